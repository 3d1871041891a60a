"""Regression tests for holes a review found: each refused input leaves nothing recorded,
nothing the run recorded under its own limits fails to load, and a log cannot drop a
nested field (an approval gate) silently."""

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
)
from tests.helpers import assert_refused


def _deep(levels: int) -> dict[str, Any]:
    root: dict[str, Any] = {}
    node = root
    for _ in range(levels):
        node["k"] = {}
        node = node["k"]
    return root


def test_a_lone_surrogate_is_refused_before_anything_is_recorded() -> None:
    c = RunController.start(run_id="r", session_id="s")
    c.begin_model_call()
    for bad in ({"a": "\ud800"}, {"\udfff": 1}, ["ok", {"deep": ["\ud800"]}]):
        assert_refused(c, SchemaError, c.model_responded,
                       [ToolCall("c1", "t", bad, needs_approval=True)])
    c.model_responded([ToolCall("c1", "t", {"a": "caf\u00e9 \U0001f600"}, needs_approval=True)])
    c.approve("c1")


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
