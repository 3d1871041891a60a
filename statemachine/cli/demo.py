"""``statemachine demo``: the field reports, replayed with injected failures on the
embedded defaults (a SQLite event store and a SQLite Session in a fresh directory), with
a transcript of every transition and a table of the invariants checked."""

from __future__ import annotations

import asyncio
import json
import shlex
import tempfile
from collections.abc import MutableMapping
from contextlib import aclosing
from pathlib import Path
from typing import Any

import structlog

from statemachine import structured_logging as log
from statemachine.cli.common import UserError, shown
from statemachine.controller import RunController
from statemachine.errors import ControlError, PublicationUnsettled, RunNotResumable
from statemachine.runner import (
    Agent,
    FunctionTool,
    ModelResponse,
    RemoteToolExecutor,
    Runner,
)
from statemachine.sessions import SQLiteSession
from statemachine.stores import SQLiteEventStore
from statemachine.testing import (
    Counters,
    CountingHooks,
    FakeRemote,
    FlakySession,
    InjectedWriteError,
    ScriptedModel,
    Untouchable,
    check_log,
    counted_tool,
    settled,
)
from statemachine.values import RecoveryPolicy, Step

RUNS = ("partial-approval-1", "partial-approval-2", "terminal-output", "remote-executor")
"""The runs the demo leaves in its store."""


class Demo:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.store = SQLiteEventStore(folder / "events.db")
        self.checks: list[tuple[str, str, bool]] = []

    def say(self, text: str) -> None:
        print(text, flush=True)

    def check(self, invariant: str, what: str, holds: bool) -> None:
        self.checks.append((invariant, what, holds))
        self.say(f"    {'ok' if holds else 'FAILED'}  {invariant}: {what}")

    def session(self, name: str) -> SQLiteSession:
        return SQLiteSession(name, self.folder / "session.db")

    def billing_agent(self, counters: Counters, *, terminal: bool = False) -> Agent:
        charge_tool = counted_tool(counters, "charge", lambda x: f"charged {x}",
                                   needs_approval=True, guarded=True)
        if terminal:
            model = ScriptedModel([ModelResponse((("charge", "charge", {"x": 7}),))])
            return Agent("billing", model, (charge_tool,),
                         tool_use_behavior="stop_on_first_tool")
        model = ScriptedModel([
            ModelResponse((("charge", "charge", {"x": 7}), ("notify", "notify", {}))),
            ModelResponse(output="charged 7 and notified you"),
        ])
        return Agent("billing", model, (charge_tool, counted_tool(
            counters, "notify", lambda: "notified", needs_approval=True)))

    def durable_ok(self, run_id: str, session_items: list[Any]) -> bool:
        c = RunController.load(self.store, run_id)
        check_log(c.events)
        return session_items == settled(c.events)[0]

    # ------------------------------------------------------------- scenarios

    async def partial_approval(self, outcome: str, run_id: str) -> None:
        self.say(f"\n== Partial approval, the resumed write fails ({outcome}) ==")
        counters = Counters()
        hooks = CountingHooks(counters)
        agent = self.billing_agent(counters)
        session = self.session(f"{run_id}-session")
        paused = await Runner.run(agent, "charge me 7 and notify me", session=session,
                                  store=self.store, run_id=run_id, hooks=hooks)
        self.say(f"  paused for decisions on: {', '.join(paused.controller.pending_approvals)}")
        self.say("  the user approves charge only")
        paused.controller.approve("charge")
        frontier = len(await session.get_items())
        flaky = FlakySession(session, fail_on=1, outcome=outcome)  # type: ignore[arg-type]
        try:
            await Runner.run(agent, session=flaky, controller=paused.controller, hooks=hooks)
        except InjectedWriteError as error:
            self.say(f"  the Session write raised: {error}")
            self.check("I6", "the original write error reached the caller",
                       error is flaky.raised)
        restarted = RunController.load(self.store, run_id)
        self.say(f"  a new process loads the run from the store: step {restarted.step.name}")
        before = restarted.events
        try:
            restarted.approve("notify")
            refused = False
        except PublicationUnsettled as error:
            self.say(f"  approving notify now is refused: {error}")
            refused = True
        self.check("I2", "the approval was refused before anything was recorded",
                   refused and restarted.events == before)
        if outcome == "partial":
            try:
                await Runner.run(agent, session=session, store=self.store, run_id=run_id,
                                 hooks=hooks)
                rejected = False
            except ControlError as error:
                self.say(f"  reconcile refuses the partial write: {error}")
                rejected = True
            self.check("I7", "a partial write fails closed and keeps the envelope",
                       rejected and RunController.load(self.store, run_id).envelope
                       is not None)
            while len(await session.get_items()) > frontier:
                await session.pop_item()
            self.say("  the operator restores the Session to the pre-write frontier")
        resumed = await Runner.run(agent, session=session, store=self.store, run_id=run_id,
                                   hooks=hooks)
        decision = [type(e).__name__ for e in resumed.controller.events
                    if type(e).__name__.startswith("Reconciled")]
        self.say(f"  reconciliation: {decision[-1]} -> paused for decisions on: "
                 f"{', '.join(resumed.controller.pending_approvals)}")
        self.check("I5", "notify is still the remaining interruption",
                   resumed.controller.pending_approvals == ("notify",))
        resumed.controller.approve("notify")
        done = await Runner.run(agent, session=session, controller=resumed.controller,
                                hooks=hooks)
        self.say(f"  completed: {done.final_output!r}")
        items = await session.get_items()
        charge_outputs = [i for i in items if i.get("type") == "function_call_output"
                          and i.get("call_id") == "charge"]
        self.check("I1", "charge, its guardrails and its hooks each ran exactly once",
                   counters.tools["charge"] == 1
                   and counters.guardrails == {"charge_input": 1, "charge_output": 1}
                   and counters.hooks["tool_start:charge"] == 1
                   and counters.hooks["tool_end:charge"] == 1)
        self.check("I3", "the Session holds exactly one charge call/output pair",
                   len(charge_outputs) == 1 and self.durable_ok(run_id, items))
        self.check("I4", "the guardrail results were published exactly once",
                   [g.name for g in done.guardrail_results] == ["charge_input",
                                                                "charge_output"])

    async def terminal_fail_closed(self, run_id: str) -> None:
        self.say("\n== Terminal output under FAIL_CLOSED: the final write fails ==")
        counters = Counters()
        hooks = CountingHooks(counters)
        agent = self.billing_agent(counters, terminal=True)
        session = self.session(f"{run_id}-session")
        paused = await Runner.run(agent, "charge me 7", session=session, store=self.store,
                                  run_id=run_id, hooks=hooks,
                                  policy=RecoveryPolicy.FAIL_CLOSED)
        paused.controller.approve("charge")
        flaky = FlakySession(session, fail_on=1, outcome="atomic")
        try:
            await Runner.run(agent, session=flaky, controller=paused.controller, hooks=hooks)
        except InjectedWriteError as error:
            self.say(f"  the terminal write raised: {error}")
        self.say(f"  the run is now {paused.controller.step.name}")
        untouchable = Untouchable(session.session_id)
        refusals = 0
        for attempt in (1, 2):
            try:
                await Runner.run(Agent("billing", untouchable, agent.tools,
                                       tool_use_behavior="stop_on_first_tool"),
                                 session=untouchable, store=self.store,
                                 run_id=run_id, hooks=hooks)
            except RunNotResumable as error:
                refusals += 1
                self.say(f"  resume #{attempt} refused before any work: {error}")
        reloaded = RunController.load(self.store, run_id)
        self.check("I9", "every resume was refused and the marker survived the store",
                   refusals == 2 and reloaded.step is Step.TERMINAL_UNRECOVERABLE
                   and RunController.from_json(json.dumps(reloaded.to_json())).step
                   is Step.TERMINAL_UNRECOVERABLE)
        self.check("I1", "no further model call, tool, guardrail or hook ran",
                   counters.tools["charge"] == 1 and counters.hooks["agent_end"] == 1
                   and agent.model.calls == 1)  # type: ignore[attr-defined]

    async def remote_reconnect(self, run_id: str) -> None:
        self.say("\n== Remote executor: the result post fails for good, then a reconnect ==")
        runs: list[str] = []

        def bash(cmd: str) -> str:
            runs.append(cmd)
            return f"{cmd}: done (execution {len(runs)})"

        remote = FakeRemote([("toolu_1", "bash", {"cmd": "charge-card"})],
                            disconnect_after=[1], post_outcomes={"toolu_1": ["permanent"]})
        controller = RunController.start(run_id=run_id, session_id=None, store=self.store)
        executor = RemoteToolExecutor(remote, [FunctionTool("bash", bash)],
                                      controller=controller, backoff=0)
        seen = []
        async with aclosing(executor.run()) as stream:
            async for call in stream:
                seen.append(call)
                self.say(f"  dispatched {call.call_id}: posted={call.posted}, "
                         f"result={call.result!r}")
        self.say(f"  reconnects: {remote.connections - 1}")
        self.check("I12", "the cached result was re-posted, never recomputed",
                   len(runs) == 1 and len({c.result for c in seen}) == 1
                   and remote.results() == {"toolu_1": [seen[0].result]})
        check_log(RunController.load(self.store, run_id).events)
        self.check("I11", "the tool ran once across the failed post and the reconnect",
                   runs == ["charge-card"])

    async def play(self) -> None:
        await self.partial_approval("commit_then_raise", "partial-approval-1")
        await self.partial_approval("partial", "partial-approval-2")
        await self.terminal_fail_closed("terminal-output")
        await self.remote_reconnect("remote-executor")
        for run_id in RUNS:
            c = RunController.load(self.store, run_id)
            check_log(c.events)
        self.check("I10", "every run replays from the store, each transition re-checked",
                   True)


def _transcript(logger: Any, method: str, event: MutableMapping[str, Any]) -> str:
    run = event.get("run_id", "?")
    return (f"    [{run}] #{event.get('seq')} {event.get('event')}: "
            f"{(event.get('from') or 'new').upper()} -> {str(event.get('to')).upper()}")


def _folder(folder: Path | None) -> Path:
    """The demo's directory: a new or empty one; `UserError` otherwise."""
    if folder is None:
        return Path(tempfile.mkdtemp(prefix="statemachine-demo-"))
    where = shown(folder)
    if folder.exists() and not folder.is_dir():
        raise UserError(f"--dir {where} is a file, not a directory")
    if folder.is_dir() and any(folder.iterdir()):
        raise UserError(f"--dir {where} is not empty: the demo writes its databases into "
                        "an empty or new directory, so give one (or leave --dir out)")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UserError(f"cannot create --dir {where}: {error.strerror or error}") from None
    return folder


def _next_steps(folder: Path) -> list[str]:
    """The commands that look at the runs the demo left, with its real paths."""
    store = shlex.quote(str(folder / "events.db"))
    lines = ["\nLook at the runs it left (these commands only read the store):"]
    lines += [f"  statemachine inspect --store {store} --run {run_id}" for run_id in RUNS]
    lines.append(f"  statemachine render --store {store} --run {RUNS[0]} "
                 f"--out {shlex.quote(str(folder))}")
    return lines


def run_demo(folder: Path | None) -> int:
    folder = _folder(folder)
    print(f"statemachine demo: SQLite store and Session in {folder}")
    structlog.configure(processors=[_transcript],
                        logger_factory=structlog.PrintLoggerFactory(),
                        cache_logger_on_first_use=False)
    log.switch.turn(logging=True)
    demo = Demo(folder)
    try:
        asyncio.run(demo.play())
    finally:
        log.switch.turn(logging=False)
        structlog.reset_defaults()
        demo.store.close()
    print("\n invariant | checked                                                     | holds")
    print("-----------+-------------------------------------------------------------+------")
    for invariant, what, holds in demo.checks:
        print(f" {invariant:<9} | {what:<59} | {'yes' if holds else 'NO'}")
    failed = [c for c in demo.checks if not c[2]]
    print(f"\n{len(demo.checks) - len(failed)} of {len(demo.checks)} checks hold"
          f"{'' if not failed else ' - FAILED'}")
    for line in _next_steps(folder):
        print(line)
    return 1 if failed else 0
