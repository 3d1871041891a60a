"""Run heads keep each run's read model (DESIGN §7.5): after every command, on every store
that keeps them, a head's blocker and inbox entries are what a fresh load of the run says
(`RunController.blocker`, `RunController.waiting`), kept by the append itself (the head
row is folded before anything lists it), for controllers that append per event or
buffer, and for a commit that carries its Session write. A head without one (a direct
append, an older store) or whose read model does not decode is folded from the log. And
an append that does not land leaves the controller exactly as it was, a run loaded from
a snapshot included (the journal folds before it appends, then puts the state back)."""

from __future__ import annotations

import asyncio
import sqlite3
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from statemachine import RunController, Step, ToolCall
from statemachine import events as ev
from statemachine.blocker import BlockerKind, ReadModel
from statemachine.errors import ConcurrencyConflict, StorageError
from statemachine.postgres import AsyncPostgresEventStore, PostgresEventStore
from statemachine.stores import (
    SNAPSHOT_EVERY,
    AsyncSQLiteEventStore,
    EventStore,
    IndexedStore,
    MemoryEventStore,
    RunHead,
    SessionWrite,
    Snapshot,
    SQLiteEventStore,
    keeps_read_models,
)
from statemachine.testing.contracts import AsyncStoreAdapter, at_interruption
from statemachine.testing.random_runs import RandomRun
from statemachine.values import RecoveryPolicy
from tests.helpers import B, P, run_charge

KINDS = ["memory", "sqlite", "async_sqlite",
         pytest.param("postgres", marks=pytest.mark.postgres),
         pytest.param("async_postgres", marks=pytest.mark.postgres)]

Opener = Callable[[], Any]


@pytest.fixture(params=KINDS)
def open_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Opener]:
    """Opens the store under test again and again (the sync face of an async one: its
    appends still go through the async store's own ``append``)."""
    kind = request.param
    opened: list[Any] = []
    memory = MemoryEventStore()

    def opener() -> Any:
        if kind == "memory":
            return memory
        if kind == "sqlite":
            store: Any = SQLiteEventStore(tmp_path / "events.db")
        elif kind == "async_sqlite":
            store = AsyncStoreAdapter(AsyncSQLiteEventStore(tmp_path / "events.db"))
        else:
            dsn = request.getfixturevalue("pg_dsn")
            schema = request.getfixturevalue("pg_schema")
            store = (PostgresEventStore(dsn, schema=schema) if kind == "postgres" else
                     AsyncStoreAdapter(AsyncPostgresEventStore(dsn, schema=schema)))
        opened.append(store)
        return store

    yield opener
    for store in opened:
        store.close()


def _raw_head(store: Any, run_id: str) -> tuple[Any, Any, Any] | None:
    """The head's step, read model text and blocker as the store keeps them, read past
    ``list_runs`` (which would fold an unfolded head); None for the memory store's
    unfolded head."""
    inner = getattr(store, "inner", store)
    inner = getattr(inner, "sync", inner)
    if isinstance(inner, MemoryEventStore):
        fold = inner._folds.get(run_id)
        if fold is None:
            return None
        step, model = fold
        kind = None if model.blocker is None else model.blocker.kind.value
        return step.value, model.encode(), kind
    if isinstance(inner, SQLiteEventStore):
        with sqlite3.connect(inner.path) as raw:
            row = raw.execute("SELECT step, read_model, blocker FROM runs WHERE run_id = ?",
                              (run_id,)).fetchone()
        return None if row is None else tuple(row)
    with psycopg.connect(inner.dsn, autocommit=True) as raw:
        row = raw.execute(f'SELECT step, read_model, blocker FROM "{inner.schema}".runs '
                          "WHERE run_id = %s", (run_id,)).fetchone()
    return None if row is None else tuple(row)


def check_heads(store: Any, *run_ids: str) -> None:
    """Every head is what a fresh load of its run says, and was kept by the append (its
    row is folded before any listing)."""
    for run_id in run_ids:
        fresh = RunController.load(store, run_id, snapshot=False)
        expected = ReadModel(fresh.blocker, fresh.waiting)
        raw = _raw_head(store, run_id)
        assert raw is not None, run_id
        assert raw[0] == fresh.step.value, (run_id, raw)
        kind = None if fresh.blocker is None else fresh.blocker.kind.value
        assert (raw[1], raw[2]) == (expected.encode(), kind), run_id
    heads = {head.run_id: head for head in store.list_runs()}
    for run_id in run_ids:
        fresh = RunController.load(store, run_id)
        head = heads[run_id]
        assert (head.step, head.version, head.blocker, head.waiting) == (
            fresh.step, fresh.version, fresh.blocker, fresh.waiting), run_id


# ------------------------------------------------------------ every blocker kind


Command = Callable[[RunController], Any]
"""A command; a `RunController` it returns replaces the one driven (a reload)."""


def _reload(c: RunController) -> RunController:
    assert c.store is not None
    return RunController.load(c.store, c.run_id)


def _each_kind() -> list[tuple[str | None, Command]]:
    """A run through every blocker: decisions, a call in doubt after a reload, settled,
    an unsettled publication, committed, abandoned. Each command, the kind it leads to
    (what the fresh load must say, for an independent check of the test itself)."""
    return [
        ("awaiting_decisions", lambda c: None),
        (None, lambda c: c.approve("charge", fingerprint=c.fingerprint("charge"))),
        (None, lambda c: c.approve("audit")),
        (None, lambda c: c.reject("notify", "no")),
        (None, lambda c: c.resume()),
        ("in_doubt", lambda c: c.begin_tool("charge")),
        ("in_doubt", _reload),
        (None, lambda c: c.resolve_in_doubt("charge", "charged 7")),
        ("in_doubt", lambda c: c.begin_tool("audit")),
        (None, lambda c: c.tool_completed("audit", "logged")),
        ("unsettled", _stage),
        ("unsettled", _reload),
        ("not_resumable", lambda c: c.abandon("operator gave up", by="alice")),
    ]


def _stage(c: RunController) -> None:
    c.stage_publication(B, P, call_ids=["charge", "audit"])


def _drive(store: Any, c: RunController, script: list[tuple[str | None, Command]],
           buffered: bool) -> RunController:
    for kind, command in script:
        again = command(c)
        c = again if isinstance(again, RunController) else c
        if buffered:
            c.flush()
        check_heads(store, c.run_id)
        found = None if c.blocker is None else c.blocker.kind.value
        assert found == kind, (kind, found)
    return c


@pytest.mark.parametrize("buffered", [False, True], ids=["per_event", "buffered"])
def test_a_head_shows_every_blocker_kind_after_every_command(open_store: Opener,
                                                             buffered: bool) -> None:
    store = open_store()
    assert keeps_read_models(store)
    c = at_interruption(store, buffered=buffered)
    c.flush()
    _drive(store, c, _each_kind(), buffered)
    check_heads(open_store(), "run-1")  # and opened again


@pytest.mark.parametrize("buffered", [False, True], ids=["per_event", "buffered"])
def test_a_publication_that_fails_closed_completed_and_running_runs(open_store: Opener,
                                                                    buffered: bool) -> None:
    store = open_store()
    closed = at_interruption(store, "closed", policy=RecoveryPolicy.FAIL_CLOSED,
                             buffered=buffered)
    run_charge(closed)
    closed.stage_publication(B, P, call_ids=["charge", "audit"])
    closed.flush()
    check_heads(store, "closed")
    reloaded = _reload(closed)  # the write never answered: it fails closed
    assert reloaded.blocker is not None
    assert reloaded.blocker.kind is BlockerKind.NOT_RESUMABLE
    check_heads(store, "closed")
    reloaded.abandon("repaired by hand")
    check_heads(store, "closed")
    failed = at_interruption(store, "failed", policy=RecoveryPolicy.FAIL_CLOSED,
                             buffered=buffered)
    run_charge(failed)
    failed.stage_publication(B, P, call_ids=["charge", "audit"])
    failed.publication_failed(RuntimeError("the write failed"))  # it fails closed
    failed.flush()
    assert failed.blocker is not None
    assert failed.blocker.kind is BlockerKind.NOT_RESUMABLE
    check_heads(store, "failed")
    done = RunController.start(run_id="done", session_id=None, store=store,
                               buffered=buffered)
    done.begin_model_call()
    done.model_responded([], output="the answer")
    done.flush()
    check_heads(store, "done")  # running: nothing blocks
    assert done.blocker is None
    done.accept_final_output("the answer")
    done.complete()
    done.flush()
    assert done.step is Step.COMPLETED
    check_heads(store, "done", "closed", "failed")


@settings(max_examples=15, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow])
@given(data=st.data())
def test_random_runs_keep_their_heads_after_every_move(open_store: Opener,
                                                       data: st.DataObject) -> None:
    store = open_store()
    run_id = f"r-{uuid.uuid4().hex}"  # the store outlives an example: a fresh run each
    run = RandomRun.start(data, run_id=run_id, store=store)
    check_heads(store, run_id)
    for _ in range(data.draw(st.integers(0, 30), label="moves")):
        if not run.step(data):
            break
        check_heads(store, run_id)


# -------------------------------------------------- a commit with its Session write


@pytest.mark.postgres
@pytest.mark.parametrize("face", ["sync", "async"])
def test_a_commit_carrying_its_session_write_keeps_the_settled_read_model(
        pg_dsn: str, pg_schema: str, face: str) -> None:
    if face == "sync":
        store: Any = PostgresEventStore(pg_dsn, schema=pg_schema)
        c = at_interruption(store)
        run_charge(c)
        c.stage_publication(B, P, call_ids=["charge", "audit"])
        publication = c.publication_id
        assert publication is not None
        c.publication_committed(session_write=SessionWrite("session-1", publication,
                                                           tuple(B)))
        check_heads(store, "run-1")
        store.close()
        return

    async def scenario() -> None:
        inner = AsyncPostgresEventStore(pg_dsn, schema=pg_schema)
        c = at_interruption(inner)  # type: ignore[arg-type]  # (an async store)
        run_charge(c)
        c.stage_publication(B, P, call_ids=["charge", "audit"])
        publication = c.publication_id
        assert publication is not None
        c.publication_committed(session_write=SessionWrite("session-1", publication,
                                                           tuple(B)))
        await c.flush_async()
        await inner.close()

    asyncio.run(scenario())
    adapter = AsyncStoreAdapter(AsyncPostgresEventStore(pg_dsn, schema=pg_schema))
    try:
        fresh = RunController.load(adapter, "run-1")
        assert fresh.step is Step.INTERRUPTION
        assert fresh.blocker is not None
        assert fresh.blocker.call_ids == ("notify",)  # settled: notify awaits its decision
        check_heads(adapter, "run-1")
    finally:
        adapter.close()


def test_an_async_sqlite_store_keeps_a_buffered_controllers_read_model(tmp_path: Path
                                                                        ) -> None:
    async def scenario() -> None:
        store = AsyncSQLiteEventStore(tmp_path / "events.db")
        c = at_interruption(store)  # type: ignore[arg-type]  # async: the controller buffers
        await c.flush_async()
        c.approve("charge")
        c.approve("audit")
        c.reject("notify")
        c.resume()
        c.begin_tool("charge")
        await c.flush_async()
        await store.close()

    asyncio.run(scenario())
    store = SQLiteEventStore(tmp_path / "events.db")
    check_heads(store, "run-1")
    (head,) = store.list_runs()
    assert head.blocker is not None
    assert head.blocker.kind is BlockerKind.IN_DOUBT
    assert [w.call_id for w in head.waiting] == ["charge"]
    store.close()


# ------------------------------------------- heads without one, or a damaged one


def test_a_direct_append_leaves_the_head_unfolded_and_listing_folds_it(
        open_store: Opener) -> None:
    source = at_interruption(run_id="run-1")
    events = list(source.events)
    store = open_store()
    store.append("run-1", events[:2], 0)  # a run's first append is folded
    assert _raw_head(store, "run-1") is not None
    store.append("run-1", events[2:], 2, step=Step.INTERRUPTION)  # a step, no read model
    raw = _raw_head(store, "run-1")
    assert raw is None or raw[0] is None  # unfolded: "nothing waits" is never assumed
    (head,) = store.list_runs()
    assert head.blocker == source.blocker
    assert head.waiting == source.waiting
    assert head.blocker is not None
    check_heads(store, "run-1")  # and the fold was kept


def test_a_damaged_read_model_is_folded_again_never_shown_as_nothing(
        tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    store = SQLiteEventStore(path)
    c = at_interruption(store)
    for text, kind in [("not json", "awaiting_decisions"), ('{"blocker":null}', None),
                       (c.blocker and ReadModel(None, c.waiting).encode(), "in_doubt"),
                       (ReadModel(c.blocker, c.waiting).encode(), None)]:
        with sqlite3.connect(path) as raw:
            raw.execute("UPDATE runs SET read_model = ?, blocker = ?", (text, kind))
        (head,) = SQLiteEventStore(path).list_runs()
        assert (head.blocker, head.waiting) == (c.blocker, c.waiting)
        check_heads(store, "run-1")  # kept again


@pytest.mark.postgres
@pytest.mark.parametrize("face", ["sync", "async"])
def test_a_damaged_read_model_on_postgresql_is_folded_again(pg_dsn: str, pg_schema: str,
                                                            face: str) -> None:
    store: Any = (PostgresEventStore(pg_dsn, schema=pg_schema) if face == "sync" else
                  AsyncStoreAdapter(AsyncPostgresEventStore(pg_dsn, schema=pg_schema)))
    try:
        c = at_interruption(store)
        with psycopg.connect(pg_dsn, autocommit=True) as raw:
            raw.execute(f'UPDATE "{pg_schema}".runs SET read_model = %s, blocker = NULL',
                        ('{"blocker":null,"waiting":[[1]]}',))
        (head,) = store.list_runs()
        assert (head.blocker, head.waiting) == (c.blocker, c.waiting) != (None, ())
        check_heads(store, "run-1")
    finally:
        store.close()


def test_an_older_sqlite_database_gains_the_columns_with_every_head_unfolded(
        tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    first = SQLiteEventStore(path)
    at_interruption(first)
    first.close()
    with sqlite3.connect(path) as raw:  # as the previous version left it
        raw.execute("ALTER TABLE runs DROP COLUMN read_model")
        raw.execute("ALTER TABLE runs DROP COLUMN blocker")
    readonly = SQLiteEventStore(path, readonly=True)
    (head,) = readonly.list_runs(steps={Step.INTERRUPTION})
    assert head.blocker is not None
    assert head.blocker.kind is BlockerKind.AWAITING_DECISIONS
    readonly.close()
    with sqlite3.connect(path) as raw:
        assert not any(row[1] == "read_model" for row in raw.execute("PRAGMA table_info(runs)"))
    store = SQLiteEventStore(path)  # upgraded in place: every head unfolded
    assert _raw_head(store, "run-1") == (None, None, None)
    (head,) = store.list_runs()
    assert head.blocker is not None
    assert head.blocker.kind is BlockerKind.AWAITING_DECISIONS
    check_heads(store, "run-1")
    RunController.load(store, "run-1").approve("charge")
    check_heads(store, "run-1")
    store.close()


@pytest.mark.postgres
def test_a_version_4_schema_gains_the_columns_with_every_head_unfolded(
        pg_dsn: str, pg_schema: str) -> None:
    s = f'"{pg_schema}"'
    with PostgresEventStore(pg_dsn, schema=pg_schema) as store:
        at_interruption(store)
    with psycopg.connect(pg_dsn, autocommit=True) as admin:  # as version 4 left it
        admin.execute(f"ALTER TABLE {s}.runs DROP COLUMN read_model, DROP COLUMN blocker")
        admin.execute(f"UPDATE {s}.statemachine_schema SET version = 4")
    with PostgresEventStore(pg_dsn, schema=pg_schema, readonly=True) as readonly:
        (head,) = readonly.list_runs(steps={Step.INTERRUPTION})
        assert head.blocker is not None
        assert head.blocker.kind is BlockerKind.AWAITING_DECISIONS
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        assert admin.execute(f"SELECT version FROM {s}.statemachine_schema").fetchall() == [
            (4,)]
    with PostgresEventStore(pg_dsn, schema=pg_schema) as store:
        store.version("run-1")  # opened: upgraded
        assert _raw_head(store, "run-1") == (None, None, None)
        (head,) = store.list_runs()
        assert head.blocker is not None
        assert head.blocker.kind is BlockerKind.AWAITING_DECISIONS
        check_heads(store, "run-1")
        RunController.load(store, "run-1").approve("charge")
        check_heads(store, "run-1")
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        assert admin.execute(f"SELECT version FROM {s}.statemachine_schema").fetchall() == [
            (5,)]


# ----------------------------------------------- an append that does not land


class _Refusing(MemoryEventStore):
    """Refuses the next append when armed, writing nothing (``"not_written"``)."""

    armed = False

    def append(self, run_id: str, events: Sequence[ev.Event], expected_version: int, *,
               snapshot: Snapshot | None = None, step: Step | None = None,
               read_model: ReadModel | None = None) -> None:
        if self.armed:
            self.armed = False
            raise StorageError("the disk said no", outcome="not_written")
        super().append(run_id, events, expected_version, snapshot=snapshot, step=step,
                       read_model=read_model)


def _observed(c: RunController) -> tuple[Any, ...]:
    return (c.state.view(), c.events, c.step, c.version, c.blocker, c.waiting)


def _long_run(store: IndexedStore, *, respond: bool = True) -> RunController:
    """A run past a snapshot (SNAPSHOT_EVERY events), paused on decisions."""
    c = RunController.start(run_id="long", session_id="s", store=store)
    while c.version < SNAPSHOT_EVERY + 10:
        c.begin_model_call()
        c.model_failed(TimeoutError())
    if respond:
        c.begin_model_call()
        c.model_responded([ToolCall("a", "tool", {}, needs_approval=True)])
    return c


def test_an_unfolded_head_past_a_snapshot_is_folded_from_it(open_store: Opener) -> None:
    store = open_store()
    version = _long_run(store, respond=False).version
    source = MemoryEventStore()
    _long_run(source)
    tail = source.load("long")[version:]
    store.append("long", tail, version)  # written directly: unfolded
    (head,) = store.list_runs()
    assert head.blocker is not None
    assert head.blocker.kind is BlockerKind.AWAITING_DECISIONS
    check_heads(store, "long")


@pytest.mark.parametrize("long", [False, True], ids=["whole_log", "from_a_snapshot"])
def test_an_append_refused_leaves_the_controller_as_it_was(long: bool) -> None:
    store = _Refusing()
    if long:
        _long_run(store)
        c = RunController.load(store, "long")
        assert c._journal.origin is not None  # loaded from the snapshot
    else:
        c = at_interruption(store)
    call = c.pending_approvals[0]
    before = _observed(c)
    store.armed = True
    with pytest.raises(StorageError):
        c.approve(call)
    assert _observed(c) == before
    c.approve(call)  # and it goes on
    check_heads(store, c.run_id)


@pytest.mark.parametrize("long", [False, True], ids=["whole_log", "from_a_snapshot"])
def test_an_append_another_writer_beat_leaves_the_controller_as_it_was(
        open_store: Opener, long: bool) -> None:
    store = open_store()
    run_id = "long" if long else "run-1"
    (_long_run if long else at_interruption)(store)
    c = RunController.load(store, run_id)
    other = RunController.load(open_store(), run_id)
    call = c.pending_approvals[0]
    other.reject(call)
    before = _observed(c)
    with pytest.raises(ConcurrencyConflict):
        c.approve(call)
    assert _observed(c) == before
    check_heads(store, run_id)
    heads: tuple[RunHead, ...] = store.list_runs()
    assert [(h.blocker, h.waiting) for h in heads if h.run_id == run_id] == [
        (other.blocker, other.waiting)]  # the writer that landed


def test_a_store_subclass_without_read_model_gets_unfolded_heads(tmp_path: Path) -> None:
    class Older(SQLiteEventStore):  # written before read models
        def append(  # type: ignore[override]
                self, run_id: str, events: Sequence[ev.Event], expected_version: int, *,
                snapshot: Snapshot | None = None, step: Step | None = None) -> None:
            super().append(run_id, events, expected_version, snapshot=snapshot, step=step)

    store = Older(tmp_path / "events.db")
    assert not keeps_read_models(store)
    c = at_interruption(store)
    c.approve("charge")
    assert _raw_head(store, "run-1") == (None, None, None)
    (head,) = store.list_runs()  # folded where it is listed, and kept
    assert (head.blocker, head.waiting) == (c.blocker, c.waiting)
    check_heads(SQLiteEventStore(tmp_path / "events.db"), "run-1")
    store.close()


def test_a_plain_event_store_is_handed_no_read_model() -> None:
    class Plain:
        def __init__(self) -> None:
            self.inner = MemoryEventStore()

        def append(self, run_id: str, events: Sequence[ev.Event],
                   expected_version: int, *, snapshot: Snapshot | None = None) -> None:
            self.inner.append(run_id, events, expected_version, snapshot=snapshot)

        def load(self, run_id: str) -> list[ev.Event]:
            return self.inner.load(run_id)

    plain: EventStore = Plain()
    assert not keeps_read_models(plain)
    c = at_interruption(plain)
    c.approve("charge")
    assert RunController.load(plain, "run-1").state.view() == c.state.view()


def test_an_interrupt_between_the_fold_and_the_append_leaves_the_run_as_its_log(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-event path folds an event before its append (the head keeps the state it
    leads to): whatever stops it before the append lands (here a KeyboardInterrupt in the
    read model) puts the state back, so the next command goes on from the log."""
    from statemachine import journal as journal_module

    store = SQLiteEventStore(tmp_path / "events.db")
    c = RunController.start(run_id="r", session_id=None, store=store)
    c.begin_model_call()
    before = c.state.view()

    def interrupted(*_: object, **__: object) -> None:
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(journal_module, "read_model", interrupted)
        with pytest.raises(KeyboardInterrupt):
            c.model_responded([ToolCall("a", "pay", {}, needs_approval=True)])
    assert c.state.view() == before
    assert c.step is Step.AWAITING_MODEL
    c.model_responded([ToolCall("a", "pay", {}, needs_approval=True)])
    c.approve("a")
    again = RunController.load(store, "r")
    assert again.state == c.state


def test_a_failed_append_names_the_step_the_run_is_in(tmp_path: Path) -> None:
    """Not the step the event would have led to (the state was folded ahead of it)."""
    from statemachine import ConcurrencyConflict

    store = SQLiteEventStore(tmp_path / "events.db")
    c = RunController.start(run_id="r", session_id=None, store=store)
    rival = RunController.load(store, "r")
    rival.claim("other")
    with pytest.raises(ConcurrencyConflict) as info:
        c.begin_model_call()
    assert info.value.step is Step.RUN_AGAIN
    assert c.step is Step.RUN_AGAIN
