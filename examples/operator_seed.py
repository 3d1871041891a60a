"""Three runs that wait on a person, in a SQLite event store, for trying the operator's
commands (README, "Settling runs: the operator's guide"):

* order-17: its charge was started and the worker died before recording the result,
  so the charge is in doubt;
* order-18: its refund awaits an approval;
* order-19: its email awaits an approval too.

Run: python examples/operator_seed.py runs.db
"""

from __future__ import annotations

import sys

from statemachine import RunController, SQLiteEventStore, ToolCall


def seed(path: str) -> None:
    store = SQLiteEventStore(path)
    crashed = RunController.start(run_id="order-17", session_id=None, store=store)
    crashed.begin_model_call()
    crashed.model_responded([ToolCall("charge", "charge_card", {"amount": 7})])
    crashed.begin_tool("charge")  # ... and the process died here
    for run_id, call in (("order-18", ToolCall("refund", "refund", {"amount": 12},
                                               needs_approval=True)),
                         ("order-19", ToolCall("email", "send_email", {"to": "ann"},
                                               needs_approval=True))):
        paused = RunController.start(run_id=run_id, session_id=None, store=store)
        paused.begin_model_call()
        paused.model_responded([call])
    store.close()
    print(f"{path}: order-17 has a call in doubt; order-18 and order-19 await approvals. "
          f"Try: statemachine inbox --store {path}")


if __name__ == "__main__":
    seed(sys.argv[1] if len(sys.argv) > 1 else "runs.db")
