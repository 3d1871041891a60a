"""Pydantic AI (``pydantic-ai-slim``, import ``pydantic_ai``) with the control core
underneath: a pydantic-ai user keeps their `Agent` and ``agent.run`` and gets, with a
store and across process restarts, the guarantees of `RunController` (DESIGN §6.8).
Install with ``pip install 'agent-statemachine[pydantic-ai]'`` (tested on
pydantic-ai-slim 2.68.x).

Theory of operation
-------------------
pydantic-ai publishes its durability seam as *capabilities*: objects handed to an agent
(or to one run, ``agent.run(..., capabilities=[...])``) whose hooks wrap each model
request, each tool execution, and the resolution of deferred tool calls. `LedgerRun` is one
run bound to a `RunController`; its `LedgerCapability` goes into every ``agent.run`` it
makes and asks the controller first and reports after, like the reference runner
(`statemachine.runner.loop`):

=============================  ================================================================
pydantic-ai hook               what the capability records
=============================  ================================================================
``wrap_model_request``        publishes the messages the run added since the last write (a
                               staged publication: the tool results), then
                               ``begin_model_call`` (durable before the request), then
                               ``model_responded(calls)`` or ``model_failed``; a response
                               with tool calls is published before any of them runs; a
                               final answer is recorded once pydantic-ai's checks pass
``wrap_tool_execute``          ``begin_tool(call id)``: `Execute` → durable start, the body,
                               ``tool_completed`` (``tool_interrupted`` if it ends without a
                               result); `Resend` → the recorded result, the body never runs
                               again; a started, unfinished call → `ToolInDoubt`, never re-run
``handle_deferred_tool_calls``  approval-gated calls (``requires_approval=True``) are answered
                               from the ledger's decisions; an undecided one pauses the run
                               (its output is `DeferredToolRequests`)
``before_run``                 refuses a pydantic-ai run that `LedgerRun.run` did not start
=============================  ================================================================

The messages are the conversation. With a ``history`` (any Session of
`statemachine.sessions`: memory, SQLite, PostgreSQL, or `ConversationStoreHistory` over a
pydantic-ai `ConversationStore`) every message is written there exactly once, each write a
staged publication reconciled after a failure, and each attempt reads the run's messages
back from it, once. A history in the store's database is written by the run's next
flush, each write staged against what the attempt read followed by what it wrote since:
before that flush the history's tail is read again, and another writer's message found
there (a user's, another run's) refuses the write (`ReconcileRejected`), nothing the
attempt buffered recorded, as after a crash. A new run refuses a history whose last
items hold another run's call without its result (`PublicationUnsettled`). Without a
history the run keeps a private one for its own bookkeeping and the caller carries the
messages (``message_history=``), as with pydantic-ai alone; messages of
an earlier stop (saved before a crash, after which the run wrote more) are brought up to
what the run's publications hold, messages that are no stop of the run are refused
(`HistoryMismatch`), and so is a retry with none once the run has written some
(`HistoryRequired`: sent only its prompt, the model would ask for the same calls again).
pydantic-ai merges the consecutive requests of a history it is given (a paused turn's
results and the ones its resume adds are two): each attempt hands it the history in that
merged form (``repair_messages``, its own first step), so what was written is counted in
its terms.

Before pydantic-ai is called, an attempt on an existing run records ``claim`` (of two
processes that loaded the same version one goes on, the other gets `ConcurrencyConflict`
having done nothing), asks the verifiers given to `LedgerRun.open` about the calls of
their tools in doubt (`statemachine.verifiers`: recorded as ``verify:<tool>``), passes
the gate (``resume()``: `RunNotResumable`, `ToolInDoubt`), records the decisions it was
given (``deferred_tool_results=``), and settles an unsettled write. Decisions
(`LedgerRun.approve`, `LedgerRun.reject`, or ``deferred_tool_results``) and new input are
refused with `PublicationUnsettled` while a write is unsettled. An in-doubt call its
tool's verifier cannot settle leaves doubt only through the operator:
`LedgerRun.resolve_in_doubt` (or any process through the store) records the outcome the
operator established, and the next attempt goes on from it: a ``COMPLETED`` output is
handed to pydantic-ai as the tool's return value (a ``ToolReturnPart``), a ``FAILED`` one
as the tool's failure (``ToolFailed``: the failed tool result pydantic-ai sends), and
after ``NOT_EXECUTED`` the tool runs again, once. `LedgerRun.abandon` ends the run.

What a tool's result becomes: the ledger records what pydantic-ai writes to the history
for it, in pydantic-ai's own JSON form (bytes as base64, a pydantic model as its JSON, a
file or a ``ToolReturn`` as their JSON forms), after every other capability has rewritten
it (the ledger's capability is the outermost: a redacting hook's output is what is kept,
never the raw one); a resent result is rebuilt from that form, so the model is sent
exactly what it was sent the first time. A tool's answers are recorded as its result:
``ModelRetry`` and ``ToolFailed`` as themselves, and an ordinary exception raised by its
body as a failure the model is told of (``ToolFailed`` with the exception's type and
text) -- pydantic-ai raises that exception out of ``agent.run``, and the run's next
attempt tells the model, never running the body again. Only a body that ends without an
answer (cancelled, killed, timed out by the tool's ``timeout=``, or deferring itself with
``CallDeferred`` / ``ApprovalRequired``) leaves its call in doubt. A result the run's
log has no room for under ``max_bytes`` (or over ``max_result_bytes``, when set) is not
recorded: the call is recorded as failed, and the model told why. Before a response's
calls run, a run whose log has no room left for each of them to end in a recorded failure
is refused (`SchemaError`), none of them started: no call is ever left in doubt by the
log's limit.

A final output is recorded (``model_responded``, then ``accept_final_output``) only once
pydantic-ai's checks of it pass: its output validators and output tools. A refused one
ends the model call as failed, goes to the history with pydantic-ai's retry prompt, and
the model is asked again. A crash between the recorded answer and its acceptance is
finished by handing the recorded answer back to pydantic-ai in place of the model call
(no model call), so its checks run on it and pydantic-ai writes its messages; one they
refuse is never accepted (`RecordedOutputRefused`).

A completed run is not run again: an attempt with no prompt or the prompt it last ran
returns its recorded result (``recorded=True``), calling neither the model nor a tool;
another prompt is refused (`RunNotResumable`).

What it does not cover (refused, never silently unsafe): a pydantic-ai run that
`LedgerRun` did not start (``agent.run_stream``, ``agent.iter``,
``agent.run_stream_events``, or ``agent.run`` handed the capability) is refused when it
starts (`UnsupportedRun`); history processors (``ProcessHistory``), which rewrite
messages already written, are refused when the run is opened or given them
(`UnsupportedCapability`); a history that is not the run's is refused when the run is
opened (`HistoryMismatch`); external tools (an ``ExternalToolset`` the agent has, at
open, or given to `LedgerRun.run`; a tool of kind ``external`` offered to the model,
before the model is called; ``DeferredToolResults.calls``) and approvals that change a
call's arguments (``ToolApproved(override_args=...)``: an approval binds the recorded
arguments) are refused (`UnsupportedDeferral`); pydantic-ai's own lifecycle hooks are
capabilities and are not recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import types
import typing
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import attrs

from statemachine.adapters import missing_extra

try:
    import pydantic
    from pydantic_ai import (
        Agent,
        DeferredToolRequests,
        DeferredToolResults,
        ToolApproved,
        ToolDenied,
        ToolReturn,
    )
    from pydantic_ai.capabilities import AbstractCapability, CapabilityOrdering, ProcessHistory
    from pydantic_ai.conversation import Conversation
    from pydantic_ai.conversation_store import ConversationStore
    from pydantic_ai.exceptions import (
        ApprovalRequired,
        CallDeferred,
        ModelRetry,
        ToolFailed,
        ToolFailedError,
        ToolRetryError,
    )
    from pydantic_ai.messages import (
        ModelMessage,
        ModelMessagesTypeAdapter,
        ModelRequest,
        ModelResponse,
        TextPart,
        ToolCallPart,
        ToolReturnPart,
        UserPromptPart,
        repair_messages,
        tool_return_ta,
    )
    from pydantic_ai.output import NativeOutput, PromptedOutput, TextOutput, ToolOutput
    from pydantic_ai.run import AgentRunResult
    from pydantic_ai.toolsets import (
        AbstractToolset,
        ExternalToolset,
        FunctionToolset,
        WrapperToolset,
    )
except ModuleNotFoundError as error:  # pragma: no cover - the extra is installed in CI
    raise missing_extra(__name__, "pydantic-ai", error) from error

from statemachine import events as ev
from statemachine.adapters._calls import (
    HistoryMismatch,
    InvalidVerifier,
    UnsupportedFeature,
    Walk,
    abandoning,
    begin_call,
    checked_verifiers,
    decide_async,
    error_text,
    lossless,
    naming_take_over,
    plain,
    recorded_output,
    resolution,
    resolving,
    same_history,
    settle_unsettled,
    stored_run,
)
from statemachine.controller import RunController
from statemachine.errors import (
    ConcurrencyConflict,
    ControlError,
    InvalidTransition,
    PublicationUnsettled,
    ReconcileRejected,
    RunNotFound,
    SchemaError,
    ToolInDoubt,
    excerpt,
)
from statemachine.journal import is_async
from statemachine.payloads import DEFAULT_MAX_BYTES, JSON, canonical_json, json_size
from statemachine.runner.attempt import Attempt, interrupted
from statemachine.runner.publish import TAIL_ITEMS, one_writer, publish, run_history
from statemachine.sessions import MemorySession, Session
from statemachine.stores import AsyncEventStore, EventStore, checks_session_tail
from statemachine.values import Phase, RecoveryPolicy, Resolution, Step, ToolCall
from statemachine.verifiers import Verifier, running_call

__all__ = [
    "ConversationStoreHistory",
    "HistoryMismatch",
    "HistoryRequired",
    "InvalidVerifier",
    "LedgerCapability",
    "LedgerRun",
    "LedgerRunResult",
    "RecordedOutputRefused",
    "UnsupportedCapability",
    "UnsupportedDeferral",
    "UnsupportedRun",
]

_MID_TURN = frozenset({Step.INTERRUPTION, Step.TOOLS, Step.FINALIZING, Step.FINAL_OUTPUT})
"""Steps inside one turn: only the run's messages lead pydantic-ai back into them."""
ROOM_KEPT = 16 * 1024
"""Bytes of the log kept beside the tool results a turn records: the messages around them
in the write that publishes them, and the room the core keeps for settling the run."""
MAX_FAILURE_BYTES = 2048
"""The most bytes (as JSON) of a recorded failure's text: what a failed call's record
and its publication may take is known before its body runs."""
FAILURE_ROOM = 2 * MAX_FAILURE_BYTES + 1024
"""The room one call's failure takes in the log: its record, and its part in the write
that publishes it."""


class HistoryRequired(ControlError):
    """The run has no ``history`` and the caller passed no ``message_history``, where the
    run needs messages to go on from: it stopped inside a turn, or it has written
    messages (the error names their calls), which the model would otherwise not see, and
    would ask for the same effects again. Refused before anything is recorded. Pass the
    messages the run had at its last stop (``result.messages``), or abandon the run."""


class UnsupportedDeferral(ControlError, ValueError):
    """A deferral the ledger cannot make safe: an external tool's result, or an approval
    that changes the call's arguments. Nothing was recorded."""


class RecordedOutputRefused(ControlError):
    """A final output the ledger recorded before its checks ran (a run recorded by an
    earlier version of this adapter) was refused by the agent's output checks when it was
    handed back to them after a crash. A recorded response cannot be taken back, and the
    model is not asked again from it: nothing was accepted; abandon the run."""


class UnsupportedRun(ControlError):
    """A pydantic-ai run that `LedgerRun` did not start was handed the run's capability
    (``agent.run_stream``, ``agent.iter``, ``agent.run_stream_events``, or ``agent.run``
    with ``capabilities=[run.capability]``): it would run tools with no one to write the
    messages or accept the answer. Refused when that run starts, before the model or a
    tool is called; drive the run with `LedgerRun.run`."""


class UnsupportedCapability(ControlError, ValueError):
    """A capability the ledger cannot carry: a history processor (``ProcessHistory``)
    rewrites messages the run has already written. Refused when the run is opened (the
    agent's) or given it (``capabilities=``), before anything is recorded."""


# ------------------------------------------------------------------ plain JSON forms


def _finite(value: Any, walk: Walk | None) -> JSON:
    """The `plain` fallback for pydantic's JSON form (whose values are plain but for
    these): a non-finite float (JSON has none) and a value nested too deep to walk as
    their text; an int too long to print as it is, for the controller to refuse."""
    return value if walk is not None and type(value) is int else str(value)


def _sent(value: Any) -> JSON:
    """``value`` as plain JSON, as pydantic-ai serializes what it sends the model
    (``tool_return_ta``: bytes as base64; what it cannot serialize as its text), then
    `_finite`."""
    return plain(tool_return_ta.dump_python(value, mode="json", by_alias=True, fallback=str),
                 fallback=_finite)


def _messages_json(messages: Sequence[ModelMessage]) -> list[JSON]:
    dumped = ModelMessagesTypeAdapter.dump_python(list(messages), mode="json")
    return [plain(item, fallback=_finite) for item in dumped]


def _messages(items: Sequence[JSON]) -> list[ModelMessage]:
    return ModelMessagesTypeAdapter.validate_python(list(items))


def _arguments(call: ToolCallPart) -> JSON:
    return _sent(call.args_as_dict())


# ------------------------------------------------------------- a tool's recorded result

_FAILED = "tool-failed"
_RETRY = "model-retry"
_RETURN = "tool-return"
_ANSWERS = {_FAILED: ToolFailed, _RETRY: ModelRetry}
"""The recorded forms of a tool's answers (pydantic-ai's own serialized forms of
``ToolFailed`` and ``ModelRetry``): ``{"kind": ..., "message": ...}``."""
_TOOL_RETURN = pydantic.TypeAdapter(ToolReturn)


def _result_form(value: Any) -> JSON:
    """What the history keeps of a tool's result: pydantic-ai's JSON form of the content
    of the part that carries it, or of the `ToolReturn` it is. A result whose form would
    read back as an answer or a `ToolReturn` is recorded inside a `ToolReturn`, so it
    reads back as itself. Raises what pydantic-ai's serializer raises."""
    if isinstance(value, ToolReturn):
        form = tool_return_ta.dump_python(value, mode="json", by_alias=True)
    else:
        request = ModelRequest(parts=[ToolReturnPart("", value, tool_call_id="")])
        form = ModelMessagesTypeAdapter.dump_python([request], mode="json")[0]["parts"][0][
            "content"]
        if isinstance(form, dict) and form.get("kind") in (_FAILED, _RETRY, _RETURN):
            return _result_form(ToolReturn(return_value=value))
    return plain(form, fallback=_finite)


def _answer(kind: str, message: str) -> JSON:
    return {"kind": kind, "message": message}


def _bounded(text: str) -> str:
    """``text`` cut to at most `MAX_FAILURE_BYTES` as JSON."""
    while json_size(text) > MAX_FAILURE_BYTES:
        text = text[: len(text) * 3 // 4]
    return text


def _rebuilt(form: JSON) -> Any:
    """A recorded result handed back to pydantic-ai (the body does not run again): what
    pydantic-ai reads back from the history for it, so the model is sent what it was
    sent the first time; a recorded answer is raised again."""
    if isinstance(form, dict):
        kind, message = form.get("kind"), form.get("message")
        if kind in _ANSWERS and isinstance(message, str) and len(form) == 2:
            raise _ANSWERS[kind](message)
        if kind == _RETURN:
            return _TOOL_RETURN.validate_python(form)
    part = {"part_kind": "tool-return", "tool_name": "", "tool_call_id": "", "content": form}
    (request,) = ModelMessagesTypeAdapter.validate_python([{"kind": "request",
                                                            "parts": [part]}])
    (returned,) = request.parts
    assert isinstance(returned, ToolReturnPart)
    return returned.content


# ------------------------------------------------------------------------ results


@attrs.frozen
class LedgerRunResult:
    """Where an attempt stopped.

    ``step`` is ``COMPLETED`` (``output`` holds the output: pydantic-ai's object when it
    produced it in this attempt, its recorded JSON form when the run settled from the
    ledger) or ``INTERRUPTION`` (``pending`` names the ledger's calls awaiting a decision,
    ``requests`` the `DeferredToolRequests` pydantic-ai paused with, when it ran).
    ``messages`` are the run's messages (what to pass back as ``message_history`` for a
    run without a ``history``); ``sdk_result`` is pydantic-ai's own result of this
    attempt (None when pydantic-ai was not called). ``recorded`` is True when the run had
    completed before this attempt: ``output`` is its recorded result, and neither the
    model nor a tool was called (a prompt given was not sent)."""

    output: Any
    step: Step
    pending: tuple[ToolCall, ...]
    requests: DeferredToolRequests | None
    messages: tuple[ModelMessage, ...]
    sdk_result: AgentRunResult[Any] | None
    recorded: bool = False


# ------------------------------------------------------------------ the histories


class _PrivateHistory(MemorySession):
    """The history of a run without a Session: its publications land here."""

    def __init__(self) -> None:
        super().__init__("")
        self.session_id = None  # type: ignore[assignment]


class ConversationStoreHistory:
    """A pydantic-ai `ConversationStore` conversation as a run's ``history``.

    Items are the conversation's messages in pydantic-ai's JSON form. ``add_items`` loads
    the stored conversation and saves it extended by the batch; the store's revision check
    makes a concurrent writer's save fail (`ConversationConflict`) instead of landing
    twice, and the run reconciles against what the store holds. ``pop_item`` and
    ``clear_session`` are refused (the store keeps every message: branch it instead)."""

    def __init__(self, store: ConversationStore, conversation_id: str, *,
                 scope: str | None = None) -> None:
        self.store = store
        self.session_id = conversation_id
        self.scope = scope

    async def get_items(self, limit: int | None = None) -> list[JSON]:
        if limit is not None and limit <= 0:
            return []
        conversation = await self.store.load(self.session_id, limit=limit, scope=self.scope)
        return [] if conversation is None else _messages_json(conversation.messages)

    async def add_items(self, items: list[JSON]) -> None:
        stored = await self.store.load(self.session_id, scope=self.scope)
        if stored is None:
            stored = Conversation(conversation_id=self.session_id)
        stored.messages = [*stored.messages, *_messages(items)]
        await self.store.save(stored, scope=self.scope)

    async def pop_item(self) -> JSON | None:
        raise NotImplementedError("a conversation store keeps every message: branch it")

    async def clear_session(self) -> None:
        raise NotImplementedError("a conversation store keeps every message: branch it")


# ----------------------------------------------------------------- the capability


@dataclass
class _CheckedToolset(WrapperToolset[Any]):
    """The run's toolset, its tools listed only once what it holds is known to be
    carried: a dynamic toolset (``@agent.toolset``) is only made when the run lists its
    tools, and one that returns an MCP toolset is refused then (`UnsupportedFeature`),
    before the model sees its tools or any of them runs."""

    run_id: str = ""

    async def get_tools(self, ctx: Any) -> dict[str, Any]:
        tools = await super().get_tools(ctx)
        _refuse_external_toolsets([self.wrapped], self.run_id, listing=True)
        return tools


@dataclass
class LedgerCapability(AbstractCapability[Any]):
    """The capability `LedgerRun` hands to every ``agent.run`` it makes: model requests,
    tool executions and deferred approvals go through the run's ledger."""

    run: LedgerRun

    def get_ordering(self) -> CapabilityOrdering:
        # the outermost layer: a tool's result is recorded after every other capability
        # rewrote it (what the model is sent), a response as pydantic-ai acts on it
        return CapabilityOrdering(position="outermost")

    async def before_run(self, ctx: Any) -> None:
        if not self.run._driving:
            c = self.run.controller
            raise UnsupportedRun(
                "this pydantic-ai run was not started by LedgerRun.run (agent.run_stream, "
                "agent.iter, agent.run_stream_events and agent.run handed the capability "
                "are not supported: nothing would write the run's messages or accept its "
                "answer); drive the run with LedgerRun.run", run_id=c.run_id, step=c.step,
                action="run")

    def get_wrapper_toolset(self, toolset: AbstractToolset[Any]) -> AbstractToolset[Any]:
        return _CheckedToolset(toolset, run_id=self.run.controller.run_id)

    async def wrap_model_request(self, ctx: Any, *, request_context: Any,
                                 handler: Any) -> ModelResponse:
        run = self.run
        replayed = run._replayed()
        if replayed is not None:  # the recorded response, back through its checks
            return replayed
        _refuse_external(run.controller, request_context.model_request_parameters
                         .function_tools, "model_request")  # before the model is paid
        await run._before_model_call(list(ctx.messages))
        try:
            response: ModelResponse = await handler(request_context)
        except BaseException as error:
            run._model_failed(error)
            raise
        try:
            await run._model_responded(response, ctx)
        except ControlError as refused:
            # refused before anything was recorded of the response: the call ends in a
            # recorded failure, never left open to be paid again by the same attempt
            run._model_failed(refused)
            raise
        return response

    async def wrap_tool_execute(self, ctx: Any, *, call: ToolCallPart, tool_def: Any,
                                args: Any, handler: Any) -> Any:
        return await self.run._execute(call, args, handler)

    async def handle_deferred_tool_calls(self, ctx: Any, *,
                                         requests: DeferredToolRequests
                                         ) -> DeferredToolResults | None:
        return self.run._ledger_decisions([call.tool_call_id for call in requests.approvals])


# ----------------------------------------------------------------------- the run


class LedgerRun:
    """One run of a pydantic-ai `Agent`, bound to a `RunController`.

    Open it with `LedgerRun.open` (loads the run from ``store`` when it exists, else
    starts it), drive it with `run`, decide with `approve` / `reject` (or pass
    ``deferred_tool_results`` to `run`), repair with `settle` and `resolve_in_doubt`.
    Every public call may raise the controller's refusals: `RunNotResumable`,
    `ToolInDoubt`, `PublicationUnsettled`, `ReconcileRejected`, `ConcurrencyConflict`,
    `InvalidTransition`, `SchemaError`, and `HistoryRequired`, `HistoryMismatch`,
    `UnsupportedDeferral`, `UnsupportedCapability`, `UnsupportedRun`."""

    def __init__(self, agent: Agent[Any, Any], controller: RunController,
                 history: Session | None, *, existing: bool, owner: str | None,
                 take_over: bool, idempotent: Collection[str],
                 max_bytes: int = DEFAULT_MAX_BYTES,
                 max_result_bytes: int | None = None,
                 verifiers: Mapping[str, Verifier] | None = None) -> None:
        checked = checked_verifiers(verifiers, _function_tools(agent.toolsets),
                                    idempotent=idempotent, run_id=controller.run_id)
        self.agent = agent
        self.controller = controller
        self.take_over = take_over
        """True only when no earlier write of this run can still land (its writer is
        gone): an unsettled write is then written again if nothing of it landed."""
        self.history = history
        self.max_bytes = max_bytes
        """The bound on the run's log the controller was loaded with (`RunController`)."""
        self.max_result_bytes = max_result_bytes
        """The most bytes (as JSON) one tool result may take (None: what the log has room
        for): a bigger one is recorded as a failure the model is told of."""
        self._history: Session = history if history is not None else _PrivateHistory()
        self._idempotent = frozenset(idempotent)
        self._published = 0
        """How many of the messages pydantic-ai holds in this attempt are written."""
        self._known: list[JSON] | None = None
        """The history as the run sees it (`run_history`), read once in this attempt and
        followed by what the attempt published since (`publish`'s ``known``): None
        without a history, or before it was read."""
        self._driving = False
        """True while `run` drives pydantic-ai: the capability refuses any other run."""
        self._running = False
        """True while a `run` of this object is under way: a second one is refused."""
        self._candidate: JSON | None = None
        """The recorded form of the model's last response while pydantic-ai checks it as
        the final output (validators, output tools): recorded only once they pass."""
        self._replay: ModelResponse | None = None
        """A recorded final response to hand back to pydantic-ai instead of calling the
        model (a crash came before its acceptance was written)."""
        self._replays = 0
        self._flush_lock = asyncio.Lock()
        self._attempt = Attempt(controller, resumes=existing, owner=owner, flush=self._flush,
                                verifiers=checked)
        self.capability = LedgerCapability(self)

    @classmethod
    async def open(cls, agent: Agent[Any, Any], *, run_id: str,
                   history: Session | None = None,
                   store: EventStore | AsyncEventStore | None = None,
                   policy: RecoveryPolicy = RecoveryPolicy.RECONCILE,
                   owner: str | None = None, take_over: bool = False,
                   idempotent: Collection[str] = (), buffered: bool = True,
                   max_bytes: int = DEFAULT_MAX_BYTES,
                   max_result_bytes: int | None = None,
                   verifiers: Mapping[str, Verifier] | None = None) -> LedgerRun:
        """The run ``run_id``: loaded from ``store`` when the store holds it (another
        process may have started it), else started (bound to ``store``, writing its
        messages to ``history``, under ``policy``). ``idempotent`` names the tools that may
        run again after a crash inside them; every other tool's unfinished call is in
        doubt. ``owner`` is recorded by every claim. ``take_over=True`` only when no
        earlier write of this run can still land (its writer is gone): after a process
        died inside a write, the restart that knows it is dead passes it.
        ``max_bytes`` bounds the run's log (`RunController.start`); ``max_result_bytes``
        bounds one tool result (by default, what the log has room for). ``verifiers``
        (by tool name: ``verify(context) -> Completed(output) | NotExecuted() |
        Unknown()``, sync or async, `statemachine.verifiers`) are asked, on each attempt
        right after its claim, what happened to a call of their tool left in doubt;
        inside a tool's body `statemachine.tool_context()` gives its call's idempotency
        key.

        Refused before anything is recorded: a run the store holds opened with a history
        that is not its own (`HistoryMismatch`), an agent with a history processor
        (`UnsupportedCapability`), an agent with external tools (`UnsupportedDeferral`,
        naming them), an agent whose output type holds output functions
        (`UnsupportedFeature`, naming them), and a verifier naming no function tool of
        the agent, or not callable (`InvalidVerifier`)."""
        _refuse_rewriters(agent.root_capability, run_id)
        _refuse_external_toolsets(agent.toolsets, run_id)
        _refuse_output_functions(agent.output_type, run_id, "open")
        checked_verifiers(verifiers, _function_tools(agent.toolsets), idempotent=idempotent,
                          run_id=run_id)
        controller: RunController | None = None
        if store is not None:
            with contextlib.suppress(RunNotFound):
                if is_async(store):
                    # (not isinstance(store, AsyncEventStore): a runtime protocol checks
                    # names only, and a sync store has the same names)
                    controller = await RunController.load_async(store, run_id,
                                                                buffered=buffered,
                                                                max_bytes=max_bytes)
                else:
                    controller = stored_run(cast("EventStore", store), run_id,
                                            buffered=buffered, max_bytes=max_bytes)
        existing = controller is not None
        if controller is None:
            controller = RunController.start(
                run_id=run_id, session_id=None if history is None else history.session_id,
                policy=policy, store=store, buffered=buffered,  # type: ignore[arg-type]
                max_bytes=max_bytes)
        else:
            same_history(controller, history, "passing message_history to run()")
        return cls(agent, controller, history, existing=existing, owner=owner,
                   take_over=take_over, idempotent=idempotent, max_bytes=max_bytes,
                   max_result_bytes=max_result_bytes, verifiers=verifiers)

    @property
    def owner(self) -> str | None:
        """Who claims the run: recorded by every claim (``RunClaimed(owner)``)."""
        return self._attempt.owner

    # ---------------------------------------------------------------- decisions

    async def approve(self, call_id: str) -> None:
        """Approve a call awaiting a decision; durable before this returns.
        `PublicationUnsettled` while a write is unsettled; `InvalidTransition` for a call
        not awaiting a decision."""
        self.controller.approve(call_id)
        await self._flush()

    async def reject(self, call_id: str, message: str = "The tool call was denied.") -> None:
        """Reject a call awaiting a decision; ``message`` is what the model is told.
        Refused like `approve`."""
        self.controller.reject(call_id, message)
        await self._flush()

    async def resolve_in_doubt(self, call_id: str, output: Any = None, *,
                               outcome: Resolution = Resolution.COMPLETED,
                               by: str | None = None, evidence: str | None = None) -> None:
        """The operator's way out of `ToolInDoubt` (`RunController.resolve_in_doubt`),
        for a call that started and never reported (established outside the run: did the
        charge go through?). ``COMPLETED``: ``output`` is handed to pydantic-ai as the
        tool's return value (a ``ToolReturnPart``), the tool never runs again; ``FAILED``:
        ``output`` is the error text the model is told (``ToolFailed``, as for a tool that
        failed); ``NOT_EXECUTED`` (no output): the next attempt runs the tool, once.
        ``output`` is recorded in pydantic-ai's JSON form of it. Claims the run first as
        ``by`` (else this run's owner), durable before it returns; a refusal
        (`InvalidTransition` for a call not in doubt, `SchemaError`,
        `ConcurrencyConflict`) records nothing."""
        c = self.controller
        await decide_async(c, by if by is not None else self.owner,
                           resolving(c, call_id, _sent(output), outcome=outcome, by=by,
                                     evidence=evidence), flush=self._flush)

    async def abandon(self, reason: str, *, by: str | None = None) -> None:
        """End the run for good (`RunController.abandon`), claimed first like
        `resolve_in_doubt`: every later `run` is refused (`RunNotResumable`)."""
        c = self.controller
        await decide_async(c, by if by is not None else self.owner,
                           abandoning(reason, by=by), flush=self._flush)

    def _record_decisions(self, results: DeferredToolResults) -> None:
        """Record ``deferred_tool_results``' approvals as the ledger's decisions, all or
        nothing: each is checked before the first is recorded."""
        c = self.controller
        if results.calls:
            raise UnsupportedDeferral(
                "external tool results (DeferredToolResults.calls) are not supported: the "
                "ledger cannot tell whether they ran", run_id=c.run_id, step=c.step,
                action="approve")
        decisions: list[tuple[str, str | None]] = []
        for call_id, answer in results.approvals.items():
            if isinstance(answer, ToolApproved) and answer.override_args is not None:
                raise UnsupportedDeferral(
                    f"the approval of call {call_id!r} changes its arguments; an approval "
                    "binds the recorded ones", run_id=c.run_id, step=c.step,
                    action="approve")
            if answer is True or isinstance(answer, ToolApproved):
                decisions.append((call_id, None))
            elif answer is False or isinstance(answer, ToolDenied):
                denial = answer.message if isinstance(answer, ToolDenied) else (
                    "The tool call was denied.")
                decisions.append((call_id, denial))
            else:
                raise UnsupportedDeferral(
                    f"the answer to call {call_id!r} is neither an approval nor a denial",
                    run_id=c.run_id, step=c.step, action="approve")
        if decisions and c.step is Step.UNSETTLED:
            raise PublicationUnsettled(
                "a write of this run is unsettled: settle it before deciding",
                run_id=c.run_id, step=c.step, action="approve")
        views = {call_id: c.call(call_id)  # InvalidTransition for a call never proposed
                 for call_id, _ in decisions}
        for call_id, message in decisions:
            view = views[call_id]
            recorded = (Phase.APPROVED if message is None else Phase.REJECTED)
            if view.phase is recorded and view.starts == 0:
                continue  # the same decision, given again
            if message is None:
                c.approve(call_id)
            else:
                c.reject(call_id, message)

    def _ledger_decisions(self, call_ids: Sequence[str]) -> DeferredToolResults | None:
        """The ledger's decisions for ``call_ids`` (undecided calls are left out)."""
        c = self.controller
        approvals: dict[str, bool | ToolApproved | ToolDenied] = {}
        for call_id in call_ids:
            phase = c.phase(call_id)
            if phase is None or phase in (Phase.AWAITING, Phase.SKIPPED):
                continue
            view = c.call(call_id)
            if phase is Phase.REJECTED or (phase is Phase.PUBLISHED and view.starts == 0):
                result = view.result
                approvals[call_id] = ToolDenied(result if isinstance(result, str)
                                                else "The tool call was denied.")
            else:
                approvals[call_id] = ToolApproved()
        return DeferredToolResults(approvals=approvals) if approvals else None

    # ------------------------------------------------------------------ running

    async def run(self, user_prompt: str | None = None, *,
                  message_history: Sequence[ModelMessage] | None = None,
                  deferred_tool_results: DeferredToolResults | None = None,
                  **options: Any) -> LedgerRunResult:
        """One attempt: claim (an existing run), gate, record the decisions given, settle,
        then ``agent.run`` to the next stop (``options`` go to ``agent.run``). With a
        ``history`` the run's messages are read from it (``message_history`` must be
        omitted); without one, pass the messages of the run's last stop to resume it.
        A completed run answers a repeat of its last prompt (or none) with its recorded
        result (``recorded=True``), calling neither the model nor a tool; another prompt is
        refused (`RunNotResumable`). ``toolsets`` holding external tools are refused
        (`UnsupportedDeferral`) before anything is recorded. The original error of a
        failed write propagates (I6). A second `run` of this object while one is under
        way is refused (`ConcurrencyConflict`) before anything is done: the two would
        share this object's controller and its view of the history."""
        c = self.controller
        if self._running:
            raise ConcurrencyConflict(
                "a run of this LedgerRun is already under way (this object drives one "
                "attempt at a time; a second process opens the run with LedgerRun.open "
                "and its claim decides); nothing was done", run_id=c.run_id, step=c.step,
                action="run")
        self._running = True
        try:
            return await self._run(user_prompt, message_history, deferred_tool_results,
                                   options)
        finally:
            self._running = False

    async def _run(self, user_prompt: str | None,
                   message_history: Sequence[ModelMessage] | None,
                   deferred_tool_results: DeferredToolResults | None,
                   options: dict[str, Any]) -> LedgerRunResult:
        """`run`, the one attempt of this object under way."""
        c = self.controller
        self._known = None  # (read afresh by each call: another run may have written)
        if self.history is not None and message_history is not None:
            raise ValueError("this run reads its messages from its history: omit "
                             "message_history")
        for capability in options.get("capabilities") or ():
            _refuse_rewriters(capability, c.run_id)
        _refuse_external_toolsets(options.get("toolsets") or (), c.run_id)
        _refuse_output_functions(options.get("output_type"), c.run_id, "run")
        if self.history is None:
            _carried(c, list(message_history or ()))  # HistoryMismatch before any record
        if c.step is Step.COMPLETED and deferred_tool_results is None:
            # a request retried after it completed: its recorded answer, nothing re-run;
            # other input is refused (RunNotResumable): a completed run takes none
            new = [] if user_prompt is None else [_prompt_form(user_prompt)]
            recorded_output(c, new, last_input=_last_prompt(c))
            return self._result(None, await self._messages(message_history), None,
                                recorded=True)
        async with self._attempt as resumes:
            return await self._run_attempt(user_prompt, message_history,
                                           deferred_tool_results, new_run=not resumes,
                                           options=options)

    async def _run_attempt(self, user_prompt: str | None,
                           message_history: Sequence[ModelMessage] | None,
                           deferred_tool_results: DeferredToolResults | None, *,
                           new_run: bool, options: dict[str, Any]) -> LedgerRunResult:
        """The work of `run`'s attempt, once the run is claimed."""
        c = self.controller
        self._candidate, self._replay, self._replays = None, None, 0
        c.resume()  # the gate: RunNotResumable or ToolInDoubt before any work
        if user_prompt is not None and c.step is Step.UNSETTLED:
            raise PublicationUnsettled(
                "a write of this run is unsettled: settle it before giving new input",
                run_id=c.run_id, step=c.step, action="add_input")
        if deferred_tool_results is not None:
            self._record_decisions(deferred_tool_results)  # refused while unsettled
            await self._flush()  # decisions are durable before anything acts on them
        if new_run:  # (nothing to settle: the history read here is read once)
            read = None if self.history is None else await self._read_history()
            await one_writer(c, self._history, read=read)
            if read is not None:
                _refuse_unanswered(c, read[-TAIL_ITEMS:])
        unsettled = c.step is Step.UNSETTLED
        await settle_unsettled(c, self._history, take_over=self.take_over, how=_TAKE_OVER)
        if unsettled:  # what settling recorded (a new run's start waits for an effect)
            await self._flush()
        messages = await self._messages(message_history)
        if c.step in (Step.TOOLS, Step.INTERRUPTION):
            messages = await self._write_proposals(messages)
        if c.step is Step.COMPLETED:  # the settled batch published the final output
            return self._result(None, messages, None)
        if c.step is Step.INTERRUPTION and c.pending_approvals:
            if user_prompt is None and not self._has_decided():
                return self._result(None, messages, None)  # still waiting: nothing to do
            # pydantic-ai resumes a paused turn only with an answer for every call it
            # deferred; refused before the ledger leaves INTERRUPTION, so the remaining
            # decisions can still be taken
            raise InvalidTransition(
                f"{len(c.pending_approvals)} call(s) still await a decision: decide every "
                "one before resuming the run", run_id=c.run_id, step=c.step, action="run")
        c.resume()  # an interruption whose approved calls may run enters TOOLS
        if c.step in _MID_TURN and not messages:
            raise HistoryRequired(
                "the run stopped inside a turn and no messages lead back into it: pass "
                "message_history (the messages of its last stop), or abandon the run",
                run_id=c.run_id, step=c.step, action="run")
        runnable = len(c.runnable_call_ids())
        if runnable:
            self._room_for(runnable)  # before any of them runs
        # pydantic-ai's own first step on a history (consecutive requests merged, as a
        # paused turn's results and its resumed ones are): done here, so the messages it
        # holds begin with exactly these, and what is written is counted in its terms
        sent = repair_messages(messages, repair_last_response=False)
        self._published = len(sent)
        deferred = None
        if sent and isinstance(sent[-1], ModelRequest):
            # a paused turn: pydantic-ai reads the decisions from deferred_tool_results
            deferred = self._ledger_decisions(_unanswered(sent))
        if c.step in (Step.FINALIZING, Step.FINAL_OUTPUT):
            # the model's final answer was recorded and the process stopped before its
            # acceptance was written: pydantic-ai is handed the recorded response instead
            # of calling the model, so its output checks (validators, output tools) run on
            # it and it writes its own messages for it
            self._replay = _recorded_response(c.model_output)
        capabilities = [*(options.pop("capabilities", None) or ()), self.capability]
        self._driving = True
        try:
            result = await self.agent.run(user_prompt, message_history=sent,
                                          deferred_tool_results=deferred,
                                          capabilities=capabilities, **options)
        finally:
            self._driving = False
        return await self._epilogue(result)

    async def settle(self, *, take_over: bool | None = None) -> None:
        """Settle an unsettled write now (claiming the run first), without calling
        pydantic-ai. `ReconcileRejected` when the history cannot be matched (nothing
        recorded; repair it and call again). ``take_over`` (default: the run's) as for
        `open`."""
        take_over = self.take_over if take_over is None else take_over
        try:
            await self._attempt.settle(self._history, take_over=take_over)
        except ReconcileRejected as refused:
            told = naming_take_over(refused, _TAKE_OVER)
            if told is refused:
                raise
            raise told from None

    async def _messages(self, given: Sequence[ModelMessage] | None) -> list[ModelMessage]:
        """The run's messages: read from its history, else the ones the caller gave
        (`_carried`: brought up to what the run wrote since they were saved)."""
        if self.history is not None:
            known = self._known
            return _messages(known if known is not None else await self._read_history())
        return _carried(self.controller, list(given or ()))

    async def _read_history(self) -> list[JSON]:
        """The history as the run sees it (with what rides to the run's next flush),
        kept as `_known` for the attempt's publications."""
        known = self._known = await run_history(self.controller, self._history)
        return known

    async def _write_proposals(self, messages: list[ModelMessage]) -> list[ModelMessage]:
        """``messages`` with the calls the ledger holds and they lack: the model's response
        proposing them was recorded and the process stopped before it was written (a
        store appending per event). Written now, rebuilt from the ledger (its tool calls,
        in order; any text beside them is lost), before anything acts on them."""
        c = self.controller
        known = {part.tool_call_id for message in messages
                 if isinstance(message, ModelResponse) for part in message.parts
                 if isinstance(part, ToolCallPart)}
        # the turn's calls are the unpublished ones; the messages must lead up to them
        # (every earlier call there) and hold none of them
        missing = [view.call for view in c.calls if view.phase is not Phase.PUBLISHED]
        earlier = [view.call.call_id for view in c.calls if view.phase is Phase.PUBLISHED]
        if (not messages or not missing or any(call.call_id in known for call in missing)
                or not known.issuperset(earlier)):
            return messages
        response = ModelResponse(parts=[ToolCallPart(call.name, call.arguments,
                                                     tool_call_id=call.call_id)
                                        for call in missing])
        self._published = len(messages)
        await self._publish([response])
        return [*messages, response]

    def _has_decided(self) -> bool:
        c = self.controller
        return any(view.phase in (Phase.APPROVED, Phase.REJECTED) for view in c.calls)

    async def _epilogue(self, result: AgentRunResult[Any]) -> LedgerRunResult:
        c = self.controller
        messages = result.all_messages()
        output = result.output
        if isinstance(output, DeferredToolRequests):
            if output.calls:
                raise UnsupportedDeferral(
                    "the run paused for external tool calls, which are not supported",
                    run_id=c.run_id, step=c.step, action="run")
        elif c.step is Step.AWAITING_MODEL and self._candidate is not None:
            # the final output passed pydantic-ai's checks: the response, then its
            # acceptance
            c.model_responded((), output=self._candidate)
        if not isinstance(output, DeferredToolRequests) and c.step in (Step.FINALIZING,
                                                                       Step.TOOLS):
            sent = _sent(output)
            c.accept_final_output(sent, lossless=lossless(output, sent))
        await self._publish(messages[self._published:])
        if c.step is Step.FINAL_OUTPUT and c.session_id is None:
            c.complete()
        await self._flush()
        expected = (Step.INTERRUPTION if isinstance(output, DeferredToolRequests)
                    else Step.COMPLETED)
        if c.step is not expected:
            raise InvalidTransition(
                f"pydantic-ai ended its run expecting step {expected.value}, but the ledger "
                f"is at {c.step.value}", run_id=c.run_id, step=c.step, action="run")
        requests = output if isinstance(output, DeferredToolRequests) else None
        return self._result(result, messages, requests)

    def _result(self, result: AgentRunResult[Any] | None, messages: Sequence[ModelMessage],
                requests: DeferredToolRequests | None, *,
                recorded: bool = False) -> LedgerRunResult:
        c = self.controller
        pending = tuple(c.call(call_id).call for call_id in c.pending_approvals)
        output: Any = None
        if c.step is Step.COMPLETED:
            output = result.output if result is not None else c.final_output
        return LedgerRunResult(output, c.step, pending, requests, tuple(messages), result,
                               recorded)

    # ------------------------------------------------------ what the hooks record

    async def _flush(self) -> None:
        """Make what the controller buffered durable (a no-op for a run that appends per
        command). pydantic-ai runs a response's tools concurrently, and each flushes
        before its body: one flush at a time."""
        async with self._flush_lock:
            await self._unmoved()
            await self.controller.flush_async()

    async def _unmoved(self) -> None:
        """Before a flush that writes the history (publications riding with it, staged
        against the history this attempt read and followed by what it published since):
        `ReconcileRejected` when the history's tail is no longer that. Another writer
        appended (a user's message, another run of the conversation) while the messages
        waited: written after it, they would split a call from its result or answer what
        the model never saw. Nothing this attempt buffered is then recorded, as if the
        process had stopped before the flush (a started call stays in doubt), and the run
        is loaded again to go on, reading the history afresh. One read of the tail; the
        read and the flush are two transactions, so a write landing between them is not
        seen. A store that checks each write's staged tail inside the flush's own
        transaction (`stores.checks_session_tail`: the SQLite and PostgreSQL stores)
        refuses such a write itself (`ReconcileRejected`, the controller stopped alike),
        and then nothing is read here."""
        c = self.controller
        known = self._known
        riding = sum(len(write.items) for write in c._journal.riding)
        if known is None or not riding or checks_session_tail(c.store):
            return
        limit = riding + 1
        if await run_history(c, self._history, limit=limit) == known[-limit:]:
            return
        reason = ("the history changed since this attempt read it: another writer (a "
                  "user, another run of the conversation) appended to it while this run's "
                  "messages waited to be written after what the attempt had read; they "
                  "were not written, and nothing this attempt buffered was recorded (as if "
                  "it stopped here: a call it started is in doubt); load the run again to "
                  "go on from the history as it is")
        c._journal.stop(ReconcileRejected, reason)
        raise ReconcileRejected(reason, run_id=c.run_id, step=c.step, action="publish")

    async def _publish(self, messages: Sequence[ModelMessage]) -> None:
        """Write ``messages`` (with every result the ledger owes) as one publication."""
        c = self.controller
        if not messages and not c.unpublished_call_ids():
            return
        self._answer_unrun(messages)
        owed = list(c.unpublished_call_ids())
        if not messages:
            raise InvalidTransition(
                "results are owed but pydantic-ai added no message carrying them",
                run_id=c.run_id, step=c.step, action="publish")
        async with self._flush_lock:
            # with the history in the store's database, its write rides with the run's
            # next flush (the one before a tool body, or the attempt's end): pydantic-ai
            # sends the model its messages from memory, never from the history
            items = _messages_json(messages)
            await publish(c, self._history, items, call_ids=owed, ride=True,
                          known=self._known)
            if self._known is not None:
                self._known.extend(items)
        self._published += len(messages)

    def _answer_unrun(self, messages: Sequence[ModelMessage]) -> None:
        """Calls pydantic-ai answered without running them (an unknown tool, arguments
        that failed validation) carry that answer in ``messages``: record it as the
        call's result, so the call can never run later."""
        c = self.controller
        for message in messages:
            if not isinstance(message, ModelRequest):
                continue
            for part in message.parts:
                call_id = getattr(part, "tool_call_id", None)
                if (part.part_kind in ("tool-return", "retry-prompt")
                        and isinstance(call_id, str) and c.phase(call_id) is Phase.APPROVED
                        and c.call(call_id).starts == 0):
                    if c.step is Step.INTERRUPTION:
                        c.resume()
                    if c.step is Step.TOOLS:
                        c.begin_tool(call_id)
                        c.tool_completed(call_id, _sent(getattr(part, "content", None)))

    def _replayed(self) -> ModelResponse | None:
        """The recorded final response, handed to pydantic-ai once instead of a model
        call. Asked again, its checks refused it: `RecordedOutputRefused`."""
        c = self.controller
        if self._replay is None:
            return None
        self._replays += 1
        if self._replays > 1:
            raise RecordedOutputRefused(
                "the final output recorded before its checks ran was refused by the "
                "agent's output checks; nothing was accepted and the model was not asked "
                "again: abandon the run", run_id=c.run_id, step=c.step, action="run")
        return self._replay

    async def _before_model_call(self, messages: list[ModelMessage]) -> None:
        c = self.controller
        if self._candidate is not None and c.step is Step.AWAITING_MODEL:
            # pydantic-ai's checks refused the final output (a validator's ModelRetry, an
            # output tool's invalid arguments): the call ends as failed, the refusal goes
            # to the history with the response, and the model is asked again
            self._candidate = None
            c.model_failed(ModelRetry)
        if c.step is not Step.AWAITING_MODEL:  # a crash may have come after the record
            await self._publish(messages[self._published:])
            c.begin_model_call()  # refused while a write is unsettled (I2)
        # a model call needs no flush of its own (DESIGN §7.7): a crash before its
        # response calls the model again. But a tool's result recorded since the last
        # flush is made durable first, with its publication (the messages just staged):
        # a crash while the model answers then leaves the call completed, not in doubt.
        # Else this attempt must still hold the run (one read, no write)
        async with self._flush_lock:
            if c._journal.holds_results:  # (the flush lands what rides with it)
                await self._unmoved()
            await c.flush_results_async()

    def _model_failed(self, error: BaseException) -> None:
        c = self.controller
        if c.step is Step.AWAITING_MODEL:
            c.model_failed(error)

    async def _model_responded(self, response: ModelResponse, ctx: Any) -> None:
        c = self.controller
        tools: dict[str, Any] = dict(getattr(ctx, "tools", None) or {})
        calls: list[ToolCall] = []
        outputs: list[JSON] = []
        for part in response.parts:
            if not isinstance(part, ToolCallPart):
                continue
            tool = tools.get(part.tool_name)
            kind = getattr(tool, "kind", "function")
            if kind == "output":
                outputs.append({"output_tool": part.tool_name, "arguments": _arguments(part),
                                # the JSON text pydantic-ai parses, whole: a NaN or an
                                # infinity the plain form above cannot hold is kept
                                "arguments_json": part.args_as_json_str(),
                                "call_id": part.tool_call_id})
                continue
            _refuse_external(c, [tool] if tool is not None else [], "model_responded")
            calls.append(ToolCall(part.tool_call_id, part.tool_name, _arguments(part),
                                  needs_approval=kind == "unapproved",
                                  idempotent=part.tool_name in self._idempotent))
        text = "".join(part.content for part in response.parts if isinstance(part, TextPart))
        if not calls:
            # a final output is recorded only once pydantic-ai's checks of it pass (the
            # epilogue); refused, the model is asked again (`_before_model_call`)
            self._candidate = outputs[0] if outputs else text
            return
        # a duplicate or reused call id is refused here (InvalidTransition), before any
        # of the response's calls runs
        c.model_responded(calls)
        # the calls are in the history before any of them runs: a resumed attempt finds
        # them there
        await self._publish([response])
        runnable = sum(not call.needs_approval for call in calls)
        if runnable:
            self._room_for(runnable)

    def _room_for(self, calls: int) -> None:
        """`SchemaError` (nothing recorded, no call started) when the log has no room
        left under ``max_bytes`` for ``calls`` calls to end in a recorded failure: after
        its body runs, a call can always be recorded, never left in doubt by the log's
        own limit."""
        c = self.controller
        if self._room(FAILURE_ROOM * calls) < 0:
            raise SchemaError(
                f"{calls} call(s) were not started: the run's log ({c.size} bytes) has no "
                f"room left under max_bytes={self.max_bytes} to record their results; "
                "abandon the run, or open runs with a larger max_bytes",
                run_id=c.run_id, step=c.step, action="begin_tool")

    def _room(self, kept: int) -> int:
        """Bytes of the log left once ``kept`` are set aside: beside `ROOM_KEPT` and the
        results recorded and not yet written (the write that publishes them carries them
        again)."""
        c = self.controller
        owed = sum(json_size(c.call(call_id).result) for call_id in c.unpublished_call_ids())
        return self.max_bytes - c.size - owed - ROOM_KEPT - kept

    def _result_problem(self, size: int) -> str | None:
        """Why a result of ``size`` bytes is not recorded (None: it is): it must fit
        twice (its record, and the write that publishes it) in the room left beside the
        failures the other running calls may need."""
        others = len(self.controller.in_flight) - 1
        limit = self._room(FAILURE_ROOM * others) // 2
        if self.max_result_bytes is not None:
            limit = min(limit, self.max_result_bytes)
        if size <= limit:
            return None
        cap = ("" if self.max_result_bytes is None
               else f", max_result_bytes={self.max_result_bytes}")
        return (f"the tool's result was not recorded or sent: it takes {size} bytes as "
                f"JSON, more than the {max(limit, 0)} this run can record for it "
                f"(max_bytes={self.max_bytes}{cap})")

    async def _execute(self, call: ToolCallPart, args: Any, handler: Any) -> Any:
        c = self.controller
        call_id = call.tool_call_id
        done, cached = begin_call(c, call_id, _arguments(call))
        if done:  # published before, or recorded: its recorded result, never a rerun
            settled = resolution(c, call_id)
            if settled is Resolution.FAILED:  # the failure pydantic-ai sends for a tool
                raise ToolFailed(error_text(cached))
            if settled is Resolution.COMPLETED:  # an operator's JSON: the return value
                return cached
            return _rebuilt(cached)
        await self._flush()  # an effect boundary: the start is durable before the body
        raised: Exception | None = None
        try:
            with running_call(c, call_id):  # tool_context() in the body
                output = await handler(args)
        except ToolRetryError as retry:  # the tool's answer: the model is asked again
            if _timed_out(retry):
                # pydantic-ai stopped waiting; the body did not answer (cancelled mid-way,
                # or still running in its thread): in doubt, never asked for again
                interrupted(c, call_id)
                raise ToolInDoubt(
                    f"call {call_id!r} ({call.tool_name}) timed out (the tool's timeout=): "
                    "its body may have had its effect, or may still be running; it is in "
                    "doubt and never run again: establish its outcome and record it with "
                    "resolve_in_doubt", call_id=call_id, run_id=c.run_id, step=c.step,
                    action="tool_completed") from None
            content = retry.tool_retry.content
            form = _answer(_RETRY, content if isinstance(content, str) else str(retry))
            raised = retry
        except ToolFailedError as failed:  # the tool's answer: a failure the model sees
            form, raised = _answer(_FAILED, str(failed)), failed
        except (CallDeferred, ApprovalRequired):  # deferred itself: ended without a result
            interrupted(c, call_id)
            raise
        except Exception as error:
            # the body ended with an error: recorded as a failure the model is told of on
            # the next attempt; pydantic-ai raises the error on, as it does alone
            form = _answer(_FAILED, _bounded(f"{type(error).__name__}: {error}"))
            raised = error
        except BaseException:  # cancelled or interrupted: the call stays started
            interrupted(c, call_id)
            raise
        else:
            try:
                form = _result_form(output)
            except Exception as error:  # what pydantic-ai could not serialize either
                text = _bounded(f"the tool's result could not be recorded: "
                                f"{type(error).__name__}: {error}")
                form, raised = _answer(_FAILED, text), ToolFailed(text)
        problem = self._result_problem(json_size(form))
        if problem is None:
            try:
                self._recorded(call_id, form)
            except SchemaError as refused:  # nested deeper than the ledger keeps, say
                problem = f"the tool's result could not be recorded: {refused.reason}"
            else:
                if raised is not None:
                    raise raised
                return output
        problem = _bounded(problem)
        self._recorded(call_id, _answer(_FAILED, problem))
        raise ToolFailed(problem)  # the model is told what the ledger recorded

    def _recorded(self, call_id: str, form: JSON) -> None:
        """Record ``form`` as the call's result. A refusal of a store (the call's record
        did not land) leaves the call started, and no longer running here: in doubt."""
        c = self.controller
        try:
            c.tool_completed(call_id, form)
        except SchemaError:
            raise
        except BaseException:
            interrupted(c, call_id)
            raise


def _written(c: RunController) -> list[list[JSON]]:
    """The batches the run wrote, in order: the items of each publication it staged and
    then settled (committed, or acknowledged by a reconcile)."""
    batches: list[list[JSON]] = []
    staged: list[JSON] | None = None
    for event in c.events:
        if isinstance(event, ev.PublicationStaged):
            staged = list(event.items)
        elif isinstance(event, ev.PublicationCommitted | ev.ReconciledAcknowledge):
            if staged is not None:
                batches.append(staged)
            staged = None
    return batches


def _parts(items: Sequence[JSON]) -> list[bytes]:
    """Messages in pydantic-ai's JSON form as the sequence of their parts (each with its
    message's kind), canonical: the same however consecutive requests were merged."""
    return [canonical_json([message.get("kind"), part]) for message in items
            if isinstance(message, dict)
            for part in cast("list[JSON]", message.get("parts") or [])]


def _holds(found: list[bytes], block: list[bytes]) -> bool:
    """Whether ``block`` occurs in ``found``, contiguous."""
    size = len(block)
    return any(found[i:i + size] == block for i in range(len(found) - size + 1)
               if found[i] == block[0])


def _carried(c: RunController, given: list[ModelMessage]) -> list[ModelMessage]:
    """The messages a run without a history goes on from (its caller carries them, and
    may hold only the ones of an earlier stop: it saved them, then the process died
    after the run had written more). ``given`` when they hold everything the run wrote
    (`_written`); when they end with only the first batches of it, ``given`` and the
    batches written since, so nothing the run wrote is sent or written again;
    `HistoryMismatch` (nothing recorded) when they hold no stop of the run, and
    `HistoryRequired` when there are none and the run wrote some (but for a completed
    run, which sends nothing): the ledger alone cannot stand in for them, lacking the
    messages the run was first given."""
    batches = _written(c)
    if not batches:
        return given
    if not given:
        if c.step is Step.COMPLETED:
            return given  # its recorded answer: nothing is sent, nothing runs
        # sent only a prompt, the model would not see the calls the run made and would
        # ask for them again under new ids: refused, never answered from the ledger alone
        # (it lacks the messages the run was first given, if any)
        written = [item for batch in batches for item in batch]
        calls = [part.tool_call_id for message in _messages(written)
                 for part in message.parts if isinstance(part, ToolCallPart)]
        raise HistoryRequired(
            f"the run wrote {len(written)} message(s) (calls "
            f"{', '.join(map(repr, calls)) or 'none'}) and no message_history was given "
            "to carry them: the model would be asked as if they never happened; pass the "
            "messages of the run's last stop (result.messages), or abandon the run; "
            "nothing was recorded", run_id=c.run_id, step=c.step, action="run")
    theirs = _parts(_messages_json(given))
    if _holds(theirs, _parts([item for batch in batches for item in batch])):
        return given
    for stop in range(len(batches) - 1, 0, -1):
        head = _parts([item for batch in batches[:stop] for item in batch])
        if head and theirs[-len(head):] == head:
            return [*given, *_messages([item for batch in batches[stop:] for item in batch])]
    raise HistoryMismatch(
        "the messages given are not the messages of any stop of this run (they do not end "
        "with what it wrote); pass the messages of its last stop (result.messages); "
        "nothing was recorded", run_id=c.run_id, step=c.step, action="run")


def _refuse_unanswered(c: RunController, tail: Sequence[JSON]) -> None:
    """`PublicationUnsettled` when ``tail`` (the history's last items, pydantic-ai's JSON
    form) holds a tool call no later part answers: another run is inside its turn there
    (its tool running, its result not yet written) or stopped in it. A new run writing
    there would split that call from its result, and pydantic-ai, handed such a history,
    runs the call itself or refuses the prompt (`one_writer` checks the openai-style
    items; these are pydantic-ai's own)."""
    answered: set[str] = set()
    for item in reversed(tail):
        parts = item.get("parts") if isinstance(item, dict) else None
        for part in reversed(parts if isinstance(parts, list) else []):
            if not isinstance(part, dict):
                continue
            call_id = part.get("tool_call_id")
            if not isinstance(call_id, str):
                continue
            if part.get("part_kind") == "tool-call":
                if call_id not in answered:
                    raise PublicationUnsettled(
                        f"the history holds call {excerpt(call_id)} with no result after "
                        "it: another run is inside its turn there, or stopped in it; "
                        "settle or repair the run that wrote it before another run "
                        "writes there", run_id=c.run_id, step=c.step, action="run")
            else:
                answered.add(call_id)


def _unanswered(messages: Sequence[ModelMessage]) -> list[str]:
    """The ids of tool calls in ``messages`` that no later part answers."""
    answered: set[str] = set()
    unanswered: list[str] = []
    for message in reversed(messages):
        for part in message.parts:
            call_id = getattr(part, "tool_call_id", None)
            if not isinstance(call_id, str):
                continue
            if isinstance(part, ToolCallPart):
                if call_id not in answered:
                    unanswered.append(call_id)
            else:
                answered.add(call_id)
    return unanswered


_TAKE_OVER = "LedgerRun.open(..., take_over=True), or call settle(take_over=True)"
"""How a pydantic-ai user takes over from an attempt that may still be writing."""


def _prompt_form(prompt: Any) -> JSON:
    """A user prompt in the JSON form the history keeps it in (its part's content)."""
    request = ModelRequest(parts=[UserPromptPart(prompt)])
    dumped = ModelMessagesTypeAdapter.dump_python([request], mode="json")
    return plain(dumped[0]["parts"][0]["content"], fallback=_finite)


def _last_prompt(c: RunController) -> list[JSON]:
    """The last user prompt the run's written messages hold (its staged batches, the
    ledger's own copy of what it wrote), as ``[content]``; ``[]`` when none does."""
    for event in reversed(c.events):
        if not isinstance(event, ev.PublicationStaged):
            continue
        for item in reversed(event.items):
            parts = item.get("parts") if isinstance(item, dict) else None
            for part in reversed(parts if isinstance(parts, list) else []):
                if isinstance(part, dict) and part.get("part_kind") == "user-prompt":
                    return [part.get("content")]
    return []


def _recorded_response(output: JSON) -> ModelResponse:
    """The model's recorded final response rebuilt for pydantic-ai: its text, or its call
    of an output tool (with the recorded call id: what pydantic-ai writes for it), its
    arguments as the JSON text the model answered (a log recorded before that text was
    kept: their plain JSON form)."""
    if isinstance(output, dict) and isinstance(output.get("output_tool"), str):
        call_id, arguments = output.get("call_id"), output.get("arguments")
        text = output.get("arguments_json")
        part = ToolCallPart(output["output_tool"], text if isinstance(text, str) else
                            arguments if isinstance(arguments, dict) else None)
        if isinstance(call_id, str):
            part.tool_call_id = call_id
        return ModelResponse(parts=[part])
    return ModelResponse(parts=[TextPart(output if isinstance(output, str) else "")])


def _function_tools(toolsets: Sequence[AbstractToolset[Any]]) -> set[str]:
    """The names of the tools of the function toolsets in ``toolsets`` (the agent's own
    ``@agent.tool`` tools among them): the tools a verifier may be given for. A toolset
    that makes its tools only when a run asks (a dynamic one) names none here."""
    found: set[str] = set()

    def visit(toolset: AbstractToolset[Any]) -> None:
        if isinstance(toolset, FunctionToolset):
            found.update(toolset.tools)

    for toolset in toolsets:
        toolset.apply(visit)
    return found


def _external_names(toolsets: Sequence[AbstractToolset[Any]]) -> list[str]:
    found: list[str] = []

    def visit(toolset: AbstractToolset[Any]) -> None:
        if isinstance(toolset, ExternalToolset):
            found.extend(tool.name for tool in toolset.tool_defs)

    for toolset in toolsets:
        toolset.apply(visit)
    return found


def _mcp_toolsets(toolsets: Sequence[AbstractToolset[Any]]) -> list[str]:
    """The MCP toolsets (``pydantic_ai.mcp`` servers, FastMCP toolsets, and classes of the
    user's own made from them) in ``toolsets``, by class name."""
    found: list[str] = []

    def visit(toolset: AbstractToolset[Any]) -> None:
        if any(kind.__module__ == "pydantic_ai.mcp"
               or kind.__module__.startswith("pydantic_ai.toolsets.fastmcp")
               for kind in type(toolset).__mro__):
            found.append(type(toolset).__name__)

    for toolset in toolsets:
        toolset.apply(visit)
    return found


def _refuse_external_toolsets(toolsets: Sequence[AbstractToolset[Any]], run_id: str, *,
                              listing: bool = False) -> None:
    """`UnsupportedDeferral` naming the external tools (``ExternalToolset``) in
    ``toolsets``: their calls are answered outside the run, where the ledger cannot tell
    whether they ran. `UnsupportedFeature` for an MCP toolset: its client turns a lost
    ``tools/call`` response into an ordinary exception, which this adapter records as the
    tool's failure, so the model would be told a call failed that may have run.
    ``listing``: found while the run lists its tools (a dynamic toolset's), before the
    model is asked."""
    action, done = (("list_tools", "the model was not asked and none of them ran")
                    if listing else ("open", "nothing was recorded"))
    mcp = _mcp_toolsets(toolsets)
    if mcp:
        raise UnsupportedFeature(
            f"MCP toolsets ({', '.join(sorted(set(mcp)))}) are not carried yet: a tools/call "
            f"whose response was lost would be recorded as failed, not in doubt; {done}",
            feature="MCP toolsets", run_id=run_id, action=action)
    names = _external_names(toolsets)
    if names:
        raise UnsupportedDeferral(
            f"external tools ({', '.join(map(repr, names))}, an ExternalToolset) are not "
            "supported: their results come from outside the run, where the ledger cannot "
            f"tell whether they ran; {done}", run_id=run_id, action=action)


def _output_functions(spec: Any) -> list[str]:
    """The names of the output functions in an output spec (``output_type``): a function
    given as the output, or inside `ToolOutput`, `NativeOutput`, `PromptedOutput`,
    `TextOutput`, a list or a union of them."""
    found: list[str] = []

    def walk(value: Any) -> None:
        if isinstance(value, list | tuple):
            for item in value:
                walk(item)
        elif isinstance(value, ToolOutput):
            walk(value.output)
        elif isinstance(value, NativeOutput | PromptedOutput):
            walk(value.outputs)
        elif isinstance(value, TextOutput):
            found.append(getattr(value.output_function, "__name__", repr(value.output_function)))
        elif typing.get_origin(value) in (typing.Union, types.UnionType):
            walk(typing.get_args(value))
        elif (callable(value) and not isinstance(value, type)
              and typing.get_origin(value) is None):
            found.append(getattr(value, "__name__", repr(value)))

    walk(spec)
    return found


def _refuse_output_functions(spec: Any, run_id: str, action: str) -> None:
    """`UnsupportedFeature` naming the output functions in ``spec``: pydantic-ai calls
    one while it checks the model's final answer, before the ledger can record that
    answer, so a crash (or a cancellation) after its effect would run it again."""
    names = _output_functions(spec)
    if names:
        raise UnsupportedFeature(
            f"output functions ({', '.join(map(repr, names))}) are not carried: pydantic-ai "
            "runs one before the final answer is recorded, so a crash after its effect "
            "would run it again; give the output as a type (structured output), and do "
            "the work in a function tool; nothing was recorded",
            feature="output functions", run_id=run_id, action=action)


def _refuse_external(c: RunController, tools: Sequence[Any], action: str) -> None:
    """`UnsupportedDeferral` when one of a model request's ``tools`` is external (a
    toolset given some other way, or a tool prepared as external): refused before the
    model call is recorded or paid."""
    names = [tool.name for tool in tools if getattr(tool, "kind", None) == "external"]
    if names:
        raise UnsupportedDeferral(
            f"external tools ({', '.join(map(repr, names))}) are not supported: their "
            "results come from outside the run; the model was not called",
            run_id=c.run_id, step=c.step, action=action)


def _timed_out(retry: ToolRetryError) -> bool:
    """Whether pydantic-ai's tool ``timeout=`` made this retry: its `FunctionToolset`
    turns the ``TimeoutError`` of the deadline into ``ModelRetry`` (raised inside its
    handler). The body did not answer: it was cancelled, or (a sync tool) still runs in
    its thread."""
    error = retry.__cause__
    if not isinstance(error, ModelRetry) or not isinstance(error.__context__, TimeoutError):
        return False
    trace = error.__traceback__
    while trace is not None and trace.tb_next is not None:
        trace = trace.tb_next
    return trace is not None and trace.tb_frame.f_code is FunctionToolset.call_tool.__code__


def _refuse_rewriters(capability: AbstractCapability[Any], run_id: str) -> None:
    """`UnsupportedCapability` when ``capability`` is or holds a history processor."""
    found: list[AbstractCapability[Any]] = []
    capability.apply(lambda leaf: found.append(leaf) if isinstance(leaf, ProcessHistory)
                     else None)
    if found:
        raise UnsupportedCapability(
            "a history processor (ProcessHistory) rewrites messages the run has already "
            "written; it is not supported", run_id=run_id, action="open")
