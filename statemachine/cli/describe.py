"""A run described for a person: can it resume and what may be done (`verdict`), its
ledger in words (`call_status`), and everything ``inspect`` and the console show of it
(`describe`)."""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, Any

from statemachine.blocker import preview
from statemachine.cli.common import shown
from statemachine.cli.operate import blocker_json, waiting_json
from statemachine.values import Action, Phase

if TYPE_CHECKING:
    from statemachine.controller import RunController



def verdict(c: RunController) -> str:
    """One sentence: can the run resume, and what may the operator do."""
    from statemachine.values import Step

    action = c.next_action()
    if action is Action.NOT_RESUMABLE:
        if c.step is Step.COMPLETED:
            return "The run is completed: there is nothing to resume."
        if c.step is Step.UNSETTLED:
            return ("Cannot resume: a fail-closed publication is unsettled (the side effect "
                    "completed and the write's outcome is unknown); repair the Session and "
                    "start a new run, or abandon this one.")
        return "Cannot resume: the run is terminal and never resumes; start a new run."
    if action is Action.RESOLVE_IN_DOUBT:
        return (f"Blocked: call {shown(c.in_doubt()[0])!r} was started and never completed, "
                "so it is never re-run; an operator records its outcome (resolve_in_doubt) "
                "or abandons the run.")
    if action is Action.RECONCILE:
        return ("Resumable: a write's outcome is unknown; the next attempt reconciles with "
                "the Session (append if nothing landed, acknowledge if it did) and completed "
                "tools are never re-run.")
    if action is Action.AWAIT_DECISIONS:
        waiting = ", ".join(shown(a) for a in c.pending_approvals)
        return f"Resumable: waiting for decisions on {waiting}."
    return f"Resumable: the runner's next action is {action.value}."


def call_status(phase: Phase, *, rejected: bool, resolved: bool, in_doubt: bool,
                idempotent: bool, publishing: bool = False) -> str:
    """A ledger row in words. ``publishing``: the unsettled envelope publishes it."""
    if phase is Phase.STARTED:
        if in_doubt:
            return "started, outcome unknown: in doubt, never re-run automatically"
        if idempotent:
            return "started, outcome unknown: idempotent, so it may run again"
        return "started, outcome unknown"
    unpublished = ("its publication unsettled" if publishing else "not yet published")
    if rejected:
        return ("rejected, the rejection published" if phase is Phase.PUBLISHED
                else f"rejected, {unpublished}")
    done = "resolved by an operator" if resolved else "completed"
    return {
        Phase.AWAITING: "awaiting a decision",
        Phase.APPROVED: "approved, not started",
        Phase.REJECTED: f"rejected, {unpublished}",
        Phase.SKIPPED: "skipped: overtaken before it started, never runs",
        Phase.COMPLETED: f"{done}, result cached, {unpublished}",
        Phase.PUBLISHED: f"{done}, result published",
    }[phase]


def describe(c: RunController) -> dict[str, Any]:
    from statemachine import events as ev

    envelope = c.envelope
    rejected: set[str] = set()
    resolved: set[str] = set()
    for event in c.events:
        if isinstance(event, ev.CallRejected):
            rejected.add(event.call_id)
        elif isinstance(event, ev.InDoubtResolved):
            resolved.add(event.call_id)
    ledger = []
    in_doubt = set(c.in_doubt())
    publishing = set() if envelope is None else set(envelope.call_ids)
    for view in c.calls:
        call_id = view.call.call_id
        facts = {"rejected": call_id in rejected, "resolved": call_id in resolved,
                 "in_doubt": call_id in in_doubt, "idempotent": view.call.idempotent}
        ledger.append({
            "call_id": call_id, "tool": view.call.name, "phase": view.phase.value,
            "decisions": [{"kind": d.kind, "by": d.by, "reason": d.reason, "at": d.at,
                           "outcome": None if d.outcome is None else d.outcome.value,
                           "evidence": d.evidence}
                          for d in view.decisions],
            "fingerprint": c.fingerprint(call_id),
            "status": call_status(view.phase, **facts, publishing=call_id in publishing),
            "starts": view.starts, "ran": view.starts > 0,
            "arguments": preview(view.call.arguments),
            "result": None if view.result is None else preview(view.result),
            "cached": view.phase in (Phase.COMPLETED, Phase.REJECTED, Phase.PUBLISHED),
            "in_doubt": facts["in_doubt"], "idempotent": facts["idempotent"],
            "rejected": facts["rejected"],
            "outcome_unknown": view.phase is Phase.STARTED,
            "resolved_by_operator": facts["resolved"],
        })
    last = c.events[-1] if c.version else None
    return {
        "run_id": c.run_id,
        "step": c.step.value,
        "updated_at": None if last is None else last.at,
        "policy": c.policy.value,
        "session_id": c.session_id,
        "has_session": c.session_id is not None,
        "events": c.version,
        "pending_approvals": list(c.pending_approvals),
        "envelope": None if envelope is None else {
            "session_id": envelope.session_id,
            "frontier_items": len(envelope.frontier),
            "read_limit": envelope.read_limit,
            "batch_items": len(envelope.items),
            "publishes_calls": list(envelope.call_ids),
            "continuation": envelope.continuation.value,
            "pending_guardrail_results": len(envelope.guardrails),
            "fail_closed": envelope.fail_closed,
        },
        "published_guardrail_results": len(c.guardrail_results),
        "pending_guardrail_results": len(c.pending_guardrail_results),
        "ledger": ledger,
        "next_action": c.next_action().value,
        "blocker": blocker_json(c.blocker),
        "waiting": [waiting_json(w) for w in c.waiting],
        "verdict": verdict(c),
    }


def when(at: int | None) -> str:
    """An event's ``at`` in words: ISO 8601 in UTC, to the millisecond (an unknown time
    for a log written before time was recorded)."""
    if at is None:
        return "at an unknown time"
    try:
        moment = datetime.datetime.fromtimestamp(at / 1_000_000, tz=datetime.UTC)
    except (OverflowError, ValueError, OSError):
        return f"at {at} µs since the epoch"
    return f"at {moment.isoformat(timespec='milliseconds').replace('+00:00', 'Z')}"


def decision_note(decision: dict[str, Any]) -> str:
    """One decision of a ledger row in words: what, who, when, why and on what evidence."""
    kind = decision["kind"]
    if decision.get("outcome") is not None:
        kind = f"{kind} {decision['outcome']}"
    who = f" by {shown(decision['by'])}" if decision["by"] is not None else ""
    why = f" ({shown(decision['reason'])})" if decision["reason"] is not None else ""
    evidence = decision.get("evidence")
    shown_evidence = f" [evidence {shown(evidence)}]" if evidence is not None else ""
    return f"{kind}{who} {when(decision['at'])}{why}{shown_evidence}"


