"""The reference async runner that embeds `RunController` (`Runner`, `Agent`,
`FunctionTool`...), the Session writers (`publish`, `settle`; `run_history` is the
Session as a run that publishes with ``ride=True`` sees it) and the remote tool executor
(`RemoteToolExecutor`). Read `statemachine.runner.loop` as the guide to embedding the
core in your own runner."""

from statemachine.runner.agents import (
    ALLOW,
    Agent,
    FunctionTool,
    MaxTurnsExceeded,
    Model,
    ModelResponse,
    OutputGuardrail,
    OutputGuardrailTripwire,
    RunHooks,
    RunResult,
    StreamEvent,
    ToolGuardrail,
    Verdict,
    reject_content,
)
from statemachine.runner.loop import Runner, RunResultStreaming
from statemachine.runner.publish import publish, run_history, settle
from statemachine.runner.remote import (
    AlreadyAnswered,
    DispatchedToolCall,
    RemoteEvent,
    RemoteSession,
    RemoteToolExecutor,
    RemoteUnavailable,
    TransientPostError,
)

__all__ = [
    "ALLOW",
    "Agent",
    "AlreadyAnswered",
    "DispatchedToolCall",
    "FunctionTool",
    "MaxTurnsExceeded",
    "Model",
    "ModelResponse",
    "OutputGuardrail",
    "OutputGuardrailTripwire",
    "RemoteEvent",
    "RemoteSession",
    "RemoteToolExecutor",
    "RemoteUnavailable",
    "RunHooks",
    "RunResult",
    "RunResultStreaming",
    "Runner",
    "StreamEvent",
    "ToolGuardrail",
    "TransientPostError",
    "Verdict",
    "publish",
    "reject_content",
    "run_history",
    "settle",
]
