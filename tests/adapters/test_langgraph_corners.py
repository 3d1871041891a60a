"""The adapter corners of `statemachine.testing.adapter_corners` (issue 32) played through
the LangGraph adapter, offline (the scripted chat model of tests/drivers/langgraph_driver.py,
its requests kept), each case checked against what the case alone says. Every family is
played through both doors: a graph of LangGraph's ``ToolNode(..., wrap_tool_call=...)``
with the ledger's wrapper, and LangChain's ``create_agent`` with `LedgerMiddleware` last
in its middleware list. The thread is checkpointed by LangGraph's ``SqliteSaver`` on a
file, through ``OneWriterSaver(saver, ledger=ledger)`` (the checkpoint writes are the
ledger's publications); a "process" is a ledger, a saver connection and a graph of its
own on the same two files:

* every mix and order of new, cached and in-doubt calls in one reply (all up to three
  calls; drawn ones up to eight in ``just fuzz``): the calls run in parallel (the
  ``ToolNode``'s threads, ``create_agent``'s tasks), each held where its kind says (a
  new one in a wrapper around the ledger, before the ledger sees it; a call in doubt
  inside its body; a cached one after the ledger recorded its result) until all are,
  then the process dies (a ``BaseException`` out of every call); the thread is resumed
  by a new process or by the same objects;
* the checkpoint write carrying a recorded result refused, or landed then raised, or the
  model request after it failing, once or twice;
* time travel: the checkpoint of the approval's pause given again after the run moved
  on: refused by ``OneWriterSaver`` (`OlderState.REFUSED`), then the thread goes on from
  its latest checkpoint; on LangGraph's saver alone a branch (`OlderState.FORKED`);
* two resumers of one checkpoint (`Fence.CHECKPOINT`): the rival resumes it before the
  first attempt, during its model call, during its tool body;
* a final output, text or a structured response (``create_agent(response_format=...)``:
  a dataclass, a pydantic model, with fields JSON lacks) after one tool call, the run
  crashed after every append of the ledger (its store snapshotting every event) and
  resumed. The ledger records no final output (the checkpointer holds the answer), so
  every such boundary falls before the answer.

Under CI a missing ``langgraph`` package fails this module instead of skipping it.
"""

from __future__ import annotations

import contextlib
import datetime
import decimal
import json
import os
import sqlite3
import tempfile
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pydantic
import pytest
from hypothesis import given, settings

try:
    import langgraph  # noqa: F401
except ImportError:  # pragma: no cover - CI installs the extra
    from tests.helpers import missing_extra

    missing_extra("langgraph")

from langchain.agents import create_agent
from langchain.agents.middleware import AgentMiddleware
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.tools import BaseTool, tool
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.types import Command

from statemachine import (
    ConcurrencyConflict,
    ControlError,
    SQLiteEventStore,
    ToolInDoubt,
    operator,
    tool_context,
)
from statemachine import controller as controller_module
from statemachine import events as ev
from statemachine.adapters.langgraph import (
    LedgerMiddleware,
    OneWriterSaver,
    ToolLedger,
    decision,
)
from statemachine.testing import (
    PLAIN_TEXT,
    STRUCTURED_TEXT,
    Boundary,
    CaseFailed,
    FaultSeen,
    Fence,
    OlderState,
    OneWriterCase,
    OneWriterSeen,
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
    WRITTEN,
)
from statemachine.values import Resolution
from tests.drivers.langgraph_driver import (
    FailingPut,
    InjectedPutError,
    ScriptedModel,
    build,
)
from tests.helpers import crash_folder

THREAD = "t1"
CONFIG: Any = {"configurable": {"thread_id": THREAD},
               "max_concurrency": 16}  # every call of a drawn reply at once
RUN = f"langgraph:{THREAD}"
DOORS = ("toolnode", "agent")
FUZZ = os.environ.get("HYPOTHESIS_PROFILE") == "fuzz"
ONE: list[Any] = [[("work", {"n": 0}, "c0")], "done"]
"""The script of a run whose one reply holds one call, ``c0``."""


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with crash_folder(tmp_path_factory, "lg-corners") as folder:  # fsyncs are cheap there
        yield folder


def _folder(root: Path) -> Path:
    """A fresh folder for one case's SQLite files."""
    return Path(tempfile.mkdtemp(dir=root))


def _results(messages: list[BaseMessage]) -> list[tuple[str, Any]]:
    """The (tool call id, content) pairs of the ToolMessages in ``messages``."""
    return [(m.tool_call_id, m.content) for m in messages if isinstance(m, ToolMessage)]


def _work(runs: Counter[str], during: Callable[[str], None] | None = None) -> BaseTool:
    @tool
    def work(n: int) -> str:
        """Do the n-th piece of work."""
        call_id = tool_context().call_id
        runs[call_id] += 1
        if during is not None:
            during(call_id)
        return ReplyCase.result_text(call_id)

    return work


class Crash(BaseException):
    """The process dying (out of every call it was running)."""


class RequestFailed(ConnectionError):
    """The model request a fault fails."""


Outer = Callable[[Any, Callable[[], Any]], Any]
"""A tool-call wrapper around the ledger's: the request, and the call through the ledger."""


class _Around(AgentMiddleware):
    """``outer`` as middleware listed before `LedgerMiddleware` (so around it)."""

    def __init__(self, outer: Outer) -> None:
        super().__init__()
        self.outer = outer

    def wrap_tool_call(self, request: Any, handler: Callable[[Any], Any]) -> Any:
        return self.outer(request, lambda: handler(request))


class Process:
    """One process's handles on the thread: a ledger on its own connection to the event
    store (``store``, or the folder's), its own connection to the checkpoints through
    ``OneWriterSaver`` with the ledger's publications (``saver="history"``) or LangGraph's
    ``SqliteSaver`` by itself (``"alone"``), and the graph of ``door`` over them, invoked
    with ``durability="sync"`` or (``"default"``) LangGraph's default, ``"async"``: a
    step's checkpoint written while the next step runs."""

    def __init__(self, door: str, folder: Path, model: ScriptedModel, tools: list[BaseTool],
                 *, approvals: tuple[str, ...] = (), saver: str = "history",
                 outer: Outer | None = None, fault: FailingPut | None = None,
                 idempotent: tuple[str, ...] = (), response_format: Any = None,
                 store: SQLiteEventStore | None = None, durability: str = "sync") -> None:
        self.durability = durability
        self.store = store or SQLiteEventStore(str(folder / "events.db"))
        self.ledger = ToolLedger(self.store, approvals=approvals, idempotent=idempotent)
        self.connection = sqlite3.connect(folder / "checkpoints.db", check_same_thread=False)
        self.inner = SqliteSaver(self.connection)
        self.landed = 0
        """The checkpoint writes of this process that landed, once ``counting``."""
        self.counting = False
        put = self.inner.put

        def counted(*args: Any) -> Any:
            written = put(*args)
            self.landed += self.counting
            return written

        self.inner.put = counted  # type: ignore[method-assign,assignment]
        if fault is not None:
            fault.attach(self.inner)
        checkpointer: Any = self.inner
        if saver == "history":
            checkpointer = OneWriterSaver(self.inner, ledger=self.ledger)
        self.saver = checkpointer
        """What the graph reads and writes the thread through."""
        if door == "toolnode":
            assert response_format is None
            self.graph = build("ledger", tools, model, checkpointer, ledger=self.ledger,
                               review=bool(approvals), outer=outer)
        else:
            around = [] if outer is None else [_Around(outer)]
            self.graph = create_agent(model, tools, checkpointer=checkpointer,
                                      middleware=[*around, LedgerMiddleware(self.ledger)],
                                      response_format=response_format)

    def invoke(self, value: Any, config: Any = CONFIG, **options: Any) -> dict[str, Any]:
        if self.durability != "default":
            options["durability"] = self.durability
        return dict(self.graph.invoke(value, config, **options))

    def messages(self) -> list[BaseMessage]:
        """The thread's messages at its latest checkpoint."""
        return list(self.graph.get_state(CONFIG).values["messages"])

    def checkpoints(self) -> int:
        return len(list(self.inner.list({"configurable": {"thread_id": THREAD}})))


def _done(result: dict[str, Any]) -> bool:
    last = result["messages"][-1]
    return isinstance(last, AIMessage) and last.content == "done"


# ------------------------------------------------------------ one reply, mixed


def _play_reply(case: ReplyCase, door: str, folder: Path) -> ReplySeen:
    runs: Counter[str] = Counter()
    crashing = [True]
    arrived = threading.Barrier(len(case.kinds), timeout=60)

    def dies_inside(call_id: str) -> None:  # its start durable, never to report
        if crashing[0] and case.kind(call_id) == IN_DOUBT:
            arrived.wait()
            raise Crash

    def holds(request: Any, through_the_ledger: Callable[[], Any]) -> Any:
        if not crashing[0]:
            return through_the_ledger()
        if case.kind(request.tool_call["id"]) != NEW:  # a new one never reaches it
            through_the_ledger()  # cached: its result recorded (in doubt: dies inside)
        arrived.wait()
        raise Crash

    model = ScriptedModel(script=[[("work", {"n": n}, call_id)
                                   for n, call_id in enumerate(case.ids)], "done"])
    tools = [_work(runs, dies_inside)]

    def opened() -> Process:  # as a new process opens it: its own connections
        return Process(door, folder, model, tools, outer=holds)

    process = opened()
    try:
        process.invoke({"messages": [HumanMessage("go")]})
    except Crash:
        pass
    else:
        raise CaseFailed("the crashing attempt completed")
    if arrived.broken:
        raise CaseFailed("the crashing attempt ended before every call stood where its "
                         "kind puts it")
    crashing[0] = False
    runs.clear()
    asked = len(model.requests)

    refused_by, refused_did = None, 0
    if case.reload:
        process = opened()
    try:
        result = process.invoke(None)
    except ToolInDoubt as refused:
        refused_by = refused.call_id
        refused_did = sum(runs.values()) + len(model.requests) - asked
        for call_id in case.of_kind(IN_DOUBT):
            output = (case.settled_text(call_id) if case.settle is Resolution.COMPLETED
                      else None)
            operator.resolve(process.store, RUN, call_id, outcome=case.settle,
                             output=output, by="ops")
        if case.reload:
            process = opened()
        result = process.invoke(None)
    requests = model.requests[asked:]
    return ReplySeen(refused_by=refused_by, runs=dict(runs),
                     sent=[pair for messages in requests for pair in _results(messages)],
                     model_calls=len(requests), written=_results(process.messages()),
                     completed=_done(result), refused_did=refused_did)


def _case_id(case: ReplyCase) -> str:
    return f"{case.label}-{case.settle.value}-{'reloaded' if case.reload else 'live'}"


@pytest.mark.invariant("I11", "I12")
@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize("case", every_reply_case(3), ids=_case_id)
def test_every_mix_of_new_cached_and_in_doubt_calls(root: Path, case: ReplyCase,
                                                    door: str) -> None:
    check_reply(case, _play_reply(case, door, _folder(root)))


@settings(max_examples=200 if FUZZ else 3)
@given(reply_cases(8))
def test_a_drawn_mix_of_new_cached_and_in_doubt_calls(root: Path, case: ReplyCase) -> None:
    for door in DOORS:
        check_reply(case, _play_reply(case, door, _folder(root)))


# ------------------------------------------------- a fault after a recorded result


def _play_fault(case: RecordedFaultCase, door: str, folder: Path) -> FaultSeen:
    runs: Counter[str] = Counter()
    # the reply's request answered; the request carrying the result fails `repeats` times
    failing = ([None, *[RequestFailed("injected request failure")] * case.repeats]
               if case.fault == REQUEST_FAILED else [])
    model = ScriptedModel(script=ONE, failures=failing)
    fault = (None if case.fault == REQUEST_FAILED else
             FailingPut(landed=case.fault == WRITE_LANDED, times=case.repeats))

    def opened() -> Process:
        return Process(door, folder, model, [_work(runs)], fault=fault)

    process = opened()
    errors: list[BaseException] = []
    result = None
    for attempt in range(case.repeats + 1):
        if attempt and case.reload:
            process = opened()
        try:
            result = process.invoke({"messages": [HumanMessage("go")]} if attempt == 0
                                    else None)
            break
        except (InjectedPutError, RequestFailed) as error:
            errors.append(error)
    injected = RequestFailed if case.fault == REQUEST_FAILED else InjectedPutError
    return FaultSeen(errors=errors, injected=injected, runs=runs["c0"],
                     requests=[_results(messages) for messages in model.requests],
                     answered=model.answered, written=_results(process.messages()),
                     completed=result is not None and _done(result))


@pytest.mark.invariant("I6", "I12")
@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize("case", every_recorded_fault_case(),
                         ids=lambda c: f"{c.fault}-x{c.repeats}-"
                         f"{'reloaded' if c.reload else 'live'}")
def test_a_fault_after_the_result_was_recorded(root: Path, case: RecordedFaultCase,
                                               door: str) -> None:
    check_recorded_fault(case, _play_fault(case, door, _folder(root)))


# ----------------------------------------- time travel: an older checkpoint, resumed


def _play_stale(case: StaleStateCase, door: str, folder: Path, durability: str) -> StaleSeen:
    """The checkpoint of the approval's pause, given again (with the resume value the
    reviewer sent from it) after the run moved on; through ``OneWriterSaver`` with the
    ledger's publications (`OlderState.REFUSED`) or on LangGraph's saver alone
    (`OlderState.FORKED`)."""
    runs: Counter[str] = Counter()
    failing = [None, RequestFailed("injected request failure")] if case.moved == WRITTEN \
        else []
    model = ScriptedModel(script=ONE, failures=failing)
    fault = FailingPut(landed=False, times=int(case.moved == RECORDED))
    saver = "history" if case.older == OlderState.REFUSED else "alone"

    def opened() -> Process:
        return Process(door, folder, model, [_work(runs)], approvals=("work",), saver=saver,
                       fault=fault, durability=durability)

    process = opened()
    (asked,) = process.invoke({"messages": [HumanMessage("go")]})["__interrupt__"]
    (pending,) = asked.value["pending"]
    saved = process.graph.get_state(CONFIG).config  # the pause, as the reviewer saw it
    approval: Command[Any] = Command(resume={"c0": decision("approve", pending["fingerprint"])})
    if case.moved == DECIDED:  # through the operator: the thread stays at the pause
        operator.approve(process.store, RUN, "c0", fingerprint=pending["fingerprint"],
                         by="ops")
    else:
        with contextlib.suppress(InjectedPutError, RequestFailed):
            process.invoke(approval)
    if case.reload:
        process = opened()
    requests, ran, checkpoints = len(model.requests), runs["c0"], process.checkpoints()
    error: BaseException | None = None
    try:
        result = process.invoke(approval, saved)
    except ControlError as refused:
        error = refused
        refused_did = runs["c0"] - ran + len(model.requests) - requests
        requests, checkpoints = len(model.requests), process.checkpoints()
        result = process.invoke(None)  # the thread from its latest checkpoint
    else:
        refused_did = 0
    return StaleSeen(runs=runs["c0"], error=error, completed=_done(result),
                     replayed=process.checkpoints() == checkpoints,
                     model_calls=len(model.requests) - requests,
                     sent=_results(model.requests[-1]), written=_results(process.messages()),
                     refused_did=refused_did)


DURABILITIES = ("sync", "default")
"""How the thread's checkpoints are written where ``OneWriterSaver`` fences it: each before
the next step runs, or (LangGraph's default) while it runs."""
STALE = [(case, durability) for case in every_stale_state_case(OlderState.REFUSED)
         for durability in DURABILITIES] + [
    (case, "sync") for case in every_stale_state_case(OlderState.FORKED)]


@pytest.mark.invariant("I1", "I12")
@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize(("case", "durability"), STALE, ids=[
    f"{c.older}-{c.moved}-{'reloaded' if c.reload else 'live'}-{d}" for c, d in STALE])
def test_an_older_checkpoint_resumed_after_the_run_moved_on(
        root: Path, case: StaleStateCase, durability: str, door: str) -> None:
    seen = _play_stale(case, door, _folder(root), durability)
    check_stale_state(case, seen)
    if case.refused:  # the fork is what was refused, and the error says so
        assert isinstance(seen.error, ConcurrencyConflict)
        assert "fork from an earlier checkpoint" in seen.error.reason


# ------------------------------------------------------------------ one writer


def _after_load(process: Process, then: Callable[[], None]) -> None:
    """Call ``then`` once, right after ``process``'s graph next reads the thread (the
    load an invoke starts with: what it resumes from)."""
    read = process.saver.get_tuple

    def loaded(config: Any) -> Any:
        found = read(config)
        process.saver.get_tuple = read
        then()
        return found

    process.saver.get_tuple = loaded


def _play_one_writer(case: OneWriterCase, door: str, folder: Path,
                     durability: str) -> OneWriterSeen:
    """Two resumers of the checkpoint that holds the run's input, its next step the
    model call (whose first request failed), each a process of its own that resumes the
    thread (``invoke(None, config)``, as a second process does): both read the
    checkpoint before either goes on; the rival, held right after its read, resumes
    where the case says, to its end."""
    starting = ScriptedModel(script=ONE, failures=[RequestFailed("injected")])
    with pytest.raises(RequestFailed):
        Process(door, folder, starting, [_work(Counter())]).invoke(
            {"messages": [HumanMessage("go")]})
    first_runs: Counter[str] = Counter()
    rival_runs: Counter[str] = Counter()
    ended: dict[str, str] = {}

    def resume(process: Process, who: str) -> None:
        try:
            process.invoke(None)
            ended[who] = "completed"
        except ControlError as error:
            ended[who] = type(error).__name__

    rival = Process(door, folder, ScriptedModel(script=ONE), [_work(rival_runs)],
                    durability=durability)
    racing = threading.Thread(target=resume, args=(rival, "rival"))  # another process
    read, go = threading.Event(), threading.Event()

    def held() -> None:  # the rival read the checkpoint; it goes on when told
        read.set()
        go.wait(60)

    _after_load(rival, held)

    def rival_goes(*_: Any) -> None:
        first.counting = rival.counting = True
        go.set()
        racing.join(60)

    first_model = ScriptedModel(script=ONE, during=lambda asked: rival_goes()
                                if case.rival_at == MODEL_CALL and asked == 0 else None)
    first = Process(door, folder, first_model, [_work(
        first_runs, rival_goes if case.rival_at == TOOL_BODY else None)],
                    durability=durability)

    def both_read() -> None:
        racing.start()
        read.wait(60)
        if case.rival_at == LOADED:  # the rival goes first
            rival_goes()

    _after_load(first, both_read)
    resume(first, "first")
    return OneWriterSeen(first_outcome=ended["first"], first_runs=first_runs["c0"],
                         first_model_calls=len(first_model.requests),
                         first_writes_after=first.landed, rival_outcome=ended["rival"],
                         rival_runs=rival_runs["c0"], written=_results(first.messages()),
                         rival_writes=rival.landed)


@pytest.mark.invariant("I1", "I7")
@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize("durability", DURABILITIES)
@pytest.mark.parametrize("case", [c for c in every_one_writer_case(Fence.CHECKPOINT)
                                  if c.buffered],  # the ledger always buffers
                         ids=lambda c: str(c.rival_at))
def test_two_resumers_of_one_checkpoint(root: Path, case: OneWriterCase, durability: str,
                                        door: str) -> None:
    check_one_writer(case, _play_one_writer(case, door, _folder(root), durability))


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


OUTPUT_TYPES: dict[OutputShape, Any] = {TEXT: None, DATACLASS: Structured,
                                        MODEL: StructuredModel}


def _answering(shape: OutputShape) -> ScriptedModel:
    """One call of ``work``, then the final answer: the text, or the call of the
    structured response's tool (``create_agent``'s tool strategy) with the answer's
    fields (a NaN among them)."""
    output_type = OUTPUT_TYPES[shape]
    final: Any = PLAIN_TEXT if output_type is None else [
        (output_type.__name__, json.loads(STRUCTURED_TEXT), "answer")]
    return ScriptedModel(script=[[("work", {"n": 0}, "c0")], final])


def _output(shape: OutputShape, result: dict[str, Any]) -> Any:
    return (result["messages"][-1].content if OUTPUT_TYPES[shape] is None
            else result["structured_response"])


def _answers(shape: OutputShape, messages: list[BaseMessage]) -> int:
    """How many replies in the thread carry the final answer."""
    if OUTPUT_TYPES[shape] is None:
        return sum(isinstance(m, AIMessage) and not m.tool_calls for m in messages)
    return sum(isinstance(m, AIMessage) and any(call["id"] == "answer"
                                                for call in m.tool_calls) for m in messages)


class _Recording(SQLiteEventStore):
    """The ledger's store, keeping each append (its arguments) with a copy of the
    checkpoints as they stood at that moment (read on a connection of its own: what is
    committed), so a crash after any append can be rebuilt."""

    def __init__(self, path: Path, checkpoints: Path) -> None:
        super().__init__(str(path))
        self.checkpoints = checkpoints
        self.appends: list[tuple[tuple[Any, ...], dict[str, Any], Path]] = []

    def append(self, *args: Any, **kwargs: Any) -> None:
        copy = self.checkpoints.with_name(f"checkpoints-{len(self.appends)}.db")
        with contextlib.closing(sqlite3.connect(self.checkpoints)) as source, \
                contextlib.closing(sqlite3.connect(copy)) as target:
            source.backup(target)
        self.appends.append((args, kwargs, copy))
        super().append(*args, **kwargs)


Played = list[tuple[OutputCase, OutputSeen]]


def _play_outputs(shape: OutputShape, folder: Path) -> tuple[Played, Any]:
    """The uninterrupted run (its ledger's store snapshotting every event), then a new
    process for a crash after each append of the ledger: the store holding those
    appends, the checkpoints as they stood then. The tool is idempotent: a crash between
    its start and its result runs it again instead of leaving it in doubt (the
    reply cases play that); what is played here is the final output."""
    store = _Recording(folder / "events.db", folder / "checkpoints.db")
    process = Process("agent", folder, _answering(shape), [_work(Counter())],
                      idempotent=("work",), response_format=OUTPUT_TYPES[shape], store=store)
    uninterrupted = _output(shape, process.invoke({"messages": [HumanMessage("go")]}))
    played = []
    for k, (_, _, checkpoints) in enumerate(store.appends, start=1):
        events = [e for args, _, _ in store.appends[:k] for e in args[1]]
        crashed = folder / f"crash-{k}"
        crashed.mkdir()
        restored = SQLiteEventStore(str(crashed / "events.db"))
        for args, kwargs, _ in store.appends[:k]:  # what was durable when it died
            restored.append(*args, **kwargs)
        checkpoints.rename(crashed / "checkpoints.db")
        case = OutputCase(shape, boundary_of(events))
        played.append((case, _restart(case, crashed)))
    return played, uninterrupted


def _restart(case: OutputCase, folder: Path) -> OutputSeen:
    model = _answering(case.shape)
    process = Process("agent", folder, model, [_work(Counter())], idempotent=("work",),
                      response_format=OUTPUT_TYPES[case.shape])
    output: Any = None
    try:
        output, outcome = _output(case.shape, process.invoke(None)), "completed"
    except ControlError as error:
        outcome = type(error).__name__
    accepted = [e for e in process.ledger.controller(RUN).events
                if isinstance(e, ev.FinalOutputAccepted)]
    return OutputSeen(outcome=outcome, output=output,
                      recorded=accepted[-1].output if accepted else None,
                      lossless=accepted[-1].lossless if accepted else None,
                      model_calls=len(model.requests),
                      written=_answers(case.shape, process.messages()))


@pytest.mark.invariant("I10")
@pytest.mark.parametrize("shape", OutputShape)
def test_a_final_output_crashed_at_every_event_boundary(
        root: Path, shape: OutputShape, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(controller_module, "SNAPSHOT_EVERY", 1)  # a snapshot every event
    played, uninterrupted = _play_outputs(shape, _folder(root))
    output_type = OUTPUT_TYPES[shape]
    assert isinstance(uninterrupted, output_type or str)
    assert len(played) >= 3
    # the ledger records no final output: every boundary of its log is before the answer
    assert {case.boundary for case, _ in played} == {Boundary.BEFORE_ANSWER}
    for case, seen in played:
        check_output(case, seen, uninterrupted, output_type=output_type)
