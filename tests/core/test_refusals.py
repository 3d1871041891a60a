"""A random walk over every public command and query of `RunController` with garbage and
plausible arguments mixed (DESIGN §6.6): the only exceptions allowed are `ControlError`s,
and a refusal changes nothing (events, step, envelope, approvals, guardrail results, the
whole state, the attempt, the calls in flight). Every state the walk reaches still
round-trips through JSON."""

from __future__ import annotations

import json
import math
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from statemachine import ControlError, RecoveryPolicy, RunController, ToolCall
from tests.helpers import snapshot


class Weird:
    """Not plain JSON, not a str, not anything the core expects."""


GARBAGE: list[Any] = [
    None, 0, -1, 1, True, 2.5, math.nan, math.inf, 10**5000, "", "c1", "c2", "x" * 5000,
    "bad\ud800", b"bytes", [], {}, ["c1"], {"a": 1}, {1: "int key"}, (1, 2), {"a": (1,)},
    {"s": {1, 2}}, Weird(), Weird, ValueError("e"), ValueError, ToolCall("c1", "t", {}),
    [ToolCall("c1", "t", {"a": 1}, needs_approval=True)], [ToolCall("c2", "t", {})],
    [ToolCall("c3", "t", {}, idempotent=True)], [ToolCall("c1", 7, {})],  # type: ignore[arg-type]
    [ToolCall("c4", "t", {"n": [1, [2, [3]]]}, needs_approval=1)],  # type: ignore[arg-type]
    [{"role": "user"}], [{"call_id": "c1", "output": "ok"}],
]
DEEP: Any = []
for _ in range(300):
    DEEP = [DEEP]
GARBAGE.append(DEEP)

COMMANDS: dict[str, int] = {  # name -> positional arity
    "begin_model_call": 0, "model_failed": 1, "model_responded": 2, "approve": 1,
    "reject": 2, "resume": 0, "claim": 1, "begin_tool": 1, "tool_completed": 2,
    "tool_interrupted": 1, "resolve_in_doubt": 2, "hook_ran": 1, "accept_final_output": 1,
    "complete": 0, "add_input": 1, "handoff": 1, "abandon": 1, "receive_tool_calls": 1,
    "result_posted": 1, "result_post_failed": 2, "stage_publication": 2,
    "publication_committed": 0, "publication_failed": 1, "reconcile": 2,
}
KEYWORDS: dict[str, list[str]] = {
    "approve": ["fingerprint"], "reject": ["fingerprint"], "accept_final_output": ["lossless"],
    "stage_publication": ["call_ids", "whole"], "reconcile": ["take_over"],
    "hook_ran": ["call_id"],
}
QUERIES: dict[str, int] = {
    "fingerprint": 1, "call": 1, "phase": 1, "hook_done": 1, "in_doubt": 0,
    "next_action": 0, "unpublished_call_ids": 0, "runnable_call_ids": 0, "to_json": 0,
}


def _guardrail(c: RunController, name: Any, result: Any, stage: Any, call_id: Any) -> None:
    c.guardrail_evaluated(name, result, stage=stage, call_id=call_id)


def _recorded(c: RunController, name: Any, stage: Any, call_id: Any) -> Any:
    return c.recorded_guardrail(name, stage=stage, call_id=call_id)


arguments = st.sampled_from(GARBAGE)


@given(st.data(), st.sampled_from([None, "s"]), st.sampled_from(list(RecoveryPolicy)),
       st.sampled_from([None, 1, 3]))
def test_garbage_walk_raises_only_control_errors_and_refusals_change_nothing(
    data: st.DataObject, session_id: str | None, policy: RecoveryPolicy,
    max_turns: int | None,
) -> None:
    c = RunController.start(run_id="walk", session_id=session_id, policy=policy,
                            max_turns=max_turns, max_events=80)
    for _ in range(data.draw(st.integers(10, 60), label="steps")):
        kind = data.draw(st.sampled_from(["command", "query", "guardrail"]), label="kind")
        if kind == "command":
            name = data.draw(st.sampled_from(sorted(COMMANDS)), label="command")
            args = [data.draw(arguments) for _ in range(COMMANDS[name])]
            kwargs = {key: data.draw(arguments) for key in KEYWORDS.get(name, [])
                      if data.draw(st.booleans())}
            call = getattr(c, name)
        elif kind == "query":
            name = data.draw(st.sampled_from(sorted(QUERIES)), label="query")
            args = [data.draw(arguments) for _ in range(QUERIES[name])]
            kwargs = {}
            call = getattr(c, name)
        else:
            name = data.draw(st.sampled_from(["guardrail_evaluated", "recorded_guardrail"]))
            args = [c, data.draw(arguments), data.draw(arguments), data.draw(arguments)]
            if name == "guardrail_evaluated":
                args.append(data.draw(arguments))
            kwargs = {}
            call = _guardrail if name == "guardrail_evaluated" else _recorded
        before = snapshot(c)
        try:
            call(*args, **kwargs)
        except ControlError:
            assert snapshot(c) == before, name
        # any other exception fails the test: it escaped a public call untyped
    text = json.dumps(c.to_json())
    assert RunController.from_json(text).to_json() == c.to_json()
