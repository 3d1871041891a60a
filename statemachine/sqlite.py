"""Everything SQLite: the event stores (`SQLiteEventStore`, `AsyncSQLiteEventStore`), the
Session (`SQLiteSession`), and the one place their connections are opened and their
transactions run: WAL, ``synchronous=FULL``, autocommit off, and every write in one
``BEGIN IMMEDIATE`` transaction that rolls back on any exception (cancellation included)
before it propagates.

It is also where a backend failure gets its type: every `sqlite3.Error` and `OSError` a
store or a Session meets becomes a `StorageError` (`failure`) saying what went wrong
(locked, read-only, full, not a database, damaged, deleted or replaced) and what happened
to the write (``outcome``). A database file is also watched for being deleted or replaced
while open (`FileIdentity`), which SQLite itself never notices: it would go on writing
into the unlinked file.

The stores are also importable from `statemachine.stores` (and `SQLiteEventStore` from
`statemachine`), the Session from `statemachine.sessions`.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import json
import os
import sqlite3
import threading
import uuid
import weakref
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar
from urllib.parse import quote

from statemachine import codec
from statemachine import events as ev
from statemachine.errors import ControlError, Outcome, SchemaError, StorageError
from statemachine.events import Event
from statemachine.payloads import JSON, detach, text_problem
from statemachine.stored import (
    NO_LEASE,
    Head,
    Loaded,
    Rows,
    RunHead,
    SessionWrite,
    check_filters,
    claimed_owner,
    conflict,
    decode_rows,
    digest,
    dumps,
    event_text,
    head_of_log,
    kept_model,
    moved_refusal,
    next_lease,
    now_micros,
    session_moved,
    session_writes,
    snapshot_ignored,
    started_session,
    takes_session_write,
    to_index,
    verified_snapshot,
)
from statemachine.values import Step

if TYPE_CHECKING:
    from statemachine.blocker import ReadModel
    from statemachine.stores import Snapshot

T = TypeVar("T")

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


def connect_readonly(path: str, *, timeout: float, immutable: bool,
                     shm_readonly: bool = False) -> sqlite3.Connection:
    """A connection that cannot write (SQLite's ``mode=ro``; with ``immutable``, one that
    takes no lock and creates no ``-wal``/``-shm`` either: only for a file at rest).

    With ``shm_readonly`` (and not ``immutable``) it opens the ``-shm`` a writer left
    read-only too (``readonly_shm``): a plain ``mode=ro`` reader writes its read marks into
    that file (its bytes and mtime change), and creates one that is missing. So a
    ``-wal`` without its ``-shm`` cannot be read that way (`sqlite3.OperationalError`,
    "unable to open"), which is refused rather than read without the ``-wal``'s commits.
    Only for a process that never writes the file: in one process the connections to a
    file share one shared-memory index, and a writer opened while such a read is under
    way would share its read-only index and be refused."""
    uri = "file:" + quote(os.fsencode(os.path.abspath(path))) + "?mode=ro"
    extra = "&immutable=1" if immutable else "&readonly_shm=1" if shm_readonly else ""
    return sqlite3.connect(uri + extra, uri=True, timeout=timeout, isolation_level=None,
                           check_same_thread=False)


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
    """One consistent snapshot for several reads (on a connection inside a transaction
    already, that transaction's: `SQLiteEventStore.in_transaction_of`)."""
    if conn.in_transaction:
        yield conn
        return
    conn.execute("BEGIN")
    try:
        yield conn
    finally:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("COMMIT")


def same_file(path: str | os.PathLike[str], other: str | os.PathLike[str]) -> bool:
    """Whether two paths name one file (False when either cannot be read: a file not
    made yet is no other's)."""
    try:
        return os.path.samefile(path, other)
    except OSError:
        return False


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
    Outcome.NOT_WRITTEN: "nothing was written",
    Outcome.UNKNOWN: "the write may or may not have landed",
}


def failure(error: BaseException, path: str, *, outcome: Outcome, doing: str,
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
def storage_errors(path: str, *, doing: str, outcome: Outcome = Outcome.NOT_WRITTEN,
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

    @property
    def identity(self) -> tuple[int, int]:
        """The (device, inode) of the file opened."""
        return self._identity

    def _now(self) -> tuple[int, int]:
        st = os.stat(self.path)
        return st.st_dev, st.st_ino

    def check(self, *, doing: str, outcome: Outcome = Outcome.NOT_WRITTEN, **where: Any) -> None:
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


# ------------------------------------------------------------------ the event store

_SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    run_id   TEXT    NOT NULL,
    seq      INTEGER NOT NULL,
    batch_id TEXT    NOT NULL,
    body     TEXT    NOT NULL,
    UNIQUE (run_id, seq)
);
CREATE INDEX IF NOT EXISTS events_by_batch ON events (batch_id);
CREATE TABLE IF NOT EXISTS snapshots (
    run_id  TEXT    PRIMARY KEY,
    version INTEGER NOT NULL,
    body    TEXT    NOT NULL,
    digest  TEXT
);
"""
"""``snapshots.digest`` is the sha256 (hex) of ``body``, the snapshot's JSON text exactly as
stored; a row whose digest is missing or does not match is never used."""

_RUNS_TABLE = """CREATE TABLE runs (
    run_id     TEXT    PRIMARY KEY,
    step       TEXT,
    session_id TEXT,
    owner      TEXT,
    version    INTEGER,
    updated_at INTEGER,
    lease_owner TEXT,
    lease_until INTEGER,
    lease      INTEGER,
    read_model TEXT,
    blocker    TEXT
)"""
"""One head per run. ``step`` NULL: unfolded; `SQLiteEventStore.list_runs` folds the
run's log and fills it in (with the Session and the read model as the log has them).
``read_model``: the run's `ReadModel` as `ReadModel.encode` wrote it (NULL: nothing
blocks, nothing waits, in a folded head), and ``blocker`` its blocker's kind (NULL:
none); a head whose two do not decode to one that agrees is folded again. ``version``: how many
events the run's log holds, moved by every append in its transaction, so a load checks
the log against it: the last rows lost past the newest snapshot are a shorter legal
log, which only the head tells from a run that stopped there. NULL: not known (a head
an older version wrote); not checked until the next append here sets it.
``updated_at``: the ``at`` of the run's newest event (NULL for an event without one).
``lease_owner``, ``lease_until``, ``lease``: the run's lease (`stored.next_lease`), its
holder, its end by the wall clock and its length, in microseconds; NULL without one."""
_LEASE_COLUMNS = ("ALTER TABLE runs ADD COLUMN lease_owner TEXT",
                  "ALTER TABLE runs ADD COLUMN lease_until INTEGER",
                  "ALTER TABLE runs ADD COLUMN lease INTEGER")
_READ_MODEL_COLUMNS = ("ALTER TABLE runs ADD COLUMN read_model TEXT",
                       "ALTER TABLE runs ADD COLUMN blocker TEXT",
                       "UPDATE runs SET step = NULL")
"""The read model's columns, with every head already there unfolded: the first listing
folds each run once and keeps its step and read model (none was ever kept)."""
_HEAD_VERSION = "ALTER TABLE runs ADD COLUMN version INTEGER"
_FILL_VERSIONS = ("UPDATE runs SET version = (SELECT MAX(seq) + 1 FROM events "
                  "WHERE events.run_id = runs.run_id)")
_RUNS_INDEXES = ("CREATE INDEX runs_by_session ON runs (session_id, step)",
                 "CREATE INDEX runs_unfolded ON runs (run_id) WHERE step IS NULL")
_HAS_RUNS = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'runs'"
_VERSION = "(SELECT MAX(seq) + 1 FROM events WHERE events.run_id = runs.run_id)"
_HEAD = ("SELECT run_id, {_VERSION}, step, session_id, owner, updated_at, lease_owner, "
         "lease_until, read_model, blocker FROM runs").replace("{_VERSION}", _VERSION)
_UNMODELLED_HEAD = _HEAD.replace(" step,", " NULL,").replace("read_model, blocker",
                                                              "NULL, NULL")
"""`_HEAD` on a database made before the heads kept read models, open read-only: every
head reads unfolded, so each listing folds each run (without keeping it)."""
_OLD_HEAD = _UNMODELLED_HEAD.replace("lease_owner, lease_until", "NULL, NULL")
"""`_HEAD` on a database made before the run heads kept leases, open read-only: none of
its runs took one (an append here would have added the columns first)."""
_OLDER_HEAD = _OLD_HEAD.replace("updated_at,", "NULL,")
"""`_HEAD` on a database made before ``runs.updated_at``, open read-only (its runs were
all written without time, so NULL is what the column would hold)."""
_SIDE_FILES = ("-wal", "-shm", "-journal")


_APPEND = "append to the event store"


class _Prepared(NamedTuple):
    """One append checked and encoded (`SQLiteEventStore._prepare`), before any I/O."""

    run_id: str
    events: tuple[Event, ...]
    expected: int
    batch_id: str
    rows: list[tuple[str, int, str, str]]
    kept: tuple[str, int, str, str] | None
    fold: tuple[Step, ReadModel] | None
    items: list[tuple[str, str]] | None
    checks: tuple[tuple[int, SessionWrite], ...] = ()
    """Each write with a tail to check (`SessionWrite.after`), with the position in
    ``items`` where its own rows begin: its check comes after the rows before it."""


class SQLiteEventStore:
    """A store on a real SQLite database file: WAL, ``synchronous=FULL``, every append in
    one ``BEGIN IMMEDIATE`` transaction, UNIQUE(run_id, seq).

    Failures are typed: every `sqlite3.Error` and `OSError` of a public call is a
    `StorageError` (the database locked past the busy ``timeout``, read-only, the disk
    full, not a database, damaged, the file deleted or replaced while open) with an
    ``outcome``: ``"not_written"`` when the append certainly did not land (and for every
    read), ``"unknown"`` when it may have. An append whose COMMIT raises is classified by
    reading back the append's client-generated batch id on a fresh connection, never by
    retrying: found means appended; not found is ``"not_written"``; a read-back that
    cannot decide (it fails too, or the path no longer names the file) is ``"unknown"``.

    ``timeout`` (seconds) is SQLite's busy timeout on every connection the store opens
    (the read-back's too): a writer waits that long for another's lock, ``BEGIN
    IMMEDIATE`` included, so a few processes contending for one file queue rather than
    fail. Each append and read first checks, with one ``stat``, that the path still names
    the file opened (`FileIdentity`): a file deleted or replaced while open is a
    `StorageError` instead of writes into the void.

    The log is checked as it is read: rows must run from seq 0 (or from the snapshot)
    without a gap, each body decoding to the event of its row's seq, else `SchemaError`;
    so a loaded log is never silently shorter than the rows say. Snapshots carry a digest
    (sha256 of their JSON text) and are used only when the digest matches and the JSON is
    an object of this run ending right before the row's version; otherwise the snapshot
    is ignored with a `SnapshotIgnored` warning and the whole log is read. A snapshot that
    passes vouches for the log up to its version: if event 0 or event version - 1 is
    missing, the log was truncated (or has a gap) and loading is a `SchemaError`, not a
    replay of what is left. Every load also checks the log against its run's head, whose
    ``version`` each append moves in its transaction: rows lost at the end, past the
    newest snapshot, leave a shorter legal log that only the head tells from a run that
    stopped there, so it is a `SchemaError`, and an append refuses to write on top of it.
    One check would cost O(log length) and is left to a whole read (``load``, a
    controller's ``events``, which raise `SchemaError`): a gap strictly inside the
    snapshot's prefix.

    ``readonly=True`` opens an existing store that can never be written through this
    object, nor any file created or changed by reading it: each read is its own SQLite
    ``mode=ro`` connection, ``immutable`` when the database is at rest (no ``-wal``,
    ``-shm`` or ``-journal`` beside it, which a read-only connection could leave behind
    and never remove), read again through SQLite's locks if the file moved meanwhile.
    No PRAGMA, no schema: a missing file, a directory and a file without the store's
    ``events`` table are refused (`StorageError`); ``append`` is refused
    (``"not_written"``); ``list_runs`` folds unfolded heads without keeping them.

    ``leave_shm=True`` (with ``readonly``) also leaves a live writer's ``-shm`` as it was
    (SQLite's ``readonly_shm``; a ``-wal`` whose ``-shm`` is gone is then refused, not
    read without its commits): for a process that only reads the file, as the
    ``statemachine`` command's read verbs do. A process that also writes the file must
    not use it (its connections share one index with such a read, and a writer opened
    meanwhile would be refused).

    Safe to share between threads; several processes may open the same file.

    Runs are indexed by Session (`IndexedStore`) in a ``runs`` table, one head per run,
    written in each append's transaction. A database made before that table existed gets
    it when first opened, in one transaction: a row per run with its Session and last
    owner read off its log and its step unfolded, so the first ``list_runs`` folds each
    such run (snapshot plus tail) once and keeps the result. A run an older writer logs
    later gets its row on the next append here. A database made before snapshots had a
    digest gets the column, and its undigested snapshots are dropped (the next ones are
    written with one); one whose heads have no version gets it, set to each log's length
    as it stands (read-only, such a head is not checked). Processes writing to one
    database should all run a version that keeps the heads, their versions and the
    digests: an older writer's appends leave the head's version behind its log, which a
    load then refuses as damaged (fail closed).
    A database made before the heads kept ``updated_at`` (the newest event's ``at``,
    `RunHead.updated_at`) gets the column, NULL for every run already there (none of
    their events carries a time).
    """

    keeps_leases = True
    """Leases are checked and moved in each append's transaction (`stored.next_lease`):
    a claim landing while another owner's lease is live is refused (`LeaseHeld`)."""
    keeps_read_models = True
    """Each append keeps the run's `ReadModel` (``read_model=``) in its head, beside the
    step, in the append's transaction (`stores.keeps_read_models`)."""
    many_session_writes = True
    """``append`` takes a tuple of `SessionWrite` (`stores.many_session_writes`)."""
    checks_session_tail = True
    """A `SessionWrite`'s ``after`` is checked in the append's transaction, against the
    Session's rows in this file (`stores.checks_session_tail`)."""

    def __init__(self, path: str | os.PathLike[str], *, timeout: float = 30.0,
                 readonly: bool = False, leave_shm: bool = False) -> None:
        self.path = os.fspath(path)
        self.readonly = readonly
        self._leave_shm = readonly and leave_shm
        self._timeout = timeout
        self._lock = threading.Lock()
        self._conn: Any = None
        self._identity: FileIdentity | None = None
        self._closed = False
        self._has_runs = self._has_digests = self._has_versions = True
        self._has_updated_at = self._has_leases = self._has_read_models = True
        self._session_table = False  # (True once a Session's table was seen in the file)
        self._through = threading.local()
        """Per thread: where `in_transaction_of` sends its appends and reads (the connection,
        its lock, the runs appended to), or nothing."""
        self.commits = 0
        """How many write transactions of appends this object committed (each one fsync
        of the write-ahead log: an `append`'s, or an `append_group`'s of several appends):
        what the bench counts as durable writes."""
        if readonly:
            self._open_readonly()
            return
        with storage_errors(self.path, doing="open the event store"):
            try:
                self._conn = self._connect()
                with self._lock:
                    self._conn.executescript(_SCHEMA)
                    self._ensure_runs()
                    self._ensure_digests()
                    self._ensure_versions()
                    self._ensure_updated_at()
                    self._ensure_leases()
                    self._ensure_read_models()
                if not _in_memory(self.path):
                    self._identity = FileIdentity(self.path)
            except BaseException:
                if self._conn is not None:
                    self._conn.close()
                raise

    # ------------------------------------------------------------------ opening

    def _ensure_runs(self) -> None:
        """Create the ``runs`` table if absent, with a head for every run already logged
        (its Session, owner, version and newest event's ``at``; the step is left
        unfolded)."""
        conn = self._conn
        if conn.execute(_HAS_RUNS).fetchone() is not None:
            return
        try:
            with write_transaction(conn):
                if conn.execute(_HAS_RUNS).fetchone() is not None:
                    return  # another process created it first
                conn.execute(_RUNS_TABLE)
                for index in _RUNS_INDEXES:
                    conn.execute(index)
                logged = conn.execute("SELECT DISTINCT run_id FROM events").fetchall()
                for (run_id,) in logged:
                    conn.execute("INSERT INTO runs (run_id, session_id, owner, updated_at) "
                                 "VALUES (?, ?, ?, ?)", (run_id, *self._read_head(conn, run_id),
                                                         _newest_at(conn, run_id)))
                conn.execute(_FILL_VERSIONS)
        except CommitFailed as failed:
            raise failed.__cause__ from None  # type: ignore[misc]

    def _ensure_digests(self) -> None:
        """Give the ``snapshots`` table of an older database its ``digest`` column, and
        drop the snapshots it holds (nothing vouches for them; they are only a cache)."""
        self._upgrade(_has_digest, "ALTER TABLE snapshots ADD COLUMN digest TEXT",
                      "DELETE FROM snapshots")

    def _ensure_versions(self) -> None:
        """Give the ``runs`` table of an older database its ``version`` column, each head
        set to its log's length now (the log is trusted as it stands, once)."""
        self._upgrade(_has_version, _HEAD_VERSION, _FILL_VERSIONS)

    def _ensure_updated_at(self) -> None:
        """Give the ``runs`` table of an older database its ``updated_at`` column. Every
        run already there was written without time, so NULL is each one's value."""
        self._upgrade(lambda conn: _has_column(conn, "runs", "updated_at"),
                      "ALTER TABLE runs ADD COLUMN updated_at INTEGER")

    def _ensure_leases(self) -> None:
        """Give the ``runs`` table of an older database its lease columns, NULL for every
        run already there: none of them took a lease (no library before this one kept
        any)."""
        self._upgrade(lambda conn: _has_column(conn, "runs", "lease"), *_LEASE_COLUMNS)

    def _ensure_read_models(self) -> None:
        """Give the ``runs`` table of an older database its read model's columns, every
        head there unfolded (`_READ_MODEL_COLUMNS`): never a head that says nothing waits
        because no one wrote what waits."""
        self._upgrade(lambda conn: _has_column(conn, "runs", "read_model"),
                      *_READ_MODEL_COLUMNS)

    def _upgrade(self, done: Callable[[sqlite3.Connection], bool], *statements: str) -> None:
        """Upgrade an older database in place, once: ``statements`` in one write
        transaction, unless ``done`` says the upgrade is there (asked again inside the
        transaction: another process may have made it first)."""
        conn = self._conn
        if done(conn):
            return
        try:
            with write_transaction(conn):
                if done(conn):
                    return  # another process upgraded it first
                for statement in statements:
                    conn.execute(statement)
        except CommitFailed as failed:
            raise failed.__cause__ from None  # type: ignore[misc]

    def _open_readonly(self) -> None:
        name = shown(self.path)
        if not os.path.lexists(self.path):
            raise StorageError(f"no such store file: {name}", outcome=Outcome.NOT_WRITTEN)
        if os.path.isdir(self.path):
            raise StorageError(f"{name} is a directory, not an event store file",
                               outcome=Outcome.NOT_WRITTEN)
        with storage_errors(self.path, doing="open the event store"):
            self._identity = FileIdentity(self.path)
            tables, columns, digest, versions, timed, leased, modelled = self._read(
                _describe, doing="open the event store")
        if "events" not in tables or not {"run_id", "seq", "body"} <= columns:
            what = ("an empty file" if os.path.getsize(self.path) == 0
                    else "a SQLite database")
            raise StorageError(f"{name} is not an agent-statemachine event store: it is "
                               f"{what} without the store's events table",
                               outcome=Outcome.NOT_WRITTEN)
        self._has_runs = "runs" in tables
        self._has_digests = "snapshots" in tables and digest
        self._has_versions = versions
        self._has_updated_at = timed
        self._has_leases = leased
        self._has_read_models = modelled

    def _read_head(self, conn: sqlite3.Connection, run_id: str) -> tuple[str | None,
                                                                        str | None]:
        """The Session (of its `RunStarted`) and the owner (of its last `RunClaimed`) of a
        run logged without a head, read off its log. What does not decode is left None:
        the run's step is unfolded, and folding it reads (and rejects) the whole log."""
        session = owner = None
        try:
            first = conn.execute("SELECT body FROM events WHERE run_id = ? AND seq = 0",
                                 (run_id,)).fetchone()
            if first is not None:
                session = started_session([codec.decode_stored_event(codec.parse(first[0]),
                                                                      0)])
            for seq, body in conn.execute(
                    "SELECT seq, body FROM events WHERE run_id = ? AND body LIKE "
                    "'%RunClaimed%' ORDER BY seq DESC", (run_id,)).fetchall():
                event = codec.decode_stored_text(body, seq)
                if type(event) is ev.RunClaimed:
                    owner = event.owner
                    break
        except ControlError:
            pass
        return session, owner

    def _connect(self) -> sqlite3.Connection:
        return connect(self.path, timeout=self._timeout)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._conn is not None:
                self._drop_connection()

    def _live(self) -> sqlite3.Connection:
        """The writer connection, opened again if a failure closed it."""
        if self._conn is None:
            self._conn = self._connect()
        return self._conn  # type: ignore[no-any-return]

    def _routed(self) -> tuple[sqlite3.Connection, Any, set[str]] | None:
        """Where `in_transaction_of` sends this thread's appends and reads (the
        connection, its lock, the runs appended to), or None."""
        return getattr(self._through, "into", None)

    def _check(self, doing: str, outcome: Outcome = Outcome.NOT_WRITTEN, **where: Any) -> None:
        """`StorageError` when the store is closed, or its path no longer names the file
        it opened."""
        if self._closed:
            raise StorageError(f"cannot {doing}: the event store is closed",
                               outcome=Outcome.NOT_WRITTEN, **where)
        if self._identity is not None:
            self._identity.check(doing=doing, outcome=outcome, **where)

    def _read(self, query: Callable[[sqlite3.Connection], Any], *, doing: str,
              run_id: str | None = None) -> Any:
        """Run ``query`` (reads only) on a connection and return what it returns; every
        backend failure is a `StorageError` (``"not_written"``: nothing was)."""
        where: dict[str, Any] = {} if run_id is None else {"run_id": run_id}
        with storage_errors(self.path, doing=doing, **where):
            through = self._routed()
            if through is not None:  # (`in_transaction_of`: what it wrote, seen)
                conn, lock, _ = through
                with lock if lock is not None else contextlib.nullcontext():
                    self._check(doing, **where)
                    return query(conn)
            if self.readonly:
                self._check(doing, **where)
                return self._read_only(query)
            with self._lock:
                self._check(doing, **where)
                try:
                    return query(self._live())
                except BaseException:
                    self._settle_connection()
                    raise

    def _read_only(self, query: Callable[[sqlite3.Connection], Any]) -> Any:
        """``query`` on a connection that creates and changes nothing: ``immutable`` when
        the database is at rest, again through SQLite's locks if it moved meanwhile."""
        name = self._identity.path if self._identity is not None else self.path
        before = _at_rest(name)
        if before is not None:
            result = self._query_readonly(query, immutable=True)
            if _at_rest(name) == before:
                return result
        return self._query_readonly(query, immutable=False)

    def _query_readonly(self, query: Callable[[sqlite3.Connection], Any], *,
                        immutable: bool) -> Any:
        conn = connect_readonly(self.path, timeout=self._timeout, immutable=immutable,
                                shm_readonly=self._leave_shm)
        try:
            return query(conn)
        finally:
            conn.close()

    # ------------------------------------------------------------------ writing

    def append(self, run_id: str, events: Sequence[Event], expected_version: int, *,
               snapshot: Snapshot | None = None, step: Step | None = None,
               read_model: ReadModel | None = None,
               session_write: SessionWrite | tuple[SessionWrite, ...] | None = None
               ) -> None:
        """`IndexedStore.append`; with ``session_write``, its items go to its Session's
        rows in this file (`SQLiteSession` on the same file, which shares this
        transaction: ``shares_transaction_with``) in the append's own transaction, so a
        publication's items and its commit land together or not at all (DESIGN §7.7). A
        tuple of writes (`many_session_writes`) writes each in order, in the same
        transaction."""
        a = self._prepare(run_id, events, expected_version, snapshot, step, read_model,
                          session_write)
        where: dict[str, Any] = {"run_id": run_id}
        through = self._routed()
        if through is not None:  # (`in_transaction_of`)
            self._append_in(through[0], through[1], through[2], a)
            return
        with self._lock:
            self._check(_APPEND, **where)
            try:
                conn = self._live()
                with write_transaction(conn):
                    self._write(conn, a)
            except CommitFailed as failed:
                self._classify(failed, a.batch_id, _APPEND, **where)
            except (sqlite3.Error, OSError) as error:  # before COMMIT: nothing landed
                self._settle_connection()
                raise failure(error, self.path, outcome=Outcome.NOT_WRITTEN, doing=_APPEND,
                              **where) from error
            except BaseException:
                self._settle_connection()
                raise
            # the file was deleted or replaced during the append: it went into the void
            self._check(_APPEND, outcome=Outcome.UNKNOWN, **where)
            self.commits += 1
            if a.items is not None:
                self._session_table = True

    def shares_file_with(self, conn: sqlite3.Connection) -> bool:
        """Whether ``conn``, a connection of someone else's, has this store's file open as
        its main database (the same device and inode; a database in memory, a read-only
        store or a closed connection shares nothing): its transactions may then carry
        this store's appends (`in_transaction_of`)."""
        if self.readonly or self._identity is None:
            return False
        try:  # (in memory: no file, an empty name, which stat refuses)
            (main,) = [row[2] for row in conn.execute("PRAGMA database_list").fetchall()
                       if row[1] == "main"]
            st = os.stat(main)
        except (sqlite3.Error, OSError):
            return False
        return (st.st_dev, st.st_ino) == self._identity.identity

    @contextlib.contextmanager
    def in_transaction_of(self, conn: sqlite3.Connection, lock: Any = None, *,
                          gather: set[str] | None = None) -> Iterator[set[str]]:
        """Within: this thread's appends and reads of this store go through ``conn`` (a
        connection to this store's file, `shares_file_with`), inside the transaction it
        holds open with the file's write lock (``BEGIN IMMEDIATE``); the appends are
        never committed here. They land when that transaction commits and not at all when
        it rolls back: its owner decides, and nothing tells this store which. An owner
        that does not commit them as planned must stop the controllers that made them
        (their runs' ids are gathered in the set yielded, ``gather`` when given): a
        controller ahead of the store is caught by its next fence only until another
        attempt appends as many events (a fence counts events). The reads see them
        meanwhile, so a run's fence finds the version its controller flushed. Each append
        runs in a savepoint of its own, so a refused one (a
        version conflict, `LeaseHeld`) leaves the transaction as it found it. ``lock``:
        held around each call's statements, for a connection other threads use too
        (`SqliteSaver.lock`). An append when ``conn`` holds no open transaction is
        refused, nothing written.

        For a write of someone else's that must land with a run's events or not at all
        (a LangGraph checkpoint and its publication: `adapters.langgraph.OneWriterSaver`);
        `commits` does not count these appends, the transaction is not this store's."""
        if self.readonly:
            raise StorageError(f"cannot {_APPEND}: {shown(self.path)} is open read-only; "
                               "nothing was written", outcome=Outcome.NOT_WRITTEN)
        before = self._routed()
        routed: set[str] = set() if gather is None else gather
        self._through.into = (conn, lock, routed)
        try:
            yield routed
        finally:
            self._through.into = before

    def _append_in(self, conn: sqlite3.Connection, lock: Any, routed: set[str],
                   a: _Prepared) -> None:
        """One append inside ``conn``'s open transaction (`in_transaction_of`)."""
        where: dict[str, Any] = {"run_id": a.run_id}
        with storage_errors(self.path, doing=_APPEND, **where), (
                lock if lock is not None else contextlib.nullcontext()):
            self._check(_APPEND, **where)
            if not conn.in_transaction:
                raise StorageError(
                    f"cannot {_APPEND}: the connection it was to share holds no open "
                    "transaction; nothing was written", outcome=Outcome.NOT_WRITTEN,
                    **where)
            routed.add(a.run_id)  # (from here on its events may be in the transaction)
            conn.execute("SAVEPOINT statemachine_append")
            try:
                self._write(conn, a)
            except BaseException:
                conn.execute("ROLLBACK TO statemachine_append")
                raise
            finally:
                conn.execute("RELEASE statemachine_append")

    def _prepare(self, run_id: str, events: Sequence[Event], expected_version: int,
                 snapshot: Snapshot | None, step: Step | None, read_model: ReadModel | None,
                 session_write: SessionWrite | tuple[SessionWrite, ...] | None
                 ) -> _Prepared:
        """One append checked (`ValueError`, `TypeError`; `StorageError` when read-only)
        and encoded, before any lock or I/O."""
        if self.readonly:
            raise StorageError(f"cannot {_APPEND}: {shown(self.path)} is open "
                               "read-only; nothing was written", outcome=Outcome.NOT_WRITTEN,
                               run_id=run_id)
        events = tuple(events)  # read once: an iterator would be empty on the next read
        batch_id = uuid.uuid4().hex
        rows = [(run_id, event.seq, batch_id, event_text(event)) for event in events]
        if any(event.seq != expected_version + i for i, event in enumerate(events)):
            raise ValueError("events must carry the sequence numbers that follow "
                             "expected_version")
        items = None if session_write is None else _session_rows(session_write, events)
        checks = () if session_write is None else _tail_checks(session_write)
        kept = None
        if snapshot is not None:
            text = dumps(snapshot)
            kept = (run_id, expected_version, text, digest(text))
        fold = to_index(run_id, events, step, read_model, expected_version)
        return _Prepared(run_id, events, expected_version, batch_id, rows, kept, fold,
                         items, checks)

    def _write(self, conn: sqlite3.Connection, a: _Prepared) -> None:
        """The body of one append, inside a write transaction (its own, or a group's
        savepoint): the version check against the log and its head, the rows, the
        snapshot, the head (its lease checked: `LeaseHeld`) and the Session's items.
        A refusal raises (`ConcurrencyConflict`, `SchemaError`); the caller rolls back."""
        run_id, expected_version = a.run_id, a.expected
        try:
            last, headed, head, *held = conn.execute(
                "SELECT (SELECT MAX(seq) FROM events WHERE run_id = ?), runs.run_id IS NOT "
                "NULL, runs.version, runs.owner, runs.lease_owner, runs.lease_until, "
                "runs.lease FROM (SELECT 1) LEFT JOIN runs ON runs.run_id = ?",
                (run_id, run_id)).fetchone()
            version = 0 if last is None else last + 1
            # never on top of lost rows: the log must be as long as its head says
            _checked(run_id, head, version, Loaded([]), "append")
            if version != expected_version:
                raise conflict(run_id, expected_version, version)
            conn.executemany(
                "INSERT INTO events (run_id, seq, batch_id, body) VALUES (?, ?, ?, ?)",
                a.rows)
            if a.kept is not None:
                conn.execute(
                    "INSERT OR REPLACE INTO snapshots (run_id, version, body, digest) "
                    "VALUES (?, ?, ?, ?)", a.kept)
            if a.events:
                self._keep_head(conn, run_id, a.events, expected_version, a.fold,
                                tuple(held) if headed else None)
            if a.items is not None:
                if not self._session_table:  # (known made once an append of items landed)
                    conn.execute(_SESSION_TABLE)
                    conn.execute(_SESSION_INDEX)
                start = 0
                for position, write in a.checks:  # each Session's tail as it was staged
                    conn.executemany(_INSERT_ITEM, a.items[start:position])
                    start = position
                    assert write.after is not None
                    if session_moved(write, _session_bodies(conn, write.session_id,
                                                            len(write.after) + 1)):
                        raise moved_refusal(write, run_id)
                conn.executemany(_INSERT_ITEM, a.items[start:] if start else a.items)
        except sqlite3.IntegrityError:  # UNIQUE(run_id, seq): another writer got there
            raise conflict(run_id, expected_version, expected_version + 1) from None

    def append_group(self, group: Sequence[_Prepared]) -> list[BaseException | None]:
        """Several prepared appends (`_prepare`) in ONE write transaction, one COMMIT (one
        fsync): group commit, what `AsyncSQLiteEventStore` does with the appends waiting
        together (DESIGN §7.7). Each runs `_write` inside a savepoint of its own, in
        order, so two appends of one run behave as if serialized (the second sees the
        first's rows, or, if the first was refused, what is really there); a refused one
        is rolled back to its savepoint and fails alone. The answer: each append's
        outcome, None for landed, else its error (what `append` would raise). A COMMIT
        that fails is decided for each append as `append` decides it (`_classify`: its
        batch read back). `commits` counts the group's one transaction."""
        outcomes: list[BaseException | None] = [None] * len(group)
        with self._lock:
            try:
                self._check(_APPEND)
            except StorageError as refused:
                return [self._again(refused, a) for a in group]
            written: list[int] = []
            try:
                conn = self._live()
                conn.execute("BEGIN IMMEDIATE")
                for i, a in enumerate(group):
                    conn.execute("SAVEPOINT one_append")
                    try:
                        self._write(conn, a)
                    except Exception as error:
                        conn.execute("ROLLBACK TO one_append")
                        if not conn.in_transaction:  # SQLite rolled it all back itself
                            raise
                        outcomes[i] = (failure(error, self.path, outcome=Outcome.NOT_WRITTEN,
                                               doing=_APPEND, run_id=a.run_id)
                                       if isinstance(error, (sqlite3.Error, OSError))
                                       else error)
                    else:
                        written.append(i)
                    conn.execute("RELEASE one_append")
                if not written:
                    conn.execute("ROLLBACK")
                    return outcomes
            except BaseException as error:  # the transaction itself failed: nothing landed
                with contextlib.suppress(sqlite3.Error):
                    if self._conn is not None and self._conn.in_transaction:
                        self._conn.execute("ROLLBACK")
                self._settle_connection()
                return [failure(error, self.path, outcome=Outcome.NOT_WRITTEN,
                                doing=_APPEND, run_id=a.run_id)
                        if isinstance(error, (sqlite3.Error, OSError)) else error
                        for a in group]
            try:
                conn.execute("COMMIT")
            except sqlite3.Error as error:
                failed = CommitFailed(str(error))
                failed.__cause__ = error
                for i in written:  # each decided by its own batch, read back
                    try:
                        self._classify(failed, group[i].batch_id, _APPEND,
                                       run_id=group[i].run_id)
                    except StorageError as undecided:
                        outcomes[i] = undecided
            landed = [i for i in written if outcomes[i] is None]
            for i in landed:  # the file was deleted or replaced meanwhile: into the void
                try:
                    self._check(_APPEND, outcome=Outcome.UNKNOWN, run_id=group[i].run_id)
                except StorageError as lost:
                    outcomes[i] = lost
            if landed:
                self.commits += 1
                if any(group[i].items is not None for i in landed):
                    self._session_table = True
        return outcomes

    @staticmethod
    def _again(error: StorageError, a: _Prepared) -> StorageError:
        """``error`` (said of the store, not of one run) for the append ``a``."""
        return StorageError(error.reason, outcome=error.outcome, run_id=a.run_id)

    def _settle_connection(self) -> None:
        """After a failed write: a connection left inside a transaction (its ROLLBACK
        failed too) is closed, which rolls back, and opened again on next use."""
        if self._conn is not None and in_transaction(self._conn):
            self._drop_connection()

    def _drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:  # (a group's appends each drop it after a failed COMMIT)
            with contextlib.suppress(sqlite3.Error):
                conn.close()

    def _classify(self, failed: CommitFailed, batch_id: str, doing: str,
                  **where: Any) -> None:
        """A COMMIT raised: read the batch back. Found: appended (return). Not found:
        `StorageError` ``"not_written"``. Undecidable: ``"unknown"``."""
        cause = failed.__cause__ or failed
        self._drop_connection()  # a fresh one next time; closing rolls back what is left
        try:
            landed = self._landed(batch_id)
            self._check(doing, outcome=Outcome.UNKNOWN, **where)  # the probe read the right file
        except StorageError:
            raise
        except Exception as error:  # the read-back failed: cannot decide
            raise failure(cause, self.path, outcome=Outcome.UNKNOWN, doing=doing,
                          **where) from error
        if not landed:
            raise failure(cause, self.path, outcome=Outcome.NOT_WRITTEN, doing=doing,
                          **where) from cause

    def _landed(self, batch_id: str) -> bool:
        probe = sqlite3.connect(self.path, timeout=self._timeout)
        try:
            row = probe.execute("SELECT 1 FROM events WHERE batch_id = ? LIMIT 1",
                                (batch_id,)).fetchone()
        finally:
            probe.close()
        return row is not None

    def _keep_head(self, conn: sqlite3.Connection, run_id: str, events: Sequence[Event],
                   expected_version: int, fold: tuple[Step, ReadModel] | None,
                   row: tuple[Any, ...] | None) -> None:
        """Move the run's head (its version, step and read model, owner, ``updated_at``
        and lease) in the append's transaction (``fold`` None: unfolded); `LeaseHeld`
        (the transaction rolls back) for a claim that another owner's live lease refuses
        (`stored.next_lease`, by the wall clock). ``row``: the head's owner and lease as
        the append's transaction read them (None: the run has no head)."""
        claimed, owner = claimed_owner(events)
        value, model, kind = _fold_columns(fold)
        version = expected_version + len(events)
        at = events[-1].at
        if expected_version == 0:
            lease = next_lease(run_id, NO_LEASE, events, now_micros())
            conn.execute("INSERT OR REPLACE INTO runs (run_id, step, session_id, owner, "
                         "version, updated_at, lease_owner, lease_until, lease, read_model, "
                         "blocker) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                         (run_id, value, started_session(events), owner, version, at, *lease,
                          model, kind))
            return
        if row is None:  # a run an older writer logged without a head (and no lease)
            session, logged_owner = self._read_head(conn, run_id)
            lease = next_lease(run_id, NO_LEASE, events, now_micros())
            conn.execute("INSERT INTO runs (run_id, session_id, owner, version, updated_at, "
                         "lease_owner, lease_until, lease) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                         (run_id, session, owner if claimed else logged_owner, version, at,
                          *lease))
            return  # unfolded: its Session was read off a log this store did not write
        lease = row[1:]
        if claimed or lease[2] is not None:  # no lease involved: no clock read
            lease = next_lease(run_id, lease, events, now_micros())
        conn.execute("UPDATE runs SET step = ?, owner = ?, version = ?, updated_at = ?, "
                     "lease_owner = ?, lease_until = ?, lease = ?, read_model = ?, "
                     "blocker = ? WHERE run_id = ?",
                     (value, owner if claimed else row[0], version, at, *lease, model, kind,
                      run_id))

    # ------------------------------------------------------------------ reading

    def list_runs(self, session_id: str | None = None,
                  steps: Collection[Step] | None = None) -> tuple[RunHead, ...]:
        wanted = check_filters(session_id, steps)
        if wanted is not None and not wanted:
            return ()
        where, params = [], []
        if session_id is not None:
            where.append("session_id = ?")
            params.append(session_id)
        if wanted is not None:
            where.append(f"step IN ({', '.join('?' * len(wanted))})")
            params.extend(step.value for step in wanted)
        sql = head = (_OLDER_HEAD if not self._has_updated_at
                      else _OLD_HEAD if not self._has_leases
                      else _UNMODELLED_HEAD if not self._has_read_models else _HEAD)
        if where:  # and every unfolded head, which may match: folded below, then filtered
            sql = (f"{head} WHERE step IS NOT NULL AND {' AND '.join(where)} "
                   f"UNION ALL {head} WHERE step IS NULL")

        def query(conn: sqlite3.Connection) -> list[tuple[Any, ...]]:
            if not self._has_runs:  # a read-only look at a database made before heads
                return [(run_id, version, None, None, self._read_head(conn, run_id)[1],
                         _newest_at(conn, run_id), None, None, None, None)
                        for run_id, version in conn.execute(
                            "SELECT run_id, MAX(seq) + 1 FROM events GROUP BY run_id "
                            "ORDER BY run_id").fetchall()]
            return conn.execute(f"{sql} ORDER BY 1", params).fetchall()

        rows = self._read(query, doing="list the runs of the event store")
        heads = []
        for (run_id, stored_version, step, stored_session, owner, updated_at, holder,
             until, text, kind) in rows:
            if stored_version is None:
                continue  # a head without a log (rows are never deleted; be safe)
            model = None if step is None else kept_model(run_id, text, kind)
            if model is None:  # unfolded, or its read model does not decode: fold it
                folded = self._fill_unfolded_head(run_id)
                if folded is None:
                    continue
                version, known, session, model = folded
            else:
                try:
                    known = Step(step)
                except ValueError:
                    raise SchemaError("the run's head names an unknown step",
                                      run_id=run_id, action="list_runs") from None
                version, session = stored_version, stored_session
            if (session_id is None or session == session_id) and (
                    wanted is None or known in wanted):
                heads.append(RunHead(run_id, version, known, session, owner,
                                     _updated_at(run_id, updated_at), holder,
                                     _updated_at(run_id, until), model.blocker,
                                     model.waiting))
        return tuple(heads)

    def version(self, run_id: str) -> int:
        """How many events the run's log holds (0 for a run not in the store): one
        indexed read, what `RunController.fence` asks before an effect."""
        def query(conn: sqlite3.Connection) -> int:
            row = conn.execute("SELECT MAX(seq) FROM events WHERE run_id = ?",
                               (run_id,)).fetchone()
            return 0 if row is None or row[0] is None else int(row[0]) + 1

        return self._read(query, doing="read the run's version")  # type: ignore[no-any-return]

    def session_items(self, session_id: str, limit: int | None = None) -> list[JSON]:
        """The items of the `SQLiteSession` ``session_id`` in this file (all of them, or
        the last ``limit``), as the Session's ``get_items`` reads them, through this
        store's connection: the Session whose items this store writes in its appends
        (``session_write``), read where they are written, with no thread of the
        Session's (`runner.publish.run_history` reads so beside this store and its async
        face). `StorageError` as `SQLiteSession.get_items` raises it."""
        def query(conn: sqlite3.Connection) -> list[Any]:
            if not self._has_session_items(conn):
                return []
            return _session_bodies(conn, session_id, limit)

        bodies = self._read(query, doing=_READ_SESSION)
        return [_item(body, self.path, _READ_SESSION) for body in bodies]

    def _has_session_items(self, conn: sqlite3.Connection) -> bool:
        """Whether the file holds a Session table (kept once found: never dropped). Read
        outside any write transaction, so what it finds is committed; inside another's
        (`in_transaction_of`) it may be that transaction's own, so it is not kept."""
        if self._session_table:
            return True
        found = conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = "
                             "'session_items'").fetchone() is not None
        if self._routed() is None:
            self._session_table = found
        return found

    def run_ids(self, limit: int | None = None) -> list[str]:
        """The ids of the runs the store holds, sorted (the first ``limit`` of them)."""
        def query(conn: sqlite3.Connection) -> list[str]:
            return [row[0] for row in conn.execute(
                "SELECT DISTINCT run_id FROM events ORDER BY run_id LIMIT ?",
                (-1 if limit is None else limit,))]

        return self._read(query, doing="read the event store")  # type: ignore[no-any-return]

    def _fill_unfolded_head(self, run_id: str) -> Head | None:
        """Fold an unfolded head (or one whose read model does not decode) from the run's
        log and keep the result (only if the run has not moved meanwhile: a newer append
        keeps its own head; never when the store is read-only)."""
        snapshot, tail = self.load_latest(run_id)
        if snapshot is None and not tail:
            return None
        head = head_of_log(run_id, snapshot, tail, lambda: self.load(run_id))
        version, step, session, model = head
        if self.readonly or self._routed() is not None:
            return head  # (keeping it is a cache: not inside another's transaction)
        with self._lock:
            try:
                self._check("fold a run's head", run_id=run_id)
                with write_transaction(self._live()) as conn:
                    value, text, kind = _fold_columns((step, model))
                    conn.execute(f"UPDATE runs SET step = ?, session_id = ?, read_model = ?, "
                                 f"blocker = ? WHERE run_id = ? AND {_VERSION} = ?",
                                 (value, session, text, kind, run_id, version))
            except (CommitFailed, sqlite3.Error, OSError, StorageError):
                self._drop_connection()  # only a cache of the fold was lost: fold again
        return head

    def load(self, run_id: str) -> list[Event]:
        return self.load_measured(run_id).events

    def load_measured(self, run_id: str) -> Loaded:
        """`load`, with the size of the events when they were decoded together (clean
        rows, the common case): see `stores.load_measured`."""
        def query(conn: sqlite3.Connection) -> tuple[Any, Rows]:
            with read_transaction(conn):
                head = self._head_version(conn, run_id)
                return head, conn.execute(
                    "SELECT seq, body FROM events WHERE run_id = ? ORDER BY seq",
                    (run_id,)).fetchall()

        head, rows = self._read(query, doing="load a run", run_id=run_id)
        return _checked(run_id, head, 0, decode_rows(run_id, rows, 0))

    def _head_version(self, conn: sqlite3.Connection, run_id: str) -> Any:
        """The run's head's version (None: no head, or one that does not know it)."""
        if not self._has_versions:
            return None
        row = conn.execute("SELECT version FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        return None if row is None else row[0]

    def load_latest(self, run_id: str) -> tuple[Snapshot | None, list[Event]]:
        snapshot, tail = self.load_latest_measured(run_id)
        return snapshot, tail.events

    def load_latest_measured(self, run_id: str) -> tuple[Snapshot | None, Loaded]:
        """`load_latest`, with the size of the tail as `load_measured` measures it."""
        def query(conn: sqlite3.Connection
                  ) -> tuple[Snapshot | None, str | None, int, Any, Rows]:
            with read_transaction(conn):
                head = self._head_version(conn, run_id)
                found = conn.execute(
                    "SELECT version, body, digest FROM snapshots WHERE run_id = ?",
                    (run_id,)).fetchone() if self._has_digests else None
                snapshot, problem = verified_snapshot(run_id, found)
                version = 0
                if snapshot is not None:
                    assert found is not None
                    version = found[0]
                    present = conn.execute(
                        "SELECT COUNT(*) FROM events WHERE run_id = ? AND seq IN (0, ?)",
                        (run_id, version - 1)).fetchone()[0]
                    if present != (1 if version == 1 else 2):  # it vouches for them
                        raise SchemaError(
                            f"the stored log is truncated or has a gap: its verified "
                            f"snapshot is at version {version}, but event {version - 1} "
                            "or event 0 is missing", run_id=run_id, action="load")
                rows = conn.execute(
                    "SELECT seq, body FROM events WHERE run_id = ? AND seq >= ? ORDER BY seq",
                    (run_id, version)).fetchall()
            return snapshot, problem, version, head, rows

        snapshot, problem, version, head, rows = self._read(query, doing="load a run",
                                                            run_id=run_id)
        if problem is not None:
            snapshot_ignored(run_id, problem)
        return snapshot, _checked(run_id, head, version, decode_rows(run_id, rows, version))


def _describe(conn: sqlite3.Connection
              ) -> tuple[set[str], set[str], bool, bool, bool, bool, bool]:
    """The tables of a database, the columns of its ``events`` table, whether its
    snapshots have a digest, whether its heads have a version, whether they keep
    ``updated_at``, whether they keep leases and whether they keep read models."""
    tables = {row[0] for row in conn.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table'")}
    columns = {row[1] for row in conn.execute("PRAGMA table_info(events)")}
    return (tables, columns, _has_digest(conn), _has_column(conn, "runs", "version"),
            _has_column(conn, "runs", "updated_at"), _has_column(conn, "runs", "lease"),
            _has_column(conn, "runs", "read_model"))


def _fold_columns(fold: tuple[Step, ReadModel] | None
                  ) -> tuple[str | None, str | None, str | None]:
    """A head's ``step``, ``read_model`` and ``blocker`` columns (all NULL: unfolded)."""
    if fold is None:
        return None, None, None
    step, model = fold
    kind = None if model.blocker is None else model.blocker.kind.value
    return step.value, model.encode(), kind


def _has_version(conn: sqlite3.Connection) -> bool:
    return _has_column(conn, "runs", "version")


def _checked(run_id: str, head: Any, first: int, loaded: Loaded, action: str = "load"
             ) -> Loaded:
    """``loaded`` (the log from seq ``first`` on), checked against its head's version
    (None: no head, or one that does not know it). A log shorter or longer than its head
    says lost rows or was written past this store: `SchemaError`, never a shorter log."""
    if head is not None and head != first + len(loaded.events):
        raise SchemaError(f"the stored log holds {first + len(loaded.events)} events but "
                          f"its head says {head}: the store is damaged", run_id=run_id,
                          action=action)
    return loaded


def _newest_at(conn: sqlite3.Connection, run_id: str) -> int | None:
    """The ``at`` of a run's newest event, read off its log (for a database without
    heads); None when it has none, or does not decode (loading the run refuses it)."""
    row = conn.execute("SELECT seq, body FROM events WHERE run_id = ? ORDER BY seq DESC "
                       "LIMIT 1", (run_id,)).fetchone()
    try:
        return None if row is None else codec.decode_stored_text(row[1], row[0]).at
    except ControlError:
        return None


def _has_column(conn: sqlite3.Connection, table: str, column: str) -> bool:
    return any(row[1] == column for row in conn.execute(f"PRAGMA table_info({table})"))


def _updated_at(run_id: str, value: object) -> int | None:
    """A head row's ``updated_at``: an int or NULL; anything else is a damaged store."""
    if value is None or type(value) is int:
        return value
    raise SchemaError("the run's head holds a time that is not an integer", run_id=run_id,
                      action="list_runs")


def _in_memory(path: str) -> bool:
    """Whether ``path`` names no file (SQLite's in-memory and temporary databases)."""
    return path in ("", ":memory:")


def _has_digest(conn: sqlite3.Connection) -> bool:
    return any(row[1] == "digest" for row in conn.execute("PRAGMA table_info(snapshots)"))


def _at_rest(name: str) -> tuple[int, int, int, int] | None:
    """The identity, size and mtime of a database with no side file beside it (None when
    it has one: a writer may be at work)."""
    if any(os.path.lexists(name + suffix) for suffix in _SIDE_FILES):
        return None
    st = os.stat(name)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


GROUP_LIMIT = 64
"""The most appends `AsyncSQLiteEventStore` writes in one group (one transaction)."""


class AsyncSQLiteEventStore:
    """The async face of `SQLiteEventStore` (an `AsyncEventStore`): every call runs the
    sync store's method on one worker thread of its own, so an asyncio runner's event loop
    never waits for a lock or an fsync. Calls run on that thread one at a time, in order,
    except that appends are group-committed.

    Group commit (DESIGN §7.7): the appends waiting when the worker thread becomes free
    (at most `GROUP_LIMIT`, in the order they were made) are written in one transaction,
    one COMMIT and so one fsync for all of them (`SQLiteEventStore.append_group`): each in
    a savepoint of its own, so one run's refusal (a version conflict, `LeaseHeld`) fails
    only that append, two appends of one run behave as if serialized, and each caller
    gets its own append's outcome. ``commits`` counts one commit per group.
    ``group_commit=False`` writes each append in its own transaction, as the sync store
    does (the bench's comparison). A sync store whose ``append`` is overridden (a test's
    recording store set as ``sync``) is called one append at a time, through it.

    An append cancelled before its group is taken is never written; once taken, it lands
    or fails with its group, whether its caller still waits or not."""

    keeps_leases = True
    """Leases are checked and moved in each append's transaction (`stored.next_lease`):
    a claim landing while another owner's lease is live is refused (`LeaseHeld`)."""
    keeps_read_models = True
    """Each append keeps the run's `ReadModel` (``read_model=``) in its head, beside the
    step, in the append's transaction (`stores.keeps_read_models`)."""
    many_session_writes = True
    """``append`` takes a tuple of `SessionWrite` (`stores.many_session_writes`)."""
    checks_session_tail = True
    """A `SessionWrite`'s ``after`` is checked in the append's transaction, against the
    Session's rows in this file (`stores.checks_session_tail`)."""

    def __init__(self, path: str | os.PathLike[str], *, timeout: float = 30.0,
                 group_commit: bool = True) -> None:
        self.sync = SQLiteEventStore(path, timeout=timeout)
        self.group_commit = group_commit
        self._worker = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="statemachine-sqlite")
        self._queue_lock = threading.Lock()
        self._waiting: collections.deque[tuple[_Call, concurrent.futures.Future[None]]] = (
            collections.deque())
        self._draining = False

    async def _call(self, fn: Callable[..., T], *args: Any, of_run: str | None = None,
                    **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on the store's worker thread, after the calls made
        before it; `StorageError` once the store is closed (``of_run``: the run the call
        is about, which the error names)."""
        loop = asyncio.get_running_loop()
        try:
            done = loop.run_in_executor(self._worker, functools.partial(fn, *args, **kwargs))
        except RuntimeError:  # the worker was shut down: the store is closed
            raise self._closed_error(getattr(fn, "__name__", "call"), of_run) from None
        return await done

    @staticmethod
    def _closed_error(doing: str, run_id: str | None = None) -> StorageError:
        where = {} if run_id is None else {"run_id": run_id}
        return StorageError(f"cannot {doing}: the event store is closed",
                            outcome=Outcome.NOT_WRITTEN, **where)

    async def append(self, run_id: str, events: Sequence[Event], expected_version: int, *,
                     snapshot: Snapshot | None = None, step: Step | None = None,
                     read_model: ReadModel | None = None,
                     session_write: SessionWrite | tuple[SessionWrite, ...] | None = None
                     ) -> None:
        """`SQLiteEventStore.append`, off the event loop (group-committed: see the
        class)."""
        if not (self.group_commit
                and getattr(type(self.sync), "append", None) is SQLiteEventStore.append):
            options: dict[str, Any] = {"snapshot": snapshot, "step": step,
                                       "read_model": read_model}
            if session_write is not None:  # (a wrapped sync store may not name it)
                options["session_write"] = session_write
            await self._call(self.sync.append, run_id, events, expected_version,
                             of_run=run_id, **options)
            return
        call = _Call(run_id, events, expected_version, snapshot, step, read_model,
                     session_write)
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        with self._queue_lock:
            self._waiting.append((call, done))
            if not self._draining:
                try:
                    self._worker.submit(self._drain)
                except RuntimeError:  # the worker was shut down: the store is closed
                    self._waiting.pop()
                    raise self._closed_error(_APPEND, run_id) from None
                self._draining = True
        await asyncio.wrap_future(done)

    def _drain(self) -> None:
        """On the worker thread: write the appends waiting now as one group, and leave
        the ones that come meanwhile (or past `GROUP_LIMIT`) to the next."""
        taken: list[tuple[_Call, concurrent.futures.Future[None]]] = []
        with self._queue_lock:
            while self._waiting and len(taken) < GROUP_LIMIT:
                call, done = self._waiting.popleft()
                if done.set_running_or_notify_cancel():  # cancelled before taken: dropped
                    taken.append((call, done))
            self._draining = bool(self._waiting)
            if self._draining:  # after the calls queued meanwhile, in order
                try:
                    self._worker.submit(self._drain)
                except RuntimeError:  # shut down: nothing more is written
                    self._draining = False
                    self._refuse_waiting()
        if not taken:
            return
        outcomes: list[BaseException | None] = [None] * len(taken)
        group: list[_Prepared] = []
        where: list[int] = []
        for i, (call, _) in enumerate(taken):
            try:
                group.append(self.sync._prepare(*call))
                where.append(i)
            except BaseException as refused:
                outcomes[i] = refused
        try:
            for i, outcome in zip(where, self.sync.append_group(group), strict=True):
                outcomes[i] = outcome
        except BaseException as error:  # never leave a caller waiting
            for i in where:
                outcomes[i] = error
        for (_, done), outcome in zip(taken, outcomes, strict=True):
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                if outcome is None:
                    done.set_result(None)
                else:
                    done.set_exception(outcome)

    def _refuse_waiting(self) -> None:
        while self._waiting:
            call, done = self._waiting.popleft()
            if done.set_running_or_notify_cancel():
                done.set_exception(self._closed_error(_APPEND, call.run_id))

    @property
    def path(self) -> str:
        return self.sync.path

    @property
    def commits(self) -> int:
        """As `SQLiteEventStore.commits` (one per group of appends)."""
        return self.sync.commits

    async def load(self, run_id: str) -> list[Event]:
        return await self._call(self.sync.load, run_id, of_run=run_id)

    async def load_latest(self, run_id: str) -> tuple[Snapshot | None, list[Event]]:
        return await self._call(self.sync.load_latest, run_id, of_run=run_id)

    async def list_runs(self, session_id: str | None = None,
                        steps: Collection[Step] | None = None) -> tuple[RunHead, ...]:
        return await self._call(self.sync.list_runs, session_id, steps)

    async def version(self, run_id: str) -> int:
        """As `SQLiteEventStore.version`."""
        return await self._call(self.sync.version, run_id, of_run=run_id)

    async def session_items(self, session_id: str, limit: int | None = None) -> list[JSON]:
        """`SQLiteEventStore.session_items` on the store's worker thread, after the calls
        made before it (an append's items it waited for included)."""
        return await self._call(self.sync.session_items, session_id, limit)

    async def close(self) -> None:
        """Close the store, after the calls made before it; then every call is refused
        with `StorageError` (``not_written``), and closing it again does nothing."""
        with contextlib.suppress(StorageError):  # (closed already)
            await self._call(self.sync.close)
        self._worker.shutdown(wait=False)


class _Call(NamedTuple):
    """An append's arguments, as `SQLiteEventStore._prepare` takes them."""

    run_id: str
    events: Sequence[Event]
    expected: int
    snapshot: Snapshot | None
    step: Step | None
    read_model: ReadModel | None
    session_write: SessionWrite | tuple[SessionWrite, ...] | None


# ------------------------------------------------------------------------ the Session


_SESSION_TABLE = ("CREATE TABLE IF NOT EXISTS session_items (id INTEGER PRIMARY KEY "
                  "AUTOINCREMENT, session_id TEXT NOT NULL, body TEXT NOT NULL)")
_SESSION_INDEX = ("CREATE INDEX IF NOT EXISTS session_items_by_session "
                  "ON session_items (session_id, id)")


_READ_SESSION = "read the Session"


def _NOBODY() -> None:
    """A weak reference to nothing."""


def _session_bodies(conn: sqlite3.Connection, session_id: str, limit: int | None
                    ) -> list[Any]:
    """The stored bodies of a Session's items, in order: all of them, or the last
    ``limit``."""
    if limit is None:
        rows = conn.execute("SELECT body FROM session_items WHERE session_id = ? ORDER BY id",
                            (session_id,)).fetchall()
    else:
        rows = conn.execute(
            "SELECT body FROM (SELECT id, body FROM session_items WHERE session_id = ?"
            " ORDER BY id DESC LIMIT ?) ORDER BY id", (session_id, max(limit, 0))).fetchall()
    return [body for (body,) in rows]


def _item(body: Any, path: str, doing: str) -> JSON:
    """A stored Session item parsed; `StorageError` for one that is not JSON."""
    try:
        return json.loads(body)
    except (ValueError, TypeError, RecursionError):
        raise StorageError(f"cannot {doing}: {shown(path)} holds a damaged "
                           "item (not JSON)", outcome=Outcome.NOT_WRITTEN) from None


def _tail_checks(write: SessionWrite | tuple[SessionWrite, ...]
                 ) -> tuple[tuple[int, SessionWrite], ...]:
    """`_Prepared.checks` of a ``session_write``: each write whose ``after`` is set, with
    the position of its first row among the append's Session rows."""
    checks = []
    position = 0
    for one in session_writes(write):
        if one.after is not None:
            checks.append((position, one))
        position += len(one.items)
    return tuple(checks)


_INSERT_ITEM = "INSERT INTO session_items (session_id, body) VALUES (?, ?)"


def _session_rows(write: SessionWrite | tuple[SessionWrite, ...],
                  events: Sequence[Event]) -> list[tuple[str, str]]:
    """The rows of a ``session_write`` (one, or a tuple of them in order) as detached JSON
    text, checked before any I/O."""
    writes = session_writes(write)
    if not events:  # the read-back after a lost COMMIT finds a batch by its events
        raise ValueError("a session_write needs events to carry it")
    if any(type(one.session_id) is not str for one in writes):
        raise TypeError("session_id must be a str")
    return [(one.session_id, dumps(detach(item))) for one in writes for item in one.items]


class SQLiteSession:
    """A Session in a real SQLite database file (WAL, ``synchronous=FULL``).

    ``add_items`` writes its batch in one transaction: all of it or none of it. Several
    sessions (and processes) may share one file; rows are keyed by ``session_id``.

    Every `sqlite3.Error` and `OSError` of a public call is a `StorageError` (a locked,
    read-only, full, damaged file, or a stored item that is not JSON) with an
    ``outcome``: ``"not_written"`` when nothing of a write landed (and for every read),
    ``"unknown"`` when its COMMIT raised (it may have landed). A write's error reaches
    the runner as the write's error, like any Session's: ``publish`` reports it with
    ``publication_failed`` and re-raises it (I6). ``timeout`` is SQLite's busy timeout.

    Every call runs on a worker thread of the Session's own, never on the event loop
    (which would otherwise stop for each fsync, and for as long as another connection
    holds the file's lock), one call at a time and in the order they were made: a read
    after a write sees it. A call cancelled while it runs is finished on that thread (a
    write lands whole or not at all, as ever), and the calls made after it wait for it.
    Beside a `SQLiteEventStore` of its own file (or its async face), which writes its
    items in the store's appends, the runners read it through that store
    (`SQLiteEventStore.session_items`: the sync store on the caller's thread, the async
    one on its worker thread), not through these calls.
    """

    def __init__(self, session_id: str, path: str | os.PathLike[str], *,
                 timeout: float = 30.0) -> None:
        if type(session_id) is str and (problem := text_problem(session_id)) is not None:
            # refused as PostgreSQL refuses it, so a run moves between stores unchanged
            raise SchemaError(f"session_id {problem}", action="open the Session")
        self.session_id = session_id
        self.path = os.fspath(path)
        self._timeout = timeout
        self._lock = threading.Lock()
        self.commits = 0
        """How many write transactions this Session committed (`SQLiteEventStore.commits`
        counts the ones its store wrote for it)."""
        self._sharing: Callable[[], object] = _NOBODY
        """The store last found to share this Session's transaction (a weak reference)."""
        self._worker = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="statemachine-sqlite-session")
        with storage_errors(self.path, doing="open the Session"):
            self._conn = connect(self.path, timeout=timeout)
            try:
                self._conn.execute(_SESSION_TABLE)
                self._conn.execute(_SESSION_INDEX)
            except BaseException:
                self._conn.close()
                raise

    def shares_transaction_with(self, store: object) -> bool:
        """Whether ``store`` writes this Session's items in its own append transaction:
        a writable `SQLiteEventStore` (or its async face) on this very file. Then
        ``statemachine.runner.publish`` hands a publication's items to the store with its
        commit event (`SessionWrite`), one transaction and one fsync for both, as with
        `PostgresSession` (DESIGN §7.7)."""
        if store is not None and store is self._sharing():
            return True  # (asked before every publication and read: the files are the same)
        sync = getattr(store, "sync", store)
        if (not isinstance(sync, SQLiteEventStore) or sync.readonly
                or not takes_session_write(sync)):
            return False
        shared = same_file(sync.path, self.path)
        if shared:
            self._sharing = weakref.ref(store)
        return shared

    def close(self) -> None:
        with self._lock:
            self._conn.close()
        self._worker.shutdown(wait=False)

    async def _off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the Session's worker thread; `StorageError` (``not_written``)
        once the Session is closed."""
        loop = asyncio.get_running_loop()
        try:
            done = loop.run_in_executor(self._worker, fn, *args)
        except RuntimeError:  # the worker was shut down: the Session is closed
            doing = getattr(fn, "__name__", "call").lstrip("_").replace("_", " ")
            raise StorageError(f"cannot {doing}: the Session {self.session_id!r} is closed",
                               outcome=Outcome.NOT_WRITTEN) from None
        return await done

    def _failed(self, error: BaseException, doing: str, outcome: Outcome) -> StorageError:
        if in_transaction(self._conn):  # a failed ROLLBACK: closing rolls back
            with contextlib.suppress(sqlite3.Error):
                self._conn.close()
            with contextlib.suppress(sqlite3.Error, OSError):
                self._conn = connect(self.path, timeout=self._timeout)
        return failure(error, self.path, outcome=outcome, doing=doing)

    async def get_items(self, limit: int | None = None) -> list[JSON]:
        return await self._off_loop(self._get_items, limit)

    async def add_items(self, items: list[JSON]) -> None:
        # detached here, on the caller's side: a value that is not plain JSON is refused
        # before anything runs, and the caller's items are never read from the thread
        bodies = [(self.session_id, dumps(detach(item))) for item in items]
        await self._off_loop(self._add_items, bodies)

    async def pop_item(self) -> JSON | None:
        return await self._off_loop(self._pop_item)

    async def clear_session(self) -> None:
        await self._off_loop(self._clear_session)

    def _get_items(self, limit: int | None) -> list[JSON]:
        with self._lock, storage_errors(self.path, doing=_READ_SESSION):
            rows = _session_bodies(self._conn, self.session_id, limit)
        return [_item(body, self.path, _READ_SESSION) for body in rows]

    def _item(self, body: Any, doing: str) -> JSON:
        return _item(body, self.path, doing)

    def _add_items(self, bodies: list[tuple[str, str]]) -> None:
        doing = "write to the Session"
        with self._lock:
            try:
                with write_transaction(self._conn) as conn:
                    conn.executemany(_INSERT_ITEM, bodies)
                    self._before_commit()
            except CommitFailed as failed:
                raise self._failed(failed.__cause__ or failed, doing, Outcome.UNKNOWN) from None
            except (sqlite3.Error, OSError) as error:
                raise self._failed(error, doing, Outcome.NOT_WRITTEN) from error
            self.commits += 1
        self._after_commit()

    def _before_commit(self) -> None:
        """A seam for fault injection (tests kill the process here)."""

    def _after_commit(self) -> None:
        """A seam for fault injection (tests kill the process here)."""

    def _pop_item(self) -> JSON | None:
        doing = "pop an item from the Session"
        with self._lock:
            try:
                with write_transaction(self._conn) as conn:
                    row = conn.execute(
                        "SELECT id, body FROM session_items WHERE session_id = ? "
                        "ORDER BY id DESC LIMIT 1", (self.session_id,)).fetchone()
                    item = None if row is None else self._item(row[1], doing)
                    if row is not None:  # a damaged item is refused before it is removed
                        conn.execute("DELETE FROM session_items WHERE id = ?", (row[0],))
            except CommitFailed as failed:
                raise self._failed(failed.__cause__ or failed, doing, Outcome.UNKNOWN) from None
            except (sqlite3.Error, OSError) as error:
                raise self._failed(error, doing, Outcome.NOT_WRITTEN) from error
            self.commits += 1
        return item

    def _clear_session(self) -> None:
        doing = "clear the Session"
        with self._lock:
            try:
                with write_transaction(self._conn) as conn:
                    conn.execute("DELETE FROM session_items WHERE session_id = ?",
                                 (self.session_id,))
            except CommitFailed as failed:
                raise self._failed(failed.__cause__ or failed, doing, Outcome.UNKNOWN) from None
            except (sqlite3.Error, OSError) as error:
                raise self._failed(error, doing, Outcome.NOT_WRITTEN) from error
