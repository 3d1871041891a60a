"""The operator's read models at scale (DESIGN §7.9): `statemachine.operator.runs` and
`inbox` over a SQLite store of 10,000 runs, one in ten awaiting decisions and one in ten
with a call in doubt, each read off the run heads in one query. Target: the inbox in
0.5 s or less. The store is built once (one buffered append per run, in a temporary
directory); each read is timed ``repeats`` times on a fresh store object, median shown,
and checked (every waiting call listed, nothing else).

Usage: ``python -m bench.inbox_rows`` prints the row as JSON.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

RUNS = 10_000
INBOX_S = 0.5


def _build(path: Path, runs: int) -> int:
    """``runs`` runs in a SQLite store at ``path``; returns how many calls wait."""
    from statemachine import RunController, SQLiteEventStore, ToolCall

    store = SQLiteEventStore(path)
    waiting = 0
    for i in range(runs):
        c = RunController.start(run_id=f"run-{i:05d}", session_id=None, store=store,
                                buffered=True)
        c.begin_model_call()
        kind = i % 10
        if kind == 0:  # awaiting two decisions
            c.model_responded([ToolCall("a", "pay", {"n": i}, needs_approval=True),
                               ToolCall("b", "mail", {"n": i}, needs_approval=True)])
            waiting += 2
        elif kind == 1:  # a call started by a worker that died
            c.model_responded([ToolCall("a", "charge", {"n": i})])
            c.begin_tool("a")
            waiting += 1
        else:
            c.model_responded(output="done")
        c.flush()
    store.close()
    return waiting


def bench_row(args: Any = None) -> dict[str, Any]:
    from statemachine import SQLiteEventStore, operator

    runs = RUNS
    repeats = max(3, getattr(args, "repeats", None) or 3)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "events.db"
        began = time.perf_counter()
        expected = _build(path, runs)
        built = time.perf_counter() - began
        timings: dict[str, list[float]] = {"runs": [], "inbox": []}
        for _ in range(repeats):
            store = SQLiteEventStore(path, readonly=True)
            start = time.perf_counter()
            heads = operator.runs(store)
            timings["runs"].append(time.perf_counter() - start)
            start = time.perf_counter()
            found = operator.inbox(store)
            timings["inbox"].append(time.perf_counter() - start)
            store.close()
            if len(heads) != runs or len(found) != expected:
                raise RuntimeError(f"listed {len(heads)} runs and {len(found)} waiting "
                                   f"calls, expected {runs} and {expected}")
    inbox_s = statistics.median(timings["inbox"])
    return {"runs": runs, "waiting": expected, "build_s": round(built, 2),
            "runs_s": round(statistics.median(timings["runs"]), 3),
            "inbox_s": round(inbox_s, 3), "target": f"inbox <= {INBOX_S} s",
            "verdict": "met" if inbox_s <= INBOX_S else "missed"}


if __name__ == "__main__":
    print(json.dumps(bench_row(), indent=2))
