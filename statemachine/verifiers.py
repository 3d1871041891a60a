"""Settling doubt without a person (DESIGN §7.3): idempotency keys, the tool context, and
verifiers.

A call in doubt was started and its end never recorded. Many side effects can say what
happened when asked by a key they were given: a payment or ticket API deduplicates by
an idempotency key and answers "did this key succeed?". So:

* `RunController.idempotency_key` is a call's key, the same in every process;
* inside a tool body run by the reference runner or an adapter, `tool_context()` returns
  the `ToolContext` (run, call, key, which start of the call this is), for the body to
  pass the key on;
* a tool may have a verifier, ``verify(context) -> Completed(output) | NotExecuted() |
  Unknown()`` (sync or async). On every attempt, after its claim and before any other
  effect, `verify_in_doubt` asks the verifier of each call in doubt once and records its
  answer as ``resolve_in_doubt(..., by="verify:<tool>")``: `Completed` as COMPLETED,
  `NotExecuted` as NOT_EXECUTED (the call then runs again, with the same key); `Unknown`,
  an exception or a timeout leaves the call in doubt (`ToolInDoubt`, as without one).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import logging
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import attrs

from statemachine import telemetry
from statemachine.payloads import JSON
from statemachine.values import Resolution

if TYPE_CHECKING:
    from statemachine.controller import RunController

__all__ = [
    "Answer",
    "Completed",
    "NotExecuted",
    "ToolContext",
    "Unknown",
    "Verifier",
    "running",
    "tool_context",
    "verify_in_doubt",
    "verify_in_doubt_async",
]

_log = logging.getLogger(__name__)


@attrs.frozen
class ToolContext:
    """What a tool body knows of the call it runs (`tool_context`)."""

    run_id: str
    call_id: str
    idempotency_key: str
    """32 lowercase hex digits, the same for this call in every process and on every
    start of it (`RunController.idempotency_key`): give it to an API that deduplicates."""
    attempt: int
    """Which start of the call this is: 1, then one more after each NOT_EXECUTED."""


_CURRENT: contextvars.ContextVar[ToolContext] = contextvars.ContextVar("tool_context")


def tool_context() -> ToolContext:
    """The `ToolContext` of the tool body running now; `LookupError` outside one. Carried
    by a context variable: a body's own tasks and ``asyncio.to_thread`` see it."""
    try:
        return _CURRENT.get()
    except LookupError:
        raise LookupError("tool_context() is only known inside a tool body run by the "
                          "reference runner or an adapter") from None


def context_of(controller: RunController, call_id: str) -> ToolContext:
    """The `ToolContext` of ``call_id`` of ``controller``'s run, as its latest start."""
    starts = controller.call(call_id).starts
    return ToolContext(controller.run_id, call_id, controller.idempotency_key(call_id),
                       max(starts, 1))


def entered(context: ToolContext) -> contextvars.Token[ToolContext]:
    """Make ``context`` what `tool_context` returns from now on in the current context
    (for an SDK whose callbacks before and after a body are two calls, each call's
    body in a context of its own); the token undoes it (``left``)."""
    return _CURRENT.set(context)


def left(token: contextvars.Token[ToolContext]) -> None:
    """Undo `entered` (``token``, from the same context)."""
    _CURRENT.reset(token)


@contextlib.contextmanager
def running(context: ToolContext) -> Iterator[ToolContext]:
    """Make ``context`` what `tool_context` returns inside the block (a tool's body)."""
    token = _CURRENT.set(context)
    try:
        yield context
    finally:
        _CURRENT.reset(token)


@contextlib.contextmanager
def running_call(controller: RunController, call_id: str) -> Iterator[ToolContext]:
    """The body of ``call_id``, which ``controller`` just started: its `ToolContext` is
    what `tool_context` returns inside the block, and its ``execute_tool`` span, when
    telemetry is on, the current span (so the body's own spans nest under it)."""
    # (the controller's open spans are its own; only the body's block is lent them)
    with running(context_of(controller, call_id)) as context, \
            telemetry.inside(controller._spans, call_id):
        yield context


@attrs.frozen
class Completed:
    """The verifier's answer: the effect happened; ``output`` is what the model sees."""

    output: JSON = None


@attrs.frozen
class NotExecuted:
    """The verifier's answer: the effect did not happen; the call runs again."""


@attrs.frozen
class Unknown:
    """The verifier's answer: it cannot tell; the call stays in doubt."""


Answer = Completed | NotExecuted | Unknown
Verifier = Callable[[ToolContext], "Answer | Awaitable[Answer]"]


def _recorded(controller: RunController, call_id: str, tool: str, answer: object) -> Answer:
    """Record a verifier's `Completed` or `NotExecuted` answer and return it; anything
    else records nothing and is `Unknown` (the call stays in doubt)."""
    by = f"verify:{tool}"
    if type(answer) is Completed:
        controller.resolve_in_doubt(call_id, answer.output, by=by)
        return answer
    if type(answer) is NotExecuted:
        controller.resolve_in_doubt(call_id, outcome=Resolution.NOT_EXECUTED, by=by)
        return answer
    if type(answer) is not Unknown:
        _log.warning("verifier of %r answered %s, not Completed, NotExecuted or "
                     "Unknown: the call stays in doubt", tool, type(answer).__name__)
    return Unknown()


def _raised(tool: str, error: Exception) -> None:
    _log.warning("verifier of %r raised %s: the call stays in doubt", tool,
                 type(error).__name__)


def _asked(controller: RunController, verifiers: Mapping[str, Verifier]
           ) -> list[tuple[str, str, Verifier]]:
    found = []
    for call_id in controller.in_doubt():
        tool = controller.call(call_id).call.name
        verify = verifiers.get(tool)
        if verify is not None:
            found.append((call_id, tool, verify))
    return found


def verify_in_doubt(controller: RunController, verifiers: Mapping[str, Verifier]
                    ) -> dict[str, Answer]:
    """Ask the verifier (by tool name) of each call in doubt, once, and record each
    `Completed` or `NotExecuted` answer (``by="verify:<tool>"``). A verifier that raises
    (or answers something else) leaves its call in doubt. Returns the answers by call id.
    For sync verifiers; an async one is refused here (`TypeError`): use
    `verify_in_doubt_async`."""
    answers: dict[str, Answer] = {}
    for call_id, tool, verify in _asked(controller, verifiers):
        if inspect.iscoroutinefunction(verify):
            raise TypeError(f"the verifier of {tool!r} is async: use verify_in_doubt_async")
        try:
            answer: Any = verify(context_of(controller, call_id))
        except Exception as error:  # the call stays in doubt: nothing is known
            _raised(tool, error)
            continue
        answers[call_id] = _recorded(controller, call_id, tool, answer)
    return answers


async def verify_in_doubt_async(controller: RunController,
                                verifiers: Mapping[str, Verifier], *,
                                timeout: float | None = None) -> dict[str, Answer]:
    """`verify_in_doubt` for sync and async verifiers (a sync one runs on a worker thread,
    the tool context's variable copied), each given ``timeout`` seconds (None: no limit):
    one that runs out leaves its call in doubt."""
    answers: dict[str, Answer] = {}
    for call_id, tool, verify in _asked(controller, verifiers):
        context = context_of(controller, call_id)
        try:
            if inspect.iscoroutinefunction(verify):
                pending: Awaitable[Any] = verify(context)
            else:
                pending = asyncio.to_thread(verify, context)
            answer: Any = await asyncio.wait_for(pending, timeout)
            answer = await answer if inspect.isawaitable(answer) else answer
        except Exception as error:  # a timeout too: the call stays in doubt
            _raised(tool, error)
            continue
        answers[call_id] = _recorded(controller, call_id, tool, answer)
    return answers
