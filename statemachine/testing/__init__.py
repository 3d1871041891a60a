"""The test kit: fakes for the seed scenarios (`ScriptedModel`, `FlakySession`,
`FakeRemote`, counters), the log checker (`check_log`), explorable worlds (`ScriptWorld`
checks every step against an `Oracle` computed from its `Script`, and that the run can
finish), the exhaustive
explorer and the Hypothesis kit, and the contract suites every store and Session backend
runs (`statemachine.testing.contracts`). Install with the ``testing`` extra."""

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

__all__ = [
    "FAULTS",
    "SCRIPT_FAULTS",
    "TOOL_KINDS",
    "Counters",
    "CountingHooks",
    "ExploreReport",
    "FakeRemote",
    "FlakySession",
    "InjectedWriteError",
    "InvariantViolation",
    "ListSession",
    "ListingFailed",
    "Oracle",
    "Outcome",
    "PermanentPostError",
    "PostOutcome",
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
    "settled",
    "world_state_machine",
]
