"""openai-agents' tracing bridged into OpenTelemetry (`TracingBridge` in
statemachine.adapters.openai_agents), offline: the SDK's `agents.testing.ScriptedModel`
answers, the spans are read back from OpenTelemetry's SDK and its in-memory exporter
(the ``traced`` fixture).

The expected trees come from each scenario: a caller's request runs one turn in which
the model asks for ``charge(x=7)`` and then answers; the SDK's trace sits under the
caller's span, its function span under its agent span; the function span is the call's
one ``execute_tool charge`` span, the ledger's attributes and events joined to it (the
SDK traces the execution: the ledger opens no second span), and the body's own span sits
under it. A resumed turn whose call was recorded before asks the ledger again and is
answered ``resent``, on the bridged function span, the body never running again.

The SDK's trace processors and its tracing switch are global: each test installs only
the bridge (so the SDK's own exporter, which would reach for the network, is not
installed) and restores both afterwards.

Under CI a missing ``agents`` package fails this module instead of skipping it.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

try:
    import agents  # noqa: F401
except ImportError:  # pragma: no cover - CI installs the extra
    from tests.helpers import missing_extra

    missing_extra("openai-agents")

from agents import (
    Agent,
    RunConfig,
    SQLiteSession,
    function_tool,
    set_trace_processors,
    set_tracing_disabled,
)
from agents.exceptions import UserError
from agents.testing import ScriptedModel, assistant_message, function_call
from agents.tracing import custom_span, get_trace_provider
from agents.tracing import trace as agents_trace
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import StatusCode

from statemachine import MemoryEventStore, Phase, RunController, Step, telemetry
from statemachine.adapters.openai_agents import AgentRun, AgentRunResult, TracingBridge
from statemachine.telemetry import disable_telemetry
from statemachine.testing import FlakySession, InjectedWriteError
from tests import otel
from tests.adapters import test_openai_agents as adapter_tests
from tests.adapters.test_openai_agents import Hooks
from tests.otel import Traced, attributes

USER = "please charge me 7"
ARGUMENTS = '{"x":7}'  # as the model sends them
RESULT = "charged 7 dollars"
ANSWER = "your card was charged"
DECLINED = "card 4242 declined"
TRACED = RunConfig(tracing_disabled=False)  # the SDK traces (into the bridge only)
MODES = ["run", "run_streamed"]


@pytest.fixture
def bridged(traced: Traced) -> Iterator[Traced]:
    """Telemetry on, the SDK tracing, and the bridge its only trace processor; the SDK's
    processors and switch as they were afterwards."""
    provider: Any = get_trace_provider()
    processors = list(provider._multi_processor._processors)
    disabled = provider._manual_disabled
    set_trace_processors([TracingBridge()])
    set_tracing_disabled(False)
    try:
        yield traced
    finally:
        set_trace_processors(processors)
        provider.set_disabled(disabled)


class World:
    """The billing agent on a scripted model (which traces its generations): ``charge(x=7)``,
    then the answer; every charge counted. ``declined``: the charge raises (its error
    text is what the model is sent)."""

    def __init__(self, *, declined: bool = False) -> None:
        self.effects: Counter[str] = Counter()
        effects = self.effects

        @function_tool
        def charge(x: int) -> str:  # the body opens a span of its own, as a traced client does
            effects["tool charge"] += 1
            with trace.get_tracer("tests.billing").start_as_current_span("charge body"):
                if declined:
                    raise ValueError(DECLINED)
                return RESULT if x == 7 else "charged something else"

        model = ScriptedModel([[function_call("charge", {"x": 7}, call_id="c1")],
                               [assistant_message(ANSWER)]], emit_traces=True)
        self.agent = Agent("billing", model=model, tools=[charge])
        self.session = SQLiteSession("bridged", ":memory:")
        self.store = MemoryEventStore()

    async def attempt(self, mode: str = "run") -> AgentRunResult:
        """Open the run and make one attempt with the user's request."""
        run = await AgentRun.open(self.agent, run_id="bridged-run", session=self.session,
                                  store=self.store)
        if mode == "run":
            return await run.run(USER, run_config=TRACED)
        streamed = run.run_streamed(USER, run_config=TRACED)
        async for _ in streamed.stream_events():
            pass
        return streamed.result


def _bridged(traced: Traced, name: str, kind: str) -> list[ReadableSpan]:
    """The spans named ``name`` that mirror SDK spans of type ``kind``."""
    return [span for span in traced.spans if span.name == name
            and (span.attributes or {}).get("openai_agents.span_type") == kind]


def _ours(traced: Traced) -> ReadableSpan:
    """The ``execute_tool charge`` span carrying the ledger's outcome."""
    (span,) = [span for span in traced.named("execute_tool charge")
               if "statemachine.tool.outcome" in (span.attributes or {})]
    return span


def _function(traced: Traced) -> ReadableSpan:
    """The mirror of the SDK's function span of the charge."""
    (span,) = _bridged(traced, "execute_tool charge", "function")
    return span


def _values(span: ReadableSpan) -> list[Any]:
    """Every attribute value of ``span`` and of its events."""
    return [*(span.attributes or {}).values(),
            *(value for event in span.events for value in (event.attributes or {}).values())]


def _parent_is(span: ReadableSpan, parent: ReadableSpan) -> bool:
    return span.parent is not None and span.parent.span_id == parent.context.span_id


@pytest.mark.parametrize("mode", MODES)
def test_a_one_tool_turn_is_one_trace_with_the_ledgers_span_under_the_sdks(
        bridged: Traced, mode: str) -> None:
    world = World()

    async def go() -> AgentRunResult:  # a caller serving a request, traced itself
        with trace.get_tracer("tests.caller").start_as_current_span("handle request"):
            return await world.attempt(mode)

    result = asyncio.run(go())
    assert (result.step, result.final_output) == (Step.COMPLETED, ANSWER)
    assert world.effects["tool charge"] == 1

    spans = bridged.spans
    assert len({span.context.trace_id for span in spans}) == 1  # one trace
    (root,) = [span for span in spans if span.parent is None]
    assert root.name == "handle request"
    (workflow,) = bridged.named("Agent workflow")
    assert _parent_is(workflow, root)
    (agent,) = _bridged(bridged, "invoke_agent billing", "agent")
    assert dict(agent.attributes or {}) == {
        "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "billing",
        "openai_agents.span_type": "agent"}
    agent_above = bridged.ancestors(agent)
    assert agent_above[-2:] == ["Agent workflow", "handle request"]

    function = _function(bridged)  # the SDK's span of the call, the ledger's joined to it
    assert dict(function.attributes or {}) == {
        "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "charge",
        "gen_ai.tool.type": "function", "openai_agents.span_type": "function",
        "gen_ai.tool.call.id": "c1", "statemachine.run_id": "bridged-run",
        "statemachine.tool.outcome": "executed"}
    function_above = bridged.ancestors(function)
    assert function_above[function_above.index("invoke_agent billing"):] == [
        "invoke_agent billing", *agent_above]
    assert bridged.named("execute_tool") == [function]  # one span for the one execution
    assert [e["statemachine.event"] for e in bridged.transitions()
            if e["span"] == "execute_tool charge"] == ["ToolStarted", "ToolCompleted"]
    (body,) = bridged.named("charge body")
    assert _parent_is(body, function)

    # the model was asked twice (the call, then the answer): two generations, mirrored
    chats = _bridged(bridged, "chat", "generation")
    assert len(chats) == 2
    assert all("invoke_agent billing" in bridged.ancestors(chat) for chat in chats)
    # the input, the call with its output, the answer: three writes, in the SDK's trace
    published = bridged.named("statemachine.publish")
    assert attributes(published, "statemachine.publication.outcome") == [("committed",)] * 3
    assert all("Agent workflow" in bridged.ancestors(span) for span in published)


def test_no_attribute_holds_the_input_the_arguments_the_result_or_the_answer(
        bridged: Traced) -> None:
    assert asyncio.run(World().attempt()).step is Step.COMPLETED
    assert _function(bridged)  # the run was traced, bridged
    assert _ours(bridged)
    values = [str(value) for value in bridged.values()]
    for payload in (USER, ARGUMENTS, '"x"', RESULT, ANSWER):
        assert not [value for value in values if payload in value], payload


def test_an_sdk_span_that_failed_ends_failed_naming_no_message(bridged: Traced) -> None:
    """The charge raises: the SDK sends the model its error text and marks its function
    span failed; the mirror ends failed (``error.type`` ``_OTHER``: the SDK keeps a
    message, never a type), the message nowhere. For the ledger the tool answered."""
    world = World(declined=True)
    result = asyncio.run(world.attempt())
    assert (result.step, result.final_output) == (Step.COMPLETED, ANSWER)
    function = _function(bridged)
    assert function.status.status_code is StatusCode.ERROR
    assert (function.attributes or {})["error.type"] == "_OTHER"
    assert attributes([_ours(bridged)], "statemachine.tool.outcome") == [("executed",)]
    failed = [span for span in bridged.spans if span.status.status_code is StatusCode.ERROR]
    assert [span.name for span in failed] == ["charge body", "execute_tool charge"]
    assert failed[1] is function
    # the body's own span recorded its exception (the tool's choice); none of ours did
    ours = [span for span in bridged.spans if span.name != "charge body"]
    assert not [value for span in ours for value in _values(span) if "4242" in str(value)]
    assert all(not span.status.description for span in ours)


def test_off_the_bridge_emits_nothing(bridged: Traced) -> None:
    disable_telemetry()
    world = World()
    assert asyncio.run(world.attempt()).step is Step.COMPLETED
    assert world.effects["tool charge"] == 1
    (body,) = bridged.spans  # the tool's own span only, a root: nothing of ours above it
    assert (body.name, body.parent) == ("charge body", None)


def test_a_recorded_call_asked_again_is_resent_under_the_bridged_spans(
        bridged: Traced) -> None:
    """The adapter tests' approval scenario (tests/adapters/test_openai_agents.py): the
    model asks for charge, notify and log; charge approved, the others rejected; charge
    completes and its end hook raises before its result is written. A new `AgentRun` (as
    a new process would open it) resumes with the SDK state saved at the pause: the SDK
    asks for the charge again and the ledger answers from its record, ``resent``, under
    the SDK's function span, in the trace the SDK resumes (the paused one's), the body
    never running again."""

    class FailingEndHook(Hooks):
        async def on_tool_end(self, context: Any, agent: Any, tool: Any, result: Any) -> None:
            await super().on_tool_end(context, agent, tool, result)
            if self.effects[f"hook tool_end {tool.name}"] == 1:
                raise RuntimeError("the end hook failed")

    world = adapter_tests.World(adapter_tests.APPROVAL, "atomic-no-commit")
    world.hooks = FailingEndHook(world.effects)

    async def first() -> tuple[AgentRun, str]:
        run = await adapter_tests.open_run(world)
        paused = await run.run("charge me 7", hooks=world.hooks, run_config=TRACED)
        assert paused.step is Step.INTERRUPTION
        assert paused.state is not None
        saved = paused.state.to_string()  # as saved at the pause
        for item in paused.interruptions:
            await (run.approve(item) if item.call_id == "c1" else run.reject(item))
        with pytest.raises(UserError, match="end hook failed"):  # the SDK wraps it
            await run.run(hooks=world.hooks, run_config=TRACED)
        return run, saved

    run, saved = asyncio.run(first())
    assert run.controller.phase("c1") is Phase.COMPLETED  # recorded, never written
    assert attributes([_ours(bridged)], "statemachine.tool.outcome") == [("executed",)]
    (paused_trace,) = {span.context.trace_id for span in bridged.named("Agent workflow")}
    bridged.clear()

    async def again() -> Any:
        resumed = await adapter_tests.open_run(world)
        return await resumed.run(state=saved, hooks=world.hooks, run_config=TRACED)

    done = asyncio.run(again())
    assert (done.step, done.final_output) == (Step.COMPLETED, "charged and notified")
    assert world.effects["tool charge"] == 1
    assert world.effects["hook tool_end charge"] == 2  # it raised before its record
    resent = _ours(bridged)
    assert attributes([resent], "gen_ai.tool.call.id", "statemachine.tool.outcome") == [
        ("c1", "resent")]
    assert resent is _function(bridged)  # the SDK's function span says so, no other
    assert bridged.named("execute_tool") == [resent]
    assert "invoke_agent billing" in bridged.ancestors(resent)
    assert {span.context.trace_id for span in bridged.spans
            if span.name != "statemachine.record"} == {paused_trace}


def test_a_span_ended_in_another_context_ends_and_the_trace_restores_the_context(
        bridged: Traced, caplog: pytest.LogCaptureFixture) -> None:
    """An SDK span started here and finished in another context (a copy, as a task or a
    thread runs in) ends without touching this context's current span, nothing raised or
    logged; the trace's end, here, gives this context back its span from before."""
    before = trace.get_current_span()
    with caplog.at_level(logging.WARNING), agents_trace("detached work"):
        span = custom_span("elsewhere")
        span.start()  # not marked current for the SDK, current for OpenTelemetry here
        assert trace.get_current_span().is_recording()
        contextvars.copy_context().run(span.finish)
    assert trace.get_current_span() is before
    assert caplog.records == []
    (mirrored,) = bridged.named("custom")
    (workflow,) = bridged.named("detached work")
    assert _parent_is(mirrored, workflow)


def test_a_bridge_that_fails_never_fails_the_run(
        bridged: Traced, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("no tracer today")

    monkeypatch.setattr(telemetry, "mirror", broken)
    world = World()
    with caplog.at_level(logging.WARNING, logger="statemachine.adapters.openai_agents"):
        result = asyncio.run(world.attempt())
    assert (result.step, result.final_output) == (Step.COMPLETED, ANSWER)
    assert world.effects["tool charge"] == 1
    messages = {record.getMessage() for record in caplog.records}
    assert "TracingBridge.on_span_start failed (RuntimeError); the SDK's run goes on" in messages
    assert not [m for m in messages if "no tracer today" in m]  # its type, not its message
    assert _ours(bridged)  # the ledger's own spans go on


def test_the_seed_scenario_is_one_tree_per_request(bridged: Traced) -> None:
    """The billing agent's charge needs approval. Request 1: the model asks for it and
    the run pauses (the SDK opens its function span, finds the approval missing and runs
    nothing: the ledger is not asked); a reviewer approves it; request 2 resumes from the
    saved state: charge runs and its end hook raises before its result is written (the
    SDK marks its function and agent spans failed); request 3 resumes again: the SDK asks
    for charge, the ledger resends the recorded result, and the write of the call's output
    lands and then raises; request 4: the claim's reconcile finds the write (acknowledged)
    before the SDK starts, the model answers and the answer is written. Each request runs
    under a trace of its own (``trace_id`` in its run config), so the SDK's trace sits
    under the caller's span and the ledger's events recorded before the SDK starts (the
    claim, the gate, the reconcile) on the caller's span itself; the call is one
    ``execute_tool charge`` span each time the SDK runs it, the SDK's function span."""
    effects: Counter[str] = Counter()

    @function_tool(needs_approval=True)
    def charge(x: int) -> str:
        effects["tool charge"] += 1
        return RESULT if x == 7 else "charged something else"

    class FailingEndHook(Hooks):
        async def on_tool_end(self, context: Any, agent: Any, tool: Any, result: Any) -> None:
            await super().on_tool_end(context, agent, tool, result)
            if self.effects[f"hook tool_end {tool.name}"] == 1:
                raise RuntimeError("the end hook failed")

    hooks = FailingEndHook(effects)
    model = ScriptedModel([[function_call("charge", {"x": 7}, call_id="c1")],
                           [assistant_message(ANSWER)]], emit_traces=True)
    agent = Agent("billing", model=model, tools=[charge])
    session: Any = FlakySession(SQLiteSession("bridged", ":memory:"),
                                fail_on=10**9, outcome="commit_then_raise")
    store = MemoryEventStore()
    caller = trace.get_tracer("tests.caller")

    async def request(n: int, *, state: str | None = None) -> AgentRunResult:
        config = RunConfig(tracing_disabled=False, trace_id=f"trace_{n:032x}")
        with caller.start_as_current_span(f"request {n}"):
            run = await AgentRun.open(agent, run_id="r", session=session, store=store)
            return await run.run(None if state else USER, state=state, hooks=hooks,
                                 run_config=config)

    async def go() -> AgentRunResult:
        paused = await request(1)
        assert paused.step is Step.INTERRUPTION
        assert paused.state is not None
        saved = paused.state.to_string()
        with caller.start_as_current_span("review"):
            await (await AgentRun.open(agent, run_id="r", session=session,
                                       store=store)).approve("c1")
        with pytest.raises(UserError, match="end hook failed"):
            await request(2, state=saved)
        session.fail_on = session.add_calls + 1  # the next write: the call's output
        with pytest.raises(InjectedWriteError):
            await request(3, state=saved)
        return await request(4, state=saved)

    done = asyncio.run(go())
    assert (done.step, done.final_output) == (Step.COMPLETED, ANSWER)
    assert effects["tool charge"] == 1
    assert bridged.tree() == otel.dedent("""
        request 1
          · RunStarted InputAdded
          Agent workflow
            task
              statemachine.publish via=staged items=1 outcome=committed
                · PublicationStaged PublicationCommitted
              invoke_agent billing
                turn
                  · HookRan HookRan ModelCallBegun ModelResponded
                  chat
                  execute_tool charge
                statemachine.publish via=staged items=1 outcome=committed
                  · PublicationStaged PublicationCommitted
        review
          · CallApproved
        request 2
          · RunClaimed Resumed
          Agent workflow
            task
              invoke_agent billing error=_OTHER
                execute_tool charge call=c1 outcome=executed error=_OTHER
                  · HookRan ToolStarted ToolCompleted
        request 3
          · RunClaimed
          Agent workflow
            task
              invoke_agent billing error=_OTHER
                execute_tool charge call=c1 outcome=resent
                  · HookRan
                statemachine.publish via=staged items=1 outcome=failed error=InjectedWriteError
                  · PublicationStaged PublicationFailed
        request 4
          · RunClaimed
          statemachine.publish via=reconcile outcome=acknowledged
            · ReconciledAcknowledge
          Agent workflow
            task
              invoke_agent billing
                · FinalOutputAccepted
                turn
                  · HookRan ModelCallBegun ModelResponded HookRan
                  chat
                statemachine.publish via=staged items=1 outcome=committed
                  · PublicationStaged PublicationCommitted""")
    bridged.assert_conventions()
    assert len(bridged.walk()) == len(RunController.load(store, "r").events)
    bridged.assert_no_payloads(USER, ARGUMENTS, '"x"', RESULT, ANSWER)
