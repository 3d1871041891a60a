"""The adapter corners of `statemachine.testing.adapter_corners` (issue 32) played through
the Anthropic adapter's `MessageToolLedger` (a ``client.messages.create`` loop), offline:
every request goes through the SDK's own HTTP layer into a local ``httpx2.MockTransport``.
Each case is checked against what the case alone says:

* the mixes and orders of new, cached and in-doubt calls in one reply that this adapter
  can reach: its ledger refuses every tool while a call is in doubt, so a reply holds at
  most one (every mix of up to three calls with at most one in doubt; drawn ones up to
  eight in ``just fuzz``). The earlier attempt is played through `run_tools`: the cached
  calls answered one by one, in any order, then the call in doubt dying in its body;
  the new ones never reach the ledger. Then the run is resumed from the store or by the
  same object;
* the request carrying a recorded result failing, once or twice, through a ``create``
  loop and through a tool runner, sync and async (a new runner given the reply the failed
  one yielded):
  this adapter writes no Session, its results reach the model by that request only;
* the caller's messages saved when the reply came, or before its request, reused after
  the run moved on (the result recorded; the request carrying it failed; the run
  completed), through a ``create`` loop and through a tool runner given them; the model
  names the calls of a reply asked for again afresh, as the API does. Saved before the
  reply, they are refused before any request (`StaleHistory`);
* a rival claiming the run (another connection to the SQLite file): opening its own
  ledger first (the messages ledger claims when it is opened), or during the first
  attempt's model request, or during its tool body;
* a final output, text (through ``create``, or a tool runner) or structured (a tool
  runner's ``output_format``: a dataclass, a pydantic model, with fields JSON lacks, a NaN
  among them), the run crashed after every append (a store snapshotting every event) and
  asked again: the ledger records the reply as the API sent it, so every shape is kept
  whole and parsed again (``reparsed``); with no Session a run's end is never staged.

Under CI a missing ``anthropic`` package fails this module instead of skipping it.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import decimal
import json
import os
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pydantic
import pytest
from hypothesis import assume, given, settings

try:
    import anthropic  # noqa: F401
except ImportError:  # pragma: no cover - CI installs the extra
    from tests.helpers import missing_extra

    missing_extra("anthropic")

import httpx2
from anthropic import Anthropic, InternalServerError
from anthropic.lib.tools import beta_async_tool, beta_tool

from statemachine import (
    ControlError,
    RunController,
    SQLiteEventStore,
    ToolInDoubt,
    tool_context,
)
from statemachine import controller as controller_module
from statemachine import events as ev
from statemachine.adapters.anthropic import MessageToolLedger
from statemachine.testing import (
    PLAIN_TEXT,
    STRUCTURED_TEXT,
    Boundary,
    FaultSeen,
    OneWriterCase,
    OneWriterSeen,
    OutputCase,
    OutputSeen,
    OutputShape,
    RecordedFault,
    RecordedFaultCase,
    ReplyCase,
    ReplySeen,
    StaleSeen,
    StaleStateCase,
    Structured,
    boundary_of,
    check_one_writer,
    check_output,
    check_recorded_fault,
    check_reply,
    check_stale_state,
    every_one_writer_case,
    every_recorded_fault_case,
    every_reply_case,
    every_stale_state_case,
    reply_cases,
)
from statemachine.testing.adapter_corners import (
    CACHED,
    COMPLETED,
    DATACLASS,
    DECIDED,
    IN_DOUBT,
    LOADED,
    MODEL,
    MODEL_CALL,
    TEXT,
    TOOL_BODY,
    WRITTEN,
)
from statemachine.values import Resolution
from tests.drivers.anthropic_driver import Served
from tests.helpers import crash_folder

FUZZ = os.environ.get("HYPOTHESIS_PROFILE") == "fuzz"
PARAMS: dict[str, Any] = {"model": "claude-test", "max_tokens": 64}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with crash_folder(tmp_path_factory, "an-corners") as folder:  # fsyncs are cheap there
        yield folder


def _folder(root: Path) -> Path:
    """A fresh folder for one case's SQLite files."""
    return Path(tempfile.mkdtemp(dir=root))


def _results(messages: list[Any]) -> list[tuple[str, Any]]:
    """The (tool_use id, content) pairs of the tool_result blocks in ``messages``."""
    return [(block["tool_use_id"], block["content"]) for message in messages
            if isinstance(message.get("content"), list) for block in message["content"]
            if isinstance(block, dict) and block.get("type") == "tool_result"]


class Model(Served):
    """``POST /v1/messages``: answers a request without tool results with one reply
    holding a ``tool_use`` of ``work`` for each of ``ids``, and one carrying results with
    the final text ``done``; ``fail`` lists, per request, whether to answer 500. Every
    request's messages are kept. ``fresh``: a reply after the first names its calls
    afresh, as the API does (it never gives a ``tool_use`` id twice)."""

    def __init__(self, ids: list[str], fail: list[bool] | None = None, *,
                 fresh: bool = False) -> None:
        self.ids = ids
        self.fail = list(fail or [])
        self.fresh = fresh
        self.replies = 0
        self.requests: list[list[dict[str, Any]]] = []
        self.answered: list[bool] = []
        self.during: Callable[[int], None] | None = None
        """Called with the request's number (from 1) while it is on its way."""

    def handle(self, request: httpx2.Request) -> httpx2.Response:
        messages = json.loads(request.content)["messages"]
        self.requests.append(messages)
        if self.during is not None:
            self.during(len(self.requests))
        self.answered.append(not (self.fail and self.fail.pop(0)))
        if not self.answered[-1]:
            return httpx2.Response(500, json={"type": "error", "error": {
                "type": "api_error", "message": "injected"}})
        if _results(messages[-1:]):
            content: list[dict[str, Any]] = [{"type": "text", "text": "done"}]
        else:
            again = f"-again{self.replies}" if self.fresh and self.replies else ""
            self.replies += 1
            content = [{"type": "tool_use", "id": call_id + again, "name": "work",
                        "input": {"n": n}} for n, call_id in enumerate(self.ids)]
        return httpx2.Response(200, json={
            "id": f"msg_{len(self.requests)}", "type": "message", "role": "assistant",
            "model": "claude-test", "content": content,
            "stop_reason": "tool_use" if content[0]["type"] == "tool_use" else "end_turn",
            "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1}})


class Crash(BaseException):
    """The process dying inside a tool body."""


def _work(runs: Counter[str], dying: set[str], *,
          during: Callable[[], None] | None = None) -> Any:
    @beta_tool
    def work(n: int) -> str:
        """Do the n-th piece of work."""
        call_id = tool_context().call_id
        runs[call_id] += 1
        if during is not None:
            during()
        if call_id in dying:
            raise Crash
        return ReplyCase.result_text(call_id)

    return work


def _awork(runs: Counter[str]) -> Any:
    """`_work` as an async tool, for an async runner."""
    @beta_async_tool
    async def work(n: int) -> str:
        """Do the n-th piece of work."""
        call_id = tool_context().call_id
        runs[call_id] += 1
        return ReplyCase.result_text(call_id)

    return work


# ------------------------------------------------------------ one reply, mixed


def _reachable(case: ReplyCase) -> bool:
    """At most one call in doubt: this adapter refuses every tool once one is."""
    return case.kinds.count(IN_DOUBT) <= 1


def _play_reply(case: ReplyCase, folder: Path) -> ReplySeen:
    runs: Counter[str] = Counter()
    dying = set(case.of_kind(IN_DOUBT))
    model = Model(case.ids)
    client = model.client()
    tools = [_work(runs, dying)]

    def opened() -> MessageToolLedger:  # as a new process opens it: from the store
        return MessageToolLedger.open("reply", tools, store=SQLiteEventStore(
            folder / "events.db"), buffered=False)

    ledger = opened()
    history: list[Any] = [{"role": "user", "content": "go"}]
    reply = ledger.create(client.messages, messages=history, **PARAMS)
    uses = {block.id: block for block in reply.content if block.type == "tool_use"}
    for call_id in case.of_kind(CACHED):  # answered, the answer never sent
        ledger.run_tools([uses[call_id]])
    for call_id in case.of_kind(IN_DOUBT):
        with pytest.raises(Crash):
            ledger.run_tools([uses[call_id]])
    dying.clear()
    runs.clear()
    asked = len(model.requests)
    history.append({"role": "assistant", "content": reply.content})

    def resumed() -> Any:
        answer = ledger.run_tools(reply)
        return ledger.create(client.messages, messages=[*history, answer], **PARAMS)

    refused_by, refused_did = None, 0
    if case.reload:
        ledger = opened()
    try:
        final = resumed()
    except ToolInDoubt as refused:
        refused_by = refused.call_id
        refused_did = sum(runs.values()) + len(model.requests) - asked
        for call_id in case.of_kind(IN_DOUBT):
            output = (case.settled_text(call_id) if case.settle is Resolution.COMPLETED
                      else None)
            ledger.resolve_in_doubt(call_id, output, outcome=case.settle, by="ops")
        if case.reload:
            ledger = opened()
        final = resumed()
    requests = model.requests[asked:]
    return ReplySeen(refused_by=refused_by, runs=dict(runs),
                     sent=[pair for messages in requests for pair in _results(messages)],
                     model_calls=len(requests),
                     written=_results(requests[-1]) if requests else [],
                     completed=final.content[0].text == "done", refused_did=refused_did)


def _case_id(case: ReplyCase) -> str:
    return f"{case.label}-{case.settle.value}-{'reloaded' if case.reload else 'live'}"


@pytest.mark.invariant("I11", "I12")
@pytest.mark.parametrize("case", [c for c in every_reply_case(3) if _reachable(c)],
                         ids=_case_id)
def test_every_reachable_mix_of_new_cached_and_in_doubt_calls(root: Path,
                                                              case: ReplyCase) -> None:
    check_reply(case, _play_reply(case, _folder(root)))


@settings(max_examples=200 if FUZZ else 3)
@given(reply_cases(8))
def test_a_drawn_mix_of_new_cached_and_in_doubt_calls(root: Path, case: ReplyCase) -> None:
    assume(_reachable(case))
    check_reply(case, _play_reply(case, _folder(root)))


# ------------------------------------------------- a fault after a recorded result


def _play_fault(case: RecordedFaultCase, folder: Path, via: str) -> FaultSeen:
    """Through a ``create`` loop (the turn retried whole: its tools, then its request) or
    a tool runner (the runner raises; a new one is given the reply it yielded, answered by
    ``run_tools``)."""
    runs: Counter[str] = Counter()
    # the reply's request, then the request carrying the result fails `repeats` times
    model = Model(["c0"], fail=[False, *[True] * case.repeats])
    client = model.client()
    tools = [_work(runs, set())]

    def opened() -> MessageToolLedger:
        return MessageToolLedger.open("fault", tools, store=SQLiteEventStore(
            folder / "events.db"))

    ledger = opened()
    history: list[Any] = [{"role": "user", "content": "go"}]
    errors: list[BaseException] = []
    final = None
    if via == "async-runner":
        ledger.tools = {"work": _awork(runs)}

        async def turns() -> Any:
            replies: list[Any] = []
            nonlocal ledger
            for attempt in range(case.repeats + 1):
                if attempt and case.reload:
                    ledger = opened()
                    ledger.tools = {"work": _awork(runs)}
                messages = (history if not replies else [
                    *history, replies[0].to_param(), await ledger.arun_tools(replies[0])])
                try:
                    async for message in ledger.attach(model.async_client().beta.messages
                                                       .tool_runner(tools=[_awork(runs)],
                                                                    messages=messages,
                                                                    **PARAMS)):
                        replies.append(message)
                    return replies[-1]
                except InternalServerError as error:
                    errors.append(error)
            return None

        final = asyncio.run(turns())
        written = _results(model.requests[-1])
    elif via == "runner":
        replies: list[Any] = []
        for attempt in range(case.repeats + 1):
            if attempt and case.reload:
                ledger = opened()
            messages = (history if not replies else
                        [*history, replies[0].to_param(), ledger.run_tools(replies[0])])
            try:
                for message in ledger.attach(client.beta.messages.tool_runner(
                        tools=tools, messages=messages, **PARAMS)):
                    replies.append(message)
                    final = message
                break
            except InternalServerError as error:
                errors.append(error)
        written = _results(model.requests[-1])
    else:
        reply = ledger.create(client.messages, messages=history, **PARAMS)
        history.append({"role": "assistant", "content": reply.content})
        for attempt in range(case.repeats + 1):
            if attempt and case.reload:
                ledger = opened()
            try:  # the turn retried whole: its tools, then its request
                answer = ledger.run_tools(reply)
                final = ledger.create(client.messages, messages=[*history, answer],
                                      **PARAMS)
                history.append(answer)
                break
            except InternalServerError as error:
                errors.append(error)
        written = _results(history)
    return FaultSeen(errors=errors, injected=InternalServerError, runs=runs["c0"],
                     requests=[_results(messages) for messages in model.requests],
                     answered=model.answered, written=written,
                     completed=final is not None and final.content[0].text == "done")


FAULTS = [(case, via) for case in every_recorded_fault_case()
          if case.fault is RecordedFault.REQUEST_FAILED
          for via in ("create", "runner", "async-runner")]


@pytest.mark.invariant("I6", "I12")
@pytest.mark.parametrize(("case", "via"), FAULTS,
                         ids=lambda x: x if isinstance(x, str) else f"{x.fault}-x{x.repeats}-"
                         f"{'reloaded' if x.reload else 'live'}")
def test_a_request_failing_after_the_result_was_recorded(root: Path, case: RecordedFaultCase,
                                                         via: str) -> None:
    check_recorded_fault(case, _play_fault(case, _folder(root), via))


# ------------------------------------------------------ an older messages list, reused


def _loop(ledger: MessageToolLedger, client: Anthropic, messages: list[Any]) -> Any:
    """A ``messages.create`` loop from ``messages`` (ending with the user's turn, or with
    a reply whose calls are still to be answered) to the final reply; ``messages`` grows
    as the caller's history does."""
    if messages[-1]["role"] == "assistant":  # answer the saved reply's calls first
        messages.append(ledger.run_tools(messages[-1]["content"]))
    reply = ledger.create(client.messages, messages=messages, **PARAMS)
    messages.append({"role": "assistant", "content": reply.content})
    while reply.stop_reason == "tool_use":
        messages.append(ledger.run_tools(reply))
        reply = ledger.create(client.messages, messages=messages, **PARAMS)
        messages.append({"role": "assistant", "content": reply.content})
    return reply


def _play_stale(case: StaleStateCase, folder: Path, via: str) -> StaleSeen:
    """The caller's messages saved when the reply came (at the pause: the reply, its call
    unanswered) or before its request (``before_reply``), reused after the run moved on,
    through a ``create`` loop or a tool runner (``via``) given them. The model names the
    calls of each later reply afresh, as the API does, so a reply asked for again is not
    the first one."""
    runs: Counter[str] = Counter()
    model = Model(["c0"], fail=[False, case.moved == WRITTEN], fresh=True)
    client = model.client()
    tools = [_work(runs, set())]

    def opened() -> MessageToolLedger:
        # one append per event: the recorded result is durable when the attempt stops
        # (buffered, it rides with the next request: a stop before that leaves the call
        # in doubt, the adapter's documented window, refused with ToolInDoubt)
        return MessageToolLedger.open("stale", tools, store=SQLiteEventStore(
            folder / "events.db"), buffered=False)

    ledger = opened()
    history: list[Any] = [{"role": "user", "content": "go"}]
    reply = ledger.create(client.messages, messages=history, **PARAMS)
    history.append({"role": "assistant", "content": reply.content})
    saved = list(history[:1] if case.before_reply else history)
    if case.moved != DECIDED:  # the messages ledger takes no decision: the pause itself
        answer = ledger.run_tools(reply)
        if case.moved in (WRITTEN, COMPLETED):  # WRITTEN: this request fails
            with contextlib.suppress(InternalServerError):
                ledger.create(client.messages, messages=[*history, answer], **PARAMS)
    if case.reload:
        ledger = opened()
    asked = len(model.requests)
    error: BaseException | None = None
    final = None
    messages = list(saved)
    try:
        if via == "runner":
            final = ledger.attach(client.beta.messages.tool_runner(
                tools=tools, messages=messages, **PARAMS)).until_done()
        else:
            final = _loop(ledger, client, messages)
    except ControlError as refused:
        error = refused
    # what the model holds: the results of the last request it answered (this adapter
    # hands back replies, never a history: the caller's messages are its own)
    answered = [request for n, request in enumerate(model.requests) if model.answered[n]]
    return StaleSeen(runs=sum(runs.values()), error=error,
                     completed=final is not None and final.content[0].text == "done",
                     replayed=ledger.replayed, model_calls=len(model.requests) - asked,
                     sent=_results(model.requests[-1]),
                     written=_results(answered[-1]))


STALE = [(case, via) for case in every_stale_state_case(before_reply=True)
         for via in ("create", "runner")
         # a tool runner starts from the messages it is given: never a reply's unanswered
         # call; and the ledger records no decision, so a state saved before the reply
         # of a run only decided is one the ledger knows nothing of (a fresh start)
         if not (via == "runner" and not case.before_reply)
         and not (case.before_reply and case.moved == DECIDED)]


def _stale_id(played: tuple[StaleStateCase, str]) -> str:
    case, via = played
    return (f"{via}-{'before-reply' if case.before_reply else 'at-reply'}-{case.moved}-"
            f"{'reloaded' if case.reload else 'live'}")


@pytest.mark.invariant("I1", "I12")
@pytest.mark.parametrize("played", STALE, ids=_stale_id)
def test_an_older_messages_list_reused_after_the_run_moved_on(
        root: Path, played: tuple[StaleStateCase, str]) -> None:
    case, via = played
    check_stale_state(case, _play_stale(case, _folder(root), via))


# ------------------------------------------------------------------ one writer


def _play_one_writer(case: OneWriterCase, folder: Path) -> OneWriterSeen:
    """The first attempt's ledger, then a rival (another process: its own connection to
    the SQLite file) claiming the run: opening its own ledger before the first attempt
    asks anything (the messages ledger claims when it is opened), or claiming during the
    first attempt's model request or its tool body. Each runs the loop from the user's
    message with a model of its own."""
    path = folder / "events.db"
    RunController.start(run_id="one", session_id=None, store=SQLiteEventStore(path))
    claimed = False

    def rival() -> None:  # another process claims the run, on its own connection
        nonlocal claimed
        RunController.load(SQLiteEventStore(path), "one").claim("rival")
        claimed = True

    first_runs: Counter[str] = Counter()
    first_model = Model(["c0"])
    if case.rival_at == MODEL_CALL:
        first_model.during = lambda n: rival() if n == 1 else None
    first_tools = [_work(first_runs, set(), during=rival if case.rival_at == TOOL_BODY
                         else None)]
    rival_runs: Counter[str] = Counter()
    rival_model = Model(["c0"])

    def opened(tools: list[Any], owner: str) -> MessageToolLedger:
        return MessageToolLedger.open("one", tools, store=SQLiteEventStore(path),
                                      buffered=case.buffered, owner=owner)

    def ended(ledger: MessageToolLedger, model: Model) -> str:
        try:
            _loop(ledger, model.client(), [{"role": "user", "content": "go"}])
        except ControlError as error:
            return type(error).__name__
        return "completed"

    attempt = opened(first_tools, "first")
    if case.rival_at == LOADED:  # the rival opens after it, and goes first
        rival_outcome = ended(opened([_work(rival_runs, set())], "rival"), rival_model)
        claimed = True
        since = len(first_model.requests)
        first_outcome = ended(attempt, first_model)
    else:
        since = -1
        first_outcome = ended(attempt, first_model)
        rival_outcome = ended(opened([_work(rival_runs, set())], "rival"), rival_model)
    assert claimed, "the rival never claimed the run"
    after = first_model.requests[since:] if since >= 0 else first_model.requests[1:]
    answered = [request for n, request in enumerate(rival_model.requests)
                if rival_model.answered[n]]
    return OneWriterSeen(first_outcome=first_outcome, first_runs=sum(first_runs.values()),
                         first_model_calls=len(first_model.requests),
                         first_writes_after=sum(bool(_results(r)) for r in after),
                         rival_outcome=rival_outcome, rival_runs=sum(rival_runs.values()),
                         written=_results(answered[-1]) if answered else [])


@pytest.mark.invariant("I1", "I7")
@pytest.mark.parametrize("case", every_one_writer_case(),
                         ids=lambda c: f"{c.rival_at}-{'buffered' if c.buffered else 'per-event'}")
def test_one_writer_through_the_messages_ledger(root: Path, case: OneWriterCase) -> None:
    check_one_writer(case, _play_one_writer(case, _folder(root)))


# ------------------------------------------------------------------ final outputs


class StructuredModel(pydantic.BaseModel):
    """`Structured`'s fields as a pydantic model."""

    when: datetime.datetime
    amount: decimal.Decimal
    raw: bytes
    tags: frozenset[str]
    pair: tuple[int, int]
    names: dict[int, str]
    ratio: float


FORMATS: dict[OutputShape, Any] = {TEXT: None, DATACLASS: Structured, MODEL: StructuredModel}
"""The tool runner's ``output_format`` per shape (the SDK parses the reply's text with
pydantic, NaN included)."""


class Answering:
    """``POST /v1/messages``: the final answer at once, the shape's text."""

    def __init__(self, shape: OutputShape) -> None:
        self.text = PLAIN_TEXT if shape == TEXT else STRUCTURED_TEXT
        self.requests = 0

    def handle(self, request: httpx2.Request) -> httpx2.Response:
        self.requests += 1
        return httpx2.Response(200, json={
            "id": "msg_out", "type": "message", "role": "assistant", "model": "claude-test",
            "content": [{"type": "text", "text": self.text}], "stop_reason": "end_turn",
            "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1}})


def _answer(ledger: MessageToolLedger, model: Answering, shape: OutputShape,
            via: str) -> Any:
    """The conversation's final output: through ``create``, its text (the caller parses
    it); through a tool runner with ``output_format``, what the SDK parsed."""
    client = Anthropic(api_key="test-key", max_retries=0, http_client=httpx2.Client(
        transport=httpx2.MockTransport(model.handle)))
    first: list[Any] = [{"role": "user", "content": "go"}]
    if via == "create":
        return ledger.create(client.messages, messages=first, **PARAMS).content[0].text
    options = {} if FORMATS[shape] is None else {"output_format": FORMATS[shape]}
    final = ledger.attach(client.beta.messages.tool_runner(
        tools=[], messages=first, **options, **PARAMS)).until_done()
    return final.content[0].text if FORMATS[shape] is None else final.parsed_output


class _Recording(SQLiteEventStore):
    """The run's store, keeping each append's arguments, so a crash after any append can
    be rebuilt."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.appends: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def append(self, *args: Any, **kwargs: Any) -> None:
        self.appends.append((args, kwargs))
        super().append(*args, **kwargs)


def _play_outputs(shape: OutputShape, via: str, folder: Path
                  ) -> tuple[list[tuple[OutputCase, OutputSeen]], Any]:
    """The uninterrupted conversation (one append per event, a snapshot with each), then a
    new process for a crash after each of its appends, asking the same request again.
    This adapter writes no Session: a run's end is recorded, never staged."""
    store = _Recording(folder / "events.db")
    uninterrupted = _answer(MessageToolLedger.open("out", [], store=store, buffered=False),
                            Answering(shape), shape, via)
    played = []
    for k in range(1, len(store.appends) + 1):
        prefix = store.appends[:k]
        events = [e for args, _ in prefix for e in args[1]]
        case = OutputCase(shape, boundary_of(events), reparsed=True)
        crashed = folder / f"crash-{k}"
        crashed.mkdir()
        durable = SQLiteEventStore(crashed / "events.db")
        for args, kwargs in prefix:  # what was durable when the process died
            durable.append(*args, **kwargs)
        ledger = MessageToolLedger.open("out", [], store=SQLiteEventStore(
            crashed / "events.db"))
        output: Any = None
        model = Answering(shape)
        try:
            output = _answer(ledger, model, shape, via)
        except ControlError as error:
            outcome = type(error).__name__
        else:
            log = RunController.load(SQLiteEventStore(crashed / "events.db"), "out").events
            completed_here = any(isinstance(e, ev.RunCompleted) for e in log[len(events):])
            outcome = "completed" if completed_here else (
                "replayed" if ledger.replayed else "unfinished")
        log = RunController.load(SQLiteEventStore(crashed / "events.db"), "out").events
        accepted = [e for e in log if isinstance(e, ev.FinalOutputAccepted)]
        played.append((case, OutputSeen(
            outcome=outcome, output=output,
            recorded=accepted[-1].output if accepted else None,
            lossless=accepted[-1].lossless if accepted else None,
            model_calls=model.requests,
            written=len(accepted))))
    return played, uninterrupted


OUTPUTS = [(TEXT, "create"), *((shape, "runner") for shape in OutputShape)]


@pytest.mark.invariant("I10")
@pytest.mark.parametrize(("shape", "via"), OUTPUTS, ids=str)
def test_a_final_output_crashed_at_every_event_boundary(
        root: Path, shape: OutputShape, via: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(controller_module, "SNAPSHOT_EVERY", 1)  # a snapshot every event
    played, uninterrupted = _play_outputs(shape, via, _folder(root))
    assert isinstance(uninterrupted, FORMATS[shape] or str)
    # no Session: the end is recorded and the run completed, never staged nor written
    assert {case.boundary for case, _ in played} == {
        Boundary.BEFORE_ANSWER, Boundary.ANSWERED, Boundary.ACCEPTED, Boundary.COMPLETED}
    for case, seen in played:
        check_output(case, seen, uninterrupted, output_type=FORMATS[shape])
