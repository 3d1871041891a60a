"""A call in doubt settled from outside goes on through both Anthropic runners (DESIGN
§7.3): kill -9 inside ``charge``, the outcome recorded by another process
(`settle_from_outside`) or by the adapter's own ``resolve_in_doubt``, then a restarted
process: the conversation completes, the model (or the session) received the outcome as
a ``tool_result`` (``is_error`` for FAILED), and the tool ran once, or a second time only
after NOT_EXECUTED (counted in an fsynced effects file).

Expected requests are written out from the scenario, never read from the ledger."""

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
    import anthropic  # noqa: F401
except ImportError:  # pragma: no cover - CI installs the extra
    if os.environ.get("CI"):
        raise
    pytest.skip("anthropic is not installed", allow_module_level=True)

from statemachine import (
    InvalidTransition,
    Resolution,
    RunController,
    SchemaError,
    SQLiteEventStore,
    Step,
)
from statemachine.adapters.anthropic import LedgerSessionToolRunner, MessageToolLedger
from tests.adapters.outside import settle_from_outside
from tests.drivers.anthropic_driver import (
    MESSAGES_RUN,
    SESSION_ID,
    FakeSession,
    charge_tool,
    client_for,
    fork,
    tool_use,
)
from tests.drivers.effects import Effects
from tests.helpers import long_rows

ROOT = Path(__file__).resolve().parents[2]
SESSION_RUN = f"anthropic-session:{SESSION_ID}"

# (outcome, output, the tool_result the model must receive, the runs of charge)
CASES = [
    pytest.param(Resolution.COMPLETED, "charged 7 (by hand)",
                 {"content": "charged 7 (by hand)"}, 1, id="completed-text"),
    pytest.param(Resolution.COMPLETED, {"charged": 7, "ok": True},
                 {"content": '{"charged": 7, "ok": true}'}, 1, id="completed-json"),
    pytest.param(Resolution.FAILED, "card declined",
                 {"content": "card declined", "is_error": True}, 1, id="failed"),
    pytest.param(Resolution.FAILED, {"code": 402},
                 {"content": '{"code": 402}', "is_error": True}, 1, id="failed-json"),
    pytest.param(Resolution.NOT_EXECUTED, None, {"content": "charged 7"}, 2,
                 id="not-executed"),
]
# CI runs these three; every row under STATEMACHINE_LONG=1 (just fuzz)
CASES = long_rows(CASES, core={"completed-text", "failed", "not-executed"})


def _messages(command: str, folder: Path, name: str, via: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "tests.drivers.anthropic_driver", command,
                           str(folder), name, via], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=False)
    if command == "messages-crash-tool":
        assert done.returncode == -9, done.stderr  # killed inside charge
        return {}
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def _bodies(folder: Path) -> list[list[dict[str, Any]]]:
    return [json.loads(line) for line in (folder / "bodies.jsonl").read_text().splitlines()]


def _charges(folder: Path) -> list[str]:
    return [line for line in Effects(folder, "").lines() if line.endswith("charge 7")]


@pytest.mark.invariant("I11")
@pytest.mark.parametrize("via", ["create", "runner"])
@pytest.mark.parametrize(("outcome", "output", "sent", "runs"), CASES)
def test_messages_settled_from_outside_goes_on(tmp_path: Path, via: str, outcome: Resolution,
                                               output: Any, sent: dict[str, Any],
                                               runs: int) -> None:
    _messages("messages-crash-tool", tmp_path, "first", via)
    settle_from_outside(tmp_path / "events.db", MESSAGES_RUN, "tu_1", outcome, output,
                        "alice", "ticket-9")
    resumed = _messages("messages-resume", tmp_path, "second", via)
    assert resumed["outcome"] == "done", resumed
    *_, last = _bodies(tmp_path)  # the request that carried the outcome
    assert last[-1] == {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "tu_1", **sent}]}
    assert _charges(tmp_path) == ["first charge 7", "second charge 7"][:runs]
    again = _messages("messages-resume", tmp_path, "third", via)  # answered from the record
    assert (again["outcome"], again["replayed"]) == ("done", True)
    assert _charges(tmp_path) == ["first charge 7", "second charge 7"][:runs]


@pytest.mark.invariant("I11")
@pytest.mark.parametrize(("outcome", "output", "sent", "runs"), CASES)
def test_session_runner_settled_from_outside_goes_on(tmp_path: Path, outcome: Resolution,
                                                     output: Any, sent: dict[str, Any],
                                                     runs: int) -> None:
    assert fork("crash-tool", str(tmp_path), "first") is None  # killed inside charge
    settle_from_outside(tmp_path / "events.db", SESSION_RUN, "tu_1", outcome, output,
                        "alice", "ticket-9")
    assert fork("resume", str(tmp_path), "second") == {
        "name": "second", "outcome": "done", "error": None, "posted": [True]}
    remote = json.loads((tmp_path / "remote.json").read_text())["events"]
    [landed] = [e for e in remote if e.get("custom_tool_use_id") == "tu_1"]
    text = sent["content"]
    assert {key: landed[key] for key in ("type", "content", "is_error")} == {
        "type": "user.custom_tool_result", "content": [{"type": "text", "text": text}],
        "is_error": sent.get("is_error", False)}
    assert _charges(tmp_path) == ["first charge 7", "second charge 7"][:runs]


# ---------------------------------------------------------------- the adapter's own way


def test_message_ledger_resolves_claims_and_refuses_with_nothing_recorded(
        tmp_path: Path) -> None:
    _messages("messages-crash-tool", tmp_path, "first", "create")
    store = SQLiteEventStore(tmp_path / "events.db")
    ledger = MessageToolLedger.open(MESSAGES_RUN, store=store, owner="ops")
    before = len(ledger.controller.events)
    refusals: list[tuple[str, dict[str, Any], type[Exception]]] = [
        ("tu_1", {"output": "x", "outcome": Resolution.NOT_EXECUTED}, SchemaError),
        ("tu_1", {"output": "x", "outcome": "failed"}, SchemaError),
        ("ghost", {"output": "x"}, InvalidTransition)]
    for call_id, kwargs, error in refusals:
        with pytest.raises(error):
            ledger.resolve_in_doubt(call_id, **kwargs)
        assert len(RunController.load(store, MESSAGES_RUN).events) == before  # not a claim
    ledger.resolve_in_doubt("tu_1", "card declined", outcome=Resolution.FAILED, by="bob",
                            evidence="ticket-9")
    reloaded = RunController.load(store, MESSAGES_RUN)  # durable before it returned
    claim, _resolved = reloaded.events[before:]
    assert (type(claim).__name__, claim.owner) == ("RunClaimed", "bob")  # type: ignore[attr-defined]
    decision = reloaded.call("tu_1").decisions[-1]
    assert (decision.by, decision.outcome, decision.evidence) == (
        "bob", Resolution.FAILED, "ticket-9")
    store.close()
    resumed = _messages("messages-resume", tmp_path, "second", "create")
    assert resumed["outcome"] == "done", resumed
    assert _bodies(tmp_path)[-1][-1]["content"] == [
        {"type": "tool_result", "tool_use_id": "tu_1", "content": "card declined",
         "is_error": True}]
    assert _charges(tmp_path) == ["first charge 7"]


def test_message_ledger_abandons_a_stuck_run(tmp_path: Path) -> None:
    _messages("messages-crash-tool", tmp_path, "first", "create")
    store = SQLiteEventStore(tmp_path / "events.db")
    MessageToolLedger.open(MESSAGES_RUN, store=store, owner="ops").abandon("charged twice?")
    reloaded = RunController.load(store, MESSAGES_RUN)
    assert reloaded.step is Step.TERMINAL_UNRECOVERABLE
    assert (reloaded.events[-2].owner, reloaded.events[-1].by) == (  # type: ignore[attr-defined]
        "ops", None)
    store.close()
    resumed = subprocess.run([sys.executable, "-m", "tests.drivers.anthropic_driver",
                              "messages-resume", str(tmp_path), "second", "create"],
                             cwd=ROOT, capture_output=True, text=True, timeout=120,
                             check=False)
    assert "RunNotResumable" in resumed.stderr  # refused when opened, before any request
    assert _charges(tmp_path) == ["first charge 7"]
    assert len(_bodies(tmp_path)) == 1


def test_session_runner_resolves_not_executed_then_runs_the_tool_once(tmp_path: Path) -> None:
    assert fork("crash-tool", str(tmp_path), "first") is None

    async def operator() -> None:
        server = FakeSession([tool_use("tu_1", "charge", {"x": 7})],
                             path=tmp_path / "remote.json")
        runner = await LedgerSessionToolRunner.open(
            client_for(server), SESSION_ID, tools=[charge_tool(Effects(tmp_path, "ops"))],
            store=SQLiteEventStore(tmp_path / "events.db"), owner="ops", max_idle=None)
        with pytest.raises(InvalidTransition):
            await runner.resolve_in_doubt("ghost", outcome=Resolution.NOT_EXECUTED)
        await runner.resolve_in_doubt("tu_1", outcome=Resolution.NOT_EXECUTED,
                                      evidence="no charge at the bank")
        assert [call.posted async for call in runner] == [True]

    asyncio.run(operator())
    assert _charges(tmp_path) == ["first charge 7", "ops charge 7"]
    reloaded = RunController.load(SQLiteEventStore(tmp_path / "events.db"), SESSION_RUN)
    assert reloaded.step is Step.COMPLETED
    assert [(d.by, d.outcome) for d in reloaded.call("tu_1").decisions] == [
        (None, Resolution.NOT_EXECUTED)]
    claims = [e.owner for e in reloaded.events  # type: ignore[attr-defined]
              if type(e).__name__ == "RunClaimed"]
    assert claims[-2:] == ["ops", "ops"]  # the resolution's claim, then the iteration's


def test_session_runner_abandons(tmp_path: Path) -> None:
    assert fork("crash-tool", str(tmp_path), "first") is None

    async def operator() -> None:
        server = FakeSession([tool_use("tu_1", "charge", {"x": 7})],
                             path=tmp_path / "remote.json")
        runner = await LedgerSessionToolRunner.open(
            client_for(server), SESSION_ID, tools=[charge_tool(Effects(tmp_path, "ops"))],
            store=SQLiteEventStore(tmp_path / "events.db"), max_idle=None)
        await runner.abandon("the bank cannot tell", by="carol")

    asyncio.run(operator())
    reloaded = RunController.load(SQLiteEventStore(tmp_path / "events.db"), SESSION_RUN)
    assert reloaded.step is Step.TERMINAL_UNRECOVERABLE
    assert (reloaded.events[-2].owner, reloaded.events[-1].by) == (  # type: ignore[attr-defined]
        "carol", "carol")
