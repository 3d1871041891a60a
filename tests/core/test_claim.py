"""``claim(owner)``: the first command of every attempt on an existing run (DESIGN §6.3).

It records `RunClaimed` in every live step, UNSETTLED included, and changes nothing else;
it is refused, with nothing changed, where every attempt is refused. With a store bound
it is appended with the expected version: of attempts that loaded one version exactly
one claims, the others get `ConcurrencyConflict` before any effect, and an attempt whose
claim was superseded is refused on its next append. The reference runner claims before
anything else; real worker processes racing on one SQLite store prove it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from queue import Empty, Queue
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from statemachine import (
    Action,
    ConcurrencyConflict,
    InvalidTransition,
    MemoryEventStore,
    RecoveryPolicy,
    RunController,
    RunNotResumable,
    SchemaError,
    SQLiteEventStore,
    Step,
    ToolCall,
    ToolInDoubt,
)
from statemachine import events as ev
from statemachine.controller import RESERVED_EVENTS
from statemachine.runner import Runner
from statemachine.sessions import MemorySession, SQLiteSession
from statemachine.stores import EventStore
from statemachine.testing.invariants import check_log
from tests.drivers import claim_driver
from tests.helpers import (
    SESSION,
    TEST_NOW,
    B,
    P,
    assert_refused,
    at_interruption,
    failed,
    reloaded,
    staged,
)
from tests.strategies import drive

ROOT = Path(__file__).resolve().parents[2]


def picture(c: RunController) -> tuple[Any, ...]:
    """Everything but the log itself: what a claim must leave exactly as it was."""
    return (c.state.view()[:-1], c.step, c.envelope, c.pending_approvals,
            c.guardrail_results, c.pending_guardrail_results, c.next_action(),
            c.holds_attempt, c.in_doubt(), c.in_flight, c.calls, c.runnable_call_ids(),
            c.unpublished_call_ids())


def _claimed(c: RunController, owner: str | None) -> None:
    before_events, before = c.events, picture(c)
    c.claim(owner)
    assert c.events == (*before_events, ev.RunClaimed(len(before_events), owner, at=TEST_NOW))
    assert picture(c) == before
    again = reloaded(c)
    assert again.state == c.state
    assert again.events == c.events


# ------------------------------------------------------------- one per live step


def _run_again() -> RunController:
    return RunController.start(run_id="r", session_id=SESSION)


def _awaiting_model() -> RunController:
    c = _run_again()
    c.begin_model_call()
    return c


def _tools() -> RunController:
    c = at_interruption()
    c.approve("charge")
    c.resume()
    return c


def _finalizing(session_id: str | None = None) -> RunController:
    c = RunController.start(run_id="r", session_id=session_id)
    c.begin_model_call()
    c.model_responded([], output="the answer")
    return c


def _final_output() -> RunController:
    c = _finalizing(SESSION)
    c.accept_final_output("the answer")
    return c


def _handoff() -> RunController:
    c = _run_again()
    c.handoff("billing")
    return c


LIVE: dict[str, Callable[[], RunController]] = {
    "run_again": _run_again,
    "awaiting_model": _awaiting_model,
    "interruption": at_interruption,
    "tools": _tools,
    "finalizing": _finalizing,
    "final_output": _final_output,
    "handoff": _handoff,
    "unsettled_reconcile": failed,
    "unsettled_held_attempt": staged,
    "unsettled_foreign_attempt": lambda: reloaded(staged()),
}


def test_the_live_cases_cover_every_live_step() -> None:
    from statemachine.values import LIVE_STEPS

    assert {make().step for make in LIVE.values()} == set(LIVE_STEPS)


@pytest.mark.parametrize("owner", ["worker-1", None, "", "wörker ☃"])
@pytest.mark.parametrize("case", list(LIVE))
def test_claim_records_run_claimed_in_every_live_step_and_changes_nothing_else(
    case: str, owner: str | None,
) -> None:
    c = LIVE[case]()
    _claimed(c, owner)
    _claimed(c, "a second claim")  # claims repeat freely: each attempt makes one


@pytest.mark.invariant("I2")
def test_a_claim_while_unsettled_leaves_the_attempt_where_it_was() -> None:
    held = staged()
    held.claim("same process")
    assert held.holds_attempt
    assert held.next_action() is Action.PUBLISH
    held.publication_committed()  # the attempt it held is still its own
    assert held.step is Step.INTERRUPTION

    foreign = reloaded(staged())
    foreign.claim("another process")
    with pytest.raises(Exception, match="an attempt may still be writing"):
        foreign.reconcile(P, SESSION)  # a claim is no take-over

    settled = failed()
    settled.claim(None)
    settled.reconcile(P + B, SESSION)
    assert settled.step is Step.INTERRUPTION
    check_log(settled.events)  # RunClaimed is allowed while unsettled (I2)


# --------------------------------------------------------------------- refusals


def _lossy_unsettled() -> RunController:
    c = _finalizing(SESSION)
    c.accept_final_output("the answer", lossless=False)
    c.stage_publication([{"role": "assistant", "content": "the answer"}], [])
    return c


def _completed() -> RunController:
    c = _finalizing()
    c.accept_final_output("the answer")
    c.complete()
    return c


def _abandoned() -> RunController:
    c = at_interruption()
    c.abandon("operator gave up")
    return c


REFUSING: dict[str, Callable[[], RunController]] = {
    "fail_closed_unsettled": lambda: reloaded(staged(RecoveryPolicy.FAIL_CLOSED)),
    "fail_closed_unsettled_held_attempt": lambda: staged(RecoveryPolicy.FAIL_CLOSED),
    "lossy_output_unsettled": lambda: reloaded(_lossy_unsettled()),
    "completed": _completed,
    "terminal": _abandoned,
}


@pytest.mark.invariant("I9")
@pytest.mark.parametrize("owner", ["worker-1", None, 7])
@pytest.mark.parametrize("case", list(REFUSING))
def test_claim_is_refused_where_no_attempt_may_go_on(case: str, owner: Any) -> None:
    c = REFUSING[case]()
    error = assert_refused(c, RunNotResumable, c.claim, owner)  # the gate comes first
    assert error.action == "claim"
    assert c.next_action() is (Action.PUBLISH if case.endswith("held_attempt")
                               else Action.NOT_RESUMABLE)


def test_a_fail_closed_attempt_that_saw_its_write_succeed_still_commits() -> None:
    c = staged(RecoveryPolicy.FAIL_CLOSED)
    assert_refused(c, RunNotResumable, c.claim, "me")
    c.publication_committed()
    _claimed(c, "me")


def test_an_unsettled_fail_closed_run_can_still_be_abandoned() -> None:
    c = reloaded(staged(RecoveryPolicy.FAIL_CLOSED))
    assert_refused(c, RunNotResumable, c.claim, None)
    c.abandon("repair impossible")
    assert_refused(c, RunNotResumable, c.claim, None)


@pytest.mark.parametrize("owner", [7, b"worker", ["w"], {"w": 1}, 1.5, True, "\ud800",
                                   "w\udfff"])
@pytest.mark.parametrize("case", ["interruption", "unsettled_reconcile"])
def test_an_owner_that_is_not_valid_text_is_a_schema_error(case: str, owner: Any) -> None:
    c = LIVE[case]()
    error = assert_refused(c, SchemaError, c.claim, owner)
    assert "owner" in str(error)


def test_claim_needs_ordinary_room_under_max_events_never_the_reserve() -> None:
    limit = 12
    c = RunController.start(run_id="r", session_id=SESSION, max_events=limit)
    while limit - c.version > RESERVED_EVENTS + 1:
        c.add_input([{"role": "user", "content": "more"}])
    c.claim("last ordinary room")
    assert limit - c.version == RESERVED_EVENTS
    assert_refused(c, SchemaError, c.claim, "into the reserve")
    c.abandon("closing still fits")

    log = failed().to_json()
    events = len(log["events"])
    for room in range(2, RESERVED_EVENTS + 1):
        c = RunController.from_json(log, max_events=events + room)
        assert_refused(c, SchemaError, c.claim, None)
        assert c.next_action() is Action.RECONCILE
        c.reconcile(P + B, SESSION)  # settling uses the reserve; a claim never does
    c = RunController.from_json(log, max_events=events + RESERVED_EVENTS + 1)
    _claimed(c, None)


# ------------------------------------------------------------ replay and codec


def test_a_log_with_claims_replays_and_round_trips() -> None:
    c = failed()
    c.claim("worker-a")
    c.reconcile(P + B, SESSION)
    c.claim(None)
    c.approve("notify")
    c.claim("worker-b")
    c.resume()
    doc = c.to_json()
    assert doc["schema_version"] == 3
    text = json.dumps(doc, sort_keys=True)
    again = RunController.from_json(text)
    assert again.state == c.state
    assert again.events == c.events
    assert json.dumps(again.to_json(), sort_keys=True) == text
    claims = [e for e in doc["events"] if e["type"] == "RunClaimed"]
    assert [e["owner"] for e in claims] == ["worker-a", None, "worker-b"]
    check_log(again.events)


@pytest.mark.invariant("I10")
@pytest.mark.parametrize("make", [lambda: staged(RecoveryPolicy.FAIL_CLOSED), _completed,
                                  _abandoned], ids=["fail_closed", "completed", "terminal"])
def test_a_forged_claim_where_no_attempt_may_go_on_is_rejected_on_load(
    make: Callable[[], RunController],
) -> None:
    doc = make().to_json()
    events: list[Any] = doc["events"]
    events.append({"type": "RunClaimed", "seq": len(events), "at": TEST_NOW,
                   "owner": "forger", "lease": None})
    with pytest.raises(InvalidTransition, match=rf"event {len(events) - 1} \(RunClaimed\) "
                                                "is forbidden here") as info:
        RunController.from_json(doc)
    assert "forger" not in str(info.value)


def test_store_reload_of_claims_equals_full_replay(tmp_path: Path) -> None:
    store = SQLiteEventStore(tmp_path / "events.db")
    c = at_interruption(store=store)
    for n in range(40):  # past a snapshot or two
        c.claim(f"attempt-{n}")
    loaded = RunController.load(store, c.run_id)
    assert loaded.state == c.state == RunController.from_json(c.to_json()).state
    assert loaded.events == c.events


@given(st.data())
def test_any_reachable_run_claims_or_refuses_with_nothing_changed(data: st.DataObject) -> None:
    c = drive(data).c
    envelope = c.state.envelope
    refused = c.step in (Step.COMPLETED, Step.TERMINAL_UNRECOVERABLE) or (
        envelope is not None and envelope.fail_closed)
    if refused:
        assert_refused(c, RunNotResumable, c.claim, "w")
        return
    _claimed(c, data.draw(st.sampled_from([None, "w"]), label="owner"))


# ------------------------------------------------- optimistic concurrency (store)


@pytest.fixture(params=["memory", "sqlite"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[EventStore]:
    if request.param == "memory":
        yield MemoryEventStore()
        return
    sqlite_store = SQLiteEventStore(tmp_path / "events.db")
    yield sqlite_store
    sqlite_store.close()


def _paused(store: EventStore) -> RunController:
    c = at_interruption(store=store)
    c.approve("charge", fingerprint=c.fingerprint("charge"))
    return c


@pytest.mark.invariant("I7")
def test_of_two_controllers_loaded_at_one_version_exactly_one_claims(store: EventStore) -> None:
    paused = _paused(store)
    first = RunController.load(store, paused.run_id)
    second = RunController.load(store, paused.run_id)
    assert first.version == second.version == paused.version
    first.claim("first")
    error = assert_refused(second, ConcurrencyConflict, second.claim, "second")
    assert error.action == "claim"
    assert second.version == paused.version
    log = store.load(paused.run_id)
    assert [e.owner for e in log if isinstance(e, ev.RunClaimed)] == ["first"]
    # the loser can do nothing else either: its every append meets the winner's claim
    assert_refused(second, ConcurrencyConflict, second.resume)
    assert_refused(second, ConcurrencyConflict, second.approve, "audit")
    first.resume()
    assert first.step is Step.TOOLS
    # reloading shows the winner's claim; claiming again is a new attempt
    third = RunController.load(store, paused.run_id)
    assert third.events == first.events
    third.claim("third")


@pytest.mark.invariant("I7")
def test_a_superseded_claim_is_refused_on_its_next_append(store: EventStore) -> None:
    paused = _paused(store)
    stale = RunController.load(store, paused.run_id)
    stale.claim("stale")
    newer = RunController.load(store, paused.run_id)
    newer.claim("newer")
    for command, args in ((stale.resume, ()), (stale.claim, ("stale again",)),
                          (stale.abandon, ("stale",)), (stale.reject, ("audit",))):
        error = assert_refused(stale, ConcurrencyConflict, command, *args)
        assert error.run_id == paused.run_id
    newer.resume()
    assert [type(e).__name__ for e in store.load(paused.run_id)][paused.version:] == [
        "RunClaimed", "RunClaimed", "Resumed"]


def test_a_claim_with_a_store_bound_is_appended_before_it_is_applied(
        store: EventStore) -> None:
    """What makes a claim a claim: an accepted claim is in the store when claim returns."""
    paused = _paused(store)
    paused.claim("me")
    assert store.load(paused.run_id)[-1] == ev.RunClaimed(paused.version - 1, "me", at=TEST_NOW)


# ------------------------------------------------------------ the reference runner


def _paused_runner_run(store: EventStore, variant: str,
                       session: MemorySession) -> RunController:
    agent, hooks = claim_driver.build(None)
    first = asyncio.run(Runner.run(agent, "pay 7", session=session, store=store,
                                   run_id=claim_driver.RUN_ID, hooks=hooks))
    c = first.controller
    c.approve("pay")
    if variant == "tools":
        c.claim("died")
        c.resume()
    return c


def _resume(mode: str, agent: Any, hooks: Any, session: MemorySession,
            **source: Any) -> Any:
    async def go() -> Any:
        if mode == "streamed":
            streamed = Runner.run_streamed(agent, session=session, hooks=hooks, **source)
            async for _ in streamed.stream_events():
                pass
            return streamed.result
        return await Runner.run(agent, session=session, hooks=hooks, **source)

    return asyncio.run(go())


def test_a_run_the_runner_starts_holds_no_claim() -> None:
    agent, hooks = claim_driver.build(None)
    store = MemoryEventStore()
    result = asyncio.run(Runner.run(agent, "pay 7", session=MemorySession(SESSION),
                                    store=store, run_id="fresh", hooks=hooks))
    assert not [e for e in result.controller.events if isinstance(e, ev.RunClaimed)]


@pytest.mark.parametrize("mode", ["run", "streamed"])
@pytest.mark.parametrize("source", ["controller", "state", "store"])
def test_the_runner_claims_first_on_every_resumed_attempt(source: str, mode: str) -> None:
    store = MemoryEventStore()
    session = MemorySession(SESSION)
    c = _paused_runner_run(store, "interruption", session)
    paused = c.version
    every: dict[str, dict[str, Any]] = {"controller": {"controller": c},
                                        "state": {"state": c.to_json()},
                                        "store": {"store": store, "run_id": c.run_id}}
    sources = every[source]
    owner = {"controller": "worker-7", "state": None, "store": "worker-8"}[source]
    if owner is not None:
        sources["owner"] = owner
    agent, hooks = claim_driver.build(None)
    result = _resume(mode, agent, hooks, session, **sources)
    assert result.step is Step.COMPLETED
    new = result.controller.events[paused:]
    assert new[0] == ev.RunClaimed(paused, owner, at=TEST_NOW)
    assert type(new[1]) is ev.Resumed
    assert not [e for e in new[1:] if isinstance(e, ev.RunClaimed)]


@pytest.mark.invariant("I1", "I7")
@pytest.mark.parametrize("mode", ["run", "streamed"])
@pytest.mark.parametrize("variant", ["interruption", "tools"])
def test_the_runner_that_loses_the_claim_runs_nothing(tmp_path: Path, variant: str,
                                                      mode: str) -> None:
    store = MemoryEventStore()
    session = MemorySession(SESSION)
    paused = _paused_runner_run(store, variant, session)
    winner = RunController.load(store, paused.run_id)
    loser = RunController.load(store, paused.run_id)
    agent, hooks = claim_driver.build(tmp_path / "winner.txt")
    assert _resume(mode, agent, hooks, session, controller=winner).step is Step.COMPLETED
    agent, hooks = claim_driver.build(tmp_path / "loser.txt")
    before = loser.events
    with pytest.raises(ConcurrencyConflict) as info:
        _resume(mode, agent, hooks, session, controller=loser)
    assert info.value.action == "claim"
    assert loser.events == before
    assert not (tmp_path / "loser.txt").exists()
    effects = (tmp_path / "winner.txt").read_text().splitlines()
    assert [line.split(" ", 1)[1] for line in effects] == list(claim_driver.WINNER_EFFECTS)


# ------------------------------------------------------ the real-process race

WORKERS = 4
TRIALS = 120
"""Both profiles: 40 trials of 4 processes take a few seconds on two cores."""
TIMEOUT = 60.0


class _Worker:
    """One ``python -m tests.drivers.claim_driver`` process, answering a line per command."""

    def __init__(self, log: Path) -> None:
        self._stderr = log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.drivers.claim_driver"], cwd=ROOT, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr)
        self.lines: Queue[str] = Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.log = log

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def answer(self) -> str:
        try:
            return self.lines.get(timeout=TIMEOUT)
        except Empty:
            raise AssertionError(f"worker {self.proc.pid} did not answer: "
                                 f"{self.log.read_text()}") from None

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("quit")
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._stderr.close()


def _template(base: Path, variant: str) -> tuple[Path, int]:
    folder = base / f"template-{variant}"
    folder.mkdir()
    return folder, claim_driver.prepare(folder, variant)


def _trial_folder(base: Path, template: Path, trial: int) -> Path:
    folder = base / f"trial-{trial:03d}"
    folder.mkdir()
    for name in os.listdir(template):
        shutil.copy2(template / name, folder / name)
    return folder


@pytest.mark.invariant("I1", "I7")
def test_racing_worker_processes_exactly_one_goes_on_and_the_others_run_nothing(
    tmp_path: Path,
) -> None:
    started = time.perf_counter()
    templates = {variant: _template(tmp_path, variant) for variant in ("interruption", "tools")}
    workers = [_Worker(tmp_path / f"worker-{n}.log") for n in range(WORKERS)]
    tally: Counter[str] = Counter()
    spreads: list[float] = []
    contended = 0
    try:
        for trial in range(TRIALS):
            variant = ("tools", "interruption")[trial % 2]
            mode = ("run", "run", "streamed", "streamed")[trial % 4]
            template, paused = templates[variant]
            folder = _trial_folder(tmp_path, template, trial)
            for worker in workers:
                worker.send(f"load {folder}")
            # the barrier: every worker holds the run at the same version before any goes
            assert [w.answer() for w in workers] == [f"loaded {paused}"] * WORKERS
            for worker in workers:
                worker.send(f"go {mode}")
            outcomes = [json.loads(w.answer()) for w in workers]
            where = f"trial {trial} ({variant}, {mode}): {outcomes}"

            winners = [o for o in outcomes if o["outcome"] == "completed"]
            losers = [o for o in outcomes if o["outcome"] == "conflict"]
            assert len(winners) == 1, where
            assert len(losers) == WORKERS - 1, where
            assert winners[0]["step"] == "completed", where
            winner = winners[0]["pid"]

            lines = (folder / claim_driver.EFFECTS).read_text().splitlines()
            pids = {int(line.split(" ", 1)[0]) for line in lines}
            assert pids == {winner}, f"{where}: effects by {pids}, winner {winner}: {lines}"
            assert [line.split(" ", 1)[1] for line in lines] == list(
                claim_driver.WINNER_EFFECTS), where
            # every loser was refused at its claim, its first append
            assert all(o["action"] == "claim" for o in losers), where
            claims = [o["claim"] for o in outcomes]
            spreads.append(max(c[0] for c in claims) - min(c[0] for c in claims))
            contended += sum(o["claim"][0] < winners[0]["claim"][1] for o in losers)

            store = SQLiteEventStore(folder / "events.db")
            log = store.load(claim_driver.RUN_ID)
            store.close()
            assert sum(isinstance(e, ev.RunClaimed) for e in log[paused:]) == 1, where
            assert type(log[paused]) is ev.RunClaimed, where
            session = SQLiteSession(claim_driver.SESSION_ID, folder / "session.db")
            items = asyncio.run(session.get_items())
            session.close()
            assert sum(1 for item in items if item.get("type") == "function_call_output"
                       and item.get("call_id") == "pay") == 1, where
            tally[f"{variant}/{mode}"] += 1
    finally:
        for worker in workers:
            worker.close()
    seconds = time.perf_counter() - started
    spreads.sort()
    print(f"\nclaim race: {TRIALS} trials x {WORKERS} workers, one winner and "
          f"{WORKERS - 1} ConcurrencyConflict each, {dict(tally)}; {contended} of "
          f"{TRIALS * (WORKERS - 1)} losing claims began before the winning one had "
          f"committed; spread of the claims' start, median "
          f"{spreads[len(spreads) // 2] * 1000:.1f} ms, max {spreads[-1] * 1000:.1f} ms; "
          f"{seconds:.1f} s")


@pytest.mark.parametrize("buffered", [False, True], ids=["per-event", "buffered"])
def test_a_refused_resume_of_a_stuck_run_records_nothing(tmp_path: Path,
                                                          buffered: bool) -> None:
    """A run with a call in doubt: every resume is refused (`ToolInDoubt`) and the log
    does not grow (before: each refused attempt appended a `RunClaimed`; one fleet run
    reached 7,838 events, 7,811 of them claims)."""
    from statemachine.runner import Agent
    from statemachine.testing import ScriptedModel

    store = SQLiteEventStore(tmp_path / "events.db")
    c = RunController.start(run_id="stuck", session_id=None, store=store)
    c.begin_model_call()
    c.model_responded([ToolCall("c1", "charge", {"x": 7})])
    c.begin_tool("c1")  # ... and the process died inside the tool
    size = len(store.load("stuck"))
    agent = Agent("a", ScriptedModel([]))
    for _ in range(5):
        with pytest.raises(ToolInDoubt):
            asyncio.run(Runner.run(agent, store=store, run_id="stuck", buffered=buffered))
    assert len(store.load("stuck")) == size
    # an attempt that only records the operator's outcome claims it, and it goes on
    from statemachine.runner.attempt import Attempt

    async def resolve() -> None:
        loaded = RunController.load(store, "stuck", buffered=buffered)
        async with Attempt(loaded, resumes=True, owner="operator").deciding():
            loaded.resolve_in_doubt("c1", "charged 7")

    asyncio.run(resolve())
    after = store.load("stuck")
    assert [type(e).__name__ for e in after[size:]] == ["RunClaimed", "InDoubtResolved"]
