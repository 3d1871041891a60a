"""Sessions: one contract for ours and for a plain class that only has the protocol's
methods; `publish` and `settle` drive the controller through any of them."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from statemachine import Acknowledge, Append, RecoveryPolicy, RunController, Step
from statemachine.runner import publish, settle
from statemachine.sessions import MemorySession, Session, SQLiteSession
from tests.helpers import SESSION, B, P, at_interruption, run_charge


class PlainSession:
    """Implements only the protocol, as a runner author's own session would."""

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self.rows: list[Any] = []

    async def get_items(self, limit: int | None = None) -> list[Any]:
        return list(self.rows if limit is None else self.rows[-limit:])

    async def add_items(self, items: list[Any]) -> None:
        self.rows.extend(items)

    async def pop_item(self) -> Any:
        return self.rows.pop() if self.rows else None

    async def clear_session(self) -> None:
        self.rows.clear()


@pytest.fixture(params=["memory", "sqlite", "plain"])
def session(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Session]:
    if request.param == "memory":
        yield MemorySession(SESSION)
    elif request.param == "sqlite":
        s = SQLiteSession(SESSION, tmp_path / "session.db")
        yield s
        s.close()
    else:
        yield PlainSession(SESSION)


def test_the_protocol_contract(session: Session) -> None:
    async def go() -> None:
        assert isinstance(session, Session)
        await session.add_items([{"n": 1}, {"n": 2}])
        await session.add_items([{"n": 3}])
        assert await session.get_items() == [{"n": 1}, {"n": 2}, {"n": 3}]
        assert await session.get_items(limit=2) == [{"n": 2}, {"n": 3}]
        assert await session.get_items(limit=10) == [{"n": 1}, {"n": 2}, {"n": 3}]
        assert await session.pop_item() == {"n": 3}
        await session.clear_session()
        assert await session.get_items() == []
        assert await session.pop_item() is None

    asyncio.run(go())


@pytest.mark.parametrize("outcome", ["acknowledge", "append"])
def test_publish_then_settle_through_any_session(session: Session, outcome: str) -> None:
    async def go() -> None:
        await session.add_items(list(P))
        c = at_interruption()
        run_charge(c)
        original = session.add_items
        boom = RuntimeError("injected")

        async def failing(items: list[Any]) -> None:
            if outcome == "acknowledge":
                await original(items)
            raise boom

        session.add_items = failing  # type: ignore[method-assign]
        with pytest.raises(RuntimeError) as info:
            await publish(c, session, list(B), call_ids=["charge", "audit"])
        assert info.value is boom  # the original error propagates (I6)
        assert c.step is Step.UNSETTLED
        assert c.events[-1].error == "RuntimeError"  # type: ignore[attr-defined]
        session.add_items = original  # type: ignore[method-assign]
        restored = RunController.from_json(c.to_json())
        decision = await settle(restored, session)
        assert isinstance(decision, Acknowledge if outcome == "acknowledge" else Append)
        assert await session.get_items() == P + B
        assert restored.step is Step.INTERRUPTION

    asyncio.run(go())


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
        with pytest.raises(OSError, match="power lost"):
            await s.add_items([{"n": 1}, {"n": 2}])
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
