"""Event stores: where a run's log lives between processes.

`EventStore` is the protocol the controller binds to: ``append(run_id, events,
expected_version)`` succeeds only if the run's log holds exactly ``expected_version``
events (otherwise `ConcurrencyConflict`, and nothing is written), and ``load(run_id)``
returns the whole log (empty for an unknown run). Versions are log lengths, and the
uniqueness of (run id, seq) is the optimistic-concurrency primitive.

Both stores here also keep snapshots: a controller hands ``append`` the encoded state at
``expected_version`` every `SNAPSHOT_EVERY` events, the store writes it in the same
transaction, and ``load_latest`` returns the newest snapshot with the events after it, so
loading is O(1) in log length. Snapshots are optional for other stores.

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

import json
import os
import sqlite3
import threading
import uuid
from collections.abc import Callable, Collection, Sequence
from typing import Any, Protocol, TypeGuard, runtime_checkable

import attrs

from statemachine import codec, sqlite
from statemachine import events as ev
from statemachine.errors import ConcurrencyConflict, ControlError
from statemachine.events import Event
from statemachine.machine import replay, replay_onto
from statemachine.payloads import JSON
from statemachine.state import RunState
from statemachine.values import Step

SNAPSHOT_EVERY = 256
"""How often (in events) a controller hands its store a snapshot."""

Snapshot = dict[str, JSON]


@runtime_checkable
class EventStore(Protocol):
    """One append-only log per run id; versions are lengths."""

    def append(self, run_id: str, events: Sequence[Event], expected_version: int, *,
               snapshot: Snapshot | None = None) -> None:
        """Append ``events`` atomically if the log holds ``expected_version`` events;
        `ConcurrencyConflict` (nothing written) otherwise. ``snapshot``, when given, is
        the encoded state at ``expected_version``; a store may keep or ignore it."""

    def load(self, run_id: str) -> list[Event]:
        """The run's whole log, in order (empty when the run is unknown)."""


@runtime_checkable
class SnapshotStore(EventStore, Protocol):
    """A store that keeps the snapshots it is handed."""

    def load_latest(self, run_id: str) -> tuple[Snapshot | None, list[Event]]:
        """The newest snapshot (None if there is none) and every event after it."""


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


def _fold(run_id: str, snapshot: Snapshot | None, tail: list[Event],
          whole: Callable[[], list[Event]]) -> tuple[int, Step, str | None]:
    """Version, step and Session of a run, folded from its newest snapshot and the tail
    after it (the whole log when there is no usable snapshot). A log that does not
    replay raises (`SchemaError`, `InvalidTransition`): fail closed."""
    state = RunState.restore(snapshot) if snapshot is not None else None
    if state is None:
        log = whole()
        state = replay(run_id, log)
        return len(log), state.step, state.session_id
    base = state.last_seq + 1
    replay_onto(state, tail, first=base)
    return base + len(tail), state.step, state.session_id


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
    body    TEXT    NOT NULL
);
"""

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


class SQLiteEventStore:
    """A store on a real SQLite database file: WAL, ``synchronous=FULL``, every append in
    one ``BEGIN IMMEDIATE`` transaction, UNIQUE(run_id, seq).

    An append whose COMMIT raises has an unknown outcome (the commit may have landed and
    only its answer been lost). It is classified by reading back the append's
    client-generated batch id on a fresh connection, never by retrying: found means
    appended; not found re-raises the original error (nothing was written).
    Safe to share between threads; several processes may open the same file.

    Runs are indexed by Session (`IndexedStore`) in a ``runs`` table, one head per run,
    written in each append's transaction. A database made before that table existed gets
    it when first opened, in one transaction: a row per run with its Session and last
    owner read off its log and its step unfolded, so the first ``list_runs`` folds each
    such run (snapshot plus tail) once and keeps the result. A run an older writer logs
    later gets its row on the next append here. Processes writing to one database should
    all run a version that keeps the heads.
    """

    def __init__(self, path: str | os.PathLike[str], *, timeout: float = 30.0) -> None:
        self.path = os.fspath(path)
        self._timeout = timeout
        self._lock = threading.Lock()
        self._conn = self._connect()
        with self._lock:
            self._conn.executescript(_SCHEMA)
            self._ensure_runs()

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
                event = codec.decode_stored_event(codec.parse(body), seq)
                if type(event) is ev.RunClaimed:
                    owner = event.owner
                    break
        except ControlError:
            pass
        return session, owner

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=self._timeout, isolation_level=None,
                               check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        return conn

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def append(self, run_id: str, events: Sequence[Event], expected_version: int, *,
               snapshot: Snapshot | None = None, step: Step | None = None) -> None:
        batch_id = uuid.uuid4().hex
        rows = [(run_id, event.seq, batch_id, _dumps(codec.encode_event(event)))
                for event in events]
        if any(event.seq != expected_version + i for i, event in enumerate(events)):
            raise ValueError("events must carry the sequence numbers that follow "
                             "expected_version")
        step = _first_step(run_id, events, step, expected_version)
        with self._lock:
            conn = self._conn
            try:
                with sqlite.write_transaction(conn):
                    (last,) = conn.execute(
                        "SELECT MAX(seq) FROM events WHERE run_id = ?", (run_id,)).fetchone()
                    version = 0 if last is None else last + 1
                    if version != expected_version:
                        raise _conflict(run_id, expected_version, version)
                    conn.executemany(
                        "INSERT INTO events (run_id, seq, batch_id, body) VALUES (?, ?, ?, ?)",
                        rows)
                    if snapshot is not None:
                        conn.execute(
                            "INSERT OR REPLACE INTO snapshots (run_id, version, body) "
                            "VALUES (?, ?, ?)", (run_id, expected_version, _dumps(snapshot)))
                    if events:
                        self._keep_head(conn, run_id, events, expected_version, step)
            except sqlite3.IntegrityError:
                raise _conflict(run_id, expected_version, expected_version + 1) from None
            except sqlite.CommitFailed as failed:
                landed = self._landed(batch_id)
                self._reopen()
                if not landed:
                    raise failed.__cause__ from None  # type: ignore[misc]

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
        with self._lock:
            rows = self._conn.execute(f"{sql} ORDER BY 1", params).fetchall()
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
                version, known, session = stored_version, Step(step), stored_session
            if (session_id is None or session == session_id) and (
                    wanted is None or known in wanted):
                heads.append(RunHead(run_id, version, known, session, owner))
        return tuple(heads)

    def _fold(self, run_id: str) -> tuple[int, Step, str | None] | None:
        """Fold an unfolded head from the run's log and keep the result (only if the run
        has not moved meanwhile: a newer append keeps its own head)."""
        snapshot, tail = self.load_latest(run_id)
        if snapshot is None and not tail:
            return None
        version, step, session = _fold(run_id, snapshot, tail, lambda: self.load(run_id))
        with self._lock:
            try:
                with sqlite.write_transaction(self._conn) as conn:
                    conn.execute(f"UPDATE runs SET step = ?, session_id = ? WHERE run_id = ? "
                                  f"AND step IS NULL AND {_VERSION} = ?",
                                  (step.value, session, run_id, version))
            except sqlite.CommitFailed:
                self._reopen()  # only a cache of the fold was lost: fold again next time
        return version, step, session

    def _landed(self, batch_id: str) -> bool:
        probe = sqlite3.connect(self.path, timeout=self._timeout)
        try:
            row = probe.execute("SELECT 1 FROM events WHERE batch_id = ? LIMIT 1",
                                (batch_id,)).fetchone()
        finally:
            probe.close()
        return row is not None

    def _reopen(self) -> None:
        try:
            self._conn.close()
        finally:
            self._conn = self._connect()

    def _decode(self, rows: list[tuple[int, str]]) -> list[Event]:
        return [codec.decode_stored_event(codec.parse(body), seq) for seq, body in rows]

    def load(self, run_id: str) -> list[Event]:
        with self._lock:
            rows = self._conn.execute(
                "SELECT seq, body FROM events WHERE run_id = ? ORDER BY seq",
                (run_id,)).fetchall()
        return self._decode(rows)

    def load_latest(self, run_id: str) -> tuple[Snapshot | None, list[Event]]:
        with self._lock, sqlite.read_transaction(self._conn) as conn:
            found = conn.execute("SELECT version, body FROM snapshots WHERE run_id = ?",
                                 (run_id,)).fetchone()
            version = found[0] if found else 0
            rows = conn.execute(
                "SELECT seq, body FROM events WHERE run_id = ? AND seq >= ? ORDER BY seq",
                (run_id, version)).fetchall()
        snapshot = json.loads(found[1]) if found else None
        return snapshot, self._decode(rows)


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
