"""The test kit: fakes for the seed scenarios (`ScriptedModel`, `FlakySession`,
`FakeRemote`, counters), the log checker (`check_log`), explorable worlds (`ScriptWorld`
checks every step against an `Oracle` computed from its `Script`, and that the run can
finish), the corner generators (`handoff_cases`, `input_cases`, each case played by its
``play_*`` against what the case says), the exhaustive explorer and the Hypothesis kit
(`random_run` and `RandomRun`: random reachable runs), and the contract suites every
store and Session backend runs (`statemachine.testing.contracts`).
Install with the ``testing`` extra."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from statemachine.testing.corners import (
    CALL_PHASES,
    INPUT_RESTS,
    INPUT_SOURCES,
    CaseFailed,
    HandoffCase,
    InputCase,
    handoff_cases,
    input_cases,
    play_handoff,
    play_input,
)
from statemachine.testing.explore import ExploreReport, explore, world_state_machine
from statemachine.testing.fakes import (
    Counters,
    CountingHooks,
    FakeRemote,
    FlakySession,
    InjectedWriteError,
    ListingFailed,
    ListSession,
    Outcome,
    PermanentPostError,
    PostOutcome,
    ScriptedModel,
    StreamDisconnected,
    Untouchable,
    counted_tool,
)
from statemachine.testing.invariants import InvariantViolation, check_log, settled
from statemachine.testing.worlds import (
    FAULTS,
    SCRIPT_FAULTS,
    TOOL_KINDS,
    Oracle,
    ReferenceWorld,
    RemoteWorld,
    Script,
    ScriptWorld,
    SimulatedCrash,
    Turn,
    World,
)

if TYPE_CHECKING:
    from statemachine.testing.random_runs import RandomRun, random_run

__all__ = [
    "CALL_PHASES",
    "FAULTS",
    "INPUT_RESTS",
    "INPUT_SOURCES",
    "SCRIPT_FAULTS",
    "TOOL_KINDS",
    "CaseFailed",
    "Counters",
    "CountingHooks",
    "ExploreReport",
    "FakeRemote",
    "FlakySession",
    "HandoffCase",
    "InjectedWriteError",
    "InputCase",
    "InvariantViolation",
    "ListSession",
    "ListingFailed",
    "Oracle",
    "Outcome",
    "PermanentPostError",
    "PostOutcome",
    "RandomRun",
    "ReferenceWorld",
    "RemoteWorld",
    "Script",
    "ScriptWorld",
    "ScriptedModel",
    "SimulatedCrash",
    "StreamDisconnected",
    "Turn",
    "Untouchable",
    "World",
    "check_log",
    "counted_tool",
    "explore",
    "handoff_cases",
    "input_cases",
    "play_handoff",
    "play_input",
    "random_run",
    "settled",
    "world_state_machine",
]


def __getattr__(name: str) -> Any:
    # the random runs are drawn by Hypothesis: imported when first asked for, so the rest
    # of the kit (the CLI's demo and explorer use it) works without Hypothesis installed
    if name in ("RandomRun", "random_run"):
        from statemachine.testing import random_runs

        return getattr(random_runs, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
