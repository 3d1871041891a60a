"""Sessions: the durable conversation history a run publishes to.

`Session` is the protocol runner authors already implement (``session_id``, and async
``get_items(limit=None)``, ``add_items(items)``, ``pop_item()``, ``clear_session()``), so
an existing session plugs in unchanged: nothing here checks its class. `MemorySession`
and `SQLiteSession` are ours (the latter lives with the rest of SQLite in
`statemachine.sqlite`; the PostgreSQL ones are in `statemachine.postgres`). A runner
writes to a Session through a controller with `statemachine.runner.publish` and
`statemachine.runner.settle`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from statemachine.payloads import JSON, detach
from statemachine.sqlite import SQLiteSession

__all__ = ["MemorySession", "SQLiteSession", "Session"]


@runtime_checkable
class Session(Protocol):
    """A linear, append-only conversation history."""

    session_id: str

    async def get_items(self, limit: int | None = None) -> list[JSON]:
        """The last ``limit`` items (all when None), oldest first."""

    async def add_items(self, items: list[JSON]) -> None:
        """Append ``items``, all or nothing."""

    async def pop_item(self) -> JSON | None:
        """Remove and return the newest item (None when empty)."""

    async def clear_session(self) -> None:
        """Remove every item."""


class MemorySession:
    """A Session in memory; items are detached on the way in and out."""

    def __init__(self, session_id: str, items: list[JSON] | None = None) -> None:
        self.session_id = session_id
        self._items: list[JSON] = [detach(item) for item in items or []]

    async def get_items(self, limit: int | None = None) -> list[JSON]:
        chosen = self._items if limit is None else self._items[-limit:] if limit > 0 else []
        return [detach(item) for item in chosen]

    async def add_items(self, items: list[JSON]) -> None:
        copies = [detach(item) for item in items]
        self._items.extend(copies)

    async def pop_item(self) -> JSON | None:
        return self._items.pop() if self._items else None

    async def clear_session(self) -> None:
        self._items.clear()
