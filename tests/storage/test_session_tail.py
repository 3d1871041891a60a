"""A publication's Session write carries the tail it was staged against
(`SessionWrite.after`), and the SQLite and PostgreSQL stores check it inside the append's
own transaction: a Session another writer moved after the run read it refuses the whole
append (`ReconcileRejected`), events and items, where before the write would have landed
after the other writer's items, answering what the model never saw. The reference runner
then keeps the Session it read in an attempt (`publish.keeps_history`) instead of reading
it before every publication and model call, and reads it again after code of the user's
(a tool, a hook, a guardrail, a stream's consumer), which may have written to it.

Every test runs on a SQLite file and on a PostgreSQL schema, through the sync store and
the async one (group commit on). Expected outcomes come from a model of the check
(`_lands`), not from the store."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import tempfile
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs
import psycopg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from statemachine import ConcurrencyConflict, ReconcileRejected, RunController, SchemaError, Step
from statemachine.errors import StorageError
from statemachine.postgres import (
    AsyncPostgresEventStore,
    AsyncPostgresSession,
    PostgresEventStore,
    PostgresSession,
)
from statemachine.runner import (
    ALLOW,
    Agent,
    FunctionTool,
    ModelResponse,
    OutputGuardrail,
    RunHooks,
    Runner,
    Verdict,
)
from statemachine.sessions import SQLiteSession
from statemachine.stores import AsyncSQLiteEventStore, SessionWrite, SQLiteEventStore
from statemachine.testing import ScriptedModel
from tests import pg_cluster

SESSION = "s"
ITEMS = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
         {"type": "note", "n": 1, "text": "a\x00b"}]
"""Few distinct items, so that a tail that differs often differs only in its order or
its length."""
NEW = {"role": "assistant", "content": "new"}
KINDS = ["sqlite-sync", "sqlite-async", "pg-sync", "pg-async"]


@attrs.frozen
class Place:
    """Where a test's stores and Sessions live: a SQLite file or a PostgreSQL schema,
    through the sync store or the async one (``kind``)."""

    kind: str
    path: Path
    dsn: str = ""
    schema: str = ""

    def store(self) -> Any:
        if self.kind == "sqlite-sync":
            return SQLiteEventStore(self.path)
        if self.kind == "sqlite-async":
            return AsyncSQLiteEventStore(self.path)
        if self.kind == "pg-sync":
            return PostgresEventStore(self.dsn, schema=self.schema)
        return AsyncPostgresEventStore(self.dsn, schema=self.schema)

    def session(self, session_id: str = SESSION) -> Any:
        """A Session that shares the place's stores' transaction."""
        if self.kind.startswith("sqlite"):
            return SQLiteSession(session_id, self.path)
        if self.kind == "pg-sync":
            return PostgresSession(self.dsn, session_id, schema=self.schema)
        return AsyncPostgresSession(self.dsn, session_id, schema=self.schema)

    async def items(self, session_id: str = SESSION) -> list[Any]:
        """What the Session holds, read on a connection of its own."""
        session = self.session(session_id)
        try:
            return list(await session.get_items())
        finally:
            await _closed(session)

    async def version(self, run_id: str) -> int:
        store = self.store()
        try:
            return int(await _maybe(store.version(run_id)))
        finally:
            await _closed(store)

    async def write(self, item: Any, session_id: str = SESSION) -> None:
        """Another writer appends ``item`` to the Session, on a connection of its own."""
        session = self.session(session_id)
        try:
            await session.add_items([item])
        finally:
            await _closed(session)


async def _maybe(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


async def _closed(opened: Any) -> None:
    await _maybe(opened.close())


@contextlib.contextmanager
def _places(kind: str, request: pytest.FixtureRequest) -> Any:
    """A fresh place of ``kind`` (a PostgreSQL one in a schema of its own, dropped after:
    the property test needs one per example)."""
    with tempfile.TemporaryDirectory() as folder:
        if not kind.startswith("pg"):
            yield Place(kind, Path(folder) / "events.db")
            return
        dsn = request.getfixturevalue("pg_dsn")
        schema = pg_cluster.unique_schema()
        try:
            yield Place(kind, Path(folder) / "events.db", dsn, schema)
        finally:
            pg_cluster.drop_schema(dsn, schema)


@pytest.fixture(params=KINDS)
def place(request: pytest.FixtureRequest) -> Any:
    with _places(request.param, request) as made:
        yield made


async def _ready(place: Place) -> None:
    """The place's tables made (a PostgreSQL schema is made by its first store)."""
    await place.version("-")


def _lands(held: list[Any], after: list[Any], whole: bool) -> bool:
    """The model: a write staged after ``after`` lands on a Session holding ``held``
    when the Session ends with exactly those items (is exactly them, ``whole``)."""
    if whole:
        return held == after
    return len(after) <= len(held) and held[len(held) - len(after):] == after


async def _append(place: Place, run_id: str, write: Any) -> BaseException | None:
    """A new run's first event appended with ``write``; its refusal, or None."""
    events = list(RunController.start(run_id=run_id, session_id=SESSION).events)
    store = place.store()
    try:
        await _maybe(store.append(run_id, events, 0, session_write=write))
    except ReconcileRejected as refused:
        return refused
    finally:
        await _closed(store)
    return None


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_a_write_lands_only_on_the_tail_it_was_staged_against(
        kind: str, request: pytest.FixtureRequest, data: st.DataObject) -> None:
    held = data.draw(st.lists(st.sampled_from(ITEMS), max_size=5), label="held")
    if data.draw(st.booleans(), label="a suffix of the Session"):
        after = held[data.draw(st.integers(0, len(held)), label="from"):]
    else:
        after = data.draw(st.lists(st.sampled_from(ITEMS), max_size=4), label="after")
    whole = data.draw(st.booleans(), label="whole")

    async def go(place: Place) -> None:
        await _ready(place)
        for item in held:
            await place.write(item)
        write = SessionWrite(SESSION, "r:0", (NEW,), after=tuple(after), whole=whole)
        refused = await _append(place, "r", write)
        if _lands(held, after, whole):
            assert refused is None
            assert await place.items() == [*held, NEW]
            assert await place.version("r") == 1
        else:
            assert isinstance(refused, ReconcileRejected)
            assert "another writer" in str(refused)
            assert refused.run_id == "r"
            assert await place.items() == held  # nothing of it: no item, no event
            assert await place.version("r") == 0

    with _places(kind, request) as place:
        asyncio.run(go(place))


def test_each_write_of_an_append_is_checked_after_the_ones_before_it(place: Place) -> None:
    """Two writes riding in one append: the second was staged after the first's items
    (which land before it in the same transaction); a second staged after the Session
    as it was before the first is refused, and the first's items with it."""
    async def go() -> None:
        await _ready(place)
        await place.write(ITEMS[0])
        first = SessionWrite(SESSION, "r:0", (ITEMS[1],), after=(ITEMS[0],), whole=True)
        stale = SessionWrite(SESSION, "r:0", (NEW,), after=(ITEMS[0],), whole=True)
        assert isinstance(await _append(place, "r", (first, stale)), ReconcileRejected)
        assert await place.items() == [ITEMS[0]]
        assert await place.version("r") == 0
        second = SessionWrite(SESSION, "r:0", (NEW,), after=(ITEMS[0], ITEMS[1]),
                              whole=True)
        assert await _append(place, "r", (first, second)) is None
        assert await place.items() == [ITEMS[0], ITEMS[1], NEW]
        assert await place.version("r") == 1
        # a write without a tail is not checked (a reconcile's, or a caller's own)
        assert await _append(place, "r2", SessionWrite(SESSION, "r2:0", (NEW,))) is None
        assert await place.items() == [ITEMS[0], ITEMS[1], NEW, NEW]

    asyncio.run(go())


@contextlib.asynccontextmanager
async def _hold(store: Any) -> AsyncIterator[None]:
    """The async store kept busy in the body: the appends made there are one group."""
    if isinstance(store, AsyncSQLiteEventStore):
        gate = threading.Event()
        held = asyncio.ensure_future(store._call(gate.wait))
        await asyncio.sleep(0.01)
        try:
            yield
            await asyncio.sleep(0.05)
        finally:
            gate.set()
            await held
        return
    await store.version("-")  # (its connection open)
    async with store._lock:  # (an async PostgreSQL store's group waits for its lock)
        yield
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("kind", ["sqlite-async", "pg-async"])
def test_a_moved_session_fails_only_its_own_append_in_a_group(
        kind: str, request: pytest.FixtureRequest) -> None:
    """Group commit: four runs' appends in one transaction, one of them staged against a
    Session another writer moved: it alone is refused, the others land with their
    items, in one commit."""
    async def go(place: Place) -> None:
        await _ready(place)
        await place.write(ITEMS[2], "s2")  # (run 2 staged against an empty Session)
        store = place.store()
        await store.version("-")
        before = store.commits
        async with _hold(store):
            appends = []
            for i in range(4):
                events = list(RunController.start(run_id=f"r{i}", session_id=f"s{i}").events)
                write = SessionWrite(f"s{i}", f"r{i}:0", ({"n": i},), after=(), whole=True)
                appends.append(asyncio.ensure_future(
                    store.append(f"r{i}", events, 0, session_write=write)))
        outcomes = list(await asyncio.gather(*appends, return_exceptions=True))
        assert store.commits == before + 1
        await store.close()
        assert [type(outcome) for outcome in outcomes] == [
            type(None), type(None), ReconcileRejected, type(None)]
        assert [await place.version(f"r{i}") for i in range(4)] == [1, 1, 0, 1]
        assert [await place.items(f"s{i}") for i in range(4)] == [
            [{"n": 0}], [{"n": 1}], [ITEMS[2]], [{"n": 3}]]

    with _places(kind, request) as place:
        asyncio.run(go(place))


def test_a_session_write_names_its_tail_as_a_tuple(tmp_path: Path) -> None:
    """`publication_committed` refuses a tail that is not a tuple, or a ``whole`` that is
    not a bool, before anything is recorded."""
    from tests.helpers import SESSION as RUNS_SESSION
    from tests.helpers import assert_refused

    store = SQLiteEventStore(tmp_path / "events.db")
    c = RunController.start(run_id="r", session_id=RUNS_SESSION, store=store)
    c.add_input([NEW])
    c.stage_publication([NEW], [], whole=True)
    publication = c.publication_id
    assert publication is not None
    for after, whole in (([NEW], False), ((NEW,), 1)):
        write = SessionWrite(RUNS_SESSION, publication, (NEW,), after=after,  # type: ignore[arg-type]
                             whole=whole)  # type: ignore[arg-type]
        assert_refused(c, SchemaError, c.publication_committed, session_write=write)
    c.publication_committed(session_write=SessionWrite(RUNS_SESSION, publication, (NEW,),
                                                       after=(), whole=True))
    assert c.step is Step.RUN_AGAIN
    store.close()


def test_a_refused_riding_write_stops_a_buffered_controller(place: Place) -> None:
    """A buffered controller whose flush is refused because its riding write's Session
    moved keeps nothing of the refused batch as if it landed: every later command is
    refused (`ReconcileRejected`, load the run again), and the store holds none of it."""
    async def go() -> None:
        await _ready(place)
        store = place.store()
        c = RunController.start(run_id="r", session_id=SESSION, store=store, buffered=True)
        c.add_input([NEW])
        c.stage_publication([NEW], [], whole=True)
        publication = c.publication_id
        assert publication is not None
        c.publication_committed(session_write=SessionWrite(SESSION, publication, (NEW,),
                                                           after=(), whole=True), ride=True)
        await place.write(RIVAL)
        with pytest.raises(ReconcileRejected, match="another writer"):
            await c.flush_async()
        with pytest.raises(ReconcileRejected, match="load the run again"):
            c.begin_model_call()
        with pytest.raises(ReconcileRejected):
            await c.flush_async()
        await _closed(store)
        assert await place.version("r") == 0
        assert await place.items() == [RIVAL]

    asyncio.run(go())


# ------------------------------------------------------------ the reference runner


class WritingModel(ScriptedModel):
    """A scripted model during whose ``during``-th call (0-based) ``write`` is awaited."""

    def __init__(self, responses: list[ModelResponse],
                 write: Callable[[], Awaitable[None]] | None = None, during: int = 0) -> None:
        super().__init__(responses)
        self.write = write
        self.during = during
        self.seen: list[list[Any]] = []

    async def respond(self, items: list[Any], agent: Any) -> ModelResponse:
        if self.write is not None and len(self.seen) == self.during:
            await self.write()
        self.seen.append(list(items))
        return await super().respond(items, agent)


def _paying(ran: list[int], model: Any,
            on_run: Callable[[], Awaitable[None]] | None = None) -> Agent:
    async def pay(amount: int) -> str:
        ran.append(amount)
        if on_run is not None:
            await on_run()
        return f"paid {amount}"

    return Agent("payer", model, (FunctionTool("pay", pay),))


def _responses() -> list[ModelResponse]:
    return [ModelResponse((("p1", "pay", {"amount": 7}),)), ModelResponse(output="paid 7")]


USER = {"role": "user", "content": "pay 7"}
CALL = {"type": "function_call", "call_id": "p1", "name": "pay", "arguments": {"amount": 7}}
OUTPUT = {"type": "function_call_output", "call_id": "p1", "output": "paid 7"}
ANSWER = {"role": "assistant", "content": "paid 7"}
RIVAL = {"role": "user", "content": "from elsewhere"}


async def _run(place: Place, agent: Agent, input: str | None = None, **options: Any) -> Any:
    """One attempt of run ``r`` on a store and a Session of the place's, closed after."""
    store, session = place.store(), place.session()
    try:
        return await Runner.run(agent, input, session=session, store=store, run_id="r",
                                **options)
    finally:
        await _closed(store)
        await _closed(session)


def test_a_rival_write_during_the_first_model_call_stops_the_run_before_its_tool(
        place: Place) -> None:
    """The runner kept the Session it read at the start; another writer appends while the
    model answers. The flush before the tool body (carrying the input's publication) is
    refused: the tool never runs, nothing of the run is written, the other writer's item
    stays. Run again, the run reads the Session afresh and pays once."""
    async def go() -> None:
        await _ready(place)
        ran: list[int] = []
        model = WritingModel(_responses(), lambda: place.write(RIVAL))
        with pytest.raises(ReconcileRejected, match="another writer"):
            await _run(place, _paying(ran, model), "pay 7")
        assert ran == []
        assert await place.items() == [RIVAL]
        assert await place.version("r") == 0
        again = WritingModel(_responses())
        done = await _run(place, _paying(ran, again), "pay 7")
        assert done.step is Step.COMPLETED
        assert ran == [7]
        assert again.seen[0] == [RIVAL, USER]  # the model was sent the Session as it is
        assert await place.items() == [RIVAL, USER, CALL, OUTPUT, ANSWER]

    asyncio.run(go())


def test_a_rival_write_during_the_last_model_call_keeps_the_tool_run_once(
        place: Place) -> None:
    """Another writer appends while the model writes its answer, after the tool's result
    was published: the answer's write is refused, the tool's result is durable. Loaded
    again, the run asks the model again (sent the other writer's item) and never re-runs
    the tool."""
    async def go() -> None:
        await _ready(place)
        ran: list[int] = []
        model = WritingModel(_responses(), lambda: place.write(RIVAL), during=1)
        with pytest.raises(ReconcileRejected, match="another writer"):
            await _run(place, _paying(ran, model), "pay 7")
        assert ran == [7]
        assert await place.items() == [USER, CALL, OUTPUT, RIVAL]
        again = WritingModel([ModelResponse(output="paid 7")])
        done = await _run(place, _paying(ran, again))
        assert done.step is Step.COMPLETED
        assert ran == [7]
        assert again.seen == [[USER, CALL, OUTPUT, RIVAL]]
        assert await place.items() == [USER, CALL, OUTPUT, RIVAL, ANSWER]

    asyncio.run(go())


class NoteHooks(RunHooks):
    """Hooks that write a note to the run's Session when the model is first called."""

    def __init__(self, write: Callable[[], Awaitable[None]]) -> None:
        self.write = write

    async def on_llm_start(self, agent: Any) -> None:
        await self.write()


EXPECTED: dict[str, tuple[list[list[Any]], list[Any]]] = {
    "tool": ([[USER], [USER, "note", CALL, OUTPUT]], [USER, "note", CALL, OUTPUT, ANSWER]),
    "hook": ([[USER, "note"], [USER, "note", CALL, OUTPUT]],
             [USER, "note", CALL, OUTPUT, ANSWER]),
    "guardrail": ([[USER], [USER, CALL, OUTPUT]], [USER, CALL, OUTPUT, "note", ANSWER]),
    "consumer": ([[USER], [USER, CALL, OUTPUT]], [USER, CALL, OUTPUT, "note", ANSWER])}
"""Per writer: what the model was sent at each call, and the Session at the end."""


@pytest.mark.parametrize("writer", list(EXPECTED))
def test_code_of_the_users_that_writes_to_the_session_is_read_after(
        place: Place, writer: str) -> None:
    """A tool (in its body), a hook (before the first model call), an output guardrail or
    a streamed run's consumer (at the final answer's response) that writes a note to the
    run's Session, on a connection of its own, is code of the user's that the runner
    reads the Session after: the run completes, the tool ran once, the model was sent
    the note where the Session held it, and the run's later items land after it."""
    note = {"role": "user", "content": f"a note from the {writer}"}
    wrote: list[int] = []

    async def write() -> None:
        if not wrote:
            wrote.append(1)
            await place.write(note)

    async def go() -> None:
        await _ready(place)
        ran: list[int] = []
        model = WritingModel(_responses())
        agent = _paying(ran, model, on_run=write if writer == "tool" else None)
        if writer == "guardrail":
            async def check(output: Any) -> Verdict:
                await write()
                return ALLOW

            agent = attrs.evolve(agent, output_guardrails=(OutputGuardrail("noted", check),))
        if writer == "consumer":
            store, session = place.store(), place.session()
            run = Runner.run_streamed(agent, "pay 7", session=session, store=store,
                                      run_id="r")
            async for event in run.stream_events():
                if event.kind == "model_response" and event.data["output"]:
                    await write()  # (the answer's publication is staged after this)
            done = run.result
            await _closed(store)
            await _closed(session)
        else:
            hooks = NoteHooks(write) if writer == "hook" else None
            done = await _run(place, agent, "pay 7", hooks=hooks)
        assert done.step is Step.COMPLETED
        assert ran == [7]
        assert wrote == [1]
        seen, held = EXPECTED[writer]
        assert model.seen == [[note if item == "note" else item for item in sent]
                              for sent in seen]
        assert await place.items() == [note if item == "note" else item for item in held]

    asyncio.run(go())


def test_the_runner_reads_the_session_twice_a_turn_where_it_keeps_it(place: Place) -> None:
    """Where the runner may keep the Session (its store checks a write's tail), a
    one-tool turn reads it whole twice: at the start, and after the tool (code of the
    user's); not before each publication and model call (six reads before)."""
    async def go() -> None:
        await _ready(place)
        reads: list[int | None] = []
        store, session = place.store(), place.session()
        # (the runner reads through the store where it can, else through the Session)
        through_store = getattr(store, "session_items", None)
        if through_store is not None:
            def session_items(session_id: str, limit: int | None = None) -> Any:
                reads.append(limit)
                return through_store(session_id, limit)

            store.session_items = session_items
        through_session = session.get_items

        def get_items(limit: int | None = None) -> Any:
            reads.append(limit)
            return through_session(limit)

        session.get_items = get_items
        ran: list[int] = []
        model = WritingModel(_responses())
        done = await Runner.run(_paying(ran, model), "pay 7", session=session, store=store,
                                run_id="r")
        await _closed(store)
        await _closed(session)
        assert done.step is Step.COMPLETED
        assert ran == [7]
        assert reads == [None, None]
        assert model.seen == [[USER], [USER, CALL, OUTPUT]]
        assert await place.items() == [USER, CALL, OUTPUT, ANSWER]

    asyncio.run(go())


class Scribbler(ScriptedModel):
    """A model that changes the items it is sent (each dict, and the list)."""

    async def respond(self, items: list[Any], agent: Any) -> ModelResponse:
        for item in items:
            item["scribbled"] = True
        items.clear()
        return await super().respond(items, agent)


def test_a_model_that_changes_what_it_is_sent_changes_nothing_the_run_writes(
        place: Place) -> None:
    """The model is sent a copy of the Session the runner keeps: a model that changes
    it (its items, the list) leaves what the run stages against, and writes, as it was."""
    async def go() -> None:
        await _ready(place)
        ran: list[int] = []
        done = await _run(place, _paying(ran, Scribbler(_responses())), "pay 7")
        assert done.step is Step.COMPLETED
        assert ran == [7]
        assert await place.items() == [USER, CALL, OUTPUT, ANSWER]

    asyncio.run(go())


def test_a_tail_deeper_than_the_runs_limit_is_carried_as_it_is(tmp_path: Path) -> None:
    """The staged tail is the Session's, not the run's input: an item another writer left
    there, nested deeper than this run's ``max_depth``, is carried and checked, not
    refused."""
    path = tmp_path / "events.db"
    deep: Any = "leaf"
    for _ in range(6):
        deep = {"in": deep}
    asyncio.run(Place("sqlite-sync", path).write(deep))
    store = SQLiteEventStore(path)
    c = RunController.start(run_id="r", session_id=SESSION, store=store, max_depth=4)
    c.add_input([NEW])
    c.stage_publication([NEW], [deep], whole=True)
    publication = c.publication_id
    assert publication is not None
    c.publication_committed(session_write=SessionWrite(SESSION, publication, (NEW,),
                                                       after=(deep,), whole=True))
    assert c.step is Step.RUN_AGAIN
    store.close()
    assert asyncio.run(Place("sqlite-sync", path).items()) == [deep, NEW]


def test_a_session_of_the_users_is_sent_to_the_model_as_it_holds_it(tmp_path: Path) -> None:
    """A Session the runner does not keep (one of the user's) is read before each model
    call and sent as it is: its items need not be plain JSON (a tuple here)."""
    class Loose:
        """A Session of the user's that keeps what it is given as it is."""

        session_id = SESSION

        def __init__(self) -> None:
            self.items: list[Any] = []

        async def get_items(self, limit: int | None = None) -> list[Any]:
            return list(self.items if limit is None else self.items[-limit:] if limit else [])

        async def add_items(self, items: list[Any]) -> None:
            self.items.extend(items)

        async def pop_item(self) -> Any:
            return self.items.pop() if self.items else None

        async def clear_session(self) -> None:
            self.items.clear()

    session = Loose()
    old = {"role": "user", "content": ("a", "tuple")}
    session.items.append(old)
    ran: list[int] = []
    model = WritingModel(_responses())
    done = asyncio.run(Runner.run(_paying(ran, model), "pay 7", session=session,
                                  store=SQLiteEventStore(tmp_path / "events.db"),
                                  run_id="r"))
    assert done.step is Step.COMPLETED
    assert ran == [7]
    assert model.seen == [[old, USER], [old, USER, CALL, OUTPUT]]


@pytest.mark.parametrize("grouped", [False, True], ids=["alone", "in-a-group"])
def test_a_write_under_way_on_postgresql_is_waited_for_and_seen(
        request: pytest.FixtureRequest, grouped: bool) -> None:
    """PostgreSQL, read committed: another writer's Session write whose transaction has
    inserted its row but not committed yet is invisible to a plain read, and its row's id
    is already below the one the append would take. Every write of this library's to a
    Session holds the Session's lock until it commits, so the append's check waits for
    it, then sees the row and refuses; before, the append landed and the Session read
    [the other writer's item, the append's]. In a group (with another run's append on
    another Session, which lands), the group takes the lock before its first append."""
    class Paused(AsyncPostgresSession):
        """A Session whose write stops just before its COMMIT until told to go on."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.waiting = asyncio.Event()
            self.go_on = asyncio.Event()

        async def _before_commit(self) -> None:
            self.waiting.set()
            await self.go_on.wait()

    async def go(place: Place) -> None:
        await _ready(place)
        rival = Paused(place.dsn, SESSION, schema=place.schema)
        writing = asyncio.ensure_future(rival.add_items([RIVAL]))
        await asyncio.wait_for(rival.waiting.wait(), 10)
        store = place.store()
        await store.version("-")  # (its connection open)
        runs = [("r", SESSION), ("r2", "s-other")] if grouped else [("r", SESSION)]
        await store._lock.acquire()  # (the appends below queued as one group)
        appending = []
        for run_id, session_id in runs:
            events = list(RunController.start(run_id=run_id, session_id=session_id).events)
            write = SessionWrite(session_id, f"{run_id}:0", (NEW,), after=(), whole=True)
            appending.append(asyncio.ensure_future(
                store.append(run_id, events, 0, session_write=write)))
        await asyncio.sleep(0.05)
        store._lock.release()
        await asyncio.sleep(0.3)
        assert not any(append.done() for append in appending)  # waiting for the lock
        rival.go_on.set()
        await writing
        outcomes = await asyncio.gather(*appending, return_exceptions=True)
        assert isinstance(outcomes[0], ReconcileRejected)
        assert "another writer" in str(outcomes[0])
        assert outcomes[1:] == [None] * (len(runs) - 1)
        await store.close()
        await rival.close()
        assert await place.items() == [RIVAL]
        assert await place.version("r") == 0
        if grouped:
            assert await place.items("s-other") == [NEW]

    with _places("pg-async", request) as place:
        asyncio.run(go(place))


def test_an_append_takes_its_sessions_locks_before_its_runs_row() -> None:
    """PostgreSQL: every transaction takes the Sessions' locks it needs first, sorted,
    then the runs' rows (in run id order, in a group), so two stores' groups, or a group
    and a lone append, never wait on each other in a cycle."""
    from statemachine.postgres.steps import (
        Batch,
        Query,
        Sql,
        append_steps,
        lock_steps,
        locked_sessions,
        prepare,
    )

    sql = Sql("s")
    appends = []
    for run_id, session_id in (("a1", "s-b"), ("a2", "s-a")):
        events = list(RunController.start(run_id=run_id, session_id=session_id).events)
        write = SessionWrite(session_id, f"{run_id}:0", (NEW,), after=(), whole=True)
        appends.append(prepare(run_id, events, 0, None, None, write))
    assert locked_sessions(appends) == ["s-a", "s-b"]
    batch = append_steps(sql, appends[0]).send(None)
    assert isinstance(batch, Batch)  # one round trip
    first, second, *rest = batch.queries
    assert (first.sql, first.params) == (sql.lock_sessions, (["s-b"],))
    assert "pg_advisory_xact_lock" not in second.sql  # then the run's own statement
    assert "session_items" not in second.sql
    assert [query.sql for query in rest] == [sql.add_items_checked]  # then its write
    # a group's: one statement, in the sorted order, taken before its first append
    locks = lock_steps(sql, locked_sessions(appends)).send(None)
    assert isinstance(locks, Query)
    assert (locks.sql, locks.params) == (sql.lock_sessions, (["s-a", "s-b"],))
    grouped = append_steps(sql, appends[0], locked=True).send(None)
    assert isinstance(grouped, Batch)
    assert "pg_advisory_xact_lock" not in grouped.queries[0].sql


def test_two_stores_groups_over_the_same_sessions_both_land(
        request: pytest.FixtureRequest) -> None:
    """Two async PostgreSQL stores each write a group whose runs' Sessions come in the
    other's order; released together, again and again, every append lands (none is
    refused by a deadlock)."""
    async def go(place: Place) -> None:
        await _ready(place)
        stores = [place.store(), place.store()]
        for round_ in range(10):
            appends = []
            for store in stores:
                await store.version("-")  # (its connection open)
            # both stores' groups queued while each store's lock is held, then let go of
            # together
            await stores[0]._lock.acquire()
            await stores[1]._lock.acquire()
            for s, store in enumerate(stores):
                pairs = [("x", "s-b"), ("y", "s-a")] if s == 0 else [("x", "s-a"), ("y", "s-b")]
                for name, session_id in pairs:
                    run_id = f"{round_}-{s}-{name}"
                    events = list(RunController.start(run_id=run_id,
                                                      session_id=session_id).events)
                    # (an empty tail, not whole: checked, and always there)
                    write = SessionWrite(session_id, f"{run_id}:0", ({"n": run_id},),
                                         after=())
                    appends.append(asyncio.ensure_future(
                        store.append(run_id, events, 0, session_write=write)))
            await asyncio.sleep(0.05)
            stores[0]._lock.release()
            stores[1]._lock.release()
            outcomes = await asyncio.gather(*appends, return_exceptions=True)
            assert outcomes == [None] * 4
        for store in stores:
            await store.close()
        assert len(await place.items("s-a")) == len(await place.items("s-b")) == 20

    with _places("pg-async", request) as place:
        asyncio.run(go(place))


def _lone_store(place: Place, lock_timeout: float | None) -> Any:
    """A PostgreSQL store of ``place``'s kind whose appends are each a transaction of
    their own (the async one without group commit)."""
    if place.kind == "pg-sync":
        return PostgresEventStore(place.dsn, schema=place.schema, lock_timeout=lock_timeout)
    return AsyncPostgresEventStore(place.dsn, schema=place.schema, lock_timeout=lock_timeout,
                                   group_commit=False)


async def _started(store: Any, run_id: str, session_id: str
                   ) -> tuple[RunController, list[Any], list[Any]]:
    """A run whose first event is in ``store``, and its next (a model call begun, not
    appended): the controller, the events appended, the events to append next."""
    c = RunController.start(run_id=run_id, session_id=session_id)
    first = list(c.events)
    await _maybe(store.append(run_id, first, 0))
    c.begin_model_call()
    return c, first, list(c.events)[len(first):]


@pytest.mark.parametrize(("kind", "how"), [("pg-sync", "refused"), ("pg-async", "refused"),
                                         ("pg-async", "cancelled")])
def test_an_append_stopped_in_the_middle_of_its_batch_leaves_nothing(
        request: pytest.FixtureRequest, kind: str, how: str) -> None:
    """PostgreSQL sends an append's statements in one pipeline (the Session's lock, the
    run's statement, the checked Session write). Another session holds the run's head
    row, so the run's statement waits: past the store's ``lock_timeout`` the server
    refuses it (``refused``: the statements after it are not run), or the caller cancels
    the append while it waits (``cancelled``: the async store without group commit; a
    group's append, once taken, lands or fails with its group). Either way nothing of
    the append is written and the Session's lock is let go (another writer's item goes
    in), and the same store then makes the same append, staged after that item: it
    lands once, its item once."""
    async def go(place: Place) -> None:
        await _ready(place)
        store = _lone_store(place, 0.3 if how == "refused" else None)
        _, first, later = await _started(store, "r", SESSION)
        write = SessionWrite(SESSION, f"r:{len(first)}", (NEW,), after=(), whole=True)
        with psycopg.connect(place.dsn, autocommit=True) as rival:
            rival.execute("BEGIN")
            rival.execute(f'SELECT 1 FROM "{place.schema}".runs WHERE run_id = %s FOR UPDATE',
                          ("r",))
            if how == "refused":
                with pytest.raises(StorageError) as refused:
                    await _maybe(store.append("r", later, len(first), session_write=write))
                assert refused.value.outcome == "not_written"
            else:
                appending = asyncio.ensure_future(
                    store.append("r", later, len(first), session_write=write))
                await asyncio.sleep(0.3)
                assert not appending.done()  # waiting for the head row
                appending.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await appending
            assert await place.items() == []
            await asyncio.wait_for(place.write(RIVAL), 10)  # the lock is not held
            assert await place.version("r") == len(first)
            rival.execute("ROLLBACK")
        write = SessionWrite(SESSION, f"r:{len(first)}", (NEW,), after=(RIVAL,), whole=True)
        await _maybe(store.append("r", later, len(first), session_write=write))
        assert await place.items() == [RIVAL, NEW]
        assert await place.version("r") == len(first) + len(later)
        await _closed(store)

    with _places(kind, request) as place:
        asyncio.run(go(place))


@pytest.mark.parametrize("kind", ["pg-sync", "pg-async"])
def test_a_statement_behind_a_refused_one_in_a_batch_stays_usable(
        request: pytest.FixtureRequest, kind: str) -> None:
    """psycopg prepares a statement once it has run it a few times; in a pipeline it
    counts the statement as prepared as soon as it sends the PREPARE, and when a
    statement before it in the pipeline fails the server skips that PREPARE. So a
    Session write behind a run's statement refused by ``lock_timeout`` could leave the
    write's statement "prepared" on the client and missing on the server, and every
    later append with a Session write on that connection failed. Here the append at
    position ``k`` is refused (another session holds the run's head row), for every
    ``k`` around psycopg's threshold, each on a connection of its own (the Session's
    lock held instead, at even positions: the batch's first statement fails): every
    other append lands, and so does an append of events alone after it (one statement,
    the run's statement of the batch), and the Session holds exactly their items."""
    from statemachine.postgres.steps import Sql

    async def go(place: Place) -> None:
        await _ready(place)
        for k in range(3, 9):
            store = _lone_store(place, 0.2)
            landed: list[Any] = []
            for n in range(10):
                run_id, session_id = f"{k}-{n}", f"s-{k}"
                c, first, later = await _started(store, run_id, session_id)
                item = {"n": n}
                write = SessionWrite(session_id, f"{run_id}:{len(first)}", (item,),
                                     after=tuple(landed[-1:]), whole=not landed)
                if n in (1, k):  # (1: the first ROLLBACK, which psycopg clears its cache on)
                    with psycopg.connect(place.dsn, autocommit=True) as rival:
                        rival.execute("BEGIN")
                        if n % 2:  # the run's head row: its statement fails
                            rival.execute(f'SELECT 1 FROM "{place.schema}".runs '
                                          "WHERE run_id = %s FOR UPDATE", (run_id,))
                        else:  # the Session's lock: the first statement fails
                            rival.execute(Sql(place.schema).lock_session, (session_id,))
                        with pytest.raises(StorageError):
                            await _maybe(store.append(run_id, later, len(first),
                                                      session_write=write))
                        rival.execute("ROLLBACK")
                    continue
                await _maybe(store.append(run_id, later, len(first), session_write=write))
                landed.append(item)
                c.model_responded(output="done")  # and an append of events alone (one statement)
                more = list(c.events)[len(first) + len(later):]
                await _maybe(store.append(run_id, more, len(first) + len(later)))
                assert await place.version(run_id) == len(c.events)
            assert await place.items(f"s-{k}") == landed
            assert len(landed) == 8
            await _closed(store)

    with _places(kind, request) as place:
        asyncio.run(go(place))


@pytest.mark.parametrize("kind", ["pg-sync", "pg-async"])
def test_a_stale_append_with_a_snapshot_is_refused_without_waiting(
        request: pytest.FixtureRequest, kind: str) -> None:
    """An append made from a version the run has moved past, carrying a snapshot, while
    another transaction (an append of the run in flight) holds the run's snapshot row:
    it is refused with `ConcurrencyConflict` at once. Its snapshot is written only once
    its run's statement moved the head; written before, it waited for that row and
    ended in `StorageError` at the ``lock_timeout``."""
    async def go(place: Place) -> None:
        await _ready(place)
        store = _lone_store(place, 1.0)
        c, first, later = await _started(store, "r", SESSION)
        await _maybe(store.append("r", later, len(first)))  # the run is ahead
        with psycopg.connect(place.dsn, autocommit=True) as rival:
            rival.execute("BEGIN")
            rival.execute(f'INSERT INTO "{place.schema}".snapshots VALUES (%s, 9, %s, %s) '
                          "ON CONFLICT (run_id) DO UPDATE SET body = EXCLUDED.body",
                          ("r", "{}", "d"))
            with pytest.raises(ConcurrencyConflict):
                await _maybe(store.append("r", later, len(first),
                                          snapshot=c.state.snapshot()))
            rival.execute("ROLLBACK")
        assert await place.version("r") == len(first) + len(later)
        await _closed(store)

    with _places(kind, request) as place:
        asyncio.run(go(place))


@pytest.mark.parametrize("kind", ["pg-sync", "pg-async"])
def test_an_append_alone_after_a_refused_batch_uses_no_statement_it_skipped(
        request: pytest.FixtureRequest, kind: str) -> None:
    """The run's statement of a batch is also the whole of an append of events alone. A
    batch whose first statement (the Session's lock) is refused past ``lock_timeout``
    skips the rest, the PREPARE psycopg may have sent for the run's statement among them:
    the same append then made without its Session write (one statement, not pipelined)
    must land. One append is refused first, its Session having moved (psycopg forgets
    what it prepared on the first ROLLBACK it sees, and only then), ``k`` land, then one
    is refused by the lock, for every ``k`` around psycopg's threshold, each time on a
    connection of its own."""
    from statemachine.postgres.steps import Sql

    async def go(place: Place) -> None:
        await _ready(place)
        for k in range(3, 9):
            store = _lone_store(place, 0.2)
            for n in range(k + 2):
                run_id = session_id = f"{k}-{n}"
                c, first, later = await _started(store, run_id, session_id)
                write = SessionWrite(session_id, f"{run_id}:{len(first)}", (NEW,),
                                     after=(), whole=True)
                if 0 < n <= k:
                    await _maybe(store.append(run_id, later, len(first),
                                              session_write=write))
                    continue
                if n == 0:
                    moved = SessionWrite(session_id, f"{run_id}:{len(first)}", (NEW,),
                                         after=(RIVAL,), whole=True)
                    with pytest.raises(ReconcileRejected):
                        await _maybe(store.append(run_id, later, len(first),
                                                  session_write=moved))
                    continue
                with psycopg.connect(place.dsn, autocommit=True) as rival:
                    rival.execute("BEGIN")
                    rival.execute(Sql(place.schema).lock_session, (session_id,))
                    with pytest.raises(StorageError):
                        await _maybe(store.append(run_id, later, len(first),
                                                  session_write=write))
                    rival.execute("ROLLBACK")
                await _maybe(store.append(run_id, later, len(first)))
                assert await place.version(run_id) == len(c.events)
                assert await place.items(session_id) == []
            await _closed(store)

    with _places(kind, request) as place:
        asyncio.run(go(place))
