"""The invariant index: the tests that check each invariant of DESIGN §2.5 (I1...I12),
read from their ``invariant`` markers (``@pytest.mark.invariant("I4")``, several ids
allowed) while pytest collects the suite. Nothing runs, so it takes seconds.

``python -m tests.tools.invariant_index`` (`just invariants`) prints each invariant and the
tests marked with it, one node id a line (a parametrized test once, with its number of
cases); ``--markdown`` prints, per invariant, the README table's "checked by" cell (the
files and how many marked tests each holds); ``--json`` prints the whole index. The exit
status is 1 when an invariant has no marked test or a marker names no known invariant.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

INVARIANTS = {
    "I1": "each approved tool call, its guardrails and its hooks run exactly once",
    "I2": "while unsettled, commands are refused before anything is recorded",
    "I3": "a successful recovery leaves exactly one copy of the batch in the Session",
    "I4": "completed guardrail results survive every recovery, published exactly once",
    "I5": "interruptions and decisions are preserved; no approval is resurrected",
    "I6": "the original write error propagates from the failing attempt",
    "I7": "mismatch, changed history, partial writes, concurrent resumes fail closed",
    "I8": "streamed and non-streamed runs leave equal durable state",
    "I9": "TERMINAL_UNRECOVERABLE refuses every resume, survives, is never left",
    "I10": "replay is deterministic; a forged or corrupted log is rejected on load",
    "I11": "a started-but-not-completed call is never re-executed automatically",
    "I12": "an unpublished result is re-sent from the cache, never recomputed",
}


@dataclass
class Index:
    """Marked tests by invariant, as node ids without parameters (a parametrized test is
    one entry; `cases` counts what pytest collected for it)."""

    tests: dict[str, list[str]] = field(default_factory=lambda: {i: [] for i in INVARIANTS})
    cases: Counter[str] = field(default_factory=Counter)
    unknown: dict[str, list[str]] = field(default_factory=dict)
    """Tests whose markers name something that is not an invariant id, with what they name."""

    def missing(self) -> list[str]:
        return [i for i, tests in self.tests.items() if not tests]

    def add(self, nodeid: str, ids: list[object]) -> None:
        """One collected test and the ids its markers name (its cases may differ)."""
        test = re.sub(r"\[.*\]$", "", nodeid)
        self.cases[test] += 1
        wrong = [repr(i) for i in ids if not (isinstance(i, str) and i in INVARIANTS)]
        if wrong or not ids:
            names = self.unknown.setdefault(test, [])
            names += [name for name in wrong or ["(no id)"] if name not in names]
        for i in ids:
            if isinstance(i, str) and i in INVARIANTS and test not in self.tests[i]:
                self.tests[i].append(test)


def files(tests: list[str]) -> str:
    """The README's "checked by" cell of an invariant marked on ``tests``: each file (its
    path under tests/) and how many of its tests are marked."""
    per_file = Counter(test.split("::", 1)[0].removeprefix("tests/") for test in tests)
    return ", ".join(f"`{name}` ({n})" for name, n in sorted(per_file.items()))


class _Collector:
    """A pytest plugin that reads the invariant markers of every collected test."""

    def __init__(self) -> None:
        self.index = Index()

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            marks = list(item.iter_markers("invariant"))
            if marks:
                self.index.add(item.nodeid, [i for mark in marks for i in mark.args])


def collect(*paths: str) -> Index:
    """The index of the tests under ``paths`` (the whole suite when none is given)."""
    collector = _Collector()
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider",
                            "--rootdir", str(ROOT), "-c", str(ROOT / "pyproject.toml"),
                            *(paths or (str(ROOT / "tests"),))], plugins=[collector])
    if code != pytest.ExitCode.OK:
        sys.stderr.write(output.getvalue())
        raise SystemExit(f"collection failed (pytest exit status {int(code)})")
    for tests in collector.index.tests.values():
        tests.sort()
    return collector.index


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.tools.invariant_index",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", help="test files or folders (default: tests)")
    form = parser.add_mutually_exclusive_group()
    form.add_argument("--markdown", action="store_true",
                      help="one README table cell per invariant: files and marked tests")
    form.add_argument("--json", action="store_true", help="the whole index as JSON")
    args = parser.parse_args(argv)
    index = collect(*args.paths)
    if args.json:
        print(json.dumps({"tests": index.tests, "cases": dict(index.cases),
                          "unknown": index.unknown}, indent=1))
    elif args.markdown:
        for invariant in INVARIANTS:
            print(f"| {invariant} | {files(index.tests[invariant])} |")
    else:
        for invariant, title in INVARIANTS.items():
            print(f"{invariant}  {title}")
            for test in index.tests[invariant]:
                n = index.cases[test]
                print(f"    {test}" + (f" ({n} cases)" if n > 1 else ""))
    for test, names in index.unknown.items():
        print(f"{test}: the invariant marker names {', '.join(names)}, not one of I1-I12",
              file=sys.stderr)
    for invariant in index.missing():
        print(f"{invariant}: no test is marked with it", file=sys.stderr)
    return 1 if index.unknown or index.missing() else 0


if __name__ == "__main__":
    sys.exit(main())
