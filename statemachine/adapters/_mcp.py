"""What every adapter that carries MCP tools shares (DESIGN §7.4 "MCP"): the idempotency
key in a ``tools/call`` request's ``_meta``, which failures of a ``tools/call`` are the
server's answer and which leave the call in doubt, and when a server's hints make a tool
idempotent.

A ``tools/call`` is a request over a transport: once it was sent, only the server's
answer says what happened. A tool's result (``isError`` or not) is an answer, and so is
a JSON-RPC error saying the server refused the request as it was (it could not parse it,
does not know the method, or the parameters are invalid: it ran nothing). Every other
failure (a connection closed or cut, a timeout, an HTTP status from a proxy, an internal
error, a cancellation) may have come after the tool ran: the call is in doubt, and the
library never sends it again. This module imports nothing of the `mcp` package, so an
adapter whose SDK does not depend on it can still import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

IDEMPOTENCY_KEY = "statemachine/idempotency_key"
"""The ``_meta`` key of a ``tools/call`` request that carries the call's idempotency key
(`RunController.idempotency_key`): a server that deduplicates reads it there."""

REFUSED_UNRUN = frozenset({-32700, -32600, -32601, -32602})
"""The JSON-RPC error codes by which a server refuses a request it did not run (parse
error, invalid request, method not found, invalid params). Not -32603 (internal error):
the tool may have run before it failed, and not the codes the client makes up itself for
a closed connection or a timeout."""


def with_key(meta: Mapping[str, Any] | None, key: str) -> dict[str, Any]:
    """``meta`` (the request's ``_meta``, or None) with the call's idempotency key added;
    a key already there is replaced: the ledger's key is the only one the call has."""
    merged = dict(meta or {})
    merged[IDEMPOTENCY_KEY] = key
    return merged


def error_code(error: BaseException) -> int | None:
    """The JSON-RPC code of an MCP error (``mcp``'s `MCPError`, in either of its
    shapes), or None for anything else."""
    code = getattr(error, "code", None)
    if not isinstance(code, int):
        code = getattr(getattr(error, "error", None), "code", None)
    return code if isinstance(code, int) and not isinstance(code, bool) else None


def answered(error: BaseException) -> bool:
    """Whether ``error``, raised by a ``tools/call``, is the server's answer that it ran
    nothing (`REFUSED_UNRUN`); False for everything that may have come after the tool
    ran, and the call is then in doubt."""
    if not isinstance(error, Exception) or type(error).__name__ != "MCPError":
        return False
    return error_code(error) in REFUSED_UNRUN


def hinted_idempotent(annotations: Any) -> bool:
    """Whether a tool's annotations say it may run twice: ``readOnlyHint`` or
    ``idempotentHint`` true. Counts only for a server the user marked trusted: a hint is
    the server's claim, and an untrusted server's claim never re-runs a call."""
    if annotations is None:
        return False
    hints = [getattr(annotations, name, None) for name in ("read_only_hint", "readOnlyHint",
                                                           "idempotent_hint",
                                                           "idempotentHint")]
    return any(hint is True for hint in hints)
