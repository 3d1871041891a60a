"""The Anthropic SDK adapter (statemachine.adapters.anthropic), offline: every request goes
through the SDK's own HTTP layer into a local ``httpx2.MockTransport`` (the SDK's HTTP
client is ``httpx2``); nothing touches the network.

Expected outcomes come from the scenario, not from the ledger: a tool's body appends one
line per run to a file (O_APPEND + fsync) and returns text naming how many times it has
run, so a recomputed result differs from the first one wherever it lands (the remote
history, the next request).

* managed sessions: the differential (the SDK's runner alone runs a tool again after a
  failed post and a reconnect; through the adapter it runs once and the cached result is
  re-posted), the post-fault matrix, a call in doubt, and kill -9 between the tool and its
  post, or inside the tool, with a restart in a new process on a SQLite store;
* messages: a retried turn of a ``messages.create`` loop and of the SDK's
  ``beta.messages.tool_runner`` never re-runs a finished tool; a history holding a
  ``tool_use`` without its ``tool_result`` is refused before anything is sent.

Under CI a missing ``anthropic`` package fails this module instead of skipping it.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

try:
    import anthropic  # noqa: F401
except ImportError:  # pragma: no cover - CI installs the extra
    from tests.helpers import missing_extra

    missing_extra("anthropic")

import httpx2
import pydantic
from anthropic import Anthropic, AsyncAnthropic, InternalServerError
from anthropic.lib.environments import SessionToolRunner
from anthropic.lib.tools import beta_async_tool, beta_tool

from statemachine import (
    ConcurrencyConflict,
    InvalidTransition,
    MemoryEventStore,
    Phase,
    RunController,
    RunNotResumable,
    SchemaError,
    SQLiteEventStore,
    Step,
    ToolCall,
    ToolInDoubt,
)
from statemachine.adapters.anthropic import (
    LedgerSessionToolRunner,
    MessageToolLedger,
    StaleHistory,
    UnansweredToolUse,
    UnsupportedFeature,
)
from statemachine.cli.describe import verdict
from statemachine.cli.main import main as cli_main
from statemachine.stores import AsyncSQLiteEventStore
from tests.adapters.dying import Crash
from tests.drivers.anthropic_driver import (
    SESSION_ID,
    FakeSession,
    PostFault,
    client_for,
    fork,
    tool_use,
)
from tests.drivers.effects import Effects

ROOT = Path(__file__).resolve().parents[2]


def counted_charge(effects: Effects) -> Any:
    """``charge(x)``: one line per run in the effects file; its result names the run."""

    @beta_async_tool
    async def charge(x: int) -> str:
        """Charge the customer x dollars."""
        effects(f"charge {x}")
        return f"charged {x} (run {len(effects.lines())})"

    return charge


def texts(event: dict[str, Any]) -> list[str]:
    return [block["text"] for block in event["content"]]


async def drive(runner: SessionToolRunner) -> list[tuple[str, bool, list[str]]]:
    return [(call.tool_use_id, call.posted, texts(dict(call.result or {"content": []})))
            async for call in runner]


# --------------------------------------------------------------- managed sessions


@pytest.mark.invariant("I1", "I12")
@pytest.mark.parametrize("through", ["sdk-alone", "adapter"])
def test_differential_failed_post_then_reconnect(tmp_path: Path, through: str) -> None:
    """The seed's scenario: the first post of the result is rejected, then the stream
    drops; the history pass after the reconnect dispatches the call again."""
    effects = Effects(tmp_path, "p")
    server = FakeSession([tool_use("tu_1", "charge", {"x": 7})],
                         faults=[PostFault("reject", then_drop_stream=True)])
    tools = [counted_charge(effects)]

    async def go() -> list[tuple[str, bool, list[str]]]:
        if through == "sdk-alone":
            return await drive(SessionToolRunner(client_for(server), SESSION_ID, tools=tools,
                                                 max_idle=None))
        runner = await LedgerSessionToolRunner.open(client_for(server), SESSION_ID,
                                                    tools=tools, max_idle=None)
        return await drive(runner)

    seen = asyncio.run(go())
    assert server.stream_opens == 2  # the reconnect happened in both worlds
    [landed] = server.results("tu_1")
    if through == "sdk-alone":
        # what anthropic 2.10 does: the tool ran again, and the remote holds run 2
        assert effects.lines() == ["p charge 7", "p charge 7"]
        assert texts(landed) == ["charged 7 (run 2)"]
    else:
        assert effects.lines() == ["p charge 7"]
        assert texts(landed) == ["charged 7 (run 1)"]  # the cached result, re-posted
        assert seen == [("tu_1", False, ["charged 7 (run 1)"]),
                        ("tu_1", True, ["charged 7 (run 1)"])]
    assert [post["custom_tool_use_id"] for post in server.posts] == ["tu_1", "tu_1"]


FAULTS = {
    "rejected-then-reconnect": [PostFault("reject", then_drop_stream=True)],
    "connection-drop-then-retry": [PostFault("drop")],
    "landed-then-500": [PostFault("land-then-500")],
    "landed-then-500-then-reconnect": [PostFault("land-then-500", then_drop_stream=True)],
    "rejected-twice": [PostFault("reject", then_drop_stream=True),
                       PostFault("reject", then_drop_stream=True)],
}


@pytest.mark.invariant("I1", "I12")
@pytest.mark.parametrize("buffered", [False, True], ids=["per-event", "buffered"])
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_post_faults_run_the_tool_once_and_land_one_result(tmp_path: Path, fault: str,
                                                           buffered: bool) -> None:
    effects = Effects(tmp_path, "p")
    store = MemoryEventStore()
    server = FakeSession([tool_use("tu_1", "charge", {"x": 7}),
                          tool_use("tu_2", "charge", {"x": 8})], faults=FAULTS[fault])

    async def go() -> None:
        runner = await LedgerSessionToolRunner.open(client_for(server), SESSION_ID,
                                                    tools=[counted_charge(effects)],
                                                    store=store, run_id="r", max_idle=None,
                                                    buffered=buffered)
        await drive(runner)

    asyncio.run(go())
    # each call ran exactly once, and the remote holds exactly one result of each: the
    # one computed by its only run
    assert sorted(effects.lines()) == ["p charge 7", "p charge 8"]
    runs = {line.split()[-1]: n + 1 for n, line in enumerate(effects.lines())}
    for call_id, x in (("tu_1", "7"), ("tu_2", "8")):
        [landed] = server.results(call_id)
        assert texts(landed) == [f"charged {x} (run {runs[x]})"]
    reloaded = RunController.load(store, "r")
    assert {call.call.call_id: call.phase for call in reloaded.calls} == {
        "tu_1": Phase.PUBLISHED, "tu_2": Phase.PUBLISHED}


@pytest.mark.invariant("I1", "I12")
def test_an_async_store_keeps_the_ledger_across_runners(tmp_path: Path) -> None:
    """On an async store (always buffered): the first runner's post is rejected and the
    session stops before a reconnect; a second runner, loaded from the store, re-posts the
    cached result and runs nothing."""
    effects = Effects(tmp_path, "p")
    server = FakeSession([tool_use("tu_1", "charge", {"x": 7})],
                         faults=[PostFault("reject", then_drop_stream=True)])

    async def go(max_reconnects: int) -> list[tuple[str, bool, list[str]]]:
        store = AsyncSQLiteEventStore(tmp_path / "events.db")
        runner = await LedgerSessionToolRunner.open(client_for(server), SESSION_ID,
                                                    tools=[counted_charge(effects)],
                                                    store=store, run_id="r", max_idle=None)
        seen = []
        async with contextlib.aclosing(runner.__aiter__()) as calls:
            async for call in calls:
                seen.append((call.tool_use_id, call.posted,
                             texts(dict(call.result or {"content": []}))))
                if len(seen) >= max_reconnects:
                    break  # the consumer stops: no reconnect in this runner
        await store.close()
        return seen

    assert asyncio.run(go(1)) == [("tu_1", False, ["charged 7 (run 1)"])]
    assert asyncio.run(go(1)) == [("tu_1", True, ["charged 7 (run 1)"])]
    assert effects.lines() == ["p charge 7"]
    assert [texts(e) for e in server.results("tu_1")] == [["charged 7 (run 1)"]]


@pytest.mark.invariant("I11")
def test_a_call_in_doubt_fails_closed_before_anything_is_sent(tmp_path: Path) -> None:
    """A process started the tool and died: the restarted runner raises `ToolInDoubt`
    (itself, not inside an exception group) before it opens the stream or posts."""
    store = MemoryEventStore()
    earlier = RunController.start(run_id="r", session_id=None, store=store)
    earlier.receive_tool_calls([ToolCall("tu_1", "charge", {"x": 7})])
    earlier.begin_tool("tu_1")  # ... and the process died inside the tool
    effects = Effects(tmp_path, "p")
    server = FakeSession([tool_use("tu_1", "charge", {"x": 7})])

    async def go() -> None:
        runner = await LedgerSessionToolRunner.open(client_for(server), SESSION_ID,
                                                    tools=[counted_charge(effects)],
                                                    store=store, run_id="r", max_idle=None)
        await drive(runner)

    with pytest.raises(ToolInDoubt):
        asyncio.run(go())
    assert effects.lines() == []
    assert server.posts == []
    assert server.stream_opens == 0
    # the operator records the outcome; the next runner posts it and runs nothing
    RunController.load(store, "r").resolve_in_doubt("tu_1", {
        "type": "user.custom_tool_result", "custom_tool_use_id": "tu_1", "is_error": False,
        "content": [{"type": "text", "text": "charged 7 (by hand)"}]})
    asyncio.run(go())
    assert effects.lines() == []
    assert [texts(e) for e in server.results("tu_1")] == [["charged 7 (by hand)"]]


@pytest.mark.invariant("I11")
def test_a_tool_interrupted_by_a_base_exception_is_left_in_doubt(tmp_path: Path) -> None:
    store = MemoryEventStore()
    effects = Effects(tmp_path, "p")

    class Killed(BaseException):
        pass

    @beta_async_tool
    async def charge(x: int) -> str:
        """Charge."""
        effects(f"charge {x}")
        raise Killed

    server = FakeSession([tool_use("tu_1", "charge", {"x": 7})])

    async def go(tools: list[Any]) -> None:
        runner = await LedgerSessionToolRunner.open(client_for(server), SESSION_ID,
                                                    tools=tools, store=store, run_id="r",
                                                    max_idle=None)
        await drive(runner)

    with pytest.raises((Killed, BaseExceptionGroup)) as raised:
        asyncio.run(go([charge]))
    if isinstance(raised.value, BaseExceptionGroup):
        assert raised.group_contains(Killed)
    with pytest.raises(ToolInDoubt):
        asyncio.run(go([counted_charge(effects)]))
    assert effects.lines() == ["p charge 7"]
    assert server.posts == []


@pytest.mark.parametrize("through", ["sdk-alone", "adapter"])
def test_a_tool_the_runner_timed_out_is_in_doubt_never_answered(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, through: str) -> None:
    """The session runner bounds each tool by ``TOOL_TIMEOUT`` and posts "timed out" for a
    body it cancelled; the SDK alone then goes on as if the call had an answer, though
    its effect may have happened. Through the ledger a body that ended with no answer is
    in doubt: nothing is posted, the restarted runner raises `ToolInDoubt` and never runs
    the tool again (the rule of all three adapters: only a body's own exception is an
    answer)."""
    import anthropic.lib.tools._beta_session_runner as sdk_runner

    monkeypatch.setattr(sdk_runner, "TOOL_TIMEOUT", 0.05)
    store = MemoryEventStore()
    effects = Effects(tmp_path, "p")

    @beta_async_tool
    async def charge(x: int) -> str:
        """Charge."""
        effects(f"charge {x}")
        await asyncio.sleep(30)  # the payment provider answers too late
        return f"charged {x}"

    server = FakeSession([tool_use("tu_1", "charge", {"x": 7})])

    async def go(tools: list[Any]) -> None:
        if through == "sdk-alone":
            runner: Any = SessionToolRunner(client_for(server), SESSION_ID, tools=tools,
                                            max_idle=None)
        else:
            runner = await LedgerSessionToolRunner.open(client_for(server), SESSION_ID,
                                                        tools=tools, store=store,
                                                        run_id="r", max_idle=None)
        await drive(runner)

    if through == "sdk-alone":
        asyncio.run(go([charge]))
        assert [texts(e) for e in server.results("tu_1")] == [["tool 'charge' timed out"]]
        return
    with pytest.raises((ToolInDoubt, BaseExceptionGroup)) as raised:
        asyncio.run(go([charge]))
    if isinstance(raised.value, BaseExceptionGroup):
        assert raised.group_contains(ToolInDoubt)
    assert server.posts == []
    with pytest.raises(ToolInDoubt):
        asyncio.run(go([counted_charge(effects)]))
    assert effects.lines() == ["p charge 7"]
    assert server.posts == []
    assert RunController.load(store, "r").in_doubt() == ("tu_1",)


# ---------------------------------------------------------------------- processes


def _driver(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tests.drivers.anthropic_driver", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.invariant("I1", "I12")
@pytest.mark.parametrize("through", ["sdk-alone", "adapter", "adapter-buffered"])
def test_kill_9_between_the_tool_and_its_post_then_restart(tmp_path: Path,
                                                           through: str) -> None:
    prefix = "sdk-" if through == "sdk-alone" else ""
    extra = ["buffered"] if through == "adapter-buffered" else []
    # (each process forked from this one: the kill and the restart are real, without an
    # interpreter start-up each; the next test runs the driver as its own program)
    assert fork(f"{prefix}crash-post", str(tmp_path), "first", *extra) is None  # killed
    assert Effects(tmp_path, "").lines() == ["first charge 7"]
    if through != "sdk-alone":  # the result was durable before its post: completed
        store = SQLiteEventStore(tmp_path / "events.db")
        left = RunController.load(store, f"anthropic-session:{SESSION_ID}")
        store.close()
        assert (left.phase("tu_1"), left.in_doubt()) == (Phase.COMPLETED, ())
    assert fork(f"{prefix}resume", str(tmp_path), "second", *extra) == {
        "name": "second", "outcome": "done", "error": None, "posted": [True]}
    remote = json.loads((tmp_path / "remote.json").read_text())["events"]
    [landed] = [e for e in remote if e.get("custom_tool_use_id") == "tu_1"]
    if through == "sdk-alone":
        assert Effects(tmp_path, "").lines() == ["first charge 7", "second charge 7"]
    else:
        assert Effects(tmp_path, "").lines() == ["first charge 7"]  # re-posted, not re-run
        assert texts(landed) == ["charged 7"]


@pytest.mark.invariant("I11")
def test_kill_9_inside_the_tool_then_restart_is_in_doubt(tmp_path: Path) -> None:
    crashed = _driver("crash-tool", str(tmp_path), "first")
    assert crashed.returncode == -9, crashed.stderr
    resumed = _driver("resume", str(tmp_path), "second")
    assert json.loads(resumed.stdout) == {"name": "second", "outcome": "error",
                                          "error": "ToolInDoubt", "posted": []}
    assert Effects(tmp_path, "").lines() == ["first charge 7"]
    remote = json.loads((tmp_path / "remote.json").read_text())["events"]
    assert [e["type"] for e in remote] == ["agent.custom_tool_use"]  # nothing was posted


# ----------------------------------------------------------------------- messages


class FakeModel:
    """``POST /v1/messages``: asks for ``charge(x=7)`` (id ``tu_1``) until the last user
    message carries a tool_result, then answers with the text of that result. ``fail``
    lists, per request, whether to answer 500."""

    def __init__(self, fail: list[bool] | None = None) -> None:
        self.fail = list(fail or [])
        self.requests: list[list[dict[str, Any]]] = []

    def handle(self, request: httpx2.Request) -> httpx2.Response:
        messages = json.loads(request.content)["messages"]
        self.requests.append(messages)
        if self.fail and self.fail.pop(0):
            return httpx2.Response(500, json={"type": "error", "error": {
                "type": "api_error", "message": "injected"}})
        last = messages[-1]["content"]
        results = [b for b in last if b.get("type") == "tool_result"] if isinstance(
            last, list) else []
        if results:
            content: list[dict[str, Any]] = [{"type": "text", "text": str(results[0][
                "content"])}]
        else:
            content = [{"type": "tool_use", "id": "tu_1", "name": "charge",
                        "input": {"x": 7}}]
        return httpx2.Response(200, json={
            "id": f"msg_{len(self.requests)}", "type": "message", "role": "assistant",
            "model": "claude-test", "content": content,
            "stop_reason": "end_turn" if results else "tool_use", "stop_sequence": None,
            "usage": {"input_tokens": 1, "output_tokens": 1}})

    def client(self) -> Anthropic:
        return Anthropic(api_key="test-key", max_retries=0, http_client=httpx2.Client(
            transport=httpx2.MockTransport(self.handle)))


def sync_charge(effects: Effects) -> Any:
    @beta_tool
    def charge(x: int) -> str:
        """Charge the customer x dollars."""
        effects(f"charge {x}")
        return f"charged {x} (run {len(effects.lines())})"

    return charge


def _loop(client: Anthropic, ledger: MessageToolLedger | None, tools: list[Any],
          messages: list[Any]) -> Any:
    """A plain messages loop; a failed request is retried by redoing the whole turn (its
    tools included), as a caller without a ledger would."""
    params: dict[str, Any] = {"model": "claude-test", "max_tokens": 64,
                              "tools": [tool.to_dict() for tool in tools]}
    reply = client.messages.create(messages=messages, **params) if ledger is None else \
        ledger.create(client.messages, messages=messages, **params)
    messages.append({"role": "assistant", "content": reply.content})
    for _attempt in range(3):
        if ledger is None:
            results = [{"type": "tool_result", "tool_use_id": block.id,
                        "content": tools[0].call(block.input)}
                       for block in reply.content if block.type == "tool_use"]
            answer: Any = {"role": "user", "content": results}
        else:
            answer = ledger.run_tools(reply)
        try:
            request = [*messages, answer]
            final = client.messages.create(messages=request, **params) if ledger is None \
                else ledger.create(client.messages, messages=request, **params)
        except InternalServerError:
            continue  # retry the turn
        messages.append(answer)
        return final
    raise AssertionError("the loop never finished")


@pytest.mark.invariant("I1", "I12")
@pytest.mark.parametrize("through", ["sdk-alone", "ledger"])
def test_a_retried_turn_of_a_create_loop_never_reruns_a_finished_tool(
        tmp_path: Path, through: str) -> None:
    effects = Effects(tmp_path, "p")
    model = FakeModel(fail=[False, True])  # the request carrying the result fails once
    tools = [sync_charge(effects)]
    store = SQLiteEventStore(tmp_path / "events.db")
    ledger = None if through == "sdk-alone" else MessageToolLedger.open(
        "m", tools, store=store)
    final = _loop(model.client(), ledger, tools, [{"role": "user", "content": "pay 7"}])
    if through == "sdk-alone":
        assert effects.lines() == ["p charge 7", "p charge 7"]
        assert final.content[0].text == "charged 7 (run 2)"
    else:
        assert effects.lines() == ["p charge 7"]
        assert final.content[0].text == "charged 7 (run 1)"  # both requests carried it
        sent = [m[-1]["content"][0]["content"] for m in model.requests[1:]]
        assert sent == ["charged 7 (run 1)", "charged 7 (run 1)"]
        assert RunController.load(store, "m").phase("tu_1") is Phase.PUBLISHED


@pytest.mark.invariant("I12")
@pytest.mark.parametrize("buffered", [False, True])
def test_a_restarted_loop_answers_a_finished_call_from_the_store(tmp_path: Path,
                                                                 buffered: bool) -> None:
    """The process died after the tool and before the request. Per event, the result was
    recorded: a new ledger on the same store answers the reply again from the cache.
    Buffered (the default), the result rides with the next write, the request's, which
    never came: the call is in doubt. Either way it never runs again."""
    effects = Effects(tmp_path, "p")
    store = SQLiteEventStore(tmp_path / "events.db")
    model = FakeModel()
    client = model.client()
    tools = [sync_charge(effects)]
    first = MessageToolLedger.open("m", tools, store=store, owner="first", buffered=buffered)
    reply = first.create(client.messages, model="claude-test", max_tokens=64,
                         messages=[{"role": "user", "content": "pay 7"}])
    answered = first.run_tools(reply)
    del first  # ... the process died here
    second = MessageToolLedger.open("m", tools, store=SQLiteEventStore(tmp_path / "events.db"),
                                    owner="second", buffered=buffered)
    if buffered:
        with pytest.raises(ToolInDoubt):
            second.run_tools(reply)
    else:
        assert second.run_tools(reply) == answered
    assert effects.lines() == ["p charge 7"]


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_superseded_messages_ledger_sends_no_request(tmp_path: Path,
                                                       asynchronous: bool) -> None:
    """A request needs no flush of its own (DESIGN §7.7), but the ledger must still hold
    the run: once another process claimed it, the first ledger's next request is refused
    (`ConcurrencyConflict`) before anything is sent."""
    effects = Effects(tmp_path, "p")
    model = FakeModel()
    store = SQLiteEventStore(tmp_path / "events.db")
    tools = [sync_charge(effects)]
    first = MessageToolLedger.open("m", tools, store=store, owner="first")
    reply = first.create(model.client().messages, model="claude-test", max_tokens=64,
                         messages=[{"role": "user", "content": "pay 7"}])
    answered = first.run_tools(reply)  # the tool's start was flushed: the run exists
    MessageToolLedger.open("m", tools, store=SQLiteEventStore(tmp_path / "events.db"),
                           owner="second")  # claims it
    request = [{"role": "user", "content": "pay 7"},
               {"role": "assistant", "content": reply.content}, answered]
    params: dict[str, Any] = {"model": "claude-test", "max_tokens": 64, "messages": request}
    if asynchronous:
        client = AsyncAnthropic(api_key="test-key", max_retries=0, http_client=httpx2.AsyncClient(
            transport=httpx2.MockTransport(model.handle)))
        with pytest.raises(ConcurrencyConflict):
            asyncio.run(first.acreate(client.messages, **params))
    else:
        with pytest.raises(ConcurrencyConflict):
            first.create(model.client().messages, **params)
    assert len(model.requests) == 1  # the second request was never sent
    assert effects.lines() == ["p charge 7"]


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_request_answering_a_call_in_doubt_on_its_own_is_never_sent(
        tmp_path: Path, asynchronous: bool) -> None:
    """The process died inside ``charge``; the restarted caller answers the interrupted
    call itself (an error result asking to retry, a common way to go on) and asks again.
    The call is in doubt: the request is refused (`ToolInDoubt`) before anything is sent,
    for the model would be told the charge never happened and could ask for it again."""
    effects = Effects(tmp_path, "p")
    model = FakeModel()

    @beta_tool
    def charge(x: int) -> str:
        """Charge the customer x dollars."""
        effects(f"charge {x}")
        raise Crash  # (the process dies here: nothing after the effect is recorded)

    first = MessageToolLedger.open("m", [charge], store=SQLiteEventStore(tmp_path / "e.db"))
    history: list[Any] = [{"role": "user", "content": "pay 7"}]
    reply = first.create(model.client().messages, model="claude-test", max_tokens=64,
                         messages=history)
    with pytest.raises(Crash):
        first.run_tools(reply)
    again = MessageToolLedger.open("m", [charge], store=SQLiteEventStore(tmp_path / "e.db"))
    history += [{"role": "assistant", "content": reply.content},
                {"role": "user", "content": [{
                    "type": "tool_result", "tool_use_id": reply.content[0].id,
                    "content": "interrupted: please try again", "is_error": True}]}]
    params: dict[str, Any] = {"model": "claude-test", "max_tokens": 64, "messages": history}
    if asynchronous:
        client = AsyncAnthropic(api_key="test-key", max_retries=0, http_client=httpx2.AsyncClient(
            transport=httpx2.MockTransport(model.handle)))
        with pytest.raises(ToolInDoubt, match=reply.content[0].id):
            asyncio.run(again.acreate(client.messages, **params))
    else:
        with pytest.raises(ToolInDoubt, match=reply.content[0].id):
            again.create(model.client().messages, **params)
    assert len(model.requests) == 1  # only the first request was ever sent
    assert effects.lines() == ["p charge 7"]


def test_a_tool_use_id_seen_again_with_other_input_never_runs(tmp_path: Path) -> None:
    """A reply whose ``tool_use`` id the ledger holds, with input other than the recorded
    one (as JSON: ``7`` and ``7.0`` differ), is refused before anything runs; the same
    input is answered from the ledger."""
    effects = Effects(tmp_path, "p")
    model = FakeModel()
    client = model.client()
    ledger = MessageToolLedger.open("m", [sync_charge(effects)], store=MemoryEventStore())
    reply = ledger.create(client.messages, model="claude-test", max_tokens=64,
                          messages=[{"role": "user", "content": "pay 7"}])
    answered = ledger.run_tools(reply)
    for other in ({"x": 8}, {"x": 7.0}):
        altered = reply.model_copy(deep=True)
        altered.content[0].input = other
        with pytest.raises(InvalidTransition, match="other than the recorded"):
            ledger.run_tools(altered)
    assert ledger.run_tools(reply) == answered
    assert effects.lines() == ["p charge 7"]


def test_an_unanswered_tool_use_is_refused_before_anything_is_sent(tmp_path: Path) -> None:
    effects = Effects(tmp_path, "p")
    store = MemoryEventStore()
    model = FakeModel()
    client = model.client()
    ledger = MessageToolLedger.open("m", [sync_charge(effects)], store=store)
    history: list[Any] = [{"role": "user", "content": "pay 7"}]
    reply = ledger.create(client.messages, model="claude-test", max_tokens=64,
                          messages=history)
    history.append({"role": "assistant", "content": reply.content})
    history.append({"role": "user", "content": "never mind"})  # no tool_result
    with pytest.raises(UnansweredToolUse):
        ledger.create(client.messages, model="claude-test", max_tokens=64, messages=history)
    assert len(model.requests) == 1
    assert effects.lines() == []

    # a call in doubt: refused by run_tools before any call of the reply runs, and the
    # history that lacks its result is refused too, naming the doubt
    ledger.controller.receive_tool_calls([ToolCall("tu_1", "charge", {"x": 7})])
    ledger.controller.begin_tool("tu_1")
    ledger.controller.flush()  # the start is durable, as before a tool body
    reloaded = MessageToolLedger.open("m", [sync_charge(effects)], store=store)
    with pytest.raises(ToolInDoubt):
        reloaded.run_tools(reply)
    with pytest.raises(UnansweredToolUse, match="in doubt"):
        reloaded.create(client.messages, model="claude-test", max_tokens=64,
                        messages=history[:2])
    assert len(model.requests) == 1
    assert effects.lines() == []


@pytest.mark.parametrize("via", ["create", "runner"])
def test_a_saved_answer_holding_a_result_the_ledger_lost_is_refused(tmp_path: Path,
                                                                   via: str) -> None:
    """Buffered (the default), an idempotent call's result rides with the next request;
    the process dies before it, and the caller resumes with the answer it saved, whose
    result the ledger never recorded (the call is started: it runs again). Sent, the model
    would answer and the run could never end (its call started, never completed). It is
    refused before anything is sent (`UnansweredToolUse`, naming the call); the kept reply
    answered by ``run_tools`` runs the call again and the conversation ends."""
    effects = Effects(tmp_path, "p")
    store = SQLiteEventStore(tmp_path / "events.db")
    model = FakeModel()
    client = model.client()
    lookup = sync_charge(effects)  # idempotent here: it may run again
    ledger = MessageToolLedger.open("m", [lookup], store=store, idempotent={"charge"})
    history: list[Any] = [{"role": "user", "content": "pay 7"}]
    reply = ledger.create(client.messages, model="claude-test", max_tokens=64,
                          messages=history)
    history += [{"role": "assistant", "content": reply.content}, ledger.run_tools(reply)]
    del ledger  # ... the process died before the request carrying the result
    again = MessageToolLedger.open("m", [lookup], store=SQLiteEventStore(
        tmp_path / "events.db"), idempotent={"charge"})

    def resend() -> Any:
        if via == "runner":
            return again.attach(client.beta.messages.tool_runner(
                model="claude-test", max_tokens=64, tools=[lookup],
                messages=history)).until_done()
        return again.create(client.messages, model="claude-test", max_tokens=64,
                            messages=history)

    with pytest.raises(UnansweredToolUse, match="tu_1"):
        resend()
    assert len(model.requests) == 1  # nothing sent
    final = again.create(client.messages, model="claude-test", max_tokens=64,
                         messages=[*history[:2], again.run_tools(reply)])
    assert final.content[0].text == "charged 7 (run 2)"  # it ran again, as idempotent
    assert effects.lines() == ["p charge 7", "p charge 7"]
    assert again.controller.step is Step.COMPLETED


@pytest.mark.invariant("I1", "I12")
@pytest.mark.parametrize(("through", "resend"), [
    ("sdk-alone", "first"), ("ledger", "first"), ("ledger", "kept"), ("ledger", "elsewhere")])
def test_a_retried_tool_runner_turn_never_reruns_a_finished_tool(
        tmp_path: Path, through: str, resend: str) -> None:
    """``client.beta.messages.tool_runner``: the request carrying the tool's result fails,
    and the runner raises. The SDK alone's caller runs the turn again with a new runner
    from the first message; the model asks for the call again (this one under the same id,
    ``tu_1``; the API would name it afresh) and it runs twice. Through the ledger a new
    runner from the first message alone is sent the turn it lacks, rebuilt from the ledger
    (`MessageToolLedger.resumed`: the reply as it came, the recorded result), the tool run
    once; a ledger that never saw the reply (another process's, loaded from the store)
    refuses it before anything is sent (`StaleHistory`, ``why="not-kept"``: the model
    would ask again and the tool run twice); one given the reply the runner yielded,
    answered by ``ledger.run_tools`` from the ledger, goes on, the tool run once."""
    effects = Effects(tmp_path, "p")
    model = FakeModel(fail=[False, True])
    client = model.client()
    store = MemoryEventStore()
    ledger = MessageToolLedger.open("t", store=store)
    tools = [sync_charge(effects)]
    first: list[Any] = [{"role": "user", "content": "pay 7"}]

    def runner(messages: list[Any], through_ledger: MessageToolLedger = ledger) -> Any:
        made = client.beta.messages.tool_runner(
            model="claude-test", max_tokens=64, tools=tools, messages=messages)
        return made if through == "sdk-alone" else through_ledger.attach(made)

    replies = []
    with pytest.raises(InternalServerError):
        replies.extend(runner(first))
    if through == "sdk-alone":
        final = runner(first).until_done()
        assert effects.lines() == ["p charge 7", "p charge 7"]
        assert final.content[0].text == "charged 7 (run 2)"
        return
    if resend == "elsewhere":  # another process's ledger, which claims the run
        with pytest.raises(StaleHistory) as refused:
            runner(first, MessageToolLedger.open("t", store=store)).until_done()
        assert (refused.value.call_ids, refused.value.why) == (("tu_1",), "not-kept")
        assert len(model.requests) == 2  # the reply's and the failed one: nothing sent
        assert effects.lines() == ["p charge 7"]
        return
    [reply] = replies
    if resend == "first":
        final = runner(first).until_done()
    else:
        final = runner([*first, reply.to_param(), ledger.run_tools(reply)]).until_done()
    assert effects.lines() == ["p charge 7"]
    assert final.content[0].text == "charged 7 (run 1)"
    turn = [{"role": "user", "content": "pay 7"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "tu_1",
                                               "name": "charge", "input": {"x": 7}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu_1",
                                          "content": "charged 7 (run 1)"}]}]
    # the failed request went on the SDK's server-side thread (its results alone); the
    # new runner's starts a thread with the whole turn
    assert model.requests[1:] == [turn[2:], turn]


def test_an_async_tool_runner_and_arun_tools_use_the_same_ledger(tmp_path: Path) -> None:
    effects = Effects(tmp_path, "p")
    model = FakeModel(fail=[False, True])
    ledger = MessageToolLedger.open("a", [counted_charge(effects)], store=MemoryEventStore())
    client = AsyncAnthropic(api_key="test-key", max_retries=0, http_client=httpx2.AsyncClient(
        transport=httpx2.MockTransport(model.handle)))
    first: list[Any] = [{"role": "user", "content": "pay 7"}]

    async def go() -> Any:
        def runner(messages: list[Any]) -> Any:
            return ledger.attach(client.beta.messages.tool_runner(
                model="claude-test", max_tokens=64, tools=[counted_charge(effects)],
                messages=messages))

        replies: list[Any] = []

        async def collect() -> None:
            async for message in runner(first):
                replies.append(message)

        with pytest.raises(InternalServerError):
            await collect()
        [reply] = replies
        final = await runner([*first, reply.to_param(),
                              await ledger.arun_tools(reply)]).until_done()
        again = await client.messages.create(model="claude-test", max_tokens=64,
                                             messages=[{"role": "user", "content": "pay"}])
        return final, await ledger.arun_tools(again)

    final, answer = asyncio.run(go())
    assert effects.lines() == ["p charge 7"]
    assert final.content[0].text == "charged 7 (run 1)"
    assert answer["content"][0]["content"] == "charged 7 (run 1)"


# ------------------------------------------------ what the SDK lets users do (issue 23)


class Receipt(pydantic.BaseModel):
    amount: int
    at: datetime.datetime
    note: str = ""


STAMPED = datetime.datetime(2026, 1, 1, 12, 0)


class Model(FakeModel):
    """`FakeModel` that also keeps each request's raw body."""

    def __init__(self, fail: list[bool] | None = None) -> None:
        super().__init__(fail)
        self.bodies: list[bytes] = []

    def handle(self, request: httpx2.Request) -> httpx2.Response:
        self.bodies.append(request.content)
        return super().handle(request)

    def async_client(self) -> AsyncAnthropic:
        return AsyncAnthropic(api_key="test-key", max_retries=0,
                              http_client=httpx2.AsyncClient(
                                  transport=httpx2.MockTransport(self.handle)))


def receipt_tool(effects: Effects) -> Any:
    @beta_tool  # type: ignore[type-var]  # (the SDK's types want text)
    def charge(x: int) -> Receipt:
        """Charge the customer x dollars."""
        effects(f"charge {x}")
        return Receipt(amount=x, at=STAMPED)

    return charge


def test_a_pydantic_result_with_a_datetime_is_sent_byte_for_byte_as_the_sdk_sends_it(
        tmp_path: Path) -> None:
    """``beta.messages.tool_runner`` with a tool returning a pydantic model holding a
    datetime: the SDK alone sends it (as its own encoder writes it). Through the ledger the
    request carrying it is byte-identical, and so is the retried turn's (a new runner given
    the reply, answered from the ledger: the tool ran once)."""
    bodies = {}
    first: list[Any] = [{"role": "user", "content": "pay 7"}]
    for through in ("sdk-alone", "ledger"):
        effects = Effects(tmp_path, through)
        model = Model(fail=[False, True])  # the request carrying the result fails once
        client = model.client()
        ledger = MessageToolLedger.open(through, store=MemoryEventStore())

        def runner(messages: list[Any], ledger: MessageToolLedger = ledger,
                   client: Anthropic = client, effects: Effects = effects,
                   through: str = through) -> Any:
            made = client.beta.messages.tool_runner(
                model="claude-test", max_tokens=64, tools=[receipt_tool(effects)],
                messages=messages)
            return made if through == "sdk-alone" else ledger.attach(made)

        replies: list[Any] = []
        with pytest.raises(InternalServerError):
            replies.extend(runner(first))
        if through == "sdk-alone":
            runner(first).until_done()
        else:
            [reply] = replies
            runner([*first, reply.to_param(), ledger.run_tools(reply)]).until_done()
        bodies[through] = model.bodies
        runs = [line for line in effects.lines() if line.startswith(through)]
        assert len(runs) == (2 if through == "sdk-alone" else 1)
    sent = json.loads(bodies["sdk-alone"][1])["messages"][-1]["content"][0]["content"]
    assert sent == [["amount", 7], ["at", "2026-01-01T12:00:00"], ["note", ""]]
    assert bodies["ledger"][1] == bodies["sdk-alone"][1]
    # the resend (a new runner: the whole history, where the failed request continued the
    # runner's thread with its last message only) carries the same result block, and the
    # same bytes of it
    result = json.loads(bodies["sdk-alone"][1])["messages"][-1]
    assert json.loads(bodies["ledger"][2])["messages"][-1] == result
    assert json.dumps(result["content"], separators=(",", ":")).encode() in bodies["ledger"][2]


@pytest.mark.parametrize("through", ["sdk-alone", "adapter"])
def test_a_pydantic_result_in_a_managed_session_is_posted_once(tmp_path: Path,
                                                               through: str) -> None:
    """The SDK's session runner alone fails on a tool returning a pydantic model (after the
    tool ran, nothing posted); through the adapter the result is posted as the model's JSON
    text, and re-posted after a failed post and a reconnect without a second run."""
    effects = Effects(tmp_path, "p")

    @beta_async_tool  # type: ignore[type-var]
    async def charge(x: int) -> Receipt:
        """Charge the customer x dollars."""
        effects(f"charge {x}")
        return Receipt(amount=x, at=STAMPED)

    server = FakeSession([tool_use("tu_1", "charge", {"x": 7})],
                         faults=[PostFault("reject", then_drop_stream=True)])

    async def go() -> list[tuple[str, bool, list[str]]]:
        if through == "sdk-alone":
            return await drive(SessionToolRunner(client_for(server), SESSION_ID,
                                                 tools=[charge], max_idle=None))
        runner = await LedgerSessionToolRunner.open(client_for(server), SESSION_ID,
                                                    tools=[charge], max_idle=None)
        return await drive(runner)

    if through == "sdk-alone":
        with pytest.raises(BaseExceptionGroup) as raised:
            asyncio.run(go())
        assert raised.group_contains(AttributeError)
        assert effects.lines() == ["p charge 7"]
        assert server.posts == []
        return
    text = '{"amount": 7, "at": "2026-01-01T12:00:00", "note": ""}'
    assert asyncio.run(go()) == [("tu_1", False, [text]), ("tu_1", True, [text])]
    assert effects.lines() == ["p charge 7"]
    assert [texts(e) for e in server.results("tu_1")] == [[text]]


def test_run_tools_answers_a_result_holding_datetimes(tmp_path: Path) -> None:
    effects = Effects(tmp_path, "p")

    @beta_tool
    def charge(x: int) -> Any:
        """Charge the customer x dollars."""
        effects(f"charge {x}")
        return {"amount": x, "at": STAMPED}

    model = FakeModel()
    client = model.client()
    ledger = MessageToolLedger.open("m", [charge], store=MemoryEventStore())
    reply = ledger.create(client.messages, model="claude-test", max_tokens=64,
                          messages=[{"role": "user", "content": "pay 7"}])
    answer = ledger.run_tools(reply)
    assert answer is not None
    assert answer["content"] == [{"type": "tool_result", "tool_use_id": "tu_1",
                                  "content": '{"amount": 7, "at": "2026-01-01T12:00:00"}'}]
    assert ledger.run_tools(reply) == answer
    assert effects.lines() == ["p charge 7"]


# a loop killed inside its tool, or while the request carrying its result is sent; a
# restarted process goes on from the caller's saved messages (the SDK alone's caller runs
# the loop again from its first message)


def _messages_driver(command: str, folder: Path, name: str, via: str, *extra: str
                     ) -> dict[str, Any]:
    """One driver command in a forked child (killed by itself: ``{}``)."""
    answer = fork(command, str(folder), name, via, *extra)
    assert (answer is None) == ("crash" in command), answer
    return answer or {}


def _requests(folder: Path) -> list[str]:
    path = folder / "requests.txt"
    return path.read_text().splitlines() if path.exists() else []


@pytest.mark.parametrize("via", ["create", "runner"])
@pytest.mark.parametrize("through", ["sdk-alone", "ledger"])
def test_after_a_crash_inside_a_tool_nothing_is_sent(tmp_path: Path, through: str,
                                                     via: str) -> None:
    """kill -9 inside ``charge``; the restarted loop. The SDK alone sends the first request
    again and charges again; through the ledger the restart is refused with `ToolInDoubt`
    before any request."""
    prefix = "sdk-" if through == "sdk-alone" else ""
    _messages_driver(f"{prefix}messages-crash-tool", tmp_path, "first", via)
    assert _requests(tmp_path) == ["first request"]
    resumed = _messages_driver(f"{prefix}messages-resume", tmp_path, "second", via)
    if through == "sdk-alone":
        assert resumed["outcome"] == "done"
        assert Effects(tmp_path, "").lines() == ["first charge 7", "second charge 7"]
        return
    assert (resumed["outcome"], resumed["error"]) == ("error", "ToolInDoubt")
    assert _requests(tmp_path) == ["first request"]
    assert Effects(tmp_path, "").lines() == ["first charge 7"]


@pytest.mark.parametrize("via", ["create", "runner"])
@pytest.mark.parametrize("output", ["charged 7 (by hand)", {"charged": 7, "by": "hand"}])
def test_a_resolution_recorded_from_outside_is_sent_as_a_tool_result(
        tmp_path: Path, output: Any, via: str) -> None:
    """kill -9 inside ``charge``; an operator records the outcome (plain text or JSON,
    `resolve_in_doubt`); the restarted loop, from the saved reply, sends it as the call's
    tool_result and ends (the model echoes it): the tool never runs again, and the model
    is asked only for its next answer."""
    _messages_driver("messages-crash-tool", tmp_path, "first", via)
    store = SQLiteEventStore(tmp_path / "events.db")
    operator = RunController.load(store, "messages")
    operator.claim("operator")
    operator.resolve_in_doubt("tu_1", output)
    store.close()
    resumed = _messages_driver("messages-resume", tmp_path, "second", via)
    assert resumed["outcome"] == "done", resumed
    assert resumed["final"] == (output if isinstance(output, str) else json.dumps(output))
    assert Effects(tmp_path, "").lines() == ["first charge 7"]
    assert _requests(tmp_path) == ["first request", "second request"]


def test_a_resolution_recorded_from_outside_is_posted_by_the_session_runner(
        tmp_path: Path) -> None:
    assert fork("crash-tool", str(tmp_path), "first") is None  # killed inside the tool
    store = SQLiteEventStore(tmp_path / "events.db")
    operator = RunController.load(store, f"anthropic-session:{SESSION_ID}")
    operator.claim("operator")
    operator.resolve_in_doubt("tu_1", "charged 7 (by hand)")
    store.close()
    assert fork("resume", str(tmp_path), "second") == {
        "name": "second", "outcome": "done", "error": None, "posted": [True]}
    remote = json.loads((tmp_path / "remote.json").read_text())["events"]
    [landed] = [e for e in remote if e.get("custom_tool_use_id") == "tu_1"]
    assert landed["type"] == "user.custom_tool_result"
    assert texts(landed) == ["charged 7 (by hand)"]
    assert Effects(tmp_path, "").lines() == ["first charge 7"]


@pytest.mark.parametrize("via", ["create", "runner"])
def test_kill_9_while_the_result_is_sent_then_restart_goes_on(tmp_path: Path,
                                                               via: str) -> None:
    """kill -9 while the request carrying the result is on its way: a result is a per-call
    publication (no Session envelope), so the restart is never refused as "an attempt may
    still be writing": it re-sends the recorded result and ends; a third process gets the
    recorded answer without any request."""
    _messages_driver("messages-crash-request", tmp_path, "first", via)
    resumed = _messages_driver("messages-resume", tmp_path, "second", via)
    assert (resumed["outcome"], resumed["final"], resumed["replayed"]) == (
        "done", "charged 7", False)
    assert Effects(tmp_path, "").lines() == ["first charge 7"]
    again = _messages_driver("messages-resume", tmp_path, "third", via)
    assert (again["outcome"], again["final"], again["replayed"]) == ("done", "charged 7",
                                                                     True)
    assert _requests(tmp_path) == ["first request", "second request"]
    assert Effects(tmp_path, "").lines() == ["first charge 7"]


@pytest.mark.invariant("I11", "I12")
@pytest.mark.parametrize("via", ["create", "runner"])
def test_kill_9_while_the_model_answers_after_a_tool_leaves_the_call_completed(
        tmp_path: Path, via: str) -> None:
    """Buffered (the default), kill -9 while the request carrying the tool's result waits
    for the model: the result was made durable before that request (flush_results), so
    the call is completed in the log the killed process left (not in doubt, no operator
    needed), and the restart, from the caller's saved messages, answers it from the ledger
    and ends; the tool ran once."""
    _messages_driver("messages-crash-request", tmp_path, "first", via, "buffered")
    store = SQLiteEventStore(tmp_path / "events.db")
    left = RunController.load(store, "messages")
    store.close()
    assert (left.phase("tu_1"), left.in_doubt()) == (Phase.COMPLETED, ())
    assert left.call("tu_1").result == {"type": "tool_result", "tool_use_id": "tu_1",
                                        "content": "charged 7"}
    resumed = _messages_driver("messages-resume", tmp_path, "second", via, "buffered")
    assert (resumed["outcome"], resumed["final"]) == ("done", "charged 7"), resumed
    assert Effects(tmp_path, "").lines() == ["first charge 7"]
    assert _requests(tmp_path) == ["first request", "second request"]


# a conversation that ended


def _verdict_and_listing(path: Path, run_id: str, capsys: pytest.CaptureFixture[str]
                         ) -> tuple[str, list[str], list[str]]:
    store = SQLiteEventStore(path)
    said = verdict(RunController.load(store, run_id))
    store.close()
    capsys.readouterr()
    listed = {}
    for step in ("completed", "tools"):
        assert cli_main(["list", "--store", str(path), "--step", step, "--json"]) == 0
        listed[step] = [run["run_id"] for run in json.loads(capsys.readouterr().out)]
    return said, listed["completed"], listed["tools"]


def test_a_finished_messages_conversation_says_it_ended(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A create loop, the SDK's tool runner (sync and async), and a conversation without
    any tool call: each ends COMPLETED, `inspect` says so and ``list --step`` tells it from
    a conversation left in TOOLS (one whose final reply never came)."""
    path = tmp_path / "events.db"
    store = SQLiteEventStore(path)
    effects = Effects(tmp_path, "p")
    tools = [sync_charge(effects)]
    model = Model()
    client = model.client()
    _loop(client, MessageToolLedger.open("loop", tools, store=store), tools,
          [{"role": "user", "content": "pay 7"}])
    ledger = MessageToolLedger.open("runner", store=store)
    ledger.attach(client.beta.messages.tool_runner(
        model="claude-test", max_tokens=64, tools=tools,
        messages=[{"role": "user", "content": "pay 7"}])).until_done()
    async_ledger = MessageToolLedger.open("async", store=store)

    async def go() -> None:
        await async_ledger.attach(model.async_client().beta.messages.tool_runner(
            model="claude-test", max_tokens=64, tools=[counted_charge(effects)],
            messages=[{"role": "user", "content": "pay 7"}])).until_done()

    asyncio.run(go())
    MessageToolLedger.open("no-tools", store=store).create(
        client.messages, model="claude-test", max_tokens=64,
        messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x",
                                                 "content": "hello"}]}])
    stuck = MessageToolLedger.open("stuck", tools, store=store)
    stuck.run_tools(client.messages.create(model="claude-test", max_tokens=64,
                                           messages=[{"role": "user", "content": "pay"}]))
    for run_id in ("loop", "runner", "async", "no-tools"):
        said, completed, in_tools = _verdict_and_listing(path, run_id, capsys)
        assert said == "The run is completed: there is nothing to resume.", run_id
        assert run_id in completed
        assert run_id not in in_tools
    assert "stuck" in in_tools
    assert "stuck" not in completed
    store.close()


def test_a_finished_managed_session_says_it_ended(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    effects = Effects(tmp_path, "p")
    path = tmp_path / "events.db"
    server = FakeSession([tool_use("tu_1", "charge", {"x": 7})])

    async def go() -> None:
        runner = await LedgerSessionToolRunner.open(
            client_for(server), SESSION_ID, tools=[counted_charge(effects)],
            store=SQLiteEventStore(path), run_id="session", max_idle=None)
        await drive(runner)

    asyncio.run(go())
    said, completed, in_tools = _verdict_and_listing(path, "session", capsys)
    assert said == "The run is completed: there is nothing to resume."
    assert completed == ["session"]
    assert in_tools == []


# running a completed conversation again


def _conversation(client: Anthropic, ledger: MessageToolLedger | None, tools: list[Any],
                  messages: list[Any]) -> Any:
    """A messages loop that runs until a reply asks for no tool."""
    params: dict[str, Any] = {"model": "claude-test", "max_tokens": 64,
                              "tools": [tool.to_dict() for tool in tools]}

    def send() -> Any:
        if ledger is None:
            return client.messages.create(messages=messages, **params)
        return ledger.create(client.messages, messages=messages, **params)

    reply = send()
    while reply.stop_reason == "tool_use":
        messages.append({"role": "assistant", "content": reply.content})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": block.id,
             "content": tools[0].call(block.input)}
            for block in reply.content if block.type == "tool_use"]}
            if ledger is None else ledger.run_tools(reply))
        reply = send()
    return reply


@pytest.mark.parametrize("via", ["create", "runner", "async-runner"])
@pytest.mark.parametrize("through", ["sdk-alone", "ledger"])
def test_running_a_completed_conversation_again_returns_its_recorded_result(
        tmp_path: Path, through: str, via: str) -> None:
    """A user retries a request that completed: the SDK alone asks the model again and
    charges again; through the ledger the recorded final reply comes back without any
    request or tool run, and the ledger says so (``replayed``)."""
    effects = Effects(tmp_path, "p")
    store = SQLiteEventStore(tmp_path / "events.db")
    model = Model()

    def once() -> tuple[str, bool | None]:
        ledger = None if through == "sdk-alone" else MessageToolLedger.open(
            "m", [sync_charge(effects)], store=store)
        first: list[Any] = [{"role": "user", "content": "pay 7"}]
        params: dict[str, Any] = {"model": "claude-test", "max_tokens": 64}
        if via == "create":
            final = _conversation(model.client(), ledger, [sync_charge(effects)], first)
        elif via == "runner":
            made = model.client().beta.messages.tool_runner(
                tools=[sync_charge(effects)], messages=first, **params)
            final = (made if ledger is None else ledger.attach(made)).until_done()
        else:
            async def go() -> Any:
                made = model.async_client().beta.messages.tool_runner(
                    tools=[counted_charge(effects)], messages=first, **params)
                return await (made if ledger is None else ledger.attach(made)).until_done()
            final = asyncio.run(go())
        return final.content[0].text, None if ledger is None else ledger.replayed

    assert once() == ("charged 7 (run 1)", None if through == "sdk-alone" else False)
    requests = len(model.requests)
    assert requests == 2
    again = once()
    if through == "sdk-alone":
        assert again == ("charged 7 (run 2)", None)
        assert len(model.requests) == 4
        assert effects.lines() == ["p charge 7", "p charge 7"]
        return
    assert again == ("charged 7 (run 1)", True)
    assert len(model.requests) == requests  # no request
    assert effects.lines() == ["p charge 7"]  # no tool
    assert RunController.load(store, "m").step is Step.COMPLETED


def test_a_completed_conversation_refuses_a_request_that_is_not_its_own(
        tmp_path: Path) -> None:
    """A create on a completed run whose messages go past the recorded conversation (a new
    user turn after its end) is refused before anything is sent: it needs a new run."""
    model = Model()
    client = model.client()
    store = MemoryEventStore()
    tools = [sync_charge(Effects(tmp_path, "p"))]
    history: list[Any] = [{"role": "user", "content": "pay 7"}]
    final = _loop(client, MessageToolLedger.open("m", tools, store=store), tools, history)
    history += [{"role": "assistant", "content": final.content},
                {"role": "user", "content": "and 8 more"}]
    ledger = MessageToolLedger.open("m", tools, store=store)
    with pytest.raises(RunNotResumable, match="new run"):
        ledger.create(client.messages, model="claude-test", max_tokens=64, messages=history)
    assert len(model.requests) == 2


def test_running_a_completed_managed_session_again_opens_nothing(tmp_path: Path) -> None:
    effects = Effects(tmp_path, "p")
    store = SQLiteEventStore(tmp_path / "events.db")
    server = FakeSession([tool_use("tu_1", "charge", {"x": 7})])

    async def go() -> tuple[list[tuple[str, bool, list[str]]], bool]:
        runner = await LedgerSessionToolRunner.open(
            client_for(server), SESSION_ID, tools=[counted_charge(effects)], store=store,
            run_id="r", max_idle=None)
        return await drive(runner), runner.replayed

    assert asyncio.run(go()) == ([("tu_1", True, ["charged 7 (run 1)"])], False)
    opened = server.stream_opens
    assert asyncio.run(go()) == ([], True)
    assert server.stream_opens == opened
    assert effects.lines() == ["p charge 7"]
    assert len(server.posts) == 1


# results over max_bytes


def _small(run_id: str, max_bytes: int = 4000) -> RunController:
    return RunController.start(run_id=run_id, session_id=None, store=MemoryEventStore(),
                               max_bytes=max_bytes)


@pytest.mark.parametrize("via", ["run_tools", "runner"])
@pytest.mark.parametrize("through", ["sdk-alone", "ledger"])
def test_a_result_over_max_bytes_is_an_error_the_model_sees(tmp_path: Path, through: str,
                                                            via: str) -> None:
    """A tool's result too large for the run's log: the SDK alone sends it; through the
    ledger the call is recorded as failed and the model sees an error result, never a call
    left in doubt by the library's own limit."""
    effects = Effects(tmp_path, "p")

    @beta_tool
    def charge(x: int) -> str:
        """Charge the customer x dollars."""
        effects(f"charge {x}")
        return "receipt " * 1000

    model = Model()
    client = model.client()
    ledger = MessageToolLedger(_small(through), [charge])
    params: dict[str, Any] = {"model": "claude-test", "max_tokens": 64}
    first: list[Any] = [{"role": "user", "content": "pay 7"}]
    if via == "runner":
        made = client.beta.messages.tool_runner(tools=[charge], messages=first, **params)
        (made if through == "sdk-alone" else ledger.attach(made)).until_done()
    else:
        reply = client.messages.create(messages=first, **params)
        answer = ({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "tu_1", "content": charge.call({"x": 7})}]}
                  if through == "sdk-alone" else ledger.run_tools(reply))
        request: list[Any] = [*first, {"role": "assistant", "content": reply.content},
                              answer]
        if through == "sdk-alone":
            client.messages.create(messages=request, **params)
        else:
            ledger.create(client.messages, messages=request, **params)
    [sent] = model.requests[1][-1]["content"]
    assert effects.lines() == ["p charge 7"]
    if through == "sdk-alone":
        assert sent["content"] == "receipt " * 1000
        return
    assert sent["is_error"] is True
    assert "max_bytes" in str(sent["content"])
    assert ledger.controller.call("tu_1").phase is Phase.PUBLISHED
    assert ledger.controller.in_doubt() == ()


def test_a_result_over_max_bytes_in_a_managed_session_is_an_error_the_model_sees(
        tmp_path: Path) -> None:
    effects = Effects(tmp_path, "p")

    @beta_async_tool
    async def charge(x: int) -> str:
        """Charge the customer x dollars."""
        effects(f"charge {x}")
        return "receipt " * 1000

    server = FakeSession([tool_use("tu_1", "charge", {"x": 7})])
    c = _small("r")

    async def go() -> None:
        await drive(LedgerSessionToolRunner(client_for(server), SESSION_ID, tools=[charge],
                                            controller=c, existing=False, max_idle=None))

    asyncio.run(go())
    [landed] = server.results("tu_1")
    assert landed["is_error"] is True
    assert "max_bytes" in texts(landed)[0]
    assert effects.lines() == ["p charge 7"]
    assert c.call("tu_1").phase is Phase.PUBLISHED


@pytest.mark.parametrize("via", ["run_tools", "runner", "session"])
def test_a_log_without_room_for_a_result_refuses_the_call_before_its_body(
        tmp_path: Path, via: str) -> None:
    """The log's room under max_bytes cannot hold even an error result: the call is
    refused before its body runs (`SchemaError`), and it is not left started."""
    effects = Effects(tmp_path, "p")
    c = _small("full", max_bytes=2964)
    c.receive_tool_calls([ToolCall("filler", "charge", {"x": "x" * 1100})])

    @beta_tool
    def charge(x: int) -> str:
        """Charge the customer x dollars."""
        effects(f"charge {x}")
        return "ok"

    @beta_async_tool(name="charge")
    async def acharge(x: int) -> str:
        """Charge the customer x dollars."""
        effects(f"charge {x}")
        return "ok"

    model = Model()
    client = model.client()
    ledger = MessageToolLedger(c, [charge])

    def attempt() -> None:
        if via == "run_tools":
            ledger.run_tools(client.messages.create(
                model="claude-test", max_tokens=64, messages=[{"role": "user",
                                                               "content": "pay"}]))
        elif via == "runner":
            ledger.attach(client.beta.messages.tool_runner(
                model="claude-test", max_tokens=64, tools=[charge],
                messages=[{"role": "user", "content": "pay"}])).until_done()
        else:
            server = FakeSession([tool_use("tu_1", "charge", {"x": 7})])
            asyncio.run(drive(LedgerSessionToolRunner(
                client_for(server), SESSION_ID, tools=[acharge], controller=c,
                existing=False, max_idle=None)))

    with pytest.raises(SchemaError, match="max_bytes"):
        attempt()
    assert effects.lines() == []
    assert c.phase("tu_1") in (None, Phase.APPROVED)
    assert c.in_doubt() == ()


# features refused or carried


def test_a_runner_with_a_toolset_is_refused_when_attached(tmp_path: Path) -> None:
    """A toolset's members would run outside the ledger: `attach` refuses the runner
    (`UnsupportedFeature`), before any request or tool."""
    from anthropic.lib.tools import BetaRunnableToolset

    class Browser(BetaRunnableToolset):
        toolset_name = "browser"

        def call(self, context: Any, name: str, input: Any) -> str:
            raise AssertionError("a member ran")

        def to_dict(self) -> Any:
            return {"type": "browser_toolset_20260801"}

    model = Model()
    runner = model.client().beta.messages.tool_runner(
        model="claude-test", max_tokens=64, tools=[Browser()],
        messages=[{"role": "user", "content": "pay"}])
    ledger = MessageToolLedger.open("t", store=MemoryEventStore())
    with pytest.raises(UnsupportedFeature, match="toolsets") as refused:
        ledger.attach(runner)
    assert refused.value.feature == "toolsets"
    assert model.requests == []
    assert ledger.controller.version == 1  # nothing recorded but the run's start


class Verdict(pydantic.BaseModel):
    paid: bool
    receipt: str


def test_a_replayed_structured_reply_is_parsed_as_the_runner_parses_it(
        tmp_path: Path) -> None:
    """A tool runner with ``output_format``: its final reply's ``parsed_output`` is the
    format's model, and so is the recorded reply's when the conversation runs again."""
    effects = Effects(tmp_path, "p")
    answer = '{"paid": true, "receipt": "r-7"}'

    def handle(request: httpx2.Request) -> httpx2.Response:
        last = json.loads(request.content)["messages"][-1]["content"]
        done = isinstance(last, list) and last[0].get("type") == "tool_result"
        content = ([{"type": "text", "text": answer}] if done else
                   [{"type": "tool_use", "id": "tu_1", "name": "charge", "input": {"x": 7}}])
        return httpx2.Response(200, json={
            "id": "msg", "type": "message", "role": "assistant", "model": "claude-test",
            "content": content, "stop_reason": "end_turn" if done else "tool_use",
            "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1}})

    client = Anthropic(api_key="test-key", max_retries=0, http_client=httpx2.Client(
        transport=httpx2.MockTransport(handle)))
    store = MemoryEventStore()

    def once() -> Any:
        ledger = MessageToolLedger.open("s", store=store)
        return ledger.attach(client.beta.messages.tool_runner(
            model="claude-test", max_tokens=64, tools=[sync_charge(effects)],
            output_format=Verdict,
            messages=[{"role": "user", "content": "pay 7"}])).until_done(), ledger

    first, _ = once()
    again, ledger = once()
    assert ledger.replayed
    assert first.parsed_output == again.parsed_output == Verdict(paid=True, receipt="r-7")
    assert type(again) is type(first)
    assert effects.lines() == ["p charge 7"]


@pytest.mark.parametrize(("died_in", "tools"), [("complete", True), ("complete", False),
                                                ("accept_final_output", False),
                                                ("model_responded", False)])
def test_a_conversation_whose_end_was_half_recorded_is_finished_from_its_record(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, died_in: str, tools: bool) -> None:
    """The process died while it recorded the conversation's end (between its records, as
    a kill between two appends leaves it, one append per event): the next attempt
    finishes the record and answers with the recorded reply, sending nothing, when the
    reply is in the log; it asks the model again only when it is not (died before the
    answer was recorded)."""
    effects = Effects(tmp_path, "p")
    store = SQLiteEventStore(tmp_path / "events.db")
    model = Model()
    first: list[Any] = ([{"role": "user", "content": "pay 7"}] if tools else
                        [{"role": "user", "content": [{"type": "tool_result",
                                                        "tool_use_id": "x",
                                                        "content": "hello"}]}])

    class Died(Exception):
        pass

    def die(*args: Any, **kwargs: Any) -> None:
        raise Died

    with monkeypatch.context() as patched:
        patched.setattr(RunController, died_in, die)
        with pytest.raises(Died):
            _conversation(model.client(), MessageToolLedger.open(
                "m", [sync_charge(effects)], store=store, buffered=False),
                [sync_charge(effects)], list(first))
    requests = len(model.requests)
    ledger = MessageToolLedger.open("m", [sync_charge(effects)], buffered=False,
                                    store=SQLiteEventStore(tmp_path / "events.db"))
    final = _conversation(model.client(), ledger, [sync_charge(effects)], list(first))
    asked_again = died_in == "model_responded"
    assert ledger.replayed is not asked_again
    assert len(model.requests) == requests + asked_again
    assert final.content[0].text == ("charged 7 (run 1)" if tools else "hello")
    assert effects.lines() == (["p charge 7"] if tools else [])
    assert RunController.load(store, "m").step is Step.COMPLETED


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
def test_an_attached_runner_records_a_result_posted_once_a_request_carried_it(
        tmp_path: Path, sync: bool) -> None:
    """Each reply the runner yields came back to a request: the results that request
    carried are recorded as posted by then, not only when the runner ends."""
    effects = Effects(tmp_path, "p")
    model = Model()
    ledger = MessageToolLedger.open("t", store=MemoryEventStore())
    seen = []
    params: dict[str, Any] = {"model": "claude-test", "max_tokens": 64,
                              "messages": [{"role": "user", "content": "pay 7"}]}
    if sync:
        for message in ledger.attach(model.client().beta.messages.tool_runner(
                tools=[sync_charge(effects)], **params)):
            seen.append((message.stop_reason, ledger.controller.phase("tu_1")))
    else:
        async def go() -> None:
            async for message in ledger.attach(model.async_client().beta.messages.tool_runner(
                    tools=[counted_charge(effects)], **params)):
                seen.append((message.stop_reason, ledger.controller.phase("tu_1")))

        asyncio.run(go())
    assert seen == [("tool_use", None), ("end_turn", Phase.PUBLISHED)]
    assert ledger.controller.step is Step.COMPLETED


def test_an_exception_raised_by_a_tool_is_the_error_result_the_sdk_sends(
        tmp_path: Path) -> None:
    """An ordinary exception from a tool body is the call's result: the SDK's own error
    result (what its tool runner sends), the same through `run_tools` and through an
    attached runner; recorded, so a retried turn sends it again without a second run."""
    effects = Effects(tmp_path, "p")

    @beta_tool
    def charge(x: int) -> str:
        """Charge the customer x dollars."""
        effects(f"charge {x}")
        raise ValueError("card declined")

    sent = {}
    for via in ("sdk-runner", "runner", "run_tools"):
        model = Model()
        client = model.client()
        ledger = MessageToolLedger.open(via, [charge], store=MemoryEventStore())
        first: list[Any] = [{"role": "user", "content": "pay 7"}]
        if via == "run_tools":
            _conversation(client, ledger, [charge], first)
        else:
            made = client.beta.messages.tool_runner(model="claude-test", max_tokens=64,
                                                    tools=[charge], messages=first)
            (made if via == "sdk-runner" else ledger.attach(made)).until_done()
        [sent[via]] = model.requests[1][-1]["content"]
    assert sent["runner"] == sent["run_tools"] == sent["sdk-runner"]
    assert sent["runner"]["is_error"] is True
    assert "card declined" in str(sent["runner"]["content"])
    assert len(effects.lines()) == 3  # once per world


def test_tools_made_by_the_sdks_mcp_helpers_are_refused_before_anything_is_recorded(
        tmp_path: Path) -> None:
    """``anthropic.lib.tools.mcp`` tools send a ``tools/call`` whose lost response the SDK
    turns into an error result: refused at open (and at attach), naming them, with no run
    started, loaded or claimed."""
    from anthropic.lib.tools.mcp import async_mcp_tool, mcp_tool
    from mcp.types import Tool as McpTool

    definition = McpTool(name="charge", input_schema={"type": "object", "properties": {}})
    client: Any = object()  # never reached: the tools are refused before any call
    sync_tool, async_tool = mcp_tool(definition, client), async_mcp_tool(definition, client)
    store = SQLiteEventStore(tmp_path / "events.db")
    with pytest.raises(UnsupportedFeature, match="MCP tools") as refused:
        MessageToolLedger.open("m", [sync_tool], store=store)
    assert refused.value.feature == "MCP tools"
    with pytest.raises(UnsupportedFeature, match="charge"):
        asyncio.run(LedgerSessionToolRunner.open(
            Model().async_client(), "s", tools=[async_tool], store=store))
    assert store.list_runs() == ()
    model = Model()
    runner = model.client().beta.messages.tool_runner(
        model="claude-test", max_tokens=64, tools=[sync_tool],
        messages=[{"role": "user", "content": "pay"}])
    ledger = MessageToolLedger.open("t", store=MemoryEventStore())
    with pytest.raises(UnsupportedFeature, match="MCP tools"):
        ledger.attach(runner)
    assert model.requests == []
    assert ledger.controller.version == 1
