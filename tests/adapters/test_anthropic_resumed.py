"""The Anthropic messages ledger when a request carrying a tool's result fails (DESIGN
§2.4, §7.3, §7.7): offline, through the SDK's own HTTP layer into a local
``httpx2.MockTransport`` that plays a script (a 500 where the script says).

* A caller retrying with the messages it had before the reply that asked for the call
  (the SDK's tool runner keeps the turn to itself: ``until_done`` raises the 500 and the
  caller's list holds only its first message) is sent the turns it lacks, rebuilt from
  the ledger (`MessageToolLedger.resumed`): the reply as it came, the recorded results;
  the conversation ends and each tool ran once. Where that cannot be exact the request is
  refused before anything is sent (`StaleHistory`, naming why): a reply with thinking
  blocks (their signatures are not kept), a history that is not the one the reply
  answered.
* Every request carrying a tool's result finds that result durable (`flush_results`):
  a reader of the store sees the call completed, not in doubt, while the model answers.

Expected outcomes come from the script: a tool appends one fsynced line per run to a
file, and the requests the model should see are written out from the script.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Collection
from pathlib import Path
from typing import Any

import pytest

try:
    import anthropic  # noqa: F401
except ImportError:  # pragma: no cover - CI installs the extra
    from tests.helpers import missing_extra

    missing_extra("anthropic")

import httpx2
from anthropic import APIStatusError, InternalServerError
from anthropic.lib.tools import beta_async_tool, beta_tool

from statemachine import Phase, RunController, RunNotResumable, SQLiteEventStore, Step
from statemachine.adapters.anthropic import MessageToolLedger, StaleHistory
from tests.drivers.anthropic_driver import Served
from tests.drivers.effects import Effects

USER = {"role": "user", "content": "pay 7 then 8"}
THOUGHT = {"type": "thinking", "thinking": "charge first", "signature": "c2lnbmVk"}


def use(n: int, x: int) -> dict[str, Any]:
    return {"type": "tool_use", "id": f"tu_{n}", "name": "charge", "input": {"x": x}}


def result(n: int, x: int) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"tu_{n}",
                                         "content": f"charged {x}"}]}


class Script(Served):
    """``POST /v1/messages``: turn ``k`` of ``turns`` (an assistant content list) answers
    a request whose last message is the user's text (``k = 0``) or the results of
    ``tu_k``; after the last turn, a final text naming every result the request's last
    message carries. ``fail`` lists, per request, whether to answer 500. ``on_results``
    is called with each request that carries a tool_result, before it is answered."""

    def __init__(self, turns: list[list[dict[str, Any]]], fail: list[bool] | None = None,
                 on_results: Any = None) -> None:
        self.turns = turns
        self.fail = list(fail or [])
        self.on_results = on_results
        self.requests: list[list[dict[str, Any]]] = []

    def handle(self, request: httpx2.Request) -> httpx2.Response:
        messages = json.loads(request.content)["messages"]
        self.requests.append(messages)
        last = messages[-1]["content"]
        answered = [block for block in last if block["type"] == "tool_result"] if isinstance(
            last, list) else []
        if answered and self.on_results is not None:
            self.on_results()
        if self.fail and self.fail.pop(0):
            return httpx2.Response(500, json={"type": "error", "error": {
                "type": "api_error", "message": "injected"}})
        k = int(answered[-1]["tool_use_id"].removeprefix("tu_")) if answered else 0
        if k < len(self.turns):
            content, stop = self.turns[k], "tool_use"
        else:
            content = [{"type": "text", "text": "; ".join(
                str(block["content"]) for block in answered)}]
            stop = "end_turn"
        reply = {"id": f"msg_{len(self.requests)}", "type": "message", "role": "assistant",
                 "model": "claude-test", "content": content, "stop_reason": stop,
                 "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1}}
        if json.loads(request.content).get("stream"):
            return httpx2.Response(200, headers={"content-type": "text/event-stream"},
                                   content=streamed(reply))
        return httpx2.Response(200, json=reply)


def streamed(reply: dict[str, Any]) -> bytes:
    """``reply`` as the API streams it (server-sent events, one block after another)."""
    events: list[dict[str, Any]] = [{"type": "message_start", "message": {
        **reply, "content": [], "stop_reason": None}}]
    for index, block in enumerate(reply["content"]):
        kind = block["type"]
        start: dict[str, Any]
        deltas: list[dict[str, Any]]
        if kind == "text":
            start, deltas = {"type": "text", "text": ""}, [
                {"type": "text_delta", "text": block["text"]}]
        elif kind == "thinking":
            start, deltas = {"type": "thinking", "thinking": ""}, [
                {"type": "thinking_delta", "thinking": block["thinking"]},
                {"type": "signature_delta", "signature": block["signature"]}]
        else:
            start, deltas = {**block, "input": {}}, [
                {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}]
        events += [{"type": "content_block_start", "index": index, "content_block": start},
                   *({"type": "content_block_delta", "index": index, "delta": delta}
                     for delta in deltas),
                   {"type": "content_block_stop", "index": index}]
    events += [{"type": "message_delta", "delta": {"stop_reason": reply["stop_reason"],
                                                    "stop_sequence": None},
                "usage": {"output_tokens": 1}}, {"type": "message_stop"}]
    return "".join(f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"
                   for event in events).encode()


def charge_tools(effects: Effects) -> tuple[Any, Any]:
    """``charge(x)`` as a sync and an async tool, one fsynced line per run."""

    @beta_tool
    def charge(x: int) -> str:
        """Charge the customer x dollars."""
        effects(f"charge {x}")
        return f"charged {x}"

    @beta_async_tool
    async def acharge(x: int) -> str:
        """Charge the customer x dollars."""
        effects(f"charge {x}")
        return f"charged {x}"

    acharge.name = "charge"
    return charge, acharge


PARAMS: dict[str, Any] = {"model": "claude-test", "max_tokens": 64}


def run(kind: str, ledger: MessageToolLedger, script: Script, effects: Effects,
        messages: list[Any]) -> Any:
    """One attempt at the conversation from ``messages`` (never changed): the SDK's tool
    runner (sync or async) attached to ``ledger``, or a ``create`` / ``acreate`` loop that
    answers each reply with ``run_tools`` / ``arun_tools`` and keeps its history to
    itself, as the runner does."""
    charge, acharge = charge_tools(effects)
    if kind == "runner":
        return ledger.attach(script.client().beta.messages.tool_runner(
            tools=[charge], messages=messages, **PARAMS)).until_done()
    if kind in ("streamed-runner", "eager-runner"):
        return ledger.attach(script.client().beta.messages.tool_runner(
            tools=[charge], messages=messages, stream=True,
            run_tools_eagerly=kind == "eager-runner", **PARAMS)).until_done()
    if kind == "async-runner":
        return asyncio.run(ledger.attach(script.async_client().beta.messages.tool_runner(
            tools=[acharge], messages=messages, **PARAMS)).until_done())
    params = {**PARAMS, "tools": [charge.to_dict()]}
    if kind == "create":
        history = list(messages)
        reply = ledger.create(script.client().messages, messages=history, **params)
        while reply.stop_reason == "tool_use":
            history += [{"role": "assistant", "content": reply.content},
                        ledger.run_tools(reply)]
            reply = ledger.create(script.client().messages, messages=history, **params)
        return reply

    async def loop() -> Any:
        client = script.async_client()
        history = list(messages)
        reply = await ledger.acreate(client.messages, messages=history, **params)
        while reply.stop_reason == "tool_use":
            history += [{"role": "assistant", "content": reply.content},
                        await ledger.arun_tools(reply)]
            reply = await ledger.acreate(client.messages, messages=history, **params)
        return reply

    return asyncio.run(loop())


KINDS = ["runner", "streamed-runner", "eager-runner", "async-runner", "create", "acreate"]


def open_ledger(kind: str, path: Path, effects: Effects) -> MessageToolLedger:
    """The ledger of run ``m`` on the SQLite store at ``path`` (buffered, the default),
    holding the tool a ``create`` / ``acreate`` loop runs."""
    charge, acharge = charge_tools(effects)
    return MessageToolLedger.open("m", [acharge if kind == "acreate" else charge],
                                  store=SQLiteEventStore(path))


@pytest.mark.invariant("I1", "I12")
@pytest.mark.parametrize("kind", KINDS)
def test_a_retry_from_the_first_message_is_sent_the_turns_it_lacks(
        tmp_path: Path, kind: str) -> None:
    """Two tool turns, with text beside the second call; the request carrying the second
    result fails (500) after the tool ran and its result was recorded. The caller retries
    with the one message it had: the ledger sends both turns it lacks (the first one's
    results were posted, the second one's never), each reply as it came and each result
    as it was first sent; the conversation ends, each tool ran once."""
    effects = Effects(tmp_path, "p")
    turns = [[use(1, 7)], [{"type": "text", "text": "and now 8"}, use(2, 8)]]
    script = Script(turns, fail=[False, False, True])
    ledger = open_ledger(kind, tmp_path / "events.db", effects)
    with pytest.raises(InternalServerError):
        run(kind, ledger, script, effects, [USER])
    assert effects.lines() == ["p charge 7", "p charge 8"]
    final = run(kind, ledger, script, effects, [USER])
    assert final.content[0].text == "charged 8"
    assert effects.lines() == ["p charge 7", "p charge 8"]  # neither ran again
    whole = [USER, {"role": "assistant", "content": turns[0]}, result(1, 7),
             {"role": "assistant", "content": turns[1]}, result(2, 8)]
    assert script.requests[-1] == whole  # (the runner's server-side thread starts anew)
    assert len(script.requests) == 4  # one per turn, the failed one, the retried one
    assert ledger.controller.step is Step.COMPLETED


@pytest.mark.parametrize("kind", KINDS)
def test_a_reply_with_thinking_blocks_is_not_rebuilt(tmp_path: Path, kind: str) -> None:
    """The reply that asked for the call held a thinking block: its signature is the
    API's, which the ledger does not keep, so a retry lacking that reply is refused before
    anything is sent (`StaleHistory`, ``why="thinking"``), the tool not run again; the
    history holding the reply as it came, answered from the ledger, goes on."""
    effects = Effects(tmp_path, "p")
    script = Script([[THOUGHT, use(1, 7)]], fail=[False, True])
    ledger = open_ledger(kind, tmp_path / "events.db", effects)
    with pytest.raises(InternalServerError):
        run(kind, ledger, script, effects, [USER])
    with pytest.raises(StaleHistory) as refused:
        run(kind, ledger, script, effects, [USER])
    assert (refused.value.why, refused.value.call_ids) == ("thinking", ("tu_1",))
    assert "thinking" in str(refused.value)
    assert len(script.requests) == 2  # nothing sent
    kept: list[dict[str, Any]] = [USER, {"role": "assistant", "content": [THOUGHT, use(1, 7)]}]
    final = ledger.create(script.client().messages, **PARAMS,
                          messages=[*kept, asyncio.run(ledger.arun_tools(
                              kept[1]["content"]))])
    assert final.content[0].text == "charged 7"
    assert script.requests[-1] == [*kept, result(1, 7)]
    assert effects.lines() == ["p charge 7"]


@pytest.mark.parametrize("kind", ["runner", "create"])
def test_a_history_the_reply_did_not_answer_is_refused(tmp_path: Path, kind: str) -> None:
    """A retry whose history differs from the request the reply answered other than by
    the missing turns (another first message) is refused before anything is sent
    (`StaleHistory`, ``why="diverged"``): the kept turn answered another history."""
    effects = Effects(tmp_path, "p")
    script = Script([[use(1, 7)]], fail=[False, True])
    ledger = open_ledger(kind, tmp_path / "events.db", effects)
    with pytest.raises(InternalServerError):
        run(kind, ledger, script, effects, [USER])
    other = {"role": "user", "content": "pay 7 then 9"}
    with pytest.raises(StaleHistory) as refused:
        run(kind, ledger, script, effects, [other])
    assert (refused.value.why, refused.value.call_ids) == ("diverged", ("tu_1",))
    assert len(script.requests) == 2
    assert run(kind, ledger, script, effects, [USER]).content[0].text == "charged 7"
    assert effects.lines() == ["p charge 7"]


@pytest.mark.invariant("I11")
@pytest.mark.parametrize("kind", KINDS)
def test_a_request_carrying_a_result_finds_it_durable(tmp_path: Path, kind: str) -> None:
    """Buffered (the default): while the model answers each request carrying a tool's
    result, a reader of the store (an operator's inbox, another process after a crash)
    finds the call completed with its result, nothing in doubt."""
    path = tmp_path / "events.db"
    seen: list[tuple[Phase | None, tuple[str, ...]]] = []

    def look() -> None:
        reader = SQLiteEventStore(path)
        try:
            stored = RunController.load(reader, "m")
            seen.append((stored.phase("tu_1"), stored.in_doubt()))
        finally:
            reader.close()

    effects = Effects(tmp_path, "p")
    script = Script([[use(1, 7)]], on_results=look)
    ledger = open_ledger(kind, path, effects)
    assert run(kind, ledger, script, effects, [USER]).content[0].text == "charged 7"
    assert seen == [(Phase.COMPLETED, ())]
    assert effects.lines() == ["p charge 7"]


# ------------------------------------------------- a stream that breaks mid-body


class Fresh(Served):
    """A model that names each call afresh, as the API does: a request ending with the
    user's text is answered with ``charge(x=7)`` under the id ``tu_r<n>`` (``n``: the
    request's number, from 1), one ending with results with a final text naming them.
    Every request is answered as it asks (streamed or not); the ``broken`` ones (by
    number) with a 200 whose stream breaks after its first event (an ``error`` event,
    which the API sends mid-body when overloaded), their answer never given."""

    def __init__(self, broken: Collection[int] = (), pause: bool = False) -> None:
        self.broken = broken
        self.pause = pause
        self.requests: list[list[dict[str, Any]]] = []

    def handle(self, request: httpx2.Request) -> httpx2.Response:
        body = json.loads(request.content)
        self.requests.append(body["messages"])
        n = len(self.requests)
        # (after a paused turn the runner's thread sends nothing new)
        last = body["messages"][-1]["content"] if body["messages"] else ""
        answered = [block for block in last if block["type"] == "tool_result"] if isinstance(
            last, list) else []
        content: list[dict[str, Any]]
        if self.pause and n == 1:  # (a server tool's turn, paused: the runner goes on)
            content, stop = [{"type": "text", "text": "searching"}], "pause_turn"
        elif answered:
            content = [{"type": "text", "text": "done: " + "; ".join(
                str(block["content"]) for block in answered)}]
            stop = "end_turn"
        else:
            content = [{"type": "tool_use", "id": f"tu_r{n}", "name": "charge",
                        "input": {"x": 7}}]
            stop = "tool_use"
        reply = {"id": f"msg_{n}", "type": "message", "role": "assistant",
                 "model": "claude-test", "content": content, "stop_reason": stop,
                 "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1}}
        if not body.get("stream"):
            assert n not in self.broken, "only a stream breaks mid-body"
            return httpx2.Response(200, json=reply)
        text = streamed(reply)
        if n in self.broken:  # its first event, then the error
            error = {"type": "error", "error": {"type": "overloaded_error",
                                                "message": "Overloaded"}}
            text = text.split(b"\n\n")[0] + b"\n\n" + (
                f"event: error\ndata: {json.dumps(error)}\n\n".encode())
        return httpx2.Response(200, headers={"content-type": "text/event-stream"},
                               content=text)


class Reading:
    """A streamed reply's events read into the message they stream (its content as the
    SDK sends it back), as a caller's loop over ``create(stream=True)`` builds it."""

    def __init__(self) -> None:
        self.content: list[dict[str, Any]] = []
        self.stop_reason: str | None = None
        self._json: dict[int, str] = {}

    def read(self, event: Any) -> None:
        if event.type == "content_block_start":
            self.content.append(event.content_block.model_dump(exclude_none=True))
            self._json[event.index] = ""
        elif event.type == "content_block_delta" and event.delta.type == "text_delta":
            self.content[event.index]["text"] += event.delta.text
        elif event.type == "content_block_delta" and event.delta.type == "input_json_delta":
            self._json[event.index] += event.delta.partial_json
        elif event.type == "content_block_stop" and self._json[event.index]:
            self.content[event.index]["input"] = json.loads(self._json[event.index])
        elif event.type == "message_delta":
            self.stop_reason = event.delta.stop_reason


STREAMED = ["streamed-runner", "eager-runner", "async-streamed-runner", "create-stream",
            "acreate-stream"]
"""Every way a conversation reads its replies as streams."""


def streaming(kind: str, ledger: MessageToolLedger, model: Fresh, effects: Effects,
              messages: list[Any]) -> tuple[str, list[Any]]:
    """One attempt at the conversation from ``messages``, every reply streamed: the
    SDK's streamed tool runner (sync, eager, async) attached to ``ledger``, or a loop
    of ``create(stream=True)`` / ``acreate`` reading each stream to its end and
    answering its calls with ``run_tools``. (The final text, and the history the loop
    built: for a runner, the messages it had.)"""
    charge, acharge = charge_tools(effects)
    if kind in ("streamed-runner", "eager-runner"):
        final = ledger.attach(model.client().beta.messages.tool_runner(
            tools=[charge], messages=messages, stream=True,
            run_tools_eagerly=kind == "eager-runner", **PARAMS)).until_done()
        return final.content[0].text, messages
    if kind == "async-streamed-runner":
        final = asyncio.run(ledger.attach(model.async_client().beta.messages.tool_runner(
            tools=[acharge], messages=messages, stream=True, **PARAMS)).until_done())
        return final.content[0].text, messages
    params = {**PARAMS, "tools": [charge.to_dict()], "stream": True}
    history = list(messages)

    async def loop() -> str:
        client = model.async_client()
        while True:
            reading = Reading()
            async for event in await ledger.acreate(client.messages, messages=history,
                                                    **params):
                reading.read(event)
            if reading.stop_reason != "tool_use":
                return str(reading.content[0]["text"])
            history.extend([{"role": "assistant", "content": reading.content},
                            await ledger.arun_tools(reading.content)])

    if kind == "acreate-stream":
        return asyncio.run(loop()), history
    client = model.client()
    while True:
        reading = Reading()
        for event in ledger.create(client.messages, messages=history, **params):
            reading.read(event)
        if reading.stop_reason != "tool_use":
            return str(reading.content[0]["text"]), history
        history += [{"role": "assistant", "content": reading.content},
                    ledger.run_tools(reading.content)]


@pytest.mark.invariant("I1", "I12")
@pytest.mark.parametrize("kind", STREAMED)
def test_a_stream_broken_mid_body_leaves_its_results_unsent(tmp_path: Path,
                                                            kind: str) -> None:
    """The request carrying the tool's result is answered (200) and its stream breaks
    after its first event: the model's answer never came, so the result it carried was
    not posted. The caller retries with the one message it had. A runner's ledger saw
    the reply that asked for the call (it is in the runner's thread): it sends the turn
    the history lacks, and the conversation ends. A ``create`` loop's never saw it (the
    caller read the stream): refused before anything is sent (`StaleHistory`, ``why=
    "not-kept"``), and the history the caller built goes on. The tool ran once either
    way. (Posted when its stream opened, the result was taken as seen: the retry went
    out as it was, the model asked again under a new id, and the tool ran twice.)"""
    effects = Effects(tmp_path, "p")
    model = Fresh(broken={2})
    ledger = open_ledger("acreate" if kind.startswith("async") or kind == "acreate-stream"
                         else kind, tmp_path / "events.db", effects)
    asked = {"role": "assistant", "content": [
        {"type": "tool_use", "id": "tu_r1", "name": "charge", "input": {"x": 7}}]}
    answer = {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "tu_r1", "content": "charged 7"}]}
    with pytest.raises(APIStatusError):
        streaming(kind, ledger, model, effects, [USER])
    assert effects.lines() == ["p charge 7"]
    assert ledger.controller.phase("tu_r1") is Phase.COMPLETED  # (not posted)
    if kind.endswith("runner"):
        final, _ = streaming(kind, ledger, model, effects, [USER])
        assert model.requests[-1] == [USER, asked, answer]
        assert len(model.requests) == 3
    else:
        with pytest.raises(StaleHistory) as refused:
            streaming(kind, ledger, model, effects, [USER])
        assert (refused.value.why, refused.value.call_ids) == ("not-kept", ("tu_r1",))
        assert len(model.requests) == 2  # nothing sent
        final, _ = streaming(kind, ledger, model, effects, [USER, asked, answer])
        assert model.requests[-1] == [USER, asked, answer]
    assert final == "done: charged 7"
    assert effects.lines() == ["p charge 7"]  # never again


# ------------------------------------------------------------- an abandoned run


@pytest.mark.invariant("I9")
@pytest.mark.parametrize("kind", [*KINDS, "async-streamed-runner", "create-stream",
                                  "acreate-stream"])
def test_an_abandoned_run_sends_nothing(tmp_path: Path, kind: str) -> None:
    """`abandon` on the ledger a loop goes on with: its next request (`create`, an
    attached runner's first) is refused (`RunNotResumable`, naming the reason), nothing
    sent and no tool run, as it is when the run is opened again."""
    effects = Effects(tmp_path, "p")
    ledger = open_ledger("acreate" if kind.startswith("async") or kind == "acreate-stream"
                         else kind, tmp_path / "events.db", effects)
    ledger.abandon("the card was stolen", by="ops")

    def attempt() -> None:
        if kind in KINDS:
            run(kind, ledger, Script([[use(1, 7)]]), effects, [USER])
        else:
            streaming(kind, ledger, Fresh(), effects, [USER])

    with pytest.raises(RunNotResumable) as refused:
        attempt()
    assert "the card was stolen" in str(refused.value)
    assert effects.lines() == []
    with pytest.raises(RunNotResumable):
        MessageToolLedger.open("m", store=SQLiteEventStore(tmp_path / "events.db"))


@pytest.mark.invariant("I9")
@pytest.mark.parametrize("kind", ["runner", "async-runner"])
def test_a_run_abandoned_while_its_runner_goes_on_sends_nothing_more(
        tmp_path: Path, kind: str) -> None:
    """The first reply pauses its turn (a server tool's), and the caller abandons the run
    before the runner sends the next request: that request is refused, nothing more
    sent."""
    effects = Effects(tmp_path, "p")
    model = Fresh(pause=True)
    ledger = open_ledger("acreate" if kind == "async-runner" else kind,
                         tmp_path / "events.db", effects)
    charge, acharge = charge_tools(effects)
    first: list[Any] = [USER]

    def iterate() -> None:
        for reply in ledger.attach(model.client().beta.messages.tool_runner(
                tools=[charge], messages=first, **PARAMS)):
            assert reply.stop_reason == "pause_turn"
            ledger.abandon("stop here")

    async def iterate_async() -> None:
        async for reply in ledger.attach(model.async_client().beta.messages.tool_runner(
                tools=[acharge], messages=first, **PARAMS)):
            assert reply.stop_reason == "pause_turn"
            ledger.abandon("stop here")

    with pytest.raises(RunNotResumable):
        iterate() if kind == "runner" else asyncio.run(iterate_async())
    assert len(model.requests) == 1
    assert effects.lines() == []


def test_a_posted_call_asked_for_again_with_other_arguments_is_refused(
        tmp_path: Path) -> None:
    """A reply names a call again under the id of one whose result was posted, with
    other arguments (``charge(8)`` under ``tu_1``, whose ``charge(7)`` ran and was sent):
    neither run nor answered with the other call's result (`InvalidTransition`, naming
    it); the same arguments are answered from the ledger, not run. Before, it was
    answered ``charged 7`` for a charge of 8."""
    from statemachine import InvalidTransition

    effects = Effects(tmp_path, "p")
    script = Script([[use(1, 7)]])
    ledger = open_ledger("create", tmp_path / "events.db", effects)
    assert run("create", ledger, script, effects, [USER]).content[0].text == "charged 7"
    assert ledger.controller.phase("tu_1") is Phase.PUBLISHED
    with pytest.raises(InvalidTransition, match=r"'tu_1'.*other than the recorded"):
        ledger.run_tools([use(1, 8)])
    assert ledger.run_tools([use(1, 7)]) == result(1, 7)
    assert effects.lines() == ["p charge 7"]
