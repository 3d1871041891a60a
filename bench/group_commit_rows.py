"""Group commit (DESIGN §7.7, §7.9): 64 one-tool turns in flight in one process, through
the reference runner on one `AsyncSQLiteEventStore`, three ways in the same run:

* ``grouped`` (today's default): events flushed only where an effect needs it
  (``buffered=True``), each turn's `SQLiteSession` in the store's own file (its items
  ride in the store's appends), and group commit on;
* ``apart``: the same with group commit off (``group_commit=False``: one transaction
  per append), the context: what group commit alone adds to the new flush rules;
* ``before``: the store as it was when the issue asking for group commit was filed,
  as near as this code can run it: no group commit, and each turn's `SQLiteSession` in
  a file of its own (``session.db``, one for all turns), written in transactions of
  its own. That store paid 13 commits per run (issue 28: "with 64 turns in flight in
  one process, every run still pays its 13 fsyncs"): its runs flushed before every
  model call too, which no flush rule does any more, and an async store cannot append
  per event (a controller bound to one always buffers). So ``before`` pays 8 commits
  per run where the issue's store paid 13: a baseline faster than the one the issue
  measured, never a slower one.

The verdict compares ``grouped`` with ``before``: DESIGN §7.9 asks for ">= 3x faster than
today's store", and "today" is the store the issue measured. The ratio of ``grouped``
to ``apart`` is reported beside it: the new flush rules and the shared Session already
cut an ungrouped run to two commits, so much of the gain over the old store is theirs,
not group commit's.

A one-tool turn is `bench.durable_rows`' (the user's input, a model call proposing one
tool, the tool, its result into the history, a model call that answers); every turn is
checked as there. Durable writes are counted by the store and the Sessions themselves
(`SQLiteEventStore.commits`, one per group, plus `SQLiteSession.commits`): each a
transaction, one fsync of the write-ahead log.

Targets: with group commit, the 64 turns take 3 times less wall time than ``before``
or better, and 2 or fewer commits per run. The median of ``repeats`` rounds (3 at most;
1 with ``--quick``) is shown. The speed-up is bounded by what a commit's fsync
costs on the machine against the runner's own work per turn, so the row also shows
``commit_ms``: one one-row WAL transaction with ``synchronous=FULL`` in the same folder
(median of 200); where that is a fraction of a millisecond (a disk with a write cache),
the runner's CPU dominates every configuration and no way of committing can be 3x
faster than another.

`postgres_row`: the same three on one `AsyncPostgresEventStore` (``before``: per event,
each turn's `AsyncPostgresSession` written apart from the store's transaction, as a
Session of another database would be, no group commit; the other two with the Sessions
in the store's schema, their items riding in its appends). Durable writes are counted
twice: the store's own count of its commits (`AsyncPostgresEventStore.commits`; a
Session written apart commits on its own connection, which only the server's count
sees), and the server's WAL flushes over the turns (``pg_stat_wal.wal_sync``, the whole
server's, read once every connection of the measurement has ended and so reported its
counts); the verdict takes the WAL flushes. As on SQLite, ``commit_ms`` is what one
durable commit costs on that server (a one-row INSERT, its own transaction; median of
200), which bounds the speed-up. The median of ``repeats`` rounds (3 at most; 1 with
``--quick``) is shown. Skipped without a server (``--no-pg``, or none to be had: see
`bench.backends.postgres`).

Usage: ``python -m bench.group_commit_rows`` prints both rows as JSON.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.durable_rows import RUNNER, _pid, _wal_syncs

RUNS = 64
SPEEDUP = 3.0
COMMITS_PER_RUN = 2.0
ROUNDS = 3
HOWS = ("grouped", "apart", "before")
"""The three configurations of a round (see the module's docstring), in the order run."""
BASELINE = "before"
"""The configuration the verdict's speed-up is measured against."""
BEFORE = "the store before group commit (none, and each turn's Session written apart)"


async def _turns(folder: Path, runs: int, how: str) -> tuple[float, float]:
    """(wall seconds, commits per run) of ``runs`` turns in flight at once, ``how``."""
    from statemachine.sessions import SQLiteSession
    from statemachine.stores import AsyncSQLiteEventStore

    store = AsyncSQLiteEventStore(folder / "events.db", group_commit=how == "grouped")
    shared = how != "before"
    where = folder / ("events.db" if shared else "session.db")
    sessions = [SQLiteSession(f"s-{i}", where) for i in range(runs)]
    if any(session.shares_transaction_with(store) != shared for session in sessions):
        raise RuntimeError(f"{how}: the Sessions do not share the store's transaction "
                           "as they should")
    try:
        for session in sessions:  # each Session's worker thread started before the clock
            await session.get_items()
        made = [RUNNER.make() for _ in sessions]  # (each system builds its agents so)
        start = time.perf_counter()
        checks = await asyncio.gather(*[RUNNER.run(store, session, f"run-{i}", True, made[i])
                                        for i, session in enumerate(sessions)])
        wall = time.perf_counter() - start
        commits = store.commits + sum(session.commits for session in sessions)
        for check in checks:
            await check()
    finally:
        await store.close()
        for session in sessions:
            session.close()
    return wall, commits / runs


def _commit_ms(folder: Path) -> float:
    """What one durable commit costs here: a one-row WAL transaction, synchronous=FULL."""
    conn = sqlite3.connect(folder / "fsync.db", isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("CREATE TABLE t (x INTEGER)")
        times = []
        for i in range(200):
            start = time.perf_counter()
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("INSERT INTO t VALUES (?)", (i,))
            conn.execute("COMMIT")
            times.append(time.perf_counter() - start)
    finally:
        conn.close()
    return statistics.median(times) * 1000


def _judged(runs: int, repeats: int, commit_ms: float, wall: dict[str, float],
            writes: dict[str, float], unit: str, extra: str = "",
            counts: dict[str, dict[str, float]] | None = None) -> dict[str, Any]:
    """The row: ``wall`` seconds and ``writes`` per run of each configuration (`HOWS`),
    judged by the speed-up over `BASELINE` and the grouped writes per run (``unit``:
    what a write is). ``counts``: more figures per configuration, shown as they are."""
    speedup = round(wall[BASELINE] / wall["grouped"], 2)  # (judged as shown)
    context = wall["apart"] / wall["grouped"]
    met = speedup >= SPEEDUP and writes["grouped"] <= COMMITS_PER_RUN
    return {
        "summary": f"{runs} one-tool turns in flight: {wall['grouped'] * 1000:.1f} ms "
                   f"grouped, {wall[BASELINE] * 1000:.1f} ms on the store before group "
                   f"commit ({speedup:.2f}x; Sessions apart, {writes[BASELINE]:.2f} {unit} "
                   f"per run), {wall['apart'] * 1000:.1f} ms "
                   f"with the new flush rules but no group commit ({context:.2f}x); "
                   f"{writes['grouped']:.2f} {unit} per run grouped, {writes['apart']:.2f} "
                   f"apart{extra} (one commit: {commit_ms:.3f} ms)",
        "target": f">= {SPEEDUP}x faster than {BEFORE}, <= {COMMITS_PER_RUN} {unit} per run",
        "verdict": "met" if met else "missed",
        "baseline": BASELINE,
        "runs": runs, "repeats": repeats, "commit_ms": round(commit_ms, 3),
        **{how: {"wall_ms": round(wall[how] * 1000, 1),
                 f"{unit.lower().replace(' ', '_')}_per_run": round(writes[how], 2),
                 **{k: round(v, 2) for k, v in (counts or {}).get(how, {}).items()}}
           for how in HOWS},
        "speedup": {"value": round(speedup, 2), "over": BASELINE,
                    "target": f">= {SPEEDUP}x",
                    "verdict": "met" if speedup >= SPEEDUP else "missed"},
        "grouped_over_apart": round(context, 2),
        f"{unit.lower().replace(' ', '_')}_per_run": {
            "value": round(writes["grouped"], 2), "target": f"<= {COMMITS_PER_RUN}",
            "verdict": "met" if writes["grouped"] <= COMMITS_PER_RUN else "missed"},
    }


def _rounds(args: Any) -> int:
    """Rounds of the three configurations: ``--repeats``, 3 at most (the command rows'
    seven would add half a minute for a median that moves little), 1 with ``--quick``."""
    wanted = 1 if getattr(args, "quick", False) else ROUNDS
    return max(1, min(getattr(args, "repeats", None) or wanted, wanted))


def bench_row(args: Any = None) -> dict[str, Any]:
    runs = RUNS  # (not --runs: the fresh runs of the command rows, 1000 of them)
    repeats = _rounds(args)
    measured: dict[str, list[tuple[float, float]]] = {how: [] for how in HOWS}
    with tempfile.TemporaryDirectory() as folder:
        commit_ms = _commit_ms(Path(folder))
        for round_ in range(repeats):
            for how in HOWS:
                place = Path(folder) / f"{round_}-{how}"
                place.mkdir()
                measured[how].append(asyncio.run(_turns(place, runs, how)))
    wall = {how: statistics.median(w for w, _ in found) for how, found in measured.items()}
    per_run = {how: statistics.median(c for _, c in found) for how, found in measured.items()}
    return _judged(runs, repeats, commit_ms, wall, per_run, "commits")


# ------------------------------------------------------------------- PostgreSQL


async def _pg_turns(dsn: str, schema: str, runs: int, how: str
                    ) -> tuple[float, float, float]:
    """(wall seconds, the store's commits per run, the server's WAL flushes per run) of
    ``runs`` turns in flight at once, ``how``."""
    from bench.durable_rows import _Apart
    from statemachine.postgres import AsyncPostgresEventStore, AsyncPostgresSession

    store = AsyncPostgresEventStore(dsn, schema=schema, group_commit=how == "grouped")
    sessions: list[Any] = [AsyncPostgresSession(dsn, f"s-{i}", schema=schema)
                           for i in range(runs)]
    if how == "before":  # written apart from the store's transaction
        sessions = [_Apart(session) for session in sessions]
    shared = how != "before"
    if any(bool(getattr(session, "shares_transaction_with", lambda _: False)(store))
           != shared for session in sessions):
        raise RuntimeError(f"{how}: the Sessions do not share the store's transaction "
                           "as they should")
    pids: list[int] = []
    try:
        await store.version("-")  # every connection open, the tables made, before the clock
        # every Session's connection open before the clock (side by side: 64 in turn
        # took longer than the turns)
        await asyncio.gather(*(session.get_items() for session in sessions))
        pids = [pid for opened in (store, *sessions) for pid in _pid(opened)]
        before = _wal_syncs(dsn, ())
        made = [RUNNER.make() for _ in sessions]  # (each system builds its agents so)
        start = time.perf_counter()
        checks = await asyncio.gather(*[RUNNER.run(store, session, f"run-{i}", True, made[i])
                                        for i, session in enumerate(sessions)])
        wall = time.perf_counter() - start
        commits = store.commits
        for check in checks:
            await check()
    finally:
        await store.close()
        await asyncio.gather(*(session.close() for session in sessions))
    syncs = _wal_syncs(dsn, pids) - before
    return wall, commits / runs, syncs / runs


def _pg_commit_ms(dsn: str, schema: str) -> float:
    """What one durable commit costs on the server: a one-row INSERT, autocommit."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'CREATE TABLE "{schema}".fsync (x integer)')
        times = []
        for i in range(200):
            start = time.perf_counter()
            conn.execute(f'INSERT INTO "{schema}".fsync VALUES (%s)', (i,))
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def postgres_row(args: Any = None) -> dict[str, Any]:
    from bench.durable_rows import _server

    repeats = _rounds(args)
    measured: dict[str, list[tuple[float, float, float]]] = {how: [] for how in HOWS}
    with _server(args) as (dsn, schema, skipped):
        if dsn is None:
            return {"skipped": skipped}
        with schema() as name:
            import psycopg

            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(f'CREATE SCHEMA "{name}"')
            commit_ms = _pg_commit_ms(dsn, name)
        for _ in range(repeats):
            for how in HOWS:
                with schema() as name:
                    measured[how].append(asyncio.run(_pg_turns(dsn, name, RUNS, how)))
    wall = {how: statistics.median(w for w, _, _ in found) for how, found in measured.items()}
    commits = {how: statistics.median(c for _, c, _ in found)
               for how, found in measured.items()}
    syncs = {how: statistics.median(s for _, _, s in found) for how, found in measured.items()}
    return _judged(RUNS, repeats, commit_ms, wall, syncs, "WAL flushes",
                   f" (the store's own commits: {commits['grouped']:.2f} grouped, "
                   f"{commits['apart']:.2f} apart, {commits[BASELINE]:.2f} before)",
                   {how: {"store_commits_per_run": commits[how]} for how in HOWS})


if __name__ == "__main__":
    print(json.dumps({"sqlite": bench_row(), "postgres": postgres_row()}, indent=2))
