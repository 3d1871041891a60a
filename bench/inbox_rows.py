"""The operator's read models at scale (DESIGN §7.9): `statemachine.operator.runs` and
`inbox` over a SQLite store of 10,000 runs, one in ten awaiting decisions and one in ten
with a call in doubt, each read off the run heads in one query. Target: the inbox in
0.5 s or less. The store is built once (one buffered append per run, in a temporary
directory on a memory file system where there is one, ``/dev/shm``: the row times
reads, and 10,000 fsynced appends on a disk would be most of the bench's time); each
read is timed ``repeats`` times, 3 at most (once with ``--quick``), on a fresh store
object, median shown, and checked (every waiting call listed, nothing else).

With the console extra, the console's runs page and inbox page over the same store too
(DESIGN §7.5: each under a second), each request served whole in process (read, render,
response body), and how many times the bare read each costs (the floor, measured in the
same run).

Usage: ``python -m bench.inbox_rows`` prints the row as JSON.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

RUNS = 10_000
MEMORY_FS = Path("/dev/shm")
INBOX_S = 0.5
PAGE_S = 1.0


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
    repeats = 1 if getattr(args, "quick", False) else min(3, getattr(args, "repeats", None) or 3)
    memory = str(MEMORY_FS) if MEMORY_FS.is_dir() and os.access(MEMORY_FS, os.W_OK) else None
    with tempfile.TemporaryDirectory(dir=memory) as folder:
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
        pages = _pages(path, repeats, runs, expected)
    inbox_s = statistics.median(timings["inbox"])
    runs_s = statistics.median(timings["runs"])
    row: dict[str, Any] = {"runs": runs, "waiting": expected, "build_s": round(built, 2),
                           "runs_s": round(runs_s, 3), "inbox_s": round(inbox_s, 3)}
    met = inbox_s <= INBOX_S
    target = f"inbox <= {INBOX_S} s"
    if pages is not None:
        runs_page, inbox_page = pages
        row.update({"runs_page_s": round(runs_page, 3), "inbox_page_s": round(inbox_page, 3),
                    "runs_page_over_read": round(runs_page / runs_s, 1),
                    "inbox_page_over_read": round(inbox_page / inbox_s, 1)})
        met = met and max(pages) <= PAGE_S
        target += f"; console pages <= {PAGE_S} s"
    else:
        row["console"] = "skipped: the console extra is not installed"
    return {**row, "target": target, "verdict": "met" if met else "missed"}


def _pages(path: Path, repeats: int, runs: int, waiting: int) -> tuple[float, float] | None:
    """The median seconds of the console's runs page and inbox page, served whole."""
    try:
        from starlette.testclient import TestClient
    except ImportError:
        return None
    from statemachine import SQLiteEventStore
    from statemachine.console import Console, create_app

    timings: dict[str, list[float]] = {"/runs": [], "/inbox": []}
    for _ in range(repeats):
        store = SQLiteEventStore(path, readonly=True)
        client = TestClient(create_app(Console(store, None, None, False, None)))
        for url, times in timings.items():
            start = time.perf_counter()
            answer = client.get(url)
            times.append(time.perf_counter() - start)
            rows = answer.text.count("<tr")
            if answer.status_code != 200 or rows != 1 + (runs if url == "/runs" else waiting):
                raise RuntimeError(f"{url} answered {answer.status_code} with {rows} rows")
        store.close()
    return statistics.median(timings["/runs"]), statistics.median(timings["/inbox"])


if __name__ == "__main__":
    print(json.dumps(bench_row(), indent=2))
