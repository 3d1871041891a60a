"""What a person (or a service acting for one) does to a run from outside it: decide a
call, settle a call in doubt, abandon the run; and the read models that show where runs
wait (DESIGN §7.5).

Each command loads the run from its store, claims it as ``by`` (so an attempt that was
running is superseded: its next append or fence stops it before any effect, and a live
lease of another owner refuses the operator instead, `LeaseHeld`), applies the command
through the `RunController` (every guard, fingerprint and limit applies: give a run
started with other limits than the defaults its own, ``max_bytes=`` and the like, as its
workers load it; and ``seen=``, the version a person saw, to refuse a run that moved
since), and makes it durable before it returns the controller. A refusal
raises the typed error having changed nothing: the claim and the command are held back
and appended together, in one transaction, only once both were accepted.

``runs`` and ``inbox`` read the run heads a store keeps (`RunHead.blocker`,
`RunHead.waiting`), written with every append from the fold that decides resumability:
one query, whatever the number of runs. The ``*_async`` forms take an async store, or a
sync one, whose loads and appends then run on a worker thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection
from typing import Any, TypedDict, Unpack

from statemachine import telemetry
from statemachine.blocker import Waiting
from statemachine.controller import RunController
from statemachine.errors import (
    ConcurrencyConflict,
    ConfigurationError,
    RunNotResumable,
    SchemaError,
)
from statemachine.journal import is_async
from statemachine.payloads import JSON, misprints
from statemachine.stored import RunHead
from statemachine.stores import AsyncEventStore, EventStore
from statemachine.values import Resolution, Step

__all__ = [
    "abandon",
    "abandon_async",
    "approve",
    "approve_async",
    "inbox",
    "inbox_async",
    "reject",
    "reject_async",
    "resolve",
    "resolve_async",
    "runs",
    "runs_async",
]

Command = Callable[[RunController], None]
Clock = Callable[[], int] | None


class Limits(TypedDict, total=False):
    """The run's own limits, as its workers load it (`RunController.load`; the defaults
    otherwise), and ``seen``."""

    max_depth: int
    max_events: int
    max_bytes: int
    seen: int
    """The run's version (number of events) as the deciding person saw it: a run that
    moved since is refused (`ConcurrencyConflict`) having changed nothing, so a decision
    is never taken on a page that no longer shows the run (the console's forms)."""


def _who(action: str, by: object, run_id: object) -> None:
    """``by`` names who acts: a non-empty str, every character of it printing as itself
    (a direction override or a zero-width space would record a name that reads as
    another, or as nothing); the controller checks the rest."""
    where = run_id if type(run_id) is str else None
    if type(by) is not str or not by.strip():
        raise SchemaError(f"{action} needs by: who decides, as non-empty text",
                          run_id=where, action=action)
    if any(misprints(c) for c in by):
        raise SchemaError(f"{action} needs by: who decides, as text that prints as itself "
                          "(no control, line break, direction override or zero-width "
                          "character)", run_id=where, action=action)


def _loading(limits: Limits, run_id: object) -> tuple[int | None, dict[str, Any]]:
    """``seen`` apart from the limits `RunController.load` takes; `SchemaError` unless it
    is a whole number of events."""
    rest: dict[str, Any] = dict(limits)
    seen = rest.pop("seen", None)
    if seen is not None and (type(seen) is not int or seen < 1):
        raise SchemaError("seen is the run's version as shown: a whole number of events, "
                          "1 or more", run_id=run_id if type(run_id) is str else None)
    return seen, rest


def _fresh(c: RunController, seen: int | None) -> None:
    if seen is not None and c.version != seen:
        raise ConcurrencyConflict(
            f"the run has moved since it was shown ({seen} events then, {c.version} now): "
            "look at it again before deciding; nothing was recorded", run_id=c.run_id)


def _claim(c: RunController, by: str, *, settling: bool) -> None:
    """Claim the run as ``by``. An unsettled run that fails closed refuses every claim
    (no attempt may go on there); abandoning it needs none: its append is checked against
    the version it loaded like any other, so a writer that moved the log still wins."""
    try:
        c.claim(by)
    except RunNotResumable:
        if not (settling and c.step is Step.UNSETTLED):
            raise


def _act(store: EventStore, run_id: str, action: str, by: str, command: Command,
         clock: Clock, limits: Limits, *, settling: bool = False) -> RunController:
    _who(action, by, run_id)
    seen, rest = _loading(limits, run_id)
    with telemetry.command_span(action, run_id, by):
        c = RunController.load(store, run_id, buffered=True, clock=clock, **rest)
        _fresh(c, seen)
        _claim(c, by, settling=settling)
        command(c)
        c.flush()
    return c


async def _act_async(store: AsyncEventStore | EventStore, run_id: str, action: str, by: str,
                     command: Command, clock: Clock, limits: Limits, *,
                     settling: bool = False) -> RunController:
    if not is_async(store):  # a sync store's load and append, off the event loop
        return await asyncio.to_thread(_act, store, run_id, action,  # type: ignore[arg-type]
                                       by, command, clock, limits, settling=settling)
    _who(action, by, run_id)
    seen, rest = _loading(limits, run_id)
    with telemetry.command_span(action, run_id, by):
        c = await RunController.load_async(store, run_id, buffered=True, clock=clock, **rest)
        _fresh(c, seen)
        _claim(c, by, settling=settling)
        command(c)
        await c.flush_async()
    return c


# ------------------------------------------------------------------ the commands


def _approving(call_id: str, fingerprint: str, by: str, reason: str | None) -> Command:
    if type(fingerprint) is not str or not fingerprint:
        raise SchemaError("approve needs the fingerprint the approval binds to (the one "
                          "inbox and inspect show)", action="approve")
    return lambda c: c.approve(call_id, fingerprint=fingerprint, by=by, reason=reason)


def approve(store: EventStore, run_id: str, call_id: str, *, fingerprint: str, by: str,
            reason: str | None = None, clock: Clock = None,
        **limits: Unpack[Limits]) -> RunController:
    """Approve a call awaiting a decision, bound to ``fingerprint`` (a call whose
    arguments are not the ones shown is refused, `InvalidTransition`)."""
    return _act(store, run_id, "approve", by, _approving(call_id, fingerprint, by, reason),
                clock, limits)


async def approve_async(store: AsyncEventStore | EventStore, run_id: str, call_id: str, *,
                        fingerprint: str, by: str, reason: str | None = None,
                        clock: Clock = None,
        **limits: Unpack[Limits]) -> RunController:
    """`approve` on an async store."""
    return await _act_async(store, run_id, "approve", by,
                            _approving(call_id, fingerprint, by, reason), clock, limits)


def _rejecting(call_id: str, by: str, message: JSON) -> Command:
    return lambda c: c.reject(call_id, message, by=by)


def reject(store: EventStore, run_id: str, call_id: str, *, by: str, message: JSON = None,
           clock: Clock = None,
        **limits: Unpack[Limits]) -> RunController:
    """Reject a call awaiting a decision; ``message`` is what the model is told."""
    return _act(store, run_id, "reject", by, _rejecting(call_id, by, message), clock, limits)


async def reject_async(store: AsyncEventStore | EventStore, run_id: str, call_id: str, *,
                       by: str, message: JSON = None, clock: Clock = None,
        **limits: Unpack[Limits]) -> RunController:
    """`reject` on an async store."""
    return await _act_async(store, run_id, "reject", by, _rejecting(call_id, by, message),
                            clock, limits)


def _resolving(call_id: str, outcome: Resolution, output: JSON, by: str,
               evidence: str | None) -> Command:
    return lambda c: c.resolve_in_doubt(call_id, output, outcome=outcome, by=by,
                                        evidence=evidence)


def resolve(store: EventStore, run_id: str, call_id: str, *, outcome: Resolution,
            output: JSON = None, by: str, evidence: str | None = None,
            clock: Clock = None,
        **limits: Unpack[Limits]) -> RunController:
    """Record what happened to a call in doubt (`RunController.resolve_in_doubt`):
    ``COMPLETED`` with what the model sees, ``FAILED`` with the error text it sees, or
    ``NOT_EXECUTED`` (no output: the call runs again on the next attempt)."""
    return _act(store, run_id, "resolve_in_doubt", by,
                _resolving(call_id, outcome, output, by, evidence), clock, limits)


async def resolve_async(store: AsyncEventStore | EventStore, run_id: str, call_id: str, *,
                        outcome: Resolution, output: JSON = None, by: str,
                        evidence: str | None = None, clock: Clock = None,
        **limits: Unpack[Limits]) -> RunController:
    """`resolve` on an async store."""
    return await _act_async(store, run_id, "resolve_in_doubt", by,
                            _resolving(call_id, outcome, output, by, evidence), clock, limits)


def _abandoning(reason: str, by: str) -> Command:
    if type(reason) is str and not reason.strip():
        raise SchemaError("abandon needs a reason: why the run ends, as non-empty text",
                          action="abandon")
    return lambda c: c.abandon(reason, by=by)


def abandon(store: EventStore, run_id: str, *, reason: str, by: str,
            clock: Clock = None,
        **limits: Unpack[Limits]) -> RunController:
    """End the run for good (`TERMINAL_UNRECOVERABLE`), saying why and who."""
    return _act(store, run_id, "abandon", by, _abandoning(reason, by), clock, limits,
                settling=True)


async def abandon_async(store: AsyncEventStore | EventStore, run_id: str, *, reason: str,
                        by: str, clock: Clock = None,
        **limits: Unpack[Limits]) -> RunController:
    """`abandon` on an async store."""
    return await _act_async(store, run_id, "abandon", by, _abandoning(reason, by), clock,
                            limits, settling=True)


# ------------------------------------------------------------------ read models


def _heads(store: object) -> None:
    if not callable(getattr(store, "list_runs", None)):
        raise ConfigurationError("this store keeps no run heads (list_runs): runs and "
                                 "inbox need one of the library's stores")


def _select(heads: list[RunHead], blocked: bool) -> list[RunHead]:
    return [h for h in heads if h.blocker is not None] if blocked else heads


def _waiting(heads: list[RunHead]) -> list[Waiting]:
    found = [w for h in heads for w in h.waiting]
    found.sort(key=lambda w: (w.since is None, w.since or 0, w.run_id))
    return found


def runs(store: EventStore, *, steps: Collection[Step] | None = None,
         session_id: str | None = None, blocked: bool = False) -> list[RunHead]:
    """The runs a store holds (`RunHead`: step, Session, owner, lease, ``updated_at``,
    blocker, inbox entries), by run id; ``blocked`` keeps only those with a blocker."""
    _heads(store)
    heads = list(store.list_runs(session_id, steps))  # type: ignore[attr-defined]
    return _select(heads, blocked)


async def runs_async(store: AsyncEventStore | EventStore, *,
                     steps: Collection[Step] | None = None, session_id: str | None = None,
                     blocked: bool = False) -> list[RunHead]:
    """`runs` on an async store."""
    _heads(store)
    lister: Any = store.list_runs  # type: ignore[union-attr]
    heads = list(await lister(session_id, steps) if is_async(store)
                 else await asyncio.to_thread(lister, session_id, steps))
    return _select(heads, blocked)


def inbox(store: EventStore) -> list[Waiting]:
    """Every call awaiting a decision and every call in doubt, across the store's runs,
    oldest first (`Waiting`: run, call, tool, argument preview, fingerprint, since)."""
    return _waiting(runs(store))


async def inbox_async(store: AsyncEventStore | EventStore) -> list[Waiting]:
    """`inbox` on an async store."""
    return _waiting(await runs_async(store))
