"""A call in doubt settled from outside goes on through the pydantic-ai adapter (DESIGN
§7.3): kill -9 inside ``pay``, the outcome recorded by another process
(`settle_from_outside`) or by `LedgerRun.resolve_in_doubt`, then a restarted process: the
run completes, the ``FunctionModel`` received the outcome as the call's ``ToolReturnPart``
(``outcome="failed"``, what pydantic-ai sends for a tool that raised ``ToolFailed``, for
FAILED), and the tool ran once, or a second time only after NOT_EXECUTED (counted in an
fsynced effects file)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

try:
    import pydantic_ai  # noqa: F401
except ImportError:  # pragma: no cover - CI installs the extra
    if os.environ.get("CI"):
        raise
    pytest.skip("pydantic-ai is not installed", allow_module_level=True)

from statemachine import (
    InvalidTransition,
    Resolution,
    RunController,
    SchemaError,
    SQLiteEventStore,
    Step,
)
from statemachine.adapters.pydantic_ai import LedgerRun
from statemachine.sessions import SQLiteSession
from tests.adapters.outside import settle_from_outside
from tests.drivers.effects import Effects
from tests.drivers.pydantic_ai_driver import HISTORY_ID, RUN_ID, billing
from tests.helpers import long_rows

ROOT = Path(__file__).resolve().parents[2]

# (outcome, output, the part's content and outcome the model must receive, runs of pay)
CASES = [
    pytest.param(Resolution.COMPLETED, "paid 7 (by hand)", ("paid 7 (by hand)", "success"), 1,
                 id="completed-text"),
    pytest.param(Resolution.COMPLETED, {"paid": 7, "ok": True},
                 ({"paid": 7, "ok": True}, "success"), 1, id="completed-json"),
    # an operator's JSON is the tool's return value, even shaped like the ledger's forms
    pytest.param(Resolution.COMPLETED, {"kind": "tool-failed", "message": "no"},
                 ({"kind": "tool-failed", "message": "no"}, "success"), 1,
                 id="completed-json-like-a-failure"),
    pytest.param(Resolution.FAILED, "card declined", ("card declined", "failed"), 1,
                 id="failed"),
    pytest.param(Resolution.FAILED, {"code": 402}, ('{"code": 402}', "failed"), 1,
                 id="failed-json"),
    pytest.param(Resolution.NOT_EXECUTED, None, ("paid 7", "success"), 2, id="not-executed"),
]
# CI runs these three; every row under STATEMACHINE_LONG=1 (just fuzz)
CASES = long_rows(CASES, core={"completed-text", "failed", "not-executed"})


def _driver(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tests.drivers.pydantic_ai_driver", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)


def _last_part(folder: Path) -> dict[str, Any]:
    *_, last = (folder / "bodies.jsonl").read_text().splitlines()
    [request] = json.loads(last)
    [part] = request["parts"]
    return {key: part[key] for key in ("part_kind", "tool_name", "tool_call_id", "content",
                                       "outcome")}


def _pays(folder: Path) -> list[str]:
    return [line for line in Effects(folder, "").lines() if line.endswith("tool pay")]


def _expected(content: Any, outcome: str) -> dict[str, Any]:
    return {"part_kind": "tool-return", "tool_name": "pay", "tool_call_id": "p1",
            "content": content, "outcome": outcome}


@pytest.mark.invariant("I11")
@pytest.mark.parametrize(("outcome", "output", "sent", "runs"), CASES)
def test_settled_from_outside_goes_on(tmp_path: Path, outcome: Resolution, output: Any,
                                      sent: tuple[Any, str], runs: int) -> None:
    assert _driver("crash-fresh", str(tmp_path)).returncode == -9  # killed inside pay
    settle_from_outside(tmp_path / "events.db", RUN_ID, "p1", outcome, output, "alice",
                        "ticket-9")
    resumed = _driver("resume", str(tmp_path), "second")
    assert json.loads(resumed.stdout)["outcome"] == "completed", resumed.stderr
    assert _last_part(tmp_path) == _expected(*sent)
    assert _pays(tmp_path) == ["crash tool pay", "second tool pay"][:runs]


def _open(folder: Path) -> LedgerRun:
    async def go() -> LedgerRun:
        return await LedgerRun.open(billing(Effects(folder, "ops"), tool="pay", call_id="p1",
                                            crash=False), run_id=RUN_ID,
                                    history=SQLiteSession(HISTORY_ID, folder / "history.db"),
                                    store=SQLiteEventStore(folder / "events.db"), owner="ops")
    return asyncio.run(go())


def test_ledger_run_resolves_claims_first_and_refuses_with_nothing_recorded(
        tmp_path: Path) -> None:
    assert _driver("crash-fresh", str(tmp_path)).returncode == -9
    run = _open(tmp_path)
    before = len(run.controller.events)
    store = SQLiteEventStore(tmp_path / "events.db")
    refusals: list[tuple[str, dict[str, Any], type[Exception]]] = [
        ("ghost", {}, InvalidTransition),
        ("p1", {"outcome": Resolution.NOT_EXECUTED}, SchemaError)]  # it takes no output
    for call_id, kwargs, error in refusals:
        with pytest.raises(error):
            asyncio.run(run.resolve_in_doubt(call_id, "x", **kwargs))
        assert len(RunController.load(store, RUN_ID).events) == before  # not even a claim
    asyncio.run(run.resolve_in_doubt("p1", "card declined", outcome=Resolution.FAILED,
                                     by="bob", evidence="ticket-9"))
    reloaded = RunController.load(store, RUN_ID)  # durable before it returned
    claim = reloaded.events[before]
    assert (type(claim).__name__, claim.owner) == ("RunClaimed", "bob")  # type: ignore[attr-defined]
    decision = reloaded.call("p1").decisions[-1]
    assert (decision.by, decision.outcome, decision.evidence) == (
        "bob", Resolution.FAILED, "ticket-9")
    resumed = _driver("resume", str(tmp_path), "second")
    assert json.loads(resumed.stdout)["outcome"] == "completed", resumed.stderr
    assert _last_part(tmp_path) == _expected("card declined", "failed")
    assert _pays(tmp_path) == ["crash tool pay"]


def test_ledger_run_not_executed_runs_the_tool_once_more(tmp_path: Path) -> None:
    assert _driver("crash-fresh", str(tmp_path)).returncode == -9
    run = _open(tmp_path)
    asyncio.run(run.resolve_in_doubt("p1", outcome=Resolution.NOT_EXECUTED))
    result = asyncio.run(run.run())
    assert (result.step, result.output) == (Step.COMPLETED, "done: paid 7")
    assert _pays(tmp_path) == ["crash tool pay", "ops tool pay"]


def test_ledger_run_abandons(tmp_path: Path) -> None:
    assert _driver("crash-fresh", str(tmp_path)).returncode == -9
    asyncio.run(_open(tmp_path).abandon("the bank cannot tell"))
    reloaded = RunController.load(SQLiteEventStore(tmp_path / "events.db"), RUN_ID)
    assert reloaded.step is Step.TERMINAL_UNRECOVERABLE
    assert (reloaded.events[-2].owner, reloaded.events[-1].by) == (  # type: ignore[attr-defined]
        "ops", None)  # claimed as the run's owner
    resumed = json.loads(_driver("resume", str(tmp_path), "second").stdout)
    assert (resumed["outcome"], resumed["error"]) == ("error", "RunNotResumable")
    assert _pays(tmp_path) == ["crash tool pay"]
