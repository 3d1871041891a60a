"""The kill -9 rows every adapter's verifier tests share (tests/adapters/test_*_verifiers.py):
a charge through the adapter, killed at each boundary around it
(`tests.drivers.verifier_driver`), then resumed. With a verifier every run completes with
exactly one charge, settled by it and no operator; without one a call whose start was
durable and whose result was not is in doubt (`ToolInDoubt`), as before."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

from statemachine import Resolution, RunController, SQLiteEventStore, ToolInDoubt
from tests.drivers.payment_driver import PaymentService
from tests.drivers.verifier_driver import RUN_ID
from tests.helpers import long_rows

ROOT = Path(__file__).resolve().parents[2]

ALL_BOUNDARIES = ["before-charge", "after-charge", "after-return", "after-record"]
BOUNDARIES = long_rows(ALL_BOUNDARIES, core={"before-charge", "after-return"})
"""Where the adapters' kill -9 rows kill: all four under STATEMACHINE_LONG=1 (``just
fuzz``); in CI the two that reach a verifier's two answers (NotExecuted before the charge,
Completed after it with the result not recorded). tests/runner/test_verifiers.py kills
the reference runner at all four in CI."""
CHARGED_BEFORE_THE_KILL = {"before-charge": 0, "after-charge": 1, "after-return": 1,
                           "after-record": 1}
"""What the service holds when the process dies there (an independent statement)."""


def _driver(adapter: str, folder: Path, boundary: str, verify: bool
            ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tests.drivers.verifier_driver", adapter,
                           str(folder), boundary, "1" if verify else "0"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)


def kill_then_resume(adapter: str, folder: Path, boundary: str, verify: bool,
                     call_id: str) -> None:
    """Kill the adapter's charge at ``boundary``, resume it, and check the outcome."""
    killed = _driver(adapter, folder, boundary, verify)
    assert killed.returncode == -9, killed.stderr
    service = PaymentService(folder / "payments.jsonl")
    assert len(service.charges()) == CHARGED_BEFORE_THE_KILL[boundary]
    resumed = _driver(adapter, folder, "none", verify)
    assert resumed.returncode == 0, resumed.stderr
    said = json.loads(resumed.stdout)
    recorded = boundary == "after-record"  # the result was durable: it is re-sent
    if verify or recorded:
        assert said == {"output": "done: charged 7"}  # the model saw the charge's output
        assert len(service.charges()) == 1  # exactly one charge, no operator
    else:
        assert said == {"error": ToolInDoubt.__name__}
        assert len(service.charges()) == CHARGED_BEFORE_THE_KILL[boundary]
    run = RunController.load(SQLiteEventStore(folder / "events.db"), RUN_ID)
    decisions = [(d.kind, d.by, d.outcome) for d in run.call(call_id).decisions]
    if verify and not recorded:
        expected = (Resolution.NOT_EXECUTED if CHARGED_BEFORE_THE_KILL[boundary] == 0
                    else Resolution.COMPLETED)
        assert decisions == [("resolved", "verify:charge", expected)]
        assert run.call(call_id).starts == (2 if expected is Resolution.NOT_EXECUTED else 1)
    else:
        assert decisions == []
    key = hashlib.sha256(f"{RUN_ID}\0{call_id}".encode()).hexdigest()[:32]
    assert {c["key"] for c in service.charges()} <= {key}  # every start gave the same key
