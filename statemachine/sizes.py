"""Exact sizes: the UTF-8 length of an event's compact JSON, counted without writing it.

A controller keeps the size of its `to_json()` as it records (what ``max_bytes`` bounds),
so every event it records is measured, on the hot path. The size of an attrs record's
compact JSON (`payloads.compact_json` of `codec.encode_event`: no spaces, no ASCII
escapes) is a constant (braces, the "type" pair of an event, every key with its colon and
comma) plus the encoded length of each value. One straight-line function per class adds
them up: str fields through the C string encoder (quotes and escapes included), payloads
through the compact encoder, the rest by arithmetic. The function is generated from the
fields, so the hot path makes no call and no loop per field (a generic loop cost twice as
much), and recording a payload-free event (a model call, a hook, an approval) builds no
JSON text at all. `tests/core/test_limits.py` checks every event type against `compact_json`.

The size of a whole document (its frame: run id and version) is `codec.log_size`, next to
the version it writes.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import attrs

from statemachine import events as ev
from statemachine.payloads import JSON, encode_str, json_size, utf8_len, walk_size
from statemachine.values import GuardrailResult, RecoveryPolicy, Resolution, Step, ToolCall


def _str_expr(value: str) -> str:
    # the quoted, escaped text; its UTF-8 length without a copy when it is ASCII (O(1))
    return f"(len(_q) if (_q := _quote({value})).isascii() else _utf8(_q))"


def _value_expr(kind: Any, value: str, sizers: dict[str, Any]) -> str:
    """A Python expression for the encoded length of ``value`` (source text), of type
    ``kind``; nested records and tuples of them get a sizer of their own in ``sizers``."""
    if kind is str:
        return _str_expr(value)
    if kind is int:
        return f"len(str({value}))"
    if kind is bool:
        return f"(4 if {value} else 5)"
    if kind == str | None:
        return f"(4 if {value} is None else {_str_expr(value)})"
    if kind == int | None:
        return f"(4 if {value} is None else len(str({value})))"
    if kind in (Step, RecoveryPolicy, Resolution):
        return _str_expr(f"{value}.value")
    if kind is JSON:
        return f"(4 if {value} is None else _json({value}))"
    if kind in (tuple[str, ...], tuple[JSON, ...]):
        return f"_json(list({value}))"  # a list: the tuple's own JSON, and walk_size knows it
    if kind in (ToolCall, GuardrailResult):
        name = f"_{kind.__name__}"
        sizers[name] = _sizer(kind)
        return f"{name}({value})"
    if kind == tuple[ToolCall, ...]:
        sizers["_ToolCall"] = _sizer(ToolCall)
        return f"(max(len({value}) + 1, 2) + sum(map(_ToolCall, {value})))"
    raise TypeError(f"no size for a field of type {kind}")  # pragma: no cover


_AT_SIZE = ("(4 if (_at := value.at) is None else 16 if 999_999_999_999_999 < _at "
            "< 10_000_000_000_000_000 else len(str(_at)))")
"""An event's ``at``: a clock's reading has 16 digits from 2001 to 2286, so two
comparisons size it without printing it (every event is sized as it is recorded)."""


def _sizer(cls: type, tag: str | None = None) -> Callable[[Any], int]:
    """The exact size of ``cls``'s compact JSON; ``tag`` for an event's "type"."""
    fields = attrs.fields(attrs.resolve_types(cls))
    pairs = [f'"type":{json.dumps(tag)}'] if tag is not None else []
    pairs += [f'"{f.name}":' for f in fields]
    constant = 2 + sum(map(len, pairs)) + len(pairs) - 1
    namespace: dict[str, Any] = {"_quote": encode_str, "_json": json_size, "_utf8": utf8_len}
    terms = [_AT_SIZE if f.name == "at" else _value_expr(f.type, f"value.{f.name}", namespace)
             for f in fields]
    source = f"def size(value):\n    return {constant} + {' + '.join(terms) or '0'}\n"
    exec(source, namespace)  # the source is built above from attrs field names only
    sizer: Callable[[Any], int] = namespace["size"]
    return sizer


EVENT_SIZE: dict[type[ev.Event], Callable[[Any], int]] = {
    cls: _sizer(cls, cls.__name__) for cls in ev.EVENT_TYPES
}
"""``EVENT_SIZE[type(event)](event)`` is `event_size`, one call fewer (the hot path)."""


def event_size(event: ev.Event) -> int:
    """Bytes of ``event``'s compact JSON (`codec.encode_event`), exactly, without encoding
    the event: a constant per event type plus the encoded length of each field."""
    return EVENT_SIZE[type(event)](event)


CHAIN_BYTES = len(',"chain":""') + 64
"""What the keyed chain (`codec.chain_tag`, 64 hex digits) adds to a document's size."""


def document_size(data: Any, max_depth: int = sys.maxsize) -> int | None:
    """Bytes of a raw document's compact JSON, exactly; None when the encoder cannot
    write it (a NaN, a set, a cycle) or it nests deeper than ``max_depth``: the decoder
    refuses those with a precise message."""
    try:
        text = json.dumps(data, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        return utf8_len(text)
    except RecursionError:
        return walk_size(data, max_depth)
    except (TypeError, ValueError):
        return None
