"""Storage faults are typed (DESIGN §6.6): no `sqlite3` error or `OSError` escapes a public
call of the SQLite store, the SQLite Session or a controller. Each fault is a
`StorageError` with an ``outcome``: ``"not_written"`` leaves the controller exactly as it
was (nothing in ``events``, the state untouched) and the command can be retried;
``"unknown"`` makes the controller refuse every command until the run is loaded again.

One test per fault, each with the real fault where this machine allows it (a small
tmpfs for a full disk, a read-only bind mount), else the exact error SQLite raises,
injected at the connection: a locked database, a read-only one, a full disk, a file that
is not a database, a damaged one, a COMMIT that raises with a read-back that cannot
decide, a file deleted or replaced while open. Then the read-only store mode."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import sqlite3
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from statemachine import (
    ControlError,
    MemoryEventStore,
    RecoveryPolicy,
    RunController,
    RunNotFound,
    SQLiteEventStore,
    Step,
    StorageError,
)
from statemachine import events as ev
from statemachine.blocker import ReadModel
from statemachine.runner import publish
from statemachine.sessions import SQLiteSession
from statemachine.stores import Snapshot
from tests.helpers import B, assert_refused, at_interruption, run_charge, snapshot

RUN = "run-1"


class Faulty:
    """A connection that raises ``error`` for the statements ``fails`` picks (as SQLite
    would, before anything of the statement is done), and is the real one otherwise."""

    def __init__(self, conn: sqlite3.Connection, fails: Callable[[str], bool],
                 error: sqlite3.Error) -> None:
        self.conn = conn
        self.fails = fails
        self.error = error
        self.armed = True

    def _maybe_fail(self, sql: str) -> None:
        if self.armed and self.fails(sql):
            raise self.error

    def execute(self, sql: str, *args: Any) -> Any:
        self._maybe_fail(sql)
        return self.conn.execute(sql, *args)

    def executemany(self, sql: str, rows: Any) -> Any:
        self._maybe_fail(sql)
        return self.conn.executemany(sql, rows)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.conn, name)


def _writes(sql: str) -> bool:
    return sql.lstrip().upper().startswith(("INSERT", "UPDATE", "DELETE"))


def _tool_ran(store: SQLiteEventStore) -> RunController:
    """The field report's moment: charge started and ran; its result is to be recorded."""
    c = at_interruption(store=store)
    c.approve("charge")
    c.resume()
    c.begin_tool("charge")
    return c


def _unchanged_in_store(store: SQLiteEventStore, c: RunController) -> None:
    """The store holds exactly what the controller holds: nothing of a refusal landed."""
    assert [e.seq for e in store.load(RUN)] == [e.seq for e in c.events]
    assert RunController.load(store, RUN).state == c.state


def _mount(*args: str) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    done = subprocess.run(["mount", *args], capture_output=True, check=False)
    return done.returncode == 0


def _umount(path: Path) -> None:
    for _ in range(50):
        if subprocess.run(["umount", str(path)], capture_output=True,
                          check=False).returncode == 0:
            return
        time.sleep(0.05)
    subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


@contextlib.contextmanager
def small_disk(tmp_path: Path, size: str = "512k") -> Iterator[Path | None]:
    """A directory on a tmpfs of ``size`` (None where mounting is not permitted)."""
    where = tmp_path / "disk"
    where.mkdir()
    if not _mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)):
        yield None
        return
    try:
        yield where
    finally:
        _umount(where)


# --------------------------------------------------------------------- locked


def test_a_locked_database_is_not_written_and_the_command_goes_through_later(
        tmp_path: Path) -> None:
    """The field report: a 1 ms-ish busy timeout, the database locked by another writer
    right after a tool ran. The result is refused, typed, nothing recorded, the call still
    in flight here, and recorded once the lock is gone."""
    path = tmp_path / "events.db"
    store = SQLiteEventStore(path, timeout=0.05)
    c = _tool_ran(store)
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another process's write transaction
    try:
        refused = assert_refused(c, StorageError, c.tool_completed, "charge", "charged 7")
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert refused.outcome == "not_written"
    assert "locked" in str(refused)
    assert (refused.run_id, refused.step, refused.action) == (RUN, Step.TOOLS,
                                                              "tool_completed")
    assert isinstance(refused, ControlError)
    assert c.in_flight == ("charge",)
    _unchanged_in_store(store, c)
    c.tool_completed("charge", "charged 7")  # the lock is gone: it goes through
    assert RunController.load(store, RUN).state == c.state


def test_the_busy_timeout_waits_for_a_lock_instead_of_failing(tmp_path: Path) -> None:
    """Contention between a few writers queues: BEGIN IMMEDIATE waits out another's lock
    (here 0.3 s) within the busy timeout, on every connection the store opens."""
    path = tmp_path / "events.db"
    store = SQLiteEventStore(path, timeout=10.0)
    assert store._conn.execute("PRAGMA busy_timeout").fetchone()[0] == 10_000
    c = _tool_ran(store)
    other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")
    release = threading.Timer(0.3, lambda: other.execute("ROLLBACK"))
    release.start()
    began = time.monotonic()
    c.tool_completed("charge", "charged 7")
    assert time.monotonic() - began >= 0.25
    release.join()
    other.close()
    assert RunController.load(store, RUN).state == c.state


def test_the_read_back_probe_has_the_busy_timeout_too(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[float] = []
    real = sqlite3.connect

    def connect(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs.get("timeout", 5.0))
        return real(*args, **kwargs)

    store = SQLiteEventStore(tmp_path / "events.db", timeout=12.5)
    monkeypatch.setattr(sqlite3, "connect", connect)
    assert store._landed("no-such-batch") is False
    assert seen == [12.5]


# ------------------------------------------------------------------ read-only


def test_a_read_only_database_is_not_written(tmp_path: Path) -> None:
    """The store's file on a read-only mount (a read-only bind of its directory, while
    its writer keeps it open); where mounting is not permitted, SQLite's own read-only
    refusal (``PRAGMA query_only``, "attempt to write a readonly database")."""
    rw, ro = tmp_path / "rw", tmp_path / "ro"
    rw.mkdir()
    ro.mkdir()
    writer = SQLiteEventStore(rw / "events.db")
    at_interruption(store=writer)
    mounted = _mount("--bind", str(rw), str(ro)) and _mount(
        "-o", "remount,ro,bind", str(ro))
    try:
        if mounted:
            store = SQLiteEventStore(ro / "events.db")
        else:
            store = SQLiteEventStore(rw / "events.db")
            store._conn.execute("PRAGMA query_only = ON")
        c = RunController.load(store, RUN)
        refused = assert_refused(c, StorageError, c.approve, "charge")
        assert refused.outcome == "not_written"
        assert "read-only" in str(refused)
        _unchanged_in_store(writer, c)
    finally:
        store.close()
        writer.close()  # (SQLite keeps a closed connection's fd while another holds locks)
        if mounted:
            _umount(ro)
    writer = SQLiteEventStore(rw / "events.db")
    c = RunController.load(writer, RUN)
    c.approve("charge")  # writable again: it goes through
    writer.close()


def test_opening_a_store_on_a_read_only_filesystem_is_typed(tmp_path: Path) -> None:
    rw, ro = tmp_path / "rw", tmp_path / "ro"
    rw.mkdir()
    ro.mkdir()
    if not (_mount("--bind", str(rw), str(ro)) and _mount("-o", "remount,ro,bind",
                                                           str(ro))):
        # no mount here: a directory the store cannot create its file in
        target = tmp_path / "plain-file" / "events.db"
        (tmp_path / "plain-file").write_text("not a directory")
        with pytest.raises(StorageError) as info:
            SQLiteEventStore(target)
        assert info.value.outcome == "not_written"
        return
    try:
        with pytest.raises(StorageError) as info:
            SQLiteEventStore(ro / "events.db")  # a new store cannot be created there
        assert info.value.outcome == "not_written"
        assert not (ro / "events.db").exists()
    finally:
        _umount(ro)


# ------------------------------------------------------------------ full disk


def test_a_full_disk_is_not_written_and_the_command_goes_through_once_there_is_room(
        tmp_path: Path) -> None:
    """A store on a 512 KiB tmpfs filled up by the run itself; where mounting is not
    permitted, the exact error SQLite raises then, at the connection."""
    with small_disk(tmp_path) as disk:
        if disk is None:
            store = SQLiteEventStore(tmp_path / "events.db")
            c = at_interruption(store=store)
            store._conn = Faulty(store._conn, _writes,
                                 sqlite3.OperationalError("database or disk is full"))
            refused = assert_refused(c, StorageError, c.add_input, [{"big": "x" * 3000}])
            store._conn.armed = False
        else:
            room = disk / "room"
            room.write_bytes(b"\0" * 64 * 1024)  # freed later, to make room again
            store = SQLiteEventStore(disk / "events.db")
            c = at_interruption(store=store)
            for _ in range(1000):
                before = snapshot(c)
                try:
                    c.add_input([{"big": os.urandom(1500).hex()}])
                except StorageError as error:
                    refused = error
                    break
            else:
                pytest.fail("the disk never filled up")
            assert snapshot(c) == before
            room.unlink()
        assert refused.outcome == "not_written"
        assert "disk is full" in str(refused)
        _unchanged_in_store(store, c)
        c.add_input([{"small": 1}])  # there is room again: it goes through
        assert RunController.load(store, RUN).state == c.state
        store.close()


# ------------------------------------------------------- not a database, damaged


def test_a_file_that_is_not_a_database_is_typed(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    path.write_text("hello, I am not SQLite\n" * 200)
    for readonly in (False, True):
        with pytest.raises(StorageError, match="is not a SQLite database") as info:
            SQLiteEventStore(path, readonly=readonly)
        assert info.value.outcome == "not_written"
    session_file = tmp_path / "session.db"
    session_file.write_text("hello, I am not SQLite\n" * 200)
    with pytest.raises(StorageError, match="is not a SQLite database"):
        SQLiteSession("s", session_file)


def _damage(path: Path, start: int) -> None:
    """Seeded garbage over every byte from ``start`` (the 100-byte header kept)."""
    data = bytearray(path.read_bytes())
    rng = random.Random(11)
    data[start:] = bytes(rng.randrange(256) for _ in range(len(data) - start))
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("start", [100, 4096])
def test_a_damaged_database_is_typed(tmp_path: Path, start: int) -> None:
    """A valid SQLite header, garbage pages after it (from byte 100: the schema page too;
    from 4096: the tables' pages). Opening or loading is a StorageError, never sqlite3's."""
    path = tmp_path / "events.db"
    store = SQLiteEventStore(path)
    c = at_interruption(store=store)
    run_charge(c)
    store.close()
    _damage(path, start)
    for readonly in (False, True):
        with pytest.raises(StorageError, match=r"damaged|not a SQLite") as info:
            RunController.load(SQLiteEventStore(path, readonly=readonly), RUN)
        assert info.value.outcome == "not_written"


# ------------------------------------------------------- commit, then unknown


class _CommitRaises(SQLiteEventStore):
    """COMMIT raises (landing first when ``lands``); the read-back fails too."""

    lands = True
    probe_fails = True

    def _landed(self, batch_id: str) -> bool:
        if self.probe_fails:
            raise sqlite3.OperationalError("unable to open database file")
        return super()._landed(batch_id)


def _commit_raises(store: _CommitRaises) -> None:
    conn = store._conn

    class Wrapper(Faulty):
        def execute(self, sql: str, *args: Any) -> Any:
            if sql == "COMMIT" and self.armed:
                self.conn.execute("COMMIT" if store.lands else "ROLLBACK")
                raise sqlite3.OperationalError("disk I/O error")
            return self.conn.execute(sql, *args)

    store._conn = Wrapper(conn, lambda sql: False, sqlite3.OperationalError("unused"))


@pytest.mark.parametrize("lands", [True, False])
def test_an_undecidable_commit_is_unknown_and_every_command_is_refused_until_reload(
        tmp_path: Path, lands: bool) -> None:
    store = _CommitRaises(tmp_path / "events.db")
    store.lands = lands
    c = _tool_ran(store)
    _commit_raises(store)
    with pytest.raises(StorageError) as info:
        c.tool_completed("charge", "charged 7")
    assert info.value.outcome == "unknown"
    assert info.value.action == "tool_completed"
    assert "may or may not have landed" in str(info.value)
    # nothing goes on from here: every command is refused, typed, and changes nothing
    store.probe_fails = False
    commands: list[tuple[Callable[..., Any], tuple[Any, ...]]] = [
        (c.tool_completed, ("charge", "charged 7")), (c.tool_interrupted, ("charge",)),
        (c.begin_model_call, ()), (c.abandon, ("give up",)), (c.resume, ()),
        (c.hook_ran, ("tool_end",))]
    for command, args in commands:
        refused = assert_refused(c, StorageError, command, *args)
        assert refused.outcome == "unknown"
        assert "load the run again" in str(refused)
    # loading again is the way on, and shows whether the result landed
    again = RunController.load(store, RUN)
    assert (again.call("charge").phase.value == "completed") is lands
    if not lands:
        with pytest.raises(ControlError):  # started, never completed here: in doubt
            again.begin_tool("charge")
    again.abandon("done")


class _LostAnswerStore(MemoryEventStore):
    """Appends, then (when armed) loses the answer: the append landed, the caller cannot
    know it (a StorageError with outcome "unknown")."""

    armed = False

    def append(self, run_id: str, events: Sequence[ev.Event], expected_version: int, *,
               snapshot: Snapshot | None = None, step: Step | None = None,
               read_model: ReadModel | None = None) -> None:
        super().append(run_id, events, expected_version, snapshot=snapshot, step=step,
                       read_model=read_model)
        if self.armed:
            self.armed = False
            raise StorageError("the answer was lost", outcome="unknown")


def test_after_an_append_of_unknown_outcome_every_command_is_refused() -> None:
    # CT04: the controller may be behind its log, so it refuses everything (StorageError,
    # nothing appended) until the run is loaded again, which shows what landed
    store = _LostAnswerStore()
    c = RunController.start(run_id="lost", session_id=None, store=store)
    store.armed = True
    with pytest.raises(StorageError):
        c.add_input(["first"])
    for command, args in ((c.add_input, (["second"],)), (c.begin_model_call, ()),
                          (c.abandon, ("gone",))):
        with pytest.raises(StorageError) as info:
            command(*args)
        assert type(info.value) is StorageError
        assert "load the run again" in str(info.value)
    assert [type(e) for e in store.load("lost")] == [ev.RunStarted, ev.InputAdded]
    again = RunController.load(store, "lost")
    assert again.unpublished_input == ("first",)
    again.add_input(["second"])


def test_a_commit_that_did_not_land_and_reads_back_so_is_not_written(
        tmp_path: Path) -> None:
    store = _CommitRaises(tmp_path / "events.db")
    store.lands, store.probe_fails = False, False
    c = _tool_ran(store)
    _commit_raises(store)
    refused = assert_refused(c, StorageError, c.tool_completed, "charge", "charged 7")
    assert refused.outcome == "not_written"
    assert store._conn is None  # the failed connection was dropped: a fresh one next
    c.tool_completed("charge", "charged 7")  # not poisoned: it goes on
    assert RunController.load(store, RUN).state == c.state


def test_a_store_that_lets_sqlite_errors_through_is_typed_by_the_controller() -> None:
    """A third-party store raising sqlite3's or the OS's errors: an append is "unknown"
    (it did not say whether it landed), a load is typed."""
    from statemachine import MemoryEventStore

    class Leaky(MemoryEventStore):
        broken = False

        def append(self, *args: Any, **kwargs: Any) -> None:
            if self.broken:
                raise sqlite3.OperationalError("disk I/O error")
            super().append(*args, **kwargs)

        def load(self, run_id: str) -> Any:
            if self.broken:
                raise OSError(5, "Input/output error")
            return super().load(run_id)

        def load_latest(self, run_id: str) -> Any:
            if self.broken:
                raise OSError(5, "Input/output error")
            return super().load_latest(run_id)

    store = Leaky()
    c = at_interruption(store=store)
    store.broken = True
    with pytest.raises(StorageError) as info:
        c.approve("charge")
    assert info.value.outcome == "unknown"
    assert_refused(c, StorageError, c.approve, "audit")
    with pytest.raises(StorageError):
        RunController.load(store, RUN)
    with pytest.raises(StorageError):
        RunController.start(run_id="run-2", session_id=None, store=store)


# ------------------------------------------------------------ deleted, replaced


def test_a_deleted_database_file_refuses_every_command(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    store = SQLiteEventStore(path)
    c = at_interruption(store=store)
    for name in tmp_path.glob("events.db*"):
        name.unlink()
    refused = assert_refused(c, StorageError, c.approve, "charge")
    assert refused.outcome == "not_written"
    assert "deleted" in str(refused)
    with pytest.raises(StorageError, match="deleted"):
        RunController.load(store, RUN)
    # a new opener finds no run, and nothing was written into the unlinked file
    with pytest.raises(RunNotFound):
        RunController.load(SQLiteEventStore(path), RUN)


def test_a_replaced_database_file_refuses_every_command(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    store = SQLiteEventStore(path)
    c = at_interruption(store=store)
    other = SQLiteEventStore(tmp_path / "other.db")
    at_interruption(store=other)
    other.close()
    os.replace(tmp_path / "other.db", path)
    refused = assert_refused(c, StorageError, c.approve, "charge")
    assert refused.outcome == "not_written"
    assert "replaced" in str(refused)
    assert RunController.load(SQLiteEventStore(path), RUN).version == c.version


# ---------------------------------------------------------------- the Session


def test_sqlite_session_errors_are_typed_and_publish_reports_them(tmp_path: Path) -> None:
    """A Session write's StorageError reaches the runner as the write's error: publish
    reports publication_failed and re-raises it (I6)."""
    session = SQLiteSession("session-1", tmp_path / "session.db")
    session._conn.execute("PRAGMA query_only = ON")  # SQLite refuses every write now
    c = at_interruption(RecoveryPolicy.RECONCILE)
    run_charge(c)
    with pytest.raises(StorageError) as info:
        asyncio.run(publish(c, session, list(B), call_ids=["charge", "audit"]))
    assert info.value.outcome == "not_written"
    assert type(c.events[-1]).__name__ == "PublicationFailed"
    for call in (session.pop_item(), session.clear_session()):
        with pytest.raises(StorageError):
            asyncio.run(call)
    session._conn.execute("PRAGMA query_only = OFF")
    assert asyncio.run(session.get_items()) == []


def test_a_locked_session_is_typed(tmp_path: Path) -> None:
    path = tmp_path / "session.db"
    session = SQLiteSession("s", path, timeout=0.05)
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(StorageError, match="locked") as info:
            asyncio.run(session.add_items([{"n": 1}]))
        assert info.value.outcome == "not_written"
    finally:
        other.execute("ROLLBACK")
        other.close()
    asyncio.run(session.add_items([{"n": 1}]))
    assert asyncio.run(session.get_items()) == [{"n": 1}]


def test_a_damaged_session_item_is_typed(tmp_path: Path) -> None:
    path = tmp_path / "session.db"
    session = SQLiteSession("s", path)
    asyncio.run(session.add_items([{"n": 1}]))
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as raw:
        raw.execute("UPDATE session_items SET body = '{not json'")
    with pytest.raises(StorageError, match="damaged item"):
        asyncio.run(session.get_items())
    with pytest.raises(StorageError, match="damaged item"):
        asyncio.run(session.pop_item())
    with contextlib.closing(sqlite3.connect(path)) as raw:  # the damaged item stays
        assert raw.execute("SELECT COUNT(*) FROM session_items").fetchone()[0] == 1


# ------------------------------------------------------------ read-only mode


def _files(folder: Path) -> list[tuple[str, int, int]]:
    return sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir())


def test_a_read_only_store_reads_and_never_writes(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    writer = SQLiteEventStore(path)
    c = at_interruption(store=writer)
    heads = writer.list_runs()
    writer.close()
    before = _files(tmp_path)
    assert [name for name, _, _ in before] == ["events.db"]
    store = SQLiteEventStore(path, readonly=True)
    loaded = RunController.load(store, RUN)
    assert loaded.state == c.state
    assert loaded.events == c.events
    assert store.list_runs() == heads
    refused = assert_refused(loaded, StorageError, loaded.approve, "charge")
    assert refused.outcome == "not_written"
    assert "read-only" in str(refused)
    with pytest.raises(StorageError, match="read-only"):
        RunController.start(run_id="run-2", session_id=None, store=store)
    again = SQLiteEventStore(path, readonly=True)
    RunController.load(again, RUN, snapshot=False)
    assert _files(tmp_path) == before  # nothing changed, no -wal or -shm left behind


def test_a_read_only_store_refuses_what_is_not_a_store(tmp_path: Path) -> None:
    with pytest.raises(StorageError, match="no such store file"):
        SQLiteEventStore(tmp_path / "none.db", readonly=True)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(StorageError, match="is a directory"):
        SQLiteEventStore(tmp_path, readonly=True)
    (tmp_path / "empty.db").write_bytes(b"")
    with pytest.raises(StorageError, match="not an agent-statemachine event store"):
        SQLiteEventStore(tmp_path / "empty.db", readonly=True)
    with contextlib.closing(sqlite3.connect(tmp_path / "other.db", isolation_level=None)) as raw:
        raw.execute("CREATE TABLE t (x)")
    with pytest.raises(StorageError, match="not an agent-statemachine event store"):
        SQLiteEventStore(tmp_path / "other.db", readonly=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.db", "other.db"]


def test_a_read_only_store_sees_a_writers_uncheckpointed_events(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    writer = SQLiteEventStore(path)
    c = at_interruption(store=writer)
    c.approve("charge")  # in the -wal
    try:
        before = _files(tmp_path)
        assert RunController.load(SQLiteEventStore(path, readonly=True),
                                  RUN).version == c.version
        assert {n for n, _, _ in _files(tmp_path)} == {n for n, _, _ in before}
        c.approve("audit")  # the writer goes on
    finally:
        writer.close()


def test_a_read_only_look_at_a_database_made_before_the_run_index(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    writer = SQLiteEventStore(path)
    at_interruption(store=writer).claim("worker-1")
    expected = writer.list_runs()
    writer.close()
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as raw:
        raw.execute("DROP TABLE runs")
        raw.execute("CREATE TABLE snapshots2 AS SELECT run_id, version, body FROM snapshots")
        raw.execute("DROP TABLE snapshots")
        raw.execute("ALTER TABLE snapshots2 RENAME TO snapshots")
    before = _files(tmp_path)
    store = SQLiteEventStore(path, readonly=True)
    assert store.list_runs() == expected
    assert RunController.load(store, RUN).version == expected[0].version
    assert _files(tmp_path) == before
