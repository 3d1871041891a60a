"""Plant one mutant at a time in a fresh copy of the tree and run its module's tests.

A mutant is *killed* when its test selection fails (a run past the per-mutant timeout is
killed too, and reported as a timeout), *survived* when the selection passes, and
*equivalent* when the catalogue says it cannot change any behaviour (it is then not run).
A mutant whose original snippet does not occur exactly once in its target is *stale*: the
catalogue no longer describes the code, and the run refuses to score anything.

The checkout the harness reads is never written: each mutant gets its own temporary copy
of the package, the tests and the project configuration."""

from __future__ import annotations

import enum
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from mutate.catalogue import SELECTIONS, Mutant

ROOT = Path(__file__).resolve().parent.parent
"""The checkout the catalogue describes (the mutants' targets are relative to it)."""

COPIED = ("statemachine", "tests", "examples", "pyproject.toml", "README.md")
"""What a mutant's copy of the tree holds: enough to run any selected test."""

_IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis", ".pytest_cache")

PYTEST_FLAGS = ("-x", "-q", "-p", "no:cacheprovider", "--no-header", "-rfE")

STRUCTURAL = (
    "tests/tools/test_mutate_harness.py",
    "tests/tools/test_layout.py",
    "tests/tools/test_invariant_index.py",
    "tests/tools/test_unasync.py::test_the_generated_sync_driver_is_current",
)
"""Tests that check the source text or the tree's shape rather than behaviour (the
catalogue's snippets, the imports between modules, the README's index, the generated
sync driver against its async source): any edit to a line they read fails them, so they
would kill a mutant without checking what it does. Every selection runs without them."""

GOAL = 0.90
"""The least share of non-equivalent mutants the tests must kill."""

_GRACE = 15.0
"""Seconds a timed-out run gets to tear down (its PostgreSQL clusters) after SIGINT."""


class StaleMutant(Exception):
    """A mutant's original snippet does not occur exactly once in its target."""


class Outcome(enum.Enum):
    KILLED = "killed"
    SURVIVED = "survived"
    EQUIVALENT = "equivalent"
    ERROR = "error"
    """The selection could not run at all (a usage error, no test collected): a harness
    problem, never counted as a kill."""


@dataclass(frozen=True)
class Result:
    mutant: Mutant
    outcome: Outcome
    seconds: float = 0.0
    timed_out: bool = False
    detail: str = ""
    """The first failing test (killed), the equivalence reason, or what went wrong."""


def module_of(target: str) -> str:
    """``statemachine/runner/loop.py`` → ``runner/loop``."""
    path = Path(target)
    parts = path.with_suffix("").parts
    return "/".join(parts[1:] if parts and parts[0] == "statemachine" else parts)


def occurrences(root: Path, mutant: Mutant) -> int:
    """How many times the mutant's original snippet occurs in its target under ``root``
    (-1 when the target file is missing)."""
    path = root / mutant.target
    if not path.is_file():
        return -1
    return path.read_text(encoding="utf-8").count(mutant.original)


def check_catalogue(mutants: Sequence[Mutant], root: Path = ROOT) -> list[str]:
    """Every problem with the catalogue against the tree at ``root``: duplicate ids, empty
    fields, a no-op replacement, a target without a test selection, and stale snippets
    (not exactly once in their target). Empty when the catalogue is sound."""
    problems: list[str] = []
    seen: set[str] = set()
    for m in mutants:
        if m.id in seen:
            problems.append(f"{m.id}: duplicate id")
        seen.add(m.id)
        if not m.id or not m.description.strip() or not m.original:
            problems.append(f"{m.id or '?'}: empty id, description or snippet")
        if m.original == m.replacement:
            problems.append(f"{m.id}: the replacement is the original")
        if m.equivalent is not None and not m.equivalent.strip():
            problems.append(f"{m.id}: equivalent without a reason")
        if m.target not in SELECTIONS:
            problems.append(f"{m.id}: no test selection for {m.target}")
        found = occurrences(root, m)
        if found == -1:
            problems.append(f"{m.id}: STALE: no file {m.target}")
        elif found != 1:
            problems.append(f"{m.id}: STALE: its snippet occurs {found} times in {m.target}")
        elif m.target.endswith(".py"):
            broken = _uncompilable(root, m)
            if broken is not None:
                problems.append(f"{m.id}: the mutated {m.target} does not compile ({broken}): "
                                "its tests would fail on the import, not on what it does")
    return problems


def _uncompilable(root: Path, mutant: Mutant) -> str | None:
    """Why ``mutant`` planted in its target is not Python (None: it compiles). A snippet
    taken at another indentation than its line's, or one that cuts a string in two,
    makes a file no test can import: such a mutant would be killed without a test
    checking anything it does."""
    text = (root / mutant.target).read_text(encoding="utf-8")
    try:
        compile(text.replace(mutant.original, mutant.replacement, 1), mutant.target, "exec")
    except SyntaxError as error:
        return f"{type(error).__name__} at line {error.lineno}: {error.msg}"
    return None


def apply(root: Path, mutant: Mutant) -> str:
    """Plant ``mutant`` in the tree at ``root``; returns the target's original text (for
    `unapply`). `StaleMutant` when the snippet is not there exactly once."""
    path = root / mutant.target
    text = path.read_text(encoding="utf-8")
    count = text.count(mutant.original)
    if count != 1:
        raise StaleMutant(f"{mutant.id}: its snippet occurs {count} times in {mutant.target}")
    path.write_text(text.replace(mutant.original, mutant.replacement, 1), encoding="utf-8")
    return text


def unapply(root: Path, mutant: Mutant, original: str) -> None:
    """Put back the target's text `apply` returned."""
    (root / mutant.target).write_text(original, encoding="utf-8")


def copy_tree(source: Path, destination: Path) -> None:
    """The parts of the checkout a test run needs (`COPIED`), without caches."""
    for name in COPIED:
        src = source / name
        if src.is_dir():
            shutil.copytree(src, destination / name, ignore=_IGNORED)
        elif src.is_file():
            shutil.copy2(src, destination / name)


def _environment(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["CI"] = "1"  # the deterministic, bounded Hypothesis profile
    env.pop("HYPOTHESIS_PROFILE", None)
    env["PYTHONPATH"] = str(tree)  # the copy's package, before any installed one
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def _stop(process: subprocess.Popen[bytes]) -> None:
    """End a timed-out test run and everything it started in its session: SIGINT first
    (pytest tears its fixtures down), SIGKILL after `_GRACE` seconds."""
    for sig, wait in ((signal.SIGINT, _GRACE), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _first_failure(output: str) -> str:
    for line in output.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line[:200]
    lines = [line for line in output.splitlines() if line.strip()]
    return lines[-1][:200] if lines else ""


def _deselected() -> list[str]:
    """pytest's arguments leaving out `STRUCTURAL` (a node id prefix: a file deselects
    every test in it, even one a selection names)."""
    return [flag for test in STRUCTURAL for flag in ("--deselect", test)]


def run_selection(tree: Path, selection: Sequence[str], timeout: float
                  ) -> tuple[int | None, float, str]:
    """Run the test selection in ``tree``: (pytest's exit code or None on timeout,
    seconds, output)."""
    started = time.monotonic()
    with tempfile.TemporaryFile() as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "pytest", *PYTEST_FLAGS, *_deselected(), *selection],
            cwd=tree,
            env=_environment(tree), stdin=subprocess.DEVNULL, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code: int | None = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop(process)
            code = None
        except BaseException:
            _stop(process)
            raise
        out.seek(0)
        output = out.read().decode("utf-8", "replace")
    return code, time.monotonic() - started, output


def run_mutant(mutant: Mutant, *, root: Path = ROOT, timeout: float = 300.0) -> Result:
    """Plant ``mutant`` in a fresh copy of ``root`` and run its module's selection (an
    unexpected failure of the harness itself is an `Outcome.ERROR`, never a kill)."""
    try:
        return _run_mutant(mutant, root=root, timeout=timeout)
    except Exception as error:
        return Result(mutant, Outcome.ERROR, detail=f"{type(error).__name__}: {error}")


def _run_mutant(mutant: Mutant, *, root: Path, timeout: float) -> Result:
    if mutant.equivalent is not None:
        return Result(mutant, Outcome.EQUIVALENT, detail=mutant.equivalent)
    with tempfile.TemporaryDirectory(prefix="mutant-") as scratch:
        tree = Path(scratch)
        copy_tree(root, tree)
        try:
            apply(tree, mutant)
        except StaleMutant as stale:  # the code changed after the catalogue was checked
            return Result(mutant, Outcome.ERROR, detail=f"STALE: {stale}")
        code, seconds, output = run_selection(tree, SELECTIONS[mutant.target], timeout)
    if code is None:
        return Result(mutant, Outcome.KILLED, seconds, timed_out=True,
                      detail=f"timed out after {timeout:.0f}s")
    if code == 0:
        return Result(mutant, Outcome.SURVIVED, seconds)
    if code in (1, 2):  # tests failed, or collection/import failed under the mutant
        return Result(mutant, Outcome.KILLED, seconds, detail=_first_failure(output))
    return Result(mutant, Outcome.ERROR, seconds,
                  detail=f"pytest exit code {code}: {_first_failure(output)}")


def baseline(targets: Iterable[str], *, root: Path = ROOT, timeout: float = 900.0
             ) -> list[str]:
    """Run each distinct selection of ``targets`` on an unmutated copy: the problems
    (a selection that fails without a mutant would kill every mutant for nothing)."""
    problems = []
    selections = {tuple(SELECTIONS[target]) for target in targets}
    with tempfile.TemporaryDirectory(prefix="mutant-baseline-") as scratch:
        tree = Path(scratch)
        copy_tree(root, tree)
        for selection in sorted(selections):
            code, _, output = run_selection(tree, selection, timeout)
            if code != 0:
                problems.append(f"the unmutated tree fails {' '.join(selection)} "
                                f"({'timeout' if code is None else f'exit {code}'}: "
                                f"{_first_failure(output)})")
    return problems


def score(results: Iterable[Result]) -> float | None:
    """killed / (killed + survived); None when no mutant was scored."""
    outcomes = [r.outcome for r in results]
    killed = outcomes.count(Outcome.KILLED)
    scored = killed + outcomes.count(Outcome.SURVIVED)
    return killed / scored if scored else None
