"""Mutation testing of the core and the runner: a catalogue of plausible bugs
(`mutate.catalogue`), each planted alone in a fresh copy of the tree and run against the
tests mapped to its module (`mutate.harness`). ``python -m mutate`` prints the score.

Nothing here touches the checkout it reads: every mutant runs in a temporary copy."""

from mutate.catalogue import CATALOGUE, SELECTIONS, Mutant
from mutate.harness import (
    Outcome,
    Result,
    StaleMutant,
    apply,
    check_catalogue,
    module_of,
    run_mutant,
    score,
    unapply,
)

__all__ = [
    "CATALOGUE",
    "SELECTIONS",
    "Mutant",
    "Outcome",
    "Result",
    "StaleMutant",
    "apply",
    "check_catalogue",
    "module_of",
    "run_mutant",
    "score",
    "unapply",
]
