"""The remote tool executor: at-most-once execution across reconnects, failed posts and
process restarts, against a scripted fake remote."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from statemachine import MemoryEventStore, Phase, RunController
from statemachine import events as ev
from statemachine.payloads import JSON
from statemachine.runner import (
    DispatchedToolCall,
    FunctionTool,
    RemoteEvent,
    RemoteToolExecutor,
)
from statemachine.runner.remote import RemoteUnavailable
from statemachine.testing import FakeRemote, PostOutcome

ROOT = Path(__file__).resolve().parents[2]


def _tools(executions: Counter[str]) -> list[FunctionTool]:
    def bash(cmd: str) -> str:
        executions[cmd] += 1
        return f"ran {cmd} (execution {executions[cmd]})"

    return [FunctionTool("bash", bash)]


async def _drain(remote: FakeRemote, executions: Counter[str],
                 controller: RunController | None = None) -> list[DispatchedToolCall]:
    c = controller or RunController.start(run_id="remote", session_id=None)
    executor = RemoteToolExecutor(remote, _tools(executions), controller=c, backoff=0)
    async with aclosing(executor.run()) as stream:
        return [call async for call in stream]


@pytest.mark.invariant("I1", "I12")
def test_seed_regression_permanent_post_failure_then_reconnect() -> None:
    """A permanent failure on the first post, then a reconnect: the tool runs once and
    the same cached result is re-posted."""
    remote = FakeRemote([("toolu_1", "bash", {"cmd": "charge"})], disconnect_after=[1],
                        post_outcomes={"toolu_1": ["permanent"]})
    executions: Counter[str] = Counter()
    seen = asyncio.run(_drain(remote, executions))
    assert executions == {"charge": 1}
    assert [(d.call_id, d.posted) for d in seen] == [("toolu_1", False), ("toolu_1", True)]
    assert seen[0].result == seen[1].result == "ran charge (execution 1)"
    assert remote.results() == {"toolu_1": ["ran charge (execution 1)"]}
    assert remote.connections == 2
    assert remote.open_streams == 0


def test_foreign_and_unknown_calls_are_left_alone() -> None:
    remote = FakeRemote([("t1", "someone_elses_tool", {}), ("t2", "bash", {"cmd": "x"})])
    executions: Counter[str] = Counter()
    remote.history.append(remote.pending.pop(0))
    remote.history.append(RemoteEvent("tool_result", "t1", result="theirs"))
    seen = asyncio.run(_drain(remote, executions))
    assert [d.call_id for d in seen] == ["t2"]
    assert executions == {"x": 1}


schedules = st.fixed_dictionaries({
    "calls": st.integers(1, 3),
    "disconnect_after": st.lists(st.integers(0, 3), max_size=4),
    "failing_listings": st.lists(st.integers(1, 5), max_size=3),
    "outcomes": st.lists(st.lists(st.sampled_from(
        ["ok", "transient", "permanent", "commit_then_raise"]), max_size=5),
        min_size=3, max_size=3),
})


@pytest.mark.invariant("I1", "I12")
@given(schedules)
def test_any_disconnect_and_post_failure_schedule(schedule: dict[str, Any]) -> None:
    ids = [f"toolu_{i}" for i in range(schedule["calls"])]
    outcomes: dict[str, list[PostOutcome]] = dict(zip(ids, schedule["outcomes"],
                                                      strict=False))
    remote = FakeRemote([(i, "bash", {"cmd": i}) for i in ids],
                        disconnect_after=schedule["disconnect_after"],
                        failing_listings=schedule["failing_listings"],
                        post_outcomes=outcomes)
    executions: Counter[str] = Counter()

    async def go() -> list[DispatchedToolCall]:
        seen = await _drain(remote, executions)
        assert asyncio.all_tasks() == {asyncio.current_task()}
        return seen

    seen = asyncio.run(go())
    assert executions == dict.fromkeys(ids, 1)  # each tool executed once
    held = remote.results()
    assert sorted(held) == ids
    assert all(len(results) == 1 for results in held.values())  # posted exactly once
    for call_id in ids:
        results = {d.result for d in seen if d.call_id == call_id}
        assert results == set(held[call_id])  # every yield carries the cached result
        assert [d.posted for d in seen if d.call_id == call_id][-1] in (True, False)
    assert remote.open_streams == 0


def _driver(folder: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tests.drivers.remote_driver", str(folder),
                           *flags],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.invariant("I1", "I12")
def test_restart_after_the_tool_ran_reposts_the_cached_result(tmp_path: Path) -> None:
    killed = _driver(tmp_path, "--kill-before-post")
    assert killed.returncode == -9
    restarted = _driver(tmp_path)
    assert restarted.returncode == 0, restarted.stderr
    dispatched = [json.loads(line) for line in restarted.stdout.splitlines()]
    assert dispatched == [{"call_id": "toolu_1", "name": "bash", "result": "ran pay #1",
                           "posted": True, "in_doubt": False}]
    assert (tmp_path / "effects.txt").read_text().splitlines() == ["pay"]
    remote = FakeRemote(path=str(tmp_path / "remote.json"))
    assert remote.results() == {"toolu_1": ["ran pay #1"]}


@pytest.mark.invariant("I11")
def test_restart_after_a_crash_inside_the_tool_is_in_doubt(tmp_path: Path) -> None:
    assert _driver(tmp_path, "--kill-in-tool").returncode == -9
    restarted = _driver(tmp_path)
    assert [json.loads(line)["in_doubt"] for line in restarted.stdout.splitlines()] == [True]
    assert "ToolInDoubt" in restarted.stderr
    assert "'toolu_1'" in restarted.stderr
    assert (tmp_path / "effects.txt").read_text().splitlines() == ["pay"]
    assert FakeRemote(path=str(tmp_path / "remote.json")).results() == {}


@pytest.mark.invariant("I11")
def test_a_cancelled_remote_tool_is_in_doubt_in_the_live_controller() -> None:
    """A remote tool whose task is cancelled mid-run leaves its call in doubt in the live
    controller, exactly as a reloaded controller sees it (never held "in flight")."""
    from statemachine import Action, ToolInDoubt

    started = asyncio.Event()

    async def slow(cmd: str) -> str:
        started.set()
        await asyncio.sleep(60)
        return "never"

    remote = FakeRemote([("toolu_1", "bash", {"cmd": "charge"})])
    c = RunController.start(run_id="remote", session_id=None)
    executor = RemoteToolExecutor(remote, [FunctionTool("bash", slow)], controller=c,
                                  backoff=0)

    async def scenario() -> None:
        async def drain() -> None:
            async with aclosing(executor.run()) as stream:
                async for _ in stream:
                    pass

        task = asyncio.create_task(drain())
        await started.wait()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    reloaded = RunController.from_json(c.to_json())
    assert c.in_flight == ()
    assert c.next_action() is reloaded.next_action() is Action.RESOLVE_IN_DOUBT
    for controller in (c, reloaded):
        with pytest.raises(ToolInDoubt) as info:
            controller.begin_tool("toolu_1")
        assert info.value.call_id == "toolu_1"


def test_a_refusal_of_the_controller_is_raised_not_taken_for_a_dropped_stream() -> None:
    """A command the controller refuses while a call arrives on the stream (here: the
    store cannot tell whether the tool's start was written) ends the run with that typed
    error at once; it is not a dropped stream to reconnect over, and the tool never
    runs."""
    from statemachine import MemoryEventStore, StorageError

    class Failing(MemoryEventStore):
        def append(self, run_id: str, events: Any, expected_version: int,
                   **options: Any) -> None:
            if any(type(event).__name__ == "ToolStarted" for event in events):
                raise StorageError("the disk went away", outcome="unknown", run_id=run_id)
            super().append(run_id, events, expected_version, **options)

    remote = FakeRemote([("toolu_1", "bash", {"cmd": "charge"})])
    executions: Counter[str] = Counter()
    c = RunController.start(run_id="remote", session_id=None, store=Failing())
    executor = RemoteToolExecutor(remote, _tools(executions), controller=c, backoff=0,
                                  max_reconnects=3)

    async def drain() -> None:
        async with aclosing(executor.run()) as stream:
            async for _ in stream:
                pass

    with pytest.raises(StorageError) as info:
        asyncio.run(drain())
    assert info.value.outcome == "unknown"
    assert executions == {}
    assert executor.reconnects == 0


class _WatchedRemote(FakeRemote):
    def __init__(self, store: MemoryEventStore, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.store = store
        self.completed_when_posted: list[tuple[str, int]] = []

    async def post_result(self, call_id: str, result: JSON) -> None:
        done = sum(type(e) is ev.ToolCompleted and e.call_id == call_id
                   for e in self.store.load("remote"))
        self.completed_when_posted.append((call_id, done))
        await super().post_result(call_id, result)


async def _drain_remote(remote: FakeRemote, c: RunController,
                        tools: Sequence[FunctionTool]) -> list[Any]:
    executor = RemoteToolExecutor(remote, tools, controller=c, backoff=0)
    return [call async for call in executor.run()]


def test_a_remote_result_is_durable_before_it_is_posted() -> None:
    # RE04: a buffered run's result is in the store before the remote is told it
    store = MemoryEventStore()
    remote = _WatchedRemote(store, [("t1", "echo", {"v": 1}), ("t2", "echo", {"v": 2})])
    c = RunController.start(run_id="remote", session_id=None, store=store, buffered=True)
    asyncio.run(_drain_remote(remote, c, [FunctionTool("echo", lambda v: v)]))
    assert remote.completed_when_posted == [("t1", 1), ("t2", 1)]


def test_a_result_the_remote_already_holds_is_recorded_as_posted() -> None:
    # RE05: the first post lands but its answer is lost; the retry hears AlreadyAnswered,
    # which means the remote holds the result: the ledger must say published
    remote = FakeRemote([("t1", "echo", {"v": 1})],
                        post_outcomes={"t1": ["commit_then_raise"]})
    c = RunController.start(run_id="remote", session_id=None)
    seen = asyncio.run(_drain_remote(remote, c, [FunctionTool("echo", lambda v: v)]))
    assert remote.results() == {"t1": [1]}
    assert c.phase("t1") is Phase.PUBLISHED
    assert [(d.call_id, d.posted) for d in seen] == [("t1", True)]


def test_a_result_the_listing_shows_is_never_posted_again() -> None:
    # RE01: on reconnect the listing is reconciled with the ledger: a result the remote
    # holds (its post landed, the answer was lost) is recorded as posted, not re-posted
    remote = FakeRemote([("t1", "echo", {"v": 1})], disconnect_after=[1],
                        post_outcomes={"t1": ["commit_then_raise"]})
    c = RunController.start(run_id="remote", session_id=None)
    executor = RemoteToolExecutor(remote, [FunctionTool("echo", lambda v: v)],
                                  controller=c, backoff=0, retries=0)

    async def drain() -> list[Any]:
        return [d async for d in executor.run()]

    seen = asyncio.run(drain())
    assert remote.posts["t1"] == 1
    assert remote.results() == {"t1": [1]}
    assert c.phase("t1") is Phase.PUBLISHED
    assert [(d.call_id, d.posted) for d in seen] == [("t1", False)]


class _Redelivering:
    """A remote whose stream delivers the same tool_use twice (at-least-once delivery),
    then ends the session."""

    def __init__(self) -> None:
        self.history: list[RemoteEvent] = []
        self.posted: list[tuple[str, JSON]] = []

    async def list_events(self) -> AsyncGenerator[RemoteEvent, None]:
        for event in list(self.history):
            yield event

    async def events(self) -> AsyncGenerator[RemoteEvent, None]:
        use = RemoteEvent("tool_use", "t1", "echo", {"v": 1})
        self.history.append(use)
        yield use
        yield use  # redelivered after its result was posted
        yield RemoteEvent("session_end")

    async def post_result(self, call_id: str, result: JSON) -> None:
        self.posted.append((call_id, result))
        self.history.append(RemoteEvent("tool_result", call_id, result=result))


@pytest.mark.invariant("I1")
def test_a_redelivered_call_is_not_run_or_posted_again() -> None:
    # RE02: a published call is done: a second delivery of it changes nothing
    remote = _Redelivering()
    runs: list[int] = []

    def echo(v: int) -> int:
        runs.append(v)
        return v

    c = RunController.start(run_id="remote", session_id=None)
    executor = RemoteToolExecutor(remote, [FunctionTool("echo", echo)], controller=c,
                                  backoff=0)

    async def drain() -> list[Any]:
        return [d async for d in executor.run()]

    seen = asyncio.run(drain())
    assert runs == [1]
    assert remote.posted == [("t1", 1)]
    assert [(d.call_id, d.posted) for d in seen] == [("t1", True)]
    assert c.phase("t1") is Phase.PUBLISHED


def test_the_executor_gives_up_after_max_reconnects() -> None:
    # RE07: max_reconnects=3: the first listing and three reconnects, then it gives up
    remote = FakeRemote([("t1", "echo", {"v": 1})], failing_listings=range(1, 100))
    c = RunController.start(run_id="remote", session_id=None)
    executor = RemoteToolExecutor(remote, [FunctionTool("echo", lambda v: v)],
                                  controller=c, backoff=0, max_reconnects=3)

    async def drain() -> list[Any]:
        return [d async for d in executor.run()]

    with pytest.raises(RemoteUnavailable):
        asyncio.run(drain())
    assert remote.listings == 4


def test_a_remote_tools_exception_is_its_result() -> None:
    # RE09: as for every FunctionTool, an exception the tool raises is its output
    def broken(v: int) -> int:
        raise KeyError(v)

    remote = FakeRemote([("t1", "broken", {"v": 1}), ("t2", "echo", {"v": 2})])
    c = RunController.start(run_id="remote", session_id=None)
    seen = asyncio.run(_drain_remote(remote, c, [FunctionTool("broken", broken),
                                                 FunctionTool("echo", lambda v: v)]))
    assert remote.results() == {"t1": ["tool error: KeyError"], "t2": [2]}
    assert [(d.call_id, d.result, d.posted) for d in seen] == [
        ("t1", "tool error: KeyError", True), ("t2", 2, True)]
