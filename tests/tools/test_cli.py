"""The ``statemachine`` command, run for real in a subprocess: the diagrams drawn from
the declaration (and the drift check on the committed ones), inspect, replay, render of
a run's path, explore's verdict, the demo, help on every option, one-line errors with
exit status 2 for every failure, and read-only commands that never create or change a
file."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from statemachine import RecoveryPolicy, RunController, SQLiteEventStore, ToolCall
from statemachine import diagrams as diagrams_module
from statemachine.cli.main import explore_verdict
from statemachine.cli.main import parser as cli_parser
from statemachine.testing.explore import ExploreReport
from tests.helpers import SESSION, B, P, at_interruption, failed, reloaded, run_charge, staged

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(sys.executable).with_name("statemachine")
COMMAND = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "statemachine"]


def cli(*args: str, cwd: Path = ROOT,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*COMMAND, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, check=False, env=env)


def _one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def _store_file(path: Path) -> Path:
    """A closed SQLite event store file holding run-1 at its interruption."""
    path.parent.mkdir(parents=True, exist_ok=True)
    store = SQLiteEventStore(path)
    at_interruption(store=store)
    store.close()
    return path


def _ledger_line(out: str, call_id: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(f"  {call_id} "))


# ----------------------------------------------------------------- diagrams


def test_committed_diagrams_match_the_declaration(tmp_path: Path) -> None:
    """Regenerate everything from the declaration and compare with what is committed
    (the SVGs depend on the Graphviz version, so only that they exist)."""
    folder = ROOT / "diagrams"
    drift = "diagrams/ drifted from the declaration: run `just diagrams` and commit"
    for name, text in (("overview.mmd", diagrams_module.overview_mermaid()),
                       ("overview.dot", diagrams_module.overview_dot()),
                       ("run.mmd", diagrams_module.mermaid()),
                       ("run.dot", diagrams_module.dot()),
                       ("README.md", diagrams_module.readme())):
        assert (folder / name).read_text() == text, f"{name}: {drift}"
    assert (folder / "overview.svg").is_file()
    assert (folder / "run.svg").is_file()


def test_the_overview_folds_self_loops_and_guards_away() -> None:
    from statemachine.machine import TRANSITIONS
    from statemachine.values import LIVE_STEPS

    edges = diagrams_module.overview_edges()
    pairs = [(e.source, e.dest) for e in edges]
    assert len(pairs) == len(set(pairs)), "one edge per (source, dest)"
    assert all(e.source != e.dest for e in edges), "no self-loops"
    moves = {(s.value, row.dest.value, row.trigger) for row in TRANSITIONS
             for s in row.sources if row.dest is not None and row.dest is not s}
    drawn = {(e.source, e.dest, t) for e in edges for t in e.triggers}
    everywhere = {(row.dest.value, row.trigger) for row in TRANSITIONS
                  if row.dest is not None and set(row.sources) == set(LIVE_STEPS)}
    for source, dest, trigger in moves:  # every move is drawn, once or from "any live step"
        assert ((source, dest, trigger) in drawn
                or (diagrams_module.ANY_LIVE_STEP, dest, trigger) in drawn)
    assert {(d, t) for s, d, t in drawn if s == diagrams_module.ANY_LIVE_STEP} == everywhere
    triggers = {row.trigger for row in TRANSITIONS}
    labels = re.findall(r'\|"([^"]*)"\|', diagrams_module.overview_mermaid())
    labels += re.findall(r'label="([^"]*)"[,\]]', diagrams_module.overview_dot())
    trigger_labels = [part for label in labels for part in re.split(r"<br/>|\\n", label)
                      if not part.isupper() and part not in ("start", "any live step")
                      and not part.startswith("agent-statemachine")]
    assert trigger_labels
    assert set(trigger_labels) <= triggers, "labels are triggers only"
    readme = diagrams_module.readme()
    assert readme.index("## Overview") < readme.index("## Every transition")
    assert readme.index(diagrams_module.overview_mermaid()) < readme.index(
        diagrams_module.mermaid())


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
    assert (tmp_path / "overview.mmd").read_text() == diagrams_module.overview_mermaid()
    assert (tmp_path / "overview.dot").read_text() == diagrams_module.overview_dot()
    assert (tmp_path / "README.md").read_text() == diagrams_module.readme()


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz is not installed")
def test_render_draws_both_svgs_with_graphviz(tmp_path: Path) -> None:
    done = cli("render", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "overview.svg").read_text().lstrip().startswith("<?xml")
    assert (tmp_path / "run.svg").is_file()
    assert "skipped" not in done.stdout


def test_render_says_when_it_skips_the_svg(tmp_path: Path) -> None:
    no_graphviz = tmp_path / "empty-path"
    no_graphviz.mkdir()
    env = {**os.environ, "PATH": str(no_graphviz)}
    done = cli("render", "--out", str(tmp_path / "out"), env=env)
    assert done.returncode == 0, done.stderr
    assert not list((tmp_path / "out").glob("*.svg"))
    says = [line for line in (done.stdout + done.stderr).splitlines() if "SVG" in line]
    assert len(says) == 1
    assert "Graphviz" in says[0]
    assert "not installed" in says[0]


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
    assert "its publication unsettled" in _ledger_line(done.stdout, "charge")
    assert "awaiting a decision" in _ledger_line(done.stdout, "notify")
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
    assert "started, outcome unknown" in _ledger_line(done.stdout, "charge")
    as_json = json.loads(cli("inspect", "--store", str(tmp_path / "events.db"), "--run",
                             "run-1", "--json").stdout)
    charge = next(call for call in as_json["ledger"] if call["call_id"] == "charge")
    assert charge["outcome_unknown"] is True
    assert charge["in_doubt"] is True
    assert charge["status"].startswith("started, outcome unknown")


def _inspected(c: RunController, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    run = tmp_path / "run.json"
    run.write_text(json.dumps(c.to_json()))
    done = cli("inspect", str(run))
    assert done.returncode == 0, done.stderr
    as_json = cli("inspect", str(run), "--json")
    assert as_json.returncode == 0, as_json.stderr
    return done.stdout, json.loads(as_json.stdout)


def test_inspect_says_a_call_was_rejected(tmp_path: Path) -> None:
    c = at_interruption()
    c.reject("charge", "the user declined")
    rejection = {"type": "function_call_output", "call_id": "charge", "output": "declined"}
    c.stage_publication([rejection], P, call_ids=["charge"])
    c.publication_committed()  # the rejection is published: its phase is PUBLISHED
    out, info = _inspected(c, tmp_path)
    line = _ledger_line(out, "charge")
    assert "rejected" in line, line
    assert "ran" not in line, line
    assert "awaiting a decision" in _ledger_line(out, "notify")
    ledger = {call["call_id"]: call for call in info["ledger"]}
    assert ledger["charge"]["rejected"] is True
    assert ledger["notify"]["rejected"] is False
    assert ledger["charge"]["status"].startswith("rejected")


def test_inspect_says_an_operator_resolved_a_call(tmp_path: Path) -> None:
    c = at_interruption()
    c.approve("charge")
    c.resume()
    c.begin_tool("charge")  # the process dies here
    restarted = reloaded(c)
    restarted.resolve_in_doubt("charge", "charged by the operator")
    out, info = _inspected(restarted, tmp_path)
    line = _ledger_line(out, "charge")
    assert "resolved by an operator" in line, line
    assert "IN DOUBT" not in line, line
    ledger = {call["call_id"]: call for call in info["ledger"]}
    assert ledger["charge"]["resolved_by_operator"] is True
    assert ledger["charge"]["outcome_unknown"] is False
    assert ledger["notify"]["resolved_by_operator"] is False


def test_inspect_says_who_decided_when_and_why(tmp_path: Path) -> None:
    """DESIGN §7.2: each decision of the ledger with its actor, time (UTC) and reason,
    in words and in --json; a log without time says so."""
    ticks = iter(range(1_767_225_600_000_000, 1_767_225_600_000_000 + 10**9, 1500))
    c = RunController.start(run_id="run-1", session_id=SESSION, clock=lambda: next(ticks))
    c.begin_model_call()
    c.model_responded([ToolCall("charge", "charge", {"x": 7}, needs_approval=True),
                       ToolCall("notify", "notify", {}, needs_approval=True)])
    c.approve("charge", by="alice", reason="asked for it")
    c.reject("notify", "no", by="bob")
    out, info = _inspected(c, tmp_path)
    line = _ledger_line(out, "charge")
    assert "approved by alice at 2026-01-01T00:00:00.004Z (asked for it)" in line, line
    assert "rejected by bob at 2026-01-01T00:00:00.006Z" in _ledger_line(out, "notify")
    assert "last moved at 2026-01-01T00:00:00.006Z" in out
    ledger = {call["call_id"]: call for call in info["ledger"]}
    assert ledger["charge"]["decisions"] == [
        {"kind": "approved", "by": "alice", "reason": "asked for it", "outcome": None,
         "evidence": None,
         "at": 1_767_225_600_004_500}]
    assert info["updated_at"] == 1_767_225_600_006_000
    old = tmp_path / "old.json"
    old.write_text((ROOT / "tests" / "fixtures" / "v2" / "claimed_settled.json").read_text())
    done = cli("inspect", str(old))
    assert done.returncode == 0, done.stderr
    assert "last moved at an unknown time" in done.stdout


def test_inspect_says_a_run_has_no_session(tmp_path: Path) -> None:
    c = RunController.start(run_id="solo", session_id=None)
    out, info = _inspected(c, tmp_path)
    assert "no Session" in out.splitlines()[0]
    assert "None" not in out.splitlines()[0]
    assert info["session_id"] is None
    assert info["has_session"] is False
    _, with_session = _inspected(at_interruption(), tmp_path)
    assert with_session["has_session"] is True


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
    doc["events"].append({"type": "CallApproved", "seq": len(doc["events"]), "at": None,
                          "call_id": "notify", "fingerprint": "0" * 64, "by": None,
                          "reason": None})
    run = tmp_path / "forged.json"
    run.write_text(json.dumps(doc))
    line = _one_line_error(cli("replay", str(run)))
    assert f"event {len(doc['events']) - 1} (CallApproved) is forbidden here" in line


# ------------------------------------------------------------------- errors


def _garbage(path: Path, start: int, end: int | None = None) -> Path:
    """Overwrite bytes ``start:end`` of ``path`` with seeded random garbage."""
    data = bytearray(path.read_bytes())
    rng = random.Random(7)
    stop = len(data) if end is None else end
    data[start:stop] = bytes(rng.randrange(256) for _ in range(stop - start))
    path.write_bytes(bytes(data))
    return path


def _error_case(case: str, tmp_path: Path) -> tuple[list[str], str]:
    """The command line of each failure, and what its one line must say."""
    bad = tmp_path / "bad.json"
    plain = tmp_path / "plain-file"
    plain.write_text("not a directory")
    long_name = "x" * 3000
    if case == "not-json":
        bad.write_text("{not json")
    elif case == "not-utf8":
        bad.write_bytes(b"\xff\xfe garbage")
    elif case == "future-version":
        bad.write_text(json.dumps({**failed().to_json(), "schema_version": 99}))
    elif case in ("unknown-run", "long-run-id"):
        _store_file(tmp_path / "events.db")
    elif case == "not-a-database":
        (tmp_path / "events.db").write_text("hello, I am not SQLite\n" * 100)
    elif case == "damaged-pages":  # the header and the schema page intact, the rest garbage
        _garbage(_store_file(tmp_path / "events.db"), 4096)
    elif case == "damaged-schema":  # the 100-byte header intact, everything after garbage
        _garbage(_store_file(tmp_path / "events.db"), 100)
    elif case == "hostile-run-id":
        bad.write_text(json.dumps(RunController.start(run_id="../x", session_id=None)
                                  .to_json()))
    store = ["--store", str(tmp_path / "events.db"), "--run", "run-1"]
    cases: dict[str, tuple[list[str], str]] = {
        "missing-file": (["inspect", str(tmp_path / "nope.json")], "no such file"),
        "directory-as-file": (["replay", str(tmp_path)], "is a directory"),
        "not-utf8": (["inspect", str(bad)], "not UTF-8"),
        "not-json": (["inspect", str(bad)], "not valid JSON"),
        "future-version": (["replay", str(bad)], "newer than this library reads"),
        "long-path": (["inspect", str(tmp_path / long_name)], "cannot read"),
        "unknown-run": (["inspect", *store[:3], "ghost"], "no run 'ghost'"),
        "long-run-id": (["inspect", *store[:3], long_name], "no run 'xxx"),
        "missing-store": (["inspect", "--store", str(tmp_path / "none.db"), "--run", "x"],
                          "no such store file"),
        "store-is-a-directory": (["replay", "--store", str(tmp_path), "--run", "x"],
                                 "is a directory"),
        "not-a-database": (["inspect", *store], "is not a SQLite database"),
        "damaged-pages": (["inspect", *store], "damaged"),
        "damaged-schema": (["replay", *store], "damaged"),
        "store-without-run": (["inspect", "--store", str(_store_file(tmp_path / "s.db"))],
                              "--store needs --run ID (it holds 'run-1')"),
        "run-without-store": (["inspect", str(tmp_path / "nope.json"), "--run", "x"],
                              "--run needs --store"),
        "no-source": (["inspect"], "give a run's JSON file"),
        "render-out-is-a-file": (["render", "--out", str(plain)], "is a file, not a directory"),
        "render-run-out-is-a-file": (["render", *store[:0], str(bad), "--out", str(plain)],
                                     "is a file, not a directory"),
        "demo-dir-is-a-file": (["demo", "--dir", str(plain)], "is a file, not a directory"),
        "demo-dir-uncreatable": (["demo", "--dir", str(plain / "sub")], "cannot create --dir"),
        "bad-depth": (["explore", "--depth", "abc"], "not a whole number"),
        "negative-depth": (["explore", "--depth", "-1"], "must be 0 or more"),
        "zero-max-states": (["explore", "--max-states", "0"], "must be 1 or more"),
        "unknown-command": (["frobnicate"], "invalid choice"),
    }
    if case == "render-run-out-is-a-file":
        bad.write_text(json.dumps(at_interruption().to_json()))
    return cases[case]


ERROR_CASES = [
    "missing-file", "directory-as-file", "not-utf8", "not-json", "future-version",
    "long-path", "unknown-run", "long-run-id", "missing-store", "store-is-a-directory",
    "not-a-database", "damaged-pages", "damaged-schema", "store-without-run",
    "run-without-store", "no-source", "render-out-is-a-file", "render-run-out-is-a-file",
    "demo-dir-is-a-file", "demo-dir-uncreatable", "bad-depth", "negative-depth",
    "zero-max-states", "unknown-command",
]


@pytest.mark.parametrize("case", ERROR_CASES)
def test_every_failure_is_one_bounded_line_and_exit_status_2(case: str,
                                                             tmp_path: Path) -> None:
    args, says = _error_case(case, tmp_path)
    line = _one_line_error(cli(*args, cwd=tmp_path))
    assert says in line
    assert len(line) < 700, "a message echoes at most ~200 characters of what it was given"
    assert "x" * 300 not in line


def test_a_failed_command_leaves_no_file_behind(tmp_path: Path) -> None:
    """The refusals above create nothing: no store, no --dir, no output directory."""
    before = sorted(p.name for p in tmp_path.iterdir())
    for args in (["inspect", "--store", str(tmp_path / "none.db"), "--run", "x"],
                 ["replay", "--store", str(tmp_path / "none.db"), "--run", "x"],
                 ["render", "--store", str(tmp_path / "none.db"), "--run", "x", "--out",
                  str(tmp_path / "out")]):
        _one_line_error(cli(*args, cwd=tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_render_keeps_a_runs_files_inside_out(tmp_path: Path) -> None:
    run = tmp_path / "run.json"
    run.write_text(json.dumps(RunController.start(run_id="../x", session_id=None).to_json()))
    out = tmp_path / "out"
    done = cli("render", str(run), "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.iterdir() if p.suffix != ".svg") == [
        "run-.._x.dot", "run-.._x.mmd"]


# ------------------------------------------------------- read-only commands


def _fingerprint(path: Path) -> tuple[str, int, int, list[str]]:
    """What a read-only command must leave exactly as it was: the bytes, the size, the
    mtime, and the files beside it (no -wal, -shm or -journal appears)."""
    if not path.exists():
        return "", -1, -1, sorted(p.name for p in path.parent.iterdir())
    st = path.stat()
    return (hashlib.sha256(path.read_bytes()).hexdigest(), st.st_size, st.st_mtime_ns,
            sorted(p.name for p in path.parent.iterdir()))


READ_ONLY = {
    "inspect": ["inspect"],
    "inspect --json": ["inspect", "--json"],
    "replay": ["replay"],
    "render --store": ["render"],
}


@pytest.mark.parametrize("kind", ["valid-store", "empty-file", "missing"])
@pytest.mark.parametrize("command", list(READ_ONLY))
def test_read_only_commands_never_create_or_change_a_file(command: str, kind: str,
                                                          tmp_path: Path) -> None:
    db = tmp_path / "store" / "events.db"
    if kind == "valid-store":
        _store_file(db)
    else:
        db.parent.mkdir()
        if kind == "empty-file":
            db.write_bytes(b"")
    before = _fingerprint(db)
    done = cli(*READ_ONLY[command], "--store", str(db), "--run", "run-1", "--out",
               str(tmp_path / "out"), cwd=tmp_path) if command.startswith("render") else cli(
        *READ_ONLY[command], "--store", str(db), "--run", "run-1", cwd=tmp_path)
    if kind == "valid-store":
        assert done.returncode == 0, done.stderr
    else:
        line = _one_line_error(done)
        assert ("not an agent-statemachine event store" if kind == "empty-file"
                else "no such store file") in line
    assert _fingerprint(db) == before


def test_a_store_in_use_is_read_through_its_write_ahead_log(tmp_path: Path) -> None:
    """A writer holds the store open with events only in its -wal: the read sees them,
    and leaves the writer's files as they were."""
    store = SQLiteEventStore(tmp_path / "events.db")
    c = at_interruption(store=store)
    c.approve("charge")
    try:
        done = cli("replay", "--store", str(tmp_path / "events.db"), "--run", "run-1")
        assert done.returncode == 0, done.stderr
        assert f"ok: {c.version} events replayed" in done.stdout
        c.approve("audit")  # the writer goes on writing
        assert RunController.load(store, "run-1").version == c.version
    finally:
        store.close()


# ---------------------------------------------------------------------- list


def _listed_store(path: Path) -> Path:
    """A store with four runs: run-1 interrupted and claimed by worker-7, run-2 unsettled
    on the same Session, run-3 without a Session, run-4 on another Session."""
    path.parent.mkdir(parents=True, exist_ok=True)
    store = SQLiteEventStore(path)
    at_interruption(store=store).claim("worker-7")
    unsettled = at_interruption(store=store, run_id="run-2")
    run_charge(unsettled)
    unsettled.stage_publication(B, P, call_ids=["charge", "audit"])
    RunController.start(run_id="run-3", session_id=None, store=store)
    RunController.start(run_id="run-4", session_id="session-2", store=store)
    store.close()
    return path


def test_list_shows_one_line_per_run(tmp_path: Path) -> None:
    db = _listed_store(tmp_path / "events.db")
    done = cli("list", "--store", str(db))
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert done.stdout.splitlines() == [
        "run run-1: step INTERRUPTION, session session-1, 7 events, owner worker-7, blocked: "
        "awaiting_decisions (charge, notify, audit) since 2026-01-01T00:00:00.000Z",
        f"run run-2: step UNSETTLED, session session-1, {staged().version} events, no owner, "
        f"blocked: unsettled (run-2:{staged().version - 1}) since 2026-01-01T00:00:00.000Z",
        "run run-3: step RUN_AGAIN, no Session, 1 event, no owner",
        "run run-4: step RUN_AGAIN, session session-2, 1 event, no owner",
    ]


def test_list_filters_by_session_and_step(tmp_path: Path) -> None:
    db = _listed_store(tmp_path / "events.db")
    by_session = cli("list", "--store", str(db), "--session", "session-1")
    assert [line.split(":")[0] for line in by_session.stdout.splitlines()] == [
        "run run-1", "run run-2"]
    by_step = cli("list", "--store", str(db), "--step", "unsettled", "--step", "RUN_AGAIN")
    assert [line.split(":")[0] for line in by_step.stdout.splitlines()] == [
        "run run-2", "run run-3", "run run-4"]
    both = cli("list", "--store", str(db), "--session", "session-1", "--step",
               "RUN_AGAIN")
    assert (both.returncode, both.stdout) == (0, "")
    as_json = json.loads(cli("list", "--store", str(db), "--session", "session-1",
                             "--json").stdout)
    assert [{k: run[k] for k in ("run_id", "step", "session_id", "version", "owner")}
            for run in as_json] == [
        {"run_id": "run-1", "step": "interruption", "session_id": "session-1",
         "version": 7, "owner": "worker-7"},
        {"run_id": "run-2", "step": "unsettled", "session_id": "session-1",
         "version": staged().version, "owner": None},
    ]
    assert [(run["blocker"]["kind"], run["waiting"]) for run in as_json] == [
        ("awaiting_decisions", 3), ("unsettled", 1)]  # notify still awaits a decision


@pytest.mark.parametrize(("args", "says"), [
    (["--step", "sleeping"], "unknown step 'sleeping'"),
    (["--step", "x" * 3000], "unknown step 'xxx"),
    ([], "list needs --store DB or --dsn DSN"),
])
def test_list_refuses_a_bad_step_or_no_store_in_one_line(tmp_path: Path, args: list[str],
                                                         says: str) -> None:
    db = _listed_store(tmp_path / "events.db")
    store = [] if not args else ["--store", str(db)]
    line = _one_line_error(cli("list", *store, *args))
    assert says in line
    assert len(line) < 700
    assert "x" * 300 not in line


@pytest.mark.parametrize("kind", ["valid-store", "empty-file", "missing", "in-use"])
def test_list_never_creates_or_changes_a_file(kind: str, tmp_path: Path) -> None:
    db = tmp_path / "store" / "events.db"
    writer = None
    if kind in ("valid-store", "in-use"):
        _listed_store(db)
    else:
        db.parent.mkdir()
        if kind == "empty-file":
            db.write_bytes(b"")
    if kind == "in-use":  # a writer holds it open, its last events only in the -wal
        writer = SQLiteEventStore(db)
        RunController.load(writer, "run-3").begin_model_call()
    before = _fingerprint(db)
    try:
        done = cli("list", "--store", str(db), cwd=tmp_path)
        if kind in ("valid-store", "in-use"):
            assert done.returncode == 0, done.stderr
            assert len(done.stdout.splitlines()) == 4
            if kind == "in-use":
                assert "run run-3: step AWAITING_MODEL" in done.stdout
        else:
            line = _one_line_error(done)
            assert ("not an agent-statemachine event store" if kind == "empty-file"
                    else "no such store file") in line
        assert _fingerprint(db) == before
    finally:
        if writer is not None:
            writer.close()


# ------------------------------------------------------------------- explore


def test_explore_states_its_verdict_in_words() -> None:
    done = cli("explore", "--world", "reference", "--depth", "2")
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(r"reference: no counterexample to I1-I12 in \d+ states up to "
                        r"depth 2 \(.*\)\n", done.stdout), done.stdout


def test_explore_says_when_max_states_cut_the_search_short() -> None:
    done = cli("explore", "--world", "remote", "--depth", "4", "--max-states", "10")
    assert done.returncode == 0, done.stderr
    assert "no counterexample to I1-I12 in the first 10 states" in done.stdout
    assert "--max-states 10 cut the search short" in done.stdout


def test_explore_words_a_counterexample() -> None:
    report = ExploreReport(12, 30, 2, 0.1, (("approve", "charge"), ("run", "charge")),
                           "AssertionError: I1: charge ran twice")
    lines = explore_verdict("reference", report, depth=5, max_states=100)
    assert lines[0].startswith("reference: COUNTEREXAMPLE: 2 step(s) from the start "
                               "break an invariant")
    assert lines[1] == "  violation: AssertionError: I1: charge ran twice"
    assert lines[3:] == ["    1. approve charge", "    2. run charge"]


# --------------------------------------------------------------------- help


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    top = cli_parser()
    (commands,) = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(commands.choices)


def test_every_command_and_option_has_help() -> None:
    top = cli_parser()
    (commands,) = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)]
    aliases = {"list"}  # runs' other name
    assert {c.dest.split(" (")[0]: bool(c.help) for c in commands._choices_actions} == (
        dict.fromkeys(set(commands.choices) - aliases, True))
    for name, sub in [("statemachine", top), *_subcommands().items()]:
        assert sub.description, name
        for action in sub._actions:
            assert action.help, (name, action.dest)
            assert action.help != argparse.SUPPRESS, (name, action.dest)


@pytest.mark.parametrize("command", ["", "demo", "render", "inspect", "replay", "explore",
                                     "list", "runs", "inbox", "approve", "reject", "resolve",
                                     "abandon"])
def test_help_is_plain_text(command: str) -> None:
    done = cli(*command.split(), "--help")
    assert done.returncode == 0, done.stderr
    assert "`" not in done.stdout
    assert "*" not in done.stdout
    if command:
        for action in _subcommands()[command]._actions:
            for option in action.option_strings:
                assert option in done.stdout


# --------------------------------------------------------------------- demo


def test_the_demo_plays_every_scenario_and_checks_the_invariants(tmp_path: Path) -> None:
    done = cli("demo", "--dir", str(tmp_path / "demo"))
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    for expected in ("PublicationFailed", "refused approve", "ReconciledAcknowledge",
                     "ReconciledAppend", "partial write", "TERMINAL_UNRECOVERABLE",
                     "posted=False", "posted=True", "18 of 18 checks hold"):
        assert expected in out
    db = tmp_path / "demo" / "events.db"
    assert db.exists()
    # it ends with the commands that look at its runs, with the real paths; they work
    suggested = [shlex.split(line) for line in out.splitlines()
                 if line.startswith("  statemachine ")]
    assert {args[1] for args in suggested} == {"inspect", "render"}
    assert all(str(db) in args for args in suggested)
    before = _fingerprint(db)
    for args in suggested:
        ran = cli(*args[1:])
        assert ran.returncode == 0, (args, ran.stderr)
    assert _fingerprint(db)[:3] == before[:3]


def test_the_demo_refuses_a_directory_that_is_not_empty(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    line = _one_line_error(cli("demo", "--dir", str(tmp_path)))
    assert "is not empty" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
