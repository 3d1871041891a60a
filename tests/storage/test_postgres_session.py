"""PostgresSession and the shared transaction (DESIGN §6.7).

The Session contract on `PostgresSession` and `AsyncPostgresSession`; the schema that
holds their items (version 2, upgraded in place from version 1); publication ids and
`publication_items`; and, when the run's store and its Session share a database, a
publication's items and its `PublicationCommitted` written in one transaction: they land
together (the same PostgreSQL transaction id on both), or neither does (a COMMIT that
failed for real, a failure before it, a lost version race), and a COMMIT whose answer was
lost is decided for both by one read-back. Last, the reference runner end to end on the
sync store and Session (per command and buffered) and on the async pair. Every test here
needs a server (`pg_dsn`) and gets a schema of its own."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from statemachine import RunController, Step
from statemachine import events as ev
from statemachine.errors import (
    ConcurrencyConflict,
    InvalidTransition,
    SchemaError,
    StorageError,
)
from statemachine.postgres import (
    SCHEMA_VERSION,
    AsyncPostgresEventStore,
    AsyncPostgresSession,
    PostgresEventStore,
    PostgresSession,
)
from statemachine.runner import Agent, ModelResponse, Runner
from statemachine.runner.publish import publish, settle
from statemachine.sessions import Session
from statemachine.stores import MemoryEventStore, SessionWrite, SQLiteEventStore
from statemachine.testing import Counters, CountingHooks, ScriptedModel, counted_tool
from statemachine.testing.contracts import SessionContract
from statemachine.values import Append
from tests.helpers import SESSION, B, P, assert_refused, at_interruption, run_charge
from tests.storage.test_postgres import _Proxy

pytestmark = pytest.mark.postgres

CALLS = ["charge", "audit"]


# ------------------------------------------------------------------ the contract


class TestPostgresSession(SessionContract):
    dsn: str
    schema: str

    @pytest.fixture(autouse=True)
    def _database(self, pg_dsn: str, pg_schema: str) -> None:
        self.dsn, self.schema = pg_dsn, pg_schema

    def make_session(self, tmp_path: Path, session_id: str) -> Session:
        return PostgresSession(self.dsn, session_id, schema=self.schema)


class _ClosingAsyncSession(AsyncPostgresSession):
    """The contract closes its Sessions with a plain ``close()``."""

    def close(self) -> None:  # type: ignore[override]
        asyncio.run(super().close())


class TestAsyncPostgresSession(SessionContract):
    dsn: str
    schema: str

    @pytest.fixture(autouse=True)
    def _database(self, pg_dsn: str, pg_schema: str) -> None:
        self.dsn, self.schema = pg_dsn, pg_schema

    def make_session(self, tmp_path: Path, session_id: str) -> Session:
        return _ClosingAsyncSession(self.dsn, session_id, schema=self.schema)


# ------------------------------------------------------------------ fixtures, helpers


@pytest.fixture
def store(pg_dsn: str, pg_schema: str) -> Iterator[PostgresEventStore]:
    with PostgresEventStore(pg_dsn, schema=pg_schema) as opened:
        yield opened


@pytest.fixture
def session(pg_dsn: str, pg_schema: str) -> Iterator[PostgresSession]:
    with PostgresSession(pg_dsn, SESSION, schema=pg_schema) as opened:
        yield opened


def _admin(dsn: str) -> psycopg.Connection[Any]:
    return psycopg.connect(dsn, autocommit=True)


def _rows(dsn: str, schema: str) -> list[tuple[str, str | None, Any]]:
    """Every stored item: (session id, publication id, item), in order."""
    with _admin(dsn) as admin:
        rows = admin.execute(f'SELECT session_id, publication_id, body FROM "{schema}".'
                             "session_items ORDER BY id").fetchall()
    return [(sid, pid, json.loads(body)) for sid, pid, body in rows]


def _one_transaction(dsn: str, schema: str, run_id: str, publication_id: str,
                     commit_seq: int) -> bool:
    """Whether the publication's items and the run's event ``commit_seq`` were written by
    one PostgreSQL transaction (the same ``xmin``)."""
    s = f'"{schema}"'
    with _admin(dsn) as admin:
        items = admin.execute(f"SELECT DISTINCT xmin::text FROM {s}.session_items WHERE "
                              "publication_id = %s", (publication_id,)).fetchall()
        event = admin.execute(f"SELECT xmin::text FROM {s}.events WHERE run_id = %s AND "
                              "seq = %s", (run_id, commit_seq)).fetchall()
    return len(items) == 1 and items == event


def _charged(store: Any = None, *, buffered: bool = False) -> RunController:
    """The seed run (charge and audit approved and run), bound to ``store``."""
    if store is not None and buffered:
        c = RunController.start(run_id="run-1", session_id=SESSION, store=store,
                                buffered=True)
        seeded = at_interruption()
        for event in seeded.events[1:]:  # the same six events, recorded buffered
            if isinstance(event, ev.ModelResponded):
                c.model_responded(list(event.tool_calls))
            elif isinstance(event, ev.HookRan):
                c.hook_ran(event.hook)
            else:
                c.begin_model_call()
    else:
        c = at_interruption(store=store)
    run_charge(c)
    return c


def _write_for(c: RunController, items: list[Any] = B) -> SessionWrite:
    return SessionWrite(SESSION, f"run-1:{c.state.attempt_seq}", tuple(items))


def _seq_of(c: RunController, kind: type[ev.Event]) -> int:
    return [e.seq for e in c.events if isinstance(e, kind)][-1]


# ------------------------------------------------------------------ the schema


def test_the_schema_holds_session_items_and_a_version_1_schema_is_upgraded(
        pg_dsn: str, pg_schema: str) -> None:
    s = f'"{pg_schema}"'
    with PostgresEventStore(pg_dsn, schema=pg_schema) as store:
        c = at_interruption(store=store)
    with _admin(pg_dsn) as admin:
        assert admin.execute(f"SELECT version FROM {s}.statemachine_schema").fetchall() == [
            (SCHEMA_VERSION,)] == [(5,)]
        # what version 1 left: the same tables without session_items, head times, leases
        # and read models
        admin.execute(f"DROP TABLE {s}.session_items")
        admin.execute(f"ALTER TABLE {s}.runs DROP COLUMN updated_at")
        for column in ("lease_owner", "lease_until", "lease", "read_model", "blocker"):
            admin.execute(f"ALTER TABLE {s}.runs DROP COLUMN {column}")
        admin.execute(f"UPDATE {s}.statemachine_schema SET version = 1")
    with PostgresEventStore(pg_dsn, schema=pg_schema, readonly=True) as readonly:
        assert RunController.load(readonly, "run-1").state == c.state  # read as it is
    with _admin(pg_dsn) as admin:
        assert admin.execute("SELECT to_regclass(%s)", (f"{s}.session_items",)).fetchone(
            ) == (None,)
    sessions = [PostgresSession(pg_dsn, f"s{i}", schema=pg_schema) for i in range(4)]
    barrier = threading.Barrier(len(sessions))
    errors: list[BaseException] = []

    def first_use(opened: PostgresSession) -> None:
        barrier.wait()
        try:
            asyncio.run(opened.add_items([{"n": 1}]))
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=first_use, args=(x,)) for x in sessions]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []  # four processes' worth of first use: upgraded once
    with _admin(pg_dsn) as admin:
        assert admin.execute(f"SELECT version FROM {s}.statemachine_schema").fetchall() == [
            (SCHEMA_VERSION,)]
    assert asyncio.run(sessions[0].get_items()) == [{"n": 1}]
    for x in sessions:
        x.close()
    with PostgresEventStore(pg_dsn, schema=pg_schema) as store:
        assert RunController.load(store, "run-1").state == c.state  # the log is intact


def test_a_newer_schema_is_refused_by_the_session(pg_dsn: str, pg_schema: str) -> None:
    with PostgresSession(pg_dsn, SESSION, schema=pg_schema) as opened:
        asyncio.run(opened.get_items())
    with _admin(pg_dsn) as admin:
        admin.execute(f'UPDATE "{pg_schema}".statemachine_schema SET version = %s',
                      (SCHEMA_VERSION + 1,))
    newer = PostgresSession(pg_dsn, SESSION, schema=pg_schema)
    with pytest.raises(StorageError, match="newer than this library") as info:
        asyncio.run(newer.add_items([{"n": 1}]))
    assert info.value.outcome == "not_written"
    newer.close()
    with pytest.raises(StorageError, match="the Session is closed"):
        asyncio.run(newer.get_items())


def test_session_failures_are_typed(pg_dsn: str, pg_schema: str, tmp_path: Path) -> None:
    nowhere = PostgresSession(f"host={tmp_path} dbname=x user=x connect_timeout=2", SESSION,
                              schema=pg_schema)
    for call in (nowhere.get_items, lambda: nowhere.add_items([{"n": 1}]),
                 nowhere.pop_item, nowhere.clear_session):
        with pytest.raises(StorageError, match="PostgreSQL OperationalError") as info:
            asyncio.run(call())
        assert info.value.outcome == "not_written"
    nowhere.close()
    with pytest.raises(TypeError):
        PostgresSession(pg_dsn, None, schema=pg_schema)  # type: ignore[arg-type]
    with PostgresSession(pg_dsn, SESSION, schema=pg_schema) as opened:
        asyncio.run(opened.add_items([{"n": 1}]))
        with _admin(pg_dsn) as admin:
            admin.execute(f'UPDATE "{pg_schema}".session_items SET body = %s', ("{bad",))
        with pytest.raises(StorageError, match="damaged item") as info:
            asyncio.run(opened.pop_item())
        assert info.value.outcome == "not_written"
        with pytest.raises(StorageError, match="damaged item"):
            asyncio.run(opened.get_items())
    with _admin(pg_dsn) as admin:  # refused, so kept
        assert admin.execute(f'SELECT count(*) FROM "{pg_schema}".session_items'
                             ).fetchone() == (1,)


def _terminate(dsn: str, pid: int) -> None:
    """End a server process (from another connection) and wait until it is gone."""
    with _admin(dsn) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        while admin.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s",
                            (pid,)).fetchone():
            time.sleep(0.01)


def test_a_session_write_whose_commit_fails_is_unknown(pg_dsn: str, pg_schema: str) -> None:
    """A write whose COMMIT raised (its connection ended right before it) may have
    landed: ``"unknown"``, for the sync and the async Session alike; the next call
    opens a new connection and works."""

    class Killed(PostgresSession):
        def _before_commit(self) -> None:
            _terminate(self.dsn, self._conn.info.backend_pid)

    class AsyncKilled(AsyncPostgresSession):
        async def _before_commit(self) -> None:
            _terminate(self.dsn, self._conn.info.backend_pid)

    async def go(session: Any) -> None:
        with pytest.raises(StorageError) as info:
            await session.add_items([{"n": 1}])
        assert info.value.outcome == "unknown"
        assert await session.get_items() == []  # the server rolled it back

    with Killed(pg_dsn, SESSION, schema=pg_schema) as session:
        asyncio.run(go(session))

    async def go_async() -> None:
        async with AsyncKilled(pg_dsn, SESSION, schema=pg_schema) as session:
            await go(session)

    asyncio.run(go_async())


# ------------------------------------------------------------------ publication ids


class _Unwritable:
    """The Session, except that its writes raise without writing (and it keeps no
    publication ids, so ``publish`` tells it none)."""

    def __init__(self, inner: PostgresSession) -> None:
        self.inner = inner
        self.session_id = inner.session_id

    async def get_items(self, limit: int | None = None) -> list[Any]:
        return await self.inner.get_items(limit)

    async def add_items(self, items: list[Any]) -> None:
        raise RuntimeError("injected")

    async def pop_item(self) -> Any:
        return await self.inner.pop_item()

    async def clear_session(self) -> None:
        await self.inner.clear_session()


def test_publication_ids_tag_each_item_and_count_a_publication_exactly(
        session: PostgresSession, pg_dsn: str, pg_schema: str) -> None:
    """Without a shared store (none here), ``publish`` and ``settle`` tell the Session
    the attempt's publication id: ``run_id:seq`` of the PublicationStaged, or of the
    ReconciledAppend."""

    async def go() -> None:
        await session.add_items(list(P))  # written without a publication id
        c = _charged()
        with pytest.raises(RuntimeError, match="injected"):
            await publish(c, _Unwritable(session), list(B), call_ids=CALLS)
        staged = f"run-1:{_seq_of(c, ev.PublicationStaged)}"
        assert await session.publication_items(staged) == 0
        decision = await settle(c, session)
        assert isinstance(decision, Append)
        appended = f"run-1:{_seq_of(c, ev.ReconciledAppend)}"
        assert appended != staged
        assert await session.publication_items(appended) == len(B)
        assert await session.publication_items("run-1:999") == 0
        assert await session.get_items() == P + B
        assert _rows(pg_dsn, pg_schema) == (
            [(SESSION, None, item) for item in P] + [(SESSION, appended, item) for item in B])
        c.approve("notify")
        c.resume()
        c.begin_tool("notify")
        c.tool_completed("notify", "notified")
        items: list[Any] = [{"type": "function_call_output", "call_id": "notify",
                             "output": "notified"}]
        await publish(c, session, items, call_ids=["notify"])
        assert await session.publication_items(
            f"run-1:{_seq_of(c, ev.PublicationStaged)}") == 1
        other = PostgresSession(pg_dsn, "other", schema=pg_schema)
        assert await other.publication_items(appended) == 0  # counted per Session
        other.close()

    asyncio.run(go())


def test_shares_transaction_with_the_stores_of_its_database_and_schema(
        pg_dsn: str, pg_schema: str, tmp_path: Path) -> None:
    opened = PostgresSession(pg_dsn, SESSION, schema=pg_schema)
    other = AsyncPostgresSession(pg_dsn, SESSION, schema=pg_schema)
    for x in (opened, other):
        assert x.shares_transaction_with(PostgresEventStore(pg_dsn, schema=pg_schema))
        assert x.shares_transaction_with(AsyncPostgresEventStore(pg_dsn, schema=pg_schema))
        respelled = make_conninfo("", **conninfo_to_dict(pg_dsn))
        assert x.shares_transaction_with(PostgresEventStore(respelled, schema=pg_schema))
        assert not x.shares_transaction_with(PostgresEventStore(pg_dsn, schema="elsewhere"))
        assert not x.shares_transaction_with(
            PostgresEventStore(pg_dsn, schema=pg_schema, readonly=True))
        assert not x.shares_transaction_with(
            PostgresEventStore(make_conninfo(pg_dsn, dbname="another"), schema=pg_schema))
        assert not x.shares_transaction_with(MemoryEventStore())
        assert not x.shares_transaction_with(SQLiteEventStore(tmp_path / "e.db"))
        assert not x.shares_transaction_with(None)
    opened.close()


# ------------------------------------------------------------------ the shared transaction


@pytest.mark.parametrize("buffered", [False, True], ids=["per-command", "buffered"])
def test_a_publication_and_its_commit_are_written_in_one_transaction(
        store: PostgresEventStore, session: PostgresSession, pg_dsn: str, pg_schema: str,
        buffered: bool) -> None:
    async def go() -> None:
        await session.add_items(list(P))
        c = _charged(store, buffered=buffered)
        await publish(c, session, list(B), call_ids=CALLS)
        assert c.step is Step.INTERRUPTION  # settled: notify still awaits its decision
        assert c.unflushed == 0  # the items are the effect: the commit did not wait
        assert store.load("run-1") == list(c.events)
        assert await session.get_items() == P + B
        publication = f"run-1:{_seq_of(c, ev.PublicationStaged)}"
        assert await session.publication_items(publication) == len(B)
        assert _one_transaction(pg_dsn, pg_schema, "run-1", publication,
                                _seq_of(c, ev.PublicationCommitted))
        assert RunController.load(store, "run-1").state == c.state

    asyncio.run(go())


class _KillsTheWrite(PostgresEventStore):
    """Terminates its own backend right before the COMMIT of the next append that
    carries a Session write: the COMMIT fails for real."""

    armed = False
    carrying = False

    def append(self, *args: Any,
               session_write: SessionWrite | tuple[SessionWrite, ...] | None = None,
               **options: Any) -> None:
        self.carrying = session_write is not None
        super().append(*args, session_write=session_write, **options)

    def _before_commit(self) -> None:
        if not (self.armed and self.carrying):
            return
        self.armed = False
        pid = self._conn.info.backend_pid
        with _admin(self.dsn) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
            while admin.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s",
                                (pid,)).fetchone():
                time.sleep(0.01)


def test_a_commit_that_failed_writes_neither_the_items_nor_the_event(
        session: PostgresSession, pg_dsn: str, pg_schema: str) -> None:
    store = _KillsTheWrite(pg_dsn, schema=pg_schema)

    async def go() -> None:
        await session.add_items(list(P))
        c = _charged(store)
        store.armed = True
        with pytest.raises(StorageError) as info:
            await publish(c, session, list(B), call_ids=CALLS)
        assert info.value.outcome == "not_written"  # decided by reading the batch back
        assert "terminating connection" in info.value.reason
        assert await session.get_items() == P  # nothing of the batch
        staged = f"run-1:{_seq_of(c, ev.PublicationStaged)}"
        assert await session.publication_items(staged) == 0
        assert not any(isinstance(e, ev.PublicationCommitted) for e in store.load("run-1"))
        assert isinstance(c.events[-1], ev.PublicationFailed)  # reported (I6 re-raised)
        assert store.load("run-1") == list(c.events)
        assert c.step is Step.UNSETTLED
        decision = await settle(c, session)  # nothing landed: Append, in one transaction
        assert isinstance(decision, Append)
        assert c.step is Step.INTERRUPTION
        assert await session.get_items() == P + B  # once
        appended = f"run-1:{_seq_of(c, ev.ReconciledAppend)}"
        assert await session.publication_items(appended) == len(B)
        assert _one_transaction(pg_dsn, pg_schema, "run-1", appended,
                                _seq_of(c, ev.PublicationCommitted))
        assert RunController.load(store, "run-1").state == c.state

    asyncio.run(go())
    store.close()


def test_a_failure_before_commit_leaves_the_controller_as_it_was(
        store: PostgresEventStore, session: PostgresSession) -> None:
    """`publication_committed(session_write=)` whose append fails: nothing recorded,
    nothing written, the attempt still open for ``publication_failed``."""
    c = _charged(store)
    c.stage_publication(B, P, call_ids=CALLS)
    other = RunController.load(store, "run-1")
    other.claim("another worker")  # the log moves on under this controller
    assert_refused(c, ConcurrencyConflict, c.publication_committed,
                   session_write=_write_for(c))
    assert asyncio.run(session.get_items()) == []
    assert c.holds_attempt
    c = RunController.load(store, "run-1")
    assert isinstance(c.reconcile(P, SESSION, take_over=True), Append)  # holds an attempt
    store.close()  # every append now fails before COMMIT
    error = assert_refused(c, StorageError, c.publication_committed,
                           session_write=_write_for(c))
    assert error.outcome == "not_written"
    assert c.holds_attempt
    assert asyncio.run(session.get_items()) == []


@pytest.mark.parametrize("readback", ["decided", "unknown"])
def test_a_lost_commit_answer_is_decided_for_both_by_one_read_back(
        pg_dsn: str, pg_schema: str, readback: str) -> None:
    proxy = _Proxy(pg_dsn)

    class Armed(PostgresEventStore):
        arm = False
        carrying = False

        def append(self, *args: Any,
                   session_write: SessionWrite | tuple[SessionWrite, ...] | None = None,
                   **options: Any) -> None:
            self.carrying = session_write is not None
            super().append(*args, session_write=session_write, **options)

        def _before_commit(self) -> None:
            if self.arm and self.carrying:
                self.arm = False
                proxy.mode = "drop_reply"  # the COMMIT lands; its answer is lost
                proxy.refuse = readback == "unknown"

    store = Armed(proxy.dsn, schema=pg_schema, readback_timeout=1.0)
    shared = PostgresSession(proxy.dsn, SESSION, schema=pg_schema)
    assert shared.shares_transaction_with(store)

    async def go() -> None:
        await shared.add_items(list(P))
        c = _charged(store)
        store.arm = True
        if readback == "decided":
            await publish(c, shared, list(B), call_ids=CALLS)  # found: both landed
            assert c.step is Step.INTERRUPTION
        else:
            with pytest.raises(StorageError) as info:
                await publish(c, shared, list(B), call_ids=CALLS)
            assert info.value.outcome == "unknown"
            assert isinstance(c.events[-1], ev.PublicationStaged)  # nothing reported
            proxy.refuse = False
        assert proxy.mode is None  # the answer was lost for real
        with PostgresEventStore(pg_dsn, schema=pg_schema) as direct, \
                PostgresSession(pg_dsn, SESSION, schema=pg_schema) as items:
            loaded = RunController.load(direct, "run-1")
            # the pair landed together: no write is ambiguous, nothing to reconcile
            assert loaded.step is Step.INTERRUPTION
            assert await items.get_items() == P + B
            assert await items.publication_items(
                f"run-1:{_seq_of(loaded, ev.PublicationStaged)}") == len(B)
            if readback == "decided":
                assert loaded.state == c.state

    try:
        asyncio.run(go())
    finally:
        store.close()
        shared.close()
        proxy.close()


def test_a_session_write_needs_a_store_that_takes_it_and_the_staged_batch(
        tmp_path: Path) -> None:
    for bound in (None, MemoryEventStore()):
        c = _charged(bound)
        c.stage_publication(B, P, call_ids=CALLS)
        assert_refused(c, InvalidTransition, c.publication_committed,
                       session_write=_write_for(c))
        assert c.holds_attempt


def test_a_session_write_is_checked_against_the_attempt(store: PostgresEventStore) -> None:
    c = _charged(store)
    c.stage_publication(B, P, call_ids=CALLS)
    pid = f"run-1:{c.state.attempt_seq}"
    for wrong in (SessionWrite("other", pid, tuple(B)),
                  SessionWrite(SESSION, "run-1:0", tuple(B)),
                  SessionWrite(SESSION, pid, tuple(B[:2])),
                  SessionWrite(SESSION, pid, (*B[:2], {"changed": True}))):
        assert_refused(c, InvalidTransition, c.publication_committed, session_write=wrong)
    assert_refused(c, SchemaError, c.publication_committed,
                   session_write=SessionWrite(SESSION, pid, list(B)))  # type: ignore[arg-type]
    assert_refused(c, SchemaError, c.publication_committed,
                   session_write=(SESSION, pid, tuple(B)))
    c.publication_committed(session_write=SessionWrite(SESSION, pid, tuple(B)))
    assert c.step is Step.INTERRUPTION
    assert store.load("run-1") == list(c.events)


# ------------------------------------------------------------------ the async pair


def test_the_async_store_writes_the_pair_at_the_next_flush(pg_dsn: str,
                                                          pg_schema: str) -> None:
    class Failing(AsyncPostgresEventStore):
        fail = False

        async def _before_commit(self) -> None:
            if self.fail:
                self.fail = False
                raise psycopg.OperationalError("injected before COMMIT")

    async def go() -> None:
        async with Failing(pg_dsn, schema=pg_schema) as store, \
                AsyncPostgresSession(pg_dsn, SESSION, schema=pg_schema) as session:
            assert session.shares_transaction_with(store)
            await session.add_items(list(P))
            c = _charged(store)  # an async store: the controller buffers
            c.stage_publication(B, P, call_ids=CALLS)
            await c.flush_async()
            version, events = c.version, c.events
            c.publication_committed(session_write=_write_for(c))
            # waiting for its append: recorded nothing yet, refuses every other record
            assert (c.version, c.events, c.step) == (version, events, Step.UNSETTLED)
            assert_refused(c, InvalidTransition, c.publication_failed, RuntimeError)
            store.fail = True
            with pytest.raises(StorageError) as info:
                await c.flush_async()
            assert info.value.outcome == "not_written"
            assert (c.version, c.events, c.step) == (version, events, Step.UNSETTLED)
            assert c.holds_attempt
            assert await session.get_items() == P
            c.publication_failed(info.value)  # the attempt was still open
            decision = await settle(c, session)  # the reference path: flush right after
            assert isinstance(decision, Append)
            assert c.step is Step.INTERRUPTION
            assert c.unflushed == 0
            assert await session.get_items() == P + B
            assert await session.publication_items(
                f"run-1:{_seq_of(c, ev.ReconciledAppend)}") == len(B)
            assert await store.load("run-1") == list(c.events)
            assert _one_transaction(pg_dsn, pg_schema, "run-1",
                                    f"run-1:{_seq_of(c, ev.ReconciledAppend)}",
                                    _seq_of(c, ev.PublicationCommitted))

    asyncio.run(go())


# ------------------------------------------------------------------ the reference runner


@pytest.mark.parametrize("mode", ["per-command", "buffered", "async"])
def test_the_reference_runner_end_to_end(pg_dsn: str, pg_schema: str, mode: str) -> None:
    """Approval, the tool once, completed; the Session holds each item once, and every
    item was written by the store with its publication's commit event."""
    counters = Counters()
    hooks = CountingHooks(counters)
    tools = (counted_tool(counters, "charge", lambda x: f"charged {x}", needs_approval=True,
                          guarded=True),
             counted_tool(counters, "notify", lambda: "notified", needs_approval=True))
    model = ScriptedModel([
        ModelResponse((("charge", "charge", {"x": 7}), ("notify", "notify", {}))),
        ModelResponse(output="charged and notified"),
    ])
    agent = Agent("billing", model, tools)
    buffered = mode == "buffered"

    async def go() -> None:
        store: Any
        session: Any
        if mode == "async":
            store = AsyncPostgresEventStore(pg_dsn, schema=pg_schema)
            session = AsyncPostgresSession(pg_dsn, "seed-session", schema=pg_schema)
        else:
            store = PostgresEventStore(pg_dsn, schema=pg_schema)
            session = PostgresSession(pg_dsn, "seed-session", schema=pg_schema)
        assert session.shares_transaction_with(store)
        first = await Runner.run(agent, "charge me 7 and notify me", session=session,
                                 store=store, run_id="seed", hooks=hooks, buffered=buffered)
        assert [call.call_id for call in first.interruptions] == ["charge", "notify"]
        c = first.controller
        c.approve("charge", fingerprint=c.fingerprint("charge"))
        c.approve("notify")
        await c.flush_async()  # durable before it is acknowledged
        done = await Runner.run(agent, session=session, store=store, run_id="seed",
                                hooks=hooks, buffered=buffered)
        assert done.step is Step.COMPLETED
        assert done.final_output == "charged and notified"
        assert counters.tools == {"charge": 1, "notify": 1}
        assert counters.guardrails == {"charge_input": 1, "charge_output": 1}
        assert model.calls == 2
        items = await session.get_items()
        texts = [json.dumps(item, sort_keys=True) for item in items]
        assert len(texts) == len(set(texts))  # each item once
        assert items[0] == {"role": "user", "content": "charge me 7 and notify me"}
        for call_id in ("charge", "notify"):
            for kind in ("function_call", "function_call_output"):
                assert sum(1 for item in items if item.get("type") == kind
                           and item.get("call_id") == call_id) == 1
        log = list(await store.load("seed") if mode == "async" else store.load("seed"))
        assert log == list(done.controller.events)
        # every publication went with its commit: one transaction, counted exactly
        written = 0
        opened: int | None = None
        size = 0
        for event in log:
            if isinstance(event, ev.PublicationStaged):
                opened, size = event.seq, len(event.items)
            elif isinstance(event, ev.PublicationCommitted):
                assert opened is not None
                publication = f"seed:{opened}"
                assert await session.publication_items(publication) == size
                assert _one_transaction(pg_dsn, pg_schema, "seed", publication, event.seq)
                written += size
        assert written == len(items)
        if mode == "async":
            reloaded = await RunController.load_async(store, "seed")
            await store.close()
            await session.close()
        else:
            reloaded = RunController.load(store, "seed")
            store.close()
            session.close()
        assert reloaded.state == done.controller.state

    asyncio.run(go())
