"""The Anthropic adapter under an SDK tool runner that compacts its conversation
(``runner.compact_before_next_turn()``), without a history: the compaction request goes
out on a fork of the runner's thread, carries the whole conversation (the results of its
calls included), and its answer replaces the messages the runner sends next.

The model is a local ``httpx2.MockTransport`` that answers from the conversation it is
sent, never from the ledger: it asks for ``charge(x=7)`` until the conversation holds a
tool result, or the summary of one, then answers ``done``; a compaction request gets a
summary block (stop reason ``compaction``) saying whether the customer was charged. A
tool's body appends a line to an fsynced file, so a second run of it shows.

What must hold wherever the compaction falls (before the first request, between a
reply asking for a call and the request carrying its result, after the final reply):
the tool runs once, the run is completed once the runner ends, in the store, with the
final reply recorded, and every result is posted (published). A compaction after the
final reply finds the run's end already in the store when its request arrives. A request
failing right after a compaction, retried from the first message: the SDK alone runs the
tool again; through the ledger it runs once.

Under CI a missing ``anthropic`` package fails this module instead of skipping it.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

try:
    import anthropic  # noqa: F401
except ImportError:  # pragma: no cover - CI installs the extra
    from tests.helpers import missing_extra

    missing_extra("anthropic")

import httpx2
from anthropic import Anthropic, AsyncAnthropic, InternalServerError
from anthropic.lib.tools import beta_async_tool, beta_tool

from statemachine import Phase, RunNotResumable, SQLiteEventStore, Step
from statemachine.adapters.anthropic import MessageToolLedger, StaleHistory
from tests.drivers.effects import Effects

WHEN = ("before-the-first-request", "after-a-call-was-asked-for", "after-the-final-reply")


class Model:
    """``POST /v1/messages`` answered from the request alone (see the module docstring).
    ``requests`` keeps each request's kind and messages; ``ended`` whether the run's end
    was in the store (read by a store of its own) when each request arrived."""

    def __init__(self, store_path: Path, *, fail_after_compaction: bool = False) -> None:
        self.store_path = store_path
        self.requests: list[tuple[str, list[dict[str, Any]]]] = []
        self.ended: list[bool] = []
        self.fail_after_compaction = fail_after_compaction

    def handle(self, request: httpx2.Request) -> httpx2.Response:
        body = json.loads(request.content)
        messages = body["messages"]
        compaction = bool(body.get("compaction"))
        if (not compaction and self.fail_after_compaction
                and any(kind == "compaction" for kind, _ in self.requests)):
            self.fail_after_compaction = False
            self.requests.append(("failed", messages))
            return httpx2.Response(500, json={"type": "error", "error": {
                "type": "api_error", "message": "injected"}})
        self.requests.append(("compaction" if compaction else "turn", messages))
        reader = SQLiteEventStore(self.store_path)
        try:
            self.ended.append(any(type(event).__name__ == "RunCompleted"
                                  for event in reader.load("t")))
        finally:
            reader.close()
        blocks = [block for message in messages if isinstance(message["content"], list)
                  for block in message["content"]]
        charged = any(block.get("type") == "tool_result" or (
            block.get("type") == "compaction" and "charged" in block["content"])
            for block in blocks)
        if compaction:  # (the summary says what the conversation it replaces did)
            content: list[dict[str, Any]] = [{"type": "compaction", "content": (
                "the customer was charged 7" if charged else "the customer asks to pay 7")}]
            stop = "compaction"
        elif charged:
            content, stop = [{"type": "text", "text": "done"}], "end_turn"
        else:
            content = [{"type": "tool_use", "id": f"tu_{len(self.requests)}",
                        "name": "charge", "input": {"x": 7}}]
            stop = "tool_use"
        return httpx2.Response(200, json={
            "id": f"msg_{len(self.requests)}", "type": "message", "role": "assistant",
            "model": "claude-test", "content": content, "stop_reason": stop,
            "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1}})


def _runner(client: Any, tool: Any) -> Any:
    return client.beta.messages.tool_runner(
        model="claude-test", max_tokens=64, tools=[tool], betas=["compact-2026-09-04"],
        messages=[{"role": "user", "content": "pay 7"}])


def _compacts_now(when: str, seen: list[Any]) -> bool:
    """Whether to schedule the compaction once ``seen`` (the runner's items so far)."""
    if when == WHEN[1]:
        return len(seen) == 1 and seen[0].stop_reason == "tool_use"
    return when == WHEN[2] and seen[-1].stop_reason == "end_turn"


def _opened(tmp_path: Path, **model: Any) -> tuple[Effects, Model, MessageToolLedger]:
    """The effects file, the model (``model``: its options) and the run's ledger on a
    SQLite store in ``tmp_path``."""
    ledger = MessageToolLedger.open("t", store=SQLiteEventStore(tmp_path / "events.db"))
    return Effects(tmp_path, "p"), Model(tmp_path / "events.db", **model), ledger


def _client(model: Model) -> Anthropic:
    return Anthropic(api_key="test-key", max_retries=0, http_client=httpx2.Client(
        transport=httpx2.MockTransport(model.handle)))


def _charge(effects: Effects) -> Any:
    @beta_tool
    def charge(x: int) -> str:
        """Charge the customer x dollars."""
        effects(f"charge {x}")
        return f"charged {x} (run {len(effects.lines())})"

    return charge


def _sync(tmp_path: Path, when: str) -> tuple[Model, list[str], MessageToolLedger]:
    effects, model, ledger = _opened(tmp_path)
    runner = _runner(_client(model), _charge(effects))
    if when == WHEN[0]:
        runner.compact_before_next_turn()
    runner = ledger.attach(runner)
    seen: list[Any] = []
    for message in runner:
        seen.append(message)
        if _compacts_now(when, seen):
            runner.compact_before_next_turn()
    return model, [message.stop_reason for message in seen], ledger


def _async(tmp_path: Path, when: str) -> tuple[Model, list[str], MessageToolLedger]:
    effects, model, ledger = _opened(tmp_path)
    client = AsyncAnthropic(api_key="test-key", max_retries=0, http_client=httpx2.AsyncClient(
        transport=httpx2.MockTransport(model.handle)))

    @beta_async_tool
    async def charge(x: int) -> str:
        """Charge the customer x dollars."""
        effects(f"charge {x}")
        return f"charged {x} (run {len(effects.lines())})"

    async def go() -> list[str]:
        runner = _runner(client, charge)
        if when == WHEN[0]:
            runner.compact_before_next_turn()
        runner = ledger.attach(runner)
        seen: list[Any] = []
        async for message in runner:
            seen.append(message)
            if _compacts_now(when, seen):
                runner.compact_before_next_turn()
        return [message.stop_reason for message in seen]

    return model, asyncio.run(go()), ledger


EXPECTED = {  # (the runner's items' stop reasons, the requests' kinds), from the script
    WHEN[0]: (["compaction", "tool_use", "end_turn"], ["compaction", "turn", "turn"]),
    WHEN[1]: (["tool_use", "compaction", "end_turn"], ["turn", "compaction", "turn"]),
    WHEN[2]: (["tool_use", "end_turn", "compaction"], ["turn", "turn", "compaction"]),
}


@pytest.mark.parametrize("drive", [_sync, _async], ids=["sync", "async"])
@pytest.mark.parametrize("when", WHEN)
def test_a_compacting_tool_runner_runs_the_tool_once_and_completes_the_run(
        tmp_path: Path, when: str, drive: Any) -> None:
    model, stops, ledger = drive(tmp_path, when)
    assert Effects(tmp_path, "p").lines() == ["p charge 7"]
    assert (stops, [kind for kind, _ in model.requests]) == EXPECTED[when]
    if when == WHEN[1]:
        # the compaction request carried the call's result: the model has seen it, and
        # the next request (its summary) cannot carry it again
        [compaction] = [messages for kind, messages in model.requests if kind == "compaction"]
        assert compaction[-1]["content"] == [{"type": "tool_result", "tool_use_id": "tu_1",
                                              "content": "charged 7 (run 1)"}]
    # the run's end is in the store, read by a store of its own
    reader = SQLiteEventStore(tmp_path / "events.db")
    reopened = MessageToolLedger.open("t", store=reader)
    c = reopened.controller
    assert c.step is Step.COMPLETED
    assert ledger.controller.step is Step.COMPLETED
    record = c.final_output
    assert isinstance(record, dict)
    assert record["reply"]["content"] == [{"type": "text", "text": "done"}]
    assert record["reply"]["stop_reason"] == "end_turn"
    assert [view.phase for view in c.calls] == [Phase.PUBLISHED]
    reader.close()


@pytest.mark.parametrize("drive", [_sync, _async], ids=["sync", "async"])
def test_a_compaction_after_the_final_reply_goes_out_once_the_end_is_durable(
        tmp_path: Path, drive: Any) -> None:
    """The conversation ended with the reply before it: a crash while the compaction is
    answered must not leave a completed conversation unrecorded (its retry would ask the
    model again)."""
    model, _, _ = drive(tmp_path, WHEN[2])
    assert model.ended == [False, False, True]


@pytest.mark.parametrize("when", WHEN)
def test_a_retry_of_a_completed_compacted_conversation_sends_nothing(
        tmp_path: Path, when: str) -> None:
    """A new runner from the first message, on a ledger loaded from the store: when the
    compaction came after the final reply, the recorded reply answers it (the request
    the reply answered begins with that message); when it came before, the recorded
    request is the compacted conversation, which the first message does not begin, and
    the retry is refused before anything is sent."""
    model, _, _ = _sync(tmp_path, when)
    sent = len(model.requests)
    reader = SQLiteEventStore(tmp_path / "events.db")
    ledger = MessageToolLedger.open("t", store=reader)
    runner = ledger.attach(_runner(_client(model), _charge(Effects(tmp_path, "again"))))
    if when == WHEN[2]:
        assert runner.until_done().content[0].text == "done"
    else:
        with pytest.raises(RunNotResumable):
            runner.until_done()
    assert len(model.requests) == sent
    assert Effects(tmp_path, "p").lines() == ["p charge 7"]
    reader.close()


@pytest.mark.parametrize("through", ["sdk-alone", "the-same-ledger", "a-ledger-from-the-store"])
def test_a_request_failing_after_a_compaction_leaves_its_results_unsent(
        tmp_path: Path, through: str) -> None:
    """A compaction between a call's result and the next request, which fails; the caller
    retries with a new runner from the first message, as after any failed request. The
    SDK alone sends it as it is, the model asks again under a new id and the tool runs
    twice. Through the ledger the results the compaction carried count as sent only once
    a request built on its summary is answered, so the retry is given the turn it lacks,
    rebuilt from the ledger (`resumed`), or, on a ledger that never saw the reply,
    refused before anything is sent (`StaleHistory`): the tool runs once."""
    effects, model, ledger = _opened(tmp_path, fail_after_compaction=True)
    client, charge = _client(model), _charge(effects)
    alone = through == "sdk-alone"
    runner = _runner(client, charge) if alone else ledger.attach(_runner(client, charge))

    def compacting() -> None:
        for message in runner:
            if message.stop_reason == "tool_use":
                runner.compact_before_next_turn()

    with pytest.raises(InternalServerError):
        compacting()
    assert [kind for kind, _ in model.requests] == ["turn", "compaction", "failed"]
    if alone:
        assert _runner(client, charge).until_done().content[0].text == "done"
        assert effects.lines() == ["p charge 7", "p charge 7"]
        return
    retry = (ledger if through == "the-same-ledger" else MessageToolLedger.open(
        "t", store=SQLiteEventStore(tmp_path / "events.db")))
    again = retry.attach(_runner(client, charge))
    if through == "the-same-ledger":
        assert again.until_done().content[0].text == "done"
        assert model.requests[-1][1][1:] == [  # the turn the first message lacked
            {"role": "assistant", "content": [{"type": "tool_use", "id": "tu_1",
                                               "name": "charge", "input": {"x": 7}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu_1",
                                          "content": "charged 7 (run 1)"}]}]
        assert retry.controller.step is Step.COMPLETED
    else:
        with pytest.raises(StaleHistory):
            again.until_done()
        assert len(model.requests) == 3  # nothing sent
    assert effects.lines() == ["p charge 7"]
