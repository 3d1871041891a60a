"""A LangGraph ReAct graph for the adapter's tests (tests/adapters/test_langgraph*.py), and
the process the kill -9 and two-resumer tests run (``python -m
tests.drivers.langgraph_driver ARGS``).

The world: a scripted chat model (its reply depends only on the conversation, so a fresh
process answers as the dead one would have), tools that append one line to an effects
file and fsync it before returning (what ran is counted from the file, never from a
ledger), and the graph ``model → [review →] tools → model``. ``mode`` ``alone`` is
LangGraph by itself (its ``ToolNode``, a plain review node that interrupts); ``ledger``
is the same graph through `statemachine.adapters.langgraph`; ``history`` also makes the
checkpoint writes the ledger's publications (``OneWriterSaver(saver, ledger=...)``);
``together`` is ``history`` with the ledger's store in the checkpoints' file (a checkpoint
that publishes written in one transaction with its publication).

Kill points (``--kill``): ``before-effect`` and ``after-effect`` inside the tool body,
``after-tool`` when LangGraph saves the tools' writes or the checkpoint holding their
result, whichever comes first (before it: LangGraph writes them on two threads, in no
fixed order), ``before-put`` when
it writes the checkpoint after them (before it), ``after-put`` right after that write.
``--agent`` builds the agent with LangChain's ``create_agent`` instead (through the ledger:
``LedgerMiddleware``); ``--durability default`` runs the graph with LangGraph's default
durability instead of ``durability="sync"``.
The checkpointer is LangGraph's ``SqliteSaver``, or its ``PostgresSaver`` with
``--pg-dsn`` (tables in ``--pg-schema``); there, through `OneWriterSaver`, ``after-put``
comes after the write's statements and before its transaction's commit.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.tools import BaseTool, tool
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition
from langgraph.types import Command, interrupt
from pydantic import Field

KILL = {"point": ""}
"""Where this process kills itself (``--kill``), once the effect has happened."""
EFFECTS = {"path": ""}


def effect(path: str | Path, line: str) -> None:
    """Append ``line`` to the effects file and make it durable (the tool's effect)."""
    with open(path, "a", encoding="utf-8") as out:
        out.write(line + "\n")
        out.flush()
        os.fsync(out.fileno())


def effects(path: str | Path) -> list[str]:
    """The effects file's lines (what ran), [] when nothing did."""
    try:
        return Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []


def die_at(point: str) -> None:
    if KILL["point"] == point:
        os.kill(os.getpid(), signal.SIGKILL)


class ScriptedModel(BaseChatModel):
    """Answers the n-th model call of a conversation with ``script[n]`` (n counts the
    AIMessages already in it): a list of tool calls ``[(name, args, id), ...]`` or a
    text. Keeps every request's messages (``requests``) and whether it was answered
    (``answered``); the k-th request raises ``failures[k]`` when that is an exception
    (``during``, when set, is called with k first)."""

    script: list[Any]
    requests: list[list[BaseMessage]] = Field(default_factory=list)
    answered: list[bool] = Field(default_factory=list)
    failures: list[Any] = Field(default_factory=list)
    during: Any = None

    @property
    def _llm_type(self) -> str:
        return "scripted"

    def _generate(self, messages: list[BaseMessage], stop: Any = None,
                  run_manager: Any = None, **kwargs: Any) -> ChatResult:
        asked = len(self.requests)
        self.requests.append(list(messages))
        self.answered.append(False)
        if self.during is not None:
            self.during(asked)
        if asked < len(self.failures) and isinstance(self.failures[asked], BaseException):
            raise self.failures[asked]
        self.answered[-1] = True
        turn = sum(isinstance(message, AIMessage) for message in messages)
        step = self.script[min(turn, len(self.script) - 1)]
        if isinstance(step, str):
            reply = AIMessage(content=step)
        else:
            reply = AIMessage(content="", tool_calls=[
                {"name": name, "args": args, "id": call_id, "type": "tool_call"}
                for name, args, call_id in step])
        return ChatResult(generations=[ChatGeneration(message=reply)])

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> Any:
        return self


def make_tools(path: str | Path, *, sleep: float = 0.0) -> list[BaseTool]:
    """``charge(amount)`` and ``notify(to)``: each appends ``name args`` to ``path``."""

    @tool
    def charge(amount: int) -> str:
        """Charge the customer."""
        die_at("before-effect")
        effect(path, f"charge {amount}")
        die_at("after-effect")
        if sleep:
            time.sleep(sleep)
        return f"charged {amount}"

    @tool
    def notify(to: str) -> str:
        """Notify someone."""
        effect(path, f"notify {to}")
        return f"notified {to}"

    return [charge, notify]


def plain_review(state: MessagesState) -> Command[Any] | None:
    """LangGraph's own review pattern (its docs' ``interrupt`` before tools): one
    interrupt for the last AIMessage's calls; a rejected call is answered with a
    ToolMessage; the batch then goes to the tool node."""
    last = state["messages"][-1]
    assert isinstance(last, AIMessage)
    decisions = interrupt({"calls": [call["id"] for call in last.tool_calls]})
    answers = [ToolMessage(content="rejected", tool_call_id=call_id, status="error")
               for call_id, made in decisions.items() if made == "reject"]
    return Command(update={"messages": answers}) if answers else None


def build(mode: str, tools: list[BaseTool], model: BaseChatModel,
          checkpointer: BaseCheckpointSaver[Any], *, ledger: Any = None,
          review: bool = False, outer: Callable[[Any, Callable[[], Any]], Any] | None = None
          ) -> Any:
    """The graph: ``model → [review →] tools → model`` on ``checkpointer``. ``outer``: a
    tool-call wrapper around the ledger's (alone: around the tool), called with the
    request and a function that puts the call through the ledger (alone: runs it; the
    tool node is then ``ToolNode(tools, wrap_tool_call=...)``, LangGraph's default error
    handling)."""

    def call_model(state: MessagesState) -> dict[str, Any]:
        return {"messages": [model.invoke(state["messages"])]}

    builder: Any = StateGraph(MessagesState)
    builder.add_node("model", call_model)
    if mode == "alone":
        bare = outer

        def around(request: Any, handler: Callable[[Any], Any]) -> Any:
            assert bare is not None
            return bare(request, lambda: handler(request))

        builder.add_node("tools", ToolNode(tools) if bare is None
                         else ToolNode(tools, wrap_tool_call=around))
        reviewer: Callable[..., Any] = plain_review
    elif outer is not None:
        wrapping = outer

        def wrapped(request: Any, handler: Callable[[Any], Any]) -> Any:
            return wrapping(request, lambda: ledger.wrap_tool_call(request, handler))

        builder.add_node("tools", ToolNode(tools, wrap_tool_call=wrapped))
        reviewer = ledger.review
    else:
        builder.add_node("tools", ledger.tool_node(tools))
        reviewer = ledger.review
    builder.add_edge(START, "model")
    if review:
        builder.add_node("review", reviewer)
        builder.add_conditional_edges("model", tools_condition, {"tools": "review",
                                                                 END: END})
        builder.add_edge("review", "tools")
    else:
        builder.add_conditional_edges("model", tools_condition)
    builder.add_edge("tools", "model")
    return builder.compile(checkpointer=checkpointer)


class KillingSaver:
    """Wraps a checkpointer's ``put_writes`` and ``put`` with the kill points around the
    checkpoint write after the tools ran (the effects file is not empty)."""

    def __init__(self, saver: Any, path: str | Path) -> None:
        self.saver = saver
        self.path = path
        put_writes, put = saver.put_writes, saver.put

        def writes(config: Any, items: Any, task_id: str, task_path: str = "") -> None:
            if effects(path) and any(channel == "messages" and _tool_result(value)
                                     for channel, value in items):
                die_at("after-tool")
            put_writes(config, items, task_id, task_path)

        def putting(config: Any, checkpoint: Any, metadata: Any, versions: Any) -> Any:
            after_tools = effects(path) and _holds_tool_result(checkpoint)
            if after_tools:  # LangGraph may write this checkpoint before the tools'
                die_at("after-tool")  # writes (two threads): die before either is saved
                die_at("before-put")
            done = put(config, checkpoint, metadata, versions)
            if after_tools:
                die_at("after-put")
            return done

        saver.put_writes = writes
        saver.put = putting


class FailingPut:
    """Fails checkpoint writes that hold a ToolMessage, the next ``times`` of them: each
    raises `InjectedPutError` after it landed (``landed=True``) or before. `attach` it to
    each saver (a process's own connection) the thread is written through; the count is
    shared."""

    def __init__(self, *, landed: bool, times: int = 1) -> None:
        self.landed, self.left = landed, times

    def attach(self, saver: Any) -> Any:
        put = saver.put

        def failing(config: Any, checkpoint: Any, metadata: Any, versions: Any) -> Any:
            if self.left and _holds_tool_result(checkpoint):
                self.left -= 1
                if self.landed:
                    put(config, checkpoint, metadata, versions)
                raise InjectedPutError("injected: the checkpoint write failed")
            return put(config, checkpoint, metadata, versions)

        saver.put = failing
        return saver


class InjectedPutError(OSError):
    """The error `FailingPut` raises."""


def _tool_result(value: Any) -> bool:
    items = value if isinstance(value, list) else [value]
    return any(isinstance(item, ToolMessage) for item in items)


def _holds_tool_result(checkpoint: Any) -> bool:
    messages = (checkpoint.get("channel_values") or {}).get("messages") or []
    return any(isinstance(message, ToolMessage) for message in messages)


SCRIPT: list[Any] = [[("charge", {"amount": 7}, "call-charge")], "done"]


def postgres_saver(dsn: str, schema: str) -> Any:
    """LangGraph's ``PostgresSaver`` on one connection (as its ``from_conn_string`` opens
    it) whose tables live in ``schema`` (created here; its tables set up)."""
    import psycopg
    from langgraph.checkpoint.postgres import PostgresSaver
    from psycopg.rows import dict_row

    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
    conn = psycopg.connect(dsn, autocommit=True, prepare_threshold=0,
                           row_factory=dict_row, options=f"-c search_path={schema}")
    saver = PostgresSaver(cast("Any", conn))
    saver.setup()
    return saver


def ledger_file(mode: str) -> str:
    """The file of the ledger's store in ``mode`` (in the folder)."""
    return "checkpoints.db" if mode == "together" else "ledger.db"


def main(argv: list[str] | None = None) -> int:
    from langgraph.checkpoint.sqlite import SqliteSaver

    from statemachine import ControlError, SQLiteEventStore
    from statemachine.adapters.langgraph import OneWriterSaver, ToolLedger, decision

    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["alone", "ledger", "history", "together"],
                        required=True)
    parser.add_argument("--folder", required=True)
    parser.add_argument("--action", choices=["start", "resume", "approve", "fork"], required=True)
    parser.add_argument("--kill", default="")
    parser.add_argument("--review", action="store_true")
    parser.add_argument("--go", default="")
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--pg-dsn", default="", help="PostgresSaver on this server")
    parser.add_argument("--pg-schema", default="", help="its schema (search_path)")
    parser.add_argument("--durability", choices=["sync", "default"], default="sync",
                        help="invoke(durability='sync'), or LangGraph's default")
    parser.add_argument("--agent", action="store_true",
                        help="LangChain's create_agent (LedgerMiddleware through the "
                             "ledger) instead of the hand-built graph")
    args = parser.parse_args(argv)
    folder = Path(args.folder)
    KILL["point"] = args.kill
    path = folder / "effects.txt"
    import sqlite3

    saver: Any
    if args.pg_dsn:
        saver = postgres_saver(args.pg_dsn, args.pg_schema)
    else:
        connection = sqlite3.connect(folder / "checkpoints.db", check_same_thread=False,
                                     timeout=30)
        saver = SqliteSaver(connection)
    KillingSaver(saver, path)
    ledger = None
    if args.mode != "alone":
        ledger = ToolLedger(SQLiteEventStore(str(folder / ledger_file(args.mode))),
                            approvals=["charge"] if args.review else ())
        saver = OneWriterSaver(saver, ledger=None if args.mode == "ledger" else ledger)
    graph: Any
    if args.agent:
        from langchain.agents import create_agent

        from statemachine.adapters.langgraph import LedgerMiddleware

        graph = create_agent(ScriptedModel(script=SCRIPT), make_tools(path, sleep=args.sleep),
                             middleware=[] if ledger is None else [LedgerMiddleware(ledger)],
                             checkpointer=saver)
    else:
        graph = build("alone" if ledger is None else "ledger",
                      make_tools(path, sleep=args.sleep), ScriptedModel(script=SCRIPT), saver,
                      ledger=ledger, review=args.review)
    durable: dict[str, Any] = {"durability": "sync"} if args.durability == "sync" else {}
    config = {"configurable": {"thread_id": "t1"}}
    value: Any = None
    paused = graph.get_state(config).config  # what a resumer saw, before the instant
    if args.action == "fork":  # each check of the thread's latest takes a while
        reads = saver.saver.get_tuple if ledger is not None else saver.get_tuple

        def slow(config: Any) -> Any:
            found = reads(config)
            time.sleep(1.0)
            return found

        (saver.saver if ledger is not None else saver).get_tuple = slow
    if args.action == "approve":  # what the resumer saw paused, before the instant
        (pending,) = graph.get_state(config).interrupts
        if args.mode == "alone":
            value = dict.fromkeys(pending.value["calls"], "approve")
        else:
            value = {item["call_id"]: decision("approve", item["fingerprint"])
                     for item in pending.value["pending"]}
    if args.go:  # ready: wait for the instant both resumers go
        Path(args.go + f".ready-{os.getpid()}").touch()
        while not Path(args.go).exists():
            time.sleep(0.01)
    try:
        if args.action == "start":
            result = graph.invoke({"messages": [HumanMessage("charge me 7")]}, config,
                                  **durable)
        elif args.action == "resume":
            result = graph.invoke(None, config, **durable)
        elif args.action == "fork":
            graph.update_state(paused, {"messages": [AIMessage(f"writer {os.getpid()}")]})
            print(json.dumps({"written": paused["configurable"]["checkpoint_id"]}))
            return 0
        else:
            result = graph.invoke(Command(resume=value), config, **durable)
    except ControlError as refused:
        print(json.dumps({"refused": type(refused).__name__, "reason": refused.reason}))
        return 3
    last = result["messages"][-1]
    print(json.dumps({"interrupted": bool(result.get("__interrupt__")),
                      "last": last.content if isinstance(last.content, str) else ""}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
