"""A store for the console's tests, built by hand so what the pages must show is known
apart from what the library computes: which runs wait on whom, and on what."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from statemachine import RunController, SQLiteEventStore, ToolCall
from tests import helpers

HOSTILE = '</code></td><script>alert("x")</script><img src=x onerror=alert(1)>&amp;'
"""A text no page may ever show unescaped."""


@attrs.frozen
class Seeded:
    path: Path
    approvals: dict[tuple[str, str], str]
    """(run, call) -> tool, of every call awaiting a decision."""
    in_doubt: dict[tuple[str, str], str]
    """(run, call) -> tool, of every call in doubt."""
    runs: dict[str, str]
    """run -> the step's name it was left in."""


def seed(folder: Path, *, hostile: bool = False) -> Seeded:
    """A SQLite store (``events.db`` in ``folder``) holding what `seed_into` writes."""
    path = folder / "events.db"
    store = SQLiteEventStore(path)
    try:
        approvals, in_doubt, runs = seed_into(store, hostile=hostile)
    finally:
        store.close()
    return Seeded(path, approvals, in_doubt, runs)


Found = tuple[dict[tuple[str, str], str], dict[tuple[str, str], str], dict[str, str]]


def seed_into(store: Any, *, hostile: bool = False) -> Found:
    """A completed run, a call in doubt, two calls awaiting a decision in one run, one in
    another, an unsettled publication and an abandoned run, in ``store``; with
    ``hostile`` every id, name, argument and reason is `HOSTILE`-laced. The approvals,
    calls in doubt and runs, as `Seeded` has them."""
    h = HOSTILE if hostile else ""
    runs: dict[str, str] = {}
    approvals: dict[tuple[str, str], str] = {}
    in_doubt: dict[tuple[str, str], str] = {}

    done = RunController.start(run_id=f"done{h}", session_id=None, store=store)
    done.begin_model_call()
    done.model_responded(output=f"all done{h}")
    done.accept_final_output(f"all done{h}")
    done.complete()
    runs[done.run_id] = "COMPLETED"

    crashed = RunController.start(run_id=f"order-17{h}", session_id=f"s{h}", store=store)
    crashed.claim(f"worker-3{h}")
    crashed.begin_model_call()
    crashed.model_responded([ToolCall(f"charge{h}", f"charge_card{h}",
                                      {"amount": 7, "note": h or "x" * 300})])
    crashed.begin_tool(f"charge{h}")  # ... and the worker died here
    runs[crashed.run_id] = "TOOLS"
    in_doubt[(crashed.run_id, f"charge{h}")] = f"charge_card{h}"

    two = RunController.start(run_id=f"order-18{h}", session_id=None, store=store)
    two.begin_model_call()
    two.model_responded([ToolCall("refund", "refund", {"amount": 12, "why": h},
                                  needs_approval=True),
                         ToolCall(f"email{h}", "send_email", {"to": "ann"},
                                  needs_approval=True)])
    runs[two.run_id] = "INTERRUPTION"
    approvals[(two.run_id, "refund")] = "refund"
    approvals[(two.run_id, f"email{h}")] = "send_email"

    one = RunController.start(run_id="order-19", session_id=None, store=store)
    one.begin_model_call()
    one.model_responded([ToolCall("wire", "wire", {"to": "bob"}, needs_approval=True)])
    runs[one.run_id] = "INTERRUPTION"
    approvals[("order-19", "wire")] = "wire"

    unsettled = helpers.staged(store=store)
    unsettled.publication_failed(RuntimeError("injected ambiguous write failure"))
    runs[unsettled.run_id] = "UNSETTLED"
    # the seed approves charge and audit, not notify: it still awaits a decision, which
    # the inbox lists (the next attempt reconciles first, then someone must decide)
    approvals[(unsettled.run_id, "notify")] = "notify"

    gone = RunController.start(run_id="gone", session_id=None, store=store)
    gone.abandon(f"customer left{h}", by=f"ops{h}")
    runs["gone"] = "TERMINAL_UNRECOVERABLE"

    return approvals, in_doubt, runs
