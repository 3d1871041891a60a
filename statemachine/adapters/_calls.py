"""What every adapter shares: `plain`, an SDK's value as the plain JSON the ledger keeps
(each adapter naming its policy for what is not JSON); `begin_call`, what an adapter does
before a tool body runs (ask the ledger, DESIGN §2.4); and, for the async adapters, the
whole of one call (`run_call`)."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from statemachine.controller import RunController
from statemachine.errors import InvalidTransition
from statemachine.payloads import JSON, canonical_json
from statemachine.values import Phase, Resend, Step

# ------------------------------------------------------------------ plain JSON forms

Walk = Callable[[Any], JSON]
"""Makes a part of a value plain, one level deeper than the value."""

Fallback = Callable[[Any, Walk | None], JSON]
"""An adapter's policy for a value `plain` does not take as it is: called with the value
and a `Walk` for its parts (None when the value is nested too deep to walk any further),
it returns what the ledger keeps for it: the text the SDK shows the model, the SDK's own
JSON form, or the value as it is, for the controller to refuse (`SchemaError`)."""

MAX_PLAIN_DEPTH = 100
"""How deep `plain` walks; a value nested deeper is the fallback's (given no `Walk`)."""

_INT_BITS = 14_000
"""Below this bit length an int has fewer than 4,300 digits, so it prints."""


def plain(value: Any, *, fallback: Fallback) -> JSON:
    """``value`` as plain JSON. ``None``, a ``bool``, a ``str``, an ``int`` of fewer than
    14,000 bits and a finite ``float`` (each by exact type) are kept; a list or a tuple,
    and a mapping whose keys are all ``str``, are walked; anything else (a subclass of
    those, a longer int, a non-finite float, a mapping with another key, a model, any
    other object) is what ``fallback`` makes of it, as is a value nested deeper than
    `MAX_PLAIN_DEPTH` levels."""
    return _walk(value, fallback, 0)


def _walk(value: Any, fallback: Fallback, depth: int) -> JSON:
    if depth > MAX_PLAIN_DEPTH:
        return fallback(value, None)
    kind = type(value)
    if value is None or kind is bool or kind is str:
        return value
    if kind is int and value.bit_length() < _INT_BITS:
        return value
    if kind is float and math.isfinite(value):
        return value
    if isinstance(value, list | tuple):
        return [_walk(item, fallback, depth + 1) for item in value]
    if isinstance(value, Mapping) and all(isinstance(key, str) for key in value):
        return {key: _walk(item, fallback, depth + 1) for key, item in value.items()}
    return fallback(value, lambda part: _walk(part, fallback, depth + 1))


def lossless(value: Any, plain_form: JSON) -> bool:
    """Whether ``plain_form`` (what `plain` made of ``value``) is ``value`` itself: a
    final output that is plain JSON is kept whole (``accept_final_output(lossless=)``)."""
    return type(value) in (str, int, float, bool, type(None), list, dict) and (
        plain_form == value)


# --------------------------------------------------------------------- tool calls


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
                   as_json: Callable[[Any], JSON],
                   answers: tuple[type[BaseException], ...] = ()) -> Any:
    """One tool call through the ledger: its recorded result when it must not run
    (`begin_call`); else its start made durable (``flush``: an effect boundary), the
    body once, and its result recorded (``as_json`` makes it JSON). An exception of a type
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
    c.tool_completed(call_id, as_json(output))
    return output
