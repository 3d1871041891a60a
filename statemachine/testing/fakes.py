"""Testing helpers for runners embedding the core: a scripted model, a fault-injecting
Session, effect counters and lifecycle hooks that count, and a model and session that
fail the test if they are touched at all."""

from __future__ import annotations

import asyncio
import json
import os
from collections import Counter
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any, Literal

import attrs

from statemachine.payloads import JSON
from statemachine.runner import (
    ALLOW,
    Agent,
    AlreadyAnswered,
    FunctionTool,
    ModelResponse,
    RemoteEvent,
    RunHooks,
    ToolGuardrail,
    TransientPostError,
    Verdict,
)
from statemachine.sessions import Session
from statemachine.values import ToolCall

Outcome = Literal["atomic", "commit_then_raise", "partial", "cancel", "hang"]
OUTCOMES: tuple[Outcome, ...] = ("atomic", "commit_then_raise", "partial", "cancel", "hang")


class ScriptedModel:
    """Answers with the scripted responses in order; counts its calls."""

    def __init__(self, responses: Sequence[ModelResponse]) -> None:
        self.responses = list(responses)
        self.calls = 0

    async def respond(self, history: list[JSON], agent: Agent) -> ModelResponse:
        if self.calls >= len(self.responses):
            raise AssertionError(f"the scripted model was called {self.calls + 1} times")
        response = self.responses[self.calls]
        self.calls += 1
        return response


class InjectedWriteError(RuntimeError):
    """The error a `FlakySession` raises (the original error the runner must surface)."""


class FlakySession:
    """Wraps any Session; on the ``fail_on``-th call of ``add_items`` (1-based) it fails
    with ``outcome``:

    * ``atomic``: raises before writing anything (atomic no-commit);
    * ``commit_then_raise``: writes the whole batch, then raises;
    * ``partial``: writes the first ``k`` items, then raises;
    * ``cancel``: writes the whole batch, then raises `asyncio.CancelledError`;
    * ``hang``: never returns (cancel it with a timeout).
    """

    def __init__(self, inner: Session, *, fail_on: int, outcome: Outcome, k: int = 1) -> None:
        self.inner = inner
        self.session_id = inner.session_id
        self.fail_on = fail_on
        self.outcome = outcome
        self.k = k
        self.add_calls = 0
        self.raised: BaseException | None = None

    async def get_items(self, limit: int | None = None) -> list[JSON]:
        return await self.inner.get_items(limit)

    async def add_items(self, items: list[JSON]) -> None:
        self.add_calls += 1
        if self.add_calls != self.fail_on:
            await self.inner.add_items(items)
            return
        if self.outcome == "hang":
            await asyncio.Event().wait()
        if self.outcome in ("commit_then_raise", "cancel"):
            await self.inner.add_items(items)
        elif self.outcome == "partial":
            await self.inner.add_items(items[: self.k])
        error: BaseException = (asyncio.CancelledError() if self.outcome == "cancel" else
                                InjectedWriteError(f"injected {self.outcome} write failure"))
        self.raised = error
        raise error

    async def pop_item(self) -> JSON | None:
        return await self.inner.pop_item()

    async def clear_session(self) -> None:
        await self.inner.clear_session()


class ListSession:
    """A Session in a plain list, readable without an event loop (``items``). Items are
    copied through JSON on the way in and out, like a real store."""

    def __init__(self, session_id: str, items: Sequence[JSON] = ()) -> None:
        self.session_id = session_id
        self.items: list[JSON] = json.loads(json.dumps(list(items)))

    async def get_items(self, limit: int | None = None) -> list[JSON]:
        chosen = self.items if limit is None else self.items[-limit:] if limit > 0 else []
        result: list[JSON] = json.loads(json.dumps(chosen))
        return result

    async def add_items(self, items: list[JSON]) -> None:
        self.items += json.loads(json.dumps(items))

    async def pop_item(self) -> JSON | None:
        return self.items.pop() if self.items else None

    async def clear_session(self) -> None:
        self.items.clear()


class Counters:
    """How often each effect happened: tool bodies, guardrails and hooks, by name."""

    def __init__(self) -> None:
        self.tools: Counter[str] = Counter()
        self.guardrails: Counter[str] = Counter()
        self.hooks: Counter[str] = Counter()


def counted_tool(counters: Counters, name: str, output: Callable[..., JSON], *,
                 needs_approval: bool = False, idempotent: bool = False,
                 guarded: bool = False,
                 after_effect: Callable[[], None] | None = None) -> FunctionTool:
    """A tool whose every execution counts in ``counters.tools[name]`` before returning
    ``output(**arguments)``; ``after_effect`` runs right after the count (raise from it to
    simulate a crash after the side effect). ``guarded`` adds an input and an output
    guardrail, ``{name}_input`` and ``{name}_output``, that allow and count in
    ``counters.guardrails``."""

    def run(**arguments: Any) -> JSON:
        counters.tools[name] += 1
        if after_effect is not None:
            after_effect()
        return output(**arguments)

    def guard(guard_name: str) -> ToolGuardrail:
        def check(call: ToolCall, *tool_output: JSON) -> Verdict:
            counters.guardrails[guard_name] += 1
            return ALLOW
        return ToolGuardrail(guard_name, check)

    guards: dict[str, Any] = {}
    if guarded:
        guards = {"input_guardrails": (guard(f"{name}_input"),),
                  "output_guardrails": (guard(f"{name}_output"),)}
    return FunctionTool(name, run, needs_approval=needs_approval, idempotent=idempotent,
                        **guards)


class CountingHooks(RunHooks):
    """Lifecycle hooks that count into `Counters` (keys like ``tool_start:charge``)."""

    def __init__(self, counters: Counters) -> None:
        self.counters = counters

    async def on_agent_start(self, agent: Agent) -> None:
        self.counters.hooks["agent_start"] += 1

    async def on_agent_end(self, agent: Agent, output: JSON) -> None:
        self.counters.hooks["agent_end"] += 1

    async def on_llm_start(self, agent: Agent) -> None:
        self.counters.hooks["model_start"] += 1

    async def on_llm_end(self, agent: Agent, response: ModelResponse) -> None:
        self.counters.hooks["model_end"] += 1

    async def on_tool_start(self, agent: Agent, call: ToolCall) -> None:
        self.counters.hooks[f"tool_start:{call.name}"] += 1

    async def on_tool_end(self, agent: Agent, call: ToolCall, output: JSON) -> None:
        self.counters.hooks[f"tool_end:{call.name}"] += 1


class Untouchable:
    """A model and a Session that fail the test if anything calls them."""

    session_id: str

    def __init__(self, session_id: str = "untouchable") -> None:
        self.session_id = session_id

    def _touched(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a refused run touched the model or the Session")

    respond = get_items = add_items = pop_item = clear_session = _touched


class StreamDisconnected(ConnectionError):
    """The fake remote's stream dropped."""


class ListingFailed(ConnectionError):
    """The fake remote's history listing failed part way."""


class PermanentPostError(Exception):
    """A post the fake remote refuses for good (a 4xx)."""


PostOutcome = Literal["ok", "transient", "permanent", "commit_then_raise"]


class FakeRemote:
    """A scripted remote agent loop for `RemoteToolExecutor`.

    It emits ``tool_uses`` (call id, tool name, arguments) one per stream event, then
    ``session_end`` once every call has a result. Faults, all scripted:

    * ``disconnect_after[i]``: the i-th connection drops after that many events;
    * ``failing_listings``: those listings (1-based) raise part way;
    * ``post_outcomes[call_id]``: the outcome of each post attempt of that call (then
      ``ok``): ``transient``, ``permanent``, or ``commit_then_raise`` (the result lands,
      then the post raises a transient error).

    The remote keeps at most one result per call: a second post raises
    `AlreadyAnswered`. With ``path`` its state survives processes (a JSON file).
    """

    def __init__(self, tool_uses: Sequence[tuple[str, str, JSON]] = (), *,
                 disconnect_after: Sequence[int] = (), failing_listings: Sequence[int] = (),
                 post_outcomes: dict[str, list[PostOutcome]] | None = None,
                 path: str | None = None) -> None:
        self.path = path
        self.disconnect_after = list(disconnect_after)
        self.failing_listings = set(failing_listings)
        self.post_outcomes = dict(post_outcomes or {})
        self.history: list[RemoteEvent] = []
        self.pending = [RemoteEvent("tool_use", call_id, name, arguments)
                        for call_id, name, arguments in tool_uses]
        self.posts: Counter[str] = Counter()
        self.connections = 0
        self.listings = 0
        self.open_streams = 0
        if path is not None and os.path.exists(path):
            self._load()

    # persistence, for tests that kill the client process
    def _save(self) -> None:
        if self.path is None:
            return
        data = {"history": [attrs.asdict(e) for e in self.history],
                "pending": [attrs.asdict(e) for e in self.pending],
                "posts": dict(self.posts)}
        with open(self.path, "w") as f:
            json.dump(data, f)

    def _load(self) -> None:
        assert self.path is not None
        with open(self.path) as f:
            data = json.load(f)
        self.history = [RemoteEvent(**e) for e in data["history"]]
        self.pending = [RemoteEvent(**e) for e in data["pending"]]
        self.posts = Counter(data["posts"])

    def results(self) -> dict[str, list[JSON]]:
        """Every result the remote holds, by call id."""
        held: dict[str, list[JSON]] = {}
        for event in self.history:
            if event.kind == "tool_result" and event.call_id is not None:
                held.setdefault(event.call_id, []).append(event.result)
        return held

    def _answered(self, call_id: str) -> bool:
        return call_id in self.results()

    def _all_answered(self) -> bool:
        return all(self._answered(e.call_id) for e in self.history  # type: ignore[arg-type]
                   if e.kind == "tool_use")

    async def list_events(self) -> AsyncGenerator[RemoteEvent, None]:
        self.listings += 1
        snapshot = list(self.history)
        fail = self.listings in self.failing_listings
        for index, event in enumerate(snapshot):
            if fail and index >= len(snapshot) // 2:
                raise ListingFailed("listing failed part way")
            await asyncio.sleep(0)
            yield event
        if fail:
            raise ListingFailed("listing failed part way")

    async def events(self) -> AsyncGenerator[RemoteEvent, None]:
        self.connections += 1
        limit = (self.disconnect_after[self.connections - 1]
                 if self.connections <= len(self.disconnect_after) else None)
        self.open_streams += 1
        delivered = 0
        try:
            while True:
                if limit is not None and delivered >= limit:
                    raise StreamDisconnected("the stream dropped")
                if not self.pending:
                    if self._all_answered() and self.history:
                        end = RemoteEvent("session_end")
                        if end not in self.history:
                            self.history.append(end)
                            self._save()
                        yield end
                    return  # idle: the client reconnects and reconciles
                event = self.pending.pop(0)
                self.history.append(event)
                self._save()
                delivered += 1
                yield event
        finally:
            self.open_streams -= 1

    async def post_result(self, call_id: str, result: JSON) -> None:
        attempt = self.posts[call_id]
        self.posts[call_id] += 1
        self._save()
        outcomes = self.post_outcomes.get(call_id, [])
        outcome = outcomes[attempt] if attempt < len(outcomes) else "ok"
        if self._answered(call_id):
            raise AlreadyAnswered(call_id)
        if outcome == "transient":
            raise TransientPostError("the remote timed out")
        if outcome == "permanent":
            raise PermanentPostError("the remote refused the post")
        self.history.append(RemoteEvent("tool_result", call_id, result=result))
        self._save()
        if outcome == "commit_then_raise":
            raise TransientPostError("the answer was lost after the post landed")
