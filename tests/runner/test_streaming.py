"""Streamed runs (DESIGN §6.5): ``stream_events()`` is single use; a consumer that stops
early (break, ``aclose()``, cancellation) stops the run at its next event boundary, with
nothing left running in the background; every error of a streamed run reaches the
consumer or ``result``, and none is left as an unretrieved task exception."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from statemachine import Action, RunController, Step
from statemachine import events as ev
from statemachine.payloads import JSON
from statemachine.runner import Agent, FunctionTool, ModelResponse, Runner, RunResultStreaming
from statemachine.sessions import MemorySession
from statemachine.testing import FlakySession, InjectedWriteError

SESSION_ID = "stream-session"


def run_clean(main: Callable[[], Awaitable[None]]) -> None:
    """Run ``main`` with a loop exception handler that records every report ("Task
    exception was never retrieved" among them); fail if anything was reported or if a
    task is still running once ``main`` returned."""
    reported: list[dict[str, Any]] = []

    async def checked() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _loop, context: reported.append(context))
        await main()
        for _ in range(5):  # let finalizers and done callbacks run
            gc.collect()
            await asyncio.sleep(0)
        assert asyncio.all_tasks() == {asyncio.current_task()}, "something still runs"

    asyncio.run(checked())
    gc.collect()
    assert reported == []


class CyclingModel:
    """Asks for ``charge`` with a new call id, then answers ``done`` once the tool's output
    is in the history; again and again (a second run would run the tool again)."""

    def __init__(self) -> None:
        self.calls = 0

    async def respond(self, history: list[JSON], agent: Agent) -> ModelResponse:
        self.calls += 1
        last = history[-1] if history else None
        if isinstance(last, dict) and last.get("type") == "function_call_output":
            return ModelResponse(output="done")
        return ModelResponse(((f"charge-{self.calls}", "charge", {"x": 7}),))


class CountedTool:
    """``charge``: counts every run; hangs until cancelled while ``hang`` is set."""

    def __init__(self, *, hang: bool = False) -> None:
        self.calls = 0
        self.hang = hang
        self.entered = asyncio.Event()

    async def __call__(self, x: int) -> JSON:
        self.calls += 1
        self.entered.set()
        if self.hang:
            await asyncio.Event().wait()
        return f"charged {x}"


def _world(*, hang: bool = False) -> tuple[Agent, CyclingModel, CountedTool, MemorySession]:
    model, tool = CyclingModel(), CountedTool(hang=hang)
    agent = Agent("billing", model, (FunctionTool("charge", tool),))
    return agent, model, tool, MemorySession(SESSION_ID)


def _controller() -> RunController:
    return RunController.start(run_id="streamed", session_id=SESSION_ID)


# ------------------------------------------------------------------- single use


def test_stream_events_is_single_use_and_a_second_call_runs_nothing() -> None:
    async def main() -> None:
        agent, model, tool, session = _world()
        streamed = Runner.run_streamed(agent, "charge me 7", session=session)
        kinds = [event.kind async for event in streamed.stream_events()]
        assert kinds[-1] == "final_output"
        result = streamed.result
        assert result.final_output == "done"
        counts = (tool.calls, model.calls, await session.get_items())
        assert counts[:2] == (1, 2)

        with pytest.raises(RuntimeError, match="single use"):
            async for _event in streamed.stream_events():
                pass
        for _ in range(3):
            await asyncio.sleep(0)
        assert (tool.calls, model.calls, await session.get_items()) == counts
        assert streamed.result is result

    run_clean(main)


def test_a_stream_never_iterated_still_counts_as_its_one_use() -> None:
    async def main() -> None:
        agent, model, tool, session = _world()
        streamed = Runner.run_streamed(agent, "charge me 7", session=session)
        first = streamed.stream_events()
        with pytest.raises(RuntimeError, match="single use"):
            streamed.stream_events()
        assert [event.kind async for event in first][-1] == "final_output"
        assert (tool.calls, model.calls) == (1, 2)

    run_clean(main)


# ------------------------------------------------------------------ early stop


async def _stop_after_first_event(streamed: RunResultStreaming, how: str) -> None:
    if how == "break":
        async for _event in streamed.stream_events():
            break
    else:
        events = streamed.stream_events()
        await events.__anext__()
        await events.aclose()
        # the run ended before aclose() returned: nothing is left running
        assert asyncio.all_tasks() == {asyncio.current_task()}


@pytest.mark.parametrize("how", ["break", "aclose"])
def test_a_consumer_that_stops_stops_the_run_and_nothing_runs_in_the_background(
        how: str) -> None:
    async def main() -> None:
        agent, model, tool, session = _world()
        # the input batch is the first write; the tool's batch would be the second
        flaky = FlakySession(session, fail_on=2, outcome="atomic")
        c = _controller()
        streamed = Runner.run_streamed(agent, "charge me 7", session=flaky, controller=c)
        await _stop_after_first_event(streamed, how)
        for _ in range(10):
            await asyncio.sleep(0.001)
        # the run stopped at the boundary it was waiting at: no model call, no tool, no
        # second write (which would fail unseen by anyone)
        assert (model.calls, tool.calls, flaky.add_calls) == (0, 0, 1)
        assert c.step is Step.RUN_AGAIN
        assert c.in_flight == ()
        assert not c.holds_attempt
        with pytest.raises(RuntimeError, match="stopped before the run finished"):
            _ = streamed.result
        with pytest.raises(RuntimeError, match="single use"):
            async for _event in streamed.stream_events():
                pass
        assert (model.calls, tool.calls, flaky.add_calls) == (0, 0, 1)

        # the same controller goes on from where the stream stopped
        done = await Runner.run(agent, session=session, controller=c)
        assert done.step is Step.COMPLETED
        assert (model.calls, tool.calls) == (2, 1)

    run_clean(main)


def test_a_stream_stopped_mid_write_leaves_a_cancelled_write() -> None:
    async def main() -> None:
        agent, _model, tool, session = _world()
        flaky = FlakySession(session, fail_on=2, outcome="hang")
        c = _controller()
        streamed = Runner.run_streamed(agent, "charge me 7", session=flaky, controller=c)

        async def consume() -> None:
            async for _event in streamed.stream_events():
                pass

        with pytest.raises(TimeoutError):
            await asyncio.wait_for(consume(), timeout=0.2)
        assert asyncio.all_tasks() == {asyncio.current_task()}  # the run has ended
        assert flaky.add_calls == 2  # the write was in flight when the consumer stopped
        assert tool.calls == 1
        # a cancelled write is not reported: its attempt stays open in this controller
        assert c.step is Step.UNSETTLED
        assert c.holds_attempt
        assert not any(isinstance(e, ev.PublicationFailed) for e in c.events)
        assert c.next_action() is Action.PUBLISH
        with pytest.raises(RuntimeError, match="stopped before the run finished"):
            _ = streamed.result

    run_clean(main)


class WriteAborted(Exception):
    """A Session whose write, when cancelled, ends with this error instead."""


class AbortingSession(MemorySession):
    async def add_items(self, items: list[JSON]) -> None:
        if any(isinstance(i, dict) and i.get("type") == "function_call" for i in items):
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                raise WriteAborted("the write was aborted") from None
        await super().add_items(items)


@pytest.mark.invariant("I6")
@pytest.mark.parametrize("read_result", [True, False])
def test_an_error_raised_while_the_run_stops_is_raised_from_result(read_result: bool) -> None:
    async def main() -> None:
        agent, _model, _tool, _session = _world()
        session = AbortingSession(SESSION_ID)
        c = _controller()
        streamed = Runner.run_streamed(agent, "charge me 7", session=session, controller=c)

        async def consume() -> None:
            async for _event in streamed.stream_events():
                pass

        with pytest.raises(TimeoutError):
            await asyncio.wait_for(consume(), timeout=0.2)
        assert asyncio.all_tasks() == {asyncio.current_task()}  # the run has ended
        # a write that ended with an error was reported as failed
        assert any(isinstance(e, ev.PublicationFailed) for e in c.events)
        if read_result:
            with pytest.raises(WriteAborted):
                _ = streamed.result
        # never read, the error is still not left in an unretrieved task (run_clean)

    run_clean(main)


@pytest.mark.invariant("I6")
def test_a_write_error_reaches_the_consumer_and_result_without_a_stray_task() -> None:
    async def main() -> None:
        agent, _model, tool, session = _world()
        flaky = FlakySession(session, fail_on=2, outcome="atomic")
        streamed = Runner.run_streamed(agent, "charge me 7", session=flaky)
        with pytest.raises(InjectedWriteError) as info:
            async for _event in streamed.stream_events():
                pass
        assert info.value is flaky.raised
        with pytest.raises(InjectedWriteError):
            _ = streamed.result
        assert tool.calls == 1

    run_clean(main)


def test_the_run_never_gets_ahead_of_its_consumer() -> None:
    async def main() -> None:
        agent, model, tool, session = _world()
        streamed = Runner.run_streamed(agent, "charge me 7", session=session)
        seen: list[tuple[str, int, int]] = []
        async for event in streamed.stream_events():
            for _ in range(5):  # a slow consumer: the run waits for it
                await asyncio.sleep(0)
            seen.append((event.kind, model.calls, tool.calls))
        # the tool ran after the consumer took the event announcing it, never before
        announce = next(i for i, (kind, *_rest) in enumerate(seen)
                        if kind == "action" and i > 0 and seen[i - 1][0] == "model_response")
        assert seen[announce][2] == 0
        assert seen[announce + 1] == ("tool_output", 1, 1)
        assert streamed.result.final_output == "done"

    run_clean(main)


# ------------------------------------------------- shown only once it is durable


@pytest.mark.invariant("I8")
@pytest.mark.parametrize("approval", [False, True])
def test_a_streamed_run_shows_its_last_event_only_once_it_is_durable(
        tmp_path: Any, approval: bool) -> None:
    """With an async store (always buffered) the attempt's own flush comes at its end,
    after its last event reaches the consumer: the answer (``final_output``) or the pause
    (``interruption``) must be durable before the consumer sees it, else a consumer
    shows an answer the run may never keep. A reader of the store when the consumer gets
    the last event finds the run completed with every item written, or paused with the
    call awaiting its decision."""
    from statemachine.sessions import SQLiteSession
    from statemachine.stores import AsyncSQLiteEventStore, SQLiteEventStore

    path = tmp_path / "events.db"
    tool = CountedTool()
    agent = Agent("billing", CyclingModel(),
                  (FunctionTool("charge", tool, needs_approval=approval),))
    seen: dict[str, Any] = {}

    async def main() -> None:
        store = AsyncSQLiteEventStore(path)
        session = SQLiteSession(SESSION_ID, path)
        streamed = Runner.run_streamed(agent, "charge 7", session=session, store=store,
                                       run_id="r")
        async for event in streamed.stream_events():
            if event.kind in ("final_output", "interruption"):
                reader = SQLiteEventStore(path, readonly=True)
                try:
                    c = RunController.load(reader, "r")
                    seen.update(kind=event.kind, step=c.step,
                                pending=c.pending_approvals)
                finally:
                    reader.close()
                seen["items"] = await SQLiteSession(SESSION_ID, path).get_items()
        await store.close()

    run_clean(main)
    if approval:
        assert seen["kind"] == "interruption"
        assert seen["step"] is Step.INTERRUPTION
        assert seen["pending"] == ("charge-1",)
        assert tool.calls == 0
    else:
        assert seen["kind"] == "final_output"
        assert seen["step"] is Step.COMPLETED
        assert [item.get("content", item.get("type")) for item in seen["items"]] == [
            "charge 7", "function_call", "function_call_output", "done"]
        assert tool.calls == 1
