"""Generators for the corners random walks seldom reach (issue 32), each played against
an expected outcome written from the case alone, never read from the controller, and
driven to the run's end (liveness): a corner that leaves a run stuck fails too.

`handoff_cases`: a handoff from every mix of call phases a reachable run can hold: calls
still undecided, approved and not started, rejected (their rejection not yet published),
run and published in an earlier batch, started and not completed (held in flight, or in
doubt once the run is reloaded), and completed with their result unpublished; the mix
may be empty (a handoff straight from ``RUN_AGAIN``) or hold nothing awaiting a decision
(every call decided, the run still in ``INTERRUPTION``), and the run may be reloaded
from its JSON just before each handoff. `play_handoff` plays one: a started or completed
call holds the run in ``TOOLS``, where the handoff is refused with nothing changed; the
call is then finished (or, in doubt, refused by ``resume`` and settled by an operator's
``resolve_in_doubt``) and published, and the handoff taken. After it every call not
started is skipped (it can be neither run nor decided any more), the rejections are the
next batch's results (a batch leaving one out, or naming one that has none, is refused),
and the new activation calls the model and completes.

`input_cases`: new input sent with the next attempt of the reference runner while the run
rests in each step it can rest in between attempts (`INPUT_RESTS`: RUN_AGAIN after a
failed model call, an interruption with a decision pending or every call decided, a
model call or a tool the process died in, a failed hook, a final output whose write
could not start, a handoff, a write unsettled or cancelled under FAIL_CLOSED, completed,
abandoned), the run found through its live controller, its JSON or a store (memory or a
SQLite file), streamed or not. `play_input` checks that the input is taken where DESIGN
allows it (RUN_AGAIN, INTERRUPTION) and appears once, right after the items before it;
that anywhere else the attempt is refused with the typed error before it claims the run
(the run, the store and the Session as they were, nothing run); then drives the run to
its end, the tool's own count of its runs at most one.

Use them in your own property tests::

    @given(handoff_cases())
    def test_handoffs(case):
        play_handoff(case)
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
from collections.abc import Sequence
from typing import Any

import attrs
from hypothesis import strategies as st

from statemachine import events as ev
from statemachine.controller import RunController
from statemachine.errors import (
    ControlError,
    InvalidTransition,
    PublicationUnsettled,
    RunNotResumable,
    ToolInDoubt,
)
from statemachine.payloads import JSON
from statemachine.runner import (
    Agent,
    FunctionTool,
    ModelResponse,
    RunHooks,
    Runner,
    RunResult,
)
from statemachine.sqlite import SQLiteEventStore
from statemachine.stores import MemoryEventStore
from statemachine.testing.fakes import (
    FlakySession,
    InjectedWriteError,
    ListSession,
)
from statemachine.testing.invariants import check_log
from statemachine.testing.worlds import SimulatedCrash, run_sync
from statemachine.values import Phase, RecoveryPolicy, Step, ToolCall

__all__ = ["AT_WORK", "CALL_PHASES", "INPUT_REFUSAL", "INPUT_RESTS", "INPUT_SOURCES",
           "REST_STEP", "TAKES_INPUT", "CaseFailed", "HandoffCase", "InputCase",
           "handoff_cases", "input_cases", "play_handoff", "play_input", "snapshot"]


class CaseFailed(AssertionError):
    """The run did not do what its case says it must (the message says what it did)."""

CALL_PHASES = ("undecided", "approved", "rejected", "published", "started", "completed")
"""What a call can be when a handoff is asked for: awaiting a decision; approved, not
started; rejected, its rejection unpublished; run, its result published in an earlier
batch; started and not completed (in flight, or in doubt after a reload); completed,
its result unpublished. The last two hold the run in ``TOOLS``, where the handoff is
refused until they are published."""

AT_WORK = ("started", "completed")
"""The phases that hold the run in ``TOOLS``: a handoff is refused while a call has one."""

AFTER_HANDOFF = {"undecided": Phase.SKIPPED, "approved": Phase.SKIPPED,
                 "rejected": Phase.REJECTED, "published": Phase.PUBLISHED,
                 "started": Phase.PUBLISHED, "completed": Phase.PUBLISHED}
"""The expected phase of each call after the handoff is taken."""


@attrs.frozen
class HandoffCase:
    phases: tuple[str, ...]
    """Each call's phase at the handoff (`CALL_PHASES`), in proposal order."""
    reload: bool
    """Reload the run from its JSON just before each handoff asked for (a started call
    is then in doubt)."""

    @property
    def ids(self) -> list[str]:
        return [f"c{i}" for i in range(len(self.phases))]

    def having(self, *phases: str) -> list[str]:
        """The calls with any of ``phases``, in proposal order."""
        return [i for i, p in zip(self.ids, self.phases, strict=True) if p in phases]

    @property
    def pending(self) -> list[str]:
        """The calls whose rejection the next batch must publish."""
        return self.having("rejected")


def handoff_cases() -> st.SearchStrategy[HandoffCase]:
    """Every mix of up to five calls' phases (`CALL_PHASES`), reloaded or not."""
    return st.builds(HandoffCase, st.lists(st.sampled_from(CALL_PHASES), max_size=5).map(tuple),
                     st.booleans())


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise CaseFailed(what)


def _refused(do: Any, what: str, error: type[ControlError] = InvalidTransition) -> None:
    """``do()`` must raise ``error`` (exactly that type)."""
    try:
        do()
    except ControlError as refusal:
        if type(refusal) is not error:
            raise CaseFailed(f"{what} was refused with {type(refusal).__name__}, not "
                             f"{error.__name__}") from refusal
        return
    raise CaseFailed(f"{what} was not refused")


def snapshot(c: RunController) -> tuple[Any, ...]:
    """Everything a refused command must leave exactly as it was: the log, the step, the
    envelope, the decisions, the guardrail results, the ledger, the attempt and the calls
    in flight."""
    return (c.events, c.step, c.envelope, c.pending_approvals, c.guardrail_results,
            c.calls, c.holds_attempt, c.in_flight, c.in_doubt())


def _refused_unchanged(c: RunController, do: Any, what: str,
                       error: type[ControlError] = InvalidTransition) -> None:
    before = snapshot(c)
    _refused(do, what, error)
    _expect(snapshot(c) == before, f"{what}, refused, changed the run")


def _output(call_id: str) -> JSON:
    return {"type": "function_call_output", "call_id": call_id, "output": f"ran {call_id}"}


def _rejection(call_id: str) -> JSON:
    return {"type": "function_call_output", "call_id": call_id, "output": f"no {call_id}"}


def _publish(c: RunController, history: list[JSON], items: Sequence[JSON],
             call_ids: Sequence[str]) -> None:
    c.stage_publication(list(items), history, call_ids=list(call_ids), whole=True)
    history.extend(items)
    c.publication_committed()


def play_handoff(case: HandoffCase) -> RunController:
    """Play ``case`` and check it at each stage; returns the completed run. `CaseFailed`
    (`InvariantViolation` from the log's check, or the controller's own refusal of a
    legal command) when the run does not do what the case says it must."""
    history: list[JSON] = []
    c = RunController.start(run_id="handoff", session_id="s")
    _publish(c, history, [{"role": "user", "content": "go"}], [])
    ids, at_work = case.ids, case.having(*AT_WORK)
    if ids:
        c.begin_model_call()
        c.model_responded([ToolCall(i, "tool", {"call": i}, needs_approval=p != "published")
                           for i, p in zip(ids, case.phases, strict=True)])
        ran = case.having("published")
        if ran:
            c.resume()  # calls needing no approval run while the others await a decision
            for call_id in ran:
                c.begin_tool(call_id)
                c.tool_completed(call_id, f"ran {call_id}")
            _publish(c, history, _results(ran), ran)
        if at_work:
            c = _hold_in_tools(c, case, history)
    _decide(c, case)
    _expect(c.step is (Step.INTERRUPTION if case.having("undecided", "approved", "rejected")
                       else Step.RUN_AGAIN), f"before the handoff the run is in {c.step}")
    if case.reload:
        c = RunController.from_json(c.to_json())
    c.handoff("next")
    _expect(c.step is Step.HANDOFF, f"the handoff left the run in {c.step}")
    for call_id, phase in zip(ids, case.phases, strict=True):
        found = c.phase(call_id)
        _expect(found is AFTER_HANDOFF[phase],
                f"call {call_id}, {phase} at the handoff, is {found} after it")
        if AFTER_HANDOFF[phase] is Phase.SKIPPED:
            _refused(lambda i=call_id: c.begin_tool(i), f"running skipped call {call_id}")
            _refused(lambda i=call_id: c.approve(i), f"approving skipped call {call_id}")
    pending = case.pending
    if pending:
        _refused(c.begin_model_call, "a model call with rejections unpublished")
        _refused(lambda: c.stage_publication([_rejection(i) for i in pending[1:]], history,
                                             call_ids=pending[1:], whole=True),
                 "a batch leaving a rejection out")
        _publish(c, history, [_rejection(i) for i in pending], pending)
    skipped = [i for i, p in zip(ids, case.phases, strict=True)
               if AFTER_HANDOFF[p] is Phase.SKIPPED]
    if skipped:
        _refused(lambda: c.stage_publication([_output(skipped[0])], history,
                                             call_ids=skipped[:1], whole=True),
                 "a batch publishing a skipped call")
    c.begin_model_call()  # the new activation
    c.model_responded(output="done")
    c.accept_final_output("done")
    _publish(c, history, [{"role": "assistant", "content": "done"}], [])
    _expect(c.step is Step.COMPLETED, f"the run ended in {c.step}, not COMPLETED")
    check_log(c.events)
    starts = [e.call_id for e in c.events if isinstance(e, ev.ToolStarted)]
    _expect(sorted(starts) == sorted(case.having("published", *AT_WORK)),
            f"the calls started were {starts}: each call run before the handoff, once")
    return c


def _results(call_ids: Sequence[str]) -> list[JSON]:
    """A batch publishing these calls' results: each call's item, then its output."""
    items: list[JSON] = []
    for call_id in call_ids:
        items += [{"type": "function_call", "call_id": call_id}, _output(call_id)]
    return items


def _hold_in_tools(c: RunController, case: HandoffCase, history: list[JSON]
                   ) -> RunController:
    """Start the case's started and completed calls (the run enters ``TOOLS``), ask for
    the handoff (refused there, nothing changed), then drive on: finish the call in
    flight, or, reloaded, see ``resume`` and ``begin_tool`` refuse the call in doubt and
    settle it as an operator would; publish them all. The calls the case leaves
    approved or rejected are decided after (decided before, they would hold the run in
    ``TOOLS`` too). Returns the controller the run goes on with."""
    at_work, started = case.having(*AT_WORK), case.having("started")
    for call_id in at_work:
        c.approve(call_id, fingerprint=c.fingerprint(call_id))
    c.resume()
    for call_id in at_work:
        c.begin_tool(call_id)
        if call_id not in started:
            c.tool_completed(call_id, f"ran {call_id}")
    if case.reload:
        c = RunController.from_json(c.to_json())
    _expect(c.step is Step.TOOLS, f"with calls at work the run is in {c.step}, not TOOLS")
    _refused_unchanged(c, lambda: c.handoff("next"), "a handoff with calls at work")
    for call_id in started:
        if case.reload:  # in doubt: never re-run, settled from outside
            _refused_unchanged(c, c.resume, f"resuming with {call_id} in doubt", ToolInDoubt)
            _refused_unchanged(c, lambda i=call_id: c.begin_tool(i),
                               f"running {call_id} in doubt", ToolInDoubt)
            c.resolve_in_doubt(call_id, f"ran {call_id}", by="operator")
        else:
            _expect(call_id in c.in_flight, f"call {call_id} is not held in flight")
            c.tool_completed(call_id, f"ran {call_id}")
    _publish(c, history, _results(at_work), at_work)
    return c


def _decide(c: RunController, case: HandoffCase) -> None:
    for call_id, phase in zip(case.ids, case.phases, strict=True):
        if phase == "approved":
            c.approve(call_id, fingerprint=c.fingerprint(call_id))
        elif phase == "rejected":
            c.reject(call_id, f"no {call_id}", fingerprint=c.fingerprint(call_id))


# ------------------------------------------------------- new input in every live step

INPUT_RESTS = ("run_again", "interruption", "decided", "awaiting_model", "tools",
               "in_doubt", "finalizing", "final_output", "handoff", "unsettled",
               "unsettled_landed", "fail_closed", "completed", "abandoned")
"""Where a run of the reference runner can rest between two attempts when new input
comes with the next one. The run is a payment: the model proposes ``pay`` (approval
needed), then answers "done". ``run_again``: the model call failed; ``interruption``:
``pay`` awaits its decision; ``decided``: ``pay`` approved, not resumed; ``awaiting_model``:
the process died inside the model call; ``tools``: ``pay`` ran and its end hook failed;
``in_doubt``: the process died inside ``pay``; ``finalizing``: the agent's end hook
failed; ``final_output``: the output was accepted and the Session's read for its write
failed; ``handoff``: an operator handed off at the interruption; ``unsettled``: the
results' write failed before landing (``unsettled_landed``: after); ``fail_closed``: under
FAIL_CLOSED that write was cancelled; ``completed``; ``abandoned`` by an operator at the
interruption."""

TAKES_INPUT = frozenset({"run_again", "interruption", "decided"})
"""The rests where DESIGN allows new input (RUN_AGAIN, INTERRUPTION, no envelope)."""

INPUT_REFUSAL: dict[str, type[ControlError]] = {
    "awaiting_model": InvalidTransition, "tools": InvalidTransition, "in_doubt": ToolInDoubt,
    "finalizing": InvalidTransition, "final_output": InvalidTransition,
    "handoff": InvalidTransition, "unsettled": PublicationUnsettled,
    "unsettled_landed": PublicationUnsettled, "fail_closed": RunNotResumable,
    "completed": RunNotResumable, "abandoned": RunNotResumable}
"""How the input is refused where it is not taken (before the attempt claims the run)."""

REST_STEP = {
    "run_again": Step.RUN_AGAIN, "interruption": Step.INTERRUPTION,
    "decided": Step.INTERRUPTION, "awaiting_model": Step.AWAITING_MODEL,
    "tools": Step.TOOLS, "in_doubt": Step.TOOLS, "finalizing": Step.FINALIZING,
    "final_output": Step.FINAL_OUTPUT, "handoff": Step.HANDOFF,
    "unsettled": Step.UNSETTLED, "unsettled_landed": Step.UNSETTLED,
    "fail_closed": Step.UNSETTLED, "completed": Step.COMPLETED,
    "abandoned": Step.TERMINAL_UNRECOVERABLE}
"""The step each rest is (what the case reaches before the input is sent)."""

INPUT_SOURCES = ("live", "json", "memory", "sqlite")
"""How the attempt bringing the input finds the run: the live controller
(``controller=``), its JSON (``state=``), or a store (``store=`` and ``run_id=``: a
memory store, or a SQLite file)."""


@attrs.frozen
class InputCase:
    rest: str
    """Where the run rests when the input comes (`INPUT_RESTS`)."""
    source: str
    """How the attempt finds the run (`INPUT_SOURCES`)."""
    streamed: bool
    """The attempt bringing the input runs with ``Runner.run_streamed``."""

    @property
    def taken(self) -> bool:
        return self.rest in TAKES_INPUT

    def expected_session(self) -> list[JSON]:
        """The Session's items once the run has ended, from the case alone: the first
        input, the new one where it was taken, the call and its output (the operator's,
        for a call settled in doubt) unless a handoff skipped it or the run ended before
        it ran, and the answer unless the run ended before it."""
        items: list[JSON] = [_GO, _MORE] if self.taken else [_GO]
        if self.rest in ("handoff", "abandoned"):
            return items + ([] if self.rest == "abandoned" else [_DONE])
        output = _SETTLED if self.rest == "in_doubt" else _PAID
        items += [_PAY_CALL, {"type": "function_call_output", "call_id": "pay",
                              "output": output}]
        return items if self.rest == "fail_closed" else [*items, _DONE]

    @property
    def end(self) -> Step:
        """Where the run ends, driven on without faults."""
        return {"fail_closed": Step.UNSETTLED,
                "abandoned": Step.TERMINAL_UNRECOVERABLE}.get(self.rest, Step.COMPLETED)

    @property
    def payments(self) -> int:
        """How often ``pay``'s body runs in the whole run: once, or never where a handoff
        skipped it or the run was abandoned before it ran (the one run that crashed
        inside it included: a call in doubt is never run again)."""
        return 0 if self.rest in ("handoff", "abandoned") else 1

    @property
    def model_calls(self) -> int:
        """How often the model is asked: each of its two answers once, plus the call
        that failed or died, minus the answer a run that ended early never asked for."""
        if self.rest in ("fail_closed", "abandoned"):
            return 1
        return 3 if self.rest in ("run_again", "awaiting_model") else 2


def input_cases() -> st.SearchStrategy[InputCase]:
    """Every rest, source and mode."""
    return st.builds(InputCase, st.sampled_from(INPUT_RESTS), st.sampled_from(INPUT_SOURCES),
                     st.booleans())


_GO: JSON = {"role": "user", "content": "go"}
_MORE: JSON = {"role": "user", "content": "more"}
_PAY_CALL: JSON = {"type": "function_call", "call_id": "pay", "name": "pay",
                   "arguments": {"amount": 7}}
_PAID = "paid 7"
_SETTLED = "paid 7 (settled by an operator)"
_DONE: JSON = {"role": "assistant", "content": "done"}


class _ModelDown(RuntimeError):
    """The model call failed (the runner records it and the run goes back to RUN_AGAIN)."""


class _HookFailed(RuntimeError):
    """A lifecycle hook raised."""


class _ReadFailed(ConnectionError):
    """The Session could not be read."""


class _PaymentModel:
    """Proposes ``pay``, then answers "done"; an answer is used up only when given.
    ``fail_next`` makes the next call raise, ``crash_next`` makes it die."""

    def __init__(self) -> None:
        self.calls = 0
        self.answered = 0
        self.fail_next = self.crash_next = False

    async def respond(self, history: list[JSON], agent: Agent) -> ModelResponse:
        self.calls += 1
        if self.crash_next:
            self.crash_next = False
            raise SimulatedCrash
        if self.fail_next:
            self.fail_next = False
            raise _ModelDown("the model is down")
        self.answered += 1
        if self.answered == 1:
            return ModelResponse((("pay", "pay", {"amount": 7}),))
        return ModelResponse(output="done")


class _FaultySession(ListSession):
    """A list Session whose next read fails once ``fail_next_read`` is set."""

    fail_next_read = False

    async def get_items(self, limit: int | None = None) -> list[JSON]:
        if self.fail_next_read:
            self.fail_next_read = False
            raise _ReadFailed("the Session could not be read")
        return await super().get_items(limit)


class _FaultyHooks(RunHooks):
    """Hooks that fail once where asked: ``tool_end``, ``agent_end``, or the agent's end
    arming a failed read of the Session (the read of the final output's write)."""

    def __init__(self, session: _FaultySession) -> None:
        self.session = session
        self.fail: str | None = None

    async def on_tool_end(self, agent: Agent, call: ToolCall, output: JSON) -> None:
        if self.fail == "tool_end":
            self.fail = None
            raise _HookFailed("tool_end")

    async def on_agent_end(self, agent: Agent, output: JSON) -> None:
        if self.fail == "agent_end":
            self.fail = None
            raise _HookFailed("agent_end")
        if self.fail == "read":
            self.fail = None
            self.session.fail_next_read = True


_RUN = "input-run"


class _InputWorld:
    """One input case's run: the Session, the counted tool, the model, the hooks, and
    where the run is kept (the live controller, or a store)."""

    def __init__(self, case: InputCase, folder: str) -> None:
        self.case = case
        self.session = _FaultySession("input-session")
        self.model = _PaymentModel()
        self.hooks = _FaultyHooks(self.session)
        self.payments = 0
        self.crash_in_pay = False
        self.store: Any = None
        if case.source == "memory":
            self.store = MemoryEventStore()
        elif case.source == "sqlite":
            self.store = SQLiteEventStore(os.path.join(folder, "events.db"))
        policy = (RecoveryPolicy.FAIL_CLOSED if case.rest == "fail_closed"
                  else RecoveryPolicy.RECONCILE)
        self.live = (None if self.store is not None else
                     RunController.start(run_id=_RUN, session_id="input-session",
                                         policy=policy))
        self.policy = policy

        def pay(amount: int) -> str:
            self.payments += 1
            if self.crash_in_pay:
                self.crash_in_pay = False
                raise SimulatedCrash
            return f"paid {amount}"

        self.agent = Agent("payer", self.model,
                           (FunctionTool("pay", pay, needs_approval=True),))

    def controller(self) -> RunController:
        """The run as it is now: the live controller, or loaded from the store."""
        if self.store is None:
            assert self.live is not None
            return self.live
        return RunController.load(self.store, _RUN)

    def attempt(self, input: str | None = None, *, expect: type[BaseException] | None = None,
                session: Any = None, source: str = "live", streamed: bool = False) -> None:
        """One attempt of the reference runner, which must end with ``expect`` (None: it
        returns). ``source`` ``json`` hands it the run's JSON instead of the controller."""
        options: dict[str, Any] = {"session": session or self.session, "hooks": self.hooks}
        if self.store is not None:
            options.update(store=self.store, run_id=_RUN, policy=self.policy)
        elif source == "json":
            options["state"] = json.dumps(self.controller().to_json())
        else:
            options["controller"] = self.live
        try:
            result = run_sync(_run_attempt(self.agent, streamed, {"input": input, **options}))
        except (Exception, SimulatedCrash, asyncio.CancelledError) as error:
            if type(error) is not expect:
                raise CaseFailed(f"{self.case}: an attempt ended with "
                                 f"{type(error).__name__}, not "
                                 f"{getattr(expect, '__name__', 'a return')}") from error
            if isinstance(error, SimulatedCrash) and self.live is not None:
                # the process died: only what was recorded survives
                self.live = RunController.from_json(self.live.to_json())
            return
        if expect is not None:
            raise CaseFailed(f"{self.case}: an attempt returned; it must raise "
                             f"{expect.__name__}")
        if self.store is None:
            self.live = result.controller  # (from state=, a controller of its own)

    def close(self) -> None:
        if isinstance(self.store, SQLiteEventStore):
            self.store.close()


async def _run_attempt(agent: Agent, streamed: bool, options: dict[str, Any]) -> RunResult:
    if not streamed:
        return await Runner.run(agent, **options)
    stream = Runner.run_streamed(agent, **options)
    async for _event in stream.stream_events():
        pass
    return stream.result


def _rest(w: _InputWorld, rest: str) -> None:
    """Bring the run to ``rest`` (`INPUT_RESTS`) with the first input, ``go``."""
    if rest == "run_again":
        w.model.fail_next = True
        w.attempt("go", expect=_ModelDown)
        return
    if rest == "awaiting_model":
        w.model.crash_next = True
        w.attempt("go", expect=SimulatedCrash)
        return
    w.attempt("go")  # pay awaits its decision
    c = w.controller()
    if rest == "handoff":
        c.handoff("next")
    elif rest == "abandoned":
        c.abandon("operator", by="operator")
    if rest in ("interruption", "handoff", "abandoned"):
        return
    c.approve("pay", fingerprint=c.fingerprint("pay"), by="operator")
    if rest == "decided":
        return
    if rest == "in_doubt":
        w.crash_in_pay = True
        w.attempt(expect=SimulatedCrash)
    elif rest in ("tools", "finalizing", "final_output"):
        w.hooks.fail = {"tools": "tool_end", "finalizing": "agent_end",
                        "final_output": "read"}[rest]
        w.attempt(expect=_ReadFailed if rest == "final_output" else _HookFailed)
    elif rest in ("unsettled", "unsettled_landed", "fail_closed"):
        outcome = {"unsettled": "atomic", "unsettled_landed": "commit_then_raise",
                   "fail_closed": "cancel"}[rest]
        flaky = FlakySession(w.session, fail_on=1, outcome=outcome)  # type: ignore[arg-type]
        w.attempt(session=flaky, expect=asyncio.CancelledError if rest == "fail_closed"
                  else InjectedWriteError)
    else:  # completed
        w.attempt()


def _drive_on(w: _InputWorld, case: InputCase) -> None:
    """After the input's attempt: decide, settle and resume as an operator would, until
    the run ends (every attempt must end as the case says)."""
    rest = case.rest
    if rest in ("fail_closed", "abandoned"):
        w.attempt(expect=RunNotResumable)  # nothing can go on: refused, doing nothing
        return
    if rest == "in_doubt":
        c = w.controller()
        _refused_unchanged(c, c.resume, "resuming with pay in doubt", ToolInDoubt)
        c.resolve_in_doubt("pay", _SETTLED, by="operator")
    if rest in ("run_again", "awaiting_model", "interruption"):
        if rest != "interruption":  # the model is asked (again), and proposes pay
            w.attempt()
        c = w.controller()
        _expect(c.step is Step.INTERRUPTION and c.pending_approvals == ("pay",),
                f"{case}: pay does not await its decision ({c.step})")
        c.approve("pay", fingerprint=c.fingerprint("pay"), by="operator")
    if rest not in ("decided", "completed"):
        w.attempt()


def play_input(case: InputCase) -> RunController:
    """Play ``case`` through the reference runner and check it; returns the run as it
    ended. New input is taken where the run rests in RUN_AGAIN or INTERRUPTION and
    appears once in the Session, right after the items before it; anywhere else the
    attempt bringing it is refused with the typed error before it claims the run: the
    run, the store and the Session as they were, no model call and no tool. Then the run
    is driven to its end (settling a call in doubt, reconciling a write), which must be
    where the case says, with the Session's items the case implies and ``pay`` run at
    most once. `CaseFailed` otherwise."""
    with tempfile.TemporaryDirectory() as folder:
        w = _InputWorld(case, folder)
        try:
            return _play_input(w, case)
        finally:
            w.close()


def _play_input(w: _InputWorld, case: InputCase) -> RunController:
    _rest(w, case.rest)
    c = w.controller()
    _expect(c.step is REST_STEP[case.rest], f"{case}: the run rests in {c.step}, not "
            f"{REST_STEP[case.rest]}")
    _expect((c.in_doubt() == ("pay",)) is (case.rest == "in_doubt"),
            f"{case}: the calls in doubt are {c.in_doubt()}")
    before = (c.to_json(), snapshot(c) if w.store is None else None, list(w.session.items),
              w.payments, w.model.calls)
    if case.taken:
        w.attempt("more", source=case.source, streamed=case.streamed)
        items = w.session.items
        _expect(items[:len(before[2]) + 1] == [*before[2], _MORE],
                f"{case}: the Session does not hold the input right after the items "
                f"before it: {items}")
    else:
        w.attempt("more", source=case.source, streamed=case.streamed,
                  expect=INPUT_REFUSAL[case.rest])
        c = w.controller()
        after = (c.to_json(), snapshot(c) if w.store is None else None,
                 list(w.session.items), w.payments, w.model.calls)
        _expect(after == before, f"{case}: the refused input changed the run, the Session "
                "or ran something")
    _drive_on(w, case)
    c = w.controller()
    _expect(c.step is case.end, f"{case}: the run ended in {c.step}, not {case.end}")
    items = w.session.items
    _expect(items == case.expected_session(),
            f"{case}: the Session holds {items}, not {case.expected_session()}")
    _expect(w.payments == case.payments,
            f"{case}: pay ran {w.payments} times, not {case.payments}")
    _expect(w.model.calls == case.model_calls,
            f"{case}: the model was asked {w.model.calls} times, not {case.model_calls}")
    check_log(c.events)
    return c
