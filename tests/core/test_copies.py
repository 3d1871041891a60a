"""Everything the library hands out is a copy (DESIGN §6.2): mutating what was handed out
never changes the log, never changes what a tool runs with, and never breaks a reload."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from statemachine import Append, RecoveryPolicy, RunController, ToolCall
from statemachine.runner import Agent, FunctionTool, ModelResponse, Runner
from statemachine.sessions import MemorySession
from statemachine.testing import ScriptedModel

ARGS = {"amount": 7, "meta": {"currency": "eur", "tags": ["a"]}}


def _unsettled_run() -> RunController:
    c = RunController.start(run_id="r", session_id="s")
    c.begin_model_call()
    c.model_responded([ToolCall("c1", "charge", ARGS, needs_approval=True),
                       ToolCall("c2", "charge", ARGS, needs_approval=True)])
    c.approve("c1")
    c.resume()
    c.begin_tool("c1")
    c.tool_completed("c1", {"charged": [7]})
    c.guardrail_evaluated("g", {"verdict": {"ok": True}}, stage="output")
    c.stage_publication([{"call_id": "c1", "output": {"charged": [7]}}], [], call_ids=["c1"],
                        whole=True)
    return c


def _scribble(value: Any) -> None:
    """Change every dict and list inside ``value`` in place."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
            item["scribbled"] = True
        elif isinstance(item, list):
            stack.extend(item)
            item.append("scribbled")


def test_mutating_everything_handed_out_changes_nothing() -> None:
    c = _unsettled_run()
    doc = json.dumps(c.to_json())
    envelope = c.envelope
    assert envelope is not None
    handed: list[Any] = [
        *(view.call.arguments for view in c.calls), *(view.result for view in c.calls),
        *envelope.items, *(g.result for g in c.pending_guardrail_results),
        c.call("c1").result, c.model_output, c.final_output,
    ]
    for event in c.events:
        for name in ("tool_calls", "items", "output", "result", "message"):
            value = getattr(event, name, None)
            if isinstance(value, tuple):
                handed.extend(getattr(v, "arguments", v) for v in value)
            elif value is not None:
                handed.append(getattr(value, "result", value))
    recorded = c.recorded_guardrail("g", stage="output")
    assert recorded is not None
    handed.append(recorded.result)
    for value in handed:
        _scribble(value)
    assert json.dumps(c.to_json()) == doc
    assert RunController.from_json(doc).to_json() == c.to_json()


def test_reconcile_hands_out_a_copy_of_the_batch() -> None:
    c = _unsettled_run()
    c.publication_failed(RuntimeError("lost"))
    doc = json.dumps(c.to_json())
    decision = c.reconcile([], "s")
    assert isinstance(decision, Append)
    _scribble(list(decision.items))
    c.publication_committed()
    loaded = RunController.from_json(json.dumps(c.to_json()))
    assert json.dumps(loaded.to_json()).startswith(doc[: doc.index('"events"')])
    assert list(loaded.to_json()["events"])[: len(json.loads(doc)["events"])] == (
        json.loads(doc)["events"])


def test_an_edited_interruption_never_reaches_the_tool() -> None:
    """Editing ``RunResult.interruptions[0].arguments`` and approving with the
    fingerprint of the original arguments runs the tool with the original ones."""
    ran: list[int] = []

    def charge(amount: int) -> str:
        ran.append(amount)
        return f"charged {amount}"

    model = ScriptedModel([ModelResponse(tool_calls=(("c1", "charge", {"amount": 7}),)),
                           ModelResponse(output="done")])
    agent = Agent("billing", model, tools=(FunctionTool("charge", charge,
                                                        needs_approval=True),))
    session = MemorySession("s")

    async def scenario() -> None:
        paused = await Runner.run(agent, "charge me 7", session=session)
        (call,) = paused.interruptions
        call.arguments["amount"] = 700
        c = paused.controller
        original = RunController.start(run_id="x", session_id=None)
        original.begin_model_call()
        original.model_responded([ToolCall("c1", "charge", {"amount": 7})])
        c.approve("c1", fingerprint=original.fingerprint("c1"))
        saved = json.dumps(c.to_json())
        result = await Runner.run(agent, session=session, state=saved)
        assert result.final_output == "done"

    asyncio.run(scenario())
    assert ran == [7]


def test_a_fail_closed_run_round_trips_after_scribbling() -> None:
    c = RunController.start(run_id="r", session_id="s", policy=RecoveryPolicy.FAIL_CLOSED)
    c.begin_model_call()
    c.model_responded(output={"answer": [1, 2]})
    c.accept_final_output({"answer": [1, 2]})
    _scribble(c.final_output)
    _scribble(c.model_output)
    assert RunController.from_json(c.to_json()).final_output == {"answer": [1, 2]}


def test_a_resumed_attempt_never_rereads_the_log(tmp_path: Any) -> None:
    """A runner step costs O(1) in log length: an attempt on a run loaded from a snapshot
    reads only the snapshot and its tail, never the whole log (it once re-read and decoded
    the whole log twice per loop step)."""
    from statemachine.stores import SQLiteEventStore

    class CountingStore(SQLiteEventStore):
        whole_loads = 0

        def load(self, run_id: str) -> Any:
            CountingStore.whole_loads += 1
            return super().load(run_id)

    store = CountingStore(tmp_path / "events.db")
    c = RunController.start(run_id="long", session_id="s", store=store)
    for _ in range(300):  # past the snapshot interval
        c.begin_model_call()
        c.model_failed(TimeoutError())
    CountingStore.whole_loads = 0
    agent = Agent("a", ScriptedModel([ModelResponse(output="done")]), max_turns=None)
    result = asyncio.run(Runner.run(agent, "more", session=MemorySession("s"), store=store,
                                    run_id="long"))
    assert result.final_output == "done"
    assert result.controller.version > 600
    assert CountingStore.whole_loads == 0


def test_the_model_output_handed_out_is_a_copy() -> None:
    # CT18: what the controller hands out is the caller's; changing it changes nothing
    c = RunController.start(run_id="copy", session_id=None)
    c.begin_model_call()
    c.model_responded(output={"answer": [1, 2]})
    handed = c.model_output
    assert isinstance(handed, dict)
    handed["answer"].append(3)
    handed["extra"] = True
    assert c.model_output == {"answer": [1, 2]}
    c.accept_final_output(c.model_output)
    assert RunController.from_json(c.to_json()).final_output == {"answer": [1, 2]}
