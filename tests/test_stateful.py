"""I1-I12 under any interleaving: Hypothesis stateful tests over the reference runner
and the remote executor, and the exhaustive explorer at the CI bound."""

from __future__ import annotations

import os
import time

import pytest
from hypothesis import settings

from statemachine import RecoveryPolicy
from statemachine.testing import ReferenceWorld, RemoteWorld, explore, world_state_machine

EXPLORE_DEPTH = 5
"""The CI bound: every action sequence of this length (`just fuzz` goes deeper)."""


def _fail_closed_world() -> ReferenceWorld:
    return ReferenceWorld(RecoveryPolicy.FAIL_CLOSED)


_current = settings()
FUZZING = os.environ.get("HYPOTHESIS_PROFILE") == "fuzz"
STATEFUL = _current if FUZZING else settings(
    _current, max_examples=min(_current.max_examples, 40),
    stateful_step_count=min(_current.stateful_step_count, 20))
PROGRESS = 50 if FUZZING else None

TestReferenceRunner = world_state_machine(ReferenceWorld, progress_every=PROGRESS).TestCase
TestReferenceRunner.settings = STATEFUL
TestFailClosedRunner = world_state_machine(_fail_closed_world,
                                           progress_every=PROGRESS).TestCase
TestFailClosedRunner.settings = STATEFUL
TestRemoteExecutor = world_state_machine(RemoteWorld, progress_every=PROGRESS).TestCase
TestRemoteExecutor.settings = STATEFUL


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
