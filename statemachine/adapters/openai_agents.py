"""The OpenAI Agents SDK (``openai-agents``, import ``agents``) with the control core
underneath: an openai-agents user keeps the SDK's own `Runner` and gets, with a store and
across process restarts, the guarantees of `RunController` (DESIGN §6.8). Install with
``pip install 'agent-statemachine[openai-agents]'`` (tested on openai-agents 0.24.x).

Theory of operation
-------------------
`AgentRun` is one run of an SDK `Agent`, bound to a `RunController` (and through it to an
event store). Every attempt still runs on the SDK's ``Runner.run`` / ``Runner.run_streamed``,
handed a copy of the agent whose seams are wrapped. Each wrapper asks the controller
first and reports after, exactly as the reference runner does (`statemachine.runner.loop`):

==========================  ===================================================================
SDK seam                    what the wrapper records
==========================  ===================================================================
``Model.get_response`` /    ``begin_model_call`` (durable before the request) →
``stream_response``         ``model_responded(calls, output)`` or ``model_failed``
``FunctionTool`` invoke     ``begin_tool(call id)``: `Execute` → durable start, the body,
                            ``tool_completed`` (or ``tool_interrupted`` if it ends without a
                            result); `Resend` → the cached result, the body never runs again;
                            a started, unfinished call → `ToolInDoubt`, never re-run
``Session.add_items``       a staged publication: stage → write → commit / fail (``publish``)
``RunHooks`` / agent hooks  skipped when the log shows them run, else run then ``hook_ran``;
                            ``on_agent_end`` also records ``accept_final_output``
guardrails (agent, tool)    the recorded verdict when the log has one, else run then
                            ``guardrail_evaluated``
==========================  ===================================================================

Before the SDK is called at all, an attempt on an existing run records ``claim`` (of two
processes that loaded the same version one goes on, the other gets `ConcurrencyConflict`
having done nothing), passes the gate (``resume()``: `RunNotResumable`, `ToolInDoubt`),
and settles an unsettled write (``settle``: reconcile, then write the batch only if
nothing of it landed). Decisions and new input go through `AgentRun` and are refused
with `PublicationUnsettled` while a write is unsettled.

The ledger is the truth; the SDK's `RunState` is only a way back into an interrupted
turn. Before an SDK state resumes, the ledger's decisions replace its own; a call the
ledger shows published is answered from the cache and its output is never written twice;
a run that the ledger shows settled into ``COMPLETED`` is answered from the ledger and
the SDK is not called again.

What it does not cover (refused or documented, never silently unsafe): tools other than
``FunctionTool`` and handoffs are refused when the run is opened; standing decisions
(``always_approve`` / ``always_reject``) are not offered, and a call the SDK starts without
a decision the ledger holds is refused before its body runs; a run stopped inside a turn
resumes only with the SDK state saved at its last interruption (`SDKStateRequired`
otherwise); a compaction-aware Session is written as a plain Session (the wrapper does not
expose compaction, which would rewrite the history a write was staged against); input
guardrails are recorded once per activation, so new input given to an existing run is
checked again but its verdict is not recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import inspect
import json
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping, Sequence
from typing import Any, cast

import attrs

from statemachine.adapters import missing_extra

try:
    from agents import (
        Agent,
        FunctionTool,
        GuardrailFunctionOutput,
        InputGuardrail,
        ItemHelpers,
        Model,
        ModelResponse,
        OutputGuardrail,
        RunConfig,
        RunHooks,
        Runner,
        RunResult,
        RunResultStreaming,
        RunState,
        ToolApprovalItem,
        ToolGuardrailFunctionOutput,
        ToolInputGuardrail,
        ToolOutputGuardrail,
    )
    from agents.lifecycle import AgentHooksBase, RunHooksBase
    from agents.memory import Session as SDKSession
    from agents.tool_context import ToolContext
    from agents.tool_guardrails import ToolInputGuardrailData, ToolOutputGuardrailData
except ModuleNotFoundError as error:  # pragma: no cover - the extra is installed in CI
    raise missing_extra(__name__, "openai-agents", error) from error

from statemachine.adapters._calls import Walk, lossless, plain, run_call
from statemachine.controller import RunController
from statemachine.errors import (
    ControlError,
    InvalidTransition,
    PublicationUnsettled,
    RunNotFound,
)
from statemachine.payloads import JSON, fingerprint_of
from statemachine.runner.attempt import Attempt, maybe_await
from statemachine.runner.publish import one_writer, publish, settle
from statemachine.stores import AsyncEventStore, EventStore
from statemachine.values import Action, Phase, RecoveryPolicy, Step, ToolCall

__all__ = [
    "AgentRun",
    "AgentRunResult",
    "AgentRunStreaming",
    "LedgerSession",
    "ModelStreamIncomplete",
    "SDKStateRequired",
]

_MID_TURN = frozenset({Step.INTERRUPTION, Step.TOOLS, Step.FINALIZING, Step.FINAL_OUTPUT})
"""Steps inside one SDK turn: only the SDK's `RunState` leads back into them."""


class SDKStateRequired(ControlError):
    """The run stopped inside a turn (step ``INTERRUPTION``, ``TOOLS``, ``FINALIZING`` or
    ``FINAL_OUTPUT``) and no SDK `RunState` was given to resume it from. The SDK keeps no
    durable record of a turn in progress, so nothing can lead it back there: pass the
    state saved at the run's last interruption (``state=``), or abandon the run."""


class ModelStreamIncomplete(Exception):
    """A streamed model response ended without its ``response.completed`` event."""


# ------------------------------------------------------------------ plain JSON forms


def _as_shown(value: Any, walk: Walk | None) -> JSON:
    """The `plain` fallback of this adapter: what the SDK shows the model. A str, int or
    float of a subclass (an enum member) as its plain value, an int too long to print as
    a note of its size, a non-finite float as its text, a pydantic model through
    ``model_dump(mode="json")``; anything else (a mapping with a key that is not a str, a
    model that does not dump, a value nested too deep to walk) as ``str(value)``."""
    if walk is None:
        return str(value)
    if isinstance(value, str):
        return str.__str__(value)  # a str subclass (a str enum): its plain text
    if isinstance(value, int):
        number = int(value)
        return number if number.bit_length() < 14_000 else f"<int of {number.bit_length()} bits>"
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, Mapping):
        return str(value)
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        with contextlib.suppress(Exception):
            return walk(dump(mode="json"))
    return str(value)


def _arguments(raw: str | None) -> JSON:
    """A call's arguments as the ledger keeps them: the parsed JSON object, or the raw
    text when it is not JSON (the fingerprint then binds the text)."""
    if raw is None:
        return None
    try:
        return plain(json.loads(raw), fallback=_as_shown)
    except ValueError:
        return raw


def _items(items: Sequence[Any]) -> list[JSON]:
    return [plain(item, fallback=_as_shown) for item in items]


# ------------------------------------------------------------------------ results


@attrs.frozen
class AgentRunResult:
    """Where an attempt stopped.

    ``step`` is ``COMPLETED`` (``final_output`` holds the output: the SDK's object when
    the SDK produced it in this attempt, its recorded JSON form when the run settled from
    the ledger) or ``INTERRUPTION`` (``pending`` names the ledger's calls awaiting a
    decision; ``interruptions`` holds the SDK's approval items for them when an SDK state
    is held). ``state`` is the SDK `RunState` to save (``state.to_string()``) for resuming
    in another process; ``sdk_result`` the SDK's own result of this attempt (None when
    the SDK was not called)."""

    final_output: Any
    step: Step
    pending: tuple[ToolCall, ...]
    interruptions: tuple[ToolApprovalItem, ...]
    state: RunState[Any] | None
    sdk_result: RunResult | RunResultStreaming | None


# ----------------------------------------------------------------- the Session


class LedgerSession:
    """Any openai-agents `Session`, written only through staged publications.

    ``add_items`` stages the batch in the run's envelope (reading just enough of the
    Session's tail), makes it durable, writes it, and reports the outcome: a write that
    raised is reported failed and its error propagates; a cancelled write may still land
    and is not reported (the run stays ``UNSETTLED`` until it is reconciled). A result the
    ledger shows published is dropped from the batch: it is never written twice. Reads pass
    through; ``pop_item`` and ``clear_session`` are refused while a write is unsettled (they
    would move the frontier the envelope recorded)."""

    def __init__(self, run: AgentRun, inner: SDKSession) -> None:
        self._run = run
        self.inner = inner
        self.session_id = inner.session_id
        self.session_settings = getattr(inner, "session_settings", None)

    async def get_items(self, limit: int | None = None) -> list[Any]:
        return list(await self.inner.get_items(limit))

    async def add_items(self, items: list[Any]) -> None:
        run = self._run
        c = run.controller
        batch = [item for item in _items(items) if not _already_published(c, item)]
        if not batch:
            return
        ids = dict.fromkeys(_call_id(item) for item in batch)
        owed = set(c.unpublished_call_ids())
        call_ids = [call_id for call_id in ids if call_id in owed]
        try:
            async with run._flush_lock:  # publish flushes the staged envelope itself
                await publish(c, self.inner, batch, call_ids=call_ids)
        except BaseException as error:
            run._write_error = error
            raise

    async def pop_item(self) -> Any:
        self._refuse_unsettled("pop_item")
        return await self.inner.pop_item()

    async def clear_session(self) -> None:
        self._refuse_unsettled("clear_session")
        await self.inner.clear_session()

    def _refuse_unsettled(self, action: str) -> None:
        c = self._run.controller
        if c.step is Step.UNSETTLED:
            raise PublicationUnsettled(
                "a write to this Session is unsettled: settle the run before changing the "
                "Session", run_id=c.run_id, step=c.step, action=action)


def _call_id(item: JSON) -> str | None:
    if isinstance(item, dict):
        call_id = item.get("call_id")
        if isinstance(call_id, str):
            return call_id
    return None


def _already_published(c: RunController, item: JSON) -> bool:
    """A ``function_call_output`` of a call whose result the ledger shows published: the
    SDK resumed a state older than the ledger, and writing it again would duplicate it."""
    call_id = _call_id(item)
    return (call_id is not None and isinstance(item, dict)
            and item.get("type") == "function_call_output"
            and c.phase(call_id) is Phase.PUBLISHED)


# -------------------------------------------------------------------- the model


class _LedgerModel(Model):
    """The agent's model, asked only after the controller allowed the call."""

    def __init__(self, run: AgentRun, inner: Model) -> None:
        self._run = run
        self.inner = inner

    async def get_response(self, *args: Any, **kwargs: Any) -> ModelResponse:
        run = self._run
        await run._begin_model_call()
        try:
            response = await self.inner.get_response(*args, **kwargs)
        except BaseException as error:
            run._model_failed(error)
            raise
        await run._model_responded(response.output)
        return response

    async def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        run = self._run
        await run._begin_model_call()
        responded = False
        try:
            async for event in self.inner.stream_response(*args, **kwargs):
                if not responded and getattr(event, "type", None) == "response.completed":
                    completed: Any = event
                    await run._model_responded(list(completed.response.output))
                    responded = True
                yield event
        except BaseException as error:
            if not responded:
                run._model_failed(error)
            raise
        if not responded:
            run._model_failed(ModelStreamIncomplete)

    def get_retry_advice(self, request: Any) -> Any:
        return self.inner.get_retry_advice(request)

    async def close(self) -> None:
        await self.inner.close()

    async def _cleanup_on_run_end(self, owner: object) -> None:
        await self.inner._cleanup_on_run_end(owner)


# -------------------------------------------------------------------- the hooks


class _LedgerHooks(RunHooks[Any]):
    """The run's hooks (``hooks=``) and the agent's own (``agent.hooks``), each run at
    most once per scope: skipped when the log shows it ran, else run and recorded
    (exactly once when no crash falls between running one and recording it)."""

    def __init__(self, run: AgentRun, hooks: RunHooks[Any] | None, agent_hooks: Any) -> None:
        self._run = run
        self._hooks = hooks
        self._agent_hooks = agent_hooks

    async def _once(self, hook: str, call_id: str | None, run_name: str, agent_name: str,
                    *args: Any) -> None:
        methods = [method for method in (_overridden(self._hooks, run_name, RunHooksBase),
                                         _overridden(self._agent_hooks, agent_name,
                                                     AgentHooksBase))
                   if method is not None]
        if not methods:
            return  # nothing of the user's runs here: nothing to record
        c = self._run.controller
        if c.hook_done(hook, call_id=call_id):
            return
        for method in methods:
            await method(*args)
        c.hook_ran(hook, call_id=call_id)

    async def on_agent_start(self, context: Any, agent: Any) -> None:
        await self._once("agent_start", None, "on_agent_start", "on_start", context, agent)

    async def on_agent_end(self, context: Any, agent: Any, output: Any) -> None:
        await self._once("agent_end", None, "on_agent_end", "on_end", context, agent, output)
        self._run._accept_final_output(output)

    async def on_llm_start(self, context: Any, agent: Any, system_prompt: str | None,
                           input_items: list[Any]) -> None:
        self._run._context = context  # what callable approval policies are asked with
        await self._once("model_start", None, "on_llm_start", "on_llm_start", context, agent,
                         system_prompt, input_items)

    async def on_llm_end(self, context: Any, agent: Any, response: ModelResponse) -> None:
        await self._once("model_end", None, "on_llm_end", "on_llm_end", context, agent,
                         response)

    async def on_tool_start(self, context: Any, agent: Any, tool: Any) -> None:
        call_id = getattr(context, "tool_call_id", None)
        await self._once("tool_start", call_id, "on_tool_start", "on_tool_start", context,
                         agent, tool)

    async def on_tool_end(self, context: Any, agent: Any, tool: Any, result: Any) -> None:
        call_id = getattr(context, "tool_call_id", None)
        await self._once("tool_end", call_id, "on_tool_end", "on_tool_end", context, agent,
                         tool, result)


def _overridden(hooks: Any, name: str, base: type) -> Callable[..., Awaitable[None]] | None:
    """``hooks.name`` when its class overrides the SDK's no-op default, else None."""
    if hooks is None:
        return None
    method = getattr(type(hooks), name, None)
    if method is None or method is getattr(base, name, None):
        return None
    return getattr(hooks, name)  # type: ignore[no-any-return]


# -------------------------------------------------------------------- guardrails


def _agent_guardrail(run: AgentRun, guardrail: Any, stage: str) -> Any:
    """An input or output guardrail that runs once per activation; a repeat returns the
    recorded verdict (``output_info`` in its recorded JSON form)."""
    name = guardrail.get_name()

    async def check(context: Any, agent: Any, value: Any) -> GuardrailFunctionOutput:
        c = run.controller
        recorded = c.recorded_guardrail(name, stage=stage)
        if recorded is not None and not (stage == "input" and run._fresh_input):
            result: Any = recorded.result
            return GuardrailFunctionOutput(output_info=result["output_info"],
                                           tripwire_triggered=result["tripwire_triggered"])
        output = await maybe_await(guardrail.guardrail_function(context, agent, value))
        if recorded is None:
            c.guardrail_evaluated(name, {"tripwire_triggered": bool(output.tripwire_triggered),
                                         "output_info": plain(output.output_info,
                                                              fallback=_as_shown)},
                                  stage=stage)
        return output  # type: ignore[no-any-return]

    if stage == "input":
        return InputGuardrail(guardrail_function=check, name=name,
                              run_in_parallel=guardrail.run_in_parallel)
    return OutputGuardrail(guardrail_function=check, name=name)


def _tool_guardrail(run: AgentRun, guardrail: Any, stage: str) -> Any:
    """A tool input or output guardrail that runs once per call."""
    name = guardrail.get_name()

    async def check(data: ToolInputGuardrailData) -> ToolGuardrailFunctionOutput:
        c = run.controller
        call_id = data.context.tool_call_id
        recorded = c.recorded_guardrail(name, stage=stage, call_id=call_id)
        if recorded is not None:
            result: Any = recorded.result
            return ToolGuardrailFunctionOutput(output_info=result["output_info"],
                                               behavior=result["behavior"])
        output = await maybe_await(guardrail.guardrail_function(data))
        c.guardrail_evaluated(name, {"behavior": plain(dict(output.behavior), fallback=_as_shown),
                                     "output_info": plain(output.output_info,
                                                          fallback=_as_shown)},
                              stage=stage, call_id=call_id)
        return output  # type: ignore[no-any-return]

    if stage == "tool_input":
        return ToolInputGuardrail(guardrail_function=check, name=name)

    async def check_output(data: ToolOutputGuardrailData) -> ToolGuardrailFunctionOutput:
        return await check(data)

    return ToolOutputGuardrail(guardrail_function=check_output, name=name)


# --------------------------------------------------------------------- the tools


def _ledgered_tool(run: AgentRun, tool: FunctionTool) -> FunctionTool:
    wrapped = copy.copy(tool)
    inner = wrapped.on_invoke_tool

    async def invoke(ctx: ToolContext[Any], input: str) -> Any:
        return await run._invoke_tool(inner, ctx, input)

    wrapped.on_invoke_tool = invoke
    wrapped.tool_input_guardrails = [_tool_guardrail(run, g, "tool_input")
                                     for g in tool.tool_input_guardrails or []] or None
    wrapped.tool_output_guardrails = [_tool_guardrail(run, g, "tool_output")
                                      for g in tool.tool_output_guardrails or []] or None
    return wrapped


# ----------------------------------------------------------------------- the run


@attrs.define
class _Call:
    """What the SDK is asked to run in one attempt."""

    input: list[Any] | RunState[Any]


class AgentRun:
    """One run of an openai-agents `Agent`, bound to a `RunController`.

    Open it with `AgentRun.open` (loads the run from ``store`` when it exists, else starts
    it), then drive it with `run` or `run_streamed`, decide with `approve` / `reject`, and
    repair with `settle`. Every public call may raise the controller's refusals:
    `RunNotResumable`, `ToolInDoubt`, `PublicationUnsettled`, `ReconcileRejected`,
    `ConcurrencyConflict`, `InvalidTransition`, and `SDKStateRequired`."""

    def __init__(self, agent: Agent[Any], controller: RunController, session: SDKSession,
                 *, existing: bool, owner: str | None, take_over: bool,
                 idempotent: Collection[str]) -> None:
        _check_supported(agent)
        self.controller = controller
        self.take_over = take_over
        self.session = LedgerSession(self, session)
        self._inner_session = session
        self._idempotent = frozenset(idempotent)
        self._original = agent
        self._tools = {tool.name: tool for tool in agent.tools
                       if isinstance(tool, FunctionTool)}
        self._state: RunState[Any] | None = None
        self._context: Any = None
        self._write_error: BaseException | None = None
        self._flush_lock = asyncio.Lock()
        self._attempt = Attempt(controller, resumes=existing, owner=owner, flush=self._flush)
        self._fresh_input = False
        """This attempt brought input after the activation's input guardrails were recorded:
        they check it again (the log keeps one verdict per activation: the first)."""
        self._agent = agent.clone(
            tools=[_ledgered_tool(self, tool) for tool in self._tools.values()],
            input_guardrails=[_agent_guardrail(self, g, "input")
                              for g in agent.input_guardrails],
            output_guardrails=[_agent_guardrail(self, g, "output")
                               for g in agent.output_guardrails],
            hooks=None,
        )

    # ------------------------------------------------------------------ opening

    @classmethod
    async def open(cls, agent: Agent[Any], *, run_id: str, session: SDKSession,
                   store: EventStore | AsyncEventStore | None = None,
                   policy: RecoveryPolicy = RecoveryPolicy.RECONCILE,
                   owner: str | None = None, take_over: bool = False,
                   idempotent: Collection[str] = (), buffered: bool = False) -> AgentRun:
        """The run ``run_id``: loaded from ``store`` when the store holds it (another
        process may have started it), else started (bound to ``store``, on ``session``,
        under ``policy``). ``idempotent`` names the tools that may run again after a crash
        inside them; every other tool's unfinished call is in doubt. ``owner`` is recorded
        by every claim. ``take_over=True`` only when no earlier write of this run can
        still land (its writer is gone)."""
        controller: RunController | None = None
        if store is not None:
            with contextlib.suppress(RunNotFound):
                if inspect.iscoroutinefunction(getattr(store, "append", None)):
                    # (not isinstance(store, AsyncEventStore): a runtime protocol checks
                    # names only, and a sync store has the same names)
                    controller = await RunController.load_async(store, run_id)
                else:
                    controller = RunController.load(cast("EventStore", store), run_id,
                                                    buffered=buffered)
        existing = controller is not None
        if controller is None:
            controller = RunController.start(
                run_id=run_id, session_id=session.session_id, policy=policy,
                store=store, buffered=buffered)  # type: ignore[arg-type]
        return cls(agent, controller, session, existing=existing, owner=owner,
                   take_over=take_over, idempotent=idempotent)

    @classmethod
    def from_controller(cls, agent: Agent[Any], controller: RunController,
                        session: SDKSession, *, owner: str | None = None,
                        take_over: bool = False,
                        idempotent: Collection[str] = ()) -> AgentRun:
        """An existing run from its controller (e.g. ``RunController.from_json``)."""
        return cls(agent, controller, session, existing=True, owner=owner,
                   take_over=take_over, idempotent=idempotent)

    @property
    def owner(self) -> str | None:
        """Who claims the run: recorded by every claim (``RunClaimed(owner)``)."""
        return self._attempt.owner

    @property
    def state(self) -> RunState[Any] | None:
        """The SDK `RunState` this run resumes from next (None outside an interruption)."""
        return self._state

    @property
    def agent(self) -> Agent[Any]:
        """The agent the SDK runs: a copy of yours with every seam wrapped."""
        return self._agent

    # ---------------------------------------------------------------- decisions

    async def approve(self, item: ToolApprovalItem | str) -> None:
        """Approve a call awaiting a decision: recorded (bound to the fingerprint of the
        arguments the item shows) and durable before the SDK state hears of it.
        `PublicationUnsettled` while a write is unsettled; `InvalidTransition` for a call
        not awaiting a decision or whose arguments differ from the recorded ones."""
        c = self.controller
        call_id, fingerprint = self._decision(item)
        c.approve(call_id, fingerprint=fingerprint)
        await self._flush()
        self._sync_decisions()

    async def reject(self, item: ToolApprovalItem | str, message: str | None = None) -> None:
        """Reject a call awaiting a decision; ``message`` is what the model is told.
        Refused like `approve`."""
        c = self.controller
        call_id, fingerprint = self._decision(item)
        c.reject(call_id, message, fingerprint=fingerprint)
        await self._flush()
        self._sync_decisions()

    def _decision(self, item: ToolApprovalItem | str) -> tuple[str, str | None]:
        if isinstance(item, str):
            return item, None
        call_id = item.call_id
        if call_id is None:
            raise InvalidTransition("the approval item has no call id",
                                    run_id=self.controller.run_id, step=self.controller.step,
                                    action="approve")
        return call_id, fingerprint_of(item.name or "", _arguments(item.arguments))

    def _sync_decisions(self) -> None:
        """Give the held SDK state the ledger's decisions (the ledger wins)."""
        state = self._state
        if state is None:
            return
        c = self.controller
        for item in state.get_interruptions():
            call_id = item.call_id
            if call_id is None or c.phase(call_id) in (None, Phase.AWAITING, Phase.SKIPPED):
                continue
            view = c.call(call_id)
            # a published call that never started was rejected
            if view.phase is Phase.REJECTED or (view.phase is Phase.PUBLISHED
                                                 and view.starts == 0):
                message = view.result
                state.reject(item, rejection_message=message if isinstance(message, str)
                             else None)
            else:
                state.approve(item)

    # ------------------------------------------------------------------ running

    async def run(self, input: str | list[Any] | None = None, *,
                  state: RunState[Any] | str | Mapping[str, Any] | None = None,
                  hooks: RunHooks[Any] | None = None, run_config: RunConfig | None = None,
                  context: Any = None, max_turns: int | None = None) -> AgentRunResult:
        """One attempt: claim (an existing run), gate, settle, then ``Runner.run`` to the
        next stop. ``input`` is new input (refused while a write is unsettled); ``state``
        is the SDK state saved at the last interruption (needed only to resume a turn in
        another process). The original error of a failed write propagates (I6)."""
        async with self._attempt as resumes:
            call = await self._prologue(input, state, new_run=not resumes)
            if isinstance(call, AgentRunResult):
                return call
            try:
                result = await Runner.run(self._agent, call.input, **self._options(
                    hooks, run_config, context, max_turns))
            except BaseException as error:
                refusal = _refusal(error)
                if refusal is error:
                    raise
                raise refusal from None
            return await self._epilogue(result)

    def run_streamed(self, input: str | list[Any] | None = None, *,
                     state: RunState[Any] | str | Mapping[str, Any] | None = None,
                     hooks: RunHooks[Any] | None = None, run_config: RunConfig | None = None,
                     context: Any = None, max_turns: int | None = None) -> AgentRunStreaming:
        """Like `run`, on ``Runner.run_streamed``: iterate ``stream_events()``, then read
        ``result``. A write error the SDK's stream does not raise (a cancelled write, which
        the SDK ends cleanly) is raised to the consumer at the end of the stream."""
        return AgentRunStreaming(self, input, state,
                                 self._options(hooks, run_config, context, max_turns))

    async def settle(self) -> None:
        """Settle an unsettled write now (claiming the run first), without calling the
        SDK: reconcile and write the batch if nothing of it landed. `ReconcileRejected`
        when the Session cannot be matched (nothing recorded; repair it and call again)."""
        await self._attempt.settle(self._inner_session, take_over=self.take_over)

    def _options(self, hooks: RunHooks[Any] | None, run_config: RunConfig | None,
                 context: Any, max_turns: int | None) -> dict[str, Any]:
        options: dict[str, Any] = {
            "session": self.session,
            "hooks": _LedgerHooks(self, hooks, self._original.hooks),
            "run_config": self._config(run_config),
            "context": context,
        }
        if max_turns is not None:
            options["max_turns"] = max_turns
        return options

    def _config(self, run_config: RunConfig | None) -> RunConfig:
        config = copy.copy(run_config) if run_config is not None else RunConfig()
        model = config.model if config.model is not None else self._original.model
        if not isinstance(model, Model):
            provider = config.model_provider
            model = provider.get_model(model if isinstance(model, str) else None)
        config.model = _LedgerModel(self, model)
        config.input_guardrails = [_agent_guardrail(self, g, "input")
                                   for g in config.input_guardrails or []] or None
        config.output_guardrails = [_agent_guardrail(self, g, "output")
                                    for g in config.output_guardrails or []] or None
        return config

    async def _prologue(self, input: str | list[Any] | None,
                        state: RunState[Any] | str | Mapping[str, Any] | None, *,
                        new_run: bool) -> AgentRunResult | _Call:
        """An attempt's work before the SDK is called, after its claim: what to run."""
        c = self.controller
        c.resume()  # the gate: RunNotResumable or ToolInDoubt before any work
        self._write_error = None
        if state is not None:
            self._state = await self._hydrate(state)
        if new_run:
            await one_writer(c, self._inner_session)
        new_items = _items(ItemHelpers.input_to_new_input_list(input)) if input else []
        if new_items:
            c.add_input(new_items)  # PublicationUnsettled while a write is unsettled
        self._fresh_input = bool(new_items) and not new_run
        while c.step is Step.UNSETTLED:
            await settle(c, self._inner_session, take_over=self.take_over)
        await self._flush()
        if c.step is Step.COMPLETED:  # the settled batch published the final output
            return self._result(None)
        action = c.resume()  # an interruption whose approved calls may run enters TOOLS
        if action is Action.AWAIT_DECISIONS and not new_items:
            return self._result(None)
        if c.step in _MID_TURN:
            if self._state is None:
                raise SDKStateRequired(
                    "the run stopped inside a turn and no SDK RunState was given: pass the "
                    "state saved at its last interruption (state=), or abandon the run",
                    run_id=c.run_id, step=c.step, action="run")
            self._sync_decisions()
            if new_items:
                self._state.add_input(new_items)
            return _Call(self._state)
        # RUN_AGAIN / AWAITING_MODEL: the Session holds the whole conversation, so a fresh
        # SDK run continues from it; only the new input is handed over
        self._state = None
        return _Call(new_items)

    async def _hydrate(self, state: RunState[Any] | str | Mapping[str, Any]) -> RunState[Any]:
        """The SDK state, bound to this run's wrapped agent."""
        if isinstance(state, RunState):
            if state._current_agent is self._agent:
                return state
            return await RunState.from_json(self._agent, state.to_json())
        if isinstance(state, str):
            return await RunState.from_string(self._agent, state)
        return await RunState.from_json(self._agent, dict(state))

    async def _epilogue(self, result: RunResult | RunResultStreaming) -> AgentRunResult:
        c = self.controller
        await self._flush()
        expected = Step.INTERRUPTION if result.interruptions else Step.COMPLETED
        if c.step is not expected:
            # the SDK ended without raising while the ledger shows its run unfinished (it
            # ends a streamed run cleanly when its write was cancelled): surface it (I6)
            if self._write_error is not None:
                raise self._write_error
            kind = PublicationUnsettled if c.step is Step.UNSETTLED else InvalidTransition
            raise kind(f"the SDK ended its run expecting step {expected.value}, but the "
                       f"ledger is at {c.step.value}: resume the run to settle it",
                       run_id=c.run_id, step=c.step, action="run")
        self._state = result.to_state() if result.interruptions else None
        return self._result(result)

    def _result(self, result: RunResult | RunResultStreaming | None) -> AgentRunResult:
        c = self.controller
        pending = tuple(c.call(call_id).call for call_id in c.pending_approvals)
        waiting = set(c.pending_approvals)
        interruptions = tuple(item for item in (self._state.get_interruptions()
                                                 if self._state is not None else ())
                              if item.call_id in waiting)
        if c.step is Step.COMPLETED:
            output = (result.final_output if result is not None
                      and result.final_output is not None else c.final_output)
        else:
            output = None
        return AgentRunResult(output, c.step, pending, interruptions, self._state, result)

    # ------------------------------------------------------ what the wrappers record

    async def _flush(self) -> None:
        """Make what the controller buffered durable (a no-op for a run that appends per
        command). The SDK runs a response's tools concurrently, and each flushes before its
        body: one flush at a time, so each appends at the version the last one left."""
        async with self._flush_lock:
            await self.controller.flush_async()

    async def _begin_model_call(self) -> None:
        c = self.controller
        if c.step is not Step.AWAITING_MODEL:  # a crash may have come after the record
            c.begin_model_call()  # refused while a write is unsettled (I2)
        await self._flush()  # an effect boundary: the model call is durable first

    def _model_failed(self, error: BaseException | type[BaseException]) -> None:
        c = self.controller
        if c.step is Step.AWAITING_MODEL:
            c.model_failed(error)

    async def _model_responded(self, output: Sequence[Any]) -> None:
        calls: list[ToolCall] = []
        for item in output:
            if getattr(item, "type", None) != "function_call":
                continue
            name = item.name
            tool = self._tools.get(name)
            calls.append(ToolCall(item.call_id, name, _arguments(item.arguments),
                                  needs_approval=await self._needs_approval(tool, item),
                                  idempotent=name in self._idempotent))
        text: JSON = None if calls else _message_text(output)
        self.controller.model_responded(calls, output=text)

    async def _needs_approval(self, tool: FunctionTool | None, item: Any) -> bool:
        """What the SDK will decide for this call (its own evaluation, so the ledger
        pauses exactly where the SDK pauses)."""
        if tool is None:
            return False  # the SDK fails the run on an unknown tool; nothing runs
        setting = tool.needs_approval
        if isinstance(setting, bool):
            return setting
        try:
            from agents.util._approvals import evaluate_function_tool_approval
        except ImportError:  # pragma: no cover - a newer SDK: ask the policy directly
            arguments = _arguments(item.arguments)
            return bool(await maybe_await(setting(self._context, arguments
                                             if isinstance(arguments, dict) else {},
                                             item.call_id)))
        verdict = await evaluate_function_tool_approval(tool, self._context, item.arguments,
                                                        item.call_id)
        return verdict.outcome == "require_approval"

    def _accept_final_output(self, output: Any) -> None:
        c = self.controller
        if c.step in (Step.FINALIZING, Step.TOOLS):
            shown = plain(output, fallback=_as_shown)
            c.accept_final_output(shown, lossless=lossless(output, shown))

    async def _invoke_tool(self, inner: Callable[[ToolContext[Any], str], Awaitable[Any]],
                           ctx: ToolContext[Any], input: str) -> Any:
        return await run_call(self.controller, ctx.tool_call_id, _arguments(input),
                              flush=self._flush, body=lambda: inner(ctx, input),
                              as_json=lambda output: plain(output, fallback=_as_shown))


def _refusal(error: BaseException) -> BaseException:
    """The controller's refusal inside ``error``, or ``error``: the SDK re-raises what a
    tool raised as ``UserError("Error running tool ...")``, and a `ToolInDoubt` or an
    `InvalidTransition` the wrapper raised must reach the caller as itself."""
    cause: BaseException | None = error
    seen = 0
    while cause is not None and seen < 8:
        if isinstance(cause, ControlError):
            return cause
        cause, seen = cause.__cause__, seen + 1
    return error


def _message_text(output: Sequence[Any]) -> JSON:
    texts: list[str] = []
    for item in output:
        if getattr(item, "type", None) == "message":
            for part in getattr(item, "content", ()) or ():
                text = getattr(part, "text", None)
                if isinstance(text, str):
                    texts.append(text)
    return "".join(texts)


def _check_supported(agent: Agent[Any]) -> None:
    """Refuse what the adapter cannot make safe, before anything runs."""
    others = [type(tool).__name__ for tool in agent.tools if not isinstance(tool, FunctionTool)]
    if others:
        raise ValueError(f"the openai-agents adapter runs FunctionTools only; agent "
                         f"{agent.name!r} has {', '.join(sorted(set(others)))}")
    if agent.handoffs:
        raise ValueError(f"the openai-agents adapter does not support handoffs yet; agent "
                         f"{agent.name!r} has {len(agent.handoffs)}")


# ------------------------------------------------------------------- streaming


class AgentRunStreaming:
    """A streamed attempt: ``async for event in streamed.stream_events()``, then
    ``streamed.result``. ``stream_events()`` may be called once. The run's error — the
    write's own error included, even where the SDK's stream would end cleanly — is raised
    to the consumer and again by ``result``. A consumer that stops early cancels the SDK
    run: a tool in flight is reported with ``tool_interrupted``, a write in flight is a
    cancelled write (the run settles on its next attempt)."""

    def __init__(self, run: AgentRun, input: str | list[Any] | None,
                 state: RunState[Any] | str | Mapping[str, Any] | None,
                 options: dict[str, Any]) -> None:
        self._run = run
        self._input = input
        self._state = state
        self._options = options
        self._streamed = False
        self._result: AgentRunResult | None = None
        self._error: BaseException | None = None
        self.sdk_result: RunResultStreaming | None = None

    @property
    def result(self) -> AgentRunResult:
        """The attempt's `AgentRunResult` once its stream ended; its error if it failed."""
        if self._error is not None:
            raise self._error
        if self._result is None:
            raise RuntimeError("the stream has not been consumed to its end")
        return self._result

    @property
    def final_output(self) -> Any:
        return self.result.final_output

    def stream_events(self) -> AsyncIterator[Any]:
        if self._streamed:
            raise RuntimeError("a streamed result is single use: stream_events() was "
                               "already called")
        self._streamed = True
        return self._stream()

    async def _stream(self) -> AsyncIterator[Any]:
        run = self._run
        try:
            async with run._attempt as resumes:
                call = await run._prologue(self._input, self._state, new_run=not resumes)
                if isinstance(call, AgentRunResult):
                    self._result = call
                    return
                streamed = Runner.run_streamed(run.agent, call.input, **self._options)
                self.sdk_result = streamed
                events = streamed.stream_events()
                try:
                    async for event in events:
                        yield event
                except GeneratorExit:
                    streamed.cancel()  # the consumer stopped: stop the run at once
                    raise
                finally:
                    if not streamed.is_complete:
                        streamed.cancel()
                    await events.aclose()  # type: ignore[attr-defined]
                self._result = await run._epilogue(streamed)
        except GeneratorExit:
            raise
        except BaseException as error:
            self._error = _refusal(error)
            if self._error is error:
                raise
            raise self._error from None
