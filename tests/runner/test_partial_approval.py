"""The seed scenario matrices on the reference runner. Every row is named by its
coordinates: failing attempt x recovery attempt x state transport x write outcome
(x recovery policy for the terminal-output scenario)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from statemachine import (
    Action,
    PublicationUnsettled,
    ReconcileRejected,
    RecoveryPolicy,
    RunController,
    RunNotResumable,
    SQLiteEventStore,
    Step,
)
from statemachine.runner import (
    Agent,
    ModelResponse,
    Runner,
    RunResult,
)
from statemachine.sessions import MemorySession, Session, SQLiteSession
from statemachine.stores import EventStore
from statemachine.testing import (
    Counters,
    CountingHooks,
    FlakySession,
    InjectedWriteError,
    ScriptedModel,
    Untouchable,
    counted_tool,
)

RUN_ID = "seed-run"
SESSION_ID = "seed-session"
ATTEMPTS = ["run", "run_streamed"]
TRANSPORTS = ["live", "json", "store"]
OUTCOMES = {"atomic-no-commit": "atomic", "commit-then-raise": "commit_then_raise",
            "partial-write": "partial", "cancellation": "cancel"}


# ---------------------------------------------------------------------------- world


class World:
    """One row's world: counters, the agent, the session, the store."""

    def __init__(self, tmp_path: Path, transport: str, *, terminal: bool) -> None:
        self.counters = Counters()
        self.hooks = CountingHooks(self.counters)
        self.transport = transport
        self.store: EventStore | None = None
        self.session: Session
        if transport == "store":
            self.store = SQLiteEventStore(tmp_path / "events.db")
            self.session = SQLiteSession(SESSION_ID, tmp_path / "session.db")
        else:
            self.session = MemorySession(SESSION_ID)
        tools = (
            counted_tool(self.counters, "charge", lambda x: f"charged {x}",
                         needs_approval=True, guarded=True),
            counted_tool(self.counters, "notify", lambda: "notified", needs_approval=True),
        )
        if terminal:
            self.model = ScriptedModel([ModelResponse((("charge", "charge", {"x": 7}),))])
            self.agent = Agent("billing", self.model, tools[:1],
                               tool_use_behavior="stop_on_first_tool")
        else:
            self.model = ScriptedModel([
                ModelResponse((("charge", "charge", {"x": 7}), ("notify", "notify", {}))),
                ModelResponse(output="charged and notified"),
            ])
            self.agent = Agent("billing", self.model, tools)

    async def attempt(self, how: str, session: Session, *, agent: Agent | None = None,
                      **source: Any) -> RunResult:
        """One `Runner.run` or a fully consumed `Runner.run_streamed`."""
        options = {"session": session, "hooks": self.hooks, **source}
        if how == "run":
            return await Runner.run(agent or self.agent, **options)
        streamed = Runner.run_streamed(agent or self.agent, **options)
        kinds = [event.kind async for event in streamed.stream_events()]
        assert kinds  # the stream reported progress before it ended
        return streamed.result

    def source(self, controller: RunController) -> dict[str, Any]:
        """How the next attempt finds the run, by transport."""
        if self.transport == "live":
            return {"controller": controller}
        if self.transport == "json":
            return {"state": json.dumps(controller.to_json())}
        return {"store": self.store, "run_id": RUN_ID}

    def reload(self, controller: RunController) -> RunController:
        if self.transport == "live":
            return controller
        if self.transport == "json":
            return RunController.from_json(json.dumps(controller.to_json()))
        assert self.store is not None
        return RunController.load(self.store, RUN_ID)

    async def items(self) -> list[Any]:
        return await self.session.get_items()


def _count(items: list[Any], kind: str, call_id: str) -> int:
    return sum(1 for i in items if i.get("type") == kind and i.get("call_id") == call_id)


async def _failing_attempt(world: World, how: str, outcome: str,
                           controller: RunController) -> RunController:
    """Resume the run through a session whose next write fails; return the controller
    as the failing attempt left it. The original error must reach the caller (I6)."""
    flaky = FlakySession(world.session, fail_on=1, outcome=OUTCOMES[outcome])  # type: ignore[arg-type]
    expected = asyncio.CancelledError if outcome == "cancellation" else InjectedWriteError
    with pytest.raises(expected) as info:
        await world.attempt(how, flaky, controller=controller)
    assert info.value is flaky.raised
    return controller


async def _restore_to_frontier(world: World, frontier: int) -> None:
    """What an operator does after a partial write: trim the Session back to P."""
    while len(await world.items()) > frontier:
        await world.session.pop_item()


# ------------------------------------------------------------ partial approval


async def partial_approval(tmp_path: Path, failing: str, recovery: str, transport: str,
                           outcome: str) -> tuple[World, RunResult]:
    world = World(tmp_path, transport, terminal=False)
    first = await Runner.run(world.agent, "charge me 7 and notify me", session=world.session,
                             store=world.store, run_id=RUN_ID, hooks=world.hooks)
    assert [c.call_id for c in first.interruptions] == ["charge", "notify"]
    c = first.controller
    c.approve("charge", fingerprint=c.fingerprint("charge"))
    frontier = len(await world.items())

    c = await _failing_attempt(world, failing, outcome, c)
    assert c.step is Step.UNSETTLED
    assert c.pending_approvals == ("notify",)
    c = world.reload(c)
    before = c.events
    with pytest.raises(PublicationUnsettled):
        c.approve("notify")
    with pytest.raises(PublicationUnsettled):
        c.begin_model_call()
    assert c.events == before

    if outcome == "partial-write":
        with pytest.raises(ReconcileRejected, match="partial write"):
            await world.attempt(recovery, world.session, **world.source(c))
        assert world.reload(c).envelope is not None  # kept
        await _restore_to_frontier(world, frontier)
        c = world.reload(c)
    result = await world.attempt(recovery, world.session, **world.source(c))
    return world, result


@pytest.mark.invariant("I1", "I2", "I3", "I4", "I6", "I7", "I8")
@pytest.mark.parametrize("outcome", list(OUTCOMES))
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("recovery", ATTEMPTS)
@pytest.mark.parametrize("failing", ATTEMPTS)
def test_partial_approval(tmp_path: Path, failing: str, recovery: str, transport: str,
                          outcome: str) -> None:
    async def go() -> None:
        world, result = await partial_approval(tmp_path, failing, recovery, transport, outcome)
        n = world.counters
        assert n.tools["charge"] == 1
        assert n.guardrails == {"charge_input": 1, "charge_output": 1}
        assert n.hooks["tool_start:charge"] == n.hooks["tool_end:charge"] == 1
        items = await world.items()
        assert _count(items, "function_call", "charge") == 1
        assert _count(items, "function_call_output", "charge") == 1
        assert [g.name for g in result.guardrail_results] == ["charge_input", "charge_output"]
        durable = world.reload(result.controller)
        assert durable.guardrail_results == result.guardrail_results
        assert [c.call_id for c in result.interruptions] == ["notify"]
        assert world.model.calls == 1

        c = result.controller
        c.approve("notify")
        done = await Runner.run(world.agent, session=world.session, hooks=world.hooks,
                                **world.source(c))
        assert done.step is Step.COMPLETED
        assert done.final_output == "charged and notified"
        assert n.tools == {"charge": 1, "notify": 1}
        assert [g.name for g in done.guardrail_results] == ["charge_input", "charge_output"]
        items = await world.items()
        assert _count(items, "function_call_output", "charge") == 1
        assert _count(items, "function_call_output", "notify") == 1
        await _assert_streaming_parity(tmp_path, "partial", failing, recovery, transport,
                                       outcome, done.controller, items)

    asyncio.run(go())


# ------------------------------------------------------------- terminal output


async def terminal_output(tmp_path: Path, failing: str, recovery: str, transport: str,
                          outcome: str, policy: RecoveryPolicy) -> tuple[World, Any]:
    world = World(tmp_path, transport, terminal=True)
    first = await Runner.run(world.agent, "charge me 7", session=world.session,
                             store=world.store, run_id=RUN_ID, hooks=world.hooks,
                             policy=policy)
    c = first.controller
    c.approve("charge")
    frontier = len(await world.items())
    c = await _failing_attempt(world, failing, outcome, c)
    if policy is RecoveryPolicy.FAIL_CLOSED:
        return world, c
    c = world.reload(c)
    if outcome == "partial-write":
        with pytest.raises(ReconcileRejected, match="partial write"):
            await world.attempt(recovery, world.session, **world.source(c))
        await _restore_to_frontier(world, frontier)
        c = world.reload(c)
    return world, await world.attempt(recovery, world.session, **world.source(c))


@pytest.mark.invariant("I1", "I3", "I6", "I8", "I9")
@pytest.mark.parametrize("policy", list(RecoveryPolicy), ids=lambda p: p.value)
@pytest.mark.parametrize("outcome", list(OUTCOMES))
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("recovery", ATTEMPTS)
@pytest.mark.parametrize("failing", ATTEMPTS)
def test_terminal_output(tmp_path: Path, failing: str, recovery: str, transport: str,
                         outcome: str, policy: RecoveryPolicy) -> None:
    async def go() -> None:
        world, outcome_of = await terminal_output(tmp_path, failing, recovery, transport,
                                                  outcome, policy)
        n = world.counters
        assert n.tools["charge"] == 1
        assert n.hooks["agent_start"] == n.hooks["agent_end"] == 1
        if policy is RecoveryPolicy.RECONCILE:
            result = outcome_of
            assert result.step is Step.COMPLETED
            assert result.final_output == "charged 7"
            assert world.model.calls == 1  # no further model call
            items = await world.items()
            assert _count(items, "function_call_output", "charge") == 1
            assert items[-1] == {"role": "assistant", "content": "charged 7"}
            await _assert_streaming_parity(tmp_path, "terminal", failing, recovery, transport,
                                           outcome, result.controller, items)
            return
        failed = outcome_of
        reloaded = world.reload(failed)
        # the live controller of a cancelled write still holds its attempt: only it may
        # report the write (PUBLISH); every resume is refused all the same
        held = transport == "live" and outcome == "cancellation"
        assert reloaded.next_action() is (Action.PUBLISH if held else Action.NOT_RESUMABLE)
        assert RunController.from_json(reloaded.to_json()).next_action() is (
            Action.NOT_RESUMABLE)
        if world.store is not None:
            assert RunController.load(world.store, RUN_ID).next_action() is (
                Action.NOT_RESUMABLE)
        touched = Untouchable(SESSION_ID)
        refused = Agent("billing", touched, world.agent.tools,
                        tool_use_behavior="stop_on_first_tool")
        for _ in range(2):
            with pytest.raises(RunNotResumable):
                await world.attempt(recovery, touched, agent=refused,
                                    **world.source(reloaded))
        assert n.tools["charge"] == 1
        assert n.hooks["agent_end"] == 1

    asyncio.run(go())


# ----------------------------------------------------------- streaming parity (I8)

_REFERENCE: dict[tuple[str, ...], tuple[Any, list[Any]]] = {}


async def _assert_streaming_parity(tmp_path: Path, scenario: str, failing: str,
                                   recovery: str, transport: str, outcome: str,
                                   controller: RunController, items: list[Any]) -> None:
    """The durable state equals the one the same row leaves with run/run."""
    key = (scenario, transport, outcome)
    if key not in _REFERENCE:
        folder = tmp_path / "reference"
        folder.mkdir()
        if scenario == "partial":
            world, result = await partial_approval(folder, "run", "run", transport, outcome)
            result.controller.approve("notify")
            result = await Runner.run(world.agent, session=world.session, hooks=world.hooks,
                                      **world.source(result.controller))
        else:
            world, result = await terminal_output(folder, "run", "run", transport, outcome,
                                                  RecoveryPolicy.RECONCILE)
        _REFERENCE[key] = (world.reload(result.controller).to_json(), await world.items())
    durable, session_items = _REFERENCE[key]
    if (failing, recovery) != ("run", "run"):
        assert RunController.from_json(controller.to_json()).to_json() == durable
        assert items == session_items


# -------------------------------------------------------------------- one more


@pytest.mark.invariant("I1", "I3", "I7")
def test_a_hung_write_blocks_append_until_taken_over(tmp_path: Path) -> None:
    async def go() -> None:
        world = World(tmp_path, "json", terminal=False)
        first = await Runner.run(world.agent, "charge", session=world.session,
                                 run_id=RUN_ID, hooks=world.hooks)
        c = first.controller
        c.approve("charge")
        flaky = FlakySession(world.session, fail_on=1, outcome="hang")
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(Runner.run(world.agent, session=flaky, controller=c,
                                              hooks=world.hooks), timeout=0.2)
        state = json.dumps(c.to_json())
        with pytest.raises(ReconcileRejected, match="may still be writing"):
            await Runner.run(world.agent, session=world.session, state=state,
                             hooks=world.hooks)
        result = await Runner.run(world.agent, session=world.session, state=state,
                                  hooks=world.hooks, take_over=True)
        assert [i.call_id for i in result.interruptions] == ["notify"]
        assert world.counters.tools["charge"] == 1
        assert _count(await world.items(), "function_call_output", "charge") == 1

    asyncio.run(go())
