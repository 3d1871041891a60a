"""Plain JSON payloads: validation, detaching and canonical digests.

Every payload that enters the core (tool arguments and outputs, items, guardrail results,
final outputs) is checked to be a plain JSON value and copied ("detached") on the way in,
because attrs ``frozen`` is shallow: a caller that mutates its dict afterwards must not be
able to change a recorded event. Plain JSON means ``dict`` with ``str`` keys, ``list``,
``str``, ``int``, finite ``float``, ``bool`` and ``None``, by exact type: no tuples, sets,
enum members or subclasses. The walk is iterative, so a deep document is refused by the
depth limit, never by a ``RecursionError``.

Also here: the measure ``max_bytes`` bounds. A value's size is the UTF-8 length of its
compact JSON text (`compact_json`: no spaces, no ASCII escapes, as the SQLite store writes
it); `json_size` and `str_size` count it exactly, `walk_size` without recursion.
"""

from __future__ import annotations

import hashlib
import json
import json.encoder
import math
import sys
from collections.abc import Callable
from typing import Any, NoReturn, TypeAlias

from statemachine.errors import SchemaError, excerpt, type_name

JSON: TypeAlias = Any
"""A plain JSON value (see the module docstring); ``Any`` because mypy cannot spell it."""

DEFAULT_MAX_DEPTH = 200
DEFAULT_MAX_EVENTS = 1_000_000
DEFAULT_MAX_BYTES = 64 * 2**20
"""64 MiB: the default bound on a document's size, the UTF-8 length of its compact JSON
text (see `compact_json`)."""

_SCALARS = frozenset({str, int, bool, type(None)})


class PayloadError(ValueError):
    """Why a value is not plain JSON; turned into a `SchemaError` by the caller."""


def encodable(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8 (a lone surrogate does not)."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


_BAD_TEXT = "a string that is not valid Unicode (a lone surrogate)"

MAX_INT_DIGITS = 4300
"""Python refuses to print an int with more digits than this (``int_max_str_digits``),
so such an int could be recorded and never written: it is refused on the way in."""
_INT_BITS = 14_000
"""Below this bit length an int has fewer than 4,300 digits (no need to count them)."""
_BIG_INT = "an int with more than 4300 digits"

MAX_TEXT = 4096
"""The longest identifier, name, reason or target (in characters) the core accepts."""


def _int_ok(value: int) -> bool:
    if value.bit_length() < _INT_BITS:
        return True
    try:
        return len(str(abs(value))) <= MAX_INT_DIGITS
    except ValueError:
        return False


def misprints(c: str) -> bool:
    """Whether the character ``c`` prints as something other than itself, or as nothing:
    a control, a line break, a direction override, a zero-width, private or unassigned
    one (Python's "not printable": categories Cc, Cf, Cs, Co, Cn, and separators other
    than the space)."""
    return not c.isprintable()


def text_problem(value: object) -> str | None:
    """Why ``value`` is not an acceptable text field (an id, a name, a reason), or None:
    not a str, longer than `MAX_TEXT`, holding a NUL, or not valid Unicode. A NUL is
    refused because PostgreSQL's ``text`` cannot hold one: a run whose id SQLite took
    would fail there, so it is refused on every store, before anything is recorded. (A
    payload's strings may hold NUL: they are stored as JSON text, where it is
    ``\\u0000``.)"""
    if type(value) is not str:
        return f"must be a str, not {type_name(value)}"
    if len(value) > MAX_TEXT:
        return f"is longer than {MAX_TEXT} characters"
    if "\x00" in value:
        return "holds a NUL character"
    if not encodable(value):
        return "is not valid Unicode (a lone surrogate)"
    return None


class _Unsure(Exception):
    """Internal: the fast copy met something it does not decide (a non-ASCII text, a big
    int, a non-finite float, a foreign type, the depth limit, a deep tree): `_walk`
    decides, with its precise message."""


_FAST_DEPTH = 48
"""Below this nesting the fast copy recurses (Python's stack holds it with room to
spare); a deeper tree is left to the iterative walk, which never recurses."""


def _fast_copy(value: Any, left: int) -> Any:
    """A copy of the dict or list ``value`` if it is plain JSON with only ASCII text,
    small ints and finite floats, within ``left`` levels; else `_Unsure`. Recursion is
    bounded by ``left`` (at most `_FAST_DEPTH`). The dict and the list loops check items
    alike and stay apart: one loop over either (``enumerate`` for a list, a branch for
    keys) made a payload's copy a quarter to a third slower."""
    if type(value) is dict:
        out: Any = {}
        for key, item in value.items():
            if type(key) is not str or not key.isascii():
                raise _Unsure
            kind = type(item)
            if kind is str:
                if not item.isascii():
                    raise _Unsure
            elif kind is int:
                if item.bit_length() >= _INT_BITS:
                    raise _Unsure
            elif kind is dict or kind is list:
                if left <= 1:
                    raise _Unsure
                out[key] = _fast_copy(item, left - 1)
                continue
            elif kind is float:
                if item - item != 0.0:  # inf - inf and nan - nan are nan
                    raise _Unsure
            elif item is not None and kind is not bool:
                raise _Unsure
            out[key] = item
        return out
    out = []
    for item in value:
        kind = type(item)
        if kind is str:
            if not item.isascii():
                raise _Unsure
        elif kind is int:
            if item.bit_length() >= _INT_BITS:
                raise _Unsure
        elif kind is dict or kind is list:
            if left <= 1:
                raise _Unsure
            out.append(_fast_copy(item, left - 1))
            continue
        elif kind is float:
            if item - item != 0.0:
                raise _Unsure
        elif item is not None and kind is not bool:
            raise _Unsure
        out.append(item)
    return out


def detach(value: JSON, max_depth: int = DEFAULT_MAX_DEPTH) -> JSON:
    """Return a deep copy of ``value``, raising `PayloadError` unless it is plain JSON.

    ``max_depth`` bounds the nesting of containers counted from ``value`` itself (a
    top-level list or dict is depth 1). The message names the problem, never the content.

    The common case (ASCII text, small ints, finite floats, shallow) is copied by a short
    recursive pass; anything else, and every refusal, by the iterative `_walk`."""
    kind = type(value)
    if (kind is dict or kind is list) and max_depth >= 1:
        try:
            return _fast_copy(value, min(max_depth, _FAST_DEPTH))
        except (_Unsure, RecursionError):
            pass
    return _walk(value, max_depth)


def _walk(value: JSON, max_depth: int) -> JSON:
    """`detach`, by an iterative walk: the reference for every value and every refusal."""
    kind = type(value)
    if kind in _SCALARS:
        if kind is str and not encodable(value):
            raise PayloadError(_BAD_TEXT)
        if kind is int and not _int_ok(value):
            raise PayloadError(_BIG_INT)
        return value
    if kind is float:
        if not math.isfinite(value):
            raise PayloadError("a float that is not finite (NaN or infinity)")
        return value
    if kind is not dict and kind is not list:
        raise PayloadError(f"a value of type {type_name(value)}, which is not plain JSON")
    if max_depth >= 1:
        # the common case: one flat container of strings, ints, bools and None
        values = value.values() if kind is dict else value
        if all(type(v) in _SCALARS and (type(v) is not str or encodable(v))
               and (type(v) is not int or v.bit_length() < _INT_BITS) for v in values):
            if kind is list:
                return list(value)
            if all(type(k) is str and encodable(k) for k in value):
                return dict(value)
    root: dict[str, JSON] | list[JSON] = {} if kind is dict else []
    stack: list[tuple[Any, Any, int]] = [(value, root, 1)]
    if max_depth < 1:
        raise PayloadError(f"nesting deeper than {max_depth}")
    while stack:
        source, target, depth = stack.pop()
        pairs = source.items() if type(source) is dict else enumerate(source)
        is_dict = type(target) is dict
        for key, item in pairs:
            if is_dict and type(key) is not str:
                raise PayloadError(f"a dict key of type {type_name(key)}")
            if is_dict and isinstance(key, str) and not encodable(key):
                raise PayloadError(_BAD_TEXT)
            kind = type(item)
            if kind in _SCALARS:
                if kind is str and not encodable(item):
                    raise PayloadError(_BAD_TEXT)
                if kind is int and not _int_ok(item):
                    raise PayloadError(_BIG_INT)
                copy = item
            elif kind is float:
                if not math.isfinite(item):
                    raise PayloadError("a float that is not finite (NaN or infinity)")
                copy = item
            elif kind is dict or kind is list:
                if depth + 1 > max_depth:
                    raise PayloadError(f"nesting deeper than {max_depth}")
                copy = {} if kind is dict else []
                stack.append((item, copy, depth + 1))
            else:
                raise PayloadError(f"a value of type {type_name(item)}, which is not plain JSON")
            if is_dict:
                target[key] = copy
            else:
                target.append(copy)
    return root


def copy_plain(value: JSON) -> JSON:
    """A deep copy of a value already checked by `detach` (under whatever depth limit):
    what the core hands out, so a caller cannot change what it recorded."""
    return detach(value, sys.maxsize)


def _refuse_type(value: object) -> NoReturn:
    raise TypeError(type(value).__name__)


def _make_compact() -> Callable[[JSON], str]:
    """The C encoder's one-shot call with compact separators, called directly: json.dumps
    with non-default options builds a new encoder per call, which costs more than the
    encoding itself for the small values the hot path measures."""
    c_make_encoder = getattr(json.encoder, "c_make_encoder", None)
    c_encode = getattr(json.encoder, "c_encode_basestring", None)
    if c_make_encoder is None or c_encode is None:  # pragma: no cover - no C accelerator
        encoder = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False,
                                   allow_nan=False)
        return encoder.encode
    # markers=None skips the circular check: only detached values (trees) are measured
    # this way; `document_size` measures untrusted ones with the check on.
    one_shot = c_make_encoder(None, _refuse_type, c_encode, None, ":", ",", False, False,
                              False)

    def compact(value: JSON) -> str:
        return "".join(one_shot(value, 0))

    return compact


compact_json: Callable[[JSON], str] = _make_compact()
"""``json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)`` for
a plain JSON tree (no circular check): the form whose UTF-8 length `max_bytes` bounds."""

encode_str: Callable[[str], str] = getattr(json.encoder, "c_encode_basestring", None) or \
    json.encoder.py_encode_basestring
"""A str as a JSON string (quotes and escapes, no ASCII escapes), as `compact_json`
writes it."""


def utf8_len(text: str) -> int:
    """The UTF-8 length of ``text`` (``isascii`` is O(1): no copy for ASCII text). A lone
    surrogate counts the three bytes it would take: this measures, it does not validate."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def str_size(text: str) -> int:
    """Bytes of ``text`` as a compact JSON string: quotes and escapes included."""
    return utf8_len(encode_str(text))


def json_size(value: JSON) -> int:
    """Bytes of a plain JSON tree's compact UTF-8 text (`compact_json`), exactly."""
    if value is None:
        return 4
    try:
        text = compact_json(value)
    except RecursionError:  # deeper than the C encoder goes: count it iteratively
        size = walk_size(value, sys.maxsize)
        if size is None:
            raise ValueError("not plain JSON") from None
        return size
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def walk_size(value: JSON, max_depth: int) -> int | None:
    """`json_size` by an iterative walk (no recursion, no text built): None when the tree
    is nested deeper than ``max_depth`` or holds a value compact JSON cannot write."""
    total = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        kind = type(item)
        if kind is str:
            total += str_size(item)
        elif kind is dict or kind is list:
            if depth >= max_depth:
                return None
            count = len(item)
            total += 2 + max(count - 1, 0)  # brackets and commas
            if kind is dict:
                for key, child in item.items():
                    if type(key) is not str:
                        return None
                    total += str_size(key) + 1  # the key and its colon
                    stack.append((child, depth + 1))
            else:
                stack.extend((child, depth + 1) for child in item)
        elif item is None or kind is bool:
            total += 4 if item is None or item else 5
        elif kind is int:
            if not _int_ok(item):
                return None
            total += len(int.__repr__(item))
        elif kind is float and math.isfinite(item):
            total += len(float.__repr__(item))
        else:
            return None
    return total


def _not_serializable(value: object) -> NoReturn:
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


_C_MAKE_ENCODER = getattr(json.encoder, "c_make_encoder", None)
_C_ENCODE_STR = getattr(json.encoder, "c_encode_basestring", None)


def canonical_json(value: JSON) -> bytes:
    """The built-in canonical form: sorted keys, no spaces, UTF-8, no NaN.

    ``json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
    allow_nan=False)``, through the C encoder it would build, built here without the
    options' overhead (the circular check stays)."""
    if _C_MAKE_ENCODER is None or _C_ENCODE_STR is None:  # pragma: no cover - no C accelerator
        return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                          allow_nan=False).encode("utf-8")
    if type(value) is str:
        text: str = _C_ENCODE_STR(value)
        return text.encode("utf-8")
    one_shot = _C_MAKE_ENCODER({}, _not_serializable, _C_ENCODE_STR, None, ":", ",", True,
                               False, False)
    return "".join(one_shot(value, 0)).encode("utf-8")


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fingerprint_of(name: str, arguments: JSON) -> str:
    """sha256 hex of the built-in canonical form of ``[name, arguments]``."""
    return sha256_hex(canonical_json([name, arguments]))


def fingerprint_digest(name: str, arguments: JSON) -> bytes:
    """`fingerprint_of` as the 32 bytes of the digest (its ``hex()`` is the fingerprint)."""
    return hashlib.sha256(canonical_json([name, arguments])).digest()


CanonicalForm: TypeAlias = Callable[[JSON], bytes]
"""Maps a Session item to the bytes its digest is taken over."""

_CANONICAL_FORMS: dict[str, CanonicalForm] = {"json": canonical_json}


def register_canonical(name: str, form: CanonicalForm) -> None:
    """Register a canonical form by name, for sessions that rewrite what they store.

    The name is recorded when a run starts; a run naming a form that is not registered
    in the loading process is refused with `SchemaError`. Re-registering a name with a
    different function is refused: it would silently change every recorded digest.
    """
    if type(name) is not str or not name:
        raise SchemaError("a canonical form needs a non-empty str name")
    existing = _CANONICAL_FORMS.get(name)
    if existing is not None and existing is not form:
        raise SchemaError(f"canonical form {excerpt(name)} is already registered")
    _CANONICAL_FORMS[name] = form


def canonical_form(name: str) -> CanonicalForm:
    """The canonical form registered as ``name``; `SchemaError` when unknown."""
    try:
        return _CANONICAL_FORMS[name]
    except KeyError:
        raise SchemaError(f"unknown canonical form {excerpt(name)}") from None


def digests(items: list[JSON] | tuple[JSON, ...], form: CanonicalForm) -> tuple[str, ...]:
    """Digest of each item's canonical form."""
    sha256 = hashlib.sha256
    return tuple([sha256(form(item)).hexdigest() for item in items])
