"""Group commit in the async PostgreSQL store (DESIGN §7.7): the appends of concurrent
runs waiting together are written by one writer task in one transaction, one COMMIT (one
WAL flush), each in a savepoint of its own; one run's refusal (a version conflict,
`LeaseHeld`) rolls back to its savepoint and fails only that run's append, Session items
included; a group of one is today's lone append (one statement, no savepoint); a COMMIT
whose answer was lost is decided per append by reading its batch back; an append
cancelled before its group is taken is never written; a process killed with SIGKILL
while groups commit leaves each run exactly a prefix of what it meant to append, with
every acknowledged append in it.

The deterministic tests hold the store's lock (``_hold``) while the appends queue, so
that all of them are one group: the store's ``commits`` then moves by exactly one.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg
import pytest

from statemachine import ConcurrencyConflict, ReconcileRejected, RunController, codec
from statemachine import events as ev
from statemachine.errors import StorageError
from statemachine.postgres import AsyncPostgresEventStore, AsyncPostgresSession, PostgresEventStore
from statemachine.stores import SessionWrite
from statemachine.testing.invariants import check_log
from tests.drivers.crash_driver import Ticks, append_line
from tests.drivers.durability_driver import run_forked
from tests.storage.test_group_commit import (
    FLUSHES,
    RUNS,
    TOOLS,
    _drive,
    _lines,
    _outcomes,
    _paused,
    _pg,
)
from tests.storage.test_group_commit import _hold_pg as _hold
from tests.storage.test_postgres import _admin, _Proxy

pytestmark = pytest.mark.postgres


@pytest.fixture
def proxy(pg_dsn: str) -> Iterator[_Proxy]:
    opened = _Proxy(pg_dsn)
    yield opened
    opened.close()


def _xact_commits(dsn: str) -> int:
    """The database's committed transactions so far (every backend that ended has
    reported its own)."""
    with _admin(dsn) as admin:
        row = admin.execute("SELECT xact_commit FROM pg_stat_database "
                            "WHERE datname = current_database()").fetchone()
    assert row is not None
    return int(row[0])


def _gone(dsn: str, pid: int) -> None:
    """Wait until the server process ``pid`` has ended (and so reported its counts)."""
    deadline = time.monotonic() + 30
    with _admin(dsn) as admin:
        while admin.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s",
                            (pid,)).fetchone():
            assert time.monotonic() < deadline
            time.sleep(0.01)


# ------------------------------------------------------------ (a) fewer commits


def test_64_concurrent_runs_land_in_far_fewer_commits_than_appends(pg_dsn: str,
                                                                    pg_schema: str) -> None:
    async def go(group_commit: bool) -> tuple[int, int]:
        store = _pg(pg_dsn, pg_schema, group_commit=group_commit)
        await store.version("warm-up")  # the tables exist, the connection is open
        prefix = "g" if group_commit else "a"
        pid = store._conn.info.backend_pid
        before = _xact_commits(pg_dsn)
        controllers = await asyncio.gather(*[_drive(store, f"{prefix}-{i}")
                                             for i in range(RUNS)])
        commits = store.commits
        await store.close()
        _gone(pg_dsn, pid)
        counted = _xact_commits(pg_dsn) - before
        async with _pg(pg_dsn, pg_schema) as reader:
            for c in controllers:  # every log is exactly what its controller recorded
                log = await reader.load(c.run_id)
                assert log == list(c.events)
                check_log(log)
                assert c.version == 2 + 2 * TOOLS + 2
        return commits, counted

    grouped, grouped_counted = asyncio.run(go(True))
    apart, apart_counted = asyncio.run(go(False))
    appends = RUNS * FLUSHES
    print(f"\n{RUNS} runs, {appends} appends: {grouped} commits grouped "
          f"({grouped / RUNS:.2f} per run; the server counted {grouped_counted}), "
          f"{apart} apart (the server counted {apart_counted})")
    assert apart == appends  # one transaction per append without grouping
    assert apart_counted >= appends
    assert grouped <= 2 * RUNS  # at most 2 commits per run of 5 flushes
    assert grouped < appends / 4
    # the server saw as few (give or take the opening and the watching connections' own)
    assert grouped <= grouped_counted <= grouped + 20


def test_without_group_commit_each_append_is_its_own_transaction(pg_dsn: str,
                                                                 pg_schema: str) -> None:
    async def go() -> None:
        store = _pg(pg_dsn, pg_schema, group_commit=False)
        controllers = await _paused(store, [f"run-{i}" for i in range(8)])
        before = store.commits
        async with _hold(store):
            flushes = [asyncio.ensure_future(c.flush_async()) for c in controllers]
        assert await _outcomes(flushes) == [None] * 8
        assert store.commits == before + 8
        await store.close()

    asyncio.run(go())


# ----------------------------------------------- (b), (c) one run's refusal is its own


def test_two_stores_groups_over_the_same_runs_never_deadlock(pg_dsn: str,
                                                            pg_schema: str) -> None:
    """Two stores' groups claim the same eight runs, queued in opposite orders: each
    group takes the runs' heads in the order of their ids, so the second waits for the
    first and then finds every run moved (a conflict per run), instead of the two
    waiting for each other until the server breaks the cycle (a deadlock error)."""
    async def go() -> None:
        first, second = _pg(pg_dsn, pg_schema), _pg(pg_dsn, pg_schema)
        run_ids = [f"run-{i}" for i in range(8)]
        await _paused(first, run_ids)
        claims: dict[str, list[RunController]] = {}
        for name, store in (("first", first), ("second", second)):
            for run_id in run_ids:
                c = await RunController.load_async(store, run_id)
                c.claim(name)
                claims.setdefault(name, []).append(c)
        async with first._lock, second._lock:
            flushes = [asyncio.ensure_future(c.flush_async()) for c in claims["first"]]
            flushes += [asyncio.ensure_future(c.flush_async())
                        for c in reversed(claims["second"])]
            await asyncio.sleep(0.05)
        outcomes = await _outcomes(flushes)
        ours, theirs = outcomes[:8], outcomes[8:][::-1]
        for run_id, one, other in zip(run_ids, ours, theirs, strict=True):
            assert sorted(type(o).__name__ for o in (one, other)) == [
                "ConcurrencyConflict", "NoneType"], (run_id, one, other)
        heads = {h.run_id: h.owner for h in await first.list_runs()}
        assert len(set(heads.values())) == 1  # one group went first and took them all
        await first.close()
        await second.close()

    asyncio.run(go())


def test_a_server_error_or_a_refused_text_in_one_group_fails_only_that_append(
        pg_dsn: str, pg_schema: str) -> None:
    """run-2's head is locked by another session past the store's ``lock_timeout`` (the
    server refuses the statement: the transaction is in error until the savepoint is
    rolled back), and one append's run id holds a NUL (psycopg refuses it before
    sending): both fail "not_written", alone; the others land."""
    async def go() -> None:
        store = _pg(pg_dsn, pg_schema, lock_timeout=0.3)
        run_ids = [f"run-{i}" for i in range(5)]
        controllers = await _paused(store, run_ids)
        before = store.commits
        with _admin(pg_dsn) as other:
            other.execute("BEGIN")
            other.execute(f'SELECT 1 FROM "{pg_schema}".runs WHERE run_id = %s FOR UPDATE',
                          ("run-2",))
            async with _hold(store):
                flushes = [asyncio.ensure_future(c.flush_async()) for c in controllers]
                nul = asyncio.ensure_future(store.append("bad\x00id", [], 0))
            outcomes = await _outcomes([*flushes, nul])
            other.execute("ROLLBACK")
        assert store.commits == before + 1
        *landed, refused = outcomes
        assert isinstance(refused, StorageError)
        assert refused.outcome == "not_written"
        for run_id, c, outcome in zip(run_ids, controllers, landed, strict=True):
            if run_id == "run-2":
                assert isinstance(outcome, StorageError)
                assert outcome.outcome == "not_written"
                assert "lock" in outcome.reason
                assert await store.version(run_id) == 2
                await c.flush_async()  # nothing was written: the run goes on
            assert await store.load(run_id) == list(c.events)
        await store.close()

    asyncio.run(go())


def test_session_items_ride_in_their_appends_savepoint(pg_dsn: str, pg_schema: str) -> None:
    """Each append's Session items are written in its own savepoint: a refused append's
    items are rolled back with it, the others' land with their events."""
    async def go() -> None:
        store = _pg(pg_dsn, pg_schema)
        run_ids = [f"run-{i}" for i in range(4)]
        controllers = await _paused(store, run_ids)
        rival = await RunController.load_async(store, "run-2")
        rival.claim("rival")
        await rival.flush_async()
        sessions = [AsyncPostgresSession(pg_dsn, f"s-{r}", schema=pg_schema)
                    for r in run_ids]
        assert all(s.shares_transaction_with(store) for s in sessions)
        before = store.commits
        async with _hold(store):
            appends = []
            for c, session in zip(controllers, sessions, strict=True):
                pending = list(c.events)[c.version - c.unflushed:]
                write = SessionWrite(session.session_id, f"{c.run_id}:{pending[0].seq}",
                                     ({"role": "user", "n": c.run_id},))
                appends.append(asyncio.ensure_future(store.append(
                    c.run_id, pending, pending[0].seq, session_write=write)))
        outcomes = await _outcomes(appends)
        assert store.commits == before + 1
        for c, session, outcome in zip(controllers, sessions, outcomes, strict=True):
            items = await session.get_items()
            if c.run_id == "run-2":
                assert isinstance(outcome, ConcurrencyConflict)
                assert items == []
            else:
                assert outcome is None
                assert items == [{"role": "user", "n": c.run_id}]
                assert len(await store.load(c.run_id)) == c.version
            await session.close()
        await store.close()

    asyncio.run(go())


@pytest.mark.parametrize("pattern", ["LRRL", "RLLR", "RRRR", "LLLL", "RLRLR", "LRLRL"])
def test_refusals_anywhere_in_a_group_undo_their_own_append_alone(
        pg_dsn: str, pg_schema: str, pattern: str) -> None:
    """A group's appends each run in a savepoint inside the one before (none released),
    and a refused one is rolled back to its own. Every append writes to ONE Session,
    checked against the items of the landing appends before it (``L`` in ``pattern``,
    in run id order: the group's order); a refused one (``R``) is refused by a version
    conflict (a rival flushed its run) or, every other one, by a tail it was not staged
    against. If a refusal undid an earlier append, or left its own items behind, the
    next landing append's tail would not match and it would be refused too: the outcome
    of each, every run's log and the Session's items come from ``pattern`` alone."""
    async def go() -> None:
        store = _pg(pg_dsn, pg_schema)
        run_ids = [f"run-{i}" for i in range(len(pattern))]
        controllers = await _paused(store, run_ids)
        logged = {c.run_id: list(c.events)[:c.version - c.unflushed] for c in controllers}
        for i, c in enumerate(controllers):
            if pattern[i] == "R" and i % 2 == 0:
                rival = await RunController.load_async(store, c.run_id)
                rival.claim("rival")
                await rival.flush_async()
                logged[c.run_id] = list(rival.events)
        session = AsyncPostgresSession(pg_dsn, "shared", schema=pg_schema)
        items = [{"role": "user", "n": i} for i in range(len(pattern))]
        landing = [item for item, how in zip(items, pattern, strict=True) if how == "L"]
        before = store.commits
        async with _hold(store):
            appends = []
            for i, c in enumerate(controllers):
                after = tuple(landing[:pattern[:i].count("L")])
                if pattern[i] == "R" and i % 2:
                    after = ({"role": "user", "n": "never written"},)
                pending = list(c.events)[c.version - c.unflushed:]
                write = SessionWrite("shared", f"{c.run_id}:{pending[0].seq}", (items[i],),
                                     after=after, whole=True)
                appends.append(asyncio.ensure_future(store.append(
                    c.run_id, pending, pending[0].seq, session_write=write)))
        outcomes = await _outcomes(appends)
        assert store.commits == before + (1 if "L" in pattern else 0)
        for i, (c, outcome) in enumerate(zip(controllers, outcomes, strict=True)):
            if pattern[i] == "L":
                assert outcome is None
                logged[c.run_id] = list(c.events)
            elif i % 2 == 0:
                assert isinstance(outcome, ConcurrencyConflict)
            else:
                assert isinstance(outcome, ReconcileRejected)
            assert await store.load(c.run_id) == logged[c.run_id]
        assert await session.get_items() == landing
        await session.close()
        await store.close()

    asyncio.run(go())


# --------------------------------------------------- (e) a group of one is a lone append


def test_a_group_of_one_sends_what_a_lone_append_sends(pg_dsn: str, pg_schema: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Events alone: the one statement, no BEGIN, no SAVEPOINT; with a snapshot: BEGIN,
    the statements, COMMIT; the same with group commit on as off."""
    sent: list[str] = []
    execute = psycopg.AsyncConnection.execute

    async def spy(self: psycopg.AsyncConnection[Any], query: Any, *args: Any,
                  **kwargs: Any) -> Any:
        sent.append(str(query).split(" ", 1)[0] if len(str(query)) > 40 else str(query))
        return await execute(self, query, *args, **kwargs)

    async def statements(group_commit: bool, run_id: str) -> list[list[str]]:
        store = _pg(pg_dsn, pg_schema, group_commit=group_commit)
        c = RunController.start(run_id=run_id, session_id=None)
        c.begin_model_call()
        events = list(c.events)
        later = [ev.HookRan(len(events), "agent_start", None)]
        await store.version(run_id)  # connected
        shapes = []
        for append in (store.append(run_id, events, 0),
                       store.append(run_id, later, len(events), snapshot=c.state.snapshot())):
            sent.clear()
            await append
            shapes.append(list(sent))
        commits = store.commits
        await store.close()
        assert commits == 2
        return shapes

    monkeypatch.setattr(psycopg.AsyncConnection, "execute", spy)
    grouped = asyncio.run(statements(True, "grouped"))
    apart = asyncio.run(statements(False, "apart"))
    assert grouped == apart
    alone, with_snapshot = grouped
    assert alone == ["WITH"]  # one statement, its own transaction
    assert with_snapshot[0] == "BEGIN"
    assert with_snapshot[-1] == "COMMIT"
    assert not any("SAVEPOINT" in statement for statement in alone + with_snapshot)


# ------------------------------------------------------------ (f) cancelled before taken


def test_an_append_cancelled_before_its_group_is_taken_is_never_written(
        pg_dsn: str, pg_schema: str) -> None:
    async def go() -> None:
        store = _pg(pg_dsn, pg_schema)
        first, second, third = await _paused(store, ["a", "b", "c"])
        async with _hold(store):
            cancelled = asyncio.ensure_future(first.flush_async())
            kept = asyncio.ensure_future(second.flush_async())
            also = asyncio.ensure_future(third.flush_async())
            await asyncio.sleep(0.01)
            cancelled.cancel()
        outcomes = await _outcomes([cancelled, kept, also])
        assert isinstance(outcomes[0], asyncio.CancelledError)
        assert outcomes[1:] == [None, None]
        assert await store.version("a") == 2
        assert await store.load("b") == list(second.events)
        assert await store.load("c") == list(third.events)
        await store.close()

    asyncio.run(go())


# ------------------------------------------------------------ a COMMIT that was lost


@pytest.mark.parametrize("mode", ["drop_reply", "drop_request"])
def test_a_groups_lost_commit_is_decided_per_append_by_its_batch(
        proxy: _Proxy, pg_dsn: str, pg_schema: str, mode: str) -> None:
    """The group's COMMIT travels through a proxy that loses its answer (the server
    committed) or the request itself (it did not): each append of the group is decided
    by reading its own batch back, as a lone append's lost COMMIT is."""
    class Armed(AsyncPostgresEventStore):
        arm: str | None = None

        async def _before_commit(self) -> None:
            if self.arm is not None:
                self._conn.prepare_threshold = None  # (see test_postgres._Armed)
                proxy.mode, self.arm = self.arm, None

    async def go() -> None:
        store = Armed(proxy.dsn, schema=pg_schema, readback_timeout=5.0)
        run_ids = [f"run-{i}" for i in range(5)]
        controllers = await _paused(store, run_ids)
        stale = await RunController.load_async(store, "run-0")
        rival = await RunController.load_async(store, "run-0")
        rival.claim("rival")
        await rival.flush_async()
        stale.claim("stale")
        before = [list(await store.load(r)) for r in run_ids]
        commits = store.commits
        store.arm = mode
        async with _hold(store):
            flushes = [asyncio.ensure_future(c.flush_async()) for c in controllers[1:]]
            flushes.append(asyncio.ensure_future(stale.flush_async()))
        *outcomes, refused = await _outcomes(flushes)
        assert proxy.mode is None  # the message was lost for real
        assert isinstance(refused, ConcurrencyConflict)  # refused inside: never decided
        lands = mode == "drop_reply"
        async with _pg(pg_dsn, pg_schema) as direct:
            for run_id, c, outcome, was in zip(run_ids[1:], controllers[1:], outcomes,
                                               before[1:], strict=True):
                if lands:
                    assert outcome is None  # read back: appended
                    assert await direct.load(run_id) == list(c.events)
                else:
                    assert isinstance(outcome, StorageError)
                    assert outcome.outcome == "not_written"
                    assert outcome.run_id == run_id
                    assert await direct.load(run_id) == was
        assert store.commits == commits + lands  # one group, counted if it landed
        await store.close()

    asyncio.run(go())


# ------------------------------------------------------------------ (d) kill -9

KILL_RUNS = 32
KILL_TOOLS = 6
TRIALS = 8
APP = "group-commit-kill"
"""The application name of the killed child's connections (so the parent can wait until
the server has ended them)."""


def _encoded(events: Any) -> list[Any]:
    return [codec.encode_event(event) for event in events]


class _Noted(AsyncPostgresEventStore):
    """Notes each append's events (an fsynced line) before it is made."""

    pending: Path

    async def append(self, run_id: str, events: Sequence[ev.Event], expected_version: int,
                     **options: Any) -> None:
        append_line(self.pending, json.dumps({"run": run_id, "from": expected_version,
                                              "events": _encoded(events)}))
        await super().append(run_id, events, expected_version, **options)


async def _child(dsn: str, schema: str, trial: int, folder: Path) -> dict[str, Any]:
    """32 runs at once through one async PostgreSQL store. Before each flush the events
    it carries are noted (an fsynced line: pending), after it returned its version (an
    fsynced line: acknowledged); each tool's run is noted after its start was flushed."""
    os.environ["PGAPPNAME"] = APP
    store = _Noted(dsn, schema=schema)
    store.pending = folder / "pending.txt"
    acks, tools = folder / "acks.txt", folder / "tools.txt"
    await asyncio.gather(*[
        _drive(store, f"t{trial}-{i}", KILL_TOOLS,
               acked=lambda run_id, version: append_line(acks, f"{run_id} {version}"),
               ran=lambda call_id: append_line(tools, call_id), pause=0.004)
        for i in range(KILL_RUNS)])
    commits = store.commits
    await store.close()
    return {"commits": commits}


def _wait_for_the_childs_connections(dsn: str) -> None:
    deadline = time.monotonic() + 30
    with _admin(dsn) as admin:
        while admin.execute("SELECT 1 FROM pg_stat_activity WHERE application_name = %s",
                            (APP,)).fetchone():
            assert time.monotonic() < deadline
            time.sleep(0.01)


@pytest.fixture
def tables(pg_dsn: str, pg_schema: str) -> None:
    with PostgresEventStore(pg_dsn, schema=pg_schema) as store:
        store.run_ids(limit=1)  # the tables exist before any child starts


@pytest.mark.usefixtures("tables")
def test_a_kill_while_groups_commit_leaves_each_run_a_prefix_of_what_it_meant(
        pg_dsn: str, pg_schema: str, tmp_path: Path) -> None:
    random.seed(11)
    killed = 0
    acknowledged = 0
    latest = 0.6  # the latest kill: earlier each time a child finished first (a fast day)
    reader = PostgresEventStore(pg_dsn, schema=pg_schema)
    trial = -1
    while trial + 1 < TRIALS or (killed < TRIALS // 2 and trial + 1 < 4 * TRIALS):
        trial += 1
        folder = tmp_path / f"trial-{trial}"
        folder.mkdir()

        async def body(ticks: Ticks, trial: int = trial, folder: Path = folder
                       ) -> dict[str, Any]:
            return await _child(pg_dsn, pg_schema, trial, folder)

        outcome = run_forked(folder, body, None, kill_after=random.uniform(0.05, latest))
        killed += outcome is None
        if outcome is not None:
            latest = max(0.1, latest * 0.7)
        _wait_for_the_childs_connections(pg_dsn)
        meant: dict[str, list[Any]] = {}
        bounds: dict[str, set[int]] = {}
        for line in _lines(folder / "pending.txt"):
            note = json.loads(line)
            run = meant.setdefault(note["run"], [])
            assert note["from"] == len(run)  # the child meant one log per run
            run.extend(note["events"])
            bounds.setdefault(note["run"], {0}).add(len(run))
        logs = {run_id: reader.load(run_id) for run_id in reader.run_ids()
                if run_id.startswith(f"t{trial}-")}
        assert set(logs) <= set(meant)
        for run_id, log in logs.items():
            check_log(log)  # a valid log: seq 0.., one start, no tool started twice
            assert _encoded(log) == meant[run_id][:len(log)], run_id  # a prefix of it
            assert len(log) in bounds[run_id], run_id  # of whole appends: none half
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
    reader.close()
    print(f"\n{trial + 1} trials, {killed} killed mid-run, {acknowledged} appends "
          "acknowledged, all found")
    assert killed >= TRIALS // 2

