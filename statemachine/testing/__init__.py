"""The test kit: fakes for the seed scenarios (`ScriptedModel`, `FlakySession`,
`FakeRemote`, counters), the log checker (`check_log`), explorable worlds (`ScriptWorld`
checks every step against an `Oracle` computed from its `Script`, and that the run can
finish), the corner generators (`handoff_cases`, each case played by `play_handoff`
against what the case says), the exhaustive explorer and the Hypothesis kit
(`random_run` and `RandomRun`: random reachable runs), and the contract suites every
store and Session backend runs (`statemachine.testing.contracts`).
Install with the ``testing`` extra."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from statemachine.testing.adapter_corners import (
    PLAIN_TEXT,
    STRUCTURED_TEXT,
    Boundary,
    CallKind,
    FaultSeen,
    OneWriterCase,
    OneWriterSeen,
    OutputCase,
    OutputSeen,
    OutputShape,
    RecordedFault,
    RecordedFaultCase,
    ReplyCase,
    ReplySeen,
    RivalPoint,
    StaleMove,
    StaleSeen,
    StaleStateCase,
    Structured,
    boundary_of,
    check_one_writer,
    check_output,
    check_recorded_fault,
    check_reply,
    check_stale_state,
    every_one_writer_case,
    every_output_case,
    every_recorded_fault_case,
    every_reply_case,
    every_stale_state_case,
    reply_cases,
)
from statemachine.testing.corners import (
    CALL_PHASES,
    CaseFailed,
    HandoffCase,
    handoff_cases,
    play_handoff,
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
    "PLAIN_TEXT",
    "SCRIPT_FAULTS",
    "STRUCTURED_TEXT",
    "TOOL_KINDS",
    "Boundary",
    "CallKind",
    "CaseFailed",
    "Counters",
    "CountingHooks",
    "ExploreReport",
    "FakeRemote",
    "FaultSeen",
    "FlakySession",
    "HandoffCase",
    "InjectedWriteError",
    "InvariantViolation",
    "ListSession",
    "ListingFailed",
    "OneWriterCase",
    "OneWriterSeen",
    "Oracle",
    "Outcome",
    "OutputCase",
    "OutputSeen",
    "OutputShape",
    "PermanentPostError",
    "PostOutcome",
    "RandomRun",
    "RecordedFault",
    "RecordedFaultCase",
    "ReferenceWorld",
    "RemoteWorld",
    "ReplyCase",
    "ReplySeen",
    "RivalPoint",
    "Script",
    "ScriptWorld",
    "ScriptedModel",
    "SimulatedCrash",
    "StaleMove",
    "StaleSeen",
    "StaleStateCase",
    "StreamDisconnected",
    "Structured",
    "Turn",
    "Untouchable",
    "World",
    "boundary_of",
    "check_log",
    "check_one_writer",
    "check_output",
    "check_recorded_fault",
    "check_reply",
    "check_stale_state",
    "counted_tool",
    "every_one_writer_case",
    "every_output_case",
    "every_recorded_fault_case",
    "every_reply_case",
    "every_stale_state_case",
    "explore",
    "handoff_cases",
    "play_handoff",
    "random_run",
    "reply_cases",
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
