"""Event stores: where a run's log lives between processes.

`EventStore` is the protocol the controller binds to: ``append(run_id, events,
expected_version)`` succeeds only if the run's log holds exactly ``expected_version``
events (otherwise `ConcurrencyConflict`, and nothing is written), and ``load(run_id)``
returns the whole log (empty for an unknown run). Versions are log lengths, and the
uniqueness of (run id, seq) is the optimistic-concurrency primitive. A backend failure is
a `StorageError` whose ``outcome`` says whether an append certainly did not land
(``"not_written"``) or may have (``"unknown"``); the controller also types a `sqlite3`
error or an `OSError` that another store lets through.

The stores are the memory store here and the SQLite ones (`statemachine.sqlite`, importable
from here too); the PostgreSQL ones are in `statemachine.postgres`. Each of them also
keeps snapshots: a controller hands ``append`` the encoded state at
``expected_version`` every `SNAPSHOT_EVERY` events, the store writes it in the same
transaction, and ``load_latest`` returns the newest snapshot with the events after it, so
loading is O(1) in log length. Snapshots are optional for other stores, and never trusted
blindly: one that does not check out (`restored`; the SQLite store also checks a digest
and the version) is ignored with a `SnapshotIgnored` warning and the whole log replayed.

Each also indexes runs by Session (`IndexedStore`, optional for other stores): a run head
per run (`RunHead`: version, step, Session, owner, ``updated_at``) kept in the same
transaction as each
append, and ``list_runs(session_id=None, steps=None)``. That is how a runner finds out,
before it writes to a Session, that another run has an unsettled publication there
(DESIGN §6.4). The store cannot fold a log itself on every append, so a controller hands
an `IndexedStore`'s ``append`` the step its events lead to (``step=``); everything else in
the head the store reads off the events it writes (the Session from `RunStarted`, the
owner from the last `RunClaimed`, ``updated_at`` from the newest event's ``at``). A
run's first append is its whole log, so a store
folds it there when no ``step`` is given (`RunController.start` gives none): that costs
what encoding those events does. A later append without ``step`` (a caller writing
events directly) leaves the head's step *unfolded* until an append gives one again;
``list_runs`` folds an unfolded head from the run's log (snapshot plus tail) and keeps
the result. A store that says ``keeps_read_models`` (each of these) also keeps the run's
`ReadModel` (its blocker and inbox entries, `RunHead.blocker` and ``waiting``) in the
head: a controller hands it with the step (``read_model=``); an append without both
(after a run's first, which is folded) leaves the head unfolded, and so does a read
model that does not decode, so a head never says nothing waits unless a fold said so.
What the stores share for that (heads, snapshot checks, stored rows) is in
`statemachine.stored`.

A store that measured the size of the events it decoded says so through optional
methods, ``load_measured`` and ``load_latest_measured`` (`Loaded`); a controller asks for
them with `load_measured` and `load_latest_measured` here.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeGuard, runtime_checkable

from statemachine.events import Event, RunClaimed
from statemachine.payloads import JSON
from statemachine.sqlite import AsyncSQLiteEventStore, SQLiteEventStore
from statemachine.stored import (
    NO_LEASE,
    Lease,
    Loaded,
    RunHead,
    SessionWrite,
    SnapshotIgnored,
    _append_takes,
    check_filters,
    checks_session_tail,
    claimed_owner,
    conflict,
    dumps,
    head_of_log,
    many_session_writes,
    next_lease,
    now_micros,
    restored,
    session_writes,
    snapshot_ignored,
    started_session,
    takes_session_write,
    to_index,
)
from statemachine.values import Step

if TYPE_CHECKING:
    from statemachine.blocker import ReadModel

__all__ = [
    "SNAPSHOT_EVERY",
    "UNTYPED_BACKEND_ERRORS",
    "AsyncEventStore",
    "AsyncSQLiteEventStore",
    "EventStore",
    "IndexedStore",
    "Loaded",
    "MemoryEventStore",
    "RunHead",
    "SQLiteEventStore",
    "SessionWrite",
    "Snapshot",
    "SnapshotIgnored",
    "SnapshotStore",
    "checks_session_tail",
    "indexes_runs",
    "keeps_read_models",
    "load_latest_measured",
    "load_measured",
    "many_session_writes",
    "restored",
    "session_writes",
    "snapshot_ignored",
    "takes_session_write",
]

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


def _measuring(store: object, measured: str, plain: str) -> Callable[[str], Any] | None:
    """``store``'s optional ``measured`` method, when it reads what ``plain`` reads: a
    class (or an instance) that overrides ``plain`` below the class that defines
    ``measured`` (a subclass that records or edits its loads) is read through ``plain``,
    so what it returns is what a controller gets, with no size."""
    if plain in getattr(store, "__dict__", ()):
        return None
    for cls in type(store).__mro__:
        if measured in cls.__dict__:
            return getattr(store, measured)  # type: ignore[no-any-return]
        if plain in cls.__dict__:
            return None
    return None


def load_measured(store: EventStore, run_id: str) -> Loaded:
    """The whole log of ``run_id`` with the size the store measured, when it offers one
    (an optional ``load_measured`` method, see `_measuring`); else ``load`` with no size.
    A size travels only with the events it was measured on: a wrapper or a subclass that
    changes what ``load`` returns hands on no size."""
    own = _measuring(store, "load_measured", "load")
    if own is not None:
        return own(run_id)  # type: ignore[no-any-return]
    return Loaded(list(store.load(run_id)), None)


def load_latest_measured(store: SnapshotStore, run_id: str) -> tuple[Snapshot | None, Loaded]:
    """`SnapshotStore.load_latest` with the size the store measured for the tail (an
    optional ``load_latest_measured`` method, as `load_measured`); else with no size."""
    own = _measuring(store, "load_latest_measured", "load_latest")
    if own is not None:
        return own(run_id)  # type: ignore[no-any-return]
    snapshot, tail = store.load_latest(run_id)
    return snapshot, Loaded(list(tail), None)



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
        step is folded from the log when it is next listed). The head's version, Session,
        owner and ``updated_at`` come from the events themselves. A store that keeps read
        models also takes ``read_model=`` (`keeps_read_models`)."""

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



_KEEPS_MODELS: dict[type, bool] = {}


def keeps_read_models(store: object) -> bool:
    """Whether ``store`` keeps each run's read model in its head (``keeps_read_models``,
    DESIGN §7.5): then a controller hands its ``append`` the `ReadModel` of the state
    its events lead to (``read_model=``). A subclass that says so by inheritance but
    overrides ``append`` without a ``read_model`` parameter (one written before read
    models) is handed none: its heads are left unfolded, and folded where they are
    listed. Cached per class, as `takes_session_write`."""
    if getattr(store, "keeps_read_models", False) is not True:
        return False
    return _append_takes(store, "read_model", _KEEPS_MODELS)


class MemoryEventStore:
    """An in-process store (thread-safe). Events are immutable and kept as they are.
    Runs are indexed by Session (`IndexedStore`), each head with its read model."""

    keeps_leases = True
    """Leases are checked and moved in each append's transaction (`stored.next_lease`):
    a claim landing while another owner's lease is live is refused (`LeaseHeld`)."""
    keeps_read_models = True
    """Each append keeps the run's `ReadModel` (``read_model=``) in its head, beside the
    step (`keeps_read_models`)."""

    def __init__(self) -> None:
        self._logs: dict[str, list[Event]] = {}
        self._snapshots: dict[str, tuple[int, Snapshot]] = {}
        self._by_session: dict[str | None, dict[str, None]] = {}
        """Run ids by Session (read off each run's `RunStarted`), in start order."""
        self._folds: dict[str, tuple[Step, ReadModel] | None] = {}
        """Each run's step and read model (None: unfolded, folded from the log when next
        listed)."""
        self._owners: dict[str, str | None] = {}
        self._leases: dict[str, Lease] = {}
        """Each run's lease (`stored.next_lease`), judged by the wall clock."""
        self._lock = threading.Lock()

    def append(self, run_id: str, events: Sequence[Event], expected_version: int, *,
               snapshot: Snapshot | None = None, step: Step | None = None,
               read_model: ReadModel | None = None) -> None:
        events = tuple(events)  # read once: an iterator would be empty on the next read
        if any(event.seq != expected_version + i for i, event in enumerate(events)):
            raise ValueError("events must carry the sequence numbers that follow "
                             "expected_version")
        fold = to_index(run_id, events, step, read_model, expected_version)
        with self._lock:
            log = self._logs.get(run_id, [])
            if len(log) != expected_version:
                raise conflict(run_id, expected_version, len(log))
            lease = self._leases.get(run_id, NO_LEASE)
            if lease is not NO_LEASE or any(type(event) is RunClaimed for event in events):
                self._leases[run_id] = next_lease(run_id, lease, events, now_micros())
            self._logs[run_id] = log
            log.extend(events)
            if snapshot is not None:
                self._snapshots[run_id] = (expected_version, snapshot)
            if not events:
                return
            claimed, owner = claimed_owner(events)
            self._folds[run_id] = fold
            if expected_version == 0:
                self._by_session.setdefault(started_session(events), {})[run_id] = None
                self._owners[run_id] = owner
            elif claimed:
                self._owners[run_id] = owner

    def list_runs(self, session_id: str | None = None,
                  steps: Collection[Step] | None = None) -> tuple[RunHead, ...]:
        wanted = check_filters(session_id, steps)
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
                fold = self._folds.get(run_id)
                if fold is None:
                    version, snapshot = self._snapshots.get(run_id, (0, None))
                    _, step, _, model = head_of_log(run_id, snapshot, log[version:],
                                                    log.copy)
                    fold = self._folds[run_id] = step, model
                step, model = fold
                if wanted is None or step in wanted:
                    holder, until, _ = self._leases.get(run_id, NO_LEASE)
                    heads.append(RunHead(run_id, len(log), step, started_session(log),
                                         self._owners.get(run_id), log[-1].at, holder,
                                         until, model.blocker, model.waiting))
            return tuple(heads)

    def load(self, run_id: str) -> list[Event]:
        with self._lock:
            return list(self._logs.get(run_id, ()))

    def version(self, run_id: str) -> int:
        """How many events the run's log holds (0 for a run not in the store)."""
        with self._lock:
            return len(self._logs.get(run_id, ()))

    def load_latest(self, run_id: str) -> tuple[Snapshot | None, list[Event]]:
        with self._lock:
            log = self._logs.get(run_id, [])
            version, snapshot = self._snapshots.get(run_id, (0, None))
            return snapshot, log[version:]


_dumps = dumps
"""`stored.dumps` under its old name here (`bench/backends.py` reads it)."""
