"""The corner generators of `statemachine.testing.corners` (issue 32), each case played
against the outcome written from the case alone, to the run's end: every mix of call
phases at a handoff, exhaustively up to three calls, then drawn up to five."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given

from statemachine.testing import CALL_PHASES, CaseFailed, HandoffCase, handoff_cases, play_handoff
from statemachine.values import Phase, Step

EVERY_MIX = [HandoffCase(phases, reload) for size in range(4)
             for phases in itertools.product(CALL_PHASES, repeat=size)
             for reload in (False, True)]


@pytest.mark.invariant("I5")
@pytest.mark.parametrize("case", EVERY_MIX, ids=lambda case: "-".join(case.phases) +
                         ("-reloaded" if case.reload else "") or "no-calls")
def test_a_handoff_from_every_mix_of_call_phases(case: HandoffCase) -> None:
    c = play_handoff(case)
    assert c.step is Step.COMPLETED


@given(handoff_cases())
def test_a_handoff_from_a_drawn_mix(case: HandoffCase) -> None:
    play_handoff(case)


def test_the_cases_reach_each_corner_the_issue_names() -> None:
    """A handoff straight from RUN_AGAIN, one where nothing awaits a decision (every call
    decided, still INTERRUPTION), and one of each phase beside the others."""
    assert HandoffCase((), False) in EVERY_MIX
    decided = HandoffCase(("approved", "rejected"), False)
    assert decided in EVERY_MIX
    c = play_handoff(decided)
    assert [c.phase(i) for i in decided.ids] == [Phase.SKIPPED, Phase.PUBLISHED]
    assert {p for case in EVERY_MIX for p in case.phases} == set(CALL_PHASES)


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
