"""The two ways a runner writes completed work to a Session through a controller:
`publish` (stage, write, report) and `settle` (reconcile, write if nothing landed,
report). Both ask the controller first and never write what it refuses."""

from __future__ import annotations

import asyncio

from statemachine.controller import RunController
from statemachine.payloads import JSON
from statemachine.sessions import Session
from statemachine.values import Acknowledge, Append


async def publish(controller: RunController, session: Session, items: list[JSON], *,
                  call_ids: list[str] | None = None) -> None:
    """Stage ``items`` (reading just enough of the Session's tail), write them, report.

    A write that raises an `Exception` is reported with ``publication_failed`` and the
    original error propagates (I6). A cancelled write (`asyncio.CancelledError`, or any
    other `BaseException`) might still land, so it is *not* reported: its attempt stays
    open and a later attempt must reconcile (or, fail-closed, cannot go on)."""
    history = await session.get_items(limit=len(items) + 1)
    controller.stage_publication(items, history, call_ids=call_ids)
    await _write(controller, session, items)


async def settle(controller: RunController, session: Session, *,
                 take_over: bool = False) -> Append | Acknowledge:
    """Reconcile an unsettled run against the Session, and write the batch if nothing of
    it is there. Raises `ReconcileRejected` (nothing recorded) when the Session cannot be
    matched, and the write's own error if the re-write fails."""
    envelope = controller.envelope
    limit = envelope.read_limit if envelope is not None else 1
    decision = controller.reconcile(await session.get_items(limit=limit), session.session_id,
                                    take_over=take_over)
    if isinstance(decision, Append):
        await _write(controller, session, list(decision.items))
    return decision


async def _write(controller: RunController, session: Session, items: list[JSON]) -> None:
    try:
        await session.add_items(items)
    except asyncio.CancelledError:
        raise
    except Exception as error:
        controller.publication_failed(error)
        raise
    controller.publication_committed()
