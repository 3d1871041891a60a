"""`statemachine list --dsn` and `inspect --dsn`: how an operator sees the runs of a
PostgreSQL event store, read-only."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from statemachine import RunController, Step, ToolCall
from statemachine.postgres import PostgresEventStore

pytestmark = pytest.mark.postgres


@pytest.fixture
def default_schema(pg_dsn: str) -> Iterator[str]:
    """The CLI reads the store's default schema; drop it around the test."""
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute("DROP SCHEMA IF EXISTS statemachine CASCADE")
        yield pg_dsn
        admin.execute("DROP SCHEMA IF EXISTS statemachine CASCADE")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "statemachine", *args], capture_output=True,
                          text=True, timeout=60, check=False)


def test_list_and_inspect_a_postgres_store(default_schema: str) -> None:
    dsn = default_schema
    with PostgresEventStore(dsn) as store:
        paused = RunController.start(run_id="run-1", session_id="s1", store=store)
        paused.claim("worker-7")
        paused.begin_model_call()
        paused.model_responded([ToolCall("c1", "pay", {"amount": 7}, needs_approval=True)])
        done = RunController.start(run_id="run-2", session_id=None, store=store)
        done.begin_model_call()
        done.model_responded(output="hi")
        done.accept_final_output("hi")
        done.complete()
    listed = _cli("list", "--dsn", dsn)
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines == ["run run-1: step INTERRUPTION, session s1, 4 events, owner worker-7, "
                     "blocked: awaiting_decisions (c1) since 2026-01-01T00:00:00.000Z",
                     "run run-2: step COMPLETED, no Session, 5 events, no owner"]
    only = json.loads(_cli("list", "--dsn", dsn, "--step", "interruption", "--json").stdout)
    assert [run["run_id"] for run in only] == ["run-1"]
    inspected = _cli("inspect", "--dsn", dsn, "--run", "run-1", "--json")
    assert inspected.returncode == 0, inspected.stderr
    assert json.loads(inspected.stdout)["step"] == Step.INTERRUPTION.value
    both = _cli("list", "--dsn", dsn, "--store", "x.db")
    assert both.returncode == 2
    assert "not both" in both.stderr


def test_an_unreachable_dsn_is_one_line_and_exit_2() -> None:
    done = _cli("list", "--dsn", "host=/nonexistent-socket-dir dbname=x connect_timeout=2")
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1
    assert "Traceback" not in done.stderr


def test_render_draws_a_run_of_a_postgres_store(default_schema: str, tmp_path: Path) -> None:
    dsn = default_schema
    with PostgresEventStore(dsn) as store:
        paused = RunController.start(run_id="run-1", session_id="s1", store=store)
        paused.begin_model_call()
        paused.model_responded([ToolCall("c1", "pay", {"amount": 7}, needs_approval=True)])
    done = _cli("render", "--dsn", dsn, "--run", "run-1", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    drawn = (tmp_path / "run-run-1.mmd").read_text()
    assert "class interruption current" in drawn
    missing = _cli("render", "--dsn", dsn, "--run", "ghost", "--out", str(tmp_path))
    assert missing.returncode == 2
    assert "no run 'ghost' in the --dsn database" in missing.stderr
