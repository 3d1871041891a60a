"""What telemetry costs (DESIGN §7.6): a one-tool turn through the reference runner (the
turn of `bench.durable_rows`, in memory: no store, a `MemorySession`, so the turn's CPU is
all there is to see), with telemetry never enabled, enabled through OpenTelemetry's SDK
(a `TracerProvider` whose `SimpleSpanProcessor` hands every span to an in-memory
exporter, cleared as it goes), and disabled again after that, interleaved in the same
run. Each turn's spans are counted, so the row also shows what "on" emits per turn.

Off is the reference: the library pays one flag read per recorded event (and per call
asked to run) and nothing else, so "off again" must be as fast as "never on" (within the
noise). The row is reported, without a verdict: the cost on depends on the exporter.

Usage: ``python -m bench.telemetry_rows`` prints the row as JSON. ImportError without
``opentelemetry-sdk`` (the ``bench`` extra, or ``dev``).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from typing import Any

from bench.durable_rows import _agent

TURNS = 200


async def _turns(turns: int) -> float:
    """Seconds per turn of ``turns`` one-tool turns in memory."""
    from statemachine import Step
    from statemachine.runner import Runner
    from statemachine.sessions import MemorySession

    began = time.perf_counter()
    for i in range(turns):
        agent, ran = _agent()
        result = await Runner.run(agent, "pay 7", session=MemorySession(f"s{i}"))
        if result.step is not Step.COMPLETED or ran != [7]:
            raise RuntimeError(f"the turn went wrong: {result.step}, ran {ran}")
    return (time.perf_counter() - began) / turns


def bench_row(args: Any = None) -> dict[str, Any]:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from statemachine.telemetry import disable_telemetry, enable_telemetry

    quick = getattr(args, "quick", False)
    turns = TURNS // 4 if quick else TURNS
    repeats = 2 if quick else max(1, min(5, getattr(args, "repeats", None) or 3))
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    asyncio.run(_turns(5))  # warm: imports, first-call caches
    times: dict[str, list[float]] = {"never": [], "on": [], "off": []}
    spans: list[int] = []
    for _ in range(repeats):
        times["never"].append(asyncio.run(_turns(turns)))
        enable_telemetry(provider)
        exporter.clear()
        try:
            times["on"].append(asyncio.run(_turns(turns)))
        finally:
            disable_telemetry()
        spans.append(len(exporter.get_finished_spans()))
        exporter.clear()
        times["off"].append(asyncio.run(_turns(turns)))
    ms = {key: statistics.median(value) * 1000 for key, value in times.items()}
    per_turn = statistics.median(spans) / turns
    return {
        "summary": f"one-tool turn in memory: {ms['never']:.3f} ms never on, "
                   f"{ms['off']:.3f} ms off again ({ms['off'] / ms['never']:.2f}x), "
                   f"{ms['on']:.3f} ms on ({ms['on'] / ms['never']:.2f}x, "
                   f"{per_turn:.0f} spans per turn to an in-memory exporter)",
        "target": "reported (off costs a flag read per event; on depends on the exporter)",
        "verdict": "reported",
        "turns": turns, "repeats": repeats,
        "never_ms": round(ms["never"], 3), "off_ms": round(ms["off"], 3),
        "on_ms": round(ms["on"], 3),
        "off_over_never": round(ms["off"] / ms["never"], 3),
        "on_over_never": round(ms["on"] / ms["never"], 3),
        "spans_per_turn": round(per_turn, 1),
    }


if __name__ == "__main__":
    print(json.dumps(bench_row(), indent=2))
