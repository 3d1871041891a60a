"""What a run is made of: agents, tools, guardrails, hooks, the model protocol, and the
results a run returns."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Literal, Protocol

import attrs

from statemachine.controller import RunController
from statemachine.payloads import JSON
from statemachine.values import GuardrailResult, Step, ToolCall
from statemachine.verifiers import Verifier

# ------------------------------------------------------------------ the agent side


@attrs.frozen
class Verdict:
    """What a guardrail decided: ``allow``, or ``reject_content`` with the ``message``
    that replaces the tool's input (the tool does not run) or its output."""

    behavior: Literal["allow", "reject_content"] = "allow"
    message: str | None = None

    def as_json(self) -> dict[str, JSON]:
        return {"behavior": self.behavior, "message": self.message}


ALLOW = Verdict()


def reject_content(message: str) -> Verdict:
    return Verdict("reject_content", message)


@attrs.frozen
class ToolGuardrail:
    """``check(call)`` (input) or ``check(call, output)`` (output) → `Verdict`; raising
    stops the run with that error."""

    name: str
    check: Callable[..., Verdict | Awaitable[Verdict]]


@attrs.frozen
class OutputGuardrail:
    """``check(output)`` → `Verdict` for the agent's final output; ``reject_content`` is a
    tripwire: the run is abandoned and `OutputGuardrailTripwire` raised."""

    name: str
    check: Callable[[JSON], Verdict | Awaitable[Verdict]]


@attrs.frozen
class FunctionTool:
    """A tool the model may call: ``function(**arguments)``, sync or async, returns a
    plain JSON output (an `Exception` it raises becomes the output ``"tool error: Type"``).

    ``needs_approval``: every call pauses the run in ``INTERRUPTION`` until a human
    approves or rejects it. ``idempotent``: a call started by a process that died may be
    run again (a new start is recorded); otherwise such a call is in doubt
    (`ToolInDoubt`) and never re-run. ``input_guardrails`` run before the tool (a
    ``reject_content`` verdict replaces its output and the tool does not run);
    ``output_guardrails`` check its output. Each guardrail runs once per call (I1).

    Inside ``function``, `statemachine.tool_context()` gives the call's `ToolContext`
    (its idempotency key, the same on every start). ``verify``: asked, on each later
    attempt before any other effect, what happened to a call of this tool left in doubt
    (`statemachine.verifiers`: ``Completed(output)``, ``NotExecuted()`` or
    ``Unknown()``, sync or async); its answer is recorded as ``by="verify:<name>"``.
    """

    name: str
    function: Callable[..., Any]
    needs_approval: bool = False
    idempotent: bool = False
    input_guardrails: tuple[ToolGuardrail, ...] = ()
    output_guardrails: tuple[ToolGuardrail, ...] = ()
    verify: Verifier | None = None


@attrs.frozen
class ModelResponse:
    """What the model answered: tool calls (``call_id``, ``name``, ``arguments``), or an
    output, or both (calls win)."""

    tool_calls: tuple[tuple[str, str, JSON], ...] = ()
    output: JSON = None


class Model(Protocol):
    async def respond(self, history: list[JSON], agent: Agent) -> ModelResponse:
        """Answer the conversation so far."""


@attrs.frozen
class Agent:
    """What the runner drives: a ``model``, its ``tools``, what to do after a tool ran
    (``run_llm_again``, or ``stop_on_first_tool``: the first tool output is the final
    output), ``output_guardrails`` (a ``reject_content`` verdict is a tripwire: the run
    is abandoned and `OutputGuardrailTripwire` raised) and ``max_turns`` (model
    responses; past it the run is abandoned with ``"max_turns"`` and
    `MaxTurnsExceeded` raised; None for no limit)."""

    name: str
    model: Model
    tools: tuple[FunctionTool, ...] = ()
    tool_use_behavior: Literal["run_llm_again", "stop_on_first_tool"] = "run_llm_again"
    output_guardrails: tuple[OutputGuardrail, ...] = ()
    max_turns: int | None = 10

    def verifiers(self) -> dict[str, Verifier]:
        """The verifiers of the agent's tools, by tool name."""
        return {t.name: t.verify for t in self.tools if t.verify is not None}

    def tool(self, name: str) -> FunctionTool:
        """The tool called ``name``; `LookupError` when the agent has none."""
        for tool in self.tools:
            if tool.name == name:
                return tool
        raise LookupError(f"agent {self.name!r} has no tool {name!r}")


class RunHooks:
    """Lifecycle hooks; override what you need. Each runs once per scope (I1)."""

    async def on_agent_start(self, agent: Agent) -> None: ...
    async def on_agent_end(self, agent: Agent, output: JSON) -> None: ...
    async def on_llm_start(self, agent: Agent) -> None: ...
    async def on_llm_end(self, agent: Agent, response: ModelResponse) -> None: ...
    async def on_tool_start(self, agent: Agent, call: ToolCall) -> None: ...
    async def on_tool_end(self, agent: Agent, call: ToolCall, output: JSON) -> None: ...


class OutputGuardrailTripwire(Exception):
    """An output guardrail rejected the final output; the run was abandoned."""

    def __init__(self, guardrail: str) -> None:
        super().__init__(f"output guardrail {guardrail!r} tripped; the run was abandoned")
        self.guardrail = guardrail


class MaxTurnsExceeded(Exception):
    """The agent used all its turns; the run was abandoned."""


# ------------------------------------------------------------------------ results


@attrs.frozen
class RunResult:
    """Where an attempt stopped: completed (``final_output``, ``step`` is ``COMPLETED``)
    or paused for human decisions (``interruptions``: copies of the calls awaiting one,
    in proposal order; decide them on ``controller`` and run again). ``guardrail_results``
    are the published ones (I4). ``controller`` is the run itself: resume with
    ``Runner.run(..., controller=result.controller)``, or save ``controller.to_json()``.
    """

    final_output: JSON
    interruptions: tuple[ToolCall, ...]
    guardrail_results: tuple[GuardrailResult, ...]
    controller: RunController

    @property
    def step(self) -> Step:
        return self.controller.step


@attrs.frozen
class StreamEvent:
    """One thing that happened, as a streamed run reports it."""

    kind: str
    data: dict[str, JSON] = attrs.field(factory=dict)


Emit = Callable[[StreamEvent], None]


