"""``tool_interrupted`` (DESIGN §6.3): a tool the runner started ended without a result
(cancelled, timed out, or a `BaseException`). The call stays STARTED and is no longer held
in flight, so the live controller answers exactly as a reloaded one."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from statemachine import (
    Action,
    Execute,
    InvalidTransition,
    PublicationUnsettled,
    RecoveryPolicy,
    RunController,
    RunNotResumable,
    SchemaError,
    Step,
    ToolCall,
    ToolInDoubt,
)
from statemachine.payloads import JSON
from statemachine.runner import Agent, FunctionTool, ModelResponse, Runner, RunResult
from statemachine.sessions import MemorySession, Session
from statemachine.testing import ScriptedModel
from statemachine.values import Phase
from tests.helpers import assert_refused, at_interruption, reloaded, snapshot, staged, tools_run
from tests.runner.test_streaming import run_clean

SESSION_ID = "interrupted-session"


def _running(c: RunController | None = None) -> RunController:
    """The seed run with ``charge`` started and held in flight by ``c``."""
    c = c or at_interruption()
    c.approve("charge")
    c.resume()
    assert isinstance(c.begin_tool("charge"), Execute)
    c.hook_ran("tool_start", call_id="charge")
    return c


# ----------------------------------------------------------------- the command


@pytest.mark.invariant("I11")
def test_the_live_controller_answers_as_a_reloaded_one() -> None:
    c = _running()
    before = (c.events, c.to_json())
    assert c.next_action() is Action.RUN_TOOLS  # held in flight: still running here
    c.tool_interrupted("charge")
    assert (c.events, c.to_json()) == before  # nothing recorded
    again = reloaded(c)
    assert c.next_action() is again.next_action() is Action.RESOLVE_IN_DOUBT
    assert c.in_doubt() == again.in_doubt() == ("charge",)
    assert c.in_flight == ()
    assert c.call("charge") == again.call("charge")
    assert c.phase("charge") is Phase.STARTED
    for controller in (c, again):
        assert_refused(controller, ToolInDoubt, controller.resume)
        assert_refused(controller, ToolInDoubt, controller.begin_tool, "charge")
        assert_refused(controller, InvalidTransition, controller.tool_completed, "charge", "x")
        controller.resolve_in_doubt("charge", "charged by the operator")
        assert controller.phase("charge") is Phase.COMPLETED
    assert c.to_json() == again.to_json()


@pytest.mark.invariant("I11")
def test_an_idempotent_call_executes_again_with_a_new_recorded_start() -> None:
    c = RunController.start(run_id="idem", session_id=SESSION_ID)
    c.begin_model_call()
    c.model_responded([ToolCall("lookup", "lookup", {"q": 1}, idempotent=True)])
    assert isinstance(c.begin_tool("lookup"), Execute)
    c.tool_interrupted("lookup")
    again = reloaded(c)
    assert c.next_action() is again.next_action() is Action.RUN_TOOLS
    assert c.runnable_call_ids() == again.runnable_call_ids() == ("lookup",)
    assert c.resume() is Action.RUN_TOOLS
    for controller in (c, again):
        decision = controller.begin_tool("lookup")
        assert isinstance(decision, Execute)
        assert controller.call("lookup").starts == 2
        controller.tool_completed("lookup", "found")
    assert c.to_json() == again.to_json()


def test_refused_for_a_call_this_controller_does_not_hold_in_flight() -> None:
    c = _running()
    for call_id in ("notify", "audit", "unknown"):  # awaiting, awaiting, unknown
        error = assert_refused(c, InvalidTransition, c.tool_interrupted, call_id)
        assert "not in flight" in str(error)
    # started by another process: in doubt, not in flight here
    other = reloaded(c)
    assert_refused(other, InvalidTransition, other.tool_interrupted, "charge")
    # completed
    c.tool_completed("charge", "charged 7")
    assert_refused(c, InvalidTransition, c.tool_interrupted, "charge")
    # reported twice
    d = _running()
    d.tool_interrupted("charge")
    assert_refused(d, InvalidTransition, d.tool_interrupted, "charge")


def test_a_call_id_that_is_not_a_str_is_a_schema_error() -> None:
    c = _running()
    for bad in (7, None, ["charge"]):
        assert_refused(c, SchemaError, c.tool_interrupted, bad)
    assert c.in_flight == ("charge",)


def test_gated_like_every_other_command() -> None:
    abandoned = _running()
    abandoned.abandon("operator gave up")
    assert_refused(abandoned, RunNotResumable, abandoned.tool_interrupted, "charge")
    assert_refused(abandoned, RunNotResumable, abandoned.tool_interrupted, 7)  # gate first
    unsettled = staged()
    assert_refused(unsettled, PublicationUnsettled, unsettled.tool_interrupted, "charge")
    fail_closed = reloaded(staged(RecoveryPolicy.FAIL_CLOSED))
    assert_refused(fail_closed, RunNotResumable, fail_closed.tool_interrupted, "charge")


def test_accepted_when_the_log_is_at_its_limit() -> None:
    # it records nothing, so the log's room never strands a call in flight
    c = RunController.start(run_id="tight", session_id=SESSION_ID, max_events=10)
    c.begin_model_call()
    c.model_responded([ToolCall("charge", "charge", {"x": 7})])
    assert isinstance(c.begin_tool("charge"), Execute)
    c.hook_ran("tool_start", call_id="charge")
    c.guardrail_evaluated("charge_output", {"allowed": True}, stage="tool_output",
                          call_id="charge")
    assert_refused(c, SchemaError, c.hook_ran, "agent_end")  # no room for that
    before = snapshot(c)
    c.tool_interrupted("charge")
    assert snapshot(c)[:-1] == before[:-1]  # all but in_doubt()
    assert c.next_action() is Action.RESOLVE_IN_DOUBT


def test_a_completed_call_is_no_longer_in_flight() -> None:
    # CT10: in flight means started here and not seen complete
    c = tools_run(ToolCall("pay", "pay", {}))
    c.begin_tool("pay")
    assert c.in_flight == ("pay",)
    assert c.call("pay").in_flight is True
    c.tool_completed("pay", "paid")
    assert c.in_flight == ()
    assert c.call("pay").in_flight is False
    assert c.in_doubt() == ()


@pytest.mark.invariant("I11")
def test_an_interrupted_tool_is_answered_as_a_reloaded_controller_would() -> None:
    # CT22: after tool_interrupted the call is no longer held in flight: in doubt when it
    # is not idempotent (never re-run, I11), runnable again when it is
    c = tools_run(ToolCall("pay", "pay", {}), ToolCall("look", "look", {}, idempotent=True))
    c.begin_tool("pay")
    c.begin_tool("look")
    c.tool_interrupted("pay")
    c.tool_interrupted("look")
    assert c.in_flight == ()
    assert c.in_doubt() == ("pay",)
    assert_refused(c, ToolInDoubt, c.begin_tool, "pay")
    again = c.begin_tool("look")
    assert isinstance(again, Execute)
    assert c.call("look").starts == 2


# -------------------------------------------------------------------- the runner


class HangingTool:
    """``charge``: counts every run; the first ``hang`` runs hang until cancelled."""

    def __init__(self, hang: int = 1) -> None:
        self.calls = 0
        self.cancelled = 0
        self.hang = hang
        self.entered = asyncio.Event()

    async def __call__(self, x: int) -> JSON:
        self.calls += 1
        if self.calls <= self.hang:
            self.entered.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        return f"charged {x}"


def _agent(tool: HangingTool, *, idempotent: bool) -> tuple[Agent, ScriptedModel]:
    model = ScriptedModel([ModelResponse((("charge", "charge", {"x": 7}),)),
                           ModelResponse(output="done")])
    return Agent("billing", model, (FunctionTool("charge", tool, idempotent=idempotent),)), model


async def _attempt(how: str, agent: Agent, session: Session, **options: Any) -> RunResult:
    if how == "run":
        return await Runner.run(agent, session=session, **options)
    streamed = Runner.run_streamed(agent, session=session, **options)
    async for _event in streamed.stream_events():
        pass
    return streamed.result


async def _interrupted(how: str, stop: str, tool: HangingTool, agent: Agent,
                       session: Session) -> RunController:
    """Run until the tool hangs, then stop the attempt (cancel its task, or time out)."""
    c = RunController.start(run_id="interrupted", session_id=SESSION_ID)
    attempt = _attempt(how, agent, session, input="charge me 7", controller=c)
    if stop == "timeout":
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(attempt, timeout=0.2)
    else:
        task = asyncio.ensure_future(attempt)
        await tool.entered.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert asyncio.all_tasks() == {asyncio.current_task()}  # the attempt has ended
    assert tool.calls == tool.cancelled == 1
    assert c.phase("charge") is Phase.STARTED
    return c


@pytest.mark.invariant("I1", "I11")
@pytest.mark.parametrize("stop", ["cancel", "timeout"])
@pytest.mark.parametrize("how", ["run", "run_streamed"])
def test_a_cancelled_tool_leaves_the_live_controller_like_a_reloaded_one(
        how: str, stop: str) -> None:
    async def main() -> None:
        tool = HangingTool()
        agent, model = _agent(tool, idempotent=False)
        session = MemorySession(SESSION_ID)
        c = await _interrupted(how, stop, tool, agent, session)
        again = RunController.from_json(json.dumps(c.to_json()))
        assert c.in_flight == ()
        assert c.next_action() is again.next_action() is Action.RESOLVE_IN_DOUBT
        for source in ({"controller": c}, {"controller": again}):
            with pytest.raises(ToolInDoubt):
                await _attempt(how, agent, session, **source)
        assert (tool.calls, model.calls) == (1, 1)
        again.resolve_in_doubt("charge", "charged by the operator")
        c.resolve_in_doubt("charge", "charged by the operator")
        assert c.to_json() == again.to_json()
        done = await _attempt(how, agent, session, controller=c)
        assert done.step is Step.COMPLETED
        assert done.final_output == "done"
        assert (tool.calls, model.calls) == (1, 2)

    run_clean(main)


@pytest.mark.invariant("I11")
@pytest.mark.parametrize("stop", ["cancel", "timeout"])
@pytest.mark.parametrize("how", ["run", "run_streamed"])
def test_a_cancelled_idempotent_tool_runs_again_once(how: str, stop: str) -> None:
    async def main() -> None:
        tool = HangingTool()
        agent, _model = _agent(tool, idempotent=True)
        session = MemorySession(SESSION_ID)
        c = await _interrupted(how, stop, tool, agent, session)
        again = RunController.from_json(json.dumps(c.to_json()))
        assert c.next_action() is again.next_action() is Action.RUN_TOOLS
        assert c.runnable_call_ids() == again.runnable_call_ids() == ("charge",)
        done = await _attempt(how, agent, session, controller=c)
        assert done.step is Step.COMPLETED
        assert done.final_output == "done"
        assert tool.calls == 2  # re-executed exactly once
        assert c.call("charge").starts == 2
        assert c.to_json()["events"] != again.to_json()["events"]

    run_clean(main)


class Stop(BaseException):
    """A `BaseException` that is not an `Exception` (like SystemExit)."""


def test_a_tool_raising_a_base_exception_is_reported_and_re_raised() -> None:
    async def main() -> None:
        def charge(x: int) -> JSON:
            raise Stop

        model = ScriptedModel([ModelResponse((("charge", "charge", {"x": 7}),))])
        agent = Agent("billing", model, (FunctionTool("charge", charge),))
        c = RunController.start(run_id="stopped", session_id=SESSION_ID)
        with pytest.raises(Stop):
            await Runner.run(agent, "charge me 7", session=MemorySession(SESSION_ID),
                             controller=c)
        assert c.in_flight == ()
        assert c.next_action() is Action.RESOLVE_IN_DOUBT
        with pytest.raises(ToolInDoubt):
            c.resume()

    asyncio.run(main())
