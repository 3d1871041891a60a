"""The run's state and the fold: state is a pure function of the event log.

`RunState.check` asks the machine whether an event may fire (raising `Refused`), and
`RunState.apply` folds an accepted event in. The controller and the replay use the same
two calls, so a log is re-validated exactly as it was recorded. ``apply`` never fails for
an event ``check`` accepted, which is what lets a refused command leave nothing changed.
The fold performs no I/O.
"""

from __future__ import annotations

from typing import Any

from statemachine import events as ev
from statemachine.envelope import Envelope
from statemachine.machine import Step, fire
from statemachine.payloads import JSON, CanonicalForm, canonical_form, fingerprint_of
from statemachine.values import GuardrailResult, RecoveryPolicy, ToolCall

PHASES = ("awaiting", "approved", "rejected", "skipped", "started", "completed", "published")
"""A call's place in the ledger: proposed calls await a decision or are approved; an
approved call starts, completes (its result cached) and is published. A rejected call's
rejection output is its result. Calls a final output or handoff overtakes are skipped."""


_TOOL_STAGES = frozenset({"tool_input", "tool_output"})


class CallRecord:
    """One call in the tool ledger (internal, mutated only by the fold)."""

    __slots__ = ("_fingerprint", "call", "phase", "result", "starts")

    def __init__(self, call: ToolCall, phase: str) -> None:
        self.call = call
        self._fingerprint: str | None = None
        self.phase = phase
        self.result: JSON = None
        self.starts = 0

    @property
    def fingerprint(self) -> str:
        """Computed on first use: most calls are never decided, and replay is hot."""
        if self._fingerprint is None:
            self._fingerprint = fingerprint_of(self.call.name, self.call.arguments)
        return self._fingerprint

    def view(self) -> tuple[Any, ...]:
        return (self.call, self.phase, self.result, self.starts)


class RunState:
    """Everything the log implies about a run. Read it through `RunController`."""

    __slots__ = (
        "activation", "attempt_seq", "awaiting_ids", "calls", "canonical", "counts", "envelope",
        "final_accepted", "final_lossless", "final_output", "form", "guardrail_keys",
        "hook_keys", "last_seq", "max_turns", "model_calls", "model_output", "pending_guardrails",
        "policy", "published_guardrails", "run_id", "session_id", "step", "turns",
    )

    def __init__(self, started: ev.RunStarted) -> None:
        self.run_id = started.run_id
        self.session_id = started.session_id
        self.policy = started.policy
        self.max_turns = started.max_turns
        self.canonical = started.canonical
        self.form: CanonicalForm = canonical_form(started.canonical)
        self.step = Step.RUN_AGAIN
        self.turns = 0
        self.model_calls = 0
        self.activation = 0
        self.calls: dict[str, CallRecord] = {}
        self.awaiting_ids: dict[str, None] = {}
        """The calls awaiting a decision, in proposal order (kept so reads are O(1))."""
        self.counts = dict.fromkeys(PHASES, 0)
        self.pending_guardrails: list[GuardrailResult] = []
        self.published_guardrails: list[GuardrailResult] = []
        self.guardrail_keys: dict[tuple[Any, ...], GuardrailResult] = {}
        """Every recorded guardrail by (name, stage, call id or activation)."""
        self.hook_keys: set[tuple[Any, ...]] = set()
        self.model_output: JSON = None
        self.final_output: JSON = None
        self.final_accepted = False
        self.final_lossless = True
        self.envelope: Envelope | None = None
        self.attempt_seq: int | None = None
        self.last_seq = started.seq

    # ------------------------------------------------------------------ queries

    def count(self, phase: str) -> int:
        return self.counts[phase]

    def unpublished_results(self) -> int:
        return self.counts["completed"] + self.counts["rejected"]

    def awaiting(self) -> tuple[str, ...]:
        return tuple(self.awaiting_ids)

    def guardrail_key(self, result: GuardrailResult) -> tuple[Any, ...]:
        stage = result.stage
        scope = result.call_id if stage in _TOOL_STAGES else self.activation
        return (result.name, stage, scope)

    def hook_key(self, hook: str, call_id: str | None) -> tuple[Any, ...]:
        if hook.startswith("tool_"):
            return (hook, call_id)
        if hook.startswith("model_"):
            return (hook, self.model_calls)
        return (hook, self.activation)

    def continuation_after(self, call_ids: tuple[str, ...]) -> Step:
        """The step a batch publishing ``call_ids`` continues to, first match wins."""
        if self.final_accepted:
            return Step.COMPLETED
        counts = self.counts
        if counts["approved"] or self.unpublished_results() > len(call_ids):
            return Step.TOOLS
        if counts["awaiting"]:
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
            tuple(self.pending_guardrails), tuple(self.published_guardrails),
            self.guardrail_keys, frozenset(self.hook_keys),
            self.model_output, self.final_output, self.final_accepted, self.final_lossless,
            self.envelope, self.attempt_seq, self.last_seq,
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RunState) and self.view() == other.view()

    __hash__ = None  # type: ignore[assignment]

    # --------------------------------------------------------------- the fold

    def check(self, event: ev.Event) -> Step:
        """The step ``event`` leads to; raises `machine.Refused` if the machine forbids it."""
        return fire(self, event.TRIGGER, event)

    def apply(self, event: ev.Event, dest: Step) -> None:
        """Fold an event that `check` accepted (with the step it returned)."""
        _APPLY[type(event)](self, event)
        self.step = dest
        self.last_seq = event.seq

    def _phase(self, record: CallRecord, phase: str) -> None:
        counts = self.counts
        counts[record.phase] -= 1
        counts[phase] += 1
        if record.phase == "awaiting":
            del self.awaiting_ids[record.call.call_id]
        record.phase = phase

    def _settle(self) -> None:
        envelope = self.envelope
        assert envelope is not None
        for call_id in envelope.call_ids:
            self._phase(self.calls[call_id], "published")
        self.published_guardrails.extend(envelope.guardrails)
        del self.pending_guardrails[: len(envelope.guardrails)]
        self.envelope = None
        self.attempt_seq = None

    def _skip_unstarted(self) -> None:
        if self.counts["awaiting"] or self.counts["approved"]:
            for record in list(self.calls.values()):
                if record.phase in ("awaiting", "approved"):
                    self._phase(record, "skipped")


def _nothing(s: RunState, e: Any) -> None:
    return None


def _model_call_begun(s: RunState, e: ev.ModelCallBegun) -> None:
    s.model_calls += 1


def _model_responded(s: RunState, e: ev.ModelResponded) -> None:
    s.turns += 1
    s.model_output = e.output
    for call in e.tool_calls:
        phase = "awaiting" if call.needs_approval else "approved"
        s.calls[call.call_id] = CallRecord(call, phase)
        s.counts[phase] += 1
        if phase == "awaiting":
            s.awaiting_ids[call.call_id] = None


def _received(s: RunState, e: ev.ToolCallsReceived) -> None:
    for call in e.tool_calls:
        s.calls[call.call_id] = CallRecord(call, "approved")
        s.counts["approved"] += 1


def _posted(s: RunState, e: ev.ResultPosted) -> None:
    s._phase(s.calls[e.call_id], "published")


def _approved(s: RunState, e: ev.CallApproved) -> None:
    s._phase(s.calls[e.call_id], "approved")


def _rejected(s: RunState, e: ev.CallRejected) -> None:
    record = s.calls[e.call_id]
    record.result = e.message
    s._phase(record, "rejected")


def _tool_started(s: RunState, e: ev.ToolStarted) -> None:
    record = s.calls[e.call_id]
    record.starts += 1
    if record.phase != "started":
        s._phase(record, "started")


def _tool_completed(s: RunState, e: ev.ToolCompleted | ev.InDoubtResolved) -> None:
    record = s.calls[e.call_id]
    record.result = e.output
    s._phase(record, "completed")


def _guardrail(s: RunState, e: ev.GuardrailEvaluated) -> None:
    s.guardrail_keys[s.guardrail_key(e.result)] = e.result
    s.pending_guardrails.append(e.result)


def _hook(s: RunState, e: ev.HookRan) -> None:
    s.hook_keys.add(s.hook_key(e.hook, e.call_id))


def _final_output(s: RunState, e: ev.FinalOutputAccepted) -> None:
    s.final_output = e.output
    s.final_accepted = True
    s.final_lossless = e.lossless
    s._skip_unstarted()


def _handed_off(s: RunState, e: ev.HandedOff) -> None:
    s.activation += 1
    s._skip_unstarted()


def _staged(s: RunState, e: ev.PublicationStaged) -> None:
    s.envelope = Envelope(
        session_id=e.session_id,
        items=e.items,
        call_ids=e.call_ids,
        continuation=e.continuation,
        read_limit=e.read_limit,
        frontier=e.frontier,
        frontier_whole=e.frontier_whole,
        batch_digests=e.batch_digests,
        guardrails=tuple(s.pending_guardrails),
        interruptions=s.awaiting(),
        fail_closed=s.fails_closed(),
        staged_seq=e.seq,
    )
    s.attempt_seq = e.seq


def _committed(s: RunState, e: Any) -> None:
    s._settle()


def _failed(s: RunState, e: ev.PublicationFailed) -> None:
    s.attempt_seq = None


def _append_decided(s: RunState, e: ev.ReconciledAppend) -> None:
    s.attempt_seq = e.seq


_APPLY: dict[type[ev.Event], Any] = {
    ev.ModelCallBegun: _model_call_begun,
    ev.ModelFailed: _nothing,
    ev.ModelResponded: _model_responded,
    ev.InputAdded: _nothing,
    ev.CallApproved: _approved,
    ev.CallRejected: _rejected,
    ev.Resumed: _nothing,
    ev.ToolStarted: _tool_started,
    ev.ToolCompleted: _tool_completed,
    ev.InDoubtResolved: _tool_completed,
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
