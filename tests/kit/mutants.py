"""Deliberate bugs, each a context manager that plants it for the duration of a test.
The fuzzers must catch every one of `MUTANTS` (tests/kit/test_planted_bugs.py); the oracle and the
liveness check of the scripted world must catch every one of `ORACLE_MUTANTS`, bugs
whose log is consistent with what happened (so no check of the log alone sees them)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from statemachine import RecoveryPolicy, codec, envelope, machine
from statemachine import controller as controller_module
from statemachine import events as ev
from statemachine.envelope import Finding
from statemachine.machine import TABLE
from statemachine.runner import loop
from statemachine.state import RunState
from statemachine.values import Phase, Step


@contextlib.contextmanager
def _patched(*patches: tuple[Any, Any, Any]) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        for target, name, value in patches:
            if isinstance(target, dict):
                mp.setitem(target, name, value)
            else:
                mp.setattr(target, name, value)
        yield


def approve_while_unsettled() -> contextlib.AbstractContextManager[None]:
    guards, dest = TABLE[(Step.INTERRUPTION, "approve")][0]
    unguarded = ((tuple(g for g in guards if g[0] != "no_envelope"), dest),)
    return _patched(
        (TABLE, (Step.UNSETTLED, "approve"), unguarded),
        (controller_module, "SETTLING_TRIGGERS", machine.SETTLING_TRIGGERS | {"approve"}),
    )


def reconcile_appends_on_p_plus_b() -> contextlib.AbstractContextManager[None]:
    real = envelope.classify

    def classify(*args: Any) -> Finding:
        found = real(*args)
        return Finding("append") if found.kind == "acknowledge" else found

    return _patched((controller_module, "classify", classify))


def guardrails_published_twice() -> contextlib.AbstractContextManager[None]:
    real = RunState._settle

    def settle(self: RunState) -> None:
        envelope = self.envelope
        real(self)
        if envelope is not None:
            self.published_guardrails.extend(envelope.guardrails)

    return _patched((RunState, "_settle", settle))


def started_call_re_executed() -> contextlib.AbstractContextManager[None]:
    import attrs

    real = controller_module.RunController.begin_tool

    def begin_tool(self: Any, call_id: str) -> Any:
        record = self.state.calls.get(call_id)
        if record is not None and record.phase == Phase.STARTED and call_id not in self.in_flight:
            record.call = attrs.evolve(record.call, idempotent=True)
        return real(self, call_id)

    real_runnable = loop._AgentLoop._runnable

    def runnable(self: Any) -> list[Any]:
        chosen = real_runnable(self)
        ids = {view.call.call_id for view in chosen}
        return chosen + [view for view in self.controller.calls if view.phase is Phase.STARTED
                         and not view.in_flight and view.call.call_id not in ids]

    return _patched((controller_module.RunController, "begin_tool", begin_tool),
                    (controller_module, "in_doubt", lambda state, in_flight: ()),
                    (loop._AgentLoop, "_runnable", runnable))


def terminal_marker_dropped_by_json() -> contextlib.AbstractContextManager[None]:
    real = codec.encode_log

    def encode_log(run_id: str, events: Any, *args: Any, **kwargs: Any) -> Any:
        events = list(events)
        fail_closed = events and events[0].policy is RecoveryPolicy.FAIL_CLOSED
        if events and (isinstance(events[-1], ev.Abandoned) or (
                fail_closed and isinstance(events[-1], ev.PublicationFailed))):
            events = events[:-1]  # the run's terminal marker is lost on the way out
        return real(run_id, events, *args, **kwargs)

    return _patched((codec, "encode_log", encode_log))


def streamed_run_skips_the_envelope() -> contextlib.AbstractContextManager[None]:
    real = loop._AgentLoop._publish

    async def publish(self: Any) -> None:
        if getattr(self.emit, "__self__", None) is None:  # run(): the no-op emitter
            await real(self)
            return
        # streamed: write first, arm the envelope afterwards (the seed's bug)
        c = self.controller
        ids = [i for i, r in c.state.calls.items() if r.phase in (Phase.COMPLETED, Phase.REJECTED)]
        items: list[Any] = []
        for call_id in ids:
            record = c.state.calls[call_id]
            items += [{"type": "function_call", "call_id": call_id, "name": record.call.name,
                       "arguments": record.call.arguments},
                      {"type": "function_call_output", "call_id": call_id,
                       "output": record.result}]
        if c.step is Step.FINAL_OUTPUT:
            items.append({"role": "assistant", "content": c.final_output})
        history = await self.session.get_items(limit=len(items) + 1)
        await self.session.add_items(items)
        c.stage_publication(items, history, call_ids=ids)
        c.publication_committed()

    return _patched((loop._AgentLoop, "_publish", publish))


MUTANTS: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
    "approve allowed while unsettled": approve_while_unsettled,
    "reconcile appends on P + B": reconcile_appends_on_p_plus_b,
    "guardrail results published twice": guardrails_published_twice,
    "a started call re-executed on resume": started_call_re_executed,
    "the terminal marker dropped by JSON": terminal_marker_dropped_by_json,
    "a streamed run skipping the envelope": streamed_run_skips_the_envelope,
}


# ------------------------------------------------ bugs only the oracle can see


def rejected_guardrail_stops_the_run() -> contextlib.AbstractContextManager[None]:
    """A tool input guardrail's rejection is taken for a tripwire: the run is abandoned
    instead of going on with the rejection as the call's output."""
    from statemachine.runner import OutputGuardrailTripwire

    real = loop._AgentLoop._guardrails

    async def guardrails(self: Any, guards: Any, stage: str, call: Any, *args: Any) -> Any:
        verdict = await real(self, guards, stage, call, *args)
        if stage == "tool_input" and verdict.behavior == "reject_content":
            self.controller.abandon("tool guardrail")
            raise OutputGuardrailTripwire(guards[0].name)
        return verdict

    return _patched((loop._AgentLoop, "_guardrails", guardrails))


def session_write_drops_an_item() -> contextlib.AbstractContextManager[None]:
    """A batch of several tool results loses its last item on the way to staging (an
    off-by-one slice): the log and the Session agree, and both lack the item."""
    real = loop.publish  # type: ignore[attr-defined]

    async def publish(controller: Any, session: Any, items: list[Any], **kw: Any) -> None:
        if len(items) > 2:
            items = items[:-1]
        await real(controller, session, items, **kw)

    return _patched((loop, "publish", publish))


def failed_tool_retried() -> contextlib.AbstractContextManager[None]:
    """A tool that raised is run once more before its result is recorded: one start, one
    result in the log, two executions."""
    real = loop._AgentLoop._execute

    async def execute(self: Any, tool: Any, call: Any, decision: Any, verdict: Any) -> Any:
        output = await real(self, tool, call, decision, verdict)
        if isinstance(output, str) and output.startswith("tool error:"):
            output = await real(self, tool, call, decision, verdict)
        return output

    return _patched((loop._AgentLoop, "_execute", execute))


def interruption_returned_early() -> contextlib.AbstractContextManager[None]:
    """An attempt that settles an earlier write returns right after, as if it had
    reached an interruption: it raises nothing, and the run stops short."""
    real = loop._AgentLoop.run

    async def run(self: Any, input_items: Any) -> Any:
        if self.controller.step is Step.UNSETTLED:
            from statemachine.runner.publish import settle

            self.controller.resume()
            await settle(self.controller, self.session, take_over=self.take_over)
            return loop._result(self.controller)
        return await real(self, input_items)

    return _patched((loop._AgentLoop, "run", run))


ORACLE_MUTANTS: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
    "a rejected tool guardrail stops the run": rejected_guardrail_stops_the_run,
    "a Session write drops an item": session_write_drops_an_item,
    "a failed tool run twice": failed_tool_retried,
    "an attempt stops after settling": interruption_returned_early,
}
