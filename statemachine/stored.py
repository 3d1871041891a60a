"""What every event store shares, none of it I/O: a run's head, snapshot checks, rows.

- A run's head (`RunHead`): what an append's own events tell it (`started_session`, the
  owner of the last `RunClaimed`: `claimed_owner`, the newest event's ``at``), the step
  and read model an append indexes (`to_index`: a first append's are folded), the head
  of a run folded from its snapshot and log (`head_of_log`, for a head left unfolded by
  an append that gave no step or no read model, or whose read model does not decode:
  `kept_model`), and the lease it keeps (`next_lease`: checked and moved in the append's
  transaction).
- Snapshots are never trusted blindly: `restored` is the state a snapshot holds if it is
  usable for the run and the events after it, else None, with a `SnapshotIgnored`
  warning when it is damaged; `verified_snapshot` checks a SQL store's snapshot row
  (its digest, its JSON, its version) before that.
- The SQL stores keep each event as a row of JSON text (`dumps` of `codec.encode_event`);
  `decode_rows` reads them back, checked, with the size it measured (`Loaded`).

`stores` re-exports the public names; the SQLite and PostgreSQL stores import them from
here, so that `stores` can re-export those stores by name without an import circle.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import inspect
import json
import time
import warnings
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from statemachine import codec, fastload
from statemachine import events as ev
from statemachine.blocker import Blocker, ReadModel, Waiting, read_model
from statemachine.errors import (
    ConcurrencyConflict,
    ControlError,
    ReconcileRejected,
    SchemaError,
    lease_held,
)
from statemachine.events import Event
from statemachine.machine import replay, replay_onto
from statemachine.payloads import JSON
from statemachine.state import RunState
from statemachine.values import Step

if TYPE_CHECKING:
    from statemachine.stores import Snapshot


@attrs.frozen
class Loaded:
    """Events a store read, with ``size``: the UTF-8 length of their compact JSON joined
    by commas (what they add to `to_json()`'s ``"events"``) when the store measured it
    while decoding them, else None (the controller sizes each event)."""

    events: list[Event]
    size: int | None = None


# --------------------------------------------------------------------- run heads


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
    updated_at: int | None = None
    """The ``at`` of the run's newest event (microseconds since the Unix epoch, UTC):
    when it last moved. None when that event carries no time (a log written before
    schema version 3)."""
    lease_owner: str | None = None
    """Who holds the run's lease (the owner of its last `RunClaimed`, when that claim took
    a lease; DESIGN §7.2), or None: no lease."""
    lease_until: int | None = None
    """When that lease ends by the store's clock (microseconds since the Unix epoch,
    UTC), as its holder's last append moved it; None without a lease. A lease that
    ended is still shown: it no longer holds the run against anyone."""
    blocker: Blocker | None = None
    """What keeps the run from going on by itself (None: nothing), from the same fold
    that decides resumability (`statemachine.blocker.read_model`), kept in the head by
    each append's transaction (DESIGN §7.5)."""
    waiting: tuple[Waiting, ...] = ()
    """The run's inbox entries: every call awaiting a decision and every call in doubt,
    oldest first."""


def claimed_owner(events: Sequence[Event]) -> tuple[bool, str | None]:
    """Whether ``events`` hold a `RunClaimed`, and the owner of the last one."""
    for event in reversed(events):
        if type(event) is ev.RunClaimed:
            return True, event.owner
    return False, None


Lease = tuple[str | None, int | None, int | None]
"""A run head's lease: its holder, its end and its length (microseconds); all None
without one."""
NO_LEASE: Lease = (None, None, None)


def now_micros() -> int:
    """The clock the memory and SQLite stores judge leases by: the wall clock, in
    microseconds since the Unix epoch (PostgreSQL's stores use the database's)."""
    return time.time_ns() // 1000


def next_lease(run_id: str, lease: Lease, events: Sequence[Event], now: int) -> Lease:
    """The head's lease after an append of ``events`` at ``now``, or `LeaseHeld` (the
    append must not land): a `RunClaimed` of anyone but the holder of a live lease
    (``now`` before its end) is refused; a claim sets the lease it takes (or none); any
    other append, by the attempt that holds the run (the expected version says so),
    moves a lease's end to ``now`` plus its length."""
    holder, until, length = lease
    claims = [event for event in events if type(event) is ev.RunClaimed]
    if not claims:
        return lease if length is None else (holder, now + length, length)
    if until is not None and now < until and any(c.owner != holder for c in claims):
        raise lease_held(holder, until, run_id=run_id)
    last = claims[-1]
    if last.lease is None:
        return NO_LEASE
    return last.owner, now + last.lease, last.lease


def started_session(events: Sequence[Event]) -> str | None:
    """The Session of a log's `RunStarted` (None when ``events`` do not start with one)."""
    first = events[0] if events else None
    return first.session_id if type(first) is ev.RunStarted else None


def to_index(run_id: str, events: Sequence[Event], step: Step | None,
             model: ReadModel | None, expected_version: int
             ) -> tuple[Step, ReadModel] | None:
    """The step and read model to keep in the head: ``step`` and ``model`` when both are
    given; for a run's first append (its whole log) what it folds to (``step`` when
    given); otherwise None: the head is left *unfolded*, and folded from the log where it
    is next listed (`head_of_log`). A head is never kept with a step and no read model:
    "nothing waits" is only ever said by a fold. A first append that does not fold is
    left unfolded: folding it again where it is listed rejects it there."""
    if step is not None and model is not None:
        return step, model
    if expected_version != 0 or not events:
        return None
    try:
        state = replay(run_id, events)
    except ControlError:
        return None
    return (state.step if step is None else step), read_model(state)


def kept_model(run_id: str, text: Any, blocker: Any) -> ReadModel | None:
    """The read model a head row keeps (its JSON text and its blocker's kind), or None
    when the two do not decode to one that agrees (a damaged row, or one written by
    hand): the caller folds the run again instead (fail closed)."""
    if text is not None and type(text) is not str:
        return None
    try:
        model = ReadModel.decode(run_id, text)
    except ValueError:
        return None
    kind = None if model.blocker is None else model.blocker.kind.value
    return model if kind == blocker else None


Head = tuple[int, Step, str | None, ReadModel]
"""A run's version, step, Session and read model, as folded from its log."""


def head_of_log(run_id: str, snapshot: Snapshot | None, tail: list[Event],
                whole: Callable[[], list[Event]]) -> Head:
    """The head of a run, folded from its newest snapshot and the tail after it (the
    whole log, read by ``whole``, when there is no usable snapshot, or when the tail does
    not replay onto it). A log that does not replay raises (`SchemaError`,
    `InvalidTransition`): fail closed."""
    head, stale = head_after_snapshot(run_id, snapshot, tail)
    return head if head is not None else head_of_whole_log(run_id, whole(), stale=stale)


def head_after_snapshot(run_id: str, snapshot: Snapshot | None, tail: list[Event]
                        ) -> tuple[Head | None, bool]:
    """(the head folded from a usable snapshot and the tail after it, False); (None,
    False) when there is no usable snapshot; (None, True) when the tail does not replay
    onto it. Without a head, the whole log decides (`head_of_whole_log`)."""
    state = restored(run_id, snapshot, tail)
    if state is None:
        return None, False
    base = state.last_seq + 1
    try:
        replay_onto(state, tail, first=base)
    except ControlError:
        return None, True
    return (base + len(tail), state.step, state.session_id, read_model(state)), False


def head_of_whole_log(run_id: str, log: list[Event], *, stale: bool = False) -> Head:
    """The head folded from the whole log (it raises, or the snapshot was bad: ``stale``,
    its tail did not replay onto it, which is then warned of)."""
    state = replay(run_id, log)
    if stale:
        snapshot_ignored(run_id, "the events after it do not replay onto it")
    return len(log), state.step, state.session_id, read_model(state)


def check_filters(session_id: object, steps: object) -> frozenset[Step] | None:
    """``list_runs``' filters checked (`TypeError`), with ``steps`` as a set (None: any)."""
    if session_id is not None and type(session_id) is not str:
        raise TypeError("session_id must be a str or None")
    if steps is None:
        return None
    if isinstance(steps, str | bytes) or not isinstance(steps, Collection) or any(
            type(step) is not Step for step in steps):
        raise TypeError("steps must be None or a collection of Step")
    return frozenset(steps)


def conflict(run_id: str, expected: int, actual: int) -> ConcurrencyConflict:
    """The `ConcurrencyConflict` of an append that expected another version."""
    return ConcurrencyConflict(
        f"another writer moved the log: expected version {expected}, found {actual}",
        run_id=run_id)


# --------------------------------------------------------------------- snapshots


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


def digest(text: str) -> str:
    """The sha256 (hex) of a snapshot's JSON text, as a SQL store keeps it beside it."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def verified_snapshot(run_id: str, found: tuple[Any, Any, Any] | None
                      ) -> tuple[Snapshot | None, str | None]:
    """A stored snapshot row (version, body, digest) checked on its own: (the snapshot,
    None) when its digest matches its text and the text is a JSON object of this run
    ending right before the row's version; (None, why) otherwise; (None, None) when there
    is no row."""
    if found is None:
        return None, None
    version, body, stored = found
    if type(body) is not str or type(stored) is not str:
        return None, "it has no digest" if stored is None else "its row is damaged"
    if not hmac.compare_digest(digest(body), stored):
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


# -------------------------------------------------------------------------- rows

Rows = list[tuple[Any, Any]]
"""Stored rows (seq, body), as a SQL store reads them."""


_COMPACT = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)
"""`json.dumps` with these options builds an encoder per call; one serves every call (an
encoder keeps no state between calls)."""


def dumps(value: Any) -> str:
    """The JSON text a SQL store keeps for an event, a snapshot or an item: compact, not
    ASCII-escaped (what `codec.decode_stored_text` decodes on its fast path)."""
    return _COMPACT.encode(value)


def event_text(event: Event) -> str:
    """``dumps(codec.encode_event(event))``, the text a SQL store keeps for an event,
    without copying its payloads first (`codec.shared_event`): the same text for every
    event whose payloads are plain JSON (every event a controller records: its payloads
    are detached copies within its depth limit, `payloads.detach`). Whatever the shared
    form cannot take as it is (a payload json refuses, a subclass of a value class, a
    field of the wrong kind) is encoded by `codec.encode_event`, which then decides: the
    same text, or the same error. Two kinds of payload, only ever built by hand, come out
    as json writes them rather than as cattrs copies them: one nested past about 330
    levels (json writes it to about 990, and it loads back, where `encode_event` raises
    `RecursionError`), and an enum member that is an int or a str with a value of its own
    (json writes the int or the str)."""
    with contextlib.suppress(Exception):  # (then `encode_event` decides)
        shared = codec.shared_event(event)
        if shared is not None:
            return _COMPACT.encode(shared)
    return _COMPACT.encode(codec.encode_event(event))


def decode_rows(run_id: str, rows: Rows, first: int) -> Loaded:
    """Stored rows (seq, body) from seq ``first`` on → events. `SchemaError` for a gap, a
    row whose body does not decode, or whose body's seq is not the row's: a log is never
    silently shorter, or other, than its rows. Clean rows (the common case) are decoded
    together (`fastload.decode_stored_batch`), and come with their size."""
    position = first
    for seq, body in rows:
        if type(seq) is not int or seq != position or type(body) is not str:
            break
        position += 1
    else:
        batch = fastload.decode_stored_batch([body for _, body in rows], first)
        if batch is not None:
            return Loaded(*batch)
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
    return Loaded(events)


@attrs.frozen
class SessionWrite:
    """A publication's Session items, handed to a store with the publication's commit
    event so both land in one transaction (DESIGN §6.7, §7.7): a store whose ``append``
    takes ``session_write=`` (the PostgreSQL and SQLite stores) writes ``items`` to the Session
    ``session_id``, tagged with ``publication_id``, in the append's own transaction. Build
    one for `RunController.publication_committed` (``statemachine.runner.publish`` does
    when the Session shares the store's database)."""

    session_id: str
    publication_id: str
    """``f"{run_id}:{seq}"``: the seq of the event that opened the attempt (its
    `PublicationStaged`, or the `ReconciledAppend` of a reconcile that said Append)."""
    items: tuple[JSON, ...]
    after: tuple[JSON, ...] | None = None
    """The Session's last items as the publication was staged against them (`runner.
    publish` sets them), or None. A store that says ``checks_session_tail``
    (`checks_session_tail`) writes ``items`` only onto a Session that still ends with
    exactly these (compared as JSON values), read inside the append's own transaction, and
    otherwise refuses the whole append with `ReconcileRejected`, nothing of it written:
    another writer changed the Session's last items after the run read them (DESIGN §6.4
    says one writer; this is what holds when there are two). Only the last items are
    compared: a writer that appended exactly those items again is not told apart."""
    whole: bool = False
    """With ``after``: ``after`` is the whole Session (it held fewer items than were
    read), so a Session holding anything before them has moved too."""


def checks_session_tail(store: object) -> bool:
    """Whether ``store`` checks a `SessionWrite`'s ``after`` in its append's transaction:
    a true ``checks_session_tail`` attribute (the SQLite and PostgreSQL stores have it).
    A runner may then stage a publication against the history it already holds, not a
    fresh read: a write that would land on a Session that moved meanwhile is refused
    whole."""
    return getattr(store, "checks_session_tail", False) is True and takes_session_write(store)


def session_moved(write: SessionWrite, found: Sequence[Any]) -> bool:
    """Whether a Session whose last stored bodies (JSON text, oldest first; at most
    ``len(write.after) + 1`` of them) are ``found`` no longer ends as ``write`` was staged
    against (`SessionWrite.after`): fewer items than staged, other items, or, for a whole
    Session, an item before them. A body that is not JSON has moved too."""
    after = write.after
    if after is None:
        return False
    if len(found) > len(after):
        if write.whole:
            return True
        found = found[len(found) - len(after):]
    if len(found) != len(after):
        return True
    try:
        return [json.loads(body) if isinstance(body, (str, bytes)) else body
                for body in found] != list(after)
    except (ValueError, RecursionError):
        return True


def moved_refusal(write: SessionWrite, run_id: str) -> ControlError:
    """The refusal of an append whose Session moved (`session_moved`): nothing written."""
    return ReconcileRejected(
        f"the Session {write.session_id!r} no longer ends as this run's write was staged "
        "against: another writer appended to it (or removed from it) after the run read "
        "it; nothing of the append was written (the run's events neither); load the run "
        "again to go on from the Session as it is", run_id=run_id, action="append")


_TAKES_WRITE: dict[type, bool] = {}


def takes_session_write(store: object) -> bool:
    """Whether ``store``'s ``append`` accepts ``session_write=`` (cached per class)."""
    return _append_takes(store, "session_write", _TAKES_WRITE)


def many_session_writes(store: object) -> bool:
    """Whether ``store``'s ``append`` takes a tuple of `SessionWrite` as ``session_write=``
    (several publications' items in one transaction, in order): a store says so with a
    true ``many_session_writes`` attribute (the SQLite and PostgreSQL stores do). A run
    on any other store that takes ``session_write=`` lets one write ride at a time."""
    return getattr(store, "many_session_writes", False) is True and takes_session_write(store)


def session_writes(value: object) -> tuple[SessionWrite, ...]:
    """An append's ``session_write=`` as the writes it holds, in order: one `SessionWrite`
    or a non-empty tuple of them (`TypeError`/`ValueError` otherwise, before any I/O)."""
    if type(value) is SessionWrite:
        return (value,)
    if type(value) is not tuple:
        raise TypeError("session_write must be a SessionWrite or a tuple of them")
    if not value:
        raise ValueError("session_write must hold at least one SessionWrite")
    if any(type(write) is not SessionWrite for write in value):
        raise TypeError("session_write must be a SessionWrite or a tuple of them")
    return value


def _append_takes(store: object, parameter: str, cache: dict[type, bool]) -> bool:
    """Whether ``store``'s ``append`` has ``parameter`` (cached per class in ``cache``)."""
    kind = type(store)
    found = cache.get(kind)
    if found is None:
        append = getattr(store, "append", None)
        try:
            found = append is not None and parameter in inspect.signature(
                append).parameters
        except (TypeError, ValueError):
            found = False
        cache[kind] = found
    return found
