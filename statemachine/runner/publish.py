"""The two ways a runner writes completed work to a Session through a controller:
`publish` (stage, write, report) and `settle` (reconcile, write if nothing landed,
report). Both ask the controller first and never write what it refuses, and both refuse
a Session that is not the run's. `one_writer` is the check an attempt makes before its
first write: one Session, one writer (DESIGN §6.4)."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Sequence

from statemachine.controller import TOO_SHORT, RunController
from statemachine.errors import (
    ConcurrencyConflict,
    ControlError,
    InvalidTransition,
    PublicationUnsettled,
    ReconcileRejected,
    StorageError,
    excerpt,
)
from statemachine.events import RunClaimed
from statemachine.payloads import JSON
from statemachine.sessions import Session, SQLiteSession
from statemachine.stores import (
    AsyncEventStore,
    AsyncSQLiteEventStore,
    SessionWrite,
    SQLiteEventStore,
    checks_session_tail,
    indexes_runs,
    many_session_writes,
    takes_session_write,
)
from statemachine.values import Acknowledge, Append, Step

TAIL_ITEMS = 16
"""How many of the Session's last items `one_writer` reads (never the whole Session)."""


async def one_writer(controller: RunController, session: Session, *,
                     read: list[JSON] | None = None) -> None:
    """Refuse (`PublicationUnsettled`, before anything is written and before any model
    call) an attempt that would write to a Session another run left unsettled:

    * with a store that indexes runs (`stores.IndexedStore`), any other run on the same
      Session in step ``UNSETTLED`` blocks, and the error names it;
    * always (with a store or without), a Session whose last items hold a
      ``function_call`` with no ``function_call_output`` after it blocks: some run's
      write stopped half way (or left its calls unanswered), and the model must never
      be sent a call without its output.

    A run that is itself ``UNSETTLED`` is not checked: its next write is its own
    reconcile, which writes only onto exactly the frontier it recorded. Nor is a run
    without a Session (it writes into a private history). ``read``: the whole Session as
    `run_history` gave it to the caller in this attempt, nothing written since (its last
    items are checked instead of reading them again)."""
    c = controller
    if c.session_id is None or c.step is Step.UNSETTLED:
        return
    store = c.store  # the store the run is bound to (None: a run loaded from JSON)
    if store is not None and (indexes_runs(store) or isinstance(store, AsyncEventStore)):
        heads = store.list_runs(session_id=c.session_id, steps=(Step.UNSETTLED,))
        if inspect.isawaitable(heads):  # an async store
            heads = await heads
        blocking = [head.run_id for head in heads if head.run_id != c.run_id]
        if blocking:
            names = ", ".join(repr(run_id) for run_id in blocking[:3])
            more = f" (and {len(blocking) - 3} more)" if len(blocking) > 3 else ""
            raise PublicationUnsettled(
                f"run {names}{more} has an unsettled publication on Session "
                f"{c.session_id!r}: settle it (reconcile), or abandon it and repair the "
                "Session, before another run writes there",
                run_id=c.run_id, step=c.step, action="run")
    tail = (read[-TAIL_ITEMS:] if read is not None
            else await run_history(c, session, limit=TAIL_ITEMS))
    dangling = _unanswered_call(tail)
    if dangling is not None:
        position, call_id = dangling
        where = ("the Session ends with call {} that has no output" if position == len(tail) - 1
                 else "the Session's last items hold call {} with no output after it")
        raise PublicationUnsettled(
            f"{where.format(excerpt(call_id))}: settle or repair the run that wrote it",
            run_id=c.run_id, step=c.step, action="run")


def _unanswered_call(tail: list[JSON]) -> tuple[int, JSON] | None:
    """The position and call id of the last ``function_call`` in ``tail`` that no
    ``function_call_output`` with an equal call id follows, or None. Call ids are
    compared by value: a foreign Session may hold any JSON there (the reference runner
    never leaves a call without its output: it writes a call and its output in one batch,
    and never writes the calls a handoff or a final output skipped)."""
    answered: list[JSON] = []  # (a list: an id may be a list or an object)
    for position in range(len(tail) - 1, -1, -1):
        item = tail[position]
        if not isinstance(item, dict):
            continue
        kind, call_id = item.get("type"), item.get("call_id")
        if kind == "function_call_output":
            answered.append(call_id)
        elif kind == "function_call" and call_id not in answered:
            return position, call_id
    return None


def _same_session(controller: RunController, session: Session, action: str) -> None:
    """`ReconcileRejected` (nothing recorded, nothing written) for a Session that is not
    the run's. A run without a Session writes only into a history whose id is None."""
    if session.session_id != controller.session_id:
        raise ReconcileRejected(
            f"the Session {session.session_id!r} is not the run's Session "
            f"{controller.session_id!r}; nothing was staged or written",
            run_id=controller.run_id, step=controller.step, action=action)


async def run_history(controller: RunController, session: Session,
                      limit: int | None = None) -> list[JSON]:
    """The run's Session as the run sees it: what ``session`` holds, then the items of
    the publications that ride with the controller's next flush (`riding_items`: they are
    committed in the run and land with its next append); the last ``limit`` of them.
    Whoever reads a run's Session while it publishes with ``ride=True`` reads it here."""
    riding = list(controller.riding_items)
    if limit is not None and len(riding) >= limit:
        return riding[len(riding) - limit:] if limit > 0 else []
    wanted = None if limit is None else limit - len(riding)
    store = controller.store
    if isinstance(store, SQLiteEventStore) and _reads_through_store(store, session):
        held = store.session_items(session.session_id, wanted)
    elif isinstance(store, AsyncSQLiteEventStore) and _reads_through_store(store, session):
        held = await store.session_items(session.session_id, wanted)
    else:
        held = await session.get_items(limit=wanted)
    return [*held, *riding]


def _reads_through_store(store: object, session: Session) -> bool:
    """Whether ``session`` is read through the run's ``store``: a `SQLiteSession` (one
    that reads as it reads, not a subclass that reads otherwise) in the file of the
    `SQLiteEventStore` (or its async face) the run is bound to, which writes the
    Session's items in its own appends. A sync store reads it on the event loop's thread,
    where it already runs every append (its fsync included), fence and load: the read
    blocks the loop no more, finds the pages the store just wrote in its own cache, and
    saves the hop to the Session's thread and back (two thread switches per read, most of
    a read's cost). The async store reads it on its own worker thread, after the calls
    made before (one thread for every run's reads, already awake for their appends,
    where each Session's own thread would be one more to wake). Any other Session is read
    through its ``get_items``."""
    return (getattr(type(session), "get_items", None) is SQLiteSession.get_items
            and session.shares_transaction_with(store))  # type: ignore[attr-defined]


async def publish(controller: RunController, session: Session, items: list[JSON], *,
                  call_ids: list[str] | None = None, ride: bool = False,
                  known: list[JSON] | None = None) -> None:
    """Stage ``items`` (reading just enough of the Session's tail: ``len(items) + 1``
    items, more while they cannot tell the write's outcomes apart), write them, report.

    ``known``: the whole Session as the run sees it (`run_history`), read by the caller
    in this attempt, with every item it published since (the Session has one writer,
    DESIGN §6.4): its tail is staged against instead of reading the Session again, where
    the publication lands in one append with its staging and commit (`_lands_whole`), so
    that tail is never reconciled against; elsewhere the Session is read.

    A write the store makes in its own append carries the tail it was staged against
    (`SessionWrite.after`): a store that checks it (`stores.checks_session_tail`) refuses
    the write, whole, onto a Session whose last items another writer changed after the
    tail was read.

    ``ride=True``: a Session that shares the store's transaction is written by the
    controller's next flush, with the commit (DESIGN §7.7; `RunController.
    publication_committed`); read the Session through `run_history` until then. Any other
    Session is written at once, as without it.

    A write that raises an `Exception` is reported with ``publication_failed`` and the
    original error propagates (I6). A cancelled write (`asyncio.CancelledError`, or any
    other `BaseException`) might still land, so it is *not* reported: its attempt stays
    open and a later attempt must reconcile (or, fail-closed, cannot go on).
    `ReconcileRejected` before staging for a Session that is not the run's."""
    _same_session(controller, session, "publish")
    if not many_session_writes(controller.store) and controller.riding_items:
        await controller.flush_async()  # (its store writes one Session write per append)
    if known is not None and _lands_whole(controller, session):
        after = stage_known(controller, items, known, call_ids=call_ids)
    else:
        limit = len(items) + 1
        while True:
            tail = await run_history(controller, session, limit=limit)
            if _staged(controller, items, tail, limit, call_ids):
                break
            limit *= 2
        after = (tuple(tail), len(tail) < limit)
    await _write(controller, session, items, ride=ride, after=after)


def stage_known(controller: RunController, items: list[JSON], known: Sequence[JSON], *,
                call_ids: list[str] | None = None) -> tuple[tuple[JSON, ...], bool]:
    """`publish`'s staging against ``known``, the whole Session as the run sees it (read
    in this attempt, with what it published since), nothing read: the tail it was staged
    against and whether that is the whole Session (`SessionWrite.after`, ``whole``)."""
    limit = len(items) + 1
    while not _staged(controller, items, known[-limit:], limit, call_ids):
        limit *= 2
    return tuple(known[-limit:]), len(known) < limit


def _staged(controller: RunController, items: list[JSON], tail: Sequence[JSON], limit: int,
            call_ids: list[str] | None) -> bool:
    """Stage ``items`` against ``tail``, the Session's last ``limit`` items (a shorter
    list is the whole Session); False when that tail is too short to tell the write's
    outcomes apart and more of the Session may (DESIGN §2.3, read_limit: read twice as
    much, up to the whole Session, which always tells them apart); a refusal for any other
    reason is raised."""
    whole = len(tail) < limit
    try:
        controller.stage_publication(items, tail, call_ids=call_ids, whole=whole)
    except InvalidTransition as refused:
        if whole or TOO_SHORT not in refused.reason:
            raise
        return False
    return True


def keeps_history(controller: RunController, session: Session) -> bool:
    """Whether a runner may keep the run's Session as it read it once in an attempt (with
    every item it published since) and pass that as `publish`'s ``known`` and as what it
    sends the model, instead of reading the Session again: a publication then lands whole
    (`_lands_whole`) and its store checks, in that same transaction, that the Session
    still ends as the publication was staged against (`stores.checks_session_tail`), so a
    Session another writer moved meanwhile refuses the write (`ReconcileRejected`),
    nothing of it written. Code of the user's that may have written to the Session (a
    tool, a hook, a guardrail, a stream's consumer) is followed by a fresh read."""
    return keeps_history_on(controller.store, session,
                            buffered=controller._journal.buffered)


def keeps_history_on(store: object, session: object, *, buffered: bool) -> bool:
    """`keeps_history` for a run on ``store`` that buffers (``buffered``) or not, asked
    before its controller exists (an adapter refusing, when a run opens, a history it
    cannot keep)."""
    return lands_whole_on(store, session, buffered=buffered) and checks_session_tail(store)


def _lands_whole(controller: RunController, session: Session) -> bool:
    """Whether a publication staged now lands with its commit and its items in one
    append, or not at all: the controller buffers (its staging waits for the flush that
    writes the commit) and the Session is written in the store's transaction (`_write`).
    Its frontier is then never reconciled against: no append leaves it unsettled."""
    return lands_whole_on(controller.store, session, buffered=controller._journal.buffered)


def lands_whole_on(store: object, session: object, *, buffered: bool) -> bool:
    """`_lands_whole` for a run on ``store`` that buffers (``buffered``) or not."""
    shares = getattr(session, "shares_transaction_with", None)
    return (buffered and store is not None
            and callable(shares) and bool(shares(store)) and takes_session_write(store))


async def settle(controller: RunController, session: Session, *,
                 take_over: bool = False) -> Append | Acknowledge:
    """Reconcile an unsettled run against the Session, and write the batch if nothing of
    it is there. Raises `ReconcileRejected` (nothing recorded) when the Session cannot be
    matched (a Session that is not the run's is refused before it is read), and the
    write's own error if the re-write fails."""
    _same_session(controller, session, "settle")
    envelope = controller.envelope
    limit = envelope.read_limit if envelope is not None else 1
    decision = controller.reconcile(await run_history(controller, session, limit=limit),
                                    session.session_id, take_over=take_over)
    if isinstance(decision, Append):
        await _write(controller, session, list(decision.items))
    return decision


def writer_gone(controller: RunController, session: Session) -> bool:
    """Whether the attempt that began the run's unsettled write can no longer land it, so
    the next claimant may take the write over (DESIGN §7.2, leases). All of:

    * ``session`` is written in the store's own append transaction (it shares it, as
      `PostgresSession` does): the writer's write is its commit append, which the store
      refuses once another attempt has moved the log. A Session written on its own
      (memory, a SQLite file of its own, yours) is never taken over this way: a write
      stalled past the lease could still land after the take-over, twice;
    * that attempt's claim took a lease and named an owner, and a later claim by ANOTHER
      owner landed in a store that keeps leases (``keeps_leases``), which refuses such a
      claim while the lease is live: the writer appended nothing for a whole lease.

    False whenever any of it cannot be shown from the events this controller holds (the
    claims before a snapshot it was loaded from included): then only an explicit
    ``take_over=True`` goes on (fail closed)."""
    attempt = controller.state.attempt_seq
    store = controller.store
    shares = getattr(session, "shares_transaction_with", None)
    if (controller.step is not Step.UNSETTLED or attempt is None
            or not getattr(store, "keeps_leases", False)
            or not (callable(shares) and shares(store) and takes_session_write(store))):
        return False
    writer: RunClaimed | None = None
    for event in controller.events:
        if type(event) is not RunClaimed:
            continue
        if event.seq < attempt:
            writer = event  # the last claim before the write began: the writer's
            continue
        # the first claim after the write began: another owner's, past the writer's lease
        return (writer is not None and writer.lease is not None
                and writer.owner is not None and event.owner != writer.owner)
    return False


async def _write(controller: RunController, session: Session, items: list[JSON], *,
                 ride: bool = False, after: tuple[tuple[JSON, ...], bool] | None = None
                 ) -> None:
    """Write the attempt's batch, then report. Its publication id is ``run_id:seq`` (the
    seq of the event that opened the attempt). A Session that shares the run's store's
    database (``shares_transaction_with(store)``: `PostgresSession`, `SQLiteSession` on
    the store's file) is not written here: the store writes the staging, the items and
    the commit event in one transaction (DESIGN §6.7, §7.7). A
    Session that keeps publication ids (``publication_items``) is told the id."""
    publication_id = controller.publication_id
    assert publication_id is not None  # this controller holds the open attempt
    store = controller.store
    shares = getattr(session, "shares_transaction_with", None)
    # (a store whose append does not name session_write=, e.g. a subclass wrapping it
    # with **kwargs, is refused the pair: its Session is then written like any other)
    if (store is not None and callable(shares) and shares(store)
            and takes_session_write(store)):
        # no flush first: the write IS the append, so the staging, the commit and the
        # items land in one transaction or not at all (DESIGN §7.7); nothing outside
        # the store happens before it
        # with the tail it was staged against (``after``: a store that checks it refuses
        # the write onto a Session another writer moved since, in the same transaction)
        write = SessionWrite(session.session_id, publication_id, tuple(items),
                             *(after or (None, False)))
        try:
            controller.publication_committed(session_write=write, ride=ride)
            if controller.holds_attempt:  # (riding, it is committed: the next flush writes it)
                await controller.flush_async()  # an async store appends the pair here
        except asyncio.CancelledError:
            raise
        except Exception as error:
            # nothing of the pair landed, unless its outcome is unknown or another writer
            # moved the log: then the controller refuses everything (load the run again)
            if not (isinstance(error, ConcurrencyConflict) or (
                    isinstance(error, StorageError) and error.outcome != "not_written")):
                with contextlib.suppress(ControlError):  # the write's error wins (I6)
                    controller.publication_failed(error)
            raise
        return
    await controller.flush_async()  # an effect boundary: the staged envelope is durable
    try:
        if callable(getattr(session, "publication_items", None)):
            await session.add_items(items, publication_id=publication_id)  # type: ignore[call-arg]
        else:
            await session.add_items(items)
    except asyncio.CancelledError:
        raise
    except Exception as error:
        with contextlib.suppress(ControlError):  # the write's own error propagates (I6)
            controller.publication_failed(error)
        raise
    controller.publication_committed()
