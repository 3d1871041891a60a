"""The test kit: fakes for the seed scenarios (`ScriptedModel`, `FlakySession`,
`FakeRemote`, counters), the log checker (`check_log`), explorable worlds, the exhaustive
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
    ReferenceWorld,
    RemoteWorld,
    SimulatedCrash,
    World,
)

__all__ = [
    "FAULTS",
    "Counters",
    "CountingHooks",
    "ExploreReport",
    "FakeRemote",
    "FlakySession",
    "InjectedWriteError",
    "InvariantViolation",
    "ListingFailed",
    "Outcome",
    "PermanentPostError",
    "PostOutcome",
    "ReferenceWorld",
    "RemoteWorld",
    "ScriptedModel",
    "SimulatedCrash",
    "StreamDisconnected",
    "Untouchable",
    "World",
    "check_log",
    "counted_tool",
    "explore",
    "settled",
    "world_state_machine",
]
