"""The fast loading paths: decoders for clean text, which decline anything unusual.

Loading is mostly decoding text this library wrote. A text that is the compact JSON of
what it parses to, up to a space after a comma or a colon (so what ``json.dumps`` writes
with its default separators too), holds no duplicate key and no NaN or infinity (see
`clean_parse`); if that text is also valid Unicode throughout, every value in it is
plain JSON of an exact type with valid text (no NUL) and printable ints. Such a "clean" tree is
the parser's own, so nothing else holds it and its payloads need no copy: only their
depth is checked. Its events are decoded by one generated function per class
(`FAST_DECODE`: exact types, text lengths, enums, key sets); a store's rows that are all
clean are parsed and decoded together (`decode_stored_batch`), measuring their size on
the way.

Nothing here decides a refusal. Whatever a fast decoder does not accept (it raises, or a
function here answers None) is decoded again by `codec.decode_event`, the strict parser
and decoder, which gives the precise refusal: the strict path stays the authority for
every text that is not clean. `codec` calls these first; `tests/core/test_codec.py` and
`tests/tools/test_bench.py` check the two paths agree.
"""

from __future__ import annotations

import json
import json.encoder
from collections.abc import Callable
from typing import Any, NoReturn

import attrs

from statemachine import events as ev
from statemachine.payloads import JSON, MAX_TEXT, compact_json, encodable, utf8_len
from statemachine.values import GuardrailResult, RecoveryPolicy, Resolution, Step, ToolCall


class _Slow(Exception):
    """Internal: the fast decoder declines; `codec.decode_event` decides."""


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


_NUL = "\\u0000"
"""How a NUL reads in compact JSON. A text holding one is not clean: the fast decoders do
not look for it, and the strict path refuses it in a text field (`text_problem`) and
keeps it in a payload."""


def clean_parse(text: str) -> tuple[Any, str] | None:
    """(the parsed tree, its compact text) when ``text`` is clean (see the module), else
    None: then `codec.parse` decides, strictly.

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
    if not encodable(compact) or _NUL in compact:
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
        elif kind in (Step, RecoveryPolicy, Resolution):
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
    # positional fields first, then the keyword-only ones (``at``, ``by``, ``reason``)
    passed = [v for f, v in zip(fields, args, strict=True) if not f.kw_only]
    passed += [f"{f.name}={v}" for f, v in zip(fields, args, strict=True) if f.kw_only]
    lines.append(f"    return _cls({', '.join(passed)})")
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
    "_Resolution": {member.value: member for member in Resolution},
}
_FAST_NAMESPACE["_ToolCall"] = _fast_decoder(ToolCall, _FAST_NAMESPACE)
_FAST_NAMESPACE["_GuardrailResult"] = _fast_decoder(GuardrailResult, _FAST_NAMESPACE)
FAST_DECODE: dict[str, Callable[[Any, Limit], ev.Event]] = {
    cls.__name__: _fast_decoder(cls, _FAST_NAMESPACE) for cls in ev.EVENT_TYPES
}
"""``FAST_DECODE[name](raw, limit)``: the event a clean raw event holds (payloads within
``limit`` levels; None: no limit), or an exception: then `codec.decode_event` decides."""


_scan_once: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


def decode_stored_batch(bodies: list[str], first: int) -> tuple[list[ev.Event], int] | None:
    """(the events, their size) of stored bodies, the compact JSON of one event each from
    seq ``first`` on, when every body is clean, decodes by its fast decoder and carries
    its row's seq; None otherwise: decode them one by one (`codec.decode_stored_text`),
    which names the first row that is wrong. The size is the UTF-8 length of the bodies
    joined by commas: what the events add to a document's ``"events"``.

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
    if compact[1:-1] != ",".join(bodies) or not encodable(compact) or _NUL in compact:
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
    return decoded, utf8_len(compact) - 2
