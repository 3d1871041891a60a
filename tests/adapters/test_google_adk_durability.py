"""The Google ADK adapter across process deaths (DESIGN §6.8, §7.4, issue 30): an agent
on ADK's own ``SqliteSessionService``, driven in child processes
(`tests.drivers.adk_driver`) that kill themselves with SIGKILL at each boundary around a
tool call, then resumed (the invocation the dead process left) by a fresh process; and
two processes resuming the same session at one signal. ADK alone and through the adapter,
the same agent; what ran is counted from the tool's fsynced effects file.

The expected counts come from what the scenario says (one charge was asked for, so it may
happen once; a kill before its effect leaves nothing to count), never from a ledger.

Under CI a missing ``google-adk`` package fails this module instead of skipping it.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

try:
    import google.adk  # noqa: F401
except ImportError:  # pragma: no cover - CI installs the extra
    if os.environ.get("CI"):
        raise
    pytest.skip("google-adk is not installed (pip install -e '.[google-adk]')",
                allow_module_level=True)

from google.adk.plugins.base_plugin import BasePlugin
from google.adk.runners import Runner
from google.adk.sessions.base_session_service import BaseSessionService

from statemachine import ConcurrencyConflict, RunController, SQLiteEventStore
from statemachine.values import Phase
from tests.drivers.adk_driver import APP, RUN, SESSION, USER, build, effects, run

ROOT = Path(__file__).resolve().parents[2]

EFFECT_BEFORE_THE_KILL = {"before-effect": 0, "after-effect": 1, "after-callback": 1,
                          "before-append": 1, "after-append": 1, "model-answer": 1}
"""How many charges happened when the process died there (the kill points of
`tests.drivers.adk_driver`: in the body before and after its effect, in the agent's own
after-tool callback, when the session service is asked to append the function response,
before it, once ADK's session service wrote it, before the ledger recorded the
publication's commit, and when the model is asked again with the response)."""
ALONE_RESUMED = {"before-effect": 1, "after-effect": 2, "after-callback": 2,
                 "before-append": 2, "after-append": 1, "model-answer": 1}
"""ADK alone, the charges in all once the killed invocation is resumed (measured on
google-adk 2.13: it charges again wherever the session lacks the response)."""
IN_DOUBT = {"before-effect", "after-effect", "after-callback"}
"""Where the tool's start is durable and its result is not: the call is in doubt (the
effect may or may not have happened), and the resumed run must say so, never guess. The
ledger records what the agent's own after-tool callback made of the output, so a kill
inside that callback (``after-callback``) leaves the call in doubt too; once recorded, the
result is flushed at once, before ADK makes it an event."""


def _start(folder: Path, mode: str, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.drivers.adk_driver", "--dir", str(folder),
         "--mode", mode, *extra], cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)


def _drive(folder: Path, mode: str, *extra: str) -> int:
    child = _start(folder, mode, *extra)
    _, err = child.communicate(timeout=120)
    assert child.returncode in (0, -9), err
    return child.returncode


def _outcomes(folder: Path) -> list[str]:
    return sorted(json.loads(p.read_text())["result"] for p in folder.glob("outcome-*.json"))


def _stored(folder: Path) -> list[Any]:
    """The events of the session on ADK's ``SqliteSessionService`` file."""
    from google.adk.sessions.sqlite_session_service import SqliteSessionService

    async def read() -> Any:
        return await SqliteSessionService(str(folder / "sessions.db")).get_session(
            app_name=APP, user_id=USER, session_id=SESSION)

    session = asyncio.run(read())
    return list(session.events) if session is not None else []


def _responses(folder: Path, name: str | None = None) -> list[str]:
    """The ids of the tools' function responses in the stored session, in order."""
    return [str(r.id) for e in _stored(folder) if e.author != "user"
            for r in e.get_function_responses() if name is None or r.name == name]


def _texts(folder: Path) -> list[str]:
    """The agent's texts in the stored session, in order."""
    return [str(part.text) for e in _stored(folder) if e.author != "user" and e.content
            for part in e.content.parts or () if part.text]


@pytest.mark.invariant("I1", "I11")
@pytest.mark.parametrize("kill", sorted(EFFECT_BEFORE_THE_KILL))
@pytest.mark.parametrize("mode", ["alone", "ledger"])
def test_a_charge_killed_at_each_boundary_runs_at_most_once_through_the_ledger(
        tmp_path: Path, mode: str, kill: str) -> None:
    """ADK alone, resumed, charges again at every kill point after the effect whose
    response the session lacks (measured: 2 charges at after-effect, after-callback and
    before-append, 1 at before-effect and after-append); through the adapter the charge
    happened at most once, a call in doubt is reported `ToolInDoubt`, and a response the
    session holds (after-append: written, its commit not recorded) is acknowledged, never
    written twice."""
    assert _drive(tmp_path, mode, "--kill", kill) == -9
    assert len(effects(tmp_path / "effects.txt")) == EFFECT_BEFORE_THE_KILL[kill]
    _drive(tmp_path, mode)
    ran = effects(tmp_path / "effects.txt")
    if mode == "alone":
        assert ran == ["charge 5"] * ALONE_RESUMED[kill]
        return
    assert len(ran) == EFFECT_BEFORE_THE_KILL[kill]  # the resume ran nothing
    if kill in IN_DOUBT:
        assert _outcomes(tmp_path) == ["in_doubt"]
        assert RunController.load(SQLiteEventStore(str(tmp_path / "ledger.db")),
                                  RUN).phase("c1") is Phase.STARTED
    else:
        assert _outcomes(tmp_path) == ["ok"]
        assert ran == ["charge 5"]
        assert _responses(tmp_path) == ["c1"]  # I3: one copy, the run went on
        assert _texts(tmp_path)[-1:] == ["done"]
        assert RunController.load(SQLiteEventStore(str(tmp_path / "ledger.db")),
                                  RUN).phase("c1") is Phase.PUBLISHED  # settled
        assert RunController.load(SQLiteEventStore(str(tmp_path / "ledger.db")),
                                  RUN).phase("c1") is Phase.PUBLISHED  # settled


@pytest.mark.invariant("I1", "I12")
def test_without_publications_a_result_is_durable_when_recorded(tmp_path: Path) -> None:
    """When the session appends are not the ledger's publications, the ledger flushes a
    result as it records it (once the agent's own after-tool callback made it): a kill
    when the session service is then asked to append the response (``before-append``)
    leaves the call completed, and the resumed invocation answers it from the ledger and
    goes on, the charge made once."""
    assert _drive(tmp_path, "ledger", "--kill", "before-append", "--no-publications") == -9
    _drive(tmp_path, "ledger", "--no-publications")
    assert effects(tmp_path / "effects.txt") == ["charge 5"]
    assert _outcomes(tmp_path) == ["ok"]


@pytest.mark.invariant("I1", "I12")
@pytest.mark.parametrize("publications", [True, False],
                         ids=["appends-published", "appends-not-published"])
def test_a_kill_while_the_model_is_asked_again_leaves_the_call_completed(
        tmp_path: Path, publications: bool) -> None:
    """The process dies while the model is asked again with the charge's response (the
    longest wait of a turn): the ledger holds the call completed (published with the
    session's appends as its publications), never in doubt, and the resumed invocation
    goes on to the answer, the charge made once."""
    extra = () if publications else ("--no-publications",)
    assert _drive(tmp_path, "ledger", "--kill", "model-answer", *extra) == -9
    assert effects(tmp_path / "effects.txt") == ["charge 5"]
    c = RunController.load(SQLiteEventStore(str(tmp_path / "ledger.db")), RUN)
    assert c.in_doubt() == ()
    assert c.phase("c1") is (Phase.PUBLISHED if publications else Phase.COMPLETED)
    _drive(tmp_path, "ledger", *extra)
    assert _outcomes(tmp_path) == ["ok"]
    assert effects(tmp_path / "effects.txt") == ["charge 5"]
    assert _texts(tmp_path)[-1:] == ["done"]


@pytest.mark.invariant("I1", "I7")
@pytest.mark.parametrize("mode", ["alone", "ledger"])
def test_two_resumers_of_a_killed_session_charge_at_most_once_through_the_ledger(
        tmp_path: Path, mode: str) -> None:
    """The process died before the session append (the charge happened, its response not
    in the session); two processes resume the session at one signal. ADK alone charges
    once per resumer (measured: 3 charges in all; its SqliteSessionService refuses the
    second writer's append with StaleSessionError, after that charge); through the
    adapter the charge stays at one, its response is written once, and each resumer goes
    on or is refused with `ConcurrencyConflict` (never ADK's own StaleSessionError).
    One goes on, except in the narrow schedule of the test below (both refused), after
    which the next resume goes on."""
    assert _drive(tmp_path, mode, "--kill", "before-append") == -9
    go = tmp_path / "go"
    children = [_start(tmp_path, mode, "--wait-for", str(go)) for _ in range(2)]
    # both children imported, opened the session and wait for the signal (a child slower
    # than that would find the other's response written, and ADK alone not charge again)
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("go.ready-*"))) < 2:
        assert time.monotonic() < deadline, "the children never got ready"
        assert all(child.poll() is None for child in children), "a child ended early"
        time.sleep(0.01)
    go.write_text("go")
    for child in children:
        _, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
    ran = effects(tmp_path / "effects.txt")
    if mode == "alone":
        assert ran == ["charge 5"] * 3
        return
    assert ran == ["charge 5"]
    assert set(_outcomes(tmp_path)) <= {"ok", "conflict"}
    if "ok" not in _outcomes(tmp_path):  # the narrow schedule: the next resume goes on
        assert _responses(tmp_path) == ["c1"]
        _drive(tmp_path, mode)
        assert "ok" in _outcomes(tmp_path)
    assert effects(tmp_path / "effects.txt") == ["charge 5"]
    assert _responses(tmp_path) == ["c1"]
    assert _texts(tmp_path)[-1:] == ["done"]


@pytest.mark.invariant("I1", "I5")
@pytest.mark.parametrize(("mode", "kill"), [("alone", "at-decision"),
                                            ("ledger", "before-decision"),
                                            ("ledger", "after-decision")])
def test_a_confirmation_killed_around_its_decision_runs_the_wire_once_when_resumed(
        tmp_path: Path, mode: str, kill: str) -> None:
    """One process asks for the wire's confirmation and sends it; the process dies while
    the confirmation is recorded: through the ledger before the append holding the
    approval, or after it (the call approved, not started); ADK alone, where the
    confirmed call reaches the tool callbacks. A fresh process resumes the invocation:
    the confirmation the session holds is neither lost (the wire runs) nor taken twice
    (it runs once, one approval recorded), alone and through the ledger alike."""
    assert _drive(tmp_path, mode, "--flow", "confirm", "--kill", kill) == -9
    assert effects(tmp_path / "effects.txt") == []  # the kill came before the wire
    store = SQLiteEventStore(str(tmp_path / "ledger.db"))
    if mode == "ledger":  # the kill fell where it says
        expected = Phase.AWAITING if kill == "before-decision" else Phase.APPROVED
        assert RunController.load(store, RUN).phase("w1") is expected
    _drive(tmp_path, mode, "--flow", "confirm")
    assert effects(tmp_path / "effects.txt") == ["wire 7"]
    assert _outcomes(tmp_path) == ["ok"]
    assert _texts(tmp_path)[-1:] == ["done"]
    if mode == "ledger":
        view = RunController.load(store, RUN).call("w1")
        assert view.phase is Phase.PUBLISHED
        assert [(d.kind, d.by) for d in view.decisions] == [("approved", "adk:confirmation")]


def _race(folder: Path, mode: str, *extra: str) -> list[str]:
    """Two resumer processes of the session, each held once its run is open (through the
    ledger: loaded and claimed, or refused there) until both are: they have both read
    the run before either goes on. Their outcomes."""
    go = folder / "go"
    children = [_start(folder, mode, "--hold", str(go), *extra) for _ in range(2)]
    while len(list(folder.glob("opened-*"))) + sum(
            child.poll() is not None for child in children) < 2:
        time.sleep(0.02)  # a wait for both, not a timed assertion
    go.write_text("go")
    for child in children:
        _, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
    return _outcomes(folder)


@pytest.mark.invariant("I1", "I7")
@pytest.mark.parametrize("mode", ["alone", "ledger"])
def test_two_resumers_of_an_approved_unstarted_wire_run_it_once_through_the_ledger(
        tmp_path: Path, mode: str) -> None:
    """The process died with the wire confirmed and not started (through the ledger: its
    approval durable); two processes resume the invocation, both past their load before
    either goes on, so each would run the wire. ADK alone wires twice (measured; its
    SqliteSessionService then refuses the second writer's append, StaleSessionError,
    after the wire); through the adapter exactly one wires and the other is refused with
    `ConcurrencyConflict` (its claim lost the store's race, or a later claim superseded
    it before its tool ran), never ADK's own error."""
    kill = "after-decision" if mode == "ledger" else "at-decision"
    assert _drive(tmp_path, mode, "--flow", "confirm", "--kill", kill) == -9
    assert effects(tmp_path / "effects.txt") == []
    outcomes = _race(tmp_path, mode, "--flow", "confirm")
    if mode == "alone":
        assert effects(tmp_path / "effects.txt") == ["wire 7"] * 2
        return
    assert effects(tmp_path / "effects.txt") == ["wire 7"]
    assert outcomes == ["conflict", "ok"]
    assert _responses(tmp_path, "wire")[-1:] == ["w1"]
    assert RunController.load(SQLiteEventStore(str(tmp_path / "ledger.db")),
                              RUN).phase("w1") is Phase.PUBLISHED


class _Held(BasePlugin):
    """After the ledger's ``before_run_callback`` (its claim): says so, then waits."""

    def __init__(self) -> None:
        super().__init__(name="held")
        self.claimed = asyncio.Event()
        self.go = asyncio.Event()

    async def before_run_callback(self, *, invocation_context: Any) -> None:
        self.claimed.set()
        await self.go.wait()


class _HeldWrite(BaseSessionService):
    """ADK's session service; once a function response is written, says so and waits
    (the writer is between its session write and the ledger's commit)."""

    def __init__(self, service: BaseSessionService) -> None:
        self.service = service
        self.written = asyncio.Event()
        self.go = asyncio.Event()

    async def create_session(self, **options: Any) -> Any:
        return await self.service.create_session(**options)

    async def get_session(self, **options: Any) -> Any:
        return await self.service.get_session(**options)

    async def list_sessions(self, **options: Any) -> Any:
        return await self.service.list_sessions(**options)

    async def delete_session(self, **options: Any) -> None:
        await self.service.delete_session(**options)

    async def append_event(self, session: Any, event: Any) -> Any:
        written = await self.service.append_event(session, event)
        if event.get_function_responses() and not event.partial:
            self.written.set()
            await self.go.wait()
        return written


@pytest.mark.invariant("I1", "I7")
def test_a_resumer_superseded_by_a_later_claim_writes_nothing_and_the_later_one_goes_on(
        tmp_path: Path) -> None:
    """The schedule that left both resumers refused (seen in CI): A claims the killed
    run, B reads the session and claims after it (B supersedes A), then A reaches its
    tool callback. A must stop there, writing nothing (neither the function response
    nor ADK's error event for the refusal), so that B goes on. Reclaiming the run at
    A's tool callback (the bug) superseded B in turn: A wrote the response and lost its
    commit to B's claim, B's append found the session moved on, and neither went on.
    Two runners in one process, each with its own ledger store and ADK session service
    on the same files, stand for the two processes; the gates fix the order."""
    from google.adk.sessions.sqlite_session_service import SqliteSessionService

    from statemachine.adapters.google_adk import LedgerPlugin, OneWriterSessionService

    # the run the resumers find: the call completed, its response not in the session, as
    # a process appending without publications leaves it (its result flushed when
    # recorded; with them the kill leaves the response staged, which the first resumer
    # to open the run settles: the before-append row)
    assert _drive(tmp_path, "ledger", "--kill", "before-append", "--no-publications") == -9
    path = tmp_path / "effects.txt"

    def side() -> tuple[Runner, _Held, _HeldWrite]:
        held = _Held()
        inner = _HeldWrite(SqliteSessionService(str(tmp_path / "sessions.db")))
        plugin = LedgerPlugin(SQLiteEventStore(str(tmp_path / "ledger.db")))
        runner, _, _ = build(path, [("c1", "charge", {"amount": 5})], tools=["charge"],
                             service=OneWriterSessionService(inner, plugin=plugin),
                             plugins=[plugin, held], resumable=True)
        return runner, held, inner

    async def resume(runner: Runner) -> str:
        session = await runner.session_service.get_session(
            app_name=APP, user_id=USER, session_id=SESSION)
        assert session is not None
        pending = [e.invocation_id for e in session.events if e.get_function_calls()]
        try:
            await run(runner, None, invocation_id=pending[-1])
        except ConcurrencyConflict:
            return "conflict"
        return "ok"

    async def scenario() -> tuple[str, str]:
        (ra, a, a_writes), (rb, b, b_writes) = side(), side()
        b_writes.go.set()
        first = asyncio.create_task(resume(ra))
        await a.claimed.wait()
        later = asyncio.create_task(resume(rb))
        await b.claimed.wait()  # B read the session and claimed after A
        a.go.set()
        wrote = asyncio.create_task(a_writes.written.wait())
        await asyncio.wait({first, wrote}, return_when=asyncio.FIRST_COMPLETED)
        b.go.set()
        b_outcome = await later
        a_writes.go.set()
        a_outcome = await first
        wrote.cancel()
        return a_outcome, b_outcome

    a_outcome, b_outcome = asyncio.run(scenario())
    assert effects(path) == ["charge 5"]  # the charge before the kill, never again
    assert (a_outcome, b_outcome) == ("conflict", "ok")

    async def stored() -> Any:
        return await SqliteSessionService(str(tmp_path / "sessions.db")).get_session(
            app_name=APP, user_id=USER, session_id=SESSION)

    events = asyncio.run(stored()).events
    assert [r.id for e in events for r in e.get_function_responses()] == ["c1"]
    assert not [e for e in events if e.error_code]  # A wrote no error event


class _GatedWrite(_HeldWrite):
    """ADK's session service; a function response to be written says so and waits for
    ``go`` before the write (the writer has staged it in the ledger, nothing written)."""

    async def append_event(self, session: Any, event: Any) -> Any:
        if event.get_function_responses() and not event.partial:
            self.written.set()  # here: about to write
            await self.go.wait()
        return await self.service.append_event(session, event)


@pytest.mark.invariant("I1", "I3", "I7")
def test_a_resumer_claiming_while_the_other_writes_leaves_both_refused_and_the_next_goes_on(
        tmp_path: Path) -> None:
    """The narrow schedule in which neither of two resumers goes on: A has staged the
    function response (durable in the ledger) and is about to write it; B reads the
    session, claims (superseding A) and, finding A's write not landed, takes the
    publication over to write it itself. A's write lands first: A's commit is refused
    (B's claim), and B's write is refused as stale by the session service (its copy was
    read before A's write): both get `ConcurrencyConflict`, the response is in the
    session once, and the charge ran once. The next resume acknowledges the write and
    goes on. (A resumer cannot tell a writer that is gone from one still writing: the
    session service's own stale check is what keeps the write single here.)"""
    from google.adk.sessions.sqlite_session_service import SqliteSessionService

    from statemachine.adapters.google_adk import LedgerPlugin, OneWriterSessionService

    # the run the resumers find: the call completed, its response not in the session, as
    # a process appending without publications leaves it (its result flushed when
    # recorded; with them the kill leaves the response staged, which the first resumer
    # to open the run settles: the before-append row)
    assert _drive(tmp_path, "ledger", "--kill", "before-append", "--no-publications") == -9
    path = tmp_path / "effects.txt"

    def side() -> tuple[Runner, _GatedWrite]:
        inner = _GatedWrite(SqliteSessionService(str(tmp_path / "sessions.db")))
        plugin = LedgerPlugin(SQLiteEventStore(str(tmp_path / "ledger.db")))
        runner, _, _ = build(path, [("c1", "charge", {"amount": 5})], tools=["charge"],
                             service=OneWriterSessionService(inner, plugin=plugin),
                             plugins=[plugin], resumable=True)
        return runner, inner

    async def resume(runner: Runner) -> str:
        session = await runner.session_service.get_session(
            app_name=APP, user_id=USER, session_id=SESSION)
        assert session is not None
        pending = [e.invocation_id for e in session.events if e.get_function_calls()]
        try:
            await run(runner, None, invocation_id=pending[-1])
        except ConcurrencyConflict:
            return "conflict"
        return "ok"

    async def scenario() -> tuple[str, str]:
        (ra, a_writes), (rb, b_writes) = side(), side()
        first = asyncio.create_task(resume(ra))
        await a_writes.written.wait()  # A staged the response, about to write it
        later = asyncio.create_task(resume(rb))
        await b_writes.written.wait()  # B claimed and took the publication over
        a_writes.go.set()
        a_outcome = await first
        b_writes.go.set()
        return a_outcome, await later

    assert asyncio.run(scenario()) == ("conflict", "conflict")
    assert effects(path) == ["charge 5"]
    assert _responses(tmp_path) == ["c1"]  # A's write, once
    _drive(tmp_path, "ledger")  # the next resume, in a fresh process
    assert _outcomes(tmp_path) == ["ok"]
    assert effects(path) == ["charge 5"]
    assert _responses(tmp_path) == ["c1"]
    assert _texts(tmp_path)[-1:] == ["done"]


@pytest.mark.invariant("I1", "I7")
def test_a_resumer_whose_message_is_refused_never_supersedes_the_one_that_wrote_it(
        tmp_path: Path) -> None:
    """Two resumers of one confirmation (each sends it as the user's message): B reads
    the session for its message's check before A's message lands, then waits; A writes
    its message and claims the run (its ``before_run_callback``); B goes on, finds
    nothing to settle and has its message refused as stale. B must have appended
    nothing: settling claimed the run and flushed the claim alone, which superseded A,
    whose tool callback was then refused too, and the wire never ran (neither went on).
    Two runners in one process, each with its own ledger store and ADK session service
    on the same files, stand for the two processes; the gates fix the order."""
    from google.adk.sessions.sqlite_session_service import SqliteSessionService

    from statemachine.adapters.google_adk import LedgerPlugin, OneWriterSessionService
    from tests.drivers.adk_driver import confirmation_requests, response, text

    path = tmp_path / "effects.txt"

    def side(*plugins: BasePlugin) -> tuple[Runner, LedgerPlugin]:
        plugin = LedgerPlugin(SQLiteEventStore(str(tmp_path / "ledger.db")))
        service = OneWriterSessionService(
            SqliteSessionService(str(tmp_path / "sessions.db")), plugin=plugin)
        runner, _, _ = build(path, [("w1", "wire", {"amount": 7})], tools=["wire"],
                             service=service, plugins=[plugin, *plugins], resumable=True)
        return runner, plugin

    async def attempt(runner: Runner, message: Any) -> str:
        try:
            await run(runner, message)
        except ConcurrencyConflict:
            return "conflict"
        return "ok"

    async def scenario() -> tuple[str, str]:
        starter, _ = side()
        await starter.session_service.create_session(app_name=APP, user_id=USER,
                                                     session_id=SESSION)
        request, payload = confirmation_requests(await run(starter, text("go")))["w1"]
        confirm = response(request, "adk_request_confirmation",
                           {"confirmed": True, "payload": payload})
        a = _Held()
        ra, _ = side(a)
        rb, b_plugin = side()
        b_checked = asyncio.Event()
        settle = b_plugin._settle

        async def b_settles(session: Any, service: BaseSessionService) -> None:
            b_checked.set()  # B's check read the session without A's message
            await a.claimed.wait()
            await settle(session, service)

        b_plugin._settle = b_settles  # type: ignore[method-assign]
        later = asyncio.create_task(attempt(rb, confirm))
        await b_checked.wait()
        first = asyncio.create_task(attempt(ra, confirm))
        await a.claimed.wait()  # A's message written, the run claimed
        b_outcome = await later
        a.go.set()
        return await first, b_outcome

    assert asyncio.run(scenario()) == ("ok", "conflict")
    assert effects(path) == ["wire 7"]
    assert RunController.load(SQLiteEventStore(str(tmp_path / "ledger.db")),
                              RUN).phase("w1") is Phase.PUBLISHED
