"""The vocabulary of the public contract: the enums (`Step`, `Phase`, `RecoveryPolicy`,
`Action`), the sets of steps, hooks and guardrail stages the machine and the fold both
speak of, and the small frozen values (tool calls, guardrail results, ledger views, and
the decisions the core hands back: `Execute`, `Resend`, `Append`, `Acknowledge`)."""

from __future__ import annotations

import enum

import attrs

from statemachine.payloads import JSON


class _Fast(enum.Enum):
    """An enum hashed by identity: `enum.Enum` hashes a member by its name in Python
    code, and the machine's table, the ledger's counts and every set of steps hash one
    per command. Members compare by identity, so the identity hash is consistent (and
    no less stable: a str hash changes from one process to the next as well)."""

    __hash__ = object.__hash__


class Step(_Fast):
    """The step a run is in."""

    RUN_AGAIN = "run_again"
    """The next action is a model call."""
    AWAITING_MODEL = "awaiting_model"
    """A model call is in flight."""
    INTERRUPTION = "interruption"
    """Proposed calls await human decisions."""
    TOOLS = "tools"
    """Approved calls run; their results are cached as they complete."""
    FINALIZING = "finalizing"
    """The model gave an output; its guardrails and hooks run before it is accepted."""
    FINAL_OUTPUT = "final_output"
    """A final output is accepted (guardrails passed, terminal hooks ran)."""
    HANDOFF = "handoff"
    """Control passed to another agent; the next model call starts its activation."""
    UNSETTLED = "unsettled"
    """A publication envelope is staged and not confirmed."""
    TERMINAL_UNRECOVERABLE = "terminal_unrecoverable"
    """Fail-closed: this run can never resume."""
    COMPLETED = "completed"
    """The final output is published."""


TERMINAL_STEPS = frozenset({Step.TERMINAL_UNRECOVERABLE, Step.COMPLETED})
"""The steps with no way out: a run in one records nothing again."""
WORKING_STEPS = (
    Step.RUN_AGAIN,
    Step.AWAITING_MODEL,
    Step.INTERRUPTION,
    Step.TOOLS,
    Step.FINALIZING,
    Step.FINAL_OUTPUT,
    Step.HANDOFF,
)
"""The live steps but ``UNSETTLED``: where hooks and guardrails may run."""
LIVE_STEPS = (*WORKING_STEPS, Step.UNSETTLED)
"""Every step but the terminal ones: where ``abandon`` may end a run."""
PARTIAL_STAGING_STEPS = (Step.RUN_AGAIN, Step.INTERRUPTION, Step.TOOLS)
"""The steps a batch may be staged from while leaving results unpublished (the plain
rules of staging)."""
STAGING_STEPS = frozenset({*PARTIAL_STAGING_STEPS, Step.FINAL_OUTPUT, Step.HANDOFF})
"""Every step a batch may be staged from: the `PARTIAL_STAGING_STEPS`, and
``FINAL_OUTPUT`` and ``HANDOFF``, whose batch must publish every unpublished result."""

HOOK_SCOPES = {"agent_start": "agent", "agent_end": "agent", "model_start": "model",
               "model_end": "model", "tool_start": "tool", "tool_end": "tool"}
"""The lifecycle hooks, each with what it runs once per: an activation (``agent``), a
model call (``model``) or a call (``tool``)."""
HOOKS = frozenset(HOOK_SCOPES)
TOOL_HOOKS = frozenset(hook for hook, scope in HOOK_SCOPES.items() if scope == "tool")
"""The hooks that name their call (``call_id``); the others name none."""
GUARDRAIL_STAGES = frozenset({"input", "output", "tool_input", "tool_output"})
TOOL_STAGES = frozenset({"tool_input", "tool_output"})
"""The guardrail stages that name their call, once per call; the others name none and
run once per activation."""


class Phase(_Fast):
    """A call's place in the tool ledger (DESIGN §2.4). A proposed call awaits a decision
    or is approved; an approved call starts, completes (its result cached) and is
    published. A rejected call's rejection output is its result. Calls that a final output
    or a handoff overtakes before they start are skipped."""

    AWAITING = "awaiting"
    """Proposed; a human decision is pending."""
    APPROVED = "approved"
    """Approved (or needing no approval) and not started."""
    REJECTED = "rejected"
    """Rejected; its rejection output waits to be published."""
    SKIPPED = "skipped"
    """Overtaken by a final output or a handoff before it started; it never runs."""
    STARTED = "started"
    """Its start is recorded and its result is not: running here, or in doubt."""
    COMPLETED = "completed"
    """Its result is cached and not yet published."""
    PUBLISHED = "published"
    """Its result (or rejection) is in the Session or the remote history."""


class RecoveryPolicy(_Fast):
    """What a failed or interrupted publication leads to."""

    RECONCILE = "reconcile"
    """Default: keep the envelope and settle it against the Session on the next attempt."""
    FAIL_CLOSED = "fail_closed"
    """The staged envelope is the fail-closed marker: a failed or unfinished write ends
    the run in ``TERMINAL_UNRECOVERABLE``; only the attempt that saw it succeed clears it."""


class Resolution(_Fast):
    """What an operator or a verifier says happened to a call in doubt (DESIGN §7.3),
    recorded by `RunController.resolve_in_doubt`."""

    COMPLETED = "completed"
    """The effect happened; the output is what the model sees."""
    FAILED = "failed"
    """The tool failed; the output is the error text the model sees."""
    NOT_EXECUTED = "not_executed"
    """The effect did not happen: the call is runnable again, its approval kept, and the
    next ``begin_tool`` answers `Execute` (it takes no output)."""


class Action(_Fast):
    """What the runner should do next (`RunController.next_action`)."""

    RESOLVE_IN_DOUBT = "resolve_in_doubt"
    """A non-idempotent call was started and never completed: an operator records its
    outcome with ``resolve_in_doubt`` or abandons the run."""
    PUBLISH = "publish"
    """Write the pending batch (or the staged one, when this controller holds the attempt)."""
    NOT_RESUMABLE = "not_resumable"
    """Nothing may run: completed, terminal, or fail-closed while unsettled."""
    RECONCILE = "reconcile"
    """Read the Session tail and call ``reconcile``."""
    CALL_MODEL = "call_model"
    """Call the model (``begin_model_call``)."""
    RUN_TOOLS = "run_tools"
    """Run the approved calls (``resume`` first when in ``INTERRUPTION``)."""
    AWAIT_DECISIONS = "await_decisions"
    """Ask a human to approve or reject the pending calls."""
    FINISH = "finish"
    """Finish the final output: guardrails and hooks, then ``accept_final_output`` or
    ``complete``."""


@attrs.frozen
class ToolCall:
    """One tool call proposed by the model. ``arguments`` is plain JSON."""

    call_id: str
    name: str
    arguments: JSON
    needs_approval: bool = False
    idempotent: bool = False


@attrs.frozen
class GuardrailResult:
    """A completed guardrail evaluation. ``stage`` is one of ``input``, ``output``,
    ``tool_input``, ``tool_output``; tool stages name their ``call_id``."""

    name: str
    stage: str
    call_id: str | None
    result: JSON


@attrs.frozen
class Execute:
    """``begin_tool`` decision: run the tool now (its start is recorded)."""

    call_id: str
    call: ToolCall


@attrs.frozen
class Resend:
    """``begin_tool`` decision: the tool already ran; publish this cached result (I12)."""

    call_id: str
    result: JSON


@attrs.frozen
class Append:
    """``reconcile`` decision: the Session is at the pre-write frontier; write ``items``
    (detached copies of the staged batch) and report ``publication_committed``."""

    items: tuple[JSON, ...]


@attrs.frozen
class Acknowledge:
    """``reconcile`` decision: the earlier write had committed; the run is settled."""


@attrs.frozen
class Decision:
    """A decision on a call as its log records it (DESIGN §7.2): ``kind`` is
    ``"approved"``, ``"rejected"`` or ``"resolved"`` (an in-doubt call's outcome recorded
    by `RunController.resolve_in_doubt`); ``by`` who decided and ``reason`` why (an
    approval's; None for the others), each None when not said; ``at`` when (microseconds
    since the Unix epoch, UTC; None in a log written before schema version 3); for a
    resolution, its ``outcome`` and ``evidence``."""

    kind: str
    by: str | None
    reason: str | None
    at: int | None
    outcome: Resolution | None = None
    """A resolution's `Resolution` (None for an approval or a rejection)."""
    evidence: str | None = None
    """A resolution's evidence (a payment id, a ticket), or None."""


@attrs.frozen
class CallView:
    """One call of the tool ledger as `RunController.calls` hands it out: the call, its
    `Phase`, how many starts the log records, whether this controller holds it in flight,
    its result (the cached output, or the rejection message; None before) and the
    decisions on it, in log order (an approval or a rejection, then an in-doubt
    resolution; none for a call that needed none).

    ``call`` and ``result`` are copies: changing them changes nothing in the run."""

    call: ToolCall
    phase: Phase
    starts: int
    in_flight: bool
    result: JSON
    decisions: tuple[Decision, ...] = ()
