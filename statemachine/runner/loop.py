"""A reference async runner that embeds `RunController` as its control core.

Every effect is asked of the controller first and reported after: the model call
(``begin_model_call`` → respond → ``model_responded``), every tool (``begin_tool`` →
`Execute` or `Resend`), every guardrail and hook (skipped when the log shows it already
ran), and every write to the Session (``publish`` / ``settle``). The loop itself is one
question asked again and again: ``controller.next_action()``. Read `_AgentLoop.run` as
the guide to embedding the core in your own runner, and `attempt.Attempt` for how each
attempt begins (a claim) and ends (a flush).

``Runner.run`` and ``Runner.run_streamed`` share that loop, so a streamed and a
non-streamed run leave equal durable state (I8); a streamed run whose write fails ends
its stream by raising that error to the consumer (I6). A streamed run runs only while
its stream is consumed (it waits at every event until the consumer asks for the next),
so a consumer that stops early stops the run at that event boundary (§6.5). A tool
that ends without a result (cancelled, timed out, a `BaseException`) is reported with
``tool_interrupted``, so the live controller answers as a reloaded one (§6.3).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from functools import partial
from typing import Any

from statemachine import telemetry
from statemachine.controller import RunController
from statemachine.errors import ControlError, RunNotFound
from statemachine.machine import TABLE
from statemachine.payloads import JSON, PayloadError, copy_plain
from statemachine.runner.agents import (
    ALLOW,
    Agent,
    Emit,
    FunctionTool,
    MaxTurnsExceeded,
    OutputGuardrailTripwire,
    RunHooks,
    RunResult,
    StreamEvent,
    ToolGuardrail,
    Verdict,
)
from statemachine.runner.attempt import Attempt, interrupted, maybe_await
from statemachine.runner.publish import (
    keeps_history,
    one_writer,
    publish,
    run_history,
    settle,
    writer_gone,
)
from statemachine.sessions import MemorySession, Session
from statemachine.stores import AsyncEventStore, EventStore
from statemachine.values import Action, CallView, Execute, Phase, RecoveryPolicy, Step, ToolCall
from statemachine.verifiers import running_call


def _result(c: RunController) -> RunResult:
    return RunResult(
        final_output=c.final_output if c.step is Step.COMPLETED else None,
        interruptions=tuple(c.call(i).call for i in c.pending_approvals),  # copies
        guardrail_results=c.guardrail_results,
        controller=c,
    )


AsyncEmit = Callable[[StreamEvent], Awaitable[None]]
"""A streamed run's emitter: the run waits on it at every event (an event boundary)."""


class _LocalHistory(MemorySession):
    """The history of a run without a Session: publications land here."""


# ------------------------------------------------------------------------ the loop


class _AgentLoop:
    """One attempt of the reference runner: ``run`` asks ``next_action()`` again and again
    and does what it says, until the run completes or pauses for human decisions."""

    def __init__(self, agent: Agent, controller: RunController, session: Session,
                 hooks: RunHooks, emit: Emit | AsyncEmit, take_over: bool) -> None:
        self.agent = agent
        self.controller = controller
        self.session = session
        self.hooks = hooks
        self.own_hooks = type(hooks) is RunHooks and not getattr(hooks, "__dict__", None)
        """Whether the hooks are the library's own, which do nothing: a `RunHooks` with no
        method set on the instance (one set there is code of the user's)."""
        self.emit = emit
        self.take_over = take_over
        self.keeps = False
        """Whether this attempt may keep the Session it read (`run` decides, once the
        attempt's buffering is set)."""
        self.known: list[JSON] | None = None
        """The run's Session as this attempt sees it (read whole once, then followed by
        each item it published), where it may be kept (`publish.keeps_history`): what a
        publication is staged against and the model is sent, without reading again.
        Dropped once code of the user's ran (it may have written to the Session)."""

    async def run(self, input_items: Sequence[JSON]) -> RunResult:
        c = self.controller
        if not input_items or c.step is not Step.INTERRUPTION:
            # the gate: RunNotResumable or ToolInDoubt before any work. A run resting in
            # INTERRUPTION takes new input first (the gate refuses nothing there, and
            # resume() would move a run whose approved calls can run on to TOOLS, where
            # input is refused); the loop below resumes it
            c.resume()
        self.keeps = keeps_history(c, self.session)
        if input_items and self.keeps:  # (the model is sent the whole Session next)
            self.known = await run_history(c, self.session)
        # §6.4: never write over another run's batch
        await one_writer(c, self.session, read=self.known)
        if input_items:
            c.add_input(list(input_items))
            await self._published(list(input_items))
        progress: tuple[int, Action] | None = None
        while True:
            action = c.next_action()
            if progress == (c.version, action):
                # the last round of this action recorded nothing: going on would loop
                raise RuntimeError(f"the runner made no progress on {action.value} in step "
                                   f"{c.step.value}")
            progress = (c.version, action)
            await self._emit(StreamEvent("action", {"action": action.value,
                                                    "step": c.step.value}))
            if action is Action.NOT_RESUMABLE:
                if c.step is Step.COMPLETED:
                    return await self._done()
                c.resume()  # raises RunNotResumable with the reason
            elif action is Action.RESOLVE_IN_DOUBT:
                c.resume()  # raises ToolInDoubt naming the call
            elif action is Action.RECONCILE or (action is Action.PUBLISH
                                                and c.step is Step.UNSETTLED):
                # a writer whose lease ended is gone: take its write over, recorded
                take_over = self.take_over or writer_gone(c, self.session)
                self.known = None  # (what a reconcile writes is its own)
                decision = await settle(c, self.session, take_over=take_over)
                await self._emit(StreamEvent("reconciled",
                                             {"decision": type(decision).__name__}))
            elif action is Action.AWAIT_DECISIONS:
                await c.flush_async()  # durable before a consumer is shown the pause
                result = _result(c)
                await self._emit(StreamEvent("interruption", {
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
                await self._end_hooks()  # a crash may have come between a tool and its hook
                if self._stops_on_tool():
                    await self._finish(self._first_tool_output())
                else:
                    await self._publish()
            elif action is Action.FINISH:
                if c.step is Step.FINALIZING:
                    await self._finish(c.model_output)
                else:
                    c.complete()

    async def _done(self) -> RunResult:
        c = self.controller
        # durable before a consumer is shown the answer (a streamed run's consumer runs
        # while the attempt's own flush, at its end, would still be waiting)
        await c.flush_async()
        await self._emit(StreamEvent("final_output", {"output": c.final_output}))
        return _result(c)

    async def _emit(self, event: StreamEvent) -> None:
        """Report an event. A streamed run waits here until its consumer asks for the next
        one: these are the event boundaries where a stopped consumer stops the run."""
        waiting = self.emit(event)
        if waiting is not None:
            await waiting
            self.known = None  # the consumer's code ran meanwhile

    async def _hook(self, hook: str, call: Callable[[], Awaitable[None]],
                    call_id: str | None = None) -> None:
        c = self.controller
        if not c.hook_done(hook, call_id=call_id):
            if not self.own_hooks:
                await _before_user_code(c)  # a superseded attempt runs no hook (I1)
                self.known = None
            await call()
            c.hook_ran(hook, call_id=call_id)

    async def _call_model(self) -> None:
        c, agent = self.controller, self.agent
        if c.step is not Step.AWAITING_MODEL:
            await self._hook("agent_start", lambda: self.hooks.on_agent_start(agent))
            if c.max_turns is not None and c.turns >= c.max_turns:
                c.abandon("max_turns")
                raise MaxTurnsExceeded(f"agent {agent.name!r} used its {c.max_turns} turns")
            c.begin_model_call()
        await self._hook("model_start", lambda: self.hooks.on_llm_start(agent))
        items = await self._history()  # (with what rides to the next flush)
        # a model call needs no flush of its own (DESIGN §7.7): a crash before its
        # response calls the model again, which no invariant forbids; what it proposes
        # is made durable before any tool body runs. But a tool's result recorded since
        # the last flush is made durable first, with its publication: a crash while the
        # model answers then leaves the call completed, not in doubt. Else this attempt
        # must still hold the run (one read, no write)
        await c.flush_results_async()
        try:
            response = await agent.model.respond(items, agent)
        except Exception as error:
            c.model_failed(error)
            raise
        await self._hook("model_end", lambda: self.hooks.on_llm_end(agent, response))
        calls = [ToolCall(call_id, name, arguments,
                          needs_approval=agent.tool(name).needs_approval,
                          idempotent=agent.tool(name).idempotent)
                 for call_id, name, arguments in response.tool_calls]
        c.model_responded(calls, output=response.output)
        await self._emit(StreamEvent("model_response", {
            "calls": [call.call_id for call in calls], "output": response.output}))

    async def _guardrail_once(self, name: str, stage: str, call_id: str | None,
                              check: Callable[[], Verdict | Awaitable[Verdict]]) -> Verdict:
        """Run a guardrail unless the log shows it ran in its scope; then its recorded
        verdict is honoured and the guardrail is never re-run (I1)."""
        c = self.controller
        recorded = c.recorded_guardrail(name, stage=stage, call_id=call_id)
        if recorded is not None:
            return Verdict(recorded.result["behavior"], recorded.result["message"])
        await _before_user_code(c)  # a superseded attempt runs no guardrail (I1)
        self.known = None
        outcome: Verdict = await maybe_await(check())
        c.guardrail_evaluated(name, outcome.as_json(), stage=stage, call_id=call_id)
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
        c = self.controller
        runnable = set(c.runnable_call_ids())
        return [view for view in c.calls
                if view.call.call_id in runnable or (
                    view.phase is Phase.COMPLETED
                    and c.hook_done("tool_start", call_id=view.call.call_id)
                    and not c.hook_done("tool_end", call_id=view.call.call_id))]

    async def _run_tools(self) -> None:
        c, agent = self.controller, self.agent
        for view in self._runnable():
            call = view.call
            call_id = call.call_id
            tool = agent.tool(call.name)
            verdict = await self._guardrails(tool.input_guardrails, "tool_input", call)
            decision = c.begin_tool(call_id)  # Execute, or Resend: never a second run
            if isinstance(decision, Execute):
                await c.flush_async()  # an effect boundary: the start is durable first
                self.known = None
                try:
                    output: JSON = await self._execute(tool, call, decision, verdict)
                    c.tool_completed(call_id, output)
                except BaseException:
                    interrupted(c, call_id)  # ended without a result: in doubt from now on
                    raise
                await self._emit(StreamEvent("tool_output",
                                             {"call_id": call_id, "output": output}))
            else:
                output = decision.result
            if c.hook_done("tool_start", call_id=call_id):
                await self._hook("tool_end",
                                 partial(self.hooks.on_tool_end, agent, call, output), call_id)

    async def _execute(self, tool: FunctionTool, call: ToolCall, decision: Execute,
                       verdict: Verdict) -> JSON:
        """What runs between ``begin_tool`` and ``tool_completed``: the start hook, the tool
        (an `Exception` it raises is its output) and its output guardrails. The tool runs
        with the arguments of ``decision`` (its own copy), never with ``call``."""
        agent = self.agent
        if verdict.behavior == "reject_content":
            return verdict.message
        await self._hook("tool_start", partial(self.hooks.on_tool_start, agent, call),
                         call.call_id)
        if not self.own_hooks:  # (the library's own ran nothing since the flush before
            # the body) the start hook may have waited: still ours
            await self.controller.fence_async()
        try:
            with running_call(self.controller, call.call_id):  # tool_context()
                output: JSON = await maybe_await(tool.function(**decision.call.arguments))
        except Exception as error:  # a tool's failure is its output
            output = f"tool error: {type(error).__name__}"
        checked = await self._guardrails(tool.output_guardrails, "tool_output", call, output)
        return checked.message if checked.behavior == "reject_content" else output

    def _stops_on_tool(self) -> bool:
        c = self.controller
        return (self.agent.tool_use_behavior == "stop_on_first_tool"
                and c.step is Step.TOOLS and self._first_tool_output() is not _NONE)

    def _first_tool_output(self) -> Any:
        for view in self.controller.calls:
            if view.phase is Phase.COMPLETED:
                return view.result
        return _NONE

    async def _finish(self, output: JSON) -> None:
        c, agent = self.controller, self.agent
        for guard in agent.output_guardrails:
            outcome = await self._guardrail_once(guard.name, "output", None,
                                                 partial(guard.check, output))
            if outcome.behavior == "reject_content":
                c.abandon(f"output guardrail {guard.name}")
                raise OutputGuardrailTripwire(guard.name)
        await self._hook("agent_end", lambda: self.hooks.on_agent_end(agent, output))
        c.accept_final_output(output)

    async def _end_hooks(self) -> None:
        """The end hook of every completed call whose start hook ran and whose end hook
        did not (the process died between the two): run once, with the cached result."""
        c = self.controller
        for view in c.calls:
            call_id = view.call.call_id
            if (view.phase is Phase.COMPLETED and c.hook_done("tool_start", call_id=call_id)
                    and not c.hook_done("tool_end", call_id=call_id)):
                await self._hook("tool_end", partial(self.hooks.on_tool_end, self.agent,
                                                     view.call, view.result), call_id)

    async def _publish(self) -> None:
        c = self.controller
        ids = list(c.unpublished_call_ids())
        items: list[JSON] = list(c.unpublished_input)  # input recorded before a crash
        for call_id in ids:
            view = c.call(call_id)
            items.append({"type": "function_call", "call_id": call_id,
                          "name": view.call.name, "arguments": view.call.arguments})
            items.append({"type": "function_call_output", "call_id": call_id,
                          "output": view.result})
        if c.step is Step.FINAL_OUTPUT:
            items.append({"role": "assistant", "content": c.final_output})
        await self._emit(StreamEvent("publish", {"items": len(items), "call_ids": list(ids)}))
        await self._published(items, ids)

    async def _history(self) -> list[JSON]:
        """The run's Session as the run sees it (`run_history`), for the model: read
        whole, or the one this attempt keeps; a copy either way, which the model may
        change without changing what a publication is staged against."""
        if self.known is None:
            items = await run_history(self.controller, self.session)
            if not self.keeps:
                return items
            self.known = items
        return [_copied(item) for item in self.known]

    async def _published(self, items: list[JSON], call_ids: list[str] | None = None
                         ) -> None:
        """`publish` ``items`` (riding with the next flush), staged against the Session
        this attempt keeps (read whole first, where it keeps one), which then follows
        them (copies: the caller's items may change after)."""
        if self.keeps and self.known is None:
            self.known = await run_history(self.controller, self.session)
        await publish(self.controller, self.session, items, call_ids=call_ids, ride=True,
                      known=self.known)
        if self.known is not None:
            self.known.extend(_copied(item) for item in items)


_NONE = object()


def _copied(item: JSON) -> JSON:
    """A copy of a Session item the runner keeps (plain JSON, as read or as published,
    at any depth), or of anything else a Session of the user's held."""
    try:
        return copy_plain(item)
    except PayloadError:
        return copy.deepcopy(item)


async def _before_user_code(c: RunController) -> None:
    """Before a hook or a guardrail (code of the user's, which may read the Session):
    the publications that ride to the next flush are written first, so it reads the
    Session as the run sees it; else one read that this attempt still holds the run.
    Either way a superseded attempt is refused (`ConcurrencyConflict`)."""
    if c.riding_items:
        await c.flush_async()
    else:
        await c.fence_async()


# ----------------------------------------------------------------------- the API


def _input_items(input: str | list[JSON] | None) -> list[JSON]:
    if input is None:
        return []
    if isinstance(input, str):
        return [{"role": "user", "content": input}]
    return list(input)


async def _controller(agent: Agent, *, session: Session | None,
                      controller: RunController | None, state: Mapping[str, Any] | str | None,
                      store: EventStore | AsyncEventStore | None, run_id: str | None,
                      policy: RecoveryPolicy, buffered: bool) -> tuple[RunController, bool]:
    """The run's controller, and whether it is an existing run (resumed) rather than one
    this call started. An async store is read without blocking the loop."""
    sources = sum(x is not None for x in (controller, state)) + (store is not None
                                                                 and run_id is not None)
    if sources > 1:
        raise ValueError("resume from one of controller=, state= or store= with run_id=")
    if controller is not None:
        return controller, True
    if state is not None:
        return RunController.from_json(state), True
    if store is not None and run_id is not None:
        with contextlib.suppress(RunNotFound):
            if isinstance(store, AsyncEventStore):  # (a sync store passes this check too)
                return await RunController.load_async(store, run_id, buffered=buffered), True
            return RunController.load(store, run_id, buffered=buffered), True
    return RunController.start(
        run_id=run_id or uuid.uuid4().hex,
        session_id=None if session is None else session.session_id,
        policy=policy, max_turns=agent.max_turns,
        store=store, buffered=buffered), False  # type: ignore[arg-type]


def _refuse_input_before_claim(c: RunController, items: list[JSON]) -> None:
    """New input that the run cannot take where it rests (the declaration has no
    add_input row from its step: DESIGN allows input in RUN_AGAIN and INTERRUPTION only)
    is refused here, before the attempt claims the run, recording nothing: a claim would
    supersede an attempt working on the run for an attempt that does nothing. The
    controller's own refusal says why (`RunNotResumable`, `PublicationUnsettled`,
    `InvalidTransition`). A call in doubt is left to the attempt's gate (`ToolInDoubt`,
    or its verifier first)."""
    if (c.step, "add_input") not in TABLE and not c.in_doubt():
        c.add_input(items)  # no row: refused, whatever its guards would say


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

    Every attempt on an existing run first claims it (``controller.claim(owner)``, with
    ``owner=`` recorded in the log, None by default): of attempts that loaded the same
    version of a run bound to a store, exactly one goes on and the others raise
    `ConcurrencyConflict` having run nothing.
    """

    @staticmethod
    async def run(
        agent: Agent,
        input: str | list[JSON] | None = None,
        *,
        session: Session | None = None,
        controller: RunController | None = None,
        state: Mapping[str, Any] | str | None = None,
        store: EventStore | AsyncEventStore | None = None,
        run_id: str | None = None,
        policy: RecoveryPolicy = RecoveryPolicy.RECONCILE,
        hooks: RunHooks | None = None,
        take_over: bool = False,
        owner: str | None = None,
        buffered: bool | None = None,
        lease: float | None = None,
    ) -> RunResult:
        """Run ``agent`` to its next stop and return the `RunResult`.

        A new run starts with ``input`` (a str becomes one user message); an existing
        one resumes from exactly one of ``controller=``, ``state=`` (its JSON) or
        ``store=`` with ``run_id=`` (a ``run_id`` the store does not hold starts a new run
        bound to the store). ``session`` is the run's Session (omit it for a run without
        one). A resumed attempt first records ``claim(owner, lease=lease)``, then passes
        the gate, all before any guardrail, hook, model call or tool. ``lease`` (seconds,
        with an ``owner``) holds the run against other owners while this attempt works:
        each flush renews it, and another owner's claim is refused with `LeaseHeld` until
        it ends (DESIGN §7.2). A run the runner binds to a store appends its events where
        an effect needs them durable: before a tool body, with each Session write, before
        the model is asked again after a tool's result was recorded (so a crash while it
        answers leaves the call completed, not in doubt), at the attempt's end (DESIGN
        §7.7). By default (``buffered=None``) the controller it
        hands back then appends each event as it is recorded (on a sync store), so a
        decision taken on it is durable when the call returns, and it buffers again for
        the next attempt it is handed in for (``controller=``; one its caller bound per
        event stays so);
        ``buffered=True`` keeps a run it binds buffered (flush before acknowledging a
        decision); ``buffered=False`` appends each event as it is recorded, in the
        attempt too.

        Raises, before any work: `RunNotResumable`, `ToolInDoubt`, `ConcurrencyConflict`
        (another process claimed the run first), `PublicationUnsettled` (another run left
        this Session mid-write), `ControlError` (a ``session`` that is not the run's, or
        has no ``session_id``). ``input`` for a run resting where it takes none (only
        RUN_AGAIN and INTERRUPTION do) is refused before the claim, recording nothing:
        `PublicationUnsettled` while a write is unsettled, `ToolInDoubt` while a call is
        in doubt (a call whose tool has a verifier is first asked about after the claim,
        DESIGN §7.3, so that refusal comes after them), `RunNotResumable` once it ended,
        else `InvalidTransition`. During the
        run: `ReconcileRejected` (the Session cannot be matched to the unsettled batch;
        nothing re-runs), the Session's own write error (I6), `MaxTurnsExceeded`,
        `OutputGuardrailTripwire`. ``take_over=True`` only when no earlier write of this
        run can still land."""
        return await Runner._run(agent, input, session=session, controller=controller,
                                 state=state, store=store, run_id=run_id, policy=policy,
                                 hooks=hooks, take_over=take_over, emit=lambda event: None,
                                 owner=owner, buffered=buffered, lease=lease)

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
                   store: EventStore | AsyncEventStore | None, run_id: str | None,
                   policy: RecoveryPolicy,
                   hooks: RunHooks | None, take_over: bool, emit: Emit | AsyncEmit,
                   owner: str | None = None, buffered: bool | None = None,
                   lease: float | None = None) -> RunResult:
        if session is not None and session.session_id is None:
            # a run would start without a Session, write its input there and complete
            # without writing its output (a run without a Session publishes nothing at
            # its end): refused before anything is recorded
            raise ControlError(
                "the Session passed has no session_id: give it one, or omit session= "
                "for a run that stores nothing", run_id=run_id if controller is None
                else controller.run_id, action="run")
        with telemetry.agent_span(agent.name) as span:
            c, resumed = await _controller(agent, session=session, controller=controller,
                                           state=state, store=store, run_id=run_id,
                                           policy=policy, buffered=buffered is not False)
            telemetry.of_run(span, c.run_id)
            loop = _AgentLoop(agent, c, _session_for(c, session), hooks or RunHooks(), emit,
                              take_over)
            # buffered within the attempt, per event after it (unless told either): a
            # controller this runner handed back buffers its next attempt again
            items = _input_items(input)
            if resumed and items:
                _refuse_input_before_claim(c, items)
            switched = buffered is None and controller is not None and c._buffer_attempt()
            try:
                async with Attempt(c, resumes=resumed, owner=owner, lease=lease,
                                   verifiers=agent.verifiers()):  # claim first, flush last
                    return await loop.run(items)
            finally:
                if buffered is None and (controller is None or switched):
                    c._between_attempts()


_LAST_KINDS = frozenset({"final_output", "interruption"})
"""Events the loop returns right after: the run does not wait for its consumer there."""


class _Lockstep:
    """The boundary between a streamed run (its own task) and the stream's consumer.

    The run hands over one event and waits there until the consumer asks for the next, so
    it never runs ahead of its consumer: a consumer that stops reading leaves the run
    waiting at that event boundary, where stopping it interrupts nothing."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._ready: list[StreamEvent] = []
        self._arrived: asyncio.Future[None] | None = None
        self._asked: asyncio.Future[None] | None = None
        self.stopped = False

    async def emit(self, event: StreamEvent) -> None:
        """The run's side: hand ``event`` over, then wait until the consumer asks again."""
        if self.stopped:  # the consumer is gone (and the run ignored its cancellation)
            raise asyncio.CancelledError
        self._ready.append(event)
        if self._arrived is not None and not self._arrived.done():
            self._arrived.set_result(None)
        if event.kind not in _LAST_KINDS:
            self._asked = self._loop.create_future()
            await self._asked

    async def next(self, run: asyncio.Task[RunResult]) -> StreamEvent | None:
        """The consumer's side: let the run go on past the event it handed over last, and
        wait for its next one (None once the run has ended)."""
        if self._asked is not None and not self._asked.done():
            self._asked.set_result(None)
        while not self._ready and not run.done():
            self._arrived = self._loop.create_future()
            await asyncio.wait((self._arrived, run), return_when=asyncio.FIRST_COMPLETED)
        return self._ready.pop(0) if self._ready else None


class RunResultStreaming:
    """A streamed run: ``async for event in streamed.stream_events()``, then
    ``streamed.result``.

    The run starts when the stream is first iterated and runs only while it is consumed:
    at every event it waits until the consumer asks for the next one. ``stream_events()``
    may be called once. A consumer that stops early (``break``, ``aclose()``,
    cancellation) stops the run at its next event boundary: a tool in flight is reported
    with ``tool_interrupted``, a write in flight is a cancelled write, and nothing runs in
    the background afterwards. The run's error is raised to the consumer, and by
    ``result``; none is left in an unretrieved task."""

    def __init__(self, agent: Agent, input: str | list[JSON] | None,
                 options: dict[str, Any]) -> None:
        self._agent = agent
        self._input = input
        self._options = options
        self._streamed = False
        self._run: asyncio.Task[RunResult] | None = None
        self._ended = False
        self._stopped = False
        self._result: RunResult | None = None
        self._error: BaseException | None = None

    @property
    def result(self) -> RunResult:
        """The run's `RunResult` once its stream ended; the run's error if it failed."""
        if self._run is not None and self._run.done():
            self._end(self._run)
        if self._result is not None:
            return self._result
        error = self._error
        if error is not None and not (self._stopped
                                      and isinstance(error, asyncio.CancelledError)):
            raise error
        if self._run is None:
            raise RuntimeError("the run has not started: iterate stream_events() to run it")
        raise RuntimeError(
            "the stream was stopped before the run finished (or is not consumed to its end "
            "yet): a streamed run runs only while its stream is consumed, and a consumer "
            "that stops stops the run at its next event boundary; nothing runs in the "
            "background. Resume the run from its controller")

    def stream_events(self) -> AsyncGenerator[StreamEvent, None]:
        """The run's events, in order. A streamed result is single use: a second call
        raises `RuntimeError` and runs nothing."""
        if self._streamed:
            raise RuntimeError(
                "a streamed result is single use: stream_events() was already called, and "
                "a second call runs nothing. Read result, or resume the run from its "
                "controller with a new Runner.run or Runner.run_streamed")
        self._streamed = True
        return self._stream()

    async def _stream(self) -> AsyncGenerator[StreamEvent, None]:
        options = {"session": None, "controller": None, "state": None, "store": None,
                   "run_id": None, "policy": RecoveryPolicy.RECONCILE, "hooks": None,
                   "take_over": False, **self._options}
        channel = _Lockstep()
        run = asyncio.ensure_future(Runner._run(self._agent, self._input, emit=channel.emit,
                                                **options))
        run.add_done_callback(self._end)  # every outcome is retrieved, whoever stops
        self._run = run
        try:
            while (event := await channel.next(run)) is not None:
                yield event
        finally:
            await self._stop(channel, run)
        self._end(run)
        if self._error is not None:
            raise self._error  # the run's error ends the stream (I6)

    async def _stop(self, channel: _Lockstep, run: asyncio.Task[RunResult]) -> None:
        """The consumer stopped before the run ended: stop the run at its boundary (or
        cancel what it has in flight) and wait until it has ended. An error it ends with
        is kept for ``result``; only the consumer's own cancellation is raised here."""
        if run.done():
            return
        channel.stopped = self._stopped = True
        run.cancel()
        cancelled: asyncio.CancelledError | None = None
        while not run.done():
            try:
                await asyncio.wait((run,))
            except asyncio.CancelledError as error:  # ours: raised once the run has ended
                cancelled = error
        if cancelled is not None:
            raise cancelled

    def _end(self, run: asyncio.Task[RunResult]) -> None:
        """Keep the ended run's outcome (once: this also retrieves its exception)."""
        if self._ended:
            return
        self._ended = True
        try:
            self._result = run.result()
        except BaseException as error:  # every error: raised to the consumer or by result
            self._error = error
