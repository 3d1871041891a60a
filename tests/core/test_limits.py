"""The byte limit (DESIGN §3.2, §6.6) and the bound on error messages.

``max_bytes`` bounds the UTF-8 length of a run's compact JSON text (``to_json()`` written
with ``separators=(",", ":")`` and ``ensure_ascii=False``). It binds commands and loading
alike: a command that would pass it is refused before recording, every log a controller
writes also loads under the same limit (with or without a keyed chain), and room is kept
so that a run at its limit can still fail, reconcile, commit and abandon. A dict and its
compact text are accepted or refused together, to the byte.

Messages quote at most 64 characters of any string a document holds."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from statemachine import (
    Append,
    InvalidTransition,
    MemoryEventStore,
    RecoveryPolicy,
    RunController,
    SchemaError,
    Step,
    ToolCall,
    codec,
    sizes,
)
from statemachine import events as ev
from statemachine import payloads as pl
from statemachine.controller import RESERVED_TEXT
from statemachine.payloads import MAX_TEXT
from statemachine.stores import SQLiteEventStore
from statemachine.values import GuardrailResult
from tests.helpers import assert_refused, failed
from tests.strategies import drive, step

KEY = b"limits-test-key"
WEIRD = 'quote" back\\slash new\nline \x01ctl \x7f é 中 😀 \u2028'


def compact(doc: Any) -> str:
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def measured(doc: Any) -> int:
    return len(compact(doc).encode("utf-8"))


# ------------------------------------------------------------------ the measure


EVENTS: list[ev.Event] = [
    ev.RunStarted(0, WEIRD, None, RecoveryPolicy.FAIL_CLOSED, 3, "json"),
    ev.RunStarted(0, "r", "s", RecoveryPolicy.RECONCILE, None, "json"),
    ev.ModelCallBegun(10**12),
    ev.ModelResponded(5, (ToolCall(WEIRD, "t", {"a": [1.5, -0.0, 1e300, 2**70]}, True,
                                   False), ToolCall("b", WEIRD, [], False, True)), None),
    ev.ModelResponded(5, (), {WEIRD: [WEIRD, None, True, False, {}]}),
    ev.InputAdded(1, ()),
    ev.InputAdded(1, ({"role": WEIRD}, "x", 0.1, None)),
    ev.CallApproved(7, WEIRD, "f" * 64),
    ev.CallRejected(7, "c", "0" * 64, None),
    ev.HookRan(99, WEIRD, None),
    ev.HookRan(99, "tool_start", WEIRD),
    ev.GuardrailEvaluated(3, GuardrailResult(WEIRD, "input", None, {"score": 0.97})),
    ev.GuardrailEvaluated(3, GuardrailResult("g", "tool_input", WEIRD, None)),
    ev.FinalOutputAccepted(8, WEIRD, False),
    ev.HandedOff(8, WEIRD),
    ev.PublicationStaged(9, None, ({"k": WEIRD},), (WEIRD,), 2, ("a" * 64,), True,
                         ("b" * 64,), Step.COMPLETED),
    ev.PublicationFailed(10, WEIRD),
    ev.ReconciledAppend(11, True),
    ev.ReconciledAcknowledge(11, False),
    ev.ToolCallsReceived(12, ()),
    ev.ResultPostFailed(13, "c", WEIRD),
    ev.RunClaimed(14, None),
    ev.RunClaimed(14, WEIRD),
    ev.Abandoned(15, WEIRD * 50),
    # time and actor (schema version 3): an int of any length, None, text of any kind
    ev.ModelCallBegun(1, at=1_767_225_600_123_456),
    ev.ModelCallBegun(1, at=0),
    ev.ModelCallBegun(1, at=10**15 - 1),  # the edges of the 16-digit readings
    ev.ModelCallBegun(1, at=10**15),
    ev.ModelCallBegun(1, at=10**16 - 1),
    ev.ModelCallBegun(1, at=10**16),
    ev.RunStarted(0, "r", "s", RecoveryPolicy.RECONCILE, None, "json", at=ev.MAX_AT),
    ev.CallApproved(7, "c", "f" * 64, at=10**15, by=WEIRD, reason=WEIRD * 3),
    ev.CallApproved(7, "c", "f" * 64, at=None, by=None, reason="why"),
    ev.CallRejected(7, "c", "0" * 64, {"no": WEIRD}, at=5, by=WEIRD),
    ev.InDoubtResolved(1, "c", "charged", at=99, by="verify:charge"),
    ev.Abandoned(15, "stop", at=123, by=WEIRD),
]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_event_size_is_the_length_of_its_compact_json(event: ev.Event) -> None:
    assert sizes.event_size(event) == measured(codec.encode_event(event))


def test_every_event_type_is_measured() -> None:
    assert {type(e) for e in EVENTS} | {ev.Resumed, ev.ToolStarted, ev.ToolCompleted,
                                        ev.InDoubtResolved, ev.RunCompleted,
                                        ev.PublicationCommitted, ev.ResultPosted,
                                        ev.ModelFailed} == set(ev.EVENT_TYPES)
    for event in (ev.Resumed(1), ev.ToolStarted(1, WEIRD), ev.ToolCompleted(1, "c", [WEIRD]),
                  ev.InDoubtResolved(1, "c", {"a": {}}), ev.RunCompleted(10),
                  ev.PublicationCommitted(100), ev.ResultPosted(1, WEIRD),
                  ev.ModelFailed(1, "TimeoutError")):
        assert sizes.event_size(event) == measured(codec.encode_event(event))


def test_a_payload_deeper_than_the_encoder_goes_is_measured_exactly() -> None:
    deep: Any = "leaf"
    for _ in range(5000):
        deep = [deep]
    assert pl.json_size(deep) == 5000 * 2 + len('"leaf"')
    assert pl.walk_size({"a": [1, 2.5, None, True, "é"]}, 3) == measured(
        {"a": [1, 2.5, None, True, "é"]})
    assert pl.walk_size([[[]]], 2) is None  # deeper than allowed


@given(st.data())
def test_size_is_the_compact_json_length_of_any_reachable_run(data: st.DataObject) -> None:
    c = drive(data).c
    doc = c.to_json()
    assert c.size == measured(doc)
    assert RunController.from_json(doc).size == c.size
    assert measured(c.to_json(key=KEY)) == c.size + sizes.CHAIN_BYTES


# ------------------------------------------------------- dict and text, to the byte


def test_a_document_at_the_limit_loads_as_dict_and_text_and_one_byte_over_neither() -> None:
    c = RunController.start(run_id="r", session_id="s")
    c.begin_model_call()
    c.model_responded(output={"text": WEIRD, "n": 1.25})
    doc = c.to_json()
    text = compact(doc)
    size = len(text.encode("utf-8"))
    assert size > len(text)  # non-ASCII: bytes, not characters, are counted
    for data in (doc, text, text.encode("utf-8")):
        assert RunController.from_json(data, max_bytes=size).state == c.state
        with pytest.raises(SchemaError, match="over max_bytes"):
            RunController.from_json(data, max_bytes=size - 1)
    signed = c.to_json(key=KEY)
    signed_size = measured(signed)
    for data in (signed, compact(signed)):
        RunController.from_json(data, max_bytes=signed_size, key=KEY)
        with pytest.raises(SchemaError, match="over max_bytes"):
            RunController.from_json(data, max_bytes=signed_size - 1, key=KEY)


def test_a_text_is_refused_before_parsing_and_measured_in_its_compact_form() -> None:
    with pytest.raises(SchemaError, match="over max_bytes=100 "):
        RunController.from_json("[" * 101, max_bytes=100)  # not parsed: not "nested"
    with pytest.raises(SchemaError, match="over max_bytes"):
        RunController.from_json(b"{" + b" " * 200 + b"}", max_bytes=100)
    # a float written short ("1e15") is counted as the encoder writes it back
    # ("1000000000000000.0"): a short text cannot smuggle in a larger document
    c = RunController.start(run_id="r", session_id=None)
    c.begin_model_call()
    c.model_responded(output=[1e15] * 20)
    text = compact(c.to_json()).replace("1000000000000000.0", "1e15")
    assert len(text) < c.size
    with pytest.raises(SchemaError, match="over max_bytes"):
        RunController.from_json(text, max_bytes=len(text))
    assert RunController.from_json(text, max_bytes=c.size).size == c.size


def test_a_padded_text_counts_its_padding() -> None:
    c = failed()
    padded = json.dumps(c.to_json(), indent=1)
    assert RunController.from_json(padded, max_bytes=len(padded)).size == c.size
    with pytest.raises(SchemaError, match="over max_bytes"):
        RunController.from_json(padded, max_bytes=len(padded) - 1)
    RunController.from_json(c.to_json(), max_bytes=len(padded) - 1)  # the dict is smaller


# ----------------------------------------------------------- commands and reserve


def _probe_max(c: RunController, limit: int, command: Any) -> int:
    """The largest padding ``command(controller, padding)`` accepts on a copy of ``c``."""
    low, high = 0, limit
    while low < high:
        middle = (low + high + 1) // 2
        probe = RunController.from_json(c.to_json(), max_bytes=limit)
        try:
            command(probe, middle)
        except SchemaError:
            high = middle - 1
        else:
            low = middle
    return low


def _stage_padded(c: RunController, padding: int) -> None:
    c.stage_publication([{"call_id": "c1", "output": "x" * padding}], [], call_ids=["c1"],
                        whole=True)


def _completed(limit: int, policy: RecoveryPolicy = RecoveryPolicy.RECONCILE
               ) -> RunController:
    c = RunController.start(run_id="r", session_id="s", policy=policy, max_bytes=limit)
    c.begin_model_call()
    c.model_responded([ToolCall("c1", "t", {})])
    c.begin_tool("c1")
    c.tool_completed("c1", "ok")
    return c


def _loads_under(c: RunController, limit: int) -> None:
    for key in (None, KEY):
        doc = c.to_json(key=key)
        assert measured(doc) <= limit
        again = RunController.from_json(compact(doc), max_bytes=limit, key=key)
        assert again.state == c.state


@pytest.mark.parametrize("limit", [2_400, 4_000, 50_000])
def test_a_run_at_its_byte_limit_can_still_fail_reconcile_commit_and_abandon(
    limit: int,
) -> None:
    c = _completed(limit)
    padding = _probe_max(c, limit, _stage_padded)
    _stage_padded(c, padding)  # the run is now exactly at the room for ordinary commands
    assert c.step is Step.UNSETTLED
    error = assert_refused(c, SchemaError, c.claim, "worker")
    assert "max_bytes" in str(error)
    c.publication_failed(type("E" * 128, (OSError,), {}))  # the longest name recorded
    decision = c.reconcile([], "s", take_over=True)
    assert isinstance(decision, Append)
    c.publication_committed()
    assert c.step is Step.RUN_AGAIN
    assert_refused(c, SchemaError, c.begin_model_call)
    assert_refused(c, SchemaError, c.hook_ran, "agent_start")
    _loads_under(c, limit)
    c.abandon("r" * RESERVED_TEXT, by="b" * RESERVED_TEXT)
    assert c.step is Step.TERMINAL_UNRECOVERABLE
    _loads_under(c, limit)


def test_settling_can_repeat_until_only_abandon_is_left() -> None:
    limit = 2_400
    c = _completed(limit)
    _stage_padded(c, _probe_max(c, limit, _stage_padded))
    cycles: list[int] = []

    def settle_again_and_again() -> None:
        while True:
            c.publication_failed(OSError)
            c.reconcile([], "s", take_over=True)
            cycles.append(1)

    with pytest.raises(SchemaError, match="max_bytes"):
        settle_again_and_again()
    assert cycles
    assert c.step is Step.UNSETTLED
    c.abandon("gave up")
    _loads_under(c, limit)


def test_a_fail_closed_run_at_its_limit_fails_into_terminal() -> None:
    limit = 2_200
    c = _completed(limit, RecoveryPolicy.FAIL_CLOSED)
    _stage_padded(c, _probe_max(c, limit, _stage_padded))
    c.publication_failed(TimeoutError)
    assert c.step is Step.TERMINAL_UNRECOVERABLE
    _loads_under(c, limit)


def test_a_payload_over_the_room_is_refused_before_recording() -> None:
    c = RunController.start(run_id="r", session_id="s", max_bytes=3_000)
    c.begin_model_call()
    error = assert_refused(c, SchemaError, c.model_responded, (), "é" * 1_500)
    assert "max_bytes=3000" in str(error)
    assert "é" not in str(error)
    c.model_responded((), "é" * 100)


def test_start_refuses_a_limit_with_no_room() -> None:
    for bad in (0, -1, "64", 1.5, True):
        with pytest.raises(SchemaError, match="max_bytes must be an int"):
            RunController.start(run_id="r", session_id="s", max_bytes=bad)  # type: ignore[arg-type]
    with pytest.raises(SchemaError, match="too small"):
        RunController.start(run_id="r", session_id="s", max_bytes=500)
    with pytest.raises(SchemaError, match="max_bytes must be an int"):
        RunController.from_json(failed().to_json(), max_bytes=0)


def test_a_started_tool_always_has_room_to_record_and_publish_its_result() -> None:
    c = RunController.start(run_id="r", session_id="s", max_events=10)
    c.begin_model_call()
    c.model_responded([ToolCall("c1", "t", {})])
    c.hook_ran("agent_start")  # 4 events; 6 left
    error = assert_refused(c, SchemaError, c.begin_tool, "c1")
    assert "max_events" in str(error)
    roomy = RunController.start(run_id="r", session_id="s", max_events=11)
    roomy.begin_model_call()
    roomy.model_responded([ToolCall("c1", "t", {})])
    roomy.hook_ran("agent_start")
    roomy.begin_tool("c1")  # 7 left: room to complete, stage, and settle or abandon
    roomy.tool_completed("c1", "done")
    roomy.stage_publication([{"call_id": "c1"}], [], call_ids=["c1"])
    roomy.publication_failed(OSError())
    roomy.reconcile([], "s")
    roomy.publication_committed()
    assert_refused(roomy, SchemaError, roomy.begin_model_call)
    roomy.abandon("limit")


@given(st.data(), st.integers(1_700, 5_000))
def test_every_log_written_under_a_small_max_bytes_loads_under_it(
    data: st.DataObject, limit: int,
) -> None:
    from tests.strategies import Driven

    d = Driven(RunController.start(run_id="small", session_id="s", max_bytes=limit))
    refused = "max_bytes"
    for _ in range(data.draw(st.integers(0, 60), label="steps")):
        before = d.c
        try:
            more = step(d, data)
        except SchemaError as error:
            refused = str(error)
            break
        if d.c is not before:  # the driver reloaded with the default limit: rebind
            d.c = RunController.from_json(compact(d.c.to_json()), max_bytes=limit)
        if not more:
            break
    c = d.c
    assert "max_bytes" in refused  # the only refusal a driven run meets is the limit
    assert c.size <= limit - sizes.CHAIN_BYTES
    _loads_under(c, limit)
    if c.step not in (Step.COMPLETED, Step.TERMINAL_UNRECOVERABLE):
        c.abandon("out of room")  # always fits: its room is reserved
        _loads_under(c, limit)


# ----------------------------------------------------------------------- stores


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_a_store_load_knows_the_size_and_refuses_a_log_over_max_bytes(
    kind: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from statemachine import controller as controller_module

    monkeypatch.setattr(controller_module, "SNAPSHOT_EVERY", 8)
    store = MemoryEventStore() if kind == "memory" else SQLiteEventStore(tmp_path / "s.db")
    c = RunController.start(run_id="r", session_id="s", store=store)
    for turn in range(12):
        c.begin_model_call()
        c.model_failed(TimeoutError)
        c.claim(f"worker {turn} {WEIRD}")
    for snapshot in (True, False):
        loaded = RunController.load(store, "r", snapshot=snapshot)
        assert loaded.size == c.size == measured(loaded.to_json())
        with pytest.raises(SchemaError, match="over max_bytes"):
            RunController.load(store, "r", max_bytes=c.size - 1, snapshot=snapshot)
        assert RunController.load(store, "r", max_bytes=c.size, snapshot=snapshot).size == (
            c.size)
    loaded = RunController.load(store, "r")
    loaded.begin_model_call()
    assert loaded.size == measured(loaded.to_json())


class _Trimming:
    """A wrapper store whose ``load`` drops the last event of what its store read."""

    def __init__(self, inner: SQLiteEventStore) -> None:
        self.inner = inner

    def append(self, run_id: str, events: Any, expected_version: int, *,
               snapshot: dict[str, Any] | None = None) -> None:
        self.inner.append(run_id, events, expected_version, snapshot=snapshot)

    def load(self, run_id: str) -> list[Any]:
        events = self.inner.load(run_id)
        events.sort(key=lambda event: event.seq, reverse=True)  # keyword arguments too
        events.sort(key=lambda event: event.seq)
        events.pop()
        return events


class _TrimmingLoad(SQLiteEventStore):
    def load(self, run_id: str) -> list[Any]:
        return super().load(run_id)[:-1]


class _TrimmingLatest(SQLiteEventStore):
    def load_latest(self, run_id: str) -> Any:
        snapshot, tail = super().load_latest(run_id)
        return snapshot, tail[:-1]


@pytest.mark.parametrize("how", ["a wrapper's load", "a subclass's load",
                                 "a subclass's load_latest"])
def test_a_store_that_changes_the_events_it_read_is_sized_by_the_events(
    tmp_path: Any, how: str,
) -> None:
    """A store's decoded rows come with their size (`stores.load_measured`); a store that
    changes them before handing them on (here: drops the last event), a wrapper around
    such a store or a subclass overriding ``load`` or ``load_latest``, must not pass the
    size of what it read on: the controller counts the events it got."""
    from statemachine import stores

    kind = {"a subclass's load": _TrimmingLoad,
            "a subclass's load_latest": _TrimmingLatest}.get(how, SQLiteEventStore)
    inner = kind(tmp_path / "s.db")
    c = RunController.start(run_id="r", session_id="s", store=inner)
    c.begin_model_call()
    c.model_failed(TimeoutError)
    c.hook_ran("agent_start")
    whole = SQLiteEventStore(tmp_path / "s.db")
    assert stores.load_measured(whole, "r").size is not None  # the rows were measured
    assert stores.load_latest_measured(whole, "r")[1].size is not None
    store: Any = _Trimming(inner) if how == "a wrapper's load" else inner
    loaded = RunController.load(store, "r", snapshot=how != "a subclass's load")
    assert len(loaded.events) == 3
    assert loaded.size == measured(loaded.to_json()) < c.size


def test_a_snapshot_without_a_recorded_size_costs_one_read_of_the_log(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from statemachine import controller as controller_module

    monkeypatch.setattr(controller_module, "SNAPSHOT_EVERY", 4)
    store = MemoryEventStore()
    c = RunController.start(run_id="r", session_id="s", store=store)
    for _ in range(5):
        c.begin_model_call()
        c.model_failed(TimeoutError)
    stored, _ = store.load_latest("r")
    assert stored is not None
    assert stored.pop(controller_module.SNAPSHOT_SIZE) > 0  # an older library's snapshot
    assert RunController.load(store, "r").size == c.size


def test_max_events_counts_the_events_before_a_snapshot() -> None:
    # CT23: max_events bounds the whole log, however it is loaded
    store = MemoryEventStore()
    c = RunController.start(run_id="long", session_id=None, store=store)
    for i in range(299):
        c.add_input([i])
    assert c.version == 300
    snapshot, tail = store.load_latest("long")
    assert snapshot is not None  # the load below starts from it
    assert len(tail) < 280
    for use_snapshot in (True, False):
        with pytest.raises(SchemaError):
            RunController.load(store, "long", max_events=280, snapshot=use_snapshot)
        assert RunController.load(store, "long", max_events=300,
                                  snapshot=use_snapshot).version == 300


# ------------------------------------------------------------- message bounds


def _doc() -> dict[str, Any]:
    return failed().to_json()


LONG = "k" * 10_000


def _top_key(doc: dict[str, Any]) -> None:
    doc[LONG] = 1


def _event_field(doc: dict[str, Any]) -> None:
    doc["events"][1][LONG] = 1


def _call_field(doc: dict[str, Any]) -> None:
    doc["events"][4]["tool_calls"][0][LONG] = 1


def _event_type(doc: dict[str, Any]) -> None:
    doc["events"][1]["type"] = LONG


def _canonical(doc: dict[str, Any]) -> None:
    doc["events"][0]["canonical"] = LONG


def _canonical_within_text_limit(doc: dict[str, Any]) -> None:
    doc["events"][0]["canonical"] = "c" * MAX_TEXT


def _many_keys(doc: dict[str, Any]) -> None:
    doc.update({f"extra-{i}-{'x' * 50}": i for i in range(2_000)})


def _non_str_keys(doc: dict[Any, Any]) -> None:
    doc.update({1: 2, (3, 4): 5, None: 6})


def _huge_version(doc: dict[str, Any]) -> None:
    doc["schema_version"] = 10**5000


def _long_type_name(doc: dict[str, Any]) -> None:
    doc["events"][4]["tool_calls"][0]["arguments"] = type(LONG, (), {})()


def _long_run_id(doc: dict[str, Any]) -> None:
    doc["run_id"] = doc["events"][0]["run_id"] = "r" * MAX_TEXT
    doc["events"][2]["type"] = "RunCompleted"  # an illegal step: InvalidTransition


@pytest.mark.parametrize("mutate", [
    _top_key, _event_field, _call_field, _event_type, _canonical,
    _canonical_within_text_limit, _many_keys, _non_str_keys, _huge_version,
    _long_type_name, _long_run_id,
], ids=lambda f: f.__name__.strip("_"))
def test_messages_quote_at_most_a_short_excerpt_of_the_document(mutate: Any) -> None:
    doc = _doc()
    mutate(doc)
    with pytest.raises((SchemaError, InvalidTransition)) as info:
        RunController.from_json(doc)
    message = str(info.value)
    assert len(message) < 300, message
    assert "k" * 100 not in message
    try:
        text = json.dumps(doc)
    except (TypeError, ValueError):
        return  # only a dict can hold it
    with pytest.raises((SchemaError, InvalidTransition)) as info:
        RunController.from_json(text)
    assert len(str(info.value)) < 300


def test_excerpts_are_escaped_and_cut() -> None:
    from statemachine.errors import excerpt

    assert excerpt("abc") == "'abc'"
    assert excerpt("a" * 100) == repr("a" * 64) + "…"
    escaped = excerpt("\x00" * 100)
    assert len(escaped) <= 67
    assert "\x00" not in escaped
    assert excerpt(7) == "<int>"  # type: ignore[arg-type]
    with pytest.raises(SchemaError) as info:
        pl.canonical_form("c" * 10_000)
    assert len(str(info.value)) < 120


def test_command_messages_quote_ids_by_excerpt() -> None:
    c = RunController.start(run_id="r" * MAX_TEXT, session_id="s")
    c.begin_model_call()
    c.model_responded([ToolCall("c" * MAX_TEXT, "t", {})])
    error = assert_refused(c, InvalidTransition, c.tool_completed, "c" * MAX_TEXT, "ok")
    assert len(str(error)) < 300
    assert "c" * 100 not in str(error)
    assert "r" * 100 not in str(error)
