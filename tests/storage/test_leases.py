"""Leases (DESIGN §7.2): ``claim(owner, lease=...)`` holds a run against other owners.

While another owner's lease is live a claim is refused with `LeaseHeld` (naming the
holder and the end) and nothing is recorded; the holder may claim again; each append of
the holder moves the end on; an ended lease is claimable. Each store checks it in the
append's transaction, by its own clock (the wall clock for memory and SQLite, the
database's for PostgreSQL). The expected ends below come from the wall clock read around
each call, never from what a store recorded; PostgreSQL runs on this machine, so its
clock is this one's up to the slack allowed.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import pickle
import sqlite3
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

from statemachine import ConcurrencyConflict, LeaseHeld, RunController, SchemaError, Step
from statemachine import events as ev
from statemachine.controller import MAX_LEASE
from statemachine.postgres import PostgresEventStore
from statemachine.runner import Runner
from statemachine.sessions import SQLiteSession
from statemachine.stores import (
    AsyncSQLiteEventStore,
    MemoryEventStore,
    RunHead,
    SQLiteEventStore,
)
from tests.drivers import claim_driver
from tests.helpers import StoreMaker

SLACK = 2_000_000
"""Microseconds a store's clock and the wall clock read around a call may differ by (a
busy machine, PostgreSQL's clock)."""


def _now() -> int:
    return time.time_ns() // 1000






async def _maybe(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


async def _head(store: Any, run_id: str = "run") -> RunHead:
    heads: tuple[RunHead, ...] = await _maybe(store.list_runs())
    (head,) = [h for h in heads if h.run_id == run_id]
    return head


async def _until(store: Any) -> int:
    until = (await _head(store)).lease_until
    assert until is not None
    return until


async def _claimed(store: Any, owner: str | None, lease: float | None = None,
                   run_id: str = "run") -> RunController:
    c = await RunController.load_async(store, run_id)
    c.claim(owner, lease=lease)
    await c.flush_async()
    return c


async def _started(store: Any, run_id: str = "run") -> None:
    c = RunController.start(run_id=run_id, session_id=None, store=store)
    await c.flush_async()


def _run(body: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(body())


def test_a_live_lease_refuses_every_other_owner_and_records_nothing(make: StoreMaker) -> None:
    async def body() -> None:
        store = make()
        await _started(store)
        before = _now()
        await _claimed(store, "worker-a", lease=30)
        after = _now()
        head = await _head(store)
        until = await _until(store)
        assert head.lease_owner == "worker-a"
        assert before + 30_000_000 - SLACK <= until <= after + 30_000_000 + SLACK
        version = await _maybe(store.version("run"))
        for rival, lease in [("worker-b", 30), ("worker-b", None), (None, None)]:
            with pytest.raises(LeaseHeld) as info:
                await _claimed(store, rival, lease=lease)
            refused = info.value
            assert isinstance(refused, ConcurrencyConflict)
            assert (refused.owner, refused.until) == ("worker-a", head.lease_until)
            assert "'worker-a'" in str(refused)
            assert str(head.lease_until) in str(refused)
            assert refused.run_id == "run"
            assert refused.action in ("claim", "flush")
            assert await _maybe(store.version("run")) == version  # nothing recorded
        again = pickle.loads(pickle.dumps(refused))
        assert (type(again), again.owner, again.until) == (LeaseHeld, "worker-a",
                                                           head.lease_until)
        # the holder may claim again, and it still holds the run
        await _claimed(store, "worker-a", lease=30)
        assert (await _head(store)).lease_owner == "worker-a"
        with pytest.raises(LeaseHeld):
            await _claimed(store, "worker-b")

    _run(body)


def test_each_append_of_the_holder_moves_the_end_on(make: StoreMaker) -> None:
    async def body() -> None:
        store = make()
        await _started(store)
        holder = await _claimed(store, "worker-a", lease=1.0)
        first = await _until(store)
        await asyncio.sleep(0.6)
        before = _now()
        holder.begin_model_call()
        await holder.flush_async()
        until = await _until(store)
        assert until >= before + 1_000_000 - SLACK
        # both ends read off the store's own clock: moved on by the 0.6 s slept, not kept
        assert until - first >= 500_000
        assert until > first
        assert (await _head(store)).lease_owner == "worker-a"
        await asyncio.sleep(0.6)  # 1.2 s after the claim, 0.6 s after the renewal
        with pytest.raises(LeaseHeld):
            await _claimed(store, "worker-b")

    _run(body)


def test_an_ended_lease_is_claimable_and_a_claim_without_one_drops_it(
        make: StoreMaker) -> None:
    async def body() -> None:
        store = make()
        await _started(store)
        await _claimed(store, "worker-a", lease=0.05)
        await asyncio.sleep(0.2)
        taker = await _claimed(store, "worker-b", lease=30)  # ended: claimable
        assert (await _head(store)).lease_owner == "worker-b"
        with pytest.raises(LeaseHeld) as info:
            await _claimed(store, "worker-a", lease=30)
        assert info.value.owner == "worker-b"
        taker.begin_model_call()  # the refused claim recorded nothing: the holder goes on
        await taker.flush_async()
        await _claimed(store, "worker-b")  # the holder claims without a lease: none left
        head = await _head(store)
        assert (head.lease_owner, head.lease_until) == (None, None)
        await _claimed(store, "worker-c")  # today's behaviour: no lease, no refusal
        await _claimed(store, "worker-d")

    _run(body)


def test_a_buffered_claim_in_one_batch_with_the_start_takes_the_lease(tmp_path: Path) -> None:
    async def body() -> None:
        store = AsyncSQLiteEventStore(tmp_path / "events.db")
        c = RunController.start(run_id="run", session_id=None,
                                store=store)  # type: ignore[arg-type]  # async: buffered
        c.claim("worker-a", lease=30)
        await c.flush_async()  # RunStarted and RunClaimed: the run's first append
        assert (await _head(store)).lease_owner == "worker-a"
        with pytest.raises(LeaseHeld):
            await _claimed(store, "worker-b")

    _run(body)


@pytest.mark.parametrize("lease", [0, -1, 0.0, math.nan, math.inf, -math.inf, True, "30",
                                   MAX_LEASE + 1, [30]])
def test_a_lease_is_a_positive_finite_number_of_seconds(lease: Any) -> None:
    c = RunController.start(run_id="run", session_id=None, store=MemoryEventStore())
    with pytest.raises(SchemaError, match="lease must be a positive finite number"):
        c.claim("worker-a", lease=lease)
    assert c.version == 1


def test_a_lease_needs_an_owner_and_is_recorded_in_microseconds() -> None:
    c = RunController.start(run_id="run", session_id=None, store=MemoryEventStore())
    with pytest.raises(SchemaError, match="a lease needs an owner"):
        c.claim(None, lease=30)
    assert c.version == 1
    c.claim("worker-a", lease=2.5)
    c.claim("worker-a", lease=1e-9)  # shorter than a microsecond: one
    c.claim("worker-a")
    assert [e.lease for e in c.events[1:]] == [2_500_000, 1, None]  # type: ignore[attr-defined]
    assert RunController.from_json(c.to_json()).events == c.events


def test_an_older_sqlite_database_gains_the_lease_columns(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    store = SQLiteEventStore(path)
    c = RunController.start(run_id="run", session_id=None, store=store)
    c.claim("worker-a")
    store.close()
    conn = sqlite3.connect(path)
    for column in ("lease_owner", "lease_until", "lease"):
        conn.execute(f"ALTER TABLE runs DROP COLUMN {column}")
    conn.commit()
    conn.close()
    look = SQLiteEventStore(path, readonly=True)  # read-only: no column, no lease
    assert (look.list_runs()[0].lease_owner, look.list_runs()[0].lease_until) == (None, None)
    look.close()
    store = SQLiteEventStore(path)
    RunController.load(store, "run").claim("worker-a", lease=30)
    assert store.list_runs()[0].lease_owner == "worker-a"
    with pytest.raises(LeaseHeld):
        RunController.load(store, "run").claim("worker-b")


def test_the_reference_runner_claims_with_its_lease_and_a_rival_runs_nothing(
        tmp_path: Path) -> None:
    # worker-a resumes the paused run with a lease; while it runs (at its first hook)
    # worker-b's attempt is refused with LeaseHeld before any effect, recording nothing
    claim_driver.prepare(tmp_path, "interruption")
    rival: dict[str, Any] = {}

    class Interleaved(claim_driver.Effects):
        def __call__(self, what: str) -> None:
            super().__call__(what)
            if not rival:
                rival["version"] = SQLiteEventStore(tmp_path / "events.db").version(
                    claim_driver.RUN_ID)
                thread = threading.Thread(target=_rival_attempt, args=(tmp_path, rival))
                thread.start()
                thread.join()

    agent, hooks = claim_driver.build(tmp_path / "a.txt", Interleaved)
    store = SQLiteEventStore(tmp_path / "events.db")
    session = SQLiteSession(claim_driver.SESSION_ID, tmp_path / "session.db")
    result = asyncio.run(Runner.run(agent, session=session, store=store,
                                    run_id=claim_driver.RUN_ID, hooks=hooks,
                                    owner="worker-a", lease=30))
    assert result.step is Step.COMPLETED
    assert isinstance(rival["error"], LeaseHeld)
    assert rival["error"].owner == "worker-a"
    assert rival["after"] == rival["version"]  # the refused claim recorded nothing
    assert not (tmp_path / "b.txt").exists()  # and ran no effect
    claims = [e for e in store.load(claim_driver.RUN_ID) if isinstance(e, ev.RunClaimed)]
    assert [(e.owner, e.lease) for e in claims] == [("worker-a", 30_000_000)]


def _rival_attempt(folder: Path, out: dict[str, Any]) -> None:
    agent, hooks = claim_driver.build(folder / "b.txt")
    store = SQLiteEventStore(folder / "events.db")
    session = SQLiteSession(claim_driver.SESSION_ID, folder / "session.db")
    try:
        asyncio.run(Runner.run(agent, session=session, store=store,
                               run_id=claim_driver.RUN_ID, hooks=hooks, owner="worker-b",
                               lease=30))
    except ConcurrencyConflict as error:
        out["error"] = error
    out["after"] = store.version(claim_driver.RUN_ID)


# ------------------------------------------- taking over a write whose writer is gone


def _left_writing(store: Any, *, owner: str | None, lease: float | None) -> None:
    """Worker ``owner`` claimed the seed run (with ``lease``), ran its tools, staged the
    batch and was killed before its write landed: the run is UNSETTLED and the Session
    holds nothing of the batch."""
    from tests.helpers import B as BATCH
    from tests.helpers import P, at_interruption, run_charge

    c = at_interruption(store=store)
    if owner is not None:  # (None: the attempt that started the run, which claims nothing)
        c.claim(owner, lease=lease)
    run_charge(c)
    c.stage_publication(BATCH, P, call_ids=["charge", "audit"])
    assert c.step is Step.UNSETTLED


def _next_worker(store: Any, session: Any, owner: str) -> Any:
    from statemachine.runner import Agent
    from statemachine.testing import Untouchable

    return asyncio.run(Runner.run(Agent("a", Untouchable()), store=store, run_id="run-1",
                                  session=session, owner=owner, lease=5))


def _pg_session(pg_dsn: str, pg_schema: str) -> Any:
    """The run's Session in the store's database (its writes share the store's
    transaction), holding the conversation before the batch."""
    from statemachine.postgres import PostgresSession
    from tests.helpers import SESSION, P

    session = PostgresSession(pg_dsn, SESSION, schema=pg_schema)
    asyncio.run(session.add_items(list(P)))
    return session


@pytest.mark.postgres
def test_a_writer_whose_lease_ended_is_taken_over_by_the_next_worker(
        pg_dsn: str, pg_schema: str) -> None:
    """Finding 3.7: the killed writer held a lease and its write was the store's own
    commit append (`PostgresSession`); once the lease ended another worker's claim lands,
    so the writer appended nothing for a whole lease and can land nothing now (its commit
    would meet a moved log). The reference runner takes the write over by itself
    (recorded: ``take_over`` in the log), writes the batch once and goes on. Before:
    UNSETTLED until someone passed take_over=True."""
    from tests.helpers import B as BATCH
    from tests.helpers import P

    with PostgresEventStore(pg_dsn, schema=pg_schema) as store:
        session = _pg_session(pg_dsn, pg_schema)
        _left_writing(store, owner="worker-a", lease=0.2)
        time.sleep(0.3)
        result = _next_worker(store, session, "worker-b")
        assert asyncio.run(session.get_items()) == [*P, *BATCH]  # the batch, written once
        assert result.controller.step is Step.INTERRUPTION  # notify awaits its decision
        taken = [e for e in store.load("run-1") if isinstance(e, ev.ReconciledAppend)]
        assert [e.take_over for e in taken] == [True]
        session.close()


@pytest.mark.postgres
@pytest.mark.parametrize("case", ["lease-live", "no-lease", "same-owner", "no-claim",
                                  "session-of-its-own"])
def test_a_writer_not_provably_gone_is_never_taken_over(pg_dsn: str, pg_schema: str,
                                                         case: str) -> None:
    """Fail closed: a live lease refuses the next worker (`LeaseHeld`, nothing recorded);
    a writer that took no lease (or claimed nothing: it started the run), a next claim by
    the same owner, or a Session written outside the store's transaction (a write stalled
    past the lease could still land after a take-over) proves nothing, so the run stays
    unsettled (`ReconcileRejected`: "may still be writing") and the Session is not
    written."""
    from statemachine import ReconcileRejected
    from statemachine.sessions import MemorySession
    from tests.helpers import SESSION, P

    owner = None if case == "no-claim" else "worker-a"
    lease = None if case in ("no-lease", "no-claim") else (30.0 if case == "lease-live"
                                                          else 0.2)
    with PostgresEventStore(pg_dsn, schema=pg_schema) as store:
        session: Any = (MemorySession(SESSION, list(P)) if case == "session-of-its-own"
                        else _pg_session(pg_dsn, pg_schema))
        _left_writing(store, owner=owner, lease=lease)
        before = store.load("run-1")
        if case != "lease-live":
            time.sleep(0.3)
        refused = LeaseHeld if case == "lease-live" else ReconcileRejected
        with pytest.raises(refused):
            _next_worker(store, session, "worker-a" if case == "same-owner" else "worker-b")
        log = store.load("run-1")
        assert not any(isinstance(e, ev.ReconciledAppend) for e in log)
        assert RunController.load(store, "run-1").step is Step.UNSETTLED
        assert asyncio.run(session.get_items()) == list(P)
        if case == "lease-live":
            assert log == before


def test_a_new_run_started_with_a_lease_is_held_from_its_first_attempt(
        tmp_path: Path) -> None:
    """``Runner.run(..., lease=)`` on a run that does not exist yet: its first batch holds
    the claim with the lease, so another owner is refused (`LeaseHeld`) while it works
    (before: a new run's first attempt claimed nothing and held nothing)."""
    from statemachine.runner import Agent, ModelResponse
    from statemachine.sessions import MemorySession

    store = SQLiteEventStore(tmp_path / "events.db")
    refusals: list[BaseException] = []

    class RivalDuringTheModelCall:
        async def respond(self, history: list[Any], agent: Agent) -> ModelResponse:
            try:
                RunController.load(SQLiteEventStore(tmp_path / "events.db"),
                                   "held").claim("rival", lease=5)
            except LeaseHeld as refused:
                refusals.append(refused)
            return ModelResponse(output="done")

    result = asyncio.run(Runner.run(Agent("a", RivalDuringTheModelCall()), "hi",
                                    session=MemorySession("s"), store=store, run_id="held",
                                    owner="first", lease=5))
    assert result.final_output == "done"
    assert [r.owner for r in refusals] == ["first"]  # type: ignore[attr-defined]
    claims = [e for e in store.load("held") if isinstance(e, ev.RunClaimed)]
    assert [(e.owner, e.lease) for e in claims] == [("first", 5_000_000)]


@pytest.mark.parametrize("forged", [{"lease": 0}, {"lease": -5}, {"lease": 10**16},
                                    {"owner": None}])
def test_a_log_holding_a_lease_no_claim_records_does_not_load(tmp_path: Path,
                                                               forged: dict[str, Any]) -> None:
    """A lease `claim` would refuse (not positive, past 10⁹ s, or without an owner) in a
    forged or copied log: refused on load, from a document and from a store's rows (the
    fast decoding path), never handed to a store's lease check."""
    import json as json_module

    path = tmp_path / "events.db"
    c = RunController.start(run_id="forged", session_id=None, store=SQLiteEventStore(path))
    c.claim("worker-a", lease=3)
    doc = c.to_json()
    doc["events"][1].update(forged)
    with pytest.raises(SchemaError, match="RunClaimed"):
        RunController.from_json(doc)
    with sqlite3.connect(path) as raw:
        raw.execute("UPDATE events SET body = ? WHERE run_id = 'forged' AND seq = 1",
                    (json_module.dumps(doc["events"][1]),))
    with pytest.raises(SchemaError):
        RunController.load(SQLiteEventStore(path), "forged")
