"""`statemachine.adapters._calls.begin_call`, the ledger question every adapter asks before
a tool body runs: no SDK needed."""

from __future__ import annotations

import pytest

from statemachine import InvalidTransition, RunController, ToolCall, ToolInDoubt
from statemachine.adapters._calls import begin_call
from statemachine.payloads import JSON


def _run(arguments: dict[str, JSON]) -> RunController:
    c = RunController.start(run_id="r", session_id=None)
    c.begin_model_call()
    c.model_responded([ToolCall("c1", "charge", arguments)])
    return c


@pytest.mark.parametrize(("recorded", "asked"), [
    ({"x": 1}, {"x": True}),
    ({"x": True}, {"x": 1}),
    ({"x": 1}, {"x": 1.0}),
    ({"x": 0}, {"x": False}),
    ({"x": [1]}, {"x": [True]}),
    ({"x": 7}, {"x": 8}),
    ({"x": 7}, {"x": float("nan")}),
], ids=["int-as-bool", "bool-as-int", "int-as-float", "zero-as-false", "nested", "value",
        "nan"])
def test_arguments_other_than_the_recorded_ones_never_start(
        recorded: dict[str, JSON], asked: dict[str, JSON]) -> None:
    """Equal in Python is not the same JSON: a call asked to run with arguments whose
    JSON differs from the recorded ones (which its approval binds) does not start."""
    c = _run(recorded)
    with pytest.raises(InvalidTransition):
        begin_call(c, "c1", asked)
    assert c.call("c1").phase is not None
    assert begin_call(c, "c1", recorded) == (False, None)  # the recorded ones start it


@pytest.mark.invariant("I11", "I12")
def test_a_started_call_is_in_doubt_and_a_finished_one_answers_from_the_ledger() -> None:
    c = _run({"x": 7})
    assert begin_call(c, "c1", {"x": 7}) == (False, None)
    c.tool_interrupted("c1")  # the body ended without a result (cancelled, killed...)
    with pytest.raises(ToolInDoubt):
        begin_call(c, "c1", {"x": 7})  # started, never finished: never run again
    done = _run({"x": 7})
    assert begin_call(done, "c1", {"x": 7}) == (False, None)
    done.tool_completed("c1", "charged 7")
    assert begin_call(done, "c1", {"x": 7}) == (True, "charged 7")  # never a second run
