"""The Anthropic SDK (PyPI ``anthropic``) with the control core's tool ledger underneath
(DESIGN §2.4, §6.8, §7.4). Install with ``pip install 'agent-statemachine[anthropic]'``
(tested on anthropic 2.10.x; the extra pins ``>=2.10,<2.11`` because the runners are
wrapped at seams the SDK does not promise to keep).

Two ways the SDK runs tools on the client, two wrappers, one ledger (a `RunController`
without a Session, usually bound to an event store so it survives process restarts):

Managed sessions — `LedgerSessionToolRunner`
    The SDK's ``SessionToolRunner`` (what ``client.beta.sessions.events.tool_runner()``
    returns) executes the ``agent.tool_use`` / ``agent.custom_tool_use`` calls of a
    managed-agents session and posts each result back. Its history pass after every
    stream reconnect re-dispatches each call whose result the server does not hold, and
    in 2.10 a re-dispatch runs the tool again: a tool whose result post failed runs twice
    after a reconnect. `LedgerSessionToolRunner` is that runner with four seams wrapped:

    ========================  ============================================================
    SDK seam                  what the wrapper does
    ========================  ============================================================
    running one tool          ``begin_tool(tool_use id)``: `Execute` → the start is durable
                              first, the SDK runs the tool, ``tool_completed`` records the
                              result event before anything is posted; `Resend` → the cached
                              result event (an operator's ``resolve_in_doubt`` output made
                              into one), the tool never runs again; a started, unfinished
                              call → `ToolInDoubt`, and the runner stops (fails closed)
    posting a result          a post that ends without landing → ``result_post_failed``
    a result the server holds the server's history or stream shows the result (or a post
                              landed) → ``result_posted``: never re-sent again
    the live event stream     ``session.status_terminated`` / ``session.deleted`` (what
                              the SDK stops on): once every call is posted the run is
                              completed; iterating a completed run opens nothing
                              (``replayed``)
    ========================  ============================================================

    Every iteration on an existing run first records ``claim``, asks the verifiers given
    to ``open`` about the calls of their tools in doubt (`statemachine.verifiers`), and
    passes the gate (``resume()``: a call in doubt raises `ToolInDoubt` before the stream
    is opened). Every tool body of either runner runs inside its call's
    `statemachine.tool_context`.

Messages — `MessageToolLedger`
    For a plain ``client.messages.create`` loop (or ``client.beta.messages.create``):
    ``ledger.run_tools(reply)`` runs the reply's ``tool_use`` blocks through the ledger,
    keyed by the ``tool_use`` id, and returns the user message of their ``tool_result``
    blocks, so a retried turn answers a finished call from the cache instead of running it
    again; ``ledger.create(client.messages, ...)`` refuses a history that holds a
    ``tool_use`` without its ``tool_result`` (`UnansweredToolUse`) and any request while a
    call is in doubt (`ToolInDoubt`), before anything is sent; a history older than the
    run, one lacking the ``tool_use`` of a call whose result is recorded and unsent (sent
    as it is, the model would ask again under a new id, and the tool run twice), is sent
    followed by the turns it lacks, rebuilt from the ledger (`MessageToolLedger.resumed`:
    the replies this ledger saw, the recorded results), or refused when that cannot be
    exact (`StaleHistory`, naming why). The results a request carries are made durable
    before it is sent (``flush_results``: a crash while the model answers leaves their
    calls completed, not in doubt), and marked posted once its reply came whole (a stream
    read to its end). ``ledger.attach(runner)``
    puts the same ledger under a ``client.beta.messages.tool_runner(...)`` runner (sync or
    async, streamed or not): each tool call it makes is ledgered by its ``tool_use`` id.

    A run is one conversation up to its final reply (one without ``tool_use`` that ends the
    turn): that reply is recorded and the run completed. Running the conversation again (a
    request whose messages are the recorded conversation's, or a start of them) returns the
    recorded reply without any request or tool run, and says so (``ledger.replayed``); a
    request that goes past the recorded conversation (a new user turn after its end) is
    refused (`RunNotResumable`): it belongs to a new run.

Results: a tool's return value is recorded as the SDK sends it (its own request encoder's
JSON: a pydantic model, a datetime, a tuple), so a result re-sent from the cache is
byte-identical to the first one. A result the run's log cannot hold (over ``max_bytes``,
nested deeper than ``max_depth``, or not JSON at all) is recorded as a failed call, an
error result the model sees; when the log has no room left even for that error, the call
is refused before its body runs (`SchemaError`). An ordinary exception raised by a tool
body is the call's result, an error result the model sees, as the SDK makes it; only a
process crash, a `BaseException` (cancellation), or the session runner's timeout
(``TOOL_TIMEOUT``, which cancels the body: its effect may have happened) between its start
and its result leaves the call in doubt.

What it does not cover (refused or documented, never silently unsafe): decisions (tool
confirmations) and new input reach a managed session through the server's own events, not
through this adapter, so there is no adapter call to refuse while a write is unsettled,
and a per-call result post never makes a run ``UNSETTLED`` (§2.4: an unposted result
blocks no other call), so no restart is ever refused as "an attempt may still be writing"
and there is nothing to take over (``take_over``): a post or a request that a killed
process left on its way is re-sent from the ledger. A call in doubt is settled with
``resolve_in_doubt`` (on `MessageToolLedger` and `LedgerSessionToolRunner`, or from any
other process through the store): a ``COMPLETED`` output is sent as the call's
``tool_result`` (posted as its result event), a ``FAILED`` one as an error result
(``is_error``), and after ``NOT_EXECUTED`` the tool runs again, once; ``abandon`` ends
the run. A tool the wrapped runner does not own
is left to its owner, as the SDK does, and is not entered in the ledger. The SDK has no
tool output guardrail (no redacting step between a tool and its result): what a tool
returns is what the ledger keeps and the model sees (redact inside the tool). Toolsets
(``BetaRunnableToolset``) in a messages tool runner are refused when it is attached
(`UnsupportedFeature`). ``create(stream=True)`` is carried for its tool results, but the
streamed final reply is not seen, so it does not complete the run. The SDK's
``EnvironmentWorker`` builds the SDK's own session runner, outside the ledger: drive the
session with `LedgerSessionToolRunner` instead.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Collection,
    Generator,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from typing import Any, TypeVar, cast

from statemachine.adapters import missing_extra

try:
    import pydantic
    from anthropic import AsyncAnthropic
    from anthropic._utils._json import openapi_dumps
    from anthropic.lib._parse._response import parse_beta_response
    from anthropic.lib.environments import DispatchedToolCall, SessionToolRunner
    from anthropic.lib.tools import (
        BetaAsyncStreamingToolRunner,
        BetaAsyncToolRunner,
        BetaStreamingToolRunner,
        BetaToolRunner,
    )
    from anthropic.lib.tools._beta_session_runner import _build_result_event, _to_session_content
    from anthropic.lib.tools._tool_dispatch import run_runnable_tool, tool_error_content
    from anthropic.types import Message, ParsedMessage
    from anthropic.types.beta import BetaMessage
    from anthropic.types.beta.parsed_beta_message import ParsedBetaMessage
except ModuleNotFoundError as error:  # pragma: no cover - the extra is installed in CI
    raise missing_extra(__name__, "anthropic", error) from error

from statemachine.adapters._calls import (
    STAGED_BYTES,
    HistoryMismatch,
    InvalidVerifier,
    UnsupportedFeature,
    Walk,
    abandoned_reason,
    abandoning,
    begin_call,
    checked_verifiers,
    decide,
    decide_async,
    plain,
    resolution,
    resolving,
    room,
    same_history,
    stored_run,
)
from statemachine.controller import RunController
from statemachine.errors import (
    ControlError,
    InvalidTransition,
    RunNotFound,
    RunNotResumable,
    SchemaError,
    ToolInDoubt,
    excerpt,
)
from statemachine.payloads import JSON, canonical_json, walk_size
from statemachine.runner.attempt import VERIFY_TIMEOUT, Attempt, interrupted, maybe_await
from statemachine.runner.publish import keeps_history_on, stage_known
from statemachine.sessions import Session
from statemachine.stores import (
    AsyncEventStore,
    EventStore,
    SessionWrite,
)
from statemachine.structured_logging import run_logger, switch
from statemachine.values import Phase, Resolution, Step, ToolCall
from statemachine.verifiers import (
    Verifier,
    running_call,
    verify_in_doubt,
    verify_in_doubt_async,
)

__all__ = [
    "HistoryMismatch",
    "InvalidVerifier",
    "LedgerSessionToolRunner",
    "MessageToolLedger",
    "ResultNotPosted",
    "StaleHistory",
    "UnansweredToolUse",
    "UnsupportedFeature",
]

_Runner = TypeVar("_Runner", BetaToolRunner[Any], BetaStreamingToolRunner[Any],
                  BetaAsyncToolRunner[Any], BetaAsyncStreamingToolRunner[Any])


class UnansweredToolUse(ControlError):
    """The message history holds a ``tool_use`` block that no ``tool_result`` in the next
    user message answers, or answers with a result the ledger does not hold (the call is
    to run again: an idempotent call whose run was never recorded, or one resolved
    ``NOT_EXECUTED``; a saved answer kept a result the ledger lost). Nothing was sent: the
    API would refuse the history, and a result made up for a call that may have run would
    hide what happened. Answer the call (from `MessageToolLedger.run_tools`, or
    `resolve_in_doubt` for a call in doubt) first."""


class StaleHistory(ControlError):
    """The request's history is older than the run: it lacks the ``tool_use`` of a call
    (``call_ids``, in the ledger's order) whose result the ledger recorded and no request
    has carried yet, as a history saved before the reply that asked for it does, and the
    turns it lacks cannot be rebuilt exactly (`MessageToolLedger.resumed`; ``why`` says
    why). Sent as it is, it would have the model ask again as if the call had not run,
    under a new ``tool_use`` id (the API never gives one twice), so the tool would run a
    second time and the recorded result never reach the model. Nothing was sent. Send the
    history that holds that reply, answered by `MessageToolLedger.run_tools` (from the
    ledger, nothing runs again); when it is lost, end the run
    (`MessageToolLedger.abandon`)."""

    def __init__(self, reason: str, *, call_ids: Sequence[str], why: str = "not-kept",
                 **where: Any) -> None:
        self.call_ids = tuple(call_ids)
        self.why = why
        """Why the ledger could not rebuild the missing turns exactly
        (`MessageToolLedger.resumed`): ``"not-kept"`` (this ledger never saw the reply
        that asked for the calls: another process did, and the log keeps the calls, not
        the reply), ``"thinking"`` (the reply held thinking blocks, whose signatures the
        ledger does not keep), ``"diverged"`` (the history differs from every request this
        ledger saw answered with calls, other than by the missing turns), or
        ``"unanswered"`` (a call of the reply has no recorded result)."""
        super().__init__(reason, **where)

    def _extra(self) -> dict[str, Any]:
        return {"call_ids": self.call_ids, "why": self.why}


class ResultNotPosted(Exception):
    """Recorded (by type name) for a result post that ended without landing."""


# ------------------------------------------------------------------ plain values


def _field(obj: Any, name: str) -> Any:
    """``obj[name]`` for a mapping, ``obj.name`` for an SDK model; None when absent."""
    if isinstance(obj, Mapping):
        return obj.get(name)
    return getattr(obj, name, None)


def _as_is(value: Any, walk: Walk | None) -> JSON:
    """The `plain` fallback of this adapter: a pydantic model through
    ``model_dump(mode="json", exclude_none=True)`` (the form the API takes), a mapping's
    items whatever its keys; anything else (and a value nested too deep to walk) is left
    as it is, so the controller refuses it (`SchemaError`)."""
    if walk is None:
        return value
    if isinstance(value, Mapping):
        return {key: walk(item) for key, item in value.items()}
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        return walk(dump(mode="json", exclude_none=True))
    return value


def _sendable(value: Any) -> JSON:
    """``value`` exactly as the SDK sends it: the JSON its request encoder writes (a tuple
    as a list, a datetime as its ISO text, a pydantic model as its request dump), read
    back. `TypeError`, `ValueError` or `RecursionError` for a value the encoder refuses,
    as the SDK's request would."""
    return cast(JSON, json.loads(openapi_dumps(value)))


def _blocks(value: Any) -> bool:
    """A list of content blocks (each a mapping with a ``type``)."""
    return isinstance(value, list | tuple) and all(
        isinstance(block, Mapping) and isinstance(block.get("type"), str) for block in value)


def _content_of(value: Any) -> JSON:
    """A value the adapter turns into ``tool_result`` content itself (a return value of
    `run_tools`' tools, an operator's resolution): text as it is, a list of content
    blocks as plain JSON, anything else as its JSON text (as the SDK's encoder reads it),
    or its ``str()`` when it has none."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    blocks = plain(value, fallback=_as_is)
    if isinstance(blocks, list):
        return blocks
    try:
        return json.dumps(_sendable(blocks))
    except (TypeError, ValueError, RecursionError):
        return str(value)


def _open_sync(run_id: str, store: EventStore | None, buffered: bool,
               history: Session | None = None) -> tuple[RunController, bool]:
    buffered = buffered and store is not None
    loaded = None if store is None else stored_run(store, run_id, buffered=buffered)
    if loaded is not None:
        same_history(loaded, history, "keeping the messages yourself")
        return loaded, True
    return RunController.start(run_id=run_id, session_id=None if history is None
                               else history.session_id, store=store, buffered=buffered), False


def _reads_sessions(store: EventStore) -> bool:
    """Whether ``store`` reads a Session's items in this thread (``session_items``: the
    SQLite and PostgreSQL stores; their async faces read in a coroutine)."""
    read = getattr(store, "session_items", None)
    return callable(read) and not inspect.iscoroutinefunction(read)


def _refuse_history(history: Session | None, store: EventStore | None, buffered: bool,
                    run_id: str) -> None:
    """`UnsupportedFeature` (``feature="history"``) for a history `MessageToolLedger` cannot
    write with the run's end in one transaction: its conversation is written in the
    store's append that completes the run, or not at all, so the Session must be one the
    store writes in its own transaction (`SQLiteSession` on a `SQLiteEventStore`'s file,
    `PostgresSession` on a `PostgresEventStore`'s schema) and checks the tail of (a write
    onto a Session another writer moved is refused whole), and the run must be buffered
    (per event, the staging would land apart from the commit)."""
    if history is None:
        return
    if store is None:
        why = "without a store"
    elif not buffered:
        why = "per event (buffered=False): its staging would land apart from the commit"
    elif not (keeps_history_on(store, history, buffered=True) and _reads_sessions(store)):
        why = (f"in a Session the store does not write in its own transaction "
               f"({type(history).__name__} {excerpt(str(history.session_id))} beside "
               f"{type(store).__name__}): give a SQLiteSession on the store's file, or a "
               "PostgresSession on its schema")
    else:
        return
    raise UnsupportedFeature(
        f"the conversation cannot be kept in a history {why}; it is written with the "
        "run's end in one transaction, or not at all. Nothing was opened",
        feature="history", run_id=run_id, action="open")


async def _open_async(run_id: str, store: EventStore | AsyncEventStore | None, buffered: bool
                      ) -> tuple[RunController, bool]:
    # `AsyncEventStore` is a structural protocol a sync store also matches: ask whether
    # its append is a coroutine, as the controller does
    if store is not None and inspect.iscoroutinefunction(getattr(store, "append", None)):
        store = cast(AsyncEventStore, store)
        with contextlib.suppress(RunNotFound):
            return await RunController.load_async(store, run_id), True
        return RunController.start(run_id=run_id, session_id=None,
                                   store=store), False  # type: ignore[arg-type]
    return _open_sync(run_id, cast(EventStore | None, store), buffered)


def _receive(c: RunController, call_id: str, name: str, arguments: JSON,
             idempotent: Collection[str]) -> None:
    """Enter a call the ledger has not seen (it needs no approval on the client: a call the
    server gates is released to the runner only once it is allowed)."""
    if c.phase(call_id) is None:
        call = ToolCall(call_id, name, arguments, idempotent=name in idempotent)
        if c.step is Step.AWAITING_MODEL:  # an earlier process died recording an answer
            c.model_responded(tool_calls=[call])
        else:
            c.receive_tool_calls([call])


def _refuse_mcp(tools: Iterable[Any], run_id: str | None, action: str,
                step: Step | None = None) -> None:
    """`UnsupportedFeature` (``feature="MCP tools"``) for a tool the SDK's MCP helpers
    made (``anthropic.lib.tools.mcp``: ``mcp_tool``, ``async_mcp_tool``): its body sends a
    ``tools/call`` whose lost response the SDK turns into an error result, so the ledger
    would record as answered a call the server may have run, and the model could ask for
    it again. Refused until the adapter carries MCP (DESIGN §7.4)."""
    from anthropic.lib._stainless_helpers import get_helper_tag

    names = sorted(str(getattr(tool, "name", "?")) for tool in tools
                   if get_helper_tag(tool) == "mcp_tool")
    if names:
        raise UnsupportedFeature(
            f"MCP tools ({', '.join(names)}) made by anthropic.lib.tools.mcp are not "
            "carried by this adapter: a lost response would be recorded as an error the "
            "model may retry; call the server from a function tool of your own",
            feature="MCP tools", run_id=run_id, step=step, action=action)


def _names(tools: Sequence[Any]) -> list[str]:
    """The names of the runnable tools given to a runner or a ledger: the tools a verifier
    may be given for."""
    return [str(tool.name) for tool in tools]


def _refuse_abandoned(c: RunController, action: str) -> None:
    """`RunNotResumable` for a run that was abandoned (`abandon`, here or by an operator
    whose record this controller holds): nothing more is sent to the model."""
    if c.step is Step.TERMINAL_UNRECOVERABLE:
        raise RunNotResumable(f"the run was abandoned ({abandoned_reason(c)}) and never "
                              "resumes; nothing was sent", run_id=c.run_id, step=c.step,
                              action=action)


def _refuse_in_doubt(c: RunController, action: str) -> None:
    """`ToolInDoubt` while any call of the run is in doubt: nothing of this attempt may
    run or be sent until an operator records its outcome."""
    doubt = c.in_doubt()
    if doubt:
        raise ToolInDoubt(
            f"call {doubt[0]!r} was started and never completed; it is not re-run, and "
            "nothing is sent until its outcome is recorded (resolve_in_doubt) or the run "
            "is abandoned", call_id=doubt[0], run_id=c.run_id, step=c.step, action=action)


# ------------------------------------------------------------------ results


_UNSENDABLE = ("the tool ran, but its result cannot be sent as JSON ({error}); it was not "
               "recorded")
_TOO_LARGE = ("the tool ran, but its result ({size} bytes as JSON) is more than the run's "
              "log may hold (max_bytes, max_depth); it was not recorded")
_LARGEST_SIZE = 10**18
"""A size no result reaches: the error result it names is the longest one (`_room_for`)."""


def _record(c: RunController, call_id: str, result: Any,
            failure: Callable[[str], JSON]) -> tuple[JSON, bool]:
    """Record ``result`` (as the SDK would send it) as the call's output; returns what to
    send, and whether that is a failure recorded in its place: a result the log cannot
    hold is recorded as ``failure(why)``, an error result the model sees, so a call is
    never left in doubt by the library's own limits."""
    try:
        sent = _sendable(result)
    except (TypeError, ValueError, RecursionError) as error:
        sent = failure(_UNSENDABLE.format(error=type(error).__name__))
    else:
        try:
            c.tool_completed(call_id, sent)
            return sent, False
        except SchemaError:  # over max_bytes or max_depth: nothing was recorded
            sent = failure(_TOO_LARGE.format(size=len(canonical_json(sent))))
    c.tool_completed(call_id, sent)
    return sent, True


def _tool_result(call_id: str, content: JSON, error: bool) -> dict[str, JSON]:
    block: dict[str, JSON] = {"type": "tool_result", "tool_use_id": call_id,
                              "content": content}
    if error:
        block["is_error"] = True
    return block


def _as_tool_result(c: RunController, call_id: str, recorded: JSON) -> JSON:
    """A recorded output as the call's ``tool_result`` block: a block recorded by this
    adapter as it is; anything else (an operator's ``resolve_in_doubt`` output: text or
    JSON, from any process) made into one, so a run settled from outside goes on: its
    content as `_content_of` makes a tool's return value, ``is_error`` for a ``FAILED``
    resolution (its output is the error the model sees)."""
    if isinstance(recorded, dict) and recorded.get("type") == "tool_result" and recorded.get(
            "tool_use_id") == call_id:
        return recorded
    return _tool_result(call_id, recorded if _blocks(recorded) else _content_of(recorded),
                        resolution(c, call_id) is Resolution.FAILED)


def _session_content(value: Any) -> Any:
    """A tool's return value as the session runner can post it: text and lists of content
    blocks as they are (pydantic blocks dumped); anything else (a pydantic model, a dict, a
    number), which the SDK's session runner fails on after the tool ran, as its JSON text."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list | tuple) and value and all(
            isinstance(item, Mapping | pydantic.BaseModel) for item in value):
        listed = [dict(item) if isinstance(item, Mapping) else _sendable(item)
                  for item in value]
        if _blocks(listed):
            return listed
    return _content_of(value)


def _as_result_event(c: RunController, event: Any, recorded: JSON) -> JSON:
    """A recorded output as the call's result event: an event recorded by this adapter as
    it is; anything else (an operator's ``resolve_in_doubt`` output, from any process)
    made into the event the SDK would post for that content, ``is_error`` for a
    ``FAILED`` resolution."""
    if isinstance(recorded, dict) and recorded.get("type") in (
            "user.custom_tool_result", "user.tool_result") and event.id in (
            recorded.get("custom_tool_use_id"), recorded.get("tool_use_id")):
        return recorded
    content = recorded if _blocks(recorded) else _content_of(recorded)
    blocks, _ = _to_session_content(cast(Any, content))
    return cast(JSON, _build_result_event(event, blocks,
                                          resolution(c, event.id) is Resolution.FAILED))


# ------------------------------------------------------------ the conversation's end


_REPLIES: dict[str, type[pydantic.BaseModel]] = {
    kind.__name__: kind for kind in (ParsedMessage, Message, ParsedBetaMessage, BetaMessage)}
"""The SDK's reply types a recorded final reply is rebuilt as, the more specific first."""


def _kind(reply: Any) -> str | None:
    """The name of ``reply``'s SDK type in `_REPLIES` (a generic ``ParsedBetaMessage[T]``
    is a ``ParsedBetaMessage``); None for anything else, which is replayed as JSON."""
    return next((name for name, kind in _REPLIES.items() if isinstance(reply, kind)), None)
_NOT_FINAL = frozenset({"tool_use", "pause_turn", "compaction"})
"""Stop reasons after which the conversation goes on (the SDK's tool runner sends the next
request after each)."""


def _final(reply: Any) -> bool:
    """A reply that ends the conversation: an assistant message without ``tool_use`` whose
    stop reason is not one the SDK's tool runner continues after."""
    return (_field(reply, "type") == "message" and _field(reply, "role") == "assistant"
            and _field(reply, "stop_reason") not in _NOT_FINAL
            and not _tool_uses(_field(reply, "content")))


def _compacting(runner: Any) -> bool:
    """Whether an SDK tool runner's request under way is a compaction's (scheduled with
    ``compact_before_next_turn``): it goes out on a fork of the runner's thread, carrying
    the whole conversation, and its answer replaces the messages the runner sends next."""
    return getattr(runner, "_messages_being_compacted", None) is not None


def _digests(messages: Iterable[Any]) -> list[JSON]:
    """One digest per message, of its JSON as the SDK sends it: what tells a request of
    the recorded conversation (or a start of it) from any other."""
    return [hashlib.sha256(canonical_json(_sendable(message))).hexdigest()[:32]
            for message in messages]


def _finished(c: RunController, output: JSON, end: Callable[[], None] | None = None
              ) -> bool:
    """Record ``output`` as the run's final output and complete it, when nothing is left
    to run or post (True); otherwise record nothing (False). Each step goes on from where
    an earlier process that died recording the end left it. ``end``: what completes a run
    with a Session (its last publication), in place of ``complete``."""
    if c.in_flight or c.in_doubt() or c.unpublished_call_ids():
        return c.step is Step.COMPLETED
    if c.step is Step.RUN_AGAIN:
        # no call was asked for: the model's answer is the whole conversation
        c.begin_model_call()
    if c.step is Step.AWAITING_MODEL:
        c.model_responded(output=output)
    if c.step in (Step.TOOLS, Step.FINALIZING):
        c.accept_final_output(output)
    if c.step is Step.FINAL_OUTPUT:
        if end is None:
            c.complete()
        else:
            end()
    return c.step is Step.COMPLETED


def _end_recorded(c: RunController) -> bool:
    """Whether the run's end is recorded: completed, or (an earlier process died while it
    recorded the end) its final answer recorded, the run then completed here."""
    if c.step is Step.FINALIZING:
        c.accept_final_output(c.model_output)
    if c.step is Step.FINAL_OUTPUT:
        c.complete()
    return c.step is Step.COMPLETED


def _replayed(c: RunController, what: str) -> None:
    if switch.logging:
        run_logger(c.run_id).info("replayed", action=what,
                                  note="the run completed earlier: its recorded result, "
                                       "nothing sent, no tool run")


# ------------------------------------------------------------- managed sessions


class _Answered(set[str]):
    """The runner's set of answered call ids; an id the server shows answered is recorded
    as posted in the ledger, so its cached result is never sent again."""

    def __init__(self, items: Iterable[str], on_add: Callable[[str], None]) -> None:
        super().__init__(items)
        self._on_add = on_add

    def add(self, item: str) -> None:
        super().add(item)
        self._on_add(item)


_SESSION_ENDS = frozenset({"session.status_terminated", "session.deleted"})


class _WatchedEvents:
    """The session's events resource, whose live streams report each event they deliver
    (the runner learns from them that the session ended)."""

    def __init__(self, events: Any, on_event: Callable[[Any], None]) -> None:
        self._events = events
        self._on_event = on_event

    def __getattr__(self, name: str) -> Any:
        return getattr(self._events, name)

    async def stream(self, *args: Any, **kwargs: Any) -> _WatchedStream:
        return _WatchedStream(await self._events.stream(*args, **kwargs), self._on_event)


class _WatchedStream:
    def __init__(self, stream: Any, on_event: Callable[[Any], None]) -> None:
        self._stream = stream
        self._on_event = on_event

    async def __aenter__(self) -> _WatchedStream:
        await self._stream.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> Any:
        return await self._stream.__aexit__(*exc)

    async def __aiter__(self) -> AsyncIterator[Any]:
        async for event in self._stream:
            self._on_event(event)
            yield event


class _SendableTool:
    """A tool whose return value the session runner can post (`_session_content`); it
    runs as the SDK runs the tool it wraps. ``answered`` says whether the body ended with
    an answer (a value, or an ordinary exception it raised): a body the runner's timeout
    cancelled has none, and may still be running its effect."""

    def __init__(self, tool: Any) -> None:
        self._tool = tool
        self.name = tool.name
        self.answered = False

    async def call(self, input_: dict[str, object]) -> Any:
        try:
            value = await run_runnable_tool(self._tool, input_)
        except Exception:
            self.answered = True
            raise
        self.answered = True
        return _session_content(value)


class LedgerSessionToolRunner(SessionToolRunner):
    """The SDK's managed-session tool runner with the ledger under its tool calls: a result
    is recorded before it is posted; after a reconnect a recorded result is re-posted,
    never recomputed; a started, unfinished call is in doubt and stops the runner with
    `ToolInDoubt` (fails closed); with a store all of this holds across process restarts.
    Once the session has ended (the event the SDK stops on) and every result is posted,
    the run is completed; iterating a completed run yields nothing, opens no stream, runs
    no tool, and sets ``replayed``.

    Open it with `open` (loads the run from ``store`` when it exists, else starts it) and
    iterate it like the SDK's runner (``async for call in runner``, or ``until_done()``).
    Every iteration may raise the controller's refusals as themselves (never inside an
    exception group): `ToolInDoubt`, `RunNotResumable`, `ConcurrencyConflict`,
    `StorageError`, `SchemaError` (no room in the log for a call: it did not run)."""

    def __init__(self, client: AsyncAnthropic, session_id: str, *,
                 tools: Sequence[Any], controller: RunController, existing: bool = True,
                 idempotent: Collection[str] = (), owner: str | None = None,
                 verifiers: Mapping[str, Verifier] | None = None, **options: Any) -> None:
        checked = checked_verifiers(verifiers, _names(tools), idempotent=idempotent,
                                    run_id=controller.run_id)
        _refuse_mcp(tools, controller.run_id, "open", controller.step)
        super().__init__(client, session_id, tools=tools, **options)
        self.controller = controller
        self.replayed = False
        """True when the last iteration found the run completed: nothing was opened,
        run or posted."""
        self._idempotent = frozenset(idempotent)
        self._attempt = Attempt(controller, resumes=existing, owner=owner, verifiers=checked)
        self._ended: str | None = None

    @classmethod
    async def open(cls, client: AsyncAnthropic, session_id: str, *, tools: Sequence[Any],
                   store: EventStore | AsyncEventStore | None = None,
                   run_id: str | None = None, idempotent: Collection[str] = (),
                   owner: str | None = None, buffered: bool = True,
                   verifiers: Mapping[str, Verifier] | None = None,
                   **options: Any) -> LedgerSessionToolRunner:
        """The runner for ``session_id``, on the run ``run_id`` (default
        ``"anthropic-session:" + session_id``): loaded from ``store`` when it holds it (an
        earlier process ran it), else started. ``idempotent`` names the tools that may run
        again after a crash inside them; every other tool's unfinished call is in doubt.
        ``buffered=True`` (the default, DESIGN §7.7) appends the ledger's events only at
        effect boundaries (before a tool runs, before its result is posted, when the
        iteration ends: one transaction each); ``buffered=False``, one per event; an
        async store is always buffered. ``verifiers``
        (by tool name: ``verify(context) -> Completed(output) | NotExecuted() |
        Unknown()``, sync or async, `statemachine.verifiers`) are asked, on each iteration
        right after its claim, what happened to a call of their tool left in doubt; a
        tool's body finds its call's idempotency key in `statemachine.tool_context()`. A
        verifier naming none of ``tools``, or not callable, is refused (`InvalidVerifier`)
        before anything is recorded. ``options`` go to the SDK runner (``max_idle``,
        ``environment_key``, ``extra_headers``)."""
        run_id = run_id or f"anthropic-session:{session_id}"
        _refuse_mcp(tools, run_id, "open")  # before any load or claim
        checked_verifiers(verifiers, _names(tools), idempotent=idempotent, run_id=run_id)
        controller, existing = await _open_async(run_id, store, buffered)
        return cls(client, session_id, tools=tools, controller=controller, existing=existing,
                   idempotent=idempotent, owner=owner, verifiers=verifiers, **options)

    @property
    def owner(self) -> str | None:
        """Who claims the run: recorded by every claim (``RunClaimed(owner)``)."""
        return self._attempt.owner

    async def resolve_in_doubt(self, call_id: str, output: JSON = None, *,
                               outcome: Resolution = Resolution.COMPLETED,
                               by: str | None = None, evidence: str | None = None) -> None:
        """Record what happened to a call in doubt (`RunController.resolve_in_doubt`):
        ``COMPLETED`` (``output`` is posted as the call's result), ``FAILED`` (``output``
        is posted as an error result, ``is_error``) or ``NOT_EXECUTED`` (no output: the
        next iteration runs the tool, once). Claims the run first as ``by`` (else this
        runner's owner), durable before it returns; a refusal (`InvalidTransition` for a
        call not in doubt, `SchemaError`, `ConcurrencyConflict`) records nothing."""
        c = self.controller
        await decide_async(c, by if by is not None else self.owner,
                           resolving(c, call_id, output, outcome=outcome, by=by,
                                     evidence=evidence))

    async def abandon(self, reason: str, *, by: str | None = None) -> None:
        """End the run for good (`RunController.abandon`), claimed first like
        `resolve_in_doubt`; its calls in doubt stay as they are, unposted."""
        c = self.controller
        await decide_async(c, by if by is not None else self.owner, abandoning(reason, by=by))

    # the SDK assigns a fresh set when it starts; the ledger listens to it
    @property
    def _answered(self) -> set[str]:
        return self.__dict__["_ledger_answered"]  # type: ignore[no-any-return]

    @_answered.setter
    def _answered(self, value: Iterable[str]) -> None:
        self.__dict__["_ledger_answered"] = _Answered(value, self._acknowledge)

    # ... and its events resource, whose streams tell the session's end
    @property
    def _events(self) -> Any:
        return self.__dict__["_ledger_events"]

    @_events.setter
    def _events(self, value: Any) -> None:
        self.__dict__["_ledger_events"] = _WatchedEvents(value, self._note)

    def _note(self, event: Any) -> None:
        if _field(event, "type") in _SESSION_ENDS:
            self._ended = _field(event, "type")

    def _acknowledge(self, call_id: str) -> None:
        c = self.controller
        if c.phase(call_id) is Phase.COMPLETED:
            c.result_posted(call_id)

    async def __aiter__(self) -> AsyncGenerator[DispatchedToolCall, None]:
        c = self.controller
        self.replayed = c.step is Step.COMPLETED
        if self.replayed:  # a session that ended: nothing to claim, open, run or post
            _replayed(c, "iterate")
            return
        async with self._attempt:  # an existing run is claimed first, before any effect
            if _end_recorded(c):  # an earlier process died recording the end: finish it
                self.replayed = True
                _replayed(c, "iterate")
                return
            try:
                c.resume()  # the gate: RunNotResumable, or ToolInDoubt for a call in doubt
                self._ended = None
                # closing this iterator closes the SDK's in the same task (anyio needs it)
                sdk_calls = cast(AsyncGenerator[DispatchedToolCall, None], super().__aiter__())
                async with contextlib.aclosing(sdk_calls) as calls:
                    async for call in calls:
                        yield call
                if self._ended is not None:
                    _finished(c, {"session_id": self.session_id, "ended": self._ended})
            except BaseExceptionGroup as group:
                refusal = _refusal_in(group)
                if refusal is not None:
                    raise refusal from None
                if group.split(GeneratorExit)[1] is None:
                    return  # the consumer closed the iterator early: the SDK runner stopped
                raise

    async def _call_tool(self, tool: Any, ev: Any, input_: dict[str, object]) -> Any:
        c = self.controller
        call_id: str = ev.id
        arguments = plain(input_, fallback=_as_is)
        _receive(c, call_id, ev.name, arguments, self._idempotent)

        def failure(why: str) -> JSON:
            return cast(JSON, _build_result_event(ev, [{"type": "text", "text": why}], True))

        done, result = begin_call(c, call_id, arguments)  # ToolInDoubt: started, unfinished
        if done:  # posted before, or it ran: the cached result, never a second run
            event = _as_result_event(c, ev, result)
            return event, _field(event, "content")
        try:
            await c.flush_async()  # an effect boundary: the start is durable first
            sendable = _SendableTool(tool)
            with running_call(c, call_id):  # tool_context() in the body
                result_event, recorded = await super()._call_tool(cast(Any, sendable), ev,
                                                                  input_)
            if not sendable.answered and call_id not in self._idempotent:
                # the runner's timeout (TOOL_TIMEOUT) cancelled the body, whose effect may
                # have happened or may still happen (a sync tool's thread runs on): its
                # "timed out" text is no answer, so the call is in doubt, never re-run
                interrupted(c, call_id)
                begin_call(c, call_id, arguments)  # ToolInDoubt, as a reloaded run says
            event, failed = _record(c, call_id, result_event, failure)
            await c.flush_async()  # the result is durable before it is posted
        except BaseException:
            interrupted(c, call_id)
            raise
        return event, _field(event, "content") if failed else recorded

    async def _send_result(self, tool_result: Any, tool_use_id: str,
                           conversation_id: str | None) -> bool:
        c = self.controller
        sent = await super()._send_result(tool_result, tool_use_id, conversation_id)
        if not sent and c.phase(tool_use_id) is Phase.COMPLETED:
            c.result_post_failed(tool_use_id, ResultNotPosted)
        return sent


def _refusal_in(group: BaseExceptionGroup[Any]) -> ControlError | None:
    """The controller's refusal inside the task group's exception group, if any."""
    for error in group.exceptions:
        if isinstance(error, ControlError):
            return error
        if isinstance(error, BaseExceptionGroup):
            found = _refusal_in(error)
            if found is not None:
                return found
    return None


# ----------------------------------------------------------------------- messages


def _tool_uses(content: Any) -> list[Any]:
    if isinstance(content, str) or content is None:
        return []
    return [block for block in content if _field(block, "type") == "tool_use"]


def _missing(c: RunController, messages: Sequence[Any]) -> list[str]:
    """The calls whose result is recorded and unsent (a request carrying it marks it
    posted) and whose ``tool_use`` ``messages`` lack: the history is older than the run.
    One that holds it carries its result too (`check_history`)."""
    unsent = c.unpublished_call_ids()
    if not unsent:
        return []
    asked = {str(_field(block, "id")) for message in messages
             if _field(message, "role") == "assistant"
             for block in _tool_uses(_field(message, "content"))}
    return [call_id for call_id in unsent if call_id not in asked]


_STALE = {
    "not-kept": "this ledger never saw the reply that asked for them (the log keeps the "
                "calls and their results, not the reply's other blocks)",
    "thinking": "the reply that asked for them held thinking blocks, whose signatures the "
                "ledger does not keep",
    "diverged": "the history differs from every request this ledger saw answered with "
                "calls, other than by the missing turns",
    "unanswered": "a call of the reply that asked for them has no recorded result",
}


def _stale(c: RunController, missing: Sequence[str], why: str) -> StaleHistory:
    return StaleHistory(
        f"the history is older than the run: it lacks the tool_use of {len(missing)} "
        f"call(s) whose result is recorded and was never sent (first: "
        f"{excerpt(missing[0])}), and the turns that asked for them cannot be rebuilt "
        f"exactly: {_STALE[why]}. Sent as it is, the model would ask again under a new id "
        "and the tool would run twice; nothing was sent. Send the history holding the "
        "reply that asked for them, answered by run_tools (from the ledger), or abandon "
        "the run", call_ids=missing, why=why, run_id=c.run_id, step=c.step,
        action="create")


_THINKING = frozenset({"thinking", "redacted_thinking"})


def _message(message: Any) -> JSON:
    """A message as a history keeps it: its ``role`` and ``content`` as the SDK sends
    them (an SDK reply appended whole and its ``to_param()`` are one message), without
    the ``cache_control`` marks of its blocks (and of a tool result's blocks): a prompt
    cache breakpoint belongs to a request, and moves from one to the next."""
    kept = _sendable({"role": _field(message, "role"), "content": _field(message, "content")})
    for block in _content_blocks(kept):
        block.pop("cache_control", None)
        for inner in _content_blocks(block):
            inner.pop("cache_control", None)
    return kept


def _content_blocks(value: JSON) -> list[dict[str, JSON]]:
    """The blocks of ``value``'s ``content`` (a message's, a tool result's) that are
    objects; none for content given as text."""
    content = value.get("content") if isinstance(value, dict) else None
    return [block for block in content if isinstance(block, dict)] if isinstance(
        content, list) else []


def _turn_key(messages: Sequence[Any]) -> str:
    """A request's messages as the SDK sends them (role and content: an SDK reply appended
    whole and its ``to_param()`` are one message), as one digest."""
    return hashlib.sha256(canonical_json(_sendable(
        [{"role": _field(message, "role"), "content": _field(message, "content")}
         for message in messages]))).hexdigest()


def _result_ids(message: Any) -> set[str]:
    content = _field(message, "content")
    if _field(message, "role") != "user" or isinstance(content, str) or content is None:
        return set()
    return {str(_field(block, "tool_use_id")) for block in content
            if _field(block, "type") == "tool_result"}


class MessageToolLedger:
    """The tool ledger around a client-side messages loop, keyed by ``tool_use`` id.

    ``tools`` are the SDK's runnable tools (``@beta_tool`` / ``@beta_async_tool``, or
    anything with ``.name`` and ``.call(input)``). `run_tools` / `arun_tools` answer a
    reply's ``tool_use`` blocks: a new call runs once (its start durable first, its result
    recorded right after), a finished call is answered from the cache and never runs again,
    a started, unfinished call raises `ToolInDoubt` before any call of the reply runs.
    `create` / `acreate` send a request only if every ``tool_use`` in its history is
    answered (`UnansweredToolUse` otherwise) and no call is in doubt (`ToolInDoubt`); a
    history lacking the ``tool_use`` of a call whose result is recorded and unsent is sent
    with the turns it lacks (`resumed`), or refused (`StaleHistory`: sent as it is, the
    model would ask again, and the tool run twice); the results a request carries are
    durable before it is sent, and recorded as posted once its reply came whole; the final reply
    completes the run, and a request of a completed conversation is answered with its
    recorded final reply (``replayed``), nothing sent.
    """

    def __init__(self, controller: RunController, tools: Sequence[Any] = (), *,
                 idempotent: Collection[str] = (), owner: str | None = None,
                 history: Session | None = None) -> None:
        _refuse_mcp(tools, controller.run_id, "open", controller.step)
        self.controller = controller
        self.history = history
        """The Session the conversation is kept in (`open`'s ``history``), or None."""
        self._known: list[JSON] | None = None
        """The history's items as this ledger read them when it opened, followed by what
        it wrote since (the Session has one writer); None without a history."""
        self._ending: list[JSON] | None = None
        """The conversation the run's end wrote, riding with its flush until that lands
        (`_held`)."""
        same_history(controller, history, "keeping the messages yourself")
        if history is not None:
            store = cast(EventStore, controller.store)
            _refuse_history(history, store, controller._journal.buffered, controller.run_id)
            self._known = list(cast(Any, store).session_items(history.session_id))
        self.owner = owner
        """Who claims the run (`open`, `resolve_in_doubt`, `abandon`)."""
        self.tools: dict[str, Any] = {str(tool.name): tool for tool in tools}
        self.replayed = False
        """True when the last `create` (or attached runner) found the conversation
        completed and returned its recorded final reply: nothing was sent or run."""
        self._idempotent = frozenset(idempotent)
        self._turns: dict[str, JSON] = {}
        """The replies with calls this ledger saw, by the request they answered
        (`_turn_key`): the reply's content as the SDK sends it, or why it is not kept
        (``"thinking"``); what `resumed` rebuilds a history's missing turns from."""

    @classmethod
    def open(cls, run_id: str, tools: Sequence[Any] = (), *, store: EventStore | None = None,
             history: Session | None = None, idempotent: Collection[str] = (),
             owner: str | None = None, buffered: bool = True,
             verifiers: Mapping[str, Verifier] | None = None) -> MessageToolLedger:
        """The ledger of run ``run_id``: loaded from ``store`` when it holds it (and claimed
        by ``owner``: of two processes that loaded the same version one goes on; a
        completed run is not claimed, it only answers from its record), else started.
        ``buffered=True`` (the default, DESIGN §7.7): events are appended at effect
        boundaries only (before a tool runs, before a request is sent, when the
        conversation ends); ``buffered=False``, one transaction per event. ``verifiers`` (by
        tool name, each one of ``tools``: ``verify(context) -> Completed(output) |
        NotExecuted() | Unknown()``, `statemachine.verifiers`) are asked right after the
        claim what happened to a call of their tool left in doubt, and their answers made
        durable before this returns; a tool's body finds its call's idempotency key in
        `statemachine.tool_context()`. An async verifier needs `open_async`; a verifier
        naming none of ``tools``, or not callable, is refused (`InvalidVerifier`) before
        anything is recorded. ``history``: a Session the conversation is kept in, written
        with the run's end in the append that completes it (`messages`): a `SQLiteSession`
        on the store's file or a `PostgresSession` on its schema, for a buffered run
        (`UnsupportedFeature`, ``feature="history"``, otherwise); a run the store holds
        opened with a history not its own, or without the one it has, is refused
        (`HistoryMismatch`), nothing claimed."""
        checked = checked_verifiers(verifiers, _names(tools), idempotent=idempotent,
                                    run_id=run_id, sync_only="MessageToolLedger.open_async")
        _refuse_mcp(tools, run_id, "open")  # before any load or claim
        _refuse_history(history, store, buffered, run_id)
        controller, existing = _open_sync(run_id, store, buffered, history)
        if existing and controller.step is not Step.COMPLETED:
            controller.claim(owner)
            controller.flush()  # durable before any effect, the verifiers' questions too
            if checked:
                verify_in_doubt(controller, checked)
                controller.flush()
        return cls(controller, tools, idempotent=idempotent, owner=owner, history=history)

    @classmethod
    async def open_async(cls, run_id: str, tools: Sequence[Any] = (), *,
                         store: EventStore | None = None, history: Session | None = None,
                         idempotent: Collection[str] = (), owner: str | None = None,
                         buffered: bool = True,
                         verifiers: Mapping[str, Verifier] | None = None,
                         verify_timeout: float | None = VERIFY_TIMEOUT) -> MessageToolLedger:
        """`open` for verifiers that may be async (for a loop on ``client.messages`` of an
        async client, or an async tool runner): each verifier is given ``verify_timeout``
        seconds, after which its call stays in doubt."""
        checked = checked_verifiers(verifiers, _names(tools), idempotent=idempotent,
                                    run_id=run_id)
        _refuse_history(history, store, buffered, run_id)
        controller, existing = _open_sync(run_id, store, buffered, history)
        if existing and controller.step is not Step.COMPLETED:
            controller.claim(owner)
            await controller.flush_async()
            if checked:
                await verify_in_doubt_async(controller, checked, timeout=verify_timeout)
                await controller.flush_async()
        return cls(controller, tools, idempotent=idempotent, owner=owner, history=history)

    # --------------------------------------------------------------- the operator

    def resolve_in_doubt(self, call_id: str, output: JSON = None, *,
                         outcome: Resolution = Resolution.COMPLETED, by: str | None = None,
                         evidence: str | None = None) -> None:
        """Record what happened to a call in doubt (`RunController.resolve_in_doubt`):
        ``COMPLETED`` (``output`` is the call's ``tool_result`` content), ``FAILED``
        (``output`` is sent as an error result, ``is_error``) or ``NOT_EXECUTED`` (no
        output: the next `run_tools` runs the tool, once). Claims the run first as ``by``
        (else the ledger's owner), durable before it returns; a refusal
        (`InvalidTransition` for a call not in doubt, `SchemaError`, `ConcurrencyConflict`)
        records nothing."""
        c = self.controller
        decide(c, by if by is not None else self.owner,
               resolving(c, call_id, output, outcome=outcome, by=by, evidence=evidence))

    def abandon(self, reason: str, *, by: str | None = None) -> None:
        """End the run for good (`RunController.abandon`), claimed first like
        `resolve_in_doubt`: every later request or tool run is refused."""
        c = self.controller
        decide(c, by if by is not None else self.owner, abandoning(reason, by=by))

    # ------------------------------------------------------------------ history

    @property
    def messages(self) -> list[JSON]:
        """The conversation the history holds (``history`` given at `open`), as this
        ledger read it when it opened, with the turns it wrote since: each message its
        ``role`` and ``content`` as the SDK sends them, without the request-only
        ``cache_control`` marks (a copy). A request goes on from it: ``messages=[*ledger.
        messages, new user message]``. Empty without a history."""
        known = self._held()
        return [] if known is None else json.loads(json.dumps(known))

    def _held(self) -> list[JSON] | None:
        """`_known`, with the conversation the run's end wrote once its flush landed
        (everything the controller recorded is in the store: nothing buffered, no
        commit waiting with its write; a refused or undecided flush leaves both)."""
        known, ending = self._known, self._ending
        journal = self.controller._journal
        if (known is not None and ending is not None and journal.write is None
                and not journal.unflushed):
            known.extend(ending)
            self._ending = None
        return known

    def _goes_on(self, messages: Sequence[Any]) -> list[JSON]:
        """Before every request: `HistoryMismatch` (nothing sent) unless ``messages``
        begin with the conversation the history holds, since the run's end writes the
        messages after it there (`_conversation`), so a request built on another start
        would write a conversation the model never had; and `SchemaError` (nothing sent)
        when the messages after it are more than the run's log can hold with its end, as
        the end would find once the model answered (a run that could then never
        complete): nested past ``max_depth``, or past the room left under
        ``max_bytes``. The messages after it, as the history would keep them (none
        without a history)."""
        known = self._held()
        if known is None:
            return []
        n = len(known)
        head = list(messages[:n])
        c = self.controller
        try:
            same = len(head) == n and (head == known
                                       or [_message(message) for message in head] == known)
        except (TypeError, ValueError, RecursionError):
            same = False  # not messages the SDK could send: not the history's
        if not same:
            raise HistoryMismatch(
                f"the request's messages do not begin with the {n} message(s) the history "
                f"{excerpt(str(c.session_id))} holds: the run's end writes its messages "
                "after them; send ledger.messages followed by the new turn. Nothing was "
                "sent", run_id=c.run_id, step=c.step, action="create")
        # (a message the SDK's encoder refuses raises here, as the request would)
        added = [_message(message) for message in messages[n:]]
        depth = c._journal.limits.max_depth
        sizes = [walk_size(item, depth) for item in added]
        if None in sizes:
            problem = (f"a message is nested deeper than max_depth={depth}, or holds a "
                       "value JSON cannot write")
        else:
            size = sum(cast(list[int], sizes))
            left = room(c)
            if size + STAGED_BYTES <= left:
                return added
            problem = (f"its {len(added)} message(s) after the history take {size} bytes, "
                       f"and the run may record only {left} more under max_bytes")
        raise SchemaError(
            f"the conversation could not be kept in the history with the run's end "
            f"({problem}); nothing was sent. This run cannot end with its conversation "
            "kept: abandon it, and keep such a conversation yourself (a run without a "
            "history)", run_id=c.run_id, step=c.step, action="create")

    def _conversation(self, messages: Sequence[Any], reply: Any) -> list[JSON] | None:
        """The messages the run's end writes to the history: the request's after what
        the history holds, and the final reply; None without a history."""
        if self._held() is None:
            return None
        return [*self._goes_on(messages),
                _message({"role": "assistant", "content": _field(reply, "content")})]

    def _end_with(self, items: list[JSON]) -> Callable[[], None]:
        """What completes the run with a history (see `_finished`): ``items`` staged as
        the run's last publication against the history as this ledger knows it, and
        committed with their write riding with the end's flush, one transaction: the
        conversation lands with the run's end, or neither does."""
        def end() -> None:
            c = self.controller
            known = self._held()
            assert known is not None
            assert self.history is not None
            try:
                tail, whole = stage_known(c, items, known)
                publication_id = c.publication_id
                assert publication_id is not None
                c.publication_committed(session_write=SessionWrite(
                    self.history.session_id, publication_id, tuple(items), tail, whole),
                    ride=True)
            except BaseException as error:
                # the final answer is recorded in this controller, and must not land
                # without its conversation: nothing it buffered is recorded (load the
                # run again to go on)
                reason = (f"the conversation could not be written with the run's end "
                          f"({type(error).__name__}): nothing of the end was recorded; "
                          "open the run again")
                c._journal.stop(InvalidTransition, reason)
                raise
            self._ending = items  # (in the history once the end's flush lands)

        return end

    def check_history(self, messages: Iterable[Any]) -> None:
        """`UnansweredToolUse` unless every assistant ``tool_use`` is answered by a
        ``tool_result`` in the user message right after it, and no ``tool_result`` answers
        a call the ledger holds to run again (started by an earlier process that never
        recorded its result, idempotent: so not in doubt; or resolved ``NOT_EXECUTED``):
        such a result is not the ledger's, and with it sent the run could never end."""
        history = list(messages)
        c = self.controller
        missing: list[str] = []
        for index, message in enumerate(history):
            if _field(message, "role") != "assistant":
                continue
            answered = _result_ids(history[index + 1]) if index + 1 < len(history) else set()
            missing += [str(_field(block, "id")) for block in _tool_uses(
                _field(message, "content")) if str(_field(block, "id")) not in answered]
            unheld = sorted(call_id for call_id in answered
                            if c.phase(call_id) in (Phase.STARTED, Phase.APPROVED)
                            and call_id not in c.in_doubt())
            if unheld:
                raise UnansweredToolUse(
                    f"the history answers {len(unheld)} call(s) with a result the ledger "
                    f"does not hold (first: {excerpt(unheld[0])}): each is to run again "
                    "(its run was never recorded, or it was resolved not executed); answer "
                    "the reply with run_tools, never with a saved answer; nothing was sent",
                    run_id=c.run_id, step=c.step, action="create")
        if missing:
            doubt = [call_id for call_id in missing if call_id in c.in_doubt()]
            why = (f"; {len(doubt)} of them in doubt (started, never completed): record "
                   "their outcome with resolve_in_doubt, never re-run them") if doubt else ""
            raise UnansweredToolUse(
                f"the history holds {len(missing)} tool_use block(s) without a tool_result "
                f"(first: {missing[0]!r}){why}; nothing was sent",
                run_id=c.run_id, step=c.step, action="create")

    def _posted(self, messages: Iterable[Any]) -> None:
        c = self.controller
        for message in messages:
            for call_id in sorted(_result_ids(message)):
                if c.phase(call_id) is Phase.COMPLETED:
                    c.result_posted(call_id)

    def _recorded(self, messages: Sequence[Any], *, stream: bool = False) -> JSON:
        """Before a request: the record of the final reply (``{"kind", "reply",
        "request"}``) when the conversation completed and ``messages`` are its own (or a
        start of them); None when the run goes on. `RunNotResumable` for a completed run
        asked anything else, and for an abandoned run (nothing is sent)."""
        c = self.controller
        self.replayed = False
        if not _end_recorded(c):
            _refuse_abandoned(c, "create")
            return None
        record = c.final_output
        if not isinstance(record, dict) or not isinstance(record.get("request"), list):
            raise RunNotResumable("the run is completed, and not by a messages conversation "
                                  "of this adapter; nothing was sent", run_id=c.run_id,
                                  step=c.step, action="create")
        try:
            asked = _digests(messages)
        except (TypeError, ValueError, RecursionError):
            asked = []  # not a history the SDK could send: not the recorded one
        if stream or not asked or asked != record["request"][:len(asked)]:
            why = ("a streamed request gets no recorded reply: ask without stream=True"
                   if stream and asked else
                   "a new user turn after its end, or another conversation, is a new run: "
                   "open the ledger with a new run_id")
            raise RunNotResumable(
                f"this run's conversation ended with its recorded final reply, and this "
                f"request is not one of its own; {why}. Nothing was sent",
                run_id=c.run_id, step=c.step, action="create")
        _replayed(c, "create")
        self.replayed = True
        return record

    def _keep_turn(self, messages: Sequence[Any], reply: Any) -> None:
        """Keep ``reply`` (when it asks for calls) as the answer to ``messages``, so a
        history saved before it can be resumed (`resumed`); a reply with thinking blocks is
        kept as ``"thinking"`` only (their signatures are not kept), and one this adapter
        cannot send as JSON is not kept."""
        content = _field(reply, "content")
        if not _tool_uses(content):
            return
        try:
            key = _turn_key(messages)
            kept: JSON = ("thinking" if any(_field(block, "type") in _THINKING
                                            for block in content) else _sendable(content))
        except (TypeError, ValueError, RecursionError):
            return
        self._turns[key] = kept

    def _keep_sent(self, messages: Sequence[Any]) -> None:
        """Before a tool runner's request: keep the reply it answers (the assistant turn
        before its last message, that turn's results), as `create` keeps a reply when it
        comes (a runner's reply is whole only once its stream ends, after its calls ran
        when they run eagerly)."""
        if (len(messages) > 2 and _field(messages[-2], "role") == "assistant"
                and _result_ids(messages[-1])):
            self._keep_turn(messages[:-2], messages[-2])

    def resumed(self, messages: Iterable[Any]) -> list[Any]:
        """The messages to send for ``messages``: as they are, unless they lack the
        ``tool_use`` of a call whose result is recorded and was never sent (a history saved
        before the reply that asked for it, as a caller retrying a failed request with the
        list it had holds), then followed by the turns they lack, rebuilt exactly: each
        reply this ledger saw answer the history so far (its content as it came) and the
        user message of its calls' recorded results (what `run_tools` returned), until no
        such call is missing. Nothing runs. `StaleHistory` (``why`` says which) when that
        cannot be exact: the reply was seen by another process only (``"not-kept"``), held
        thinking blocks (``"thinking"``), the history differs from every request this
        ledger saw answered (``"diverged"``), or a call of a reply has no recorded result
        (``"unanswered"``)."""
        c = self.controller
        history = list(messages)
        missing = _missing(c, history)
        if not missing:
            return history
        resumed = list(history)
        while missing:
            try:
                kept = self._turns.get(_turn_key(resumed))
            except (TypeError, ValueError, RecursionError):
                kept = None
            if kept is None:
                raise _stale(c, missing, "diverged" if self._turns else "not-kept")
            if isinstance(kept, str):
                raise _stale(c, missing, kept)
            results: list[JSON] = []
            for use in _tool_uses(kept):
                call_id = str(_field(use, "id"))
                if c.phase(call_id) not in (Phase.COMPLETED, Phase.PUBLISHED):
                    raise _stale(c, missing, "unanswered")
                results.append(_as_tool_result(c, call_id, c.call(call_id).result))
            resumed += [{"role": "assistant", "content": kept},
                        {"role": "user", "content": results}]
            missing = _missing(c, resumed)
        if switch.logging:
            run_logger(c.run_id).info("resumed", action="create",
                                      turns=(len(resumed) - len(history)) // 2,
                                      note="the history lacked turns the ledger holds: "
                                           "rebuilt from the ledger, nothing run again")
        return resumed

    def _before_request(self, messages: list[Any]) -> list[Any]:
        """The gates before a request, and the messages to send (`resumed`)."""
        self._goes_on(messages)
        self.check_history(messages)
        _refuse_in_doubt(self.controller, "create")
        resumed = self.resumed(messages)
        return messages if len(resumed) == len(messages) else resumed

    def _after_reply(self, messages: Sequence[Any], reply: Any) -> bool:
        """The request was answered: the results it carried are posted, and a final reply
        ends the conversation: recorded, the run completed (True; the caller flushes)."""
        c = self.controller
        self._posted(messages)
        if not _final(reply):
            return False
        try:
            record: JSON = {"kind": _kind(reply), "reply": _sendable(reply),
                            "request": _digests(messages)}
            items = self._conversation(messages, reply)
        except (TypeError, ValueError, RecursionError):
            return False  # a reply or history this adapter cannot record: the run goes on
        return _finished(c, record, None if items is None else self._end_with(items))

    def _end_before_compaction(self, messages: Sequence[Any], last: Any) -> bool:
        """Before a tool runner's compaction request: when ``last``, the reply to the
        request of ``messages``, ended the conversation, the run's end is recorded from
        them (True: the caller flushes), so the run is completed, and durably, before the
        compaction is sent, whatever it answers. A compaction before the first request, or
        after a reply that asks for calls, records nothing (False)."""
        return last is not None and _final(last) and self._after_reply(messages, last)

    def create(self, resource: Any, /, **params: Any) -> Any:
        """``resource.create(**params)`` (``client.messages`` or ``client.beta.messages``)
        after `check_history`, the in-doubt gate and the stale-history check: a history
        that lacks the turns whose results were never sent is sent with them, rebuilt
        from the ledger (`resumed`), or refused (`StaleHistory`, naming why); the results
        the request carries are made durable before it is sent (`RunController.
        flush_results`), posted once it is answered (with ``stream=True``, by a later
        request answered whole that carries them: a stream may break mid-body), and a
        final reply completes the run. A completed conversation's own request gets its
        recorded final reply, nothing sent (``replayed``); an abandoned run's is refused
        (`RunNotResumable`)."""
        messages = list(params.get("messages") or ())
        recorded = self._recorded(messages, stream=bool(params.get("stream")))
        if recorded is not None:
            self.controller.flush()  # the recorded end made durable
            return _reply(recorded)
        messages = params["messages"] = self._before_request(messages)
        # a model call needs no flush of its own (DESIGN §7.7): a crash before its reply
        # asks the model again; but the results the request carries are made durable
        # first (the wait for the model is a turn's longest), so a crash during it leaves
        # their calls completed, not in doubt; with none, this ledger must still hold the
        # run (one read, no write)
        self.controller.flush_results()
        try:
            reply = resource.create(**params)
        except BaseException:
            # the attempt ends with the request's error: what it recorded (the results
            # the request carried) is made durable first, so the next attempt, in any
            # process, answers their calls from the ledger instead of finding them in
            # doubt; the request's own error is what propagates
            with contextlib.suppress(ControlError):
                self.controller.flush()
            raise
        if params.get("stream"):
            # a stream is answered whole only once its last event is read, and it may
            # break before (an error event mid-body): the results it carries are posted by
            # the next request answered whole that carries them, so until then a retry
            # from an older history is given them (`resumed`) or refused, never sent
            # without them
            return reply
        self._keep_turn(messages, reply)
        if self._after_reply(messages, reply):
            self.controller.flush()  # the end of the conversation is durable
        return reply

    async def acreate(self, resource: Any, /, **params: Any) -> Any:
        """`create` for an async client."""
        messages = list(params.get("messages") or ())
        recorded = self._recorded(messages, stream=bool(params.get("stream")))
        if recorded is not None:
            await self.controller.flush_async()
            return _reply(recorded)
        messages = params["messages"] = self._before_request(messages)
        await self.controller.flush_results_async()  # the results it carries (`create`)
        try:
            reply = await resource.create(**params)
        except BaseException:  # what the attempt recorded made durable (`create`)
            with contextlib.suppress(ControlError):
                await self.controller.flush_async()
            raise
        if params.get("stream"):  # answered whole only once read to its end (`create`)
            return reply
        self._keep_turn(messages, reply)
        if self._after_reply(messages, reply):
            await self.controller.flush_async()
        return reply

    # -------------------------------------------------------------------- tools

    def _begin(self, tool_use: Any) -> tuple[str, JSON | None]:
        """Enter the call and ask the ledger: ``(call_id, None)`` to run it now, or
        ``(call_id, cached result block)``."""
        c = self.controller
        call_id = _field(tool_use, "id")
        name = _field(tool_use, "name")
        if not isinstance(call_id, str) or not isinstance(name, str):
            raise InvalidTransition("a tool_use block without a str id and name",
                                    run_id=c.run_id, step=c.step, action="begin_tool")
        arguments = plain(_field(tool_use, "input"), fallback=_as_is)
        _receive(c, call_id, name, arguments, self._idempotent)
        done, result = begin_call(c, call_id, arguments)
        return call_id, _as_tool_result(c, call_id, result) if done else None

    def _failure_for(self, call_id: str) -> Callable[[str], JSON]:
        return lambda why: _tool_result(call_id, why, True)

    def _result(self, call_id: str, tool_use: Any, output: Any, error: bool) -> dict[str, JSON]:
        return _tool_result(call_id, _content_of(output), error)

    def _failure(self, call_id: str, tool_use: Any, error: Exception) -> dict[str, JSON]:
        # the error result the SDK's tool runner sends: a ToolError's own content, else
        # its text of the exception
        return self._result(call_id, tool_use, tool_error_content(error), True)

    def _missing_tool(self, call_id: str, tool_use: Any) -> dict[str, JSON]:
        return self._result(call_id, tool_use,
                            f"no tool named {_field(tool_use, 'name')!r} is available", True)

    def run_tools(self, reply: Any) -> dict[str, JSON] | None:
        """The user message (``{"role": "user", "content": [tool_result, ...]}``) that
        answers every ``tool_use`` of ``reply`` (a Message or its content), in order; None
        when it has none. Sync tools only (use `arun_tools` for async ones)."""
        uses = _tool_uses(_field(reply, "content") if not isinstance(reply, list) else reply)
        if not uses:
            return None
        _refuse_in_doubt(self.controller, "run_tools")
        asynchronous = sorted({str(_field(use, "name")) for use in uses
                               if inspect.iscoroutinefunction(getattr(
                                   self.tools.get(str(_field(use, "name"))), "call", None))})
        if asynchronous:
            raise TypeError(f"run_tools runs sync tools; {', '.join(asynchronous)} "
                            "are async: use arun_tools (nothing ran)")
        blocks: list[JSON] = []
        for use in uses:
            blocks.append(self._run_one(use, self._call_sync))
        return {"role": "user", "content": blocks}

    async def arun_tools(self, reply: Any) -> dict[str, JSON] | None:
        """`run_tools` for sync and async tools."""
        uses = _tool_uses(_field(reply, "content") if not isinstance(reply, list) else reply)
        if not uses:
            return None
        _refuse_in_doubt(self.controller, "run_tools")
        blocks: list[JSON] = []
        for use in uses:
            blocks.append(await self._arun_one(use, self._call_async))
        return {"role": "user", "content": blocks}

    def _call_sync(self, use: Any) -> Any:
        call_id, tool = _field(use, "id"), self.tools.get(str(_field(use, "name")))
        if tool is None:
            return self._missing_tool(call_id, use)
        try:
            output = tool.call(_field(use, "input"))
        except Exception as error:  # a tool's failure is its result
            return self._failure(call_id, use, error)
        return self._result(call_id, use, output, False)

    async def _call_async(self, use: Any) -> Any:
        call_id, tool = _field(use, "id"), self.tools.get(str(_field(use, "name")))
        if tool is None:
            return self._missing_tool(call_id, use)
        try:
            output = await maybe_await(tool.call(_field(use, "input")))
        except Exception as error:  # a tool's failure is its result
            return self._failure(call_id, use, error)
        return self._result(call_id, use, output, False)

    def _run_one(self, use: Any, execute: Callable[[Any], Any]) -> Any:
        c = self.controller
        call_id, cached = self._begin(use)
        if cached is not None:
            return cached  # it ran: the cached result, never a second run
        try:
            c.flush()  # an effect boundary: the start is durable first
            with running_call(c, call_id):  # tool_context() in the body
                block = execute(use)
            return _record(c, call_id, block, self._failure_for(call_id))[0]
        except BaseException:
            interrupted(c, call_id)
            raise

    async def _arun_one(self, use: Any, execute: Callable[[Any], Awaitable[Any]]) -> Any:
        c = self.controller
        call_id, cached = self._begin(use)
        if cached is not None:
            return cached
        try:
            await c.flush_async()
            with running_call(c, call_id):  # tool_context() in the body
                block = await execute(use)
            return _record(c, call_id, block, self._failure_for(call_id))[0]
        except BaseException:
            interrupted(c, call_id)
            raise

    # --------------------------------------------------- the SDK's tool runner

    def attach(self, runner: _Runner) -> _Runner:
        """Put the ledger under a ``client.beta.messages.tool_runner(...)`` runner (sync or
        async, streamed or not, eager or not): each of its tool calls is ledgered by its
        ``tool_use`` id (a finished call is answered from the cache, a call in doubt raises
        `ToolInDoubt` out of the runner before its first request; a history older than the
        run gets the turns it lacks, `resumed`, or `StaleHistory`), the results each
        request carries are durable before it is sent and posted once its reply is whole
        (a stream, once the runner read it to the end), and the final reply completes the
        run. A runner of a
        completed conversation sends nothing and ends with its recorded final reply
        (``replayed``). Returns ``runner``; attach it before iterating it.

        `UnsupportedFeature` (``feature="toolsets"``, nothing attached) for a runner given
        toolsets (``BetaRunnableToolset``: a toolset member's calls are the toolset's to
        run, not the ledger's); a toolset added later is refused when its member is
        called, before it runs."""
        original = runner._run_tool
        steps = runner._steps
        c = self.controller
        _refuse_mcp(runner._runnable_tools().values(), c.run_id, "attach", c.step)
        if runner._toolsets_by_family:
            raise UnsupportedFeature(
                f"toolsets ({', '.join(sorted(runner._toolsets_by_family))}) are not "
                "ledgered by this adapter: their members would run outside the ledger; "
                "give the runner function tools", feature="toolsets", run_id=c.run_id,
                step=c.step, action="attach")
        if self._known is not None:
            if (getattr(runner, "_pending_compaction", None) is not None
                    or getattr(runner, "_messages_being_compacted", None) is not None):
                raise UnsupportedFeature(
                    "the runner has a compaction scheduled, which would replace the "
                    "messages the run's end writes to its history with a summary; with a "
                    "history it is not supported. Nothing was attached",
                    feature="compaction", run_id=c.run_id, step=c.step, action="attach")

            def refuse_compaction(*args: Any, **kwargs: Any) -> None:
                raise UnsupportedFeature(
                    "compaction replaces the messages the run's end writes to its history "
                    "with a summary; with a history it is not supported, and nothing was "
                    "scheduled", feature="compaction", run_id=c.run_id, step=c.step,
                    action="compact_before_next_turn")

            runner.compact_before_next_turn = refuse_compaction  # type: ignore[method-assign]

        def refuse_toolset(tool_use: Any) -> Any:
            raise UnsupportedFeature(
                f"toolset member {_field(tool_use, 'name')!r} is not ledgered by this "
                "adapter; it did not run", feature="toolsets", run_id=c.run_id, step=c.step,
                action="begin_tool")

        request = runner._handle_request
        # the messages of the runner's latest request on its thread (posted once it is
        # answered), and those of a compaction since (`compact_before_next_turn`: sent on
        # a fork of the thread, carrying the whole conversation), whose results are
        # posted only once a request built on its summary is answered: until then a retry
        # from an older history finds them unsent, and is given them (`resumed`)
        sent: list[Sequence[Any]] = [()]
        compacted: list[Sequence[Any]] = [()]

        # a reply is whole when the runner yields it, or, streamed, once the runner's
        # step read its stream to the last event
        streams = isinstance(runner, BetaStreamingToolRunner | BetaAsyncStreamingToolRunner)

        def answered() -> None:
            """After each of the runner's requests, once its reply is whole: the results
            it carried are posted (a compaction's with the request that follows it). A
            stream that broke off (an error event mid-body) posts nothing: a retry from
            an older history then finds them unsent, and is given them (`resumed`)."""
            if _compacting(runner):
                return
            self._posted(sent[0])
            self._posted(compacted[0])
            compacted[0] = ()

        def requesting(messages: Sequence[Any]) -> None:
            _refuse_abandoned(c, "create")  # (abandoned while the runner went on)
            if _compacting(runner):
                compacted[0] = messages
            else:
                sent[0] = messages
            self._goes_on(messages)  # (its messages may have been set)
            self._keep_sent(messages)

        if isinstance(runner, BetaAsyncToolRunner | BetaAsyncStreamingToolRunner):
            async def run_async(tool: Any, tool_use: Any) -> Any:
                _refuse_in_doubt(c, "run_tools")
                return await self._arun_one(tool_use, lambda use: original(tool, use))

            @contextlib.asynccontextmanager
            async def request_async(thread: Any) -> AsyncIterator[Any]:
                if _compacting(runner):
                    last = await runner._get_last_message()
                    if self._end_before_compaction(sent[0], last):
                        await c.flush_async()
                requesting(thread.messages)
                await c.flush_results_async()  # the results it carries (`create`)
                async with request(thread) as item:
                    yield item  # (back here once the runner read the reply whole)
                if streams:
                    answered()

            async def refuse_async(tool_use: Any) -> Any:
                return refuse_toolset(tool_use)

            async def steps_async() -> AsyncGenerator[Any, None]:
                if self._runner_recorded(runner):
                    await c.flush_async()  # the recorded end made durable (`create`)
                    return
                try:
                    async with contextlib.aclosing(cast(AsyncGenerator[Any, None],
                                                        steps())) as items:
                        async for item in items:
                            if not streams:
                                answered()
                            yield item
                except BaseException:  # what the attempt recorded made durable (`create`)
                    with contextlib.suppress(ControlError):
                        await c.flush_async()
                    raise
                if not runner._closed:
                    self._after_reply(sent[0], await runner._get_last_message())
                await c.flush_async()

            runner._run_tool = run_async  # type: ignore[method-assign]
            runner._run_toolset_member = refuse_async  # type: ignore[method-assign]
            runner._steps = steps_async  # type: ignore[method-assign]
            runner._handle_request = request_async  # type: ignore[method-assign]
        else:
            def run_sync(tool: Any, tool_use: Any) -> Any:
                _refuse_in_doubt(c, "run_tools")
                return self._run_one(tool_use, lambda use: original(tool, use))

            @contextlib.contextmanager
            def request_sync(thread: Any) -> Iterator[Any]:
                if _compacting(runner) and self._end_before_compaction(
                        sent[0], runner._get_last_message()):
                    c.flush()
                requesting(thread.messages)
                # a model call needs no flush of its own, but the results it carries are
                # made durable first, so a crash while the model answers leaves their
                # calls completed, not in doubt (`create`); else a fence
                c.flush_results()
                with request(thread) as item:
                    yield item  # (back here once the runner read the reply whole)
                if streams:
                    answered()

            def steps_sync() -> Generator[Any, None, None]:
                if self._runner_recorded(runner):
                    c.flush()  # the recorded end made durable (`create`); a run going on
                    return  # needs no write before its request (`request_sync`)
                try:
                    for item in cast(Generator[Any, None, None], steps()):
                        if not streams:
                            answered()
                        yield item
                except BaseException:
                    # a request (or a tool) failed: the results the attempt recorded, which
                    # the request carried, are made durable before its error propagates,
                    # so the next attempt, in any process, answers their calls from the
                    # ledger instead of finding them in doubt (`create` does the same)
                    with contextlib.suppress(ControlError):
                        c.flush()
                    raise
                if not runner._closed:
                    self._after_reply(sent[0], runner._get_last_message())
                c.flush()

            runner._run_tool = run_sync  # type: ignore[method-assign]
            runner._run_toolset_member = refuse_toolset  # type: ignore[method-assign]
            runner._steps = steps_sync  # type: ignore[method-assign]
            runner._handle_request = request_sync  # type: ignore[method-assign]
        return runner

    def _runner_recorded(self, runner: Any) -> bool:
        """Before an attached runner's first request: the gate (`ToolInDoubt`), or its
        recorded final reply as the runner's last message when the conversation completed
        (True: the runner sends nothing)."""
        messages = list(runner._thread.messages)
        recorded = self._recorded(messages)
        if recorded is None:
            resumed = self._before_request(messages)
            if resumed is not messages:  # the turns the runner's history lacks (`resumed`)
                runner.append_messages(*resumed[len(messages):])
            return False
        # parsed as the runner's thread parses a reply (its output_format, if any)
        runner._last_message = parse_beta_response(
            output_format=runner._thread._state.output_format,
            response=BetaMessage.model_validate(cast(dict[str, Any], recorded)["reply"]))
        return True


def _reply(record: JSON) -> Any:
    """A recorded final reply as the SDK type it was (its JSON for any other)."""
    assert isinstance(record, dict)
    kind = _REPLIES.get(str(record.get("kind")))
    return record["reply"] if kind is None else kind.model_validate(record["reply"])
