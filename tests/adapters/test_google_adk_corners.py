"""The adapter corners of `statemachine.testing.adapter_corners` (issue 32) played through
the Google ADK adapter (`LedgerPlugin`, `OneWriterSessionService`), offline: ADK's own
``Runner`` over the scripted model of `tests.drivers.adk_driver`, ADK's
``SqliteSessionService`` on a file, the ledger on a SQLite store, tools that append a
line to an fsynced effects file (what ran is counted there). A "fresh process" is a new
plugin, store and session service on the same files. Each case is checked against what
the case alone says.

ADK 2.13 runs the function calls of one model response side by side: one task per call,
started in the response's order on one event loop (each task: the plugins'
``before_tool_callback``, the body, the ``after_tool_callback``; a sync body runs on the
loop unless a tool thread pool is configured), so one attempt can leave any mix:

* every mix and order of new, cached and in-doubt calls in one reply (all up to three
  calls; drawn ones up to eight in ``just fuzz``): the attempt is cancelled once every
  call stands where its kind says (a new call held in a plugin placed before the ledger,
  its start unrecorded; a call in doubt inside its body; a cached one in a plugin after
  the ledger, its result recorded), then the invocation is resumed (``invocation_id``)
  by a fresh process or by the same runner;
* calls awaiting ``require_confirmation`` beside new and cached ones, every mix up to
  three calls (drawn ones in ``just fuzz``): resumed, the run asks every decision, then
  one message confirms some and rejects the others;
* the session append carrying a recorded result failing (refused, or landed then
  raising), or the model request after it failing, once or twice;
* a confirmation sent again after the run moved on (ADK's session is the history, so its
  older state comes back as input: `OlderState.RESENT`), in a resumable app and in one
  that is not;
* a rival claiming the run before the attempt, during its model call, during its body
  (the plugin flushes at effect boundaries: the buffered cases);
* the final output: the adapter records none (ADK's final answer is an event of its
  session, no call of the ledger), so `OutputCase` does not apply. What reaches the
  ledger is a structured output (``output_schema`` beside tools) riding ADK's own
  ``set_model_response`` call, with values JSON lacks that ADK carries (a tuple, int
  keys, a NaN; a datetime, a Decimal, bytes or a set make ADK alone fail): the run is
  stopped after each durable append (a snapshot every event) and resumed.

Under CI a missing ``google-adk`` package fails this module instead of skipping it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pydantic
import pytest
from hypothesis import given, settings

try:
    import google.adk  # noqa: F401
except ImportError:  # pragma: no cover - CI installs the extra
    from tests.helpers import missing_extra

    missing_extra("google-adk")

from google.adk.plugins.base_plugin import BasePlugin
from google.adk.sessions import InMemorySessionService
from google.adk.sessions.sqlite_session_service import SqliteSessionService
from google.adk.tools.function_tool import FunctionTool
from google.genai import types

from statemachine import (
    ControlError,
    RunController,
    SQLiteEventStore,
    ToolInDoubt,
    operator,
    tool_context,
)
from statemachine import controller as controller_module
from statemachine import events as ev
from statemachine.adapters.google_adk import ASK_CONFIRMATION, REJECTED, LedgerPlugin
from statemachine.testing import (
    CaseFailed,
    DecisionMixCase,
    DecisionSeen,
    FaultSeen,
    OlderState,
    OneWriterCase,
    OneWriterSeen,
    RecordedFaultCase,
    ReplyCase,
    ReplySeen,
    RivalPoint,
    StaleSeen,
    StaleStateCase,
    check_decision_mix,
    check_one_writer,
    check_recorded_fault,
    check_reply,
    check_stale_state,
    decision_mix_cases,
    every_decision_mix_case,
    every_one_writer_case,
    every_recorded_fault_case,
    every_reply_case,
    every_stale_state_case,
    reply_cases,
)
from statemachine.testing.adapter_corners import (
    CACHED,
    CONFIRMED,
    DECIDED,
    IN_DOUBT,
    LOADED,
    MODEL_CALL,
    NEW,
    RECORDED,
    REQUEST_FAILED,
    TOOL_BODY,
    WRITE_LANDED,
    WRITTEN,
)
from statemachine.values import Resolution
from tests.adapters.test_google_adk import LosesAppend, World
from tests.drivers import adk_driver as world
from tests.drivers.adk_driver import (
    APP,
    RUN,
    SESSION,
    USER,
    Call,
    DieBeforeAppend,
    ModelUnavailable,
    confirmation_requests,
    response,
    run,
    text,
)
from tests.helpers import crash_folder

logging.getLogger("google_adk").setLevel(logging.CRITICAL)
FUZZ = os.environ.get("HYPOTHESIS_PROFILE") == "fuzz"


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with crash_folder(tmp_path_factory, "adk-corners") as folder:  # fsyncs are cheap there
        yield folder


def _folder(root: Path) -> Path:
    """A fresh folder for one case's files."""
    return Path(tempfile.mkdtemp(dir=root))


def _sessions(folder: Path) -> SqliteSessionService:
    """ADK's SQLite session service on the case's file, as a process opens it."""
    return SqliteSessionService(str(folder / "sessions.db"))


def _world(folder: Path, script: list[Call], *, service: Any, resumable: bool = True,
           confirm: bool = False, hold: Callable[[str], Any] | None = None,
           label: str = "", during: Callable[[], None] | None = None,
           before: Sequence[BasePlugin] = (), after: Sequence[BasePlugin] = (),
           ledger: Callable[..., LedgerPlugin] = LedgerPlugin) -> World:
    """A process running the case's agent through the ledger: its ``work`` tool (its
    calls needing a confirmation when ``confirm``; ``pay`` always needs one) appends
    ``label + call id`` to the effects file, calls ``during``, awaits ``hold(call id)``
    and returns `ReplyCase.result_text`."""
    w = World(folder, "ledger", script, [], resumable=resumable, service=service,
              before=before, after=after, ledger=ledger)

    async def body() -> str:
        call_id = tool_context().call_id
        world.effect(w.effects, label + call_id)
        if during is not None:
            during()
        if hold is not None:
            await hold(call_id)
        return ReplyCase.result_text(call_id)

    async def work(n: int) -> str:
        """Do the n-th piece of work."""
        return await body()

    async def pay(n: int) -> str:
        """Pay the n-th bill (needs a confirmation)."""
        return await body()

    agent: Any = w.runner.agent
    agent.tools.extend([FunctionTool(work, require_confirmation=confirm),
                        FunctionTool(pay, require_confirmation=True)])
    return w


def _output(response: Any) -> Any:
    """What a function response carries: a tool's text return is ``{"result": text}``."""
    if isinstance(response, dict) and set(response) == {"result"}:
        return response["result"]
    return response


async def _stored(w: World) -> list[Any]:
    session = await w.service.get_session(app_name=APP, user_id=USER, session_id=SESSION)
    assert session is not None
    return list(session.events)


async def _written(w: World) -> list[tuple[str, Any]]:
    """The (call id, output) pairs of the tools' function responses in the session, but
    the answer ADK writes for a call while it awaits its confirmation."""
    return [(str(r.id), _output(r.response)) for e in await _stored(w) if e.author != "user"
            for r in e.get_function_responses() if r.response != {"error": ASK_CONFIRMATION}]


def _said(events: Sequence[Any], words: str) -> bool:
    return any(part.text == words for event in events if event.content
               for part in event.content.parts or ())


class _Requests:
    """The model requests made by the processes a case opened, from ``mark()`` on."""

    def __init__(self) -> None:
        self.models: list[Any] = []
        self.skip: list[int] = []

    def add(self, w: World) -> World:
        self.models.append(w.model)
        self.skip.append(0)
        return w

    def mark(self) -> None:
        self.skip = [len(model.seen) for model in self.models]

    def made(self) -> list[list[tuple[str, Any]]]:
        return [[(call_id, _output(response)) for call_id, response in request]
                for model, skip in zip(self.models, self.skip, strict=True)
                for request in model.seen[skip:]]


class _Held:
    """Where each call of the crashing attempt stands: ``held`` fills as each reaches
    the place ``where(call id)`` names for it, then the attempt is cancelled."""

    def __init__(self, where: Callable[[str], str]) -> None:
        self.where = where
        self.crashing = True
        self.held: set[str] = set()

    async def hold(self, call_id: str, place: str) -> None:
        if self.crashing and self.where(call_id) == place:
            self.held.add(call_id)
            await asyncio.Event().wait()


class _Holding(BasePlugin):
    """Holds a call of the crashing attempt before the ledger, in
    ``before_tool_callback`` (its start not recorded: ``"before"``). It overrides no
    result callback: a plugin before the ledger that does is refused when the run opens."""

    def __init__(self, held: _Held, place: str = "before") -> None:
        super().__init__(name=f"hold_{place}")
        self.held = held
        self.place = place

    async def before_tool_callback(self, *, tool: Any, tool_args: dict[str, Any],
                                   tool_context: Any) -> dict[str, Any] | None:
        await self.held.hold(tool_context.function_call_id, self.place)
        return None


class _HoldingLedger(LedgerPlugin):
    """The ledger, holding a call of the crashing attempt once its
    ``after_tool_callback`` recorded the result (``"after"``: what the callbacks after
    it made of the output, which the ledger runs itself), before ADK makes the event."""

    def __init__(self, held: _Held, store: Any, **options: Any) -> None:
        super().__init__(store, **options)
        self.held = held

    async def after_tool_callback(self, *, tool: Any, tool_args: dict[str, Any],
                                  tool_context: Any, result: Any) -> dict[str, Any] | None:
        answer = await super().after_tool_callback(
            tool=tool, tool_args=tool_args, tool_context=tool_context, result=result)
        await self.held.hold(tool_context.function_call_id, "after")
        return answer


def _holding_ledger(held: _Held) -> Callable[..., LedgerPlugin]:
    return lambda store, **options: _HoldingLedger(held, store, **options)


async def _crash(w: World, held: _Held, calls: int) -> str:
    """Runs ``"go"`` until ``calls`` calls are held, cancels it (the process dies),
    and returns the invocation to resume."""
    crashing = asyncio.ensure_future(run(w.runner, text("go")))
    while len(held.held) < calls and not crashing.done():
        await asyncio.sleep(0.001)
    if crashing.done():  # it ended before every call stood where the case puts it
        raise CaseFailed(f"the crashing attempt ended early: {crashing.result()!r}")
    crashing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await crashing
    held.crashing = False
    return str(next(e.invocation_id for e in await _stored(w) if e.get_function_calls()))


# ------------------------------------------------------------ one reply, mixed


PLACE = {NEW: "before", CACHED: "after", IN_DOUBT: "body"}
"""Where the crashing attempt holds a call of each kind."""


async def _play_reply(case: ReplyCase, folder: Path) -> ReplySeen:
    held = _Held(lambda call_id: PLACE[case.kind(call_id)])
    script = [(call_id, "work", {"n": n}) for n, call_id in enumerate(case.ids)]
    requests = _Requests()

    def opened() -> World:  # a process running the reply
        return requests.add(_world(
            folder, script, service=_sessions(folder),
            hold=lambda call_id: held.hold(call_id, "body"),
            before=[_Holding(held)], ledger=_holding_ledger(held)))

    w = opened()
    await w.open()
    invocation = await _crash(w, held, len(case.kinds))
    before = len(w.ran())
    requests.mark()
    refused_by, refused_did = None, 0
    if case.reload:
        w = opened()
    try:
        events = await run(w.runner, None, invocation_id=invocation)
    except ToolInDoubt as refused:
        refused_by = refused.call_id
        refused_did = len(w.ran()) - before + len(requests.made())
        for call_id in case.of_kind(IN_DOUBT):
            output = (case.settled_text(call_id) if case.settle is Resolution.COMPLETED
                      else None)
            operator.resolve(w.store, RUN, call_id, outcome=case.settle, output=output,
                             by="ops")
        if case.reload:
            w = opened()
        events = await run(w.runner, None, invocation_id=invocation)
    made = requests.made()
    return ReplySeen(refused_by=refused_by, runs=Counter(w.ran()[before:]),
                     sent=[pair for request in made for pair in request],
                     model_calls=len(made), written=await _written(w),
                     completed=_said(events, "done"), refused_did=refused_did)


def _case_id(case: ReplyCase) -> str:
    return f"{case.label}-{case.settle.value}-{'reloaded' if case.reload else 'live'}"


@pytest.mark.invariant("I11", "I12")
@pytest.mark.parametrize("case", every_reply_case(3), ids=_case_id)
def test_every_mix_of_new_cached_and_in_doubt_calls(root: Path, case: ReplyCase) -> None:
    check_reply(case, asyncio.run(_play_reply(case, _folder(root))))


@settings(max_examples=200 if FUZZ else 3, deadline=None)
@given(reply_cases(8))
def test_a_drawn_mix_of_new_cached_and_in_doubt_calls(root: Path, case: ReplyCase) -> None:
    check_reply(case, asyncio.run(_play_reply(case, _folder(root))))


# ------------------------------------------- confirmations beside new and cached calls


async def _play_decisions(case: DecisionMixCase, folder: Path) -> DecisionSeen:
    # a call needing a decision waits before the ledger, not yet asked about
    held = _Held(lambda call_id: "after" if case.kind(call_id) == CACHED else "before")
    script = [(call_id, "work" if case.kind(call_id) in (NEW, CACHED) else "pay",
               {"n": n}) for n, call_id in enumerate(case.ids)]
    requests = _Requests()

    def opened() -> World:
        return requests.add(_world(folder, script, service=_sessions(folder),
                                   before=[_Holding(held)],
                                   ledger=_holding_ledger(held)))

    w = opened()
    await w.open()
    invocation = await _crash(w, held, len(case.kinds))
    before = len(w.ran())
    requests.mark()
    if case.reload:
        w = opened()
    paused = await run(w.runner, None, invocation_id=invocation)
    asked = confirmation_requests(paused)
    parts = [part for call_id, (request, payload) in asked.items()
             for part in response(request, "adk_request_confirmation", {
                 "confirmed": case.kind(call_id) == CONFIRMED,
                 "payload": payload}).parts or ()]
    answered = await run(w.runner, types.Content(role="user", parts=parts))
    made = requests.made()
    return DecisionSeen(
        asked=[call.args["originalFunctionCall"]["id"] for event in [*paused, *answered]
               for call in event.get_function_calls()
               if call.name == "adk_request_confirmation" and call.args],
        runs=Counter(w.ran()[before:]), sent=[pair for request in made for pair in request],
        model_calls=len(made), written=await _written(w), rejection={"error": REJECTED},
        completed=_said(answered, "done"))


@pytest.mark.invariant("I1", "I5")
@pytest.mark.parametrize("case", every_decision_mix_case(3, every_variant_up_to=1),
                         ids=lambda c: f"{c.label}-{'reloaded' if c.reload else 'live'}")
def test_every_mix_of_confirmations_beside_new_and_cached_calls(
        root: Path, case: DecisionMixCase) -> None:
    check_decision_mix(case, asyncio.run(_play_decisions(case, _folder(root))))


@settings(max_examples=200 if FUZZ else 3, deadline=None)
@given(decision_mix_cases(6))
def test_a_drawn_mix_of_confirmations_beside_new_and_cached_calls(
        root: Path, case: DecisionMixCase) -> None:
    check_decision_mix(case, asyncio.run(_play_decisions(case, _folder(root))))


# ------------------------------------------------- a fault after a recorded result


async def _play_fault(case: RecordedFaultCase, folder: Path) -> FaultSeen:
    script = [(case.call_id, "work", {"n": 7})]
    # the append carrying the response fails; the reconciling write at the next open too
    sessions = LosesAppend(_sessions(folder), landed=case.fault == WRITE_LANDED,
                           times=0 if case.fault == REQUEST_FAILED else case.repeats)
    requests = _Requests()
    errors: list[BaseException] = []

    def opened() -> World:
        w = requests.add(_world(folder, script, service=sessions))
        if case.fault == REQUEST_FAILED:
            w.model.failing = case.repeats - len(errors)
        return w

    w = opened()
    await w.open()
    events: list[Any] = []
    invocation = None
    for attempt in range(case.repeats + 1):
        if attempt and case.reload:
            w = opened()
        try:
            events = await run(w.runner, text("go") if invocation is None else None,
                               invocation_id=invocation)
            break
        except (OSError, ModelUnavailable) as error:
            errors.append(error)
            invocation = next(e.invocation_id for e in await _stored(w)
                              if e.get_function_calls())
    injected = ModelUnavailable if case.fault == REQUEST_FAILED else OSError
    return FaultSeen(errors=errors, injected=injected, runs=len(w.ran()),
                     requests=requests.made(),
                     answered=[ok for model in requests.models for ok in model.answered],
                     written=await _written(w), completed=_said(events, "done"))


@pytest.mark.invariant("I6", "I12")
@pytest.mark.parametrize("case", every_recorded_fault_case(),
                         ids=lambda c: f"{c.fault}-x{c.repeats}-"
                         f"{'reloaded' if c.reload else 'live'}")
def test_a_fault_after_the_result_was_recorded(root: Path, case: RecordedFaultCase) -> None:
    check_recorded_fault(case, asyncio.run(_play_fault(case, _folder(root))))


# ---------------------------------------------- a confirmation sent again, after


async def _play_stale(case: StaleStateCase, folder: Path, resumable: bool) -> StaleSeen:
    script = [(case.call_id, "work", {"n": 7})]
    sessions = LosesAppend(_sessions(folder), landed=False, times=0)
    requests = _Requests()

    def opened() -> World:
        return requests.add(_world(folder, script, service=sessions, confirm=True,
                                   resumable=resumable))

    w = opened()
    await w.open()
    request, payload = confirmation_requests(await run(w.runner, text("go")))[case.call_id]
    message = response(request, "adk_request_confirmation",  # what the client keeps
                       {"confirmed": True, "payload": payload})
    if case.moved == DECIDED:  # through the ledger: the session never got it
        operator.approve(w.store, RUN, case.call_id, fingerprint=payload["fingerprint"],
                         by="ops")
    else:
        sessions.times = int(case.moved == RECORDED)  # the response's append refused
        w.model.failing = int(case.moved == WRITTEN)  # the request after it fails
        with contextlib.suppress(OSError, ModelUnavailable):
            await run(w.runner, message)
    if case.reload:
        w = opened()
    requests.mark()
    ran = len(w.ran())
    error: BaseException | None = None
    try:  # the confirmation the client kept, sent again
        await run(w.runner, message)
    except ControlError as refused:
        error = refused
    given = len(requests.made())  # what the attempt given the decision asked and ran
    did = given + len(w.ran()) - ran
    if await _last_answer(w) != ["done"]:  # the run goes on from its ledger with new input
        requests.mark()
        await run(w.runner, text("go on"))
    made = [request for model in requests.models for request in model.seen]
    # a stale decision (one ADK got and acted on) is to change nothing: what the attempt
    # given it did is counted as a refused attempt's; the run completes on new input
    return StaleSeen(runs=len(w.ran()), error=error, completed=await _last_answer(w) == ["done"],
                     replayed=False, model_calls=len(requests.made()) if case.stale else given,
                     refused_did=did if case.stale else 0,
                     sent=[(i, _output(r)) for i, r in made[-1]] if made else [],
                     written=await _written(w))


async def _last_answer(w: World) -> list[str]:
    """The agent's last text in the session (its answer), if any."""
    return [str(part.text) for e in await _stored(w) if e.author != "user" and e.content
            for part in e.content.parts or () if part.text][-1:]


@pytest.mark.invariant("I1", "I2", "I12")
@pytest.mark.parametrize(("case", "resumable"), [
    pytest.param(case, resumable, id=f"{case.moved}-{'reloaded' if case.reload else 'live'}-"
                 f"{'resumable' if resumable else 'not-resumable'}")
    for case in every_stale_state_case(OlderState.RESENT) for resumable in (True, False)])
def test_a_confirmation_sent_again_after_the_run_moved_on(
        root: Path, case: StaleStateCase, resumable: bool) -> None:
    check_stale_state(case, asyncio.run(_play_stale(case, _folder(root), resumable)))


# ------------------------------------------------------------------ one writer


class _Counting(DieBeforeAppend):
    """ADK's ``SqliteSessionService`` on the case's file, counting the events written
    once ``since`` is set (the rival's claim)."""

    def __init__(self, folder: Path) -> None:
        super().__init__(_sessions(folder))
        self.since = False
        self.writes_after = 0

    async def append_event(self, session: Any, event: Any) -> Any:
        written = await self.service.append_event(session, event)
        if self.since and not event.partial:
            self.writes_after += 1
        return written


class _Rival(BasePlugin):
    """After the ledger: ``rival()`` when the first model request is made."""

    def __init__(self, rival: Callable[[], None]) -> None:
        super().__init__(name="rival")
        self.rival: Callable[[], None] | None = rival

    async def before_model_callback(self, *, callback_context: Any,
                                    llm_request: Any) -> Any:
        rival, self.rival = self.rival, None
        if rival is not None:
            rival()
        return None


async def _play_one_writer(case: OneWriterCase, folder: Path) -> OneWriterSeen:
    path = folder / "ledger.db"
    sessions = _Counting(folder)
    script = [(case.call_id, "work", {"n": 7})]
    RunController.start(run_id=RUN, session_id=None, store=SQLiteEventStore(path))

    def rival() -> None:  # another process claims the run, on its own connection
        RunController.load(SQLiteEventStore(path), RUN).claim("rival")
        sessions.since = True

    async def ended(w: World, message: Any, **options: Any) -> str:
        try:
            await run(w.runner, message, **options)
        except ControlError as error:
            return type(error).__name__
        return "completed"

    go = folder / "go"
    after: dict[RivalPoint, list[BasePlugin]] = {LOADED: [world.Hold(folder, go)],
                                                  MODEL_CALL: [_Rival(rival)]}
    first = _world(folder, script, service=sessions, label="first ",
                   during=rival if case.rival_at == TOOL_BODY else None,
                   after=after.get(case.rival_at, []))
    await first.open()
    second = _world(folder, script, service=_sessions(folder), label="rival ")
    if case.rival_at == LOADED:  # both opened the run (loaded, claimed); the rival goes on
        running = asyncio.ensure_future(ended(first, text("go")))
        while not list(folder.glob("opened-*")) and not running.done():
            await asyncio.sleep(0.005)
        sessions.since = True
        rival_outcome = await ended(second, text("go"))
        go.write_text("go")
        first_outcome = await running
    else:
        first_outcome = await ended(first, text("go"))
        invocation = next(e.invocation_id for e in await _stored(first))
        rival_outcome = await ended(second, None, invocation_id=invocation)
    ran = Counter(line.split()[0] for line in first.ran())
    return OneWriterSeen(first_outcome=first_outcome, first_runs=ran["first"],
                         first_model_calls=first.model.requests,
                         first_writes_after=sessions.writes_after,
                         rival_outcome=rival_outcome, rival_runs=ran["rival"],
                         written=await _written(second))


@pytest.mark.invariant("I1", "I7")
@pytest.mark.parametrize("case", [c for c in every_one_writer_case() if c.buffered],
                         ids=lambda c: str(c.rival_at))
def test_one_writer_through_the_adapter(root: Path, case: OneWriterCase) -> None:
    check_one_writer(case, asyncio.run(_play_one_writer(case, _folder(root))))


# ------------------------------------------------------------------ final outputs


class Reachable(pydantic.BaseModel):
    """A structured output whose values JSON lacks and ADK carries: ADK hands the model's
    answer to ``json.dumps``, which takes a tuple, int keys and a NaN (a datetime, a
    Decimal, bytes or a set make ADK alone fail, with or without the adapter)."""

    pair: tuple[int, int]
    names: dict[int, str]
    ratio: float


ANSWER: dict[str, Any] = {"pair": [1, 2], "names": {"1": "one"}, "ratio": math.nan}
STRUCTURED = ("c1", "set_model_response", ANSWER)
"""ADK's own call that carries the structured output, beside the reply's charge."""


class _Recording(SQLiteEventStore):
    """The run's store, keeping each append with the session's events at that moment."""

    def __init__(self, path: Path, service: InMemorySessionService) -> None:
        super().__init__(path)
        self.sessions = service
        self.appends: list[tuple[tuple[Any, ...], dict[str, Any], list[Any]]] = []

    def append(self, *args: Any, **kwargs: Any) -> None:
        session = self.sessions.sessions.get(APP, {}).get(USER, {}).get(SESSION)
        events = [e.model_copy(deep=True) for e in session.events] if session else []
        self.appends.append((args, kwargs, events))
        super().append(*args, **kwargs)


def _structured(folder: Path, service: Any, store: SQLiteEventStore | None = None) -> World:
    w = World(folder, "ledger", [("c0", "charge", {"amount": 5}), STRUCTURED], ["charge"],
              resumable=True, service=service, store=store)
    agent: Any = w.runner.agent
    agent.output_schema = Reachable  # beside a tool: ADK adds set_model_response
    return w


def _answers(events: Sequence[Any]) -> list[str]:
    return [str(part.text) for e in events if e.author != "user" and e.content
            for part in e.content.parts or () if part.text]


async def _play_structured(folder: Path) -> tuple[list[str], set[str]]:
    """The uninterrupted run, then a fresh process for a stop after each durable append
    (the store holding those appends, the session as it was then): what each restart
    did that the case says it must not, as lines (none when all held), and which
    expectations were met."""
    sessions = InMemorySessionService()
    store = _Recording(folder / "events.db", sessions)
    w = _structured(folder, sessions, store)
    await w.open()
    uninterrupted = _answers(await run(w.runner, text("go")))
    assert uninterrupted[-1].startswith('{"pair": [1, 2]')  # ADK's json.dumps of it
    failures, met = [], set()
    for k in range(1, len(store.appends) + 1):
        events = [e for args, _, _ in store.appends[:k] for e in args[1]]
        started = {e.call_id for e in events if isinstance(e, ev.ToolStarted)}
        completed = {e.call_id for e in events if isinstance(e, ev.ToolCompleted)}
        staged = any(isinstance(e, ev.PublicationStaged) for e in events)
        crashed = folder / f"crash-{k}"
        crashed.mkdir()
        restored = SQLiteEventStore(crashed / "ledger.db")
        for args, kwargs, _ in store.appends[:k]:  # what was durable when it stopped
            restored.append(*args, **kwargs)
        service = InMemorySessionService()
        session = await service.create_session(app_name=APP, user_id=USER,
                                               session_id=SESSION)
        for event in store.appends[k - 1][2]:
            await service.append_event(session, event)
        again = _structured(crashed, service)
        invocation = next(e.invocation_id for e in store.appends[k - 1][2])
        try:
            outcome = _answers(await run(again.runner, None, invocation_id=invocation))[-1:]
        except ToolInDoubt as refused:
            outcome = [f"ToolInDoubt {refused.call_id}"]
        # the charge in doubt is refused (I11); else the run ends with the same output,
        # unless its publication was staged: the session then holds (or the reconcile
        # writes) set_model_response's response, and ADK, resuming after it, asks the
        # model again, as it does alone once that response is in the session
        doubt = "c0" in started - completed
        expected = (["ToolInDoubt c0"] if doubt else ["done"] if staged
                    else uninterrupted[-1:])
        met.add("in doubt" if doubt else "staged" if staged else "the output")
        charges = int("c0" in started) + len(again.ran())
        if outcome != expected or charges != 1:
            failures.append(f"stopped after append {k} ({type(events[-1]).__name__}): "
                            f"{outcome} and {charges} charges; expected {expected} and 1")
    return failures, met


@pytest.mark.invariant("I1", "I10")
def test_a_structured_output_stopped_after_every_durable_append(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(controller_module, "SNAPSHOT_EVERY", 1)  # a snapshot every event
    failures, met = asyncio.run(_play_structured(_folder(root)))
    assert failures == []
    assert met == {"the output", "in doubt", "staged"}  # every kind of stop was met
