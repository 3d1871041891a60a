"""Settling a call in doubt from outside the adapter's process, as an operator would: a new
Python process loads the run from its SQLite store, claims it and records the outcome
(DESIGN §7.3), knowing nothing of the SDK. The adapters' tests then resume the run and
check that it goes on in the SDK's shape.

One function on purpose: when the CLI's ``statemachine resolve`` verb lands, its body
becomes that command and no test changes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from statemachine import Resolution

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = """
import json, sys
from statemachine import Resolution, RunController, SQLiteEventStore
a = json.loads(sys.argv[1])
store = SQLiteEventStore(a["db"])
c = RunController.load(store, a["run_id"])
c.claim(a["by"])
c.resolve_in_doubt(a["call_id"], a["output"], outcome=Resolution(a["outcome"]), by=a["by"],
                   evidence=a["evidence"])
c.flush()
store.close()
"""


def settle_from_outside(db_path: Path, run_id: str, call_id: str,
                        outcome: Resolution | str, output: Any, by: str,
                        evidence: str | None) -> None:
    """Record ``outcome`` (with ``output``, ``by``, ``evidence``) for call ``call_id`` of
    run ``run_id`` in the SQLite store at ``db_path``, from another process; raises
    `AssertionError` with that process's error output when it fails."""
    arguments = {"db": str(db_path), "run_id": run_id, "call_id": call_id,
                 "outcome": Resolution(outcome).value, "output": output, "by": by,
                 "evidence": evidence}
    done = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(arguments)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
