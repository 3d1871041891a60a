"""The Anthropic SDK (PyPI ``anthropic``) with the control core's tool ledger underneath
(DESIGN §2.4, §6.8). Install with ``pip install 'agent-statemachine[anthropic]'`` (tested
on anthropic 2.10.x; the extra pins ``>=2.10,<2.11`` because the session runner is wrapped
at seams the SDK does not promise to keep).

Two ways the SDK runs tools on the client, two wrappers, one ledger (a `RunController`
without a Session, usually bound to an event store so it survives process restarts):

Managed sessions — `LedgerSessionToolRunner`
    The SDK's ``SessionToolRunner`` (what ``client.beta.sessions.events.tool_runner()``
    returns) executes the ``agent.tool_use`` / ``agent.custom_tool_use`` calls of a
    managed-agents session and posts each result back. Its history pass after every
    stream reconnect re-dispatches each call whose result the server does not hold, and
    in 2.10 a re-dispatch runs the tool again: a tool whose result post failed runs twice
    after a reconnect. `LedgerSessionToolRunner` is that runner with three seams wrapped:

    ========================  ============================================================
    SDK seam                  what the wrapper does
    ========================  ============================================================
    running one tool          ``begin_tool(tool_use id)``: `Execute` → the start is durable
                              first, the SDK runs the tool, ``tool_completed`` records the
                              result event before anything is posted; `Resend` → the cached
                              result event, the tool never runs again; a started, unfinished
                              call → `ToolInDoubt`, and the runner stops (fails closed)
    posting a result          a post that ends without landing → ``result_post_failed``
    a result the server holds the server's history or stream shows the result (or a post
                              landed) → ``result_posted``: never re-sent again
    ========================  ============================================================

    Every iteration on an existing run first records ``claim`` and passes the gate
    (``resume()``: a call in doubt raises `ToolInDoubt` before the stream is opened).

Messages — `MessageToolLedger`
    For a plain ``client.messages.create`` loop (or ``client.beta.messages.create``):
    ``ledger.run_tools(reply)`` runs the reply's ``tool_use`` blocks through the ledger,
    keyed by the ``tool_use`` id, and returns the user message of their ``tool_result``
    blocks, so a retried turn answers a finished call from the cache instead of running it
    again; ``ledger.create(client.messages, ...)`` refuses a history that holds a
    ``tool_use`` without its ``tool_result`` (`UnansweredToolUse`) before anything is sent,
    and marks the results a successful request carried as posted. ``ledger.attach(runner)``
    puts the same ledger under a ``client.beta.messages.tool_runner(...)`` runner (sync or
    async, streamed or not): each tool call it makes is ledgered by its ``tool_use`` id.

What it does not cover (refused or documented, never silently unsafe): toolset members in
a messages tool runner (``toolset_name`` calls) are refused by `attach` before they run;
decisions (tool confirmations) and new input reach a managed session through the server's
own events, not through this adapter, so there is no adapter call to refuse while a write
is unsettled, and a per-call result post never makes a run ``UNSETTLED`` (§2.4: an unposted
result blocks no other call). A tool the wrapped runner does not own is left to its owner,
as the SDK does, and is not entered in the ledger.
"""

from __future__ import annotations

import contextlib
import inspect
import json
from collections.abc import (
    AsyncGenerator,
    Awaitable,
    Callable,
    Collection,
    Iterable,
    Mapping,
    Sequence,
)
from typing import Any, TypeVar, cast

from statemachine.adapters import missing_extra

try:
    from anthropic import AsyncAnthropic
    from anthropic.lib.environments import DispatchedToolCall, SessionToolRunner
    from anthropic.lib.tools import (
        BetaAsyncStreamingToolRunner,
        BetaAsyncToolRunner,
        BetaStreamingToolRunner,
        BetaToolRunner,
        ToolError,
    )
except ModuleNotFoundError as error:  # pragma: no cover - the extra is installed in CI
    raise missing_extra(__name__, "anthropic", error) from error

from statemachine.adapters._calls import Walk, begin_call, plain
from statemachine.controller import RunController
from statemachine.errors import ControlError, InvalidTransition, RunNotFound, ToolInDoubt
from statemachine.payloads import JSON
from statemachine.runner.attempt import Attempt, interrupted, maybe_await
from statemachine.stores import AsyncEventStore, EventStore
from statemachine.values import Phase, ToolCall

__all__ = [
    "LedgerSessionToolRunner",
    "MessageToolLedger",
    "ResultNotPosted",
    "UnansweredToolUse",
]

_Runner = TypeVar("_Runner", BetaToolRunner[Any], BetaStreamingToolRunner[Any],
                  BetaAsyncToolRunner[Any], BetaAsyncStreamingToolRunner[Any])


class UnansweredToolUse(ControlError):
    """The message history holds a ``tool_use`` block that no ``tool_result`` in the next
    user message answers. Nothing was sent: the API would refuse the history, and a result
    made up for a call that may have run would hide what happened. Answer the call (from
    `MessageToolLedger.run_tools`, or `resolve_in_doubt` for a call in doubt) first."""


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


def _open_sync(run_id: str, store: EventStore | None, buffered: bool
               ) -> tuple[RunController, bool]:
    buffered = buffered and store is not None
    if store is not None:
        with contextlib.suppress(RunNotFound):
            return RunController.load(store, run_id, buffered=buffered), True
    return RunController.start(run_id=run_id, session_id=None, store=store,
                               buffered=buffered), False


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
        c.receive_tool_calls([ToolCall(call_id, name, arguments,
                                       idempotent=name in idempotent)])


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


class LedgerSessionToolRunner(SessionToolRunner):
    """The SDK's managed-session tool runner with the ledger under its tool calls: a result
    is recorded before it is posted; after a reconnect a recorded result is re-posted,
    never recomputed; a started, unfinished call is in doubt and stops the runner with
    `ToolInDoubt` (fails closed); with a store all of this holds across process restarts.

    Open it with `open` (loads the run from ``store`` when it exists, else starts it) and
    iterate it like the SDK's runner (``async for call in runner``, or ``until_done()``).
    Every iteration may raise the controller's refusals as themselves (never inside an
    exception group): `ToolInDoubt`, `RunNotResumable`, `ConcurrencyConflict`,
    `StorageError`, `SchemaError` (a result that is not plain JSON: the tool ran, and its
    call is left in doubt)."""

    def __init__(self, client: AsyncAnthropic, session_id: str, *,
                 tools: Sequence[Any], controller: RunController, existing: bool = True,
                 idempotent: Collection[str] = (), owner: str | None = None,
                 **options: Any) -> None:
        super().__init__(client, session_id, tools=tools, **options)
        self.controller = controller
        self._idempotent = frozenset(idempotent)
        self._attempt = Attempt(controller, resumes=existing, owner=owner)

    @classmethod
    async def open(cls, client: AsyncAnthropic, session_id: str, *, tools: Sequence[Any],
                   store: EventStore | AsyncEventStore | None = None,
                   run_id: str | None = None, idempotent: Collection[str] = (),
                   owner: str | None = None, buffered: bool = False,
                   **options: Any) -> LedgerSessionToolRunner:
        """The runner for ``session_id``, on the run ``run_id`` (default
        ``"anthropic-session:" + session_id``): loaded from ``store`` when it holds it (an
        earlier process ran it), else started. ``idempotent`` names the tools that may run
        again after a crash inside them; every other tool's unfinished call is in doubt.
        ``buffered=True`` appends the ledger's events only at effect boundaries (before a
        tool runs, before its result is posted, when the iteration ends: one transaction
        each) instead of one per event; an async store is always buffered. ``options`` go
        to the SDK runner (``max_idle``, ``environment_key``, ``extra_headers``)."""
        controller, existing = await _open_async(run_id or f"anthropic-session:{session_id}",
                                                 store, buffered)
        return cls(client, session_id, tools=tools, controller=controller, existing=existing,
                   idempotent=idempotent, owner=owner, **options)

    @property
    def owner(self) -> str | None:
        """Who claims the run: recorded by every claim (``RunClaimed(owner)``)."""
        return self._attempt.owner

    # the SDK assigns a fresh set when it starts; the ledger listens to it
    @property
    def _answered(self) -> set[str]:
        return self.__dict__["_ledger_answered"]  # type: ignore[no-any-return]

    @_answered.setter
    def _answered(self, value: Iterable[str]) -> None:
        self.__dict__["_ledger_answered"] = _Answered(value, self._acknowledge)

    def _acknowledge(self, call_id: str) -> None:
        c = self.controller
        if c.phase(call_id) is Phase.COMPLETED:
            c.result_posted(call_id)

    async def __aiter__(self) -> AsyncGenerator[DispatchedToolCall, None]:
        async with self._attempt:  # an existing run is claimed first, before any effect
            try:
                self.controller.resume()  # the gate: RunNotResumable, or ToolInDoubt
                # closing this iterator closes the SDK's in the same task (anyio needs it)
                sdk_calls = cast(AsyncGenerator[DispatchedToolCall, None], super().__aiter__())
                async with contextlib.aclosing(sdk_calls) as calls:
                    async for call in calls:
                        yield call
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
        done, result = begin_call(c, call_id, arguments)  # ToolInDoubt: started, unfinished
        if done:  # posted before, or it ran: the cached result, never a second run
            return result, _field(result, "content")
        try:
            await c.flush_async()  # an effect boundary: the start is durable first
            result_event, recorded = await super()._call_tool(tool, ev, input_)
            c.tool_completed(call_id, plain(result_event, fallback=_as_is))
            await c.flush_async()  # the result is durable before it is posted
        except BaseException:
            interrupted(c, call_id)
            raise
        return result_event, recorded

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


def _result_ids(message: Any) -> set[str]:
    content = _field(message, "content")
    if _field(message, "role") != "user" or isinstance(content, str) or content is None:
        return set()
    return {str(_field(block, "tool_use_id")) for block in content
            if _field(block, "type") == "tool_result"}


def _content_of(value: Any) -> JSON:
    """A tool's return value as ``tool_result`` content: text as it is, a list of content
    blocks as plain JSON, anything else as its JSON text."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    blocks = plain(value, fallback=_as_is)
    if isinstance(blocks, list):
        return blocks
    try:
        return json.dumps(blocks)
    except (TypeError, ValueError):
        return str(value)


class MessageToolLedger:
    """The tool ledger around a client-side messages loop, keyed by ``tool_use`` id.

    ``tools`` are the SDK's runnable tools (``@beta_tool`` / ``@beta_async_tool``, or
    anything with ``.name`` and ``.call(input)``). `run_tools` / `arun_tools` answer a
    reply's ``tool_use`` blocks: a new call runs once (its start durable first, its result
    recorded right after), a finished call is answered from the cache and never runs again,
    a started, unfinished call raises `ToolInDoubt` before any call of the reply runs.
    `create` / `acreate` send a request only if every ``tool_use`` in its history is
    answered (`UnansweredToolUse` otherwise), and record the results it carried as posted.
    """

    def __init__(self, controller: RunController, tools: Sequence[Any] = (), *,
                 idempotent: Collection[str] = ()) -> None:
        self.controller = controller
        self.tools: dict[str, Any] = {str(tool.name): tool for tool in tools}
        self._idempotent = frozenset(idempotent)

    @classmethod
    def open(cls, run_id: str, tools: Sequence[Any] = (), *, store: EventStore | None = None,
             idempotent: Collection[str] = (), owner: str | None = None,
             buffered: bool = False) -> MessageToolLedger:
        """The ledger of run ``run_id``: loaded from ``store`` when it holds it (and claimed
        by ``owner``: of two processes that loaded the same version one goes on), else
        started. ``buffered=True``: events are appended at effect boundaries only (before
        a tool runs, before a request is sent)."""
        controller, existing = _open_sync(run_id, store, buffered)
        if existing:
            controller.claim(owner)
            controller.flush()
        return cls(controller, tools, idempotent=idempotent)

    # ------------------------------------------------------------------ history

    def check_history(self, messages: Iterable[Any]) -> None:
        """`UnansweredToolUse` unless every assistant ``tool_use`` is answered by a
        ``tool_result`` in the user message right after it."""
        history = list(messages)
        missing: list[str] = []
        for index, message in enumerate(history):
            if _field(message, "role") != "assistant":
                continue
            answered = _result_ids(history[index + 1]) if index + 1 < len(history) else set()
            missing += [str(_field(block, "id")) for block in _tool_uses(
                _field(message, "content")) if str(_field(block, "id")) not in answered]
        if missing:
            c = self.controller
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

    def create(self, resource: Any, /, **params: Any) -> Any:
        """``resource.create(**params)`` (``client.messages`` or ``client.beta.messages``)
        after `check_history`; the results the request carried are then posted."""
        messages = list(params.get("messages") or ())
        self.check_history(messages)
        self.controller.flush()  # an effect boundary
        reply = resource.create(**params)
        self._posted(messages)
        return reply

    async def acreate(self, resource: Any, /, **params: Any) -> Any:
        """`create` for an async client."""
        messages = list(params.get("messages") or ())
        self.check_history(messages)
        await self.controller.flush_async()
        reply = await resource.create(**params)
        self._posted(messages)
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
        return call_id, result if done else None

    def _gate(self, tool_uses: Sequence[Any]) -> None:
        """Before any call of a reply runs: refuse if any call of the run is in doubt."""
        c = self.controller
        doubt = set(c.in_doubt())
        for block in tool_uses:
            call_id = _field(block, "id")
            if call_id in doubt:
                raise ToolInDoubt(
                    f"call {call_id!r} was started and never completed; it is not re-run. "
                    "Record its outcome with resolve_in_doubt, or abandon the run",
                    call_id=call_id, run_id=c.run_id, step=c.step, action="run_tools")

    def _finish(self, call_id: str, block: Any) -> Any:
        self.controller.tool_completed(call_id, plain(block, fallback=_as_is))
        return block

    def _result(self, call_id: str, tool_use: Any, output: Any, error: bool) -> dict[str, JSON]:
        block: dict[str, JSON] = {"type": "tool_result", "tool_use_id": call_id,
                                  "content": _content_of(output)}
        if error:
            block["is_error"] = True
        return block

    def _failure(self, call_id: str, tool_use: Any, error: Exception) -> dict[str, JSON]:
        if isinstance(error, ToolError):
            return self._result(call_id, tool_use, error.content, True)
        return self._result(call_id, tool_use, f"{type(error).__name__}: {error}", True)

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
        self._gate(uses)
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
        self._gate(uses)
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
            block = execute(use)
            return self._finish(call_id, block)
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
            block = await execute(use)
            return self._finish(call_id, block)
        except BaseException:
            interrupted(c, call_id)
            raise

    # --------------------------------------------------- the SDK's tool runner

    def attach(self, runner: _Runner) -> _Runner:
        """Put the ledger under a ``client.beta.messages.tool_runner(...)`` runner (sync or
        async, streamed or not, eager or not): each of its tool calls is ledgered by its
        ``tool_use`` id (a finished call is answered from the cache, a call in doubt raises
        `ToolInDoubt` out of the runner before its turn's results are sent). A toolset
        member call is refused (`InvalidTransition`) before it runs. Returns ``runner``."""
        original = runner._run_tool
        c = self.controller

        def refuse_toolset(tool_use: Any) -> Any:
            raise InvalidTransition(
                f"toolset member {_field(tool_use, 'name')!r} is not ledgered by this "
                "adapter; it did not run", run_id=c.run_id, step=c.step, action="begin_tool")

        if isinstance(runner, BetaAsyncToolRunner | BetaAsyncStreamingToolRunner):
            async def run_async(tool: Any, tool_use: Any) -> Any:
                self._gate([tool_use])
                return await self._arun_one(tool_use, lambda use: original(tool, use))

            async def refuse_async(tool_use: Any) -> Any:
                return refuse_toolset(tool_use)

            runner._run_tool = run_async  # type: ignore[method-assign]
            runner._run_toolset_member = refuse_async  # type: ignore[method-assign]
        else:
            def run_sync(tool: Any, tool_use: Any) -> Any:
                self._gate([tool_use])
                return self._run_one(tool_use, lambda use: original(tool, use))

            runner._run_tool = run_sync  # type: ignore[method-assign]
            runner._run_toolset_member = refuse_toolset  # type: ignore[method-assign]
        return runner

