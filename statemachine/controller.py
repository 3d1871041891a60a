"""`RunController`: the embedding API. Commands in, events recorded, decisions out.

Sans-I/O: the controller never calls a model, a tool or a Session. The runner asks it
(``begin_tool``, ``stage_publication``, ``reconcile``...), performs the effect itself, and
reports the outcome (``tool_completed``, ``publication_committed``...).

Every command goes through the same pipeline, and the first failing check wins:

1. the gate: `RunNotResumable` for a completed or terminal run (and for an unsettled
   fail-closed one), `PublicationUnsettled` for anything but commit, fail, reconcile and
   abandon while unsettled (I2);
2. the arguments: `SchemaError` unless plain JSON within the limits (detached here);
3. `ToolInDoubt`, only from ``resume`` and ``begin_tool``;
4. the machine (`machine.destination`): `InvalidTransition` naming the failed guard;
5. the store, when one is bound: the event is appended with the expected version, so a
   `ConcurrencyConflict` leaves this controller unchanged;
6. the fold: the event is applied and appended to ``events``.

Two things the controller knows and the log does not, and that are never serialized:
the publication attempt it holds (stage or an ``Append`` decision, until commit or fail)
and the calls it has in flight (started here, not yet completed).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import inspect
import sqlite3
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NoReturn

import attrs

from statemachine import codec
from statemachine import events as ev
from statemachine.envelope import Envelope, FindingKind, classify, measure_frontier
from statemachine.errors import (
    ConcurrencyConflict,
    ControlError,
    InvalidTransition,
    Outcome,
    PublicationUnsettled,
    ReconcileRejected,
    RunNotFound,
    RunNotResumable,
    SchemaError,
    StorageError,
    ToolInDoubt,
    excerpt,
)
from statemachine.machine import (
    NEUTRAL_TRIGGERS,
    SETTLING_TRIGGERS,
    Refused,
    destination,
    replay,
    replay_onto,
)
from statemachine.payloads import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_DEPTH,
    DEFAULT_MAX_EVENTS,
    JSON,
    MAX_TEXT,
    PayloadError,
    canonical_form,
    copy_plain,
    detach,
    digests,
    text_problem,
)
from statemachine.state import RunState, in_doubt, next_action
from statemachine.stores import (
    SNAPSHOT_EVERY,
    AsyncEventStore,
    MemoryEventStore,
    SessionWrite,
    SnapshotStore,
    indexes_runs,
    restored,
    snapshot_ignored,
    takes_session_write,
)
from statemachine.structured_logging import run_logger, switch
from statemachine.values import (
    TERMINAL_STEPS,
    WORKING_STEPS,
    Acknowledge,
    Action,
    Append,
    CallView,
    Execute,
    GuardrailResult,
    Phase,
    RecoveryPolicy,
    Resend,
    Step,
    ToolCall,
)

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
"""The bytes (UTF-8, as JSON) of an error name or abandon reason that the room reserved
under ``max_bytes`` holds: a run at its byte limit can always fail, reconcile, commit and
abandon with a reason or an error name up to this long."""

_RECORDS_NOTHING = frozenset({"tool_interrupted"})
"""Commands that never record an event, so the log's room does not gate them."""
_UNSETTLED = Step.UNSETTLED
_WORKING = frozenset(WORKING_STEPS)


class RunController:
    """The control core of one run. Create with `start`, `load` or `from_json`."""

    __slots__ = ("_attempt", "_base", "_buffered", "_bytes", "_conflict", "_events",
                 "_flushed", "_in_flight", "_log", "_max_bytes", "_max_depth", "_max_events",
                 "_pending_snapshot", "_room", "_snapshot_at", "_state", "_store",
                 "_unknown", "_write")

    def __init__(self, state: RunState, events: list[ev.Event], *, store: EventStore | None,
                 max_depth: int, max_events: int, base: int = 0,
                 max_bytes: int = DEFAULT_MAX_BYTES, size: int | None = None) -> None:
        self._state = state
        self._events = events
        self._base = base  # events before this seq live only in the store (snapshot load)
        self._store = store
        self._max_depth = max_depth
        self._max_events = max_events
        self._attempt: int | None = None
        self._in_flight: dict[str, None] = {}  # a set, in the 64 bytes of an empty dict
        self._log: Any = None
        self._unknown: str | None = None
        """Why an append's outcome is unknown (None: it never was); then every command
        is refused until the run is loaded again."""
        self._buffered = store is not None and _is_async(store)
        """Durability at effect boundaries: events are kept here and appended by
        `flush` / `flush_async` in one transaction (always so for an async store)."""
        self._flushed = base + len(events)
        """How many events the store holds (the version the next flush expects)."""
        self._pending_snapshot: dict[str, JSON] | None = None
        self._write: _PendingWrite | None = None
        """A publication's commit event and its Session write, waiting for the append
        that writes both in one transaction (`publication_committed(session_write=)`)."""
        self._snapshot_at = base
        self._conflict: str | None = None
        """Why buffered events were refused by the store (another writer moved the log);
        then every command is refused until the run is loaded again."""
        self._bytes = codec.log_size(state.run_id, events) if size is None else size
        """The size of `to_json()` (no chain): what ``max_bytes`` bounds, kept as events
        are recorded (``base`` > 0 needs ``size``: the events before it are not here)."""
        self._max_bytes = max_bytes
        self._room = max_bytes - _byte_reserves(max_events)[0]
        """The size below which any command may record; above it only the settling ones
        and abandon may, in the room reserved for them (`_over_bytes`)."""

    # ----------------------------------------------------------- creating a run

    @classmethod
    def start(
        cls,
        *,
        run_id: str,
        session_id: str | None,
        policy: RecoveryPolicy = RecoveryPolicy.RECONCILE,
        max_turns: int | None = None,
        canonical: str = "json",
        store: EventStore | None = None,
        max_depth: int = DEFAULT_MAX_DEPTH,
        max_events: int = DEFAULT_MAX_EVENTS,
        max_bytes: int = DEFAULT_MAX_BYTES,
        buffered: bool = False,
    ) -> RunController:
        """Start a run. ``session_id=None`` is a run without a Session; ``canonical``
        names a registered canonical form (`register_canonical`). With a ``store`` the
        first event is appended at version 0 (`ConcurrencyConflict` if the run exists).

        ``buffered=True`` (always so with an async store): events are appended only by
        `flush` / `flush_async`, one transaction per effect boundary, and a run id the
        store already holds is refused at the first flush.

        ``max_bytes`` bounds the size of `to_json()` (the UTF-8 length of its compact JSON
        text, the keyed chain included): a command that would take the run over it is
        refused before recording, leaving room for settling and closing the run."""
        where = {"run_id": run_id if text_problem(run_id) is None else None,
                 "action": "start"}
        for name, text in (("run_id", run_id), ("session_id", session_id),
                           ("canonical", canonical)):
            problem = None if text is None and name == "session_id" else text_problem(text)
            if problem is not None:
                raise SchemaError(f"{name} {problem}", **where)
        if not run_id:
            raise SchemaError("run_id must not be empty", **where)
        if type(policy) is not RecoveryPolicy:
            raise SchemaError("policy must be a RecoveryPolicy", **where)
        if max_turns is not None and (type(max_turns) is not int or max_turns < 0):
            raise SchemaError("max_turns must be None or an int >= 0", **where)
        for name, limit in (("max_depth", max_depth), ("max_events", max_events)):
            if type(limit) is not int or limit < 1:
                raise SchemaError(f"{name} must be an int >= 1", **where)
        if max_events <= RESERVED_EVENTS + 1:
            raise SchemaError(f"max_events must exceed {RESERVED_EVENTS + 1}", **where)
        canonical_form(canonical)  # SchemaError when unknown
        started = ev.RunStarted(0, run_id, session_id, policy, max_turns, canonical)
        size = _started_size(started, max_events, max_bytes, where)
        if store is not None and (buffered or _is_async(store)):
            controller = cls(RunState(started), [started], store=store, max_depth=max_depth,
                             max_events=max_events, max_bytes=max_bytes, size=size)
            controller._buffered, controller._flushed = True, 0
            controller._logged(started, None)
            return controller
        if store is not None:
            try:
                store.append(run_id, (started,), 0)
            except ConcurrencyConflict:
                raise ConcurrencyConflict("a run with this id already exists in the store",
                                          **where) from None
            except StorageError as exc:
                _placed(exc, run_id=where["run_id"], step=None, action="start")
                raise
            except (sqlite3.Error, OSError) as exc:  # a store that does not type its errors
                raise _storage_error(exc, Outcome.UNKNOWN, **where) from exc
        controller = cls(RunState(started), [started], store=store, max_depth=max_depth,
                         max_events=max_events, max_bytes=max_bytes, size=size)
        controller._logged(started, None)
        return controller

    @classmethod
    def from_json(
        cls,
        data: Mapping[str, Any] | str | bytes,
        *,
        max_depth: int = DEFAULT_MAX_DEPTH,
        max_events: int = DEFAULT_MAX_EVENTS,
        max_bytes: int = DEFAULT_MAX_BYTES,
        key: bytes | None = None,
    ) -> RunController:
        """Rebuild a run from `to_json` output (dict or text), replaying the whole log.

        `SchemaError` for a malformed document, and for one over ``max_bytes``: the UTF-8
        length of its compact JSON text, the same for a dict and its compact text (a text
        longer than that, with spaces or ASCII escapes, is measured as given and refused
        before it is parsed). With ``key``, `SchemaError` unless the document carries a
        keyed chain (`to_json(key=...)`) that verifies under that key, checked before any
        state is built; without one a chain is not checked. `InvalidTransition` naming the
        sequence number of the first event the machine forbids. The controller holds no
        attempt and no call in flight."""
        _check_limit("max_bytes", max_bytes, "load")
        with _gc_paused():
            decoded = codec.decode_log(data, max_depth=max_depth, max_events=max_events,
                                       max_bytes=max_bytes, key=key)
            state = replay(decoded.run_id, decoded.events)
            return cls(state, decoded.events, store=None, max_depth=max_depth,
                       max_events=max_events, max_bytes=max_bytes, size=decoded.size)

    @classmethod
    def load(
        cls,
        store: EventStore,
        run_id: str,
        *,
        max_depth: int = DEFAULT_MAX_DEPTH,
        max_events: int = DEFAULT_MAX_EVENTS,
        max_bytes: int = DEFAULT_MAX_BYTES,
        snapshot: bool = True,
        buffered: bool = False,
    ) -> RunController:
        """Load a run from an event store and bind it to that store (``buffered`` as for
        `start`; an async store is loaded with `load_async`).

        From a store that keeps snapshots (`stores.SnapshotStore`) the newest snapshot is
        used if it passes its checks and only the events after it are replayed, so loading
        is O(1) in log length. A snapshot that fails them (it does not restore, is another
        run's, the events after it do not follow it or do not replay onto it; the SQLite
        store also checks its digest and that its version is within the log) is ignored
        with a `stores.SnapshotIgnored` warning, and the whole log is replayed.
        ``snapshot=False`` always replays the whole log.

        `RunNotFound` for a run the store does not hold; `SchemaError` or
        `InvalidTransition` for a log that is damaged, has a gap or does not replay;
        `StorageError` when the store cannot be read. Loading is also the one way on after
        a command's append had an unknown outcome. ``max_bytes`` as for `start`: a log
        whose `to_json()` is over it is `SchemaError`."""
        _check_limit("max_bytes", max_bytes, "load")
        with _gc_paused():
            loaded = cls._load(store, run_id, max_depth=max_depth, max_events=max_events,
                               snapshot=snapshot)
        loaded._bind_max_bytes(max_bytes)
        loaded._buffered = buffered
        return loaded

    @classmethod
    async def load_async(
        cls,
        store: AsyncEventStore | EventStore,
        run_id: str,
        *,
        max_depth: int = DEFAULT_MAX_DEPTH,
        max_events: int = DEFAULT_MAX_EVENTS,
        max_bytes: int = DEFAULT_MAX_BYTES,
        snapshot: bool = True,
        buffered: bool = False,
    ) -> RunController:
        """`load` without blocking the event loop: decoding and replay run on a worker
        thread, which awaits the store's coroutines on this loop. A controller bound to
        an async store buffers its events (flush with `flush_async`).

        A `MemoryEventStore` is loaded on the loop itself: it does no I/O and decodes
        nothing, and it keeps snapshots, so its load replays a bounded tail; the hop to
        a worker thread costs more than that."""
        if type(store) is MemoryEventStore:
            return cls.load(store, run_id, max_depth=max_depth, max_events=max_events,
                            max_bytes=max_bytes, snapshot=snapshot, buffered=buffered)
        if not _is_async(store):
            return await asyncio.to_thread(
                cls.load, store, run_id,  # type: ignore[arg-type]
                max_depth=max_depth, max_events=max_events,
                max_bytes=max_bytes, snapshot=snapshot, buffered=buffered)
        loop = asyncio.get_running_loop()
        bridge = _SyncBridge(store, loop)
        loaded: RunController = await asyncio.to_thread(
            cls.load, bridge, run_id,
            max_depth=max_depth, max_events=max_events, max_bytes=max_bytes,
            snapshot=snapshot)
        loaded._store = store  # type: ignore[assignment]
        loaded._buffered = True
        return loaded

    @classmethod
    def _load(cls, store: EventStore, run_id: str, *, max_depth: int, max_events: int,
              snapshot: bool = True) -> RunController:
        try:
            return cls._loaded(store, run_id, max_depth=max_depth, max_events=max_events,
                               snapshot=snapshot)
        except StorageError as exc:
            _placed(exc, run_id=run_id, step=None, action="load")
            raise
        except (sqlite3.Error, OSError) as exc:  # a store that does not type its errors
            raise _storage_error(exc, Outcome.NOT_WRITTEN, run_id=run_id, action="load") from exc

    @classmethod
    def _loaded(cls, store: EventStore, run_id: str, *, max_depth: int, max_events: int,
                snapshot: bool) -> RunController:
        where = {"run_id": run_id, "action": "load"}
        stored: Mapping[str, Any] | None = None
        state: RunState | None = None
        log: list[ev.Event] | None = None
        source: Sequence[ev.Event] = ()
        if snapshot and isinstance(store, SnapshotStore):
            stored, tail = store.load_latest(run_id)
            state = restored(run_id, stored, tail)
            if state is not None:
                base = state.last_seq + 1
                if base + len(tail) > max_events:
                    raise SchemaError(f"the log has more than max_events={max_events} "
                                      "events", **where)
                try:
                    replay_onto(state, tail, first=base)
                except ControlError:
                    pass  # the whole log decides below: it raises too, or the snapshot is bad
                else:
                    return cls(state, list(tail), store=store, max_depth=max_depth,
                               max_events=max_events, base=base,
                               size=_snapshot_size(store, run_id, stored, base, tail))
            elif stored is None and tail and tail[0].seq == 0:
                log, source = list(tail), tail  # no snapshot: the tail is the whole log
        if log is None:
            source = store.load(run_id)
            log = list(source)
        if not log:
            raise RunNotFound("no such run in the store", **where)
        if len(log) > max_events:
            raise SchemaError(f"the log has more than max_events={max_events} events",
                              **where)
        loaded = cls._replayed(run_id, log, store=store, max_depth=max_depth,
                               max_events=max_events, size=_measured_size(run_id, source))
        if stored is not None and state is not None:
            snapshot_ignored(run_id, "the events after it do not replay onto it")
        return loaded

    @classmethod
    def _replayed(cls, run_id: str, events: list[ev.Event], *, store: EventStore | None,
                  max_depth: int, max_events: int, size: int | None = None
                  ) -> RunController:
        state = replay(run_id, events)
        return cls(state, events, store=store, max_depth=max_depth, max_events=max_events,
                   size=size)

    def to_json(self, key: bytes | None = None) -> dict[str, JSON]:
        """The run as a plain JSON tree of the current ``schema_version``.

        With ``key`` (non-empty bytes) the document also carries ``"chain"``: the
        HMAC-SHA256 chain over its events (`codec.chain_tag`), so that
        ``from_json(..., key=key)`` refuses a document whose events were edited, removed
        or reordered. Without a key, replay rejects only an illegal or malformed log: an
        edited payload that keeps the log legal loads."""
        return codec.encode_log(self._state.run_id, self._log_events(), key=key)

    @property
    def size(self) -> int:
        """The size of `to_json()`: the UTF-8 length of its compact JSON text
        (``json.dumps(doc, separators=(",", ":"), ensure_ascii=False)``), without a
        keyed chain (which adds `codec.CHAIN_BYTES`). ``max_bytes`` bounds it. O(1)."""
        return self._bytes

    def _bind_max_bytes(self, max_bytes: int) -> None:
        """Bind a loaded run to ``max_bytes``; `SchemaError` when it is already over."""
        if self._bytes > max_bytes:
            raise SchemaError(f"the log is over max_bytes={max_bytes} (its JSON takes "
                              f"{self._bytes} bytes)", run_id=self._state.run_id,
                              action="load")
        self._max_bytes = max_bytes
        self._room = max_bytes - _byte_reserves(self._max_events)[0]

    # ------------------------------------------------------------------ reading

    @property
    def run_id(self) -> str:
        return self._state.run_id

    @property
    def session_id(self) -> str | None:
        return self._state.session_id

    @property
    def policy(self) -> RecoveryPolicy:
        return self._state.policy

    @property
    def step(self) -> Step:
        return self._state.step

    @property
    def store(self) -> EventStore | None:
        """The event store this run is bound to (None for a run without one)."""
        return self._store

    @property
    def max_turns(self) -> int | None:
        return self._state.max_turns

    @property
    def turns(self) -> int:
        """Model responses recorded so far (what ``max_turns`` counts)."""
        return self._state.turns

    @property
    def events(self) -> tuple[ev.Event, ...]:
        """The whole log, as copies (read from the store for a run loaded from a snapshot:
        O(log length); ``version`` is the O(1) way to see whether the log moved)."""
        return tuple(ev.copied(event) for event in self._log_events())

    def _log_events(self) -> list[ev.Event]:
        if self._base and self._store is not None:
            return [*self._prefix(self._store), *self._events]
        return self._events

    def _prefix(self, store: EventStore) -> list[ev.Event]:
        """The events before the snapshot this run was loaded from, read from the store:
        exactly ``_base`` of them, seq 0 on, and leading (with the events after them) to
        this run's state; else `SchemaError` (or the replay's `InvalidTransition`): never a
        shorter log, nor one the snapshot did not come from. O(log length), like
        ``events`` itself."""
        where = {"run_id": self._state.run_id, "action": "events"}
        if _is_async(store):
            raise InvalidTransition(
                "this run was loaded from a snapshot of an async store, so its whole log "
                "is not at hand: load it with load_async(..., snapshot=False) to read it",
                step=self._state.step, **where)
        try:
            prefix = store.load(self._state.run_id)[: self._base]
        except StorageError as exc:
            _placed(exc, run_id=where["run_id"], step=self._state.step, action="events")
            raise
        except (sqlite3.Error, OSError) as exc:  # a store that does not type its errors
            raise _storage_error(exc, Outcome.NOT_WRITTEN, **where) from exc
        if len(prefix) != self._base or any(
                event.seq != seq for seq, event in enumerate(prefix)):
            raise SchemaError(f"the stored log lacks events before the snapshot this run "
                              f"was loaded from (it holds {len(prefix)} of {self._base})",
                              **where)
        with _gc_paused():
            if replay(self._state.run_id, [*prefix, *self._events]) != self._state:
                raise SchemaError("the stored log before the snapshot this run was loaded "
                                  "from does not lead to the snapshot's state (it was "
                                  "changed)", **where)
        return prefix

    @property
    def state(self) -> RunState:
        """The folded state (read-only by convention; compare runs with ``==``)."""
        return self._state

    @property
    def pending_approvals(self) -> tuple[str, ...]:
        """Call ids awaiting a decision, in proposal order."""
        return self._state.awaiting()

    @property
    def envelope(self) -> Envelope | None:
        """The unsettled publication envelope (a copy), or None."""
        envelope = self._state.envelope
        if envelope is None:
            return None
        return attrs.evolve(envelope, items=tuple(copy_plain(i) for i in envelope.items),
                            guardrails=tuple(ev.copied(g) for g in envelope.guardrails))

    @property
    def guardrail_results(self) -> tuple[GuardrailResult, ...]:
        """The published guardrail results, in evaluation order (I4), as copies."""
        return tuple(ev.copied(g) for g in self._state.published_guardrails)

    @property
    def pending_guardrail_results(self) -> tuple[GuardrailResult, ...]:
        """Completed guardrail results the next settled batch will publish (copies)."""
        return tuple(ev.copied(g) for g in self._state.pending_guardrails)

    @property
    def unpublished_input(self) -> tuple[JSON, ...]:
        """Input recorded by ``add_input`` that no settled batch has published yet (copies):
        a runner publishes it first, before anything else (its batch starts with these
        items)."""
        return tuple(copy_plain(item) for item in self._state.pending_input)

    @property
    def model_output(self) -> JSON:
        """The output of the model's last response (what FINALIZING is finishing)."""
        return copy_plain(self._state.model_output)

    @property
    def final_output(self) -> JSON:
        """The accepted final output (None until ``accept_final_output``)."""
        return copy_plain(self._state.final_output)

    @property
    def holds_attempt(self) -> bool:
        """Whether this controller opened the open publication attempt."""
        return self._attempt is not None and self._attempt == self._state.attempt_seq

    def fingerprint(self, call_id: str) -> str:
        """sha256 hex of the built-in canonical JSON of ``[name, arguments]``."""
        record = self._state.calls.get(call_id) if type(call_id) is str else None
        if record is None:
            self._refuse(InvalidTransition, "fingerprint", "unknown call id")
        return record.fingerprint

    @property
    def in_flight(self) -> tuple[str, ...]:
        """Calls this controller started and has not seen complete (never serialized)."""
        return tuple(self._in_flight)

    def recorded_guardrail(self, name: str, *, stage: str,
                           call_id: str | None = None) -> GuardrailResult | None:
        """The result recorded for this guardrail in its scope (this call for tool
        stages, the current activation otherwise), or None: how a resumed runner skips a
        guardrail that already ran (I1) and honours its verdict."""
        self._text("recorded_guardrail", "name", name)
        self._text("recorded_guardrail", "stage", stage)
        self._text("recorded_guardrail", "call_id", call_id, optional=True)
        s = self._state
        found = s.guardrail_keys.get(s.guardrail_key(GuardrailResult(name, stage, call_id,
                                                                     None)))
        return None if found is None else ev.copied(found)

    def hook_done(self, hook: str, *, call_id: str | None = None) -> bool:
        """Whether this hook already ran in its scope (I1)."""
        self._text("hook_done", "hook", hook)
        self._text("hook_done", "call_id", call_id, optional=True)
        return self._state.hook_key(hook, call_id) in self._state.hook_keys

    def in_doubt(self) -> tuple[str, ...]:
        """Started, non-idempotent calls this controller does not hold in flight."""
        return in_doubt(self._state, self._in_flight)

    def next_action(self) -> Action:
        """What the runner should do next; see `Action` and `state.next_action`."""
        return next_action(self._state, holds_attempt=self.holds_attempt,
                           in_flight=self._in_flight)

    @property
    def calls(self) -> tuple[CallView, ...]:
        """The tool ledger in proposal order, as copies (`CallView`)."""
        in_flight = self._in_flight
        return tuple(
            CallView(_copy_call(r.call), r.phase, r.starts, call_id in in_flight,
                     copy_plain(r.result))
            for call_id, r in self._state.calls.items())

    def call(self, call_id: str) -> CallView:
        """One call of the ledger as a copy; `InvalidTransition` for an unknown id."""
        record = self._state.calls.get(call_id) if type(call_id) is str else None
        if record is None:
            self._refuse(InvalidTransition, "call", "unknown call id")
        return CallView(_copy_call(record.call), record.phase, record.starts,
                        call_id in self._in_flight, copy_plain(record.result))

    def phase(self, call_id: str) -> Phase | None:
        """The call's `Phase`, or None for a call the ledger does not know. O(1)."""
        record = self._state.calls.get(call_id) if type(call_id) is str else None
        return None if record is None else record.phase

    def unpublished_call_ids(self) -> tuple[str, ...]:
        """Calls whose result (an output or a rejection) is recorded and not yet
        published, in proposal order: what the next batch must name in ``call_ids``."""
        s = self._state
        if not s.unpublished_results():
            return ()
        return tuple(call_id for call_id, r in s.calls.items()
                     if r.phase is Phase.COMPLETED or r.phase is Phase.REJECTED)

    def runnable_call_ids(self) -> tuple[str, ...]:
        """Calls ``begin_tool`` would answer `Execute` for now, in proposal order: approved
        and unstarted, or started by an idempotent call no live controller holds."""
        s = self._state
        counts = s.counts
        if not (counts[Phase.APPROVED] or counts[Phase.STARTED]):
            return ()
        in_flight = self._in_flight
        return tuple(
            call_id for call_id, r in s.calls.items()
            if r.phase is Phase.APPROVED or (r.phase is Phase.STARTED and r.call.idempotent
                                             and call_id not in in_flight))

    @property
    def version(self) -> int:
        """How many events the log holds (the store's expected version). O(1), unlike
        ``len(events)`` for a run loaded from a snapshot."""
        return self._seq

    # ---------------------------------------------------------------- pipeline

    def _refuse(self, kind: type[ControlError], action: str, reason: str) -> NoReturn:
        raise kind(reason, run_id=self._state.run_id, step=self._state.step, action=action)

    def _gate(self, action: str, trigger: str) -> None:
        if self._conflict is not None:
            self._refuse(ConcurrencyConflict, action,
                         f"this controller's buffered events were refused ({self._conflict}):"
                         " another writer moved the log; load the run again to go on")
        if self._unknown is not None:
            self._refuse(StorageError, action,
                         f"an earlier append's outcome is unknown ({self._unknown}); this "
                         "controller may be behind its log: load the run again from the "
                         "store (RunController.load) to go on")
        s = self._state
        step = s.step
        if step in _WORKING and (self._max_events - self._base - len(self._events)
                                 > RESERVED_EVENTS + 2):
            return  # the hot path: a live, settled run with room in its log
        if step in TERMINAL_STEPS:
            self._refuse(RunNotResumable, action, f"the run is {step.value} and never resumes")
        if step is _UNSETTLED:
            envelope = s.envelope
            assert envelope is not None
            if envelope.fail_closed and trigger != "abandon" and not (
                trigger in ("publication_committed", "publication_failed")
                and self.holds_attempt
            ):
                self._refuse(
                    RunNotResumable, action,
                    "a fail-closed publication is unsettled: the side effect completed and "
                    "the write's outcome is unknown; repair the Session or start a new run "
                    "(abandon records it as terminal)")
            if trigger not in SETTLING_TRIGGERS and trigger not in NEUTRAL_TRIGGERS:
                self._refuse(
                    PublicationUnsettled, action,
                    "a publication envelope is unsettled; reconcile it (or commit, fail or "
                    "abandon) before anything else runs")
        if trigger in _RECORDS_NOTHING:
            return  # it needs no room in the log, and refusing it would strand a call
        room = self._max_events - self._seq
        needed = 1 if trigger == "abandon" else 2 if trigger in SETTLING_TRIGGERS else (
            RESERVED_EVENTS + _FINISHING.get(trigger, 1))
        if room < needed:
            self._refuse(SchemaError, action,
                         f"the log is at its limit of max_events={self._max_events}")

    def _detach(self, action: str, what: str, value: JSON) -> JSON:
        try:
            return detach(value, self._max_depth)
        except PayloadError as exc:
            self._refuse(SchemaError, action, f"{what} is not plain JSON: {exc}")

    def _text(self, action: str, what: str, value: Any, *, optional: bool = False) -> None:
        if optional and value is None:
            return
        problem = text_problem(value)
        if problem is not None:
            self._refuse(SchemaError, action,
                         f"{what} {problem}{' (or None)' if optional else ''}")

    def _record(self, action: str, event: ev.Event) -> Step:
        s = self._state
        if self._write is not None:  # a commit and its Session write wait for their append
            self._refuse(InvalidTransition, action,
                         "a publication's commit and its Session write are waiting for "
                         "their append: await flush_async() first")
        kind = type(event)
        size = self._bytes + _EVENT_SIZE[kind](event) + 1  # the comma before it
        if size > self._room:
            self._over_bytes(action, event, size)
        try:
            dest = destination(s, event)
        except Refused as refused:
            self._refuse(InvalidTransition, action, refused.reason())
        step = s.step
        store = self._store
        if store is not None and self._buffered:
            self._buffer(event)
        elif store is not None:
            snapshot = (s.snapshot() if event.seq % SNAPSHOT_EVERY == 0
                        and isinstance(store, SnapshotStore) else None)
            if snapshot is not None:
                snapshot[SNAPSHOT_SIZE] = self._bytes  # how a load from it knows the size
            try:
                if indexes_runs(store):  # it keeps a head per run: tell it the new step
                    store.append(s.run_id, (event,), event.seq, snapshot=snapshot, step=dest)
                else:
                    store.append(s.run_id, (event,), event.seq, snapshot=snapshot)
            except StorageError as exc:
                if exc.outcome != Outcome.NOT_WRITTEN:
                    self._unknown = f"{type(event).__name__} at seq {event.seq}, {action}"
                _placed(exc, run_id=s.run_id, step=s.step, action=action)
                raise
            except ControlError as exc:
                exc.step, exc.action = s.step, action
                raise
            except (sqlite3.Error, OSError) as exc:  # a store that does not type its errors
                self._unknown = f"{type(event).__name__} at seq {event.seq}, {action}"
                raise _storage_error(exc, Outcome.UNKNOWN, run_id=s.run_id, step=s.step,
                                     action=action) from exc
            except BaseException:  # interrupted, or untyped: the append may have landed
                self._unknown = f"{type(event).__name__} at seq {event.seq}, {action}"
                raise
        s.apply(event, dest)
        self._events.append(event)
        self._bytes = size
        if not self._buffered:
            self._flushed = event.seq + 1
        if switch.enabled:
            self._logged(event, step)  # (the step before: nothing above changes it)
        return dest

    # ------------------------------------------------ durability at effect boundaries

    def _commit_with(self, action: str, write: SessionWrite) -> None:
        """`_record` for a commit event that carries its Session write: checked now,
        appended with the write (and any buffered events) in one transaction, and applied
        only once that append landed (`_flushed_ok`), so a failed append leaves this
        controller as it was. A sync store appends here; an async one at the next
        `flush_async`."""
        s = self._state
        event = ev.PublicationCommitted(self._seq)
        size = self._bytes + _EVENT_SIZE[type(event)](event) + 1
        if size > self._room:
            self._over_bytes(action, event, size)
        try:
            dest = destination(s, event)
        except Refused as refused:
            self._refuse(InvalidTransition, action, refused.reason())
        store = self._store
        if self._buffered:
            self._buffer(event)  # the snapshot a batch starting an interval takes
        elif event.seq % SNAPSHOT_EVERY == 0 and isinstance(store, SnapshotStore):
            snapshot = s.snapshot()
            snapshot[SNAPSHOT_SIZE] = self._bytes
            self._pending_snapshot = snapshot
        self._write = _PendingWrite(action, event, dest, size, write)
        if not _is_async(store):
            self.flush()

    def _drop_write(self) -> str:
        """Forget a pending commit whose append failed (nothing of it landed, or its
        outcome is marked unknown); the action to name in the error."""
        pending, self._write = self._write, None
        if pending is None:
            return "flush"
        if not self._buffered:
            self._pending_snapshot = None
        return pending.action

    def _buffer(self, event: ev.Event) -> None:
        """Keep ``event`` for the next flush. A batch that starts a snapshot interval
        takes the snapshot of the state it starts from (the store's expected version)."""
        store = self._store
        if (self._flushed == event.seq and event.seq - self._snapshot_at >= SNAPSHOT_EVERY
                and isinstance(store, SnapshotStore | AsyncEventStore)):
            snapshot = self._state.snapshot()
            snapshot[SNAPSHOT_SIZE] = self._bytes
            self._pending_snapshot = snapshot

    @property
    def unflushed(self) -> int:
        """Events recorded here and not yet in the store (0 unless the run buffers)."""
        return self._base + len(self._events) - self._flushed

    def _batch(self) -> tuple[list[ev.Event], dict[str, Any]]:
        first = self._flushed - self._base
        options: dict[str, Any] = {"snapshot": self._pending_snapshot}
        if indexes_runs(self._store) or _is_async(self._store):
            options["step"] = self._state.step
        events = self._events[first:]
        pending = self._write
        if pending is not None:  # a commit event with its Session write: one transaction
            events.append(pending.event)
            options["step"] = pending.dest
            options["session_write"] = pending.write
        return events, options

    def _flushed_ok(self, count: int) -> None:
        if self._pending_snapshot is not None:
            self._snapshot_at = self._flushed
        self._flushed += count
        self._pending_snapshot = None
        pending, self._write = self._write, None
        if pending is not None:  # the commit and its items landed: apply the commit
            s = self._state
            before = s.step
            s.apply(pending.event, pending.dest)
            self._events.append(pending.event)
            self._bytes = pending.size
            self._attempt = None
            if switch.enabled:
                self._logged(pending.event, before)

    def _flush_failed(self, exc: BaseException, batch: list[ev.Event]) -> NoReturn:
        s = self._state
        action = self._drop_write()
        where = f"{len(batch)} event(s) from seq {batch[0].seq}"
        if isinstance(exc, ConcurrencyConflict):
            if self._buffered:  # buffered events stay behind, refused: reload to go on
                self._conflict = where
            if batch[0].seq == 0:
                exc = ConcurrencyConflict("a run with this id already exists in the store",
                                          run_id=s.run_id)
            exc.step, exc.action = s.step, action
            raise exc
        if isinstance(exc, StorageError):
            if exc.outcome != Outcome.NOT_WRITTEN:
                self._unknown = f"{where}, {action}"
            _placed(exc, run_id=s.run_id, step=s.step, action=action)
            raise exc
        if isinstance(exc, sqlite3.Error | OSError):
            self._unknown = f"{where}, {action}"
            raise _storage_error(exc, Outcome.UNKNOWN, run_id=s.run_id, step=s.step,
                                 action=action) from exc
        raise exc

    def flush(self) -> None:
        """Append the events this controller buffered, as one transaction with the
        expected version (a no-op when nothing is buffered, e.g. a run that appends per
        command). Call it before every effect outside the process — a tool runs, a write
        is attempted, a model is called — and before acknowledging a human decision; the
        reference runner does. `ConcurrencyConflict` (another writer moved the log; this
        controller then refuses everything until the run is loaded again) or
        `StorageError` (after `Outcome.NOT_WRITTEN` the events stay buffered for a retry).
        A commit waiting with its Session write (`publication_committed(session_write=)`)
        goes in the same transaction, and is applied only if it lands."""
        if not self.unflushed and self._write is None:
            return
        if self._unknown is not None or self._conflict is not None:
            self._gate("flush", "flush")
        store = self._store
        assert store is not None
        if _is_async(store):
            raise InvalidTransition("this run's store is async: await flush_async()",
                                    run_id=self.run_id, step=self.step, action="flush")
        batch, options = self._batch()
        try:
            store.append(self._state.run_id, batch, self._flushed, **options)
        except (ControlError, sqlite3.Error, OSError) as exc:
            self._flush_failed(exc, batch)
        except BaseException:
            # interrupted, or an error the store did not type: the append may have landed
            self._drop_write()
            self._unknown = f"{len(batch)} event(s) from seq {batch[0].seq}, flush"
            raise
        self._flushed_ok(len(batch))

    async def flush_async(self) -> None:
        """`flush` for any store: awaits an async store's append, calls a sync one."""
        store = self._store
        if (not self.unflushed and self._write is None) or store is None or not _is_async(
                store):
            self.flush()
            return
        if self._unknown is not None or self._conflict is not None:
            self._gate("flush", "flush")
        batch, options = self._batch()
        try:
            await store.append(  # type: ignore[func-returns-value,misc]
                self._state.run_id, batch, self._flushed, **options)
        except (ControlError, sqlite3.Error, OSError) as exc:
            self._flush_failed(exc, batch)
        except BaseException:
            # cancelled, or an error the store did not type: the append may have landed
            self._drop_write()
            self._unknown = f"{len(batch)} event(s) from seq {batch[0].seq}, flush"
            raise
        self._flushed_ok(len(batch))

    def _over_bytes(self, action: str, event: ev.Event, size: int) -> None:
        """``event`` would take the run past the room for ordinary commands: only the
        settling commands (keeping room for an abandon) and abandon itself may use the
        reserve, and nothing may take `to_json(key=...)` over ``max_bytes``."""
        trigger = event.TRIGGER
        if trigger == "abandon":
            limit = self._max_bytes - codec.CHAIN_BYTES
        elif trigger in SETTLING_TRIGGERS:
            limit = self._max_bytes - _byte_reserves(self._max_events)[1]
        else:
            limit = self._room
        if size > limit:
            self._refuse(SchemaError, action,
                         f"recording it would take the run's JSON to {size} bytes, past "
                         f"its room under max_bytes={self._max_bytes} (room is kept for "
                         "settling and abandoning the run)")

    def _logged(self, event: ev.Event, before: Step | None) -> None:
        if not switch.enabled:
            return
        if self._log is None:
            self._log = run_logger(self._state.run_id)
        self._log.info(type(event).__name__, seq=event.seq,
                       **{"from": before.value if before else None,
                          "to": self._state.step.value})

    @property
    def _seq(self) -> int:
        return self._base + len(self._events)

    # ----------------------------------------------------------------- the model

    def begin_model_call(self) -> None:
        """RUN_AGAIN or HANDOFF → AWAITING_MODEL. Refused naming ``max_turns`` when no
        turn is left, and while a result is unpublished."""
        self._gate("begin_model_call", "begin_model_call")
        self._record("begin_model_call", ev.ModelCallBegun(self._base + len(self._events)))

    def model_failed(self, error: BaseException | type[BaseException]) -> None:
        """AWAITING_MODEL → RUN_AGAIN; records the error's type name only."""
        self._gate("model_failed", "model_failed")
        self._record("model_failed", ev.ModelFailed(self._seq, _error_name(error)))

    def model_responded(self, tool_calls: Sequence[ToolCall] = (), output: JSON = None) -> None:
        """AWAITING_MODEL → INTERRUPTION (a call needs approval), TOOLS (calls, none
        needing approval) or FINALIZING (an output and no calls)."""
        action = "model_responded"
        self._gate(action, action)
        calls = self._tool_calls(action, tool_calls)
        detached = self._detach(action, "output", output)
        self._record(action, ev.ModelResponded(self._seq, calls, detached))
        ledger = self._state.calls
        for call in calls:  # a live run fingerprints now, so decisions stay cheap
            ledger[call.call_id].digest()

    def _tool_calls(self, action: str, tool_calls: Any) -> tuple[ToolCall, ...]:
        if not isinstance(tool_calls, list | tuple):
            self._refuse(SchemaError, action, "tool_calls must be a list of ToolCall")
        return tuple(self._tool_call(action, call) for call in tool_calls)

    def _tool_call(self, action: str, call: Any) -> ToolCall:
        if type(call) is not ToolCall:
            self._refuse(SchemaError, action, "tool_calls must hold ToolCall values")
        self._text(action, "call_id", call.call_id)
        self._text(action, "tool name", call.name)
        if type(call.needs_approval) is not bool or type(call.idempotent) is not bool:
            self._refuse(SchemaError, action, "needs_approval and idempotent must be bool")
        arguments = self._detach(action, f"arguments of call {excerpt(call.call_id)}",
                                 call.arguments)
        return ToolCall(call.call_id, call.name, arguments, call.needs_approval,
                        call.idempotent)

    def add_input(self, items: list[JSON]) -> None:
        """New input in RUN_AGAIN or INTERRUPTION."""
        self._gate("add_input", "add_input")
        if type(items) is not list:
            self._refuse(SchemaError, "add_input", "items must be a list")
        detached = tuple(self._detach("add_input", "an input item", item) for item in items)
        self._record("add_input", ev.InputAdded(self._seq, detached))

    # ------------------------------------------------------------------ decisions

    def _decision_fingerprint(self, action: str, call_id: str, fingerprint: str | None) -> str:
        if not (type(call_id) is str and call_id.isascii() and len(call_id) <= MAX_TEXT):
            self._text(action, "call_id", call_id)
        if fingerprint is not None:
            if not (type(fingerprint) is str and fingerprint.isascii()
                    and len(fingerprint) <= MAX_TEXT):
                self._text(action, "fingerprint", fingerprint, optional=True)
            return fingerprint
        record = self._state.calls.get(call_id)
        return record.fingerprint if record is not None else ""

    def approve(self, call_id: str, *, fingerprint: str | None = None) -> None:
        """Approve a call awaiting a decision (INTERRUPTION only). With ``fingerprint``,
        the approval binds to those exact arguments; a mismatch is refused."""
        self._gate("approve", "approve")
        bound = self._decision_fingerprint("approve", call_id, fingerprint)
        self._record("approve", ev.CallApproved(self._base + len(self._events), call_id, bound))

    def reject(self, call_id: str, message: JSON = None, *,
               fingerprint: str | None = None) -> None:
        """Reject a call awaiting a decision; ``message`` is its rejection output, which the
        next batch publishes like a tool output. The call never runs."""
        self._gate("reject", "reject")
        bound = self._decision_fingerprint("reject", call_id, fingerprint)
        detached = self._detach("reject", "message", message)
        self._record("reject", ev.CallRejected(self._seq, call_id, bound, detached))

    def claim(self, owner: str | None = None) -> None:
        """The first command of every attempt on an existing run: records `RunClaimed`
        before any guardrail, hook, model call or tool (DESIGN §6.3).

        Accepted in every live step, ``UNSETTLED`` included (it changes no envelope).
        With a store bound it is appended with the expected version, so of two attempts
        that loaded the same version exactly one records its claim and the other gets
        `ConcurrencyConflict` with nothing changed; an attempt whose claim another claim
        superseded is refused (`ConcurrencyConflict`) on its next append. `RunNotResumable`
        for a completed or terminal run and for an unsettled fail-closed one; `SchemaError`
        unless ``owner`` is a str (valid Unicode) or None. It needs ordinary room under
        ``max_events``: claims never use the events reserved for settling a run."""
        action = "claim"
        self._gate(action, action)
        self._text(action, "owner", owner, optional=True)  # str (valid Unicode) or None
        self._record(action, ev.RunClaimed(self._seq, owner))

    def resume(self) -> Action:
        """The gate of every resumed attempt; returns `next_action`.

        `RunNotResumable` for a completed or terminal run, and for an unsettled one under
        FAIL_CLOSED; an unsettled RECONCILE run returns at once (reconcile next);
        `ToolInDoubt` while a non-idempotent call is in doubt; INTERRUPTION with an
        approved, unstarted call enters TOOLS; anything else is a no-op."""
        s = self._state
        if s.step is _UNSETTLED and s.envelope is not None and not s.envelope.fail_closed:
            return self.next_action()
        self._gate("resume", "resume")
        doubtful = self.in_doubt()
        if doubtful:
            self._refuse_in_doubt("resume", doubtful[0])
        if s.step is Step.INTERRUPTION and s.counts[Phase.APPROVED]:
            self._record("resume", ev.Resumed(self._seq))
        return self.next_action()

    def _refuse_in_doubt(self, action: str, call_id: str) -> NoReturn:
        raise ToolInDoubt(
            f"call {excerpt(call_id)} was started and never completed; it is not re-run (I11). "
            "Record its outcome with resolve_in_doubt, or abandon the run",
            call_id=call_id, run_id=self._state.run_id, step=self._state.step, action=action)

    # --------------------------------------------------------------------- tools

    def begin_tool(self, call_id: str) -> Execute | Resend:
        """`Execute` the first time (the start is recorded before the tool runs);
        `Resend` with the cached result for a completed, unpublished call (records
        nothing); `ToolInDoubt` for a started, non-idempotent call this controller does
        not hold in flight; `InvalidTransition` otherwise (published, rejected, not yet
        approved, or already running here)."""
        self._gate("begin_tool", "begin_tool")
        self._text("begin_tool", "call_id", call_id)
        record = self._state.calls.get(call_id)
        if record is not None:
            if record.phase is Phase.COMPLETED:
                return Resend(call_id, copy_plain(record.result))
            if record.phase is Phase.STARTED:
                if call_id in self._in_flight:
                    self._refuse(InvalidTransition, "begin_tool",
                                 f"call {excerpt(call_id)} is already running in this controller")
                if not record.call.idempotent:
                    self._refuse_in_doubt("begin_tool", call_id)
        # the copy handed out is made before anything is recorded
        handed = None if record is None else _copy_call(record.call)
        self._record("begin_tool", ev.ToolStarted(self._seq, call_id))
        self._in_flight[call_id] = None
        assert handed is not None  # a call unknown to the ledger was refused above
        return Execute(call_id, handed)

    def tool_completed(self, call_id: str, output: JSON) -> None:
        """Cache the result of a call this controller started (I12)."""
        self._gate("tool_completed", "tool_completed")
        self._text("tool_completed", "call_id", call_id)
        detached = self._detach("tool_completed", "output", output)
        if call_id not in self._in_flight:
            self._refuse(InvalidTransition, "tool_completed",
                         f"call {excerpt(call_id)} is not in flight in this controller (a call "
                         "started elsewhere leaves doubt only through resolve_in_doubt)")
        self._record("tool_completed", ev.ToolCompleted(self._seq, call_id, detached))
        self._in_flight.pop(call_id, None)

    def tool_interrupted(self, call_id: str) -> None:
        """A tool this controller started ended without a result (its task was cancelled,
        timed out, or raised a `BaseException`). Records nothing: the call stays STARTED
        and is no longer held in flight, so this controller now answers as a reloaded one
        (`ToolInDoubt`, or `Execute` again for an idempotent call). `InvalidTransition`
        for a call this controller does not hold in flight."""
        action = "tool_interrupted"
        self._gate(action, action)
        self._text(action, "call_id", call_id)
        if call_id not in self._in_flight:
            self._refuse(InvalidTransition, action,
                         f"call {excerpt(call_id)} is not in flight in this controller")
        self._in_flight.pop(call_id, None)

    def resolve_in_doubt(self, call_id: str, output: JSON) -> None:
        """The operator records the outcome of an in-doubt call; its result is then
        published like any other."""
        self._gate("resolve_in_doubt", "resolve_in_doubt")
        self._text("resolve_in_doubt", "call_id", call_id)
        detached = self._detach("resolve_in_doubt", "output", output)
        if call_id in self._in_flight:
            self._refuse(InvalidTransition, "resolve_in_doubt",
                         f"call {excerpt(call_id)} is in flight in this controller; report "
                         "tool_completed")
        self._record("resolve_in_doubt", ev.InDoubtResolved(self._seq, call_id, detached))

    # ------------------------------------------------------- guardrails and hooks

    def guardrail_evaluated(self, name: str, result: JSON, *, stage: str,
                            call_id: str | None = None) -> None:
        """Record a completed guardrail: tool stages once per (name, stage, call), the
        input/output stages once per (name, stage, activation) (I1)."""
        action = "guardrail_evaluated"
        self._gate(action, action)
        # the common case (short ASCII text) passes here; anything else goes to `_text`,
        # which decides with the exact message (an ASCII str is valid Unicode)
        if not (type(name) is str and name.isascii() and len(name) <= MAX_TEXT):
            self._text(action, "name", name)
        if not (type(stage) is str and stage.isascii() and len(stage) <= MAX_TEXT):
            self._text(action, "stage", stage)
        if call_id is not None and not (type(call_id) is str and call_id.isascii()
                                        and len(call_id) <= MAX_TEXT):
            self._text(action, "call_id", call_id, optional=True)
        detached = self._detach(action, "guardrail result", result)
        self._record(action, ev.GuardrailEvaluated(
            self._base + len(self._events), GuardrailResult(name, stage, call_id, detached)))

    def hook_ran(self, hook: str, *, call_id: str | None = None) -> None:
        """Record a lifecycle hook: tool hooks once per call, model hooks once per model
        call (record them after ``begin_model_call``), agent hooks once per activation."""
        self._gate("hook_ran", "hook_ran")
        if not (type(hook) is str and hook.isascii() and len(hook) <= MAX_TEXT):
            self._text("hook_ran", "hook", hook)  # (the exact message; see guardrail_evaluated)
        if call_id is not None and not (type(call_id) is str and call_id.isascii()
                                        and len(call_id) <= MAX_TEXT):
            self._text("hook_ran", "call_id", call_id, optional=True)
        self._record("hook_ran", ev.HookRan(self._base + len(self._events), hook, call_id))

    # ---------------------------------------------------- final output, handoff

    def accept_final_output(self, output: JSON, *, lossless: bool = True) -> None:
        """FINALIZING or TOOLS → FINAL_OUTPUT. Unstarted and undecided calls are skipped.
        ``lossless=False`` marks an output that cannot be rebuilt: its publication fails
        closed whatever the policy."""
        action = "accept_final_output"
        self._gate(action, action)
        detached = self._detach(action, "output", output)
        if type(lossless) is not bool:
            self._refuse(SchemaError, action, "lossless must be a bool")
        self._record(action, ev.FinalOutputAccepted(self._seq, detached, lossless))

    def complete(self) -> None:
        """FINAL_OUTPUT → COMPLETED, for a run without a Session with nothing unpublished."""
        self._gate("complete", "complete")
        self._record("complete", ev.RunCompleted(self._seq))

    def handoff(self, target: str) -> None:
        """RUN_AGAIN or INTERRUPTION → HANDOFF: a new activation; every call not yet
        started is skipped, and the next batch must publish every unpublished result."""
        self._gate("handoff", "handoff")
        self._text("handoff", "target", target)
        self._record("handoff", ev.HandedOff(self._seq, target))

    def abandon(self, reason: str) -> None:
        """Any live step → TERMINAL_UNRECOVERABLE, for good."""
        self._gate("abandon", "abandon")
        self._text("abandon", "reason", reason)
        self._record("abandon", ev.Abandoned(self._seq, reason))
        self._in_flight.clear()
        self._attempt = None

    # -------------------------------------------------- per-call publications

    def receive_tool_calls(self, tool_calls: Sequence[ToolCall]) -> None:
        """Calls a remote agent loop asks this client to run (RUN_AGAIN or TOOLS →
        TOOLS). They need no approval here; their ids must be new to the run."""
        action = "receive_tool_calls"
        self._gate(action, action)
        calls = self._tool_calls(action, tool_calls)
        self._record(action, ev.ToolCallsReceived(self._seq, calls))

    def result_posted(self, call_id: str) -> None:
        """The call's cached result is now in the remote history: it is published, and
        ``begin_tool`` will neither re-send nor re-run it."""
        self._gate("result_posted", "result_posted")
        self._text("result_posted", "call_id", call_id)
        self._record("result_posted", ev.ResultPosted(self._seq, call_id))

    def result_post_failed(self, call_id: str, error: BaseException | type[BaseException]
                           ) -> None:
        """A post of the call's result ended without landing (the type name is recorded;
        re-raise or report the error yourself). The result stays cached for a re-post."""
        self._gate("result_post_failed", "result_post_failed")
        self._text("result_post_failed", "call_id", call_id)
        self._record("result_post_failed",
                     ev.ResultPostFailed(self._seq, call_id, _error_name(error)))

    # --------------------------------------------------------------- publication

    def stage_publication(self, items: list[JSON], history: Sequence[JSON], *,
                          call_ids: Sequence[str] | None = None, whole: bool = False) -> None:
        """Arm the envelope before writing ``items`` to the Session, and open an attempt.

        ``history`` is the Session's last L >= len(items) + 1 items (a shorter list is the
        whole Session), or all of it with ``whole=True``. ``call_ids`` names the calls
        whose results the batch publishes. Refused (`InvalidTransition`) for an empty
        batch, while a call is started, when ``call_ids`` does not name exactly the calls
        with unpublished results that the items name, and when ``history`` cannot tell
        the write's outcomes apart (the message says how many items to read)."""
        action = "stage_publication"
        s = self._state
        self._gate(action, action)
        if type(items) is not list:
            self._refuse(SchemaError, action, "items must be a list")
        if not isinstance(history, list | tuple):
            self._refuse(SchemaError, action, "history must be a list")
        if type(whole) is not bool:
            self._refuse(SchemaError, action, "whole must be a bool")
        listed: tuple[str, ...] = ()
        if call_ids is not None:
            if not isinstance(call_ids, list | tuple) or any(type(c) is not str
                                                             for c in call_ids):
                self._refuse(SchemaError, action, "call_ids must be a list of str")
            listed = tuple(call_ids)
        batch = tuple(self._detach(action, "a batch item", item) for item in items)
        try:
            batch_digests = digests(batch, s.form)
            frontier = measure_frontier(history, batch_digests, s.form,
                                        whole=whole or len(history) < len(batch) + 1)
        except (TypeError, ValueError, RecursionError) as exc:
            self._refuse(SchemaError, action,
                         f"an item has no canonical form ({type(exc).__name__})")
        if frontier is None:
            self._refuse(
                InvalidTransition, action,
                f"the {len(history)} history items given cannot tell the write's outcomes "
                f"apart; read at least {len(history) + 1} items, or pass the whole Session "
                "with whole=True")
        event = ev.PublicationStaged(
            self._seq, s.session_id, batch, listed, frontier.read_limit, frontier.digests,
            frontier.whole, batch_digests, s.continuation_after(listed))
        self._record(action, event)
        self._attempt = event.seq

    def _own_attempt(self, action: str) -> None:
        if not self.holds_attempt:
            self._refuse(InvalidTransition, action,
                         "no publication attempt is open in this controller")

    def publication_committed(self, *, session_write: SessionWrite | None = None) -> None:
        """The write this controller attempted succeeded: settle the envelope, publish
        its guardrail results and enter the continuation.

        With ``session_write`` the write has not happened yet: the store writes the
        batch's items together with this commit event, in one transaction (DESIGN §6.7),
        so they land together or not at all. It must hold exactly the staged batch, for
        the run's Session, under the attempt's publication id (``f"{run_id}:{seq}"``, the
        seq of the event that opened the attempt: its `PublicationStaged`, or the
        `ReconciledAppend`), and the store's ``append`` must take ``session_write=`` (the
        PostgreSQL stores); otherwise `InvalidTransition` (`SchemaError` for a value that
        is not a `SessionWrite` of plain JSON), nothing recorded or written.

        A sync store appends at once, in either durability (events the run buffered go in
        the same transaction). With an async store, ``await flush_async()`` right after:
        the items are the effect, so they cannot wait (every command that records is
        refused until then). The event is applied only once the append landed: if it
        raises, nothing of the items was written either, the controller is as it was and
        its attempt stays open — report ``publication_failed`` after an `Outcome.NOT_WRITTEN`
        `StorageError`; after a `ConcurrencyConflict` or an unknown outcome load the run
        again (the log shows whether the pair landed)."""
        action = "publication_committed"
        self._gate(action, action)
        self._own_attempt(action)
        if session_write is not None:
            self._commit_with(action, self._session_write(action, session_write))
            return
        self._record(action, ev.PublicationCommitted(self._seq))
        self._attempt = None

    def _session_write(self, action: str, write: SessionWrite) -> SessionWrite:
        """``write`` checked against the attempt this controller holds, its items detached
        (the copy the store gets)."""
        s = self._state
        if type(write) is not SessionWrite:
            self._refuse(SchemaError, action, "session_write must be a SessionWrite")
        store = self._store
        if store is None or not takes_session_write(store):
            self._refuse(InvalidTransition, action,
                         "this run's store cannot write a Session's items with its events "
                         "(its append takes no session_write=): write the items to the "
                         "Session, then call publication_committed()")
        if write.session_id != s.session_id:
            self._refuse(InvalidTransition, action,
                         f"session_write is for Session {excerpt(str(write.session_id))}, "
                         "not the run's Session")
        if write.publication_id != f"{s.run_id}:{s.attempt_seq}":
            self._refuse(InvalidTransition, action,
                         "session_write's publication_id is not the open attempt's "
                         f"(run_id:seq, seq {s.attempt_seq})")
        if type(write.items) is not tuple:
            self._refuse(SchemaError, action, "session_write's items must be a tuple")
        items = tuple(self._detach(action, "a batch item", item) for item in write.items)
        envelope = s.envelope
        assert envelope is not None  # an attempt is open, so the run is unsettled
        try:
            same = digests(items, s.form) == envelope.batch_digests
        except (TypeError, ValueError, RecursionError):
            same = False
        if not same:
            self._refuse(InvalidTransition, action,
                         "session_write's items are not the staged batch")
        return SessionWrite(write.session_id, write.publication_id, items)

    def publication_failed(self, error: BaseException | type[BaseException]) -> None:
        """The write has *ended* without committing (it can no longer land). Under
        RECONCILE the run stays unsettled for `reconcile`; fail-closed envelopes enter
        TERMINAL_UNRECOVERABLE. Records the error's type name only and never raises
        ``error``: re-raise it yourself (I6). Do not report a write that was cancelled or
        timed out and may still land: its attempt stays open."""
        self._gate("publication_failed", "publication_failed")
        self._own_attempt("publication_failed")
        self._record("publication_failed", ev.PublicationFailed(self._seq, _error_name(error)))
        self._attempt = None

    def reconcile(self, history: Sequence[JSON], session_id: str | None, *,
                  take_over: bool = False) -> Append | Acknowledge:
        """Settle an unsettled envelope against the Session's tail (only the last
        ``envelope.read_limit`` items of ``history`` are read).

        `Acknowledge` when the batch is already there (settled now); `Append` when the
        Session is at the pre-write frontier (write the items, then
        ``publication_committed``). `ReconcileRejected` — nothing recorded, envelope kept
        — for another session, a partial write, a changed history, or an attempt that may
        still be writing (unless ``take_over=True``: its writer is gone and no request of
        it can still land)."""
        action = "reconcile"
        s = self._state
        self._gate(action, "reconcile_append")
        if not isinstance(history, list | tuple):
            self._refuse(SchemaError, action, "history must be a list")
        self._text(action, "session_id", session_id, optional=True)
        if type(take_over) is not bool:
            self._refuse(SchemaError, action, "take_over must be a bool")
        envelope = s.envelope
        if envelope is None:
            self._refuse(InvalidTransition, action, "no publication envelope to reconcile")
        try:
            finding = classify(envelope, history, session_id, s.form)
        except (TypeError, ValueError, RecursionError) as exc:
            self._refuse(SchemaError, action,
                         f"a history item has no canonical form ({type(exc).__name__})")
        if finding.kind is FindingKind.ACKNOWLEDGE:
            self._record(action, ev.ReconciledAcknowledge(self._seq, take_over))
            self._attempt = None
            return Acknowledge()
        if finding.kind is FindingKind.APPEND:
            if s.attempt_seq is not None and not take_over:
                self._refuse(
                    ReconcileRejected, action,
                    "the Session is at the pre-write frontier but an attempt may still be "
                    "writing; reconcile again once it has ended, or pass take_over=True if "
                    "no write of this batch can still land. The completed tool must not be "
                    "re-run")
            items = tuple(copy_plain(item) for item in envelope.items)
            event = ev.ReconciledAppend(self._seq, take_over)
            self._record(action, event)
            self._attempt = event.seq
            return Append(items)
        self._refuse(ReconcileRejected, action,
                     f"{finding.explain(envelope)}. The envelope is kept; the completed tool "
                     "must not be re-run")
        return None


_EVENT_SIZE = codec.EVENT_SIZE
SNAPSHOT_SIZE = "log_bytes"
"""The key under which a snapshot handed to a store records the size of the log before it
(so a load from the snapshot knows `RunController.size` without reading that log)."""


@functools.lru_cache(maxsize=16)
def _byte_reserves(max_events: int) -> tuple[int, int]:
    """(room kept for fail, reconcile, commit and abandon; room kept for abandon), each
    with the keyed chain's bytes: the largest such events (a seq as long as
    ``max_events``, texts of `RESERVED_TEXT` bytes), and the comma before each."""
    seq, text = max_events, "x" * RESERVED_TEXT
    abandon = codec.event_size(ev.Abandoned(seq, text)) + 1
    reconcile = max(codec.event_size(ev.ReconciledAcknowledge(seq, False)),
                    codec.event_size(ev.ReconciledAppend(seq, False)))
    settle = (codec.event_size(ev.PublicationFailed(seq, text)) + reconcile
              + codec.event_size(ev.PublicationCommitted(seq)) + 3)
    return codec.CHAIN_BYTES + settle + abandon, codec.CHAIN_BYTES + abandon


def _check_limit(name: str, value: object, action: str) -> None:
    if type(value) is not int or value < 1:
        raise SchemaError(f"{name} must be an int >= 1", action=action)


def _started_size(started: ev.RunStarted, max_events: int, max_bytes: int,
                  where: dict[str, Any]) -> int:
    """The size of a run's first document; `SchemaError` unless ``max_bytes`` leaves the
    reserved room beside it."""
    if type(max_bytes) is not int or max_bytes < 1:
        raise SchemaError("max_bytes must be an int >= 1", **where)
    size = codec.envelope_size(started.run_id) + codec.event_size(started)
    needed = size + _byte_reserves(max_events)[0]
    if needed > max_bytes:
        raise SchemaError(f"max_bytes={max_bytes} is too small: this run needs at least "
                          f"{needed} (its first event and the room reserved for settling "
                          "and abandoning it)", **where)
    return size


def _snapshot_size(store: EventStore, run_id: str, stored: Mapping[str, Any] | None,
                   base: int, tail: Sequence[ev.Event]) -> int:
    """`RunController.size` of a run loaded from a snapshot: the size it recorded for the
    log before it, plus the tail's events. A snapshot without one (an older library's)
    costs one read of the log before it."""
    before = None if stored is None else stored.get(SNAPSHOT_SIZE)
    if type(before) is not int or before < 1:
        before = codec.log_size(run_id, store.load(run_id)[:base])
    measured = codec.measured_size(tail)
    if measured is not None:
        return before + (measured + 1 if tail else 0)
    return before + sum(_EVENT_SIZE[type(event)](event) + 1 for event in tail)


def _measured_size(run_id: str, events: Sequence[ev.Event]) -> int | None:
    """`RunController.size` of a whole log a store decoded and measured
    (`codec.SizedEvents`); None when it did not: the controller sizes each event."""
    measured = codec.measured_size(events)
    return None if measured is None else codec.envelope_size(run_id) + measured


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
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


def _placed(error: StorageError, *, run_id: str | None, step: Any, action: str) -> None:
    """Make ``error`` (a store's) say which run, step and command it refused."""
    error.run_id, error.step, error.action = run_id, step, action
    error.args = (error._message(),)


def _storage_error(error: BaseException, outcome: Outcome, **where: Any) -> StorageError:
    """A `StorageError` for a `sqlite3.Error` or `OSError` a store let through untyped
    (`Outcome.UNKNOWN` for an append: the store did not say whether it landed)."""
    return StorageError(f"the store raised {type(error).__name__}: {error}", outcome=outcome,
                        **where)


class _SyncBridge:
    """An async store seen from a worker thread as a sync one (for `load_async`): each
    call runs the store's coroutine on the loop and waits for it. Never used on the
    loop's own thread."""

    def __init__(self, store: Any, loop: asyncio.AbstractEventLoop) -> None:
        self._store = store
        self._loop = loop

    def _wait(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def append(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("loading never appends")

    def load(self, run_id: str) -> list[ev.Event]:
        return self._wait(self._store.load(run_id))  # type: ignore[no-any-return]

    def load_latest(self, run_id: str) -> tuple[Any, list[ev.Event]]:
        return self._wait(self._store.load_latest(run_id))  # type: ignore[no-any-return]


@attrs.frozen
class _PendingWrite:
    """A commit event checked by `publication_committed(session_write=)` and the Session
    write it carries, until the append that writes both lands."""

    action: str
    event: ev.Event
    dest: Step
    size: int
    write: SessionWrite


def _is_async(store: object) -> bool:
    """Whether ``store`` appends with a coroutine (an `AsyncEventStore`)."""
    return bool(inspect.iscoroutinefunction(getattr(store, "append", None)))


def _copy_call(call: ToolCall) -> ToolCall:
    return ToolCall(call.call_id, call.name, copy_plain(call.arguments), call.needs_approval,
                    call.idempotent)


def _error_name(error: Any) -> str:
    """The error's type name as recorded: cut to 128 characters and made valid Unicode,
    so an absurd class name can neither break the log nor eat the settling reserve."""
    name = error.__name__ if isinstance(error, type) else type(error).__name__
    name = name[:128]
    return name if text_problem(name) is None else "<unprintable error type>"
