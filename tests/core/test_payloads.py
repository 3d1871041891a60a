"""Payloads are plain JSON, detached on the way in, bounded in depth."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from statemachine import (
    Execute,
    InvalidTransition,
    MemoryEventStore,
    RunController,
    SchemaError,
    SQLiteEventStore,
    ToolCall,
    register_canonical,
)
from statemachine.payloads import PayloadError, canonical_json, detach, fingerprint_of
from tests.helpers import assert_refused


@pytest.mark.parametrize("bad", [
    (1, 2), {1, 2}, float("nan"), float("inf"), {1: "x"}, {"k": (1,)}, [object()],
    b"bytes", [[{"k": float("-inf")}]],
], ids=["tuple", "set", "nan", "inf", "int-key", "nested-tuple", "object", "bytes",
        "nested-inf"])
def test_not_plain_json_is_refused(bad: Any) -> None:
    with pytest.raises(PayloadError):
        detach(bad)


def test_detach_copies_deeply() -> None:
    value = {"a": [1, {"b": [2.5, None, True, "s"]}]}
    copy = detach(value)
    assert copy == value
    value["a"][1]["b"].append("later")  # type: ignore[index]
    assert copy == {"a": [1, {"b": [2.5, None, True, "s"]}]}


def test_depth_limit_is_iterative_and_exact() -> None:
    deep: Any = "leaf"
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(PayloadError, match="deeper than 200"):
        detach(deep)
    ok: Any = "leaf"
    for _ in range(200):
        ok = [ok]
    assert detach(ok) == ok
    with pytest.raises(PayloadError):
        detach([ok])


def test_commands_detach_and_refuse_before_recording() -> None:
    c = RunController.start(run_id="p", session_id=None, max_depth=3)
    c.begin_model_call()
    args = {"nested": {"list": [1]}}
    c.model_responded([ToolCall("a", "t", args)])
    args["nested"]["list"].append(2)
    assert c.state.calls["a"].call.arguments == {"nested": {"list": [1]}}
    error = assert_refused(c, SchemaError, c.tool_completed, "a", {"x": {"y": {"z": {}}}})
    assert "deeper than 3" in str(error)
    assert_refused(c, SchemaError, c.hook_ran, 7)


def test_fingerprint_is_sha256_of_the_builtin_canonical_json() -> None:
    import hashlib

    expected = hashlib.sha256(b'["pay",{"a":1,"b":[true,null]}]').hexdigest()
    assert fingerprint_of("pay", {"b": [True, None], "a": 1}) == expected


def test_messages_never_echo_payload_contents() -> None:
    c = RunController.start(run_id="p", session_id=None)
    c.begin_model_call()
    secret = "card-4111-1111"
    with pytest.raises(SchemaError) as info:
        c.model_responded([ToolCall("a", "t", {secret: float("nan")})])
    assert secret not in str(info.value)


def test_canonical_forms_are_registered_once_by_name() -> None:
    def lower(item: Any) -> bytes:
        return canonical_json(item).lower()

    register_canonical("lowercase-test", lower)
    register_canonical("lowercase-test", lower)
    with pytest.raises(SchemaError):
        register_canonical("lowercase-test", canonical_json)
    c = RunController.start(run_id="c", session_id="s", canonical="lowercase-test")
    assert RunController.from_json(c.to_json()).state == c.state
    with pytest.raises(SchemaError, match="unknown canonical form"):
        RunController.start(run_id="c", session_id="s", canonical="never-registered")


def _deep(levels: int) -> dict[str, Any]:
    root: dict[str, Any] = {}
    node = root
    for _ in range(levels):
        node["k"] = {}
        node = node["k"]
    return root


def test_payloads_deeper_than_the_default_work_under_a_raised_limit(tmp_path: Path) -> None:
    deep = _deep(250)
    for store in (None, SQLiteEventStore(tmp_path / "events.db"), MemoryEventStore()):
        c = RunController.start(run_id="deep", session_id=None, max_depth=500, store=store)
        c.begin_model_call()
        c.model_responded([ToolCall("c1", "t", deep)])
        decision = c.begin_tool("c1")
        assert isinstance(decision, Execute)
        assert decision.call.arguments == deep
        c.tool_completed("c1", deep)
        assert c.begin_tool("c1").result == deep  # type: ignore[union-attr]
        if store is not None:
            assert RunController.load(store, "deep", max_depth=500).state == c.state
        assert RunController.from_json(c.to_json(), max_depth=500).state == c.state


def test_history_that_is_not_plain_json_is_a_schema_error() -> None:
    c = RunController.start(run_id="r", session_id="s")
    c.begin_model_call()
    c.model_responded([], output="o")
    c.accept_final_output("o")
    deep: Any = []
    for _ in range(100_000):
        deep = [deep]
    assert_refused(c, SchemaError, c.stage_publication, [{"a": 1}], [deep, {"x": 1}],
                   whole=True)
    assert_refused(c, InvalidTransition, c.stage_publication, [], [])
