"""The test kit: fakes for the seed scenarios (`ScriptedModel`, `FlakySession`,
`FakeRemote`, counters), the log checker (`check_log`), explorable worlds (`ScriptWorld`
checks every step against an `Oracle` computed from its `Script`, and that the run can
finish), the corner generators (`handoff_cases`, `input_cases`, `tail_cases`,
`frontier_cases`, `session_id_cases`, each case played by its ``play_*`` against what the
case says), the exhaustive explorer and the Hypothesis kit
(`random_run` and `RandomRun`: random reachable runs), and the contract suites every
store and Session backend runs (`statemachine.testing.contracts`).
Install with the ``testing`` extra."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from statemachine.testing.corners import (
    CALL_PHASES,
    FRONTIER_TOKENS,
    INPUT_RESTS,
    INPUT_SOURCES,
    RUNNER_SKIPS,
    SESSION_ID_DOORS,
    TAIL_TOKENS,
    CaseFailed,
    FrontierCase,
    HandoffCase,
    InputCase,
    SessionIdCase,
    TailCase,
    calls_without_output,
    frontier_cases,
    handoff_cases,
    input_cases,
    play_frontier,
    play_handoff,
    play_input,
    play_runner_skip,
    play_session_id,
    play_tail,
    read_limit_by_definition,
    session_id_cases,
    tail_cases,
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
    "FRONTIER_TOKENS",
    "INPUT_RESTS",
    "INPUT_SOURCES",
    "RUNNER_SKIPS",
    "SCRIPT_FAULTS",
    "SESSION_ID_DOORS",
    "TAIL_TOKENS",
    "TOOL_KINDS",
    "CaseFailed",
    "Counters",
    "CountingHooks",
    "ExploreReport",
    "FakeRemote",
    "FlakySession",
    "FrontierCase",
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
    "SessionIdCase",
    "SimulatedCrash",
    "StreamDisconnected",
    "TailCase",
    "Turn",
    "Untouchable",
    "World",
    "calls_without_output",
    "check_log",
    "counted_tool",
    "explore",
    "frontier_cases",
    "handoff_cases",
    "input_cases",
    "play_frontier",
    "play_handoff",
    "play_input",
    "play_runner_skip",
    "play_session_id",
    "play_tail",
    "random_run",
    "read_limit_by_definition",
    "session_id_cases",
    "settled",
    "tail_cases",
    "world_state_machine",
]


def __getattr__(name: str) -> Any:
    # the random runs are drawn by Hypothesis: imported when first asked for, so the rest
    # of the kit (the CLI's demo and explorer use it) works without Hypothesis installed
    if name in ("RandomRun", "random_run"):
        from statemachine.testing import random_runs

        return getattr(random_runs, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
