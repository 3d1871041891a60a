"""The Anthropic SDK with the tool ledger underneath, offline.

A managed-agents session asks this client to run ``charge(x=7)``. The first post of its
result is rejected and the event stream drops; after the reconnect, the SDK's own session
runner would run ``charge`` again. `LedgerSessionToolRunner` re-posts the recorded result
instead: the customer is charged once. Then a plain ``messages.create`` loop whose request
carrying the tool result fails is retried: `MessageToolLedger` answers the retried turn
from its cache, and a history with an unanswered ``tool_use`` is refused before sending;
the conversation's final reply completes the run, and the same request made again gets
that recorded reply without any request. Last, a conversation kept in a history
(``history=``, a `SQLiteSession` on the store's file): each user turn is a run, and its
messages land with its end, in one write.

Every request goes through the SDK's HTTP layer into a local mock transport; nothing
touches the network. The ledger lives in a SQLite event store in a fresh temporary
directory. Run it: ``python examples/anthropic_adapter.py`` (needs
``pip install 'agent-statemachine[anthropic]'``). It exits 0.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx2
from anthropic import Anthropic, AsyncAnthropic, InternalServerError
from anthropic.lib.tools import beta_async_tool, beta_tool

from statemachine import SQLiteEventStore, SQLiteSession
from statemachine.adapters.anthropic import (
    LedgerSessionToolRunner,
    MessageToolLedger,
    UnansweredToolUse,
)

charges: list[int] = []


class Session:
    """A managed session that wants one tool call answered; it rejects the first result
    post and drops its event stream right after."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = [{
            "type": "agent.custom_tool_use", "id": "tu_1", "name": "charge",
            "input": {"x": 7}, "processed_at": "2026-01-01T00:00:00Z"}]
        self.posts = 0
        self.drop = False
        self.changed: asyncio.Event | None = None

    async def handle(self, request: httpx2.Request) -> httpx2.Response:
        if self.changed is None:
            self.changed = asyncio.Event()
        if request.url.path.endswith("/stream"):
            return httpx2.Response(200, headers={"content-type": "text/event-stream"},
                                   content=self.stream(len(self.events)))
        if request.method == "GET":
            return httpx2.Response(200, json={"data": self.events, "next_page": None})
        self.posts += 1
        if self.posts == 1:
            self.drop = True
            self.changed.set()
            return httpx2.Response(400, json={"type": "error", "error": {
                "type": "invalid_request_error", "message": "rejected (injected)"}})
        result = json.loads(request.content)["events"][0]
        stamp = {"processed_at": "2026-01-01T00:00:00Z"}
        self.events += [{**result, "id": "sevt_1", **stamp},
                        {"type": "session.status_terminated", "id": "sevt_2", **stamp}]
        self.changed.set()
        return httpx2.Response(200, json={"data": []})

    async def stream(self, seen: int) -> AsyncIterator[bytes]:
        assert self.changed is not None
        while True:
            self.changed.clear()
            for event in self.events[seen:]:
                yield f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()
            seen = len(self.events)
            if self.drop:
                self.drop = False
                raise httpx2.ReadError("stream dropped (injected)")
            if self.events[-1]["type"] == "session.status_terminated":
                return
            await self.changed.wait()


@beta_async_tool
async def charge(x: int) -> str:
    """Charge the customer x dollars."""
    charges.append(x)
    return f"charged {x}"


async def managed_session(store: SQLiteEventStore) -> None:
    session = Session()
    client = AsyncAnthropic(api_key="offline", max_retries=0, http_client=httpx2.AsyncClient(
        transport=httpx2.MockTransport(session.handle)))
    runner = await LedgerSessionToolRunner.open(client, "sesn_1", tools=[charge],
                                                store=store, max_idle=None)
    async for call in runner:
        text = next(iter(call.result["content"])).get("text") if call.result else None
        print(f"  {call.tool_use_id}: {text!r}, posted={call.posted}")
    print(f"  charge ran {len(charges)} time(s); {session.posts} post(s); the ledger says "
          f"{getattr(runner.controller.phase('tu_1'), 'value', None)}")
    assert charges == [7]


def messages_loop(store: SQLiteEventStore) -> None:
    requests: list[int] = []

    def model(request: httpx2.Request) -> httpx2.Response:
        messages = json.loads(request.content)["messages"]
        requests.append(len(messages))
        if len(requests) == 2:
            return httpx2.Response(500, json={"type": "error", "error": {
                "type": "api_error", "message": "overloaded (injected)"}})
        last = messages[-1]["content"]
        answered = isinstance(last, list) and last[0].get("type") == "tool_result"
        content = ([{"type": "text", "text": "done"}] if answered else
                   [{"type": "tool_use", "id": "tu_9", "name": "refund", "input": {"x": 3}}])
        return httpx2.Response(200, json={
            "id": "msg", "type": "message", "role": "assistant", "model": "claude-offline",
            "content": content, "stop_reason": "end_turn" if answered else "tool_use",
            "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1}})

    refunds: list[int] = []

    @beta_tool
    def refund(x: int) -> str:
        """Refund x dollars."""
        refunds.append(x)
        return f"refunded {x}"

    client = Anthropic(api_key="offline", max_retries=0, http_client=httpx2.Client(
        transport=httpx2.MockTransport(model)))
    ledger = MessageToolLedger.open("chat-1", [refund], store=store)
    params: dict[str, Any] = {"model": "claude-offline", "max_tokens": 64,
                              "tools": [refund.to_dict()]}
    history: list[Any] = [{"role": "user", "content": "refund 3"}]
    reply = ledger.create(client.messages, messages=history, **params)
    history.append({"role": "assistant", "content": reply.content})
    try:
        ledger.create(client.messages, messages=history, **params)
    except UnansweredToolUse as refused:
        print(f"  refused before sending: {type(refused).__name__}")
    for attempt in (1, 2):
        answer = ledger.run_tools(reply)  # the retried turn answers from the cache
        try:
            final = ledger.create(client.messages, messages=[*history, answer], **params)
        except InternalServerError:
            print(f"  attempt {attempt}: the request failed (injected)")
            continue
        print(f"  attempt {attempt}: {final.content[0].text!r}")
        break
    print(f"  refund ran {len(refunds)} time(s) over {len(requests)} request(s)")
    assert refunds == [3]
    # the conversation ended with that reply, and the run with it: the same request again
    # (a user retrying it) gets the recorded reply, with no request and no refund
    retried = MessageToolLedger.open("chat-1", [refund], store=store)
    again = retried.create(client.messages, messages=history[:1], **params)
    print(f"  the same request again: {again.content[0].text!r} (replayed="
          f"{retried.replayed}); still {len(requests)} request(s), {len(refunds)} refund")
    assert retried.replayed
    assert refunds == [3]


def kept_conversation(path: Path) -> None:
    """Two user turns, each a run, the conversation kept in a history on the store's
    file: each run's messages land with its end, in the append that completes it."""
    store = SQLiteEventStore(path)
    history = SQLiteSession("chat-2", path)  # the store's own file

    def model(request: httpx2.Request) -> httpx2.Response:
        messages = json.loads(request.content)["messages"]
        text = f"you said {len(messages) // 2 + 1} thing(s)"
        return httpx2.Response(200, json={
            "id": "msg", "type": "message", "role": "assistant", "model": "claude-offline",
            "content": [{"type": "text", "text": text}], "stop_reason": "end_turn",
            "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1}})

    client = Anthropic(api_key="offline", max_retries=0, http_client=httpx2.Client(
        transport=httpx2.MockTransport(model)))
    for turn, said in enumerate(("hello", "and goodbye")):
        before = store.commits
        ledger = MessageToolLedger.open(f"chat-2-turn-{turn}", store=store, history=history)
        reply = ledger.create(client.messages, model="claude-offline", max_tokens=64,
                              messages=[*ledger.messages, {"role": "user", "content": said}])
        print(f"  turn {turn}: {reply.content[0].text!r}; the history holds "
              f"{len(ledger.messages)} message(s), {store.commits - before} write(s)")
    assert len(ledger.messages) == 4
    store.close()


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        store = SQLiteEventStore(Path(folder) / "events.db")
        print("managed session: the first post is rejected, then the stream drops")
        asyncio.run(managed_session(store))
        print("messages loop: the request carrying the result fails once")
        messages_loop(store)
        store.close()
        print("a conversation kept in a history, a run per user turn")
        kept_conversation(Path(folder) / "chat.db")


if __name__ == "__main__":
    main()
