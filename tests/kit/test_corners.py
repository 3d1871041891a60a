"""The corner generators of `statemachine.testing.corners` (issue 32), each case played
against the outcome written from the case alone, to the run's end: every mix of call
phases at a handoff (exhaustively up to three calls, then drawn up to five). CI plays
the small enumeration and a bounded draw; `just fuzz` draws long."""

from __future__ import annotations

import importlib
import itertools
import os

import pytest
from hypothesis import given, settings

from statemachine.testing import (
    CALL_PHASES,
    CaseFailed,
    HandoffCase,
    handoff_cases,
    play_handoff,
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
