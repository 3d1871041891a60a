"""Processes of the openai-agents adapter tests (tests/adapters/test_openai_agents.py): one
command per process, on a run kept in DIR (SQLite event store DIR/events.db, the SDK's own
`SQLiteSession` in DIR/session.db, the SDK state saved at the interruption in
DIR/state.json).

``python -m tests.drivers.openai_agents_driver COMMAND DIR [NAME]``:

* ``pause DIR``: start the run; the scripted model asks for ``charge(x=7)``, which needs
  approval; save the SDK state, then approve the call through the adapter;
* ``crash DIR``: resume the paused run; ``charge`` kills its own process (SIGKILL) inside
  its body, after its effect;
* ``crash-fresh DIR``: start a run whose model asks for ``pay(x=7)`` (no approval); ``pay``
  kills its own process inside its body;
* ``resume DIR NAME [take-over]``: open the run (with ``take_over=True`` when asked) and
  run it to its next stop (with the saved state when there is one);
* ``pause-receipt DIR``: like ``pause``, for ``receipt(x=7)``, whose result is a pydantic
  model; ``crash-after-tool DIR``: resume it; the process kills itself in the tool's end
  hook, after the result is recorded and before it is written;
* ``final DIR WHERE`` / ``final-sdk DIR WHERE`` (WHERE: ``guardrail`` or ``agent_end``):
  start a run (through the adapter, or on the SDK alone) whose model answers at once; the
  process kills itself inside the output guardrail or the ``on_agent_end`` hook, after its
  effect and before the answer is written; ``resume-sdk DIR NAME``: the SDK alone's
  restart (a new ``Runner.run`` on the Session);
* ``crash-write DIR``: start a run whose model asks for ``pay(x=7)``; the process kills
  itself inside the Session write of pay's result, before anything of it is written;
* ``race DIR NAME``: like ``resume``, but only after loading the run and waiting until two
  racers have loaded it (so both hold the same version);
* ``overhead DIR``: measure the adapter against the SDK alone, side by side in one run, and
  print one JSON line (see `overhead`).

Every tool body, hook, guardrail and model call appends ``NAME what`` to DIR/effects.txt
(O_APPEND, fsynced) before it returns; each model call appends the input it received as
one JSON line to DIR/bodies.jsonl. ``resume`` and ``race`` print one JSON line:
``{"name", "outcome": "completed" | "interruption" | "error", "error", "message", "step",
"final_output"}``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pydantic
from agents import (
    Agent,
    GuardrailFunctionOutput,
    RunConfig,
    RunHooks,
    Runner,
    SQLiteSession,
    ToolGuardrailFunctionOutput,
    function_tool,
    output_guardrail,
    set_tracing_disabled,
    tool_input_guardrail,
)
from agents.testing import ScriptedModel, assistant_message, function_call

from statemachine import SQLiteEventStore, Step
from statemachine.adapters.openai_agents import AgentRun
from tests.drivers.effects import Effects

RUN_ID = "oa-run"
SESSION_ID = "oa-session"
CONFIG = RunConfig(tracing_disabled=True)
set_tracing_disabled(True)


class Receipt(pydantic.BaseModel):
    amount: int
    note: str


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class Hooks(RunHooks[Any]):
    """Every hook counted; ``kill_in`` names the hooks that then kill the process."""

    def __init__(self, effect: Effects, kill_in: tuple[str, ...] = ()) -> None:
        self.effect = effect
        self.kill_in = kill_in

    async def on_agent_start(self, context: Any, agent: Any) -> None:
        self.effect("hook agent_start")

    async def on_agent_end(self, context: Any, agent: Any, output: Any) -> None:
        self.effect("hook agent_end")
        if "agent_end" in self.kill_in:
            _die()

    async def on_llm_start(self, context: Any, agent: Any, system_prompt: Any,
                           input_items: Any) -> None:
        self.effect("model")

    async def on_tool_start(self, context: Any, agent: Any, tool: Any) -> None:
        self.effect(f"hook tool_start {tool.name}")

    async def on_tool_end(self, context: Any, agent: Any, tool: Any, result: Any) -> None:
        self.effect(f"hook tool_end {tool.name}")
        if "tool_end" in self.kill_in:
            _die()


class CountedModel(ScriptedModel):
    """The scripted model, each call counted (``model call``)."""

    def __init__(self, effect: Effects, responses: list[Any]) -> None:
        super().__init__(responses)
        self.effect = effect

    async def get_response(self, *args: Any, **kwargs: Any) -> Any:
        self.effect("model call")
        received = kwargs["input"] if "input" in kwargs else args[1]
        fd = os.open(self.effect.path.with_name("bodies.jsonl"),
                     os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:  # the exact input the model received, one JSON line per call
            os.write(fd, (json.dumps(received, default=str) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        return await super().get_response(*args, **kwargs)


class KillingSession(SQLiteSession):
    """The run's Session, killing the process inside its ``kill_on``-th write, before
    anything of it is written."""

    def __init__(self, session_id: str, path: Path, kill_on: int) -> None:
        super().__init__(session_id, path)
        self.kill_on = kill_on
        self.writes = 0

    async def add_items(self, items: list[Any]) -> None:
        self.writes += 1
        if self.writes == self.kill_on:
            _die()
        await super().add_items(items)


def agent(effect: Effects, *, responses: list[Any], crash: bool) -> Agent[Any]:
    @tool_input_guardrail
    def amount_check(data: Any) -> ToolGuardrailFunctionOutput:
        effect("guardrail amount_check")
        return ToolGuardrailFunctionOutput.allow()

    @function_tool(needs_approval=True, tool_input_guardrails=[amount_check])
    def charge(x: int) -> str:
        effect("tool charge")
        if crash:
            os.kill(os.getpid(), signal.SIGKILL)
        return f"charged {x}"

    @function_tool
    def pay(x: int) -> str:
        effect("tool pay")
        if crash:
            os.kill(os.getpid(), signal.SIGKILL)
        return f"paid {x}"

    @function_tool(needs_approval=True)
    def receipt(x: int) -> Receipt:
        effect("tool receipt")
        return Receipt(amount=x, note="ok")

    return Agent("billing", model=CountedModel(effect, responses),
                 tools=[charge, pay, receipt])


def final_agent(effect: Effects, *, kill_in: tuple[str, ...] = ()) -> Agent[Any]:
    """The model answers at once; an output guardrail checks the answer."""

    @output_guardrail
    def checked(context: Any, agent: Any, output: Any) -> GuardrailFunctionOutput:
        effect("guardrail checked")
        if "guardrail" in kill_in:
            _die()
        return GuardrailFunctionOutput(output_info=None, tripwire_triggered=False)

    return Agent("oracle", model=CountedModel(effect, [[assistant_message("the answer is 42")],
                                                       [assistant_message("another")]]),
                 output_guardrails=[checked])


async def _open(folder: Path, effect: Effects, *, responses: list[Any],
                crash: bool = False, the_agent: Agent[Any] | None = None,
                session: SQLiteSession | None = None, take_over: bool = False) -> AgentRun:
    return await AgentRun.open(
        the_agent or agent(effect, responses=responses, crash=crash), run_id=RUN_ID,
        session=session or SQLiteSession(SESSION_ID, folder / "session.db"),
        store=SQLiteEventStore(folder / "events.db"), owner=effect.name, take_over=take_over,
        buffered=False)  # one append per event: each kill falls between two of them


def _state(folder: Path) -> str | None:
    path = folder / "state.json"
    return path.read_text() if path.exists() else None


async def pause(folder: Path, tool: str = "charge") -> None:
    effect = Effects(folder, "pause")
    run = await _open(folder, effect, responses=[[function_call(tool, {"x": 7},
                                                                call_id="c1")]])
    paused = await run.run("charge me 7", hooks=Hooks(effect), run_config=CONFIG)
    assert paused.step is Step.INTERRUPTION
    assert paused.state is not None
    (folder / "state.json").write_text(paused.state.to_string())
    (item,) = paused.interruptions
    await run.approve(item)


async def crash(folder: Path, fresh: bool) -> None:
    effect = Effects(folder, "crash")
    responses = [[function_call("pay", {"x": 7}, call_id="p1")]] if fresh else []
    run = await _open(folder, effect, responses=responses, crash=True)
    await run.run("pay 7" if fresh else None, state=None if fresh else _state(folder),
                  hooks=Hooks(effect), run_config=CONFIG)
    raise AssertionError("the tool should have killed this process")


async def crash_after_tool(folder: Path) -> None:
    effect = Effects(folder, "crash")
    run = await _open(folder, effect, responses=[])
    await run.run(state=_state(folder), hooks=Hooks(effect, kill_in=("tool_end",)),
                  run_config=CONFIG)
    raise AssertionError("the end hook should have killed this process")


async def final(folder: Path, where: str, *, sdk: bool) -> None:
    effect = Effects(folder, "crash")
    the_agent = final_agent(effect, kill_in=(where,))
    hooks = Hooks(effect, kill_in=(where,))
    session = SQLiteSession(SESSION_ID, folder / "session.db")
    if sdk:
        await Runner.run(the_agent, "what is the answer?", session=session, hooks=hooks,
                         run_config=CONFIG)
    else:
        run = await _open(folder, effect, responses=[], the_agent=the_agent, session=session)
        await run.run("what is the answer?", hooks=hooks, run_config=CONFIG)
    raise AssertionError(f"the {where} should have killed this process")


async def resume_sdk(folder: Path, name: str) -> dict[str, Any]:
    effect = Effects(folder, name)
    session = SQLiteSession(SESSION_ID, folder / "session.db")
    result = await Runner.run(final_agent(effect), [], session=session, hooks=Hooks(effect),
                              run_config=CONFIG)
    return {"name": name, "outcome": "completed", "final_output": result.final_output}


async def crash_write(folder: Path) -> None:
    effect = Effects(folder, "crash")
    session = KillingSession(SESSION_ID, folder / "session.db", kill_on=2)
    run = await _open(folder, effect, session=session,
                      responses=[[function_call("pay", {"x": 7}, call_id="p1")]])
    await run.run("pay 7", hooks=Hooks(effect), run_config=CONFIG)
    raise AssertionError("the Session write should have killed this process")


async def resume(folder: Path, name: str, *, barrier: bool,
                 take_over: bool = False) -> dict[str, Any]:
    effect = Effects(folder, name)
    final_run = (folder / "final").exists()
    run = await _open(folder, effect, responses=[[assistant_message("done")]],
                      the_agent=final_agent(effect) if final_run else None,
                      take_over=take_over)
    if barrier:
        (folder / f"ready-{name}").write_text("")
        deadline = time.monotonic() + 30
        while len(list(folder.glob("ready-*"))) < 2:
            if time.monotonic() > deadline:
                raise AssertionError("the other racer never loaded the run")
            await asyncio.sleep(0.005)
    try:
        result = await run.run(state=_state(folder), hooks=Hooks(effect), run_config=CONFIG)
    except Exception as error:
        return {"name": name, "outcome": "error", "error": type(error).__name__,
                "message": str(error), "step": run.controller.step.value}
    return {"name": name, "outcome": result.step.value, "error": None,
            "step": result.step.value, "final_output": result.final_output}


# ------------------------------------------------------------------- overhead


def _calls_agent(calls: int) -> Agent[Any]:
    @function_tool
    def lookup(i: int) -> str:
        return f"found {i}"

    response = [function_call("lookup", {"i": i}, call_id=f"c{i}") for i in range(calls)]
    return Agent("bench", model=ScriptedModel([response, [assistant_message("done")]]),
                 tools=[lookup])


async def _timed(calls: int, how: str, folder: Path, n: int) -> float:
    """Seconds for one whole run with ``calls`` tool calls in one model response: on the
    SDK alone, or through `AgentRun` with a memory or SQLite (synchronous=FULL) store."""
    from agents import Runner

    from statemachine import MemoryEventStore

    agent = _calls_agent(calls)
    session = SQLiteSession(f"s{n}", ":memory:")
    started = time.perf_counter()
    if how == "sdk":
        await Runner.run(agent, "go", session=session, run_config=CONFIG)
    else:
        store = (MemoryEventStore() if how == "memory"
                 else SQLiteEventStore(folder / f"bench-{n}.db"))
        run = await AgentRun.open(agent, run_id=f"r{n}", session=session, store=store,
                                  buffered=how == "sqlite-buffered")
        result = await run.run("go", run_config=CONFIG)
        assert result.step is Step.COMPLETED
    return time.perf_counter() - started


async def _write_timed(how: str, folder: Path, writes: int) -> float:
    """Seconds per 2-item Session write: the SDK's session directly, or through the
    adapter's `LedgerSession` (stage, durable envelope, write, commit)."""
    from statemachine import MemoryEventStore

    session = SQLiteSession("w", ":memory:")
    batch = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    target: Any = session
    if how != "sdk":
        store = (MemoryEventStore() if how == "memory"
                 else SQLiteEventStore(folder / f"writes-{how}.db"))
        run = await AgentRun.open(_calls_agent(1), run_id=f"w-{how}", session=session,
                                  store=store, buffered=how == "sqlite-buffered")
        target = run.session
    started = time.perf_counter()
    for i in range(writes):
        await target.add_items([dict(item, n=i) for item in batch])
    return (time.perf_counter() - started) / writes


async def overhead(folder: Path, repeats: int = 7) -> dict[str, Any]:
    """The adapter's overhead, measured side by side in one run (medians of ``repeats``,
    GC on, after one warm-up): per tool call, the slope over 1 → 21 calls in one model
    response, adapter minus SDK alone; per write, a 2-item ``add_items`` through
    `LedgerSession` minus the SDK's session alone."""
    from statistics import median

    hows = ("sdk", "memory", "sqlite", "sqlite-buffered")
    await _timed(1, "sdk", folder, 0)
    times: dict[tuple[str, int], list[float]] = {}
    n = 1
    for _ in range(repeats):
        for how in hows:
            for calls in (1, 21):
                n += 1
                times.setdefault((how, calls), []).append(await _timed(calls, how, folder, n))
    run = {key: median(values) for key, values in times.items()}
    slope = {how: (run[how, 21] - run[how, 1]) / 20 for how in hows}
    writes: dict[str, float] = {}
    for how in hows:
        samples = []
        for r in range(repeats):
            (folder / f"{how}-{r}").mkdir()
            samples.append(await _write_timed(how, folder / f"{how}-{r}", 50))
        writes[how] = median(samples)
    us = 1e6
    return {
        "run_1_call_ms": {how: round(run[how, 1] * 1e3, 2) for how in hows},
        "run_21_calls_ms": {how: round(run[how, 21] * 1e3, 2) for how in hows},
        "per_tool_call_us": {how: round(slope[how] * us, 1) for how in hows},
        "tool_call_overhead_us": {how: round((slope[how] - slope["sdk"]) * us, 1)
                                  for how in hows[1:]},
        "per_write_us": {how: round(writes[how] * us, 1) for how in hows},
        "write_overhead_us": {how: round((writes[how] - writes["sdk"]) * us, 1)
                              for how in hows[1:]},
    }


def main(argv: list[str]) -> None:
    command, folder = argv[0], Path(argv[1])
    name = argv[2] if len(argv) > 2 else command
    if command == "pause":
        asyncio.run(pause(folder))
    elif command == "pause-receipt":
        asyncio.run(pause(folder, "receipt"))
    elif command in ("crash", "crash-fresh"):
        asyncio.run(crash(folder, fresh=command == "crash-fresh"))
    elif command == "crash-after-tool":
        asyncio.run(crash_after_tool(folder))
    elif command in ("final", "final-sdk"):
        (folder / "final").write_text("")
        asyncio.run(final(folder, argv[2], sdk=command == "final-sdk"))
    elif command == "resume-sdk":
        print(json.dumps(asyncio.run(resume_sdk(folder, name))))
    elif command == "crash-write":
        asyncio.run(crash_write(folder))
    elif command == "overhead":
        print(json.dumps(asyncio.run(overhead(folder))))
    elif command in ("resume", "race"):
        print(json.dumps(asyncio.run(resume(folder, name, barrier=command == "race",
                                            take_over=argv[3:] == ["take-over"]))))
    else:
        raise SystemExit(f"unknown command {command!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
