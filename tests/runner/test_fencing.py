"""DESIGN §7.2, fencing effects: an attempt another attempt superseded (it claimed the
run while this one waited on the model) runs no hook, guardrail, tool or model call from
then on; it stops with `ConcurrencyConflict` before the next effect, per event and
buffered, on every store. Before: a superseded worker ran ``on_llm_end``, the output
guardrails and ``on_agent_end`` and only then met the conflict on its next append."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from statemachine import ConcurrencyConflict, MemoryEventStore, RunController, SQLiteEventStore
from statemachine import events as ev
from statemachine.runner import Agent, ModelResponse, RunHooks, Runner
from statemachine.runner.agents import OutputGuardrail, Verdict
from statemachine.sessions import MemorySession
from statemachine.stores import AsyncSQLiteEventStore
from statemachine.testing import Counters, CountingHooks, ScriptedModel, counted_tool

RUN = "fenced"
JSON = Any


class SupersededWhileWaiting:
    """A model during whose call another process claims the run (``rival``), then answers
    with ``response``: the attempt that called it has been superseded."""

    def __init__(self, rival: Callable[[], None], response: ModelResponse) -> None:
        self.rival = rival
        self.response = response
        self.calls = 0

    async def respond(self, history: list[Any], agent: Agent) -> ModelResponse:
        self.calls += 1
        if self.calls == 1:
            self.rival()
        return self.response


def _stores(tmp_path: Path, kind: str) -> tuple[Any, Callable[[], None]]:
    """The attempt's store, and how a rival process claims the run on its own store
    object (its own connection, for SQLite)."""
    if kind == "memory":
        store: Any = MemoryEventStore()

        def rival() -> None:
            RunController.load(store, RUN).claim("rival")

        return store, rival
    path = tmp_path / "events.db"
    store = AsyncSQLiteEventStore(path) if kind == "async-sqlite" else SQLiteEventStore(path)

    def rival_on_its_own_connection() -> None:
        RunController.load(SQLiteEventStore(path), RUN).claim("rival")

    return store, rival_on_its_own_connection


@pytest.mark.invariant("I1")
@pytest.mark.parametrize("buffered", [False, True], ids=["per-event", "buffered"])
@pytest.mark.parametrize("kind", ["memory", "sqlite", "async-sqlite"])
@pytest.mark.parametrize("answer", ["final", "tool"])
def test_a_superseded_attempt_runs_no_effect_after_the_model_call(
        tmp_path: Path, kind: str, buffered: bool, answer: str) -> None:
    counters = Counters()
    checked: list[JSON] = []

    def check(output: Any) -> Verdict:
        checked.append(output)
        return Verdict()

    store, rival = _stores(tmp_path, kind)
    if answer == "final":
        response = ModelResponse(output="the answer")
    else:
        response = ModelResponse((("c1", "charge", {"x": 7}),))
    model = SupersededWhileWaiting(rival, response)
    agent = Agent("a", model, (counted_tool(counters, "charge", lambda x: f"charged {x}",
                                            guarded=True),),
                  output_guardrails=(OutputGuardrail("final_check", check),))
    with pytest.raises(ConcurrencyConflict):
        asyncio.run(Runner.run(agent, "hi", session=MemorySession("s"), store=store,
                               run_id=RUN, hooks=CountingHooks(counters), buffered=buffered))
    # what ran before the rival's claim, and nothing after it
    assert dict(counters.hooks) == {"agent_start": 1, "model_start": 1}
    assert model.calls == 1
    assert not counters.tools
    assert not counters.guardrails
    assert not checked
    # the rival holds the run: its claim is the log's last event
    if kind == "async-sqlite":
        store = SQLiteEventStore(tmp_path / "events.db")
    log = RunController.load(store, RUN)
    last = log.events[-1]
    assert isinstance(last, ev.RunClaimed)
    assert last.owner == "rival"



@pytest.mark.parametrize("buffered", [False, True], ids=["per-event", "buffered"])
@pytest.mark.parametrize("kind", ["sqlite", "async-sqlite"])
def test_a_rival_claim_before_the_model_call_stops_it(tmp_path: Path, buffered: bool,
                                                      kind: str) -> None:
    """Superseded while ``on_llm_start`` runs (the hook passed its fence): the model call
    after it, which no flush precedes (DESIGN §7.7), is fenced, and never made."""
    counters = Counters()
    store, rival = _stores(tmp_path, kind)

    class RivalInTheHook(CountingHooks):
        async def on_llm_start(self, agent: Agent) -> None:
            await super().on_llm_start(agent)
            rival()

    model = ScriptedModel([ModelResponse(output="the answer")])
    agent = Agent("a", model)
    # the run exists in the store before the attempt (a rival can only claim a stored run)
    RunController.start(run_id=RUN, session_id="s", store=SQLiteEventStore(
        tmp_path / "events.db"))
    with pytest.raises(ConcurrencyConflict):
        asyncio.run(Runner.run(agent, "hi", session=MemorySession("s"), store=store,
                               run_id=RUN, hooks=RivalInTheHook(counters),
                               buffered=buffered))
    assert dict(counters.hooks) == {"agent_start": 1, "model_start": 1}
    assert model.calls == 0


@pytest.mark.invariant("I1")
@pytest.mark.parametrize("buffered", [False, True], ids=["per-event", "buffered"])
def test_a_rival_claim_during_a_hook_stops_the_guardrails_after_it(
        tmp_path: Path, buffered: bool) -> None:
    """Superseded while ``on_llm_end`` runs (the hook itself passed its fence): the
    output guardrail after it and ``on_agent_end`` do not run."""
    counters = Counters()
    checked: list[JSON] = []
    store, rival = _stores(tmp_path, "sqlite")

    class RivalInTheHook(CountingHooks):
        async def on_llm_end(self, agent: Agent, response: ModelResponse) -> None:
            await super().on_llm_end(agent, response)
            rival()

    def check(output: Any) -> Verdict:
        checked.append(output)
        return Verdict()

    agent = Agent("a", ScriptedModel([ModelResponse(output="the answer")]),
                  output_guardrails=(OutputGuardrail("final_check", check),))
    with pytest.raises(ConcurrencyConflict):
        asyncio.run(Runner.run(agent, "hi", session=MemorySession("s"), store=store,
                               run_id=RUN, hooks=RivalInTheHook(counters),
                               buffered=buffered))
    assert dict(counters.hooks) == {"agent_start": 1, "model_start": 1, "model_end": 1}
    assert not checked


@pytest.mark.invariant("I1")
@pytest.mark.parametrize("buffered", [False, True], ids=["per-event", "buffered"])
@pytest.mark.parametrize("kind", ["sqlite", "async-sqlite"])
@pytest.mark.parametrize("hooks", ["subclass", "instance"])
def test_a_rival_claim_during_a_tool_start_hook_stops_the_tool(
        tmp_path: Path, kind: str, buffered: bool, hooks: str) -> None:
    """Superseded while a hook of the user's ``on_tool_start`` runs (after the flush that
    made the tool's start durable): the tool body does not run, whether the hook is a
    subclass's method or one set on a `RunHooks` instance. (With the library's own hooks
    nothing runs between that flush and the body, and no read is made there.)"""
    counters = Counters()
    store, rival = _stores(tmp_path, kind)
    started: list[str] = []

    async def on_tool_start(agent: Agent, call: Any) -> None:
        started.append(call.name)
        rival()

    if hooks == "subclass":
        class RivalInTheHook(RunHooks):
            async def on_tool_start(self, agent: Agent, call: Any) -> None:
                await on_tool_start(agent, call)

        chosen: RunHooks = RivalInTheHook()
    else:
        chosen = RunHooks()
        chosen.on_tool_start = on_tool_start  # type: ignore[method-assign]
    agent = Agent("a", ScriptedModel([ModelResponse((("c1", "charge", {"x": 7}),)),
                                      ModelResponse(output="charged")]),
                  (counted_tool(counters, "charge", lambda x: f"charged {x}"),))
    with pytest.raises(ConcurrencyConflict):
        asyncio.run(Runner.run(agent, "hi", session=MemorySession("s"), store=store,
                               run_id=RUN, hooks=chosen, buffered=buffered))
    assert started == ["charge"]
    assert not counters.tools


def test_a_fence_on_a_run_nobody_else_touched_passes_and_reads_only(tmp_path: Path) -> None:
    """The fence writes nothing: the log is the same before and after, and a controller
    that buffered events passes it (what it has not flushed is its own)."""
    store = SQLiteEventStore(tmp_path / "events.db")
    c = RunController.start(run_id=RUN, session_id=None, store=store, buffered=True)
    c.flush()
    c.claim("me")  # buffered, not flushed
    before = store.load(RUN)
    c.fence()
    assert store.load(RUN) == before
    c.flush()
    c.fence()


def test_a_fenced_controller_refuses_everything_until_reloaded(tmp_path: Path) -> None:
    """Buffered, so that only the fence's verdict (not an append) refuses what follows."""
    store = SQLiteEventStore(tmp_path / "events.db")
    c = RunController.start(run_id=RUN, session_id=None, store=store, buffered=True)
    c.flush()
    RunController.load(SQLiteEventStore(tmp_path / "events.db"), RUN).claim("rival")
    with pytest.raises(ConcurrencyConflict, match="superseded"):
        c.fence()
    with pytest.raises(ConcurrencyConflict):
        c.begin_model_call()
    with pytest.raises(ConcurrencyConflict):
        c.fence()
    reloaded = RunController.load(store, RUN)
    reloaded.fence()  # the reloaded controller holds the run's newest version


def test_a_store_without_a_version_read_is_fenced_from_its_log() -> None:
    """A store of your own with no ``version(run_id)``: the fence reads the log's
    length instead (correct, O(log))."""

    class Plain:
        def __init__(self) -> None:
            self.inner = MemoryEventStore()

        def append(self, *args: Any, **kwargs: Any) -> None:
            self.inner.append(*args, **kwargs)

        def load(self, run_id: str) -> list[Any]:
            return self.inner.load(run_id)

    store = Plain()
    c = RunController.start(run_id=RUN, session_id=None, store=store)
    c.fence()
    RunController.load(store, RUN).claim("rival")
    with pytest.raises(ConcurrencyConflict):
        c.fence()


@pytest.mark.postgres
def test_the_fence_on_postgresql_reads_the_run_head(pg_dsn: str, pg_schema: str) -> None:
    """Both PostgreSQL faces: ``version`` is the log's length (0 for no run), and a
    rival's claim on another connection fences the first controller."""
    from statemachine.postgres import AsyncPostgresEventStore, PostgresEventStore

    with PostgresEventStore(pg_dsn, schema=pg_schema) as store, \
            PostgresEventStore(pg_dsn, schema=pg_schema) as rival:
        assert store.version(RUN) == 0
        c = RunController.start(run_id=RUN, session_id=None, store=store)
        c.claim("me")
        assert store.version(RUN) == len(store.load(RUN)) == 2
        c.fence()
        RunController.load(rival, RUN).claim("rival")
        with pytest.raises(ConcurrencyConflict, match="superseded"):
            c.fence()

    async def go() -> None:
        async with AsyncPostgresEventStore(pg_dsn, schema=pg_schema) as store:
            assert await store.version(RUN) == 3
            assert await store.version("no-such-run") == 0
            c = await RunController.load_async(store, RUN, buffered=True)
            c.claim("again")
            await c.fence_async()  # its own buffered claim is not another writer's
            await c.flush_async()
            with PostgresEventStore(pg_dsn, schema=pg_schema) as rival:
                RunController.load(rival, RUN).claim("rival")
            with pytest.raises(ConcurrencyConflict, match="superseded"):
                await c.fence_async()

    asyncio.run(go())
