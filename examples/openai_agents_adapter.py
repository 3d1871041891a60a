"""The OpenAI Agents SDK with the control core underneath (``AgentRun``), offline.

An openai-agents `Agent` with an approval-gated ``charge`` tool runs on the SDK's own
scripted test model. The first process pauses for the approval, approves, and resumes;
the tool charges once, and the Session write of its output commits but raises (the
acknowledgement is lost). The adapter surfaces that error and refuses new input while
the write is unsettled. A second process opens the run from the SQLite store with the
SDK state saved at the interruption: it reconciles (the batch is already there), never
re-runs the charge, and the SDK finishes the run. Asked again (a retried request), the
completed run answers from its ledger: no model call, no charge.

Run it: ``python examples/openai_agents_adapter.py`` (needs
``pip install 'agent-statemachine[openai-agents]'``; it starts both processes itself, in a
fresh temporary directory, and never touches the network). It exits 0.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from agents import Agent, RunConfig, SQLiteSession, function_tool, set_tracing_disabled
from agents.testing import ScriptedModel, assistant_message, function_call

from statemachine import PublicationUnsettled, SQLiteEventStore
from statemachine.adapters.openai_agents import AgentRun

RUN_ID = "order-42"
CONFIG = RunConfig(tracing_disabled=True)
set_tracing_disabled(True)


class LosesOneAcknowledgement(SQLiteSession):
    """The SDK's SQLite session, whose third write commits and then raises."""

    writes = 0

    async def add_items(self, items: list[Any]) -> None:
        await super().add_items(items)
        LosesOneAcknowledgement.writes += 1
        if LosesOneAcknowledgement.writes == 3:
            raise ConnectionError("the acknowledgement was lost")


def billing(folder: Path, *responses: Any) -> Agent[Any]:
    @function_tool(needs_approval=True)
    def charge(amount: int) -> str:
        with open(folder / "charges.txt", "a") as charges:  # the real side effect
            charges.write(f"{amount}\n")
        return f"charged {amount}"

    return Agent("billing", model=ScriptedModel(responses), tools=[charge])


async def first_process(folder: Path) -> None:
    agent = billing(folder, [function_call("charge", {"amount": 7}, call_id="call-1")])
    run = await AgentRun.open(agent, run_id=RUN_ID, store=SQLiteEventStore(folder / "ev.db"),
                              session=LosesOneAcknowledgement("s-1", folder / "session.db"))
    paused = await run.run("charge me 7", run_config=CONFIG)
    assert paused.state is not None
    (folder / "state.json").write_text(paused.state.to_string())  # as the SDK docs do
    print(f"first process: paused for {[call.name for call in paused.pending]}")
    await run.approve(paused.interruptions[0])  # recorded and durable first
    try:
        await run.run(run_config=CONFIG)
    except ConnectionError as error:
        print(f"first process: the Session write raised ({error}); "
              f"the run is {run.controller.step.value}")
    try:
        await run.run("and refund the last one", run_config=CONFIG)
    except PublicationUnsettled:
        print("first process: new input refused while the write is unsettled")


async def second_process(folder: Path) -> None:
    agent = billing(folder, [assistant_message("charged 7, receipt sent")])
    run = await AgentRun.open(agent, run_id=RUN_ID, store=SQLiteEventStore(folder / "ev.db"),
                              session=SQLiteSession("s-1", folder / "session.db"))
    result = await run.run(state=(folder / "state.json").read_text(), run_config=CONFIG)
    charges = (folder / "charges.txt").read_text().split()
    outputs = [item for item in await run.session.get_items()
               if item.get("type") == "function_call_output"]
    print(f"second process: {result.step.value}: {result.final_output!r}; "
          f"charged {len(charges)} time(s); {len(outputs)} output(s) in the Session")
    assert charges == ["7"]
    assert len(outputs) == 1
    again = await run.run(run_config=CONFIG)  # the client retries: the recorded answer
    print(f"second process, asked again: {again.final_output!r} "
          f"(replayed from the ledger: {again.replayed})")
    assert again.replayed
    assert (folder / "charges.txt").read_text().split() == ["7"]


def main() -> None:
    if len(sys.argv) == 3:
        process = first_process if sys.argv[1] == "first" else second_process
        asyncio.run(process(Path(sys.argv[2])))
        return
    with tempfile.TemporaryDirectory() as folder:
        for step in ("first", "second"):
            subprocess.run([sys.executable, __file__, step, folder], check=True)


if __name__ == "__main__":
    main()
