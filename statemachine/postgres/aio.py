"""The async PostgreSQL event store and Session, on psycopg's ``AsyncConnection``.

Written by hand, and the one copy: ``sync.py`` (`PostgresEventStore`, `PostgresSession`)
is generated from this file by ``tools/unasync.py``, which drops ``async`` and ``await``
and renames the async names; ``python tools/unasync.py --check`` fails when ``sync.py``
is stale. The SQL, the operations and the checks both run are in ``steps.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any, Self, TypeVar

import psycopg

from statemachine.errors import ConcurrencyConflict, Outcome, StorageError
from statemachine.events import Event
from statemachine.payloads import JSON
from statemachine.postgres.steps import (
    APPEND,
    BACKEND_ERRORS,
    LIST,
    LOAD,
    LOCK_TIMEOUT,
    PIPELINE,
    READ_SESSION,
    UNPREPARED,
    Backend,
    Base,
    Batch,
    Op,
    PreparedAppend,
    SessionMethods,
    answered,
    append_steps,
    backend_of,
    closed,
    ensure_schema,
    fence_steps,
    head_step,
    heads,
    heads_query,
    latest_log,
    loaded_log,
    lost_race,
    one,
    one_statement,
    prepare,
    prepared,
    probe_steps,
    refusal,
    session_items_steps,
)
from statemachine.stored import (
    Head,
    Loaded,
    RunHead,
    check_filters,
    head_after_snapshot,
    head_of_whole_log,
    kept_model,
    snapshot_ignored,
)
from statemachine.stores import SessionWrite, Snapshot
from statemachine.values import Step

if TYPE_CHECKING:
    from statemachine.blocker import ReadModel

T = TypeVar("T")

BEGIN = ("BEGIN",)
"""What `run_statements` runs first to open a transaction."""

# ------------------------------------------------------------------------- driver


# unasync: async only
from statemachine.postgres.steps import lock_steps, locked_sessions  # noqa: E402

GROUP_LIMIT = 64
"""The most appends `AsyncPostgresEventStore` writes in one group (one transaction): a
writing savepoint takes a subtransaction id, and a transaction holding more than 64 makes
every other session's snapshot look them up in pg_subtrans (its subtransaction cache
overflows)."""


def _in_transaction(conn: psycopg.AsyncConnection[Any]) -> bool:
    """The connection is up and inside its transaction (failed or not)."""
    status = conn.info.transaction_status
    return (not conn.closed and not conn.broken
            and status in (psycopg.pq.TransactionStatus.INTRANS,
                           psycopg.pq.TransactionStatus.INERROR))


def _again(error: StorageError, a: PreparedAppend) -> StorageError:
    """``error`` (the group's, or another append's of it) for the append ``a``."""
    return StorageError(error.reason, outcome=error.outcome, run_id=a.run_id)


# unasync: end
async def answer(cursor: psycopg.AsyncCursor[Any], want: str) -> Any:
    """What a `steps.Query` wants back from its cursor."""
    if want == "rowcount":
        return cursor.rowcount
    if want == "one":
        return await cursor.fetchone()
    if want == "all":
        return await cursor.fetchall()
    return None


async def run_statements(conn: psycopg.AsyncConnection[Any], op: Op[T], *,
                         begin: Sequence[str] = ()) -> T:
    """Run the statements ``op`` yields on ``conn``, sending each its answer (a `Batch`
    its answers, pipelined where libpq can), and return what ``op`` returns; ``begin``:
    statements to run first (``BEGIN``, which opens a transaction), pipelined with the
    first statement where libpq can."""
    if begin and not PIPELINE:
        for statement in begin:
            await conn.execute(statement)
        begin = ()
    reply: Any = None
    while True:
        try:
            step = op.send(reply)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        queries = step.queries if isinstance(step, Batch) else (step,)
        prepare = prepared(conn)
        if PIPELINE and (begin or len(queries) > 1):
            try:
                async with conn.pipeline():
                    for statement in begin:
                        await conn.execute(statement, prepare=prepare)
                    cursors = [await conn.execute(q.sql, q.params, prepare=prepare)
                               for q in queries]
            except BaseException:
                UNPREPARED.add(conn)
                raise
            begin = ()
        else:
            cursors = [await conn.execute(q.sql, q.params, prepare=prepare) for q in queries]
        answers = [await answer(cursor, q.want) for cursor, q in zip(cursors, queries,
                                                                       strict=True)]
        reply = answers if isinstance(step, Batch) else answers[0]


class _AsyncClient(Base):
    """One psycopg ``AsyncConnection`` (autocommit), opened on first use and replaced when
    it broke, with every call serialized by a lock (``asyncio.Lock``): what the store and
    the Session share."""

    def __init__(self, dsn: str, *, schema: str = "statemachine", readonly: bool = False,
                 readback_timeout: float = 10.0,
                 lock_timeout: float | None = LOCK_TIMEOUT) -> None:
        super().__init__(dsn, schema=schema, readonly=readonly,
                         readback_timeout=readback_timeout, lock_timeout=lock_timeout)
        self._lock = asyncio.Lock()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        async with self._lock:
            self._closed = True
            await self._drop()

    # ------------------------------------------------------------ connections

    async def _live(self, doing: str, **where: Any) -> psycopg.AsyncConnection[Any]:
        """The connection, opened (and the tables checked or created) if there is none,
        the last one broke, or it is a forked parent's."""
        if self._closed:
            raise closed(doing, self._noun, **where)
        self._inherited()
        conn = self._conn
        if conn is not None and not conn.closed:
            return conn  # type: ignore[no-any-return]
        self._conn = None
        try:
            conn = await psycopg.AsyncConnection.connect(self.dsn, **self._options())
        except psycopg.Error as error:
            raise self._failure(error, doing=doing, outcome=Outcome.NOT_WRITTEN,
                                **where) from self._cause(error)
        try:
            if not self._ready:
                await self._transaction(conn, ensure_schema(self._sql, readonly=self.readonly))
                self._ready = True
            cursor = await conn.execute(self._sql.identify)
            self._backend = backend_of(conn, await cursor.fetchone())
        except BaseException as error:
            with contextlib.suppress(Exception):
                await conn.close()
            if isinstance(error, BACKEND_ERRORS):
                raise self._failure(error, doing=self._opening, outcome=Outcome.NOT_WRITTEN,
                                    **where) from error
            raise
        self._conn = conn
        return conn

    async def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()

    async def _settle(self) -> None:
        """After a failure before COMMIT: roll back, or drop a connection that cannot."""
        conn = self._conn
        if conn is None:
            return
        try:
            if conn.closed or conn.broken:
                raise psycopg.InterfaceError("the connection is gone")
            await conn.execute("ROLLBACK")
        except Exception:
            await self._drop()

    @staticmethod
    async def _transaction(conn: psycopg.AsyncConnection[Any], op: Op[T]) -> T:
        await conn.execute("BEGIN")
        try:
            result = await run_statements(conn, op)
        except BaseException:
            with contextlib.suppress(Exception):
                await conn.execute("ROLLBACK")
            raise
        await conn.execute("COMMIT")
        return result

    async def _read(self, op: Op[T], *, doing: str, **where: Any) -> T:
        """One read (one statement: one snapshot); every failure is `StorageError`
        (``"not_written"``: a read writes nothing)."""
        async with self._lock:
            conn = await self._live(doing, **where)
            try:
                return await run_statements(conn, op)
            except BACKEND_ERRORS as error:
                await self._settle()
                raise self._failure(error, doing=doing, outcome=Outcome.NOT_WRITTEN,
                                    **where) from error
            except BaseException:
                await self._settle()
                raise

    async def _write(self, op: Op[T], *, doing: str, **where: Any) -> T:
        """One transaction of ``op`` (a Session's write). Before COMMIT every failure is
        ``"not_written"``; a COMMIT that raises is ``"unknown"`` (no read-back: a Session
        write is settled by reconciling its envelope)."""
        async with self._lock:
            conn = await self._live(doing, **where)
            try:
                result = await run_statements(conn, op, begin=BEGIN)
                await self._before_commit()
            except BACKEND_ERRORS as error:
                await self._settle()
                raise self._failure(error, doing=doing, outcome=Outcome.NOT_WRITTEN,
                                    **where) from error
            except BaseException:
                await self._settle()
                raise
            try:
                await conn.execute("COMMIT")
            except psycopg.Error as error:
                await self._drop()
                raise self._failure(error, doing=doing, outcome=Outcome.UNKNOWN,
                                    **where) from error
            except BaseException:  # interrupted or cancelled while committing: never reused
                await self._drop()
                raise
        await self._after_commit()
        return result

    async def _before_commit(self) -> None:
        """A seam for fault injection: runs right before a write's COMMIT."""

    async def _after_commit(self) -> None:
        """A seam for fault injection: runs right after a write's COMMIT returned."""


class AsyncPostgresEventStore(_AsyncClient):
    """An event store on PostgreSQL through psycopg 3's ``AsyncConnection`` (see the
    package's docstring for its tables and failure rules).

    ``dsn``: a libpq connection string or URI. ``schema``: where the tables live
    (created on first use). ``readonly=True``: never creates or writes anything (every
    session is ``default_transaction_read_only``; ``append`` is refused, ``list_runs``
    folds unfolded heads without keeping them, a database without the tables is a
    `StorageError`). ``readback_timeout``: how long (seconds) the read-back after a lost
    COMMIT may wait for a lock or a connection before answering ``"unknown"``.
    ``lock_timeout`` (seconds, `LOCK_TIMEOUT` unless told; None: PostgreSQL's own
    setting, by default no limit): how long a statement waits for a lock another session
    holds, such as the run's head row another append's transaction holds; past it the
    command fails with `StorageError` ``"not_written"``.
    """

    keeps_leases = True
    """Leases are checked and moved in each append's transaction (`stored.next_lease`):
    a claim landing while another owner's lease is live is refused (`LeaseHeld`)."""
    keeps_read_models = True
    """Each append keeps the run's `ReadModel` (``read_model=``) in its head, beside the
    step, in the append's transaction (`stores.keeps_read_models`)."""
    many_session_writes = True
    """``append`` takes a tuple of `SessionWrite` (`stores.many_session_writes`)."""
    checks_session_tail = True
    """A `SessionWrite`'s ``after`` is checked in the append's transaction, against the
    Session's rows in the store's schema (`stores.checks_session_tail`)."""
    commits = 0
    """How many transactions of appends this store committed (counting one whose COMMIT
    answer was lost but whose batch the read-back found): durable writes, one WAL flush
    each."""

    # unasync: async only
    def __init__(self, dsn: str, *, schema: str = "statemachine", readonly: bool = False,
                 readback_timeout: float = 10.0,
                 lock_timeout: float | None = LOCK_TIMEOUT, group_commit: bool = True
                 ) -> None:
        """Group commit (DESIGN §7.7; ``group_commit=True``, the default): the appends
        made while the store's connection is busy wait, and are then written together by
        one writer task, at most `GROUP_LIMIT` of them, in one transaction, one COMMIT,
        one WAL flush (`commits` counts one): each in a savepoint of its own, in the
        order of their run ids (two stores' groups never wait for each other in a
        cycle; two appends of one run keep their order and behave as if serialized), so
        one run's refusal (a version conflict, `LeaseHeld`, a lock it waited for too
        long, an error of the server) rolls back to its savepoint and fails only that
        append. A COMMIT that raised is decided for each append of the group as a lone
        append's would be: its batch read back after the fence. A group of one is a lone
        append: events alone are one statement, no savepoint. An append cancelled before
        its group is taken is never written; once taken, it lands or fails with its
        group, whether its caller still waits or not. ``group_commit=False``: each
        append is a transaction of its own, as in the sync store."""
        super().__init__(dsn, schema=schema, readonly=readonly,
                         readback_timeout=readback_timeout, lock_timeout=lock_timeout)
        self.group_commit = group_commit
        self._waiting: list[tuple[PreparedAppend, asyncio.Future[None]]] = []
        self._writer: asyncio.Task[None] | None = None

    # unasync: end
    # ---------------------------------------------------------------- writing

    async def append(self, run_id: str, events: Sequence[Event], expected_version: int, *,
                     snapshot: Snapshot | None = None, step: Step | None = None,
                     session_write: SessionWrite | tuple[SessionWrite, ...] | None = None,
                     read_model: ReadModel | None = None) -> None:
        """`IndexedStore.append`; with ``session_write``, its items go to its Session (the
        ``session_items`` table the PostgreSQL Sessions read, tagged with its publication
        id) in the same transaction as ``events``: both land or neither does, and a lost
        COMMIT answer is decided for both by reading the batch back; a tuple of writes
        (`many_session_writes`) writes each in order, in the same transaction.
        ``read_model``: the run's `ReadModel` after ``events``, kept in its head beside
        ``step`` (without both, after a run's first append, the head is left
        unfolded)."""
        if self.readonly:
            raise self._refused_readonly(APPEND, run_id)
        prepared = prepare(run_id, events, expected_version, snapshot, step, session_write,
                           read_model)
        # unasync: async only
        if self.group_commit:
            await self._in_group(prepared)
            return
        # unasync: end
        async with self._lock:
            await self._append_alone(prepared)
        await self._after_commit()

    async def _append_alone(self, prepared: PreparedAppend) -> None:
        """One append in a transaction of its own (events alone: one statement), under
        the lock its caller holds."""
        where = {"run_id": prepared.run_id}
        conn = await self._live(APPEND, **where)
        if one_statement(prepared):
            await self._append_one(conn, prepared)
            self.commits += 1
            return
        try:
            await run_statements(conn, append_steps(self._sql, prepared), begin=BEGIN)
            await self._before_commit()
        except ConcurrencyConflict:
            await self._settle()
            raise
        except psycopg.errors.UniqueViolation:  # the log is ahead of its head
            await self._settle()
            raise lost_race(prepared.run_id, prepared.expected,
                            prepared.expected + 1) from None
        except BACKEND_ERRORS as error:  # before COMMIT: the transaction did not commit
            await self._settle()
            raise self._failure(error, doing=APPEND, outcome=Outcome.NOT_WRITTEN,
                                **where) from error
        except BaseException:
            await self._settle()
            raise
        try:
            await conn.execute("COMMIT")
        except psycopg.Error as error:
            await self._classify(error, prepared)
        except BaseException:  # interrupted or cancelled while committing: never reused
            await self._drop()
            raise
        self.commits += 1

    async def _append_one(self, conn: psycopg.AsyncConnection[Any], a: PreparedAppend
                          ) -> None:
        """An append of events alone: one statement, its own transaction."""
        where = {"run_id": a.run_id}
        try:
            await self._before_commit()
        except BACKEND_ERRORS as error:  # nothing was sent
            raise self._failure(error, doing=APPEND, outcome=Outcome.NOT_WRITTEN,
                                **where) from error
        try:
            cursor = await conn.execute(self._sql.append[a.expected == 0, a.count == 1],
                                        a.params, prepare=prepared(conn))
            moved = cursor.rowcount
        except psycopg.errors.UniqueViolation:  # the log is ahead of its head
            raise lost_race(a.run_id, a.expected, a.expected + 1) from None
        except psycopg.Error as error:
            if answered(conn):
                raise self._failure(error, doing=APPEND, outcome=Outcome.NOT_WRITTEN,
                                    **where) from error
            await self._classify(error, a)
            return
        except UnicodeEncodeError as error:  # refused while encoding: nothing was sent
            raise self._failure(error, doing=APPEND, outcome=Outcome.NOT_WRITTEN,
                                **where) from error
        except BaseException:  # interrupted or cancelled in flight: never reused
            await self._drop()
            raise
        if moved != a.count:  # a lost race: the statement wrote nothing
            try:
                cursor = await conn.execute(self._sql.head_version, (a.run_id,))
                row = await cursor.fetchone()
            except BACKEND_ERRORS as error:
                await self._settle()
                raise self._failure(error, doing=APPEND, outcome=Outcome.NOT_WRITTEN,
                                    **where) from error
            raise refusal(a, row)

    async def _classify(self, error: psycopg.Error, prepared: PreparedAppend, *,
                        in_transaction: bool = False) -> None:
        """The connection was lost with a COMMIT in flight: fence and read the batch back
        on a fresh connection. Found: appended (return). Not found: ``"not_written"``.
        Undecidable: ``"unknown"``. ``in_transaction``: the append was not its own
        statement but ran in a transaction (BEGIN ... COMMIT) of several statements."""
        where = {"run_id": prepared.run_id}
        backend = self._backend
        await self._drop()  # closing it ends whatever is left of the transaction server-side
        try:
            fenced, landed = await self._landed(prepared, backend)
        except Exception as probe_error:
            raise self._failure(error, doing=APPEND, outcome=Outcome.UNKNOWN,
                                **where) from self._cause(probe_error)
        if landed:
            return
        decided = fenced or not one_statement(prepared) or in_transaction
        raise self._failure(error, doing=APPEND,
                            outcome=Outcome.NOT_WRITTEN if decided else Outcome.UNKNOWN,
                      **where) from error

    # unasync: async only
    async def _in_group(self, prepared: PreparedAppend) -> None:
        """Queue ``prepared`` for the writer task (started if none runs) and wait for its
        group's outcome."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append((prepared, done))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write_groups())
        await done  # cancelled here before the writer took it: it is dropped

    async def _write_groups(self) -> None:
        """The writer task: while appends wait, take the ones waiting once the lock is
        free (at most `GROUP_LIMIT`, in the order they were made; a cancelled one is
        dropped) and write them as one group; each caller gets its own outcome."""
        while self._waiting:
            async with self._lock:
                taken: list[tuple[PreparedAppend, asyncio.Future[None]]] = []
                while self._waiting and len(taken) < GROUP_LIMIT:
                    prepared, done = self._waiting.pop(0)
                    if not done.done():
                        taken.append((prepared, done))
                if not taken:
                    continue
                try:
                    outcomes = await self._append_group([prepared for prepared, _ in taken])
                except Exception as error:  # never leave a caller waiting
                    outcomes = [error] * len(taken)
                except BaseException:  # the writer itself was cancelled (the loop ends)
                    for _, done in [*taken, *self._waiting]:
                        done.cancel()
                    self._waiting.clear()
                    raise
            if any(outcome is None for outcome in outcomes):
                await self._after_commit()
            for (_, done), outcome in zip(taken, outcomes, strict=True):
                if done.done():  # its caller was cancelled after the group was taken
                    continue
                if outcome is None:
                    done.set_result(None)
                else:
                    done.set_exception(outcome)

    async def _append_group(self, group: Sequence[PreparedAppend]
                            ) -> list[BaseException | None]:
        """Several appends in ONE transaction (see ``group_commit``); each one's outcome:
        None for landed, else the error a lone append would raise. A group of one is
        a lone append (`_append_alone`)."""
        if len(group) == 1:
            try:
                await self._append_alone(group[0])
            except Exception as error:
                return [error]
            return [None]
        outcomes: list[BaseException | None] = [None] * len(group)
        try:
            conn = await self._live(APPEND)
        except StorageError as error:
            return [_again(error, a) for a in group]
        written: list[int] = []
        begin: tuple[str, ...] = ("BEGIN", "SAVEPOINT one_append")
        sessions = locked_sessions(group)
        try:
            if sessions:  # every Session's lock before any run's row, outside the savepoints
                await run_statements(conn, lock_steps(self._sql, sessions), begin=("BEGIN",))
                begin = ("SAVEPOINT one_append",)
            for i in sorted(range(len(group)), key=lambda j: group[j].run_id):
                try:
                    await run_statements(conn, append_steps(self._sql, group[i],
                                                            locked=bool(sessions)),
                                         begin=begin)
                except Exception as error:
                    outcomes[i] = self._append_error(error, group[i])
                    if not _in_transaction(conn):  # the group's transaction is lost
                        raise
                    await conn.execute("ROLLBACK TO SAVEPOINT one_append")
                    begin = ()  # the savepoint, kept and empty, serves the next append
                else:
                    written.append(i)
                    # the next append's savepoint inside this one's, which is kept (not
                    # released: a statement fewer); rolling back to it undoes the next
                    # append alone
                    begin = ("SAVEPOINT one_append",)
            if not written:
                await conn.execute("ROLLBACK")
                return outcomes
            await self._before_commit()
        except Exception as error:  # before COMMIT: nothing of the group landed
            await self._settle()
            return [self._append_error(error, a, lost=True) if outcome is None else outcome
                    for a, outcome in zip(group, outcomes, strict=True)]
        except BaseException:
            await self._settle()
            raise
        try:
            await conn.execute("COMMIT")
        except psycopg.Error as error:  # each decided by its own batch, read back
            undecided: StorageError | None = None
            for i in written:
                try:
                    if undecided is not None:  # one transaction: as undecidable
                        raise _again(undecided, group[i])
                    await self._classify(error, group[i], in_transaction=True)
                except StorageError as failed:
                    outcomes[i] = failed
                    if failed.outcome == Outcome.UNKNOWN:
                        undecided = failed
        except BaseException:  # interrupted or cancelled while committing: never reused
            await self._drop()
            raise
        if any(outcomes[i] is None for i in written):
            self.commits += 1
        return outcomes

    def _append_error(self, error: Exception, a: PreparedAppend, *, lost: bool = False
                      ) -> Exception:
        """What a lone append raises for ``error``, met before its COMMIT (``lost``: by
        the group's transaction, not by ``a``'s own statements)."""
        if isinstance(error, psycopg.errors.UniqueViolation) and not lost:
            return lost_race(a.run_id, a.expected, a.expected + 1)
        if isinstance(error, BACKEND_ERRORS):
            failed = self._failure(error, doing=APPEND, outcome=Outcome.NOT_WRITTEN,
                                   run_id=a.run_id)
            failed.__cause__ = error
            return failed
        return error

    # unasync: end
    async def _landed(self, prepared: PreparedAppend, backend: Backend | None
                      ) -> tuple[bool, bool]:
        """(fenced, landed): see the package's docstring."""
        async with await psycopg.AsyncConnection.connect(
                self.dsn, **self._probe_options()) as probe:
            fenced = False
            if backend is not None:
                try:
                    fenced = await run_statements(
                        probe, fence_steps(self._sql, backend, self.readback_timeout))
                except psycopg.Error:  # not allowed to signal it: the lock wait decides
                    fenced = False
            await probe.execute("BEGIN")
            try:
                return fenced, await run_statements(probe, probe_steps(
                    self._sql, prepared.run_id, prepared.expected == 0, prepared.batch_id,
                    self.readback_timeout))
            finally:
                with contextlib.suppress(Exception):
                    await probe.execute("ROLLBACK")

    # ---------------------------------------------------------------- reading

    async def load(self, run_id: str) -> list[Event]:
        loaded = await self.load_measured(run_id)
        return loaded.events

    async def load_measured(self, run_id: str) -> Loaded:
        """`load`, with the size of the events when they were decoded together (clean
        rows, the common case): see `stores.load_measured`."""
        rows = await self._read(one(self._sql.load, {"run": run_id}), doing=LOAD,
                                run_id=run_id)
        return loaded_log(run_id, rows)

    async def load_latest(self, run_id: str) -> tuple[Snapshot | None, list[Event]]:
        snapshot, tail = await self.load_latest_measured(run_id)
        return snapshot, tail.events

    async def load_latest_measured(self, run_id: str) -> tuple[Snapshot | None, Loaded]:
        """`load_latest`, with the size of the tail as `load_measured` measures it."""
        rows = await self._read(one(self._sql.load_latest, {"run": run_id}), doing=LOAD,
                                run_id=run_id)
        snapshot, problem, tail = latest_log(run_id, rows)
        if problem is None:
            return snapshot, tail
        snapshot_ignored(run_id, problem)
        return None, await self.load_measured(run_id)

    async def list_runs(self, session_id: str | None = None,
                        steps: Collection[Step] | None = None) -> tuple[RunHead, ...]:
        wanted = check_filters(session_id, steps)
        if wanted is not None and not wanted:
            return ()
        tail, params = heads_query(session_id, wanted)
        rows = await self._read(heads(self._sql, tail, params), doing=LIST)
        found = []
        for (run_id, stored_version, step, stored_session, owner, updated_at, holder,
             until, text, kind) in rows:
            model = None if step is None else kept_model(run_id, text, kind)
            if model is None:  # unfolded, or its read model does not decode: fold it
                version, known, session, model = await self._fill_unfolded_head(run_id)
            else:
                version, known, session = stored_version, head_step(run_id, step), stored_session
            if wanted is None or known in wanted:
                found.append(RunHead(run_id, version, known, session, owner, updated_at,
                                     holder, until, model.blocker, model.waiting))
        return tuple(found)

    async def version(self, run_id: str) -> int:
        """How many events the run's log holds (0 for a run not in the store): one read
        of its head row, what `RunController.fence` asks before an effect."""
        rows = await self._read(one(self._sql.version, (run_id,)), doing=LOAD, run_id=run_id)
        return int(rows[0][0]) if rows else 0

    async def session_items(self, session_id: str, limit: int | None = None) -> list[JSON]:
        """The items of the PostgreSQL Session ``session_id`` in this store's schema (all
        of them, or the last ``limit``), as its ``get_items`` reads them, through this
        store's connection (a sync store: no thread of the Session's). `StorageError` as
        the Session raises it."""
        items: list[JSON] = await self._read(
            session_items_steps(self._sql, session_id, limit), doing=READ_SESSION)
        return items

    async def run_ids(self, limit: int | None = None) -> list[str]:
        """The ids of the runs the store holds, sorted (the first ``limit`` of them)."""
        sql = self._sql.run_ids + ("" if limit is None else f" LIMIT {int(limit)}")
        return [row[0] for row in await self._read(one(sql, None), doing=LIST)]

    async def _fill_unfolded_head(self, run_id: str) -> Head:
        """Fold an unfolded head (or one whose read model does not decode) from the run's
        log (its snapshot and tail) and keep its step and read model (only if the run has
        not moved meanwhile; never when read-only). Keeping it is a cache: a failure to
        keep it costs a fold next time."""
        snapshot, tail = await self.load_latest(run_id)
        head, stale = head_after_snapshot(run_id, snapshot, tail)
        if head is None:  # the whole log decides
            head = head_of_whole_log(run_id, await self.load(run_id), stale=stale)
        version, step, _, model = head
        if not self.readonly:
            kind = None if model.blocker is None else model.blocker.kind.value
            kept = (step.value, model.encode(), kind, run_id, version)
            with contextlib.suppress(StorageError):
                await self._read(one(self._sql.keep_fold, kept, "none"), doing=LIST,
                                 run_id=run_id)
        return head


class AsyncPostgresSession(SessionMethods, _AsyncClient):
    """A Session on PostgreSQL through psycopg's ``AsyncConnection``: see `SessionMethods`
    (``dsn``, ``session_id``, ``schema``, ``lock_timeout``)."""
