"""The events: every change to a run is one of these, appended to its log.

Events are frozen, slotted attrs classes. ``seq`` is the event's position in the log
(0 for `RunStarted`). Payload fields hold detached plain JSON (see `payloads`). Each class
names the machine trigger it fires (``TRIGGER``); the declaration in `machine` says in
which steps that trigger is legal and under which guards.

Time and actor (DESIGN §7.2, schema version 3): every event carries ``at``, the
microseconds since the Unix epoch (UTC) at which its controller recorded it, read from
the controller's clock (None in a log written before version 3). The decisions
(`CallApproved`, `CallRejected`, `InDoubtResolved`, `Abandoned`) also carry ``by``, who
decided (None: not said), and an approval its ``reason``; a `RunClaimed` its ``lease``;
an `InDoubtResolved` its ``outcome`` (a `Resolution`) and ``evidence``.
These fields are keyword-only and default to None, so an event built without them is one
of an older log.
"""

from __future__ import annotations

from typing import Any, ClassVar, TypeVar

import attrs

from statemachine.payloads import JSON, copy_plain
from statemachine.values import GuardrailResult, RecoveryPolicy, Resolution, Step, ToolCall

MAX_AT = 2**63 - 1
"""The latest ``at`` a controller records (a signed 64-bit column holds every one)."""


@attrs.frozen
class Event:
    """Base class: ``seq`` is the position in the run's log."""

    TRIGGER: ClassVar[str] = ""
    seq: int
    at: int | None = attrs.field(default=None, kw_only=True)
    """When it was recorded: microseconds since the Unix epoch (UTC), from the recording
    controller's clock; None in a log written before schema version 3. Replay never
    reads a clock: this is what the log says."""


@attrs.frozen
class RunStarted(Event):
    TRIGGER: ClassVar[str] = "start"
    run_id: str
    session_id: str | None
    policy: RecoveryPolicy
    max_turns: int | None
    canonical: str


@attrs.frozen
class ModelCallBegun(Event):
    TRIGGER: ClassVar[str] = "begin_model_call"


@attrs.frozen
class ModelFailed(Event):
    TRIGGER: ClassVar[str] = "model_failed"
    error: str
    """The error's type name, never its message."""


@attrs.frozen
class ModelResponded(Event):
    TRIGGER: ClassVar[str] = "model_responded"
    tool_calls: tuple[ToolCall, ...]
    output: JSON


@attrs.frozen
class InputAdded(Event):
    TRIGGER: ClassVar[str] = "add_input"
    items: tuple[JSON, ...]


@attrs.frozen
class CallApproved(Event):
    TRIGGER: ClassVar[str] = "approve"
    call_id: str
    fingerprint: str
    """The fingerprint of the call the decision binds to; re-checked on replay."""
    by: str | None = attrs.field(default=None, kw_only=True)
    """Who approved (a person, a service, ``"verify:<tool>"``), or None."""
    reason: str | None = attrs.field(default=None, kw_only=True)
    """Why, in the approver's words, or None."""


@attrs.frozen
class CallRejected(Event):
    TRIGGER: ClassVar[str] = "reject"
    call_id: str
    fingerprint: str
    message: JSON
    """The rejection output, published in the next batch like a tool output."""
    by: str | None = attrs.field(default=None, kw_only=True)
    """Who rejected, or None."""


@attrs.frozen
class Resumed(Event):
    TRIGGER: ClassVar[str] = "resume"


MAX_LEASE_MICROS = 10**15
"""The longest lease a claim records (10⁹ s, `controller.MAX_LEASE`), in microseconds."""


def _check_lease(claim: RunClaimed, lease: int | None) -> None:
    """A recorded lease is what `RunController.claim` records: a positive whole number
    of microseconds up to `MAX_LEASE_MICROS`, on a claim with an owner. A log holding any
    other (forged, or copied from elsewhere) does not load."""
    if lease is not None and (type(lease) is not int or not 0 < lease <= MAX_LEASE_MICROS
                              or claim.owner is None):
        raise ValueError("a claim's lease must be 1 to 10**15 microseconds, with an owner")


@attrs.frozen
class RunClaimed(Event):
    """An attempt claimed the run: the first event of every attempt on an existing run.

    Appended with the expected version like any event, so of two attempts that loaded
    the same version exactly one records its claim (the other gets `ConcurrencyConflict`
    before any effect). It changes nothing else: no step, envelope or ledger."""

    TRIGGER: ClassVar[str] = "claim"
    owner: str | None
    """Who claimed (an attempt id, a host or process name), or None."""
    lease: int | None = attrs.field(default=None, kw_only=True,
                                    validator=lambda claim, _, lease: _check_lease(claim, lease))
    """How long the claim holds the run against other owners, in microseconds, from
    each append of its attempt (the store's clock decides when it ends); None: no lease.
    A claim with a lease always has an owner."""


@attrs.frozen
class ToolStarted(Event):
    TRIGGER: ClassVar[str] = "begin_tool"
    call_id: str


@attrs.frozen
class ToolCompleted(Event):
    TRIGGER: ClassVar[str] = "tool_completed"
    call_id: str
    output: JSON


@attrs.frozen
class InDoubtResolved(Event):
    TRIGGER: ClassVar[str] = "resolve_in_doubt"
    call_id: str
    output: JSON
    """What the model sees (None for `Resolution.NOT_EXECUTED`, which takes none)."""
    by: str | None = attrs.field(default=None, kw_only=True)
    """Who recorded the outcome (an operator, ``"verify:<tool>"``), or None."""
    outcome: Resolution = attrs.field(default=Resolution.COMPLETED, kw_only=True)
    """What happened (DESIGN §7.3); a log written before schema version 3 says
    ``COMPLETED``, the only outcome it could record."""
    evidence: str | None = attrs.field(default=None, kw_only=True)
    """What the outcome rests on (a payment id, a ticket), or None."""


@attrs.frozen
class GuardrailEvaluated(Event):
    TRIGGER: ClassVar[str] = "guardrail_evaluated"
    result: GuardrailResult


@attrs.frozen
class HookRan(Event):
    TRIGGER: ClassVar[str] = "hook_ran"
    hook: str
    call_id: str | None


@attrs.frozen
class FinalOutputAccepted(Event):
    TRIGGER: ClassVar[str] = "accept_final_output"
    output: JSON
    lossless: bool


@attrs.frozen
class RunCompleted(Event):
    TRIGGER: ClassVar[str] = "complete"


@attrs.frozen
class HandedOff(Event):
    TRIGGER: ClassVar[str] = "handoff"
    target: str


@attrs.frozen
class PublicationStaged(Event):
    """The envelope, armed before the write. ``frontier`` holds the digests of the last
    ``len(frontier)`` items of the pre-write history P (all of P when ``frontier_whole``);
    ``batch_digests`` and ``continuation`` are re-derived and checked on replay."""

    TRIGGER: ClassVar[str] = "stage_publication"
    session_id: str | None
    items: tuple[JSON, ...]
    call_ids: tuple[str, ...]
    read_limit: int
    frontier: tuple[str, ...]
    frontier_whole: bool
    batch_digests: tuple[str, ...]
    continuation: Step


@attrs.frozen
class PublicationCommitted(Event):
    TRIGGER: ClassVar[str] = "publication_committed"


@attrs.frozen
class PublicationFailed(Event):
    TRIGGER: ClassVar[str] = "publication_failed"
    error: str
    """The error's type name, never its message."""


@attrs.frozen
class ReconciledAppend(Event):
    """``reconcile`` found the pre-write frontier and answered `Append`: an attempt opens."""

    TRIGGER: ClassVar[str] = "reconcile_append"
    take_over: bool


@attrs.frozen
class ReconciledAcknowledge(Event):
    """``reconcile`` found the batch already written and answered `Acknowledge`: settled."""

    TRIGGER: ClassVar[str] = "reconcile_acknowledge"
    take_over: bool


@attrs.frozen
class ToolCallsReceived(Event):
    """Calls a remote agent loop asks this client to execute (the remote executor)."""

    TRIGGER: ClassVar[str] = "receive_tool_calls"
    tool_calls: tuple[ToolCall, ...]


@attrs.frozen
class ResultPosted(Event):
    """A per-call publication: the call's cached result is in the remote history."""

    TRIGGER: ClassVar[str] = "result_posted"
    call_id: str


@attrs.frozen
class ResultPostFailed(Event):
    """A post of the call's result ended without landing; the result stays cached."""

    TRIGGER: ClassVar[str] = "result_post_failed"
    call_id: str
    error: str
    """The error's type name, never its message."""


@attrs.frozen
class Abandoned(Event):
    TRIGGER: ClassVar[str] = "abandon"
    reason: str
    by: str | None = attrs.field(default=None, kw_only=True)
    """Who abandoned the run, or None."""


EVENT_TYPES: tuple[type[Event], ...] = (
    RunStarted,
    ModelCallBegun,
    ModelFailed,
    ModelResponded,
    InputAdded,
    CallApproved,
    CallRejected,
    Resumed,
    RunClaimed,
    ToolStarted,
    ToolCompleted,
    InDoubtResolved,
    GuardrailEvaluated,
    HookRan,
    FinalOutputAccepted,
    RunCompleted,
    HandedOff,
    PublicationStaged,
    PublicationCommitted,
    PublicationFailed,
    ReconciledAppend,
    ReconciledAcknowledge,
    ToolCallsReceived,
    ResultPosted,
    ResultPostFailed,
    Abandoned,
)
"""Every event class, by name in the JSON log (``"type"``)."""


_T = TypeVar("_T")


def copied(value: _T) -> _T:
    """A copy of an event, `ToolCall` or `GuardrailResult` whose payloads are fresh
    copies: what the library hands out, so a caller cannot change what it recorded."""
    result: Any = value
    if isinstance(value, dict | list):
        result = copy_plain(value)
    elif isinstance(value, tuple):
        result = tuple(copied(v) for v in value)
    elif attrs.has(type(value)):
        fields = attrs.fields(type(value))  # type: ignore[arg-type]
        changes = {f.name: copied(getattr(value, f.name)) for f in fields
                   if isinstance(getattr(value, f.name), dict | list | tuple)
                   or attrs.has(type(getattr(value, f.name)))}
        if changes:
            result = attrs.evolve(value, **changes)  # type: ignore[misc]
    return result  # type: ignore[no-any-return]
