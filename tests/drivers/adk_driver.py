"""A Google ADK agent for the adapter's tests (tests/adapters/test_google_adk*.py), and
the process the kill -9 and two-resumer tests run (``python -m tests.drivers.adk_driver
ARGS``).

The world: a scripted model (its reply depends only on the request's contents, so a
fresh process answers as the dead one would have: it calls each scripted function call
the conversation does not hold yet, in one batch, then answers "done"), tools that append
one line to an effects file and fsync it before returning (what ran is counted from the
file, never from a ledger), ADK's ``Runner`` on a session service. ``mode`` ``alone`` is
ADK by itself; ``ledger`` is the same runner with `LedgerPlugin` and
`OneWriterSessionService`.

Kill points (``--kill``): ``before-effect`` inside the body before its line (through the
ledger its start is durable), ``after-effect`` inside the body once its line is durable,
``after-callback`` in the agent's own ``after_tool_callback`` (which the ledger runs
before it records the result: what the callback made of it is what the ledger keeps),
``before-append`` when the session service is asked to append the function responses
(before it; through the ledger, once the plugin staged their publication, the results
riding with it, or, with ``--no-publications``, once each result was flushed as it was
recorded), ``after-append`` once ADK's own session service has written them (through
the ledger, before the publication's commit is recorded), ``model-answer`` when the
model is asked again with the function responses (the scripted model's request). With
``--flow confirm`` the process asks for a confirmed wire (``"go"``, then the
confirmation ADK asked for, in one process) and dies around recording the confirmation:
``before-decision`` / ``after-decision`` when the ledger's append holding the approval
is made (before it, after it), ``at-decision`` (ADK alone, which records no
decision but the session's) when the confirmed call reaches the tool callbacks.

``--no-publications``: `OneWriterSessionService` without the plugin (the ledger flushes
each result as it records it, and publishes them in its own history).

``--hold`` FILE: once the run is open (through the ledger: loaded and claimed), the
process writes ``opened-<pid>`` beside the effects and waits for FILE, so two resumers
are both past their load before either goes on.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path
from typing import Any

from google.adk.agents import LlmAgent
from google.adk.apps import App, ResumabilityConfig
from google.adk.models.base_llm import BaseLlm
from google.adk.models.llm_request import LlmRequest
from google.adk.models.llm_response import LlmResponse
from google.adk.plugins.base_plugin import BasePlugin
from google.adk.runners import Runner
from google.adk.sessions import InMemorySessionService
from google.adk.sessions.base_session_service import BaseSessionService
from google.adk.sessions.sqlite_session_service import SqliteSessionService
from google.adk.tools.function_tool import FunctionTool
from google.adk.tools.long_running_tool import LongRunningFunctionTool
from google.genai import types
from pydantic import Field

from statemachine import tool_context

APP = "app"
USER = "u"
SESSION = "s1"
RUN = f"adk:{APP}/{USER}/{SESSION}"
KILL = {"point": ""}
EFFECTS = {"path": ""}
KEYS: list[str] = []
"""The idempotency keys the tool bodies saw (`statemachine.tool_context`)."""


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


Call = tuple[str, str, dict[str, Any]]
"""A scripted function call: (id, tool name, arguments)."""


class ModelUnavailable(ConnectionError):
    """A model request that failed (`ScriptedModel.failing`)."""


class ScriptedModel(BaseLlm):
    """Calls, in one batch, each scripted function call the request does not hold yet;
    once all are in the conversation, answers ``"done"``. Each request's function
    responses are kept (``seen``), and whether it was answered; the next ``failing``
    requests that carry a function response raise `ModelUnavailable`."""

    model: str = "scripted"
    script: list[Call] = Field(default_factory=list)
    requests: int = 0
    seen: list[list[tuple[str, Any]]] = Field(default_factory=list)
    answered: list[bool] = Field(default_factory=list)
    failing: int = 0

    async def generate_content_async(self, llm_request: LlmRequest, stream: bool = False
                                     ) -> AsyncGenerator[LlmResponse, None]:
        self.requests += 1
        responses = [(str(part.function_response.id), part.function_response.response)
                     for content in llm_request.contents for part in content.parts or ()
                     if part.function_response]
        self.seen.append(responses)
        self.answered.append(False)
        if responses:
            die_at("model-answer")
        if responses and self.failing:
            self.failing -= 1
            raise ModelUnavailable("injected model request failure")
        self.answered[-1] = True
        called = {part.function_call.id for content in llm_request.contents
                  for part in content.parts or () if part.function_call}
        todo = [call for call in self.script if (call[0] or None) not in called]
        if todo:  # an id "" is a call sent without one (ADK makes one, hidden from us)
            parts = [types.Part(function_call=types.FunctionCall(id=i or None, name=n,
                                                                 args=a))
                     for i, n, a in todo]
        else:
            parts = [types.Part(text="done")]
        yield LlmResponse(content=types.Content(role="model", parts=parts))


def make_tools(path: str | Path) -> dict[str, Any]:
    """The tools, each appending ``"<name> <args>"`` to the effects file."""

    def charge(amount: int) -> dict[str, Any]:
        """Charge a card."""
        with contextlib.suppress(LookupError):  # ADK alone: no ledger, no key
            KEYS.append(tool_context().idempotency_key)
        die_at("before-effect")
        effect(path, f"charge {amount}")
        die_at("after-effect")
        return {"charged": amount}

    def wire(amount: int) -> dict[str, Any]:
        """Wire money (needs a confirmation)."""
        effect(path, f"wire {amount}")
        return {"wired": amount}

    def ticket(title: str) -> dict[str, Any]:
        """Open a ticket that finishes later (long-running)."""
        effect(path, f"ticket {title}")
        return {"status": "pending", "title": title}

    def render(shot: int) -> None:
        """Start rendering a shot; the client sends its result later (long-running)."""
        effect(path, f"render {shot}")

    def refund(amount: int) -> dict[str, Any]:
        """Refund a card; raises for a negative amount."""
        effect(path, f"refund {amount}")
        if amount < 0:
            raise ValueError("negative refund")
        return {"refunded": amount}

    return {"charge": FunctionTool(charge), "wire": FunctionTool(wire, require_confirmation=True),
            "ticket": LongRunningFunctionTool(ticket), "refund": FunctionTool(refund),
            "render": LongRunningFunctionTool(render)}


class DieBeforeAppend(BaseSessionService):
    """A session service that kills the process when asked to append an event carrying
    function responses (``--kill before-append``); otherwise ``service`` itself."""

    def __init__(self, service: BaseSessionService) -> None:
        self.service = service

    async def create_session(self, **options: Any) -> Any:
        return await self.service.create_session(**options)

    async def get_session(self, **options: Any) -> Any:
        return await self.service.get_session(**options)

    async def list_sessions(self, **options: Any) -> Any:
        return await self.service.list_sessions(**options)

    async def delete_session(self, **options: Any) -> None:
        await self.service.delete_session(**options)

    async def append_event(self, session: Any, event: Any) -> Any:
        if event.get_function_responses() and not event.partial:
            die_at("before-append")
        return await self.service.append_event(session, event)


class DieAfterAppend(SqliteSessionService):
    """ADK's ``SqliteSessionService``, killing the process once it has appended an event
    carrying a tool's function responses (``--kill after-append``). A subclass that keeps
    ADK's ``get_session``: `OneWriterSessionService` reads the last stored event itself,
    as it does for ADK's own service."""

    async def append_event(self, session: Any, event: Any) -> Any:
        written = await super().append_event(session, event)
        if event.get_function_responses() and not event.partial and event.author != "user":
            die_at("after-append")
        return written


class DieAtDecision(BasePlugin):
    """ADK alone: kills the process when a confirmed call reaches the tool callbacks
    (``--kill at-decision``), where the ledger would record its confirmation."""

    def __init__(self) -> None:
        super().__init__(name="die_at_decision")

    async def before_tool_callback(self, *, tool: Any, tool_args: dict[str, Any],
                                   tool_context: Any) -> dict[str, Any] | None:
        if tool_context.tool_confirmation is not None:
            die_at("at-decision")
        return None


class Hold(BasePlugin):
    """Once the run is open (after the ledger's ``before_run_callback``, placed after
    it): writes ``opened-<pid>`` in ``folder`` and waits for the file ``go``."""

    def __init__(self, folder: Path, go: Path) -> None:
        super().__init__(name="hold")
        self.folder = folder
        self.go = go

    async def before_run_callback(self, *, invocation_context: Any) -> None:
        (self.folder / f"opened-{os.getpid()}").write_text("opened")
        while not self.go.exists():
            await asyncio.sleep(0.01)


def _after_tool(tool: Any, args: Any, tool_context: Any, tool_response: Any) -> None:
    """The agent's own after_tool_callback: the ``after-callback`` kill point."""
    die_at("after-callback")


def build(path: str | Path, script: Sequence[Call], *, tools: Sequence[str],
          service: BaseSessionService | None = None, plugins: Sequence[BasePlugin] = (),
          resumable: bool = False) -> tuple[Runner, BaseSessionService, ScriptedModel]:
    """ADK's runner over the scripted model and the named tools."""
    made = make_tools(path)
    model = ScriptedModel(script=list(script))
    agent = LlmAgent(name="agent", model=model, tools=[made[name] for name in tools],
                     after_tool_callback=_after_tool)
    service = service if service is not None else InMemorySessionService()
    app = App(name=APP, root_agent=agent, plugins=list(plugins),
              resumability_config=ResumabilityConfig(is_resumable=True) if resumable
              else None)
    return Runner(app=app, session_service=service), service, model


def text(value: str) -> types.Content:
    return types.Content(role="user", parts=[types.Part(text=value)])


def response(call_id: str, name: str, result: dict[str, Any]) -> types.Content:
    """A function response the client sends (a long-running tool's late result, a
    confirmation)."""
    return types.Content(role="user", parts=[types.Part(
        function_response=types.FunctionResponse(id=call_id, name=name, response=result))])


async def run(runner: Runner, message: types.Content | None, *,
              invocation_id: str | None = None, session: str = SESSION,
              streaming: bool = False) -> list[Any]:
    """One ``run_async``, its events (the ledger's refusals raised as themselves: ADK
    alone raises none); ``streaming``: with ADK's server-sent-events streaming mode."""
    from google.adk.agents.run_config import RunConfig

    from statemachine.adapters.google_adk import run_async

    config = RunConfig.model_validate({"streaming_mode": "sse"} if streaming else {})
    return [event async for event in run_async(
        runner, user_id=USER, session_id=session, new_message=message,
        invocation_id=invocation_id, run_config=config)]


def confirmation_requests(events: Sequence[Any]) -> dict[str, tuple[str, Any]]:
    """The confirmation requests among ``events``: original call id → (the request's
    call id, its ToolConfirmation payload)."""
    found: dict[str, tuple[str, Any]] = {}
    for event in events:
        for call in event.get_function_calls():
            if call.name == "adk_request_confirmation":
                args = call.args or {}
                original = args["originalFunctionCall"]["id"]
                payload = (args.get("toolConfirmation") or {}).get("payload")
                found[original] = (str(call.id), payload)
    return found


# ------------------------------------------------------------------ the child process


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--mode", choices=["alone", "ledger"], required=True)
    parser.add_argument("--kill", default="")
    parser.add_argument("--wait-for", default="", help="a file to wait for before the run")
    parser.add_argument("--hold", default="", help="a file to wait for once the run is open")
    parser.add_argument("--flow", choices=["charge", "confirm"], default="charge")
    parser.add_argument("--no-publications", action="store_true",
                        help="the session appends are not the ledger's publications")
    args = parser.parse_args(argv)
    KILL["point"] = args.kill
    folder = Path(args.dir)
    EFFECTS["path"] = str(folder / "effects.txt")
    return asyncio.run(_child(folder, args.mode, args.wait_for, args.flow, args.hold,
                              publications=not args.no_publications))


def _dying_store(path: Path) -> Any:
    """The ledger's SQLite store, killing the process before or after the append that
    holds a confirmation's decision (``--kill before-decision`` / ``after-decision``)."""
    from statemachine import SQLiteEventStore
    from statemachine.events import CallApproved, CallRejected

    class DyingStore(SQLiteEventStore):
        def append(self, run_id: str, events: Sequence[Any], expected_version: int,
                   **options: Any) -> None:
            decision = any(isinstance(e, CallApproved | CallRejected) for e in events)
            if decision:
                die_at("before-decision")
            super().append(run_id, events, expected_version, **options)
            if decision:
                die_at("after-decision")

    return DyingStore(str(path))


async def _child(folder: Path, mode: str, wait_for: str, flow: str, hold: str, *,
                 publications: bool) -> int:
    from google.adk.errors import StaleSessionError

    from statemachine import ConcurrencyConflict, ToolInDoubt
    from statemachine.adapters.google_adk import LedgerPlugin, OneWriterSessionService

    # the after-append kill sits under the ledger's publication, the before-append one
    # above it (the response recorded, its publication staged by the plugin)
    sessions: BaseSessionService = DieAfterAppend(str(folder / "sessions.db"))
    plugins: list[BasePlugin] = []
    if mode == "ledger":
        plugin = LedgerPlugin(_dying_store(folder / "ledger.db"))
        plugins.append(plugin)
        sessions = OneWriterSessionService(sessions, plugin=plugin if publications else None)
    else:
        plugins.append(DieAtDecision())
    if hold:
        plugins.append(Hold(folder, Path(hold)))
    script: list[Call] = ([("w1", "wire", {"amount": 7})] if flow == "confirm"
                          else [("c1", "charge", {"amount": 5})])
    runner, service, _ = build(EFFECTS["path"], script, tools=["charge", "wire"],
                               service=DieBeforeAppend(sessions), plugins=plugins, resumable=True)
    found = await service.get_session(app_name=APP, user_id=USER, session_id=SESSION)
    if found is None:
        await service.create_session(app_name=APP, user_id=USER, session_id=SESSION)
    outcome: dict[str, Any] = {}
    if wait_for:  # ready (a file beside the signal's, one per child), then the signal
        Path(f"{wait_for}.ready-{os.getpid()}").touch()
        while not Path(wait_for).exists():
            await asyncio.sleep(0.01)
    try:
        session = await service.get_session(app_name=APP, user_id=USER,
                                            session_id=SESSION)
        assert session is not None
        pending = [e.invocation_id for e in session.events if e.get_function_calls()]
        if pending:  # resume the invocation that the dead process left
            await run(runner, None, invocation_id=pending[-1])
        elif flow == "confirm":  # ask, then confirm what the request showed
            asked = confirmation_requests(await run(runner, text("go")))
            request, payload = asked["w1"]
            await run(runner, response(request, "adk_request_confirmation",
                                       {"confirmed": True, "payload": payload}))
        else:
            await run(runner, text("go"))
        outcome["result"] = "ok"
    except ToolInDoubt as error:
        outcome.update(result="in_doubt", error=repr(error))
    except ConcurrencyConflict as error:
        outcome.update(result="conflict", error=repr(error))
    except StaleSessionError as error:  # ADK alone's check of a second writer (its append)
        outcome.update(result="stale", error=repr(error))
    (folder / f"outcome-{os.getpid()}.json").write_text(json.dumps(outcome))
    return 0


if __name__ == "__main__":
    sys.exit(main())
