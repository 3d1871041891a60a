"""A Google ADK agent with the tool ledger underneath, offline.

The agent's model (a scripted ``BaseLlm``: it asks for ``charge(amount=7)``, then says
"done") runs in ADK's ``Runner`` on its own ``SqliteSessionService``, wrapped by
``OneWriterSessionService`` (one writer per session; the append that carries the
function response is the ledger's publication), with ``LedgerPlugin`` on a SQLite event
store. ``charge`` needs a confirmation (``FunctionTool(require_confirmation=True)``): the
request ADK shows carries the call's fingerprint, and the confirmation must carry it
back. The first process confirms; the charge goes through and the process is killed
(SIGKILL) inside the tool. A second process resumes the invocation: ADK alone would run
the call again and charge twice; through the ledger the call is in doubt and the run
refuses to go on (``ToolInDoubt``). The operator checks the payment system and records
what happened (``statemachine.operator.resolve``, or ``statemachine resolve`` on the
command line); the agent then finishes with that outcome, and the tool never runs again.

Run it: ``python examples/google_adk_adapter.py`` (needs
``pip install 'agent-statemachine[google-adk]'``; it starts both processes itself, in a
fresh temporary directory, and never touches the network). It exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import tempfile
import warnings
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

from google.adk.agents import LlmAgent
from google.adk.apps import App, ResumabilityConfig
from google.adk.models.base_llm import BaseLlm
from google.adk.models.llm_request import LlmRequest
from google.adk.models.llm_response import LlmResponse
from google.adk.runners import Runner
from google.adk.sessions.sqlite_session_service import SqliteSessionService
from google.adk.tools.function_tool import FunctionTool
from google.genai import types

from statemachine import Resolution, SQLiteEventStore, ToolInDoubt, operator
from statemachine.adapters.google_adk import (
    LedgerPlugin,
    OneWriterSessionService,
    confirmation,
    run_async,
)

RUN_ID = "adk:shop/alice/order-42"
warnings.simplefilter("ignore")  # ADK marks resumability experimental
logging.disable(logging.WARNING)


class Scripted(BaseLlm):
    """Asks for charge(amount=7); once its response is in, says what it was."""

    model: str = "scripted"

    async def generate_content_async(self, llm_request: LlmRequest, stream: bool = False
                                     ) -> AsyncGenerator[LlmResponse, None]:
        answered = [part.function_response.response for content in llm_request.contents
                    for part in content.parts or () if part.function_response
                    and part.function_response.name == "charge"]
        if answered:
            parts = [types.Part(text=f"done: {answered[-1]}")]
        else:
            parts = [types.Part(function_call=types.FunctionCall(
                id="call-1", name="charge", args={"amount": 7}))]
        yield LlmResponse(content=types.Content(role="model", parts=parts))


def runner(folder: Path, *, die_after_charging: bool) -> Runner:
    def charge(amount: int) -> dict[str, Any]:
        """Charge the customer."""
        with open(folder / "charges.txt", "a") as charges:  # the real side effect
            charges.write(f"{amount}\n")
        if die_after_charging:
            os.kill(os.getpid(), signal.SIGKILL)  # the process dies inside the tool
        return {"charged": amount}

    plugin = LedgerPlugin(SQLiteEventStore(str(folder / "events.db")))
    sessions = OneWriterSessionService(SqliteSessionService(str(folder / "sessions.db")),
                                       plugin=plugin)
    agent = LlmAgent(name="shop", model=Scripted(),
                     tools=[FunctionTool(charge, require_confirmation=True)])
    app = App(name="shop", root_agent=agent, plugins=[plugin],
              resumability_config=ResumabilityConfig(is_resumable=True))
    return Runner(app=app, session_service=sessions)


async def events(r: Runner, message: types.Content | None, *,
                 invocation_id: str | None = None) -> list[Any]:
    return [event async for event in run_async(
        r, user_id="alice", session_id="order-42", new_message=message,
        invocation_id=invocation_id)]


async def first_process(folder: Path) -> None:
    r = runner(folder, die_after_charging=True)
    await r.session_service.create_session(app_name="shop", user_id="alice",
                                           session_id="order-42")
    paused = await events(r, types.Content(role="user", parts=[types.Part(
        text="charge me 7")]))
    (request,) = [call for event in paused for call in event.get_function_calls()
                  if call.name == "adk_request_confirmation"]
    shown = (request.args or {})["toolConfirmation"]["payload"]["fingerprint"]
    print(f"paused: charge(amount=7) awaits confirmation, fingerprint {shown[:12]}...")
    await events(r, confirmation(str(request.id), fingerprint=shown))  # killed inside


async def second_process(folder: Path) -> None:
    r = runner(folder, die_after_charging=False)
    session = await r.session_service.get_session(app_name="shop", user_id="alice",
                                                  session_id="order-42")
    assert session is not None
    invocation = [e.invocation_id for e in session.events if e.get_function_calls()][-1]
    try:
        await events(r, None, invocation_id=invocation)
    except ToolInDoubt as refused:
        print(f"resumed: refused, {refused.reason[:60]}...")
    else:
        raise SystemExit("the resumed run should have refused the call in doubt")
    store = SQLiteEventStore(str(folder / "events.db"))
    (waiting,) = operator.inbox(store)
    print(f"inbox: {waiting.call_id} ({waiting.tool}) is {waiting.kind}")
    operator.resolve(store, RUN_ID, "call-1", outcome=Resolution.COMPLETED,
                     output={"charged": 7}, by="alice", evidence="payment 981 at the bank")
    r = runner(folder, die_after_charging=False)
    done = await events(r, None, invocation_id=invocation)
    text = [part.text for event in done if event.content
            for part in event.content.parts or () if part.text]
    print(f"settled by the operator: {text[-1]}")


def main() -> int:
    if len(sys.argv) == 3:
        role, folder = sys.argv[1], Path(sys.argv[2])
        asyncio.run((first_process if role == "first" else second_process)(folder))
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
        print(f"charges at the bank: {charges} (ADK alone, resumed, runs the call again)")
        return 0 if charges == ["7"] else 1


if __name__ == "__main__":
    sys.exit(main())
