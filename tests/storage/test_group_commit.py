"""Group commit in the async stores (DESIGN §7.7): the appends of concurrent runs waiting
together are folded into one transaction, one COMMIT (one fsync); one run's refusal (a
version conflict, `LeaseHeld`) fails only that run's append; two appends of one run in a
group behave as if serialized; a COMMIT that fails is decided per append by reading its
batch back; a process killed with SIGKILL while groups commit loses nothing it was told
had landed, and writes nothing twice. (The async PostgreSQL store's group commit:
``test_postgres_group_commit.py``.)

The deterministic tests hold the store's worker (``_hold``) while the appends queue, so
that all of them are one group: the store's ``commits`` then moves by exactly one.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import sqlite3
import threading
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from statemachine import ConcurrencyConflict, LeaseHeld, RunController, ToolCall
from statemachine import events as ev
from statemachine.errors import StorageError
from statemachine.postgres import AsyncPostgresEventStore
from statemachine.stores import AsyncSQLiteEventStore, SQLiteEventStore
from statemachine.testing.invariants import check_log
from tests.drivers.crash_driver import Ticks, append_line
from tests.drivers.durability_driver import run_forked

RUNS = 64
TOOLS = 3
FLUSHES = TOOLS + 2
"""Each run's flushes (`_drive`): its start with the model call, each tool's start, and
its final output with the last result."""


async def _drive(store: Any, run_id: str, tools: int = TOOLS,
                 acked: Callable[[str, int], None] | None = None,
                 ran: Callable[[str], None] | None = None, pause: float = 0.0) -> RunController:
    """One run through ``store``: a model call proposing ``tools`` calls, each started
    (flushed before it runs, as a runner does), run and completed, then the final output.
    ``acked`` hears each flush's version once it returned; ``ran`` each tool run."""
    async def flush(c: RunController) -> None:
        await c.flush_async()
        if acked is not None:
            acked(run_id, c.version)
        if pause:
            await asyncio.sleep(random.random() * pause)

    c = RunController.start(run_id=run_id, session_id=None, store=store)
    c.begin_model_call()
    await flush(c)
    calls = [ToolCall(f"{run_id}/t{i}", "echo", {"i": i}) for i in range(tools)]
    c.model_responded(calls)
    for call in calls:
        c.begin_tool(call.call_id)
        await flush(c)  # the start is durable before the tool runs
        if ran is not None:
            ran(call.call_id)
        c.tool_completed(call.call_id, f"ran {call.call_id}")
    c.accept_final_output(f"done {run_id}")
    await flush(c)
    return c


@contextlib.asynccontextmanager
async def _hold(store: AsyncSQLiteEventStore) -> AsyncIterator[None]:
    """Keep the store's worker busy in the body, so every append made there waits, and
    the waiting ones are taken as one group when it is let go."""
    gate = threading.Event()
    held = asyncio.ensure_future(store._call(gate.wait))
    await asyncio.sleep(0.01)
    try:
        yield
        await asyncio.sleep(0.05)  # every append of the body is queued by now
    finally:
        gate.set()
        await held


async def _outcomes(calls: Sequence[Awaitable[Any]]) -> list[Any]:
    return list(await asyncio.gather(*calls, return_exceptions=True))


async def _paused(store: Any, run_ids: Sequence[str]) -> list[RunController]:
    """Runs started and flushed, each with a tool proposed (nothing of it flushed yet:
    the next flush appends the proposal and the tool's start)."""
    controllers = []
    for run_id in run_ids:
        c = RunController.start(run_id=run_id, session_id=None, store=store)
        c.begin_model_call()
        await c.flush_async()
        c.model_responded([ToolCall(f"{run_id}/t", "echo", {})])
        c.begin_tool(f"{run_id}/t")
        controllers.append(c)
    return controllers


def _sqlite(tmp_path: Path, **options: Any) -> AsyncSQLiteEventStore:
    return AsyncSQLiteEventStore(tmp_path / "events.db", **options)


def _pg(pg_dsn: str, pg_schema: str, **options: Any) -> AsyncPostgresEventStore:
    return AsyncPostgresEventStore(pg_dsn, schema=pg_schema, **options)


@contextlib.asynccontextmanager
async def _hold_pg(store: AsyncPostgresEventStore) -> AsyncIterator[None]:
    """Hold the PostgreSQL store's lock in the body, so every append made there waits,
    and the waiting ones are taken as one group when it is let go."""
    async with store._lock:
        yield
        await asyncio.sleep(0.05)  # every append of the body is queued by now


class Grouped:
    """An async store that group-commits, and how to hold it while appends queue."""

    def __init__(self, open_store: Callable[[], Any],
                 hold: Callable[[Any], contextlib.AbstractAsyncContextManager[None]]) -> None:
        self.open = open_store
        self.hold = hold


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def grouped(request: pytest.FixtureRequest, tmp_path: Path) -> Grouped:
    """The tests both stores must pass: the async SQLite store, the async PostgreSQL
    store (its own tests: ``test_postgres_group_commit.py``)."""
    if request.param == "sqlite":
        return Grouped(lambda: _sqlite(tmp_path), _hold)
    dsn, schema = request.getfixturevalue("pg_dsn"), request.getfixturevalue("pg_schema")
    return Grouped(lambda: _pg(dsn, schema), _hold_pg)


# ------------------------------------------------------------ (a) fewer commits


def test_64_concurrent_runs_land_in_far_fewer_commits_than_appends(tmp_path: Path) -> None:
    async def go(group_commit: bool) -> tuple[int, list[RunController], AsyncSQLiteEventStore]:
        store = _sqlite(tmp_path / str(group_commit), group_commit=group_commit)
        controllers = await asyncio.gather(*[_drive(store, f"run-{i}") for i in range(RUNS)])
        commits = store.commits
        for c in controllers:  # every log is exactly what its controller recorded
            log = await store.load(c.run_id)
            assert log == list(c.events)
            check_log(log)
        await store.close()
        return commits, controllers, store

    (tmp_path / "True").mkdir()
    (tmp_path / "False").mkdir()
    grouped, controllers, _ = asyncio.run(go(True))
    apart, _, _ = asyncio.run(go(False))
    appends = RUNS * FLUSHES
    print(f"\n{RUNS} runs, {appends} appends: {grouped} commits grouped "
          f"({grouped / RUNS:.2f} per run), {apart} apart")
    assert apart == appends  # one transaction per append without grouping
    assert grouped <= 2 * RUNS  # at most 2 commits per run of 5 flushes
    assert grouped < appends / 4
    assert all(c.version == 2 + 2 * TOOLS + 2 for c in controllers)


def test_two_appends_of_one_run_in_one_group_behave_as_if_serialized(grouped: Grouped) -> None:
    # the second sees the first's rows; a refused first leaves the second checked against
    # what is really there
    async def go() -> None:
        store = grouped.open()
        recorded = RunController.start(run_id="r", session_id=None)  # in memory
        recorded.begin_model_call()
        recorded.model_responded([ToolCall("t1", "echo", {}), ToolCall("t2", "echo", {})])
        recorded.begin_tool("t1")
        recorded.tool_completed("t1", "one")
        events = list(recorded.events)
        assert len(events) == 5
        before = store.commits
        async with grouped.hold(store):
            calls = [store.append("r", events[:2], 0), store.append("r", events[2:], 2)]
            first, second = [asyncio.ensure_future(c) for c in calls]
        assert await _outcomes([first, second]) == [None, None]
        assert store.commits == before + 1
        assert await store.load("r") == events
        # a stale append first (expects 2, the log is at 5), then the right one
        recorded.begin_tool("t2")
        more = list(recorded.events)[5:]
        before = store.commits
        async with grouped.hold(store):
            stale = asyncio.ensure_future(store.append("r", events[2:], 2))
            right = asyncio.ensure_future(store.append("r", more, 5))
            again = asyncio.ensure_future(store.append("r", more, 5))  # now behind
        stale_error, landed, behind = await _outcomes([stale, right, again])
        assert isinstance(stale_error, ConcurrencyConflict)
        assert landed is None
        assert isinstance(behind, ConcurrencyConflict)
        assert store.commits == before + 1
        assert await store.load("r") == list(recorded.events)
        check_log(await store.load("r"))
        await store.close()

    asyncio.run(go())


# ----------------------------------------------- (b), (c) one run's refusal is its own


def test_a_version_conflict_in_one_group_fails_only_that_runs_append(grouped: Grouped) -> None:
    async def go() -> None:
        store = grouped.open()
        run_ids = [f"run-{i}" for i in range(8)]
        controllers = await _paused(store, run_ids)
        # another controller moves run-3's log: run-3's controller is now behind
        rival = await RunController.load_async(store, "run-3")
        rival.claim("rival")
        await rival.flush_async()
        moved = list(await store.load("run-3"))
        before = store.commits
        async with grouped.hold(store):
            flushes = [asyncio.ensure_future(c.flush_async()) for c in controllers]
        outcomes = await _outcomes(flushes)
        assert store.commits == before + 1  # one group
        for run_id, c, outcome in zip(run_ids, controllers, outcomes, strict=True):
            if run_id == "run-3":
                assert isinstance(outcome, ConcurrencyConflict)
                assert type(outcome) is ConcurrencyConflict
                assert outcome.run_id == "run-3"
                assert await store.load(run_id) == moved  # nothing of it landed
            else:
                assert outcome is None
                assert await store.load(run_id) == list(c.events)
        await store.close()

    asyncio.run(go())


def test_a_lease_refusal_in_one_group_fails_only_that_runs_append(grouped: Grouped) -> None:
    async def go() -> None:
        store = grouped.open()
        run_ids = [f"run-{i}" for i in range(8)]
        controllers = await _paused(store, run_ids)
        holder = await RunController.load_async(store, "run-5")
        holder.claim("worker-a", lease=30)
        await holder.flush_async()
        held = list(await store.load("run-5"))
        claims = []
        for run_id in run_ids:  # every run claimed by worker-b, in one group
            c = await RunController.load_async(store, run_id)
            c.claim("worker-b", lease=30)
            claims.append(c)
        before = store.commits
        async with grouped.hold(store):
            flushes = [asyncio.ensure_future(c.flush_async()) for c in claims]
        outcomes = await _outcomes(flushes)
        assert store.commits == before + 1
        for run_id, c, outcome in zip(run_ids, claims, outcomes, strict=True):
            if run_id == "run-5":
                assert isinstance(outcome, LeaseHeld)
                assert (outcome.owner, outcome.run_id) == ("worker-a", "run-5")
                assert await store.load(run_id) == held
            else:
                assert outcome is None
                assert await store.load(run_id) == list(c.events)
        heads = {h.run_id: h.lease_owner for h in await store.list_runs()}
        assert heads == {r: "worker-a" if r == "run-5" else "worker-b" for r in run_ids}
        del controllers
        await store.close()

    asyncio.run(go())


# ------------------------------------------------------------ a COMMIT that fails


class _FailingCommit:
    """The store's connection, with a COMMIT that fails: after landing (the answer was
    lost) or rolled back (nothing landed)."""

    def __init__(self, conn: sqlite3.Connection, *, lands: bool) -> None:
        self._conn = conn
        self.lands = lands

    def execute(self, sql: str, *args: Any) -> Any:
        if sql == "COMMIT":
            self._conn.execute("COMMIT" if self.lands else "ROLLBACK")
            raise sqlite3.OperationalError("disk I/O error")
        return self._conn.execute(sql, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


@pytest.mark.parametrize("lands", [True, False])
def test_a_groups_failed_commit_is_decided_per_append_by_its_batch(tmp_path: Path,
                                                                     lands: bool) -> None:
    async def go() -> None:
        store = _sqlite(tmp_path)
        run_ids = [f"run-{i}" for i in range(6)]
        controllers = await _paused(store, run_ids)
        stale = await RunController.load_async(store, "run-0")
        rival = await RunController.load_async(store, "run-0")
        rival.claim("rival")
        await rival.flush_async()
        stale.claim("stale")
        store.sync._conn = _FailingCommit(store.sync._live(), lands=lands)
        before = [list(await store.load(r)) for r in run_ids]
        commits = store.commits
        async with _hold(store):
            flushes = [asyncio.ensure_future(c.flush_async()) for c in controllers[1:]]
            flushes.append(asyncio.ensure_future(stale.flush_async()))
        *outcomes, refused = await _outcomes(flushes)
        assert isinstance(refused, ConcurrencyConflict)  # refused inside: never decided
        for run_id, c, outcome, was in zip(run_ids[1:], controllers[1:], outcomes,
                                           before[1:], strict=True):
            if lands:
                assert outcome is None  # read back: appended
                assert await store.load(run_id) == list(c.events)
            else:
                assert isinstance(outcome, StorageError)
                assert outcome.outcome == "not_written"
                assert outcome.run_id == run_id
                assert await store.load(run_id) == was
        assert store.commits == commits + lands  # one group, counted if it landed
        await store.close()

    asyncio.run(go())


def test_without_group_commit_each_append_is_its_own_transaction(tmp_path: Path) -> None:
    async def go() -> None:
        store = _sqlite(tmp_path, group_commit=False)
        controllers = await _paused(store, [f"run-{i}" for i in range(8)])
        before = store.commits
        async with _hold(store):
            flushes = [asyncio.ensure_future(c.flush_async()) for c in controllers]
        assert await _outcomes(flushes) == [None] * 8
        assert store.commits == before + 8
        await store.close()

    asyncio.run(go())


def test_an_append_cancelled_before_its_group_is_taken_is_never_written(
        tmp_path: Path) -> None:
    async def go() -> None:
        store = _sqlite(tmp_path)
        first, second = await _paused(store, ["a", "b"])
        async with _hold(store):
            cancelled = asyncio.ensure_future(first.flush_async())
            kept = asyncio.ensure_future(second.flush_async())
            await asyncio.sleep(0.01)
            cancelled.cancel()
        outcomes = await _outcomes([cancelled, kept])
        assert isinstance(outcomes[0], asyncio.CancelledError)
        assert outcomes[1] is None
        assert await store.version("a") == 2
        assert await store.load("b") == list(second.events)
        await store.close()

    asyncio.run(go())


# ------------------------------------------------------------------ (d) kill -9

KILL_RUNS = 32
KILL_TOOLS = 6
TRIALS = 8


async def _child(folder: Path) -> dict[str, Any]:
    """32 runs at once through one async SQLite store; each append acknowledged (an
    fsynced line) once it returned, each tool's run noted (an fsynced line) after its
    start was flushed."""
    store = AsyncSQLiteEventStore(folder / "events.db")
    acks, tools = folder / "acks.txt", folder / "tools.txt"
    await asyncio.gather(*[
        _drive(store, f"run-{i}", KILL_TOOLS,
               acked=lambda run_id, version: append_line(acks, f"{run_id} {version}"),
               ran=lambda call_id: append_line(tools, call_id), pause=0.004)
        for i in range(KILL_RUNS)])
    commits = store.commits
    await store.close()
    return {"commits": commits}


async def _in_child(folder: Path, ticks: Ticks) -> dict[str, Any]:
    return await _child(folder)


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_a_kill_while_groups_commit_loses_no_acknowledged_append_and_repeats_nothing(
        tmp_path: Path) -> None:
    random.seed(7)
    killed = trials = 0
    acknowledged = 0
    for trial in range(4 * TRIALS):
        if trials >= TRIALS and killed >= TRIALS // 2:
            break
        trials += 1
        folder = tmp_path / f"trial-{trial}"
        folder.mkdir()
        outcome = run_forked(folder, functools.partial(_in_child, folder), None,
                             kill_after=random.uniform(0.02, 0.4))
        try:
            reader = SQLiteEventStore(folder / "events.db", readonly=True)
        except StorageError:  # killed before its store was made (a loaded machine):
            # nothing was acknowledged, no tool ran, and it is no kill mid-run
            assert outcome is None
            assert not _lines(folder / "acks.txt")
            assert not _lines(folder / "tools.txt")
            continue
        killed += outcome is None
        logs = {run_id: reader.load(run_id) for run_id in reader.run_ids()}
        reader.close()
        seen: set[tuple[str, int]] = set()
        for run_id, log in logs.items():
            check_log(log)  # a valid log: seq 0.., one start, no tool started twice
            assert isinstance(log[0], ev.RunStarted)
            assert log[0].run_id == run_id
            for event in log:
                call_id = getattr(event, "call_id", None)
                if call_id is not None:  # no run holds an event of another
                    assert call_id.startswith(f"{run_id}/"), (run_id, event)
                assert (run_id, event.seq) not in seen
                seen.add((run_id, event.seq))
        acks = _lines(folder / "acks.txt")
        acknowledged += len(acks)
        for line in acks:  # every acknowledged append is in its log
            run_id, version = line.split()
            assert len(logs.get(run_id, [])) >= int(version), line
        ran = Counter(_lines(folder / "tools.txt"))
        assert all(n == 1 for n in ran.values()), ran  # no tool ran twice
        for call_id in ran:  # and each ran only after its start was durable
            run_id = call_id.split("/")[0]
            assert any(type(e) is ev.ToolStarted and e.call_id == call_id
                       for e in logs[run_id]), call_id
        if outcome is not None:  # ran to the end: every run whole
            assert len(logs) == KILL_RUNS
            assert all(len(log) == 2 + 2 * KILL_TOOLS + 2 for log in logs.values())
            assert outcome["commits"] < KILL_RUNS * (KILL_TOOLS + 2)
    print(f"\n{trials} trials, {killed} killed mid-run, {acknowledged} appends "
          "acknowledged, all found")
    assert killed >= TRIALS // 2
