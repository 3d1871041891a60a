"""The benchmark runs and reports every row (a smoke test: it asserts no timing)."""

from __future__ import annotations

import contextlib
import io
import json

from bench.__main__ import COMMANDS, main


def test_bench_reports_every_command_as_json() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["--runs", "20", "--repeats", "1", "--appends", "20", "--sizes", "50",
                     "--idle-runs", "50", "--fuzz-examples", "2", "--turns", "5",
                     "--batch-items", "20", "40", "--event-mb", "0.01", "0.02",
                     "--json"]) == 0
    report = json.loads(out.getvalue())
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
