"""The pydantic-ai adapter killed with SIGKILL between its records and their flush
(tests/adapters/test_pydantic_ai_durability.py): `tests.drivers.durability_driver`'s boundaries,
through `LedgerRun` instead of the reference runner.

The run ``pa-durable`` goes through `LedgerRun` on a SQLite store, in one of three modes:
``per-event`` (each event appended as it is recorded), ``buffered`` (a `SQLiteEventStore`
with ``buffered=True``: one append per flush) and ``async`` (an `AsyncSQLiteEventStore`),
with a SQLite history. pydantic-ai's `FunctionModel` asks in one response for ``pay``
(approval-gated, not idempotent) and ``lookup`` (idempotent), then answers with pay's
result. When the run pauses for the approval, the driver approves (`LedgerRun.approve`
flushes before it returns) and only then acknowledges the decision: an fsynced line
``acked:pay`` in DIR/acks.txt.

The model call, each tool and each history write first read the *durable* log (another
connection to the store, as a restarted process would) and write a line to
DIR/violations.txt unless it holds the record that allows the effect
(`durability_driver.Checker`); each effect then appends an fsynced line to
DIR/effects.txt (``model``, ``tool pay``, ``tool lookup``). The process counts its durable
boundaries (``record``, ``flush-before`` / ``flush-after``, ``effect``,
``session-before`` / ``session-after``, ``acked``: see `tests.drivers.durability_driver`) and
SIGKILLs itself at the chosen one. Every restart opens the run with ``take_over=True``:
the process before it is dead, so no write of it can still land.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic_ai import Agent, DeferredToolRequests
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from statemachine import ConcurrencyConflict, RunController, Step, ToolInDoubt
from statemachine.adapters.pydantic_ai import LedgerRun
from statemachine.events import Event
from tests.drivers.crash_driver import Effects, Ticks, append_line
from tests.drivers.durability_driver import (
    ACKS,
    Checker,
    SkipsFlushBeforeTools,
    TickingAsyncStore,
    TickingController,
    TickingSession,
    TickingStore,
    log,
    run_forked,
)

RUN_ID = "pa-durable"
SESSION_ID = "pa-durable-session"
INPUT = "pay 7, then look the rate up"
MODES = ("per-event", "buffered", "async")


def agent(effect: Effects, checker: Checker) -> Agent[None, Any]:
    def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        checker.model()
        effect("model")
        answered = {part.tool_call_id: part.content for message in messages
                    for part in message.parts if part.part_kind == "tool-return"}
        if "pay" in answered:
            return ModelResponse(parts=[TextPart(f"done: {answered['pay']}")])
        return ModelResponse(parts=[ToolCallPart("pay", {"amount": 7}, tool_call_id="pay"),
                                    ToolCallPart("lookup", {"q": "rate"},
                                                 tool_call_id="lookup")])

    the_agent: Agent[None, Any] = Agent(FunctionModel(respond),
                                        output_type=[str, DeferredToolRequests])

    @the_agent.tool_plain(requires_approval=True)
    def pay(amount: int) -> str:
        checker.tool("pay")
        effect("tool pay")  # inside the tool: a kill here leaves the call in doubt
        return f"charged {amount}"

    @the_agent.tool_plain
    def lookup(q: str) -> str:
        checker.tool("lookup")
        effect("tool lookup")
        return f"{q} is 1.0"

    return the_agent


async def run_durable(folder: Path, mode: str, ticks: Ticks, *,
                      broken: bool = False) -> dict[str, Any]:
    """One process's attempts on the run in ``folder``, until it completes or fails
    closed (``broken``: with `durability_driver.SkipsFlushBeforeTools`)."""
    path = folder / "events.db"
    store: Any = (TickingAsyncStore(path, ticks) if mode == "async"
                  else TickingStore(path, ticks))

    def read() -> list[Event]:
        return log(folder, RUN_ID)

    checker = Checker(folder, RUN_ID, read)
    history = TickingSession(SESSION_ID, folder / "session.db", ticks, checker)
    kind = SkipsFlushBeforeTools if broken else TickingController
    buffered = mode != "per-event"
    existing = bool(read())
    c: RunController
    if not existing:
        c = kind.start(run_id=RUN_ID, session_id=SESSION_ID, store=store, buffered=buffered)
    elif mode == "async":
        c = await kind.load_async(store, RUN_ID)
    else:
        c = kind.load(store, RUN_ID, buffered=buffered)
    assert isinstance(c, TickingController)
    c.ticks = ticks
    run = LedgerRun(agent(Effects(folder, ticks), checker), c, history, existing=existing,
                    owner=str(os.getpid()), take_over=True, idempotent=("lookup",))
    try:
        while True:
            if c.step is Step.UNSETTLED:
                await run.settle()  # a prompt written or not: settled before it is given
            prompt = None if await history.get_items(limit=1) else INPUT
            result = await run.run(prompt)
            if result.step is Step.COMPLETED:
                return {"outcome": "completed", "output": result.output}
            if not result.pending:
                return {"outcome": result.step.value}
            for call in result.pending:
                await run.approve(call.call_id)  # durable before it returns
            for call in result.pending:
                append_line(folder / ACKS, f"acked:{call.call_id}")
                ticks(f"acked {call.call_id}")
    except ToolInDoubt as error:
        return {"outcome": "in_doubt", "call_id": error.call_id}
    except ConcurrencyConflict as error:  # a dead process's COMMIT landed after our load
        return {"outcome": "conflict", "action": error.action}
    finally:
        if mode == "async":
            await store.close()
        else:
            store.close()
        history.close()


def fork(folder: Path, mode: str, kill_at: int | None, *, broken: bool = False
         ) -> dict[str, Any] | None:
    """One driver process on the run in ``folder``; None if it was killed."""
    return run_forked(folder, lambda ticks: run_durable(folder, mode, ticks, broken=broken),
                      kill_at)
