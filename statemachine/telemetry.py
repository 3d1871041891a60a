"""OpenTelemetry spans for what the ledger decides (DESIGN §7.6), off unless enabled.

`enable_telemetry` (the ``[otel]`` extra: ``opentelemetry-api``) switches it on for every
controller in the process; `disable_telemetry` switches it off. Off, the core pays one
attribute read per recorded event, as for `enable_logging`. On, a controller emits:

* an ``execute_tool {name}`` span per tool call it is asked to run (GenAI semantic
  conventions: ``gen_ai.operation.name``, ``gen_ai.tool.name``, ``gen_ai.tool.call.id``,
  ``gen_ai.tool.type``), from the recorded start to the recorded result, with
  ``statemachine.tool.outcome``: ``executed``; ``interrupted`` (the body ended without a
  result: the call is now in doubt); ``resent`` (a recorded result answered instead, the
  body never ran); ``rejected`` (an adapter answered with the call's rejection);
  ``refused_in_doubt`` (a started, unfinished call: nothing ran). When an SDK already
  traces the execution (the span current there is its own span of the same call, an
  ``execute_tool`` operation: `_sdk_tool_span`), the controller opens none: it adds its
  attributes and events to the SDK's span, which it never ends nor marks failed (the SDK
  does both), so each execution is one ``execute_tool`` span, as the conventions ask of a
  second instrumentation that finds a tool already traced;
* a ``statemachine.publish`` span per publication attempt, with
  ``statemachine.publication.via`` (``staged``, ``reconcile`` or ``post``: one call's
  result posted, as the remote executor and the Anthropic adapter post them) and
  ``statemachine.publication.outcome`` (``committed``, ``failed``, ``acknowledged``:
  reconcile found the batch written, ``rejected``: reconcile refused, ``unsettled``: its
  write's outcome was never reported, and a reconcile opened the next attempt); an
  attempt reconcile opens (``Append``) ends with the write's outcome, and an attempt
  still open when its controller is dropped never ends (so it is never exported);
* a ``statemachine.transition`` span event per recorded event: ``statemachine.seq``,
  ``statemachine.from``, ``statemachine.to``, ``statemachine.event`` (its class), and
  ``statemachine.actor`` where the event names one (an approver, an operator, a claim's
  owner), on the span it belongs to (its call's, its publication's) or else the current
  span (the SDK's, the reference runner's ``invoke_agent``, an operator command's); with
  no recording span current it gets a ``statemachine.record`` span of its own.

The reference runner opens an ``invoke_agent {agent}`` span per attempt and the operator
commands (`statemachine.operator`, the CLI, the console) a ``statemachine.{command}`` span
carrying ``statemachine.actor`` (the CLI turns telemetry on when
``STATEMACHINE_TELEMETRY=1``). Every span is a child of the span current where it starts,
so the spans sit under an SDK's own (pydantic-ai's instrumentation, ADK's tracing, the
Anthropic SDK's, openai-agents' through `adapters.openai_agents.TracingBridge`).

Loading or replaying a log records nothing, so it emits nothing. Payloads (arguments,
results, items, outputs, reasons, evidence) and fingerprints are never attributes, nor
are exception messages: an error is its type name (``error.type``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
from collections.abc import Callable, Iterator
from importlib import metadata
from typing import TYPE_CHECKING, Any, TypeVar

from statemachine import events as ev
from statemachine.errors import ConfigurationError
from statemachine.structured_logging import switch
from statemachine.values import Step

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span, Tracer, TracerProvider

__all__ = ["disable_telemetry", "enable_telemetry"]

SCOPE = "agent-statemachine"
"""The instrumentation scope the spans are created under."""


class _Otel:
    tracer: Tracer | None = None
    trace: Any = None
    """``opentelemetry.trace``, imported when telemetry is first enabled."""
    context: Any = None
    """``opentelemetry.context``, likewise."""


_otel = _Otel()

_log = logging.getLogger("statemachine.telemetry")
_Hook = TypeVar("_Hook", bound=Callable[..., None])


def _quiet(hook: _Hook) -> _Hook:
    """``hook`` never raises: it runs after the controller recorded (or refused), so a
    failing tracer or exporter must not make a command that happened look as if it had
    not (a call started would look unstarted). The failure is logged, the span lost."""

    @functools.wraps(hook)
    def quiet(*args: Any, **kwargs: Any) -> None:
        try:
            hook(*args, **kwargs)
        except Exception as error:  # (a BaseException is not telemetry's to swallow)
            _lost(error)

    return quiet  # type: ignore[return-value]


def _lost(error: Exception) -> None:
    _log.warning("telemetry failed (%s); the span is lost, the run goes on",
                 type(error).__name__)


def enable_telemetry(tracer_provider: TracerProvider | None = None) -> None:
    """Emit spans from now on, through ``tracer_provider`` (default: OpenTelemetry's
    global one, which SDKs that trace use too). `ConfigurationError` without
    ``opentelemetry-api`` (``pip install 'agent-statemachine[otel]'``)."""
    try:
        from opentelemetry import context, trace
    except ImportError as missing:
        raise ConfigurationError(
            "telemetry needs opentelemetry-api: pip install 'agent-statemachine[otel]'"
        ) from missing
    provider = trace.get_tracer_provider() if tracer_provider is None else tracer_provider
    try:
        version = metadata.version(SCOPE)
    except metadata.PackageNotFoundError:  # pragma: no cover - run from a source tree
        version = None
    _otel.tracer = provider.get_tracer(SCOPE, version)
    _otel.trace = trace
    _otel.context = context
    switch.turn(telemetry=True)


def disable_telemetry() -> None:
    """Emit nothing from now on (spans already open still end)."""
    switch.turn(telemetry=False)


# ------------------------------------------------------------ spans around work


@contextlib.contextmanager
def _current(name: str, attributes: dict[str, Any]) -> Iterator[Span | None]:
    """A span current inside the block; None (the block runs all the same) when the
    tracer fails to make one."""
    tracer = _otel.tracer
    assert tracer is not None
    with contextlib.ExitStack() as stack:
        span: Span | None = None
        try:
            span = stack.enter_context(tracer.start_as_current_span(
                name, attributes=attributes, record_exception=False,
                set_status_on_exception=False))
        except Exception as error:
            _lost(error)
        try:
            yield span
        except BaseException as error:
            if span is not None:
                _quiet(_failed)(span, type(error).__name__)
            raise


_OFF: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
"""What a span helper returns when telemetry is off (one shared, reusable no-op)."""


def agent_span(agent: str) -> contextlib.AbstractContextManager[Span | None]:
    """The reference runner's ``invoke_agent {agent}`` span around one attempt, current
    for what the attempt records, from loading or starting its run on (name the run with
    `of_run` once it is known); a no-op yielding None when off."""
    if not switch.telemetry:
        return _OFF
    return _current(f"invoke_agent {agent}", {
        "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": agent})


def of_run(span: Span | None, run_id: str) -> None:
    """``span`` (from `agent_span`) is about the run ``run_id``."""
    if span is not None:
        span.set_attribute("statemachine.run_id", run_id)


def inside(spans: Spans | None, call_id: str) -> contextlib.AbstractContextManager[Any]:
    """The block is the body of ``call_id``: its open ``execute_tool`` span (in
    ``spans``, a controller's) is the current span there; a no-op without one."""
    span = None if spans is None or not switch.telemetry else spans.calls.get(call_id)
    if span is None:
        return _OFF
    lent: contextlib.AbstractContextManager[Any] = _otel.trace.use_span(
        span, end_on_exit=False, record_exception=False, set_status_on_exception=False)
    return lent


def command_span(command: str, run_id: str, actor: str) -> contextlib.AbstractContextManager[Any]:
    """An operator command's ``statemachine.{command}`` span, current while it loads,
    claims, applies and appends (a no-op when off)."""
    if not switch.telemetry:
        return _OFF
    return _current(f"statemachine.{command}", {
        "statemachine.run_id": run_id, "statemachine.actor": actor})


class Mirrored:
    """A span opened for a span of another tracing system (`mirror`), the current span
    in the context that opened it until `end`."""

    __slots__ = ("_here", "_token", "span")

    def __init__(self, span: Span, token: contextvars.Token[Context],
                 here: contextvars.Token[Span | None]) -> None:
        self.span = span
        self._token = token
        self._here = here

    def end(self, error_type: str | None = None) -> None:
        """End the span (failed with ``error_type``, when given). It stops being the
        current span only when it ends in the context that opened it: another context (a
        task, a thread) cannot reset that one's."""
        if error_type is not None:
            _failed(self.span, error_type)
        try:
            _MIRRORED.reset(self._here)
        except (ValueError, RuntimeError):  # another context's token, or reset already
            pass
        else:
            _otel.context.detach(self._token)
        self.span.end()


_MIRRORED: contextvars.ContextVar[Span | None] = contextvars.ContextVar(
    "statemachine_mirrored", default=None)
"""Set beside each attach of a `Mirrored` span: resetting it tells, without touching
OpenTelemetry's context, whether a span ends in the context that opened it."""


def mirror(name: str, attributes: dict[str, Any], parent: Mirrored | None = None
           ) -> Mirrored | None:
    """A span ``name`` mirroring a span of another tracing system (openai-agents'), a
    child of ``parent`` (else of the current span), made the current span here until
    `Mirrored.end`; None when off. ``attributes`` name things, never payloads."""
    if not switch.telemetry:
        return None
    tracer = _otel.tracer
    assert tracer is not None
    trace = _otel.trace
    context = None if parent is None else trace.set_span_in_context(parent.span)
    span = tracer.start_span(name, context=context, attributes=attributes)
    token = _otel.context.attach(trace.set_span_in_context(span))
    return Mirrored(span, token, _MIRRORED.set(span))


def _failed(span: Span, error_type: str) -> None:
    span.set_attribute("error.type", error_type)
    span.set_status(_otel.trace.Status(_otel.trace.StatusCode.ERROR))


# ------------------------------------------------------ what a controller records


def _tool_span(run_id: str, call_id: str, tool: str) -> Span:
    tracer = _otel.tracer
    assert tracer is not None
    return tracer.start_span(f"execute_tool {tool}", attributes={
        "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": tool,
        "gen_ai.tool.call.id": call_id, "gen_ai.tool.type": "function",
        "statemachine.run_id": run_id})


def _sdk_tool_span(run_id: str, call_id: str, tool: str) -> Span | None:
    """The span current here when it is an SDK's own span of this very tool execution,
    joined: it gets ``gen_ai.tool.call.id`` (when it has none) and ``statemachine.run_id``;
    None when there is none, or when it cannot be told for sure (then the call gets a span
    of its own). The GenAI conventions want one ``execute_tool`` span per execution (a
    second instrumentation that can tell a tool is traced already adds its attributes to
    that span instead of opening another, as their MCP client span does), and dashboards
    count and time tools by ``gen_ai.operation.name``: two nested spans would count each
    call twice.

    The current span is the SDK's span of the call when it records, its attributes can be
    read (an SDK span's; the API has no reading), it says it is a tool execution (its
    ``gen_ai.operation.name`` is ``execute_tool`` and its ``gen_ai.tool.name`` is
    ``tool``, as pydantic-ai's, openai-agents' through the bridge and the Anthropic SDK's
    ``anthropic.custom_tool_use {tool}`` say from their start; or it is named
    ``execute_tool {tool}``, the conventions' name, and says nothing else yet, as ADK's
    until it ends), and whatever else it says (call id, run) agrees."""
    current: Span = _otel.trace.get_current_span()
    if not current.is_recording():
        return None
    said = getattr(current, "attributes", None)
    if said is None:
        return None
    named = getattr(current, "name", None) == f"execute_tool {tool}"
    operation = said.get("gen_ai.operation.name")
    if operation is None and not named:
        return None
    if operation not in (None, "execute_tool") or said.get(
            "gen_ai.tool.name", tool if named else None) != tool:
        return None
    if said.get("gen_ai.tool.call.id", call_id) != call_id or said.get(
            "statemachine.run_id", run_id) != run_id:
        return None  # (another call, or another run's call, running inside this one)
    if "gen_ai.tool.call.id" not in said:
        current.set_attribute("gen_ai.tool.call.id", call_id)
    current.set_attribute("statemachine.run_id", run_id)
    return current


def _publication(run_id: str, via: str, items: int | None) -> Span:
    tracer = _otel.tracer
    assert tracer is not None
    attributes: dict[str, Any] = {"statemachine.run_id": run_id,
                                  "statemachine.publication.via": via}
    if items is not None:
        attributes["statemachine.publication.items"] = items
    return tracer.start_span("statemachine.publish", attributes=attributes)


@_quiet
def answered(run_id: str, call_id: str, tool: str, outcome: str) -> None:
    """The ledger answered a call without running it: ``resent`` (its recorded result),
    ``rejected`` or ``refused_in_doubt`` (`ToolInDoubt`). Its span starts and ends
    here, unless it is an SDK's (`_sdk_tool_span`): that one only says the outcome."""
    sdk = _sdk_tool_span(run_id, call_id, tool)
    if sdk is not None:
        sdk.set_attribute("statemachine.tool.outcome", outcome)
        return
    span = _tool_span(run_id, call_id, tool)
    span.set_attribute("statemachine.tool.outcome", outcome)
    if outcome == "refused_in_doubt":
        _failed(span, "ToolInDoubt")
    span.end()


@_quiet
def rejected(run_id: str) -> None:
    """Reconcile refused the Session's tail (`ReconcileRejected`, nothing recorded): a
    reconcile attempt of its own, ended so (an attempt still open in the controller is
    not over: it may still be writing)."""
    span = _publication(run_id, "reconcile", None)
    span.set_attribute("statemachine.publication.outcome", "rejected")
    _failed(span, "ReconcileRejected")
    span.end()


class Spans:
    """The spans one controller holds open: its calls' ``execute_tool`` spans (by call
    id) and its publication attempt's span. A controller creates one when it first
    records with telemetry on; the spans die with it (a process killed mid-call never
    ends them, so they are never exported)."""

    __slots__ = ("calls", "joined", "publication", "run_id")

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.calls: dict[str, Span] = {}
        self.joined: set[str] = set()
        """The calls whose span in `calls` is an SDK's (`_sdk_tool_span`): never ended
        nor marked failed here."""
        self.publication: Span | None = None

    @_quiet
    def interrupted(self, call_id: str) -> None:
        """The body ended without a result (`RunController.tool_interrupted`)."""
        span = self.calls.pop(call_id, None)
        if span is not None:
            span.set_attribute("statemachine.tool.outcome", "interrupted")
            if call_id in self.joined:
                self.joined.discard(call_id)
                return
            _failed(span, "interrupted")
            span.end()

    def _opened(self, span: Span) -> Span:
        """``span`` is the publication attempt now; one still open (its write's outcome
        never reported) ends ``unsettled``."""
        if self.publication is not None:
            self.publication.set_attribute("statemachine.publication.outcome", "unsettled")
            self.publication.end()
        self.publication = span
        return span

    def _settled(self) -> Span:
        """The open publication attempt, which the event settles (one of its own when
        none is open here)."""
        span = self.publication or _publication(self.run_id, "reconcile", None)
        self.publication = None
        return span

    @_quiet
    def recorded(self, event: ev.Event, before: Step | None, after: Step,
                 tool: str | None) -> None:
        """``event`` was recorded (``before`` → ``after``); ``tool`` names its call's
        tool, if it is about one."""
        span: Span | None = None
        outcome: str | None = None  # the publication attempt's, when the event ends it
        ends = False
        match event:
            case ev.ToolStarted(call_id=call_id):
                span = _sdk_tool_span(self.run_id, call_id, tool or "")
                if span is None:
                    span = _tool_span(self.run_id, call_id, tool or "")
                else:
                    self.joined.add(call_id)
                self.calls[call_id] = span
            case ev.ToolCompleted(call_id=call_id):
                span = self.calls.pop(call_id, None)
                if span is not None:
                    span.set_attribute("statemachine.tool.outcome", "executed")
                    ends = call_id not in self.joined
                    self.joined.discard(call_id)
            case ev.PublicationStaged(items=items):
                span = self._opened(_publication(self.run_id, "staged", len(items)))
            case ev.ReconciledAppend():
                span = self._opened(_publication(self.run_id, "reconcile", None))
            case ev.ReconciledAcknowledge():
                span, outcome = self._settled(), "acknowledged"
            case ev.PublicationCommitted() if self.publication is not None:
                span, outcome = self._settled(), "committed"
            case ev.PublicationFailed(error=error) if self.publication is not None:
                span, outcome = self._settled(), "failed"
                _failed(span, error)
            case ev.ResultPosted(call_id=call_id) | ev.ResultPostFailed(call_id=call_id):
                span = _publication(self.run_id, "post", 1)
                span.set_attribute("gen_ai.tool.call.id", call_id)
                outcome = "committed" if isinstance(event, ev.ResultPosted) else "failed"
                if isinstance(event, ev.ResultPostFailed):
                    _failed(span, event.error)
        attributes = _transition(event, before, after)
        if span is None:
            current = _otel.trace.get_current_span()
            if current.is_recording():
                current.add_event("statemachine.transition", attributes)
                return
            span, ends = self._record_span(), True
        span.add_event("statemachine.transition", attributes)
        if outcome is not None:
            span.set_attribute("statemachine.publication.outcome", outcome)
            ends = True
        if ends:
            span.end()

    def _record_span(self) -> Span:
        tracer = _otel.tracer
        assert tracer is not None
        return tracer.start_span("statemachine.record",
                                 attributes={"statemachine.run_id": self.run_id})


def _transition(event: ev.Event, before: Step | None, after: Step) -> dict[str, Any]:
    """The span event's attributes: where the run went, never a payload or fingerprint."""
    attributes: dict[str, Any] = {
        "statemachine.seq": event.seq, "statemachine.event": type(event).__name__,
        "statemachine.to": after.value}
    if before is not None:
        attributes["statemachine.from"] = before.value
    call_id = getattr(event, "call_id", None)
    if type(call_id) is str:
        attributes["gen_ai.tool.call.id"] = call_id
    actor = event.owner if isinstance(event, ev.RunClaimed) else getattr(event, "by", None)
    if type(actor) is str:
        attributes["statemachine.actor"] = actor
    if isinstance(event, ev.InDoubtResolved):
        attributes["statemachine.resolution"] = event.outcome.value
    elif isinstance(event, ev.HookRan):
        attributes["statemachine.hook"] = event.hook
    error = getattr(event, "error", None)
    if type(error) is str:
        attributes["error.type"] = error
    return attributes
