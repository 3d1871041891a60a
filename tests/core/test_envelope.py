"""The pure envelope functions: the read limit and reconciliation's classification."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from statemachine.envelope import Envelope, classify, measure_frontier, read_limit_for
from statemachine.payloads import JSON, canonical_json, digests
from statemachine.values import Step
from tests.helpers import staged_over

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


def _naive_read_limit(frontier: tuple[str, ...], batch: tuple[str, ...], *,
                      whole: bool) -> int | None:
    """DESIGN §2.3 read word for word: try every n, compare every tail."""
    m = len(batch)
    high = max(m + 1, len(frontier) + m) if whole else len(frontier)
    for n in range(m + 1, high + 1):
        tails = [(frontier + batch[:k])[-n:] for k in range(m + 1)]
        if len(set(tails)) == len(tails):
            return n
    return None


@given(st.lists(st.sampled_from("abc"), max_size=12), st.lists(st.sampled_from("abc"),
                                                                  max_size=8), st.booleans())
def test_read_limit_matches_the_naive_definition(frontier: list[str], batch: list[str],
                                                 whole: bool) -> None:
    expected = _naive_read_limit(tuple(frontier), tuple(batch), whole=whole)
    assert read_limit_for(frontier, batch, whole=whole) == expected


@given(st.lists(st.sampled_from("ab"), max_size=10), st.lists(st.sampled_from("ab"),
                                                                 min_size=1, max_size=6),
       st.integers(0, 6), st.sampled_from(["append", "ack", "partial", "other"]))
def test_classify_matches_the_naive_comparison(history: list[str], batch: list[str],
                                               extra: int, outcome: str) -> None:
    from statemachine.payloads import canonical_form, sha256_hex

    form = canonical_form("json")
    digest = {x: sha256_hex(form(x)) for x in "abcz"}
    p = tuple(digest[x] for x in history)
    b = tuple(digest[x] for x in batch)
    n = read_limit_for(p, b, whole=True)
    assert n is not None
    envelope = Envelope(session_id="s", items=tuple(batch), call_ids=(),
                        continuation=Step.RUN_AGAIN, read_limit=n, frontier=p[-n:],
                        frontier_whole=len(p) <= n,
                        batch_digests=b, guardrails=(), interruptions=(), fail_closed=False,
                        staged_seq=1)
    written = {"append": 0, "ack": len(batch), "partial": min(extra, len(batch)),
               "other": 0}[outcome]
    now = [*history, *batch[:written], *(["z"] if outcome == "other" else [])]
    found = classify(envelope, now, "s", form)
    seen = tuple(digest[x] for x in now[-n:])
    fp, fb = envelope.frontier, b
    if seen == fp[-n:]:
        assert found.kind == "append"
    elif seen == (fp + fb)[-n:]:
        assert found.kind == "acknowledge"
    else:
        ks = [k for k in range(1, len(fb)) if seen == (fp + fb[:k])[-n:]]
        assert (found.kind, found.written) == (("partial_write", ks[0]) if ks
                                                else ("history_changed", 0))


def test_a_staged_envelope_holds_each_field_under_its_own_name() -> None:
    """The fold builds the envelope by position: every field must land under its name."""
    from statemachine import RunController, ToolCall
    from statemachine.events import PublicationStaged

    c = RunController.start(run_id="r", session_id="s")
    c.add_input([{"role": "user", "content": "hi"}])
    c.guardrail_evaluated("g", {"ok": True}, stage="input")
    c.begin_model_call()
    c.model_responded([ToolCall("a", "t", {}, needs_approval=True),
                       ToolCall("b", "t", {}, needs_approval=True)])
    c.reject("a", {"r": 1})
    history: list[JSON] = [{"role": "system", "content": "x"}]
    batch: list[JSON] = [{"role": "user", "content": "hi"}, {"call_id": "a", "output": {"r": 1}}]
    c.stage_publication(batch, history, call_ids=["a"])
    envelope = c.envelope
    staged = c.events[-1]
    assert envelope is not None
    assert isinstance(staged, PublicationStaged)
    assert envelope.session_id == "s"
    assert envelope.items == tuple(batch) == staged.items
    assert envelope.call_ids == ("a",)
    assert envelope.continuation is Step.INTERRUPTION is staged.continuation
    assert envelope.read_limit == staged.read_limit == 3
    assert envelope.frontier == staged.frontier == tuple(digests(history, canonical_json))
    assert envelope.frontier_whole is True
    assert envelope.batch_digests == tuple(digests(batch, canonical_json))
    assert [g.name for g in envelope.guardrails] == ["g"]
    assert envelope.interruptions == ("b",)
    assert envelope.fail_closed is False
    assert envelope.staged_seq == staged.seq
    assert envelope.input_items == 1


def test_a_frontier_is_whole_only_when_it_covers_the_whole_history() -> None:
    # EN07: frontier_whole says the frontier covers all of P; with the whole Session given
    # but only its last read_limit items kept, it does not
    history: list[JSON] = [{"h": i} for i in range(3)]
    c = staged_over(history, [{"n": 9}], whole=True)
    envelope = c.envelope
    assert envelope is not None
    assert envelope.read_limit == 2
    assert envelope.frontier == digests(history[-2:], c.state.form)
    assert envelope.frontier_whole is False
    short = staged_over(history[:1], [{"n": 9}], whole=True)  # P shorter than the limit: all kept
    assert short.envelope is not None
    assert short.envelope.frontier_whole is True
    assert short.envelope.frontier == digests(history[:1], c.state.form)
