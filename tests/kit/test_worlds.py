"""I1-I12 under any interleaving: Hypothesis stateful tests over the reference runner
and the remote executor, and the exhaustive explorer at the CI bound."""

from __future__ import annotations

import os
import time

import pytest
from hypothesis import settings

from statemachine import RecoveryPolicy
from statemachine.testing import ReferenceWorld, RemoteWorld, explore, world_state_machine
from statemachine.testing.worlds import Script, ScriptWorld, Turn
from tests.strategies import scripts

EXPLORE_DEPTH = 5
"""The CI bound: every action sequence of this length (`just fuzz` goes deeper)."""


def _fail_closed_world() -> ReferenceWorld:
    return ReferenceWorld(RecoveryPolicy.FAIL_CLOSED)


_current = settings()
FUZZING = os.environ.get("HYPOTHESIS_PROFILE") == "fuzz"
STATEFUL = _current if FUZZING else settings(
    _current, max_examples=min(_current.max_examples, 80),
    stateful_step_count=min(_current.stateful_step_count, 30))
REMOTE = _current if FUZZING else settings(
    _current, max_examples=min(_current.max_examples, 150),
    stateful_step_count=min(_current.stateful_step_count, 30))
SCRIPTED = _current if FUZZING else settings(
    _current, max_examples=min(_current.max_examples * 4, 560),
    stateful_step_count=min(_current.stateful_step_count, 25))
"""The CI budget: about 2,400 steps in each reference world (each step runs an attempt
twice, streamed and not, to compare them), 4,500 in the remote world and 13,400 in the
scripted world, whose every step is checked against the oracle (over 25,000 in all, at
least what issue 32 found; the terminal summary reports the count)."""
PROGRESS = 50 if FUZZING else None

# What each world checks after every step: its own checks and those of `check_log`
# (I1, I2, I4, I5, I9, I10, I11, I12 as the log shows them).
REFERENCE = pytest.mark.invariant("I1", "I2", "I3", "I4", "I5", "I8", "I9", "I10", "I11",
                                  "I12")
REMOTE_CHECKS = pytest.mark.invariant("I1", "I3", "I11", "I12")
SCRIPT_CHECKS = pytest.mark.invariant("I1", "I2", "I3", "I4", "I5", "I9", "I10", "I11", "I12")

TestReferenceRunner = REFERENCE(
    world_state_machine(ReferenceWorld, progress_every=PROGRESS).TestCase)
TestReferenceRunner.settings = STATEFUL
TestFailClosedRunner = REFERENCE(
    world_state_machine(_fail_closed_world, progress_every=PROGRESS).TestCase)
TestFailClosedRunner.settings = STATEFUL
TestRemoteExecutor = REMOTE_CHECKS(
    world_state_machine(RemoteWorld, progress_every=PROGRESS).TestCase)
TestRemoteExecutor.settings = REMOTE
TestScriptedRunner = SCRIPT_CHECKS(
    world_state_machine(ScriptWorld, scripts=scripts(), progress_every=PROGRESS).TestCase)
TestScriptedRunner.settings = SCRIPTED


@REFERENCE
@pytest.mark.parametrize("world", [ReferenceWorld, _fail_closed_world, RemoteWorld],
                         ids=["reference-reconcile", "reference-fail-closed", "remote"])
def test_explorer_finds_no_counterexample_at_the_ci_bound(world: type) -> None:
    started = time.perf_counter()
    report = explore(world, depth=EXPLORE_DEPTH)
    assert report.counterexample is None, (report.counterexample, report.violation)
    assert report.depth == EXPLORE_DEPTH
    assert report.states > 20
    print(f"\n{world.__name__}: {report.states} states, {report.transitions} transitions, "
          f"depth {report.depth}, {time.perf_counter() - started:.1f}s")


EXPLORED_SCRIPTS = {
    # every tool kind in one response, a decision each way, then the answer
    "all-kinds": Script((Turn(("approve", "blocked", "idem", "redacted"), (True,)),
                         Turn(("approve", "fails"), (False,)), Turn())),
    # a handoff at the interruption; fail-closed; a tripping output guardrail
    "handoff-trip": Script((Turn(("plain", "approve"), (True,), handoff=True), Turn()),
                           trip=True, policy=RecoveryPolicy.FAIL_CLOSED),
    # one turn too few
    "turn-limit": Script((Turn(("idem",)), Turn(("plain", "plain")), Turn()), max_turns=2),
}
SCRIPT_DEPTH = 3


@SCRIPT_CHECKS
@pytest.mark.parametrize("name", list(EXPLORED_SCRIPTS))
def test_explorer_checks_the_oracle_and_liveness_of_scripted_worlds(name: str) -> None:
    script = EXPLORED_SCRIPTS[name]
    report = explore(lambda: ScriptWorld(script), depth=SCRIPT_DEPTH)
    assert report.counterexample is None, (report.counterexample, report.violation)
    assert report.depth == SCRIPT_DEPTH
    print(f"\n{name}: {report.states} states, {report.transitions} transitions, "
          f"{report.seconds:.1f}s")
