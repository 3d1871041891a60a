"""The contract suites every event store and every Session backend passes (DESIGN §6.9).

One abstract test class per contract, subclassed once per backend (the eventsourcing
way): a new backend passes the same suite, or it is not done. pytest collects the
subclasses you name ``Test*``; the bases here are not collected::

    from statemachine.testing.contracts import EventStoreContract, SessionContract

    class TestMyStore(EventStoreContract):
        def make_store(self, tmp_path):
            return MyStore(tmp_path / "events")

    class TestMySession(SessionContract):
        def make_session(self, tmp_path, session_id):
            return MySession(session_id, tmp_path / "session")

An `AsyncEventStore` runs the same event-store suite through `AsyncStoreAdapter` (its
coroutines driven on a private event loop in a background thread, behind the sync
protocol): subclass `AsyncEventStoreContract` and override ``make_async_store``::

    class TestMyAsyncStore(AsyncEventStoreContract):
        def make_async_store(self, tmp_path):
            return MyAsyncStore(tmp_path / "events")

A backend whose objects have ``close()`` is closed after each test (an async store's
``close()`` is awaited). Needs the ``testing`` extra (pytest, Hypothesis).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
import uuid
from collections.abc import Callable, Collection, Coroutine, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from statemachine import controller as controller_module
from statemachine import events as ev
from statemachine.blocker import ReadModel
from statemachine.controller import RunController
from statemachine.errors import ConcurrencyConflict
from statemachine.payloads import JSON
from statemachine.runner.publish import publish, settle
from statemachine.sessions import Session
from statemachine.stores import (
    AsyncEventStore,
    EventStore,
    RunHead,
    Snapshot,
    SnapshotStore,
    keeps_read_models,
)
from statemachine.testing.random_runs import random_run
from statemachine.values import (
    Acknowledge,
    Append,
    RecoveryPolicy,
    Step,
    ToolCall,
)

__all__ = ["AsyncEventStoreContract", "AsyncStoreAdapter", "EventStoreContract",
           "SessionContract"]

E = TypeVar("E", bound=BaseException)
T = TypeVar("T")


def _close(backend: object) -> None:
    close = getattr(backend, "close", None)
    if callable(close):
        close()


# ------------------------------------------------------------------ scenario kit


def at_interruption(store: EventStore | None = None, run_id: str = "run-1",
                    session_id: str = "session-1",
                    policy: RecoveryPolicy = RecoveryPolicy.RECONCILE, *,
                    buffered: bool = False) -> RunController:
    """A run paused on three approval-gated calls, ``charge``, ``notify`` and ``audit``,
    with its agent and model hooks recorded (six events): the seed's model response."""
    c = RunController.start(run_id=run_id, session_id=session_id, policy=policy,
                            store=store, buffered=buffered)
    c.hook_ran("agent_start")
    c.begin_model_call()
    c.hook_ran("model_start")
    c.model_responded([
        ToolCall("charge", "charge", {"x": 7}, needs_approval=True),
        ToolCall("notify", "notify", {}, needs_approval=True),
        ToolCall("audit", "audit", {}, needs_approval=True),
    ])
    c.hook_ran("model_end")
    return c


def _observed(c: RunController) -> tuple[Any, ...]:
    """Everything a refusal must leave as it was."""
    return (c.events, c.step, c.envelope, c.pending_approvals, c.guardrail_results,
            c.state.view(), c.holds_attempt, c.in_doubt())


def _assert_refused(c: RunController, error: type[E], command: Callable[..., Any],
                    *args: Any) -> E:
    before = _observed(c)
    with pytest.raises(error) as info:
        command(*args)
    assert _observed(c) == before, "a refused command changed the run"
    assert type(info.value) is error, f"expected {error.__name__}, got {info.value!r}"
    return info.value


# ------------------------------------------------------------------ event stores


class EventStoreContract:
    """What every `EventStore` guarantees. Override `make_store`; for a store that other
    processes can open too, override `open_again`; set ``keeps_snapshots = False`` for a
    store that is not a `SnapshotStore`."""

    keeps_snapshots: bool = True

    def make_store(self, tmp_path: Path) -> EventStore:
        """A new, empty store (it may keep its files under ``tmp_path``)."""
        raise NotImplementedError

    def open_again(self, tmp_path: Path) -> EventStore | None:
        """A second, independent handle on the store `make_store` made in ``tmp_path``
        (another connection), as another process would open it; None for a store that
        lives in one process (the two-process test is then skipped)."""
        return None

    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[EventStore]:
        store = self.make_store(tmp_path)
        yield store
        _close(store)

    def test_appends_and_loads_in_order(self, store: EventStore) -> None:
        events = [ev.RunStarted(0, "r", "s", RecoveryPolicy.RECONCILE, None, "json"),
                  ev.ModelCallBegun(1)]
        store.append("r", events[:1], 0)
        store.append("r", events[1:], 1)
        assert store.load("r") == events
        assert store.load("unknown") == []

    def test_a_batch_lands_whole(self, store: EventStore) -> None:
        c = at_interruption()
        store.append("run-1", c.events, 0)
        assert store.load("run-1") == list(c.events)

    def test_a_moved_version_conflicts_and_writes_nothing(self, store: EventStore) -> None:
        c = at_interruption(store=store)
        before = store.load("run-1")
        for version in (0, len(before) - 1, len(before) + 1):
            with pytest.raises(ConcurrencyConflict):
                store.append("run-1", [ev.ModelCallBegun(version)], version)
        assert store.load("run-1") == before == list(c.events)

    def test_runs_are_independent(self, store: EventStore) -> None:
        a = at_interruption(store=store, run_id="a")
        b = at_interruption(store=store, run_id="b")
        a.approve("charge")
        assert store.load("b") == list(b.events)
        assert store.load("a") == list(a.events)

    def test_a_loaded_run_equals_the_live_one(self, store: EventStore) -> None:
        c = at_interruption(store=store)
        c.approve("charge", fingerprint=c.fingerprint("charge"))
        loaded = RunController.load(store, "run-1")
        assert loaded.state == c.state
        assert loaded.events == c.events

    def test_snapshot_plus_tail_equals_full_replay(self, store: EventStore,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
        if not self.keeps_snapshots:
            pytest.skip("this store keeps no snapshots")
        assert isinstance(store, SnapshotStore)
        monkeypatch.setattr(controller_module, "SNAPSHOT_EVERY", 3)

        @settings(max_examples=25, suppress_health_check=list(HealthCheck))
        @given(st.data())
        def check(data: st.DataObject) -> None:
            run_id = f"snap-{uuid.uuid4().hex}"
            c = random_run(data, max_steps=30, run_id=run_id, store=store)
            snapshot, tail = store.load_latest(run_id)
            loaded = RunController.load(store, run_id)
            full = RunController.from_json(c.to_json())
            assert loaded.state == full.state == c.state
            assert loaded.events == full.events
            if len(full.events) > 3:
                assert snapshot is not None
                assert len(tail) < len(full.events)

        check()

    def test_two_threads_from_one_version_cannot_both_act(self, store: EventStore) -> None:
        at = at_interruption(store=store)
        racers = [RunController.load(store, "run-1") for _ in range(2)]
        barrier = threading.Barrier(2)
        outcomes: list[str] = []

        def act(c: RunController, call_id: str) -> None:
            barrier.wait()
            try:
                c.approve(call_id)
                outcomes.append("approved")
            except ConcurrencyConflict:
                outcomes.append("conflict")

        threads = [threading.Thread(target=act, args=(c, i))
                   for c, i in zip(racers, ("charge", "notify"), strict=True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(outcomes) == ["approved", "conflict"]
        winner = max(racers, key=lambda c: len(c.events))
        loser = min(racers, key=lambda c: len(c.events))
        assert RunController.load(store, "run-1").state == winner.state
        assert len(store.load("run-1")) == at.version + 1
        _assert_refused(loser, ConcurrencyConflict, loser.approve, "audit")

    def test_two_processes_from_one_version_cannot_both_act(self, store: EventStore,
                                                            tmp_path: Path) -> None:
        probe = self.open_again(tmp_path)
        if probe is None:
            pytest.skip("this store lives in one process")
        _close(probe)
        if "fork" not in multiprocessing.get_all_start_methods():
            pytest.skip("needs the fork start method")
        at = at_interruption(store=store)
        context = multiprocessing.get_context("fork")
        ready = context.Barrier(3)
        answers = context.Queue()

        def act(call_id: str) -> None:  # in the child: its own handle on the store
            try:
                other = self.open_again(tmp_path)
                assert other is not None
                c = RunController.load(other, "run-1")
                ready.wait()
                try:
                    c.approve(call_id)
                    answers.put("approved")
                except ConcurrencyConflict:
                    answers.put("conflict")
            except BaseException as error:  # reported to the test, never swallowed
                answers.put(f"error: {error!r}")

        processes = [context.Process(target=act, args=(call_id,))
                     for call_id in ("charge", "notify")]
        for p in processes:
            p.start()
        ready.wait(timeout=60)
        outputs = sorted(answers.get(timeout=60) for _ in processes)
        for p in processes:
            p.join(timeout=60)
        assert outputs == ["approved", "conflict"]
        assert len(store.load("run-1")) == at.version + 1


# ------------------------------------------------------------ async event stores


class AsyncStoreAdapter:
    """An `AsyncEventStore` behind the sync store protocol (`EventStore`, `SnapshotStore`,
    `IndexedStore`), so the event-store contract runs against it unchanged: each call
    runs the async store's coroutine on a private event loop, which runs in a background
    thread of its own, and waits for its answer. Calls from several threads at once are
    scheduled on that one loop concurrently, as tasks of one asyncio runner would be, so
    the store's own serialization (a lock, a worker thread) is what keeps them apart.

    `close` awaits the store's ``close()`` (if it has one), then stops the loop. Never
    call the adapter from a coroutine running on its own loop (it would wait for
    itself)."""

    def __init__(self, store: AsyncEventStore) -> None:
        self.inner = store
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="statemachine-async-store-adapter")
        self._thread.start()
        self._closed = False

    def _wait(self, coroutine: Coroutine[Any, Any, T]) -> T:
        if threading.current_thread() is self._thread:
            coroutine.close()
            raise RuntimeError("the adapter was called from its own event loop")
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    @property
    def keeps_read_models(self) -> bool:
        """Whether the async store keeps read models (its ``read_model=`` is passed on)."""
        return keeps_read_models(self.inner)

    def append(self, run_id: str, events: Sequence[ev.Event], expected_version: int, *,
               snapshot: Snapshot | None = None, step: Step | None = None,
               read_model: ReadModel | None = None) -> None:
        options = {} if read_model is None else {"read_model": read_model}
        self._wait(self.inner.append(run_id, events, expected_version, snapshot=snapshot,
                                     step=step, **options))

    def load(self, run_id: str) -> list[ev.Event]:
        return self._wait(self.inner.load(run_id))

    def load_latest(self, run_id: str) -> tuple[Snapshot | None, list[ev.Event]]:
        return self._wait(self.inner.load_latest(run_id))

    def list_runs(self, session_id: str | None = None,
                  steps: Collection[Step] | None = None) -> tuple[RunHead, ...]:
        return self._wait(self.inner.list_runs(session_id, steps))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            close = getattr(self.inner, "close", None)
            if callable(close):
                closing = close()
                if asyncio.iscoroutine(closing):
                    self._wait(closing)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=60)
            if not self._thread.is_alive():
                self._loop.close()


class AsyncEventStoreContract(EventStoreContract):
    """`EventStoreContract` for an `AsyncEventStore`, through `AsyncStoreAdapter`.
    Override `make_async_store`; for a store that other processes can open too, override
    `open_async_again`."""

    def make_async_store(self, tmp_path: Path) -> AsyncEventStore:
        """A new, empty async store (it may keep its files under ``tmp_path``)."""
        raise NotImplementedError

    def open_async_again(self, tmp_path: Path) -> AsyncEventStore | None:
        """As `EventStoreContract.open_again`, for the async store."""
        return None

    def make_store(self, tmp_path: Path) -> EventStore:
        return AsyncStoreAdapter(self.make_async_store(tmp_path))

    def open_again(self, tmp_path: Path) -> EventStore | None:
        other = self.open_async_again(tmp_path)
        return None if other is None else AsyncStoreAdapter(other)

    def test_it_is_an_async_store(self, store: EventStore) -> None:
        assert isinstance(store, AsyncStoreAdapter)
        assert isinstance(store.inner, AsyncEventStore)
        assert asyncio.iscoroutinefunction(store.inner.append)


# ------------------------------------------------------------------------ Sessions


class _WriteFails:
    """The Session under test, except that its next ``add_items`` raises ``error`` after
    writing the batch (``lands``) or without writing it."""

    def __init__(self, inner: Session, *, lands: bool, error: Exception) -> None:
        self.inner = inner
        self.session_id = inner.session_id
        self.lands = lands
        self.error = error

    async def get_items(self, limit: int | None = None) -> list[JSON]:
        return await self.inner.get_items(limit)

    async def add_items(self, items: list[JSON]) -> None:
        if self.lands:
            await self.inner.add_items(items)
        raise self.error

    async def pop_item(self) -> JSON | None:
        return await self.inner.pop_item()

    async def clear_session(self) -> None:
        await self.inner.clear_session()


def _run(coroutine: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coroutine)


class SessionContract:
    """What every `Session` guarantees, and that `publish` and `settle` work through it.
    Override `make_session`."""

    def make_session(self, tmp_path: Path, session_id: str) -> Session:
        """A new, empty Session named ``session_id`` (it may keep files under
        ``tmp_path``)."""
        raise NotImplementedError

    @pytest.fixture
    def session(self, tmp_path: Path) -> Iterator[Session]:
        session = self.make_session(tmp_path, "session-1")
        yield session
        _close(session)

    def test_is_a_session(self, session: Session) -> None:
        assert isinstance(session, Session)
        assert session.session_id == "session-1"
        assert _run(session.get_items()) == []

    def test_the_protocol_contract(self, session: Session) -> None:
        async def go() -> None:
            await session.add_items([{"n": 1}, {"n": 2}])
            await session.add_items([{"n": 3}])
            assert await session.get_items() == [{"n": 1}, {"n": 2}, {"n": 3}]
            assert await session.get_items(limit=2) == [{"n": 2}, {"n": 3}]
            assert await session.get_items(limit=10) == [{"n": 1}, {"n": 2}, {"n": 3}]
            assert await session.pop_item() == {"n": 3}
            await session.clear_session()
            assert await session.get_items() == []
            assert await session.pop_item() is None

        _run(go())

    def test_get_items_limit_is_the_newest_items_oldest_first(self,
                                                              session: Session) -> None:
        async def go() -> None:
            items: list[JSON] = [{"n": n} for n in range(5)]
            await session.add_items(items)
            for limit in range(1, 7):
                assert await session.get_items(limit=limit) == items[-limit:]
            assert await session.get_items(limit=None) == items

        _run(go())

    def test_an_empty_batch_adds_nothing(self, session: Session) -> None:
        async def go() -> None:
            await session.add_items([{"n": 1}])
            await session.add_items([])
            assert await session.get_items() == [{"n": 1}]

        _run(go())

    def test_add_items_is_all_or_nothing(self, session: Session) -> None:
        async def go() -> None:
            await session.add_items([{"n": 1}])
            unstorable: Any = {"n": object()}
            try:
                await session.add_items([{"n": 2}, unstorable])
            except Exception:
                assert await session.get_items() == [{"n": 1}]  # nothing of the batch
            else:
                assert len(await session.get_items()) == 3  # or all of it

        _run(go())

    def test_pop_item_removes_the_newest(self, session: Session) -> None:
        async def go() -> None:
            assert await session.pop_item() is None
            await session.add_items([{"n": 1}, {"n": 2}])
            assert await session.pop_item() == {"n": 2}
            assert await session.get_items() == [{"n": 1}]
            await session.add_items([{"n": 3}])
            assert await session.get_items() == [{"n": 1}, {"n": 3}]

        _run(go())

    def test_clear_session_removes_only_its_items(self, session: Session,
                                                  tmp_path: Path) -> None:
        other = self.make_session(tmp_path, "session-2")
        try:
            async def go() -> None:
                await session.add_items([{"n": 1}])
                await other.add_items([{"m": 1}])
                await session.clear_session()
                assert await session.get_items() == []
                assert await other.get_items() == [{"m": 1}]
                await session.add_items([{"n": 2}])
                assert await session.get_items() == [{"n": 2}]

            _run(go())
        finally:
            _close(other)

    def test_items_are_detached_on_the_way_in_and_out(self, session: Session) -> None:
        async def go() -> None:
            inner: list[JSON] = [1]
            await session.add_items([{"n": inner}])
            inner.append(2)  # the caller changes what it added
            read = await session.get_items()
            assert read == [{"n": [1]}]
            first = read[0]
            assert isinstance(first, dict)
            assert isinstance(first["n"], list)
            first["n"].append(3)  # the caller changes what it read
            assert await session.get_items() == [{"n": [1]}]
            assert await session.get_items(limit=1) == [{"n": [1]}]

        _run(go())

    @pytest.mark.parametrize("outcome", ["acknowledge", "append"])
    def test_publish_then_settle_through_it(self, session: Session, outcome: str) -> None:
        history: list[JSON] = [{"role": "user", "content": "charge me 7"}]
        batch: list[JSON] = [
            {"type": "function_call", "call_id": "charge", "name": "charge"},
            {"type": "function_call_output", "call_id": "charge", "output": "charged 7"},
            {"type": "function_call_output", "call_id": "audit", "output": "logged"}]

        async def go() -> None:
            await session.add_items(list(history))
            c = at_interruption(session_id=session.session_id)
            c.approve("charge", fingerprint=c.fingerprint("charge"))
            c.approve("audit")
            c.resume()
            c.begin_tool("charge")
            c.guardrail_evaluated("charge_input", {"allowed": True}, stage="tool_input",
                                  call_id="charge")
            c.hook_ran("tool_start", call_id="charge")
            c.tool_completed("charge", "charged 7")
            c.hook_ran("tool_end", call_id="charge")
            c.begin_tool("audit")
            c.tool_completed("audit", "logged")
            boom = RuntimeError("injected")
            failing = _WriteFails(session, lands=outcome == "acknowledge", error=boom)
            with pytest.raises(RuntimeError) as info:
                await publish(c, failing, list(batch), call_ids=["charge", "audit"])
            assert info.value is boom  # the original error propagates (I6)
            assert c.step is Step.UNSETTLED
            last = c.events[-1]
            assert isinstance(last, ev.PublicationFailed)
            assert last.error == "RuntimeError"
            restored = RunController.from_json(c.to_json())
            decision = await settle(restored, session)
            assert isinstance(decision, Acknowledge if outcome == "acknowledge" else Append)
            assert await session.get_items() == history + batch
            assert restored.step is Step.INTERRUPTION
            assert [g.name for g in restored.guardrail_results] == ["charge_input"]  # I4

        _run(go())
