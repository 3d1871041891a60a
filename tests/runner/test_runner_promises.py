"""One test per public promise of the reference runner (`statemachine.runner`: the
docstrings of `Runner`, `Agent`, `FunctionTool`, `RunHooks`, `OutputGuardrail`, and the
README's "Embed it in your runner") and of the remote executor (`RemoteToolExecutor`).

Every expected outcome is computed from the script the test wrote (how many responses
the model was given, which calls it proposed, which were approved), never read back from
the log: counts of tool runs, hook calls and model calls are taken by the fakes below,
and the Session's items are compared with the list the script implies. Each scenario
runs both ways, `Runner.run` and `Runner.run_streamed`, and both must leave the same log
and the same Session (I8).
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import Any

import attrs
import pytest

from statemachine import MemoryEventStore, Phase, RunController, RunNotResumable, Step
from statemachine import events as ev
from statemachine.payloads import JSON
from statemachine.runner import (
    Agent,
    AlreadyAnswered,
    FunctionTool,
    MaxTurnsExceeded,
    ModelResponse,
    OutputGuardrail,
    OutputGuardrailTripwire,
    RemoteEvent,
    RemoteToolExecutor,
    RunHooks,
    Runner,
    RunResult,
    ToolGuardrail,
    TransientPostError,
    Verdict,
    reject_content,
)
from statemachine.runner.agents import ALLOW
from statemachine.sessions import MemorySession
from statemachine.testing import ScriptedModel
from statemachine.values import ToolCall
from tests import helpers
from tests.helpers import tools_run

SESSION = "promises"
MODES = ["run", "streamed"]
USER = {"role": "user", "content": "go"}


# ------------------------------------------------------------------------- fakes


class Script:
    """A model answering with the given responses in order; it records the history it
    was sent each time and fails the test if asked once more than scripted."""

    def __init__(self, *responses: ModelResponse) -> None:
        self.responses = list(responses)
        self.histories: list[list[JSON]] = []

    async def respond(self, history: list[JSON], agent: Agent) -> ModelResponse:
        assert len(self.histories) < len(self.responses), "the model was called past its script"
        self.histories.append(list(history))
        return self.responses[len(self.histories) - 1]

    @property
    def calls(self) -> int:
        return len(self.histories)


class Hooks(RunHooks):
    """Counts every hook by (hook, call id or None)."""

    def __init__(self) -> None:
        self.seen: Counter[tuple[str, str | None]] = Counter()
        self.order: list[tuple[str, str | None]] = []

    def _saw(self, hook: str, call_id: str | None = None) -> None:
        self.seen[(hook, call_id)] += 1
        self.order.append((hook, call_id))

    async def on_agent_start(self, agent: Agent) -> None:
        self._saw("agent_start")

    async def on_agent_end(self, agent: Agent, output: JSON) -> None:
        self._saw("agent_end")

    async def on_llm_start(self, agent: Agent) -> None:
        self._saw("llm_start")

    async def on_llm_end(self, agent: Agent, response: ModelResponse) -> None:
        self._saw("llm_end")

    async def on_tool_start(self, agent: Agent, call: ToolCall) -> None:
        self._saw("tool_start", call.call_id)

    async def on_tool_end(self, agent: Agent, call: ToolCall, output: JSON) -> None:
        self._saw("tool_end", call.call_id)

    def total(self, hook: str) -> int:
        return sum(n for (name, _), n in self.seen.items() if name == hook)


class Tools:
    """Tools that count their runs by arguments' ``id`` (each call passes its call id)."""

    def __init__(self) -> None:
        self.ran: Counter[str] = Counter()

    def tool(self, name: str, **options: Any) -> FunctionTool:
        def function(id: str) -> JSON:
            self.ran[id] += 1
            return f"{name} did {id}"
        return FunctionTool(name, function, **options)


def call(call_id: str, name: str) -> tuple[str, str, JSON]:
    return (call_id, name, {"id": call_id})


def call_items(call_id: str, name: str, output: JSON) -> list[JSON]:
    return [{"type": "function_call", "call_id": call_id, "name": name,
             "arguments": {"id": call_id}},
            {"type": "function_call_output", "call_id": call_id, "output": output}]


def final(output: JSON) -> JSON:
    return {"role": "assistant", "content": output}


@attrs.define
class World:
    """One run's world: its Session, store, hooks and tools, and the mode it runs in.
    Every attempt is bound to the store, so the run can be read back after it raised."""

    mode: str
    session: MemorySession = attrs.Factory(lambda: MemorySession(SESSION))
    store: MemoryEventStore = attrs.Factory(MemoryEventStore)
    hooks: Hooks = attrs.Factory(Hooks)
    tools: Tools = attrs.Factory(Tools)
    run_id: str = "promised-run"

    async def run(self, agent: Agent, input: str | None = None, **options: Any) -> RunResult:
        options = {"session": self.session, "hooks": self.hooks, "store": self.store,
                   "run_id": self.run_id, **options}
        if self.mode == "run":
            return await Runner.run(agent, input, **options)
        streamed = Runner.run_streamed(agent, input, **options)
        async for _ in streamed.stream_events():
            pass
        return streamed.result

    def controller(self) -> RunController:
        return RunController.load(self.store, self.run_id)

    async def outcome(self) -> Outcome:
        return self.controller(), await self.session.get_items()


Outcome = tuple[RunController, list[JSON]]


def run(coroutine: Awaitable[Any]) -> Any:
    async def main() -> Any:
        return await coroutine
    return asyncio.run(main())


def of_kind(c: RunController, kind: type[ev.Event]) -> list[Any]:
    return [e for e in c.events if type(e) is kind]


# ----------------------------------------------------------- the runner's promises
# Each scenario asserts its promise against the script and returns the run's outcome,
# which the parity test compares between the two modes.


async def turn_limit(w: World) -> Outcome:
    """`Agent.max_turns`: past it the run is abandoned with "max_turns" and
    `MaxTurnsExceeded` raised; the model is never asked for a turn past the limit."""
    turns = 2
    model = Script(*[ModelResponse((call(f"t{n}", "step"),)) for n in range(turns + 1)])
    agent = Agent("looper", model, (w.tools.tool("step"),), max_turns=turns)
    with pytest.raises(MaxTurnsExceeded):
        await w.run(agent, "go")
    c = w.controller()
    assert c.step is Step.TERMINAL_UNRECOVERABLE
    assert [e.reason for e in of_kind(c, ev.Abandoned)] == ["max_turns"]
    assert model.calls == turns
    assert w.tools.ran == Counter({f"t{n}": 1 for n in range(turns)})
    expected: list[JSON] = [USER]
    for n in range(turns):
        expected += call_items(f"t{n}", "step", f"step did t{n}")
    assert await w.session.get_items() == expected
    return await w.outcome()


async def approve_one_reject_another(w: World) -> Outcome:
    """README: a paused run resumes after decisions; the approved call runs once, the
    rejected one never runs, its rejection is published like a tool output, and the run
    goes on to call the model again."""
    model = Script(ModelResponse((call("a", "charge"), call("b", "refund"))),
                   ModelResponse(output="charged, refund declined"))
    agent = Agent("billing", model, (w.tools.tool("charge", needs_approval=True),
                                     w.tools.tool("refund", needs_approval=True)))
    paused = await w.run(agent, "go")
    assert [c.call_id for c in paused.interruptions] == ["a", "b"]
    assert paused.step is Step.INTERRUPTION
    assert model.calls == 1
    assert not w.tools.ran
    c = paused.controller
    c.approve("a")
    c.reject("b", "refunds need a manager")
    result = await w.run(agent, controller=c, run_id=None, store=None)
    assert result.step is Step.COMPLETED
    assert result.final_output == "charged, refund declined"
    assert w.tools.ran == Counter({"a": 1})
    assert model.calls == 2
    published = [USER, *call_items("a", "charge", "charge did a"),
                 *call_items("b", "refund", "refunds need a manager")]
    assert model.histories[1] == published  # the model saw the rejection
    assert await w.session.get_items() == [*published, final("charged, refund declined")]
    return c, await w.session.get_items()


async def input_guardrail_rejects(w: World) -> Outcome:
    """`FunctionTool.input_guardrails`: a ``reject_content`` verdict replaces the tool's
    output and the tool does not run: no tool hooks, no output guardrail, the message is
    published as its output, and the model is called again as scripted."""
    output_checks: list[str] = []

    def block(call: ToolCall) -> Verdict:
        return reject_content("blocked by policy")

    def watch(call: ToolCall, output: JSON) -> Verdict:
        output_checks.append(call.call_id)
        return Verdict()

    model = Script(ModelResponse((call("x", "wire"), call("y", "lookup"))),
                   ModelResponse(output="done"))
    agent = Agent("ops", model, (
        w.tools.tool("wire", input_guardrails=(ToolGuardrail("policy", block),),
                     output_guardrails=(ToolGuardrail("audit", watch),)),
        w.tools.tool("lookup", output_guardrails=(ToolGuardrail("audit", watch),))))
    result = await w.run(agent, "go")
    assert result.step is Step.COMPLETED
    assert w.tools.ran == Counter({"y": 1})
    assert output_checks == ["y"]
    assert w.hooks.seen[("tool_start", "x")] == w.hooks.seen[("tool_end", "x")] == 0
    assert w.hooks.seen[("tool_start", "y")] == w.hooks.seen[("tool_end", "y")] == 1
    assert model.calls == 2
    assert await w.session.get_items() == [
        USER, *call_items("x", "wire", "blocked by policy"),
        *call_items("y", "lookup", "lookup did y"), final("done")]
    stages = sorted((g.name, g.stage, g.call_id) for g in result.guardrail_results)
    assert stages == [("audit", "tool_output", "y"), ("policy", "tool_input", "x")]
    return await w.outcome()


async def output_tripwire(w: World) -> Outcome:
    """`OutputGuardrail`: ``reject_content`` is a tripwire: the run is abandoned and
    `OutputGuardrailTripwire` raised; the output is never accepted nor published, and
    the agent's end hook does not run."""
    model = Script(ModelResponse(output="the secret is 42"))
    agent = Agent("chat", model, output_guardrails=(
        OutputGuardrail("no_secrets", lambda output: reject_content("leak")),))
    with pytest.raises(OutputGuardrailTripwire) as info:
        await w.run(agent, "go")
    assert info.value.guardrail == "no_secrets"
    c = w.controller()
    assert c.step is Step.TERMINAL_UNRECOVERABLE
    assert [e.reason for e in of_kind(c, ev.Abandoned)] == ["output guardrail no_secrets"]
    assert not of_kind(c, ev.FinalOutputAccepted)
    assert w.hooks.total("agent_end") == 0
    assert model.calls == 1
    assert await w.session.get_items() == [USER]
    return await w.outcome()


async def hooks_once_each(w: World) -> Outcome:
    """`RunHooks`: each hook runs once per scope: model hooks once per model call, tool
    hooks once per executed tool, agent hooks once per activation (I1)."""
    responses = [ModelResponse((call("p", "ping"), call("q", "ping"))),
                 ModelResponse((call("r", "ping"),)),
                 ModelResponse(output="pong")]
    model = Script(*responses)
    agent = Agent("pinger", model, (w.tools.tool("ping"),))
    result = await w.run(agent, "go")
    assert result.step is Step.COMPLETED
    executed = [cid for r in responses for cid, _, _ in r.tool_calls]
    assert model.calls == len(responses)
    assert w.hooks.total("llm_start") == w.hooks.total("llm_end") == len(responses)
    assert w.hooks.total("agent_start") == w.hooks.total("agent_end") == 1
    assert w.tools.ran == Counter(executed)
    for cid in executed:
        assert w.hooks.seen[("tool_start", cid)] == w.hooks.seen[("tool_end", cid)] == 1
    assert w.hooks.total("tool_start") == w.hooks.total("tool_end") == len(executed)
    # each start hook comes before its end hook, and the model hooks pair up in order
    order = w.hooks.order
    for cid in executed:
        assert order.index(("tool_start", cid)) < order.index(("tool_end", cid))
    llm = [h for h, _ in order if h.startswith("llm_")]
    assert llm == ["llm_start", "llm_end"] * len(responses)
    return await w.outcome()


async def handoff_skips_approved(w: World) -> Outcome:
    """DESIGN §2.1 through the runner: a handoff skips every call not yet started, the
    approved ones included; the next agent's run never executes them and starts a new
    activation (its agent hooks run again)."""
    first = Script(ModelResponse((call("a", "charge"), call("b", "charge"))))
    agent = Agent("billing", first, (w.tools.tool("charge", needs_approval=True),))
    paused = await w.run(agent, "go")
    c = paused.controller
    c.approve("a")
    c.handoff("support")
    second = Script(ModelResponse(output="support here"))
    support = Agent("support", second, (w.tools.tool("charge", needs_approval=True),))
    result = await w.run(support, controller=c, run_id=None, store=None)
    assert result.step is Step.COMPLETED
    assert result.final_output == "support here"
    assert not w.tools.ran
    assert [v.phase for v in c.calls] == [Phase.SKIPPED, Phase.SKIPPED]
    assert first.calls == 1
    assert second.calls == 1
    assert w.hooks.total("agent_start") == 2  # one per activation
    assert w.hooks.total("tool_start") == 0
    assert await w.session.get_items() == [USER, final("support here")]
    return c, await w.session.get_items()


async def stop_on_first_tool(w: World) -> Outcome:
    """`Agent.tool_use_behavior="stop_on_first_tool"`: the first tool output is the final
    output; the model is not called again, and the final batch publishes the call, its
    output and the answer."""
    model = Script(ModelResponse((call("s", "search"),)))
    agent = Agent("finder", model, (w.tools.tool("search"),),
                  tool_use_behavior="stop_on_first_tool")
    result = await w.run(agent, "go")
    assert result.step is Step.COMPLETED
    assert result.final_output == "search did s"
    assert model.calls == 1
    assert w.tools.ran == Counter({"s": 1})
    assert w.hooks.total("agent_end") == 1
    assert await w.session.get_items() == [
        USER, *call_items("s", "search", "search did s"), final("search did s")]
    return await w.outcome()


async def failing_tool(w: World) -> Outcome:
    """`FunctionTool`: an `Exception` the tool raises becomes its output
    ``"tool error: Type"``; it is published, the tool is not retried, the run goes on."""
    runs: list[str] = []

    def broken(id: str) -> JSON:
        runs.append(id)
        raise KeyError(id)

    model = Script(ModelResponse((call("k", "broken"),)), ModelResponse(output="sorry"))
    agent = Agent("fragile", model, (FunctionTool("broken", broken),))
    result = await w.run(agent, "go")
    assert result.step is Step.COMPLETED
    assert runs == ["k"]
    assert model.calls == 2
    assert w.hooks.seen[("tool_start", "k")] == w.hooks.seen[("tool_end", "k")] == 1
    assert await w.session.get_items() == [
        USER, *call_items("k", "broken", "tool error: KeyError"), final("sorry")]
    return await w.outcome()


SCENARIOS: dict[str, Callable[[World], Awaitable[Outcome]]] = {
    "turn limit": turn_limit,
    "approve one, reject another": approve_one_reject_another,
    "input guardrail rejects": input_guardrail_rejects,
    "output tripwire": output_tripwire,
    "hooks once each": hooks_once_each,
    "handoff skips approved calls": handoff_skips_approved,
    "stop on first tool": stop_on_first_tool,
    "a failing tool's error is its output": failing_tool,
}


@pytest.mark.invariant("I1")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_the_runner_keeps_its_promise(scenario: str, mode: str) -> None:
    run(SCENARIOS[scenario](World(mode)))


@pytest.mark.invariant("I8")
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_streamed_and_plain_runs_leave_the_same_log(scenario: str) -> None:
    """I8, per scenario: the same log (every event, in order) and the same Session."""
    plain, plain_items = run(SCENARIOS[scenario](World("run")))
    streamed, streamed_items = run(SCENARIOS[scenario](World("streamed")))
    assert streamed.to_json() == plain.to_json()
    assert streamed_items == plain_items


@pytest.mark.invariant("I9")
@pytest.mark.parametrize("mode", MODES)
def test_a_terminal_run_refuses_to_resume_before_any_work(mode: str) -> None:
    """`Runner.run`: resuming a run that cannot go on raises `RunNotResumable` before any
    model call, tool, hook or guardrail."""
    w = World(mode)
    run(output_tripwire(w))
    w.hooks = Hooks()
    untouched = Script()  # any model call fails the test
    checks: list[JSON] = []

    def check(output: JSON) -> Verdict:
        checks.append(output)
        return Verdict()

    agent = Agent("chat", untouched, (w.tools.tool("t"),),
                  output_guardrails=(OutputGuardrail("g", check),))
    before = w.controller().to_json()
    with pytest.raises(RunNotResumable):
        run(w.run(agent))
    assert untouched.calls == 0
    assert not w.hooks.seen
    assert not checks
    assert not w.tools.ran
    assert w.controller().to_json() == before


def test_a_streamed_result_is_single_use() -> None:
    """`RunResultStreaming.stream_events`: a second call raises and runs nothing."""
    w = World("streamed")
    model = Script(ModelResponse(output="once"))
    streamed = Runner.run_streamed(Agent("a", model), "go", session=w.session,
                                      hooks=w.hooks)

    async def consume() -> None:
        async for _ in streamed.stream_events():
            pass

    run(consume())
    with pytest.raises(RuntimeError, match="single use"):
        streamed.stream_events()
    assert model.calls == 1
    assert streamed.result.final_output == "once"
    assert w.hooks.total("llm_start") == 1


# ------------------------------------------------------ more promises, one test each


def test_a_tool_is_looked_up_by_its_whole_name() -> None:
    # AG04: Agent.tool names one tool exactly; a prefix is another (unknown) name
    agent = Agent("a", ScriptedModel([]), (FunctionTool("search_all", lambda: 1),))
    assert agent.tool("search_all").name == "search_all"
    with pytest.raises(LookupError):
        agent.tool("search")


def test_the_first_rejecting_input_guardrail_decides() -> None:
    # LP06: the tool guardrails of a stage run in order and the first rejection wins
    ran: list[str] = []

    def tool() -> str:
        ran.append("tool")
        return "ran"

    guards = (ToolGuardrail("allow", lambda call: ALLOW),
              ToolGuardrail("first", lambda call: reject_content("first says no")),
              ToolGuardrail("second", lambda call: reject_content("second says no")))
    agent = Agent("a", ScriptedModel([ModelResponse((("k", "act", {}),)),
                                      ModelResponse(output="done")]),
                  (FunctionTool("act", tool, input_guardrails=guards),))
    result = asyncio.run(Runner.run(agent, "go"))
    assert ran == []
    assert result.controller.call("k").result == "first says no"


def test_a_rejected_tool_output_is_replaced_by_the_guardrails_message() -> None:
    # LP07: an output guardrail's reject_content verdict replaces the tool's output
    runs: list[int] = []

    def secret() -> str:
        runs.append(1)
        return "the password is hunter2"

    guard = ToolGuardrail("redact", lambda call, output: reject_content("[redacted]"))
    agent = Agent("a", ScriptedModel([ModelResponse((("s", "secret", {}),)),
                                      ModelResponse(output="done")]),
                  (FunctionTool("secret", secret, output_guardrails=(guard,)),))
    session = MemorySession(SESSION)
    result = asyncio.run(Runner.run(agent, "tell me", session=session))
    assert runs == [1]
    assert result.controller.call("s").result == "[redacted]"
    written = asyncio.run(session.get_items())
    assert {"type": "function_call_output", "call_id": "s", "output": "[redacted]"} in written
    assert "hunter2" not in json.dumps(written)


def test_an_output_guardrail_tripwire_abandons_the_run() -> None:
    # LP08: the tripwire is raised and the run is abandoned (terminal, for good)
    store = MemoryEventStore()
    agent = Agent("a", ScriptedModel([ModelResponse(output="rude")]),
                  output_guardrails=(OutputGuardrail("polite",
                                                     lambda out: reject_content("no")),))
    with pytest.raises(OutputGuardrailTripwire):
        asyncio.run(Runner.run(agent, "hi", store=store, run_id="tripped"))
    c = RunController.load(store, "tripped")
    assert c.step is Step.TERMINAL_UNRECOVERABLE
    assert c.final_output is None


def test_max_turns_abandons_the_run_before_one_more_model_call() -> None:
    # LP02: with max_turns=2, the third model call is never made: the run is abandoned
    # with "max_turns" and MaxTurnsExceeded raised
    store = MemoryEventStore()
    model = ScriptedModel([ModelResponse(((f"c{i}", "tick", {}),)) for i in range(3)])
    agent = Agent("a", model, (FunctionTool("tick", lambda: "tock"),), max_turns=2)
    with pytest.raises(MaxTurnsExceeded):
        asyncio.run(Runner.run(agent, "go", store=store, run_id="turns"))
    assert model.calls == 2
    c = RunController.load(store, "turns")
    assert c.step is Step.TERMINAL_UNRECOVERABLE
    assert [e.reason for e in c.events if isinstance(e, ev.Abandoned)] == ["max_turns"]


def test_a_failed_attempt_still_stores_what_it_recorded() -> None:
    # LP11: a buffered run whose model call fails records the failure, and the attempt's
    # buffered events reach the store although the run ends with the model's error
    class Broken(ScriptedModel):
        async def respond(self, history: list[JSON], agent: Agent) -> ModelResponse:
            raise ValueError("the model is down")

    store = MemoryEventStore()
    agent = Agent("a", Broken([]))
    with pytest.raises(ValueError, match="the model is down"):
        asyncio.run(Runner.run(agent, "hi", store=store, run_id="down", buffered=True))
    c = RunController.load(store, "down")
    assert c.step is Step.RUN_AGAIN
    last = c.events[-1]
    assert isinstance(last, ev.ModelFailed)
    assert last.error == "ValueError"


def test_a_runner_that_can_make_no_progress_stops() -> None:
    # LP12: a call this controller holds in flight (started, never reported) can be
    # neither run again nor resolved here: the runner raises instead of spinning
    c = tools_run(ToolCall("pay", "pay", {}))
    c.begin_tool("pay")
    agent = Agent("a", ScriptedModel([]), (FunctionTool("pay", lambda: "paid"),))

    async def consume() -> int:
        seen = 0
        streamed = Runner.run_streamed(agent, controller=c, session=MemorySession(helpers.SESSION))
        async for _ in streamed.stream_events():
            seen += 1
            if seen > 50:
                break
        return seen

    with pytest.raises(RuntimeError, match="no progress"):
        asyncio.run(consume())
    assert c.phase("pay") is Phase.STARTED


# ------------------------------------------------------------- the remote executor


class Remote:
    """A remote agent loop: a fixed history (listed on connect), no live stream, and a
    post outcome per call id (consumed in order; missing: success). Records every post
    that landed."""

    def __init__(self, history: Sequence[RemoteEvent],
                 posts: dict[str, list[type[Exception] | None]] | None = None) -> None:
        self.history = list(history)
        self.posts = {k: list(v) for k, v in (posts or {}).items()}
        self.landed: list[str] = []
        self.attempts: list[str] = []

    async def _events(self, events: Sequence[RemoteEvent]) -> AsyncGenerator[RemoteEvent, None]:
        for event in events:
            yield event

    def events(self) -> AsyncGenerator[RemoteEvent, None]:
        return self._events([])

    def list_events(self) -> AsyncGenerator[RemoteEvent, None]:
        return self._events(self.history)

    async def post_result(self, call_id: str, result: JSON) -> None:
        self.attempts.append(call_id)
        outcome = self.posts.get(call_id, [])
        error = outcome.pop(0) if outcome else None
        if error is not None:
            raise error("injected")
        self.landed.append(call_id)
        self.history.append(RemoteEvent("tool_result", call_id, result=result))


def _use(call_id: str) -> RemoteEvent:
    return RemoteEvent("tool_use", call_id, "lookup", {"id": call_id})


def _remote_controller() -> RunController:
    return RunController.start(run_id="remote-run", session_id=None)


async def _drain(executor: RemoteToolExecutor) -> list[Any]:
    return [d async for d in executor.run()]


@pytest.mark.invariant("I1")
def test_remote_a_call_already_answered_is_never_run_again() -> None:
    """README: on (re)connect a result the remote holds is acknowledged, never re-run; a
    new call runs once; every successful post is recorded (`result_posted`)."""
    tools = Tools()
    remote = Remote([_use("done"), RemoteEvent("tool_result", "done", result="old"),
                     _use("new"), RemoteEvent("session_end")])
    c = _remote_controller()
    dispatched = run(_drain(RemoteToolExecutor(remote, [tools.tool("lookup")], controller=c)))
    assert tools.ran == Counter({"new": 1})
    assert remote.landed == ["new"]
    assert [(d.call_id, d.posted) for d in dispatched] == [("new", True)]
    assert [e.call_id for e in of_kind(c, ev.ResultPosted)] == remote.landed
    assert c.phase("done") is None  # never taken into the ledger, never run


@pytest.mark.invariant("I1", "I12")
def test_remote_a_failed_post_is_resent_from_the_cache_and_every_landed_post_recorded(
) -> None:
    """`RemoteToolExecutor`: transient post failures are retried, permanent ones wait for
    the next reconnect, where the result is re-posted from the cache (I12) and the tool
    is not run again; each post that landed is recorded once, each failure too."""
    tools = Tools()
    remote = Remote([_use("t"), _use("p")], posts={
        "t": [TransientPostError, None],  # lands on the retry
        "p": [RuntimeError],  # permanent: waits for the next connect
    })
    c = _remote_controller()
    executor = RemoteToolExecutor(remote, [tools.tool("lookup")], controller=c, backoff=0)

    async def two_connects() -> list[Any]:
        seen = []
        async for d in executor.run():
            seen.append(d)
            if d.call_id == "p" and d.posted:
                remote.history.append(RemoteEvent("session_end"))
        return seen

    dispatched = run(two_connects())
    assert tools.ran == Counter({"t": 1, "p": 1})  # neither re-run across the reconnect
    assert sorted(remote.landed) == ["p", "t"]
    assert [(d.call_id, d.posted) for d in dispatched] == [
        ("t", True), ("p", False), ("p", True)]
    posted = [e.call_id for e in of_kind(c, ev.ResultPosted)]
    assert sorted(posted) == sorted(remote.landed)  # every landed post, once
    failed = [e.call_id for e in of_kind(c, ev.ResultPostFailed)]
    assert failed == ["t", "p"]
    results = {d.call_id: d.result for d in dispatched}
    assert results == {"t": "lookup did t", "p": "lookup did p"}


def test_remote_already_answered_post_counts_as_posted() -> None:
    """`AlreadyAnswered` means an earlier post landed: it is recorded as posted, and the
    tool is not run again."""
    tools = Tools()
    remote = Remote([_use("x"), RemoteEvent("session_end")], posts={"x": [AlreadyAnswered]})
    c = _remote_controller()
    dispatched = run(_drain(RemoteToolExecutor(remote, [tools.tool("lookup")], controller=c)))
    assert tools.ran == Counter({"x": 1})
    assert [(d.call_id, d.posted) for d in dispatched] == [("x", True)]
    assert [e.call_id for e in of_kind(c, ev.ResultPosted)] == ["x"]
    assert c.phase("x") is Phase.PUBLISHED
