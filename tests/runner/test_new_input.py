"""New input sent with a resumed attempt of the reference runner (DESIGN §3.1: add_input
in RUN_AGAIN or INTERRUPTION; I2): taken where the run rests in one of those, refused
elsewhere before the attempt changes anything. The expected Sessions are written from
the script; the tool counts its own runs."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from statemachine import (
    InvalidTransition,
    MemoryEventStore,
    PublicationUnsettled,
    RunController,
    Step,
)
from statemachine.payloads import JSON
from statemachine.runner import Agent, FunctionTool, ModelResponse, Runner
from statemachine.testing import FlakySession, InjectedWriteError, ListSession, ScriptedModel

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


async def _rest(where: str, agent: Agent, session: ListSession,
                store: MemoryEventStore) -> None:
    """Leave run ``r`` resting where input is refused: ``unsettled`` (its results' write
    failed atomically: PublicationUnsettled), ``handoff`` (an operator handed off at its
    interruption: InvalidTransition)."""
    first = await Runner.run(agent, "go", session=session, store=store, run_id="r")
    c = first.controller
    if where == "handoff":
        c.handoff("next")
        return
    c.approve("pay")
    flaky = FlakySession(session, fail_on=1, outcome="atomic")
    with pytest.raises(InjectedWriteError):
        await Runner.run(agent, session=flaky, store=store, run_id="r")


@pytest.mark.invariant("I2")
@pytest.mark.parametrize(("where", "error"), [("unsettled", PublicationUnsettled),
                                              ("handoff", InvalidTransition)])
def test_an_attempt_whose_input_is_refused_records_nothing(
        where: str, error: type[Exception]) -> None:
    """A resumed attempt bringing input the run cannot take where it rests is refused
    before its claim: the store holds exactly the events it held (a claim would have
    superseded an attempt working on the run, for an attempt that does nothing), the
    Session is untouched, and the run then goes on without the input."""
    ran: Counter[str] = Counter()
    agent = _agent(ran)
    session = ListSession("s")
    store = MemoryEventStore()

    async def go() -> None:
        await _rest(where, agent, session, store)
        events, items = store.load("r"), list(session.items)
        with pytest.raises(error):
            await Runner.run(agent, "more", session=session, store=store, run_id="r")
        assert store.load("r") == events
        assert session.items == items
        done = await Runner.run(agent, session=session, store=store, run_id="r")
        assert done.controller.step is Step.COMPLETED

    asyncio.run(go())
    assert session.items == ([GO, DONE] if where == "handoff" else [GO, CALL, OUT, DONE])
    assert ran == Counter(pay=0 if where == "handoff" else 1)
