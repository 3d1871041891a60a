"""The error hierarchy: every refusal of the core is a `ControlError`.

Each error carries the run (``run_id``), the step it was in (``step``) and the refused
command (``action``), and its message names them. Messages never echo payload contents:
they name call ids, guard names and counts, not arguments, outputs or items.

When several checks fail, the first in this order wins: `RunNotResumable`,
`PublicationUnsettled`, `SchemaError`, `ToolInDoubt`, `InvalidTransition`.
"""

from __future__ import annotations

from typing import Any


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
            where.append(f"run {self.run_id!r}")
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


class RunNotFound(ControlError):
    """The store holds no run with this id."""


class ConcurrencyConflict(ControlError):
    """Another writer appended to the run's log first; nothing was recorded."""
