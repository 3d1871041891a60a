"""The event-store contract (`statemachine.testing.contracts.EventStoreContract`) run
against the async stores (DESIGN §6.9), through `AsyncStoreAdapter`: `AsyncSQLiteEventStore`
and, with a PostgreSQL server, `AsyncPostgresEventStore`. Then what a controller bound
to an async store does directly: it buffers, flushes one transaction per effect boundary
and loads back without blocking its loop."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from statemachine import ConcurrencyConflict, RunController, RunNotFound, SchemaError
from statemachine.postgres import AsyncPostgresEventStore
from statemachine.stores import AsyncEventStore, AsyncSQLiteEventStore, SQLiteEventStore
from statemachine.testing.contracts import AsyncEventStoreContract


class TestAsyncSQLiteEventStore(AsyncEventStoreContract):
    def make_async_store(self, tmp_path: Path) -> AsyncEventStore:
        return AsyncSQLiteEventStore(tmp_path / "events.db")

    def open_async_again(self, tmp_path: Path) -> AsyncEventStore:
        return AsyncSQLiteEventStore(tmp_path / "events.db")


@pytest.mark.postgres
class TestAsyncPostgresEventStore(AsyncEventStoreContract):
    dsn: str
    schema: str

    @pytest.fixture(autouse=True)
    def _database(self, pg_dsn: str, pg_schema: str) -> None:
        self.dsn, self.schema = pg_dsn, pg_schema

    def make_async_store(self, tmp_path: Path) -> AsyncEventStore:
        return AsyncPostgresEventStore(self.dsn, schema=self.schema)

    def open_async_again(self, tmp_path: Path) -> AsyncEventStore:
        return AsyncPostgresEventStore(self.dsn, schema=self.schema)


# ------------------------------------------------- a controller bound to an async store


async def _buffered_round_trip(store: AsyncEventStore) -> None:
    """Commands buffer; one flush appends them as one transaction; a load equals the
    live run; another controller from the same version conflicts on its flush."""
    appends = 0
    append = store.append

    async def counted(*args: object, **kwargs: object) -> None:
        nonlocal appends
        appends += 1
        await append(*args, **kwargs)  # type: ignore[arg-type]

    store.append = counted  # type: ignore[method-assign]
    c = RunController.start(run_id="run-1", session_id="s",
                            store=store)  # type: ignore[arg-type]  # async: buffered
    c.begin_model_call()
    c.model_responded([], output="answer")
    assert c.unflushed == 3
    assert appends == 0
    await c.flush_async()
    assert (c.unflushed, appends) == (0, 1)
    loaded = await RunController.load_async(store, "run-1")
    assert loaded.state == c.state
    assert loaded.events == c.events
    rival = await RunController.load_async(store, "run-1")
    c.claim("a")
    rival.claim("b")
    await c.flush_async()
    with pytest.raises(ConcurrencyConflict):
        await rival.flush_async()
    assert (await RunController.load_async(store, "run-1")).state == c.state
    assert appends == 3


def test_a_controller_on_the_async_sqlite_store_flushes_per_boundary(tmp_path: Path) -> None:
    async def go() -> None:
        store = AsyncSQLiteEventStore(tmp_path / "events.db")
        try:
            await _buffered_round_trip(store)
        finally:
            await store.close()

    asyncio.run(go())


@pytest.mark.postgres
def test_a_controller_on_the_async_postgres_store_flushes_per_boundary(
        pg_dsn: str, pg_schema: str) -> None:
    async def go() -> None:
        async with AsyncPostgresEventStore(pg_dsn, schema=pg_schema) as store:
            await _buffered_round_trip(store)

    asyncio.run(go())


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_an_async_stores_heads_keep_the_newest_events_at(
        kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    # SQ13, PG05 through the async stores: updated_at moves with every flush
    store: Any
    if kind == "sqlite":
        store = AsyncSQLiteEventStore(tmp_path / "e.db")
    else:
        store = AsyncPostgresEventStore(request.getfixturevalue("pg_dsn"),
                                        schema=request.getfixturevalue("pg_schema"))
    readings = iter(range(7_000, 7_100))

    async def go() -> list[int | None]:
        seen = []
        c = RunController.start(run_id="r", session_id="s", store=store,
                                clock=lambda: next(readings))
        await c.flush_async()
        seen.append((await store.list_runs())[0].updated_at)
        c.hook_ran("agent_start")
        c.begin_model_call()
        await c.flush_async()
        seen.append((await store.list_runs())[0].updated_at)
        again = await RunController.load_async(store, "r", clock=lambda: 9_000)
        again.claim("w")
        await again.flush_async()
        seen.append((await store.list_runs())[0].updated_at)
        await store.close()
        return seen

    assert asyncio.run(go()) == [7_000, 7_002, 9_000]


def test_a_sync_stores_missing_run_is_not_found_without_a_worker_thread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`load_async` on a sync store: a run the store does not hold is `RunNotFound` after
    one read on the loop (no worker thread, made and shut down per event loop); a run it
    holds is still decoded and replayed on a worker thread; the arguments are checked
    first, as `load` checks them."""
    store = SQLiteEventStore(tmp_path / "events.db")
    started = RunController.start(run_id="there", session_id="s", store=store)
    started.hook_ran("agent_start")
    hops: list[object] = []
    real = asyncio.to_thread

    async def counted(fn: Any, *args: Any, **kwargs: Any) -> Any:
        hops.append(fn)
        return await real(fn, *args, **kwargs)

    monkeypatch.setattr(asyncio, "to_thread", counted)  # (the module the controller uses)
    with pytest.raises(RunNotFound) as missing:
        asyncio.run(RunController.load_async(store, "absent"))
    assert (missing.value.run_id, missing.value.action) == ("absent", "load")
    assert hops == []
    loaded = asyncio.run(RunController.load_async(store, "there"))
    assert [type(e).__name__ for e in loaded.events] == ["RunStarted", "HookRan"]
    assert len(hops) == 1
    with pytest.raises(SchemaError, match="max_bytes"):
        asyncio.run(RunController.load_async(store, "absent", max_bytes=0))


@pytest.mark.parametrize("group_commit", [True, False], ids=["grouped", "apart"])
def test_a_closed_async_sqlite_store_refuses_every_call_with_storage_error(
        tmp_path: Path, group_commit: bool) -> None:
    """After `close`, an append (grouped or not) and a read are refused with
    `StorageError` (``not_written``), nothing written, and closing again does nothing;
    before, the shut-down worker's `RuntimeError` came out of them (and of a second
    `close`)."""
    from statemachine import StorageError
    from tests.helpers import at_interruption

    events = at_interruption().events
    path = tmp_path / "events.db"

    async def body() -> None:
        store = AsyncSQLiteEventStore(path, group_commit=group_commit)
        await store.append("run-1", events[:1], 0)
        await store.close()
        await store.close()
        with pytest.raises(StorageError, match="closed") as refused:
            await store.append("run-1", events[1:2], 1)
        assert refused.value.outcome == "not_written"
        assert refused.value.run_id == "run-1"
        with pytest.raises(StorageError, match="closed"):
            await store.load("run-1")

    asyncio.run(body())
    assert SQLiteEventStore(path).load("run-1") == list(events[:1])
