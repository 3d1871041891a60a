"""A publication's Session write rides with the run's next flush (DESIGN §7.7): with the
Session in the store's own database, a buffered run writes a publication's items with
its next append instead of at once, so a one-tool turn (input, model, tool, result,
answer) is three durable writes: the one before the tool body (the input rides with
it), the one before the model is asked again (a tool's result is never left to wait out
a model's answer: a crash there would leave the call in doubt), and the one at the
attempt's end. Until that flush the items are the run's `riding_items`: the model, the
next staging and the user's hooks see the Session with them, and a failed or lost flush
loses them together with their commits, never one without the other.

Every expectation here is written out from the turn itself (what the user typed, the
call, its output, the answer), not read from what the library recorded."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg
import pytest

from statemachine import RunController, SchemaError, Step
from statemachine import events as ev
from statemachine.errors import Outcome, RunNotFound, StorageError, ToolInDoubt
from statemachine.postgres import (
    AsyncPostgresEventStore,
    AsyncPostgresSession,
    PostgresEventStore,
    PostgresSession,
)
from statemachine.runner import Agent, ModelResponse, RunHooks, Runner
from statemachine.runner.publish import publish
from statemachine.sessions import SQLiteSession
from statemachine.stores import AsyncSQLiteEventStore, SessionWrite, SQLiteEventStore
from statemachine.testing import Counters, ScriptedModel, counted_tool

USER = {"role": "user", "content": "charge 7"}
CALL = {"type": "function_call", "call_id": "c1", "name": "charge", "arguments": {"x": 7}}
OUTPUT = {"type": "function_call_output", "call_id": "c1", "output": "charged 7"}
ANSWER = {"role": "assistant", "content": "charged"}
SEEN = [[USER], [USER, CALL, OUTPUT]]
"""What the model is sent at its two calls: the input, then the input, the call and its
output (the answer is the second call's response)."""
SESSION_AFTER = [USER, CALL, OUTPUT, ANSWER]


class SeeingModel(ScriptedModel):
    """A scripted model that keeps the history each call was sent."""

    def __init__(self, responses: Sequence[ModelResponse]) -> None:
        super().__init__(responses)
        self.seen: list[list[Any]] = []

    async def respond(self, history: list[Any], agent: Agent) -> ModelResponse:
        self.seen.append(list(history))
        return await super().respond(history, agent)


def _agent(counters: Counters, *, tools: bool = True) -> tuple[Agent, SeeingModel]:
    """The billing agent; ``tools=False``: its model answers at once."""
    charge = counted_tool(counters, "charge", lambda x: f"charged {x}")
    model = SeeingModel([ModelResponse((("c1", "charge", {"x": 7}),)),
                         ModelResponse(output="charged")] if tools
                        else [ModelResponse(output="charged")])
    return Agent("billing", model, (charge,)), model


class Appends:
    """What a store's appends carried: per append, the kind of its ``session_write``."""

    def __init__(self) -> None:
        self.writes: list[str] = []

    def note(self, session_write: Any) -> None:
        self.writes.append("none" if session_write is None else
                           f"tuple of {len(session_write)}" if isinstance(session_write, tuple)
                           else "one")


def _counting(base: type[Any], appends: Appends, *, many: bool = True) -> type[Any]:
    """``base`` whose appends are noted in ``appends`` (and, ``many=False``, a store that
    says it takes one Session write per append)."""
    if asyncio.iscoroutinefunction(base.append):
        async def append_async(self: Any, *args: Any, session_write: Any = None,
                               **options: Any) -> None:
            appends.note(session_write)
            if session_write is not None:
                options["session_write"] = session_write
            await base.append(self, *args, **options)
        body: dict[str, Any] = {"append": append_async}
    else:
        def append(self: Any, *args: Any, session_write: Any = None, **options: Any) -> None:
            appends.note(session_write)
            if session_write is not None:
                options["session_write"] = session_write
            base.append(self, *args, **options)
        body = {"append": append}
    body["many_session_writes"] = many
    return type(f"Counting{base.__name__}", (base,), body)


@pytest.fixture(params=["sqlite", "sqlite-async", "postgres", "postgres-async"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A store class, how to open it and its Session on the same database."""
    kind = request.param
    if kind.startswith("postgres"):
        request.applymarker(pytest.mark.postgres)
        dsn = request.getfixturevalue("pg_dsn")
        schema = request.getfixturevalue("pg_schema")

        def reader() -> PostgresEventStore:
            return PostgresEventStore(dsn, schema=schema, readonly=True)

        if kind == "postgres":
            yield {"store": PostgresEventStore, "args": (dsn,), "kw": {"schema": schema},
                   "session": lambda: PostgresSession(dsn, "s", schema=schema),
                   "dsn": dsn, "schema": schema, "reader": reader}
        else:
            yield {"store": AsyncPostgresEventStore, "args": (dsn,),
                   "kw": {"schema": schema},
                   "session": lambda: AsyncPostgresSession(dsn, "s", schema=schema),
                   "dsn": dsn, "schema": schema, "reader": reader}
        return
    path = tmp_path / "events.db"
    yield {"store": AsyncSQLiteEventStore if kind == "sqlite-async" else SQLiteEventStore,
           "args": (path,), "kw": {}, "session": lambda: SQLiteSession("s", path),
           "reader": lambda: SQLiteEventStore(path, readonly=True)}


async def _close(*things: Any) -> None:
    for thing in things:
        closed = thing.close()
        if asyncio.iscoroutine(closed):
            await closed


def _turn(backend: dict[str, Any], *, many: bool = True, hooks: RunHooks | None = None,
          tools: bool = True) -> dict[str, Any]:
    counters = Counters()
    agent, model = _agent(counters, tools=tools)
    appends = Appends()
    store = _counting(backend["store"], appends, many=many)(*backend["args"], **backend["kw"])

    async def go() -> dict[str, Any]:
        session = backend["session"]()
        assert session.shares_transaction_with(store)
        options: dict[str, Any] = {} if hooks is None else {"hooks": hooks}
        result = await Runner.run(agent, "charge 7", session=session, store=store,
                                  run_id="r", **options)
        items = await session.get_items()
        await _close(session, store)
        return {"result": result, "items": items}

    found = asyncio.run(go())
    found.update(counters=counters.tools, seen=model.seen, appends=appends.writes)
    return found


def test_a_one_tool_turn_is_three_writes_and_the_model_sees_what_rides(
        backend: dict[str, Any]) -> None:
    turn = _turn(backend)
    assert turn["result"].step is Step.COMPLETED
    assert turn["counters"] == {"charge": 1}
    assert turn["seen"] == SEEN  # the input, then its call and output, before they landed
    assert turn["items"] == SESSION_AFTER  # every item once, in order
    # the input rides with the tool's start, the result's publication with its own flush
    # before the model is asked again, the answer with the end
    assert turn["appends"] == ["one", "one", "one"]
    reader = backend["reader"]()
    try:
        log = reader.load("r")
    finally:
        reader.close()
    assert sum(type(e) is ev.PublicationCommitted for e in log) == 3
    if "dsn" in backend:  # each publication's items are tagged with its own id
        assert _publication_ids(backend) == _staged_ids(log)


def _publication_ids(backend: dict[str, Any]) -> list[str]:
    with psycopg.connect(backend["dsn"], autocommit=True) as conn:
        rows = conn.execute(f"SELECT publication_id FROM {backend['schema']}.session_items "
                            "ORDER BY id").fetchall()
    return [row[0] for row in rows]


def _staged_ids(log: list[ev.Event]) -> list[str]:
    """The publication id of each Session item the turn writes: the input (one item), the
    call and its output (two), the answer (one), each under its staging's seq."""
    staged = [e.seq for e in log if type(e) is ev.PublicationStaged]
    assert len(staged) == 3
    return [f"r:{staged[0]}", f"r:{staged[1]}", f"r:{staged[1]}", f"r:{staged[2]}"]


class ReadingHooks(RunHooks):
    """Hooks that read the run's Session each time the model is about to be called."""

    def __init__(self) -> None:
        self.session: Any = None
        self.read: list[list[Any]] = []

    async def on_llm_start(self, agent: Agent) -> None:
        self.read.append(list(await self.session.get_items()))


def test_a_hook_reads_the_session_as_the_run_sees_it(backend: dict[str, Any]) -> None:
    hooks = ReadingHooks()
    opened = backend["session"]
    backend = {**backend, "session": lambda: _kept(hooks, opened())}
    turn = _turn(backend, hooks=hooks)
    assert hooks.read == SEEN  # what rode was written before the user's code ran
    assert turn["items"] == SESSION_AFTER


def _kept(hooks: ReadingHooks, session: Any) -> Any:
    hooks.session = session
    return session


def test_a_store_that_takes_one_session_write_per_append_never_gets_two(
        backend: dict[str, Any]) -> None:
    turn = _turn(backend, many=False)
    assert "tuple" not in " ".join(turn["appends"])
    assert turn["appends"] == ["one", "one", "one"]  # the answer no longer rides with the result
    assert turn["seen"] == SEEN
    assert turn["items"] == SESSION_AFTER


@pytest.mark.parametrize("many", [True, False])
def test_a_turn_without_tools_writes_its_input_and_answer_as_the_store_takes_them(
        backend: dict[str, Any], many: bool) -> None:
    """The model answers at once: no tool's result made a flush before the model call, so
    the input's publication still rides when the answer's is staged. A store that takes
    many Session writes per append gets both in the attempt's one append; one that takes
    one per append is flushed before the second is staged: two appends, one write each."""
    turn = _turn(backend, many=many, tools=False)
    assert turn["result"].step is Step.COMPLETED
    assert turn["counters"] == {}
    assert turn["seen"] == [[USER]]
    assert turn["items"] == [USER, ANSWER]
    assert turn["appends"] == (["tuple of 2"] if many else ["one", "one"])


class Failing(SQLiteEventStore):
    """Refuses its appends that carry a Session write (``times`` of them), before
    writing anything."""

    times = 1_000

    def append(self, *args: Any, session_write: Any = None, **options: Any) -> None:
        if session_write is not None and self.times:
            self.times -= 1
            raise StorageError("the disk is full (injected)", outcome=Outcome.NOT_WRITTEN)
        if session_write is not None:
            options["session_write"] = session_write
        super().append(*args, **options)


def test_a_flush_not_written_writes_neither_the_items_nor_their_commit(
        tmp_path: Path) -> None:
    counters = Counters()
    agent, _ = _agent(counters)
    path = tmp_path / "events.db"
    store = Failing(path)
    session = SQLiteSession("s", path)
    with pytest.raises(StorageError):
        asyncio.run(Runner.run(agent, "charge 7", session=session, store=store, run_id="r"))
    assert counters.tools == {}  # the flush before the tool failed: the tool never ran
    assert asyncio.run(session.get_items()) == []  # neither the input nor its commit
    with pytest.raises(RunNotFound):
        RunController.load(SQLiteEventStore(path, readonly=True), "r")


def test_a_retried_flush_writes_what_rides_once(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    store = Failing(path)
    store.times = 1
    session = SQLiteSession("s", path)
    c = RunController.start(run_id="r", session_id="s", store=store, buffered=True)
    c.add_input([USER])
    asyncio.run(publish(c, session, [USER], ride=True))
    assert c.riding_items == (USER,)
    with pytest.raises(StorageError):
        c.flush()
    assert asyncio.run(session.get_items()) == []
    assert c.riding_items == (USER,)  # kept for the retry
    c.flush()
    assert c.riding_items == ()
    assert asyncio.run(session.get_items()) == [USER]
    log = SQLiteEventStore(path, readonly=True).load("r")
    assert [type(e) for e in log][-2:] == [ev.PublicationStaged, ev.PublicationCommitted]
    c.flush()  # nothing left: no second write of the items
    assert asyncio.run(session.get_items()) == [USER]


def test_what_rides_is_handed_out_as_copies(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    store = SQLiteEventStore(path)
    session = SQLiteSession("s", path)
    c = RunController.start(run_id="r", session_id="s", store=store, buffered=True)
    c.add_input([{"role": "user", "content": "hi"}])
    asyncio.run(publish(c, session, [{"role": "user", "content": "hi"}], ride=True))
    copy = c.riding_items[0]
    assert isinstance(copy, dict)
    copy["content"] = "changed"
    c.flush()
    assert asyncio.run(session.get_items()) == [{"role": "user", "content": "hi"}]


def test_per_event_a_ride_is_written_at_once(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    store = SQLiteEventStore(path)
    session = SQLiteSession("s", path)
    c = RunController.start(run_id="r", session_id="s", store=store)
    c.add_input([USER])
    asyncio.run(publish(c, session, [USER], ride=True))
    assert c.riding_items == ()
    assert asyncio.run(session.get_items()) == [USER]


def test_ride_must_be_a_bool(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    c = RunController.start(run_id="r", session_id="s", store=SQLiteEventStore(path),
                            buffered=True)
    c.add_input([USER])
    c.stage_publication([USER], [])
    write = SessionWrite("s", c.publication_id or "", (USER,))
    with pytest.raises(SchemaError, match="ride"):
        c.publication_committed(session_write=write, ride=1)  # type: ignore[arg-type]
    assert c.holds_attempt
    assert c.riding_items == ()


def test_a_crash_before_the_flush_leaves_the_call_in_doubt_never_run_again(
        tmp_path: Path) -> None:
    """The result rides past the tool: a process that dies after the tool and before the
    result's flush has the tool's start durable and its result lost, so the run is in
    doubt (fail closed), and the Session holds only the input."""
    counters = Counters()
    path = tmp_path / "events.db"

    class Dying(SQLiteEventStore):
        def append(self, *args: Any, **options: Any) -> None:
            if counters.tools:  # the tool ran: this process dies before its next write
                raise KeyboardInterrupt
            super().append(*args, **options)

    agent, _ = _agent(counters)
    with pytest.raises(KeyboardInterrupt):
        asyncio.run(Runner.run(agent, "charge 7", session=SQLiteSession("s", path),
                               store=Dying(path), run_id="r"))
    assert counters.tools == {"charge": 1}
    again, _ = _agent(counters)
    with pytest.raises(ToolInDoubt):
        asyncio.run(Runner.run(again, session=SQLiteSession("s", path),
                               store=SQLiteEventStore(path), run_id="r"))
    assert counters.tools == {"charge": 1}
    assert asyncio.run(SQLiteSession("s", path).get_items()) == [USER]


@pytest.mark.parametrize("many", [True, False])
def test_a_controller_hands_a_store_only_the_session_writes_it_takes(
        tmp_path: Path, many: bool) -> None:
    """Two publications committed with ``ride=True`` and no flush between (the controller
    used directly): a store that takes several Session writes per append gets both in
    one, any other gets the first written before the second is held."""
    path = tmp_path / "events.db"
    appends = Appends()
    store = _counting(SQLiteEventStore, appends, many=many)(path)
    session = SQLiteSession("s", path)
    c = RunController.start(run_id="r", session_id="s", store=store, buffered=True)
    first, second = {"role": "user", "content": "one"}, {"role": "user", "content": "two"}
    for item, tail in ((first, []), (second, [first])):
        c.add_input([item])
        c.stage_publication([item], tail)
        c.publication_committed(session_write=SessionWrite("s", c.publication_id or "",
                                                           (item,)), ride=True)
    c.flush()
    assert appends.writes == (["tuple of 2"] if many else ["one", "one"])
    assert asyncio.run(session.get_items()) == [first, second]


@pytest.mark.invariant("I1", "I12")
@pytest.mark.parametrize("kind", ["sqlite", "sqlite-async"])
def test_a_crash_while_the_model_answers_after_a_tool_leaves_the_call_completed(
        tmp_path: Path, kind: str) -> None:
    """The process dies while the model is asked again after the tool (the longest wait
    of a turn): the tool's result and its publication were made durable before that
    request, so the next attempt finds the call completed (never in doubt, no operator
    needed), its call and output written once, asks the model again and completes; the
    tool ran once. While the model is asked, a reader of the store (an operator's inbox)
    already sees the call completed, not in doubt."""
    counters = Counters()
    path = tmp_path / "events.db"
    store_class = AsyncSQLiteEventStore if kind == "sqlite-async" else SQLiteEventStore
    inbox: list[Any] = []

    class DiesAtTheSecondCall(SeeingModel):
        async def respond(self, history: list[Any], agent: Agent) -> ModelResponse:
            if len(self.seen) == 1:  # asked again, after the tool: the process dies
                reader = SQLiteEventStore(path, readonly=True)
                try:
                    inbox.append(RunController.load(reader, "r").in_doubt())
                finally:
                    reader.close()
                raise KeyboardInterrupt
            return await super().respond(history, agent)

    charge = counted_tool(counters, "charge", lambda x: f"charged {x}")
    dying = DiesAtTheSecondCall([ModelResponse((("c1", "charge", {"x": 7}),)),
                                 ModelResponse(output="charged")])

    async def attempt(agent: Agent) -> Any:
        store = store_class(path)
        try:
            return await Runner.run(agent, None if agent.model is not dying else "charge 7",
                                    session=SQLiteSession("s", path), store=store,
                                    run_id="r")
        finally:
            await _close(store)

    with pytest.raises(KeyboardInterrupt):
        asyncio.run(attempt(Agent("billing", dying, (charge,))))
    assert counters.tools == {"charge": 1}
    assert inbox == [()]  # no call in doubt while the model was asked
    assert asyncio.run(SQLiteSession("s", path).get_items()) == [USER, CALL, OUTPUT]
    again = SeeingModel([ModelResponse(output="charged")])
    result = asyncio.run(attempt(Agent("billing", again, (charge,))))
    assert result.step is Step.COMPLETED
    assert counters.tools == {"charge": 1}
    assert again.seen == [[USER, CALL, OUTPUT]]
    assert asyncio.run(SQLiteSession("s", path).get_items()) == SESSION_AFTER


def test_publish_reads_more_of_the_session_only_for_too_short_a_history() -> None:
    """`publish` reads twice as much of the Session while its tail cannot tell the write's
    outcomes apart; any other refusal (here a batch that leaves out the call whose result
    it carries) is raised after the first read, not after reading the whole Session."""
    from statemachine import InvalidTransition, ToolCall
    from statemachine.sessions import MemorySession

    class Counting(MemorySession):
        def __init__(self) -> None:
            super().__init__("s")
            self.limits: list[int | None] = []

        async def get_items(self, limit: int | None = None) -> list[Any]:
            self.limits.append(limit)
            return await super().get_items(limit)

    session = Counting()
    asyncio.run(session.add_items([{"role": "user", "content": f"m{i}"} for i in range(5000)]))
    c = RunController.start(run_id="r", session_id="s")
    c.begin_model_call()
    c.model_responded([ToolCall("c1", "charge", {"x": 7})])
    c.resume()
    c.begin_tool("c1")
    c.tool_completed("c1", "charged 7")
    with pytest.raises(InvalidTransition, match="batch_names_its_calls"):
        asyncio.run(publish(c, session, [OUTPUT]))  # (call_ids left out)
    assert session.limits == [2]
    # a tail repeating the batch is read further until it tells the outcomes apart
    session.limits.clear()
    asyncio.run(session.add_items([OUTPUT, OUTPUT]))
    asyncio.run(publish(c, session, [OUTPUT], call_ids=["c1"]))
    assert session.limits[:2] == [2, 4]
    assert c.step is not Step.UNSETTLED


@pytest.mark.parametrize("held", [0, 1, 2, 3, 10])
def test_a_publication_staged_against_a_kept_session_records_its_last_items(
        held: int) -> None:
    """`stage_known` (the Session an attempt keeps, nothing read) stages against the
    Session's last ``len(items) + 1`` items (DESIGN §2.3), the whole Session when it
    holds fewer: the envelope's frontier is those items' digests, and the write carries
    them as the tail the store checks."""
    from statemachine.runner.publish import stage_known

    known = [{"role": "user", "content": f"m{i}"} for i in range(held)]
    items = [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]
    c = RunController.start(run_id="r", session_id="s")
    tail, whole = stage_known(c, items, known)
    expected = known[-3:]  # len(items) + 1, or all of a Session shorter than that
    assert (list(tail), whole) == (expected, held < 3)
    staged = c.events[-1]
    assert isinstance(staged, ev.PublicationStaged)
    assert staged.frontier_whole is (held < 3)
    assert len(staged.frontier) == len(expected)
    other = RunController.start(run_id="r2", session_id="s")  # the same, staged directly
    other.stage_publication(items, expected, whole=held < 3)
    twin = other.events[-1]
    assert isinstance(twin, ev.PublicationStaged)
    assert (twin.frontier, twin.read_limit) == (staged.frontier, staged.read_limit)
