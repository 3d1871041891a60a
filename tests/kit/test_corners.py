"""The corner generators of `statemachine.testing.corners` (issue 32), each case played
against the outcome written from the case alone, to the run's end: every mix of call
phases at a handoff (exhaustively up to three calls, then drawn up to five), new input
in every step a run of the reference runner rests in, Sessions whose tail holds a call
without an output, Sessions of repeated items at stage and reconcile, and Sessions that
are not the run's. CI plays each family's small enumeration and a bounded draw; `just
fuzz` draws long."""

from __future__ import annotations

import importlib
import itertools
import os

import pytest
from hypothesis import given, settings

from statemachine.testing import (
    CALL_PHASES,
    INPUT_RESTS,
    RUNNER_SKIPS,
    SESSION_ID_DOORS,
    TAIL_TOKENS,
    CaseFailed,
    FrontierCase,
    HandoffCase,
    InputCase,
    SessionIdCase,
    TailCase,
    calls_without_output,
    frontier_cases,
    handoff_cases,
    input_cases,
    play_frontier,
    play_handoff,
    play_input,
    play_runner_skip,
    play_session_id,
    play_tail,
    read_limit_by_definition,
    session_id_cases,
    tail_cases,
)
from statemachine.testing.corners import AT_WORK, _item
from statemachine.values import Phase, Step

_current = settings()
FUZZING = os.environ.get("HYPOTHESIS_PROFILE") == "fuzz"
DRAWN = _current if FUZZING else settings(_current,
                                          max_examples=min(_current.max_examples, 40))
DRAWN_RUNS = _current if FUZZING else settings(_current,
                                               max_examples=min(_current.max_examples, 15))
"""The CI budget of the drawn cases (the enumerations cover the small ones): 40 each,
15 of the runs with input (up to five attempts each, some on a SQLite file); `just fuzz`
draws the long profile's count."""
PUBLISH = importlib.import_module("statemachine.runner.publish")
"""The module (``statemachine.runner.publish`` is also the name of its function)."""

# ------------------------------------------------------------------------- handoffs

EVERY_MIX = [HandoffCase(phases, reload) for size in range(4)
             for phases in itertools.product(CALL_PHASES, repeat=size)
             for reload in (False, True)]


@pytest.mark.invariant("I5", "I11")
@pytest.mark.parametrize("case", EVERY_MIX, ids=lambda case: "-".join(case.phases) +
                         ("-reloaded" if case.reload else "") or "no-calls")
def test_a_handoff_from_every_mix_of_call_phases(case: HandoffCase) -> None:
    c = play_handoff(case)
    assert c.step is Step.COMPLETED


@given(handoff_cases())
@DRAWN
def test_a_handoff_from_a_drawn_mix(case: HandoffCase) -> None:
    play_handoff(case)


def test_the_cases_reach_each_corner_the_issue_names() -> None:
    """A handoff straight from RUN_AGAIN, one where nothing awaits a decision (every call
    decided, still INTERRUPTION), one asked for while a call is started (in flight, and
    in doubt after a reload) or completed and unpublished, and one of each phase beside
    the others."""
    assert HandoffCase((), False) in EVERY_MIX
    decided = HandoffCase(("approved", "rejected"), False)
    assert decided in EVERY_MIX
    c = play_handoff(decided)
    assert [c.phase(i) for i in decided.ids] == [Phase.SKIPPED, Phase.PUBLISHED]
    for reload in (False, True):
        at_work = HandoffCase(("undecided", "started", "completed"), reload)
        assert at_work in EVERY_MIX
        c = play_handoff(at_work)
        assert [c.phase(i) for i in at_work.ids] == [Phase.SKIPPED, Phase.PUBLISHED,
                                                     Phase.PUBLISHED]
        assert [v.starts for v in c.calls] == [0, 1, 1]  # the call in doubt never re-ran
    assert {p for case in EVERY_MIX for p in case.phases} == set(CALL_PHASES)
    assert set(AT_WORK) < set(CALL_PHASES)


def test_a_case_the_run_breaks_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check can fail: a run whose handoff keeps an approved call runnable."""
    from statemachine import state

    def keep_approved(self: state.RunState) -> None:
        for record in list(self.calls.values()):
            if record.phase is Phase.AWAITING:
                self._phase(record, Phase.SKIPPED)

    monkeypatch.setattr(state.RunState, "_skip_unstarted", keep_approved)
    with pytest.raises(CaseFailed, match="approved at the handoff"):
        play_handoff(HandoffCase(("approved",), False))


def test_a_call_in_doubt_that_resumes_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check can fail: a reloaded run that forgets a started call is in doubt."""
    from statemachine.controller import RunController

    monkeypatch.setattr(RunController, "in_doubt", lambda self: ())
    with pytest.raises(CaseFailed, match="in doubt was not refused"):
        play_handoff(HandoffCase(("started",), True))


# ------------------------------------------------------------------------ new input

EVERY_INPUT = [InputCase(rest, source, streamed) for rest in INPUT_RESTS
               for source, streamed in (("live", False), ("live", True), ("json", False),
                                        ("memory", False), ("memory", True),
                                        ("sqlite", False))]
"""Every rest, by every door; streamed on the live controller and a store (the SQLite
store once per rest: its fsyncs are most of this file's time)."""


@pytest.mark.invariant("I1", "I2")
@pytest.mark.parametrize("case", EVERY_INPUT, ids=lambda case: f"{case.rest}-{case.source}"
                         + ("-streamed" if case.streamed else ""))
def test_new_input_in_every_step_a_run_rests_in(case: InputCase) -> None:
    c = play_input(case)
    assert c.step is case.end


@given(input_cases())
@DRAWN_RUNS
def test_new_input_in_a_drawn_step(case: InputCase) -> None:
    play_input(case)


def test_input_is_taken_only_where_design_allows_it() -> None:
    """The rests the issue names are all there, and the model of what is taken is
    DESIGN's: RUN_AGAIN and INTERRUPTION without an envelope, nowhere else."""
    assert {"interruption", "in_doubt", "unsettled", "fail_closed", "handoff",
            "final_output", "finalizing"} <= set(INPUT_RESTS)
    taken = {case.rest for case in EVERY_INPUT if case.taken}
    assert taken == {"run_again", "interruption", "decided"}
    assert InputCase("decided", "live", False).expected_session()[:2] == [
        {"role": "user", "content": "go"}, {"role": "user", "content": "more"}]


def test_an_attempt_whose_input_records_a_claim_is_reported(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The check can fail: a runner that claims the run before refusing its input."""
    from statemachine.runner import loop

    monkeypatch.setattr(loop, "_refuse_input_before_claim", lambda c, items: None)
    with pytest.raises(CaseFailed, match="refused input changed the run"):
        play_input(InputCase("handoff", "memory", False))


# ---------------------------------------------------- calls without output in the tail

EVERY_TAIL = [TailCase(tokens, store) for size in range(4)
              for tokens in itertools.product(TAIL_TOKENS, repeat=size)
              for store in (False, True)]


@pytest.mark.invariant("I7")
def test_a_new_run_on_every_tail_of_up_to_three_items() -> None:
    """Every Session of up to three items (a call left without an output last, before a
    message, before another call that has its output...), with a store and without."""
    for case in EVERY_TAIL:
        assert play_tail(case).step is Step.COMPLETED, case


@given(tail_cases())
@DRAWN
def test_a_new_run_on_a_drawn_tail(case: TailCase) -> None:
    play_tail(case)


def test_the_tails_reach_an_orphan_that_is_not_last() -> None:
    orphans = {case.tokens for case in EVERY_TAIL
               if any(p < len(case.tokens) - 1
                      for p, _ in calls_without_output([_item(t) for t in case.tokens]))}
    assert ("call:X", "user") in orphans
    assert ("call:X", "call:Y", "out:Y") in orphans
    assert ("call:X", "out:X") not in orphans


@pytest.mark.parametrize("kind", RUNNER_SKIPS)
def test_what_the_runner_leaves_behind_never_blocks_a_new_run(kind: str) -> None:
    items = play_runner_skip(kind)
    assert not any(i.get("call_id") == "pay" for i in items if kind != "rejected")


def test_a_runner_blind_to_calls_without_output_is_reported(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(PUBLISH, "_unanswered_call", lambda tail: None)
    with pytest.raises(CaseFailed, match="was not refused"):
        play_tail(TailCase(("call:X", "call:Y", "out:Y"), False))


# ------------------------------------------------------ repeated items and read_limit

NAMED_FRONTIERS = [
    *(FrontierCase(("x",) * k, ("x",) * m, landed, given, through)
      for k in range(5) for m in (1, 2, 3) for landed in range(m + 1)
      for given, through in ((None, "controller"), (m + 1, "controller"), (None, "runner"))
      if given is None or given <= max(k, m + 1)),
    *(FrontierCase(("a", "y", "x", "y"), ("x", "y"), landed, given, through)
      for landed in range(3)
      for given, through in ((None, "controller"), (3, "controller"), (None, "runner"))),
]
"""The Sessions DESIGN §2.3 names: P = [x] * k with B = [x] * m, and P = [a, y, x, y] with
B = [x, y], every part of the batch landed, through the controller (the whole Session, or
just len(B) + 1 items) and the runner."""
EVERY_SMALL_FRONTIER = [
    FrontierCase(before, batch, landed, given)
    for size in range(4) for before in itertools.product("xy", repeat=size)
    for m in (1, 2) for batch in itertools.product("xy", repeat=m)
    for landed in range(m + 1) for given in (None, m + 1)]


@pytest.mark.invariant("I3", "I7")
@pytest.mark.parametrize("case", NAMED_FRONTIERS, ids=lambda case: (
    f"{''.join(case.before) or 'empty'}+{''.join(case.batch)}-landed{case.landed}-"
    f"{case.through}" + (f"-given{case.given}" if case.given else "")))
def test_repeated_items_at_stage_and_reconcile(case: FrontierCase) -> None:
    assert play_frontier(case).step is Step.COMPLETED


def test_every_small_frontier() -> None:
    """Every P of up to three items of two kinds, B of one or two, each part landed."""
    for case in EVERY_SMALL_FRONTIER:
        assert play_frontier(case).step is Step.COMPLETED, case


@given(frontier_cases())
@DRAWN
def test_a_drawn_frontier(case: FrontierCase) -> None:
    play_frontier(case)


def test_the_definition_reads_as_design_says() -> None:
    """The oracle itself, on DESIGN's own example and the run of identical items: four
    items tell [a, y, x, y] + [x, y] apart; [x] * 3 + [x] needs all four, which only the
    whole Session may give."""
    assert read_limit_by_definition(list("ayxy"), list("xy"), whole=False) == 4
    assert read_limit_by_definition(list("xxx"), list("x"), whole=False) is None
    assert read_limit_by_definition(list("xxx"), list("x"), whole=True) == 4
    assert read_limit_by_definition([], list("xx"), whole=True) == 3


def test_a_reconcile_that_appends_over_a_partial_write_is_reported(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from statemachine import controller, envelope

    real = envelope.classify

    def appends(*args: object) -> envelope.Finding:
        found = real(*args)  # type: ignore[arg-type]
        partial = found.kind is envelope.FindingKind.PARTIAL_WRITE
        return envelope.Finding(envelope.FindingKind.APPEND) if partial else found

    monkeypatch.setattr(controller, "classify", appends)
    with pytest.raises(CaseFailed, match="a partial write was not refused"):
        play_frontier(FrontierCase(("x",) * 2, ("x",) * 2, 1, None, "controller"))


# ------------------------------------------------------------ Sessions not the run's

EVERY_SESSION_ID = [*(SessionIdCase(door, other) for door in SESSION_ID_DOORS
                      for other in ("theirs", None)),
                    SessionIdCase("publish", "theirs", None),
                    SessionIdCase("runner", "theirs", None)]


@pytest.mark.invariant("I7")
@pytest.mark.parametrize("case", EVERY_SESSION_ID, ids=lambda case: (
    f"{case.door}-{case.given or 'none'}" + ("-runs-without" if case.run_session is None
                                             else "")))
def test_a_session_that_is_not_the_runs(case: SessionIdCase) -> None:
    assert play_session_id(case).step is Step.COMPLETED


@given(session_id_cases())
@DRAWN
def test_a_drawn_session_that_is_not_the_runs(case: SessionIdCase) -> None:
    play_session_id(case)


def test_a_settle_that_reads_another_session_is_reported(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(PUBLISH, "_same_session", lambda c, session, action: None)
    with pytest.raises(AssertionError, match="touched"):
        play_session_id(SessionIdCase("settle", None))
