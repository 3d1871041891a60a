"""The reference runner's durability by default (DESIGN §7.7): buffered within an
attempt (flushed where an effect needs it), per event after it, so what the caller records
on the controller it gets back (a decision) is durable when the command returns; told
``buffered=True`` it stays buffered, told ``buffered=False`` it appends per event
throughout. Counted by the store's own commits."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from statemachine import Phase, RunController, SQLiteEventStore, Step
from statemachine import events as ev
from statemachine.runner import Agent, ModelResponse, Runner
from statemachine.sessions import MemorySession
from statemachine.testing import Counters, ScriptedModel, counted_tool


def _agent(counters: Counters) -> Agent:
    charge = counted_tool(counters, "charge", lambda x: f"charged {x}", needs_approval=True)
    model = ScriptedModel([ModelResponse((("c1", "charge", {"x": 7}),)),
                           ModelResponse(output="charged")])
    return Agent("billing", model, (charge,))


def _first(tmp_path: Path, **options: Any) -> tuple[SQLiteEventStore, RunController, Agent,
                                                    Counters]:
    counters = Counters()
    agent = _agent(counters)
    store = SQLiteEventStore(tmp_path / "events.db")
    result = asyncio.run(Runner.run(agent, "charge 7", session=MemorySession("s"),
                                    store=store, run_id="r", **options))
    assert result.step is Step.INTERRUPTION
    return store, result.controller, agent, counters


def test_a_decision_on_the_controller_handed_back_is_durable_at_once(tmp_path: Path) -> None:
    store, c, _, _ = _first(tmp_path)
    before = store.commits
    c.approve("c1", fingerprint=c.fingerprint("c1"), by="ann")  # no flush
    assert store.commits == before + 1
    loaded = RunController.load(SQLiteEventStore(tmp_path / "events.db"), "r")
    assert isinstance(loaded.events[-1], ev.CallApproved)


def test_told_buffered_the_controller_stays_buffered(tmp_path: Path) -> None:
    store, c, _, _ = _first(tmp_path, buffered=True)
    c.approve("c1", fingerprint=c.fingerprint("c1"))
    assert c.unflushed == 1
    loaded = RunController.load(SQLiteEventStore(tmp_path / "events.db"), "r")
    assert loaded.step is Step.INTERRUPTION  # not durable until flushed
    c.flush()
    assert RunController.load(store, "r").phase("c1") is Phase.APPROVED


@pytest.mark.parametrize("how", ["controller", "store"])
def test_the_next_attempt_is_buffered_whichever_way_it_resumes(tmp_path: Path,
                                                               how: str) -> None:
    """The resumed attempt (claim, tool, result, answer) takes a few transactions, not
    one per event, whether the caller hands the controller back or names the run; the
    controller is per event again afterwards."""
    store, c, agent, counters = _first(tmp_path)
    c.approve("c1", fingerprint=c.fingerprint("c1"))
    before, version = store.commits, c.version
    session = MemorySession("s")
    if how == "controller":
        done = asyncio.run(Runner.run(agent, controller=c, session=session))
    else:
        done = asyncio.run(Runner.run(agent, session=session, store=store, run_id="r"))
    assert done.step is Step.COMPLETED
    assert counters.tools == {"charge": 1}
    events = done.controller.version - version
    commits = store.commits - before
    assert events >= 8
    # the claim, the tool's start, the result's publication (its staging flushed before a
    # Session of its own is written), the write's commit and the answer, at most
    assert commits <= 6 < events, (commits, events)
    assert done.controller.unflushed == 0


def test_told_per_event_every_event_is_its_own_transaction(tmp_path: Path) -> None:
    store, c, agent, _ = _first(tmp_path, buffered=False)
    c.approve("c1", fingerprint=c.fingerprint("c1"))
    before, version = store.commits, c.version
    done = asyncio.run(Runner.run(agent, session=MemorySession("s"), store=store,
                                  run_id="r", buffered=False))
    assert done.step is Step.COMPLETED
    assert store.commits - before == done.controller.version - version


def test_a_controller_its_caller_bound_per_event_stays_so(tmp_path: Path) -> None:
    """Loaded by the caller with the controller's own default (one append per event) and
    handed in: the runner keeps to it, every event its own transaction."""
    store, c, agent, _ = _first(tmp_path)
    c.approve("c1", fingerprint=c.fingerprint("c1"))
    mine = RunController.load(store, "r")
    before, version = store.commits, mine.version
    done = asyncio.run(Runner.run(agent, controller=mine, session=MemorySession("s")))
    assert done.step is Step.COMPLETED
    assert store.commits - before == done.controller.version - version
