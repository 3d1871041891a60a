"""Worker processes on PostgreSQL (tests/storage/test_postgres_processes.py).

The race: `race_worker` is a long-lived process (forked once; one connection of its own
for the event store and one for the Session) that takes trial after trial from a pipe.
For each it loads the paused run named in the trial (before the barrier, so all hold
the same version), waits at a barrier shared by every worker, resumes the run through
the reference `Runner` (``run`` or ``run_streamed``, per command or buffered), and
answers one dict: ``{"pid", "owner", "outcome": "completed" | "conflict" | "error",
"action", "error", "step"}``. The run is `claim_driver`'s: ``pay`` approved, paused at
INTERRUPTION, or in TOOLS after an attempt that claimed and resumed it died before the
tool's input guardrail ran. Every guardrail, hook, model call and tool appends
``<pid> <what>`` to the trial's effects file (O_APPEND, fsynced) before it returns.

The kills: `run_postgres` is one process's attempt at `durability_driver.run_durable`
on PostgreSQL (the store and the Session in one database; the Session is a
`PostgresSession` when the library has one, else SQLite), with the boundaries ticked as
on SQLite, plus ``flush-commit`` (an append's statements sent, its COMMIT not yet).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import traceback
from collections.abc import Sequence
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

from statemachine import ConcurrencyConflict, RunController, Step
from statemachine import postgres as pg
from statemachine.events import Event
from statemachine.payloads import JSON
from statemachine.postgres import PostgresEventStore
from statemachine.runner import (
    Agent,
    Runner,
)
from statemachine.sessions import Session, SQLiteSession
from statemachine.stores import Snapshot
from tests.drivers import claim_driver
from tests.drivers.crash_driver import Ticks, append_line
from tests.drivers.durability_driver import Checker, TickingSession, run_durable

EFFECTS = "effects.txt"
SESSION_CLASS: Any = getattr(pg, "PostgresSession", None)
"""`PostgresSession` when the library has one (else the Session is a SQLite file)."""


def session_kind() -> str:
    return "postgres" if SESSION_CLASS is not None else "sqlite"


def open_session(dsn: str, schema: str, session_id: str, folder: Path) -> Any:
    """The trial's Session: a `PostgresSession` in the store's schema (so a publication's
    items ride in its commit's transaction), else a SQLite file in ``folder``."""
    if SESSION_CLASS is not None:
        return SESSION_CLASS(dsn, session_id, schema=schema)
    return SQLiteSession(session_id, folder / "session.db")


# ---------------------------------------------------------------------- the race


class FsyncEffects(claim_driver.Effects):
    """`claim_driver.Effects`, each line fsynced before the effect returns."""

    def __call__(self, what: str) -> None:
        if self.path is not None:
            append_line(self.path, f"{os.getpid()} {what}")


def build(effects: Path | None) -> tuple[Agent, claim_driver.Hooks]:
    """`claim_driver.build` with fsynced effects."""
    return claim_driver.build(effects, FsyncEffects)


async def prepare(store: PostgresEventStore, session: Session, run_id: str,
                  variant: str) -> int:
    """Pause the run ``run_id`` as `claim_driver.prepare` does (buffered: a few
    transactions); the version it is paused at."""
    agent, hooks = build(None)
    first = await Runner.run(agent, "pay 7", session=session, store=store, run_id=run_id,
                             hooks=hooks, buffered=True)
    c = first.controller
    c.approve("pay", fingerprint=c.fingerprint("pay"))
    if variant == "tools":
        c.claim("died-before-its-guardrail")
        c.resume()
    elif variant != "interruption":
        raise ValueError(variant)
    await c.flush_async()
    return c.version


async def resume(mode: str, agent: Agent, hooks: claim_driver.Hooks, c: RunController,
                 session: Session, owner: str) -> str:
    if mode == "streamed":
        streamed = Runner.run_streamed(agent, session=session, controller=c, hooks=hooks,
                                       owner=owner)
        async for _ in streamed.stream_events():
            pass
        return streamed.result.step.value
    result = await Runner.run(agent, session=session, controller=c, hooks=hooks, owner=owner)
    return result.step.value


class TimedStore(PostgresEventStore):
    """Notes when its first append of a trial (the attempt's claim) began and ended, on
    the system-wide monotonic clock, so the parent can see that the claims overlapped."""

    first: tuple[float, float] | None = None

    def append(self, run_id: str, events: Sequence[Event], expected_version: int, *,
               snapshot: Snapshot | None = None, step: Step | None = None,
               session_write: Any = None, read_model: Any = None) -> None:
        # (the signature names session_write: a store is asked for the Session's items
        # with a commit event only if its append says it takes them)
        began = time.monotonic()
        options: dict[str, Any] = {"snapshot": snapshot, "step": step,
                                   "read_model": read_model}
        if session_write is not None:
            options["session_write"] = session_write
        try:
            super().append(run_id, events, expected_version, **options)
        finally:
            if self.first is None:
                self.first = (began, time.monotonic())


def race_worker(index: int, dsn: str, schema: str, pipe: Connection, barrier: Barrier) -> None:
    """The body of one racing worker process (see the module's docstring). A trial is
    ``{"run_id", "session_id", "folder", "mode", "buffered"}``; None ends the worker."""
    store = TimedStore(dsn, schema=schema)
    session: Any = None
    loop = asyncio.new_event_loop()
    owner = f"worker-{index}-{os.getpid()}"
    try:
        while (trial := pipe.recv()) is not None:
            folder = Path(trial["folder"])
            answer: dict[str, Any] = {"pid": os.getpid(), "owner": owner}
            try:
                c = RunController.load(store, trial["run_id"], buffered=trial["buffered"])
                if session is None or SESSION_CLASS is None:
                    if session is not None:
                        session.close()
                    session = open_session(dsn, schema, trial["session_id"], folder)
                session.session_id = trial["session_id"]  # one connection, trial after trial
                agent, hooks = build(folder / EFFECTS)
                answer["loaded"] = c.version
            except Exception:
                answer.update(outcome="error", error=traceback.format_exc())
                barrier.abort()
                pipe.send(answer)
                continue
            try:
                barrier.wait(timeout=60)  # every worker holds the same version: go together
            except threading.BrokenBarrierError:
                answer.update(outcome="error", error="the barrier broke")
                pipe.send(answer)
                continue
            answer["go"] = time.monotonic()
            try:
                answer["step"] = loop.run_until_complete(
                    resume(trial["mode"], agent, hooks, c, session, owner))
                answer["outcome"] = "completed"
            except ConcurrencyConflict as error:
                answer.update(outcome="conflict", action=error.action, error=str(error))
            except Exception as error:
                answer.update(outcome="error", action=getattr(error, "action", None),
                              error=f"{type(error).__name__}: {error}")
            answer["ended"] = time.monotonic()
            answer["claim"], store.first = store.first, None
            pipe.send(answer)
    finally:
        store.close()
        if session is not None:
            session.close()
        loop.close()


# ------------------------------------------------------------------------ the kills


class TickingPostgresStore(PostgresEventStore):
    """Ticks around each append, and between its statements and its COMMIT; checks the
    durable log before a Session write that rides in an append."""

    def __init__(self, dsn: str, *, schema: str, ticks: Ticks, checker: Checker) -> None:
        super().__init__(dsn, schema=schema)
        self.ticks = ticks
        self.checker = checker

    def append(self, run_id: str, events: Sequence[Event], expected_version: int, *,
               snapshot: Snapshot | None = None, step: Step | None = None,
               session_write: Any = None, read_model: Any = None) -> None:
        names = "+".join(type(event).__name__ for event in events)
        self.ticks(f"flush-before {names}")
        options: dict[str, Any] = {"snapshot": snapshot, "step": step,
                                   "read_model": read_model}
        if session_write is not None:  # the Session write: its envelope must be durable,
            # or land in this very transaction (DESIGN §7.7)
            self.checker.riding(session_write, events)
            options["session_write"] = session_write
        super().append(run_id, events, expected_version, **options)
        self.ticks(f"flush-after {names}")

    def _before_commit(self) -> None:
        self.ticks("flush-commit")


def ticking_session(dsn: str, schema: str, session_id: str, folder: Path, ticks: Ticks,
                    checker: Checker) -> Any:
    if SESSION_CLASS is None:
        return TickingSession(session_id, folder / "session.db", ticks, checker)

    class TickingPostgresSession(SESSION_CLASS):  # type: ignore[misc]
        async def add_items(self, items: list[JSON], **options: Any) -> None:
            checker.write(items)
            await super().add_items(items, **options)

        def _before_commit(self) -> None:
            ticks("session-before commit")

        def _after_commit(self) -> None:
            ticks("session-after commit")

    return TickingPostgresSession(dsn, session_id, schema=schema)


async def run_postgres(folder: Path, dsn: str, schema: str, run_id: str, session_id: str,
                       ticks: Ticks, *, buffered: bool) -> dict[str, Any]:
    """One process's attempt at the run ``run_id`` on PostgreSQL."""
    reader = PostgresEventStore(dsn, schema=schema, readonly=True)
    checker = Checker(folder, run_id, lambda: reader.load(run_id))
    store = TickingPostgresStore(dsn, schema=schema, ticks=ticks, checker=checker)
    session = ticking_session(dsn, schema, session_id, folder, ticks, checker)
    try:
        return await run_durable(folder, ticks, store, session, checker, run_id=run_id,
                                 buffered=buffered)
    finally:
        store.close()
        reader.close()
        session.close()


def session_items(dsn: str, schema: str, session_id: str, folder: Path) -> list[JSON]:
    session = open_session(dsn, schema, session_id, folder)
    try:
        items: list[JSON] = asyncio.run(session.get_items())
        return items
    finally:
        session.close()

