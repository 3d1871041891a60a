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

`tail_cases`: a new run's first write on a Session whose tail holds a call without an
output anywhere, with a store or without; `play_tail` expects the run refused, naming
the newest such call, until an operator has answered the calls, then completed (at once
on a tail without one). `play_runner_skip` shows that what the reference runner writes
when a handoff or a final output skips a call never blocks the next run.

`frontier_cases`: Sessions and batches made of few distinct items (long runs of one
item, repeating patterns), part of the batch landed; `play_frontier` checks the read
limit staged, the refusal of a history too short to tell the outcomes apart, and the
reconcile's finding against `read_limit_by_definition` and `finding_by_definition`
(DESIGN §2.3 written out by brute force), through the controller and the runner.

`session_id_cases`: a Session whose id is another run's or None handed to `publish`,
`settle`, ``reconcile`` or an attempt of the runner; `play_session_id` expects the
refusal before anything is recorded or read, then the run to complete on its own
Session.

Use them in your own property tests::

    @given(handoff_cases())
    def test_handoffs(case):
        play_handoff(case)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import tempfile
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from statemachine import events as ev
from statemachine.controller import RunController
from statemachine.errors import (
    ControlError,
    InvalidTransition,
    PublicationUnsettled,
    ReconcileRejected,
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
    publish,
    settle,
)
from statemachine.sqlite import SQLiteEventStore
from statemachine.stores import MemoryEventStore
from statemachine.testing.fakes import (
    FlakySession,
    InjectedWriteError,
    ListSession,
    ScriptedModel,
    Untouchable,
)
from statemachine.testing.invariants import check_log
from statemachine.testing.worlds import SimulatedCrash, run_sync
from statemachine.values import Append, Phase, RecoveryPolicy, Step, ToolCall

if TYPE_CHECKING:  # each strategy imports Hypothesis when it is built: the rest of the kit
    from hypothesis import strategies as st  # (the CLI's demo and explorer) runs without it

__all__ = ["AT_WORK", "CALL_PHASES", "FRONTIER_TOKENS", "INPUT_REFUSAL", "INPUT_RESTS",
           "INPUT_SOURCES", "REST_STEP", "RUNNER_SKIPS", "SESSION_ID_DOORS", "TAIL_TOKENS",
           "TAKES_INPUT", "CaseFailed", "FrontierCase", "HandoffCase", "InputCase",
           "SessionIdCase", "TailCase",
           "calls_without_output", "finding_by_definition", "frontier_cases",
           "handoff_cases", "input_cases", "play_frontier", "play_handoff", "play_input",
           "play_runner_skip", "play_session_id", "play_tail", "read_limit_by_definition",
           "session_id_cases", "snapshot", "tail_cases"]


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
    from hypothesis import strategies as hs
    return hs.builds(HandoffCase, hs.lists(hs.sampled_from(CALL_PHASES), max_size=5).map(tuple),
                     hs.booleans())


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
    from hypothesis import strategies as hs
    return hs.builds(InputCase, hs.sampled_from(INPUT_RESTS), hs.sampled_from(INPUT_SOURCES),
                     hs.booleans())


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


# ------------------------------------------------------------------ Session corners

TAIL_TOKENS = ("user", "call:X", "out:X", "call:Y", "out:Y")
"""The items a Session's tail is drawn from: a user message, and a ``function_call`` or a
``function_call_output`` of call ``X`` or ``Y``."""


def _item(token: str) -> JSON:
    if token == "user":
        return {"role": "user", "content": "earlier"}
    kind, call_id = token.split(":")
    if kind == "call":
        return {"type": "function_call", "call_id": call_id, "name": "tool", "arguments": {}}
    return {"type": "function_call_output", "call_id": call_id, "output": f"out {call_id}"}


def calls_without_output(items: Sequence[JSON]) -> list[tuple[int, JSON]]:
    """Each ``function_call`` of ``items`` that no ``function_call_output`` of the same
    call follows (position, call id), oldest first: what a run that did not settle left
    behind (the reference runner writes a call and its output in one batch, and never
    writes a call a handoff or a final output skipped)."""
    found = []
    for position, item in enumerate(items):
        if isinstance(item, dict) and item.get("type") == "function_call":
            call_id = item.get("call_id")
            later = items[position + 1:]
            if not any(isinstance(o, dict) and o.get("type") == "function_call_output"
                       and o.get("call_id") == call_id for o in later):
                found.append((position, call_id))
    return found


@attrs.frozen
class TailCase:
    """A new run's first write on a Session holding ``tokens`` (`TAIL_TOKENS`), with a
    store or without one."""

    tokens: tuple[str, ...]
    store: bool


def tail_cases() -> st.SearchStrategy[TailCase]:
    """Sessions of up to eight items (within the tail the runner reads)."""
    from hypothesis import strategies as hs
    return hs.builds(TailCase, hs.lists(hs.sampled_from(TAIL_TOKENS), max_size=8).map(tuple),
                     hs.booleans())


def play_tail(case: TailCase) -> RunController:
    """A new run greets on a Session holding the case's items: refused before the model or
    any write (`PublicationUnsettled` naming the newest call without an output after it,
    the Session untouched, nothing recorded but the run's start) when the tail holds such
    a call anywhere; else, and once an operator has written the missing outputs, it
    completes with its input and answer after the items. Returns the completed run."""
    items = [_item(t) for t in case.tokens]
    session = ListSession("tail-session", items)
    store = MemoryEventStore() if case.store else None
    model = ScriptedModel([ModelResponse(output="hi")])
    agent = Agent("greeter", model)
    options: dict[str, Any] = {"session": session, "store": store, "run_id": "greeter"}
    orphans = calls_without_output(items)
    repairs: list[JSON] = []
    if orphans:
        position, call_id = orphans[-1]
        try:
            run_sync(Runner.run(agent, "hello", **options))
        except PublicationUnsettled as refusal:
            where = ("the Session ends with call {} that has no output" if position ==
                     len(items) - 1 else
                     "the Session's last items hold call {} with no output after it")
            expected = f"{where.format(repr(call_id))}: settle or repair the run that wrote it"
            _expect(refusal.reason == expected, f"{case}: refused with {refusal.reason!r}, "
                    f"not {expected!r}")
        else:
            raise CaseFailed(f"{case}: a run on a Session whose tail holds call {call_id} "
                             "without an output was not refused")
        _expect(model.calls == 0 and session.items == items,
                f"{case}: the refused run called the model or wrote to the Session")
        if store is not None:
            kinds = [type(e).__name__ for e in store.load("greeter")]
            _expect(kinds == ["RunStarted"], f"{case}: the refused run recorded {kinds}")
        repairs = [{"type": "function_call_output", "call_id": i, "output": "repaired"}
                   for _, i in orphans]
        run_sync(session.add_items(repairs))  # an operator answers each call
    result = run_sync(Runner.run(agent, "hello", **options))
    c: RunController = result.controller
    expected_items = [*items, *repairs, {"role": "user", "content": "hello"},
                      {"role": "assistant", "content": "hi"}]
    _expect(c.step is Step.COMPLETED and session.items == expected_items,
            f"{case}: the run ended in {c.step} with the Session {session.items}")
    check_log(c.events)
    return c


RUNNER_SKIPS = ("handoff", "final_output", "rejected")
"""Runs of the reference runner that leave a call without an output of its own: one a
handoff skipped, one a final output (the first tool's) skipped, and one rejected (its
rejection is its output)."""


def play_runner_skip(kind: str) -> list[JSON]:
    """A run of the reference runner leaves a call behind as ``kind`` (`RUNNER_SKIPS`)
    says; the Session it wrote must hold no call without an output (the skipped call is
    not written at all), so a new run on that Session is not refused and completes.
    Returns the Session's items."""
    session = ListSession("skips")
    model = ScriptedModel([
        ModelResponse((("look", "look", {}), ("pay", "pay", {}))) if kind != "rejected"
        else ModelResponse((("pay", "pay", {}),)),
        ModelResponse(output="done")])
    tools = (FunctionTool("look", lambda: "looked"),
             FunctionTool("pay", lambda: "paid", needs_approval=True))
    agent = Agent("skipper", model, tools, tool_use_behavior=(
        "stop_on_first_tool" if kind == "final_output" else "run_llm_again"))
    first = run_sync(Runner.run(agent, "go", session=session))
    c = first.controller
    look: list[JSON] = [{"type": "function_call", "call_id": "look", "name": "look",
                         "arguments": {}},
                        {"type": "function_call_output", "call_id": "look",
                         "output": "looked"}]
    go: JSON = {"role": "user", "content": "go"}
    if kind == "final_output":  # look ran, its output is the answer: pay is skipped
        expected = [go, *look, {"role": "assistant", "content": "looked"}]
    else:
        if kind == "handoff":
            c.handoff("next")
        else:
            c.reject("pay", "declined", by="operator")
        run_sync(Runner.run(agent, session=session, controller=c))
        expected = ([go, *look, _DONE] if kind == "handoff" else
                    [go, {"type": "function_call", "call_id": "pay", "name": "pay",
                          "arguments": {}},
                     {"type": "function_call_output", "call_id": "pay",
                      "output": "declined"}, _DONE])
    _expect(c.step is Step.COMPLETED and session.items == expected,
            f"{kind}: the first run ended in {c.step} with {session.items}")
    _expect(calls_without_output(session.items) == [],
            f"{kind}: the runner left a call without an output in the Session")
    second = run_sync(Runner.run(Agent("next", ScriptedModel([ModelResponse(output="hi")])),
                                 "hello", session=session))
    _expect(second.controller.step is Step.COMPLETED,
            f"{kind}: a new run on the Session ended in {second.controller.step}")
    _expect(session.items == [*expected, {"role": "user", "content": "hello"},
                              {"role": "assistant", "content": "hi"}],
            f"{kind}: the new run's items are not after the first run's")
    return list(session.items)


# -------------------------------------------------- repeated items and read_limit

FRONTIER_TOKENS = ("x", "y", "a")
"""The items of a frontier case: user messages whose content is the token."""


def read_limit_by_definition(before: Sequence[str], batch: Sequence[str], *,
                             whole: bool) -> int | None:
    """DESIGN §2.3, word for word: the smallest n >= len(B) + 1 for which the n-item tails
    of P + B[:k], k = 0..len(B), are pairwise distinct, at most max(len(B) + 1,
    len(P) + len(B)), and never more than P's length unless P is the whole Session (a
    tail cut short by the Session's start is shorter, so it differs). None: no such n."""
    m, p = len(batch), len(before)
    top = max(m + 1, p + m) if whole else p
    for n in range(m + 1, top + 1):
        tails = {tuple([*before, *batch[:k]][-n:]) for k in range(m + 1)}
        if len(tails) == m + 1:
            return n
    return None


def finding_by_definition(before: Sequence[str], batch: Sequence[str],
                          history: Sequence[str], n: int) -> str:
    """What reconciling ``history`` must find (DESIGN §2.3) against a batch staged with
    read limit ``n``: ``append`` when its last n items are P's, ``acknowledge`` when they
    are those of P + B, else ``rejected`` (a partial write, or another history)."""
    tail = list(history[-n:])
    if tail == list(before[-n:]):
        return "append"
    if tail == [*before, *batch][-n:]:
        return "acknowledge"
    return "rejected"


@attrs.frozen
class FrontierCase:
    """A batch ``batch`` written onto a Session holding ``before`` (tokens of
    `FRONTIER_TOKENS`), of which the first ``landed`` items landed before the write
    failed; staged through the reference runner (``through="runner"``: it reads as much
    of the Session as it needs), or on the controller with the Session's last ``given``
    items (None: all of it, ``whole=True``)."""

    before: tuple[str, ...]
    batch: tuple[str, ...]
    landed: int
    given: int | None = None
    through: str = "controller"


def frontier_cases() -> st.SearchStrategy[FrontierCase]:
    """Sessions and batches of few distinct items (long runs of one item, patterns that
    repeat), any part of the batch landed, any history given."""
    from hypothesis import strategies as hs
    tokens = hs.sampled_from(FRONTIER_TOKENS)

    @hs.composite
    def cases(draw: st.DrawFn) -> FrontierCase:
        before = tuple(draw(hs.lists(tokens, max_size=10)))
        batch = tuple(draw(hs.lists(tokens, min_size=1, max_size=4)))
        landed = draw(hs.integers(0, len(batch)))
        through = draw(hs.sampled_from(("controller", "runner")))
        given = None if through == "runner" else draw(
            hs.none() | hs.integers(len(batch) + 1, max(len(batch) + 1, len(before))))
        return FrontierCase(before, batch, landed, given, through)

    return cases()


def _user(token: str) -> JSON:
    return {"role": "user", "content": token}


def play_frontier(case: FrontierCase) -> RunController:
    """Stage the batch, land its first ``landed`` items, fail the write, and reconcile from
    a reloaded run (or the next attempt of the runner): the read limit recorded, the
    refusal of a history too short to tell the outcomes apart, and the reconcile's finding
    must be those of `read_limit_by_definition` and `finding_by_definition`; a rejected
    reconcile records nothing, and once the Session is repaired the batch is written
    once and the run completes. Returns the completed run."""
    before, batch, m = list(case.before), list(case.batch), len(case.batch)
    items, landed = [_user(t) for t in batch], batch[:case.landed]
    session = ListSession("frontier", [_user(t) for t in before])
    model = ScriptedModel([ModelResponse(output="done")])
    agent = Agent("frontier", model)
    c = RunController.start(run_id="frontier", session_id="frontier")
    if case.through == "runner":
        limit = read_limit_by_definition(before, batch, whole=True)
        flaky = FlakySession(session, fail_on=1, outcome="partial", k=case.landed)
        try:
            run_sync(Runner.run(agent, items, session=flaky, controller=c))
        except InjectedWriteError:
            pass
        else:
            raise CaseFailed(f"{case}: the failing write did not fail the attempt")
    else:
        c.add_input(items)
        given = before if case.given is None else before[-case.given:]
        whole = case.given is None  # (a history shorter than the batch + 1 is whole too)
        limit = read_limit_by_definition(given, batch, whole=whole or len(given) < m + 1)
        history = [_user(t) for t in given]
        if limit is None:  # too few items given: refused, then the whole Session
            _refused_unchanged(c, lambda: c.stage_publication(items, history),
                               f"{case}: staging with too short a history")
            limit = read_limit_by_definition(before, batch, whole=True)
            history, whole = [_user(t) for t in before], True
        c.stage_publication(items, history, whole=whole)
        run_sync(session.add_items([_user(t) for t in landed]))
        c.publication_failed(InjectedWriteError("the write failed"))
        c = RunController.from_json(c.to_json())  # a later process reconciles
    envelope = c.envelope
    _expect(c.step is Step.UNSETTLED and envelope is not None
            and envelope.read_limit == limit,
            f"{case}: staged with read limit {getattr(envelope, 'read_limit', None)}, "
            f"not {limit}")
    assert limit is not None
    finding = finding_by_definition(before, batch, [*before, *landed], limit)
    if finding == "rejected":
        if case.through == "runner":
            _runner_refuses_reconcile(c, agent, session, case)
        else:
            _refused_unchanged(c, lambda: c.reconcile(run_sync(session.get_items(limit)),
                                                      "frontier"),
                               f"{case}: reconciling a partial write", ReconcileRejected)
        for _ in landed:  # the operator trims the Session back to P
            run_sync(session.pop_item())
        finding = "append"
    if case.through == "runner":
        run_sync(Runner.run(agent, session=session, controller=c))
    else:
        decision = c.reconcile(run_sync(session.get_items(limit)), "frontier")
        found = "append" if isinstance(decision, Append) else "acknowledge"
        _expect(found == finding, f"{case}: the reconcile found {found}, not {finding}")
        if isinstance(decision, Append):
            _expect(list(decision.items) == items, f"{case}: Append holds another batch")
            run_sync(session.add_items(list(decision.items)))
            c.publication_committed()
        c.begin_model_call()
        c.model_responded(output="done")
        c.accept_final_output("done")
        c.stage_publication([_DONE], run_sync(session.get_items()), whole=True)
        run_sync(session.add_items([_DONE]))
        c.publication_committed()
    expected = [*map(_user, before), *items, _DONE]
    _expect(c.step is Step.COMPLETED and session.items == expected,
            f"{case}: the run ended in {c.step} with {session.items}, not {expected}")
    check_log(c.events)
    return c


def _runner_refuses_reconcile(c: RunController, agent: Agent, session: ListSession,
                             case: FrontierCase) -> None:
    """The runner's next attempt must end with `ReconcileRejected`, recording nothing but
    its claim, the Session untouched."""
    before = (len(c.events), c.envelope, list(session.items))
    try:
        run_sync(Runner.run(agent, session=session, controller=c))
    except ReconcileRejected:
        pass
    else:
        raise CaseFailed(f"{case}: a partial write was not refused")
    claims = [type(e).__name__ for e in c.events[before[0]:]]
    _expect(claims == ["RunClaimed"] and (c.envelope, session.items) == before[1:],
            f"{case}: the refused reconcile recorded {claims} or touched the Session")


# ------------------------------------------------------- foreign and None Session ids

SESSION_ID_DOORS = ("publish", "settle", "reconcile", "runner")
"""Where a Session that is not the run's is handed in: `runner.publish` (it stages),
`runner.settle` and ``RunController.reconcile`` (with a ``session_id``) on an unsettled
run, and an attempt of the reference runner (``Runner.run(session=...)``) on an
unsettled run."""


@attrs.frozen
class SessionIdCase:
    """A run on Session ``"mine"`` (or without a Session: ``run_session=None``) handed a
    Session whose id is ``given`` (another id, or None) at ``door``
    (`SESSION_ID_DOORS`)."""

    door: str
    given: str | None
    run_session: str | None = "mine"


def session_id_cases() -> st.SearchStrategy[SessionIdCase]:
    """Every door with another id and with None; a run without a Session handed one."""
    from hypothesis import strategies as hs
    return hs.sampled_from([*(SessionIdCase(door, given) for door in SESSION_ID_DOORS
                              for given in ("theirs", None)),
                            SessionIdCase("publish", "theirs", None),
                            SessionIdCase("runner", "theirs", None)])


_SESSION_REFUSAL: dict[str, type[ControlError]] = {
    "publish": ReconcileRejected, "settle": ReconcileRejected,
    "reconcile": ReconcileRejected, "runner": ControlError}
"""DESIGN §6.4: publish and settle refuse another Session with `ReconcileRejected`, as
reconcile does a history of another Session; the runner refuses a Session that is not
the run's, or has no id, with `ControlError`."""


def play_session_id(case: SessionIdCase) -> RunController:
    """Hand the run a Session that is not its own at the case's door: refused with the
    error `_SESSION_REFUSAL` names before anything is recorded or written (the other
    Session is never read or written), then the run completes on its own Session, which
    holds the input once and the answer (a run without a Session: its private history
    holds the input). Returns the completed run."""
    mine = ListSession(case.run_session or "private", [])
    if case.run_session is None:  # a run without a Session publishes into a history
        mine.session_id = None  # type: ignore[assignment]  # whose id is None
    theirs: Any = Untouchable("")
    theirs.session_id = case.given
    model = ScriptedModel([ModelResponse(output="done")])
    agent = Agent("owner", model)
    c = RunController.start(run_id="owner", session_id=case.run_session)
    go = [_GO]
    if case.door in ("settle", "reconcile") or (case.door == "runner"
                                                and case.run_session is not None):
        # the run is left unsettled: its input's write failed before landing
        flaky = FlakySession(mine, fail_on=1, outcome="atomic")
        with contextlib.suppress(InjectedWriteError):
            run_sync(Runner.run(agent, go, session=flaky, controller=c))
        _expect(c.step is Step.UNSETTLED, f"{case}: the run is in {c.step}, not UNSETTLED")
        c = RunController.from_json(c.to_json())
    elif case.door == "publish":
        c.add_input(go)
    before = snapshot(c)
    try:
        if case.door == "publish":
            run_sync(publish(c, theirs, go))
        elif case.door == "settle":
            run_sync(settle(c, theirs))
        elif case.door == "reconcile":
            c.reconcile(run_sync(mine.get_items()), case.given)
        else:
            run_sync(Runner.run(agent, session=theirs, controller=c))
    except ControlError as refusal:
        _expect(type(refusal) is _SESSION_REFUSAL[case.door],
                f"{case}: refused with {type(refusal).__name__}, not "
                f"{_SESSION_REFUSAL[case.door].__name__}")
    else:
        raise CaseFailed(f"{case}: a Session that is not the run's was taken")
    _expect(snapshot(c) == before and mine.items == [] and model.calls == 0,
            f"{case}: the refusal recorded something, wrote, or called the model")
    result: RunResult
    if case.run_session is None:
        if case.door == "publish":
            run_sync(publish(c, mine, go))
            _expect(mine.items == go, f"{case}: the private history holds {mine.items}")
        result = run_sync(Runner.run(agent, None if case.door == "publish" else go,
                                     controller=c))
    else:
        if case.door == "publish":
            run_sync(publish(c, mine, go))
        result = run_sync(Runner.run(agent, session=mine, controller=c))
        _expect(mine.items == [_GO, _DONE], f"{case}: the Session holds {mine.items}")
    c = result.controller
    _expect(c.step is Step.COMPLETED and model.calls == 1,
            f"{case}: the run ended in {c.step} after {model.calls} model calls")
    check_log(c.events)
    return c
