"""The mutation harness's self-check (fast; no mutant is run here): the catalogue is well
formed and describes the current tree (no stale mutant), and planting and removing a
mutant works on a copy, leaving the checkout untouched."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from mutate import (
    CATALOGUE,
    SELECTIONS,
    Mutant,
    Outcome,
    Result,
    StaleMutant,
    apply,
    check_catalogue,
    harness,
    module_of,
    run_mutant,
    score,
    unapply,
)
from mutate.harness import ROOT, copy_tree


def test_the_catalogue_describes_the_current_tree() -> None:
    # a stale snippet (gone, or no longer unique) names the mutant to fix or drop
    assert check_catalogue(CATALOGUE) == []


def test_ids_are_unique_and_every_mutant_says_what_bug_it_plants() -> None:
    ids = [m.id for m in CATALOGUE]
    assert len(ids) == len(set(ids))
    for m in CATALOGUE:
        assert m.description.strip()
        assert m.original
        assert m.original != m.replacement
        assert m.equivalent is None or len(m.equivalent) > 20  # a reason, not a flag
        assert (ROOT / m.target).is_file()
        assert m.target.startswith("statemachine/")


def test_every_selection_names_existing_test_files() -> None:
    for target, selection in SELECTIONS.items():
        assert (ROOT / target).is_file(), target
        assert selection, target
        files = [name for name in selection if name.endswith(".py")]
        assert files, target
        for name in files:
            assert (ROOT / name).is_file(), f"{target}: {name}"


def test_the_catalogue_covers_core_and_runner_modules() -> None:
    modules = {module_of(m.target) for m in CATALOGUE}
    assert {"machine", "state", "envelope", "codec", "controller", "stores", "sqlite",
            "sessions", "postgres/steps", "runner/loop", "runner/publish", "runner/remote",
            "runner/agents"} <= modules
    assert len(CATALOGUE) >= 80


def test_module_names() -> None:
    assert module_of("statemachine/runner/loop.py") == "runner/loop"
    assert module_of("statemachine/machine.py") == "machine"


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    copy = tmp_path_factory.mktemp("tree")
    copy_tree(ROOT, copy)
    return copy


def test_apply_and_unapply_on_a_copy(tree: Path) -> None:
    before_checkout = {t: (ROOT / t).read_bytes() for t in SELECTIONS}
    for target in SELECTIONS:
        mutant = next(m for m in CATALOGUE if m.target == target)
        pristine = (tree / target).read_text(encoding="utf-8")
        saved = apply(tree, mutant)
        assert saved == pristine
        planted = (tree / target).read_text(encoding="utf-8")
        assert planted != pristine
        assert planted == pristine.replace(mutant.original, mutant.replacement)
        assert mutant.original not in planted or mutant.original in mutant.replacement
        unapply(tree, mutant, saved)
        assert (tree / target).read_text(encoding="utf-8") == pristine
    # the checkout itself was never written
    assert {t: (ROOT / t).read_bytes() for t in SELECTIONS} == before_checkout


def test_a_stale_mutant_is_refused_and_reported(tree: Path) -> None:
    target = "statemachine/machine.py"
    text = (tree / target).read_text(encoding="utf-8")
    gone = Mutant("X1", target, "this snippet is nowhere", "x", "a stale mutant")
    twice = Mutant("X2", target, "return", "yield", "an ambiguous snippet")
    with pytest.raises(StaleMutant):
        apply(tree, gone)
    with pytest.raises(StaleMutant):
        apply(tree, twice)
    assert (tree / target).read_text(encoding="utf-8") == text  # nothing planted
    problems = check_catalogue([gone, twice, gone], tree)
    assert any("X1: STALE" in p for p in problems)
    assert any("X2: STALE" in p and "times" in p for p in problems)
    assert any("X1: duplicate id" in p for p in problems)
    # a catalogue mutant whose code changed goes stale too
    first = next(m for m in CATALOGUE if m.target == target)
    saved = apply(tree, first)
    try:
        assert any(p.startswith(f"{first.id}: STALE") for p in check_catalogue(CATALOGUE, tree))
    finally:
        unapply(tree, first, saved)


def test_a_mutant_that_breaks_the_syntax_is_a_catalogue_problem(tree: Path) -> None:
    """A snippet taken at another indentation than its line's (its removal leaves the
    line's first spaces before the next line), or a replacement that cuts a string in
    two, makes a module no test can import: every test would fail on the import, a kill
    that checks nothing the mutant does. The catalogue refuses it; the catalogue's own
    mutants all compile."""
    target = "statemachine/journal.py"
    text = (tree / target).read_text(encoding="utf-8")
    rows = text.splitlines(keepends=True)

    def plain(row: str) -> bool:  # a simple statement of its own, at eight spaces
        return (row.startswith("        ") and row[8] not in " #\"'\n" and ":" not in row
                and not row.rstrip().endswith((",", "(", "[", "{", ")", "]", "\\")))

    line = next(row for row, after in itertools.pairwise(rows)
                if plain(row) and plain(after) and text.count(row[4:]) == 1)
    deeper = Mutant("Y1", target, line[4:], "", "a line taken four spaces in")
    cut = Mutant("Y2", target, line, line.rstrip("\n") + ' "\n', "a string cut open")
    problems = check_catalogue([deeper, cut], tree)
    assert [p.split(":")[0] for p in problems if "does not compile" in p] == ["Y1", "Y2"]
    assert not [p for p in check_catalogue(CATALOGUE, tree) if "does not compile" in p]


def test_equivalent_mutants_are_not_run_and_do_not_count() -> None:
    equivalent = next(m for m in CATALOGUE if m.equivalent is not None)
    result = run_mutant(equivalent, root=Path("/nonexistent"))  # no copy is even made
    assert result.outcome is Outcome.EQUIVALENT
    killed = Mutant("K", "statemachine/machine.py", "a", "b", "k")
    survived = Mutant("S", "statemachine/machine.py", "a", "c", "s")
    results = [Result(killed, Outcome.KILLED)] * 9 + [Result(survived, Outcome.SURVIVED),
                                                      result]
    assert score(results) == pytest.approx(0.9)
    assert score([result]) is None


def test_a_structural_test_never_runs_in_a_selection() -> None:
    """The tests that read the source text (`harness.STRUCTURAL`) are left out of every
    selection, even one naming them: only behaviour kills a mutant."""
    for test in (harness.STRUCTURAL[0] + "::test_the_catalogue_describes_the_current_tree",
                 harness.STRUCTURAL[-1]):
        code, _, output = harness.run_selection(harness.ROOT, [test], 120)
        assert code == 5, output  # pytest: no test ran
    code, _, output = harness.run_selection(
        harness.ROOT, ["tests/tools/test_unasync.py::"
                       "test_an_async_only_block_is_left_out_of_the_sync_module"], 120)
    assert code == 0, output  # a behaviour test beside it still runs
    named = {test for selection in SELECTIONS.values() for test in selection}
    assert not {test for test in named if test.startswith(harness.STRUCTURAL)}
