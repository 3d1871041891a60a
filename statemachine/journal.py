"""`Journal`: a run's event log as its controller keeps it, and the way to its store.

The controller decides what may be recorded (the gate, validation, the machine); the
journal keeps what was recorded and sees it into the store:

* the events (from `base` on: a run loaded from a snapshot holds only the events after
  it) and the state that is their fold;
* the store binding: one append per command, or buffered until `flush` (always so for an
  async store), one transaction per effect boundary;
* the commit that waits for its append together with the Session items it carries
  (`hold_commit`), applied only once both landed; or, buffered, the Session writes that
  ride with the next flush behind commits already applied (`ride`);
* the snapshots handed to the store, every `Limits.snapshot_every` events;
* the room left under the run's `Limits`, with the reserves that let any run settle and
  close (`room_for`, `check_count`);
* the one state in which the controller must be loaded again (``stopped``): a write whose
  outcome is unknown, or buffered events another writer refused.

Every store call runs inside `_StoreCall`, which types its failure once (see there): no
store error reaches a caller without saying where, and none of a backend's untyped errors
(`stores.UNTYPED_BACKEND_ERRORS`) escapes at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import gc
import inspect
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NoReturn

import attrs

from statemachine import codec, sizes
from statemachine import events as ev
from statemachine.blocker import read_model
from statemachine.errors import (
    ConcurrencyConflict,
    ControlError,
    InvalidTransition,
    Outcome,
    ReconcileRejected,
    RunNotFound,
    SchemaError,
    StorageError,
)
from statemachine.machine import SETTLING_TRIGGERS, replay, replay_onto
from statemachine.payloads import JSON
from statemachine.state import RunState
from statemachine.stores import (
    UNTYPED_BACKEND_ERRORS,
    AsyncEventStore,
    Loaded,
    SessionWrite,
    SnapshotStore,
    indexes_runs,
    keeps_read_models,
    load_latest_measured,
    load_measured,
    many_session_writes,
    restored,
    snapshot_ignored,
)
from statemachine.values import Step

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from statemachine.stores import EventStore

RESERVED_EVENTS = 4
"""Events under ``max_events`` kept for fail, reconcile, commit and abandon, so a run at
its limit can always settle or close."""
_FINISHING = {"begin_tool": 3, "tool_completed": 2, "resolve_in_doubt": 2}
"""Extra room a command needs beyond the reserve: a started tool must be able to record
its result, and a result must be able to be staged, or it would be lost."""
RESERVED_TEXT = 256
"""The bytes (UTF-8, as JSON) of an error name, an abandon reason and who abandoned that
the room reserved under ``max_bytes`` holds: a run at its byte limit can always fail,
reconcile, commit and abandon with a reason, a ``by`` or an error name up to this long."""
SNAPSHOT_SIZE = "log_bytes"
"""The key under which a snapshot handed to a store records the size of the log before it
(so a load from the snapshot knows `RunController.size` without reading that log)."""

_EVENT_SIZE = sizes.EVENT_SIZE
_RECORDS_NOTHING = frozenset({"tool_interrupted"})
"""Commands that never record an event, so the log's room does not gate them."""
_RESULTS = (ev.ToolCompleted, ev.InDoubtResolved)
"""The events that record a call's result (`Journal.holds_results`)."""


@attrs.frozen
class Limits:
    """What a run's log is kept within (DESIGN §3.2, §6.6) and the room that leaves, with
    how often its store is handed a snapshot. One value per set of limits (`limits_of`),
    shared by every run that has them."""

    max_depth: int
    """The nesting depth of a payload, counted from its own root."""
    max_events: int
    max_bytes: int
    """The size of `to_json()`, the keyed chain included."""
    snapshot_every: int
    room: int
    """The size below which any command may record; above it only the settling commands
    and abandon may, in the room reserved for them (`Journal.room_for`)."""
    roomy_version: int
    """The highest version at which every command still has the events it needs
    (`Journal.check_count` needs asking only above it)."""


@functools.lru_cache(maxsize=64)
def limits_of(max_depth: int, max_events: int, max_bytes: int, snapshot_every: int) -> Limits:
    """The `Limits` of these bounds (checked by the caller), shared."""
    return Limits(max_depth, max_events, max_bytes, snapshot_every,
                  max_bytes - _byte_reserves(max_events)[0],
                  max_events - RESERVED_EVENTS - max(_FINISHING.values()))


@functools.lru_cache(maxsize=16)
def _byte_reserves(max_events: int) -> tuple[int, int]:
    """(room kept for fail, reconcile, commit and abandon; room kept for abandon), each
    with the keyed chain's bytes: the largest such events (a seq as long as
    ``max_events``, the latest ``at`` a clock may give, texts of `RESERVED_TEXT` bytes:
    the reason and who abandoned), and the comma before each."""
    seq, text, at = max_events, "x" * RESERVED_TEXT, ev.MAX_AT
    abandon = sizes.event_size(ev.Abandoned(seq, text, at=at, by=text)) + 1
    reconcile = max(sizes.event_size(ev.ReconciledAcknowledge(seq, False, at=at)),
                    sizes.event_size(ev.ReconciledAppend(seq, False, at=at)))
    settle = (sizes.event_size(ev.PublicationFailed(seq, text, at=at)) + reconcile
              + sizes.event_size(ev.PublicationCommitted(seq, at=at)) + 3)
    return sizes.CHAIN_BYTES + settle + abandon, sizes.CHAIN_BYTES + abandon


@attrs.frozen
class PendingCommit:
    """A commit event the machine accepted and the Session write it carries, until the
    append that writes both lands (`Journal.hold_commit`)."""

    action: str
    event: ev.Event
    source: Step
    dest: Step
    size: int
    write: SessionWrite


class Journal:
    """The log of one run and its way to the store (see the module's docstring)."""

    __slots__ = ("between", "buffered", "events", "flushed", "limits", "origin",
                 "pending_snapshot", "riding", "size", "snapshot_at", "state", "stopped",
                 "store", "version", "write")

    def __init__(self, state: RunState, events: list[ev.Event], *, store: EventStore | None,
                 limits: Limits, size: int | None = None) -> None:
        self.state = state
        self.events = events
        self.origin: Mapping[str, Any] | None = None
        """The snapshot this run was loaded from (``base`` > 0): the state `events` start
        from, which `_unfold` rebuilds the state from."""
        """The events recorded here: the log from `base` on."""
        self.version = state.last_seq + 1
        """How many events the log holds: the seq of the next event (the store's expected
        version)."""
        self.store = store
        self.limits = limits
        self.buffered = store is not None and is_async(store)
        """Durability at effect boundaries: events are kept here and appended by `flush`
        / `flush_async` in one transaction (always so for an async store)."""
        self.flushed = self.version
        """How many events the store holds (the version the next flush expects)."""
        self.between = False
        """Per event between a runner's attempts and buffered within them: set by
        `RunController._between_attempts`, read by `RunController._buffer_attempt`."""
        self.pending_snapshot: dict[str, JSON] | None = None
        self.snapshot_at = self.base
        self.write: PendingCommit | None = None
        """A commit waiting with its Session write for the append that writes both."""
        self.riding: tuple[SessionWrite, ...] = ()
        """The Session writes of commits recorded (and applied) in the buffer, in order:
        the next flush's append writes them with the events (`ride`). A tuple (the empty
        one shared by every idle run, where a list was 56 bytes of each)."""
        self.stopped: tuple[type[ControlError], str] | None = None
        """Why every command is refused until the run is loaded again: an append whose
        outcome is unknown, or buffered events the store refused (another writer moved
        the log). None while the journal is sound."""
        self.size = codec.log_size(state.run_id, events) if size is None else size
        """The size of `to_json()` (no chain): what ``max_bytes`` bounds, kept as events
        are recorded (``base`` > 0 needs ``size``: the events before it are not here)."""

    def __deepcopy__(self, memo: dict[int, Any]) -> Journal:
        """A deep copy that shares the recorded events and the limits: they are never
        changed (every read hands out copies), so walking them would only cost."""
        for shared in (*self.events, self.limits):
            memo.setdefault(id(shared), shared)
        twin = Journal.__new__(Journal)
        memo[id(self)] = twin
        for name in Journal.__slots__:
            setattr(twin, name, copy.deepcopy(getattr(self, name), memo))
        return twin

    # ------------------------------------------------------------ starting, loading

    @classmethod
    def start(cls, started: ev.RunStarted, *, store: EventStore | None, limits: Limits,
              buffered: bool) -> Journal:
        """The journal of a new run. Its first event is appended now, unless the journal
        buffers (``buffered``, or an async store): then a run id the store already holds
        is refused at the first flush. `SchemaError` unless ``max_bytes`` leaves the
        reserved room beside the first document; `ConcurrencyConflict` ("already
        exists") when the store holds the run."""
        run_id = started.run_id
        size = codec.envelope_size(run_id) + sizes.event_size(started)
        needed = size + _byte_reserves(limits.max_events)[0]
        if needed > limits.max_bytes:
            raise SchemaError(f"max_bytes={limits.max_bytes} is too small: this run needs "
                              f"at least {needed} (its first event and the room reserved "
                              "for settling and abandoning it)", run_id=run_id, action="start")
        buffers = store is not None and (buffered or is_async(store))
        if store is not None and not buffers:
            with _StoreCall(run_id, "start", (started,)):
                store.append(run_id, (started,), 0)
        journal = cls(RunState(started), [started], store=store, limits=limits, size=size)
        if buffers:
            journal.buffered, journal.flushed = True, 0
        return journal

    @classmethod
    def load(cls, store: EventStore, run_id: str, *, limits: Limits, snapshot: bool,
             buffered: bool) -> Journal:
        """The journal of a stored run, its state replayed (from the newest snapshot that
        passes its checks, or the whole log; see `RunController.load`). `RunNotFound`,
        `SchemaError`, `InvalidTransition` or `StorageError`; `SchemaError` as well for a
        log whose `to_json()` is over ``max_bytes``."""
        with gc_paused(), _StoreCall(run_id, "load", None):
            journal = cls._loaded(store, run_id, limits=limits, snapshot=snapshot)
        if journal.size > limits.max_bytes:
            raise SchemaError(f"the log is over max_bytes={limits.max_bytes} (its JSON takes "
                              f"{journal.size} bytes)", run_id=run_id, action="load")
        journal.buffered = buffered
        return journal

    @staticmethod
    def holds_none(store: EventStore, run_id: str) -> bool:
        """Whether ``store``, which counts a run's events (``version``: every sync store
        of this library), holds none of ``run_id``'s: one indexed read, its failure
        typed as a load's. False for a store that does not count them."""
        reader = getattr(store, "version", None)
        if reader is None:
            return False
        with _StoreCall(run_id, "load", None):
            return int(reader(run_id)) == 0

    @classmethod
    async def load_async(cls, store: AsyncEventStore, run_id: str, *, limits: Limits,
                         snapshot: bool) -> Journal:
        """`load` from an async store without blocking the event loop: decoding and
        replay run on a worker thread, which awaits the store's coroutines on this loop.
        The journal buffers (flush it with `flush_async`)."""
        bridge = _SyncBridge(store, asyncio.get_running_loop())
        journal: Journal = await asyncio.to_thread(
            cls.load, bridge, run_id, limits=limits, snapshot=snapshot, buffered=True)
        journal.store = store  # type: ignore[assignment]
        return journal

    @classmethod
    def _loaded(cls, store: EventStore, run_id: str, *, limits: Limits,
                snapshot: bool) -> Journal:
        where = {"run_id": run_id, "action": "load"}
        max_events = limits.max_events
        stored: Mapping[str, Any] | None = None
        state: RunState | None = None
        log: Loaded | None = None
        if snapshot and isinstance(store, SnapshotStore):
            stored, tail = load_latest_measured(store, run_id)
            state = restored(run_id, stored, tail.events)
            if state is not None:
                base = state.last_seq + 1
                if base + len(tail.events) > max_events:
                    raise SchemaError(f"the log has more than max_events={max_events} "
                                      "events", **where)
                try:
                    replay_onto(state, tail.events, first=base)
                except ControlError:
                    pass  # the whole log decides below: it raises too, or the snapshot is bad
                else:
                    journal = cls(state, list(tail.events), store=store, limits=limits,
                                  size=_snapshot_size(store, run_id, stored, base, tail))
                    journal.origin = stored
                    return journal
            elif stored is None and (not tail.events or tail.events[0].seq == 0):
                log = tail  # no snapshot: the tail is the whole log (none: no run)
        if log is None:
            log = load_measured(store, run_id)
        events = list(log.events)
        if not events:
            raise RunNotFound("no such run in the store", **where)
        if len(events) > max_events:
            raise SchemaError(f"the log has more than max_events={max_events} events",
                              **where)
        size = None if log.size is None else codec.envelope_size(run_id) + log.size
        loaded = cls(replay(run_id, events), events, store=store, limits=limits, size=size)
        if stored is not None and state is not None:
            snapshot_ignored(run_id, "the events after it do not replay onto it")
        return loaded

    # ------------------------------------------------------------------ reading

    @property
    def base(self) -> int:
        """How many events before the first one held here (those before the snapshot this
        run was loaded from): they live only in the store."""
        return self.version - len(self.events)

    @property
    def unflushed(self) -> int:
        """Events recorded here and not yet in the store (0 unless the journal buffers)."""
        return self.version - self.flushed

    @property
    def holds_results(self) -> bool:
        """Whether what waits for the next flush records a call's result (a tool's output,
        an operator's or a verifier's resolution; its publication rides along)."""
        return any(type(e) in _RESULTS for e in self.events[self.flushed - self.base:])

    def whole(self) -> list[ev.Event]:
        """The whole log (its events before `base` read from the store: O(log length))."""
        if self.base and self.store is not None:
            return [*self._prefix(self.store), *self.events]
        return self.events

    def _prefix(self, store: EventStore) -> list[ev.Event]:
        """The events before the snapshot this run was loaded from, read from the store:
        exactly `base` of them, seq 0 on, and leading (with the events after them) to this
        run's state; else `SchemaError` (or the replay's `InvalidTransition`): never a
        shorter log, nor one the snapshot did not come from."""
        state, base = self.state, self.base
        where = {"run_id": state.run_id, "action": "events"}
        if is_async(store):
            raise InvalidTransition(
                "this run was loaded from a snapshot of an async store, so its whole log "
                "is not at hand: load it with load_async(..., snapshot=False) to read it",
                step=state.step, **where)
        with _StoreCall(self, "events", None):
            prefix = store.load(state.run_id)[:base]
        if len(prefix) != base or any(event.seq != seq for seq, event in enumerate(prefix)):
            raise SchemaError(f"the stored log lacks events before the snapshot this run "
                              f"was loaded from (it holds {len(prefix)} of {base})", **where)
        with gc_paused():
            if replay(state.run_id, [*prefix, *self.events]) != state:
                raise SchemaError("the stored log before the snapshot this run was loaded "
                                  "from does not lead to the snapshot's state (it was "
                                  "changed)", **where)
        return prefix

    # ------------------------------------------------------------------ the room

    def room_for(self, action: str, event: ev.Event) -> int:
        """The run's size once ``event`` is recorded; `SchemaError` when that takes it past
        the room for ordinary commands and ``event`` may not use the reserve: only the
        settling commands (keeping room for an abandon) and abandon itself may, and
        nothing may take `to_json(key=...)` over ``max_bytes``."""
        size = self.size + _EVENT_SIZE[type(event)](event) + 1  # the comma before it
        if size > self.limits.room:
            bounds = self.limits
            trigger = event.TRIGGER
            if trigger == "abandon":
                limit = bounds.max_bytes - sizes.CHAIN_BYTES
            elif trigger in SETTLING_TRIGGERS:
                limit = bounds.max_bytes - _byte_reserves(bounds.max_events)[1]
            else:
                limit = bounds.room
            if size > limit:
                self._refuse(SchemaError, action,
                             f"recording it would take the run's JSON to {size} bytes, past "
                             f"its room under max_bytes={bounds.max_bytes} (room is kept "
                             "for settling and abandoning the run)")
        return size

    def check_count(self, action: str, trigger: str) -> None:
        """`SchemaError` unless the log has the events ``trigger`` needs under
        ``max_events``: ordinary commands leave `RESERVED_EVENTS` for settling and closing
        (and a few more where a result must still fit, `_FINISHING`), settling ones leave
        one for abandon."""
        if trigger in _RECORDS_NOTHING:
            return  # it needs no room in the log, and refusing it would strand a call
        room = self.limits.max_events - self.version
        needed = 1 if trigger == "abandon" else 2 if trigger in SETTLING_TRIGGERS else (
            RESERVED_EVENTS + _FINISHING.get(trigger, 1))
        if room < needed:
            self._refuse(SchemaError, action,
                         f"the log is at its limit of max_events={self.limits.max_events}")

    # --------------------------------------------------------------- recording

    def record(self, event: ev.Event, dest: Step, size: int, action: str) -> None:
        """Record ``event``, which the machine accepted (leading to ``dest``) and which
        brings the run to ``size``: appended to the store now, or buffered for the next
        flush, then folded into the state and kept. A failed append leaves the journal as
        it was (stopped, when the append may have landed)."""
        store = self.store
        state = self.state
        folded = False
        if store is not None and self.buffered:
            self._buffer(event)
        elif store is not None:
            snapshot = (self._snapshot() if event.seq % self.limits.snapshot_every == 0
                        and isinstance(store, SnapshotStore) else None)
            options: dict[str, Any] = {}
            call = _StoreCall(self, action, (event,))  # (it names the step before the event)
            try:
                if indexes_runs(store):  # it keeps a head per run: tell it the new step
                    options["step"] = dest
                    if keeps_read_models(store):  # and what the state after the event shows
                        folded = True
                        state.apply(event, dest)
                        options["read_model"] = read_model(state)
                with call:
                    store.append(state.run_id, (event,), event.seq, snapshot=snapshot,
                                 **options)
            except BaseException:
                if folded:
                    self._unfold()
                raise
        if not folded:
            state.apply(event, dest)
        self.events.append(event)
        self.version = event.seq + 1
        self.size = size
        if not self.buffered:
            self.flushed = self.version

    def _unfold(self) -> None:
        """Put the state back as it was before the event folded ahead of an append that
        did not land (the log is what it was, so its replay is that state, I10)."""
        state = self.state
        try:
            with gc_paused():
                if self.origin is None:
                    before = replay(state.run_id, self.events)
                else:
                    found = restored(state.run_id, dict(self.origin), self.events)
                    assert found is not None  # it was restored from this snapshot once
                    before = found
                    replay_onto(before, self.events, first=self.base)
            for name in RunState.__slots__:
                setattr(state, name, getattr(before, name))
        except BaseException:  # (an interrupt while putting it back): the state is unknown
            self.stop(StorageError, "the run's state could not be put back after an append "
                      "that did not land: load the run again to go on")
            raise

    def _buffer(self, event: ev.Event) -> None:
        """Keep ``event`` for the next flush. A batch that starts a snapshot interval
        takes the snapshot of the state it starts from (the store's expected version)."""
        if (self.flushed == event.seq
                and event.seq - self.snapshot_at >= self.limits.snapshot_every
                and isinstance(self.store, SnapshotStore | AsyncEventStore)):
            self.pending_snapshot = self._snapshot()

    def _snapshot(self) -> dict[str, JSON]:
        """The state as a snapshot for the store, with the size of the log before it."""
        snapshot = self.state.snapshot()
        snapshot[SNAPSHOT_SIZE] = self.size  # how a load from it knows the size
        return snapshot

    def refuse_waiting(self, action: str) -> NoReturn:
        """Refuse a command while a commit waits with its Session write."""
        self._refuse(InvalidTransition, action,
                     "a publication's commit and its Session write are waiting for their "
                     "append: await flush_async() first")

    def hold_commit(self, commit: PendingCommit) -> PendingCommit | None:
        """Keep ``commit`` (checked: room, machine, write) for the append that writes it
        with its Session items and any buffered events, in one transaction: a sync store
        appends here (the landed commit is returned, for the caller to see it applied),
        an async one at the next `flush_async`. Until it lands nothing of it is applied,
        so a failed append leaves the run as it was."""
        store = self.store
        if self.buffered:
            self._buffer(commit.event)  # the snapshot a batch starting an interval takes
        elif (commit.event.seq % self.limits.snapshot_every == 0
              and isinstance(store, SnapshotStore)):
            self.pending_snapshot = self._snapshot()
        self.write = commit
        return None if is_async(store) else self.flush()

    def ride(self, write: SessionWrite) -> None:
        """Let ``write`` (the Session items of the commit event just buffered) go with the
        next flush's append, in its transaction (DESIGN §7.7: a result rides with the
        run's next write). Only a buffered journal, whose store writes several Session
        writes in one append when one already rides (`many_session_writes`)."""
        assert self.may_ride()
        self.riding = (*self.riding, write)

    def may_ride(self) -> bool:
        """Whether a commit's Session write may wait for the next flush: the journal
        buffers, and its store writes several writes in one append when one rides."""
        return self.buffered and (not self.riding or many_session_writes(self.store))

    # ------------------------------------------------------------------- flushing

    def flush(self) -> PendingCommit | None:
        """Append what this journal buffered (and the commit waiting with its Session
        write) as one transaction with the expected version; a no-op when nothing waits.
        Returns the commit when one landed (it is applied by then). Refused while the
        journal is stopped, and for an async store (`flush_async`)."""
        if not self.unflushed and self.write is None:
            return None
        if self.stopped is not None:
            self.refuse_stopped("flush")
        store = self.store
        assert store is not None
        if is_async(store):
            self._refuse(InvalidTransition, "flush",
                         "this run's store is async: await flush_async()")
        batch, options = self._batch()
        with _StoreCall(self, self._flush_action(), batch):
            store.append(self.state.run_id, batch, self.flushed, **options)
        return self._flushed_ok(len(batch))

    async def flush_async(self) -> PendingCommit | None:
        """`flush` for any store: awaits an async store's append, calls a sync one."""
        store = self.store
        if (not self.unflushed and self.write is None) or store is None or not is_async(
                store):
            return self.flush()
        if self.stopped is not None:
            self.refuse_stopped("flush")
        batch, options = self._batch()
        with _StoreCall(self, self._flush_action(), batch):
            await store.append(  # type: ignore[func-returns-value,misc]
                self.state.run_id, batch, self.flushed, **options)
        return self._flushed_ok(len(batch))

    def _flush_action(self) -> str:
        """The command a flush's failure names: the commit's, when one waits."""
        return "flush" if self.write is None else self.write.action

    def _batch(self) -> tuple[list[ev.Event], dict[str, Any]]:
        options: dict[str, Any] = {"snapshot": self.pending_snapshot}
        store = self.store
        if indexes_runs(store) or is_async(store):
            options["step"] = self.state.step
        events = self.events[self.flushed - self.base:]
        commit = self.write
        writes = list(self.riding)  # (their commits are among the buffered events)
        if commit is not None:  # a commit event with its Session write: one transaction
            events.append(commit.event)
            options["step"] = commit.dest
            writes.append(commit.write)
        if writes:
            options["session_write"] = writes[0] if len(writes) == 1 else tuple(writes)
        if keeps_read_models(store):
            options["read_model"] = read_model(
                self.state, settled_to=None if commit is None else commit.dest)
        return events, options

    def _flushed_ok(self, count: int) -> PendingCommit | None:
        if self.pending_snapshot is not None:
            self.snapshot_at = self.flushed
        self.flushed += count
        self.pending_snapshot = None
        self.riding = ()
        commit, self.write = self.write, None
        if commit is not None:  # the commit and its items landed: apply the commit
            self.state.apply(commit.event, commit.dest)
            self.events.append(commit.event)
            self.version = commit.event.seq + 1
            self.size = commit.size
        return commit

    # ------------------------------------------------------------------ fencing

    def fence(self) -> None:
        """`RunController.fence`: refused when the store's log has moved past what this
        journal flushed (another attempt appended: it superseded this one)."""
        store = self.store
        if store is None:
            return
        if is_async(store):
            self._refuse(InvalidTransition, "fence",
                         "this run's store is async: await fence_async()")
        with _StoreCall(self, "fence", None):
            found = _stored_version(store, self.state.run_id)
        self._fenced(found)

    async def fence_async(self) -> None:
        """`fence` for any store: awaits an async store's read, calls a sync one."""
        store = self.store
        if store is None or not is_async(store):
            self.fence()
            return
        with _StoreCall(self, "fence", None):
            reader = getattr(store, "version", None)
            found = int(await reader(self.state.run_id) if reader is not None
                        else len(await store.load(self.state.run_id)))  # type: ignore[misc]
        self._fenced(found)

    def _fenced(self, found: int) -> None:
        if self.stopped is not None:
            self.refuse_stopped("fence")
        if found != self.flushed:
            reason = (f"another attempt moved the log (this one flushed {self.flushed} "
                      f"events, the store holds {found}): this attempt was superseded; "
                      "load the run again to go on")
            self.stop(ConcurrencyConflict, reason)
            self._refuse(ConcurrencyConflict, "fence", reason)

    # -------------------------------------------------------- stopping and refusing

    def drop_commit(self) -> None:
        """Forget the commit whose append failed: nothing of it landed, or its outcome is
        unknown and the journal is stopped."""
        if self.write is not None:
            self.write = None
            if not self.buffered:
                self.pending_snapshot = None

    def stop(self, kind: type[ControlError], reason: str) -> None:
        """Refuse every command from now on with ``kind`` and ``reason``: only loading the
        run again goes on."""
        self.stopped = (kind, reason)

    def refuse_stopped(self, action: str) -> NoReturn:
        """Refuse ``action`` of a stopped journal (the run must be loaded again)."""
        assert self.stopped is not None
        kind, reason = self.stopped
        self._refuse(kind, action, reason)

    def _refuse(self, kind: type[ControlError], action: str, reason: str) -> NoReturn:
        state = self.state
        raise kind(reason, run_id=state.run_id, step=state.step, action=action)



class _StoreCall:
    """A store call whose failure is typed here, once (``with _StoreCall(...)``):

    * `ConcurrencyConflict` from an append: another writer moved the log, and a buffered
      journal stops (its events stay behind, refused); for a run's first batch (seq 0) it
      is the run that already exists;
    * `StorageError`: placed (it names the run, step and command); when an append may
      have landed (outcome not `Outcome.NOT_WRITTEN`) the journal stops;
    * another refusal of an append is placed too (a read's passes as it is: loading
      raises its own, with their own step);
    * an error the store did not type (`stores.UNTYPED_BACKEND_ERRORS`): a `StorageError`,
      outcome `Outcome.UNKNOWN` for an append (the journal stops) and ``NOT_WRITTEN`` for a
      read;
    * anything else (an interrupted append, an error of unknown kind) passes as it is,
      and an append stops the journal: it may have landed.

    A failed append also drops the commit waiting for it (`Journal.hold_commit`). Where
    there is no journal yet (starting, loading) there is nothing to stop, and the error
    names the run and no step."""

    __slots__ = ("action", "batch", "journal", "step")

    def __init__(self, journal: Journal | str, action: str,
                 batch: Sequence[ev.Event] | None) -> None:
        self.journal = journal  # (or, where there is none yet, the run id)
        self.action = action
        self.batch = batch
        self.step = None if isinstance(journal, str) else journal.state.step
        """The step the run is in as the call is made: what a failure names, even where
        the state went ahead of the append (`Journal.record`)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: Any) -> None:
        if error is None:
            return
        found = self.journal
        journal = None if isinstance(found, str) else found
        where: dict[str, Any] = {
            "run_id": found if journal is None else journal.state.run_id,
            "step": self.step, "action": self.action}
        batch = self.batch
        if batch is None:  # a read: nothing was written
            if isinstance(error, StorageError):
                _placed(error, **where)
            elif isinstance(error, UNTYPED_BACKEND_ERRORS):
                raise _untyped(error, Outcome.NOT_WRITTEN, where) from error
            return
        what = f"{len(batch)} event(s) from seq {batch[0].seq}, {self.action}"
        if journal is not None:
            journal.drop_commit()
        if isinstance(error, ConcurrencyConflict):
            if journal is not None and journal.buffered:  # they stay behind, refused
                journal.stop(ConcurrencyConflict,
                             f"this controller's buffered events were refused ({what}): "
                             "another writer moved the log; load the run again to go on")
            if batch[0].seq == 0:
                raise ConcurrencyConflict("a run with this id already exists in the store",
                                          **where) from None
            _placed(error, **where)
            return
        if isinstance(error, ControlError):
            if (journal is not None and isinstance(error, StorageError)
                    and error.outcome != Outcome.NOT_WRITTEN):
                journal.stop(StorageError, _unknown(what))
            elif (journal is not None and journal.buffered
                  and isinstance(error, ReconcileRejected)):
                # the Session moved under a riding write (`SessionWrite.after`): written
                # again, it would be refused again; they stay behind, refused
                journal.stop(ReconcileRejected,
                             f"this controller's buffered events were refused ({what}): "
                             f"{error.reason}")
            _placed(error, **where)
            return
        if journal is not None:  # interrupted, or untyped: the append may have landed
            journal.stop(StorageError, _unknown(what))
        if isinstance(error, UNTYPED_BACKEND_ERRORS):
            raise _untyped(error, Outcome.UNKNOWN, where) from error


def _stored_version(store: EventStore, run_id: str) -> int:
    """How many events ``store`` holds for ``run_id``: its ``version(run_id)`` (one
    indexed read; every store of this library has it), else the length of its log (a
    store of your own without one: correct, and O(log length))."""
    reader = getattr(store, "version", None)
    if reader is not None:
        return int(reader(run_id))
    return len(store.load(run_id))


def _unknown(what: str) -> str:
    return (f"an earlier append's outcome is unknown ({what}); this controller may be "
            "behind its log: load the run again from the store (RunController.load) to go "
            "on")


def _placed(error: ControlError, *, run_id: str | None, step: Any, action: str) -> None:
    """Make ``error`` (a store's) say which run, step and command it refused."""
    error.run_id, error.step, error.action = run_id, step, action
    error.args = (error._message(),)


def _untyped(error: BaseException, outcome: Outcome, where: dict[str, Any]) -> StorageError:
    """A `StorageError` for an error a store let through untyped (`Outcome.UNKNOWN`
    for an append: the store did not say whether it landed)."""
    return StorageError(f"the store raised {type(error).__name__}: {error}", outcome=outcome,
                        **where)


def _snapshot_size(store: EventStore, run_id: str, stored: Mapping[str, Any] | None,
                   base: int, tail: Loaded) -> int:
    """`RunController.size` of a run loaded from a snapshot: the size it recorded for the
    log before it, plus the tail's events. A snapshot without one (an older library's)
    costs one read of the log before it."""
    before = None if stored is None else stored.get(SNAPSHOT_SIZE)
    if type(before) is not int or before < 1:
        before = codec.log_size(run_id, store.load(run_id)[:base])
    if tail.size is not None:
        return before + (tail.size + 1 if tail.events else 0)
    return before + sum(_EVENT_SIZE[type(event)](event) + 1 for event in tail.events)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Decoding and replaying a log allocates many objects and no reference cycles; the
    cyclic collector's full passes over a growing heap would cost a third of a large
    load. It is switched back on afterwards if it was on."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def is_async(store: object) -> bool:
    """Whether ``store`` appends with a coroutine (an `AsyncEventStore`)."""
    return bool(inspect.iscoroutinefunction(getattr(store, "append", None)))


class _SyncBridge:
    """An async store seen from a worker thread as a sync one (for `Journal.load_async`):
    each call runs the store's coroutine on the loop and waits for it. Never used on the
    loop's own thread. A store's measured loads (``load_measured``,
    ``load_latest_measured``) are passed on when it has them."""

    def __init__(self, store: Any, loop: asyncio.AbstractEventLoop) -> None:
        self._store = store
        self._loop = loop
        for name in ("load_measured", "load_latest_measured"):
            own = getattr(store, name, None)
            if own is not None:
                setattr(self, name, functools.partial(self._passed, own))

    def _wait(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def _passed(self, method: Any, run_id: str) -> Any:
        return self._wait(method(run_id))

    def append(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("loading never appends")

    def load(self, run_id: str) -> list[ev.Event]:
        return self._wait(self._store.load(run_id))  # type: ignore[no-any-return]

    def load_latest(self, run_id: str) -> tuple[Any, list[ev.Event]]:
        return self._wait(self._store.load_latest(run_id))  # type: ignore[no-any-return]
