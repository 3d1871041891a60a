"""Crash-restart: a scripted run (controller + SQLite store + SQLite session + a tool
with a real side effect) is killed with SIGKILL at every event boundary, inside the
tool, and inside each session append; then restarted. For every kill point: the paying
tool's line is written at most once (I1, I11); the run completes, or fails closed with
ToolInDoubt naming ``pay``; no committed event is lost; the Session holds each call and
output at most once, and exactly the reference history when the run completes."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from statemachine.sessions import SQLiteSession
from statemachine.stores import SQLiteEventStore

ROOT = Path(__file__).resolve().parents[2]


def _run(folder: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tests.drivers.crash_driver", str(folder), *flags],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)


def _observe(folder: Path) -> dict[str, Any]:
    log = SQLiteEventStore(folder / "events.db").load("crash")
    session = asyncio.run(SQLiteSession("crash-session", folder / "session.db").get_items())
    pay = folder / "pay.txt"
    return {
        "types": [type(e).__name__ for e in log],
        "session": session,
        "pay_lines": len(pay.read_text().splitlines()) if pay.exists() else 0,
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("reference")
    done = _run(folder)
    assert json.loads(done.stdout) == {"outcome": "completed"}, done.stderr
    return _observe(folder)


def _kill_points(reference_events: int) -> list[tuple[str, ...]]:
    points: list[tuple[str, ...]] = [("--kill-after-event", str(n))
                                     for n in range(reference_events)]
    points.append(("--kill-in-tool",))
    points += [("--kill-in-append", f"{k}:{phase}") for k in (1, 2, 3)
               for phase in ("before", "after")]
    return points


def _kill_and_restart(base: Path, flags: tuple[str, ...]) -> tuple[tuple[str, ...],
                                                                   dict[str, Any]]:
    folder = base / "-".join(f.strip("-").replace(":", "_") for f in flags)
    folder.mkdir()
    killed = _run(folder, *flags)
    before = _observe(folder)
    restarted = _run(folder)
    outcome = json.loads(restarted.stdout) if restarted.stdout else {"error": restarted.stderr}
    return flags, {"killed_rc": killed.returncode, "before": before, "outcome": outcome,
                   "after": _observe(folder), "again": json.loads(_run(folder).stdout)}


@pytest.mark.invariant("I1", "I3", "I11")
def test_every_kill_point_restarts_safely(reference: dict[str, Any], tmp_path: Path) -> None:
    points = _kill_points(len(reference["types"]))
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(pool.map(lambda flags: _kill_and_restart(tmp_path, flags), points))
    summary: Counter[str] = Counter()
    for flags, r in results.items():
        where = " ".join(flags)
        assert r["killed_rc"] == -9, f"{where}: the process was not killed"
        after, before = r["after"], r["before"]
        # I1/I11: the paying tool never ran twice
        assert after["pay_lines"] <= 1, where
        # no committed event lost: what the killed process appended is still the prefix
        assert after["types"][: len(before["types"])] == before["types"], where
        assert before["types"] == reference["types"][: len(before["types"])], where
        # each call and output at most once in the Session
        counts = Counter(json.dumps(item, sort_keys=True) for item in after["session"])
        assert max(counts.values(), default=0) <= 1, where
        outcome = r["outcome"]
        if outcome == {"outcome": "completed"}:
            assert after["session"] == reference["session"], where
            assert after["types"][-1] in ("PublicationCommitted", "ReconciledAcknowledge"), where
            summary.update(t for t in after["types"] if t.startswith("Reconciled"))
        else:
            assert outcome == {"outcome": "in_doubt", "call_id": "pay"}, (where, outcome)
            assert after["types"][-1] == "ToolStarted", where
        assert r["again"] == outcome, f"{where}: a second restart must agree"
        summary[outcome["outcome"]] += 1
    assert summary["in_doubt"] >= 2  # killed between pay's start and its completion
    assert summary["completed"] >= len(points) - 3
    # both reconciliation outcomes were exercised: nothing written, and written-but-unacked
    assert summary["ReconciledAppend"] >= 2
    assert summary["ReconciledAcknowledge"] >= 2
    print(dict(summary))
