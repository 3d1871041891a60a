"""The rows of `just bench` beyond one guarded command: loading, memory, fuzzing
throughput, whole scenarios, large batches and events, and the optional comparison with
openai-agents."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

from statemachine import RunController, ToolCall, codec
from statemachine.controller import SNAPSHOT_SIZE
from statemachine.payloads import JSON, compact_json
from statemachine.stores import MemoryEventStore, SQLiteEventStore


def _median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def long_run(events: int, *, max_calls: int | None = None) -> RunController:
    """A legal log of ``events`` events: turns of one tool call, run and published (at
    most ``max_calls`` of them; then failed model calls, which add no ledger entry)."""
    return _long_run(events, max_calls, None)[0]


def _long_run(events: int, max_calls: int | None, cut: int | None
              ) -> tuple[RunController, JSON]:
    """`long_run`, and the run's snapshot taken when its log held ``cut`` events (None
    when ``cut`` is None or never reached): the size of the log before it recorded as a
    controller's own snapshot records it."""
    c = RunController.start(run_id="long", session_id="s")
    kept: list[JSON] = []

    def step(command: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        command(*args, **kwargs)
        keep()

    def keep() -> None:
        if c.version == cut:
            snapshot = c.state.snapshot()
            # without the size, as from an older library, a load reads the whole log
            # once to count it
            snapshot[SNAPSHOT_SIZE] = c.size
            kept.append(snapshot)

    keep()
    history: list[JSON] = []
    turn = 0
    while c.version + 6 <= events and (max_calls is None or turn < max_calls):
        call_id = f"call-{turn}"
        items: list[JSON] = [{"call_id": call_id, "output": {"rate": turn}}]
        step(c.begin_model_call)
        step(c.model_responded, [ToolCall(call_id, "lookup", {"q": turn})])
        step(c.begin_tool, call_id)
        step(c.tool_completed, call_id, {"rate": turn})
        step(c.stage_publication, items, history[-2:], call_ids=[call_id])
        history += items
        step(c.publication_committed)
        turn += 1
    while c.version + 2 <= events:
        step(c.begin_model_call)
        step(c.model_failed, TimeoutError())
    if c.version < events:
        step(c.hook_ran, "agent_start")
    return c, (kept[0] if kept else None)


def measure_load(sizes: tuple[int, ...], repeats: int) -> list[dict[str, Any]]:
    """Events per second loading a run from JSON text and from the SQLite store by full
    replay; milliseconds loading through a snapshot (snapshot + a 128-event tail), for a
    run whose ledger grows with its log (a call every six events) and for one whose
    ledger stays at 100 calls. A snapshot makes loading independent of the log's
    length; what is left is linear in the state, which holds the whole tool ledger."""
    return [_load_row(size, repeats) for size in sizes]


def _cut(length: int) -> int:
    """Where a load row's snapshot is taken: 128 events before the end."""
    return max(1, length - 128)


def _snapshot_store(path: Path, events: list[Any], snapshot: JSON) -> SQLiteEventStore:
    """A store holding ``events`` with ``snapshot`` (the run's, taken by `_long_run` when
    it held ``_cut(len(events))`` events) at that cut."""
    store = SQLiteEventStore(path)
    cut = _cut(len(events))
    store.append("long", events[:cut], 0)
    store.append("long", events[cut:], cut, snapshot=snapshot)
    return store


def _two_stores(tmp: Path, events: list[Any], snapshot: JSON
                ) -> tuple[SQLiteEventStore, SQLiteEventStore]:
    """Two stores of ``events``: one without a snapshot (a load replays the whole log)
    and one with ``snapshot`` at `_cut`. The events before the cut are appended once and
    the file copied (sqlite3's backup), which halves the cost of building them."""
    import sqlite3

    cut = _cut(len(events))
    full = SQLiteEventStore(tmp / "full.db")
    full.append("long", events[:cut], 0)
    full.close()
    source = sqlite3.connect(tmp / "full.db")
    copy = sqlite3.connect(tmp / "snap.db")
    try:
        source.backup(copy)
    finally:
        copy.close()
        source.close()
    full = SQLiteEventStore(tmp / "full.db")
    full.append("long", events[cut:], cut)
    snap = SQLiteEventStore(tmp / "snap.db")
    snap.append("long", events[cut:], cut, snapshot=snapshot)
    return full, snap


def _load_row(size: int, repeats: int) -> dict[str, Any]:
    c, snapshot = _long_run(size, None, _cut(size))
    events = list(c.events)
    assert snapshot is not None
    assert len(events) == size
    text = json.dumps(c.to_json())
    tries = repeats if size <= 10_000 else max(1, repeats // 3)
    from_json = _median_seconds(lambda: RunController.from_json(text), tries)
    with tempfile.TemporaryDirectory() as tmp:
        full, snap = _two_stores(Path(tmp), events, snapshot)
        from_store = _median_seconds(lambda: RunController.load(full, "long"), tries)
        loaded = RunController.load(snap, "long")
        assert loaded.state == c.state  # snapshot + tail equals the full replay
        assert loaded.size == c.size  # and counts the same bytes against max_bytes
        from_snapshot = _median_seconds(lambda: RunController.load(snap, "long"), repeats)
        bounded, bounded_at = _long_run(size, 100, _cut(size))
        assert bounded_at is not None
        small = _snapshot_store(Path(tmp) / "small.db", list(bounded.events), bounded_at)
        bounded_loaded = RunController.load(small, "long")
        assert bounded_loaded.state == bounded.state
        assert bounded_loaded.size == bounded.size
        bounded_snapshot = _median_seconds(lambda: RunController.load(small, "long"),
                                           repeats)
        attempt = _resumed_attempt_seconds(small)
        for store in (full, snap, small):
            store.close()
    n = len(events)
    return {
        "events": n,
        "json_events_per_s": round(n / from_json),
        "sqlite_replay_events_per_s": round(n / from_store),
        "sqlite_snapshot_ms": round(from_snapshot * 1e3, 2),
        "sqlite_snapshot_100_calls_ms": round(bounded_snapshot * 1e3, 2),
        "resumed_attempt_ms": round(attempt * 1e3, 2),
    }


def _resumed_attempt_seconds(store: SQLiteEventStore) -> float:
    """One whole reference-runner attempt on a run loaded from ``store`` (snapshot plus a
    short tail): input, model call, final output, its publication, about a dozen loop
    steps, each appended to the store. A step must cost O(1) in log length, so this stays
    flat from 1k to 100k events (it once re-read the whole log twice per step)."""
    from statemachine.runner import Agent, ModelResponse, Runner
    from statemachine.sessions import MemorySession
    from statemachine.testing import ScriptedModel

    agent = Agent("bench", ScriptedModel([ModelResponse(output="done")]), max_turns=None)
    start = time.perf_counter()
    result = asyncio.run(Runner.run(agent, "one more", session=MemorySession("s"),
                                    store=store, run_id="long"))
    elapsed = time.perf_counter() - start
    assert result.final_output == "done"
    return elapsed


def _payload_bytes(value: Any) -> int:
    stack, total = [value], 0
    while stack:
        item = stack.pop()
        total += sys.getsizeof(item)
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return total


def measure_memory(runs: int) -> dict[str, Any]:
    """tracemalloc of ``runs`` idle runs paused at an interruption (two proposed calls),
    per run, with and without the bytes of their payloads."""
    def paused(i: int) -> RunController:
        c = RunController.start(run_id=f"idle-{i}", session_id="s")
        c.begin_model_call()
        c.model_responded([ToolCall(f"a{i}", "charge", {"x": i}, needs_approval=True),
                           ToolCall(f"b{i}", "notify", {}, needs_approval=True)])
        return c

    payloads = _payload_bytes([{"x": 1}, {}]) + _payload_bytes(["a0", "b0", "idle-0",
                                                                 "charge", "notify"])
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    kept = [paused(i) for i in range(runs)]
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    per_run = (after - before) / len(kept)
    return {"runs": runs, "bytes_per_run": round(per_run),
            "payload_bytes_per_run": payloads,
            "bytes_per_run_beyond_payloads": round(per_run - payloads)}


def measure_fuzz_throughput(examples: int) -> dict[str, Any]:
    """Stateful fuzzing throughput: steps per second of the reference-runner world under
    the CI profile's shape (Hypothesis, derandomized)."""
    from hypothesis import HealthCheck, settings
    from hypothesis.stateful import run_state_machine_as_test

    from statemachine.testing import ReferenceWorld, world_state_machine

    machine: Any = world_state_machine(ReferenceWorld)
    start = time.perf_counter()
    run_state_machine_as_test(machine, settings=settings(
        max_examples=examples, stateful_step_count=20, derandomize=True, database=None,
        deadline=None, suppress_health_check=list(HealthCheck)))
    elapsed = time.perf_counter() - start
    steps = machine.tally["steps"]
    return {"examples": examples, "steps": steps, "steps_per_s": round(steps / elapsed)}


async def partial_approval(store: Any, *, run_id: str = "r", session_id: str = "s",
                           buffered: bool = False) -> int:
    """The seed scenario on ``store`` (any event store, sync or async): propose two
    approval-gated calls, approve one, its Session write fails after landing, recover,
    approve the other, finish. Returns the run's length in events."""
    from statemachine.runner import Agent, FunctionTool, ModelResponse, Runner
    from statemachine.sessions import MemorySession
    from statemachine.testing import FlakySession, InjectedWriteError, ScriptedModel

    agent = Agent("billing", ScriptedModel([
        ModelResponse((("charge", "charge", {"x": 7}), ("notify", "notify", {}))),
        ModelResponse(output="done")]), (
        FunctionTool("charge", lambda x: f"charged {x}", needs_approval=True),
        FunctionTool("notify", lambda: "notified", needs_approval=True)))
    session = MemorySession(session_id)
    paused = await Runner.run(agent, "charge me", session=session, store=store,
                              run_id=run_id, buffered=buffered)
    paused.controller.approve("charge")
    with contextlib.suppress(InjectedWriteError):
        await Runner.run(agent, session=FlakySession(session, fail_on=1,
                                                     outcome="commit_then_raise"),
                         controller=paused.controller)
    recovered = await Runner.run(agent, session=session, store=store, run_id=run_id,
                                 buffered=buffered)
    recovered.controller.approve("notify")
    done = await Runner.run(agent, session=session, controller=recovered.controller)
    assert done.final_output == "done"
    return done.controller.version


async def _partial_approval_times(repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` scenarios, all on one event loop (as the other
    runners' rows time theirs: a new loop per repeat would time asyncio, not the run),
    after one untimed warm-up."""
    await partial_approval(MemoryEventStore())
    times = []
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter()
        await partial_approval(MemoryEventStore())
        times.append(time.perf_counter() - start)
    return times


def measure_scenario(repeats: int) -> dict[str, Any]:
    """The whole partial-approval scenario (propose, approve one, failed write, recover,
    approve the other, finish) on the reference runner, memory Session and store; beside
    it the same scenario on LangGraph (`bench.langgraph_rows`) and on openai-agents
    (`bench.openai_agents_rows`) where they are installed (else None)."""
    ours = statistics.median(asyncio.run(_partial_approval_times(repeats))) * 1e3
    row: dict[str, Any] = {"reference_runner_ms": round(ours, 3),
                           "langgraph_ms": None, "openai_agents_ms": None}
    try:
        from bench.langgraph_rows import partial_approval_ms as langgraph_ms
        theirs = langgraph_ms(repeats)
    except ImportError:
        pass
    else:
        row["langgraph_ms"] = round(theirs, 2)
        row["langgraph_over_ours"] = round(theirs / ours, 1)
    try:
        from bench.openai_agents_rows import partial_approval_ms
        theirs = partial_approval_ms(repeats)
    except ImportError:
        return row
    row["openai_agents_ms"] = round(theirs, 2)
    row["openai_agents_over_ours"] = round(theirs / ours, 1)
    return row


def paused_run(turns: int) -> RunController:
    """A run paused at an interruption after ``turns`` turns of one published call."""
    c = long_run(turns * 6 + 1)
    c.begin_model_call()
    c.model_responded([ToolCall("final", "charge", {"x": 7}, needs_approval=True)])
    return c


def measure_roundtrip(turns: int, repeats: int) -> dict[str, Any]:
    """Serialize and load a paused run of ``turns`` turns: per item (a Session item of
    the published history: a call and its output count as two)."""
    c = paused_run(turns)
    items = 2 * turns
    dump = _median_seconds(lambda: json.dumps(c.to_json()), repeats)
    text = json.dumps(c.to_json())
    load = _median_seconds(lambda: RunController.from_json(text), repeats)
    row: dict[str, Any] = {"turns": turns, "items": items,
                           "serialize_us_per_item": round(dump / items * 1e6, 2),
                           "load_us_per_item": round(load / items * 1e6, 2),
                           "openai_agents_load_us_per_item": None}
    try:
        from bench.openai_agents_rows import state_roundtrip_detail
        theirs = state_roundtrip_detail(turns, repeats)
    except ImportError:
        return row
    ours = load / items * 1e6
    # theirs per generated item; ``from_json`` (a dict) is the target, ``from_string``
    # (text, as ours loads) is shown too
    from_json = theirs["from_json_ms"] * 1e3 / theirs["items"]
    from_string = theirs["load_ms"] * 1e3 / theirs["items"]
    row["openai_agents_load_us_per_item"] = round(from_json, 2)
    row["openai_agents_from_string_us_per_item"] = round(from_string, 2)
    row["openai_agents_over_ours"] = round(from_json / ours, 1)
    row["openai_agents_from_string_over_ours"] = round(from_string / ours, 1)
    return row


# ------------------------------------------------------- large batches and events
#
# DESIGN §6.6: staging, recording and loading cost O(size). Each row is measured at two
# sizes, the second twice the first, and the ratio of their times is shown: linear is
# about 2 (staging 10k items once took 23 s and reloading it 8.3 s, quadratic).


def _seconds(fn: Callable[[Any], Any], arg: Any) -> float:
    gc.collect()
    start = time.perf_counter()
    fn(arg)
    return time.perf_counter() - start


def _batch_run(items: int) -> tuple[RunController, list[JSON], list[str]]:
    """A run whose model asked for ``items`` calls, all run and completed, with the
    batch publishing their results (one Session item per call)."""
    c = RunController.start(run_id="batch", session_id="s")
    c.begin_model_call()
    c.model_responded([ToolCall(f"call-{i}", "lookup", {"q": i}) for i in range(items)])
    for i in range(items):
        c.begin_tool(f"call-{i}")
        c.tool_completed(f"call-{i}", {"rate": i})
    batch: list[JSON] = [{"call_id": f"call-{i}", "output": {"rate": i}} for i in range(items)]
    return c, batch, [f"call-{i}" for i in range(items)]


def _batch_row(items: int, repeats: int) -> dict[str, Any]:
    stage, load = [], []
    size = 0
    for _ in range(repeats):
        c, batch, call_ids = _batch_run(items)
        gc.collect()
        start = time.perf_counter()
        c.stage_publication(batch, [{"role": "user", "content": "go"}], call_ids=call_ids,
                            whole=True)
        stage.append(time.perf_counter() - start)
        text = compact_json(c.to_json())
        size = len(text.encode("utf-8"))
        load.append(_seconds(RunController.from_json, text))
    stage_s, load_s = min(stage), min(load)
    return {"items": items, "document_bytes": size,
            "stage_s": round(stage_s, 4), "stage_us_per_item": round(stage_s / items * 1e6, 2),
            "load_s": round(load_s, 4), "load_us_per_item": round(load_s / items * 1e6, 2)}


def _large_output(megabytes: float) -> list[JSON]:
    """A tool output of about ``megabytes`` MB of compact JSON: records of text, numbers
    and flags, as a search or a file listing returns them."""
    target = int(megabytes * 2**20)
    record = {"id": 0, "title": "result title " * 3, "score": 0.5, "tags": ["a", "b"],
              "hit": True, "snippet": "lorem ipsum dolor sit amet, consectetur " * 2}
    each = len(compact_json({**record, "id": 10**4, "score": 1 / 7}))  # a typical one
    return [{**record, "id": i, "score": i / 7} for i in range(max(1, target // each))]


def _event_row(megabytes: float, repeats: int) -> dict[str, Any]:
    output = _large_output(megabytes)
    record, load = [], []
    text = ""
    for _ in range(repeats):
        c = RunController.start(run_id="big", session_id="s")
        c.begin_model_call()
        c.model_responded([ToolCall("search", "search", {"q": "everything"})])
        c.begin_tool("search")
        gc.collect()
        start = time.perf_counter()
        c.tool_completed("search", output)
        record.append(time.perf_counter() - start)
        text = compact_json(c.to_json())
        load.append(_seconds(RunController.from_json, text))
    event = len(compact_json(codec.encode_event(c.events[-1])).encode("utf-8"))
    mb = event / 2**20
    record_s, load_s = min(record), min(load)
    return {"event_bytes": event, "document_bytes": len(text.encode("utf-8")),
            "record_ms": round(record_s * 1e3, 2),
            "record_ms_per_mb": round(record_s * 1e3 / mb, 2),
            "load_ms": round(load_s * 1e3, 2), "load_ms_per_mb": round(load_s * 1e3 / mb, 2)}


def measure_large(items: tuple[int, int], megabytes: tuple[float, float],
                  repeats: int) -> dict[str, Any]:
    """Staging a batch of ``items`` results and loading its document, and recording and
    loading a run whose one event is a tool output of ``megabytes`` MB; each at the two
    sizes given, with the ratio of the second's time to the first's. Each time is the
    fastest of ``repeats`` (another process on a shared machine only adds time, and
    each repeat builds a run of up to 20,000 calls first, so there are only two or three
    of them)."""
    batches = [_batch_row(n, repeats) for n in items]
    events = [_event_row(mb, repeats) for mb in megabytes]

    def ratio(rows: list[dict[str, Any]], key: str) -> float:
        return round(rows[1][key] / rows[0][key], 2) if rows[0][key] else 0.0

    return {
        "batch": batches,
        "batch_stage_ratio": ratio(batches, "stage_s"),
        "batch_load_ratio": ratio(batches, "load_s"),
        "batch_size_ratio": round(items[1] / items[0], 2),
        "event": events,
        "event_record_ratio": ratio(events, "record_ms"),
        "event_load_ratio": ratio(events, "load_ms"),
        "event_size_ratio": round(events[1]["event_bytes"] / events[0]["event_bytes"], 2),
    }
