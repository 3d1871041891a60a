"""One test (at least) per invariant the core alone can show: I2, I5, I7, I9, I10, I11,
I12. Every refusal is checked to leave events, step, envelope, approvals and guardrail
results exactly as they were (`assert_refused`)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from statemachine import (
    Acknowledge,
    Action,
    Append,
    Execute,
    InvalidTransition,
    PublicationUnsettled,
    ReconcileRejected,
    RecoveryPolicy,
    Resend,
    RunController,
    RunNotResumable,
    SchemaError,
    Step,
    ToolCall,
    ToolInDoubt,
)
from tests.helpers import (
    AUDIT_OUT,
    CHARGE_CALL,
    CHARGE_OUT,
    SESSION,
    B,
    P,
    assert_refused,
    at_interruption,
    failed,
    reloaded,
    run_charge,
    staged,
)

# ------------------------------------------------------------------------------- I2

UNSETTLED_REFUSALS: dict[str, tuple[str, tuple[Any, ...], dict[str, Any]]] = {
    "approve": ("approve", ("notify",), {}),
    "reject": ("reject", ("notify", "no"), {}),
    "tool-start": ("begin_tool", ("notify",), {}),
    "tool-resend": ("begin_tool", ("charge",), {}),
    "hook": ("hook_ran", ("agent_end",), {}),
    "tool-hook": ("hook_ran", ("tool_start",), {"call_id": "notify"}),
    "guardrail": ("guardrail_evaluated", ("out", True), {"stage": "output"}),
    "model-call": ("begin_model_call", (), {}),
    "handoff": ("handoff", ("other-agent",), {}),
    "new-input": ("add_input", ([{"role": "user", "content": "more"}],), {}),
    "final-output": ("accept_final_output", ("done",), {}),
    "second-stage": ("stage_publication", ([CHARGE_OUT], P), {}),
    "complete": ("complete", (), {}),
}


@pytest.mark.invariant("I2")
@pytest.mark.parametrize("transport", ["live", "json"])
@pytest.mark.parametrize("command", list(UNSETTLED_REFUSALS))
def test_unsettled_refuses_before_recording(command: str, transport: str) -> None:
    c = staged() if transport == "live" else reloaded(failed())
    name, args, kwargs = UNSETTLED_REFUSALS[command]
    assert_refused(c, PublicationUnsettled, getattr(c, name), *args, **kwargs)


@pytest.mark.invariant("I2")
def test_resume_while_unsettled_records_nothing_and_says_reconcile() -> None:
    c = reloaded(failed())
    before = c.events
    assert c.resume() is Action.RECONCILE
    assert c.events == before
    assert c.step is Step.UNSETTLED


@pytest.mark.invariant("I2")
def test_unsettled_outranks_schema_errors() -> None:
    c = staged()
    assert_refused(c, PublicationUnsettled, c.add_input, [float("nan")])


# ------------------------------------------------------------------------------- I5


@pytest.mark.invariant("I5")
def test_interruptions_survive_and_approvals_are_not_resurrected() -> None:
    c = reloaded(failed())
    assert c.envelope is not None
    assert c.envelope.interruptions == ("notify",)
    assert c.pending_approvals == ("notify",)
    c.reconcile(P + B, SESSION)
    assert c.pending_approvals == ("notify",)
    for call_id in ("charge", "audit"):
        assert_refused(c, InvalidTransition, c.approve, call_id)
        assert_refused(c, InvalidTransition, c.reject, call_id)
    assert c.resume() is Action.AWAIT_DECISIONS
    c.reject("notify", "not now")
    assert c.pending_approvals == ()
    assert_refused(c, InvalidTransition, c.approve, "notify")


@pytest.mark.invariant("I5")
def test_decisions_bind_to_the_fingerprint_not_the_position() -> None:
    c = at_interruption()
    other = c.fingerprint("notify")
    assert_refused(c, InvalidTransition, c.approve, "charge", fingerprint=other)
    assert_refused(c, InvalidTransition, c.approve, "unknown")
    c.approve("charge", fingerprint=c.fingerprint("charge"))
    assert_refused(c, InvalidTransition, c.approve, "charge")


@pytest.mark.invariant("I5", "I10")
def test_a_forged_fingerprint_in_the_log_is_rejected_on_load() -> None:
    c = at_interruption()
    c.approve("charge")
    doc = c.to_json()
    doc["events"][-1]["fingerprint"] = "0" * 64
    with pytest.raises(InvalidTransition, match=r"event 6 .*fingerprint_matches"):
        RunController.from_json(doc)


# ------------------------------------------------------------------------------- I7

REJECTED_HISTORIES = {
    "partial-write": ([*P, CHARGE_CALL], SESSION, "partial write: 1 of the batch's 3"),
    "partial-write-two": ([*P, CHARGE_CALL, CHARGE_OUT], SESSION, "2 of the batch's 3"),
    "changed-history": ([{"role": "user", "content": "something else"}], SESSION,
                        "neither the pre-write frontier"),
    "another-writer": (P + B + [{"role": "user", "content": "later"}], SESSION,
                       "neither the pre-write frontier"),
    "reordered-batch": ([*P, CHARGE_OUT, CHARGE_CALL, AUDIT_OUT], SESSION, "neither"),
    "session-mismatch": (P, "session-2", "another Session"),
    "emptied-session": ([], SESSION, "neither"),
}


@pytest.mark.invariant("I7")
@pytest.mark.parametrize("case", list(REJECTED_HISTORIES))
def test_reconcile_fails_closed_and_keeps_the_envelope(case: str) -> None:
    c = reloaded(failed())
    history, session_id, says = REJECTED_HISTORIES[case]
    error = assert_refused(c, ReconcileRejected, c.reconcile, history, session_id)
    assert says in str(error)
    assert "must not be re-run" in str(error)
    # the same reconcile can be retried once the Session is repaired
    assert c.reconcile(P, SESSION) == Append(tuple(B))


@pytest.mark.invariant("I7")
def test_a_foreign_attempt_blocks_append_but_not_acknowledge() -> None:
    writer = staged()  # holds the attempt; its write may still land
    resumer = reloaded(writer)
    assert resumer.next_action() is Action.RECONCILE
    error = assert_refused(resumer, ReconcileRejected, resumer.reconcile, P, SESSION)
    assert "may still be writing" in str(error)
    assert resumer.reconcile(P + B, SESSION) == Acknowledge()


@pytest.mark.invariant("I7")
def test_take_over_is_recorded() -> None:
    resumer = reloaded(staged())
    decision = resumer.reconcile(P, SESSION, take_over=True)
    assert decision == Append(tuple(B))
    assert resumer.events[-1].take_over is True  # type: ignore[attr-defined]
    assert resumer.holds_attempt
    assert resumer.next_action() is Action.PUBLISH


@pytest.mark.invariant("I7")
def test_an_attempt_from_append_blocks_a_second_resumer() -> None:
    first = reloaded(failed())
    shared = first.to_json()
    assert isinstance(first.reconcile(P, SESSION), Append)
    second = RunController.from_json(first.to_json())
    assert_refused(second, ReconcileRejected, second.reconcile, P, SESSION)
    # a stale copy that never saw the Append decision is a concurrency problem for the
    # store (issue: durable runs); without a store it can still decide Append
    assert isinstance(RunController.from_json(shared).reconcile(P, SESSION), Append)


@pytest.mark.invariant("I7")
def test_reconcile_reads_only_the_tail() -> None:
    long_history = [{"old": i} for i in range(1000)] + P
    c = at_interruption()
    run_charge(c)
    c.stage_publication(B, long_history, call_ids=["charge", "audit"])
    c.publication_failed(RuntimeError("write failed"))
    c = reloaded(c)
    assert c.envelope is not None
    assert c.envelope.read_limit == len(B) + 1
    assert not c.envelope.frontier_whole
    assert len(c.envelope.frontier) == len(B) + 1
    assert c.reconcile(long_history[-c.envelope.read_limit:], SESSION) == Append(tuple(B))
    # items older than the tail are never read: rewriting them goes unseen (documented)
    rewritten = [{"rewritten": True}, *long_history[1:]]
    c3 = reloaded(failed_with_history(long_history))
    assert c3.reconcile(rewritten, SESSION) == Append(tuple(B))


def failed_with_history(history: list[Any]) -> RunController:
    c = at_interruption()
    run_charge(c)
    c.stage_publication(B, history, call_ids=["charge", "audit"])
    c.publication_failed(RuntimeError("write failed"))
    return c


@pytest.mark.invariant("I7")
def test_stage_refuses_a_history_too_short_to_tell_outcomes_apart() -> None:
    # P = [a, y, x, y], B = [x, y]: the 3-item tails of P and P + B are equal
    a, x, y = {"a": 1}, {"x": 1}, {"y": 1}
    c = RunController.start(run_id="short", session_id=SESSION)
    c.begin_model_call()
    c.model_responded([], output="o")
    c.accept_final_output("o")
    error = assert_refused(c, InvalidTransition, c.stage_publication, [x, y], [x, y, x, y][1:])
    assert "read at least 4 items" in str(error)
    c.stage_publication([x, y], [a, y, x, y])
    assert c.envelope is not None
    assert c.envelope.read_limit == 4


# ------------------------------------------------------------------------------- I9

ALL_COMMANDS: dict[str, tuple[str, tuple[Any, ...], dict[str, Any]]] = {
    **UNSETTLED_REFUSALS,
    "resume": ("resume", (), {}),
    "reconcile": ("reconcile", (P, SESSION), {}),
    "commit": ("publication_committed", (), {}),
    "fail": ("publication_failed", (RuntimeError("x"),), {}),
    "abandon": ("abandon", ("again",), {}),
    "tool-completed": ("tool_completed", ("notify", "x"), {}),
    "resolve": ("resolve_in_doubt", ("notify", "x"), {}),
    "model-failed": ("model_failed", (RuntimeError("x"),), {}),
    "model-responded": ("model_responded", ([],), {"output": "x"}),
}


def _terminal_runs() -> dict[str, RunController]:
    abandoned = at_interruption()
    abandoned.abandon("operator gave up")
    fail_closed = staged(RecoveryPolicy.FAIL_CLOSED)
    fail_closed.publication_failed(RuntimeError("write failed"))
    return {"abandoned": abandoned, "fail-closed-write-failed": fail_closed}


@pytest.mark.invariant("I9")
@pytest.mark.parametrize("transport", ["live", "json", "json-twice"])
@pytest.mark.parametrize("run", ["abandoned", "fail-closed-write-failed"])
def test_terminal_rejects_everything_and_survives_serialization(
    run: str, transport: str
) -> None:
    c = _terminal_runs()[run]
    for _ in range({"live": 0, "json": 1, "json-twice": 2}[transport]):
        c = reloaded(c)
    assert c.step is Step.TERMINAL_UNRECOVERABLE
    assert c.next_action() is Action.NOT_RESUMABLE
    for name, args, kwargs in ALL_COMMANDS.values():
        assert_refused(c, RunNotResumable, getattr(c, name), *args, **kwargs)
    assert c.step is Step.TERMINAL_UNRECOVERABLE


@pytest.mark.invariant("I9")
@pytest.mark.parametrize("command", sorted(set(ALL_COMMANDS) - {"abandon"}))
def test_fail_closed_unsettled_reload_refuses_all_but_abandon(command: str) -> None:
    c = reloaded(staged(RecoveryPolicy.FAIL_CLOSED))  # died during the write
    assert c.next_action() is Action.NOT_RESUMABLE
    name, args, kwargs = ALL_COMMANDS[command]
    error = assert_refused(c, RunNotResumable, getattr(c, name), *args, **kwargs)
    assert "outcome is unknown" in str(error)


@pytest.mark.invariant("I9")
def test_fail_closed_abandon_records_terminal() -> None:
    c = reloaded(staged(RecoveryPolicy.FAIL_CLOSED))
    c.abandon("write outcome unknown")
    assert c.step is Step.TERMINAL_UNRECOVERABLE
    assert reloaded(c).step is Step.TERMINAL_UNRECOVERABLE


@pytest.mark.invariant("I9")
def test_fail_closed_is_cleared_only_by_the_attempt_that_saw_the_write() -> None:
    c = staged(RecoveryPolicy.FAIL_CLOSED)
    assert c.next_action() is Action.PUBLISH
    assert_refused(c, RunNotResumable, c.reconcile, P + B, SESSION)
    c.publication_committed()
    assert c.step is Step.INTERRUPTION


@pytest.mark.invariant("I9")
def test_a_lossy_final_output_fails_closed_under_reconcile() -> None:
    c = RunController.start(run_id="lossy", session_id=SESSION)
    c.begin_model_call()
    c.model_responded([], output="<encoded object>")
    c.accept_final_output("<encoded object>", lossless=False)
    c.stage_publication([{"role": "assistant", "content": "<encoded object>"}], P)
    c.publication_failed(OSError("disk"))
    assert c.step is Step.TERMINAL_UNRECOVERABLE
    assert reloaded(c).next_action() is Action.NOT_RESUMABLE


# ------------------------------------------------------------------------------ I10


@pytest.mark.invariant("I10")
def test_replay_is_deterministic() -> None:
    c = failed()
    c.reconcile(P, SESSION)
    doc = c.to_json()
    again = RunController.from_json(doc)
    assert again.state == c.state
    assert again.to_json() == doc
    assert RunController.from_json(again.to_json()).to_json() == doc


def _forge(doc: dict[str, Any], how: str) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    events = doc["events"]
    staged_at = next(i for i, e in enumerate(events) if e["type"] == "PublicationStaged")
    if how == "approve-while-unsettled":
        events.insert(staged_at + 1, {"type": "CallApproved", "seq": staged_at + 1,
                                      "at": None, "call_id": "notify",
                                      "fingerprint": events[6]["fingerprint"],
                                      "by": None, "reason": None})
        for i, e in enumerate(events):
            e["seq"] = i
    elif how == "batch-item-altered":
        events[staged_at]["items"][1]["output"] = "charged 700"
    elif how == "continuation-altered":
        events[staged_at]["continuation"] = "run_again"
    elif how == "read-limit-altered":
        events[staged_at]["read_limit"] += 1
    elif how == "tool-run-twice":
        started = next(e for e in events if e["type"] == "ToolStarted")
        events.insert(staged_at, dict(started))
        for i, e in enumerate(events):
            e["seq"] = i
    elif how == "commit-without-attempt":
        events.append({"type": "PublicationCommitted", "seq": len(events), "at": None})
    return doc


@pytest.mark.invariant("I10")
@pytest.mark.parametrize("how", ["approve-while-unsettled", "batch-item-altered",
                                 "continuation-altered", "read-limit-altered",
                                 "tool-run-twice", "commit-without-attempt"])
def test_a_forged_log_is_rejected_on_load(how: str) -> None:
    doc = failed().to_json()
    with pytest.raises(InvalidTransition, match=r"event \d+ "):
        RunController.from_json(_forge(doc, how))


@pytest.mark.invariant("I10")
def test_a_sequence_gap_is_a_schema_error() -> None:
    doc = failed().to_json()
    del doc["events"][3]
    with pytest.raises(SchemaError, match="sequence gap"):
        RunController.from_json(doc)


# ------------------------------------------------------------------------------ I11


def _in_tools() -> RunController:
    c = RunController.start(run_id="tools", session_id=SESSION)
    c.begin_model_call()
    c.model_responded([ToolCall("pay", "pay", {"amount": 5}),
                       ToolCall("lookup", "lookup", {"q": "x"}, idempotent=True)])
    return c


@pytest.mark.invariant("I11")
def test_a_started_call_is_never_re_executed_after_a_restart() -> None:
    c = _in_tools()
    assert isinstance(c.begin_tool("pay"), Execute)  # the process dies while it runs
    assert c.next_action() is Action.RUN_TOOLS
    restarted = reloaded(c)
    assert restarted.in_doubt() == ("pay",)
    assert restarted.next_action() is Action.RESOLVE_IN_DOUBT
    error = assert_refused(restarted, ToolInDoubt, restarted.resume)
    assert "'pay'" in str(error)
    assert_refused(restarted, ToolInDoubt, restarted.begin_tool, "pay")
    assert_refused(restarted, InvalidTransition, restarted.tool_completed, "pay", "done")
    assert_refused(restarted, InvalidTransition, restarted.stage_publication, [{"a": 1}], P)
    restarted.resolve_in_doubt("pay", {"status": "operator confirmed"})
    assert restarted.begin_tool("pay") == Resend("pay", {"status": "operator confirmed"})
    assert restarted.resume() is Action.RUN_TOOLS


@pytest.mark.invariant("I11")
def test_an_idempotent_call_runs_again_with_a_new_start() -> None:
    c = _in_tools()
    c.begin_tool("lookup")
    restarted = reloaded(c)
    assert restarted.in_doubt() == ()
    assert isinstance(restarted.begin_tool("lookup"), Execute)
    assert restarted.state.calls["lookup"].starts == 2
    assert_refused(restarted, InvalidTransition, restarted.begin_tool, "lookup")


@pytest.mark.invariant("I11")
def test_the_live_controller_may_not_start_its_own_call_twice() -> None:
    c = _in_tools()
    c.begin_tool("pay")
    assert c.in_doubt() == ()
    assert_refused(c, InvalidTransition, c.begin_tool, "pay")
    assert_refused(c, InvalidTransition, c.resolve_in_doubt, "pay", "x")


# ------------------------------------------------------------------------------ I12


@pytest.mark.invariant("I12")
@pytest.mark.parametrize("transport", ["live", "json"])
def test_an_unpublished_result_is_resent_from_the_cache(transport: str) -> None:
    c = _in_tools()
    c.begin_tool("pay")
    c.tool_completed("pay", {"receipt": "r-1"})
    if transport == "json":
        c = reloaded(c)
    before = c.events
    resent = c.begin_tool("pay")
    assert resent == Resend("pay", {"receipt": "r-1"})
    assert c.events == before
    resent.result["receipt"] = "mutated by the caller"
    assert c.begin_tool("pay") == Resend("pay", {"receipt": "r-1"})
    assert_refused(c, InvalidTransition, c.begin_model_call)


@pytest.mark.invariant("I12")
def test_a_published_result_is_neither_resent_nor_run() -> None:
    c = _in_tools()
    c.begin_tool("pay")
    c.tool_completed("pay", "paid")
    out = {"type": "function_call_output", "call_id": "pay", "output": "paid"}
    c.stage_publication([out], P, call_ids=["pay"])
    c.publication_committed()
    assert c.step is Step.TOOLS  # lookup is still approved and unstarted
    assert_refused(c, InvalidTransition, c.begin_tool, "pay")
