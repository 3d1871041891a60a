"""What each page of the console shows, as plain data read from a store: the runs with
their blockers, the inbox, and one run (timeline, ledger, verdict, the forms it offers).

Nothing here renders HTML or knows of HTTP: the templates escape every value these
return (all of it text that came from a run's log or a store's heads).
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from collections.abc import Collection, Sequence
from typing import Any

import attrs

from statemachine import events as ev
from statemachine import operator
from statemachine.blocker import BlockerKind, Waiting
from statemachine.cli.common import shown
from statemachine.cli.describe import decision_note, describe
from statemachine.cli.operate import moment
from statemachine.controller import RunController
from statemachine.diagrams import RunPath, run_path, run_svg
from statemachine.payloads import misprints
from statemachine.stored import RunHead
from statemachine.values import LIVE_STEPS, Step

TIMELINE_EVENTS = 2_000
"""The most events a run's page lists (the newest); the rest are counted."""
KINDS = (*(k.value for k in BlockerKind), "none")
"""What the runs page counts and filters by: each blocker kind, and nothing blocking."""
DONE: dict[str, tuple[type[ev.Event], str]] = {
    "approve": (ev.CallApproved, "Approved."), "reject": (ev.CallRejected, "Rejected."),
    "resolve": (ev.InDoubtResolved, "Resolved."), "abandon": (ev.Abandoned, "Abandoned.")}
"""What a page may say was done, and the event the log must hold for it to say so."""


def now_micros() -> int:
    return time.time_ns() // 1_000


def visible(value: object) -> str:
    """``value``'s text with each character that does not print as itself (`misprints`)
    written as its escape (``\\u202e``, ``\\n``), so what a page shows is what the log
    holds: an id, a tool's name."""
    return shown(value, sys.maxsize)


def shown_json(value: Any) -> str:
    """``value`` as indented JSON, each character that does not print as itself
    (`misprints`) escaped (``\\u202e``): JSON that reads back as ``value``, and shows on
    a page exactly what it holds (what an approval binds)."""
    text = json.dumps(value, indent=2, ensure_ascii=False)
    return "".join(json.dumps(c)[1:-1] if c != "\n" and misprints(c) else c for c in text)


def age(since: int | None, now: int) -> str:
    """How long ago ``since`` was, in the largest two units ("3 h 12 min", "45 s")."""
    if since is None:
        return "unknown"
    seconds = max(0, (now - since) // 1_000_000)
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds} s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours} h {minutes} min"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours} h"


@attrs.frozen
class RunRow:
    run_id: str
    step: str
    blocker: str | None
    blocked_since: str | None
    age: str
    owner: str | None
    session_id: str | None
    events: int
    waiting: int


@attrs.frozen
class RunsPage:
    rows: tuple[RunRow, ...]
    total: int
    counts: tuple[tuple[str, int], ...]
    """Runs per blocker kind (every kind, zeros included) and unblocked, over the
    whole store whatever the filter."""
    steps: tuple[str, ...]
    chosen: frozenset[str]
    blocked: bool
    kind: str | None


def runs_page(store: Any, *, steps: Collection[Step] | None, blocked: bool,
              now: int, kind: str | None = None) -> RunsPage:
    heads: list[RunHead] = operator.runs(store)
    tally = Counter(h.blocker.kind.value if h.blocker is not None else "none" for h in heads)
    counts = tuple((k, tally[k]) for k in KINDS)
    chosen = set(steps) if steps else None
    rows = []
    for h in heads:
        if chosen is not None and h.step not in chosen:
            continue
        if blocked and h.blocker is None:
            continue
        if kind is not None and (h.blocker.kind.value if h.blocker else "none") != kind:
            continue
        b = h.blocker
        since = b.since if b is not None else h.updated_at
        rows.append(RunRow(h.run_id, h.step.name, None if b is None else b.kind.value,
                           None if b is None else moment(b.since), age(since, now),
                           h.owner, h.session_id, h.version, len(h.waiting)))
    return RunsPage(tuple(rows), len(heads), counts, tuple(s.name for s in Step),
                    frozenset(s.name for s in chosen or ()), blocked, kind)


@attrs.frozen
class InboxRow:
    entry: Waiting
    since: str | None
    age: str


def inbox_page(store: Any, *, now: int) -> tuple[InboxRow, ...]:
    return tuple(InboxRow(w, moment(w.since), age(w.since, now))
                 for w in operator.inbox(store))


@attrs.frozen
class Moment:
    """One event of a run's timeline."""

    seq: int
    kind: str
    at: str | None
    actor: str | None
    before: str | None
    after: str
    detail: str


def _actor(event: ev.Event) -> str | None:
    if isinstance(event, ev.RunClaimed):
        return event.owner
    by = getattr(event, "by", None)
    return by if isinstance(by, str) else None


def _detail(event: ev.Event) -> str:
    """What the event was about, in a few words (ids and outcomes, never payloads)."""
    if isinstance(event, ev.InDoubtResolved):
        evidence = "" if event.evidence is None else f", evidence {event.evidence}"
        return f"call {event.call_id}: {event.outcome.value}{evidence}"
    if isinstance(event, ev.Abandoned):
        return event.reason
    if isinstance(event, ev.CallApproved) and event.reason is not None:
        return f"call {event.call_id}: {event.reason}"
    call_id = getattr(event, "call_id", None)
    if isinstance(call_id, str):
        return f"call {call_id}"
    if isinstance(event, ev.ModelResponded):
        calls = len(event.tool_calls)
        return f"{calls} call{'' if calls == 1 else 's'} proposed" if calls else "an output"
    if isinstance(event, ev.ModelFailed):
        return event.error
    return ""


def timeline(events: Sequence[ev.Event], path: RunPath) -> tuple[tuple[Moment, ...], int]:
    """The newest `TIMELINE_EVENTS` events with their steps before and after (``path``:
    the log's `run_path`), and how many older ones are not listed."""
    found = [Moment(0, type(events[0]).__name__, moment(events[0].at), None, None,
                    Step.RUN_AGAIN.name, "")]
    for event, (source, dest, _) in zip(events[1:], path.moves, strict=True):
        found.append(Moment(event.seq, type(event).__name__, moment(event.at),
                            _actor(event), source.name, dest.name, _detail(event)))
    hidden = max(0, len(found) - TIMELINE_EVENTS)
    return tuple(reversed(found[hidden:])), hidden


@attrs.frozen
class RunPage:
    run_id: str
    version: int
    step: str
    live: bool
    info: dict[str, Any]
    """`describe`'s account: ledger, verdict, blocker, envelope."""
    decisions: dict[str, tuple[str, ...]]
    """Each call's decisions in words."""
    timeline: tuple[Moment, ...]
    hidden: int
    diagram: str
    """The run's part of the machine as SVG markup (`run_svg`): built from the
    declaration and escaped there, the one piece a template does not escape."""
    approvals: tuple[Waiting, ...]
    in_doubt: tuple[Waiting, ...]
    arguments: dict[str, str]
    """Each call's whole arguments, as indented JSON (`shown_json`): what an approval
    binds is shown whole, never only its preview, and as it is."""
    events: tuple[tuple[int, type[ev.Event]], ...] = ()
    """Each event's seq and class (what `done` checks)."""

    def done(self, verb: str, seq: str) -> str | None:
        """What the page may say was done: the text for ``verb`` only if the event at
        ``seq`` is that verb's (a link that merely says so makes it say nothing)."""
        found = DONE.get(verb)
        if found is None or not seq.isascii() or not seq.isdigit() or len(seq) > 18:
            return None
        index = int(seq)
        if index >= len(self.events) or self.events[index][1] is not found[0]:
            return None
        return found[1]


def run_diagram(store: Any, run_id: str) -> str:
    """The run's drawing alone (`run_svg`); `RunNotFound` as `run_page`."""
    return run_svg(run_path(RunController.load(store, run_id).events))


def run_page(store: Any, run_id: str) -> RunPage:
    """`RunNotFound` for a run the store does not hold."""
    c = RunController.load(store, run_id)
    events = c.events
    info = describe(c)
    path = run_path(events)
    moments, hidden = timeline(events, path)
    waiting = c.waiting
    return RunPage(
        c.run_id, c.version, c.step.name, c.step in LIVE_STEPS, info,
        {call["call_id"]: tuple(decision_note(d) for d in call["decisions"])
         for call in info["ledger"]},
        moments, hidden, run_svg(path),
        tuple(w for w in waiting if w.kind == "approval"),
        tuple(w for w in waiting if w.kind == "in_doubt"),
        {view.call.call_id: shown_json(view.call.arguments) for view in c.calls},
        tuple((e.seq, type(e)) for e in events))
