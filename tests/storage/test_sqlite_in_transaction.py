"""`SQLiteEventStore.in_transaction_of`: a store's appends and reads on this thread go
through another connection to its file, inside the transaction that connection holds
open, and land with that transaction or not at all (what the LangGraph adapter's
checkpoint and its publication share). On files on disk; what landed is read back by
stores and connections of the test's own, never by the store under test."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from statemachine import ConcurrencyConflict, LeaseHeld, RunController
from statemachine import events as ev
from statemachine.errors import Outcome, StorageError
from statemachine.stores import SessionWrite, SQLiteEventStore
from statemachine.values import RecoveryPolicy

SESSION = "chat-1"
AT = 1_767_225_600_000_000


def _owner(path: Path) -> sqlite3.Connection:
    """Someone else's connection to the file, holding its write lock in a transaction
    that also writes a row of its own."""
    conn = sqlite3.connect(str(path), check_same_thread=False)
    conn.execute("CREATE TABLE IF NOT EXISTS theirs (x INTEGER)")
    conn.commit()
    conn.execute("BEGIN IMMEDIATE")
    conn.execute("INSERT INTO theirs VALUES (1)")
    return conn


def _versions(path: Path, run_id: str = "run") -> tuple[int, int]:
    """The run's version and the owner's rows, as a fresh reader finds them."""
    with sqlite3.connect(str(path)) as conn:
        theirs = conn.execute("SELECT count(*) FROM theirs").fetchone()[0]
    return SQLiteEventStore(str(path)).version(run_id), theirs


def _started(store: SQLiteEventStore, run_id: str = "run") -> RunController:
    c = RunController.start(run_id=run_id, session_id=None, store=store, buffered=True)
    c.flush()
    return c


@pytest.mark.parametrize("commit", [True, False])
def test_appends_land_with_the_owners_transaction_or_not_at_all(tmp_path: Path,
                                                                 commit: bool) -> None:
    path = tmp_path / "one.db"
    store = SQLiteEventStore(str(path))
    c = _started(store)
    commits = store.commits
    owner = _owner(path)
    with store.in_transaction_of(owner):
        c.claim("worker-a")
        c.flush()
        # its own reads see what went in: a fence finds what the controller flushed
        assert store.version("run") == 2
        assert [type(e).__name__ for e in store.load("run")] == ["RunStarted",
                                                                  "RunClaimed"]
        c.fence()
    assert store.commits == commits  # (not this store's transaction)
    assert _versions(path) == (1, 0)  # nothing is visible outside before the owner ends
    owner.commit() if commit else owner.rollback()
    assert _versions(path) == ((2, 1) if commit else (1, 0))
    assert store.version("run") == (2 if commit else 1)  # its own connection again
    if not commit:  # the controller went ahead of the store: its fence says so
        with pytest.raises(ConcurrencyConflict):
            c.fence()


def test_a_refused_append_leaves_the_owners_transaction_as_it_found_it(
        tmp_path: Path) -> None:
    """A claim refused by another owner's live lease inside the transaction is rolled
    back to its own savepoint: the owner's row and an earlier append in the same
    transaction land with its commit, none of the refused append's rows do (its events
    are inserted before its head refuses it)."""
    path = tmp_path / "one.db"
    store = SQLiteEventStore(str(path))
    _started(store)
    held = RunController.load(store, "run")
    held.claim("worker-a", lease=60)
    held.flush()
    owner = _owner(path)
    rival = RunController.load(store, "run", buffered=True)
    with store.in_transaction_of(owner):
        other = _started(store, "other")  # lands with the owner
        rival.claim("worker-b", lease=60)
        with pytest.raises(LeaseHeld):
            rival.flush()
    owner.commit()
    assert _versions(path) == (2, 1)
    assert _versions(path, "other")[0] == other.version == 1
    log = SQLiteEventStore(str(path)).load("run")
    assert [getattr(e, "owner", None) for e in log] == [None, "worker-a"]


def test_an_append_without_an_open_transaction_is_refused_and_writes_nothing(
        tmp_path: Path) -> None:
    path = tmp_path / "one.db"
    store = SQLiteEventStore(str(path))
    c = _started(store)
    idle = sqlite3.connect(str(path), check_same_thread=False)
    with store.in_transaction_of(idle):
        c.claim("worker-a")
        with pytest.raises(StorageError) as refused:
            c.flush()
    assert refused.value.outcome == Outcome.NOT_WRITTEN
    assert not idle.in_transaction
    assert SQLiteEventStore(str(path)).version("run") == 1


def test_only_a_connection_to_the_stores_own_file_shares_it(tmp_path: Path) -> None:
    path = tmp_path / "one.db"
    store = SQLiteEventStore(str(path))
    assert store.shares_file_with(sqlite3.connect(str(path)))
    (tmp_path / "link.db").symlink_to(path)  # the same file by another name
    assert store.shares_file_with(sqlite3.connect(str(tmp_path / "link.db")))
    assert not store.shares_file_with(sqlite3.connect(str(tmp_path / "other.db")))
    assert not store.shares_file_with(sqlite3.connect(":memory:"))
    closed = sqlite3.connect(str(path))
    closed.close()
    assert not store.shares_file_with(closed)
    readonly = SQLiteEventStore(str(path), readonly=True)
    assert not readonly.shares_file_with(sqlite3.connect(str(path)))
    with pytest.raises(StorageError), readonly.in_transaction_of(sqlite3.connect(str(path))):
        pass


def test_a_session_table_made_inside_a_transaction_that_rolls_back_is_not_taken_as_made(
        tmp_path: Path) -> None:
    """A commit carrying a Session's items, appended inside another's transaction, makes
    the Session's table there, and a read of the Session inside finds it; the owner
    rolls back, the table with it: later appends carrying a Session's items through the
    store's own connection make it again and land (the store did not keep "made")."""
    path = tmp_path / "one.db"
    store = SQLiteEventStore(str(path))
    c = _started(store)
    owner = _owner(path)
    with store.in_transaction_of(owner):
        c.claim("worker-a")
        c.flush()
        store.append("other", [ev.RunStarted(0, "other", SESSION, RecoveryPolicy.FAIL_CLOSED,
                                             None, "{}", at=AT)], 0,
                     session_write=SessionWrite(SESSION, "p-1", ({"role": "user"},)))
        assert store.session_items(SESSION) == [{"role": "user"}]
    owner.rollback()
    store.append("other", [ev.RunStarted(0, "other", SESSION, RecoveryPolicy.FAIL_CLOSED,
                                         None, "{}", at=AT)], 0,
                 session_write=SessionWrite(SESSION, "p-1", ({"role": "user"},)))
    assert SQLiteEventStore(str(path)).session_items(SESSION) == [{"role": "user"}]
