"""A call in doubt settled from outside goes on through the openai-agents adapter (DESIGN
§7.3): kill -9 inside the tool, the outcome recorded by another process
(`settle_from_outside`) or by `AgentRun.resolve_in_doubt`, then a restarted process: the
run completes, the scripted model received the outcome as the call's function-call output
item (the SDK's own conversion of a tool's return value of that shape), and the tool ran
once, or a second time only after NOT_EXECUTED (counted in an fsynced effects file)."""

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
    import agents  # noqa: F401
except ImportError:  # pragma: no cover - CI installs the extra
    if os.environ.get("CI"):
        raise
    pytest.skip("openai-agents is not installed", allow_module_level=True)

from agents import SQLiteSession

from statemachine import InvalidTransition, Resolution, RunController, SQLiteEventStore, Step
from statemachine.adapters.openai_agents import AgentRun
from tests.adapters.outside import settle_from_outside
from tests.drivers.effects import Effects
from tests.drivers.openai_agents_driver import RUN_ID, SESSION_ID, agent
from tests.helpers import long_rows

ROOT = Path(__file__).resolve().parents[2]

# (outcome, output, the output the model must receive, the runs of the tool)
CASES = [
    pytest.param(Resolution.COMPLETED, "paid 7 (by hand)", "paid 7 (by hand)", 1,
                 id="completed-text"),
    # the SDK sends a dict a tool returned as its str()
    pytest.param(Resolution.COMPLETED, {"paid": 7, "ok": True}, "{'paid': 7, 'ok': True}", 1,
                 id="completed-json"),
    pytest.param(Resolution.FAILED, "card declined", "card declined", 1, id="failed"),
    pytest.param(Resolution.NOT_EXECUTED, None, "paid 7", 2, id="not-executed"),
]
# CI runs these three; every row under STATEMACHINE_LONG=1 (just fuzz)
CASES = long_rows(CASES, core={"completed-text", "failed", "not-executed"})


def _driver(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tests.drivers.openai_agents_driver", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)


def _last_input(folder: Path) -> list[Any]:
    *_, last = (folder / "bodies.jsonl").read_text().splitlines()
    return json.loads(last)  # type: ignore[no-any-return]


def _runs(folder: Path, tool: str) -> list[str]:
    return [line for line in Effects(folder, "").lines() if line.endswith(f"tool {tool}")]


@pytest.mark.invariant("I11")
@pytest.mark.parametrize(("outcome", "output", "sent", "runs"), CASES)
def test_settled_from_outside_goes_on(tmp_path: Path, outcome: Resolution, output: Any,
                                      sent: str, runs: int) -> None:
    assert _driver("crash-fresh", str(tmp_path)).returncode == -9  # killed inside pay
    settle_from_outside(tmp_path / "events.db", RUN_ID, "p1", outcome, output, "alice",
                        "ticket-9")
    resumed = _driver("resume", str(tmp_path), "second")
    assert json.loads(resumed.stdout)["outcome"] == "completed", resumed.stderr
    assert _last_input(tmp_path)[-1] == {"call_id": "p1", "output": sent,
                                         "type": "function_call_output"}
    assert _runs(tmp_path, "pay") == ["crash tool pay", "second tool pay"][:runs]


@pytest.mark.invariant("I11")
def test_not_executed_keeps_the_approval_and_runs_the_approved_call_once(
        tmp_path: Path) -> None:
    assert _driver("pause", str(tmp_path)).returncode == 0  # charge approved
    assert _driver("crash", str(tmp_path)).returncode == -9  # killed inside charge
    settle_from_outside(tmp_path / "events.db", RUN_ID, "c1", Resolution.NOT_EXECUTED, None,
                        "alice", None)
    resumed = _driver("resume", str(tmp_path), "second")
    assert json.loads(resumed.stdout)["outcome"] == "completed", resumed.stderr
    assert _last_input(tmp_path)[-1] == {"call_id": "c1", "output": "charged 7",
                                         "type": "function_call_output"}
    assert _runs(tmp_path, "charge") == ["crash tool charge", "second tool charge"]


def _open(folder: Path, owner: str | None = "ops") -> AgentRun:
    async def go() -> AgentRun:
        return await AgentRun.open(agent(Effects(folder, "ops"), responses=[], crash=False),
                                   run_id=RUN_ID,
                                   session=SQLiteSession(SESSION_ID, folder / "session.db"),
                                   store=SQLiteEventStore(folder / "events.db"), owner=owner)
    return asyncio.run(go())


def test_agent_run_resolves_claims_first_and_refuses_with_nothing_recorded(
        tmp_path: Path) -> None:
    assert _driver("crash-fresh", str(tmp_path)).returncode == -9
    run = _open(tmp_path)
    before = len(run.controller.events)
    with pytest.raises(InvalidTransition):
        asyncio.run(run.resolve_in_doubt("ghost", "x"))
    store = SQLiteEventStore(tmp_path / "events.db")
    assert len(RunController.load(store, RUN_ID).events) == before  # not even a claim
    asyncio.run(run.resolve_in_doubt("p1", "card declined", outcome=Resolution.FAILED,
                                     evidence="ticket-9"))
    reloaded = RunController.load(store, RUN_ID)  # durable before it returned
    claim = reloaded.events[before]
    assert (type(claim).__name__, claim.owner) == ("RunClaimed", "ops")  # type: ignore[attr-defined]
    decision = reloaded.call("p1").decisions[-1]
    assert (decision.by, decision.outcome, decision.evidence) == (
        None, Resolution.FAILED, "ticket-9")
    resumed = _driver("resume", str(tmp_path), "second")
    assert json.loads(resumed.stdout)["outcome"] == "completed", resumed.stderr
    assert _last_input(tmp_path)[-1]["output"] == "card declined"
    assert _runs(tmp_path, "pay") == ["crash tool pay"]


def test_agent_run_abandons(tmp_path: Path) -> None:
    assert _driver("crash-fresh", str(tmp_path)).returncode == -9
    asyncio.run(_open(tmp_path).abandon("the bank cannot tell", by="carol"))
    reloaded = RunController.load(SQLiteEventStore(tmp_path / "events.db"), RUN_ID)
    assert reloaded.step is Step.TERMINAL_UNRECOVERABLE
    assert (reloaded.events[-2].owner, reloaded.events[-1].by) == (  # type: ignore[attr-defined]
        "carol", "carol")
    resumed = json.loads(_driver("resume", str(tmp_path), "second").stdout)
    assert (resumed["outcome"], resumed["error"]) == ("error", "RunNotResumable")
    assert _runs(tmp_path, "pay") == ["crash tool pay"]
