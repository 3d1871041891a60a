"""Pydantic AI with the control core underneath (``LedgerRun``), offline.

A pydantic-ai `Agent` with an approval-gated ``charge`` tool runs on pydantic-ai's own
`FunctionModel`. The first process pauses for the approval, approves, and resumes; the
charge goes through and the process is killed (SIGKILL) before the tool returns. A second
process opens the run from the SQLite store: the charge is in doubt, so the run refuses
to go on (pydantic-ai alone would run the tool again and charge twice). The operator
checks the payment system, records what happened (``resolve_in_doubt``), and the run
finishes with the recorded outcome; the tool never runs again. A retry of the same
request afterwards gets the recorded answer (``recorded=True``): no model call, no tool.

Run it: ``python examples/pydantic_ai_adapter.py`` (needs
``pip install 'agent-statemachine[pydantic-ai]'``; it starts both processes itself, in a
fresh temporary directory, and never touches the network). It exits 0.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from pydantic_ai import Agent, DeferredToolRequests
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from statemachine import SQLiteEventStore, ToolInDoubt
from statemachine.adapters.pydantic_ai import LedgerRun
from statemachine.sessions import SQLiteSession

RUN_ID = "order-42"


def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """The model: asks for charge(amount=7), then reports the tool's result."""
    results = [part.content for part in messages[-1].parts if part.part_kind == "tool-return"]
    if results:
        return ModelResponse(parts=[TextPart(f"done: {results[-1]}")])
    return ModelResponse(parts=[ToolCallPart("charge", {"amount": 7}, tool_call_id="call-1")])


def billing(folder: Path, *, die_after_charging: bool) -> Agent[None, Any]:
    agent: Agent[None, Any] = Agent(FunctionModel(respond),
                                    output_type=[str, DeferredToolRequests])

    @agent.tool_plain(requires_approval=True)
    def charge(amount: int) -> str:
        with open(folder / "charges.txt", "a") as charges:  # the real side effect
            charges.write(f"{amount}\n")
        if die_after_charging:
            os.kill(os.getpid(), signal.SIGKILL)  # the process dies inside the tool
        return f"charged {amount}"

    return agent


async def open_run(folder: Path, *, die_after_charging: bool = False) -> LedgerRun:
    return await LedgerRun.open(billing(folder, die_after_charging=die_after_charging),
                                run_id=RUN_ID, store=SQLiteEventStore(folder / "events.db"),
                                history=SQLiteSession("conversation-1", folder / "history.db"))


async def first_process(folder: Path) -> None:
    run = await open_run(folder, die_after_charging=True)
    paused = await run.run("charge me 7")
    print(f"first process: paused for {[call.name for call in paused.pending]}")
    await run.approve("call-1")  # recorded and durable first
    print("first process: approved; resuming (the process dies inside charge)",
          flush=True)
    await run.run()


async def second_process(folder: Path) -> None:
    run = await open_run(folder)
    try:
        await run.run()
    except ToolInDoubt as refused:
        print(f"second process: refused to go on: {type(refused).__name__} "
              f"(calls in doubt: {list(run.controller.in_doubt())})")
    charged = (folder / "charges.txt").read_text().split()
    # the operator looks at the payment system, sees the charge, and records it
    await run.resolve_in_doubt("call-1", f"charged {charged[-1]}")
    result = await run.run()
    charges = (folder / "charges.txt").read_text().split()
    stored = await SQLiteSession("conversation-1", folder / "history.db").get_items()
    print(f"second process: {result.step.value}: {result.output!r}; charged "
          f"{len(charges)} time(s); {len(stored)} message(s) in the history")
    retried = await (await open_run(folder)).run("charge me 7")  # the caller retries
    print(f"a retry of the request: {retried.output!r} (recorded: {retried.recorded})")
    assert charges == (folder / "charges.txt").read_text().split() == ["7"]


def main() -> None:
    if len(sys.argv) == 3:
        process = first_process if sys.argv[1] == "first" else second_process
        asyncio.run(process(Path(sys.argv[2])))
        return
    with tempfile.TemporaryDirectory() as folder:
        first = subprocess.run([sys.executable, __file__, "first", folder], check=False)
        assert first.returncode == -signal.SIGKILL, first.returncode
        print("the first process was killed inside the tool")
        subprocess.run([sys.executable, __file__, "second", folder], check=True)


if __name__ == "__main__":
    main()
