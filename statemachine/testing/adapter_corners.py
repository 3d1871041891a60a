"""Corner cases for the adapters (issue 32), free of any SDK: each case says what must
happen, computed from the case alone, never read from a ledger; a *player* drives one
adapter through the case with that SDK's own offline model (players import the SDKs, so
they live with the tests) and hands what it observed to the case's ``check_*``, which
raises `CaseFailed` naming what went wrong.

Six families, each with an exhaustive enumerator for CI (``every_*``) and, where it
grows, a Hypothesis strategy for long fuzzing:

* `ReplyCase`: one model reply whose calls mix new (never started), cached (completed
  earlier, result recorded, not written) and in-doubt (started, never completed) calls in
  any order, found by a restarted attempt. Fail closed: a reply holding a call in doubt is
  refused at the attempt's gate (`ToolInDoubt`, naming its first call in doubt) before
  any call of it runs, the new ones included (they run once the call in doubt is
  settled); a cached call is answered from its record, the text the model was to be sent,
  never run again; a new call runs exactly once; the model is sent each call's output
  exactly once, and asked nothing but the next answer (the reply is never asked again).
* `RecordedFaultCase`: after a call's result was recorded, the write carrying it is
  refused, or lands and then raises, or the model request after it fails, once or twice
  in a row: each failing attempt raises the injected error (I6), the tool never runs
  again, and the result reaches the model exactly once.
* `DecisionMixCase`: one model reply whose calls needing no decision (new or cached, as
  above) sit beside calls awaiting a human decision, all answered by one message that
  confirms some and rejects others: each decision is asked once, a confirmed call runs
  once, a rejected one never, and the model is sent each call's output exactly once.
* `StaleStateCase`: a run paused for one decision, its SDK state (openai-agents'
  ``RunState``, pydantic-ai's message history, an Anthropic messages list, a LangGraph
  checkpoint) saved at the pause, reused after the run moved on (the decision recorded;
  the tool run and its result recorded; written; the run completed): the tool never runs
  again and nothing is sent or written twice. What the attempt given the older state
  does is the adapter's `OlderState`: it completes (the ledger alone leads on from each
  of those stages), or it is refused with a `ControlError` before any effect and the run
  goes on from its latest state, or the SDK branches from it and the branch goes on with
  the ledger's record, or, where the SDK's state is the history itself (an ADK
  session), it comes back as the decision sent again, a stale one changing nothing. A
  state saved *before* the model's reply that asked for the call
  (``before_reply``) lacks the call: an adapter that keeps no record of that reply may
  instead refuse the attempt before any effect, with a typed error naming the call
  (`StaleStateCase.refusal_allowed`); never run the call again, nor lose its result.
* `OneWriterCase`: the reference runner's one-writer cases through an adapter: two
  attempts that loaded the same version (exactly one goes on), and an attempt superseded
  by a rival's claim while it waits on the model or while its tool body runs (it does
  nothing more; the rival finishes, or finds the call in doubt). Where the SDK's saver
  is the fence (`Fence.CHECKPOINT`: one write per saved state, LangGraph's
  ``OneWriterSaver``), the rival is a second resumer of the same saved state and the
  first of the two to write goes on.
* `OutputCase`: a final output, plain text or a structured value that is not JSON
  (`Structured`: a datetime, a Decimal, bytes, a set, a tuple, a dict with int keys, a
  NaN), with the run reloaded at every event boundary (`boundary_of`, a store
  snapshotting every event): the reloaded run ends as the uninterrupted one did, except
  that a lossy output (``lossless=False``) is never rebuilt: staged and unsettled, its
  envelope fails closed (`RunNotResumable`, DESIGN §2.3); completed, a retried request
  gets its recorded plain form. An adapter that records the model's reply as the API sent
  it, from which the SDK parses the structured value again (``reparsed``: the Anthropic
  SDK's ``output_format``), keeps every shape whole.

Use them in your own property tests::

    @given(reply_cases())
    def test_replies(case):
        check_reply(case, play_my_adapter(case))
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import decimal
import enum
import itertools
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from statemachine import events as ev
from statemachine.errors import ControlError
from statemachine.payloads import JSON
from statemachine.testing.corners import CaseFailed
from statemachine.values import Resolution

if TYPE_CHECKING:  # a strategy imports Hypothesis when it is built (the kit runs without it)
    from hypothesis import strategies as st

__all__ = [
    "PLAIN_TEXT",
    "STRUCTURED_TEXT",
    "Boundary",
    "CallKind",
    "Decision",
    "DecisionMixCase",
    "DecisionSeen",
    "FaultSeen",
    "Fence",
    "OlderState",
    "OneWriterCase",
    "OneWriterSeen",
    "OutputCase",
    "OutputSeen",
    "OutputShape",
    "RecordedFault",
    "RecordedFaultCase",
    "ReplyCase",
    "ReplySeen",
    "RivalPoint",
    "StaleMove",
    "StaleSeen",
    "StaleStateCase",
    "Structured",
    "boundary_of",
    "check_decision_mix",
    "check_one_writer",
    "check_output",
    "check_recorded_fault",
    "check_reply",
    "check_stale_state",
    "decision_mix_cases",
    "every_decision_mix_case",
    "every_one_writer_case",
    "every_output_case",
    "every_recorded_fault_case",
    "every_reply_case",
    "every_stale_state_case",
    "reply_cases",
]


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise CaseFailed(what)


def _counts(pairs: Iterable[tuple[str, JSON]]) -> Counter[str]:
    return Counter(call_id for call_id, _ in pairs)


# ------------------------------------------------------------------ one reply, mixed

class CallKind(enum.StrEnum):
    """Where a call of a reply stood when the attempt running it stopped."""

    NEW = "new"
    """No attempt started it: approved (or needing no approval) and unstarted."""
    CACHED = "cached"
    """It ran and its result was recorded, not yet written."""
    IN_DOUBT = "in_doubt"
    """Its body started and never reported a result."""


NEW, CACHED, IN_DOUBT = CallKind

SETTLEMENTS = (Resolution.COMPLETED, Resolution.NOT_EXECUTED)
"""How the operator settles the calls in doubt of a reply (`ReplyCase.settle`)."""


@attrs.frozen
class ReplyCase:
    """One model reply of ``len(kinds)`` calls (``c0``, ``c1``... in the reply's order),
    each of the kind named in ``kinds`` when the attempt that ran them stopped (a crash,
    or a cancellation). Then the run is resumed: by a new process loading it from the
    store (``reload``) or by the same object; while a call is in doubt the operator
    settles each with ``settle`` (`Resolution.COMPLETED` with `settled_text`, or
    `Resolution.NOT_EXECUTED`: it runs again, once) and the run is resumed again, to its
    end. Every call is of one tool, whose body returns `result_text` of its call."""

    kinds: tuple[CallKind, ...]
    settle: Resolution = Resolution.COMPLETED
    reload: bool = True

    @property
    def ids(self) -> list[str]:
        return [f"c{i}" for i in range(len(self.kinds))]

    @property
    def label(self) -> str:
        """The kinds in order, as a test id: ``new-cached-in_doubt``."""
        return "-".join(kind.value for kind in self.kinds)

    def kind(self, call_id: str) -> CallKind:
        return self.kinds[self.ids.index(call_id)]

    def of_kind(self, kind: CallKind) -> list[str]:
        return [i for i, k in zip(self.ids, self.kinds, strict=True) if k == kind]

    @staticmethod
    def result_text(call_id: str) -> str:
        """What the tool returns for ``call_id`` (sent to the model as it is): a text with
        quotes, a backslash and a non-ASCII character, so a resend that is not
        byte-identical shows."""
        return f'{call_id}: paid "7" \\ ✓'

    @staticmethod
    def settled_text(call_id: str) -> str:
        """What the operator records for ``call_id`` settled `Resolution.COMPLETED`."""
        return f"{call_id}: settled by the operator"

    @property
    def refused_by(self) -> str | None:
        """The call the first resume's `ToolInDoubt` names (the first in doubt), or None:
        the first resume goes on."""
        doubtful = self.of_kind(IN_DOUBT)
        return doubtful[0] if doubtful else None

    @property
    def runs_after(self) -> dict[str, int]:
        """How often each call's body runs from the first resume on: a new call once, a
        cached one never, one in doubt never (once, after `Resolution.NOT_EXECUTED`)."""
        again = int(self.settle is Resolution.NOT_EXECUTED)
        return {i: {NEW: 1, CACHED: 0, IN_DOUBT: again}[k]
                for i, k in zip(self.ids, self.kinds, strict=True)}

    @property
    def sent(self) -> dict[str, JSON]:
        """The output the model is sent for each call, exactly once."""
        settled = self.settle is Resolution.COMPLETED
        return {i: self.settled_text(i) if k == IN_DOUBT and settled else self.result_text(i)
                for i, k in zip(self.ids, self.kinds, strict=True)}


def every_reply_case(max_calls: int = 3, *, every_variant_up_to: int = 2) -> list[ReplyCase]:
    """Every mix and order of one to ``max_calls`` calls, resumed from the store and
    settled `Resolution.COMPLETED`; those of up to ``every_variant_up_to`` calls also
    resumed by the same object, and (with a call in doubt) settled
    `Resolution.NOT_EXECUTED`."""
    cases = []
    for size in range(1, max_calls + 1):
        for kinds in itertools.product(CallKind, repeat=size):
            if size > every_variant_up_to:
                cases.append(ReplyCase(kinds))
                continue
            settles = SETTLEMENTS if IN_DOUBT in kinds else SETTLEMENTS[:1]
            cases.extend(ReplyCase(kinds, settle, reload)
                         for settle in settles for reload in (True, False))
    return cases


def reply_cases(max_calls: int = 8) -> st.SearchStrategy[ReplyCase]:
    """Replies of one to ``max_calls`` calls of any kinds, settled and resumed either way."""
    from hypothesis import strategies as hs
    return hs.builds(ReplyCase,
                     hs.lists(hs.sampled_from(CallKind), min_size=1,
                              max_size=max_calls).map(tuple),
                     hs.sampled_from(SETTLEMENTS), hs.booleans())


@attrs.frozen
class ReplySeen:
    """What a player saw from the first resume on."""

    refused_by: str | None
    """The call id the first resume's `ToolInDoubt` named; None when it was not refused
    (any other error is raised by the player itself)."""
    runs: Mapping[str, int]
    """How often each call's body ran (counted in the bodies)."""
    sent: Sequence[tuple[str, JSON]]
    """Every (call id, output) pair of every model request."""
    model_calls: int
    written: Sequence[tuple[str, JSON]]
    """Every (call id, output) pair the Session (history) holds at the end."""
    completed: bool
    refused_did: int = 0
    """Tool bodies run and model requests made by the refused resume (none may be)."""


def check_reply(case: ReplyCase, seen: ReplySeen) -> None:
    """`CaseFailed` unless ``seen`` is what ``case`` says must happen."""
    _expect(seen.refused_by == case.refused_by,
            f"the first resume was refused naming {seen.refused_by!r}; the case says "
            f"{case.refused_by!r} (kinds {case.label})")
    _expect(seen.refused_did == 0, f"the refused resume ran {seen.refused_did} tool bodies "
            "or model requests; a call in doubt refuses it before any (kinds "
            f"{case.label})")
    runs = {i: seen.runs.get(i, 0) for i in case.ids}
    _expect(runs == case.runs_after, f"the bodies ran {runs} times from the first resume "
            f"on; the case says {case.runs_after} (kinds {case.label})")
    _expect(seen.model_calls == 1, f"the model was asked {seen.model_calls} times after the "
            "crash; only the next answer may be asked (the reply is never asked again)")
    for what, pairs in (("sent to the model", seen.sent), ("written", seen.written)):
        counts = _counts(pairs)
        _expect(counts == Counter(case.ids),
                f"the outputs {what}, by call: {dict(counts)}; each call exactly once")
        found = dict(pairs)
        _expect(found == case.sent, f"the outputs {what} were {found}; the case says "
                f"{case.sent}")
    _expect(seen.completed, "the run did not complete")


# ------------------------------------------------- decisions beside new and cached calls

class Decision(enum.StrEnum):
    """How the one message that decides a reply's calls answers a call awaiting it."""

    CONFIRMED = "confirmed"
    REJECTED = "rejected"


CONFIRMED, REJECTED = Decision

MixKind = CallKind | Decision
"""A call of a `DecisionMixCase`: one needing no decision (`NEW` or `CACHED`), or one
awaiting a decision and how it is answered."""


@attrs.frozen
class DecisionMixCase:
    """One model reply of ``len(kinds)`` calls (``c0``, ``c1``... in the reply's order):
    a `NEW` or `CACHED` call needs no decision and stood where its kind says when the
    attempt that ran them stopped (a crash, or a cancellation), before any call needing
    a decision was asked about; a `Decision` call needs one. The run is resumed (by a
    new process loading it from the store when ``reload``, else by the same object): it
    runs the new calls, answers the cached ones from their record, asks for every
    decision and pauses. Then one message confirms the `CONFIRMED` calls and rejects the
    `REJECTED` ones, and the run goes on to its end. Every call's body returns
    `ReplyCase.result_text` of its call."""

    kinds: tuple[MixKind, ...]
    reload: bool = True

    @property
    def ids(self) -> list[str]:
        return [f"c{i}" for i in range(len(self.kinds))]

    @property
    def label(self) -> str:
        """The kinds in order, as a test id: ``new-confirmed-rejected``."""
        return "-".join(kind.value for kind in self.kinds)

    def kind(self, call_id: str) -> MixKind:
        return self.kinds[self.ids.index(call_id)]

    def of_kind(self, kind: MixKind) -> list[str]:
        return [i for i, k in zip(self.ids, self.kinds, strict=True) if k == kind]

    @property
    def asked(self) -> list[str]:
        """The calls the resumed run asks a decision for, each once, in reply order."""
        return [i for i, k in zip(self.ids, self.kinds, strict=True)
                if isinstance(k, Decision)]

    @property
    def runs_after(self) -> dict[str, int]:
        """How often each call's body runs from the resume on: a new or confirmed call
        once, a cached or rejected one never."""
        return {i: int(k in (NEW, CONFIRMED)) for i, k in zip(self.ids, self.kinds,
                                                             strict=True)}

    @property
    def rejected(self) -> list[str]:
        return self.of_kind(REJECTED)


def every_decision_mix_case(max_calls: int = 3, *,
                            every_variant_up_to: int = 2) -> list[DecisionMixCase]:
    """Every mix and order of one to ``max_calls`` calls holding at least one call
    awaiting a decision (the mixes without one are `every_reply_case`'s), resumed from the
    store; those of up to ``every_variant_up_to`` calls also by the same object."""
    kinds: tuple[MixKind, ...] = (NEW, CACHED, CONFIRMED, REJECTED)
    cases: list[DecisionMixCase] = []
    for size in range(1, max_calls + 1):
        for mix in itertools.product(kinds, repeat=size):
            if not any(isinstance(k, Decision) for k in mix):
                continue
            reloads = (True, False) if size <= every_variant_up_to else (True,)
            cases.extend(DecisionMixCase(mix, reload) for reload in reloads)
    return cases


def decision_mix_cases(max_calls: int = 8) -> st.SearchStrategy[DecisionMixCase]:
    """Replies of one to ``max_calls`` calls, at least one awaiting a decision, resumed
    either way."""
    from hypothesis import strategies as hs
    kinds = hs.sampled_from((NEW, CACHED, CONFIRMED, REJECTED))
    return hs.builds(DecisionMixCase,
                     hs.lists(kinds, min_size=1, max_size=max_calls).filter(
                         lambda mix: any(isinstance(k, Decision) for k in mix)).map(tuple),
                     hs.booleans())


@attrs.frozen
class DecisionSeen:
    """What a player saw from the resume on."""

    asked: Sequence[str]
    """The call id of each decision request the run made (one per request)."""
    runs: Mapping[str, int]
    """How often each call's body ran (counted in the bodies)."""
    sent: Sequence[tuple[str, JSON]]
    """Every (call id, output) pair of every model request."""
    model_calls: int
    written: Sequence[tuple[str, JSON]]
    """Every (call id, output) pair the history holds at the end, not counting the
    answer an SDK writes for a call while it awaits its decision."""
    rejection: JSON
    """The output the SDK sends the model for a rejected call (its own text)."""
    completed: bool


def check_decision_mix(case: DecisionMixCase, seen: DecisionSeen) -> None:
    """`CaseFailed` unless ``seen`` is what ``case`` says must happen."""
    asked = Counter(seen.asked)
    _expect(asked == Counter(case.asked), f"decisions were asked for {dict(asked)}; the "
            f"case says once for each of {case.asked} (kinds {case.label})")
    runs = {i: seen.runs.get(i, 0) for i in case.ids}
    _expect(runs == case.runs_after, f"the bodies ran {runs} times from the resume on; "
            f"the case says {case.runs_after} (kinds {case.label})")
    _expect(seen.model_calls == 1, f"the model was asked {seen.model_calls} times from "
            "the resume on; only once the decisions were taken (a pause asks nothing)")
    rejected = set(case.rejected)
    _expect(all(seen.rejection != ReplyCase.result_text(i) for i in rejected),
            "the rejection the SDK sends is a rejected call's result")
    expected = {i: seen.rejection if i in rejected else ReplyCase.result_text(i)
                for i in case.ids}
    for what, pairs in (("sent to the model", seen.sent), ("written", seen.written)):
        counts = _counts(pairs)
        _expect(counts == Counter(case.ids),
                f"the outputs {what}, by call: {dict(counts)}; each call exactly once")
        found = dict(pairs)
        _expect(found == expected, f"the outputs {what} were {found}; the case says "
                f"{expected} (kinds {case.label})")
    _expect(seen.completed, "the run did not complete")


# ---------------------------------------------------- a fault after a recorded result

class RecordedFault(enum.StrEnum):
    """How an attempt fails after a call's result was recorded."""

    WRITE_REFUSED = "write_refused"
    """The write carrying the result raises having written nothing."""
    WRITE_LANDED = "write_landed"
    """The write carrying the result lands whole, then raises (commit then raise)."""
    REQUEST_FAILED = "request_failed"
    """The model request after the result was written raises."""


WRITE_REFUSED, WRITE_LANDED, REQUEST_FAILED = RecordedFault


@attrs.frozen
class RecordedFaultCase:
    """One reply with one call, ``c0``, needing no approval; its body returns
    `ReplyCase.result_text`. After its result is recorded, ``fault`` hits the next
    ``repeats`` attempts in a row (each resumed from the store when ``reload``); the one
    after goes on to the model's final answer."""

    fault: RecordedFault
    repeats: int = 1
    reload: bool = True

    call_id = "c0"

    @property
    def result(self) -> str:
        return ReplyCase.result_text(self.call_id)

    @property
    def requests(self) -> int:
        """Model requests made in all: the reply, each failed request, the final answer.
        A failed write stops its attempt before the model is asked."""
        return 2 + (self.repeats if self.fault == REQUEST_FAILED else 0)


def every_recorded_fault_case() -> list[RecordedFaultCase]:
    """Each fault once and twice in a row (a write that landed is acknowledged by the next
    attempt, never written again: it fails only once), resumed either way."""
    return [RecordedFaultCase(fault, repeats, reload) for fault in RecordedFault
            for repeats in ((1,) if fault == WRITE_LANDED else (1, 2))
            for reload in (True, False)]


@attrs.frozen
class FaultSeen:
    errors: Sequence[BaseException]
    """What each attempt but the last raised, in order."""
    injected: type[BaseException]
    """The type of the error the fault raises."""
    runs: int
    """How often the body ran, in all."""
    requests: Sequence[Sequence[tuple[str, JSON]]]
    """Each model request, as the (call id, output) pairs it carried."""
    answered: Sequence[bool]
    """For each model request, whether it was answered (a failed one was not)."""
    written: Sequence[tuple[str, JSON]]
    completed: bool


def check_recorded_fault(case: RecordedFaultCase, seen: FaultSeen) -> None:
    _expect(len(seen.errors) == case.repeats and all(
        isinstance(error, seen.injected) for error in seen.errors),
        f"the failing attempts raised {[type(e).__name__ for e in seen.errors]}; the case "
        f"says {case.repeats} x {seen.injected.__name__} (the original error, I6)")
    _expect(seen.runs == 1, f"the tool ran {seen.runs} times; once")
    _expect(len(seen.requests) == case.requests,
            f"the model was asked {len(seen.requests)} times; the case says {case.requests}")
    for n, pairs in enumerate(seen.requests):
        _expect(_counts(pairs)[case.call_id] <= 1,
                f"request {n + 1} carried {case.call_id}'s output more than once")
    last = dict(seen.requests[-1]) if seen.requests else {}
    _expect(last.get(case.call_id) == case.result,
            f"the final request carried {last.get(case.call_id)!r} for {case.call_id}; the "
            f"case says {case.result!r}")
    answered = [pairs for pairs, ok in zip(seen.requests, seen.answered, strict=True) if ok]
    carried = sum(_counts(pairs)[case.call_id] > 0 for pairs in answered)
    _expect(carried == 1, f"{carried} answered requests carried the result; exactly one")
    _expect(seen.written == [(case.call_id, case.result)],
            f"the Session holds {list(seen.written)}; exactly the one result")
    _expect(seen.completed, "the run did not complete")


# ---------------------------------------------------- an older SDK state, reused

class StaleMove(enum.StrEnum):
    """How far a run moved after its SDK state was saved at its pause."""

    DECIDED = "decided"
    """The call was approved."""
    RECORDED = "recorded"
    """Its tool ran and its result was recorded, not written (the write was refused)."""
    WRITTEN = "written"
    """The result was written (the next model request failed)."""
    COMPLETED = "completed"
    """The run completed."""


DECIDED, RECORDED, WRITTEN, COMPLETED = StaleMove


class OlderState(enum.StrEnum):
    """What an adapter does with an SDK state older than the run's latest (one saved
    before the run moved on)."""

    FOLLOWED = "followed"
    """The ledger leads on from it: the attempt completes, a completed run answered from
    its record (no model call, no tool)."""
    REFUSED = "refused"
    """Refused with a `ControlError` before any effect (no tool body, no model request,
    nothing written), the run unchanged; the run then resumed from its latest state
    completes as `FOLLOWED` does (LangGraph's ``OneWriterSaver``: time travel)."""
    FORKED = "forked"
    """The SDK branches from it, and the branch goes on with the ledger's record (nothing
    runs again); the adapter keeps no final output, so even a completed run's branch
    asks the model for its answer again (LangGraph's time travel on its own saver)."""
    RESENT = "resent"
    """The SDK's state is the history itself (an ADK session), so the older state comes
    back as the decision the pause asked for, sent again (the SDK writes it into the
    history first). One the SDK never got (`DECIDED`: recorded through the ledger) goes
    on as `FOLLOWED` does; one it got and acted on is stale: the attempt given it runs no
    tool and asks no model, returning or refused with a `ControlError`, and the run
    completes on new input, asking the model once (a completed run has nothing to go on
    with: the adapter keeps no final output to replay)."""


FOLLOWED, REFUSED, FORKED, RESENT = OlderState


@attrs.frozen
class StaleStateCase:
    """One call, ``c0``, needing approval: the run pauses and its SDK state is saved;
    the call is approved and the run moves on as far as ``moved`` says; then an attempt
    (on a run loaded from the store when ``reload``) is given the state saved at the
    pause, to which the adapter answers as ``older`` says, or, when ``before_reply``, the
    state saved before the model's reply that asked for the call (the request that reply
    answered, as a caller keeps its messages when it sends them): a state that lacks the
    call. A decision recorded through the ledger (or the operator) leaves the saved state
    the run's latest; every later stage moves the SDK state on past it."""

    moved: StaleMove
    reload: bool = True
    before_reply: bool = False
    older: OlderState = FOLLOWED

    call_id = "c0"

    @property
    def result(self) -> str:
        return ReplyCase.result_text(self.call_id)

    @property
    def runs(self) -> int:
        """How often the body runs in all: once (before the reuse unless only decided)."""
        return 1

    @property
    def runs_before(self) -> int:
        """How often the body ran before the reuse: once, unless only decided."""
        return 0 if self.moved == DECIDED else 1

    @property
    def refusal_allowed(self) -> bool:
        """Whether a typed refusal is an acceptable end: only for a state saved before the
        reply, once the ledger holds the call the state lacks and the run has not
        completed. Asked again from that state, the model asks anew (a real API names
        each call afresh), so an adapter that keeps no record of the first reply cannot
        lead on from it: the call the ledger holds would run a second time under another
        id, or its result never reach the model. Such an adapter refuses the attempt
        before any effect (no model request, no tool run) with a `ControlError` naming
        the call; one that can answer the request from its record completes as from the
        pause. A completed run answers from its record either way."""
        return self.before_reply and self.moved != COMPLETED

    @property
    def refused(self) -> bool:
        """Whether the attempt given the saved state is refused: only by an adapter that
        refuses an older state, and only once the run moved on past the decision."""
        return self.older == REFUSED and self.moved != DECIDED

    @property
    def stale(self) -> bool:
        """Whether the attempt is given a decision the SDK already acted on (`RESENT`,
        once the run moved on past the decision)."""
        return self.older == RESENT and self.moved != DECIDED

    @property
    def replayed(self) -> bool:
        """Whether the attempt that completes (the one given the saved state, or after a
        refusal the one resumed from the latest state) answers from the record of a run
        that had completed, asking no model and running no tool: never on a branch, nor
        for an adapter that keeps no final output."""
        return self.moved == COMPLETED and self.older not in (FORKED, RESENT)

    @property
    def model_calls(self) -> int:
        """Model requests made by the attempt that completes: the next answer, none when
        it replays a completed run, nor when a stale decision met a completed run."""
        return 0 if self.replayed or (self.stale and self.moved == COMPLETED) else 1


def every_stale_state_case(older: OlderState = FOLLOWED, *,
                           before_reply: bool = False) -> list[StaleStateCase]:
    """Each stage, resumed either way, with the state saved at the pause, answered as
    ``older`` says; with ``before_reply``, also with the state saved before the reply."""
    saved = (False, True) if before_reply else (False,)
    return [StaleStateCase(moved, reload, early, older) for early in saved
            for moved in StaleMove
            for reload in (True, False)]


@attrs.frozen
class StaleSeen:
    runs: int
    """How often the body ran, in all."""
    error: BaseException | None
    """What the attempt given the old state raised (None: it returned)."""
    completed: bool
    """Whether the attempt that completes did: the one given the old state, or (it was
    refused) the one resumed from the run's latest state after it."""
    replayed: bool
    """That attempt returned a completed run's recorded result (no model, no tool)."""
    model_calls: int
    """Model requests made by that attempt."""
    sent: Sequence[tuple[str, JSON]]
    """The (call id, output) pairs of the last model request of the whole run."""
    written: Sequence[tuple[str, JSON]]
    """The (call id, output) pairs the run's history holds at the end (every write the
    run made, for a run whose caller carries its messages; the latest branch, for an SDK
    that branches)."""
    carried: Sequence[tuple[str, JSON]] | None = None
    """The (call id, output) pairs of the messages the attempt handed back for its caller
    to carry (None for an SDK whose Session is the history)."""
    refused_did: int = 0
    """Tool bodies run and model requests made by the refused attempt, or by the one
    given a stale decision (none may be)."""


def check_stale_state(case: StaleStateCase, seen: StaleSeen) -> None:
    """Every stage a run moves to is one its ledger alone leads on from (it holds the
    decision, the result, and what was written), so an older SDK state never makes the
    tool run again nor anything be sent or written twice: the attempt given one
    completes (an adapter that cannot use it goes on without it), or, where the adapter
    refuses an older state, is refused before any effect and the run completes from its
    latest state. The one exception (`StaleStateCase.refusal_allowed`): a state saved
    before the reply may be refused before any effect, with a typed error naming the
    call."""
    if seen.error is not None and case.refusal_allowed:
        _expect(isinstance(seen.error, ControlError),
                f"the attempt given a state saved before the reply raised {seen.error!r}; "
                f"only a typed refusal (a ControlError) may end it (moved to "
                f"{case.moved.value})")
        _expect(case.call_id in str(seen.error), f"the refusal does not name "
                f"{case.call_id}, the call the older state lacks: {seen.error}")
        _expect(seen.model_calls == 0, f"the refused attempt asked the model "
                f"{seen.model_calls} times; a refusal comes before any effect")
        _expect(seen.runs == case.runs_before, f"the tool ran {seen.runs} times; the "
                f"refused attempt may run nothing ({case.runs_before} before it)")
        return
    where = f"moved to {case.moved.value}, older state {case.older.value}"
    _expect(seen.runs == case.runs, f"the tool ran {seen.runs} times; once ({where})")
    if case.refused:
        _expect(isinstance(seen.error, ControlError),
                f"the attempt given the older state ended with {seen.error!r}; the case "
                f"says it is refused with a ControlError ({where})")
        _expect(seen.refused_did == 0, f"the refused attempt ran {seen.refused_did} tool "
                f"bodies or model requests; it is refused before any ({where})")
    elif case.stale:
        _expect(seen.error is None or isinstance(seen.error, ControlError),
                f"the decision sent again ended with {seen.error!r}; a stale one is "
                f"ignored or refused with a ControlError ({where})")
        _expect(seen.refused_did == 0, f"the decision sent again ran {seen.refused_did} "
                f"tool bodies or model requests; it was acted on already ({where})")
    else:
        _expect(seen.error is None, f"the attempt given the older state raised "
                f"{seen.error!r}; the case says it completes ({where})")
    _expect(seen.completed, f"the run did not complete ({where})")
    _expect(seen.replayed is case.replayed,
            f"replayed={seen.replayed}: the case says {case.replayed} ({where})")
    _expect(seen.model_calls == case.model_calls,
            f"the attempt that completed asked the model {seen.model_calls} times; the "
            f"case says {case.model_calls} ({where})")
    _expect(dict(seen.sent) == {case.call_id: case.result} and len(seen.sent) == 1,
            f"the last request carried {list(seen.sent)}; the one result, once")
    _expect(list(seen.written) == [(case.call_id, case.result)],
            f"the history holds {list(seen.written)}; the one result, once")
    if seen.carried is not None:
        _expect(list(seen.carried) == [(case.call_id, case.result)],
                f"the messages handed back hold {list(seen.carried)}; the one result, once")


# ------------------------------------------------------------------ one writer

class RivalPoint(enum.StrEnum):
    """Where a rival's claim falls in an attempt."""

    LOADED = "loaded"
    """Before it: both loaded the same version, and the rival went first."""
    MODEL_CALL = "model_call"
    """While it waits on the model."""
    TOOL_BODY = "tool_body"
    """While its tool body runs (its start already durable)."""


LOADED, MODEL_CALL, TOOL_BODY = RivalPoint


class Fence(enum.StrEnum):
    """What stops an attempt that a rival superseded."""

    CLAIM = "claim"
    """The run's claim: recorded at the attempt's start and checked before every effect
    (the reference runner, the openai-agents and pydantic-ai adapters). The rival claims
    the run (another process, its own store connection) where `RivalPoint` says, and
    resumes it once the first attempt has ended."""
    CHECKPOINT = "checkpoint"
    """The saved state the attempt resumed from: the SDK's saver takes one write per
    parent state, so of two resumers of one saved state the first to write goes on and
    the other's first write is refused, the steps before it run (LangGraph's
    ``OneWriterSaver``: a resumer's first step is its model call). The saved state
    holds the run's input, its next step the model call; both resumers read it before
    either goes on, and the rival's steps run where `RivalPoint` says, to its end."""


CLAIM, CHECKPOINT = Fence


@attrs.frozen
class OneWriterCase:
    """A run whose one reply holds one call, ``c0``, needing no approval. The first
    attempt and a rival (another process: its own store connection) race as ``rival_at``
    says, the store appending per event or ``buffered``, the superseded one stopped by
    ``fence``."""

    rival_at: RivalPoint
    buffered: bool = False
    fence: Fence = CLAIM

    call_id = "c0"

    @property
    def first_goes_on(self) -> bool:
        """Whether the first attempt is the one that goes on: under `CHECKPOINT` when its
        write after the model call landed before the rival wrote (the rival came while
        its tool body ran); under `CLAIM` never (the rival's claim supersedes it)."""
        return self.fence == CHECKPOINT and self.rival_at == TOOL_BODY

    @property
    def first_outcome(self) -> str:
        """How the first attempt ends: refused (`ConcurrencyConflict`), having done
        nothing after the rival's claim (or write); or completed."""
        return "completed" if self.first_goes_on else "ConcurrencyConflict"

    @property
    def first_runs(self) -> int:
        """Tool bodies the first attempt runs: only one started before the rival came."""
        return 1 if self.rival_at == TOOL_BODY else 0

    @property
    def rival_outcome(self) -> str:
        """How the rival's attempt ends: completed; or (`CLAIM`: the first attempt's call
        started and never recorded) refused with `ToolInDoubt`, never running it again;
        or (`CHECKPOINT`: the first attempt wrote first) its first write refused with
        `ConcurrencyConflict`, having run no tool."""
        if self.rival_at != TOOL_BODY:
            return "completed"
        return "ConcurrencyConflict" if self.fence == CHECKPOINT else "ToolInDoubt"

    @property
    def first_model_calls(self) -> int:
        """Model requests the first attempt made: under `CLAIM` none when the rival went
        first, else the one it waited on; under `CHECKPOINT` its first step's, and, going
        on, the final answer's."""
        if self.fence == CHECKPOINT:
            return 2 if self.first_goes_on else 1
        return 0 if self.rival_at == LOADED else 1

    @property
    def written(self) -> list[tuple[str, JSON]]:
        """What the Session holds at the end: the one result, unless no attempt went on
        (the call left in doubt)."""
        if self.rival_outcome == "completed" or self.first_outcome == "completed":
            return [(self.call_id, ReplyCase.result_text(self.call_id))]
        return []


def every_one_writer_case(fence: Fence = CLAIM) -> list[OneWriterCase]:
    return [OneWriterCase(point, buffered, fence) for point in RivalPoint
            for buffered in (False, True)]


@attrs.frozen
class OneWriterSeen:
    first_outcome: str
    """``"completed"`` or the type name of the first attempt's error."""
    first_runs: int
    first_model_calls: int
    first_writes_after: int
    """Session writes the first attempt made after the rival's claim (or first write)."""
    rival_outcome: str
    rival_runs: int
    written: Sequence[tuple[str, JSON]]
    """The (call id, output) pairs the Session holds at the end."""
    rival_writes: int = 0
    """Session writes the rival made (none may be when it is refused)."""


def check_one_writer(case: OneWriterCase, seen: OneWriterSeen) -> None:
    where = f"rival at {case.rival_at.value}, fenced by {case.fence.value}"
    _expect(seen.first_outcome == case.first_outcome,
            f"the first attempt ended {seen.first_outcome}; the case says "
            f"{case.first_outcome} ({where})")
    _expect(seen.first_runs == case.first_runs,
            f"the first attempt ran the tool {seen.first_runs} times; the case says "
            f"{case.first_runs} ({where})")
    _expect(seen.first_model_calls == case.first_model_calls,
            f"the first attempt asked the model {seen.first_model_calls} times; the "
            f"case says {case.first_model_calls} ({where})")
    if case.first_outcome != "completed":
        _expect(seen.first_writes_after == 0, f"the superseded attempt wrote to the "
                f"Session {seen.first_writes_after} times after the rival came ({where})")
    _expect(seen.rival_outcome == case.rival_outcome,
            f"the rival ended {seen.rival_outcome}; the case says {case.rival_outcome} "
            f"({where})")
    if case.rival_outcome != "completed":
        _expect(seen.rival_writes == 0, f"the refused rival wrote to the Session "
                f"{seen.rival_writes} times ({where})")
    _expect(seen.first_runs + seen.rival_runs == 1,
            f"the tool ran {seen.first_runs} + {seen.rival_runs} times; once in all")
    _expect(list(seen.written) == case.written,
            f"the Session holds {list(seen.written)}; the case says {case.written}")


# ------------------------------------------------------------------ final outputs


@dataclasses.dataclass
class Structured:
    """A final output that is not JSON: every field is of a type JSON lacks (a NaN
    among them, which is not equal to itself)."""

    when: _dt.datetime
    amount: decimal.Decimal
    raw: bytes
    tags: frozenset[str]
    pair: tuple[int, int]
    names: dict[int, str]
    ratio: float


STRUCTURED_TEXT = ('{"when": "2026-01-01T12:00:00Z", "amount": "7.10", "raw": "abc", '
                   '"tags": ["b", "a"], "pair": [1, 2], "names": {"1": "one"}, '
                   '"ratio": NaN}')
"""The model's answer a `Structured` output is parsed from (JSON with a NaN, as pydantic
reads it)."""

class OutputShape(enum.StrEnum):
    """What a run's final output is."""

    TEXT = "text"
    """Plain text (`PLAIN_TEXT`): lossless."""
    DATACLASS = "dataclass"
    """A `Structured` dataclass."""
    MODEL = "model"
    """A pydantic model of `Structured`'s fields (the player defines it: this module
    imports no pydantic)."""


TEXT, DATACLASS, MODEL = OutputShape

PLAIN_TEXT = "the answer is 42, ✓"
"""The ``text`` shape's output."""


class Boundary(enum.StrEnum):
    """Where a crash falls in a run whose one reply is its final answer (`boundary_of`)."""

    BEFORE_ANSWER = "before_answer"
    """The final answer not recorded."""
    ANSWERED = "answered"
    """The answer recorded, not accepted."""
    ACCEPTED = "accepted"
    """Accepted, its write not staged."""
    STAGED = "staged"
    """Its write staged, the Session not written."""
    WRITTEN = "written"
    """Staged and written, not committed."""
    COMPLETED = "completed"
    """Committed: the run completed."""


BEFORE_ANSWER, ANSWERED, ACCEPTED, STAGED, WRITTEN_UNCOMMITTED, DONE = Boundary


def boundary_of(events: Sequence[ev.Event], *, written: bool = False) -> Boundary:
    """The boundary a durable log prefix stops at, from its events' types (``written``:
    the Session holds the staged batch). The run's one reply is its final answer."""
    accepted = next((n for n, e in enumerate(events)
                     if isinstance(e, ev.FinalOutputAccepted)), None)
    if accepted is None:
        answered = any(isinstance(e, ev.ModelResponded) and not e.tool_calls for e in events)
        return ANSWERED if answered else BEFORE_ANSWER
    after = events[accepted + 1:]
    settled = (ev.PublicationCommitted, ev.ReconciledAcknowledge, ev.RunCompleted)
    if any(isinstance(e, settled) for e in after):
        return DONE
    if any(isinstance(e, ev.PublicationStaged) for e in after):
        return WRITTEN_UNCOMMITTED if written else STAGED
    return ACCEPTED


@attrs.frozen
class OutputCase:
    """A run whose model answers at once with a final output of ``shape``, crashed at
    ``boundary`` and resumed by a new process (with ``take_over=True``: the crashed one is
    gone), given the request's input again only if the crashed attempt had not recorded
    it. ``reparsed``: the adapter records the model's reply as the API sent it (the
    answer's text), and the SDK parses the structured value from that text again each
    time the reply is handed back (the Anthropic SDK's ``output_format``)."""

    shape: OutputShape
    boundary: Boundary
    reparsed: bool = False

    @property
    def lossless(self) -> bool:
        """Whether the ledger keeps the output whole: plain JSON, or a reply it records
        as the API sent it (``reparsed``)."""
        return self.shape == TEXT or self.reparsed

    @property
    def outcome(self) -> str:
        """``"completed"``; ``"RunNotResumable"`` for a lossy output whose write was
        staged and never settled (its envelope fails closed: the output cannot be rebuilt
        to write it again); ``"replayed"`` for a run that had completed (its recorded
        result, no model call)."""
        if self.boundary == DONE:
            return "replayed"
        if not self.lossless and self.boundary in (STAGED, WRITTEN_UNCOMMITTED):
            return "RunNotResumable"
        return "completed"

    @property
    def model_calls(self) -> int:
        """The model is asked again only when its answer was never recorded."""
        return 1 if self.boundary == BEFORE_ANSWER else 0

    @property
    def same_output(self) -> bool:
        """Whether the resumed attempt's output equals the uninterrupted run's (else: its
        recorded plain JSON form, or nothing when refused)."""
        if self.outcome == "completed":
            return self.lossless or self.boundary in (BEFORE_ANSWER, ANSWERED, ACCEPTED)
        return self.outcome == "replayed" and self.lossless


def every_output_case(*, reparsed: bool = False) -> list[OutputCase]:
    return [OutputCase(shape, boundary, reparsed) for shape in OutputShape
            for boundary in Boundary]


@attrs.frozen
class OutputSeen:
    outcome: str
    """``"completed"``, ``"replayed"``, or the type name of the error."""
    output: Any
    """The attempt's final output (None when refused)."""
    recorded: JSON
    """The final output the ledger recorded (its plain JSON form), if any."""
    lossless: bool | None
    """The ``lossless`` flag the ledger recorded with it (None: none recorded)."""
    model_calls: int
    written: int
    """How many items of the final answer the Session holds at the end (a run without a
    Session: how many final answers its record holds)."""


def _same(a: Any, b: Any) -> bool:
    """Equal, NaN counting as equal to NaN (``repr`` of the values)."""
    return type(a) is type(b) and repr(a) == repr(b)


def check_output(case: OutputCase, seen: OutputSeen, uninterrupted: Any, *,
                 output_type: type | None = None) -> None:
    """``uninterrupted``: the final output of the run no crash interrupted;
    ``output_type``: the class of a structured output (a recorded one is never an
    instance)."""
    _expect(seen.outcome == case.outcome, f"crashed at {case.boundary}, the resumed attempt "
            f"ended {seen.outcome}; the case says {case.outcome} ({case.shape})")
    _expect(seen.model_calls == case.model_calls,
            f"crashed at {case.boundary}, the model was asked {seen.model_calls} times")
    if case.outcome == "RunNotResumable":
        _expect(seen.output is None, "a refused attempt handed out an output")
        landed = int(case.boundary == WRITTEN_UNCOMMITTED)  # by the attempt that crashed
        _expect(seen.written == landed, f"the Session holds {seen.written} copies of the "
                f"answer; a refused attempt writes nothing ({landed} were there)")
        return
    if seen.lossless is not None:
        _expect(seen.lossless is case.lossless,
                f"the ledger recorded lossless={seen.lossless} for a {case.shape} output")
    _expect(seen.written == 1, f"the Session holds {seen.written} copies of the answer; one")
    if case.same_output:
        _expect(_same(seen.output, uninterrupted), f"crashed at {case.boundary}, the output "
                f"{seen.output!r} differs from the uninterrupted run's {uninterrupted!r}")
    else:  # the recorded plain form, never rebuilt
        _expect(seen.output == seen.recorded, f"crashed at {case.boundary}, the output "
                f"{seen.output!r} is not the recorded form {seen.recorded!r}")
        if output_type is not None:
            _expect(not isinstance(seen.output, output_type),
                    f"a lossy output was rebuilt as a {output_type.__name__}")
