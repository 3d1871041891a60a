"""Random reachable runs, for property tests (Hypothesis): `RandomRun` moves a
`RunController` by any move the controller allows, and `random_run` returns one such run.

A move is drawn from what ``next_action()`` asks for: model calls that fail or propose 0
to 3 calls (each approval-gated or not, idempotent or not), approvals, rejections and
handoffs, tools completed or left in flight, in-doubt resolutions (of each outcome),
writes to a simulated Session that land, do not land, or land and report failure,
reconciliation, final
output; and now and then an abandon, or a reload (from the run's store when it has one,
else from its JSON), after which what was in flight is in doubt. Every draw is labelled,
so a failing example reads as the moves that led to it.
"""

from __future__ import annotations

from typing import Any, Self

from hypothesis import strategies as st

from statemachine.controller import RunController
from statemachine.payloads import JSON
from statemachine.values import (
    Action,
    Append,
    Phase,
    RecoveryPolicy,
    Resolution,
    Step,
    ToolCall,
)

__all__ = ["RandomRun", "random_run"]


def random_run(data: st.DataObject, *, max_steps: int = 40, run_id: str = "random-run",
               **options: Any) -> RunController:
    """A random reachable run: started with a drawn Session id (or none), recovery policy
    and turn limit (``options`` go to `RunController.start`: ``store=``, ``max_bytes=``),
    then moved by a drawn number of moves, up to ``max_steps`` (`RandomRun.walk`)."""
    run = RandomRun.start(data, run_id=run_id, **options)
    return run.walk(data, max_steps=max_steps).controller


class RandomRun:
    """A run moved by random legal moves, with the Session its writes go to (a list).

    ``controller`` is the run's controller, replaced by a reloaded one when a move
    reloads it (so read it after each `step`)."""

    def __init__(self, controller: RunController) -> None:
        self.controller = controller
        self.session: list[JSON] = []
        self._batch: list[JSON] = []
        """The batch the run's open attempt writes (staged, or appended by a reconcile)."""
        self._proposed = 0

    @classmethod
    def start(cls, data: st.DataObject, *, run_id: str = "random-run",
              **options: Any) -> Self:
        """A new run with a drawn Session id (or none), recovery policy and turn limit;
        ``options`` go to `RunController.start`."""
        session_id = data.draw(st.sampled_from(["s", None]), label="session")
        policy = data.draw(st.sampled_from([RecoveryPolicy.RECONCILE] * 3
                                           + [RecoveryPolicy.FAIL_CLOSED]), label="policy")
        max_turns = data.draw(st.sampled_from([None, 3]), label="max_turns")
        return cls(RunController.start(run_id=run_id, session_id=session_id, policy=policy,
                                       max_turns=max_turns, **options))

    def walk(self, data: st.DataObject, *, max_steps: int = 40) -> Self:
        """A drawn number of moves (up to ``max_steps``), fewer once the run can make
        none; returns the run."""
        for _ in range(data.draw(st.integers(0, max_steps), label="steps")):
            if not self.step(data):
                break
        return self

    def step(self, data: st.DataObject) -> bool:
        """One move drawn from ``data``; False, having made none, once the run can make
        none (`Action.NOT_RESUMABLE`)."""
        c = self.controller
        action = c.next_action()
        roll = data.draw(st.integers(0, 99), label="roll")
        if action is Action.NOT_RESUMABLE:
            return False
        if roll < 1:
            c.abandon("driver")
        elif roll < 10:  # a restart: what was in flight is now in doubt
            self.controller = (RunController.load(c.store, c.run_id) if c.store is not None
                               else RunController.from_json(c.to_json()))
        elif action is Action.RESOLVE_IN_DOUBT:
            if roll < 40:  # the effect did not happen: the call runs again
                c.resolve_in_doubt(c.in_doubt()[0], outcome=Resolution.NOT_EXECUTED)
            else:
                c.resolve_in_doubt(c.in_doubt()[0], "resolved",
                                   outcome=Resolution.FAILED if roll > 90 else
                                   Resolution.COMPLETED)
        elif action is Action.RECONCILE:
            self._reconcile(data)
        elif action is Action.CALL_MODEL:
            self._call_model(data, roll)
        elif action is Action.AWAIT_DECISIONS:
            self._decide(data, roll)
        elif action is Action.RUN_TOOLS:
            self._run_tool(data, roll)
        elif action is Action.PUBLISH:
            self._publish(data)
        elif action is Action.FINISH:
            self._finish(roll)
        return True

    def _reconcile(self, data: st.DataObject) -> None:
        c = self.controller
        assert c.envelope is not None
        decision = c.reconcile(self.session[-c.envelope.read_limit:], c.session_id,
                               take_over=True)
        if isinstance(decision, Append):
            self._batch = list(decision.items)
            self._write(data)

    def _call_model(self, data: st.DataObject, roll: int) -> None:
        c = self.controller
        if c.step is not Step.AWAITING_MODEL:
            if c.max_turns is not None and c.turns >= c.max_turns:
                c.abandon("max_turns")
                return
            c.begin_model_call()
        if roll < 15:
            c.model_failed(TimeoutError())
            return
        calls = []
        for _ in range(data.draw(st.integers(0, 3), label="calls")):
            self._proposed += 1
            calls.append(ToolCall(
                f"c{self._proposed}", "tool", {"n": self._proposed},
                needs_approval=data.draw(st.booleans(), label="approval"),
                idempotent=data.draw(st.booleans(), label="idempotent")))
        c.model_responded(calls, output=None if calls else "answer")

    def _decide(self, data: st.DataObject, roll: int) -> None:
        c = self.controller
        call_id = data.draw(st.sampled_from(c.pending_approvals), label="decide")
        if roll < 60:
            c.approve(call_id, fingerprint=c.fingerprint(call_id))
        elif roll < 90:
            c.reject(call_id, "declined")
        else:
            c.handoff("other")

    def _run_tool(self, data: st.DataObject, roll: int) -> None:
        c = self.controller
        if c.step is Step.INTERRUPTION:
            c.resume()
            return
        runnable = set(c.runnable_call_ids())
        choices = [view.call.call_id for view in c.calls  # in proposal order
                   if view.call.call_id in runnable or view.in_flight]
        call_id = data.draw(st.sampled_from(choices), label="tool")
        if call_id not in c.in_flight:
            c.begin_tool(call_id)
            if roll < 20:
                return  # left in flight: a reload now puts it in doubt
        c.guardrail_evaluated("tool_out", {"ok": True}, stage="tool_output", call_id=call_id)
        c.tool_completed(call_id, f"result of {call_id}")
        if roll > 92 and not any(view.phase is Phase.STARTED for view in c.calls):
            c.accept_final_output(f"result of {call_id}")

    def _publish(self, data: st.DataObject) -> None:
        c = self.controller
        if c.holds_attempt:  # staged before, and not written yet
            self._write(data)
            return
        ids = list(c.unpublished_call_ids())
        batch: list[JSON] = [{"call_id": i, "output": c.call(i).result} for i in ids]
        if c.step is Step.FINAL_OUTPUT or not batch:
            batch.append({"role": "assistant", "n": c.version})
        c.stage_publication(batch, self.session[-(len(batch) + 1):], call_ids=ids)
        self._batch = batch
        self._write(data)

    def _write(self, data: st.DataObject) -> None:
        """Write the open attempt's batch: it lands and commits, does not land, or lands
        and reports failure (the writer cannot tell)."""
        outcome = data.draw(st.sampled_from(["ok", "ok", "no-commit", "commit-then-raise"]),
                            label="write")
        if outcome != "no-commit":
            self.session.extend(self._batch)
        if outcome == "ok":
            self.controller.publication_committed()
        else:
            self.controller.publication_failed(OSError("injected"))

    def _finish(self, roll: int) -> None:
        c = self.controller
        if c.step is Step.FINALIZING:
            if roll < 50:
                c.guardrail_evaluated("final", {"ok": True}, stage="output")
            c.accept_final_output("answer", lossless=roll < 90)
        else:
            c.complete()
