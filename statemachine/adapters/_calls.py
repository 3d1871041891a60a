"""What every adapter shares: `plain`, an SDK's value as the plain JSON the ledger keeps
(each adapter naming its policy for what is not JSON); `begin_call`, what an adapter does
before a tool body runs (ask the ledger, DESIGN §2.4); and, for the async adapters, the
whole of one call (`run_call`). And the rules of issue 23 that hold in every adapter:

* a result is recorded only if the run has room for it under ``max_bytes``: before the
  body the call is refused when even its failure could not be recorded (`begin_call`),
  and after it a result too large to keep is recorded as the call's failure, the text the
  model is sent instead (`record_result`) — never left in doubt by the library's limit;
* what a tool output guardrail let through is what the ledger keeps: `run_call` with
  ``keep=False`` leaves the result to be recorded after the guardrail (`record_result`);
* an attempt refused because a dead attempt may still be writing names the adapter's
  ``take_over=True`` (`naming_take_over`, `settle_unsettled`);
* a run that already completed answers a retried request with its recorded output
  (`recorded_output`), calling no model and running no tool;
* a call settled from outside (an operator's or a verifier's `resolve_in_doubt`, in any
  process) goes on in the adapter's SDK: `resolution` says whether its recorded result is
  a resolution's word (``FAILED``: an error the model is shown as one), and the adapters'
  own ``resolve_in_doubt`` / ``abandon`` claim the run first and change nothing when
  refused (`decide`, `decide_async`);
* an SDK feature an adapter cannot carry is refused with `UnsupportedFeature`;
* the verifiers an adapter is given (by tool name, DESIGN §7.3) are checked when the run is
  opened (`checked_verifiers`: `InvalidVerifier`), and every tool body runs inside its
  call's `statemachine.tool_context` (`run_call` for the async adapters).
"""

from __future__ import annotations

import inspect
import json
import math
import threading
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from typing import Any, ClassVar

from statemachine import events as ev
from statemachine import sizes, telemetry
from statemachine.controller import RunController
from statemachine.errors import (
    ConfigurationError,
    ControlError,
    InvalidTransition,
    ReconcileRejected,
    RunNotFound,
    RunNotResumable,
    SchemaError,
)
from statemachine.journal import Journal
from statemachine.payloads import JSON, canonical_json
from statemachine.runner.publish import settle
from statemachine.sessions import Session
from statemachine.stores import EventStore
from statemachine.structured_logging import switch
from statemachine.values import Phase, Resend, Resolution, Step
from statemachine.verifiers import Verifier, running_call, verify_in_doubt


class UnsupportedFeature(ControlError, ValueError):
    """An SDK feature this adapter cannot carry safely, refused before anything was
    recorded or run: when the run is opened, or (an option given to one attempt) before
    that attempt does anything. ``feature`` names it."""

    def __init__(self, reason: str, *, feature: str, **where: Any) -> None:
        self.feature = feature
        super().__init__(reason, **where)

    def _extra(self) -> dict[str, Any]:
        return {"feature": self.feature}


class HistoryMismatch(ReconcileRejected):
    """The history the run was opened with is not the run's: another Session, none for a
    run that writes to one, or one for a run started without. Refused when the run is
    opened, before anything is recorded; open it with its own history. Also messages that
    do not go on from the run's history (pydantic-ai: ``message_history`` that is no stop
    of a run without a history; Anthropic: a request whose messages do not begin with the
    conversation its history holds): refused before anything runs or is sent."""


def same_history(c: RunController, history: Session | None, carried: str) -> None:
    """`HistoryMismatch` unless ``history`` is the history the run writes to; ``carried``
    says how a run without one is given its messages."""
    given = None if history is None else history.session_id
    if given == c.session_id:
        return
    if c.session_id is None:
        reason = (f"the run was started without a history (the caller carries its messages), "
                  f"and was opened with history {given!r}: open it without one, {carried}")
    elif given is None:
        reason = (f"the run writes its messages to history {c.session_id!r} and was opened "
                  "without a history: open it with that history")
    else:
        reason = (f"the history {given!r} is not the run's history {c.session_id!r}: open "
                  "the run with its own history; nothing was recorded")
    raise HistoryMismatch(reason, run_id=c.run_id, step=c.step, action="open")


class InvalidVerifier(ConfigurationError):
    """A verifier an adapter was given when the run was opened that it cannot use: one
    naming no tool of the run (``tool`` names it), one for an idempotent tool (its calls
    run again and are never in doubt, so it would never be asked), or one that is not
    callable. Nothing was opened or recorded."""

    def __init__(self, reason: str, *, tool: str | None, **where: Any) -> None:
        self.tool = tool
        super().__init__(reason, **where)

    def _extra(self) -> dict[str, Any]:
        return {"tool": self.tool}


def checked_verifiers(verifiers: Mapping[str, Verifier] | None, tools: Collection[str], *,
                      idempotent: Collection[str] = (), run_id: str | None = None,
                      sync_only: str | None = None,
                      any_name: bool = False) -> dict[str, Verifier]:
    """``verifiers`` (by tool name) as the adapter keeps them, checked before anything is
    opened or recorded: each must name one of ``tools``, none of ``idempotent``, and be
    callable (with ``sync_only``, the way to open the run that takes an async one; a sync
    opening cannot await it). `InvalidVerifier` otherwise: a verifier that could never be
    asked is refused rather than silently left out. ``any_name``: the run also has tools
    known only when it runs (an MCP server's), so a name not in ``tools`` may be one."""
    if verifiers is None:
        return {}
    if not isinstance(verifiers, Mapping):
        raise InvalidVerifier("verifiers must be a mapping of tool name to verifier, "
                              f"not {type(verifiers).__name__}", tool=None, run_id=run_id,
                              action="open")
    known = set(tools)
    for tool, verify in verifiers.items():
        if type(tool) is not str or (tool not in known and not any_name):
            raise InvalidVerifier(f"a verifier was given for {tool!r}, which is no tool of "
                                  "this run", tool=tool if type(tool) is str else None,
                                  run_id=run_id, action="open")
        if tool in idempotent:
            raise InvalidVerifier(f"the verifier of {tool!r} would never be asked: the tool "
                                  "is idempotent, so its calls run again and are never in "
                                  "doubt", tool=tool, run_id=run_id, action="open")
        if not callable(verify):
            raise InvalidVerifier(f"the verifier of {tool!r} is not callable (a "
                                  f"{type(verify).__name__})", tool=tool, run_id=run_id,
                                  action="open")
        if sync_only is not None and inspect.iscoroutinefunction(verify):
            raise InvalidVerifier(f"the verifier of {tool!r} is async, and this opening "
                                  f"cannot await it: use {sync_only}", tool=tool,
                                  run_id=run_id, action="open")
    return dict(verifiers)

# ------------------------------------------------------------------ plain JSON forms

Walk = Callable[[Any], JSON]
"""Makes a part of a value plain, one level deeper than the value."""

Fallback = Callable[[Any, Walk | None], JSON]
"""An adapter's policy for a value `plain` does not take as it is: called with the value
and a `Walk` for its parts (None when the value is nested too deep to walk any further),
it returns what the ledger keeps for it: the text the SDK shows the model, the SDK's own
JSON form, or the value as it is, for the controller to refuse (`SchemaError`)."""

MAX_PLAIN_DEPTH = 100
"""How deep `plain` walks; a value nested deeper is the fallback's (given no `Walk`)."""

_INT_BITS = 14_000
"""Below this bit length an int has fewer than 4,300 digits, so it prints."""


def plain(value: Any, *, fallback: Fallback) -> JSON:
    """``value`` as plain JSON. ``None``, a ``bool``, a ``str``, an ``int`` of fewer than
    14,000 bits and a finite ``float`` (each by exact type) are kept; a list or a tuple,
    and a mapping whose keys are all ``str``, are walked; anything else (a subclass of
    those, a longer int, a non-finite float, a mapping with another key, a model, any
    other object) is what ``fallback`` makes of it, as is a value nested deeper than
    `MAX_PLAIN_DEPTH` levels."""
    return _walk(value, fallback, 0)


def _walk(value: Any, fallback: Fallback, depth: int) -> JSON:
    if depth > MAX_PLAIN_DEPTH:
        return fallback(value, None)
    kind = type(value)
    if value is None or kind is bool or kind is str:
        return value
    if kind is int and value.bit_length() < _INT_BITS:
        return value
    if kind is float and math.isfinite(value):
        return value
    if isinstance(value, list | tuple):
        return [_walk(item, fallback, depth + 1) for item in value]
    if isinstance(value, Mapping) and all(isinstance(key, str) for key in value):
        return {key: _walk(item, fallback, depth + 1) for key, item in value.items()}
    return fallback(value, lambda part: _walk(part, fallback, depth + 1))


def lossless(value: Any, plain_form: JSON) -> bool:
    """Whether ``plain_form`` (what `plain` made of ``value``) is ``value`` itself: a
    final output that is plain JSON is kept whole (``accept_final_output(lossless=)``)."""
    return type(value) in (str, int, float, bool, type(None), list, dict) and (
        plain_form == value)


# --------------------------------------------------------------------- tool calls


def begin_call(c: RunController, call_id: str, arguments: JSON, *,
               staged: int = 0) -> tuple[bool, JSON]:
    """``(True, result)`` when the call must not run: its recorded result (published
    before, or a `Resend` of a result recorded but not yet published). ``(False, None)``
    when its start is recorded and the body runs now, once the start is made durable
    (the caller flushes: an effect boundary). Raises `InvalidTransition` for a call the
    ledger never saw or one asked to run with other arguments than the recorded ones
    (which its approval binds) or one still awaiting a decision, `ToolInDoubt` for a
    started, unfinished call, and
    `SchemaError` (nothing recorded, the body never runs) when the run has no room left
    to record and publish even the call's failure (`ensure_room`; ``staged``: the bytes
    its batch takes beside its result)."""
    view = c.call(call_id)
    refuse_other_arguments(c, call_id, arguments)
    if view.phase is Phase.PUBLISHED:
        answered(c, call_id)
        return True, view.result
    if view.phase is Phase.AWAITING:
        raise InvalidTransition(
            f"call {call_id!r} awaits a decision the ledger has not recorded (a decision "
            "the SDK keeps for later calls is not one); it did not run",
            run_id=c.run_id, step=c.step, action="begin_tool")
    if c.step is Step.INTERRUPTION:
        c.resume()  # calls needing no approval run while others await a decision
    if view.phase is not Phase.COMPLETED:
        ensure_room(c, call_id, staged=staged)
    decision = c.begin_tool(call_id)
    if isinstance(decision, Resend):
        return True, decision.result
    return False, None


def refuse_other_arguments(c: RunController, call_id: str, arguments: JSON) -> None:
    """`InvalidTransition` when ``call_id`` is asked for with arguments other than the
    recorded ones: a call the ledger answered is not answered again for other arguments
    (a model reusing an id across turns would be sent an answer to another call), and one
    to run never runs with them (its approval binds the recorded ones)."""
    if not _same_json(arguments, c.call(call_id).call.arguments):
        raise InvalidTransition(
            f"call {call_id!r} was asked for with arguments other than the recorded ones "
            "(which its approval and its answer are bound to): it did not run and was not "
            "answered", run_id=c.run_id, step=c.step, action="begin_tool")


def answered(c: RunController, call_id: str) -> None:
    """The ledger answers ``call_id`` from its record, the body not run: its
    ``execute_tool`` span (when telemetry is on) says ``resent``, or ``rejected`` for a
    rejection, published or not (a published call that never started and was last
    decided ``rejected`` was published with its rejection)."""
    if switch.telemetry:
        view = c.call(call_id)
        rejection = view.phase is Phase.REJECTED or (
            view.phase is Phase.PUBLISHED and view.starts == 0 and bool(view.decisions)
            and view.decisions[-1].kind == "rejected")
        telemetry.answered(c.run_id, call_id, view.call.name,
                           "rejected" if rejection else "resent")


def _same_json(asked: JSON, recorded: JSON) -> bool:
    """Exactly the same JSON (``1``, ``1.0`` and ``true`` are equal in Python, not here);
    arguments that are not plain JSON (a NaN) are never the recorded ones."""
    try:
        return canonical_json(asked) == canonical_json(recorded)
    except (TypeError, ValueError):
        return False


async def run_call(c: RunController, call_id: str, arguments: JSON, *,
                   flush: Callable[[], Awaitable[None]], body: Callable[[], Awaitable[Any]],
                   as_json: Callable[[Any], JSON],
                   answers: tuple[type[BaseException], ...] = (),
                   answer: Callable[[BaseException], JSON] | None = None,
                   keep: bool = True, staged: int = 0) -> Any:
    """One tool call through the ledger: its recorded result when it must not run
    (`begin_call`); else its start made durable (``flush``: an effect boundary), the
    body once, and its result recorded (``as_json`` makes it JSON) by `record_result`: a
    result the run has no room for is recorded as the call's failure, and that text is
    returned instead (what the model must be sent). With ``keep=False`` nothing is
    recorded after the body: the call stays in flight and the caller records what a
    guardrail let through (`record_result`) or reports ``tool_interrupted``. ``staged``
    is what the call's batch takes beside its result (`record_result`).

    An exception of a type in ``answers`` is the tool's own answer: recorded as its
    result (``answer(error)``, by default ``{"error": type name, "message": str}``) and
    raised on. Anything else the body raises (cancelled, timed out, killed before a
    result) leaves the call started, and this controller answers as a reloaded one would
    (`ToolInDoubt`). The body runs inside the call's `statemachine.tool_context` (its
    idempotency key), as do its own tasks and the threads an SDK runs it on."""
    done, cached = begin_call(c, call_id, arguments, staged=staged)
    if done:  # published before, or recorded: its cached result, never a rerun
        return cached
    await flush()
    try:
        with running_call(c, call_id):  # tool_context() in the body
            output = await body()
    except answers as error:
        record_result(c, call_id, answer(error) if answer is not None else
                      {"error": type(error).__name__, "message": str(error)}, staged=staged)
        raise
    except BaseException:
        if call_id in c.in_flight:
            c.tool_interrupted(call_id)
        raise
    if not keep:
        return output
    kept, recorded = record_result(c, call_id, as_json(output), staged=staged)
    return output if kept else recorded


# ------------------------------------------------- results and the room under max_bytes

STAGED_BYTES = 1024
"""What staging a batch adds beside its items (the envelope's digests and frontier, an
item's keys): room kept for it, so a result that was recorded can also be published."""


def room(c: RunController) -> int:
    """The bytes an ordinary command may still add to the run's JSON under its
    ``max_bytes`` (the room kept for settling and abandoning excluded)."""
    # (the run's journal keeps this limit privately; a public reading belongs there)
    limit: int = c._journal.limits.room
    return limit - c.size


def _needed(c: RunController, call_id: str, output: JSON, staged: int) -> int:
    """The bytes recording ``output`` takes, with room to publish it: its record, and its
    copy in the staged batch beside the ``staged`` bytes of the batch's other items."""
    completed = sizes.event_size(ev.ToolCompleted(c.version, call_id, output)) + 1
    return completed + (completed + staged + STAGED_BYTES)


def not_kept(reason: str) -> str:
    """The failure text recorded (and sent to the model) for a result the run did not
    keep."""
    return f"The tool ran, but its result was not kept: {reason}."


def _too_large(size: int, left: int) -> str:
    return not_kept(f"recording and publishing it takes {size} bytes, and this run may "
                    f"record only {left} more under max_bytes")


def ensure_room(c: RunController, call_id: str, *, staged: int = 0) -> None:
    """`SchemaError` (nothing recorded) when the run could not record the call's start
    and then publish even its failure (``staged``: the bytes its batch takes beside the
    result): refused before the body, so the library's own limit never leaves a call in
    doubt."""
    started = sizes.event_size(ev.ToolStarted(c.version, call_id)) + 1
    failure = _needed(c, call_id, _too_large(10**18, 10**18), staged)
    if started + failure > room(c):
        raise SchemaError(
            f"call {call_id!r} was not started: the run has no room left under max_bytes "
            "to record and publish its result; abandon the run (or start it again with a "
            "larger max_bytes)", run_id=c.run_id, step=c.step, action="begin_tool")


def record_result(c: RunController, call_id: str, output: JSON, *,
                  staged: int = 0) -> tuple[bool, JSON]:
    """Record ``output`` as the result of a call this controller holds in flight, when
    the run has room to record it and publish it (``staged``: the bytes its batch takes
    beside it); otherwise record the call's failure (`not_kept`: why; the text the model
    is sent instead). Returns ``(kept, recorded)``."""
    try:
        needed = _needed(c, call_id, output, staged)
    except (TypeError, ValueError, RecursionError):  # not plain JSON: tool_completed says
        needed = 0
    left = room(c)
    if needed <= left:
        try:
            c.tool_completed(call_id, output)
        except SchemaError as refused:  # too deep, not plain JSON: the call fails
            failure = not_kept(refused.reason)
        else:
            return True, output
    else:
        failure = _too_large(needed, left)
    c.tool_completed(call_id, failure)
    return False, failure


# ---------------------------------------------------------------- settling, completed runs


def naming_take_over(refused: ReconcileRejected, how: str) -> ReconcileRejected:
    """``refused`` told how to take over in this adapter (``how``: e.g.
    ``"AgentRun.open(..., take_over=True)"``) when it is the refusal of an attempt that may
    still be writing; any other refusal as it is."""
    if "may still be writing" not in refused.reason:
        return refused
    return ReconcileRejected(
        f"{refused.reason}. The attempt that staged this write is not this one: once the "
        f"process that ran it is gone (killed, exited) and no request it sent can still "
        f"land, open the run with {how}", run_id=refused.run_id, step=refused.step,
        action=refused.action)


async def settle_unsettled(c: RunController, session: Session, *, take_over: bool,
                           how: str) -> None:
    """Settle the run's unsettled write (reconcile, and write the batch if nothing of it
    landed) until it is settled; a refusal because an earlier attempt may still be
    writing says how to take over (`naming_take_over`)."""
    while c.step is Step.UNSETTLED:
        try:
            await settle(c, session, take_over=take_over)
        except ReconcileRejected as refused:
            told = naming_take_over(refused, how)
            if told is refused:
                raise
            raise told from None


def recorded_output(c: RunController, new_input: Sequence[JSON], *,
                    last_input: Sequence[JSON] | None = None) -> JSON:
    """The recorded final output of a run that already completed, for an attempt that
    repeats it: with no new input, or the input the run last received (a retried
    request; ``last_input`` when the adapter keeps it elsewhere than ``add_input``).
    Other input is refused with `RunNotResumable` (nothing recorded): a completed run
    takes no new input; start a new run."""
    if new_input:
        inputs = [event.items for event in c.events if isinstance(event, ev.InputAdded)]
        last = (list(last_input) if last_input is not None
                else list(inputs[-1]) if inputs else [])
        if not _same_json(list(new_input), last):
            raise RunNotResumable(
                "the run completed and takes no new input; its recorded output answers "
                "only a repeat of its last request: start a new run for this input",
                run_id=c.run_id, step=c.step, action="run")
    return c.final_output


def abandoned_reason(c: RunController) -> str | None:
    """Why a terminal run was abandoned (its last ``abandon`` reason), or None."""
    for event in reversed(c.events):
        if isinstance(event, ev.Abandoned):
            return event.reason
    return None


# -------------------------------------------------------- an operator's word, in the adapters


def resolution(c: RunController, call_id: str) -> Resolution | None:
    """How the call's recorded result came to be, when it is a resolution's word:
    `Resolution.COMPLETED` (the output is what the model sees, as if the tool had
    returned it) or `Resolution.FAILED` (the output is the error the model sees). None
    when the result is the tool's own (recorded by a run of its body, also the run after a
    ``NOT_EXECUTED``) or the call has none."""
    view = c.call(call_id)
    if view.phase not in (Phase.COMPLETED, Phase.PUBLISHED) or not view.decisions:
        return None
    last = view.decisions[-1]
    if last.kind != "resolved" or last.outcome is Resolution.NOT_EXECUTED:
        return None  # after NOT_EXECUTED the body ran again: its result is its own
    return last.outcome


def error_text(output: JSON) -> str:
    """A ``FAILED`` resolution's output as the error text an SDK takes: text as it is,
    anything else as its JSON text (the same text for the same log: a resend is
    byte-identical)."""
    return output if isinstance(output, str) else json.dumps(output, ensure_ascii=False)


Command = Callable[[RunController], None]
"""One operator command on a controller (``resolve_in_doubt``, ``abandon``)."""


def resolving(c: RunController, call_id: str, output: JSON, *, outcome: Resolution,
              by: str | None, evidence: str | None) -> Command:
    """The command recording ``outcome`` for call ``call_id`` (`decide` runs it). A call
    this controller itself runs (in flight) is refused now (`InvalidTransition`, nothing
    recorded): a copy of the run could not tell."""
    if call_id in c.in_flight:
        c.resolve_in_doubt(call_id, output, outcome=outcome, by=by, evidence=evidence)

    def command(target: RunController) -> None:
        target.resolve_in_doubt(call_id, output, outcome=outcome, by=by, evidence=evidence)

    return command


def abandoning(reason: str, *, by: str | None) -> Command:
    """The command abandoning the run for good (`decide` runs it)."""

    def command(target: RunController) -> None:
        target.abandon(reason, by=by)

    return command


def _rehearsed(c: RunController, owner: str | None, command: Command) -> None:
    """``claim(owner)`` and ``command`` on a detached copy of the run first: a refusal
    (the call not in doubt, a bad outcome, text or output) is raised before the real run
    records anything, not even its claim."""
    limits = c._journal.limits  # the run's own limits, so the copy refuses what it would
    trial = RunController.from_json(c.to_json(), max_depth=limits.max_depth,
                                    max_events=limits.max_events,
                                    max_bytes=limits.max_bytes)
    trial.claim(owner)
    command(trial)


def decide(c: RunController, owner: str | None, command: Command) -> None:
    """An operator's command through an adapter (sync store): rehearsed on a copy (a
    refusal changes nothing), then the run claimed as ``owner`` (`ConcurrencyConflict`
    when another attempt claimed it first: nothing recorded), the command recorded, and
    both made durable before this returns."""
    _rehearsed(c, owner, command)
    c.claim(owner)
    c.flush()
    command(c)
    c.flush()


async def decide_async(c: RunController, owner: str | None, command: Command, *,
                       flush: Callable[[], Awaitable[None]] | None = None) -> None:
    """`decide` for an adapter whose store may be async (``flush``: how it flushes)."""
    flush = flush if flush is not None else c.flush_async
    _rehearsed(c, owner, command)
    c.claim(owner)
    await flush()
    command(c)
    await flush()


def stored_run(store: EventStore, run_id: str, **options: Any) -> RunController | None:
    """The run ``run_id`` loaded from the sync ``store`` (`RunController.load` with
    ``options``), or None when the store holds none of its events: for a store that counts
    a run's events (every store of this library) one indexed read finds a new run's id
    absent, where a load would read the snapshot and the log to find nothing."""
    if Journal.holds_none(store, run_id):
        return None
    try:
        return RunController.load(store, run_id, **options)
    except RunNotFound:
        return None


class HeldRuns:
    """This process's copies of the runs an adapter keeps one per thread or session (the
    LangGraph `ToolLedger`, the ADK `LedgerPlugin`): the class sets ``store``, ``owner``,
    ``verifiers`` (checked), ``_lock`` (an `RLock`) and ``_runs``."""

    store: EventStore
    owner: str | None
    verifiers: Mapping[str, Verifier]
    _lock: threading.RLock
    _runs: dict[str, RunController]
    claim_at_open: ClassVar[bool] = True
    """Whether a loaded run's claim is made durable when it is opened (before the
    attempt's hooks, which only fence), or rides with the attempt's first write (an
    attempt that finds nothing to record never supersedes the one that does)."""

    def controller(self, run_id: str, *, reopen: bool = True) -> RunController:
        """The run's controller as this process holds it: loaded (and claimed, its
        verifiers asked) when the store holds the run and this process does not, or holds
        a stale copy (another process wrote since); started when the store does not hold
        it. `ConcurrencyConflict` when another attempt claimed the same version first.

        ``reopen=False`` is for a callback inside an attempt that already holds the run
        (an ADK tool callback after the invocation's ``before_run_callback``): a held
        copy that another process wrote past means a later attempt claimed the run, so
        this one was superseded and gets `ConcurrencyConflict` (the copy stays stopped:
        the next attempt loads the run again). Claiming it back would supersede the
        newer attempt in turn, and of two resumers neither would go on."""
        with self._lock:
            c = self._runs.get(run_id)
            if c is not None:
                try:
                    c.fence()
                except ControlError:  # another process wrote, or this copy stopped
                    if not reopen:
                        raise
                    c = None
            if c is None:
                c = self._open(run_id)
                self._runs[run_id] = c
            return c

    def _open(self, run_id: str) -> RunController:
        c = stored_run(self.store, run_id, buffered=True)
        if c is None:
            return RunController.start(run_id=run_id, session_id=None, store=self.store,
                                       buffered=True)
        doubtful = c.in_doubt()
        verifiable = [call_id for call_id in doubtful
                      if c.call(call_id).call.name in self.verifiers]
        if doubtful and not verifiable:
            c.resume()  # ToolInDoubt before the claim: a stuck run gains no claim
        c.claim(self.owner)
        if self.claim_at_open or verifiable:
            c.flush()  # durable before any effect: of two resumers, one goes on
        if verifiable:
            verify_in_doubt(c, self.verifiers)
            c.flush()
        return c

    def forget(self, run_id: str | None = None) -> None:
        """Drop this process's copy of a run (all of them with None): the next call loads
        it from the store again (and claims it)."""
        with self._lock:
            if run_id is None:
                self._runs.clear()
            else:
                self._runs.pop(run_id, None)

