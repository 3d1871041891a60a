"""A worker of the claim race (tests/core/test_claim.py), and the run it races on.

The run ``claim-race`` (SQLite event store DIR/events.db, SQLite session DIR/session.db)
is paused before the approval-gated tool ``pay`` runs: at INTERRUPTION with ``pay``
approved (``prepare(DIR, "interruption")``), or in TOOLS after an attempt that claimed and
resumed it died before the tool's input guardrail ran (``prepare(DIR, "tools")``).

``python -m tests.drivers.claim_driver`` serves trials, one command a line on stdin:

* ``load DIR`` opens the store and the session in DIR, loads the run (before the
  barrier, so every worker holds the same version) and answers ``loaded <version>``;
* ``go run`` / ``go streamed`` resumes it with ``Runner.run`` / ``Runner.run_streamed``
  and answers one JSON line: ``{"pid", "outcome": "completed" | "conflict" | "error",
  "action", "error"}``;
* ``quit``.

Every guardrail, hook, model call and tool the worker runs appends ``<pid> <what>`` to
DIR/effects.txt, opened with O_APPEND, before it returns.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from statemachine import ConcurrencyConflict, ControlError, RunController, ToolCall
from statemachine.payloads import JSON
from statemachine.runner import (
    Agent,
    FunctionTool,
    ModelResponse,
    OutputGuardrail,
    RunHooks,
    Runner,
    ToolGuardrail,
    Verdict,
)
from statemachine.sessions import SQLiteSession
from statemachine.stores import SQLiteEventStore

RUN_ID = "claim-race"
SESSION_ID = "claim-session"
EFFECTS = "effects.txt"
WINNER_EFFECTS = ("guardrail pay_input", "hook tool_start:pay", "tool pay",
                  "guardrail pay_output", "hook tool_end:pay", "hook model_start", "model",
                  "hook model_end", "guardrail final_check", "hook agent_end")
"""What the attempt that goes on runs, each exactly once, in this order."""


class Effects:
    """Appends one line per effect to a file opened with O_APPEND (atomic per line)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path

    def __call__(self, what: str) -> None:
        if self.path is None:
            return
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{os.getpid()} {what}\n".encode())
        finally:
            os.close(fd)


class Model:
    def __init__(self, effect: Effects) -> None:
        self.effect = effect

    async def respond(self, history: list[JSON], agent: Agent) -> ModelResponse:
        self.effect("model")
        if any(type(item) is dict and item.get("type") == "function_call_output"
               for item in history):
            return ModelResponse(output="paid 7")
        return ModelResponse(tool_calls=(("pay", "pay", {"amount": 7}),))


class Hooks(RunHooks):
    def __init__(self, effect: Effects) -> None:
        self.effect = effect

    async def on_agent_start(self, agent: Agent) -> None:
        self.effect("hook agent_start")

    async def on_agent_end(self, agent: Agent, output: JSON) -> None:
        self.effect("hook agent_end")

    async def on_llm_start(self, agent: Agent) -> None:
        self.effect("hook model_start")

    async def on_llm_end(self, agent: Agent, response: ModelResponse) -> None:
        self.effect("hook model_end")

    async def on_tool_start(self, agent: Agent, call: ToolCall) -> None:
        self.effect(f"hook tool_start:{call.call_id}")

    async def on_tool_end(self, agent: Agent, call: ToolCall, output: JSON) -> None:
        self.effect(f"hook tool_end:{call.call_id}")


def build(effects: Path | None, kind: type[Effects] = Effects) -> tuple[Agent, Hooks]:
    """The agent and hooks; every effect goes to ``effects`` (None: nowhere), written by
    ``kind``."""
    effect = kind(effects)

    def guard(name: str) -> Any:
        def check(*args: Any) -> Verdict:
            effect(f"guardrail {name}")
            return Verdict()

        return check

    def pay(amount: int) -> str:
        effect("tool pay")
        return f"paid {amount}"

    tool = FunctionTool("pay", pay, needs_approval=True,
                        input_guardrails=(ToolGuardrail("pay_input", guard("pay_input")),),
                        output_guardrails=(ToolGuardrail("pay_output", guard("pay_output")),))
    agent = Agent("payer", Model(effect), (tool,),
                  output_guardrails=(OutputGuardrail("final_check", guard("final_check")),))
    return agent, Hooks(effect)


def prepare(folder: Path, variant: str) -> int:
    """Write the paused run into ``folder``; returns the version it is paused at."""
    agent, hooks = build(None)
    store = SQLiteEventStore(folder / "events.db")
    session = SQLiteSession(SESSION_ID, folder / "session.db")
    try:
        first = asyncio.run(Runner.run(agent, "pay 7", session=session, store=store,
                                       run_id=RUN_ID, hooks=hooks))
        c = first.controller
        c.approve("pay", fingerprint=c.fingerprint("pay"))
        if variant == "tools":
            c.claim("died-before-its-guardrail")  # as the runner would, then resume...
            c.resume()  # ...and the process died here: TOOLS, pay approved, unstarted
        elif variant != "interruption":
            raise ValueError(variant)
        return c.version
    finally:
        store.close()
        session.close()


class TimedStore(SQLiteEventStore):
    """Notes when its first append (the attempt's claim) began and ended, on the
    system-wide monotonic clock, so the parent can see that the claims overlapped."""

    first: tuple[float, float] | None = None

    def append(self, *args: Any, **kwargs: Any) -> None:
        began = time.monotonic()
        try:
            super().append(*args, **kwargs)
        finally:
            if self.first is None:
                self.first = (began, time.monotonic())


def _outcome(error: BaseException | None) -> dict[str, Any]:
    if error is None:
        return {"outcome": "completed"}
    kind = "conflict" if type(error) is ConcurrencyConflict else "error"
    return {"outcome": kind, "action": getattr(error, "action", None),
            "error": f"{type(error).__name__}: {error}"}


async def _resume(mode: str, agent: Agent, hooks: Hooks, c: RunController,
                  session: SQLiteSession) -> str:
    if mode == "streamed":
        streamed = Runner.run_streamed(agent, session=session, controller=c, hooks=hooks)
        async for _ in streamed.stream_events():
            pass
        return streamed.result.step.value
    return (await Runner.run(agent, session=session, controller=c, hooks=hooks)).step.value


def serve() -> None:
    opened: tuple[TimedStore, SQLiteSession, RunController, Agent, Hooks] | None = None
    loop = asyncio.new_event_loop()
    for line in sys.stdin:
        command, _, argument = line.strip().partition(" ")
        if command == "load":
            folder = Path(argument)
            store = TimedStore(folder / "events.db")
            session = SQLiteSession(SESSION_ID, folder / "session.db")
            c = RunController.load(store, RUN_ID)
            opened = (store, session, c, *build(folder / EFFECTS))
            answer: Any = f"loaded {c.version}"
        elif command == "go":
            assert opened is not None
            went = time.monotonic()
            store, session, c, agent, hooks = opened
            error: BaseException | None = None
            try:
                step = loop.run_until_complete(_resume(argument, agent, hooks, c, session))
            except (ControlError, Exception) as exc:
                error, step = exc, None
            answer = json.dumps({"pid": os.getpid(), "step": step, "go": went,
                                 "claim": store.first, **_outcome(error)})
            store.close()
            session.close()
            opened = None
        elif command == "quit":
            loop.close()
            return
        else:
            answer = f"unknown command {command!r}"
        sys.stdout.write(f"{answer}\n")
        sys.stdout.flush()


if __name__ == "__main__":
    serve()
