"""The one place SQLite connections are opened and transactions are run, for the event
store and the Session alike: WAL, ``synchronous=FULL``, autocommit off, and every write
in one ``BEGIN IMMEDIATE`` transaction that rolls back on any exception (cancellation
included) before it propagates.

It is also where a backend failure gets its type: every `sqlite3.Error` and `OSError` a
store or a Session meets becomes a `StorageError` (`failure`) saying what went wrong
(locked, read-only, full, not a database, damaged, deleted or replaced) and what happened
to the write (``outcome``). A database file is also watched for being deleted or replaced
while open (`FileIdentity`), which SQLite itself never notices: it would go on writing
into the unlinked file."""

from __future__ import annotations

import contextlib
import os
import sqlite3
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

from statemachine.errors import StorageError

SHOWN = 200
"""The most characters of a path a message echoes."""


def connect(path: str | os.PathLike[str], *, timeout: float) -> sqlite3.Connection:
    """A connection in autocommit mode (transactions are explicit), WAL journal,
    ``synchronous=FULL``, shareable between threads (callers serialize with a lock).

    ``timeout`` is SQLite's busy timeout, in seconds: a connection that meets another's
    lock waits that long (``BEGIN IMMEDIATE`` included) before "database is locked"."""
    conn = sqlite3.connect(os.fspath(path), timeout=timeout, isolation_level=None,
                           check_same_thread=False)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
    except BaseException:
        conn.close()
        raise
    return conn


def connect_readonly(path: str, *, timeout: float, immutable: bool) -> sqlite3.Connection:
    """A connection that cannot write (SQLite's ``mode=ro``; with ``immutable``, one that
    takes no lock and creates no ``-wal``/``-shm`` either: only for a file at rest)."""
    uri = "file:" + quote(os.fsencode(os.path.abspath(path))) + "?mode=ro"
    return sqlite3.connect(uri + ("&immutable=1" if immutable else ""), uri=True,
                           timeout=timeout, isolation_level=None, check_same_thread=False)


class CommitFailed(Exception):
    """The COMMIT itself raised (``__cause__`` is the sqlite3 error): the transaction may
    have landed and only its answer been lost, so its outcome is unknown until read back."""


@contextlib.contextmanager
def write_transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """``BEGIN IMMEDIATE`` … ``COMMIT``; ``ROLLBACK`` when the body raises (the body's
    error propagates, even when the ROLLBACK fails too: SQLite rolls some failures back
    itself, and a caller that finds ``conn.in_transaction`` still set closes the
    connection, which rolls back). A COMMIT that raises is `CommitFailed`."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
    except BaseException:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")
        raise
    try:
        conn.execute("COMMIT")
    except sqlite3.Error as error:
        raise CommitFailed(str(error)) from error


@contextlib.contextmanager
def read_transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """One consistent snapshot for several reads."""
    conn.execute("BEGIN")
    try:
        yield conn
    finally:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("COMMIT")


def in_transaction(conn: Any) -> bool:
    """Whether ``conn`` is still inside a transaction (a failed ROLLBACK leaves it so)."""
    try:
        return bool(getattr(conn, "in_transaction", False))
    except sqlite3.Error:
        return True


# ----------------------------------------------------------------- typed failures


def shown(path: str) -> str:
    """A path as a bounded, printable quotation for a message."""
    text = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in path[:SHOWN])
    return repr(text + ("..." if len(path) > SHOWN else ""))


_AFTER = {
    "not_written": "nothing was written",
    "unknown": "the write may or may not have landed",
}


def failure(error: BaseException, path: str, *, outcome: str, doing: str,
            **where: Any) -> StorageError:
    """The `StorageError` for a `sqlite3.Error` or `OSError` met while ``doing`` something
    with the database at ``path``. Its message names the path, the kind of failure and
    the outcome, and SQLite's own words (never a payload)."""
    text = str(error)
    low = text.lower()
    name = shown(path)
    if "not a database" in low:
        what = f"{name} is not a SQLite database, so not an agent-statemachine store"
    elif "malformed" in low or "corrupt" in low:
        what = f"{name} is a damaged SQLite database ({text})"
    elif "locked" in low or "busy" in low:
        what = (f"{name} is locked by another connection ({text}): the busy timeout "
                "ran out")
    elif "readonly" in low or "read-only" in low:
        what = f"{name} cannot be written: it is read-only ({text})"
    elif "full" in low or (isinstance(error, OSError) and error.errno == 28):
        what = f"{name} cannot grow: the disk is full ({text})"
    elif isinstance(error, FileNotFoundError):
        what = f"no such file: {name}"
    elif isinstance(error, OSError):
        what = f"{name}: {error.strerror or text}"
    else:
        what = f"{name}: {type(error).__name__}: {text}"
    return StorageError(f"cannot {doing}: {what}; {_AFTER[outcome]}", outcome=outcome,
                        **where)


@contextlib.contextmanager
def storage_errors(path: str, *, doing: str, outcome: str = "not_written",
                   **where: Any) -> Iterator[None]:
    """Turn a `sqlite3.Error` or `OSError` raised in the body into `failure`'s
    `StorageError` (other errors, `StorageError` included, pass through)."""
    try:
        yield
    except (sqlite3.Error, OSError) as error:
        raise failure(error, path, outcome=outcome, doing=doing, **where) from error


class FileIdentity:
    """Which file a path named when a database was opened (device and inode), so that a
    file deleted or replaced while open is noticed: SQLite keeps writing into the file it
    has open, which no later opener of the path will ever see. One ``stat`` per check."""

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
        self._identity = self._now()

    def _now(self) -> tuple[int, int]:
        st = os.stat(self.path)
        return st.st_dev, st.st_ino

    def check(self, *, doing: str, outcome: str = "not_written", **where: Any) -> None:
        """`StorageError` when the path no longer names the file opened."""
        try:
            now = self._now()
        except FileNotFoundError:
            problem = "was deleted while open"
        except OSError as error:
            raise failure(error, self.path, outcome=outcome, doing=doing,
                          **where) from error
        else:
            if now == self._identity:
                return
            problem = "was replaced by another file while open"
        raise StorageError(f"cannot {doing}: the database file {shown(self.path)} "
                           f"{problem}; open it again; {_AFTER[outcome]}",
                           outcome=outcome, **where)
