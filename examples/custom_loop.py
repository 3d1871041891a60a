"""Embedding the controller in a small loop of your own, without the reference runner.

The loop asks ``next_action()`` what to do, performs the effect itself, and reports the
outcome. What it publishes to the Session, each time through ``stage_publication``:

* the user's input, as soon as the run starts;
* each tool call's proposal item together with its result item (the result of an
  approved call, or the rejection message of a rejected one);
* the final output.

Run it: ``python examples/custom_loop.py``. It exits 0 and prints the Session.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from statemachine import Action, Execute, RunController, ToolCall
from statemachine.runner import publish
from statemachine.sessions import MemorySession

# The "model": first it asks for two tool calls (one needs a human's approval), then it
# answers with the final output.
SCRIPT: list[dict[str, Any]] = [
    {"calls": [ToolCall("c1", "charge", {"amount": 7}, needs_approval=True),
               ToolCall("c2", "refund", {"amount": 99}, needs_approval=True)]},
    {"output": "charged 7, refund declined"},
]
def charge(amount: int) -> str:
    return f"charged {amount}"


def refund(amount: int) -> str:
    return "refunded"


TOOLS = {"charge": charge, "refund": refund}
HUMAN = {"c1": True, "c2": False}  # approve the charge, reject the refund


async def main() -> list[Any]:
    session = MemorySession("session-1")
    run = RunController.start(run_id="custom-1", session_id=session.session_id)
    prompt = [{"role": "user", "content": "charge me 7, and refund 99"}]
    run.add_input(prompt)
    await publish(run, session, prompt)  # stage → write → commit (or fail, and re-raise)
    turn = 0
    while True:
        action = run.next_action()
        if action is Action.CALL_MODEL:
            run.begin_model_call()
            answer = SCRIPT[turn]
            turn += 1
            run.model_responded(answer.get("calls", []), output=answer.get("output"))
        elif action is Action.AWAIT_DECISIONS:
            for call_id in run.pending_approvals:  # a human decides, bound to the arguments
                if HUMAN[call_id]:
                    run.approve(call_id, fingerprint=run.fingerprint(call_id))
                else:
                    run.reject(call_id, "declined by the operator")
        elif action is Action.RUN_TOOLS:
            run.resume()  # INTERRUPTION → TOOLS once an approved call can run
            for call_id in run.runnable_call_ids():
                decision = run.begin_tool(call_id)  # the start is recorded first
                if isinstance(decision, Execute):
                    output = TOOLS[decision.call.name](**decision.call.arguments)
                    run.tool_completed(call_id, output)
        elif action is Action.PUBLISH:
            ids = list(run.unpublished_call_ids())
            items: list[Any] = []
            for call_id in ids:
                view = run.call(call_id)
                items.append({"type": "function_call", "call_id": call_id,
                              "name": view.call.name, "arguments": view.call.arguments})
                items.append({"type": "function_call_output", "call_id": call_id,
                              "output": view.result})
            if run.final_output is not None:
                items.append({"role": "assistant", "content": run.final_output})
            await publish(run, session, items, call_ids=ids)
        elif action is Action.FINISH:
            run.accept_final_output(run.model_output)  # then PUBLISH writes it
        else:  # NOT_RESUMABLE: completed here; RECONCILE / RESOLVE_IN_DOUBT after faults
            break
    assert run.step.value == "completed", run.step
    return await session.get_items()


if __name__ == "__main__":
    for item in asyncio.run(main()):
        print(json.dumps(item))
