"""LangGraph and LangChain agents (PyPI ``langgraph``, ``langchain``) with the control
core's tool ledger underneath (DESIGN §2.4, §6.8, §7.4). Install with
``pip install 'agent-statemachine[langgraph]'`` (tested on langgraph 1.2.x,
langchain 1.5.x, langgraph-checkpoint-sqlite 3.1.x, langgraph-checkpoint-postgres 3.2.x).

Theory of operation
-------------------
LangGraph re-executes a node from its start whenever a thread is resumed from a
checkpoint: after a crash between a tool's effect and the next checkpoint write, after an
``interrupt()``, after a second process resumes the same thread. `ToolLedger` makes the
tool calls of a thread a run of a `RunController` bound to an event store (SQLite or
PostgreSQL), one run per thread (run id ``f"{prefix}{thread_id}"``), and sits at the
seams LangGraph publishes:

=================================  ==========================================================
LangGraph / LangChain seam         what the ledger does
=================================  ==========================================================
``ToolNode(wrap_tool_call=,         keyed by the tool call id: an unknown call's batch (the
awrap_tool_call=)``, or            ``AIMessage`` holding it) is entered in the ledger; its
`LedgerMiddleware` in              start is durable (flushed) before the body runs; the
``create_agent(middleware=)``      result is recorded and flushed before LangGraph sees it. A
(the last of the list)             completed call answers from the ledger (the same
                                   ``ToolMessage`` content, byte for byte), never re-runs; a
                                   started, unfinished call is in doubt (`ToolInDoubt`), and
                                   while one is, no call of the thread runs or is answered
                                   (`ToolInDoubt` names the first in doubt, in this process
                                   as in a new one); a
                                   rejected call answers with its rejection, never runs; a
                                   call awaiting a decision, or asked to run with arguments
                                   other than the ones its approval binds, is refused
                                   (`InvalidTransition`)
`ToolLedger.review` (a graph node) one ``interrupt()`` per batch for the calls of the tools
or `LedgerMiddleware.after_model`  named in ``approvals``: each pending call is shown with its
                                   fingerprint, and each decision of the resume value
                                   (``Command(resume={call_id: decision})``) must carry the
                                   fingerprint of the call it decides (a refused value is
                                   asked again, nothing recorded); an ``edit`` rejects the
                                   call and proposes a new one (``<id>-edit1``) that needs
                                   its own approval, the batch's other calls not yet run
                                   proposed again with it (a handoff skips the old ids);
                                   decisions taken through `statemachine.operator` (or the
                                   CLI) are honoured on the next resume
`OneWriterSaver(saver)`            a checkpoint ``put`` whose parent is not the thread's
                                   latest checkpoint is refused (`ConcurrencyConflict`): of
                                   two resumers of one checkpoint one goes on (across
                                   processes on ``SqliteSaver``, its write lock, and on
                                   ``PostgresSaver`` on one connection, an advisory lock
                                   on the thread in the write's transaction). A step
                                   runs no call before the write LangGraph has in flight
                                   (its default durability writes a step's checkpoint while
                                   the next step runs) ends and leaves the step's
                                   checkpoint the thread's latest (`ConcurrencyConflict`
                                   otherwise: a refused resumer runs no tool; a write
                                   that failed raises its own error, I6). With
                                   ``ledger=``, the ``put`` that adds a batch's
                                   ``ToolMessage`` items is the batch's staged publication (the
                                   graph's messages are the Session): staged durably before
                                   the write, committed after it; after a ``put`` that
                                   raised or a writer that died, the next ``put`` reconciles
                                   it against the thread's latest messages (acknowledged when
                                   it had landed; else LangGraph writes the batch again, the
                                   results answered from the ledger, and that write commits).
                                   With the ledger's `SQLiteEventStore` in ``SqliteSaver``'s
                                   own file, that ``put`` carries the staging and the commit
                                   in its transaction: one commit, all of it or nothing
=================================  ==========================================================

Every attempt on a run that already exists (the first ledger call of a process, or after
another process wrote to the run) records ``claim`` first; the claim rides with the
attempt's first write (a decision, a batch, a tool's start), which lands only on the
version the attempt loaded: of two processes that loaded the same version, one goes on
and the other gets `ConcurrencyConflict` before any tool runs. An attempt that finds
nothing to record (a resume whose decisions another resumer already recorded) writes
nothing, so it never supersedes the resumer that goes on, and the checkpoint it then
writes onto the paused one is refused (`OneWriterSaver`): of two resumers, one goes on.
A run with calls in doubt whose tools have verifiers makes its claim durable at once, and
the verifiers given to the ledger (by tool name, DESIGN §7.3) are asked about them; every
body runs inside its call's `statemachine.tool_context` (its idempotency key).

A tool that raises: with ``handle_tool_errors`` set on the ToolNode, LangGraph turns the
error into an error ``ToolMessage``, which is recorded like any result; otherwise the
error propagates out of the graph (as with LangGraph alone) and is recorded as an error
``ToolMessage`` (LangGraph's own error text), which the next attempt sends the model
instead of running the body again. Only a body that ends without an answer (a kill, a
``BaseException``) leaves its call in doubt.

What it does not carry (refused with `UnsupportedFeature`, naming the feature, before
anything is recorded or run): a tool-call wrapper between the ledger and the body (a
middleware listed after `LedgerMiddleware`: LangChain runs the first of the list as the
outermost, and the ledger must be the innermost); ``ToolRetryMiddleware`` and
``HumanInTheLoopMiddleware`` wherever they sit (refused before the agent's first model
call, and at the tool node; decide calls with `ToolLedger.review`); tool calls without an
id; a ``Send`` of a tool call that no
``AIMessage`` of the state holds (``create_agent``'s own ``Send`` per call is carried: the
call is entered with its batch); tool nodes inside subgraphs (a nested checkpoint
namespace); ``interrupt()`` inside a tool body (LangGraph re-runs the body on resume: the
call is left in doubt, for the operator); a tool declared to return a ``Command`` (its
function's return annotation; one that returns it undeclared is known only after its
body ran, and is recorded as run, the Command not applied, then refused); a graph run
without a thread (no checkpointer, no ``thread_id``) unless the ledger is given a
``run_id``; an async event store; ``durability="exit"`` on a `OneWriterSaver` (no
checkpoint is written before the run ends, so a refused write would be found only after
every tool ran); on a `OneWriterSaver`, a ``ToolNode`` with only the sync
``wrap_tool_call`` run with ``ainvoke`` (LangGraph calls it on the event loop's thread,
where the step's write cannot be waited for). A tool node's ``handle_tool_errors``
(on `ToolLedger.tool_node`, ``create_agent``'s node, or a ``ToolNode`` you build with the
ledger's wrappers, set at its first call) applies to the tools' errors as LangGraph
alone applies it (a callable gets the errors its annotation names), never to the
ledger's refusals nor to the error of a checkpoint write a step waited for: those
propagate. Time travel (resuming from a checkpoint that is not the thread's latest) is refused by
`OneWriterSaver` at its first write (a step before it runs: given the resume value of an
approval's pause, the review); without it, the branch goes on with the ledger's record:
a completed call answers from the cache, a call in doubt is refused. The ledger records
no final output: the checkpointer holds the answer. Without
``OneWriterSaver(..., ledger=)`` (or on a
checkpointer other than LangGraph's ``SqliteSaver``, ``PostgresSaver`` on one psycopg
``Connection`` without a pipeline, and ``InMemorySaver``, refused there: a
``PostgresSaver`` on a connection pool among them) the ledger publishes each batch's
results into a private history once the next batch arrives (bookkeeping that settles
in one append).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import json
import re
import sqlite3
import threading
import time
import typing
import weakref
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from typing import Any, cast

from statemachine.adapters import missing_extra

try:
    import langgraph  # noqa: F401  -- the error names the SDK, not one of its modules
    from langchain.agents.middleware import (
        AgentMiddleware,
        HumanInTheLoopMiddleware,
        ToolRetryMiddleware,
    )
    from langchain_core.messages import AIMessage, BaseMessage, ToolMessage, message_to_dict
    from langgraph.checkpoint.base import BaseCheckpointSaver
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.config import get_config
    from langgraph.errors import GraphBubbleUp
    from langgraph.prebuilt import ToolNode
    from langgraph.prebuilt.tool_node import _infer_handled_types
    from langgraph.types import Command, interrupt
except ModuleNotFoundError as error:  # pragma: no cover - the extra is installed in CI
    raise missing_extra(__name__, "langgraph", error) from error

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
)
from statemachine.controller import RunController
from statemachine.errors import (
    ConcurrencyConflict,
    ControlError,
    InvalidTransition,
    PublicationUnsettled,
    StorageError,
    ToolInDoubt,
)
from statemachine.journal import is_async
from statemachine.payloads import JSON
from statemachine.runner.attempt import interrupted
from statemachine.stores import EventStore, SQLiteEventStore
from statemachine.values import Append, Phase, Resolution, Step, ToolCall
from statemachine.verifiers import Verifier, running_call

__all__ = [
    "InvalidVerifier",
    "LedgerMiddleware",
    "OneWriterSaver",
    "ToolInDoubt",
    "ToolLedger",
    "UnsupportedFeature",
    "decision",
]

ERROR_TEMPLATE = "Error: {error}\n Please fix your mistakes."
"""The text LangGraph's ToolNode sends the model for a tool error it handles (its
``handle_tool_errors=True``): the ledger records a raised error in the same words."""

REJECTED = "The call was rejected and did not run."
"""What the model is told of a rejected call whose rejection gave no message."""

STEP_WAIT = 60.0
"""How long a tool call waits for the write of the checkpoint its step runs from (in
flight under LangGraph's default durability) before it is refused."""

_KEPT_OUTCOMES = 1024
"""How many of its latest writes' outcomes a `OneWriterSaver` keeps (a step asks about
the one just before it)."""


# ------------------------------------------------------------------ plain JSON forms


def _as_text(value: Any, walk: Walk | None) -> JSON:
    """The `plain` fallback: a pydantic model as its JSON form, anything else as text."""
    dump = getattr(value, "model_dump", None)
    if walk is not None and callable(dump):
        return walk(dump(mode="json"))
    return str(value)


def _arguments(call: Mapping[str, Any]) -> JSON:
    return plain(call.get("args") or {}, fallback=_as_text)


def _form(message: ToolMessage) -> JSON:
    """What the ledger keeps of a tool's ``ToolMessage``: its content, status and name
    (and its artifact, as plain JSON), from which the same message is rebuilt."""
    form: dict[str, JSON] = {"content": plain(message.content, fallback=_as_text),
                             "status": message.status, "name": message.name}
    if message.artifact is not None:
        form["artifact"] = plain(message.artifact, fallback=_as_text)
    return form


def _message(c: RunController, call_id: str, call: Mapping[str, Any]) -> ToolMessage:
    """The recorded result of call ``call_id`` as the ``ToolMessage`` LangGraph gets: the
    tool's own (rebuilt from `_form`), an operator's or a verifier's word (``COMPLETED``:
    its output as the content; ``FAILED``: an error message), or a rejection."""
    view = c.call(call_id)
    name = call.get("name") or view.call.name
    if view.phase is Phase.REJECTED or (view.phase is Phase.PUBLISHED and view.decisions
                                        and view.decisions[-1].kind == "rejected"
                                        and view.starts == 0):
        text = REJECTED if view.result is None else error_text(view.result)
        return ToolMessage(content=text, tool_call_id=call_id, name=name, status="error")
    settled = resolution(c, call_id)
    output = view.result
    if settled is Resolution.FAILED:
        return ToolMessage(content=error_text(output), tool_call_id=call_id, name=name,
                           status="error")
    if settled is Resolution.COMPLETED:
        content = output if isinstance(output, str | list) else json.dumps(output)
        return ToolMessage(content=content, tool_call_id=call_id, name=name)
    if not isinstance(output, dict) or "content" not in output:
        # the tool's own result is always a form; anything else is the failure recorded
        # for a result the run could not keep (`record_result`)
        return ToolMessage(content=error_text(output), tool_call_id=call_id, name=name,
                           status="error")
    status = output.get("status")
    return ToolMessage(content=cast("Any", output["content"]), tool_call_id=call_id,
                       name=cast("Any", output.get("name", name)),
                       status="error" if status == "error" else "success",
                       artifact=output.get("artifact"))


def decision(kind: str, fingerprint: str, *, args: Mapping[str, Any] | None = None,
             message: str | None = None) -> dict[str, Any]:
    """One decision of a resume value (``Command(resume={call_id: decision(...)})``):
    ``kind`` ``"approve"``, ``"reject"`` (``message``: what the model is told) or
    ``"edit"`` (``args``: the arguments of the new call that replaces it, which needs its
    own approval); ``fingerprint`` is the one the interrupt showed for the call."""
    made: dict[str, Any] = {"type": kind, "fingerprint": fingerprint}
    if args is not None:
        made["args"] = dict(args)
    if message is not None:
        made["message"] = message
    return made


# ------------------------------------------------------------------------ the ledger


def _messages_of(state: Any) -> list[BaseMessage]:
    if isinstance(state, list):
        return state
    if isinstance(state, Mapping):
        found = state.get("messages")
    else:
        found = getattr(state, "messages", None)
    return list(found) if isinstance(found, list) else []


class ToolLedger(HeldRuns):
    """The tool calls of LangGraph threads, through one event store (DESIGN §7.4).

    Use it as ``ToolNode(tools, wrap_tool_call=ledger.wrap_tool_call,
    awrap_tool_call=ledger.awrap_tool_call)`` (or `tool_node`), or through `LedgerMiddleware` in
    ``create_agent``; put `review` before the tool node for the tools that need approval.
    The ledger must be the innermost tool-call wrapper (nothing between it and the body,
    which could run the body again under one recorded start); a wrapper around it that
    calls it again is answered from the ledger. ``ToolRetryMiddleware`` and
    ``HumanInTheLoopMiddleware`` are refused wherever they sit (`UnsupportedFeature`,
    before anything runs).

    ``store`` is a sync `EventStore` (`SQLiteEventStore`, the PostgreSQL store);
    ``prefix`` makes a thread's run id (``f"{prefix}{thread_id}"``), or ``run_id`` names
    one run for every thread. ``approvals`` names the tools whose calls need a decision,
    ``idempotent`` the tools that may run again after a crash inside them, ``verifiers``
    (by tool name, sync) the tools whose calls in doubt can be asked about. ``owner`` is
    recorded by every claim.

    Refused when built (`InvalidVerifier`, `UnsupportedFeature`): a verifier for no tool
    of ``tools`` (when given) or for an idempotent tool, and an async store."""

    claim_at_open = False  # no hook fences a LangGraph attempt: the claim rides

    def __init__(self, store: EventStore, *, prefix: str = "langgraph:",
                 run_id: str | None = None, approvals: Collection[str] = (),
                 idempotent: Collection[str] = (),
                 verifiers: Mapping[str, Verifier] | None = None,
                 tools: Collection[str] | None = None, owner: str | None = None) -> None:
        if is_async(store):
            raise UnsupportedFeature(
                "an async event store is not carried: LangGraph's ToolNode runs a sync "
                "wrapper on worker threads; use the sync store of the same database",
                feature="async event stores", run_id=run_id, action="open")
        named = set(tools) if tools is not None else set(verifiers or ())
        self.verifiers = checked_verifiers(verifiers, named, idempotent=idempotent,
                                           run_id=run_id, sync_only="a sync verifier")
        self.store = store
        self.prefix = prefix
        self.run_id = run_id
        self.approvals = frozenset(approvals)
        self.idempotent = frozenset(idempotent)
        self.owner = owner
        self._lock = threading.RLock()
        self._runs: dict[str, RunController] = {}
        self._checked: weakref.WeakSet[ToolNode] = weakref.WeakSet()
        """The tool nodes that passed `_check_tool_node` (a node's tools and wrappers do
        not change once it is built)."""
        self.publishes_to: OneWriterSaver | None = None
        """The checkpointer whose writes are this ledger's publications (set by
        ``OneWriterSaver(saver, ledger=...)``); None: a private history."""

    # ------------------------------------------------------------------ the runs

    def run_id_of(self, config: Mapping[str, Any] | None) -> str:
        """The run id of the thread ``config`` names (LangGraph's ``thread_id``)."""
        if self.run_id is not None:
            return self.run_id
        configurable = (config or {}).get("configurable") or {}
        thread = configurable.get("thread_id")
        if thread is None:
            raise UnsupportedFeature(
                "a graph run without a thread_id (no checkpointer, or no "
                "config={'configurable': {'thread_id': ...}}) has no run to ledger: give "
                "the ledger a run_id, or run the graph on a thread",
                feature="graphs without a thread", action="open")
        return f"{self.prefix}{thread}"


    # ------------------------------------------------------------------- batches

    def _batch(self, state: Any, call_id: str) -> list[Mapping[str, Any]]:
        """The tool calls of the ``AIMessage`` that holds call ``call_id``."""
        for message in reversed(_messages_of(state)):
            if isinstance(message, AIMessage) and any(
                    call.get("id") == call_id for call in message.tool_calls):
                return list(message.tool_calls)
        return []

    def _enter(self, c: RunController, calls: Sequence[Mapping[str, Any]], *,
               flush: bool = True) -> None:
        """Enter a batch of calls the ledger has not seen, as one model response: the
        results of the batch before it published first (each batch's results are in the
        graph's messages by the time the model proposed the next one). ``flush=False``:
        the batch rides with the caller's next flush (a tool's start, which follows it
        at once)."""
        ids = [call.get("id") for call in calls]
        if any(not isinstance(call_id, str) or not call_id for call_id in ids):
            raise UnsupportedFeature(
                "a tool call without an id cannot be keyed in the ledger (the model or a "
                "middleware made it): nothing ran", feature="tool calls without ids",
                run_id=c.run_id, step=c.step, action="begin_tool")
        if len(set(ids)) != len(ids):
            raise InvalidTransition(
                "a batch holds the same tool call id twice: nothing ran",
                run_id=c.run_id, step=c.step, action="model_responded")
        known = [call_id for call_id in ids if c.phase(cast("str", call_id)) is not None]
        if known:
            if len(known) == len(ids):
                return
            raise InvalidTransition(
                f"a batch reuses call id(s) {known!r} the ledger already holds beside new "
                "ones: nothing ran", run_id=c.run_id, step=c.step, action="model_responded")
        self._settle(c)
        if c.in_doubt():
            c.resume()  # ToolInDoubt: a call of an earlier batch never finished
        self._publish_owed(c)
        c.begin_model_call()
        c.model_responded([
            ToolCall(cast("str", call["id"]), str(call.get("name")), _arguments(call),
                     needs_approval=call.get("name") in self.approvals,
                     idempotent=call.get("name") in self.idempotent)
            for call in calls])
        if flush:
            c.flush()

    def _settle(self, c: RunController) -> None:
        """A run a process left ``UNSETTLED`` (an older log): the ledger's private history
        is rebuilt empty in each process, so no write of the dead attempt can land
        anywhere, and taking it over is safe."""
        if c.step is not Step.UNSETTLED or self.publishes_to is not None:
            return  # a checkpoint's write is reconciled by the next write (OneWriterSaver)
        if isinstance(c.reconcile([], c.session_id, take_over=True), Append):
            c.publication_committed()
        c.flush()

    def _publish_owed(self, c: RunController) -> None:
        """Publish the recorded results (and rejections) of the earlier batch, staged and
        committed in one append: the graph's checkpoint holds the messages themselves."""
        owed = list(c.unpublished_call_ids())
        if c.step in (Step.TOOLS, Step.INTERRUPTION) and owed:
            items: list[JSON] = [{"type": "tool", "tool_call_id": call_id,
                                  "result": c.call(call_id).result} for call_id in owed]
            c.stage_publication(items, [], call_ids=owed, whole=True)
            c.publication_committed()
        if c.step in (Step.TOOLS, Step.INTERRUPTION):
            raise InvalidTransition(
                "the graph moved on to a new batch while calls of the earlier one never "
                "ran (approved, not started): nothing ran", run_id=c.run_id, step=c.step,
                action="begin_model_call")

    # -------------------------------------------------------------- one tool call

    def _where(self, request: Any) -> tuple[str, str, Mapping[str, Any]]:
        call = request.tool_call
        call_id = call.get("id")
        config = getattr(getattr(request, "runtime", None), "config", None) or {}
        run_id = self.run_id_of(config)
        if not isinstance(call_id, str) or not call_id:
            raise UnsupportedFeature(
                "a tool call without an id cannot be keyed in the ledger: it did not run",
                feature="tool calls without ids", run_id=run_id, action="begin_tool")
        configurable = config.get("configurable") or {}
        if "|" in str(configurable.get("checkpoint_ns") or ""):  # a task of a subgraph
            raise UnsupportedFeature(
                "a tool node inside a subgraph is not carried (its checkpoints live in "
                "their own namespace, which the ledger does not follow): the call did not "
                "run", feature="subgraphs with their own tool nodes", run_id=run_id,
                action="begin_tool")
        return run_id, call_id, call

    def _before(self, request: Any) -> tuple[RunController, str, Mapping[str, Any],
                                             ToolMessage | None]:
        """Under the lock: the call entered, and its recorded answer (the body must not
        run) or its start made durable (None: run the body now)."""
        run_id, call_id, call = self._where(request)
        with self._lock:
            c = self.controller(run_id)
            if c.in_doubt():
                # as a process loading the run refuses it (`HeldRuns._open`): no call
                # runs, nor is answered, beside a call in doubt; ToolInDoubt names the
                # first of them, whichever call LangGraph's threads bring first
                c.resume()
            entered = False
            if c.phase(call_id) is None:
                batch = self._batch(request.state, call_id)
                if not batch:
                    raise UnsupportedFeature(
                        f"call {call_id!r} is in no AIMessage of the state the tool node "
                        "was given (a Send of a tool call made outside the model's reply, "
                        "or a state without its messages): it cannot be entered with its "
                        "batch; it did not run", feature="Send fan-out of calls outside "
                        "the model's reply", run_id=run_id, action="begin_tool")
                # the batch rides with the start's flush below: one write before the
                # body, not two (elsewhere it is flushed as it was on its own)
                self._enter(c, batch, flush=False)
                entered = True
            phase = c.phase(call_id)
            try:
                if phase in (Phase.REJECTED, Phase.COMPLETED, Phase.PUBLISHED):
                    refuse_other_arguments(c, call_id, _arguments(call))
                    answered(c, call_id)
                    done = True
                else:
                    done, _ = begin_call(c, call_id, _arguments(call))
            except BaseException as refused:
                if entered:  # the batch durable all the same, as a caller sees it
                    try:
                        c.flush()
                    except BaseException as failed:  # its own write's error is raised
                        self._runs.pop(run_id, None)  # (the next attempt loads again)
                        raise failed from refused
                raise
            if done:
                if entered:
                    c.flush()
                return c, call_id, call, _message(c, call_id, call)
            try:
                c.flush()  # an effect boundary: the start is durable before the body
            except BaseException:
                self._runs.pop(run_id, None)
                raise
            return c, call_id, call, None

    def _after(self, c: RunController, call_id: str, call: Mapping[str, Any],
               result: Any) -> Any:
        with self._lock:
            if not isinstance(result, ToolMessage):
                # known only now, its effect done: recorded as what happened (the body
                # ran, its Command was not applied), so it is answered, never run again
                text = (f"the tool ran, and returned a {type(result).__name__} (not a "
                        "ToolMessage), which was not applied: this adapter does not carry "
                        "a tool's Command")
                record_result(c, call_id, {"content": ERROR_TEMPLATE.format(error=text),
                                           "status": "error", "name": call.get("name")})
                c.flush()
                raise UnsupportedFeature(
                    f"call {call_id!r}: {text}; it is recorded as run, with this text for "
                    "the model (declare the tool's return type, -> Command, to have it "
                    "refused before it runs)", feature="tools returning Command",
                    run_id=c.run_id, step=c.step, action="tool_completed")
            kept, _ = record_result(c, call_id, _form(result))
            try:
                c.flush()  # the result is durable before LangGraph checkpoints it
            except BaseException:  # not durable: the call is in doubt on the next load
                self._runs.pop(c.run_id, None)
                raise
            return result if kept else _message(c, call_id, call)

    def _raised(self, c: RunController, call_id: str, call: Mapping[str, Any],
                error: BaseException) -> BaseException:
        """What to raise for a body that raised ``error``; records what it means."""
        with self._lock:
            if isinstance(error, GraphBubbleUp):
                interrupted(c, call_id)
                c.flush()
                return UnsupportedFeature(
                    f"call {call_id!r} called interrupt() inside its body, which LangGraph "
                    "runs again from its start on resume: it is left in doubt; decide "
                    "calls with ToolLedger.review instead, and settle this one with "
                    "statemachine.operator.resolve", feature="interrupt() inside a tool",
                    run_id=c.run_id, step=c.step, action="tool_completed")
            if isinstance(error, Exception):
                record_result(c, call_id, {
                    "content": ERROR_TEMPLATE.format(error=repr(error)), "status": "error",
                    "name": call.get("name")})
                with contextlib.suppress(ControlError):
                    c.flush()
                return error
            interrupted(c, call_id)
            return error

    @staticmethod
    def _step_of(request: Any) -> tuple[OneWriterSaver, Mapping[str, Any], str] | None:
        """The `OneWriterSaver` checkpointing the graph a call runs in, the step's config
        and the checkpoint the step runs from; None on another checkpointer (or outside a
        graph step). ``durability="exit"`` on a `OneWriterSaver` is refused."""
        config = getattr(getattr(request, "runtime", None), "config", None) or {}
        configurable = config.get("configurable") or {}
        saver = configurable.get("__pregel_checkpointer")
        if not isinstance(saver, OneWriterSaver):
            return None
        _refuse_exit(configurable)
        step = (configurable.get("checkpoint_map") or {}).get("")
        return (saver, configurable, step) if isinstance(step, str) else None

    def _in_step(self, request: Any) -> None:
        """Before anything of a call on a thread a `OneWriterSaver` checkpoints: the
        write LangGraph has in flight (the step's checkpoint, under its default
        durability) ended, its error raised (the saver's refusal among them), and the
        step's checkpoint the thread's latest (`OneWriterSaver.check_step`)."""
        found = self._step_of(request)
        if found is None:
            return
        saver, configurable, step = found
        if _on_event_loop():
            raise UnsupportedFeature(
                "a sync wrap_tool_call on the event loop's thread (a ToolNode without "
                "awrap_tool_call, run with ainvoke or astream) cannot wait for the step's "
                "checkpoint write, which that loop makes, nor read an async saver: give the "
                "ToolNode awrap_tool_call=ledger.awrap_tool_call too (ToolLedger.tool_node "
                "does); nothing ran", feature="a sync tool-call wrapper on the async path "
                "with OneWriterSaver", action="begin_tool")
        pending = _write_in_flight(configurable)
        waited = isinstance(pending, concurrent.futures.Future)
        try:
            if waited:
                with contextlib.suppress(concurrent.futures.TimeoutError,  # refused below
                                         concurrent.futures.CancelledError):  # (not written)
                    pending.result(timeout=STEP_WAIT)
            saver.check_step(configurable.get("thread_id"), step,
                             timeout=0 if waited else STEP_WAIT)
        except Exception as error:
            _not_the_tools(error)  # the write's own error, or a refusal
            raise

    async def _ain_step(self, request: Any) -> None:
        """`_in_step` on the event loop: LangGraph's write waited for without cancelling
        it when this call is cancelled, and the saver read through its async methods (an
        async saver's sync ones hand their work back to this loop)."""
        found = self._step_of(request)
        if found is None:
            return
        saver, configurable, step = found
        pending = _write_in_flight(configurable)
        waited = isinstance(pending, asyncio.Future | concurrent.futures.Future)
        try:
            if waited:
                ending = pending if isinstance(pending, asyncio.Future) \
                    else asyncio.wrap_future(pending)
                try:  # shielded: a cancelled call leaves LangGraph's write alone
                    await asyncio.wait_for(asyncio.shield(ending), STEP_WAIT)
                except TimeoutError:
                    pass  # refused below
                except asyncio.CancelledError:
                    task = asyncio.current_task()
                    if not ending.cancelled() or (task is not None and task.cancelling()):
                        raise  # this call is cancelled, not the write
                    # the write was cancelled: it never lands, and is refused below
            await saver.acheck_step(configurable.get("thread_id"), step,
                                    timeout=0 if waited else STEP_WAIT)
        except Exception as error:
            _not_the_tools(error)  # the write's own error, or a refusal
            raise

    def wrap_tool_call(self, request: Any, handler: Callable[[Any], Any]) -> Any:
        """LangGraph's ``ToolNode(wrap_tool_call=)``: one call through the ledger."""
        _check_placement(handler, self)
        self._in_step(request)
        c, call_id, call, answer = self._before(request)
        if answer is not None:
            return answer
        try:
            with running_call(c, call_id):
                result = handler(request)
        except BaseException as error:
            raised = self._raised(c, call_id, call, error)
            if raised is error:
                raise
            raise raised from error
        return self._after(c, call_id, call, result)

    async def awrap_tool_call(self, request: Any,
                              handler: Callable[[Any], Awaitable[Any]]) -> Any:
        """LangGraph's ``ToolNode(awrap_tool_call=)``: one call through the ledger."""
        _check_placement(handler, self)
        await self._ain_step(request)
        c, call_id, call, answer = self._before(request)
        if answer is not None:
            return answer
        try:
            with running_call(c, call_id):
                result = await handler(request)
        except BaseException as error:
            raised = self._raised(c, call_id, call, error)
            if raised is error:
                raise
            raise raised from error
        return self._after(c, call_id, call, result)

    def tool_node(self, tools: Sequence[Any], **options: Any) -> ToolNode:
        """A ``ToolNode`` over ``tools`` with this ledger's wrappers. Its
        ``handle_tool_errors`` (LangGraph's, default or yours) applies to the tools'
        errors, never to the ledger's refusals (a call in doubt is not turned into a tool
        message the model could answer by calling again). A tool declared to return a
        ``Command`` is refused here (`UnsupportedFeature`), before anything runs."""
        if "wrap_tool_call" in options or "awrap_tool_call" in options:
            raise UnsupportedFeature(
                "tool_node installs the ledger's own wrap_tool_call/awrap_tool_call, the "
                "innermost wrapper; put other wrappers around it (create_agent middleware "
                "before LedgerMiddleware)",
                feature="other tool-call wrappers around the ledger", action="open")
        node = ToolNode(tools, wrap_tool_call=self.wrap_tool_call,
                        awrap_tool_call=self.awrap_tool_call, **options)
        _check_tool_node(node, self)
        return node

    # ------------------------------------------------------------------- decisions

    def review(self, state: Any) -> dict[str, Any] | None:
        """A graph node (or the body of `LedgerMiddleware.after_model`) put between the
        model and the tool node: the last ``AIMessage``'s calls entered in the ledger,
        and one ``interrupt()`` for those awaiting a decision, its value
        ``{"run_id": ..., "pending": [{"call_id", "name", "args", "fingerprint"}, ...]}``.
        Resume with ``Command(resume={call_id: decision(...)})``: every decision is
        checked (the call awaits one, the fingerprint is the call's) before any is
        recorded, and made durable before the graph goes on. A call without a decision in
        the value (or decided through the operator meanwhile) is taken from the ledger;
        one still undecided is asked again. Returns the ``AIMessage`` with each edited
        call replaced by its new call (or None when nothing was edited).

        Refused (`InvalidTransition`, nothing recorded): a fingerprint that is not the
        call's, a decision for a call not awaiting one that contradicts the ledger, an
        unknown decision type."""
        messages = _messages_of(state)
        last = messages[-1] if messages else None
        if not isinstance(last, AIMessage) or not last.tool_calls:
            return None
        run_id = self.run_id_of(get_config())
        with self._lock:
            c = self.controller(run_id)
            self._enter(c, last.tool_calls)
        refused: list[str] = []
        while True:
            with self._lock:
                calls = _current(c, last.tool_calls)
                pending = [call for call in calls
                           if c.phase(call["id"]) is Phase.AWAITING]
                shown = [{"call_id": call["id"], "name": call["name"],
                          "args": _arguments(call), "fingerprint": c.fingerprint(call["id"])}
                         for call in pending]
            if not pending:
                break
            asked: dict[str, Any] = {"run_id": run_id, "pending": shown}
            if refused:
                asked["refused"] = refused
            answer = interrupt(asked)
            with self._lock:
                c = self.controller(run_id)
                try:
                    self._decide(c, calls, answer)
                except InvalidTransition as refusal:  # nothing recorded: asked again
                    refused = [refusal.reason]
                else:
                    refused = []
        if [call["id"] for call in calls] == [call["id"] for call in last.tool_calls]:
            return None
        return {"messages": [last.model_copy(update={"tool_calls": calls})]}

    def _decide(self, c: RunController, calls: list[dict[str, Any]], answer: Any) -> bool:
        """Record the decisions of ``answer`` for ``calls`` (checked first, all of them);
        an edit replaces its call in ``calls`` by a new call awaiting its own approval.
        Whether a call was edited."""
        if not isinstance(answer, Mapping):
            raise InvalidTransition(
                "a resume value must map call ids to decisions (statemachine.adapters."
                "langgraph.decision): nothing was recorded", run_id=c.run_id, step=c.step,
                action="approve")
        planned: list[tuple[str, str, Mapping[str, Any]]] = []
        for call_id, made in answer.items():
            kind = made.get("type") if isinstance(made, Mapping) else None
            if kind not in ("approve", "reject", "edit"):
                raise InvalidTransition(
                    f"the decision for call {call_id!r} is not approve, reject or edit: "
                    "nothing was recorded", run_id=c.run_id, step=c.step, action="approve")
            assert isinstance(made, Mapping)
            if c.phase(call_id) is None:
                raise InvalidTransition(
                    f"a decision names call {call_id!r}, which the ledger does not hold: "
                    "nothing was recorded", run_id=c.run_id, step=c.step, action="approve")
            if made.get("fingerprint") != c.fingerprint(call_id):
                raise InvalidTransition(
                    f"the decision for call {call_id!r} carries a fingerprint that is not "
                    "the call's (it decides other arguments, or another call): nothing was "
                    "recorded", run_id=c.run_id, step=c.step, action="approve")
            if c.phase(call_id) is not Phase.AWAITING:
                if _agrees(c, call_id, kind):
                    continue  # a decision recorded before (a replayed resume value)
                raise InvalidTransition(
                    f"call {call_id!r} was already decided otherwise (in the ledger, by an "
                    "earlier resume or the operator): nothing was recorded",
                    run_id=c.run_id, step=c.step, action="approve")
            if kind == "edit" and not isinstance(made.get("args"), Mapping):
                raise InvalidTransition(
                    f"the edit of call {call_id!r} gives no args: nothing was recorded",
                    run_id=c.run_id, step=c.step, action="approve")
            planned.append((call_id, kind, made))
        edits = {call_id: made for call_id, kind, made in planned if kind == "edit"}
        for call_id, kind, made in planned:
            fingerprint = c.fingerprint(call_id)
            if kind == "approve" and not edits:
                c.approve(call_id, fingerprint=fingerprint)
            elif kind == "reject":
                message = made.get("message")
                c.reject(call_id, message if isinstance(message, str) else REJECTED,
                         fingerprint=fingerprint)
            elif kind == "edit":
                c.reject(call_id, "edited: replaced by a new call that needs its own "
                         "approval", fingerprint=fingerprint)
        if edits:
            self._repropose(c, calls, edits, {call_id for call_id, kind, _ in planned
                                              if kind == "approve"})
        if planned:
            c.flush()  # decisions are durable before anything acts on them
        # else each was recorded before (by the other resumer of the same interrupt, a
        # replayed value, the operator): a flush would append only this attempt's claim,
        # superseding the attempt that recorded them, and then neither would go on (the
        # checkpoint's write decides between two resumers; the claim rides with the next
        # write, the tool's start)
        return bool(edits)

    def _repropose(self, c: RunController, calls: list[dict[str, Any]],
                   edits: Mapping[str, Mapping[str, Any]], approving: set[str]) -> None:
        """An edit is a new proposal: the batch's calls not yet run are overtaken (a
        handoff skips them; none ever runs under its old id) and proposed again under new
        ids, the edited ones with their new arguments and awaiting their own approval; a
        call approved with the same arguments (same fingerprint) keeps its approval.
        ``calls`` is rewritten in place (the ``AIMessage`` the graph goes on with)."""
        approved = {call["id"] for call in calls
                    if c.phase(call["id"]) is Phase.APPROVED
                    and c.call(call["id"]).call.needs_approval} | approving
        c.handoff("edited tool calls: a new proposal")
        owed = list(c.unpublished_call_ids())
        items: list[JSON] = [{"type": "tool", "tool_call_id": call_id,
                              "result": c.call(call_id).result} for call_id in owed]
        c.stage_publication(items, [], call_ids=owed, whole=True)
        c.publication_committed()
        proposed: list[ToolCall] = []
        origin: dict[str, str] = {}
        for index, call in enumerate(calls):
            old = call["id"]
            if c.phase(old) is not Phase.SKIPPED and old not in edits:
                continue  # rejected: answered with its rejection under its own id
            new_id = _successor(old)
            if c.phase(new_id) is not None:
                raise InvalidTransition(
                    f"call {old!r} cannot be proposed again as {new_id!r}, which the ledger "
                    "already holds: nothing was recorded", run_id=c.run_id, step=c.step,
                    action="model_responded")
            args = dict(edits[old]["args"]) if old in edits else call.get("args") or {}
            calls[index] = {**call, "id": new_id, "args": args}
            origin[new_id] = old
            proposed.append(ToolCall(new_id, str(call["name"]), _arguments(calls[index]),
                                     needs_approval=old in edits or call["name"] in
                                     self.approvals,
                                     idempotent=call["name"] in self.idempotent))
        c.begin_model_call()
        c.model_responded(proposed)
        for new in proposed:
            old = origin[new.call_id]
            if new.needs_approval and old in approved and old not in edits:
                c.approve(new.call_id, fingerprint=c.fingerprint(new.call_id))


def _write_in_flight(configurable: Mapping[str, Any]) -> Any:
    """The future of the last checkpoint write LangGraph's loop submitted for the run a
    step belongs to (each write waits for the one before it and is not made after one
    that failed), reached through the step's config as langgraph 1.2 builds it (through
    the guard a node with a timeout policy runs under); None where it cannot be told
    (`OneWriterSaver.check_step` then waits on the saver)."""
    call = configurable.get("__pregel_call")
    for _ in range(8):  # LangGraph's guard around a node with a timeout policy
        if getattr(call, "keywords", None) is not None or not callable(call):
            break
        call = _cells(call).get("call")
    keywords = getattr(call, "keywords", None) or {}
    loop = getattr(keywords.get("schedule_task"), "__self__", None)
    return getattr(loop, "_put_checkpoint_fut", None)


def _on_event_loop() -> bool:
    """Whether this thread runs an event loop (a sync wrapper LangGraph called on it)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _refuse_exit(configurable: Mapping[str, Any]) -> None:
    """`UnsupportedFeature` for a run with ``durability="exit"`` on a `OneWriterSaver`."""
    if configurable.get("__pregel_durability") == "exit":
        raise UnsupportedFeature(
            'durability="exit" writes no checkpoint before the run ends, so a write '
            "OneWriterSaver refuses (another resumer came first, or a fork from an earlier "
            "checkpoint) is found only after every tool of the run ran; run with "
            'durability="sync" or LangGraph\'s default: nothing ran',
            feature='durability="exit" with OneWriterSaver', action="open")


def _agrees(c: RunController, call_id: str, kind: str) -> bool:
    """Whether the ledger's decision of ``call_id`` is the one ``kind`` asks for."""
    view = c.call(call_id)
    recorded = [d.kind for d in view.decisions if d.kind in ("approved", "rejected")]
    if not recorded:
        return False
    if kind == "approve":
        return recorded[-1] == "approved"
    return recorded[-1] == "rejected"


def _successor(call_id: str) -> str:
    """The id under which call ``call_id`` is proposed again after an edit of its batch:
    ``x`` becomes ``x-edit1``, ``x-edit1`` becomes ``x-edit2`` (so a review run again
    from its start finds each call's successor in the ledger)."""
    base, _, number = call_id.rpartition("-edit")
    if base and number.isdigit():
        return f"{base}-edit{int(number) + 1}"
    return f"{call_id}-edit1"


def _current(c: RunController, calls: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``calls`` with each call an edit overtook replaced by its successor, as the ledger
    recorded it (its arguments the edited ones)."""
    current: list[dict[str, Any]] = []
    for call in calls:
        now = dict(call)
        while (c.phase(now["id"]) in (Phase.SKIPPED, Phase.REJECTED, Phase.PUBLISHED)
               and c.phase(_successor(now["id"])) is not None):
            recorded = c.call(_successor(now["id"])).call
            now = {**now, "id": recorded.call_id, "args": recorded.arguments}
        current.append(now)
    return current


# ---------------------------------------------------------- what wraps the ledger

_EXECUTORS = ("ToolNode._run_one.<locals>.", "ToolNode._arun_one.<locals>.")
"""How the functions a ``ToolNode`` hands its wrapper as the handler that runs the tool
body are named (langgraph 1.2: ``execute``, and ``_sync_execute`` for a sync wrapper on
the async path)."""

REFUSED_MIDDLEWARE: tuple[tuple[type[Any], str], ...] = (
    (ToolRetryMiddleware, "the ledger records an error a body raised as the call's "
     "result, so a retry cannot run it again: inside the ledger it would run the body "
     "again under one recorded start, outside it it would only repeat the ledger's answer "
     "or hand the model the ledger's refusal (ToolInDoubt) as a tool message; retry "
     "inside the tool body instead, with its idempotency key (statemachine.tool_context)"),
    (HumanInTheLoopMiddleware, "its decisions are bound to no call's fingerprint, and its "
     "edit runs the reviewer's arguments under the model's call id with no approval of "
     "them (langchain #40166); decide calls with the ledger's own review instead "
     "(ToolLedger(approvals=[...]): LedgerMiddleware.after_model, ToolLedger.review), "
     "where an edit is a new call that needs its own approval"),
)
"""Middleware refused wherever it sits on a ledger's tool node, with why."""


def _cells(function: Any) -> dict[str, Any]:
    """What ``function`` closes over, by name (empty cells left out)."""
    code = getattr(function, "__code__", None)
    closure = getattr(function, "__closure__", None) or ()
    if code is None:
        return {}
    found = {}
    for name, cell in zip(code.co_freevars, closure, strict=False):
        with contextlib.suppress(ValueError):  # an empty cell
            found[name] = cell.cell_contents
    return found


def _executor_node(handler: Any) -> ToolNode | None:
    """The ``ToolNode`` whose own tool-running function ``handler`` is, or None (the
    handler is something else: a wrapper sits between the ledger and the body)."""
    if (getattr(handler, "__module__", None) != ToolNode.__module__
            or not getattr(handler, "__qualname__", "").startswith(_EXECUTORS)):
        return None
    node = _cells(handler).get("self")
    return node if isinstance(node, ToolNode) else None


def _reached(function: Any) -> tuple[list[AgentMiddleware], ToolNode | None]:
    """The middleware ``function`` reaches through its closures (LangChain composes a
    chain of hooks as closures over the middleware's bound methods, each maybe wrapped by
    a tracer: ``__wrapped__``), and the ``ToolNode`` it reaches: the one whose
    tool-running function it calls, or one it closes over (``create_agent``'s model step
    binds the tools of its tool node)."""
    found: list[AgentMiddleware] = []
    node: ToolNode | None = None
    seen: set[int] = set()
    stack = [function]
    while stack:
        part = stack.pop()
        if id(part) in seen:
            continue
        seen.add(id(part))
        if isinstance(getattr(part, "__self__", None), AgentMiddleware):
            found.append(part.__self__)
            continue
        node = node or _executor_node(part)
        if getattr(part, "__wrapped__", None) is not None:
            stack.append(part.__wrapped__)
        for content in _cells(part).values():
            if isinstance(content, ToolNode):
                node = node or content
            elif callable(content):
                stack.append(content)
    return found, node


def _owner(hook: Any) -> Any:
    """Whose ``hook`` is: the middleware (or ledger) of a bound method, through tracers."""
    while getattr(hook, "__wrapped__", None) is not None:
        hook = hook.__wrapped__
    return getattr(hook, "__self__", hook)


def _wrappers(hook: Any) -> list[Any]:
    """The owners of the wrappers LangChain composed into a ToolNode's ``hook``, the
    outermost first (``create_agent`` composes its middleware pairwise, each step
    closing over an ``outer`` and an ``inner``)."""
    owners = []
    while hook is not None:
        cells = _cells(hook)
        if getattr(hook, "__qualname__", "").endswith("compose_two.<locals>.composed") and {
                "outer", "inner"} <= set(cells):
            owners.append(_owner(cells["outer"]))
            hook = cells["inner"]
        else:
            owners.append(_owner(hook))
            hook = None
    return owners


def _check_tool_node(node: ToolNode, ledger: ToolLedger) -> None:
    """Refuse a tool node that carries middleware of `REFUSED_MIDDLEWARE` (wherever it
    sits), a tool-call wrapper inside ``ledger`` (after it in ``create_agent``'s list),
    or a tool declared to return a ``Command``: nothing is recorded or run."""
    if node in ledger._checked:
        return
    for name, candidate in node.tools_by_name.items():
        if _declares_command(candidate):
            raise UnsupportedFeature(
                f"tool {name!r} is declared to return a Command, which updates the graph's "
                "state: the ledger cannot keep it as a call's result, nor answer a call "
                "with it again; return a ToolMessage or a value; nothing ran",
                feature="tools returning Command", action="open")
    for hook in (node._wrap_tool_call, node._awrap_tool_call):
        owners = _wrappers(hook)
        for owner in owners:
            for kind, why in REFUSED_MIDDLEWARE:
                if isinstance(owner, kind):
                    raise UnsupportedFeature(
                        f"{type(owner).__name__} is on the ledger's tool node: {why}; "
                        "nothing ran", feature=kind.__name__, action="open")
        mine = [index for index, owner in enumerate(owners) if owner is ledger or (
            isinstance(owner, LedgerMiddleware) and owner.ledger is ledger)]
        if mine and mine[-1] != len(owners) - 1:
            _refuse_inside([getattr(owner, "__qualname__", type(owner).__name__)
                            for owner in owners[mine[-1] + 1:]])
    if node._handle_tool_errors is not False:  # the ledger's refusals pass through it
        node._handle_tool_errors = _passing_refusals(node._handle_tool_errors)
    ledger._checked.add(node)


def _declares_command(candidate: Any) -> bool:
    """Whether a tool's function (``func``/``coroutine``, or a ``BaseTool`` subclass's
    ``_run``/``_arun``) says it returns a LangGraph ``Command`` (alone, in a union, or in a
    list): its return annotation, resolved, or as text when it cannot be."""
    functions = [getattr(candidate, "func", None), getattr(candidate, "coroutine", None)]
    if not any(functions):
        functions = [getattr(type(candidate), "_run", None),
                     getattr(type(candidate), "_arun", None)]
    for function in functions:
        if function is None:
            continue
        try:
            returned = typing.get_type_hints(function).get("return")
        except Exception:  # a name the annotation cannot resolve: read it as text
            returned = getattr(function, "__annotations__", {}).get("return")
        if _names_command(returned):
            return True
    return False


def _names_command(annotation: Any) -> bool:
    if isinstance(annotation, str):
        return re.search(r"\bCommand\b", annotation) is not None
    if annotation is Command or typing.get_origin(annotation) is Command:
        return True
    return any(_names_command(part) for part in typing.get_args(annotation))


def _refuse_inside(names: Sequence[str]) -> None:
    raise UnsupportedFeature(
        f"{', '.join(sorted(set(names)))} sits between the ledger and the tool body, where "
        "it could run the body again (a retry) or with other arguments under one recorded "
        "start: the ledger must be the innermost tool-call wrapper, the last of "
        "create_agent(middleware=[...]) (LangChain runs the first as the outermost); "
        "nothing ran", feature="tool-call middleware inside the ledger", action="open")


def _check_placement(handler: Any, ledger: ToolLedger) -> None:
    """At a tool call, before anything is recorded or run: `_check_tool_node` on the
    tool node the handler leads to, and a handler that is not that node's own
    tool-running function (something sits between the ledger and the body) refused."""
    inside, node = _reached(handler)
    if node is not None:
        _check_tool_node(node, ledger)
    if _executor_node(handler) is None:
        _refuse_inside([type(m).__name__ for m in inside]
                       or [getattr(handler, "__qualname__", type(handler).__name__)])


_PASSES = "_statemachine_passes_tool_error_handlers"
"""The attribute that marks an error the ledger raised for a call before its body ran
(the write its step waited for failed: the saver's own error) as no error of the tool's:
`_passing_refusals` lets it through, as a ledger's refusal."""


def _not_the_tools(error: Exception) -> None:
    """Mark ``error`` as no error of the tool's (`_PASSES`): a ``ToolNode``'s
    ``handle_tool_errors`` lets it through (a `ControlError` passes anyway)."""
    if not isinstance(error, ControlError):
        with contextlib.suppress(AttributeError, TypeError):  # an error taking no attributes
            setattr(error, _PASSES, True)


def _passing_refusals(handling: Any) -> Callable[[Exception], Any]:
    """``handle_tool_errors`` that raises the ledger's refusals on (and the error of a
    write a step waited for, `_not_the_tools`), and hands every other error to
    ``handling`` (LangGraph's setting: True, a text, a callable, exception types)
    exactly when LangGraph alone would: a callable gets only the errors its annotation
    names (LangGraph's own reading of it), and what it returns is the message's
    content. A tool node's wrapper errors reach ``handle_tool_errors`` unfiltered by
    LangGraph, so the filter is here."""
    if getattr(handling, _PASSES, False):
        return cast("Callable[[Exception], Any]", handling)

    def handled() -> tuple[type[Exception], ...]:
        if isinstance(handling, type) and issubclass(handling, Exception):
            return (handling,)
        if isinstance(handling, tuple):
            return handling
        if callable(handling):  # (its annotation read when an error comes, as LangGraph)
            return _infer_handled_types(handling)
        return (Exception,)

    def handle(error: Exception) -> Any:
        if isinstance(error, ControlError) or getattr(error, _PASSES, False) or (
                not isinstance(error, handled())):
            raise error
        if isinstance(handling, str):
            return handling
        if callable(handling) and not isinstance(handling, type):
            return handling(error)
        return ERROR_TEMPLATE.format(error=repr(error))  # True, or exception types

    setattr(handle, _PASSES, True)
    return handle


# ------------------------------------------------------------------------ middleware


class LedgerMiddleware(AgentMiddleware):
    """The ledger in LangChain's ``create_agent(middleware=[...,
    LedgerMiddleware(ledger)])``: ``wrap_tool_call`` / ``awrap_tool_call`` put every tool
    call through it, and ``after_model`` reviews the calls of the tools the ledger's
    ``approvals`` names (one interrupt per batch, `ToolLedger.review`). Put it last:
    LangChain runs the first middleware of the list as the outermost ``wrap_tool_call``,
    and the ledger must be the innermost, so that no wrapper runs a body again under the
    start it recorded (a wrapper before it that calls the handler again is answered from
    the ledger). Before each model call the agent's tool node is checked:
    ``ToolRetryMiddleware`` or ``HumanInTheLoopMiddleware`` anywhere, or a tool-call
    middleware after this one, is refused (`UnsupportedFeature`, naming it) before the
    model is asked or anything is recorded."""

    def __init__(self, ledger: ToolLedger) -> None:
        super().__init__()
        self.ledger = ledger
        self._checked: weakref.WeakSet[Any] = weakref.WeakSet()
        """The model-call handlers whose agent passed `_check_agent` (an agent's
        middleware does not change once it is built)."""

    def wrap_model_call(self, request: Any, handler: Callable[[Any], Any]) -> Any:
        """Before each model call: the agent's tool node checked (`_check_tool_node`),
        so a middleware the ledger cannot carry is refused before anything runs, and
        ``durability="exit"`` on a `OneWriterSaver` too."""
        self._check_agent(handler)
        return handler(request)

    async def awrap_model_call(self, request: Any,
                               handler: Callable[[Any], Awaitable[Any]]) -> Any:
        self._check_agent(handler)
        return await handler(request)

    def _check_agent(self, handler: Any) -> None:
        with contextlib.suppress(RuntimeError):  # outside a graph run: no config
            configurable = get_config().get("configurable") or {}
            if isinstance(configurable.get("__pregel_checkpointer"), OneWriterSaver):
                _refuse_exit(configurable)
        if handler in self._checked:
            return
        node = _reached(handler)[1]  # create_agent's model step closes over its tool node
        if node is not None:
            _check_tool_node(node, self.ledger)
        with contextlib.suppress(TypeError):  # a handler that takes no weak reference
            self._checked.add(handler)

    def after_model(self, state: Any, runtime: Any) -> dict[str, Any] | None:
        if not self.ledger.approvals:
            return None
        return self.ledger.review(state)

    async def aafter_model(self, state: Any, runtime: Any) -> dict[str, Any] | None:
        return self.after_model(state, runtime)

    def wrap_tool_call(self, request: Any, handler: Callable[[Any], Any]) -> Any:
        return self.ledger.wrap_tool_call(request, handler)

    async def awrap_tool_call(self, request: Any,
                              handler: Callable[[Any], Awaitable[Any]]) -> Any:
        return await self.ledger.awrap_tool_call(request, handler)


# ---------------------------------------------------------------------- checkpointer


def _head(config: Mapping[str, Any]) -> Any:
    """The config naming the latest checkpoint of ``config``'s thread and namespace."""
    configurable = config.get("configurable") or {}
    return {"configurable": {"thread_id": configurable.get("thread_id"),
                             "checkpoint_ns": configurable.get("checkpoint_ns", "")}}


def _channel_messages(checkpoint: Any) -> list[BaseMessage]:
    values = (checkpoint or {}).get("channel_values") or {}
    found = values.get("messages")
    return list(found) if isinstance(found, list) else []


def _messages_json(messages: Sequence[BaseMessage]) -> list[JSON]:
    """The graph's messages as the plain JSON the ledger's publications keep."""
    return [plain(message_to_dict(message), fallback=_as_text) for message in messages]


class _SaverLocks:
    """The locks of one checkpointer, shared by every `OneWriterSaver` around it (a
    wrapper per graph, or per request, around one saver): their writes go through one
    connection, whose transactions must not interleave (before, a second wrapper's
    ``BEGIN IMMEDIATE`` met the first one's open transaction on the shared connection)."""

    def __init__(self) -> None:
        self.write = threading.Lock()
        """A sync write's (`OneWriterSaver._lock`)."""
        self.state = threading.Lock()
        """Guards ``loops``."""
        self.loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = \
            weakref.WeakKeyDictionary()
        """`OneWriterSaver.aput`'s, one per event loop."""


_SAVER_LOCKS: weakref.WeakKeyDictionary[Any, _SaverLocks] = weakref.WeakKeyDictionary()
_SAVER_LOCKS_GUARD = threading.Lock()


def _locks_of(saver: Any) -> _SaverLocks:
    """The locks every `OneWriterSaver` around ``saver`` shares (a saver that cannot be
    weakly referenced, or hashed, gets locks of its wrapper's own)."""
    with _SAVER_LOCKS_GUARD:
        try:
            found = _SAVER_LOCKS.get(saver)
            if found is None:
                found = _SAVER_LOCKS[saver] = _SaverLocks()
        except TypeError:
            return _SaverLocks()
        return found


class OneWriterSaver(BaseCheckpointSaver):  # type: ignore[type-arg]
    """Any LangGraph checkpointer (``InMemorySaver``, ``SqliteSaver``, ...) with one writer
    per thread: a ``put`` whose parent (the checkpoint the writer resumed from) is not the
    thread's latest checkpoint in its namespace is refused with `ConcurrencyConflict`,
    nothing written. Of two resumers of the same checkpoint, the first to write goes on.
    This also refuses time travel (a fork from an earlier checkpoint).

    The check and the write are one step: in this process always (a lock around every
    write of the saver); across processes for LangGraph's ``SqliteSaver``, whose
    connection holds the database's write lock (``BEGIN IMMEDIATE``) from the check to
    the write's commit, and for its ``PostgresSaver`` on one psycopg ``Connection`` in
    autocommit mode without a pipeline (what ``PostgresSaver.from_conn_string`` makes):
    the check and the write run in one transaction that first takes a transaction-level
    advisory lock on the thread and namespace (``pg_advisory_xact_lock``), so a second
    writer of the thread waits for the first one's commit and then finds the thread
    moved on. For another saver shared by several processes (a ``PostgresSaver`` on a
    connection pool or a pipeline among them) they are two steps, and two processes can
    both write in the instant between them: the tool ledger is what keeps their tools at
    most once there.

    A refused write stops its run only at its next step with ``durability="sync"``: with
    LangGraph's default (``"async"``) the next step runs while the write is made, so the
    ledger asks `check_step` (`acheck_step` on the async path) before every tool call of
    a graph this saver checkpoints: the step's checkpoint must be the thread's latest
    once written, or nothing of the step runs. No lock of this saver is held while it
    reads the saver inside, nor taken on an event loop while a sync write holds it: an
    async saver's (``AsyncSqliteSaver``, ``AsyncPostgresSaver``) sync methods hand their
    work to its event loop. With ``durability="exit"`` nothing is written before the run ends; its
    tool calls are refused (`UnsupportedFeature`)."""

    def __init__(self, saver: BaseCheckpointSaver,  # type: ignore[type-arg]
                 *, ledger: ToolLedger | None = None) -> None:
        super().__init__(serde=saver.serde)
        self.saver = saver
        self._sqlite_conn = self._sqlite_of(saver)
        self._locks = _locks_of(saver)
        self._lock = self._locks.write
        """Held across a sync write (the check and the write, one step), and never while
        this saver waits for an event loop or on the loop's own thread: an async saver's
        sync methods hand their work to its loop (`aput` and `acheck_step` take
        `_state` only, briefly). Every `OneWriterSaver` around the same saver shares it
        (`_SaverLocks`)."""
        self._state = threading.Lock()
        """Guards `_outcomes`, held only for its bookkeeping."""
        self._write_ended = threading.Condition(self._state)
        """Notified each time a write of this saver ends."""
        self._outcomes: OrderedDict[tuple[Any, str, str], BaseException | None] = \
            OrderedDict()
        """How each of the latest writes of this saver ended, by (thread, namespace,
        checkpoint id): None when it landed, else its error (`ConcurrencyConflict` for a
        write refused, the saver's own error for one that failed)."""
        if ledger is not None and self._sqlite() is None and self._postgres() is None and (
                type(saver) is not InMemorySaver):
            raise UnsupportedFeature(
                f"the checkpoint writes of a {type(saver).__name__} cannot be the ledger's "
                "publications: only SqliteSaver (its write lock spans the check, the "
                "staging and the write), PostgresSaver on one psycopg Connection without "
                "a pipeline (a lock on the thread, in the transaction of the write) and "
                "InMemorySaver (one process) are carried; pass no ledger",
                feature="publications on this checkpointer", action="open")
        self.ledger = ledger
        """With a ledger, each checkpoint that adds the ``ToolMessage`` of a call whose
        result the ledger has not published is that batch's staged publication."""
        if ledger is not None:
            ledger.publishes_to = self
        conn = self._sqlite()
        self._together = (ledger is not None and conn is not None
                          and isinstance(ledger.store, SQLiteEventStore)
                          and ledger.store.shares_file_with(conn))
        """The ledger's `SQLiteEventStore` is in this ``SqliteSaver``'s file: a checkpoint
        that publishes is written in one transaction with the ledger's events (the
        staging, the commit, and whatever the ledger records while the put holds the
        file's write lock), one commit for all of them: `_written_together`."""

    def _check(self, config: Mapping[str, Any], latest: str | None) -> None:
        configurable = config.get("configurable") or {}
        parent = configurable.get("checkpoint_id")
        if latest is not None and parent != latest:
            raise ConcurrencyConflict(
                f"thread {configurable.get('thread_id')!r} moved on: this writer resumed "
                f"from checkpoint {parent!r}, and the thread's latest is {latest!r} (another "
                "resumer wrote first, or this is a fork from an earlier checkpoint); "
                "nothing was written", action="checkpoint_put")

    def _sqlite(self) -> sqlite3.Connection | None:
        """The connection of LangGraph's ``SqliteSaver`` (None for another saver)."""
        return self._sqlite_conn

    @staticmethod
    def _sqlite_of(saver: Any) -> sqlite3.Connection | None:
        conn = getattr(saver, "conn", None)
        if (type(saver).__module__.startswith("langgraph.checkpoint.sqlite")
                and isinstance(conn, sqlite3.Connection)):
            return conn
        return None

    def _read_id(self, config: Any) -> str | None:
        """The id of the checkpoint ``config`` names (the latest of its thread and
        namespace when it names none), None when there is none. On LangGraph's
        ``SqliteSaver`` (`_sqlite`: its own class, not a subclass of another module) one
        statement on its connection, the query ``get_tuple`` makes without the
        checkpoint's body, its metadata and its pending writes, which it would read and
        decode; on any other saver ``get_tuple``."""
        saver: Any = self.saver
        if self._sqlite() is None:
            found = saver.get_tuple(config)
            return None if found is None else str(found.checkpoint["id"])
        configurable = config["configurable"]
        asked = (str(configurable["thread_id"]), configurable.get("checkpoint_ns", ""))
        named = configurable.get("checkpoint_id")
        with saver.cursor(transaction=False) as cur:
            if named:
                cur.execute("SELECT checkpoint_id FROM checkpoints WHERE thread_id = ? AND "
                            "checkpoint_ns = ? AND checkpoint_id = ?", (*asked, named))
            else:
                cur.execute("SELECT checkpoint_id FROM checkpoints WHERE thread_id = ? AND "
                            "checkpoint_ns = ? ORDER BY checkpoint_id DESC LIMIT 1", asked)
            row = cur.fetchone()
        return None if row is None else str(row[0])

    def _postgres(self) -> Any:
        """The psycopg ``Connection`` of LangGraph's ``PostgresSaver`` when the check and
        the write can share its transaction (None for another saver, its shallow one and
        subclasses among them, a connection pool, whose every statement may take another
        connection, a pipeline, or a connection not in autocommit mode)."""
        saver: Any = self.saver
        if type(saver).__module__ != "langgraph.checkpoint.postgres":
            return None
        import psycopg
        from langgraph.checkpoint.postgres import PostgresSaver

        conn = getattr(saver, "conn", None)
        if (type(saver) is PostgresSaver and isinstance(conn, psycopg.Connection)
                and saver.pipe is None and conn.autocommit):
            return conn
        return None

    def put(self, config: Any, checkpoint: Any, metadata: Any, new_versions: Any) -> Any:
        ledger = self.ledger
        # in one file with the ledger's store, the ledger's lock is taken before the file's
        # write lock: a ledger call on another thread holds it while it waits for that lock
        held = ledger._lock if self._together and ledger is not None else contextlib.nullcontext()
        with self._lock, held:
            conn = self._sqlite()
            pg = self._postgres()
            saver: Any = self.saver
            if conn is not None:
                try:
                    if not saver.is_setup:
                        with saver.cursor(transaction=False):
                            pass  # its tables exist: creating them would commit ours
                    with saver.lock:
                        conn.execute("BEGIN IMMEDIATE")  # the write lock, until the commit
                except BaseException as error:  # (a file locked past its busy timeout)
                    self._ended(config, checkpoint, error)  # a step waiting hears it now
                    raise

            landed = False
            ended: BaseException | None = None

            def write(*args: Any) -> Any:
                """The saver's put, committed: SqliteSaver's commits itself (ending
                ``BEGIN IMMEDIATE``); PostgresSaver's ends the transaction here."""
                nonlocal landed
                written = saver.put(*args)
                if pg is not None:
                    with saver.lock:
                        pg.execute("COMMIT")
                landed = True
                return written

            try:
                if pg is not None:
                    configurable = config.get("configurable") or {}
                    with saver.lock:  # a lock on the thread, until the commit or rollback
                        pg.execute("BEGIN")
                        pg.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))",
                                   (json.dumps(["langgraph", configurable.get("thread_id"),
                                                configurable.get("checkpoint_ns", "")]),))
                if pg is None:
                    self._check(config, self._read_id(_head(config)))
                    found = None
                else:  # (one read: the parent, which a publication stages against)
                    found = self.saver.get_tuple(_head(config))
                    self._check(config, None if found is None else found.checkpoint["id"])
                if self.ledger is None:
                    return write(config, checkpoint, metadata, new_versions)

                def parent() -> Any:  # (read under the write lock, as the check was)
                    return found if pg is not None else self.saver.get_tuple(_head(config))

                if not self._together:
                    return self._publishing(config, checkpoint, metadata, new_versions,
                                            parent, write)
                assert conn is not None
                assert isinstance(self.ledger.store, SQLiteEventStore)
                # the ledger's reads and appends, in this put's transaction until it ends
                with self.ledger.store.in_transaction_of(conn, saver.lock) as routed:
                    try:
                        written = self._publishing(config, checkpoint, metadata,
                                                   new_versions, parent, write,
                                                   (conn, routed))
                    except BaseException:
                        self._drop(routed)
                        raise
                landed = True
                return written
            except BaseException as error:
                ended = error
                raise
            finally:
                if conn is not None:
                    with saver.lock:
                        if conn.in_transaction:  # refused, or the put raised
                            conn.rollback()
                elif pg is not None and pg.info.transaction_status.name != "IDLE":
                    # refused, or it raised: the error that got here wins over this one
                    with saver.lock, contextlib.suppress(Exception):
                        pg.execute("ROLLBACK")
                self._ended(config, checkpoint, None if landed else ended)

    def _publishing(self, config: Any, checkpoint: Any, metadata: Any, new_versions: Any,
                    parent: Callable[[], Any], put: Callable[..., Any],
                    together: tuple[sqlite3.Connection, set[str]] | None = None) -> Any:
        """The ``put`` of a checkpoint as the ledger's staged publication of the results
        it adds (the graph's history is the Session): staged (durable) before the write,
        committed after it, recorded failed when it raises; an earlier write left
        unsettled is reconciled first against the thread's latest messages (this runs
        under the saver's write lock, or PostgreSQL's lock on the thread, so no other
        writer can still land it). ``put`` is the saver's write, committed; ``parent``
        reads the thread's latest checkpoint, which a checkpoint that answers no call
        whose result is unpublished (nothing to publish) is written without. ``together``
        (the saver's connection, and the runs whose events went into its transaction):
        the ledger's store is in the saver's file, its calls go into the put's
        transaction, and a publication is written with its staging and commit in it
        (`_written_together`)."""
        ledger = self.ledger
        assert ledger is not None
        configurable = config.get("configurable") or {}
        if "|" in str(configurable.get("checkpoint_ns") or ""):
            return put(config, checkpoint, metadata, new_versions)
        after = _channel_messages(checkpoint)
        with ledger._lock:
            c = ledger.controller(ledger.run_id_of(config))
            owed = set(c.unpublished_call_ids())
            if c.step is not Step.UNSETTLED and not any(
                    isinstance(m, ToolMessage) and m.tool_call_id in owed for m in after):
                return put(config, checkpoint, metadata, new_versions)
        found = parent()
        before = _channel_messages(None if found is None else found.checkpoint)
        added = after[len(before):]
        if [m.id for m in after[:len(before)]] != [m.id for m in before]:
            added = []  # not an append (a message replaced): nothing published here
        results = [m.tool_call_id for m in added if isinstance(m, ToolMessage)]
        with ledger._lock:
            c = ledger.controller(ledger.run_id_of(config))
            if c.step is Step.UNSETTLED:  # a write that failed, or a writer that died
                envelope = c.envelope
                assert envelope is not None
                if isinstance(c.reconcile(_messages_json(before), c.session_id,
                                          take_over=True), Append):
                    # the write did not land; this one must carry the same results
                    # (LangGraph re-ran the node: the ledger answered from its record)
                    if sorted(results) != sorted(envelope.call_ids):
                        raise PublicationUnsettled(
                            "a checkpoint write that carried tool results did not land, "
                            "and this write does not carry them again: resume the thread "
                            "from its latest checkpoint; nothing was written",
                            run_id=c.run_id, step=c.step, action="checkpoint_put")
                    return self._written(c, put, together, config, checkpoint, metadata,
                                         new_versions)
                c.flush()  # acknowledged: the write had landed
            owed = set(c.unpublished_call_ids())
            answered = [call_id for call_id in results if call_id in owed]
            if not answered or owed - set(answered):
                return put(config, checkpoint, metadata, new_versions)
            c.stage_publication(_messages_json(added), _messages_json(before),
                                call_ids=[i for i in c.unpublished_call_ids()
                                          if i in answered])
            if together is None:
                c.flush()  # the envelope is durable before the write
            return self._written(c, put, together, config, checkpoint, metadata,
                                 new_versions)

    def _written(self, c: RunController, put: Callable[..., Any],
                 together: tuple[sqlite3.Connection, set[str]] | None, *args: Any) -> Any:
        """The checkpoint written as the publication ``c`` holds open: committed once it
        is written, recorded failed (the write's own error propagating) when it raises;
        with ``together``, in one transaction with its staging and commit."""
        if together is not None:
            return self._written_together(c, *together, *args)
        try:
            result = put(*args)
        except Exception as error:
            with contextlib.suppress(ControlError):  # the write's own error wins (I6)
                c.publication_failed(error)
                c.flush()
            raise
        c.publication_committed()
        c.flush()
        return result

    def _written_together(self, c: RunController, conn: sqlite3.Connection,
                          routed: set[str], *args: Any) -> Any:
        """The ledger's store in the saver's file: the publication ``c`` holds open (its
        staging, or the reconcile that calls for the write again, not yet flushed), the
        checkpoint, and the publication's commit, in the put's transaction, one COMMIT.
        All of it lands or none of it does: a kill or a failure anywhere in between
        leaves the thread and the ledger as they were before the put (``put`` rolls the
        transaction back and drops ``c``, then ahead of the store: `_drop`). Under the
        saver's lock until the commit, so no reader of the saver's connection sees the
        checkpoint before it."""
        saver: Any = self.saver
        ledger = self.ledger
        assert ledger is not None
        assert isinstance(ledger.store, SQLiteEventStore)
        with saver.lock, ledger.store.in_transaction_of(conn, gather=routed):
            c.flush()  # the envelope, in the transaction the checkpoint goes into
            written = self._put_held(*args)
            c.publication_committed()
            c.flush()
            conn.commit()  # (ends BEGIN IMMEDIATE: the checkpoint and its publication)
        return written

    def _put_held(self, *args: Any) -> Any:
        """``SqliteSaver.put`` on this thread, its commit held back (its cursor opened
        without the commit and without the saver's lock, which this thread holds): the
        caller commits. Other threads' calls get the saver's own cursor meanwhile."""
        saver: Any = self.saver
        kept = vars(saver).get("cursor")  # (one of the user's own, put back after)
        own = kept if kept is not None else functools.partial(type(saver).cursor, saver)
        me = threading.get_ident()

        @contextlib.contextmanager
        def cursor(transaction: bool = True) -> typing.Iterator[sqlite3.Cursor]:
            if threading.get_ident() != me:
                with own(transaction) as theirs:
                    yield theirs
                return
            saver.setup()
            cur = saver.conn.cursor()
            try:
                yield cur
            finally:
                cur.close()

        saver.cursor = cursor
        try:
            return saver.put(*args)
        finally:
            if kept is None:
                del saver.cursor
            else:
                saver.cursor = kept

    def _drop(self, routed: set[str]) -> None:
        """After a put in one file with the ledger that did not end with its commit as
        planned: the events it put into its transaction may have landed or not (rolled
        back with it, or committed by the saver on its own), so each such run's copy is
        stopped and dropped, and the next call loads the run from the store. (Its fence
        alone would not do: it counts events, and another attempt appending as many as
        were rolled back would pass it.)"""
        ledger = self.ledger
        assert ledger is not None
        with ledger._lock:
            for run_id in routed:
                c = ledger._runs.pop(run_id, None)
                if c is not None:
                    c._journal.stop(StorageError, (
                        "a checkpoint write that carried this run's events did not commit "
                        "as planned: they may not have landed; load the run again to go "
                        "on"))

    def _ended(self, config: Mapping[str, Any], checkpoint: Any,
               error: BaseException | None) -> None:
        """Note how a write ended (``error``: None when it landed, even when it raised
        after) and wake `check_step`'s waiters."""
        configurable = config.get("configurable") or {}
        key = (configurable.get("thread_id"), str(configurable.get("checkpoint_ns") or ""),
               str(checkpoint["id"]))
        with self._write_ended:
            self._outcomes[key] = error
            self._outcomes.move_to_end(key)
            while len(self._outcomes) > _KEPT_OUTCOMES:
                self._outcomes.popitem(last=False)
            self._write_ended.notify_all()

    def check_step(self, thread_id: Any, checkpoint_id: str, *,
                   timeout: float = STEP_WAIT) -> None:
        """Return once checkpoint ``checkpoint_id`` (the one a step of thread
        ``thread_id`` runs from) is the thread's latest, waiting up to ``timeout`` seconds
        for this saver's write of it to end (LangGraph's default durability writes it
        while the step runs). When that write failed, its own error, the same object
        (I6); `ConcurrencyConflict` when it was refused (another writer came first, or a
        fork from an earlier checkpoint) or cancelled, when the thread moved on past it,
        or when it is not written in time: the step is not the thread's, and nothing of
        it may run. The saver is read without any of this saver's locks held."""
        judging = self._judging(thread_id, checkpoint_id, timeout)
        asked = next(judging)
        while True:
            if isinstance(asked, float):
                with self._write_ended:
                    self._write_ended.wait(asked)
                answer: Any = None
            else:
                answer = self._read_id(asked)
            try:
                asked = judging.send(answer)
            except StopIteration:
                return

    async def acheck_step(self, thread_id: Any, checkpoint_id: str, *,
                          timeout: float = STEP_WAIT) -> None:
        """`check_step` on the event loop, reading through the saver's async methods."""
        judging = self._judging(thread_id, checkpoint_id, timeout)
        asked = next(judging)
        while True:
            if isinstance(asked, float):
                await asyncio.sleep(asked)
                answer: Any = None
            else:
                found = await self.saver.aget_tuple(asked)
                answer = None if found is None else str(found.checkpoint["id"])
            try:
                asked = judging.send(answer)
            except StopIteration:
                return

    def _judging(self, thread_id: Any, checkpoint_id: str,
                 timeout: float) -> typing.Generator[Any, Any, None]:
        """`check_step`'s reasoning, without its reads: yields a config to read (sent the
        id of the checkpoint it names, None for none) or a number of seconds to wait; ends
        when the step is the thread's, raises when it is not. How the write ended is taken
        before the reads, so a write landing between them is never mistaken for the
        thread moving on."""
        key = (thread_id, "", checkpoint_id)
        head: Any = {"configurable": {"thread_id": thread_id, "checkpoint_ns": ""}}
        itself: Any = {"configurable": {**head["configurable"],
                                        "checkpoint_id": checkpoint_id}}
        deadline = time.monotonic() + timeout
        while True:
            with self._state:
                known = key in self._outcomes
                error = self._outcomes.get(key)
            found = yield head
            if found == checkpoint_id:
                return  # written (a write that landed, then raised, among them)
            if known and isinstance(error, ConcurrencyConflict):
                raise ConcurrencyConflict(
                    f"thread {thread_id!r}: the checkpoint this step runs from was not "
                    "written (refused: another resumer wrote first, or this is a fork from "
                    "an earlier checkpoint): nothing of the step ran", action="begin_tool"
                ) from error
            if known and isinstance(error, Exception):
                raise error  # the write's own error (I6)
            if known and error is not None:
                raise ConcurrencyConflict(
                    f"thread {thread_id!r}: the write of the checkpoint this step runs from "
                    f"ended without an answer ({type(error).__name__}): nothing of the "
                    "step ran", action="begin_tool") from error
            if known or (yield itself) is not None:  # written, not the latest when read:
                again = yield head  # (read once more: it may have landed since)
                if again == checkpoint_id:
                    return
                raise ConcurrencyConflict(
                    f"thread {thread_id!r} moved on past the checkpoint this step runs "
                    "from (another resumer, or a fork from an earlier checkpoint): "
                    "nothing of the step ran", action="begin_tool")
            left = deadline - time.monotonic()
            if left <= 0:
                raise ConcurrencyConflict(
                    f"thread {thread_id!r}: the checkpoint this step runs from was not "
                    f"written within {timeout:g} s: nothing of the step ran",
                    action="begin_tool")
            yield min(left, 0.05)  # a write of another saver: read again

    def get_tuple(self, config: Any) -> Any:
        return self.saver.get_tuple(config)

    def list(self, config: Any, **options: Any) -> Any:
        return self.saver.list(config, **options)

    def put_writes(self, config: Any, writes: Any, task_id: str, task_path: str = "") -> None:
        with self._lock:  # a write of its own would commit a put's open transaction
            self.saver.put_writes(config, writes, task_id, task_path)

    def delete_thread(self, thread_id: str) -> None:
        with self._lock:
            self.saver.delete_thread(thread_id)

    async def aget_tuple(self, config: Any) -> Any:
        return await self.saver.aget_tuple(config)

    async def alist(self, config: Any, **options: Any) -> Any:
        async for item in self.saver.alist(config, **options):
            yield item

    async def aput(self, config: Any, checkpoint: Any, metadata: Any,
                   new_versions: Any) -> Any:
        if self.ledger is not None:  # an in-memory saver: its put is the same, one step
            return self.put(config, checkpoint, metadata, new_versions)
        landed = False
        ended: BaseException | None = None
        try:
            async with self._async_lock():  # the check and the write, one step here too
                found = await self.saver.aget_tuple(_head(config))
                self._check(config, None if found is None else found.checkpoint["id"])
                written = await self.saver.aput(config, checkpoint, metadata, new_versions)
                landed = True
                return written
        except BaseException as error:
            ended = error
            raise
        finally:  # (never `_lock` on the loop: a sync write may be waiting for the loop)
            self._ended(config, checkpoint, None if landed else ended)

    def _async_lock(self) -> asyncio.Lock:
        """The lock of `aput` on the running event loop (an asyncio lock serves one
        loop; a saver shared by threads with loops of their own gets one per loop)."""
        loop = asyncio.get_running_loop()
        with self._locks.state:
            lock = self._locks.loops.get(loop)
            if lock is None:
                lock = self._locks.loops[loop] = asyncio.Lock()
        return lock

    async def aput_writes(self, config: Any, writes: Any, task_id: str,
                          task_path: str = "") -> None:
        await self.saver.aput_writes(config, writes, task_id, task_path)

    async def adelete_thread(self, thread_id: str) -> None:
        await self.saver.adelete_thread(thread_id)

    def get_next_version(self, current: Any, channel: Any) -> Any:
        return self.saver.get_next_version(current, channel)
