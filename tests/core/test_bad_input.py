"""Bad input never records an event that breaks the run (DESIGN §6.6): lone surrogates and
over-long text in every text field, ints past Python's 4,300-digit printing limit, and
documents that only one of ``from_json(dict)`` and ``from_json(text)`` would accept. All
are `SchemaError` before anything is recorded."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from statemachine import ControlError, RunController, SchemaError, ToolCall
from statemachine.payloads import MAX_TEXT
from tests.helpers import assert_refused

SURROGATE = "bad\ud800name"
HUGE = 10**5000
LONG = "x" * (MAX_TEXT + 1)
NUL = "bad\x00name"  # ASCII, so it must not slip through an ASCII fast path
PAYLOADS = ("argument value", "output", "reject message", "input item")


def _interruption() -> RunController:
    c = RunController.start(run_id="r", session_id="s")
    c.begin_model_call()
    c.model_responded([ToolCall("c1", "charge", {"amount": 7}, needs_approval=True)])
    return c


BAD_COMMANDS: dict[str, Callable[[RunController, Any], Any]] = {
    "tool name": lambda c, bad: c.model_responded([ToolCall("c2", bad, {})]),
    "call id": lambda c, bad: c.model_responded([ToolCall(bad, "charge", {})]),
    "argument value": lambda c, bad: c.model_responded([ToolCall("c2", "t", {"a": [bad]})]),
    "output": lambda c, bad: c.model_responded(output={"text": bad}),
    "approve id": lambda c, bad: c.approve(bad),
    "reject message": lambda c, bad: c.reject("c1", {"why": bad}),
    "handoff target": lambda c, bad: c.handoff(bad),
    "abandon reason": lambda c, bad: c.abandon(bad),
    "input item": lambda c, bad: c.add_input([{"content": bad}]),
    "hook name": lambda c, bad: c.hook_ran(bad),
    "guardrail name": lambda c, bad: c.guardrail_evaluated(bad, True, stage="input"),
    "guardrail stage": lambda c, bad: c.guardrail_evaluated("g", True, stage=bad),
}


def _needs_model_call(name: str) -> bool:
    return name in ("tool name", "call id", "argument value", "output")


# (a payload's string may hold a NUL: tests/storage/test_nul.py, so no such case here)
@pytest.mark.parametrize(("command", "bad"), [
    pytest.param(command, bad, id=f"{command}-{name}")
    for command in BAD_COMMANDS
    for bad, name in ((SURROGATE, "surrogate"), (HUGE, "huge-int"), (LONG, "long"),
                      (NUL, "nul"))
    if not (bad is NUL and command in PAYLOADS)])
def test_bad_text_or_int_is_refused_before_recording(command: str, bad: Any) -> None:
    if bad is HUGE and command in ("approve id", "handoff target", "abandon reason",
                                   "hook name", "guardrail name", "guardrail stage",
                                   "tool name", "call id"):
        pytest.skip("a text field: an int there is a plain type error, tested elsewhere")
    if bad is LONG and command in PAYLOADS:
        pytest.skip("payload strings are bounded by max_bytes, not by MAX_TEXT")
    c = _interruption()
    if _needs_model_call(command):
        c.approve("c1")
        c.resume()
        c.begin_tool("c1")
        c.tool_completed("c1", "ok")
        c.stage_publication([{"o": 1}], [], call_ids=["c1"], whole=True)
        c.publication_committed()
        c.begin_model_call()
    error = assert_refused(c, SchemaError, BAD_COMMANDS[command], c, bad)
    assert "\ud800" not in str(error)
    assert "\x00" not in str(error)
    assert "xxxxxxxxxx" not in str(error)
    # the run is not stuck: it still round-trips and takes good commands
    again = RunController.from_json(json.dumps(c.to_json()))
    assert again.to_json() == c.to_json()
    c.abandon("done")


@pytest.mark.parametrize("bad", [SURROGATE, NUL], ids=["surrogate", "nul"])
@pytest.mark.parametrize("field", ["run_id", "session_id", "canonical"])
def test_start_refuses_bad_text(field: str, bad: str) -> None:
    options: dict[str, Any] = {"run_id": "r", "session_id": "s", field: bad}
    with pytest.raises(SchemaError):
        RunController.start(**options)


def test_a_nul_owner_is_refused_before_recording() -> None:
    c = RunController.start(run_id="r", session_id="s")
    assert_refused(c, SchemaError, c.claim, NUL)


def test_queries_refuse_wrong_types_with_a_typed_error() -> None:
    c = _interruption()
    for query in (lambda: c.hook_done(7),  # type: ignore[arg-type]
                  lambda: c.hook_done("tool_start", call_id=[1]),  # type: ignore[arg-type]
                  lambda: c.recorded_guardrail(None, stage="input"),  # type: ignore[arg-type]
                  lambda: c.recorded_guardrail("g", stage=3),  # type: ignore[arg-type]
                  lambda: c.fingerprint({"x": 1}),  # type: ignore[arg-type]
                  lambda: c.call(3)):  # type: ignore[arg-type]
        with pytest.raises(ControlError):
            query()


def _doc_with(path: list[Any], value: Any) -> dict[str, Any]:
    c = _interruption()
    doc = c.to_json()
    target: Any = doc
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return doc


@pytest.mark.parametrize(("where", "value"), [
    (["events", 2, "tool_calls", 0, "name"], SURROGATE),
    (["events", 2, "tool_calls", 0, "call_id"], SURROGATE),
    (["events", 2, "tool_calls", 0, "arguments", "amount"], HUGE),
    (["events", 0, "run_id"], SURROGATE),
    (["run_id"], SURROGATE),
    (["events", 2, "tool_calls", 0, "arguments", "amount"], (7,)),
    (["events", 2, "tool_calls", 0, "arguments"], {1: "non-str key"}),
    (["events", 2, "tool_calls", 0, "name"], LONG),
    (["events", 2, "tool_calls", 0, "name"], NUL),
    (["events", 0, "session_id"], NUL),
    (["run_id"], NUL),
], ids=["surrogate-name", "surrogate-id", "huge-int", "surrogate-started", "surrogate-run",
        "tuple", "int-key", "long-name", "nul-name", "nul-session", "nul-run"])
def test_from_json_dict_and_text_agree(where: list[Any], value: Any) -> None:
    doc = _doc_with(where, value)
    with pytest.raises(SchemaError):
        RunController.from_json(doc)
    try:
        text = json.dumps(doc)
    except (TypeError, ValueError):
        return  # not expressible as text: the dict form alone is refused
    if json.loads(text) != doc:
        RunController.from_json(text)  # the text is another, legal document (7,) -> [7]
        return
    with pytest.raises(SchemaError):
        RunController.from_json(text)


def test_errors_name_the_right_thing() -> None:
    import pickle

    from statemachine import (
        ConcurrencyConflict,
        MemoryEventStore,
        RunNotFound,
        Step,
        ToolInDoubt,
    )

    store = MemoryEventStore()
    with pytest.raises(RunNotFound):
        RunController.load(store, "nobody")
    RunController.start(run_id="r", session_id="s", store=store)
    with pytest.raises(ConcurrencyConflict, match="already exists"):
        RunController.start(run_id="r", session_id="s", store=store)
    error = ToolInDoubt("in doubt", call_id="c1", run_id="r", step=Step.TOOLS,
                        action="resume")
    again = pickle.loads(pickle.dumps(error))
    assert (type(again), again.call_id, again.run_id, again.step, again.action, str(again)) \
        == (ToolInDoubt, "c1", "r", Step.TOOLS, "resume", str(error))


def test_refusals_name_the_steps_that_allow_a_trigger_and_read_as_one_line() -> None:
    from statemachine import InvalidTransition
    from statemachine.machine import GUARDS, requirement

    c = RunController.start(run_id="r", session_id="s", max_turns=0)
    with pytest.raises(InvalidTransition, match="begin_tool is allowed only in TOOLS"):
        c.begin_tool("c1")
    with pytest.raises(InvalidTransition, match="approve is allowed only in INTERRUPTION"):
        c.approve("c1")
    with pytest.raises(InvalidTransition) as info:
        c.begin_model_call()
    assert "guard turns_left failed (it requires: a turn is left under max_turns" in str(
        info.value)
    for name in GUARDS:
        rule = requirement(name)
        assert "\n" not in rule
        assert "  " not in rule
        # one voice: what must hold, never what went wrong
        assert not rule.startswith(("no turns", "a tool result is", "the decision's "
                                    "fingerprint does not", "this guardrail already",
                                    "a call is started", "the run has a Session"))


def test_an_absurd_error_type_name_still_records_a_log_that_loads() -> None:
    c = RunController.start(run_id="r", session_id="s")
    c.begin_model_call()
    huge = type("E" * 5000, (Exception,), {})
    c.model_failed(huge())
    assert RunController.from_json(json.dumps(c.to_json())).to_json() == c.to_json()


def test_a_lone_surrogate_is_refused_before_anything_is_recorded() -> None:
    c = RunController.start(run_id="r", session_id="s")
    c.begin_model_call()
    for bad in ({"a": "\ud800"}, {"\udfff": 1}, ["ok", {"deep": ["\ud800"]}]):
        assert_refused(c, SchemaError, c.model_responded,
                       [ToolCall("c1", "t", bad, needs_approval=True)])
    c.model_responded([ToolCall("c1", "t", {"a": "caf\u00e9 \U0001f600"}, needs_approval=True)])
    c.approve("c1")
