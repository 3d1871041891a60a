"""Durable writes and CPU per one-tool turn through the LangGraph and Google ADK adapters
(DESIGN §7.9), beside each framework alone, in the manner of `bench.durable_rows`: the
user's input, a model call that proposes ``pay(amount=7)``, the tool, its result into the
history, a model call that answers ``paid 7``; every turn is checked (the answer, the tool
ran once), the first one of each configuration warms up and is not counted.

Each framework keeps the conversation in its own store, so a turn's durable writes are
the framework's own commits plus the ledger's (`SQLiteEventStore.commits`):

* `langgraph_row`: a graph ``model → tools → model`` (LangChain's own fake chat model,
  scripted) on LangGraph's ``SqliteSaver`` with ``durability="sync"``, its commits
  counted off its connection's statements (``COMMIT``): alone (LangGraph's ``ToolNode``);
  through `ToolLedger` (``ledger.tool_node``) with the saver behind `OneWriterSaver`;
  with the checkpoint writes as the ledger's publications (``OneWriterSaver(saver,
  ledger=ledger)``), the ledger's store in a file of its own; and the same with the
  ledger's store in the checkpoints' file, where a checkpoint that publishes is written
  in one transaction with the ledger's staging and commit (the configuration judged). On
  PostgreSQL the publications once more, on ``PostgresSaver`` and
  `PostgresEventStore` in one server, counted as the server's WAL flushes
  (``pg_stat_wal.wal_sync``, as `bench.durable_rows` reads them);
* `google_adk_row`: an ``LlmAgent`` (a scripted ``BaseLlm``) and one ``FunctionTool`` on
  ADK's ``SqliteSessionService``, each of its writes (``create_session``, an
  ``append_event`` of a whole event) one transaction, counted: alone; through
  `LedgerPlugin` with the service behind `OneWriterSessionService`; and with the session
  appends as the ledger's publications (``plugin=``). ADK's service on PostgreSQL needs an
  async driver for SQLAlchemy that the extras do not install: no PostgreSQL figure.

Targets: DESIGN §7.9's "≤ 3 durable writes per turn" holds for a history in the library's
own store (its Session in the store's database); here the history is the framework's, so
the writes are reported. CPU per turn (``time.process_time``, the process's threads
included) is judged against the framework alone, ≤ 1.3x, as for every adapter; the two
configurations it compares (the framework alone and the last of its configurations) run
turn by turn in turn (`bench.durable_rows._side_by_side`),
so a slow while on a shared machine falls on both. At most `MOST_TURNS` turns per
configuration; ``--quick`` leaves both rows out.

Usage: ``python -m bench.framework_rows`` prints both rows as JSON. ImportError without
the framework.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import statistics
import tempfile
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from pathlib import Path
from typing import Any

from bench.durable_rows import (
    CPU_RATIO,
    Steps,
    _counting_from,
    _pid,
    _server,
    _side_by_side,
    _turns,
    _wal_syncs,
)

QUICK = "skipped: --quick (the full bench measures it)"
MOST_TURNS = 10
"""The most turns per configuration (``--durable-turns``, at most this): a turn here is
several of the framework's own fsyncs, and the full bench has a minute."""

REPORTED = ("reported (the history is the framework's own store, its commits counted; "
            "DESIGN §7.9's <= 3 writes is for a history in the library's store); CPU per "
            f"turn <= {CPU_RATIO}x the framework alone's")


def _row(rows: dict[str, Any], alone: str, judged: str, name: str) -> dict[str, Any]:
    """The row: each configuration's figures, the CPU of ``judged`` against ``alone``."""
    cpu = round(rows[judged]["cpu_ms"] / rows[alone]["cpu_ms"], 2)
    return {"summary": "; ".join(
                f"{mode} {row['writes_per_turn']} writes, {row['turn_ms']} ms"
                + (f", {row['cpu_ms']} ms CPU" if "cpu_ms" in row else "")
                for mode, row in rows.items() if "writes_per_turn" in row)
                + f"; CPU per turn {cpu}x {name} alone's",
            "rows": rows, "cpu_vs_sdk_alone": cpu, "target": REPORTED,
            "verdict": "met" if cpu <= CPU_RATIO else "missed"}


def _timed(turns: int, turn: Callable[[int], None], times: list[float],
           cpus: list[float]) -> Steps:
    """``turn(i)`` for i = 0 … ``turns`` (0 warms up), one per step: the wall and CPU
    seconds of the rest go to ``times`` and ``cpus``."""
    for i in range(turns + 1):
        start, cpu = time.perf_counter(), time.process_time()
        turn(i)
        if i:
            times.append(time.perf_counter() - start)
            cpus.append(time.process_time() - cpu)
        yield


def _figures(writes: float, times: list[float], cpus: list[float]) -> dict[str, Any]:
    return {"writes_per_turn": round(writes, 2),
            "turn_ms": round(statistics.median(times) * 1000, 2),
            "cpu_ms": round(statistics.median(cpus) * 1000, 2)}


# ------------------------------------------------------------------------ LangGraph

LANGGRAPH_MODES = ("LangGraph alone, SqliteSaver (sync)",
                   "ToolLedger, SqliteSaver behind OneWriterSaver",
                   "ToolLedger, the checkpoint writes as its publications",
                   "ToolLedger, the checkpoint writes as its publications, the ledger in "
                   "the checkpoints' file")
LANGGRAPH_PG = ("PostgreSQL: ToolLedger, PostgresSaver's writes as its publications, "
                "PostgresEventStore")


def _langgraph_app(saver: Any, ledger: Any, ran: list[int]) -> Any:
    """The graph on ``saver``: its tool node LangGraph's own, or ``ledger``'s."""
    from langchain_core.language_models.fake_chat_models import FakeMessagesListChatModel
    from langchain_core.messages import AIMessage, BaseMessage
    from langchain_core.tools import tool
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode, tools_condition

    @tool
    def pay(amount: int) -> str:
        """Pay the amount."""
        ran.append(amount)
        return f"paid {amount}"

    replies: list[BaseMessage] = [AIMessage(content="", tool_calls=[
        {"name": "pay", "args": {"amount": 7}, "id": "p1", "type": "tool_call"}]),
        AIMessage(content="paid 7")]

    def model(state: Any) -> dict[str, Any]:
        # the reply depends on the conversation alone (how many answers it holds)
        chat = FakeMessagesListChatModel(responses=replies)
        chat.i = sum(isinstance(message, AIMessage) for message in state["messages"])
        return {"messages": [chat.invoke(state["messages"])]}

    graph: Any = StateGraph(MessagesState)
    graph.add_node("model", model)
    graph.add_node("tools", ToolNode([pay]) if ledger is None else ledger.tool_node([pay]))
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", tools_condition)
    graph.add_edge("tools", "model")
    return graph.compile(checkpointer=saver)


def _langgraph_turns(folder: Path, mode: str, turns: int) -> dict[str, Any]:
    """`_langgraph_steps`, alone."""
    found: dict[str, Any] = _side_by_side(_langgraph_steps(folder, mode, turns))[0]
    return found


def _langgraph_steps(folder: Path, mode: str, turns: int) -> Steps:
    """``turns`` turns in ``mode`` (and one that warms up), one per step: the figures."""
    from langgraph.checkpoint.sqlite import SqliteSaver

    from statemachine.adapters.langgraph import OneWriterSaver, ToolLedger
    from statemachine.stores import SQLiteEventStore

    conn = sqlite3.connect(folder / "checkpoints.db", check_same_thread=False)
    together = mode == LANGGRAPH_MODES[3]
    store = None if mode == LANGGRAPH_MODES[0] else SQLiteEventStore(
        folder / ("checkpoints.db" if together else "events.db"))
    ledger = None if store is None else ToolLedger(store)
    saver: Any = SqliteSaver(conn)
    if ledger is not None:
        saver = OneWriterSaver(saver, ledger=None if mode == LANGGRAPH_MODES[1] else ledger)
        if saver._together != together:
            raise RuntimeError(f"{mode}: the checkpoint and its publication are not "
                               "written together as they should be")
    ran: list[int] = []
    app = _langgraph_app(saver, ledger, ran)
    statements: list[str] = []
    counted = [0]

    def turn(i: int) -> None:
        if i == 1:  # (after the turn that warms up)
            conn.set_trace_callback(statements.append)
            counted[0] = 0 if store is None else store.commits
        done = app.invoke({"messages": [("user", "pay 7")]},
                          {"configurable": {"thread_id": f"t{i}"}}, durability="sync")
        if done["messages"][-1].content != "paid 7" or ran != [7] * (i + 1):
            raise RuntimeError(f"{mode}: the turn went wrong: ran {ran}")

    times: list[float] = []
    cpus: list[float] = []
    yield from _timed(turns, turn, times, cpus)
    conn.set_trace_callback(None)
    conn.close()
    ours = 0 if store is None else store.commits - counted[0]
    if store is not None:
        store.close()
    commits = sum(1 for q in statements if q.lstrip().upper().startswith("COMMIT"))
    return _figures((commits + ours) / turns, times, cpus)


def _langgraph_pg(dsn: str, schema: str, turns: int) -> dict[str, Any]:
    """`LANGGRAPH_PG`: the server's WAL flushes per turn (the turn that warms up
    counted too, as `bench.durable_rows` counts PostgreSQL)."""
    import psycopg
    from langgraph.checkpoint.postgres import PostgresSaver
    from psycopg.rows import dict_row

    from statemachine.adapters.langgraph import OneWriterSaver, ToolLedger
    from statemachine.postgres import PostgresEventStore

    _counting_from(dsn, schema)  # the store's tables made, by a connection that ends
    setup = psycopg.connect(dsn, autocommit=True, prepare_threshold=0, row_factory=dict_row,
                            options=f"-c search_path={schema}")
    PostgresSaver(setup).setup()  # (its tables made by a connection that then ends)
    ended = [setup.info.backend_pid]
    setup.close()
    syncs = _wal_syncs(dsn, ended)
    conn = psycopg.connect(dsn, autocommit=True, prepare_threshold=0, row_factory=dict_row,
                           options=f"-c search_path={schema}")
    store = PostgresEventStore(dsn, schema=schema)
    ledger = ToolLedger(store)
    ran: list[int] = []
    app = _langgraph_app(OneWriterSaver(PostgresSaver(conn), ledger=ledger), ledger, ran)

    def turn(i: int) -> None:
        done = app.invoke({"messages": [("user", "pay 7")]},
                          {"configurable": {"thread_id": f"t{i}"}}, durability="sync")
        if done["messages"][-1].content != "paid 7" or ran != [7] * (i + 1):
            raise RuntimeError(f"{LANGGRAPH_PG}: the turn went wrong: ran {ran}")

    times: list[float] = []
    cpus: list[float] = []
    for _ in _timed(turns, turn, times, cpus):
        pass
    ended = [conn.info.backend_pid, *_pid(store)]
    conn.close()
    store.close()
    return _figures((_wal_syncs(dsn, ended) - syncs) / (turns + 1), times, cpus)


def _modes(modes: Sequence[str], steps: Callable[[Path, str, int], Steps],
           turns: int) -> dict[str, Any]:
    """A framework's configurations, each in a folder of its own: the first (the
    framework alone) and the last (through the ledger with its publications), which the
    CPU verdict compares, turn by turn in turn (a slow while falls on both); the ones
    between on their own."""
    found: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as folder:
        places = [Path(folder) / f"mode-{index}" for index in range(len(modes))]
        for place in places:
            place.mkdir()
        found[modes[0]], found[modes[-1]] = _side_by_side(
            steps(places[0], modes[0], turns), steps(places[-1], modes[-1], turns))
        for mode, place in zip(modes[1:-1], places[1:-1], strict=True):
            found[mode] = _side_by_side(steps(place, mode, turns))[0]
    return {mode: found[mode] for mode in modes}  # (in their order)


def langgraph_row(args: Any = None) -> dict[str, Any]:
    """The durable turn through the LangGraph adapter beside LangGraph alone (see the
    module's docstring). ImportError without LangGraph."""
    if getattr(args, "quick", False):  # (--quick has 20 s for every row)
        return {"skipped": QUICK}
    import langgraph.checkpoint.sqlite  # noqa: F401

    turns = min(_turns(args), MOST_TURNS)
    rows = _modes(LANGGRAPH_MODES, _langgraph_steps, turns)
    with _server(args) as (dsn, schema, skipped):
        if dsn is None:
            rows[LANGGRAPH_PG] = {"skipped": skipped}
        else:
            with schema() as name:
                rows[LANGGRAPH_PG] = _langgraph_pg(dsn, name, turns)
    return _row(rows, LANGGRAPH_MODES[0], LANGGRAPH_MODES[-1], "LangGraph")


# ------------------------------------------------------------------------ Google ADK

ADK_MODES = ("ADK alone, SqliteSessionService",
             "LedgerPlugin, the service behind OneWriterSessionService",
             "LedgerPlugin, the session appends as its publications")


def _adk_parts() -> tuple[type, Callable[..., Any]]:
    """A scripted ``BaseLlm`` (a call of ``pay`` until the conversation holds its
    response, then the answer) and the session service counting its transactions."""
    from google.adk.models.base_llm import BaseLlm
    from google.adk.models.llm_request import LlmRequest
    from google.adk.models.llm_response import LlmResponse
    from google.adk.sessions.sqlite_session_service import SqliteSessionService
    from google.genai import types

    class Scripted(BaseLlm):
        model: str = "scripted"

        async def generate_content_async(self, llm_request: LlmRequest, stream: bool = False
                                         ) -> AsyncGenerator[LlmResponse, None]:
            answered = any(part.function_response for content in llm_request.contents
                           for part in content.parts or ())
            part = (types.Part(text="paid 7") if answered else types.Part(
                function_call=types.FunctionCall(id="p1", name="pay", args={"amount": 7})))
            yield LlmResponse(  # (with its usage, as a model reports it)
                content=types.Content(role="model", parts=[part]),
                usage_metadata=types.GenerateContentResponseUsageMetadata(
                    prompt_token_count=1, candidates_token_count=1, total_token_count=2))

    def counted(path: Path, commits: list[int]) -> Any:
        class Counted(SqliteSessionService):
            async def create_session(self, **options: Any) -> Any:
                made = await super().create_session(**options)
                commits[0] += 1
                return made

            async def append_event(self, session: Any, event: Any) -> Any:
                appended = await super().append_event(session, event)
                if not event.partial:  # (a partial event is not stored)
                    commits[0] += 1
                return appended

        return Counted(str(path))

    return Scripted, counted


def _adk_steps(folder: Path, mode: str, turns: int) -> Steps:
    """``turns`` turns in ``mode`` (and one that warms up), one per step: the figures."""
    from google.adk.agents import LlmAgent
    from google.adk.apps import App
    from google.adk.runners import Runner
    from google.adk.tools.function_tool import FunctionTool
    from google.genai import types

    from statemachine.adapters.google_adk import (
        LedgerPlugin,
        OneWriterSessionService,
        run_async,
    )
    from statemachine.stores import SQLiteEventStore

    scripted, counted = _adk_parts()
    ran: list[int] = []

    def pay(amount: int) -> dict[str, Any]:
        """Pay the amount."""
        ran.append(amount)
        return {"paid": amount}

    commits = [0]
    service: Any = counted(folder / "sessions.db", commits)
    store = None if mode == ADK_MODES[0] else SQLiteEventStore(folder / "events.db")
    plugins: list[Any] = []
    if store is not None:
        plugin = LedgerPlugin(store)
        plugins.append(plugin)
        service = OneWriterSessionService(
            service, plugin=plugin if mode == ADK_MODES[2] else None)
    agent = LlmAgent(name="payer", model=scripted(), tools=[FunctionTool(pay)])
    runner = Runner(app=App(name="bench", root_agent=agent, plugins=plugins),
                    session_service=service)
    message = types.Content(role="user", parts=[types.Part(text="pay 7")])
    counted_from = [0, 0]

    async def go(i: int) -> None:
        await service.create_session(app_name="bench", user_id="u", session_id=f"s{i}")
        events = [event async for event in run_async(
            runner, user_id="u", session_id=f"s{i}", new_message=message)]
        last = events[-1].content.parts[0].text if events else None
        if last != "paid 7" or ran != [7] * (i + 1):
            raise RuntimeError(f"{mode}: the turn went wrong: {last!r}, ran {ran}")

    def turn(i: int) -> None:
        if i == 1:
            counted_from[:] = [commits[0], 0 if store is None else store.commits]
        asyncio.run(go(i))

    times: list[float] = []
    cpus: list[float] = []
    yield from _timed(turns, turn, times, cpus)
    ours = 0 if store is None else store.commits - counted_from[1]
    if store is not None:
        store.close()
    return _figures((commits[0] - counted_from[0] + ours) / turns, times, cpus)


def google_adk_row(args: Any = None) -> dict[str, Any]:
    """The durable turn through the Google ADK adapter beside ADK alone (see the
    module's docstring). ImportError without ADK."""
    if getattr(args, "quick", False):  # (ADK's import alone takes a tenth of --quick's time)
        return {"skipped": QUICK}
    import google.adk  # noqa: F401

    turns = min(_turns(args), MOST_TURNS)
    rows = _modes(ADK_MODES, _adk_steps, turns)
    rows["PostgreSQL"] = {"skipped": "skipped: ADK's session service on PostgreSQL needs "
                                     "an async SQLAlchemy driver the extras do not install"}
    return _row(rows, ADK_MODES[0], ADK_MODES[-1], "ADK")


if __name__ == "__main__":
    print(json.dumps({"langgraph": langgraph_row(), "google_adk": google_adk_row()},
                     indent=2))
