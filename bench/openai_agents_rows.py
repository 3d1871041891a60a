"""Two comparison rows measured on the OpenAI Agents SDK (PyPI ``openai-agents``, import
``agents``), driven by a scripted in-process model: nothing here calls a real model or API.

* `partial_approval_ms`: the median wall time of one whole "partial approval" scenario:

  1. an Agent with two function tools, ``charge(x: int)`` and ``notify()``, both
     ``needs_approval=True``, and an in-memory ``SQLiteSession(":memory:")``;
  2. turn 1: the scripted model returns two function calls (charge x=7, notify); the run
     stops with 2 interruptions;
  3. the caller approves only charge (``state.approve(...)``) and resumes with
     ``Runner.run(agent, state, session=...)``; the session's ``add_items`` raises once,
     on the first write of that resumed run (the charge output), and the caller catches it;
  4. the recovering caller resumes again from the same ``RunState`` object; the run stops
     with 1 interruption (notify);
  5. the caller approves notify and resumes; turn 2 of the model is a final text.

  Each repeat builds a fresh model, session and agent (inside the timed region); the two
  ``function_tool`` definitions are built once, outside it. Every repeat is checked: the
  interruption counts, the injected error, charge and notify each run exactly once, two
  model calls, the final output and the 6 session items (inside the timed region: one extra
  session read); a mismatch raises RuntimeError. One untimed warm-up run goes first.

* `state_roundtrip_us_per_item`: a run of ``turns`` turns that each call a tool without
  approval (``lookup(i)``), then one turn calling the approval-gated ``charge``, pauses
  with 1 interruption: a ``RunState`` of ``2 * turns + 2`` generated items (and
  ``turns + 1`` model responses). Its persistence round trip is timed: ``to_string()``
  (the JSON text one would store) and ``RunState.from_string(agent, text)``; the
  dict-level ``to_json()``/``from_json()`` are timed too (`state_roundtrip_detail`).

Deviations from the brief's scenario, both to fit this SDK's API:

* the session wrapper is a subclass of ``SQLiteSession`` overriding ``add_items`` (not a
  delegating wrapper), so every other session method the runner may use is the real one;
* "resume again from the state" resumes from the same in-memory ``RunState`` object that
  the failed run was given (the SDK records the unacknowledged session write in it and
  settles it on the next resume, without re-running charge), not from a snapshot taken
  before the failed attempt.

Tracing is disabled through ``RunConfig(tracing_disabled=True)``; streaming is not
exercised, but the scripted model implements ``stream_response`` (one ``response.completed``
event carrying the canned output) to satisfy the ``Model`` interface.

Usage: ``python -m bench.openai_agents_rows``. Both functions raise ImportError when the
``agents`` package is not installed.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import json
import os
import statistics
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agents import Agent, FunctionTool, RunConfig, RunState
    from agents.agent_output import AgentOutputSchemaBase
    from agents.handoffs import Handoff
    from agents.items import TResponseInputItem, TResponseOutputItem, TResponseStreamEvent
    from agents.memory import SQLiteSession
    from agents.model_settings import ModelSettings
    from agents.models.interface import Model, ModelTracing
    from agents.tool import Tool


CACHE_VARIABLE = "STATEMACHINE_BENCH_CACHE"


class InjectedSessionFailure(OSError):
    """The one failure injected into the session's write on the resumed run."""


class Script:
    """The canned model outputs, one per model call, and how many calls consumed them."""

    def __init__(self, steps: Sequence[list[TResponseOutputItem]]) -> None:
        self.steps = list(steps)
        self.calls = 0

    def next(self) -> list[TResponseOutputItem]:
        if self.calls >= len(self.steps):
            raise RuntimeError(f"scripted model: no step {self.calls + 1}")
        output = self.steps[self.calls]
        self.calls += 1
        return output


class Fault:
    """Arms one failure of the session's next ``add_items``; counts those raised."""

    def __init__(self) -> None:
        self.armed = False
        self.raised = 0


def _model_factory() -> Callable[[Script], Model]:
    """The scripted model class: each call returns the script's next canned output."""
    from agents import ModelResponse, Usage
    from agents.models.interface import Model
    from openai.types.responses import (  # type: ignore[import-not-found, unused-ignore]
        Response,
        ResponseCompletedEvent,
    )

    class ScriptedModel(Model):  # type: ignore[misc, unused-ignore]
        def __init__(self, script: Script) -> None:
            self.script = script

        async def get_response(
            self,
            system_instructions: str | None,
            input: str | list[TResponseInputItem],
            model_settings: ModelSettings,
            tools: list[Tool],
            output_schema: AgentOutputSchemaBase | None,
            handoffs: list[Handoff],
            tracing: ModelTracing,
            *,
            previous_response_id: str | None,
            conversation_id: str | None,
            prompt: Any,  # ResponsePromptParam | None; Any keeps openai out of the types
        ) -> ModelResponse:
            output = self.script.next()
            return ModelResponse(output=output, usage=Usage(requests=1), response_id=None)

        async def stream_response(
            self,
            system_instructions: str | None,
            input: str | list[TResponseInputItem],
            model_settings: ModelSettings,
            tools: list[Tool],
            output_schema: AgentOutputSchemaBase | None,
            handoffs: list[Handoff],
            tracing: ModelTracing,
            *,
            previous_response_id: str | None,
            conversation_id: str | None,
            prompt: Any,
        ) -> AsyncIterator[TResponseStreamEvent]:
            response = Response(
                id=f"scripted-{self.script.calls + 1}",
                created_at=0,
                model="scripted",
                object="response",
                output=self.script.next(),
                tool_choice="none",
                tools=[],
                top_p=None,
                parallel_tool_calls=False,
                status="completed",
            )
            yield ResponseCompletedEvent(
                type="response.completed", response=response, sequence_number=0
            )

    return ScriptedModel


def _call(name: str, arguments: dict[str, Any], call_id: str) -> TResponseOutputItem:
    from openai.types.responses import (  # type: ignore[import-not-found, unused-ignore]
        ResponseFunctionToolCall,
    )

    return ResponseFunctionToolCall(
        id=f"fc-{call_id}",
        call_id=call_id,
        type="function_call",
        name=name,
        arguments=json.dumps(arguments, separators=(",", ":")),
        status="completed",
    )


def _text(text: str) -> TResponseOutputItem:
    from openai.types.responses import (  # type: ignore[import-not-found, unused-ignore]
        ResponseOutputMessage,
        ResponseOutputText,
    )

    return ResponseOutputMessage(
        id="msg-final",
        type="message",
        role="assistant",
        status="completed",
        content=[ResponseOutputText(type="output_text", text=text, annotations=[], logprobs=[])],
    )


def _run_config() -> RunConfig:
    from agents import RunConfig

    return RunConfig(tracing_disabled=True)


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise RuntimeError(f"openai-agents scenario diverged: {what}")


# --- row 1: partial approval with one injected session failure ------------------------------


def _session_factory() -> Callable[[str, Fault], SQLiteSession]:
    """An in-memory SQLiteSession whose ``add_items`` raises once when its fault is armed."""
    from agents.memory import SQLiteSession

    class FlakySession(SQLiteSession):  # type: ignore[misc, unused-ignore]
        def __init__(self, session_id: str, fault: Fault) -> None:
            super().__init__(session_id, ":memory:")
            self.fault = fault

        async def add_items(self, items: list[TResponseInputItem]) -> None:
            if self.fault.armed:
                self.fault.armed = False
                self.fault.raised += 1
                raise InjectedSessionFailure("injected: session write failed")
            await super().add_items(items)

    return FlakySession


def _approval_tools(ran: list[str]) -> tuple[FunctionTool, FunctionTool]:
    from agents import function_tool

    # Called, not used as decorators: an untyped decorator would erase the functions' types
    # for mypy when the SDK is not installed.
    def charge(x: int) -> str:
        """Charge x."""
        ran.append(f"charge:{x}")
        return f"charged {x}"

    def notify() -> str:
        """Notify the user."""
        ran.append("notify")
        return "notified"

    return function_tool(charge, needs_approval=True), function_tool(notify, needs_approval=True)


async def _partial_approval_once(
    make_model: Callable[[Script], Model],
    make_session: Callable[[str, Fault], SQLiteSession],
    tools: tuple[FunctionTool, FunctionTool],
    ran: list[str],
    run_config: RunConfig,
    i: int,
) -> None:
    from agents import Agent, Runner

    ran.clear()
    script = Script([
        [_call("charge", {"x": 7}, "call-charge"), _call("notify", {}, "call-notify")],
        [_text("charged 7 and notified")],
    ])
    model, fault = make_model(script), Fault()
    session = make_session(f"partial-{i}", fault)
    agent: Agent[Any] = Agent(name="payer", instructions="Pay.", model=model, tools=list(tools))
    try:
        first = await Runner.run(agent, "charge 7 and notify", session=session,
                                 run_config=run_config)
        _check(len(first.interruptions) == 2, "turn 1 should stop with 2 interruptions")
        state = first.to_state()
        state.approve(next(it for it in first.interruptions if it.name == "charge"))

        fault.armed = True
        try:
            await Runner.run(agent, state, session=session, run_config=run_config)
        except InjectedSessionFailure:
            pass
        else:
            _check(False, "the injected session failure did not surface")
        _check(fault.raised == 1, "add_items should fail exactly once")

        recovered = await Runner.run(agent, state, session=session, run_config=run_config)
        _check([it.name for it in recovered.interruptions] == ["notify"],
               "the recovered resume should stop on notify alone")
        state = recovered.to_state()
        state.approve(recovered.interruptions[0])

        final = await Runner.run(agent, state, session=session, run_config=run_config)
        _check(not final.interruptions, "the last resume should complete")
        _check(final.final_output == "charged 7 and notified", "final output")
        _check(ran == ["charge:7", "notify"], f"tools ran {ran}, want each exactly once")
        _check(script.calls == 2, "two model calls")
        _check(len(await session.get_items()) == 6, "session history: user, 2 calls, 2 "
               "outputs, final message")
    finally:
        session.close()


async def _partial_approval_all(repeats: int) -> list[float]:
    ran: list[str] = []
    make_model, make_session = _model_factory(), _session_factory()
    tools, run_config = _approval_tools(ran), _run_config()
    await _partial_approval_once(make_model, make_session, tools, ran, run_config, -1)  # warm-up
    times: list[float] = []
    for i in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        await _partial_approval_once(make_model, make_session, tools, ran, run_config, i)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def partial_approval_ms(repeats: int = 20) -> float:
    """Median wall time (ms) of the whole partial-approval scenario on openai-agents."""
    import agents  # noqa: F401  -- ImportError here when the SDK is absent

    return statistics.median(asyncio.run(_partial_approval_all(repeats)))


# --- row 2: RunState persistence round trip ------------------------------------------------


def _state_cache(turns: int) -> Path | None:
    """Where the paused state of ``turns`` turns is kept between bench runs (None: not
    kept): under STATEMACHINE_BENCH_CACHE (``off`` turns it off), else the user's cache
    directory; the name carries the SDK's version and a digest of this module, so a
    change to either builds the state anew."""
    from importlib.metadata import version

    where = os.environ.get(CACHE_VARIABLE)
    if where == "off":
        return None
    root = (Path(where) if where else
            Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
            / "statemachine-bench")
    digest = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]
    return root / f"openai-agents-{version('openai-agents')}-paused-{turns}-{digest}.json"


async def _paused_state(turns: int) -> tuple[Agent[Any], RunState[Any, Agent[Any]]]:
    """The agent and its run paused after ``turns`` turns. Running the SDK's loop that
    long costs about half a minute (its per-turn work grows with the run), so the state's
    ``to_json()`` is kept (`_state_cache`) and later runs restore it with
    ``RunState.from_json``, checked to give back the same document, the same items and
    the one interruption."""
    from agents import Agent, RunState, function_tool

    def lookup(i: int) -> str:
        """Look row i up."""
        return f"row {i}"

    def charge(x: int) -> str:
        """Charge x."""
        return f"charged {x}"

    tools: list[Tool] = [function_tool(lookup), function_tool(charge, needs_approval=True)]

    script: list[list[TResponseOutputItem]] = [
        [_call("lookup", {"i": t}, f"call-lookup-{t}")] for t in range(turns)
    ]
    script.append([_call("charge", {"x": 7}, "call-charge")])
    agent: Agent[Any] = Agent(name="payer", instructions="Pay.",
                              model=_model_factory()(Script(script)), tools=tools)
    cache = _state_cache(turns)
    if cache is not None and cache.is_file():
        kept = json.loads(cache.read_text(encoding="utf-8"))
        state = await RunState.from_json(agent, kept)
        if (state.to_json() == kept and len(kept["generated_items"]) == 2 * turns + 2
                and len(state.get_interruptions()) == 1):
            return agent, state
    state = await _run_paused(agent, turns)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        partial = cache.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(state.to_json()), encoding="utf-8")
        os.replace(partial, cache)
    return agent, state


async def _run_paused(agent: Agent[Any], turns: int) -> RunState[Any, Agent[Any]]:
    from agents import Runner

    result = await Runner.run(agent, "look up then charge", max_turns=turns + 2,
                              run_config=_run_config())
    _check(len(result.interruptions) == 1, "the big run should pause on charge")
    return result.to_state()


async def _roundtrip(turns: int, repeats: int) -> dict[str, float]:
    from agents import RunState

    agent, state = await _paused_state(turns)
    items = len(state.to_json()["generated_items"])
    ser: list[float] = []
    load: list[float] = []
    ser_dict: list[float] = []
    load_dict: list[float] = []
    text = ""
    for _ in range(repeats):
        gc.collect()  # GC stays on; this only keeps one op's garbage out of the next's timing
        t0 = time.perf_counter()
        text = state.to_string()
        ser.append(time.perf_counter() - t0)
        gc.collect()
        t0 = time.perf_counter()
        loaded = await RunState.from_string(agent, text)
        load.append(time.perf_counter() - t0)
        _check(len(loaded.get_interruptions()) == 1, "the loaded state lost its interruption")
        del loaded
        gc.collect()
        t0 = time.perf_counter()
        data = state.to_json()
        ser_dict.append(time.perf_counter() - t0)
        gc.collect()
        t0 = time.perf_counter()
        await RunState.from_json(agent, data)
        load_dict.append(time.perf_counter() - t0)
    return {
        "turns": turns,
        "items": items,
        "chars": len(text),
        "serialize_ms": statistics.median(ser) * 1e3,
        "load_ms": statistics.median(load) * 1e3,
        "to_json_ms": statistics.median(ser_dict) * 1e3,
        "from_json_ms": statistics.median(load_dict) * 1e3,
    }


def state_roundtrip_detail(turns: int = 500, repeats: int = 5) -> dict[str, float]:
    """A paused RunState of ``turns`` tool turns: ``items`` (generated items), ``chars`` (of
    ``to_string()``), and the median ``serialize_ms`` (``to_string``), ``load_ms``
    (``RunState.from_string``), ``to_json_ms`` and ``from_json_ms`` over ``repeats``."""
    import agents  # noqa: F401  -- ImportError here when the SDK is absent

    return asyncio.run(_roundtrip(turns, repeats))


def state_roundtrip_us_per_item(turns: int = 500) -> float:
    """Microseconds per generated item to load a paused RunState back from its JSON text."""
    detail = state_roundtrip_detail(turns)
    return detail["load_ms"] * 1e3 / detail["items"]


if __name__ == "__main__":
    from importlib.metadata import version

    print(f"openai-agents {version('openai-agents')}")
    print(f"partial_approval_ms: {partial_approval_ms():.2f}")
    d = state_roundtrip_detail()
    print(
        f"state_roundtrip: {d['load_ms'] * 1e3 / d['items']:.1f} us/item to load "
        f"({int(d['items'])} items, {int(d['chars'])} chars; serialize {d['serialize_ms']:.1f} ms, "
        f"load {d['load_ms']:.1f} ms; to_json {d['to_json_ms']:.1f} ms, "
        f"from_json {d['from_json_ms']:.1f} ms)"
    )
