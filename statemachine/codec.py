"""Versioned JSON for event logs, through one strict `cattrs` converter.

A document is ``{"schema_version": <int>, "run_id": <str>, "events": [...]}``, plus an
optional ``"chain"`` from version 2 on (a keyed chain: `chain_tag`); each event is its
attrs fields plus ``"type"`` (the class name). Structuring is strict: no coercion (``"7"``
is not ``7``, ``1`` is not ``True``), no unknown or missing keys, enums by value through
explicit hooks, payloads checked to be plain JSON within the depth limit.

A document's size is the UTF-8 length of its compact JSON text (`payloads.compact_json`:
no spaces, no ASCII escapes): `document_size` for a whole document, `event_size` for one
event, counted without building the text for the events the hot path records.

Messages name the event's position and the problem, never payload values; a string taken
from the document (a key, a name) is quoted by `errors.excerpt`, at most 64 characters.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import json
import json.encoder
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn

import attrs
import cattrs

from statemachine import events as ev
from statemachine.errors import SchemaError, excerpt, type_name
from statemachine.payloads import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_DEPTH,
    DEFAULT_MAX_EVENTS,
    JSON,
    MAX_TEXT,
    PayloadError,
    canonical_json,
    compact_json,
    detach,
    encodable,
    encode_str,
    json_size,
    str_size,
    text_problem,
    utf8_len,
    walk_size,
)
from statemachine.values import GuardrailResult, RecoveryPolicy, Step, ToolCall

if TYPE_CHECKING:
    import enum
    from collections.abc import Mapping

SCHEMA_VERSION = 2
"""The version `to_json` writes. Every released version stays readable (see `UPCASTERS`).

1: the first release. 2: adds `RunClaimed` (DESIGN §6.3) and the optional top-level
``"chain"`` (DESIGN §6.6); nothing else changed."""

DOCUMENT_KEYS: dict[int, frozenset[str]] = {
    1: frozenset({"schema_version", "run_id", "events"}),
    2: frozenset({"schema_version", "run_id", "events", "chain"}),
}
"""The top-level keys a document of each version may hold (checked before upcasting)."""


def _upcast_1_to_2(doc: dict[str, Any]) -> dict[str, Any]:
    """Version 2 only adds an event type, so a version 1 document is a version 2 one."""
    return {**doc, "schema_version": 2}


UPCASTERS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {1: _upcast_1_to_2}
"""``UPCASTERS[v]`` turns a raw version-``v`` document into a version ``v + 1`` one."""

EVENT_BY_NAME: dict[str, type[ev.Event]] = {cls.__name__: cls for cls in ev.EVENT_TYPES}
EVENT_SINCE: dict[str, int] = {**dict.fromkeys(EVENT_BY_NAME, 1), "RunClaimed": 2}
"""The schema version that introduced each event type: a document labelled older than
that cannot hold it (a terminal marker under a label that predates it is forged)."""

_max_depth: contextvars.ContextVar[int] = contextvars.ContextVar(
    "max_depth", default=DEFAULT_MAX_DEPTH
)


class _Bad(Exception):
    """Internal: a field failed a strict hook; the message names no value."""


def _exact(kind: type) -> Callable[[Any, Any], Any]:
    def hook(value: Any, _: Any) -> Any:
        if type(value) is not kind:
            raise _Bad(f"expected {kind.__name__}, got {type_name(value)}")
        if kind is str and (problem := text_problem(value)) is not None:
            raise _Bad(f"a text field {problem}")
        if kind is int:
            try:
                detach(value)  # an int past the 4,300-digit printing limit
            except PayloadError as exc:
                raise _Bad(str(exc)) from None
        return value

    return hook


def _enum(kind: type[enum.Enum]) -> Callable[[Any, Any], Any]:
    by_value = {member.value: member for member in kind}

    def hook(value: Any, _: Any) -> Any:
        if type(value) is not str or value not in by_value:
            raise _Bad(f"not a {kind.__name__} value")
        return by_value[value]

    return hook


def _payload(value: Any, _: Any) -> Any:
    try:
        return detach(value, _max_depth.get())
    except PayloadError as exc:
        raise _Bad(f"payload is not plain JSON: {exc}") from None


def _tuple_of(structure: Callable[[Any], Any]) -> Callable[[Any, Any], Any]:
    def hook(value: Any, _: Any) -> Any:
        if type(value) is not list:
            raise _Bad(f"expected a list, got {type_name(value)}")
        return tuple([structure(item) for item in value])

    return hook


def _optional(structure: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    def hook(value: Any, kind: Any) -> Any:
        return None if value is None else structure(value, kind)

    return hook


# Unknown and missing keys are named by `decode_event` itself (cattrs would only say
# that something was wrong), so the converter may ignore the "type" key.
converter = cattrs.Converter(detailed_validation=False)
for _kind in (str, int, bool):
    converter.register_structure_hook(_kind, _exact(_kind))
for _enum_kind in (Step, RecoveryPolicy):
    converter.register_structure_hook(_enum_kind, _enum(_enum_kind))
    converter.register_unstructure_hook(_enum_kind, lambda member: member.value)
converter.register_structure_hook(JSON, _payload)
converter.register_structure_hook(str | None, _optional(_exact(str)))
converter.register_structure_hook(int | None, _optional(_exact(int)))
_TUPLE_ITEMS: dict[Any, Callable[[Any], Any]] = {
    tuple[str, ...]: lambda item: _exact(str)(item, str),
    tuple[JSON, ...]: lambda item: _payload(item, None),
    tuple[ToolCall, ...]: lambda item: converter.structure(item, ToolCall),
}


def _is(expected: Any) -> Callable[[Any], bool]:
    return lambda kind: bool(kind == expected)


for _tuple_type, _item in _TUPLE_ITEMS.items():
    converter.register_structure_hook_func(_is(_tuple_type), _tuple_of(_item))
converter.register_unstructure_hook_func(
    lambda t: t is tuple or getattr(t, "__origin__", None) is tuple,
    lambda value: [converter.unstructure(item) for item in value],
)

def _strict_value(cls: type) -> Callable[[Any, Any], Any]:
    """Nested values (tool calls, guardrail results) name every field, and only those."""
    names = frozenset(f.name for f in attrs.fields(cls))
    generated: Callable[[Any, Any], Any] = converter.gen_structure_attrs_fromdict(cls)

    def hook(value: Any, _: Any) -> Any:
        if type(value) is not dict:
            raise _Bad(f"expected a {cls.__name__} object, got {type_name(value)}")
        if value.keys() != names:
            missing = sorted(names - value.keys())
            raise _Bad(f"a {cls.__name__} with missing field(s) {', '.join(missing) or '-'} "
                       f"and unknown field(s) {named(value.keys() - names) or '-'}")
        return generated(value, cls)

    return hook


for _value_cls in (ToolCall, GuardrailResult):
    converter.register_structure_hook(_value_cls, _strict_value(_value_cls))

_FIELDS = {cls: tuple(f.name for f in attrs.fields(cls)) for cls in ev.EVENT_TYPES}
_STRUCTURE = {cls: converter.get_structure_hook(cls) for cls in ev.EVENT_TYPES}


def encode_event(event: ev.Event) -> dict[str, JSON]:
    data: dict[str, JSON] = {"type": type(event).__name__}
    data.update(converter.unstructure(event))
    return data


def encode_log(run_id: str, events: list[ev.Event] | tuple[ev.Event, ...], *,
               key: bytes | None = None) -> dict[str, JSON]:
    """The current-version document for a run's log; with ``key``, carrying the keyed
    chain over its events (``"chain"``, see `chain_tag`)."""
    doc: dict[str, JSON] = {
        "schema_version": SCHEMA_VERSION,
        "run_id": run_id,
        "events": [encode_event(event) for event in events],
    }
    if key is not None:
        doc["chain"] = chain_tag(check_key(key), doc["events"])
    return doc


def named(keys: Any, most: int = 3) -> str:
    """Up to ``most`` keys of a document, quoted by `excerpt` (a key that is not a str by
    its type), then how many more: a message stays short however many keys, of whatever
    length, a document holds."""
    shown = sorted(excerpt(k) if type(k) is str else f"<{type_name(k)}>" for k in keys)
    more = len(shown) - most
    return ", ".join(shown[:most]) + (f" and {more} more" if more > 0 else "")


# ----------------------------------------------------------------------- sizes
#
# The size of an attrs record's compact JSON is a constant (braces, the "type" pair of an
# event, every key with its colon and comma) plus the encoded length of each value. One
# straight-line function per class adds them up: str fields through the C string encoder
# (quotes and escapes included), payloads through the compact encoder, the rest by
# arithmetic. The function is generated from the fields, so the hot path makes no call
# and no loop per field (a generic loop cost twice as much), and recording a payload-free
# event (a model call, a hook, an approval) builds no JSON text at all.
# `tests/test_limits.py` checks every event type against `compact_json`.


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
    if kind in (Step, RecoveryPolicy):
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


def _sizer(cls: type, tag: str | None = None) -> Callable[[Any], int]:
    """The exact size of ``cls``'s compact JSON; ``tag`` for an event's "type"."""
    fields = attrs.fields(attrs.resolve_types(cls))
    pairs = [f'"type":{json.dumps(tag)}'] if tag is not None else []
    pairs += [f'"{f.name}":' for f in fields]
    constant = 2 + sum(map(len, pairs)) + len(pairs) - 1
    namespace: dict[str, Any] = {"_quote": encode_str, "_json": json_size, "_utf8": utf8_len}
    terms = [_value_expr(f.type, f"value.{f.name}", namespace) for f in fields]
    source = f"def size(value):\n    return {constant} + {' + '.join(terms) or '0'}\n"
    exec(source, namespace)  # the source is built above from attrs field names only
    sizer: Callable[[Any], int] = namespace["size"]
    return sizer


EVENT_SIZE: dict[type[ev.Event], Callable[[Any], int]] = {
    cls: _sizer(cls, cls.__name__) for cls in ev.EVENT_TYPES
}
"""``EVENT_SIZE[type(event)](event)`` is `event_size`, one call fewer (the hot path)."""


def event_size(event: ev.Event) -> int:
    """Bytes of ``event``'s compact JSON (`encode_event`), exactly, without encoding the
    event: a constant per event type plus the encoded length of each field."""
    return EVENT_SIZE[type(event)](event)


_ENVELOPE = len('{"schema_version":,"run_id":,"events":[]}')
CHAIN_BYTES = len(',"chain":""') + 64
"""What the keyed chain adds to a document's size."""


def envelope_size(run_id: str, version: int = SCHEMA_VERSION) -> int:
    """Bytes of a document around its events (its run id, version, brackets)."""
    return _ENVELOPE + len(str(version)) + str_size(run_id)


def log_size(run_id: str, events: list[ev.Event] | tuple[ev.Event, ...]) -> int:
    """Bytes of ``encode_log(run_id, events)`` as compact JSON, exactly (no chain)."""
    return (envelope_size(run_id) + sum(EVENT_SIZE[type(e)](e) for e in events)
            + max(len(events) - 1, 0))


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


# ------------------------------------------------------------------ keyed chain

CHAIN_REFUSED = ("the log's keyed chain does not verify: it was changed or signed with "
                 "another key")
CHAIN_MISSING = ("the log carries no keyed chain: it was written without a key, or its "
                 "chain was removed")


def check_key(key: object) -> bytes:
    """A chain key is non-empty bytes; `SchemaError` otherwise."""
    if type(key) is not bytes or not key:
        raise SchemaError("a chain key must be non-empty bytes")
    return key


def chain_tag(key: bytes, raw_events: list[Any]) -> str:
    """The keyed chain over a log's encoded events, as hex: ``h_0 = HMAC(key, c_0)``,
    ``h_i = HMAC(key, h_{i-1} || c_i)`` with HMAC-SHA256 and ``c_i`` the canonical JSON
    of event ``i`` (sorted keys, compact, UTF-8). Only the final tag is kept: it changes
    with any edit, insertion, removal or reordering of events, truncation included."""
    tag = b""
    for raw in raw_events:
        tag = hmac.new(key, tag + canonical_json(raw), hashlib.sha256).digest()
    return tag.hex()


def _chain_problem(chain: object) -> str | None:
    if type(chain) is not str or len(chain) != 64 or chain.strip("0123456789abcdef"):
        return "the document's chain must be 64 lowercase hex digits"
    return None


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        raise SchemaError("the document has an object with duplicate keys")
    return result


def _reject_constant(name: str) -> Any:
    raise SchemaError(f"the document holds {name}, which is not plain JSON")


def parse(text: str | bytes) -> Any:
    """Parse JSON text strictly: duplicate keys and NaN/Infinity are `SchemaError`."""
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)
    except SchemaError:
        raise
    except RecursionError:
        raise SchemaError("the document is nested too deeply") from None
    except (ValueError, TypeError) as exc:
        raise SchemaError(f"the document is not valid JSON ({type(exc).__name__})") from None


def decode_event(data: Any, position: int) -> ev.Event:
    """One raw event dict of the current version → an event; `SchemaError` otherwise."""
    if type(data) is not dict:
        raise SchemaError(f"event {position} is not an object")
    name = data.get("type")
    cls = EVENT_BY_NAME.get(name) if type(name) is str else None
    if cls is None:
        shown = f" {excerpt(name)}" if type(name) is str else ""
        raise SchemaError(f"event {position} has a missing or unknown type{shown}")
    fields = _FIELDS[cls]
    if len(data) != len(fields) + 1 or any(f not in data for f in fields):
        missing = [f for f in fields if f not in data]
        if missing:
            raise SchemaError(f"event {position} ({name}) lacks field(s) {', '.join(missing)}")
        unknown = [k for k in data if k not in fields and k != "type"]
        raise SchemaError(f"event {position} ({name}) has unknown field(s) {named(unknown)}")
    try:
        return _STRUCTURE[cls](data, cls)  # type: ignore[no-any-return]
    except SchemaError:
        raise
    except _Bad as exc:
        raise SchemaError(f"event {position} ({name}) has a bad field: {exc}") from None
    except Exception as exc:  # cattrs raises several kinds; name the kind only
        raise SchemaError(
            f"event {position} ({name}) is malformed ({type_name(exc)})"
        ) from None


# ------------------------------------------------------------------ fast path
#
# Loading is mostly decoding text this library wrote. A text that is the compact JSON of
# what it parses to, up to a space after a comma or a colon (so what ``json.dumps`` writes
# with its default separators too), holds no duplicate key and no NaN or infinity (see
# `clean_parse`); if that text is also valid Unicode throughout, every value in it is
# plain JSON of an exact type with valid text and printable ints. Such a "clean" tree is
# the parser's own, so nothing else holds it and its payloads need no copy: only their
# depth is checked. Its events are decoded by one generated function per class (exact
# types, text lengths, enums, key sets); anything such a function does not accept is
# decoded again by `decode_event`, which gives the precise refusal. The strict parse
# stays the authority for every text that is not clean. `tests/test_codec.py` checks the
# two paths agree.


class _Slow(Exception):
    """Internal: the fast decoder declines; `decode_event` decides."""


def _make_ascii_compact() -> Callable[[Any], str]:
    c_make_encoder = getattr(json.encoder, "c_make_encoder", None)
    c_ascii = getattr(json.encoder, "c_encode_basestring_ascii", None)
    if c_make_encoder is None or c_ascii is None:  # pragma: no cover - no C accelerator
        return json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode
    one_shot = c_make_encoder(None, _not_plain, c_ascii, None, ":", ",", False, False, False)

    def ascii_compact(value: Any) -> str:
        return "".join(one_shot(value, 0))

    return ascii_compact


def _not_plain(value: object) -> NoReturn:
    raise TypeError(type(value).__name__)


_ascii_compact = _make_ascii_compact()
"""`compact_json` with every non-ASCII character escaped (``ensure_ascii``), for a tree."""


def _squeezed(text: str) -> str:
    """``text`` without the space after each ", " and ": " (left to right)."""
    return text.replace(", ", ",").replace(": ", ":")


def clean_parse(text: str) -> tuple[Any, str] | None:
    """(the parsed tree, its compact text) when ``text`` is clean (see above), else
    None: then `parse` decides, strictly.

    Clean: ``text`` and the compact text are equal once each drops the space after every
    ", " and ": " (`_squeezed`). Why that rules out a duplicate key: both then have the
    same characters once every space is dropped, and a space is never part of an escape,
    so which of those characters lie outside strings is the same for both. A colon
    outside a string is a key's separator, so ``text`` has as many keys as the compact
    text, which has one per key of the parsed tree: none was lost to a duplicate. The
    compact encoder refuses NaN and infinities (and so ``1e400``), and the parser ints
    past the 4,300-digit limit; text that is not valid UTF-8 is refused below."""
    if type(text) is not str:
        return None
    try:
        tree = json.loads(text)
        compact = compact_json(tree)
    except (ValueError, TypeError, RecursionError):
        return None
    if compact != text:
        squeezed = _squeezed(text)
        if _squeezed(compact) != squeezed and not (
                # json.dumps' default also escapes every non-ASCII character
                text.isascii() and not compact.isascii()
                and _squeezed(_ascii_compact(tree)) == squeezed):
            return None
    if not encodable(compact):
        return None
    return tree, compact


def _within(value: Any, limit: int) -> bool:
    """Whether ``value`` nests at most ``limit`` containers deep (a container is 1)."""
    kind = type(value)
    if kind is not dict and kind is not list:
        return True
    level = [value]
    depth = 1
    while depth <= limit:
        below = [item for node in level
                 for item in (node.values() if type(node) is dict else node)
                 if type(item) is dict or type(item) is list]
        if not below:
            return True
        level = below
        depth += 1
    return False


def _fast_source(cls: type, fn: str) -> str:
    """The source of a fast decoder for ``cls`` (an event or a nested value)."""
    fields = attrs.fields(attrs.resolve_types(cls))
    extra = 1 if issubclass(cls, ev.Event) else 0  # an event's "type"
    lines = [f"def {fn}(d, limit):",
             f"    if type(d) is not dict or len(d) != {len(fields) + extra}:",
             "        raise _Slow"]
    args = []
    for i, f in enumerate(fields):
        v = f"v{i}"
        args.append(v)
        lines.append(f"    {v} = d[{f.name!r}]")
        kind = f.type
        if kind is int:
            lines.append(f"    if type({v}) is not int: raise _Slow")
        elif kind is str:
            lines.append(f"    if type({v}) is not str or len({v}) > MAX_TEXT: raise _Slow")
        elif kind == str | None:
            lines.append(f"    if {v} is not None and (type({v}) is not str "
                         f"or len({v}) > MAX_TEXT): raise _Slow")
        elif kind == int | None:
            lines.append(f"    if {v} is not None and type({v}) is not int: raise _Slow")
        elif kind is bool:
            lines.append(f"    if type({v}) is not bool: raise _Slow")
        elif kind in (Step, RecoveryPolicy):
            table = f"_{kind.__name__}"
            lines.append(f"    {v} = {table}.get({v}) if type({v}) is str else None")
            lines.append(f"    if {v} is None: raise _Slow")
        elif kind is JSON:
            lines.append(f"    if limit is not None and not _within({v}, limit): raise _Slow")
        elif kind == tuple[str, ...]:
            lines.append(f"    if type({v}) is not list: raise _Slow")
            lines.append(f"    for x in {v}:")
            lines.append("        if type(x) is not str or len(x) > MAX_TEXT: raise _Slow")
            lines.append(f"    {v} = tuple({v})")
        elif kind == tuple[JSON, ...]:
            lines.append(f"    if type({v}) is not list: raise _Slow")
            lines.append(f"    if limit is not None and not all(_within(x, limit) "
                         f"for x in {v}): raise _Slow")
            lines.append(f"    {v} = tuple({v})")
        elif kind == tuple[ToolCall, ...]:
            lines.append(f"    if type({v}) is not list: raise _Slow")
            lines.append(f"    {v} = tuple([_ToolCall(x, limit) for x in {v}])")
        elif kind is GuardrailResult:
            lines.append(f"    {v} = _GuardrailResult({v}, limit)")
        else:  # pragma: no cover - every field type of the events is listed above
            raise TypeError(f"no fast decoder for a field of type {kind}")
    lines.append(f"    return _cls({', '.join(args)})")
    return "\n".join(lines) + "\n"


Limit = int | None
"""The depth limit of a fast decoder's payloads (None: none)."""


def _fast_decoder(cls: type, namespace: dict[str, Any]) -> Callable[[Any, Limit], Any]:
    local = {**namespace, "_cls": cls}
    exec(_fast_source(cls, "decode"), local)  # built above from attrs field names only
    decoder: Callable[[Any, Limit], Any] = local["decode"]
    return decoder


_FAST_NAMESPACE: dict[str, Any] = {
    "_Slow": _Slow, "MAX_TEXT": MAX_TEXT, "_within": _within,
    "_Step": {member.value: member for member in Step},
    "_RecoveryPolicy": {member.value: member for member in RecoveryPolicy},
}
_FAST_NAMESPACE["_ToolCall"] = _fast_decoder(ToolCall, _FAST_NAMESPACE)
_FAST_NAMESPACE["_GuardrailResult"] = _fast_decoder(GuardrailResult, _FAST_NAMESPACE)
FAST_DECODE: dict[str, Callable[[Any, Limit], ev.Event]] = {
    cls.__name__: _fast_decoder(cls, _FAST_NAMESPACE) for cls in ev.EVENT_TYPES
}
"""``FAST_DECODE[name](raw, limit)``: the event a clean raw event holds (payloads within
``limit`` levels; None: no limit), or an exception: then `decode_event` decides."""


def decode_clean(raw_events: list[Any], max_depth: int) -> list[ev.Event]:
    """The events of a clean tree's ``"events"`` list, each by its fast decoder or, when
    that declines, by `decode_event` (under the current depth limit)."""
    fast = FAST_DECODE
    limit = None if max_depth >= sys.maxsize else max_depth
    events: list[ev.Event] = []
    append = events.append
    for raw in raw_events:
        try:
            append(fast[raw["type"]](raw, limit))
        except Exception:  # a bad or unusual event: the strict decoder decides
            append(decode_event(raw, len(events)))
    return events


class SizedEvents(list[ev.Event]):
    """Events a store decoded, with ``json_size``: the UTF-8 length of their compact JSON
    joined by commas (what they add to `to_json()`'s ``"events"``), measured while
    decoding them, so a controller loading them need not size each event again. Any
    change to the list (by whoever it was handed to) forgets it: None."""

    json_size: int | None = None


def _forgetting(name: str) -> Callable[..., Any]:
    change = getattr(list, name)

    def method(self: SizedEvents, *args: Any, **kwargs: Any) -> Any:
        self.json_size = None
        return change(self, *args, **kwargs)

    method.__name__ = name
    return method


for _name in ("append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse",
              "__setitem__", "__delitem__", "__iadd__", "__imul__"):
    setattr(SizedEvents, _name, _forgetting(_name))


def measured_size(events: Sequence[ev.Event]) -> int | None:
    """The size a store measured for ``events`` while decoding them (`SizedEvents`, and
    unchanged since); None when none was, or it was forgotten."""
    return events.json_size if type(events) is SizedEvents else None


_scan_once: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


def decode_stored_batch(bodies: list[str], first: int) -> SizedEvents | None:
    """The events of stored bodies, the compact JSON of one event each from seq
    ``first`` on, when every body is clean, decodes by its fast decoder and carries its
    row's seq; None otherwise: decode them one by one (`decode_stored_text`), which names
    the first row that is wrong.

    One parser call per body (with no ``json.loads`` wrapper) and one compact encoding
    of them all: each body must be exactly one JSON value, and the compact text of the
    list of their trees must be the bodies joined by commas. Then each body is the
    compact text of its tree: were the first one that differs shorter or longer than its
    tree's text, one would be a proper prefix of the other followed by a comma, and a
    complete JSON value is never that (the parser stops where it ends, and a value
    holding a comma ends after it). So each body is clean (see `clean_parse`)."""
    scan = _scan_once
    trees: list[Any] = []
    append = trees.append
    try:
        for body in bodies:
            tree, end = scan(body, 0)
            if end != len(body):
                return None
            append(tree)
        compact = compact_json(trees)
    except (StopIteration, ValueError, TypeError, RecursionError):
        return None
    if compact[1:-1] != ",".join(bodies) or not encodable(compact):
        return None
    fast = FAST_DECODE
    decoded: list[ev.Event] = []
    add = decoded.append
    for position, raw in enumerate(trees, start=first):
        try:
            event = fast[raw["type"]](raw, None)
        except Exception:  # a bad or unusual event: row by row, the first problem named
            return None
        if event.seq != position:
            return None
        add(event)
    events = SizedEvents(decoded)
    events.json_size = utf8_len(compact) - 2
    return events


def decode_stored_text(body: str, position: int) -> ev.Event:
    """`decode_stored_event` of the JSON text of one stored event (`parse` first)."""
    clean = clean_parse(body)
    if clean is not None:
        raw = clean[0]
        try:
            return FAST_DECODE[raw["type"]](raw, None)
        except Exception:  # the strict decoder decides
            pass
        return decode_stored_event(raw, position)
    return decode_stored_event(parse(body), position)


def decode_stored_event(data: Any, position: int) -> ev.Event:
    """Decode an event a store holds. Stores hold only what a controller recorded, under
    that controller's own depth limit, so none is imposed again here: every log a
    controller writes also loads."""
    token = _max_depth.set(sys.maxsize)
    try:
        return decode_event(data, position)
    finally:
        _max_depth.reset(token)


class Decoded(NamedTuple):
    """What `decode_log` returns."""

    run_id: str
    events: list[ev.Event]
    size: int
    """The size of the document `encode_log(run_id, events)` writes (no chain), which is
    what a controller holding these events counts against ``max_bytes``."""


def _over(max_bytes: int) -> SchemaError:
    return SchemaError(f"the document is over max_bytes={max_bytes} (the UTF-8 length of "
                       "its compact JSON text)")


def _version_text(version: int) -> str:
    return str(version) if version.bit_length() <= 64 else "(an int of many digits)"


def decode_log(
    data: Mapping[str, Any] | str | bytes,
    *,
    max_depth: int = DEFAULT_MAX_DEPTH,
    max_events: int = DEFAULT_MAX_EVENTS,
    max_bytes: int = DEFAULT_MAX_BYTES,
    key: bytes | None = None,
) -> Decoded:
    """A document (dict or text) of any released version → (run_id, events, size).

    ``max_bytes`` bounds the UTF-8 length of the document's compact JSON text, for a dict
    and a text alike; a text is also refused, before it is parsed, when it is itself
    longer (spaces and ASCII escapes count: write documents compactly to use the whole
    limit). With ``key`` the document must carry a keyed chain that verifies
    (`chain_tag`); without one a chain is checked for shape only and otherwise ignored."""
    if key is not None:
        check_key(key)
    measured: int | None
    clean = False
    if isinstance(data, str | bytes):
        # a str's UTF-8 length is at least its length: the first test is O(1)
        if len(data) > max_bytes or (type(data) is str and utf8_len(data) > max_bytes):
            raise _over(max_bytes)
        found = clean_parse(data)  # type: ignore[arg-type]
        if found is not None:
            data, compact = found
            measured, clean = utf8_len(compact), True
        else:
            data = parse(data)
            try:  # parsed text holds no cycle and no NaN: the plain encoder measures it
                measured = json_size(data)
            except (TypeError, ValueError):
                measured = None  # a float overflowing to infinity ("1e400"): refused below
    else:
        measured = document_size(data, max_depth + 8)  # the document's own nesting too
    if measured is not None and measured > max_bytes:
        raise _over(max_bytes)
    if type(data) is not dict:
        raise SchemaError("the document is not a JSON object")
    doc: dict[str, Any] = dict(data)
    version = doc.get("schema_version")
    if type(version) is not int:
        raise SchemaError("the document has a missing or mistyped schema_version")
    if version > SCHEMA_VERSION:
        raise SchemaError(f"schema_version {_version_text(version)} is newer than this "
                          f"library reads ({SCHEMA_VERSION})")
    if version < 1 or (version < SCHEMA_VERSION and version not in UPCASTERS):
        raise SchemaError(f"unknown schema_version {_version_text(version)}")
    label = version
    extra = set(doc) - DOCUMENT_KEYS[min(version, max(DOCUMENT_KEYS))]
    if extra:
        raise SchemaError(f"the document has unknown key(s) {named(extra)} for "
                          f"schema_version {version}")
    raw = doc.get("events")
    if type(raw) is list and version < SCHEMA_VERSION:
        for position, event in enumerate(raw):
            name = event.get("type") if type(event) is dict else None
            if type(name) is str and EVENT_SINCE.get(name, 1) > version:
                raise SchemaError(f"event {position}: {name} is not valid under "
                                  f"schema_version {version}")
    while version < SCHEMA_VERSION:
        doc = UPCASTERS[version](doc)
        version += 1
    signed = "chain" in doc
    chain = doc.pop("chain", None)
    if signed and (problem := _chain_problem(chain)) is not None:
        raise SchemaError(problem)
    run_id, raw_events = doc.get("run_id"), doc.get("events")
    if type(run_id) is not str or type(raw_events) is not list:
        raise SchemaError("the document needs a str run_id and a list of events")
    if (problem := text_problem(run_id)) is not None:
        raise SchemaError(f"the document's run_id {problem}")
    if len(raw_events) > max_events:
        raise SchemaError(f"the log has more than max_events={max_events} events")
    token = _max_depth.set(max_depth)
    try:
        if clean:
            decoded = decode_clean(raw_events, max_depth)
        else:
            decoded = [decode_event(raw, i) for i, raw in enumerate(raw_events)]
    finally:
        _max_depth.reset(token)
    if key is not None:
        if chain is None:
            raise SchemaError(CHAIN_MISSING)
        # every raw event decoded, so each is plain JSON with a canonical form
        if not hmac.compare_digest(chain_tag(key, raw_events), chain):
            raise SchemaError(CHAIN_REFUSED)
    if measured is not None and label == SCHEMA_VERSION:
        size = measured - (CHAIN_BYTES if signed else 0)
    else:  # an older label, or a document the encoder could not measure: count events
        size = log_size(run_id, decoded)
        if size + (CHAIN_BYTES if signed else 0) > max_bytes:
            raise _over(max_bytes)
    return Decoded(run_id, decoded, size)


# the tuple of guardrail results an envelope holds (snapshots carry envelopes)
converter.register_structure_hook_func(
    _is(tuple[GuardrailResult, ...]),
    _tuple_of(lambda item: converter.structure(item, GuardrailResult)),
)
