"""The declaration itself, and the differential test: the compiled table the controller
runs agrees with a plain `transitions.Machine` built from the same declaration on every
event sequence."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, target
from hypothesis import strategies as st
from transitions.core import MachineError

from statemachine import events as ev
from statemachine.envelope import measure_frontier
from statemachine.machine import (
    GUARDS,
    NEUTRAL_TRIGGERS,
    SETTLING_TRIGGERS,
    TABLE,
    TRANSITIONS,
    TRIGGERS,
    GuardAdapter,
    Refused,
    build_transitions_machine,
    fire,
)
from statemachine.payloads import digests
from statemachine.state import RunState
from statemachine.values import (
    LIVE_STEPS,
    TERMINAL_STEPS,
    GuardrailResult,
    RecoveryPolicy,
    Step,
    ToolCall,
)


def test_every_guard_is_declared_and_documented() -> None:
    used = {g for t in TRANSITIONS for g in t.guards}
    assert used <= set(GUARDS)
    assert set(GUARDS) <= used, "a guard nothing uses"
    assert all(GUARDS[g].__doc__ for g in used)


@pytest.mark.invariant("I9")
def test_terminal_steps_have_no_way_out() -> None:
    assert not [key for key in TABLE if key[0] in TERMINAL_STEPS]


@pytest.mark.invariant("I2")
def test_unsettled_accepts_only_settling_and_neutral_triggers() -> None:
    assert {trigger for step, trigger in TABLE if step is Step.UNSETTLED} == (
        SETTLING_TRIGGERS | NEUTRAL_TRIGGERS)
    assert not SETTLING_TRIGGERS & NEUTRAL_TRIGGERS


def test_neutral_triggers_stay_in_every_live_step() -> None:
    for trigger in NEUTRAL_TRIGGERS:
        for step in LIVE_STEPS:
            assert [dest for _, dest in TABLE[(step, trigger)]] == [None]
        assert not [key for key in TABLE if key[1] == trigger and key[0] not in LIVE_STEPS]


def test_every_live_step_can_be_abandoned() -> None:
    assert all((step, "abandon") in TABLE for step in LIVE_STEPS)


def test_every_event_class_fires_a_declared_trigger() -> None:
    assert {cls.TRIGGER for cls in ev.EVENT_TYPES} - {"start"} == set(TRIGGERS)


# ------------------------------------------------------------------ differential

CALL_IDS = ("a", "b", "c")
ITEMS = ({"i": 1}, {"i": 2}, {"call_id": "a"}, {"call_id": "b"})


@st.composite
def events_for(draw: st.DrawFn, state: RunState, seq: int) -> ev.Event:
    """A plausible event for ``state``: mostly well-formed, sometimes not."""
    kind = draw(st.sampled_from([cls for cls in ev.EVENT_TYPES if cls is not ev.RunStarted]))
    call_id = draw(st.sampled_from(CALL_IDS))
    if kind in (ev.ModelResponded, ev.ToolCallsReceived):
        ids = draw(st.lists(st.sampled_from((*CALL_IDS, "d", "e")), max_size=3))
        calls = tuple(ToolCall(i, "t", {"n": n}, draw(st.booleans()), draw(st.booleans()))
                      for n, i in enumerate(ids))
        if kind is ev.ToolCallsReceived:
            return ev.ToolCallsReceived(seq, calls)
        return ev.ModelResponded(seq, calls, draw(st.sampled_from([None, "out"])))
    if kind in (ev.CallApproved, ev.CallRejected):
        record = state.calls.get(call_id)
        fingerprint = record.fingerprint if record and draw(st.booleans()) else "f"
        if kind is ev.CallApproved:
            return ev.CallApproved(seq, call_id, fingerprint)
        return ev.CallRejected(seq, call_id, fingerprint, "no")
    if kind in (ev.ToolStarted, ev.ResultPosted):
        return kind(seq, call_id)
    if kind is ev.ResultPostFailed:
        return ev.ResultPostFailed(seq, call_id, "OSError")
    if kind in (ev.ToolCompleted, ev.InDoubtResolved):
        return kind(seq, call_id, "out")
    if kind is ev.GuardrailEvaluated:
        stage = draw(st.sampled_from(["input", "output", "tool_input", "tool_output", "x"]))
        cid = draw(st.sampled_from([None, call_id]))
        return ev.GuardrailEvaluated(seq, GuardrailResult(draw(st.sampled_from("gh")), stage,
                                                          cid, True))
    if kind is ev.HookRan:
        hook = draw(st.sampled_from(["agent_start", "model_end", "tool_start", "nope"]))
        return ev.HookRan(seq, hook, draw(st.sampled_from([None, call_id])))
    if kind is ev.PublicationStaged:
        items = tuple(draw(st.lists(st.sampled_from(ITEMS), max_size=3)))
        listed = tuple(draw(st.lists(st.sampled_from(CALL_IDS), max_size=2, unique=True)))
        history = draw(st.lists(st.sampled_from(ITEMS), max_size=4))
        batch = digests(items, state.form)
        frontier = measure_frontier(history, batch, state.form, whole=True)
        assert frontier is not None
        continuation = (state.continuation_after(listed) if draw(st.booleans())
                        else draw(st.sampled_from(list(Step))))
        return ev.PublicationStaged(seq, state.session_id, items, listed, frontier.read_limit,
                                    frontier.digests, frontier.whole, batch, continuation)
    if kind in (ev.ReconciledAppend, ev.ReconciledAcknowledge):
        return kind(seq, draw(st.booleans()))
    if kind is ev.FinalOutputAccepted:
        return ev.FinalOutputAccepted(seq, "out", draw(st.booleans()))
    if kind is ev.HandedOff:
        return ev.HandedOff(seq, "other")
    if kind in (ev.ModelFailed, ev.PublicationFailed):
        return kind(seq, "RuntimeError")
    if kind is ev.InputAdded:
        return ev.InputAdded(seq, ({"role": "user"},))
    if kind is ev.Abandoned:
        return ev.Abandoned(seq, "why")
    if kind is ev.RunClaimed:
        return ev.RunClaimed(seq, draw(st.sampled_from([None, "worker-1"])))
    return kind(seq)


def _transitions_verdict(machine: Any, machine_model: GuardAdapter, state: RunState,
                         event: ev.Event) -> Step | None:
    machine_model.run_state = state
    machine.set_state(state.step.value, machine_model)
    try:
        moved = getattr(machine_model, "trigger")(event.TRIGGER, event=event)  # noqa: B009
    except MachineError:
        return None
    return Step(machine_model.step_value) if moved else None


@pytest.mark.invariant("I10")
@given(st.data(), st.sampled_from([None, "s"]), st.sampled_from(list(RecoveryPolicy)),
       st.sampled_from([None, 1, 2]))
def test_differential_table_equals_transitions(
    data: st.DataObject, session_id: str | None, policy: RecoveryPolicy, max_turns: int | None,
) -> None:
    state = RunState(ev.RunStarted(0, "r", session_id, policy, max_turns, "json"))
    model = GuardAdapter(state)
    machine = build_transitions_machine(model)
    accepted = 0
    for seq in range(1, 60):
        event = data.draw(events_for(state, seq))
        try:
            ours: Step | None = fire(state, event.TRIGGER, event)
        except Refused:
            ours = None
        theirs = _transitions_verdict(machine, model, state, event)
        assert ours == theirs, (type(event).__name__, state.step, ours, theirs)
        if ours is not None:
            state.apply(event, ours)
            accepted += 1
    target(float(accepted))
