"""A Session whose tail repeats the items a run writes next (DESIGN §2.3, read_limit):
the reference runner reads as much of the Session as telling the write's outcomes apart
needs, so such a write is staged, and settled after any failure, like any other. The
expected Sessions are written from the script."""

from __future__ import annotations

import asyncio

import pytest

from statemachine import RunController, Step
from statemachine.payloads import JSON
from statemachine.runner import Agent, ModelResponse, Runner
from statemachine.testing import FlakySession, InjectedWriteError, ListSession, ScriptedModel

AGAIN: JSON = {"role": "user", "content": "again"}
OTHER: JSON = {"role": "user", "content": "other"}
DONE: JSON = {"role": "assistant", "content": "done"}

TAILS = {
    # the whole Session repeats the input: only all of it tells P from P + B
    "all-repeats": [AGAIN, AGAIN],
    # three items tell them apart, and the Session is longer than that
    "repeats-at-the-end": [OTHER] * 6 + [DONE, AGAIN, AGAIN],
}


@pytest.mark.invariant("I3")
@pytest.mark.parametrize("fault", ["none", "atomic", "commit_then_raise"])
@pytest.mark.parametrize("tail", TAILS)
def test_input_repeating_the_sessions_tail_is_written_once(tail: str, fault: str) -> None:
    """The input's write lands, fails before writing, or lands and raises; a failed one
    is settled by the next attempt (append again, or acknowledge). Either way the
    Session ends with the input once, then the answer."""
    before = TAILS[tail]
    session = ListSession("s", before)
    model = ScriptedModel([ModelResponse(output="done")])
    agent = Agent("echo", model)
    c = RunController.start(run_id="r", session_id="s")

    async def go() -> None:
        if fault == "none":
            await Runner.run(agent, [AGAIN], session=session, controller=c)
            return
        flaky = FlakySession(session, fail_on=1, outcome=fault)  # type: ignore[arg-type]
        with pytest.raises(InjectedWriteError):
            await Runner.run(agent, [AGAIN], session=flaky, controller=c)
        assert c.step is Step.UNSETTLED
        await Runner.run(agent, session=session, controller=c)

    asyncio.run(go())
    assert c.step is Step.COMPLETED
    assert session.items == [*before, AGAIN, DONE]
    assert model.calls == 1
