"""The publication envelope and reconciliation, as pure functions.

Before a fallible write of batch B to a history whose current state is P, the core
records an envelope: digests of P's tail, B itself, and what settling will do. After a
failure the write's outcome is unknown; `classify` compares the Session's current tail H
with the envelope and says which of the outcomes it sees:

* H ends exactly with P: nothing was written, append B (``"append"``);
* H ends exactly with P + B: the write committed, acknowledge it (``"acknowledge"``);
* anything else (another session, P + B[:k], a changed tail): reject, keep the envelope.

``read_limit`` is the smallest n >= len(B) + 1 for which the n-item tails of
P + B[:k], k = 0..len(B), are pairwise distinct, so the last n items always tell the
outcomes apart. It is searched only within what the runner gave us, unless the runner
said the history is the whole Session.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

from statemachine.payloads import JSON, CanonicalForm, sha256_hex
from statemachine.values import GuardrailResult, Step


@attrs.frozen
class Envelope:
    """A staged publication (read it from `RunController.envelope`)."""

    session_id: str | None
    items: tuple[JSON, ...]
    """The canonical batch B (detached copies)."""
    call_ids: tuple[str, ...]
    """The calls whose results B publishes."""
    continuation: Step
    """The step the run enters once B is settled."""
    read_limit: int
    """How many Session items reconciliation reads (``get_items(limit=read_limit)``)."""
    frontier: tuple[str, ...]
    """Digests of the last ``len(frontier)`` items of the pre-write history P."""
    frontier_whole: bool
    """``frontier`` covers all of P (P is shorter than ``read_limit``)."""
    batch_digests: tuple[str, ...]
    guardrails: tuple[GuardrailResult, ...]
    """The completed guardrail results G this batch publishes when it settles."""
    interruptions: tuple[str, ...]
    """The call ids still awaiting a decision (I), unchanged until the envelope settles."""
    fail_closed: bool
    """FAIL_CLOSED policy, or a lossy final output: no reconciliation, ever."""
    staged_seq: int


def read_limit_for(frontier: Sequence[str], batch: Sequence[str], *, whole: bool) -> int | None:
    """The smallest n that tells P + B[:k] apart for every k, or None if ``frontier``
    (the known tail of P) is too short to find one and is not the whole of P."""
    m = len(batch)
    p = tuple(frontier)
    b = tuple(batch)
    high = max(m + 1, len(p) + m) if whole else len(p)
    for n in range(m + 1, high + 1):
        p_tail = p[-n:]
        seen: set[tuple[str, ...]] = set()
        for k in range(m + 1):
            tail = (p_tail + b[:k])[-n:]
            if tail in seen:
                break
            seen.add(tail)
        else:
            return n
    return None


@attrs.frozen
class Frontier:
    """What `measure_frontier` found: the limit and the digests of P's tail to keep."""

    read_limit: int
    digests: tuple[str, ...]
    whole: bool


def measure_frontier(
    history: Sequence[JSON], batch_digests: Sequence[str], form: CanonicalForm, *, whole: bool
) -> Frontier | None:
    """Compute ``read_limit`` from the history the runner gave, digesting only as much of
    its tail as the search needs. None when ``history`` cannot tell the outcomes apart."""
    m = len(batch_digests)
    given = len(history)
    window = min(given, 2 * (m + 1))
    cache: list[str] = []  # digests of history from the end backwards
    while True:
        while len(cache) < window:
            cache.append(sha256_hex(form(history[given - 1 - len(cache)])))
        p_tail = tuple(reversed(cache))
        covers_all = window == given
        n = read_limit_for(p_tail, batch_digests, whole=whole and covers_all)
        if n is not None:
            kept = p_tail[-n:]
            return Frontier(n, kept, whole and covers_all and len(kept) == given)
        if covers_all:
            return None
        window = min(given, window * 2)


@attrs.frozen
class Finding:
    """What `classify` saw. ``kind`` is ``append``, ``acknowledge``, ``session_mismatch``,
    ``partial_write`` or ``history_changed``; ``written`` counts batch items found for a
    partial write."""

    kind: str
    written: int = 0

    def explain(self, envelope: Envelope) -> str:
        size = len(envelope.items)
        if self.kind == "session_mismatch":
            return "the history is from another Session than the envelope's"
        if self.kind == "partial_write":
            return (f"a partial write: {self.written} of the batch's {size} items are in "
                    "the Session; repair it to the pre-write frontier or abandon the run")
        return ("the Session's tail is neither the pre-write frontier nor the frontier plus "
                "the batch (another writer, or a rewrite)")


def classify(
    envelope: Envelope,
    history: Sequence[JSON],
    session_id: str | None,
    form: Callable[[JSON], bytes],
) -> Finding:
    """Compare the Session's tail with the envelope (pure; reads only the last
    ``read_limit`` items of ``history``)."""
    if session_id != envelope.session_id:
        return Finding("session_mismatch")
    n = envelope.read_limit
    tail = history[-n:] if len(history) > n else history
    seen = tuple(sha256_hex(form(item)) for item in tail)
    p, b = envelope.frontier, envelope.batch_digests
    if seen == p[-n:]:
        return Finding("append")
    if seen == (p + b)[-n:]:
        return Finding("acknowledge")
    for k in range(1, len(b)):
        if seen == (p + b[:k])[-n:]:
            return Finding("partial_write", k)
    return Finding("history_changed")
