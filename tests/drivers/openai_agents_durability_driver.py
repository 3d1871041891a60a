"""A run through the openai-agents adapter killed with SIGKILL between its records and
their flush (tests/adapters/test_openai_agents_durability.py): what
`tests.drivers.durability_driver` is for the reference runner, for `AgentRun` on the
SDK's own `Runner`.

The run ``oa-durable`` goes through `AgentRun` with a SQLite event store, appending per
event (``per-event``) or buffering (``buffered=True``), and the SDK's own `SQLiteSession`:
the model proposes ``pay`` (needs approval, not idempotent, a tool input and a tool output
guardrail) and ``lookup`` (idempotent), then answers, and an output guardrail checks the
answer. When the run pauses for the approval, the driver saves the SDK state, approves
through the adapter (durable before it returns), and only then acknowledges the
decision: an fsynced line ``acked:<call>`` in DIR/acks.txt.

Every effect (hook, guardrail, model call, tool) appends an fsynced line to
DIR/effects.txt. The tools, the model and each Session write first read the *durable*
log (another connection to the store, as a restarted process would) and write a line to
DIR/violations.txt unless it holds the record that allows the effect (`Checker`). The
process counts its durable boundaries (ticks: an event recorded, a store append before
and after, an effect, a Session write before and after, a decision acknowledged) and
kills itself at the chosen one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from agents import (
    Agent,
    GuardrailFunctionOutput,
    Model,
    ModelResponse,
    RunConfig,
    RunHooks,
    SQLiteSession,
    ToolGuardrailFunctionOutput,
    Usage,
    function_tool,
    output_guardrail,
    set_tracing_disabled,
    tool_input_guardrail,
    tool_output_guardrail,
)
from agents.testing import assistant_message, function_call

from statemachine import ConcurrencyConflict, RunNotResumable, Step, ToolInDoubt
from statemachine.adapters.openai_agents import AgentRun
from statemachine.events import InputAdded
from tests.drivers.crash_driver import Effects, Ticks, append_line
from tests.drivers.durability_driver import (
    Checker,
    SkipsFlushBeforeTools,
    TickingController,
    TickingStore,
    log,
    run_forked,
)

RUN_ID = "oa-durable"
SESSION_ID = "oa-durable-session"
INPUT = "pay 7, then look the rate up"
MODES = ("per-event", "buffered")
CONFIG = RunConfig(tracing_disabled=True)
set_tracing_disabled(True)


class TickingSession(SQLiteSession):
    """The SDK's SQLite session: checks the durable log before each write, ticks before
    and after it."""

    def __init__(self, session_id: str, path: Path, ticks: Ticks, checker: Checker) -> None:
        super().__init__(session_id, path)
        self.ticks = ticks
        self.checker = checker

    async def add_items(self, items: list[Any]) -> None:
        self.checker.write(items)
        self.ticks("session-before write")
        await super().add_items(items)
        self.ticks("session-after write")


class HistoryModel(Model):
    """Proposes ``pay`` and ``lookup`` until a tool output is in its input, then
    answers: what it says depends on the Session alone, so a restarted process agrees."""

    def __init__(self, effect: Effects, checker: Checker) -> None:
        self.effect = effect
        self.checker = checker

    async def get_response(self, system_instructions: Any, input: Any, *args: Any,
                           **kwargs: Any) -> ModelResponse:
        self.checker.model()
        answered = any(isinstance(item, dict) and item.get("type") == "function_call_output"
                       for item in input)
        self.effect(f"model {'answer' if answered else 'calls'}")
        output = ([assistant_message("paid 7")] if answered else
                  [function_call("pay", {"amount": 7}, call_id="pay"),
                   function_call("lookup", {"q": "rate"}, call_id="lookup")])
        return ModelResponse(output=output, usage=Usage(), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def get_retry_advice(self, request: Any) -> Any:
        return None


class EffectHooks(RunHooks[Any]):
    def __init__(self, effect: Effects) -> None:
        self.effect = effect

    async def on_agent_start(self, context: Any, agent: Any) -> None:
        self.effect("hook agent_start")

    async def on_agent_end(self, context: Any, agent: Any, output: Any) -> None:
        self.effect("hook agent_end")

    async def on_tool_start(self, context: Any, agent: Any, tool: Any) -> None:
        self.effect(f"hook tool_start:{context.tool_call_id}")

    async def on_tool_end(self, context: Any, agent: Any, tool: Any, result: Any) -> None:
        self.effect(f"hook tool_end:{context.tool_call_id}")


def agent(effect: Effects, checker: Checker) -> Agent[Any]:
    @tool_input_guardrail
    def pay_input(data: Any) -> ToolGuardrailFunctionOutput:
        effect("guardrail pay_input")
        return ToolGuardrailFunctionOutput.allow()

    @tool_output_guardrail
    def pay_output(data: Any) -> ToolGuardrailFunctionOutput:
        effect("guardrail pay_output")
        return ToolGuardrailFunctionOutput.allow()

    @function_tool(needs_approval=True, tool_input_guardrails=[pay_input],
                   tool_output_guardrails=[pay_output])
    def pay(amount: int) -> str:
        checker.tool("pay")
        effect("tool pay")  # inside the tool: a kill here leaves the call in doubt
        return f"charged {amount}"

    @function_tool
    def lookup(q: str) -> str:
        checker.tool("lookup")
        effect("tool lookup")
        return f"{q} is 1.0"

    @output_guardrail
    def final_output(context: Any, agent: Any, output: Any) -> GuardrailFunctionOutput:
        effect("guardrail final_output")
        return GuardrailFunctionOutput(output_info=None, tripwire_triggered=False)

    return Agent("payer", model=HistoryModel(effect, checker), tools=[pay, lookup],
                 output_guardrails=[final_output])


async def run_durable(folder: Path, mode: str, ticks: Ticks, *, broken: bool = False
                      ) -> dict[str, Any]:
    """Start or resume the run through `AgentRun`, approving ``pay`` when asked (durable
    before acknowledged), until it completes or fails closed. ``broken``: with a
    controller whose flush before a tool does nothing (`SkipsFlushBeforeTools`), for the
    test of the test."""
    path = folder / "events.db"
    store = TickingStore(path, ticks)
    checker = Checker(folder, RUN_ID, lambda: log(folder, RUN_ID) if path.exists() else [])
    session = TickingSession(SESSION_ID, folder / "session.db", ticks, checker)
    effect = Effects(folder, ticks)
    buffered = mode == "buffered"
    logged = store.load(RUN_ID)
    kind = SkipsFlushBeforeTools if broken else TickingController
    c = (kind.load(store, RUN_ID, buffered=buffered) if logged else
         kind.start(run_id=RUN_ID, session_id=SESSION_ID, store=store, buffered=buffered))
    assert isinstance(c, TickingController)
    c.ticks = ticks
    saved = folder / "state.json"
    # the previous process is dead: no write of its attempt can still land
    run = AgentRun.from_controller(agent(effect, checker), c, session, take_over=True,
                                   owner=str(os.getpid()), idempotent=("lookup",))
    new_input = None if any(isinstance(e, InputAdded) for e in logged) else INPUT
    state = saved.read_text() if saved.exists() else None
    try:
        while True:
            result = await run.run(new_input, state=state, hooks=EffectHooks(effect),
                                   run_config=CONFIG)
            new_input = state = None
            if result.step is Step.COMPLETED:
                return {"outcome": "completed", "output": result.final_output}
            if not result.pending:
                return {"outcome": result.step.value}
            if result.state is not None:
                draft = folder / "state.tmp"
                draft.write_text(result.state.to_string())
                draft.replace(saved)
            for call in result.pending:
                await run.approve(call.call_id)  # durable before it returns
            for call in result.pending:
                append_line(folder / "acks.txt", f"acked:{call.call_id}")
                ticks(f"acked {call.call_id}")
    except ToolInDoubt as error:
        return {"outcome": "in_doubt", "call_id": error.call_id}
    except ConcurrencyConflict as error:
        return {"outcome": "conflict", "action": error.action}
    except RunNotResumable:
        return {"outcome": c.step.value}
    finally:
        store.close()
        session.close()


def fork(folder: Path, mode: str, kill_at: int | None, *, broken: bool = False
         ) -> dict[str, Any] | None:
    """One driver process on the run in ``folder`` (None: it was killed)."""
    return run_forked(folder, lambda ticks: run_durable(folder, mode, ticks, broken=broken),
                      kill_at)
