"""The OpenAI Agents SDK (``openai-agents``, import ``agents``) with the control core
underneath: an openai-agents user keeps the SDK's own `Runner` and gets, with a store and
across process restarts, the guarantees of `RunController` (DESIGN §6.8). Install with
``pip install 'agent-statemachine[openai-agents]'`` (tested on openai-agents 0.24.x).

Theory of operation
-------------------
`AgentRun` is one run of an SDK `Agent`, bound to a `RunController` (and through it to an
event store). Every attempt still runs on the SDK's ``Runner.run`` / ``Runner.run_streamed``,
handed copies of the agent and of every agent its handoffs reach, whose seams are wrapped.
Each wrapper asks the controller first and reports after, exactly as the reference runner
does (`statemachine.runner.loop`):

==========================  ===================================================================
SDK seam                    what the wrapper records
==========================  ===================================================================
``Model.get_response`` /    ``begin_model_call`` (durable before the request) →
``stream_response``         ``model_responded(calls, output items)`` or ``model_failed`` (also
                            for a response naming a tool the agent does not have, which the
                            SDK refuses)
``FunctionTool`` invoke     ``begin_tool(call id)``: `Execute` → durable start, the body, and
                            the result as the SDK sends it (after the tool's output
                            guardrails: what they let through); `Resend` → the cached result,
                            the body never runs again; a started, unfinished call →
                            `ToolInDoubt`, never re-run
a handoff                   its call is a ledger call (its ``on_handoff`` runs once); the next
                            model call of the new agent records ``handoff(agent name)``
``Session.add_items``       a staged publication: stage → write → commit / fail (``publish``);
                            a call the SDK answered itself (a guardrail's rejection, an unknown
                            tool's error) is recorded with that answer first, and the final
                            output is accepted here, once its output guardrails passed
``RunHooks`` / agent hooks  skipped when the log shows them run, else run then ``hook_ran``
guardrails (agent, tool)    the recorded verdict when the log has one, else run then
                            ``guardrail_evaluated``; a tripped guardrail abandons the run
==========================  ===================================================================

Before the SDK is called at all, an attempt on an existing run records ``claim`` (of two
processes that loaded the same version one goes on, the other gets `ConcurrencyConflict`
having done nothing), asks the verifiers given to `AgentRun.open` about the calls of
their tools in doubt (`statemachine.verifiers`: recorded as ``verify:<tool>``), passes
the gate (``resume()``: `RunNotResumable`, `ToolInDoubt`), settles an unsettled write
(reconcile, then write the batch only if nothing of it landed), and records the
decisions the SDK state it was given holds (``state.approve(item)``). Decisions and new
input are refused with `PublicationUnsettled` while a write is unsettled. A run that
already completed answers a repeat of its request from the ledger (``replayed``), calling
no model and running no tool.

The ledger is the truth; the SDK's `RunState` is only a way back into an interrupted
turn. Before an SDK state resumes, the ledger's decisions replace its own; a call the
ledger shows published is answered from the cache and its output is never written twice.
A turn stopped after its model response (paused for decisions, tools running, or the
final answer being checked or written) and resumed without an SDK state replays the
recorded response to the SDK instead of calling the model again: the SDK pauses again
for the calls still awaiting a decision, runs the approved ones once (a completed one
answered from the cache), and checks and writes the final answer.

MCP servers (``mcp_servers``) are carried: the SDK lists their tools on every turn, and
each ``tools/call`` is a ledger call like a function tool's, its start durable before the
request is sent, the call's idempotency key in the request's ``_meta``; a failure after
the request may have been sent that is not the server's answer leaves the call in doubt
(`statemachine.adapters._mcp`). A server's read-only and idempotent hints count only for a
server named in ``trusted_mcp_servers``.

What is refused when the run is opened (`UnsupportedFeature`, nothing recorded): an MCP
server configured to retry (``max_retry_attempts``), a trusted MCP server name no agent
has, every tool but ``FunctionTool`` (hosted tools, ``HostedMCPTool``, computer, shell
tools), an agent used as a tool whose agent has tools needing approval, handoff input
filters and nested handoff history. Standing decisions taken on the SDK state
(``always_approve`` / ``always_reject``) are refused when an attempt is given that
state, before anything is recorded; a call the SDK starts without a decision the ledger
holds is refused before its body runs. A tripped guardrail (the agent's input or output
guardrail, a tool's input or output guardrail) is raised as on the SDK alone and ends
the run, abandoned with a reason naming it. A turn stopped with a rejection not yet
written, or given new input mid-turn, resumes only with the SDK state saved at its
interruption (`SDKStateRequired` otherwise). An agent a handoff reaches runs its own
input guardrails when a restart resumes with it (the SDK runs only the first agent's). A
handoff's ``on_handoff`` hooks run with its call, at most once (a crash between the
call's record and its hooks skips them). A compaction-aware Session is written as a
plain Session; input guardrails are recorded once per activation, so new input given to
an existing run is checked again but its verdict is not recorded.

Tracing: the SDK traces with its own system, not OpenTelemetry. `TracingBridge`, a
trace processor (``agents.set_trace_processors([TracingBridge()])`` or
``agents.add_trace_processor``), mirrors its traces and spans as OpenTelemetry spans
through `statemachine.telemetry` (nothing when telemetry is off), each the current span
while the SDK's is open: the ledger's ``execute_tool`` span of a function tool then sits
under the SDK's function span, and what the ledger records during the SDK's run (its
publications, its transitions) in the SDK's trace; what it records before the SDK runs
(the run's start, its input, a claim) goes under the caller's current span, if any.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
import dataclasses
import inspect
import json
import logging
import math
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping, Sequence
from typing import Any, cast

import attrs

from statemachine import telemetry
from statemachine.adapters import missing_extra

try:
    from agents import (
        Agent,
        FunctionTool,
        GuardrailFunctionOutput,
        Handoff,
        InputGuardrail,
        InputGuardrailTripwireTriggered,
        ItemHelpers,
        Model,
        ModelResponse,
        OutputGuardrail,
        OutputGuardrailTripwireTriggered,
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
        Usage,
        handoff,
    )
    from agents.exceptions import (
        ModelBehaviorError,
        ToolInputGuardrailTripwireTriggered,
        ToolOutputGuardrailTripwireTriggered,
    )
    from agents.lifecycle import AgentHooksBase, RunHooksBase
    from agents.mcp import MCPServer
    from agents.memory import Session as SDKSession
    from agents.run_internal.items import function_tool_error_output
    from agents.run_internal.turn_preparation import get_model_settings as sdk_model_settings
    from agents.tool import default_tool_error_function
    from agents.tool_context import ToolContext
    from agents.tool_guardrails import ToolInputGuardrailData, ToolOutputGuardrailData
    from agents.tracing import (
        AgentSpanData,
        FunctionSpanData,
        GenerationSpanData,
        ResponseSpanData,
        Trace,
        TracingProcessor,
    )
    from agents.tracing import Span as SDKSpan
    from openai.types.responses import Response, ResponseCompletedEvent, ResponseOutputItem
    from pydantic import TypeAdapter
except ModuleNotFoundError as error:  # pragma: no cover - the extra is installed in CI
    raise missing_extra(__name__, "openai-agents", error) from error

from statemachine.adapters._calls import (
    InvalidVerifier,
    UnsupportedFeature,
    Walk,
    abandoned_reason,
    abandoning,
    begin_call,
    checked_verifiers,
    decide_async,
    lossless,
    naming_take_over,
    plain,
    record_result,
    recorded_output,
    resolving,
    run_call,
    settle_unsettled,
)
from statemachine.adapters._mcp import answered, hinted_idempotent, with_key
from statemachine.controller import RunController
from statemachine.errors import (
    ControlError,
    InvalidTransition,
    PublicationUnsettled,
    ReconcileRejected,
    RunNotFound,
    RunNotResumable,
    ToolInDoubt,
)
from statemachine.events import (
    HandedOff,
    PublicationCommitted,
    PublicationStaged,
    ReconciledAcknowledge,
)
from statemachine.payloads import JSON, canonical_json, fingerprint_of, json_size
from statemachine.runner.attempt import Attempt, interrupted, maybe_await
from statemachine.runner.publish import one_writer, publish, run_history
from statemachine.stores import AsyncEventStore, EventStore
from statemachine.values import Action, Phase, RecoveryPolicy, Resolution, Step, ToolCall
from statemachine.verifiers import Verifier, running_call, tool_context

__all__ = [
    "AgentRun",
    "AgentRunResult",
    "AgentRunStreaming",
    "InvalidVerifier",
    "LedgerSession",
    "ModelStreamIncomplete",
    "SDKStateRequired",
    "TracingBridge",
    "UnsupportedFeature",
]

_MID_TURN = frozenset({Step.INTERRUPTION, Step.TOOLS, Step.FINALIZING, Step.FINAL_OUTPUT})
"""Steps inside one SDK turn: the SDK's `RunState`, or a replay of the recorded model
response, leads back into them."""
_TAKE_OVER = "AgentRun.open(..., take_over=True)"
_OUTPUT_ITEM: TypeAdapter[Any] = TypeAdapter(ResponseOutputItem)
_log = logging.getLogger(__name__)


class SDKStateRequired(ControlError):
    """The run stopped inside a turn that its recorded model response cannot lead back
    into (a rejection not yet written, or new input given mid-turn), and no SDK
    `RunState` was given to resume it from: only the SDK's state saved at that
    interruption leads back there. Pass it (``state=``), or abandon the run."""


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


def _shown(value: Any) -> JSON:
    """``value`` as the ledger keeps it: `plain`, with what the SDK shows the model for
    what is not JSON (`_as_shown`)."""
    return plain(value, fallback=_as_shown)


def _items(items: Sequence[Any]) -> list[JSON]:
    return [_shown(item) for item in items]


def _output_items(output: Sequence[Any]) -> list[JSON]:
    """A model response's output items as the ledger keeps them (enough to rebuild the
    response exactly: `_response_of`)."""
    dumped = []
    for item in output:
        dump = getattr(item, "model_dump", None)
        dumped.append(_shown(dump(mode="json", exclude_unset=True) if callable(dump) else item))
    return dumped


def _sent(tool: FunctionTool, tool_call: Any, output: Any) -> JSON:
    """What the SDK sends the model for ``output`` of ``tool`` (the ``output`` of its
    ``function_call_output`` item): the result the ledger records, so a resent result is
    byte-identical to the one the SDK sent. Falls back to the plain JSON form when the
    SDK's conversion refuses the value (the SDK then sends its own error instead)."""
    if tool_call is None:
        return _shown(output)
    try:
        item = ItemHelpers.tool_call_output_item(
            tool_call, output, output_json_schema=tool.output_json_schema,
            output_type_adapter=getattr(tool, "_output_type_adapter", None))
    except Exception:
        return _shown(output)
    return _shown(item["output"])


def _sent_error(tool: FunctionTool, tool_call: Any, message: str) -> JSON:
    """What the SDK sends for an answer it generated (a guardrail's rejection)."""
    if tool_call is None:
        return message
    return _shown(function_tool_error_output(tool_call, message,
                                             output_json_schema=tool.output_json_schema))


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
    the SDK was not called). ``replayed`` is True when the run had completed before this
    attempt: ``final_output`` is its recorded output, no model was called and no tool
    ran."""

    final_output: Any
    step: Step
    pending: tuple[ToolCall, ...]
    interruptions: tuple[ToolApprovalItem, ...]
    state: RunState[Any] | None
    sdk_result: RunResult | RunResultStreaming | None
    replayed: bool = False


# ----------------------------------------------------------------- the Session


class LedgerSession:
    """Any openai-agents `Session`, written only through staged publications.

    ``add_items`` stages the batch in the run's envelope (reading just enough of the
    Session's tail), makes it durable, writes it, and reports the outcome: a write that
    raised is reported failed and its error propagates; a cancelled write may still land
    and is not reported (the run stays ``UNSETTLED`` until it is reconciled). A result the
    ledger shows published, or a call the run already wrote (a replayed response asks the
    SDK to write it again), is dropped from the batch: it is never written twice. Reads pass
    through; ``pop_item`` and ``clear_session`` are refused while a write is unsettled (they
    would move the frontier the envelope recorded)."""

    def __init__(self, run: AgentRun, inner: SDKSession) -> None:
        self._run = run
        self.inner = inner
        self.session_id = inner.session_id
        self.session_settings = getattr(inner, "session_settings", None)

    async def get_items(self, limit: int | None = None) -> list[Any]:
        """The Session's items with the run's publications that ride to its next flush
        (`runner.publish.run_history`): the SDK builds the model's input from these."""
        return list(await run_history(self._run.controller, self.inner, limit))

    async def add_items(self, items: list[Any]) -> None:
        run = self._run
        c = run.controller
        batch = [item for item in _items(items) if not _already_published(c, item)
                 and _written_call(item) not in run._written and not run._rewritten(item)]
        if not batch or not run._final_checked():
            return  # (a final answer whose checks did not all pass is never written)
        run._answer_unrun(batch)
        run._accept_final_output()
        ids = dict.fromkeys(_call_id(item) for item in batch)
        owed = set(c.unpublished_call_ids())
        call_ids = [call_id for call_id in ids if call_id in owed]
        version = c.version
        try:
            async with run._flush_lock:  # publish flushes the staged envelope itself
                # a Session in the store's database: the write rides with the run's next
                # flush (before a tool body, or at the attempt's end); the SDK reads it
                # back through get_items, which adds what rides
                await publish(c, self.inner, batch, call_ids=call_ids, ride=True)
        except BaseException as error:
            run._write_error = error
            raise
        finally:
            if c.version > version:  # staged: written now, or by the reconcile that settles it
                run._written.update(_written_calls(batch))

    async def pop_item(self) -> Any:
        self._refuse_unsettled("pop_item")
        await self._written_through()
        return await self.inner.pop_item()

    async def clear_session(self) -> None:
        self._refuse_unsettled("clear_session")
        await self._written_through()
        await self.inner.clear_session()

    async def _written_through(self) -> None:
        """Write what rides to the next flush first: the Session must hold every item
        the run committed before one is taken off it."""
        run = self._run
        if run.controller.riding_items:
            async with run._flush_lock:
                await run.controller.flush_async()

    def _refuse_unsettled(self, action: str) -> None:
        c = self._run.controller
        if c.step is Step.UNSETTLED:
            raise PublicationUnsettled(
                "a write of this run is unsettled: its frontier must not move until it is "
                "reconciled", run_id=c.run_id, step=c.step, action=action)


def _call_id(item: JSON) -> str | None:
    if isinstance(item, dict):
        call_id = item.get("call_id")
        if isinstance(call_id, str):
            return call_id
    return None


def _written_call(item: JSON) -> str | None:
    """The call id of a ``function_call`` item (the model's request, written once)."""
    if isinstance(item, dict) and item.get("type") == "function_call":
        return _call_id(item)
    return None


def _written_calls(items: Sequence[JSON]) -> set[str]:
    return {call_id for call_id in map(_written_call, items) if call_id is not None}


def _written_again(events: Sequence[Any], response: Sequence[JSON]
                   ) -> collections.Counter[bytes]:
    """The items other than calls of a recorded ``response`` (by their ``id``) that the
    run's publications wrote (committed, or found written by a reconcile), as canonical
    JSON, each with how often it was written."""
    ids = {item.get("id") for item in response if isinstance(item, dict)
           and _written_call(item) is None and isinstance(item.get("id"), str)}
    found: collections.Counter[bytes] = collections.Counter()
    if not ids:
        return found
    staged: tuple[JSON, ...] = ()
    for event in events:
        if isinstance(event, PublicationStaged):
            staged = event.items
        elif isinstance(event, PublicationCommitted | ReconciledAcknowledge):
            found.update(canonical_json(item) for item in staged if isinstance(item, dict)
                         and item.get("id") in ids and _written_call(item) is None)
            staged = ()
    return found


def _already_published(c: RunController, item: JSON) -> bool:
    """A ``function_call_output`` of a call whose result the ledger shows published: the
    SDK resumed a state older than the ledger, and writing it again would duplicate it."""
    call_id = _call_id(item)
    return (call_id is not None and isinstance(item, dict)
            and item.get("type") == "function_call_output"
            and c.phase(call_id) is Phase.PUBLISHED)


# -------------------------------------------------------------------- the model


class _LedgerModel(Model):
    """An agent's model (or the run's), asked only after the controller allowed the
    call. ``inner`` is a `Model`, or a name resolved with the attempt's model provider."""

    def __init__(self, run: AgentRun, inner: Model | str | None) -> None:
        self._run = run
        self.inner = inner

    def _model(self) -> Model:
        if isinstance(self.inner, Model):
            return self.inner
        return self._run._model_named(self.inner)

    async def get_response(self, *args: Any, **kwargs: Any) -> ModelResponse:
        run = self._run
        replayed = run._replay()
        if replayed is not None:
            return replayed
        await run._begin_model_call()
        try:
            response = await self._model().get_response(*args, **kwargs)
        except BaseException as error:
            run._model_failed(error)
            raise
        await run._model_responded(response.output)
        return response

    async def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        run = self._run
        replayed = run._replay()
        if replayed is not None:
            yield _completed_event(replayed)
            return
        await run._begin_model_call()
        responded = False
        done: list[Any] = []  # each output item as its stream finished it
        try:
            async for event in self._model().stream_response(*args, **kwargs):
                kind = getattr(event, "type", None)
                if not responded and kind == "response.completed":
                    completed: Any = event
                    # as the SDK reads it: a backend may leave the completed response's
                    # output empty and give its items only as each finished
                    await run._model_responded(list(completed.response.output) or done)
                    responded = True
                elif kind == "response.output_item.done":
                    done.append(getattr(event, "item", None))
                yield event
        except BaseException as error:
            if not responded:
                run._model_failed(error)
            raise
        if not responded:
            run._model_failed(ModelStreamIncomplete)

    def get_retry_advice(self, request: Any) -> Any:
        return self._model().get_retry_advice(request)

    async def close(self) -> None:
        await self._model().close()

    async def _cleanup_on_run_end(self, owner: object) -> None:
        await self._model()._cleanup_on_run_end(owner)


def _response_of(items: Sequence[JSON]) -> ModelResponse:
    """The recorded model response, rebuilt (its items exactly; no usage: it costs
    nothing again)."""
    return ModelResponse(output=[_OUTPUT_ITEM.validate_python(item) for item in items],
                         usage=Usage(), response_id=None)


def _completed_event(response: ModelResponse) -> ResponseCompletedEvent:
    return ResponseCompletedEvent(
        type="response.completed", sequence_number=0,
        response=Response(id="replayed", created_at=0, model="replayed", object="response",
                          output=list(response.output), tool_choice="none", tools=[],
                          top_p=None, parallel_tool_calls=False, status="completed"))


# -------------------------------------------------------------------- the hooks


class _LedgerHooks(RunHooks[Any]):
    """The run's hooks (``hooks=``) and each agent's own (``agent.hooks``), each run at
    most once per scope: skipped when the log shows it ran, else run and recorded
    (exactly once when no crash falls between running one and recording it)."""

    def __init__(self, run: AgentRun, hooks: RunHooks[Any] | None) -> None:
        self._run = run
        self._hooks = hooks

    def _methods(self, run_name: str, agent_name: str, agent: Any
                 ) -> list[Callable[..., Awaitable[None]]]:
        agent_hooks = self._run._original_of(agent).hooks
        return [method for method in (_overridden(self._hooks, run_name, RunHooksBase),
                                      _overridden(agent_hooks, agent_name, AgentHooksBase))
                if method is not None]

    async def _once(self, hook: str, call_id: str | None, run_name: str, agent_name: str,
                    context: Any, agent: Any, *args: Any) -> None:
        methods = self._methods(run_name, agent_name, agent)
        if not methods:
            return  # nothing of the user's runs here: nothing to record
        c = self._run.controller
        if c.hook_done(hook, call_id=call_id):
            return
        await self._run._fence()  # a superseded attempt runs no hook (I1)
        for method in methods:
            await method(context, agent, *args)
        c.hook_ran(hook, call_id=call_id)

    async def on_agent_start(self, context: Any, agent: Any) -> None:
        self._run._activate(agent)
        await self._once("agent_start", None, "on_agent_start", "on_start", context, agent)

    async def on_agent_end(self, context: Any, agent: Any, output: Any) -> None:
        self._run._final = (output,)  # accepted when written, once its guardrails passed
        await self._once("agent_end", None, "on_agent_end", "on_end", context, agent, output)

    async def on_llm_start(self, context: Any, agent: Any, system_prompt: str | None,
                           input_items: list[Any]) -> None:
        run = self._run
        run._context = context  # what callable approval policies are asked with
        run._current = agent
        run._activate(agent)
        if run._replaying:
            return  # the recorded response is replayed: its model call began long ago
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

    async def on_handoff(self, context: Any, from_agent: Any, to_agent: Any) -> None:
        run = self._run
        if not run._handoffs_ran:
            return  # its handoff call was answered from the ledger: its hooks ran then
        run._handoffs_ran -= 1
        if self._hooks is not None:
            await self._hooks.on_handoff(context, from_agent, to_agent)
        source_hooks = run._original_of(from_agent).hooks
        if source_hooks is not None:
            await source_hooks.on_handoff(context, to_agent, from_agent)


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
            output = GuardrailFunctionOutput(output_info=result["output_info"],
                                             tripwire_triggered=result["tripwire_triggered"])
        else:
            await run._fence()  # a superseded attempt runs no guardrail (I1)
            output = await maybe_await(guardrail.guardrail_function(context, agent, value))
            if recorded is None:
                c.guardrail_evaluated(name, {
                    "tripwire_triggered": bool(output.tripwire_triggered),
                    "output_info": _shown(output.output_info)}, stage=stage)
        if stage == "output" and output.tripwire_triggered:
            run._tripped = name  # the final output is never accepted
        return output

    if stage == "input":
        return InputGuardrail(guardrail_function=check, name=name,
                              run_in_parallel=guardrail.run_in_parallel)
    return OutputGuardrail(guardrail_function=check, name=name)


def _verdict(recorded: Any) -> ToolGuardrailFunctionOutput:
    result: Any = recorded.result
    return ToolGuardrailFunctionOutput(output_info=result["output_info"],
                                       behavior=result["behavior"])


def _tool_input_guardrail(run: AgentRun, guardrail: Any) -> ToolInputGuardrail[Any]:
    """A tool input guardrail that runs once per call. A call it rejects never runs: the
    SDK sends the rejection, which the ledger records as the call's result when it is
    written (`AgentRun._answer_unrun`)."""
    name = guardrail.get_name()

    async def check(data: ToolInputGuardrailData) -> ToolGuardrailFunctionOutput:
        c = run.controller
        call_id = data.context.tool_call_id
        recorded = c.recorded_guardrail(name, stage="tool_input", call_id=call_id)
        if recorded is not None:
            return _verdict(recorded)
        await run._fence()
        output = await maybe_await(guardrail.guardrail_function(data))
        c.guardrail_evaluated(name, {"behavior": _shown(dict(output.behavior)),
                                     "output_info": _shown(output.output_info)},
                              stage="tool_input", call_id=call_id)
        return output  # type: ignore[no-any-return]

    return ToolInputGuardrail(guardrail_function=check, name=name)


def _tool_output_guardrail(run: AgentRun, tool: FunctionTool, guardrail: Any, last: bool
                           ) -> ToolOutputGuardrail[Any]:
    """A tool output guardrail that runs once per call. The call's result is recorded
    here, not when its body returned: what the SDK will send after the guardrail that
    decides it (the first to reject, or the last to allow), so the raw output of a tool
    whose output a guardrail replaced is never persisted."""
    name = guardrail.get_name()

    async def check(data: ToolOutputGuardrailData) -> ToolGuardrailFunctionOutput:
        c = run.controller
        context = data.context
        call_id = context.tool_call_id
        recorded = c.recorded_guardrail(name, stage="tool_output", call_id=call_id)
        if recorded is not None:
            verdict = _verdict(recorded)
        else:
            await run._fence()
            verdict = await maybe_await(guardrail.guardrail_function(data))
            c.guardrail_evaluated(name, {"behavior": _shown(dict(verdict.behavior)),
                                         "output_info": _shown(verdict.output_info)},
                                  stage="tool_output", call_id=call_id)
        if call_id not in c.in_flight:
            return verdict  # a resent result: recorded when it was first decided
        behavior: Any = verdict.behavior
        kind = behavior["type"]
        tool_call = context.tool_call
        if kind == "reject_content":
            final = _sent_error(tool, tool_call, behavior["message"])
        elif kind == "raise_exception":
            final = (f"The tool ran, but its output was withheld: the tool output "
                     f"guardrail {name!r} tripped.")
        elif last:
            final = _sent(tool, tool_call, data.output)
        else:
            return verdict  # the next guardrail decides
        kept, recorded_result = record_result(c, call_id, final, staged=run._staged())
        if not kept and kind != "raise_exception":
            # the run could not keep what the SDK would send: the model is sent the
            # failure the ledger recorded instead
            return ToolGuardrailFunctionOutput.reject_content(
                str(recorded_result), output_info=verdict.output_info)
        return verdict

    return ToolOutputGuardrail(guardrail_function=check, name=name)


# --------------------------------------------------------------------- the tools


def _copied(agent: Agent[Any], **fields: Any) -> Agent[Any]:
    """A copy of ``agent`` with ``fields`` replaced, each of the type the SDK checks
    for. Not ``agent.clone``: its ``__post_init__`` checks again every field the user's
    agent passed already, and compares the settings with a fresh default, about 70 µs a
    copy, on every attempt; the settings it would derive for the ledger's model are set
    by each attempt anyway (`AgentRun._config`). The copy shares every other field with
    the user's agent, as ``clone`` does."""
    copied = copy.copy(agent)
    for name, value in fields.items():
        setattr(copied, name, value)
    return copied


def _ledgered_tool(run: AgentRun, tool: FunctionTool) -> FunctionTool:
    wrapped = copy.copy(tool)
    inner = tool.on_invoke_tool
    guarded = bool(tool.tool_output_guardrails)

    async def invoke(ctx: ToolContext[Any], input: str) -> Any:
        return await run._invoke_tool(tool, inner, ctx, input, keep=not guarded)

    original = tool.needs_approval

    async def needs_approval(context: Any, arguments: Any, call_id: str) -> bool:
        # the ledger's decision once it holds the call (a replayed response is not asked
        # for approval again); the tool's own setting for a call it does not hold
        phase = run.controller.phase(call_id)
        if phase is None:
            if isinstance(original, bool):
                return original
            return bool(await maybe_await(original(context, arguments, call_id)))
        return phase in (Phase.AWAITING, Phase.REJECTED)

    wrapped.on_invoke_tool = invoke
    wrapped.needs_approval = needs_approval
    wrapped.tool_input_guardrails = [_tool_input_guardrail(run, g)
                                     for g in tool.tool_input_guardrails or []] or None
    guardrails = tool.tool_output_guardrails or []
    wrapped.tool_output_guardrails = [
        _tool_output_guardrail(run, tool, g, last=i == len(guardrails) - 1)
        for i, g in enumerate(guardrails)] or None
    return wrapped


# ------------------------------------------------------------------ MCP servers


class _LedgerMCPServer:
    """An agent's MCP server as the SDK sees it in a run: everything passes through to
    ``inner`` but ``call_tool``, which only the body of a call the ledger started sends
    (its start durable first: `AgentRun._invoke_mcp_tool`), with the call's idempotency
    key in the request's ``_meta``. A failure that is not the server's answer (`answered`:
    a lost response, a timeout, a cut connection) is noted for that body, which leaves
    the call in doubt whatever the SDK makes of the failure."""

    def __init__(self, run: AgentRun, inner: MCPServer) -> None:
        self._run = run
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def call_tool(self, tool_name: str, arguments: dict[str, Any] | None,
                        meta: dict[str, Any] | None = None) -> Any:
        run = self._run
        try:
            context = tool_context()
        except LookupError:
            c = run.controller
            raise InvalidTransition(
                f"a tools/call of {tool_name!r} on MCP server {self.inner.name!r} came from "
                "outside a call the ledger started; it was not sent", run_id=c.run_id,
                step=c.step, action="call_tool") from None
        try:
            return await self.inner.call_tool(tool_name, arguments,
                                              meta=with_key(meta, context.idempotency_key))
        except BaseException as error:
            if not answered(error):
                run._lost[context.call_id] = error
            raise


def _ledger_mcp(run: AgentRun, original: Agent[Any], clone: Agent[Any]) -> None:
    """Give ``clone`` (the copy of ``original`` the SDK runs) ``original``'s MCP servers,
    each behind `_LedgerMCPServer`. The SDK lists their tools on every turn
    (`Agent.get_mcp_tools`): each tool it lists is handed to it ledgered
    (`_ledgered_mcp_tool`), and noted for the turn's record (its approval setting, and
    whether it is idempotent: named in ``idempotent=``, or hinted read-only or idempotent
    by a server named in ``trusted_mcp_servers=``)."""
    servers = list(original.mcp_servers)
    if not servers:
        return
    clone.mcp_servers = [cast("MCPServer", _LedgerMCPServer(run, s)) for s in servers]
    listing = type(clone).get_mcp_tools

    async def get_mcp_tools(run_context: Any) -> list[Any]:
        tools = await listing(clone, run_context)
        listed: dict[str, tuple[FunctionTool, bool]] = {}
        ledgered: list[Any] = []
        for tool in tools:
            if not isinstance(tool, FunctionTool):  # pragma: no cover - the SDK lists these
                raise _refuse(f"{type(tool).__name__} MCP tools", "an MCP server listed a "
                              "tool that is not a FunctionTool", action="run")
            binding = getattr(tool, "_mcp_tool_binding", None)
            index = binding[2] if binding is not None and binding[2] is not None else 0
            server = servers[index] if 0 <= index < len(servers) else None
            trusted = server is not None and server.name in run._trusted_mcp
            hinted = trusted and hinted_idempotent(getattr(tool, "_mcp_annotations", None))
            listed[tool.name] = (tool, tool.name in run._idempotent or hinted)
            ledgered.append(_ledgered_mcp_tool(run, tool))
        run._mcp_listed[id(original)] = listed
        return ledgered

    object.__setattr__(clone, "get_mcp_tools", get_mcp_tools)


def _ledgered_mcp_tool(run: AgentRun, tool: FunctionTool) -> FunctionTool:
    """An MCP tool the SDK listed, ledgered like a function tool (approvals, guardrails),
    its body the SDK's own ``tools/call`` through `AgentRun._invoke_mcp_tool`."""
    wrapped = _ledgered_tool(run, tool)
    inner = tool.on_invoke_tool
    keep = not tool.tool_output_guardrails  # else its output guardrails record the result

    async def invoke(ctx: ToolContext[Any], input: str) -> Any:
        return await run._invoke_mcp_tool(tool, inner, ctx, input, keep=keep)

    wrapped.on_invoke_tool = invoke
    return wrapped


def _handoffs(agent: Agent[Any]) -> list[Handoff[Any, Any]]:
    """``agent``'s handoffs, each as a `Handoff` (an agent given directly becomes the
    SDK's default handoff to it)."""
    return [h if isinstance(h, Handoff) else handoff(h) for h in agent.handoffs]


def _target(h: Handoff[Any, Any]) -> Agent[Any] | None:
    ref = h._agent_ref
    target = ref() if ref is not None else None
    return target if isinstance(target, Agent) else None


def _agents(agent: Agent[Any]) -> list[Agent[Any]]:
    """``agent`` and every agent its handoffs reach, in order, each once."""
    found: dict[int, Agent[Any]] = {}
    todo = [agent]
    while todo:
        current = todo.pop(0)
        if id(current) in found:
            continue
        found[id(current)] = current
        todo.extend(target for target in map(_target, _handoffs(current))
                    if target is not None)
    return list(found.values())


def _function_tools(agent: Agent[Any]) -> set[str]:
    """The names of the function tools of ``agent`` and of every agent its handoffs reach:
    the tools a verifier may be given for."""
    return {tool.name for each in _agents(agent) for tool in each.tools
            if isinstance(tool, FunctionTool)}


def _has_mcp(agent: Agent[Any]) -> bool:
    """Whether an agent of the run has MCP servers: their tools are listed only at run
    time, so a verifier's name cannot be checked against them at open."""
    return any(each.mcp_servers for each in _agents(agent))


def _refuse(feature: str, reason: str, *, action: str = "open") -> UnsupportedFeature:
    return UnsupportedFeature(f"{reason}; the openai-agents adapter does not carry "
                              f"{feature}", feature=feature, action=action)


async def _enabled(setting: Any, context: Any, agent: Agent[Any]) -> bool:
    """A tool's or handoff's ``is_enabled`` for this turn, evaluated as the SDK does."""
    if isinstance(setting, bool):
        return setting
    return bool(await maybe_await(setting(context, agent)))


def _standing(state: RunState[Any]) -> UnsupportedFeature | None:
    """The refusal of a standing decision taken on the SDK state (``approve(item,
    always_approve=True)``, ``reject(item, always_reject=True)``), which would let the SDK
    start later calls the ledger holds no decision for; None when it holds none."""
    approvals = getattr(state._context, "_approvals", None) or {}
    standing = sorted(name for name, record in approvals.items()
                      if record.approved is True or record.rejected is True)
    if not standing:
        return None
    return _refuse("standing decisions (always_approve / always_reject)",
                   f"the SDK state holds a standing decision for {', '.join(standing)}: "
                   "the ledger binds each decision to one call (approve or reject each "
                   "call, with AgentRun.approve / reject or state.approve(item))",
                   action="run")


def _tripped(error: BaseException, output_guardrail: str | None) -> str | None:
    """The abandon reason for an attempt ending with a guardrail's tripwire, else None."""
    if isinstance(error, OutputGuardrailTripwireTriggered):
        return (f"the output guardrail {output_guardrail or 'of the agent'!r} tripped: its "
                "final output was never accepted")
    if isinstance(error, InputGuardrailTripwireTriggered):
        name = error.guardrail_result.guardrail.get_name()
        return f"the input guardrail {name!r} tripped: the run's input was refused"
    tool_tripwires = (ToolInputGuardrailTripwireTriggered, ToolOutputGuardrailTripwireTriggered)
    if isinstance(error, tool_tripwires):
        stage = "input" if isinstance(error, ToolInputGuardrailTripwireTriggered) else "output"
        return f"the tool {stage} guardrail {error.guardrail.get_name()!r} tripped"
    return None


def _check_supported(agent: Agent[Any]) -> None:
    """Refuse what the adapter cannot make safe, before anything is recorded or runs."""
    for each in _agents(agent):
        _check_retries(each)
        others = sorted({type(t).__name__ for t in each.tools if not isinstance(t, FunctionTool)})
        if others:
            raise _refuse(f"{', '.join(others)} tools", f"agent {each.name!r} has tools that "
                          "are not FunctionTools")
        for tool in each.tools:
            nested = getattr(tool, "_agent_instance", None)
            if getattr(tool, "_is_agent_tool", False) and isinstance(nested, Agent):
                _check_agent_tool(tool.name, nested)
        for h in _handoffs(each):
            if _target(h) is None:
                raise _refuse("handoffs without their agent", f"agent {each.name!r} has a "
                              f"handoff {h.tool_name!r} not built with handoff(agent)")
            if h.input_filter is not None or h.nest_handoff_history:
                raise _refuse("handoff input filters", f"agent {each.name!r} has a handoff "
                              f"{h.tool_name!r} that rewrites the next agent's input")


def _check_retries(agent: Agent[Any]) -> None:
    """Refuse an MCP server of ``agent`` that retries: a tools/call whose response was
    lost would be sent again."""
    for server in agent.mcp_servers:
        retries = getattr(server, "max_retry_attempts", 0)
        if retries != 0:
            raise _refuse("MCP servers that retry", f"agent {agent.name!r} has MCP server "
                          f"{server.name!r} configured to retry (max_retry_attempts="
                          f"{retries}): a tools/call whose response was lost would be "
                          "sent again (give it max_retry_attempts=0)")


def _may_need_approval(server: Any) -> bool:
    """Whether an MCP server's tools may need approval (its ``require_approval``, as
    the SDK keeps it: a bool, a name-to-bool map, or a callable policy)."""
    policy = getattr(server, "_needs_approval_policy", False)
    if isinstance(policy, dict):
        return any(policy.values())
    return policy is not False


def _check_trusted(agent: Agent[Any], trusted: Collection[str]) -> None:
    """Refuse a trusted MCP server name that no agent of the run has: a misspelt name
    would leave the server untrusted while its user believes otherwise."""
    if isinstance(trusted, str):
        raise _refuse("trusted MCP servers", "trusted_mcp_servers is one text, not a "
                      "collection of server names")
    names = {server.name for each in _agents(agent) for server in each.mcp_servers}
    unknown = sorted(set(trusted) - names)
    if unknown:
        raise _refuse("trusted MCP servers", f"trusted_mcp_servers names "
                      f"{', '.join(map(repr, unknown))}, which no agent of the run has as "
                      "an MCP server")


def _check_agent_tool(name: str, agent: Agent[Any]) -> None:
    """An agent used as a tool runs, whole, as that call's body (its model calls and
    tools inside it, at most once with it); a nested call needing approval would pause
    the outer run on a call the ledger does not know, and an MCP server that retries
    could send its tools/call twice inside the one body."""
    for each in _agents(agent):
        _check_retries(each)
        for server in each.mcp_servers:
            if _may_need_approval(server):
                raise _refuse("agent tools whose agent needs approvals",
                              f"the agent tool {name!r} runs agent {each.name!r}, whose MCP "
                              f"server {server.name!r} may need approval")
        for tool in each.tools:
            if isinstance(tool, FunctionTool) and tool.needs_approval is not False:
                raise _refuse("agent tools whose agent needs approvals",
                              f"the agent tool {name!r} runs agent {each.name!r}, whose tool "
                              f"{tool.name!r} may need approval")
            nested = getattr(tool, "_agent_instance", None)
            if getattr(tool, "_is_agent_tool", False) and isinstance(nested, Agent):
                _check_agent_tool(name, nested)


def _check_config(config: RunConfig) -> None:
    """Refuse the run options the adapter cannot carry (before the attempt does
    anything)."""
    if config.handoff_input_filter is not None or config.nest_handoff_history:
        raise _refuse("handoff input filters", "the run config rewrites the input of the "
                      "agent a handoff reaches")
    execution = config.tool_execution
    if execution is not None and execution.pre_approval_tool_input_guardrails:
        raise _refuse("pre-approval tool input guardrails", "the run config runs tool input "
                      "guardrails before the approval")


def _check_session(controller: RunController, session: SDKSession) -> None:
    if session.session_id != controller.session_id:
        raise ReconcileRejected(
            f"the Session {session.session_id!r} is not the run's Session "
            f"{controller.session_id!r}; nothing was run or written",
            run_id=controller.run_id, step=controller.step, action="open")


# ----------------------------------------------------------------------- the run


@attrs.define
class _Call:
    """What the SDK is asked to run in one attempt."""

    agent: Agent[Any]
    input: list[Any] | RunState[Any]


class AgentRun:
    """One run of an openai-agents `Agent`, bound to a `RunController`.

    Open it with `AgentRun.open` (loads the run from ``store`` when it exists, else starts
    it), then drive it with `run` or `run_streamed`, decide with `approve` / `reject` (or
    through the SDK state it returned: ``result.state.approve(item)``), repair with
    `settle`, and settle a call in doubt with `resolve_in_doubt` (or end the run with
    `abandon`). Every public call may raise the controller's refusals: `RunNotResumable`,
    `ToolInDoubt`, `PublicationUnsettled`, `ReconcileRejected`, `ConcurrencyConflict`,
    `InvalidTransition`, `SDKStateRequired` and `UnsupportedFeature`."""

    def __init__(self, agent: Agent[Any], controller: RunController, session: SDKSession,
                 *, existing: bool, owner: str | None, take_over: bool,
                 idempotent: Collection[str],
                 trusted_mcp_servers: Collection[str] = (),
                 verifiers: Mapping[str, Verifier] | None = None) -> None:
        _check_supported(agent)
        _check_trusted(agent, trusted_mcp_servers)
        _check_session(controller, session)
        checked = checked_verifiers(verifiers, _function_tools(agent), idempotent=idempotent,
                                    run_id=controller.run_id, any_name=_has_mcp(agent))
        self.controller = controller
        self.take_over = take_over
        """Whether a write that an earlier attempt left open may be taken over: True only
        when no write of that attempt can still land (its process is gone)."""
        self.session = LedgerSession(self, session)
        self._inner_session = session
        self._idempotent = frozenset(idempotent)
        self._trusted_mcp = frozenset(trusted_mcp_servers)
        """The MCP servers (by name) whose read-only and idempotent hints count."""
        self._mcp_listed: dict[int, dict[str, tuple[FunctionTool, bool]]] = {}
        """By user's agent: the MCP tools the SDK listed last, each with whether it is
        idempotent."""
        self._lost: dict[str, BaseException] = {}
        """By call id: the failure of a tools/call that may have come after the tool ran."""
        self._state: RunState[Any] | None = None
        self._context: Any = None
        self._write_error: BaseException | None = None
        self._flush_lock = asyncio.Lock()
        self._attempt = Attempt(controller, resumes=existing, owner=owner, flush=self._flush,
                                verifiers=checked)
        self._fresh_input = False
        """This attempt brought input after the activation's input guardrails were recorded:
        they check it again (the log keeps one verdict per activation: the first)."""
        self._final: tuple[Any] | None = None
        """The final output the SDK reached (``on_agent_end``), accepted when written."""
        self._tripped: str | None = None
        """The output guardrail that tripped in this attempt: its output is never accepted."""
        self._replaying = False
        self._handoffs_ran = 0
        self._config_now = RunConfig()
        self._user_config: RunConfig | None = None
        self._models: dict[str | None, Model] = {}
        originals = _agents(agent)
        self._wrapped: dict[int, Agent[Any]] = {
            id(each): _copied(
                each,
                model=_LedgerModel(self, each.model),
                tools=[_ledgered_tool(self, t) if isinstance(t, FunctionTool) else t
                       for t in each.tools],
                input_guardrails=[_agent_guardrail(self, g, "input")
                                  for g in each.input_guardrails],
                output_guardrails=[_agent_guardrail(self, g, "output")
                                   for g in each.output_guardrails],
                hooks=None)
            for each in originals}
        self._originals: dict[int, Agent[Any]] = {
            id(self._wrapped[id(each)]): each for each in originals}
        self._by_name = {each.name: self._wrapped[id(each)] for each in reversed(originals)}
        for each in originals:  # their MCP tools through the ledger
            _ledger_mcp(self, each, self._wrapped[id(each)])
        for each in originals:  # the copies hand off to the copies
            self._wrapped[id(each)].handoffs = [self._ledgered_handoff(h)
                                                for h in _handoffs(each)]
        self._agent = self._wrapped[id(agent)]
        self._current = self._agent
        self._active = agent.name
        """The agent the ledger shows active: the target of its last handoff."""
        self._written: set[str] = set()
        """The calls whose ``function_call`` item the run has written (staged)."""
        self._rewrites: collections.Counter[bytes] = collections.Counter()
        """The items of a replayed response the run wrote before (`_rewritten`)."""
        for event in controller.events if existing else ():
            if isinstance(event, HandedOff):
                self._active = event.target
            elif isinstance(event, PublicationStaged):
                self._written.update(_written_calls(event.items))

    # ------------------------------------------------------------------ opening

    @classmethod
    async def open(cls, agent: Agent[Any], *, run_id: str, session: SDKSession,
                   store: EventStore | AsyncEventStore | None = None,
                   policy: RecoveryPolicy = RecoveryPolicy.RECONCILE,
                   owner: str | None = None, take_over: bool = False,
                   idempotent: Collection[str] = (), buffered: bool = True,
                   trusted_mcp_servers: Collection[str] = (),
                   verifiers: Mapping[str, Verifier] | None = None) -> AgentRun:
        """The run ``run_id``: loaded from ``store`` when the store holds it (another
        process may have started it), else started (bound to ``store``, on ``session``,
        under ``policy``). ``idempotent`` names the tools that may run again after a crash
        inside them (MCP tools too); every other tool's unfinished call is in doubt.
        ``trusted_mcp_servers`` names the MCP servers whose ``readOnlyHint`` /
        ``idempotentHint`` make a tool idempotent (an untrusted server's hints count for
        nothing). ``verifiers`` (by
        tool name: ``verify(context) -> Completed(output) | NotExecuted() | Unknown()``,
        sync or async, `statemachine.verifiers`) are asked, on each attempt right after its
        claim, what happened to a call of their tool left in doubt; inside a tool's body
        `statemachine.tool_context()` gives its call's idempotency key. ``owner`` is
        recorded by every claim. ``take_over=True`` only when no earlier write of this run
        can still land (its writer is gone). An agent the adapter cannot carry is refused
        (`UnsupportedFeature`), a verifier naming no function tool of the agent (or of an
        agent its handoffs reach) or not callable (`InvalidVerifier`), and a run opened on
        a Session that is not its own (`ReconcileRejected`), before anything is
        recorded."""
        _check_supported(agent)
        _check_trusted(agent, trusted_mcp_servers)
        checked_verifiers(verifiers, _function_tools(agent), idempotent=idempotent,
                          run_id=run_id, any_name=_has_mcp(agent))
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
                   take_over=take_over, idempotent=idempotent,
                   trusted_mcp_servers=trusted_mcp_servers, verifiers=verifiers)

    @classmethod
    def from_controller(cls, agent: Agent[Any], controller: RunController,
                        session: SDKSession, *, owner: str | None = None,
                        take_over: bool = False, idempotent: Collection[str] = (),
                        trusted_mcp_servers: Collection[str] = (),
                        verifiers: Mapping[str, Verifier] | None = None) -> AgentRun:
        """An existing run from its controller (e.g. ``RunController.from_json``)."""
        return cls(agent, controller, session, existing=True, owner=owner,
                   take_over=take_over, idempotent=idempotent,
                   trusted_mcp_servers=trusted_mcp_servers, verifiers=verifiers)

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

    def _original_of(self, agent: Any) -> Agent[Any]:
        """The user's agent behind one of the copies the SDK runs (``agent`` itself when it
        is none of them)."""
        return cast("Agent[Any]", self._originals.get(id(agent), agent))

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

    def _take_sdk_decisions(self, state: RunState[Any]) -> None:
        """Record the decisions taken on the SDK state (``state.approve(item)``) for calls
        the ledger still shows awaiting one, bound to the arguments each item shows: the
        SDK's API is honoured, never dropped."""
        c = self.controller
        context = state._context
        if context is None or c.step is not Step.INTERRUPTION:
            return
        for item in state.get_interruptions():
            call_id = item.call_id
            if call_id is None or c.phase(call_id) is not Phase.AWAITING:
                continue
            name = item.tool_name or item.name or ""
            status = context.get_approval_status(name, call_id, existing_pending=item)
            if status is None:
                continue
            _, fingerprint = self._decision(item)
            if status:
                c.approve(call_id, fingerprint=fingerprint)
            else:
                c.reject(call_id, context.get_rejection_message(
                    name, call_id, existing_pending=item), fingerprint=fingerprint)

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
        another process). The original error of a failed write propagates (I6). A run
        that already completed returns its recorded result (``replayed``)."""
        options = self._options(hooks, run_config, context, max_turns)
        new_items = _new_items(input)
        finished = self._finished(new_items)
        if finished is not None:
            return finished
        async with self._attempt as resumes:
            try:
                call = await self._prologue(new_items, state, new_run=not resumes)
                if isinstance(call, AgentRunResult):
                    return call
                result = await Runner.run(call.agent, call.input, **options)
            except BaseException as error:
                self._failed(error)
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

    async def resolve_in_doubt(self, call_id: str, output: JSON = None, *,
                               outcome: Resolution = Resolution.COMPLETED,
                               by: str | None = None, evidence: str | None = None) -> None:
        """Record what happened to a call in doubt (`RunController.resolve_in_doubt`):
        ``COMPLETED`` (``output`` is handed to the SDK as the tool's return value, so the
        model gets the function-call output the SDK makes of it), ``FAILED`` (``output``
        is the error text the model gets as that output) or ``NOT_EXECUTED`` (no output:
        the next `run` runs the tool, once). Claims the run first as ``by`` (else this
        run's owner), durable before it returns; a refusal (`InvalidTransition` for a call
        not in doubt, `SchemaError`, `ConcurrencyConflict`) records nothing."""
        c = self.controller
        await decide_async(c, by if by is not None else self.owner,
                           resolving(c, call_id, output, outcome=outcome, by=by,
                                     evidence=evidence), flush=self._flush)

    async def abandon(self, reason: str, *, by: str | None = None) -> None:
        """End the run for good (`RunController.abandon`), claimed first like
        `resolve_in_doubt`: every later `run` is refused (`RunNotResumable`)."""
        c = self.controller
        await decide_async(c, by if by is not None else self.owner,
                           abandoning(reason, by=by), flush=self._flush)

    async def settle(self, *, take_over: bool | None = None) -> None:
        """Settle an unsettled write now (claiming the run first), without calling the
        SDK: reconcile and write the batch if nothing of it landed. `ReconcileRejected`
        when the Session cannot be matched (nothing recorded; repair it and call again).
        ``take_over`` (default: the run's, `open`) only when the process that left the
        write is gone and no write of it can still land."""
        take_over = self.take_over if take_over is None else take_over
        try:
            await self._attempt.settle(self._inner_session, take_over=take_over)
        except ReconcileRejected as refused:
            told = naming_take_over(refused, _TAKE_OVER)
            if told is refused:
                raise
            raise told from None

    def _options(self, hooks: RunHooks[Any] | None, run_config: RunConfig | None,
                 context: Any, max_turns: int | None) -> dict[str, Any]:
        options: dict[str, Any] = {
            "session": self.session,
            "hooks": _LedgerHooks(self, hooks),
            "run_config": self._config(run_config),
            "context": context,
        }
        if max_turns is not None:
            options["max_turns"] = max_turns
        return options

    def _config(self, run_config: RunConfig | None) -> RunConfig:
        config = copy.copy(run_config) if run_config is not None else RunConfig()
        _check_config(config)
        self._user_config = run_config
        self._config_now = config
        self._models = {}
        # the settings the SDK alone would send each agent's model: the SDK derives those
        # an agent leaves implicit from the model's *name* (a gpt-5's reasoning effort and
        # verbosity), which the copies, whose model is the ledger's, no longer have; so
        # each copy is given them outright (the run's own settings still go on top)
        named = copy.copy(config)
        named.model_settings = None
        for original in self._originals.values():
            self._wrapped[id(original)].model_settings = sdk_model_settings(original, named)
        if config.model is not None:  # the run's model overrides every agent's (the SDK)
            config.model = _LedgerModel(self, config.model)
        config.input_guardrails = [_agent_guardrail(self, g, "input")
                                   for g in config.input_guardrails or []] or None
        config.output_guardrails = [_agent_guardrail(self, g, "output")
                                    for g in config.output_guardrails or []] or None
        return config

    def _model_named(self, name: str | None) -> Model:
        """An agent's model given by name, resolved as the SDK does (the attempt's model
        provider), once per attempt."""
        model = self._models.get(name)
        if model is None:
            model = self._models[name] = self._config_now.model_provider.get_model(name)
        return model

    async def _prologue(self, new_items: list[JSON],
                        state: RunState[Any] | str | Mapping[str, Any] | None, *,
                        new_run: bool) -> AgentRunResult | _Call:
        """An attempt's work before the SDK is called, after its claim: what to run."""
        c = self.controller
        c.resume()  # the gate: RunNotResumable or ToolInDoubt before any work
        self._write_error = None
        self._final = None
        self._tripped = None
        self._replaying = False
        self._handoffs_ran = 0
        if state is not None:
            self._state = await self._hydrate(state)
        if self._state is not None:  # given, or held (the state a result handed out)
            standing = _standing(self._state)
            if standing is not None:  # refused before anything is recorded, and not kept
                self._state = None
                raise standing
        if self._state is not None and not self._in_turn(self._state):
            self._state = None  # saved at an earlier turn: the ledger has moved past it
        if new_run:
            await one_writer(c, self._inner_session)
        if new_items:
            c.add_input(new_items)  # PublicationUnsettled while a write is unsettled
        self._fresh_input = bool(new_items) and not new_run
        unsettled = c.step is Step.UNSETTLED
        await settle_unsettled(c, self._inner_session, take_over=self.take_over,
                               how=_TAKE_OVER)
        if unsettled:  # the settlement is durable before anything goes on from it; a new
            await self._flush()  # run's start and input wait for its first effect (§7.7)
        # input recorded by an attempt that stopped before writing it goes to the SDK now
        # (its write publishes it, before anything else)
        new_items = list(c.unpublished_input)
        if c.step is Step.COMPLETED:  # the settled batch published the final output
            return self._result(None)
        if self._state is not None:
            self._take_sdk_decisions(self._state)
            await self._flush()  # decisions are durable before anything acts on them
        action = c.resume()  # an interruption whose approved calls may run enters TOOLS
        if action is Action.AWAIT_DECISIONS and not new_items:
            return self._result(None)
        if c.step in _MID_TURN:
            if self._state is not None:
                self._sync_decisions()
                if new_items:
                    self._state.add_input(new_items)
                return _Call(self._agent, self._state)
            if new_items or not self._replayable():
                raise SDKStateRequired(
                    "the run stopped inside a turn that its recorded response cannot lead "
                    "back into (new input, or a rejection not yet written) and no SDK "
                    "RunState was given: pass the state saved at its last interruption "
                    "(state=), or abandon the run", run_id=c.run_id, step=c.step,
                    action="run")
            self._replaying = True  # the recorded response, not a new model call
        else:
            self._state = None
        # the Session holds the whole conversation, so a fresh SDK run continues from it,
        # with the agent the ledger shows active; only the new input is handed over
        return _Call(self._by_name.get(self._active, self._agent), new_items)

    def _finished(self, new_items: list[JSON]) -> AgentRunResult | None:
        """A run that already completed answers a retried request with its recorded
        output, running nothing and recording nothing; an abandoned one is refused,
        saying why."""
        c = self.controller
        if c.step is Step.COMPLETED:
            output = recorded_output(c, new_items)
            return AgentRunResult(output, c.step, (), (), None, None, replayed=True)
        if c.step is Step.TERMINAL_UNRECOVERABLE:
            raise RunNotResumable(f"the run was abandoned ({abandoned_reason(c)}) and never "
                                  "resumes", run_id=c.run_id, step=c.step, action="run")
        return None

    def _replayable(self) -> bool:
        """Whether the recorded model response of the turn leads the SDK back into it:
        replayed, the SDK pauses again for the calls awaiting a decision, runs the
        approved ones (or is answered from the cache), and checks and writes a final
        answer; only a rejection not yet written needs the SDK's state."""
        c = self.controller
        items = c.model_output
        if not isinstance(items, list):
            return False
        return all(c.phase(call_id) is not Phase.REJECTED
                   for call_id in map(_written_call, items) if call_id is not None)

    def _in_turn(self, state: RunState[Any]) -> bool:
        """Whether an SDK state was saved in the turn the ledger is in: its last model
        response proposed the calls of the ledger's last response. A state saved at an
        earlier interruption must not lead the SDK back into a turn the run has left."""
        responses = getattr(state, "_model_responses", None)
        items = self.controller.model_output
        if not responses or not isinstance(items, list):
            return True  # nothing to tell them apart by: the state is the only way back
        theirs = [getattr(item, "call_id", None) for item in responses[-1].output
                  if getattr(item, "type", None) == "function_call"]
        return theirs == [_written_call(item) for item in items
                          if _written_call(item) is not None]

    def _replay(self) -> ModelResponse | None:
        """The recorded response, once, when this attempt replays its turn; the SDK then
        writes its items again, and the ones the run wrote before are dropped
        (`_rewritten`)."""
        if not self._replaying:
            self._rewrites.clear()  # (a new model call: the replayed turn's items written)
            return None
        self._replaying = False
        items = self.controller.model_output
        assert isinstance(items, list)
        self._rewrites = _written_again(self.controller.events, items)
        return _response_of(items)

    def _rewritten(self, item: JSON) -> bool:
        """Whether ``item`` is one the run wrote before that the replayed response has the
        SDK write again (a message or a reasoning item of it; its calls are `_written`):
        dropped, once for each time it was written."""
        if not self._rewrites or _written_call(item) is not None:
            return False
        key = canonical_json(item)
        if self._rewrites[key] <= 0:
            return False
        self._rewrites[key] -= 1
        return True

    async def _hydrate(self, state: RunState[Any] | str | Mapping[str, Any]) -> RunState[Any]:
        """The SDK state, bound to this run's wrapped agents."""
        if isinstance(state, RunState):
            if id(state._current_agent) in self._originals:
                return state
            return await RunState.from_json(self._agent, state.to_json())
        if isinstance(state, str):
            return await RunState.from_string(self._agent, state)
        return await RunState.from_json(self._agent, dict(state))

    def _failed(self, error: BaseException) -> None:
        """The attempt is ending with ``error`` (its `Attempt` flushes what it recorded):
        a call whose result was never recorded is left in doubt, and a tripped guardrail
        (the agent's input or output guardrail, a tool's input or output guardrail) ends
        the run, abandoned with a reason naming it: its recorded verdict would trip again
        on every retry, so the run could never go on. Never replaces the error in
        flight."""
        c = self.controller
        for call_id in c.in_flight:
            interrupted(c, call_id)
        tripped = _tripped(error, self._tripped)
        if tripped is not None and c.step is not Step.UNSETTLED:  # a write settles first
            with contextlib.suppress(ControlError):  # (a finished run refuses: kept)
                c.abandon(tripped)

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

    async def _fence(self) -> None:
        """`RunController.fence_async` before an effect no append of this attempt
        precedes (a hook, a guardrail, the model call): never while one of the concurrent
        tools' flushes is on its way, which would look like another writer's append."""
        async with self._flush_lock:
            await self.controller.fence_async()

    def _activate(self, agent: Any) -> None:
        """Record the handoff to ``agent`` when it is not the agent the ledger shows
        active: the first model call of the agent a handoff reached starts its activation."""
        if id(agent) in self._originals and agent.name != self._active:
            self.controller.handoff(agent.name)
            self._active = agent.name

    async def _begin_model_call(self) -> None:
        c = self.controller
        if c.step is not Step.AWAITING_MODEL:  # a crash may have come after the record
            c.begin_model_call()  # refused while a write is unsettled (I2)
        # a model call needs no flush of its own (DESIGN §7.7): a crash before its
        # response calls the model again. But a tool's result recorded since the last
        # flush is made durable first, with what rides along (the Session write of its
        # call and output): a crash while the model answers then leaves the call
        # completed, not in doubt. Else this attempt must still hold the run (one read)
        async with self._flush_lock:
            await c.flush_results_async()

    def _model_failed(self, error: BaseException | type[BaseException]) -> None:
        c = self.controller
        if c.step is Step.AWAITING_MODEL:
            c.model_failed(error)

    async def _model_responded(self, output: Sequence[Any]) -> None:
        c = self.controller
        agent = self._original_of(self._current)
        # the tools and handoffs the SDK offers this turn: a disabled one (``is_enabled``)
        # is unknown to it, so a call naming it is answered as the SDK answers one
        tools = {t.name: t for t in agent.tools if isinstance(t, FunctionTool)
                 and await _enabled(t.is_enabled, self._context, agent)}
        mcp = self._mcp_listed.get(id(agent), {})
        tools.update((name, tool) for name, (tool, _) in mcp.items() if name not in tools)
        handoffs = {h.tool_name for h in _handoffs(agent)
                    if await _enabled(h.is_enabled, self._context, agent)}
        calls: list[ToolCall] = []
        unknown = False
        for item in output:
            if getattr(item, "type", None) != "function_call":
                continue
            name = item.name
            tool = tools.get(name)
            unknown = unknown or (tool is None and name not in handoffs)
            calls.append(ToolCall(item.call_id, name, _arguments(item.arguments),
                                  needs_approval=await self._needs_approval(tool, item),
                                  idempotent=name in self._idempotent or (
                                      name in mcp and mcp[name][1])))
        if unknown and self._config_now.tool_not_found_behavior == "raise_error":
            # the SDK refuses a response naming a tool the agent does not have: for the
            # ledger it is a failed model call, and the next attempt asks the model again
            c.model_failed(ModelBehaviorError)
            return
        c.model_responded(calls, output=_output_items(output))

    async def _needs_approval(self, tool: FunctionTool | None, item: Any) -> bool:
        """What the SDK will decide for this call (its own evaluation, so the ledger
        pauses exactly where the SDK pauses)."""
        if tool is None:
            return False  # a handoff, or an unknown tool the SDK answers itself
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

    def _answer_unrun(self, batch: Sequence[JSON]) -> None:
        """Before a batch is staged: a call the SDK answered without running its body (a
        tool input guardrail's rejection, an unknown tool's error, a handoff it ignored)
        is recorded with the answer it sent; a call in doubt whose answer the SDK made up
        (a timed-out or cancelled body turned into text) is refused (`ToolInDoubt`)."""
        c = self.controller
        for item in batch:
            call_id = _call_id(item)
            if call_id is None or not isinstance(item, dict) or (
                    item.get("type") != "function_call_output"):
                continue
            phase = c.phase(call_id)
            if phase is Phase.APPROVED:
                if c.step is Step.INTERRUPTION:
                    c.resume()
                c.begin_tool(call_id)
                c.tool_completed(call_id, item.get("output"))
            elif phase is Phase.AWAITING and c.step is Step.INTERRUPTION:
                c.reject(call_id, item.get("output"))
            elif phase is Phase.STARTED and call_id not in c.in_flight:
                raise ToolInDoubt(
                    f"call {call_id!r} ended without a result (cancelled or timed out) and "
                    "the SDK answered it; it is in doubt and never re-run: record its "
                    "outcome with resolve_in_doubt, or abandon the run", call_id=call_id,
                    run_id=c.run_id, step=c.step, action="publish")

    def _staged(self) -> int:
        """What a call's batch takes beside its result: the calls of the response, written
        with their results (room `record_result` keeps for publishing)."""
        items = self.controller.model_output
        if not isinstance(items, list):
            return 0
        return json_size([item for item in items if isinstance(item, dict)
                          and item.get("type") == "function_call"])

    def _final_checked(self) -> bool:
        """False while the final output the SDK reached has an output guardrail without
        a passing verdict (one tripped, or failed before its verdict): the SDK would write
        that answer anyway; the adapter does not, and the run stays where it is (a
        tripped one ends it)."""
        if self._final is None:
            return True
        c = self.controller
        guardrails = [*self._original_of(self._current).output_guardrails,
                      *(self._user_config.output_guardrails or []
                        if self._user_config is not None else [])]
        for guardrail in guardrails:
            recorded = c.recorded_guardrail(guardrail.get_name(), stage="output")
            result: Any = None if recorded is None else recorded.result
            if result is None or result["tripwire_triggered"]:
                return False
        return True

    def _accept_final_output(self) -> None:
        """Accept the final output the SDK reached, when it is written (after its output
        guardrails passed: never before their verdict, §2.1)."""
        c = self.controller
        final, self._final = self._final, None
        if final is not None and self._tripped is None and c.step in (Step.FINALIZING,
                                                                       Step.TOOLS):
            output = final[0]
            shown = _shown(output)
            c.accept_final_output(shown, lossless=lossless(output, shown))

    async def _invoke_tool(self, tool: FunctionTool,
                           inner: Callable[[ToolContext[Any], str], Awaitable[Any]],
                           ctx: ToolContext[Any], input: str, *, keep: bool) -> Any:
        if getattr(tool, "_is_agent_tool", False):
            # the nested run is this call's body: it runs with the run config the caller
            # gave (as it would on the SDK alone), never through this run's ledger
            ctx = copy.copy(ctx)
            ctx.run_config = self._user_config
        tool_call = ctx.tool_call
        return await run_call(self.controller, ctx.tool_call_id, _arguments(input),
                              flush=self._flush, body=lambda: inner(ctx, input),
                              as_json=lambda output: _sent(tool, tool_call, output),
                              answers=(Exception,),
                              answer=lambda error: default_tool_error_function(
                                  ctx, cast("Exception", error)),
                              keep=keep, staged=self._staged())

    async def _invoke_mcp_tool(self, tool: FunctionTool,
                               inner: Callable[[ToolContext[Any], str], Awaitable[Any]],
                               ctx: ToolContext[Any], input: str, *, keep: bool) -> Any:
        """One ``tools/call`` through the ledger: its recorded result when it must not be
        sent (`begin_call`); else its start made durable, then the SDK's own call (``inner``:
        the request through `_LedgerMCPServer`, with the call's idempotency key), once.
        A response lost after the request may have been sent (`_LedgerMCPServer` noted it)
        leaves the call in doubt (`ToolInDoubt`), whatever text the SDK made of the
        failure; the server's answer (a result, ``isError`` or not, or its refusal of the
        request) is recorded as the SDK sends it."""
        c = self.controller
        call_id = ctx.tool_call_id
        staged = self._staged()
        done, cached = begin_call(c, call_id, _arguments(input), staged=staged)
        if done:  # published before, or recorded: never sent again
            return cached
        await self._flush()  # durable before the request is sent
        self._lost.pop(call_id, None)
        try:
            with running_call(c, call_id):
                output = await inner(ctx, input)
        except Exception as error:  # the SDK raises the failure (failure_error_function=None)
            if call_id not in self._lost:  # the server's answer: recorded as the SDK sends it
                record_result(c, call_id, default_tool_error_function(ctx, error),
                              staged=staged)
                raise
            ending = self._response_lost(tool, call_id)
            if ending is error:
                raise
            raise ending from error
        except BaseException:
            self._lost.pop(call_id, None)
            interrupted(c, call_id)
            raise
        if call_id in self._lost:
            raise self._response_lost(tool, call_id)
        if not keep:
            return output
        kept, recorded = record_result(c, call_id, _sent(tool, ctx.tool_call, output),
                                       staged=staged)
        return output if kept else recorded

    def _response_lost(self, tool: FunctionTool, call_id: str) -> BaseException:
        """What ends the attempt whose call lost its response: the call stays started
        (`interrupted`), so a non-idempotent one is in doubt (`ToolInDoubt`, never sent
        again) and an idempotent one is sent again by the next attempt (the transport's
        own failure ends this one, as a function tool's would)."""
        c = self.controller
        lost = self._lost.pop(call_id)
        interrupted(c, call_id)
        if c.call(call_id).call.idempotent:
            return lost
        return ToolInDoubt(
            f"the MCP tools/call of {tool.name!r} (call {call_id!r}) ended without the "
            f"server's answer ({type(lost).__name__}) after it may have been sent: the call "
            "is in doubt and is never sent again; record its outcome with resolve_in_doubt "
            "(or give the tool a verifier), or abandon the run", call_id=call_id,
            run_id=c.run_id, step=c.step, action="call_tool")

    def _ledgered_handoff(self, h: Handoff[Any, Any]) -> Handoff[Any, Any]:
        """``h`` to the wrapped copy of its agent; its call goes through the ledger, so
        its ``on_handoff`` runs at most once."""
        target = self._wrapped[id(_target(h))]
        inner = h.on_invoke_handoff

        async def invoke(context: Any, input_json: str) -> Agent[Any]:
            await self._invoke_handoff(h, inner, context, input_json, target)
            return target

        wrapped = dataclasses.replace(h, on_invoke_handoff=invoke)
        wrapped._agent_ref = weakref.ref(target)
        return wrapped

    async def _invoke_handoff(self, h: Handoff[Any, Any], inner: Any, context: Any,
                              input_json: str, target: Agent[Any]) -> None:
        c = self.controller
        # the SDK executes the first handoff call of the response: the ledger's last
        # unpublished call of that name
        call_id = next((view.call.call_id for view in reversed(c.calls)
                        if view.call.name == h.tool_name and view.phase in (
                            Phase.APPROVED, Phase.STARTED, Phase.COMPLETED)), None)
        if call_id is None:
            raise InvalidTransition(f"the SDK handed off through {h.tool_name!r}, which no "
                                    "call of the ledger names", run_id=c.run_id,
                                    step=c.step, action="handoff")
        ran = False

        async def body() -> Any:
            nonlocal ran
            ran = True
            return await inner(context, input_json)

        await run_call(c, call_id, _arguments(input_json), flush=self._flush, body=body,
                       as_json=lambda _: h.get_transfer_message(target),
                       staged=self._staged())
        self._handoffs_ran += ran


def _new_items(input: str | list[Any] | None) -> list[JSON]:
    """An attempt's new input as the ledger records it."""
    return _items(ItemHelpers.input_to_new_input_list(input)) if input else []


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
            new_items = _new_items(self._input)
            self._result = run._finished(new_items)
            if self._result is not None:
                return
            async with run._attempt as resumes:
                try:
                    call = await run._prologue(new_items, self._state, new_run=not resumes)
                    if isinstance(call, AgentRunResult):
                        self._result = call
                        return
                    streamed = Runner.run_streamed(call.agent, call.input, **self._options)
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
                except BaseException as error:
                    run._failed(error)
                    raise
        except GeneratorExit:
            raise
        except BaseException as error:
            self._error = _refusal(error)
            if self._error is error:
                raise
            raise self._error from None


# --------------------------------------------------------------------- tracing


class TracingBridge(TracingProcessor):
    """openai-agents' traces and spans mirrored as OpenTelemetry spans, through
    `statemachine.telemetry` (so nothing when telemetry is off): install it with
    ``agents.set_trace_processors([TracingBridge()])`` (instead of the SDK's exporter) or
    ``agents.add_trace_processor(TracingBridge())`` (beside it).

    A trace is a span named as the trace (``Agent workflow``), a child of the span
    current where it starts; each SDK span a child of its parent's mirror (else its
    trace's): ``invoke_agent {agent}``, ``execute_tool {tool}``, ``chat`` (a generation
    or a response), else the span data's type (``turn``, ``handoff``, ``guardrail``...).
    Each is the current OpenTelemetry span while its SDK span is open, in the context it
    started in, so what the ledger records inside the SDK's function span (its
    ``execute_tool`` span, the body's own spans) nests under it, in one trace. A trace
    the SDK resumes (a run resumed from its `RunState` in the process that started it)
    is not started again: its spans go on under the ended trace's span (the bridge keeps
    the last `KEPT_TRACES` ended ones). An SDK
    span that ended with an error ends failed, ``error.type`` ``_OTHER``: the SDK records
    an error's message, never its type, and messages, inputs and outputs are never
    attributes. The bridge never raises into the SDK: a failure is logged (its type)."""

    KEPT_TRACES = 256
    """How many ended traces a resumed trace's spans may still go under."""

    def __init__(self) -> None:
        self._traces: dict[str, telemetry.Mirrored] = {}
        self._ended: collections.OrderedDict[str, telemetry.Mirrored] = (
            collections.OrderedDict())
        self._spans: dict[str, telemetry.Mirrored] = {}

    def on_trace_start(self, trace: Trace) -> None:
        try:
            opened = telemetry.mirror(trace.name, {"openai_agents.trace_id": trace.trace_id})
            if opened is not None:
                self._traces[trace.trace_id] = opened
        except Exception as error:
            _bridge_failed("on_trace_start", error)

    def on_trace_end(self, trace: Trace) -> None:
        try:
            opened = self._traces.pop(trace.trace_id, None)
            if opened is not None:
                opened.end()
                self._ended[trace.trace_id] = opened
                while len(self._ended) > self.KEPT_TRACES:
                    self._ended.popitem(last=False)
        except Exception as error:
            _bridge_failed("on_trace_end", error)

    def on_span_start(self, span: SDKSpan[Any]) -> None:
        try:
            parent = self._spans.get(span.parent_id) if span.parent_id else None
            if parent is None:
                parent = self._traces.get(span.trace_id) or self._ended.get(span.trace_id)
            name, attributes = _mirrored_as(span.span_data)
            opened = telemetry.mirror(name, attributes, parent)
            if opened is not None:
                self._spans[span.span_id] = opened
        except Exception as error:
            _bridge_failed("on_span_start", error)

    def on_span_end(self, span: SDKSpan[Any]) -> None:
        try:
            opened = self._spans.pop(span.span_id, None)
            if opened is not None:
                opened.end("_OTHER" if span.error is not None else None)
        except Exception as error:
            _bridge_failed("on_span_end", error)

    def shutdown(self) -> None:
        """Nothing to flush: the tracer provider exports the spans."""

    def force_flush(self) -> None:
        """Nothing to flush: the tracer provider exports the spans."""


def _mirrored_as(data: Any) -> tuple[str, dict[str, Any]]:
    """The mirror's name and attributes for an SDK span's data: names, never payloads."""
    kind = str(data.type)
    attributes: dict[str, Any] = {"openai_agents.span_type": kind}
    if isinstance(data, AgentSpanData):
        attributes.update({"gen_ai.operation.name": "invoke_agent",
                           "gen_ai.agent.name": data.name})
        return f"invoke_agent {data.name}", attributes
    if isinstance(data, FunctionSpanData):
        attributes.update({"gen_ai.operation.name": "execute_tool",
                           "gen_ai.tool.name": data.name, "gen_ai.tool.type": "function"})
        return f"execute_tool {data.name}", attributes
    if isinstance(data, GenerationSpanData | ResponseSpanData):
        attributes["gen_ai.operation.name"] = "chat"
        model = getattr(data, "model", None)
        if isinstance(model, str):
            attributes["gen_ai.request.model"] = model
        return "chat", attributes
    return kind, attributes


def _bridge_failed(where: str, error: Exception) -> None:
    _log.warning("TracingBridge.%s failed (%s); the SDK's run goes on", where,
                 type(error).__name__)
