"""The Anthropic adapter's overhead per tool call, measured against the SDK alone in the
same run, both through the same in-process mock transport (``httpx2.MockTransport``, the
SDK's own HTTP client): nothing here calls a real model or API.

`tool_call_overhead` times two workloads, each ``repeats`` times, the two sides
interleaved (SDK, adapter, SDK, adapter, ...) and summarised by their medians:

* managed session: a session whose history holds ``calls`` ``agent.custom_tool_use``
  events; the runner lists the history, runs each (trivial) tool, posts each result, and
  stops when the fake server ends the session after the last result. SDK alone:
  ``SessionToolRunner``; adapter: `LedgerSessionToolRunner` on a `MemoryEventStore`, on a
  `SQLiteEventStore` file appending each event as it is recorded (``sqlite``), and on one
  appending at effect boundaries only (``buffered=True``: ``sqlite_buffered``); each repeat
  is a fresh run;
* messages: ``calls`` turns of a plain loop, each a ``messages.create`` reply with one
  ``tool_use`` and the tool's ``tool_result`` sent with the next request. SDK alone: the
  loop runs the tool itself; adapter: `MessageToolLedger.run_tools` and ``.create`` on a
  `MemoryEventStore`.

It returns a dict of figures (µs per tool call, and the adapter's overhead per call =
adapter minus SDK alone). Usage: ``python -m bench.anthropic_rows``. Raises ImportError when
``anthropic`` is not installed.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import sqlite3
import statistics
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

STAMP = "2026-01-01T00:00:00Z"
SESSION_SIDES = ("sdk", "memory", "sqlite", "sqlite_buffered")


class _Server:
    """A managed session whose history holds ``calls`` tool calls; it ends once all are
    answered."""

    def __init__(self, calls: int) -> None:
        self.events: list[dict[str, Any]] = [
            {"type": "agent.custom_tool_use", "id": f"tu_{i}", "name": "noop",
             "input": {"i": i}, "processed_at": STAMP} for i in range(calls)]
        self.open = calls
        self.changed: asyncio.Event | None = None

    async def handle(self, request: Any) -> Any:
        import httpx2

        if self.changed is None:
            self.changed = asyncio.Event()
        if request.url.path.endswith("/stream"):
            return httpx2.Response(200, headers={"content-type": "text/event-stream"},
                                   content=self._stream(len(self.events)))
        if request.method == "GET":
            return httpx2.Response(200, json={"data": self.events, "next_page": None})
        result = json.loads(request.content)["events"][0]
        self.events.append({**result, "id": f"sevt_{len(self.events)}", "processed_at": STAMP})
        self.open -= 1
        if not self.open:
            self.events.append({"type": "session.status_terminated", "id": "sevt_end",
                                "processed_at": STAMP})
        self.changed.set()
        return httpx2.Response(200, json={"data": []})

    async def _stream(self, seen: int) -> AsyncIterator[bytes]:
        assert self.changed is not None
        while True:
            self.changed.clear()
            for event in self.events[seen:]:
                yield f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()
            seen = len(self.events)
            if self.events[-1]["type"] == "session.status_terminated":
                return
            await self.changed.wait()


async def _session_once(calls: int, side: str, folder: Path, index: int) -> float:
    import httpx2
    from anthropic import AsyncAnthropic
    from anthropic.lib.environments import SessionToolRunner
    from anthropic.lib.tools import beta_async_tool

    from statemachine import MemoryEventStore, SQLiteEventStore
    from statemachine.adapters.anthropic import LedgerSessionToolRunner

    @beta_async_tool
    async def noop(i: int) -> str:
        """Answer i."""
        return f"ok {i}"

    server = _Server(calls)
    client = AsyncAnthropic(api_key="bench", max_retries=0, http_client=httpx2.AsyncClient(
        transport=httpx2.MockTransport(server.handle)))
    store: Any = None
    start = time.perf_counter()
    runner: SessionToolRunner
    if side == "sdk":
        runner = SessionToolRunner(client, "sesn_bench", tools=[noop], max_idle=None)
    else:
        store = (MemoryEventStore() if side == "memory"
                 else SQLiteEventStore(folder / f"events-{side}-{index}.db"))
        runner = await LedgerSessionToolRunner.open(client, "sesn_bench", tools=[noop],
                                                    store=store, max_idle=None,
                                                    buffered=side == "sqlite_buffered")
    posted = sum([call.posted async for call in runner])
    elapsed = time.perf_counter() - start
    if posted != calls:
        raise RuntimeError(f"{side}: {posted} of {calls} results posted")
    if side.startswith("sqlite"):
        store.close()
    await client.close()
    return elapsed


def _messages_once(calls: int, side: str) -> float:
    import httpx2
    from anthropic import Anthropic
    from anthropic.lib.tools import beta_tool

    from statemachine import MemoryEventStore
    from statemachine.adapters.anthropic import MessageToolLedger

    turn = [0]

    def model(request: httpx2.Request) -> httpx2.Response:
        turn[0] += 1
        done = turn[0] > calls
        content = ([{"type": "text", "text": "done"}] if done else
                   [{"type": "tool_use", "id": f"tu_{turn[0]}", "name": "noop",
                     "input": {"i": turn[0]}}])
        return httpx2.Response(200, json={
            "id": "msg", "type": "message", "role": "assistant", "model": "bench",
            "content": content, "stop_reason": "end_turn" if done else "tool_use",
            "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1}})

    @beta_tool
    def noop(i: int) -> str:
        """Answer i."""
        return f"ok {i}"

    client = Anthropic(api_key="bench", max_retries=0, http_client=httpx2.Client(
        transport=httpx2.MockTransport(model)))
    params: dict[str, Any] = {"model": "bench", "max_tokens": 16, "tools": [noop.to_dict()]}
    ledger = (MessageToolLedger.open("bench", [noop], store=MemoryEventStore())
              if side == "memory" else None)
    history: list[Any] = [{"role": "user", "content": "go"}]
    start = time.perf_counter()
    ran = 0
    while True:
        reply = (client.messages.create(messages=history, **params) if ledger is None
                 else ledger.create(client.messages, messages=history, **params))
        if reply.stop_reason != "tool_use":
            break
        history.append({"role": "assistant", "content": reply.content})
        if ledger is None:
            answer: Any = {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": block.id,
                 "content": noop.call(block.input)}
                for block in reply.content if block.type == "tool_use"]}
        else:
            answer = ledger.run_tools(reply)
        ran += len(answer["content"])
        history.append(answer)
    elapsed = time.perf_counter() - start
    client.close()
    if ran != calls:
        raise RuntimeError(f"{side}: {ran} of {calls} tool calls answered")
    return elapsed


def tool_call_overhead(calls: int = 100, repeats: int = 5) -> dict[str, float]:
    """Figures in µs per tool call (medians over ``repeats``): ``session_sdk_us``,
    ``session_memory_us``, ``session_sqlite_us``, ``session_sqlite_buffered_us`` and their
    overheads over the SDK alone (``session_<side>_overhead_us``); ``messages_sdk_us``,
    ``messages_memory_us`` and ``messages_memory_overhead_us``; plus ``calls`` and
    ``repeats``."""
    logging.getLogger("anthropic").setLevel(logging.WARNING)
    per_call = 1e6 / calls
    timings: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as folder:
        for side in SESSION_SIDES:  # one untimed warm-up each
            asyncio.run(_session_once(2, side, Path(folder), -1))
        for index in range(repeats):
            for side in SESSION_SIDES:
                elapsed = asyncio.run(_session_once(calls, side, Path(folder), index))
                timings.setdefault(f"session_{side}", []).append(elapsed)
    for side in ("sdk", "memory"):
        _messages_once(2, side)
    for _ in range(repeats):
        for side in ("sdk", "memory"):
            timings.setdefault(f"messages_{side}", []).append(_messages_once(calls, side))
    figures = {f"{name}_us": round(statistics.median(values) * per_call, 1)
               for name, values in timings.items()}
    for workload, side in (("session", "memory"), ("session", "sqlite"),
                           ("session", "sqlite_buffered"), ("messages", "memory")):
        figures[f"{workload}_{side}_overhead_us"] = round(
            figures[f"{workload}_{side}_us"] - figures[f"{workload}_sdk_us"], 1)
    figures["calls"] = calls
    figures["repeats"] = repeats
    return figures


def bench_row(args: Any) -> dict[str, Any]:
    """The bench's row (`bench.__main__.EXTRA_ROWS`): ``--adapter-calls`` calls per
    run, ``--adapter-repeats`` repeats."""
    figures = tool_call_overhead(args.adapter_calls, args.adapter_repeats)
    return {"summary": (
        f"overhead per tool call against the SDK alone: managed session +"
        f"{figures['session_memory_overhead_us']} µs in memory, +"
        f"{figures['session_sqlite_overhead_us']} µs on SQLite per event, +"
        f"{figures['session_sqlite_buffered_overhead_us']} µs SQLite buffered (SDK alone "
        f"{figures['session_sdk_us']} µs); messages loop +"
        f"{figures['messages_memory_overhead_us']} µs in memory"), **figures}


# ------------------------------------------------------------- the durable one-tool turn

DURABLE_MODES = ("SDK alone, its messages saved to SQLite after the turn",
                 "MessageToolLedger on SQLite, the messages in its history (the store's file)")
DURABLE_PG = ("PostgreSQL: MessageToolLedger on PostgresEventStore, its history a "
              "PostgresSession")


def _paying_client(ran: list[int]) -> tuple[Any, Any]:
    """A client on the mock transport whose model asks for ``pay(amount=7)`` until the
    request carries its result, then answers ``paid 7``; and the tool."""
    import httpx2
    from anthropic import Anthropic
    from anthropic.lib.tools import beta_tool

    def model(request: httpx2.Request) -> httpx2.Response:
        sent = json.loads(request.content)["messages"]
        done = any(isinstance(block, dict) and block.get("type") == "tool_result"
                   for message in sent for block in message["content"]
                   if isinstance(message["content"], list))
        content = ([{"type": "text", "text": "paid 7"}] if done else
                   [{"type": "tool_use", "id": "toolu_p1", "name": "pay",
                     "input": {"amount": 7}}])
        return httpx2.Response(200, json={
            "id": "msg", "type": "message", "role": "assistant", "model": "bench",
            "content": content, "stop_reason": "end_turn" if done else "tool_use",
            "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1}})

    @beta_tool
    def pay(amount: int) -> str:
        """Pay the amount."""
        ran.append(amount)
        return f"paid {amount}"

    return Anthropic(api_key="bench", max_retries=0, http_client=httpx2.Client(
        transport=httpx2.MockTransport(model))), pay


def _durable_turn(store: Any, run_id: str, kept: Any) -> None:
    """One turn of the messages loop, alone (``store`` None: the messages then saved to
    ``kept``, a SQLite connection, in one transaction, as a caller keeping the
    conversation would; the SDK keeps none) or through the ledger, the conversation kept
    in its history (``kept``: a Session the store writes in its own transaction), written
    with the run's end."""
    from statemachine.adapters.anthropic import MessageToolLedger

    ran: list[int] = []
    client, pay = _paying_client(ran)
    params: dict[str, Any] = {"model": "bench", "max_tokens": 16, "tools": [pay.to_dict()]}
    ledger = None if store is None else MessageToolLedger.open(run_id, [pay], store=store,
                                                               history=kept)
    history: list[Any] = [*([] if ledger is None else ledger.messages),
                          {"role": "user", "content": "pay 7"}]
    while True:
        reply = (client.messages.create(messages=history, **params) if ledger is None
                 else ledger.create(client.messages, messages=history, **params))
        if reply.stop_reason != "tool_use":
            break
        history.append({"role": "assistant", "content": reply.content})
        history.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": block.id, "content": pay.call(block.input)}
            for block in reply.content if block.type == "tool_use"]} if ledger is None
            else ledger.run_tools(reply))
    client.close()
    if reply.content[0].text != "paid 7" or ran != [7]:
        raise RuntimeError(f"the Anthropic turn went wrong: ran {ran}")
    if ledger is not None:
        if ledger.messages[-1]["content"][0]["text"] != "paid 7":
            raise RuntimeError("the Anthropic turn's history lacks its final reply")
        return
    history.append({"role": "assistant", "content": reply.content})
    with kept:
        kept.execute("INSERT INTO messages VALUES (?, ?)", (run_id, json.dumps(
            history, default=lambda block: block.model_dump(mode="json"))))


def durable_row(args: Any = None) -> dict[str, Any]:
    """The durable one-tool turn through `MessageToolLedger` (the messages loop) beside
    the SDK alone, on one mock transport: the ledger's durable writes per turn
    (`SQLiteEventStore.commits` and the history's own, `SQLiteSession.commits`; on
    PostgreSQL the server's WAL flushes, as `bench.durable_rows` counts them) and the CPU
    per turn (``time.process_time``) against the SDK alone's, turn by turn in turn. The
    conversation is kept on both sides: by the SDK alone's caller, saved to SQLite after
    the turn (one write); by the ledger in its history (``history=``: a `SQLiteSession`
    on the store's file, a `PostgresSession` on its schema), written with the run's end
    in the same append. DESIGN §7.9: <= 3 writes; CPU <= 1.3x the SDK alone's.
    ImportError without ``anthropic``; ``--quick`` leaves it out."""
    from bench.framework_rows import QUICK

    if getattr(args, "quick", False):  # (--quick has 20 s for every row)
        return {"skipped": QUICK}
    import anthropic  # noqa: F401

    from bench.durable_rows import (
        CPU_RATIO,
        TARGET,
        _counting_from,
        _pid,
        _server,
        _turns,
        _wal_syncs,
    )
    from statemachine.sqlite import SQLiteSession
    from statemachine.stores import SQLiteEventStore

    logging.getLogger("anthropic").setLevel(logging.WARNING)
    turns = _turns(args)
    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as folder:
        store = SQLiteEventStore(Path(folder) / "events.db")
        kept = sqlite3.connect(Path(folder) / "messages.db")
        kept.execute("PRAGMA journal_mode=WAL")
        kept.execute("PRAGMA synchronous=FULL")
        kept.execute("CREATE TABLE messages (run_id TEXT, body TEXT)")
        times: dict[str, list[float]] = {mode: [] for mode in DURABLE_MODES}
        cpus: dict[str, list[float]] = {mode: [] for mode in DURABLE_MODES}
        commits = 0
        for i in range(turns + 1):  # (the first warms up)
            for mode in DURABLE_MODES:
                ours = mode != DURABLE_MODES[0]
                history = SQLiteSession(f"chat-{i}", Path(folder) / "events.db")
                before = store.commits
                gc.collect()  # (outside the clock, as `bench.durable_rows._side_by_side`)
                start, cpu = time.perf_counter(), time.process_time()
                _durable_turn(store if ours else None, f"{mode[:3]}-{i}",
                              history if ours else kept)
                if i:
                    times[mode].append(time.perf_counter() - start)
                    cpus[mode].append(time.process_time() - cpu)
                    commits += store.commits - before + history.commits
                history.close()
        store.close()
        kept.close()
    for mode in DURABLE_MODES:  # (the SDK alone's save is one write)
        rows[mode] = {"writes_per_turn": 1.0 if mode == DURABLE_MODES[0]
                      else round(commits / turns, 2),
                      "turn_ms": round(statistics.median(times[mode]) * 1000, 2),
                      "cpu_ms": round(statistics.median(cpus[mode]) * 1000, 2)}
    with _server(args) as (dsn, schema, skipped):
        if dsn is None:
            rows[DURABLE_PG] = {"skipped": skipped}
        else:
            from statemachine.postgres import PostgresEventStore, PostgresSession

            with schema() as name:
                syncs = _counting_from(dsn, name)
                pg = PostgresEventStore(dsn, schema=name)
                for i in range(turns + 1):
                    on_pg = PostgresSession(dsn, f"chat-{i}", schema=name)
                    _durable_turn(pg, f"run-{i}", on_pg)
                    on_pg.close()
                ended = _pid(pg)
                pg.close()
                rows[DURABLE_PG] = {"writes_per_turn": round(
                    (_wal_syncs(dsn, ended) - syncs) / (turns + 1), 2)}
    ours = rows[DURABLE_MODES[1]]
    cpu = round(ours["cpu_ms"] / rows[DURABLE_MODES[0]]["cpu_ms"], 2)
    writes = [row["writes_per_turn"] for mode, row in rows.items()
              if mode != DURABLE_MODES[0] and "writes_per_turn" in row]
    return {"summary": "; ".join(
                f"{mode} {row['writes_per_turn']} writes"
                + (f", {row['turn_ms']} ms, {row['cpu_ms']} ms CPU" if "cpu_ms" in row else "")
                for mode, row in rows.items() if "writes_per_turn" in row)
                + f"; CPU per turn {cpu}x the SDK alone's",
            "rows": rows, "cpu_vs_sdk_alone": cpu,
            "target": f"<= {TARGET} durable writes per one-tool turn; CPU per turn <= "
                      f"{CPU_RATIO}x the SDK alone's",
            "verdict": "met" if max(writes) <= TARGET and cpu <= CPU_RATIO else "missed"}


if __name__ == "__main__":
    print(json.dumps(tool_call_overhead(), indent=2))
