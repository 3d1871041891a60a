"""One worker of the fleet (tests/storage/test_fleet.py): resumes the same few runs on one
PostgreSQL database, attempt after attempt, until the parent says stop.

``python -m tests.drivers.fleet_worker DIR DSN SCHEMA WORKER SEED RUN...`` (cwd at the
repository's root). ``WORKER`` names this incarnation (``w3.1``: worker 3, restarted once)
and is the owner of every claim it makes. Each attempt picks one of the runs that is not
known to be finished, and resumes it through the reference `Runner` (``store=``,
``run_id=``, ``owner=WORKER``, ``lease=LEASE``), buffered or per command and on the sync
or the async store, as its seeded random choice says. It prints one JSON line per
attempt: ``{"worker", "attempt", "run", "buffered", "store", "outcome", "typed",
"error"}`` (``outcome`` ``"completed"`` or the class name of the error the attempt ended
with; ``typed``: the error is one of the library's own: a `ControlError`, or the
runner's `MaxTurnsExceeded` or `OutputGuardrailTripwire`). The worker
ends when DIR/stop exists or every run is finished as far as it can tell.

Every model call, hook, guardrail and tool appends one JSON line to DIR/effects.txt
(O_APPEND, fsynced before the effect returns; `crash_driver.append_line`): ``{"effect",
"run", "worker", "attempt", "claim", "newest", "fresh"}``. ``claim`` is the seq of this
attempt's `RunClaimed` (noted by the store when the claim's append succeeded, which is
before any effect); ``newest`` is the seq of the run's newest `RunClaimed`, read from the
store on a connection of its own right before the line is appended; ``fresh`` is
``claim == newest``. The read comes before the line, so a line that says ``fresh: false``
was certainly written after another attempt's claim had committed (no false alarm); an
effect whose read saw its claim newest and whose line landed after a claim that
committed in between was in flight at that moment, which the test allows once per
attempt anyway. Each effect first works for a few random milliseconds, so that a
SIGSTOP or a kill -9 often lands inside one.

The agent: the model proposes ``pay`` (approval-gated, not idempotent: the paying tool;
approved before the fleet starts, see `prepare`), then `LOOKUPS` calls of ``lookup``
(idempotent) one turn each, then answers; ``pay`` and ``lookup`` have an input and an
output guardrail, the agent an output guardrail ``final_check``, and every hook reports.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from statemachine import (
    ControlError,
    LeaseHeld,
    ReconcileRejected,
    Step,
    ToolCall,
    ToolInDoubt,
)
from statemachine import events as ev
from statemachine.events import Event
from statemachine.payloads import JSON
from statemachine.postgres import (
    AsyncPostgresEventStore,
    AsyncPostgresSession,
    PostgresEventStore,
    PostgresSession,
)
from statemachine.runner import (
    Agent,
    FunctionTool,
    MaxTurnsExceeded,
    ModelResponse,
    OutputGuardrail,
    OutputGuardrailTripwire,
    RunHooks,
    Runner,
    ToolGuardrail,
    Verdict,
)
from statemachine.stores import Snapshot
from tests.drivers.crash_driver import append_line

LOOKUPS = 12 if os.environ.get("STATEMACHINE_FLEET") == "long" else 3
"""How many times the model calls ``lookup`` after ``pay``, before it answers (the long
fleet's runs are longer, so more of its kills and stops land mid-run)."""
LEASE = 2.0
"""Seconds: the lease each attempt's claim takes (renewed by each of its flushes)."""
EFFECTS = "effects.txt"
WORK = (0.02, 0.2)
"""How long each effect works before it reports (seconds, uniformly at random)."""


def session_id(run_id: str) -> str:
    return f"{run_id}-session"


class Attempt:
    """What the effects of this process's current attempt tag their lines with."""

    def __init__(self) -> None:
        self.run_id = ""
        self.number = 0
        self.claim: int | None = None


class Effects:
    """Reports effects for the worker ``worker`` (see the module's docstring); without a
    ``reader`` (the parent preparing runs) reports nothing."""

    def __init__(self, folder: Path, worker: str, attempt: Attempt,
                 reader: PostgresEventStore | None, rng: random.Random) -> None:
        self.path = folder / EFFECTS
        self.worker = worker
        self.attempt = attempt
        self.reader = reader
        self.rng = rng

    async def __call__(self, what: str) -> None:
        if self.reader is None:
            return
        await asyncio.sleep(self.rng.uniform(*WORK))  # the effect's own work
        attempt = self.attempt
        try:
            newest: int | None = newest_claim(self.reader.load(attempt.run_id))
        except ControlError:  # the check could not read: the line says so
            newest = None
        append_line(self.path, json.dumps({
            "effect": what, "run": attempt.run_id, "worker": self.worker,
            "attempt": attempt.number, "claim": attempt.claim, "newest": newest,
            "fresh": None if newest is None else newest == attempt.claim}))


def newest_claim(log: Sequence[Event]) -> int | None:
    """The seq of the newest `RunClaimed` in ``log``."""
    for event in reversed(log):
        if isinstance(event, ev.RunClaimed):
            return event.seq
    return None


def _claimed(attempt: Attempt, worker: str, events: Sequence[Event]) -> None:
    for event in events:
        if isinstance(event, ev.RunClaimed) and event.owner == worker:
            attempt.claim = event.seq


class SyncStore(PostgresEventStore):
    """Notes the seq of this worker's claim once its append has committed."""

    attempt: Attempt
    worker: str

    def append(self, run_id: str, events: Sequence[Event], expected_version: int, *,
               snapshot: Snapshot | None = None, step: Step | None = None,
               session_write: Any = None, read_model: Any = None) -> None:
        # (names session_write: a store is handed a Session's items only if it says so)
        super().append(run_id, events, expected_version, snapshot=snapshot, step=step,
                       session_write=session_write, read_model=read_model)
        _claimed(self.attempt, self.worker, events)


class AsyncStore(AsyncPostgresEventStore):
    """`SyncStore` on the async store."""

    attempt: Attempt
    worker: str

    async def append(self, run_id: str, events: Sequence[Event], expected_version: int, *,
                     snapshot: Snapshot | None = None, step: Step | None = None,
                     session_write: Any = None, read_model: Any = None) -> None:
        await super().append(run_id, events, expected_version, snapshot=snapshot, step=step,
                             session_write=session_write, read_model=read_model)
        _claimed(self.attempt, self.worker, events)


# ------------------------------------------------------------------------- the agent


class Model:
    def __init__(self, effect: Effects) -> None:
        self.effect = effect

    async def respond(self, history: list[JSON], agent: Agent) -> ModelResponse:
        await self.effect("model")
        done = sum(type(item) is dict and item.get("type") == "function_call_output"
                   for item in history)
        if done == 0:
            return ModelResponse(tool_calls=(("pay", "pay", {"amount": 7}),))
        if done <= LOOKUPS:
            return ModelResponse(tool_calls=((f"lookup-{done}", "lookup", {"q": "receipt"}),))
        return ModelResponse(output="paid 7")


class Hooks(RunHooks):
    def __init__(self, effect: Effects) -> None:
        self.effect = effect

    async def on_agent_start(self, agent: Agent) -> None:
        await self.effect("hook agent_start")

    async def on_agent_end(self, agent: Agent, output: JSON) -> None:
        await self.effect("hook agent_end")

    async def on_llm_start(self, agent: Agent) -> None:
        await self.effect("hook model_start")

    async def on_llm_end(self, agent: Agent, response: ModelResponse) -> None:
        await self.effect("hook model_end")

    async def on_tool_start(self, agent: Agent, call: ToolCall) -> None:
        await self.effect(f"hook tool_start:{call.call_id}")

    async def on_tool_end(self, agent: Agent, call: ToolCall, output: JSON) -> None:
        await self.effect(f"hook tool_end:{call.call_id}")


def build(effect: Effects) -> tuple[Agent, Hooks]:
    def guard(name: str) -> Any:
        async def check(*args: Any) -> Verdict:
            await effect(f"guardrail {name}")
            return Verdict()

        return check

    async def pay(amount: int) -> str:
        await effect("tool pay")
        return f"paid {amount}"

    async def lookup(q: str) -> str:
        await effect("tool lookup")
        return f"found {q}"

    def tool(name: str, function: Any, **options: Any) -> FunctionTool:
        return FunctionTool(name, function, **options, input_guardrails=(
            ToolGuardrail(f"{name}_input", guard(f"{name}_input")),), output_guardrails=(
            ToolGuardrail(f"{name}_output", guard(f"{name}_output")),))

    agent = Agent("payer", Model(effect),
                  (tool("pay", pay, needs_approval=True), tool("lookup", lookup,
                                                                 idempotent=True)),
                  output_guardrails=(OutputGuardrail("final_check", guard("final_check")),),
                  max_turns=LOOKUPS + 2)  # pay, each lookup, the answer
    return agent, Hooks(effect)


async def prepare(dsn: str, schema: str, run_id: str) -> int:
    """Start the run ``run_id`` (no effects reported) and leave it paused at INTERRUPTION
    with ``pay`` approved; the version it is paused at."""
    effect = Effects(Path(), "prepare", Attempt(), None, random.Random(0))
    agent, hooks = build(effect)
    with PostgresEventStore(dsn, schema=schema) as store, PostgresSession(
            dsn, session_id(run_id), schema=schema) as session:
        first = await Runner.run(agent, "pay 7", session=session, store=store,
                                 run_id=run_id, hooks=hooks)
        c = first.controller
        c.approve("pay", fingerprint=c.fingerprint("pay"))
        await c.flush_async()
        return c.version


# ------------------------------------------------------------------------ the worker


FINISHED = (Step.COMPLETED, Step.TERMINAL_UNRECOVERABLE)


async def serve(folder: Path, dsn: str, schema: str, worker: str, seed: int,
                runs: list[str]) -> None:
    rng = random.Random(f"{seed}:{worker}")
    attempt = Attempt()
    reader = PostgresEventStore(dsn, schema=schema, readonly=True)
    sync_store = SyncStore(dsn, schema=schema)
    async_store = AsyncStore(dsn, schema=schema)
    for client in (sync_store, async_store):
        client.attempt, client.worker = attempt, worker
    sessions: dict[tuple[str, str], Any] = {}
    agent, hooks = build(Effects(folder, worker, attempt, reader, rng))
    finished: set[str] = set()  # completed, or a call in doubt: no worker can go on
    try:
        while not (folder / "stop").exists() and len(finished) < len(runs):
            try:
                heads = {head.run_id: head.step for head in reader.list_runs()}
            except ControlError as error:  # the database may refuse a while: try again
                sys.stdout.write(json.dumps({"worker": worker, "attempt": None,
                                             "outcome": type(error).__name__,
                                             "typed": True, "error": str(error)}) + "\n")
                await asyncio.sleep(0.2)
                continue
            finished |= {run for run in runs if heads.get(run) in FINISHED}
            open_runs = [run for run in runs if run not in finished]
            if not open_runs:
                break
            attempt.run_id, attempt.claim = rng.choice(open_runs), None
            attempt.number += 1
            kind = rng.choice(("sync", "async"))
            buffered = rng.random() < 0.6  # where a missing fence shows most
            store: Any = sync_store if kind == "sync" else async_store
            key = (kind, attempt.run_id)
            if key not in sessions:
                session_class = PostgresSession if kind == "sync" else AsyncPostgresSession
                sessions[key] = session_class(dsn, session_id(attempt.run_id),
                                              schema=schema)
            report: dict[str, Any] = {"worker": worker, "attempt": attempt.number,
                                      "run": attempt.run_id, "buffered": buffered,
                                      "store": kind}
            pause = 0.0
            try:
                result = await Runner.run(agent, session=sessions[key], store=store,
                                          run_id=attempt.run_id, hooks=hooks, owner=worker,
                                          lease=LEASE, buffered=buffered)
                report.update(outcome="completed", step=result.step.value, typed=True)
            except (ControlError, MaxTurnsExceeded, OutputGuardrailTripwire) as error:
                # the library's own errors (a refusal, or the runner ending a run)
                report.update(outcome=type(error).__name__, typed=True, error=str(error))
                if isinstance(error, ToolInDoubt):
                    finished.add(attempt.run_id)  # stays in doubt: no operator here
                if isinstance(error, LeaseHeld) and error.until is not None:
                    pause = min(max(error.until / 1e6 - time.time(), 0.0), 0.5)
                elif isinstance(error, ReconcileRejected):
                    pause = 0.3  # an unsettled run another attempt may still be writing
                else:
                    pause = 0.05
            except Exception as error:  # a finding: the test fails on it
                report.update(outcome=type(error).__name__, typed=False,
                              error=traceback.format_exc())
                pause = 0.2
            report["claim"] = attempt.claim
            sys.stdout.write(json.dumps(report) + "\n")
            sys.stdout.flush()
            await asyncio.sleep(pause + rng.uniform(0, 0.05))
    finally:
        for (kind, _), session in sessions.items():
            await session.close() if kind == "async" else session.close()
        await async_store.close()
        sync_store.close()
        reader.close()


def main(argv: list[str]) -> None:
    folder, dsn, schema, worker, seed, *runs = argv
    asyncio.run(serve(Path(folder), dsn, schema, worker, int(seed), runs))


if __name__ == "__main__":
    main(sys.argv[1:])
