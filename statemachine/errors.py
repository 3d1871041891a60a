"""The error hierarchy: every refusal of the core is a `ControlError`.

Each error carries the run (``run_id``), the step it was in (``step``) and the refused
command (``action``), and its message names them. Messages never echo payload contents:
they name call ids, guard names and counts, not arguments, outputs or items.

When several checks fail, the first in this order wins: `RunNotResumable`,
`PublicationUnsettled`, `SchemaError`, `ToolInDoubt`, `InvalidTransition`.
"""

from __future__ import annotations

import enum
from typing import Any

EXCERPT = 64
"""The most characters of a string from a document or a command a message quotes."""


def excerpt(text: str, limit: int = EXCERPT) -> str:
    """``repr`` of at most ``limit`` characters of ``text``, cut with an ellipsis: how a
    message quotes a string it was handed (an id, a key, a name), so a message stays
    short whatever the input holds."""
    if not isinstance(text, str):
        return f"<{type_name(text)}>"
    shown = repr(text[:limit])
    if len(shown) > limit + 2:  # escapes made it longer: keep a prefix of the escaped form
        return shown[: limit + 1] + "…"
    return shown + ("…" if len(text) > limit else "")


def type_name(value: object) -> str:
    """The name of ``value``'s type, cut like `excerpt` (a class name can be any length)."""
    name = type(value).__name__
    return name if len(name) <= EXCERPT else name[:EXCERPT] + "…"


class ControlError(Exception):
    """Base class of every refusal; ``run_id``, ``step`` and ``action`` say where."""

    def __init__(
        self,
        reason: str,
        *,
        run_id: str | None = None,
        step: Any = None,
        action: str | None = None,
    ) -> None:
        self.reason = reason
        self.run_id = run_id
        self.step = step
        self.action = action
        super().__init__(self._message())

    def _message(self) -> str:
        where = []
        if self.run_id is not None:
            where.append(f"run {excerpt(self.run_id)}")
        if self.step is not None:
            where.append(f"in step {getattr(self.step, 'name', self.step)}")
        if self.action is not None:
            where.append(f"refused {self.action}")
        prefix = ", ".join(where)
        return f"{prefix}: {self.reason}" if prefix else self.reason

    def _extra(self) -> dict[str, Any]:
        """Keyword arguments a subclass adds (kept across pickling)."""
        return {}

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.reason, self.run_id, self.step, self.action,
                           self._extra()))


def _rebuild(cls: type[ControlError], reason: str, run_id: str | None, step: Any,
             action: str | None, extra: dict[str, Any] | None = None) -> ControlError:
    return cls(reason, run_id=run_id, step=step, action=action, **(extra or {}))


class RunNotResumable(ControlError):
    """The run is terminal, completed, or fail-closed while unsettled; nothing may run."""


class PublicationUnsettled(ControlError):
    """A publication envelope is unsettled: only commit, fail, reconcile or abandon (I2)."""


class SchemaError(ControlError):
    """A payload or document that is not plain JSON, is malformed, or is over a limit."""


class ToolInDoubt(ControlError):
    """A non-idempotent call was started and never completed; it is never re-run (I11)."""

    def __init__(self, reason: str, *, call_id: str | None = None, **where: Any) -> None:
        self.call_id = call_id
        super().__init__(reason, **where)

    def _extra(self) -> dict[str, Any]:
        return {"call_id": self.call_id}


class InvalidTransition(ControlError):
    """The machine forbids this command here; the message names the failed guard."""


class ReconcileRejected(ControlError):
    """The Session cannot be matched to the envelope; nothing was recorded (I7)."""


class Outcome(enum.StrEnum):
    """What happened to a write that a `StorageError` refused (a str enum: each member
    equals its text, so ``error.outcome == "unknown"`` keeps working)."""

    NOT_WRITTEN = "not_written"
    """Nothing of it landed: the controller is unchanged and the command may be retried."""
    UNKNOWN = "unknown"
    """It may have landed: reload the run to go on."""


_OUTCOMES = tuple(member.value for member in Outcome)


class StorageError(ControlError):
    """The backend failed (locked, read-only, full, corrupt, deleted, connection lost).

    ``outcome`` says what happened to the write: ``"not_written"`` (nothing of it landed;
    the controller is unchanged and the command may be retried) or ``"unknown"`` (it may
    have landed; the controller refuses every command until the run is loaded again)."""

    def __init__(self, reason: str, *, outcome: str = Outcome.UNKNOWN, **where: Any) -> None:
        if outcome not in _OUTCOMES:
            raise ValueError(f"outcome is one of {', '.join(map(repr, _OUTCOMES))}")
        self.outcome = Outcome(outcome)
        super().__init__(reason, **where)

    def _extra(self) -> dict[str, Any]:
        return {"outcome": self.outcome}


class ConfigurationError(ControlError, ValueError):
    """A store or Session was handed a setting it cannot use (a PostgreSQL ``schema=``
    that is not a plain SQL identifier); nothing was opened. It is also a `ValueError`,
    which the refusal was before it had a type."""


class RunNotFound(ControlError):
    """The store holds no run with this id."""


class ConcurrencyConflict(ControlError):
    """Another writer appended to the run's log first; nothing was recorded."""


class LeaseHeld(ConcurrencyConflict):
    """Another owner's lease on the run is live (DESIGN §7.2): a claim by anyone else is
    refused until it ends, and nothing was recorded. ``owner`` holds the lease; ``until``
    is when it ends by the store's clock (integer microseconds since the Unix epoch, UTC),
    unless its holder appends again first, which moves it on."""

    def __init__(self, reason: str, *, owner: str | None = None, until: int | None = None,
                 **where: Any) -> None:
        self.owner = owner
        self.until = until
        super().__init__(reason, **where)

    def _extra(self) -> dict[str, Any]:
        return {"owner": self.owner, "until": self.until}


def lease_held(owner: str | None, until: int, *, run_id: str | None = None) -> LeaseHeld:
    """The `LeaseHeld` a store raises: its message names the holder and the lease's end
    (as the integer and in UTC, so a person reading a log need not convert it)."""
    import datetime  # only on a refusal: most processes never build one

    try:
        when = datetime.datetime.fromtimestamp(until / 1e6, datetime.UTC).isoformat()
    except (OverflowError, ValueError, OSError):  # past what a datetime holds
        when = "UTC time out of range"
    shown = "an owner without a name" if owner is None else excerpt(owner)
    return LeaseHeld(f"{shown} holds the run's lease until {until} ({when}): another "
                     "owner may claim it only after that; nothing was recorded",
                     owner=owner, until=until, run_id=run_id)
