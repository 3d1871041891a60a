"""`statemachine.operator` (DESIGN §7.5): approve, reject, resolve and abandon a stored
run from outside it, on every store kind, sync and async; each durable with who, or the
typed error with nothing appended (not even its claim)."""

from __future__ import annotations

import asyncio
import inspect
from pathlib import Path
from typing import Any

import pytest

from statemachine import (
    ConcurrencyConflict,
    InvalidTransition,
    LeaseHeld,
    Phase,
    RecoveryPolicy,
    Resolution,
    RunController,
    RunNotResumable,
    SchemaError,
    Step,
    operator,
)
from statemachine import events as ev
from statemachine.stores import SQLiteEventStore
from tests.helpers import SESSION, B, P, StoreMaker

RUN = "run-op"




def _is_async(store: Any) -> bool:
    return inspect.iscoroutinefunction(store.append)


async def _call(name: str, store: Any, *args: Any, **kwargs: Any) -> RunController:
    """The operator's ``name`` on ``store``: its async form on an async store."""
    if _is_async(store):
        result: RunController = await getattr(operator, f"{name}_async")(store, *args, **kwargs)
        return result
    return getattr(operator, name)(store, *args, **kwargs)  # type: ignore[no-any-return]


async def _load(store: Any) -> RunController:
    return await RunController.load_async(store, RUN)


async def _versions(store: Any) -> int:
    return (await _load(store)).version


async def _seeded(store: Any, upto: str) -> RunController:
    """A stored run at ``upto``: ``interruption`` (charge, notify, audit await a decision),
    ``in_doubt`` (charge approved and started by a worker that died), ``unsettled_closed``
    (a FAIL_CLOSED publication staged and never settled)."""
    policy = RecoveryPolicy.FAIL_CLOSED if upto == "unsettled_closed" else (
        RecoveryPolicy.RECONCILE)
    c = RunController.start(run_id=RUN, session_id=SESSION, policy=policy, store=store)
    c.add_input(P)
    c.stage_publication(P, [], call_ids=[])
    c.publication_committed()
    c.begin_model_call()
    from statemachine import ToolCall

    c.model_responded([ToolCall("charge", "charge", {"x": 7}, needs_approval=True),
                       ToolCall("notify", "notify", {}, needs_approval=True),
                       ToolCall("audit", "audit", {}, needs_approval=True)])
    if upto in ("in_doubt", "unsettled_closed"):
        c.approve("charge")
        c.reject("notify", "no")
        c.reject("audit", "no")
        c.resume()
        c.begin_tool("charge")
        if upto == "unsettled_closed":
            c.tool_completed("charge", "charged 7")
            c.stage_publication(B, [*P], call_ids=["charge", "notify", "audit"])
    await c.flush_async()
    return await _load(store)


async def _approved(worker: RunController) -> None:
    worker.approve("charge")  # appended now (per event), or at the flush (buffered)
    await worker.flush_async()


def _run(body: Any) -> None:
    asyncio.run(body)


def test_approve_binds_the_fingerprint_records_who_and_is_durable(make: StoreMaker) -> None:
    async def body() -> None:
        store = make()
        seeded = await _seeded(store, "interruption")
        await _call("approve", store, RUN, "charge", fingerprint=seeded.fingerprint("charge"),
                    by="alice", reason="asked for it")
        again = await _load(make())
        assert again.phase("charge") is Phase.APPROVED
        (decision,) = again.call("charge").decisions
        assert (decision.kind, decision.by, decision.reason) == ("approved", "alice",
                                                                 "asked for it")
        claims = [e for e in again.events if isinstance(e, ev.RunClaimed)]
        assert claims[-1].owner == "alice"
        assert again.version == seeded.version + 2  # its claim and its decision

    _run(body())


@pytest.mark.parametrize("case", ["wrong-fingerprint", "decided-call", "unknown-call",
                                  "no-by", "empty-by", "no-fingerprint", "override-by",
                                  "invisible-by", "line-break-by"])
def test_a_refused_approval_appends_nothing_not_even_its_claim(make: StoreMaker,
                                                               case: str) -> None:
    async def body() -> None:
        store = make()
        seeded = await _seeded(store, "interruption")
        fingerprint = seeded.fingerprint("charge")
        call_id, by = "charge", "alice"
        if case == "wrong-fingerprint":
            fingerprint = seeded.fingerprint("notify")
        elif case == "decided-call":
            await _call("reject", store, RUN, "charge", by="bob", message="no")
        elif case == "unknown-call":
            call_id = "ghost"
        elif case == "no-fingerprint":
            fingerprint = ""
        elif case.endswith("-by") and case not in ("no-by", "empty-by"):
            # a name that reads as another, or as nothing: the console refuses it too
            by = {"override-by": "\u202eecila", "invisible-by": "\u200b",
                  "line-break-by": "alice\nbob"}[case]
        else:
            by = "" if case == "empty-by" else None  # type: ignore[assignment]
        before = await _versions(store)
        error = InvalidTransition if case in ("wrong-fingerprint", "decided-call",
                                              "unknown-call") else SchemaError
        with pytest.raises(error):
            await _call("approve", store, RUN, call_id, fingerprint=fingerprint, by=by)
        assert await _versions(make()) == before

    _run(body())


def test_reject_records_its_message_and_who(make: StoreMaker) -> None:
    async def body() -> None:
        store = make()
        await _seeded(store, "interruption")
        await _call("reject", store, RUN, "notify", by="bob", message="not today")
        again = await _load(make())
        view = again.call("notify")
        assert view.phase is Phase.REJECTED
        assert view.result == "not today"
        assert [(d.kind, d.by) for d in view.decisions] == [("rejected", "bob")]

    _run(body())


@pytest.mark.parametrize("outcome", list(Resolution))
def test_resolve_settles_a_call_in_doubt_durably(make: StoreMaker, outcome: Resolution) -> None:
    async def body() -> None:
        store = make()
        await _seeded(store, "in_doubt")
        output = None if outcome is Resolution.NOT_EXECUTED else "the answer"
        await _call("resolve", store, RUN, "charge", outcome=outcome, output=output,
                    by="carol", evidence="ch_9")
        again = await _load(make())
        assert again.in_doubt() == ()
        expected = Phase.APPROVED if outcome is Resolution.NOT_EXECUTED else Phase.COMPLETED
        assert again.phase("charge") is expected
        last = again.call("charge").decisions[-1]
        assert (last.kind, last.by, last.outcome, last.evidence) == ("resolved", "carol",
                                                                     outcome, "ch_9")
        assert again.call("charge").result == output

    _run(body())


def test_resolve_of_a_call_not_in_doubt_appends_nothing(make: StoreMaker) -> None:
    async def body() -> None:
        store = make()
        await _seeded(store, "interruption")
        before = await _versions(store)
        with pytest.raises(InvalidTransition):
            await _call("resolve", store, RUN, "charge", outcome=Resolution.COMPLETED,
                        output="x", by="carol")
        with pytest.raises(SchemaError):
            await _call("resolve", store, RUN, "charge", outcome=Resolution.NOT_EXECUTED,
                        output="x", by="carol")
        assert await _versions(make()) == before

    _run(body())


def test_abandon_ends_the_run_and_a_second_abandon_is_refused(make: StoreMaker) -> None:
    async def body() -> None:
        store = make()
        await _seeded(store, "in_doubt")
        await _call("abandon", store, RUN, reason="the customer cancelled", by="dave")
        again = await _load(make())
        assert again.step is Step.TERMINAL_UNRECOVERABLE
        last = again.events[-1]
        assert isinstance(last, ev.Abandoned)
        assert (last.reason, last.by) == ("the customer cancelled", "dave")
        before = again.version
        with pytest.raises(RunNotResumable):
            await _call("abandon", store, RUN, reason="again", by="dave")
        assert await _versions(make()) == before

    _run(body())



@pytest.mark.parametrize("reason", ["", "   "], ids=["empty", "blank"])
def test_an_abandon_without_a_reason_is_refused(make: StoreMaker, reason: str) -> None:
    """An abandon says why the run ends (the console requires it): an empty or blank
    reason is refused (`SchemaError`), nothing recorded."""
    async def body() -> None:
        store = make()
        await _seeded(store, "interruption")
        before = await _versions(store)
        with pytest.raises(SchemaError, match="reason"):
            await _call("abandon", store, RUN, reason=reason, by="alice")
        assert await _versions(make()) == before

    _run(body())

def test_abandon_reaches_an_unsettled_run_that_fails_closed(make: StoreMaker) -> None:
    """No claim is accepted there (no attempt may go on); abandoning it needs none."""
    async def body() -> None:
        store = make()
        seeded = await _seeded(store, "unsettled_closed")
        assert seeded.step is Step.UNSETTLED
        with pytest.raises(RunNotResumable):
            await _call("resolve", store, RUN, "charge", outcome=Resolution.COMPLETED,
                        by="carol")
        await _call("abandon", store, RUN, reason="write lost", by="dave")
        assert (await _load(make())).step is Step.TERMINAL_UNRECOVERABLE

    _run(body())


def test_a_live_lease_of_a_worker_refuses_the_operator_with_nothing_changed(
        make: StoreMaker) -> None:
    async def body() -> None:
        store = make()
        await _seeded(store, "interruption")
        worker = await _load(store)
        worker.claim("worker-1", lease=600)
        await worker.flush_async()
        before = await _versions(store)
        with pytest.raises(LeaseHeld):
            await _call("reject", store, RUN, "notify", by="bob")
        assert await _versions(make()) == before

    _run(body())


def test_the_operator_supersedes_a_worker_that_holds_no_lease(make: StoreMaker) -> None:
    async def body() -> None:
        store = make()
        await _seeded(store, "interruption")
        worker = await _load(store)
        worker.claim("worker-1")
        await worker.flush_async()
        await _call("reject", store, RUN, "notify", by="bob")
        with pytest.raises(ConcurrencyConflict):
            await _approved(worker)
        assert (await _load(make())).phase("charge") is Phase.AWAITING

    _run(body())


def test_the_read_models_need_a_store_with_run_heads() -> None:
    from statemachine import ConfigurationError

    class Bare:
        def append(self, *args: Any, **kwargs: Any) -> None: ...
        def load(self, run_id: str) -> list[ev.Event]: return []

    with pytest.raises(ConfigurationError):
        operator.runs(Bare())


class _Clock:
    def __init__(self, start: int) -> None:
        self.now = start

    def __call__(self) -> int:
        self.now += 1000
        return self.now


def test_the_inbox_lists_across_runs_oldest_first(make: StoreMaker) -> None:
    """run-z waited first, run-a later: the inbox goes by since, not by run id."""
    async def body() -> None:
        from statemachine import ToolCall

        store = make()
        for run_id, start in (("run-z", 1_000_000_000), ("run-a", 2_000_000_000)):
            c = RunController.start(run_id=run_id, session_id=None, store=store,
                                    clock=_Clock(start))
            c.begin_model_call()
            c.model_responded([ToolCall(f"{run_id}-call", "pay", {"to": run_id},
                                        needs_approval=True)])
            await c.flush_async()
        if _is_async(store):
            found = await operator.inbox_async(store)
            heads = await operator.runs_async(store, blocked=True)
        else:
            found = operator.inbox(store)
            heads = operator.runs(store, blocked=True)
        assert [(w.run_id, w.call_id, w.kind) for w in found] == [
            ("run-z", "run-z-call", "approval"), ("run-a", "run-a-call", "approval")]
        times = [w.since for w in found]
        assert None not in times
        assert times == sorted(t for t in times if t is not None)
        assert [h.run_id for h in heads] == ["run-a", "run-z"]  # runs go by id
        assert found[0].preview == '{"to":"run-z"}'

    _run(body())


def test_the_async_read_models_take_a_sync_store_too(tmp_path: Path) -> None:
    store = SQLiteEventStore(tmp_path / "events.db")
    asyncio.run(_seeded(store, "in_doubt"))
    found = asyncio.run(operator.inbox_async(store))
    assert found == operator.inbox(store)
    assert [(w.call_id, w.kind) for w in found] == [("charge", "in_doubt")]
    (head,) = asyncio.run(operator.runs_async(store, steps={Step.TOOLS}))
    assert head.blocker is not None
    assert asyncio.run(operator.runs_async(store, steps={Step.COMPLETED})) == []


def test_the_operator_keeps_to_the_runs_own_limits(tmp_path: Path) -> None:
    """A run whose workers load it with max_bytes=6000: the operator given those limits
    is refused a resolution that would take the log past them (nothing appended), so the
    workers can still load the run; the CLI takes them as --max-bytes."""
    store = SQLiteEventStore(tmp_path / "events.db")
    asyncio.run(_seeded(store, "in_doubt"))
    big = "x" * 6000
    before = RunController.load(store, RUN).version
    with pytest.raises(SchemaError, match="max_bytes"):
        operator.resolve(store, RUN, "charge", outcome=Resolution.COMPLETED, output=big,
                         by="carol", max_bytes=6000)
    assert RunController.load(store, RUN).version == before
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "statemachine", "resolve", RUN, "charge",
                           "--store", str(tmp_path / "events.db"), "--by", "carol",
                           "--completed", f'"{big}"', "--max-bytes", "6000"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2
    assert "max_bytes" in done.stderr
    operator.resolve(store, RUN, "charge", outcome=Resolution.COMPLETED, output="ok",
                     by="carol", max_bytes=6000)
    assert RunController.load(store, RUN, max_bytes=6000).phase("charge") is Phase.COMPLETED


@pytest.mark.parametrize("verb", ["approve", "reject", "resolve", "abandon"])
def test_a_decision_on_a_run_that_moved_since_it_was_seen_is_refused(make: StoreMaker,
                                                                     verb: str) -> None:
    """``seen=`` (the console's forms): the version the person saw. A run that moved since
    refuses every command with nothing appended; the version it has now is accepted."""

    async def body() -> None:
        store = make()
        seeded = await _seeded(store, "in_doubt" if verb == "resolve" else "interruption")
        shown = seeded.version
        if verb == "resolve":
            args: tuple[Any, ...] = (RUN, "charge")
            kwargs: dict[str, Any] = {"outcome": Resolution.FAILED, "output": "declined"}
        elif verb == "abandon":
            args, kwargs = (RUN,), {"reason": "stop"}
        else:
            args = (RUN, "charge")
            kwargs = {"fingerprint": seeded.fingerprint("charge")} if verb == "approve" else {}
        for stale in (shown - 1, shown + 1):
            with pytest.raises(ConcurrencyConflict, match="moved since it was shown"):
                await _call(verb, store, *args, by="alice", seen=stale, **kwargs)
            assert await _versions(make()) == shown
        for bad in (0, -1, True, "3", 2.0):
            with pytest.raises(SchemaError, match="seen"):
                await _call(verb, store, *args, by="alice", seen=bad, **kwargs)
            assert await _versions(make()) == shown
        await _call(verb, store, *args, by="alice", seen=shown, **kwargs)
        assert await _versions(make()) == shown + 2  # its claim and its command

    _run(body())
