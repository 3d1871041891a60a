"""Sessions: the Session contract (`statemachine.testing.contracts.SessionContract`, which
also drives `publish` and `settle` through the Session) run against ours and against a
plain class that only has the protocol's methods; then what only one backend promises."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from statemachine import RecoveryPolicy, Step, StorageError
from statemachine.runner import publish
from statemachine.sessions import MemorySession, Session, SQLiteSession
from statemachine.testing.contracts import SessionContract
from tests.helpers import SESSION, B, P, at_interruption, run_charge


class PlainSession:
    """Implements only the protocol, as a runner author's own session would: it keeps
    what it is given as JSON text, like any session that stores its items."""

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self.rows: list[str] = []

    async def get_items(self, limit: int | None = None) -> list[Any]:
        return [json.loads(row) for row in (self.rows if limit is None
                                             else self.rows[-limit:])]

    async def add_items(self, items: list[Any]) -> None:
        self.rows.extend([json.dumps(item) for item in items])

    async def pop_item(self) -> Any:
        return json.loads(self.rows.pop()) if self.rows else None

    async def clear_session(self) -> None:
        self.rows.clear()


class TestMemorySession(SessionContract):
    def make_session(self, tmp_path: Path, session_id: str) -> Session:
        return MemorySession(session_id)


class TestSQLiteSession(SessionContract):
    def make_session(self, tmp_path: Path, session_id: str) -> Session:
        return SQLiteSession(session_id, tmp_path / "session.db")


class TestPlainSession(SessionContract):
    def make_session(self, tmp_path: Path, session_id: str) -> Session:
        return PlainSession(session_id)


def test_a_cancelled_write_is_not_reported_and_its_attempt_stays_open() -> None:
    async def go() -> None:
        session = MemorySession(SESSION, list(P))
        c = at_interruption(RecoveryPolicy.FAIL_CLOSED)
        run_charge(c)

        async def cancelled(items: list[Any]) -> None:
            raise asyncio.CancelledError

        session.add_items = cancelled  # type: ignore[method-assign]
        with pytest.raises(asyncio.CancelledError):
            await publish(c, session, list(B), call_ids=["charge", "audit"])
        assert c.step is Step.UNSETTLED
        assert c.holds_attempt

    asyncio.run(go())


def test_sqlite_add_items_is_atomic(tmp_path: Path) -> None:
    class Crashing(SQLiteSession):
        def _before_commit(self) -> None:
            raise OSError("power lost mid-batch")

    async def go() -> None:
        s = Crashing(SESSION, tmp_path / "session.db")
        with pytest.raises(StorageError, match="power lost") as info:  # typed (DESIGN §6.6)
            await s.add_items([{"n": 1}, {"n": 2}])
        assert info.value.outcome == "not_written"
        assert await SQLiteSession(SESSION, tmp_path / "session.db").get_items() == []

    asyncio.run(go())


def test_sqlite_sessions_share_a_file_by_id(tmp_path: Path) -> None:
    async def go() -> None:
        a = SQLiteSession("a", tmp_path / "s.db")
        b = SQLiteSession("b", tmp_path / "s.db")
        await a.add_items([{"a": 1}])
        await b.add_items([{"b": 1}])
        assert await a.get_items() == [{"a": 1}]
        assert await SQLiteSession("a", tmp_path / "s.db").get_items() == [{"a": 1}]

    asyncio.run(go())


def test_a_refused_pop_leaves_the_session_usable(tmp_path: Path) -> None:
    # SQ03: a write transaction that fails is rolled back, so the next one can begin
    path = tmp_path / "session.db"
    session = SQLiteSession("s", path)
    try:
        raw = sqlite3.connect(path)
        raw.execute("INSERT INTO session_items (session_id, body) VALUES ('s', 'not json{')")
        raw.commit()
        raw.close()
        with pytest.raises(StorageError):
            asyncio.run(session.pop_item())
        asyncio.run(session.clear_session())
        asyncio.run(session.add_items([{"n": 1}]))
        assert asyncio.run(session.get_items()) == [{"n": 1}]
    finally:
        session.close()


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_a_non_positive_limit_reads_no_items(kind: str, tmp_path: Path) -> None:
    # SE01, SE03: get_items(limit=n) is the last n items: none for 0 (and for a negative
    # n, on which both Sessions agree)
    session: MemorySession | SQLiteSession = (
        MemorySession("s") if kind == "memory" else SQLiteSession("s", tmp_path / "s.db"))
    asyncio.run(session.add_items([1, 2, 3]))
    assert asyncio.run(session.get_items(limit=2)) == [2, 3]
    assert asyncio.run(session.get_items(limit=0)) == []
    assert asyncio.run(session.get_items(limit=-1)) == []
    if isinstance(session, SQLiteSession):
        session.close()
