"""Processes of the pydantic-ai adapter tests (tests/adapters/test_pydantic_ai.py): one
command per process, on a run kept in DIR. Through the adapter: the SQLite event store
DIR/events.db and the run's history, a SQLite Session in DIR/history.db. On pydantic-ai
alone: the messages of the last stop saved as JSON in DIR/alone.json (what a pydantic-ai
user persists between runs).

``python -m tests.drivers.pydantic_ai_driver COMMAND DIR [NAME]``:

* ``pause DIR``: start the run; the model asks for ``charge(x=7)`` (``requires_approval``);
  the run pauses, and the call is approved through the adapter;
* ``crash DIR``: resume the paused run; ``charge`` kills its own process (SIGKILL) inside
  its body, after its effect;
* ``crash-fresh DIR``: start a run whose model asks for ``pay(x=7)`` (no approval); ``pay``
  kills its own process inside its body;
* ``resume DIR NAME``: open the run and run it to its next stop;
* ``resolve DIR NAME``: the operator's path: open the run, record the in-doubt call's
  outcome (``resolve_in_doubt``), then run it to its next stop;
* ``alone-pause DIR``, ``alone-crash DIR``, ``alone-resume DIR NAME``: the same approved
  ``charge`` on pydantic-ai alone: pause and save the messages; resume with the approval
  and die inside the tool; resume again from the saved messages with the approval.

Mixed calls: the model asks for ``charge(x=7)`` (approval) and ``lookup(i=1)`` (none) in
one response, then answers with charge's result.

* ``mixed-pause DIR``: start the run (lookup runs, charge waits) and approve charge;
* ``mixed-kill DIR WHEN``: resume; the process SIGKILLs itself inside the history's
  first write (charge's result): ``during`` (before its COMMIT) or ``after`` it;
* ``mixed-resume DIR NAME [take-over]``: open the run (``take_over=True`` when asked) and
  run it to its next stop;
* ``alone-mixed-pause DIR``, ``alone-mixed-kill DIR``, ``alone-mixed-resume DIR NAME``:
  pydantic-ai alone: pause and save the messages; resume with the approval and die after
  the run, before its messages are saved; resume again from the saved messages.

The mixed model appends ``NAME model`` to DIR/effects.txt at each request. Errors are
printed with their ``message``.

Every tool body appends ``NAME tool <name>`` to DIR/effects.txt (O_APPEND, fsync) before
it can be killed. ``resume``, ``resolve`` and ``alone-resume`` print one JSON line:
``{"name", "outcome": <step> | "error", "error", "step", "output"}``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from pydantic_ai import Agent, DeferredToolRequests, DeferredToolResults
from pydantic_ai.messages import (
    ModelMessage,
    ModelMessagesTypeAdapter,
    ModelResponse,
    TextPart,
    ToolCallPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

from statemachine import SQLiteEventStore, Step
from statemachine.adapters.pydantic_ai import LedgerRun
from statemachine.sessions import SQLiteSession
from tests.drivers.crash_driver import append_line
from tests.drivers.effects import Effects

RUN_ID = "pa-run"
HISTORY_ID = "pa-history"
RESOLVED = "ran once (confirmed by the operator)"


def model(tool: str, call_id: str, folder: Path | None = None) -> FunctionModel:
    """Asks for ``tool(x=7)`` until a tool result is in the last request, then says done;
    with ``folder``, each request's last message is appended to DIR/bodies.jsonl."""

    def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if folder is not None:  # the exact request the model received, one JSON line each
            append_line(folder / "bodies.jsonl", ModelMessagesTypeAdapter.dump_json(
                messages[-1:]).decode())
        answered = [part for part in messages[-1].parts if part.part_kind == "tool-return"]
        if answered:
            return ModelResponse(parts=[TextPart(f"done: {answered[-1].content}")])
        return ModelResponse(parts=[ToolCallPart(tool, {"x": 7}, tool_call_id=call_id)])

    return FunctionModel(respond)


def billing(effect: Effects, *, tool: str, call_id: str, crash: bool) -> Agent[None, Any]:
    agent: Agent[None, Any] = Agent(model(tool, call_id, effect.path.parent),
                                    output_type=[str, DeferredToolRequests])

    @agent.tool_plain(requires_approval=True)
    def charge(x: int) -> str:
        effect("tool charge")
        if crash:
            os.kill(os.getpid(), signal.SIGKILL)
        return f"charged {x}"

    @agent.tool_plain
    def pay(x: int) -> str:
        effect("tool pay")
        if crash:
            os.kill(os.getpid(), signal.SIGKILL)
        return f"paid {x}"

    return agent


async def _open(folder: Path, effect: Effects, *, tool: str = "charge", call_id: str = "c1",
                crash: bool = False) -> LedgerRun:
    return await LedgerRun.open(billing(effect, tool=tool, call_id=call_id, crash=crash),
                                run_id=RUN_ID,
                                history=SQLiteSession(HISTORY_ID, folder / "history.db"),
                                store=SQLiteEventStore(folder / "events.db"), owner=effect.name,
                                buffered=False)  # one append per event, as the rows say


async def pause(folder: Path) -> None:
    run = await _open(folder, Effects(folder, "pause"))
    paused = await run.run("charge me 7")
    assert paused.step is Step.INTERRUPTION, paused.step
    assert [call.call_id for call in paused.pending] == ["c1"]
    await run.approve("c1")


async def crash(folder: Path, fresh: bool) -> None:
    effect = Effects(folder, "crash")
    if fresh:
        run = await _open(folder, effect, tool="pay", call_id="p1", crash=True)
        await run.run("pay 7")
    else:
        run = await _open(folder, effect, crash=True)
        await run.run()
    raise AssertionError("the tool should have killed this process")


def _outcome(name: str, run: LedgerRun, result: Any = None,
             error: BaseException | None = None) -> dict[str, Any]:
    step = run.controller.step.value
    if error is not None:
        return {"name": name, "outcome": "error", "error": type(error).__name__, "step": step,
                "output": None, "message": str(error)}
    return {"name": name, "outcome": result.step.value, "error": None, "step": step,
            "output": result.output}


async def resume(folder: Path, name: str, *, resolve: bool) -> dict[str, Any]:
    run = await _open(folder, Effects(folder, name))
    try:
        if resolve:
            (call_id,) = run.controller.in_doubt()
            await run.resolve_in_doubt(call_id, RESOLVED)
        result = await run.run()
    except Exception as error:
        return _outcome(name, run, error=error)
    return _outcome(name, run, result)


# -------------------------------------------------------------- pydantic-ai alone


def _save(folder: Path, messages: list[ModelMessage]) -> None:
    (folder / "alone.json").write_bytes(ModelMessagesTypeAdapter.dump_json(messages))


def _load(folder: Path) -> list[ModelMessage]:
    return ModelMessagesTypeAdapter.validate_json((folder / "alone.json").read_bytes())


async def alone(folder: Path, command: str, name: str) -> dict[str, Any] | None:
    effect = Effects(folder, name)
    agent = billing(effect, tool="charge", call_id="c1", crash=command == "alone-crash")
    if command == "alone-pause":
        paused = await agent.run("charge me 7")
        assert isinstance(paused.output, DeferredToolRequests)
        _save(folder, paused.all_messages())
        return None
    approved = DeferredToolResults(approvals={"c1": True})
    result = await agent.run(message_history=_load(folder), deferred_tool_results=approved)
    if command == "alone-crash":
        raise AssertionError("the tool should have killed this process")
    return {"name": name, "outcome": "completed", "error": None, "step": None,
            "output": result.output}


# ------------------------------------------------------------------ mixed calls


def mixed_model(effect: Effects) -> FunctionModel:
    def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        effect("model")
        answered = {part.tool_call_id: part.content for message in messages
                    for part in message.parts if part.part_kind == "tool-return"}
        if "c1" in answered:
            return ModelResponse(parts=[TextPart(f"done: {answered['c1']}")])
        return ModelResponse(parts=[ToolCallPart("charge", {"x": 7}, tool_call_id="c1"),
                                    ToolCallPart("lookup", {"i": 1}, tool_call_id="c2")])

    return FunctionModel(respond)


def mixed_agent(effect: Effects) -> Agent[None, Any]:
    agent: Agent[None, Any] = Agent(mixed_model(effect),
                                    output_type=[str, DeferredToolRequests])

    @agent.tool_plain(requires_approval=True)
    def charge(x: int) -> str:
        effect("tool charge")
        return f"charged {x}"

    @agent.tool_plain
    def lookup(i: int) -> str:
        effect("tool lookup")
        return f"found {i}"

    return agent


class DiesInWrite(SQLiteSession):
    """The run's SQLite history, whose first write kills the process before or after
    its COMMIT."""

    def __init__(self, session_id: str, path: Path, when: str) -> None:
        super().__init__(session_id, path)
        self.when = when

    def _before_commit(self) -> None:
        if self.when == "during":
            os.kill(os.getpid(), signal.SIGKILL)

    def _after_commit(self) -> None:
        if self.when == "after":
            os.kill(os.getpid(), signal.SIGKILL)


async def mixed(folder: Path, command: str, name: str, extra: list[str]) -> dict[str, Any]:
    effect = Effects(folder, name)
    history: SQLiteSession = (DiesInWrite(HISTORY_ID, folder / "history.db", extra[0])
                              if command == "mixed-kill"
                              else SQLiteSession(HISTORY_ID, folder / "history.db"))
    run = await LedgerRun.open(mixed_agent(effect), run_id=RUN_ID, history=history,
                               store=SQLiteEventStore(folder / "events.db"), owner=name,
                               take_over="take-over" in extra, buffered=False)
    try:
        result = await run.run("charge me 7" if command == "mixed-pause" else None)
        if command == "mixed-pause":
            assert [call.call_id for call in result.pending] == ["c1"], result
            await run.approve("c1")
    except Exception as error:
        return _outcome(name, run, error=error)
    return _outcome(name, run, result)


async def alone_mixed(folder: Path, command: str, name: str) -> dict[str, Any] | None:
    agent = mixed_agent(Effects(folder, name))
    if command == "alone-mixed-pause":
        paused = await agent.run("charge me 7")
        assert isinstance(paused.output, DeferredToolRequests)
        _save(folder, paused.all_messages())
        return None
    approved = DeferredToolResults(approvals={"c1": True})
    result = await agent.run(message_history=_load(folder), deferred_tool_results=approved)
    if command == "alone-mixed-kill":
        os.kill(os.getpid(), signal.SIGKILL)  # the answer came; its messages are not saved
    return {"name": name, "outcome": "completed", "error": None, "step": None,
            "output": result.output}


def main(argv: list[str]) -> None:
    command, folder = argv[0], Path(argv[1])
    name = argv[2] if len(argv) > 2 else command
    if command == "pause":
        asyncio.run(pause(folder))
    elif command in ("crash", "crash-fresh"):
        asyncio.run(crash(folder, fresh=command == "crash-fresh"))
    elif command in ("resume", "resolve"):
        print(json.dumps(asyncio.run(resume(folder, name, resolve=command == "resolve"))))
    elif command.startswith("mixed-"):
        name = command if command != "mixed-resume" else name
        print(json.dumps(asyncio.run(mixed(folder, command, name, argv[2:]))))
    elif command.startswith("alone-mixed-"):
        answer = asyncio.run(alone_mixed(folder, command, name))
        if answer is not None:
            print(json.dumps(answer))
    elif command.startswith("alone-"):
        answer = asyncio.run(alone(folder, command, name))
        if answer is not None:
            print(json.dumps(answer))
    else:
        raise SystemExit(f"unknown command {command!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
