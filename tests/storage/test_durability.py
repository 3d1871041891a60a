"""Durability at effect boundaries (DESIGN §6.7): a controller bound to a store may buffer
its events (``buffered=True``, always so with an async store) and append them as one
transaction per flush; the reference runner flushes after a claim, before a model call,
before a tool runs, before every Session write, and at the end of an attempt, and a
runner flushes before it acknowledges a human decision.

1. The buffer itself (memory and SQLite stores): nothing is appended until a flush; one
   flush is one ``append`` carrying every buffered event at the right expected version;
   of two buffered controllers loaded at one version the first flush wins and the other
   refuses everything until reloaded; a flush that was not written keeps its events for
   the next one; a long buffered run loads through snapshots (taken at batch starts)
   equal to a full replay; the async SQLite store never runs SQLite on the event loop.
2. "An effect never precedes the durable record that allows it": the tool, the model and
   the Session of the seed scenario (approval, tool, a failed write, its recovery) read
   the *durable* log (a read-only store on the same file) when called, and each finds
   the record that allows it; the transactions per scenario are counted and compared
   with the per-command mode.
3. kill -9 between any record and its flush: forked driver processes
   (`tests.drivers.durability_driver`) die with SIGKILL at every boundary of a buffered run and
   at random ones, and are restarted until the run ends: the paying tool never runs
   twice, an acknowledged decision is never lost, no committed event is lost, and every
   run completes or fails closed with `ToolInDoubt`. Two modes alternate: a sync SQLite
   store with ``buffered=True`` and the async SQLite store. ``DURABILITY_TRIALS``
   (default: one trial per boundary, 88; twice that kills each boundary in each mode)
   and ``DURABILITY_SEED`` choose the trials; run with ``-s`` for the figures.
   ``CRASH_DIR`` as for tests/runner/test_crash_hooks.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest

from statemachine import (
    ConcurrencyConflict,
    MemoryEventStore,
    RunController,
    SQLiteEventStore,
    Step,
    codec,
)
from statemachine import events as ev
from statemachine.blocker import ReadModel
from statemachine.errors import InvalidTransition, StorageError
from statemachine.machine import replay
from statemachine.payloads import JSON
from statemachine.runner import Agent, FunctionTool, ModelResponse, Runner
from statemachine.sessions import MemorySession, Session, SQLiteSession
from statemachine.state import RunState
from statemachine.stores import (
    SNAPSHOT_EVERY,
    AsyncSQLiteEventStore,
    EventStore,
    SessionWrite,
    Snapshot,
)
from statemachine.testing import (
    Counters,
    CountingHooks,
    FlakySession,
    InjectedWriteError,
    ScriptedModel,
    check_log,
    counted_tool,
)
from statemachine.testing.contracts import at_interruption
from statemachine.values import Phase
from tests.drivers import durability_driver as driver
from tests.helpers import SESSION, TEST_NOW, B, P, assert_refused, crash_folder, run_charge

# ------------------------------------------------------------- recording stores


@attrs.define
class Appended:
    """One ``append`` call a store received."""

    events: tuple[ev.Event, ...]
    expected_version: int
    snapshot: Snapshot | None


@attrs.define
class Record:
    """What a store saw: every append call (in order), the threads that called it, and
    failures to raise on the next appends (nothing is written then)."""

    appends: list[Appended] = attrs.field(factory=list)
    threads: set[int] = attrs.field(factory=set)
    thread_names: set[str] = attrs.field(factory=set)
    fail_next: list[StorageError] = attrs.field(factory=list)

    def called(self) -> None:
        self.threads.add(threading.get_ident())
        self.thread_names.add(threading.current_thread().name)

    def append(self, events: Sequence[ev.Event], expected: int,
               snapshot: Snapshot | None) -> None:
        self.called()
        self.appends.append(Appended(tuple(events), expected, snapshot))
        if self.fail_next:
            raise self.fail_next.pop(0)


class RecordingMemory(MemoryEventStore):
    def __init__(self) -> None:
        super().__init__()
        self.record = Record()

    def append(self, run_id: str, events: Sequence[ev.Event], expected_version: int, *,
               snapshot: Snapshot | None = None, step: Step | None = None,
               read_model: ReadModel | None = None) -> None:
        self.record.append(events, expected_version, snapshot)
        super().append(run_id, events, expected_version, snapshot=snapshot, step=step,
                       read_model=read_model)


class RecordingSQLite(SQLiteEventStore):
    """A SQLite store that records its appends and the thread of every call."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.record = Record()

    def append(self, run_id: str, events: Sequence[ev.Event], expected_version: int, *,
               snapshot: Snapshot | None = None, step: Step | None = None,
               read_model: ReadModel | None = None,
               session_write: SessionWrite | tuple[SessionWrite, ...] | None = None) -> None:
        self.record.append(events, expected_version, snapshot)
        super().append(run_id, events, expected_version, snapshot=snapshot, step=step,
                       read_model=read_model, session_write=session_write)

    def load(self, run_id: str) -> list[ev.Event]:
        self.record.called()
        return super().load(run_id)

    def load_latest(self, run_id: str) -> tuple[Snapshot | None, list[ev.Event]]:
        self.record.called()
        return super().load_latest(run_id)

    def list_runs(self, session_id: str | None = None,
                  steps: Any = None) -> tuple[Any, ...]:
        self.record.called()
        return super().list_runs(session_id, steps)


def _recording_async(path: Path) -> tuple[AsyncSQLiteEventStore, RecordingSQLite]:
    """An `AsyncSQLiteEventStore` whose sync store records every call it runs."""
    store = AsyncSQLiteEventStore(path)
    store.sync.close()
    recording = RecordingSQLite(path)
    store.sync = recording
    return store, recording


Recording = RecordingMemory | RecordingSQLite


@pytest.fixture(params=["memory", "sqlite"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Recording]:
    if request.param == "memory":
        yield RecordingMemory()
        return
    sqlite_store = RecordingSQLite(tmp_path / "events.db")
    yield sqlite_store
    sqlite_store.close()


# ------------------------------------------------------------------ the buffer

RUN = "run-1"


def _buffered(store: EventStore) -> RunController:
    """The seed's first turn (`at_interruption`), buffered."""
    return at_interruption(store, RUN, SESSION, buffered=True)


def test_buffered_commands_append_nothing_until_one_flush_appends_them_all(
        store: Recording) -> None:
    c = _buffered(store)
    assert store.record.appends == []
    assert store.load(RUN) == []
    assert c.version == c.unflushed == 6  # started, 2 hooks, begun, responded, a hook
    c.flush()
    assert [(len(a.events), a.expected_version) for a in store.record.appends] == [(6, 0)]
    assert store.load(RUN) == list(c.events)
    assert c.unflushed == 0
    assert c.version == 6

    c.flush()  # nothing buffered: no append at all
    assert len(store.record.appends) == 1

    run_charge(c)  # approvals, resume, two tools with guardrails and hooks
    c.stage_publication(B, P, call_ids=["charge", "audit"])
    assert len(store.record.appends) == 1
    assert store.load(RUN) == list(c.events)[:6]
    assert c.unflushed == c.version - 6 == 12
    c.flush()
    second = store.record.appends[1]
    assert second.expected_version == 6
    assert [e.seq for e in second.events] == list(range(6, 18))
    assert store.load(RUN) == list(c.events)

    c.publication_committed()
    assert (c.unflushed, c.version) == (1, 19)
    loaded = RunController.load(store, RUN)
    assert loaded.version == 18  # the commit is only in this controller until it flushes
    c.flush()
    assert RunController.load(store, RUN).state == c.state
    check_log(store.load(RUN))


def test_a_run_loaded_with_buffered_true_buffers_and_one_loaded_without_appends_each(
        store: Recording) -> None:
    c = at_interruption(store, RUN, SESSION)
    assert len(store.record.appends) == c.version == 6  # per command: one append each
    assert c.unflushed == 0

    buffered = RunController.load(store, RUN, buffered=True)
    buffered.approve("charge")
    buffered.approve("audit")
    assert (buffered.unflushed, len(store.record.appends)) == (2, 6)
    buffered.flush()
    assert len(store.record.appends) == 7
    assert store.record.appends[-1].expected_version == 6

    per_command = RunController.load(store, RUN)
    per_command.reject("notify", "no")
    assert (per_command.unflushed, len(store.record.appends)) == (0, 8)
    per_command.flush()  # a no-op: nothing is buffered
    assert len(store.record.appends) == 8


@pytest.mark.invariant("I7")
def test_of_two_buffered_controllers_at_one_version_the_first_flush_wins(
        store: Recording) -> None:
    paused = _buffered(store)
    paused.flush()
    first = RunController.load(store, RUN, buffered=True)
    second = RunController.load(store, RUN, buffered=True)
    first.claim("first")
    first.approve("charge")
    second.claim("second")  # both are accepted here: nothing is appended yet
    second.reject("charge", "no")
    first.flush()
    with pytest.raises(ConcurrencyConflict) as info:
        second.flush()
    assert info.value.action == "flush"
    assert info.value.run_id == RUN
    # the store holds the winner's batch only
    log = store.load(RUN)
    assert [type(e).__name__ for e in log[6:]] == ["RunClaimed", "CallApproved"]
    assert log == list(first.events)
    # the loser refuses every command, and another flush, with nothing changed
    for command, args in ((second.approve, ("audit",)), (second.claim, ("again",)),
                          (second.resume, ()), (second.abandon, ("gave up",)),
                          (second.begin_tool, ("charge",)), (second.flush, ())):
        error = assert_refused(second, ConcurrencyConflict, command, *args)
        assert "load the run again" in str(error)
    assert second.unflushed == 2
    assert store.load(RUN) == log
    # reloaded, it goes on from the winner's log
    again = RunController.load(store, RUN, buffered=True)
    again.approve("audit")
    again.flush()
    assert store.load(RUN)[-1] == ev.CallApproved(8, "audit", again.fingerprint("audit"),
                                                   at=TEST_NOW)


def test_a_buffered_start_of_a_run_id_the_store_holds_is_refused_at_its_first_flush(
        store: Recording) -> None:
    _buffered(store).flush()
    before = store.load(RUN)
    twin = _buffered(store)  # accepted: the store is not asked until the flush
    with pytest.raises(ConcurrencyConflict, match="already exists"):
        twin.flush()
    assert store.load(RUN) == before
    assert_refused(twin, ConcurrencyConflict, twin.approve, "charge")


def test_a_flush_that_was_not_written_keeps_its_events_for_the_next_one(
        store: Recording) -> None:
    c = _buffered(store)
    c.flush()
    c.approve("charge")
    c.approve("audit")
    store.record.fail_next.append(StorageError("the disk is full", outcome="not_written"))
    with pytest.raises(StorageError) as info:
        c.flush()
    assert info.value.outcome == "not_written"
    assert info.value.action == "flush"
    assert (c.unflushed, c.version) == (2, 8)
    assert len(store.load(RUN)) == 6
    c.reject("notify", "later")  # the controller goes on: nothing was written
    c.flush()
    last = store.record.appends[-1]
    assert last.expected_version == 6
    assert [type(e).__name__ for e in last.events] == ["CallApproved", "CallApproved",
                                                       "CallRejected"]
    assert store.load(RUN) == list(c.events)
    assert c.unflushed == 0


def test_a_flush_whose_outcome_is_unknown_refuses_everything_until_reloaded(
        store: Recording) -> None:
    c = _buffered(store)
    c.flush()
    c.approve("charge")
    store.record.fail_next.append(StorageError("lost the ack", outcome="unknown"))
    with pytest.raises(StorageError):
        c.flush()
    for command, args in ((c.approve, ("audit",)), (c.flush, ()), (c.resume, ())):
        error = assert_refused(c, StorageError, command, *args)
        assert "load the run again" in str(error)
    again = RunController.load(store, RUN, buffered=True)
    assert again.version == 6  # it did not land (the wrapper raised before the store)
    again.approve("charge")
    again.flush()


def _long_agent(turns: int, counters: Counters) -> Agent:
    """A model that asks for three tools a turn for ``turns`` turns, then answers."""
    responses = [ModelResponse(tuple((f"t{turn}-{n}", "echo", {"n": n}) for n in range(3)))
                 for turn in range(turns)]
    responses.append(ModelResponse(output="done"))
    echo = counted_tool(counters, "echo", lambda n: f"echo {n}")
    return Agent("long", ScriptedModel(responses), (echo,), max_turns=turns + 1)


def test_a_long_buffered_run_loads_through_snapshots_taken_at_batch_starts(
        store: Recording) -> None:
    counters = Counters()
    agent = _long_agent(40, counters)
    result = asyncio.run(Runner.run(agent, "go", session=MemorySession(SESSION), store=store,
                                    run_id=RUN, hooks=CountingHooks(counters), buffered=True))
    c = result.controller
    assert c.step is Step.COMPLETED
    assert c.version > 600
    log = store.load(RUN)
    assert log == list(c.events)
    appends = store.record.appends
    assert sum(len(a.events) for a in appends) == len(log)
    assert len(appends) < len(log) / 3  # batches: one per model call, tool and write
    # every snapshot came with a batch, is the state at that batch's start, and records
    # the size of the log before it; they are at least SNAPSHOT_EVERY events apart
    versions = []
    for appended in appends:
        if appended.snapshot is None:
            continue
        version = appended.expected_version
        versions.append(version)
        snapshot = dict(appended.snapshot)
        size = snapshot.pop("log_bytes")
        assert snapshot == replay(RUN, log[:version]).snapshot()
        assert size == codec.log_size(RUN, log[:version])
        assert RunState.restore(snapshot) == replay(RUN, log[:version])
    assert len(versions) >= 2
    assert all(b - a >= SNAPSHOT_EVERY for a, b in zip([0, *versions], versions, strict=False))
    # loading goes through the newest snapshot, and equals the full replay
    latest, tail = store.load_latest(RUN)
    assert latest is not None
    assert len(tail) == len(log) - versions[-1]
    through = RunController.load(store, RUN)
    whole = RunController.load(store, RUN, snapshot=False)
    assert through.state == whole.state == c.state == replay(RUN, log)
    assert through.version == whole.version == len(log)
    assert through.events == whole.events == c.events
    check_log(log)


def test_the_async_sqlite_store_never_runs_sqlite_on_the_event_loop(tmp_path: Path) -> None:
    store, recording = _recording_async(tmp_path / "events.db")
    counters = Counters()
    charge = counted_tool(counters, "charge", lambda x: f"charged {x}", needs_approval=True,
                          guarded=True)
    model = ScriptedModel([ModelResponse((("charge", "charge", {"x": 7}),)),
                           ModelResponse(output="charged")])
    agent = Agent("billing", model, (charge,))
    session = MemorySession(SESSION)
    hooks = CountingHooks(counters)

    async def go() -> tuple[int, RunController]:
        loop_thread = threading.get_ident()
        first = await Runner.run(agent, "charge 7", session=session,
                                 store=store,  # async: buffered
                                 run_id=RUN, hooks=hooks)
        assert first.step is Step.INTERRUPTION
        assert first.controller.unflushed == 0  # flushed at the end of the attempt
        decided = await RunController.load_async(store, RUN)
        decided.approve("charge", fingerprint=decided.fingerprint("charge"))
        assert decided.unflushed == 1
        with pytest.raises(InvalidTransition, match="flush_async"):
            decided.flush()  # an async store is never written from the loop's thread
        await decided.flush_async()  # the decision is durable before it is acknowledged
        second = await Runner.run(agent, session=session,
                                  store=store,  # async: buffered
                                  run_id=RUN, hooks=hooks, owner="resumer")
        assert second.step is Step.COMPLETED
        reloaded = await RunController.load_async(store, RUN, snapshot=False)
        await store.close()
        return loop_thread, reloaded

    loop_thread, reloaded = asyncio.run(go())
    assert recording.record.threads, "the store was never called"
    assert loop_thread not in recording.record.threads
    assert {name.split("_")[0] for name in recording.record.thread_names} == {
        "statemachine-sqlite"}
    assert counters.tools["charge"] == 1
    assert reloaded.step is Step.COMPLETED
    log = SQLiteEventStore(tmp_path / "events.db", readonly=True).load(RUN)
    assert log == list(reloaded.events)
    check_log(log)
    # one transaction per boundary: the attempt's publications, model calls, the tool,
    # the decision, the claim, the ends of the attempts
    assert len(recording.record.appends) < len(log) / 2


# ------------------------------- an effect never precedes the durable record (§6.7)


class Durable:
    """The durable log: read through a separate read-only store on the store's file, as
    another process would see it after a crash of this one. Every effect checks it, and
    a finding is kept (a tool's error would become its output, not fail the test)."""

    def __init__(self, path: Path, run_id: str) -> None:
        self.path = path
        self.run_id = run_id
        self.violations: list[str] = []
        self.checked: Counter[str] = Counter()

    def state(self) -> RunState:
        reader = SQLiteEventStore(self.path, readonly=True)
        try:
            return replay(self.run_id, reader.load(self.run_id))
        finally:
            reader.close()

    def expect(self, effect: str, ok: bool, seen: str) -> None:
        self.checked[effect] += 1
        if not ok:
            self.violations.append(f"{effect} ran while the durable log showed {seen}")

    def tool(self, call_id: str) -> None:
        s = self.state()
        record = s.calls.get(call_id)
        phase = None if record is None else record.phase
        self.expect(f"tool {call_id}", phase is Phase.STARTED, f"phase {phase}")

    def model(self) -> None:
        """Counted, not checked: a model call needs no durable record first (DESIGN
        §7.7; a crash before its response calls the model again)."""
        self.checked["model"] += 1

    def write(self, items: list[JSON]) -> None:
        s = self.state()
        envelope = s.envelope
        ok = (s.attempt_seq is not None and envelope is not None
              and list(envelope.items) == items)
        self.expect("session write", ok,
                    f"attempt {s.attempt_seq}, envelope {envelope and envelope.items}")


class CheckedSession:
    """A Session whose every write first checks the durable log (staged or reconciled
    with exactly these items, attempt open), then goes to ``inner`` (which may fail)."""

    def __init__(self, inner: Session, durable: Durable) -> None:
        self.inner = inner
        self.session_id = inner.session_id
        self.durable = durable
        self.writes = 0

    async def get_items(self, limit: int | None = None) -> list[JSON]:
        return await self.inner.get_items(limit)

    async def add_items(self, items: list[JSON]) -> None:
        self.writes += 1
        self.durable.write(items)
        await self.inner.add_items(items)

    async def pop_item(self) -> JSON | None:
        return await self.inner.pop_item()

    async def clear_session(self) -> None:
        await self.inner.clear_session()


class CheckedModel(ScriptedModel):
    def __init__(self, responses: Sequence[ModelResponse], durable: Durable) -> None:
        super().__init__(responses)
        self.durable = durable

    async def respond(self, history: list[JSON], agent: Agent) -> ModelResponse:
        self.durable.model()
        return await super().respond(history, agent)


MODES = ["per-command", "buffered", "async"]


@attrs.define
class SeedWorld:
    """The seed scenario on SQLite, in one of three durability modes."""

    mode: str
    durable: Durable
    counters: Counters
    agent: Agent
    session: SQLiteSession
    store: Any
    record: Record
    attempts: int = 0
    decisions: int = 0

    @classmethod
    def make(cls, tmp_path: Path, mode: str) -> SeedWorld:
        path = tmp_path / "events.db"
        durable = Durable(path, "seed")
        counters = Counters()

        def checked(call_id: str, output: Callable[..., JSON]) -> Callable[..., JSON]:
            def run(**arguments: Any) -> JSON:
                durable.tool(call_id)
                return output(**arguments)
            return run

        tools = (counted_tool(counters, "charge", checked("charge", lambda x: f"charged {x}"),
                              needs_approval=True, guarded=True),
                 counted_tool(counters, "notify", checked("notify", lambda: "notified"),
                              needs_approval=True))
        model = CheckedModel([
            ModelResponse((("charge", "charge", {"x": 7}), ("notify", "notify", {}))),
            ModelResponse(output="charged and notified"),
        ], durable)
        store: Any
        if mode == "async":
            store, recording = _recording_async(path)
        else:
            store = recording = RecordingSQLite(path)
        return cls(mode, durable, counters, Agent("billing", model, tools),
                   SQLiteSession("seed-session", tmp_path / "session.db"), store,
                   recording.record)

    async def attempt(self, session: Session, input: str | None = None) -> RunController:
        self.attempts += 1
        result = await Runner.run(self.agent, input, session=CheckedSession(session,
                                                                            self.durable),
                                  store=self.store, run_id="seed",
                                  hooks=CountingHooks(self.counters),
                                  buffered=self.mode == "buffered")
        return result.controller

    async def load(self) -> RunController:
        if self.mode == "async":
            return await RunController.load_async(self.store, "seed")
        return RunController.load(self.store, "seed", buffered=self.mode == "buffered")


async def _seed_scenario(world: SeedWorld, outcome: str) -> RunController:
    """Run to the approvals; approve (durable before acknowledged); resume through a
    write that fails with ``outcome``; recover with a new attempt."""
    paused = await world.attempt(world.session, "charge 7 and notify me")
    assert paused.step is Step.INTERRUPTION
    c = await world.load()
    for call_id in c.pending_approvals:
        c.approve(call_id, fingerprint=c.fingerprint(call_id))
    await c.flush_async()  # then the decisions may be acknowledged
    world.decisions += 1
    durable = world.durable.state()
    assert all(durable.calls[i].phase is Phase.APPROVED for i in ("charge", "notify"))
    flaky = FlakySession(world.session, fail_on=1, outcome=outcome)  # type: ignore[arg-type]
    with pytest.raises(InjectedWriteError):
        await world.attempt(flaky)
    recovered = await world.attempt(world.session)
    assert recovered.step is Step.COMPLETED
    return recovered


def _transactions(world: SeedWorld, log: list[ev.Event]) -> tuple[int, int]:
    """The scenario's transactions (append calls), and the bound for a buffered run: one
    per effect boundary (each effect, each claim, each acknowledged decision) plus the
    flush that ends each attempt."""
    boundaries = (sum(world.durable.checked.values()) + world.decisions
                  + (world.attempts - 1) + world.attempts)
    return len(world.record.appends), boundaries


@pytest.mark.parametrize("outcome", ["atomic", "commit_then_raise"])
@pytest.mark.parametrize("mode", MODES)
def test_an_effect_never_precedes_the_durable_record_that_allows_it(
        tmp_path: Path, mode: str, outcome: str) -> None:
    world = SeedWorld.make(tmp_path, mode)
    asyncio.run(_seed_scenario(world, outcome))
    durable = world.durable
    assert durable.violations == []
    # every effect was checked: two tools, two model calls, and the Session writes
    # (input, the failed batch, its re-write when nothing landed, the final batch)
    writes = 4 if outcome == "atomic" else 3
    assert durable.checked == Counter({"tool charge": 1, "tool notify": 1, "model": 2,
                                       "session write": writes})
    assert world.counters.tools == Counter({"charge": 1, "notify": 1})
    items = asyncio.run(world.session.get_items())
    outputs = [i["call_id"] for i in items if i.get("type") == "function_call_output"]
    assert outputs == ["charge", "notify"]
    log = SQLiteEventStore(tmp_path / "events.db", readonly=True).load("seed")
    check_log(log)
    transactions, boundaries = _transactions(world, log)
    if mode == "per-command":
        assert transactions == len(log)
    else:
        assert transactions <= boundaries


def test_transactions_per_scenario_buffered_against_per_command(tmp_path: Path) -> None:
    """The seed scenario's transactions in each mode (run with ``-s`` to see them)."""
    for outcome in ("atomic", "commit_then_raise"):
        counted = {}
        for mode in MODES:
            folder = tmp_path / f"{outcome}-{mode}"
            folder.mkdir()
            world = SeedWorld.make(folder, mode)
            asyncio.run(_seed_scenario(world, outcome))
            log = SQLiteEventStore(folder / "events.db", readonly=True).load("seed")
            counted[mode] = (*_transactions(world, log), len(log))
        (per_command, _, events), (buffered, bound, _), (asynchronous, _, _) = (
            counted[mode] for mode in MODES)
        assert per_command == events
        assert buffered == asynchronous <= bound
        assert buffered < per_command / 2
        print(f"\nseed scenario ({outcome} failed write, then recovery; 3 attempts): "
              f"{events} events; transactions: per command {per_command}, buffered "
              f"{buffered}, async store {asynchronous} (bound: {bound} boundaries)")


# A run that buffers its events appends them at each effect boundary: whatever the run
# recorded before a model call, a tool, a Session write or a post is in the store when
# that effect happens (a crash during the effect must find its announcement in the log).
# LP03, LP04, PU03.


def _stored(store: MemoryEventStore, run_id: str, kind: type[ev.Event]) -> int:
    return sum(type(e) is kind for e in store.load(run_id))


class _WatchedModel(ScriptedModel):
    def __init__(self, store: MemoryEventStore, responses: list[ModelResponse]) -> None:
        super().__init__(responses)
        self.store = store
        self.begun_when_called: list[int] = []

    async def respond(self, history: list[JSON], agent: Agent) -> ModelResponse:
        self.begun_when_called.append(_stored(self.store, "durable", ev.ModelCallBegun))
        return await super().respond(history, agent)


class _WatchedSession(MemorySession):
    def __init__(self, store: MemoryEventStore) -> None:
        super().__init__(SESSION)
        self.store = store
        self.staged_when_written: list[int] = []

    async def add_items(self, items: list[JSON]) -> None:
        self.staged_when_written.append(_stored(self.store, "durable", ev.PublicationStaged))
        await super().add_items(items)


def test_a_buffered_run_is_durable_at_every_effect() -> None:
    store = MemoryEventStore()
    started_when_run: list[int] = []

    def pay(x: int) -> str:
        started_when_run.append(_stored(store, "durable", ev.ToolStarted))
        return f"paid {x}"

    model = _WatchedModel(store, [ModelResponse((("p1", "pay", {"x": 1}),)),
                                  ModelResponse((("p2", "pay", {"x": 2}),)),
                                  ModelResponse(output="done")])
    session = _WatchedSession(store)
    agent = Agent("a", model, (FunctionTool("pay", pay),))
    result = asyncio.run(Runner.run(agent, "pay twice", session=session, store=store,
                                    run_id="durable", buffered=True))
    assert result.step is Step.COMPLETED
    # a model call needs no flush of its own (DESIGN §7.7): the k-th call finds the k-1
    # before it durable, its own begin riding with the start of the tool it proposes
    assert model.begun_when_called == [0, 1, 2]
    assert started_when_run == [1, 2]
    # input, two tool batches, the final output: the k-th write finds k staged
    assert session.staged_when_written == [1, 2, 3, 4]


# ------------------------------------------------------- kill -9 between record and flush

TRIALS = int(os.environ.get("DURABILITY_TRIALS", "0"))
"""0: one trial per boundary (88), the modes alternating."""
SEED = int(os.environ.get("DURABILITY_SEED", "0"))
MAX_KILLS = 4


@pytest.fixture(scope="module")
def kill_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with crash_folder(tmp_path_factory, "durability") as root:
        yield root


@attrs.frozen
class Reference:
    ticks: tuple[str, ...]
    effects: Counter[str]
    session: list[Any]


@pytest.fixture(scope="module")
def references(kill_root: Path) -> dict[str, Reference]:
    found = {}
    for mode in driver.MODES:
        folder = kill_root / f"reference-{mode}"
        folder.mkdir()
        result = driver.fork(folder, mode, None)
        assert result is not None
        assert result["outcome"] == "completed", result
        effects = driver.effects(folder)
        assert set(effects.values()) == {1}, effects
        assert driver.violations(folder) == []
        log = driver.log(folder)
        check_log(log)
        ticks = tuple(result["ticks"])
        # every kind of boundary is there to be hit
        kinds = {tick.split(" ")[0] for tick in ticks}
        assert kinds == {"record", "flush-before", "flush-after", "effect", "session-before",
                         "session-after", "acked"}, kinds
        found[mode] = Reference(ticks, effects, driver.session_items(folder))
    assert found["buffered"].ticks == found["async"].ticks  # the same boundaries
    return found


@attrs.frozen
class KillTrial:
    mode: str
    first_kill: str
    kills: int
    outcome: str
    effects: Counter[str]


def _kill_trial(folder: Path, index: int, references: dict[str, Reference]) -> KillTrial:
    folder.mkdir()
    modes = tuple(references)
    total = len(references[modes[0]].ticks)  # every mode crosses the same boundaries
    # the first kill walks every boundary in turn, the mode alternating (and swapped on
    # the next walk, so two walks kill each boundary in each mode)
    mode = modes[(index + index // total) % len(modes)]
    reference = references[mode]
    rng = random.Random(f"{SEED}:{index}")
    first = index % total + 1
    first_kill = f"{first} {reference.ticks[first - 1]}"
    where = f"trial {index} ({mode}), first kill at tick {first_kill}"
    kill_at: int | None = first
    kills = 0
    committed: list[ev.Event] = []
    result: dict[str, Any] | None = None
    while result is None:
        result = driver.fork(folder, mode, kill_at)
        events = driver.log(folder)
        # no committed event lost: every process's log starts with the one before it
        assert events[: len(committed)] == committed, (where, kills)
        committed = events
        # no acknowledged decision lost: the log holds every approval acknowledged
        approved = {e.call_id for e in events if isinstance(e, ev.CallApproved)}
        assert driver.acked(folder) <= approved, (where, kills)
        if result is None:
            kills += 1
            kill_at = (rng.randint(1, total) if kills < MAX_KILLS and rng.random() < 0.5
                       else None)
    assert kills >= 1, f"{where}: the first process was not killed"
    assert driver.violations(folder) == [], where
    effects = driver.effects(folder)
    assert effects["tool pay"] <= 1, (where, effects)  # the paying tool never runs twice
    check_log(committed)
    if result["outcome"] == "completed":
        assert effects["tool pay"] == 1, where
        assert set(effects) == set(reference.effects), where
        assert driver.session_items(folder, mode) == reference.session, where
        # (a kill between the approval's flush and its acknowledgement leaves it durable
        # and unacknowledged: the restarted run goes on without asking again)
        assert driver.acked(folder) <= {"pay"}, where
    else:  # fails closed, naming the paying tool
        assert (result["outcome"], result.get("call_id")) == ("in_doubt", "pay"), (where,
                                                                                  result)
        assert replay(driver.RUN_ID, committed).calls["pay"].phase is Phase.STARTED, where
    for name, count in effects.items():
        assert name in reference.effects, (where, name)
        assert count <= 1 + kills, (where, name, count)
    again = driver.fork(folder, mode, None)  # one more restart agrees, and runs nothing
    assert again is not None
    assert again["outcome"] == result["outcome"], where
    assert driver.effects(folder) == effects, where
    return KillTrial(mode, first_kill, kills, result["outcome"], effects)


@pytest.fixture(scope="module")
def shared_reference(kill_root: Path) -> dict[str, Reference]:
    folder = kill_root / "reference-shared"
    folder.mkdir()
    result = driver.fork(folder, driver.SHARED, None)
    assert result is not None
    assert result["outcome"] == "completed", result
    assert set(driver.effects(folder).values()) == {1}
    assert driver.violations(folder) == []
    check_log(driver.log(folder))
    ticks = tuple(result["ticks"])
    kinds = {tick.split(" ")[0] for tick in ticks}
    # no Session write of its own: each one is the store's append
    assert kinds == {"record", "flush-before", "flush-after", "effect", "acked"}, kinds
    return {driver.SHARED: Reference(ticks, driver.effects(folder),
                                     driver.session_items(folder, driver.SHARED))}


@pytest.mark.invariant("I1", "I3", "I11")
def test_kill_9_with_the_session_in_the_stores_file(shared_reference: dict[str, Reference],
                                                    kill_root: Path) -> None:
    """The same walk with the Session's items written in the store's append (one
    transaction for a publication's staging, items and commit): a first kill at every
    boundary, then random kills, and nothing lost, doubled, or run ahead of its record."""
    total = len(shared_reference[driver.SHARED].ticks)
    count = TRIALS or total
    trials = [_kill_trial(kill_root / f"shared-{i}", i, shared_reference)
              for i in range(count)]
    outcomes = Counter(t.outcome for t in trials)
    assert outcomes["completed"] > 0
    assert outcomes["in_doubt"] > 0
    assert set(outcomes) <= {"completed", "in_doubt"}
    assert all(t.effects["tool pay"] <= 1 for t in trials)
    if count >= total:
        hit = {t.first_kill.split(" ", 1)[1] for t in trials}
        assert hit == set(shared_reference[driver.SHARED].ticks)


def _reruns(trial: KillTrial) -> int:
    """Extra runs of hooks and guardrails: a crash re-runs each one whose record had not
    been flushed yet (each at most once per crash)."""
    return sum(n - 1 for name, n in trial.effects.items()
               if name.startswith(("hook ", "guardrail ")))


@pytest.mark.invariant("I1", "I11")
def test_kill_9_between_any_record_and_its_flush(references: dict[str, Reference],
                                                 kill_root: Path) -> None:
    started = time.monotonic()
    total = len(references["buffered"].ticks)
    count = TRIALS or total
    trials = [_kill_trial(kill_root / f"trial-{i}", i, references) for i in range(count)]
    elapsed = time.monotonic() - started
    outcomes = Counter(t.outcome for t in trials)
    first_kinds = Counter(t.first_kill.split(" ")[1] for t in trials)
    assert outcomes["completed"] > 0
    assert outcomes["in_doubt"] > 0
    assert set(outcomes) <= {"completed", "in_doubt"}
    if count >= total:  # every boundary was hit by a first kill
        hit = {t.first_kill.split(" ", 1)[1] for t in trials}
        assert hit == set(references["buffered"].ticks)
    if count >= 2 * total:  # in each mode
        for mode, reference in references.items():
            hit = {t.first_kill.split(" ", 1)[1] for t in trials if t.mode == mode}
            assert hit == set(reference.ticks), mode
    figures = {
        "trials": len(trials),
        "boundaries": {mode: len(r.ticks) for mode, r in references.items()},
        "kills": sum(t.kills for t in trials),
        "first_kill_by_boundary_kind": dict(first_kinds.most_common()),
        "tool_duplicates": sum(t.effects["tool pay"] > 1 for t in trials),
        "model_call_reruns": sum(n - 1 for t in trials for name, n in t.effects.items()
                                 if name.startswith("model ")),
        "hook_or_guardrail_reruns": sum(_reruns(t) for t in trials),
        "max_hook_or_guardrail_reruns_per_crash": max(_reruns(t) / t.kills for t in trials),
        "completed": outcomes["completed"],
        "tool_in_doubt": outcomes["in_doubt"],
        "seconds": round(elapsed, 1),
    }
    print("\nkill -9 between record and flush:", json.dumps(figures, indent=1))


def test_the_kill_test_catches_a_runner_that_skips_the_flush_before_a_tool(
        kill_root: Path) -> None:
    """The test of the test: a controller whose flush before a tool does nothing
    (`durability_driver.SkipsFlushBeforeTools`) lets the paying tool run before its
    start is durable. The tool's own check notes it; a kill inside the tool makes the
    restarted run pay again."""
    reference = kill_root / "broken-reference"
    reference.mkdir()
    result = driver.fork(reference, "buffered", None, broken=True)
    assert result is not None
    assert result["outcome"] == "completed"
    assert [line.split(" ran ")[0] for line in driver.violations(reference)] == [
        "tool lookup", "tool pay"]
    inside = result["ticks"].index("effect tool pay") + 1
    folder = kill_root / "broken"
    folder.mkdir()
    assert driver.fork(folder, "buffered", inside, broken=True) is None
    again = driver.fork(folder, "buffered", None, broken=True)
    assert again is not None
    assert again["outcome"] == "completed"
    assert driver.effects(folder)["tool pay"] == 2  # what the real runner never does
