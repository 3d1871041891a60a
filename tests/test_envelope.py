"""The pure envelope functions: the read limit and reconciliation's classification."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from statemachine.envelope import Envelope, classify, measure_frontier, read_limit_for
from statemachine.payloads import canonical_json, digests
from statemachine.values import Step

tokens = st.lists(st.sampled_from("xyab"), max_size=7)


def _tails_distinct(p: list[str], b: list[str], n: int) -> bool:
    tails = [tuple((p + b[:k])[-n:]) for k in range(len(b) + 1)]
    return len(set(tails)) == len(tails)


def test_read_limit_of_the_design_example() -> None:
    # P = [a, y, x, y], B = [x, y] needs more than three items
    assert read_limit_for("ayxy", "xy", whole=True) == 4
    assert read_limit_for("yxy", "xy", whole=False) is None


@given(tokens, st.lists(st.sampled_from("xyab"), min_size=1, max_size=4))
def test_read_limit_is_the_smallest_that_tells_every_outcome_apart(
    p: list[str], b: list[str]
) -> None:
    n = read_limit_for(p, b, whole=True)
    assert n is not None
    assert len(b) + 1 <= n <= max(len(b) + 1, len(p) + len(b))
    assert _tails_distinct(p, b, n)
    assert all(not _tails_distinct(p, b, k) for k in range(len(b) + 1, n))


@given(tokens, st.lists(st.sampled_from("xyab"), min_size=1, max_size=4),
       st.integers(0, 4))
def test_classify_finds_exactly_the_outcome_written(p: list[str], b: list[str],
                                                    k_extra: int) -> None:
    history = [{"t": t} for t in p]
    batch = [{"t": t} for t in b]
    batch_digests = digests(batch, canonical_json)
    frontier = measure_frontier(history, batch_digests, canonical_json, whole=True)
    assert frontier is not None
    envelope = Envelope("s", tuple(batch), (), Step.RUN_AGAIN, frontier.read_limit,
                        frontier.digests, frontier.whole, batch_digests, (), (), False, 1)
    for k in range(len(b) + 1):
        finding = classify(envelope, history + batch[:k], "s", canonical_json)
        expected = "append" if k == 0 else "acknowledge" if k == len(b) else "partial_write"
        assert finding.kind == expected
        if expected == "partial_write":
            assert finding.written == k
    assert classify(envelope, history, "other", canonical_json).kind == "session_mismatch"
    extra = history + batch + [{"t": "later"}] * (k_extra + 1)
    assert classify(envelope, extra, "s", canonical_json).kind == "history_changed"


def test_measure_frontier_digests_only_what_it_needs() -> None:
    seen = []

    def counting(item: object) -> bytes:
        seen.append(item)
        return canonical_json(item)

    history = [{"i": i} for i in range(10_000)]
    frontier = measure_frontier(history, digests([{"new": 1}], canonical_json), counting,
                                whole=True)
    assert frontier is not None
    assert frontier.read_limit == 2
    assert not frontier.whole
    assert len(seen) <= 4
