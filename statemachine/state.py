"""The run's state and the fold: state is a pure function of the event log.

`machine.destination` asks the declaration whether an event may fire and where to
(raising `Refused`), and `RunState.apply` folds an accepted event in. The controller and
the replay make the same two calls, so a log is re-validated exactly as it was recorded.
``apply`` never fails for an event ``destination`` accepted, which is what lets a refused
command leave nothing changed.
The fold performs no I/O.

Also here: `RunState.snapshot` / `RunState.restore` (the folded state as plain JSON, for
stores that keep snapshots) and `next_action`, the pure answer to "what now?".
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from typing import Any

from statemachine import events as ev
from statemachine.envelope import Envelope
from statemachine.payloads import JSON, CanonicalForm, canonical_form, fingerprint_digest
from statemachine.values import (
    HOOK_SCOPES,
    STAGING_STEPS,
    TERMINAL_STEPS,
    TOOL_STAGES,
    Action,
    Decision,
    GuardrailResult,
    Phase,
    RecoveryPolicy,
    Resolution,
    Step,
    ToolCall,
)

STATE_VERSION = 4
"""The shape of `RunState.snapshot`; a snapshot of another version is ignored (the log is
replayed instead). 3: each call carries the events that decided it (who, why, when).
4: a resolution carries its outcome and evidence; the times and the end reason the read
models (`statemachine.blocker`) show."""

_CALL_MODEL_STEPS = frozenset({Step.RUN_AGAIN, Step.HANDOFF, Step.AWAITING_MODEL})

SLOT: dict[Phase, int] = {phase: slot for slot, phase in enumerate(Phase)}
"""Each phase's place in `RunState.counts`: a list of seven ints is 112 bytes of an idle
run where a dict by phase was 352."""
_AWAITING, _APPROVED, _REJECTED, _STARTED, _COMPLETED = (
    SLOT[Phase.AWAITING], SLOT[Phase.APPROVED], SLOT[Phase.REJECTED], SLOT[Phase.STARTED],
    SLOT[Phase.COMPLETED])


class CallRecord:
    """One call in the tool ledger (internal, mutated only by the fold)."""

    __slots__ = ("_fingerprint", "call", "decided", "phase", "resolutions", "result",
                 "started_at", "starts")

    def __init__(self, call: ToolCall, phase: Phase) -> None:
        self.call = call
        self._fingerprint: bytes | str | None = None
        self.phase = phase
        self.result: JSON = None
        self.starts = 0
        self.started_at: int | None = None
        """The ``at`` of its last start (when a call in doubt began to wait)."""
        self.decided: ev.CallApproved | ev.CallRejected | None = None
        """The event that approved or rejected the call (its ``by``, ``reason``, ``at``);
        kept by reference, so a decision costs the fold no allocation."""
        self.resolutions: tuple[ev.InDoubtResolved, ...] = ()
        """The events that recorded the call's outcome while it was in doubt, in log order
        (more than one only after a `Resolution.NOT_EXECUTED` let it run again)."""

    def digest(self) -> None:
        """Compute the fingerprint now (a live run does, so decisions stay cheap), kept as
        its 32 bytes until first read: an idle run's ledger holds one per call."""
        if self._fingerprint is None:
            self._fingerprint = fingerprint_digest(self.call.name, self.call.arguments)

    @property
    def fingerprint(self) -> str:
        """Computed on first use: most calls are never decided, and replay is hot. Kept as
        hex once read (a decision reads it twice)."""
        found = self._fingerprint
        if isinstance(found, str):
            return found
        if found is None:
            found = fingerprint_digest(self.call.name, self.call.arguments)
        shown = found.hex()
        self._fingerprint = shown
        return shown

    def view(self) -> tuple[Any, ...]:
        """What state equality compares: who decided and why, not when (two runs that
        recorded the same commands at other times are in the same state)."""
        return (self.call, self.phase, self.result, self.starts,
                tuple((d.kind, d.by, d.reason, d.outcome, d.evidence)
                      for d in self.decisions()))

    def decisions(self) -> tuple[Decision, ...]:
        """The decisions on the call, in log order (`Decision`)."""
        found: list[Decision] = []
        decided = self.decided
        if type(decided) is ev.CallApproved:
            found.append(Decision("approved", decided.by, decided.reason, decided.at))
        elif decided is not None:
            found.append(Decision("rejected", decided.by, None, decided.at))
        for resolved in self.resolutions:
            found.append(Decision("resolved", resolved.by, None, resolved.at,
                                  resolved.outcome, resolved.evidence))
        return tuple(found)


class RunState:
    """Everything the log implies about a run. Read it through `RunController`."""

    __slots__ = (
        "activation", "attempt_seq", "awaiting_ids", "calls", "canonical", "counts", "end_reason",
        "envelope", "final_accepted", "final_lossless", "final_output", "guardrail_keys",
        "hook_keys", "last_at", "last_seq", "max_turns", "model_calls", "model_output",
        "pending_guardrails", "pending_input", "policy", "published_guardrails",
        "responded_at", "run_id", "session_id", "staged_at", "step", "turns",
    )

    def __init__(self, started: ev.RunStarted) -> None:
        self.run_id = started.run_id
        self.session_id = started.session_id
        self.policy = started.policy
        self.max_turns = started.max_turns
        self.canonical = started.canonical
        canonical_form(started.canonical)  # SchemaError when it is not registered
        self.step = Step.RUN_AGAIN
        self.turns = 0
        self.model_calls = 0
        self.activation = 0
        self.calls: dict[str, CallRecord] = {}
        self.awaiting_ids: dict[str, None] = {}
        """The calls awaiting a decision, in proposal order (kept so reads are O(1))."""
        self.counts = [0] * len(SLOT)
        """How many calls are in each phase, at its `SLOT` (read through `count`)."""
        self.pending_input: list[JSON] = []
        """Input items recorded by ``add_input`` and not yet in a settled batch."""
        self.pending_guardrails: list[GuardrailResult] = []
        self.published_guardrails: list[GuardrailResult] = []
        self.guardrail_keys: dict[tuple[Any, ...], GuardrailResult] = {}
        """Every recorded guardrail by (name, stage, call id or activation)."""
        self.hook_keys: dict[tuple[Any, ...], None] = {}
        """Every recorded hook's key (a set, in the 64 bytes of an empty dict)."""
        self.model_output: JSON = None
        self.final_output: JSON = None
        self.final_accepted = False
        self.final_lossless = True
        self.envelope: Envelope | None = None
        self.attempt_seq: int | None = None
        self.last_seq = started.seq
        # what the read models (`statemachine.blocker`) date things by, and say
        self.last_at = started.at
        """The newest event's ``at``."""
        self.responded_at: int | None = None
        """The ``at`` of the last model response (every call awaiting a decision is one
        of its calls: a new response needs the run past every decision)."""
        self.staged_at: int | None = None
        """The ``at`` of the last staged publication."""
        self.end_reason: str | None = None
        """Why the run became terminal (the abandon reason, or the failed publication)."""

    # ------------------------------------------------------------------ queries

    @property
    def form(self) -> CanonicalForm:
        """The run's canonical form (a name stays bound to one form: `register_canonical`
        refuses to rebind it), looked up when a batch is digested, not kept per run."""
        return canonical_form(self.canonical)

    def count(self, phase: Phase) -> int:
        return self.counts[SLOT[phase]]

    def unpublished_results(self) -> int:
        counts = self.counts
        return counts[_COMPLETED] + counts[_REJECTED]

    def awaiting(self) -> tuple[str, ...]:
        return tuple(self.awaiting_ids)

    def guardrail_key(self, result: GuardrailResult) -> tuple[Any, ...]:
        stage = result.stage
        scope = result.call_id if stage in TOOL_STAGES else self.activation
        return (result.name, stage, scope)

    def hook_key(self, hook: str, call_id: str | None) -> tuple[Any, ...]:
        scope = HOOK_SCOPES.get(hook)  # (one dict look-up on the hot path)
        if scope is None:  # not a known hook (a guard may still ask): by its prefix
            scope = ("tool" if hook.startswith("tool_") else
                     "model" if hook.startswith("model_") else "agent")
        if scope == "tool":
            return (hook, call_id)
        if scope == "model":
            return (hook, self.model_calls)
        return (hook, self.activation)

    def continuation_after(self, call_ids: tuple[str, ...]) -> Step:
        """The step a batch publishing ``call_ids`` continues to, first match wins."""
        if self.final_accepted:
            return Step.COMPLETED
        counts = self.counts
        if counts[_APPROVED] or self.unpublished_results() > len(call_ids):
            return Step.TOOLS
        if counts[_AWAITING]:
            return Step.INTERRUPTION
        return Step.RUN_AGAIN

    def fails_closed(self) -> bool:
        """Would an envelope staged now fail closed?"""
        return self.policy is RecoveryPolicy.FAIL_CLOSED or not self.final_lossless

    def view(self) -> tuple[Any, ...]:
        """A comparable picture of the whole state (for equality and tests)."""
        return (
            self.run_id, self.session_id, self.policy, self.max_turns, self.canonical,
            self.step, self.turns, self.model_calls, self.activation,
            tuple((i, r.view()) for i, r in self.calls.items()),
            tuple(self.pending_input), tuple(self.pending_guardrails),
            tuple(self.published_guardrails),
            self.guardrail_keys, frozenset(self.hook_keys),
            self.model_output, self.final_output, self.final_accepted, self.final_lossless,
            self.envelope, self.attempt_seq, self.end_reason, self.last_seq,
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RunState) and self.view() == other.view()

    __hash__ = None  # type: ignore[assignment]

    # ---------------------------------------------------------------- snapshots

    def snapshot(self) -> dict[str, JSON]:
        """The whole folded state as a plain JSON tree (`restore` reads it back)."""
        from statemachine import codec

        unstructure = codec.converter.unstructure
        started = ev.RunStarted(0, self.run_id, self.session_id, self.policy,
                                self.max_turns, self.canonical)
        return {
            "state_version": STATE_VERSION,
            "started": codec.encode_event(started),
            "step": self.step.value,
            "turns": self.turns,
            "model_calls": self.model_calls,
            "activation": self.activation,
            "calls": [[unstructure(r.call), r.phase.value, r.result, r.starts,
                       None if r.decided is None else codec.encode_event(r.decided),
                       [codec.encode_event(e) for e in r.resolutions]]
                      for r in self.calls.values()],
            "pending_input": list(self.pending_input),
            "pending_guardrails": unstructure(self.pending_guardrails),
            "published_guardrails": unstructure(self.published_guardrails),
            "guardrail_keys": [[[*key], unstructure(result)]
                               for key, result in self.guardrail_keys.items()],
            "hook_keys": sorted(([*key] for key in self.hook_keys), key=json.dumps),
            "model_output": self.model_output,
            "final_output": self.final_output,
            "final_accepted": self.final_accepted,
            "final_lossless": self.final_lossless,
            "envelope": None if self.envelope is None else unstructure(self.envelope),
            "attempt_seq": self.attempt_seq,
            "last_seq": self.last_seq,
            "times": [self.last_at, self.responded_at, self.staged_at,
                      [r.started_at for r in self.calls.values()]],
            "end_reason": self.end_reason,
        }

    @classmethod
    def restore(cls, data: Mapping[str, Any]) -> RunState | None:
        """The state `snapshot` wrote, or None for another ``state_version``. Snapshots
        come from a trusted store, so they are decoded, not re-validated."""
        from statemachine import codec

        structure = codec.converter.structure
        if data.get("state_version") != STATE_VERSION:
            return None
        started = codec.decode_event(data["started"], 0)
        assert isinstance(started, ev.RunStarted)
        state = cls(started)
        state.step = Step(data["step"])
        state.turns, state.model_calls = data["turns"], data["model_calls"]
        state.activation = data["activation"]
        for raw_call, raw_phase, result, starts, decided, resolutions in data["calls"]:
            phase = Phase(raw_phase)
            record = CallRecord(structure(raw_call, ToolCall), phase)
            record.result, record.starts = result, starts
            if decided is not None:
                record.decided = codec.decode_stored_event(decided, 0)  # type: ignore[assignment]
            record.resolutions = tuple(codec.decode_stored_event(e, 0)  # type: ignore[misc]
                                       for e in resolutions)
            state.calls[record.call.call_id] = record
            state.counts[SLOT[phase]] += 1
            if phase is Phase.AWAITING:
                state.awaiting_ids[record.call.call_id] = None
        state.pending_input = list(data["pending_input"])
        state.pending_guardrails = [structure(g, GuardrailResult)
                                    for g in data["pending_guardrails"]]
        state.published_guardrails = [structure(g, GuardrailResult)
                                      for g in data["published_guardrails"]]
        state.guardrail_keys = {tuple(key): structure(result, GuardrailResult)
                                for key, result in data["guardrail_keys"]}
        state.hook_keys = {tuple(key): None for key in data["hook_keys"]}
        state.model_output = data["model_output"]
        state.final_output = data["final_output"]
        state.final_accepted = data["final_accepted"]
        state.final_lossless = data["final_lossless"]
        raw_envelope = data["envelope"]
        state.envelope = None if raw_envelope is None else structure(raw_envelope, Envelope)
        state.attempt_seq, state.last_seq = data["attempt_seq"], data["last_seq"]
        state.last_at, state.responded_at, state.staged_at, started = data["times"]
        for record, started_at in zip(state.calls.values(), started, strict=True):
            record.started_at = started_at
        state.end_reason = data["end_reason"]
        return state

    # --------------------------------------------------------------- the fold

    def apply(self, event: ev.Event, dest: Step) -> None:
        """Fold an event that `machine.destination` accepted, with the step it returned.
        This is the one fold: the controller and the replay run it."""
        APPLY[type(event)](self, event)
        if dest is Step.TERMINAL_UNRECOVERABLE and self.step is not dest:
            self.end_reason = (event.reason if type(event) is ev.Abandoned else
                               "its publication failed and the run fails closed")
        self.step = dest
        self.last_seq = event.seq
        self.last_at = event.at

    def _phase(self, record: CallRecord, phase: Phase) -> None:
        counts = self.counts
        counts[SLOT[record.phase]] -= 1
        counts[SLOT[phase]] += 1
        if record.phase == Phase.AWAITING:
            del self.awaiting_ids[record.call.call_id]
        record.phase = phase

    def _settle(self) -> None:
        envelope = self.envelope
        assert envelope is not None
        for call_id in envelope.call_ids:
            self._phase(self.calls[call_id], Phase.PUBLISHED)
        self.published_guardrails.extend(envelope.guardrails)
        del self.pending_guardrails[: len(envelope.guardrails)]
        del self.pending_input[: envelope.input_items]
        self.envelope = None
        self.attempt_seq = None

    def _skip_unstarted(self) -> None:
        if self.counts[_AWAITING] or self.counts[_APPROVED]:
            for record in list(self.calls.values()):
                if record.phase in (Phase.AWAITING, Phase.APPROVED):
                    self._phase(record, Phase.SKIPPED)


def _nothing(s: RunState, e: Any) -> None:
    return None


def _model_call_begun(s: RunState, e: ev.ModelCallBegun) -> None:
    s.model_calls += 1


def _model_responded(s: RunState, e: ev.ModelResponded) -> None:
    s.responded_at = e.at
    s.turns += 1
    s.model_output = e.output
    for call in e.tool_calls:
        phase = Phase.AWAITING if call.needs_approval else Phase.APPROVED
        s.calls[call.call_id] = CallRecord(call, phase)
        s.counts[SLOT[phase]] += 1
        if phase == Phase.AWAITING:
            s.awaiting_ids[call.call_id] = None


def _received(s: RunState, e: ev.ToolCallsReceived) -> None:
    for call in e.tool_calls:
        s.calls[call.call_id] = CallRecord(call, Phase.APPROVED)
        s.counts[_APPROVED] += 1


def _posted(s: RunState, e: ev.ResultPosted) -> None:
    s._phase(s.calls[e.call_id], Phase.PUBLISHED)


def _approved(s: RunState, e: ev.CallApproved) -> None:
    record = s.calls[e.call_id]
    record.decided = e
    s._phase(record, Phase.APPROVED)


def _rejected(s: RunState, e: ev.CallRejected) -> None:
    record = s.calls[e.call_id]
    record.result = e.message
    record.decided = e
    s._phase(record, Phase.REJECTED)


def _tool_started(s: RunState, e: ev.ToolStarted) -> None:
    record = s.calls[e.call_id]
    record.starts += 1
    record.started_at = e.at
    if record.phase != Phase.STARTED:
        s._phase(record, Phase.STARTED)


def _tool_completed(s: RunState, e: ev.ToolCompleted) -> None:
    record = s.calls[e.call_id]
    record.result = e.output
    s._phase(record, Phase.COMPLETED)


def _resolved(s: RunState, e: ev.InDoubtResolved) -> None:
    record = s.calls[e.call_id]
    record.resolutions = (*record.resolutions, e)
    if e.outcome is Resolution.NOT_EXECUTED:  # runnable again, its approval kept
        record.result = None
        s._phase(record, Phase.APPROVED)
    else:
        record.result = e.output
        s._phase(record, Phase.COMPLETED)


def _guardrail(s: RunState, e: ev.GuardrailEvaluated) -> None:
    s.guardrail_keys[s.guardrail_key(e.result)] = e.result
    s.pending_guardrails.append(e.result)


def _hook(s: RunState, e: ev.HookRan) -> None:
    s.hook_keys[s.hook_key(e.hook, e.call_id)] = None


def _final_output(s: RunState, e: ev.FinalOutputAccepted) -> None:
    s.final_output = e.output
    s.final_accepted = True
    s.final_lossless = e.lossless
    s._skip_unstarted()


def _handed_off(s: RunState, e: ev.HandedOff) -> None:
    s.activation += 1
    s._skip_unstarted()


def _staged(s: RunState, e: ev.PublicationStaged) -> None:
    s.envelope = Envelope(  # by position (a third cheaper): the order of its fields
        e.session_id, e.items, e.call_ids, e.continuation, e.read_limit, e.frontier,
        e.frontier_whole, e.batch_digests, tuple(s.pending_guardrails),
        tuple(s.awaiting_ids), s.fails_closed(), e.seq,
        _input_published(s.pending_input, e.items) if s.pending_input else 0)
    s.attempt_seq = e.seq
    s.staged_at = e.at


def _input_published(pending: list[JSON], items: tuple[JSON, ...]) -> int:
    """The batch publishes the pending input when it starts with exactly those items."""
    n = len(pending)
    return n if n and len(items) >= n and list(items[:n]) == pending else 0


def _input_added(s: RunState, e: ev.InputAdded) -> None:
    s.pending_input.extend(e.items)


def _committed(s: RunState, e: Any) -> None:
    s._settle()


def _failed(s: RunState, e: ev.PublicationFailed) -> None:
    s.attempt_seq = None


def _append_decided(s: RunState, e: ev.ReconciledAppend) -> None:
    s.attempt_seq = e.seq


APPLY: dict[type[ev.Event], Any] = {
    ev.ModelCallBegun: _model_call_begun,
    ev.ModelFailed: _nothing,
    ev.ModelResponded: _model_responded,
    ev.InputAdded: _input_added,
    ev.CallApproved: _approved,
    ev.CallRejected: _rejected,
    ev.Resumed: _nothing,
    ev.RunClaimed: _nothing,
    ev.ToolStarted: _tool_started,
    ev.ToolCompleted: _tool_completed,
    ev.InDoubtResolved: _resolved,
    ev.GuardrailEvaluated: _guardrail,
    ev.HookRan: _hook,
    ev.FinalOutputAccepted: _final_output,
    ev.RunCompleted: _nothing,
    ev.HandedOff: _handed_off,
    ev.PublicationStaged: _staged,
    ev.PublicationCommitted: _committed,
    ev.PublicationFailed: _failed,
    ev.ReconciledAppend: _append_decided,
    ev.ReconciledAcknowledge: _committed,
    ev.ToolCallsReceived: _received,
    ev.ResultPosted: _posted,
    ev.ResultPostFailed: _nothing,
    ev.Abandoned: _nothing,
}


# ------------------------------------------------------------------- what now?


def in_doubt(s: RunState, in_flight: Collection[str]) -> tuple[str, ...]:
    """Started, non-idempotent calls that are not held ``in_flight`` by a live controller:
    their outcome is unknown and they are never re-run (I11)."""
    if not s.counts[_STARTED]:
        return ()
    return tuple(
        call_id for call_id, r in s.calls.items()
        if r.phase is Phase.STARTED and not r.call.idempotent and call_id not in in_flight
    )


def next_action(s: RunState, *, holds_attempt: bool, in_flight: Collection[str]) -> Action:
    """What a runner should do next (DESIGN §3.1), first match wins. ``holds_attempt``
    and ``in_flight`` are what the asking controller holds and the log does not show."""
    step = s.step
    # DESIGN lists RESOLVE_IN_DOUBT first; a terminal run (abandoned while a call ran)
    # refuses resolve_in_doubt, so it answers NOT_RESUMABLE instead (fail closed).
    if step not in TERMINAL_STEPS and in_doubt(s, in_flight):
        return Action.RESOLVE_IN_DOUBT
    if step is Step.UNSETTLED and holds_attempt:
        return Action.PUBLISH
    if step in TERMINAL_STEPS or (step is Step.UNSETTLED and s.envelope is not None
                             and s.envelope.fail_closed):
        return Action.NOT_RESUMABLE
    if step is Step.UNSETTLED:
        return Action.RECONCILE
    if s.pending_input and step in STAGING_STEPS:
        return Action.PUBLISH  # recorded input goes to the Session before anything else
    counts = s.counts
    if step in _CALL_MODEL_STEPS:
        # Fail closed: a handoff with unpublished results publishes them first, since
        # begin_model_call refuses until they are published.
        if step is Step.HANDOFF and s.unpublished_results():
            return Action.PUBLISH
        return Action.CALL_MODEL
    if step is Step.INTERRUPTION:
        if counts[_APPROVED]:
            return Action.RUN_TOOLS
        # Every decision taken and one was a rejection: its output is published next
        # (nothing is left to decide, so AWAIT_DECISIONS would wait forever).
        return Action.AWAIT_DECISIONS if counts[_AWAITING] else Action.PUBLISH
    if step is Step.TOOLS:
        if counts[_APPROVED] or counts[_STARTED]:
            return Action.RUN_TOOLS
        return Action.PUBLISH
    if step is Step.FINAL_OUTPUT:
        if s.session_id is not None or s.unpublished_results() or s.pending_guardrails:
            return Action.PUBLISH
        return Action.FINISH
    return Action.FINISH  # FINALIZING
