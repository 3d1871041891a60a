"""Settling doubt without a person through the openai-agents adapter (DESIGN §7.3):
`statemachine.tool_context()` inside every tool body `AgentRun` runs (a sync function tool,
which the SDK runs on a worker thread, an async one, and a thread the body starts), and
``AgentRun.open(..., verifiers={tool: verify})``: checked at open, asked after the claim
about each call of its tool in doubt. The kill -9 rows: `tests.adapters.verifying`."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

try:
    import agents  # noqa: F401
except ImportError:  # pragma: no cover - CI installs the extra
    if os.environ.get("CI"):
        raise
    pytest.skip("openai-agents is not installed", allow_module_level=True)

from agents import Agent, RunConfig, SQLiteSession, function_tool, set_tracing_disabled
from agents.testing import ScriptedModel, assistant_message, function_call

from statemachine import SQLiteEventStore, ToolContext, Unknown, tool_context
from statemachine.adapters.openai_agents import AgentRun, InvalidVerifier
from tests.adapters.verifying import BOUNDARIES, kill_then_resume

set_tracing_disabled(True)
CONFIG = RunConfig(tracing_disabled=True)


@pytest.mark.invariant("I11")
@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("boundary", BOUNDARIES)
def test_a_kill_around_the_charge_ends_with_one_charge_or_in_doubt(
        tmp_path: Path, boundary: str, verify: bool) -> None:
    kill_then_resume("openai-agents", tmp_path, boundary, verify, "c1")


def _agent(body: Any, name: str = "t") -> Agent[Any]:
    model = ScriptedModel([[function_call(name, {}, call_id="c1")],
                           [assistant_message("done")]])
    return Agent("a", model=model, tools=[function_tool(body, name_override=name)])


@pytest.mark.parametrize("kind", ["sync", "async", "thread"])
def test_tool_context_inside_sync_async_and_threaded_bodies(kind: str) -> None:
    seen: list[ToolContext] = []

    def sync_body() -> str:
        seen.append(tool_context())
        return "ok"

    async def async_body() -> str:
        seen.append(tool_context())
        return "ok"

    async def threaded_body() -> str:
        return await asyncio.to_thread(sync_body)

    body = {"sync": sync_body, "async": async_body, "thread": threaded_body}[kind]

    async def go() -> AgentRun:
        run = await AgentRun.open(_agent(body), run_id="r", session=SQLiteSession("s"))
        await run.run("go", run_config=CONFIG)
        return run

    run = asyncio.run(go())
    (context,) = seen
    c = run.controller
    assert context == ToolContext("r", "c1", c.idempotency_key("c1"), 1)
    with pytest.raises(LookupError):
        tool_context()


def _verify(context: ToolContext) -> Unknown:
    return Unknown()


@pytest.mark.parametrize(("verifiers", "tool", "idempotent"), [
    ({"ghost": _verify}, "ghost", ()), ({"t": "not callable"}, "t", ()),
    ({"t": _verify}, "t", ("t",))])
def test_a_verifier_it_cannot_use_is_refused_at_open(
        tmp_path: Path, verifiers: dict[str, Any], tool: str, idempotent: tuple[str]) -> None:
    store = SQLiteEventStore(tmp_path / "events.db")
    with pytest.raises(InvalidVerifier) as refused:
        asyncio.run(AgentRun.open(_agent(lambda: "ok"), run_id="r", store=store,
                                  session=SQLiteSession("s"), verifiers=verifiers,
                                  idempotent=idempotent))
    assert refused.value.tool == tool
    assert repr(tool) in str(refused.value)
    assert store.load("r") == []  # nothing was recorded


def test_a_verifier_of_a_tool_a_handoff_reaches_is_taken() -> None:
    def pay() -> str:
        return "paid"

    helper = Agent("helper", tools=[function_tool(pay)])
    agent = Agent("a", model=ScriptedModel([]), handoffs=[helper])
    run = asyncio.run(AgentRun.open(agent, run_id="r", session=SQLiteSession("s"),
                                    verifiers={"pay": _verify}))
    assert run.controller.run_id == "r"
