"""Forged logs, one per guard (DESIGN §6.9, I10).

For every guard of every row of the machine (each (step, trigger, guard) the declaration
gives, checked against the compiled `TABLE`), a legal log recorded by driving a real
`RunController` is changed as little as possible so that, at one event, exactly that
guard of the row the event was meant for fails, and nothing before it does. Such a log is
refused on load with `InvalidTransition` naming the forged event's sequence number and
the guard. The named cases below go through every door (`RunController.from_json` from
a dict and from text, `codec.decode_log` + `machine.replay`, `RunController.load` from a
memory and a SQLite store, with and without snapshots); the legal log each came from must
load, so no case is vacuous. Steps the named cases do not reach are covered by generic
forgers applied to a set of legal logs.

Some guards cannot fail alone in any log: the fold never builds a state in which the
guard is the only thing in the way (a step with a row guarded by ``no_envelope`` never
holds an envelope, exactly one ``continues_to_*`` guard holds for every envelope, a call
is started only in TOOLS, ...). `implied` gives the reason for each; every such guard
still has a forged log of the same intent that is refused (by the step, or by another
guard), and a property test over generated legal logs checks every reason, so the list
cannot silently go stale. The enumeration fails for a guard that has neither a forged
log nor a reason: a new guard without a forged case fails the suite.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from statemachine import (
    InvalidTransition,
    MemoryEventStore,
    RecoveryPolicy,
    Resolution,
    RunController,
    SchemaError,
    SQLiteEventStore,
    Step,
    ToolCall,
    codec,
)
from statemachine import events as ev
from statemachine.codec import ADDED_IN_3
from statemachine.envelope import measure_frontier
from statemachine.machine import GUARDS, TABLE, TRANSITIONS, Refused, fire, replay
from statemachine.payloads import JSON, digests
from statemachine.state import RunState
from statemachine.values import GuardrailResult, Phase
from tests.helpers import TEST_NOW, at_interruption, failed, staged, staged_over, tools_run
from tests.strategies import drive

Events = list[ev.Event]
Pair = tuple[str, str]

RUN = "forged-run"
SESSION = "forged-session"
USER: list[JSON] = [{"role": "user", "content": "pay 5, look it up, add the fee"}]


# ------------------------------------------------------------------ legal logs


@attrs.frozen
class Legal:
    """A legal log and the history each of its stagings was given (by staged seq)."""

    events: tuple[ev.Event, ...]
    histories: dict[int, list[JSON]]


class _Writer:
    """Drives a controller through publications against a simulated Session."""

    def __init__(self, c: RunController) -> None:
        self.c = c
        self.session: list[JSON] = list(USER)
        self.histories: dict[int, list[JSON]] = {}

    def stage(self, items: list[JSON], call_ids: Sequence[str] = ()) -> list[JSON]:
        history = self.session[-(len(items) + 1):]
        self.histories[len(self.c.events)] = list(history)
        self.c.stage_publication(items, history, call_ids=list(call_ids))
        return items

    def publish(self, items: list[JSON], call_ids: Sequence[str] = ()) -> None:
        self.session += self.stage(items, call_ids)
        self.c.publication_committed()

    def legal(self) -> Legal:
        return Legal(tuple(self.c.events), dict(self.histories))


def _items(call_id: str, output: JSON) -> list[JSON]:
    return [{"type": "function_call", "call_id": call_id, "name": call_id},
            {"type": "function_call_output", "call_id": call_id, "output": output}]


def approvals_run(policy: RecoveryPolicy = RecoveryPolicy.RECONCILE) -> Legal:
    """Four gated calls: pay, look, fee approved, note rejected; pay runs with a guardrail
    and hooks; the first batch fails, is reconciled and appended; then look and fee run,
    a second model call answers, and the final batch completes the run."""
    c = RunController.start(run_id=RUN, session_id=SESSION, policy=policy, max_turns=2)
    w = _Writer(c)
    c.begin_model_call()
    c.hook_ran("model_start")
    c.model_responded([ToolCall(i, i, {"n": n}, needs_approval=True)
                       for n, i in enumerate(("pay", "look", "fee", "note"))])
    c.approve("pay", fingerprint=c.fingerprint("pay"))
    c.reject("note", "declined", fingerprint=c.fingerprint("note"))
    c.approve("look")
    c.approve("fee")
    c.resume()
    c.guardrail_evaluated("pay_in", {"allowed": True}, stage="tool_input", call_id="pay")
    c.begin_tool("pay")
    c.hook_ran("tool_start", call_id="pay")
    c.tool_completed("pay", "paid 5")
    c.hook_ran("tool_end", call_id="pay")
    first = w.stage(_items("pay", "paid 5") + _items("note", "declined"), ["pay", "note"])
    c.publication_failed(OSError("injected: nothing written"))
    c.reconcile(w.session, SESSION)
    w.session += first
    c.publication_committed()
    for call_id in ("look", "fee"):
        c.begin_tool(call_id)
        c.tool_completed(call_id, f"{call_id} done")
    w.publish(_items("look", "look done") + _items("fee", "fee done"), ["look", "fee"])
    c.begin_model_call()
    c.model_responded([], output="all done")
    c.guardrail_evaluated("final", {"allowed": True}, stage="output")
    c.hook_ran("agent_end")
    c.accept_final_output("all done")
    w.publish([{"role": "assistant", "content": "all done"}])
    assert c.step is Step.COMPLETED
    return w.legal()


def tool_answer_run() -> Legal:
    """Two ungated calls run; the second's output is accepted as the final output, and the
    final batch publishes both results."""
    c = RunController.start(run_id=RUN, session_id=SESSION)
    w = _Writer(c)
    c.begin_model_call()
    c.model_responded([ToolCall("a", "a", {}), ToolCall("b", "b", {})])
    for call_id in ("a", "b"):
        c.begin_tool(call_id)
        c.tool_completed(call_id, f"{call_id} out")
    c.accept_final_output("b out")
    w.publish(_items("a", "a out") + _items("b", "b out")
              + [{"role": "assistant", "content": "b out"}], ["a", "b"])
    assert c.step is Step.COMPLETED
    return w.legal()


def handoff_run() -> Legal:
    """x rejected, y left undecided; a handoff skips y; its batch publishes x's rejection,
    and the new agent calls the model."""
    c = RunController.start(run_id=RUN, session_id=SESSION)
    w = _Writer(c)
    c.begin_model_call()
    c.model_responded([ToolCall("x", "x", {}, needs_approval=True),
                       ToolCall("y", "y", {}, needs_approval=True)])
    c.reject("x", "no")
    c.handoff("other-agent")
    w.publish([*_items("x", "no"), {"role": "system", "content": "handed off"}], ["x"])
    c.begin_model_call()
    c.model_responded([], output="handled")
    return w.legal()


def no_session_run(*, guardrail: bool) -> Legal:
    """A run without a Session answers at once; with an output guardrail its result must
    be published (into its private history) before it completes, without one it
    completes directly."""
    c = RunController.start(run_id=RUN, session_id=None)
    w = _Writer(c)
    c.begin_model_call()
    c.model_responded([], output="hello")
    if guardrail:
        c.guardrail_evaluated("final", {"allowed": True}, stage="output")
    c.accept_final_output("hello")
    if guardrail:
        w.publish([{"role": "assistant", "content": "hello"}])
    else:
        c.complete()
    assert c.step is Step.COMPLETED
    return w.legal()


def fail_closed_run() -> Legal:
    """FAIL_CLOSED: one approved call runs, its batch is staged and commits."""
    c = RunController.start(run_id=RUN, session_id=SESSION, policy=RecoveryPolicy.FAIL_CLOSED)
    w = _Writer(c)
    c.begin_model_call()
    c.model_responded([ToolCall("pay", "pay", {"n": 5})])
    c.begin_tool("pay")
    c.tool_completed("pay", "paid")
    w.publish(_items("pay", "paid"), ["pay"])
    assert c.step is Step.RUN_AGAIN
    return w.legal()


def fail_closed_failed_run() -> Legal:
    """FAIL_CLOSED: the write fails and the run is terminal."""
    c = RunController.start(run_id=RUN, session_id=SESSION, policy=RecoveryPolicy.FAIL_CLOSED)
    w = _Writer(c)
    c.begin_model_call()
    c.model_responded([ToolCall("pay", "pay", {"n": 5})])
    c.begin_tool("pay")
    c.tool_completed("pay", "paid")
    w.stage(_items("pay", "paid"), ["pay"])
    c.publication_failed(OSError("injected"))
    assert c.step is Step.TERMINAL_UNRECOVERABLE
    return w.legal()


def remote_run() -> Legal:
    """Calls received from a remote loop, each result posted on its own (one post fails
    before it lands)."""
    c = RunController.start(run_id=RUN, session_id=None)
    c.receive_tool_calls([ToolCall("r1", "lookup", {"q": 1})])
    c.begin_tool("r1")
    c.tool_completed("r1", "one")
    c.result_posted("r1")
    c.receive_tool_calls([ToolCall("r2", "lookup", {"q": 2})])
    c.begin_tool("r2")
    c.tool_completed("r2", "two")
    c.result_post_failed("r2", TimeoutError())
    c.result_posted("r2")
    return Legal(tuple(c.events), {})


def input_run() -> Legal:
    """New input is published from RUN_AGAIN before the model is called."""
    c = RunController.start(run_id=RUN, session_id=SESSION)
    w = _Writer(c)
    more: list[JSON] = [{"role": "user", "content": "and then?"}]
    c.add_input(more)
    w.publish(more)
    c.begin_model_call()
    c.model_responded([], output="then this")
    c.accept_final_output("then this")
    w.publish([{"role": "assistant", "content": "then this"}])
    return w.legal()


def interruption_run() -> Legal:
    """x rejected and its rejection published from INTERRUPTION while y awaits; then y is
    approved, runs, and its result is published."""
    c = RunController.start(run_id=RUN, session_id=SESSION)
    w = _Writer(c)
    c.begin_model_call()
    c.model_responded([ToolCall("x", "x", {}, needs_approval=True),
                       ToolCall("y", "y", {}, needs_approval=True)])
    c.reject("x", "no")
    w.publish(_items("x", "no"), ["x"])
    assert c.step is Step.INTERRUPTION
    c.approve("y")
    c.resume()
    c.begin_tool("y")
    c.tool_completed("y", "y out")
    w.publish(_items("y", "y out"), ["y"])
    return w.legal()


def handoff_note_run() -> Legal:
    """A handoff with nothing to publish but a note, then the new agent's model call."""
    c = RunController.start(run_id=RUN, session_id=SESSION)
    w = _Writer(c)
    c.begin_model_call()
    c.model_responded([ToolCall("x", "x", {}, needs_approval=True)])
    c.handoff("other-agent")
    w.publish([{"role": "system", "content": "handed off"}])
    c.begin_model_call()
    return w.legal()


def bare_handoff_run() -> Legal:
    """A handoff with nothing to publish goes straight to the new agent's model call."""
    c = RunController.start(run_id=RUN, session_id=SESSION, max_turns=5)
    c.begin_model_call()
    c.model_responded([ToolCall("x", "x", {}, needs_approval=True)])
    c.handoff("other-agent")
    c.begin_model_call()
    c.model_responded([], output="handled")
    return Legal(tuple(c.events), {})


def mixed_run() -> Legal:
    """A model call's tool result is published, then a remote loop sends calls from
    RUN_AGAIN."""
    c = RunController.start(run_id=RUN, session_id=SESSION)
    w = _Writer(c)
    c.begin_model_call()
    c.model_responded([ToolCall("m1", "m1", {})])
    c.begin_tool("m1")
    c.tool_completed("m1", "m1 out")
    w.publish(_items("m1", "m1 out"), ["m1"])
    assert c.step is Step.RUN_AGAIN
    c.receive_tool_calls([ToolCall("r1", "lookup", {"q": 1})])
    c.begin_tool("r1")
    c.tool_completed("r1", "one")
    c.result_posted("r1")
    return w.legal()


LEGAL_LOGS: dict[str, Callable[[], Legal]] = {
    "approvals": approvals_run, "tool answer": tool_answer_run, "handoff": handoff_run,
    "no session": lambda: no_session_run(guardrail=True), "fail closed": fail_closed_run,
    "remote": remote_run, "input": input_run, "interruption": interruption_run,
    "handoff note": handoff_note_run, "bare handoff": bare_handoff_run, "mixed": mixed_run,
}


# ------------------------------------------------------------------ forging tools


def renumber(events: Sequence[ev.Event]) -> Events:
    return [e if e.seq == i else attrs.evolve(e, seq=i) for i, e in enumerate(events)]


def at(events: Sequence[ev.Event], kind: type[ev.Event], nth: int = 0,
       **fields: Any) -> int:
    """The index of the ``nth`` event of type ``kind`` whose fields match ``fields``."""
    found = [i for i, e in enumerate(events) if type(e) is kind
             and all(getattr(e, k) == v for k, v in fields.items())]
    return found[nth]


def insert(events: Sequence[ev.Event], index: int, event: ev.Event) -> tuple[Events, int]:
    return renumber([*events[:index], event, *events[index:]]), index


def replace(events: Sequence[ev.Event], index: int, **changes: Any) -> tuple[Events, int]:
    out = list(events)
    out[index] = attrs.evolve(out[index], **changes)
    return out, index


def delete(events: Sequence[ev.Event], *indexes: int) -> Events:
    return renumber([e for i, e in enumerate(events) if i not in indexes])


def restaged(prefix: Sequence[ev.Event], history: list[JSON], items: list[JSON],
             call_ids: Sequence[str], **changes: Any) -> ev.PublicationStaged:
    """The staging event a controller would record after ``prefix`` for this batch (every
    derived field consistent, as a careful forger would make it), then ``changes``."""
    state = replay(RUN, prefix)
    batch = tuple(items)
    batch_digests = digests(batch, state.form)
    frontier = measure_frontier(history, batch_digests, state.form,
                                whole=len(history) < len(batch) + 1)
    assert frontier is not None
    event = ev.PublicationStaged(
        len(prefix), state.session_id, batch, tuple(call_ids), frontier.read_limit,
        frontier.digests, frontier.whole, batch_digests, state.continuation_after(tuple(call_ids)),
        at=TEST_NOW)
    return attrs.evolve(event, **changes)


def _staged_at(legal: Legal, nth: int) -> tuple[int, ev.PublicationStaged]:
    index = at(legal.events, ev.PublicationStaged, nth)
    staged = legal.events[index]
    assert isinstance(staged, ev.PublicationStaged)
    return index, staged


def restage(legal: Legal, nth: int, items: list[JSON], call_ids: Sequence[str],
            **changes: Any) -> tuple[Events, int]:
    index, _ = _staged_at(legal, nth)
    event = restaged(legal.events[:index], legal.histories[index], items, call_ids, **changes)
    return replace(legal.events, index, **{f.name: getattr(event, f.name)
                                           for f in attrs.fields(type(event))})


# ------------------------------------------------------------------------ cases


@attrs.frozen
class Forgery:
    """``build`` returns the legal log, the forged one, and the index of the forged event.
    ``pairs`` are the (trigger, guard) pairs it breaks alone; for an implied pair,
    ``refused_by`` says what refuses it instead: a guard's name, or ``"step"`` (the step
    the run is in has no row for the trigger)."""

    name: str
    pairs: tuple[Pair, ...]
    build: Callable[[], tuple[Legal, Events, int]]
    refused_by: str | None = None


def _case(name: str, pairs: Pair | tuple[Pair, ...], refused_by: str | None = None
          ) -> Callable[[Callable[[], tuple[Legal, Events, int]]], Forgery]:
    def wrap(build: Callable[[], tuple[Legal, Events, int]]) -> Forgery:
        flat = (pairs,) if isinstance(pairs[0], str) else pairs
        return Forgery(name, flat, build, refused_by)
    return wrap


def _with(legal: Legal, forged: tuple[Events, int]) -> tuple[Legal, Events, int]:
    return legal, forged[0], forged[1]


@_case("a model call past max_turns", ("begin_model_call", "turns_left"))
def _turns() -> tuple[Legal, Events, int]:
    legal = approvals_run()
    forged, _ = replace(legal.events, 0, max_turns=1)
    return legal, forged, at(forged, ev.ModelCallBegun, 1)


@_case("a model call over an unpublished rejection after a handoff",
       ("begin_model_call", "results_published"))
def _unpublished_model_call() -> tuple[Legal, Events, int]:
    legal = handoff_run()
    staged = at(legal.events, ev.PublicationStaged)
    forged = delete(legal.events, staged, staged + 1)
    return legal, forged, at(forged, ev.ModelCallBegun, 1)


@_case("a response reusing a call id", ("model_responded", "calls_are_new"))
def _reused_id() -> tuple[Legal, Events, int]:
    legal = approvals_run()
    index = at(legal.events, ev.ModelResponded, 1)
    return _with(legal, replace(legal.events, index, output=None,
                                tool_calls=(ToolCall("pay", "pay", {"n": 9}),)))


@_case("a response with neither calls nor output",
       (("model_responded", "a_call_awaits_decision"),
        ("model_responded", "calls_without_approval"), ("model_responded", "output_only")))
def _empty_response() -> tuple[Legal, Events, int]:
    legal = approvals_run()
    return _with(legal, replace(legal.events, at(legal.events, ev.ModelResponded, 1),
                                output=None))


@_case("an approval of an approved call", ("approve", "call_awaits_decision"))
def _approved_twice() -> tuple[Legal, Events, int]:
    legal = approvals_run()
    index = at(legal.events, ev.CallApproved, call_id="pay")
    return _with(legal, insert(legal.events, index + 1, legal.events[index]))


@_case("a decision on an unknown call", ("reject", "call_awaits_decision"))
def _unknown_decision() -> tuple[Legal, Events, int]:
    legal = approvals_run()
    index = at(legal.events, ev.CallRejected, call_id="note")
    return _with(legal, replace(legal.events, index, call_id="ghost"))


@_case("an approval under another fingerprint", ("approve", "fingerprint_matches"))
def _approve_fingerprint() -> tuple[Legal, Events, int]:
    legal = approvals_run()
    index = at(legal.events, ev.CallApproved, call_id="pay")
    return _with(legal, replace(legal.events, index, fingerprint="0" * 64))


@_case("a rejection under another fingerprint", ("reject", "fingerprint_matches"))
def _reject_fingerprint() -> tuple[Legal, Events, int]:
    legal = approvals_run()
    index = at(legal.events, ev.CallRejected, call_id="note")
    other = legal.events[at(legal.events, ev.CallApproved, call_id="pay")]
    return _with(legal, replace(legal.events, index, fingerprint=other.fingerprint))  # type: ignore[attr-defined]


@_case("a resume with nothing approved", ("resume", "approved_call_unstarted"))
def _resume_nothing() -> tuple[Legal, Events, int]:
    legal = approvals_run()
    events = list(legal.events)
    resumed = at(events, ev.Resumed)
    moved = events.pop(resumed)
    target = at(events, ev.ModelResponded) + 1
    return _with(legal, insert(events, target, moved))


@_case("a second start of a non-idempotent call", ("begin_tool", "call_can_start"))
def _started_twice() -> tuple[Legal, Events, int]:
    legal = approvals_run()
    index = at(legal.events, ev.ToolStarted, call_id="pay")
    return _with(legal, insert(legal.events, index + 1, legal.events[index]))


@_case("a start of a rejected call", ("begin_tool", "call_can_start"))
def _rejected_started() -> tuple[Legal, Events, int]:
    legal = approvals_run()
    return _with(legal, replace(legal.events, at(legal.events, ev.ToolStarted, call_id="look"),
                                call_id="note"))


@_case("a result without a start", ("tool_completed", "call_started"))
def _completed_unstarted() -> tuple[Legal, Events, int]:
    legal = approvals_run()
    started = at(legal.events, ev.ToolStarted, call_id="look")
    forged = delete(legal.events, started)
    return legal, forged, at(forged, ev.ToolCompleted, call_id="look")


@_case("an in-doubt resolution of a call never started", ("resolve_in_doubt", "call_started"))
def _resolved_unstarted() -> tuple[Legal, Events, int]:
    legal = approvals_run()
    index = at(legal.events, ev.Resumed) + 1
    return _with(legal, insert(legal.events, index, ev.InDoubtResolved(index, "look", "x")))


@_case("a NOT_EXECUTED resolution carrying an output", ("resolve_in_doubt", "resolution_fits"))
def _not_executed_with_output() -> tuple[Legal, Events, int]:
    legal = approvals_run()
    index = at(legal.events, ev.ToolStarted, call_id="look") + 1
    return _with(legal, insert(legal.events, index, ev.InDoubtResolved(
        index, "look", "x", outcome=Resolution.NOT_EXECUTED)))


@_case("a tool guardrail naming an unknown call", ("guardrail_evaluated", "guardrail_fits_stage"))
def _guardrail_unknown_call() -> tuple[Legal, Events, int]:
    legal = approvals_run()
    index = at(legal.events, ev.GuardrailEvaluated)
    result = GuardrailResult("pay_in", "tool_input", "ghost", {"allowed": True})
    return _with(legal, replace(legal.events, index, result=result))


@_case("a guardrail run twice", ("guardrail_evaluated", "guardrail_not_repeated"))
def _guardrail_twice() -> tuple[Legal, Events, int]:
    legal = approvals_run()
    index = at(legal.events, ev.GuardrailEvaluated)
    return _with(legal, insert(legal.events, index + 1, legal.events[index]))


@_case("a tool hook naming an unknown call", ("hook_ran", "hook_fits_scope"))
def _hook_unknown_call() -> tuple[Legal, Events, int]:
    legal = approvals_run()
    return _with(legal, replace(legal.events, at(legal.events, ev.HookRan, hook="tool_start"),
                                call_id="ghost"))


@_case("a hook run twice", ("hook_ran", "hook_not_repeated"))
def _hook_twice() -> tuple[Legal, Events, int]:
    legal = approvals_run()
    index = at(legal.events, ev.HookRan, hook="tool_start")
    return _with(legal, insert(legal.events, index + 1, legal.events[index]))


@_case("a final output accepted while a tool runs", ("accept_final_output", "no_call_started"))
def _final_while_running() -> tuple[Legal, Events, int]:
    legal = tool_answer_run()
    events = list(legal.events)
    final = events.pop(at(events, ev.FinalOutputAccepted))
    return _with(legal, insert(events, at(events, ev.ToolCompleted, call_id="b"), final))


@_case("a completion of a run with a Session", ("complete", "run_has_no_session"))
def _complete_with_session() -> tuple[Legal, Events, int]:
    legal = no_session_run(guardrail=False)
    forged, _ = replace(legal.events, 0, session_id=SESSION)
    return legal, forged, at(forged, ev.RunCompleted)


@_case("a completion over an unpublished guardrail result", ("complete", "nothing_unpublished"))
def _complete_unpublished() -> tuple[Legal, Events, int]:
    legal = no_session_run(guardrail=True)
    staged = at(legal.events, ev.PublicationStaged)
    forged = renumber([*legal.events[:staged], ev.RunCompleted(staged)])
    return legal, forged, staged


@_case("a staging while a tool runs", ("stage_publication", "no_call_started"))
def _stage_while_running() -> tuple[Legal, Events, int]:
    legal = approvals_run()
    events = list(legal.events)
    started = events.pop(at(events, ev.ToolStarted, call_id="look"))
    forged, index = insert(events, at(events, ev.PublicationStaged), started)
    return legal, forged, index + 1


@_case("an empty batch", ("stage_publication", "batch_not_empty"))
def _empty_batch() -> tuple[Legal, Events, int]:
    legal = approvals_run()
    return _with(legal, restage(legal, 2, [], []))


@_case("a batch for another Session", ("stage_publication", "batch_session_matches"))
def _other_session() -> tuple[Legal, Events, int]:
    legal = approvals_run()
    return _with(legal, replace(legal.events, _staged_at(legal, 0)[0], session_id="other"))


@_case("a batch naming a call with no result", ("stage_publication", "batch_names_its_calls"))
def _names_unfinished() -> tuple[Legal, Events, int]:
    legal = approvals_run()
    staged = _staged_at(legal, 0)[1]
    return _with(legal, restage(legal, 0, list(staged.items), ["pay", "note", "look"]))


@_case("a batch hiding a result it carries", ("stage_publication", "batch_names_its_calls"))
def _hides_result() -> tuple[Legal, Events, int]:
    legal = approvals_run()
    staged = _staged_at(legal, 0)[1]
    return _with(legal, restage(legal, 0, list(staged.items), ["pay"]))


@_case("a final batch leaving a result unpublished",
       ("stage_publication", "batch_publishes_every_result"))
def _final_batch_short() -> tuple[Legal, Events, int]:
    legal = tool_answer_run()
    items = [*_items("a", "a out"), {"role": "assistant", "content": "b out"}]
    return _with(legal, restage(legal, 0, items, ["a"]))


@_case("a batch item altered", ("stage_publication", "batch_digests_match"))
def _altered_item() -> tuple[Legal, Events, int]:
    legal = approvals_run()
    index, staged = _staged_at(legal, 0)
    items = list(staged.items)
    item = items[1]
    assert isinstance(item, dict)
    items[1] = {**item, "output": "paid 500"}
    return _with(legal, replace(legal.events, index, items=tuple(items)))


@_case("a read limit larger than needed", ("stage_publication", "read_limit_is_minimal"))
def _read_limit() -> tuple[Legal, Events, int]:
    legal = approvals_run()
    index, staged = _staged_at(legal, 0)
    return _with(legal, replace(legal.events, index, read_limit=staged.read_limit + 1))


@_case("a continuation the ledger does not imply", ("stage_publication", "continuation_matches"))
def _continuation() -> tuple[Legal, Events, int]:
    legal = approvals_run()
    index, staged = _staged_at(legal, 0)
    assert staged.continuation is Step.TOOLS
    return _with(legal, replace(legal.events, index, continuation=Step.INTERRUPTION))


@_case("a commit without an attempt", ("publication_committed", "attempt_open"))
def _commit_without_attempt() -> tuple[Legal, Events, int]:
    legal = approvals_run()
    forged = delete(legal.events, at(legal.events, ev.ReconciledAppend))
    return legal, forged, at(forged, ev.PublicationCommitted)


@_case("a write failed twice", ("publication_failed", "attempt_open"))
def _failed_twice() -> tuple[Legal, Events, int]:
    legal = approvals_run()
    index = at(legal.events, ev.PublicationFailed)
    return _with(legal, insert(legal.events, index + 1, legal.events[index]))


@_case("an acknowledge of a fail-closed envelope",
       ("reconcile_acknowledge", "envelope_reconcilable"))
def _acknowledge_fail_closed() -> tuple[Legal, Events, int]:
    legal = fail_closed_run()
    index = at(legal.events, ev.PublicationCommitted)
    events = list(legal.events)
    events[index] = ev.ReconciledAcknowledge(index, True)
    return legal, events, index


@_case("an append decision on a fail-closed envelope",
       ("reconcile_append", "envelope_reconcilable"))
def _append_fail_closed() -> tuple[Legal, Events, int]:
    legal = fail_closed_run()
    index = at(legal.events, ev.PublicationCommitted)
    events = list(legal.events)
    events[index] = ev.ReconciledAppend(index, True)
    return legal, events, index


@_case("a claim of a fail-closed unsettled run", ("claim", "envelope_reconcilable"))
def _claim_fail_closed() -> tuple[Legal, Events, int]:
    legal = fail_closed_run()
    index = at(legal.events, ev.PublicationCommitted)
    return _with(legal, insert(legal.events, index, ev.RunClaimed(index, "second-process")))


@_case("an append decision while the attempt may still write",
       ("reconcile_append", "no_attempt_or_take_over"))
def _append_over_attempt() -> tuple[Legal, Events, int]:
    legal = approvals_run()
    forged = delete(legal.events, at(legal.events, ev.PublicationFailed))
    return legal, forged, at(forged, ev.ReconciledAppend)


@_case("remote calls reusing a call id", ("receive_tool_calls", "calls_are_new"))
def _remote_reused() -> tuple[Legal, Events, int]:
    legal = remote_run()
    index = at(legal.events, ev.ToolCallsReceived, 1)
    return _with(legal, replace(legal.events, index,
                                tool_calls=(ToolCall("r1", "lookup", {"q": 2}),)))


@_case("a remote call needing approval", ("receive_tool_calls", "calls_without_approval"))
def _remote_gated() -> tuple[Legal, Events, int]:
    legal = remote_run()
    index = at(legal.events, ev.ToolCallsReceived, 1)
    return _with(legal, replace(legal.events, index, tool_calls=(
        ToolCall("r2", "lookup", {"q": 2}, needs_approval=True),)))


@_case("a result posted twice", ("result_posted", "result_unpublished"))
def _posted_twice() -> tuple[Legal, Events, int]:
    legal = remote_run()
    index = at(legal.events, ev.ResultPosted, call_id="r1")
    return _with(legal, insert(legal.events, index + 1, legal.events[index]))


@_case("a failed post of a posted result", ("result_post_failed", "result_unpublished"))
def _post_failed_after_posted() -> tuple[Legal, Events, int]:
    legal = remote_run()
    index = at(legal.events, ev.ResultPosted, call_id="r1")
    return _with(legal, insert(legal.events, index + 1,
                               ev.ResultPostFailed(index + 1, "r1", "TimeoutError")))


# ------------------------------------------------- pairs no log can break alone

Triple = tuple[Step, str, str]
"""A guard of one row of `TABLE`: (the step the run is in, trigger, guard)."""


def implied(step: Step, trigger: str, guard: str) -> str | None:
    """Why no log can break ``guard`` alone for ``trigger`` in ``step``, or None when one
    can (then a forged log must exist). `test_the_implied_guards_cannot_fail_alone` checks
    every reason on generated runs."""
    if guard == "no_envelope":
        return ("the fold holds an envelope only in UNSETTLED (and after it in "
                "TERMINAL_UNRECOVERABLE, which has no row); no row guarded by no_envelope "
                "leaves from either: the step refuses first")
    if guard.startswith("continues_to_"):
        return ("an envelope's continuation is one of the four continues_to_* steps "
                "(continuation_matches checked it at staging), so exactly one of these rows "
                "holds: a forged continuation is refused at staging")
    if trigger == "publication_failed" and guard in ("envelope_fails_closed",
                                                     "envelope_reconcilable"):
        return ("the two publication_failed rows differ only by envelope_fails_closed / "
                "envelope_reconcilable, complements for any envelope: a failure always fires "
                "one; the route shows in what may follow (a fail-closed run refuses all)")
    if guard == "no_call_started" and step is not Step.TOOLS:
        return ("a call is started only in TOOLS (every way out of TOOLS requires "
                "no_call_started): in any other step the guard holds")
    if (step, trigger, guard) == (Step.RUN_AGAIN, "begin_model_call", "results_published"):
        return ("RUN_AGAIN is entered only with every result published (a settled batch "
                "continues to TOOLS while one is not; remote calls stay in TOOLS)")
    return None


TRIPLES: list[Triple] = sorted(
    {(step, t.trigger, name) for t in TRANSITIONS for step in t.sources for name in t.guards},
    key=lambda t: (t[1], t[2], t[0].value))
"""Enumerated from the declaration; each is checked against `TABLE`, the compiled table
the controller and the replay run, so a guard lost in compilation fails its case."""
IMPLIED: dict[Triple, str] = {
    t: reason for t in TRIPLES if (reason := implied(*t)) is not None}


def _after_first_stage(make: Callable[[int], ev.Event]) -> Callable[[], tuple[Legal, Events, int]]:
    def build() -> tuple[Legal, Events, int]:
        legal = approvals_run()
        index = at(legal.events, ev.PublicationStaged) + 1
        return _with(legal, insert(legal.events, index, make(index)))
    return build


_CALL = ToolCall("late", "late", {})
_UNSETTLED_SAMPLES: dict[str, Callable[[int], ev.Event]] = {
    "begin_model_call": ev.ModelCallBegun,
    "add_input": lambda s: ev.InputAdded(s, ({"role": "user", "content": "more"},)),
    "approve": lambda s: ev.CallApproved(s, "look", "0" * 64),
    "reject": lambda s: ev.CallRejected(s, "look", "0" * 64, "no"),
    "resume": ev.Resumed,
    "begin_tool": lambda s: ev.ToolStarted(s, "look"),
    "guardrail_evaluated": lambda s: ev.GuardrailEvaluated(
        s, GuardrailResult("late", "input", None, {"allowed": True})),
    "hook_ran": lambda s: ev.HookRan(s, "agent_start", None),
    "handoff": lambda s: ev.HandedOff(s, "other"),
    "stage_publication": lambda s: ev.PublicationStaged(
        s, SESSION, ({"n": 1},), (), 2, (), True, (), Step.TOOLS),
    "receive_tool_calls": lambda s: ev.ToolCallsReceived(s, (_CALL,)),
    "result_posted": lambda s: ev.ResultPosted(s, "pay"),
    "result_post_failed": lambda s: ev.ResultPostFailed(s, "pay", "TimeoutError"),
}


def _implied_forgeries() -> list[Forgery]:
    out = [Forgery(f"{trigger} while unsettled", ((trigger, "no_envelope"),),
                   _after_first_stage(make), "step")
           for trigger, make in _UNSETTLED_SAMPLES.items()]

    def continuation(step: Step, nth: int) -> Callable[[], tuple[Legal, Events, int]]:
        def build() -> tuple[Legal, Events, int]:
            legal = approvals_run()
            index, staged = _staged_at(legal, nth)
            assert staged.continuation is not step
            return _with(legal, replace(legal.events, index, continuation=step))
        return build

    for step in (Step.COMPLETED, Step.TOOLS, Step.INTERRUPTION, Step.RUN_AGAIN):
        pairs = tuple((t, f"continues_to_{step.value}")
                      for t in ("publication_committed", "reconcile_acknowledge"))
        out.append(Forgery(f"an envelope recorded to continue to {step.value}", pairs,
                           continuation(step, 2 if step is Step.TOOLS else 0),
                           "continuation_matches"))

    def reconciled_after_fail_closed() -> tuple[Legal, Events, int]:
        legal = fail_closed_failed_run()
        n = len(legal.events)
        return legal, [*legal.events, ev.ReconciledAppend(n, True)], n

    out.append(Forgery("a fail-closed failed write reconciled",
                       (("publication_failed", "envelope_fails_closed"),
                        ("publication_failed", "envelope_reconcilable")),
                       reconciled_after_fail_closed, "step"))

    def handoff_while_running() -> tuple[Legal, Events, int]:
        legal = tool_answer_run()
        index = at(legal.events, ev.ToolStarted, call_id="b") + 1
        return _with(legal, insert(legal.events, index, ev.HandedOff(index, "other")))

    out.append(Forgery("a handoff while a tool runs", (("handoff", "no_call_started"),),
                       handoff_while_running, "step"))
    return out


FORGERIES: list[Forgery] = [
    value for value in list(globals().values()) if isinstance(value, Forgery)
] + _implied_forgeries()


# ------------------------------------------------------------------------ checks


def _failing(row: tuple[tuple[str, Any], ...], state: RunState, event: ev.Event) -> set[str]:
    """Every guard of ``row`` that does not hold, all evaluated (not first-fail). A guard
    that cannot be evaluated because an earlier one refused (it reads a call the event
    invents) is not counted: the machine never reaches it."""
    failing: set[str] = set()
    for name, check in row:
        try:
            holds = check(state, event)
        except (KeyError, AttributeError):
            if failing:
                continue
            raise
        if not holds:
            failing.add(name)
    return failing


def _loads(events: Sequence[ev.Event], tmp_path: Path, tag: str) -> list[Callable[[], Any]]:
    """Every door a log comes in by."""
    doc = codec.encode_log(RUN, list(events))
    memory = MemoryEventStore()
    memory.append(RUN, list(events), 0)
    sqlite = SQLiteEventStore(tmp_path / f"{tag}.db")
    sqlite.append(RUN, list(events), 0)
    return [
        lambda: RunController.from_json(doc),
        lambda: RunController.from_json(json.dumps(doc)),
        lambda: replay(RUN, codec.decode_log(doc).events),
        lambda: RunController.load(memory, RUN),
        lambda: RunController.load(sqlite, RUN, snapshot=False),
        lambda: RunController.load(sqlite, RUN),
    ]


def check_forgery(forgery: Forgery, tmp_path: Path) -> None:
    legal, forged, index = forgery.build()
    # not vacuous: the log it came from loads by every door
    for load in _loads(legal.events, tmp_path, "legal"):
        load()
    # the forgery is well-formed up to the forged event, which is the first refused
    prefix = replay(RUN, forged[:index])
    event = forged[index]
    assert [e.seq for e in forged] == list(range(len(forged)))
    if forgery.refused_by is None:
        assert {trigger for trigger, _ in forgery.pairs} == {event.TRIGGER}, event
    rows = TABLE.get((prefix.step, event.TRIGGER))
    if forgery.refused_by is None:
        assert rows is not None, f"{event.TRIGGER} has no row in {prefix.step}"
        for trigger, guard in forgery.pairs:
            alone = [r for r, _ in rows if guard in dict(r)
                     and _failing(r, prefix, event) == {guard}]
            assert alone, (f"{forgery.name}: no row of {trigger} in {prefix.step.name} fails "
                           f"on {guard} alone: "
                           f"{[sorted(_failing(r, prefix, event)) for r, _ in rows]}")
        expected = [re.escape(f"guard {guard} failed") for _, guard in forgery.pairs]
    elif forgery.refused_by == "step":
        assert rows is None, f"{event.TRIGGER} has a row in {prefix.step}"
        expected = [r"is allowed only in"]
    else:
        assert rows is not None
        expected = [re.escape(f"guard {forgery.refused_by} failed")]
    with pytest.raises(Refused):
        fire(prefix, event.TRIGGER, event)
    for n, load in enumerate(_loads(forged, tmp_path, "forged")):
        with pytest.raises(InvalidTransition) as info:
            load()
        assert type(info.value) is InvalidTransition, n
        message = str(info.value)
        assert f"refused load: event {index} ({type(event).__name__}) is forbidden" in message, (
            n, message)
        for pattern in expected:
            assert re.search(pattern, message), (n, message)


@pytest.mark.invariant("I10")
@pytest.mark.parametrize("forgery", FORGERIES, ids=[f.name for f in FORGERIES])
def test_a_log_breaking_one_guard_is_refused_on_load(forgery: Forgery, tmp_path: Path) -> None:
    check_forgery(forgery, tmp_path)


def test_the_staging_forger_records_what_the_controller_records() -> None:
    """`restaged` with a legal batch rebuilds the legal event bit for bit, so a forged
    staging differs from a real one only where the case says."""
    for legal in (approvals_run(), tool_answer_run(), handoff_run()):
        for nth in range(sum(type(e) is ev.PublicationStaged for e in legal.events)):
            index, staged = _staged_at(legal, nth)
            again = restaged(legal.events[:index], legal.histories[index],
                             list(staged.items), staged.call_ids)
            assert again == staged


# ------------------------------------------- every guard of every row of the table

Found = tuple[str, Events, int]
Forger = Callable[[Legal, int, RunState], tuple[Events, int] | None]
"""Given a legal log, a position and the state the log reaches there (after its first
``i`` events), a forged log and the index of its forged event, or None."""


def _twice(legal: Legal, i: int, make: Callable[[int], ev.Event], recorded: bool
           ) -> tuple[Events, int]:
    """Insert ``make`` once when what it records is recorded already, else twice (the
    first is legal, the second the repeat)."""
    forged, _ = insert(legal.events, i, make(i))
    if recorded:
        return forged, i
    forged, _ = insert(forged, i + 1, make(i + 1))
    return forged, i + 1


_REPEATED_GUARDRAIL = GuardrailResult("forged", "output", None, {"allowed": True})


def _hook_repeated(legal: Legal, i: int, s: RunState) -> tuple[Events, int] | None:
    return _twice(legal, i, lambda n: ev.HookRan(n, "agent_end", None),
                  s.hook_key("agent_end", None) in s.hook_keys)


def _guardrail_repeated(legal: Legal, i: int, s: RunState) -> tuple[Events, int] | None:
    return _twice(legal, i, lambda n: ev.GuardrailEvaluated(n, _REPEATED_GUARDRAIL),
                  s.guardrail_key(_REPEATED_GUARDRAIL) in s.guardrail_keys)


def _inserted(make: Callable[[int, RunState], ev.Event | None]) -> Forger:
    def forge(legal: Legal, i: int, s: RunState) -> tuple[Events, int] | None:
        event = make(i, s)
        return None if event is None else insert(legal.events, i, event)
    return forge


def _at_event(kind: type[ev.Event], make: Callable[[Legal, int, RunState, Any],
                                                   tuple[Events, int] | None]) -> Forger:
    """A forger that rewrites the log's own event of type ``kind`` at ``i``."""
    def forge(legal: Legal, i: int, s: RunState) -> tuple[Events, int] | None:
        if i >= len(legal.events) or type(legal.events[i]) is not kind:
            return None
        return make(legal, i, s, legal.events[i])
    return forge


def _restaged_at(legal: Legal, i: int, items: Sequence[JSON], call_ids: Sequence[str],
                 **changes: Any) -> tuple[Events, int]:
    event = restaged(legal.events[:i], legal.histories[i], list(items), call_ids, **changes)
    events = list(legal.events)
    events[i] = event
    return events, i


def _altered_first(items: tuple[JSON, ...]) -> tuple[JSON, ...]:
    first = items[0]
    changed: JSON = {**first, "forged": True} if isinstance(first, dict) else {"was": first}
    return (changed, *items[1:])


def _without(items: tuple[JSON, ...], call_id: str) -> list[JSON]:
    return [item for item in items
            if not (isinstance(item, dict) and item.get("call_id") == call_id)]


def _other_step(step: Step) -> Step:
    return Step.TOOLS if step is Step.RUN_AGAIN else Step.RUN_AGAIN


_STAGED = ev.PublicationStaged
_RECEIVED = ev.ToolCallsReceived
GENERIC: dict[Pair, tuple[Forger, ...]] = {
    ("hook_ran", "hook_not_repeated"): (_hook_repeated,),
    ("hook_ran", "hook_fits_scope"): (
        _inserted(lambda n, s: ev.HookRan(n, "tool_start", "ghost")),),
    ("guardrail_evaluated", "guardrail_not_repeated"): (_guardrail_repeated,),
    ("guardrail_evaluated", "guardrail_fits_stage"): (_inserted(
        lambda n, s: ev.GuardrailEvaluated(
            n, GuardrailResult("forged", "tool_input", "ghost", {"allowed": True}))),),
    ("begin_model_call", "results_published"): (_inserted(
        lambda n, s: ev.ModelCallBegun(n) if s.unpublished_results() else None),),
    ("begin_model_call", "turns_left"): (_at_event(
        ev.ModelCallBegun,
        lambda legal, i, s, e: (replace(legal.events, 0, max_turns=s.turns)[0], i)),),
    ("stage_publication", "batch_not_empty"): (_at_event(
        _STAGED, lambda legal, i, s, e: _restaged_at(legal, i, [], [])),),
    ("stage_publication", "batch_session_matches"): (_at_event(
        _STAGED, lambda legal, i, s, e: replace(legal.events, i, session_id="other")),),
    ("stage_publication", "batch_names_its_calls"): (
        _at_event(_STAGED, lambda legal, i, s, e: _restaged_at(
            legal, i, e.items, (*e.call_ids, "ghost"))),
        _at_event(_STAGED, lambda legal, i, s, e: _restaged_at(
            legal, i, e.items, ("ghost", *e.call_ids[1:])) if e.call_ids else None),
    ),
    ("stage_publication", "batch_digests_match"): (_at_event(
        _STAGED, lambda legal, i, s, e: replace(legal.events, i,
                                                items=_altered_first(e.items))),),
    ("stage_publication", "read_limit_is_minimal"): (_at_event(
        _STAGED, lambda legal, i, s, e: replace(legal.events, i,
                                                read_limit=e.read_limit + 1)),),
    ("stage_publication", "continuation_matches"): (_at_event(
        _STAGED, lambda legal, i, s, e: replace(legal.events, i,
                                                continuation=_other_step(e.continuation))),),
    ("stage_publication", "batch_publishes_every_result"): (_at_event(
        _STAGED, lambda legal, i, s, e: _restaged_at(
            legal, i, _without(e.items, e.call_ids[-1]), e.call_ids[:-1])
        if e.call_ids else None),),
    ("stage_publication", "no_call_started"): (_at_event(
        _STAGED, lambda legal, i, s, e: next(
            ((forged, i + 1) for call_id, record in s.calls.items()
             if record.phase is Phase.APPROVED
             for forged, _ in [insert(legal.events, i, ev.ToolStarted(i, call_id))]),
            None)),),
    ("receive_tool_calls", "calls_are_new"): (_at_event(
        _RECEIVED, lambda legal, i, s, e: replace(legal.events, i, tool_calls=(
            ToolCall(next(iter(s.calls)), "lookup", {}),)) if s.calls else None),),
    ("receive_tool_calls", "calls_without_approval"): (_at_event(
        _RECEIVED, lambda legal, i, s, e: replace(legal.events, i, tool_calls=tuple(
            attrs.evolve(c, needs_approval=True) for c in e.tool_calls))),),
}


_BUILT: dict[str, tuple[Legal, list[RunState]]] = {}


def _legal_logs() -> dict[str, tuple[Legal, list[RunState]]]:
    """Every legal log, with the state after each of its prefixes (``states[i]``: after
    its first ``i + 1`` events)."""
    if not _BUILT:
        for name, build in LEGAL_LOGS.items():
            legal = build()
            _BUILT[name] = (legal, _states(legal.events))
    return _BUILT


def _breaks_alone(forged: Events, index: int, triple: Triple) -> bool:
    step, trigger, guard = triple
    event = forged[index]
    if trigger != event.TRIGGER or [e.seq for e in forged] != list(range(len(forged))):
        return False
    try:
        prefix = replay(RUN, forged[:index])
    except (InvalidTransition, SchemaError):
        return False
    if prefix.step is not step:
        return False
    rows = TABLE.get((step, trigger), ())
    if not any(guard in dict(r) and _failing(r, prefix, event) == {guard} for r, _ in rows):
        return False
    try:
        fire(prefix, trigger, event)
    except Refused:
        return True
    return False


def find_forgery(triple: Triple) -> Found | None:
    """A forged log breaking exactly ``triple``: a hand-written case, else the first the
    generic forgers make from a legal log at a position in that step."""
    _, trigger, guard = triple
    for forgery in FORGERIES:
        if forgery.refused_by is None and (trigger, guard) in forgery.pairs:
            _, forged, index = forgery.build()
            if _breaks_alone(forged, index, triple):
                return forgery.name, forged, index
    for forger in GENERIC.get((trigger, guard), ()):
        for name, (legal, states) in _legal_logs().items():
            for i in range(1, len(legal.events) + 1):
                if states[i - 1].step is not triple[0]:
                    continue
                made = forger(legal, i, states[i - 1])
                if made is not None and _breaks_alone(made[0], made[1], triple):
                    return f"{name} log, generic forgery at {i}", made[0], made[1]
    return None


def test_every_legal_log_loads() -> None:
    """The logs the forgeries start from are legal: the refusals come from the forging."""
    for legal, states in _legal_logs().values():
        loaded = RunController.from_json(codec.encode_log(RUN, list(legal.events)))
        assert loaded.state == states[-1]


def _triple_id(t: Triple) -> str:
    return f"{t[1]}-{t[2]}-in-{t[0].name}"


@pytest.mark.invariant("I10")
@pytest.mark.parametrize("triple", [t for t in TRIPLES if t not in IMPLIED], ids=_triple_id)
def test_every_guard_of_every_row_has_a_forged_log(triple: Triple) -> None:
    """Enumerated from `TABLE`: a row's guard with no forged log fails here, so a new guard
    (or a new source step of a row) needs a forged case or an `implied` reason."""
    found = find_forgery(triple)
    assert found is not None, (f"no forged log breaks {triple[2]} alone for {triple[1]} in "
                               f"{triple[0].name}: add a case, or a reason to implied()")
    name, forged, index = found
    event = forged[index]
    with pytest.raises(InvalidTransition) as info:
        RunController.from_json(codec.encode_log(RUN, forged))
    message = str(info.value)
    assert f"refused load: event {index} ({type(event).__name__})" in message, (name, message)
    assert f"guard {triple[2]} failed" in message, (name, message)


def test_every_guard_is_enumerated_and_implied_ones_still_have_a_refused_log() -> None:
    assert {g for _, _, g in TRIPLES} == set(GUARDS), "a guard no row uses, or an unknown one"
    compiled = {(step, trigger, name) for (step, trigger), rows in TABLE.items()
                for guards, _ in rows for name, _ in guards}
    assert compiled == set(TRIPLES), "TABLE and the declaration name different guards"
    pairs = {(t, g) for _, t, g in TRIPLES}
    only_implied = {p for p in pairs
                    if all((s, *p) in IMPLIED for s, t, g in TRIPLES if (t, g) == p)}
    refused = {p for f in FORGERIES if f.refused_by is not None for p in f.pairs}
    assert only_implied <= refused, f"implied with no forged log: {only_implied - refused}"
    assert refused <= pairs


# ------------------------------------------------ the implications, over generated runs

CI_EXAMPLES = 40 if os.environ.get("CI") else 100
_SETTINGS = settings(max_examples=CI_EXAMPLES, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])


def _states(events: Sequence[ev.Event]) -> list[RunState]:
    """The state after every prefix of a legal log (each replayed from the start)."""
    return [replay(events[0].run_id, events[:n])  # type: ignore[attr-defined]
            for n in range(1, len(events) + 1)]


def _log(data: st.DataObject) -> Events:
    driven = drive(data, max_steps=30, run_id=RUN)
    return list(driven.c.events)


@_SETTINGS
@given(st.data())
def test_the_implied_guards_cannot_fail_alone(data: st.DataObject) -> None:
    events = _log(data)
    continuations = [GUARDS[f"continues_to_{s.value}"]
                     for s in (Step.COMPLETED, Step.TOOLS, Step.INTERRUPTION, Step.RUN_AGAIN)]
    for state in _states(events):
        if state.envelope is not None:
            assert state.step in (Step.UNSETTLED, Step.TERMINAL_UNRECOVERABLE), state.step
            holding = [g for g in continuations if g(state, None)]
            assert len(holding) == 1, holding
            assert GUARDS["envelope_fails_closed"](state, None) != GUARDS[
                "envelope_reconcilable"](state, None)
        if state.count(Phase.STARTED):
            assert state.step in (Step.TOOLS, Step.TERMINAL_UNRECOVERABLE), state.step
        if state.step is Step.RUN_AGAIN:
            assert state.unpublished_results() == 0
    for t in TRANSITIONS:
        if "no_envelope" in t.guards:
            assert not {Step.UNSETTLED, Step.TERMINAL_UNRECOVERABLE} & set(t.sources), t
        if t.trigger == "handoff":
            assert not {Step.TOOLS, Step.TERMINAL_UNRECOVERABLE} & set(t.sources), t


# -------------------------------------- generic forgeries over generated legal prefixes


def _duplicate_next(kind: type[ev.Event], pick: Callable[[ev.Event, RunState], bool]
                    ) -> Callable[[Events, int, RunState], ev.Event | None]:
    def forge(events: Events, i: int, state: RunState) -> ev.Event | None:
        e = events[i - 1]
        return attrs.evolve(e, seq=i) if type(e) is kind and pick(e, state) else None
    return forge


def _refingerprinted(events: Events, i: int, state: RunState) -> ev.Event | None:
    e = events[i]
    if isinstance(e, ev.CallApproved | ev.CallRejected):
        return attrs.evolve(e, fingerprint="f" * 64)
    return None


def _commit_after_failure(events: Events, i: int, state: RunState) -> ev.Event | None:
    if type(events[i - 1]) is ev.PublicationFailed and state.step is Step.UNSETTLED:
        return ev.PublicationCommitted(i)
    return None


ON_GENERATED: dict[str, tuple[str, bool, Callable[[Events, int, RunState], ev.Event | None]]] = {
    # name: (guard, replaces the event at i (else inserts), forger)
    "guardrail repeated": ("guardrail_not_repeated", False,
                           _duplicate_next(ev.GuardrailEvaluated, lambda e, s: True)),
    "non-idempotent start repeated": ("call_can_start", False, _duplicate_next(
        ev.ToolStarted, lambda e, s: not s.calls[e.call_id].call.idempotent)),  # type: ignore[attr-defined]
    "result recorded twice": ("call_started", False,
                              _duplicate_next(ev.ToolCompleted, lambda e, s: True)),
    "decision under another fingerprint": ("fingerprint_matches", True, _refingerprinted),
    "commit after a failed write": ("attempt_open", False, _commit_after_failure),
}


@pytest.mark.invariant("I10")
@_SETTINGS
@given(st.data())
def test_generated_logs_with_one_guard_broken_are_refused(data: st.DataObject) -> None:
    events = _log(data)
    states = _states(events)
    for name, (guard, replaces, forge) in ON_GENERATED.items():
        for i in range(1, len(events)):
            made = forge(events, i, states[i - 1])
            if made is None:
                continue
            forged = [*events[:i], made, *events[i + (1 if replaces else 0):]]
            forged = renumber(forged)
            rows = TABLE.get((states[i - 1].step, made.TRIGGER))
            assert rows is not None, name
            assert any(_failing(r, states[i - 1], made) == {guard} for r, _ in rows), name
            refused = rf"refused load: event {i} .*guard {guard} failed"
            with pytest.raises(InvalidTransition, match=refused):
                RunController.from_json(codec.encode_log(RUN, forged))
            break  # one site per forger per example keeps the budget bounded
    RunController.from_json(codec.encode_log(RUN, events))  # the unforged log loads


@pytest.mark.parametrize("event", [
    ev.CallApproved(6, "unknown", "f" * 64),
    ev.CallRejected(6, "unknown", "f" * 64, "no"),
], ids=["approve", "reject"])
def test_each_guard_of_a_decision_answers_alone_for_an_unknown_call(event: Any) -> None:
    """A guard is a predicate on its own: for a decision naming a call the run never saw,
    each guard of the decision's rows answers True or False whatever its place in the row
    (none leans on an earlier guard having checked that the call exists), so a forged
    decision is refused with `InvalidTransition`, never a `KeyError`, in any order."""
    state = at_interruption().state
    names = {name for t in TRANSITIONS if t.trigger == event.TRIGGER for name in t.guards}
    assert "fingerprint_matches" in names
    for name in sorted(names):
        assert type(GUARDS[name](state, event)) is bool, name


# ------------------------------------------ forged by hand: rules the controller checks first
# The controller checks these rules before it records, so only a log edited outside it
# shows whether replay checks them too (I10: a log is re-validated as it is loaded).


def _forged(c: RunController, *extra: dict[str, Any]) -> dict[str, Any]:
    """``c``'s document with ``extra`` raw events appended (their seq filled in, and what
    an older event holds for each field of version 3 they do not give)."""
    doc: dict[str, Any] = c.to_json()
    for offset, raw in enumerate(extra):
        doc["events"].append({**ADDED_IN_3[raw["type"]], **raw,
                              "seq": c.version + offset})
    return doc


def _refused(doc: dict[str, Any], seq: int) -> None:
    with pytest.raises(InvalidTransition) as info:
        RunController.from_json(doc)
    assert f"event {seq}" in str(info.value)


@pytest.mark.invariant("I10", "I11")
def test_a_log_starting_a_non_idempotent_call_twice_is_refused() -> None:
    # MA11: I11, a started non-idempotent call is never started again
    c = tools_run(ToolCall("pay", "pay", {"x": 1}), ToolCall("look", "look", {},
                                                                idempotent=True))
    c.begin_tool("pay")
    c.begin_tool("look")
    _refused(_forged(c, {"type": "ToolStarted", "call_id": "pay"}), c.version)
    # the same second start of the idempotent call is legal: the flag is what decides
    again = RunController.from_json(_forged(c, {"type": "ToolStarted", "call_id": "look"}))
    assert again.call("look").starts == 2


@pytest.mark.invariant("I10")
def test_a_log_completing_a_call_never_started_is_refused() -> None:
    # MA12: a result belongs to a started call
    c = tools_run(ToolCall("pay", "pay", {}))
    for kind in ("ToolCompleted", "InDoubtResolved"):
        _refused(_forged(c, {"type": kind, "call_id": "pay", "output": "paid"}), c.version)
    c.begin_tool("pay")
    done = RunController.from_json(_forged(c, {"type": "ToolCompleted", "call_id": "pay",
                                               "output": "paid"}))
    assert done.phase("pay") is Phase.COMPLETED


@pytest.mark.invariant("I10")
def test_a_log_appending_over_an_open_attempt_is_refused() -> None:
    # MA24: reconcile decides Append only when no attempt may still be writing
    c = staged()
    assert c.state.attempt_seq is not None
    _refused(_forged(c, {"type": "ReconciledAppend", "take_over": False}), c.version)
    taken = RunController.from_json(_forged(c, {"type": "ReconciledAppend",
                                                "take_over": True}))
    assert taken.state.attempt_seq == c.version


@pytest.mark.invariant("I10")
def test_a_log_claiming_a_fail_closed_unsettled_run_is_refused() -> None:
    # MA25: a fail-closed envelope refuses every attempt, so no claim is ever recorded
    closed = staged(RecoveryPolicy.FAIL_CLOSED)
    _refused(_forged(closed, {"type": "RunClaimed", "owner": None}), closed.version)
    open_ = staged(RecoveryPolicy.RECONCILE)
    assert RunController.from_json(_forged(open_, {"type": "RunClaimed", "owner": "w"}
                                           )).step is Step.UNSETTLED


@pytest.mark.invariant("I10")
def test_a_log_committing_with_no_attempt_open_is_refused() -> None:
    # MA32: after publication_failed the attempt is over; only reconcile may settle
    c = failed()
    assert c.state.attempt_seq is None
    _refused(_forged(c, {"type": "PublicationCommitted"}), c.version)
    committed = RunController.from_json(_forged(staged(), {"type": "PublicationCommitted"}))
    assert committed.step is not Step.UNSETTLED


@pytest.mark.invariant("I10")
def test_a_log_resuming_with_nothing_approved_is_refused() -> None:
    # MA10: resume enters TOOLS only for an approved, unstarted call
    c = at_interruption()
    _refused(_forged(c, {"type": "Resumed"}), c.version)
    c.approve("charge")
    assert RunController.from_json(_forged(c, {"type": "Resumed"})).step is Step.TOOLS


def _last_staging(doc: dict[str, Any]) -> dict[str, Any]:
    staging: dict[str, Any] = [e for e in doc["events"] if e["type"] == "PublicationStaged"][-1]
    return staging


@pytest.mark.invariant("I10")
def test_a_log_recording_a_read_limit_larger_than_needed_is_refused() -> None:
    # MA21, EN09: the recorded read limit is the smallest that tells the outcomes apart;
    # a larger one (with a frontier long enough to match it) is forged
    history: list[JSON] = [{"h": i} for i in range(5)]
    c = staged_over(history, [{"n": 9}])
    doc = c.to_json()
    staging = _last_staging(doc)
    form = c.state.form
    # five distinct items and a new one: the last 2 tell "nothing written" from "written"
    assert staging["read_limit"] == 2
    assert staging["frontier"] == list(digests(history[-2:], form))
    assert RunController.from_json(doc).step is Step.UNSETTLED
    staging["read_limit"] = 3
    staging["frontier"] = list(digests(history[-3:], form))
    _refused(doc, staging["seq"])


@pytest.mark.invariant("I10")
def test_a_log_recording_another_continuation_is_refused() -> None:
    # MA22: the continuation is implied by the ledger (notify still awaits a decision)
    c = staged()
    doc = c.to_json()
    staging = _last_staging(doc)
    assert staging["continuation"] == Step.INTERRUPTION.value
    staging["continuation"] = Step.RUN_AGAIN.value
    _refused(doc, staging["seq"])


@pytest.mark.invariant("I10")
def test_a_log_whose_batch_does_not_match_its_digests_is_refused() -> None:
    # MA31: the staged items are the batch the digests describe (reconcile compares the
    # Session with the digests, the runner writes the items)
    c = staged()
    doc = c.to_json()
    staging = _last_staging(doc)
    staging["items"][0] = {"type": "function_call", "call_id": "charge", "name": "refund"}
    _refused(doc, staging["seq"])


@pytest.mark.invariant("I10")
def test_a_document_whose_run_id_is_not_its_logs_is_refused() -> None:
    # MA35: the RunStarted names the run; a document relabelled as another run is forged
    c = at_interruption()
    doc = c.to_json()
    doc["run_id"] = "another-run"
    with pytest.raises(SchemaError):
        RunController.from_json(doc)
    with pytest.raises(SchemaError):
        replay("another-run", list(c.events))
