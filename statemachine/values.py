"""The small frozen values of the public contract: tool calls, guardrail results, the
decisions the core hands back (`Execute`, `Resend`, `Append`, `Acknowledge`), the
recovery policy and the runner's next action."""

from __future__ import annotations

import enum

import attrs

from statemachine.payloads import JSON


class RecoveryPolicy(enum.Enum):
    """What a failed or interrupted publication leads to."""

    RECONCILE = "reconcile"
    """Default: keep the envelope and settle it against the Session on the next attempt."""
    FAIL_CLOSED = "fail_closed"
    """The staged envelope is the fail-closed marker: a failed or unfinished write ends
    the run in ``TERMINAL_UNRECOVERABLE``; only the attempt that saw it succeed clears it."""


class Action(enum.Enum):
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
