"""The machine: every step of a run, every trigger, every guard, declared once.

Theory of operation
-------------------
A run is always in exactly one `Step`. Every change to it is an event (see `events`),
and every event fires one *trigger*. `TRANSITIONS` below is the whole declaration: for
each trigger, the steps it may fire from, the step it leads to, and the guards (named
predicates over the run's state and the event) that must all hold. Where one trigger has
several rows for the same step, the first row whose guards all hold wins; that is how
``model_responded`` and the settling triggers choose their destination from data.

The declaration is plain data. From it we build

* a `transitions.Machine` (`build_transitions_machine`), used by the diagrams and by a
  differential test that proves it agrees with the hot path on every event sequence;
* `TABLE`, a dict compiled from the same rows (and `ROWS`, the same by event class):
  one lookup of (step, trigger), then the guards in order. `destination` walks it, and
  it is the one answer to "may this event fire, and where to" that the controller and
  the replay ask; `RunState.apply` then folds the event in.

The sets of steps, hooks and stages the declaration speaks of live in `values`, beside
the enums, because the fold speaks of them too.

What must not live here: I/O, the event log, the ledger's bookkeeping (that is the fold
in `state`), and anything the controller knows that the log does not (which attempt this
process holds, which calls it has in flight). Guards see only the state and the event,
so replaying a log re-checks exactly what the live run checked.

The shape of the machine, in words: a run waits for the model (``RUN_AGAIN``), the model
answers with calls (``INTERRUPTION`` when one needs a human decision, else ``TOOLS``) or
with an output (``FINALIZING``); an accepted output is ``FINAL_OUTPUT``. Before any
fallible write of completed work the runner stages a publication and the run is
``UNSETTLED``: from there only commit, fail, reconcile and abandon move it, which is
invariant I2 (a ``claim``, which changes nothing, is accepted there too). ``COMPLETED``
and ``TERMINAL_UNRECOVERABLE`` have no way out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs

from statemachine import events as ev
from statemachine.envelope import is_read_limit
from statemachine.errors import InvalidTransition, SchemaError
from statemachine.payloads import digests
from statemachine.state import RunState
from statemachine.values import (
    GUARDRAIL_STAGES,
    HOOKS,
    LIVE_STEPS,
    PARTIAL_STAGING_STEPS,
    TOOL_HOOKS,
    TOOL_STAGES,
    WORKING_STEPS,
    Phase,
    Resolution,
    Step,
)

SETTLING_TRIGGERS = frozenset(
    {"publication_committed", "publication_failed", "reconcile_append",
     "reconcile_acknowledge", "abandon"}
)
"""The triggers that move an ``UNSETTLED`` run (I2): besides them it accepts only the
`NEUTRAL_TRIGGERS`."""
NEUTRAL_TRIGGERS = frozenset({"claim"})
"""Triggers that change no step, envelope or ledger (``claim``): every live step accepts
them, ``UNSETTLED`` included. They are not settling triggers: they settle nothing and get
no share of the events reserved under ``max_events`` for settling or closing a run."""


# --------------------------------------------------------------------------- guards
# A guard takes the run's state and the event being fired, and returns whether the
# transition may be taken. Its docstring says, in one voice, what must hold; a refusal
# quotes it ("requires ..."). Its name is drawn on the diagram's edge.

Guard = Callable[["RunState", Any], bool]
GUARDS: dict[str, Guard] = {}


def guard(fn: Guard) -> Guard:
    GUARDS[fn.__name__] = fn
    return fn


@guard
def no_envelope(s: RunState, e: Any) -> bool:
    """no publication envelope is unsettled"""
    return s.envelope is None


@guard
def turns_left(s: RunState, e: Any) -> bool:
    """a turn is left under max_turns (when none is, call abandon("max_turns"))"""
    return s.max_turns is None or s.turns < s.max_turns


@guard
def results_published(s: RunState, e: Any) -> bool:
    """every tool result is published before the model is called again"""
    return s.unpublished_results() == 0


@guard
def calls_are_new(s: RunState, e: Any) -> bool:
    """the response's call ids are unique and new to the run"""
    ids = {c.call_id for c in e.tool_calls}
    return len(ids) == len(e.tool_calls) and s.calls.keys().isdisjoint(ids)


@guard
def a_call_awaits_decision(s: RunState, e: Any) -> bool:
    """a proposed call needs approval"""
    return any(c.needs_approval for c in e.tool_calls)


@guard
def calls_without_approval(s: RunState, e: Any) -> bool:
    """the response has calls and none needs approval"""
    return bool(e.tool_calls) and not any(c.needs_approval for c in e.tool_calls)


@guard
def output_only(s: RunState, e: Any) -> bool:
    """the response has an output and no calls (a response needs one or the other)"""
    return not e.tool_calls and e.output is not None


@guard
def result_unpublished(s: RunState, e: Any) -> bool:
    """the call has a completed, unpublished result"""
    record = s.calls.get(e.call_id)
    return record is not None and record.phase == Phase.COMPLETED


@guard
def call_awaits_decision(s: RunState, e: Any) -> bool:
    """the call exists and awaits a decision"""
    record = s.calls.get(e.call_id)
    return record is not None and record.phase == Phase.AWAITING


@guard
def fingerprint_matches(s: RunState, e: Any) -> bool:
    """the decision's fingerprint matches the call's name and arguments"""
    record = s.calls.get(e.call_id)  # (an unknown call is call_awaits_decision's to refuse)
    return record is None or bool(record.fingerprint == e.fingerprint)


@guard
def approved_call_unstarted(s: RunState, e: Any) -> bool:
    """an approved call is waiting to run"""
    return s.count(Phase.APPROVED) > 0


@guard
def call_can_start(s: RunState, e: Any) -> bool:
    """the call is approved and unstarted (or started, idempotent and unfinished)"""
    record = s.calls.get(e.call_id)
    if record is None:
        return False
    phase = record.phase
    return phase is Phase.APPROVED or (phase is Phase.STARTED and record.call.idempotent)


@guard
def call_started(s: RunState, e: Any) -> bool:
    """the call is started and not completed"""
    record = s.calls.get(e.call_id)
    return record is not None and record.phase == Phase.STARTED


@guard
def resolution_fits(s: RunState, e: Any) -> bool:
    """a resolution NOT_EXECUTED carries no output (the call's next run gives the model
    its output)"""
    return e.outcome is not Resolution.NOT_EXECUTED or e.output is None


@guard
def guardrail_fits_stage(s: RunState, e: Any) -> bool:
    """the stage is input, output, tool_input or tool_output, and tool stages name a
    known call while the others name none"""
    r = e.result
    stage = r.stage
    if stage not in GUARDRAIL_STAGES:
        return False
    if stage in TOOL_STAGES:
        return r.call_id is not None and r.call_id in s.calls
    return r.call_id is None


@guard
def guardrail_not_repeated(s: RunState, e: Any) -> bool:
    """this guardrail has not run yet for this call or activation (I1)"""
    return s.guardrail_key(e.result) not in s.guardrail_keys


@guard
def hook_fits_scope(s: RunState, e: Any) -> bool:
    """the hook is agent_start, agent_end, model_start, model_end, tool_start or
    tool_end, and tool hooks name a known call while the others name none"""
    hook = e.hook
    if hook not in HOOKS:
        return False
    if hook in TOOL_HOOKS:
        return e.call_id is not None and e.call_id in s.calls
    return e.call_id is None


@guard
def hook_not_repeated(s: RunState, e: Any) -> bool:
    """this hook has not run yet for this call, model call or activation (I1)"""
    return s.hook_key(e.hook, e.call_id) not in s.hook_keys


@guard
def no_call_started(s: RunState, e: Any) -> bool:
    """no call is started and not completed"""
    return s.count(Phase.STARTED) == 0


@guard
def run_has_no_session(s: RunState, e: Any) -> bool:
    """the run has no Session (a run with one completes when its final batch settles)"""
    return s.session_id is None


@guard
def nothing_unpublished(s: RunState, e: Any) -> bool:
    """no tool result or guardrail result is unpublished"""
    return s.unpublished_results() == 0 and not s.pending_guardrails


@guard
def batch_not_empty(s: RunState, e: Any) -> bool:
    """the batch has at least one item"""
    return len(e.items) > 0


@guard
def batch_session_matches(s: RunState, e: Any) -> bool:
    """the envelope names the run's Session"""
    return bool(e.session_id == s.session_id)


@guard
def batch_names_its_calls(s: RunState, e: Any) -> bool:
    """call_ids names the calls this batch publishes: every call an item names that has
    an unpublished result, only such calls, once each"""
    listed = set(e.call_ids)
    if len(listed) != len(e.call_ids):
        return False
    for call_id in listed:
        record = s.calls.get(call_id)
        if record is None or record.phase not in (Phase.COMPLETED, Phase.REJECTED):
            return False
    for item in e.items:
        if type(item) is dict:
            named = item.get("call_id")
            if type(named) is str and named not in listed:
                record = s.calls.get(named)
                if record is not None and record.phase in (Phase.COMPLETED, Phase.REJECTED):
                    return False
    return True


@guard
def batch_publishes_every_result(s: RunState, e: Any) -> bool:
    """after a final output or a handoff, the batch publishes every unpublished result"""
    return s.unpublished_results() == len(e.call_ids)


@guard
def batch_digests_match(s: RunState, e: Any) -> bool:
    """the recorded batch digests are the canonical digests of the batch"""
    return bool(digests(e.items, s.form) == e.batch_digests)


@guard
def read_limit_is_minimal(s: RunState, e: Any) -> bool:
    """the recorded read limit is the smallest that tells the write's outcomes apart"""
    if len(e.frontier) > e.read_limit or (not e.frontier_whole and len(e.frontier) < e.read_limit):
        return False
    return is_read_limit(e.frontier, e.batch_digests, whole=e.frontier_whole, limit=e.read_limit)


@guard
def continuation_matches(s: RunState, e: Any) -> bool:
    """the recorded continuation is the one the ledger implies"""
    return s.continuation_after(e.call_ids) is e.continuation


@guard
def attempt_open(s: RunState, e: Any) -> bool:
    """a publication attempt is open"""
    return s.attempt_seq is not None


@guard
def envelope_fails_closed(s: RunState, e: Any) -> bool:
    """the envelope fails closed (FAIL_CLOSED policy or a lossy final output)"""
    return s.envelope is not None and s.envelope.fail_closed


@guard
def envelope_reconcilable(s: RunState, e: Any) -> bool:
    """the envelope is reconcilable (RECONCILE policy and a lossless output)"""
    return s.envelope is not None and not s.envelope.fail_closed


@guard
def no_attempt_or_take_over(s: RunState, e: Any) -> bool:
    """no attempt may still be writing (pass take_over=True only when no write of this
    batch can still land)"""
    return s.attempt_seq is None or e.take_over


def _continues_to(step: Step) -> Guard:
    def check(s: RunState, e: Any) -> bool:
        return s.envelope is not None and s.envelope.continuation is step

    check.__name__ = f"continues_to_{step.value}"
    check.__doc__ = f"the envelope's continuation is {step.value}"
    return guard(check)


for _step in (Step.COMPLETED, Step.TOOLS, Step.INTERRUPTION, Step.RUN_AGAIN):
    _continues_to(_step)


# ---------------------------------------------------------------------- declaration


@attrs.frozen
class Transition:
    """One row: ``trigger`` from any of ``sources`` to ``dest`` (None: stays) when every
    guard holds."""

    trigger: str
    sources: tuple[Step, ...]
    dest: Step | None
    guards: tuple[str, ...] = ()


def _row(trigger: str, sources: Step | tuple[Step, ...], dest: Step | None,
         *guards: str) -> Transition:
    srcs = sources if isinstance(sources, tuple) else (sources,)
    return Transition(trigger, srcs, dest, guards)


S = Step
_STAGE_CHECKS = ("no_envelope", "batch_not_empty", "batch_session_matches", "no_call_started",
                 "batch_names_its_calls", "batch_digests_match", "read_limit_is_minimal",
                 "continuation_matches")

TRANSITIONS: tuple[Transition, ...] = (
    # the model
    _row("begin_model_call", (S.RUN_AGAIN, S.HANDOFF), S.AWAITING_MODEL,
         "no_envelope", "turns_left", "results_published"),
    _row("model_failed", S.AWAITING_MODEL, S.RUN_AGAIN),
    _row("model_responded", S.AWAITING_MODEL, S.INTERRUPTION,
         "calls_are_new", "a_call_awaits_decision"),
    _row("model_responded", S.AWAITING_MODEL, S.TOOLS,
         "calls_are_new", "calls_without_approval"),
    _row("model_responded", S.AWAITING_MODEL, S.FINALIZING, "output_only"),
    _row("add_input", (S.RUN_AGAIN, S.INTERRUPTION), None, "no_envelope"),
    # decisions
    _row("approve", S.INTERRUPTION, None,
         "no_envelope", "call_awaits_decision", "fingerprint_matches"),
    _row("reject", S.INTERRUPTION, None,
         "no_envelope", "call_awaits_decision", "fingerprint_matches"),
    _row("resume", S.INTERRUPTION, S.TOOLS, "no_envelope", "approved_call_unstarted"),
    # tools
    _row("begin_tool", S.TOOLS, None, "no_envelope", "call_can_start"),
    _row("tool_completed", S.TOOLS, None, "call_started"),
    _row("resolve_in_doubt", S.TOOLS, None, "call_started", "resolution_fits"),
    # guardrails and hooks: anywhere but UNSETTLED, once each (I1)
    _row("guardrail_evaluated", WORKING_STEPS, None,
         "no_envelope", "guardrail_fits_stage", "guardrail_not_repeated"),
    _row("hook_ran", WORKING_STEPS, None, "no_envelope", "hook_fits_scope", "hook_not_repeated"),
    # final output and handoff
    _row("accept_final_output", S.FINALIZING, S.FINAL_OUTPUT),
    _row("accept_final_output", S.TOOLS, S.FINAL_OUTPUT, "no_call_started"),
    _row("complete", S.FINAL_OUTPUT, S.COMPLETED, "run_has_no_session", "nothing_unpublished"),
    _row("handoff", (S.RUN_AGAIN, S.INTERRUPTION), S.HANDOFF, "no_envelope", "no_call_started"),
    # publication: stage, then commit | fail | reconcile
    _row("stage_publication", PARTIAL_STAGING_STEPS, S.UNSETTLED, *_STAGE_CHECKS),
    _row("stage_publication", (S.FINAL_OUTPUT, S.HANDOFF), S.UNSETTLED,
         *_STAGE_CHECKS, "batch_publishes_every_result"),
    *(
        _row(trigger, S.UNSETTLED, dest, *pre, f"continues_to_{dest.value}")
        for trigger, pre in (
            ("publication_committed", ("attempt_open",)),
            ("reconcile_acknowledge", ("envelope_reconcilable",)),
        )
        for dest in (S.COMPLETED, S.TOOLS, S.INTERRUPTION, S.RUN_AGAIN)
    ),
    _row("publication_failed", S.UNSETTLED, S.TERMINAL_UNRECOVERABLE,
         "attempt_open", "envelope_fails_closed"),
    _row("publication_failed", S.UNSETTLED, None, "attempt_open", "envelope_reconcilable"),
    _row("reconcile_append", S.UNSETTLED, None, "envelope_reconcilable",
         "no_attempt_or_take_over"),
    # per-call publications (a remote event stream, keyed by call id): calls arrive in
    # any tools step and each result is posted on its own, never blocking the others
    _row("receive_tool_calls", (S.RUN_AGAIN, S.TOOLS), S.TOOLS,
         "no_envelope", "calls_are_new", "calls_without_approval"),
    _row("result_posted", S.TOOLS, None, "no_envelope", "result_unpublished"),
    _row("result_post_failed", S.TOOLS, None, "no_envelope", "result_unpublished"),
    # the first event of every attempt on an existing run: it changes nothing, so every
    # live step accepts it, UNSETTLED included (but not a fail-closed envelope, which
    # refuses every attempt); appended with the expected version, it lets exactly one of
    # the attempts that loaded the same version go on
    _row("claim", WORKING_STEPS, None),
    _row("claim", S.UNSETTLED, None, "envelope_reconcilable"),
    # the way out of every live step
    _row("abandon", LIVE_STEPS, S.TERMINAL_UNRECOVERABLE),
)

TRIGGERS: tuple[str, ...] = tuple(dict.fromkeys(t.trigger for t in TRANSITIONS))


# -------------------------------------------------------------------- compiled table

Candidate = tuple[tuple[tuple[str, Guard], ...], Step | None]
TABLE: dict[tuple[Step, str], tuple[Candidate, ...]] = {}
for _t in TRANSITIONS:
    for _src in _t.sources:
        _guards = tuple((name, GUARDS[name]) for name in _t.guards)
        TABLE[(_src, _t.trigger)] = (*TABLE.get((_src, _t.trigger), ()), (_guards, _t.dest))


ROWS: dict[tuple[Step, type[ev.Event]], tuple[tuple[tuple[Guard, ...], Step | None], ...]] = {
    (step, kind): tuple((tuple(check for _, check in guards), dest) for guards, dest in rows)
    for kind in ev.EVENT_TYPES for (step, trigger), rows in TABLE.items()
    if trigger == kind.TRIGGER
}
"""`TABLE` by event class, each row's guards without their names: what `destination` reads."""


class Refused(Exception):
    """Internal: no row of the table lets this event fire. ``failed`` names the first
    failing guard of each candidate row (empty when the step has no row at all)."""

    def __init__(self, failed: tuple[str, ...], trigger: str = "",
                 step: Step | None = None) -> None:
        super().__init__(failed)
        self.failed = failed
        self.trigger = trigger
        self.step = step

    def reason(self) -> str:
        if not self.failed:
            allowed = [s.name for s in Step if (s, self.trigger) in TABLE]
            where = ", ".join(allowed) if allowed else "no step"
            return f"{self.trigger or 'this trigger'} is allowed only in {where}"
        parts = dict.fromkeys(f"guard {name} failed (it requires: {requirement(name)})"
                              for name in self.failed)
        return "; ".join(parts)


def requirement(name: str) -> str:
    """A guard's docstring on one line: what must hold for it to pass."""
    return " ".join((GUARDS[name].__doc__ or name).split())


def fire(state: RunState, trigger: str, event: Any) -> Step:
    """The step ``event`` leads to from ``state``, walking `TABLE` by trigger with each
    guard's name; `Refused` naming the first failing guard of each row when none allows
    it. `destination` is the walk the controller and the replay take."""
    step = state.step
    candidates = TABLE.get((step, trigger))
    if candidates is None:
        raise Refused((), trigger, step)
    failed = []
    for guards, dest in candidates:
        for name, check in guards:
            if not check(state, event):
                failed.append(name)
                break
        else:
            return step if dest is None else dest
    raise Refused(tuple(failed), trigger, step)


def destination(state: RunState, event: ev.Event) -> Step:
    """May ``event`` fire from ``state``, and where to: the step of the first row of
    `ROWS` whose guards all hold (a row without a destination stays). This is the one
    such walk: the controller records, commits and replays through it, then folds with
    `RunState.apply`. `Refused` names the failed guards, as `fire` does."""
    step = state.step
    for checks, dest in ROWS.get((step, type(event)), ()):
        for check in checks:
            if not check(state, event):
                break
        else:
            return step if dest is None else dest
    fire(state, event.TRIGGER, event)  # no row lets it fire: `fire` names the failed guards
    raise AssertionError("fire accepted an event its table refused")  # pragma: no cover


def replay(run_id: str, events: Sequence[ev.Event]) -> RunState:
    """Fold a whole log, re-checking every transition and recorded fingerprint.

    `InvalidTransition` names the sequence number of the first event the machine forbids;
    `SchemaError` for a log that does not start with `RunStarted`, a sequence gap, or an
    unknown canonical form. No state is returned for a bad log."""
    if not events or type(events[0]) is not ev.RunStarted:
        raise SchemaError("the log must start with RunStarted", run_id=run_id, action="load")
    started = events[0]
    assert isinstance(started, ev.RunStarted)
    if started.run_id != run_id or started.seq != 0:
        raise SchemaError("the log's RunStarted does not match the run", run_id=run_id,
                          action="load")
    if started.max_turns is not None and started.max_turns < 0:
        raise SchemaError("a negative max_turns", run_id=run_id, action="load")
    state = RunState(started)
    replay_onto(state, events[1:], first=1)
    return state


def replay_onto(state: RunState, events: Sequence[ev.Event], *, first: int) -> None:
    """Fold ``events`` (the log from seq ``first`` on) into ``state``, checking each."""
    for position, event in enumerate(events, start=first):
        if event.seq != position:
            raise SchemaError(f"sequence gap: event {position} carries seq {event.seq}",
                              run_id=state.run_id, action="load")
        try:
            dest = destination(state, event)
        except Refused as refused:
            kind = type(event)
            reason = (f"event {position}: RunStarted after the start" if kind is ev.RunStarted
                      else f"event {position} ({kind.__name__}) is forbidden here: "
                           f"{refused.reason()}")
            raise InvalidTransition(reason, run_id=state.run_id, step=state.step,
                                    action="load") from None
        state.apply(event, dest)


def build_transitions_machine(model: Any, initial: Step = Step.RUN_AGAIN) -> Any:
    """The same declaration as a plain `transitions.Machine` (no auto transitions).

    ``model`` must expose every guard name as a method taking the ``transitions``
    event data; `GuardAdapter` builds one over a `RunState`.
    """
    from transitions import Machine

    rows = [
        {
            "trigger": t.trigger,
            "source": [s.value for s in t.sources],
            "dest": "=" if t.dest is None else t.dest.value,
            "conditions": list(t.guards),
        }
        for t in TRANSITIONS
    ]
    return Machine(
        model=model,
        states=[s.value for s in Step],
        transitions=rows,
        initial=initial.value,
        auto_transitions=False,
        send_event=True,
        model_attribute="step_value",
    )


def _adapter_method(check: Guard) -> Callable[[Any, Any], bool]:
    def method(self: Any, event_data: Any) -> bool:
        return check(self.run_state, event_data.kwargs["event"])

    return method


class GuardAdapter:
    """A `transitions` model whose guard methods (one per guard name) read a `RunState`
    and the event passed as ``trigger(name, event=...)``."""

    step_value: str

    def __init__(self, state: RunState) -> None:
        self.run_state = state


for _name, _check in GUARDS.items():
    setattr(GuardAdapter, _name, _adapter_method(_check))
