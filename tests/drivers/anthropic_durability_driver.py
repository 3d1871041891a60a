"""The Anthropic adapter's runs killed with SIGKILL at every durable boundary
(tests/adapters/test_anthropic_durability.py): the effect-boundary test of
tests/storage/test_durability.py, through `MessageToolLedger` and `LedgerSessionToolRunner`.

Each run has two tool calls: ``pay`` (not idempotent) and ``lookup`` (idempotent).

* ``messages``: a ``messages.create`` loop through the ledger (``create`` / ``run_tools``)
  against a scripted model that asks for both calls in one reply, then answers with the
  ``pay`` result; a user retrying goes on from the messages the loop saved
  (`tests.drivers.anthropic_driver.SavedHistory`, DIR/history.json). Mode ``history``:
  buffered, the conversation also kept in a `SQLiteSession` on the store's file (`HISTORY`),
  written with the run's end.
* ``session``: a managed session (tests.drivers.anthropic_driver.FakeSession, its history in
  DIR/remote.json) that asks this client for both calls; the run ends when the session
  does.

Every effect appends an fsynced line to DIR/effects.txt (``tool pay``, ``model request``)
and first reads the *durable* log (a read-only store on the same file, as a restarted
process would); it notes in DIR/violations.txt an effect the log does not allow yet: a
tool whose start is not durable, a request or a post carrying a result that is not
durably recorded as exactly what is sent.

The process counts its boundaries (`crash_driver.Ticks`) and kills itself at the chosen
one: ``record`` (an event recorded, buffered or about to be appended), ``flush-before`` /
``flush-after`` (a store append), ``effect`` (an effect's line written), ``post-before``
/ ``post-after`` (a result post reaching the server, and landing). The adapter builds its
controllers through `RunController` (replaced here, in the forked child only, by
`Ticking`).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import httpx2
from anthropic import Anthropic
from anthropic.lib.tools import beta_async_tool, beta_tool

import statemachine.adapters.anthropic as adapter
from statemachine import (
    ConcurrencyConflict,
    RunController,
    SQLiteEventStore,
    Step,
    ToolInDoubt,
)
from statemachine.events import Event, ToolStarted
from statemachine.machine import replay
from statemachine.payloads import JSON
from statemachine.sqlite import SQLiteSession
from statemachine.values import Phase
from tests.drivers.anthropic_driver import (
    SESSION_ID,
    FakeSession,
    SavedHistory,
    client_for,
    converse,
    tool_use,
)
from tests.drivers.crash_driver import Effects, Ticks, append_line
from tests.drivers.durability_driver import TickingAsyncStore, TickingStore, run_forked
from tests.drivers.durability_driver import log as durable_log

RUN_ID = "durable"
MODES = {"messages": ("per-event", "buffered", "history"),
         "session": ("per-event", "buffered", "async")}
HISTORY = "chat"
"""The Session a ``history`` run keeps its conversation in (the store's file)."""
EFFECTS = "effects.txt"
VIOLATIONS = "violations.txt"
REMOTE = "remote.json"


class Ticking(RunController):
    """A controller that ticks right after each event is recorded (buffered: before its
    flush; per event: after its append)."""

    ticks: ClassVar[Ticks]

    def _record(self, action: str, event: Event) -> Step:
        dest = super()._record(action, event)
        self.ticks(f"record {type(event).__name__}")
        return dest


class SkipsFlushBeforeTools(Ticking):
    """A broken adapter's controller, for the test of the test: the flush before a tool
    body does nothing (the start is appended with a later batch)."""

    def flush(self) -> None:
        if self.unflushed and isinstance(self._journal.events[-1], ToolStarted):
            return
        super().flush()

    async def flush_async(self) -> None:
        if self.unflushed and isinstance(self._journal.events[-1], ToolStarted):
            return
        await super().flush_async()


class Checker:
    """Reads the durable log before an effect and notes an effect it does not allow."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def _state(self) -> Any:
        events = log(self.folder)
        return replay(RUN_ID, events) if events else None

    def _note(self, what: str) -> None:
        append_line(self.folder / VIOLATIONS, what)

    def tool(self, call_id: str) -> None:
        s = self._state()
        record = None if s is None else s.calls.get(call_id)
        if record is None or record.phase is not Phase.STARTED:
            self._note(f"tool {call_id} ran with its call {record and record.phase}")

    def sent(self, call_id: str, payload: JSON) -> None:
        """``payload`` (a tool_result block or a result event) goes out: the durable log
        holds it as the call's recorded result (a model request needs no flush of its own,
        DESIGN §7.7, but the results it carries are made durable first: `flush_results`)."""
        s = self._state()
        record = None if s is None else s.calls.get(call_id)
        if record is None or record.phase not in (Phase.COMPLETED, Phase.PUBLISHED) or (
                record.result != payload):
            self._note(f"the result of {call_id} was sent with its call "
                       f"{record and record.phase}")


def _outcome(c: RunController, **more: Any) -> dict[str, Any]:
    return {"outcome": "completed" if c.step is Step.COMPLETED else c.step.value, **more}


# ------------------------------------------------------------------ messages


def _model(checker: Checker, effect: Effects) -> Callable[[httpx2.Request], httpx2.Response]:
    def handle(request: httpx2.Request) -> httpx2.Response:
        messages = json.loads(request.content)["messages"]
        for message in messages:
            content = message["content"]
            for block in content if isinstance(content, list) else ():
                if block.get("type") == "tool_result":
                    checker.sent(block["tool_use_id"], block)
        effect("model request")
        last = messages[-1]["content"]
        results = {b["tool_use_id"]: b["content"] for b in last if isinstance(b, dict)
                   and b.get("type") == "tool_result"} if isinstance(last, list) else {}
        if results:
            blocks: list[dict[str, Any]] = [{"type": "text",
                                             "text": f"paid: {results['tu_pay']}"}]
        else:
            blocks = [{"type": "tool_use", "id": "tu_pay", "name": "pay",
                       "input": {"amount": 7}},
                      {"type": "tool_use", "id": "tu_lookup", "name": "lookup",
                       "input": {"q": "rate"}}]
        return httpx2.Response(200, json={
            "id": "msg", "type": "message", "role": "assistant", "model": "claude-test",
            "content": blocks, "stop_reason": "end_turn" if results else "tool_use",
            "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1}})

    return handle


async def messages(folder: Path, mode: str, ticks: Ticks) -> dict[str, Any]:
    """One process's attempt: the conversation from its first message."""
    from statemachine.adapters.anthropic import MessageToolLedger

    checker, effect = Checker(folder), Effects(folder, ticks)

    @beta_tool
    def pay(amount: int) -> str:
        """Pay."""
        checker.tool("tu_pay")
        effect("tool pay")  # a kill here leaves the call in doubt
        return f"charged {amount}"

    @beta_tool
    def lookup(q: str) -> str:
        """Look up."""
        checker.tool("tu_lookup")
        effect("tool lookup")
        return f"{q} is 1.0"

    client = Anthropic(api_key="test-key", max_retries=0, http_client=httpx2.Client(
        transport=httpx2.MockTransport(_model(checker, effect))))
    store = TickingStore(folder / "events.db", ticks)
    params: dict[str, Any] = {"model": "claude-test", "max_tokens": 64,
                              "tools": [pay.to_dict(), lookup.to_dict()]}
    try:
        ledger = MessageToolLedger.open(RUN_ID, [pay, lookup], store=store,
                                        idempotent={"lookup"}, owner=str(os.getpid()),
                                        buffered=mode != "per-event",
                                        history=SQLiteSession(HISTORY, folder / "events.db")
                                        if mode == "history" else None)
        reply = converse(ledger, client, SavedHistory(folder, "pay 7"), **params)
        return _outcome(ledger.controller, final=reply.content[0].text,
                        replayed=ledger.replayed)
    except ToolInDoubt as error:
        return {"outcome": "in_doubt", "call_id": error.call_id}
    except ConcurrencyConflict as error:
        return {"outcome": "conflict", "action": error.action}
    finally:
        store.close()


# ------------------------------------------------------------------- session


class TickingSession(FakeSession):
    """The managed session: a post is checked against the durable log, and ticks before
    it reaches the server and once it landed."""

    def __init__(self, folder: Path, ticks: Ticks, checker: Checker) -> None:
        self.ticks = ticks
        self.checker = checker
        super().__init__([tool_use("tu_pay", "pay", {"amount": 7}),
                          tool_use("tu_lookup", "lookup", {"q": "rate"})],
                         path=folder / REMOTE, on_post=self._posting)

    def _posting(self, event: dict[str, Any]) -> None:
        self.checker.sent(event["custom_tool_use_id"], event)
        self.ticks(f"post-before {event['custom_tool_use_id']}")

    def _append(self, event: dict[str, Any]) -> None:
        super()._append(event)
        self.ticks(f"post-after {event.get('custom_tool_use_id')}")


async def session(folder: Path, mode: str, ticks: Ticks) -> dict[str, Any]:
    """One process's attempt: the session runner until the session ends."""
    from statemachine.adapters.anthropic import LedgerSessionToolRunner

    checker, effect = Checker(folder), Effects(folder, ticks)

    @beta_async_tool
    async def pay(amount: int) -> str:
        """Pay."""
        checker.tool("tu_pay")
        effect("tool pay")  # a kill here leaves the call in doubt
        return f"charged {amount}"

    @beta_async_tool
    async def lookup(q: str) -> str:
        """Look up."""
        checker.tool("tu_lookup")
        effect("tool lookup")
        return f"{q} is 1.0"

    server = TickingSession(folder, ticks, checker)
    path = folder / "events.db"
    store: Any = TickingAsyncStore(path, ticks) if mode == "async" else TickingStore(path,
                                                                                      ticks)
    try:
        runner = await LedgerSessionToolRunner.open(
            client_for(server), SESSION_ID, tools=[pay, lookup], store=store, run_id=RUN_ID,
            idempotent={"lookup"}, owner=str(os.getpid()), buffered=mode == "buffered",
            max_idle=None)
        async for _ in runner:
            pass
        return _outcome(runner.controller, replayed=runner.replayed)
    except ToolInDoubt as error:
        return {"outcome": "in_doubt", "call_id": error.call_id}
    except ConcurrencyConflict as error:
        return {"outcome": "conflict", "action": error.action}
    finally:
        if mode == "async":
            await store.close()
        else:
            store.close()


# ------------------------------------------------------------- run in a forked process


def warm(folder: Path) -> None:
    """Run each scenario once in this process (in ``folder``, left to the caller): the
    SDK builds its response models' schemas on first use, and children forked afterwards
    inherit them instead of each spending a second on it."""
    for scenario in MODES:
        where = folder / scenario
        where.mkdir()
        body = {"messages": messages, "session": session}[scenario]
        asyncio.run(body(where, "per-event", Ticks(where)))



def fork(folder: Path, scenario: str, mode: str, kill_at: int | None, *,
         broken: bool = False) -> dict[str, Any] | None:
    """One attempt in a forked child (`durability_driver.run_forked`), killed at tick
    ``kill_at``; its outcome with ``ticks``, or None if it was killed. ``broken``: with
    `SkipsFlushBeforeTools`."""
    body = {"messages": messages, "session": session}[scenario]

    async def attempt(ticks: Ticks) -> dict[str, Any]:
        Ticking.ticks = ticks
        # (in this child only)
        vars(adapter)["RunController"] = SkipsFlushBeforeTools if broken else Ticking
        return await body(folder, mode, ticks)

    return run_forked(folder, attempt, kill_at)


# ------------------------------------------------------------------ what it left


def history(folder: Path) -> list[Any]:
    """What the ``history`` run's Session holds, read as another process would."""
    reader = SQLiteEventStore(folder / "events.db", readonly=True)
    try:
        return reader.session_items(HISTORY)
    finally:
        reader.close()


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def effects(folder: Path) -> list[str]:
    return _lines(folder / EFFECTS)


def violations(folder: Path) -> list[str]:
    return _lines(folder / VIOLATIONS)


def log(folder: Path) -> list[Event]:
    return durable_log(folder, RUN_ID)


def posted(folder: Path) -> dict[str, list[Any]]:
    """The session's results by call id, as its history holds them."""
    path = folder / REMOTE
    events = json.loads(path.read_text())["events"] if path.exists() else []
    found: dict[str, list[Any]] = {}
    for event in events:
        if "custom_tool_use_id" in event:
            found.setdefault(event["custom_tool_use_id"], []).append(event["content"])
    return found
