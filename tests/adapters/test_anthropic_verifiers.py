"""Settling doubt without a person through both runners of the Anthropic adapter (DESIGN
§7.3): `statemachine.tool_context()` inside every tool body `LedgerSessionToolRunner` and
`MessageToolLedger` run (a sync tool, which the session runner runs on a worker thread, an
async one, and a thread the body starts), and ``verifiers={tool: verify}`` on their
``open``: checked there, asked right after the claim about each call of its tool in doubt.
The kill -9 rows: `tests.adapters.verifying`."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

try:
    import anthropic  # noqa: F401
except ImportError:  # pragma: no cover - CI installs the extra
    if os.environ.get("CI"):
        raise
    pytest.skip("anthropic is not installed", allow_module_level=True)

from anthropic.lib.tools import beta_async_tool, beta_tool

from statemachine import (
    Completed,
    NotExecuted,
    SQLiteEventStore,
    ToolCall,
    ToolContext,
    Unknown,
    tool_context,
)
from statemachine.adapters.anthropic import (
    InvalidVerifier,
    LedgerSessionToolRunner,
    MessageToolLedger,
)
from tests.adapters.verifying import BOUNDARIES, kill_then_resume
from tests.drivers.anthropic_driver import SESSION_ID, FakeSession, client_for, tool_use


@pytest.mark.invariant("I11")
@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("boundary", BOUNDARIES)
@pytest.mark.parametrize(("runner", "call_id"), [("anthropic-session", "c1"),
                                                 ("anthropic-messages", "tu_1")])
def test_a_kill_around_the_charge_ends_with_one_charge_or_in_doubt(
        tmp_path: Path, runner: str, call_id: str, boundary: str, verify: bool) -> None:
    kill_then_resume(runner, tmp_path, boundary, verify, call_id)


def _bodies(seen: list[ToolContext]) -> dict[str, Any]:
    def sync_body() -> str:
        """Look."""
        seen.append(tool_context())
        return "ok"

    async def async_body() -> str:
        """Look."""
        seen.append(tool_context())
        return "ok"

    async def threaded_body() -> str:
        """Look."""
        return await asyncio.to_thread(sync_body)

    return {"sync": beta_tool(sync_body, name="t"),
            "async": beta_async_tool(async_body, name="t"),
            "thread": beta_async_tool(threaded_body, name="t")}


@pytest.mark.parametrize("kind", ["sync", "async", "thread"])
def test_tool_context_inside_the_session_runners_bodies(kind: str) -> None:
    seen: list[ToolContext] = []
    tool = _bodies(seen)[kind]
    server = FakeSession([tool_use("c1", "t", {})])

    async def go() -> LedgerSessionToolRunner:
        runner = await LedgerSessionToolRunner.open(client_for(server), SESSION_ID,
                                                    tools=[tool], max_idle=None)
        async for _ in runner:
            pass
        return runner

    c = asyncio.run(go()).controller
    (context,) = seen
    assert context == ToolContext(c.run_id, "c1", c.idempotency_key("c1"), 1)
    with pytest.raises(LookupError):
        tool_context()


REPLY = {"content": [{"type": "tool_use", "id": "c1", "name": "t", "input": {}}]}


@pytest.mark.parametrize("kind", ["sync", "async", "thread"])
def test_tool_context_inside_the_messages_ledgers_bodies(kind: str) -> None:
    seen: list[ToolContext] = []
    tool = _bodies(seen)[kind]
    ledger = MessageToolLedger.open("r", [tool])
    if kind == "sync":
        ledger.run_tools(REPLY)
    else:
        asyncio.run(ledger.arun_tools(REPLY))
    c = ledger.controller
    (context,) = seen
    assert context == ToolContext("r", "c1", c.idempotency_key("c1"), 1)
    with pytest.raises(LookupError):
        tool_context()


def _in_doubt(store: SQLiteEventStore) -> None:
    """The run ``r`` with call ``c1`` of ``t`` started and never ended (a process died)."""
    c = MessageToolLedger.open("r", store=store).controller
    c.receive_tool_calls([ToolCall("c1", "t", {})])
    c.begin_tool("c1")
    c.flush()


@pytest.mark.parametrize("answer", [NotExecuted(), Completed("paid, says the API"),
                                    Unknown()])
def test_the_messages_ledger_asks_its_verifier_at_open(tmp_path: Path, answer: Any) -> None:
    store = SQLiteEventStore(tmp_path / "events.db")
    _in_doubt(store)
    seen: list[ToolContext] = []
    asked: list[ToolContext] = []

    def verify(context: ToolContext) -> Any:
        asked.append(context)
        return answer

    tool = _bodies(seen)["sync"]
    ledger = MessageToolLedger.open("r", [tool], store=store, verifiers={"t": verify})
    key = ledger.controller.idempotency_key("c1")
    assert asked == [ToolContext("r", "c1", key, 1)]
    if isinstance(answer, Unknown):
        from statemachine import ToolInDoubt

        with pytest.raises(ToolInDoubt):
            ledger.run_tools(REPLY)
        assert seen == []
        return
    (block,) = ledger.run_tools(REPLY)["content"]  # type: ignore[index]
    if isinstance(answer, NotExecuted):  # it runs again, with the same key
        assert seen == [ToolContext("r", "c1", key, 2)]
        assert block["content"] == "ok"
    else:  # the verifier's output is the call's tool_result; the body never runs again
        assert seen == []
        assert block == {"type": "tool_result", "tool_use_id": "c1",
                         "content": "paid, says the API"}


def test_an_async_verifier_needs_open_async(tmp_path: Path) -> None:
    store = SQLiteEventStore(tmp_path / "events.db")
    _in_doubt(store)
    tool = _bodies([])["sync"]

    async def verify(context: ToolContext) -> Completed:
        return Completed("paid")

    before = len(store.load("r"))
    with pytest.raises(InvalidVerifier, match="open_async") as refused:
        MessageToolLedger.open("r", [tool], store=store, verifiers={"t": verify})
    assert refused.value.tool == "t"
    assert len(store.load("r")) == before  # refused before the claim
    ledger = asyncio.run(MessageToolLedger.open_async("r", [tool], store=store,
                                                      verifiers={"t": verify}))
    (block,) = ledger.run_tools(REPLY)["content"]  # type: ignore[index]
    assert block["content"] == "paid"


def _verify(context: ToolContext) -> Unknown:
    return Unknown()


@pytest.mark.parametrize(("verifiers", "tool", "idempotent"), [
    ({"ghost": _verify}, "ghost", ()), ({"t": None}, "t", ()), ({"t": _verify}, "t", ("t",))])
@pytest.mark.parametrize("runner", ["session", "messages", "messages-async"])
def test_a_verifier_it_cannot_use_is_refused_at_open(
        tmp_path: Path, runner: str, verifiers: dict[str, Any], tool: str,
        idempotent: tuple[str]) -> None:
    store = SQLiteEventStore(tmp_path / "events.db")
    tools = [_bodies([])["sync"]]

    def open_it() -> object:
        if runner == "session":
            return asyncio.run(LedgerSessionToolRunner.open(
                client_for(FakeSession([])), SESSION_ID, tools=tools, store=store,
                run_id="r", verifiers=verifiers, idempotent=idempotent))
        if runner == "messages":
            return MessageToolLedger.open("r", tools, store=store, verifiers=verifiers,
                                          idempotent=idempotent)
        return asyncio.run(MessageToolLedger.open_async("r", tools, store=store,
                                                        verifiers=verifiers,
                                                        idempotent=idempotent))

    with pytest.raises(InvalidVerifier) as refused:
        open_it()
    assert refused.value.tool == tool
    assert repr(tool) in str(refused.value)
    assert store.load("r") == []  # nothing was recorded
