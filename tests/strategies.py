"""A random driver of reachable runs: it asks the controller what to do next and picks one
of the legal moves (and sometimes an abandon or a reload), with a simulated Session whose
writes may land, not land, or land and report failure."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from statemachine import (
    Action,
    Append,
    RecoveryPolicy,
    RunController,
    Step,
    ToolCall,
)
from statemachine.values import Phase


class Driven:
    """A run being driven, with its simulated Session."""

    def __init__(self, controller: RunController) -> None:
        self.c = controller
        self.session: list[Any] = []
        self.batch: list[Any] = []
        self.next_call = 0


def start_run(data: st.DataObject, run_id: str = "driven", **kw: Any) -> Driven:
    session_id = data.draw(st.sampled_from(["s", None]), label="session")
    policy = data.draw(st.sampled_from([RecoveryPolicy.RECONCILE] * 3
                                       + [RecoveryPolicy.FAIL_CLOSED]), label="policy")
    max_turns = data.draw(st.sampled_from([None, 3]), label="max_turns")
    return Driven(RunController.start(run_id=run_id, session_id=session_id, policy=policy,
                                      max_turns=max_turns, **kw))


def _unpublished(c: RunController) -> list[str]:
    return [i for i, r in c.state.calls.items() if r.phase in (Phase.COMPLETED, Phase.REJECTED)]


def _publish(d: Driven, data: st.DataObject) -> None:
    c = d.c
    ids = _unpublished(c)
    items = [{"call_id": i, "output": c.state.calls[i].result} for i in ids]
    if c.step is Step.FINAL_OUTPUT or not items:
        items.append({"role": "assistant", "n": len(c.events)})
    history = d.session[-(len(items) + 1):]
    c.stage_publication(items, history, call_ids=ids)
    d.batch = items
    _write(d, data)


def _write(d: Driven, data: st.DataObject) -> None:
    outcome = data.draw(st.sampled_from(["ok", "ok", "no-commit", "commit-then-raise"]),
                        label="write")
    if outcome != "no-commit":
        d.session.extend(d.batch)
    if outcome == "ok":
        d.c.publication_committed()
    else:
        d.c.publication_failed(OSError("injected"))


def step(d: Driven, data: st.DataObject) -> bool:
    """One move; False once the run can do nothing more."""
    c = d.c
    action = c.next_action()
    roll = data.draw(st.integers(0, 99), label="roll")
    if action is Action.NOT_RESUMABLE:
        return False
    if roll < 1:
        c.abandon("driver")
        return True
    if roll < 10:
        d.c = RunController.from_json(c.to_json())
        return True
    if action is Action.RESOLVE_IN_DOUBT:
        c.resolve_in_doubt(c.in_doubt()[0], "resolved")
    elif action is Action.RECONCILE:
        assert c.envelope is not None
        decision = c.reconcile(d.session[-c.envelope.read_limit:], c.session_id,
                               take_over=True)
        if isinstance(decision, Append):
            d.batch = list(decision.items)
            _write(d, data)
    elif action is Action.CALL_MODEL:
        if c.step is not Step.AWAITING_MODEL:
            if c.state.max_turns is not None and c.state.turns >= c.state.max_turns:
                c.abandon("max_turns")
                return True
            c.begin_model_call()
        if roll < 15:
            c.model_failed(TimeoutError())
            return True
        count = data.draw(st.integers(0, 3), label="calls")
        calls = []
        for _ in range(count):
            d.next_call += 1
            calls.append(ToolCall(f"c{d.next_call}", "tool", {"n": d.next_call},
                                  needs_approval=data.draw(st.booleans(), label="approval"),
                                  idempotent=data.draw(st.booleans(), label="idempotent")))
        c.model_responded(calls, output=None if calls else "answer")
    elif action is Action.AWAIT_DECISIONS:
        call_id = data.draw(st.sampled_from(c.pending_approvals), label="decide")
        if roll < 60:
            c.approve(call_id, fingerprint=c.fingerprint(call_id))
        elif roll < 90:
            c.reject(call_id, "declined")
        else:
            c.handoff("other")
    elif action is Action.RUN_TOOLS:
        if c.step is Step.INTERRUPTION:
            c.resume()
            return True
        runnable = [i for i, r in c.state.calls.items() if r.phase == Phase.APPROVED
                    or (r.phase == Phase.STARTED and i not in c.in_doubt())]
        call_id = data.draw(st.sampled_from(runnable), label="tool")
        record = c.state.calls[call_id]
        if record.phase == Phase.APPROVED or call_id not in c.in_flight:
            c.begin_tool(call_id)
            if roll < 20:
                return True  # left in flight: a reload now puts it in doubt
        c.guardrail_evaluated("tool_out", {"ok": True}, stage="tool_output", call_id=call_id)
        c.tool_completed(call_id, f"result of {call_id}")
        if roll > 92 and not c.state.count(Phase.STARTED):
            c.accept_final_output(f"result of {call_id}")
    elif action is Action.PUBLISH:
        if c.holds_attempt:
            _write(d, data)
        else:
            _publish(d, data)
    elif action is Action.FINISH:
        if c.step is Step.FINALIZING:
            if roll < 50:
                c.guardrail_evaluated("final", {"ok": True}, stage="output")
            c.accept_final_output("answer", lossless=roll < 90)
        else:
            c.complete()
    return True


def drive(data: st.DataObject, max_steps: int = 40, **kw: Any) -> Driven:
    d = start_run(data, **kw)
    for _ in range(data.draw(st.integers(0, max_steps), label="steps")):
        if not step(d, data):
            break
    return d


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
