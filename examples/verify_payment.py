"""Settling doubt without a person: a charge whose process died mid-call is settled on the
next attempt by asking the payment service, by the call's idempotency key, whether it
went through (README, "Settling doubt without a person").

The first attempt charges, then dies before the result is recorded: the call is in doubt.
The second attempt (a new controller loaded from the SQLite store, as a restarted
process would) asks the tool's verifier first; the service says the key was charged, so
the call is recorded as completed (by "verify:charge") and the run goes on without a
second charge and without an operator.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from statemachine import Completed, NotExecuted, SQLiteEventStore, ToolContext, tool_context
from statemachine.payloads import JSON
from statemachine.runner import Agent, FunctionTool, ModelResponse, Runner


class Payments:
    """A payment API that deduplicates by idempotency key."""

    def __init__(self) -> None:
        self.charged: dict[str, int] = {}

    def charge(self, key: str, amount: int) -> None:
        self.charged.setdefault(key, amount)

    def succeeded(self, key: str) -> bool:
        return key in self.charged


class Died(BaseException):
    """The process dies here (nothing after it is recorded)."""


class Model:
    async def respond(self, history: list[JSON], agent: Agent) -> ModelResponse:
        done = [item["output"] for item in history
                if isinstance(item, dict) and item.get("type") == "function_call_output"]
        if done:
            return ModelResponse(output=f"All set: {done[-1]}")
        return ModelResponse(tool_calls=(("call-1", "charge", {"amount": 7}),))


def make_agent(payments: Payments, *, die_after_charging: bool) -> Agent:
    def charge(amount: int) -> str:
        payments.charge(tool_context().idempotency_key, amount)  # the API deduplicates
        if die_after_charging:
            raise Died
        return f"charged {amount}"

    def verify(context: ToolContext) -> Completed | NotExecuted:
        if payments.succeeded(context.idempotency_key):
            return Completed(f"charged {payments.charged[context.idempotency_key]}")
        return NotExecuted()  # it never reached the API: run it again, same key

    return Agent("shop", Model(), (FunctionTool("charge", charge, verify=verify),))


async def main() -> None:
    payments = Payments()
    with tempfile.TemporaryDirectory() as folder:
        store = SQLiteEventStore(Path(folder) / "runs.db")
        try:
            await Runner.run(make_agent(payments, die_after_charging=True), "charge me 7",
                             store=store, run_id="order-1")
        except Died:
            print("the first attempt died after charging; the call is in doubt")
        result = await Runner.run(make_agent(payments, die_after_charging=False),
                                  store=store, run_id="order-1")
        (decision,) = result.controller.call("call-1").decisions
        print(f"settled by {decision.by}: {decision.outcome.value if decision.outcome else ''}")
        print(f"final output: {result.final_output}; charges made: {len(payments.charged)}")
        store.close()


if __name__ == "__main__":
    asyncio.run(main())
