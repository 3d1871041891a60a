"""The adapter corners of `statemachine.testing.adapter_corners` (issue 32) played through
the Anthropic adapter's `LedgerSessionToolRunner` (the SDK's managed-session tool runner),
offline: the session is `tests.drivers.anthropic_driver.FakeSession`, served through the
SDK's own HTTP layer into a local ``httpx2.MockTransport``. Each case is checked against
what the case alone says; what the model is sent is what lands in the session (the
result posts), and the model is the session's agent, which takes its next turn once every
call is answered (the session then ends):

* the mixes and orders of new, cached and in-doubt calls in one reply that this runner
  can reach: it refuses every iteration while a call is in doubt, and the SDK runs a
  reply's calls one at a time, so a reply holds at most one in doubt (every mix of up to
  three calls with at most one in doubt; drawn ones up to eight in ``just fuzz``). The
  calls are built-in agent tools: a new call awaits the user's confirmation
  (``evaluated_permission: ask``) while the attempts before the crash run the others, a
  cached call's post is rejected (its result recorded, never landed), and the call in
  doubt, allowed after them, dies in its body. Then the user allows the new calls and the
  run is resumed, from the store or by the same runner;
* a result post that fails after the result was recorded (rejected, once or twice; or
  landed, then failed): the SDK never raises a post's error, it yields the call with
  ``posted=False``; the caller here ends its attempt there (`Unposted`), and the next
  attempt, from the store or by the same runner, goes on;
* a rival claiming the run (another connection to the SQLite file): both runners opened
  from the same version and the rival iterating first, or the rival claiming while the
  first waits on the session (its stream just opened) or runs its tool body.

Not played here, as this runner cannot reach them: a failing *model request* (the agent
runs on the server; the runner sends none), an older SDK state (the runner keeps none
between iterations: each reads the session's history from the server, so an older runner
is only one a rival superseded, the one-writer cases), and final outputs (the session's
answer is the server's; the ledger records only that the session ended).

Under CI a missing ``anthropic`` package fails this module instead of skipping it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import assume, given, settings

try:
    import anthropic  # noqa: F401
except ImportError:  # pragma: no cover - CI installs the extra
    from tests.helpers import missing_extra

    missing_extra("anthropic")

from anthropic.lib.tools import beta_async_tool

from statemachine import ControlError, RunController, SQLiteEventStore, ToolInDoubt, tool_context
from statemachine.adapters.anthropic import LedgerSessionToolRunner
from statemachine.testing import (
    FaultSeen,
    OneWriterCase,
    OneWriterSeen,
    RecordedFault,
    RecordedFaultCase,
    ReplyCase,
    ReplySeen,
    check_one_writer,
    check_recorded_fault,
    check_reply,
    every_one_writer_case,
    every_recorded_fault_case,
    every_reply_case,
    reply_cases,
)
from statemachine.testing.adapter_corners import (
    CACHED,
    IN_DOUBT,
    LOADED,
    MODEL_CALL,
    NEW,
    TOOL_BODY,
    WRITE_LANDED,
)
from statemachine.values import Resolution
from tests.drivers.anthropic_driver import (
    SESSION_ID,
    FakeSession,
    PostFault,
    agent_tool_use,
    answered_id,
    client_for,
)
from tests.helpers import crash_folder

FUZZ = os.environ.get("HYPOTHESIS_PROFILE") == "fuzz"
RESULTS = ("user.tool_result", "user.custom_tool_result")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with crash_folder(tmp_path_factory, "an-session-corners") as folder:
        yield folder


def _folder(root: Path) -> Path:
    """A fresh folder for one case's SQLite files."""
    return Path(tempfile.mkdtemp(dir=root))


def _text(event: dict[str, Any]) -> Any:
    """A result event's content: its one text block's text."""
    content = event.get("content")
    if isinstance(content, list) and len(content) == 1 and content[0].get("type") == "text":
        return content[0]["text"]
    return content


def _landed(server: FakeSession) -> list[tuple[str, Any]]:
    """The (call id, output) pairs of the result events the session holds."""
    return [(str(answered_id(e)), _text(e)) for e in server.events if e["type"] in RESULTS]


def _ends(server: FakeSession) -> int:
    """The agent's turns after its calls were answered: each ends the session here."""
    return sum(e["type"] == "session.status_terminated" for e in server.events)


class Crash(BaseException):
    """The process dying inside a tool body."""


def _work(runs: Counter[str], dying: set[str], *,
          during: Callable[[], None] | None = None) -> Any:
    @beta_async_tool
    async def work(n: int) -> str:
        """Do the n-th piece of work."""
        call_id = tool_context().call_id
        runs[call_id] += 1
        if during is not None:
            during()
        if call_id in dying:
            raise Crash
        return ReplyCase.result_text(call_id)

    return work


async def _drive(runner: LedgerSessionToolRunner) -> list[bool]:
    """Iterate the runner to its end: whether each call it yields was posted."""
    return [call.posted async for call in runner]


async def _completed(server: FakeSession, opened: Callable[[], Any]) -> bool:
    """Whether the run completed, as a new runner on the store says: it iterates nothing
    and opens no stream (``replayed``)."""
    opens = server.stream_opens
    runner = await opened()
    seen = await _drive(runner)
    return runner.replayed and not seen and server.stream_opens == opens


# ------------------------------------------------------------ one reply, mixed


def _reachable(case: ReplyCase) -> bool:
    """At most one call in doubt: the runner refuses every iteration once one is."""
    return case.kinds.count(IN_DOUBT) <= 1


async def _play_reply(case: ReplyCase, folder: Path) -> ReplySeen:
    runs: Counter[str] = Counter()
    dying = set(case.of_kind(IN_DOUBT))
    server = FakeSession([agent_tool_use(call_id, "work", {"n": n},
                                         ask=case.kind(call_id) in (NEW, IN_DOUBT))
                          for n, call_id in enumerate(case.ids)])
    server.refusing = set(case.of_kind(CACHED))
    tools = [_work(runs, dying)]

    async def opened() -> LedgerSessionToolRunner:  # as a new process opens it
        return await LedgerSessionToolRunner.open(
            client_for(server), SESSION_ID, tools=tools, run_id="reply",
            store=SQLiteEventStore(folder / "events.db"), max_idle=None)

    runner = await opened()
    cached = case.of_kind(CACHED)
    if cached:  # an attempt runs them; their posts are rejected; the others await the user
        yielded = []
        async with contextlib.aclosing(runner.__aiter__()) as calls:
            async for call in calls:
                yielded.append((call.tool_use_id, call.posted))
                if len(yielded) == len(cached):
                    break  # the process stops
        assert yielded == [(call_id, False) for call_id in cached], yielded
    if dying:  # the user allows the call in doubt; the next attempt dies in its body
        server.confirm(sorted(dying))
        if case.reload:
            runner = await opened()
        with pytest.raises((Crash, BaseExceptionGroup)) as died:
            await _drive(runner)
        if isinstance(died.value, BaseExceptionGroup):
            assert died.group_contains(Crash)
    dying.clear()
    runs.clear()
    server.refusing.clear()
    server.confirm(case.of_kind(NEW))  # the user allows the new calls
    posts, ends = len(server.posts), _ends(server)

    refused_by, refused_did = None, 0
    if case.reload:
        runner = await opened()
    try:
        await _drive(runner)
    except ToolInDoubt as refused:
        refused_by = refused.call_id
        refused_did = sum(runs.values()) + len(server.posts) - posts
        for call_id in case.of_kind(IN_DOUBT):
            output = (case.settled_text(call_id) if case.settle is Resolution.COMPLETED
                      else None)
            await runner.resolve_in_doubt(call_id, output, outcome=case.settle, by="ops")
        if case.reload:
            runner = await opened()
        await _drive(runner)
    sent = [(str(answered_id(post)), _text(post)) for post in server.posts[posts:]]
    return ReplySeen(refused_by=refused_by, runs=dict(runs), sent=sent,
                     model_calls=_ends(server) - ends, written=_landed(server),
                     completed=await _completed(server, opened), refused_did=refused_did)


def _case_id(case: ReplyCase) -> str:
    return f"{case.label}-{case.settle.value}-{'reloaded' if case.reload else 'live'}"


@pytest.mark.invariant("I11", "I12")
@pytest.mark.parametrize("case", [c for c in every_reply_case(3) if _reachable(c)],
                         ids=_case_id)
def test_every_reachable_mix_of_new_cached_and_in_doubt_calls(root: Path,
                                                              case: ReplyCase) -> None:
    check_reply(case, asyncio.run(_play_reply(case, _folder(root))))


@settings(max_examples=200 if FUZZ else 3, deadline=None)
@given(reply_cases(8))
def test_a_drawn_mix_of_new_cached_and_in_doubt_calls(root: Path, case: ReplyCase) -> None:
    assume(_reachable(case))
    check_reply(case, asyncio.run(_play_reply(case, _folder(root))))


# ---------------------------------------------- a result post failing after its record


class Unposted(Exception):
    """The caller's end of an attempt whose call the SDK yielded unposted."""


async def _play_fault(case: RecordedFaultCase, folder: Path) -> FaultSeen:
    runs: Counter[str] = Counter()
    faults = ([PostFault("land-then-500")] if case.fault == WRITE_LANDED else
              [PostFault("reject")] * case.repeats)
    server = FakeSession([agent_tool_use("c0", "work", {"n": 0})], faults=faults)
    tools = [_work(runs, set())]

    async def opened() -> LedgerSessionToolRunner:
        return await LedgerSessionToolRunner.open(
            client_for(server), SESSION_ID, tools=tools, run_id="fault",
            store=SQLiteEventStore(folder / "events.db"), max_idle=None)

    runner = await opened()
    errors: list[BaseException] = []
    for attempt in range(case.repeats + 1):
        if attempt and case.reload:
            runner = await opened()
        try:
            async with contextlib.aclosing(runner.__aiter__()) as calls:
                async for call in calls:
                    if not call.posted:  # the SDK's word for a post that did not land
                        raise Unposted(call.tool_use_id)
            break
        except Unposted as error:
            errors.append(error)
    landed = _landed(server)
    # the agent's turns: the reply, then the one the landed results start
    return FaultSeen(errors=errors, injected=Unposted, runs=runs["c0"],
                     requests=[[], landed], answered=[True, True], written=landed,
                     completed=await _completed(server, opened))


@pytest.mark.invariant("I1", "I12")
@pytest.mark.parametrize("case", [c for c in every_recorded_fault_case()
                                  if c.fault is not RecordedFault.REQUEST_FAILED],
                         ids=lambda c: f"{c.fault}-x{c.repeats}-"
                         f"{'reloaded' if c.reload else 'live'}")
def test_a_post_failing_after_the_result_was_recorded(root: Path,
                                                      case: RecordedFaultCase) -> None:
    check_recorded_fault(case, asyncio.run(_play_fault(case, _folder(root))))


# ------------------------------------------------------------------ one writer


async def _play_one_writer(case: OneWriterCase, folder: Path) -> OneWriterSeen:
    path = folder / "events.db"
    RunController.start(run_id="one", session_id=None, store=SQLiteEventStore(path))
    server = FakeSession([agent_tool_use("c0", "work", {"n": 0})])
    claimed_at: list[int] = []

    def rival() -> None:  # another process claims the run, on its own connection
        RunController.load(SQLiteEventStore(path), "one").claim("rival")
        claimed_at.append(len(server.posts))

    if case.rival_at == MODEL_CALL:  # while the first waits on the session's agent
        server.on_stream = lambda: None if claimed_at else rival()
    first_runs: Counter[str] = Counter()
    rival_runs: Counter[str] = Counter()

    async def opened(runs: Counter[str], owner: str, *,
                     during: Callable[[], None] | None = None) -> LedgerSessionToolRunner:
        return await LedgerSessionToolRunner.open(
            client_for(server), SESSION_ID, tools=[_work(runs, set(), during=during)],
            run_id="one", store=SQLiteEventStore(path), owner=owner,
            buffered=case.buffered, max_idle=None)

    async def ended(runner: LedgerSessionToolRunner) -> str:
        try:
            await _drive(runner)
        except ControlError as error:
            return type(error).__name__
        return "completed"

    first = await opened(first_runs, "first",
                         during=rival if case.rival_at == TOOL_BODY else None)
    if case.rival_at == LOADED:  # both loaded the same version; the rival goes first
        second = await opened(rival_runs, "rival")
        rival_outcome = await ended(second)
        claimed_at.append(len(server.posts))
        opens = server.stream_opens
        first_outcome = await ended(first)
        first_waits = server.stream_opens - opens
    else:
        first_outcome = await ended(first)
        first_waits = server.stream_opens
        server.on_stream = None
    assert claimed_at, "the rival never claimed the run"
    first_writes_after = len(server.posts) - claimed_at[0]  # posts since the rival's claim
    if case.rival_at != LOADED:  # the rival resumes the run the first attempt left
        rival_outcome = await ended(await opened(rival_runs, "rival"))
    return OneWriterSeen(first_outcome=first_outcome, first_runs=first_runs["c0"],
                         first_model_calls=first_waits,
                         first_writes_after=first_writes_after,
                         rival_outcome=rival_outcome, rival_runs=rival_runs["c0"],
                         written=_landed(server))


@pytest.mark.invariant("I1", "I7")
@pytest.mark.parametrize("case", every_one_writer_case(),
                         ids=lambda c: f"{c.rival_at}-{'buffered' if c.buffered else 'per-event'}")
def test_one_writer_through_the_session_runner(root: Path, case: OneWriterCase) -> None:
    check_one_writer(case, asyncio.run(_play_one_writer(case, _folder(root))))
