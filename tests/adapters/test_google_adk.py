"""The Google ADK adapter (DESIGN §7.4, issue 30), in one process: each field report run
on ADK alone (its ``InMemorySessionService`` and ``Runner``) and through the adapter, the
same agent, a scripted model, tools that append a line to an fsynced file. What ran is
counted from that file; the expected count is what the scenario says must happen (a
confirmed call runs once, a rejected one never), never what a ledger recorded.

The kill -9 rows and the two resumer processes are in test_google_adk_durability.py.
Under CI a missing ``google-adk`` package fails this module instead of skipping it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

try:
    import google.adk  # noqa: F401
except ImportError:  # pragma: no cover - CI installs the extra
    if os.environ.get("CI"):
        raise
    pytest.skip("google-adk is not installed (pip install -e '.[google-adk]')",
                allow_module_level=True)

from google.adk.agents import LlmAgent, LoopAgent, ParallelAgent, SequentialAgent
from google.adk.code_executors.unsafe_local_code_executor import UnsafeLocalCodeExecutor
from google.adk.plugins.base_plugin import BasePlugin
from google.adk.plugins.multimodal_tool_results_plugin import MultimodalToolResultsPlugin
from google.adk.sessions import InMemorySessionService
from google.adk.sessions.base_session_service import BaseSessionService
from google.adk.tools.agent_tool import AgentTool
from google.adk.tools.mcp_tool import McpToolset
from google.adk.tools.mcp_tool.mcp_session_manager import StdioConnectionParams
from mcp import StdioServerParameters

from statemachine import (
    ConcurrencyConflict,
    InvalidTransition,
    Resolution,
    RunController,
    SQLiteEventStore,
    ToolInDoubt,
    operator,
)
from statemachine.adapters.google_adk import (
    LedgerPlugin,
    OneWriterSessionService,
    UnsupportedFeature,
    confirmation,
)
from statemachine.errors import RunNotFound
from statemachine.stores import EventStore
from statemachine.values import Phase, Step
from statemachine.verifiers import Completed, NotExecuted, Unknown
from tests.adapters.dying import Crash
from tests.drivers import adk_driver as world
from tests.drivers.adk_driver import (
    APP,
    RUN,
    SESSION,
    USER,
    Call,
    DieBeforeAppend,
    ScriptedModel,
    build,
    confirmation_requests,
    effects,
    response,
    run,
    text,
)

logging.getLogger("google_adk").setLevel(logging.ERROR)
CHARGE: Call = ("c1", "charge", {"amount": 5})


class World:
    """One scenario's world: the effects file, and ADK's runner alone or through the
    ledger (a `LedgerPlugin` on a SQLite store, `OneWriterSessionService` around the
    session service, its appends the ledger's publications unless ``publications`` is
    False; ``ledger`` makes the plugin from the store)."""

    def __init__(self, folder: Path, mode: str, script: list[Call], tools: list[str], *,
                 service: BaseSessionService | None = None, resumable: bool = False,
                 verifiers: dict[str, Any] | None = None,
                 store: EventStore | None = None, before: Sequence[BasePlugin] = (),
                 after: Sequence[BasePlugin] = (), publications: bool = True,
                 ledger: Callable[..., LedgerPlugin] = LedgerPlugin) -> None:
        self.effects = folder / "effects.txt"
        self.store = store if store is not None else SQLiteEventStore(
            str(folder / "ledger.db"))
        if isinstance(service, OneWriterSessionService):  # another runner's: its inner
            service = service.service
        inner = service if service is not None else InMemorySessionService()
        self.plugin: LedgerPlugin | None = None
        plugins = list(before)  # test plugins around the ledger, which goes first
        if mode == "ledger":
            self.plugin = ledger(self.store, verifiers=verifiers)
            plugins.append(self.plugin)
            inner = OneWriterSessionService(inner,
                                            plugin=self.plugin if publications else None)
        self.runner, self.service, self.model = build(self.effects, script, tools=tools,
                                                      service=inner,
                                                      plugins=[*plugins, *after],
                                                      resumable=resumable)

    async def open(self) -> None:
        await self.service.create_session(app_name=APP, user_id=USER, session_id=SESSION)

    def ran(self) -> list[str]:
        return effects(self.effects)

    async def responses(self) -> list[str]:
        """The function response ids in the stored session, in order."""
        session = await self.service.get_session(app_name=APP, user_id=USER,
                                                 session_id=SESSION)
        assert session is not None
        return [str(r.id) for e in session.events for r in e.get_function_responses()]


class LosesAppend(DieBeforeAppend):
    """The first ``times`` appends of a tool's function responses raise (a user's
    confirmation is written); ``landed``: after writing it (commit-then-raise), else
    before (nothing written)."""

    def __init__(self, service: BaseSessionService, *, landed: bool, times: int = 1) -> None:
        super().__init__(service)
        self.landed = landed
        self.times = times

    async def append_event(self, session: Any, event: Any) -> Any:
        if event.get_function_responses() and event.author != "user" and self.times:
            self.times -= 1
            if self.landed:
                await self.service.append_event(session, event)
            raise OSError("the append's acknowledgement was lost")
        return await self.service.append_event(session, event)


async def _noting(runner: Any, seen: list[str]) -> None:
    """One run of ``"go"``, noting each event's invocation id in ``seen`` (to resume it
    after the run raised)."""
    async for event in runner.run_async(user_id=USER, session_id=SESSION,
                                        new_message=text("go")):
        seen.append(event.invocation_id)


# --------------------------------------------------------------------- field reports


@pytest.mark.invariant("I1", "I3", "I7", "I12")
@pytest.mark.parametrize("landed", [False, True], ids=["append-not-written",
                                                       "append-written-then-raised"])
@pytest.mark.parametrize("mode", ["alone", "ledger"])
def test_a_resumed_invocation_after_a_failed_append_reruns_the_tool_alone_only(
        tmp_path: Path, mode: str, landed: bool) -> None:
    """PR #6733 / #5064's shape: the function response's append raises, the invocation
    is resumed. ADK alone runs the charge again when nothing was written (measured: 2);
    through the ledger it ran once, and the session holds its response exactly once."""
    w = World(tmp_path, mode, [CHARGE], ["charge"],
              service=LosesAppend(InMemorySessionService(), landed=landed), resumable=True)

    async def scenario() -> None:
        await w.open()
        seen: list[str] = []
        with pytest.raises(OSError, match="acknowledgement was lost"):  # I6: its own error
            await _noting(w.runner, seen)
        await run(w.runner, None, invocation_id=seen[-1])
        assert await w.responses() == ["c1"]  # I3: one copy

    asyncio.run(scenario())
    expected = 2 if mode == "alone" and not landed else 1
    assert w.ran() == ["charge 5"] * expected
    if mode == "ledger":
        c = RunController.load(w.store, RUN)
        assert c.phase("c1") is Phase.PUBLISHED


@pytest.mark.invariant("I1", "I7")
@pytest.mark.parametrize("mode", ["alone", "ledger"])
def test_two_concurrent_resumes_of_one_confirmation_run_the_tool_twice_alone_only(
        tmp_path: Path, mode: str) -> None:
    """#4751: two resumes of the same confirmation at once. ADK alone runs the wire twice
    (measured); through the adapter one goes on, the other gets `ConcurrencyConflict`."""
    w = World(tmp_path, mode, [("w1", "wire", {"amount": 7})], ["wire"])

    async def scenario() -> list[Any]:
        await w.open()
        asked = confirmation_requests(await run(w.runner, text("go")))
        request, payload = asked["w1"]
        message = response(request, "adk_request_confirmation",
                           {"confirmed": True, "payload": payload})
        outcomes: list[Any] = await asyncio.gather(
            run(w.runner, message), run(w.runner, message), return_exceptions=True)
        return outcomes

    outcomes = asyncio.run(scenario())
    if mode == "alone":
        assert w.ran() == ["wire 7", "wire 7"]
    else:
        assert w.ran() == ["wire 7"]
        assert [type(o) for o in outcomes].count(ConcurrencyConflict) == 1


def _says(events: list[Any], words: str) -> bool:
    """Whether the agent said ``words`` among ``events``."""
    return any(part.text == words for event in events if event.content
               for part in event.content.parts or ())


@pytest.mark.invariant("I1", "I12")
@pytest.mark.parametrize("resumed", [False, True], ids=["new-invocations", "resumed-sse"])
@pytest.mark.parametrize("mode", ["alone", "ledger"])
def test_finishing_one_long_running_tool_never_reruns_another(tmp_path: Path, mode: str,
                                                              resumed: bool) -> None:
    """#5450 (reported on google-adk 1.31): several long-running renders in flight (each
    started, its result to come from the client); the client sent one's result, and ADK
    ran the others again. Here the client finishes each in turn, then sends the first
    one's result again, as new invocations or resuming the paused one
    (``invocation_id``) with SSE streaming: each render started once, and the model
    answered every message (new invocations) or once every result was in (the resumed
    invocation waits for all of them), through the adapter and on ADK 2.13 alone too
    (measured: 2.13 no longer shows the report, so this side has no differential)."""
    w = World(tmp_path, mode, [("r1", "render", {"shot": 1}), ("r2", "render", {"shot": 2}),
                               ("r3", "render", {"shot": 3})], ["render"],
              resumable=resumed)

    async def scenario() -> list[bool]:
        await w.open()
        paused = await run(w.runner, text("go"), streaming=resumed)
        invocation = paused[-1].invocation_id if resumed else None
        answers = [_says(paused, "done")]
        for call_id in ("r1", "r2", "r3", "r1"):
            answered = await run(w.runner, response(call_id, "render", {"status": "done"}),
                                 invocation_id=invocation, streaming=resumed)
            answers.append(_says(answered, "done"))
        return answers

    waits = [False, False] if resumed else [True, True]  # while r3 is still running
    assert asyncio.run(scenario()) == [False, *waits, True, True]
    assert sorted(w.ran()) == ["render 1", "render 2", "render 3"]
    if mode == "ledger":  # each body's return recorded: none left in doubt
        c = RunController.load(w.store, RUN)
        assert c.in_doubt() == ()
        assert {c.phase(f"r{n}") for n in (1, 2, 3)} <= {Phase.COMPLETED, Phase.PUBLISHED}


@pytest.mark.invariant("I1")
@pytest.mark.parametrize("mode", ["alone", "ledger"])
def test_resuming_a_paused_long_running_call_goes_on_to_the_answer(tmp_path: Path,
                                                                  mode: str) -> None:
    """#5064 (fixed upstream by ADK's PR #5072): a resumable app streaming with SSE
    pauses on a long-running render (started, its result to come); the client resumes
    the invocation with the result, and ADK ended the run there (its pause check
    ignored the matching response). Here the resumed invocation goes on to the model's
    answer and the render started once, through the adapter and on ADK 2.13 alone too
    (measured: no differential)."""
    w = World(tmp_path, mode, [("r1", "render", {"shot": 1})], ["render"], resumable=True)

    async def scenario() -> tuple[bool, bool]:
        await w.open()
        paused = await run(w.runner, text("go"), streaming=True)
        answered = await run(w.runner, response("r1", "render", {"status": "done"}),
                             invocation_id=paused[-1].invocation_id, streaming=True)
        return _says(paused, "done"), _says(answered, "done")

    assert asyncio.run(scenario()) == (False, True)  # paused, then the answer
    assert w.ran() == ["render 1"]
    if mode == "ledger":  # the result the client sent is the call's publication
        assert RunController.load(w.store, RUN).phase("r1") is Phase.PUBLISHED


@pytest.mark.invariant("I1", "I12")
@pytest.mark.parametrize("mode", ["alone", "ledger"])
def test_a_caller_stopping_at_the_confirmation_request_loses_no_sibling_response(
        tmp_path: Path, mode: str) -> None:
    """PR #6733's shape: a charge and a wire needing a confirmation in one response; the
    caller stops reading the events at the confirmation request (as a server waiting
    for the user does). The PR reports that the merged function responses came after
    the request, so the charge's response was never saved and a resume ran the charge
    again. On ADK 2.13 they come before it (measured), alone and through the adapter:
    the charge's response is in the session when the caller stops, the confirmation
    runs the wire once, the charge never again, and the run goes on to its answer."""
    w = World(tmp_path, mode, [CHARGE, ("w1", "wire", {"amount": 7})], ["charge", "wire"])

    async def scenario() -> tuple[list[str], bool]:
        await w.open()
        seen: list[Any] = []
        events = w.runner.run_async(user_id=USER, session_id=SESSION,
                                    new_message=text("go"))
        async for event in events:
            seen.append(event)
            if confirmation_requests([event]):
                break  # the caller waits for the user
        await events.aclose()
        saved = await w.responses()
        request, payload = confirmation_requests(seen)["w1"]
        answered = await run(w.runner, response(request, "adk_request_confirmation",
                                                {"confirmed": True, "payload": payload}))
        return saved, _says(answered, "done")

    saved, done = asyncio.run(scenario())
    assert saved == ["c1", "w1"]  # the charge's response, and the wire's placeholder
    assert done
    assert sorted(w.ran()) == ["charge 5", "wire 7"]
    if mode == "ledger":
        c = RunController.load(w.store, RUN)
        assert [c.phase("c1"), c.phase("w1")] == [Phase.PUBLISHED] * 2


@pytest.mark.invariant("I1", "I5")
@pytest.mark.parametrize("mode", ["alone", "ledger"])
def test_a_confirmed_call_runs_once_and_the_run_goes_on(tmp_path: Path, mode: str) -> None:
    """Resuming with the confirmation runs the call once and the run goes on to its
    answer; the same confirmation sent again runs nothing. A sibling that needed no
    confirmation is not run again by the confirmation's resume."""
    w = World(tmp_path, mode, [CHARGE, ("w1", "wire", {"amount": 7})], ["charge", "wire"])

    async def scenario() -> list[Any]:
        await w.open()
        asked = confirmation_requests(await run(w.runner, text("go")))
        request, payload = asked["w1"]
        message = response(request, "adk_request_confirmation",
                           {"confirmed": True, "payload": payload})
        answered = await run(w.runner, message)
        await run(w.runner, message)
        return answered

    answered = asyncio.run(scenario())
    assert sorted(w.ran()) == ["charge 5", "wire 7"]
    assert any(part.text == "done" for event in answered if event.content
               for part in event.content.parts or ())
    if mode == "ledger":
        c = RunController.load(w.store, RUN)
        assert c.call("w1").decisions[-1].kind == "approved"
        assert c.call("w1").decisions[-1].by == "adk:confirmation"


@pytest.mark.invariant("I1", "I5")
@pytest.mark.parametrize(("mode", "resumable"), [
    pytest.param(mode, resumable, id=f"{mode}-{'resumable' if resumable else 'not-resumable'}")
    for mode in ("alone", "ledger") for resumable in (False, True)])
def test_a_confirmation_pause_asks_the_model_nothing(tmp_path: Path, mode: str,
                                                     resumable: bool) -> None:
    """ADK's own gate marks the answer of a call awaiting its confirmation as nothing for
    the model to summarize ("without this the flow re-invokes the model, which calls the
    tool again"). The ledger answers that call itself (the request carries the call's
    fingerprint), and in an app that is not resumable the flow then asked the model
    again, the placeholder as the call's result (measured: 2 requests at the pause).
    Alone and through the adapter: one request (the reply) until the confirmation, one
    after it, the wire run once."""
    w = World(tmp_path, mode, [("w1", "wire", {"amount": 7})], ["wire"],
              resumable=resumable)

    async def scenario() -> tuple[int, bool, int, bool]:
        await w.open()
        paused = await run(w.runner, text("go"))
        asked = w.model.requests
        request, payload = confirmation_requests(paused)["w1"]
        answered = await run(w.runner, response(request, "adk_request_confirmation",
                                                {"confirmed": True, "payload": payload}))
        return asked, _says(paused, "done"), w.model.requests - asked, _says(answered,
                                                                             "done")

    assert asyncio.run(scenario()) == (1, False, 1, True)
    assert w.ran() == ["wire 7"]


@pytest.mark.invariant("I1", "I5")
@pytest.mark.parametrize("mode", ["alone", "ledger"])
def test_a_confirmation_showing_another_calls_fingerprint_is_refused(tmp_path: Path,
                                                                    mode: str) -> None:
    """PR #5545: resumed calls not tied to the call that was shown. Two wires, 7 and 700;
    the human confirms what the first request showed, sent as the answer to the second.
    ADK alone wires 700 (measured); through the adapter the confirmation does not carry
    the 700 call's fingerprint and is refused: nothing ran, nothing recorded."""
    w = World(tmp_path, mode, [("w1", "wire", {"amount": 7}),
                               ("w2", "wire", {"amount": 700})], ["wire"])

    async def scenario() -> None:
        await w.open()
        asked = confirmation_requests(await run(w.runner, text("go")))
        _, shown = asked["w1"]
        request, _ = asked["w2"]
        message = response(request, "adk_request_confirmation",
                           {"confirmed": True, "payload": shown})
        if mode == "alone":
            await run(w.runner, message)
            return
        before = RunController.load(w.store, RUN).events
        with pytest.raises(InvalidTransition, match="fingerprint"):
            await run(w.runner, message)
        assert RunController.load(w.store, RUN).events[len(before):] == ()
        assert RunController.load(w.store, RUN).phase("w2") is Phase.AWAITING

    asyncio.run(scenario())
    assert w.ran() == (["wire 700"] if mode == "alone" else [])


@pytest.mark.invariant("I1", "I5")
@pytest.mark.parametrize("awaits", [True, False], ids=["awaiting-callable", "static"])
@pytest.mark.parametrize("mode", ["alone", "ledger"])
def test_parallel_calls_confirmed_in_one_message_each_ask_and_run_once(
        tmp_path: Path, mode: str, awaits: bool) -> None:
    """Two wires in one model response, each needing a confirmation, both confirmed in
    one message. ADK runs the calls' callbacks as tasks of one event loop: with an async
    ``require_confirmation`` callable that awaits they interleave there (the adapter,
    holding a thread's lock across that await, entered the batch twice and was refused
    the second time); with ``require_confirmation=True`` the first confirmed call to
    start moved the run on, and the second confirmation was refused. Each call is asked
    about once (two requests), each wire runs once and the run goes on to its answer,
    alone and through the adapter alike."""
    from google.adk.tools.function_tool import FunctionTool
    from google.genai import types

    w = World(tmp_path, mode, [("w1", "wire", {"amount": 7}),
                               ("w2", "wire", {"amount": 8})], [])

    async def needs(amount: int) -> bool:
        await asyncio.sleep(0)  # the other call's callbacks run here
        return amount > 0

    def wire(amount: int) -> dict[str, Any]:
        """Wire money."""
        world.effect(w.effects, f"wire {amount}")
        return {"wired": amount}

    agent = w.runner.agent
    assert isinstance(agent, LlmAgent)
    require: Any = needs if awaits else True  # ADK awaits a coroutine callable's answer
    agent.tools.append(FunctionTool(wire, require_confirmation=require))

    async def scenario() -> tuple[list[str], list[Any]]:
        await w.open()
        first = await run(w.runner, text("go"))
        requests = [call.args["originalFunctionCall"]["id"] for e in first
                    for call in e.get_function_calls()
                    if call.name == "adk_request_confirmation" and call.args]
        asked = confirmation_requests(first)
        parts = [part for request, payload in asked.values() for part in response(
            request, "adk_request_confirmation",
            {"confirmed": True, "payload": payload}).parts or ()]
        answered = await run(w.runner, types.Content(role="user", parts=parts))
        return requests, answered

    requests, answered = asyncio.run(scenario())
    assert sorted(requests) == ["w1", "w2"]  # one request per call
    assert sorted(w.ran()) == ["wire 7", "wire 8"]
    assert any(part.text == "done" for event in answered if event.content
               for part in event.content.parts or ())
    if mode == "ledger":
        c = RunController.load(w.store, RUN)
        assert [c.phase(i) for i in ("w1", "w2")] == [Phase.PUBLISHED] * 2


# ------------------------------------------------------------------- the ledger's rules


@pytest.mark.parametrize("publications", [True, False],
                         ids=["publications", "no-publications"])
def test_the_confirmation_request_shows_the_fingerprint_and_a_rejection_never_runs(
        tmp_path: Path, publications: bool) -> None:
    """The request carries the call's fingerprint, and the call awaiting it is durable
    when the invocation ends there (the operator's inbox, read from the store, lists
    it); a rejection never runs the call."""
    w = World(tmp_path, "ledger", [("w1", "wire", {"amount": 7})], ["wire"],
              publications=publications)

    async def scenario() -> None:
        await w.open()
        asked = confirmation_requests(await run(w.runner, text("go")))
        request, payload = asked["w1"]
        c = RunController.load(w.store, RUN)
        assert payload == {"fingerprint": c.fingerprint("w1")}
        (item,) = operator.inbox(w.store)
        assert item.run_id == RUN
        assert item.call_id == "w1"
        assert item.fingerprint == c.fingerprint("w1")
        await run(w.runner, confirmation(request, fingerprint=payload["fingerprint"],
                                         confirmed=False))

    asyncio.run(scenario())
    assert w.ran() == []
    c = RunController.load(w.store, RUN)
    assert c.call("w1").decisions[-1].kind == "rejected"
    assert operator.inbox(w.store) == []


def test_a_decision_through_the_operator_is_honoured_and_a_contradiction_refused(
        tmp_path: Path) -> None:
    """``statemachine.operator.approve`` (or the CLI) decides the call; the confirmation
    that lets ADK go on must agree with it."""
    w = World(tmp_path, "ledger", [("w1", "wire", {"amount": 7})], ["wire"])
    assert w.plugin is not None

    async def scenario() -> None:
        await w.open()
        asked = confirmation_requests(await run(w.runner, text("go")))
        request, payload = asked["w1"]
        operator.approve(w.store, RUN, "w1", fingerprint=payload["fingerprint"], by="ops")
        with pytest.raises(InvalidTransition, match="decided otherwise"):
            await run(w.runner, confirmation(request, fingerprint=payload["fingerprint"],
                                             confirmed=False))
        assert w.ran() == []
        await run(w.runner, confirmation(request, fingerprint=payload["fingerprint"]))

    asyncio.run(scenario())
    assert w.ran() == ["wire 7"]
    (run_head,) = operator.runs(w.store)
    assert run_head.run_id == RUN


def test_the_body_sees_its_idempotency_key(tmp_path: Path) -> None:
    w = World(tmp_path, "ledger", [CHARGE], ["charge"])
    world.KEYS.clear()

    async def scenario() -> None:
        await w.open()
        await run(w.runner, text("go"))

    asyncio.run(scenario())
    assert [RunController.load(w.store, RUN).idempotency_key("c1")] == world.KEYS


@pytest.mark.invariant("I1", "I12")
def test_a_tool_that_raised_is_answered_from_the_ledger_when_resumed(tmp_path: Path) -> None:
    """The body's exception propagates as with ADK alone and is recorded as the call's
    error: the resumed invocation answers with it, never running the body again."""
    w = World(tmp_path, "ledger", [("r1", "refund", {"amount": -1})], ["refund"],
              resumable=True)

    async def scenario() -> None:
        await w.open()
        seen: list[str] = []
        with pytest.raises(ValueError, match="negative refund"):
            await _noting(w.runner, seen)
        await run(w.runner, None, invocation_id=seen[-1])

    asyncio.run(scenario())
    assert w.ran() == ["refund -1"]
    c = RunController.load(w.store, RUN)
    assert c.call("r1").result == {"error": "ValueError: negative refund"}


class _DeclinesToolErrors(BasePlugin):
    """A plugin after the ledger whose ``on_tool_error_callback`` looks at a tool's error
    (counted) and leaves it to the next callback."""

    def __init__(self, seen: list[str]) -> None:
        super().__init__(name="declines_tool_errors")
        self.seen = seen

    async def on_tool_error_callback(self, *, tool: Any, tool_args: dict[str, Any],
                                     tool_context: Any, error: Exception) -> Any:
        self.seen.append(f"plugin {tool_context.function_call_id}")
        return None


@pytest.mark.invariant("I1", "I12")
@pytest.mark.parametrize("mode", ["alone", "ledger"])
def test_error_callbacks_that_answer_nothing_run_once(tmp_path: Path, mode: str) -> None:
    """A body raises; a plugin after the ledger and the agent's ``on_tool_error_callback``
    each look at the error and answer nothing. With ADK alone each runs once and the
    error propagates; through the ledger the same (measured before: each ran twice, the
    ledger running ADK's chain after it to learn whether anyone answered, and ADK then
    running it again), and the error is the call's recorded result."""
    seen: list[str] = []
    w = World(tmp_path, mode, [("r1", "refund", {"amount": -1})], ["refund"],
              after=[_DeclinesToolErrors(seen)])

    def looks(tool: Any, args: Any, tool_context: Any, error: Exception) -> Any:
        seen.append(f"agent {tool_context.function_call_id} {type(error).__name__}")
        return None

    agent = w.runner.agent
    assert isinstance(agent, LlmAgent)
    agent.on_tool_error_callback = looks

    async def scenario() -> None:
        await w.open()
        with pytest.raises(ValueError, match="negative refund"):
            await run(w.runner, text("go"))

    asyncio.run(scenario())
    assert w.ran() == ["refund -1"]
    assert seen == ["plugin r1", "agent r1 ValueError"]
    if mode == "ledger":
        c = RunController.load(w.store, RUN)
        assert c.call("r1").result == {"error": "ValueError: negative refund"}


@pytest.mark.invariant("I1", "I12")
@pytest.mark.parametrize("then", ["answers", "declines"])
def test_an_error_escaping_one_run_settles_only_that_runs_calls(tmp_path: Path,
                                                                then: str) -> None:
    """Two sessions on one runner (one plugin), each calling ``refund`` with the same
    call id, whose body raises. Session s2's error callback is still deciding when s1's
    error (nothing answered it) escapes its agent; then it answers, or declines too. s1's
    call is recorded with its error; s2's with the answer its callback made (what its
    model was given), or, declined, with its own error once that escapes in turn; each
    body ran once: the escape of one run's error settles that run's calls alone."""
    w = World(tmp_path, "ledger", [("r1", "refund", {"amount": -1})], ["refund"])
    deciding, decided = asyncio.Event(), asyncio.Event()
    answer = {"refund": "declined, sent to a person"}

    async def decides_on_s2(tool: Any, args: Any, tool_context: Any,
                            error: Exception) -> Any:
        if tool_context.session.id != "s2":
            return None
        deciding.set()
        await decided.wait()
        return answer if then == "answers" else None

    agent = w.runner.agent
    assert isinstance(agent, LlmAgent)
    agent.on_tool_error_callback = decides_on_s2

    async def scenario() -> None:
        await w.open()
        await w.service.create_session(app_name=APP, user_id=USER, session_id="s2")
        second = asyncio.create_task(run(w.runner, text("go"), session="s2"))
        await deciding.wait()
        with pytest.raises(ValueError, match="negative refund"):
            await run(w.runner, text("go"))
        decided.set()
        if then == "answers":
            assert _says(await second, "done")
        else:
            with pytest.raises(ValueError, match="negative refund"):
                await second

    asyncio.run(scenario())
    assert w.ran() == ["refund -1", "refund -1"]
    first = RunController.load(w.store, RUN)
    assert first.call("r1").result == {"error": "ValueError: negative refund"}
    other = RunController.load(w.store, RUN.replace(SESSION, "s2"))
    assert other.call("r1").result == (
        answer if then == "answers" else {"error": "ValueError: negative refund"})


@pytest.mark.invariant("I11")
def test_a_call_in_doubt_refuses_the_run_until_the_operator_resolves_it(
        tmp_path: Path) -> None:
    """A start made durable with no result (the process died in the body: here its
    record is left so by a run stopped in the body) refuses every run with `ToolInDoubt`
    before anything runs; ``operator.resolve`` lets the agent go on with its output."""
    w = World(tmp_path, "ledger", [CHARGE], ["charge"], resumable=True)
    assert w.plugin is not None
    plugin = w.plugin

    async def scenario() -> None:
        await w.open()
        world.KILL["point"] = "before-effect"
        try:
            with pytest.raises(StopInBody):
                await _noting(w.runner, [])
        finally:
            world.KILL["point"] = ""
        plugin.forget()  # a fresh process: the store's record only
        with pytest.raises(ToolInDoubt):
            await run(w.runner, text("again"))
        assert w.ran() == []
        operator.resolve(w.store, RUN, "c1", outcome=Resolution.COMPLETED,
                         output={"charged": 5}, by="ops", evidence="pay_1")
        plugin.forget()
        session = await w.service.get_session(app_name=APP, user_id=USER,
                                              session_id=SESSION)
        assert session is not None
        invocation = next(e.invocation_id for e in session.events if e.get_function_calls())
        answered = await run(w.runner, None, invocation_id=invocation)
        assert any(r.response == {"charged": 5} for e in answered
                   for r in e.get_function_responses())

    asyncio.run(scenario())
    assert w.ran() == []  # the operator's word: the body never ran
    assert RunController.load(w.store, RUN).phase("c1") is Phase.PUBLISHED


@pytest.mark.invariant("I1", "I11")
@pytest.mark.parametrize(("mode", "settle"), [("alone", ""), ("ledger", "operator"),
                                              ("ledger", "verifier")])
def test_a_cancelled_body_leaves_its_call_in_doubt_until_it_is_settled(
        tmp_path: Path, mode: str, settle: str) -> None:
    """The charge's body makes its effect and is cancelled before it returns (the task
    running the invocation is cancelled: a client gone, a timeout). ADK alone, resumed,
    charges again (2). Through the adapter the call is in doubt: the next run of the
    invocation is refused with `ToolInDoubt`, in the same process and in a fresh one,
    nothing run; once the operator records the charge the run goes on with that word.
    With a verifier, the next run in the same process asks it (as a fresh process
    would) and goes on with its answer. The body never runs again (1)."""
    from google.adk.tools.function_tool import FunctionTool

    asked: list[str] = []

    def verify(context: Any) -> Any:
        asked.append(context.call_id)
        return Completed({"charged": 5})

    w = World(tmp_path, mode, [("c1", "slow_charge", {"amount": 5})], [], resumable=True,
              verifiers={"slow_charge": verify} if settle == "verifier" else None)
    inside = asyncio.Event()

    async def slow_charge(amount: int) -> dict[str, Any]:
        """Charge a card, then wait for the bank's slow acknowledgement."""
        world.effect(w.effects, f"charge {amount}")
        inside.set()
        await asyncio.Event().wait()  # never set: only a cancellation ends it
        return {"charged": amount}

    agent = w.runner.agent
    assert isinstance(agent, LlmAgent)
    agent.tools.append(FunctionTool(slow_charge))

    async def inside_of(task: asyncio.Task[Any]) -> None:
        """Until the body is inside its wait (a run that ends first fails the test)."""
        waiting = asyncio.create_task(inside.wait())
        await asyncio.wait({task, waiting}, return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        assert inside.is_set(), task.result()

    async def scenario() -> None:
        await w.open()
        first = asyncio.create_task(_noting(w.runner, []))
        await inside_of(first)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        assert w.ran() == ["charge 5"]
        session = await w.service.get_session(app_name=APP, user_id=USER,
                                              session_id=SESSION)
        assert session is not None
        invocation = next(e.invocation_id for e in session.events if e.get_function_calls())
        if mode == "alone":
            inside.clear()
            again = asyncio.create_task(run(w.runner, None, invocation_id=invocation))
            await inside_of(again)  # the body runs again
            again.cancel()
            with pytest.raises(asyncio.CancelledError):
                await again
            return
        assert w.plugin is not None
        if settle == "verifier":  # this process asks it, as a fresh one would
            answered = await run(w.runner, None, invocation_id=invocation)
            assert [r.response for e in answered for r in e.get_function_responses()] == [
                {"charged": 5}]
            assert asked == ["c1"]
            view = RunController.load(w.store, RUN).call("c1")
            assert (view.phase, view.decisions[-1].by) == (
                Phase.PUBLISHED, "verify:slow_charge")
            return
        with pytest.raises(ToolInDoubt):  # this process: no longer held in flight
            await run(w.runner, None, invocation_id=invocation)
        w.plugin.forget()  # a fresh process: the store's record only
        with pytest.raises(ToolInDoubt):
            await run(w.runner, None, invocation_id=invocation)
        assert RunController.load(w.store, RUN).phase("c1") is Phase.STARTED
        operator.resolve(w.store, RUN, "c1", outcome=Resolution.COMPLETED,
                         output={"charged": 5}, by="ops", evidence="bank statement")
        answered = await run(w.runner, None, invocation_id=invocation)
        assert any(r.response == {"charged": 5} for e in answered
                   for r in e.get_function_responses())
        assert RunController.load(w.store, RUN).phase("c1") is Phase.PUBLISHED

    asyncio.run(scenario())
    assert w.ran() == ["charge 5"] * (2 if mode == "alone" else 1)


def _fingerprint(name: str, arguments: dict[str, Any]) -> str:
    """A call's fingerprint as DESIGN §3.1 defines it: sha256 of the canonical JSON of
    ``[name, arguments]`` (sorted keys, no spaces)."""
    text = json.dumps([name, arguments], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


async def _stopped_in_body(w: World, point: str) -> str:
    """Run ``"go"`` with the process stopping inside the charge's body at ``point`` (its
    start durable, no result); forget the plugin's copy, as a fresh process holds only
    the store's record. The invocation the stop left."""
    await w.open()
    world.KILL["point"] = point
    try:
        with pytest.raises(StopInBody):
            await _noting(w.runner, [])
    finally:
        world.KILL["point"] = ""
    assert w.plugin is not None
    w.plugin.forget()
    session = await w.service.get_session(app_name=APP, user_id=USER, session_id=SESSION)
    assert session is not None
    return next(e.invocation_id for e in session.events if e.get_function_calls())


def _cli(*args: str) -> str:
    """``statemachine ARGS`` in its own process; its output (it must exit 0)."""
    done = subprocess.run([sys.executable, "-m", "statemachine", *args], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, (args, done.stdout, done.stderr)
    return done.stdout


@pytest.mark.invariant("I1", "I11")
def test_the_operator_settles_an_adk_call_in_doubt_from_the_shell(tmp_path: Path) -> None:
    """The process stopped inside the charge after its effect. ``statemachine inbox
    --store`` lists the call in doubt with its tool, arguments and fingerprint; the
    run is refused (`ToolInDoubt`) until ``statemachine resolve --store`` records the
    charge, and the resumed invocation then goes on with that output to the model's
    answer: one charge, never run again."""
    w = World(tmp_path, "ledger", [CHARGE], ["charge"], resumable=True)
    db = str(tmp_path / "ledger.db")

    async def refused(invocation: str) -> None:
        with pytest.raises(ToolInDoubt):
            await run(w.runner, None, invocation_id=invocation)

    invocation = asyncio.run(_stopped_in_body(w, "after-effect"))
    asyncio.run(refused(invocation))
    (waiting,) = json.loads(_cli("inbox", "--store", db, "--json"))
    assert (waiting["run_id"], waiting["call_id"], waiting["kind"], waiting["tool"]) == (
        RUN, "c1", "in_doubt", "charge")
    assert json.loads(waiting["arguments"]) == {"amount": 5}
    assert waiting["fingerprint"] == _fingerprint("charge", {"amount": 5})
    _cli("resolve", RUN, "c1", "--store", db, "--by", "ops", "--completed",
         '{"charged": 5}', "--evidence", "pay_1")
    assert json.loads(_cli("inbox", "--store", db, "--json")) == []

    async def resumed() -> list[Any]:
        return await run(w.runner, None, invocation_id=invocation)

    answered = asyncio.run(resumed())
    assert [r.response for e in answered for r in e.get_function_responses()] == [
        {"charged": 5}]
    assert _says(answered, "done")
    assert w.ran() == ["charge 5"]
    c = RunController.load(w.store, RUN)
    assert c.phase("c1") is Phase.PUBLISHED
    assert c.call("c1").decisions[-1].by == "ops"


@pytest.mark.postgres
@pytest.mark.invariant("I1", "I11")
def test_the_plugin_on_postgresql_refuses_doubt_in_another_process_and_goes_on(
        tmp_path: Path, pg_dsn: str, pg_schema: str) -> None:
    """The plugin on the PostgreSQL store: the process stops inside the charge before
    its effect; a second plugin on its own connection (another process's) is refused
    (`ToolInDoubt`), nothing run; the operator's inbox on PostgreSQL shows the call with
    its tool and fingerprint; once the operator records the charge as not executed, the
    resumed invocation runs it once and goes on to the model's answer."""
    from statemachine.postgres import PostgresEventStore

    with PostgresEventStore(pg_dsn, schema=pg_schema) as first, \
            PostgresEventStore(pg_dsn, schema=pg_schema) as second:
        dying = World(tmp_path, "ledger", [CHARGE], ["charge"], resumable=True,
                      store=first)
        invocation = asyncio.run(_stopped_in_body(dying, "before-effect"))
        other = World(tmp_path, "ledger", [CHARGE], ["charge"], resumable=True,
                      store=second, service=dying.service)

        async def refused() -> None:
            with pytest.raises(ToolInDoubt):
                await run(other.runner, None, invocation_id=invocation)

        asyncio.run(refused())
        assert other.ran() == []
        (waiting,) = operator.inbox(second)
        assert (waiting.call_id, waiting.kind, waiting.tool, waiting.fingerprint) == (
            "c1", "in_doubt", "charge", _fingerprint("charge", {"amount": 5}))
        operator.resolve(second, RUN, "c1", outcome=Resolution.NOT_EXECUTED, by="ops")

        async def resumed() -> list[Any]:
            return await run(other.runner, None, invocation_id=invocation)

        answered = asyncio.run(resumed())
        assert [r.response for e in answered for r in e.get_function_responses()] == [
            {"charged": 5}]
        assert _says(answered, "done")
        assert other.ran() == ["charge 5"]
        assert RunController.load(first, RUN).phase("c1") is Phase.PUBLISHED


@pytest.mark.invariant("I11")
@pytest.mark.parametrize("answer", ["completed", "not-executed", "unknown"])
def test_a_verifier_settles_a_call_in_doubt_when_the_run_is_claimed(
        tmp_path: Path, answer: str) -> None:
    """The process died in the body (its start durable, no result): the next run's claim
    asks the tool's verifier (DESIGN §7.3). `Completed`: its output is the call's result
    and the body never runs; `NotExecuted`: the body runs once; `Unknown`: the call stays
    in doubt and the run is refused (`ToolInDoubt`), nothing run."""
    asked: list[str] = []

    def verify(context: Any) -> Any:
        asked.append(context.call_id)
        return {"completed": Completed({"charged": 5}), "not-executed": NotExecuted(),
                "unknown": Unknown()}[answer]

    w = World(tmp_path, "ledger", [CHARGE], ["charge"], resumable=True,
              verifiers={"charge": verify})
    assert w.plugin is not None
    plugin = w.plugin

    async def scenario() -> None:
        await w.open()
        world.KILL["point"] = "before-effect"
        try:
            with pytest.raises(StopInBody):
                await _noting(w.runner, [])
        finally:
            world.KILL["point"] = ""
        assert asked == []  # nothing was in doubt at the first claim
        plugin.forget()  # a fresh process: the store's record only
        session = await w.service.get_session(app_name=APP, user_id=USER,
                                              session_id=SESSION)
        assert session is not None
        invocation = next(e.invocation_id for e in session.events if e.get_function_calls())
        if answer == "unknown":
            with pytest.raises(ToolInDoubt):
                await run(w.runner, None, invocation_id=invocation)
            return
        answered = await run(w.runner, None, invocation_id=invocation)
        responses = [r.response for e in answered for r in e.get_function_responses()]
        if answer == "completed":
            assert {"charged": 5} in responses

    asyncio.run(scenario())
    assert asked == ["c1"]
    # the body: never after Completed or Unknown (the kill came before its effect), once
    # after NotExecuted
    assert len(w.ran()) == (1 if answer == "not-executed" else 0)
    phase = RunController.load(w.store, RUN).phase("c1")
    assert (phase is Phase.STARTED) == (answer == "unknown")


class StopInBody(BaseException):
    """Stands for the process dying inside the body (no result, no error recorded)."""


@pytest.fixture(autouse=True)
def _stop_in_body(monkeypatch: pytest.MonkeyPatch) -> None:
    def die_at(point: str) -> None:
        if world.KILL["point"] == point:
            raise StopInBody(point)

    monkeypatch.setattr(world, "die_at", die_at)


@pytest.mark.invariant("I7")
def test_a_second_writer_of_a_session_is_refused(tmp_path: Path) -> None:
    """`OneWriterSessionService`: an append from a session copy another writer has moved
    past is refused, nothing written."""
    inner = InMemorySessionService()
    service = OneWriterSessionService(inner)

    async def scenario() -> None:
        from google.adk.events.event import Event
        from google.genai import types

        await service.create_session(app_name=APP, user_id=USER, session_id=SESSION)
        first = await service.get_session(app_name=APP, user_id=USER, session_id=SESSION)
        second = await service.get_session(app_name=APP, user_id=USER, session_id=SESSION)
        assert first is not None
        assert second is not None
        await service.append_event(first, Event(author="user", content=types.Content(
            role="user", parts=[types.Part(text="one")])))
        with pytest.raises(ConcurrencyConflict, match="moved on"):
            await service.append_event(second, Event(author="user", content=types.Content(
                role="user", parts=[types.Part(text="two")])))
        stored = await inner.get_session(app_name=APP, user_id=USER, session_id=SESSION)
        assert stored is not None
        assert [(e.content.parts or [])[0].text for e in stored.events if e.content] == ["one"]

    asyncio.run(scenario())


def _events(author: str, *texts: str, at: float | None = None) -> list[Any]:
    """Events of ``author`` saying ``texts`` (stamped ``at``), each with the id
    ``"<first letter>-<text>"``."""
    from google.adk.events.event import Event

    events = [Event(author=author, content=text(value[2:]), id=value) for value in texts]
    if at is not None:
        for event in events:
            event.timestamp = at
    return events


@pytest.mark.invariant("I7")
@pytest.mark.parametrize("first", ["a-one", "z-one"])
@pytest.mark.parametrize("other", ["the-same-service", "another-service-same-timestamp",
                                   "another-service-in-memory-file"])
def test_a_second_writer_of_an_adk_sqlite_session_is_refused(
        tmp_path: Path, other: str, first: str) -> None:
    """On ADK's own ``SqliteSessionService`` (`OneWriterSessionService` reads the stored
    session's last event in one statement): a session copy read before another writer
    appended is refused (`ConcurrencyConflict`, "moved on"), nothing of it written. The
    other writer is this wrapper, or ADK's service on the same file as another process
    would be, appending events stamped with the same time as the copy's last, which
    ADK's own staleness check (by update time) does not see: the last is the one
    appended last, whichever way the ids sort (the copy's last event id sorts before or
    after theirs); ``:memory:``, which the wrapper cannot read itself, is checked
    through ``get_session``."""
    from google.adk.sessions.sqlite_session_service import SqliteSessionService

    path = ":memory:" if other.endswith("in-memory-file") else str(tmp_path / "s.db")
    inner = SqliteSessionService(path)
    service = OneWriterSessionService(inner)
    at = 1_800_000_000.25

    async def scenario() -> list[str]:
        await service.create_session(app_name=APP, user_id=USER, session_id=SESSION)
        ours = await service.get_session(app_name=APP, user_id=USER, session_id=SESSION)
        assert ours is not None
        await service.append_event(ours, _events("user", first, at=at)[0])
        stale = await service.get_session(app_name=APP, user_id=USER, session_id=SESSION)
        assert stale is not None
        writer = (SqliteSessionService(path) if other.startswith("another-service")
                  and not other.endswith("in-memory-file") else service)
        theirs = await writer.get_session(app_name=APP, user_id=USER, session_id=SESSION)
        assert theirs is not None
        for event in _events("user", "m-two", "m-three", at=at):  # (the same time)
            await writer.append_event(theirs, event)
        with pytest.raises(ConcurrencyConflict, match="moved on"):
            await service.append_event(stale, _events("user", "b-mine")[0])
        stored = await inner.get_session(app_name=APP, user_id=USER, session_id=SESSION)
        assert stored is not None
        return [str(part.text) for e in stored.events if e.content
                for part in e.content.parts or ()]

    assert asyncio.run(scenario()) == ["one", "two", "three"]
    assert (service._last_event.path is None) == (path == ":memory:")


class _CountedReads:
    """Counts ADK's ``SqliteSessionService.get_session`` calls (the class's own method,
    patched, so the service still reads as ADK's)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from google.adk.sessions.sqlite_session_service import SqliteSessionService

        self.calls = 0
        read = SqliteSessionService.get_session

        async def counted(service: Any, **options: Any) -> Any:
            self.calls += 1
            return await read(service, **options)

        monkeypatch.setattr(SqliteSessionService, "get_session", counted)


def _reading_otherwise() -> list[type]:
    """ADK's ``SqliteSessionService`` subclassed to read otherwise, one way each: its
    ``get_session``, its connections, its lookup of a session id (here each delegating,
    as a subclass that reads another file, or maps ids, would not)."""
    from google.adk.sessions.sqlite_session_service import SqliteSessionService

    class OwnGetSession(SqliteSessionService):
        async def get_session(self, **options: Any) -> Any:
            return await super().get_session(**options)

    class OwnConnections(SqliteSessionService):
        @contextlib.asynccontextmanager
        async def _get_db_connection(self) -> AsyncIterator[Any]:
            async with super()._get_db_connection() as db:
                yield db

    class OwnSessionIds(SqliteSessionService):
        async def _resolve_session_id(self, db: Any, app_name: str, user_id: str,
                                      session_id: str) -> str:
            return await super()._resolve_session_id(db, app_name, user_id, session_id)

    return [OwnGetSession, OwnConnections, OwnSessionIds]


@pytest.mark.parametrize("publications", [True, False])
def test_a_one_tool_turn_on_adk_sqlite_reads_the_whole_session_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, publications: bool) -> None:
    """The check before each of a turn's four appends reads the last stored event
    itself: ADK's ``get_session`` is asked once in the turn (the runner's own load, as
    ADK alone asks it), not once per append. A subclass that reads otherwise (its own
    ``get_session``, connections or session ids) is asked by every check: its answer is
    the one that counts."""
    from google.adk.sessions.sqlite_session_service import SqliteSessionService

    counted = _CountedReads(monkeypatch)
    outcomes = []
    for kind in (SqliteSessionService, *_reading_otherwise()):
        folder = tmp_path / kind.__name__
        folder.mkdir()
        w = World(folder, "ledger", [CHARGE], ["charge"],
                  service=kind(str(folder / "sessions.db")), publications=publications)

        async def turn(w: World = w) -> int:
            await w.open()
            before = counted.calls
            await run(w.runner, text("go"))
            return counted.calls - before

        outcomes.append((asyncio.run(turn()), w.ran()))
    assert outcomes == [(1, ["charge 5"])] + [(5, ["charge 5"])] * 3


@pytest.mark.invariant("I7")
def test_a_sessions_file_replaced_under_the_check_is_read_anew(tmp_path: Path) -> None:
    """The sessions file is replaced (a restore, ``os.replace``) by one where another
    writer appended, stamped with the time of the copy's last event (so ADK's own
    staleness check, by update time, does not see it): the check reads the file the path
    names now, not the one it first opened, and refuses the stale copy."""
    import shutil

    from google.adk.sessions.sqlite_session_service import SqliteSessionService

    path = tmp_path / "s.db"
    service = OneWriterSessionService(SqliteSessionService(str(path)))
    at = 1_800_000_000.25

    async def scenario() -> list[str]:
        ours = await service.create_session(app_name=APP, user_id=USER, session_id=SESSION)
        await service.append_event(ours, _events("user", "a-one", at=at)[0])
        stale = await service.get_session(app_name=APP, user_id=USER, session_id=SESSION)
        assert stale is not None
        shutil.copy(path, tmp_path / "restored.db")
        other = SqliteSessionService(str(tmp_path / "restored.db"))
        theirs = await other.get_session(app_name=APP, user_id=USER, session_id=SESSION)
        assert theirs is not None
        await other.append_event(theirs, _events("user", "m-two", at=at)[0])
        os.replace(tmp_path / "restored.db", path)
        with pytest.raises(ConcurrencyConflict, match="moved on"):
            await service.append_event(stale, _events("user", "b-mine", at=at)[0])
        stored = await service.get_session(app_name=APP, user_id=USER, session_id=SESSION)
        assert stored is not None
        return [str(e.id) for e in stored.events]

    assert asyncio.run(scenario()) == ["a-one", "m-two"]


def test_the_check_never_waits_for_a_lock_on_the_event_loop(tmp_path: Path) -> None:
    """While another process holds the sessions file's lock, the check's own read does
    not wait for it (its connection's busy timeout is 0: the event loop would stall for
    every session it runs); the service is asked instead, in its own thread, and the
    append lands once the lock is released."""
    from google.adk.sessions.sqlite_session_service import SqliteSessionService

    path = tmp_path / "s.db"
    service = OneWriterSessionService(SqliteSessionService(str(path)))
    release = tmp_path / "release"

    async def scenario() -> tuple[int, list[str]]:
        ours = await service.create_session(app_name=APP, user_id=USER, session_id=SESSION)
        await service.append_event(ours, _events("user", "a-one")[0])
        conn = service._last_event._conn
        assert conn is not None
        [(waits,)] = conn.execute("PRAGMA busy_timeout").fetchall()
        holder = subprocess.Popen(
            [sys.executable, "-c", "import os, sqlite3, sys, time\n"
             f"c = sqlite3.connect({str(path)!r}, isolation_level=None)\n"
             "c.execute('BEGIN EXCLUSIVE'); print('held', flush=True)\n"
             f"while not os.path.exists({str(release)!r}): time.sleep(0.01)\n"
             "c.execute('COMMIT')"], stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout is not None
            assert holder.stdout.readline() == "held\n"
            assert service._last_event.read(ours) is None  # (locked: the service asks)
            appending = asyncio.ensure_future(
                service.append_event(ours, _events("user", "b-two")[0]))
            await asyncio.sleep(0)
            release.touch()
            await appending
        finally:
            release.touch()
            holder.wait()
        stored = await service.get_session(app_name=APP, user_id=USER, session_id=SESSION)
        assert stored is not None
        return waits, [str(e.id) for e in stored.events]

    assert asyncio.run(scenario()) == (0, ["a-one", "b-two"])


class _AnotherWriterFirst(DieBeforeAppend):
    """ADK's ``SqliteSessionService``, where another process appends to the session
    (its own service on the same file) right before this writer's append reaches it:
    after `OneWriterSessionService` checked the session, before the write."""

    def __init__(self, path: Path) -> None:
        from google.adk.sessions.sqlite_session_service import SqliteSessionService

        super().__init__(SqliteSessionService(str(path)))
        self.other = SqliteSessionService(str(path))

    async def append_event(self, session: Any, event: Any) -> Any:
        from google.adk.events.event import Event

        theirs = await self.other.get_session(app_name=APP, user_id=USER,
                                              session_id=SESSION)
        assert theirs is not None
        await self.other.append_event(theirs, Event(author="user", content=text("theirs")))
        return await self.service.append_event(session, event)


@pytest.mark.invariant("I7")
@pytest.mark.parametrize("mode", ["alone", "ledger"])
def test_a_write_the_session_service_finds_stale_is_a_concurrency_conflict(
        tmp_path: Path, mode: str) -> None:
    """Another process appends between `OneWriterSessionService`'s check and the write:
    ADK's ``SqliteSessionService`` refuses the write (``StaleSessionError``); through the
    wrapper that refusal is `ConcurrencyConflict` (what the other of two resumers gets),
    and only the other writer's event is stored."""
    from google.adk.errors import StaleSessionError
    from google.adk.events.event import Event

    inner = _AnotherWriterFirst(tmp_path / "sessions.db")
    service: BaseSessionService = inner if mode == "alone" else OneWriterSessionService(
        inner)

    async def scenario() -> list[str]:
        await service.create_session(app_name=APP, user_id=USER, session_id=SESSION)
        ours = await service.get_session(app_name=APP, user_id=USER, session_id=SESSION)
        assert ours is not None
        refused = StaleSessionError if mode == "alone" else ConcurrencyConflict
        with pytest.raises(refused):
            await service.append_event(ours, Event(author="user", content=text("ours")))
        stored = await inner.other.get_session(app_name=APP, user_id=USER,
                                               session_id=SESSION)
        assert stored is not None
        return [str(part.text) for e in stored.events if e.content
                for part in e.content.parts or ()]

    assert asyncio.run(scenario()) == ["theirs"]


@pytest.mark.invariant("I6", "I12")
def test_a_response_refused_before_it_is_written_leaves_its_publication_failed(
        tmp_path: Path) -> None:
    """While the tool runs, another writer appends to the session; the append of the
    function response is then refused (`ConcurrencyConflict`, session moved on), nothing
    written. The response's publication was staged before the session service was asked
    (the result riding with it), so the ledger holds the result, and the publication is
    recorded failed (DESIGN §2.3: its write ended without landing), not left open."""
    from google.adk.agents import LlmAgent
    from google.adk.apps import App
    from google.adk.events.event import Event
    from google.adk.runners import Runner
    from google.adk.tools.function_tool import FunctionTool
    from google.genai import types

    inner = InMemorySessionService()
    plugin = LedgerPlugin(SQLiteEventStore(str(tmp_path / "ledger.db")))
    service = OneWriterSessionService(inner, plugin=plugin)
    charges: list[int] = []

    async def charge(amount: int) -> dict[str, Any]:
        """Charge a card (meanwhile another writer appends to the session)."""
        charges.append(amount)
        stored = await inner.get_session(app_name=APP, user_id=USER, session_id=SESSION)
        assert stored is not None
        await inner.append_event(stored, Event(author="user", content=types.Content(
            role="user", parts=[types.Part(text="meanwhile")])))
        return {"charged": amount}

    agent = LlmAgent(name="agent", model=ScriptedModel(script=[CHARGE]),
                     tools=[FunctionTool(charge)])
    runner = Runner(app=App(name=APP, root_agent=agent, plugins=[plugin]),
                    session_service=service)

    async def scenario() -> list[str]:
        await service.create_session(app_name=APP, user_id=USER, session_id=SESSION)
        with pytest.raises(ConcurrencyConflict, match="moved on"):
            await run(runner, text("go"))
        stored = await inner.get_session(app_name=APP, user_id=USER, session_id=SESSION)
        assert stored is not None
        return [str(r.id) for e in stored.events for r in e.get_function_responses()]

    assert asyncio.run(scenario()) == []
    assert charges == [5]
    c = RunController.load(SQLiteEventStore(str(tmp_path / "ledger.db")), RUN)
    assert c.phase("c1") is Phase.COMPLETED
    assert (c.step, type(c.events[-1]).__name__) == (Step.UNSETTLED, "PublicationFailed")


# ------------------------------------------------------------------------- refusals


def _mcp() -> Any:
    return McpToolset(connection_params=StdioConnectionParams(
        server_params=StdioServerParameters(command="true", args=[])))


def _mcp_tool() -> Any:
    """One MCP tool on its own (no toolset), as ADK's ``McpTool`` wraps a server's tool."""
    from google.adk.tools.mcp_tool.mcp_session_manager import MCPSessionManager
    from google.adk.tools.mcp_tool.mcp_tool import McpTool
    from mcp.types import Tool

    return McpTool(mcp_tool=Tool(name="pay", input_schema={"type": "object", "properties": {}}),
                   mcp_session_manager=MCPSessionManager(StdioConnectionParams(
                       server_params=StdioServerParameters(command="true", args=[]))))


def _of_ones_own(made: Any, name: str) -> Any:
    """``made`` as an instance of a class of the user's own, made from its class and
    named ``name`` (no "Mcp" in it)."""
    made.__class__ = type(name, (type(made),), {})
    return made


def _tools(path: Path, *more: Any) -> list[Any]:
    """The charge the model asks for (its effect counted in ``path``), and ``more``."""
    return [world.make_tools(path)["charge"], *more]


@pytest.mark.parametrize(("feature", "named", "agent"), [
    ("MCP toolsets", "McpToolset", lambda model, path: LlmAgent(
        name="agent", model=model, tools=_tools(path, _mcp()))),
    ("MCP tools", "McpTool", lambda model, path: LlmAgent(
        name="agent", model=model, tools=_tools(path, _mcp_tool()))),
    ("MCP tools", "PaymentTool", lambda model, path: LlmAgent(
        name="agent", model=model, tools=_tools(path, _of_ones_own(_mcp_tool(), "PaymentTool")))),
    ("MCP toolsets", "Payments", lambda model, path: LlmAgent(
        name="agent", model=model, tools=_tools(path, _of_ones_own(_mcp(), "Payments")))),
    ("agents as tools", "AgentTool", lambda model, path: LlmAgent(
        name="agent", model=model, tools=_tools(path, AgentTool(LlmAgent(
            name="inner", model=ScriptedModel()))))),
    ("ParallelAgent agents", "ParallelAgent", lambda model, path: ParallelAgent(
        name="agent", sub_agents=[LlmAgent(name="inner", model=model, tools=_tools(path))])),
    ("LoopAgent agents", "LoopAgent", lambda model, path: LoopAgent(
        name="agent", sub_agents=[LlmAgent(name="inner", model=model, tools=_tools(path))])),
    ("SequentialAgent agents", "SequentialAgent", lambda model, path: SequentialAgent(
        name="agent", sub_agents=[LlmAgent(name="inner", model=model, tools=_tools(path))])),
    ("sub-agents", "sub-agents", lambda model, path: LlmAgent(
        name="agent", model=model, tools=_tools(path), sub_agents=[
            LlmAgent(name="inner", model=ScriptedModel())])),
    ("code executors", "UnsafeLocalCodeExecutor", lambda model, path: LlmAgent(
        name="agent", model=model, tools=_tools(path),
        code_executor=UnsafeLocalCodeExecutor())),
], ids=["mcp-toolset", "mcp-tool", "mcp-tool-subclass", "mcp-toolset-subclass",
        "agent-tool", "parallel-agent", "loop-agent",
        "sequential-agent", "sub-agents", "code-executor"])
def test_what_the_adapter_cannot_carry_is_refused_when_the_run_opens(
        tmp_path: Path, feature: str, named: str, agent: Any) -> None:
    """DESIGN §7.4: refused when the run opens with `UnsupportedFeature` naming the
    feature (its ``feature``, and the kind in its message); nothing recorded, the model
    never asked, the charge it would ask for never run."""
    from google.adk.apps import App
    from google.adk.runners import Runner

    store = SQLiteEventStore(str(tmp_path / "ledger.db"))
    model = ScriptedModel(script=[CHARGE])
    service = InMemorySessionService()
    runner = Runner(app=App(name=APP, root_agent=agent(model, tmp_path / "effects.txt"),
                            plugins=[LedgerPlugin(store)]), session_service=service)

    async def scenario() -> None:
        await service.create_session(app_name=APP, user_id=USER, session_id=SESSION)
        with pytest.raises(UnsupportedFeature) as refused:
            await run(runner, text("go"))
        assert refused.value.feature == feature
        assert named in str(refused.value)

    asyncio.run(scenario())
    assert model.requests == 0
    assert effects(tmp_path / "effects.txt") == []
    with pytest.raises(RunNotFound):
        RunController.load(store, RUN)


class _AnswersToolErrors(BasePlugin):
    """A user's plugin that turns a tool's error into an answer for the model."""

    def __init__(self) -> None:
        super().__init__(name="answers_tool_errors")

    async def on_tool_error_callback(self, *, tool: Any, tool_args: dict[str, Any],
                                     tool_context: Any, error: Exception) -> Any:
        return {"error": "try again later"}


def test_the_session_service_in_the_ledgers_file_is_refused_when_it_is_built(
        tmp_path: Path) -> None:
    """ADK's ``SqliteSessionService`` and the ledger's `SQLiteEventStore` on one file both
    keep a table named ``events`` and cannot read each other's: `OneWriterSessionService`
    with ``plugin=`` refuses that when it is built, naming it (before, the first session
    event's write failed inside ADK: "table events has no column named id"); the same
    service on another file is carried. (A file where ADK's service wrote first, the
    store refuses to open.)"""
    from google.adk.sessions.sqlite_session_service import SqliteSessionService

    service = SqliteSessionService(str(tmp_path / "one.db"))  # (its tables made at first use)
    plugin = LedgerPlugin(SQLiteEventStore(str(tmp_path / "one.db")))
    with pytest.raises(UnsupportedFeature) as refused:
        OneWriterSessionService(service, plugin=plugin)
    assert refused.value.feature == "the ledger's store in the session service's file"
    from google.adk.events import Event
    from google.genai import types

    async def a_message() -> None:  # what ADK met, before: its first event's write failed
        session = await service.create_session(app_name="app", user_id="u", session_id="s")
        await service.append_event(session, Event(author="user", content=types.Content(
            role="user", parts=[types.Part(text="hi")])))

    with pytest.raises(Exception, match="no column named id"):
        asyncio.run(a_message())
    apart = SqliteSessionService(str(tmp_path / "sessions.db"))
    assert OneWriterSessionService(apart, plugin=plugin).plugin is plugin
    assert OneWriterSessionService(service).plugin is None  # (no ledger writes through it)


@pytest.mark.invariant("I1", "I11")
@pytest.mark.parametrize(("ahead", "overrides"), [
    (MultimodalToolResultsPlugin, "after_tool_callback"),
    (_AnswersToolErrors, "on_tool_error_callback")], ids=["adks-multimodal", "users-errors"])
def test_a_plugin_answering_tool_results_ahead_of_the_ledger_is_refused_when_the_run_opens(
        tmp_path: Path, ahead: Callable[[], BasePlugin], overrides: str) -> None:
    """ADK stops at the first plugin whose ``after_tool_callback`` (or
    ``on_tool_error_callback``) returns a value; ADK's own ``MultimodalToolResultsPlugin``
    always does, so placed before the ledger it left a charge that ran in doubt for good
    (measured before the refusal: charged, the call ``STARTED``). Refused when the run
    opens (`UnsupportedFeature`), nothing recorded, the model never asked, nothing run;
    the same plugin after the ledger goes on, the charge made once and published."""
    (tmp_path / "ahead").mkdir()
    w = World(tmp_path / "ahead", "ledger", [CHARGE], ["charge"], before=[ahead()])

    async def refused() -> None:
        await w.open()
        with pytest.raises(UnsupportedFeature) as error:
            await run(w.runner, text("go"))
        assert error.value.feature == "plugins before the ledger on tool results"
        assert overrides in str(error.value)
        assert await w.responses() == []

    asyncio.run(refused())
    assert w.model.requests == 0
    assert w.ran() == []
    with pytest.raises(RunNotFound):
        RunController.load(w.store, RUN)
    behind = World(tmp_path, "ledger", [CHARGE], ["charge"], after=[ahead()])

    async def goes_on() -> list[Any]:
        await behind.open()
        return await run(behind.runner, text("go"))

    assert _says(asyncio.run(goes_on()), "done")
    assert behind.ran() == ["charge 5"]
    assert RunController.load(behind.store, RUN).phase("c1") is Phase.PUBLISHED


class _BeforeTheAnswer(BasePlugin):
    """Runs ``during`` when the model is asked for the answer (its second request):
    the tool's result recorded, nothing in flight."""

    def __init__(self, during: Any) -> None:
        super().__init__(name="before_the_answer")
        self.during = during
        self.requests = 0

    async def before_model_callback(self, *, callback_context: Any,
                                    llm_request: Any) -> None:
        self.requests += 1
        if self.requests == 2:
            await self.during()


@pytest.mark.invariant("I2")
@pytest.mark.parametrize("publications", [True, False],
                         ids=["appends-published", "appends-not-published"])
def test_a_refused_open_records_nothing_and_supersedes_no_live_attempt(
        tmp_path: Path, publications: bool) -> None:
    """While one attempt waits for the model's answer (its charge done), a second runner
    of the same session opens an invocation the adapter refuses (its agent has a code
    executor). Before the refusal came first, that open claimed the run (and wrote the
    user's message), so the live attempt was superseded (`ConcurrencyConflict`). Now the
    refusal records nothing (the log's length is unchanged), writes nothing to the
    session, and the live attempt goes on to its answer, the charge made once."""
    from google.adk.apps import App
    from google.adk.runners import Runner

    seen: dict[str, Any] = {}
    rival: list[Runner] = []

    async def rival_opens() -> None:
        events = len(RunController.load(w.store, RUN).events)
        stored = await w.service.get_session(app_name=APP, user_id=USER,
                                             session_id=SESSION)
        assert stored is not None
        with pytest.raises(UnsupportedFeature) as refused:
            await run(rival[0], text("go"))
        seen["feature"] = refused.value.feature
        seen["events"] = (events, len(RunController.load(w.store, RUN).events))
        after = await w.service.get_session(app_name=APP, user_id=USER,
                                            session_id=SESSION)
        assert after is not None
        seen["session"] = (len(stored.events), len(after.events))

    w = World(tmp_path, "ledger", [CHARGE], ["charge"], publications=publications,
              after=[_BeforeTheAnswer(rival_opens)])
    inner = w.service.service if isinstance(w.service, OneWriterSessionService) else None
    assert inner is not None
    plugin = LedgerPlugin(SQLiteEventStore(str(tmp_path / "ledger.db")))
    rival.append(Runner(app=App(name=APP, root_agent=LlmAgent(
        name="agent", model=ScriptedModel(script=[CHARGE]), tools=_tools(tmp_path / "rival"),
        code_executor=UnsafeLocalCodeExecutor()), plugins=[plugin]),
        session_service=OneWriterSessionService(inner, plugin=plugin if publications
                                                else None)))

    async def scenario() -> list[Any]:
        await w.open()
        return await run(w.runner, text("go"))

    answered = asyncio.run(scenario())
    assert seen["feature"] == "code executors"
    before, after = seen["events"]
    assert after == before  # the refused open recorded nothing
    assert seen["session"][1] == seen["session"][0]  # nor wrote the session
    assert _says(answered, "done")  # the live attempt was not superseded
    assert w.ran() == ["charge 5"]
    assert effects(tmp_path / "rival") == []
    # without publications the ledger publishes a result with the next batch (none here)
    assert RunController.load(w.store, RUN).phase("c1") is (
        Phase.PUBLISHED if publications else Phase.COMPLETED)


@pytest.mark.parametrize("how", ["run_live", "run_async-bidi"])
def test_live_streaming_is_refused_when_the_run_opens(tmp_path: Path, how: str) -> None:
    """Live (bidirectional) streaming, through ``Runner.run_live`` or ``run_async`` with
    ``StreamingMode.BIDI``: refused when the run opens (`UnsupportedFeature`, ``"live
    streaming"``), nothing recorded, the model never asked, nothing run."""
    from google.adk.agents.live_request_queue import LiveRequestQueue
    from google.adk.agents.run_config import RunConfig

    from statemachine.adapters.google_adk import refusal

    w = World(tmp_path, "ledger", [CHARGE], ["charge"])

    async def scenario() -> BaseException:
        await w.open()
        try:
            if how == "run_live":
                queue = LiveRequestQueue()
                queue.send_content(text("go"))
                queue.close()
                async for _ in w.runner.run_live(user_id=USER, session_id=SESSION,
                                                 live_request_queue=queue):
                    pass
            else:
                async for _ in w.runner.run_async(
                        user_id=USER, session_id=SESSION, new_message=text("go"),
                        run_config=RunConfig.model_validate({"streaming_mode": "bidi"})):
                    pass
        except Exception as error:  # ADK wraps the plugin's refusal
            return refusal(error)
        raise AssertionError("live streaming was not refused")

    refused = asyncio.run(scenario())
    assert isinstance(refused, UnsupportedFeature)
    assert refused.feature == "live streaming"
    assert w.model.requests == 0
    assert w.ran() == []
    with pytest.raises(RunNotFound):
        RunController.load(w.store, RUN)


@pytest.mark.invariant("I1")
def test_function_calls_without_ids_get_adks_own_and_run_once(tmp_path: Path) -> None:
    """A model that sends function calls without ids: ADK 2.13 gives each an id of its
    own (``adk-...``) in the session event before any tool callback, so the ledger keys
    the call by it; the charge runs once and the run goes on."""
    w = World(tmp_path, "ledger", [("", "charge", {"amount": 5})], ["charge"])

    async def scenario() -> list[Any]:
        await w.open()
        return await run(w.runner, text("go"))

    answered = asyncio.run(scenario())
    assert _says(answered, "done")
    assert w.ran() == ["charge 5"]
    (view,) = RunController.load(w.store, RUN).calls
    assert view.call.call_id.startswith("adk-")
    assert view.phase is Phase.PUBLISHED


def test_a_function_call_without_an_id_is_refused_at_its_callback(tmp_path: Path) -> None:
    """ADK's runner never gives the callbacks a call without an id (it makes one); one
    that reaches ``before_tool_callback`` anyway (a runner of another version) is refused
    there (`UnsupportedFeature`, ``"function calls without ids"``): nothing recorded, the
    body never run."""
    from types import SimpleNamespace

    w = World(tmp_path, "ledger", [CHARGE], ["charge"])
    assert w.plugin is not None
    plugin = w.plugin

    async def scenario() -> None:
        await w.open()
        session = await w.service.get_session(app_name=APP, user_id=USER,
                                              session_id=SESSION)
        tool = world.make_tools(w.effects)["charge"]
        with pytest.raises(UnsupportedFeature) as refused:
            await plugin.before_tool_callback(
                tool=tool, tool_args={"amount": 5},
                tool_context=SimpleNamespace(function_call_id=None, session=session))
        assert refused.value.feature == "function calls without ids"

    asyncio.run(scenario())
    assert w.ran() == []
    with pytest.raises(RunNotFound):
        RunController.load(w.store, RUN)


def test_an_async_store_is_refused_when_the_plugin_is_built(tmp_path: Path) -> None:
    """The plugin is refused an async store when it is built (`UnsupportedFeature`
    naming it and the way on: the sync store of the same database); nothing is recorded
    in the file, and the sync store of the same file is taken and carries a run."""
    from statemachine.sqlite import AsyncSQLiteEventStore

    path = str(tmp_path / "ledger.db")
    with pytest.raises(UnsupportedFeature) as refused:
        LedgerPlugin(AsyncSQLiteEventStore(path))  # type: ignore[arg-type]
    assert refused.value.feature == "async event stores"
    assert "use the sync store" in str(refused.value)
    with pytest.raises(RunNotFound):
        RunController.load(SQLiteEventStore(path), RUN)
    w = World(tmp_path, "ledger", [CHARGE], ["charge"], store=SQLiteEventStore(path))

    async def scenario() -> None:
        await w.open()
        await run(w.runner, text("go"))

    asyncio.run(scenario())
    assert w.ran() == ["charge 5"]
    assert RunController.load(SQLiteEventStore(path), RUN).phase("c1") is Phase.PUBLISHED


@pytest.mark.invariant("I1")
@pytest.mark.parametrize("mode", ["alone", "ledger"])
def test_a_body_asking_for_its_confirmation_runs_its_effect_once(tmp_path: Path,
                                                                 mode: str) -> None:
    """``tool_context.request_confirmation()`` inside a body: the first run asks and does
    nothing; once confirmed ADK runs the body again, which then acts (once)."""
    from google.adk.tools.function_tool import FunctionTool

    w = World(tmp_path, mode, [("p1", "pay", {"amount": 9})], [])

    def pay(amount: int, tool_context: Any) -> dict[str, Any]:
        """Pay, after asking."""
        if tool_context.tool_confirmation is None:
            tool_context.request_confirmation(hint="pay?")
            return {"status": "asked"}
        world.effect(w.effects, f"pay {amount}")
        return {"paid": amount}

    agent = w.runner.agent
    assert isinstance(agent, LlmAgent)
    agent.tools.append(FunctionTool(pay))

    async def scenario() -> None:
        await w.open()
        asked = confirmation_requests(await run(w.runner, text("go")))
        request, _ = asked["p1"]
        await run(w.runner, response(request, "adk_request_confirmation",
                                     {"confirmed": True}))

    asyncio.run(scenario())
    assert w.ran() == ["pay 9"]
    if mode == "ledger":
        c = RunController.load(w.store, RUN)
        assert c.phase("p1") is Phase.PUBLISHED
        assert c.call("p1").starts == 2


CARD = "4111111111111111"


@pytest.mark.invariant("I1", "I12")
@pytest.mark.parametrize("replaced", ["after_tool_callback", "on_tool_error_callback"])
@pytest.mark.parametrize("publications", [True, False],
                         ids=["appends-published", "appends-not-published"])
def test_what_the_agents_callback_made_of_a_result_is_what_the_ledger_keeps_and_resends(
        tmp_path: Path, replaced: str, publications: bool) -> None:
    """The agent's own ``after_tool_callback`` replaces a payment's output (the card
    masked, a stamp counting its runs), or its ``on_tool_error_callback`` answers a
    payment that raised. The append of the response is lost (nothing written), and the
    invocation resumed: the model is given exactly what ADK made of the call the first
    time (the lost event's response), the callback ran once, and the card number is
    nowhere in the ledger (DESIGN §7.4: the raw output a callback replaced is not kept).
    Measured before: the ledger kept the raw output (the card, or the error's text) and
    resent it, and the callback ran again on it (stamp 2), or did not (the error text)."""
    lost: list[Any] = []

    class Lost(LosesAppend):
        async def append_event(self, session: Any, event: Any) -> Any:
            if event.get_function_responses() and event.author != "user" and self.times:
                lost.extend((str(r.id), r.response) for r in event.get_function_responses())
            return await super().append_event(session, event)

    from google.adk.tools.function_tool import FunctionTool

    w = World(tmp_path, "ledger", [("p1", "pay", {"amount": 9})], [],
              service=Lost(InMemorySessionService(), landed=False), resumable=True,
              publications=publications)
    runs: list[str] = []

    def pay(amount: int) -> dict[str, Any]:
        """Pay with the card on file."""
        world.effect(w.effects, f"pay {amount}")
        if replaced == "on_tool_error_callback":
            raise ValueError(f"card {CARD} declined")
        return {"paid": amount, "card": CARD}

    def masked(tool: Any, args: Any, tool_context: Any, tool_response: Any) -> Any:
        runs.append(tool_context.function_call_id)
        return {**tool_response, "card": "****" + CARD[-4:], "stamp": len(runs)}

    def declined(tool: Any, args: Any, tool_context: Any, error: Exception) -> Any:
        runs.append(tool_context.function_call_id)
        return {"declined": "****" + CARD[-4:], "stamp": len(runs)}

    agent = w.runner.agent
    assert isinstance(agent, LlmAgent)
    agent.tools.append(FunctionTool(pay))
    if replaced == "after_tool_callback":
        agent.after_tool_callback = masked
    else:
        agent.on_tool_error_callback = declined

    async def scenario() -> list[Any]:
        await w.open()
        seen: list[str] = []
        with pytest.raises(OSError, match="acknowledgement was lost"):
            await _noting(w.runner, seen)
        return await run(w.runner, None, invocation_id=seen[-1])

    answered = asyncio.run(scenario())
    assert _says(answered, "done")
    assert w.ran() == ["pay 9"]
    assert runs == ["p1"]  # the callback ran once
    (first,) = lost
    assert first[1]["stamp"] == 1
    given = [pair for request in w.model.seen for pair in request]
    assert given == [first]  # the model was given what ADK made of the call, once
    assert CARD not in json.dumps(RunController.load(w.store, RUN).to_json())  # nor in text


@pytest.mark.invariant("I1", "I5")
@pytest.mark.parametrize("mode", ["alone", "ledger"])
def test_a_confirmation_showing_no_fingerprint_confirms_nothing(tmp_path: Path,
                                                                mode: str) -> None:
    """A client that answers the request with ``{"confirmed": True}`` and no payload (it
    never looked at what was shown): ADK alone wires (measured); through the adapter the
    confirmation confirms no arguments and is refused, nothing ran; the confirmation
    carrying the shown fingerprint then wires once."""
    w = World(tmp_path, mode, [("w1", "wire", {"amount": 7})], ["wire"])

    async def scenario() -> None:
        await w.open()
        asked = confirmation_requests(await run(w.runner, text("go")))
        request, payload = asked["w1"]
        blind = response(request, "adk_request_confirmation", {"confirmed": True})
        if mode == "alone":
            await run(w.runner, blind)
            return
        with pytest.raises(InvalidTransition, match="fingerprint"):
            await run(w.runner, blind)
        assert w.ran() == []
        await run(w.runner, confirmation(request, fingerprint=payload["fingerprint"]))

    asyncio.run(scenario())
    assert w.ran() == ["wire 7"]




@pytest.mark.invariant("I1")
def test_a_note_left_by_a_call_cancelled_between_its_callbacks_answers_no_later_run(
        tmp_path: Path) -> None:
    """The ledger notes the answer its ``before_tool_callback`` gave (here the
    confirmation request of a wire) until the call's ``after_tool_callback``. A call
    cancelled between the two leaves the note (the state is set by hand: ADK 2.13 has
    no suspension point there to cancel at); ADK then runs the confirmed call again
    under the same id. That run is the wire's: it runs once, its result is recorded and
    given to the model, and nothing is left in doubt."""
    w = World(tmp_path, "ledger", [("w1", "wire", {"amount": 7})], ["wire"])
    assert w.plugin is not None

    async def scenario() -> None:
        await w.open()
        request, payload = confirmation_requests(await run(w.runner, text("go")))["w1"]
        assert w.plugin is not None
        w.plugin._answered[(RUN, "w1")] = {
            "error": "This tool call requires confirmation."}
        await run(w.runner, confirmation(request, fingerprint=payload["fingerprint"]))

    asyncio.run(scenario())
    assert w.ran() == ["wire 7"]
    assert ("w1", {"wired": 7}) in w.model.seen[-1]
    c = RunController.load(w.store, RUN)
    assert c.in_doubt() == ()
    assert c.phase("w1") is Phase.PUBLISHED
    assert c.call("w1").result == {"wired": 7}



@pytest.mark.invariant("I1", "I12")
@pytest.mark.parametrize("reload", [False, True], ids=["same-runner", "new-process"])
@pytest.mark.parametrize("resumed", [False, True], ids=["new-invocations", "resumed"])
def test_a_replayed_confirmation_of_a_long_running_call_sends_no_response_yet(
        tmp_path: Path, resumed: bool, reload: bool) -> None:
    """A long-running render needing a confirmation: confirmed, it starts and returns
    nothing (its client sends the result later), so ADK sends the model no response for
    it yet. The same confirmation sent again (resuming the paused invocation with
    ``ResumabilityConfig``, or as a new invocation; to the same runner, or to a second
    runner over a new store instance): ADK alone starts the render again (measured) and
    sends no response; through the ledger the render started once and the model is
    given what ADK alone gives it, no response of the render (not ``{"result": None}``,
    which the model would take for the render's result)."""
    script: list[Call] = [("r1", "render", {"shot": 1})]

    def gated(folder: Path, mode: str, service: BaseSessionService | None) -> World:
        w = World(folder, mode, script, ["render"], service=service, resumable=resumed,
                  store=SQLiteEventStore(str(folder / "ledger.db")))
        agent = w.runner.agent
        assert isinstance(agent, LlmAgent)
        agent.tools[0]._require_confirmation = True  # type: ignore[union-attr]
        return w

    def scenario(mode: str) -> tuple[list[Any], list[str]]:
        folder = tmp_path / mode
        folder.mkdir()
        w = gated(folder, mode, None)

        async def go() -> list[Any]:
            await w.open()
            first = await run(w.runner, text("go"))
            request, payload = confirmation_requests(first)["r1"]
            message = response(request, "adk_request_confirmation",
                               {"confirmed": True, "payload": payload})
            invocation = first[-1].invocation_id if resumed else None
            await run(w.runner, message, invocation_id=invocation)
            again = gated(folder, mode, w.service) if reload else w
            replayed = await run(again.runner, message, invocation_id=invocation)
            given = [r.response for e in replayed for r in e.get_function_responses()
                     if r.id == "r1"]
            return [given, again.model.seen[-1]]

        return asyncio.run(go()), w.ran()

    alone, alone_ran = scenario("alone")
    seen, ran = scenario("ledger")
    assert alone_ran == ["render 1", "render 1"]  # ADK alone starts it again
    assert ran == ["render 1"]
    assert seen == alone
    given, model = seen
    assert given == []  # no response of the render yet
    placeholder = "This tool call requires confirmation, please approve or reject."
    assert [r for call_id, r in model if call_id == "r1"] == [{"error": placeholder}]


class _Keeps(LosesAppend):
    """`LosesAppend` keeping the function responses of each event it was asked to append
    (by call id): what ADK gave the model, written or not."""

    def __init__(self, service: BaseSessionService, **options: Any) -> None:
        super().__init__(service, **options)
        self.asked: list[dict[str, Any]] = []

    async def append_event(self, session: Any, event: Any) -> Any:
        if event.get_function_responses() and event.author != "user":
            self.asked.append({str(r.id): r.response for r in event.get_function_responses()})
        return await super().append_event(session, event)


@pytest.mark.invariant("I11")
def test_an_invocation_cancelled_while_an_error_callback_decides_leaves_the_call_in_doubt(
        tmp_path: Path) -> None:
    """The body raised; the agent's ``on_tool_error_callback`` is still deciding when the
    invocation is cancelled: neither an answer nor the error ever reached ADK. The call
    is in doubt: the next run of the session, in this process, is refused with
    `ToolInDoubt` before anything runs, and the body ran once."""
    w = World(tmp_path, "ledger", [("r1", "refund", {"amount": -1})], ["refund"])
    deciding = asyncio.Event()

    async def decides(tool: Any, args: Any, tool_context: Any, error: Exception) -> Any:
        deciding.set()
        await asyncio.Event().wait()  # (never decides)

    agent = w.runner.agent
    assert isinstance(agent, LlmAgent)
    agent.on_tool_error_callback = decides

    async def scenario() -> None:
        await w.open()
        first = asyncio.create_task(run(w.runner, text("go")))
        await deciding.wait()
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        with pytest.raises(ToolInDoubt):
            await run(w.runner, text("go on"))

    asyncio.run(scenario())
    assert w.ran() == ["refund -1"]
    assert RunController.load(w.store, RUN).in_doubt() == ("r1",)


class _DiesOnceAppended(LosesAppend):
    """Appends the event carrying a tool's function responses, and the process dies right
    after (`Crash`: nothing after it runs, no callback of ADK's either)."""

    async def append_event(self, session: Any, event: Any) -> Any:
        written = await self.service.append_event(session, event)
        if event.get_function_responses() and event.author != "user" and self.times:
            self.times -= 1
            raise Crash
        return written


@pytest.mark.invariant("I3")
def test_the_answer_to_a_call_of_a_tool_the_agent_lacks_is_durable_before_adk_uses_it(
        tmp_path: Path) -> None:
    """The model calls only ``ghost``, a tool the agent does not have; ADK appends its
    not-found response (the session's appends not the ledger's publications) and the
    process dies before anything else. The ledger, reloaded, holds the call completed
    with the answer the session holds: it was durable before ADK used it, as every
    result the ledger hands ADK is."""
    service = _DiesOnceAppended(InMemorySessionService(), landed=True)
    w = World(tmp_path, "ledger", [("g1", "ghost", {"x": 1})], ["charge"], service=service,
              publications=False)

    async def scenario() -> None:
        await w.open()
        with pytest.raises(Crash):
            await run(w.runner, text("go"))

    asyncio.run(scenario())
    c = RunController.load(SQLiteEventStore(str(tmp_path / "ledger.db")), RUN)
    assert c.phase("g1") is Phase.COMPLETED
    (answer,) = [r.response for e in asyncio.run(w.service.get_session(
        app_name=APP, user_id=USER, session_id=SESSION)).events  # type: ignore[union-attr]
        for r in e.get_function_responses()]
    assert c.call("g1").result == answer


@pytest.mark.invariant("I1", "I3", "I12")
@pytest.mark.parametrize("publications", [True, False], ids=["staged", "unstaged"])
@pytest.mark.parametrize("answers", ["adk-not-found", "on-tool-error", "before-tool"])
def test_a_call_of_a_tool_the_agent_lacks_is_answered_the_same_after_a_reload(
        tmp_path: Path, answers: str, publications: bool) -> None:
    """The model calls ``ghost``, a tool the agent does not have, beside a charge; the
    append of their responses is lost and the invocation resumed by a second runner (a
    new plugin over a new store instance: another process), which appends the staged
    event again (``staged``) or, the session's appends not the ledger's publications,
    runs both calls again and the ledger answers them from its record. ADK answers the ghost call
    through its lookup error (the agent's ``on_tool_error_callback`` when it answers,
    else ADK's own not-found text) and runs no after-tool callback on it, or with the
    answer of the agent's ``before_tool_callback`` (then the after-tool callbacks run). Through the
    ledger the run goes on to its answer, the model is given the same ghost response
    as with ADK alone, the second runner gives what the first gave, the callback ran
    once (ADK alone asks it again), the charge ran once and nothing is left in doubt."""
    script: list[Call] = [("g1", "ghost", {"x": 1}), CHARGE]
    asked: list[str] = []

    def on_error(tool: Any, args: Any, tool_context: Any, error: Exception) -> Any:
        asked.append(tool.name)
        return {"error": "ghost is not a tool here"} if answers == "on-tool-error" else None

    def before(tool: Any, args: Any, tool_context: Any) -> Any:
        if answers != "before-tool" or tool.name != "ghost":
            return None
        asked.append(tool.name)
        return {"error": "ghost is not a tool here"}

    def world_of(folder: Path, mode: str, service: BaseSessionService | None) -> World:
        w = World(folder, mode, script, ["charge"], service=service, resumable=True,
                  store=SQLiteEventStore(str(folder / "ledger.db")),
                  publications=publications)
        agent = w.runner.agent
        assert isinstance(agent, LlmAgent)
        agent.on_tool_error_callback = on_error
        agent.before_tool_callback = before
        return w

    def scenario(mode: str) -> tuple[Any, Any, bool, int]:
        folder = tmp_path / mode
        folder.mkdir()
        keeps = _Keeps(InMemorySessionService(), landed=False)
        first = world_of(folder, mode, keeps)
        asked.clear()

        async def go() -> bool:
            await first.open()
            seen: list[str] = []
            with pytest.raises(OSError, match="acknowledgement was lost"):
                await _noting(first.runner, seen)
            second = world_of(folder, mode, keeps)  # another process: a new store too
            events = await run(second.runner, None, invocation_id=seen[-1])
            assert second.model.seen[-1][0][0] == "g1"
            given.append(dict(second.model.seen[-1])["g1"])
            return _says(events, "done")

        given: list[Any] = []
        done = asyncio.run(go())
        if mode == "ledger":
            c = RunController.load(SQLiteEventStore(str(folder / "ledger.db")), RUN)
            assert c.in_doubt() == ()
            held = Phase.PUBLISHED if publications else Phase.COMPLETED  # not published
            assert [c.phase("g1"), c.phase("c1")] == [held] * 2
            assert first.ran() == ["charge 5"]
        return keeps.asked[0]["g1"], given[0], done, len(asked)

    alone_first, alone_resent, alone_done, alone_asked = scenario("alone")
    first, resent, done, times = scenario("ledger")
    assert alone_done
    assert done
    assert first == resent == alone_first == alone_resent  # the model's view: the same
    if answers != "adk-not-found":
        assert first == {"error": "ghost is not a tool here"}
    else:
        assert "ghost" in first["error"]
        assert "charge" in first["error"]
    assert (alone_asked, times) == (2, 1)  # ADK alone asks the callback again


class _ReusesAnId(ScriptedModel):
    """Asks for ``charge(5)`` under ``c1``, then, once it is answered, ``charge(8)`` under
    ``c1`` again (a model reusing ids across turns), then says ``done``."""

    async def generate_content_async(self, llm_request: Any, stream: bool = False
                                     ) -> Any:
        from google.adk.models.llm_response import LlmResponse
        from google.genai import types

        self.requests += 1
        amount = {1: 5, 2: 8}.get(self.requests)
        parts = ([types.Part(text="done")] if amount is None else [types.Part(
            function_call=types.FunctionCall(id="c1", name="charge",
                                             args={"amount": amount}))])
        yield LlmResponse(content=types.Content(role="model", parts=parts))


def test_a_call_id_asked_for_again_with_other_arguments_is_refused(tmp_path: Path) -> None:
    """The model names ``charge(8)`` under the id of the ``charge(5)`` that ran: the
    ledger neither runs it nor answers it with the other call's result
    (`InvalidTransition`, naming it). Before, it was answered ``{"charged": 5}``."""
    world = World(tmp_path, "ledger", [CHARGE], ["charge"])
    agent: Any = world.runner.agent
    agent.model = _ReusesAnId()

    async def scenario() -> None:
        await world.open()
        with pytest.raises(InvalidTransition, match=r"'c1'.*other than the recorded"):
            await run(world.runner, text("go"))

    asyncio.run(scenario())
    assert world.ran() == ["charge 5"]
