"""Shared scenario builders, the refusal check and the crash tests' folder, used across
the tests."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import pytest

from statemachine import RecoveryPolicy, RunController, Step, ToolCall
from statemachine.testing import contracts

if TYPE_CHECKING:
    from collections.abc import Callable

    from statemachine.payloads import JSON
    from statemachine.stores import EventStore

E = TypeVar("E", bound=BaseException)
TEST_NOW = 1_767_225_600_000_000
"""2026-01-01T00:00:00Z, in microseconds since the Unix epoch: the ``at`` of every event a
test records without a clock of its own (tests/conftest.py)."""
SESSION = "session-1"
P: list[Any] = [{"role": "user", "content": "charge me 7 and notify me"}]
CHARGE_CALL = {"type": "function_call", "call_id": "charge", "name": "charge"}
CHARGE_OUT = {"type": "function_call_output", "call_id": "charge", "output": "charged 7"}
AUDIT_OUT = {"type": "function_call_output", "call_id": "audit", "output": "logged"}
B: list[Any] = [CHARGE_CALL, CHARGE_OUT, AUDIT_OUT]


def snapshot(c: RunController) -> tuple[Any, ...]:
    """Everything a refusal must leave exactly as it was."""
    return (c.events, c.step, c.envelope, c.pending_approvals, c.guardrail_results,
            c.state.view(), c.holds_attempt, c.in_doubt())


def assert_refused(
    c: RunController, error: type[E], command: Callable[..., Any], *args: Any, **kwargs: Any,
) -> E:
    """Run ``command``, expect ``error``, and check that nothing changed."""
    before = snapshot(c)
    with pytest.raises(error) as info:
        command(*args, **kwargs)
    assert snapshot(c) == before
    assert type(info.value) is error, f"expected {error.__name__}, got {info.value!r}"
    return info.value


def at_interruption(
    policy: RecoveryPolicy = RecoveryPolicy.RECONCILE, store: EventStore | None = None,
    run_id: str = "run-1",
) -> RunController:
    """The seed's model response: charge(x=7), notify() and audit(), all approval-gated."""
    return contracts.at_interruption(store, run_id, SESSION, policy)


def run_charge(c: RunController) -> None:
    """Approve charge and audit (not notify), run both with guardrails and hooks."""
    c.approve("charge", fingerprint=c.fingerprint("charge"))
    c.approve("audit")
    c.resume()
    c.begin_tool("charge")
    c.guardrail_evaluated("charge_input", {"allowed": True}, stage="tool_input",
                          call_id="charge")
    c.hook_ran("tool_start", call_id="charge")
    c.tool_completed("charge", "charged 7")
    c.hook_ran("tool_end", call_id="charge")
    c.guardrail_evaluated("charge_output", {"allowed": True}, stage="tool_output",
                          call_id="charge")
    c.begin_tool("audit")
    c.tool_completed("audit", "logged")


def staged(policy: RecoveryPolicy = RecoveryPolicy.RECONCILE,
           store: EventStore | None = None) -> RunController:
    """The seed run with its resumed batch staged (the write is about to happen)."""
    c = at_interruption(policy, store)
    run_charge(c)
    c.stage_publication(B, P, call_ids=["charge", "audit"])
    return c


def tools_run(*calls: ToolCall) -> RunController:
    """A run whose model proposed ``calls``, in TOOLS (none of them approval-gated)."""
    c = RunController.start(run_id="forge", session_id=SESSION)
    c.begin_model_call()
    c.model_responded(list(calls))
    assert c.step is Step.TOOLS
    return c


def staged_over(history: list[JSON], items: list[JSON], *, whole: bool = False
                ) -> RunController:
    """A run that recorded ``items`` as input and staged them over ``history``."""
    c = RunController.start(run_id="forge", session_id=SESSION)
    c.add_input(items)
    c.stage_publication(items, history, whole=whole)
    return c


def failed(policy: RecoveryPolicy = RecoveryPolicy.RECONCILE) -> RunController:
    """The seed run after its write raised, reported as failed."""
    c = staged(policy)
    c.publication_failed(RuntimeError("injected ambiguous write failure"))
    return c


def reloaded(c: RunController) -> RunController:
    return RunController.from_json(c.to_json())


@contextlib.contextmanager
def crash_folder(tmp_path_factory: pytest.TempPathFactory, prefix: str) -> Iterator[Path]:
    """Where a module's kill -9 trials write: ``CRASH_DIR`` when set (a real disk, say),
    else ``/dev/shm`` when writable (the trials fsync often), else pytest's temp dir."""
    where = os.environ.get("CRASH_DIR")
    if where is None and os.access("/dev/shm", os.W_OK):
        where = "/dev/shm"
    if where is None:
        yield tmp_path_factory.mktemp(prefix)
        return
    with tempfile.TemporaryDirectory(prefix=f"{prefix}-", dir=where) as folder:
        yield Path(folder)


StoreMaker = Callable[[], Any]
"""Opens the store under test again (the storage tests' ``make`` fixture)."""

LONG = os.environ.get("STATEMACHINE_LONG") == "1"
"""Whether every row of the slow subprocess matrices runs (``just fuzz`` sets
``STATEMACHINE_LONG=1``); CI runs the rows each matrix names as its core, so that
``.ci/run`` stays within its time."""


def long_rows(rows: Sequence[Any], *, core: Collection[str]) -> list[Any]:
    """``rows`` (pytest params with ids, or plain values) as CI runs them: every row when
    `LONG`, else those whose id (or value) is in ``core``."""
    if LONG:
        return list(rows)
    return [row for row in rows if (row.id if hasattr(row, "id") else row) in core]


def missing_extra(extra: str) -> None:
    """Called in the ``except ImportError`` of a test module's import of an adapter's SDK:
    skip the module, naming the extra that installs it; under CI (``CI`` set) re-raise
    the ImportError instead, since a skip there would hide the adapter's tests."""
    if os.environ.get("CI"):
        raise  # noqa: PLE0704 - the caller's ImportError, being handled
    pytest.skip(f"{extra} is not installed (pip install -e '.[{extra}]')",
                allow_module_level=True)
