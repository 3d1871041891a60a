"""The publication envelope and reconciliation, as pure functions.

Before a fallible write of batch B to a history whose current state is P, the core
records an envelope: digests of P's tail, B itself, and what settling will do. After a
failure the write's outcome is unknown; `classify` compares the Session's current tail H
with the envelope and says which of the outcomes it sees:

* H ends exactly with P: nothing was written, append B (`FindingKind.APPEND`);
* H ends exactly with P + B: the write committed, acknowledge it (``ACKNOWLEDGE``);
* anything else (another session, P + B[:k], a changed tail): reject, keep the envelope.

``read_limit`` is the smallest n >= len(B) + 1 for which the n-item tails of
P + B[:k], k = 0..len(B), are pairwise distinct, so the last n items always tell the
outcomes apart. It is searched only within what the runner gave us, unless the runner
said the history is the whole Session.
"""

from __future__ import annotations

import enum
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
    input_items: int = 0
    """How many of B's first items are the run's recorded, unpublished input."""


_MOD = (1 << 61) - 1
_BASE = 1_000_003


class _Windows:
    """Rolling polynomial hashes over S = P + B, so the n-item window that ends at any
    position is hashed in O(1). Equal hashes are confirmed by comparing the items, so a
    collision never makes two different windows look equal."""

    def __init__(self, seq: Sequence[str]) -> None:
        ids: dict[str, int] = {}
        self.seq = tuple(seq)
        prefix = [0]
        powers = [1]
        for digest in self.seq:
            value = ids.setdefault(digest, len(ids) + 1)
            prefix.append((prefix[-1] * _BASE + value) % _MOD)
            powers.append(powers[-1] * _BASE % _MOD)
        self.prefix = prefix
        self.powers = powers

    def hash(self, start: int, end: int) -> int:
        return (self.prefix[end] - self.prefix[start] * self.powers[end - start]) % _MOD

    def same(self, a: int, b: int, n: int) -> bool:
        """Whether the n-item windows ending at ``a`` and ``b`` hold the same items."""
        return self.seq[a - n:a] == self.seq[b - n:b]


def _distinct(w: _Windows, p: int, m: int, n: int) -> bool:
    """Whether the n-item tails of P + B[:k], k = 0..m, are pairwise distinct. A tail
    cut short by the start of S is shorter than n and so differs from every other."""
    seen: dict[int, list[int]] = {}
    for end in range(max(p, n), p + m + 1):
        h = w.hash(end - n, end)
        ends = seen.setdefault(h, [])
        if any(w.same(other, end, n) for other in ends):
            return False
        ends.append(end)
    return True


def read_limit_for(frontier: Sequence[str], batch: Sequence[str], *, whole: bool) -> int | None:
    """The smallest n that tells P + B[:k] apart for every k, or None if ``frontier``
    (the known tail of P) is too short to find one and is not the whole of P.

    Two tails that are equal at n are equal at every smaller n, so "distinct" is monotone
    in n and a binary search over rolling hashes finds the smallest n in
    O((|P| + |B|) log |P|), not by trying every n and copying every tail."""
    m, p = len(batch), len(frontier)
    high = max(m + 1, p + m) if whole else p
    low = m + 1
    if high < low:
        return None
    w = _Windows([*frontier, *batch])
    if not _distinct(w, p, m, high):
        return None
    while low < high:
        middle = (low + high) // 2
        if _distinct(w, p, m, middle):
            high = middle
        else:
            low = middle + 1
    return low


def is_read_limit(frontier: Sequence[str], batch: Sequence[str], *, whole: bool,
                  limit: int) -> bool:
    """``read_limit_for(frontier, batch, whole=whole) == limit``, with two window checks
    instead of a search: since "distinct" is monotone in n, ``limit`` is the smallest n
    that tells the outcomes apart exactly when it does and ``limit - 1`` does not (or
    ``limit`` is the smallest n allowed). Replay checks every recorded limit this way."""
    m, p = len(batch), len(frontier)
    high = max(m + 1, p + m) if whole else p
    low = m + 1
    if type(limit) is not int or not low <= limit <= high:
        return False
    seq = (*frontier, *batch)
    if m <= 32 and limit <= 32:  # a few short windows: compare them directly
        ends = range(max(p, limit), p + m + 1)
        if len({seq[end - limit:end] for end in ends}) != len(ends):
            return False
        if limit == low:
            return True
        n = limit - 1
        ends = range(max(p, n), p + m + 1)
        return len({seq[end - n:end] for end in ends}) != len(ends)
    w = _Windows(seq)
    return _distinct(w, p, m, limit) and (limit == low or not _distinct(w, p, m, limit - 1))


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


class FindingKind(enum.StrEnum):
    """What `classify` saw in the Session's tail (a str enum: each member equals its
    text, so ``finding.kind == "append"`` keeps working)."""

    APPEND = "append"
    """The tail ends with the pre-write frontier P: nothing was written; append B."""
    ACKNOWLEDGE = "acknowledge"
    """The tail ends with P + B: the write committed; acknowledge it."""
    SESSION_MISMATCH = "session_mismatch"
    """The history is another Session's."""
    PARTIAL_WRITE = "partial_write"
    """The tail ends with P + B[:k] for some 0 < k < len(B): part of the batch landed."""
    HISTORY_CHANGED = "history_changed"
    """Neither: another writer, or a rewrite."""


@attrs.frozen
class Finding:
    """What `classify` saw (``kind``); ``written`` counts batch items found for a partial
    write."""

    kind: FindingKind = attrs.field(converter=FindingKind)
    written: int = 0

    def explain(self, envelope: Envelope) -> str:
        size = len(envelope.items)
        if self.kind is FindingKind.SESSION_MISMATCH:
            return "the history is from another Session than the envelope's"
        if self.kind is FindingKind.PARTIAL_WRITE:
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
        return Finding(FindingKind.SESSION_MISMATCH)
    n = envelope.read_limit
    tail = history[-n:] if len(history) > n else history
    seen = tuple(sha256_hex(form(item)) for item in tail)
    p, b = envelope.frontier, envelope.batch_digests
    if seen == p[-n:]:
        return Finding(FindingKind.APPEND)
    if seen == (p + b)[-n:]:
        return Finding(FindingKind.ACKNOWLEDGE)
    # a partial write P + B[:k]: at most one k matches (the tails are distinct at n)
    w = _Windows((*p, *b, *seen))
    size, whole_p = len(seen), len(p) + len(b)
    target = w.hash(whole_p, whole_p + size)
    for k in range(1, len(b)):
        end = len(p) + k
        if (end >= size and w.hash(end - size, end) == target
                and (size in (n, end)) and w.seq[end - size:end] == seen):
            return Finding(FindingKind.PARTIAL_WRITE, k)
    return Finding(FindingKind.HISTORY_CHANGED)
