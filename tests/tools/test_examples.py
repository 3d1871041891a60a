"""The runnable examples in examples/ run as a user would run them, and succeed."""

from __future__ import annotations

import re
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


def _readme_imports() -> list[str]:
    """Every ``from statemachine... import ...`` statement of the README's Python blocks
    (issue 23, row 21: a snippet that does not import sends the user astray)."""
    readme = (EXAMPLES.parent / "README.md").read_text()
    found = []
    for block in re.findall(r"```python\n(.*?)```", readme, flags=re.S):
        for statement in re.findall(r"^(from statemachine[\w.]* import (?:\([^)]*\)|.*))$",
                                    block, flags=re.M):
            found.append(statement.split("#", 1)[0].rstrip())
    return found


def test_the_readme_finds_its_imports() -> None:
    assert any("SQLiteSession" in s for s in _readme_imports())


@pytest.mark.parametrize("statement", _readme_imports())
def test_every_readme_import_resolves(statement: str) -> None:
    namespace: dict[str, object] = {}
    exec(statement, namespace)  # the README's own import lines
    names = re.sub(r"[()\s]", "", statement.split(" import ", 1)[1]).split(",")
    assert all(name in namespace for name in names if name)
