"""New input sent with a resumed attempt of the reference runner (DESIGN §3.1: add_input
in RUN_AGAIN or INTERRUPTION; I2): taken where the run rests in one of those, refused
elsewhere before the attempt changes anything. The expected Sessions are written from
the script; the tool counts its own runs."""

from __future__ import annotations

import asyncio
from collections import Counter

from statemachine import (
    RunController,
    Step,
)
from statemachine.payloads import JSON
from statemachine.runner import Agent, FunctionTool, ModelResponse, Runner
from statemachine.testing import ListSession, ScriptedModel

GO: JSON = {"role": "user", "content": "go"}
MORE: JSON = {"role": "user", "content": "more"}
CALL: JSON = {"type": "function_call", "call_id": "pay", "name": "pay",
              "arguments": {"x": 7}}
OUT: JSON = {"type": "function_call_output", "call_id": "pay", "output": "paid 7"}
DONE: JSON = {"role": "assistant", "content": "done"}


def _agent(ran: Counter[str]) -> Agent:
    def pay(x: int) -> str:
        ran["pay"] += 1
        return f"paid {x}"

    model = ScriptedModel([ModelResponse((("pay", "pay", {"x": 7}),)),
                           ModelResponse(output="done")])
    return Agent("payer", model, (FunctionTool("pay", pay, needs_approval=True),))


def test_input_sent_after_the_last_decision_is_taken_before_the_tools_run() -> None:
    """The run rests in INTERRUPTION with its one call approved: the input joins the run
    there (it is not refused because the attempt first moved the run on to its tools),
    is published before the tool's items, and the call runs once."""
    ran: Counter[str] = Counter()
    agent = _agent(ran)
    session = ListSession("s")

    async def go() -> RunController:
        first = await Runner.run(agent, "go", session=session)
        c = first.controller
        c.approve("pay")
        done = await Runner.run(agent, "more", session=session, controller=c)
        return done.controller

    c = asyncio.run(go())
    assert c.step is Step.COMPLETED
    assert session.items == [GO, MORE, CALL, OUT, DONE]
    assert ran == Counter(pay=1)
