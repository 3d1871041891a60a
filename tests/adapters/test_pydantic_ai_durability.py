"""The pydantic-ai adapter at its effect boundaries (DESIGN §6.7, §7.4), as
tests/storage/test_durability.py checks the reference runner: `LedgerRun` over a SQLite store per
event, buffered, and async (`tests.drivers.pydantic_ai_durability_driver`).

1. Before each effect (the model call, a tool body, a history write) the effect reads the
   durable log through a separate connection and finds the record that allows it: the
   model call begun, the tool's start, the staged batch of exactly the items written.
2. kill -9 between any record and its flush: forked driver processes die with SIGKILL at
   every boundary of a buffered and an async run (the modes alternating) and at every
   fourth of a run that appends per event, and at random ones after, and are restarted
   until the run ends: the paying tool never runs twice, an acknowledged decision is
   never lost, no committed event is lost, and every run completes or fails closed with
   `ToolInDoubt`.
3. The test of the test: a controller that skips the flush before a tool lets the tool
   run before its start is durable; the checks see it, and a kill inside the tool makes
   the restarted run pay again.

Under CI a missing ``pydantic_ai`` package fails this module instead of skipping it.
``CRASH_DIR`` as for tests/runner/test_crash_hooks.py.
"""

from __future__ import annotations

import asyncio
import os
import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest

try:
    import pydantic_ai  # noqa: F401
except ImportError:  # pragma: no cover - CI installs the extra
    if os.environ.get("CI"):
        raise
    pytest.skip("pydantic-ai is not installed (pip install -e '.[pydantic-ai]')",
                allow_module_level=True)

from statemachine import events as ev
from statemachine.machine import replay
from statemachine.sessions import SQLiteSession
from statemachine.testing import check_log
from statemachine.values import Phase
from tests.drivers import durability_driver as seen
from tests.drivers import pydantic_ai_durability_driver as driver
from tests.helpers import crash_folder

MAX_KILLS = 4
SEED = int(os.environ.get("DURABILITY_SEED", "0"))
PER_EVENT_EVERY = 4
"""Of a run that appends per event, every fourth boundary is a first kill (a kill there
falls after an append, as at the boundary before it)."""


@pytest.fixture(scope="module")
def kill_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with crash_folder(tmp_path_factory, "pa-durability") as root:
        yield root


@attrs.frozen
class Reference:
    ticks: tuple[str, ...]
    effects: Counter[str]
    session: list[object]


@pytest.fixture(scope="module")
def references(kill_root: Path) -> dict[str, Reference]:
    found = {}
    for mode in driver.MODES:
        folder = kill_root / f"reference-{mode}"
        folder.mkdir()
        result = driver.fork(folder, mode, None)
        assert result is not None
        assert result["outcome"] == "completed", result
        assert result["output"] == "done: charged 7"
        assert seen.effects(folder) == Counter({"model": 2, "tool pay": 1,
                                                "tool lookup": 1})
        assert seen.violations(folder) == []
        check_log(seen.log(folder, driver.RUN_ID))
        found[mode] = Reference(tuple(result["ticks"]), seen.effects(folder),
                                _session(folder))
    return found


def _session(folder: Path) -> list[object]:
    """The history as the model is sent it: each message's kind and its parts' kinds,
    text, tools, arguments and call ids (not the timestamps, ids and usage that differ
    from run to run, nor what a message rebuilt from the ledger lacks: the model's name
    and usage)."""
    shown = ("part_kind", "content", "tool_name", "args", "tool_call_id", "outcome")
    history = SQLiteSession(driver.SESSION_ID, folder / "session.db")
    try:
        items = asyncio.run(history.get_items())
    finally:
        history.close()
    return [(item["kind"], [{key: part.get(key) for key in shown}
                            for part in item["parts"]]) for item in items]


@pytest.mark.parametrize("mode", driver.MODES)
def test_each_effect_finds_the_durable_record_that_allows_it(
        references: dict[str, Reference], mode: str) -> None:
    reference = references[mode]
    kinds = {tick.split(" ")[0] for tick in reference.ticks}
    assert kinds == {"record", "flush-before", "flush-after", "effect", "session-before",
                     "session-after", "acked"}, kinds
    assert reference.session == references["per-event"].session  # one history, any mode
    appends = sum(tick.startswith("flush-before") for tick in reference.ticks)
    records = sum(tick.startswith("record") for tick in reference.ticks)
    if mode == "per-event":
        assert appends == records + 1  # each event its own append (RunStarted unticked)
    else:  # one transaction per effect boundary: the same ones, buffered or async
        per_event = sum(tick.startswith("flush-before")
                        for tick in references["per-event"].ticks)
        assert appends < per_event * 2 / 3
        assert reference.ticks == references["buffered" if mode == "async"
                                             else "async"].ticks


@attrs.frozen
class KillTrial:
    mode: str
    first_kill: str
    kills: int
    outcome: str


def _kill_trial(folder: Path, mode: str, first: int, reference: Reference) -> KillTrial:
    folder.mkdir()
    total = len(reference.ticks)
    rng = random.Random(f"{SEED}:{mode}:{first}")
    first_kill = f"{first} {reference.ticks[first - 1]}"
    where = f"{mode}, first kill at tick {first_kill}"
    kill_at: int | None = first
    kills = 0
    committed: list[ev.Event] = []
    result = None
    while result is None:
        result = driver.fork(folder, mode, kill_at)
        events = seen.log(folder, driver.RUN_ID)
        assert events[: len(committed)] == committed, (where, kills)  # none lost
        committed = events
        approved = {e.call_id for e in events if isinstance(e, ev.CallApproved)}
        assert seen.acked(folder) <= approved, (where, kills)  # no acknowledged one lost
        if result is None:
            kills += 1
            kill_at = (rng.randint(1, total) if kills < MAX_KILLS and rng.random() < 0.5
                       else None)
    assert kills >= 1, f"{where}: the first process was not killed"
    assert seen.violations(folder) == [], where
    effects = seen.effects(folder)
    assert effects["tool pay"] <= 1, (where, effects)  # the paying tool never runs twice
    check_log(committed)
    if result["outcome"] == "completed":
        assert result["output"] == "done: charged 7", where
        assert effects["tool pay"] == 1, where
        assert _session(folder) == reference.session, where
    else:  # fails closed, naming the paying tool
        assert (result["outcome"], result.get("call_id")) == ("in_doubt", "pay"), (where,
                                                                                  result)
        assert replay(driver.RUN_ID, committed).calls["pay"].phase is Phase.STARTED, where
    for name, count in effects.items():
        assert name in reference.effects, (where, name)
        assert count <= reference.effects[name] + kills, (where, name, count)
    again = driver.fork(folder, mode, None)  # one more restart agrees, and runs nothing
    assert again is not None
    assert again["outcome"] == result["outcome"], where
    assert seen.effects(folder) == effects, where
    return KillTrial(mode, first_kill, kills, result["outcome"])


def test_kill_9_between_any_record_and_its_flush(references: dict[str, Reference],
                                                 kill_root: Path) -> None:
    buffered = len(references["buffered"].ticks)
    plan = [("buffered" if index % 2 == 0 else "async", index + 1)
            for index in range(buffered)]  # every boundary, the two modes alternating
    plan += [("per-event", first)
             for first in range(1, len(references["per-event"].ticks) + 1, PER_EVENT_EVERY)]
    trials = [_kill_trial(kill_root / f"trial-{mode}-{first}", mode, first,
                          references[mode]) for mode, first in plan]
    outcomes = Counter(trial.outcome for trial in trials)
    assert outcomes["completed"] > 0
    assert outcomes["in_doubt"] > 0  # a kill inside pay
    assert set(outcomes) <= {"completed", "in_doubt"}
    hit = {trial.first_kill.split(" ", 1)[1] for trial in trials
           if trial.mode != "per-event"}
    assert hit == set(references["buffered"].ticks)  # every boundary was a first kill


def test_the_kill_test_catches_an_adapter_that_skips_the_flush_before_a_tool(
        kill_root: Path) -> None:
    reference = kill_root / "broken-reference"
    reference.mkdir()
    result = driver.fork(reference, "buffered", None, broken=True)
    assert result is not None
    assert result["outcome"] == "completed"
    assert [line.split(" ran ")[0] for line in seen.violations(reference)] == [
        "tool lookup", "tool pay"]
    inside = result["ticks"].index("effect tool pay") + 1
    folder = kill_root / "broken"
    folder.mkdir()
    assert driver.fork(folder, "buffered", inside, broken=True) is None
    again = driver.fork(folder, "buffered", None, broken=True)
    assert again is not None
    assert again["outcome"] == "completed"
    assert seen.effects(folder)["tool pay"] == 2  # what the adapter never does
