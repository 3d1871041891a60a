"""The pydantic-ai adapter's cost, measured on pydantic-ai (PyPI ``pydantic-ai-slim``, import
``pydantic_ai``) driven by its own `FunctionModel`: nothing here calls a real model or API.

`tool_call_overhead` times one whole run whose model asks for ``calls`` calls of a trivial
tool ``lookup(i)`` in one response and then answers with text, for ``calls`` = 1 and 21:

* ``pydantic-ai``: ``agent.run`` alone (no capability, nothing persisted);
* ``memory``: through `LedgerRun` with a `MemoryEventStore` and a `MemorySession` history;
* ``sqlite``: the same with a `SQLiteEventStore` file (``synchronous=FULL``, one append per
  command) in a temporary directory;
* ``sqlite-buffered``: the same store, buffered (one append per effect boundary).

The per-call cost of each is the slope (t(21) - t(1)) / 20; the adapter's overhead per tool
call is its slope minus pydantic-ai's, measured side by side in the same process and run
(medians of ``repeats``, GC on, after one untimed warm-up of each). Each run is checked
(the output, and every call run exactly once); a mismatch raises RuntimeError.

Usage: ``python -m bench.pydantic_ai_rows`` prints the dict as JSON. Raises ImportError
when ``pydantic_ai`` is not installed.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

HOWS = ("pydantic-ai", "memory", "sqlite", "sqlite-buffered")


def _agent(calls: int, ran: list[int]) -> Any:
    from pydantic_ai import Agent
    from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
    from pydantic_ai.models.function import AgentInfo, FunctionModel

    def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if any(isinstance(message, ModelResponse) for message in messages):
            return ModelResponse(parts=[TextPart("done")])
        return ModelResponse(parts=[ToolCallPart("lookup", {"i": i}, tool_call_id=f"c{i}")
                                    for i in range(calls)])

    agent: Agent[None, str] = Agent(FunctionModel(respond))

    @agent.tool_plain
    def lookup(i: int) -> str:
        ran.append(i)
        return f"found {i}"

    return agent


async def _timed(calls: int, how: str, folder: Path, n: int) -> float:
    """Seconds for one whole run (building the agent and the store included in neither)."""
    from statemachine import MemoryEventStore, SQLiteEventStore
    from statemachine.adapters.pydantic_ai import LedgerRun
    from statemachine.sessions import MemorySession

    ran: list[int] = []
    agent = _agent(calls, ran)
    if how == "pydantic-ai":
        started = time.perf_counter()
        result = await agent.run("go")
        elapsed = time.perf_counter() - started
        output = result.output
    else:
        store: Any = (MemoryEventStore() if how == "memory"
                      else SQLiteEventStore(folder / f"bench-{n}.db"))
        started = time.perf_counter()
        run = await LedgerRun.open(agent, run_id=f"r{n}", history=MemorySession(f"h{n}"),
                                   store=store, buffered=how == "sqlite-buffered")
        finished = await run.run("go")
        elapsed = time.perf_counter() - started
        output = finished.output
    if output != "done" or sorted(ran) != list(range(calls)):
        raise RuntimeError(f"{how} with {calls} calls: output {output!r}, ran {sorted(ran)}")
    return elapsed


async def _overhead(folder: Path, repeats: int) -> dict[str, Any]:
    for how in HOWS:  # warm-up, untimed
        await _timed(1, how, folder, 0 if how == "pydantic-ai" else -HOWS.index(how))
    times: dict[tuple[str, int], list[float]] = {}
    n = 0
    for _ in range(repeats):
        for how in HOWS:
            for calls in (1, 21):
                n += 1
                times.setdefault((how, calls), []).append(await _timed(calls, how, folder, n))
    run = {key: statistics.median(values) for key, values in times.items()}
    slope = {how: (run[how, 21] - run[how, 1]) / 20 for how in HOWS}
    return {
        "run_1_call_ms": {how: round(run[how, 1] * 1e3, 3) for how in HOWS},
        "run_21_calls_ms": {how: round(run[how, 21] * 1e3, 3) for how in HOWS},
        "per_tool_call_us": {how: round(slope[how] * 1e6, 1) for how in HOWS},
        "tool_call_overhead_us": {how: round((slope[how] - slope["pydantic-ai"]) * 1e6, 1)
                                  for how in HOWS[1:]},
        "tool_call_overhead_ratio": {how: round(slope[how] / slope["pydantic-ai"], 2)
                                     for how in HOWS[1:]},
        "repeats": repeats,
    }


def tool_call_overhead(repeats: int = 7) -> dict[str, Any]:
    """The capability's overhead per tool call against pydantic-ai alone (see the module
    docstring): ``tool_call_overhead_us`` per store, and the raw figures it comes from."""
    with tempfile.TemporaryDirectory(prefix="pydantic-ai-bench-") as folder:
        return asyncio.run(_overhead(Path(folder), repeats))


def bench_row(args: Any) -> dict[str, Any]:
    """The bench's row (`bench.__main__.EXTRA_ROWS`): ``--adapter-repeats`` repeats."""
    figures = tool_call_overhead(args.adapter_repeats)
    over, alone = figures["tool_call_overhead_us"], figures["per_tool_call_us"]["pydantic-ai"]
    return {"summary": (
        f"overhead per tool call against pydantic-ai alone ({alone} µs): "
        + ", ".join(f"{how} +{us} µs" for how, us in over.items())), **figures}


if __name__ == "__main__":
    print(json.dumps(tool_call_overhead(), indent=2))
