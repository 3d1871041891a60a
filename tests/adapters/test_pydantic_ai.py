"""The pydantic-ai adapter (statemachine.adapters.pydantic_ai), offline: pydantic-ai's own
`TestModel` and `FunctionModel` answer, nothing touches the network.

Expected outcomes come from the script (which tool the model asks for, which decision
the caller takes, which write fails), never from what the ledger recorded. The
differential tests run the same scenario on pydantic-ai alone (what pydantic-ai 2.68
does, recorded as it is: it runs the tool again) and through `LedgerRun` (in doubt,
never re-run, resolved by the operator): a run cancelled inside a tool, a process killed
(SIGKILL) inside a tool on a SQLite store, and a reused tool-call id.

Under CI a missing ``pydantic_ai`` package fails this module instead of skipping it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pydantic
import pytest

try:
    import pydantic_ai
except ImportError:  # pragma: no cover - CI installs the extra
    from tests.helpers import missing_extra

    missing_extra("pydantic-ai")

from pydantic_ai import (
    Agent,
    BinaryContent,
    DeferredToolRequests,
    DeferredToolResults,
    ModelRetry,
    ToolApproved,
    ToolFailed,
    ToolReturn,
)
from pydantic_ai.capabilities import AbstractCapability, ProcessHistory
from pydantic_ai.conversation_store import InMemoryConversationStore
from pydantic_ai.messages import (
    ModelMessage,
    ModelMessagesTypeAdapter,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models.function import AgentInfo, DeltaToolCall, FunctionModel
from pydantic_ai.models.test import TestModel
from pydantic_ai.tools import ToolDefinition
from pydantic_ai.toolsets import ExternalToolset

from statemachine import (
    ConcurrencyConflict,
    ControlError,
    InvalidTransition,
    MemoryEventStore,
    Phase,
    PublicationUnsettled,
    RunController,
    RunNotResumable,
    SchemaError,
    SQLiteEventStore,
    Step,
    ToolInDoubt,
)
from statemachine import events as ev
from statemachine.adapters.pydantic_ai import (
    ConversationStoreHistory,
    HistoryMismatch,
    HistoryRequired,
    LedgerRun,
    RecordedOutputRefused,
    UnsupportedCapability,
    UnsupportedDeferral,
    UnsupportedRun,
)
from statemachine.sessions import MemorySession, SQLiteSession
from statemachine.testing import FlakySession, InjectedWriteError
from tests.adapters.dying import Crash, DiesWithItsProcess

ROOT = Path(__file__).resolve().parents[2]
OPERATOR = "charged 7 (confirmed by the operator)"


# ---------------------------------------------------------------------------- world


def scripted(turns: list[list[ToolCallPart]], final: str = "done", *,
             asked: list[list[ModelMessage]] | None = None) -> FunctionModel:
    """A model that answers its n-th request with ``turns[n]`` (tool calls) and, once they
    are used up, with the text ``final`` followed by the last tool result it was sent.
    Every request's messages are appended to ``asked`` (when given): what the model saw,
    and how often it was called. It streams the same answers (``run_stream``)."""

    def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if asked is not None:
            asked.append(list(messages))
        turn = sum(1 for message in messages if isinstance(message, ModelResponse))
        if turn < len(turns):
            return ModelResponse(parts=list(turns[turn]))
        results = [str(part.content) for part in messages[-1].parts
                   if part.part_kind == "tool-return"]
        return ModelResponse(parts=[TextPart(" | ".join([final, *results]))])

    async def stream(messages: list[ModelMessage], info: AgentInfo) -> Any:
        response = respond(messages, info)
        for index, part in enumerate(response.parts):
            if isinstance(part, TextPart):
                yield part.content
            elif isinstance(part, ToolCallPart):
                yield {index: DeltaToolCall(part.tool_name, part.args_as_json_str(),
                                            tool_call_id=part.tool_call_id)}

    return FunctionModel(respond, stream_function=stream)


def call(name: str, call_id: str, **arguments: Any) -> ToolCallPart:
    return ToolCallPart(name, arguments, tool_call_id=call_id)


def billing(model: Any, ran: Counter[str], *,
            hang: asyncio.Event | None = None) -> Agent[None, Any]:
    """``charge`` needs approval, ``lookup`` does not; each body counts in ``ran``. With
    ``hang``, charge sets it after its effect and then never returns."""
    agent: Agent[None, Any] = Agent(model, output_type=[str, DeferredToolRequests])

    @agent.tool_plain(requires_approval=True)
    async def charge(x: int) -> str:
        ran[f"charge {x}"] += 1
        if hang is not None:
            hang.set()
            await asyncio.Event().wait()
        return f"charged {x}"

    @agent.tool_plain
    def lookup(i: int) -> str:
        ran[f"lookup {i}"] += 1
        return f"found {i}"

    return agent


def kinds(items: list[Any]) -> list[tuple[str, list[tuple[str, str | None]]]]:
    """A history as (message kind, [(part kind, call id)]): what the tests compare."""
    shape = []
    for item in items:
        parts = [(part["part_kind"], part.get("tool_call_id")) for part in item["parts"]
                 if part["part_kind"] != "system-prompt"]
        shape.append((item["kind"], parts))
    return shape


def _shape(items: list[Any]) -> list[tuple[str, str]]:
    """The history as (message kind, its parts): a call or result by call id, a prompt or
    an answer by its text."""
    shape = []
    for item in items:
        parts = [f"{part['part_kind']} {part.get('tool_call_id') or part.get('content')}"
                 for part in item["parts"] if part["part_kind"] != "system-prompt"]
        shape.append((item["kind"], " + ".join(parts)))
    return shape


PAUSE = [("request", [("user-prompt", None)]),
         ("response", [("tool-call", "c1"), ("tool-call", "c2")]),
         ("request", [("tool-return", "c2")])]
"""The history of the approval scenario at its pause: charge (c1) awaits a decision,
lookup (c2) ran."""
FINISHED = [*PAUSE, ("request", [("tool-return", "c1")]), ("response", [("text", None)])]


MIXED = [[call("charge", "c1", x=7), call("lookup", "c2", i=1)]]
"""One response, an approval-gated call (charge) and one needing no approval (lookup)."""


def approval_agent(ran: Counter[str], *,
                   asked: list[list[ModelMessage]] | None = None) -> Agent[None, Any]:
    return billing(scripted(MIXED, asked=asked), ran)


def run_async(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


async def within(awaitable: Any) -> Any:
    """``awaitable``, or a failure: a tool that runs again in these tests never returns."""
    return await asyncio.wait_for(awaitable, 20)


# ------------------------------------------------------------------ plain runs


@pytest.mark.invariant("I1", "I3")
def test_a_test_model_run_runs_each_tool_once_and_writes_each_message_once() -> None:
    async def go() -> None:
        ran: Counter[str] = Counter()
        agent: Agent[None, str] = Agent(TestModel())

        @agent.tool_plain
        def lookup(i: int) -> str:
            ran["lookup"] += 1
            return f"found {i}"

        @agent.tool_plain
        def weather(city: str) -> str:
            ran["weather"] += 1
            return "sunny"

        history = MemorySession("h")
        run = await LedgerRun.open(agent, run_id="t", history=history,
                                   store=MemoryEventStore())
        result = await run.run("hello")
        assert result.step is Step.COMPLETED
        assert ran == Counter({"lookup": 1, "weather": 1})  # TestModel calls every tool once
        # the history holds exactly pydantic-ai's own messages, in order, once each
        expected = ModelMessagesTypeAdapter.dump_python(list(result.messages), mode="json")
        assert kinds(await history.get_items()) == kinds(expected)
        assert [view.phase for view in run.controller.calls] == [Phase.PUBLISHED] * 2

    run_async(go())


@pytest.mark.parametrize("via", ["approve", "deferred_tool_results"])
@pytest.mark.parametrize("decision", ["approved", "denied"])
def test_an_approval_pauses_the_run_and_the_decision_is_recorded(via: str,
                                                                 decision: str) -> None:
    async def go() -> None:
        ran: Counter[str] = Counter()
        history = MemorySession("h")
        run = await LedgerRun.open(approval_agent(ran), run_id="a", history=history,
                                   store=MemoryEventStore())
        paused = await run.run("charge me 7")
        assert paused.step is Step.INTERRUPTION
        assert [c.call_id for c in paused.pending] == ["c1"]
        assert isinstance(paused.requests, DeferredToolRequests)
        assert ran == Counter({"lookup 1": 1})
        assert kinds(await history.get_items()) == PAUSE
        if via == "approve":
            await (run.approve("c1") if decision == "approved" else run.reject("c1", "no"))
            done = await run.run()
        else:
            answer = decision == "approved"
            done = await run.run(deferred_tool_results=DeferredToolResults(
                approvals={"c1": answer}))
        assert done.step is Step.COMPLETED
        if decision == "approved":
            assert ran == Counter({"lookup 1": 1, "charge 7": 1})
            assert "charged 7" in done.output.split(" | ")
        else:
            assert ran == Counter({"lookup 1": 1})
            denial = "no" if via == "approve" else "The tool call was denied."
            assert denial in done.output.split(" | ")  # the model was told the denial
            assert "charged 7" not in done.output
        assert kinds(await history.get_items()) == FINISHED

    run_async(go())


def test_approvals_that_change_arguments_or_external_results_are_refused() -> None:
    async def go() -> None:
        ran: Counter[str] = Counter()
        run = await LedgerRun.open(approval_agent(ran), run_id="o",
                                   history=MemorySession("h"), store=MemoryEventStore())
        await run.run("charge me 7")
        before = len(run.controller.events)
        changed = ToolApproved(override_args={"x": 700})
        for results in (DeferredToolResults(approvals={"c1": changed}),
                        DeferredToolResults(calls={"c1": "charged by someone else"})):
            with pytest.raises(UnsupportedDeferral):
                await run.run(deferred_tool_results=results)
        assert len(run.controller.events) == before + 2  # the two claims, nothing else
        assert run.controller.pending_approvals == ("c1",)
        assert "charge 7" not in ran
        assert "charge 700" not in ran

    run_async(go())


def test_calls_pydantic_ai_answers_without_running_them_never_run_later() -> None:
    """An unknown tool, arguments that fail validation, and a tool that asks the model to
    retry: pydantic-ai answers each without a result of the tool; the ledger records that
    answer, so the call can never run afterwards, and the run completes."""

    async def go() -> None:
        ran: Counter[str] = Counter()
        turn = [call("nosuch", "c7"), call("lookup", "c8", i="not a number"),
                call("lookup", "c9", i=1), call("retry", "c6")]
        agent = billing(scripted([turn]), ran)

        @agent.tool_plain
        def retry() -> str:
            ran["retry"] += 1
            raise ModelRetry("try again")

        run = await LedgerRun.open(agent, run_id="v", history=MemorySession("h"),
                                   store=MemoryEventStore())
        done = await run.run("go")
        assert done.step is Step.COMPLETED
        assert ran == Counter({"lookup 1": 1, "retry": 1})
        c = run.controller
        phases = {view.call.call_id: view.phase for view in c.calls}
        assert phases == dict.fromkeys(("c6", "c7", "c8", "c9"), Phase.PUBLISHED)
        assert c.call("c6").result == {"kind": "model-retry", "message": "try again"}

    run_async(go())


# ------------------------------------------------------- unsettled writes (I2, I6)


@pytest.mark.invariant("I2")
@pytest.mark.parametrize("outcome", ["atomic", "commit_then_raise"])
def test_decisions_and_input_are_refused_while_a_write_is_unsettled(outcome: str) -> None:
    async def go() -> None:
        ran: Counter[str] = Counter()
        inner = MemorySession("h")
        # the third write is the pause's: lookup's result
        history = FlakySession(inner, fail_on=3, outcome=outcome)  # type: ignore[arg-type]
        run = await LedgerRun.open(approval_agent(ran), run_id="u",
                                   history=history,
                                   store=MemoryEventStore())
        with pytest.raises(InjectedWriteError):  # the write's own error (I6)
            await run.run("charge me 7")
        c = run.controller
        assert c.step is Step.UNSETTLED
        events = len(c.events)
        with pytest.raises(PublicationUnsettled):
            await run.approve("c1")
        with pytest.raises(PublicationUnsettled):
            await run.reject("c1")
        with pytest.raises(PublicationUnsettled):
            await run.run("and also refund 3")
        with pytest.raises(PublicationUnsettled):
            await run.run(deferred_tool_results=DeferredToolResults(approvals={"c1": True}))
        # refused before anything but the attempts' claims was recorded
        assert [type(e).__name__ for e in c.events[events:]] == ["RunClaimed"] * 2
        assert c.step is Step.UNSETTLED
        assert c.pending_approvals == ("c1",)
        paused = await run.run()  # settles: the batch lands exactly once
        assert paused.step is Step.INTERRUPTION
        assert kinds(await inner.get_items()) == PAUSE
        await run.approve("c1")
        done = await run.run()
        assert done.step is Step.COMPLETED
        assert ran == Counter({"lookup 1": 1, "charge 7": 1})
        assert kinds(await inner.get_items()) == FINISHED

    run_async(go())


def test_a_conversation_store_is_a_history() -> None:
    async def go() -> None:
        ran: Counter[str] = Counter()
        store = InMemoryConversationStore()
        history = ConversationStoreHistory(store, "conv-1")
        run = await LedgerRun.open(approval_agent(ran), run_id="cs", history=history,
                                   store=MemoryEventStore())
        await run.run("charge me 7")
        await run.approve("c1")
        done = await run.run()
        assert done.step is Step.COMPLETED
        assert ran["charge 7"] == 1
        stored = await store.load("conv-1")
        assert stored is not None
        assert kinds(ModelMessagesTypeAdapter.dump_python(stored.messages,
                                                          mode="json")) == FINISHED

    run_async(go())


class LosesOneAcknowledgement(InMemoryConversationStore):
    """A conversation store whose ``fail_on``-th save commits and then raises."""

    def __init__(self, fail_on: int) -> None:
        super().__init__()
        self.fail_on = fail_on
        self.saves = 0

    async def save(self, conversation: Any, *, scope: str | None = None) -> Any:
        entries = await super().save(conversation, scope=scope)
        self.saves += 1
        if self.saves == self.fail_on:
            raise ConnectionError("the acknowledgement was lost")
        return entries


def test_a_lost_acknowledgement_from_a_conversation_store_is_reconciled() -> None:
    async def go() -> None:
        ran: Counter[str] = Counter()
        store = LosesOneAcknowledgement(fail_on=3)  # the pause's write: lookup's result
        run = await LedgerRun.open(approval_agent(ran), run_id="ack",
                                   history=ConversationStoreHistory(store, "conv-2"),
                                   store=MemoryEventStore())
        with pytest.raises(ConnectionError):
            await run.run("charge me 7")
        assert run.controller.step is Step.UNSETTLED
        with pytest.raises(PublicationUnsettled):
            await run.approve("c1")
        assert (await run.run()).step is Step.INTERRUPTION  # reconciled: it had landed
        await run.approve("c1")
        assert (await run.run()).step is Step.COMPLETED
        stored = await store.load("conv-2")
        assert stored is not None
        assert kinds(ModelMessagesTypeAdapter.dump_python(stored.messages,
                                                          mode="json")) == FINISHED
        assert ran == Counter({"lookup 1": 1, "charge 7": 1})

    run_async(go())


def test_a_run_without_a_history_resumes_from_the_messages_it_is_given() -> None:
    async def go() -> None:
        ran: Counter[str] = Counter()
        run = await LedgerRun.open(approval_agent(ran), run_id="nh", store=MemoryEventStore())
        paused = await run.run("charge me 7")
        await run.approve("c1")
        with pytest.raises(HistoryRequired):
            await run.run()
        assert ran == Counter({"lookup 1": 1})
        done = await run.run(message_history=list(paused.messages))
        assert done.step is Step.COMPLETED
        assert ran == Counter({"lookup 1": 1, "charge 7": 1})
        assert kinds(ModelMessagesTypeAdapter.dump_python(list(done.messages),
                                                          mode="json")) == FINISHED

    run_async(go())


def test_messages_that_are_no_stop_of_a_run_without_a_history_are_refused() -> None:
    """The messages of another run (not any stop of this one) are refused before anything
    runs; the run's own older messages are brought up to what it wrote
    (tests/adapters/test_pydantic_ai_corners.py plays every stage)."""

    async def go() -> None:
        ran: Counter[str] = Counter()
        run = await LedgerRun.open(approval_agent(ran), run_id="nh", store=MemoryEventStore())
        await run.run("charge me 7")
        await run.approve("c1")
        other = await LedgerRun.open(approval_agent(Counter()), run_id="other",
                                     store=MemoryEventStore())
        foreign = (await other.run("charge me 8")).messages
        before = run.controller.events
        with pytest.raises(HistoryMismatch, match="not the messages of any stop"):
            await run.run(message_history=list(foreign))
        assert run.controller.events == before  # refused before anything is recorded
        assert ran == Counter({"lookup 1": 1})  # charge never ran

    run_async(go())


def _fresh_ids_agent(effects: Path, asked: list[list[ModelMessage]],
                     down: list[bool]) -> Agent[None, Any]:
    """``pay`` appends to ``effects`` (fsynced). The model asks for ``pay`` under a fresh
    call id, as a real model does, whenever the messages it is sent hold no result of it;
    with one it answers, or raises while ``down[0]`` is True (once)."""

    def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        asked.append(list(messages))
        if not any(part.part_kind == "tool-return" for message in messages
                   for part in message.parts):
            return ModelResponse(parts=[call("pay", f"id{len(asked)}", x=7)])
        if down[0]:
            down[0] = False
            raise ConnectionError("the model is unreachable")
        return ModelResponse(parts=[TextPart("done")])

    agent: Agent[None, Any] = Agent(FunctionModel(respond))

    @agent.tool_plain
    def pay(x: int) -> str:
        with effects.open("a") as file:
            file.write(f"pay {x}\n")
            file.flush()
            os.fsync(file.fileno())
        return f"charged {x}"

    return agent


@pytest.mark.invariant("I1")
@pytest.mark.parametrize("prompt", ["pay 7", None], ids=["same-prompt", "no-prompt"])
@pytest.mark.parametrize("given", ["omitted", "none", "empty"])
def test_a_retry_without_the_messages_the_run_wrote_is_refused_never_paid_again(
        tmp_path: Path, given: str, prompt: str | None) -> None:
    """A run without a history pays (its result written with the next model request),
    and that request fails: the caller, holding no messages of the run, retries with
    none. Sent only the prompt, the model would ask for ``pay`` again under a new call
    id; the retry is refused (`HistoryRequired`, naming the call the run wrote) before
    anything is recorded, and the messages the run wrote finish it, paying once."""

    async def go() -> None:
        effects = tmp_path / "effects.txt"
        asked: list[list[ModelMessage]] = []
        down = [True]
        path = tmp_path / "events.db"

        async def opened() -> LedgerRun:
            return await LedgerRun.open(_fresh_ids_agent(effects, asked, down),
                                        run_id="retry", store=SQLiteEventStore(path))

        with pytest.raises(ConnectionError):
            await (await opened()).run("pay 7")
        assert effects.read_text().splitlines() == ["pay 7"]
        written = asked[-1]  # the prompt, the call of pay, its result
        run = await opened()
        log = SQLiteEventStore(path).load("retry")
        options: dict[str, Any] = {} if given == "omitted" else {
            "message_history": None if given == "none" else []}
        with pytest.raises(HistoryRequired, match="'id1'"):
            await run.run(prompt, **options)
        assert SQLiteEventStore(path).load("retry") == log  # nothing recorded
        assert len(asked) == 2  # the model was not asked
        assert effects.read_text().splitlines() == ["pay 7"]
        done = await (await opened()).run(message_history=written)
        assert (done.step, done.output) == (Step.COMPLETED, "done")
        assert effects.read_text().splitlines() == ["pay 7"]  # paid once

    run_async(go())


# ------------------------------------------- rival writers on one SQLite file


FIRST_CALL, TOOL_BODY, SECOND_CALL = "first-model-call", "tool-body", "second-model-call"
USER, NEW_RUN, SAME_RUN = "user-appends", "another-run", "same-run-elsewhere"


def _rival_agent(name: str, paid: Counter[str], *,
                 during: dict[str, Callable[[], Any]] | None = None) -> Agent[None, Any]:
    """Run ``name``'s program: its model asks for ``pay`` (call id ``<name>-c1``) until the
    messages hold that call's result, then answers ``<name> done``; ``pay`` counts in
    ``paid`` by call id. ``during`` maps FIRST_CALL, SECOND_CALL and TOOL_BODY to the
    rival's move, made once while that request or the tool's body is under way."""
    during = dict(during or {})
    requests = [0]

    async def once(where: str) -> None:
        move = during.pop(where, None)
        if move is not None:
            await move()

    async def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        requests[0] += 1
        await once(FIRST_CALL if requests[0] == 1 else SECOND_CALL)
        if any(getattr(part, "tool_call_id", None) == f"{name}-c1"
               and part.part_kind == "tool-return" for message in messages
               for part in message.parts):
            return ModelResponse(parts=[TextPart(f"{name} done")])
        return ModelResponse(parts=[call("pay", f"{name}-c1", x=7)])

    agent: Agent[None, Any] = Agent(FunctionModel(respond))

    @agent.tool_plain
    async def pay(x: int) -> str:
        paid[f"{name}-c1"] += 1
        await once(TOOL_BODY)
        return f"charged {x}"

    return agent


def _a(*ends: tuple[str, str]) -> list[tuple[str, str]]:
    return [("request", "user-prompt a's prompt"), ("response", "tool-call a-c1"),
            ("request", "tool-return a-c1"), *ends]


_A_DONE = ("response", "text a done")
_X = ("request", "user-prompt a user's message")
_B_TURN = [("request", "user-prompt b's prompt"), ("response", "tool-call b-c1"),
           ("request", "tool-return b-c1"), ("response", "text b done")]

_AGAIN = "a's prompt"
"""The next attempt of a run whose first attempt was refused before anything of it was
durable gives its prompt again."""

RIVALS: dict[tuple[str, str], tuple[str, str, str | None, str, list[tuple[str, str]]]] = {
    # (rival, while): (a's attempt, the rival's, the prompt of a's next attempt, that
    # attempt's outcome, the history at the end)
    (USER, FIRST_CALL): ("ReconcileRejected", "written", _AGAIN, "completed",
                         [_X, *_a(_A_DONE)]),
    (USER, TOOL_BODY): ("ReconcileRejected", "written", None, "ToolInDoubt",
                        [*_a()[:2], _X]),
    (USER, SECOND_CALL): ("ReconcileRejected", "written", None, "completed",
                          _a(_X, _A_DONE)),
    (NEW_RUN, FIRST_CALL): ("ReconcileRejected", "completed", _AGAIN, "completed",
                            [*_B_TURN, *_a(_A_DONE)]),
    (NEW_RUN, TOOL_BODY): ("completed", "PublicationUnsettled", None, "completed",
                           _a(_A_DONE)),
    # (b answered last: a goes on with new input)
    (NEW_RUN, SECOND_CALL): ("ReconcileRejected", "completed", "go on", "completed",
                             _a(*_B_TURN, ("request", "user-prompt go on"), _A_DONE)),
    (SAME_RUN, TOOL_BODY): ("completed", "ToolInDoubt", None, "completed", _a(_A_DONE)),
    # (the history moved and so did the log: a store that checks the history's tail in
    # the append checks the log first; `_Unchecked` below gives ReconcileRejected)
    (SAME_RUN, SECOND_CALL): ("ConcurrencyConflict", "completed", None, "completed",
                              _a(_A_DONE)),
}
"""What the script makes of each rival (never what the ledger recorded): a write landing
in the history while run ``a``'s messages wait to be written refuses ``a``'s write
(nothing of it is recorded: its next attempt goes on from the history as it is, or
finds its tool in doubt when the result had not been made durable); a new run finds a
call of ``a`` without its result and is refused; the same run claimed elsewhere while
its tool runs finds that call in doubt, and while its second request is under way
finds its log moved (`ConcurrencyConflict`: the append checks the log before the
history)."""


class _Unchecked(SQLiteEventStore):
    """A store that does not say it checks a Session write's staged tail: the adapter
    reads the history's tail itself before each flush that writes to it (`_unmoved`)."""

    checks_session_tail = False


@pytest.mark.invariant("I1", "I7")
@pytest.mark.parametrize("checked", [True, False], ids=["store-checks", "adapter-reads"])
@pytest.mark.parametrize(("rival", "moment"), list(RIVALS),
                         ids=[f"{rival}-while-{moment}" for rival, moment in RIVALS])
def test_a_rival_writer_inside_a_turn_never_reruns_a_tool_nor_writes_on_a_stale_history(
        tmp_path: Path, rival: str, moment: str, checked: bool) -> None:
    """Run ``a`` (a run with its history in a SQLite file, the store's) pays once per turn;
    while its first model request, its tool's body or its second model request is under
    way, a rival writes to the same file through connections of its own: a user appends
    a message, another run of the conversation runs a turn, or the same run is opened
    and run elsewhere. ``a`` is then run again from the store. The tool never runs twice,
    no message is lost or written twice, and ``a`` never writes after a message it did
    not read: refused (`ReconcileRejected`) instead, as the script predicts: by the
    store, in the flush's own transaction, or by the adapter's read of the tail before
    the flush where the store does not check it (``checked``)."""
    a_attempt, rival_outcome, prompt, again_outcome, history = RIVALS[rival, moment]
    if not checked and (rival, moment) == (SAME_RUN, SECOND_CALL):
        a_attempt = "ReconcileRejected"  # (the adapter reads the history before the flush)
    path = tmp_path / "events.db"
    paid: Counter[str] = Counter()
    seen: dict[str, str] = {}
    said: dict[str, str] = {}

    async def outcome(attempt: Any) -> str:
        try:
            await attempt
        except ControlError as refused:
            said.setdefault(type(refused).__name__, str(refused))
            return type(refused).__name__
        return "completed"

    async def opened(name: str, run_id: str, **during: Any) -> LedgerRun:
        return await LedgerRun.open(_rival_agent(name, paid, during=during), run_id=run_id,
                                    history=SQLiteSession("h", path),
                                    store=(SQLiteEventStore if checked else _Unchecked)(path))

    async def move() -> None:
        if rival == USER:
            message = ModelRequest(parts=[UserPromptPart("a user's message")])
            elsewhere = SQLiteSession("h", path)
            try:
                await elsewhere.add_items(ModelMessagesTypeAdapter.dump_python(
                    [message], mode="json"))
            finally:
                elsewhere.close()
            seen["rival"] = "written"
        elif rival == NEW_RUN:
            seen["rival"] = await outcome((await opened("b", "b")).run("b's prompt"))
        else:
            seen["rival"] = await outcome((await opened("a", "a")).run())

    async def go() -> None:
        first = await opened("a", "a", **{moment: move})
        seen["a"] = await outcome(first.run("a's prompt"))
        seen["again"] = await outcome((await opened("a", "a")).run(prompt))

    run_async(go())
    assert (seen["a"], seen["rival"], seen["again"]) == (a_attempt, rival_outcome,
                                                         again_outcome)
    if seen["a"] == "ReconcileRejected":  # refused by whom the variant says
        assert ("another writer appended to it" if checked
                else "the history changed since") in said["ReconcileRejected"]
    assert paid["a-c1"] == 1  # never twice (and a refusal before the body: once, later)
    assert paid["b-c1"] == (1 if rival_outcome == "completed" and rival == NEW_RUN else 0)
    assert _shape(asyncio.run(SQLiteSession("h", path).get_items())) == history


# --------------------------------------------- differential: cancelled inside a tool


async def _cancel_inside_charge(start: Callable[[], Any], hang: asyncio.Event) -> None:
    task = asyncio.ensure_future(start())
    await asyncio.wait_for(hang.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_cancelled_inside_a_tool_pydantic_ai_alone_runs_it_again() -> None:
    async def go() -> None:
        ran: Counter[str] = Counter()
        hang = asyncio.Event()
        agent = billing(scripted([[call("charge", "c1", x=7)]]), ran, hang=hang)
        paused = await agent.run("charge me 7")
        saved = paused.all_messages()
        approved = DeferredToolResults(approvals={"c1": True})
        await _cancel_inside_charge(lambda: agent.run(message_history=saved,
                                                      deferred_tool_results=approved), hang)
        hang.clear()
        resumed = asyncio.ensure_future(agent.run(message_history=saved,
                                                  deferred_tool_results=approved))
        await asyncio.wait_for(hang.wait(), 10)
        resumed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await resumed
        assert ran["charge 7"] == 2  # what pydantic-ai alone does: the charge ran twice

    run_async(go())


@pytest.mark.invariant("I11")
@pytest.mark.parametrize("where", ["live", "store-reload"])
def test_cancelled_inside_a_tool_the_ledger_fails_closed_until_the_operator_resolves(
        where: str) -> None:
    async def go() -> None:
        ran: Counter[str] = Counter()
        hang = asyncio.Event()
        store = MemoryEventStore()
        history = MemorySession("h")
        run = await LedgerRun.open(billing(scripted([[call("charge", "c1", x=7)]]), ran,
                                           hang=hang), run_id="x", history=history,
                                   store=store)
        await run.run("charge me 7")
        await run.approve("c1")
        await _cancel_inside_charge(run.run, hang)
        assert ran["charge 7"] == 1
        if where == "store-reload":
            run = await LedgerRun.open(billing(scripted([[call("charge", "c1", x=7)]]), ran,
                                               hang=hang), run_id="x", history=history,
                                       store=store)
        for _ in range(2):  # every resume fails closed, before any work
            with pytest.raises(ToolInDoubt):
                await within(run.run())
        assert ran["charge 7"] == 1
        assert run.controller.in_doubt() == ("c1",)
        # the operator's path: establish the outcome outside the run and record it
        await run.resolve_in_doubt("c1", OPERATOR)
        done = await within(run.run())
        assert done.step is Step.COMPLETED
        assert OPERATOR in done.output.split(" | ")  # the model was told the recorded outcome
        assert ran["charge 7"] == 1  # never re-run

    run_async(go())


@pytest.mark.invariant("I11", "I12")
@pytest.mark.parametrize("kind", ["model-retry", "tool-failed"])
def test_an_operators_json_shaped_like_a_tools_answer_is_sent_as_its_output(
        kind: str) -> None:
    """The operator settles a call in doubt as completed with JSON that happens to have
    the shape of a recorded answer (``{"kind": "model-retry", "message": ...}``, the form
    the ledger keeps a tool's `ModelRetry` in). It is the call's output: the model is
    sent it as the tool's return, never a retry prompt or a failure built from it."""
    settled = {"kind": kind, "message": "charged 7 by hand"}

    async def go() -> None:
        ran: Counter[str] = Counter()
        hang = asyncio.Event()
        asked: list[list[ModelMessage]] = []
        run = await LedgerRun.open(billing(scripted([[call("charge", "c1", x=7)]],
                                                    asked=asked), ran, hang=hang),
                                   run_id="x", history=MemorySession("h"),
                                   store=MemoryEventStore())
        await run.run("charge me 7")
        await run.approve("c1")
        await _cancel_inside_charge(run.run, hang)
        await run.resolve_in_doubt("c1", settled)
        done = await within(run.run())
        assert done.step is Step.COMPLETED
        sent = [part for part in asked[-1][-1].parts
                if getattr(part, "tool_call_id", None) == "c1"]
        assert [(part.part_kind, getattr(part, "content", None)) for part in sent] == [
            ("tool-return", settled)]
        assert ran["charge 7"] == 1

    run_async(go())


@pytest.mark.invariant("I1", "I12")
def test_a_completed_call_is_resent_from_the_cache_never_run_again() -> None:
    """lookup completes, charge (no approval here) is cancelled in the same response; once
    the operator resolves charge, pydantic-ai asks for both calls again: lookup's result
    comes from the ledger (I12), its body does not run a second time."""

    async def go() -> None:
        ran: Counter[str] = Counter()
        hang = asyncio.Event()
        model = scripted([[call("lookup", "c2", i=1), call("charge", "c1", x=7)]])
        agent: Agent[None, Any] = Agent(model)

        @agent.tool_plain(sequential=True)
        def lookup(i: int) -> str:
            ran[f"lookup {i}"] += 1
            return f"found {i}"

        @agent.tool_plain(sequential=True)
        async def charge(x: int) -> str:
            ran[f"charge {x}"] += 1
            hang.set()
            await asyncio.Event().wait()
            return "unreachable"

        run = await LedgerRun.open(agent, run_id="r", history=MemorySession("h"),
                                   store=MemoryEventStore())
        await _cancel_inside_charge(lambda: run.run("go"), hang)
        assert run.controller.phase("c2") is Phase.COMPLETED
        await run.resolve_in_doubt("c1", OPERATOR)
        done = await within(run.run())
        assert done.step is Step.COMPLETED
        assert ran == Counter({"lookup 1": 1, "charge 7": 1})
        assert "found 1" in done.output
        assert OPERATOR in done.output

    run_async(go())


# ------------------------------------------------- differential: a reused call id


def test_a_reused_call_id_with_other_arguments_is_refused() -> None:
    turns = [[call("lookup", "c1", i=1)], [call("lookup", "c1", i=2)]]

    async def go() -> None:
        alone: Counter[str] = Counter()
        result = await billing(scripted(turns), alone).run("look")
        assert alone == Counter({"lookup 1": 1, "lookup 2": 1})  # pydantic-ai ran both
        assert isinstance(result.output, str)

        ran: Counter[str] = Counter()
        run = await LedgerRun.open(billing(scripted(turns), ran), run_id="d",
                                   history=MemorySession("h"), store=MemoryEventStore())
        with pytest.raises(InvalidTransition) as refused:
            await run.run("look")
        assert refused.value.action == "model_responded"  # refused before any call ran
        assert ran == Counter({"lookup 1": 1})
        assert run.controller.call("c1").call.arguments == {"i": 1}

    run_async(go())


# ----------------------------------------------------------------- processes


def _driver(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tests.drivers.pydantic_ai_driver", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)


def _effects(folder: Path) -> list[str]:
    path = folder / "effects.txt"
    return path.read_text().splitlines() if path.exists() else []


def test_kill_9_inside_a_tool_pydantic_ai_alone_runs_it_again(tmp_path: Path) -> None:
    assert _driver("alone-pause", str(tmp_path)).returncode == 0
    assert _driver("alone-crash", str(tmp_path)).returncode == -9
    resumed = _driver("alone-resume", str(tmp_path), "again")
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout)["output"] == "done: charged 7"
    assert _effects(tmp_path) == ["alone-crash tool charge", "again tool charge"]


@pytest.mark.invariant("I11")
@pytest.mark.parametrize("paused", [True, False], ids=["approved-call", "fresh-run"])
def test_kill_9_inside_a_tool_then_resume_fails_closed_and_the_operator_resolves(
        tmp_path: Path, paused: bool) -> None:
    if paused:
        assert _driver("pause", str(tmp_path)).returncode == 0
    crashed = _driver("crash" if paused else "crash-fresh", str(tmp_path))
    assert crashed.returncode == -9, crashed.stderr
    tool = "tool charge" if paused else "tool pay"
    assert _effects(tmp_path) == [f"crash {tool}"]
    for name in ("first", "second"):
        resumed = _driver("resume", str(tmp_path), name)
        answer = json.loads(resumed.stdout)
        assert "resolve_in_doubt" in answer.pop("message"), resumed.stderr
        assert answer == {"name": name, "outcome": "error", "error": "ToolInDoubt",
                          "step": "tools", "output": None}, resumed.stderr
    resolved = _driver("resolve", str(tmp_path), "operator")
    answer = json.loads(resolved.stdout)
    assert answer["outcome"] == "completed", resolved.stderr
    assert answer["output"] == "done: ran once (confirmed by the operator)"
    assert _effects(tmp_path) == [f"crash {tool}"]  # the tool never ran again
    reloaded = RunController.load(_store(tmp_path), "pa-run")
    assert reloaded.step is Step.COMPLETED


def _store(folder: Path) -> Any:
    return SQLiteEventStore(folder / "events.db")


# ------------------------- a failed write after approved and approval-free calls


@pytest.mark.parametrize("outcome", ["atomic", "commit_then_raise", "partial", "cancel"])
@pytest.mark.parametrize("write", [4, 5], ids=["charge-result", "final-answer"])
def test_a_failed_write_after_mixed_calls_is_recovered_by_the_next_attempt(
        write: int, outcome: str) -> None:
    """charge (approved) and lookup (no approval) come in one response. pydantic-ai merges
    the two requests that answer them (lookup's at the pause, charge's on the resume) into
    one when it is given the history back: the adapter counts what it wrote in
    pydantic-ai's own terms, so the first attempt after the failure completes."""

    async def go() -> None:
        # pydantic-ai alone: the caller saves the messages after each run; the save after
        # the resume fails, and the retry from the saved pause charges again
        alone: Counter[str] = Counter()
        agent = approval_agent(alone)
        saved = (await agent.run("charge me 7")).all_messages()
        approved = DeferredToolResults(approvals={"c1": True})
        await agent.run(message_history=saved, deferred_tool_results=approved)
        retried = await agent.run(message_history=saved, deferred_tool_results=approved)
        assert retried.output == "done | charged 7 | found 1"
        assert alone == Counter({"lookup 1": 1, "charge 7": 2})

        ran: Counter[str] = Counter()
        asked: list[list[ModelMessage]] = []
        inner = MemorySession("h")
        # the 4th write is charge's result (before the last model call), the 5th the answer
        history = FlakySession(inner, fail_on=write, outcome=outcome)  # type: ignore[arg-type]
        run = await LedgerRun.open(approval_agent(ran, asked=asked), run_id="m",
                                   history=history, store=MemoryEventStore())
        assert (await run.run("charge me 7")).step is Step.INTERRUPTION
        await run.approve("c1")
        with pytest.raises(asyncio.CancelledError if outcome == "cancel"
                           else InjectedWriteError):
            await run.run()
        before = len(asked)
        done = await run.run()  # the first attempt after the failure finishes the run
        assert done.step is Step.COMPLETED
        assert done.output == retried.output
        assert len(asked) - before == (1 if write == 4 else 0)  # the answer is asked once
        assert ran == Counter({"lookup 1": 1, "charge 7": 1})
        assert kinds(await inner.get_items()) == FINISHED

    run_async(go())


class LosesTheReadAfterAWrite(MemorySession):
    """A history whose first read after its first write fails: the read a write stages
    from, so the process stops with the model's response recorded and not written."""

    def __init__(self, session_id: str) -> None:
        super().__init__(session_id)
        self.writes = 0
        self.failed = False

    async def add_items(self, items: list[Any]) -> None:
        self.writes += 1
        await super().add_items(items)

    async def get_items(self, limit: int | None = None) -> list[Any]:
        if self.writes == 1 and not self.failed:
            self.failed = True
            raise ConnectionError("lost the connection")
        return await super().get_items(limit)


def test_a_response_recorded_and_not_written_is_written_from_the_ledger() -> None:
    """With a store that appends each event, the process can stop between the model's
    response (recorded) and its write: the next attempt writes the response's calls from
    the ledger before anything acts on them, and the run goes on without asking the
    model again."""

    async def go() -> None:
        ran: Counter[str] = Counter()
        asked: list[list[ModelMessage]] = []
        store = MemoryEventStore()
        history = LosesTheReadAfterAWrite("h")
        run = await LedgerRun.open(approval_agent(ran, asked=asked), run_id="lost",
                                   history=history, store=store)
        with pytest.raises(ConnectionError):
            await run.run("charge me 7")
        assert kinds(await history.get_items()) == PAUSE[:1]  # the prompt only
        assert ran == Counter()
        run = await LedgerRun.open(approval_agent(ran, asked=asked), run_id="lost",
                                   history=history, store=store)
        paused = await run.run()
        assert paused.step is Step.INTERRUPTION
        assert kinds(await history.get_items()) == PAUSE
        await run.approve("c1")
        done = await run.run()
        assert done.step is Step.COMPLETED
        assert ran == Counter({"lookup 1": 1, "charge 7": 1})
        assert len(asked) == 2  # the calls, then the answer: never asked again
        assert kinds(await history.get_items()) == FINISHED

    run_async(go())


def test_kill_9_during_or_after_a_write_pydantic_ai_alone_charges_again(
        tmp_path: Path) -> None:
    assert _driver("alone-mixed-pause", str(tmp_path)).returncode == 0
    assert _driver("alone-mixed-kill", str(tmp_path)).returncode == -9  # before the save
    resumed = _driver("alone-mixed-resume", str(tmp_path), "again")
    assert json.loads(resumed.stdout)["output"] == "done: charged 7", resumed.stderr
    assert Counter(_effects(tmp_path)) == Counter({
        "alone-mixed-pause tool lookup": 1, "alone-mixed-kill tool charge": 1,
        "again tool charge": 1, "alone-mixed-pause model": 1, "alone-mixed-kill model": 1,
        "again model": 1})


@pytest.mark.parametrize("when", ["during", "after"])
def test_kill_9_during_or_after_a_write_after_mixed_calls(tmp_path: Path, when: str) -> None:
    """The process dies inside the write of charge's result to the SQLite history: before
    its COMMIT (nothing landed) or right after it. The restart settles the write and
    finishes in one attempt; after a kill during the write the first restart is refused
    until it says the dead writer is gone (``take_over=True``), and says so."""
    assert _driver("mixed-pause", str(tmp_path)).returncode == 0
    killed = _driver("mixed-kill", str(tmp_path), when)
    assert killed.returncode == -9, killed.stderr
    if when == "during":
        refused = json.loads(_driver("mixed-resume", str(tmp_path), "first").stdout)
        assert refused["error"] == "ReconcileRejected"
        assert "an attempt may still be writing" in refused["message"]
        assert "LedgerRun.open(..., take_over=True)" in refused["message"]
        resumed = _driver("mixed-resume", str(tmp_path), "second", "take-over")
    else:
        resumed = _driver("mixed-resume", str(tmp_path), "second")
    answer = json.loads(resumed.stdout)
    assert answer["outcome"] == "completed", (answer, resumed.stderr)
    assert answer["output"] == "done: charged 7"
    assert Counter(_effects(tmp_path)) == Counter({
        "mixed-pause tool lookup": 1, "mixed-kill tool charge": 1,
        "mixed-pause model": 1, "second model": 1})  # the answer is asked once
    reloaded = RunController.load(_store(tmp_path), "pa-run")
    assert reloaded.step is Step.COMPLETED


# --------------------------------------- results pydantic-ai sends in its own form


class Receipt(pydantic.BaseModel):
    when: datetime.datetime
    amount: int


RESULTS: dict[str, Callable[[], Any]] = {
    "bytes": lambda: b"\xff\x00 receipt",
    "pydantic-model": lambda: Receipt(when=datetime.datetime(2024, 1, 1, 9, 30), amount=7),
    "binary-content": lambda: BinaryContent(b"\x89PNG\r\n", media_type="image/png"),
    "tool-return": lambda: ToolReturn(return_value={"ok": True}, content=["see the receipt"],
                                      metadata={"receipt": 1}),
    "looks-like-an-answer": lambda: {"kind": "tool-failed", "message": "not a failure"},
    "model-retry": lambda: _raise(ModelRetry("ask for the receipt again")),
    "tool-failed": lambda: _raise(ToolFailed("no receipt for this order")),
}
"""What ``receipt`` returns (or raises: its answers, recorded like a result)."""


def _raise(error: Exception) -> Any:
    raise error


def _seen(messages: list[ModelMessage], call_id: str) -> list[Any]:
    """What the model was sent about ``call_id`` in its last request: the parts answering
    it (and the user content a `ToolReturn` adds) in pydantic-ai's JSON form, their text
    for the model and the media of their files; without the fields that differ from run
    to run, and the digests of files the content holds (pydantic-ai writes them for raw
    bytes, not for the same content read back from a history)."""
    request = messages[-1]
    dumped = ModelMessagesTypeAdapter.dump_python([request], mode="json")[0]["parts"]
    volatile = {"timestamp", "run_id", "conversation_id", "content_file_digests"}
    seen = []
    for part, form in zip(request.parts, dumped, strict=True):
        if getattr(part, "tool_call_id", None) not in (call_id, None):
            continue
        if part.part_kind == "system-prompt":
            continue
        text = part.model_response_str() if isinstance(part, ToolReturnPart) else None
        files = ([(file.kind, getattr(file, "media_type", None), getattr(file, "is_image", None))
                  for file in part.files] if isinstance(part, ToolReturnPart) else None)
        seen.append(({key: value for key, value in form.items() if key not in volatile},
                     text, files))
    return seen


@pytest.mark.parametrize("kind", list(RESULTS))
def test_a_result_that_is_not_json_is_resent_exactly_as_pydantic_ai_sent_it(kind: str) -> None:
    """receipt returns something that is not a JSON value; charge, in the same response,
    is cancelled inside its body, so receipt's result is recorded and not yet written.
    After the operator resolves charge, the retry resends receipt's result from the
    ledger: the model is sent exactly what pydantic-ai alone sent it."""
    turns = [[call("receipt", "c2"), call("charge", "c1", x=7)]]

    def agent(ran: Counter[str], asked: list[list[ModelMessage]],
              hang: asyncio.Event | None) -> Agent[None, Any]:
        the_agent: Agent[None, Any] = Agent(scripted(turns, asked=asked))

        @the_agent.tool_plain(sequential=True)
        def receipt() -> Any:
            ran["receipt"] += 1
            return RESULTS[kind]()

        @the_agent.tool_plain(sequential=True)
        async def charge(x: int) -> str:
            ran[f"charge {x}"] += 1
            if hang is not None:
                hang.set()
                await asyncio.Event().wait()
            return OPERATOR

        return the_agent

    async def go() -> None:
        asked_alone: list[list[ModelMessage]] = []
        await agent(Counter(), asked_alone, None).run("go")
        sent = _seen(asked_alone[-1], "c2")

        ran: Counter[str] = Counter()
        asked: list[list[ModelMessage]] = []
        hang = asyncio.Event()
        history = MemorySession("h")
        run = await LedgerRun.open(agent(ran, asked, hang), run_id="nj", history=history,
                                   store=MemoryEventStore())
        await _cancel_inside_charge(lambda: run.run("go"), hang)
        assert run.controller.phase("c2") is Phase.COMPLETED
        await run.resolve_in_doubt("c1", OPERATOR)
        done = await within(run.run())
        assert done.step is Step.COMPLETED
        assert ran == Counter({"receipt": 1, "charge 7": 1})
        assert _seen(asked[-1], "c2") == sent
        stored = _messages_of(await history.get_items())
        assert _seen(stored[:3], "c2") == sent  # the history holds what the model was sent

    run_async(go())


def _messages_of(items: list[Any]) -> list[ModelMessage]:
    return ModelMessagesTypeAdapter.validate_python(items)


def test_a_tool_that_raises_is_a_failure_the_model_is_told_of_never_in_doubt() -> None:
    """An ordinary exception from a tool body: pydantic-ai raises it out of ``agent.run``,
    and a retry runs the body again. Through the ledger it is raised out of `LedgerRun.run`
    too, and the call is recorded as failed (not in doubt: the body ended); the next
    attempt tells the model, never running the body again."""
    turns = [[call("charge", "c1", x=7)]]

    def agent(ran: Counter[str], asked: list[list[ModelMessage]]) -> Agent[None, Any]:
        the_agent: Agent[None, Any] = Agent(scripted(turns, asked=asked))

        @the_agent.tool_plain
        def charge(x: int) -> str:
            ran[f"charge {x}"] += 1
            raise ValueError("card declined")

        return the_agent

    async def go() -> None:
        alone: Counter[str] = Counter()
        for _ in range(2):
            with pytest.raises(ValueError, match="card declined"):
                await agent(alone, []).run("charge me 7")
        assert alone == Counter({"charge 7": 2})

        ran: Counter[str] = Counter()
        asked: list[list[ModelMessage]] = []
        run = await LedgerRun.open(agent(ran, asked), run_id="raises",
                                   history=MemorySession("h"), store=MemoryEventStore())
        with pytest.raises(ValueError, match="card declined"):
            await run.run("charge me 7")
        assert run.controller.phase("c1") is Phase.COMPLETED
        assert run.controller.in_doubt() == ()
        done = await run.run()
        assert done.step is Step.COMPLETED
        assert ran == Counter({"charge 7": 1})
        (told,) = [part for part in asked[-1][-1].parts if part.part_kind == "tool-return"]
        assert told.outcome == "failed"
        assert told.model_response_str() == '{"error":"ValueError: card declined"}'

    run_async(go())


# ------------------------------------------------------------------ streaming


def test_run_stream_with_the_capability_is_refused_before_any_effect() -> None:
    """pydantic-ai's other ways to drive a run (``run_stream``, ``iter``, and ``run`` given
    the capability by hand) would run the tools with no one to write the messages or
    accept the answer: refused when that run starts, before the model or a tool."""

    async def go() -> None:
        alone: Counter[str] = Counter()
        agent = billing(scripted([[call("lookup", "c2", i=1)]]), alone)
        async with agent.run_stream("look") as streamed:
            assert await streamed.get_output() == "done | found 1"
        assert alone == Counter({"lookup 1": 1})

        ran: Counter[str] = Counter()
        asked: list[list[ModelMessage]] = []
        agent = billing(scripted([[call("lookup", "c2", i=1)]], asked=asked), ran)
        run = await LedgerRun.open(agent, run_id="st", history=MemorySession("h"),
                                   store=MemoryEventStore())
        events = run.controller.events
        with pytest.raises(UnsupportedRun) as refused:
            async with agent.run_stream("look", capabilities=[run.capability]) as streamed:
                await streamed.get_output()
        assert "run_stream" in str(refused.value)
        with pytest.raises(UnsupportedRun):
            await _iterate(agent.iter("look", capabilities=[run.capability]))
        with pytest.raises(UnsupportedRun):
            await agent.run("look", capabilities=[run.capability])
        assert (ran, asked, run.controller.events) == (Counter(), [], events)
        done = await run.run("look")  # the run itself is untouched
        assert done.step is Step.COMPLETED
        assert done.output == "done | found 1"
        assert ran == Counter({"lookup 1": 1})

    run_async(go())


async def _iterate(driven: Any) -> None:
    async with driven as nodes:
        async for _ in nodes:
            pass


def test_a_history_processor_is_refused_when_the_run_is_opened_or_given_one() -> None:
    """A history processor (``ProcessHistory``) rewrites the messages pydantic-ai holds,
    those already written included: refused before anything is recorded."""

    def keep_last(messages: list[ModelMessage]) -> list[ModelMessage]:
        return messages[-1:]

    async def go() -> None:
        ran: Counter[str] = Counter()
        store = MemoryEventStore()
        agent = billing(scripted([[call("lookup", "c2", i=1)]]), ran)
        agent_with: Agent[None, Any] = Agent(scripted([]),
                                             capabilities=[ProcessHistory(keep_last)])
        with pytest.raises(UnsupportedCapability, match="ProcessHistory"):
            await LedgerRun.open(agent_with, run_id="hp", history=MemorySession("h"),
                                 store=store)
        assert store.list_runs() == ()
        run = await LedgerRun.open(agent, run_id="hp", history=MemorySession("h"),
                                   store=store)
        events = run.controller.events
        with pytest.raises(UnsupportedCapability):
            await run.run("look", capabilities=[ProcessHistory(keep_last)])
        assert (ran, run.controller.events) == (Counter(), events)
        assert (await run.run("look")).step is Step.COMPLETED

    run_async(go())


# ---------------------------------------------------- a history that is not the run's


def test_a_history_that_is_not_the_runs_is_refused_at_open_naming_it() -> None:
    async def go() -> None:
        ran: Counter[str] = Counter()
        store = MemoryEventStore()
        run = await LedgerRun.open(approval_agent(ran), run_id="w",
                                   history=MemorySession("orders-7"), store=store)
        await run.run("charge me 7")
        await run.approve("c1")
        log = store.load("w")
        for wrong, named in ((MemorySession("orders-8"), ("orders-8", "orders-7")),
                             (None, ("orders-7",))):
            with pytest.raises(HistoryMismatch) as refused:
                await LedgerRun.open(approval_agent(ran), run_id="w", history=wrong,
                                     store=store)
            for name in named:
                assert repr(name) in str(refused.value)
        assert store.load("w") == log  # nothing recorded: no claim, no step taken
        assert ran == Counter({"lookup 1": 1})

        private = await LedgerRun.open(approval_agent(ran), run_id="p", store=store)
        await private.run("charge me 7")
        with pytest.raises(HistoryMismatch, match="without a history"):
            await LedgerRun.open(approval_agent(ran), run_id="p",
                                 history=MemorySession("orders-9"), store=store)

    run_async(go())


# ------------------------------------------------------------ results over max_bytes

MAX_BYTES = 400_000


def _export_agent(ran: Counter[str], asked: list[list[ModelMessage]],
                  turns: list[list[ToolCallPart]]) -> Agent[None, Any]:
    agent: Agent[None, Any] = Agent(scripted(turns, asked=asked))

    @agent.tool_plain
    def export(n: int) -> str:
        ran[f"export {n}"] += 1
        return f"card-4111-{n} " + "x" * n

    return agent


def test_a_result_over_the_runs_limit_is_recorded_as_failed_and_the_model_is_told(
        tmp_path: Path) -> None:
    """A result the run's log has no room for under ``max_bytes`` (it is recorded, then
    written with the messages: it must fit twice) is not recorded: the call is recorded as
    failed, the model is told why, and the run goes on; nothing is left in doubt.
    pydantic-ai alone sends the result."""
    turns = [[call("export", "c1", n=250_000)]]

    async def go() -> None:
        asked_alone: list[list[ModelMessage]] = []
        alone = await _export_agent(Counter(), asked_alone, turns).run("export")
        assert "card-4111-250000" in alone.output

        ran: Counter[str] = Counter()
        asked: list[list[ModelMessage]] = []
        store = SQLiteEventStore(tmp_path / "events.db")
        run = await LedgerRun.open(_export_agent(ran, asked, turns), run_id="big",
                                   history=SQLiteSession("h", tmp_path / "history.db"),
                                   store=store, max_bytes=MAX_BYTES)
        done = await run.run("export")
        assert done.step is Step.COMPLETED
        assert ran == Counter({"export 250000": 1})
        (told,) = [part for part in asked[-1][-1].parts if part.part_kind == "tool-return"]
        assert told.outcome == "failed"
        assert "not recorded or sent" in told.model_response_str()
        assert "card-4111" not in done.output
        store.close()
        reloaded = RunController.load(SQLiteEventStore(tmp_path / "events.db"), "big",
                                      max_bytes=MAX_BYTES)
        assert reloaded.step is Step.COMPLETED
        assert reloaded.in_doubt() == ()
        for path in tmp_path.iterdir():  # the result itself was never persisted
            assert b"card-4111" not in path.read_bytes(), path.name

    run_async(go())


def test_a_run_with_no_room_left_for_results_is_refused_before_the_bodies_run() -> None:
    """Before a response's calls run, the log must have room for each to end in a recorded
    failure; when it has not, none of them starts and none is in doubt: refused again on
    the next attempt."""
    turns = [[call("export", "c1", n=10), call("export", "c2", n=20)]]

    async def go() -> None:
        ran: Counter[str] = Counter()
        run = await LedgerRun.open(_export_agent(ran, [], turns), run_id="room",
                                   history=MemorySession("h"), store=MemoryEventStore(),
                                   max_bytes=20_000)
        for prompt in ("export", None):
            with pytest.raises(SchemaError, match="max_bytes=20000") as refused:
                await run.run(prompt)
            assert "2 call(s) were not started" in str(refused.value)
            assert ran == Counter()
            c = run.controller
            assert c.in_doubt() == ()
            assert (c.phase("c1"), c.phase("c2")) == (Phase.APPROVED, Phase.APPROVED)

    run_async(go())


# ------------------------------------------------------- a redacting tool output hook


def _redact(value: Any) -> Any:
    return re.sub(r"\d{4} \d{4} \d{4} (\d{4})", r"**** **** **** \1", str(value))


@dataclass
class RedactsAround(AbstractCapability[Any]):
    """Redacts a tool's result around the tool's execution (``wrap_tool_execute``)."""

    async def wrap_tool_execute(self, ctx: Any, *, call: Any, tool_def: Any, args: Any,
                                handler: Any) -> Any:
        return _redact(await handler(args))


@dataclass
class RedactsAfter(AbstractCapability[Any]):
    """Redacts a tool's result in the hook after it (``after_tool_execute``)."""

    async def after_tool_execute(self, ctx: Any, *, call: Any, tool_def: Any, args: Any,
                                 result: Any) -> Any:
        return _redact(result)


CARD = "4111 1111 1111 1234"


@pytest.mark.parametrize("where", ["wrap-on-the-agent", "wrap-on-the-run", "after-hook"])
def test_a_redacting_tool_output_hook_the_ledger_keeps_only_what_the_model_saw(
        tmp_path: Path, where: str) -> None:
    """pydantic-ai has no tool output guardrail; its nearest equivalent is a capability
    that rewrites a tool's result. The ledger records what the model is sent, so the card
    number is nowhere in the event store or the history."""
    redactor: AbstractCapability[Any] = RedactsAfter() if where == "after-hook" else (
        RedactsAround())

    def agent(ran: Counter[str], asked: list[list[ModelMessage]]) -> Agent[None, Any]:
        on_agent = [redactor] if where != "wrap-on-the-run" else []
        the_agent: Agent[None, Any] = Agent(scripted([[call("card", "c1")]], asked=asked),
                                            capabilities=on_agent)

        @the_agent.tool_plain
        def card() -> str:
            ran["card"] += 1
            return f"card {CARD}"

        return the_agent

    on_run = [redactor] if where == "wrap-on-the-run" else []

    async def go() -> None:
        alone = await agent(Counter(), []).run("card", capabilities=on_run)
        assert alone.output == "done | card **** **** **** 1234"

        ran: Counter[str] = Counter()
        store = SQLiteEventStore(tmp_path / "events.db")
        history = SQLiteSession("h", tmp_path / "history.db")
        run = await LedgerRun.open(agent(ran, []), run_id="red", history=history,
                                   store=store)
        done = await run.run("card", capabilities=on_run)
        assert done.output == alone.output
        assert run.controller.call("c1").result == "card **** **** **** 1234"
        store.close()
        history.close()
        for path in tmp_path.iterdir():
            assert CARD.encode() not in path.read_bytes(), path.name

    run_async(go())


# ------------------------------------------------------------ a completed run, again


def test_running_a_completed_run_again_returns_its_recorded_result() -> None:
    """A request retried after it completed (the caller did not see the answer): pydantic-
    ai alone runs it again; the ledger answers with the recorded result, calling neither
    the model nor a tool, and says so."""
    turns = [[call("lookup", "c1", i=1)]]

    async def go() -> None:
        alone: Counter[str] = Counter()
        agent = billing(scripted(turns), alone)
        for _ in range(2):
            await agent.run("look")
        assert alone == Counter({"lookup 1": 2})

        ran: Counter[str] = Counter()
        asked: list[list[ModelMessage]] = []
        store = MemoryEventStore()
        history = MemorySession("h")
        first = await LedgerRun.open(billing(scripted(turns, asked=asked), ran),
                                     run_id="again", history=history, store=store)
        done = await first.run("look")
        assert (done.output, done.recorded) == ("done | found 1", False)
        log = store.load("again")
        for attempt in range(3):
            run = first if attempt == 0 else await LedgerRun.open(
                billing(scripted(turns, asked=asked), ran), run_id="again",
                history=history, store=store)
            again = await run.run("look" if attempt < 2 else None)
            assert again.step is Step.COMPLETED
            assert again.recorded is True
            assert again.output == "done | found 1"
            assert kinds(ModelMessagesTypeAdapter.dump_python(list(again.messages),
                                                              mode="json")) == kinds(
                await history.get_items())
        assert len(asked) == 2  # the two model calls of the first attempt, no more
        assert ran == Counter({"lookup 1": 1})
        assert store.load("again") == log  # nothing recorded

    run_async(go())


def test_a_completed_run_answers_with_the_history_as_it_is_now(tmp_path: Path) -> None:
    """An attempt reads the history once and follows it with what it writes; a later
    call on the same `LedgerRun` reads it again. Run ``a`` completes, run ``b`` goes on
    in the same conversation (its own turn, written after ``a``'s), then ``a`` is asked
    its prompt again: its recorded answer comes with the history as the file holds it
    now, ``b``'s turn included, not as ``a`` last saw it."""
    turns = [[call("lookup", "c1", i=1)]]

    async def go() -> None:
        ran: Counter[str] = Counter()
        path = tmp_path / "events.db"
        store = SQLiteEventStore(path)
        history = SQLiteSession("h", path)
        first = await LedgerRun.open(billing(scripted(turns), ran), run_id="a",
                                     history=history, store=store)
        await first.run("look")
        # (the scripted model counts the responses it is sent: a's two come first)
        later = [[], [], [call("lookup", "c2", i=2)]]
        second = await LedgerRun.open(billing(scripted(later), ran), run_id="b",
                                      history=history, store=store)
        assert (await second.run("look again")).output == "done | found 2"
        again = await first.run("look")
        assert again.recorded is True
        held = await SQLiteSession("h", path).get_items()  # read apart, afresh
        assert len(held) == 8  # each turn: prompt, call, result, answer
        assert kinds(ModelMessagesTypeAdapter.dump_python(list(again.messages),
                                                          mode="json")) == kinds(held)
        assert ran == Counter({"lookup 1": 1, "lookup 2": 1})

    run_async(go())


# ------------------------------------------- a final output is accepted after its checks


def test_a_crash_while_the_model_answers_after_a_tool_leaves_the_call_completed(
        tmp_path: Path) -> None:
    """The process dies while the model is asked again after ``pay`` (the longest wait of
    a turn), the history in the store's file: the result and the message carrying it
    were made durable before that request, so what the store holds while the model is
    asked (what the crash leaves) is the call completed and written, never in doubt; the
    next attempt asks the model again and completes, ``pay`` having run once."""
    path = tmp_path / "events.db"
    paid: Counter[str] = Counter()
    durable: list[tuple[Any, ...]] = []
    store = DiesWithItsProcess(path)

    async def dies(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if len(messages) == 1:
            return ModelResponse(parts=[call("pay", "c1", x=7)])
        store.dead = True  # asked again, after the tool: the process dies here
        apart = SQLiteEventStore(path, readonly=True)
        try:
            held = RunController.load(apart, "r")
            durable.append((held.phase("c1"), held.in_doubt()))
        finally:
            apart.close()
        durable.append(tuple(_shape(await SQLiteSession("h", path).get_items())))
        raise Crash

    def agent(respond: Any) -> Agent[None, Any]:
        built: Agent[None, Any] = Agent(FunctionModel(respond))

        @built.tool_plain
        def pay(x: int) -> str:
            paid[f"pay {x}"] += 1
            return f"charged {x}"

        return built

    asked: list[list[ModelMessage]] = []

    def answers(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        asked.append(list(messages))
        return ModelResponse(parts=[TextPart("paid")])

    async def go() -> None:
        with pytest.raises(Crash):
            await (await LedgerRun.open(agent(dies), run_id="r", store=store,
                                        history=SQLiteSession("h", path))).run("pay 7")
        written = [("request", "user-prompt pay 7"), ("response", "tool-call c1"),
                   ("request", "tool-return c1")]
        assert durable == [(Phase.PUBLISHED, ()), tuple(written)]
        again = await LedgerRun.open(agent(answers), run_id="r",
                                     store=SQLiteEventStore(path),
                                     history=SQLiteSession("h", path))
        done = await again.run()
        assert (done.step, done.output) == (Step.COMPLETED, "paid")
        assert [_shape(ModelMessagesTypeAdapter.dump_python(messages, mode="json"))
                for messages in asked] == [written]
        assert _shape(await SQLiteSession("h", path).get_items()) == [
            *written, ("response", "text paid")]

    run_async(go())
    assert paid == Counter({"pay 7": 1})


class DiesBeforeAcceptance(MemoryEventStore):
    """A store appending per event whose process dies (`Crash`) at the first append of a
    final output's acceptance: the model's response is recorded, its acceptance is not."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = True

    def append(self, run_id: str, events: Any, expected_version: int, **kw: Any) -> None:
        if self.armed and any(isinstance(e, ev.FinalOutputAccepted) for e in events):
            self.armed = False
            raise Crash
        super().append(run_id, events, expected_version, **kw)


def checked(answers: list[Any], asked: list[int], checks: list[Any], *,
            output_type: Any = str, crash_in_check: bool = False,
            refuse: str | None = "FORBIDDEN") -> Agent[None, Any]:
    """An agent whose model answers its n-th call with ``answers[n]`` (a text, or the
    arguments of the structured output) and whose output validator refuses (ModelRetry)
    an output holding ``refuse``; each check appends the output it saw to ``checks``;
    with ``crash_in_check`` the first check dies (`Crash`)."""

    def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        answer = answers[len(asked)]
        asked.append(1)
        if isinstance(answer, str):
            return ModelResponse(parts=[TextPart(answer)])
        (tool,) = info.output_tools
        return ModelResponse(parts=[call(tool.name, f"o{len(asked)}", **answer)])

    agent: Agent[None, Any] = Agent(FunctionModel(respond), output_type=output_type)

    @agent.output_validator
    def check(output: Any) -> Any:
        checks.append(output)
        if crash_in_check and len(checks) == 1:
            raise Crash
        if refuse is not None and refuse in str(output):
            raise ModelRetry("that answer is not allowed")
        return output

    return agent


def test_an_output_refused_by_a_validator_asks_the_model_again() -> None:
    """pydantic-ai alone asks the model again when a validator refuses its output; through
    the ledger the same, and the refused output is never accepted."""

    async def go() -> None:
        asked: list[int] = []
        checks: list[Any]
        alone = await checked(["FORBIDDEN", "fine"], asked, []).run("hi")
        assert (alone.output, len(asked)) == ("fine", 2)

        asked, checks = [], []
        run = await LedgerRun.open(checked(["FORBIDDEN", "fine"], asked, checks),
                                   run_id="v", history=MemorySession("h"),
                                   store=MemoryEventStore())
        done = await run.run("hi")
        assert (done.step, done.output, len(asked)) == (Step.COMPLETED, "fine", 2)
        assert checks == ["FORBIDDEN", "fine"]
        assert run.controller.final_output == "fine"

    run_async(go())


def test_a_crash_inside_the_output_checks_never_accepts_the_unchecked_output() -> None:
    """The process dies while the validator checks the model's answer: the restart never
    accepts that answer unchecked (it was never recorded as accepted); the refused answer
    goes back to the model."""

    async def go() -> None:
        asked: list[int] = []
        checks: list[Any] = []
        store, history = MemoryEventStore(), MemorySession("h")
        answers = ["FORBIDDEN", "FORBIDDEN", "fine"]
        run = await LedgerRun.open(checked(answers, asked, checks, crash_in_check=True),
                                   run_id="k", history=history, store=store)
        with pytest.raises(Crash):
            await run.run("hi")
        run = await LedgerRun.open(checked(answers, asked, checks), run_id="k",
                                   history=history, store=store)
        done = await run.run()
        assert (done.step, done.output) == (Step.COMPLETED, "fine")
        assert "FORBIDDEN" not in json.dumps(run.controller.final_output)
        assert checks[1:] == ["FORBIDDEN", "fine"]  # every later answer was checked

    run_async(go())


class Order(pydantic.BaseModel):
    item: str
    amount: int


@pytest.mark.parametrize("output", ["text", "structured"])
def test_a_crash_before_the_acceptance_hands_the_recorded_answer_back_to_its_checks(
        output: str) -> None:
    """The model's answer is recorded, and the process dies before its acceptance: the
    restart hands the recorded answer back to pydantic-ai instead of calling the model
    (no second model call), its checks run on it, and pydantic-ai writes its own messages
    for it (a structured output's output-tool call and return)."""
    answer: Any = "fine" if output == "text" else {"item": "tea", "amount": 2}
    output_type: Any = str if output == "text" else Order

    async def go() -> None:
        asked: list[int] = []
        checks: list[Any] = []
        store, history = DiesBeforeAcceptance(), MemorySession("h")
        run = await LedgerRun.open(checked([answer], asked, checks, output_type=output_type),
                                   run_id="s", history=history, store=store,
                                   buffered=False)  # the answer recorded at once
        with pytest.raises(Crash):
            await run.run("hi")
        assert len(checks) == 1
        run = await LedgerRun.open(checked([answer], asked, checks, output_type=output_type),
                                   run_id="s", history=history, store=store,
                                   buffered=False)  # the answer recorded at once
        done = await run.run()
        assert done.step is Step.COMPLETED
        assert len(asked) == 1  # the model was not called again
        assert len(checks) == 2  # the checks ran on the recorded answer
        expected = answer if output == "text" else Order(**answer)
        assert done.output == expected
        shape = kinds(await history.get_items())
        if output == "text":
            assert shape == [("request", [("user-prompt", None)]),
                             ("response", [("text", None)])]
        else:
            assert shape == [("request", [("user-prompt", None)]),
                             ("response", [("tool-call", "o1")]),
                             ("request", [("tool-return", "o1")])]
        assert RunController.load(store, "s").step is Step.COMPLETED

    run_async(go())


def test_a_recorded_answer_its_checks_refuse_after_a_crash_is_never_accepted() -> None:
    """An answer recorded before a check that now refuses it (the run was recorded with
    no validator, and is resumed by an agent with one): refused with a typed error,
    nothing accepted, the model not asked again."""

    async def go() -> None:
        asked: list[int] = []
        checks: list[Any] = []
        store, history = DiesBeforeAcceptance(), MemorySession("h")
        run = await LedgerRun.open(checked(["FORBIDDEN"], asked, checks, refuse=None),
                                   run_id="r", history=history, store=store,
                                   buffered=False)
        with pytest.raises(Crash):
            await run.run("hi")
        for _ in range(2):
            run = await LedgerRun.open(checked(["FORBIDDEN", "fine"], asked, checks),
                                       run_id="r", history=history, store=store,
                                       buffered=False)
            with pytest.raises(RecordedOutputRefused):
                await run.run()
            assert run.controller.step is Step.FINALIZING
            assert run.controller.final_output is None
        assert len(asked) == 1

    run_async(go())


# --------------------------------------------------- a completed run and a new prompt


def test_a_completed_run_answers_only_its_own_prompt_again() -> None:
    turns = [[call("lookup", "c1", i=1)]]

    async def go() -> None:
        ran: Counter[str] = Counter()
        asked: list[list[ModelMessage]] = []
        store = MemoryEventStore()
        for history in (MemorySession("h"), None):
            run_id = "p" if history is not None else "p-private"
            run = await LedgerRun.open(billing(scripted(turns, asked=asked), ran),
                                       run_id=run_id, history=history, store=store)
            await run.run("look")
            log = store.load(run_id)
            before = len(asked)
            again = await run.run("look")
            assert (again.recorded, again.output) == (True, "done | found 1")
            with pytest.raises(RunNotResumable):
                await run.run("look at something else")
            reopened = await LedgerRun.open(billing(scripted(turns, asked=asked), ran),
                                            run_id=run_id, history=history, store=store)
            with pytest.raises(RunNotResumable):
                await reopened.run("look at something else")
            assert (await reopened.run("look")).recorded is True
            assert len(asked) == before  # no model call
            assert store.load(run_id) == log  # nothing recorded
        assert ran == Counter({"lookup 1": 2})

    run_async(go())


# ------------------------------------------------------------------- tool timeouts


def _count(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def _timing_out(path: Path, asked: list[list[ModelMessage]]) -> Agent[None, Any]:
    """``pay`` (timeout 0.2 s) appends a line to ``path`` (fsynced) and then blocks its
    thread for 0.6 s the first time; the model asks for it again (a new call id) when it
    is told it timed out."""
    turns = [[call("pay", "c1", x=7)], [call("pay", "c2", x=7)]]
    agent: Agent[None, Any] = Agent(scripted(turns, asked=asked))

    @agent.tool_plain(timeout=0.2)
    def pay(x: int) -> str:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, b"paid\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        if _count(path) == 1:
            time.sleep(0.6)
        return f"paid {x}"

    return agent


def test_a_tool_that_times_out_is_in_doubt_never_asked_for_again(tmp_path: Path) -> None:
    async def go() -> None:
        alone = tmp_path / "alone.txt"
        await _timing_out(alone, []).run("pay")
        await asyncio.sleep(0.8)  # the abandoned thread ends
        assert _count(alone) == 2  # pydantic-ai alone: the model asked again, paid twice

        paid = tmp_path / "ledger.txt"
        asked: list[list[ModelMessage]] = []
        store, history = MemoryEventStore(), MemorySession("h")
        run = await LedgerRun.open(_timing_out(paid, asked), run_id="t", history=history,
                                   store=store)
        with pytest.raises(ToolInDoubt) as refused:
            await run.run("pay")
        assert refused.value.call_id == "c1"
        await asyncio.sleep(0.8)
        for _ in range(2):
            run = await LedgerRun.open(_timing_out(paid, asked), run_id="t",
                                       history=history, store=store)
            with pytest.raises(ToolInDoubt):
                await run.run()
        assert _count(paid) == 1
        assert len(asked) == 1  # the model was never told to try again

    run_async(go())


def test_a_tool_raising_model_retry_itself_is_still_its_answer() -> None:
    """Only pydantic-ai's own timeout leaves a call in doubt: a body that raises
    ModelRetry while handling a TimeoutError of its own has answered."""
    turns = [[call("fetch", "c1")]]

    async def go() -> None:
        agent: Agent[None, Any] = Agent(scripted(turns))

        @agent.tool_plain(timeout=5)
        def fetch() -> str:
            try:
                raise TimeoutError("upstream")
            except TimeoutError:
                raise ModelRetry("upstream timed out, try later") from None

        run = await LedgerRun.open(agent, run_id="m", history=MemorySession("h"),
                                   store=MemoryEventStore())
        done = await run.run("fetch")
        assert done.step is Step.COMPLETED
        assert run.controller.call("c1").result == {
            "kind": "model-retry", "message": "upstream timed out, try later"}

    run_async(go())


# ------------------------------------------------------------------- external tools


SHIP = ToolDefinition(name="ship", parameters_json_schema={
    "type": "object", "properties": {"to": {"type": "string"}}})


def test_external_tools_are_refused_before_any_model_call() -> None:
    async def go() -> None:
        asked: list[list[ModelMessage]] = []
        store = MemoryEventStore()
        model = scripted([[call("ship", "c1", to="x")]], asked=asked)
        agent: Agent[None, Any] = Agent(model, output_type=[str, DeferredToolRequests],
                                        toolsets=[ExternalToolset([SHIP])])
        with pytest.raises(UnsupportedDeferral, match="'ship'"):
            await LedgerRun.open(agent, run_id="e", history=MemorySession("h"), store=store)
        assert not store.list_runs()
        plain_agent: Agent[None, Any] = Agent(model, output_type=[str, DeferredToolRequests])
        run = await LedgerRun.open(plain_agent, run_id="e", history=MemorySession("h"),
                                   store=store)
        with pytest.raises(UnsupportedDeferral, match="'ship'"):
            await run.run("ship it", toolsets=[ExternalToolset([SHIP])])

        async def as_external(ctx: Any, tool: ToolDefinition) -> ToolDefinition:
            return dataclasses.replace(tool, kind="external")

        prepared: Agent[None, Any] = Agent(model, output_type=[str, DeferredToolRequests])

        @prepared.tool_plain(prepare=as_external)
        def ship(to: str) -> str:
            return "shipped"

        run = await LedgerRun.open(prepared, run_id="e2", history=MemorySession("h2"),
                                   store=store)
        for _ in range(2):
            with pytest.raises(UnsupportedDeferral, match="'ship'"):
                await run.run("ship it" if run.controller.step is Step.RUN_AGAIN else None)
        assert asked == []  # the model was never paid
        assert run.controller.step is not Step.AWAITING_MODEL

    run_async(go())


# ------------------------------------------------------------------ buffered runs


def test_a_buffered_run_reopened_stays_buffered() -> None:
    async def go() -> None:
        ran: Counter[str] = Counter()
        store = MemoryEventStore()
        run = await LedgerRun.open(approval_agent(ran), run_id="b", history=MemorySession("h"),
                                   store=store, buffered=True)
        assert (await run.run("charge me 7")).step is Step.INTERRUPTION
        reopened = await LedgerRun.open(approval_agent(ran), run_id="b",
                                        history=MemorySession("h"), store=store,
                                        buffered=True)
        reopened.controller.approve("c1")
        assert reopened.controller.unflushed == 1  # held until the next effect boundary
        assert len(store.load("b")) == len(run.controller.events)

    run_async(go())


def test_mcp_toolsets_are_refused_at_open_until_carried() -> None:
    """An MCP toolset's client makes a lost ``tools/call`` response an ordinary
    exception, which the ledger would record as the tool's failure (the model told a call
    failed that may have run): refused when the run is opened, nothing recorded. (The
    real ``pydantic_ai.mcp`` classes need the ``fastmcp`` client, which this project does
    not depend on; a toolset of that module stands in for them.)"""
    from pydantic_ai.toolsets import FunctionToolset

    from statemachine.adapters._calls import UnsupportedFeature

    stand_in = type("MCPServerStreamableHTTP", (FunctionToolset,),
                    {"__module__": "pydantic_ai.mcp"})
    store = MemoryEventStore()
    agent = Agent(TestModel(), toolsets=[stand_in()])
    with pytest.raises(UnsupportedFeature, match="MCPServerStreamableHTTP") as refused:
        asyncio.run(LedgerRun.open(agent, run_id="mcp", store=store))
    assert refused.value.feature == "MCP toolsets"
    assert not store.list_runs()


@pytest.mark.invariant("I1")
def test_a_second_run_of_one_ledger_run_under_way_is_refused(tmp_path: Path) -> None:
    """Two `run` calls on one `LedgerRun` at once, the second while the first waits for
    the model: the second is refused (`ConcurrencyConflict`) before anything is done, the
    first goes on and completes, and the tool ran once. Before, both went on with the
    one controller between them: the model, asked twice, named the charge under two ids,
    both ran, and the run was left stuck."""
    asked, release, charges = asyncio.Event(), asyncio.Event(), Counter[str]()
    ids = iter(range(1, 10))

    async def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if not any(isinstance(part, ToolReturnPart) for message in messages
                   if isinstance(message, ModelRequest) for part in message.parts):
            asked.set()
            await release.wait()
            return ModelResponse(parts=[ToolCallPart("charge", {"x": 7},
                                                     tool_call_id=f"call_{next(ids)}")])
        return ModelResponse(parts=[TextPart("done")])

    agent = Agent(FunctionModel(respond))

    @agent.tool_plain
    async def charge(x: int) -> str:
        charges["charge"] += 1
        return f"charged {x}"

    async def body() -> None:
        run = await LedgerRun.open(agent, run_id="r", store=SQLiteEventStore(
            tmp_path / "events.db"), history=SQLiteSession("h", tmp_path / "events.db"))
        first = asyncio.create_task(run.run("charge me 7"))
        await asyncio.wait_for(asked.wait(), 10)
        with pytest.raises(ConcurrencyConflict, match="already under way"):
            await asyncio.wait_for(run.run(), 10)  # (refused at once, never waiting)
        release.set()
        assert (await first).output == "done"

    asyncio.run(body())
    assert charges["charge"] == 1
    stored = RunController.load(SQLiteEventStore(tmp_path / "events.db"), "r")
    assert stored.step is Step.COMPLETED
    assert [view.call.call_id for view in stored.calls] == ["call_1"]


def _place_order(item: str) -> str:
    """An output function with an effect: it places the order."""
    return f"ordered {item}"


class _Order(pydantic.BaseModel):
    item: str


@pytest.mark.parametrize("spec", [
    _place_order, [_place_order], pydantic_ai.ToolOutput(_place_order),
    [pydantic_ai.ToolOutput(_place_order), str], pydantic_ai.TextOutput(_place_order),
    pydantic_ai.NativeOutput([_Order, _place_order]),  # type: ignore[list-item]
    pydantic_ai.PromptedOutput([_place_order])],
    ids=["function", "list", "tool-output", "tool-output-or-text", "text-output",
         "native", "prompted"])
def test_output_functions_are_refused_before_anything_is_recorded(
        tmp_path: Path, spec: Any) -> None:
    """pydantic-ai calls an output function while it checks the final answer, before the
    ledger can record the answer: a crash (or a cancellation) after its effect ran it
    again. So an agent whose output type holds one is refused at `LedgerRun.open`, and
    one given to `run.run(output_type=...)` there (`UnsupportedFeature` naming it),
    nothing recorded and the model never asked."""
    from statemachine.adapters._calls import UnsupportedFeature

    asked: list[list[ModelMessage]] = []
    store = SQLiteEventStore(tmp_path / "events.db")

    async def body() -> None:
        with pytest.raises(UnsupportedFeature, match="_place_order") as refused:
            await LedgerRun.open(Agent(scripted([], asked=asked), output_type=spec),
                                 run_id="r", store=store)
        assert refused.value.feature == "output functions"
        run = await LedgerRun.open(Agent(scripted([], asked=asked)), run_id="s", store=store)
        with pytest.raises(UnsupportedFeature, match="_place_order"):
            await run.run("order a book", output_type=spec)

    asyncio.run(body())
    assert asked == []
    assert store.list_runs() == ()


@pytest.mark.parametrize("spec", [
    str, _Order, [_Order, DeferredToolRequests], pydantic_ai.ToolOutput(_Order),
    pydantic_ai.NativeOutput([_Order]), list[_Order], _Order | None,
    pydantic_ai.StructuredDict({"type": "object", "properties": {}})],
    ids=["str", "model", "with-deferred", "tool-output", "native", "list-of", "optional",
         "structured-dict"])
def test_output_types_without_functions_open(tmp_path: Path, spec: Any) -> None:
    """Output types that are types (structured output) hold no function: carried."""
    async def body() -> None:
        await LedgerRun.open(Agent(scripted([]), output_type=spec), run_id="r",
                             store=SQLiteEventStore(tmp_path / "events.db"))

    asyncio.run(body())


def _mcp_stand_in() -> type[Any]:
    """A toolset of ``pydantic_ai.mcp`` standing in for its servers (their client needs
    ``fastmcp``; see `test_mcp_toolsets_are_refused_at_open_until_carried`)."""
    from pydantic_ai.toolsets import FunctionToolset

    return type("MCPServerStreamableHTTP", (FunctionToolset,), {"__module__": "pydantic_ai.mcp"})


def test_an_mcp_toolset_of_a_class_of_ones_own_is_refused_at_open() -> None:
    """A subclass of an MCP toolset, made in the user's own module: refused at open as
    the toolset it is made from. Before, only the class's own module was looked at."""
    from statemachine.adapters._calls import UnsupportedFeature

    payments = type("Payments", (_mcp_stand_in(),), {"__module__": "my_app.tools"})
    store = MemoryEventStore()
    with pytest.raises(UnsupportedFeature, match="Payments"):
        asyncio.run(LedgerRun.open(Agent(TestModel(), toolsets=[payments()]),
                                   run_id="mcp", store=store))
    assert not store.list_runs()


@pytest.mark.parametrize("returned", ["mcp", "external", "function"])
def test_a_dynamic_toolset_is_checked_once_the_run_lists_its_tools(returned: str) -> None:
    """A dynamic toolset (``@agent.toolset``) is made only when the run lists its tools,
    so open cannot see what it holds. Returning an MCP toolset (`UnsupportedFeature`) or
    an external one (`UnsupportedDeferral`), it is refused then: the model never asked,
    no tool run. Before, the MCP toolset's tool ran. Returning function tools, it is
    carried: its tool runs once, through the ledger."""
    from pydantic_ai.toolsets import FunctionToolset

    from statemachine.adapters._calls import UnsupportedFeature

    ran: list[int] = []
    asked: list[list[ModelMessage]] = []

    def charge(x: int) -> str:
        ran.append(x)
        return f"charged {x}"

    agent = Agent(scripted([[ToolCallPart("charge", {"x": 7}, tool_call_id="c1")]],
                           asked=asked))

    @agent.toolset
    def tools(ctx: Any) -> Any:
        if returned == "mcp":
            return _mcp_stand_in()([charge])
        if returned == "external":
            return ExternalToolset([ToolDefinition(name="charge")])
        return FunctionToolset([charge])

    async def body() -> Any:
        run = await LedgerRun.open(agent, run_id="d", store=MemoryEventStore())
        return await run.run("charge me 7"), run

    if returned == "function":
        result, run = asyncio.run(body())
        assert result.step is Step.COMPLETED
        assert ran == [7]
        assert run.controller.phase("c1") is Phase.PUBLISHED
        return
    refusal = UnsupportedFeature if returned == "mcp" else UnsupportedDeferral
    with pytest.raises(refusal):
        asyncio.run(body())
    assert asked == []
    assert ran == []
