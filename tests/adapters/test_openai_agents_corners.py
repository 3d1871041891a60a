"""The adapter corners of `statemachine.testing.adapter_corners` (issue 32) played through
the openai-agents adapter, offline (the SDK's own `ScriptedModel`), each case checked
against what the case alone says:

* every mix and order of new, cached and in-doubt calls in one reply (all up to three
  calls; drawn ones up to eight in ``just fuzz``): the attempt is cancelled once every
  call stands where its kind says (a new call held in its ``on_tool_start`` hook, before
  its start; a call in doubt inside its body; a cached one in its ``on_tool_end`` hook,
  after its result was recorded), then resumed from the store or by the same object;
* a write or a model request failing after the result was recorded, once or twice;
* an SDK `RunState` saved at the pause, reused after the run moved on;
* a rival claiming the run (another connection to the SQLite file) before the attempt,
  during its model call, during its tool body;
* a final output, text or structured (a dataclass, a pydantic model) with fields JSON
  lacks, the run crashed at every event boundary (a store snapshotting every event) and
  resumed.

Under CI a missing ``agents`` package fails this module instead of skipping it.
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
from typing import Any, cast

import pydantic
import pytest
from hypothesis import given, settings

try:
    import agents  # noqa: F401
except ImportError:  # pragma: no cover - CI installs the extra
    from tests.helpers import missing_extra

    missing_extra("openai-agents")

from agents import (
    Agent,
    AgentOutputSchema,
    RunConfig,
    RunHooks,
    SQLiteSession,
    function_tool,
    set_tracing_disabled,
)
from agents.testing import ScriptedModel, assistant_message, function_call

from statemachine import ControlError, RunController, SQLiteEventStore, ToolInDoubt, tool_context
from statemachine import controller as controller_module
from statemachine import events as ev
from statemachine.adapters.openai_agents import AgentRun
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

set_tracing_disabled(True)
CONFIG = RunConfig(tracing_disabled=True)
SESSION_ID = "corners"
NEVER = 10**9
FUZZ = os.environ.get("HYPOTHESIS_PROFILE") == "fuzz"


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with crash_folder(tmp_path_factory, "oa-corners") as folder:  # fsyncs are cheap there
        yield folder


def _folder(root: Path) -> Path:
    """A fresh folder for one case's SQLite files."""
    return Path(tempfile.mkdtemp(dir=root))


def _outputs(items: list[Any]) -> list[tuple[str, Any]]:
    """The (call id, output) pairs of the ``function_call_output`` items in ``items``."""
    return [(item["call_id"], item["output"]) for item in items
            if isinstance(item, dict) and item.get("type") == "function_call_output"]


# ------------------------------------------------------------ one reply, mixed


class _Held:
    """Where each call of the crashing attempt stands: ``held`` fills as each reaches
    the place its kind says, then the attempt is cancelled."""

    def __init__(self, case: ReplyCase) -> None:
        self.case = case
        self.crashing = True
        self.held: set[str] = set()
        self.runs: Counter[str] = Counter()

    async def hold(self, call_id: str, kind: str) -> None:
        if self.crashing and self.case.kind(call_id) == kind:
            self.held.add(call_id)
            await asyncio.Event().wait()


class _HoldingHooks(RunHooks[Any]):
    def __init__(self, held: _Held) -> None:
        self.held = held

    async def on_tool_start(self, context: Any, agent: Any, tool: Any) -> None:
        await self.held.hold(context.tool_call_id, NEW)  # before its start is recorded

    async def on_tool_end(self, context: Any, agent: Any, tool: Any, result: Any) -> None:
        await self.held.hold(context.tool_call_id, CACHED)  # its result recorded


def _reply_agent(held: _Held, model: ScriptedModel) -> Agent[Any]:
    @function_tool
    async def work(n: int) -> str:
        call_id = tool_context().call_id
        held.runs[call_id] += 1
        await held.hold(call_id, IN_DOUBT)  # started, never to report
        return ReplyCase.result_text(call_id)

    return Agent("worker", model=model, tools=[work])


async def _play_reply(case: ReplyCase, folder: Path) -> ReplySeen:
    held = _Held(case)
    session = SQLiteSession(SESSION_ID, folder / "session.db")
    reply = [function_call("work", {"n": n}, call_id=call_id)
             for n, call_id in enumerate(case.ids)]
    model = ScriptedModel([reply, [assistant_message("done")]])
    agent = _reply_agent(held, model)

    async def opened() -> AgentRun:  # as a new process opens it: from the store
        return await AgentRun.open(agent, run_id="reply", session=session,
                                   store=SQLiteEventStore(folder / "events.db"))

    run = await opened()
    crashing = asyncio.ensure_future(run.run("go", hooks=_HoldingHooks(held),
                                             run_config=CONFIG))
    while len(held.held) < len(case.kinds) and not crashing.done():
        await asyncio.sleep(0.001)
    if crashing.done():  # it ended before every call stood where the case puts it
        raise CaseFailed(f"the crashing attempt ended early: {crashing.result()!r}")
    crashing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await crashing
    held.crashing = False
    held.runs.clear()
    asked = len(model.calls)

    refused_by, refused_did = None, 0
    if case.reload:
        run = await opened()
    try:
        result = await run.run(run_config=CONFIG)
    except ToolInDoubt as refused:
        refused_by = refused.call_id
        refused_did = sum(held.runs.values()) + len(model.calls) - asked
        for call_id in case.of_kind(IN_DOUBT):
            output = (case.settled_text(call_id) if case.settle is Resolution.COMPLETED
                      else None)
            await run.resolve_in_doubt(call_id, output, outcome=case.settle, by="ops")
        if case.reload:
            run = await opened()
        result = await run.run(run_config=CONFIG)
    calls = model.calls[asked:]
    return ReplySeen(refused_by=refused_by, runs=dict(held.runs),
                     sent=[pair for call in calls for pair in _outputs(list(call.input))],
                     model_calls=len(calls),
                     written=_outputs(list(await session.get_items())),
                     completed=result.final_output == "done", refused_did=refused_did)


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


class RequestFailed(ConnectionError):
    """The model request the fault fails."""


class _Model(ScriptedModel):
    """The scripted model, each request's input and whether it was answered kept."""

    def __init__(self, steps: list[Any]) -> None:
        super().__init__(steps)
        self.requests: list[list[tuple[str, Any]]] = []
        self.answered: list[bool] = []

    async def get_response(self, *args: Any, **kwargs: Any) -> Any:
        self.requests.append(_outputs(list(kwargs["input"] if "input" in kwargs
                                           else args[1])))
        self.answered.append(False)
        response = await super().get_response(*args, **kwargs)
        self.answered[-1] = True
        return response


def _paying(runs: Counter[str], *, approval: bool = False, during: Callable[[], None] | None
            = None) -> Any:
    def pay(n: int) -> str:
        runs[tool_context().call_id] += 1
        if during is not None:
            during()
        return ReplyCase.result_text(tool_context().call_id)

    return function_tool(pay, needs_approval=approval)


async def _play_fault(case: RecordedFaultCase, folder: Path) -> FaultSeen:
    runs: Counter[str] = Counter()
    failing = [RequestFailed("injected request failure")] * (
        case.repeats if case.fault == REQUEST_FAILED else 0)
    model = _Model([[function_call("pay", {"n": 7}, call_id="c0")], *failing,
                    [assistant_message("done")]])
    agent = Agent("payer", model=model, tools=[_paying(runs)])
    inner = SQLiteSession(SESSION_ID, folder / "session.db")
    outcome: Outcome = "commit_then_raise" if case.fault == WRITE_LANDED else "atomic"
    # the run's first write is its input; the second carries the result
    session: Any = FlakySession(inner, fail_on=2 if case.fault != REQUEST_FAILED else NEVER,
                                outcome=outcome)

    async def opened() -> AgentRun:
        return await AgentRun.open(agent, run_id="fault", session=session,
                                   store=SQLiteEventStore(folder / "events.db"))

    run = await opened()
    errors: list[BaseException] = []
    result = None
    for attempt in range(case.repeats + 1):
        if attempt and case.reload:
            run = await opened()
        try:
            result = await run.run("go" if attempt == 0 else None, run_config=CONFIG)
            break
        except (InjectedWriteError, RequestFailed) as error:
            errors.append(error)
            if case.fault == WRITE_REFUSED and len(errors) < case.repeats:
                session.fail_on = session.add_calls + 1  # the next write of the batch too
    injected = RequestFailed if case.fault == REQUEST_FAILED else InjectedWriteError
    return FaultSeen(errors=errors, injected=injected, runs=runs["c0"],
                     requests=model.requests, answered=model.answered,
                     written=_outputs(list(await inner.get_items())),
                     completed=result is not None and result.final_output == "done")


@pytest.mark.invariant("I6", "I12")
@pytest.mark.parametrize("case", every_recorded_fault_case(),
                         ids=lambda c: f"{c.fault}-x{c.repeats}-"
                         f"{'reloaded' if c.reload else 'live'}")
def test_a_fault_after_the_result_was_recorded(root: Path, case: RecordedFaultCase) -> None:
    check_recorded_fault(case, asyncio.run(_play_fault(case, _folder(root))))


# ------------------------------------------------------ an older SDK state, reused


async def _play_stale(case: StaleStateCase, folder: Path) -> StaleSeen:
    runs: Counter[str] = Counter()
    steps: list[Any] = [[function_call("pay", {"n": 7}, call_id="c0")]]
    if case.moved == WRITTEN:
        steps.append(RequestFailed("injected request failure"))
    steps.append([assistant_message("done")])
    model = _Model(steps)
    agent = Agent("payer", model=model, tools=[_paying(runs, approval=True)])
    inner = SQLiteSession(SESSION_ID, folder / "session.db")
    session: Any = FlakySession(inner, fail_on=NEVER, outcome="atomic")

    async def opened() -> AgentRun:
        return await AgentRun.open(agent, run_id="stale", session=session,
                                   store=SQLiteEventStore(folder / "events.db"))

    run = await opened()
    paused = await run.run("go", run_config=CONFIG)
    assert paused.state is not None
    saved = paused.state.to_string()  # the SDK state at the pause, as the SDK docs save it
    await run.approve("c0")
    if case.moved == RECORDED:
        session.fail_on = session.add_calls + 1  # the write of the result is refused
    if case.moved != DECIDED:
        with contextlib.suppress(InjectedWriteError, RequestFailed):
            await run.run(run_config=CONFIG)
    if case.reload:
        run = await opened()
    asked = len(model.requests)
    error: BaseException | None = None
    result = None
    try:
        result = await run.run(state=saved, run_config=CONFIG)
    except ControlError as refused:
        error = refused
    return StaleSeen(runs=runs["c0"], error=error,
                     completed=result is not None and result.final_output == "done",
                     replayed=result is not None and result.replayed,
                     model_calls=len(model.requests) - asked, sent=model.requests[-1],
                     written=_outputs(list(await inner.get_items())))


@pytest.mark.invariant("I1", "I12")
@pytest.mark.parametrize("case", every_stale_state_case(),
                         ids=lambda c: f"{c.moved}-{'reloaded' if c.reload else 'live'}")
def test_an_older_sdk_state_reused_after_the_run_moved_on(root: Path,
                                                          case: StaleStateCase) -> None:
    check_stale_state(case, asyncio.run(_play_stale(case, _folder(root))))


# ------------------------------------------------------------------ one writer


class _CountingSession(SQLiteSession):
    """The run's Session, counting the writes made after ``since`` was set."""

    since: bool = False
    writes_after = 0

    async def add_items(self, items: list[Any]) -> None:
        if self.since:
            self.writes_after += 1
        await super().add_items(items)


async def _play_one_writer(case: OneWriterCase, folder: Path) -> OneWriterSeen:
    path = folder / "events.db"
    session = _CountingSession(SESSION_ID, folder / "session.db")
    RunController.start(run_id="one", session_id=SESSION_ID, store=SQLiteEventStore(path))

    def rival() -> None:  # another process claims the run, on its own connection
        RunController.load(SQLiteEventStore(path), "one").claim("rival")
        session.since = True

    class Superseded(_Model):
        async def get_response(self, *args: Any, **kwargs: Any) -> Any:
            if case.rival_at == MODEL_CALL and not self.requests:
                rival()
            return await super().get_response(*args, **kwargs)

    first_runs: Counter[str] = Counter()
    first_model = Superseded([[function_call("pay", {"n": 7}, call_id="c0")],
                              [assistant_message("done")]])
    first = Agent("payer", model=first_model, tools=[_paying(
        first_runs, during=rival if case.rival_at == TOOL_BODY else None)])
    rival_runs: Counter[str] = Counter()
    rival_model = _Model([[function_call("pay", {"n": 7}, call_id="c0")],
                          [assistant_message("done")]])
    second = Agent("payer", model=rival_model, tools=[_paying(rival_runs)])

    async def opened(agent: Agent[Any], *, take_over: bool = False) -> AgentRun:
        return await AgentRun.open(agent, run_id="one", session=session,
                                   store=SQLiteEventStore(path), buffered=case.buffered,
                                   take_over=take_over)

    async def ended(run: AgentRun, input: str | None) -> str:
        try:
            await run.run(input, run_config=CONFIG)
        except ControlError as error:
            return type(error).__name__
        return "completed"

    attempt = await opened(first)
    if case.rival_at == LOADED:  # both loaded the same version; the rival goes first
        rival_outcome = await ended(await opened(second), "go")
        session.since = True
        first_outcome = await ended(attempt, "go")
        first_writes_after = session.writes_after
    else:
        first_outcome = await ended(attempt, "go")
        first_writes_after = session.writes_after
        # the rival resumes the run the first attempt left (its input recorded); that
        # attempt has ended, so a write it staged can no longer land: take_over
        rival_outcome = await ended(await opened(second, take_over=True), None)
    return OneWriterSeen(first_outcome=first_outcome, first_runs=first_runs["c0"],
                         first_model_calls=len(first_model.requests),
                         first_writes_after=first_writes_after,
                         rival_outcome=rival_outcome, rival_runs=rival_runs["c0"],
                         written=_outputs(list(await session.get_items())))


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


OUTPUT_TYPES: dict[str, Any] = {
    TEXT: (None, PLAIN_TEXT),
    # the SDK wraps an output type that is not a pydantic model or a TypedDict
    DATACLASS: (Structured, f'{{"response": {STRUCTURED_TEXT}}}'),
    MODEL: (StructuredModel, STRUCTURED_TEXT),
}


class _Recording(SQLiteEventStore):
    """The run's store, keeping each append (its arguments) with the Session's items at
    that moment, so a crash after any append can be rebuilt (`_crashed_after`)."""

    def __init__(self, path: Path, session: ListSession) -> None:
        super().__init__(path)
        self.session = session
        self.appends: list[tuple[tuple[Any, ...], dict[str, Any], list[Any]]] = []

    def append(self, *args: Any, **kwargs: Any) -> None:
        self.appends.append((args, kwargs, list(self.session.items)))
        super().append(*args, **kwargs)


def _output_agent(shape: OutputShape, model: _Model) -> Agent[Any]:
    output_type, _ = OUTPUT_TYPES[shape]
    if output_type is None:
        return Agent("oracle", model=model)
    return Agent("oracle", model=model,
                 output_type=AgentOutputSchema(output_type, strict_json_schema=False))


def _answers(shape: OutputShape) -> _Model:
    return _Model([[assistant_message(OUTPUT_TYPES[shape][1])]])


def _answer_items(items: list[Any]) -> int:
    return sum(1 for item in items if isinstance(item, dict) and item.get("role") == "assistant")


Played = list[tuple[OutputCase, OutputSeen]]


async def _play_outputs(shape: OutputShape, folder: Path) -> tuple[Played, Any]:
    """The uninterrupted run (its store appending per event, a snapshot with each), then a
    new process for a crash after each of its appends: the store holding those appends,
    the Session as it was then, and, where a write followed the append, as it was with
    that write landed. Returns each crash's case and what the restart did, and the
    uninterrupted run's output."""
    session = ListSession(SESSION_ID)
    store = _Recording(folder / "events.db", session)
    run = await AgentRun.open(_output_agent(shape, _answers(shape)), run_id="out",
                              session=cast("Any", session), store=store, buffered=False)
    uninterrupted = (await run.run("go", run_config=CONFIG)).final_output
    appends = store.appends
    played = []
    for k in range(1, len(appends) + 1):
        events = [e for args, _, _ in appends[:k] for e in args[1]]
        unwritten = appends[k - 1][2]
        landed = appends[k][2] if k < len(appends) else list(session.items)
        for written, items in ((False, unwritten), (True, landed)):
            if written and landed == unwritten:
                continue
            case = OutputCase(shape, boundary_of(events, written=written))
            crashed = folder / f"crash-{k}-{written}"
            crashed.mkdir()
            played.append((case, await _restart(case, appends[:k], items, crashed,
                                                any(isinstance(e, ev.InputAdded)
                                                    for e in events))))
    return played, uninterrupted


async def _restart(case: OutputCase, appends: list[Any], items: list[Any], folder: Path,
                   input_recorded: bool) -> OutputSeen:
    store = SQLiteEventStore(folder / "events.db")
    for args, kwargs, _ in appends:  # what was durable when the process died
        store.append(*args, **kwargs)
    session = ListSession(SESSION_ID, items)
    model = _answers(case.shape)
    run = await AgentRun.open(_output_agent(case.shape, model), run_id="out",
                              session=cast("Any", session),
                              store=SQLiteEventStore(folder / "events.db"),
                              take_over=True)  # the crashed process is gone
    output: Any = None
    try:
        result = await run.run(None if input_recorded else "go", run_config=CONFIG)
        outcome, output = "replayed" if result.replayed else "completed", result.final_output
    except ControlError as error:
        outcome = type(error).__name__
    accepted = [e for e in run.controller.events if isinstance(e, ev.FinalOutputAccepted)]
    return OutputSeen(outcome=outcome, output=output,
                      recorded=accepted[-1].output if accepted else None,
                      lossless=accepted[-1].lossless if accepted else None,
                      model_calls=len(model.requests), written=_answer_items(session.items))


@pytest.mark.invariant("I10")
@pytest.mark.parametrize("shape", OutputShape)
def test_a_final_output_crashed_at_every_event_boundary(
        root: Path, shape: OutputShape, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(controller_module, "SNAPSHOT_EVERY", 1)  # a snapshot every event
    played, uninterrupted = asyncio.run(_play_outputs(shape, _folder(root)))
    output_type = OUTPUT_TYPES[shape][0]
    assert isinstance(uninterrupted, output_type or str)
    assert {case.boundary for case, _ in played} == set(Boundary)  # every kind met
    for case, seen in played:
        check_output(case, seen, uninterrupted, output_type=output_type)
