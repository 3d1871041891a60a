"""No PostgreSQL statement waits for ever for a lock another session holds (DESIGN §6.7):
each connection sets ``lock_timeout`` (`LOCK_TIMEOUT` unless told), so an append that
meets a run's head row held by another session's transaction fails with `StorageError`
``"not_written"`` and leaves the run as it was; once the lock is gone, it goes through.

The holder is a second real connection inside ``SELECT ... FOR UPDATE`` on the head row.
It is ended by the server after 20 s (``idle_in_transaction_session_timeout``), so an
append that ignored the bound would wait and then land: "did not raise", not a hang."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from statemachine import ConfigurationError, RunController, StorageError
from statemachine.postgres import (
    LOCK_TIMEOUT,
    AsyncPostgresEventStore,
    AsyncPostgresSession,
    PostgresEventStore,
    PostgresSession,
)

pytestmark = pytest.mark.postgres

SHORT = 0.2


@contextlib.contextmanager
def _head_held(dsn: str, schema: str, run_id: str) -> Iterator[None]:
    with psycopg.connect(dsn, autocommit=True) as holder:
        holder.execute("SET idle_in_transaction_session_timeout = '20s'")
        holder.execute("BEGIN")
        row = holder.execute(f'SELECT version FROM "{schema}".runs WHERE run_id = %s '
                             "FOR UPDATE", (run_id,)).fetchone()
        assert row is not None  # the head row exists and is now held
        try:
            yield
        finally:
            holder.execute("ROLLBACK")


def _setting(conn: Any) -> str:
    return str(conn.execute("SHOW lock_timeout").fetchone()[0])


def test_an_append_meeting_a_held_head_row_fails_not_written(pg_dsn: str,
                                                             pg_schema: str) -> None:
    store = PostgresEventStore(pg_dsn, schema=pg_schema, lock_timeout=SHORT)
    c = RunController.start(run_id="r", session_id="s", store=store)
    before = store.load("r")
    with _head_held(pg_dsn, pg_schema, "r"):
        with pytest.raises(StorageError, match="lock timeout") as info:
            c.add_input(["one statement"])  # an append of events alone
        assert info.value.outcome == "not_written"
        with pytest.raises(StorageError, match="lock timeout") as info:
            store.append("r", [], c.version)  # BEGIN, the head locked, COMMIT
        assert info.value.outcome == "not_written"
        assert c.version == len(before)  # not_written: the controller is unchanged
    assert store.load("r") == before
    c.add_input(["after the lock"])  # the lock is gone: the command goes through
    assert store.load("r") == list(c.events)
    store.close()


def test_the_async_store_and_the_sessions_are_bounded_too(pg_dsn: str, pg_schema: str
                                                          ) -> None:
    sync = PostgresEventStore(pg_dsn, schema=pg_schema)
    RunController.start(run_id="r", session_id="s", store=sync)
    event = RunController.start(run_id="r", session_id="s")
    event.add_input(["from the async store"])
    session = PostgresSession(pg_dsn, "s", schema=pg_schema, lock_timeout=SHORT)

    async def appends() -> None:
        async with AsyncPostgresEventStore(pg_dsn, schema=pg_schema,
                                           lock_timeout=SHORT) as store:
            with _head_held(pg_dsn, pg_schema, "r"):
                for events in ([event.events[1]], []):
                    with pytest.raises(StorageError, match="lock timeout") as info:
                        await store.append("r", events, 1)
                    assert info.value.outcome == "not_written"
            await store.append("r", [event.events[1]], 1)
        await session.add_items([{"a": 1}])
        with psycopg.connect(pg_dsn, autocommit=True) as holder:
            holder.execute("BEGIN")
            holder.execute(f'SELECT * FROM "{pg_schema}".session_items FOR UPDATE')
            with pytest.raises(StorageError, match="lock timeout") as info:
                await session.pop_item()
            assert info.value.outcome == "not_written"
            holder.execute("ROLLBACK")
        assert await session.pop_item() == {"a": 1}

    asyncio.run(appends())
    assert len(sync.load("r")) == 2
    sync.close()


def test_the_bound_is_on_by_default_and_configurable(pg_dsn: str, pg_schema: str) -> None:
    assert LOCK_TIMEOUT == 5.0
    for store, shown in ((PostgresEventStore(pg_dsn, schema=pg_schema), "5s"),
                         (PostgresEventStore(pg_dsn, schema=pg_schema, lock_timeout=0.25),
                          "250ms"),
                         (PostgresEventStore(pg_dsn, schema=pg_schema, readonly=True,
                                             lock_timeout=1.5), "1500ms"),
                         (PostgresEventStore(pg_dsn, schema=pg_schema, lock_timeout=None),
                          "0")):  # None: the server's own setting (no limit here)
        store.list_runs()
        assert _setting(store._conn) == shown
        store.close()

    async def session_setting() -> str:
        async with AsyncPostgresSession(pg_dsn, "s", schema=pg_schema) as session:
            await session.get_items()
            conn = session._conn
            assert conn is not None
            return str((await (await conn.execute("SHOW lock_timeout")).fetchone())[0])

    assert asyncio.run(session_setting()) == "5s"
    bads: list[Any] = [0, -1, float("nan"), float("inf"), "5", True, 10**9]
    for bad in bads:
        with pytest.raises(ConfigurationError, match="lock_timeout"):
            PostgresEventStore(pg_dsn, lock_timeout=bad)
        with pytest.raises(ConfigurationError, match="lock_timeout"):
            AsyncPostgresSession(pg_dsn, "s", lock_timeout=bad)
