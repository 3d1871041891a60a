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
from statemachine.machine import TERMINAL_STEPS
from statemachine.payloads import JSON
from statemachine.runner import (
    Agent,
    FunctionTool,
    MaxTurnsExceeded,
    ModelResponse,
    Runner,
)
from statemachine.sessions import MemorySession
from statemachine.testing.fakes import (
    Counters,
    CountingHooks,
    FlakySession,
    InjectedWriteError,
    counted_tool,
)
from statemachine.testing.invariants import check_log, fail, settled
from statemachine.values import Phase, RecoveryPolicy, Step

Action = tuple[str, ...]


# ------------------------------------------------------------------------ worlds


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
            elif name == "repair":
                asyncio.run(self._repair())
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
        before = (self.durable(), self.counters_view())
        try:
            asyncio.run(_attempt(agent, streamed, options))
        except RunNotResumable:
            if (self.durable(), self.counters_view()) != before:
                fail("I9", "a refused resume did work")
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
        if ledger(again) != ledger(c) or again.step is not c.step or again.to_json() != doc:
            fail("I10", "a JSON round trip changed the run")
        n = self.counters
        if n.tools["charge"] > 1:
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
        from_log = settled(events)[1]
        if list(c.guardrail_results) != from_log:
            fail("I4", f"{len(c.guardrail_results)} guardrail results published, the log "
                  f"settled {len(from_log)}")
        self._check_session(c)
        if c.step is Step.UNSETTLED and c.envelope is not None and (
                c.pending_approvals != c.envelope.interruptions):
            fail("I5", "the remaining interruptions changed while unsettled")

    def _check_session(self, c: RunController) -> None:
        items, expected = self.session_items(), self.expected_items()
        if items[: len(expected)] != expected:
            fail("I3", "the Session does not hold exactly the settled batches")
        extra = items[len(expected):]
        open_batch = list(c.envelope.items) if c.envelope is not None else []
        if c.step is Step.UNSETTLED or c.step is Step.TERMINAL_UNRECOVERABLE:
            last = [e for e in c.events if isinstance(e, ev.PublicationStaged)]
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
            fail("I1", "the executor left a task running")

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
