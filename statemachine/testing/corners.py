"""Generators for the corners random walks seldom reach (issue 32), each played against
an expected outcome written from the case alone, never read from the controller, and
driven to the run's end (liveness): a corner that leaves a run stuck fails too.

`handoff_cases`: a handoff from every mix of call phases a reachable run can hold at a
handoff: calls still undecided, approved and not started, rejected (their rejection not
yet published), and run and published in an earlier batch; the mix may be empty (a
handoff straight from ``RUN_AGAIN``) or hold nothing awaiting a decision (every call
decided, the run still in ``INTERRUPTION``), and the run may be reloaded from its JSON
just before the handoff. `play_handoff` plays one: after the handoff every call not
started is skipped (it can be neither run nor decided any more), the rejections are the
next batch's results (a batch leaving one out, or naming one that has none, is refused),
and the new activation calls the model and completes.

Use them in your own property tests::

    @given(handoff_cases())
    def test_handoffs(case):
        play_handoff(case)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
from hypothesis import strategies as st

from statemachine import events as ev
from statemachine.controller import RunController
from statemachine.errors import InvalidTransition
from statemachine.payloads import JSON
from statemachine.testing.invariants import check_log
from statemachine.values import Phase, Step, ToolCall

__all__ = ["CALL_PHASES", "CaseFailed", "HandoffCase", "handoff_cases", "play_handoff"]


class CaseFailed(AssertionError):
    """The run did not do what its case says it must (the message says what it did)."""

CALL_PHASES = ("undecided", "approved", "rejected", "published")
"""What a call can be at a handoff: awaiting a decision; approved, not started; rejected,
its rejection unpublished; run, its result published in an earlier batch. (A started
call is in ``TOOLS``, where a handoff is refused by step.)"""

AFTER_HANDOFF = {"undecided": Phase.SKIPPED, "approved": Phase.SKIPPED,
                 "rejected": Phase.REJECTED, "published": Phase.PUBLISHED}
"""The expected phase of each call after the handoff."""


@attrs.frozen
class HandoffCase:
    phases: tuple[str, ...]
    """Each call's phase at the handoff (`CALL_PHASES`), in proposal order."""
    reload: bool
    """Reload the run from its JSON just before the handoff."""

    @property
    def ids(self) -> list[str]:
        return [f"c{i}" for i in range(len(self.phases))]

    @property
    def pending(self) -> list[str]:
        """The calls whose rejection the next batch must publish."""
        return [i for i, p in zip(self.ids, self.phases, strict=True) if p == "rejected"]


def handoff_cases() -> st.SearchStrategy[HandoffCase]:
    """Every mix of up to five calls' phases, reloaded or not."""
    return st.builds(HandoffCase, st.lists(st.sampled_from(CALL_PHASES), max_size=5).map(tuple),
                     st.booleans())


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise CaseFailed(what)


def _refused(do: Any, what: str) -> None:
    try:
        do()
    except InvalidTransition:
        return
    raise CaseFailed(f"{what} was not refused")


def _output(call_id: str) -> JSON:
    return {"type": "function_call_output", "call_id": call_id, "output": f"ran {call_id}"}


def _rejection(call_id: str) -> JSON:
    return {"type": "function_call_output", "call_id": call_id, "output": f"no {call_id}"}


def _publish(c: RunController, history: list[JSON], items: Sequence[JSON],
             call_ids: Sequence[str]) -> None:
    c.stage_publication(list(items), history, call_ids=list(call_ids), whole=True)
    history.extend(items)
    c.publication_committed()


def play_handoff(case: HandoffCase) -> RunController:
    """Play ``case`` and check it at each stage; returns the completed run. `CaseFailed`
    (`InvariantViolation` from the log's check, or the controller's own refusal of a
    legal command) when the run does not do what the case says it must."""
    history: list[JSON] = []
    c = RunController.start(run_id="handoff", session_id="s")
    _publish(c, history, [{"role": "user", "content": "go"}], [])
    ids = case.ids
    if ids:
        c.begin_model_call()
        c.model_responded([ToolCall(i, "tool", {"call": i}, needs_approval=p != "published")
                           for i, p in zip(ids, case.phases, strict=True)])
        ran = [i for i, p in zip(ids, case.phases, strict=True) if p == "published"]
        if ran:
            c.resume()  # calls needing no approval run while the others await a decision
            for call_id in ran:
                c.begin_tool(call_id)
                c.tool_completed(call_id, f"ran {call_id}")
            _publish(c, history, [{"type": "function_call", "call_id": i} for i in ids]
                     + [_output(i) for i in ran], ran)
        for call_id, phase in zip(ids, case.phases, strict=True):
            if phase == "approved":
                c.approve(call_id, fingerprint=c.fingerprint(call_id))
            elif phase == "rejected":
                c.reject(call_id, f"no {call_id}", fingerprint=c.fingerprint(call_id))
    decided_all = any(p != "published" for p in case.phases)
    _expect(c.step is (Step.INTERRUPTION if decided_all else Step.RUN_AGAIN),
            f"before the handoff the run is in {c.step}")
    if case.reload:
        c = RunController.from_json(c.to_json())
    c.handoff("next")
    _expect(c.step is Step.HANDOFF, f"the handoff left the run in {c.step}")
    for call_id, phase in zip(ids, case.phases, strict=True):
        found = c.phase(call_id)
        _expect(found is AFTER_HANDOFF[phase],
                f"call {call_id}, {phase} at the handoff, is {found} after it")
        if AFTER_HANDOFF[phase] is Phase.SKIPPED:
            _refused(lambda i=call_id: c.begin_tool(i), f"running skipped call {call_id}")
            _refused(lambda i=call_id: c.approve(i), f"approving skipped call {call_id}")
    pending = case.pending
    if pending:
        _refused(c.begin_model_call, "a model call with rejections unpublished")
        _refused(lambda: c.stage_publication([_rejection(i) for i in pending[1:]], history,
                                             call_ids=pending[1:], whole=True),
                 "a batch leaving a rejection out")
        _publish(c, history, [_rejection(i) for i in pending], pending)
    skipped = [i for i, p in zip(ids, case.phases, strict=True)
               if AFTER_HANDOFF[p] is Phase.SKIPPED]
    if skipped:
        _refused(lambda: c.stage_publication([_output(skipped[0])], history,
                                             call_ids=skipped[:1], whole=True),
                 "a batch publishing a skipped call")
    c.begin_model_call()  # the new activation
    c.model_responded(output="done")
    c.accept_final_output("done")
    _publish(c, history, [{"role": "assistant", "content": "done"}], [])
    _expect(c.step is Step.COMPLETED, f"the run ended in {c.step}, not COMPLETED")
    check_log(c.events)
    starts = [e.call_id for e in c.events if isinstance(e, ev.ToolStarted)]
    _expect(sorted(starts) == sorted(i for i, p in zip(ids, case.phases, strict=True)
                                     if p == "published"),
            f"the calls started were {starts}: only those run before the handoff may be")
    return c
