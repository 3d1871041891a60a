"""The seed scenario of the partial-approval report at controller level: two approval-gated
calls besides the approved one, the resumed publication fails, and the recovery must
neither duplicate nor lose the batch."""

from __future__ import annotations

import pytest

from statemachine import (
    Acknowledge,
    Action,
    Append,
    GuardrailResult,
    InvalidTransition,
    PublicationUnsettled,
    Resend,
    Step,
)
from tests.helpers import SESSION, B, P, assert_refused, failed, reloaded

OUTCOMES = {
    # what the Session holds after add_items raised
    "atomic-no-commit": P,
    "commit-then-raise": P + B,
}


@pytest.mark.invariant("I2", "I3", "I4", "I5")
@pytest.mark.parametrize("transport", ["live", "json"])
@pytest.mark.parametrize("outcome", list(OUTCOMES))
def test_partial_approval_recovers_exactly_once(outcome: str, transport: str) -> None:
    c = failed()
    if transport == "json":
        c = reloaded(c)
    session = list(OUTCOMES[outcome])
    assert c.step is Step.UNSETTLED
    assert c.next_action() is Action.RECONCILE
    assert c.envelope is not None
    assert c.envelope.interruptions == ("notify",)

    # while unsettled: the other approval, a model call and a tool start are refused
    assert_refused(c, PublicationUnsettled, c.approve, "notify")
    assert_refused(c, PublicationUnsettled, c.begin_model_call)
    assert_refused(c, PublicationUnsettled, c.begin_tool, "charge")
    assert_refused(c, PublicationUnsettled, c.guardrail_evaluated, "g", True,
                   stage="tool_input", call_id="notify")

    decision = c.reconcile(session, SESSION)
    if outcome == "atomic-no-commit":
        assert decision == Append(tuple(B))
        session.extend(decision.items)
        c.publication_committed()
    else:
        assert decision == Acknowledge()

    # exactly one copy of the batch, guardrails published once, notify still pending
    assert session == P + B
    assert c.step is Step.INTERRUPTION
    assert c.pending_approvals == ("notify",)
    assert c.guardrail_results == (
        GuardrailResult("charge_input", "tool_input", "charge", {"allowed": True}),
        GuardrailResult("charge_output", "tool_output", "charge", {"allowed": True}),
    )
    assert reloaded(c).guardrail_results == c.guardrail_results
    # the charge ran once and is published: it can neither run again nor be re-sent
    assert_refused(c, InvalidTransition, c.begin_tool, "charge")
    assert_refused(c, InvalidTransition, c.approve, "charge")

    # approving notify then completes the run's tool work
    c.approve("notify")
    assert c.resume() is Action.RUN_TOOLS
    c.begin_tool("notify")
    c.tool_completed("notify", "sent")
    assert isinstance(c.begin_tool("notify"), Resend)
    out = {"type": "function_call_output", "call_id": "notify", "output": "sent"}
    c.stage_publication([out], session, call_ids=["notify"])
    session.append(out)
    c.publication_committed()
    assert c.step is Step.RUN_AGAIN
    assert c.guardrail_results == reloaded(c).guardrail_results
    assert len(c.guardrail_results) == 2
