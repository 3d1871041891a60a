"""Durability at effect boundaries through the openai-agents adapter (DESIGN §6.7; issue
23), as tests/storage/test_durability.py shows it for the reference runner, per event
and buffered:

1. "An effect never precedes the durable record that allows it": the tools, the model
   and every Session write of the run (`tests.drivers.openai_agents_durability_driver`:
   approval, two tools with guardrails, a final answer with an output guardrail) read the
   *durable* log (a read-only store on the same file, as another process would after a
   crash of this one) when called, and each finds the record that allows it.
2. kill -9 between any record and its flush: forked driver processes die with SIGKILL at
   every boundary of the run (an event recorded, a store append before and after, an
   effect, a Session write before and after, a decision acknowledged) and are restarted
   (killed again at random ones) until the run ends: the paying tool never runs twice, an
   acknowledged decision is never lost, no committed event is lost, and every run
   completes or fails closed with `ToolInDoubt`. ``OA_DURABILITY_STRIDE`` (default 1:
   every boundary of each mode) thins the first kills; ``DURABILITY_SEED`` chooses the
   later ones; run with ``-s`` for the figures.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest

try:
    import agents  # noqa: F401
except ImportError:  # pragma: no cover - CI installs the extra
    from tests.helpers import missing_extra

    missing_extra("openai-agents")

from statemachine import events as ev
from statemachine.machine import replay
from statemachine.testing import check_log
from statemachine.values import Phase
from tests.drivers import durability_driver as base
from tests.drivers import openai_agents_durability_driver as driver
from tests.helpers import crash_folder

STRIDE = int(os.environ.get("OA_DURABILITY_STRIDE", "1"))
SEED = int(os.environ.get("DURABILITY_SEED", "0"))
MAX_KILLS = 4
KINDS = {"record", "flush-before", "flush-after", "effect", "session-before", "session-after",
         "acked"}


@pytest.fixture(scope="module")
def kill_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with crash_folder(tmp_path_factory, "oa-durability") as root:
        yield root


@attrs.frozen
class Reference:
    ticks: tuple[str, ...]
    effects: Counter[str]
    session: list[Any]


def _session(folder: Path) -> list[Any]:
    import asyncio

    from agents import SQLiteSession

    session = SQLiteSession(driver.SESSION_ID, folder / "session.db")
    try:
        return list(asyncio.run(session.get_items()))
    finally:
        session.close()


@pytest.fixture(scope="module")
def references(kill_root: Path) -> dict[str, Reference]:
    found = {}
    for mode in driver.MODES:
        folder = kill_root / f"reference-{mode}"
        folder.mkdir()
        result = driver.fork(folder, mode, None)
        assert result is not None
        assert result["outcome"] == "completed", result
        found[mode] = Reference(tuple(result["ticks"]), base.effects(folder), _session(folder))
    return found


@pytest.mark.parametrize("mode", driver.MODES)
def test_an_effect_never_precedes_the_durable_record_that_allows_it(
        references: dict[str, Reference], kill_root: Path, mode: str) -> None:
    reference = references[mode]
    folder = kill_root / f"reference-{mode}"
    assert base.violations(folder) == []
    # every effect ran once, each checked against the durable log first (tools, model
    # calls, Session writes)
    assert set(reference.effects.values()) == {1}, reference.effects
    assert {"tool pay", "tool lookup", "model calls", "model answer"} <= set(reference.effects)
    writes = sum(tick == "session-before write" for tick in reference.ticks)
    assert writes >= 3  # the input, the calls paused for approval, the results, the answer
    assert {tick.split(" ")[0] for tick in reference.ticks} == KINDS
    outputs = [i["call_id"] for i in reference.session if i.get("type") == "function_call_output"]
    assert sorted(outputs) == ["lookup", "pay"]
    calls = [i["call_id"] for i in reference.session if i.get("type") == "function_call"]
    assert sorted(calls) == ["lookup", "pay"]  # each written once
    check_log(base.log(folder, driver.RUN_ID))


@attrs.frozen
class KillTrial:
    mode: str
    first_kill: str
    kills: int
    outcome: str
    effects: Counter[str]


def _kill_trial(folder: Path, mode: str, first: int, references: dict[str, Reference]
                ) -> KillTrial:
    folder.mkdir()
    reference = references[mode]
    total = len(reference.ticks)
    rng = random.Random(f"{SEED}:{mode}:{first}")
    first_kill = f"{first} {reference.ticks[first - 1]}"
    where = f"{mode}, first kill at tick {first_kill}"
    kill_at: int | None = first
    kills = 0
    committed: list[ev.Event] = []
    result: dict[str, Any] | None = None
    while result is None:
        result = driver.fork(folder, mode, kill_at)
        events = base.log(folder, driver.RUN_ID) if (folder / "events.db").exists() else []
        # no committed event lost: every process's log starts with the one before it
        assert events[: len(committed)] == committed, (where, kills)
        committed = events
        # no acknowledged decision lost: the log holds every approval acknowledged
        assert base.acked(folder) <= base.approved(events), (where, kills)
        if result is None:
            kills += 1
            kill_at = (rng.randint(1, total) if kills < MAX_KILLS and rng.random() < 0.5
                       else None)
    assert kills >= 1, f"{where}: the first process was not killed"
    assert base.violations(folder) == [], where
    effects = base.effects(folder)
    assert effects["tool pay"] <= 1, (where, effects)  # the paying tool never runs twice
    check_log(committed)
    if result["outcome"] == "completed":
        assert effects["tool pay"] == 1, where
        assert set(effects) == set(reference.effects), where
        assert _session(folder) == reference.session, where
    else:  # fails closed, naming the paying tool
        assert (result["outcome"], result.get("call_id")) == ("in_doubt", "pay"), (where,
                                                                                  result)
        assert replay(driver.RUN_ID, committed).calls["pay"].phase is Phase.STARTED, where
    for name, count in effects.items():
        assert name in reference.effects, (where, name)
        assert count <= 1 + kills, (where, name, count)
    again = driver.fork(folder, mode, None)  # one more restart agrees, and runs nothing
    assert again is not None
    assert again["outcome"] == result["outcome"], (where, again)
    assert base.effects(folder) == effects, where
    return KillTrial(mode, first_kill, kills, result["outcome"], effects)


def test_kill_9_between_any_record_and_its_flush(references: dict[str, Reference],
                                                 kill_root: Path) -> None:
    started = time.monotonic()
    trials = [_kill_trial(kill_root / f"trial-{mode}-{first}", mode, first, references)
              for mode, reference in references.items()
              for first in range(1, len(reference.ticks) + 1, STRIDE)]
    outcomes = Counter(t.outcome for t in trials)
    assert outcomes["completed"] > 0
    assert outcomes["in_doubt"] > 0  # a kill inside the paying tool
    assert set(outcomes) <= {"completed", "in_doubt"}
    if STRIDE == 1:  # every boundary of each mode was hit by a first kill
        for mode, reference in references.items():
            hit = {t.first_kill.split(" ", 1)[1] for t in trials if t.mode == mode}
            assert hit == set(reference.ticks), mode
    figures = {
        "trials": len(trials),
        "boundaries": {mode: len(r.ticks) for mode, r in references.items()},
        "kills": sum(t.kills for t in trials),
        "first_kill_by_boundary_kind": dict(Counter(
            t.first_kill.split(" ")[1] for t in trials).most_common()),
        "tool_duplicates": sum(t.effects["tool pay"] > 1 for t in trials),
        "model_call_reruns": sum(n - 1 for t in trials for name, n in t.effects.items()
                                 if name.startswith("model ")),
        "completed": outcomes["completed"],
        "tool_in_doubt": outcomes["in_doubt"],
        "seconds": round(time.monotonic() - started, 1),
    }
    print("\nopenai-agents adapter, kill -9 between record and flush:",
          json.dumps(figures, indent=1))


def test_the_kill_test_catches_an_adapter_that_skips_the_flush_before_a_tool(
        kill_root: Path) -> None:
    """The test of the test: a buffered controller whose flush before a tool does nothing
    lets the paying tool run before its start is durable. The tool's own check notes it;
    a kill inside the tool makes the restarted run pay again."""
    reference = kill_root / "broken-reference"
    reference.mkdir()
    result = driver.fork(reference, "buffered", None, broken=True)
    assert result is not None
    assert result["outcome"] == "completed"
    assert sorted(line.split(" ran ")[0] for line in base.violations(reference)) == [
        "tool lookup", "tool pay"]
    inside = result["ticks"].index("effect tool pay") + 1
    folder = kill_root / "broken"
    folder.mkdir()
    assert driver.fork(folder, "buffered", inside, broken=True) is None
    again = driver.fork(folder, "buffered", None, broken=True)
    assert again is not None
    assert again["outcome"] == "completed"
    assert base.effects(folder)["tool pay"] == 2  # what the adapter never does
