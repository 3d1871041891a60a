"""One attempt on a run: how the reference loop and every adapter begin and end the work
of one call (`Runner.run`, an adapter's ``run`` or ``settle``, one iteration of a tool
runner), so that each does it the same way (DESIGN §6.3, §7.7).

An attempt on a run that already exists first records ``claim(owner)`` and makes it
durable, before any guardrail, hook, model call, tool or write: of attempts that loaded
the same version of a run bound to a store, exactly one goes on, and the others get
`ConcurrencyConflict` having done nothing. A run this process started has nothing to
claim on its first attempt. When the attempt ends, what it buffered goes to the store;
when it ends with an error, a failing flush never replaces that error (the events stay
buffered for the next flush or, if the process dies, are lost like a crash before them).

`Attempt.settle` is the attempt an adapter makes to settle a run and nothing else. Also
here, for what runs inside an attempt: `maybe_await` (a hook, guardrail or tool may
be sync or async) and `interrupted` (a tool that ended without a result).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from types import TracebackType
from typing import Any

from statemachine.controller import RunController
from statemachine.errors import ControlError
from statemachine.runner.publish import settle
from statemachine.sessions import Session
from statemachine.values import Step
from statemachine.verifiers import Verifier, verify_in_doubt_async

VERIFY_TIMEOUT = 30.0
"""How long an attempt waits for one verifier's answer (seconds) before leaving its call
in doubt."""


async def maybe_await(value: Any) -> Any:
    """``value``, awaited first if it is awaitable (what a sync or async callable gave)."""
    return await value if inspect.isawaitable(value) else value


class Attempt:
    """The attempts made on one run from here, each an ``async with attempt:`` block
    around all of its work (entering returns whether it resumes an existing run).

    Entering claims an existing run (``claim(owner, lease=lease)``) and flushes the claim:
    raises `ConcurrencyConflict` when another attempt claimed the version first (its
    subclass `LeaseHeld` while another owner's lease is live), or the
    controller's refusal, with the block not run. A run the gate would refuse anyway (a
    call in doubt: `ToolInDoubt`) is refused before the claim, recording nothing, unless
    a call in doubt has a verifier (``verifiers``, by tool name): then, right after the
    claim is durable and before anything else, each such call's verifier is asked once
    (`verifiers.verify_in_doubt_async`, ``verify_timeout`` seconds each) and its answer
    recorded and flushed; what stays in doubt is refused by the gate as before.
    Leaving flushes what the block buffered: its error, when it raised, is what
    propagates, whatever the flush does; a flush that fails after a block that returned
    raises. ``flush`` is how to flush (an adapter whose tools run concurrently passes its
    own, one at a time; default ``controller.flush_async``)."""

    def __init__(self, controller: RunController, *, resumes: bool, owner: str | None = None,
                 flush: Callable[[], Awaitable[None]] | None = None,
                 lease: float | None = None,
                 verifiers: Mapping[str, Verifier] | None = None,
                 verify_timeout: float | None = VERIFY_TIMEOUT) -> None:
        self.controller = controller
        self.verifiers = dict(verifiers or {})
        """The verifiers (by tool name) asked about calls in doubt after the claim."""
        self.verify_timeout = verify_timeout
        self.owner = owner
        self.lease = lease
        """The lease each claim takes (`RunController.claim`), in seconds, or None."""
        self.resumes = resumes
        """Whether the next attempt resumes a run that exists (and claims it): False only
        before the first attempt on a run this process started."""
        self._flush = flush if flush is not None else controller.flush_async
        self._gated = True

    async def __aenter__(self) -> bool:
        resumes = self.resumes
        if resumes:
            c = self.controller
            doubtful = c.in_doubt()
            verifiable = [call_id for call_id in doubtful
                          if c.call(call_id).call.name in self.verifiers]
            if self._gated and doubtful and not verifiable:  # the gate refuses it
                c.resume()  # (ToolInDoubt) before the claim: a stuck run gains no claim
            c.claim(self.owner, lease=self.lease)
            await self._flush()  # durable before any effect, whatever the durability
            if verifiable:  # the first effect: ask what happened, record it, durably
                await verify_in_doubt_async(c, self.verifiers, timeout=self.verify_timeout)
                await self._flush()
        elif self.lease is not None:  # a new run held from its first attempt on: its
            self.controller.claim(self.owner, lease=self.lease)  # claim takes the lease
            await self._flush()
        self.resumes = True  # every later attempt on the run claims it
        return resumes

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None,
                        traceback: TracebackType | None) -> None:
        if error is None:
            await self._flush()
            return
        with contextlib.suppress(ControlError):  # the attempt's own error wins
            await self._flush()

    @contextlib.asynccontextmanager
    async def deciding(self) -> AsyncIterator[bool]:
        """An attempt that records an outcome and runs nothing (an operator's
        ``resolve_in_doubt``): claimed even while a call is in doubt, since recording its
        outcome is how a stuck run goes on."""
        self._gated = False
        try:
            async with self as resumes:
                self._gated = True
                yield resumes
        finally:
            self._gated = True

    async def settle(self, session: Session, *, take_over: bool = False) -> None:
        """An attempt that only settles the run: claimed, through the gate (``resume()``),
        then its unsettled write settled against ``session`` (`publish.settle`: reconcile,
        and write the batch if nothing of it landed), without a model call or a tool.
        `ReconcileRejected` when ``session`` cannot be matched (nothing recorded)."""
        c = self.controller
        async with self:
            c.resume()
            while c.step is Step.UNSETTLED:
                await settle(c, session, take_over=take_over)


def interrupted(controller: RunController, call_id: str) -> None:
    """A tool this controller started ended without a recorded result (cancelled, timed
    out, or stopped by an error first): the call stays started and the controller stops
    holding it in flight, so it answers as a reloaded one would (`ToolInDoubt`, or
    `Execute` again for an idempotent call). Never replaces the error in flight: a run
    already refusing everything (after an unknown append, say) refuses this too."""
    if call_id in controller.in_flight:
        with contextlib.suppress(ControlError):
            controller.tool_interrupted(call_id)
