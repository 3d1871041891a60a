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
5. the journal (`journal.Journal`), when a store is bound: the event is appended with the
   expected version (or buffered until the next flush), so a `ConcurrencyConflict`
   leaves this controller unchanged;
6. the fold: the event is applied (`RunState.apply`) and kept in the log.

The journal keeps the log, its store, its room under the limits and the state in which
the run must be loaded again; the controller keeps the doors (`start`, `load`,
`load_async`, `from_json`), the reads, the gate, validation and the commands, and two
things the log does not know and that are never serialized: the publication attempt it
holds (stage or an ``Append`` decision, until commit or fail) and the calls it has in
flight (started here, not yet completed).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import TYPE_CHECKING, Any, NoReturn

import attrs

from statemachine import codec, telemetry
from statemachine import events as ev
from statemachine.blocker import Blocker, Waiting, read_model
from statemachine.envelope import Envelope, FindingKind, classify, measure_frontier
from statemachine.errors import (
    ControlError,
    InvalidTransition,
    PublicationUnsettled,
    ReconcileRejected,
    RunNotFound,
    RunNotResumable,
    SchemaError,
    ToolInDoubt,
    excerpt,
)
from statemachine.journal import (
    RESERVED_EVENTS,
    RESERVED_TEXT,
    SNAPSHOT_SIZE,
    Journal,
    Limits,
    PendingCommit,
    gc_paused,
    is_async,
    limits_of,
)
from statemachine.machine import NEUTRAL_TRIGGERS, SETTLING_TRIGGERS, Refused, destination, replay
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
    many_session_writes,
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
    Resolution,
    Step,
    ToolCall,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from statemachine.stores import EventStore

__all__ = ["MAX_LEASE", "RESERVED_EVENTS", "RESERVED_TEXT", "SNAPSHOT_SIZE", "RunController",
           "wall_clock"]
"""The reserves and the snapshot's size key live in `journal`; code that imports them
from here still can."""

_UNSETTLED = Step.UNSETTLED
_WORKING = frozenset(WORKING_STEPS)
_MAX_AT = ev.MAX_AT
MAX_LEASE = 1_000_000_000
"""The longest lease a claim takes, in seconds (about 31 years): a store adds it to its
clock's microseconds, and the sum must stay far inside a signed 64-bit column."""


def wall_clock() -> int:
    """The default clock: microseconds since the Unix epoch (UTC), by the system's wall
    clock."""
    return time.time_ns() // 1000


TOO_SHORT = "cannot tell the write's outcomes apart"
"""What `RunController.stage_publication`'s refusal of too short a history says (a runner
reads more of the Session on it, and on no other refusal)."""


class RunController:
    """The control core of one run. Create with `start`, `load` or `from_json`."""

    __slots__ = ("_attempt", "_clock", "_in_flight", "_journal", "_spans", "_state")

    def __init__(self, journal: Journal, clock: Callable[[], int] | None = None) -> None:
        self._journal = journal
        self._state = journal.state
        self._clock = wall_clock if clock is None else clock
        """Read once per event recorded here (its ``at``), never by replay."""
        self._attempt: int | None = None
        self._in_flight: dict[str, None] = {}  # a set, in the 64 bytes of an empty dict
        self._spans: telemetry.Spans | None = None  # its open spans, once telemetry is on

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
        clock: Callable[[], int] | None = None,
    ) -> RunController:
        """Start a run. ``session_id=None`` is a run without a Session; ``canonical``
        names a registered canonical form (`register_canonical`). With a ``store`` the
        first event is appended at version 0 (`ConcurrencyConflict` if the run exists).

        ``buffered=True`` (always so with an async store): events are appended only by
        `flush` / `flush_async`, one transaction per effect boundary, and a run id the
        store already holds is refused at the first flush.

        ``max_bytes`` bounds the size of `to_json()` (the UTF-8 length of its compact JSON
        text, the keyed chain included): a command that would take the run over it is
        refused before recording, leaving room for settling and closing the run.

        ``clock`` is how the run tells time: a callable returning the microseconds since
        the Unix epoch (UTC) as an int, 0 <= value < 2**63, read once for each event
        recorded (its ``at``; `wall_clock` when None). A clock that returns anything
        else refuses the command (`SchemaError`), recording nothing."""
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
        _check_limit("max_depth", max_depth, where)
        _check_limit("max_events", max_events, where)
        if max_events <= RESERVED_EVENTS + 1:
            raise SchemaError(f"max_events must exceed {RESERVED_EVENTS + 1}", **where)
        canonical_form(canonical)  # SchemaError when unknown
        _check_limit("max_bytes", max_bytes, where)
        clock = _check_clock(clock, where)
        started = ev.RunStarted(0, run_id, session_id, policy, max_turns, canonical,
                                at=_read_clock(clock, where))
        journal = Journal.start(started, store=store, buffered=buffered,
                                limits=_limits(max_depth, max_events, max_bytes))
        controller = cls(journal, clock)
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
        clock: Callable[[], int] | None = None,
    ) -> RunController:
        """Rebuild a run from `to_json` output (dict or text), replaying the whole log.

        `SchemaError` for a malformed document, and for one over ``max_bytes``: the UTF-8
        length of its compact JSON text, the same for a dict and its compact text (a text
        longer than that, with spaces or ASCII escapes, is measured as given and refused
        before it is parsed). With ``key``, `SchemaError` unless the document carries a
        keyed chain (`to_json(key=...)`) that verifies under that key, checked before any
        state is built; without one a chain is not checked. `InvalidTransition` naming the
        sequence number of the first event the machine forbids. The controller holds no
        attempt and no call in flight. ``clock`` as for `start`: it times the events this
        controller records; the log's own keep the ``at`` they were recorded with."""
        _check_limit("max_bytes", max_bytes, {"action": "load"})
        clock = _check_clock(clock, {"action": "load"})
        with gc_paused():
            decoded = codec.decode_log(data, max_depth=max_depth, max_events=max_events,
                                       max_bytes=max_bytes, key=key)
            state = replay(decoded.run_id, decoded.events)
            return cls(Journal(state, decoded.events, store=None, size=decoded.size,
                               limits=_limits(max_depth, max_events, max_bytes)), clock)

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
        clock: Callable[[], int] | None = None,
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
        a command's append had an unknown outcome. ``max_bytes`` and ``clock`` as for
        `start`: a log whose `to_json()` is over ``max_bytes`` is `SchemaError`; loading
        never reads the clock."""
        _check_limit("max_bytes", max_bytes, {"action": "load"})
        clock = _check_clock(clock, {"run_id": run_id, "action": "load"})
        return cls(Journal.load(store, run_id, snapshot=snapshot, buffered=buffered,
                                limits=_limits(max_depth, max_events, max_bytes)), clock)

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
        clock: Callable[[], int] | None = None,
    ) -> RunController:
        """`load` without blocking the event loop: decoding and replay run on a worker
        thread, which awaits the store's coroutines on this loop. A controller bound to
        an async store buffers its events (flush with `flush_async`).

        A `MemoryEventStore` is loaded on the loop itself: it does no I/O and decodes
        nothing, and it keeps snapshots, so its load replays a bounded tail; the hop to
        a worker thread costs more than that. A sync store that counts a run's events
        (``version``) is asked on the loop first: a run it does not hold is
        `RunNotFound` without the hop."""
        if type(store) is MemoryEventStore:
            return cls.load(store, run_id, max_depth=max_depth, max_events=max_events,
                            max_bytes=max_bytes, snapshot=snapshot, buffered=buffered,
                            clock=clock)
        if not is_async(store):
            _check_limit("max_bytes", max_bytes, {"action": "load"})
            _check_clock(clock, {"run_id": run_id, "action": "load"})
            if Journal.holds_none(store, run_id):  # type: ignore[arg-type]
                # a run that is not there (a new run's open) costs one indexed read on
                # the loop, not a worker thread (made, and shut down, per event loop)
                raise RunNotFound("no such run in the store", run_id=run_id,
                                  action="load")
            return await asyncio.to_thread(
                cls.load, store, run_id,  # type: ignore[arg-type]
                max_depth=max_depth, max_events=max_events,
                max_bytes=max_bytes, snapshot=snapshot, buffered=buffered, clock=clock)
        _check_limit("max_bytes", max_bytes, {"action": "load"})
        clock = _check_clock(clock, {"run_id": run_id, "action": "load"})
        return cls(await Journal.load_async(
            store, run_id, snapshot=snapshot,  # type: ignore[arg-type]
            limits=_limits(max_depth, max_events, max_bytes)), clock)

    def to_json(self, key: bytes | None = None) -> dict[str, JSON]:
        """The run as a plain JSON tree of the current ``schema_version``.

        With ``key`` (non-empty bytes) the document also carries ``"chain"``: the
        HMAC-SHA256 chain over its events (`codec.chain_tag`), so that
        ``from_json(..., key=key)`` refuses a document whose events were edited, removed
        or reordered. Without a key, replay rejects only an illegal or malformed log: an
        edited payload that keeps the log legal loads."""
        return codec.encode_log(self._state.run_id, self._journal.whole(), key=key)

    @property
    def size(self) -> int:
        """The size of `to_json()`: the UTF-8 length of its compact JSON text
        (``json.dumps(doc, separators=(",", ":"), ensure_ascii=False)``), without a
        keyed chain (which adds `sizes.CHAIN_BYTES`). ``max_bytes`` bounds it. O(1)."""
        return self._journal.size

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
        return self._journal.store

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
        return tuple(ev.copied(event) for event in self._journal.whole())

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

    @property
    def blocker(self) -> Blocker | None:
        """What keeps this run from going on by itself, as a reader holding no attempt sees
        it (`Blocker`: a call in doubt, an unsettled publication, decisions to take, or
        not resumable), or None. The same fold decides `next_action`, and stores that keep
        run heads keep it there (`statemachine.operator.runs`)."""
        return read_model(self._state).blocker

    @property
    def waiting(self) -> tuple[Waiting, ...]:
        """This run's inbox entries (`Waiting`): every call awaiting a decision and every
        call in doubt, oldest first (`statemachine.operator.inbox` lists them across
        runs)."""
        return read_model(self._state).waiting

    @property
    def publication_id(self) -> str | None:
        """The open publication attempt's id, ``f"{run_id}:{seq}"`` with the seq of the
        event that opened it (its `PublicationStaged`, or the `ReconciledAppend`); None
        while no attempt is open. A Session that keeps the writer of its items (the
        PostgreSQL Session) files the batch under it."""
        seq = self._state.attempt_seq
        return None if seq is None else f"{self._state.run_id}:{seq}"

    def idempotency_key(self, call_id: str) -> str:
        """The call's idempotency key (DESIGN §7.3): 32 lowercase hex digits of
        sha256(run id, NUL, call id), the same in every process and on every start of the
        call, for a tool body to give an API that deduplicates (`tool_context`).
        `InvalidTransition` for a call the run does not know."""
        if type(call_id) is not str or call_id not in self._state.calls:
            self._refuse(InvalidTransition, "idempotency_key", "unknown call id")
        text = f"{self._state.run_id}\0{call_id}".encode("utf-8", "surrogatepass")
        return hashlib.sha256(text).hexdigest()[:32]

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
                     copy_plain(r.result), r.decisions())
            for call_id, r in self._state.calls.items())

    def call(self, call_id: str) -> CallView:
        """One call of the ledger as a copy; `InvalidTransition` for an unknown id."""
        record = self._state.calls.get(call_id) if type(call_id) is str else None
        if record is None:
            self._refuse(InvalidTransition, "call", "unknown call id")
        return CallView(_copy_call(record.call), record.phase, record.starts,
                        call_id in self._in_flight, copy_plain(record.result),
                        record.decisions())

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
        if not (s.count(Phase.APPROVED) or s.count(Phase.STARTED)):
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
        return self._journal.version

    @property
    def unflushed(self) -> int:
        """Events recorded here and not yet in the store (0 unless the run buffers)."""
        return self._journal.unflushed

    # ---------------------------------------------------------------- pipeline

    def _refuse(self, kind: type[ControlError], action: str, reason: str) -> NoReturn:
        raise kind(reason, run_id=self._state.run_id, step=self._state.step, action=action)

    def _gate(self, action: str, trigger: str) -> None:
        journal = self._journal
        if journal.stopped is not None:
            journal.refuse_stopped(action)
        s = self._state
        step = s.step
        if step in _WORKING and journal.version <= journal.limits.roomy_version:
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
        journal.check_count(action, trigger)

    def _detach(self, action: str, what: str, value: JSON) -> JSON:
        try:
            return detach(value, self._journal.limits.max_depth)
        except PayloadError as exc:
            self._refuse(SchemaError, action, f"{what} is not plain JSON: {exc}")

    def _text(self, action: str, what: str, value: Any, *, optional: bool = False) -> None:
        if (type(value) is str and value.isascii() and len(value) <= MAX_TEXT
                and "\x00" not in value):
            return  # the common case (an ASCII str is valid Unicode); the rest is decided below
        if optional and value is None:
            return
        problem = text_problem(value)
        if problem is not None:
            self._refuse(SchemaError, action,
                         f"{what} {problem}{' (or None)' if optional else ''}")

    def _record(self, action: str, event: ev.Event) -> Step:
        s = self._state
        journal = self._journal
        at = event.at
        if type(at) is not int or not 0 <= at <= _MAX_AT:
            self._refuse(SchemaError, action, _BAD_CLOCK)
        if journal.write is not None:  # a commit and its Session write wait for their append
            journal.refuse_waiting(action)
        size = journal.room_for(action, event)
        try:
            dest = destination(s, event)
        except Refused as refused:
            self._refuse(InvalidTransition, action, refused.reason())
        before = s.step
        journal.record(event, dest, size, action)
        if switch.enabled:
            self._logged(event, before)
        return dest

    def _commit_with(self, action: str, write: SessionWrite, ride: bool) -> None:
        """`_record` for a commit event that carries its Session write: checked now, then
        held by the journal for the append that writes it with the items (a sync store's
        happens here, an async one's at the next `flush_async`), and applied only once
        that append landed, so a failed append leaves this controller as it was. With
        ``ride`` on a buffered journal: recorded and applied now, like any buffered event,
        its items going with the next flush (`Journal.ride`)."""
        s = self._state
        journal = self._journal
        if ride and journal.may_ride():
            self._record(action, ev.PublicationCommitted(journal.version, at=self._clock()))
            journal.ride(write)
            self._attempt = None
            return
        if journal.riding and not many_session_writes(journal.store):
            # (this store writes one Session write per append: the riding one goes first)
            if is_async(journal.store):
                journal.refuse_waiting(action)
            self.flush()
        event = ev.PublicationCommitted(self._journal.version, at=self._clock())
        at = event.at
        if type(at) is not int or not 0 <= at <= _MAX_AT:
            self._refuse(SchemaError, action, _BAD_CLOCK)
        size = journal.room_for(action, event)
        try:
            dest = destination(s, event)
        except Refused as refused:
            self._refuse(InvalidTransition, action, refused.reason())
        self._landed(journal.hold_commit(PendingCommit(action, event, s.step, dest, size,
                                                       write)))

    def _landed(self, commit: PendingCommit | None) -> None:
        """A commit with its Session write landed (the journal applied it): this
        controller's attempt is over."""
        if commit is not None:
            self._attempt = None
            if switch.enabled:
                self._logged(commit.event, commit.source)

    @property
    def riding_items(self) -> tuple[JSON, ...]:
        """The Session items of commits recorded with ``ride=True`` that the next flush
        writes (empty once it did), copies in order: they follow what the run's Session
        holds."""
        limit = self._journal.limits.max_depth
        return tuple(detach(item, limit) for write in self._journal.riding
                     for item in write.items)

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
        self._landed(self._journal.flush())

    def _buffer_attempt(self) -> bool:
        """Buffer from now on, a controller a runner handed back between its attempts
        (`_between_attempts`), for the next attempt a runner runs with it (DESIGN §7.7).
        A controller its caller bound per event stays so. Whether it switched."""
        journal = self._journal
        if not journal.between or journal.buffered:
            return False
        journal.buffered = True  # (per event, everything recorded is flushed already)
        return True

    def _between_attempts(self) -> None:
        """Append each event as it is recorded from now on (a sync store), once nothing is
        left buffered: what a runner that buffered its attempt hands back, so a decision
        its caller takes is durable when the command returns. A no-op for an async store
        (always buffered) or while events wait for a flush."""
        journal = self._journal
        if (journal.buffered and journal.store is not None and not is_async(journal.store)
                and self.unflushed == 0):
            journal.buffered = False
            journal.between = True

    async def flush_async(self) -> None:
        """`flush` for any store: awaits an async store's append, calls a sync one."""
        self._landed(await self._journal.flush_async())

    def flush_results(self) -> None:
        """Before a wait that needs no record of its own (a model call: DESIGN §7.7):
        `flush` when what waits for the next flush records a call's result (with what
        rides along: its publication), so a crash during the wait (a model's answer takes
        the longest of a turn) leaves the call completed and its result written, not in
        doubt, and no reader (an operator's inbox) sees a call whose result this attempt
        holds as in doubt for that long; else `fence`. Either way a superseded attempt
        is refused (`ConcurrencyConflict`)."""
        if self._journal.holds_results:
            self.flush()
        else:
            self.fence()

    async def flush_results_async(self) -> None:
        """`flush_results` for any store."""
        if self._journal.holds_results:
            await self.flush_async()
        else:
            await self.fence_async()

    def fence(self) -> None:
        """Check that this attempt still holds the run, before an effect that no append
        of its own precedes (a hook, a guardrail; DESIGN §7.2): one read of how many
        events the store holds, no write and no fsync. `ConcurrencyConflict` when another
        attempt appended since this controller last flushed (it claimed the run, so this
        attempt was superseded): the effect must not run, and this controller then
        refuses everything until the run is loaded again. A no-op without a store."""
        self._journal.fence()

    async def fence_async(self) -> None:
        """`fence` for any store: awaits an async store's read, calls a sync one."""
        await self._journal.fence_async()

    def _logged(self, event: ev.Event, before: Step | None) -> None:
        s = self._state
        if switch.logging:
            run_logger(s.run_id).info(
                type(event).__name__, seq=event.seq,
                **{"from": before.value if before else None, "to": s.step.value})
        if switch.telemetry:
            call_id = getattr(event, "call_id", None)
            self._telemetry().recorded(event, before, s.step,
                                       None if call_id is None else self._tool_name(call_id))

    def _telemetry(self) -> telemetry.Spans:
        if self._spans is None:
            self._spans = telemetry.Spans(self._state.run_id)
        return self._spans

    def _tool_name(self, call_id: str) -> str:
        record = self._state.calls.get(call_id)
        return "" if record is None else record.call.name

    # ----------------------------------------------------------------- the model

    def begin_model_call(self) -> None:
        """RUN_AGAIN or HANDOFF → AWAITING_MODEL. Refused naming ``max_turns`` when no
        turn is left, and while a result is unpublished."""
        self._gate("begin_model_call", "begin_model_call")
        self._record("begin_model_call", ev.ModelCallBegun(self._journal.version, at=self._clock()))

    def model_failed(self, error: BaseException | type[BaseException]) -> None:
        """AWAITING_MODEL → RUN_AGAIN; records the error's type name only."""
        self._gate("model_failed", "model_failed")
        self._record("model_failed", ev.ModelFailed(self._journal.version, _error_name(error),
                                                    at=self._clock()))

    def model_responded(self, tool_calls: Sequence[ToolCall] = (), output: JSON = None) -> None:
        """AWAITING_MODEL → INTERRUPTION (a call needs approval), TOOLS (calls, none
        needing approval) or FINALIZING (an output and no calls)."""
        action = "model_responded"
        self._gate(action, action)
        calls = self._tool_calls(action, tool_calls)
        detached = self._detach(action, "output", output)
        self._record(action, ev.ModelResponded(self._journal.version, calls, detached,
                                               at=self._clock()))
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
        self._record("add_input", ev.InputAdded(self._journal.version, detached, at=self._clock()))

    # ------------------------------------------------------------------ decisions

    def _decision_fingerprint(self, action: str, call_id: str, fingerprint: str | None) -> str:
        self._text(action, "call_id", call_id)
        if fingerprint is not None:
            self._text(action, "fingerprint", fingerprint, optional=True)
            return fingerprint
        record = self._state.calls.get(call_id)
        return record.fingerprint if record is not None else ""

    def approve(self, call_id: str, *, fingerprint: str | None = None, by: str | None = None,
                reason: str | None = None) -> None:
        """Approve a call awaiting a decision (INTERRUPTION only). With ``fingerprint``,
        the approval binds to those exact arguments; a mismatch is refused. ``by`` (who
        decided) and ``reason`` (why) are text, recorded with the decision (`CallView`)."""
        action = "approve"
        self._gate(action, action)
        bound = self._decision_fingerprint(action, call_id, fingerprint)
        self._text(action, "by", by, optional=True)
        self._text(action, "reason", reason, optional=True)
        self._record(action, ev.CallApproved(self._journal.version, call_id, bound,
                                             at=self._clock(), by=by, reason=reason))

    def reject(self, call_id: str, message: JSON = None, *,
               fingerprint: str | None = None, by: str | None = None) -> None:
        """Reject a call awaiting a decision; ``message`` is its rejection output, which the
        next batch publishes like a tool output. The call never runs. ``by`` (who
        decided) is text, recorded with the decision."""
        action = "reject"
        self._gate(action, action)
        bound = self._decision_fingerprint(action, call_id, fingerprint)
        self._text(action, "by", by, optional=True)
        detached = self._detach(action, "message", message)
        self._record(action, ev.CallRejected(self._journal.version, call_id, bound, detached,
                                             at=self._clock(), by=by))

    def claim(self, owner: str | None = None, *, lease: float | None = None) -> None:
        """The first command of every attempt on an existing run: records `RunClaimed`
        before any guardrail, hook, model call or tool (DESIGN §6.3).

        Accepted in every live step, ``UNSETTLED`` included (it changes no envelope).
        With a store bound it is appended with the expected version, so of two attempts
        that loaded the same version exactly one records its claim and the other gets
        `ConcurrencyConflict` with nothing changed; an attempt whose claim another claim
        superseded is refused (`ConcurrencyConflict`) on its next append. `RunNotResumable`
        for a completed or terminal run and for an unsettled fail-closed one; `SchemaError`
        unless ``owner`` is a str (valid Unicode) or None. It needs ordinary room under
        ``max_events``: claims never use the events reserved for settling a run.

        ``lease`` (seconds, a positive finite number; it needs an ``owner``) holds the run
        against other owners (DESIGN §7.2): the store keeps it in the run's head, ending
        ``lease`` seconds after the claim by the store's own clock, and every later append
        of this attempt moves that end on. While it is live any claim by another owner is
        refused with `LeaseHeld` (naming the holder and the end) and records nothing; the
        same owner may claim again, and once it has ended anyone may. A claim without a
        lease ends the one it follows (of its own owner or an expired one); it is refused
        like any other while another owner's lease is live. A store that keeps no run
        heads (a plain `EventStore`) keeps no leases either."""
        action = "claim"
        self._gate(action, action)
        self._text(action, "owner", owner, optional=True)  # str (valid Unicode) or None
        length = None if lease is None else self._lease(action, owner, lease)
        self._record(action, ev.RunClaimed(self._journal.version, owner, at=self._clock(),
                                           lease=length))

    def _lease(self, action: str, owner: str | None, lease: Any) -> int:
        """``lease`` (seconds) as whole microseconds, at least one: a positive finite
        int or float up to `MAX_LEASE` seconds, on a claim with an owner."""
        if type(lease) not in (int, float) or not 0 < lease <= MAX_LEASE:  # NaN fails too
            self._refuse(SchemaError, action, "lease must be a positive finite number of "
                         f"seconds (at most {MAX_LEASE}) or None")
        if owner is None:
            self._refuse(SchemaError, action, "a lease needs an owner: nobody could renew "
                         "or reclaim a lease held by no one")
        return max(1, round(float(lease) * 1_000_000))

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
        if s.step is Step.INTERRUPTION and s.count(Phase.APPROVED):
            self._record("resume", ev.Resumed(self._journal.version, at=self._clock()))
        return self.next_action()

    def _refuse_in_doubt(self, action: str, call_id: str) -> NoReturn:
        if switch.telemetry:
            telemetry.answered(self._state.run_id, call_id, self._tool_name(call_id),
                               "refused_in_doubt")
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
                if switch.telemetry:
                    telemetry.answered(self._state.run_id, call_id, record.call.name, "resent")
                return Resend(call_id, copy_plain(record.result))
            if record.phase is Phase.STARTED:
                if call_id in self._in_flight:
                    self._refuse(InvalidTransition, "begin_tool",
                                 f"call {excerpt(call_id)} is already running in this controller")
                if not record.call.idempotent:
                    self._refuse_in_doubt("begin_tool", call_id)
        # the copy handed out is made before anything is recorded
        handed = None if record is None else _copy_call(record.call)
        self._record("begin_tool", ev.ToolStarted(self._journal.version, call_id, at=self._clock()))
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
        self._record("tool_completed", ev.ToolCompleted(self._journal.version, call_id, detached,
                                                        at=self._clock()))
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
        if self._spans is not None:
            self._spans.interrupted(call_id)

    def resolve_in_doubt(self, call_id: str, output: JSON = None, *,
                         outcome: Resolution = Resolution.COMPLETED, by: str | None = None,
                         evidence: str | None = None) -> None:
        """Record what happened to a call in doubt (DESIGN §7.3): the operator's (or a
        verifier's) word, the only way such a call leaves doubt.

        ``outcome`` `Resolution.COMPLETED` (the default: the effect happened, ``output``
        is what the model sees) or `Resolution.FAILED` (the tool failed, ``output`` is the
        error text the model sees) caches ``output`` as the call's result, published like
        any other; `Resolution.NOT_EXECUTED` (the effect did not happen) takes no output
        and makes the call runnable again with its approval kept, so the next
        ``begin_tool`` answers `Execute`. ``by`` (who said so) and ``evidence`` (a
        payment id, a ticket) are text, kept with the outcome. `InvalidTransition` unless
        the call is started and not completed (and not running in this controller)."""
        action = "resolve_in_doubt"
        self._gate(action, action)
        self._text(action, "call_id", call_id)
        if type(outcome) is not Resolution:
            self._refuse(SchemaError, action, "outcome must be a Resolution")
        self._text(action, "by", by, optional=True)
        self._text(action, "evidence", evidence, optional=True)
        if outcome is Resolution.NOT_EXECUTED and output is not None:
            self._refuse(SchemaError, action, "NOT_EXECUTED takes no output: the effect did "
                         "not happen, and the call's next run gives the model its output")
        detached = self._detach(action, "output", output)
        if call_id in self._in_flight:
            self._refuse(InvalidTransition, action,
                         f"call {excerpt(call_id)} is in flight in this controller; report "
                         "tool_completed")
        self._record(action, ev.InDoubtResolved(self._journal.version, call_id, detached,
                                                at=self._clock(), by=by, outcome=outcome,
                                                evidence=evidence))

    # ------------------------------------------------------- guardrails and hooks

    def guardrail_evaluated(self, name: str, result: JSON, *, stage: str,
                            call_id: str | None = None) -> None:
        """Record a completed guardrail: tool stages once per (name, stage, call), the
        input/output stages once per (name, stage, activation) (I1)."""
        action = "guardrail_evaluated"
        self._gate(action, action)
        self._text(action, "name", name)
        self._text(action, "stage", stage)
        self._text(action, "call_id", call_id, optional=True)
        detached = self._detach(action, "guardrail result", result)
        self._record(action, ev.GuardrailEvaluated(
            self._journal.version, GuardrailResult(name, stage, call_id, detached),
            at=self._clock()))

    def hook_ran(self, hook: str, *, call_id: str | None = None) -> None:
        """Record a lifecycle hook: tool hooks once per call, model hooks once per model
        call (record them after ``begin_model_call``), agent hooks once per activation."""
        self._gate("hook_ran", "hook_ran")
        self._text("hook_ran", "hook", hook)
        self._text("hook_ran", "call_id", call_id, optional=True)
        self._record("hook_ran", ev.HookRan(self._journal.version, hook, call_id, at=self._clock()))

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
        self._record(action, ev.FinalOutputAccepted(self._journal.version, detached, lossless,
                                                    at=self._clock()))

    def complete(self) -> None:
        """FINAL_OUTPUT → COMPLETED, for a run without a Session with nothing unpublished."""
        self._gate("complete", "complete")
        self._record("complete", ev.RunCompleted(self._journal.version, at=self._clock()))

    def handoff(self, target: str) -> None:
        """RUN_AGAIN or INTERRUPTION → HANDOFF: a new activation; every call not yet
        started is skipped, and the next batch must publish every unpublished result."""
        self._gate("handoff", "handoff")
        self._text("handoff", "target", target)
        self._record("handoff", ev.HandedOff(self._journal.version, target, at=self._clock()))

    def abandon(self, reason: str, *, by: str | None = None) -> None:
        """Any live step → TERMINAL_UNRECOVERABLE, for good. ``by`` (who abandoned it) is
        text, recorded with ``reason``."""
        self._gate("abandon", "abandon")
        self._text("abandon", "reason", reason)
        self._text("abandon", "by", by, optional=True)
        self._record("abandon", ev.Abandoned(self._journal.version, reason, at=self._clock(),
                                             by=by))
        self._in_flight.clear()
        self._attempt = None

    # -------------------------------------------------- per-call publications

    def receive_tool_calls(self, tool_calls: Sequence[ToolCall]) -> None:
        """Calls a remote agent loop asks this client to run (RUN_AGAIN or TOOLS →
        TOOLS). They need no approval here; their ids must be new to the run."""
        action = "receive_tool_calls"
        self._gate(action, action)
        calls = self._tool_calls(action, tool_calls)
        self._record(action, ev.ToolCallsReceived(self._journal.version, calls, at=self._clock()))

    def result_posted(self, call_id: str) -> None:
        """The call's cached result is now in the remote history: it is published, and
        ``begin_tool`` will neither re-send nor re-run it."""
        self._gate("result_posted", "result_posted")
        self._text("result_posted", "call_id", call_id)
        self._record("result_posted", ev.ResultPosted(self._journal.version, call_id,
                                                      at=self._clock()))

    def result_post_failed(self, call_id: str, error: BaseException | type[BaseException]
                           ) -> None:
        """A post of the call's result ended without landing (the type name is recorded;
        re-raise or report the error yourself). The result stays cached for a re-post."""
        self._gate("result_post_failed", "result_post_failed")
        self._text("result_post_failed", "call_id", call_id)
        self._record("result_post_failed",
                     ev.ResultPostFailed(self._journal.version, call_id, _error_name(error),
                                         at=self._clock()))

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
                f"the {len(history)} history items given {TOO_SHORT}; read at least "
                f"{len(history) + 1} items, or pass the whole Session with whole=True")
        event = ev.PublicationStaged(
            self._journal.version, s.session_id, batch, listed, frontier.read_limit,
            frontier.digests, frontier.whole, batch_digests, s.continuation_after(listed),
            at=self._clock())
        self._record(action, event)
        self._attempt = event.seq

    def _own_attempt(self, action: str) -> None:
        if not self.holds_attempt:
            self._refuse(InvalidTransition, action,
                         "no publication attempt is open in this controller")

    def publication_committed(self, *, session_write: SessionWrite | None = None,
                              ride: bool = False) -> None:
        """The write this controller attempted succeeded: settle the envelope, publish
        its guardrail results and enter the continuation.

        With ``session_write`` the write has not happened yet: the store writes the
        batch's items together with this commit event, in one transaction (DESIGN §6.7),
        so they land together or not at all. It must hold exactly the staged batch, for
        the run's Session, under the attempt's `publication_id`, and the store's
        ``append`` must take ``session_write=`` (the PostgreSQL stores); otherwise
        `InvalidTransition` (`SchemaError` for a value that is not a `SessionWrite` of
        plain JSON), nothing recorded or written.

        A sync store appends at once, in either durability (events the run buffered go in
        the same transaction). With an async store, ``await flush_async()`` right after:
        the items are the effect, so they cannot wait (every command that records is
        refused until then). The event is applied only once the append landed: if it
        raises, nothing of the items was written either, the controller is as it was and
        its attempt stays open — report ``publication_failed`` after an `Outcome.NOT_WRITTEN`
        `StorageError`; after a `ConcurrencyConflict` or an unknown outcome load the run
        again (the log shows whether the pair landed).

        ``ride=True`` (with ``session_write``) lets the pair wait for the next flush of a
        buffered controller (DESIGN §7.7: a result rides with the run's next write): the
        commit is recorded and applied now, like any buffered event, and the next flush's
        append writes the items with it, in one transaction; until then they are in
        `riding_items`, which whoever reads the Session for the run (the model's history,
        the next staging) must add to what the Session holds (`runner.publish.run_history`
        does). A crash before that flush loses both, as it loses every buffered event.
        Per event, or when a write already rides and the store writes one per append, it
        is written as without ``ride``."""
        action = "publication_committed"
        self._gate(action, action)
        self._own_attempt(action)
        if type(ride) is not bool:
            self._refuse(SchemaError, action, "ride must be a bool")
        if session_write is not None:
            self._commit_with(action, self._session_write(action, session_write), ride)
            return
        self._record(action, ev.PublicationCommitted(self._journal.version, at=self._clock()))
        self._attempt = None

    def _session_write(self, action: str, write: SessionWrite) -> SessionWrite:
        """``write`` checked against the attempt this controller holds, its items detached
        (the copy the store gets)."""
        s = self._state
        if type(write) is not SessionWrite:
            self._refuse(SchemaError, action, "session_write must be a SessionWrite")
        store = self._journal.store
        if store is None or not takes_session_write(store):
            self._refuse(InvalidTransition, action,
                         "this run's store cannot write a Session's items with its events "
                         "(its append takes no session_write=): write the items to the "
                         "Session, then call publication_committed()")
        if write.session_id != s.session_id:
            self._refuse(InvalidTransition, action,
                         f"session_write is for Session {excerpt(str(write.session_id))}, "
                         "not the run's Session")
        if write.publication_id != self.publication_id:
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
        after = write.after
        if after is not None:
            if type(after) is not tuple or type(write.whole) is not bool:
                self._refuse(SchemaError, action,
                             "session_write's after must be a tuple, its whole a bool")
            try:  # (a Session item another writer left may be deeper than this run's limit)
                after = tuple(copy_plain(item) for item in after)
            except PayloadError as exc:
                self._refuse(SchemaError, action, f"a Session item is not plain JSON: {exc}")
        return SessionWrite(write.session_id, write.publication_id, items, after,
                            write.whole)

    def publication_failed(self, error: BaseException | type[BaseException]) -> None:
        """The write has *ended* without committing (it can no longer land). Under
        RECONCILE the run stays unsettled for `reconcile`; fail-closed envelopes enter
        TERMINAL_UNRECOVERABLE. Records the error's type name only and never raises
        ``error``: re-raise it yourself (I6). Do not report a write that was cancelled or
        timed out and may still land: its attempt stays open."""
        self._gate("publication_failed", "publication_failed")
        self._own_attempt("publication_failed")
        self._record("publication_failed",
                     ev.PublicationFailed(self._journal.version, _error_name(error),
                                          at=self._clock()))
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
            self._record(action, ev.ReconciledAcknowledge(self._journal.version, take_over,
                                                          at=self._clock()))
            self._attempt = None
            return Acknowledge()
        if finding.kind is FindingKind.APPEND:
            if s.attempt_seq is not None and not take_over:
                self._reconcile_rejected()
                self._refuse(
                    ReconcileRejected, action,
                    "the Session is at the pre-write frontier but an attempt may still be "
                    "writing; reconcile again once it has ended, or pass take_over=True if "
                    "no write of this batch can still land. The completed tool must not be "
                    "re-run")
            items = tuple(copy_plain(item) for item in envelope.items)
            event = ev.ReconciledAppend(self._journal.version, take_over, at=self._clock())
            self._record(action, event)
            self._attempt = event.seq
            return Append(items)
        self._reconcile_rejected()
        self._refuse(ReconcileRejected, action,
                     f"{finding.explain(envelope)}. The envelope is kept; the completed tool "
                     "must not be re-run")
        return None

    def _reconcile_rejected(self) -> None:
        if switch.telemetry:
            telemetry.rejected(self._state.run_id)


_BAD_CLOCK = ("the run's clock must return an int of microseconds since the Unix epoch, "
              "0 <= value < 2**63; nothing was recorded")


def _check_clock(clock: object, where: dict[str, Any]) -> Callable[[], int] | None:
    """``clock`` when it is None (the wall clock) or callable; `SchemaError` otherwise."""
    if clock is not None and not callable(clock):
        raise SchemaError("clock must be None or a callable returning an int of "
                          "microseconds since the Unix epoch", **where)
    return clock


def _read_clock(clock: Callable[[], int] | None, where: dict[str, Any]) -> int:
    """The first event's ``at``, checked as `RunController._record` checks every other."""
    at = (wall_clock if clock is None else clock)()
    if type(at) is not int or not 0 <= at <= _MAX_AT:
        raise SchemaError(_BAD_CLOCK, **where)
    return at


def _limits(max_depth: int, max_events: int, max_bytes: int) -> Limits:
    """The journal's `Limits` for these bounds, with this module's snapshot cadence."""
    return limits_of(max_depth, max_events, max_bytes, SNAPSHOT_EVERY)


def _check_limit(name: str, value: object, where: dict[str, Any]) -> None:
    if type(value) is not int or value < 1:
        raise SchemaError(f"{name} must be an int >= 1", **where)


def _copy_call(call: ToolCall) -> ToolCall:
    return ToolCall(call.call_id, call.name, copy_plain(call.arguments), call.needs_approval,
                    call.idempotent)


def _error_name(error: Any) -> str:
    """The error's type name as recorded: cut to 128 characters and made valid Unicode,
    so an absurd class name can neither break the log nor eat the settling reserve."""
    name = error.__name__ if isinstance(error, type) else type(error).__name__
    name = name[:128]
    return name if text_problem(name) is None else "<unprintable error type>"
