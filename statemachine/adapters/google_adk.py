"""Google ADK agents (PyPI ``google-adk``) with the control core's tool ledger underneath
(DESIGN §2.4, §6.8, §7.4). Install with ``pip install 'agent-statemachine[google-adk]'``
(tested on google-adk 2.13.x).

Theory of operation
-------------------
ADK runs each function call of a model response through a plugin's tool callbacks, and
runs a call again whenever a session is resumed with a function response that names it:
a confirmation (``adk_request_confirmation``), the late result of a long-running tool, a
resumed invocation. `LedgerPlugin` makes the function calls of an ADK session a run of a
`RunController` bound to an event store (SQLite or PostgreSQL), one run per session (run
id ``f"{prefix}{app_name}/{user_id}/{session_id}"``), keyed by ADK's
``function_call_id``:

===============================  ===========================================================
ADK seam                         what the ledger does
===============================  ===========================================================
``before_tool_callback``         an unknown call's batch (the session event holding its
                                 function calls) is entered in the ledger; a completed call
                                 answers with its recorded response (the body never runs
                                 again: finishing one long-running tool, a replayed
                                 confirmation or a resumed invocation re-run nothing; a
                                 long-running tool's empty result is ``{}``, no response
                                 yet, as ADK gave it the first time); a started,
                                 unfinished call is in doubt (`ToolInDoubt`, after its
                                 verifier was asked); a call asked to run with other
                                 arguments than the recorded ones (which its confirmation
                                 binds) is refused (`InvalidTransition`); a call of a tool
                                 the agent does not have is not begun (no body runs: ADK
                                 answers it, and the ledger records that answer); otherwise
                                 its start is made durable (flushed) before the body runs,
                                 inside its `statemachine.tool_context` (its idempotency
                                 key)
``after_tool_callback``          ADK's own chain after the plugin (the plugins after it,
                                 then the agent's ``after_tool_callback``) is run here, once,
                                 and what it made of the output is recorded (a value that is
                                 not JSON is kept as its text) and given to ADK in its
                                 recorded form, so a resent response is the same and the
                                 raw output a callback replaced is not kept (DESIGN §7.4);
                                 flushed at once (a crash before ADK's append then finds
                                 the call completed); a call answered from the ledger is
                                 given as it is (the chain does not run again on what it
                                 made); a call ADK could not look up that a before-tool
                                 callback after the plugin answered is recorded here, begun
                                 and completed at once
``before_model_callback``        a result the ledger still buffers is made durable
                                 (``flush_results``), else the claim is checked
``on_event_callback``            before ADK hands the session service an event carrying
                                 responses the ledger holds: with
                                 ``OneWriterSessionService(plugin=)`` an event answering
                                 every unpublished call is staged (durably) as their
                                 publication
``on_tool_error_callback``       an exception of the body is noted and left to ADK's
                                 chain after the plugin (the plugins after it, then the
                                 agent's ``on_tool_error_callback``), run once, by ADK: an
                                 answer it makes goes to the after-tool callbacks, which
                                 record what ADK uses; a cancelled body leaves its call in
                                 doubt
                                 (the next run of the session, in this process too, is
                                 refused when it opens, as a fresh process's would be); a
                                 call of a tool the agent does not have (ADK's lookup error,
                                 no after-tool callback follows) is recorded here, begun and
                                 completed at once, with the answer of the chain or else
                                 ADK's own not-found response, and that answer goes to ADK
``on_agent_error_callback``,     the noted exception of a body that nothing answered, which
``on_run_error_callback``        ADK then raised, is recorded as the call's error
                                 (``{"error": "<Type>: <message>"}``) and propagates as with
                                 ADK alone (were neither callback to come, the call would
                                 stay started: in doubt, never run again)
``require_confirmation``         the call awaits a decision in the ledger; the confirmation
                                 request ADK shows carries the call's fingerprint in its
                                 ``payload``, and a confirmation is taken only with that
                                 fingerprint in its own payload (`confirmation` builds it;
                                 a rejection needs none); one with another fingerprint, a
                                 confirming one without it, or one contradicting a decision
                                 the ledger holds (`statemachine.operator`, the CLI), is
                                 refused (`InvalidTransition`), nothing recorded; the
                                 confirmations one message brings for several calls are
                                 checked and recorded together, before any of them runs
``tool_context.                  a body that asks for confirmation is taken to have done
request_confirmation``           nothing before asking (recorded ``NOT_EXECUTED`` by
                                 ``adk:request_confirmation``): ADK runs it again once
                                 confirmed, with the same arguments and idempotency key
`OneWriterSessionService`        around any ``BaseSessionService``: an ``append_event`` from
                                 a session copy that is not the session's latest is refused
                                 (`ConcurrencyConflict`, also when the service itself finds
                                 it stale: ADK's ``StaleSessionError``), nothing written;
                                 the event that
                                 carries function responses the ledger holds unpublished is
                                 their staged publication (durable before the write: staged
                                 by the plugin's ``on_event_callback``, or here; committed
                                 after, recorded failed when it raises or is refused; a write
                                 left unsettled is reconciled against the stored events by
                                 the next append)
===============================  ===========================================================

ADK's own ``set_model_response`` (the tool ADK adds for an ``output_schema`` beside tools)
is left to ADK, outside the ledger: it has no effect (it checks the model's structured
answer), and its body is what hands ADK the output, so it runs whenever ADK runs it. The
adapter records no final output: ADK's final answer is an event of its session.

Every attempt on a run that already exists (the first ledger call of a process, or after
another process wrote to the run) records ``claim`` first and makes it durable: of two
processes that loaded the same version, one goes on and the other gets
`ConcurrencyConflict` before any tool runs; one superseded by a later claim gets it at its
next model request, tool callback or session write, writing nothing. Right after the claim
the verifiers (by tool name, DESIGN §7.3) are asked about the calls of their tools in
doubt.

Refused when a run opens (``on_user_message_callback``, before the user's message is
written and before anything is claimed, and ``before_run_callback`` for a resumed
invocation: `UnsupportedFeature` naming the feature, nothing recorded, written or run, no
live attempt superseded): MCP toolsets and tools (ADK's MCP tool retries a
failed call once with a fresh session below the plugin callbacks, so a non-idempotent
call could run twice unseen), agents used as tools (``AgentTool``: the inner agent's tool
calls would run outside this run's ledger), workflow agents (``ParallelAgent``,
``LoopAgent``, ``SequentialAgent``) and sub-agents (their calls would interleave in one
run), code executors (the code the model writes runs outside the tool callbacks), a
plugin placed before the ledger that overrides ``after_tool_callback`` or
``on_tool_error_callback`` (ADK stops at the first that returns a value, so the ledger
could miss a body's result: ADK's own ``MultimodalToolResultsPlugin`` always returns
one), and live (bidirectional) streaming (``run_live``, or ``StreamingMode.BIDI``).
Refused at the call: a function call without an id (ADK 2.13 gives a call the model sent
without one an id of its own before any callback, so through its runner this is never
reached). ADK wraps whatever a plugin callback raises in a ``RuntimeError``; `run_async`
and `refusal` give back the ledger's own error (its refusal, or the error of the session
write it made to settle a publication).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import json
import os
import sqlite3
import threading
from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from typing import Any

from statemachine.adapters import missing_extra

try:
    import google.adk  # noqa: F401  -- the error names the SDK, not one of its modules
    from google.adk.agents import LlmAgent
    from google.adk.agents.readonly_context import ReadonlyContext
    from google.adk.errors import StaleSessionError
    from google.adk.events.event import Event
    from google.adk.flows.llm_flows.tools._error_handler import (
        build_tool_not_found_response,
    )
    from google.adk.plugins.base_plugin import BasePlugin
    from google.adk.sessions.base_session_service import BaseSessionService
    from google.adk.sessions.sqlite_session_service import SqliteSessionService
    from google.adk.tools.agent_tool import AgentTool
    from google.adk.tools.base_tool import BaseTool
    from google.adk.tools.base_toolset import BaseToolset
    from google.adk.tools.set_model_response_tool import SetModelResponseTool
    from google.adk.tools.tool_confirmation import ToolConfirmation
    from google.adk.utils._callback_pipeline import _run_callbacks, _stop_on_non_none
    from google.genai import types
except ModuleNotFoundError as error:  # pragma: no cover - the extra is installed in CI
    raise missing_extra(__name__, "google-adk", error) from error

from statemachine.adapters._calls import (
    HeldRuns,
    InvalidVerifier,
    UnsupportedFeature,
    Walk,
    answered,
    begin_call,
    checked_verifiers,
    error_text,
    plain,
    record_result,
    refuse_other_arguments,
    resolution,
    stored_run,
)
from statemachine.controller import RunController
from statemachine.errors import (
    ConcurrencyConflict,
    ControlError,
    InvalidTransition,
    ToolInDoubt,
)
from statemachine.journal import is_async
from statemachine.payloads import JSON
from statemachine.runner.attempt import interrupted
from statemachine.sqlite import connect_readonly, same_file
from statemachine.stores import EventStore, SQLiteEventStore
from statemachine.values import Append, Phase, Resolution, Step, ToolCall
from statemachine.verifiers import Verifier, context_of, entered, left

__all__ = [
    "InvalidVerifier",
    "LedgerPlugin",
    "OneWriterSessionService",
    "ToolInDoubt",
    "UnsupportedFeature",
    "confirmation",
    "refusal",
    "run_async",
]

CONFIRMATION = "adk_request_confirmation"
"""The name of the function call ADK emits to ask for a tool call's confirmation."""

ASK_CONFIRMATION = "This tool call requires confirmation, please approve or reject."
REJECTED = "This tool call is rejected."
"""ADK's own answers to a call awaiting confirmation and to a rejected one."""


# ------------------------------------------------------------------ plain JSON forms


def _as_text(value: Any, walk: Walk | None) -> JSON:
    """The `plain` fallback: a pydantic model as its JSON form, anything else as text."""
    dump = getattr(value, "model_dump", None)
    if walk is not None and callable(dump):
        return walk(dump(mode="json"))
    return str(value)


def _arguments(args: Mapping[str, Any] | None) -> JSON:
    return plain(dict(args or {}), fallback=_as_text)


def confirmation(confirmation_call_id: str, *, fingerprint: str, confirmed: bool = True,
                 role: str = "user") -> types.Content:
    """The message that answers ADK's confirmation request ``confirmation_call_id`` (the
    id of its ``adk_request_confirmation`` function call) for the call whose
    ``fingerprint`` the request's payload showed: pass it as ``new_message``."""
    return types.Content(role=role, parts=[types.Part(
        function_response=types.FunctionResponse(
            id=confirmation_call_id, name=CONFIRMATION,
            response={"confirmed": confirmed, "payload": {"fingerprint": fingerprint}}))])


def _payload_fingerprint(payload: Any) -> str | None:
    if isinstance(payload, Mapping):
        found = payload.get("fingerprint")
        return found if isinstance(found, str) else None
    return None


_SETTLING_WRITE = ("statemachine: raised by the session write that settles a publication "
                   "left unsettled (the ledger's reconcile when the invocation opened)")
"""The note the ledger adds to the error of a session write it made itself."""


def refusal(error: BaseException) -> BaseException:
    """The ledger's own error inside ``error`` (a refusal, a `ControlError`, or the error
    of the session write the ledger made itself to settle a publication: I6, the write's
    own error), or ``error`` itself. ADK wraps whatever a plugin callback raises in a
    ``RuntimeError`` (the original chained as its ``__cause__``)."""
    found: BaseException | None = error
    while found is not None:
        notes = getattr(found, "__notes__", ())
        if isinstance(found, ControlError) or _SETTLING_WRITE in notes:
            return found
        found = found.__cause__
    return error


async def run_async(runner: Any, **options: Any) -> AsyncIterator[Any]:
    """``runner.run_async(**options)``, its events, with the ledger's refusals raised as
    themselves (`ToolInDoubt`, `ConcurrencyConflict`, `UnsupportedFeature`, ...), and
    the error of a session write the ledger made itself, rather than inside ADK's
    ``RuntimeError`` (`refusal`)."""
    try:
        async for event in runner.run_async(**options):
            yield event
    except Exception as error:
        found = refusal(error)
        if found is error:
            raise
        raise found from error


# ------------------------------------------------------------------------ the plugin

_RESULT_CALLBACKS = ("after_tool_callback", "on_tool_error_callback")
"""The plugin callbacks through which the ledger records a body's result."""


def _ids(c: RunController, calls: Sequence[types.FunctionCall]) -> list[str]:
    """The ids of a batch's calls; `UnsupportedFeature` when one has none."""
    ids = [call.id for call in calls]
    if any(not isinstance(call_id, str) or not call_id for call_id in ids):
        raise UnsupportedFeature(
            "a function call without an id cannot be keyed in the ledger: nothing ran",
            feature="function calls without ids", run_id=c.run_id, step=c.step,
            action="begin_tool")
    return [str(call_id) for call_id in ids]


def _check_fingerprint(c: RunController, call_id: str, given: ToolConfirmation) -> None:
    """`InvalidTransition` (nothing recorded) unless ``given`` carries call
    ``call_id``'s fingerprint in its payload (a rejection may carry none)."""
    shown = _payload_fingerprint(given.payload)
    fingerprint = c.fingerprint(call_id)
    if shown not in (fingerprint, None) or (given.confirmed and shown != fingerprint):
        raise InvalidTransition(
            f"the confirmation of call {call_id!r} does not carry the call's fingerprint "
            "(it confirms other arguments, another call, or none shown): nothing was "
            "recorded; answer with statemachine.adapters.google_adk.confirmation",
            run_id=c.run_id, step=c.step, action="approve")


def _confirmations(session: Any, c: RunController) -> dict[str, ToolConfirmation]:
    """The confirmations the session's last user message brings for calls awaiting a
    decision in the ledger, by the id of the call each confirms (as ADK reads them: the
    message's ``adk_request_confirmation`` responses, each mapped to the call its
    request showed)."""
    events = list(session.events)
    message = next((e for e in reversed(events) if e.author == "user"), None)
    if message is None:
        return {}
    answers = {str(r.id): r.response for r in message.get_function_responses()
               if r.name == CONFIRMATION and r.id and r.response is not None}
    found: dict[str, ToolConfirmation] = {}
    for event in events:
        for request in event.get_function_calls():
            original = (request.args or {}).get("originalFunctionCall")
            if request.id not in answers or not isinstance(original, Mapping):
                continue
            call_id = original.get("id")
            if isinstance(call_id, str) and c.phase(call_id) is Phase.AWAITING:
                found[call_id] = ToolConfirmation.from_response_dict(answers[request.id])
    return found


def _run_id(prefix: str, session: Any) -> str:
    return f"{prefix}{session.app_name}/{session.user_id}/{session.id}"


def _mcp(obj: Any) -> bool:
    """Whether ``obj`` is one of ADK's MCP tools or toolsets, or made from one (a subclass
    of its own, whatever its name): a class in its MRO is named so (the MCP modules are
    not imported, since they need the ``mcp`` package)."""
    return any("Mcp" in kind.__name__ or "MCP" in kind.__name__ for kind in type(obj).__mro__)


class LedgerPlugin(HeldRuns, BasePlugin):
    """The function calls of ADK sessions, through one event store (DESIGN §7.4).

    Give it to the runner first: ``Runner(..., plugins=[LedgerPlugin(store), ...])`` (a
    plugin before it that answers a call would bypass the ledger). ``store`` is a sync
    `EventStore` (`SQLiteEventStore`, the PostgreSQL store); ``prefix`` makes a session's
    run id. ``idempotent`` names the tools that may run again after a crash inside them,
    ``verifiers`` (by tool name, sync) the tools whose calls in doubt can be asked about.
    ``owner`` is recorded by every claim.

    Refused when built (`InvalidVerifier`, `UnsupportedFeature`): a verifier for no tool
    of ``tools`` (when given) or for an idempotent tool, and an async store."""

    def __init__(self, store: EventStore, *, prefix: str = "adk:",
                 idempotent: Collection[str] = (),
                 verifiers: Mapping[str, Verifier] | None = None,
                 tools: Collection[str] | None = None, owner: str | None = None,
                 name: str = "statemachine_ledger") -> None:
        super().__init__(name=name)
        if is_async(store):
            raise UnsupportedFeature(
                "an async event store is not carried: ADK runs sync tool bodies on worker "
                "threads beside the callbacks; use the sync store of the same database",
                feature="async event stores", action="open")
        named = set(tools) if tools is not None else set(verifiers or ())
        self.verifiers = checked_verifiers(verifiers, named, idempotent=idempotent,
                                           sync_only="a sync verifier")
        self.store = store
        self.prefix = prefix
        self.idempotent = frozenset(idempotent)
        self.owner = owner
        self._lock = threading.RLock()
        self._runs: dict[str, RunController] = {}
        self._bodies: dict[tuple[str, str], contextvars.Token[Any]] = {}
        """By run id and call id: the body's `tool_context` entered, until it ends."""
        self.publishes_to: OneWriterSessionService | None = None
        """The session service whose appends are this plugin's publications (set by
        ``OneWriterSessionService(service, plugin=...)``); None: the session appends are
        not the plugin's publications."""
        self._answered: dict[tuple[str, str], dict[str, Any]] = {}
        """By run id and call id (two sessions on one plugin may reuse a call id): the
        answer `before_tool_callback` gave from the ledger, until its
        `after_tool_callback`."""
        self._staged: dict[str, str] = {}
        """By run id: the id of the event whose publication `_stage` staged, until the
        session service appends it (`OneWriterSessionService`)."""
        self._raised: dict[tuple[str, str], Exception] = {}
        """By run id and call id: the exception of a body that raised, from its
        ``on_tool_error_callback`` until an after-tool callback (a later error callback
        answered it) or the error escaping the agent (nothing did: `_errors_escaped`)."""

    # ------------------------------------------------------------------ the runs

    def run_id_of(self, session: Any) -> str:
        """The run id of an ADK ``Session``."""
        return _run_id(self.prefix, session)


    # ------------------------------------------------------------- opening a run

    async def on_user_message_callback(self, *, invocation_context: Any,
                                       user_message: Any) -> None:
        """Before ADK writes the user's message (which opens an invocation, and which
        `OneWriterSessionService` settles the run for first, claiming it): what this
        adapter cannot carry is refused here (`_refuse`), so a refused invocation records
        nothing, writes nothing to the session, and supersedes no live attempt."""
        await self._refuse(invocation_context)

    async def before_run_callback(self, *, invocation_context: Any) -> None:
        """Refuse what this adapter cannot carry (`UnsupportedFeature`) before the run
        does anything, and before its claim (a resumed invocation brings no message)."""
        run_id = await self._refuse(invocation_context)
        with self._lock:
            held = self._runs.get(run_id)
            for call_id, _ in self._take_raised(run_id):
                # a body's error left to an error chain that never ended (its invocation
                # cancelled): neither an answer nor the error reached ADK, as if the body
                # were cancelled
                if held is not None and call_id in held.in_flight:
                    self._reset(run_id, call_id)
                    interrupted(held, call_id)
            c = self.controller(run_id)
            if c.in_doubt() and c is held:  # a body this process ran was interrupted:
                self.forget(run_id)  # opened afresh, its verifier asked, as in another
                c = self.controller(run_id)  # process
            if c.in_doubt():  # refused here, before ADK's invocation records anything
                c.resume()  # ToolInDoubt
        if c.step is Step.UNSETTLED:
            await self._reconcile(c, invocation_context.session,
                                  invocation_context.session_service)

    async def _settle(self, session: Any, service: BaseSessionService) -> None:
        """Before a user's message is written to ``session``: a session append left
        unsettled is reconciled first (I2: no new input while a write is unsettled; the
        message would change the tail its reconcile reads, for good). A run with nothing
        to settle is not claimed here: the claim would be flushed alone, before the
        message's write decides between two writers, and a loser of that write would
        supersede its winner, so that neither went on (`before_run_callback` claims the
        run once the message is written)."""
        run_id = self.run_id_of(session)
        with self._lock:
            if not self._unsettled(run_id):
                return
            c = self.controller(run_id)
        if c.step is Step.UNSETTLED:
            await self._reconcile(c, session, service)

    def _unsettled(self, run_id: str) -> bool:
        """Whether the run is ``UNSETTLED``, read without claiming it: from the copy this
        process holds when no other process wrote since, else from the store (a copy
        another process wrote past is dropped, as `controller` would replace it: the
        next attempt loads the run again, and claims it)."""
        held = self._runs.get(run_id)
        if held is not None:
            try:
                held.fence()
            except ControlError:  # another process wrote: the copy stopped
                self._runs.pop(run_id, None)
            else:
                return held.step is Step.UNSETTLED
        stored = stored_run(self.store, run_id, buffered=True)
        return stored is not None and stored.step is Step.UNSETTLED

    async def _reconcile(self, c: RunController, session: Any,
                         service: BaseSessionService) -> None:
        """A session append left unsettled (it raised, or its writer died) reconciled
        against the session's events as the runner just read them: acknowledged when it
        had landed; else the staged event is appended again (through the runner's session
        service) and the publication committed. Another tail is `ReconcileRejected`."""
        history = [_event_json(e) for e in session.events]
        with self._lock:
            decision = c.reconcile(history, c.session_id, take_over=True)
            c.flush()
        if not isinstance(decision, Append):
            return
        inner = service.service if isinstance(service, OneWriterSessionService) else service
        try:
            for item in decision.items:
                await _appended(inner, session, Event.model_validate(item))
        except Exception as error:
            with self._lock, contextlib.suppress(ControlError):
                c.publication_failed(error)
                c.flush()
            error.add_note(_SETTLING_WRITE)  # run_async raises it as itself, not ADK's
            raise
        with self._lock:
            c.publication_committed()
            c.flush()

    async def _refuse(self, invocation_context: Any) -> str:
        """`UnsupportedFeature` for what this adapter cannot carry, read from the
        invocation alone (nothing loaded, claimed or recorded); else the run's id."""
        run_id = self.run_id_of(invocation_context.session)
        mode = getattr(invocation_context.run_config, "streaming_mode", None)
        live = getattr(invocation_context, "live_request_queue", None) is not None
        if live or getattr(mode, "name", None) == "BIDI":
            raise UnsupportedFeature(
                "live (bidirectional) streaming is not carried: its tool calls run outside "
                "the plugin's ordered callbacks; run the agent with run_async",
                feature="live streaming", run_id=run_id, action="open")
        self._check_plugins(invocation_context.plugin_manager.plugins, run_id)
        await self._check_agent(invocation_context.agent, invocation_context, run_id)
        return run_id

    def _check_plugins(self, plugins: Sequence[Any], run_id: str) -> None:
        """ADK stops at the first plugin whose ``after_tool_callback`` (or
        ``on_tool_error_callback``) returns a value: one placed before the ledger that
        overrides either could answer a call whose body ran without the ledger recording
        its result (left in doubt for good). Refused, whatever it returns today."""
        ahead = next((plugins[:n] for n, p in enumerate(plugins) if p is self), [])
        for plugin in ahead:
            for name in _RESULT_CALLBACKS:
                own = getattr(getattr(plugin, name), "__func__", None)
                if own is not getattr(BasePlugin, name):
                    raise UnsupportedFeature(
                        f"plugin {plugin.name!r} ({type(plugin).__name__}) is placed before "
                        f"the ledger and overrides {name}: ADK stops at the first plugin "
                        "that returns a value there, so the ledger could miss the result "
                        "of a body that ran; place the ledger first",
                        feature="plugins before the ledger on tool results", run_id=run_id,
                        action="open")

    async def _check_agent(self, agent: Any, invocation_context: Any, run_id: str) -> None:
        if not isinstance(agent, LlmAgent):
            raise UnsupportedFeature(
                f"agent {getattr(agent, 'name', agent)!r} is a {type(agent).__name__}: only "
                "an LlmAgent is carried (workflow agents run their sub-agents' tool calls "
                "side by side or again, which one run per session cannot order)",
                feature=f"{type(agent).__name__} agents", run_id=run_id, action="open")
        if agent.code_executor is not None:
            raise UnsupportedFeature(
                f"agent {agent.name!r} has a code executor "
                f"({type(agent.code_executor).__name__}): the code the model writes runs "
                "outside the plugin's tool callbacks, so outside the ledger",
                feature="code executors", run_id=run_id, action="open")
        if agent.sub_agents:
            raise UnsupportedFeature(
                f"agent {agent.name!r} has sub-agents: transfers between agents are not "
                "carried (each agent's calls would share one run without an order)",
                feature="sub-agents", run_id=run_id, action="open")
        for tool in agent.tools:
            if isinstance(tool, BaseToolset):
                self._refuse_toolset(tool, run_id)
        for tool in await agent.canonical_tools(ReadonlyContext(invocation_context)):
            self._refuse_tool(tool, run_id)

    @staticmethod
    def _refuse_toolset(toolset: Any, run_id: str) -> None:
        kind = type(toolset).__name__
        if _mcp(toolset):
            raise UnsupportedFeature(
                f"{kind} is not carried: ADK's MCP tool retries a failed call once with a "
                "fresh session below the plugin callbacks, so a non-idempotent call could "
                "reach the server twice without the ledger seeing it",
                feature="MCP toolsets", run_id=run_id, action="open")

    @staticmethod
    def _refuse_tool(tool: Any, run_id: str) -> None:
        kind = type(tool).__name__
        if _mcp(tool):
            raise UnsupportedFeature(
                f"tool {tool.name!r} is an {kind}: ADK's MCP tool retries a failed call "
                "once with a fresh session below the plugin callbacks, so a non-idempotent "
                "call could reach the server twice without the ledger seeing it",
                feature="MCP tools", run_id=run_id, action="open")
        if isinstance(tool, AgentTool) or getattr(tool, "_defers_response", False):
            raise UnsupportedFeature(
                f"tool {tool.name!r} is an agent used as a tool ({kind}): its inner agent's "
                "tool calls would run outside this run's ledger",
                feature="agents as tools", run_id=run_id, action="open")

    # ------------------------------------------------------------------- batches

    @staticmethod
    def _batch(session: Any, call_id: str,
               tools: Collection[str]) -> list[types.FunctionCall]:
        """The function calls of the session event that holds call ``call_id``, but
        ADK's own: its confirmation requests, and its ``set_model_response`` where no tool
        of the agent (``tools``) has that name."""
        outside = {CONFIRMATION} | ({SetModelResponseTool.NAME} - set(tools))
        for event in reversed(list(session.events)):
            calls = [call for call in event.get_function_calls()
                     if call.name not in outside]
            if any(call.id == call_id for call in calls):
                return calls
        return []

    @staticmethod
    async def _needs(calls: Sequence[types.FunctionCall], tools: Mapping[str, Any],
                     tool_context: Any) -> dict[str, bool]:
        """Which calls of a batch need a confirmation (``require_confirmation``, which
        may be an async callable), by call id."""
        needs: dict[str, bool] = {}
        for call in calls:
            tool = tools.get(str(call.name))
            needs[str(call.id)] = tool is not None and await tool.check_require_confirmation(
                dict(call.args or {}), tool_context) is True
        return needs

    def _enter(self, c: RunController, calls: Sequence[types.FunctionCall],
               needs: Mapping[str, bool]) -> None:
        """Enter a batch of calls the ledger has not seen, as one model response (``needs``:
        which need a confirmation): the results of the batch before it published first.
        A batch a sibling call entered meanwhile is left as it is."""
        ids = _ids(c, calls)
        if len(set(ids)) != len(ids):
            raise InvalidTransition("a batch holds the same function call id twice: "
                                    "nothing ran", run_id=c.run_id, step=c.step,
                                    action="model_responded")
        known = [call_id for call_id in ids if c.phase(call_id) is not None]
        if known:
            if len(known) == len(ids):
                return
            raise InvalidTransition(
                f"a batch reuses call id(s) {known!r} the ledger already holds beside new "
                "ones: nothing ran", run_id=c.run_id, step=c.step, action="model_responded")
        if c.in_doubt():
            c.resume()  # ToolInDoubt: a call of an earlier batch never finished
        self._publish_owed(c)
        proposed = [ToolCall(str(call.id), str(call.name), _arguments(call.args),
                             needs_approval=needs.get(str(call.id), False),
                             idempotent=str(call.name) in self.idempotent)
                    for call in calls]
        c.begin_model_call()
        c.model_responded(proposed)
        # not flushed here (DESIGN §7.7): the proposal rides with the next flush, the
        # start before the body, a decision, or a confirmation asked for

    @staticmethod
    def _publish_owed(c: RunController) -> None:
        """Publish the recorded results of the earlier batch in the ledger's own history
        (staged and committed in one append: ADK's session holds the events themselves).
        Calls of the earlier batch never run (a confirmation never given) are skipped by
        the handoff to the new batch."""
        owed = list(c.unpublished_call_ids())
        if c.step in (Step.TOOLS, Step.INTERRUPTION) and owed:
            items: list[JSON] = [{"type": "function_response", "id": call_id,
                                  "result": c.call(call_id).result} for call_id in owed]
            c.stage_publication(items, [], call_ids=owed, whole=True)
            c.publication_committed()
        if c.step is Step.INTERRUPTION:  # a confirmation never given: the call is skipped
            c.handoff("a new batch of function calls")
        elif c.step is Step.TOOLS:
            raise InvalidTransition(
                "the model moved on to a new batch while calls of the earlier one never "
                "ran (confirmed, not started): nothing ran", run_id=c.run_id, step=c.step,
                action="begin_model_call")

    # -------------------------------------------------------------- one tool call

    @staticmethod
    def _answer(c: RunController, call_id: str, *,
                long_running: bool = False) -> dict[str, Any]:
        """The recorded response of call ``call_id`` as the dict ADK gets: the tool's own,
        an operator's or a verifier's word, or a rejection. A long-running tool's empty
        result is ``{}``, as ADK gave it the first time: no response yet (its client sends
        it later)."""
        view = c.call(call_id)
        if view.phase is Phase.REJECTED or (view.phase is Phase.PUBLISHED and view.decisions
                                            and view.decisions[-1].kind == "rejected"
                                            and view.starts == 0):
            text = REJECTED if view.result is None else error_text(view.result)
            return {"error": text}
        settled = resolution(c, call_id)
        output = view.result
        if settled is Resolution.FAILED:
            return {"error": error_text(output)}
        if long_running and not output:
            return {}
        if settled is Resolution.COMPLETED:
            return output if isinstance(output, dict) else {"result": output}
        if isinstance(output, dict):
            return output
        return {"result": output}

    async def before_tool_callback(self, *, tool: BaseTool, tool_args: dict[str, Any],
                                   tool_context: Any) -> dict[str, Any] | None:
        call_id = tool_context.function_call_id
        session = tool_context.session
        run_id = self.run_id_of(session)
        if not isinstance(call_id, str) or not call_id:
            raise UnsupportedFeature(
                "a function call without an id cannot be keyed in the ledger: it did not "
                "run", feature="function calls without ids", run_id=run_id,
                action="begin_tool")
        if isinstance(tool, SetModelResponseTool):
            # ADK's own, for an output_schema beside tools: no effect (it checks the
            # model's structured answer), and its body is what hands ADK the output, so
            # it runs whenever ADK runs it (answered from a record, the output was lost)
            return None
        invocation = tool_context._invocation_context
        tools = {t.name: t for t in await invocation.agent.canonical_tools(
            ReadonlyContext(invocation))}
        # Nothing is awaited under the lock: ADK runs a response's calls as tasks of one
        # event loop, and a thread's lock does not keep them apart across an await.
        with self._lock:
            c = self.controller(run_id, reopen=False)  # superseded: refused, not reclaimed
            batch = self._batch(session, call_id, tools) if c.phase(call_id) is None else []
            _ids(c, batch)  # a call without an id: refused before anything is asked
        needs: dict[str, bool] = {}
        if batch:  # asked before the lock; entered under it unless a sibling was first
            needs = await self._needs(batch, tools, tool_context)
        with self._lock:
            c = self.controller(run_id, reopen=False)
            if c.phase(call_id) is None:
                if not batch:
                    raise UnsupportedFeature(
                        f"call {call_id!r} is in no event of the session: it cannot be "
                        "entered with its batch; it did not run",
                        feature="function calls outside the session", run_id=run_id,
                        action="begin_tool")
                self._enter(c, batch, needs)
            answer = self._decided(c, call_id, tool_context)
            if answer is not None:
                return self._answering(run_id, call_id, answer)
            phase = c.phase(call_id)
            long_running = bool(tool.is_long_running)
            if phase in (Phase.REJECTED, Phase.COMPLETED, Phase.PUBLISHED):
                refuse_other_arguments(c, call_id, _arguments(tool_args))
                answered(c, call_id)
                return self._answering(
                    run_id, call_id, self._answer(c, call_id, long_running=long_running))
            if tool.name not in tools:  # no tool has its name: ADK answers it through
                return None  # on_tool_error_callback, where it is recorded; never begun
            # a note left by a run of this id cancelled between its callbacks is not
            # this run's answer (ADK runs a confirmed call again under the same id)
            self._answered.pop((run_id, call_id), None)
            done, _ = begin_call(c, call_id, _arguments(tool_args))
            if done:
                return self._answering(
                    run_id, call_id, self._answer(c, call_id, long_running=long_running))
            try:
                c.flush()  # an effect boundary: the start is durable before the body
            except BaseException:
                self._runs.pop(run_id, None)
                raise
            # tool_context() in the body: ADK runs each call in a task of its own
            self._bodies[(run_id, call_id)] = entered(context_of(c, call_id))
            return None

    def _answering(self, run_id: str, call_id: str, answer: dict[str, Any]
                   ) -> dict[str, Any]:
        """``answer``, the ledger's word for a call whose body does not run, noted so
        that `after_tool_callback` gives it to ADK as it is (the callbacks after it ran
        when the result was recorded: they do not run again on what they made)."""
        self._answered[(run_id, call_id)] = answer
        return answer

    def _decided(self, c: RunController, call_id: str,
                 tool_context: Any) -> dict[str, Any] | None:
        """A call awaiting its confirmation: asked for it (its fingerprint in the
        request's payload), or the confirmation ADK brought recorded as the decision.
        None when the call may go on."""
        view = c.call(call_id)
        if not view.call.needs_approval:
            return None
        fingerprint = c.fingerprint(call_id)
        given = tool_context.tool_confirmation
        if given is None:
            if view.phase is Phase.AWAITING:
                tool_context.request_confirmation(
                    hint=f"Please approve or reject the tool call {view.call.name}() by "
                         "responding with a FunctionResponse with an expected "
                         "ToolConfirmation payload (its fingerprint).",
                    payload={"fingerprint": fingerprint})
                # as ADK's own gate does: the pause is no result for the model to
                # summarize (asked again, it may call the tool again)
                tool_context.actions.skip_summarization = True
                c.flush()  # the invocation ends awaiting it: durable (the inbox lists it)
                return {"error": ASK_CONFIRMATION}
            return None  # decided in the ledger (the operator): the ledger's word goes on
        if view.phase is Phase.AWAITING:
            # ADK runs the calls one message confirms side by side, and the first to
            # start moves the run on from its interruption (a decision is refused after
            # that): the message's decisions for this call's siblings are taken with it
            brought = {**_confirmations(tool_context.session, c), call_id: given}
            for decided, answer in brought.items():  # every check before any record
                _check_fingerprint(c, decided, answer)
            for decided, answer in brought.items():
                if answer.confirmed:
                    c.approve(decided, fingerprint=c.fingerprint(decided),
                              by="adk:confirmation")
                else:
                    c.reject(decided, REJECTED, fingerprint=c.fingerprint(decided),
                             by="adk:confirmation")
            c.flush()  # the decisions are durable before anything acts on them
            if given.confirmed:
                return None
            answered(c, call_id)  # answered with its rejection, never run
            return {"error": REJECTED}
        _check_fingerprint(c, call_id, given)
        recorded = [d.kind for d in view.decisions if d.kind in ("approved", "rejected")]
        if recorded and (recorded[-1] == "approved") != bool(given.confirmed):
            raise InvalidTransition(
                f"call {call_id!r} was already decided otherwise (by the operator or an "
                "earlier confirmation): nothing was recorded", run_id=c.run_id,
                step=c.step, action="approve")
        return None

    async def before_model_callback(self, *, callback_context: Any,
                                    llm_request: Any) -> None:
        """The model request is an effect (DESIGN §7.2): an attempt another process
        claimed the run from since it held it asks nothing (`ConcurrencyConflict`). A
        result the ledger still buffers is made durable first (`flush_results`: the
        model's answer is the longest wait of a turn, and a crash in it must leave the
        call completed, not in doubt); else the claim is only checked (no write)."""
        with self._lock:
            c = self._runs.get(self.run_id_of(callback_context.session))
            if c is not None:
                c.flush_results()

    async def after_tool_callback(self, *, tool: BaseTool, tool_args: dict[str, Any],
                                  tool_context: Any,
                                  result: dict[str, Any]) -> dict[str, Any] | None:
        """The result ADK will use, recorded: ADK's own chain after this plugin (the
        ``after_tool_callback`` of the plugins after it, then the agent's own) is run
        here, once, and what it made of the body's output is what the ledger keeps and
        what ADK is given (so nothing runs the chain again, and a resend is the same).
        A call the ledger answered from its record is answered as it is; a call of a tool
        the agent does not have that another before-tool callback answered: `_unknown`."""
        call_id = tool_context.function_call_id
        run_id = self.run_id_of(tool_context.session)
        with self._lock:
            c = self._runs.get(run_id)
            if self._answered.pop((run_id, call_id), None) is not None:
                return result  # the ledger's word, already what ADK made of the call
            unbegun = c is not None and c.phase(call_id) is Phase.APPROVED
        if unbegun:  # another before-tool callback answered a call ADK could not look up
            assert c is not None
            return await self._unknown(c, "after_tool_callback", tool=tool,
                                       tool_args=tool_args, tool_context=tool_context,
                                       result=result)
        with self._lock:
            if c is not None:  # (a later error callback answered it)
                self._raised.pop((run_id, call_id), None)
            if c is None or call_id not in c.in_flight:
                return None  # not the ledger's (ADK's set_model_response)
            self._reset(run_id, call_id)
            if call_id in (tool_context.actions.requested_tool_confirmations or {}):
                # the body asked for its confirmation: ADK runs it again once confirmed
                c.tool_interrupted(call_id)
                c.resolve_in_doubt(call_id, outcome=Resolution.NOT_EXECUTED,
                                   by="adk:request_confirmation")
                c.flush()
                return None
        try:  # nothing awaited under the lock
            made = await self._rest_of_chain(
                "after_tool_callback", tool=tool, tool_args=tool_args,
                tool_context=tool_context, result=result)
        except BaseException:  # no result ADK uses: the effect may have happened
            with self._lock:
                interrupted(c, call_id)
            raise
        used = result if made is None else made
        with self._lock:
            kept, recorded = record_result(c, call_id, plain(used, fallback=_as_text))
            try:  # flushed at once: a crash before ADK's append then finds the call
                c.flush()  # completed
            except ConcurrencyConflict:  # superseded: the copy stays held, and refuses
                raise  # (the session service fences this attempt's writes with it)
            except BaseException:  # not durable: the call is in doubt on the next load
                self._runs.pop(c.run_id, None)
                raise
            if not kept:
                return {"error": error_text(recorded)}
            if tool.is_long_running and not used:
                return {}  # as ADK alone: no response yet (the client sends it later)
            return self._answer(c, call_id)

    async def on_tool_error_callback(self, *, tool: BaseTool, tool_args: dict[str, Any],
                                     tool_context: Any,
                                     error: BaseException) -> dict[str, Any] | None:
        """A body that raised: noted, and left to ADK, which runs its chain after this
        plugin (the plugins after it, then the agent's ``on_tool_error_callback``) once. An
        answer it makes goes through the after-tool callbacks, where `after_tool_callback`
        records what ADK used; else ADK raises the error, and `_errors_escaped` records it
        as the call's result (running the chain here to learn its answer would have ADK
        run it a second time when it answers nothing). Not so for a call of a tool the
        agent does not have (no body ran, and ADK runs no after-tool callback on it):
        `_unknown` records what ADK uses here."""
        call_id = tool_context.function_call_id
        with self._lock:
            c = self._runs.get(self.run_id_of(tool_context.session))
            if c is None:
                return None
            unbegun = c.phase(call_id) is Phase.APPROVED  # ADK's lookup error: no body
            if call_id not in c.in_flight and not (unbegun and isinstance(error, Exception)):
                return None
        if unbegun:
            return await self._unknown(c, "on_tool_error_callback", tool=tool,
                                       tool_args=tool_args, tool_context=tool_context,
                                       error=error)
        with self._lock:
            if not isinstance(error, Exception):  # cancelled: the effect may have happened
                self._raised.pop((c.run_id, call_id), None)
                self._reset(c.run_id, call_id)
                interrupted(c, call_id)
                return None
            self._raised[(c.run_id, call_id)] = error
        return None

    async def on_agent_error_callback(self, *, agent: Any, callback_context: Any,
                                      error: Exception) -> None:
        """An error escaped the agent: `_errors_escaped`."""
        self._errors_escaped(self.run_id_of(callback_context.session))

    async def on_run_error_callback(self, *, invocation_context: Any,
                                    error: Exception) -> None:
        """An error escaped the run (where no agent's error callback came first):
        `_errors_escaped`."""
        self._errors_escaped(self.run_id_of(invocation_context.session))

    def _errors_escaped(self, run_id: str) -> None:
        """Each body of run ``run_id`` that raised and that no error callback answered
        (ADK raised its error, as alone): its error recorded as the call's result and
        made durable."""
        with self._lock:
            escaped = self._take_raised(run_id)
            c = self._runs.get(run_id)
            if c is None or not escaped:
                return
            for call_id, error in escaped:
                self._reset(run_id, call_id)
                if call_id in c.in_flight:
                    record_result(c, call_id, {"error": f"{type(error).__name__}: {error}"})
            with contextlib.suppress(ControlError):
                c.flush()

    def _take_raised(self, run_id: str) -> list[tuple[str, Exception]]:
        """The call ids and errors `_raised` notes for run ``run_id``, taken out of it."""
        taken = [(call_id, error) for (run, call_id), error in self._raised.items()
                 if run == run_id]
        for call_id, _ in taken:
            del self._raised[(run_id, call_id)]
        return taken

    async def _unknown(self, c: RunController, name: str,
                       **options: Any) -> dict[str, Any] | None:
        """A call of a tool the agent does not have, which ``before_tool_callback`` left
        unbegun (no body to run): ADK answers it through its lookup error (the
        ``on_tool_error_callback`` chain, ``name``), or with the answer of a before-tool
        callback after this plugin (then the ``after_tool_callback`` chain), and runs no
        other callback of this plugin on it. ADK's chain after this plugin is run here,
        and what ADK uses (what the chain made; else ADK's own not-found response, or the
        before-tool answer) is recorded as the call's result, begun and completed at once
        (nothing runs in between) and flushed, and given to ADK in its recorded form,
        which a resend gives again."""
        tool, tool_context = options["tool"], options["tool_context"]
        call_id = str(tool_context.function_call_id)
        invocation = tool_context._invocation_context
        tools = {t.name: t for t in await invocation.agent.canonical_tools(
            ReadonlyContext(invocation))}
        if tool.name in tools:
            return None  # not a call ADK could not look up: left to ADK
        made = await self._rest_of_chain(name, **options)  # raised: nothing begun or ran
        if made is not None:
            used = made
        elif name == "after_tool_callback":
            used = options["result"]
        else:
            used = build_tool_not_found_response(tool.name, tools)
        with self._lock:
            done, _ = begin_call(c, call_id, _arguments(options["tool_args"]))
            if not done:
                kept, recorded = record_result(c, call_id, plain(used, fallback=_as_text))
                try:
                    c.flush()
                except ConcurrencyConflict:
                    raise
                except BaseException:  # nothing of it durable: a reload finds it unbegun
                    self._runs.pop(c.run_id, None)
                    raise
                if not kept:
                    return {"error": error_text(recorded)}
            return self._answer(c, call_id)

    async def _rest_of_chain(self, name: str, **options: Any) -> Any:
        """What ADK would run after this plugin's callback ``name`` returned None: the
        same callback of each plugin after it, then the agent's own callbacks (ADK's
        ``tool_response``/``args`` naming, sync or async), up to the first that returns
        a value (None when none does)."""
        invocation = options["tool_context"]._invocation_context
        plugins = list(invocation.plugin_manager.plugins)
        after = next((plugins[n + 1:] for n, p in enumerate(plugins) if p is self), [])
        for plugin in after:
            made = await getattr(plugin, name)(**options)
            if made is not None:
                return made
        agent = invocation.agent
        own = (agent.canonical_after_tool_callbacks if name == "after_tool_callback"
               else agent.canonical_on_tool_error_callbacks)
        if not own:
            return None
        agent_options = {"tool": options["tool"], "args": options["tool_args"],
                         "tool_context": options["tool_context"]}
        if name == "after_tool_callback":
            agent_options["tool_response"] = options["result"]
        else:
            agent_options["error"] = options["error"]
        return await _run_callbacks(own, _stop_on_non_none, **agent_options)

    async def on_event_callback(self, *, invocation_context: Any,
                                event: Any) -> Any:
        """Before ADK hands the session service an event (an external write) carrying
        function responses: `_stage`. Nothing else, and only when the service's appends
        are this plugin's publications."""
        if self.publishes_to is None or event.partial or not _response_ids(event):
            return None
        session = invocation_context.session
        with self._lock:
            c = self._runs.get(self.run_id_of(session))
            if c is not None:
                self._stage(c, event, [_event_json(e) for e in session.events])
        return None

    def _stage(self, c: RunController, event: Any, history: list[JSON]) -> bool:
        """Before ``event``, which carries function responses, is written: when it answers
        every call whose result the ledger holds unpublished (`OneWriterSessionService.
        _publishable`), staged as their publication against ``history`` (the session's
        events); what the ledger buffered flushed with it either way. Whether it
        staged."""
        answered = OneWriterSessionService._publishable(c, event)
        if answered:
            c.stage_publication([_event_json(event)], history, call_ids=answered,
                                whole=True)
            self._staged[c.run_id] = event.id
        c.flush()  # the results (and their envelope) are durable before the write
        return bool(answered)

    def _unstage(self, session: Any, event: Any, error: BaseException) -> None:
        """The append of a staged event was refused before anything was written: its
        attempt ended (`publication_failed`); the next run of the session reconciles."""
        with self._lock:
            c = self._runs.get(self.run_id_of(session))
            if c is not None and self._staged.get(c.run_id) == event.id:
                del self._staged[c.run_id]
                if c.holds_attempt:
                    with contextlib.suppress(ControlError):
                        c.publication_failed(error)
                        c.flush()

    def _reset(self, run_id: str, call_id: str) -> None:
        token = self._bodies.pop((run_id, call_id), None)
        if token is not None:
            with contextlib.suppress(ValueError):  # entered in another context
                left(token)


# ---------------------------------------------------------------- the session service


def _event_json(event: Any) -> JSON:
    return plain(json.loads(event.model_dump_json(exclude_none=True)), fallback=_as_text)


def _response_ids(event: Any) -> list[str]:
    return [str(r.id) for r in event.get_function_responses() if r.id]


async def _appended(service: BaseSessionService, session: Any, event: Any) -> Any:
    """``service.append_event(session, event)``; the service's own refusal of a stale
    session copy (ADK's ``StaleSessionError``: another process appended since this one
    read the session) is `ConcurrencyConflict`, as `OneWriterSessionService`'s check
    would say."""
    try:
        return await service.append_event(session, event)
    except StaleSessionError as stale:
        raise ConcurrencyConflict(
            f"session {session.id!r} moved on: the session service found that another "
            "runner appended since this one read it; nothing was written",
            action="append_event") from stale


_LAST_EVENT = (
    "SELECT EXISTS (SELECT 1 FROM sessions WHERE app_name = ? AND user_id = ? AND id = ?), "
    "(SELECT id FROM events WHERE app_name = ? AND user_id = ? AND session_id = ? "
    "ORDER BY timestamp DESC, rowid DESC LIMIT 1)")
"""Whether an ADK ``SqliteSessionService`` holds a session, and the id of its last event
(``get_session``'s last, in its own order: by timestamp, ties in the order appended)."""


def _same_file(service: BaseSessionService, store: EventStore) -> bool:
    """Whether ADK's ``SqliteSessionService`` keeps its sessions in the file of
    ``store``, a `SQLiteEventStore`."""
    path = getattr(service, "_db_connect_path", None)
    if (not isinstance(service, SqliteSessionService) or not isinstance(store, SQLiteEventStore)
            or getattr(service, "_db_connect_uri", True) is not False
            or not isinstance(path, str)):
        return False
    return same_file(path, store.path)


class _LastEvent:
    """What `OneWriterSessionService` checks before each append, read in one statement:
    whether the session is stored and the id of its last event, for an ADK
    ``SqliteSessionService`` on a file that reads as ADK's own does (``get_session``,
    its connections and its session ids unchanged by a subclass). ADK's ``get_session``
    opens a connection (and its thread) and decodes every event, about 2 ms, four times
    in a one-tool turn; this reads through one read-only connection of its own, on the
    file the path names when it reads (one is reopened when the path names another, as
    a file replaced, or a relative path after a change of directory). None when it
    cannot tell at once (a database in memory or named by URI, a session id ADK would
    strip, a file not made yet or locked by a writer: it never waits, on the event
    loop, for another connection's lock; a schema that is not the one it knows, any
    SQLite error): then the service is asked, as before."""

    _READS_AS_ADK = ("get_session", "_get_db_connection", "_resolve_session_id")

    def __init__(self, service: BaseSessionService) -> None:
        self.path: str | None = None
        if (isinstance(service, SqliteSessionService)
                and all(getattr(type(service), name, None)
                        is getattr(SqliteSessionService, name) for name in self._READS_AS_ADK)
                and getattr(service, "_db_connect_uri", True) is False
                and getattr(service, "_db_path", "") not in ("", ":memory:")):
            self.path = str(service._db_connect_path)
        self._conn: sqlite3.Connection | None = None
        self._file: tuple[str, int, int] | None = None  # (path, device, inode) it reads
        self._lock = threading.Lock()  # (a runner's loop may run in a thread of its own)

    def read(self, session: Any) -> tuple[bool, str | None] | None:
        """``(stored, last event id or None)`` for ``session``; None: ask the service."""
        app, user, key = session.app_name, session.user_id, session.id
        if self.path is None or key != key.strip():  # (ADK looks a padded id up twice)
            return None
        with self._lock:
            try:
                where = os.path.abspath(self.path)
                found = os.stat(where)
                file = (where, found.st_dev, found.st_ino)
                if self._conn is None or self._file != file:
                    self.close()
                    self._conn = connect_readonly(where, timeout=0.0, immutable=False)
                    self._file = file
                # (fetchall: the statement ends, so no read lock outlives it)
                [(stored, last)] = self._conn.execute(
                    _LAST_EVENT, (app, user, key, app, user, key)).fetchall()
            except (OSError, sqlite3.Error, ValueError):
                self.close()
                return None
        if last is not None and type(last) is not str:
            return None
        return bool(stored), last

    def close(self) -> None:
        conn, self._conn, self._file = self._conn, None, None
        if conn is not None:
            conn.close()


class OneWriterSessionService(BaseSessionService):
    """Any ADK session service with one writer per session: an ``append_event`` made on
    a session copy whose last event is not the stored session's last event (another
    runner appended since this one read the session) is refused with
    `ConcurrencyConflict`, nothing written. In this process the check and the write are
    one step (a lock per session); across processes they are two, and the tool ledger is
    what keeps the tools at most once there.

    With ``plugin=`` (the runner's `LedgerPlugin`), the event carrying function responses
    whose results the ledger has not published is that batch's staged publication."""

    def __init__(self, service: BaseSessionService, *,
                 plugin: LedgerPlugin | None = None) -> None:
        if plugin is not None and _same_file(service, plugin.store):
            raise UnsupportedFeature(
                "ADK's SqliteSessionService and the ledger's SQLiteEventStore on one file: "
                "both keep a table named events, and neither can read the other's; give "
                "the ledger's store a file of its own", feature="the ledger's store in "
                "the session service's file", action="open")
        self.service = service
        self.plugin = plugin
        self._locks: dict[tuple[str, str, str], asyncio.Lock] = {}
        self._last_event = _LastEvent(service)
        if plugin is not None:
            plugin.publishes_to = self

    async def create_session(self, **options: Any) -> Any:
        return await self.service.create_session(**options)

    async def get_session(self, **options: Any) -> Any:
        return await self.service.get_session(**options)

    async def list_sessions(self, **options: Any) -> Any:
        return await self.service.list_sessions(**options)

    async def delete_session(self, **options: Any) -> None:
        await self.service.delete_session(**options)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.service, name)

    async def close(self) -> None:
        """Close the connection the check before each append reads through, then the
        service, when it has a ``close``."""
        self._last_event.close()
        close = getattr(self.service, "close", None)
        if close is not None:
            closed = close()
            if inspect.isawaitable(closed):
                await closed

    async def append_event(self, session: Any, event: Any) -> Any:
        if getattr(event, "partial", False):
            return await self.service.append_event(session, event)
        key = (session.app_name, session.user_id, session.id)
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            try:
                self._fence(session, event)
                stored = await self._stored(session, event)
            except ConcurrencyConflict as refused:
                if self.plugin is not None:
                    self.plugin._unstage(session, event, refused)
                raise
            if stored is not None and stored is not session:
                theirs = stored.events[-1].id if stored.events else None
                ours = session.events[-1].id if session.events else None
                if theirs != ours and not any(e.id == event.id for e in stored.events):
                    moved = ConcurrencyConflict(
                        f"session {session.id!r} moved on: this writer read it up to event "
                        f"{ours!r}, and its latest is {theirs!r} (another runner appended "
                        "first); nothing was written", action="append_event")
                    if self.plugin is not None:
                        self.plugin._unstage(session, event, moved)
                    raise moved
            if self.plugin is None:
                return await self._write(session, event)
            if getattr(event, "author", None) == "user":  # it opens an invocation
                await self.plugin._settle(session, self)
            return await self._publishing(session, event, stored)

    async def _write(self, session: Any, event: Any) -> Any:
        return await _appended(self.service, session, event)

    async def _stored(self, session: Any, event: Any) -> Any:
        """The stored session ``append_event`` checks ``session`` against (None when the
        service holds none), or ``session`` itself when its last event is the stored
        session's last (`_LastEvent`, one statement) and nothing of the stored one is
        needed: `_publishing` stages ``event`` from the stored events only when it
        publishes responses the plugin did not stage when it saw the event."""
        read = None if self._stages_from_stored(session, event) else (
            self._last_event.read(session))  # (not read when the whole session is)
        if read is not None:
            stored, last = read
            if not stored:
                return None
            if last == (session.events[-1].id if session.events else None):
                return session
        return await self.service.get_session(
            app_name=session.app_name, user_id=session.user_id, session_id=session.id)

    def _stages_from_stored(self, session: Any, event: Any) -> bool:
        """Whether `_publishing` would stage ``event`` from the stored events."""
        plugin = self.plugin
        if plugin is None or not _response_ids(event):
            return False
        with plugin._lock:
            c = plugin._runs.get(plugin.run_id_of(session))
            return c is not None and not (c.holds_attempt
                                          and plugin._staged.get(c.run_id) == event.id)

    @staticmethod
    def _publishable(c: RunController, event: Any) -> list[str]:
        """The calls whose results ``event`` publishes: every call whose result the
        ledger holds unpublished, all answered by its function responses (else none: it
        is written as it is), while no publication is unsettled."""
        owed = set(c.unpublished_call_ids())
        answered = [call_id for call_id in _response_ids(event) if call_id in owed]
        if not answered or owed - set(answered) or c.step is Step.UNSETTLED:
            return []
        return answered

    def _fence(self, session: Any, event: Any) -> None:
        """Refuse (`ConcurrencyConflict`, nothing written) an event of an invocation whose
        run another process claimed since this one did: a superseded attempt writes
        nothing to the session, not even the error event ADK appends for the refusal
        that stopped it, so the attempt that superseded it can go on. A user's message
        is not fenced: it opens an invocation, whose ``before_run_callback`` loads the
        run again."""
        plugin = self.plugin
        if plugin is None or getattr(event, "author", None) == "user":
            return
        with plugin._lock:
            held = plugin._runs.get(plugin.run_id_of(session))
            if held is not None:
                held.fence()

    async def _publishing(self, session: Any, event: Any, stored: Any) -> Any:
        """The append of ``event`` as the staged publication of the function responses
        it carries that the ledger holds unpublished (all of them, or it is written as
        it is): staged (durable) before the write, committed after it, recorded failed
        when it raises (the write's own error propagating)."""
        plugin = self.plugin
        assert plugin is not None
        with plugin._lock:  # nothing awaited under it (see before_tool_callback)
            c = plugin._runs.get(plugin.run_id_of(session))
            # staged by the plugin's on_event_callback, or here (an event it did not see)
            staged = c is not None and bool(_response_ids(event)) and (
                (c.holds_attempt and plugin._staged.get(c.run_id) == event.id)
                or plugin._stage(c, event, [_event_json(e) for e in (
                    stored.events if stored is not None else session.events)]))
            if staged:
                assert c is not None
                del plugin._staged[c.run_id]
        if not staged:
            return await self._write(session, event)
        assert c is not None
        try:
            written = await self._write(session, event)
        except Exception as error:
            with plugin._lock, contextlib.suppress(ControlError):  # its error wins (I6)
                c.publication_failed(error)
                c.flush()
            raise
        with plugin._lock:
            c.publication_committed()
            c.flush()
        return written
