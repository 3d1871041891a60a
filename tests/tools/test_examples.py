"""The runnable examples in examples/ run as a user would run them, and succeed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_example_runs(example: str, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(EXAMPLES / example)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()
    assert "Traceback" not in done.stderr


def test_every_example_is_listed_in_the_readme() -> None:
    readme = (EXAMPLES.parent / "README.md").read_text()
    for example in EXAMPLES.glob("*.py"):
        assert f"examples/{example.name}" in readme, example.name
