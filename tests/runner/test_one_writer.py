"""DESIGN §6.4, one Session, one writer: a new run on a Session another run left unsettled
is refused before it calls the model or writes anything (with a store: the store's run
index names the blocking run; without one: the Session's tail ends with a call that has
no output), and `publish`/`settle` refuse a Session that is not the run's. Also the run
index itself: `list_runs` on both stores, across reloads, direct appends and a database
made before the index existed."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from statemachine import (
    ControlError,
    MemoryEventStore,
    PublicationUnsettled,
    ReconcileRejected,
    RunController,
    SQLiteEventStore,
    Step,
    codec,
)
from statemachine.runner import Agent, ModelResponse, Runner, publish, settle
from statemachine.sessions import MemorySession, Session, SQLiteSession
from statemachine.stores import IndexedStore, RunHead
from statemachine.testing import (
    Counters,
    CountingHooks,
    FlakySession,
    InjectedWriteError,
    ListSession,
    ScriptedModel,
    Untouchable,
    counted_tool,
)
from statemachine.testing.fakes import Outcome
from tests.helpers import SESSION, B, at_interruption, reloaded, run_charge, snapshot, staged

OLD, NEW = "old-run", "new-run"
SESSION_ID = "shared-session"
STORES = ["memory", "sqlite", "none"]


# ---------------------------------------------------------------------------- world


class World:
    """A Session shared by two runs: the old one's terminal output was written in part
    (its batch stopped after the ``function_call``), so it is UNSETTLED; the new one
    would greet."""

    def __init__(self, tmp_path: Path, kind: str) -> None:
        self.kind = kind
        self.counters = Counters()
        self.hooks = CountingHooks(self.counters)
        self.store: IndexedStore | None = None
        self.session: Session
        if kind == "sqlite":
            self.store = SQLiteEventStore(tmp_path / "events.db")
            self.session = SQLiteSession(SESSION_ID, tmp_path / "session.db")
        else:
            self.store = MemoryEventStore() if kind == "memory" else None
            self.session = MemorySession(SESSION_ID)
        self.old_model = ScriptedModel([ModelResponse((("charge", "charge", {"x": 7}),))])
        self.old_agent = Agent(
            "billing", self.old_model,
            (counted_tool(self.counters, "charge", lambda x: f"charged {x}",
                          needs_approval=True),),
            tool_use_behavior="stop_on_first_tool")
        self.new_model = ScriptedModel([ModelResponse(output="hello")])
        self.new_agent = Agent("greeter", self.new_model)
        self.old: RunController
        self.frontier = 0

    async def leave_old_unsettled(self, outcome: Outcome = "partial") -> None:
        first = await Runner.run(self.old_agent, "charge me 7", session=self.session,
                                 store=self.store, run_id=OLD, hooks=self.hooks)
        c = first.controller
        c.approve("charge")
        self.frontier = len(await self.items())
        flaky = FlakySession(self.session, fail_on=1, outcome=outcome)
        with pytest.raises(InjectedWriteError):
            await Runner.run(self.old_agent, session=flaky, controller=c, hooks=self.hooks)
        assert c.step is Step.UNSETTLED
        if outcome == "partial":
            assert (await self.items())[-1] == {"type": "function_call", "call_id": "charge",
                                                "name": "charge", "arguments": {"x": 7}}
        self.old = c

    def old_source(self) -> dict[str, Any]:
        """How an attempt finds the old run: through the store, or from its JSON."""
        if self.store is not None:
            return {"store": self.store, "run_id": OLD}
        return {"state": json.dumps(self.old.to_json())}

    async def new_run(self) -> Any:
        return await Runner.run(self.new_agent, "hello", session=self.session,
                                store=self.store, run_id=NEW, hooks=self.hooks)

    async def items(self) -> list[Any]:
        return await self.session.get_items()

    async def repair(self) -> None:
        """What an operator does after a partial write: trim the Session back to P."""
        while len(await self.items()) > self.frontier:
            await self.session.pop_item()


async def _assert_new_run_refused(world: World, blocker: str) -> None:
    before = await world.items()
    with pytest.raises(PublicationUnsettled) as info:
        await world.new_run()
    message = str(info.value)
    if blocker == "store":
        assert f"run {OLD!r} has an unsettled publication on Session {SESSION_ID!r}" in message
    else:
        assert info.value.reason == ("the Session ends with call 'charge' that has no "
                                     "output: settle or repair the run that wrote it")
    assert world.new_model.calls == 0  # no model call
    assert await world.items() == before  # nothing written
    if world.store is not None:
        # only the new run's start (and, on a retry, its claims) is recorded: no input
        kinds = [type(e).__name__ for e in world.store.load(NEW)]
        assert kinds[0] == "RunStarted"
        assert set(kinds[1:]) <= {"RunClaimed"}


# ----------------------------------------------------- a new run on a blocked Session


@pytest.mark.invariant("I7")
@pytest.mark.parametrize("kind", STORES)
def test_a_new_run_is_refused_until_the_old_one_settles(tmp_path: Path, kind: str) -> None:
    async def go() -> None:
        world = World(tmp_path, kind)
        await world.leave_old_unsettled()
        await _assert_new_run_refused(world, "tail" if kind == "none" else "store")

        # the old run resuming itself is not blocked by its own partial batch: its own
        # reconcile sees the partial write, as before
        with pytest.raises(ReconcileRejected, match="partial write"):
            await Runner.run(world.old_agent, session=world.session, hooks=world.hooks,
                             **world.old_source())
        await _assert_new_run_refused(world, "tail" if kind == "none" else "store")

        # repaired and settled, the old run completes once; the new run then goes on
        await world.repair()
        done = await Runner.run(world.old_agent, session=world.session, hooks=world.hooks,
                                **world.old_source())
        assert done.step is Step.COMPLETED
        assert world.counters.tools["charge"] == 1
        greeted = await world.new_run()
        assert greeted.step is Step.COMPLETED
        assert greeted.final_output == "hello"
        assert world.new_model.calls == 1
        items = await world.items()
        assert items[-1] == {"role": "assistant", "content": "hello"}
        assert sum(i.get("type") == "function_call_output" for i in items) == 1

    asyncio.run(go())


@pytest.mark.invariant("I7")
@pytest.mark.parametrize("kind", STORES)
def test_an_abandoned_run_still_blocks_until_the_session_is_repaired(
    tmp_path: Path, kind: str
) -> None:
    async def go() -> None:
        world = World(tmp_path, kind)
        await world.leave_old_unsettled()
        world.old.abandon("operator: the Session will be repaired by hand")
        # no longer UNSETTLED, but the Session still ends with a call without its output:
        # the model must not be sent that
        await _assert_new_run_refused(world, "tail")
        await world.repair()
        greeted = await world.new_run()
        assert greeted.final_output == "hello"
        assert world.new_model.calls == 1

    asyncio.run(go())


@pytest.mark.invariant("I7")
@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_with_a_store_any_unsettled_run_blocks_even_with_a_clean_tail(
    tmp_path: Path, kind: str
) -> None:
    """Nothing of the old batch landed (an atomic no-commit), so the tail looks fine; a
    new run's write would still move the old run's frontier and make it impossible to
    reconcile. The store's index sees it."""

    async def go() -> None:
        world = World(tmp_path, kind)
        await world.leave_old_unsettled("atomic")
        assert len(await world.items()) == world.frontier
        await _assert_new_run_refused(world, "store")
        done = await Runner.run(world.old_agent, session=world.session, hooks=world.hooks,
                                **world.old_source())
        assert done.step is Step.COMPLETED
        greeted = await world.new_run()
        assert greeted.final_output == "hello"

    asyncio.run(go())


@pytest.mark.invariant("I7")
def test_a_streamed_new_run_is_refused_alike(tmp_path: Path) -> None:
    async def go() -> None:
        world = World(tmp_path, "memory")
        await world.leave_old_unsettled()
        before = await world.items()
        streamed = Runner.run_streamed(world.new_agent, "hello", session=world.session,
                                       store=world.store, run_id=NEW)
        with pytest.raises(PublicationUnsettled, match=repr(OLD)):
            async for _ in streamed.stream_events():
                pass
        assert world.new_model.calls == 0
        assert await world.items() == before

    asyncio.run(go())


def test_a_run_without_a_session_is_never_blocked(tmp_path: Path) -> None:
    async def go() -> None:
        world = World(tmp_path, "memory")
        await world.leave_old_unsettled()
        result = await Runner.run(world.new_agent, "hello", store=world.store, run_id=NEW)
        assert result.final_output == "hello"

    asyncio.run(go())


def _greet(items: list[Any]) -> tuple[Any, ListSession, ScriptedModel]:
    """A new run greeting on a Session that holds ``items``: (the outcome, the Session,
    the model)."""
    session = ListSession(SESSION_ID, items)
    model = ScriptedModel([ModelResponse(output="hello")])

    async def go() -> Any:
        try:
            return await Runner.run(Agent("greeter", model), "hello", session=session)
        except PublicationUnsettled as error:
            return error

    return asyncio.run(go()), session, model


CALL_X = {"type": "function_call", "call_id": "X", "name": "t", "arguments": {}}


@pytest.mark.invariant("I7")
@pytest.mark.parametrize("items", [
    [CALL_X, {"role": "user", "content": "later"}],
    [CALL_X, {"type": "function_call", "call_id": "Y"},
     {"type": "function_call_output", "call_id": "Y", "output": "y"}],
], ids=["a-message-after-it", "another-call-answered-after-it"])
def test_a_call_without_an_output_before_the_last_item_blocks_and_is_named(
        items: list[Any]) -> None:
    """The call left without output is not the Session's last item: the run is refused
    all the same, before the model or a write, and the message names the call without
    saying the Session ends with it."""
    outcome, session, model = _greet(items)
    assert isinstance(outcome, PublicationUnsettled)
    assert outcome.reason == ("the Session's last items hold call 'X' with no output after "
                              "it: settle or repair the run that wrote it")
    assert model.calls == 0
    assert session.items == items


@pytest.mark.parametrize("call_id", [["x"], {"id": "x"}, 7])
def test_call_ids_that_are_not_text_are_matched_by_value(call_id: Any) -> None:
    """A foreign Session's items may carry any JSON as a call id: an answered call is
    answered whatever its id (no TypeError for an id that is a list or an object), and
    one left without output blocks, named by its type (never echoed)."""
    call = {"type": "function_call", "call_id": call_id}
    answered, session, model = _greet([call, {"type": "function_call_output",
                                              "call_id": json.loads(json.dumps(call_id))}])
    assert answered.final_output == "hello"
    blocked, session, model = _greet([call])
    assert isinstance(blocked, PublicationUnsettled)
    assert f"call <{type(call_id).__name__}>" in blocked.reason
    assert model.calls == 0
    assert session.items == [call]


# ------------------------------------------------------------------- list_runs


@pytest.fixture(params=["memory", "sqlite"])
def open_store(request: pytest.FixtureRequest,
               tmp_path: Path) -> Iterator[Callable[[], IndexedStore]]:
    """Opens the store (again, for SQLite: a reload from the file)."""
    opened: list[SQLiteEventStore] = []
    memory = MemoryEventStore()

    def make() -> IndexedStore:
        if request.param == "memory":
            return memory
        store = SQLiteEventStore(tmp_path / "events.db")
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()


def _heads(store: IndexedStore, run_ids: list[str]) -> tuple[RunHead, ...]:
    """What the heads of these runs must be: read off the runs loaded from ``store``."""
    heads = []
    for run_id in sorted(run_ids):
        c = RunController.load(store, run_id)
        heads.append(RunHead(run_id, c.version, c.step, c.session_id, None,
                             c.events[-1].at,  # the newest event's time
                             blocker=c.blocker, waiting=c.waiting))
    return tuple(heads)


def _four_runs(store: IndexedStore) -> None:
    at_interruption(store=store, run_id="a")  # session-1, INTERRUPTION
    staged(store=store)  # "run-1": session-1, UNSETTLED
    RunController.start(run_id="c", session_id="session-2", store=store)  # RUN_AGAIN
    RunController.start(run_id="d", session_id=None, store=store)


def test_list_runs_filters_by_session_and_step(
    open_store: Callable[[], IndexedStore]
) -> None:
    store = open_store()
    assert isinstance(store, IndexedStore)
    _four_runs(store)
    a, c, d, run_1 = _heads(store, ["a", "c", "d", "run-1"])
    assert (a.step, c.step, d.step, run_1.step) == (
        Step.INTERRUPTION, Step.RUN_AGAIN, Step.RUN_AGAIN, Step.UNSETTLED)
    for s in (store, open_store()):  # and, for SQLite, a reload from the file
        assert s.list_runs() == (a, c, d, run_1)
        assert s.list_runs(session_id=SESSION) == (a, run_1)
        assert s.list_runs(steps={Step.UNSETTLED}) == (run_1,)
        assert s.list_runs(session_id=SESSION, steps=[Step.RUN_AGAIN, Step.INTERRUPTION]) == (
            a,)
        assert s.list_runs(session_id="session-2", steps=(Step.UNSETTLED,)) == ()
        assert s.list_runs(session_id="nobody") == ()
        assert s.list_runs(steps=()) == ()
        with pytest.raises(TypeError):
            s.list_runs(steps=["unsettled"])  # type: ignore[list-item]


def test_heads_follow_every_append_and_a_reload(open_store: Callable[[], IndexedStore]) -> None:
    store = open_store()
    c = staged(store=store)
    assert store.list_runs() == _heads(store, ["run-1"])
    c.publication_committed()  # settled: out of the UNSETTLED index at once
    assert store.list_runs(steps={Step.UNSETTLED}) == ()
    loaded = RunController.load(open_store(), "run-1")
    loaded.claim("worker-7")
    loaded.approve("notify")
    (head,) = open_store().list_runs(session_id=SESSION)
    again = RunController.load(open_store(), "run-1")
    assert head == RunHead("run-1", again.version, Step.INTERRUPTION, SESSION, "worker-7",
                           again.events[-1].at, blocker=again.blocker,
                           waiting=again.waiting)
    assert again.version == loaded.version


def test_direct_appends_without_a_step_are_folded_when_listed(
    open_store: Callable[[], IndexedStore]
) -> None:
    source = staged()
    source.claim("worker-1")
    events = list(source.events)
    store = open_store()
    store.append("run-1", events[:3], 0)  # a new run: its head is folded from these
    store.append("run-1", events[3:], 3)  # no step given: unfolded until listed
    expected = RunHead("run-1", len(events), Step.UNSETTLED, SESSION, "worker-1",
                       events[-1].at, blocker=source.blocker, waiting=source.waiting)
    assert store.list_runs(session_id=SESSION, steps={Step.UNSETTLED}) == (expected,)
    assert open_store().list_runs() == (expected,)
    c = RunController.load(store, "run-1")
    c.abandon("done")  # a step given again: the head moves with it
    assert open_store().list_runs() == (
        RunHead("run-1", c.version, Step.TERMINAL_UNRECOVERABLE, SESSION, "worker-1",
                c.events[-1].at, blocker=c.blocker, waiting=c.waiting),)


def test_a_database_made_before_the_run_index_gets_one(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    first = SQLiteEventStore(path)
    _four_runs(first)
    claimed = RunController.load(first, "a")
    claimed.claim("worker-3")
    expected = first.list_runs()
    assert expected[0].owner == "worker-3"
    first.close()
    with sqlite3.connect(path) as raw:
        raw.execute("DROP TABLE runs")  # as an older version left it
    legacy = SQLiteEventStore(path)
    assert legacy.list_runs(session_id=SESSION, steps={Step.UNSETTLED}) == (expected[-1],)
    assert legacy.list_runs() == expected
    RunController.load(legacy, "c").begin_model_call()
    (c,) = SQLiteEventStore(path).list_runs(session_id="session-2")
    assert (c.version, c.step) == (expected[1].version + 1, Step.AWAITING_MODEL)
    # a run an older writer logs now, without a head, gets one on its next append here
    older = at_interruption(run_id="e")
    older.claim("worker-9")
    with sqlite3.connect(path) as raw:
        raw.executemany("INSERT INTO events VALUES (?, ?, 'older', ?)", [
            ("e", event.seq, json.dumps(codec.encode_event(event))) for event in older.events])
    RunController.load(legacy, "e").approve("charge")
    e = RunController.load(legacy, "e")
    assert SQLiteEventStore(path).list_runs(session_id=SESSION)[1] == (
        RunHead("e", e.version, Step.INTERRUPTION, SESSION, "worker-9", e.events[-1].at,
                blocker=e.blocker, waiting=e.waiting))
    legacy.close()


# ----------------------------------------------------------- the wrong Session


@pytest.mark.invariant("I7")
def test_publish_refuses_a_session_that_is_not_the_runs() -> None:
    c = at_interruption()
    run_charge(c)
    other = MemorySession("session-2", [{"role": "user", "content": "someone else's"}])
    before = snapshot(c)
    with pytest.raises(ReconcileRejected) as info:
        asyncio.run(publish(c, other, B, call_ids=["charge", "audit"]))
    assert "'session-2'" in str(info.value)
    assert repr(SESSION) in str(info.value)
    assert snapshot(c) == before  # nothing recorded
    assert asyncio.run(other.get_items()) == [{"role": "user", "content": "someone else's"}]
    with pytest.raises(ReconcileRejected):  # before it reads the Session at all
        asyncio.run(publish(c, Untouchable("session-2"), B,
                            call_ids=["charge", "audit"]))
    assert snapshot(c) == before


@pytest.mark.invariant("I7")
def test_settle_refuses_a_session_that_is_not_the_runs() -> None:
    c = reloaded(staged())
    before = snapshot(c)
    with pytest.raises(ReconcileRejected) as info:
        asyncio.run(settle(c, Untouchable("session-2")))
    assert "'session-2'" in str(info.value)
    assert repr(SESSION) in str(info.value)
    assert snapshot(c) == before


def test_a_run_without_a_session_publishes_only_into_its_private_history() -> None:
    c = RunController.start(run_id="private", session_id=None)
    c.add_input([{"role": "user", "content": "hi"}])
    before = snapshot(c)
    with pytest.raises(ReconcileRejected, match="'session-1'"):
        asyncio.run(publish(c, MemorySession(SESSION), [{"role": "user", "content": "hi"}]))
    assert snapshot(c) == before
    local = MemorySession(None)  # type: ignore[arg-type]
    asyncio.run(publish(c, local, [{"role": "user", "content": "hi"}]))
    assert c.step is Step.RUN_AGAIN
    assert asyncio.run(local.get_items()) == [{"role": "user", "content": "hi"}]


@pytest.mark.invariant("I7")
@pytest.mark.parametrize("kind", ["memory", "none"])
def test_a_session_without_an_id_is_refused_before_a_run_starts(kind: str) -> None:
    """A Session object whose ``session_id`` is None would start a run without a Session
    that still writes its input there and never its final output (a run without a
    Session completes without publishing): refused before anything is recorded, the
    model never called, the Session untouched."""
    store = MemoryEventStore() if kind == "memory" else None
    model = ScriptedModel([ModelResponse(output="hello")])
    session = ListSession(None)  # type: ignore[arg-type]
    with pytest.raises(ControlError, match="session_id"):
        asyncio.run(Runner.run(Agent("greeter", model), "hello", session=session,
                               store=store, run_id="nameless"))
    assert model.calls == 0
    assert session.items == []
    if store is not None:
        assert store.load("nameless") == []
        assert store.list_runs() == ()
