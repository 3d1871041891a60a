"""The operator's verbs from the shell (DESIGN §7.5), on a SQLite file and on PostgreSQL:
find what waits (``inbox``, ``runs --blocked``), act (``approve``, ``reject``,
``resolve``, ``abandon``), and see it recorded with who; a refusal is one line, exit 2,
and changes nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from statemachine import Phase, Resolution, RunController, Step, ToolCall
from statemachine.postgres import PostgresEventStore
from statemachine.stores import SQLiteEventStore


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "statemachine", *args], capture_output=True,
                          text=True, timeout=120, check=False)


def _ok(*args: str) -> str:
    done = _cli(*args)
    assert done.returncode == 0, (args, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    return done.stdout


def _refused(*args: str) -> str:
    done = _cli(*args)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 2, (args, done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def _seed(store: Any) -> None:
    """run-a awaits decisions on pay and notify; run-b's charge was started by a worker
    that died (in doubt); run-c completed."""
    a = RunController.start(run_id="run-a", session_id=None, store=store)
    a.begin_model_call()
    a.model_responded([ToolCall("pay", "pay", {"amount": 7, "to": "acme"},
                                needs_approval=True),
                       ToolCall("notify", "notify", {}, needs_approval=True)])
    b = RunController.start(run_id="run-b", session_id=None, store=store)
    b.begin_model_call()
    b.model_responded([ToolCall("charge", "charge", {"x": 1})])
    b.begin_tool("charge")
    c = RunController.start(run_id="run-c", session_id=None, store=store)
    c.begin_model_call()
    c.model_responded(output="hi")
    c.accept_final_output("hi")
    c.complete()


def _round_trip(where: list[str], load: Callable[[str], RunController]) -> None:
    inbox = json.loads(_ok("inbox", *where, "--json"))
    assert [(w["run_id"], w["call_id"], w["kind"]) for w in inbox] == [
        ("run-a", "pay", "approval"), ("run-a", "notify", "approval"),
        ("run-b", "charge", "in_doubt")]
    pay = inbox[0]
    assert pay["tool"] == "pay"
    assert json.loads(pay["arguments"]) == {"amount": 7, "to": "acme"}
    assert pay["fingerprint"] == load("run-a").fingerprint("pay")
    blocked = json.loads(_ok("runs", *where, "--blocked", "--json"))
    assert [(r["run_id"], r["blocker"]["kind"], r["blocker"]["call_ids"]) for r in blocked] == [
        ("run-a", "awaiting_decisions", ["pay", "notify"]),
        ("run-b", "in_doubt", ["charge"])]
    # refused, with nothing changed: a fingerprint of other arguments, no --by
    version = load("run-a").version
    line = _refused("approve", "run-a", "pay", *where, "--by", "alice", "--fingerprint",
                    inbox[1]["fingerprint"])
    assert "InvalidTransition" in line
    assert "fingerprint" in line
    _refused("approve", "run-a", "pay", *where, "--fingerprint", pay["fingerprint"])
    _refused("resolve", "run-a", "pay", *where, "--by", "carol", "--completed", '"x"')
    _refused("resolve", "run-b", "charge", *where, "--by", "carol", "--completed", "{bad")
    assert load("run-a").version == version
    # acting
    said = _ok("approve", "run-a", "pay", *where, "--by", "alice", "--fingerprint",
               pay["fingerprint"], "--reason", "invoice 12")
    assert "approved call pay as alice" in said
    _ok("reject", "run-a", "notify", *where, "--by", "bob", "--message", "not now")
    a = load("run-a")
    assert [(d.kind, d.by, d.reason) for d in a.call("pay").decisions] == [
        ("approved", "alice", "invoice 12")]
    assert a.call("notify").result == "not now"
    _ok("resolve", "run-b", "charge", *where, "--by", "carol", "--completed",
        '{"charged": 1}', "--evidence", "ch_42")
    b = load("run-b")
    assert b.call("charge").result == {"charged": 1}
    last = b.call("charge").decisions[-1]
    assert (last.by, last.outcome, last.evidence) == ("carol", Resolution.COMPLETED, "ch_42")
    assert json.loads(_ok("inbox", *where, "--json")) == []
    assert "nothing waits" in _ok("inbox", *where)
    inspected = _ok("inspect", *where, "--run", "run-b")
    assert "resolved completed by carol" in inspected
    assert "ch_42" in inspected
    _ok("abandon", "run-a", *where, "--by", "dave", "--reason", "customer left")
    assert load("run-a").step is Step.TERMINAL_UNRECOVERABLE
    line = _refused("abandon", "run-c", *where, "--by", "dave", "--reason", "again")
    assert "RunNotResumable" in line


def test_the_operator_verbs_on_a_sqlite_file(tmp_path: Path) -> None:
    db = tmp_path / "events.db"
    store = SQLiteEventStore(db)
    _seed(store)
    store.close()
    _round_trip(["--store", str(db)], lambda run: RunController.load(SQLiteEventStore(db),
                                                                       run))
    assert "no event store" in _refused("approve", "r", "c", "--store",
                                        str(tmp_path / "missing.db"), "--by", "x",
                                        "--fingerprint", "ab")
    assert not (tmp_path / "missing.db").exists()


def test_not_executed_from_the_shell_gives_the_call_back(tmp_path: Path) -> None:
    db = tmp_path / "events.db"
    store = SQLiteEventStore(db)
    _seed(store)
    store.close()
    _ok("resolve", "run-b", "charge", "--store", str(db), "--by", "carol", "--not-executed",
        "--evidence", "no charge at the bank")
    b = RunController.load(SQLiteEventStore(db), "run-b")
    assert b.phase("charge") is Phase.APPROVED
    assert b.call("charge").decisions[-1].outcome is Resolution.NOT_EXECUTED
    line = _refused("resolve", "run-b", "charge", "--store", str(db), "--by", "carol",
                    "--failed", "card declined")
    assert "InvalidTransition" in line  # no longer in doubt



def test_a_command_bound_to_the_run_as_seen_decides_nothing_once_it_moved(
        tmp_path: Path) -> None:
    """``--seen N`` binds a write to the run as the operator saw it (N events, as
    inspect shows them). A resolve --not-executed run again after the call was run again
    and died in its body (in doubt once more) would decide about a doubt nobody looked
    at, and run the call a third time: with --seen it is refused, one line, nothing
    written; a negative N is refused too."""
    db = tmp_path / "events.db"
    store = SQLiteEventStore(db)
    _seed(store)
    seen = str(RunController.load(store, "run-b").version)
    store.close()
    resolve = ("resolve", "run-b", "charge", "--store", str(db), "--by", "carol",
               "--not-executed", "--seen", seen)
    _ok(*resolve)
    worker = RunController.load(SQLiteEventStore(db), "run-b")
    worker.claim("worker-2")
    worker.resume()
    worker.begin_tool("charge")  # run again, and died in its body
    before = RunController.load(SQLiteEventStore(db), "run-b").version
    line = _refused(*resolve)
    assert "ConcurrencyConflict" in line
    assert "moved" in line
    after = RunController.load(SQLiteEventStore(db), "run-b")
    assert after.version == before
    assert after.in_doubt() == ("charge",)
    assert "--seen" in _refused("abandon", "run-b", "--store", str(db), "--by", "carol",
                                "--reason", "stop", "--seen", "-1")

@pytest.fixture
def default_schema(pg_dsn: str) -> Iterator[str]:
    """The CLI uses the store's default schema; drop it around the test."""
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute("DROP SCHEMA IF EXISTS statemachine CASCADE")
        yield pg_dsn
        admin.execute("DROP SCHEMA IF EXISTS statemachine CASCADE")


@pytest.mark.postgres
def test_the_operator_verbs_on_postgres(default_schema: str) -> None:
    dsn = default_schema
    with PostgresEventStore(dsn) as store:
        _seed(store)

    def load(run: str) -> RunController:
        with PostgresEventStore(dsn) as reader:
            return RunController.from_json(RunController.load(reader, run).to_json())

    _round_trip(["--dsn", dsn], load)


README = Path(__file__).resolve().parents[2] / "README.md"
SEED = Path(__file__).resolve().parents[2] / "examples" / "operator_seed.py"


def _guide() -> tuple[list[str], list[str]]:
    """The operator's guide in the README: its shell commands and its Python blocks."""
    text = README.read_text(encoding="utf-8")
    start = text.index("## Settling runs: the operator's guide")
    section = text[start:text.index("\n## ", start + 1)]
    commands: list[str] = []
    python: list[str] = []
    for block in section.split("```")[1::2]:
        kind, _, body = block.partition("\n")
        if kind == "sh":
            commands += [line for line in body.splitlines() if line.strip()]
        elif kind == "python":
            python.append(body)
    return commands, python


def test_the_readme_operators_guide_runs_as_written(tmp_path: Path) -> None:
    import shlex

    commands, python = _guide()
    assert len(commands) >= 7
    assert python
    subprocess.run([sys.executable, str(SEED), "runs.db"], cwd=tmp_path, check=True,
                   timeout=120)
    for line in commands:
        argv = shlex.split(line)
        assert argv[0] == "statemachine", line
        done = subprocess.run([sys.executable, "-m", "statemachine", *argv[1:]],
                              cwd=tmp_path, capture_output=True, text=True, timeout=120,
                              check=False)
        assert done.returncode == 0, (line, done.stdout, done.stderr)
    store = SQLiteEventStore(tmp_path / "runs.db")
    assert RunController.load(store, "order-18").phase("refund") is Phase.APPROVED
    assert RunController.load(store, "order-19").phase("email") is Phase.REJECTED
    assert RunController.load(store, "order-17").step is Step.TERMINAL_UNRECOVERABLE
    store.close()
    # the Python block, on a fresh copy of the seeded runs
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    subprocess.run([sys.executable, str(SEED), "runs.db"], cwd=fresh, check=True, timeout=120)
    done = subprocess.run([sys.executable, "-c", python[0]], cwd=fresh, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "order-17 charge in_doubt charge_card" in done.stdout
    again = RunController.load(SQLiteEventStore(fresh / "runs.db"), "order-17")
    assert again.phase("charge") is Phase.APPROVED
