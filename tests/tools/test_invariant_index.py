"""The invariant index (`tests.tools.invariant_index`, `just invariants`): every invariant
of DESIGN §2.5 has a test marked with it, every marker names invariants that exist, and
the README's table says what the index says."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.tools.invariant_index import INVARIANTS, files

ROOT = Path(__file__).resolve().parents[2]


def _index(*args: str) -> tuple[int, dict[str, Any], str]:
    """The index as ``python -m tests.tools.invariant_index --json`` prints it (a process
    of its own, so it collects the whole suite whatever this session collected)."""
    done = subprocess.run([sys.executable, "-m", "tests.tools.invariant_index", "--json",
                           *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.stdout, done.stderr
    return done.returncode, json.loads(done.stdout), done.stderr


@pytest.fixture(scope="module")
def suite() -> tuple[int, dict[str, Any], str]:
    return _index()


def test_every_invariant_has_a_marked_test(suite: tuple[int, dict[str, Any], str]) -> None:
    _, index, _ = suite
    assert list(index["tests"]) == list(INVARIANTS) == [f"I{n}" for n in range(1, 13)]
    assert [i for i, tests in index["tests"].items() if not tests] == []


def test_every_marker_names_known_invariants(suite: tuple[int, dict[str, Any], str]) -> None:
    code, index, stderr = suite
    assert index["unknown"] == {}
    assert code == 0, stderr


def test_the_index_reports_an_unknown_id_and_an_invariant_without_a_test(
        tmp_path: Path) -> None:
    (tmp_path / "test_marked.py").write_text(
        "import pytest\n\n"
        "@pytest.mark.invariant('I1', 'I13')\n"
        "def test_one() -> None:\n    pass\n\n"
        "@pytest.mark.invariant\n"
        "def test_two() -> None:\n    pass\n\n"
        "@pytest.mark.invariant(2)\n"
        "@pytest.mark.parametrize('n', [1, 2])\n"
        "def test_three(n: int) -> None:\n    pass\n")
    code, index, stderr = _index(str(tmp_path))
    assert code == 1
    assert [i for i, tests in index["tests"].items() if tests] == ["I1"]
    assert sorted(index["unknown"].values()) == [["'I13'"], ["(no id)"], ["2"]]
    assert "'I13', not one of I1-I12" in stderr
    assert "I2: no test is marked with it" in stderr


def test_the_readme_table_is_the_index(suite: tuple[int, dict[str, Any], str]) -> None:
    _, index, _ = suite
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    rows = dict(re.findall(r"^\| (I\d+) \| .* \| (.*) \|$", readme, re.M))
    assert rows == {i: files(tests) for i, tests in index["tests"].items()}, (
        "the README's table is pasted from `just invariants --markdown`")
