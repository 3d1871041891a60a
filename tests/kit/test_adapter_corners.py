"""The SDK-neutral adapter corner cases of `statemachine.testing.adapter_corners` (the
players that drive each SDK are in tests/adapters/test_*_corners.py): the module imports
no SDK, the enumerators reach every corner they name, what each case expects is what its
words say, and each check fails on an observation that breaks the case."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import attrs
import pytest

from statemachine import ConcurrencyConflict, ToolInDoubt
from statemachine import events as ev
from statemachine.testing import (
    Boundary,
    CallKind,
    CaseFailed,
    Decision,
    DecisionMixCase,
    DecisionSeen,
    Fence,
    OlderState,
    OneWriterSeen,
    OutputCase,
    OutputSeen,
    RecordedFault,
    ReplyCase,
    ReplySeen,
    RivalPoint,
    StaleMove,
    StaleSeen,
    StaleStateCase,
    boundary_of,
    check_decision_mix,
    check_one_writer,
    check_output,
    check_reply,
    check_stale_state,
    every_decision_mix_case,
    every_one_writer_case,
    every_output_case,
    every_recorded_fault_case,
    every_reply_case,
    every_stale_state_case,
)
from statemachine.testing.adapter_corners import COMPLETED, DECIDED, RECORDED, WRITTEN
from statemachine.values import Resolution, ToolCall

SDKS = ("agents", "openai", "pydantic", "pydantic_ai", "anthropic", "langgraph",
        "langchain", "langchain_core", "google")

NEW, CACHED, IN_DOUBT = CallKind
CONFIRMED, REJECTED = Decision


def test_the_generators_import_no_sdk() -> None:
    code = ("import sys, statemachine.testing.adapter_corners; "
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({SDKS!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def test_every_reply_case_holds_every_order_of_every_mix() -> None:
    cases = every_reply_case(3)
    kinds = {case.kinds for case in cases}
    assert len(kinds) == 3 + 9 + 27
    assert (NEW, CACHED, IN_DOUBT) in kinds
    assert (IN_DOUBT, CACHED, NEW) in kinds
    # the variants (the same object, NOT_EXECUTED) for every mix of up to two calls
    assert ReplyCase((CACHED, IN_DOUBT), Resolution.NOT_EXECUTED, False) in cases
    assert ReplyCase((NEW, NEW, NEW), Resolution.COMPLETED, True) in cases
    assert len(cases) == len(set(cases))


def test_a_reply_case_expects_what_its_kinds_say() -> None:
    case = ReplyCase((NEW, IN_DOUBT, CACHED, IN_DOUBT))
    assert case.refused_by == "c1"  # the first call in doubt
    assert case.runs_after == {"c0": 1, "c1": 0, "c2": 0, "c3": 0}
    assert case.sent == {"c0": case.result_text("c0"), "c1": case.settled_text("c1"),
                         "c2": case.result_text("c2"), "c3": case.settled_text("c3")}
    again = ReplyCase((IN_DOUBT,), Resolution.NOT_EXECUTED)
    assert again.runs_after == {"c0": 1}
    assert again.sent == {"c0": again.result_text("c0")}
    assert ReplyCase((CACHED, NEW)).refused_by is None


def _seen(case: ReplyCase, **changes: Any) -> ReplySeen:
    pairs = list(case.sent.items())
    seen = ReplySeen(refused_by=case.refused_by, runs=case.runs_after, sent=pairs,
                     model_calls=1, written=pairs, completed=True)
    return attrs.evolve(seen, **changes)


@pytest.mark.parametrize("broken", [
    {"refused_by": None},  # the call in doubt was not refused
    {"refused_did": 1},  # the refused resume ran a new call before refusing
    {"runs": {"c0": 1, "c1": 1, "c2": 0}},  # the cached call ran again
    {"runs": {"c0": 0, "c1": 0, "c2": 0}},  # the new call never ran
    {"model_calls": 2},  # the reply was asked again
    {"written": []},  # nothing written
    {"completed": False},
])
def test_check_reply_fails_on_an_observation_that_breaks_the_case(
        broken: dict[str, Any]) -> None:
    case = ReplyCase((NEW, CACHED, IN_DOUBT))
    check_reply(case, _seen(case))  # the case's own outcome passes
    with pytest.raises(CaseFailed):
        check_reply(case, _seen(case, **broken))


def test_check_reply_fails_on_a_duplicate_or_altered_output() -> None:
    case = ReplyCase((CACHED, NEW))
    pairs = list(case.sent.items())
    with pytest.raises(CaseFailed, match="exactly once"):
        check_reply(case, _seen(case, sent=[*pairs, pairs[0]]))
    altered = [("c0", case.result_text("c0").replace("✓", "?")), pairs[1]]
    with pytest.raises(CaseFailed, match="the case says"):
        check_reply(case, _seen(case, written=altered))


def test_the_fault_and_stale_enumerators() -> None:
    faults = every_recorded_fault_case()
    assert {case.fault for case in faults} == set(RecordedFault)
    # a write that landed is acknowledged by the next attempt: it cannot fail twice
    assert not [c for c in faults if c.fault is RecordedFault.WRITE_LANDED and c.repeats == 2]
    assert [c.requests for c in faults if c.fault is RecordedFault.REQUEST_FAILED] == [
        3, 3, 4, 4]
    assert len(every_stale_state_case()) == 8
    both = every_stale_state_case(before_reply=True)
    assert both[:8] == every_stale_state_case()
    assert len(both) == len(set(both)) == 16
    assert [c.moved for c in both if c.refusal_allowed] == [DECIDED, DECIDED, RECORDED,
                                                            RECORDED, WRITTEN, WRITTEN]


def _stale(case: StaleStateCase, **changes: Any) -> StaleSeen:
    pairs = [(case.call_id, case.result)]
    seen = StaleSeen(runs=1, error=None, completed=True,
                     replayed=case.moved == COMPLETED,
                     model_calls=0 if case.moved == COMPLETED else 1, sent=pairs,
                     written=pairs)
    return attrs.evolve(seen, **changes)


def test_a_state_saved_before_the_reply_may_be_refused_before_any_effect() -> None:
    early = StaleStateCase(RECORDED, before_reply=True)
    refused = _stale(early, error=ToolInDoubt("call 'c0' lacks its reply", call_id="c0"),
                     completed=False, model_calls=0, sent=[], written=[])
    check_stale_state(early, refused)  # a typed refusal naming the call
    check_stale_state(early, _stale(early))  # or it completes, as from the pause
    broken_ones: list[tuple[dict[str, Any], str]] = [
        ({"error": RuntimeError("c0")}, "typed"),
        ({"error": ConcurrencyConflict("another writer")}, "name"),
        ({"model_calls": 1}, "asked the model"), ({"runs": 2}, "ran")]
    for broken, why in broken_ones:
        with pytest.raises(CaseFailed, match=why):
            check_stale_state(early, attrs.evolve(refused, **broken))
    decided = StaleStateCase(DECIDED, before_reply=True)
    check_stale_state(decided, attrs.evolve(refused, runs=0))  # nothing ran before it
    with pytest.raises(CaseFailed, match="ran 1 times"):
        check_stale_state(decided, refused)
    # at the pause, or once the run completed, a refusal is never the case's end
    for case in (StaleStateCase(RECORDED), StaleStateCase(COMPLETED, before_reply=True)):
        with pytest.raises(CaseFailed, match="the case says it completes"):
            check_stale_state(case, attrs.evolve(refused, runs=1))


def test_one_writer_cases_expect_one_run_in_all() -> None:
    cases = {case.rival_at: case for case in every_one_writer_case()}
    assert set(cases) == set(RivalPoint)
    body = cases[RivalPoint.TOOL_BODY]
    assert (body.first_runs, body.rival_outcome) == (1, "ToolInDoubt")
    loaded = cases[RivalPoint.LOADED]
    assert (loaded.first_runs, loaded.first_model_calls, loaded.rival_outcome) == (
        0, 0, "completed")
    seen = OneWriterSeen(first_outcome="ConcurrencyConflict", first_runs=0,
                         first_model_calls=1, first_writes_after=0, rival_outcome="completed",
                         rival_runs=1, written=[("c0", ReplyCase.result_text("c0"))])
    check_one_writer(cases[RivalPoint.MODEL_CALL], seen)
    with pytest.raises(CaseFailed, match="ran the tool 1 times"):
        check_one_writer(cases[RivalPoint.MODEL_CALL],
                         attrs.evolve(seen, first_runs=1))
    with pytest.raises(CaseFailed, match="wrote"):
        check_one_writer(cases[RivalPoint.MODEL_CALL],
                         attrs.evolve(seen, first_writes_after=1))


def _stale_seen(case: StaleStateCase, **changes: Any) -> StaleSeen:
    """What a player of ``case`` sees when the adapter does what the case says."""
    seen = StaleSeen(runs=1, error=ConcurrencyConflict("moved on") if case.refused else None,
                     completed=True, replayed=case.replayed, model_calls=case.model_calls,
                     sent=[(case.call_id, case.result)], written=[(case.call_id, case.result)])
    return attrs.evolve(seen, **changes)


def test_an_older_state_is_refused_only_once_the_run_moved_past_the_decision() -> None:
    for older in OlderState:
        cases = every_stale_state_case(older)
        assert len(cases) == 8
        assert {case.older for case in cases} == {older}
    refused = {case.moved for case in every_stale_state_case(OlderState.REFUSED)
               if case.refused}
    assert refused == {StaleMove.RECORDED, StaleMove.WRITTEN, StaleMove.COMPLETED}
    assert not any(case.refused for older in (OlderState.FOLLOWED, OlderState.FORKED)
                   for case in every_stale_state_case(older))
    # a branch never replays a completed run: the adapter kept no final output
    done = {older: StaleStateCase(StaleMove.COMPLETED, older=older) for older in OlderState}
    assert [(c.replayed, c.model_calls) for c in done.values()] == [(True, 0), (True, 0),
                                                                   (False, 1), (False, 0)]
    for older in OlderState:
        for case in every_stale_state_case(older):
            check_stale_state(case, _stale_seen(case))  # the case's own outcome passes


@pytest.mark.parametrize(("older", "moved", "broken"), [
    (OlderState.REFUSED, StaleMove.RECORDED, {"error": None}),  # the fork went through
    (OlderState.REFUSED, StaleMove.WRITTEN, {"error": RuntimeError("x")}),  # untyped
    (OlderState.REFUSED, StaleMove.COMPLETED, {"refused_did": 1}),  # asked the model first
    (OlderState.REFUSED, StaleMove.DECIDED, {"error": ConcurrencyConflict("x")}),
    (OlderState.FORKED, StaleMove.COMPLETED, {"replayed": True, "model_calls": 0}),
    (OlderState.FORKED, StaleMove.RECORDED, {"runs": 2}),  # the branch ran it again
    (OlderState.FOLLOWED, StaleMove.COMPLETED, {"model_calls": 1, "replayed": False}),
    (OlderState.RESENT, StaleMove.RECORDED, {"refused_did": 1}),  # ran or asked on it
    (OlderState.RESENT, StaleMove.WRITTEN, {"error": RuntimeError("x")}),  # untyped
    (OlderState.RESENT, StaleMove.COMPLETED, {"model_calls": 1}),  # asked again
    (OlderState.RESENT, StaleMove.DECIDED, {"error": ConcurrencyConflict("x")}),
])
def test_check_stale_state_fails_on_an_observation_that_breaks_the_case(
        older: OlderState, moved: StaleMove, broken: dict[str, Any]) -> None:
    case = StaleStateCase(moved, older=older)
    check_stale_state(case, _stale_seen(case))
    with pytest.raises(CaseFailed):
        check_stale_state(case, _stale_seen(case, **broken))


def test_under_a_checkpoint_fence_the_first_resumer_to_write_goes_on() -> None:
    cases = {case.rival_at: case for case in every_one_writer_case(Fence.CHECKPOINT)
             if case.buffered}
    result = [("c0", ReplyCase.result_text("c0"))]
    for point, case in cases.items():
        assert case.written == result  # one of the two always goes on
        assert (case.first_outcome == "completed") is (point is RivalPoint.TOOL_BODY)
        assert (case.rival_outcome == "completed") is (point is not RivalPoint.TOOL_BODY)
    body = cases[RivalPoint.TOOL_BODY]
    assert (body.first_runs, body.first_model_calls, body.rival_outcome) == (
        1, 2, "ConcurrencyConflict")
    loaded = cases[RivalPoint.LOADED]
    assert (loaded.first_runs, loaded.first_model_calls) == (0, 1)  # its first step ran
    seen = OneWriterSeen(first_outcome="completed", first_runs=1, first_model_calls=2,
                         first_writes_after=3, rival_outcome="ConcurrencyConflict",
                         rival_runs=0, written=result)
    check_one_writer(body, seen)  # the winner's writes are its own business
    with pytest.raises(CaseFailed, match="refused rival wrote"):
        check_one_writer(body, attrs.evolve(seen, rival_writes=1))
    with pytest.raises(CaseFailed, match="once in all"):
        check_one_writer(body, attrs.evolve(seen, rival_runs=1))
    with pytest.raises(CaseFailed, match="ended ConcurrencyConflict"):
        check_one_writer(body, attrs.evolve(seen, first_outcome="ConcurrencyConflict"))


def test_boundary_of_reads_the_crash_point_from_event_types() -> None:
    answered = ev.ModelResponded(3, (), "hi")
    accepted = ev.FinalOutputAccepted(4, "hi", True)
    staged = ev.PublicationStaged.__new__(ev.PublicationStaged)
    committed = ev.PublicationCommitted.__new__(ev.PublicationCommitted)
    with_calls = ev.ModelResponded(3, (ToolCall("c0", "pay", {}),), None)
    assert boundary_of([]) is Boundary.BEFORE_ANSWER
    assert boundary_of([with_calls]) is Boundary.BEFORE_ANSWER  # a reply with calls
    assert boundary_of([answered]) is Boundary.ANSWERED
    assert boundary_of([answered, accepted]) is Boundary.ACCEPTED
    assert boundary_of([answered, accepted, staged]) is Boundary.STAGED
    assert boundary_of([answered, accepted, staged], written=True) is Boundary.WRITTEN
    assert boundary_of([answered, accepted, staged, committed]) is Boundary.COMPLETED


def test_a_lossy_output_is_never_rebuilt_and_fails_closed_once_staged() -> None:
    outcomes = {(case.shape.value, case.boundary.value): case.outcome
                for case in every_output_case()}
    assert outcomes["text", "staged"] == "completed"
    assert outcomes["dataclass", "staged"] == outcomes["model", "written"] == "RunNotResumable"
    assert outcomes["dataclass", "completed"] == "replayed"
    lossy = OutputCase(every_output_case()[-1].shape, Boundary.COMPLETED)
    recorded = {"amount": "7.10"}

    class Rebuilt:
        pass

    seen = OutputSeen(outcome="replayed", output=recorded, recorded=recorded, lossless=False,
                      model_calls=0, written=1)
    check_output(lossy, seen, object(), output_type=Rebuilt)
    with pytest.raises(CaseFailed, match=r"rebuilt|recorded form"):
        check_output(lossy, attrs.evolve(seen, output=Rebuilt()),
                     object(), output_type=Rebuilt)
    with pytest.raises(CaseFailed, match="lossless"):
        check_output(lossy, attrs.evolve(seen, lossless=True),
                     object(), output_type=Rebuilt)


def test_a_reparsed_reply_keeps_every_shape_whole() -> None:
    """An adapter recording the reply as the API sent it (the answer's text) never needs
    to fail closed: every shape is lossless and handed back as it was."""
    cases = every_output_case(reparsed=True)
    assert all(case.lossless and case.same_output for case in cases)
    assert {case.outcome for case in cases} == {"completed", "replayed"}
    done = OutputCase(cases[-1].shape, Boundary.COMPLETED, reparsed=True)

    class Rebuilt:
        def __repr__(self) -> str:
            return "Rebuilt()"

    seen = OutputSeen(outcome="replayed", output=Rebuilt(), recorded={"text": "{}"},
                      lossless=True, model_calls=0, written=1)
    check_output(done, seen, Rebuilt(), output_type=Rebuilt)
    with pytest.raises(CaseFailed, match="differs"):
        check_output(done, attrs.evolve(seen, output={"text": "{}"}), Rebuilt(),
                     output_type=Rebuilt)
    with pytest.raises(CaseFailed, match="lossless"):
        check_output(done, attrs.evolve(seen, lossless=False), Rebuilt(),
                     output_type=Rebuilt)


def test_every_decision_mix_holds_a_decision_in_every_order() -> None:
    cases = every_decision_mix_case(3)
    mixes = {case.kinds for case in cases}
    assert len(mixes) == (4 - 2) + (16 - 4) + (64 - 8)  # the mixes with a decision
    assert (NEW, CONFIRMED, REJECTED) in mixes
    assert (REJECTED, CACHED, CONFIRMED) in mixes
    assert (NEW, CACHED) not in mixes  # every_reply_case's
    assert DecisionMixCase((CACHED, REJECTED), reload=False) in cases
    assert DecisionMixCase((NEW, CACHED, CONFIRMED), reload=False) not in cases
    assert len(cases) == len(set(cases))


def test_a_decision_mix_expects_what_its_kinds_say() -> None:
    case = DecisionMixCase((NEW, CONFIRMED, CACHED, REJECTED))
    assert case.asked == ["c1", "c3"]
    assert case.runs_after == {"c0": 1, "c1": 1, "c2": 0, "c3": 0}
    assert case.rejected == ["c3"]
    assert case.label == "new-confirmed-cached-rejected"


def _decided(case: DecisionMixCase, **changes: Any) -> DecisionSeen:
    rejection = "rejected by the user"
    pairs = [(i, rejection if i in case.rejected else ReplyCase.result_text(i))
             for i in case.ids]
    seen = DecisionSeen(asked=case.asked, runs=case.runs_after, sent=pairs, model_calls=1,
                        written=pairs, rejection=rejection, completed=True)
    return attrs.evolve(seen, **changes)


@pytest.mark.parametrize("broken", [
    {"asked": ["c1"]},  # a decision never asked
    {"asked": ["c1", "c1", "c3"]},  # one asked twice
    {"runs": {"c0": 1, "c1": 1, "c2": 0, "c3": 1}},  # the rejected call ran
    {"runs": {"c0": 1, "c1": 0, "c2": 0, "c3": 0}},  # the confirmed call never ran
    {"runs": {"c0": 1, "c1": 1, "c2": 1, "c3": 0}},  # the cached call ran again
    {"model_calls": 2},  # the pause asked the model
    {"rejection": ReplyCase.result_text("c3")},  # the rejected call's result was sent
    {"completed": False},
])
def test_check_decision_mix_fails_on_an_observation_that_breaks_the_case(
        broken: dict[str, Any]) -> None:
    case = DecisionMixCase((NEW, CONFIRMED, CACHED, REJECTED))
    check_decision_mix(case, _decided(case))  # the case's own outcome passes
    with pytest.raises(CaseFailed):
        check_decision_mix(case, _decided(case, **broken))


def test_check_decision_mix_fails_on_a_duplicate_or_placeholder_output() -> None:
    case = DecisionMixCase((CONFIRMED, NEW))
    pairs = list(_decided(case).sent)
    with pytest.raises(CaseFailed, match="exactly once"):
        check_decision_mix(case, _decided(case, written=[*pairs, ("c0", "asking")]))
    with pytest.raises(CaseFailed, match="the case says"):
        check_decision_mix(case, _decided(case, sent=[("c0", "asking"), pairs[1]]))


def test_a_decision_sent_again_changes_nothing_once_the_sdk_acted_on_it() -> None:
    cases = {case.moved: case for case in every_stale_state_case(OlderState.RESENT)
             if case.reload}
    assert [case.stale for case in cases.values()] == [False, True, True, True]
    assert not any(case.refused or case.replayed for case in cases.values())
    for case in cases.values():
        check_stale_state(case, _stale_seen(case))
    for moved in (StaleMove.RECORDED, StaleMove.WRITTEN, StaleMove.COMPLETED):
        refused = ConcurrencyConflict("unsettled")  # ignored, or refused with a typed error
        check_stale_state(cases[moved], _stale_seen(cases[moved], error=refused))
