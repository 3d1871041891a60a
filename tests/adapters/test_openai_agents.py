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
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

try:
    import agents  # noqa: F401
except ImportError:  # pragma: no cover - CI installs the extra
    if os.environ.get("CI"):
        raise  # a skip here would hide the adapter's tests: under CI it fails the run
    pytest.skip("openai-agents is not installed (pip install -e '.[openai-agents]')",
                allow_module_level=True)

from agents import (
    Agent,
    GuardrailFunctionOutput,
    RunConfig,
    RunHooks,
    Runner,
    SQLiteSession,
    ToolGuardrailFunctionOutput,
    function_tool,
    output_guardrail,
    set_tracing_disabled,
    tool_input_guardrail,
    tool_output_guardrail,
)
from agents.exceptions import UserError
from agents.testing import ScriptedModel, assistant_message, function_call

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
    Step,
    ToolInDoubt,
)
from statemachine.adapters.openai_agents import AgentRun, AgentRunResult, SDKStateRequired
from statemachine.stores import AsyncSQLiteEventStore, SQLiteEventStore
from statemachine.testing import FlakySession, InjectedWriteError

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


def test_a_turn_without_its_sdk_state_fails_closed() -> None:
    async def go() -> None:
        world = World(APPROVAL, "atomic-no-commit")
        run = await open_run(world)
        await run.run("charge me 7", hooks=world.hooks, run_config=CONFIG)
        await run.approve("c1")
        fresh = await open_run(world)
        with pytest.raises(SDKStateRequired):
            await fresh.run(run_config=CONFIG)
        assert world.effects["tool charge"] == 0

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
    resumed = _driver("resume", str(tmp_path), "resumer")
    assert json.loads(resumed.stdout) == {"name": "resumer", "outcome": "error",
                                          "error": "ToolInDoubt", "step": "tools"}
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
