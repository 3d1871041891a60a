"""The remote tool executor: the agent loop runs on a server, and this client executes the
tool calls it owns and posts each result back, at most once each across reconnects and
restarts."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from typing import Literal, Protocol

import attrs

from statemachine.controller import RunController
from statemachine.errors import ControlError, ToolInDoubt
from statemachine.payloads import JSON
from statemachine.runner.agents import FunctionTool
from statemachine.runner.attempt import interrupted, maybe_await
from statemachine.values import Execute, Phase, ToolCall

# ------------------------------------------------------------ the remote executor
# The second runner shape: the agent loop runs on a server, and this client executes the
# tool calls it owns and posts each result back. Streams drop and reconnect and posts
# fail; on every (re)connect the client lists the remote history and reconciles it with
# the controller's ledger, so a tool whose post failed is re-posted from the cache and
# never re-run (I12), and a tool started by a process that died is in doubt (I11).


@attrs.frozen
class RemoteEvent:
    """One event of the remote history: ``tool_use`` (a call to execute),
    ``tool_result`` (a result the remote holds) or ``session_end``."""

    kind: Literal["tool_use", "tool_result", "session_end"]
    call_id: str | None = None
    name: str | None = None
    arguments: JSON = None
    result: JSON = None


class RemoteSession(Protocol):
    """The remote agent loop, as the client sees it."""

    def events(self) -> AsyncGenerator[RemoteEvent, None]:
        """Connect and stream new events; raises (or ends) when the stream drops."""

    def list_events(self) -> AsyncGenerator[RemoteEvent, None]:
        """The whole history, page by page; may raise part way."""

    async def post_result(self, call_id: str, result: JSON) -> None:
        """Post a call's result; raises `TransientPostError` (worth retrying),
        `AlreadyAnswered`, or anything else (permanent)."""


class TransientPostError(Exception):
    """A post failed in a way worth retrying (a timeout, a 5xx)."""


class AlreadyAnswered(Exception):
    """The remote already holds a result for this call (an earlier post landed)."""


class RemoteUnavailable(Exception):
    """The executor gave up reconnecting."""


@attrs.frozen
class DispatchedToolCall:
    """What the consumer sees for each owned call: its (cached) result and whether the
    remote holds it. A call whose post failed is yielded with ``posted=False`` and again
    with ``posted=True`` once a later re-post lands, with the same result. A call started
    by a process that died is yielded ``in_doubt`` and never run."""

    call_id: str
    name: str
    result: JSON
    posted: bool
    in_doubt: bool = False


class RemoteToolExecutor:
    """Executes the calls a remote agent loop sends, at most once each, on a controller.

    ``controller`` is usually bound to a store, so a restarted client resumes the same
    ledger (``RunController.load(store, run_id)``). Transient post failures are retried
    ``retries`` times with exponential ``backoff``; permanent ones are not, and wait for
    the next reconnect. ``run()`` is an async generator of `DispatchedToolCall`; it ends
    at ``session_end`` and leaves no task or stream open.
    """

    def __init__(self, remote: RemoteSession, tools: Sequence[FunctionTool], *,
                 controller: RunController, retries: int = 3, backoff: float = 0.01,
                 max_reconnects: int = 50) -> None:
        self.remote = remote
        self.tools = {tool.name: tool for tool in tools}
        self.c = controller
        self.retries = retries
        self.backoff = backoff
        self.max_reconnects = max_reconnects
        self.reconnects = 0

    async def run(self) -> AsyncGenerator[DispatchedToolCall, None]:
        while True:
            try:
                async with aclosing(self.remote.list_events()) as pages:
                    history = [event async for event in pages]
            except Exception:
                # a listing that failed part way is dropped whole: nothing is enqueued
                await self._reconnect_pause()
                continue
            answered = {e.call_id for e in history if e.kind == "tool_result"}
            for event in history:
                if event.kind == "tool_use" and (
                        dispatched := await self._handle(event, answered)) is not None:
                    yield dispatched
            if any(e.kind == "session_end" for e in history):
                return
            try:
                async with aclosing(self.remote.events()) as stream:
                    async for event in stream:
                        if event.kind == "tool_use":
                            if (dispatched := await self._handle(event, set())) is not None:
                                yield dispatched
                        elif event.kind == "tool_result" and event.call_id is not None:
                            self._acknowledge(event.call_id)
                        else:
                            return
            except ControlError:  # the controller refused: a typed end, not a drop
                raise
            except Exception:  # the stream dropped: reconnect and reconcile
                pass
            if self.c.in_doubt():
                self.c.resume()  # raises ToolInDoubt: an operator must resolve the call
            await self._reconnect_pause()

    async def _reconnect_pause(self) -> None:
        self.reconnects += 1
        if self.reconnects > self.max_reconnects:
            raise RemoteUnavailable(f"gave up after {self.max_reconnects} reconnects")
        await asyncio.sleep(self.backoff)

    def _acknowledge(self, call_id: str) -> None:
        if self.c.phase(call_id) is Phase.COMPLETED:
            self.c.result_posted(call_id)

    async def _handle(self, event: RemoteEvent,
                      answered: set[str | None]) -> DispatchedToolCall | None:
        c = self.c
        call_id, name = event.call_id, event.name
        if call_id is None or name is None or name not in self.tools:
            return None  # not ours to run
        if call_id in answered:
            self._acknowledge(call_id)  # the remote holds a result: never re-run, re-post
            return None
        phase = c.phase(call_id)
        if phase is None:
            c.receive_tool_calls([ToolCall(call_id, name, event.arguments,
                                           idempotent=self.tools[name].idempotent)])
        elif phase is Phase.PUBLISHED:
            return None
        try:
            decision = c.begin_tool(call_id)
        except ToolInDoubt:
            return DispatchedToolCall(call_id, name, None, posted=False, in_doubt=True)
        if isinstance(decision, Execute):
            await c.flush_async()  # an effect boundary: the start is durable first
            try:
                try:
                    result = await maybe_await(
                        self.tools[name].function(**decision.call.arguments))
                except Exception as error:  # a tool's failure is its result
                    result = f"tool error: {type(error).__name__}"
                c.tool_completed(call_id, result)
            except BaseException:
                # cancelled, timed out, or the result was refused: the call ended without
                # a recorded result, so this controller answers as a reloaded one would
                interrupted(c, call_id)
                raise
        else:
            result = decision.result
        return DispatchedToolCall(call_id, name, result, await self._post(call_id, result))

    async def _post(self, call_id: str, result: JSON) -> bool:
        for attempt in range(self.retries + 1):
            await self.c.flush_async()  # an effect boundary: the result is durable first
            try:
                await self.remote.post_result(call_id, result)
            except AlreadyAnswered:
                self.c.result_posted(call_id)
                return True
            except TransientPostError as error:
                self.c.result_post_failed(call_id, error)
                if attempt < self.retries:
                    await asyncio.sleep(self.backoff * 2**attempt)
                    continue
                return False
            except Exception as error:  # permanent: wait for the next reconnect
                self.c.result_post_failed(call_id, error)
                return False
            self.c.result_posted(call_id)
            return True
        return False  # pragma: no cover - the loop always returns
