"""What holds a run up, and what waits on a person: the read models of DESIGN §7.5.

A run's `Blocker` is what keeps it from going on by itself, read from the same fold that
decides resumability (`state.next_action`), as a reader that holds no attempt sees it:
a call in doubt, an unsettled publication, decisions to take, or a run that can never
resume. Its `Waiting` entries are the inbox: every call awaiting a decision (but in a run
that can never resume) and every call in doubt. While a publication is unsettled and
reconcilable, its calls awaiting a decision are listed: the next attempt reconciles
first, and a decision taken before that is refused (`PublicationUnsettled`). Stores
that keep run heads keep both beside the step, written in the append's transaction
(`ReadModel.encode`), so listing runs or the inbox is one query.
"""

from __future__ import annotations

import enum
import json
from typing import Any

import attrs

from statemachine.state import RunState, in_doubt
from statemachine.values import Phase, Step

PREVIEW_CHARS = 200
"""The longest argument preview an inbox entry carries (characters)."""


class BlockerKind(enum.StrEnum):
    """Why a run does not go on by itself."""

    IN_DOUBT = "in_doubt"
    """A call was started and its outcome never recorded: someone must say what happened
    (`statemachine.operator.resolve`) or abandon the run."""
    UNSETTLED = "unsettled"
    """A publication is staged and not settled: the next attempt reconciles it."""
    AWAITING_DECISIONS = "awaiting_decisions"
    """Calls await approval and nothing else can run: someone must decide."""
    NOT_RESUMABLE = "not_resumable"
    """Nothing may ever run again (abandoned, or a publication that fails closed)."""


@attrs.frozen
class Blocker:
    """What keeps a run from going on (DESIGN §7.5)."""

    kind: BlockerKind
    since: int | None
    """The ``at`` of the event that caused it (microseconds since the Unix epoch, UTC;
    None in a log written before schema version 3)."""
    call_ids: tuple[str, ...] = ()
    """The calls in doubt, or awaiting decisions (in proposal order)."""
    publication: str | None = None
    """The staged publication's id (``run_id:seq``) of an unsettled run (or of one whose
    publication fails closed)."""
    reason: str | None = None
    """Why a run is not resumable (the abandon reason, or what failed closed)."""


@attrs.frozen
class Waiting:
    """One entry of the inbox: a call awaiting a decision (``kind`` ``"approval"``) or in
    doubt (``"in_doubt"``)."""

    run_id: str
    call_id: str
    kind: str
    tool: str
    preview: str
    """The call's arguments as compact JSON, cut to `PREVIEW_CHARS` characters (an ellipsis
    ends a cut one). Text only: escape it before putting it in a page."""
    fingerprint: str
    """What an approval must bind to (`RunController.fingerprint`)."""
    since: int | None
    """When it started waiting: the proposal's ``at`` for an approval, the start's for a
    call in doubt."""


@attrs.frozen
class ReadModel:
    """A run's blocker and inbox entries, as a store keeps them in the run's head."""

    blocker: Blocker | None
    waiting: tuple[Waiting, ...] = ()

    def encode(self) -> str | None:
        """The JSON text a store keeps (None: nothing blocks, nothing waits)."""
        if self.blocker is None and not self.waiting:
            return None
        b = self.blocker
        return json.dumps({
            "blocker": None if b is None else [b.kind.value, b.since, list(b.call_ids),
                                               b.publication, b.reason],
            "waiting": [[w.call_id, w.kind, w.tool, w.preview, w.fingerprint, w.since]
                        for w in self.waiting],
        }, ensure_ascii=False, separators=(",", ":"))

    @classmethod
    def decode(cls, run_id: str, text: str | None) -> ReadModel:
        """What `encode` wrote; `ValueError` for anything else (a store then folds the
        run again instead of trusting it)."""
        if text is None:
            return NOTHING
        try:
            data: Any = json.loads(text)
            raw, waiting = data["blocker"], data["waiting"]
            blocker = None if raw is None else Blocker(
                BlockerKind(raw[0]), _at(raw[1]), tuple(_texts(raw[2])), _text(raw[3]),
                _text(raw[4]))
            entries = tuple(Waiting(run_id, _str(w[0]), _str(w[1]), _str(w[2]), _str(w[3]),
                                    _str(w[4]), _at(w[5])) for w in waiting)
        except (TypeError, KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"not a run head's read model ({type(exc).__name__})") from None
        return cls(blocker, entries)


NOTHING = ReadModel(None)


def _str(value: Any) -> str:
    if type(value) is not str:
        raise TypeError("expected a str")
    return value


def _text(value: Any) -> str | None:
    return None if value is None else _str(value)


def _texts(value: Any) -> list[str]:
    if type(value) is not list:
        raise TypeError("expected a list")
    return [_str(v) for v in value]


def _at(value: Any) -> int | None:
    if value is not None and type(value) is not int:
        raise TypeError("expected an int")
    return value


def preview(arguments: Any) -> str:
    """A call's arguments as compact JSON, at most `PREVIEW_CHARS` characters."""
    text = json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))
    return text if len(text) <= PREVIEW_CHARS else text[: PREVIEW_CHARS - 1] + "…"


def _input_left(s: RunState, settled_to: Step | None) -> bool:
    """Recorded input not yet in a settled batch (after the settling publication, when
    ``settled_to`` says one is settling)."""
    envelope = s.envelope
    if settled_to is not None and envelope is not None:
        return len(s.pending_input) > envelope.input_items
    return bool(s.pending_input)


def read_model(s: RunState, *, settled_to: Step | None = None) -> ReadModel:
    """The blocker and the inbox entries of the run in ``s``, as a reader holding no
    attempt sees them. ``settled_to``: as if its unsettled publication had just settled,
    continuing to that step (a commit waiting for the append that writes it)."""
    step = s.step if settled_to is None else settled_to
    if step is Step.COMPLETED:
        return NOTHING
    if step is Step.TERMINAL_UNRECOVERABLE:
        return ReadModel(Blocker(BlockerKind.NOT_RESUMABLE, s.last_at, reason=s.end_reason))
    calls = s.calls
    doubtful = in_doubt(s, ())
    envelope = s.envelope if settled_to is None else None
    closed = step is Step.UNSETTLED and envelope is not None and envelope.fail_closed
    # (an unsettled publication that fails closed: nothing can ever be decided there)
    waiting = [] if closed else [
        Waiting(s.run_id, call_id, "approval", calls[call_id].call.name,
                preview(calls[call_id].call.arguments), calls[call_id].fingerprint,
                s.responded_at) for call_id in s.awaiting_ids]
    waiting += [Waiting(s.run_id, call_id, "in_doubt", calls[call_id].call.name,
                        preview(calls[call_id].call.arguments), calls[call_id].fingerprint,
                        calls[call_id].started_at) for call_id in doubtful]
    blocker: Blocker | None = None
    if doubtful:
        starts = [at for at in (calls[c].started_at for c in doubtful) if at is not None]
        blocker = Blocker(BlockerKind.IN_DOUBT, min(starts, default=None), doubtful)
    elif step is Step.UNSETTLED and envelope is not None:
        publication = f"{s.run_id}:{envelope.staged_seq}"
        blocker = (Blocker(BlockerKind.NOT_RESUMABLE, s.staged_at, publication=publication,
                           reason="its unsettled publication fails closed")
                   if envelope.fail_closed else
                   Blocker(BlockerKind.UNSETTLED, s.staged_at, publication=publication))
    elif (step is Step.INTERRUPTION and s.count(Phase.AWAITING)
          and not s.count(Phase.APPROVED) and not _input_left(s, settled_to)):
        # what next_action answers AWAIT_DECISIONS for (input waiting for the Session
        # is published first)
        blocker = Blocker(BlockerKind.AWAITING_DECISIONS, s.responded_at,
                          tuple(s.awaiting_ids))
    waiting.sort(key=lambda w: (w.since is None, w.since or 0))
    return ReadModel(blocker, tuple(waiting))
