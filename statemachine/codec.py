"""Versioned JSON for event logs, through one strict `cattrs` converter.

A document is ``{"schema_version": <int>, "run_id": <str>, "events": [...]}``, plus an
optional ``"chain"`` from version 2 on (a keyed chain: `chain_tag`); each event is its
attrs fields plus ``"type"`` (the class name). Structuring is strict: no coercion (``"7"``
is not ``7``, ``1`` is not ``True``), no unknown or missing keys, enums by value through
explicit hooks, payloads checked to be plain JSON within the depth limit.

A document's size is the UTF-8 length of its compact JSON text (`payloads.compact_json`:
no spaces, no ASCII escapes): `log_size` for the document of a run's events (its frame
here, each event's by `sizes.event_size`), `sizes.document_size` for a raw one. Clean text
is decoded by `fastload` first; whatever it declines is decoded here, strictly.

Messages name the event's position and the problem, never payload values; a string taken
from the document (a key, a name) is quoted by `errors.excerpt`, at most 64 characters.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import json
import sys
import typing
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import attrs
import cattrs

from statemachine import events as ev
from statemachine import fastload
from statemachine.errors import SchemaError, excerpt, type_name
from statemachine.payloads import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_DEPTH,
    DEFAULT_MAX_EVENTS,
    JSON,
    PayloadError,
    canonical_json,
    detach,
    json_size,
    str_size,
    text_problem,
    utf8_len,
)
from statemachine.sizes import CHAIN_BYTES, EVENT_SIZE, document_size
from statemachine.values import GuardrailResult, RecoveryPolicy, Resolution, Step, ToolCall

if TYPE_CHECKING:
    import enum
    from collections.abc import Mapping

SCHEMA_VERSION = 3
"""The version `to_json` writes. Every released version stays readable (see `UPCASTERS`).

1: the first release. 2: adds `RunClaimed` (DESIGN §6.3) and the optional top-level
``"chain"`` (DESIGN §6.6); nothing else changed. 3: time and actor (DESIGN §7.2): every
event carries ``"at"`` (int microseconds since the Unix epoch, UTC, or null), the
decisions ``"by"`` (and an approval ``"reason"``), str or null, and an in-doubt
resolution its ``"outcome"`` and ``"evidence"`` (DESIGN §7.3); an older document's
events get what they could only have meant (`ADDED_IN_3`)."""

DOCUMENT_KEYS: dict[int, frozenset[str]] = {
    1: frozenset({"schema_version", "run_id", "events"}),
    2: frozenset({"schema_version", "run_id", "events", "chain"}),
}
"""The top-level keys a document of each version may hold (checked before upcasting;
versions after the last listed hold its keys)."""


def _upcast_1_to_2(doc: dict[str, Any]) -> dict[str, Any]:
    """Version 2 only adds an event type, so a version 1 document is a version 2 one."""
    return {**doc, "schema_version": 2}


ADDED_IN_3: dict[str, dict[str, Any]] = {
    cls.__name__: {f.name: getattr(f.default, "value", f.default)
                   for f in attrs.fields(cls) if f.kw_only}
    for cls in ev.EVENT_TYPES
}
"""The fields version 3 added to each event type, with what an older event holds: its
keyword-only fields and their defaults (``at`` for every type; ``by`` and ``reason``
for the decisions, null; a resolution's ``outcome``, ``"completed"``, and
``evidence``, null)."""


def _upcast_2_to_3(doc: dict[str, Any]) -> dict[str, Any]:
    """Each event of a version 2 document gets every field version 3 added, as an older
    event holds it (`ADDED_IN_3`): it was recorded without a clock and without an actor.
    An event that already holds one of them is refused: the field is not valid under its
    label. What is not an event object is left for `decode_event` to refuse."""
    events = doc.get("events")
    if type(events) is not list:
        return {**doc, "schema_version": 3}
    upcast: list[Any] = []
    append = upcast.append
    for position, event in enumerate(events):
        name = event.get("type") if type(event) is dict else None
        added = ADDED_IN_3.get(name) if type(name) is str else None
        if added is None:
            append(event)
            continue
        present = [key for key in added if key in event]
        if present:
            raise SchemaError(f"event {position} ({name}) has unknown field(s) "
                              f"{named(present)} for schema_version 2")
        append({**event, **added})
    return {**doc, "schema_version": 3, "events": upcast}


UPCASTERS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {
    1: _upcast_1_to_2, 2: _upcast_2_to_3}
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
for _enum_kind in (Step, RecoveryPolicy, Resolution):
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


# `encode_event` for a document serialized at once (`stored.event_text`): the same keys
# in the same order, but a payload (a field typed JSON) is handed over as it is, not
# copied value by value as cattrs copies a value it only knows at run time (most of an
# event's encoding time). Its text is `encode_event`'s wherever the payload is plain JSON;
# anything else (what `json` refuses, a subclass of a value class) is left to
# `encode_event` by the caller.


def _field_form(kind: Any) -> Callable[[Any], Any] | None:
    """How a field of type ``kind`` is encoded (None: as it is)."""
    if kind in (int, str, bool, JSON, int | None, str | None):
        return None
    if kind in (Step, RecoveryPolicy, Resolution):
        return _enum_value
    if kind in (tuple[str, ...], tuple[JSON, ...]):
        return list
    if kind in (ToolCall, GuardrailResult):
        return _shared_form(kind)
    if kind == tuple[ToolCall, ...]:
        tool_call = _shared_form(ToolCall)
        return lambda calls: [tool_call(call) for call in calls]
    raise TypeError(f"no shared form for a field of type {kind!r}: add it to _field_form")


class _NotShared(TypeError):
    """A value the shared form does not know (a subclass of a value class, or no value
    class at all): the caller encodes the event by `encode_event`."""


def _enum_value(member: Any) -> Any:
    return member.value


def _shared_form(cls: type, named: str | None = None) -> Callable[[Any], dict[str, Any]]:
    """``cls``'s fields as a dict (``named``: with ``"type"`` first), each by its form."""
    hints = typing.get_type_hints(cls)
    forms = tuple((f.name, _field_form(hints[f.name])) for f in attrs.fields(cls))

    def form(value: Any) -> dict[str, Any]:
        if type(value) is not cls:  # (a subclass has fields of its own: `encode_event`)
            raise _NotShared(f"a {type_name(value)} is not a {cls.__name__}")
        data: dict[str, Any] = {} if named is None else {"type": named}
        for name, encode in forms:
            field = getattr(value, name)
            data[name] = field if encode is None else encode(field)
        return data

    return form


_SHARED = {cls: _shared_form(cls, cls.__name__) for cls in ev.EVENT_TYPES}


def shared_event(event: ev.Event) -> dict[str, Any] | None:
    """`encode_event`'s dict with each payload as it is in ``event`` (shared, not copied:
    serialize it at once and keep nothing of it), or None for an event of a class this
    module does not declare (a subclass): `encode_event` it. Raises (`TypeError`) for a
    tool call or guardrail result that is not exactly of its class, whose own fields only
    `encode_event` knows."""
    form = _SHARED.get(type(event))
    return None if form is None else form(event)


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


# ----------------------------------------------------------------- a document's size


_ENVELOPE = len('{"schema_version":,"run_id":,"events":[]}')


def envelope_size(run_id: str) -> int:
    """Bytes of a current-version document around its events (its run id, version,
    brackets); the events' own are `sizes.event_size`."""
    return _ENVELOPE + len(str(SCHEMA_VERSION)) + str_size(run_id)


def log_size(run_id: str, events: list[ev.Event] | tuple[ev.Event, ...]) -> int:
    """Bytes of ``encode_log(run_id, events)`` as compact JSON, exactly (no chain)."""
    return (envelope_size(run_id) + sum(EVENT_SIZE[type(e)](e) for e in events)
            + max(len(events) - 1, 0))


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


def _digits_checked(text: str) -> int:
    if len(text) - text.startswith("-") > sys.get_int_max_str_digits() > 0:
        raise SchemaError(f"the document holds an integer of more than "
                          f"{sys.get_int_max_str_digits()} digits, past Python's "
                          "int-string conversion limit")
    return int(text)


def parse(text: str | bytes) -> Any:
    """Parse JSON text strictly: duplicate keys and NaN/Infinity are `SchemaError`, and so
    is an integer past Python's int-string conversion limit (4,300 digits), by name."""
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)
    except SchemaError:
        raise
    except RecursionError:
        raise SchemaError("the document is nested too deeply") from None
    except json.JSONDecodeError as exc:
        raise SchemaError(f"the document is not valid JSON ({type(exc).__name__})") from None
    except (ValueError, TypeError) as exc:
        # the parser's int(), past the limit, raises a bare ValueError: parse again (a
        # failure only), counting each integer's digits, to say so instead of "not JSON"
        try:
            json.loads(text, parse_int=_digits_checked, parse_constant=_reject_constant)
        except SchemaError:
            raise
        except (ValueError, TypeError, RecursionError):
            pass
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




def decode_clean(raw_events: list[Any], max_depth: int) -> list[ev.Event]:
    """The events of a clean tree's ``"events"`` list (`fastload.clean_parse`), each by its
    fast decoder or, when that declines, by `decode_event` (under the current depth
    limit)."""
    fast = fastload.FAST_DECODE
    limit = None if max_depth >= sys.maxsize else max_depth
    events: list[ev.Event] = []
    append = events.append
    for raw in raw_events:
        try:
            append(fast[raw["type"]](raw, limit))
        except Exception:  # a bad or unusual event: the strict decoder decides
            append(decode_event(raw, len(events)))
    return events


def decode_stored_text(body: str, position: int) -> ev.Event:
    """`decode_stored_event` of the JSON text of one stored event (`parse` first; a
    clean text by its fast decoder, when that accepts it)."""
    clean = fastload.clean_parse(body)
    if clean is not None:
        raw = clean[0]
        try:
            return fastload.FAST_DECODE[raw["type"]](raw, None)
        except Exception:  # the strict decoder decides
            pass
        return decode_stored_event(raw, position)
    return decode_stored_event(parse(body), position)


def decode_stored_event(data: Any, position: int) -> ev.Event:
    """Decode an event a store holds. Stores hold only what a controller recorded, under
    that controller's own depth limit, so none is imposed again here: every log a
    controller writes also loads.

    A stored event carries no schema version of its own: one that holds none of the
    fields version 3 added (`ADDED_IN_3`) was written by an older library, and loads with
    what an older event holds for each (as `_upcast_2_to_3` upcasts a document); one
    that holds some of them
    but not all is refused like any event missing a field."""
    if type(data) is dict and "at" not in data:
        name = data.get("type")
        added = ADDED_IN_3.get(name) if type(name) is str else None
        if added is not None and not any(key in data for key in added):
            data = {**data, **added}
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
        found = fastload.clean_parse(data)  # type: ignore[arg-type]
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
    signed_events: Any = raw  # the chain was made over the events as written, not as upcast
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
        if not hmac.compare_digest(chain_tag(key, signed_events), chain):
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
