"""The Anthropic adapter at its effect boundaries (DESIGN §6.7, §7.4), as
tests/storage/test_durability.py checks the reference runner: a messages loop through
`MessageToolLedger` (per event and buffered) and a managed session through
`LedgerSessionToolRunner` (per event, buffered, and on the async SQLite store), the
messages loop also with its conversation kept in a history (``history``: a `SQLiteSession`
on the store's file, written with the run's end), each with a
paying tool (``pay``) and an idempotent one (``lookup``), run by forked driver processes
(tests/drivers/anthropic_durability_driver.py).

1. Before each effect (a tool body, a model request, a result post) the effect reads the
   durable log through a separate connection and finds the record that allows it: the
   call's start for a tool, the exact result for a request or a post that carries it.
2. kill -9 at every boundary (each record, each store append, each effect, each post),
   the first kill of each trial at one boundary in turn, then restarts (some killed at
   random boundaries) until the run ends: ``pay`` never runs twice, no committed event is
   lost, each result lands at most once, and the run completes (with the reference
   answer) or fails closed with ``pay`` in doubt; one more restart agrees and runs nothing.
   With a history, it holds the whole conversation once the run completed, none of it
   before.
3. The test of the test: a ledger whose flush before a tool body does nothing is caught
   by the tools' own checks, and a kill inside ``pay`` then makes the restart pay again.

``ANTHROPIC_DURABILITY_SEED`` seeds the random restarts; ``CRASH_DIR`` as for
tests/runner/test_crash_hooks.py. Run with ``-s`` for the figures.
"""

from __future__ import annotations

import json
import os
import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

try:
    import anthropic  # noqa: F401
except ImportError:  # pragma: no cover - CI installs the extra
    from tests.helpers import missing_extra

    missing_extra("anthropic")

from statemachine import events as ev
from statemachine.machine import replay
from statemachine.testing import check_log
from statemachine.values import Phase
from tests.drivers import anthropic_durability_driver as driver
from tests.helpers import crash_folder

SEED = int(os.environ.get("ANTHROPIC_DURABILITY_SEED", "0"))
MAX_KILLS = 3
CONVERSATION = [
    {"role": "user", "content": "pay 7"},
    {"role": "assistant", "content": [
        {"type": "tool_use", "id": "tu_pay", "name": "pay", "input": {"amount": 7}},
        {"type": "tool_use", "id": "tu_lookup", "name": "lookup", "input": {"q": "rate"}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "tu_pay", "content": "charged 7"},
        {"type": "tool_result", "tool_use_id": "tu_lookup", "content": "rate is 1.0"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "paid: charged 7"}]}]
"""What the ``history`` run's Session holds once it completed: the script's turns."""
CASES = [(scenario, mode) for scenario, modes in driver.MODES.items() for mode in modes]
IDS = [f"{scenario}-{mode}" for scenario, mode in CASES]


@pytest.fixture(scope="module")
def kill_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with crash_folder(tmp_path_factory, "anthropic-durability") as root:
        (root / "warm").mkdir()
        driver.warm(root / "warm")
        yield root


def _reference(folder: Path, scenario: str, mode: str) -> dict[str, Any]:
    folder.mkdir()
    result = driver.fork(folder, scenario, mode, None)
    assert result is not None
    assert result["outcome"] == "completed", result
    return result


@pytest.mark.parametrize(("scenario", "mode"), CASES, ids=IDS)
def test_an_effect_never_precedes_the_durable_record_that_allows_it(
        kill_root: Path, scenario: str, mode: str) -> None:
    folder = kill_root / f"reference-{scenario}-{mode}"
    result = _reference(folder, scenario, mode)
    assert driver.violations(folder) == []
    effects = Counter(driver.effects(folder))
    expected = {"tool pay": 1, "tool lookup": 1}
    if scenario == "messages":
        expected["model request"] = 2
    assert effects == Counter(expected)
    log = driver.log(folder)
    check_log(log)
    kinds = {tick.split(" ")[0] for tick in result["ticks"]}
    assert {"record", "flush-before", "flush-after", "effect"} <= kinds, kinds
    if scenario == "session":
        assert driver.posted(folder) == {"tu_pay": [[{"type": "text", "text": "charged 7"}]],
                                         "tu_lookup": [[{"type": "text",
                                                         "text": "rate is 1.0"}]]}
    else:
        assert result["final"] == "paid: charged 7"
    if mode == "history":  # the conversation, written with the end
        assert driver.history(folder) == CONVERSATION
    appends = sum(tick.startswith("flush-after") for tick in result["ticks"])
    if mode == "per-event":
        assert appends == len(log)
    else:  # one transaction per effect boundary, not per event
        assert appends < len(log)
    again = driver.fork(folder, scenario, mode, None)  # a user running it again
    assert again is not None
    assert (again["outcome"], again["replayed"]) == ("completed", True)
    assert Counter(driver.effects(folder)) == effects
    assert driver.log(folder) == log
    if mode == "history":
        assert driver.history(folder) == CONVERSATION  # written once


def _trial(folder: Path, scenario: str, mode: str, first: int, total: int,
           reference: dict[str, Any]) -> str:
    folder.mkdir()
    rng = random.Random(f"{SEED}:{scenario}:{mode}:{first}")
    where = f"{scenario} {mode}, first kill at tick {first} {reference['ticks'][first - 1]}"
    kill_at: int | None = first
    kills = 0
    committed: list[ev.Event] = []
    result: dict[str, Any] | None = None
    while result is None:
        result = driver.fork(folder, scenario, mode, kill_at)
        events = driver.log(folder)
        assert events[: len(committed)] == committed, (where, kills)  # nothing lost
        committed = events
        if result is None:
            kills += 1
            kill_at = (rng.randint(1, total) if kills < MAX_KILLS and rng.random() < 0.5
                       else None)
    assert kills >= 1, f"{where}: the first process was not killed"
    assert driver.violations(folder) == [], where
    effects = Counter(driver.effects(folder))
    assert effects["tool pay"] <= 1, (where, effects)  # the paying tool never runs twice
    assert effects["tool lookup"] <= 1 + kills, (where, effects)
    check_log(committed)
    if scenario == "session":
        landed = driver.posted(folder)
        assert all(len(results) == 1 for results in landed.values()), (where, landed)
    if mode == "history":  # the whole conversation with the end, or none of it
        assert driver.history(folder) == (
            CONVERSATION if result["outcome"] == "completed" else []), where
    if result["outcome"] == "completed":
        assert effects["tool pay"] == 1, where
        if scenario == "messages":
            assert result["final"] == reference["final"], where
        else:
            assert driver.posted(folder) == driver.posted(folder.parent / (
                f"reference-{scenario}-{mode}")), where
    else:  # fails closed, naming the paying tool
        assert (result["outcome"], result.get("call_id")) == ("in_doubt", "tu_pay"), (
            where, result)
        assert replay(driver.RUN_ID, committed).calls["tu_pay"].phase is Phase.STARTED
    again = driver.fork(folder, scenario, mode, None)  # one more restart agrees
    assert again is not None
    assert again["outcome"] == result["outcome"], where
    assert Counter(driver.effects(folder)) == effects, where
    return str(result["outcome"])


@pytest.mark.parametrize(("scenario", "mode"), CASES, ids=IDS)
def test_kill_9_at_every_boundary_then_restart(kill_root: Path, scenario: str,
                                               mode: str) -> None:
    reference_folder = kill_root / f"reference-{scenario}-{mode}"
    reference = (_reference(reference_folder, scenario, mode)
                 if not reference_folder.exists() else
                 driver.fork(reference_folder, scenario, mode, None))
    assert reference is not None
    if reference_folder.exists() and reference.get("replayed"):
        # the reference folder was made by the test above: count its ticks afresh
        fresh = kill_root / f"ticks-{scenario}-{mode}"
        reference = _reference(fresh, scenario, mode)
    total = len(reference["ticks"])
    outcomes = Counter(
        _trial(kill_root / f"trial-{scenario}-{mode}-{first}", scenario, mode, first, total,
               reference)
        for first in range(1, total + 1))
    assert outcomes["completed"] > 0
    assert outcomes["in_doubt"] > 0
    assert set(outcomes) <= {"completed", "in_doubt"}
    print(f"\n{scenario} ({mode}): {total} boundaries, outcomes "
          f"{json.dumps(dict(outcomes))}")


@pytest.mark.parametrize("scenario", sorted(driver.MODES))
def test_the_boundary_test_catches_a_ledger_that_skips_the_flush_before_a_tool(
        kill_root: Path, scenario: str) -> None:
    """The test of the test: with the flush before a tool body doing nothing, each tool
    notes that it ran before its start was durable; a kill inside ``pay`` then leaves no
    durable start, and the restarted run pays again."""
    folder = kill_root / f"broken-reference-{scenario}"
    folder.mkdir()
    result = driver.fork(folder, scenario, "buffered", None, broken=True)
    assert result is not None
    noted = [line.split(" ran ")[0] for line in driver.violations(folder)]
    # (a request or a post flushes the results it carries first: those are durable)
    assert noted == ["tool tu_pay", "tool tu_lookup"]
    inside = result["ticks"].index("effect tool pay") + 1
    folder = kill_root / f"broken-{scenario}"
    folder.mkdir()
    assert driver.fork(folder, scenario, "buffered", inside, broken=True) is None
    again = driver.fork(folder, scenario, "buffered", None, broken=True)
    assert again is not None
    assert again["outcome"] == "completed"
    assert Counter(driver.effects(folder))["tool pay"] == 2  # what the adapter never does
