"""The PostgreSQL stores (DESIGN §6.7): the event-store contract, the run heads, the schema,
appends whose COMMIT answer was lost (classified by read-back, never retried), a server
restart mid-run, a stale owner, the async store, and a measurement against a bare psycopg
loop. Every test here needs a server (`pg_dsn`: a throwaway cluster or
STATEMACHINE_PG_DSN) and gets a schema of its own."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import os
import shutil
import socket
import statistics
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from statemachine import RunController, Step, codec
from statemachine import controller as controller_module
from statemachine import events as ev
from statemachine.errors import ConcurrencyConflict, LeaseHeld, SchemaError, StorageError
from statemachine.postgres import (
    SCHEMA_VERSION,
    AsyncEventStore,
    AsyncPostgresEventStore,
    PostgresEventStore,
)
from statemachine.stores import (
    EventStore,
    IndexedStore,
    SnapshotIgnored,
    SnapshotStore,
    _dumps,
)
from statemachine.testing.contracts import EventStoreContract
from statemachine.values import RecoveryPolicy
from tests import pg_cluster
from tests.helpers import assert_refused, at_interruption, run_charge

pytestmark = pytest.mark.postgres


class TestPostgresEventStore(EventStoreContract):
    dsn: str
    schema: str

    @pytest.fixture(autouse=True)
    def _database(self, pg_dsn: str, pg_schema: str) -> None:
        self.dsn, self.schema = pg_dsn, pg_schema

    def make_store(self, tmp_path: Path) -> EventStore:
        return PostgresEventStore(self.dsn, schema=self.schema)

    def open_again(self, tmp_path: Path) -> EventStore:
        return PostgresEventStore(self.dsn, schema=self.schema)


@pytest.fixture
def store(pg_dsn: str, pg_schema: str) -> Iterator[PostgresEventStore]:
    with PostgresEventStore(pg_dsn, schema=pg_schema) as opened:
        yield opened


def _admin(dsn: str) -> psycopg.Connection[Any]:
    return psycopg.connect(dsn, autocommit=True)


def _started(run_id: str, session_id: str | None = "s") -> ev.RunStarted:
    return ev.RunStarted(0, run_id, session_id, RecoveryPolicy.RECONCILE, None, "json")


# ------------------------------------------------------------------ protocols, heads


def test_it_is_every_kind_of_store(store: PostgresEventStore) -> None:
    assert isinstance(store, EventStore)
    assert isinstance(store, SnapshotStore)
    assert isinstance(store, IndexedStore)


def test_list_runs_indexes_runs_by_session_step_and_owner(store: PostgresEventStore) -> None:
    a = at_interruption(store=store, run_id="b-run")
    a.claim("worker-1")
    b = RunController.start(run_id="a-run", session_id="other", store=store)
    c = RunController.start(run_id="c-run", session_id=None, store=store)
    c.begin_model_call()
    heads = store.list_runs()
    assert [h.run_id for h in heads] == ["a-run", "b-run", "c-run"]  # ordered by run id
    by_id = {h.run_id: h for h in heads}
    assert by_id["b-run"].version == a.version == len(store.load("b-run"))
    assert by_id["b-run"].step is Step.INTERRUPTION
    assert by_id["b-run"].owner == "worker-1"
    assert by_id["b-run"].session_id == "session-1"
    assert by_id["a-run"].step is b.step
    assert by_id["a-run"].owner is None
    assert by_id["c-run"].session_id is None
    assert by_id["c-run"].step is Step.AWAITING_MODEL
    assert [h.run_id for h in store.list_runs("session-1")] == ["b-run"]
    assert [h.run_id for h in store.list_runs(steps={Step.AWAITING_MODEL})] == ["c-run"]
    assert store.list_runs("other", steps=[Step.INTERRUPTION]) == ()
    assert store.list_runs(steps=()) == ()
    assert store.run_ids() == ["a-run", "b-run", "c-run"]
    assert store.run_ids(limit=1) == ["a-run"]
    with pytest.raises(TypeError):
        store.list_runs(steps="interruption")  # type: ignore[arg-type]


def test_an_append_without_step_is_folded_when_listed_and_kept(
        store: PostgresEventStore, pg_dsn: str, pg_schema: str) -> None:
    c = at_interruption(store=store)
    c.approve("charge")
    # a caller writing events directly, without telling the step
    store.append("run-1", [ev.CallApproved(c.version, "audit", c.fingerprint("audit"))],
                 c.version)
    with _admin(pg_dsn) as admin:
        row = admin.execute(f'SELECT step, version FROM "{pg_schema}".runs').fetchone()
        assert row == (None, c.version + 1)
        (head,) = store.list_runs(steps={Step.INTERRUPTION})
        assert (head.step, head.version) == (Step.INTERRUPTION, c.version + 1)
        row = admin.execute(f'SELECT step FROM "{pg_schema}".runs').fetchone()
        assert row == ("interruption",)  # kept: the next listing folds nothing


def test_a_run_id_taken_is_refused_as_already_existing(store: PostgresEventStore) -> None:
    RunController.start(run_id="r", session_id="s", store=store)
    with pytest.raises(ConcurrencyConflict, match="already exists"):
        RunController.start(run_id="r", session_id="s", store=store)
    with pytest.raises(ConcurrencyConflict, match="already exists"):
        store.append("r", [_started("r")], 0)
    assert len(store.load("r")) == 1


def test_an_empty_append_checks_the_version_and_writes_nothing(
        store: PostgresEventStore) -> None:
    store.append("r", [], 0)
    assert store.load("r") == []
    assert store.list_runs() == ()
    store.append("r", [_started("r")], 0)
    store.append("r", [], 1)
    with pytest.raises(ConcurrencyConflict):
        store.append("r", [], 0)
    with pytest.raises(ValueError, match="sequence numbers"):
        store.append("r", [ev.ModelCallBegun(5)], 1)


# ------------------------------------------------------------------ schema


def test_the_schema_is_created_on_first_use_and_versioned(pg_dsn: str,
                                                          pg_schema: str) -> None:
    with _admin(pg_dsn) as admin:
        assert admin.execute("SELECT to_regnamespace(%s)", (pg_schema,)).fetchone() == (None,)
        store = PostgresEventStore(pg_dsn, schema=pg_schema)  # connects on first use
        assert admin.execute("SELECT to_regnamespace(%s)", (pg_schema,)).fetchone() == (None,)
        assert store.load("r") == []
        rows = admin.execute(f'SELECT version FROM "{pg_schema}".statemachine_schema'
                             ).fetchall()
        assert rows == [(SCHEMA_VERSION,)]
        store.close()
        admin.execute(f'UPDATE "{pg_schema}".statemachine_schema SET version = %s',
                      (SCHEMA_VERSION + 1,))
    newer = PostgresEventStore(pg_dsn, schema=pg_schema)
    with pytest.raises(StorageError, match="newer than this library") as info:
        newer.load("r")
    assert info.value.outcome == "not_written"
    with pytest.raises(StorageError, match="newer"):
        newer.append("r", [_started("r")], 0)


def test_stores_opening_at_once_create_the_schema_once(pg_dsn: str, pg_schema: str) -> None:
    stores = [PostgresEventStore(pg_dsn, schema=pg_schema) for _ in range(6)]
    barrier = threading.Barrier(len(stores))
    errors: list[BaseException] = []

    def first_use(s: PostgresEventStore) -> None:
        barrier.wait()
        try:
            s.load("r")
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=first_use, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in stores:
        s.close()
    assert errors == []
    with _admin(pg_dsn) as admin:
        assert admin.execute(f'SELECT count(*) FROM "{pg_schema}".statemachine_schema'
                             ).fetchone() == (1,)


def test_a_readonly_store_creates_nothing_and_writes_nothing(pg_dsn: str,
                                                             pg_schema: str) -> None:
    readonly = PostgresEventStore(pg_dsn, schema=pg_schema, readonly=True)
    with pytest.raises(StorageError, match="no agent-statemachine event store"):
        readonly.load("run-1")
    with _admin(pg_dsn) as admin:
        assert admin.execute("SELECT to_regnamespace(%s)", (pg_schema,)).fetchone() == (None,)
    with PostgresEventStore(pg_dsn, schema=pg_schema) as writer:
        c = at_interruption(store=writer)
        writer.append("run-1", [ev.CallApproved(c.version, "audit", c.fingerprint("audit"))],
                      c.version)
    readonly = PostgresEventStore(pg_dsn, schema=pg_schema, readonly=True)
    assert RunController.load(readonly, "run-1").step is Step.INTERRUPTION
    assert [h.step for h in readonly.list_runs()] == [Step.INTERRUPTION]  # folded, not kept
    with _admin(pg_dsn) as admin:
        assert admin.execute(f'SELECT step FROM "{pg_schema}".runs').fetchone() == (None,)
    with pytest.raises(StorageError, match="read-only") as info:
        readonly.append("run-1", [ev.ModelCallBegun(8)], 8)
    assert info.value.outcome == "not_written"
    readonly.close()


def test_a_bad_schema_name_and_an_unreachable_server(pg_schema: str,
                                                     tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="identifier"):
        PostgresEventStore("dbname=x", schema='x"; DROP TABLE y; --')
    nowhere = PostgresEventStore(f"host={tmp_path} dbname=x user=x connect_timeout=2",
                                 schema=pg_schema)
    for call in (lambda: nowhere.load("r"), nowhere.list_runs,
                 lambda: nowhere.append("r", [_started("r")], 0)):
        with pytest.raises(StorageError, match="PostgreSQL OperationalError") as info:
            call()
        assert info.value.outcome == "not_written"
    nowhere.close()
    with pytest.raises(StorageError, match="closed"):
        nowhere.load("r")


def test_text_postgresql_cannot_hold_is_a_storage_error(store: PostgresEventStore) -> None:
    """PostgreSQL text holds no NUL and no lone surrogate: an id carrying one is refused as
    not written (the controller refuses lone surrogates itself, before any store)."""
    for run_id in ("a\x00b", "a\ud800b"):
        with pytest.raises(StorageError) as info:
            store.append(run_id, [_started(run_id)], 0)
        assert info.value.outcome == "not_written"
        with pytest.raises(StorageError):
            store.load(run_id)
    RunController.start(run_id="fine", session_id="s", store=store)  # the store goes on
    assert [h.run_id for h in store.list_runs()] == ["fine"]


# ------------------------------------------------------------------ verified snapshots


async def _latest_async(dsn: str, schema: str) -> Any:
    async with AsyncPostgresEventStore(dsn, schema=schema) as store:
        return await store.load_latest("run-1")


def test_a_damaged_snapshot_is_ignored_with_a_warning(
        store: PostgresEventStore, pg_dsn: str, pg_schema: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(controller_module, "SNAPSHOT_EVERY", 3)
    c = at_interruption(store=store)
    run_charge(c)
    snapshot, tail = store.load_latest("run-1")
    assert snapshot is not None
    assert len(tail) < len(c.events)
    table = f'"{pg_schema}".snapshots'
    damages = [
        f"UPDATE {table} SET body = replace(body, '\"turns\":1', '\"turns\":2')",  # digest
        f"UPDATE {table} SET version = version + 1000",  # past the log
        f"UPDATE {table} SET digest = 'x'",
    ]
    with _admin(pg_dsn) as admin:
        kept = admin.execute(f"SELECT version, body, digest FROM {table}").fetchone()
        assert kept is not None
        for damage in damages:
            admin.execute(f"UPDATE {table} SET version = %s, body = %s, digest = %s", kept)
            admin.execute(damage)
            with pytest.warns(SnapshotIgnored):
                snapshot, log = store.load_latest("run-1")
            assert snapshot is None
            assert log == list(c.events)
            with pytest.warns(SnapshotIgnored):
                assert asyncio.run(_latest_async(pg_dsn, pg_schema)) == (None, log)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", SnapshotIgnored)
                assert RunController.load(store, "run-1").state == c.state


def test_the_stores_measure_what_they_load_and_a_run_is_sized_by_it(
        store: PostgresEventStore, pg_dsn: str, pg_schema: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Both stores hand a controller the size of the events they decoded (the whole log,
    and a snapshot's tail): the size `to_json()` has, never another."""
    from statemachine import stores

    monkeypatch.setattr(controller_module, "SNAPSHOT_EVERY", 3)
    c = at_interruption(store=store)
    run_charge(c)

    def events_size(events: list[Any]) -> int:
        return len(",".join(_dumps(codec.encode_event(e)) for e in events).encode())

    whole = stores.load_measured(store, "run-1")
    snapshot, tail = stores.load_latest_measured(store, "run-1")
    assert snapshot is not None
    assert 0 < len(tail.events) < len(c.events)
    assert whole.events == list(c.events)
    assert whole.size == events_size(whole.events)
    assert tail.size == events_size(tail.events)

    async def measured_async() -> tuple[Any, Any]:
        async with AsyncPostgresEventStore(pg_dsn, schema=pg_schema) as other:
            return await other.load_measured("run-1"), await other.load_latest_measured(
                "run-1")

    whole_async, (snapshot_async, tail_async) = asyncio.run(measured_async())
    assert (whole_async, snapshot_async, tail_async) == (whole, snapshot, tail)
    for from_snapshot in (True, False):
        loaded = RunController.load(store, "run-1", snapshot=from_snapshot)
        assert loaded.size == c.size == len(_dumps(loaded.to_json()).encode())


def test_a_truncated_log_or_a_gap_is_an_error_never_a_shorter_log(
        store: PostgresEventStore, pg_dsn: str, pg_schema: str) -> None:
    c = at_interruption(store=store)
    with _admin(pg_dsn) as admin:
        admin.execute(f'DELETE FROM "{pg_schema}".events WHERE seq = %s', (c.version - 1,))
        with pytest.raises(SchemaError, match="head says"):
            store.load("run-1")
        with pytest.raises(SchemaError):
            RunController.load(store, "run-1")
        admin.execute(f'DELETE FROM "{pg_schema}".events WHERE seq = 2')
        with pytest.raises(SchemaError, match="gap"):
            store.load("run-1")


# ------------------------------------------------------------------ a stale owner


@pytest.mark.invariant("I7")
def test_a_stale_owner_is_refused_on_its_next_append(store: PostgresEventStore) -> None:
    at_interruption(store=store)
    mine = RunController.load(store, "run-1")
    theirs = RunController.load(store, "run-1")
    mine.claim("worker-a")
    assert_refused(theirs, ConcurrencyConflict, theirs.claim, "worker-b")
    assert_refused(theirs, ConcurrencyConflict, theirs.approve, "charge")
    (head,) = store.list_runs()
    assert head.owner == "worker-a"
    theirs = RunController.load(store, "run-1")
    theirs.claim("worker-b")  # takes the run over
    assert_refused(mine, ConcurrencyConflict, mine.approve, "charge")  # superseded
    assert store.list_runs()[0].owner == "worker-b"
    theirs.approve("charge")
    assert store.list_runs()[0].owner == "worker-b"  # an append without a claim keeps it
    assert RunController.load(store, "run-1").state == theirs.state


# ------------------------------------------------------------------ lost COMMIT answers


class _Proxy:
    """A unix-socket proxy in front of the server that can lose the next message of the
    connection it serves: ``"drop_reply"`` forwards the request (so the server commits)
    and loses the answer; ``"drop_request"`` loses the request and hangs up on both sides
    (the server rolls back); ``"hold_request"`` keeps the request back and hangs up on
    the client only, leaving the server's side open (a transaction stays open, its locks
    held) until `release`, which may deliver the held request late, as a slow network
    would. ``refuse`` turns every new connection away."""

    def __init__(self, dsn: str) -> None:
        info = conninfo_to_dict(dsn)
        host, port = str(info.get("host") or "/tmp"), int(str(info.get("port") or 5432))
        self._target: Any = (f"{host}/.s.PGSQL.{port}" if host.startswith("/")
                             else (host, port))
        self._dir = tempfile.mkdtemp(prefix="smpx-", dir="/tmp")
        self.dsn = make_conninfo(dsn, host=self._dir, port="5432", sslmode="disable")
        self.mode: str | None = None
        self.refuse = False
        self._held: list[tuple[socket.socket, bytes]] = []
        self._lock = threading.Lock()
        self._listener = socket.socket(socket.AF_UNIX)
        self._listener.bind(f"{self._dir}/.s.PGSQL.5432")
        self._listener.listen(16)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self.refuse:
                client.close()
                continue
            family = socket.AF_UNIX if isinstance(self._target, str) else socket.AF_INET
            server = socket.socket(family)
            server.connect(self._target)
            threading.Thread(target=self._pump, args=(client, server, True),
                             daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False),
                             daemon=True).start()

    def _take(self, wanted: tuple[str, ...]) -> str | None:
        with self._lock:
            if self.mode in wanted:
                mode, self.mode = self.mode, None
                return mode
            return None

    def _pump(self, source: socket.socket, sink: socket.socket, request: bool) -> None:
        client, server = (source, sink) if request else (sink, source)
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                mode = self._take(("drop_request", "hold_request") if request
                                  else ("drop_reply",))
                if mode is None:
                    sink.sendall(data)
                    continue
                _hang_up(client)
                if mode == "hold_request":
                    self._held.append((server, data))
                    return
                break
        for end in (source, sink):
            if all(end is not held for held, _ in self._held):
                _hang_up(end)

    def release(self, *, deliver: bool = False) -> None:
        """Hang up on the server's side of held connections (their transactions end);
        with ``deliver``, first hand the server the request that was held back (it arrives
        late: a server process still listening runs it)."""
        for held, data in self._held:
            if deliver:
                with contextlib.suppress(OSError):
                    held.sendall(data)
                time.sleep(0.2)  # let a live server process run it
            _hang_up(held)
        self._held.clear()

    def close(self) -> None:
        self.release()
        _hang_up(self._listener)
        shutil.rmtree(self._dir, ignore_errors=True)


def _hang_up(end: socket.socket) -> None:
    """Shut a socket down (which also wakes a thread blocked reading it) and close it."""
    with contextlib.suppress(OSError):
        end.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        end.close()


@pytest.fixture
def proxy(pg_dsn: str) -> Iterator[_Proxy]:
    opened = _Proxy(pg_dsn)
    yield opened
    opened.close()


class _Counted:
    """How many statements inserting into the store's events table were ever run (a
    statement trigger bumps a sequence, which no rollback undoes): write attempts."""

    def __init__(self, dsn: str, schema: str) -> None:
        self.dsn, self.schema = dsn, schema
        s = f'"{schema}"'
        with _admin(dsn) as admin:
            admin.execute(f"CREATE SEQUENCE {s}.attempts")
            admin.execute(f"CREATE FUNCTION {s}.count_attempt() RETURNS trigger "
                          f"LANGUAGE plpgsql AS $$ BEGIN PERFORM nextval('{s}.attempts'); "
                          "RETURN NULL; END $$")
            admin.execute(f"CREATE TRIGGER count_attempts BEFORE INSERT ON {s}.events "
                          f"FOR EACH STATEMENT EXECUTE FUNCTION {s}.count_attempt()")

    def __call__(self) -> int:
        with _admin(self.dsn) as admin:
            row = admin.execute(f'SELECT last_value, is_called FROM "{self.schema}".attempts'
                                ).fetchone()
        assert row is not None
        return int(row[0]) if row[1] else 0


@pytest.fixture(params=["one-statement", "two-round-trips"])
def shape(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The two shapes of an append: events alone are one statement that is its own
    transaction (one round trip); with a snapshot (here on every append) it is ``BEGIN``,
    the statements, then ``COMMIT``."""
    if request.param == "two-round-trips":
        monkeypatch.setattr(controller_module, "SNAPSHOT_EVERY", 1)
    return str(request.param)


class _Terminates(PostgresEventStore):
    """Kills its own backend (pg_terminate_backend, from another connection) right before
    the next COMMIT (the one-statement append: right before it is sent), and waits until
    it is gone: the COMMIT then fails for real."""

    armed = False

    def _before_commit(self) -> None:
        if not self.armed:
            return
        self.armed = False
        pid = self._conn.info.backend_pid
        with _admin(self.dsn) as admin:
            assert admin.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone() == (
                True,)
            while admin.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s",
                                (pid,)).fetchone():
                time.sleep(0.01)


class _Armed(PostgresEventStore):
    """Arms its proxy right before the next COMMIT (the one-statement append: right
    before it is sent). ``unfenced`` forgets the connection's server process first, as a
    role without the right to signal it, or a pooler in between, would; ``elsewhere``
    makes the read-back find another server (its port differs): the read-back cannot
    fence either way."""

    def __init__(self, proxy: _Proxy, schema: str, **options: Any) -> None:
        super().__init__(proxy.dsn, schema=schema, **options)
        self.proxy = proxy
        self.arm: str | None = None
        self.refuse_readback = False
        self.unfenced = False
        self.elsewhere = False

    def _before_commit(self) -> None:
        if self.arm is not None:
            # the next message must be the append's own: psycopg's automatic prepare
            # would send one of its own first
            self._conn.prepare_threshold = None
            self.proxy.mode, self.arm = self.arm, None
            self.proxy.refuse = self.refuse_readback
            if self.unfenced:
                self._backend = None
            if self.elsewhere and self._backend is not None:
                pid, started, server, addr, port = self._backend
                self._backend = (pid, started, server, addr, str(int(port) + 1))


def test_a_commit_that_failed_for_real_is_not_written_and_never_retried(
        pg_dsn: str, pg_schema: str, shape: str) -> None:
    store = _Terminates(pg_dsn, schema=pg_schema)
    c = at_interruption(store=store)
    attempts = _Counted(pg_dsn, pg_schema)
    store.armed = True
    error = assert_refused(c, StorageError, c.approve, "charge")
    assert error.outcome == "not_written"
    assert "terminating connection due to administrator command" in error.reason
    # two round trips: the INSERT ran before the COMMIT failed; one statement: the server
    # process was gone before it was sent. Either way the read-back decided, no retry.
    assert attempts() == (1 if shape == "two-round-trips" else 0)
    assert RunController.load(store, "run-1").state == c.state  # the same store reconnects
    c.approve("charge")  # not_written: the controller is unchanged and may go on
    assert RunController.load(store, "run-1").state == c.state
    assert attempts() == (2 if shape == "two-round-trips" else 1)
    store.close()


@pytest.mark.parametrize("first", [False, True], ids=["later-append", "first-append"])
def test_a_commit_that_landed_but_lost_its_answer_is_classified_as_appended(
        proxy: _Proxy, pg_dsn: str, pg_schema: str, first: bool, shape: str) -> None:
    store = _Armed(proxy, pg_schema)
    if first:
        store.load("x")  # the tables exist
        attempts = _Counted(pg_dsn, pg_schema)
        store.arm = "drop_reply"
        c = RunController.start(run_id="run-1", session_id="s", store=store)
    else:
        c = at_interruption(store=store)
        attempts = _Counted(pg_dsn, pg_schema)
        store.arm = "drop_reply"
        c.approve("charge")  # the COMMIT raised; the read-back found the batch
    assert proxy.mode is None  # the answer was lost for real
    assert attempts() == 1  # and the append was not retried
    with PostgresEventStore(pg_dsn, schema=pg_schema) as direct:
        assert direct.load("run-1") == list(c.events)
        assert RunController.load(direct, "run-1").state == c.state
    if first:
        c.hook_ran("agent_start")  # the same controller and store go on
    else:
        c.approve("audit")
    assert RunController.load(store, "run-1").state == c.state
    store.close()


def test_a_commit_request_that_never_arrived_is_not_written(
        proxy: _Proxy, pg_dsn: str, pg_schema: str, shape: str) -> None:
    store = _Armed(proxy, pg_schema)
    c = at_interruption(store=store)
    attempts = _Counted(pg_dsn, pg_schema)
    store.arm = "drop_request"
    error = assert_refused(c, StorageError, c.approve, "charge")
    assert error.outcome == "not_written"
    assert attempts() == (1 if shape == "two-round-trips" else 0)
    with PostgresEventStore(pg_dsn, schema=pg_schema) as direct:
        assert direct.load("run-1") == list(c.events)
    c.approve("charge")
    assert RunController.load(store, "run-1").state == c.state
    store.close()


def test_a_read_back_that_cannot_decide_is_unknown(proxy: _Proxy, pg_dsn: str,
                                                   pg_schema: str, shape: str) -> None:
    store = _Armed(proxy, pg_schema, readback_timeout=1.0)
    c = at_interruption(store=store)
    attempts = _Counted(pg_dsn, pg_schema)
    store.arm, store.refuse_readback = "drop_reply", True  # landed; no way to read back
    with pytest.raises(StorageError) as info:
        c.approve("charge")
    assert info.value.outcome == "unknown"
    assert attempts() == 1
    proxy.refuse = False
    reloaded = RunController.load(store, "run-1")  # loading again is the way on
    assert reloaded.pending_approvals == ("notify", "audit")  # it had landed
    reloaded.approve("audit")
    store.close()


def _held_command(store: PostgresEventStore, c: RunController | None) -> None:
    """The command whose request is held: a run's first append (no run yet), or an
    approval of the paused run ``c``."""
    if c is None:
        RunController.start(run_id="run-1", session_id="s", store=store)
    else:
        c.approve("charge")


def _nothing_landed_and_the_run_goes_on(store: PostgresEventStore,
                                        c: RunController | None) -> None:
    if c is None:
        assert store.load("run-1") == []
        RunController.start(run_id="run-1", session_id="s", store=store)
    else:
        reloaded = RunController.load(store, "run-1")
        assert reloaded.pending_approvals == ("charge", "notify", "audit")
        reloaded.approve("charge")


@pytest.mark.parametrize("first", [False, True], ids=["later-append", "first-append"])
def test_a_request_held_in_flight_is_fenced_and_never_lands_late(
        proxy: _Proxy, pg_dsn: str, pg_schema: str, first: bool, shape: str) -> None:
    """The request (the COMMIT, or the one statement) is held back on the way and the
    client's connection is lost: the read-back first ends the lost connection's server
    process, so the verdict is final: "not_written". The held request, delivered late,
    then finds no one to run it."""
    store = _Armed(proxy, pg_schema, readback_timeout=5.0)
    store.load("x")
    c = None if first else at_interruption(store=store)
    attempts = _Counted(pg_dsn, pg_schema)

    store.arm = "hold_request"
    with pytest.raises(StorageError) as info:
        _held_command(store, c)
    assert info.value.outcome == "not_written"
    proxy.release(deliver=True)  # the held request arrives late
    # a run's first append carries no snapshot: it is one statement in either shape
    assert attempts() == (1 if shape == "two-round-trips" and not first else 0)
    _nothing_landed_and_the_run_goes_on(store, c)
    store.close()


@pytest.mark.parametrize("why", ["unfenced", "elsewhere"])
@pytest.mark.parametrize("first", [False, True], ids=["later-append", "first-append"])
def test_without_a_fence_the_read_back_waits_and_never_guesses(
        proxy: _Proxy, pg_dsn: str, pg_schema: str, first: bool, shape: str,
        why: str) -> None:
    """The read-back may not end the lost connection's server process (no right to signal
    it). Two round trips: the server's transaction stays open holding the run's head; a
    read-back now would see "not there" and could be wrong a moment later, so it waits for
    the head's lock, up to ``readback_timeout``: "unknown". One statement: not found
    proves nothing (the request may still arrive): "unknown" at once."""
    store = _Armed(proxy, pg_schema, readback_timeout=0.5)
    store.load("x")
    c = None if first else at_interruption(store=store)

    store.arm = "hold_request"
    setattr(store, why, True)
    started = time.monotonic()
    with pytest.raises(StorageError) as info:
        _held_command(store, c)
    assert info.value.outcome == "unknown"
    if shape == "two-round-trips" and not first:  # (a first append is one statement)
        assert time.monotonic() - started >= 0.5
    proxy.release()  # the server's side hangs up: the open transaction rolls back
    with _admin(pg_dsn) as admin:
        deadline = time.monotonic() + 30
        while admin.execute("SELECT count(*) FROM pg_stat_activity WHERE state LIKE "
                            "'idle in transaction%%'").fetchone() != (0,):
            assert time.monotonic() < deadline
            time.sleep(0.01)
    _nothing_landed_and_the_run_goes_on(store, c)
    store.close()


# ------------------------------------------------------------------ a server restart


def test_a_server_restart_mid_run_fails_one_command_then_the_run_goes_on(
        pg_server: pg_cluster.Cluster | None, pg_dsn: str, pg_schema: str) -> None:
    if pg_server is None:
        pytest.skip(pg_cluster.EXTERNAL_SKIP)
    store = PostgresEventStore(pg_dsn, schema=pg_schema)
    c = at_interruption(store=store)
    c.approve("charge", fingerprint=c.fingerprint("charge"))
    pg_server.restart()
    error = assert_refused(c, StorageError, c.approve, "audit")
    assert error.outcome == "not_written"
    loaded = RunController.load(store, "run-1")  # the same store object, a new connection
    assert loaded.state == c.state
    loaded.approve("audit")
    loaded.resume()
    loaded.begin_tool("charge")
    loaded.tool_completed("charge", "charged 7")
    assert RunController.load(store, "run-1").state == loaded.state
    assert store.list_runs()[0].step is loaded.step
    store.close()


# ------------------------------------------------------------------ the async store


def test_the_async_store_keeps_the_same_contract(pg_dsn: str, pg_schema: str) -> None:
    c = at_interruption()
    c.claim("worker-1")
    events = list(c.events)

    async def go() -> None:
        async with AsyncPostgresEventStore(pg_dsn, schema=pg_schema) as store:
            assert isinstance(store, AsyncEventStore)
            assert await store.load("run-1") == []
            await store.append("run-1", events[:1], 0)
            await store.append("run-1", events[1:], 1, step=c.step)
            assert await store.load("run-1") == events
            with pytest.raises(ConcurrencyConflict):
                await store.append("run-1", [ev.ModelCallBegun(3)], 3)
            with pytest.raises(ConcurrencyConflict, match="already exists"):
                await store.append("run-1", events[:1], 0)
            await store.append("run-2", [_started("run-2", "other")], 0)
            heads = await store.list_runs()
            assert [(h.run_id, h.version, h.step, h.session_id, h.owner) for h in heads] == [
                ("run-1", len(events), Step.INTERRUPTION, "session-1", "worker-1"),
                ("run-2", 1, Step.RUN_AGAIN, "other", None)]
            assert [h.run_id for h in await store.list_runs("other")] == ["run-2"]
            assert await store.list_runs(steps={Step.COMPLETED}) == ()
            # a snapshot written with an append is used by load_latest
            snap = c.state.snapshot()
            approved = ev.CallApproved(len(events), "audit", c.fingerprint("audit"))
            await store.append("run-1", [approved], len(events), snapshot=snap)
            snapshot, tail = await store.load_latest("run-1")
            assert snapshot == snap
            assert [e.seq for e in tail] == [len(events)]
            # two writers from one version: exactly one appends
            async with AsyncPostgresEventStore(pg_dsn, schema=pg_schema) as other:
                version = len(events) + 1
                outcomes = await asyncio.gather(
                    store.append("run-1", [ev.ModelCallBegun(version)], version),
                    other.append("run-1", [ev.ModelCallBegun(version)], version),
                    return_exceptions=True)
                assert sorted(type(o).__name__ for o in outcomes) == [
                    "ConcurrencyConflict", "NoneType"]
                assert len(await other.load("run-1")) == version + 1
        with pytest.raises(StorageError, match="closed"):
            await store.load("run-1")

    asyncio.run(go())
    with PostgresEventStore(pg_dsn, schema=pg_schema) as sync:
        assert [e.seq for e in sync.load("run-1")] == list(range(len(events) + 2))


def test_the_async_store_classifies_a_lost_commit_answer(proxy: _Proxy, pg_dsn: str,
                                                         pg_schema: str) -> None:
    class Armed(AsyncPostgresEventStore):
        arm: str | None = None
        unfenced = False

        async def _before_commit(self) -> None:
            if self.arm is not None:
                self._conn.prepare_threshold = None  # (see _Armed)
                proxy.mode, self.arm = self.arm, None
                if self.unfenced:
                    self._backend = None

    events = list(at_interruption().events)
    later = [ev.HookRan(len(events), "agent_start", None)]

    async def go() -> None:
        async with Armed(proxy.dsn, schema=pg_schema, readback_timeout=0.5) as store:
            await store.append("run-1", events[:2], 0)
            attempts = _Counted(pg_dsn, pg_schema)
            store.arm = "drop_reply"
            await store.append("run-1", events[2:4], 2)  # landed: classified as appended
            store.arm = "drop_request"
            with pytest.raises(StorageError) as info:
                await store.append("run-1", events[4:], 4)
            assert info.value.outcome == "not_written"
            assert attempts() == 1  # events alone: one statement, which never arrived
            assert await store.load("run-1") == events[:4]
            await store.append("run-1", events[4:], 4)
            assert await store.load("run-1") == events
            # held, and no fence: one statement not found proves nothing
            store.arm, store.unfenced = "hold_request", True
            with pytest.raises(StorageError) as info:
                await store.append("run-1", later, len(events))
            assert info.value.outcome == "unknown"
            proxy.release()
            assert await store.load("run-1") == events

    asyncio.run(go())


# ------------------------------------------------------------------ measurement


def test_measure_appends_against_a_bare_psycopg_loop(pg_dsn: str, pg_schema: str) -> None:
    """Not a timed test (DESIGN §5): prints appends per second of `PostgresEventStore`
    (one event per transaction, encoding and the run head included) and of a bare psycopg
    loop on the same connection settings writing the same event rows, alone and with
    the head's UPDATE too. ``STATEMACHINE_PG_APPENDS`` sets the count."""
    appends = int(os.environ.get("STATEMACHINE_PG_APPENDS", "300"))
    events: list[ev.Event] = [_started("r")]
    events += [ev.HookRan(i, "tool_start", f"call-{i}") for i in range(1, appends)]
    s = f'"{pg_schema}"'
    rounds: dict[str, list[float]] = {"store": [], "bare": [], "bare+head": []}
    with PostgresEventStore(pg_dsn, schema=pg_schema) as store, \
            psycopg.connect(pg_dsn, autocommit=True) as conn:
        store.load("warm-up")
        conn.execute(f"CREATE TABLE {s}.bare (run_id text COLLATE \"C\" NOT NULL, "
                     "seq bigint NOT NULL, batch_id text NOT NULL, body text NOT NULL, "
                     "PRIMARY KEY (run_id, seq))")
        conn.execute(f"CREATE TABLE {s}.bare_head (run_id text PRIMARY KEY, version bigint)")
        for repeat in range(5):
            run_id = f"r{repeat}"
            rows = [(run_id, e.seq, uuid.uuid4().hex, _dumps(codec.encode_event(e)))
                    for e in events]
            began = time.perf_counter()
            for e in events:
                store.append(run_id, (e,), e.seq, step=Step.RUN_AGAIN)
            rounds["store"].append(appends / (time.perf_counter() - began))
            began = time.perf_counter()
            for row in rows:
                conn.execute("BEGIN")
                conn.execute(f"INSERT INTO {s}.bare VALUES (%s, %s, %s, %s)", row)
                conn.execute("COMMIT")
            rounds["bare"].append(appends / (time.perf_counter() - began))
            conn.execute(f"INSERT INTO {s}.bare_head VALUES (%s, 0)", (run_id,))
            began = time.perf_counter()
            for row in rows:
                conn.execute("BEGIN")
                conn.execute(f"UPDATE {s}.bare_head SET version = %s WHERE run_id = %s",
                             (row[1] + 1, run_id))
                conn.execute(f"INSERT INTO {s}.bare VALUES (%s, %s, %s, %s)",
                             (f"h{run_id}", *row[1:]))
                conn.execute("COMMIT")
            rounds["bare+head"].append(appends / (time.perf_counter() - began))
    rate = {name: statistics.median(values) for name, values in rounds.items()}
    print(f"\nPostgreSQL, one event per transaction ({appends} appends, median of 5): "
          f"store {rate['store']:.0f}/s ({1e6 / rate['store']:.0f} us/append); bare "
          f"psycopg INSERT {rate['bare']:.0f}/s = {rate['store'] / rate['bare']:.2f}x; "
          f"bare INSERT + head UPDATE {rate['bare+head']:.0f}/s = "
          f"{rate['store'] / rate['bare+head']:.2f}x")
    assert all(value > 0 for value in rate.values())


def test_behind_a_pooler_there_is_nothing_to_fence() -> None:
    """A pooler or a proxy that answers for the server announces a process of its own at
    connect: the store then keeps no server process to fence (a lost one-statement append
    is "unknown", never guessed "not_written")."""
    from types import SimpleNamespace

    from statemachine.postgres.steps import backend_of

    row = (4242, datetime.datetime(2026, 1, 1), datetime.datetime(2025, 12, 1), None, "5432")
    direct = SimpleNamespace(info=SimpleNamespace(backend_pid=4242))
    pooled = SimpleNamespace(info=SimpleNamespace(backend_pid=77))
    assert backend_of(direct, row) == row
    assert backend_of(pooled, row) is None
    assert backend_of(direct, None) is None


def test_a_version_2_schema_is_upgraded_in_place_and_read_as_it_is_when_read_only(
        pg_dsn: str, pg_schema: str) -> None:
    # PG06: a version 2 schema (no runs.updated_at, events without time) opens: a
    # read-only store reads NULL times and changes nothing; a writer adds the column
    s = f'"{pg_schema}"'
    with PostgresEventStore(pg_dsn, schema=pg_schema) as store:
        at_interruption(store=store)
    with _admin(pg_dsn) as admin:
        admin.execute(f"ALTER TABLE {s}.runs DROP COLUMN updated_at, DROP COLUMN lease_owner, "
                      "DROP COLUMN lease_until, DROP COLUMN lease, DROP COLUMN read_model, "
                      "DROP COLUMN blocker")
        admin.execute(f"UPDATE {s}.statemachine_schema SET version = 2")
        for seq, body in admin.execute(f"SELECT seq, body FROM {s}.events").fetchall():
            old = {k: v for k, v in json.loads(body).items()
                   if k not in ("at", "by", "reason", "lease")}
            admin.execute(f"UPDATE {s}.events SET body = %s WHERE seq = %s",
                          (json.dumps(old, separators=(",", ":")), seq))
        admin.execute(f"DELETE FROM {s}.snapshots")
    with PostgresEventStore(pg_dsn, schema=pg_schema, readonly=True) as readonly:
        assert [(h.step, h.updated_at) for h in readonly.list_runs()] == [
            (Step.INTERRUPTION, None)]
        assert all(e.at is None for e in RunController.load(readonly, "run-1").events)
    with _admin(pg_dsn) as admin:
        assert admin.execute(f"SELECT version FROM {s}.statemachine_schema").fetchall() == [
            (2,)]
    with PostgresEventStore(pg_dsn, schema=pg_schema) as store:
        assert [h.updated_at for h in store.list_runs()] == [None]
        c = RunController.load(store, "run-1", clock=lambda: 77)
        c.approve("charge", by="alice")
        assert [h.updated_at for h in store.list_runs()] == [77]
    with _admin(pg_dsn) as admin:
        assert admin.execute(f"SELECT version FROM {s}.statemachine_schema").fetchall() == [
            (SCHEMA_VERSION,)] == [(5,)]


def test_a_version_3_schema_gains_the_lease_columns_in_place(pg_dsn: str,
                                                              pg_schema: str) -> None:
    # a version 3 schema (heads without leases) opens: a read-only store reads no
    # lease and changes nothing; a writer adds the columns and keeps leases from then on
    s = f'"{pg_schema}"'
    with PostgresEventStore(pg_dsn, schema=pg_schema) as store:
        at_interruption(store=store).claim("worker-a")
    with _admin(pg_dsn) as admin:
        admin.execute(f"ALTER TABLE {s}.runs DROP COLUMN lease_owner, "
                      "DROP COLUMN lease_until, DROP COLUMN lease, DROP COLUMN read_model, "
                      "DROP COLUMN blocker")
        admin.execute(f"UPDATE {s}.statemachine_schema SET version = 3")
    with PostgresEventStore(pg_dsn, schema=pg_schema, readonly=True) as readonly:
        assert [(h.owner, h.lease_owner, h.lease_until, h.updated_at is None)
                for h in readonly.list_runs()] == [("worker-a", None, None, False)]
    with _admin(pg_dsn) as admin:
        assert admin.execute(f"SELECT version FROM {s}.statemachine_schema").fetchall() == [
            (3,)]
    with PostgresEventStore(pg_dsn, schema=pg_schema) as store:
        RunController.load(store, "run-1").claim("worker-b", lease=30)
        assert [h.lease_owner for h in store.list_runs()] == ["worker-b"]
        with pytest.raises(LeaseHeld):
            RunController.load(store, "run-1").claim("worker-a")
    with _admin(pg_dsn) as admin:
        assert admin.execute(f"SELECT version FROM {s}.statemachine_schema").fetchall() == [
            (SCHEMA_VERSION,)]
