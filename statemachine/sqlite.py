"""The one place SQLite connections are opened and transactions are run, for the event
store and the Session alike: WAL, ``synchronous=FULL``, autocommit off, and every write
in one ``BEGIN IMMEDIATE`` transaction that rolls back on any exception (cancellation
included) before it propagates."""

from __future__ import annotations

import contextlib
import os
import sqlite3
from collections.abc import Iterator


def connect(path: str | os.PathLike[str], *, timeout: float) -> sqlite3.Connection:
    """A connection in autocommit mode (transactions are explicit), WAL journal,
    ``synchronous=FULL``, shareable between threads (callers serialize with a lock)."""
    conn = sqlite3.connect(os.fspath(path), timeout=timeout, isolation_level=None,
                           check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    return conn


class CommitFailed(Exception):
    """The COMMIT itself raised (``__cause__`` is the sqlite3 error): the transaction may
    have landed and only its answer been lost, so its outcome is unknown until read back."""


@contextlib.contextmanager
def write_transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """``BEGIN IMMEDIATE`` … ``COMMIT``; ``ROLLBACK`` when the body raises (the body's
    error propagates). A COMMIT that raises is `CommitFailed`."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
    except BaseException:
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
        conn.execute("COMMIT")
