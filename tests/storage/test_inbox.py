"""The inbox and the blockers never hide a waiting decision (DESIGN §7.5): for random
runs, what a store's run head says after every command and every reload equals what an
independent reading of a freshly loaded controller says (`next_action`,
`pending_approvals`, the ledger's calls in doubt)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from statemachine import Action, BlockerKind, MemoryEventStore, RunController, Step, operator
from statemachine.stores import SQLiteEventStore
from statemachine.testing import RandomRun

_KINDS = {Action.RESOLVE_IN_DOUBT: BlockerKind.IN_DOUBT,
          Action.RECONCILE: BlockerKind.UNSETTLED,
          Action.AWAIT_DECISIONS: BlockerKind.AWAITING_DECISIONS,
          Action.NOT_RESUMABLE: BlockerKind.NOT_RESUMABLE}
"""What blocks a run, by what a controller holding nothing asks for next (a completed
run is done, not blocked; any other action can be taken by the next attempt)."""


def _expected(store: Any, run_id: str) -> tuple[Any, ...]:
    fresh = RunController.load(store, run_id, snapshot=False)
    action = fresh.next_action()
    kind = None if fresh.step is Step.COMPLETED else _KINDS.get(action)
    ids: tuple[str, ...] = ()
    if kind is BlockerKind.IN_DOUBT:
        ids = fresh.in_doubt()
    elif kind is BlockerKind.AWAITING_DECISIONS:
        ids = fresh.pending_approvals
    live = action is not Action.NOT_RESUMABLE  # nothing can be decided in such a run
    waiting = set()
    if live:
        waiting = {(c, "approval", fresh.fingerprint(c), fresh.call(c).call.name)
                   for c in fresh.pending_approvals}
        waiting |= {(c, "in_doubt", fresh.fingerprint(c), fresh.call(c).call.name)
                    for c in fresh.in_doubt()}
    return kind, ids, waiting


def _shown(store: Any, run_id: str) -> tuple[Any, ...]:
    (head,) = [h for h in operator.runs(store) if h.run_id == run_id]
    blocker = head.blocker
    kind = None if blocker is None else blocker.kind
    ids = () if blocker is None or kind not in (BlockerKind.IN_DOUBT,
                                                BlockerKind.AWAITING_DECISIONS) else (
        blocker.call_ids)
    waiting = {(w.call_id, w.kind, w.fingerprint, w.tool) for w in head.waiting}
    inbox = {(w.call_id, w.kind, w.fingerprint, w.tool) for w in operator.inbox(store)
             if w.run_id == run_id}
    assert inbox == waiting, "inbox and the run's head disagree"
    return kind, ids, waiting


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
@given(data=st.data())
def test_the_run_head_shows_what_the_fold_decides_after_every_command(
        kind: str, data: st.DataObject) -> None:
    with tempfile.TemporaryDirectory() as folder:
        store: Any = (MemoryEventStore() if kind == "memory"
                      else SQLiteEventStore(Path(folder) / "events.db"))
        buffered = data.draw(st.booleans(), label="buffered")
        run = RandomRun.start(data, run_id="r", store=store, buffered=buffered)
        run.controller.flush()  # the run exists in the store before any move
        for _ in range(data.draw(st.integers(0, 30), label="steps")):
            moved = run.step(data)
            run.controller.flush()
            assert _shown(store, "r") == _expected(store, "r")
            if not moved:
                break
