"""The ``statemachine`` command, run for real in a subprocess: the diagrams drawn from
the declaration (and the drift check on the committed ones), inspect, replay, render of
a run's path, the demo, and one-line errors with a non-zero exit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from statemachine import RecoveryPolicy, SQLiteEventStore
from statemachine import diagrams as diagrams_module
from tests.helpers import at_interruption, failed, run_charge, staged

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(sys.executable).with_name("statemachine")
COMMAND = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "statemachine"]


def cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*COMMAND, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, check=False)


def _one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


# ----------------------------------------------------------------- diagrams


def test_committed_diagrams_match_the_declaration() -> None:
    folder = ROOT / "diagrams"
    drift = "diagrams/ drifted from the declaration: run `just diagrams` and commit"
    assert (folder / "run.mmd").read_text() == diagrams_module.mermaid(), drift
    assert (folder / "run.dot").read_text() == diagrams_module.dot(), drift
    assert (folder / "README.md").read_text() == diagrams_module.readme(
        diagrams_module.mermaid()), drift


def test_every_transition_and_guard_is_on_the_diagram() -> None:
    from statemachine.machine import TRANSITIONS

    text = diagrams_module.mermaid()
    for row in TRANSITIONS:
        label = f"{row.trigger} [{', '.join(row.guards)}]" if row.guards else row.trigger
        assert label in text


def test_render_writes_the_project_diagrams(tmp_path: Path) -> None:
    done = cli("render", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "run.mmd").read_text() == diagrams_module.mermaid()
    assert (tmp_path / "run.dot").read_text() == diagrams_module.dot()
    assert "```mermaid" in (tmp_path / "README.md").read_text()


def test_render_highlights_a_runs_path(tmp_path: Path) -> None:
    run = tmp_path / "run.json"
    run.write_text(json.dumps(failed().to_json()))
    done = cli("render", str(run), "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    text = (tmp_path / "run-run-1.mmd").read_text()
    assert "class unsettled current" in text
    assert "linkStyle" in text
    assert 'color="#e65100", penwidth=3' in (tmp_path / "run-run-1.dot").read_text()


# -------------------------------------------------------------- inspect, replay


def test_inspect_explains_an_unsettled_run(tmp_path: Path) -> None:
    run = tmp_path / "run.json"
    run.write_text(json.dumps(failed().to_json()))
    done = cli("inspect", str(run))
    assert done.returncode == 0, done.stderr
    assert "step UNSETTLED" in done.stdout
    assert "pending approvals: notify" in done.stdout
    assert "continuation INTERRUPTION" in done.stdout
    assert "verdict: Resumable: a write's outcome is unknown" in done.stdout
    as_json = json.loads(cli("inspect", str(run), "--json").stdout)
    assert as_json["envelope"]["batch_items"] == 3
    assert as_json["next_action"] == "reconcile"
    assert {c["call_id"]: c["cached"] for c in as_json["ledger"]} == {
        "charge": True, "notify": False, "audit": True}


def test_inspect_from_a_store_names_the_call_in_doubt(tmp_path: Path) -> None:
    store = SQLiteEventStore(tmp_path / "events.db")
    c = at_interruption(store=store)
    c.approve("charge")
    c.resume()
    c.begin_tool("charge")  # the process dies here
    done = cli("inspect", "--store", str(tmp_path / "events.db"), "--run", "run-1")
    assert done.returncode == 0, done.stderr
    assert "IN DOUBT" in done.stdout
    assert "verdict: Blocked: call 'charge' was started and never completed" in done.stdout


def test_inspect_says_a_fail_closed_run_cannot_resume(tmp_path: Path) -> None:
    run = tmp_path / "run.json"
    run.write_text(json.dumps(staged(RecoveryPolicy.FAIL_CLOSED).to_json()))
    assert "verdict: Cannot resume: a fail-closed publication is unsettled" in cli(
        "inspect", str(run)).stdout


def test_replay_validates_a_log(tmp_path: Path) -> None:
    c = at_interruption()
    run_charge(c)
    run = tmp_path / "run.json"
    run.write_text(json.dumps(c.to_json()))
    done = cli("replay", str(run))
    assert done.returncode == 0
    assert f"ok: {len(c.events)} events replayed" in done.stdout


def test_replay_names_the_first_illegal_event(tmp_path: Path) -> None:
    doc = failed().to_json()
    doc["events"].append({"type": "CallApproved", "seq": len(doc["events"]),
                          "call_id": "notify", "fingerprint": "0" * 64})
    run = tmp_path / "forged.json"
    run.write_text(json.dumps(doc))
    line = _one_line_error(cli("replay", str(run)))
    assert f"event {len(doc['events']) - 1} (CallApproved) is forbidden here" in line


# ------------------------------------------------------------------- errors


@pytest.mark.parametrize("case", ["missing-file", "not-json", "future-version",
                                  "unknown-run", "missing-store", "no-source"])
def test_errors_are_one_line_and_non_zero(case: str, tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    if case == "not-json":
        bad.write_text("{not json")
    elif case == "future-version":
        bad.write_text(json.dumps({**failed().to_json(), "schema_version": 99}))
    args = {
        "missing-file": ["inspect", str(tmp_path / "nope.json")],
        "not-json": ["inspect", str(bad)],
        "future-version": ["replay", str(bad)],
        "unknown-run": ["inspect", "--store", str(tmp_path / "events.db"), "--run", "ghost"],
        "missing-store": ["inspect", "--store", str(tmp_path / "none.db"), "--run", "x"],
        "no-source": ["inspect"],
    }[case]
    if case == "unknown-run":
        at_interruption(store=SQLiteEventStore(tmp_path / "events.db"))
    line = _one_line_error(cli(*args))
    says = {"missing-file": "cannot read", "not-json": "not valid JSON",
            "future-version": "newer than this library reads", "unknown-run": "no run 'ghost'",
            "missing-store": "no such store file", "no-source": "give a run's JSON file"}[case]
    assert says in line


# --------------------------------------------------------------------- demo


def test_the_demo_plays_every_scenario_and_checks_the_invariants(tmp_path: Path) -> None:
    done = cli("demo", "--dir", str(tmp_path / "demo"))
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    for expected in ("PublicationFailed", "refused approve", "ReconciledAcknowledge",
                     "ReconciledAppend", "partial write", "TERMINAL_UNRECOVERABLE",
                     "posted=False", "posted=True", "18 of 18 checks hold"):
        assert expected in out
    assert (tmp_path / "demo" / "events.db").exists()
