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
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import uuid
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from statemachine import codec, sqlite
from statemachine.errors import ConcurrencyConflict
from statemachine.events import Event
from statemachine.payloads import JSON

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


def _conflict(run_id: str, expected: int, actual: int) -> ConcurrencyConflict:
    return ConcurrencyConflict(
        f"another writer moved the log: expected version {expected}, found {actual}",
        run_id=run_id)


class MemoryEventStore:
    """An in-process store (thread-safe). Events are immutable and kept as they are."""

    def __init__(self) -> None:
        self._logs: dict[str, list[Event]] = {}
        self._snapshots: dict[str, tuple[int, Snapshot]] = {}
        self._lock = threading.Lock()

    def append(self, run_id: str, events: Sequence[Event], expected_version: int, *,
               snapshot: Snapshot | None = None) -> None:
        with self._lock:
            log = self._logs.setdefault(run_id, [])
            if len(log) != expected_version:
                raise _conflict(run_id, expected_version, len(log))
            log.extend(events)
            if snapshot is not None:
                self._snapshots[run_id] = (expected_version, snapshot)

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


class SQLiteEventStore:
    """A store on a real SQLite database file: WAL, ``synchronous=FULL``, every append in
    one ``BEGIN IMMEDIATE`` transaction, UNIQUE(run_id, seq).

    An append whose COMMIT raises has an unknown outcome (the commit may have landed and
    only its answer been lost). It is classified by reading back the append's
    client-generated batch id on a fresh connection, never by retrying: found means
    appended; not found re-raises the original error (nothing was written).
    Safe to share between threads; several processes may open the same file.
    """

    def __init__(self, path: str | os.PathLike[str], *, timeout: float = 30.0) -> None:
        self.path = os.fspath(path)
        self._timeout = timeout
        self._lock = threading.Lock()
        self._conn = self._connect()
        with self._lock:
            self._conn.executescript(_SCHEMA)

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
               snapshot: Snapshot | None = None) -> None:
        batch_id = uuid.uuid4().hex
        rows = [(run_id, event.seq, batch_id, _dumps(codec.encode_event(event)))
                for event in events]
        if any(event.seq != expected_version + i for i, event in enumerate(events)):
            raise ValueError("events must carry the sequence numbers that follow "
                             "expected_version")
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
            except sqlite3.IntegrityError:
                raise _conflict(run_id, expected_version, expected_version + 1) from None
            except sqlite.CommitFailed as failed:
                landed = self._landed(batch_id)
                self._reopen()
                if not landed:
                    raise failed.__cause__ from None  # type: ignore[misc]

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
