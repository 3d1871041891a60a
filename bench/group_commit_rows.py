"""Group commit (DESIGN §7.7): 64 one-tool turns in flight in one process, through the
reference runner on one `AsyncSQLiteEventStore` (``buffered=True``, each turn's
`SQLiteSession` in the store's own file, so its items ride in the store's appends), with
group commit and with it turned off (``group_commit=False``: one transaction per
append), measured in the same run.

A one-tool turn is `bench.durable_rows`' (the user's input, a model call proposing one
tool, the tool, its result into the history, a model call that answers); every turn is
checked as there. Durable writes are counted by the store and the Sessions themselves
(`SQLiteEventStore.commits`, one per group, plus `SQLiteSession.commits`): each a
transaction, one fsync of the write-ahead log.

Targets: with group commit, the 64 turns take 3 times less wall time or better, and 2 or
fewer commits per run. The median of ``repeats`` rounds (3 unless told; 1 with
``--quick``) is shown. The speed-up is bounded by what a commit's fsync costs on the
machine against the runner's own work per turn, so the row also shows ``commit_ms``:
one one-row WAL transaction with ``synchronous=FULL`` in the same folder (median of
200); where that is a fraction of a millisecond (a disk with a write cache), the
runner's CPU dominates both sides.

`postgres_row`: the same on one `AsyncPostgresEventStore` (each turn's
`AsyncPostgresSession` in the store's schema, so its items ride in the store's appends),
with group commit and with ``group_commit=False``, in the same run. Durable writes are
counted twice: the store's own count of its commits (`AsyncPostgresEventStore.commits`;
the Sessions write nothing apart), and the server's WAL flushes over the turns
(``pg_stat_wal.wal_sync``, the whole server's, read once every connection of the
measurement has ended and so reported its counts); the verdict takes the WAL flushes.
As on SQLite, ``commit_ms`` is what one durable commit costs on that server (a one-row
INSERT, its own transaction; median of 200), which bounds the speed-up. The median of
``repeats`` rounds (3 at most; 1 with ``--quick``) is shown. Skipped without a server
(``--no-pg``, or none to be had: see `bench.backends.postgres`).

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

from bench.durable_rows import _pid, _turn, _wal_syncs

RUNS = 64
SPEEDUP = 3.0
COMMITS_PER_RUN = 2.0


async def _turns(folder: Path, runs: int, group_commit: bool) -> tuple[float, float]:
    """(wall seconds, commits per run) of ``runs`` turns in flight at once."""
    from statemachine.sessions import SQLiteSession
    from statemachine.stores import AsyncSQLiteEventStore

    store = AsyncSQLiteEventStore(folder / "events.db", group_commit=group_commit)
    sessions = [SQLiteSession(f"s-{i}", folder / "events.db") for i in range(runs)]
    if not all(session.shares_transaction_with(store) for session in sessions):
        raise RuntimeError("the Sessions do not share the store's transaction")
    try:
        for session in sessions:  # each Session's worker thread started before the clock
            await session.get_items()
        start = time.perf_counter()
        await asyncio.gather(*[_turn(store, session, f"run-{i}", True)
                               for i, session in enumerate(sessions)])
        wall = time.perf_counter() - start
        commits = store.commits + sum(session.commits for session in sessions)
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


def bench_row(args: Any = None) -> dict[str, Any]:
    runs = RUNS  # (not --runs: the fresh runs of the command rows, 1000 of them)
    repeats = 1 if getattr(args, "quick", False) else max(1, getattr(args, "repeats", None)
                                                          or 3)
    measured: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as folder:
        commit_ms = _commit_ms(Path(folder))
        for round_ in range(repeats):
            for grouped in (True, False):
                place = Path(folder) / f"{round_}-{'grouped' if grouped else 'apart'}"
                place.mkdir()
                measured[grouped].append(asyncio.run(_turns(place, runs, grouped)))
    wall = {g: statistics.median(w for w, _ in measured[g]) for g in measured}
    per_run = {g: statistics.median(c for _, c in measured[g]) for g in measured}
    speedup = wall[False] / wall[True]
    met = speedup >= SPEEDUP and per_run[True] <= COMMITS_PER_RUN
    return {
        "summary": f"{runs} one-tool turns in flight: {wall[True] * 1000:.1f} ms grouped, "
                   f"{wall[False] * 1000:.1f} ms apart ({speedup:.2f}x), "
                   f"{per_run[True]:.2f} commits per run grouped, {per_run[False]:.2f} "
                   f"apart (one commit: {commit_ms:.3f} ms)",
        "target": f">= {SPEEDUP}x faster, <= {COMMITS_PER_RUN} commits per run",
        "verdict": "met" if met else "missed",
        "runs": runs, "repeats": repeats, "commit_ms": round(commit_ms, 3),
        "grouped": {"wall_ms": round(wall[True] * 1000, 1),
                    "commits_per_run": round(per_run[True], 2)},
        "apart": {"wall_ms": round(wall[False] * 1000, 1),
                  "commits_per_run": round(per_run[False], 2)},
        "speedup": {"value": round(speedup, 2), "target": f">= {SPEEDUP}x",
                    "verdict": "met" if speedup >= SPEEDUP else "missed"},
        "commits_per_run": {"value": round(per_run[True], 2),
                            "target": f"<= {COMMITS_PER_RUN}",
                            "verdict": "met" if per_run[True] <= COMMITS_PER_RUN
                            else "missed"},
    }


# ------------------------------------------------------------------- PostgreSQL


async def _pg_turns(dsn: str, schema: str, runs: int, group_commit: bool
                    ) -> tuple[float, float, float]:
    """(wall seconds, the store's commits per run, the server's WAL flushes per run) of
    ``runs`` turns in flight at once."""
    from statemachine.postgres import AsyncPostgresEventStore, AsyncPostgresSession

    store = AsyncPostgresEventStore(dsn, schema=schema, group_commit=group_commit)
    sessions = [AsyncPostgresSession(dsn, f"s-{i}", schema=schema) for i in range(runs)]
    if not all(session.shares_transaction_with(store) for session in sessions):
        raise RuntimeError("the Sessions do not share the store's transaction")
    pids: list[int] = []
    try:
        await store.version("-")  # every connection open, the tables made, before the clock
        for session in sessions:
            await session.get_items()
        pids = [pid for opened in (store, *sessions) for pid in _pid(opened)]
        before = _wal_syncs(dsn, ())
        start = time.perf_counter()
        await asyncio.gather(*[_turn(store, session, f"run-{i}", True)
                               for i, session in enumerate(sessions)])
        wall = time.perf_counter() - start
        commits = store.commits
    finally:
        await store.close()
        for session in sessions:
            await session.close()
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

    wanted = 1 if getattr(args, "quick", False) else 3
    repeats = max(1, min(getattr(args, "repeats", None) or wanted, wanted))
    measured: dict[bool, list[tuple[float, float, float]]] = {True: [], False: []}
    with _server(args) as (dsn, schema, skipped):
        if dsn is None:
            return {"skipped": skipped}
        with schema() as name:
            import psycopg

            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(f'CREATE SCHEMA "{name}"')
            commit_ms = _pg_commit_ms(dsn, name)
        for _ in range(repeats):
            for grouped in (True, False):
                with schema() as name:
                    measured[grouped].append(asyncio.run(_pg_turns(dsn, name, RUNS,
                                                                   grouped)))
    wall = {g: statistics.median(w for w, _, _ in measured[g]) for g in measured}
    commits = {g: statistics.median(c for _, c, _ in measured[g]) for g in measured}
    syncs = {g: statistics.median(s for _, _, s in measured[g]) for g in measured}
    speedup = wall[False] / wall[True]
    met = speedup >= SPEEDUP and syncs[True] <= COMMITS_PER_RUN
    return {
        "summary": f"{RUNS} one-tool turns in flight: {wall[True] * 1000:.1f} ms grouped, "
                   f"{wall[False] * 1000:.1f} ms apart ({speedup:.2f}x), "
                   f"{syncs[True]:.2f} WAL flushes ({commits[True]:.2f} commits) per run "
                   f"grouped, {syncs[False]:.2f} ({commits[False]:.2f}) apart (one commit: "
                   f"{commit_ms:.3f} ms)",
        "target": f">= {SPEEDUP}x faster, <= {COMMITS_PER_RUN} WAL flushes per run",
        "verdict": "met" if met else "missed",
        "runs": RUNS, "repeats": repeats, "commit_ms": round(commit_ms, 3),
        "grouped": {"wall_ms": round(wall[True] * 1000, 1),
                    "commits_per_run": round(commits[True], 2),
                    "wal_flushes_per_run": round(syncs[True], 2)},
        "apart": {"wall_ms": round(wall[False] * 1000, 1),
                  "commits_per_run": round(commits[False], 2),
                  "wal_flushes_per_run": round(syncs[False], 2)},
        "speedup": {"value": round(speedup, 2), "target": f">= {SPEEDUP}x",
                    "verdict": "met" if speedup >= SPEEDUP else "missed"},
        "wal_flushes_per_run": {"value": round(syncs[True], 2),
                                "target": f"<= {COMMITS_PER_RUN}",
                                "verdict": "met" if syncs[True] <= COMMITS_PER_RUN
                                else "missed"},
    }


if __name__ == "__main__":
    print(json.dumps({"sqlite": bench_row(), "postgres": postgres_row()}, indent=2))
