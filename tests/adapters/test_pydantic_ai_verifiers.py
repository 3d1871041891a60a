"""Settling doubt without a person through the pydantic-ai adapter (DESIGN §7.3):
`statemachine.tool_context()` inside every tool body `LedgerRun` runs (a sync tool, which
pydantic-ai runs on a worker thread, an async one, and a thread the body starts), and
``LedgerRun.open(..., verifiers={tool: verify})``: checked at open, asked after the claim
about each call of its tool in doubt. The kill -9 rows: `tests.adapters.verifying`."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

try:
    import pydantic_ai  # noqa: F401
except ImportError:  # pragma: no cover - CI installs the extra
    if os.environ.get("CI"):
        raise
    pytest.skip("pydantic-ai is not installed", allow_module_level=True)

from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from statemachine import SQLiteEventStore, ToolContext, Unknown, tool_context
from statemachine.adapters.pydantic_ai import InvalidVerifier, LedgerRun
from tests.adapters.verifying import BOUNDARIES, kill_then_resume


@pytest.mark.invariant("I11")
@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("boundary", BOUNDARIES)
def test_a_kill_around_the_charge_ends_with_one_charge_or_in_doubt(
        tmp_path: Path, boundary: str, verify: bool) -> None:
    kill_then_resume("pydantic-ai", tmp_path, boundary, verify, "c1")


def _respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    if any(part.part_kind == "tool-return" for part in messages[-1].parts):
        return ModelResponse(parts=[TextPart("done")])
    return ModelResponse(parts=[ToolCallPart("t", {}, tool_call_id="c1")])


def _agent(body: Any) -> Agent[None, str]:
    agent: Agent[None, str] = Agent(FunctionModel(_respond))
    agent.tool_plain(name="t")(body)
    return agent


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

    async def go() -> LedgerRun:
        run = await LedgerRun.open(_agent(body), run_id="r")
        await run.run("go")
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
    ({"ghost": _verify}, "ghost", ()), ({"t": 42}, "t", ()), ({"t": _verify}, "t", ("t",))])
def test_a_verifier_it_cannot_use_is_refused_at_open(
        tmp_path: Path, verifiers: dict[str, Any], tool: str, idempotent: tuple[str]) -> None:
    store = SQLiteEventStore(tmp_path / "events.db")
    with pytest.raises(InvalidVerifier) as refused:
        asyncio.run(LedgerRun.open(_agent(lambda: "ok"), run_id="r", store=store,
                                   verifiers=verifiers, idempotent=idempotent))
    assert refused.value.tool == tool
    assert repr(tool) in str(refused.value)
    assert store.load("r") == []  # nothing was recorded


def test_a_verifier_of_a_tool_of_a_toolset_is_taken() -> None:
    from pydantic_ai.toolsets import FunctionToolset

    def pay() -> str:
        return "paid"

    agent: Agent[None, str] = Agent(FunctionModel(_respond),
                                    toolsets=[FunctionToolset([pay])])
    run = asyncio.run(LedgerRun.open(agent, run_id="r", verifiers={"pay": _verify}))
    assert run.controller.run_id == "r"
