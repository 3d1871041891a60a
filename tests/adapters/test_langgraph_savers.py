"""`OneWriterSaver` and the ledger's wait for a step's checkpoint write, on LangGraph's
async savers and with the write failing or cancelled. The savers are LangGraph's own
(``AsyncSqliteSaver`` and ``SqliteSaver`` on a file, ``AsyncPostgresSaver`` on the
PostgreSQL of the ``pg_dsn`` fixture); the model is the scripted chat model
of tests/drivers/langgraph_driver.py and what ran is counted from its fsynced effects file.

* ``AsyncSqliteSaver`` and ``AsyncPostgresSaver`` run their sync methods by handing a
  coroutine to their event loop from another thread: a step that waits for its
  checkpoint write (on a node with a timeout policy too) must never hold a lock the loop
  needs meanwhile. A hang fails the test (a watchdog thread), it is never waited out.
* The checkpoint write the tools' step runs from raises: that error reaches the caller as
  itself (I6), never retyped as a refusal, and no tool runs.
* The write a step waits for is cancelled (by LangGraph), or the call waiting for it is:
  a cancelled write is refused (`ConcurrencyConflict`, nothing ran); a cancelled waiter
  leaves LangGraph's write alone and nothing recorded.

Under CI a missing ``langgraph`` package fails this module instead of skipping it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import os
import sqlite3
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

try:
    import langgraph  # noqa: F401
except ImportError:  # pragma: no cover - CI installs the extra
    if os.environ.get("CI"):
        raise
    pytest.skip("langgraph is not installed (pip install -e '.[langgraph]')",
                allow_module_level=True)

from langchain_core.messages import AIMessage, HumanMessage
from langgraph.checkpoint.base import empty_checkpoint
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition
from langgraph.types import Command, TimeoutPolicy

from statemachine import ConcurrencyConflict, SQLiteEventStore
from statemachine.adapters import langgraph as adapter
from statemachine.adapters.langgraph import (
    OneWriterSaver,
    ToolLedger,
    UnsupportedFeature,
    decision,
)
from tests.drivers.langgraph_driver import ScriptedModel, effects, make_tools

CONFIG: Any = {"configurable": {"thread_id": "t1"}}
RUN = "langgraph:t1"
HANG = 120.0
"""How long the watchdog lets a graph run before it calls it hung (a generous bound: the
runs here take well under a second; a hang is the failure, not a slow run)."""


def _unhung(make: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    """Run ``make()`` on an event loop of its own in a daemon thread and return what it
    returns (raise what it raises); fail when it has not ended after `HANG` seconds (a
    deadlock blocks the loop itself, so no timeout inside the loop could fire)."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = asyncio.run(make())
        except BaseException as error:  # handed to the test's thread
            outcome["error"] = error

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(HANG)
    if worker.is_alive():
        pytest.fail(f"the graph hung: not done after {HANG:g} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _graph(model: ScriptedModel, ledger: ToolLedger, path: Path, checkpointer: Any, *,
           timeout: TimeoutPolicy | None, review: bool = False,
           handling: Any = None) -> Any:
    """``model → [review →] tools → model`` with the ledger's tool node (``timeout``:
    LangGraph's timeout policy on the tool node; ``handling``: its
    ``handle_tool_errors``, None for LangGraph's default)."""
    options = {} if handling is None else {"handle_tool_errors": handling}
    builder: Any = StateGraph(MessagesState)
    builder.add_node("model", lambda state: {"messages": [model.invoke(state["messages"])]})
    builder.add_node("tools", ledger.tool_node(make_tools(path), **options),
                     timeout=timeout)
    builder.add_edge(START, "model")
    if review:
        builder.add_node("review", ledger.review)
        builder.add_conditional_edges("model", tools_condition, {"tools": "review",
                                                                 "__end__": "__end__"})
        builder.add_edge("review", "tools")
    else:
        builder.add_conditional_edges("model", tools_condition)
    builder.add_edge("tools", "model")
    return builder.compile(checkpointer=checkpointer)


TIMEOUTS = [None, TimeoutPolicy(run_timeout=HANG)]
"""No timeout policy on the tool node, and one that never fires here (a node with a
policy runs under LangGraph's guard, which hides the write in flight from the step)."""


@contextlib.asynccontextmanager
async def _async_saver(kind: str, tmp_path: Path, pg: tuple[str, str] | None
                       ) -> AsyncIterator[Any]:
    """LangGraph's ``AsyncSqliteSaver`` on a file, or its ``AsyncPostgresSaver`` on one
    connection (``pg``: the DSN and a schema of its own)."""
    if kind == "sqlite":
        async with AsyncSqliteSaver.from_conn_string(str(tmp_path / "graph.db")) as saver:
            yield saver
        return
    import psycopg
    from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
    from psycopg.rows import dict_row

    assert pg is not None
    dsn, schema = pg
    async with await psycopg.AsyncConnection.connect(
            dsn, autocommit=True, prepare_threshold=0, row_factory=dict_row) as conn:
        await conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
        await conn.execute(f'SET search_path TO "{schema}"')
        on_pg = AsyncPostgresSaver(cast("Any", conn))
        await on_pg.setup()
        yield on_pg


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
@pytest.mark.parametrize("timeout", TIMEOUTS, ids=["plain", "timeout-policy"])
def test_an_async_saver_runs_a_step_and_a_resume_without_hanging(
        tmp_path: Path, timeout: TimeoutPolicy | None, kind: str,
        request: pytest.FixtureRequest) -> None:
    """On LangGraph's ``AsyncSqliteSaver`` (a file) and ``AsyncPostgresSaver`` through
    `OneWriterSaver`: a turn that pauses for the charge's approval, the resume that
    approves it, a notify without approval, then the answer. What the script says must
    run, runs once each, and the graph ends (before: with a timeout policy the step's
    check held the saver's lock while the saver's read waited for the event loop, which
    waited for that lock: a hang)."""
    path = tmp_path / "effects.txt"
    script: list[Any] = [[("charge", {"amount": 7}, "c1")], [("notify", {"to": "ops"}, "n1")],
                         "done"]
    pg = None if kind == "sqlite" else (request.getfixturevalue("pg_dsn"),
                                        request.getfixturevalue("pg_schema"))

    async def go() -> tuple[list[str], str, str]:
        async with _async_saver(kind, tmp_path, pg) as inner:
            ledger = ToolLedger(SQLiteEventStore(str(tmp_path / "ledger.db")),
                                approvals=["charge"])
            graph = _graph(ScriptedModel(script=script), ledger, path,
                           OneWriterSaver(inner), timeout=timeout, review=True)
            paused = await graph.ainvoke({"messages": [HumanMessage("go")]}, CONFIG)
            (asked,) = paused["__interrupt__"]
            (shown,) = asked.value["pending"]
            ran_before = list(effects(path))
            done = await graph.ainvoke(Command(resume={shown["call_id"]: decision(
                "approve", shown["fingerprint"])}), CONFIG)
            return ran_before, shown["call_id"], done["messages"][-1].content

    ran_before, call_id, answer = _unhung(go)
    assert (ran_before, call_id, answer) == ([], "c1", "done")
    assert effects(path) == ["charge 7", "notify ops"]


class DiskFull(OSError):
    """The error the saver raises for the step's checkpoint write."""


def _proposes_calls(checkpoint: Any) -> bool:
    """Whether ``checkpoint`` is the one the tools' step runs from: its last message is
    the model's reply with tool calls."""
    messages = (checkpoint.get("channel_values") or {}).get("messages") or []
    return bool(messages) and isinstance(messages[-1], AIMessage) and bool(
        messages[-1].tool_calls)


def _first(checkpoint: Any, written: list[Any]) -> bool:
    """Whether ``checkpoint`` is the thread's first (the input's): none written before."""
    return not written


FAILING = {"its-own": lambda checkpoint, written: _proposes_calls(checkpoint),
           "an-earlier": _first}
"""Which write raises: the one of the checkpoint the tools' step runs from, or an
earlier one (the first), after which LangGraph makes none of the thread's writes."""


def _every_error(error: Exception) -> str:
    """A tool node's ``handle_tool_errors`` that would make a message of any error."""
    return f"caught {error!r}"


HANDLING: dict[str, Any] = {"default": None, "every-error": _every_error}
"""The tool node's ``handle_tool_errors``: LangGraph's default, or one that handles every
error (the write's error is not the tool's: it must not become a message)."""


@pytest.mark.invariant("I6")
@pytest.mark.parametrize("failing", sorted(FAILING))
@pytest.mark.parametrize("handling", sorted(HANDLING))
@pytest.mark.parametrize("timeout", TIMEOUTS, ids=["plain", "timeout-policy"])
def test_a_failed_write_of_the_steps_checkpoint_reaches_the_caller_as_itself_async(
        tmp_path: Path, timeout: TimeoutPolicy | None, handling: str, failing: str) -> None:
    """``AsyncSqliteSaver``'s write of the checkpoint the tools' step runs from, or an
    earlier one, raises (LangGraph's default durability writes it while the tools' step
    starts): the caller gets that error, the same object, and the charge never ran, with
    a tool node that handles every error too, which never makes a message of it (a
    consumer of the stream would see one) (before: with a timeout policy the step's
    tool call refused with `ConcurrencyConflict`, the write's own error retyped, or after
    a wait of 60 s for a write LangGraph never makes)."""
    path = tmp_path / "effects.txt"
    raised = DiskFull("injected: the disk is full")

    async def go() -> tuple[list[str], BaseException | None]:
        async with AsyncSqliteSaver.from_conn_string(str(tmp_path / "graph.db")) as inner:
            write, fails = inner.aput, FAILING[failing]
            written: list[Any] = []

            async def put(config: Any, checkpoint: Any, *rest: Any) -> Any:
                if fails(checkpoint, written):
                    raise raised
                written.append(checkpoint["id"])
                return await write(config, checkpoint, *rest)

            inner.aput = put  # type: ignore[method-assign, assignment]
            ledger = ToolLedger(SQLiteEventStore(str(tmp_path / "ledger.db")))
            graph = _graph(ScriptedModel(script=[[("charge", {"amount": 7}, "c1")], "done"]),
                           ledger, path, OneWriterSaver(inner), timeout=timeout,
                           handling=HANDLING[handling])
            updated: list[str] = []  # the nodes whose updates a consumer saw
            try:
                async for update in graph.astream({"messages": [HumanMessage("go")]},
                                                  CONFIG, stream_mode="updates"):
                    updated.extend(update)
            except BaseException as error:
                return updated, error
            return updated, None

    updated, error = _unhung(go)
    assert error is raised
    assert updated == ["model"]  # no tool message made of the write's error
    assert effects(path) == []


@pytest.mark.invariant("I6")
@pytest.mark.parametrize("handling", sorted(HANDLING))
def test_a_failed_write_of_the_steps_checkpoint_reaches_the_caller_as_itself_sync(
        tmp_path: Path, handling: str) -> None:
    """The same through ``invoke`` on LangGraph's ``SqliteSaver``: the write's own error,
    the same object, and nothing ran."""
    path = tmp_path / "effects.txt"
    raised = DiskFull("injected: the disk is full")
    with SqliteSaver.from_conn_string(str(tmp_path / "graph.db")) as inner:
        write = inner.put

        def failing(config: Any, checkpoint: Any, *rest: Any) -> Any:
            if _proposes_calls(checkpoint):
                raise raised
            return write(config, checkpoint, *rest)

        inner.put = failing  # type: ignore[method-assign, assignment]
        ledger = ToolLedger(SQLiteEventStore(str(tmp_path / "ledger.db")))
        graph = _graph(ScriptedModel(script=[[("charge", {"amount": 7}, "c1")], "done"]),
                       ledger, path, OneWriterSaver(inner), timeout=None,
                       handling=HANDLING[handling])
        with pytest.raises(DiskFull) as caught:
            graph.invoke({"messages": [HumanMessage("go")]}, CONFIG)
    assert caught.value is raised
    assert effects(path) == []


@pytest.mark.invariant("I6")
def test_check_step_raises_a_failed_writes_own_error(tmp_path: Path) -> None:
    """`OneWriterSaver.check_step` (and `acheck_step`) asked about a checkpoint whose
    write this saver saw fail: that write's error, the same object, at once (before: a
    `ConcurrencyConflict` saying the write was refused or failed)."""
    inner = InMemorySaver()
    saver = OneWriterSaver(inner)
    builder: Any = StateGraph(MessagesState)
    builder.add_node("step", lambda state: {"messages": []})
    builder.add_edge(START, "step")
    graph = builder.compile(checkpointer=saver)
    graph.invoke({"messages": [HumanMessage("go")]}, CONFIG)
    raised = DiskFull("injected: the disk is full")

    def failing(*args: Any) -> Any:
        raise raised

    inner.put = failing  # type: ignore[method-assign, assignment]
    with pytest.raises(DiskFull) as caught:
        graph.update_state(graph.get_state(CONFIG).config, {"messages": []})
    assert caught.value is raised
    (failed,) = [key for key, error in saver._outcomes.items() if error is not None]
    with pytest.raises(DiskFull) as again:
        saver.check_step("t1", failed[2], timeout=HANG)
    assert again.value is raised
    with pytest.raises(DiskFull) as anew:
        asyncio.run(saver.acheck_step("t1", failed[2], timeout=HANG))
    assert anew.value is raised


@pytest.mark.invariant("I6")
@pytest.mark.parametrize("ledgered", [False, True])
def test_a_write_that_cannot_take_the_files_lock_is_heard_by_check_step_at_once(
        tmp_path: Path, ledgered: bool) -> None:
    """Another connection holds the checkpoints' file's write lock past the saver's busy
    timeout: `OneWriterSaver.put` raises SQLite's error before it writes anything, and
    `check_step` asked about that checkpoint raises the same object at once (before: the
    put never said how it ended, and the step waited out its timeout for a write that
    had failed, then was refused with `ConcurrencyConflict`)."""
    path = tmp_path / "graph.db"
    SqliteSaver(sqlite3.connect(str(path))).setup()
    ledger = ToolLedger(SQLiteEventStore(str(tmp_path / "ledger.db"))) if ledgered else None
    conn = sqlite3.connect(str(path), timeout=0.05, check_same_thread=False)
    saver = OneWriterSaver(SqliteSaver(conn), ledger=ledger)
    checkpoint = empty_checkpoint()
    holder = sqlite3.connect(str(path), isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(sqlite3.OperationalError) as raised:
            saver.put({"configurable": {"thread_id": "t1", "checkpoint_ns": ""}},
                      checkpoint, {}, {})
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert not conn.in_transaction
    with pytest.raises(sqlite3.OperationalError) as heard:
        saver.check_step("t1", checkpoint["id"], timeout=1)
    assert heard.value is raised.value


def test_a_sync_wrapper_on_the_async_path_is_refused_before_anything_runs(
        tmp_path: Path) -> None:
    """A ``ToolNode`` given only the ledger's sync ``wrap_tool_call``, run with
    ``ainvoke`` on ``AsyncSqliteSaver`` through `OneWriterSaver`: LangGraph calls the
    wrapper on the event loop's thread, where waiting for the step's write (the loop makes
    it) would block the loop. Refused, naming the feature, before the charge runs (before:
    the saver's sync read on its own loop's thread raised ``InvalidStateError``, or, on
    another async saver, the loop blocked for 60 s); the same graph with
    ``awrap_tool_call`` too charges once."""
    path = tmp_path / "effects.txt"
    script: list[Any] = [[("charge", {"amount": 7}, "c1")], "done"]

    async def go(wrappers: dict[str, Any], thread: str) -> Any:
        async with AsyncSqliteSaver.from_conn_string(str(tmp_path / "graph.db")) as inner:
            model = ScriptedModel(script=script)
            builder: Any = StateGraph(MessagesState)
            builder.add_node("model",
                             lambda state: {"messages": [model.invoke(state["messages"])]})
            builder.add_node("tools", ToolNode(make_tools(path), **wrappers))
            builder.add_edge(START, "model")
            builder.add_conditional_edges("model", tools_condition)
            builder.add_edge("tools", "model")
            graph = builder.compile(checkpointer=OneWriterSaver(inner))
            try:
                done = await graph.ainvoke({"messages": [HumanMessage("go")]},
                                           {"configurable": {"thread_id": thread}})
            except Exception as error:
                return error
            return done["messages"][-1].content

    ledger = ToolLedger(SQLiteEventStore(str(tmp_path / "ledger.db")))
    refused = _unhung(lambda: go({"wrap_tool_call": ledger.wrap_tool_call}, "t1"))
    assert isinstance(refused, UnsupportedFeature), refused
    assert refused.feature == "a sync tool-call wrapper on the async path with OneWriterSaver"
    assert effects(path) == []
    assert _unhung(lambda: go({"wrap_tool_call": ledger.wrap_tool_call,
                               "awrap_tool_call": ledger.awrap_tool_call}, "t2")) == "done"
    assert effects(path) == ["charge 7"]


# ------------------------------------------------- a write in flight, cancelled


class _Loop:
    """Stands for LangGraph's loop as a step's config reaches it (``schedule_task``'s
    owner holds the write in flight, ``_put_checkpoint_fut``)."""

    def __init__(self, pending: Any) -> None:
        self._put_checkpoint_fut = pending

    def schedule_task(self, *args: Any) -> None:  # pragma: no cover - never called
        raise AssertionError("not scheduled here")


def _request(saver: OneWriterSaver, pending: Any, step: str) -> Any:
    """A tool-call request of a step that runs from checkpoint ``step`` of thread t1, with
    ``pending`` the checkpoint write LangGraph has in flight (as langgraph 1.2 hands it)."""
    call = functools.partial(print, schedule_task=_Loop(pending).schedule_task)
    config = {"configurable": {"thread_id": "t1", "checkpoint_ns": "",
                               "checkpoint_map": {"": step}, "__pregel_checkpointer": saver,
                               "__pregel_call": call}}
    tool_call = {"name": "charge", "args": {"amount": 7}, "id": "c1", "type": "tool_call"}
    state = {"messages": [HumanMessage("go"), AIMessage(content="", tool_calls=[tool_call])]}
    return SimpleNamespace(tool_call=tool_call, state=state,
                           runtime=SimpleNamespace(config=config))


@pytest.mark.parametrize("kind", ["asyncio", "concurrent"])
def test_a_cancelled_write_in_flight_is_refused_and_nothing_runs(
        tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checkpoint write a step waits for was cancelled (it never lands): the step's
    call is refused (`ConcurrencyConflict`), its body never runs and the ledger holds
    nothing of it (before: the write's cancellation came out of the call as if the call
    itself had been cancelled)."""
    monkeypatch.setattr(adapter, "_check_placement", lambda handler, ledger: None)
    ledger = ToolLedger(SQLiteEventStore(str(tmp_path / "ledger.db")))
    saver = OneWriterSaver(InMemorySaver())
    ran: list[Any] = []  # (the body stands for the tool node's own: placement unchecked)

    async def body(request: Any) -> Any:  # pragma: no cover - must not run
        ran.append(request)

    async def go() -> BaseException | None:
        pending: Any = (asyncio.get_running_loop().create_future() if kind == "asyncio"
                        else concurrent.futures.Future())
        pending.cancel()
        try:
            await ledger.awrap_tool_call(_request(saver, pending, "cp-1"), body)
        except BaseException as error:
            return error
        return None

    refused = _unhung(go)
    assert isinstance(refused, ConcurrencyConflict), refused
    assert ran == []
    assert ledger.controller(RUN).phase("c1") is None


@pytest.mark.parametrize("kind", ["asyncio", "concurrent"])
def test_a_cancelled_call_waiting_for_its_write_leaves_the_write_alone(
        tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tool call cancelled (a timeout policy firing) while it waits for its step's
    checkpoint write: the cancellation is its own (`asyncio.CancelledError`), LangGraph's
    write is not cancelled with it (it still lands), and nothing of the call is recorded
    (before: waiting on a write LangGraph runs in a thread cancelled that write)."""
    monkeypatch.setattr(adapter, "_check_placement", lambda handler, ledger: None)
    ledger = ToolLedger(SQLiteEventStore(str(tmp_path / "ledger.db")))
    saver = OneWriterSaver(InMemorySaver())
    ran: list[Any] = []  # (the body stands for the tool node's own: placement unchecked)

    async def body(request: Any) -> Any:  # pragma: no cover - must not run
        ran.append(request)

    async def go() -> tuple[bool, bool]:
        pending: Any = (asyncio.get_running_loop().create_future() if kind == "asyncio"
                        else concurrent.futures.Future())
        call = asyncio.ensure_future(ledger.awrap_tool_call(
            _request(saver, pending, "cp-1"), body))
        for _ in range(20):  # let it reach its wait
            await asyncio.sleep(0)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        return pending.cancelled(), call.cancelled()

    write_cancelled, call_cancelled = _unhung(go)
    assert (write_cancelled, call_cancelled) == (False, True)
    assert ran == []
    assert ledger.controller(RUN).phase("c1") is None
