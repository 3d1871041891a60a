"""The benchmark runs and reports every row (a smoke test: it asserts no timing)."""

from __future__ import annotations

import contextlib
import io
import json
from typing import Any

import pytest

from bench import backends
from bench.__main__ import COMMANDS, FULL, QUICK, main, markdown, options, print_report

TINY = ["--runs", "20", "--repeats", "1", "--appends", "20", "--sizes", "50",
        "--idle-runs", "50", "--fuzz-examples", "2", "--turns", "5",
        "--batch-items", "20", "40", "--event-mb", "0.01", "0.02",
        "--scenarios", "1", "--lag-runs", "3", "--pg-appends", "5", "--workers", "1", "2",
        "--worker-runs", "1"]


def _run(*argv: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(list(argv)) == 0
    return out.getvalue()


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    """One tiny run of the whole bench (without PostgreSQL), as JSON."""
    found: dict[str, Any] = json.loads(_run(*TINY, "--no-pg", "--json"))
    return found


def test_bench_reports_every_command_as_json(report: dict[str, Any]) -> None:
    assert [row["command"] for row in report["command"]] == list(COMMANDS)
    for row in report["command"]:
        assert row["floor_us"] > 0
        assert row["controller_us"] > 0
        assert row["transitions_us"] > 0
    assert report["sqlite_store"]["store_appends_per_s"] > 0
    assert report["load"][0]["events"] == 50
    assert report["memory"]["bytes_per_run"] > 0
    assert report["fuzz"]["steps"] > 0
    assert report["scenario"]["reference_runner_ms"] > 0
    assert report["roundtrip"]["items"] == 10
    large = report["large"]
    assert [row["items"] for row in large["batch"]] == [20, 40]
    assert large["batch_stage_ratio"] > 0
    assert large["batch_load_ratio"] > 0
    assert 0 < large["event"][0]["event_bytes"] < large["event"][1]["event_bytes"]
    assert large["event_load_ratio"] > 0


def test_the_backend_rows_run_or_say_why_not(report: dict[str, Any]) -> None:
    """The embedded stores' rows run; the PostgreSQL ones say why they did not."""
    assert report["postgres"]["available"] is False
    assert report["pg_append"] == {"skipped": "skipped: --no-pg"}
    assert report["pg_workers"] == {"skipped": "skipped: --no-pg"}
    _check_embedded_rows(report)
    for row in report["backend_scenario"] + report["loop_lag"]["rows"]:
        if row["store"].startswith("PostgreSQL"):
            assert row["skipped"] == "skipped: --no-pg"


def test_the_text_and_markdown_reports_show_every_section(report: dict[str, Any]) -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_report(report, options(TINY))
    text = out.getvalue()
    for heading in ("one guarded command", "SQLite store, one event per transaction",
                    "the seed scenario per store", "event-loop lag",
                    "PostgreSQL store append: skipped: --no-pg",
                    "PostgreSQL worker processes: skipped: --no-pg"):
        assert heading in text
    table = markdown(report)
    assert "| seed scenario, SQLite buffered |" in table
    assert "| loop lag, 3 concurrent runs, SQLite async |" in table
    assert "| PostgreSQL store append | skipped: --no-pg |" in table


def test_quick_fills_in_only_what_is_not_given() -> None:
    assert options([]).scenarios == FULL["scenarios"]
    assert options(["--quick"]).scenarios == QUICK["scenarios"]
    assert options(["--quick"]).sizes == QUICK["sizes"]
    assert options(["--quick", "--scenarios", "2"]).scenarios == 2


def _check_embedded_rows(report: dict[str, Any]) -> None:
    rows = {row["store"]: row for row in report["backend_scenario"]}
    assert rows["memory"]["over_memory"] == 1.0
    for name in ("memory", "SQLite per command", "SQLite buffered", "SQLite async"):
        assert rows[name]["ms"] > 0
        assert rows[name]["events"] > 0
        assert 0 < rows[name]["transactions"] <= rows[name]["events"]
    # per command: one transaction per event; buffered: fewer
    assert rows["SQLite per command"]["transactions"] == rows["SQLite per command"]["events"]
    assert rows["SQLite async"]["transactions"] < rows["SQLite async"]["events"]
    lag = report["loop_lag"]
    assert lag["runs"] == 3
    assert lag["idle"]["heartbeats"] > 0
    for row in lag["rows"]:
        if "skipped" not in row:
            assert row["wall_s"] > 0


@pytest.mark.postgres
def test_bench_postgres_rows(pg_dsn: str) -> None:
    with backends.postgres(pg_dsn) as pg:
        assert pg.dsn == pg_dsn
        report = backends.measure_all(pg, pg_appends=5, repeats=1, scenarios=1, lag_runs=3,
                                      workers=(1, 2), worker_runs=1)
    assert report["postgres"]["available"] is True
    append = report["pg_append"]
    assert append["appends"] == 5
    assert append["store_appends_per_s"] > 0
    assert append["bare_psycopg_per_s"] > 0
    assert append["where"]["store_round_trip_us"] > 0
    _check_embedded_rows(report)
    rows = {row["store"]: row for row in report["backend_scenario"]}
    for name in ("PostgreSQL per command", "PostgreSQL buffered", "PostgreSQL async"):
        assert rows[name]["ms"] > 0
    assert rows["PostgreSQL per command"]["transactions"] == rows[
        "PostgreSQL per command"]["events"]
    assert "skipped" not in {k for row in report["loop_lag"]["rows"] for k in row}
    workers = report["pg_workers"]
    for mode in ("per_command", "buffered"):
        assert [row["workers"] for row in workers[mode]] == [1, 2]
        assert all(row["runs_per_s"] > 0 and row["events_per_s"] > 0 for row in workers[mode])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        backends.print_rows(report)
    assert "bare psycopg" in out.getvalue()
    assert "PostgreSQL workers, buffered" in "\n".join(backends.markdown_rows(report))
