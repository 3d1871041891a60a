"""The adapter corners of `statemachine.testing.adapter_corners` (issue 32) played through
the pydantic-ai adapter, offline (pydantic-ai's own `FunctionModel`), each case checked
against what the case alone says:

* every mix and order of new, cached and in-doubt calls in one reply (all up to three
  calls; drawn ones up to eight in ``just fuzz``). pydantic-ai starts every call of a
  response before any of them can finish (they run as tasks, begun in order), so no one
  attempt leaves a new call before a cached one; the reply is recorded and written
  through the adapter by an attempt cancelled before any call began (each held in a
  ``before_tool_validate`` hook), and the calls' phases by the commands the adapter
  records for a call (``begin_tool``, ``tool_completed``), as an attempt that died would
  have left them; then the run is resumed through the adapter, from the store or by the
  same object;
* a history write or a model request failing after the result was recorded, once or twice;
* the message history of a run without a history, saved at its pause, reused after the
  run moved on;
* a rival claiming the run (another connection to the SQLite file) before the attempt,
  during its model call, during its tool body;
* a final output, text or structured (a dataclass, a pydantic model) with fields JSON
  lacks, the run crashed at every event boundary (a store snapshotting every event) and
  resumed.

Under CI a missing ``pydantic_ai`` package fails this module instead of skipping it.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import decimal
import os
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pydantic
import pytest
from hypothesis import given, settings

try:
    import pydantic_ai  # noqa: F401
except ImportError:  # pragma: no cover - CI installs the extra
    from tests.helpers import missing_extra

    missing_extra("pydantic-ai")

from pydantic_ai import Agent, DeferredToolRequests
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.messages import (
    FunctionToolResultEvent,
    ModelMessage,
    ModelMessagesTypeAdapter,
    ModelResponse,
    TextPart,
    ToolCallPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

from statemachine import ControlError, RunController, SQLiteEventStore, ToolInDoubt, tool_context
from statemachine import controller as controller_module
from statemachine import events as ev
from statemachine.adapters.pydantic_ai import LedgerRun
from statemachine.sessions import SQLiteSession
from statemachine.testing import (
    PLAIN_TEXT,
    STRUCTURED_TEXT,
    Boundary,
    CaseFailed,
    FaultSeen,
    FlakySession,
    InjectedWriteError,
    ListSession,
    OneWriterCase,
    OneWriterSeen,
    Outcome,
    OutputCase,
    OutputSeen,
    OutputShape,
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
    DATACLASS,
    DECIDED,
    IN_DOUBT,
    LOADED,
    MODEL,
    MODEL_CALL,
    NEW,
    RECORDED,
    REQUEST_FAILED,
    TEXT,
    TOOL_BODY,
    WRITE_LANDED,
    WRITE_REFUSED,
    WRITTEN,
)
from statemachine.values import Resolution
from tests.helpers import crash_folder

HISTORY_ID = "corners"
NEVER = 10**9
FUZZ = os.environ.get("HYPOTHESIS_PROFILE") == "fuzz"


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with crash_folder(tmp_path_factory, "pa-corners") as folder:  # fsyncs are cheap there
        yield folder


def _folder(root: Path) -> Path:
    """A fresh folder for one case's SQLite files."""
    return Path(tempfile.mkdtemp(dir=root))


def _returns(messages: list[Any]) -> list[tuple[str, Any]]:
    """The (call id, content) pairs of the tool returns in ``messages`` (pydantic-ai's
    messages, or their JSON form as a history keeps them)."""
    if messages and not isinstance(messages[0], dict):
        messages = ModelMessagesTypeAdapter.dump_python(messages, mode="json")
    return [(part["tool_call_id"], part["content"]) for message in messages
            for part in message["parts"] if part["part_kind"] == "tool-return"]


class RequestFailed(ConnectionError):
    """The model request a fault fails."""


class Model:
    """A `FunctionModel` answering its n-th request with ``steps[n]`` (a list of parts, or
    an exception to raise), each request's messages kept and whether it was answered."""

    def __init__(self, steps: list[Any]) -> None:
        self.steps = list(steps)
        self.requests: list[list[ModelMessage]] = []
        self.answered: list[bool] = []
        self.during: Callable[[int], None] | None = None

    def respond(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        self.requests.append(list(messages))
        self.answered.append(False)
        if self.during is not None:
            self.during(len(self.requests))
        step = self.steps.pop(0)
        if isinstance(step, BaseException):
            raise step
        self.answered[-1] = True
        return ModelResponse(parts=list(step))

    @property
    def model(self) -> FunctionModel:
        return FunctionModel(self.respond)

    def sent(self, since: int = 0) -> list[tuple[str, Any]]:
        return [pair for messages in self.requests[since:] for pair in _returns(messages)]


def _calls(ids: list[str]) -> list[ToolCallPart]:
    return [ToolCallPart("work", {"n": n}, tool_call_id=call_id) for n, call_id in enumerate(ids)]


DONE = [TextPart("done")]


def _agent(model: Model, runs: Counter[str], *, approval: bool = False,
           during: Callable[[], None] | None = None, output_type: Any = str) -> Agent[None, Any]:
    agent: Agent[None, Any] = Agent(model.model, output_type=output_type)

    @agent.tool_plain(requires_approval=approval)
    def work(n: int) -> str:
        call_id = tool_context().call_id
        runs[call_id] += 1
        if during is not None:
            during()
        return ReplyCase.result_text(call_id)

    return agent


# ------------------------------------------------------------ one reply, mixed


class _HoldAtValidation(AbstractCapability[Any]):
    """Holds every call of the response before pydantic-ai validates it (so before any
    starts), counting the calls held."""

    def __init__(self) -> None:
        self.held = 0

    async def before_tool_validate(self, ctx: Any, *, call: Any, tool_def: Any,
                                   args: Any) -> Any:
        self.held += 1
        await asyncio.Event().wait()
        return args  # pragma: no cover - held until cancelled


async def _play_reply(case: ReplyCase, folder: Path) -> ReplySeen:
    runs: Counter[str] = Counter()
    model = Model([_calls(case.ids), DONE])
    agent = _agent(model, runs)
    history = SQLiteSession(HISTORY_ID, folder / "history.db")

    async def opened() -> LedgerRun:  # as a new process opens it: from the store
        return await LedgerRun.open(agent, run_id="reply", history=history,
                                    store=SQLiteEventStore(folder / "events.db"))

    run = await opened()
    holding = _HoldAtValidation()
    crashing = asyncio.ensure_future(run.run("go", capabilities=[holding]))
    while holding.held < 1 and not crashing.done():
        await asyncio.sleep(0.001)
    if crashing.done():
        raise CaseFailed(f"the first attempt ended before its calls: {crashing.result()!r}")
    crashing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await crashing
    # the attempt that ran the calls and died, as the adapter records a call: its start,
    # durable before the body; the body's result (cached); nothing more (in doubt)
    if case.reload:
        c = RunController.load(SQLiteEventStore(folder / "events.db"), "reply")
        c.claim("died")
    else:
        c = run.controller
    for call_id in case.ids:
        if case.kind(call_id) == NEW:
            continue
        c.begin_tool(call_id)
        c.flush()
        if case.kind(call_id) == CACHED:
            c.tool_completed(call_id, ReplyCase.result_text(call_id))
        else:
            c.tool_interrupted(call_id)  # the body never reported (what a reload sees too)
    c.flush()
    asked = len(model.requests)

    refused_by, refused_did = None, 0
    if case.reload:
        run = await opened()
    try:
        result = await run.run()
    except ToolInDoubt as refused:
        refused_by = refused.call_id
        refused_did = sum(runs.values()) + len(model.requests) - asked
        for call_id in case.of_kind(IN_DOUBT):
            output = (case.settled_text(call_id) if case.settle is Resolution.COMPLETED
                      else None)
            await run.resolve_in_doubt(call_id, output, outcome=case.settle, by="ops")
        if case.reload:
            run = await opened()
        result = await run.run()
    return ReplySeen(refused_by=refused_by, runs=dict(runs), sent=model.sent(asked),
                     model_calls=len(model.requests) - asked,
                     written=_returns(await history.get_items()),
                     completed=result.output == "done", refused_did=refused_did)


def _case_id(case: ReplyCase) -> str:
    return f"{case.label}-{case.settle.value}-{'reloaded' if case.reload else 'live'}"


@pytest.mark.invariant("I11", "I12")
@pytest.mark.parametrize("case", every_reply_case(3), ids=_case_id)
def test_every_mix_of_new_cached_and_in_doubt_calls(root: Path, case: ReplyCase) -> None:
    check_reply(case, asyncio.run(_play_reply(case, _folder(root))))


@settings(max_examples=200 if FUZZ else 3)
@given(reply_cases(8))
def test_a_drawn_mix_of_new_cached_and_in_doubt_calls(root: Path, case: ReplyCase) -> None:
    check_reply(case, asyncio.run(_play_reply(case, _folder(root))))


# ------------------------------------------------- a fault after a recorded result


async def _play_fault(case: RecordedFaultCase, folder: Path) -> FaultSeen:
    runs: Counter[str] = Counter()
    failing = [RequestFailed("injected request failure")] * (
        case.repeats if case.fault == REQUEST_FAILED else 0)
    model = Model([_calls(["c0"]), *failing, DONE])
    agent = _agent(model, runs)
    inner = SQLiteSession(HISTORY_ID, folder / "history.db")
    outcome: Outcome = "commit_then_raise" if case.fault == WRITE_LANDED else "atomic"
    # the writes: the prompt, the reply, then the request carrying the result
    history = FlakySession(inner, fail_on=3 if case.fault != REQUEST_FAILED else NEVER,
                           outcome=outcome)

    async def opened() -> LedgerRun:
        return await LedgerRun.open(agent, run_id="fault", history=history,
                                    store=SQLiteEventStore(folder / "events.db"))

    run = await opened()
    errors: list[BaseException] = []
    result = None
    for attempt in range(case.repeats + 1):
        if attempt and case.reload:
            run = await opened()
        try:
            result = await run.run("go" if attempt == 0 else None)
            break
        except (InjectedWriteError, RequestFailed) as error:
            errors.append(error)
            if case.fault == WRITE_REFUSED and len(errors) < case.repeats:
                history.fail_on = history.add_calls + 1  # the next write of the batch too
    injected = RequestFailed if case.fault == REQUEST_FAILED else InjectedWriteError
    return FaultSeen(errors=errors, injected=injected, runs=runs["c0"],
                     requests=[_returns(messages) for messages in model.requests],
                     answered=model.answered, written=_returns(await inner.get_items()),
                     completed=result is not None and result.output == "done")


@pytest.mark.invariant("I6", "I12")
@pytest.mark.parametrize("case", every_recorded_fault_case(),
                         ids=lambda c: f"{c.fault}-x{c.repeats}-"
                         f"{'reloaded' if c.reload else 'live'}")
def test_a_fault_after_the_result_was_recorded(root: Path, case: RecordedFaultCase) -> None:
    check_recorded_fault(case, asyncio.run(_play_fault(case, _folder(root))))


# ------------------------------------------- an older message history, reused


class Stop(Exception):
    """Ends an attempt right after a call's result was recorded, before it is written."""


async def _stop_after_the_result(ctx: Any, events: Any) -> None:
    async for event in events:
        if isinstance(event, FunctionToolResultEvent):
            raise Stop


async def _play_stale(case: StaleStateCase, folder: Path) -> StaleSeen:
    """A run without a history (the caller carries its messages, ``message_history``):
    the messages of its pause, reused after it moved on."""
    runs: Counter[str] = Counter()
    steps: list[Any] = [_calls(["c0"])]
    if case.moved == WRITTEN:
        steps.append(RequestFailed("injected request failure"))
    steps.append(DONE)
    model = Model(steps)
    agent = _agent(model, runs, approval=True, output_type=[str, DeferredToolRequests])

    async def opened() -> LedgerRun:
        return await LedgerRun.open(agent, run_id="stale",
                                    store=SQLiteEventStore(folder / "events.db"))

    run = await opened()
    paused = await run.run("go")
    saved = list(paused.messages)  # what the caller keeps to resume the run
    await run.approve("c0")
    if case.moved != DECIDED:
        handler = _stop_after_the_result if case.moved == RECORDED else None
        with contextlib.suppress(Stop, RequestFailed):
            await run.run(message_history=saved, event_stream_handler=handler)
    if case.reload:
        run = await opened()
    asked = len(model.requests)
    error: BaseException | None = None
    result = None
    try:
        result = await run.run(message_history=saved)
    except ControlError as refused:
        error = refused
    # the run has no history of its own: what it wrote is what its publications hold
    log = RunController.load(SQLiteEventStore(folder / "events.db"), "stale").events
    written = _returns([item for e in log if isinstance(e, ev.PublicationStaged)
                        for item in e.items])
    return StaleSeen(runs=runs["c0"], error=error,
                     completed=result is not None and result.output == "done",
                     replayed=result is not None and result.recorded,
                     model_calls=len(model.requests) - asked,
                     sent=_returns(model.requests[-1]), written=written,
                     carried=None if result is None else _returns(list(result.messages)))


@pytest.mark.invariant("I1", "I12")
@pytest.mark.parametrize("case", every_stale_state_case(),
                         ids=lambda c: f"{c.moved}-{'reloaded' if c.reload else 'live'}")
def test_an_older_message_history_reused_after_the_run_moved_on(
        root: Path, case: StaleStateCase) -> None:
    check_stale_state(case, asyncio.run(_play_stale(case, _folder(root))))


# ------------------------------------------------------------------ one writer


class _CountingHistory(SQLiteSession):
    """The run's history, counting the writes made after ``since`` was set."""

    since: bool = False
    writes_after = 0

    async def add_items(self, items: list[Any]) -> None:
        if self.since:
            self.writes_after += 1
        await super().add_items(items)


async def _play_one_writer(case: OneWriterCase, folder: Path) -> OneWriterSeen:
    path = folder / "events.db"
    history = _CountingHistory(HISTORY_ID, folder / "history.db")
    RunController.start(run_id="one", session_id=HISTORY_ID, store=SQLiteEventStore(path))

    def rival() -> None:  # another process claims the run, on its own connection
        RunController.load(SQLiteEventStore(path), "one").claim("rival")
        history.since = True

    first_runs: Counter[str] = Counter()
    first_model = Model([_calls(["c0"]), DONE])
    if case.rival_at == MODEL_CALL:
        first_model.during = lambda n: rival() if n == 1 else None
    first = _agent(first_model, first_runs,
                   during=rival if case.rival_at == TOOL_BODY else None)
    rival_runs: Counter[str] = Counter()
    second = _agent(Model([_calls(["c0"]), DONE]), rival_runs)

    async def opened(agent: Agent[None, Any], *, take_over: bool = False) -> LedgerRun:
        return await LedgerRun.open(agent, run_id="one", history=history,
                                    store=SQLiteEventStore(path), buffered=case.buffered,
                                    take_over=take_over)

    async def ended(run: LedgerRun, prompt: str | None) -> str:
        try:
            await run.run(prompt)
        except ControlError as error:
            return type(error).__name__
        return "completed"

    attempt = await opened(first)
    if case.rival_at == LOADED:  # both loaded the same version; the rival goes first
        rival_outcome = await ended(await opened(second), "go")
        history.since = True
        first_outcome = await ended(attempt, "go")
        first_writes_after = history.writes_after
    else:
        first_outcome = await ended(attempt, "go")
        first_writes_after = history.writes_after
        # the rival resumes the run the first attempt left (its prompt recorded); that
        # attempt has ended, so a write it staged can no longer land: take_over
        rival_outcome = await ended(await opened(second, take_over=True), None)
    return OneWriterSeen(first_outcome=first_outcome, first_runs=first_runs["c0"],
                         first_model_calls=len(first_model.requests),
                         first_writes_after=first_writes_after,
                         rival_outcome=rival_outcome, rival_runs=rival_runs["c0"],
                         written=_returns(await history.get_items()))


@pytest.mark.invariant("I1", "I7")
@pytest.mark.parametrize("case", every_one_writer_case(),
                         ids=lambda c: f"{c.rival_at}-{'buffered' if c.buffered else 'per-event'}")
def test_one_writer_through_the_adapter(root: Path, case: OneWriterCase) -> None:
    check_one_writer(case, asyncio.run(_play_one_writer(case, _folder(root))))


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


OUTPUT_TYPES: dict[OutputShape, Any] = {TEXT: str, DATACLASS: Structured, MODEL: StructuredModel}


def _answer(shape: OutputShape) -> list[Any]:
    """The model's final answer: its text, or its call of pydantic-ai's output tool."""
    if shape == TEXT:
        return [TextPart(PLAIN_TEXT)]
    return [ToolCallPart("final_result", STRUCTURED_TEXT, tool_call_id="out")]


class _Recording(SQLiteEventStore):
    """The run's store, keeping each append (its arguments) with the history's items at
    that moment, so a crash after any append can be rebuilt."""

    def __init__(self, path: Path, history: ListSession) -> None:
        super().__init__(path)
        self.history = history
        self.appends: list[tuple[tuple[Any, ...], dict[str, Any], list[Any]]] = []

    def append(self, *args: Any, **kwargs: Any) -> None:
        self.appends.append((args, kwargs, list(self.history.items)))
        super().append(*args, **kwargs)


def _answers_written(items: list[Any]) -> int:
    """How many responses in the history carry the final answer."""
    return sum(1 for message in items if message["kind"] == "response" and any(
        part["part_kind"] == "text" or part.get("tool_name") == "final_result"
        for part in message["parts"]))


Played = list[tuple[OutputCase, OutputSeen]]


async def _play_outputs(shape: OutputShape, folder: Path) -> tuple[Played, Any]:
    """The uninterrupted run (its store appending per event, a snapshot with each), then a
    new process for a crash after each of its appends: the store holding those appends,
    the history as it was then, and, where a write followed the append, as it was with
    that write landed."""
    history = ListSession(HISTORY_ID)
    store = _Recording(folder / "events.db", history)
    model = Model([_answer(shape)])
    agent: Agent[None, Any] = Agent(model.model, output_type=OUTPUT_TYPES[shape])
    run = await LedgerRun.open(agent, run_id="out", history=history, store=store,
                               buffered=False)
    uninterrupted = (await run.run("go")).output
    appends = store.appends
    played = []
    for k in range(1, len(appends) + 1):
        events = [e for args, _, _ in appends[:k] for e in args[1]]
        unwritten = appends[k - 1][2]
        landed = appends[k][2] if k < len(appends) else list(history.items)
        for written, items in ((False, unwritten), (True, landed)):
            if written and landed == unwritten:
                continue
            case = OutputCase(shape, boundary_of(events, written=written))
            crashed = folder / f"crash-{k}-{written}"
            crashed.mkdir()
            # the prompt goes again only if the crashed attempt had not recorded it (the
            # adapter records it by staging the request that carries it)
            recorded = any(isinstance(e, ev.PublicationStaged) for e in events)
            played.append((case, await _restart(case, appends[:k], items, crashed,
                                                recorded)))
    return played, uninterrupted


async def _restart(case: OutputCase, appends: list[Any], items: list[Any], folder: Path,
                   prompt_recorded: bool) -> OutputSeen:
    store = SQLiteEventStore(folder / "events.db")
    for args, kwargs, _ in appends:  # what was durable when the process died
        store.append(*args, **kwargs)
    history = ListSession(HISTORY_ID, items)
    model = Model([_answer(case.shape)])
    agent: Agent[None, Any] = Agent(model.model, output_type=OUTPUT_TYPES[case.shape])
    run = await LedgerRun.open(agent, run_id="out", history=history,
                               store=SQLiteEventStore(folder / "events.db"),
                               take_over=True)  # the crashed process is gone
    output: Any = None
    try:
        result = await run.run(None if prompt_recorded else "go")
        outcome, output = "replayed" if result.recorded else "completed", result.output
    except ControlError as error:
        outcome = type(error).__name__
    accepted = [e for e in run.controller.events if isinstance(e, ev.FinalOutputAccepted)]
    return OutputSeen(outcome=outcome, output=output,
                      recorded=accepted[-1].output if accepted else None,
                      lossless=accepted[-1].lossless if accepted else None,
                      model_calls=len(model.requests), written=_answers_written(history.items))


@pytest.mark.invariant("I10")
@pytest.mark.parametrize("shape", OutputShape)
def test_a_final_output_crashed_at_every_event_boundary(
        root: Path, shape: OutputShape, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(controller_module, "SNAPSHOT_EVERY", 1)  # a snapshot every event
    played, uninterrupted = asyncio.run(_play_outputs(shape, _folder(root)))
    assert isinstance(uninterrupted, OUTPUT_TYPES[shape])
    assert {case.boundary for case, _ in played} == set(Boundary)  # every kind met
    for case, seen in played:
        check_output(case, seen, uninterrupted,
                     output_type=None if shape == TEXT else OUTPUT_TYPES[shape])
