"""Teeth: deliberate bugs, and the proof that the stateful tests and the explorer each
catch every one of `MUTANTS` within the CI budget, and that the scripted world's oracle
and liveness check catch every one of `ORACLE_MUTANTS` (bugs whose log agrees with what
happened, so the reference world, which checks effects against the log, misses them).
Prints the table of who caught what, and in how many steps."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.errors import HypothesisException
from hypothesis.stateful import run_state_machine_as_test

from statemachine import RecoveryPolicy
from statemachine.testing import InvariantViolation, ReferenceWorld, explore, world_state_machine
from statemachine.testing.worlds import ScriptWorld
from tests.kit.mutants import MUTANTS, ORACLE_MUTANTS
from tests.kit.test_worlds import EXPLORE_DEPTH
from tests.strategies import scripts

BUDGET = settings(max_examples=200, stateful_step_count=20, derandomize=True,
                  database=None, deadline=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck), print_blob=False)


def _stateful_steps_to_catch() -> tuple[int, str] | None:
    """Total stateful steps run until the first failure, or None if none failed."""
    counter = {"steps": 0}

    class Counting(ReferenceWorld):
        def apply(self, action: Any) -> None:
            counter["steps"] += 1
            super().apply(action)

    try:
        run_state_machine_as_test(world_state_machine(Counting), settings=BUDGET)
    except HypothesisException:
        raise  # a broken test definition is not a catch
    except Exception as error:
        return counter["steps"], f"{type(error).__name__}: {str(error).splitlines()[0]}"
    return None


def _scripted_steps_to_catch() -> tuple[int, str, str] | None:
    """Total stateful steps of the scripted world until the first failure (with the
    invariant it broke), or None if none failed."""
    counter = {"steps": 0}

    class Counting(ScriptWorld):
        def apply(self, action: Any) -> None:
            counter["steps"] += 1
            super().apply(action)

    try:
        run_state_machine_as_test(world_state_machine(Counting, scripts=scripts()),
                                  settings=BUDGET)
    except HypothesisException:
        raise
    except InvariantViolation as error:
        return counter["steps"], error.invariant, str(error).splitlines()[0]
    except Exception as error:
        return counter["steps"], "-", f"{type(error).__name__}: {str(error).splitlines()[0]}"
    return None


@pytest.mark.parametrize("mutant", list(ORACLE_MUTANTS))
def test_the_oracle_catches_what_the_log_agrees_with(mutant: str) -> None:
    with ORACLE_MUTANTS[mutant]():
        caught = _scripted_steps_to_catch()
    assert caught is not None, f"the scripted world missed: {mutant}"
    steps, invariant, error = caught
    # an oracle (O*) or liveness (L*) failure: what happened differs from the script
    assert invariant[0] in "OL", (mutant, error)
    print(f"\n| {mutant} | scripted: {steps} steps ({error}) |")


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_both_fuzzers_catch_the_planted_bug(mutant: str) -> None:
    with MUTANTS[mutant]():
        report = explore(ReferenceWorld, depth=EXPLORE_DEPTH)
        if report.counterexample is None:
            report = explore(lambda: ReferenceWorld(RecoveryPolicy.FAIL_CLOSED),
                             depth=EXPLORE_DEPTH)
        caught = _stateful_steps_to_catch()
    assert report.counterexample is not None, f"the explorer missed: {mutant}"
    assert caught is not None, f"the stateful tests missed: {mutant}"
    steps, error = caught
    # a planted bug that no longer fits the code it patches is not a catch
    broken = ("TypeError", "AttributeError", "NameError")
    assert not error.startswith(broken), f"the planted bug is broken: {error}"
    assert not str(report.violation).startswith(broken), report.violation
    print(f"\n| {mutant} | explorer: {len(report.counterexample)}-step trace, "
          f"{report.states} states ({report.violation}) | stateful: {steps} steps ({error}) |")


def test_no_mutant_is_left_planted() -> None:
    report = explore(ReferenceWorld, depth=3)
    assert report.counterexample is None
