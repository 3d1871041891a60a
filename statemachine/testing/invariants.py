"""The invariants a run's event log alone shows (I1, I2, I4, I5, I9, I10, I11, I12),
checked independently of the fold that recorded it: `check_log`, and `settled` (what the
log's settled publications published)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from typing import Any

import attrs

from statemachine import events as ev
from statemachine.payloads import JSON
from statemachine.values import GuardrailResult, Resolution, ToolCall


class InvariantViolation(AssertionError):
    """An invariant failed; the message names it (I1...I12) and what was seen."""

    def __init__(self, invariant: str, detail: str) -> None:
        super().__init__(f"{invariant}: {detail}")
        self.invariant = invariant


def fail(invariant: str, detail: str) -> None:
    raise InvariantViolation(invariant, detail)


# ----------------------------------------------------------------- the log alone

_SETTLING = (ev.PublicationFailed, ev.ReconciledAppend, ev.PublicationCommitted,
             ev.ReconciledAcknowledge, ev.Abandoned)
_WHILE_UNSETTLED = (*_SETTLING, ev.RunClaimed)
"""What a log may hold while a publication is unsettled (I2): the settling events, and
claims, which change nothing."""


def settled(events: Sequence[ev.Event]) -> tuple[list[JSON], list[GuardrailResult]]:
    """What the log's settled publications published, in order: the Session items (what
    the Session must hold) and the guardrail results (each pending one is published by
    the next batch that settles)."""
    items: list[JSON] = []
    guardrails: list[GuardrailResult] = []
    pending: list[GuardrailResult] = []
    staged: ev.PublicationStaged | None = None
    staged_guardrails = 0
    for event in events:
        if isinstance(event, ev.GuardrailEvaluated):
            pending.append(event.result)
        elif isinstance(event, ev.PublicationStaged):
            staged, staged_guardrails = event, len(pending)
        elif isinstance(event, ev.PublicationCommitted | ev.ReconciledAcknowledge):
            assert staged is not None
            items.extend(staged.items)
            guardrails.extend(pending[:staged_guardrails])
            del pending[:staged_guardrails]
            staged = None
        elif isinstance(event, ev.Abandoned):
            staged = None
    return items, guardrails


def check_log(events: Sequence[ev.Event]) -> None:
    """The invariants a log alone shows; raises `InvariantViolation`."""
    calls: dict[str, ToolCall] = {}
    starts: Counter[str] = Counter()
    released: Counter[str] = Counter()
    """Starts an outside `Resolution.NOT_EXECUTED` gave back, per call."""
    results: Counter[str] = Counter()
    unsettled = False
    evaluated: list[Any] = []
    decided: set[str] = set()
    for position, event in enumerate(events):
        if position and isinstance(event, ev.RunStarted):
            fail("I10", f"a second RunStarted at {position}")
        if event.seq != position:
            fail("I10", f"event {position} carries seq {event.seq}")
        if unsettled and not isinstance(event, _WHILE_UNSETTLED):
            fail("I2", f"{type(event).__name__} at {position} while a publication is "
                  "unsettled")
        if isinstance(event, ev.PublicationStaged):
            unsettled = True
        elif isinstance(event, ev.PublicationCommitted | ev.ReconciledAcknowledge
                        | ev.Abandoned):
            unsettled = False
        if isinstance(event, ev.ModelResponded | ev.ToolCallsReceived):
            for call in event.tool_calls:
                calls[call.call_id] = call
        elif isinstance(event, ev.CallApproved | ev.CallRejected):
            if event.call_id in decided:
                fail("I5", f"call {event.call_id!r} decided twice (at {position})")
            decided.add(event.call_id)
        elif isinstance(event, ev.ToolStarted):
            starts[event.call_id] += 1
            proposed = calls.get(event.call_id)
            if (starts[event.call_id] > 1 + released[event.call_id]
                    and (proposed is None or not proposed.idempotent)):
                fail("I11", f"non-idempotent call {event.call_id!r} started twice")
            if results[event.call_id]:
                fail("I12", f"call {event.call_id!r} started after its result was cached")
        elif isinstance(event, ev.InDoubtResolved) and event.outcome is Resolution.NOT_EXECUTED:
            # someone outside said the effect did not happen: one more start is allowed
            if starts[event.call_id] != 1 + released[event.call_id]:
                fail("I11", f"call {event.call_id!r} resolved not executed while not in doubt")
            released[event.call_id] += 1
        elif isinstance(event, ev.ToolCompleted | ev.InDoubtResolved):
            results[event.call_id] += 1
            if results[event.call_id] > 1:
                fail("I12", f"call {event.call_id!r} got a second result")
        elif isinstance(event, ev.GuardrailEvaluated):
            evaluated.append(event.result)
    terminal = [i for i, e in enumerate(events) if isinstance(e, ev.Abandoned | ev.RunCompleted)]
    if terminal and terminal[0] != len(events) - 1:
        fail("I9", f"events recorded after the terminal event at {terminal[0]}")
    published = settled(events)[1]
    if len(published) != len({json.dumps(attrs.asdict(g), sort_keys=True)
                              for g in published}):
        fail("I4", "a guardrail result was published twice")
    if any(g not in evaluated for g in published):
        fail("I4", "a published guardrail result was never evaluated")


