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
fewer commits per run. The median of ``repeats`` rounds (3 unless told) is shown. The
speed-up is bounded by what a commit's fsync costs on the machine against the runner's
own work per turn, so the row also shows ``commit_ms``: one one-row WAL transaction with
``synchronous=FULL`` in the same folder (median of 200); where that is a fraction of a
millisecond (a disk with a write cache), the runner's CPU dominates both sides.

Usage: ``python -m bench.group_commit_rows`` prints the row as JSON.
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

from bench.durable_rows import _turn

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
    runs = getattr(args, "runs", None) or RUNS
    repeats = max(1, getattr(args, "repeats", None) or 3)
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


if __name__ == "__main__":
    print(json.dumps(bench_row(), indent=2))
