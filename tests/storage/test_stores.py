"""The event-store contract (`statemachine.testing.contracts.EventStoreContract`) run
against each of our stores, then what only SQLite promises: durable pragmas, two fresh
interpreters racing on one file, and appends whose outcome is unknown."""

from __future__ import annotations

import asyncio
import inspect
import json
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from statemachine import MemoryEventStore, RunController, SchemaError, Step, StorageError, sqlite
from statemachine import controller as controller_module
from statemachine import events as ev
from statemachine.stores import EventStore, SQLiteEventStore
from statemachine.testing.contracts import EventStoreContract
from tests.helpers import SESSION, StoreMaker, assert_refused, at_interruption

ROOT = Path(__file__).resolve().parents[2]


class TestMemoryEventStore(EventStoreContract):
    def make_store(self, tmp_path: Path) -> EventStore:
        return MemoryEventStore()


class TestSQLiteEventStore(EventStoreContract):
    def make_store(self, tmp_path: Path) -> EventStore:
        return SQLiteEventStore(tmp_path / "events.db")

    def open_again(self, tmp_path: Path) -> EventStore:
        return SQLiteEventStore(tmp_path / "events.db")

    def test_is_durable_on_disk_with_the_promised_pragmas(self, tmp_path: Path) -> None:
        path = tmp_path / "events.db"
        first = SQLiteEventStore(path)
        c = at_interruption(store=first)
        first.close()
        second = SQLiteEventStore(path)
        assert RunController.load(second, "run-1").state == c.state
        conn = second._conn
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
        with sqlite3.connect(path) as raw, pytest.raises(sqlite3.IntegrityError):
            raw.execute("INSERT INTO events VALUES ('run-1', 0, 'x', '{}')")

    def test_two_processes_on_one_file_cannot_both_act(self, tmp_path: Path) -> None:
        path = tmp_path / "events.db"
        at_interruption(store=SQLiteEventStore(path))
        script = (
            "import sys, time\n"
            "from statemachine import RunController, ConcurrencyConflict\n"
            "from statemachine.stores import SQLiteEventStore\n"
            "c = RunController.load(SQLiteEventStore(sys.argv[1]), 'run-1')\n"
            "open(sys.argv[3], 'w').close()\n"
            "while not __import__('os').path.exists(sys.argv[4]): time.sleep(0.005)\n"
            "try:\n    c.approve(sys.argv[2]); print('approved')\n"
            "except ConcurrencyConflict: print('conflict')\n"
        )
        go = tmp_path / "go"
        procs = [subprocess.Popen([sys.executable, "-c", script, str(path), call_id,
                                   str(tmp_path / f"ready-{call_id}"), str(go)],
                                  stdout=subprocess.PIPE, text=True, cwd=ROOT)
                 for call_id in ("charge", "notify")]
        for call_id in ("charge", "notify"):
            while not (tmp_path / f"ready-{call_id}").exists():
                threading.Event().wait(0.005)
        go.touch()
        outputs = sorted(p.communicate(timeout=60)[0].strip() for p in procs)
        assert outputs == ["approved", "conflict"]
        assert len(SQLiteEventStore(path).load("run-1")) == 7

    def test_an_append_whose_commit_answer_was_lost_is_classified_by_read_back(
        self, tmp_path: Path
    ) -> None:
        class LostAnswer(SQLiteEventStore):
            """COMMIT lands, then the connection reports an error."""

            def _connect(self) -> sqlite3.Connection:
                conn = sqlite3.connect(self.path, isolation_level=None,
                                       check_same_thread=False, factory=_LosesCommitAnswer)
                conn.execute("PRAGMA journal_mode=WAL")
                return conn

        store = LostAnswer(tmp_path / "events.db")
        c = at_interruption(store=store)
        _LOSE_COMMIT_ANSWER.set()
        try:
            c.approve("charge")  # the commit landed: classified as appended, no retry
        finally:
            _LOSE_COMMIT_ANSWER.clear()
        assert RunController.load(store, "run-1").state == c.state
        assert store.load("run-1")[-1] == c.events[-1]

    def test_an_append_that_did_not_land_raises_and_leaves_the_run_unchanged(
        self, tmp_path: Path
    ) -> None:
        class Refusing(SQLiteEventStore):
            def _landed(self, batch_id: str) -> bool:
                return False

        store = Refusing(tmp_path / "events.db")
        c = at_interruption(store=store)
        original = store._conn
        store._conn = _Broken(original)
        refused = assert_refused(c, StorageError, c.approve, "charge")
        assert refused.outcome == "not_written"
        assert RunController.load(store, "run-1").state == c.state


def test_a_memory_stores_log_is_not_the_callers_list() -> None:
    # SS04: what load returns is the caller's; changing it changes nothing stored
    store = MemoryEventStore()
    RunController.start(run_id="r", session_id=None, store=store).add_input(["x"])
    log = store.load("r")
    log.clear()
    assert [type(e) for e in store.load("r")] == [ev.RunStarted, ev.InputAdded]
    assert RunController.load(store, "r").version == 2


@pytest.mark.parametrize("kind", ["memory", "sqlite",
                                  pytest.param("postgres", marks=pytest.mark.postgres)])
def test_a_run_heads_owner_is_its_last_claims(kind: str, tmp_path: Path,
                                              request: pytest.FixtureRequest) -> None:
    # SS03, SS08, PG03: RunHead.owner is the owner of the run's last RunClaimed, whatever
    # was appended after it
    store: Any
    if kind == "memory":
        store = MemoryEventStore()
    elif kind == "sqlite":
        store = SQLiteEventStore(tmp_path / "e.db")
    else:
        from statemachine.postgres import PostgresEventStore

        store = PostgresEventStore(request.getfixturevalue("pg_dsn"),
                                   schema=request.getfixturevalue("pg_schema"))

    def owner() -> str | None:
        (head,) = store.list_runs()
        found: str | None = head.owner
        return found

    try:
        c = RunController.start(run_id="owned", session_id=SESSION, store=store)
        assert owner() is None
        for who in ("worker-1", "worker-2"):
            c = RunController.load(store, "owned")
            c.claim(who)
            assert owner() == who
            c.add_input(["more"])  # an append without a claim keeps the owner
            assert owner() == who
        c.claim(None)
        assert owner() is None
    finally:
        if kind != "memory":
            store.close()


@pytest.mark.parametrize("seq", [1, 3])
def test_clean_rows_whose_bodies_carry_other_seqs_are_refused(tmp_path: Path, seq: int) -> None:
    """A log is never other than its rows: a body in the store's own compact form (so the
    rows decode together) that carries another seq than its row is damage, refused."""
    path = tmp_path / "e.db"
    store = SQLiteEventStore(path)
    c = RunController.start(run_id="r", session_id=None, store=store)
    c.add_input(["a"])
    c.add_input(["b"])
    store.close()
    raw = sqlite3.connect(path)
    (body,) = raw.execute("SELECT body FROM events WHERE seq = 2").fetchone()
    forged = body.replace('"seq":2', f'"seq":{seq}', 1)
    assert forged != body
    raw.execute("UPDATE events SET body = ? WHERE seq = 2", (forged,))
    raw.commit()
    raw.close()
    reopened = SQLiteEventStore(path)
    try:
        with pytest.raises(SchemaError, match="carries seq"):
            reopened.load("r")
        with pytest.raises(SchemaError, match="carries seq"):
            RunController.load(reopened, "r")
    finally:
        reopened.close()


_LOSE_COMMIT_ANSWER = threading.Event()


class _LosesCommitAnswer(sqlite3.Connection):
    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
        cursor = super().execute(sql, *args)
        if sql == "COMMIT" and _LOSE_COMMIT_ANSWER.is_set():
            raise sqlite3.OperationalError("disk I/O error")
        return cursor


class _Broken:
    """A connection whose COMMIT fails for real (rolled back: nothing lands)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def execute(self, sql: str, *args: Any) -> Any:
        if sql == "COMMIT":
            self._conn.execute("ROLLBACK")
            raise sqlite3.OperationalError("disk I/O error")
        return self._conn.execute(sql, *args)

    def executemany(self, sql: str, rows: Any) -> Any:
        return self._conn.executemany(sql, rows)

    def close(self) -> None:
        self._conn.close()


def test_snapshots_are_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(controller_module, "SNAPSHOT_EVERY", 2)
    store = MemoryEventStore()
    c = at_interruption(store=store)
    assert c.step is Step.INTERRUPTION
    snapshot, _ = store.load_latest("run-1")
    assert snapshot is not None
    assert json.loads(json.dumps(snapshot)) == snapshot


def test_sqlite_connections_sync_every_commit(tmp_path: Path) -> None:
    # SQ01: synchronous=FULL (2) in WAL mode: an acknowledged commit survives a power cut
    conn = sqlite.connect(tmp_path / "db.sqlite", timeout=1.0)
    try:
        assert conn.execute("PRAGMA synchronous").fetchone()[0] == 2
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        conn.close()


def test_a_write_transaction_holds_the_write_lock_from_its_start(tmp_path: Path) -> None:
    # SQ02: BEGIN IMMEDIATE, so a check-then-write (an append's version check) cannot
    # interleave with another writer's: the second writer waits at its BEGIN
    path = tmp_path / "db.sqlite"
    first = sqlite.connect(path, timeout=5.0)
    second = sqlite.connect(path, timeout=0.05)
    try:
        first.execute("CREATE TABLE t (x INTEGER)")
        with sqlite.write_transaction(first):
            first.execute("SELECT COUNT(*) FROM t").fetchone()  # a read, no write yet
            with pytest.raises(sqlite3.OperationalError, match="locked"), \
                    sqlite.write_transaction(second):
                pass
        with sqlite.write_transaction(second):
            second.execute("INSERT INTO t VALUES (1)")
    finally:
        first.close()
        second.close()


# ------------------------------------------------- the head's time (DESIGN §7.2)


class _Ticks:
    def __init__(self, start: int) -> None:
        self.next = start

    def __call__(self) -> int:
        self.next += 1
        return self.next - 1


def _store_of(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> Any:
    if kind == "memory":
        return MemoryEventStore()
    if kind == "sqlite":
        return SQLiteEventStore(tmp_path / "e.db")
    from statemachine.postgres import PostgresEventStore

    return PostgresEventStore(request.getfixturevalue("pg_dsn"),
                              schema=request.getfixturevalue("pg_schema"))


@pytest.mark.parametrize("kind", ["memory", "sqlite",
                                  pytest.param("postgres", marks=pytest.mark.postgres)])
@pytest.mark.parametrize("buffered", [False, True], ids=["per-command", "buffered"])
def test_a_run_heads_updated_at_is_its_newest_events_at(
        kind: str, buffered: bool, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    # SS09, SQ13, PG05: RunHead.updated_at is the at of the newest event, whatever appended
    store = _store_of(kind, tmp_path, request)

    def updated_at() -> int | None:
        (head,) = store.list_runs()
        found: int | None = head.updated_at
        return found

    try:
        c = RunController.start(run_id="timed", session_id=SESSION, store=store,
                                clock=_Ticks(10**15), buffered=buffered)
        c.flush()
        assert updated_at() == 10**15
        c.hook_ran("agent_start")  # a step that moves nothing but the time
        c.begin_model_call()
        c.flush()
        assert updated_at() == 10**15 + 2 == store.load("timed")[-1].at
        again = RunController.load(store, "timed", clock=_Ticks(2 * 10**15),
                                   buffered=buffered)
        assert updated_at() == 10**15 + 2  # loading records nothing
        again.claim("worker")
        again.flush()
        assert updated_at() == 2 * 10**15
        # events appended directly, without a time: the head says so
        store.append("timed", [ev.RunClaimed(again.version, "direct")], again.version,
                     **({"step": Step.AWAITING_MODEL} if kind != "memory" else {}))
        assert updated_at() is None
    finally:
        if kind != "memory":
            store.close()


def _as_previous_version(path: Path) -> None:
    """Make ``path`` what the previous version left: its runs table without
    ``updated_at`` and its events without time (version 2 bodies)."""
    with sqlite3.connect(path) as raw:
        raw.execute("ALTER TABLE runs DROP COLUMN updated_at")
        for seq, body in raw.execute("SELECT seq, body FROM events").fetchall():
            event = {k: v for k, v in json.loads(body).items()
                     if k not in ("at", "by", "reason")}
            raw.execute("UPDATE events SET body = ? WHERE seq = ?",
                        (json.dumps(event, separators=(",", ":")), seq))
        raw.execute("DELETE FROM snapshots")


def test_a_database_of_the_previous_version_opens_and_its_heads_gain_updated_at(
        tmp_path: Path) -> None:
    # SQ14: the column is added in place (NULL: its runs were written without time);
    # a read-only look reads NULL without adding anything
    path = tmp_path / "old.db"
    first = SQLiteEventStore(path)
    at_interruption(store=first)
    first.close()
    _as_previous_version(path)
    readonly = SQLiteEventStore(path, readonly=True)
    assert [(h.run_id, h.step, h.updated_at) for h in readonly.list_runs()] == [
        ("run-1", Step.INTERRUPTION, None)]
    readonly.close()
    with sqlite3.connect(path) as raw:
        assert "updated_at" not in {r[1] for r in raw.execute("PRAGMA table_info(runs)")}
    store = SQLiteEventStore(path)
    with sqlite3.connect(path) as raw:
        assert "updated_at" in {r[1] for r in raw.execute("PRAGMA table_info(runs)")}
    assert [h.updated_at for h in store.list_runs()] == [None]
    c = RunController.load(store, "run-1", clock=lambda: 42)
    assert all(e.at is None for e in c.events)
    c.approve("charge", by="alice")
    assert [h.updated_at for h in store.list_runs()] == [42]
    assert SQLiteEventStore(path).list_runs()[0].updated_at == 42  # opened again: as is


def test_an_append_to_a_run_logged_without_a_head_gives_it_one(tmp_path: Path) -> None:
    # SQ32, SQ33: a run whose log has no head (an older writer logged it while this
    # store was open) gains one with the append's version, its owner and Session read
    # off the log; a run with a head has it moved, never a second one made
    path = tmp_path / "events.db"
    store = SQLiteEventStore(path)
    c = at_interruption(store=store)
    c.claim("worker-1")
    with sqlite3.connect(path) as raw:
        raw.execute("DELETE FROM runs WHERE run_id = 'run-1'")
    c.approve("charge")
    with sqlite3.connect(path) as raw:
        heads = raw.execute("SELECT version, owner, session_id FROM runs WHERE run_id = "
                            "'run-1'").fetchall()
        logged = raw.execute("SELECT COUNT(*) FROM events WHERE run_id = 'run-1'").fetchone()
    assert heads == [(logged[0], "worker-1", SESSION)]
    c.approve("audit")  # and the head now there is moved
    (head,) = SQLiteEventStore(path).list_runs()
    assert (head.run_id, head.version, head.owner) == ("run-1", c.version, "worker-1")


def test_a_head_time_that_is_not_an_integer_is_a_schema_error(tmp_path: Path) -> None:
    path = tmp_path / "e.db"
    store = SQLiteEventStore(path)
    at_interruption(store=store)
    with sqlite3.connect(path) as raw:
        raw.execute("UPDATE runs SET updated_at = 'yesterday'")
    with pytest.raises(SchemaError, match="time that is not an integer"):
        store.list_runs()


def test_an_appends_events_are_read_once(make: StoreMaker) -> None:
    """Every store reads an append's events once, so events given as a one-shot iterator
    (a caller's generator) land whole, and ones whose sequence numbers do not follow
    ``expected_version`` are refused (`ValueError`) with nothing written, the memory
    store too. Read twice, the second read found the iterator empty: SQLite wrote the
    rows and left the run's head behind them (the run then neither loaded nor took
    another append), PostgreSQL wrote nothing and said the append landed."""
    events = list(at_interruption().events)

    async def body() -> None:
        store = make()
        try:
            with pytest.raises(ValueError, match="sequence numbers"):
                await _maybe(store.append("run-1", (e for e in events[1:]), 0))
            assert await _maybe(store.list_runs()) == ()  # nothing written
            await _maybe(store.append("run-1", (e for e in events[:3]), 0))
            await _maybe(store.append("run-1", (e for e in events[3:]), 3))
            assert list(await _maybe(store.load("run-1"))) == events
            assert await _maybe(store.version("run-1")) == len(events)
            with pytest.raises(ValueError, match="sequence numbers"):
                await _maybe(store.append("run-1", iter([events[-1]]), len(events)))
            assert list(await _maybe(store.load("run-1"))) == events
        finally:
            closing = getattr(store, "close", None)
            if closing is not None:
                await _maybe(closing())

    asyncio.run(body())


async def _maybe(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value
