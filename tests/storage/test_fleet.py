"""The fleet (DESIGN §7.2): worker processes on one PostgreSQL database resume the same
runs through the reference `Runner` with leases, while this process kills them (-9) and
stops them (SIGSTOP, then SIGCONT) at random.

Each worker is ``python -m tests.drivers.fleet_worker`` (see its docstring): attempt after
attempt it resumes one of the runs with ``owner=`` its own name and a 2 s lease, buffered
or per command, on the sync or the async store. Every model call, hook, guardrail and tool
appends an fsynced line saying which attempt ran it and whether that attempt's claim was
still the run's newest, read from the store right before the line. A stop longer than
the lease lets another worker claim the run: the stopped attempt's claim is superseded,
and when it wakes, the effect it was in the middle of reports (at most one such effect
per superseded attempt: the runner fences before every effect, so the next one is refused
with `ConcurrencyConflict`). A kill during the paying tool leaves its run in doubt: counted,
not a failure.

The chaos goes on for a bounded time (or until every run is finished: completed, or in
doubt and unchanged for a while), then the workers get a short calm to finish what they
can, then are told to stop. End states are counted, not checked: a run can be in doubt,
left unsettled by a write its superseded attempt never finished (until the runner takes
over on an expired lease by itself), or mid-way when the budget ran out.

What must hold: the paying tool ran at most once per run, and exactly once per run that
completed; no effect reported after its attempt's claim was superseded, except at most one
per superseded attempt; every error a worker ended an attempt with is one of the
library's typed errors and no worker wrote to stderr; every run's log passes
`check_log`. An effect counts as after supersession when its own check (a read of the
run's newest claim, on another connection, before its line) saw a newer claim than its
attempt's: a claim that committed before the read, so before the line (never a false
alarm); one that committed between the read and the line is missed, but then the effect
was in flight at that moment, the one effect allowed anyway. Per command, an attempt's
next record would be refused after one effect even without the fences; buffered, it
would run on until its next flush, which is what the fences prevent (with them commented
out of the runner this test fails).

CI form: 4 workers, 4 runs, 22 s of chaos at most (seed ``STATEMACHINE_FLEET_SEED``,
default 24). ``STATEMACHINE_FLEET=long`` (``just fuzz``): 8 workers, 24 longer runs, 240 s.
Run with ``-s`` for the figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import IO, Any

import attrs
import pytest

from statemachine import RunController, Step
from statemachine.postgres import PostgresEventStore
from statemachine.testing import check_log
from tests.drivers import fleet_worker

pytestmark = pytest.mark.postgres

ROOT = Path(__file__).resolve().parents[2]
LONG = os.environ.get("STATEMACHINE_FLEET") == "long"
SEED = int(os.environ.get("STATEMACHINE_FLEET_SEED", "24"))


@attrs.frozen
class Budget:
    workers: int
    runs: int
    seconds: float
    """How long the chaos may go on (it ends sooner once every run is finished)."""
    calm: float
    """How long the workers may then go on without it, to finish what they can."""
    kills: int
    stops: int


BUDGET = (Budget(workers=8, runs=24, seconds=240.0, calm=30.0, kills=100, stops=150) if LONG
          else Budget(workers=4, runs=4, seconds=22.0, calm=8.0, kills=6, stops=12))
QUIET = 4.0
"""Seconds a run in doubt must stay unchanged before the chaos counts it finished."""


@attrs.define
class Worker:
    """One worker slot: the incarnation running in it now (None while it is dead)."""

    index: int
    incarnation: int = 0
    process: subprocess.Popen[bytes] | None = None
    files: tuple[IO[bytes], IO[bytes]] | None = None
    stopped_until: float | None = None
    restart_at: float | None = None

    @property
    def name(self) -> str:
        return f"w{self.index}.{self.incarnation}"


class Fleet:
    def __init__(self, folder: Path, dsn: str, schema: str, runs: list[str]) -> None:
        self.folder, self.dsn, self.schema, self.runs = folder, dsn, schema, runs
        self.workers = [Worker(index) for index in range(BUDGET.workers)]
        self.names: list[str] = []
        self.kills = 0
        self.stops = Counter[str]()

    def start(self, worker: Worker) -> None:
        if worker.process is not None:
            worker.incarnation += 1
        name = worker.name
        self.names.append(name)
        files = (open(self.folder / f"{name}.out", "wb"),  # noqa: SIM115 (closed in reap)
                 open(self.folder / f"{name}.err", "wb"))  # noqa: SIM115
        worker.files = files
        worker.process = subprocess.Popen(
            [sys.executable, "-m", "tests.drivers.fleet_worker", str(self.folder), self.dsn,
             self.schema, name, str(SEED), *self.runs],
            cwd=ROOT, stdout=files[0], stderr=files[1])
        worker.restart_at = None

    def reap(self, worker: Worker) -> None:
        assert worker.process is not None
        assert worker.files is not None
        worker.process.wait()
        for file in worker.files:
            file.close()
        worker.files = None

    def live(self) -> list[Worker]:
        return [w for w in self.workers if w.files is not None and w.stopped_until is None]

    def tick(self, now: float) -> None:
        """Wake the stopped workers whose time has come, notice the ones that ended by
        themselves, restart the killed ones that are due."""
        for worker in self.workers:
            process = worker.process
            if worker.stopped_until is not None and now >= worker.stopped_until:
                assert process is not None
                process.send_signal(signal.SIGCONT)
                worker.stopped_until = None
            if worker.files is not None and process is not None and process.poll() is not None:
                self.reap(worker)  # it ended by itself: every run finished, as it saw them
            if worker.restart_at is not None and now >= worker.restart_at:
                self.start(worker)

    def chaos(self, rng: random.Random, now: float) -> None:
        """One random move: kill -9 a running worker (restarted a little later), stop one
        for less or more than the lease, or nothing."""
        live = self.live()
        if not live:
            return
        move = rng.random()
        worker = rng.choice(live)
        assert worker.process is not None
        if move < 0.3 and self.kills < BUDGET.kills:
            worker.process.send_signal(signal.SIGKILL)
            self.reap(worker)
            worker.restart_at = now + rng.uniform(0.1, 1.0)
            self.kills += 1
        elif move < 0.8 and sum(self.stops.values()) < BUDGET.stops:
            long_stop = rng.random() < 0.75
            seconds = (rng.uniform(fleet_worker.LEASE + 0.3, fleet_worker.LEASE + 1.5)
                       if long_stop else rng.uniform(0.1, 1.0))
            worker.process.send_signal(signal.SIGSTOP)
            worker.stopped_until = now + seconds
            self.stops["past the lease" if long_stop else "within the lease"] += 1

    def end(self) -> None:
        """Wake every worker, ask them to stop after their attempt, and wait for them."""
        (self.folder / "stop").touch()
        for worker in self.workers:
            if worker.stopped_until is not None and worker.process is not None:
                worker.process.send_signal(signal.SIGCONT)
                worker.stopped_until = None
        deadline = time.monotonic() + 30
        for worker in self.workers:
            if worker.files is None or worker.process is None:
                continue
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            if worker.process.poll() is None:  # never seen so far; a finding if it is
                worker.process.kill()
            self.reap(worker)


def finished(store: PostgresEventStore, run_id: str, quiet: dict[str, tuple[int, float]],
             now: float) -> bool:
    """Completed or unrecoverable, or in doubt with its log unchanged for `QUIET` seconds (an
    attempt stopped inside the paying tool may still record its result)."""
    c = RunController.load(store, run_id)
    if c.step in (Step.COMPLETED, Step.TERMINAL_UNRECOVERABLE):
        return True
    if not c.in_doubt():
        return False
    version, since = quiet.setdefault(run_id, (c.version, now))
    if version != c.version:
        quiet[run_id] = (c.version, now)
        return False
    return now - since >= QUIET


def lines(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of ``path``; a line cut short by a kill -9 is left out."""
    found = []
    for line in path.read_text().splitlines() if path.exists() else ():
        with contextlib.suppress(ValueError):
            found.append(json.loads(line))
    return found


@pytest.mark.invariant("I1")
def test_a_fleet_of_killed_and_stopped_workers_runs_no_effect_twice_or_superseded(
        pg_dsn: str, pg_schema: str, tmp_path: Path) -> None:
    rng = random.Random(SEED)
    runs = [f"fleet-{n}" for n in range(BUDGET.runs)]
    for run_id in runs:
        asyncio.run(fleet_worker.prepare(pg_dsn, pg_schema, run_id))
    fleet = Fleet(tmp_path, pg_dsn, pg_schema, runs)
    began = time.monotonic()
    for worker in fleet.workers:
        fleet.start(worker)
    quiet: dict[str, tuple[int, float]] = {}
    next_move = began + 1.0  # let the workers start first
    next_look = began
    chaos_ends = began + BUDGET.seconds
    with PostgresEventStore(pg_dsn, schema=pg_schema, readonly=True) as store:
        try:
            while (now := time.monotonic()) < chaos_ends + BUDGET.calm:
                fleet.tick(now)
                if now >= next_look:
                    if all(finished(store, run_id, quiet, now) for run_id in runs):
                        break
                    next_look = now + 0.5
                if now < chaos_ends and now >= next_move:
                    fleet.chaos(rng, now)
                    next_move = now + rng.uniform(0.2, 0.8)
                time.sleep(0.05)
        finally:
            fleet.end()
        took = time.monotonic() - began
        logs = {run_id: store.load(run_id) for run_id in runs}
        states = {run_id: _end_state(RunController.load(store, run_id)) for run_id in runs}

    # ------------------------------------------------------------------ the figures
    effects = lines(tmp_path / fleet_worker.EFFECTS)
    reports = [report for name in fleet.names for report in lines(tmp_path / f"{name}.out")]
    errors = {name: (tmp_path / f"{name}.err").read_text() for name in fleet.names}
    for log in logs.values():
        check_log(log)
    by_attempt: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for line in effects:
        by_attempt.setdefault((line["worker"], line["attempt"]), []).append(line)
    stale = {key: [line["effect"] for line in found if line["fresh"] is False]
             for key, found in by_attempt.items()}
    conflicted = {(r["worker"], r["attempt"]) for r in reports
                  if r["outcome"] == "ConcurrencyConflict" and r.get("claim") is not None}
    superseded = {key for key, found in stale.items() if found} | conflicted
    extra = Counter(len(stale.get(key, ())) for key in superseded)
    pays = Counter(line["run"] for line in effects if line["effect"] == "tool pay")
    untyped = [r for r in reports if not r["typed"]]
    tracebacks = {name: text for name, text in errors.items() if text.strip()}
    figures = {
        "seed": SEED, "workers": BUDGET.workers, "runs": len(runs), "seconds": round(took, 1),
        "attempts": len({(r["worker"], r["attempt"]) for r in reports
                         if r["attempt"] is not None} | set(by_attempt)),
        "attempts with effects": len(by_attempt),
        "kills": fleet.kills, "stops": dict(fleet.stops),
        "superseded attempts": len(superseded),
        "extra effects per superseded attempt": dict(sorted(extra.items())),
        "extra effects": dict(Counter(e for found in stale.values() for e in found)),
        "unchecked effects": sum(line["fresh"] is None for line in effects),
        "outcomes": dict(Counter(r["outcome"] for r in reports)),
        "end states": dict(Counter(states.values())),
    }
    print(f"\nfleet: {json.dumps(figures)}")
    shown = json.dumps(figures)

    # ------------------------------------------------------------------ the checks
    assert not untyped, f"untyped errors: {untyped[:3]} ({shown})"
    assert not tracebacks, f"a worker wrote to stderr: {tracebacks} ({shown})"
    assert all(count <= 1 for count in pays.values()), (
        f"the paying tool ran twice: {pays} ({shown})")
    for run_id, state in states.items():
        if state == "completed":
            assert pays[run_id] == 1, f"{run_id} completed with {pays[run_id]} payments ({shown})"
    over = {f"{w}#{n}": found for (w, n), found in stale.items() if len(found) > 1}
    assert not over, f"effects after the attempt's claim was superseded: {over} ({shown})"
    assert any(state == "completed" for state in states.values()), shown


def _end_state(c: RunController) -> str:
    if c.step is Step.COMPLETED:
        return "completed"
    if c.in_doubt():
        return "in doubt"
    if c.step is Step.UNSETTLED:
        return "unsettled"
    return str(c.step.value)
