"""agent-statemachine: the control core for AI-agent runners.

An event-sourced, guarded run-step machine (declared in `statemachine.machine`) that
refuses everything unsafe: a tool never runs twice, an approval never takes effect on top
of an unsettled write, and a run that cannot safely resume says so before doing anything.
Embed `RunController` in your runner.
"""

from statemachine.blocker import Blocker, BlockerKind, Waiting
from statemachine.controller import RunController
from statemachine.envelope import Envelope
from statemachine.errors import (
    ConcurrencyConflict,
    ConfigurationError,
    ControlError,
    InvalidTransition,
    LeaseHeld,
    Outcome,
    PublicationUnsettled,
    ReconcileRejected,
    RunNotFound,
    RunNotResumable,
    SchemaError,
    StorageError,
    ToolInDoubt,
)
from statemachine.payloads import register_canonical
from statemachine.sessions import MemorySession, Session, SQLiteSession
from statemachine.stores import (
    EventStore,
    MemoryEventStore,
    SessionWrite,
    SnapshotIgnored,
    SQLiteEventStore,
)
from statemachine.structured_logging import disable_logging, enable_logging
from statemachine.telemetry import disable_telemetry, enable_telemetry
from statemachine.values import (
    Acknowledge,
    Action,
    Append,
    CallView,
    Decision,
    Execute,
    GuardrailResult,
    Phase,
    RecoveryPolicy,
    Resend,
    Resolution,
    Step,
    ToolCall,
)
from statemachine.verifiers import Completed, NotExecuted, ToolContext, Unknown, tool_context

__all__ = [
    "Acknowledge",
    "Action",
    "Append",
    "Blocker",
    "BlockerKind",
    "CallView",
    "Completed",
    "ConcurrencyConflict",
    "ConfigurationError",
    "ControlError",
    "Decision",
    "Envelope",
    "EventStore",
    "Execute",
    "GuardrailResult",
    "InvalidTransition",
    "LeaseHeld",
    "MemoryEventStore",
    "MemorySession",
    "NotExecuted",
    "Outcome",
    "Phase",
    "PublicationUnsettled",
    "ReconcileRejected",
    "RecoveryPolicy",
    "Resend",
    "Resolution",
    "RunController",
    "RunNotFound",
    "RunNotResumable",
    "SQLiteEventStore",
    "SQLiteSession",
    "SchemaError",
    "Session",
    "SessionWrite",
    "SnapshotIgnored",
    "Step",
    "StorageError",
    "ToolCall",
    "ToolContext",
    "ToolInDoubt",
    "Unknown",
    "Waiting",
    "disable_logging",
    "disable_telemetry",
    "enable_logging",
    "enable_telemetry",
    "register_canonical",
    "tool_context",
]
