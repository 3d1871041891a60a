"""Resuming from the SQLite event store in a new process after a failed write.

The first process runs an agent whose tool charges a card; the Session write that would
publish the charge fails after committing (the acknowledgement was lost), and the process
exits. A second process loads the run from the store and resumes it: the runner
reconciles with the Session (the batch is already there: acknowledge), never re-runs the
charge, and completes.

Run it: ``python examples/resume_from_store.py`` (it starts both processes itself, in a
fresh temporary directory). It exits 0.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import tempfile
from pathlib import Path

from statemachine import RunController
from statemachine.runner import Agent, FunctionTool, ModelResponse, Runner
from statemachine.sessions import SQLiteSession
from statemachine.stores import SQLiteEventStore
from statemachine.testing import FlakySession, InjectedWriteError, ScriptedModel

RUN_ID = "order-42"
CALL_CHARGE = ModelResponse(tool_calls=(("call-1", "charge", {"amount": 7}),))
ANSWER = ModelResponse(output="charged 7")


def agent(folder: Path, *answers: ModelResponse) -> Agent:
    def charge(amount: int) -> str:
        with open(folder / "charges.txt", "a") as charges:  # the real side effect
            charges.write(f"{amount}\n")
        return f"charged {amount}"

    return Agent("billing", ScriptedModel(answers), tools=(FunctionTool("charge", charge),))


async def first_process(folder: Path) -> None:
    store = SQLiteEventStore(folder / "events.db")
    session = SQLiteSession("session-1", folder / "session.db")
    # the second write (the tool call and its output) commits, then raises
    flaky = FlakySession(session, fail_on=2, outcome="commit_then_raise")
    try:
        await Runner.run(agent(folder, CALL_CHARGE, ANSWER), "charge me 7", session=flaky,
                         store=store, run_id=RUN_ID)
    except InjectedWriteError:
        step = RunController.load(store, RUN_ID).step.value
        print(f"first process: the Session write failed; the run is {step}")
    else:
        raise AssertionError("the write was meant to fail")


async def second_process(folder: Path) -> None:
    store = SQLiteEventStore(folder / "events.db")
    session = SQLiteSession("session-1", folder / "session.db")
    # the model already asked for the charge; the resumed run only needs its answer
    result = await Runner.run(agent(folder, ANSWER), session=session, store=store,
                              run_id=RUN_ID)
    print("second process:", result.step.value, "-", result.final_output)
    charges = (folder / "charges.txt").read_text().split()
    assert charges == ["7"], charges  # charged once, across both processes
    print("charges:", charges)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for phase in ("first", "second"):
            subprocess.run([sys.executable, __file__, phase, tmp], check=True)


if __name__ == "__main__":
    if len(sys.argv) == 3:
        phase = first_process if sys.argv[1] == "first" else second_process
        asyncio.run(phase(Path(sys.argv[2])))
    else:
        main()
