"""Sessions: the Session contract (`statemachine.testing.contracts.SessionContract`, which
also drives `publish` and `settle` through the Session) run against ours and against a
plain class that only has the protocol's methods; then what only one backend promises."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
from collections.abc import Awaitable, Callable
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


class _Gated:
    """A SQLiteSession's connection whose statements wait until the test opens the gate:
    a statement made slow by the test, deterministically, whatever the machine's speed."""

    def __init__(self, conn: sqlite3.Connection, gate: threading.Event) -> None:
        self._conn = conn
        self._gate = gate

    def execute(self, *args: Any) -> Any:
        self._wait()
        return self._conn.execute(*args)

    def executemany(self, *args: Any) -> Any:
        self._wait()
        return self._conn.executemany(*args)

    def _wait(self) -> None:
        # on the event loop (the old behaviour) nothing can open the gate: give up after
        # a while, and the test fails on the order of events, not on a clock
        self._gate.wait(timeout=10)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


CALLS: dict[str, Callable[[SQLiteSession], Awaitable[Any]]] = {
         "get_items": lambda s: s.get_items(), "get_items(limit)": lambda s: s.get_items(1),
         "add_items": lambda s: s.add_items([{"n": 2}, {"n": 3}]),
         "pop_item": lambda s: s.pop_item(), "clear_session": lambda s: s.clear_session()}


@pytest.mark.parametrize("call", list(CALLS))
def test_sqlite_session_calls_never_block_the_event_loop(tmp_path: Path, call: str) -> None:
    """A heartbeat keeps ticking while a SQLiteSession call waits on its database: the
    call runs on the Session's own thread, and only the heartbeat, on the loop, lets it
    go on. Had the call run on the loop, the heartbeat could not tick until it ended."""
    async def go() -> None:
        session = SQLiteSession(SESSION, tmp_path / "session.db")
        await session.add_items([{"n": 1}])
        gate = threading.Event()
        session._conn = _Gated(session._conn, gate)  # type: ignore[assignment]
        ticks = 0

        async def heartbeat() -> bool:
            nonlocal ticks
            for _ in range(5):
                await asyncio.sleep(0)
                ticks += 1
            finished: bool = pending.done()
            gate.set()
            return finished

        pending = asyncio.ensure_future(CALLS[call](session))
        finished_before_the_gate = await heartbeat()
        await pending
        assert ticks == 5
        assert not finished_before_the_gate  # it waited on its thread, the loop ran on
        session.close()

    asyncio.run(go())


def test_a_cancelled_sqlite_session_write_finishes_whole_before_the_next_call(
        tmp_path: Path) -> None:
    """Cancelling a caller does not cut a write short (it runs to its end on the Session's
    thread, all of it or none), and the next call waits for it: a read right after a
    cancelled add_items sees the whole batch, never half of it."""
    async def go() -> None:
        session = SQLiteSession(SESSION, tmp_path / "session.db")
        gate = threading.Event()
        real = session._conn
        session._conn = _Gated(real, gate)  # type: ignore[assignment]
        write = asyncio.ensure_future(session.add_items([{"n": 1}, {"n": 2}]))
        await asyncio.sleep(0)
        write.cancel()
        with pytest.raises(asyncio.CancelledError):
            await write
        read = asyncio.ensure_future(session.get_items())
        await asyncio.sleep(0)
        assert not read.done()  # queued behind the write
        gate.set()
        assert await read == [{"n": 1}, {"n": 2}]
        session._conn = real
        session.close()

    asyncio.run(go())


def test_a_closed_sqlite_session_refuses_every_call_with_storage_error(
        tmp_path: Path) -> None:
    """After `close`, each of the Session's calls is refused with `StorageError`
    (``not_written``) naming the call and the Session, nothing written, and closing it
    again does nothing; before, the shut-down worker's `RuntimeError` came out."""
    session = SQLiteSession("s", tmp_path / "events.db")

    async def body() -> None:
        await session.add_items([{"role": "user", "content": "hi"}])
        session.close()
        session.close()
        def add() -> Awaitable[None]:
            return session.add_items([{"role": "user", "content": "x"}])

        calls: dict[str, Callable[[], Awaitable[Any]]] = {
            "get items": session.get_items, "pop item": session.pop_item,
            "clear session": session.clear_session, "add items": add}
        for doing, call in calls.items():
            with pytest.raises(StorageError, match=f"cannot {doing}: .* closed") as refused:
                await call()
            assert refused.value.outcome == "not_written"

    asyncio.run(body())
    again = SQLiteSession("s", tmp_path / "events.db")
    assert asyncio.run(again.get_items()) == [{"role": "user", "content": "hi"}]
    again.close()
