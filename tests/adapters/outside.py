"""Settling a call in doubt from outside the adapter's process, as an operator would: the
``statemachine resolve`` command (DESIGN §7.5) loads the run from its SQLite store, claims
it as ``--by`` and records the outcome (DESIGN §7.3), knowing nothing of the SDK (an
error that is JSON rather than text goes through `statemachine.operator.resolve`). The
adapters' tests then resume the run and check that it goes on in the SDK's shape."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from statemachine import Resolution

ROOT = Path(__file__).resolve().parents[2]


def settle_from_outside(db_path: Path, run_id: str, call_id: str,
                        outcome: Resolution | str, output: Any, by: str,
                        evidence: str | None) -> None:
    """Record ``outcome`` (with ``output``, ``by``, ``evidence``) for call ``call_id`` of
    run ``run_id`` in the SQLite store at ``db_path`` with the CLI, from another process;
    raises `AssertionError` with that process's error output when it fails."""
    chosen = Resolution(outcome)
    if chosen is Resolution.FAILED and type(output) is not str:
        # the command takes an error's text; JSON errors go through the operator module
        command = ["-c", _OPERATOR, json.dumps(
            [str(db_path), run_id, call_id, chosen.value, output, by, evidence])]
    else:
        how = (["--not-executed"] if chosen is Resolution.NOT_EXECUTED else
               ["--completed", json.dumps(output)] if chosen is Resolution.COMPLETED else
               ["--failed", output])
        where = ["--evidence", evidence] if evidence is not None else []
        command = ["-m", "statemachine", "resolve", run_id, call_id, "--store", str(db_path),
                   "--by", by, *how, *where]
    done = subprocess.run([sys.executable, *command], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr


_OPERATOR = """
import json, sys
from statemachine import Resolution, SQLiteEventStore
from statemachine.operator import resolve
db, run_id, call_id, outcome, output, by, evidence = json.loads(sys.argv[1])
resolve(SQLiteEventStore(db), run_id, call_id, outcome=Resolution(outcome), output=output,
        by=by, evidence=evidence)
"""
