"""MCP tools through the openai-agents adapter's ledger (DESIGN §7.4 "MCP"), against a
real MCP server (the `mcp` package, streamable HTTP on loopback) that counts in an
fsynced file every ``tools/call`` it received.

What should happen comes from the script and the faults, not from the log: a call the
model asked for once is received by the server at most once, unless its tool is
idempotent (named in ``idempotent=``, or hinted by a server the user trusts); a
``tools/call`` whose response was lost after the server received it leaves the run in
doubt (`ToolInDoubt`) until an operator or the tool's verifier settles it.

Under CI a missing ``agents`` package fails this module instead of skipping it.
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

try:
    import agents  # noqa: F401
except ImportError:  # pragma: no cover - CI installs the extra
    if os.environ.get("CI"):
        raise
    pytest.skip("openai-agents is not installed", allow_module_level=True)

from agents import Agent, RunConfig, Runner, SQLiteSession, set_tracing_disabled
from agents.mcp import MCPServerStreamableHttp
from agents.testing import ScriptedModel, assistant_message, function_call

from statemachine import MemoryEventStore, Phase, RunController, Step, ToolInDoubt
from statemachine.adapters._mcp import IDEMPOTENCY_KEY
from statemachine.adapters.openai_agents import AgentRun, UnsupportedFeature
from statemachine.stores import SQLiteEventStore
from statemachine.verifiers import Completed, NotExecuted, ToolContext
from tests.adapters.mcp_world import Server

set_tracing_disabled(True)
CONFIG = RunConfig(tracing_disabled=True)
RUN = "mcp-run"
SESSION = "mcp-session"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    world = Server(tmp_path)
    yield world
    world.stop()


def _client(server: Server, **options: Any) -> MCPServerStreamableHttp:
    return MCPServerStreamableHttp(params={"url": server.url}, name="payments",
                                   cache_tools_list=False, **options)


def _agent(client: Any, *responses: Any, asked: list[str]) -> Agent[Any]:
    class Counted(ScriptedModel):
        async def get_response(self, *args: Any, **kwargs: Any) -> Any:
            asked.append("model")
            return await super().get_response(*args, **kwargs)

    return Agent("payer", model=Counted(list(responses)), mcp_servers=[client])


def _calls(tool: str, **arguments: Any) -> list[Any]:
    return [function_call(tool, arguments, call_id="m1")]


async def _open(agent: Agent[Any], tmp_path: Path, **options: Any) -> AgentRun:
    return await AgentRun.open(agent, run_id=RUN, store=SQLiteEventStore(tmp_path / "ev.db"),
                               session=SQLiteSession(SESSION, str(tmp_path / "s.db")),
                               **options)


def _outputs(items: list[Any]) -> dict[str, Any]:
    return {i["call_id"]: i["output"] for i in items if i.get("type") == "function_call_output"}


def test_a_tools_call_goes_through_the_ledger_once_with_its_key_in_meta(
        tmp_path: Path, server: Server) -> None:
    """The SDK alone and the adapter each send ``charge`` once and show the model the same
    output; through the adapter the call is a ledger call (started once, published) and
    the request's ``_meta`` carries the call's idempotency key."""
    server.start()

    async def go() -> None:
        asked: list[str] = []
        async with _client(server) as client:
            alone = _agent(client, _calls("charge", amount=5), [assistant_message("done")],
                           asked=asked)
            session = SQLiteSession("alone", ":memory:")
            result = await Runner.run(alone, "pay", session=session, run_config=CONFIG)
            assert result.final_output == "done"
            sdk_outputs = _outputs(await session.get_items())
            assert [c["key"] for c in server.calls()] == [None]

            agent = _agent(client, _calls("charge", amount=5), [assistant_message("done")],
                           asked=asked)
            run = await _open(agent, tmp_path)
            done = await run.run("pay", run_config=CONFIG)
        assert (done.step, done.final_output) == (Step.COMPLETED, "done")
        assert _outputs(await run.session.get_items()) == sdk_outputs
        ledger = RunController.load(SQLiteEventStore(tmp_path / "ev.db"), RUN)
        assert [(v.call.name, v.phase, v.starts) for v in ledger.calls] == [
            ("charge", Phase.PUBLISHED, 1)]
        assert server.calls()[1] == {"tool": "charge", "arguments": {"amount": 5},
                                     "key": ledger.idempotency_key("m1"), "tenant": None}
        assert server.counted() == Counter({"charge": 2})  # once alone, once adapted

    asyncio.run(go())


def test_a_key_a_meta_resolver_set_is_replaced_by_the_calls_own(tmp_path: Path,
                                                                 server: Server) -> None:
    """The server's ``tool_meta_resolver`` puts a key of its own under the ledger's
    ``_meta`` name (a stale key copied from an earlier request, say): the request carries
    the call's idempotency key, never that one, or a server deduplicating by it would
    take the call for another (or another call for this one); the resolver's other
    ``_meta`` entries are sent as they were."""
    server.start()

    def stale(context: Any) -> dict[str, Any]:
        return {IDEMPOTENCY_KEY: "a key from another call", "tenant": "t1"}

    async def go() -> None:
        asked: list[str] = []
        async with _client(server, tool_meta_resolver=stale) as client:
            agent = _agent(client, _calls("charge", amount=5), [assistant_message("done")],
                           asked=asked)
            run = await _open(agent, tmp_path)
            done = await run.run("pay", run_config=CONFIG)
        assert done.step is Step.COMPLETED
        ledger = RunController.load(SQLiteEventStore(tmp_path / "ev.db"), RUN)
        assert [c["key"] for c in server.calls()] == [ledger.idempotency_key("m1")]
        assert [c["tenant"] for c in server.calls()] == ["t1"]

    asyncio.run(go())


async def _cut_then_resume(tmp_path: Path, server: Server, tool: str, *,
                           arguments: dict[str, Any], trusted: tuple[str, ...] = (),
                           verifiers: dict[str, Any] | None = None) -> tuple[Any, list[str]]:
    """The server dies after receiving the call and before answering; then a new
    ``AgentRun`` from the store (another process's view) resumes on a server started
    again. Returns what the resume returned (or raised) and the model calls."""
    server.start(tool)
    asked: list[str] = []
    async with _client(server) as client:
        agent = _agent(client, _calls(tool, **arguments), [assistant_message("done")],
                       asked=asked)
        run = await _open(agent, tmp_path, trusted_mcp_servers=trusted)
        try:
            await run.run("go", run_config=CONFIG)
        except Exception as error:  # the attempt ends: the call has no answer
            first: Exception = error
        else:  # pragma: no cover - the assertion below says what happened
            raise AssertionError("the attempt whose response was lost completed")
    # in doubt, or (an idempotent call) the transport's failure: sent again next attempt
    assert isinstance(first, ToolInDoubt) is (not trusted), first  # (trusted: a tuple)
    assert server.counted() == Counter({tool: 1})  # received once, never answered
    server.start()
    async with _client(server) as client:
        agent = _agent(client, [assistant_message("done")], asked=asked)
        run = await _open(agent, tmp_path, trusted_mcp_servers=trusted,
                          verifiers=verifiers)  # by the MCP tool's name
        try:
            return await run.run(run_config=CONFIG), asked
        except ToolInDoubt as refused:
            return refused, asked


def test_a_response_lost_after_sending_leaves_the_call_in_doubt_never_sent_again(
        tmp_path: Path, server: Server) -> None:
    async def go() -> None:
        outcome, asked = await _cut_then_resume(tmp_path, server, "charge",
                                                arguments={"amount": 5})
        assert isinstance(outcome, ToolInDoubt)
        assert outcome.call_id == "m1"
        assert asked == ["model"]  # the resume asked no model
        assert server.counted() == Counter({"charge": 1})  # never sent again
        ledger = RunController.load(SQLiteEventStore(tmp_path / "ev.db"), RUN)
        assert ledger.in_doubt() == ("m1",)

    asyncio.run(go())


@pytest.mark.parametrize("answer", ["completed", "not-executed"])
def test_a_call_in_doubt_is_settled_by_its_tools_verifier(tmp_path: Path, server: Server,
                                                          answer: str) -> None:
    """The verifier asks the server's record by the call's key: it finds the charge
    (``Completed``: the model sees its output, the charge is not sent again) or, told it
    did not happen, the call is sent again with the same key."""
    seen: list[ToolContext] = []

    def verify(context: ToolContext) -> Any:
        seen.append(context)
        if answer == "not-executed":
            return NotExecuted()
        found = [c for c in server.calls() if c["key"] == context.idempotency_key]
        return Completed("charged 5") if found else NotExecuted()

    async def go() -> None:
        outcome, asked = await _cut_then_resume(tmp_path, server, "charge",
                                                arguments={"amount": 5},
                                                verifiers={"charge": verify})
        assert outcome.step is Step.COMPLETED, outcome
        assert outcome.final_output == "done"
        assert asked == ["model", "model"]  # the turn replayed, then the final answer
        ledger = RunController.load(SQLiteEventStore(tmp_path / "ev.db"), RUN)
        key = ledger.idempotency_key("m1")
        assert [c.idempotency_key for c in seen] == [key]
        sent = [c["key"] for c in server.calls()]
        assert sent == ([key] if answer == "completed" else [key, key])
        outputs = _outputs(await SQLiteSession(SESSION, str(tmp_path / "s.db")).get_items())
        assert "charged 5" in str(outputs["m1"])

    asyncio.run(go())


@pytest.mark.parametrize("trusted", [True, False])
@pytest.mark.parametrize("tool", ["balance", "refund"])
def test_a_trusted_servers_hinted_tool_is_sent_again_an_untrusted_ones_is_in_doubt(
        tmp_path: Path, server: Server, tool: str, trusted: bool) -> None:
    """``balance`` is hinted read-only, ``refund`` idempotent: a lost response re-sends
    the call on the next attempt only when the server is trusted; the same hints from an
    untrusted server leave the call in doubt."""
    arguments = {} if tool == "balance" else {"amount": 2}

    async def go() -> None:
        outcome, _ = await _cut_then_resume(tmp_path, server, tool, arguments=arguments,
                                            trusted=("payments",) if trusted else ())
        if trusted:
            assert outcome.step is Step.COMPLETED, outcome
            assert server.counted() == Counter({tool: 2})
        else:
            assert isinstance(outcome, ToolInDoubt)
            assert server.counted() == Counter({tool: 1})

    asyncio.run(go())


def test_a_server_configured_to_retry_is_refused_at_open(tmp_path: Path,
                                                         server: Server) -> None:
    """``max_retry_attempts`` would send a ``tools/call`` again after its response was
    lost: refused when the run is opened, before anything is recorded or sent."""
    server.start()

    async def go() -> None:
        store = MemoryEventStore()
        async with _client(server, max_retry_attempts=2) as client:
            agent = _agent(client, [assistant_message("done")], asked=[])
            with pytest.raises(UnsupportedFeature, match="payments") as refused:
                await AgentRun.open(agent, run_id=RUN, store=store,
                                    session=SQLiteSession(SESSION, ":memory:"))
        assert refused.value.feature == "MCP servers that retry"
        assert not store.list_runs()
        assert server.calls() == []

    asyncio.run(go())


def test_a_trusted_name_no_agent_has_is_refused(tmp_path: Path, server: Server) -> None:
    server.start()

    async def go() -> None:
        async with _client(server) as client:
            agent = _agent(client, [assistant_message("done")], asked=[])
            with pytest.raises(UnsupportedFeature, match="paymints"):
                await AgentRun.open(agent, run_id=RUN, store=MemoryEventStore(),
                                    session=SQLiteSession(SESSION, ":memory:"),
                                    trusted_mcp_servers=["paymints"])

    asyncio.run(go())


@pytest.mark.parametrize(("options", "feature"), [
    ({"max_retry_attempts": 2}, "MCP servers that retry"),
    ({"require_approval": "always"}, "agent tools whose agent needs approvals"),
    ({"require_approval": {"always": {"tool_names": ["charge"]}}},
     "agent tools whose agent needs approvals"),
], ids=["retries", "approval-always", "approval-for-one-tool"])
def test_an_agent_used_as_a_tool_is_refused_for_its_mcp_server_too(
        tmp_path: Path, server: Server, options: dict[str, Any], feature: str) -> None:
    """An agent used as a tool (``as_tool``) runs inside its call's body: an MCP server
    of that agent that retries would send its ``tools/call`` twice inside the one body,
    and one whose tools need approval would pause the outer run on a call the ledger
    does not know. Refused when the run opens, as for the run's own agents, nothing
    recorded or sent. Before, the nested agent's servers were not looked at: the
    retrying one was sent the charge twice."""
    server.start()

    async def go() -> None:
        store = MemoryEventStore()
        async with _client(server, **options) as client:
            helper = _agent(client, [assistant_message("done")], asked=[])
            outer = Agent("outer", model=ScriptedModel([[assistant_message("done")]]),
                          tools=[helper.as_tool("ask_helper", "the helper pays")])
            with pytest.raises(UnsupportedFeature, match="payments") as refused:
                await AgentRun.open(outer, run_id=RUN, store=store,
                                    session=SQLiteSession(SESSION, ":memory:"))
        assert refused.value.feature == feature
        assert not store.list_runs()
        assert server.calls() == []

    asyncio.run(go())
