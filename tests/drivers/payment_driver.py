"""A charge through the reference runner, killed with SIGKILL around it, against a fake
payment service that deduplicates by idempotency key (tests/runner/test_verifiers.py).

``python -m tests.drivers.payment_driver DIR BOUNDARY VERIFY``: the run ``pay-1`` on the
SQLite store DIR/events.db; the model asks for ``charge(amount=7)``, then answers with
the tool's output. The tool gives the service its call's idempotency key
(`statemachine.tool_context`); ``VERIFY`` ``1`` gives the tool a verifier that asks the
service whether that key was charged. The process kills itself at ``BOUNDARY``:

* ``before-charge``: inside the tool, its start durable, before the service is called;
* ``after-charge``: inside the tool, after the service charged, before it returns;
* ``after-return``: in the tool's output guardrail, before the result is recorded;
* ``after-record``: in the tool's end hook, the result recorded;
* ``none``: no kill: the resume of the stored run.

It prints one JSON line: the run's step and final output, or the error's type.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from statemachine import (
    Completed,
    ControlError,
    NotExecuted,
    SQLiteEventStore,
    ToolCall,
    ToolContext,
    tool_context,
)
from statemachine.payloads import JSON
from statemachine.runner import (
    ALLOW,
    Agent,
    FunctionTool,
    ModelResponse,
    RunHooks,
    Runner,
    ToolGuardrail,
    Verdict,
)

RUN_ID = "pay-1"


class PaymentService:
    """A payment API that deduplicates by idempotency key: each charge is one fsynced
    line of DIR/payments.jsonl; a key already charged is answered from it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def charges(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line]

    def charge(self, key: str, amount: int) -> str:
        if any(c["key"] == key for c in self.charges()):
            return f"charged {amount}"  # deduplicated: the earlier charge stands
        with self.path.open("a") as out:
            out.write(json.dumps({"key": key, "amount": amount}) + "\n")
            out.flush()
            os.fsync(out.fileno())
        return f"charged {amount}"

    def charged(self, key: str) -> bool:
        return any(c["key"] == key for c in self.charges())


def _kill_at(boundary: str, here: str) -> None:
    if boundary == here:
        os.kill(os.getpid(), signal.SIGKILL)


class _Model:
    async def respond(self, history: list[JSON], agent: Agent) -> ModelResponse:
        outputs = [item.get("output") for item in history
                   if isinstance(item, dict) and item.get("type") == "function_call_output"]
        if outputs:
            return ModelResponse(output=f"done: {outputs[-1]}")
        return ModelResponse(tool_calls=(("c1", "charge", {"amount": 7}),))


def agent(folder: Path, boundary: str, verify: bool) -> Agent:
    service = PaymentService(folder / "payments.jsonl")

    def charge(amount: int) -> str:
        context = tool_context()
        _kill_at(boundary, "before-charge")
        done = service.charge(context.idempotency_key, amount)
        _kill_at(boundary, "after-charge")
        return done

    def verifier(context: ToolContext) -> Completed | NotExecuted:
        return (Completed("charged 7") if service.charged(context.idempotency_key)
                else NotExecuted())

    def after_return(call: ToolCall, output: JSON) -> Verdict:
        _kill_at(boundary, "after-return")
        return ALLOW

    tool = FunctionTool("charge", charge,
                        output_guardrails=(ToolGuardrail("after_return", after_return),),
                        verify=verifier if verify else None)
    return Agent("payer", _Model(), (tool,))


class _Hooks(RunHooks):
    def __init__(self, boundary: str) -> None:
        self.boundary = boundary

    async def on_tool_end(self, agent: Agent, call: ToolCall, output: JSON) -> None:
        _kill_at(self.boundary, "after-record")


async def main(folder: Path, boundary: str, verify: bool) -> dict[str, Any]:
    store = SQLiteEventStore(folder / "events.db")
    try:
        first = boundary != "none"  # the first attempt; "none" resumes the stored run
        result = await Runner.run(agent(folder, boundary, verify),
                                  "charge me 7" if first else None, store=store,
                                  run_id=RUN_ID, hooks=_Hooks(boundary), owner="driver",
                                  buffered=False)  # one append per event: "after-record"
    except ControlError as error:
        return {"error": type(error).__name__}
    finally:
        store.close()
    return {"step": result.controller.step.value, "output": result.final_output}


if __name__ == "__main__":
    folder, boundary, verify = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
    print(json.dumps(asyncio.run(main(folder, boundary, verify))))
