"""The openai-agents adapter (statemachine.adapters.openai_agents), offline: the SDK's own
`agents.testing.ScriptedModel` answers, nothing touches the network.

The differential test runs each of the three behaviours of issue #14 on the SDK alone
(what openai-agents 0.24 does, recorded as it is) and through the adapter (what it
prevents), for both `Runner.run` and `Runner.run_streamed`, for the four write faults of
the seed matrix, and — through the adapter — with the recovery in the same process (live)
or in a new `AgentRun` loaded from the store with the SDK state saved at the interruption
(store). Then: kill -9 inside a tool, and two processes resuming one paused run.

Under CI a missing ``agents`` package fails this module instead of skipping it.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, cast

import pytest

try:
    import agents  # noqa: F401
except ImportError:  # pragma: no cover - CI installs the extra
    from tests.helpers import missing_extra

    missing_extra("openai-agents")

from agents import (
    Agent,
    GuardrailFunctionOutput,
    InputGuardrailTripwireTriggered,
    ModelProvider,
    ModelSettings,
    OutputGuardrailTripwireTriggered,
    RunConfig,
    RunHooks,
    Runner,
    SQLiteSession,
    ToolGuardrailFunctionOutput,
    function_tool,
    handoff,
    input_guardrail,
    output_guardrail,
    set_tracing_disabled,
    tool_input_guardrail,
    tool_output_guardrail,
)
from agents.exceptions import (
    ModelBehaviorError,
    ToolInputGuardrailTripwireTriggered,
    ToolOutputGuardrailTripwireTriggered,
    UserError,
)
from agents.mcp import MCPServer
from agents.testing import ScriptedModel, assistant_message, function_call
from mcp.types import CallToolResult, TextContent
from mcp.types import Tool as MCPTool

from statemachine import (
    ConcurrencyConflict,
    InvalidTransition,
    MemoryEventStore,
    Phase,
    PublicationUnsettled,
    ReconcileRejected,
    RecoveryPolicy,
    RunController,
    RunNotResumable,
    SchemaError,
    Step,
    ToolInDoubt,
)
from statemachine.adapters.openai_agents import (
    AgentRun,
    AgentRunResult,
    SDKStateRequired,
    UnsupportedFeature,
)
from statemachine.events import HandedOff, RunClaimed
from statemachine.stores import AsyncSQLiteEventStore, SQLiteEventStore
from statemachine.testing import FlakySession, InjectedWriteError
from tests.adapters.dying import Crash, DiesWithItsProcess
from tests.drivers.effects import Effects
from tests.drivers.openai_agents_driver import Receipt

set_tracing_disabled(True)
CONFIG = RunConfig(tracing_disabled=True)
ROOT = Path(__file__).resolve().parents[2]
RUN_ID = "adapter-run"
SESSION_ID = "adapter-session"
FAULTS = {"atomic-no-commit": "atomic", "commit-then-raise": "commit_then_raise",
          "partial-write": "partial", "cancellation": "cancel"}
MODES = ["run", "run_streamed"]
NEVER = 10**9

APPROVAL = "approval-while-unsettled"
TERMINAL = "terminal-output"
STREAMED = "cancelled-append"
SCENARIOS = [APPROVAL, TERMINAL, STREAMED]


# ---------------------------------------------------------------------------- world


class Hooks(RunHooks[Any]):
    """SDK run hooks that count into ``effects`` (``hook agent_start``...)."""

    def __init__(self, effects: Counter[str]) -> None:
        self.effects = effects

    async def on_agent_start(self, context: Any, agent: Any) -> None:
        self.effects["hook agent_start"] += 1

    async def on_agent_end(self, context: Any, agent: Any, output: Any) -> None:
        self.effects["hook agent_end"] += 1

    async def on_llm_start(self, context: Any, agent: Any, system_prompt: Any,
                           input_items: Any) -> None:
        self.effects["hook llm_start"] += 1

    async def on_tool_start(self, context: Any, agent: Any, tool: Any) -> None:
        self.effects[f"hook tool_start {tool.name}"] += 1

    async def on_tool_end(self, context: Any, agent: Any, tool: Any, result: Any) -> None:
        self.effects[f"hook tool_end {tool.name}"] += 1


def build_agent(scenario: str, effects: Counter[str]) -> tuple[Agent[Any], ScriptedModel]:
    """The scenario's agent on a scripted model; every effect counts in ``effects``.

    * approval-while-unsettled: one response proposes charge, notify and log, all needing
      approval; the caller approves charge and rejects log, so notify still awaits a
      decision when the batch (charge's output, log's rejection) is written;
    * terminal-output: charge (approved) and log (rejected) with ``stop_on_first_tool``:
      charge's output is the final output, accepted before its batch is written;
    * cancelled-append: pay needs no approval; its batch is the run's second write."""

    @tool_input_guardrail
    def charge_input(data: Any) -> ToolGuardrailFunctionOutput:
        effects["guardrail charge_input"] += 1
        return ToolGuardrailFunctionOutput.allow()

    @tool_output_guardrail
    def charge_output(data: Any) -> ToolGuardrailFunctionOutput:
        effects["guardrail charge_output"] += 1
        return ToolGuardrailFunctionOutput.allow()

    @function_tool(needs_approval=True, tool_input_guardrails=[charge_input],
                   tool_output_guardrails=[charge_output])
    def charge(x: int) -> str:
        effects["tool charge"] += 1
        return f"charged {x}"

    @function_tool(needs_approval=True)
    def notify() -> str:
        effects["tool notify"] += 1
        return "notified"

    @function_tool(needs_approval=True)
    def log() -> str:
        effects["tool log"] += 1
        return "logged"

    @function_tool
    def pay(x: int) -> str:
        effects["tool pay"] += 1
        return f"paid {x}"

    @output_guardrail
    def final_check(context: Any, agent: Any, output: Any) -> GuardrailFunctionOutput:
        effects["guardrail final_check"] += 1
        return GuardrailFunctionOutput(output_info={"checked": True}, tripwire_triggered=False)

    if scenario == APPROVAL:
        model = ScriptedModel([
            [function_call("charge", {"x": 7}, call_id="c1"),
             function_call("notify", {}, call_id="c2"), function_call("log", {}, call_id="c3")],
            [assistant_message("charged and notified")]])
        return Agent("billing", model=model, tools=[charge, notify, log],
                     output_guardrails=[final_check]), model
    if scenario == TERMINAL:
        model = ScriptedModel([[function_call("charge", {"x": 7}, call_id="c1"),
                                function_call("log", {}, call_id="c3")]])
        return Agent("billing", model=model, tools=[charge, log],
                     tool_use_behavior="stop_on_first_tool"), model
    model = ScriptedModel([[function_call("pay", {"x": 7}, call_id="c1")],
                           [assistant_message("paid")]])
    return Agent("billing", model=model, tools=[pay], output_guardrails=[final_check]), model


class World:
    def __init__(self, scenario: str, fault: str) -> None:
        self.scenario = scenario
        self.effects: Counter[str] = Counter()
        self.agent, self.model = build_agent(scenario, self.effects)
        self.hooks = Hooks(self.effects)
        self.inner = SQLiteSession(SESSION_ID, ":memory:")
        self.session: Any = FlakySession(self.inner, fail_on=NEVER,
                                         outcome=FAULTS[fault])  # type: ignore[arg-type]
        self.store = MemoryEventStore()

    def arm(self) -> None:
        """Fail the next write of the failing attempt: its batch of tool results."""
        self.session.fail_on = self.session.add_calls + (2 if self.scenario == STREAMED
                                                         else 1)

    async def items(self) -> list[Any]:
        return list(await self.inner.get_items())

    async def dangling(self) -> list[str]:
        """Calls the Session holds without an output."""
        items = await self.items()
        answered = {i.get("call_id") for i in items if i.get("type") == "function_call_output"}
        return [i["call_id"] for i in items
                if i.get("type") == "function_call" and i["call_id"] not in answered]

    async def count(self, kind: str, call_id: str) -> int:
        return sum(1 for i in await self.items()
                   if i.get("type") == kind and i.get("call_id") == call_id)

    async def trim(self, length: int) -> None:
        """What an operator does after a partial write: trim back to the frontier."""
        while len(await self.items()) > length:
            await self.inner.pop_item()


def expected_error(fault: str) -> type[BaseException]:
    return asyncio.CancelledError if fault == "cancellation" else InjectedWriteError


# ------------------------------------------------------------------- the SDK alone


async def sdk_attempt(mode: str, agent: Agent[Any], input: Any, session: Any,
                      hooks: Hooks) -> Any:
    if mode == "run":
        return await Runner.run(agent, input, session=session, hooks=hooks, run_config=CONFIG)
    streamed = Runner.run_streamed(agent, input, session=session, hooks=hooks,
                                   run_config=CONFIG)
    async for _ in streamed.stream_events():
        pass
    return streamed


async def sdk_alone(scenario: str, fault: str, mode: str) -> dict[str, Any]:
    """One cell on the SDK alone: what it does, as observed."""
    world = World(scenario, fault)
    seen: dict[str, Any] = {}
    state: Any = None
    if scenario in (APPROVAL, TERMINAL):
        paused = await Runner.run(world.agent, "charge me 7", session=world.session,
                                  hooks=world.hooks, run_config=CONFIG)
        state = paused.to_state()
        for item in paused.interruptions:
            if item.call_id == "c1":
                state.approve(item)
            elif item.call_id == "c3":
                state.reject(item, rejection_message="no logging")
    world.arm()
    try:
        result = await sdk_attempt(mode, world.agent, state or "pay 7", world.session,
                                   world.hooks)
        seen["failing"] = f"returned, final_output={result.final_output!r}"
    except BaseException as error:
        seen["failing"] = f"raised {type(error).__name__}"
        seen["original"] = error is world.session.raised
    seen["dangling"] = await world.dangling()
    if scenario == APPROVAL:
        (notify,) = [i for i in state.get_interruptions() if i.call_id == "c2"]
        state.approve(notify)  # the SDK takes it: no error
        seen["approval"] = "accepted"
    if state is not None:
        try:
            result = await Runner.run(world.agent, state, session=world.session,
                                      hooks=world.hooks, run_config=CONFIG)
            seen["resume"] = f"returned, final_output={result.final_output!r}"
        except UserError as error:
            seen["resume"] = "raised UserError: " + (
                "unrecoverable" if "unrecoverable" in str(error) else "cannot reconcile")
    seen["pay ran"] = world.effects["tool pay"]
    seen["outputs"] = await world.count("function_call_output", "c1")
    return seen


def sdk_expected(scenario: str, fault: str, mode: str) -> dict[str, Any]:
    """What openai-agents 0.24.0 does in each cell (observed; the issue's claims hold
    where this says so, and the notes below say where the SDK goes further)."""
    swallowed = mode == "run_streamed" and fault == "cancellation"
    seen: dict[str, Any] = {}
    if swallowed:  # (3): a streamed run whose append is cancelled ends cleanly, no output
        seen["failing"] = "returned, final_output=None"
    else:
        seen["failing"] = f"raised {expected_error(fault).__name__}"
        seen["original"] = True
    if scenario == APPROVAL:
        # (1) the approval is accepted while the write is unsettled; 0.24 then settles
        # its own live pending write before the next tool, except a partial write
        seen["dangling"] = {"atomic-no-commit": ["c1", "c2", "c3"],
                            "partial-write": ["c2", "c3"]}.get(fault, ["c2"])
        seen["approval"] = "accepted"
        seen["resume"] = ("raised UserError: cannot reconcile" if fault == "partial-write"
                          else "returned, final_output='charged and notified'")
        seen["outputs"] = 1
    elif scenario == TERMINAL:
        # (2) nothing committed: the Session holds the payment call without its output,
        # and the SDK's terminal marker refuses every resume, so it stays that way
        seen["dangling"] = {"atomic-no-commit": ["c1", "c3"],
                            "partial-write": ["c3"]}.get(fault, [])
        seen["resume"] = "raised UserError: unrecoverable"
        seen["outputs"] = 0 if fault == "atomic-no-commit" else 1
    else:
        # a fresh run leaves no RunState to resume: pay ran, and after an atomic failure
        # the Session holds nothing of it; after a partial one, its call without output
        seen["dangling"] = ["c1"] if fault == "partial-write" else []
        seen["outputs"] = 0 if fault in ("atomic-no-commit", "partial-write") else 1
    seen["pay ran"] = 1 if scenario == STREAMED else 0
    return seen


# ------------------------------------------------------------------- the adapter


async def adapter_attempt(mode: str, run: AgentRun, world: World, input: Any = None,
                          **options: Any) -> AgentRunResult:
    if mode == "run":
        return await run.run(input, hooks=world.hooks, run_config=CONFIG, **options)
    streamed = run.run_streamed(input, hooks=world.hooks, run_config=CONFIG, **options)
    async for _ in streamed.stream_events():
        pass
    return streamed.result


async def open_run(world: World, policy: RecoveryPolicy = RecoveryPolicy.RECONCILE
                   ) -> AgentRun:
    return await AgentRun.open(world.agent, run_id=RUN_ID, session=world.session,
                               store=world.store, policy=policy)


async def failing_attempt(world: World, fault: str, mode: str, policy: RecoveryPolicy
                          ) -> tuple[AgentRun, str | None, int]:
    """Pause (scenarios 1 and 2: approve charge, reject log), then the attempt whose
    write fails. Returns the run, the SDK state saved at the interruption, and the
    Session's length before the failing write (the frontier)."""
    run = await open_run(world, policy)
    saved: str | None = None
    input: str | None = "pay 7"
    if world.scenario in (APPROVAL, TERMINAL):
        paused = await run.run("charge me 7", hooks=world.hooks, run_config=CONFIG)
        assert paused.step is Step.INTERRUPTION
        assert paused.state is not None
        saved = paused.state.to_string()
        for item in paused.interruptions:
            if item.call_id == "c1":
                await run.approve(item)
            elif item.call_id == "c3":
                await run.reject(item, "no logging")
        input = None
    frontier = len(await world.items())
    world.arm()
    with pytest.raises(expected_error(fault)) as info:
        await adapter_attempt(mode, run, world, input)
    assert info.value is world.session.raised  # the write's own error, in both modes (I6)
    if world.scenario == STREAMED:
        frontier += 1  # the user's input was written first
    return run, saved, frontier


async def next_attempt(world: World, run: AgentRun, transport: str, saved: str | None,
                       policy: RecoveryPolicy) -> tuple[AgentRun, dict[str, Any]]:
    """The run as the recovering attempt finds it: this process's `AgentRun` (live), or
    a new one loaded from the store with the SDK state saved at the interruption."""
    if transport == "live":
        return run, {}
    return await open_run(world, policy), ({"state": saved} if saved is not None else {})


async def adapter(scenario: str, fault: str, mode: str, transport: str,
                  policy: RecoveryPolicy) -> None:
    world = World(scenario, fault)
    run, saved, frontier = await failing_attempt(world, fault, mode, policy)
    c = run.controller
    failed_closed = policy is RecoveryPolicy.FAIL_CLOSED and fault != "cancellation"
    assert c.step is (Step.TERMINAL_UNRECOVERABLE if failed_closed else Step.UNSETTLED)

    run, options = await next_attempt(world, run, transport, saved, policy)
    c = run.controller
    before = c.events
    if policy is RecoveryPolicy.FAIL_CLOSED:
        # (2) fail closed: every later attempt is refused before any work
        for _ in range(2):
            with pytest.raises(RunNotResumable):
                await adapter_attempt(mode, run, world, **options)
            with pytest.raises(RunNotResumable):
                await run.approve("c1")
        assert c.events == before
        assert world.effects["tool charge"] == 1
        assert len(world.model.calls) == 1
        return

    # (1) and new input: refused while the write is unsettled, and nothing recorded
    if scenario == APPROVAL:
        with pytest.raises(PublicationUnsettled):
            await run.approve("c2")
        with pytest.raises(PublicationUnsettled):
            await run.reject("c2")
    assert c.events == before
    envelope, pending = c.envelope, c.pending_approvals
    with pytest.raises(PublicationUnsettled):
        await adapter_attempt(mode, run, world, "and one more thing", **options)
    # the refused attempt recorded its claim (§6.3: first, changing nothing) and no input
    assert [type(e).__name__ for e in c.events[len(before):]] == ["RunClaimed"]
    assert (c.step, c.envelope, c.pending_approvals) == (Step.UNSETTLED, envelope, pending)
    assert not c.unpublished_input

    if fault == "partial-write":
        with pytest.raises(ReconcileRejected, match="partial write"):
            await adapter_attempt(mode, run, world, **options)
        assert c.step is Step.UNSETTLED  # the envelope is kept
        await world.trim(frontier)
    result = await adapter_attempt(mode, run, world, **options)

    if scenario == APPROVAL:
        assert result.step is Step.INTERRUPTION
        assert [call.call_id for call in result.pending] == ["c2"]
        assert world.effects["tool charge"] == 1
        await run.approve("c2")
        result = await adapter_attempt(mode, run, world, **options)
        assert result.final_output == "charged and notified"
        assert await world.count("function_call_output", "c2") == 1
        assert world.effects["tool notify"] == 1
        assert world.effects["guardrail final_check"] == 1
    elif scenario == TERMINAL:
        assert result.final_output == "charged 7"
        assert len(world.model.calls) == 1  # recovered from the ledger: no model call
    else:
        assert result.final_output == "paid"
        assert world.effects["tool pay"] == 1
    assert result.step is Step.COMPLETED
    assert await world.dangling() == []
    assert await world.count("function_call_output", "c1") == 1  # exactly one copy (I3)
    assert world.effects["tool charge"] <= 1
    assert world.effects["tool log"] == 0
    for effect in ("guardrail charge_input", "guardrail charge_output",
                   "hook tool_start charge", "hook tool_end charge", "hook agent_start",
                   "hook agent_end"):
        assert world.effects[effect] <= 1, effect  # hooks and guardrails once each (I1)
    durable = RunController.load(world.store, RUN_ID)
    assert durable.step is Step.COMPLETED
    assert durable.guardrail_results == run.controller.guardrail_results


# ----------------------------------------------------------- the differential test


POLICIES = {APPROVAL: [RecoveryPolicy.RECONCILE], STREAMED: [RecoveryPolicy.RECONCILE],
            TERMINAL: list(RecoveryPolicy)}


@pytest.mark.invariant("I1", "I2", "I3", "I6", "I7", "I9")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fault", list(FAULTS))
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_differential(scenario: str, fault: str, mode: str) -> None:
    """The same cell on the SDK alone (as openai-agents 0.24 behaves) and through the
    adapter (what it prevents), recovered live and from the store, under each policy."""
    observed = asyncio.run(sdk_alone(scenario, fault, mode))
    assert observed == sdk_expected(scenario, fault, mode)
    for transport in ("live", "store"):
        for policy in POLICIES[scenario]:
            asyncio.run(adapter(scenario, fault, mode, transport, policy))


# ---------------------------------------------------------------- the tools


@pytest.mark.invariant("I1", "I12")
def test_a_completed_call_is_resent_never_run_again() -> None:
    """The tool completed and the attempt died before its batch was written (its end hook
    raised): a new process resuming from the store and the saved SDK state gets the cached
    result (Resend); the tool body never runs again and its output is written once."""

    class FailingEndHook(Hooks):
        async def on_tool_end(self, context: Any, agent: Any, tool: Any, result: Any) -> None:
            await super().on_tool_end(context, agent, tool, result)
            if self.effects[f"hook tool_end {tool.name}"] == 1:
                raise RuntimeError("the end hook failed")

    async def go() -> None:
        world = World(APPROVAL, "atomic-no-commit")
        world.hooks = FailingEndHook(world.effects)
        run = await open_run(world)
        paused = await run.run("charge me 7", hooks=world.hooks, run_config=CONFIG)
        assert paused.state is not None
        saved = paused.state.to_string()
        for item in paused.interruptions:
            await (run.approve(item) if item.call_id == "c1" else run.reject(item))
        with pytest.raises(UserError, match="end hook failed"):  # the SDK wraps it
            await run.run(hooks=world.hooks, run_config=CONFIG)
        assert run.controller.phase("c1") is Phase.COMPLETED
        assert await world.count("function_call_output", "c1") == 0

        again = await open_run(world)  # as a new process would: store + saved state
        done = await again.run(state=saved, hooks=world.hooks, run_config=CONFIG)
        assert done.step is Step.COMPLETED
        assert world.effects["tool charge"] == 1
        assert world.effects["hook tool_start charge"] == 1
        assert world.effects["hook tool_end charge"] == 2  # it raised before its record
        assert await world.count("function_call_output", "c1") == 1
        assert await world.dangling() == []

    asyncio.run(go())


@pytest.mark.invariant("I11")
@pytest.mark.parametrize("mode", MODES)
def test_an_interrupted_tool_is_in_doubt_and_never_run_again(mode: str) -> None:
    """A tool cancelled mid-body (the caller's task cancelled, or the stream's consumer
    stopping early) is reported with tool_interrupted: the same run, and a run loaded
    from the store, answer ToolInDoubt and never run it again."""

    async def go() -> None:
        effects: Counter[str] = Counter()

        @function_tool
        async def slow(x: int) -> str:
            effects["slow"] += 1
            await asyncio.Event().wait()
            return "done"

        model = ScriptedModel([[function_call("slow", {"x": 1}, call_id="s1")]])
        agent = Agent("slow", model=model, tools=[slow])
        session = SQLiteSession("cancel", ":memory:")
        store = MemoryEventStore()
        run = await AgentRun.open(agent, run_id="cancelled", session=session, store=store)
        if mode == "run":
            task = asyncio.ensure_future(run.run("go", run_config=CONFIG))
            while not effects["slow"]:
                await asyncio.sleep(0.001)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        else:
            events = run.run_streamed("go", run_config=CONFIG).stream_events()
            async for event in events:
                if getattr(event, "name", None) == "tool_called":
                    while not effects["slow"]:
                        await asyncio.sleep(0.001)
                    break  # the consumer stops early while the tool runs
            await events.aclose()  # type: ignore[attr-defined]
        c = run.controller
        assert c.phase("s1") is Phase.STARTED
        assert c.in_flight == ()  # reported: tool_interrupted
        with pytest.raises(ToolInDoubt):
            await run.run(run_config=CONFIG)
        again = await AgentRun.open(agent, run_id="cancelled", session=session, store=store)
        with pytest.raises(ToolInDoubt):
            await again.run(run_config=CONFIG)
        assert effects["slow"] == 1

    asyncio.run(go())


def test_an_async_store_with_tools_running_concurrently(tmp_path: Path) -> None:
    """An async store buffers; the SDK runs both approved calls of one response
    concurrently and each start is flushed before its body, one flush at a time."""

    async def go() -> None:
        world = World(APPROVAL, "atomic-no-commit")
        store = AsyncSQLiteEventStore(tmp_path / "events.db")
        run = await AgentRun.open(world.agent, run_id=RUN_ID, session=world.session,
                                  store=store)
        paused = await run.run("charge me 7", hooks=world.hooks, run_config=CONFIG)
        assert paused.state is not None
        saved = paused.state.to_string()
        for item in paused.interruptions:  # charge and notify approved, log rejected
            await (run.reject(item) if item.call_id == "c3" else run.approve(item))
        again = await AgentRun.open(world.agent, run_id=RUN_ID, session=world.session,
                                    store=store)
        done = await again.run(state=saved, hooks=world.hooks, run_config=CONFIG)
        assert done.final_output == "charged and notified"
        assert (world.effects["tool charge"], world.effects["tool notify"]) == (1, 1)
        durable = await RunController.load_async(store, RUN_ID)
        assert durable.step is Step.COMPLETED
        assert durable.version == again.controller.version

    asyncio.run(go())


def test_a_sync_store_reopened_keeps_the_buffering_asked_for(tmp_path: Path) -> None:
    """``buffered=`` on a sync store holds for a run opened again too: a claim waits for
    the next flush when buffered, and is appended at once when not."""

    async def go() -> None:
        world = World(APPROVAL, "atomic-no-commit")
        store = SQLiteEventStore(tmp_path / "events.db")
        run = await AgentRun.open(world.agent, run_id=RUN_ID, session=world.session,
                                  store=store)
        await run.run("charge me 7", hooks=world.hooks, run_config=CONFIG)
        for buffered in (True, False):
            again = await AgentRun.open(world.agent, run_id=RUN_ID, session=world.session,
                                        store=store, buffered=buffered)
            stored = len(store.load(RUN_ID))
            again.controller.claim(f"worker-{buffered}")
            assert len(store.load(RUN_ID)) == stored + (0 if buffered else 1)
            again.controller.flush()
            assert len(store.load(RUN_ID)) == stored + 1

    asyncio.run(go())


def test_arguments_other_than_the_approved_ones_never_run() -> None:
    async def go() -> None:
        world = World(TERMINAL, "atomic-no-commit")
        run = await open_run(world)
        paused = await run.run("charge me 7", hooks=world.hooks, run_config=CONFIG)
        item = next(i for i in paused.interruptions if i.call_id == "c1")
        item.raw_item.arguments = '{"x": 700}'  # type: ignore[union-attr]
        with pytest.raises(InvalidTransition, match="fingerprint"):
            await run.approve(item)  # the approval binds to what the human was shown
        assert run.controller.phase("c1") is Phase.AWAITING
        assert world.effects["tool charge"] == 0

    asyncio.run(go())


def test_a_turn_resumed_without_its_sdk_state_replays_its_recorded_response() -> None:
    """A new process without the SDK state saved at the interruption: the recorded model
    response is replayed (the model is not asked again), the approved call runs once, the
    SDK pauses again for the calls still awaiting a decision, and nothing is written
    twice. A rejection not yet written is the one thing only the SDK state carries."""

    async def go() -> None:
        world = World(APPROVAL, "atomic-no-commit")
        run = await open_run(world)
        await run.run("charge me 7", hooks=world.hooks, run_config=CONFIG)
        await run.approve("c1")
        fresh = await open_run(world)
        paused = await fresh.run(hooks=world.hooks, run_config=CONFIG)
        assert paused.step is Step.INTERRUPTION
        assert [call.call_id for call in paused.pending] == ["c2", "c3"]
        assert {item.call_id for item in paused.interruptions} == {"c2", "c3"}
        assert world.effects["tool charge"] == 1
        assert len(world.model.calls) == 1  # replayed, not asked again
        for kind in ("function_call", "function_call_output"):
            assert await world.count(kind, "c1") == 1
        assert await world.count("function_call", "c2") == 1

        await fresh.approve("c2")
        await fresh.reject("c3", "no logging")
        again = await open_run(world)
        with pytest.raises(SDKStateRequired):
            await again.run(run_config=CONFIG)
        assert paused.state is not None
        done = await again.run(state=paused.state.to_string(), run_config=CONFIG)
        assert done.final_output == "charged and notified"
        assert (world.effects["tool charge"], world.effects["tool notify"],
                world.effects["tool log"]) == (1, 1, 0)
        assert await world.dangling() == []

    asyncio.run(go())


@pytest.mark.invariant("I1")
def test_hooks_and_guardrails_are_recorded_once() -> None:
    async def go() -> None:
        world = World(APPROVAL, "atomic-no-commit")
        run = await open_run(world)
        paused = await run.run("charge me 7", hooks=world.hooks, run_config=CONFIG)
        for item in paused.interruptions:
            await (run.approve(item) if item.call_id != "c3" else run.reject(item, "no"))
        done = await run.run(hooks=world.hooks, run_config=CONFIG)
        assert done.step is Step.COMPLETED
        assert world.effects["hook agent_start"] == 1  # the SDK calls it on every resume
        assert world.effects["guardrail charge_input"] == 1
        c = run.controller
        assert {(g.name, g.stage) for g in c.guardrail_results} == {
            ("charge_input", "tool_input"), ("charge_output", "tool_output"),
            ("final_check", "output")}
        assert c.hook_done("tool_start", call_id="c1")
        assert c.hook_done("agent_end")

    asyncio.run(go())


# ----------------------------------------------------------------- processes


SESSION_ID_DRIVER = "oa-session"
"""The Session of the driver's run (tests/drivers/openai_agents_driver.py)."""


def _driver(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tests.drivers.openai_agents_driver", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)


def _effects(folder: Path) -> list[str]:
    path = folder / "effects.txt"
    return path.read_text().splitlines() if path.exists() else []


@pytest.mark.invariant("I11")
@pytest.mark.parametrize("paused", [True, False], ids=["approved-call", "fresh-run"])
def test_kill_9_inside_a_tool_then_resume_in_a_new_process(tmp_path: Path,
                                                           paused: bool) -> None:
    if paused:
        assert _driver("pause", str(tmp_path)).returncode == 0
    crashed = _driver("crash" if paused else "crash-fresh", str(tmp_path))
    assert crashed.returncode == -9, crashed.stderr
    tool = "tool charge" if paused else "tool pay"
    assert _effects(tmp_path).count(f"crash {tool}") == 1
    resumed = json.loads(_driver("resume", str(tmp_path), "resumer").stdout)
    assert resumed.pop("message").endswith("Record its outcome with resolve_in_doubt, or "
                                           "abandon the run")
    assert resumed == {"name": "resumer", "outcome": "error", "error": "ToolInDoubt",
                       "step": "tools"}
    assert not [line for line in _effects(tmp_path) if line.startswith("resumer")]
    assert [line for line in _effects(tmp_path) if line.endswith(tool)] == [f"crash {tool}"]


@pytest.mark.invariant("I1", "I7")
def test_two_processes_resume_one_paused_run_and_one_proceeds(tmp_path: Path) -> None:
    assert _driver("pause", str(tmp_path)).returncode == 0
    racers = [subprocess.Popen([sys.executable, "-m", "tests.drivers.openai_agents_driver", "race",
                                str(tmp_path), name], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for name in ("A", "B")]
    outcomes = {}
    for racer in racers:
        out, err = racer.communicate(timeout=120)
        assert racer.returncode == 0, err
        answer = json.loads(out)
        outcomes[answer["name"]] = answer
    winners = [n for n, a in outcomes.items() if a["outcome"] == "completed"]
    losers = [n for n, a in outcomes.items() if a["outcome"] == "error"]
    assert (len(winners), len(losers)) == (1, 1), outcomes
    assert outcomes[losers[0]]["error"] == ConcurrencyConflict.__name__
    effects = _effects(tmp_path)
    assert not [line for line in effects if line.startswith(losers[0])]  # nothing ran
    assert [line for line in effects if line.endswith("tool charge")] == [
        f"{winners[0]} tool charge"]


# ----------------------------------------- issue 23: the SDK's ordinary features, side by side
#
# Each row runs one scenario on the SDK alone (what openai-agents 0.24 does, as observed)
# and through the adapter; every paying tool, MCP tool and model call appends a line to an
# fsynced file (tests/drivers/effects.py), so what ran is counted outside the process.

PAID = "tool pay"


def _paying(effects: Effects, name: str = "pay", **options: Any) -> Any:
    def pay(x: int) -> str:
        effects(f"tool {name}")
        return f"paid {x}"

    return function_tool(pay, name_override=name, **options)


def _model(effects: Effects, *responses: Any) -> ScriptedModel:
    """A scripted model whose every answer is counted (``model``)."""

    class Counted(ScriptedModel):
        async def get_response(self, *args: Any, **kwargs: Any) -> Any:
            effects("model")
            return await super().get_response(*args, **kwargs)

        async def stream_response(self, *args: Any, **kwargs: Any) -> Any:
            effects("model")
            async for event in super().stream_response(*args, **kwargs):
                yield event

    return Counted(list(responses))


async def _sdk_run(agent: Agent[Any], input: Any, session: Any, mode: str = "run",
                   **options: Any) -> Any:
    if mode == "run":
        return await Runner.run(agent, input, session=session, run_config=CONFIG, **options)
    streamed = Runner.run_streamed(agent, input, session=session, run_config=CONFIG,
                                   **options)
    async for _ in streamed.stream_events():
        pass
    return streamed


async def _attempt(run: AgentRun, input: Any = None, mode: str = "run",
                   **options: Any) -> AgentRunResult:
    options.setdefault("run_config", CONFIG)
    if mode == "run":
        return await run.run(input, **options)
    streamed = run.run_streamed(input, **options)
    async for _ in streamed.stream_events():
        pass
    return streamed.result


def _count(effects: Effects) -> Counter[str]:
    """What ran in the world named ``effects.name`` (the file is shared)."""
    lines = (line.split(" ", 1) for line in effects.lines())
    return Counter(what for name, what in lines if name == effects.name)


def _outputs(items: list[Any]) -> dict[str, Any]:
    return {i["call_id"]: i["output"] for i in items if i.get("type") == "function_call_output"}


@pytest.mark.parametrize("mode", MODES)
def test_row01_an_agent_used_as_a_tool_runs_whole_as_its_calls_body(tmp_path: Path,
                                                                   mode: str) -> None:
    """Row 1: ``inner.as_tool(...)``. The SDK alone runs the nested agent (its model, its
    paying tool) and sends its answer; through the adapter the nested run is the outer
    call's body, run once with it, and the model is sent the same answer (before: the
    nested model call was refused inside and the run "completed" on error text)."""

    def world(name: str) -> tuple[Agent[Any], Effects]:
        effects = Effects(tmp_path, name)
        inner = Agent("inner", model=_model(effects, [function_call("pay", {"x": 5},
                                                                    call_id="n1")],
                                            [assistant_message("inner paid 5")]),
                      tools=[_paying(effects)])
        outer = Agent("outer", model=_model(effects, [function_call("ask_inner", {
            "input": "pay 5"}, call_id="o1")], [assistant_message("done")]),
            tools=[inner.as_tool("ask_inner", "asks the inner agent")])
        return outer, effects

    async def go() -> None:
        outer, alone = world("alone")
        session = SQLiteSession("alone", ":memory:")
        result = await _sdk_run(outer, "go", session, mode)
        assert result.final_output == "done"
        sdk_items = await session.get_items()
        assert _outputs(sdk_items) == {"o1": "inner paid 5"}
        assert _count(alone) == Counter({PAID: 1, "model": 4})

        outer, through = world("adapter")
        store = MemoryEventStore()
        session = SQLiteSession("adapted", ":memory:")
        run = await AgentRun.open(outer, run_id="row1", session=session, store=store)
        done = await _attempt(run, "go", mode)
        assert (done.step, done.final_output) == (Step.COMPLETED, "done")
        assert _outputs(await session.get_items()) == _outputs(sdk_items)
        assert _count(through) == Counter({PAID: 1, "model": 4})
        ledger = RunController.load(store, "row1")
        assert [(v.call.call_id, v.phase, v.starts, v.result) for v in ledger.calls] == [
            ("o1", Phase.PUBLISHED, 1, "inner paid 5")]  # the nested call is its body

    asyncio.run(go())


def test_row01_an_agent_tool_whose_agent_may_need_approval_is_refused_at_open() -> None:
    """A nested call needing approval would pause the outer run on a call its ledger
    does not know: refused when the run is opened, before anything is recorded."""
    inner = Agent("inner", tools=[function_tool(lambda: "x", name_override="gated",
                                                needs_approval=True)])
    outer = Agent("outer", tools=[inner.as_tool("ask_inner", "asks")])
    store = MemoryEventStore()
    with pytest.raises(UnsupportedFeature, match="ask_inner") as refused:
        asyncio.run(AgentRun.open(outer, run_id="r", session=SQLiteSession("s", ":memory:"),
                                  store=store))
    assert refused.value.feature == "agent tools whose agent needs approvals"
    assert not store.list_runs()


class _FakeMCPServer(MCPServer):
    """An MCP server in the process: one tool, ``lookup``, whose every call is counted."""

    def __init__(self, effects: Effects) -> None:
        super().__init__()
        self.effects = effects

    @property
    def name(self) -> str:
        return "fake"

    async def connect(self) -> None:
        return None

    async def cleanup(self) -> None:
        return None

    async def list_tools(self, run_context: Any = None, agent: Any = None) -> list[Any]:
        return [MCPTool(name="lookup", input_schema={"type": "object", "properties": {}})]

    async def call_tool(self, tool_name: str, arguments: Any, meta: Any = None) -> Any:
        self.effects(f"mcp {tool_name}")
        return CallToolResult(content=[TextContent(type="text", text="found")])

    async def list_prompts(self) -> Any:
        raise NotImplementedError

    async def get_prompt(self, name: str, arguments: Any = None) -> Any:
        raise NotImplementedError


def test_row02_mcp_servers_are_carried_through_the_ledger(tmp_path: Path) -> None:
    """Row 2: the SDK alone calls the MCP tool; through the adapter its call is a ledger
    call (before: refused at open, and before that approved with 0 starts, then
    InvalidTransition, then SDKStateRequired forever): started once and published, the
    server called once, with the call's idempotency key in the request's ``_meta``."""
    metas: list[Any] = []

    def agent(effects: Effects) -> Agent[Any]:
        server = _FakeMCPServer(effects)
        inner = server.call_tool

        async def call_tool(tool_name: str, arguments: Any, meta: Any = None) -> Any:
            metas.append(meta)
            return await inner(tool_name, arguments, meta)

        server.call_tool = call_tool  # type: ignore[method-assign]
        return Agent("a", model=_model(effects, [function_call("lookup", {}, call_id="m1")],
                                       [assistant_message("done")]),
                     mcp_servers=[server])

    alone = Effects(tmp_path, "alone")
    result = asyncio.run(_sdk_run(agent(alone), "go", SQLiteSession("s", ":memory:")))
    assert result.final_output == "done"
    assert _count(alone) == Counter({"mcp lookup": 1, "model": 2})

    through = Effects(tmp_path, "adapter")
    store = MemoryEventStore()

    async def adapted() -> AgentRunResult:
        run = await AgentRun.open(agent(through), run_id="row2", store=store,
                                  session=SQLiteSession("s", ":memory:"))
        return await _attempt(run, "go")

    done = asyncio.run(adapted())
    assert (done.step, done.final_output) == (Step.COMPLETED, "done")
    assert _count(through) == Counter({"mcp lookup": 1, "model": 2})
    ledger = RunController.load(store, "row2")
    assert [(v.call.name, v.phase, v.starts, v.result) for v in ledger.calls] == [
        ("lookup", Phase.PUBLISHED, 1, [{"type": "input_text", "text": "found"}])]
    assert metas[1] == {"statemachine/idempotency_key": ledger.idempotency_key("m1")}


@pytest.mark.parametrize("mode", MODES)
def test_row03_a_call_a_tool_input_guardrail_rejects_never_runs_and_the_run_goes_on(
        tmp_path: Path, mode: str) -> None:
    """Row 3: the SDK alone skips the body, tells the model the rejection, and completes;
    so does the adapter, which records the call with the text the model was sent (before:
    approved with 0 starts, the next model call refused, the run stuck)."""

    def agent(effects: Effects) -> Agent[Any]:
        @tool_input_guardrail
        def no_payments(data: Any) -> ToolGuardrailFunctionOutput:
            effects("guardrail no_payments")
            return ToolGuardrailFunctionOutput.reject_content("payments are closed today")

        return Agent("a", model=_model(effects, [function_call("pay", {"x": 7},
                                                               call_id="c1")],
                                       [assistant_message("sorry, payments are closed")]),
                     tools=[_paying(effects, tool_input_guardrails=[no_payments])])

    async def go() -> None:
        alone = Effects(tmp_path, "alone")
        session = SQLiteSession("s", ":memory:")
        result = await _sdk_run(agent(alone), "pay 7", session, mode)
        assert result.final_output == "sorry, payments are closed"
        sdk_items = await session.get_items()
        assert _count(alone) == Counter({"guardrail no_payments": 1, "model": 2})

        through = Effects(tmp_path, "adapter")
        store = MemoryEventStore()
        session = SQLiteSession("s", ":memory:")
        run = await AgentRun.open(agent(through), run_id="row3", session=session,
                                  store=store)
        done = await _attempt(run, "pay 7", mode)
        assert (done.step, done.final_output) == (Step.COMPLETED, "sorry, payments are closed")
        assert await session.get_items() == sdk_items
        assert _count(through) == _count(alone)  # no body ran
        view = RunController.load(store, "row3").call("c1")
        assert (view.phase, view.result) == (Phase.PUBLISHED, "payments are closed today")

    asyncio.run(go())


@pytest.mark.parametrize("mode", MODES)
def test_row04_a_tripped_output_guardrail_never_accepts_the_output(tmp_path: Path,
                                                                  mode: str) -> None:
    """Row 4: the SDK alone raises the tripwire and writes nothing of the blocked answer.
    Through the adapter the same error; the ledger never accepted the blocked text (before:
    accepted before the verdict, against §2.1) and the run is over: a retry is refused
    naming the guardrail, having called nothing (before: SDKStateRequired forever)."""

    def agent(effects: Effects) -> Agent[Any]:
        @output_guardrail
        def no_secrets(context: Any, agent: Any, output: Any) -> GuardrailFunctionOutput:
            effects("guardrail no_secrets")
            return GuardrailFunctionOutput(output_info=None, tripwire_triggered=True)

        return Agent("a", model=_model(effects, [assistant_message("the secret is 42")]),
                     output_guardrails=[no_secrets])

    async def go() -> None:
        alone = Effects(tmp_path, "alone")
        session = SQLiteSession("s", ":memory:")
        with pytest.raises(OutputGuardrailTripwireTriggered):
            await _sdk_run(agent(alone), "tell me", session, mode)
        assert await session.get_items() == [{"content": "tell me", "role": "user"}]

        through = Effects(tmp_path, "adapter")
        store = MemoryEventStore()
        session = SQLiteSession("s", ":memory:")
        the_agent = agent(through)
        run = await AgentRun.open(the_agent, run_id="row4", session=session, store=store)
        with pytest.raises(OutputGuardrailTripwireTriggered):
            await _attempt(run, "tell me", mode)
        assert await session.get_items() == [{"content": "tell me", "role": "user"}]
        log = RunController.load(store, "row4")
        assert not any(type(e).__name__ == "FinalOutputAccepted" for e in log.events)
        assert log.step is Step.TERMINAL_UNRECOVERABLE
        again = await AgentRun.open(the_agent, run_id="row4", session=session, store=store)
        with pytest.raises(RunNotResumable, match="no_secrets"):
            await _attempt(again, None, mode)
        assert _count(through) == _count(alone) == Counter({"guardrail no_secrets": 1,
                                                            "model": 1})

    asyncio.run(go())


def _tripping(effects: Effects, where: str) -> Agent[Any]:
    """An agent one of whose guardrails trips (raises its tripwire) on the first call."""

    @tool_input_guardrail
    def stop_in(data: Any) -> ToolGuardrailFunctionOutput:
        effects("guardrail stop")
        return ToolGuardrailFunctionOutput.raise_exception()

    @tool_output_guardrail
    def stop_out(data: Any) -> ToolGuardrailFunctionOutput:
        effects("guardrail stop")
        return ToolGuardrailFunctionOutput.raise_exception()

    @input_guardrail
    def stop_input(context: Any, agent: Any, value: Any) -> GuardrailFunctionOutput:
        effects("guardrail stop")
        return GuardrailFunctionOutput(output_info=None, tripwire_triggered=True)

    by_place: dict[str, dict[str, Any]] = {
        "tool_input": {"tool_input_guardrails": [stop_in]},
        "tool_output": {"tool_output_guardrails": [stop_out]},
        "input": {}}
    options = by_place[where]
    return Agent("a", model=_model(effects, [function_call("pay", {"x": 7}, call_id="c1")],
                                   [assistant_message("done")]),
                 tools=[_paying(effects, **options)],
                 input_guardrails=[stop_input] if where == "input" else [])


TRIPWIRES = {"tool_input": ToolInputGuardrailTripwireTriggered,
             "tool_output": ToolOutputGuardrailTripwireTriggered,
             "input": InputGuardrailTripwireTriggered}


class EndHooks(Hooks):
    async def on_llm_end(self, context: Any, agent: Any, response: Any) -> None:
        self.effects["hook llm_end"] += 1


@pytest.mark.invariant("I1")
@pytest.mark.parametrize("buffered", [False, True], ids=["per-event", "buffered"])
@pytest.mark.parametrize("answer", ["final", "tool"])
def test_a_superseded_attempt_runs_no_hook_guardrail_or_tool_after_the_model_call(
        tmp_path: Path, buffered: bool, answer: str) -> None:
    """Another process claims the run while this attempt waits on the model (DESIGN §7.2,
    fencing): from then on this attempt runs no hook (``on_llm_end``, ``on_agent_end``,
    ``on_tool_start``), no guardrail and no tool, and stops with `ConcurrencyConflict`
    (before: the hooks and guardrails ran and only the next append was refused)."""
    path = tmp_path / "events.db"
    counts: Counter[str] = Counter()

    @output_guardrail
    def final_check(context: Any, agent: Any, output: Any) -> GuardrailFunctionOutput:
        counts["guardrail final_check"] += 1
        return GuardrailFunctionOutput(output_info=None, tripwire_triggered=False)

    @function_tool
    def pay(x: int) -> str:
        counts["tool pay"] += 1
        return f"paid {x}"

    first = (assistant_message("the answer") if answer == "final"
             else function_call("pay", {"x": 7}, call_id="c1"))

    class Superseded(ScriptedModel):
        async def get_response(self, *args: Any, **kwargs: Any) -> Any:
            counts["model"] += 1
            RunController.load(SQLiteEventStore(path), "fenced").claim("rival")
            return await super().get_response(*args, **kwargs)

    agent = Agent("a", model=Superseded([[first], [assistant_message("done")]]),
                  tools=[pay], output_guardrails=[final_check])

    async def go() -> None:
        run = await AgentRun.open(agent, run_id="fenced", store=SQLiteEventStore(path),
                                  session=SQLiteSession("s", ":memory:"),
                                  buffered=buffered)
        with pytest.raises(ConcurrencyConflict):
            await run.run("hi", run_config=CONFIG, hooks=EndHooks(counts))

    asyncio.run(go())
    assert counts == Counter({"hook agent_start": 1, "hook llm_start": 1, "model": 1})
    last = RunController.load(SQLiteEventStore(path), "fenced").events[-1]
    assert isinstance(last, RunClaimed)
    assert last.owner == "rival"


@pytest.mark.parametrize("where", sorted(TRIPWIRES))
def test_a_tripped_guardrail_ends_the_run_naming_it(tmp_path: Path, where: str) -> None:
    """A guardrail that raises its tripwire (the agent's input guardrail, a tool's input
    or output guardrail): the SDK alone raises it out of the run; so does the adapter, and
    the run is over (abandoned, its reason naming the guardrail). A retry is refused
    before anything runs (before: the recorded verdict tripped again on every retry, the
    run stuck for ever). The tool body runs at most as often as on the SDK alone."""

    async def go() -> None:
        alone = Effects(tmp_path, "alone")
        with pytest.raises(TRIPWIRES[where]):
            await _sdk_run(_tripping(alone, where), "pay 7", SQLiteSession("s", ":memory:"))

        through = Effects(tmp_path, "adapter")
        store = MemoryEventStore()
        session = SQLiteSession("s", ":memory:")
        agent = _tripping(through, where)
        run = await AgentRun.open(agent, run_id="trip", session=session, store=store)
        with pytest.raises(TRIPWIRES[where]):
            await _attempt(run, "pay 7")
        assert RunController.load(store, "trip").step is Step.TERMINAL_UNRECOVERABLE
        before = _count(through)
        again = await AgentRun.open(agent, run_id="trip", session=session, store=store)
        with pytest.raises(RunNotResumable, match="stop"):
            await _attempt(again)
        assert _count(through) == before == _count(alone)  # the retry ran nothing
        assert before["tool pay"] == (1 if where == "tool_output" else 0)

    asyncio.run(go())


@pytest.mark.parametrize("enabled", [False, "callable"])
def test_a_disabled_tool_is_unknown_to_the_ledger_as_to_the_sdk(tmp_path: Path,
                                                                 enabled: Any) -> None:
    """A tool with ``is_enabled`` false (a bool, or a callable answering False) is not
    offered by the SDK; a model naming it gets the SDK's "not found" error. The ledger
    counts it unknown too: the model call failed, and a retry asks the model again and
    completes (before: the call was recorded, the SDK refused it, every retry stuck on
    the same replayed response)."""
    setting: Any = False if enabled is False else (lambda context, agent: False)

    def agent(effects: Effects) -> Agent[Any]:
        return Agent("a", model=_model(effects, [function_call("pay", {"x": 7},
                                                               call_id="c1")],
                                       [assistant_message("done")]),
                     tools=[_paying(effects, is_enabled=setting)])

    async def go() -> None:
        alone = Effects(tmp_path, "alone")
        sdk_agent = agent(alone)
        with pytest.raises(ModelBehaviorError):
            await _sdk_run(sdk_agent, "pay 7", SQLiteSession("s", ":memory:"))
        done = await _sdk_run(sdk_agent, "pay 7", SQLiteSession("s2", ":memory:"))
        assert done.final_output == "done"

        through = Effects(tmp_path, "adapter")
        store = MemoryEventStore()
        session = SQLiteSession("s", ":memory:")
        the_agent = agent(through)
        run = await AgentRun.open(the_agent, run_id="off", session=session, store=store)
        with pytest.raises(ModelBehaviorError):
            await _attempt(run, "pay 7")
        assert RunController.load(store, "off").calls == ()
        again = await AgentRun.open(the_agent, run_id="off", session=session, store=store)
        result = await _attempt(again)
        assert (result.step, result.final_output) == (Step.COMPLETED, "done")
        assert _count(through) == _count(alone) == Counter({"model": 2})

    asyncio.run(go())


@pytest.mark.parametrize("behavior", ["raise_error", "return_error_to_model"])
def test_row05_a_call_to_a_tool_the_agent_does_not_have(tmp_path: Path,
                                                        behavior: str) -> None:
    """Row 5: the model names a tool the agent does not have. The SDK alone raises
    ModelBehaviorError (``tool_not_found_behavior="raise_error"``) and completes when run
    again, or sends the model an error and completes; so does the adapter (before: every
    retry SDKStateRequired)."""
    config = RunConfig(tracing_disabled=True, tool_not_found_behavior=behavior)  # type: ignore[arg-type]

    def agent(effects: Effects) -> Agent[Any]:
        return Agent("a", model=_model(effects, [function_call("refund", {}, call_id="u1")],
                                       [assistant_message("done")]),
                     tools=[_paying(effects)])

    async def attempts(attempt: Callable[[Any], Awaitable[Any]]) -> list[str]:
        seen = []
        for input in ("pay 7", None):  # a retry continues from what the Session holds
            try:
                seen.append(f"output {(await attempt(input)).final_output}")
                break
            except ModelBehaviorError:
                seen.append("ModelBehaviorError")
        return seen

    async def go() -> None:
        alone = Effects(tmp_path, "alone")
        the_agent, session = agent(alone), SQLiteSession("s", ":memory:")
        sdk_seen = await attempts(lambda i: Runner.run(the_agent, i or [], session=session,
                                                       run_config=config))
        sdk_items = await session.get_items()

        through = Effects(tmp_path, "adapter")
        store, session = MemoryEventStore(), SQLiteSession("s", ":memory:")
        run = await AgentRun.open(agent(through), run_id="row5", session=session,
                                  store=store)
        seen = await attempts(lambda i: run.run(i, run_config=config))
        assert seen == sdk_seen == (["ModelBehaviorError", "output done"]
                                    if behavior == "raise_error" else ["output done"])
        assert run.controller.step is Step.COMPLETED
        assert _count(through) == _count(alone)
        assert await session.get_items() == sdk_items

    asyncio.run(go())


def _gated(effects: Effects) -> Agent[Any]:
    """``pay`` needs approval; the model asks for it, then answers."""
    return Agent("billing", model=_model(effects, [function_call("pay", {"x": 7},
                                                                 call_id="c1")],
                                         [assistant_message("paid")]),
                 tools=[_paying(effects, needs_approval=True)])


@pytest.mark.parametrize("decision", ["approve", "reject"])
@pytest.mark.parametrize("where", ["same-state", "saved-state"])
def test_row07_a_decision_taken_on_the_sdk_state_is_honoured(tmp_path: Path, decision: str,
                                                             where: str) -> None:
    """Row 7: ``result.state.approve(item)`` (or ``reject``), the SDK's own API. The SDK
    alone resumes the state and runs (or skips) the tool; the adapter records the decision
    the state holds, durable before the tool runs, and does the same (before: the
    decision was dropped and the run paused again). The state may be the one the adapter
    returned, or its saved text resumed by a new process."""

    async def decide(state: Any, item: Any) -> None:
        if decision == "approve":
            state.approve(item)
        else:
            state.reject(item, rejection_message="not today")

    async def go() -> None:
        alone = Effects(tmp_path, "alone")
        agent, session = _gated(alone), SQLiteSession("s", ":memory:")
        paused = await Runner.run(agent, "pay 7", session=session, run_config=CONFIG)
        state = paused.to_state()
        await decide(state, paused.interruptions[0])
        sdk = await Runner.run(agent, state, session=session, run_config=CONFIG)
        sdk_items = await session.get_items()

        through = Effects(tmp_path, "adapter")
        agent, store = _gated(through), SQLiteEventStore(tmp_path / "events.db")
        session = SQLiteSession("s", ":memory:")
        run = await AgentRun.open(agent, run_id="row7", session=session, store=store)
        paused_run = await run.run("pay 7", run_config=CONFIG)
        assert paused_run.state is not None
        await decide(paused_run.state, paused_run.interruptions[0])
        if where == "saved-state":
            saved = paused_run.state.to_string()
            run = await AgentRun.open(agent, run_id="row7", session=session, store=store)
            done = await run.run(state=saved, run_config=CONFIG)
        else:
            done = await run.run(state=paused_run.state, run_config=CONFIG)
        assert (done.step, done.final_output) == (Step.COMPLETED, sdk.final_output)
        assert await session.get_items() == sdk_items
        assert _count(through) == _count(alone)
        assert _count(through)[PAID] == (decision == "approve")
        kind = "CallApproved" if decision == "approve" else "CallRejected"
        assert kind in [type(e).__name__ for e in RunController.load(store, "row7").events]

    asyncio.run(go())


def test_row09_a_run_opened_on_another_session_is_refused_before_any_effect(
        tmp_path: Path) -> None:
    """Row 9: the SDK alone resumes a paused run's state on any Session and runs the
    approved tool there. Opening the adapter's run with a Session that is not its own is
    refused before anything runs (before: the approved body ran, then ReconcileRejected)."""

    async def go() -> None:
        alone = Effects(tmp_path, "alone")
        agent = _gated(alone)
        paused = await Runner.run(agent, "pay 7", session=SQLiteSession("s", ":memory:"),
                                  run_config=CONFIG)
        state = paused.to_state()
        state.approve(paused.interruptions[0])
        await Runner.run(agent, state, session=SQLiteSession("other", ":memory:"),
                         run_config=CONFIG)
        assert _count(alone)[PAID] == 1

        through = Effects(tmp_path, "adapter")
        agent, store = _gated(through), MemoryEventStore()
        run = await AgentRun.open(agent, run_id="row9", session=SQLiteSession(
            "s", ":memory:"), store=store)
        paused_run = await run.run("pay 7", run_config=CONFIG)
        await run.approve(paused_run.interruptions[0])
        assert paused_run.state is not None
        saved, version = paused_run.state.to_string(), run.controller.version
        with pytest.raises(ReconcileRejected, match="'other' is not the run's Session"):
            await AgentRun.open(agent, run_id="row9", store=store,
                                session=SQLiteSession("other", ":memory:"))
        assert RunController.load(store, "row9").version == version  # nothing recorded
        assert _count(through)[PAID] == 0
        assert saved

    asyncio.run(go())


def _handoff_world(effects: Effects, *, fail_first: bool = False) -> Agent[Any]:
    """``triage`` hands off to ``billing``, whose model asks for ``pay`` then answers;
    with ``fail_first`` billing's first model call fails (after the handoff was written)."""

    class Failing(ScriptedModel):
        failed = False

        async def get_response(self, *args: Any, **kwargs: Any) -> Any:
            effects("model billing")
            if fail_first and not Failing.failed:
                Failing.failed = True
                raise ConnectionError("the model is unreachable")
            return await super().get_response(*args, **kwargs)

    billing = Agent("billing", model=Failing([[function_call("pay", {"x": 7}, call_id="p1")],
                                              [assistant_message("paid 7")]]),
                    tools=[_paying(effects)])

    class Triage(ScriptedModel):
        async def get_response(self, *args: Any, **kwargs: Any) -> Any:
            effects("model triage")
            return await super().get_response(*args, **kwargs)

    return Agent("triage", model=Triage([[function_call("transfer_to_billing", {},
                                                        call_id="h1")]]),
                 handoffs=[handoff(billing, on_handoff=lambda ctx: effects("on_handoff"))])


def test_row10_a_handoff_is_carried_and_a_restart_goes_on_with_the_agent_handed_to(
        tmp_path: Path) -> None:
    """Row 10: the SDK alone hands off from triage to billing, which pays and answers.
    Through the adapter the same run, the same Session items, each effect once, the
    handoff recorded (before: refused at open). When billing's first model call fails, a
    new process goes on with billing (the ledger's active agent), never asking triage
    again and never running the handoff's callback again."""

    async def go() -> None:
        alone = Effects(tmp_path, "alone")
        session = SQLiteSession("s", ":memory:")
        result = await Runner.run(_handoff_world(alone), "pay 7", session=session,
                                  run_config=CONFIG)
        assert (result.final_output, result.last_agent.name) == ("paid 7", "billing")
        sdk_items = await session.get_items()

        through = Effects(tmp_path, "adapter")
        store, session = MemoryEventStore(), SQLiteSession("s", ":memory:")
        run = await AgentRun.open(_handoff_world(through), run_id="row10", session=session,
                                  store=store)
        done = await run.run("pay 7", run_config=CONFIG)
        assert (done.step, done.final_output) == (Step.COMPLETED, "paid 7")
        assert await session.get_items() == sdk_items
        assert _count(through) == _count(alone) == Counter({
            "model triage": 1, "on_handoff": 1, "model billing": 2, PAID: 1})
        log = RunController.load(store, "row10")
        assert [e.target for e in log.events if isinstance(e, HandedOff)] == ["billing"]

        failing = Effects(tmp_path, "failing")
        store, session = MemoryEventStore(), SQLiteSession("s", ":memory:")
        run = await AgentRun.open(_handoff_world(failing, fail_first=True), run_id="row10",
                                  session=session, store=store)
        with pytest.raises(ConnectionError):
            await run.run("pay 7", run_config=CONFIG)
        again = await AgentRun.open(_handoff_world(failing), run_id="row10",
                                    session=session, store=store)
        done = await again.run(run_config=CONFIG)
        assert done.final_output == "paid 7"
        assert await session.get_items() == sdk_items
        assert _count(failing) == Counter({"model triage": 1, "on_handoff": 1,
                                           "model billing": 3, PAID: 1})

    asyncio.run(go())


@pytest.mark.parametrize("size", [200_000, 60_000], ids=["over-the-log", "over-its-batch"])
def test_row18_a_result_over_max_bytes_is_the_calls_failure_the_model_sees(
        tmp_path: Path, size: int) -> None:
    """Row 18: a result larger than the run may record, or than it may record and then
    publish with its batch. The SDK alone sends it. The adapter records the call as
    failed, with a text that says so, and sends the model that text; the run completes and
    nothing is in doubt (before: SchemaError after the body, then the call in doubt by the
    library's own limit)."""
    big = "x" * size

    def agent(effects: Effects) -> Agent[Any]:
        @function_tool
        def export() -> str:
            effects("tool export")
            return big

        return Agent("a", model=_model(effects, [function_call("export", {}, call_id="e1")],
                                       [assistant_message("exported")]), tools=[export])

    async def go() -> None:
        alone = Effects(tmp_path, "alone")
        session = SQLiteSession("s", ":memory:")
        await Runner.run(agent(alone), "export", session=session, run_config=CONFIG)
        assert _outputs(await session.get_items()) == {"e1": big}

        through = Effects(tmp_path, "adapter")
        store, session = MemoryEventStore(), SQLiteSession("s", ":memory:")
        c = RunController.start(run_id="row18", session_id="s", store=store,
                                max_bytes=100_000)
        run = AgentRun.from_controller(agent(through), c, session)
        done = await run.run("export", run_config=CONFIG)
        assert (done.step, done.final_output) == (Step.COMPLETED, "exported")
        sent = _outputs(await session.get_items())["e1"]
        assert sent.startswith("The tool ran, but its result was not kept")
        assert "max_bytes" in sent
        view = RunController.load(store, "row18").call("e1")
        assert (view.phase, view.result, view.starts) == (Phase.PUBLISHED, sent, 1)
        assert _count(through) == _count(alone)

    asyncio.run(go())


def test_row18_a_call_the_run_has_no_room_for_is_refused_before_its_body(
        tmp_path: Path) -> None:
    """When the run could not record even the call's failure, the body never runs and
    the call is not started (not in doubt): the run can be abandoned cleanly."""

    async def go() -> None:
        padding = "p" * 5_000
        for max_bytes in range(13_000, 12_000, -5):  # the largest run that refuses it
            through = Effects(tmp_path, f"max_bytes={max_bytes}")
            store, session = MemoryEventStore(), SQLiteSession("s", ":memory:")
            agent = Agent("a", model=_model(through, [function_call(
                "pay", {"x": 7, "note": padding}, call_id="c1")]), tools=[_paying(through)])
            c = RunController.start(run_id="r", session_id="s", store=store,
                                    max_bytes=max_bytes)
            try:
                await AgentRun.from_controller(agent, c, session).run("pay", run_config=CONFIG)
            except SchemaError as refused:
                if "was not started" in str(refused):
                    break
            except Exception:  # a run with room goes on (and finds no answer)
                pass
        else:
            raise AssertionError("no max_bytes refused the call before its body")
        assert c.phase("c1") is Phase.APPROVED  # never started: not in doubt
        assert _count(through) == Counter({"model": 1})  # the body never ran
        c.abandon("no room")

    asyncio.run(go())


def test_row19_a_redacting_tool_output_guardrail_keeps_the_raw_output_out_of_the_store(
        tmp_path: Path) -> None:
    """Row 19: the tool's output carries a card number and its output guardrail replaces
    it. The SDK alone sends the redacted text; so does the adapter, and its event store
    (the SQLite file) holds the redacted text and never the card number (before: the raw
    output was recorded before the guardrail ran)."""
    card = "4111 1111 1111 1111"

    def agent(effects: Effects) -> Agent[Any]:
        @tool_output_guardrail
        def redact(data: Any) -> ToolGuardrailFunctionOutput:
            return ToolGuardrailFunctionOutput.reject_content("card on file: [redacted]")

        @function_tool(tool_output_guardrails=[redact])
        def card_on_file() -> str:
            effects("tool card_on_file")
            return f"card on file: {card}"

        return Agent("a", model=_model(effects, [function_call("card_on_file", {},
                                                               call_id="k1")],
                                       [assistant_message("done")]), tools=[card_on_file])

    async def go() -> None:
        alone = Effects(tmp_path, "alone")
        session = SQLiteSession("s", ":memory:")
        await Runner.run(agent(alone), "card?", session=session, run_config=CONFIG)
        sdk_items = await session.get_items()
        assert _outputs(sdk_items) == {"k1": "card on file: [redacted]"}

        through = Effects(tmp_path, "adapter")
        path = tmp_path / "events.db"
        store, session = SQLiteEventStore(path), SQLiteSession("s", ":memory:")
        run = await AgentRun.open(agent(through), run_id="row19", session=session,
                                  store=store)
        done = await run.run("card?", run_config=CONFIG)
        assert done.step is Step.COMPLETED
        assert await session.get_items() == sdk_items
        assert RunController.load(store, "row19").call("k1").result == (
            "card on file: [redacted]")
        store.close()
        stored = b"".join(p.read_bytes() for p in tmp_path.glob("events.db*"))
        assert b"[redacted]" in stored
        assert card.encode() not in stored
        assert _count(through) == _count(alone)

    asyncio.run(go())


@pytest.mark.parametrize("mode", MODES)
def test_row22_a_completed_run_answers_a_retried_request_from_its_ledger(
        tmp_path: Path, mode: str) -> None:
    """Row 22: a request retried after it completed. The SDK alone runs it again (the
    model is asked again, the paying tool pays again); the adapter returns the recorded
    output and says so (``replayed``), with no model call and no tool (before:
    RunNotResumable). Other input is refused: a completed run takes none."""

    def agent(effects: Effects) -> Agent[Any]:
        return Agent("a", model=_model(effects, [function_call("pay", {"x": 7},
                                                               call_id="c1")],
                                       [assistant_message("paid")],
                                       [function_call("pay", {"x": 7}, call_id="c2")],
                                       [assistant_message("paid")]),
                     tools=[_paying(effects)])

    async def go() -> None:
        alone = Effects(tmp_path, "alone")
        the_agent, session = agent(alone), SQLiteSession("s", ":memory:")
        for _ in range(2):
            await _sdk_run(the_agent, "pay 7", session, mode)
        assert _count(alone) == Counter({PAID: 2, "model": 4})

        through = Effects(tmp_path, "adapter")
        the_agent, store = agent(through), MemoryEventStore()
        session = SQLiteSession("s", ":memory:")
        run = await AgentRun.open(the_agent, run_id="row22", session=session, store=store)
        first = await _attempt(run, "pay 7", mode)
        assert (first.final_output, first.replayed) == ("paid", False)
        items, version = await session.get_items(), run.controller.version
        for again in (run, await AgentRun.open(the_agent, run_id="row22", session=session,
                                               store=store)):
            for input in ("pay 7", None):
                retried = await _attempt(again, input, mode)
                assert (retried.step, retried.final_output, retried.replayed,
                        retried.sdk_result) == (Step.COMPLETED, "paid", True, None)
            with pytest.raises(RunNotResumable, match="takes no new input"):
                await _attempt(again, "pay 8", mode)
        assert _count(through) == Counter({PAID: 1, "model": 2})
        assert await session.get_items() == items
        assert RunController.load(store, "row22").version == version  # nothing recorded

    asyncio.run(go())


def _named(folder: Path, name: str) -> list[str]:
    return [line.split(" ", 1)[1] for line in _effects(folder) if line.split(" ", 1)[0] == name]


@pytest.mark.parametrize("where", ["guardrail", "agent_end"])
def test_row06_kill_9_between_the_final_answer_and_its_write(tmp_path: Path,
                                                            where: str) -> None:
    """Row 6: kill -9 inside the output guardrail or ``on_agent_end``, after the model's
    final answer and before it is written. The SDK alone, restarted, asks the model again
    (a second answer); through the adapter the restart replays the recorded answer (no
    model call), finishes the checks, and writes it once (before: SDKStateRequired on
    every restart, the answer never published)."""
    alone, through = tmp_path / "alone", tmp_path / "adapter"
    for folder, kind in ((alone, "final-sdk"), (through, "final")):
        folder.mkdir()
        assert _driver(kind, str(folder), where).returncode == -9
        assert _named(folder, "crash").count("model call") == 1

    restarted = _driver("resume-sdk", str(alone), "restart")
    assert json.loads(restarted.stdout)["outcome"] == "completed"
    assert _named(alone, "restart").count("model call") == 1  # asked again: a new answer

    for _ in range(2):  # a second restart finds the run completed
        resumed = json.loads(_driver("resume", str(through), "restart").stdout)
        assert (resumed["outcome"], resumed["final_output"]) == ("completed",
                                                                 "the answer is 42"), resumed
    assert "model call" not in _named(through, "restart")
    # the check the kill fell in (run, never recorded) runs again once; nothing else does
    crashed, restart = _named(through, "crash"), _named(through, "restart")
    assert crashed.count("guardrail checked") == (where == "guardrail")
    assert restart.count("guardrail checked") == 1
    assert crashed.count("hook agent_end") + restart.count("hook agent_end") == 1 + (
        where == "agent_end")
    session: list[Any] = asyncio.run(SQLiteSession(SESSION_ID_DRIVER, through / "session.db")
                                     .get_items())
    answers = [item for item in session if item.get("role") == "assistant"]
    assert [a["content"][0]["text"] for a in answers] == ["the answer is 42"]


def test_row08_a_pydantic_result_is_resent_as_the_text_the_sdk_sent(tmp_path: Path) -> None:
    """Row 8: a tool returning a pydantic model, killed after the tool (in its end hook)
    and before the write. Resumed from the store and the saved SDK state, its cached
    result is resent byte-identical to what the SDK alone sends (``str(model)``), and the
    tool never runs again (before: re-sent as its ``model_dump`` dict)."""

    async def sdk_alone() -> str:
        (tmp_path / "alone").mkdir()
        effects = Effects(tmp_path / "alone", "alone")

        @function_tool
        def receipt(x: int) -> Any:
            effects("tool receipt")
            return Receipt(amount=x, note="ok")

        session = SQLiteSession("s", ":memory:")
        await Runner.run(Agent("a", model=ScriptedModel([
            [function_call("receipt", {"x": 7}, call_id="c1")], [assistant_message("ok")]]),
            tools=[receipt]), "receipt", session=session, run_config=CONFIG)
        output: str = _outputs(await session.get_items())["c1"]
        return output

    sent = asyncio.run(sdk_alone())
    assert sent == "amount=7 note='ok'"
    assert _driver("pause-receipt", str(tmp_path)).returncode == 0
    assert _driver("crash-after-tool", str(tmp_path)).returncode == -9
    resumed = json.loads(_driver("resume", str(tmp_path), "resumer").stdout)
    assert resumed["outcome"] == "completed", resumed
    session = asyncio.run(SQLiteSession(SESSION_ID_DRIVER, tmp_path / "session.db")
                          .get_items())
    assert _outputs(session) == {"c1": sent}
    assert [line for line in _effects(tmp_path) if line.endswith("tool receipt")] == [
        "crash tool receipt"]


def test_row20_kill_9_during_a_write_names_take_over(tmp_path: Path) -> None:
    """Row 20: kill -9 inside a Session write. A restart is refused ("an attempt may
    still be writing") with a message naming ``AgentRun.open(..., take_over=True)``; the
    adapter takes it: opened with ``take_over=True`` the run writes the batch and
    completes, the tool having run once."""
    assert _driver("crash-write", str(tmp_path)).returncode == -9
    refused = json.loads(_driver("resume", str(tmp_path), "first").stdout)
    assert (refused["error"], refused["step"]) == ("ReconcileRejected", "unsettled")
    assert "may still be writing" in refused["message"]
    assert "AgentRun.open(..., take_over=True)" in refused["message"]
    taken = json.loads(_driver("resume", str(tmp_path), "second", "take-over").stdout)
    assert (taken["outcome"], taken["final_output"]) == ("completed", "done"), taken
    assert [line for line in _effects(tmp_path) if line.endswith("tool pay")] == [
        "crash tool pay"]
    session = asyncio.run(SQLiteSession(SESSION_ID_DRIVER, tmp_path / "session.db")
                          .get_items())
    assert _outputs(session) == {"p1": "paid 7"}


def test_row08_a_resent_result_is_the_text_the_sdk_sent_in_one_process() -> None:
    """Row 8 without a kill: the tool's end hook raised after its result was recorded; a
    new attempt resends the cached result exactly as the SDK first sent it."""

    class FailingEndHook(RunHooks[Any]):
        failed = False

        async def on_tool_end(self, context: Any, agent: Any, tool: Any, result: Any) -> None:
            if not FailingEndHook.failed:
                FailingEndHook.failed = True
                raise RuntimeError("the end hook failed")

    ran: list[int] = []

    @function_tool(needs_approval=True)
    def receipt(x: int) -> Receipt:
        ran.append(x)
        return Receipt(amount=x, note="ok")

    async def go() -> None:
        model = ScriptedModel([[function_call("receipt", {"x": 7}, call_id="c1")],
                               [assistant_message("done")]])
        agent = Agent("a", model=model, tools=[receipt])
        session, store = SQLiteSession("s", ":memory:"), MemoryEventStore()
        run = await AgentRun.open(agent, run_id="row8", session=session, store=store)
        paused = await run.run("receipt", run_config=CONFIG)
        assert paused.state is not None
        saved = paused.state.to_string()
        await run.approve("c1")
        with pytest.raises(UserError, match="end hook failed"):
            await run.run(hooks=FailingEndHook(), run_config=CONFIG)
        again = await AgentRun.open(agent, run_id="row8", session=session, store=store)
        done = await again.run(state=saved, run_config=CONFIG)
        assert done.step is Step.COMPLETED
        assert _outputs(await session.get_items()) == {"c1": str(Receipt(amount=7,
                                                                         note="ok"))}
        assert ran == [7]

    asyncio.run(go())


def test_a_timed_out_tool_is_in_doubt_before_the_sdks_timeout_text_is_written() -> None:
    """The SDK turns a tool that outlived its ``timeout`` into a timeout message for
    the model; through the adapter its body was cancelled mid-effect, so the call is in
    doubt: the attempt stops with ToolInDoubt before that text is written, and the call
    never runs again."""
    ran: list[str] = []

    @function_tool(timeout=0.05)
    async def slow_charge() -> str:
        ran.append("slow_charge")
        await asyncio.sleep(10)
        return "charged"

    async def go() -> None:
        model = ScriptedModel([[function_call("slow_charge", {}, call_id="t1")],
                               [assistant_message("timed out")]])
        agent = Agent("a", model=model, tools=[slow_charge])
        session, store = SQLiteSession("s", ":memory:"), MemoryEventStore()
        run = await AgentRun.open(agent, run_id="timeout", session=session, store=store)
        with pytest.raises(ToolInDoubt):
            await run.run("charge", run_config=CONFIG)
        assert run.controller.phase("t1") is Phase.STARTED
        assert _outputs(await session.get_items()) == {}
        again = await AgentRun.open(agent, run_id="timeout", session=session, store=store)
        with pytest.raises(ToolInDoubt):
            await again.run(run_config=CONFIG)
        assert ran == ["slow_charge"]

    asyncio.run(go())


@pytest.mark.parametrize("decision", ["always_approve", "always_reject"])
def test_a_standing_decision_on_the_sdk_state_is_refused_naming_it(decision: str) -> None:
    """``state.approve(item, always_approve=True)`` (or ``reject(..., always_reject=True)``)
    would let the SDK start later calls of that tool with no decision in the ledger: the
    attempt given that state is refused (`UnsupportedFeature` naming standing decisions)
    before any decision is recorded or any tool runs (before: the first call ran and the
    run failed later, mid-turn, on the second)."""
    ran: list[int] = []

    @function_tool(needs_approval=True)
    def charge(x: int) -> str:
        ran.append(x)
        return f"charged {x}"

    async def go() -> None:
        model = ScriptedModel([[function_call("charge", {"x": 1}, call_id="a1")],
                               [function_call("charge", {"x": 2}, call_id="a2")],
                               [assistant_message("done")]])
        agent = Agent("a", model=model, tools=[charge])
        run = await AgentRun.open(agent, run_id="standing",
                                  session=SQLiteSession("s", ":memory:"),
                                  store=MemoryEventStore())
        paused = await run.run("charge twice", run_config=CONFIG)
        assert paused.state is not None
        if decision == "always_approve":
            paused.state.approve(paused.interruptions[0], always_approve=True)
        else:
            paused.state.reject(paused.interruptions[0], always_reject=True)
        with pytest.raises(UnsupportedFeature, match="standing decision") as refused:
            await run.run(state=paused.state, run_config=CONFIG)
        assert refused.value.feature.startswith("standing decisions")
        assert ran == []
        assert run.controller.phase("a1") is Phase.AWAITING
        await run.approve(paused.interruptions[0])  # one call, one decision: goes on
        assert (await run.run(run_config=CONFIG)).step is Step.INTERRUPTION
        assert ran == [1]

    asyncio.run(go())


def test_a_state_saved_at_an_earlier_turn_never_leads_the_sdk_back_into_it() -> None:
    """The state saved at the interruption, given again after the run has moved on (its
    final answer reached, an output guardrail failing before its verdict, which the SDK
    alone would write unchecked and the adapter does not): the ledger is past that turn,
    so the state is not used and the recorded final answer is replayed instead, checked
    and written once; no tool runs again and the model is not asked again."""

    class Flaky:
        failed = False

    @output_guardrail
    def flaky(context: Any, agent: Any, output: Any) -> GuardrailFunctionOutput:
        if not Flaky.failed:
            Flaky.failed = True
            raise ConnectionError("the checker is unreachable")
        return GuardrailFunctionOutput(output_info=None, tripwire_triggered=False)

    async def go() -> None:
        world = World(TERMINAL, "atomic-no-commit")
        model = ScriptedModel([[function_call("charge", {"x": 7}, call_id="c1")],
                               [assistant_message("charged")]])
        agent = world.agent.clone(model=model, tool_use_behavior="run_llm_again",
                                  output_guardrails=[flaky])
        run = await AgentRun.open(agent, run_id=RUN_ID, session=world.session,
                                  store=world.store)
        paused = await run.run("charge me 7", run_config=CONFIG)
        assert paused.state is not None
        saved = paused.state.to_string()
        await run.approve("c1")
        with pytest.raises(ConnectionError):
            await run.run(run_config=CONFIG)
        assert run.controller.step is Step.FINALIZING
        assert [i for i in await world.items() if i.get("role") == "assistant"] == []
        again = await AgentRun.open(agent, run_id=RUN_ID, session=world.session,
                                    store=world.store)
        done = await again.run(state=saved, run_config=CONFIG)
        assert (done.step, done.final_output) == (Step.COMPLETED, "charged")
        assert world.effects["tool charge"] == 1
        assert len(model.calls) == 2
        assert await world.count("function_call_output", "c1") == 1

    asyncio.run(go())


@pytest.mark.parametrize("option", ["handoff_input_filter", "pre_approval_guardrails"])
def test_run_options_the_adapter_cannot_carry_are_refused_before_the_attempt(
        option: str) -> None:
    from agents.run_config import ToolExecutionConfig

    config = (RunConfig(handoff_input_filter=lambda data: data) if option ==
              "handoff_input_filter" else RunConfig(tool_execution=ToolExecutionConfig(
                  pre_approval_tool_input_guardrails=True)))

    async def go() -> None:
        world = World(STREAMED, "atomic-no-commit")
        run = await open_run(world)
        with pytest.raises(UnsupportedFeature):
            await run.run("pay 7", run_config=config)
        assert run.controller.version == 1  # nothing recorded but the run's start
        assert not world.model.calls

    asyncio.run(go())


def test_an_attempt_left_writing_is_refused_naming_take_over_then_taken_over() -> None:
    """A cancelled write (it might still land): another process's attempt on the run is
    refused "an attempt may still be writing", told to open the run with
    ``take_over=True``; opened so, it settles the write and completes."""

    class CancelledBeforeWriting(SQLiteSession):
        writes = 0

        async def add_items(self, items: list[Any]) -> None:
            CancelledBeforeWriting.writes += 1
            if CancelledBeforeWriting.writes == 2:  # pay's result: it never lands
                raise asyncio.CancelledError
            await super().add_items(items)

    async def go() -> None:
        world = World(STREAMED, "cancellation")
        world.inner = world.session = CancelledBeforeWriting(SESSION_ID, ":memory:")
        run = await open_run(world)
        with pytest.raises(asyncio.CancelledError):
            await run.run("pay 7", hooks=world.hooks, run_config=CONFIG)
        other = await open_run(world)
        with pytest.raises(ReconcileRejected, match=r"AgentRun\.open\(\.\.\., take_over=True\)"):
            await other.run(run_config=CONFIG)
        taken = await AgentRun.open(world.agent, run_id=RUN_ID, session=world.session,
                                    store=world.store, take_over=True)
        done = await taken.run(run_config=CONFIG)
        assert (done.step, done.final_output) == (Step.COMPLETED, "paid")
        assert world.effects["tool pay"] == 1
        assert await world.count("function_call_output", "c1") == 1

    asyncio.run(go())


def test_row01_an_agent_tool_runs_on_the_callers_run_config(tmp_path: Path) -> None:
    """Row 1 with the run's model given in ``RunConfig(model=...)``: the SDK runs the
    nested agent on that config too, so through the adapter the nested run gets the
    caller's config, never the run's ledgered one (which would refuse its model call)."""

    def world(name: str) -> tuple[Agent[Any], Effects, RunConfig]:
        effects = Effects(tmp_path, name)
        shared = _model(effects, [function_call("ask_inner", {"input": "pay 5"},
                                                call_id="o1")],
                        [function_call("pay", {"x": 5}, call_id="n1")],
                        [assistant_message("inner paid 5")], [assistant_message("done")])
        inner = Agent("inner", tools=[_paying(effects)])
        outer = Agent("outer", tools=[inner.as_tool("ask_inner", "asks the inner agent")])
        return outer, effects, RunConfig(model=shared, tracing_disabled=True)

    async def go() -> None:
        outer, alone, config = world("alone")
        session = SQLiteSession("s", ":memory:")
        await Runner.run(outer, "go", session=session, run_config=config)
        sdk_items = await session.get_items()
        outer, through, config = world("adapter")
        session = SQLiteSession("s", ":memory:")
        run = await AgentRun.open(outer, run_id="row1", session=session,
                                  store=MemoryEventStore())
        done = await run.run("go", run_config=config)
        assert (done.step, done.final_output) == (Step.COMPLETED, "done")
        assert _outputs(await session.get_items()) == _outputs(sdk_items) == {
            "o1": "inner paid 5"}
        assert _count(through) == _count(alone) == Counter({PAID: 1, "model": 4})

    asyncio.run(go())


# ------------------------------------------- a crash while the model answers after a tool


def _kind_of(item: Any) -> str:
    return str(item.get("type") if item.get("type") not in (None, "message")
               else item.get("role"))


def test_a_crash_while_the_model_answers_after_a_tool_leaves_the_call_completed(
        tmp_path: Path) -> None:
    """The process dies while the model is asked again after ``pay`` (the longest wait of
    a turn), the Session the library's `SQLiteSession` in the store's file: the result and
    the Session write of its call and output were made durable before that request, so
    what the store holds while the model is asked (what the crash leaves) is the call
    completed and written, never in doubt; the next attempt asks the model again and
    completes, ``pay`` having run once."""
    from statemachine.sessions import SQLiteSession as StoreFileSession

    path = tmp_path / "events.db"
    paid: list[int] = []
    durable: list[Any] = []
    sent: list[list[str]] = []
    store = DiesWithItsProcess(path)

    class Dies(ScriptedModel):
        async def get_response(self, *args: Any, **kwargs: Any) -> Any:
            given = kwargs.get("input", args[1] if len(args) > 1 else None)
            sent.append(["user"] if isinstance(given, str)
                        else [_kind_of(item) for item in given or ()])
            if len(sent) == 2 and self is dying:  # asked again, after the tool: it dies
                store.dead = True
                apart = SQLiteEventStore(path, readonly=True)
                try:
                    held = RunController.load(apart, "r")
                    durable.append((held.phase("p1"), held.in_doubt()))
                finally:
                    apart.close()
                items = await StoreFileSession("s", path).get_items()
                durable.append([_kind_of(item) for item in items])
                raise Crash
            return await super().get_response(*args, **kwargs)

    def pay(amount: int) -> str:
        paid.append(amount)
        return f"paid {amount}"

    dying = Dies([[function_call("pay", {"amount": 7}, call_id="p1")]])
    answering = Dies([[assistant_message("paid 7")]])

    async def attempt(model: Any, input: Any, on: Any) -> Any:
        agent = Agent("payer", model=model, tools=[function_tool(pay)])
        run = await AgentRun.open(agent, run_id="r", store=on,
                                  session=cast("Any", StoreFileSession("s", path)))
        return await run.run(input, run_config=CONFIG)

    with pytest.raises(Crash):
        asyncio.run(attempt(dying, "pay 7", store))
    written = ["user", "function_call", "function_call_output"]
    assert durable == [(Phase.PUBLISHED, ()), written]
    sent.clear()
    result = asyncio.run(attempt(answering, None, SQLiteEventStore(path)))
    assert (result.step, result.final_output) == (Step.COMPLETED, "paid 7")
    assert sent == [written]  # asked again once, with the call and its output
    assert paid == [7]
    items = asyncio.run(StoreFileSession("s", path).get_items())
    assert [_kind_of(item) for item in items] == [*written, "assistant"]


# ------------------------------------------------- the model settings the model is sent


class _SettingsSeen(ScriptedModel):
    """A scripted model (the front agent hands off, the other answers) that keeps the
    name it was asked for and the `ModelSettings` of every request."""

    def __init__(self, seen: list[tuple[str, Any]]) -> None:
        super().__init__([[function_call("transfer_to_back", {}, call_id="h1")],
                          [assistant_message("done")]])
        self._seen = seen
        self.name = ""

    async def get_response(self, system_instructions: Any, input: Any, model_settings: Any,
                           *args: Any, **kwargs: Any) -> Any:
        self._seen.append((self.name, model_settings))
        return await super().get_response(system_instructions, input, model_settings,
                                          *args, **kwargs)


class _Provider(ModelProvider):
    """One scripted model behind every name (its script goes on across agents)."""

    def __init__(self, seen: list[tuple[str, Any]]) -> None:
        self._model = _SettingsSeen(seen)

    def get_model(self, model_name: str | None) -> Any:
        self._model.name = str(model_name)
        return self._model


SETTINGS_CASES = {
    # (the front agent's model, its explicit settings, the back agent's model,
    #  the run's model, the run's settings)
    "a gpt-5 by name": ("gpt-5", None, "gpt-5", None, None),
    "the default model": (None, None, None, None, None),
    "a name without defaults": ("gpt-4.1", None, "gpt-5", None, None),
    "explicit settings": ("gpt-5", ModelSettings(temperature=0.3), None, None, None),
    "the run's model by name": (None, None, "gpt-4.1", "gpt-5", None),
    "the run's settings on top": ("gpt-5", None, None, None, ModelSettings(max_tokens=9)),
    "the run's model and settings": ("gpt-4.1", None, None, "gpt-5",
                                     ModelSettings(verbosity="high")),
}


@pytest.mark.parametrize("case", sorted(SETTINGS_CASES))
def test_each_model_is_sent_the_settings_it_is_sent_alone(case: str) -> None:
    """The SDK derives the settings an agent leaves implicit from the model's name (a
    gpt-5's reasoning effort and verbosity); the ledger's copies of the agents hold the
    ledger's model instead of the name, which must not change what any request carries:
    every request (the front agent's, and the agent it hands off to) is sent the settings
    the SDK alone sends, across agent and run models given by name or left default,
    explicit settings and the run's settings on top."""
    front_model, explicit, back_model, run_model, run_settings = SETTINGS_CASES[case]

    def agents_() -> Agent[Any]:
        back = Agent("back", model=back_model)
        options: dict[str, Any] = {} if explicit is None else {"model_settings": explicit}
        return Agent("front", model=front_model, handoffs=[back], **options)

    def config(seen: list[tuple[str, Any]]) -> RunConfig:
        return RunConfig(model=run_model, model_settings=run_settings,
                         model_provider=_Provider(seen), tracing_disabled=True)

    alone: list[tuple[str, Any]] = []
    through: list[tuple[str, Any]] = []
    result = asyncio.run(Runner.run(agents_(), "go", run_config=config(alone)))
    assert result.final_output == "done"

    async def ledgered() -> Any:
        run = await AgentRun.open(agents_(), run_id="r", session=SQLiteSession("s"))
        return await run.run("go", run_config=config(through))

    assert asyncio.run(ledgered()).final_output == "done"
    assert len(alone) == 2  # (the handoff's request, then the answer's)
    assert through == alone


@pytest.mark.parametrize("reasoning", [False, True], ids=["message", "with-reasoning"])
def test_a_replayed_turn_writes_none_of_its_items_twice(tmp_path: Path,
                                                        reasoning: bool) -> None:
    """A response holding text (and a reasoning item) beside a call that needs approval;
    the run pauses, the call is approved, and a new process resumes it without the SDK
    state, so the recorded response is replayed and the SDK writes its items again. The
    Session ends as it does when the same run is resumed with the state (the SDK's own
    way back): each item once. Before, the replayed message (and reasoning) items were
    written a second time, under the same id."""
    from openai.types.responses import ResponseReasoningItem

    def run_once(folder: Path, with_state: bool) -> list[Any]:
        charges: list[int] = []

        @function_tool(needs_approval=True)
        def charge(x: int) -> str:
            """Charge the customer x dollars."""
            charges.append(x)
            return f"charged {x}"

        first: list[Any] = [assistant_message("I will charge you now."),
                            function_call("charge", {"x": 7}, call_id="c1")]
        if reasoning:
            first.insert(0, ResponseReasoningItem(id="rs_1", type="reasoning", summary=[]))
        model = ScriptedModel([first, [assistant_message("done")]])

        async def go() -> list[Any]:
            def opened() -> Awaitable[AgentRun]:
                return AgentRun.open(Agent("a", model=model, tools=[charge]), run_id="r",
                                     store=SQLiteEventStore(folder / "events.db"),
                                     session=SQLiteSession("s", str(folder / "s.db")))

            run = await opened()
            paused = await run.run("charge me 7", run_config=CONFIG)
            assert paused.state is not None
            saved = paused.state.to_string()
            await run.approve("c1")
            again = await opened()
            done = await again.run(run_config=CONFIG, state=saved if with_state else None)
            assert done.final_output == "done"
            assert charges == [7]
            return list(await SQLiteSession("s", str(folder / "s.db")).get_items())

        return asyncio.run(go())

    (tmp_path / "with").mkdir()
    (tmp_path / "without").mkdir()
    reference = run_once(tmp_path / "with", True)
    replayed = run_once(tmp_path / "without", False)
    assert replayed == reference
    said = [item for item in replayed if "I will charge you now." in json.dumps(item)]
    assert len(said) == 1
    assert sum(item.get("type") == "reasoning" for item in replayed) == int(reasoning)


def test_a_stream_whose_completed_response_is_empty_is_read_as_the_sdk_reads_it(
        tmp_path: Path) -> None:
    """A streaming backend may leave the ``response.completed`` event's output empty and
    give the items only as each finishes (``response.output_item.done``); the SDK then
    reads the response from those. Through the adapter, the ledger records the same
    response: the call is known, runs once, and the run completes as the SDK alone's
    does. Before, the ledger recorded an empty response: the call was refused as
    unknown, and every later attempt replayed the empty response and failed."""
    from agents import SQLiteSession

    charges: list[int] = []

    @function_tool
    def pay(x: int) -> str:
        """Pay x."""
        charges.append(x)
        return f"paid {x}"

    class Emptying(ScriptedModel):
        async def stream_response(self, *args: Any, **kwargs: Any) -> Any:
            async for event in super().stream_response(*args, **kwargs):
                if getattr(event, "type", None) != "response.completed":
                    yield event
                    continue
                emptied: Any = event.model_copy(deep=True)
                emptied.response.output = []
                yield emptied

    def agent() -> Agent[Any]:
        return Agent("a", model=Emptying([[function_call("pay", {"x": 7}, call_id="c1")],
                                          [assistant_message("done")]]), tools=[pay])

    async def go() -> tuple[Any, Any]:
        alone = Runner.run_streamed(agent(), "pay 7", run_config=CONFIG)
        async for _ in alone.stream_events():
            pass
        run = await AgentRun.open(agent(), run_id="r", store=SQLiteEventStore(
            tmp_path / "events.db"), session=SQLiteSession("s", str(tmp_path / "s.db")))
        streamed = run.run_streamed("pay 7", run_config=CONFIG)
        async for _ in streamed.stream_events():
            pass
        return alone.final_output, streamed.result

    alone, through = asyncio.run(go())
    assert alone == "done"
    assert (through.step, through.final_output) == (Step.COMPLETED, "done")
    assert charges == [7, 7]  # once alone, once through the ledger
    stored = RunController.load(SQLiteEventStore(tmp_path / "events.db"), "r")
    assert [view.call.call_id for view in stored.calls] == ["c1"]
    assert stored.phase("c1") is Phase.PUBLISHED
