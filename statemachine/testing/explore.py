"""The exhaustive explorer and the Hypothesis kit over a `World`.

* `explore` walks every action sequence of a world breadth-first up to a depth, checking
  every reachable state, and returns the shortest counterexample trace if one fails.
* `world_state_machine` is the same world under Hypothesis' stateful testing.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import attrs

from statemachine.testing.worlds import Action, World

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
    """Breadth-first over every action sequence up to ``depth``, checking every state,
    and liveness (`World.finish`, on a copy) from every state at the bound.
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
                if len(path) == depth:
                    child.clone().finish()
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


STEPS = {"stateful": 0}
"""Stateful steps run in this process by every `world_state_machine` (a test session
reports the total)."""


def world_state_machine(world_factory: Callable[..., World], *,
                        progress_every: int | None = None,
                        scripts: Any = None) -> type[Any]:
    """A `hypothesis.stateful.RuleBasedStateMachine` over ``world_factory``'s worlds:
    each step applies one of the world's actions, and every invariant is checked after
    every step; at the end of every example the world's `World.finish` checks liveness.
    With ``scripts`` (a strategy), each example's world is ``world_factory(script)`` for
    a drawn script. Run it with ``TestCase = world_state_machine(MyWorld).TestCase``.
    With ``progress_every``, a line with examples, steps and steps per second goes to
    stderr every that many examples."""
    import sys

    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

    tally = {"examples": 0, "steps": 0, "started": time.perf_counter()}

    class WorldStateMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.world: World | None = None if scripts is not None else world_factory()
            self.healthy = True  # no step or check failed (then liveness is not asked)

        if scripts is not None:
            @initialize(script=scripts)
            def begin(self, script: Any) -> None:
                self.world = world_factory(script)

        @rule(data=st.data())
        def act(self, data: st.DataObject) -> None:
            assert self.world is not None
            self.healthy = False
            # (a fresh strategy per step: a cached one is cheaper, but Hypothesis then
            # explores worse; one planted bug took 40 times the steps to find)
            action = data.draw(st.sampled_from(self.world.actions()), label="action")
            self.world.apply(action)
            tally["steps"] += 1
            STEPS["stateful"] += 1
            self.healthy = True

        @invariant()
        def invariants_hold(self) -> None:
            if self.world is not None:
                self.healthy = False
                self.world.check()
                self.healthy = True

        def teardown(self) -> None:
            if self.world is not None and self.healthy:
                self.world.finish()
            tally["examples"] += 1
            if progress_every and tally["examples"] % progress_every == 0:
                elapsed = time.perf_counter() - tally["started"]
                print(f"{type(self).__name__}: {tally['examples']} examples, "
                      f"{tally['steps']} steps, {tally['steps'] / elapsed:.0f} steps/s",
                      file=sys.stderr, flush=True)

    WorldStateMachine.__name__ = f"{getattr(world_factory, '__name__', 'World')}Machine"
    WorldStateMachine.tally = tally
    return WorldStateMachine


