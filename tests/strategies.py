"""Hypothesis strategies for the tests: random reachable runs (`drive`, `step`: the kit's
`statemachine.testing.RandomRun` as these tests spell it) and `scripts`, the scripts of
scripted worlds."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from statemachine import RecoveryPolicy, RunController
from statemachine.testing import RandomRun


class Driven(RandomRun):
    """A `RandomRun`, its controller also read (and rebound) as ``c``."""

    @property
    def c(self) -> RunController:
        return self.controller

    @c.setter
    def c(self, controller: RunController) -> None:
        self.controller = controller


def drive(data: st.DataObject, max_steps: int = 40, **kw: Any) -> Driven:
    """A random reachable run (run id ``"driven"`` unless ``run_id=`` says otherwise;
    ``kw`` go to `RunController.start`), moved up to ``max_steps`` times."""
    return Driven.start(data, **{"run_id": "driven", **kw}).walk(data, max_steps=max_steps)


def step(d: Driven, data: st.DataObject) -> bool:
    """One move of ``d``; False once the run can make none."""
    return d.step(data)


# ---------------------------------------------------------------- scripted worlds


@st.composite
def scripts(draw: Any, *, max_turns: int = 3) -> Any:
    """A `Script` for a scripted world: 0-``max_turns`` tool turns of 1-3 calls each
    (every kind in `TOOL_KINDS`), their human decisions and handoffs, then the final
    output; a tripping output guardrail, a turn limit that may be too short, the
    recovery policy and streaming."""
    from statemachine.testing.worlds import TOOL_KINDS, Script, Turn

    turns = []
    for _ in range(draw(st.integers(0, max_turns), label="tool turns")):
        calls = tuple(draw(st.lists(st.sampled_from(TOOL_KINDS), min_size=1, max_size=3),
                           label="calls"))
        needing = calls.count("approve")
        turns.append(Turn(calls, tuple(draw(st.lists(st.booleans(), min_size=needing,
                                                    max_size=needing), label="approve")),
                          handoff=needing > 0 and draw(st.integers(0, 4)) == 0))
    turns.append(Turn())
    return Script(tuple(turns), trip=draw(st.integers(0, 5), label="trip") == 0,
                  max_turns=draw(st.sampled_from([10, 10, 10, len(turns) - 1]),
                                 label="max_turns"),
                  policy=draw(st.sampled_from([RecoveryPolicy.RECONCILE] * 3
                                              + [RecoveryPolicy.FAIL_CLOSED]),
                              label="policy"),
                  streamed=draw(st.booleans(), label="streamed"))
