"""The partial-approval scenario on LangGraph (PyPI ``langgraph``), beside ours: the
median wall time of the whole scenario, built the way LangGraph pauses for a human
decision (``interrupt``) and resumes (``Command(resume=...)``) from an in-memory
checkpointer (``InMemorySaver``). A scripted model; nothing here calls a real model.

The scenario, as `bench.suite.partial_approval` plays it on our reference runner:

1. the model proposes two approval-gated calls, ``charge(x=7)`` and ``notify()``; the run
   pauses with both awaiting a decision;
2. the caller approves charge only and resumes; charge runs; its output is written to the
   Session, and the write raises after it landed (commit, then raise); the error reaches
   the caller;
3. the caller recovers by resuming the same thread from its checkpoint: charge's output is
   already in the Session, so charge does not run again (the node reads the Session first,
   as a careful LangGraph tool node must: a node re-executes from its start on resume);
   the run pauses on notify alone;
4. the caller approves notify and resumes; notify runs, its output is written, the model
   answers with the final output ``done``.

The graph: ``model`` (scripted: two calls, then an output) → ``tools`` (one ``interrupt``
carrying the calls still undecided; the resume value maps call ids to ``"approve"``; each
approved call runs unless the Session holds its output, and its output is written) →
``tools`` again while a call is undecided, else ``model`` → end. Each repeat builds a fresh
graph, checkpointer and Session inside the timed region. Every repeat is checked: charge
and notify ran once each, two model calls, the injected error surfaced once, the Session
holds the input, both outputs and the final output; a mismatch raises RuntimeError. One
untimed warm-up run goes first.

`partial_approval_ms` raises ImportError when ``langgraph`` is not installed.
"""

from __future__ import annotations

import gc
import operator
import statistics
import time
from collections.abc import Callable
from typing import Annotated, Any, TypedDict


class InjectedWriteFailure(OSError):
    """The one failure injected into the Session write of charge's output."""


class _Session:
    """A list of items whose next write, when armed, lands and then raises."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.fail_next = False
        self.raised = 0

    def add(self, item: dict[str, Any]) -> None:
        self.items.append(item)
        if self.fail_next:
            self.fail_next = False
            self.raised += 1
            raise InjectedWriteFailure("injected: the write landed, then failed")

    def has_output(self, call_id: str) -> bool:
        return any(item.get("call_id") == call_id for item in self.items)


class _State(TypedDict):
    calls: list[dict[str, Any]]
    done: Annotated[list[str], operator.add]
    output: str | None


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise RuntimeError(f"langgraph scenario diverged: {what}")


def _once() -> None:
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.graph import END, START, StateGraph
    from langgraph.types import Command, interrupt

    session = _Session()
    ran: list[str] = []
    model_calls = [0]
    tools: dict[str, Callable[..., str]] = {"charge": lambda x: f"charged {x}",
                                             "notify": lambda: "notified"}

    def model(state: _State) -> dict[str, Any]:
        model_calls[0] += 1
        if model_calls[0] == 1:
            return {"calls": [{"id": "charge", "name": "charge", "args": {"x": 7}},
                              {"id": "notify", "name": "notify", "args": {}}]}
        return {"output": "done"}

    def run_tools(state: _State) -> dict[str, Any]:
        undecided = [c for c in state["calls"] if c["id"] not in state["done"]]
        decisions = interrupt({"undecided": [c["id"] for c in undecided]})
        finished = []
        for call in undecided:
            if decisions.get(call["id"]) != "approve":
                continue
            if not session.has_output(call["id"]):  # a write that landed is not redone
                ran.append(call["id"])
                output = tools[call["name"]](**call["args"])
                session.add({"call_id": call["id"], "output": output})
            finished.append(call["id"])
        return {"done": finished}

    def after_model(state: _State) -> str:
        return END if state.get("output") is not None else "tools"

    def after_tools(state: _State) -> str:
        return "tools" if len(state["done"]) < len(state["calls"]) else "model"

    builder: Any = StateGraph(_State)
    builder.add_node("model", model)
    builder.add_node("tools", run_tools)
    builder.add_edge(START, "model")
    builder.add_conditional_edges("model", after_model, ["tools", END])
    builder.add_conditional_edges("tools", after_tools, ["tools", "model"])
    graph = builder.compile(checkpointer=InMemorySaver())
    config: Any = {"configurable": {"thread_id": "partial"}}

    session.add({"role": "user", "content": "charge me"})
    paused = graph.invoke({"calls": [], "done": [], "output": None}, config)
    _check(paused["__interrupt__"][0].value["undecided"] == ["charge", "notify"],
           "the first pause should hold both calls")
    session.fail_next = True
    try:
        graph.invoke(Command(resume={"charge": "approve"}), config)
    except InjectedWriteFailure:
        pass
    else:
        _check(False, "the injected write failure did not surface")
    recovered = graph.invoke(Command(resume={"charge": "approve"}), config)
    _check(recovered["__interrupt__"][0].value["undecided"] == ["notify"],
           "the recovered run should pause on notify alone")
    final = graph.invoke(Command(resume={"notify": "approve"}), config)
    session.add({"role": "assistant", "content": final["output"]})
    _check(final["output"] == "done", "final output")
    _check(ran == ["charge", "notify"], f"tools ran {ran}, want each exactly once")
    _check(model_calls[0] == 2, "two model calls")
    _check(session.raised == 1, "the write should fail exactly once")
    _check(len(session.items) == 4, "Session: the input, two outputs, the final output")


def partial_approval_ms(repeats: int = 20) -> float:
    """Median wall time (ms) of the whole partial-approval scenario on LangGraph."""
    import langgraph.graph  # noqa: F401  -- ImportError here when LangGraph is absent

    _once()  # warm-up
    times = []
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter()
        _once()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


if __name__ == "__main__":
    from importlib.metadata import version

    print(f"langgraph {version('langgraph')}: partial approval {partial_approval_ms():.2f} ms")
