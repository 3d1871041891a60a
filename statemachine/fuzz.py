"""Fuzzing the invariants: a log checker, explorable worlds, an exhaustive explorer and a
Hypothesis state machine a runner author subclasses.

* `check_log` checks the invariants a run's event log alone can show (I1, I2, I4, I5,
  I9, I10, I11, I12), independently of the fold that recorded it.
* A `World` is a system under test: a runner embedding a controller, its Session and its
  effect counters, with a finite menu of `actions` (approve, resume with an injected
  fault, reload, abandon...) and a `check` of every invariant. `ReferenceWorld` wraps
  this project's reference runner; write your own for your runner.
* `explore` walks every action sequence of a world breadth-first up to a depth, checking
  every reachable state, and returns the shortest counterexample trace if one fails.
* `WorldStateMachine` is the same world under Hypothesis' stateful testing: subclass it
  with ``world_factory = YourWorld``.
"""

from __future__ import annotations

import asyncio
import copy
import json
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from statemachine import events as ev
from statemachine.controller import RunController
from statemachine.errors import ControlError, RunNotResumable
from statemachine.machine import TERMINAL_STEPS, Step
from statemachine.payloads import JSON
from statemachine.runner import (
    Agent,
    FunctionTool,
    MaxTurnsExceeded,
    ModelResponse,
    Runner,
)
from statemachine.sessions import MemorySession
from statemachine.testing import (
    Counters,
    CountingHooks,
    FlakySession,
    InjectedWriteError,
    counted_tool,
)
from statemachine.values import GuardrailResult, RecoveryPolicy, ToolCall

Action = tuple[str, ...]


class InvariantViolation(AssertionError):
    """An invariant failed; the message names it (I1...I12) and what was seen."""

    def __init__(self, invariant: str, detail: str) -> None:
        super().__init__(f"{invariant}: {detail}")
        self.invariant = invariant


def _fail(invariant: str, detail: str) -> None:
    raise InvariantViolation(invariant, detail)


# ----------------------------------------------------------------- the log alone

_SETTLING = (ev.PublicationFailed, ev.ReconciledAppend, ev.PublicationCommitted,
             ev.ReconciledAcknowledge, ev.Abandoned)


def settled(events: Sequence[ev.Event]) -> tuple[list[JSON], list[GuardrailResult]]:
    """What the log's settled publications published, in order: the Session items (what
    the Session must hold) and the guardrail results (each pending one is published by
    the next batch that settles)."""
    items: list[JSON] = []
    guardrails: list[GuardrailResult] = []
    pending: list[GuardrailResult] = []
    staged: ev.PublicationStaged | None = None
    staged_guardrails = 0
    for event in events:
        if isinstance(event, ev.GuardrailEvaluated):
            pending.append(event.result)
        elif isinstance(event, ev.PublicationStaged):
            staged, staged_guardrails = event, len(pending)
        elif isinstance(event, ev.PublicationCommitted | ev.ReconciledAcknowledge):
            assert staged is not None
            items.extend(staged.items)
            guardrails.extend(pending[:staged_guardrails])
            del pending[:staged_guardrails]
            staged = None
        elif isinstance(event, ev.Abandoned):
            staged = None
    return items, guardrails


def check_log(events: Sequence[ev.Event]) -> None:
    """The invariants a log alone shows; raises `InvariantViolation`."""
    calls: dict[str, ToolCall] = {}
    starts: Counter[str] = Counter()
    results: Counter[str] = Counter()
    unsettled = False
    evaluated: list[Any] = []
    decided: set[str] = set()
    for position, event in enumerate(events):
        if position and isinstance(event, ev.RunStarted):
            _fail("I10", f"a second RunStarted at {position}")
        if event.seq != position:
            _fail("I10", f"event {position} carries seq {event.seq}")
        if unsettled and not isinstance(event, _SETTLING):
            _fail("I2", f"{type(event).__name__} at {position} while a publication is "
                  "unsettled")
        if isinstance(event, ev.PublicationStaged):
            unsettled = True
        elif isinstance(event, ev.PublicationCommitted | ev.ReconciledAcknowledge
                        | ev.Abandoned):
            unsettled = False
        if isinstance(event, ev.ModelResponded | ev.ToolCallsReceived):
            for call in event.tool_calls:
                calls[call.call_id] = call
        elif isinstance(event, ev.CallApproved | ev.CallRejected):
            if event.call_id in decided:
                _fail("I5", f"call {event.call_id!r} decided twice (at {position})")
            decided.add(event.call_id)
        elif isinstance(event, ev.ToolStarted):
            starts[event.call_id] += 1
            proposed = calls.get(event.call_id)
            if starts[event.call_id] > 1 and (proposed is None or not proposed.idempotent):
                _fail("I11", f"non-idempotent call {event.call_id!r} started twice")
            if results[event.call_id]:
                _fail("I12", f"call {event.call_id!r} started after its result was cached")
        elif isinstance(event, ev.ToolCompleted | ev.InDoubtResolved):
            results[event.call_id] += 1
            if results[event.call_id] > 1:
                _fail("I12", f"call {event.call_id!r} got a second result")
        elif isinstance(event, ev.GuardrailEvaluated):
            evaluated.append(event.result)
    terminal = [i for i, e in enumerate(events) if isinstance(e, ev.Abandoned | ev.RunCompleted)]
    if terminal and terminal[0] != len(events) - 1:
        _fail("I9", f"events recorded after the terminal event at {terminal[0]}")
    published = settled(events)[1]
    if len(published) != len({json.dumps(attrs.asdict(g), sort_keys=True)
                              for g in published}):
        _fail("I4", "a guardrail result was published twice")
    if any(g not in evaluated for g in published):
        _fail("I4", "a published guardrail result was never evaluated")


# ------------------------------------------------------------------------ worlds


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
        self.session = MemorySession("world")
        self.counters = Counters()
        self.controller: RunController | None = None

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
        acts += [("resolve", call_id) for call_id in c.in_doubt()]
        if c.step is Step.UNSETTLED and self.session_items() != self.expected_items():
            acts.append(("repair",))
        return acts

    def session_items(self) -> list[JSON]:
        return asyncio.run(self.session.get_items())

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
                    _fail("I8", f"run and run_streamed left different state after {action}")
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
            elif name == "repair":
                asyncio.run(self._repair())
        except ControlError:
            after = (c.events, c.step, c.envelope, c.pending_approvals, c.guardrail_results)
            if after != before:
                _fail("I2", f"a refused {name} changed the run")

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
        before = (self.durable(), self.counters_view())
        try:
            asyncio.run(_attempt(agent, streamed, options))
        except RunNotResumable:
            if (self.durable(), self.counters_view()) != before:
                _fail("I9", "a refused resume did work")
        except SimulatedCrash:
            # the process died: only what was recorded survives
            self.controller = RunController.from_json(json.dumps(c.to_json()))
        except (InjectedWriteError, asyncio.CancelledError, ControlError, MaxTurnsExceeded):
            pass  # the live controller keeps what the attempt recorded

    def durable(self) -> tuple[Any, ...]:
        c = self.controller
        return (json.dumps(c.to_json(), sort_keys=True) if c else None,
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
        events = c.events
        check_log(events)
        doc = c.to_json()
        again = RunController.from_json(json.dumps(doc))
        if again.state != c.state or again.to_json() != doc:
            _fail("I10", "a JSON round trip changed the run")
        n = self.counters
        if n.tools["charge"] > 1:
            _fail("I1", f"charge ran {n.tools['charge']} times")
        lookups = sum(1 for e in events if isinstance(e, ev.ToolStarted)
                      and e.call_id == "lookup")
        if n.tools["lookup"] > lookups:
            _fail("I11", "lookup ran without a recorded start")
        recorded = Counter(e.result.name for e in events
                           if isinstance(e, ev.GuardrailEvaluated))
        if dict(n.guardrails) != {k: v for k, v in recorded.items() if v}:
            _fail("I1", f"guardrails ran {dict(n.guardrails)}, recorded {dict(recorded)}")
        hooks = Counter(e.hook + (f":{e.call_id}" if e.call_id else "") for e in events
                        if isinstance(e, ev.HookRan))
        if dict(n.hooks) != dict(hooks):
            _fail("I1", f"hooks ran {dict(n.hooks)}, recorded {dict(hooks)}")
        from_log = settled(events)[1]
        if list(c.guardrail_results) != from_log:
            _fail("I4", f"{len(c.guardrail_results)} guardrail results published, the log "
                  f"settled {len(from_log)}")
        self._check_session(c)
        if c.step is Step.UNSETTLED and c.envelope is not None and (
                c.pending_approvals != c.envelope.interruptions):
            _fail("I5", "the remaining interruptions changed while unsettled")

    def _check_session(self, c: RunController) -> None:
        items, expected = self.session_items(), self.expected_items()
        if items[: len(expected)] != expected:
            _fail("I3", "the Session does not hold exactly the settled batches")
        extra = items[len(expected):]
        open_batch = list(c.envelope.items) if c.envelope is not None else []
        if c.step is Step.UNSETTLED or c.step is Step.TERMINAL_UNRECOVERABLE:
            last = [e for e in c.events if isinstance(e, ev.PublicationStaged)]
            open_batch = open_batch or (list(last[-1].items) if last else [])
            if extra and extra != open_batch[: len(extra)]:
                _fail("I3", "the Session holds items outside any publication")
        elif extra:
            _fail("I3", f"the Session holds {len(extra)} items no settled batch published")
        for item in items:
            if isinstance(item, dict) and item.get("type") == "function_call_output":
                record = c.state.calls.get(str(item.get("call_id")))
                if record is not None and record.result != item.get("output"):
                    _fail("I12", f"call {item.get('call_id')!r} was published with another "
                          "result than the one it computed")


async def _attempt(agent: Agent, streamed: bool, options: dict[str, Any]) -> Any:
    if not streamed:
        return await Runner.run(agent, **options)
    stream = Runner.run_streamed(agent, **options)
    async for _event in stream.stream_events():
        pass
    return stream.result


# ---------------------------------------------------------------------- explorer


@attrs.frozen
class ExploreReport:
    """What `explore` saw: distinct states, transitions taken, the depth reached, and
    the shortest failing trace (None when every state held every invariant)."""

    states: int
    transitions: int
    depth: int
    seconds: float
    counterexample: tuple[Action, ...] | None = None
    violation: str | None = None


def explore(world_factory: Callable[[], World], *, depth: int,
            max_states: int = 100_000) -> ExploreReport:
    """Breadth-first over every action sequence up to ``depth``, checking every state.
    Breadth-first means the first counterexample found is a shortest one."""
    start = time.perf_counter()
    root = world_factory()
    root.check()
    seen = {root.key()}
    frontier: deque[tuple[World, tuple[Action, ...]]] = deque([(root, ())])
    transitions = reached = 0
    while frontier:
        world, trace = frontier.popleft()
        if len(trace) >= depth:
            continue
        for action in world.actions():
            child = world.clone()
            path = (*trace, action)
            transitions += 1
            try:
                child.apply(action)
                child.check()
            except Exception as violation:  # an invariant, or an error nothing expected
                return ExploreReport(len(seen), transitions, len(path),
                                     time.perf_counter() - start, path,
                                     f"{type(violation).__name__}: {violation}")
            key = child.key()
            if key in seen:
                continue
            seen.add(key)
            reached = max(reached, len(path))
            if len(seen) >= max_states:
                return ExploreReport(len(seen), transitions, reached,
                                     time.perf_counter() - start)
            frontier.append((child, path))
    return ExploreReport(len(seen), transitions, reached, time.perf_counter() - start)


# ------------------------------------------------------------- Hypothesis kit


def world_state_machine(world_factory: Callable[[], World], *,
                        progress_every: int | None = None) -> type[Any]:
    """A `hypothesis.stateful.RuleBasedStateMachine` over ``world_factory``'s worlds:
    each step applies one of the world's actions, and every invariant is checked after
    every step. Run it with ``TestCase = world_state_machine(MyWorld).TestCase``. With
    ``progress_every``, a line with examples, steps and steps per second goes to stderr
    every that many examples."""
    import sys

    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

    tally = {"examples": 0, "steps": 0, "started": time.perf_counter()}

    class WorldStateMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.world = world_factory()

        @rule(data=st.data())
        def act(self, data: st.DataObject) -> None:
            action = data.draw(st.sampled_from(self.world.actions()), label="action")
            self.world.apply(action)
            tally["steps"] += 1

        @invariant()
        def invariants_hold(self) -> None:
            self.world.check()

        def teardown(self) -> None:
            tally["examples"] += 1
            if progress_every and tally["examples"] % progress_every == 0:
                elapsed = time.perf_counter() - tally["started"]
                print(f"{type(self).__name__}: {tally['examples']} examples, "
                      f"{tally['steps']} steps, {tally['steps'] / elapsed:.0f} steps/s",
                      file=sys.stderr, flush=True)

    WorldStateMachine.__name__ = f"{getattr(world_factory, '__name__', 'World')}Machine"
    WorldStateMachine.tally = tally
    return WorldStateMachine


# ------------------------------------------------------------ the remote world


class RemoteWorld(World):
    """The remote tool executor against a `FakeRemote`: calls arrive, posts fail,
    streams drop, tools crash, and the client process restarts (losing what it held in
    memory)."""

    MAX_CALLS = 3

    def __init__(self) -> None:
        from statemachine.testing import FakeRemote

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
            asyncio.run(self._connect())

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
            _fail("I1", "the executor left a task running")

    def key(self) -> str:
        r = self.remote
        return json.dumps([json.dumps(self.controller.to_json(), sort_keys=True),
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
                _fail("I3", f"the remote holds {len(results)} results for {call_id!r}")
        for n, count in self.executions.items():
            if count > 1:
                _fail("I1", f"tool call {n!r} executed {count} times")
        for call_id, record in c.state.calls.items():
            if record.phase == "published" and call_id not in held:
                _fail("I12", f"{call_id!r} is marked posted but the remote lacks it")
            if call_id in held and record.result is not None and held[call_id] != [
                    record.result]:
                _fail("I12", f"{call_id!r} was posted with another result than it computed")
        if self.remote.open_streams:
            _fail("I1", "a stream was left open")
