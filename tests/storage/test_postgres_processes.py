"""Many processes, one PostgreSQL database (DESIGN §6.3, §6.7): racing resumers and kill -9.

1. Racing resumers. A pool of 8 long-lived worker processes (forked once, each with its
   own connections: `pg_worker.race_worker`) takes trial after trial: each trial pauses
   a new run (``pay`` approved, with an input guardrail; at INTERRUPTION, or in TOOLS
   after an attempt died before the guardrail ran), every worker loads it, a barrier
   releases them together, and each resumes it through the reference `Runner`
   (``run`` or ``run_streamed``, per command or buffered). Exactly one goes on; the
   other seven get `ConcurrencyConflict` at their claim having run nothing; every
   effect (an fsynced O_APPEND line) is the winner's, once; the log is the winner's
   claim followed by exactly the events of an uncontended resume (nothing interleaved;
   `check_log` passes); the run head names the winner. ``PG_RACE_SECONDS`` (default 20)
   is the time budget and ``PG_RACE_TRIALS`` (default 8) the least number of trials:
   ``PG_RACE_TRIALS=200`` for the long run.
2. kill -9 at random moments. `durability_driver.run_durable` on a PostgreSQL store
   (and a `PostgresSession` in the same database when the library has one, so a
   publication's items ride in its commit's transaction; else a SQLite Session), per
   command or buffered, in processes forked from this one and killed with SIGKILL: at a
   random durable boundary (by itself), or at a random moment (by this process, after a
   random delay), restarted until the run ends. The paying tool never runs twice, no
   committed event and no acknowledged decision is lost, every effect found the record
   allowing it durable, and every run completes or fails closed with `ToolInDoubt`.
   ``PG_KILL_TRIALS`` (default 24; 200 for the long run) and ``PG_KILL_SEED``.

Run with ``-s`` for the figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import os
import random
import statistics
import time
from collections import Counter
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import attrs
import pytest

from statemachine import RunController, Step
from statemachine import events as ev
from statemachine.machine import replay
from statemachine.postgres import PostgresEventStore
from statemachine.testing import check_log
from statemachine.values import Phase
from tests.drivers import claim_driver, pg_worker
from tests.drivers import durability_driver as driver

pytestmark = pytest.mark.postgres

WORKERS = 8
RACE_SECONDS = float(os.environ.get("PG_RACE_SECONDS", "20"))
RACE_TRIALS = int(os.environ.get("PG_RACE_TRIALS", "8"))
KILL_TRIALS = int(os.environ.get("PG_KILL_TRIALS", "24"))
KILL_SEED = int(os.environ.get("PG_KILL_SEED", "0"))
MAX_KILLS = 4
TIMEOUT = 120.0


@pytest.fixture
def store(pg_dsn: str, pg_schema: str) -> Iterator[PostgresEventStore]:
    with PostgresEventStore(pg_dsn, schema=pg_schema) as opened:
        opened.list_runs()  # creates the tables before any worker starts
        yield opened


# ------------------------------------------- a store that wraps its append (regression)


class WrappedAppend(PostgresEventStore):
    """Instrumentation as people write it: ``append(*args, **kwargs)``, which does not
    name ``session_write=``."""

    appends = 0

    def append(self, *args: Any, **kwargs: Any) -> None:
        self.appends += 1
        super().append(*args, **kwargs)


def test_a_store_whose_append_takes_kwargs_still_publishes_to_a_session_beside_it(
        store: PostgresEventStore, pg_dsn: str, pg_schema: str, tmp_path: Path) -> None:
    """Such a store cannot take a Session's items with the commit event: the runner
    writes them to the Session itself (it once handed them over anyway, and every
    publication of the run was refused, leaving it stuck unsettled)."""
    wrapped = WrappedAppend(pg_dsn, schema=pg_schema)
    session = pg_worker.open_session(pg_dsn, pg_schema, "wrapped-session", tmp_path)
    try:
        assert _paused(wrapped, session, "wrapped", "interruption") > 0
        agent, hooks = pg_worker.build(tmp_path / "effects.txt")
        c = RunController.load(wrapped, "wrapped")
        assert asyncio.run(pg_worker.resume("run", agent, hooks, c, session, "me")) == (
            "completed")
        items = asyncio.run(session.get_items())
    finally:
        wrapped.close()
        session.close()
    assert wrapped.appends > 0
    assert [item.get("type") or item.get("role") for item in items] == [
        "user", "function_call", "function_call_output", "assistant"]
    check_log(store.load("wrapped"))


# ---------------------------------------------------------------- racing resumers


class Pool:
    """The long-lived racing workers: a pipe to each, one barrier for all."""

    def __init__(self, dsn: str, schema: str) -> None:
        context = multiprocessing.get_context("fork")
        self.barrier = context.Barrier(WORKERS)
        self.pipes: list[Connection] = []
        self.processes = []
        for index in range(WORKERS):
            ours, theirs = context.Pipe()
            process = context.Process(target=pg_worker.race_worker,
                                      args=(index, dsn, schema, theirs, self.barrier),
                                      daemon=True)
            process.start()
            theirs.close()
            self.pipes.append(ours)
            self.processes.append(process)

    def trial(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        for pipe in self.pipes:
            pipe.send(task)
        answers = []
        for pipe, process in zip(self.pipes, self.processes, strict=True):
            if not pipe.poll(TIMEOUT):
                raise AssertionError(f"worker {process.pid} did not answer")
            answers.append(pipe.recv())
        return answers

    def close(self) -> None:
        for pipe in self.pipes:
            with contextlib.suppress(OSError):
                pipe.send(None)
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()


@attrs.frozen
class Combo:
    variant: str
    mode: str
    buffered: bool

    @classmethod
    def of(cls, trial: int) -> Combo:
        return cls(("interruption", "tools")[trial % 2], ("run", "streamed")[trial // 2 % 2],
                   bool(trial // 4 % 2))

    def __str__(self) -> str:
        return f"{self.variant}/{self.mode}/{'buffered' if self.buffered else 'per-command'}"


def _paused(store: PostgresEventStore, session: Any, run_id: str, variant: str) -> int:
    return asyncio.run(pg_worker.prepare(store, session, run_id, variant))


def _reference(store: PostgresEventStore, dsn: str, schema: str, folder: Path,
               variant: str) -> list[str]:
    """The events an uncontended resume appends after its claim (by type)."""
    folder.mkdir()
    run_id, session_id = f"reference-{variant}", f"reference-session-{variant}"
    session = pg_worker.open_session(dsn, schema, session_id, folder)
    try:
        paused = _paused(store, session, run_id, variant)
        agent, hooks = pg_worker.build(folder / "effects.txt")
        c = RunController.load(store, run_id)
        step = asyncio.run(pg_worker.resume("run", agent, hooks, c, session, "reference"))
        assert step == "completed"
    finally:
        session.close()
    log = store.load(run_id)
    claimed = log[paused]
    assert isinstance(claimed, ev.RunClaimed)
    assert (claimed.seq, claimed.owner) == (paused, "reference")
    assert claimed.at is not None  # every event records when
    return [type(event).__name__ for event in log[paused + 1:]]


@pytest.mark.invariant("I1", "I7")
def test_racing_resumers_on_postgres_exactly_one_goes_on(
        store: PostgresEventStore, pg_dsn: str, pg_schema: str, tmp_path: Path) -> None:
    references = {variant: _reference(store, pg_dsn, pg_schema, tmp_path / f"ref-{variant}",
                                      variant) for variant in ("interruption", "tools")}
    pool = Pool(pg_dsn, pg_schema)
    # the parent's Session handle, trial after trial (one connection)
    session: Any = None
    tally: Counter[str] = Counter()
    spreads: list[float] = []
    durations: list[float] = []
    started = time.monotonic()
    trial = contended = 0
    try:
        while trial < RACE_TRIALS or time.monotonic() - started < RACE_SECONDS:
            began = time.monotonic()
            combo = Combo.of(trial)
            folder = tmp_path / f"trial-{trial}"
            folder.mkdir()
            run_id, session_id = f"race-{trial}", f"race-session-{trial}"
            if session is None or pg_worker.SESSION_CLASS is None:
                if session is not None:
                    session.close()
                session = pg_worker.open_session(pg_dsn, pg_schema, session_id, folder)
            session.session_id = session_id
            paused = _paused(store, session, run_id, combo.variant)
            answers = pool.trial({"run_id": run_id, "session_id": session_id,
                                  "folder": str(folder), "mode": combo.mode,
                                  "buffered": combo.buffered})
            where = f"trial {trial} ({combo}): {answers}"
            assert all(a.get("loaded") == paused for a in answers), where
            winners = [a for a in answers if a["outcome"] == "completed"]
            losers = [a for a in answers if a["outcome"] == "conflict"]
            assert len(winners) == 1, where
            assert len(losers) == WORKERS - 1, where
            winner = winners[0]
            assert winner["step"] == "completed", where
            # a loser was refused at its claim, its first append (buffered: the flush
            # right after the claim), having run nothing
            assert {a["action"] for a in losers} == {"flush" if combo.buffered
                                                     else "claim"}, where
            lines = (folder / pg_worker.EFFECTS).read_text().splitlines()
            assert {int(line.split(" ", 1)[0]) for line in lines} == {winner["pid"]}, where
            assert [line.split(" ", 1)[1] for line in lines] == list(
                claim_driver.WINNER_EFFECTS), where
            # the log: the winner's claim, then exactly an uncontended resume's events
            log = store.load(run_id)
            check_log(log)
            claimed = log[paused]
            assert isinstance(claimed, ev.RunClaimed), where
            assert (claimed.seq, claimed.owner) == (paused, winner["owner"]), where
            assert [type(e).__name__ for e in log[paused + 1:]] == references[
                combo.variant], where
            assert replay(run_id, log).step is Step.COMPLETED
            (head,) = store.list_runs(session_id=session_id)
            assert (head.run_id, head.version, head.step, head.owner) == (
                run_id, len(log), Step.COMPLETED, winner["owner"]), where
            items = asyncio.run(session.get_items())
            assert sum(1 for item in items if item.get("type") == "function_call_output"
                       and item.get("call_id") == "pay") == 1, where
            # how many losing claims began before the winning one had committed
            contended += sum(a["claim"][0] < winner["claim"][1] for a in losers)
            gone = [a["go"] for a in answers]
            spreads.append(max(gone) - min(gone))
            durations.append(time.monotonic() - began)
            tally[str(combo)] += 1
            trial += 1
    finally:
        pool.close()
        if session is not None:
            session.close()
    seconds = time.monotonic() - started
    spreads.sort()
    figures = {
        "trials": trial,
        "workers": WORKERS,
        "winners_per_trial": 1,
        "conflicts": trial * (WORKERS - 1),
        "losing_claims_begun_before_the_winning_commit": contended,
        "duplicate_effects": 0,
        "session": pg_worker.session_kind(),
        "by_combo": dict(sorted(tally.items())),
        "barrier_release_spread_ms": {"median": round(spreads[len(spreads) // 2] * 1000, 2),
                                      "max": round(spreads[-1] * 1000, 2)},
        "ms_per_trial": {"median": round(statistics.median(durations) * 1000, 1),
                         "max": round(max(durations) * 1000, 1)},
        "seconds": round(seconds, 1),
    }
    print("\npg racing resumers:", json.dumps(figures, indent=1))


# ------------------------------------------------------------------------- kill -9

KILL_MODES = ("buffered", "per-command")


@attrs.frozen
class KillReference:
    ticks: tuple[str, ...]
    effects: Counter[str]
    session: list[Any]
    seconds: float


@attrs.define
class KillWorld:
    dsn: str
    schema: str
    root: Path
    store: PostgresEventStore

    def attempt(self, folder: Path, run_id: str, mode: str, *, kill_at: int | None = None,
                kill_after: float | None = None) -> dict[str, Any] | None:
        session_id = f"{run_id}-session"

        def body(ticks: Any) -> Any:
            return pg_worker.run_postgres(folder, self.dsn, self.schema, run_id, session_id,
                                          ticks, buffered=mode == "buffered")

        return driver.run_forked(folder, body, kill_at, kill_after=kill_after)

    def session(self, run_id: str, folder: Path) -> list[Any]:
        return pg_worker.session_items(self.dsn, self.schema, f"{run_id}-session", folder)

    def reference(self, mode: str) -> KillReference:
        folder = self.root / f"reference-{mode}"
        folder.mkdir()
        run_id = f"reference-{mode}"
        began = time.monotonic()
        result = self.attempt(folder, run_id, mode)
        seconds = time.monotonic() - began
        assert result is not None
        assert result["outcome"] == "completed", result
        effects = driver.effects(folder)
        assert set(effects.values()) == {1}, effects
        assert driver.violations(folder) == []
        check_log(self.store.load(run_id))
        return KillReference(tuple(result["ticks"]), effects, self.session(run_id, folder),
                             seconds)


@attrs.frozen
class KillTrial:
    mode: str
    how: str
    kills: int
    conflicts: int
    outcome: str
    effects: Counter[str]
    kinds: tuple[str, ...]


def _kill_trial(world: KillWorld, index: int, references: dict[str, KillReference]
                ) -> KillTrial:
    mode = KILL_MODES[index % 2]
    how = ("tick", "timer")[index // 2 % 2]
    reference = references[mode]
    rng = random.Random(f"{KILL_SEED}:{index}")
    folder = world.root / f"trial-{index}"
    folder.mkdir()
    run_id = f"kill-{index}"
    where = f"trial {index} ({mode}, killed by {how})"

    def next_kill() -> dict[str, Any]:
        if how == "tick":
            return {"kill_at": rng.randint(1, len(reference.ticks))}
        return {"kill_after": rng.uniform(0.0, reference.seconds)}

    kill: dict[str, Any] | None = next_kill()
    kills = conflicts = 0
    kinds: list[str] = []
    committed: list[ev.Event] = []
    while True:
        result = world.attempt(folder, run_id, mode, **(kill or {}))
        events = world.store.load(run_id)
        # no committed event lost: every process's log starts with the one before it
        assert events[: len(committed)] == committed, (where, kills)
        committed = events
        # no acknowledged decision lost
        assert driver.acked(folder) <= driver.approved(events), (where, kills)
        if result is not None and result["outcome"] != "conflict":
            break
        if result is None:
            kills += 1
            if how == "tick" and kill is not None:
                kinds.append(reference.ticks[kill["kill_at"] - 1].split(" ")[0])
            kill = next_kill() if kills < MAX_KILLS and rng.random() < 0.5 else None
        else:  # a dead process's COMMIT landed after this one loaded: go again
            conflicts += 1
            assert conflicts < 10, where
    assert driver.violations(folder) == [], where
    effects = driver.effects(folder)
    assert effects["tool pay"] <= 1, (where, effects)  # the paying tool never runs twice
    check_log(committed)
    if result["outcome"] == "completed":
        assert effects["tool pay"] == 1, where
        assert set(effects) == set(reference.effects), where
        assert world.session(run_id, folder) == reference.session, where
    else:  # fails closed, naming the paying tool
        assert (result["outcome"], result.get("call_id")) == ("in_doubt", "pay"), (where,
                                                                                  result)
        assert replay(run_id, committed).calls["pay"].phase is Phase.STARTED, where
    for name, count in effects.items():
        assert name in reference.effects, (where, name)
        assert count <= 1 + kills, (where, name, count)
    again = world.attempt(folder, run_id, mode)  # one more restart agrees, runs nothing
    assert again is not None
    assert again["outcome"] == result["outcome"], where
    assert driver.effects(folder) == effects, where
    return KillTrial(mode, how, kills, conflicts, result["outcome"], effects, tuple(kinds))


@pytest.mark.invariant("I1", "I11")
def test_kill_9_of_workers_at_random_moments_on_postgres(
        store: PostgresEventStore, pg_dsn: str, pg_schema: str, tmp_path: Path) -> None:
    world = KillWorld(pg_dsn, pg_schema, tmp_path, store)
    references = {mode: world.reference(mode) for mode in KILL_MODES}
    started = time.monotonic()
    trials = [_kill_trial(world, i, references) for i in range(KILL_TRIALS)]
    elapsed = time.monotonic() - started
    outcomes = Counter(t.outcome for t in trials)
    assert set(outcomes) <= {"completed", "in_doubt"}
    assert outcomes["completed"] > 0
    assert sum(t.kills for t in trials) >= KILL_TRIALS // 2
    figures = {
        "trials": len(trials),
        "session": pg_worker.session_kind(),
        "boundaries": {mode: len(r.ticks) for mode, r in references.items()},
        "reference_ms": {mode: round(r.seconds * 1000) for mode, r in references.items()},
        "kills": sum(t.kills for t in trials),
        "kills_by_tick_kind": dict(Counter(k for t in trials for k in t.kinds)),
        "kills_by_timer": sum(t.kills for t in trials if t.how == "timer"),
        "restarts_after_a_late_commit": sum(t.conflicts for t in trials),
        "tool_duplicates": sum(t.effects["tool pay"] > 1 for t in trials),
        "completed": outcomes["completed"],
        "tool_in_doubt": outcomes["in_doubt"],
        "seconds": round(elapsed, 1),
    }
    print("\npg kill -9:", json.dumps(figures, indent=1))
