"""A reference async runner that embeds `RunController` as its control core.

Every effect is asked of the controller first and reported after: the model call
(``begin_model_call`` → respond → ``model_responded``), every tool (``begin_tool`` →
`Execute` or `Resend`), every guardrail and hook (skipped when the log shows it already
ran), and every write to the Session (``publish`` / ``settle``). The loop itself is one
question asked again and again: ``controller.next_action()``. Read `_Drive.run` as the
guide to embedding the core in your own runner.

``Runner.run`` and ``Runner.run_streamed`` share that loop, so a streamed and a
non-streamed run leave equal durable state (I8); a streamed run whose write fails ends
its stream by raising that error to the consumer (I6).
"""

from __future__ import annotations

import asyncio
import inspect
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from functools import partial
from typing import Any

from statemachine.controller import RunController
from statemachine.errors import ControlError
from statemachine.payloads import JSON
from statemachine.runner.agents import (
    ALLOW,
    Agent,
    Emit,
    MaxTurnsExceeded,
    OutputGuardrailTripwire,
    RunHooks,
    RunResult,
    StreamEvent,
    ToolGuardrail,
    Verdict,
)
from statemachine.runner.publish import publish, settle
from statemachine.sessions import MemorySession, Session
from statemachine.stores import EventStore
from statemachine.values import Action, CallView, Execute, Phase, RecoveryPolicy, Step, ToolCall


def _result(c: RunController) -> RunResult:
    return RunResult(
        final_output=c.final_output if c.step is Step.COMPLETED else None,
        interruptions=tuple(c.call(i).call for i in c.pending_approvals),  # copies
        guardrail_results=c.guardrail_results,
        controller=c,
    )


async def maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class _LocalHistory(MemorySession):
    """The history of a run without a Session: publications land here."""


# ------------------------------------------------------------------------ the loop


class _Drive:
    def __init__(self, agent: Agent, controller: RunController, session: Session,
                 hooks: RunHooks, emit: Emit, take_over: bool) -> None:
        self.agent = agent
        self.c = controller
        self.session = session
        self.hooks = hooks
        self.emit = emit
        self.take_over = take_over

    async def run(self, input_items: Sequence[JSON]) -> RunResult:
        c = self.c
        c.resume()  # the gate: RunNotResumable or ToolInDoubt before any work
        if input_items:
            c.add_input(list(input_items))
            await publish(c, self.session, list(input_items))
        progress: tuple[int, Action] | None = None
        while True:
            action = c.next_action()
            if progress == (c.version, action):
                # the last round of this action recorded nothing: going on would loop
                raise RuntimeError(f"the runner made no progress on {action.value} in step "
                                   f"{c.step.value}")
            progress = (c.version, action)
            self.emit(StreamEvent("action", {"action": action.value, "step": c.step.value}))
            if action is Action.NOT_RESUMABLE:
                if c.step is Step.COMPLETED:
                    return self._done()
                c.resume()  # raises RunNotResumable with the reason
            elif action is Action.RESOLVE_IN_DOUBT:
                c.resume()  # raises ToolInDoubt naming the call
            elif action is Action.RECONCILE or (action is Action.PUBLISH
                                                and c.step is Step.UNSETTLED):
                decision = await settle(c, self.session, take_over=self.take_over)
                self.emit(StreamEvent("reconciled", {"decision": type(decision).__name__}))
            elif action is Action.AWAIT_DECISIONS:
                result = _result(c)
                self.emit(StreamEvent("interruption", {
                    "pending": [call.call_id for call in result.interruptions]}))
                return result
            elif action is Action.CALL_MODEL:
                await self._call_model()
            elif action is Action.RUN_TOOLS:
                if c.step is Step.INTERRUPTION:
                    c.resume()
                else:
                    await self._run_tools()
            elif action is Action.PUBLISH:
                if self._stops_on_tool():
                    await self._finish(self._first_tool_output())
                else:
                    await self._publish()
            elif action is Action.FINISH:
                if c.step is Step.FINALIZING:
                    await self._finish(c.model_output)
                else:
                    c.complete()

    def _done(self) -> RunResult:
        self.emit(StreamEvent("final_output", {"output": self.c.final_output}))
        return _result(self.c)

    async def _hook(self, hook: str, call: Callable[[], Awaitable[None]],
                    call_id: str | None = None) -> None:
        if not self.c.hook_done(hook, call_id=call_id):
            await call()
            self.c.hook_ran(hook, call_id=call_id)

    async def _call_model(self) -> None:
        c, agent = self.c, self.agent
        if c.step is not Step.AWAITING_MODEL:
            await self._hook("agent_start", lambda: self.hooks.on_agent_start(agent))
            if c.max_turns is not None and c.turns >= c.max_turns:
                c.abandon("max_turns")
                raise MaxTurnsExceeded(f"agent {agent.name!r} used its {c.max_turns} turns")
            c.begin_model_call()
        await self._hook("model_start", lambda: self.hooks.on_llm_start(agent))
        history = await self.session.get_items()
        try:
            response = await agent.model.respond(history, agent)
        except Exception as error:
            c.model_failed(error)
            raise
        await self._hook("model_end", lambda: self.hooks.on_llm_end(agent, response))
        calls = [ToolCall(call_id, name, arguments,
                          needs_approval=agent.tool(name).needs_approval,
                          idempotent=agent.tool(name).idempotent)
                 for call_id, name, arguments in response.tool_calls]
        c.model_responded(calls, output=response.output)
        self.emit(StreamEvent("model_response", {
            "calls": [call.call_id for call in calls], "output": response.output}))

    async def _guardrail_once(self, name: str, stage: str, call_id: str | None,
                              check: Callable[[], Verdict | Awaitable[Verdict]]) -> Verdict:
        """Run a guardrail unless the log shows it ran in its scope; then its recorded
        verdict is honoured and the guardrail is never re-run (I1)."""
        recorded = self.c.recorded_guardrail(name, stage=stage, call_id=call_id)
        if recorded is not None:
            return Verdict(recorded.result["behavior"], recorded.result["message"])
        outcome: Verdict = await maybe_await(check())
        self.c.guardrail_evaluated(name, outcome.as_json(), stage=stage, call_id=call_id)
        return outcome

    async def _guardrails(self, guards: tuple[ToolGuardrail, ...], stage: str,
                          call: ToolCall, *args: JSON) -> Verdict:
        """Every tool guardrail of a stage, once per call; the first rejection wins."""
        verdict = ALLOW
        for guard in guards:
            outcome = await self._guardrail_once(guard.name, stage, call.call_id,
                                                 partial(guard.check, call, *args))
            if outcome.behavior == "reject_content" and verdict is ALLOW:
                verdict = outcome
        return verdict

    def _runnable(self) -> list[CallView]:
        """What `runnable_call_ids` names (approved calls, idempotent calls a dead process
        started), and completed calls whose end hook did not run yet (a crash came
        between), in proposal order."""
        c = self.c
        runnable = set(c.runnable_call_ids())
        return [view for view in c.calls
                if view.call.call_id in runnable or (
                    view.phase is Phase.COMPLETED
                    and c.hook_done("tool_start", call_id=view.call.call_id)
                    and not c.hook_done("tool_end", call_id=view.call.call_id))]

    async def _run_tools(self) -> None:
        c, agent = self.c, self.agent
        for view in self._runnable():
            call = view.call
            call_id = call.call_id
            tool = agent.tool(call.name)
            verdict = await self._guardrails(tool.input_guardrails, "tool_input", call)
            decision = c.begin_tool(call_id)  # Execute, or Resend: never a second run
            if isinstance(decision, Execute):
                if verdict.behavior == "reject_content":
                    output: JSON = verdict.message
                else:
                    await self._hook("tool_start",
                                     partial(self.hooks.on_tool_start, agent, call), call_id)
                    try:
                        output = await maybe_await(tool.function(**decision.call.arguments))
                    except Exception as error:  # a tool's failure is its output
                        output = f"tool error: {type(error).__name__}"
                    checked = await self._guardrails(tool.output_guardrails, "tool_output",
                                                     call, output)
                    if checked.behavior == "reject_content":
                        output = checked.message
                c.tool_completed(call_id, output)
                self.emit(StreamEvent("tool_output", {"call_id": call_id, "output": output}))
            else:
                output = decision.result
            if c.hook_done("tool_start", call_id=call_id):
                await self._hook("tool_end",
                                 partial(self.hooks.on_tool_end, agent, call, output), call_id)

    def _stops_on_tool(self) -> bool:
        c = self.c
        return (self.agent.tool_use_behavior == "stop_on_first_tool"
                and c.step is Step.TOOLS and self._first_tool_output() is not _NONE)

    def _first_tool_output(self) -> Any:
        for view in self.c.calls:
            if view.phase is Phase.COMPLETED:
                return view.result
        return _NONE

    async def _finish(self, output: JSON) -> None:
        c, agent = self.c, self.agent
        for guard in agent.output_guardrails:
            outcome = await self._guardrail_once(guard.name, "output", None,
                                                 partial(guard.check, output))
            if outcome.behavior == "reject_content":
                c.abandon(f"output guardrail {guard.name}")
                raise OutputGuardrailTripwire(guard.name)
        await self._hook("agent_end", lambda: self.hooks.on_agent_end(agent, output))
        c.accept_final_output(output)

    async def _publish(self) -> None:
        c = self.c
        ids = list(c.unpublished_call_ids())
        items: list[JSON] = []
        for call_id in ids:
            view = c.call(call_id)
            items.append({"type": "function_call", "call_id": call_id,
                          "name": view.call.name, "arguments": view.call.arguments})
            items.append({"type": "function_call_output", "call_id": call_id,
                          "output": view.result})
        if c.step is Step.FINAL_OUTPUT:
            items.append({"role": "assistant", "content": c.final_output})
        self.emit(StreamEvent("publish", {"items": len(items), "call_ids": list(ids)}))
        await publish(c, self.session, items, call_ids=ids)


_NONE = object()


# ----------------------------------------------------------------------- the API


def _input_items(input: str | list[JSON] | None) -> list[JSON]:
    if input is None:
        return []
    if isinstance(input, str):
        return [{"role": "user", "content": input}]
    return list(input)


def _controller(agent: Agent, *, session: Session | None, controller: RunController | None,
                state: Mapping[str, Any] | str | None, store: EventStore | None,
                run_id: str | None, policy: RecoveryPolicy) -> RunController:
    sources = sum(x is not None for x in (controller, state)) + (store is not None
                                                                 and run_id is not None)
    if sources > 1:
        raise ValueError("resume from one of controller=, state= or store= with run_id=")
    if controller is not None:
        return controller
    if state is not None:
        return RunController.from_json(state)
    if store is not None and run_id is not None and store.load(run_id):
        return RunController.load(store, run_id)
    return RunController.start(
        run_id=run_id or uuid.uuid4().hex,
        session_id=None if session is None else session.session_id,
        policy=policy, max_turns=agent.max_turns, store=store)


def _session_for(c: RunController, session: Session | None) -> Session:
    if session is None:
        if c.session_id is not None:
            raise ControlError("this run has a Session; pass it as session=",
                               run_id=c.run_id, step=c.step, action="run")
        return _LocalHistory(None)  # type: ignore[arg-type]
    if session.session_id != c.session_id:
        raise ControlError("the session passed is not the run's Session",
                           run_id=c.run_id, step=c.step, action="run")
    return session


class Runner:
    """Runs an agent to its next stop: completed, or paused for human decisions.

    Start a run with ``input``; resume one with ``controller=`` (live), ``state=`` (the
    JSON of ``result.controller.to_json()``) or ``store=`` and ``run_id=``. Resuming a run
    that cannot safely go on raises (`RunNotResumable`, `ToolInDoubt`,
    `ReconcileRejected`) before any model call, tool, hook or guardrail. Pass
    ``take_over=True`` only when no earlier write of this run can still land.
    """

    @staticmethod
    async def run(
        agent: Agent,
        input: str | list[JSON] | None = None,
        *,
        session: Session | None = None,
        controller: RunController | None = None,
        state: Mapping[str, Any] | str | None = None,
        store: EventStore | None = None,
        run_id: str | None = None,
        policy: RecoveryPolicy = RecoveryPolicy.RECONCILE,
        hooks: RunHooks | None = None,
        take_over: bool = False,
    ) -> RunResult:
        return await Runner._run(agent, input, session=session, controller=controller,
                                 state=state, store=store, run_id=run_id, policy=policy,
                                 hooks=hooks, take_over=take_over, emit=lambda event: None)

    @staticmethod
    def run_streamed(
        agent: Agent,
        input: str | list[JSON] | None = None,
        **options: Any,
    ) -> RunResultStreaming:
        """Like `run`, streaming `StreamEvent`s; iterate ``stream_events()``, then read
        ``result``. An error ends the stream by being raised to the consumer."""
        return RunResultStreaming(agent, input, options)

    @staticmethod
    async def _run(agent: Agent, input: str | list[JSON] | None, *, session: Session | None,
                   controller: RunController | None, state: Mapping[str, Any] | str | None,
                   store: EventStore | None, run_id: str | None, policy: RecoveryPolicy,
                   hooks: RunHooks | None, take_over: bool, emit: Emit) -> RunResult:
        c = _controller(agent, session=session, controller=controller, state=state,
                        store=store, run_id=run_id, policy=policy)
        drive = _Drive(agent, c, _session_for(c, session), hooks or RunHooks(), emit,
                       take_over)
        return await drive.run(_input_items(input))


class RunResultStreaming:
    """A streamed run: ``async for event in streamed.stream_events()``, then
    ``streamed.result``. The run starts when the stream is first iterated."""

    def __init__(self, agent: Agent, input: str | list[JSON] | None,
                 options: dict[str, Any]) -> None:
        self._agent = agent
        self._input = input
        self._options = options
        self._result: RunResult | None = None

    @property
    def result(self) -> RunResult:
        if self._result is None:
            raise RuntimeError("the stream has not finished")
        return self._result

    async def stream_events(self) -> AsyncIterator[StreamEvent]:
        queue: asyncio.Queue[StreamEvent | None] = asyncio.Queue()
        options = {"session": None, "controller": None, "state": None, "store": None,
                   "run_id": None, "policy": RecoveryPolicy.RECONCILE, "hooks": None,
                   "take_over": False, **self._options}

        async def produce() -> RunResult:
            try:
                return await Runner._run(self._agent, self._input, emit=queue.put_nowait,
                                         **options)
            finally:
                queue.put_nowait(None)

        task = asyncio.ensure_future(produce())
        try:
            while (event := await queue.get()) is not None:
                yield event
        finally:
            if not task.done():
                task.cancel()
        self._result = await task  # re-raises the run's error to the consumer (I6)


