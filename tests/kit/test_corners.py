"""The corner generators of `statemachine.testing.corners` (issue 32), each case played
against the outcome written from the case alone, to the run's end: every mix of call
phases at a handoff (exhaustively up to three calls, then drawn up to five), and new
input in every step a run of the reference runner rests in. CI plays each family's
small enumeration and a bounded draw; `just fuzz` draws long."""

from __future__ import annotations

import importlib
import itertools
import os

import pytest
from hypothesis import given, settings

from statemachine.testing import (
    CALL_PHASES,
    INPUT_RESTS,
    CaseFailed,
    HandoffCase,
    InputCase,
    handoff_cases,
    input_cases,
    play_handoff,
    play_input,
)
from statemachine.testing.corners import AT_WORK
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
