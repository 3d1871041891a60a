"""Settling a call in doubt (DESIGN §7.3): `Resolution` COMPLETED, FAILED and NOT_EXECUTED,
recorded with who, when and the evidence, and checked again on replay."""

from __future__ import annotations

import json
from typing import Any

import pytest

from statemachine import (
    Execute,
    InvalidTransition,
    MemoryEventStore,
    Phase,
    RecoveryPolicy,
    Resolution,
    RunController,
    SchemaError,
    Step,
    ToolCall,
    ToolInDoubt,
)
from statemachine import events as ev
from statemachine.testing import InvariantViolation, check_log
from tests.helpers import at_interruption, tools_run


def _charge_in_doubt(store: MemoryEventStore | None = None) -> RunController:
    """The seed's charge approved by alice, started, then the process died: a reloaded
    controller sees it in doubt."""
    c = at_interruption(store=store)
    c.approve("charge", fingerprint=c.fingerprint("charge"), by="alice")
    c.reject("notify", "no")
    c.reject("audit", "no")
    c.resume()
    c.begin_tool("charge")
    again = (RunController.load(store, c.run_id) if store is not None
             else RunController.from_json(c.to_json()))
    assert again.in_doubt() == ("charge",)
    return again


def _state(c: RunController) -> tuple[Any, ...]:
    return (c.events, c.step, c.envelope, c.pending_approvals, c.calls)


@pytest.mark.invariant("I11")
def test_not_executed_gives_the_call_back_with_its_approval_kept() -> None:
    c = _charge_in_doubt()
    c.resolve_in_doubt("charge", outcome=Resolution.NOT_EXECUTED, by="bob",
                       evidence="no charge in the ledger")
    assert c.phase("charge") is Phase.APPROVED
    assert c.in_doubt() == ()
    view = c.call("charge")
    assert view.result is None
    assert view.starts == 1
    assert [(d.kind, d.by, d.outcome, d.evidence) for d in view.decisions] == [
        ("approved", "alice", None, None),
        ("resolved", "bob", Resolution.NOT_EXECUTED, "no charge in the ledger")]
    assert c.resume().value == "run_tools"
    decision = c.begin_tool("charge")
    assert isinstance(decision, Execute)
    assert decision.call.arguments == {"x": 7}
    c.tool_completed("charge", "charged 7")
    assert c.call("charge").starts == 2
    check_log(c.events)  # a second start after NOT_EXECUTED is not a re-run
    again = RunController.from_json(json.dumps(c.to_json()))
    assert again.calls == c.calls
    assert again.step is c.step


@pytest.mark.invariant("I11")
def test_a_call_given_back_that_crashes_again_is_in_doubt_again() -> None:
    store = MemoryEventStore()
    c = _charge_in_doubt(store)
    c.resolve_in_doubt("charge", outcome=Resolution.NOT_EXECUTED, by="bob")
    c.begin_tool("charge")  # and the process dies again
    again = RunController.load(store, c.run_id)
    with pytest.raises(ToolInDoubt):
        again.begin_tool("charge")
    again.resolve_in_doubt("charge", "charged 7", by="carol", evidence="ch_1")
    kinds = [(d.kind, d.by, d.outcome) for d in again.call("charge").decisions]
    assert kinds == [("approved", "alice", None), ("resolved", "bob", Resolution.NOT_EXECUTED),
                     ("resolved", "carol", Resolution.COMPLETED)]
    check_log(again.events)


@pytest.mark.parametrize("outcome", [Resolution.COMPLETED, Resolution.FAILED])
def test_completed_and_failed_cache_what_the_model_sees(outcome: Resolution) -> None:
    c = _charge_in_doubt()
    c.resolve_in_doubt("charge", "the answer", outcome=outcome, by="bob", evidence="t-9")
    assert c.phase("charge") is Phase.COMPLETED
    assert c.call("charge").result == "the answer"
    last = c.events[-1]
    assert isinstance(last, ev.InDoubtResolved)
    assert (last.outcome, last.by, last.evidence, type(last.at)) == (outcome, "bob", "t-9", int)
    assert c.begin_tool("charge").result == "the answer"  # type: ignore[union-attr]
    assert RunController.from_json(c.to_json()).call("charge").decisions[-1].outcome is outcome


def test_the_old_call_keeps_its_meaning() -> None:
    c = _charge_in_doubt()
    c.resolve_in_doubt("charge", "charged 7")
    last = c.events[-1]
    assert isinstance(last, ev.InDoubtResolved)
    assert (last.outcome, last.by, last.evidence) == (Resolution.COMPLETED, None, None)


@pytest.mark.parametrize(("kwargs", "error", "words"), [
    ({"output": "x", "outcome": Resolution.NOT_EXECUTED}, SchemaError, "takes no output"),
    ({"outcome": "completed"}, SchemaError, "must be a Resolution"),
    ({"outcome": None}, SchemaError, "must be a Resolution"),
    ({"evidence": 7}, SchemaError, "evidence"),
    ({"evidence": "bad\ud800"}, SchemaError, "evidence"),
    ({"by": ["bob"]}, SchemaError, "by"),
])
def test_bad_arguments_are_refused_with_nothing_recorded(
        kwargs: dict[str, Any], error: type[Exception], words: str) -> None:
    c = _charge_in_doubt()
    before = _state(c)
    with pytest.raises(error, match=words):
        c.resolve_in_doubt("charge", **kwargs)
    assert _state(c) == before


@pytest.mark.parametrize("outcome", list(Resolution))
def test_only_a_call_in_doubt_can_be_resolved(outcome: Resolution) -> None:
    output = None if outcome is Resolution.NOT_EXECUTED else "x"
    c = tools_run(ToolCall("pay", "pay", {}), ToolCall("look", "look", {}))
    c.begin_tool("pay")
    c.tool_completed("pay", "paid")
    for call_id in ("pay", "look", "ghost"):  # completed, never started, unknown
        before = _state(c)
        with pytest.raises(InvalidTransition):
            c.resolve_in_doubt(call_id, output, outcome=outcome)
        assert _state(c) == before


def _forged_resolution(c: RunController, **fields: Any) -> dict[str, Any]:
    doc: dict[str, Any] = c.to_json()
    doc["events"].append({"type": "InDoubtResolved", "seq": c.version, "at": None, "by": None,
                          "call_id": "charge", "output": None, "evidence": None, **fields})
    return doc


@pytest.mark.invariant("I10")
def test_replay_checks_every_resolution() -> None:
    c = _charge_in_doubt()
    ok = RunController.from_json(_forged_resolution(c, outcome="not_executed"))
    assert ok.phase("charge") is Phase.APPROVED
    with pytest.raises(SchemaError, match="not a Resolution value"):
        RunController.from_json(_forged_resolution(c, outcome="maybe"))
    doc = _forged_resolution(c, outcome="completed")
    del doc["events"][-1]["evidence"]
    with pytest.raises(SchemaError, match="lacks field"):
        RunController.from_json(doc)
    with pytest.raises(InvalidTransition, match="resolution_fits"):
        RunController.from_json(_forged_resolution(c, outcome="not_executed", output="x"))
    # given back, the call is no longer in doubt: a second NOT_EXECUTED is forged
    twice = ok.to_json()
    twice["events"].append({**twice["events"][-1], "seq": ok.version})
    with pytest.raises(InvalidTransition, match="call_started"):
        RunController.from_json(twice)


def test_the_log_checker_allows_one_more_start_per_not_executed_only() -> None:
    call = ToolCall("c", "pay", {})
    proposed = [ev.RunStarted(0, "r", None, RecoveryPolicy.RECONCILE, None, "json"),
                ev.ModelCallBegun(1), ev.ModelResponded(2, (call,), None)]
    given_back = ev.InDoubtResolved(4, "c", None, outcome=Resolution.NOT_EXECUTED)
    check_log([*proposed, ev.ToolStarted(3, "c"), given_back, ev.ToolStarted(5, "c")])
    with pytest.raises(InvariantViolation, match="I11"):
        check_log([*proposed, ev.ToolStarted(3, "c"), ev.ToolStarted(4, "c")])
    with pytest.raises(InvariantViolation, match="I11"):
        check_log([*proposed, ev.ToolStarted(3, "c"), given_back, ev.ToolStarted(5, "c"),
                   ev.ToolStarted(6, "c")])
    with pytest.raises(InvariantViolation, match="I11"):  # given back before any start
        check_log([*proposed, ev.InDoubtResolved(3, "c", None, outcome=Resolution.NOT_EXECUTED),
                   ev.ToolStarted(4, "c"), ev.ToolStarted(5, "c")])


def test_a_store_keeps_the_outcome_through_a_reload(tmp_path: Any) -> None:
    from statemachine import SQLiteEventStore

    store = SQLiteEventStore(tmp_path / "runs.db")
    c = at_interruption(store=store)
    c.approve("charge")
    c.reject("notify", "no")
    c.reject("audit", "no")
    c.resume()
    c.begin_tool("charge")
    again = RunController.load(store, c.run_id)
    again.resolve_in_doubt("charge", outcome=Resolution.NOT_EXECUTED, by="bob", evidence="e")
    loaded = RunController.load(store, c.run_id)
    assert loaded.phase("charge") is Phase.APPROVED
    assert loaded.call("charge").decisions[-1].evidence == "e"
    assert loaded.step is Step.TOOLS
