"""A scripted run on the embedded defaults, killed with SIGKILL at a chosen point.

``python -m tests.crash_driver DIR [--kill-after-event N | --kill-in-tool |
--kill-in-append K:before|after]`` drives (or resumes) the run ``crash`` with a SQLite
store and a SQLite session in DIR. The model proposes ``pay`` (approval-gated, its effect
appends a line to DIR/pay.txt) and ``lookup`` (idempotent, counted in DIR/lookup.txt),
then answers. The process prints one JSON line with its outcome, unless it was killed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from statemachine import (
    Action,
    Execute,
    RunController,
    RunNotResumable,
    Step,
    ToolCall,
    ToolInDoubt,
)
from statemachine.events import Event
from statemachine.runner import publish, settle
from statemachine.sessions import SQLiteSession
from statemachine.stores import Snapshot, SQLiteEventStore
from statemachine.values import Phase

RUN_ID = "crash"
RESPONSES = [
    [ToolCall("pay", "pay", {"amount": 7}, needs_approval=True),
     ToolCall("lookup", "lookup", {"q": "rate"}, idempotent=True)],
    "paid 7",
]


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class KillingStore(SQLiteEventStore):
    kill_after: int | None = None

    def append(self, run_id: str, events: Sequence[Event], expected_version: int, *,
               snapshot: Snapshot | None = None) -> None:
        super().append(run_id, events, expected_version, snapshot=snapshot)
        if self.kill_after is not None and any(e.seq == self.kill_after for e in events):
            _die()


class KillingSession(SQLiteSession):
    kill_at: tuple[int, str] | None = None
    appends = 0

    async def add_items(self, items: list[Any]) -> None:
        self.appends += 1
        await super().add_items(items)

    def _before_commit(self) -> None:
        if self.kill_at == (self.appends, "before"):
            _die()

    def _after_commit(self) -> None:
        if self.kill_at == (self.appends, "after"):
            _die()


def _effect(folder: Path, name: str, line: str) -> None:
    with open(folder / name, "a") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


async def drive(folder: Path, store: SQLiteEventStore, session: SQLiteSession,
                kill_in_tool: bool) -> dict[str, Any]:
    if store.load(RUN_ID):
        c = RunController.load(store, RUN_ID)
    else:
        c = RunController.start(run_id=RUN_ID, session_id=session.session_id, store=store)
    try:
        c.resume()
    except ToolInDoubt as error:
        return {"outcome": "in_doubt", "call_id": error.call_id}
    except RunNotResumable:
        return {"outcome": c.step.value}
    while True:
        action = c.next_action()
        if action is Action.NOT_RESUMABLE:
            return {"outcome": c.step.value}
        if action is Action.RESOLVE_IN_DOUBT:
            return {"outcome": "in_doubt", "call_id": c.in_doubt()[0]}
        if action is Action.RECONCILE:
            # the previous process is dead: no write of its attempt can still land
            await settle(c, session, take_over=True)
        elif action is Action.CALL_MODEL:
            if c.step is not Step.AWAITING_MODEL:
                c.begin_model_call()
            response = RESPONSES[c.state.turns]
            if isinstance(response, list):
                c.model_responded(response)
            else:
                c.model_responded([], output=response)
        elif action is Action.AWAIT_DECISIONS:
            for call_id in c.pending_approvals:
                c.approve(call_id, fingerprint=c.fingerprint(call_id))
        elif action is Action.RUN_TOOLS:
            if c.step is Step.INTERRUPTION:
                c.resume()
                continue
            for call_id, record in list(c.state.calls.items()):
                if record.phase not in (Phase.APPROVED, Phase.STARTED):
                    continue
                decision = c.begin_tool(call_id)
                if isinstance(decision, Execute):
                    if call_id == "pay":
                        _effect(folder, "pay.txt", "charged 7")
                        if kill_in_tool:
                            _die()
                    else:
                        _effect(folder, "lookup.txt", "looked up")
                    c.tool_completed(call_id, f"{call_id} done")
        elif action is Action.PUBLISH:
            ids = [i for i, r in c.state.calls.items() if r.phase == Phase.COMPLETED]
            items: list[Any] = []
            for call_id in ids:
                items.append({"type": "function_call", "call_id": call_id})
                items.append({"type": "function_call_output", "call_id": call_id,
                              "output": c.state.calls[call_id].result})
            if c.step is Step.FINAL_OUTPUT:
                items.append({"role": "assistant", "content": c.final_output})
            await publish(c, session, items, call_ids=ids)
        elif action is Action.FINISH:
            c.accept_final_output(c.model_output)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", type=Path)
    parser.add_argument("--kill-after-event", type=int)
    parser.add_argument("--kill-in-tool", action="store_true")
    parser.add_argument("--kill-in-append")
    args = parser.parse_args(argv)
    store = KillingStore(args.folder / "events.db")
    store.kill_after = args.kill_after_event
    session = KillingSession("crash-session", args.folder / "session.db")
    if args.kill_in_append:
        index, phase = args.kill_in_append.split(":")
        session.kill_at = (int(index), phase)
    result = asyncio.run(drive(args.folder, store, session, args.kill_in_tool))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
