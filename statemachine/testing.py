"""Testing helpers for runners embedding the core: a scripted model, a fault-injecting
Session, effect counters and lifecycle hooks that count, and a model and session that
fail the test if they are touched at all."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence
from typing import Any, Literal

from statemachine.payloads import JSON
from statemachine.runner import Agent, ModelResponse, RunHooks
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


class Counters:
    """How often each effect happened: tool bodies, guardrails and hooks, by name."""

    def __init__(self) -> None:
        self.tools: Counter[str] = Counter()
        self.guardrails: Counter[str] = Counter()
        self.hooks: Counter[str] = Counter()


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
