"""Versioned JSON: round trips of any reachable run, the golden fixtures, and every kind
of bad input refused with a typed error that names the problem."""

from __future__ import annotations

import enum
import json
import typing
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from statemachine import InvalidTransition, RunController, SchemaError, ToolCall, codec
from statemachine import events as ev
from statemachine.codec import SCHEMA_VERSION
from statemachine.stored import dumps, event_text
from statemachine.values import GuardrailResult
from tests.strategies import drive

FIXTURES = Path(__file__).parents[1] / "fixtures"


@pytest.mark.invariant("I10")
@given(st.data())
def test_any_reachable_run_round_trips_exactly(data: st.DataObject) -> None:
    c = drive(data).c
    doc = c.to_json()
    text = json.dumps(doc, sort_keys=True)
    again = RunController.from_json(text)
    assert again.state == c.state
    assert json.dumps(again.to_json(), sort_keys=True) == text
    assert again.events == c.events
    assert json.loads(text) == doc  # plain JSON: no tuples, no enum members survive


def test_to_json_is_plain_json() -> None:
    doc = drive_fixed().to_json()
    stack: list[Any] = [doc]
    while stack:
        value = stack.pop()
        assert type(value) in (dict, list, str, int, float, bool, type(None))
        if type(value) is dict:
            assert all(type(k) is str for k in value)
            stack.extend(value.values())
        elif type(value) is list:
            stack.extend(value)
    assert doc["schema_version"] == SCHEMA_VERSION


def drive_fixed() -> RunController:
    from tests.helpers import failed

    return failed()


# ------------------------------------------------------------------ golden fixtures


@pytest.mark.invariant("I10")
@pytest.mark.parametrize("path", sorted(FIXTURES.glob("v*/*.json")), ids=lambda p: p.stem)
def test_golden_fixture_of_every_released_version_loads(path: Path) -> None:
    expected = json.loads(path.with_suffix(".expected").read_text())
    c = RunController.from_json(path.read_text())
    assert c.step.value == expected["step"]
    assert list(c.pending_approvals) == expected["pending_approvals"]
    assert c.next_action().value == expected["next_action"]
    assert len(c.events) == expected["events"]
    if path.parent.name == f"v{SCHEMA_VERSION}":
        assert c.to_json() == json.loads(path.read_text())


def _negatives() -> list[tuple[str, dict[str, Any]]]:
    return [(p.stem, json.loads(p.read_text()))
            for p in sorted((FIXTURES / "negative").glob("*.json"))]


@pytest.mark.invariant("I10")
@pytest.mark.parametrize(("name", "case"), _negatives(), ids=[n for n, _ in _negatives()])
def test_negative_fixture_is_refused_with_a_typed_error(name: str, case: dict[str, Any]) -> None:
    text = (FIXTURES / "negative" / case["document"]).read_text()
    error = {"SchemaError": SchemaError, "InvalidTransition": InvalidTransition}[case["error"]]
    with pytest.raises(error) as info:
        RunController.from_json(text, **case.get("limits", {}))
    assert type(info.value) is error
    assert case["says"] in str(info.value)
    for secret in case.get("never_says", []):
        assert secret not in str(info.value)


def test_older_versions_are_upcast_and_newer_fields_refused_under_old_labels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Simulates the next release: version SCHEMA_VERSION + 1 introduces the Abandoned
    event."""
    from statemachine import codec

    current, following = SCHEMA_VERSION, SCHEMA_VERSION + 1
    doc = json.loads((FIXTURES / f"v{current}" / "partial_approval_unsettled.json").read_text())
    abandoned = json.loads((FIXTURES / f"v{current}" / "abandoned.json").read_text())
    calls: list[int] = []

    def upcast(doc: dict[str, Any]) -> dict[str, Any]:
        calls.append(doc["schema_version"])
        return {**doc, "schema_version": following}

    monkeypatch.setattr(codec, "SCHEMA_VERSION", following)
    monkeypatch.setitem(codec.UPCASTERS, current, upcast)
    monkeypatch.setitem(codec.EVENT_SINCE, "Abandoned", following)
    c = RunController.from_json(doc)
    assert calls == [current]
    assert c.to_json()["schema_version"] == following
    with pytest.raises(SchemaError, match=f"Abandoned is not valid under schema_version {current}"):
        RunController.from_json(abandoned)
    assert RunController.from_json({**abandoned, "schema_version": following}).step.value == (
        "terminal_unrecoverable")
    # a version 1 document goes through every upcaster in turn (its events untimed)
    calls.clear()
    assert RunController.from_json(
        (FIXTURES / "v1" / "partial_approval_unsettled.json").read_text()).events == tuple(
            attrs.evolve(e, at=None) for e in c.events)
    assert calls == [current]


def test_version_2_adds_run_claimed_and_upcasts_version_1_unchanged() -> None:
    from statemachine import codec

    assert codec.EVENT_SINCE["RunClaimed"] == 2
    assert {name for name, since in codec.EVENT_SINCE.items() if since > 1} == {"RunClaimed"}
    for path in sorted((FIXTURES / "v1").glob("*.json")):
        v1 = json.loads(path.read_text())
        assert codec.UPCASTERS[1](v1) == {**v1, "schema_version": 2}  # only the label
        assert codec.UPCASTERS[1](v1) == json.loads((FIXTURES / "v2" / path.name).read_text())
    claimed = json.loads((FIXTURES / "v2" / "claimed_unsettled.json").read_text())
    assert [e["owner"] for e in claimed["events"] if e["type"] == "RunClaimed"] == [
        "worker-a", None]
    with pytest.raises(SchemaError, match="RunClaimed is not valid under schema_version 1"):
        RunController.from_json({**claimed, "schema_version": 1})


# an independent statement of what version 3 added, field by field (DESIGN §7.2)
# (DESIGN §7.2, §7.3): what an older event holds for each field
_ADDED_IN_3: dict[str, dict[str, object]] = {
    "CallApproved": {"at": None, "by": None, "reason": None},
    "CallRejected": {"at": None, "by": None},
    "InDoubtResolved": {"at": None, "by": None, "outcome": "completed", "evidence": None},
    "Abandoned": {"at": None, "by": None}, "RunClaimed": {"at": None, "lease": None}}


def test_version_3_adds_time_and_actor_and_upcasts_older_logs_with_none() -> None:
    """Every event of a version 1 or 2 log loads with ``at`` None, and each decision with
    ``by`` (and an approval's ``reason``) None; written again, the log is the version 2
    one with those nulls and the new label, and nothing else changed."""
    from statemachine import codec

    assert SCHEMA_VERSION == 3
    assert {name: added for name, added in codec.ADDED_IN_3.items()
            if added != {"at": None}} == _ADDED_IN_3
    for version in (1, 2):
        for path in sorted((FIXTURES / f"v{version}").glob("*.json")):
            old = json.loads(path.read_text())
            c = RunController.from_json(old)
            assert all(e.at is None for e in c.events)
            expected = {**old, "schema_version": 3, "events": [
                {**e, **_ADDED_IN_3.get(e["type"], {"at": None})}
                for e in old["events"]]}
            assert c.to_json() == expected
            assert all(d.by is None and d.at is None for v in c.calls for d in v.decisions)


def test_version_3_fixtures_carry_time_by_and_reason() -> None:
    """The golden version 3 runs were timed by a clock moving 1 ms per reading: every
    event has an ``at``, strictly increasing; the decisions say who and why."""
    for path in sorted((FIXTURES / "v3").glob("*.json")):
        ats = [e["at"] for e in json.loads(path.read_text())["events"]]
        assert all(type(at) is int for at in ats), path.name
        assert ats == sorted(set(ats)), path.name
    c = RunController.from_json((FIXTURES / "v3" / "decided_and_resolved.json").read_text())
    decided = {v.call.call_id: [(d.kind, d.by, d.reason) for d in v.decisions] for v in c.calls}
    assert decided == {
        "charge": [("approved", "alice@example.com", "the customer asked for it"),
                   ("resolved", "carol", None)],
        "notify": [("rejected", "bob", None)],
        "audit": [("approved", "ops-bot", None)]}
    abandoned = json.loads((FIXTURES / "v3" / "abandoned_by.json").read_text())
    assert abandoned["events"][-1]["by"] == "dave"


def test_a_stored_event_of_an_older_library_loads_untimed() -> None:
    """A store's rows carry no version label: an event holding none of version 3's
    fields was written by an older library and loads with None for each; one holding
    some of them but not all is damaged."""
    from statemachine import codec
    from statemachine import events as ev

    approved = {"type": "CallApproved", "seq": 6, "call_id": "c", "fingerprint": "f" * 64}
    def as_dict(d: dict[str, Any]) -> ev.Event:
        return codec.decode_stored_event(d, 6)

    def as_text(d: dict[str, Any]) -> ev.Event:
        return codec.decode_stored_text(json.dumps(d), 6)

    for decode in (as_dict, as_text):
        assert decode(approved) == ev.CallApproved(6, "c", "f" * 64)
        assert decode({"type": "Resumed", "seq": 6}) == ev.Resumed(6)
        with pytest.raises(SchemaError, match="lacks field"):
            decode({**approved, "by": "alice"})  # half a version 3 event
    assert fastload_declines({"type": "Resumed", "seq": 6})


def fastload_declines(raw: dict[str, Any]) -> bool:
    from statemachine import fastload

    try:
        fastload.FAST_DECODE[raw["type"]](raw, None)
    except Exception:
        return True
    return False


def test_a_version_2_document_holding_a_version_3_field_is_refused() -> None:
    """A field is valid only under the labels that have it: a version 2 event that
    carries ``at``, ``by`` or ``reason`` was not written by a version 2 library."""
    v2 = json.loads((FIXTURES / "v2" / "partial_approval_unsettled.json").read_text())
    approved = next(i for i, e in enumerate(v2["events"]) if e["type"] == "CallApproved")
    for position, key in ((0, "at"), (approved, "by"), (approved, "reason")):
        doc = json.loads(json.dumps(v2))
        doc["events"][position][key] = None
        with pytest.raises(SchemaError, match=f"unknown field\\(s\\) '{key}' for "
                                              "schema_version 2"):
            RunController.from_json(doc)
        with pytest.raises(SchemaError, match="schema_version 2"):
            RunController.from_json(json.dumps(doc))  # the fast path refuses it too


@pytest.mark.invariant("I10")
def test_a_log_that_drops_a_nested_field_is_refused() -> None:
    c = RunController.start(run_id="r", session_id="s")
    c.begin_model_call()
    c.model_responded([ToolCall("c1", "t", {}, needs_approval=True)])
    doc = c.to_json()
    del doc["events"][2]["tool_calls"][0]["needs_approval"]
    with pytest.raises(SchemaError, match="missing field"):
        RunController.from_json(doc)
    doc = c.to_json()
    doc["events"][2]["tool_calls"][0]["extra"] = "x"
    with pytest.raises(SchemaError, match="unknown field"):
        RunController.from_json(doc)


@pytest.mark.parametrize("ensure_ascii", [True, False])
def test_a_lone_surrogate_in_a_text_document_is_refused(ensure_ascii: bool) -> None:
    """A text holding a lone surrogate is not clean (`fastload.clean_parse`), so it goes
    to the strict decoder, which refuses the string: the fast decoders check no text."""
    from statemachine import codec, fastload

    doc: Any = RunController.start(run_id="r", session_id="s").to_json()
    doc["events"][0]["session_id"] = "\ud800"
    text = json.dumps(doc, separators=(",", ":"), ensure_ascii=ensure_ascii)
    assert fastload.clean_parse(text) is None
    with pytest.raises(SchemaError, match="not valid Unicode"):
        codec.decode_log(text)
    with pytest.raises(SchemaError, match="not valid Unicode"):
        RunController.from_json(text)


@pytest.mark.parametrize("sign", ["", "-"])
def test_an_int_past_the_digit_limit_is_refused_by_name(sign: str) -> None:
    """Python's int() refuses more than 4,300 digits with a bare ValueError; the document
    is valid JSON, so the refusal names the limit, not the syntax."""
    doc = RunController.start(run_id="run-1", session_id="session-1").to_json()
    text = json.dumps(doc).replace('"session-1"', sign + "7" * 4301, 1)
    with pytest.raises(SchemaError, match="an integer of more than 4300 digits"):
        RunController.from_json(text)
    with pytest.raises(SchemaError, match="not valid JSON"):
        RunController.from_json("{x" + text)  # a syntax error before it comes first


# ------------------------------------------- a stored event's text, payloads not copied


class _Number(enum.IntEnum):
    ONE = 1


class _Word(enum.StrEnum):
    YES = "yes"


_ODD = st.sampled_from([
    (1, 2), {1, 2}, frozenset(), _Number.ONE, _Word.YES, float("nan"), float("inf"),
    ToolCall("x", "t", {"a": 1}), b"bytes", object(),
])
_KEYS = st.one_of(st.text(max_size=3), st.integers(), st.booleans(), st.none(),
                  st.floats(allow_nan=False), st.tuples(st.integers()))
_PAYLOADS = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=5),
              _ODD),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(_KEYS, inner, max_size=3),
                            st.tuples(inner, inner)),
    max_leaves=8)


@attrs.frozen
class _OwnCall(ToolCall):
    note: str = "n"


@attrs.frozen
class _OwnResult(GuardrailResult):
    note: str = "n"


_SUBCLASSES: dict[Any, Any] = {ToolCall: _OwnCall, GuardrailResult: _OwnResult}


def _field(kind: Any) -> st.SearchStrategy[Any]:
    if kind is Any:
        return _PAYLOADS
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return st.sampled_from(list(kind))
    if kind in (ToolCall, GuardrailResult):  # (or a subclass with a field of its own)
        return _built(kind) | _built(_SUBCLASSES[kind])
    if typing.get_origin(kind) is tuple:  # (now and then an item of another kind)
        item = _field(typing.get_args(kind)[0])
        return st.lists(item | _PAYLOADS if kind == tuple[ToolCall, ...] else item,
                        max_size=3).map(tuple)
    simple = {int: st.integers(), str: st.text(max_size=5), bool: st.booleans()}
    if kind in simple:
        return simple[kind]
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    assert len(args) == 1, kind  # an optional field
    return st.none() | _field(args[0])


def _built(cls: type) -> st.SearchStrategy[Any]:
    hints = typing.get_type_hints(cls)
    return st.fixed_dictionaries({f.name: _field(hints[f.name]) for f in attrs.fields(cls)}
                                 ).map(lambda fields: _made(cls, fields)).filter(
                                     lambda made: made is not None)


def _made(cls: type, fields: dict[str, Any]) -> Any:
    try:
        return cls(**fields)
    except ValueError:  # (a field's own check: a lease without an owner)
        return None


def _outcome(encode: Any) -> tuple[str, str]:
    try:
        return "text", encode()
    except (TypeError, ValueError, RecursionError) as error:
        return "error", type(error).__name__


@given(st.sampled_from(ev.EVENT_TYPES).flatmap(_built))
def test_a_stored_events_text_is_its_encoded_documents(event: ev.Event) -> None:
    # the stores' text of an event (payloads handed to json as they are) against the
    # document's encoding serialized, for every event class and field, with payloads
    # json serializes alike either way (tuples, an IntEnum, a str Enum, keys of any
    # scalar), payloads it refuses (a set, bytes, NaN: the same error either way), tool
    # calls and guardrail results of a subclass (its own field written too), and a tool
    # call that is no ToolCall at all
    expected = _outcome(lambda: dumps(codec.encode_event(event)))
    assert _outcome(lambda: event_text(event)) == expected


def test_a_stored_events_text_copies_nothing_it_keeps() -> None:
    # the shared form is serialized at once: the event's payload is not changed, and an
    # event of a class the codec does not declare is encoded by the document's rules
    payload = {"a": [1, {"b": 2}]}
    event = ev.ToolCompleted(4, "c", payload, at=7)
    assert json.loads(event_text(event)) == {"type": "ToolCompleted", "seq": 4, "at": 7,
                                             "call_id": "c", "output": payload}
    assert payload == {"a": [1, {"b": 2}]}

    @attrs.frozen
    class Later(ev.ToolCompleted):
        note: str = "n"

    assert codec.shared_event(Later(5, "c", 1)) is None
    assert event_text(Later(5, "c", 1)) == dumps(codec.encode_event(Later(5, "c", 1)))


def test_a_payload_nested_past_what_cattrs_copies_is_stored_and_loads_back(
        tmp_path: Path) -> None:
    # encode_event raises RecursionError on it (cattrs copies it frame by frame); the
    # stored text is json's, and the log loads back as it was (a hand-built event: a
    # controller never records a payload past its depth limit)
    from statemachine import RecoveryPolicy
    from statemachine.stores import SQLiteEventStore

    deep: Any = 0
    for _ in range(500):
        deep = [deep]
    events = [ev.RunStarted(0, "r", None, RecoveryPolicy.FAIL_CLOSED, None, "c"),
              ev.ToolCompleted(1, "c", deep)]
    with pytest.raises(RecursionError):
        dumps(codec.encode_event(events[1]))
    store = SQLiteEventStore(tmp_path / "events.db")
    store.append("r", events, 0)
    assert store.load("r") == events
    store.close()
