"""`MessageToolLedger` keeping the conversation in a history (``history=``, DESIGN §7.7,
§7.9): the messages a run added land in a Session on the store's own database with the
run's end, in the append that completes it, so a one-tool turn is three durable writes
(the call's start, its result before the request carrying it, the end with the
conversation) where a caller saving the messages itself pays a fourth.

Expected outcomes come from the scenario: the conversation is written out by hand from
what the scripted model answers, the writes are counted by the store (its commits) and by
the Session (its own transactions, none), and what the Session holds is read through a
second connection, as another process would, at each request and after the run.

Under CI a missing ``anthropic`` package fails this module instead of skipping it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

try:
    import anthropic  # noqa: F401
except ImportError:  # pragma: no cover - CI installs the extra
    from tests.helpers import missing_extra

    missing_extra("anthropic")

import httpx2
from anthropic import Anthropic
from anthropic.lib.tools import beta_tool

from statemachine import (
    InvalidTransition,
    MemoryEventStore,
    ReconcileRejected,
    RunController,
    SchemaError,
    SQLiteEventStore,
    Step,
)
from statemachine import events as ev
from statemachine.adapters.anthropic import (
    HistoryMismatch,
    MessageToolLedger,
    StaleHistory,
    UnsupportedFeature,
)
from statemachine.sessions import MemorySession
from statemachine.sqlite import SQLiteSession

CHAT = "chat-1"
TOOL_USE = {"id": "toolu_1", "input": {"amount": 7}, "name": "pay", "type": "tool_use"}
TOOL_RESULT = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "charged 7"}


class Model:
    """A scripted model: asks for ``pay(amount=7)`` when the user's last message asks to
    pay, else says ``done``; each request's messages are kept, with what the
    Session held (read by ``peek``) when the request was sent."""

    def __init__(self, peek: Any = None) -> None:
        self.requests: list[list[Any]] = []
        self.held: list[int] = []
        self.peek = peek

    def handle(self, request: httpx2.Request) -> httpx2.Response:
        messages = json.loads(request.content)["messages"]
        self.requests.append(messages)
        if self.peek is not None:
            self.held.append(len(self.peek()))
        last = messages[-1]["content"]
        asks = isinstance(last, str) and last.startswith("pay")
        content = [TOOL_USE] if asks else [{"type": "text", "text": "done"}]
        return httpx2.Response(200, json={
            "id": "msg", "type": "message", "role": "assistant", "model": "claude-test",
            "content": content, "stop_reason": "tool_use" if asks else "end_turn",
            "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1}})

    def client(self) -> Anthropic:
        return Anthropic(api_key="test-key", max_retries=0, http_client=httpx2.Client(
            transport=httpx2.MockTransport(self.handle)))


def paying_tool(ran: list[int]) -> Any:
    @beta_tool
    def pay(amount: int) -> str:
        """Pay the amount."""
        ran.append(amount)
        return f"charged {amount}"

    return pay


class Chat(NamedTuple):
    """A test's parts: the store's file and the store, the scripted model, the paying
    tool and what it ran."""

    path: Path
    store: SQLiteEventStore
    model: Model
    ran: list[int]
    pay: Any

    def open(self, run_id: str, **options: Any) -> MessageToolLedger:
        """The ledger of ``run_id``, its history `CHAT` on the store's file."""
        return MessageToolLedger.open(run_id, [self.pay], store=self.store,
                                      history=SQLiteSession(CHAT, self.path), **options)


@pytest.fixture
def chat(tmp_path: Path) -> Iterator[Chat]:
    path = tmp_path / "events.db"
    store = SQLiteEventStore(path)
    ran: list[int] = []
    yield Chat(path, store, Model(), ran, paying_tool(ran))
    store.close()


def held(path: Path, session_id: str = CHAT) -> list[Any]:
    """What the Session holds, read through a connection of its own (another process's
    view: only what is committed)."""
    reader = SQLiteEventStore(path, readonly=True)
    try:
        return reader.session_items(session_id)
    finally:
        reader.close()


def converse(ledger: MessageToolLedger, client: Anthropic, pay: Any, text: str) -> Any:
    """One user turn of a ``messages.create`` loop that goes on from the history."""
    messages: list[Any] = [*ledger.messages, {"role": "user", "content": text}]
    params: dict[str, Any] = {"model": "claude-test", "max_tokens": 64,
                              "tools": [pay.to_dict()]}
    while True:
        reply = ledger.create(client.messages, messages=messages, **params)
        if reply.stop_reason != "tool_use":
            return reply
        messages.append({"role": "assistant", "content": reply.content})
        messages.append(ledger.run_tools(reply))


def turn(text: str, *, tool: bool = True) -> list[Any]:
    """The messages a user turn adds to the history, written from the script."""
    if not tool:
        return [{"role": "user", "content": text},
                {"role": "assistant", "content": [{"type": "text", "text": "done"}]}]
    return [{"role": "user", "content": text},
            {"role": "assistant", "content": [TOOL_USE]},
            {"role": "user", "content": [TOOL_RESULT]},
            {"role": "assistant", "content": [{"type": "text", "text": "done"}]}]


def test_the_conversation_lands_with_the_runs_end_in_one_write(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    store = SQLiteEventStore(path)
    model = Model(peek=lambda: held(path))
    ran: list[int] = []
    pay = paying_tool(ran)
    session = SQLiteSession(CHAT, path)
    ledger = MessageToolLedger.open("run-1", [pay], store=store, history=session)
    assert ledger.messages == []
    reply = converse(ledger, model.client(), pay, "pay 7")
    assert reply.content[0].text == "done"
    assert ran == [7]
    assert ledger.controller.step is Step.COMPLETED
    # three writes: the start before the body, the result before the request carrying
    # it, the end with the conversation; the Session wrote nothing on its own
    assert store.commits == 3
    assert session.commits == 0
    # nothing of the conversation was visible before the end, all of it after
    assert model.held == [0, 0]
    assert held(path) == turn("pay 7")
    assert ledger.messages == turn("pay 7")
    # the conversation and the run's completion are one append: the log's last events
    # are the staging, the commit and nothing after (the run completed by the commit)
    log = SQLiteEventStore(path, readonly=True).load("run-1")
    assert [type(e) for e in log[-2:]] == [ev.PublicationStaged, ev.PublicationCommitted]
    # the next user turn is a new run on the same history: it goes on from it
    model.held.clear()
    ledger = MessageToolLedger.open("run-2", [pay], store=store, history=session)
    assert ledger.messages == turn("pay 7")
    converse(ledger, model.client(), pay, "and again")
    assert model.requests[-1][:4] == turn("pay 7")
    assert held(path) == turn("pay 7") + turn("and again", tool=False)
    assert ran == [7]
    assert store.commits == 4  # one more: the end, with its two messages
    store.close()


def test_a_completed_run_is_answered_from_its_record_and_writes_nothing_again(chat: Chat) -> None:
    path, store, model, ran, pay = chat
    ledger = chat.open("run-1")
    converse(ledger, model.client(), pay, "pay 7")
    last_request = model.requests[-1]
    again = MessageToolLedger.open("run-1", [pay], store=store,
                                   history=SQLiteSession(CHAT, path))
    assert again.messages == turn("pay 7")
    reply = again.create(model.client().messages, messages=last_request,
                         model="claude-test", max_tokens=64)
    assert (again.replayed, reply.content[0].text) == (True, "done")
    assert len(model.requests) == 2  # nothing sent
    assert held(path) == turn("pay 7")  # written once
    assert ran == [7]


@pytest.mark.parametrize("case", ["no store", "per event", "another file", "memory session",
                                  "memory store"])
def test_a_history_the_end_cannot_carry_is_refused_when_the_run_opens(
        tmp_path: Path, case: str) -> None:
    path = tmp_path / "events.db"
    store: Any = SQLiteEventStore(path)
    history: Any = SQLiteSession(CHAT, path)
    buffered = True
    if case == "no store":
        store = None
    elif case == "per event":
        buffered = False
    elif case == "another file":
        history = SQLiteSession(CHAT, tmp_path / "other.db")
    elif case == "memory session":
        history = MemorySession(CHAT)
    else:
        store = MemoryEventStore()
    with pytest.raises(UnsupportedFeature) as refused:
        MessageToolLedger.open("run-1", [paying_tool([])], store=store, history=history,
                               buffered=buffered)
    assert refused.value.feature == "history"
    assert "Nothing was opened" in refused.value.reason
    if store is not None:
        assert store.version("run-1") == 0  # nothing recorded


@pytest.mark.parametrize(("started", "opened"), [(CHAT, "chat-2"), (CHAT, None),
                                                 (None, CHAT)])
def test_a_run_opened_with_a_history_not_its_own_is_refused(
        chat: Chat, started: str | None, opened: str | None) -> None:
    path, store, model, _ran, pay = chat
    first = MessageToolLedger.open("run-1", [pay], store=store,
                                   history=None if started is None
                                   else SQLiteSession(started, path))
    first.run_tools(first.create(model.client().messages, model="claude-test",
                                 messages=[{"role": "user", "content": "pay 7"}],
                                 max_tokens=64, tools=[pay.to_dict()]))
    version = store.version("run-1")
    assert version > 0
    with pytest.raises(HistoryMismatch):
        MessageToolLedger.open("run-1", [pay], store=store, owner="other",
                               history=None if opened is None else SQLiteSession(opened, path))
    assert store.version("run-1") == version  # not claimed


@pytest.mark.invariant("I7")
def test_a_request_that_does_not_go_on_from_the_history_is_refused_unsent(chat: Chat) -> None:
    path, store, model, _ran, pay = chat
    converse(chat.open("run-1"),
             model.client(), pay, "pay 7")
    ledger = chat.open("run-2")
    sent = len(model.requests)
    version = store.version("run-2")
    for messages in ([{"role": "user", "content": "pay 7"}],  # the history left out
                     [*turn("pay 7")[:3], {"role": "user", "content": "x"}],  # cut short
                     [*turn("pay 8"), {"role": "user", "content": "x"}]):  # another one
        with pytest.raises(HistoryMismatch, match="Nothing was sent"):
            ledger.create(model.client().messages, messages=messages,
                          model="claude-test", max_tokens=64)
    assert len(model.requests) == sent
    assert store.version("run-2") == version
    # the SDK's own objects for the same messages go on from it
    reply = model.client().messages.create(
        messages=[{"role": "user", "content": "pay 7"}], model="claude-test", max_tokens=64)
    same = [{"role": "user", "content": "pay 7"}, {"role": "assistant",
                                                     "content": reply.content},
            *ledger.messages[2:], {"role": "user", "content": "and again"}]
    ledger.create(model.client().messages, messages=same, model="claude-test",
                  max_tokens=64)
    assert held(path) == turn("pay 7") + turn("and again", tool=False)


@pytest.mark.invariant("I7")
def test_a_history_another_writer_moved_refuses_the_end_whole(chat: Chat) -> None:
    path, store, model, ran, pay = chat
    ledger = chat.open("run-1")
    other = SQLiteSession(CHAT, path)
    moved = {"role": "user", "content": "written by someone else"}

    def handle(request: httpx2.Request) -> httpx2.Response:
        if len(model.requests) == 1:  # while the model answers the result
            asyncio.run(other.add_items([moved]))
        return model.handle(request)

    client = Anthropic(api_key="test-key", max_retries=0, http_client=httpx2.Client(
        transport=httpx2.MockTransport(handle)))
    with pytest.raises(ReconcileRejected):
        converse(ledger, client, pay, "pay 7")
    assert held(path) == [moved]  # nothing of the conversation written after it
    assert ledger.messages == []  # what it read, nothing it wrote: its end never landed
    assert ran == [7]
    log = SQLiteEventStore(path, readonly=True).load("run-1")
    assert not any(isinstance(e, ev.FinalOutputAccepted | ev.PublicationStaged)
                   for e in log)  # the end was not recorded either
    # opened again, the run goes on from the history as it now is, with the turns the
    # failed request carried: the result comes from the ledger, the tool never runs again
    again = MessageToolLedger.open("run-1", [pay], store=store,
                                   history=SQLiteSession(CHAT, path))
    assert again.messages == [moved]
    with pytest.raises(StaleHistory):  # the turns left out: refused, nothing sent
        again.create(model.client().messages, messages=[*again.messages, turn("pay 7")[0]],
                     model="claude-test", max_tokens=64)
    answer = again.run_tools(turn("pay 7")[1]["content"])
    assert answer == turn("pay 7")[2]
    reply = again.create(model.client().messages, model="claude-test", max_tokens=64,
                         messages=[*again.messages, *turn("pay 7")[:2], answer])
    assert reply.content[0].text == "done"
    assert ran == [7]
    assert held(path) == [moved, *turn("pay 7")]


def test_an_end_whose_staging_fails_records_nothing_of_the_end(
        chat: Chat, monkeypatch: pytest.MonkeyPatch) -> None:
    import statemachine.adapters.anthropic as adapter

    path, store, model, _ran, pay = chat
    ledger = chat.open("run-1")

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise InvalidTransition("staging refused", run_id="run-1")

    monkeypatch.setattr(adapter, "stage_known", refused)
    with pytest.raises(InvalidTransition, match="staging refused"):
        converse(ledger, model.client(), pay, "pay 7")
    version = store.version("run-1")
    with pytest.raises(InvalidTransition, match="nothing of the end was recorded"):
        ledger.controller.flush()  # what it buffered never lands
    assert store.version("run-1") == version
    log = SQLiteEventStore(path, readonly=True).load("run-1")
    assert not any(isinstance(e, ev.ModelResponded) and e.output is not None for e in log)
    assert held(path) == []


def test_the_sdk_tool_runner_ends_with_its_conversation_in_the_history(chat: Chat) -> None:
    path, store, model, ran, pay = chat
    ledger = chat.open("run-1")
    runner = ledger.attach(model.client().beta.messages.tool_runner(
        model="claude-test", max_tokens=64, tools=[pay],
        messages=[*ledger.messages, {"role": "user", "content": "pay 7"}]))
    final = runner.until_done()
    assert final.to_dict()["content"] == [{"type": "text", "text": "done"}]
    assert ran == [7]
    assert ledger.controller.step is Step.COMPLETED
    assert store.commits == 3
    assert held(path) == turn("pay 7")


def test_on_postgresql_the_conversation_lands_with_the_end(pg_dsn: str,
                                                          pg_schema: str) -> None:
    from statemachine.postgres import PostgresEventStore, PostgresSession

    store = PostgresEventStore(pg_dsn, schema=pg_schema)
    session = PostgresSession(pg_dsn, CHAT, schema=pg_schema)
    model = Model()
    ran: list[int] = []
    pay = paying_tool(ran)
    try:
        ledger = MessageToolLedger.open("run-1", [pay], store=store, history=session)
        converse(ledger, model.client(), pay, "pay 7")
        assert ran == [7]
        assert store.commits == 3
        assert asyncio.run(session.get_items()) == turn("pay 7")
        ledger = MessageToolLedger.open("run-2", [pay], store=store, history=session)
        assert ledger.messages == turn("pay 7")
    finally:
        store.close()
        session.close()


def test_a_tool_runner_whose_messages_are_replaced_is_refused_before_its_request(
        chat: Chat) -> None:
    """The history is checked before every request of an attached runner, not its first
    alone: messages set between requests (``set_messages_params``) would have the end
    write a conversation the model never had."""
    path, _store, model, _ran, pay = chat
    converse(chat.open("run-1"),
             model.client(), pay, "pay 7")
    ledger = chat.open("run-2")
    runner = ledger.attach(model.client().beta.messages.tool_runner(
        model="claude-test", max_tokens=64, tools=[pay],
        messages=[*ledger.messages, {"role": "user", "content": "pay 8"}]))
    sent = len(model.requests)

    def replaced_after_each_reply() -> None:
        for _ in runner:
            runner.set_messages_params(lambda params: {**params, "messages": [
                {"role": "user", "content": "something else"}]})

    with pytest.raises(HistoryMismatch, match="Nothing was sent"):
        replaced_after_each_reply()
    assert len(model.requests) == sent + 1  # the first request only
    assert held(path) == turn("pay 7")
    assert ledger.controller.step is not Step.COMPLETED


def test_prompt_cache_marks_are_the_requests_not_the_historys(chat: Chat) -> None:
    """A ``cache_control`` breakpoint moves from request to request: the history keeps
    the messages without it, and a request marking other blocks goes on from it."""
    path, store, model, _ran, pay = chat

    def marked(text: str) -> dict[str, Any]:
        return {"role": "user", "content": [{"type": "text", "text": text,
                                              "cache_control": {"type": "ephemeral"}}]}

    for i in (1, 2, 3):
        ledger = MessageToolLedger.open(f"run-{i}", [pay], store=store,
                                        history=SQLiteSession(CHAT, path))
        earlier = ledger.messages
        if earlier:  # the breakpoint on the last message of the history, too
            earlier[-1]["content"][0]["cache_control"] = {"type": "ephemeral"}
        ledger.create(model.client().messages, model="claude-test", max_tokens=64,
                      messages=[*earlier, marked(f"hello {i}")])
    assert held(path) == [message for i in (1, 2, 3) for message in (
        {"role": "user", "content": [{"type": "text", "text": f"hello {i}"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "done"}]})]
    assert sum("cache_control" in json.dumps(request) for request in model.requests) == 3


def test_a_conversation_the_log_cannot_hold_is_refused_before_the_model_is_asked_again(
        tmp_path: Path) -> None:
    """Messages nested past the log's ``max_depth`` (a tool input the call's arguments
    could hold sits three levels deeper in a message) or past its room under
    ``max_bytes`` are refused before the request that carries them: found only at the
    end, once the model answered, the run could never complete and every retry would
    ask the model again."""
    deep: Any = 1
    for _ in range(197):
        deep = {"a": deep}

    @beta_tool
    def note(text: Any) -> str:
        """Keep a note."""
        return "kept"

    for case in ("deep", "large"):
        path = tmp_path / f"{case}.db"
        store = SQLiteEventStore(path)
        requests: list[Any] = []
        arguments = {"text": deep if case == "deep" else "x" * 75_000}

        def handle(request: httpx2.Request, arguments: Any = arguments,
                   requests: list[Any] = requests) -> httpx2.Response:
            requests.append(request)
            return httpx2.Response(200, json={
                "id": "msg", "type": "message", "role": "assistant", "model": "m",
                "content": [{"type": "tool_use", "id": "toolu_1", "name": "note",
                             "input": arguments}],
                "stop_reason": "tool_use", "stop_sequence": None,
                "usage": {"input_tokens": 1, "output_tokens": 1}})

        client = Anthropic(api_key="test-key", max_retries=0, http_client=httpx2.Client(
            transport=httpx2.MockTransport(handle)))
        # the large input: room under max_bytes for the call, not for it and its copy
        # in the conversation (75,000 bytes twice)
        ledger = MessageToolLedger(RunController.start(
            run_id="run-1", session_id=CHAT, store=store, buffered=True,
            max_bytes=150_000), [note], history=SQLiteSession(CHAT, path))
        messages: list[Any] = [{"role": "user", "content": "note this"}]
        reply = ledger.create(client.messages, model="m", max_tokens=9, messages=messages)
        messages += [{"role": "assistant", "content": reply.content}, ledger.run_tools(reply)]
        with pytest.raises(SchemaError, match="nothing was sent"):
            ledger.create(client.messages, model="m", max_tokens=9, messages=messages)
        assert len(requests) == 1, case
        assert held(path) == [], case
        store.close()


def test_an_async_loop_keeps_its_conversation_as_the_sync_one_does(chat: Chat) -> None:
    """`open_async`, `acreate` and `arun_tools`: the same three writes, the same
    conversation in the history."""
    from anthropic import AsyncAnthropic

    path, store, model, ran, pay = chat

    async def handle(request: httpx2.Request) -> httpx2.Response:
        return model.handle(request)

    async def loop() -> None:
        client = AsyncAnthropic(api_key="test-key", max_retries=0,
                                http_client=httpx2.AsyncClient(
                                    transport=httpx2.MockTransport(handle)))
        ledger = await MessageToolLedger.open_async("run-1", [pay], store=store,
                                                    history=SQLiteSession(CHAT, path))
        messages: list[Any] = [*ledger.messages, {"role": "user", "content": "pay 7"}]
        while True:
            reply = await ledger.acreate(client.messages, messages=messages,
                                         model="claude-test", max_tokens=64,
                                         tools=[pay.to_dict()])
            if reply.stop_reason != "tool_use":
                break
            messages += [{"role": "assistant", "content": reply.content},
                         await ledger.arun_tools(reply)]
        await client.close()

    asyncio.run(loop())
    assert ran == [7]
    assert store.commits == 3
    assert held(path) == turn("pay 7")


def test_compaction_in_a_tool_runner_with_a_history_is_refused_when_asked(chat: Chat) -> None:
    """Compaction replaces the runner's messages with a summary, which the end would then
    write as the conversation: with a history, `compact_before_next_turn` is refused
    naming it, before anything is scheduled or sent, and a runner that scheduled one
    before it was attached is refused when attached (with an empty history, no other
    check would see the summary)."""
    _path, _store, model, _ran, pay = chat
    ledger = chat.open("run-1")
    runner = ledger.attach(model.client().beta.messages.tool_runner(
        model="claude-test", max_tokens=64, tools=[pay],
        messages=[{"role": "user", "content": "pay 7"}]))
    with pytest.raises(UnsupportedFeature) as refused:
        runner.compact_before_next_turn()
    assert refused.value.feature == "compaction"
    assert model.requests == []
    scheduled = model.client().beta.messages.tool_runner(  # before it is attached
        model="claude-test", max_tokens=64, tools=[pay],
        messages=[{"role": "user", "content": "pay 7"}])
    scheduled.compact_before_next_turn()
    with pytest.raises(UnsupportedFeature, match="Nothing was attached") as refused:
        chat.open("run-3").attach(scheduled)
    assert refused.value.feature == "compaction"
    assert model.requests == []
    assert held(chat.path) == []
    plain = MessageToolLedger.open("run-2", [pay], store=chat.store)  # no history: allowed
    other = plain.attach(model.client().beta.messages.tool_runner(
        model="claude-test", max_tokens=64, tools=[pay],
        messages=[{"role": "user", "content": "pay 7"}]))
    other.compact_before_next_turn()
