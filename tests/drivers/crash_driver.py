"""Scripted runs on the embedded defaults, killed with SIGKILL at a chosen point.

``python -m tests.drivers.crash_driver DIR [--kill-after-event N | --kill-in-tool |
--kill-in-append K:before|after]`` drives (or resumes) the run ``crash`` with a SQLite
store and a SQLite session in DIR. The model proposes ``pay`` (approval-gated, its effect
appends a line to DIR/pay.txt) and ``lookup`` (idempotent, counted in DIR/lookup.txt),
then answers. The process prints one JSON line with its outcome, unless it was killed.

``python -m tests.drivers.crash_driver DIR --hooks [--kill-at-tick N]`` drives the same run
through the reference `Runner` with every hook and guardrail (`run_hooked`): each hook,
guardrail, model call and tool appends a line naming itself to DIR/effects.txt. The
process kills itself at its N-th durable boundary (a tick): an effects line written, an
event appended, a Session batch about to commit or committed. A kill right after an
effects line falls between a hook running and its event being recorded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from statemachine import (
    Action,
    Execute,
    RunController,
    RunNotResumable,
    Step,
    ToolCall,
    ToolInDoubt,
)
from statemachine.events import Event, InputAdded
from statemachine.payloads import JSON
from statemachine.runner import (
    ALLOW,
    Agent,
    FunctionTool,
    ModelResponse,
    OutputGuardrail,
    RunHooks,
    Runner,
    ToolGuardrail,
    Verdict,
    publish,
    settle,
)
from statemachine.sessions import SQLiteSession
from statemachine.stores import SQLiteEventStore

RUN_ID = "crash"
RESPONSES = [
    [ToolCall("pay", "pay", {"amount": 7}, needs_approval=True),
     ToolCall("lookup", "lookup", {"q": "rate"}, idempotent=True)],
    "paid 7",
]


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class KillingStore(SQLiteEventStore):
    kill_after: int | None = None

    def append(self, run_id: str, events: Sequence[Event], expected_version: int,
               **options: Any) -> None:  # snapshot=, and whatever else the store takes
        super().append(run_id, events, expected_version, **options)
        if self.kill_after is not None and any(e.seq == self.kill_after for e in events):
            _die()


class KillingSession(SQLiteSession):
    kill_at: tuple[int, str] | None = None
    appends = 0

    async def add_items(self, items: list[Any]) -> None:
        self.appends += 1
        await super().add_items(items)

    def _before_commit(self) -> None:
        if self.kill_at == (self.appends, "before"):
            _die()

    def _after_commit(self) -> None:
        if self.kill_at == (self.appends, "after"):
            _die()


def _effect(folder: Path, name: str, line: str) -> None:
    with open(folder / name, "a") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


async def drive(folder: Path, store: SQLiteEventStore, session: SQLiteSession,
                kill_in_tool: bool) -> dict[str, Any]:
    if store.load(RUN_ID):
        c = RunController.load(store, RUN_ID)
    else:
        c = RunController.start(run_id=RUN_ID, session_id=session.session_id, store=store)
    try:
        c.resume()
    except ToolInDoubt as error:
        return {"outcome": "in_doubt", "call_id": error.call_id}
    except RunNotResumable:
        return {"outcome": c.step.value}
    while True:
        action = c.next_action()
        if action is Action.NOT_RESUMABLE:
            return {"outcome": c.step.value}
        if action is Action.RESOLVE_IN_DOUBT:
            return {"outcome": "in_doubt", "call_id": c.in_doubt()[0]}
        if action is Action.RECONCILE:
            # the previous process is dead: no write of its attempt can still land
            await settle(c, session, take_over=True)
        elif action is Action.CALL_MODEL:
            if c.step is not Step.AWAITING_MODEL:
                c.begin_model_call()
            response = RESPONSES[c.turns]
            if isinstance(response, list):
                c.model_responded(response)
            else:
                c.model_responded([], output=response)
        elif action is Action.AWAIT_DECISIONS:
            for call_id in c.pending_approvals:
                c.approve(call_id, fingerprint=c.fingerprint(call_id))
        elif action is Action.RUN_TOOLS:
            if c.step is Step.INTERRUPTION:
                c.resume()
                continue
            for call_id in c.runnable_call_ids():
                decision = c.begin_tool(call_id)
                if isinstance(decision, Execute):
                    if call_id == "pay":
                        _effect(folder, "pay.txt", "charged 7")
                        if kill_in_tool:
                            _die()
                    else:
                        _effect(folder, "lookup.txt", "looked up")
                    c.tool_completed(call_id, f"{call_id} done")
        elif action is Action.PUBLISH:
            ids = list(c.unpublished_call_ids())
            items: list[Any] = []
            for call_id in ids:
                items.append({"type": "function_call", "call_id": call_id})
                items.append({"type": "function_call_output", "call_id": call_id,
                              "output": c.call(call_id).result})
            if c.step is Step.FINAL_OUTPUT:
                items.append({"role": "assistant", "content": c.final_output})
            await publish(c, session, items, call_ids=ids)
        elif action is Action.FINISH:
            c.accept_final_output(c.model_output)


# ------------------------------------------------- every hook and guardrail (--hooks)

EFFECTS = "effects.txt"
HOOKED_INPUT = "pay 7, then look the rate up"


class Ticks:
    """The durable boundaries this process crossed, by label. At the ``kill_at``-th it
    notes the boundary in DIR/kills.txt and SIGKILLs its own process."""

    def __init__(self, folder: Path, kill_at: int | None = None) -> None:
        self.folder = folder
        self.kill_at = kill_at
        self.labels: list[str] = []

    def __call__(self, label: str) -> None:
        self.labels.append(label)
        if len(self.labels) == self.kill_at:
            with open(self.folder / "kills.txt", "a") as f:
                f.write(f"{self.kill_at} {label}\n")
            _die()


def append_line(path: Path, line: str) -> None:
    """Append one line with O_APPEND and fsync it before returning: once this returns,
    the effect survives any kill."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


class Effects:
    """Every hook, guardrail, model call and tool reports here: one fsynced line naming
    it (``hook tool_start:pay``, ``guardrail pay_input``, ``tool pay``...), then a tick."""

    def __init__(self, folder: Path, ticks: Ticks) -> None:
        self.path = folder / EFFECTS
        self.ticks = ticks

    def __call__(self, line: str) -> None:
        append_line(self.path, line)
        self.ticks(f"effect {line}")


class TickingStore(SQLiteEventStore):
    def __init__(self, path: Path, ticks: Ticks) -> None:
        super().__init__(path)
        self.ticks = ticks

    def append(self, run_id: str, events: Sequence[Event], expected_version: int,
               **options: Any) -> None:
        super().append(run_id, events, expected_version, **options)
        self.ticks("appended " + " ".join(type(e).__name__ for e in events))


class TickingSession(SQLiteSession):
    def __init__(self, session_id: str, path: Path, ticks: Ticks) -> None:
        super().__init__(session_id, path)
        self.ticks = ticks

    def _before_commit(self) -> None:
        self.ticks("session batch written, not committed")

    def _after_commit(self) -> None:
        self.ticks("session batch committed")


class EffectHooks(RunHooks):
    """Every lifecycle hook, named by its scope (model hooks by turn, tool hooks by call)."""

    def __init__(self, c: RunController, effect: Effects) -> None:
        self.c = c
        self.effect = effect

    async def on_agent_start(self, agent: Agent) -> None:
        self.effect("hook agent_start")

    async def on_agent_end(self, agent: Agent, output: JSON) -> None:
        self.effect("hook agent_end")

    async def on_llm_start(self, agent: Agent) -> None:
        self.effect(f"hook model_start:{self.c.turns + 1}")

    async def on_llm_end(self, agent: Agent, response: ModelResponse) -> None:
        self.effect(f"hook model_end:{self.c.turns + 1}")

    async def on_tool_start(self, agent: Agent, call: ToolCall) -> None:
        self.effect(f"hook tool_start:{call.call_id}")

    async def on_tool_end(self, agent: Agent, call: ToolCall, output: JSON) -> None:
        self.effect(f"hook tool_end:{call.call_id}")


class HistoryModel:
    """Proposes ``pay`` and ``lookup`` until a tool output is in the history, then
    answers: what it says depends on the Session alone, so a restarted process agrees."""

    def __init__(self, c: RunController, effect: Effects) -> None:
        self.c = c
        self.effect = effect

    async def respond(self, history: list[JSON], agent: Agent) -> ModelResponse:
        self.effect(f"model turn:{self.c.turns + 1}")
        if any(isinstance(item, dict) and item.get("type") == "function_call_output"
               for item in history):
            return ModelResponse(output="paid 7")
        return ModelResponse(tool_calls=(("pay", "pay", {"amount": 7}),
                                         ("lookup", "lookup", {"q": "rate"})))


def hooked_agent(c: RunController, effect: Effects) -> Agent:
    """``pay`` (approval-gated, not idempotent, an input and an output guardrail),
    ``lookup`` (idempotent) and an output guardrail on the final answer."""

    def guard(name: str) -> ToolGuardrail:
        def check(call: ToolCall, *output: JSON) -> Verdict:
            effect(f"guardrail {name}")
            return ALLOW
        return ToolGuardrail(name, check)

    def final_output(output: JSON) -> Verdict:
        effect("guardrail final_output")
        return ALLOW

    def pay(amount: int) -> JSON:
        effect("tool pay")
        return f"charged {amount}"

    def lookup(q: str) -> JSON:
        effect("tool lookup")
        return f"{q} is 1.0"

    return Agent(
        "payer", HistoryModel(c, effect),
        tools=(FunctionTool("pay", pay, needs_approval=True,
                            input_guardrails=(guard("pay_input"),),
                            output_guardrails=(guard("pay_output"),)),
               FunctionTool("lookup", lookup, idempotent=True)),
        output_guardrails=(OutputGuardrail("final_output", final_output),))


async def run_hooked(folder: Path, ticks: Ticks) -> dict[str, Any]:
    """Start or resume the run ``crash`` in ``folder`` through the reference `Runner`,
    approving ``pay`` when asked, until it completes or fails closed."""
    store = TickingStore(folder / "events.db", ticks)
    session = TickingSession("crash-session", folder / "session.db", ticks)
    try:
        if store.load(RUN_ID):
            c = RunController.load(store, RUN_ID)
        else:
            c = RunController.start(run_id=RUN_ID, session_id=session.session_id,
                                    max_turns=10, store=store)
        effect = Effects(folder, ticks)
        agent, hooks = hooked_agent(c, effect), EffectHooks(c, effect)
        new_input = (None if any(isinstance(e, InputAdded) for e in c.events)
                     else HOOKED_INPUT)
        while True:
            # the previous process is dead: no write of its attempt can still land
            result = await Runner.run(agent, new_input, session=session, controller=c,
                                      hooks=hooks, take_over=True)
            new_input = None
            if result.step is Step.COMPLETED:
                return {"outcome": "completed", "output": result.final_output}
            if not result.interruptions:
                return {"outcome": result.step.value}
            for call in result.interruptions:
                c.approve(call.call_id, fingerprint=c.fingerprint(call.call_id))
    except ToolInDoubt as error:
        return {"outcome": "in_doubt", "call_id": error.call_id}
    except RunNotResumable:  # a completed run is not resumed: nothing runs again
        if c.step is Step.COMPLETED:
            return {"outcome": "completed", "output": c.final_output}
        return {"outcome": c.step.value}
    finally:
        store.close()
        session.close()


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", type=Path)
    parser.add_argument("--kill-after-event", type=int)
    parser.add_argument("--kill-in-tool", action="store_true")
    parser.add_argument("--kill-in-append")
    parser.add_argument("--hooks", action="store_true")
    parser.add_argument("--kill-at-tick", type=int)
    args = parser.parse_args(argv)
    if args.hooks:
        ticks = Ticks(args.folder, args.kill_at_tick)
        hooked = asyncio.run(run_hooked(args.folder, ticks))
        print(json.dumps({**hooked, "ticks": ticks.labels}))
        return 0
    store = KillingStore(args.folder / "events.db")
    store.kill_after = args.kill_after_event
    session = KillingSession("crash-session", args.folder / "session.db")
    if args.kill_in_append:
        index, phase = args.kill_in_append.split(":")
        session.kill_at = (int(index), phase)
    result = asyncio.run(drive(args.folder, store, session, args.kill_in_tool))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
