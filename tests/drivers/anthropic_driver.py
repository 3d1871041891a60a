"""A fake managed-agents session served through the Anthropic SDK's own HTTP layer (an
``httpx2.MockTransport``: nothing leaves the process), and the processes of the Anthropic
adapter tests (tests/adapters/test_anthropic.py).

`FakeSession` serves the three endpoints the SDK's session tool runner uses: the event list
(``GET /v1/sessions/{id}/events``), the live stream (``GET .../events/stream``, SSE) and the
result post (``POST .../events``). Its history can live in a JSON file, so a restarted
process sees what an earlier one left. Faults are scripted per post (`PostFault`) and a
stream can be dropped after a post.

``python -m tests.drivers.anthropic_driver COMMAND DIR [NAME]`` — one command per process, on a run
kept in DIR (SQLite event store DIR/events.db, remote history DIR/remote.json, tool runs
appended to DIR/effects.txt with O_APPEND + fsync):

* ``crash-post DIR``: the adapter runs ``charge`` (effect recorded), then the process kills
  itself (SIGKILL) when the result post reaches the transport, before it lands;
* ``crash-tool DIR``: ``charge`` kills its own process inside its body, after its effect;
* a fourth argument ``buffered`` opens the adapter with ``buffered=True``;
* ``resume DIR NAME``: open the run again and drive it until the session ends; prints one
  JSON line ``{"name", "outcome": "done" | "error", "error", "posted"}``;
* ``sdk-crash-post DIR`` / ``sdk-resume DIR NAME``: the same two steps on the SDK's runner
  alone (no ledger), to show what the adapter prevents.

The messages commands run a ``messages.create`` loop (``VIA`` = ``create``, through
`MessageToolLedger.run_tools` / ``create``) or the SDK's ``beta.messages.tool_runner``
(``VIA`` = ``runner``, through ``ledger.attach``) against `ScriptedModel`, which appends one
fsynced line per request to DIR/requests.txt:

* ``messages-crash-tool DIR NAME VIA``: ``charge`` kills its own process after its effect;
* ``messages-crash-request DIR NAME VIA``: the process kills itself when the request
  carrying the tool's result reaches the transport;
* a last argument ``buffered`` opens the ledger buffered (the default of
  `MessageToolLedger.open`), else one append per event;
* ``messages-resume DIR NAME VIA``: the loop again from the caller's saved messages
  (`SavedHistory`, DIR/history.json: the reply saved before its calls run, their answer
  before the request carrying it), as a caller retrying the request would; prints
  ``{"name", "outcome", "error", "final", "replayed"}``;
* ``sdk-messages-...``: the same on the SDK alone, whose caller runs the loop again from
  its first message.

`fork` runs one command in a child forked from the calling process instead.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx2
from anthropic import Anthropic, AsyncAnthropic
from anthropic._utils._json import openapi_dumps
from anthropic.lib.environments import SessionToolRunner
from anthropic.lib.tools import _beta_session_runner as session_runner
from anthropic.lib.tools import beta_async_tool, beta_tool

from tests.drivers.crash_driver import append_line
from tests.drivers.effects import Effects

SESSION_ID = "sesn_fake"
STAMP = "2026-01-01T00:00:00Z"

# the SDK waits 0.5 s before a reconnect and up to a second between post retries: the
# tests shorten both (the behaviour under test does not depend on the waits)
session_runner.STREAM_BACKOFF_START = 0.01
session_runner.SEND_BACKOFF_CAP = 0.01



class Served:
    """A model behind the SDK's own HTTP layer: ``handle`` answers each request; the
    clients send to it through a local ``httpx2.MockTransport``."""

    def handle(self, request: httpx2.Request) -> httpx2.Response:
        raise NotImplementedError

    def client(self) -> Anthropic:
        return Anthropic(api_key="test-key", max_retries=0, http_client=httpx2.Client(
            transport=httpx2.MockTransport(self.handle)))

    def async_client(self) -> AsyncAnthropic:
        return AsyncAnthropic(api_key="test-key", max_retries=0,
                              http_client=httpx2.AsyncClient(
                                  transport=httpx2.MockTransport(self.handle)))

class PostFault:
    """What the server does with one result post: ``reject`` (400, nothing lands),
    ``land-then-500`` (the result lands, the answer is a 500), ``drop`` (a connection
    error, nothing lands); ``then_drop_stream`` also ends the live stream with an error."""

    def __init__(self, kind: str, *, then_drop_stream: bool = False) -> None:
        self.kind = kind
        self.then_drop_stream = then_drop_stream


def tool_use(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"type": "agent.custom_tool_use", "id": call_id, "name": name,
            "input": arguments, "processed_at": STAMP}


def agent_tool_use(call_id: str, name: str, arguments: dict[str, Any], *,
                   ask: bool = False) -> dict[str, Any]:
    """A call of a built-in agent tool, gated behind the user's confirmation when ``ask``
    (``evaluated_permission``: the SDK's runner holds it until a ``user.tool_confirmation``
    allows it, `FakeSession.confirm`)."""
    return {"type": "agent.tool_use", "id": call_id, "name": name, "input": arguments,
            "processed_at": STAMP, "evaluated_permission": "ask" if ask else "allow"}


def answered_id(event: dict[str, Any]) -> str | None:
    """The call a result event answers (``user.custom_tool_result`` or
    ``user.tool_result``); None for any other event."""
    if event.get("type") == "user.custom_tool_result":
        return event.get("custom_tool_use_id")
    if event.get("type") == "user.tool_result":
        return event.get("tool_use_id")
    return None


class FakeSession:
    """The server side of one managed session: ``calls`` are the agent's tool calls; once
    every one of them is answered the session ends (``session.status_terminated``).
    ``refusing`` names calls whose result posts are rejected (400, nothing lands) for as
    long as they are in it; ``on_stream`` is called as each live stream opens."""

    def __init__(self, calls: list[dict[str, Any]], *, path: Path | None = None,
                 faults: list[PostFault] | None = None,
                 on_post: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.path = path
        self.faults = list(faults or [])
        self.on_post = on_post
        self.posts: list[dict[str, Any]] = []
        self.stream_opens = 0
        self.refusing: set[str] = set()
        self.on_stream: Callable[[], None] | None = None
        self._changed = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drop = False
        if path is None or not path.exists():
            self._save({"events": list(calls), "calls": [c["id"] for c in calls]})

    # ---------------------------------------------------------------- history

    def _load(self) -> dict[str, Any]:
        if self.path is None:
            return self._memory
        return json.loads(self.path.read_text())  # type: ignore[no-any-return]

    def _save(self, data: dict[str, Any]) -> None:
        if self.path is None:
            self._memory = data
        else:
            self.path.write_text(json.dumps(data))

    @property
    def events(self) -> list[dict[str, Any]]:
        return list(self._load()["events"])

    def results(self, call_id: str | None) -> list[dict[str, Any]]:
        return [e for e in self.events if answered_id(e) == call_id]

    def confirm(self, call_ids: list[str]) -> None:
        """The user allows each of ``call_ids`` (``user.tool_confirmation``)."""
        for call_id in call_ids:
            self._append({"type": "user.tool_confirmation", "tool_use_id": call_id,
                          "result": "allow"})

    def _append(self, event: dict[str, Any]) -> None:
        data = self._load()
        data["events"].append({**event, "id": f"sevt_{len(data['events'])}",
                               "processed_at": STAMP})
        answered = {answered_id(e) for e in data["events"]}
        ended = any(e["type"] == "session.status_terminated" for e in data["events"])
        if not ended and all(call in answered for call in data["calls"]):
            data["events"].append({"type": "session.status_terminated",
                                   "id": f"sevt_{len(data['events'])}", "processed_at": STAMP})
        self._save(data)
        self._changed.set()

    # ------------------------------------------------------------------- HTTP

    async def handle(self, request: httpx2.Request) -> httpx2.Response:
        path = request.url.path
        if path.endswith("/events/stream"):
            return self._stream()
        if path.endswith("/events") and request.method == "GET":
            return httpx2.Response(200, json={"data": self.events, "next_page": None})
        if path.endswith("/events") and request.method == "POST":
            return self._post(json.loads(request.content))
        return httpx2.Response(404, json={"type": "error", "error": {
            "type": "not_found_error", "message": path}})

    def _post(self, body: dict[str, Any]) -> httpx2.Response:
        event = body["events"][0]
        self.posts.append(event)
        if self.on_post is not None:
            self.on_post(event)
        fault = self.faults.pop(0) if self.faults else None
        if fault is not None and fault.then_drop_stream:
            self._drop = True
            self._changed.set()
        call_id = answered_id(event)
        if (fault is not None and fault.kind == "reject") or call_id in self.refusing:
            return _error(400, "invalid_request_error", "injected rejection")
        if fault is not None and fault.kind == "drop":
            raise httpx2.ConnectError("injected connection drop")
        if self.results(call_id):
            return _error(400, "invalid_request_error", "tool use already answered")
        self._append(event)
        if fault is not None and fault.kind == "land-then-500":
            return _error(500, "api_error", "injected failure after the result landed")
        return httpx2.Response(200, json={"data": []})

    def _stream(self) -> httpx2.Response:
        self.stream_opens += 1
        if self.on_stream is not None:
            self.on_stream()
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # an asyncio.Event belongs to one loop
            self._loop, self._changed = loop, asyncio.Event()
        events = self.events
        # a stream opened after the session ended is told so at once (else the SDK's
        # runner would wait for an end it already missed)
        ended = [e for e in events if e["type"] == "session.status_terminated"]
        start = len(events) - len(ended[-1:])
        self._drop = False

        async def body() -> AsyncIterator[bytes]:
            seen = start
            while True:
                self._changed.clear()  # before the read: no append can slip between
                events = self.events
                for event in events[seen:]:
                    yield f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()
                seen = len(events)
                if self._drop:
                    self._drop = False
                    raise httpx2.ReadError("injected stream drop")
                if any(e["type"] == "session.status_terminated" for e in events):
                    return
                if len(self.events) > seen:
                    continue
                try:
                    await asyncio.wait_for(self._changed.wait(), 5)
                except TimeoutError:
                    return

        return httpx2.Response(200, headers={"content-type": "text/event-stream"},
                               content=body())


def _error(status: int, kind: str, message: str) -> httpx2.Response:
    return httpx2.Response(status, json={"type": "error",
                                         "error": {"type": kind, "message": message}})


def client_for(server: FakeSession) -> AsyncAnthropic:
    return AsyncAnthropic(api_key="test-key", max_retries=0,
                          http_client=httpx2.AsyncClient(
                              transport=httpx2.MockTransport(server.handle)))


def charge_tool(effect: Effects, *, crash: bool = False) -> Any:
    @beta_async_tool
    async def charge(x: int) -> str:
        """Charge the customer x dollars."""
        effect(f"charge {x}")
        if crash:
            os.kill(os.getpid(), signal.SIGKILL)
        return f"charged {x}"

    return charge


# ------------------------------------------------------------------- processes


def _kill_self(event: dict[str, Any]) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


async def _drive(folder: Path, name: str, *, ledger: bool, crash_tool: bool = False,
                 crash_post: bool = False, buffered: bool = False) -> dict[str, Any]:
    from statemachine import SQLiteEventStore
    from statemachine.adapters.anthropic import LedgerSessionToolRunner

    effect = Effects(folder, name)
    server = FakeSession([tool_use("tu_1", "charge", {"x": 7})], path=folder / "remote.json",
                         on_post=_kill_self if crash_post else None)
    client = client_for(server)
    tools = [charge_tool(effect, crash=crash_tool)]
    runner: SessionToolRunner
    if ledger:
        runner = await LedgerSessionToolRunner.open(
            client, SESSION_ID, tools=tools, store=SQLiteEventStore(folder / "events.db"),
            owner=name, max_idle=None, buffered=buffered)
    else:
        runner = SessionToolRunner(client, SESSION_ID, tools=tools, max_idle=None)
    posted: list[bool] = []
    try:
        async for call in runner:
            posted.append(call.posted)
    except Exception as error:  # the outcome is what the test reads
        return {"name": name, "outcome": "error", "error": type(error).__name__,
                "posted": posted}
    return {"name": name, "outcome": "done", "error": None, "posted": posted}


# ------------------------------------------------------------- a messages loop

MESSAGES_RUN = "messages"
REQUESTS = "requests.txt"
BODIES = "bodies.jsonl"


class ScriptedModel:
    """``POST /v1/messages``: asks for ``charge(x=7)`` (id ``tu_1``) until the last user
    message carries a tool_result, then answers (``end_turn``) with that result's content
    as text (JSON text when it is not a str). Each request appends ``NAME request`` to
    DIR/requests.txt and its messages as one JSON line to DIR/bodies.jsonl (fsynced: the
    exact request the model received); ``crash_on_result`` kills the process when a request
    carrying a tool_result reaches the transport, before any answer."""

    def __init__(self, folder: Path, name: str, *, crash_on_result: bool = False) -> None:
        self.path = folder / REQUESTS
        self.name = name
        self.crash_on_result = crash_on_result

    def handle(self, request: httpx2.Request) -> httpx2.Response:
        messages = json.loads(request.content)["messages"]
        last = messages[-1]["content"]
        results = [b for b in last if b.get("type") == "tool_result"] if isinstance(
            last, list) else []
        if results and self.crash_on_result:
            os.kill(os.getpid(), signal.SIGKILL)
        append_line(self.path, f"{self.name} request")
        append_line(self.path.with_name(BODIES), json.dumps(messages))
        if results:
            content = results[0]["content"]
            text = content if isinstance(content, str) else json.dumps(content)
            blocks: list[dict[str, Any]] = [{"type": "text", "text": text}]
        else:
            blocks = [{"type": "tool_use", "id": "tu_1", "name": "charge",
                       "input": {"x": 7}}]
        return httpx2.Response(200, json={
            "id": "msg", "type": "message", "role": "assistant", "model": "claude-test",
            "content": blocks, "stop_reason": "end_turn" if results else "tool_use",
            "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1}})


def sync_charge_tool(effect: Effects, *, crash: bool = False) -> Any:
    @beta_tool
    def charge(x: int) -> str:
        """Charge the customer x dollars."""
        effect(f"charge {x}")
        if crash:
            os.kill(os.getpid(), signal.SIGKILL)
        return f"charged {x}"

    return charge


HISTORY = "history.json"


class SavedHistory:
    """A messages loop's history as a caller that resumes after a crash keeps it: in
    DIR/history.json, replaced whole and fsynced at each step (a reply before its calls
    run, their answer before the request carrying it). A restarted caller goes on from it
    (`resumed`); one that kept only its first message would have the model ask again,
    under new ``tool_use`` ids (`StaleHistory` through the ledger). A saved answer is
    asked of the ledger again (``run_tools``): a result the crash kept from the ledger's
    record (buffered, it rides with the next write) is never sent as if it were one."""

    def __init__(self, folder: Path, first: str) -> None:
        self.path = folder / HISTORY
        self.messages: list[Any] = (json.loads(self.path.read_text()) if self.path.exists()
                                    else [{"role": "user", "content": first}])

    def add(self, message: Any) -> None:
        """Append ``message`` (a reply as its JSON, a user message as it is) and save."""
        if hasattr(message, "content") and not isinstance(message, dict):
            message = {"role": "assistant", "content": json.loads(openapi_dumps(
                message.content))}
        self.messages.append(message)
        tmp = self.path.with_suffix(".tmp")
        with tmp.open("w") as out:
            out.write(json.dumps(self.messages))
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, self.path)

    def resumed(self, ledger: Any) -> list[Any]:
        """The messages of the request to send: a saved reply's calls answered first (from
        the ledger when they ran), or, when the conversation ended, its last request again
        (the ledger answers it with the recorded reply)."""
        if len(self.messages) > 1 and _answers(self.messages[-1]):
            self.messages.pop()  # asked of the ledger again, below
        last = self.messages[-1]
        if last["role"] == "assistant":
            if any(block.get("type") == "tool_use" for block in last["content"]):
                self.add(ledger.run_tools(last["content"]))
            else:
                self.messages.pop()
        return list(self.messages)


def _answers(message: Any) -> bool:
    """A user message of ``tool_result`` blocks."""
    content = message["content"]
    return message["role"] == "user" and isinstance(content, list) and any(
        block.get("type") == "tool_result" for block in content)


def converse(ledger: Any, client: Anthropic, history: SavedHistory,
             **params: Any) -> Any:
    """A ``messages.create`` loop through ``ledger`` from ``history`` (saved as it goes) to
    the final reply."""
    reply = ledger.create(client.messages, messages=history.resumed(ledger), **params)
    while True:
        history.add(reply)
        if reply.stop_reason != "tool_use":
            return reply
        history.add(ledger.run_tools(reply))
        reply = ledger.create(client.messages, messages=list(history.messages), **params)


def _messages(folder: Path, name: str, via: str, *, ledger: bool, crash_tool: bool = False,
              crash_request: bool = False, buffered: bool = False) -> dict[str, Any]:
    from statemachine import SQLiteEventStore
    from statemachine.adapters.anthropic import MessageToolLedger

    model = ScriptedModel(folder, name, crash_on_result=crash_request)
    client = Anthropic(api_key="test-key", max_retries=0, http_client=httpx2.Client(
        transport=httpx2.MockTransport(model.handle)))
    tool = sync_charge_tool(Effects(folder, name), crash=crash_tool)
    history: list[Any] = [{"role": "user", "content": "pay 7"}]
    params: dict[str, Any] = {"model": "claude-test", "max_tokens": 64}
    opened = MessageToolLedger.open(  # per event, unless asked: the kills fall between
        MESSAGES_RUN, [tool], store=SQLiteEventStore(folder / "events.db"),
        owner=name, buffered=buffered) if ledger else None
    answer: dict[str, Any] = {"name": name, "outcome": "done", "error": None}
    try:
        if opened is not None:
            saved = SavedHistory(folder, "pay 7")
            if via == "runner":
                final = _runner_loop(opened, client, tool, saved, **params)
            else:
                final = converse(opened, client, saved, tools=[tool.to_dict()], **params)
        elif via == "runner":
            final = client.beta.messages.tool_runner(tools=[tool], messages=history,
                                                     **params).until_done()
        else:
            params["tools"] = [tool.to_dict()]
            final = client.messages.create(messages=history, **params)
            while final.stop_reason == "tool_use":
                history.append({"role": "assistant", "content": final.content})
                results: Any = {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": block.id,
                     "content": tool.call(block.input)}
                    for block in final.content if block.type == "tool_use"]}
                history.append(results)
                final = client.messages.create(messages=history, **params)
    except Exception as error:  # the outcome is what the test reads
        return {**answer, "outcome": "error", "error": type(error).__name__,
                "message": str(error)}
    return {**answer, "final": final.content[0].text,
            "replayed": None if opened is None else opened.replayed}


def _runner_loop(ledger: Any, client: Anthropic, tool: Any, history: SavedHistory,
                 **params: Any) -> Any:
    """The SDK's tool runner, attached to ``ledger``, from ``history``: each reply it
    yields is saved before its calls run (`generate_tool_call_response` runs them, and the
    runner sends that answer), and the answer before the request carrying it."""
    runner = ledger.attach(client.beta.messages.tool_runner(
        tools=[tool], messages=history.resumed(ledger), **params))
    for message in runner:
        history.add(message)
        answer = runner.generate_tool_call_response()
        if answer is not None:
            history.add(json.loads(openapi_dumps(answer)))
    return runner.until_done()


async def _answer(argv: list[str]) -> dict[str, Any]:
    """What one command of `main` does, as the JSON answer it prints."""
    command, folder = argv[0], Path(argv[1])
    name = argv[2] if len(argv) > 2 else command
    if "messages-" in command:
        messages = {
            "messages-crash-tool": {"crash_tool": True},
            "messages-crash-request": {"crash_request": True},
            "messages-resume": {},
        }[command.removeprefix("sdk-")]
        return _messages(folder, name, argv[3], ledger=not command.startswith("sdk-"),
                         buffered=argv[4:] == ["buffered"], **messages)
    buffered = argv[3:] == ["buffered"]
    options = {
        "crash-post": {"ledger": True, "crash_post": True},
        "crash-tool": {"ledger": True, "crash_tool": True},
        "resume": {"ledger": True},
        "sdk-crash-post": {"ledger": False, "crash_post": True},
        "sdk-resume": {"ledger": False},
    }[command]
    return await _drive(folder, name, buffered=buffered, **options)


def fork(*argv: str) -> dict[str, Any] | None:
    """`main`'s command in a child forked from this process (no interpreter start-up, the
    SDK's models already built): its answer, or None when the process was killed."""
    from tests.drivers.durability_driver import run_forked

    async def body(ticks: Any) -> dict[str, Any]:
        return await _answer(list(argv))

    answer = run_forked(Path(argv[1]), body, None)
    if answer is not None:
        answer.pop("ticks")
    return answer


def main(argv: list[str]) -> int:
    print(json.dumps(asyncio.run(_answer(argv))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
