"""The LangGraph / LangChain adapter (DESIGN §7.4, issue 29), in one process: each field
report run on LangGraph alone and through the adapter, the same graph, a scripted chat
model, tools that append a line to an fsynced file. What ran is counted from that file;
the expected count is what the scenario says must happen (a rejected call never runs, an
approved one runs once), never what a ledger recorded.

The kill -9 rows and the two resumer processes are in test_langgraph_durability.py.
Under CI a missing ``langgraph`` package fails this module instead of skipping it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import sqlite3
import threading
from pathlib import Path
from typing import Annotated, Any, cast

import pytest

try:
    import langgraph  # noqa: F401
except ImportError:  # pragma: no cover - CI installs the extra
    if os.environ.get("CI"):
        raise
    pytest.skip("langgraph is not installed (pip install -e '.[langgraph]')",
                allow_module_level=True)

from langchain.agents import create_agent
from langchain.agents.middleware import (
    AgentMiddleware,
    HumanInTheLoopMiddleware,
    ToolRetryMiddleware,
)
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import InjectedToolCallId, tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.errors import GraphInterrupt
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition
from langgraph.runtime import Runtime
from langgraph.types import Command, Send, interrupt

from statemachine import (
    ConcurrencyConflict,
    ControlError,
    InvalidTransition,
    Resolution,
    SQLiteEventStore,
    StorageError,
    ToolCall,
    ToolInDoubt,
    operator,
    tool_context,
)
from statemachine.adapters import langgraph as adapter
from statemachine.adapters.langgraph import (
    LedgerMiddleware,
    OneWriterSaver,
    ToolLedger,
    UnsupportedFeature,
    decision,
)
from statemachine.errors import Outcome
from statemachine.stores import AsyncSQLiteEventStore
from statemachine.values import Phase, Step
from statemachine.verifiers import Completed, NotExecuted, Unknown
from tests.drivers.langgraph_driver import (
    FailingPut,
    ScriptedModel,
    build,
    effect,
    effects,
    make_tools,
)

CONFIG: Any = {"configurable": {"thread_id": "t1"}}
RUN = "langgraph:t1"


@pytest.fixture
def store(tmp_path: Path) -> SQLiteEventStore:
    return SQLiteEventStore(str(tmp_path / "ledger.db"))


def _pending(result: dict[str, Any]) -> dict[str, str]:
    """The fingerprints of the calls the ledger's review interrupt shows, by call id."""
    (asked,) = result["__interrupt__"]
    return {item["call_id"]: item["fingerprint"] for item in asked.value["pending"]}


def _tool_messages(result: dict[str, Any]) -> list[tuple[str, Any]]:
    return [(m.tool_call_id, m.content) for m in result["messages"]
            if isinstance(m, ToolMessage)]


# ------------------------------------------------------------ the field reports


TWO = [[("charge", {"amount": 7}, "c1"), ("notify", {"to": "bob"}, "n1")], "done"]


def _hitl_graph(path: Path, script: list[Any]) -> Any:
    """LangGraph alone with the components of langchain #37093: a model node, LangChain's
    ``HumanInTheLoopMiddleware`` (batched, every decision allowed) as the review node
    after it, and LangGraph's ``ToolNode``."""
    model = ScriptedModel(script=script)
    hitl = HumanInTheLoopMiddleware(interrupt_on={"charge": True, "notify": True})

    def review(state: MessagesState, runtime: Runtime) -> Any:
        return hitl.after_model(cast("Any", state), runtime)

    builder: Any = StateGraph(MessagesState)
    builder.add_node("model", lambda state: {"messages": [model.invoke(state["messages"])]})
    builder.add_node("review", review)
    builder.add_node("tools", ToolNode(make_tools(path)))
    builder.add_edge(START, "model")
    builder.add_conditional_edges("model", tools_condition, {"tools": "review", END: END})
    builder.add_edge("review", "tools")
    builder.add_edge("tools", "model")
    return builder.compile(checkpointer=InMemorySaver())


def _answers(messages: list[Any]) -> dict[str, int]:
    """How many ToolMessages answer each tool call of the thread's AIMessages (a provider
    takes a thread only when every call has exactly one)."""
    calls = [str(call["id"]) for m in messages if isinstance(m, AIMessage)
             for call in m.tool_calls]
    return {call_id: sum(isinstance(m, ToolMessage) and m.tool_call_id == call_id
                         for m in messages) for call_id in calls}


@pytest.mark.invariant("I1")
def test_a_rejected_call_runs_on_langgraph_alone_and_never_through_the_ledger(
        tmp_path: Path, store: SQLiteEventStore) -> None:
    """langchain #37093: HumanInTheLoopMiddleware answers a rejected call with a
    ToolMessage but leaves it on the AIMessage, and LangGraph's ToolNode runs every call
    of the AIMessage: approve charge, reject notify, and the rejected notify runs
    (langchain 1.5.2 still does), its call answered twice. Through the ledger it never
    runs, and every call of the batch is answered exactly once."""
    alone = tmp_path / "alone.txt"
    graph = _hitl_graph(alone, TWO)
    graph.invoke({"messages": [HumanMessage("go")]}, CONFIG)
    result = graph.invoke(Command(resume={"decisions": [
        {"type": "approve"}, {"type": "reject", "message": "not bob"}]}), CONFIG)
    assert sorted(effects(alone)) == ["charge 7", "notify bob"]  # the rejected one ran
    assert _answers(result["messages"]) == {"c1": 1, "n1": 2}

    through = tmp_path / "ledger.txt"
    ledger = ToolLedger(store, approvals=["charge", "notify"])
    graph = build("ledger", make_tools(through), ScriptedModel(script=TWO),
                  OneWriterSaver(InMemorySaver()), ledger=ledger, review=True)
    prints = _pending(graph.invoke({"messages": [HumanMessage("go")]}, CONFIG))
    result = graph.invoke(Command(resume={
        "c1": decision("approve", prints["c1"]),
        "n1": decision("reject", prints["n1"], message="not bob")}), CONFIG)
    assert effects(through) == ["charge 7"]
    assert _tool_messages(result) == [("c1", "charged 7"), ("n1", "not bob")]
    assert _answers(result["messages"]) == {"c1": 1, "n1": 1}
    assert result["messages"][-1].content == "done"


THREE = [[("charge", {"amount": 7}, "c1"), ("charge", {"amount": 8}, "c2"),
          ("notify", {"to": "bob"}, "n1")], "done"]


@pytest.mark.invariant("I1")
def test_mixed_decisions_break_the_thread_alone_and_settle_every_call_through_the_ledger(
        tmp_path: Path, store: SQLiteEventStore) -> None:
    """langchainjs PR #11437: mixed decisions in one batch left a thread with a call no
    ToolMessage answers (JS dropped the approved calls on any rejection), which every
    later model request fails on. Python's HumanInTheLoopMiddleware keeps every call on
    the AIMessage (what the PR does for JS); with LangGraph's ToolNode the same mix
    (approve charge 7, edit charge 8 to 8000, reject notify) still leaves a broken thread:
    the rejected call runs and is answered twice (rejected, and its result), and the edit
    runs the model's arguments (its edit lives in the middleware's own tool wrapper,
    which a ToolNode does not have). Through the ledger every call is settled: the
    approved one runs once, the edit is a new call that runs once with its own approval,
    the rejected one never runs, every call of the thread is answered exactly once, and
    no call of the ledger is left approved, awaiting or in doubt."""
    alone = tmp_path / "alone.txt"
    graph = _hitl_graph(alone, THREE)
    graph.invoke({"messages": [HumanMessage("go")]}, CONFIG)
    result = graph.invoke(Command(resume={"decisions": [
        {"type": "approve"},
        {"type": "edit", "edited_action": {"name": "charge", "args": {"amount": 8000}}},
        {"type": "reject", "message": "not bob"}]}), CONFIG)
    assert sorted(effects(alone)) == ["charge 7", "charge 8", "notify bob"]
    assert _answers(result["messages"]) == {"c1": 1, "c2": 1, "n1": 2}

    through = tmp_path / "ledger.txt"
    ledger = ToolLedger(store, approvals=["charge", "notify"])
    agent: Any = create_agent(ScriptedModel(script=THREE), make_tools(through),
                              middleware=[LedgerMiddleware(ledger)],
                              checkpointer=OneWriterSaver(InMemorySaver(), ledger=ledger))
    prints = _pending(agent.invoke({"messages": [HumanMessage("go")]}, CONFIG))
    edited = _pending(agent.invoke(Command(resume={
        "c1": decision("approve", prints["c1"]),
        "c2": decision("edit", prints["c2"], args={"amount": 8000}),
        "n1": decision("reject", prints["n1"], message="not bob")}), CONFIG))
    assert list(edited) == ["c2-edit1"]  # the edit awaits its own approval
    assert effects(through) == []
    result = agent.invoke(Command(resume={
        "c2-edit1": decision("approve", edited["c2-edit1"])}), CONFIG)
    assert sorted(effects(through)) == ["charge 7", "charge 8000"]
    answers = _answers(result["messages"])
    assert set(answers.values()) == {1}
    assert sorted(answers) == ["c1-edit1", "c2-edit1", "n1"]
    assert dict(_tool_messages(result))["n1"] == "not bob"
    assert result["messages"][-1].content == "done"
    c = ToolLedger(store).controller(RUN)
    assert {view.call.call_id: view.phase for view in c.calls} == {
        "c1": Phase.SKIPPED, "c2": Phase.PUBLISHED, "n1": Phase.PUBLISHED,
        "c1-edit1": Phase.PUBLISHED, "c2-edit1": Phase.PUBLISHED}


@pytest.mark.invariant("I1")
def test_an_edit_runs_unapproved_on_langgraph_alone_and_awaits_its_own_approval(
        tmp_path: Path, store: SQLiteEventStore) -> None:
    """An edit on LangChain's HumanInTheLoopMiddleware runs the edited arguments with no
    approval of them; through the ledger the edit is a new call with its own fingerprint,
    a resume carrying the old one is refused (nothing recorded), and it runs once
    approved."""
    script = [[("charge", {"amount": 7}, "c1")], "done"]
    alone = tmp_path / "alone.txt"
    agent: Any = create_agent(ScriptedModel(script=script), make_tools(alone),
                              middleware=[HumanInTheLoopMiddleware(
                                  interrupt_on={"charge": True})],
                              checkpointer=InMemorySaver())
    agent.invoke({"messages": [HumanMessage("go")]}, CONFIG)
    agent.invoke(Command(resume={"decisions": [{"type": "edit", "edited_action": {
        "name": "charge", "args": {"amount": 7000}}}]}), CONFIG)
    assert effects(alone) == ["charge 7000"]  # never approved with these arguments

    through = tmp_path / "ledger.txt"
    ledger = ToolLedger(store, approvals=["charge"])
    agent = create_agent(ScriptedModel(script=script), make_tools(through),
                         middleware=[LedgerMiddleware(ledger)],
                         checkpointer=OneWriterSaver(InMemorySaver()))
    first = _pending(agent.invoke({"messages": [HumanMessage("go")]}, CONFIG))
    edited = agent.invoke(Command(resume={"c1": decision("edit", first["c1"],
                                                         args={"amount": 7000})}), CONFIG)
    assert effects(through) == []
    (asked,) = edited["__interrupt__"]
    (item,) = asked.value["pending"]
    assert (item["call_id"], item["args"]) == ("c1-edit1", {"amount": 7000})
    assert item["fingerprint"] != first["c1"]
    stale = agent.invoke(Command(resume={"c1-edit1": decision("approve", first["c1"])}),
                         CONFIG)
    assert "fingerprint" in stale["__interrupt__"][0].value["refused"][0]
    assert effects(through) == []
    done = agent.invoke(Command(resume={"c1-edit1": decision("approve",
                                                             item["fingerprint"])}), CONFIG)
    assert effects(through) == ["charge 7000"]
    assert done["messages"][-1].content == "done"


def test_parallel_interrupts_in_one_toolnode_misroute_an_approval_alone(
        tmp_path: Path, store: SQLiteEventStore) -> None:
    """langgraph #6533: two async calls of one ToolNode that each ``interrupt()`` for
    approval raise interrupts with one id (langgraph 1.2 keys an interrupt's id by the
    task and by how many answers the task already has, not by the call), only one is
    shown, and a resume value goes to whichever call asks first when the node runs
    again. LangGraph alone, the reviewer answering only what it is shown (approve charge
    7, reject anything else): charge 7 is shown and approved twice, charge 8 is never
    shown, and runs twice on the answers meant for charge 7 (charge 7 asks second on each
    run after the first: #6533's tools of different speeds, made an order here). Through
    the ledger one review interrupt carries both calls, each with its id and
    fingerprint: the approved one runs once, the rejected one never."""
    path = tmp_path / "alone.txt"
    entered = {7: 0, 8: 0}

    @tool
    async def charge(amount: int) -> str:
        """Charge, once approved."""
        entered[amount] += 1
        if amount == 7 and entered[7] > 1:
            await eight_asked.wait()  # on each run after the first, charge 8 asks first
        try:
            answer = interrupt({"charge": amount})
        finally:
            if amount == 8:
                eight_asked.set()
        if answer != "approve":
            return "rejected"
        effect(path, f"charge {amount}")
        return f"charged {amount}"

    ids: list[tuple[str, str]] = []

    async def spy(request: Any, execute: Any) -> Any:
        """Notes the id of each call's interrupt (LangGraph alone: no ledger here)."""
        try:
            return await execute(request)
        except GraphInterrupt as asked:
            ids.append((request.tool_call["id"], asked.args[0][0].id))
            raise

    script = [[("charge", {"amount": 7}, "a"), ("charge", {"amount": 8}, "b")], "done"]
    model = ScriptedModel(script=script)
    builder: Any = StateGraph(MessagesState)
    builder.add_node("model", lambda state: {"messages": [model.invoke(state["messages"])]})
    builder.add_node("tools", ToolNode([charge], awrap_tool_call=spy))
    builder.add_edge(START, "model")
    builder.add_conditional_edges("model", tools_condition)
    builder.add_edge("tools", "model")
    graph = builder.compile(checkpointer=InMemorySaver())
    shown: list[int] = []

    async def review() -> None:
        result = await graph.ainvoke({"messages": [HumanMessage("go")]}, CONFIG)
        while result.get("__interrupt__"):
            (asked,) = result["__interrupt__"]
            shown.append(asked.value["charge"])
            eight_asked.clear()
            answer = "approve" if asked.value["charge"] == 7 else "reject"
            result = await graph.ainvoke(Command(resume={asked.id: answer}), CONFIG)

    eight_asked = asyncio.Event()
    asyncio.run(review())
    assert sorted(call for call, _ in ids[:2]) == ["a", "b"]
    assert len({interrupt_id for _, interrupt_id in ids[:2]}) == 1  # two calls, one id
    assert shown == [7, 7]  # charge 8 was never shown to the reviewer
    assert sorted(effects(path)) == ["charge 7", "charge 8", "charge 8"]

    through = tmp_path / "ledger.txt"
    ledger = ToolLedger(store, approvals=["charge"])
    graph = build("ledger", make_tools(through), ScriptedModel(script=script),
                  OneWriterSaver(InMemorySaver()), ledger=ledger, review=True)
    prints = _pending(graph.invoke({"messages": [HumanMessage("go")]}, CONFIG))
    assert sorted(prints) == ["a", "b"]
    result = graph.invoke(Command(resume={"a": decision("approve", prints["a"]),
                                          "b": decision("reject", prints["b"])}), CONFIG)
    assert effects(through) == ["charge 7"]
    assert [call_id for call_id, _ in _tool_messages(result)] == ["a", "b"]


LOOP = [[("charge", {"amount": n}, f"c{n}")] for n in (1, 2, 3)] + ["done"]


def _loop_graph(path: Path, checkpointer: Any, ledger: ToolLedger | None = None) -> Any:
    """One node that is the whole agent loop (model, approval, tools, again), as users
    write it around ``interrupt()``: each turn's calls are approved inside the loop,
    then run. Without ``ledger``: LangGraph's interrupt and ToolNode; with it: the
    ledger's review and tool node, called from the same loop."""
    model = ScriptedModel(script=LOOP)
    tools = make_tools(path)
    node = ToolNode(tools) if ledger is None else ledger.tool_node(tools)

    def agent(state: MessagesState) -> dict[str, Any]:
        messages = list(state["messages"])
        start = len(messages)
        while True:
            reply = model.invoke(messages)
            messages.append(reply)
            if not isinstance(reply, AIMessage) or not reply.tool_calls:
                return {"messages": messages[start:]}
            if ledger is None:
                decisions = interrupt({"calls": [call["id"] for call in reply.tool_calls]})
                assert set(decisions.values()) == {"approve"}
            else:
                ledger.review({"messages": messages})
            messages.extend(node.invoke({"messages": messages})["messages"])

    builder: Any = StateGraph(MessagesState)
    builder.add_node("agent", agent)
    builder.add_edge(START, "agent")
    builder.add_edge("agent", END)
    return builder.compile(checkpointer=checkpointer)


@pytest.mark.invariant("I1")
def test_interrupts_in_a_loop_rerun_every_earlier_approved_call_alone(
        tmp_path: Path, store: SQLiteEventStore) -> None:
    """langgraph #7780, "interrupt() in a loop will cause extra resumes": a node that
    calls ``interrupt()`` inside a loop is run again from its start on every resume, each
    earlier ``interrupt()`` answered with its recorded value, so whatever the loop did
    after the earlier answers is done again (measured on langgraph 1.2.x: still so). With
    a tool call after each approval, LangGraph alone runs the k-th of n approved calls
    n - k + 1 times (three approvals, three calls: 1 + 2 + 3 = 6 charges). What should
    happen: each approved call runs once (3). Through the ledger, the same loop's earlier
    calls answer from the record by their ids (their ToolMessages the same), and the
    review of an earlier turn finds its calls decided and asks nothing (the resume values
    LangGraph replays to the later interrupts name calls already decided the same way:
    nothing new is recorded)."""
    alone = tmp_path / "alone.txt"
    graph = _loop_graph(alone, InMemorySaver())
    result = graph.invoke({"messages": [HumanMessage("go")]}, CONFIG)
    asked = 0
    while result.get("__interrupt__"):
        (pending,) = result["__interrupt__"]
        asked += 1
        result = graph.invoke(Command(resume=dict.fromkeys(pending.value["calls"],
                                                           "approve")), CONFIG)
    assert asked == 3
    assert effects(alone) == ["charge 1", "charge 1", "charge 2",
                              "charge 1", "charge 2", "charge 3"]
    assert result["messages"][-1].content == "done"

    through = tmp_path / "ledger.txt"
    ledger = ToolLedger(store, approvals=["charge"])
    graph = _loop_graph(through, OneWriterSaver(InMemorySaver()), ledger)
    result = graph.invoke({"messages": [HumanMessage("go")]}, CONFIG)
    shown = []
    while result.get("__interrupt__"):
        prints = _pending(result)
        shown.append(sorted(prints))
        result = graph.invoke(Command(resume={
            call_id: decision("approve", fingerprint)
            for call_id, fingerprint in prints.items()}), CONFIG)
    assert shown == [["c1"], ["c2"], ["c3"]]  # each call asked about once
    assert effects(through) == ["charge 1", "charge 2", "charge 3"]
    assert _tool_messages(result) == [("c1", "charged 1"), ("c2", "charged 2"),
                                      ("c3", "charged 3")]
    assert result["messages"][-1].content == "done"


def _tools_state(calls: list[tuple[str, dict[str, Any], str]]) -> dict[str, Any]:
    reply = AIMessage(content="", tool_calls=[
        {"name": name, "args": args, "id": call_id, "type": "tool_call"}
        for name, args, call_id in calls])
    return {"messages": [HumanMessage("go"), reply]}


def _graph_of(node: ToolNode, checkpointer: Any) -> Any:
    builder: Any = StateGraph(MessagesState)
    builder.add_node("tools", node)
    builder.add_edge(START, "tools")
    builder.add_edge("tools", END)
    return builder.compile(checkpointer=checkpointer)


@pytest.mark.invariant("I1", "I12")
def test_a_tool_node_run_again_answers_from_the_ledger_byte_for_byte(
        tmp_path: Path, store: SQLiteEventStore) -> None:
    """A ToolNode run again on the same calls (a resume that re-executes it) runs each
    tool again on LangGraph alone; through the ledger it answers each call from the
    record, keyed by its id (two calls of one tool are two calls), with the same content
    byte for byte."""
    calls = [("charge", {"amount": 7}, "x"), ("charge", {"amount": 8}, "y")]
    alone = tmp_path / "alone.txt"
    graph = _graph_of(ToolNode(make_tools(alone)), InMemorySaver())
    for thread in ("1", "2"):
        graph.invoke(_tools_state(calls), {"configurable": {"thread_id": "t" + thread}})
    assert len(effects(alone)) == 4

    through = tmp_path / "ledger.txt"
    ledger = ToolLedger(store, run_id="one-run")
    graph = _graph_of(ledger.tool_node(make_tools(through)), InMemorySaver())
    answers = [_tool_messages(graph.invoke(_tools_state(calls),
                                           {"configurable": {"thread_id": "t" + thread}}))
               for thread in ("1", "2")]
    assert sorted(effects(through)) == ["charge 7", "charge 8"]
    assert answers[0] == answers[1] == [("x", "charged 7"), ("y", "charged 8")]
    fresh = ToolLedger(store, run_id="one-run")  # another process: from the store
    graph = _graph_of(fresh.tool_node(make_tools(through)), InMemorySaver())
    again = _tool_messages(graph.invoke(_tools_state(calls), {"configurable": {
        "thread_id": "t3"}}))
    assert again == answers[0]
    assert len(effects(through)) == 2


def test_a_new_batch_and_its_first_start_are_one_write_before_the_body(
        tmp_path: Path) -> None:
    """Entering a batch and starting its first call need one durable write before the
    body (DESIGN §7.7: the start before the body), not one each; the body still finds
    both the batch and its start in the durable log, read through another store."""
    appended: list[list[str]] = []

    class Counting(SQLiteEventStore):
        def append(self, run_id: str, events: Any, expected_version: int,
                   **options: Any) -> None:
            appended.append([type(event).__name__ for event in events])
            super().append(run_id, events, expected_version, **options)

    path = tmp_path / "ledger.db"
    store = Counting(str(path))
    seen: list[tuple[int, list[str]]] = []

    @tool
    def charge(amount: int) -> str:
        """Charge."""
        durable = SQLiteEventStore(str(path), readonly=True).load("one-run")
        seen.append((len(appended), [type(event).__name__ for event in durable]))
        return f"charged {amount}"

    ledger = ToolLedger(store, run_id="one-run")
    graph = _graph_of(ledger.tool_node([charge]), InMemorySaver())
    graph.invoke(_tools_state([("charge", {"amount": 7}, "x")]),
                 {"configurable": {"thread_id": "t1"}})
    ((appends, durable),) = seen
    assert appends == 1  # one append before the body: the batch with its start
    assert durable == appended[0]
    assert {"ModelResponded", "ToolStarted"} <= set(durable)


def test_the_async_tool_node_goes_through_the_same_ledger(
        tmp_path: Path, store: SQLiteEventStore) -> None:
    through = tmp_path / "ledger.txt"
    ledger = ToolLedger(store, run_id="one-run")
    graph = _graph_of(ledger.tool_node(make_tools(through)), InMemorySaver())
    state = _tools_state([("charge", {"amount": 7}, "x")])
    for thread in ("1", "2"):
        result = asyncio.run(graph.ainvoke(state, {"configurable": {"thread_id": thread}}))
    assert effects(through) == ["charge 7"]
    assert _tool_messages(result) == [("x", "charged 7")]


@pytest.mark.invariant("I1")
def test_a_tool_that_raises_is_recorded_failed_and_never_runs_again(
        tmp_path: Path, store: SQLiteEventStore) -> None:
    path = tmp_path / "effects.txt"

    @tool
    def flaky(n: int) -> str:
        """Fails after its effect."""
        effect(path, f"flaky {n}")
        raise RuntimeError("the service said no")

    ledger = ToolLedger(store)
    graph = _graph_of(ledger.tool_node([flaky]), InMemorySaver())
    state = _tools_state([("flaky", {"n": 1}, "f")])
    with pytest.raises(RuntimeError, match="said no"):  # as LangGraph alone raises it
        graph.invoke(state, CONFIG)
    result = graph.invoke(state, CONFIG)  # the retry the user makes
    assert effects(path) == ["flaky 1"]
    ((call_id, content),) = _tool_messages(result)
    assert call_id == "f"
    assert content == "Error: RuntimeError('the service said no')\n Please fix your mistakes."
    assert result["messages"][-1].status == "error"

    handled = ToolLedger(SQLiteEventStore(str(tmp_path / "handled.db")), run_id="h")
    graph = _graph_of(handled.tool_node([flaky], handle_tool_errors=True), InMemorySaver())
    first, second = (_tool_messages(graph.invoke(state, {"configurable": {
        "thread_id": thread}})) for thread in ("h1", "h2"))
    assert first == second
    assert effects(path) == ["flaky 1", "flaky 1"]  # one run per ledger


@pytest.mark.invariant("I1")
def test_a_tool_that_raised_is_answered_with_its_error_in_the_next_process(
        tmp_path: Path, store: SQLiteEventStore) -> None:
    """The error a body raised (its effect done) is durable when the graph raises it: a
    retry in another process (a fresh ledger on the same store, nothing else written in
    between) answers with the error, never running the body again nor refusing the call
    as in doubt."""
    path = tmp_path / "effects.txt"

    @tool
    def flaky(n: int) -> str:
        """Fails after its effect."""
        effect(path, f"flaky {n}")
        raise RuntimeError("the service said no")

    state = _tools_state([("flaky", {"n": 1}, "f")])
    graph = _graph_of(ToolLedger(store).tool_node([flaky]), InMemorySaver())
    with pytest.raises(RuntimeError, match="said no"):
        graph.invoke(state, CONFIG)
    graph = _graph_of(ToolLedger(store).tool_node([flaky]), InMemorySaver())
    ((call_id, content),) = _tool_messages(graph.invoke(state, CONFIG))
    assert (call_id, content) == (
        "f", "Error: RuntimeError('the service said no')\n Please fix your mistakes.")
    assert effects(path) == ["flaky 1"]


# ------------------------------------------------------------------ refusals


def test_the_ledgers_refusals_pass_through_handle_tool_errors(
        tmp_path: Path, store: SQLiteEventStore) -> None:
    """A call in doubt is refused even under ``handle_tool_errors=True`` (LangGraph would
    otherwise hand the model an error message it could answer by calling again)."""
    path = tmp_path / "effects.txt"
    ledger = ToolLedger(store)
    c = ledger.controller(RUN)
    c.begin_model_call()
    c.model_responded([ToolCall("x", "charge", {"amount": 7})])
    c.begin_tool("x")
    c.flush()  # started, then "the process died"
    ledger.forget()
    graph = _graph_of(ledger.tool_node(make_tools(path), handle_tool_errors=True),
                      InMemorySaver())
    with pytest.raises(ToolInDoubt):
        graph.invoke(_tools_state([("charge", {"amount": 7}, "x")]), CONFIG)
    assert effects(path) == []


def _only_value_errors(error: ValueError) -> str:
    """A ``handle_tool_errors`` callable whose annotation names the errors it handles."""
    return f"handled {error!r}"


def _every_error(error):  # type: ignore[no-untyped-def]
    """One without an annotation: LangGraph hands it every error."""
    return f"caught {error!r}"


HANDLERS: dict[str, Any] = {"typed": _only_value_errors, "untyped": _every_error}


def _flaky(seen: list[str]) -> Any:
    @tool
    def flaky(kind: str) -> str:
        """Fail with the kind of error asked for."""
        seen.append(kind)
        if kind == "value":
            raise ValueError("bad value")
        raise KeyError("no key")

    return flaky


def _outcome(node: ToolNode, kind: str, door: str, thread: str) -> tuple[Any, ...]:
    """What a caller sees of one ``flaky`` call: the ToolMessage's content and status, or
    the type of the error raised."""
    graph = _graph_of(node, InMemorySaver())
    state = _tools_state([("flaky", {"kind": kind}, f"call-{kind}")])
    config = {"configurable": {"thread_id": thread}}
    try:
        result = (graph.invoke(state, config) if door == "sync"
                  else asyncio.run(graph.ainvoke(state, config)))
    except Exception as error:
        return ("raised", type(error).__name__)
    (message,) = [m for m in result["messages"] if isinstance(m, ToolMessage)]
    return ("message", message.content, message.status)


@pytest.mark.parametrize("door", ["sync", "async"])
@pytest.mark.parametrize("handler", sorted(HANDLERS))
def test_a_callable_handle_tool_errors_sees_what_it_sees_on_langgraph_alone(
        store: SQLiteEventStore, handler: str, door: str) -> None:
    """The same tool error alone and through the ledger (its ``tool_node``, and a
    ToolNode built with its wrappers) gives the same outcome: a callable annotated with
    the errors it handles gets only those (LangGraph reads the annotation), one without
    gets every error; what it returns is the message. Expected from the handler alone
    (before: the ledger's node handed a ValueError-only handler a KeyError too)."""
    handling = HANDLERS[handler]
    for kind, error in (("value", ValueError("bad value")), ("key", KeyError("no key"))):
        if handler == "untyped" or kind == "value":
            expected: tuple[Any, ...] = ("message", handling(error), "error")
        else:
            expected = ("raised", "KeyError")
        seen: list[str] = []
        tools = [_flaky(seen)]
        ledger, own = ToolLedger(store, run_id=f"a-{kind}"), ToolLedger(
            store, run_id=f"b-{kind}")
        nodes = {
            "alone": ToolNode(tools, handle_tool_errors=handling),
            "tool_node": ledger.tool_node(tools, handle_tool_errors=handling),
            "own node": ToolNode(tools, wrap_tool_call=own.wrap_tool_call,
                                 awrap_tool_call=own.awrap_tool_call,
                                 handle_tool_errors=handling)}
        outcomes = {name: _outcome(node, kind, door, f"{name}-{kind}")
                    for name, node in nodes.items()}
        assert outcomes == dict.fromkeys(nodes, expected), kind
        assert seen == [kind] * 3  # the body ran once through each


@pytest.mark.parametrize("handling", [True, "a text", _every_error, (Exception,),
                                      ToolInDoubt],
                         ids=["true", "text", "callable", "exception-tuple", "refusal-type"])
@pytest.mark.parametrize("built", ["tool_node", "own node"])
def test_a_refusal_is_never_a_tool_message_whatever_handles_tool_errors(
        tmp_path: Path, store: SQLiteEventStore, handling: Any, built: str) -> None:
    """A call in doubt is refused (`ToolInDoubt` out of the graph, nothing run) under
    every ``handle_tool_errors`` setting, on the ledger's ``tool_node`` and on a
    ToolNode built with the ledger's wrappers (before: that one's handler turned the
    refusal into a message the model could answer by calling again)."""
    path = tmp_path / "effects.txt"
    ledger = ToolLedger(store)
    c = ledger.controller(RUN)
    c.begin_model_call()
    c.model_responded([ToolCall("x", "charge", {"amount": 7})])
    c.begin_tool("x")
    c.flush()  # started, then "the process died"
    ledger.forget()
    node = (ledger.tool_node(make_tools(path), handle_tool_errors=handling)
            if built == "tool_node" else
            ToolNode(make_tools(path), wrap_tool_call=ledger.wrap_tool_call,
                     awrap_tool_call=ledger.awrap_tool_call, handle_tool_errors=handling))
    with pytest.raises(ToolInDoubt):
        _graph_of(node, InMemorySaver()).invoke(
            _tools_state([("charge", {"amount": 7}, "x")]), CONFIG)
    with pytest.raises(ToolInDoubt):
        asyncio.run(_graph_of(node, InMemorySaver()).ainvoke(
            _tools_state([("charge", {"amount": 7}, "x")]), CONFIG))
    assert effects(path) == []


def test_what_the_adapter_does_not_carry_is_refused_naming_it(
        tmp_path: Path, store: SQLiteEventStore) -> None:
    path = tmp_path / "effects.txt"
    ledger = ToolLedger(store)
    graph = _graph_of(ledger.tool_node(make_tools(path)), InMemorySaver())
    no_id: dict[str, Any] = {"messages": [AIMessage(content="", tool_calls=[
        {"name": "charge", "args": {"amount": 1}, "id": None, "type": "tool_call"}])]}
    with pytest.raises(UnsupportedFeature) as refused:
        graph.invoke(no_id, CONFIG)
    assert refused.value.feature == "tool calls without ids"

    @tool
    def asks(n: int) -> str:
        """Interrupts inside its body, then acts."""
        effect(path, f"asks {n}")
        interrupt("may I?")
        effect(path, f"acted {n}")
        return "ok"

    graph = _graph_of(ledger.tool_node([asks]), InMemorySaver())
    asking = _tools_state([("asks", {"n": 1}, "q")])
    with pytest.raises(UnsupportedFeature) as refused:
        graph.invoke(asking, CONFIG)
    assert refused.value.feature == "interrupt() inside a tool"
    assert effects(path) == ["asks 1"]  # ran up to its interrupt(), once
    with pytest.raises(ToolInDoubt):  # left in doubt: run again, it is refused
        graph.invoke(asking, CONFIG)
    assert effects(path) == ["asks 1"]
    assert [(w.call_id, w.kind) for w in operator.inbox(store)] == [("q", "in_doubt")]
    path.unlink()

    # a subgraph with its own tool node
    inner = _graph_of(ledger.tool_node(make_tools(path)), None)
    outer: Any = StateGraph(MessagesState)
    outer.add_node("agent", inner)
    outer.add_edge(START, "agent")
    outer.add_edge("agent", END)
    with pytest.raises(UnsupportedFeature) as refused:
        outer.compile(checkpointer=InMemorySaver()).invoke(
            _tools_state([("charge", {"amount": 3}, "s")]), {"configurable": {
                "thread_id": "sub"}})
    assert refused.value.feature == "subgraphs with their own tool nodes"
    assert effects(path) == []

    with pytest.raises(UnsupportedFeature) as refused:
        ledger.tool_node(make_tools(path), wrap_tool_call=lambda r, h: h(r))
    assert refused.value.feature == "other tool-call wrappers around the ledger"
    with pytest.raises(adapter.InvalidVerifier):
        ToolLedger(store, tools=["charge"], verifiers={"nope": lambda context: Unknown()})


ONE = [[("charge", {"amount": 7}, "c1")], "done"]


def _charging_then_failing(path: Path) -> Any:
    """A charge whose effect happens, then the gateway times out (it raises)."""

    @tool
    def charge(amount: int) -> str:
        """Charge the customer."""
        effect(path, f"charge {amount}")
        raise RuntimeError("gateway timeout after the charge")

    return charge


def _run(graph: Any, value: Any, run: str) -> Any:
    """``graph.invoke(value, CONFIG)``, or its ``ainvoke`` in an event loop."""
    if run == "ainvoke":
        return asyncio.run(graph.ainvoke(value, CONFIG))
    return graph.invoke(value, CONFIG)


class _Twice(AgentMiddleware):
    """A home-made retry: calls the rest of the chain a second time, whatever the first
    answered."""

    def wrap_tool_call(self, request: Any, handler: Any) -> Any:
        handler(request)
        return handler(request)


@pytest.mark.invariant("I1")
@pytest.mark.parametrize("run", ["invoke", "ainvoke"])
@pytest.mark.parametrize("order", ["ledger-first", "ledger-last"])
def test_retry_middleware_beside_the_ledger_is_refused_before_anything_runs(
        tmp_path: Path, store: SQLiteEventStore, order: str, run: str) -> None:
    """LangChain runs the first middleware of ``create_agent(middleware=[...])`` as the
    outermost ``wrap_tool_call``. On create_agent alone ``ToolRetryMiddleware(max_retries=
    2)`` runs a charge that raised after its effect three times. Beside the ledger, in
    either order (inside it, it would run the body again under one recorded start;
    outside it, it would only repeat the ledger's answer, or hand the model the ledger's
    refusal as a tool message), it is refused before the agent's first model call,
    naming it: the model is never asked, the tool never runs, nothing is recorded."""
    def retry() -> ToolRetryMiddleware:
        return ToolRetryMiddleware(max_retries=2, initial_delay=0, jitter=False)

    alone = tmp_path / "alone.txt"
    agent: Any = create_agent(ScriptedModel(script=ONE), [_charging_then_failing(alone)],
                              middleware=[retry()], checkpointer=InMemorySaver())
    agent.invoke({"messages": [HumanMessage("go")]}, CONFIG)
    assert effects(alone) == ["charge 7"] * 3

    through = tmp_path / "ledger.txt"
    ledger = LedgerMiddleware(ToolLedger(store))
    chain = [ledger, retry()] if order == "ledger-first" else [retry(), ledger]
    agent = create_agent(ScriptedModel(script=ONE), [_charging_then_failing(through)],
                         middleware=chain, checkpointer=InMemorySaver())
    go: Any = {"messages": [HumanMessage("go")]}
    with pytest.raises(UnsupportedFeature) as refused:
        _run(agent, go, run)
    assert refused.value.feature == "ToolRetryMiddleware"
    assert effects(through) == []
    assert operator.runs(store) == []
    assert [m.type for m in agent.get_state(CONFIG).values["messages"]] == ["human"]


@pytest.mark.invariant("I1")
@pytest.mark.parametrize("order", ["ledger-first", "ledger-last"])
def test_a_wrapper_that_calls_the_handler_twice_never_runs_a_body_twice(
        tmp_path: Path, store: SQLiteEventStore, order: str) -> None:
    """A tool-call middleware of the user's own that calls its handler twice: listed
    after the ledger (inside it, between the ledger and the body) it is refused, named,
    before anything runs; listed before it (outside), its second call reaches the ledger,
    which answers from the record: the charge runs once and both answers are the same.
    A ToolNode of the user's own whose wrapper hands the ledger another handler than the
    node's own is refused at the tool call the same way."""
    path = tmp_path / "effects.txt"
    chain = [LedgerMiddleware(ToolLedger(store)), _Twice()]
    if order == "ledger-last":
        chain.reverse()
    agent: Any = create_agent(ScriptedModel(script=ONE), make_tools(path), middleware=chain,
                              checkpointer=InMemorySaver())
    if order == "ledger-first":
        with pytest.raises(UnsupportedFeature, match="_Twice") as refused:
            agent.invoke({"messages": [HumanMessage("go")]}, CONFIG)
        assert refused.value.feature == "tool-call middleware inside the ledger"
        assert effects(path) == []
        assert [m.type for m in agent.get_state(CONFIG).values["messages"]] == ["human"]
        return
    result = agent.invoke({"messages": [HumanMessage("go")]}, CONFIG)
    assert effects(path) == ["charge 7"]
    assert _tool_messages(result) == [("c1", "charged 7")]
    assert result["messages"][-1].content == "done"

    ledger = ToolLedger(store, run_id="own-node")

    def twice(request: Any, handler: Any) -> Any:
        return ledger.wrap_tool_call(request, lambda r: (handler(r), handler(r))[1])

    graph = _graph_of(ToolNode(make_tools(path), wrap_tool_call=twice), InMemorySaver())
    with pytest.raises(UnsupportedFeature) as refused:
        graph.invoke(_tools_state([("charge", {"amount": 8}, "x")]), CONFIG)
    assert refused.value.feature == "tool-call middleware inside the ledger"
    assert effects(path) == ["charge 7"]


@pytest.mark.invariant("I1")
@pytest.mark.parametrize("order", ["ledger-first", "ledger-last"])
def test_human_in_the_loop_middleware_beside_the_ledger_is_refused_before_anything_runs(
        tmp_path: Path, store: SQLiteEventStore, order: str) -> None:
    """LangChain's HumanInTheLoopMiddleware beside the ledger: its decisions are bound to
    no fingerprint, and its "edit" runs the reviewer's arguments under the model's call
    id (langchain #40166: on create_agent alone an edit ran ``charge 7000``, never
    approved with those arguments; the edit test above). In either order it is refused
    before the agent's first model call, naming it and pointing to the ledger's own
    review: the reviewer is never asked, the tool never runs, nothing is recorded."""
    path = tmp_path / "effects.txt"
    hitl = HumanInTheLoopMiddleware(interrupt_on={"charge": True})
    ledger = LedgerMiddleware(ToolLedger(store, approvals=["charge"]))
    chain = [ledger, hitl] if order == "ledger-first" else [hitl, ledger]
    agent: Any = create_agent(ScriptedModel(script=ONE), make_tools(path), middleware=chain,
                              checkpointer=InMemorySaver())
    with pytest.raises(UnsupportedFeature, match="review") as refused:
        agent.invoke({"messages": [HumanMessage("go")]}, CONFIG)
    assert refused.value.feature == "HumanInTheLoopMiddleware"
    assert agent.get_state(CONFIG).interrupts == ()
    assert [m.type for m in agent.get_state(CONFIG).values["messages"]] == ["human"]
    assert effects(path) == []
    assert operator.runs(store) == []


def _commanding(path: Path, *, declared: bool) -> Any:
    """``pay(amount)``: pays (its effect), then returns a LangGraph ``Command`` carrying
    its ToolMessage; ``declared``: its signature says so (``-> Command``)."""

    def pay(amount: int, tool_call_id: Annotated[str, InjectedToolCallId]) -> Any:
        """Pay, and update the graph's state."""
        effect(path, f"pay {amount}")
        return Command(update={"messages": [ToolMessage(f"paid {amount}",
                                                        tool_call_id=tool_call_id)]})

    if declared:
        pay.__annotations__["return"] = Command
    return tool(pay)


def test_a_tool_declared_to_return_a_command_is_refused_before_it_runs(
        tmp_path: Path, store: SQLiteEventStore) -> None:
    """A tool whose signature says it returns a ``Command`` (which the ledger cannot keep
    as a result: it updates the graph's state) is refused before its body ever runs,
    naming the feature: when ``ToolLedger.tool_node`` builds its node, before the
    agent's first model call in ``create_agent``, and at the call in a ToolNode of the
    user's own. LangGraph alone runs it."""
    path = tmp_path / "effects.txt"
    state = _tools_state([("pay", {"amount": 7}, "p1")])
    alone = _graph_of(ToolNode([_commanding(path, declared=True)]), InMemorySaver())
    assert _tool_messages(alone.invoke(state, CONFIG)) == [("p1", "paid 7")]
    assert effects(path) == ["pay 7"]

    ledger = ToolLedger(store)
    with pytest.raises(UnsupportedFeature, match="'pay'") as refused:
        ledger.tool_node([_commanding(path, declared=True)])
    assert refused.value.feature == "tools returning Command"

    agent: Any = create_agent(ScriptedModel(script=[[("pay", {"amount": 8}, "p2")], "done"]),
                              [_commanding(path, declared=True)],
                              middleware=[LedgerMiddleware(ledger)],
                              checkpointer=InMemorySaver())
    with pytest.raises(UnsupportedFeature) as refused:
        agent.invoke({"messages": [HumanMessage("go")]}, CONFIG)
    assert refused.value.feature == "tools returning Command"
    assert [m.type for m in agent.get_state(CONFIG).values["messages"]] == ["human"]

    own = ToolNode([_commanding(path, declared=True)], wrap_tool_call=ledger.wrap_tool_call)
    with pytest.raises(UnsupportedFeature) as refused:
        _graph_of(own, InMemorySaver()).invoke(
            _tools_state([("pay", {"amount": 9}, "p3")]), CONFIG)
    assert refused.value.feature == "tools returning Command"
    assert effects(path) == ["pay 7"]  # LangGraph alone's; none through the ledger
    assert operator.runs(store) == []


@pytest.mark.invariant("I1")
def test_a_command_an_undeclared_tool_returned_is_recorded_as_what_happened(
        tmp_path: Path, store: SQLiteEventStore) -> None:
    """A tool that returns a ``Command`` without saying so can only be known after its
    body ran: the call is recorded as run (its effect happened) with the text the model
    is then sent, saying that the Command was not applied, and the graph stops with the
    refusal naming the feature. Run again (a retry, another process), the ledger answers
    from that record: the body never runs a second time."""
    path = tmp_path / "effects.txt"
    state = _tools_state([("pay", {"amount": 7}, "p1")])
    graph = _graph_of(ToolLedger(store).tool_node([_commanding(path, declared=False)]),
                      InMemorySaver())
    with pytest.raises(UnsupportedFeature) as refused:
        graph.invoke(state, CONFIG)
    assert refused.value.feature == "tools returning Command"
    assert effects(path) == ["pay 7"]
    graph = _graph_of(ToolLedger(store).tool_node([_commanding(path, declared=False)]),
                      InMemorySaver())
    ((call_id, content),) = _tool_messages(graph.invoke(state, CONFIG))
    assert call_id == "p1"
    assert content.startswith("Error: the tool ran, and returned a Command")
    assert "not applied" in content
    assert effects(path) == ["pay 7"]
    assert ToolLedger(store).controller(RUN).phase("p1") is Phase.COMPLETED


@pytest.mark.parametrize("graph", ["tool-node", "create-agent"])
def test_a_graph_without_a_thread_is_refused_before_anything_runs(
        tmp_path: Path, store: SQLiteEventStore, graph: str) -> None:
    """A graph run with no thread (no checkpointer, no thread_id) has no run to ledger:
    refused naming the feature before the tool runs, or before the reviewer is asked in
    ``create_agent``; nothing recorded. With ``ToolLedger(run_id=...)`` it goes on."""
    path = tmp_path / "effects.txt"
    state = _tools_state([("charge", {"amount": 7}, "x")])
    if graph == "tool-node":
        with pytest.raises(UnsupportedFeature) as refused:
            _graph_of(ToolLedger(store).tool_node(make_tools(path)), None).invoke(state)
    else:
        agent: Any = create_agent(ScriptedModel(script=ONE), make_tools(path),
                                  middleware=[LedgerMiddleware(ToolLedger(
                                      store, approvals=["charge"]))])
        with pytest.raises(UnsupportedFeature) as refused:
            agent.invoke({"messages": [HumanMessage("go")]})
    assert refused.value.feature == "graphs without a thread"
    assert effects(path) == []
    assert operator.runs(store) == []
    named = _graph_of(ToolLedger(store, run_id="named").tool_node(make_tools(path)), None)
    assert _tool_messages(named.invoke(state)) == [("x", "charged 7")]
    assert effects(path) == ["charge 7"]


def test_an_async_event_store_is_refused_when_the_ledger_is_built(tmp_path: Path) -> None:
    """LangGraph's ToolNode runs the sync wrapper on worker threads: an async store is
    refused when the ledger is built, naming the feature; no run is opened."""
    path = tmp_path / "events.db"
    store = AsyncSQLiteEventStore(path)
    try:
        with pytest.raises(UnsupportedFeature) as refused:
            ToolLedger(cast("Any", store))
    finally:
        asyncio.run(store.close())
    assert refused.value.feature == "async event stores"
    assert operator.runs(SQLiteEventStore(str(path))) == []


def test_the_adapter_exports_what_users_need() -> None:
    assert set(adapter.__all__) <= set(dir(adapter))
    assert {"ToolLedger", "LedgerMiddleware", "OneWriterSaver", "decision",
            "ToolInDoubt", "UnsupportedFeature"} <= set(adapter.__all__)


# ---------------------------------------------------------- the operator surface


@pytest.mark.invariant("I11")
def test_a_call_in_doubt_is_listed_settled_by_the_operator_and_the_graph_goes_on(
        tmp_path: Path, store: SQLiteEventStore) -> None:
    path = tmp_path / "effects.txt"
    ledger = ToolLedger(store)
    c = ledger.controller(RUN)
    c.begin_model_call()
    c.model_responded([ToolCall("x", "charge", {"amount": 7})])
    c.begin_tool("x")
    c.flush()
    ledger.forget()
    saver = SqliteSaver(sqlite3.connect(str(tmp_path / "checkpoints.db"),
                                        check_same_thread=False))
    graph = _graph_of(ledger.tool_node(make_tools(path)), saver)
    state = _tools_state([("charge", {"amount": 7}, "x")])
    with pytest.raises(ToolInDoubt):
        graph.invoke(state, CONFIG)
    (head,) = operator.runs(store, blocked=True)
    assert head.run_id == RUN
    (waiting,) = operator.inbox(store)
    assert (waiting.call_id, waiting.kind) == ("x", "in_doubt")
    operator.resolve(store, RUN, "x", outcome=Resolution.COMPLETED, output="charged 7 (seen "
                     "on the bank's side)", by="ops", evidence="txn 42")
    result = graph.invoke(state, CONFIG)
    assert _tool_messages(result) == [("x", "charged 7 (seen on the bank's side)")]
    assert effects(path) == []


def test_an_approval_made_through_the_operator_lets_the_graph_go_on(
        tmp_path: Path, store: SQLiteEventStore) -> None:
    path = tmp_path / "effects.txt"
    ledger = ToolLedger(store, approvals=["charge"])
    script = [[("charge", {"amount": 7}, "c1")], "done"]
    graph = build("ledger", make_tools(path), ScriptedModel(script=script),
                  OneWriterSaver(InMemorySaver()), ledger=ledger, review=True)
    prints = _pending(graph.invoke({"messages": [HumanMessage("go")]}, CONFIG))
    (waiting,) = operator.inbox(store)
    assert (waiting.call_id, waiting.fingerprint) == ("c1", prints["c1"])
    operator.approve(store, RUN, "c1", fingerprint=prints["c1"], by="ops")
    result = graph.invoke(Command(resume={}), CONFIG)
    assert effects(path) == ["charge 7"]
    assert result["messages"][-1].content == "done"


def test_a_call_awaiting_approval_without_a_review_is_durable_for_the_operator(
        tmp_path: Path, store: SQLiteEventStore) -> None:
    """A call that needs approval reaching the tool node without a review step is
    refused before its body, and its batch is durable: the operator's inbox lists it
    (the batch rides with a start's flush, and there is no start here)."""
    path = tmp_path / "effects.txt"
    ledger = ToolLedger(store, approvals=["charge"])
    script = [[("charge", {"amount": 7}, "c1")], "done"]
    graph = build("ledger", make_tools(path), ScriptedModel(script=script),
                  OneWriterSaver(InMemorySaver()), ledger=ledger, review=False)
    with pytest.raises(InvalidTransition, match="awaits a decision"):
        graph.invoke({"messages": [HumanMessage("go")]}, CONFIG)
    assert effects(path) == []
    (waiting,) = operator.inbox(SQLiteEventStore(store.path, readonly=True))
    assert waiting.call_id == "c1"


def test_a_batch_whose_write_fails_raises_that_write_s_error_not_the_refusal(
        tmp_path: Path) -> None:
    """Where the batch is written on its own (a call refused before its body), a failed
    write is what the caller is told, as when the batch was always written first, and
    the next attempt loads the run again: the batch lands then, for the operator."""
    failures = [StorageError("disk full (injected)", outcome=Outcome.NOT_WRITTEN)]

    class Failing(SQLiteEventStore):
        def append(self, run_id: str, events: Any, expected_version: int,
                   **options: Any) -> None:
            if failures:
                raise failures.pop()
            super().append(run_id, events, expected_version, **options)

    store = Failing(str(tmp_path / "ledger.db"))
    path = tmp_path / "effects.txt"
    ledger = ToolLedger(store, approvals=["charge"])
    script = [[("charge", {"amount": 7}, "c1")], "done"]
    graph = build("ledger", make_tools(path), ScriptedModel(script=script),
                  OneWriterSaver(InMemorySaver()), ledger=ledger, review=False)
    with pytest.raises(StorageError, match="disk full") as failed:
        graph.invoke({"messages": [HumanMessage("go")]}, CONFIG)
    assert isinstance(failed.value.__cause__, InvalidTransition)  # the refusal, chained
    with pytest.raises(InvalidTransition, match="awaits a decision"):
        graph.invoke(None, CONFIG)  # the tool step again, from its checkpoint
    assert effects(path) == []
    (waiting,) = operator.inbox(SQLiteEventStore(store.path, readonly=True))
    assert waiting.call_id == "c1"


def test_verifiers_settle_a_call_in_doubt_and_bodies_see_their_idempotency_key(
        tmp_path: Path, store: SQLiteEventStore) -> None:
    path = tmp_path / "effects.txt"
    keys: list[str] = []

    @tool
    def charge(amount: int) -> str:
        """Charge, with the call's idempotency key."""
        keys.append(tool_context().idempotency_key)
        effect(path, f"charge {amount}")
        return f"charged {amount}"

    c = ToolLedger(store).controller(RUN)
    c.begin_model_call()
    c.model_responded([ToolCall("x", "charge", {"amount": 7})])
    c.begin_tool("x")
    c.flush()  # started; the bank says it went through
    key = c.idempotency_key("x")
    ledger = ToolLedger(store, verifiers={"charge": lambda context: Completed(
        f"charged 7 ({context.idempotency_key})")})
    graph = _graph_of(ledger.tool_node([charge]), InMemorySaver())
    result = graph.invoke(_tools_state([("charge", {"amount": 7}, "x")]), CONFIG)
    assert _tool_messages(result) == [("x", f"charged 7 ({key})")]
    assert effects(path) == []
    graph.invoke(_tools_state([("charge", {"amount": 8}, "y")]), CONFIG)
    reloaded = ToolLedger(store).controller(RUN)
    assert keys == [reloaded.idempotency_key("y")]
    assert reloaded.phase("x") is Phase.PUBLISHED


@pytest.mark.invariant("I11")
@pytest.mark.parametrize("answer", ["not-executed", "unknown"])
def test_a_verifier_saying_not_executed_runs_the_call_once_and_unknown_leaves_it_in_doubt(
        tmp_path: Path, store: SQLiteEventStore, answer: str) -> None:
    """A call in doubt (started, then the process died), its verifier asked by the next
    attempt right after its claim: ``NotExecuted`` (the bank has no payment under the
    call's key) records it not executed and the call runs once, with the same
    idempotency key the dead attempt had, then answers from the ledger; ``Unknown``
    leaves it in doubt: refused (`ToolInDoubt`) on every attempt, each asking again, the
    tool never run, the call in the operator's inbox."""
    path = tmp_path / "effects.txt"
    keys: list[str] = []

    @tool
    def charge(amount: int) -> str:
        """Charge, with the call's idempotency key."""
        keys.append(tool_context().idempotency_key)
        effect(path, f"charge {amount}")
        return f"charged {amount}"

    c = ToolLedger(store).controller(RUN)
    c.begin_model_call()
    c.model_responded([ToolCall("x", "charge", {"amount": 7})])
    c.begin_tool("x")
    c.flush()  # started, then "the process died"
    key = c.idempotency_key("x")
    asked: list[str] = []

    def verify(context: Any) -> Any:
        asked.append(context.idempotency_key)
        return NotExecuted() if answer == "not-executed" else Unknown()

    state = _tools_state([("charge", {"amount": 7}, "x")])
    for attempt in (1, 2):  # each a fresh process: a ledger of its own on the store
        ledger = ToolLedger(store, verifiers={"charge": verify})
        graph = _graph_of(ledger.tool_node([charge]), InMemorySaver())
        if answer == "unknown":
            with pytest.raises(ToolInDoubt):
                graph.invoke(state, CONFIG)
            assert asked == [key] * attempt
            continue
        assert _tool_messages(graph.invoke(state, CONFIG)) == [("x", "charged 7")]
        assert asked == [key]  # the second attempt finds nothing in doubt
    if answer == "unknown":
        assert effects(path) == []
        assert [(w.call_id, w.kind) for w in operator.inbox(store)] == [("x", "in_doubt")]
    else:
        assert effects(path) == ["charge 7"]
        assert keys == [key]
        assert operator.inbox(store) == []


# ---------------------------------------------------------------- one writer


def test_two_resumers_of_one_checkpoint_one_goes_on(tmp_path: Path) -> None:
    """Two graphs on one SqliteSaver resume the same checkpoint: LangGraph alone takes
    both writes; the one-writer saver refuses the second (nothing written), and a resume
    from an earlier checkpoint (time travel) is refused the same way."""
    script = [[("charge", {"amount": 7}, "c1")], "done"]
    outcomes = {}
    for mode in ("alone", "ledger"):
        path = tmp_path / f"{mode}.txt"
        with SqliteSaver.from_conn_string(str(tmp_path / f"{mode}.db")) as saver:
            shared: Any = saver if mode == "alone" else OneWriterSaver(saver)
            ledger = ToolLedger(SQLiteEventStore(str(tmp_path / f"{mode}-ledger.db")),
                                approvals=["charge"])
            first = build(mode, make_tools(path), ScriptedModel(script=script), shared,
                          ledger=ledger, review=True)
            first.invoke({"messages": [HumanMessage("go")]}, CONFIG)
            paused = first.get_state(CONFIG).config
            first.update_state(CONFIG, {"messages": []})  # the first resumer wrote
            second = build(mode, make_tools(path), ScriptedModel(script=script), shared,
                           ledger=ledger, review=True)
            try:
                second.update_state(paused, {"messages": []})
                outcomes[mode] = "written"
            except ConcurrencyConflict:
                outcomes[mode] = "refused"
    assert outcomes == {"alone": "written", "ledger": "refused"}


@pytest.mark.invariant("I1", "I7")
def test_a_resumer_that_finds_nothing_to_record_never_stops_the_one_that_goes_on(
        tmp_path: Path) -> None:
    """Two processes resume one approval. The second read the paused checkpoint; the
    first recorded the decision and wrote the checkpoint after it, and is about to write
    its tool's start when the second opens the run: the second finds nothing to record,
    and its checkpoint onto the paused one is refused. It wrote nothing to the ledger
    either, so the first's start lands and the charge runs once (a claim the second made
    durable on opening the run superseded the first: both refused, nothing ran)."""
    path = tmp_path / "effects.txt"
    script = [[("charge", {"amount": 7}, "c1")], "done"]
    ledger_db, checkpoints = str(tmp_path / "ledger.db"), str(tmp_path / "checkpoints.db")

    def process(saver: Any, store: SQLiteEventStore) -> tuple[Any, OneWriterSaver]:
        one_writer = OneWriterSaver(saver)
        return build("ledger", make_tools(path), ScriptedModel(script=script), one_writer,
                     ledger=ToolLedger(store, approvals=["charge"]), review=True), one_writer

    read, go = threading.Event(), threading.Event()
    refused: list[BaseException] = []
    with SqliteSaver.from_conn_string(checkpoints) as saver_a, \
            SqliteSaver.from_conn_string(checkpoints) as saver_b:
        store_a = SQLiteEventStore(ledger_db)
        (first, _), (second, writer_b) = (process(saver_a, store_a),
                                          process(saver_b, SQLiteEventStore(ledger_db)))
        asked = _pending(first.invoke({"messages": [HumanMessage("go")]}, CONFIG))
        value = {call_id: decision("approve", fingerprint)
                 for call_id, fingerprint in asked.items()}
        get_tuple, append = writer_b.get_tuple, store_a.append

        def reading(config: Any) -> Any:  # the second read the paused checkpoint
            found = get_tuple(config)
            if not read.is_set():
                read.set()
                assert go.wait(30)
            return found

        def appending(run_id: str, events: Any, *args: Any, **kwargs: Any) -> Any:
            if not go.is_set() and any(type(event).__name__ == "ToolStarted"
                                       for event in events):
                go.set()  # the first's tool start, past its fence: the second goes on
                resumer.join(30)
            return append(run_id, events, *args, **kwargs)

        def resume_second() -> None:
            try:
                second.invoke(Command(resume=value), CONFIG, durability="sync")
            except BaseException as error:  # checked below
                refused.append(error)

        writer_b.get_tuple = reading  # type: ignore[method-assign]
        store_a.append = appending  # type: ignore[method-assign]
        resumer = threading.Thread(target=resume_second)
        resumer.start()
        assert read.wait(30)
        result = first.invoke(Command(resume=value), CONFIG, durability="sync")
        resumer.join(30)
    assert go.is_set()
    assert [type(error) for error in refused] == [ConcurrencyConflict]
    assert "moved on" in cast("ConcurrencyConflict", refused[0]).reason
    assert effects(path) == ["charge 7"]
    assert result["messages"][-1].content == "done"


class _AsyncSaver(InMemorySaver):
    """An in-memory saver whose async reads and writes yield to the event loop, as
    LangGraph's async savers (AsyncSqliteSaver, AsyncPostgresSaver) do."""

    async def aget_tuple(self, config: Any) -> Any:
        await asyncio.sleep(0.01)
        return self.get_tuple(config)

    async def aput(self, config: Any, checkpoint: Any, metadata: Any,
                   new_versions: Any) -> Any:
        await asyncio.sleep(0)
        return self.put(config, checkpoint, metadata, new_versions)


@pytest.mark.parametrize("wrappers", [1, 2])
def test_two_async_resumers_of_one_checkpoint_in_one_process_one_goes_on(
        wrappers: int) -> None:
    """The class promises one writer per thread in this process always: the async put
    too (the saver yields to the loop between its read and its write, as LangGraph's
    async savers do), under a lock around the check and the write, shared by every
    `OneWriterSaver` around the saver (``wrappers``: a graph per resumer, each with a
    wrapper of its own around one saver)."""
    inner = _AsyncSaver()

    def compiled() -> Any:
        builder: Any = StateGraph(MessagesState)
        builder.add_node("step", lambda state: {"messages": []})
        builder.add_edge(START, "step")
        builder.add_edge("step", END)
        return builder.compile(checkpointer=OneWriterSaver(inner))

    graph = compiled()
    other = graph if wrappers == 1 else compiled()
    graph.invoke({"messages": [HumanMessage("go")]}, CONFIG)
    paused = graph.get_state(CONFIG).config

    async def both() -> list[Any]:
        return list(await asyncio.gather(
            graph.aupdate_state(paused, {"messages": []}),
            other.aupdate_state(paused, {"messages": []}), return_exceptions=True))

    outcomes = asyncio.run(both())
    assert sorted(type(o).__name__ for o in outcomes) == ["ConcurrencyConflict", "dict"]


def test_a_one_writer_saver_per_request_around_one_sqlite_saver_writes_one_at_a_time(
        tmp_path: Path, store: SQLiteEventStore) -> None:
    """A `OneWriterSaver` built per request around one ``SqliteSaver`` (one connection),
    four requests at once on threads, five turns each: every turn completes and each
    charge runs once. The wrappers share the saver's write lock: before, a second
    wrapper's ``BEGIN IMMEDIATE`` met the first one's open transaction on the shared
    connection, and most turns failed ("cannot start a transaction within a
    transaction")."""
    inner = SqliteSaver(sqlite3.connect(str(tmp_path / "checkpoints.db"),
                                        check_same_thread=False))
    ledger = ToolLedger(store)
    path = tmp_path / "effects.txt"
    outcomes: list[Any] = []

    def requests(worker: int) -> None:
        for turn in range(5):
            graph = build("ledger", make_tools(path), ScriptedModel(script=SCRIPT_ONE),
                          OneWriterSaver(inner, ledger=ledger), ledger=ledger)
            try:
                done = graph.invoke({"messages": [HumanMessage("charge me 7")]},
                                    {"configurable": {"thread_id": f"w{worker}-{turn}"}},
                                    durability="sync")
                outcomes.append(done["messages"][-1].content)
            except Exception as error:  # (the outcome is what is asserted)
                outcomes.append(error)

    workers = [threading.Thread(target=requests, args=(k,)) for k in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    assert outcomes == ["done"] * 20
    assert effects(path) == ["charge 7"] * 20


_REPLIES = itertools.count(1)


class _Anew(ScriptedModel):
    """The scripted model naming the calls of each reply anew, as a provider's model does
    (a call's id ends with the number of the reply, counted across every model)."""

    def _generate(self, messages: list[Any], stop: Any = None, run_manager: Any = None,
                  **kwargs: Any) -> Any:
        result = super()._generate(messages, stop, run_manager, **kwargs)
        reply: Any = result.generations[0].message
        number = next(_REPLIES)
        for call in reply.tool_calls:
            call["id"] = f"{call['id']}-{number}"
        return result


class _Began(AgentMiddleware):
    """Sets ``began`` (a threading or an asyncio event) when a tool call reaches it
    (before the ledger, listed before it)."""

    def __init__(self, began: threading.Event | asyncio.Event) -> None:
        super().__init__()
        self.began = began

    def wrap_tool_call(self, request: Any, handler: Any) -> Any:
        self.began.set()
        return handler(request)

    async def awrap_tool_call(self, request: Any, handler: Any) -> Any:
        self.began.set()
        return await handler(request)


@pytest.mark.invariant("I1", "I7")
@pytest.mark.parametrize("door", ["toolnode", "agent"])
@pytest.mark.parametrize("mode", ["alone", "ledger", "ledger-unseen-write"])
def test_a_resumer_whose_write_is_refused_runs_no_tool_with_langgraphs_default_durability(
        tmp_path: Path, mode: str, door: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two processes resume one checkpoint (the run's input saved; its first model request
    failed) with LangGraph's default durability, where a step's checkpoint is written
    while the next step runs, and a model that names its calls anew: the first reads the
    checkpoint, the second resumes it to its end, then the first goes on, its write after
    the model call made once its tool step has begun. On SqliteSaver alone both charge.
    Through OneWriterSaver that write is refused, which LangGraph raises only after the
    tool step; the ledger waits for the write before any call of the step and refuses the
    call: one charge. ``ledger-unseen-write``: where the ledger cannot see LangGraph's
    write in flight, it waits for the step's checkpoint on the saver, and refuses the
    call when it is not written in time."""
    if mode == "ledger-unseen-write":
        monkeypatch.setattr(adapter, "_write_in_flight", lambda configurable: None)
        monkeypatch.setattr(adapter, "STEP_WAIT", 1.0)
    path = tmp_path / "effects.txt"
    script = [[("charge", {"amount": 7}, "c")], "done"]
    began = threading.Event()

    def beginning(request: Any, through_the_ledger: Any) -> Any:
        began.set()
        return through_the_ledger()

    def process(model: ScriptedModel) -> Any:  # its own connections
        saver: Any = SqliteSaver(sqlite3.connect(str(tmp_path / "checkpoints.db"),
                                                 check_same_thread=False))
        ledger = ToolLedger(SQLiteEventStore(str(tmp_path / "ledger.db")))
        if mode != "alone":
            saver = OneWriterSaver(saver, ledger=ledger)
        if door == "toolnode":
            if mode == "alone":  # the tool step's start is signalled alone too
                return build("alone", make_tools(path), model, saver, outer=beginning)
            return build("ledger", make_tools(path), model, saver, ledger=ledger,
                         outer=beginning)
        return create_agent(model, make_tools(path), checkpointer=saver, middleware=[
            _Began(began)] + ([] if mode == "alone" else [LedgerMiddleware(ledger)]))

    with pytest.raises(ConnectionError):
        process(_Anew(script=script, failures=[ConnectionError("down")])).invoke(
            {"messages": [HumanMessage("go")]}, CONFIG)
    first, second = process(_Anew(script=script)), process(_Anew(script=script))
    read, write = first.checkpointer.get_tuple, first.checkpointer.put

    def loaded(config: Any) -> Any:  # the first read the checkpoint: the second goes
        found = read(config)
        first.checkpointer.get_tuple = read
        assert second.invoke(None, CONFIG)["messages"][-1].content == "done"
        began.clear()
        return found

    def held(*args: Any) -> Any:  # the first's first write, once its tool step began
        first.checkpointer.put = write
        began.wait(30)
        return write(*args)

    first.checkpointer.get_tuple, first.checkpointer.put = loaded, held
    if mode == "alone":
        assert first.invoke(None, CONFIG)["messages"][-1].content == "done"
        assert effects(path) == ["charge 7", "charge 7"]
        return
    with pytest.raises(ConcurrencyConflict):
        first.invoke(None, CONFIG)
    assert effects(path) == ["charge 7"]


@pytest.mark.invariant("I1", "I7")
@pytest.mark.parametrize("mode", ["alone", "ledger"])
def test_an_async_resumer_whose_write_is_refused_runs_no_tool(tmp_path: Path,
                                                              mode: str) -> None:
    """The same two resumers through ``agent.ainvoke`` (the ledger's ``awrap_tool_call``),
    one in-memory saver between them: alone both charge; through OneWriterSaver the
    first's tool call waits for its step's write, refused: one charge."""
    path = tmp_path / "effects.txt"
    script = [[("charge", {"amount": 7}, "c")], "done"]
    inner = _AsyncSaver()  # the thread's one database

    async def go() -> None:
        began = asyncio.Event()

        def agent(model: ScriptedModel) -> Any:
            saver: Any = inner
            middleware: list[Any] = [_Began(began)]
            if mode == "ledger":  # (publications are carried on LangGraph's own savers)
                ledger = ToolLedger(SQLiteEventStore(str(tmp_path / "ledger.db")))
                saver = OneWriterSaver(inner)
                middleware.append(LedgerMiddleware(ledger))
            return create_agent(model, make_tools(path), checkpointer=saver,
                                middleware=middleware)

        with pytest.raises(ConnectionError):
            await agent(_Anew(script=script, failures=[ConnectionError("down")])).ainvoke(
                {"messages": [HumanMessage("go")]}, CONFIG)
        first, second = agent(_Anew(script=script)), agent(_Anew(script=script))
        saver = first.checkpointer
        read, write = saver.aget_tuple, saver.aput

        async def held(*args: Any) -> Any:  # the first's first write, once its tools began
            saver.aput = write
            await began.wait()
            return await write(*args)

        async def loaded(config: Any) -> Any:  # the first read the checkpoint
            found = await read(config)
            saver.aget_tuple = read
            done = await second.ainvoke(None, CONFIG)
            assert done["messages"][-1].content == "done"
            began.clear()
            saver.aput = held
            return found

        saver.aget_tuple = loaded
        if mode == "alone":
            done = await first.ainvoke(None, CONFIG)
            assert done["messages"][-1].content == "done"
            return
        with pytest.raises(ConcurrencyConflict):
            await first.ainvoke(None, CONFIG)

    asyncio.run(go())
    assert effects(path) == ["charge 7"] * (2 if mode == "alone" else 1)


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_check_step_says_whether_a_step_is_the_threads(tmp_path: Path, kind: str) -> None:
    """`OneWriterSaver.check_step` on its own (the ledger asks it before a step's calls):
    the thread's latest checkpoint passes; one this saver's write was refused for, or one
    the thread moved past, is refused at once, saying which; one not yet written passes
    once a write lands it, and is refused when none does in time. On ``SqliteSaver`` the
    saver reads checkpoint ids itself, one statement each."""
    inner: Any = InMemorySaver() if kind == "memory" else SqliteSaver(sqlite3.connect(
        str(tmp_path / "checkpoints.db"), check_same_thread=False))
    saver, other = OneWriterSaver(inner), OneWriterSaver(inner)
    builder: Any = StateGraph(MessagesState)
    builder.add_node("step", lambda state: {"messages": []})
    builder.add_edge(START, "step")
    builder.add_edge("step", END)
    graph = builder.compile(checkpointer=saver)
    graph.invoke({"messages": [HumanMessage("go")]}, CONFIG)
    paused = graph.get_state(CONFIG).config
    head = paused["configurable"]["checkpoint_id"]
    saver.check_step("t1", head, timeout=0)  # the latest
    with pytest.raises(ConcurrencyConflict):
        graph.update_state(graph.get_state_history(CONFIG).__next__().parent_config,
                           {"messages": []})  # a fork, refused: no child written
    (refused,) = [key for key, error in saver._outcomes.items() if error is not None]
    with pytest.raises(ConcurrencyConflict, match="refused: another resumer"):
        saver.check_step("t1", refused[2], timeout=60)
    written: Any = inner.get_tuple(paused)
    other.put(paused, {**written.checkpoint, "id": "newer"},
              {"source": "update", "step": 9}, {})  # another process moved the thread on
    with pytest.raises(ConcurrencyConflict, match="moved on past"):
        saver.check_step("t1", head, timeout=60)
    with pytest.raises(ConcurrencyConflict, match="not written within"):
        saver.check_step("t1", "never", timeout=0)
    later: Any = {"configurable": {"thread_id": "t1", "checkpoint_ns": "",
                                   "checkpoint_id": "newer"}}
    writer = threading.Thread(target=lambda: other.put(
        later, {**written.checkpoint, "id": "newest"}, {"source": "update", "step": 10},
        {}))
    writer.start()  # lands before the check, or while it waits
    saver.check_step("t1", "newest", timeout=60)
    writer.join()


class _Reads(SqliteSaver):
    """LangGraph's ``SqliteSaver`` subclassed in another module, its ``get_tuple`` its
    own (a subclass may read otherwise: its answer is the one that counts), counting its
    calls."""

    reads = 0

    def get_tuple(self, config: Any) -> Any:
        _Reads.reads += 1
        return super().get_tuple(config)


@pytest.mark.parametrize("publications", [True, False])
def test_a_one_tool_turn_on_sqlite_saver_reads_whole_checkpoints_only_to_publish(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, publications: bool) -> None:
    """The one-writer check before each of a turn's five checkpoint writes, and before
    its tool step, reads the thread's latest checkpoint id alone: ``SqliteSaver``'s
    ``get_tuple`` (which reads and decodes a whole checkpoint) is asked once by the
    graph's own load, and once more with publications, for the checkpoint that publishes
    the tool's result (staged against its parent's messages). A subclass (another
    module's, whose checkpoint writes cannot be publications) is asked by every check."""
    counted = [0]
    read = SqliteSaver.get_tuple

    def counting(saver: Any, config: Any) -> Any:
        counted[0] += 1
        return read(saver, config)

    monkeypatch.setattr(SqliteSaver, "get_tuple", counting)
    outcomes = []
    for kind in (SqliteSaver, _Reads):
        folder = tmp_path / kind.__name__
        folder.mkdir()
        saver = kind(sqlite3.connect(str(folder / "checkpoints.db"),
                                     check_same_thread=False))
        ledger = ToolLedger(SQLiteEventStore(str(folder / "ledger.db")))
        publishes = publications and kind is SqliteSaver
        graph = build("ledger", make_tools(folder / "effects.txt"),
                      ScriptedModel(script=[[("charge", {"amount": 7}, "c1")], "done"]),
                      OneWriterSaver(saver, ledger=ledger if publishes else None),
                      ledger=ledger)
        before = counted[0], _Reads.reads
        graph.invoke({"messages": [HumanMessage("go")]}, CONFIG, durability="sync")
        outcomes.append((counted[0] - before[0], _Reads.reads - before[1],
                         effects(folder / "effects.txt")))
    ours = 2 if publications else 1
    assert outcomes[0] == (ours, 0, ["charge 7"])
    assert outcomes[1][1:] == (7, ["charge 7"])  # (the graph's load, 5 writes, the step)


@pytest.mark.parametrize("door", ["toolnode", "agent"])
def test_durability_exit_on_a_one_writer_saver_is_refused_before_anything_runs(
        tmp_path: Path, store: SQLiteEventStore, door: str) -> None:
    """With ``durability="exit"`` LangGraph writes no checkpoint before the run ends, so
    OneWriterSaver could refuse a write only after every tool ran: refused, naming it,
    before the agent's model call (create_agent) or before the tool (a graph whose model
    node the ledger does not see); the same graph runs with ``durability="sync"``."""
    path = tmp_path / "effects.txt"
    ledger = ToolLedger(store)
    model = ScriptedModel(script=SCRIPT_ONE)
    saver = OneWriterSaver(InMemorySaver(), ledger=ledger)
    graph: Any = (build("ledger", make_tools(path), model, saver, ledger=ledger)
                  if door == "toolnode" else
                  create_agent(model, make_tools(path), checkpointer=saver,
                               middleware=[LedgerMiddleware(ledger)]))
    with pytest.raises(UnsupportedFeature) as refused:
        graph.invoke({"messages": [HumanMessage("go")]}, CONFIG, durability="exit")
    assert refused.value.feature == 'durability="exit" with OneWriterSaver'
    assert effects(path) == []
    assert len(model.requests) == (1 if door == "toolnode" else 0)
    fresh: Any = {"configurable": {"thread_id": "t2"}}  # exit wrote the refused run
    assert graph.invoke({"messages": [HumanMessage("go")]}, fresh,
                        durability="sync")["messages"][-1].content == "done"
    assert effects(path) == ["charge 7"]


def test_a_decision_for_a_call_the_ledger_does_not_hold_is_refused(
        tmp_path: Path, store: SQLiteEventStore) -> None:
    script = [[("charge", {"amount": 7}, "c1")], "done"]
    ledger = ToolLedger(store, approvals=["charge"])
    graph = build("ledger", make_tools(tmp_path / "e.txt"), ScriptedModel(script=script),
                  InMemorySaver(), ledger=ledger, review=True)
    prints = _pending(graph.invoke({"messages": [HumanMessage("go")]}, CONFIG))
    result = graph.invoke(Command(resume={"other": decision("approve", prints["c1"])}),
                          CONFIG)
    assert "does not hold" in result["__interrupt__"][0].value["refused"][0]
    assert ToolLedger(store).controller(RUN).step is Step.INTERRUPTION
    with pytest.raises(InvalidTransition):
        ledger._decide(ledger.controller(RUN), [], {"c1": {"type": "maybe"}})


def test_a_rejection_answers_the_same_after_the_next_batch_published_it(
        tmp_path: Path, store: SQLiteEventStore) -> None:
    """Time travel by hand: the ToolNode of a batch run again after the graph went on to
    the next batch (its results published) answers every call from the ledger: the
    rejected one with its rejection, the approved one with its result; nothing runs."""
    path = tmp_path / "effects.txt"
    script = [*TWO[:1], [("notify", {"to": "ann"}, "n2")], "done"]
    ledger = ToolLedger(store, approvals=["charge", "notify"])
    graph = build("ledger", make_tools(path), ScriptedModel(script=script),
                  InMemorySaver(), ledger=ledger, review=True)
    prints = _pending(graph.invoke({"messages": [HumanMessage("go")]}, CONFIG))
    prints = _pending(graph.invoke(Command(resume={
        "c1": decision("approve", prints["c1"]),
        "n1": decision("reject", prints["n1"], message="not bob")}), CONFIG))
    graph.invoke(Command(resume={"n2": decision("approve", prints["n2"])}), CONFIG)
    assert effects(path) == ["charge 7", "notify ann"]
    assert ToolLedger(store).controller(RUN).phase("n1") is Phase.PUBLISHED
    node = _graph_of(ledger.tool_node(make_tools(path)), InMemorySaver())
    again = node.invoke(_tools_state([("charge", {"amount": 7}, "c1"),
                                      ("notify", {"to": "bob"}, "n1")]), CONFIG)
    assert _tool_messages(again) == [("c1", "charged 7"), ("n1", "not bob")]
    assert [m.status for m in again["messages"] if isinstance(m, ToolMessage)] == [
        "success", "error"]
    assert effects(path) == ["charge 7", "notify ann"]


@pytest.mark.postgres
@pytest.mark.invariant("I1", "I11")
def test_the_ledger_on_postgresql_answers_another_process_and_refuses_doubt(
        tmp_path: Path, pg_dsn: str, pg_schema: str) -> None:
    """The same ledger on the PostgreSQL store: a second ledger (another process's, on
    its own connection) answers a finished call from the store without running it, a
    call in doubt is refused there too, and the run is listed for the operator."""
    from statemachine.postgres import PostgresEventStore

    path = tmp_path / "effects.txt"
    state = _tools_state([("charge", {"amount": 7}, "x")])
    with PostgresEventStore(pg_dsn, schema=pg_schema) as first, \
            PostgresEventStore(pg_dsn, schema=pg_schema) as second:
        graph = _graph_of(ToolLedger(first).tool_node(make_tools(path)), InMemorySaver())
        graph.invoke(state, CONFIG)
        graph = _graph_of(ToolLedger(second).tool_node(make_tools(path)), InMemorySaver())
        assert _tool_messages(graph.invoke(state, CONFIG)) == [("x", "charged 7")]
        assert effects(path) == ["charge 7"]
        doubtful = ToolLedger(first)
        c = doubtful.controller(RUN)
        doubtful._enter(c, [{"name": "charge", "args": {"amount": 8}, "id": "y"}])
        c.begin_tool("y")
        c.flush()
        graph = _graph_of(ToolLedger(second).tool_node(make_tools(path)), InMemorySaver())
        with pytest.raises(ToolInDoubt):
            graph.invoke(_tools_state([("charge", {"amount": 8}, "y")]), CONFIG)
        assert effects(path) == ["charge 7"]
        (waiting,) = operator.inbox(second)
        assert (waiting.run_id, waiting.call_id, waiting.kind) == (RUN, "y", "in_doubt")


def test_create_agent_async_with_approvals_goes_through_the_ledger(
        tmp_path: Path, store: SQLiteEventStore) -> None:
    """``agent.ainvoke``: the middleware's ``aafter_model`` review and ``awrap_tool_call``."""
    path = tmp_path / "effects.txt"
    ledger = ToolLedger(store, approvals=["charge"])
    agent: Any = create_agent(ScriptedModel(script=TWO), make_tools(path),
                              middleware=[LedgerMiddleware(ledger)],
                              checkpointer=OneWriterSaver(InMemorySaver(), ledger=ledger))

    async def go() -> dict[str, Any]:
        prints = _pending(await agent.ainvoke({"messages": [HumanMessage("go")]}, CONFIG))
        assert list(prints) == ["c1"]  # notify needs no approval
        return dict(await agent.ainvoke(Command(resume={
            "c1": decision("reject", prints["c1"])}), CONFIG))

    result = asyncio.run(go())
    assert effects(path) == ["notify bob"]
    assert sorted(_tool_messages(result)) == [("c1", adapter.REJECTED),
                                              ("n1", "notified bob")]
    c = ToolLedger(store).controller(RUN)  # the results' checkpoint was their publication
    assert [type(e).__name__ for e in c.events if "Publication" in type(e).__name__] == [
        "PublicationStaged", "PublicationCommitted"]


def test_an_idempotent_tool_runs_again_after_a_start_that_never_finished(
        tmp_path: Path, store: SQLiteEventStore) -> None:
    path = tmp_path / "effects.txt"
    c = ToolLedger(store).controller(RUN)
    c.begin_model_call()
    c.model_responded([ToolCall("n", "notify", {"to": "bob"}, idempotent=True)])
    c.begin_tool("n")
    c.flush()  # started, then "the process died"
    ledger = ToolLedger(store, idempotent=["notify"])
    graph = _graph_of(ledger.tool_node(make_tools(path)), InMemorySaver())
    result = graph.invoke(_tools_state([("notify", {"to": "bob"}, "n")]), CONFIG)
    assert _tool_messages(result) == [("n", "notified bob")]
    assert effects(path) == ["notify bob"]


@pytest.mark.invariant("I1", "I6", "I12")
@pytest.mark.parametrize("landed", [True, False], ids=["landed-then-raised", "not-landed"])
def test_a_failed_checkpoint_write_of_results_is_reconciled_by_the_next_write(
        tmp_path: Path, store: SQLiteEventStore, landed: bool) -> None:
    """With ``OneWriterSaver(saver, ledger=ledger)`` the checkpoint that adds a batch's
    ToolMessages is the batch's staged publication. A write that raises (its own error
    reaching the caller) is reconciled by the next one: acknowledged when it had landed,
    written again by LangGraph (the result answered from the ledger) when it had not.
    The tool runs once; the result is published once."""
    path = tmp_path / "effects.txt"
    ledger = ToolLedger(store)
    inner = SqliteSaver(sqlite3.connect(str(tmp_path / "checkpoints.db"),
                                        check_same_thread=False))
    FailingPut(landed=landed).attach(inner)
    graph = build("ledger", make_tools(path), ScriptedModel(script=SCRIPT_ONE),
                  OneWriterSaver(inner, ledger=ledger), ledger=ledger)
    with pytest.raises(OSError, match="injected"):
        graph.invoke({"messages": [HumanMessage("go")]}, CONFIG, durability="sync")
    assert ToolLedger(store).controller(RUN).step is Step.UNSETTLED
    result = graph.invoke(None, CONFIG, durability="sync")
    assert result["messages"][-1].content == "done"
    assert effects(path) == ["charge 7"]
    c = ToolLedger(store).controller(RUN)
    kinds = [type(event).__name__ for event in c.events
             if "Publication" in type(event).__name__ or "Reconciled" in type(event).__name__]
    assert kinds == (["PublicationStaged", "PublicationFailed", "ReconciledAcknowledge"]
                     if landed else ["PublicationStaged", "PublicationFailed",
                                     "ReconciledAppend", "PublicationCommitted"])
    assert c.phase("call-charge") is Phase.PUBLISHED
    with pytest.raises(UnsupportedFeature):
        OneWriterSaver(_Unknown(), ledger=ToolLedger(store))


class _Unknown(InMemorySaver):
    """A saver the ledger's publications do not know (not LangGraph's own)."""


SCRIPT_ONE: list[Any] = [[("charge", {"amount": 7}, "call-charge")], "done"]


class _CommitThenFail:
    """Wraps a PostgresSaver: the ``COMMIT`` that ends the transaction of the first
    checkpoint holding a ToolMessage lands, then raises, as a connection lost before the
    server's answer would."""

    def __init__(self, saver: Any) -> None:
        self.armed, self.failing = True, False
        self.put, self.execute = saver.put, saver.conn.execute
        saver.put, saver.conn.execute = self.putting, self.executing

    def putting(self, config: Any, checkpoint: Any, metadata: Any, versions: Any) -> Any:
        messages = checkpoint["channel_values"].get("messages") or []
        if self.armed and any(isinstance(m, ToolMessage) for m in messages):
            self.armed, self.failing = False, True
        return self.put(config, checkpoint, metadata, versions)

    def executing(self, query: Any, *args: Any, **options: Any) -> Any:
        done = self.execute(query, *args, **options)
        if self.failing and query == "COMMIT":
            self.failing = False
            raise OSError("injected: the commit's answer was lost")
        return done


@pytest.mark.postgres
@pytest.mark.invariant("I1", "I6", "I12")
@pytest.mark.parametrize("landed", [True, False], ids=["committed-then-raised",
                                                       "not-landed"])
def test_a_failed_checkpoint_write_on_postgres_saver_is_reconciled_by_the_next_write(
        tmp_path: Path, store: SQLiteEventStore, pg_dsn: str, pg_schema: str,
        landed: bool) -> None:
    """The same on LangGraph's PostgresSaver, whose write (the check and the put in one
    transaction, under a lock on the thread) fails before its commit (rolled back: not
    landed) or after it (the commit landed, its answer lost). The next write reconciles
    it: written again, the result answered from the ledger, or acknowledged. The tool
    runs once; the thread's checkpoints hold its result once."""
    from psycopg_pool import ConnectionPool

    from tests.drivers.langgraph_driver import postgres_saver

    path = tmp_path / "effects.txt"
    ledger = ToolLedger(store)
    inner = postgres_saver(pg_dsn, pg_schema)
    if landed:
        _CommitThenFail(inner)
    else:
        FailingPut(landed=False).attach(inner)
    saver = OneWriterSaver(inner, ledger=ledger)
    graph = build("ledger", make_tools(path), ScriptedModel(script=SCRIPT_ONE), saver,
                  ledger=ledger)
    with pytest.raises(OSError, match="injected"):
        graph.invoke({"messages": [HumanMessage("go")]}, CONFIG, durability="sync")
    assert ToolLedger(store).controller(RUN).step is Step.UNSETTLED
    result = graph.invoke(None, CONFIG, durability="sync")
    assert result["messages"][-1].content == "done"
    assert effects(path) == ["charge 7"]
    assert [m.tool_call_id for m in result["messages"] if isinstance(m, ToolMessage)] == [
        "call-charge"]
    c = ToolLedger(store).controller(RUN)
    kinds = [type(event).__name__ for event in c.events
             if "Publication" in type(event).__name__ or "Reconciled" in type(event).__name__]
    assert kinds == (["PublicationStaged", "PublicationFailed", "ReconciledAcknowledge"]
                     if landed else ["PublicationStaged", "PublicationFailed",
                                     "ReconciledAppend", "PublicationCommitted"])
    assert c.phase("call-charge") is Phase.PUBLISHED
    assert inner.conn.info.transaction_status.name == "IDLE"

    from langgraph.checkpoint.postgres import PostgresSaver

    with ConnectionPool(pg_dsn, open=True, min_size=1, max_size=1) as pool, \
            pytest.raises(UnsupportedFeature, match="PostgresSaver on one psycopg") as no:
        OneWriterSaver(PostgresSaver(cast("Any", pool)), ledger=ToolLedger(store))
    assert no.value.feature == "publications on this checkpointer"


def _sent_graph(node: Any) -> Any:
    """A graph whose first node sends the tools node a call no AIMessage holds (a tool
    call made outside the model's reply, as a fan-out node might)."""

    def fan(state: MessagesState) -> Any:
        call = {"name": "charge", "args": {"amount": 7}, "id": "sent-1", "type": "tool_call"}
        return [Send("tools", {"__type": "tool_call_with_context", "tool_call": call,
                               "state": state})]

    builder: Any = StateGraph(MessagesState)
    builder.add_node("start", lambda state: {"messages": []})
    builder.add_node("tools", node)
    builder.add_edge(START, "start")
    builder.add_conditional_edges("start", fan, ["tools"])
    builder.add_edge("tools", END)
    return builder.compile(checkpointer=InMemorySaver())


@pytest.mark.parametrize("mode", ["alone", "ledger"])
def test_a_send_of_a_call_outside_the_models_reply_is_refused_before_it_runs(
        tmp_path: Path, store: SQLiteEventStore, mode: str) -> None:
    """LangGraph alone runs a call a node sends to the tools node; the ledger cannot enter
    it with a batch (no AIMessage holds it), so it refuses it, naming the feature, and
    the tool never runs."""
    path = tmp_path / "effects.txt"
    if mode == "alone":
        _sent_graph(ToolNode(make_tools(path))).invoke({"messages": [HumanMessage("go")]},
                                                       CONFIG)
        assert effects(path) == ["charge 7"]
        return
    graph = _sent_graph(ToolLedger(store).tool_node(make_tools(path)))
    with pytest.raises(UnsupportedFeature) as refused:
        graph.invoke({"messages": [HumanMessage("go")]}, CONFIG)
    assert refused.value.feature == "Send fan-out of calls outside the model's reply"
    assert effects(path) == []


@pytest.mark.invariant("I1", "I7", "I11")
@pytest.mark.parametrize("kind", ["one file", "a ledger file of its own", "postgres"])
def test_a_resumer_about_to_be_refused_never_settles_the_winners_live_call(
        tmp_path: Path, kind: str, request: pytest.FixtureRequest) -> None:
    """Two resumers of one thread, each its own saver, store and ledger (as two
    processes), the verifier answering from the effects file. The second starts the
    moment the first looks its run up inside its first checkpoint write, and goes on
    into the tool's body while the first waits (or it waits for the first's write lock,
    then goes on). The first must never take the second's live call for one in doubt and
    have the verifier settle it as not executed: the second's result would then be
    refused, and a third resume would charge again. Found in review of a change that
    opened the run before the write lock (taken back): the one-writer check under the
    lock comes first, so the first writer is refused or goes on whole, and the charge
    happens once."""
    charges = tmp_path / "effects.txt"
    checkpoints = tmp_path / "checkpoints.db"
    in_body, release = threading.Event(), threading.Event()

    def tools(hold: bool) -> list[Any]:
        @tool
        def charge(amount: int) -> str:
            """Charge the customer."""
            if hold:
                in_body.set()
                release.wait(10)
            effect(charges, f"charge {amount}")
            return f"charged {amount}"
        return [charge]

    def verifier(context: Any) -> Any:
        return Completed("charged 7") if effects(charges) else NotExecuted()

    if kind == "postgres":
        from statemachine.postgres import PostgresEventStore
        from tests.drivers.langgraph_driver import postgres_saver

        dsn, schema = request.getfixturevalue("pg_dsn"), request.getfixturevalue("pg_schema")

        def store() -> Any:
            return PostgresEventStore(dsn, schema=schema)

        def inner() -> Any:
            return postgres_saver(dsn, schema)
    else:
        SqliteSaver(sqlite3.connect(str(checkpoints))).setup()
        ledger_file = checkpoints if kind == "one file" else tmp_path / "ledger.db"

        def store() -> Any:
            return SQLiteEventStore(str(ledger_file), timeout=5)

        def inner() -> Any:
            return SqliteSaver(sqlite3.connect(str(checkpoints), check_same_thread=False))

    def process(hold: bool) -> tuple[Any, ToolLedger]:
        ledger = ToolLedger(store(), verifiers={"charge": verifier})
        graph = build("ledger", tools(hold), ScriptedModel(script=SCRIPT_ONE),
                      OneWriterSaver(inner(), ledger=ledger), ledger=ledger)
        return graph, ledger

    second, _ = process(True)
    outcome: dict[str, Any] = {}

    def resume_second() -> None:
        try:
            outcome["second"] = second.invoke({"messages": [HumanMessage("charge me 7")]},
                                              CONFIG, durability="sync")
        except Exception as error:  # (a refusal, as the race decides)
            outcome["second"] = error

    racing = threading.Thread(target=resume_second)
    first, ledger = process(False)
    looked_up = ledger.controller

    def controller(run_id: str, **options: Any) -> Any:
        if not racing.ident:  # (the first lookup)
            racing.start()  # the second goes now, into its tool's body if it can
            in_body.wait(2)
        return looked_up(run_id, **options)

    ledger.controller = controller  # type: ignore[method-assign]
    with contextlib.suppress(ConcurrencyConflict):
        first.invoke({"messages": [HumanMessage("charge me 7")]}, CONFIG,
                     durability="sync")
    release.set()
    racing.join(30)
    assert not racing.is_alive()
    third, _ = process(False)
    with contextlib.suppress(ControlError):
        third.invoke(None, CONFIG, durability="sync")
    assert effects(charges) == ["charge 7"]


def test_a_call_id_asked_for_again_with_other_arguments_is_refused(
        tmp_path: Path, store: SQLiteEventStore) -> None:
    """The model names a call again under the id of one the ledger answered, with other
    arguments (a model reusing ids across turns): ``charge(8)`` under the id of the
    ``charge(7)`` that ran. The ledger neither runs it nor answers it with the other
    call's result (``charged 7`` for a charge of 8): `InvalidTransition`, naming the
    call. Before, it was answered with the recorded result, as if it were the same
    call."""
    path = tmp_path / "effects.txt"
    script = [[("charge", {"amount": 7}, "c1")], [("charge", {"amount": 8}, "c1")], "done"]
    ledger = ToolLedger(store)
    graph = build("ledger", make_tools(path), ScriptedModel(script=script),
                  OneWriterSaver(InMemorySaver()), ledger=ledger)
    with pytest.raises(InvalidTransition, match=r"'c1'.*other than the recorded"):
        graph.invoke({"messages": [HumanMessage("go")]}, CONFIG)
    assert effects(path) == ["charge 7"]
    assert ledger.controller(RUN).call("c1").result["content"] == "charged 7"  # as it was
