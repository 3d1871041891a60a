"""Generators for the corners random walks seldom reach (issue 32), each played against
an expected outcome written from the case alone, never read from the controller, and
driven to the run's end (liveness): a corner that leaves a run stuck fails too.

`handoff_cases`: a handoff from every mix of call phases a reachable run can hold: calls
still undecided, approved and not started, rejected (their rejection not yet published),
run and published in an earlier batch, started and not completed (held in flight, or in
doubt once the run is reloaded), and completed with their result unpublished; the mix
may be empty (a handoff straight from ``RUN_AGAIN``) or hold nothing awaiting a decision
(every call decided, the run still in ``INTERRUPTION``), and the run may be reloaded
from its JSON just before each handoff. `play_handoff` plays one: a started or completed
call holds the run in ``TOOLS``, where the handoff is refused with nothing changed; the
call is then finished (or, in doubt, refused by ``resume`` and settled by an operator's
``resolve_in_doubt``) and published, and the handoff taken. After it every call not
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
from statemachine.errors import (
    ControlError,
    InvalidTransition,
    ToolInDoubt,
)
from statemachine.payloads import JSON
from statemachine.testing.invariants import check_log
from statemachine.values import Phase, Step, ToolCall

__all__ = ["AT_WORK", "CALL_PHASES", "CaseFailed", "HandoffCase", "handoff_cases",
           "play_handoff", "snapshot"]


class CaseFailed(AssertionError):
    """The run did not do what its case says it must (the message says what it did)."""

CALL_PHASES = ("undecided", "approved", "rejected", "published", "started", "completed")
"""What a call can be when a handoff is asked for: awaiting a decision; approved, not
started; rejected, its rejection unpublished; run, its result published in an earlier
batch; started and not completed (in flight, or in doubt after a reload); completed,
its result unpublished. The last two hold the run in ``TOOLS``, where the handoff is
refused until they are published."""

AT_WORK = ("started", "completed")
"""The phases that hold the run in ``TOOLS``: a handoff is refused while a call has one."""

AFTER_HANDOFF = {"undecided": Phase.SKIPPED, "approved": Phase.SKIPPED,
                 "rejected": Phase.REJECTED, "published": Phase.PUBLISHED,
                 "started": Phase.PUBLISHED, "completed": Phase.PUBLISHED}
"""The expected phase of each call after the handoff is taken."""


@attrs.frozen
class HandoffCase:
    phases: tuple[str, ...]
    """Each call's phase at the handoff (`CALL_PHASES`), in proposal order."""
    reload: bool
    """Reload the run from its JSON just before each handoff asked for (a started call
    is then in doubt)."""

    @property
    def ids(self) -> list[str]:
        return [f"c{i}" for i in range(len(self.phases))]

    def having(self, *phases: str) -> list[str]:
        """The calls with any of ``phases``, in proposal order."""
        return [i for i, p in zip(self.ids, self.phases, strict=True) if p in phases]

    @property
    def pending(self) -> list[str]:
        """The calls whose rejection the next batch must publish."""
        return self.having("rejected")


def handoff_cases() -> st.SearchStrategy[HandoffCase]:
    """Every mix of up to five calls' phases (`CALL_PHASES`), reloaded or not."""
    return st.builds(HandoffCase, st.lists(st.sampled_from(CALL_PHASES), max_size=5).map(tuple),
                     st.booleans())


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise CaseFailed(what)


def _refused(do: Any, what: str, error: type[ControlError] = InvalidTransition) -> None:
    """``do()`` must raise ``error`` (exactly that type)."""
    try:
        do()
    except ControlError as refusal:
        if type(refusal) is not error:
            raise CaseFailed(f"{what} was refused with {type(refusal).__name__}, not "
                             f"{error.__name__}") from refusal
        return
    raise CaseFailed(f"{what} was not refused")


def snapshot(c: RunController) -> tuple[Any, ...]:
    """Everything a refused command must leave exactly as it was: the log, the step, the
    envelope, the decisions, the guardrail results, the ledger, the attempt and the calls
    in flight."""
    return (c.events, c.step, c.envelope, c.pending_approvals, c.guardrail_results,
            c.calls, c.holds_attempt, c.in_flight, c.in_doubt())


def _refused_unchanged(c: RunController, do: Any, what: str,
                       error: type[ControlError] = InvalidTransition) -> None:
    before = snapshot(c)
    _refused(do, what, error)
    _expect(snapshot(c) == before, f"{what}, refused, changed the run")


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
    ids, at_work = case.ids, case.having(*AT_WORK)
    if ids:
        c.begin_model_call()
        c.model_responded([ToolCall(i, "tool", {"call": i}, needs_approval=p != "published")
                           for i, p in zip(ids, case.phases, strict=True)])
        ran = case.having("published")
        if ran:
            c.resume()  # calls needing no approval run while the others await a decision
            for call_id in ran:
                c.begin_tool(call_id)
                c.tool_completed(call_id, f"ran {call_id}")
            _publish(c, history, _results(ran), ran)
        if at_work:
            c = _hold_in_tools(c, case, history)
    _decide(c, case)
    _expect(c.step is (Step.INTERRUPTION if case.having("undecided", "approved", "rejected")
                       else Step.RUN_AGAIN), f"before the handoff the run is in {c.step}")
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
    _expect(sorted(starts) == sorted(case.having("published", *AT_WORK)),
            f"the calls started were {starts}: each call run before the handoff, once")
    return c


def _results(call_ids: Sequence[str]) -> list[JSON]:
    """A batch publishing these calls' results: each call's item, then its output."""
    items: list[JSON] = []
    for call_id in call_ids:
        items += [{"type": "function_call", "call_id": call_id}, _output(call_id)]
    return items


def _hold_in_tools(c: RunController, case: HandoffCase, history: list[JSON]
                   ) -> RunController:
    """Start the case's started and completed calls (the run enters ``TOOLS``), ask for
    the handoff (refused there, nothing changed), then drive on: finish the call in
    flight, or, reloaded, see ``resume`` and ``begin_tool`` refuse the call in doubt and
    settle it as an operator would; publish them all. The calls the case leaves
    approved or rejected are decided after (decided before, they would hold the run in
    ``TOOLS`` too). Returns the controller the run goes on with."""
    at_work, started = case.having(*AT_WORK), case.having("started")
    for call_id in at_work:
        c.approve(call_id, fingerprint=c.fingerprint(call_id))
    c.resume()
    for call_id in at_work:
        c.begin_tool(call_id)
        if call_id not in started:
            c.tool_completed(call_id, f"ran {call_id}")
    if case.reload:
        c = RunController.from_json(c.to_json())
    _expect(c.step is Step.TOOLS, f"with calls at work the run is in {c.step}, not TOOLS")
    _refused_unchanged(c, lambda: c.handoff("next"), "a handoff with calls at work")
    for call_id in started:
        if case.reload:  # in doubt: never re-run, settled from outside
            _refused_unchanged(c, c.resume, f"resuming with {call_id} in doubt", ToolInDoubt)
            _refused_unchanged(c, lambda i=call_id: c.begin_tool(i),
                               f"running {call_id} in doubt", ToolInDoubt)
            c.resolve_in_doubt(call_id, f"ran {call_id}", by="operator")
        else:
            _expect(call_id in c.in_flight, f"call {call_id} is not held in flight")
            c.tool_completed(call_id, f"ran {call_id}")
    _publish(c, history, _results(at_work), at_work)
    return c


def _decide(c: RunController, case: HandoffCase) -> None:
    for call_id, phase in zip(case.ids, case.phases, strict=True):
        if phase == "approved":
            c.approve(call_id, fingerprint=c.fingerprint(call_id))
        elif phase == "rejected":
            c.reject(call_id, f"no {call_id}", fingerprint=c.fingerprint(call_id))
