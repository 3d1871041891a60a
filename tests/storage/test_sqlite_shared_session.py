"""A `SQLiteSession` in the store's own file shares the store's append (DESIGN §7.7): a
publication's staging, items and commit land in one transaction or not at all, one
commit where there were three, and a failure before COMMIT leaves neither; the
reference runner end to end, each Session item once, the commits counted by the stores
against the same run with the Session in a file of its own."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from statemachine import RunController, Step
from statemachine import events as ev
from statemachine.errors import ConcurrencyConflict, StorageError
from statemachine.runner import Agent, ModelResponse, Runner
from statemachine.runner.publish import publish
from statemachine.sessions import SQLiteSession
from statemachine.sqlite import AsyncSQLiteEventStore
from statemachine.stores import SessionWrite, SQLiteEventStore
from statemachine.testing import Counters, ScriptedModel, counted_tool
from tests.helpers import SESSION, B, P, assert_refused, at_interruption, run_charge

CALLS = ["charge", "audit"]


def _charged(store: Any) -> RunController:
    c = at_interruption(store=store)
    run_charge(c)
    return c


def _write_for(c: RunController) -> SessionWrite:
    return SessionWrite(SESSION, f"run-1:{c.state.attempt_seq}", tuple(B))


def _rows(path: Path) -> list[tuple[str, Any]]:
    """Every Session item in the file (none before the table exists)."""
    with sqlite3.connect(path) as conn:
        if not conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'session_items'"
                            ).fetchone():
            return []
        return [(sid, json.loads(body)) for sid, body in conn.execute(
            "SELECT session_id, body FROM session_items ORDER BY id")]


def test_the_session_shares_only_a_writable_store_of_its_own_file(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    store = SQLiteEventStore(path)
    session = SQLiteSession(SESSION, path)
    assert session.shares_transaction_with(store)
    assert session.shares_transaction_with(AsyncSQLiteEventStore(path))
    # the same file by another name: still shared
    (tmp_path / "link.db").symlink_to(path)
    assert SQLiteSession(SESSION, tmp_path / "link.db").shares_transaction_with(store)
    assert not SQLiteSession(SESSION, tmp_path / "other.db").shares_transaction_with(store)
    assert not session.shares_transaction_with(SQLiteEventStore(path, readonly=True))
    assert not session.shares_transaction_with(object())

    class Wrapped(SQLiteEventStore):  # an append that does not name session_write=
        def append(self, *args: Any, **kwargs: Any) -> None:
            kwargs.pop("session_write", None)
            super().append(*args, **kwargs)

    assert not session.shares_transaction_with(Wrapped(path))


@pytest.mark.parametrize("buffered", [False, True])
def test_a_publication_is_one_transaction_with_its_commit(tmp_path: Path,
                                                          buffered: bool) -> None:
    path = tmp_path / "events.db"
    store = SQLiteEventStore(path)
    session = SQLiteSession(SESSION, path)

    async def go() -> None:
        await session.add_items(list(P))
        c = _charged(store)
        if buffered:  # loaded buffered: publish records the staging unflushed
            c = RunController.load(store, "run-1", buffered=True)
        before = store.commits
        await publish(c, session, list(B), call_ids=CALLS)
        assert c.step is Step.INTERRUPTION  # settled: notify still awaits its decision
        # per command the staging was appended on its own; buffered it rides along
        assert store.commits == before + (1 if buffered else 2)
        assert session.commits == 1  # only the input P, written by the Session itself
        assert await session.get_items() == P + B
        assert store.load("run-1") == list(c.events)
        assert RunController.load(store, "run-1").state == c.state
        staged = [e.seq for e in c.events if isinstance(e, ev.PublicationStaged)][-1]
        with sqlite3.connect(path) as conn:  # the items and the commit: one batch
            batches = {b for (b,) in conn.execute(
                "SELECT batch_id FROM events WHERE run_id = 'run-1' AND seq >= ?",
                (staged + (0 if buffered else 1),))}
        assert len(batches) == 1

    asyncio.run(go())


def test_a_refused_append_writes_no_item(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    store = SQLiteEventStore(path)
    session = SQLiteSession(SESSION, path)
    c = _charged(store)
    c.stage_publication(B, P, call_ids=CALLS)
    other = RunController.load(store, "run-1")
    other.claim("another worker")  # the log moves on under this controller
    before = store.commits
    assert_refused(c, ConcurrencyConflict, c.publication_committed,
                   session_write=_write_for(c))
    assert _rows(path) == []
    assert store.commits == before
    assert asyncio.run(session.get_items()) == []
    assert c.holds_attempt


def test_a_failure_before_commit_writes_neither(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    store = SQLiteEventStore(path)
    c = _charged(store)
    c.stage_publication(B, P, call_ids=CALLS)
    logged = store.load("run-1")
    blocker = sqlite3.connect(path, timeout=0, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")  # another connection holds the write lock
    store._timeout = 0.05  # the append gives up waiting, before COMMIT
    store._drop_connection()
    try:
        error = assert_refused(c, StorageError, c.publication_committed,
                               session_write=_write_for(c))
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert error.outcome == "not_written"
    assert _rows(path) == []
    assert store.load("run-1") == logged
    assert c.holds_attempt


@pytest.mark.parametrize("mode", ["per-command", "buffered", "async"])
def test_the_reference_runner_end_to_end(tmp_path: Path, mode: str) -> None:
    """Approval, the tool once, completed; each Session item once; the commits the
    stores counted, with the Session in the store's file against one of its own."""

    def run(path: Path, session_path: Path) -> tuple[int, list[Any]]:
        counters = Counters()
        tools = (counted_tool(counters, "charge", lambda x: f"charged {x}",
                              needs_approval=True),)
        model = ScriptedModel([ModelResponse((("charge", "charge", {"x": 7}),)),
                               ModelResponse(output="charged")])
        agent = Agent("billing", model, tools)
        buffered = mode == "buffered"

        async def go() -> tuple[int, list[Any]]:
            store: Any = (AsyncSQLiteEventStore(path) if mode == "async"
                          else SQLiteEventStore(path))
            session = SQLiteSession("seed-session", session_path)
            first = await Runner.run(agent, "charge me 7", session=session, store=store,
                                     run_id="seed", buffered=buffered)
            c = first.controller
            c.approve("charge", fingerprint=c.fingerprint("charge"))
            await c.flush_async()
            done = await Runner.run(agent, session=session, store=store, run_id="seed",
                                    buffered=buffered)
            assert done.step is Step.COMPLETED
            assert counters.tools == {"charge": 1}
            items = await session.get_items()
            commits = store.commits + session.commits
            if mode == "async":
                await store.close()
            else:
                store.close()
            session.close()
            return commits, items

        return asyncio.run(go())

    shared, items = run(tmp_path / "a.db", tmp_path / "a.db")
    apart, apart_items = run(tmp_path / "b.db", tmp_path / "b-session.db")
    assert items == apart_items
    texts = [json.dumps(item, sort_keys=True) for item in items]
    assert len(texts) == len(set(texts))  # each item once
    assert items[0] == {"role": "user", "content": "charge me 7"}
    # three publications (the input, the charge's result, the final output): each one
    # append instead of a staging flush, a Session write and a commit append
    assert shared <= apart - 3, (shared, apart)
    log = SQLiteEventStore(tmp_path / "a.db", readonly=True).load("seed")
    commits = [e for e in log if isinstance(e, ev.PublicationCommitted)]
    assert len(commits) == 3


# ------------------------------------------------- the store reads the Session it writes


@pytest.mark.parametrize("limit", [None, 0, 1, 2, 3, 5, -1])
def test_the_store_reads_a_session_of_its_file_as_the_session_does(
        tmp_path: Path, limit: int | None) -> None:
    """`SQLiteEventStore.session_items`: the items of that Session alone, in the order
    written, all of them or the last ``limit`` (none for a limit of 0 or less), as
    `SQLiteSession.get_items` gives them; nothing in a file with no Session yet."""
    path = tmp_path / "events.db"
    store = SQLiteEventStore(path)
    assert store.session_items(SESSION, limit) == []  # no Session table in the file yet
    mine, other = SQLiteSession(SESSION, path), SQLiteSession("other", path)
    written = [{"n": 1}, ["two"], "three"]
    for item in written:  # interleaved with another Session's items
        asyncio.run(mine.add_items([item]))
        asyncio.run(other.add_items([{"other": item}]))
    expected = (written if limit is None else written[max(len(written) - limit, 0):]
                if limit > 0 else [])
    assert store.session_items(SESSION, limit) == expected
    assert asyncio.run(mine.get_items(limit)) == expected
    assert store.session_items("nobody", limit) == []


def test_the_store_refuses_a_damaged_session_item_as_the_session_does(
        tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    store = SQLiteEventStore(path)
    session = SQLiteSession(SESSION, path)
    asyncio.run(session.add_items([{"n": 1}]))
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE session_items SET body = 'not json'")
    with pytest.raises(StorageError) as ours:
        store.session_items(SESSION)
    with pytest.raises(StorageError) as theirs:
        asyncio.run(session.get_items())
    assert (ours.value.outcome, str(ours.value)) == (theirs.value.outcome,
                                                      str(theirs.value))
    assert ours.value.outcome == "not_written"


def _agent(counters: Counters) -> Agent:
    tools = (counted_tool(counters, "charge", lambda x: f"charged {x}"),)
    return Agent("billing", ScriptedModel([ModelResponse((("charge", "charge", {"x": 7}),)),
                                           ModelResponse(output="charged")]), tools)


@pytest.mark.parametrize("store_kind", ["sync", "async"])
def test_a_runner_reads_the_session_through_the_store_of_its_file(tmp_path: Path,
                                                                   store_kind: str) -> None:
    """Beside a store of its file, the runner reads the Session through the store: a sync
    store on the loop's thread, an async one on its worker thread. The Session's own
    thread never starts, and the turn sees and leaves the same history: the input, the
    call, its output, the answer."""
    path = tmp_path / "events.db"
    counters = Counters()
    session = SQLiteSession(SESSION, path)

    async def go() -> list[Any]:
        store: Any = SQLiteEventStore(path) if store_kind == "sync" else (
            AsyncSQLiteEventStore(path))
        done = await Runner.run(_agent(counters), "charge me 7", session=session,
                                store=store, run_id="r")
        assert done.step is Step.COMPLETED
        if store_kind == "async":
            await store.close()
        else:
            store.close()
        return [item.get("type", item.get("role")) for item in _items(path)]

    kinds = asyncio.run(go())
    assert kinds == ["user", "function_call", "function_call_output", "assistant"]
    assert counters.tools == {"charge": 1}
    threads = len(session._worker._threads)  # (started on its first call, not before)
    assert threads == 0
    session.close()


def _items(path: Path) -> list[Any]:
    return [item for _, item in _rows(path)]


def test_a_session_table_made_by_an_append_that_rolled_back_is_made_again(
        tmp_path: Path) -> None:
    """The store makes the Session's table in the first append that writes items; when
    that append rolls back, so does the table, and the next one makes it again (the
    store does not take it as made before an append of items landed)."""
    path = tmp_path / "events.db"
    store = SQLiteEventStore(path)  # (no SQLiteSession has made the table)
    c = _charged(store)
    c.stage_publication(B, P, call_ids=CALLS)
    real = store._write

    def fails_after(conn: Any, a: Any) -> None:
        real(conn, a)
        raise OSError("disk gone after the statements, before COMMIT")

    store._write = fails_after  # type: ignore[method-assign]
    error = assert_refused(c, StorageError, c.publication_committed,
                           session_write=_write_for(c))
    assert error.outcome == "not_written"
    assert _rows(path) == []  # the table went with the transaction
    store._write = real  # type: ignore[method-assign]
    c.publication_committed(session_write=_write_for(c))
    assert [item for _, item in _rows(path)] == list(B)
    assert store.session_items(SESSION) == list(B)


class _Proxy:
    """A Session wrapping another, its methods found through ``__getattr__`` (none on
    its class)."""

    def __init__(self, inner: SQLiteSession) -> None:
        self.inner = inner
        self.reads = 0

    def __getattr__(self, name: str) -> Any:
        if name == "get_items":
            self.reads += 1
        return getattr(self.inner, name)


def test_a_session_proxy_beside_a_sync_store_is_read_through_itself(tmp_path: Path) -> None:
    """A Session that is not a `SQLiteSession` (here a proxy of one, sharing the store's
    file) is read through its own ``get_items``, as before: the turn completes and every
    read went through the proxy."""
    path = tmp_path / "events.db"
    counters = Counters()
    session = _Proxy(SQLiteSession(SESSION, path))

    async def go() -> None:
        store = SQLiteEventStore(path)
        done = await Runner.run(_agent(counters), "charge me 7", session=session,
                                store=store, run_id="r")
        assert done.step is Step.COMPLETED
        store.close()

    asyncio.run(go())
    assert counters.tools == {"charge": 1}
    assert session.reads >= 2  # the one-writer check and the first staging, at least
    assert [item.get("type", item.get("role")) for item in _items(path)] == [
        "user", "function_call", "function_call_output", "assistant"]
    session.inner.close()
