"""Settling doubt without a person (DESIGN §7.3): idempotency keys, `tool_context()`, and
verifiers, through the reference runner.

The kill -9 rows run tests/drivers/payment_driver.py: a charge given its call's
idempotency key, killed at every boundary around it, then resumed. With a verifier every
run completes with exactly one charge and no operator; without one a call whose start
was durable and whose result was not is in doubt (`ToolInDoubt`), as before."""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from statemachine import (
    Completed,
    NotExecuted,
    Phase,
    Resolution,
    RunController,
    SQLiteEventStore,
    ToolCall,
    ToolContext,
    ToolInDoubt,
    Unknown,
    tool_context,
)
from statemachine.runner import Agent, FunctionTool, ModelResponse, Runner
from statemachine.verifiers import verify_in_doubt, verify_in_doubt_async
from tests.drivers.payment_driver import RUN_ID, PaymentService

ROOT = Path(__file__).resolve().parents[2]


def _driver(folder: Path, boundary: str, verify: bool) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tests.drivers.payment_driver", str(folder),
                           boundary, "1" if verify else "0"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=False)


BOUNDARIES = ["before-charge", "after-charge", "after-return", "after-record"]
CHARGED_BEFORE_THE_KILL = {"before-charge": 0, "after-charge": 1, "after-return": 1,
                           "after-record": 1}
"""What the service holds when the process dies there (an independent statement)."""


@pytest.mark.invariant("I11")
@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("boundary", BOUNDARIES)
def test_a_kill_around_the_charge_ends_with_one_charge_or_in_doubt(
        tmp_path: Path, boundary: str, verify: bool) -> None:
    killed = _driver(tmp_path, boundary, verify)
    assert killed.returncode == -9, killed.stderr
    service = PaymentService(tmp_path / "payments.jsonl")
    assert len(service.charges()) == CHARGED_BEFORE_THE_KILL[boundary]
    resumed = _driver(tmp_path, "none", verify)
    assert resumed.returncode == 0, resumed.stderr
    said = json.loads(resumed.stdout)
    recorded = boundary == "after-record"  # the result was durable: it is re-sent
    if verify or recorded:
        assert said == {"step": "completed", "output": "done: charged 7"}
        assert len(service.charges()) == 1  # exactly one charge, no operator
    else:
        assert said == {"error": ToolInDoubt.__name__}
        assert len(service.charges()) == CHARGED_BEFORE_THE_KILL[boundary]
    run = RunController.load(SQLiteEventStore(tmp_path / "events.db"), RUN_ID)
    decisions = [(d.kind, d.by, d.outcome) for d in run.call("c1").decisions]
    if verify and not recorded:
        expected = (Resolution.NOT_EXECUTED if CHARGED_BEFORE_THE_KILL[boundary] == 0
                    else Resolution.COMPLETED)
        assert decisions == [("resolved", "verify:charge", expected)]
        assert run.call("c1").starts == (2 if expected is Resolution.NOT_EXECUTED else 1)
    else:
        assert decisions == []
    keys = {c["key"] for c in service.charges()}
    assert keys <= {hashlib.sha256(f"{RUN_ID}\0c1".encode()).hexdigest()[:32]}


def test_the_idempotency_key_is_the_same_everywhere_and_known_calls_only() -> None:
    c = RunController.start(run_id="r-é", session_id=None)
    c.begin_model_call()
    c.model_responded([ToolCall("c/1", "pay", {})])
    key = c.idempotency_key("c/1")
    assert key == hashlib.sha256("r-é\0c/1".encode()).hexdigest()[:32]
    assert RunController.from_json(c.to_json()).idempotency_key("c/1") == key
    from statemachine import InvalidTransition

    with pytest.raises(InvalidTransition):
        c.idempotency_key("ghost")


class _Once:
    """A model that asks for one call of ``tool``, then answers with its output."""

    def __init__(self, tool: str) -> None:
        self.tool = tool

    async def respond(self, history: list[Any], agent: Agent) -> ModelResponse:
        outputs = [i["output"] for i in history if isinstance(i, dict)
                   and i.get("type") == "function_call_output"]
        if outputs:
            return ModelResponse(output=outputs[-1])
        return ModelResponse(tool_calls=(("c1", self.tool, {}),))


@pytest.mark.parametrize("kind", ["sync", "async", "thread"])
def test_tool_context_inside_sync_async_and_threaded_bodies(kind: str) -> None:
    seen: list[ToolContext] = []

    def sync_body() -> str:
        seen.append(tool_context())
        return "ok"

    async def async_body() -> str:
        seen.append(tool_context())
        return "ok"

    async def threaded_body() -> str:
        return await asyncio.to_thread(sync_body)

    body = {"sync": sync_body, "async": async_body, "thread": threaded_body}[kind]
    agent = Agent("a", _Once("t"), (FunctionTool("t", body),))
    result = asyncio.run(Runner.run(agent, "go"))
    (context,) = seen
    c = result.controller
    assert context == ToolContext(c.run_id, "c1", c.idempotency_key("c1"), 1)
    with pytest.raises(LookupError):
        tool_context()


def _in_doubt(tool: str = "pay") -> RunController:
    c = RunController.start(run_id="r", session_id=None)
    c.begin_model_call()
    c.model_responded([ToolCall("c1", tool, {}), ToolCall("c2", "other", {})])
    c.begin_tool("c1")
    c.begin_tool("c2")
    return RunController.from_json(c.to_json())


@pytest.mark.parametrize(("answer", "phase"), [
    (Completed("paid"), Phase.COMPLETED), (NotExecuted(), Phase.APPROVED),
    (Unknown(), Phase.STARTED), ("not an answer", Phase.STARTED)])
def test_verify_in_doubt_records_what_the_verifier_knows(answer: Any, phase: Phase) -> None:
    asked: list[ToolContext] = []

    def verify(context: ToolContext) -> Any:
        asked.append(context)
        return answer

    c = _in_doubt()
    verify_in_doubt(c, {"pay": verify})
    assert [a.call_id for a in asked] == ["c1"]  # only the calls of tools with a verifier
    assert c.phase("c1") is phase
    assert c.phase("c2") is Phase.STARTED
    if phase is not Phase.STARTED:
        assert c.call("c1").decisions[-1].by == "verify:pay"
    else:
        assert c.call("c1").decisions == ()


def test_a_verifier_that_raises_or_times_out_leaves_the_call_in_doubt() -> None:
    def raises(context: ToolContext) -> Completed:
        raise ConnectionError("the payment API is down")

    async def slow(context: ToolContext) -> Completed:
        await asyncio.sleep(5)
        return Completed("late")

    c = _in_doubt()
    assert verify_in_doubt(c, {"pay": raises}) == {}
    assert asyncio.run(verify_in_doubt_async(c, {"pay": slow}, timeout=0.05)) == {}
    assert c.in_doubt() == ("c1", "c2")
    with pytest.raises(TypeError, match="async"):
        verify_in_doubt(c, {"pay": slow})
