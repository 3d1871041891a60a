"""Explorable worlds: systems under test with a finite menu of actions and a check of
every invariant.

A `World` is a runner embedding a controller, its Session and its effect counters, with
the `actions` that may happen next (approve, resume with an injected fault, reload,
abandon...) and a `check` of every invariant. `ReferenceWorld` wraps this project's
reference runner and `RemoteWorld` its remote executor; write your own for your runner
and hand it to `explore` and `world_state_machine`.
"""
from __future__ import annotations

import asyncio
import copy
import json
from collections import Counter
from typing import Any

import attrs

from statemachine import events as ev
from statemachine.controller import RunController
from statemachine.errors import ControlError, RunNotResumable
from statemachine.payloads import JSON
from statemachine.runner import (
    ALLOW,
    Agent,
    FunctionTool,
    MaxTurnsExceeded,
    ModelResponse,
    OutputGuardrail,
    Runner,
    ToolGuardrail,
    Verdict,
    reject_content,
)
from statemachine.testing.fakes import (
    Counters,
    CountingHooks,
    FlakySession,
    InjectedWriteError,
    ListSession,
    counted_tool,
)
from statemachine.testing.invariants import check_log, fail, settled
from statemachine.values import TERMINAL_STEPS, Phase, RecoveryPolicy, Resolution, Step, ToolCall

Action = tuple[str, ...]

_LOOPS: list[asyncio.AbstractEventLoop] = []


def run_sync(coroutine: Any) -> Any:
    """Run ``coroutine`` to its end on one event loop kept for the process (a new loop
    per call costs more than a world's step)."""
    if not _LOOPS or _LOOPS[0].is_closed():
        _LOOPS[:] = [asyncio.new_event_loop()]
    return _LOOPS[0].run_until_complete(coroutine)


# ------------------------------------------------------------------------ worlds


def untimed(doc: dict[str, Any]) -> dict[str, Any]:
    """A run's document without its events' ``at``: the state a world reaches, compared
    across runs recorded at other moments (the explorer's key, I8's twins)."""
    return {**doc, "events": [{k: v for k, v in e.items() if k != "at"}
                              for e in doc["events"]]}


def copy_controller(c: RunController) -> RunController:
    """A copy of a live controller (its attempt and calls in flight included). Its
    recorded events are immutable, so the copy shares them instead of walking them."""
    memo: dict[int, Any] = {id(event): event for event in getattr(c, "_events", ())}
    return copy.deepcopy(c, memo)


def ledger(c: RunController) -> tuple[tuple[Any, ...], ...]:
    """The durable part of a run's ledger (what a reload must reproduce)."""
    return tuple((v.call, v.phase, v.starts, v.result) for v in c.calls)


class World:
    """A system under test. Subclass: `actions`, `apply`, `check`, `key`."""

    def actions(self) -> list[Action]:
        raise NotImplementedError

    def apply(self, action: Action) -> None:
        raise NotImplementedError

    def check(self) -> None:
        """Raise `InvariantViolation` if any invariant fails in this state."""
        raise NotImplementedError

    def key(self) -> str:
        """Equal for states that behave the same from here on (for deduplication)."""
        raise NotImplementedError

    def clone(self) -> World:
        return copy.deepcopy(self)

    def finish(self) -> None:
        """Liveness: drive the world on without faults to where it must end, and check
        it ends there (raise `InvariantViolation` if not). By default nothing."""


class SimulatedCrash(BaseException):
    """The process died here (raised inside a tool, after its effect)."""


FAULTS = ("none", "atomic", "commit_then_raise", "partial", "cancel", "crash_in_tool",
          "take_over")
"""How a resumed attempt may go wrong: its first Session write fails (four outcomes), the
process dies inside the tool, or the attempt takes over a foreign publication attempt."""


class _WorldModel:
    """Turn 0 proposes charge (approval-gated, guarded) and lookup (idempotent); turn 1
    answers."""

    def __init__(self, counters: Counters) -> None:
        self.counters = counters

    async def respond(self, history: list[JSON], agent: Agent) -> ModelResponse:
        self.counters.tools["model"] += 1
        if not any(isinstance(i, dict) and i.get("type") == "function_call" for i in history):
            return ModelResponse((("charge", "charge", {"x": 7}),
                                  ("lookup", "lookup", {"q": "rate"})))
        return ModelResponse(output="charged 7")


class ReferenceWorld(World):
    """The reference runner, a memory Session and effect counters."""

    def __init__(self, policy: RecoveryPolicy = RecoveryPolicy.RECONCILE, *,
                 check_parity: bool = True) -> None:
        self.policy = policy
        self.check_parity = check_parity
        self.session = ListSession("world")
        self.counters = Counters()
        self.controller: RunController | None = None
        self.checked: tuple[int, int, str, int] | None = None

    def clone(self) -> World:
        # the live controller (its attempt and calls in flight included) is copied whole;
        # the rest is plain data, copied without walking it generically
        twin = copy.copy(self)
        twin.session = ListSession(self.session.session_id, self.session.items)
        twin.counters = Counters()
        twin.counters.tools.update(self.counters.tools)
        twin.counters.guardrails.update(self.counters.guardrails)
        twin.counters.hooks.update(self.counters.hooks)
        twin.controller = None if self.controller is None else copy_controller(
            self.controller)
        return twin

    # the agent is rebuilt for every attempt, so a clone's tools count into the clone
    def _agent(self, crash_in_tool: bool) -> Agent:
        counters = self.counters

        def crash() -> None:
            if crash_in_tool:
                raise SimulatedCrash

        return Agent("world", _WorldModel(counters), (
            counted_tool(counters, "charge", lambda x: f"charged {x}", needs_approval=True,
                         guarded=True, after_effect=crash),
            counted_tool(counters, "lookup", lambda q: "rate 1.0", idempotent=True)),
            max_turns=3)

    def actions(self) -> list[Action]:
        c = self.controller
        if c is None:
            return [("run", "none"), ("run", "atomic"), ("run", "commit_then_raise")]
        acts: list[Action] = []
        for call_id in c.pending_approvals:
            acts += [("approve", call_id), ("reject", call_id)]
        if c.step in TERMINAL_STEPS:
            return [*acts, ("run", "none"), ("reload",)]
        acts += [("run", fault) for fault in FAULTS]
        acts += [("reload",), ("abandon",)]
        acts += [(name, call_id) for call_id in c.in_doubt()
                 for name in ("resolve", "resolve_not_executed")]
        if c.step is Step.UNSETTLED and self.session_items() != self.expected_items():
            acts.append(("repair",))
        return acts

    def session_items(self) -> list[JSON]:
        return self.session.items

    def expected_items(self) -> list[JSON]:
        c = self.controller
        return settled(c.events)[0] if c else []

    def apply(self, action: Action) -> None:
        name = action[0]
        if name == "run":
            fresh = self.controller is None
            if fresh:
                self.controller = RunController.start(
                    run_id="world", session_id=self.session.session_id, policy=self.policy,
                    max_turns=3)
            if self.check_parity:
                twin = self.clone()
                assert isinstance(twin, ReferenceWorld)
                twin._attempt(action[1], streamed=True, fresh=fresh)
                self._attempt(action[1], streamed=False, fresh=fresh)
                if (self.durable(), self.counters_view()) != (twin.durable(),
                                                              twin.counters_view()):
                    fail("I8", f"run and run_streamed left different state after {action}")
            else:
                self._attempt(action[1], streamed=False, fresh=fresh)
            return
        c = self.controller
        assert c is not None
        if name == "reload":
            self.controller = RunController.from_json(json.dumps(c.to_json()))
            return
        before = (c.events, c.step, c.envelope, c.pending_approvals, c.guardrail_results)
        try:
            if name == "approve":
                c.approve(action[1])
            elif name == "reject":
                c.reject(action[1], "declined")
            elif name == "abandon":
                c.abandon("operator")
            elif name == "resolve":
                c.resolve_in_doubt(action[1], "resolved by operator")
            elif name == "resolve_not_executed":
                c.resolve_in_doubt(action[1], outcome=Resolution.NOT_EXECUTED)
            elif name == "repair":
                run_sync(self._repair())
        except ControlError:
            after = (c.events, c.step, c.envelope, c.pending_approvals, c.guardrail_results)
            if after != before:
                fail("I2", f"a refused {name} changed the run")

    async def _repair(self) -> None:
        await self.session.clear_session()
        await self.session.add_items(self.expected_items())

    def _attempt(self, fault: str, *, streamed: bool, fresh: bool) -> None:
        outcome = {"atomic": "atomic", "commit_then_raise": "commit_then_raise",
                   "partial": "partial", "cancel": "cancel"}.get(fault)
        session = (FlakySession(self.session, fail_on=1, outcome=outcome)  # type: ignore[arg-type]
                   if outcome else self.session)
        agent = self._agent(crash_in_tool=fault == "crash_in_tool")
        options: dict[str, Any] = {"session": session, "hooks": CountingHooks(self.counters),
                                   "take_over": fault == "take_over"}
        c = self.controller
        assert c is not None
        options["controller"] = c
        if fresh:
            options["input"] = "charge me 7"
        before = self._effects()
        try:
            run_sync(_attempt(agent, streamed, options))
        except RunNotResumable:
            if self._effects() != before:
                fail("I9", "a refused resume did work")
        except SimulatedCrash:
            # the process died: only what was recorded survives
            self.controller = RunController.from_json(json.dumps(c.to_json()))
        except (InjectedWriteError, asyncio.CancelledError, ControlError, MaxTurnsExceeded):
            pass  # the live controller keeps what the attempt recorded

    def _effects(self) -> tuple[Any, ...]:
        """What work changes (cheaper than `durable`): the log's version, the Session and
        the effect counters."""
        c = self.controller
        return (c.version if c else None, repr(self.session.items), self.counters_view())

    def durable(self) -> tuple[Any, ...]:
        c = self.controller
        return (json.dumps(untimed(c.to_json()), sort_keys=True) if c else None,
                json.dumps(self.session_items(), sort_keys=True))

    def counters_view(self) -> tuple[Any, ...]:
        n = self.counters
        return (sorted(n.tools.items()), sorted(n.guardrails.items()), sorted(n.hooks.items()))

    def key(self) -> str:
        c = self.controller
        extras = (c.holds_attempt, sorted(c.in_flight)) if c else None
        return json.dumps([self.durable(), self.counters_view(), extras], sort_keys=True,
                          default=str)

    def check(self) -> None:
        c = self.controller
        if c is None:
            return
        # the log and the counters change together: a step that recorded nothing, wrote
        # nothing, ran nothing and kept its controller leaves every check below as it was
        n = self.counters
        stamp = (id(c), c.version, repr(self.session.items),
                 n.tools.total() + n.guardrails.total() + n.hooks.total())
        if stamp == self.checked:
            return
        events = c.events
        check_log(events)
        doc = c.to_json()
        again = RunController.from_json(doc)
        if ledger(again) != ledger(c) or again.step is not c.step or again.to_json() != doc:
            fail("I10", "a JSON round trip changed the run")
        self._check_effects(c, events)
        self.checked = stamp

    def _check_effects(self, c: RunController, events: tuple[ev.Event, ...]) -> None:
        n = self.counters
        # the operator may say a charge that crashed did not happen (the world's crash
        # comes after the effect, so that is a mistake the library must still bound):
        # each such word lets it run once more, never more
        given_back = sum(1 for e in events if isinstance(e, ev.InDoubtResolved)
                         and e.call_id == "charge" and e.outcome is Resolution.NOT_EXECUTED)
        if n.tools["charge"] > 1 + given_back:
            fail("I1", f"charge ran {n.tools['charge']} times")
        lookups = sum(1 for e in events if isinstance(e, ev.ToolStarted)
                      and e.call_id == "lookup")
        if n.tools["lookup"] > lookups:
            fail("I11", "lookup ran without a recorded start")
        recorded = Counter(e.result.name for e in events
                           if isinstance(e, ev.GuardrailEvaluated))
        if dict(n.guardrails) != {k: v for k, v in recorded.items() if v}:
            fail("I1", f"guardrails ran {dict(n.guardrails)}, recorded {dict(recorded)}")
        hooks = Counter(e.hook + (f":{e.call_id}" if e.call_id else "") for e in events
                        if isinstance(e, ev.HookRan))
        if dict(n.hooks) != dict(hooks):
            fail("I1", f"hooks ran {dict(n.hooks)}, recorded {dict(hooks)}")
        items_from_log, from_log = settled(events)
        if list(c.guardrail_results) != from_log:
            fail("I4", f"{len(c.guardrail_results)} guardrail results published, the log "
                  f"settled {len(from_log)}")
        self._check_session(c, events, items_from_log)
        if c.step is Step.UNSETTLED and c.envelope is not None and (
                c.pending_approvals != c.envelope.interruptions):
            fail("I5", "the remaining interruptions changed while unsettled")

    def _check_session(self, c: RunController, events: tuple[ev.Event, ...],
                       expected: list[JSON]) -> None:
        items = self.session_items()
        if items[: len(expected)] != expected:
            fail("I3", "the Session does not hold exactly the settled batches")
        extra = items[len(expected):]
        open_batch = list(c.envelope.items) if c.envelope is not None else []
        if c.step is Step.UNSETTLED or c.step is Step.TERMINAL_UNRECOVERABLE:
            last = [e for e in events if isinstance(e, ev.PublicationStaged)]
            open_batch = open_batch or (list(last[-1].items) if last else [])
            if extra and extra != open_batch[: len(extra)]:
                fail("I3", "the Session holds items outside any publication")
        elif extra:
            fail("I3", f"the Session holds {len(extra)} items no settled batch published")
        for item in items:
            if isinstance(item, dict) and item.get("type") == "function_call_output":
                call_id = item.get("call_id")
                if (type(call_id) is str and c.phase(call_id) is not None
                        and c.call(call_id).result != item.get("output")):
                    fail("I12", f"call {item.get('call_id')!r} was published with another "
                          "result than the one it computed")


async def _attempt(agent: Agent, streamed: bool, options: dict[str, Any]) -> Any:
    if not streamed:
        return await Runner.run(agent, **options)
    stream = Runner.run_streamed(agent, **options)
    async for _event in stream.stream_events():
        pass
    return stream.result


# ------------------------------------------------------------ the remote world


class RemoteWorld(World):
    """The remote tool executor against a `FakeRemote`: calls arrive, posts fail,
    streams drop, tools crash, and the client process restarts (losing what it held in
    memory)."""

    MAX_CALLS = 3

    def __init__(self) -> None:
        from statemachine.testing.fakes import FakeRemote

        self.remote = FakeRemote()
        self.executions: Counter[str] = Counter()
        self.controller = RunController.start(run_id="remote", session_id=None)
        self.emitted = 0
        self.crash_next_tool = False
        self.yielded: list[Any] = []

    def actions(self) -> list[Action]:
        acts: list[Action] = [("connect",), ("restart",), ("crash_next_tool",)]
        if self.emitted < self.MAX_CALLS:
            acts.append(("emit",))
        acts += [("fail_next_post", outcome)
                 for outcome in ("transient", "permanent", "commit_then_raise")]
        acts += [("disconnect_after", str(n)) for n in (0, 1)]
        if self.controller.in_doubt():
            acts.append(("resolve",))
        return acts

    def apply(self, action: Action) -> None:
        from statemachine.runner import RemoteEvent

        name = action[0]
        if name == "emit":
            call_id = f"toolu_{self.emitted}"
            self.emitted += 1
            self.remote.pending.append(RemoteEvent("tool_use", call_id, "bash", {"n": call_id}))
        elif name == "fail_next_post":
            for call_id in (f"toolu_{i}" for i in range(self.emitted)):
                outcomes = self.remote.post_outcomes.setdefault(call_id, [])
                outcomes[self.remote.posts[call_id]:] = [action[1]]  # type: ignore[list-item]
        elif name == "disconnect_after":
            self.remote.disconnect_after = [0] * self.remote.connections + [int(action[1])]
        elif name == "crash_next_tool":
            self.crash_next_tool = True
        elif name == "restart":
            self.controller = RunController.from_json(json.dumps(self.controller.to_json()))
        elif name == "resolve":
            self.controller.resolve_in_doubt(self.controller.in_doubt()[0], "resolved")
        elif name == "connect":
            run_sync(self._connect())

    async def _connect(self) -> None:
        from contextlib import aclosing

        from statemachine.errors import ToolInDoubt
        from statemachine.runner import RemoteToolExecutor, RemoteUnavailable

        executions = self.executions
        world = self

        def bash(n: str) -> str:
            executions[n] += 1
            if world.crash_next_tool:
                world.crash_next_tool = False
                raise SimulatedCrash
            return f"ran {n}"

        executor = RemoteToolExecutor(self.remote, [FunctionTool("bash", bash)],
                                      controller=self.controller, retries=1, backoff=0,
                                      max_reconnects=3)
        try:
            async with aclosing(executor.run()) as stream:
                async for dispatched in stream:
                    self.yielded.append(dispatched)
        except (RemoteUnavailable, ToolInDoubt):
            pass
        except SimulatedCrash:  # the client process died: only what was recorded survives
            self.controller = RunController.from_json(json.dumps(self.controller.to_json()))
        if asyncio.all_tasks() != {asyncio.current_task()}:
            fail("I1", "the executor left a task running")

    def key(self) -> str:
        r = self.remote
        return json.dumps([json.dumps(untimed(self.controller.to_json()), sort_keys=True),
                           [attrs.asdict(e) for e in r.history],
                           [attrs.asdict(e) for e in r.pending], sorted(r.posts.items()),
                           sorted(r.post_outcomes.items()), r.disconnect_after[r.connections:],
                           sorted(self.executions.items()), self.crash_next_tool],
                          sort_keys=True)

    def check(self) -> None:
        c = self.controller
        check_log(c.events)
        held = self.remote.results()
        for call_id, results in held.items():
            if len(results) > 1:
                fail("I3", f"the remote holds {len(results)} results for {call_id!r}")
        for n, count in self.executions.items():
            if count > 1:
                fail("I1", f"tool call {n!r} executed {count} times")
        for view in c.calls:
            call_id = view.call.call_id
            if view.phase is Phase.PUBLISHED and call_id not in held:
                fail("I12", f"{call_id!r} is marked posted but the remote lacks it")
            if call_id in held and view.result is not None and held[call_id] != [
                    view.result]:
                fail("I12", f"{call_id!r} was posted with another result than it computed")
        if self.remote.open_streams:
            fail("I1", "a stream was left open")


# ------------------------------------------------------------- the scripted world

TOOL_KINDS = ("plain", "approve", "idem", "fails", "blocked", "redacted")
"""The tools a scripted model may call: ``plain`` (no guardrails), ``approve`` (needs
approval; an input and an output guardrail that allow), ``idem`` (idempotent; an input
guardrail that allows), ``fails`` (raises; an output guardrail that allows), ``blocked``
(its input guardrail rejects: the tool never runs) and ``redacted`` (its output guardrail
rejects: the output is replaced)."""

_GUARDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "plain": ((), ()), "approve": (("approve_in",), ("approve_out",)),
    "idem": (("idem_in",), ()), "fails": ((), ("fails_out",)),
    "blocked": (("blocked_in",), ()), "redacted": ((), ("redacted_out",)),
}
_REJECTING = {"blocked_in": "blocked by guardrail", "redacted_out": "redacted"}
_IDS = "zyxwvu"
"""Call ids sort against proposal order, so an order taken from the ids shows."""

SCRIPT_FAULTS = ("none", "atomic", "commit_then_raise", "cancel", "partial",
                 "crash_in_tool")
"""What may go wrong in one attempt of a scripted world: its first Session write fails
(four outcomes), or the process dies inside the first tool body it runs."""


@attrs.frozen
class Turn:
    """One model response: tool calls (kinds from `TOOL_KINDS`, in proposal order), or,
    with none, the final output. ``approve[i]`` is the human decision on the i-th call
    needing approval; with ``handoff`` the operator hands off at this turn's interruption
    instead of deciding what is left."""

    calls: tuple[str, ...] = ()
    approve: tuple[bool, ...] = ()
    handoff: bool = False


@attrs.frozen
class Script:
    """What a scripted world's model answers and its humans decide: ``turns`` (the last
    is the final output), ``trip`` (the output guardrail rejects the final output),
    ``max_turns`` (the agent's limit), the recovery ``policy``, and ``streamed``
    (every attempt runs with ``Runner.run_streamed``)."""

    turns: tuple[Turn, ...]
    trip: bool = False
    max_turns: int = 10
    policy: RecoveryPolicy = RecoveryPolicy.RECONCILE
    streamed: bool = False

    @property
    def final_output(self) -> str:
        return f"final after {len(self.turns)} turns"

    def expected_end(self) -> str:
        """How the run ends when nothing goes wrong: ``completed``, or the typed error
        (every turn is one model response; a handoff skips none)."""
        if len(self.turns) > self.max_turns:
            return "MaxTurnsExceeded"
        return "OutputGuardrailTripwire" if self.trip else "completed"


def call_id(turn: int, index: int) -> str:
    return f"t{turn}-{_IDS[index]}"


class _Stop(Exception):
    """The oracle's attempt ends here, with the named error (None: an interruption)."""

    def __init__(self, error: str | None) -> None:
        super().__init__(error)
        self.error = error


@attrs.define
class _Call:
    call_id: str
    kind: str
    state: str  # undecided, approved, started, done, rejected, published, skipped
    result: JSON = None
    guarded_in: bool = False  # its input guardrails ran (recorded)
    hooked: bool = False  # its tool_start hook ran (recorded)


class Oracle:
    """What must happen in a scripted world, computed from the script, the decisions and
    the faults alone (never from the run's log): the tool bodies, guardrails and hooks
    run, the Session's items in order, the pending approvals, the error each attempt
    ends with, and where the run ends (``ended``: ``completed`` or the typed error every
    later attempt raises)."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.session: list[JSON] = []
        self.tools: Counter[str] = Counter()
        self.guardrails: Counter[str] = Counter()
        self.hooks: Counter[str] = Counter()
        self.calls: list[_Call] = []
        self.responses = 0
        self.activation = False  # agent_start ran for the current activation
        self.input_pending = True
        self.unsettled: tuple[list[JSON], list[JSON], bool] | None = None
        self.ended: str | None = None
        self.final_step = Step.COMPLETED
        self.unrecoverable: str | None = None  # the fault that made the run unrecoverable
        self.handed_off = False

    # what the world's checks read
    def pending(self) -> list[str]:
        return [c.call_id for c in self.calls if c.state == "undecided"]

    def _turn(self) -> Turn:
        return self.script.turns[self.responses - 1]

    def decide_allowed(self) -> bool:
        return self.unsettled is None and not any(c.state == "started" for c in self.calls)

    def decide(self) -> tuple[str, ...]:
        """The operator's next move at an interruption, as the script says; ``refused``
        while a publication is unsettled or a call is started and not completed (an
        idempotent call a dead process started: the run is in its tools, and decisions
        wait for the next interruption)."""
        if not self.decide_allowed():
            return ("refused",)
        pending = [c for c in self.calls if c.state == "undecided"]
        if self._turn().handoff and not self.handed_off:
            self.handed_off = True
            self.activation = False
            for call in self.calls:
                if call.state in ("undecided", "approved"):
                    call.state = "skipped"
            return ("handoff",)
        call = pending[0]
        index = [c.call_id for c in self.calls if c.kind == "approve"].index(call.call_id)
        if self._turn().approve[index]:
            call.state = "approved"
            return ("approve", call.call_id)
        call.state, call.result = "rejected", f"declined {call.call_id}"
        return ("reject", call.call_id)

    def attempt(self, fault: str) -> str | None:
        """One attempt with ``fault``: update what must have happened, and return the
        error the attempt must end with (None: it returns)."""
        if self.ended is not None:
            return "RunNotResumable" if self.ended in ("completed", "MaxTurnsExceeded",
                                                       "OutputGuardrailTripwire"
                                                       ) else self.ended
        try:
            self._run_attempt([fault])
        except _Stop as stop:
            return stop.error
        return None

    def _end(self, error: str, attempt_error: str | None = None, *,
             fault: str | None = None) -> None:
        self.ended = error
        if fault is not None:
            self.unrecoverable = fault
        raise _Stop(attempt_error or error)

    def _write(self, fault: list[str], batch: list[JSON], completes: bool) -> None:
        failure = fault[0] if fault[0] in ("atomic", "commit_then_raise", "cancel",
                                           "partial") else None
        if fault[0] != "crash_in_tool":
            fault[0] = "none"  # only the attempt's first write fails
        if failure is None:
            self.session += batch
            if completes:
                self.ended = "completed"
                raise _Stop(None)
            return
        landed = {"atomic": [], "partial": batch[:1]}.get(failure, batch)
        self.session += landed
        raised = "CancelledError" if failure == "cancel" else "InjectedWriteError"
        if self.script.policy is RecoveryPolicy.FAIL_CLOSED:
            # a reported failure ends the run; an unreported one leaves it unsettled, and
            # the gate refuses every resume of an unsettled fail-closed run
            self.final_step = (Step.UNSETTLED if failure == "cancel"
                               else Step.TERMINAL_UNRECOVERABLE)
            self._end("RunNotResumable", raised, fault=failure)
        self.unsettled = (batch, landed, completes)
        raise _Stop(raised)

    def _settle(self, fault: list[str]) -> None:
        assert self.unsettled is not None
        batch, landed, completes = self.unsettled
        if landed and landed != batch:  # P + B[:k]: nothing can tell what to write
            self.final_step = Step.UNSETTLED
            self._end("ReconcileRejected", fault="partial")
        self.unsettled = None
        if not landed:
            self._write(fault, batch, completes)
        elif completes:
            self.ended = "completed"
            raise _Stop(None)

    def _run_attempt(self, fault: list[str]) -> None:
        """One attempt, as the script says it goes: settle an unsettled write, write the
        input, then run the runnable calls, publish and call the model, until it stops
        (`_Stop`: an interruption, the end, or a fault)."""
        if self.unsettled is not None:
            self._settle(fault)
        if self.input_pending:
            self.input_pending = False
            self._write(fault, [{"role": "user", "content": "go"}], False)
        while True:
            for call in self.calls:
                if call.state == "approved" or (call.state == "started"
                                               and call.kind == "idem"):
                    self._run_call(call, fault)
            batch: list[JSON] = []
            # a rejection is published with the next batch of results, or once no
            # decision remains (while one does, the run waits for it)
            waiting = any(c.state == "undecided" for c in self.calls) and not any(
                c.state == "done" for c in self.calls)
            for call in [] if waiting else self.calls:
                if call.state in ("done", "rejected"):
                    batch += [{"type": "function_call", "call_id": call.call_id,
                               "name": call.kind, "arguments": {"n": call.call_id}},
                              {"type": "function_call_output", "call_id": call.call_id,
                               "output": call.result}]
                    call.state = "published"
            if batch:
                self._write(fault, batch, False)
                continue
            if any(c.state == "undecided" for c in self.calls):
                raise _Stop(None)  # an interruption: the attempt returns
            self._model_call(fault)

    def _run_call(self, call: _Call, fault: list[str]) -> None:
        ins, outs = _GUARDS[call.kind]
        verdict: str | None = None
        for name in ins:
            if not call.guarded_in:
                self.guardrails[name] += 1
            verdict = verdict or _REJECTING.get(name)
        call.guarded_in = True
        if verdict is not None:
            call.state, call.result = "done", verdict
            return
        if not call.hooked:
            self.hooks[f"tool_start:{call.kind}"] += 1
            call.hooked = True
        self.tools[call.kind] += 1
        if fault[0] == "crash_in_tool":
            fault[0] = "none"
            call.state = "started"
            if call.kind != "idem":
                self.final_step = Step.TOOLS
                self._end("ToolInDoubt", "SimulatedCrash", fault="crash_in_tool")
            raise _Stop("SimulatedCrash")
        output: JSON = ("tool error: ValueError" if call.kind == "fails"
                        else f"{call.kind} ran {call.call_id}")
        for name in outs:
            self.guardrails[name] += 1
            output = _REJECTING.get(name, output)
        call.state, call.result = "done", output
        self.hooks[f"tool_end:{call.kind}"] += 1

    def _model_call(self, fault: list[str]) -> None:
        if not self.activation:
            self.hooks["agent_start"] += 1
            self.activation = True
        if self.responses >= self.script.max_turns:
            self.final_step = Step.TERMINAL_UNRECOVERABLE
            self._end("MaxTurnsExceeded")
        self.hooks["model_start"] += 1
        self.tools["model"] += 1
        self.hooks["model_end"] += 1
        self.responses += 1
        turn = self._turn()
        self.handed_off = False
        if turn.calls:
            self.calls = [_Call(call_id(self.responses - 1, i), kind,
                                "undecided" if kind == "approve" else "approved")
                          for i, kind in enumerate(turn.calls)]
            return
        self.calls = []
        self.guardrails["final_check"] += 1
        if self.script.trip:
            self.final_step = Step.TERMINAL_UNRECOVERABLE
            self._end("OutputGuardrailTripwire")
        self.hooks["agent_end"] += 1
        self._write(fault, [{"role": "assistant", "content": self.script.final_output}], True)


class _ScriptedModel:
    def __init__(self, world: ScriptWorld) -> None:
        self.world = world

    async def respond(self, history: list[JSON], agent: Agent) -> ModelResponse:
        world = self.world
        world.counters.tools["model"] += 1
        index = world.counters.tools["model"] - 1
        turns = world.script.turns
        if index >= len(turns):
            fail("O1", f"the model was called {index + 1} times; the script has "
                 f"{len(turns)} responses")
        turn = turns[index]
        if turn.calls:
            return ModelResponse(tuple((call_id(index, i), kind, {"n": call_id(index, i)})
                                       for i, kind in enumerate(turn.calls)))
        return ModelResponse(output=world.script.final_output)


def _scripted_tool(world: ScriptWorld, kind: str) -> FunctionTool:
    def body(n: str) -> JSON:
        world.counters.tools[kind] += 1
        if world.crash_armed:
            world.crash_armed = False
            raise SimulatedCrash
        if kind == "fails":
            raise ValueError("the tool failed")
        return f"{kind} ran {n}"

    def guard(name: str) -> ToolGuardrail:
        def check(call: ToolCall, *output: JSON) -> Verdict:
            world.counters.guardrails[name] += 1
            message = _REJECTING.get(name)
            return ALLOW if message is None else reject_content(message)
        return ToolGuardrail(name, check)

    ins, outs = _GUARDS[kind]
    return FunctionTool(kind, body, needs_approval=kind == "approve",
                        idempotent=kind == "idem",
                        input_guardrails=tuple(guard(n) for n in ins),
                        output_guardrails=tuple(guard(n) for n in outs))


class ScriptWorld(World):
    """The reference runner driven by a `Script`, checked against the `Oracle`: after
    every step the effect counters, the Session's items, the pending approvals and the
    error the attempt ended with must be what the oracle computed from the script and
    the faults; `finish` checks liveness (the run reaches ``COMPLETED``, or the typed
    error the script or an unrecoverable fault names)."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.oracle = Oracle(script)
        self.session = ListSession("scripted")
        self.counters = Counters()
        self.controller = RunController.start(
            run_id="scripted", session_id="scripted", policy=script.policy,
            max_turns=script.max_turns)
        self.fresh = True
        self.crash_armed = False
        self.agent = self._build_agent()

    def _build_agent(self) -> Agent:
        guard = OutputGuardrail("final_check", self._final_check)
        return Agent("scripted", _ScriptedModel(self),
                     tuple(_scripted_tool(self, kind) for kind in TOOL_KINDS),
                     output_guardrails=(guard,), max_turns=self.script.max_turns)

    def _final_check(self, output: JSON) -> Verdict:
        self.counters.guardrails["final_check"] += 1
        return reject_content("tripped") if self.script.trip else ALLOW

    def clone(self) -> World:
        twin = copy.copy(self)
        twin.oracle = copy.deepcopy(self.oracle)
        twin.session = ListSession("scripted", self.session.items)
        twin.counters = Counters()
        for mine, theirs in ((twin.counters.tools, self.counters.tools),
                             (twin.counters.guardrails, self.counters.guardrails),
                             (twin.counters.hooks, self.counters.hooks)):
            mine.update(theirs)
        twin.controller = copy_controller(self.controller)
        twin.agent = twin._build_agent()
        return twin

    def actions(self) -> list[Action]:
        acts: list[Action] = [("run", fault) for fault in SCRIPT_FAULTS]
        if self.oracle.ended is None and self.oracle.pending():
            acts.append(("decide",))
        return [*acts, ("reload",)]

    def apply(self, action: Action) -> None:
        name = action[0]
        if name == "reload":
            self.controller = RunController.from_json(self.controller.to_json())
        elif name == "decide":
            self._decide()
        else:
            self._attempt(action[1])

    def _decide(self) -> None:
        move = self.oracle.decide()
        c = self.controller
        before = (c.version, c.step, c.pending_approvals)
        try:
            if move[0] == "handoff":
                c.handoff("scripted-2")
            elif move[0] == "approve":
                c.approve(move[1])
            elif move[0] == "reject":
                c.reject(move[1], f"declined {move[1]}")
            else:  # the oracle says this decision must be refused: try the first one
                c.approve(c.pending_approvals[0] if c.pending_approvals else "none")
        except ControlError as error:
            if move[0] != "refused":
                fail("O1", f"{move[0]} was refused ({type(error).__name__}); the script "
                     "allows it")
            if (c.version, c.step, c.pending_approvals) != before:
                fail("I2", "a refused decision changed the run")
            return
        if move[0] == "refused":
            fail("O1", "a decision was taken while a publication is unsettled")

    def _attempt(self, fault: str) -> None:
        expected = self.oracle.attempt(fault)
        session: Any = self.session
        if fault in ("atomic", "commit_then_raise", "cancel", "partial"):
            session = FlakySession(self.session, fail_on=1,
                                   outcome=fault)  # type: ignore[arg-type]
        self.crash_armed = fault == "crash_in_tool"
        options: dict[str, Any] = {"session": session, "controller": self.controller,
                                   "hooks": CountingHooks(self.counters)}
        if self.fresh:
            options["input"] = "go"
            self.fresh = False
        got: str | None = None
        try:
            run_sync(_attempt(self.agent, self.script.streamed, options))
        except SimulatedCrash:
            got = "SimulatedCrash"  # the process died: only what was recorded survives
            self.controller = RunController.from_json(self.controller.to_json())
        except (Exception, asyncio.CancelledError) as error:
            got = type(error).__name__
        self.crash_armed = False
        if got != expected:
            fail("O1", f"an attempt with fault {fault!r} ended with {got}; the oracle "
                 f"predicted {expected}")

    def finish(self) -> None:
        """Liveness: drive the run on without faults, deciding as the script says, until
        it ends; it must end where the oracle says (``COMPLETED`` unless the script or an
        unrecoverable fault names a typed error), within a bound."""
        o = self.oracle
        for _ in range(4 * len(self.script.turns) + 6):
            if o.ended is not None:
                break
            decides = o.pending() and o.decide_allowed()
            self.apply(("decide",) if decides else ("run", "none"))
            self.check()
        if o.ended is None:
            fail("L1", "the run did not end within its bound of attempts")
        expected = self.script.expected_end() if o.unrecoverable is None else o.ended
        c = self.controller
        if o.ended != expected:
            fail("L1", f"the run ended with {o.ended}, the script allows {expected}")
        if expected == "completed":
            if c.step is not Step.COMPLETED or c.final_output != self.script.final_output:
                fail("L1", f"the run stopped in {c.step.value}, not completed")
        else:
            if c.step is not o.final_step:
                fail("L2", f"the run ended in {c.step.value}, not {o.final_step.value}")
            self.apply(("run", "none"))  # every later attempt is refused, doing nothing
            self.check()
        self.check_log()

    def key(self) -> str:
        c = self.controller
        return json.dumps([c.to_json(), self.session.items, self.counters_view(),
                           sorted(c.in_flight), self.fresh], sort_keys=True, default=str)

    def counters_view(self) -> tuple[Any, ...]:
        n = self.counters
        return (sorted(n.tools.items()), sorted(n.guardrails.items()),
                sorted(n.hooks.items()))

    def check(self) -> None:
        o, n, c = self.oracle, self.counters, self.controller
        for what, seen, due in (("tools", n.tools, o.tools),
                                ("guardrails", n.guardrails, o.guardrails),
                                ("hooks", n.hooks, o.hooks)):
            if +seen != +due:
                fail("O2", f"{what} ran {dict(seen)}; the script says {dict(due)}")
        if self.session.items != o.session:
            fail("O3", f"the Session holds {len(self.session.items)} items "
                 f"{_ids(self.session.items)}; the script says {len(o.session)} "
                 f"{_ids(o.session)}")
        if list(c.pending_approvals) != o.pending():
            fail("O4", f"pending approvals {list(c.pending_approvals)}; the script says "
                 f"{o.pending()}")
        if o.ended == "completed" and c.step is not Step.COMPLETED:
            fail("O5", f"the run is in {c.step.value}; the script says completed")

    def check_log(self) -> None:
        """The log's own invariants and its JSON round trip. The log only grows, so one
        check of the whole log at the end of a walk sees every event it recorded (the
        reference world checks them after every step)."""
        c = self.controller
        check_log(c.events)
        doc = c.to_json()
        if RunController.from_json(doc).to_json() != doc:
            fail("I10", "a JSON round trip changed the run")


def _ids(items: list[JSON]) -> list[Any]:
    return [i.get("call_id", i.get("role")) if isinstance(i, dict) else i for i in items]
