"""The benchmark runs and reports every row (a smoke test: it asserts no timing)."""

from __future__ import annotations

import contextlib
import io
import json

from bench.__main__ import COMMANDS, main


def test_bench_reports_every_command_as_json() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["--runs", "20", "--repeats", "1", "--appends", "20", "--json"]) == 0
    report = json.loads(out.getvalue())
    assert [row["command"] for row in report["command"]] == list(COMMANDS)
    for row in report["command"]:
        assert row["floor_us"] > 0
        assert row["controller_us"] > 0
        assert row["transitions_us"] > 0
    assert report["sqlite_store"]["store_appends_per_s"] > 0
