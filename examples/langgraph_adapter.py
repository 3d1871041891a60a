"""A LangChain agent (``create_agent``) with the tool ledger underneath, offline.

The agent's model (a scripted chat model: it asks for ``charge(amount=7)``, then reports
the result) runs on LangGraph's own ``SqliteSaver``, wrapped by ``OneWriterSaver`` (one
writer per thread; the checkpoint writes that carry tool results are the ledger's
publications); the
``LedgerMiddleware`` puts every tool call through a ``ToolLedger`` on a SQLite event
store, and asks for approval of ``charge`` (one ``interrupt()`` per batch, each call shown
with its fingerprint). The first process approves and resumes; the charge goes through
and the process is killed (SIGKILL) before the tool returns. A second process resumes
the thread: LangGraph alone would run the tools node again and charge twice; through the
ledger the call is in doubt and the graph refuses to go on (``ToolInDoubt``). The operator
checks the payment system and records what happened (``statemachine.operator.resolve``,
or ``statemachine resolve`` on the command line); the graph then finishes with that
outcome, and the tool never runs again.

Run it: ``python examples/langgraph_adapter.py`` (needs
``pip install 'agent-statemachine[langgraph]'``; it starts both processes itself, in a
fresh temporary directory, and never touches the network). It exits 0.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from langchain.agents import create_agent
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.tools import tool
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.types import Command

from statemachine import Resolution, SQLiteEventStore, ToolInDoubt, operator
from statemachine.adapters.langgraph import (
    LedgerMiddleware,
    OneWriterSaver,
    ToolLedger,
    decision,
)

CONFIG: Any = {"configurable": {"thread_id": "order-42"}}
RUN_ID = "langgraph:order-42"


class Scripted(BaseChatModel):
    """Asks for charge(amount=7); once a tool result is in, reports it."""

    @property
    def _llm_type(self) -> str:
        return "scripted"

    def _generate(self, messages: list[BaseMessage], stop: Any = None,
                  run_manager: Any = None, **kwargs: Any) -> ChatResult:
        results = [m.content for m in messages if isinstance(m, ToolMessage)]
        if results:
            reply = AIMessage(content=f"done: {results[-1]}")
        else:
            reply = AIMessage(content="", tool_calls=[{
                "name": "charge", "args": {"amount": 7}, "id": "call-1",
                "type": "tool_call"}])
        return ChatResult(generations=[ChatGeneration(message=reply)])

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> Any:
        return self


def agent(folder: Path, *, die_after_charging: bool) -> Any:
    @tool
    def charge(amount: int) -> str:
        """Charge the customer."""
        with open(folder / "charges.txt", "a") as charges:  # the real side effect
            charges.write(f"{amount}\n")
        if die_after_charging:
            os.kill(os.getpid(), signal.SIGKILL)  # the process dies inside the tool
        return f"charged {amount}"

    ledger = ToolLedger(SQLiteEventStore(str(folder / "events.db")), approvals=["charge"])
    saver = SqliteSaver(sqlite3.connect(folder / "checkpoints.db", check_same_thread=False))
    return create_agent(Scripted(), [charge], middleware=[LedgerMiddleware(ledger)],
                        checkpointer=OneWriterSaver(saver, ledger=ledger))


def first_process(folder: Path) -> None:
    graph = agent(folder, die_after_charging=True)
    paused = graph.invoke({"messages": [HumanMessage("charge me 7")]}, CONFIG)
    (asked,) = paused["__interrupt__"]
    (call,) = asked.value["pending"]
    print(f"paused: {call['name']}({call['args']}) awaits approval, fingerprint "
          f"{call['fingerprint'][:12]}...")
    graph.invoke(Command(resume={call["call_id"]: decision("approve", call["fingerprint"])}),
                 CONFIG)  # charge runs, and the process is killed inside it


def second_process(folder: Path) -> None:
    graph = agent(folder, die_after_charging=False)
    try:
        graph.invoke(None, CONFIG)
    except ToolInDoubt as refused:
        print(f"resumed: refused, {refused.reason[:60]}...")
    else:
        raise SystemExit("the resumed graph should have refused the call in doubt")
    store = SQLiteEventStore(str(folder / "events.db"))
    (waiting,) = operator.inbox(store)
    print(f"inbox: {waiting.call_id} ({waiting.tool}) is {waiting.kind}")
    operator.resolve(store, RUN_ID, "call-1", outcome=Resolution.COMPLETED,
                     output="charged 7", by="alice", evidence="payment 981 at the bank")
    result = graph.invoke(None, CONFIG)
    print(f"settled by the operator: {result['messages'][-1].content}")


def main() -> int:
    if len(sys.argv) == 3:
        role, folder = sys.argv[1], Path(sys.argv[2])
        (first_process if role == "first" else second_process)(folder)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        first = subprocess.run([sys.executable, __file__, "first", tmp],
                               capture_output=True, text=True, check=False)
        print(first.stdout, end="")
        print(f"first process: killed by signal {-first.returncode} inside the tool")
        second = subprocess.run([sys.executable, __file__, "second", tmp],
                                capture_output=True, text=True, check=False)
        print(second.stdout, end="")
        if second.returncode != 0:
            print(second.stderr, file=sys.stderr)
            return 1
        charges = (Path(tmp) / "charges.txt").read_text().split()
        print(f"charges at the bank: {charges} (LangGraph alone would have charged twice)")
        return 0 if charges == ["7"] else 1


if __name__ == "__main__":
    sys.exit(main())
