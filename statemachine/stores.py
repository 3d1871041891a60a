"""Event stores: where a run's log lives between processes.

`EventStore` is the protocol the controller binds to: ``append(run_id, events,
expected_version)`` succeeds only if the run's log holds exactly ``expected_version``
events (otherwise `ConcurrencyConflict`, and nothing is written), and ``load(run_id)``
returns the whole log (empty for an unknown run).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from statemachine.errors import ConcurrencyConflict

if TYPE_CHECKING:
    from collections.abc import Sequence

    from statemachine.events import Event


@runtime_checkable
class EventStore(Protocol):
    """The optimistic-concurrency primitive: one log per run id, versions are lengths."""

    def append(self, run_id: str, events: Sequence[Event], expected_version: int) -> None:
        """Append ``events`` if the log holds ``expected_version`` events, atomically."""

    def load(self, run_id: str) -> list[Event]:
        """The run's whole log, in order (empty when the run is unknown)."""


class MemoryEventStore:
    """An in-process store; thread-safe; events are immutable, so they are kept as is."""

    def __init__(self) -> None:
        self._logs: dict[str, list[Event]] = {}
        self._lock = threading.Lock()

    def append(self, run_id: str, events: Sequence[Event], expected_version: int) -> None:
        with self._lock:
            log = self._logs.setdefault(run_id, [])
            if len(log) != expected_version:
                raise ConcurrencyConflict(
                    f"expected version {expected_version}, the log is at {len(log)}",
                    run_id=run_id)
            log.extend(events)

    def load(self, run_id: str) -> list[Event]:
        with self._lock:
            return list(self._logs.get(run_id, ()))
