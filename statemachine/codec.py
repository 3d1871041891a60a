"""Versioned JSON for event logs, through one strict `cattrs` converter.

A document is ``{"schema_version": <int>, "run_id": <str>, "events": [...]}``; each event
is its attrs fields plus ``"type"`` (the class name). Structuring is strict: no coercion
(``"7"`` is not ``7``, ``1`` is not ``True``), no unknown or missing keys, enums by value
through explicit hooks, payloads checked to be plain JSON within the depth limit.
Messages name the event's position and the problem, never payload values.
"""

from __future__ import annotations

import contextvars
import json
import sys
from typing import TYPE_CHECKING, Any

import attrs
import cattrs

from statemachine import events as ev
from statemachine.errors import SchemaError
from statemachine.payloads import (
    DEFAULT_MAX_DEPTH,
    DEFAULT_MAX_EVENTS,
    JSON,
    PayloadError,
    detach,
    text_problem,
)
from statemachine.values import GuardrailResult, RecoveryPolicy, Step, ToolCall

if TYPE_CHECKING:
    import enum
    from collections.abc import Callable, Mapping

SCHEMA_VERSION = 2
"""The version `to_json` writes. Every released version stays readable (see `UPCASTERS`).

1: the first release. 2: adds `RunClaimed` (DESIGN §6.3); nothing else changed."""


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
            raise _Bad(f"expected {kind.__name__}, got {type(value).__name__}")
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
            raise _Bad(f"expected a list, got {type(value).__name__}")
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
            raise _Bad(f"expected a {cls.__name__} object, got {type(value).__name__}")
        if value.keys() != names:
            missing = sorted(names - value.keys())
            unknown = sorted(value.keys() - names)
            raise _Bad(f"a {cls.__name__} with missing field(s) {', '.join(missing) or '-'} "
                       f"and unknown field(s) {', '.join(unknown) or '-'}")
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


def encode_log(run_id: str, events: list[ev.Event] | tuple[ev.Event, ...]) -> dict[str, JSON]:
    """The current-version document for a run's log."""
    return {
        "schema_version": SCHEMA_VERSION,
        "run_id": run_id,
        "events": [encode_event(event) for event in events],
    }


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
        raise SchemaError(f"event {position} has a missing or unknown type")
    fields = _FIELDS[cls]
    if len(data) != len(fields) + 1 or any(f not in data for f in fields):
        missing = [f for f in fields if f not in data]
        if missing:
            raise SchemaError(f"event {position} ({name}) lacks field(s) {', '.join(missing)}")
        unknown = sorted(k for k in data if k not in fields and k != "type")
        raise SchemaError(f"event {position} ({name}) has unknown field(s) "
                          f"{', '.join(unknown)}")
    try:
        return _STRUCTURE[cls](data, cls)  # type: ignore[no-any-return]
    except SchemaError:
        raise
    except _Bad as exc:
        raise SchemaError(f"event {position} ({name}) has a bad field: {exc}") from None
    except Exception as exc:  # cattrs raises several kinds; name the kind only
        raise SchemaError(
            f"event {position} ({name}) is malformed ({type(exc).__name__})"
        ) from None


def decode_stored_event(data: Any, position: int) -> ev.Event:
    """Decode an event a store holds. Stores hold only what a controller recorded, under
    that controller's own depth limit, so none is imposed again here: every log a
    controller writes also loads."""
    token = _max_depth.set(sys.maxsize)
    try:
        return decode_event(data, position)
    finally:
        _max_depth.reset(token)


def decode_log(
    data: Mapping[str, Any] | str | bytes,
    *,
    max_depth: int = DEFAULT_MAX_DEPTH,
    max_events: int = DEFAULT_MAX_EVENTS,
) -> tuple[str, list[ev.Event]]:
    """A document (dict or text) of any released version → (run_id, events)."""
    if isinstance(data, str | bytes):
        data = parse(data)
    if type(data) is not dict:
        raise SchemaError("the document is not a JSON object")
    doc: dict[str, Any] = dict(data)
    version = doc.get("schema_version")
    if type(version) is not int:
        raise SchemaError("the document has a missing or mistyped schema_version")
    if version > SCHEMA_VERSION:
        raise SchemaError(
            f"schema_version {version} is newer than this library reads ({SCHEMA_VERSION})"
        )
    if version < 1 or (version < SCHEMA_VERSION and version not in UPCASTERS):
        raise SchemaError(f"unknown schema_version {version}")
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
    extra = set(doc) - {"schema_version", "run_id", "events"}
    if extra:
        raise SchemaError(f"the document has unknown key(s) {', '.join(sorted(extra))}")
    run_id, raw_events = doc.get("run_id"), doc.get("events")
    if type(run_id) is not str or type(raw_events) is not list:
        raise SchemaError("the document needs a str run_id and a list of events")
    if (problem := text_problem(run_id)) is not None:
        raise SchemaError(f"the document's run_id {problem}")
    if len(raw_events) > max_events:
        raise SchemaError(f"the log has more than max_events={max_events} events")
    token = _max_depth.set(max_depth)
    try:
        decoded = [decode_event(raw, i) for i, raw in enumerate(raw_events)]
    finally:
        _max_depth.reset(token)
    return run_id, decoded


# the tuple of guardrail results an envelope holds (snapshots carry envelopes)
converter.register_structure_hook_func(
    _is(tuple[GuardrailResult, ...]),
    _tuple_of(lambda item: converter.structure(item, GuardrailResult)),
)
