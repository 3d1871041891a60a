"""OpenTelemetry spans through the adapters (DESIGN §7.6, issue 31), read back from
OpenTelemetry's own SDK and its in-memory exporter: where the SDK traces its tools with
OpenTelemetry (pydantic-ai's instrumentation, ADK's tracing) each call is one
``execute_tool`` span, the SDK's, carrying the ledger's attributes and events; where it
does not (LangGraph, the Anthropic SDK) the ledger's span sits under the caller's span; a
call answered from the ledger says so.

The expected trees come from each scenario (which tools the model asks for, which call
died in its body, which request failed and was retried), never from the ledger. The
openai-agents adapter's spans go through its tracing bridge
(tests/adapters/test_telemetry_openai_agents.py).

Under CI a missing SDK fails this module instead of skipping it."""

from __future__ import annotations

import asyncio
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

try:
    import google.adk  # noqa: F401
    import langgraph  # noqa: F401
    import pydantic_ai  # noqa: F401
except ImportError:  # pragma: no cover - CI installs the extras
    if os.environ.get("CI"):
        raise
    pytest.skip("the adapters' SDKs are not installed (pip install -e '.[dev]')",
                allow_module_level=True)

from google.adk.sessions import InMemorySessionService
from langchain_core.messages import HumanMessage, ToolMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.types import Command
from opentelemetry import trace
from pydantic_ai import Agent, DeferredToolRequests
from pydantic_ai.capabilities.instrumentation import Instrumentation
from pydantic_ai.models.instrumented import InstrumentationSettings

from statemachine import (
    MemoryEventStore,
    Phase,
    Resolution,
    RunController,
    SQLiteEventStore,
    Step,
    ToolInDoubt,
    operator,
)
from statemachine.adapters.anthropic import LedgerSessionToolRunner, MessageToolLedger
from statemachine.adapters.google_adk import confirmation
from statemachine.adapters.langgraph import OneWriterSaver, ToolLedger, decision
from statemachine.adapters.pydantic_ai import LedgerRun
from statemachine.sessions import MemorySession
from statemachine.telemetry import SCOPE
from statemachine.testing import FlakySession, InjectedWriteError
from tests import otel
from tests.adapters import test_google_adk as adk
from tests.adapters import test_langgraph as lg
from tests.adapters.test_anthropic import FakeModel, _loop, counted_charge, drive, sync_charge
from tests.adapters.test_pydantic_ai import call, scripted
from tests.drivers import adk_driver, langgraph_driver
from tests.drivers.anthropic_driver import SESSION_ID, FakeSession, PostFault, client_for, tool_use
from tests.drivers.effects import Effects
from tests.otel import Traced, attributes

OUTCOME = "statemachine.tool.outcome"


def _ours(traced: Traced) -> list[Any]:
    """The ``execute_tool`` spans that carry the ledger's outcome (its own, or an SDK's
    it joined)."""
    return [span for span in traced.named("execute_tool")
            if OUTCOME in (span.attributes or {})]


def _sdks(spans: list[Any]) -> bool:
    """Every one of ``spans`` was made by an SDK's instrumentation, none by the library."""
    return all(span.instrumentation_scope is not None
               and span.instrumentation_scope.name != SCOPE for span in spans)


# ------------------------------------------------------------------- pydantic-ai


def _instrumented(model: Any, ran: Counter[str]) -> Agent[None, Any]:
    settings = InstrumentationSettings(tracer_provider=otel.provider(), include_content=False)
    agent: Agent[None, Any] = Agent(model, capabilities=[Instrumentation(settings=settings)])

    @agent.tool_plain(sequential=True)
    def lookup(i: int) -> str:
        ran[f"lookup {i}"] += 1
        return f"found {i}"

    @agent.tool_plain(sequential=True)
    async def charge(x: int) -> str:
        ran[f"charge {x}"] += 1
        if ran[f"charge {x}"] == 1:
            raise asyncio.CancelledError  # the first run dies in the body
        return "unreachable"

    return agent


def test_pydantic_ai_spans_are_its_instrumentations_joined(traced: Traced) -> None:
    """lookup completes and charge dies in its body; the operator settles charge; the
    resumed run asks pydantic-ai again: lookup is answered from the ledger (resent). Each
    call, each time pydantic-ai runs it, is one ``execute_tool`` span: pydantic-ai's own,
    with the ledger's outcome on it."""
    ran: Counter[str] = Counter()
    agent = _instrumented(scripted([[call("lookup", "c2", i=1), call("charge", "c1", x=7)]]),
                          ran)

    async def go() -> None:
        run = await LedgerRun.open(agent, run_id="r", history=MemorySession("h"),
                                   store=MemoryEventStore())
        with pytest.raises(asyncio.CancelledError):
            await run.run("go")
        assert attributes(traced.named("execute_tool"), "gen_ai.tool.call.id", OUTCOME) == [
            ("c2", "executed"), ("c1", "interrupted")]  # lookup, then charge's death
        assert _sdks(traced.named("execute_tool"))
        for span in traced.named("execute_tool"):
            assert traced.ancestors(span) == ["invoke_agent agent"]
        traced.clear()
        await run.resolve_in_doubt("c1", "charged 7 (the operator)")
        await run.run()

    asyncio.run(go())
    assert ran == Counter({"lookup 1": 1, "charge 7": 1})
    assert attributes(traced.named("execute_tool"), "gen_ai.tool.call.id", OUTCOME) == [
        ("c2", "resent"), ("c1", "resent")]
    assert _sdks(traced.named("execute_tool"))
    traced.assert_no_payloads("found 1", "charged 7", '"x"', '"i"')


class _LosesARead(MemorySession):
    """A history whose connection is lost on the first read after ``ran`` counts a
    charge: the attempt stops with the charge's result recorded, before its write."""

    def __init__(self, session_id: str, ran: Counter[str]) -> None:
        super().__init__(session_id)
        self.ran = ran
        self.lost = False

    async def get_items(self, limit: int | None = None) -> list[Any]:
        if self.ran["charge 7"] and not self.lost:
            self.lost = True
            raise ConnectionError("the connection was lost")
        return await super().get_items(limit)


def test_pydantic_ai_the_seed_scenario_is_one_tree_per_request(traced: Traced) -> None:
    """The model asks for lookup (no approval) and charge (approval) at once. Request 1:
    lookup runs, the run pauses for charge; a reviewer approves it; request 2: charge runs
    and the connection is lost before its result is written; request 3 (a new process):
    pydantic-ai asks for charge again and the ledger resends the recorded result, whose
    write lands and then raises; request 4: the write is found (acknowledged) and the
    model answers. Each request is one tree under the caller's span: pydantic-ai's agent
    and chat spans, its ``execute_tool`` span of each call (the ledger's outcome on it),
    and each write a publication: the prompt and the model's calls inside its chat span
    (written before the model is asked again), lookup's result when the run pauses and
    the answer once pydantic-ai returned it (after its agent span), the reconcile first
    thing in request 4."""
    ran: Counter[str] = Counter()
    settings = InstrumentationSettings(tracer_provider=otel.provider(), include_content=False)
    model = scripted([[call("lookup", "c2", i=1), call("charge", "c1", x=7)]])
    agent: Agent[None, Any] = Agent(model, output_type=[str, DeferredToolRequests],
                                    capabilities=[Instrumentation(settings=settings)])

    @agent.tool_plain(requires_approval=True)
    async def charge(x: int) -> str:
        ran[f"charge {x}"] += 1
        return f"charged {x}"

    @agent.tool_plain
    def lookup(i: int) -> str:
        ran[f"lookup {i}"] += 1
        return f"found {i}"

    store = MemoryEventStore()
    history = FlakySession(_LosesARead("h", ran), fail_on=4,
                           outcome="commit_then_raise")  # the 4th write: charge's result
    caller = trace.get_tracer("tests.caller")

    async def request(name: str, prompt: str | None = None) -> Any:
        with caller.start_as_current_span(name):
            run = await LedgerRun.open(agent, run_id="r", history=history, store=store)
            return await run.run(prompt)

    async def go() -> Any:
        assert (await request("request 1", "charge me 7")).step is Step.INTERRUPTION
        with caller.start_as_current_span("review"):
            await (await LedgerRun.open(agent, run_id="r", history=history,
                                        store=store)).approve("c1")
        with pytest.raises(ConnectionError):
            await request("request 2")
        with pytest.raises(InjectedWriteError):
            await request("request 3")
        return await request("request 4")

    done = asyncio.run(go())
    assert done.step is Step.COMPLETED
    assert sorted(done.output.split(" | ")) == ["charged 7", "done", "found 1"]
    assert ran == Counter({"lookup 1": 1, "charge 7": 1})
    assert traced.tree() == otel.dedent("""
        request 1
          · RunStarted
          invoke_agent agent
            chat function:respond:stream
              · ModelCallBegun ModelResponded
              statemachine.publish via=staged items=1 outcome=committed
                · PublicationStaged PublicationCommitted
              statemachine.publish via=staged items=1 outcome=committed
                · PublicationStaged PublicationCommitted
            execute_tool lookup call=c2 outcome=executed
              · ToolStarted ToolCompleted
          statemachine.publish via=staged items=1 outcome=committed
            · PublicationStaged PublicationCommitted
        review
          · CallApproved
        request 2
          · RunClaimed Resumed
          invoke_agent agent
            execute_tool charge call=c1 outcome=executed
              · ToolStarted ToolCompleted
            chat function:respond:stream
        request 3
          · RunClaimed
          invoke_agent agent
            execute_tool charge call=c1 outcome=resent
            chat function:respond:stream
              statemachine.publish via=staged items=1 outcome=failed error=InjectedWriteError
                · PublicationStaged PublicationFailed
        request 4
          · RunClaimed ModelResponded FinalOutputAccepted
          statemachine.publish via=reconcile outcome=acknowledged
            · ReconciledAcknowledge
          invoke_agent agent
            chat function:respond:stream
              · ModelCallBegun
          statemachine.publish via=staged items=1 outcome=committed
            · PublicationStaged PublicationCommitted""")
    assert _sdks(traced.named("execute_tool"))  # pydantic-ai's own, one per execution
    traced.assert_conventions()
    assert len(traced.walk()) == len(RunController.load(store, "r").events)
    traced.assert_no_payloads("charge me 7", "charged 7", "found 1", '"x"', '"i"')


# ------------------------------------------------------------------------ ADK


def test_adk_spans_are_its_own_tool_span_joined(tmp_path: Path, traced: Traced) -> None:
    w = adk.World(tmp_path, "ledger", [adk.CHARGE], ["charge"])

    async def go() -> None:
        await w.open()
        await adk_driver.run(w.runner, adk_driver.text("go"))

    asyncio.run(go())
    assert w.ran() == ["charge 5"]
    (tool,) = traced.named("execute_tool")  # ADK's, the only one
    assert attributes([tool], "gen_ai.tool.name", "gen_ai.tool.call.id", OUTCOME) == [
        ("charge", "c1", "executed")]
    assert _sdks([tool])
    assert traced.ancestors(tool)[:1] == ["invoke_agent agent"]
    traced.assert_no_payloads("amount", "charged")


class _LosesTheWiresAppend(adk_driver.DieBeforeAppend):
    """The append of the wire's response (once the wire ran) raises, nothing written."""

    def __init__(self, service: Any, effects: Path) -> None:
        super().__init__(service)
        self.effects = effects
        self.failed = False

    async def append_event(self, session: Any, event: Any) -> Any:
        if (not self.failed and "wire 7" in adk_driver.effects(self.effects)
                and any(r.id == "w1" for r in event.get_function_responses())):
            self.failed = True
            raise OSError("the append was lost")
        return await self.service.append_event(session, event)


def test_adk_the_seed_scenario_is_one_tree_per_request(tmp_path: Path,
                                                       traced: Traced) -> None:
    """The model asks for charge (no confirmation) and two wires (each needs one) at once.
    Request 1: charge runs, ADK asks for both confirmations (the ledger runs nothing
    there); request 2 rejects the 700 wire (answered with its rejection); request 3
    confirms the 7 wire, which runs, and its response's append is lost, nothing written;
    request 4 resumes the invocation: the ledger writes the recorded response again
    (reconciled: append) and the model answers. Every call is ADK's own ``execute_tool``
    span, the ledger's outcome and events on it (the model's batch enters the ledger at
    the first tool callback, so its events sit there too); each append of function
    responses is a publication under ADK's workflow span."""
    script: list[adk_driver.Call] = [adk.CHARGE, ("w1", "wire", {"amount": 7}),
                                     ("w2", "wire", {"amount": 700})]
    w = adk.World(tmp_path, "ledger", script, ["charge", "wire"], resumable=True,
                  service=_LosesTheWiresAppend(InMemorySessionService(),
                                               tmp_path / "effects.txt"))
    caller = trace.get_tracer("tests.caller")

    async def go() -> None:
        await w.open()
        with caller.start_as_current_span("request 1"):
            first = await adk_driver.run(w.runner, adk_driver.text("go"))
        asked = adk_driver.confirmation_requests(first)
        with caller.start_as_current_span("request 2"):
            request, payload = asked["w2"]
            await adk_driver.run(w.runner, confirmation(
                request, fingerprint=payload["fingerprint"], confirmed=False))
        request, payload = asked["w1"]
        confirmed = confirmation(request, fingerprint=payload["fingerprint"], confirmed=True)
        with caller.start_as_current_span("request 3"), pytest.raises(
                OSError, match="append was lost"):
            await adk_driver.run(w.runner, confirmed)
        with caller.start_as_current_span("request 4"):
            done = await adk_driver.run(w.runner, None,
                                        invocation_id=first[-1].invocation_id)
        assert any(part.text == "done" for event in done if event.content
                   for part in event.content.parts or ())

    asyncio.run(go())
    assert w.ran() == ["charge 5", "wire 7"]
    tree = re.sub(r"call=[0-9a-f-]{36}", "call=<its event id>", traced.tree())
    assert tree == otel.dedent("""
        request 1
          invoke_workflow agent
            · RunStarted
            invoke_agent agent
              generate_content scripted
              execute_tool charge call=c1 outcome=executed
                · ModelCallBegun ModelResponded Resumed ToolStarted ToolCompleted
              execute_tool wire call=w1
              execute_tool wire call=w2
              execute_tool (merged) call=<its event id>
            statemachine.publish via=staged items=1 outcome=committed
              · PublicationStaged PublicationCommitted
        request 2
          invoke_workflow agent
            invoke_agent agent
              execute_tool wire call=w2 outcome=rejected error=TOOL_ERROR
                · CallRejected
            statemachine.publish via=staged items=1 outcome=committed
              · PublicationStaged PublicationCommitted
        request 3
          invoke_workflow agent
            invoke_agent agent
              execute_tool wire call=w1 outcome=executed
                · CallApproved Resumed ToolStarted ToolCompleted
            statemachine.publish via=staged items=1 outcome=failed error=OSError
              · PublicationStaged PublicationFailed
        request 4
          invoke_workflow agent
            statemachine.publish via=reconcile outcome=committed
              · ReconciledAppend PublicationCommitted
            invoke_agent agent
              generate_content scripted""")
    assert _sdks(traced.named("execute_tool"))  # ADK's own, one per call it handled
    traced.assert_conventions()
    events = traced.walk()
    assert len(events) == len(RunController.load(w.store, adk_driver.RUN).events)
    decided = [(e["statemachine.event"], e["gen_ai.tool.call.id"], e["statemachine.actor"])
               for e in events if e["statemachine.event"] in ("CallApproved", "CallRejected")]
    assert decided == [("CallRejected", "w2", "adk:confirmation"),
                       ("CallApproved", "w1", "adk:confirmation")]
    traced.assert_no_payloads("amount", "wired", "charged")


def test_adk_a_call_in_doubt_is_refused_and_settled_by_an_operator(
        tmp_path: Path, traced: Traced, monkeypatch: pytest.MonkeyPatch) -> None:
    w = adk.World(tmp_path, "ledger", [adk.CHARGE], ["charge"], resumable=True)
    assert w.plugin is not None
    plugin = w.plugin
    def die_at(point: str) -> None:  # the body stops there, as the process would die
        if adk_driver.KILL["point"] == point:
            raise adk.StopInBody(point)

    monkeypatch.setattr(adk_driver, "die_at", die_at)

    async def go() -> None:
        await w.open()
        adk_driver.KILL["point"] = "before-effect"
        try:
            with pytest.raises(adk.StopInBody):
                await adk._noting(w.runner, [])
        finally:
            adk_driver.KILL["point"] = ""
        plugin.forget()  # a fresh process: the store's record only
        traced.clear()
        with pytest.raises(ToolInDoubt):
            await adk_driver.run(w.runner, adk_driver.text("again"))

    asyncio.run(go())
    assert w.ran() == []
    (refused,) = _ours(traced)
    assert attributes([refused], "gen_ai.tool.call.id", OUTCOME, "error.type") == [
        ("c1", "refused_in_doubt", "ToolInDoubt")]
    traced.clear()
    operator.resolve(w.store, adk_driver.RUN, "c1", outcome=Resolution.NOT_EXECUTED, by="ops")
    (command,) = traced.spans
    assert (command.name, (command.attributes or {})["statemachine.actor"]) == (
        "statemachine.resolve_in_doubt", "ops")
    resolved = [dict(e.attributes or {}) for e in command.events][-1]
    assert (resolved["statemachine.event"], resolved["statemachine.resolution"],
            resolved["statemachine.actor"]) == ("InDoubtResolved", "not_executed", "ops")


# ------------------------------------------------------------------ LangGraph


def test_langgraph_spans_nest_under_the_callers_span(tmp_path: Path, traced: Traced) -> None:
    """LangGraph traces to LangSmith, not OpenTelemetry: the caller's span is the parent.
    The same calls run again on another thread are answered from the ledger."""
    path = tmp_path / "effects.txt"
    ledger = ToolLedger(SQLiteEventStore(tmp_path / "ledger.db"), run_id="one-run")
    graph = langgraph_driver.build(
        "ledger", langgraph_driver.make_tools(path),
        langgraph_driver.ScriptedModel(script=langgraph_driver.SCRIPT), InMemorySaver(),
        ledger=ledger)
    tracer = trace.get_tracer("tests.caller")
    for thread in ("t1", "t2"):
        with tracer.start_as_current_span(f"request {thread}"):
            graph.invoke({"messages": [HumanMessage("charge me 7")]},
                         {"configurable": {"thread_id": thread}})
    assert langgraph_driver.effects(path) == ["charge 7"]
    first, second = _ours(traced)
    assert attributes([first, second], "gen_ai.tool.call.id", OUTCOME) == [
        ("call-charge", "executed"), ("call-charge", "resent")]
    assert traced.ancestors(first) == ["request t1"]
    assert traced.ancestors(second) == ["request t2"]
    traced.assert_no_payloads("charge me 7", "charged 7", "amount")


class _LosesTheToolsStep:
    """Wraps a saver: the step that adds the tools' ToolMessages is lost whole, the tools'
    own writes and the checkpoint after them (each raises once, nothing saved), as when
    the checkpointer's connection drops under that step."""

    def __init__(self, saver: Any) -> None:
        self.put, self.put_writes = saver.put, saver.put_writes
        self.lost: set[str] = set()
        saver.put, saver.put_writes = self.putting, self.writing

    def _lose(self, what: str, values: list[Any]) -> None:
        held = [v for value in values for v in (value if isinstance(value, list) else [value])]
        if what not in self.lost and any(isinstance(v, ToolMessage) for v in held):
            self.lost.add(what)
            raise OSError(f"injected: the {what} was lost")

    def writing(self, config: Any, writes: Any, task_id: str, task_path: str = "") -> Any:
        self._lose("tools' writes", [value for _, value in writes])
        return self.put_writes(config, writes, task_id, task_path)

    def putting(self, config: Any, checkpoint: Any, metadata: Any, versions: Any) -> Any:
        self._lose("checkpoint", checkpoint["channel_values"].get("messages") or [])
        return self.put(config, checkpoint, metadata, versions)


def test_langgraph_the_seed_scenario_is_one_tree_per_request(tmp_path: Path,
                                                             traced: Traced) -> None:
    """The graph ``model → review → tools → model`` on ``OneWriterSaver(ledger=)``, so
    the checkpoint that adds the tools' results is their publication. Request 1: the model
    asks for charge, the review enters it in the ledger and pauses for a decision;
    request 2 approves it (resuming the graph): charge runs, and the step's writes are
    lost, its checkpoint the failed publication; request 3 resumes: LangGraph runs the
    tool node again, the ledger resends the recorded result, the checkpoint reconciles
    the failed publication (nothing had landed: it is written, committed) and the model
    answers. LangGraph does not trace with OpenTelemetry: everything sits under the
    caller's span, the ledger's ``execute_tool`` span of each call among them."""
    path = tmp_path / "effects.txt"
    store = SQLiteEventStore(tmp_path / "ledger.db")
    ledger = ToolLedger(store, approvals=["charge"])
    inner = InMemorySaver()
    _LosesTheToolsStep(inner)
    graph = langgraph_driver.build(
        "ledger", langgraph_driver.make_tools(path),
        langgraph_driver.ScriptedModel(script=langgraph_driver.SCRIPT),
        OneWriterSaver(inner, ledger=ledger), ledger=ledger, review=True)
    caller = trace.get_tracer("tests.caller")
    with caller.start_as_current_span("request 1"):
        prints = lg._pending(graph.invoke({"messages": [HumanMessage("charge me 7")]},
                                          lg.CONFIG, durability="sync"))
    with caller.start_as_current_span("request 2"), pytest.raises(OSError, match="injected"):
        graph.invoke(Command(resume={"call-charge": decision("approve", prints["call-charge"])}),
                     lg.CONFIG, durability="sync")
    with caller.start_as_current_span("request 3"):
        done = graph.invoke(None, lg.CONFIG, durability="sync")
    assert done["messages"][-1].content == "done"
    assert langgraph_driver.effects(path) == ["charge 7"]
    assert traced.tree() == otel.dedent("""
        request 1
          · RunStarted ModelCallBegun ModelResponded
        request 2
          · CallApproved Resumed
          execute_tool charge call=call-charge outcome=executed
            · ToolStarted ToolCompleted
          statemachine.publish via=staged items=1 outcome=failed error=OSError
            · PublicationStaged PublicationFailed
        request 3
          execute_tool charge call=call-charge outcome=resent
          statemachine.publish via=reconcile outcome=committed
            · ReconciledAppend PublicationCommitted""")
    traced.assert_conventions()
    assert len(traced.walk()) == len(RunController.load(store, lg.RUN).events)
    traced.assert_no_payloads("charge me 7", "charged 7", "amount")


def test_langgraph_a_rejection_says_rejected_before_and_after_its_publication(
        tmp_path: Path, traced: Traced) -> None:
    """charge (c1) approved, notify (n1) rejected; the next batch (n2) publishes their
    results. The tool node of the first batch run again (time travel by hand, as in
    tests/adapters/test_langgraph.py) answers both from the ledger: the charge's result
    is resent, and the rejection, published now, is still a rejection. Nothing runs."""
    path = tmp_path / "effects.txt"
    script = [*lg.TWO[:1], [("notify", {"to": "ann"}, "n2")], "done"]
    ledger = ToolLedger(SQLiteEventStore(tmp_path / "ledger.db"),
                        approvals=["charge", "notify"])
    graph = langgraph_driver.build("ledger", langgraph_driver.make_tools(path),
                                   langgraph_driver.ScriptedModel(script=script),
                                   InMemorySaver(), ledger=ledger, review=True)
    prints = lg._pending(graph.invoke({"messages": [HumanMessage("go")]}, lg.CONFIG))
    prints = lg._pending(graph.invoke(Command(resume={
        "c1": decision("approve", prints["c1"]),
        "n1": decision("reject", prints["n1"], message="not bob")}), lg.CONFIG))
    assert sorted(attributes(_ours(traced), "gen_ai.tool.call.id", OUTCOME)) == [
        ("c1", "executed"), ("n1", "rejected")]  # before its publication
    graph.invoke(Command(resume={"n2": decision("approve", prints["n2"])}), lg.CONFIG)
    assert ToolLedger(ledger.store).controller(lg.RUN).phase("n1") is Phase.PUBLISHED
    traced.clear()
    node = lg._graph_of(ledger.tool_node(langgraph_driver.make_tools(path)), InMemorySaver())
    node.invoke(lg._tools_state([("charge", {"amount": 7}, "c1"),
                                 ("notify", {"to": "bob"}, "n1")]), lg.CONFIG)
    assert langgraph_driver.effects(path) == ["charge 7", "notify ann"]
    assert sorted(attributes(_ours(traced), "gen_ai.tool.call.id", OUTCOME)) == [
        ("c1", "resent"), ("n1", "rejected")]  # after its publication


# -------------------------------------------------------------- Anthropic SDK


def test_anthropic_messages_a_retried_turn_is_one_tree_under_the_callers_span(
        tmp_path: Path, traced: Traced) -> None:
    """A ``messages.create`` loop (the caller runs the tools, so the SDK traces its
    requests and no tool): the model asks for charge, which runs; the request carrying
    its result fails (500) and the turn is retried, the result resent from the ledger;
    that request lands, which posts the result, and its reply is final, which completes
    the run. A failed request is no failed post: nothing says it did not reach the model.
    The Anthropic SDK has no approvals to record here (its decisions are the server's)."""
    effects = Effects(tmp_path, "p")
    model = FakeModel(fail=[False, True])  # the request carrying the result fails once
    tools = [sync_charge(effects)]
    with trace.get_tracer("tests.caller").start_as_current_span("turn"):
        ledger = MessageToolLedger.open("m", tools, store=SQLiteEventStore(tmp_path / "e.db"))
        _loop(model.client(), ledger, tools, [{"role": "user", "content": "pay 7"}])
    assert effects.lines() == ["p charge 7"]
    assert traced.tree() == otel.dedent("""
        turn
          · RunStarted ToolCallsReceived FinalOutputAccepted RunCompleted
          anthropic.messages.create
          execute_tool charge call=tu_1 outcome=executed
            · ToolStarted ToolCompleted
          anthropic.messages.create error=api_error
          execute_tool charge call=tu_1 outcome=resent
          anthropic.messages.create
          statemachine.publish call=tu_1 via=post items=1 outcome=committed
            · ResultPosted""")
    traced.assert_conventions()
    assert len(traced.walk()) == len(RunController.load(SQLiteEventStore(
        tmp_path / "e.db"), "m").events)
    traced.assert_no_payloads("pay 7", "charged 7")


def test_anthropic_managed_session_a_refused_post_is_one_tree_under_the_callers_span(
        tmp_path: Path, traced: Traced) -> None:
    """A managed session's tool runner (`LedgerSessionToolRunner`): the agent asks for
    charge, which runs inside the SDK's own ``anthropic.custom_tool_use charge`` span (an
    ``execute_tool`` operation: the ledger joins it, no second span); the post of its
    result is refused and the stream drops; after the reconnect the SDK dispatches the
    call again, the ledger answers it from the record (resent) and that post lands; the
    session ends, which completes the run. Each post is a publication of its own."""
    effects = Effects(tmp_path, "p")
    server = FakeSession([tool_use("tu_1", "charge", {"x": 7})],
                         faults=[PostFault("reject", then_drop_stream=True)])

    async def go() -> list[tuple[str, bool, list[str]]]:
        with trace.get_tracer("tests.caller").start_as_current_span("session"):
            runner = await LedgerSessionToolRunner.open(
                client_for(server), SESSION_ID, tools=[counted_charge(effects)],
                store=MemoryEventStore(), run_id="s", max_idle=None)
            return await drive(runner)

    assert [(call_id, posted) for call_id, posted, _ in asyncio.run(go())] == [
        ("tu_1", False), ("tu_1", True)]
    assert effects.lines() == ["p charge 7"]
    assert traced.tree() == otel.dedent("""
        session
          · RunStarted FinalOutputAccepted RunCompleted
          anthropic.sessions.events.stream error=connection_error
          anthropic.sessions.events.list
          anthropic.custom_tool_use charge call=tu_1 outcome=executed
            · ToolCallsReceived ToolStarted ToolCompleted
          anthropic.sessions.events.send error=invalid_request_error
          statemachine.publish call=tu_1 via=post items=1 outcome=failed error=ResultNotPosted
            · ResultPostFailed
          anthropic.sessions.events.stream
          anthropic.sessions.events.list
          anthropic.custom_tool_use charge call=tu_1 outcome=resent
          anthropic.sessions.events.send
          statemachine.publish call=tu_1 via=post items=1 outcome=committed
            · ResultPosted""")
    tools = [span for span in traced.spans
             if (span.attributes or {}).get("gen_ai.operation.name") == "execute_tool"]
    assert _sdks(tools)  # the SDK's, one per dispatch
    traced.assert_conventions()
    traced.walk()
    traced.assert_no_payloads("charged 7", '"x"')
