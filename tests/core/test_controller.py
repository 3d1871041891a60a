"""The embedding API beyond the invariants: error order and context, turns, hooks and
guardrails once each, final outputs, handoffs, batches, stores, limits and logging."""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from statemachine import (
    Action,
    ConcurrencyConflict,
    Execute,
    InvalidTransition,
    MemoryEventStore,
    PublicationUnsettled,
    RunController,
    RunNotFound,
    RunNotResumable,
    SchemaError,
    SessionWrite,
    Step,
    ToolCall,
    ToolInDoubt,
    disable_logging,
    enable_logging,
)
from statemachine import events as ev
from statemachine.payloads import JSON
from statemachine.stores import Snapshot
from statemachine.values import Phase
from tests.helpers import (
    SESSION,
    B,
    P,
    assert_refused,
    at_interruption,
    reloaded,
    staged,
    tools_run,
)


def _finalizing(session_id: str | None = SESSION, **kw: object) -> RunController:
    c = RunController.start(run_id="fin", session_id=session_id, **kw)  # type: ignore[arg-type]
    c.begin_model_call()
    c.model_responded([], output="the answer")
    return c


# ---------------------------------------------------------------- errors


def test_errors_name_run_step_and_action() -> None:
    c = at_interruption()
    error = assert_refused(c, InvalidTransition, c.begin_model_call)
    assert (error.run_id, error.step, error.action) == ("run-1", Step.INTERRUPTION,
                                                        "begin_model_call")
    assert "run 'run-1'" in str(error)
    assert "INTERRUPTION" in str(error)
    assert "begin_model_call" in str(error)


def test_first_failing_check_wins() -> None:
    c = at_interruption()
    c.abandon("done")
    assert_refused(c, RunNotResumable, c.add_input, [float("nan")])
    c = staged()
    assert_refused(c, PublicationUnsettled, c.approve, 7)
    c = at_interruption()
    assert_refused(c, SchemaError, c.begin_tool, 7)  # also not runnable here
    c = RunController.start(run_id="x", session_id=None)
    c.begin_model_call()
    c.model_responded([ToolCall("pay", "pay", {})])
    c.begin_tool("pay")
    c = reloaded(c)
    assert_refused(c, ToolInDoubt, c.begin_tool, "pay")
    assert_refused(c, SchemaError, c.begin_tool, None)


def test_start_validates_its_arguments() -> None:
    with pytest.raises(SchemaError):
        RunController.start(run_id="", session_id=None)
    with pytest.raises(SchemaError):
        RunController.start(run_id="r", session_id=3)  # type: ignore[arg-type]
    with pytest.raises(SchemaError):
        RunController.start(run_id="r", session_id=None, max_turns=-1)
    with pytest.raises(SchemaError):
        RunController.start(run_id="r", session_id=None, policy="reconcile")  # type: ignore[arg-type]


# ---------------------------------------------------------------- the model


def test_max_turns_refuses_the_model_call_and_names_it() -> None:
    c = RunController.start(run_id="t", session_id=None, max_turns=1)
    c.begin_model_call()
    c.model_failed(TimeoutError("slow"))
    assert c.events[-1].error == "TimeoutError"  # type: ignore[attr-defined]
    c.begin_model_call()
    c.model_responded([ToolCall("a", "t", {})])
    c.begin_tool("a")
    c.tool_completed("a", "x")
    c.stage_publication([{"call_id": "a", "output": "x"}], [], call_ids=["a"])
    c.publication_committed()
    assert c.step is Step.RUN_AGAIN
    assert c.next_action() is Action.CALL_MODEL
    error = assert_refused(c, InvalidTransition, c.begin_model_call)
    assert "max_turns" in str(error)
    c.abandon("max_turns")
    assert c.step is Step.TERMINAL_UNRECOVERABLE


def test_a_response_needs_calls_or_an_output() -> None:
    c = RunController.start(run_id="t", session_id=None)
    c.begin_model_call()
    assert_refused(c, InvalidTransition, c.model_responded, [], None)
    assert_refused(c, InvalidTransition, c.model_responded,
                   [ToolCall("a", "t", {}), ToolCall("a", "t", {})])
    c.model_responded([ToolCall("a", "t", {}, needs_approval=True)], output="ignored")
    assert c.step is Step.INTERRUPTION


def test_a_run_with_max_turns_zero_round_trips() -> None:
    # MA34: max_turns=0 is a legal start (no model call at all), so its log loads
    c = RunController.start(run_id="zero", session_id=None, max_turns=0)
    again = RunController.from_json(c.to_json())
    assert again.max_turns == 0
    assert_refused(again, InvalidTransition, again.begin_model_call)


@pytest.mark.invariant("I1")
def test_a_call_id_is_never_reused_in_a_run() -> None:
    # MA04: call ids are new to the run; reusing a published call's id would overwrite
    # its ledger record, and the call could run again
    c = tools_run(ToolCall("pay", "pay", {}))
    c.begin_tool("pay")
    c.tool_completed("pay", "paid")
    c.stage_publication([{"type": "function_call_output", "call_id": "pay",
                          "output": "paid"}], [], call_ids=["pay"])
    c.publication_committed()
    assert c.phase("pay") is Phase.PUBLISHED
    c.begin_model_call()
    assert_refused(c, InvalidTransition, c.model_responded, [ToolCall("pay", "pay", {})])
    c.model_responded([ToolCall("pay-2", "pay", {})])  # a new id is accepted
    remote = RunController.start(run_id="remote", session_id=None)
    remote.receive_tool_calls([ToolCall("k", "echo", {})])
    assert_refused(remote, InvalidTransition, remote.receive_tool_calls,
                   [ToolCall("k", "echo", {})])


# --------------------------------------------------------- hooks, guardrails (I1)


@pytest.mark.invariant("I1")
def test_hooks_run_once_per_scope() -> None:
    c = at_interruption()
    assert_refused(c, InvalidTransition, c.hook_ran, "agent_start")
    assert_refused(c, InvalidTransition, c.hook_ran, "model_end")
    assert_refused(c, InvalidTransition, c.hook_ran, "tool_start")  # needs a call
    assert_refused(c, InvalidTransition, c.hook_ran, "tool_start", call_id="nope")
    assert_refused(c, InvalidTransition, c.hook_ran, "agent_start", call_id="charge")
    assert_refused(c, InvalidTransition, c.hook_ran, "on_whatever")
    c.hook_ran("tool_start", call_id="charge")
    assert_refused(c, InvalidTransition, c.hook_ran, "tool_start", call_id="charge")
    c.handoff("billing-agent")
    c.hook_ran("agent_start")  # a new activation
    c.begin_model_call()
    c.hook_ran("model_start")  # a new model call


@pytest.mark.invariant("I1")
def test_guardrails_run_once_per_scope() -> None:
    c = at_interruption()
    c.guardrail_evaluated("pii", {"ok": True}, stage="input")
    assert_refused(c, InvalidTransition, c.guardrail_evaluated, "pii", True, stage="input")
    assert_refused(c, InvalidTransition, c.guardrail_evaluated, "g", True, stage="tool_input")
    assert_refused(c, InvalidTransition, c.guardrail_evaluated, "g", True, stage="input",
                   call_id="charge")
    assert_refused(c, InvalidTransition, c.guardrail_evaluated, "g", True, stage="bogus")
    c.guardrail_evaluated("g", True, stage="tool_input", call_id="charge")
    c.guardrail_evaluated("g", True, stage="tool_input", call_id="notify")
    assert_refused(c, InvalidTransition, c.guardrail_evaluated, "g", False,
                   stage="tool_input", call_id="charge")
    assert len(c.pending_guardrail_results) == 3
    assert c.guardrail_results == ()


def test_a_tool_stage_guardrail_names_a_known_call() -> None:
    # MA13: tool_input/tool_output guardrails are keyed by their call, which must exist
    c = at_interruption()
    for stage in ("tool_input", "tool_output"):
        assert_refused(c, InvalidTransition, c.guardrail_evaluated, "g", {"ok": True},
                       stage=stage, call_id="no-such-call")
        assert_refused(c, InvalidTransition, c.guardrail_evaluated, "g", {"ok": True},
                       stage=stage)
    c.guardrail_evaluated("g", {"ok": True}, stage="tool_input", call_id="charge")
    assert c.recorded_guardrail("g", stage="tool_input", call_id="charge") is not None


@pytest.mark.invariant("I1")
def test_input_and_output_guardrails_run_once_per_activation() -> None:
    # ST03: a handoff starts a new activation, in which the input guardrail runs again
    # (once); tool guardrails stay keyed by their call
    c = RunController.start(run_id="acts", session_id=None)
    c.guardrail_evaluated("screen", {"ok": True}, stage="input")
    assert_refused(c, InvalidTransition, c.guardrail_evaluated, "screen", {"ok": True},
                   stage="input")
    c.handoff("specialist")
    assert c.recorded_guardrail("screen", stage="input") is None
    c.guardrail_evaluated("screen", {"ok": False}, stage="input")
    found = c.recorded_guardrail("screen", stage="input")
    assert found is not None
    assert found.result == {"ok": False}
    assert_refused(c, InvalidTransition, c.guardrail_evaluated, "screen", {"ok": True},
                   stage="input")


# ------------------------------------------------------------------ decisions


def test_decisions_are_taken_in_interruption_only() -> None:
    c = at_interruption()
    c.approve("charge")
    c.resume()
    assert c.step is Step.TOOLS
    assert_refused(c, InvalidTransition, c.approve, "notify")
    assert_refused(c, InvalidTransition, c.begin_tool, "notify")
    assert c.next_action() is Action.RUN_TOOLS


def test_a_rejected_call_never_runs_and_its_output_is_published() -> None:
    c = at_interruption()
    c.reject("charge", "the user declined")
    assert_refused(c, InvalidTransition, c.begin_tool, "charge")
    rejection = {"type": "function_call_output", "call_id": "charge", "output": "declined"}
    assert_refused(c, InvalidTransition, c.stage_publication, [rejection], P)
    c.stage_publication([rejection], P, call_ids=["charge"])
    c.publication_committed()
    assert c.state.calls["charge"].phase == Phase.PUBLISHED


# --------------------------------------------------------- final output, handoff


def test_final_output_with_a_session_completes_when_its_batch_settles() -> None:
    c = _finalizing()
    assert c.next_action() is Action.FINISH
    c.guardrail_evaluated("tone", {"ok": True}, stage="output")
    c.hook_ran("agent_end")
    c.accept_final_output("the answer")
    assert c.next_action() is Action.PUBLISH
    assert_refused(c, InvalidTransition, c.complete)
    c.stage_publication([{"role": "assistant", "content": "the answer"}], P)
    assert c.envelope is not None
    assert c.envelope.continuation is Step.COMPLETED
    c.publication_committed()
    assert c.step is Step.COMPLETED
    assert len(c.guardrail_results) == 1
    assert c.next_action() is Action.NOT_RESUMABLE
    assert_refused(c, RunNotResumable, c.resume)


def test_a_run_without_a_session_completes_with_nothing_unpublished() -> None:
    c = _finalizing(session_id=None)
    c.accept_final_output("the answer")
    assert c.next_action() is Action.FINISH
    c.complete()
    assert c.step is Step.COMPLETED
    guarded = _finalizing(session_id=None)
    guarded.guardrail_evaluated("tone", True, stage="output")
    guarded.accept_final_output("the answer")
    assert guarded.next_action() is Action.PUBLISH
    assert_refused(guarded, InvalidTransition, guarded.complete)


def test_stop_on_first_tool_publishes_the_result_with_the_output() -> None:
    c = at_interruption()
    c.approve("charge")
    c.resume()
    c.begin_tool("charge")
    assert_refused(c, InvalidTransition, c.accept_final_output, "charged 7")
    c.tool_completed("charge", "charged 7")
    c.accept_final_output("charged 7")
    assert c.pending_approvals == ()  # notify and audit are skipped
    out = {"type": "function_call_output", "call_id": "charge", "output": "charged 7"}
    assert_refused(c, InvalidTransition, c.stage_publication, [{"role": "assistant"}], P)
    c.stage_publication([out], P, call_ids=["charge"])
    c.publication_committed()
    assert c.step is Step.COMPLETED


def test_handoff_skips_unstarted_calls_and_publishes_every_result() -> None:
    c = at_interruption()
    c.reject("notify", "no")
    c.handoff("billing-agent")
    assert c.pending_approvals == ()
    assert c.next_action() is Action.PUBLISH
    assert_refused(c, InvalidTransition, c.begin_model_call)
    out = {"type": "function_call_output", "call_id": "notify", "output": "no"}
    c.stage_publication([out], P, call_ids=["notify"])
    assert c.envelope is not None
    assert c.envelope.continuation is Step.RUN_AGAIN
    c.publication_committed()
    c.begin_model_call()
    assert c.step is Step.AWAITING_MODEL


# ----------------------------------------------------------------- batches


def test_a_batch_must_name_exactly_its_calls() -> None:
    c = at_interruption()
    c.approve("charge")
    c.approve("audit")
    c.resume()
    c.begin_tool("charge")
    c.tool_completed("charge", "charged 7")
    for items, call_ids in (
        ([], ["charge"]),                           # empty batch
        ([{"call_id": "charge"}], None),            # names a call it does not list
        ([{"other": 1}], ["audit"]),                # lists a call without a result
        ([{"other": 1}], ["charge", "charge"]),     # lists a call twice
        ([{"other": 1}], ["ghost"]),                # unknown call
    ):
        error = assert_refused(c, InvalidTransition, c.stage_publication, items, P,
                               call_ids=call_ids)
        assert "guard" in str(error)
    c.stage_publication([{"call_id": "charge"}], P, call_ids=["charge"])
    assert c.envelope is not None
    assert c.envelope.continuation is Step.TOOLS


def test_a_batch_listing_a_call_twice_is_refused() -> None:
    # MA19: each call's result is published once; a doubled id would publish it twice
    c = at_interruption()
    c.approve("charge")
    c.resume()
    c.begin_tool("charge")
    c.tool_completed("charge", "charged 7")
    items: list[JSON] = [{"type": "function_call_output", "call_id": "charge",
                          "output": "charged 7"}]
    assert_refused(c, InvalidTransition, c.stage_publication, items, P,
                   call_ids=["charge", "charge"])
    c.stage_publication(items, P, call_ids=["charge"])  # the honest batch is accepted


def test_a_batch_naming_a_rejected_call_it_does_not_list_is_refused() -> None:
    # MA20: a rejection's output is a result like any other; an item naming it must be
    # listed in call_ids, or the call would stay unpublished after its output was written
    c = at_interruption()
    c.reject("notify", "not now")
    c.reject("charge", "no")
    items: list[JSON] = [{"type": "function_call_output", "call_id": "notify",
                          "output": "not now"}]
    assert_refused(c, InvalidTransition, c.stage_publication, items, P, call_ids=["charge"])
    c.stage_publication(items, P, call_ids=["notify"])


def test_recorded_input_is_published_only_by_a_batch_that_starts_with_it() -> None:
    # ST16: a batch that does not start with the recorded input leaves it unpublished
    c = RunController.start(run_id="input", session_id=SESSION)
    c.add_input([{"role": "user", "content": "hi"}])
    c.stage_publication([{"role": "user", "content": "other"}], [])
    c.publication_committed()
    assert c.unpublished_input == ({"role": "user", "content": "hi"},)
    assert c.next_action() is Action.PUBLISH
    c.stage_publication([{"role": "user", "content": "hi"}, {"note": 1}],
                        [{"role": "user", "content": "other"}])
    c.publication_committed()
    assert c.unpublished_input == ()


def test_recorded_input_is_published_before_anything_else() -> None:
    # ST18: from every step that stages, recorded input goes to the Session first
    c = at_interruption()
    c.add_input([{"role": "user", "content": "and also"}])
    assert c.next_action() is Action.PUBLISH  # not AWAIT_DECISIONS
    h = RunController.start(run_id="handoff", session_id=SESSION)
    h.add_input([{"role": "user", "content": "hi"}])
    h.handoff("specialist")
    assert h.next_action() is Action.PUBLISH  # not CALL_MODEL


# ------------------------------------------------- calls a remote loop hands over


def test_received_calls_are_approved_and_runnable() -> None:
    # ST13: calls a remote loop hands over need no approval here: they are runnable at
    # once, and the run has tools to run until each has run
    c = RunController.start(run_id="remote", session_id=None)
    c.receive_tool_calls([ToolCall("k1", "echo", {}), ToolCall("k2", "echo", {})])
    assert c.runnable_call_ids() == ("k1", "k2")
    assert c.next_action() is Action.RUN_TOOLS
    c.begin_tool("k1")
    c.tool_completed("k1", 1)
    assert c.runnable_call_ids() == ("k2",)
    assert c.next_action() is Action.RUN_TOOLS
    c.begin_tool("k2")
    c.tool_completed("k2", 2)
    assert c.runnable_call_ids() == ()
    assert c.next_action() is Action.PUBLISH


def test_a_posted_result_is_posted_once() -> None:
    # MA07: once the remote holds a call's result, no further post of it is recorded
    c = RunController.start(run_id="remote", session_id=None)
    c.receive_tool_calls([ToolCall("k", "echo", {})])
    c.begin_tool("k")
    c.tool_completed("k", "out")
    c.result_post_failed("k", TimeoutError)  # a failed post leaves the result cached
    c.result_posted("k")
    assert_refused(c, InvalidTransition, c.result_posted, "k")
    assert_refused(c, InvalidTransition, c.result_post_failed, "k", TimeoutError)


# ---------------------------------------------------------------- stores


@pytest.mark.invariant("I7")
def test_two_controllers_from_one_version_cannot_both_act() -> None:
    store = MemoryEventStore()
    first = at_interruption(store=store)
    second = RunController.load(store, "run-1")
    first.approve("charge")
    error = assert_refused(second, ConcurrencyConflict, second.approve, "notify")
    assert error.run_id == "run-1"
    assert error.action == "approve"
    assert RunController.load(store, "run-1").state == first.state
    with pytest.raises(ConcurrencyConflict):
        RunController.start(run_id="run-1", session_id=None, store=store)


def test_load_of_an_unknown_run_is_refused() -> None:
    with pytest.raises(RunNotFound, match="no such run"):
        RunController.load(MemoryEventStore(), "ghost")


class _PairStore(MemoryEventStore):
    """A memory store whose append takes a Session write with its events (as the
    PostgreSQL stores do), keeping what it was handed."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[SessionWrite] = []

    def append(self, run_id: str, events: Sequence[ev.Event], expected_version: int, *,
               snapshot: Snapshot | None = None, step: Step | None = None,
               session_write: SessionWrite | None = None, read_model: Any = None) -> None:
        super().append(run_id, events, expected_version, snapshot=snapshot, step=step,
                       read_model=read_model)
        if session_write is not None:
            self.written.append(session_write)


def test_a_session_write_under_another_attempts_id_is_refused() -> None:
    # CT19: the publication id is f"{run_id}:{seq of the event that opened the attempt}"
    store = _PairStore()
    c = staged(store=store)
    opened = [e.seq for e in c.events if type(e) is ev.PublicationStaged][-1]
    for wrong in (f"{c.run_id}:{opened + 1}", f"other-run:{opened}", "x"):
        assert_refused(c, InvalidTransition, c.publication_committed,
                       session_write=SessionWrite(SESSION, wrong, tuple(B)))
    assert store.written == []
    c.publication_committed(session_write=SessionWrite(SESSION, f"{c.run_id}:{opened}",
                                                       tuple(B)))
    assert [w.publication_id for w in store.written] == [f"{c.run_id}:{opened}"]
    assert c.step is not Step.UNSETTLED


# ---------------------------------------------------------------- limits


def test_the_last_events_are_reserved_for_settling_and_abandon() -> None:
    c = RunController.start(run_id="lim", session_id=SESSION, max_events=12)
    c.begin_model_call()
    c.model_responded([ToolCall("a", "t", {})])
    c.begin_tool("a")
    c.tool_completed("a", "x")
    c.hook_ran("agent_start")
    c.hook_ran("tool_start", call_id="a")
    c.stage_publication([{"call_id": "a"}], P, call_ids=["a"])  # event 7: room for 4 more
    assert len(c.events) == 8
    c.publication_failed(RuntimeError("x"))
    assert c.reconcile(P, SESSION)
    c.publication_committed()
    assert_refused(c, SchemaError, c.begin_model_call)
    c.abandon("limit")
    assert len(c.events) == 12
    assert RunController.from_json(c.to_json(), max_events=12).step is Step.TERMINAL_UNRECOVERABLE
    with pytest.raises(SchemaError, match="max_events=11"):
        RunController.from_json(c.to_json(), max_events=11)


# ---------------------------------------------------------------- logging


def test_logging_is_silent_unless_enabled() -> None:
    stream = io.StringIO()
    try:
        enable_logging(json=True, stream=stream)
        c = RunController.start(run_id="logged", session_id=None)
        c.begin_model_call()
    finally:
        disable_logging()
    c.model_failed(RuntimeError("quiet"))
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [line["event"] for line in lines] == ["RunStarted", "ModelCallBegun"]
    assert lines[1]["seq"] == 1
    assert lines[1]["from"] == "run_again"
    assert lines[1]["to"] == "awaiting_model"
    assert lines[1]["run_id"] == "logged"


def test_execute_hands_out_a_detached_call() -> None:
    c = RunController.start(run_id="x", session_id=None)
    c.begin_model_call()
    c.model_responded([ToolCall("a", "t", {"k": [1]})])
    decision = c.begin_tool("a")
    assert isinstance(decision, Execute)
    decision.call.arguments["k"].append(2)
    assert c.state.calls["a"].call.arguments == {"k": [1]}


# The text fields of hook_ran, guardrail_evaluated and approve pass a short ASCII str on a
# fast path and leave everything else to the full check: a differential against an
# independent model of an acceptable text (a str, at most 4096 characters, valid Unicode).
_TEXTS = ["a" * 4096, "a" * 4097, "é" * 4096, "é" * 4097, "ok\ud800", "\ud800", "",
          7, b"hook", None]


def _text_ok(value: object) -> bool:
    if type(value) is not str or len(value) > 4096:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


_TEXT_FIELDS: dict[str, tuple[Callable[[RunController, Any], None], bool]] = {
    "hook": (lambda c, v: c.hook_ran(v), False),
    "hook call_id": (lambda c, v: c.hook_ran("tool_start", call_id=v), True),
    "guardrail name": (lambda c, v: c.guardrail_evaluated(v, {}, stage="input"), False),
    "guardrail stage": (lambda c, v: c.guardrail_evaluated("g", {}, stage=v), False),
    "guardrail call_id": (lambda c, v: c.guardrail_evaluated("g", {}, stage="tool_input",
                                                             call_id=v), True),
    "approve call_id": (lambda c, v: c.approve(v), False),
    "approve fingerprint": (lambda c, v: c.approve("charge", fingerprint=v), True),
}


@pytest.mark.parametrize("value", _TEXTS, ids=range(len(_TEXTS)))
@pytest.mark.parametrize("field", list(_TEXT_FIELDS))
def test_text_fields_are_refused_exactly_when_not_acceptable_text(field: str,
                                                                  value: object) -> None:
    command, optional = _TEXT_FIELDS[field]
    c = at_interruption()
    acceptable = _text_ok(value) or (optional and value is None)
    if not acceptable:
        error = assert_refused(c, SchemaError, command, c, value)
        assert "\ud800" not in str(error)
        return
    before = c.version
    try:
        command(c, value)
    except InvalidTransition:  # past the text check: a guard may still refuse it
        assert c.version == before
    else:
        assert c.version == before + 1


@pytest.mark.parametrize("hook", ["agent_start", "agent_end", "model_start", "model_end",
                                  "tool_start", "tool_end", "tool_", "tool_x", "model_",
                                  "model_x", "agent", "", "toolstart", "x_tool_start"])
def test_hook_key_scopes_a_hook_by_its_prefix(hook: str) -> None:
    c = at_interruption()
    s = c.state
    expected = ((hook, "cid") if hook.startswith("tool_") else
                (hook, s.model_calls) if hook.startswith("model_") else (hook, s.activation))
    assert s.hook_key(hook, "cid") == expected


# ------------------------------------------------------- time and actor (DESIGN §7.2)


class Ticks:
    """A clock that counts its readings: 1000, 1001, 1002, ..."""

    def __init__(self, start: int = 1000) -> None:
        self.readings: list[int] = []
        self.next = start

    def __call__(self) -> int:
        self.readings.append(self.next)
        self.next += 1
        return self.readings[-1]


class NeverRead:
    """A clock that must not be read: replay and loading never tell time."""

    def __call__(self) -> int:
        raise AssertionError("the clock was read")


def _seed(clock: Ticks, store: Any = None) -> RunController:
    c = RunController.start(run_id="run-1", session_id=SESSION, store=store, clock=clock)
    c.hook_ran("agent_start")
    c.begin_model_call()
    c.model_responded([ToolCall("charge", "charge", {"x": 7}, needs_approval=True),
                       ToolCall("notify", "notify", {}, needs_approval=True)])
    c.approve("charge", by="alice", reason="asked for it")
    c.reject("notify", "no", by="bob")
    c.resume()
    c.begin_tool("charge")
    return c


def test_every_recorded_event_carries_exactly_the_clocks_readings_in_order() -> None:
    clock = Ticks()
    c = _seed(clock)
    assert [e.at for e in c.events] == clock.readings == list(range(1000, 1000 + c.version))
    assert [e["at"] for e in c.to_json()["events"]] == clock.readings


def test_replay_and_loading_never_read_the_clock() -> None:
    store = MemoryEventStore()
    live = _seed(Ticks(), store)
    doc = live.to_json()
    for again in (RunController.from_json(doc, clock=NeverRead()),
                  RunController.from_json(json.dumps(doc), clock=NeverRead()),
                  RunController.load(store, "run-1", clock=NeverRead()),
                  RunController.load(store, "run-1", snapshot=False, clock=NeverRead())):
        assert again.events == live.events  # the log's own times, not a new reading
        again.next_action()
        again.in_doubt()
        assert [v.decisions for v in again.calls] == [v.decisions for v in live.calls]


def test_load_async_never_reads_the_clock_and_its_commands_do() -> None:
    import asyncio

    store = MemoryEventStore()
    _seed(Ticks(), store)
    clock = Ticks(5000)
    again = asyncio.run(RunController.load_async(store, "run-1", clock=clock))
    assert clock.readings == []
    again.resolve_in_doubt("charge", "charged 7", by="carol")
    assert clock.readings == [5000]
    assert store.load("run-1")[-1].at == 5000


def test_a_refused_command_reads_no_clock_before_its_arguments_are_checked() -> None:
    clock = Ticks()
    c = _seed(clock)
    read = len(clock.readings)
    assert_refused(c, SchemaError, c.hook_ran, 7)
    assert_refused(c, SchemaError, c.resolve_in_doubt, "charge", "x", by=b"bytes")
    assert len(clock.readings) == read


@pytest.mark.parametrize("reading", [1.5, "1767225600000000", True, -1, 2**63, None],
                         ids=["float", "str", "bool", "negative", "past-int64", "none"])
def test_a_clock_reading_that_is_not_microseconds_refuses_the_command(reading: Any) -> None:
    readings = iter([1000, reading])
    c = RunController.start(run_id="r", session_id=SESSION, clock=lambda: next(readings))
    error = assert_refused(c, SchemaError, c.begin_model_call)
    assert "clock" in str(error)
    with pytest.raises(SchemaError, match="clock"):
        RunController.start(run_id="r", session_id=SESSION, clock=lambda: reading)
    with pytest.raises(SchemaError, match="clock must be None or a callable"):
        RunController.start(run_id="r", session_id=SESSION, clock=1000)  # type: ignore[arg-type]


def test_the_default_clock_is_the_wall_clock_in_microseconds() -> None:
    """In a process of its own: the tests' processes read one fixed instant
    (tests/conftest.py)."""
    import subprocess
    import sys
    import time

    before = time.time_ns() // 1000
    printed = subprocess.run(
        [sys.executable, "-c", "from statemachine import RunController\n"
         "c = RunController.start(run_id='r', session_id=None)\n"
         "c.begin_model_call()\nprint(*(e.at for e in c.events))"],
        capture_output=True, text=True, check=True).stdout.split()
    after = time.time_ns() // 1000
    started, begun = (int(t) for t in printed)
    assert before <= started <= begun <= after


def test_decisions_record_who_and_why_and_the_ledger_shows_them() -> None:
    clock = Ticks()
    c = _seed(clock)
    events = c.events
    approved = next(e for e in events if isinstance(e, ev.CallApproved))
    rejected = next(e for e in events if isinstance(e, ev.CallRejected))
    assert (approved.by, approved.reason) == ("alice", "asked for it")
    assert rejected.by == "bob"
    again = RunController.from_json(c.to_json())  # the charge is now in doubt
    again.resolve_in_doubt("charge", "charged 7", by="carol")
    again.abandon("the customer left", by="dave")
    abandoned = again.events[-1]
    assert isinstance(abandoned, ev.Abandoned)
    assert (abandoned.by, abandoned.reason) == ("dave", "the customer left")
    decisions = {v.call.call_id: [(d.kind, d.by, d.reason, d.at) for d in v.decisions]
                 for v in again.calls}
    assert decisions == {
        "charge": [("approved", "alice", "asked for it", approved.at),
                   ("resolved", "carol", None, again.events[-2].at)],
        "notify": [("rejected", "bob", None, rejected.at)]}
    assert again.call("notify").decisions == again.calls[1].decisions


def test_decisions_without_an_actor_record_none() -> None:
    c = at_interruption()
    c.approve("charge")
    c.reject("notify")
    assert [(d.kind, d.by, d.reason) for v in c.calls for d in v.decisions] == [
        ("approved", None, None), ("rejected", None, None)]
    assert c.call("audit").decisions == ()


@pytest.mark.parametrize("bad", [7, b"alice", "\ud800", "x" * 5_000],
                         ids=["int", "bytes", "surrogate", "too-long"])
def test_by_and_reason_follow_the_text_rules(bad: Any) -> None:
    c = at_interruption()
    assert_refused(c, SchemaError, c.approve, "charge", by=bad)
    assert_refused(c, SchemaError, c.approve, "charge", reason=bad)
    assert_refused(c, SchemaError, c.reject, "charge", by=bad)
    assert_refused(c, SchemaError, c.abandon, "why", by=bad)
    started = _seed(Ticks())
    assert_refused(RunController.from_json(started.to_json()), SchemaError,
                   RunController.from_json(started.to_json()).resolve_in_doubt, "charge", "x",
                   by=bad)


def test_the_decision_commands_keep_their_positional_meaning() -> None:
    c = at_interruption()
    c.reject("notify", "not now")
    assert c.call("notify").result == "not now"
    c.approve("charge", fingerprint=c.fingerprint("charge"))
    with pytest.raises(TypeError):
        c.approve("audit", None, "alice")  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        c.abandon("why", "dave")  # type: ignore[call-arg]
