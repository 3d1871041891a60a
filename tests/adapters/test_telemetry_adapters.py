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

from langchain_core.messages import HumanMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.types import Command
from opentelemetry import trace
from pydantic_ai import Agent
from pydantic_ai.capabilities.instrumentation import Instrumentation
from pydantic_ai.models.instrumented import InstrumentationSettings

from statemachine import (
    MemoryEventStore,
    Phase,
    Resolution,
    SQLiteEventStore,
    ToolInDoubt,
    operator,
)
from statemachine.adapters.anthropic import MessageToolLedger
from statemachine.adapters.langgraph import ToolLedger, decision
from statemachine.adapters.pydantic_ai import LedgerRun
from statemachine.sessions import MemorySession
from statemachine.telemetry import SCOPE
from tests import otel
from tests.adapters import test_google_adk as adk
from tests.adapters import test_langgraph as lg
from tests.adapters.test_anthropic import FakeModel, _loop, sync_charge
from tests.adapters.test_pydantic_ai import call, scripted
from tests.drivers import adk_driver, langgraph_driver
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


def test_anthropic_a_retried_turn_is_resent_under_the_callers_span(
        tmp_path: Path, traced: Traced) -> None:
    effects = Effects(tmp_path, "p")
    model = FakeModel(fail=[False, True])  # the request carrying the result fails once
    tools = [sync_charge(effects)]
    ledger = MessageToolLedger.open("m", tools, store=SQLiteEventStore(tmp_path / "e.db"))
    with trace.get_tracer("tests.caller").start_as_current_span("turn"):
        _loop(model.client(), ledger, tools, [{"role": "user", "content": "pay 7"}])
    assert effects.lines() == ["p charge 7"]
    assert attributes(_ours(traced), "gen_ai.tool.call.id", OUTCOME) == [
        ("tu_1", "executed"), ("tu_1", "resent")]
    assert all(traced.ancestors(span) == ["turn"] for span in _ours(traced))
    traced.assert_no_payloads("pay 7", "charged 7")
