"""Event stores: where a run's log lives between processes.

`EventStore` is the protocol the controller binds to: ``append(run_id, events,
expected_version)`` succeeds only if the run's log holds exactly ``expected_version``
events (otherwise `ConcurrencyConflict`, and nothing is written), and ``load(run_id)``
returns the whole log (empty for an unknown run). Versions are log lengths, and the
uniqueness of (run id, seq) is the optimistic-concurrency primitive. A backend failure is
a `StorageError` whose ``outcome`` says whether an append certainly did not land
(``"not_written"``) or may have (``"unknown"``); the controller also types a `sqlite3`
error or an `OSError` that another store lets through.

Both stores here also keep snapshots: a controller hands ``append`` the encoded state at
``expected_version`` every `SNAPSHOT_EVERY` events, the store writes it in the same
transaction, and ``load_latest`` returns the newest snapshot with the events after it, so
loading is O(1) in log length. Snapshots are optional for other stores, and never trusted
blindly: one that does not check out (`restored`; the SQLite store also checks a digest
and the version) is ignored with a `SnapshotIgnored` warning and the whole log replayed.

Both also index runs by Session (`IndexedStore`, optional for other stores): a run head
per run (`RunHead`: version, step, Session, owner) kept in the same transaction as each
append, and ``list_runs(session_id=None, steps=None)``. That is how a runner finds out,
before it writes to a Session, that another run has an unsettled publication there
(DESIGN §6.4). The store cannot fold a log itself on every append, so a controller hands
an `IndexedStore`'s ``append`` the step its events lead to (``step=``); everything else in
the head the store reads off the events it writes (the Session from `RunStarted`, the
owner from the last `RunClaimed`). A run's first append is its whole log, so a store
folds it there when no ``step`` is given (`RunController.start` gives none): that costs
what encoding those events does. A later append without ``step`` (a caller writing
events directly) leaves the head's step *unfolded* until an append gives one again;
``list_runs`` folds an unfolded head from the run's log (snapshot plus tail) and keeps
the result.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import hashlib
import hmac
import inspect
import json
import os
import sqlite3
import threading
import uuid
import warnings
from collections.abc import Callable, Collection, Sequence
from typing import Any, Protocol, TypeGuard, TypeVar, runtime_checkable

import attrs

from statemachine import codec, sqlite
from statemachine import events as ev
from statemachine.errors import ConcurrencyConflict, ControlError, SchemaError, StorageError
from statemachine.events import Event
from statemachine.machine import replay, replay_onto
from statemachine.payloads import JSON
from statemachine.state import RunState
from statemachine.values import Step

T = TypeVar("T")

SNAPSHOT_EVERY = 256
"""How often (in events) a controller hands its store a snapshot."""

Snapshot = dict[str, JSON]
UNTYPED_BACKEND_ERRORS: tuple[type[Exception], ...] = (sqlite3.Error, OSError)
"""The backend errors a store may let through untyped: the journal types them as a
`StorageError` (outcome ``"unknown"`` for an append, ``"not_written"`` for a read), so
no `sqlite3` error or `OSError` escapes a public call."""


@runtime_checkable
class EventStore(Protocol):
    """One append-only log per run id; versions are lengths."""

    def append(self, run_id: str, events: Sequence[Event], expected_version: int, *,
               snapshot: Snapshot | None = None) -> None:
        """Append ``events`` atomically if the log holds ``expected_version`` events;
        `ConcurrencyConflict` (nothing written) otherwise. ``snapshot``, when given, is
        the encoded state at ``expected_version``; a store may keep or ignore it. A
        backend failure is `StorageError` (``outcome``: ``"not_written"`` or
        ``"unknown"``)."""

    def load(self, run_id: str) -> list[Event]:
        """The run's whole log, in order (empty when the run is unknown); never a log
        with a gap (`SchemaError`). A backend failure is `StorageError`."""


@runtime_checkable
class SnapshotStore(EventStore, Protocol):
    """A store that keeps the snapshots it is handed."""

    def load_latest(self, run_id: str) -> tuple[Snapshot | None, list[Event]]:
        """The newest snapshot (None if there is none) and every event after it."""


@attrs.frozen
class Loaded:
    """Events a store read, with ``size``: the UTF-8 length of their compact JSON joined
    by commas (what they add to `to_json()`'s ``"events"``) when the store measured it
    while decoding them, else None (the controller sizes each event)."""

    events: list[Event]
    size: int | None = None


def load_measured(store: EventStore, run_id: str) -> Loaded:
    """The whole log of ``run_id`` with the size the store measured, when it offers one
    (an optional ``load_measured`` method); else ``load`` with no size."""
    own = getattr(store, "load_measured", None)
    if own is not None:
        return own(run_id)  # type: ignore[no-any-return]
    events = store.load(run_id)
    return Loaded(list(events), codec.measured_size(events))


def load_latest_measured(store: SnapshotStore, run_id: str) -> tuple[Snapshot | None, Loaded]:
    """`SnapshotStore.load_latest` with the size the store measured for the tail (an
    optional ``load_latest_measured`` method); else with no size."""
    own = getattr(store, "load_latest_measured", None)
    if own is not None:
        return own(run_id)  # type: ignore[no-any-return]
    snapshot, tail = store.load_latest(run_id)
    return snapshot, Loaded(list(tail), codec.measured_size(tail))


@attrs.frozen
class RunHead:
    """Where one run stands, as its store indexes it (DESIGN §6.7's run head row)."""

    run_id: str
    version: int
    """How many events the run's log holds."""
    step: Step
    """The step the log leads to."""
    session_id: str | None
    """The run's Session (None: a run without one)."""
    owner: str | None = None
    """The owner of the run's last `RunClaimed` (None before any claim, or claimed
    without an owner)."""


@attrs.frozen
class SessionWrite:
    """A publication's Session items, handed to a store with the publication's commit
    event so both land in one transaction (DESIGN §6.7): a store whose ``append`` takes
    ``session_write=`` (the PostgreSQL stores) writes ``items`` to the Session
    ``session_id``, tagged with ``publication_id``, in the append's own transaction. Build
    one for `RunController.publication_committed` (``statemachine.runner.publish`` does
    when the Session shares the store's database)."""

    session_id: str
    publication_id: str
    """``f"{run_id}:{seq}"``: the seq of the event that opened the attempt (its
    `PublicationStaged`, or the `ReconciledAppend` of a reconcile that said Append)."""
    items: tuple[JSON, ...]


_TAKES_WRITE: dict[type, bool] = {}


def takes_session_write(store: object) -> bool:
    """Whether ``store``'s ``append`` accepts ``session_write=`` (cached per class)."""
    kind = type(store)
    found = _TAKES_WRITE.get(kind)
    if found is None:
        append = getattr(store, "append", None)
        try:
            found = append is not None and "session_write" in inspect.signature(
                append).parameters
        except (TypeError, ValueError):
            found = False
        _TAKES_WRITE[kind] = found
    return found


@runtime_checkable
class IndexedStore(EventStore, Protocol):
    """A store that indexes runs by Session: one `RunHead` per run, kept up to date in
    the same transaction as each append.

    A controller bound to an `IndexedStore` passes ``step=`` to every ``append`` (and
    only to such a store, so an `EventStore` whose ``append`` has no ``step`` keeps
    working); a store that does not index runs never sees it."""

    def append(self, run_id: str, events: Sequence[Event], expected_version: int, *,
               snapshot: Snapshot | None = None, step: Step | None = None) -> None:
        """As `EventStore.append`; ``step`` is the step the run is in after ``events``.
        None: unknown (a run's first append is folded at once; after that the head's
        step is folded from the log when it is next listed). The head's version, Session
        and owner come from the events themselves."""

    def list_runs(self, session_id: str | None = None,
                  steps: Collection[Step] | None = None) -> tuple[RunHead, ...]:
        """The heads of the runs on ``session_id`` (every run when None) whose step is in
        ``steps`` (any step when None), ordered by run id."""


@runtime_checkable
class AsyncEventStore(Protocol):
    """The async store (DESIGN §6.7): `IndexedStore` and `SnapshotStore` with coroutines,
    for runners that must not block their event loop. A controller bound to one buffers
    its events and appends them at effect boundaries (``await controller.flush_async()``);
    load one with ``await RunController.load_async(store, run_id)``."""

    async def append(self, run_id: str, events: Sequence[Event], expected_version: int, *,
                     snapshot: Snapshot | None = None, step: Step | None = None) -> None:
        """As `IndexedStore.append`."""

    async def load(self, run_id: str) -> list[Event]:
        """As `EventStore.load`."""

    async def load_latest(self, run_id: str) -> tuple[Snapshot | None, list[Event]]:
        """As `SnapshotStore.load_latest`."""

    async def list_runs(self, session_id: str | None = None,
                        steps: Collection[Step] | None = None) -> tuple[RunHead, ...]:
        """As `IndexedStore.list_runs`."""


_INDEXED: dict[type, bool] = {}


def indexes_runs(store: object) -> TypeGuard[IndexedStore]:
    """Whether ``store``'s class implements `IndexedStore` (cached per class: this is
    asked on every append, and a runtime protocol check costs microseconds)."""
    kind = type(store)
    found = _INDEXED.get(kind)
    if found is None:
        found = _INDEXED[kind] = isinstance(store, IndexedStore)
    return found


def _claim_in(events: Sequence[Event]) -> tuple[bool, str | None]:
    """Whether ``events`` hold a `RunClaimed`, and the owner of the last one."""
    for event in reversed(events):
        if type(event) is ev.RunClaimed:
            return True, event.owner
    return False, None


def _started_session(events: Sequence[Event]) -> str | None:
    first = events[0] if events else None
    return first.session_id if type(first) is ev.RunStarted else None


def _first_step(run_id: str, events: Sequence[Event], step: Step | None,
                expected_version: int) -> Step | None:
    """The step to index: ``step`` when given; for a run's first append (its whole log)
    the step it folds to; otherwise None (unfolded). A first append that does not fold
    is left unfolded: folding it again where it is listed rejects it there."""
    if step is not None or expected_version != 0 or not events:
        return step
    try:
        return replay(run_id, events).step
    except ControlError:
        return None


class SnapshotIgnored(UserWarning):
    """A stored snapshot failed its checks (digest, JSON, shape, version within the log,
    run id) and was ignored: the whole log was replayed instead. Issued with
    `warnings.warn`; the run loads correctly, so this is news for an operator (a damaged
    or edited store), not an error. Silence or escalate it with `warnings.filterwarnings`.
    """


def snapshot_ignored(run_id: str, why: str) -> None:
    """Warn (`SnapshotIgnored`) that ``run_id``'s snapshot is not used, and why."""
    warnings.warn(f"run {run_id[:200]!r}: the stored snapshot is ignored ({why}); the "
                  "whole log is replayed instead", SnapshotIgnored, stacklevel=3)


def restored(run_id: str, snapshot: Snapshot | None, tail: Sequence[Event]) -> RunState | None:
    """The state ``snapshot`` holds, if it is usable for ``run_id`` with ``tail`` (the
    events after it): None when there is none, when it is of another ``state_version``
    (silently: an older library's snapshot), or, with a `SnapshotIgnored` warning, when
    it does not restore (bad shape or values: whatever `RunState.restore` raises), is
    another run's, or does not meet the tail (the tail must start right after it)."""
    if snapshot is None:
        return None
    try:
        state = RunState.restore(snapshot)
    except Exception as exc:  # a damaged snapshot raises anything
        snapshot_ignored(run_id, f"it does not restore: {type(exc).__name__}")
        return None
    if state is None:
        return None
    if state.run_id != run_id:
        snapshot_ignored(run_id, "it is another run's")
        return None
    if tail and tail[0].seq != state.last_seq + 1:
        snapshot_ignored(run_id, f"it ends at event {state.last_seq} but the events after "
                                 f"it start at {tail[0].seq}")
        return None
    return state


def _fold(run_id: str, snapshot: Snapshot | None, tail: list[Event],
          whole: Callable[[], list[Event]]) -> tuple[int, Step, str | None]:
    """Version, step and Session of a run, folded from its newest snapshot and the tail
    after it (the whole log when there is no usable snapshot, or when the tail does not
    replay onto it). A log that does not replay raises (`SchemaError`,
    `InvalidTransition`): fail closed."""
    state = restored(run_id, snapshot, tail)
    if state is not None:
        base = state.last_seq + 1
        try:
            replay_onto(state, tail, first=base)
        except ControlError:
            log = whole()  # the whole log decides: it raises too, or the snapshot was bad
            state = replay(run_id, log)
            snapshot_ignored(run_id, "the events after it do not replay onto it")
            return len(log), state.step, state.session_id
        return base + len(tail), state.step, state.session_id
    log = whole()
    state = replay(run_id, log)
    return len(log), state.step, state.session_id


def _check_filters(session_id: object, steps: object) -> frozenset[Step] | None:
    if session_id is not None and type(session_id) is not str:
        raise TypeError("session_id must be a str or None")
    if steps is None:
        return None
    if isinstance(steps, str | bytes) or not isinstance(steps, Collection) or any(
            type(step) is not Step for step in steps):
        raise TypeError("steps must be None or a collection of Step")
    return frozenset(steps)


def _conflict(run_id: str, expected: int, actual: int) -> ConcurrencyConflict:
    return ConcurrencyConflict(
        f"another writer moved the log: expected version {expected}, found {actual}",
        run_id=run_id)


class MemoryEventStore:
    """An in-process store (thread-safe). Events are immutable and kept as they are.
    Runs are indexed by Session (`IndexedStore`)."""

    def __init__(self) -> None:
        self._logs: dict[str, list[Event]] = {}
        self._snapshots: dict[str, tuple[int, Snapshot]] = {}
        self._by_session: dict[str | None, dict[str, None]] = {}
        """Run ids by Session (read off each run's `RunStarted`), in start order."""
        self._steps: dict[str, Step | None] = {}
        """Each run's step (None: unfolded, folded from the log when next listed)."""
        self._owners: dict[str, str | None] = {}
        self._lock = threading.Lock()

    def append(self, run_id: str, events: Sequence[Event], expected_version: int, *,
               snapshot: Snapshot | None = None, step: Step | None = None) -> None:
        step = _first_step(run_id, events, step, expected_version)
        with self._lock:
            log = self._logs.get(run_id, [])
            if len(log) != expected_version:
                raise _conflict(run_id, expected_version, len(log))
            self._logs[run_id] = log
            log.extend(events)
            if snapshot is not None:
                self._snapshots[run_id] = (expected_version, snapshot)
            if not events:
                return
            claimed, owner = _claim_in(events)
            self._steps[run_id] = step
            if expected_version == 0:
                self._by_session.setdefault(_started_session(events), {})[run_id] = None
                self._owners[run_id] = owner
            elif claimed:
                self._owners[run_id] = owner

    def list_runs(self, session_id: str | None = None,
                  steps: Collection[Step] | None = None) -> tuple[RunHead, ...]:
        wanted = _check_filters(session_id, steps)
        with self._lock:
            if session_id is None:
                run_ids = sorted(self._logs)
            else:
                run_ids = sorted(self._by_session.get(session_id, ()))
            heads = []
            for run_id in run_ids:
                log = self._logs[run_id]
                if not log:
                    continue
                step = self._steps.get(run_id)
                if step is None:
                    version, snapshot = self._snapshots.get(run_id, (0, None))
                    _, step, _ = _fold(run_id, snapshot, log[version:], log.copy)
                    self._steps[run_id] = step
                if wanted is None or step in wanted:
                    heads.append(RunHead(run_id, len(log), step, _started_session(log),
                                         self._owners.get(run_id)))
            return tuple(heads)

    def load(self, run_id: str) -> list[Event]:
        with self._lock:
            return list(self._logs.get(run_id, ()))

    def load_latest(self, run_id: str) -> tuple[Snapshot | None, list[Event]]:
        with self._lock:
            log = self._logs.get(run_id, [])
            version, snapshot = self._snapshots.get(run_id, (0, None))
            return snapshot, log[version:]


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
    owner      TEXT
)"""
"""One head per run. ``step`` NULL: unfolded; `SQLiteEventStore.list_runs` folds the
run's log and fills it in (with the Session as the log has it). The head's version
is not stored: it is read off the log's UNIQUE (run_id, seq) index, so an append that
moves neither the step nor the owner writes no head row (and costs no extra page)."""
_RUNS_INDEXES = ("CREATE INDEX runs_by_session ON runs (session_id, step)",
                 "CREATE INDEX runs_unfolded ON runs (run_id) WHERE step IS NULL")
_HAS_RUNS = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'runs'"
_VERSION = "(SELECT MAX(seq) + 1 FROM events WHERE events.run_id = runs.run_id)"
_HEAD = f"SELECT run_id, {_VERSION}, step, session_id, owner FROM runs"
_SIDE_FILES = ("-wal", "-shm", "-journal")

Rows = list[tuple[Any, Any]]


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
    the file opened (`sqlite.FileIdentity`): a file deleted or replaced while open is a
    `StorageError` instead of writes into the void.

    The log is checked as it is read: rows must run from seq 0 (or from the snapshot)
    without a gap, each body decoding to the event of its row's seq, else `SchemaError`;
    so a loaded log is never silently shorter than the rows say. Snapshots carry a digest
    (sha256 of their JSON text) and are used only when the digest matches and the JSON is
    an object of this run ending right before the row's version; otherwise the snapshot
    is ignored with a `SnapshotIgnored` warning and the whole log is read. A snapshot that
    passes vouches for the log up to its version: if event 0 or event version - 1 is
    missing, the log was truncated (or has a gap) and loading is a `SchemaError`, not a
    replay of what is left. Two checks would cost O(log length) and are left to a whole
    read (``load``, a controller's ``events``, which raise `SchemaError`): a gap strictly
    inside the snapshot's prefix; and a truncation at the end past the newest snapshot
    leaves a shorter legal log that no check tells from a run that stopped there.

    ``readonly=True`` opens an existing store that can never be written through this
    object, nor any file created or changed by reading it: each read is its own SQLite
    ``mode=ro`` connection, ``immutable`` when the database is at rest (no ``-wal``,
    ``-shm`` or ``-journal`` beside it, which a read-only connection could leave behind
    and never remove), read again through SQLite's locks if the file moved meanwhile.
    No PRAGMA, no schema: a missing file, a directory and a file without the store's
    ``events`` table are refused (`StorageError`); ``append`` is refused
    (``"not_written"``); ``list_runs`` folds unfolded heads without keeping them.

    Safe to share between threads; several processes may open the same file.

    Runs are indexed by Session (`IndexedStore`) in a ``runs`` table, one head per run,
    written in each append's transaction. A database made before that table existed gets
    it when first opened, in one transaction: a row per run with its Session and last
    owner read off its log and its step unfolded, so the first ``list_runs`` folds each
    such run (snapshot plus tail) once and keeps the result. A run an older writer logs
    later gets its row on the next append here. A database made before snapshots had a
    digest gets the column, and its undigested snapshots are dropped (the next ones are
    written with one). Processes writing to one database should all run a version that
    keeps the heads and the digests.
    """

    def __init__(self, path: str | os.PathLike[str], *, timeout: float = 30.0,
                 readonly: bool = False) -> None:
        self.path = os.fspath(path)
        self.readonly = readonly
        self._timeout = timeout
        self._lock = threading.Lock()
        self._conn: Any = None
        self._identity: sqlite.FileIdentity | None = None
        self._closed = False
        self._has_runs = self._has_digests = True
        if readonly:
            self._open_readonly()
            return
        with sqlite.storage_errors(self.path, doing="open the event store"):
            try:
                self._conn = self._connect()
                with self._lock:
                    self._conn.executescript(_SCHEMA)
                    self._ensure_runs()
                    self._ensure_digests()
                if not _in_memory(self.path):
                    self._identity = sqlite.FileIdentity(self.path)
            except BaseException:
                if self._conn is not None:
                    self._conn.close()
                raise

    # ------------------------------------------------------------------ opening

    def _ensure_runs(self) -> None:
        """Create the ``runs`` table if absent, with a head for every run already logged
        (its Session and owner; the step is left unfolded)."""
        conn = self._conn
        if conn.execute(_HAS_RUNS).fetchone() is not None:
            return
        try:
            with sqlite.write_transaction(conn):
                if conn.execute(_HAS_RUNS).fetchone() is not None:
                    return  # another process created it first
                conn.execute(_RUNS_TABLE)
                for index in _RUNS_INDEXES:
                    conn.execute(index)
                logged = conn.execute("SELECT DISTINCT run_id FROM events").fetchall()
                for (run_id,) in logged:
                    conn.execute("INSERT INTO runs (run_id, session_id, owner) "
                                 "VALUES (?, ?, ?)", (run_id, *self._read_head(conn, run_id)))
        except sqlite.CommitFailed as failed:
            raise failed.__cause__ from None  # type: ignore[misc]

    def _ensure_digests(self) -> None:
        """Give the ``snapshots`` table of an older database its ``digest`` column, and
        drop the snapshots it holds (nothing vouches for them; they are only a cache)."""
        conn = self._conn
        if _has_digest(conn):
            return
        try:
            with sqlite.write_transaction(conn):
                if _has_digest(conn):
                    return  # another process added it first
                conn.execute("ALTER TABLE snapshots ADD COLUMN digest TEXT")
                conn.execute("DELETE FROM snapshots")
        except sqlite.CommitFailed as failed:
            raise failed.__cause__ from None  # type: ignore[misc]

    def _open_readonly(self) -> None:
        name = sqlite.shown(self.path)
        if not os.path.lexists(self.path):
            raise StorageError(f"no such store file: {name}", outcome="not_written")
        if os.path.isdir(self.path):
            raise StorageError(f"{name} is a directory, not an event store file",
                               outcome="not_written")
        with sqlite.storage_errors(self.path, doing="open the event store"):
            self._identity = sqlite.FileIdentity(self.path)
            tables, columns, digest = self._read(_describe, doing="open the event store")
        if "events" not in tables or not {"run_id", "seq", "body"} <= columns:
            what = ("an empty file" if os.path.getsize(self.path) == 0
                    else "a SQLite database")
            raise StorageError(f"{name} is not an agent-statemachine event store: it is "
                               f"{what} without the store's events table",
                               outcome="not_written")
        self._has_runs = "runs" in tables
        self._has_digests = "snapshots" in tables and digest

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
                session = _started_session([codec.decode_stored_event(codec.parse(first[0]),
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
        return sqlite.connect(self.path, timeout=self._timeout)

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

    def _check(self, doing: str, outcome: str = "not_written", **where: Any) -> None:
        """`StorageError` when the store is closed, or its path no longer names the file
        it opened."""
        if self._closed:
            raise StorageError(f"cannot {doing}: the event store is closed",
                               outcome="not_written", **where)
        if self._identity is not None:
            self._identity.check(doing=doing, outcome=outcome, **where)

    def _read(self, query: Callable[[sqlite3.Connection], Any], *, doing: str,
              run_id: str | None = None) -> Any:
        """Run ``query`` (reads only) on a connection and return what it returns; every
        backend failure is a `StorageError` (``"not_written"``: nothing was)."""
        where = {} if run_id is None else {"run_id": run_id}
        with sqlite.storage_errors(self.path, doing=doing, **where):
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
        conn = sqlite.connect_readonly(self.path, timeout=self._timeout, immutable=immutable)
        try:
            return query(conn)
        finally:
            conn.close()

    # ------------------------------------------------------------------ writing

    def append(self, run_id: str, events: Sequence[Event], expected_version: int, *,
               snapshot: Snapshot | None = None, step: Step | None = None) -> None:
        where = {"run_id": run_id}
        doing = "append to the event store"
        if self.readonly:
            raise StorageError(f"cannot {doing}: {sqlite.shown(self.path)} is open "
                               "read-only; nothing was written", outcome="not_written",
                               **where)
        batch_id = uuid.uuid4().hex
        rows = [(run_id, event.seq, batch_id, _dumps(codec.encode_event(event)))
                for event in events]
        if any(event.seq != expected_version + i for i, event in enumerate(events)):
            raise ValueError("events must carry the sequence numbers that follow "
                             "expected_version")
        kept = None
        if snapshot is not None:
            text = _dumps(snapshot)
            kept = (run_id, expected_version, text, _digest(text))
        step = _first_step(run_id, events, step, expected_version)
        with self._lock:
            self._check(doing, **where)
            try:
                conn = self._live()
                with sqlite.write_transaction(conn):
                    (last,) = conn.execute(
                        "SELECT MAX(seq) FROM events WHERE run_id = ?", (run_id,)).fetchone()
                    version = 0 if last is None else last + 1
                    if version != expected_version:
                        raise _conflict(run_id, expected_version, version)
                    conn.executemany(
                        "INSERT INTO events (run_id, seq, batch_id, body) VALUES (?, ?, ?, ?)",
                        rows)
                    if kept is not None:
                        conn.execute(
                            "INSERT OR REPLACE INTO snapshots (run_id, version, body, digest) "
                            "VALUES (?, ?, ?, ?)", kept)
                    if events:
                        self._keep_head(conn, run_id, events, expected_version, step)
            except sqlite3.IntegrityError:
                self._settle_connection()
                raise _conflict(run_id, expected_version, expected_version + 1) from None
            except sqlite.CommitFailed as failed:
                self._classify(failed, batch_id, doing, **where)
            except (sqlite3.Error, OSError) as error:  # before COMMIT: nothing landed
                self._settle_connection()
                raise sqlite.failure(error, self.path, outcome="not_written", doing=doing,
                                     **where) from error
            except BaseException:
                self._settle_connection()
                raise
            # the file was deleted or replaced during the append: it went into the void
            self._check(doing, outcome="unknown", **where)

    def _settle_connection(self) -> None:
        """After a failed write: a connection left inside a transaction (its ROLLBACK
        failed too) is closed, which rolls back, and opened again on next use."""
        if self._conn is not None and sqlite.in_transaction(self._conn):
            self._drop_connection()

    def _drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        with contextlib.suppress(sqlite3.Error):
            conn.close()

    def _classify(self, failed: sqlite.CommitFailed, batch_id: str, doing: str,
                  **where: Any) -> None:
        """A COMMIT raised: read the batch back. Found: appended (return). Not found:
        `StorageError` ``"not_written"``. Undecidable: ``"unknown"``."""
        cause = failed.__cause__ or failed
        self._drop_connection()  # a fresh one next time; closing rolls back what is left
        try:
            landed = self._landed(batch_id)
            self._check(doing, outcome="unknown", **where)  # the probe read the right file
        except StorageError:
            raise
        except Exception as error:  # the read-back failed: cannot decide
            raise sqlite.failure(cause, self.path, outcome="unknown", doing=doing,
                                 **where) from error
        if not landed:
            raise sqlite.failure(cause, self.path, outcome="not_written", doing=doing,
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
                   expected_version: int, step: Step | None) -> None:
        """Move the run's head in the append's transaction (written only if it moves)."""
        claimed, owner = _claim_in(events)
        value = None if step is None else step.value
        if expected_version == 0:
            conn.execute("INSERT OR REPLACE INTO runs (run_id, step, session_id, owner) "
                         "VALUES (?, ?, ?, ?)",
                         (run_id, value, _started_session(events), owner))
            return
        row = conn.execute("SELECT step, owner FROM runs WHERE run_id = ?",
                           (run_id,)).fetchone()
        if row is None:  # a run an older writer logged without a head
            session, logged_owner = self._read_head(conn, run_id)
            conn.execute("INSERT INTO runs (run_id, session_id, owner) VALUES (?, ?, ?)",
                         (run_id, session, owner if claimed else logged_owner))
            return  # unfolded: its Session was read off a log this store did not write
        head = (value, owner if claimed else row[1])
        if head != row:
            conn.execute("UPDATE runs SET step = ?, owner = ? WHERE run_id = ?",
                         (*head, run_id))

    # ------------------------------------------------------------------ reading

    def list_runs(self, session_id: str | None = None,
                  steps: Collection[Step] | None = None) -> tuple[RunHead, ...]:
        wanted = _check_filters(session_id, steps)
        if wanted is not None and not wanted:
            return ()
        where, params = [], []
        if session_id is not None:
            where.append("session_id = ?")
            params.append(session_id)
        if wanted is not None:
            where.append(f"step IN ({', '.join('?' * len(wanted))})")
            params.extend(step.value for step in wanted)
        sql = _HEAD
        if where:  # and every unfolded head, which may match: folded below, then filtered
            sql = (f"{_HEAD} WHERE step IS NOT NULL AND {' AND '.join(where)} "
                   f"UNION ALL {_HEAD} WHERE step IS NULL")

        def query(conn: sqlite3.Connection) -> list[tuple[Any, ...]]:
            if not self._has_runs:  # a read-only look at a database made before heads
                return [(run_id, version, None, None, self._read_head(conn, run_id)[1])
                        for run_id, version in conn.execute(
                            "SELECT run_id, MAX(seq) + 1 FROM events GROUP BY run_id "
                            "ORDER BY run_id").fetchall()]
            return conn.execute(f"{sql} ORDER BY 1", params).fetchall()

        rows = self._read(query, doing="list the runs of the event store")
        heads = []
        for run_id, stored_version, step, stored_session, owner in rows:
            if stored_version is None:
                continue  # a head without a log (rows are never deleted; be safe)
            if step is None:
                folded = self._fold(run_id)
                if folded is None:
                    continue
                version, known, session = folded
            else:
                try:
                    known = Step(step)
                except ValueError:
                    raise SchemaError("the run's head names an unknown step",
                                      run_id=run_id, action="list_runs") from None
                version, session = stored_version, stored_session
            if (session_id is None or session == session_id) and (
                    wanted is None or known in wanted):
                heads.append(RunHead(run_id, version, known, session, owner))
        return tuple(heads)

    def run_ids(self, limit: int | None = None) -> list[str]:
        """The ids of the runs the store holds, sorted (the first ``limit`` of them)."""
        def query(conn: sqlite3.Connection) -> list[str]:
            return [row[0] for row in conn.execute(
                "SELECT DISTINCT run_id FROM events ORDER BY run_id LIMIT ?",
                (-1 if limit is None else limit,))]

        return self._read(query, doing="read the event store")  # type: ignore[no-any-return]

    def _fold(self, run_id: str) -> tuple[int, Step, str | None] | None:
        """Fold an unfolded head from the run's log and keep the result (only if the run
        has not moved meanwhile: a newer append keeps its own head; never when the store
        is read-only)."""
        snapshot, tail = self.load_latest(run_id)
        if snapshot is None and not tail:
            return None
        version, step, session = _fold(run_id, snapshot, tail, lambda: self.load(run_id))
        if self.readonly:
            return version, step, session
        with self._lock:
            try:
                self._check("fold a run's head", run_id=run_id)
                with sqlite.write_transaction(self._live()) as conn:
                    conn.execute(f"UPDATE runs SET step = ?, session_id = ? WHERE run_id = ? "
                                  f"AND step IS NULL AND {_VERSION} = ?",
                                  (step.value, session, run_id, version))
            except (sqlite.CommitFailed, sqlite3.Error, OSError, StorageError):
                self._drop_connection()  # only a cache of the fold was lost: fold again
        return version, step, session

    def load(self, run_id: str) -> list[Event]:
        def query(conn: sqlite3.Connection) -> Rows:
            return conn.execute("SELECT seq, body FROM events WHERE run_id = ? ORDER BY seq",
                                (run_id,)).fetchall()

        return _decode(run_id, self._read(query, doing="load a run", run_id=run_id), 0)

    def load_latest(self, run_id: str) -> tuple[Snapshot | None, list[Event]]:
        def query(conn: sqlite3.Connection) -> tuple[Snapshot | None, str | None, int, Rows]:
            with sqlite.read_transaction(conn):
                found = conn.execute(
                    "SELECT version, body, digest FROM snapshots WHERE run_id = ?",
                    (run_id,)).fetchone() if self._has_digests else None
                snapshot, problem = _verified(run_id, found)
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
            return snapshot, problem, version, rows

        snapshot, problem, version, rows = self._read(query, doing="load a run",
                                                      run_id=run_id)
        if problem is not None:
            snapshot_ignored(run_id, problem)
        return snapshot, _decode(run_id, rows, version)


def _describe(conn: sqlite3.Connection) -> tuple[set[str], set[str], bool]:
    """The tables of a database, the columns of its ``events`` table, and whether its
    snapshots have a digest."""
    tables = {row[0] for row in conn.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table'")}
    columns = {row[1] for row in conn.execute("PRAGMA table_info(events)")}
    return tables, columns, _has_digest(conn)


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


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _verified(run_id: str, found: tuple[Any, Any, Any] | None) -> tuple[Snapshot | None,
                                                                         str | None]:
    """A stored snapshot row checked on its own: (the snapshot, None) when its digest
    matches its text and the text is a JSON object of this run ending right before the
    row's version; (None, why) otherwise; (None, None) when there is no row."""
    if found is None:
        return None, None
    version, body, digest = found
    if type(body) is not str or type(digest) is not str:
        return None, "it has no digest" if digest is None else "its row is damaged"
    if not hmac.compare_digest(_digest(body), digest):
        return None, "its digest does not match its text"
    try:
        snapshot = codec.parse(body)
    except ControlError:
        return None, "its text is not JSON"
    if type(snapshot) is not dict:
        return None, "it is not a JSON object"
    if type(version) is not int or version < 1 or snapshot.get("last_seq") != version - 1:
        return None, "its version does not match its state"
    started = snapshot.get("started")
    if type(started) is not dict or started.get("run_id") != run_id:
        return None, "it is another run's"
    return snapshot, None


def _decode(run_id: str, rows: Rows, first: int) -> list[Event]:
    """Stored rows (seq, body) from seq ``first`` on → events. `SchemaError` for a gap, a
    row whose body does not decode, or whose body's seq is not the row's: a log is never
    silently shorter, or other, than its rows. Clean rows (the common case) are decoded
    together (`codec.decode_stored_batch`), and their events know their size."""
    position = first
    for seq, body in rows:
        if type(seq) is not int or seq != position or type(body) is not str:
            break
        position += 1
    else:
        batch = codec.decode_stored_batch([body for _, body in rows], first)
        if batch is not None:
            return batch
    events = []
    for position, (seq, body) in enumerate(rows, start=first):
        if type(seq) is not int or seq != position:
            raise SchemaError(f"the stored log has a gap or a damaged row: event {position} "
                              f"is missing", run_id=run_id, action="load")
        if type(body) is not str:
            raise SchemaError(f"stored event {seq} is damaged: its body is not text",
                              run_id=run_id, action="load")
        event = codec.decode_stored_text(body, seq)
        if event.seq != seq:
            raise SchemaError(f"stored event {seq} is damaged: its body carries seq "
                              f"{event.seq}", run_id=run_id, action="load")
        events.append(event)
    return events


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


class AsyncSQLiteEventStore:
    """The async face of `SQLiteEventStore` (an `AsyncEventStore`): every call runs the
    sync store's method on one worker thread of its own, so an asyncio runner's event loop
    never waits for a lock or an fsync. Calls are serialized on that thread, in order."""

    def __init__(self, path: str | os.PathLike[str], *, timeout: float = 30.0) -> None:
        self.sync = SQLiteEventStore(path, timeout=timeout)
        self._worker = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="statemachine-sqlite")

    async def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._worker, functools.partial(fn, *args,
                                                                          **kwargs))

    async def append(self, run_id: str, events: Sequence[Event], expected_version: int, *,
                     snapshot: Snapshot | None = None, step: Step | None = None) -> None:
        await self._call(self.sync.append, run_id, events, expected_version,
                         snapshot=snapshot, step=step)

    async def load(self, run_id: str) -> list[Event]:
        return await self._call(self.sync.load, run_id)

    async def load_latest(self, run_id: str) -> tuple[Snapshot | None, list[Event]]:
        return await self._call(self.sync.load_latest, run_id)

    async def list_runs(self, session_id: str | None = None,
                        steps: Collection[Step] | None = None) -> tuple[RunHead, ...]:
        return await self._call(self.sync.list_runs, session_id, steps)

    async def close(self) -> None:
        await self._call(self.sync.close)
        self._worker.shutdown(wait=False)
