"""A buffered run killed with SIGKILL between its records and their flush
(tests/storage/test_durability.py, and tests/storage/test_postgres_processes.py on
PostgreSQL).

The run ``durable`` goes through the reference `Runner` with a controller that buffers
its events (``buffered=True`` on a `SQLiteEventStore`, or an `AsyncSQLiteEventStore`)
and a SQLite Session: the model proposes ``pay`` (approval-gated, not idempotent, an
input and an output guardrail) and ``lookup`` (idempotent), then answers. When the run
pauses for the approval, the driver approves, flushes, and only then acknowledges the
decision: an fsynced line ``acked:<call>`` in DIR/acks.txt.

Every effect (hook, guardrail, model call, tool) appends an fsynced line to
DIR/effects.txt (`crash_driver.Effects`). The tool, the model and each Session write
first read the *durable* log (another connection to the store, as a restarted process
would) and write a line to DIR/violations.txt unless it holds the record that allows
the effect: ``ToolStarted`` for the call, ``ModelCallBegun`` unanswered, a staged or
reconciled batch of exactly the items written.

The process counts its durable boundaries ("ticks", `crash_driver.Ticks`) and SIGKILLs
itself at the chosen one. Their kinds (the first word of each label): ``record`` (an
event recorded by the controller, in memory until the next flush), ``flush-before`` /
``flush-after`` (the store's append of a batch), ``effect`` (an effect's line written,
inside the hook, guardrail, model call or tool), ``session-before`` /
``session-after`` (a Session batch written, before and after its COMMIT), ``acked``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import traceback
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

from statemachine import (
    ConcurrencyConflict,
    RunController,
    RunNotResumable,
    Step,
    ToolCall,
    ToolInDoubt,
)
from statemachine.events import CallApproved, Event, InputAdded, ToolStarted
from statemachine.journal import is_async as _is_async
from statemachine.machine import replay
from statemachine.payloads import JSON
from statemachine.runner import (
    ALLOW,
    Agent,
    FunctionTool,
    ModelResponse,
    OutputGuardrail,
    Runner,
    ToolGuardrail,
    Verdict,
)
from statemachine.sessions import Session, SQLiteSession
from statemachine.stores import (
    AsyncSQLiteEventStore,
    SessionWrite,
    SQLiteEventStore,
    session_writes,
)
from statemachine.values import Phase
from tests.drivers.crash_driver import EffectHooks, Effects, HistoryModel, Ticks, append_line

RUN_ID = "durable"
SESSION_ID = "durable-session"
INPUT = "pay 7, then look the rate up"
EFFECTS = "effects.txt"
ACKS = "acks.txt"
VIOLATIONS = "violations.txt"
MODES = ("buffered", "async")
"""``buffered``: `SQLiteEventStore` with ``buffered=True``; ``async``:
`AsyncSQLiteEventStore` (a controller bound to it always buffers). The Session is a
`SQLiteSession` of its own file."""
SHARED = "shared"
"""`SQLiteEventStore` with ``buffered=True`` and the Session in the store's own file, so
each publication's staging, items and commit are one append (DESIGN §7.7)."""


class TickingController(RunController):
    """A controller that ticks right after each event is recorded (buffered, so not yet
    in the store: a kill here falls between the record and its flush)."""

    __slots__ = ("ticks",)
    ticks: Ticks

    def _record(self, action: str, event: Event) -> Step:
        dest = super()._record(action, event)
        self.ticks(f"record {type(event).__name__}")
        return dest


class SkipsFlushBeforeTools(TickingController):
    """A broken runner's controller, for the test of the test: the flush before a tool
    runs does nothing (the tool's start is appended with a later batch)."""

    __slots__ = ()

    async def flush_async(self) -> None:
        if self.unflushed and isinstance(self._journal.events[-1], ToolStarted):
            return
        await super().flush_async()


def _names(events: Sequence[Event]) -> str:
    return "+".join(type(event).__name__ for event in events)


class TickingStore(SQLiteEventStore):
    def __init__(self, path: Path, ticks: Ticks, checker: Checker | None = None) -> None:
        super().__init__(path)
        self.ticks = ticks
        self.checker = checker

    def append(self, run_id: str, events: Sequence[Event], expected_version: int, *,
               session_write: SessionWrite | tuple[SessionWrite, ...] | None = None,
               **options: Any) -> None:
        self.ticks(f"flush-before {_names(events)}")
        if session_write is not None:  # the Session's writes, in this append
            if self.checker is not None:
                self.checker.riding(session_write, events)
            options["session_write"] = session_write
        super().append(run_id, events, expected_version, **options)
        self.ticks(f"flush-after {_names(events)}")


class TickingAsyncStore(AsyncSQLiteEventStore):
    def __init__(self, path: Path, ticks: Ticks) -> None:
        super().__init__(path)
        self.ticks = ticks

    async def append(self, run_id: str, events: Sequence[Event], expected_version: int,
                     **options: Any) -> None:
        self.ticks(f"flush-before {_names(events)}")
        await super().append(run_id, events, expected_version, **options)
        self.ticks(f"flush-after {_names(events)}")


class Checker:
    """Reads the durable log (``read``: another connection to the store) before an
    effect, and notes in DIR/violations.txt an effect the log does not allow yet."""

    def __init__(self, folder: Path, run_id: str, read: Callable[[], list[Event]]) -> None:
        self.path = folder / VIOLATIONS
        self.run_id = run_id
        self.read = read

    def _check(self, effect: str, ok: Callable[[Any], bool],
               landing: Sequence[Event] = ()) -> None:
        log = [*self.read(), *landing]
        state = replay(self.run_id, log) if log else None
        if state is None or not ok(state):  # (the effect goes on: the parent reads this)
            last = type(log[-1]).__name__ if log else "nothing"
            append_line(self.path, f"{effect} ran with {len(log)} durable events, the "
                                   f"last {last}")

    def tool(self, call_id: str) -> None:
        self._check(f"tool {call_id}", lambda s: call_id in s.calls
                    and s.calls[call_id].phase is Phase.STARTED)

    def model(self) -> None:
        """A model call needs no durable record first (DESIGN §7.7): a crash before its
        response calls the model again, which no invariant forbids; nothing is checked."""

    def riding(self, session_write: SessionWrite | tuple[SessionWrite, ...],
               events: Sequence[Event]) -> None:
        """`write` for each Session write an append carries with ``events``: its batch is
        staged by the durable log and the events before its own commit event."""
        commits = [i for i, e in enumerate(events)
                   if type(e).__name__ == "PublicationCommitted"]
        writes = session_writes(session_write)
        for write, at in zip(writes, commits[-len(writes):], strict=True):
            self.write(list(write.items), events[:at])

    def write(self, items: list[JSON], landing: Sequence[Event] = ()) -> None:
        """The batch is staged (or reconciled) with exactly ``items``, its attempt open,
        in the durable log, or in the events ``landing`` before its commit in the same
        transaction as the write (a Session written with the store's append)."""
        self._check("session write", lambda s: s.attempt_seq is not None
                    and s.envelope is not None and list(s.envelope.items) == items, landing)


class TickingSession(SQLiteSession):
    """The run's Session: checks the durable log before each write, ticks around the
    write's COMMIT."""

    def __init__(self, session_id: str, path: Path, ticks: Ticks, checker: Checker) -> None:
        super().__init__(session_id, path)
        self.ticks = ticks
        self.checker = checker

    async def add_items(self, items: list[JSON]) -> None:
        self.checker.write(items)
        await super().add_items(items)

    def _before_commit(self) -> None:
        self.ticks("session-before commit")

    def _after_commit(self) -> None:
        self.ticks("session-after commit")


class CheckedModel(HistoryModel):
    def __init__(self, c: RunController, effect: Effects, checker: Checker) -> None:
        super().__init__(c, effect)
        self.checker = checker

    async def respond(self, history: list[JSON], agent: Agent) -> ModelResponse:
        self.checker.model()
        return await super().respond(history, agent)


def agent(c: RunController, effect: Effects, checker: Checker) -> Agent:
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
        checker.tool("pay")
        effect("tool pay")  # inside the tool: a kill here leaves the call in doubt
        return f"charged {amount}"

    def lookup(q: str) -> JSON:
        checker.tool("lookup")
        effect("tool lookup")
        return f"{q} is 1.0"

    return Agent(
        "payer", CheckedModel(c, effect, checker),
        tools=(FunctionTool("pay", pay, needs_approval=True,
                            input_guardrails=(guard("pay_input"),),
                            output_guardrails=(guard("pay_output"),)),
               FunctionTool("lookup", lookup, idempotent=True)),
        output_guardrails=(OutputGuardrail("final_output", final_output),), max_turns=10)


async def run_durable(folder: Path, ticks: Ticks, store: Any, session: Session,
                      checker: Checker, *, run_id: str = RUN_ID, buffered: bool = True,
                      controller: type[TickingController] = TickingController
                      ) -> dict[str, Any]:
    """Start or resume the run in ``store`` through the reference `Runner`, approving
    ``pay`` when asked (flushed before acknowledged), until it completes or fails
    closed. ``store`` is an `EventStore` (``buffered`` as given) or an
    `AsyncEventStore` (always buffered)."""
    asynchronous = _is_async(store)
    log: list[Event] = await store.load(run_id) if asynchronous else store.load(run_id)
    c: RunController
    if not log:
        c = controller.start(run_id=run_id, session_id=session.session_id, max_turns=10,
                             store=store, buffered=buffered)
    elif asynchronous:
        c = await controller.load_async(store, run_id)
    else:
        c = controller.load(store, run_id, buffered=buffered)
    assert isinstance(c, TickingController)
    c.ticks = ticks
    effect = Effects(folder, ticks)
    the_agent, hooks = agent(c, effect, checker), EffectHooks(c, effect)
    new_input = None if any(isinstance(e, InputAdded) for e in log) else INPUT
    try:
        while True:
            # the previous process is dead: no write of its attempt can still land
            result = await Runner.run(the_agent, new_input, session=session, controller=c,
                                      hooks=hooks, take_over=True, owner=str(os.getpid()))
            new_input = None
            if result.step is Step.COMPLETED:
                return {"outcome": "completed", "output": result.final_output}
            if not result.interruptions:
                return {"outcome": result.step.value}
            for call in result.interruptions:
                c.approve(call.call_id, fingerprint=c.fingerprint(call.call_id))
            await c.flush_async()  # the decisions are durable: now acknowledge them
            for call in result.interruptions:
                append_line(folder / ACKS, f"acked:{call.call_id}")
                ticks(f"acked {call.call_id}")
    except ToolInDoubt as error:
        return {"outcome": "in_doubt", "call_id": error.call_id}
    except ConcurrencyConflict as error:  # a dead process's COMMIT landed after our load
        return {"outcome": "conflict", "action": error.action}
    except RunNotResumable:  # a completed run is not resumed: nothing runs again
        if c.step is Step.COMPLETED:
            return {"outcome": "completed", "output": c.final_output}
        return {"outcome": c.step.value}


async def run_sqlite(folder: Path, mode: str, ticks: Ticks, *, broken: bool = False
                     ) -> dict[str, Any]:
    """One process's attempt on the SQLite store in ``folder`` (``mode``: `MODES`;
    ``broken``: with `SkipsFlushBeforeTools`)."""
    path = folder / "events.db"
    checker = Checker(folder, RUN_ID, lambda: log(folder))
    store: Any = (TickingAsyncStore(path, ticks) if mode == "async"
                  else TickingStore(path, ticks, checker))
    session = TickingSession(SESSION_ID, session_file(folder, mode), ticks, checker)
    assert session.shares_transaction_with(store) == (mode == SHARED)
    try:
        return await run_durable(folder, ticks, store, session, checker, controller=(
            SkipsFlushBeforeTools if broken else TickingController))
    finally:
        if mode == "async":
            await store.close()
        else:
            store.close()
        session.close()


# ------------------------------------------------------------- run in a forked process


def run_forked(folder: Path, body: Callable[[Ticks], Coroutine[Any, Any, dict[str, Any]]],
               kill_at: int | None, *, kill_after: float | None = None
               ) -> dict[str, Any] | None:
    """Run ``body`` in a child forked from this process (no interpreter start-up); its
    outcome (with ``ticks``, the boundaries it crossed), or None if it was killed: by
    itself at tick ``kill_at``, or by this process ``kill_after`` seconds after the fork
    (if it is still running then)."""
    outcome = folder / "outcome.json"
    error = folder / "error.txt"
    outcome.unlink(missing_ok=True)
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            ticks = Ticks(folder, kill_at)
            result = asyncio.run(body(ticks))
            outcome.write_text(json.dumps({**result, "ticks": ticks.labels}))
            code = 0
        except BaseException:
            error.write_text(traceback.format_exc())
        finally:
            os._exit(code)
    if kill_after is not None:
        deadline = time.monotonic() + kill_after
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return _ended(status, outcome, error)
            time.sleep(min(0.002, max(0.0, deadline - time.monotonic())))
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    return _ended(status, outcome, error)


def _ended(status: int, outcome: Path, error: Path) -> dict[str, Any] | None:
    if os.WIFSIGNALED(status):
        assert os.WTERMSIG(status) == signal.SIGKILL, status
        return None
    assert os.WEXITSTATUS(status) == 0, error.read_text() if error.exists() else status
    answer: dict[str, Any] = json.loads(outcome.read_text())
    return answer


def fork(folder: Path, mode: str, kill_at: int | None, *, broken: bool = False
         ) -> dict[str, Any] | None:
    """One driver process on the SQLite store in ``folder``."""
    return run_forked(folder, lambda ticks: run_sqlite(folder, mode, ticks, broken=broken),
                      kill_at)


# ------------------------------------------------------------------ what it left


def log(folder: Path, run_id: str = RUN_ID) -> list[Event]:
    """The durable log of ``run_id`` in ``folder``, read on a connection of its own
    (read-only: a look never writes)."""
    reader = SQLiteEventStore(folder / "events.db", readonly=True)
    try:
        return reader.load(run_id)
    finally:
        reader.close()


def session_file(folder: Path, mode: str) -> Path:
    return folder / ("events.db" if mode == SHARED else "session.db")


def session_items(folder: Path, mode: str = "buffered") -> list[Any]:
    session = SQLiteSession(SESSION_ID, session_file(folder, mode))
    try:
        return asyncio.run(session.get_items())
    finally:
        session.close()


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def effects(folder: Path) -> Counter[str]:
    return Counter(_lines(folder / EFFECTS))


def acked(folder: Path) -> set[str]:
    """The calls whose approval the driver acknowledged."""
    return {line.removeprefix("acked:") for line in _lines(folder / ACKS)}


def violations(folder: Path) -> list[str]:
    return _lines(folder / VIOLATIONS)


def approved(events: Sequence[Event]) -> set[str]:
    return {event.call_id for event in events if isinstance(event, CallApproved)}

