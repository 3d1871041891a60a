"""What every adapter does before a tool body runs: ask the ledger (DESIGN §2.4); and,
for the async adapters, the whole of one call (`run_call`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from statemachine.controller import RunController
from statemachine.errors import InvalidTransition
from statemachine.payloads import JSON, canonical_json
from statemachine.values import Phase, Resend, Step


def begin_call(c: RunController, call_id: str, arguments: JSON) -> tuple[bool, JSON]:
    """``(True, result)`` when the call must not run: its recorded result (published
    before, or a `Resend` of a result recorded but not yet published). ``(False, None)``
    when its start is recorded and the body runs now, once the start is made durable
    (the caller flushes: an effect boundary). Raises `InvalidTransition` for a call the
    ledger never saw or one asked to run with other arguments than the recorded ones
    (which its approval binds), and `ToolInDoubt` for a started, unfinished call."""
    view = c.call(call_id)
    if view.phase is Phase.PUBLISHED:
        return True, view.result
    if not _same_json(arguments, view.call.arguments):
        raise InvalidTransition(
            f"call {call_id!r} was asked to run with arguments other than the recorded "
            "ones (which its approval binds); it did not run",
            run_id=c.run_id, step=c.step, action="begin_tool")
    if c.step is Step.INTERRUPTION:
        c.resume()  # calls needing no approval run while others await a decision
    decision = c.begin_tool(call_id)
    if isinstance(decision, Resend):
        return True, decision.result
    return False, None


def _same_json(asked: JSON, recorded: JSON) -> bool:
    """Exactly the same JSON (``1``, ``1.0`` and ``true`` are equal in Python, not here);
    arguments that are not plain JSON (a NaN) are never the recorded ones."""
    try:
        return canonical_json(asked) == canonical_json(recorded)
    except (TypeError, ValueError):
        return False


async def run_call(c: RunController, call_id: str, arguments: JSON, *,
                   flush: Callable[[], Awaitable[None]], body: Callable[[], Awaitable[Any]],
                   plain: Callable[[Any], JSON],
                   answers: tuple[type[BaseException], ...] = ()) -> Any:
    """One tool call through the ledger: its recorded result when it must not run
    (`begin_call`); else its start made durable (``flush``: an effect boundary), the
    body once, and its result recorded (``plain`` makes it JSON). An exception of a type
    in ``answers`` is the tool's own answer ("retry", "failed"): recorded as its result
    and raised on. Anything else the body raises (cancelled, timed out, failed before a
    result) leaves the call started, and this controller answers as a reloaded one would
    (`ToolInDoubt`)."""
    done, cached = begin_call(c, call_id, arguments)
    if done:  # published before, or recorded: its cached result, never a rerun
        return cached
    await flush()
    try:
        output = await body()
    except answers as answer:
        c.tool_completed(call_id, {"error": type(answer).__name__, "message": str(answer)})
        raise
    except BaseException:
        if call_id in c.in_flight:
            c.tool_interrupted(call_id)
        raise
    c.tool_completed(call_id, plain(output))
    return output
