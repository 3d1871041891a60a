"""Sessions: the durable conversation history a run publishes to.

`Session` is the protocol runner authors already implement (``session_id``, and async
``get_items(limit=None)``, ``add_items(items)``, ``pop_item()``, ``clear_session()``), so
an existing session plugs in unchanged: nothing here checks its class. `MemorySession`
and `SQLiteSession` are ours. A runner writes to a Session through a controller with
`statemachine.runner.publish` and `statemachine.runner.settle`.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
from typing import Any, Protocol, runtime_checkable

from statemachine import sqlite
from statemachine.errors import StorageError
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

    Every `sqlite3.Error` and `OSError` of a public call is a `StorageError` (a locked,
    read-only, full, damaged file, or a stored item that is not JSON) with an
    ``outcome``: ``"not_written"`` when nothing of a write landed (and for every read),
    ``"unknown"`` when its COMMIT raised (it may have landed). A write's error reaches
    the runner as the write's error, like any Session's: ``publish`` reports it with
    ``publication_failed`` and re-raises it (I6). ``timeout`` is SQLite's busy timeout.
    """

    def __init__(self, session_id: str, path: str | os.PathLike[str], *,
                 timeout: float = 30.0) -> None:
        self.session_id = session_id
        self.path = os.fspath(path)
        self._timeout = timeout
        self._lock = threading.Lock()
        with sqlite.storage_errors(self.path, doing="open the Session"):
            self._conn = sqlite.connect(self.path, timeout=timeout)
            try:
                self._conn.execute(
                    "CREATE TABLE IF NOT EXISTS session_items (id INTEGER PRIMARY KEY "
                    "AUTOINCREMENT, session_id TEXT NOT NULL, body TEXT NOT NULL)")
                self._conn.execute("CREATE INDEX IF NOT EXISTS session_items_by_session "
                                   "ON session_items (session_id, id)")
            except BaseException:
                self._conn.close()
                raise

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def _failed(self, error: BaseException, doing: str, outcome: str) -> StorageError:
        if sqlite.in_transaction(self._conn):  # a failed ROLLBACK: closing rolls back
            with contextlib.suppress(sqlite3.Error):
                self._conn.close()
            with contextlib.suppress(sqlite3.Error, OSError):
                self._conn = sqlite.connect(self.path, timeout=self._timeout)
        return sqlite.failure(error, self.path, outcome=outcome, doing=doing)

    async def get_items(self, limit: int | None = None) -> list[JSON]:
        doing = "read the Session"
        with self._lock, sqlite.storage_errors(self.path, doing=doing):
            if limit is None:
                rows = self._conn.execute(
                    "SELECT body FROM session_items WHERE session_id = ? ORDER BY id",
                    (self.session_id,)).fetchall()
            else:
                rows = self._conn.execute(
                    "SELECT body FROM (SELECT id, body FROM session_items WHERE session_id = ?"
                    " ORDER BY id DESC LIMIT ?) ORDER BY id",
                    (self.session_id, max(limit, 0))).fetchall()
        return [self._item(body, doing) for (body,) in rows]

    def _item(self, body: Any, doing: str) -> JSON:
        try:
            return json.loads(body)
        except (ValueError, TypeError, RecursionError):
            raise StorageError(f"cannot {doing}: {sqlite.shown(self.path)} holds a damaged "
                               "item (not JSON)", outcome="not_written") from None

    async def add_items(self, items: list[JSON]) -> None:
        bodies = [(self.session_id, _dumps(detach(item))) for item in items]
        doing = "write to the Session"
        with self._lock:
            try:
                with sqlite.write_transaction(self._conn) as conn:
                    conn.executemany(
                        "INSERT INTO session_items (session_id, body) VALUES (?, ?)", bodies)
                    self._before_commit()
            except sqlite.CommitFailed as failed:
                raise self._failed(failed.__cause__ or failed, doing, "unknown") from None
            except (sqlite3.Error, OSError) as error:
                raise self._failed(error, doing, "not_written") from error
        self._after_commit()

    def _before_commit(self) -> None:
        """A seam for fault injection (tests kill the process here)."""

    def _after_commit(self) -> None:
        """A seam for fault injection (tests kill the process here)."""

    async def pop_item(self) -> JSON | None:
        doing = "pop an item from the Session"
        with self._lock:
            try:
                with sqlite.write_transaction(self._conn) as conn:
                    row = conn.execute(
                        "SELECT id, body FROM session_items WHERE session_id = ? "
                        "ORDER BY id DESC LIMIT 1", (self.session_id,)).fetchone()
                    item = None if row is None else self._item(row[1], doing)
                    if row is not None:  # a damaged item is refused before it is removed
                        conn.execute("DELETE FROM session_items WHERE id = ?", (row[0],))
            except sqlite.CommitFailed as failed:
                raise self._failed(failed.__cause__ or failed, doing, "unknown") from None
            except (sqlite3.Error, OSError) as error:
                raise self._failed(error, doing, "not_written") from error
        return item

    async def clear_session(self) -> None:
        doing = "clear the Session"
        with self._lock:
            try:
                with sqlite.write_transaction(self._conn) as conn:
                    conn.execute("DELETE FROM session_items WHERE session_id = ?",
                                 (self.session_id,))
            except sqlite.CommitFailed as failed:
                raise self._failed(failed.__cause__ or failed, doing, "unknown") from None
            except (sqlite3.Error, OSError) as error:
                raise self._failed(error, doing, "not_written") from error


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
