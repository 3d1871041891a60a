"""The reference runner with a human approval: the run pauses at the approval, is saved
as JSON, and a later attempt (here the same process; any process would do) resumes it.

Run it: ``python examples/reference_runner.py``. It exits 0.
"""

from __future__ import annotations

import asyncio
import json

from statemachine import RunController
from statemachine.runner import Agent, FunctionTool, ModelResponse, Runner
from statemachine.sessions import MemorySession
from statemachine.testing import ScriptedModel

charges: list[int] = []


def charge(amount: int) -> str:
    charges.append(amount)  # the side effect that must never happen twice
    return f"charged {amount}"


async def main() -> None:
    model = ScriptedModel([
        ModelResponse(tool_calls=(("call-1", "charge", {"amount": 7}),)),
        ModelResponse(output="Done: you were charged 7."),
    ])
    agent = Agent("billing", model,
                  tools=(FunctionTool("charge", charge, needs_approval=True),))
    session = MemorySession("session-1")

    paused = await Runner.run(agent, "charge me 7", session=session)
    print("paused at", paused.step.value, "awaiting", [c.call_id for c in paused.interruptions])
    saved = json.dumps(paused.controller.to_json())  # store it anywhere

    run = RunController.from_json(saved)  # later, maybe in another process
    run.approve("call-1", fingerprint=run.fingerprint("call-1"))
    result = await Runner.run(agent, session=session, controller=run)
    print("final output:", result.final_output)
    assert charges == [7], charges


if __name__ == "__main__":
    asyncio.run(main())
