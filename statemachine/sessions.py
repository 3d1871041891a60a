"""Sessions: the durable conversation history a run publishes to.

`Session` is the protocol runner authors already implement (``session_id``, and async
``get_items(limit=None)``, ``add_items(items)``, ``pop_item()``, ``clear_session()``), so
an existing session plugs in unchanged: nothing here checks its class. `MemorySession`
and `SQLiteSession` are ours. A runner writes to a Session through a controller with
`statemachine.runner.publish` and `statemachine.runner.settle`.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any, Protocol, runtime_checkable

from statemachine import sqlite
from statemachine.payloads import JSON, detach


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


class SQLiteSession:
    """A Session in a real SQLite database file (WAL, ``synchronous=FULL``).

    ``add_items`` writes its batch in one transaction: all of it or none of it. Several
    sessions (and processes) may share one file; rows are keyed by ``session_id``.
    """

    def __init__(self, session_id: str, path: str | os.PathLike[str], *,
                 timeout: float = 30.0) -> None:
        self.session_id = session_id
        self.path = os.fspath(path)
        self._lock = threading.Lock()
        self._conn = sqlite.connect(self.path, timeout=timeout)
        self._conn.execute(
            "CREATE TABLE IF NOT EXISTS session_items (id INTEGER PRIMARY KEY AUTOINCREMENT,"
            " session_id TEXT NOT NULL, body TEXT NOT NULL)")
        self._conn.execute("CREATE INDEX IF NOT EXISTS session_items_by_session "
                           "ON session_items (session_id, id)")

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    async def get_items(self, limit: int | None = None) -> list[JSON]:
        with self._lock:
            if limit is None:
                rows = self._conn.execute(
                    "SELECT body FROM session_items WHERE session_id = ? ORDER BY id",
                    (self.session_id,)).fetchall()
            else:
                rows = self._conn.execute(
                    "SELECT body FROM (SELECT id, body FROM session_items WHERE session_id = ?"
                    " ORDER BY id DESC LIMIT ?) ORDER BY id",
                    (self.session_id, max(limit, 0))).fetchall()
        return [json.loads(body) for (body,) in rows]

    async def add_items(self, items: list[JSON]) -> None:
        bodies = [(self.session_id, _dumps(detach(item))) for item in items]
        with self._lock:
            try:
                with sqlite.write_transaction(self._conn) as conn:
                    conn.executemany(
                        "INSERT INTO session_items (session_id, body) VALUES (?, ?)", bodies)
                    self._before_commit()
            except sqlite.CommitFailed as failed:
                raise failed.__cause__ from None  # type: ignore[misc]
        self._after_commit()

    def _before_commit(self) -> None:
        """A seam for fault injection (tests kill the process here)."""

    def _after_commit(self) -> None:
        """A seam for fault injection (tests kill the process here)."""

    async def pop_item(self) -> JSON | None:
        with self._lock, sqlite.write_transaction(self._conn) as conn:
            row = conn.execute(
                "SELECT id, body FROM session_items WHERE session_id = ? "
                "ORDER BY id DESC LIMIT 1", (self.session_id,)).fetchone()
            if row is not None:
                conn.execute("DELETE FROM session_items WHERE id = ?", (row[0],))
        return None if row is None else json.loads(row[1])

    async def clear_session(self) -> None:
        with self._lock:
            self._conn.execute("DELETE FROM session_items WHERE session_id = ?",
                               (self.session_id,))


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
