"""A charge through each adapter, killed with SIGKILL around it, against the fake payment
service of `tests.drivers.payment_driver` (it deduplicates by idempotency key): what that
driver is for the reference runner, for the adapters (tests/adapters/test_*_verifiers.py).

``python -m tests.drivers.verifier_driver ADAPTER DIR BOUNDARY VERIFY``. ADAPTER is
``openai-agents`` (`AgentRun` on the SDK's `Runner`, its `SQLiteSession` in DIR),
``pydantic-ai`` (`LedgerRun`), ``anthropic-session`` (`LedgerSessionToolRunner` against
the fake managed session of `tests.drivers.anthropic_driver`, its history in DIR) or
``anthropic-messages`` (a ``messages.create`` loop through `MessageToolLedger`, its model
asking for ``charge(x=7)``, its messages saved in DIR as it goes). The run
is on the SQLite store DIR/events.db (one append per event); its model asks for
``charge(amount=7)``, then answers ``done: <the tool's output as it saw it>``. The tool
gives the service its call's idempotency key (`statemachine.tool_context`); ``VERIFY``
``1`` gives the adapter a verifier for ``charge`` that asks the service whether that key
was charged. The process kills itself at ``BOUNDARY``:

* ``before-charge``: inside the tool, its start durable, before the service is called;
* ``after-charge``: inside the tool, after the service charged, before it returns;
* ``after-return``: the tool returned, in the store's append of its result, before it;
* ``after-record``: right after that append (the result durable);
* ``none``: no kill: the resume of the stored run.

It prints one JSON line: ``{"output": what the model was last told}`` or
``{"error": the error's type}``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from statemachine import (
    Completed,
    ControlError,
    NotExecuted,
    SQLiteEventStore,
    ToolContext,
    tool_context,
)
from statemachine.events import Event, ToolCompleted
from tests.drivers.payment_driver import PaymentService

RUN_ID = "pay-adapter"
ADAPTERS = ("openai-agents", "pydantic-ai", "anthropic-session", "anthropic-messages")


def kill_at(boundary: str, here: str) -> None:
    if boundary == here:
        os.kill(os.getpid(), signal.SIGKILL)


class KillingStore(SQLiteEventStore):
    """The SQLite store, killing the process around the append of a tool's result."""

    def __init__(self, path: Path, boundary: str) -> None:
        super().__init__(path)
        self.boundary = boundary

    def append(self, run_id: str, events: Sequence[Event], expected_version: int,
               **options: Any) -> None:
        result = any(isinstance(event, ToolCompleted) for event in events)
        if result:
            kill_at(self.boundary, "after-return")
        super().append(run_id, events, expected_version, **options)
        if result:
            kill_at(self.boundary, "after-record")


class Payments:
    """The tool body and the verifier, over DIR/payments.jsonl."""

    def __init__(self, folder: Path, boundary: str) -> None:
        self.service = PaymentService(folder / "payments.jsonl")
        self.boundary = boundary

    def charge(self, amount: int) -> str:
        key = tool_context().idempotency_key
        kill_at(self.boundary, "before-charge")
        done = self.service.charge(key, amount)
        kill_at(self.boundary, "after-charge")
        return done

    def verify(self, context: ToolContext) -> Completed | NotExecuted:
        return (Completed("charged 7") if self.service.charged(context.idempotency_key)
                else NotExecuted())


# ------------------------------------------------------------------- the adapters


async def _openai_agents(folder: Path, store: SQLiteEventStore, pay: Payments,
                         verifiers: dict[str, Any], first: bool) -> Any:
    from agents import (
        Agent,
        Model,
        ModelResponse,
        RunConfig,
        SQLiteSession,
        Usage,
        function_tool,
        set_tracing_disabled,
    )
    from agents.testing import assistant_message, function_call

    from statemachine.adapters.openai_agents import AgentRun

    set_tracing_disabled(True)

    class Echo(Model):
        async def get_response(self, *args: Any, **kwargs: Any) -> ModelResponse:
            given = kwargs["input"] if "input" in kwargs else args[1]
            outputs = [item.get("output") for item in given if isinstance(item, dict)
                       and item.get("type") == "function_call_output"] if isinstance(
                given, list) else []
            items = ([assistant_message(f"done: {outputs[-1]}")] if outputs
                     else [function_call("charge", {"amount": 7}, call_id="c1")])
            return ModelResponse(output=items, usage=Usage(), response_id=None)

        def stream_response(self, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError

    @function_tool
    def charge(amount: int) -> str:
        return pay.charge(amount)

    agent = Agent("payer", model=Echo(), tools=[charge])
    run = await AgentRun.open(agent, run_id=RUN_ID, store=store, owner="driver",
                              session=SQLiteSession("pay", folder / "session.db"),
                              verifiers=verifiers)
    result = await run.run("charge me 7" if first else None,
                           run_config=RunConfig(tracing_disabled=True))
    return result.final_output


async def _pydantic_ai(folder: Path, store: SQLiteEventStore, pay: Payments,
                       verifiers: dict[str, Any], first: bool) -> Any:
    from pydantic_ai import Agent
    from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
    from pydantic_ai.models.function import AgentInfo, FunctionModel

    from statemachine.adapters.pydantic_ai import LedgerRun
    from statemachine.sessions import SQLiteSession

    def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        answered = [part for part in messages[-1].parts if part.part_kind == "tool-return"]
        if answered:
            return ModelResponse(parts=[TextPart(f"done: {answered[-1].content}")])
        return ModelResponse(parts=[ToolCallPart("charge", {"amount": 7},
                                                 tool_call_id="c1")])

    agent: Agent[None, str] = Agent(FunctionModel(respond))

    @agent.tool_plain
    def charge(amount: int) -> str:
        return pay.charge(amount)

    run = await LedgerRun.open(agent, run_id=RUN_ID, store=store, owner="driver",
                               history=SQLiteSession("pay", folder / "history.db"),
                               verifiers=verifiers)
    result = await run.run("charge me 7" if first else None)
    return result.output


async def _anthropic_session(folder: Path, store: SQLiteEventStore, pay: Payments,
                             verifiers: dict[str, Any], first: bool) -> Any:
    from anthropic.lib.tools import beta_async_tool

    from statemachine.adapters.anthropic import LedgerSessionToolRunner
    from tests.drivers.anthropic_driver import SESSION_ID, FakeSession, client_for, tool_use

    server = FakeSession([tool_use("c1", "charge", {"amount": 7})],
                         path=folder / "remote.json")

    @beta_async_tool
    async def charge(amount: int) -> str:
        """Charge the customer."""
        return pay.charge(amount)

    runner = await LedgerSessionToolRunner.open(
        client_for(server), SESSION_ID, tools=[charge], store=store, run_id=RUN_ID,
        owner="driver", max_idle=None, verifiers=verifiers)
    async for _ in runner:
        pass
    (posted,) = server.results("c1")
    return f"done: {''.join(block['text'] for block in posted['content'])}"


def _anthropic_messages(folder: Path, store: SQLiteEventStore, pay: Payments,
                        verifiers: dict[str, Any], first: bool) -> Any:
    import httpx2
    from anthropic import Anthropic
    from anthropic.lib.tools import beta_tool

    from statemachine.adapters.anthropic import MessageToolLedger
    from tests.drivers.anthropic_driver import SavedHistory, ScriptedModel, converse

    model = ScriptedModel(folder, "driver")
    client = Anthropic(api_key="test-key", max_retries=0, http_client=httpx2.Client(
        transport=httpx2.MockTransport(model.handle)))

    @beta_tool
    def charge(x: int) -> str:  # the scripted model asks for charge(x=7)
        """Charge the customer."""
        return pay.charge(x)

    ledger = MessageToolLedger.open(RUN_ID, [charge], store=store, owner="driver",
                                    verifiers=verifiers)
    params: dict[str, Any] = {"model": "claude-test", "max_tokens": 64,
                              "tools": [charge.to_dict()]}
    # the caller's messages, saved as it goes: a resume goes on from them
    reply = converse(ledger, client, SavedHistory(folder, "charge me 7"), **params)
    return f"done: {reply.content[0].text}"


async def main(adapter: str, folder: Path, boundary: str, verify: bool) -> dict[str, Any]:
    store = KillingStore(folder / "events.db", boundary)
    pay = Payments(folder, boundary)
    verifiers = {"charge": pay.verify} if verify else {}
    first = boundary != "none"
    try:
        if adapter == "anthropic-messages":
            output = _anthropic_messages(folder, store, pay, verifiers, first)
        else:
            drive = {"openai-agents": _openai_agents, "pydantic-ai": _pydantic_ai,
                     "anthropic-session": _anthropic_session}[adapter]
            output = await drive(folder, store, pay, verifiers, first)
    except ControlError as error:
        return {"error": type(error).__name__}
    finally:
        store.close()
    return {"output": output}


if __name__ == "__main__":
    adapter, folder, boundary, verify = (sys.argv[1], Path(sys.argv[2]), sys.argv[3],
                                         sys.argv[4] == "1")
    print(json.dumps(asyncio.run(main(adapter, folder, boundary, verify))))
