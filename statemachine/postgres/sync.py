"""The sync PostgreSQL event store and Session, on psycopg's ``Connection``.

GENERATED from ``aio.py`` by ``tools/unasync.py``: do not edit. Change ``aio.py`` and
run ``python tools/unasync.py``; ``python tools/unasync.py --check`` fails while this
file is stale.
"""

from __future__ import annotations

import contextlib
import threading
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


def answer(cursor: psycopg.Cursor[Any], want: str) -> Any:
    """What a `steps.Query` wants back from its cursor."""
    if want == "rowcount":
        return cursor.rowcount
    if want == "one":
        return cursor.fetchone()
    if want == "all":
        return cursor.fetchall()
    return None


def run_statements(conn: psycopg.Connection[Any], op: Op[T], *,
                   begin: Sequence[str] = ()) -> T:
    """Run the statements ``op`` yields on ``conn``, sending each its answer (a `Batch`
    its answers, pipelined where libpq can), and return what ``op`` returns; ``begin``:
    statements to run first (``BEGIN``, which opens a transaction), pipelined with the
    first statement where libpq can."""
    if begin and not PIPELINE:
        for statement in begin:
            conn.execute(statement)
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
                with conn.pipeline():
                    for statement in begin:
                        conn.execute(statement, prepare=prepare)
                    cursors = [conn.execute(q.sql, q.params, prepare=prepare)
                               for q in queries]
            except BaseException:
                UNPREPARED.add(conn)
                raise
            begin = ()
        else:
            cursors = [conn.execute(q.sql, q.params, prepare=prepare) for q in queries]
        answers = [answer(cursor, q.want) for cursor, q in zip(cursors, queries,
                                                                       strict=True)]
        reply = answers if isinstance(step, Batch) else answers[0]


class _Client(Base):
    """One psycopg ``Connection`` (autocommit), opened on first use and replaced when
    it broke, with every call serialized by a lock (``threading.Lock``): what the store and
    the Session share."""

    def __init__(self, dsn: str, *, schema: str = "statemachine", readonly: bool = False,
                 readback_timeout: float = 10.0,
                 lock_timeout: float | None = LOCK_TIMEOUT) -> None:
        super().__init__(dsn, schema=schema, readonly=readonly,
                         readback_timeout=readback_timeout, lock_timeout=lock_timeout)
        self._lock = threading.Lock()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._drop()

    # ------------------------------------------------------------ connections

    def _live(self, doing: str, **where: Any) -> psycopg.Connection[Any]:
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
            conn = psycopg.connect(self.dsn, **self._options())
        except psycopg.Error as error:
            raise self._failure(error, doing=doing, outcome=Outcome.NOT_WRITTEN,
                                **where) from self._cause(error)
        try:
            if not self._ready:
                self._transaction(conn, ensure_schema(self._sql, readonly=self.readonly))
                self._ready = True
            cursor = conn.execute(self._sql.identify)
            self._backend = backend_of(conn, cursor.fetchone())
        except BaseException as error:
            with contextlib.suppress(Exception):
                conn.close()
            if isinstance(error, BACKEND_ERRORS):
                raise self._failure(error, doing=self._opening, outcome=Outcome.NOT_WRITTEN,
                                    **where) from error
            raise
        self._conn = conn
        return conn

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    def _settle(self) -> None:
        """After a failure before COMMIT: roll back, or drop a connection that cannot."""
        conn = self._conn
        if conn is None:
            return
        try:
            if conn.closed or conn.broken:
                raise psycopg.InterfaceError("the connection is gone")
            conn.execute("ROLLBACK")
        except Exception:
            self._drop()

    @staticmethod
    def _transaction(conn: psycopg.Connection[Any], op: Op[T]) -> T:
        conn.execute("BEGIN")
        try:
            result = run_statements(conn, op)
        except BaseException:
            with contextlib.suppress(Exception):
                conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
        return result

    def _read(self, op: Op[T], *, doing: str, **where: Any) -> T:
        """One read (one statement: one snapshot); every failure is `StorageError`
        (``"not_written"``: a read writes nothing)."""
        with self._lock:
            conn = self._live(doing, **where)
            try:
                return run_statements(conn, op)
            except BACKEND_ERRORS as error:
                self._settle()
                raise self._failure(error, doing=doing, outcome=Outcome.NOT_WRITTEN,
                                    **where) from error
            except BaseException:
                self._settle()
                raise

    def _write(self, op: Op[T], *, doing: str, **where: Any) -> T:
        """One transaction of ``op`` (a Session's write). Before COMMIT every failure is
        ``"not_written"``; a COMMIT that raises is ``"unknown"`` (no read-back: a Session
        write is settled by reconciling its envelope)."""
        with self._lock:
            conn = self._live(doing, **where)
            try:
                result = run_statements(conn, op, begin=BEGIN)
                self._before_commit()
            except BACKEND_ERRORS as error:
                self._settle()
                raise self._failure(error, doing=doing, outcome=Outcome.NOT_WRITTEN,
                                    **where) from error
            except BaseException:
                self._settle()
                raise
            try:
                conn.execute("COMMIT")
            except psycopg.Error as error:
                self._drop()
                raise self._failure(error, doing=doing, outcome=Outcome.UNKNOWN,
                                    **where) from error
            except BaseException:  # interrupted or cancelled while committing: never reused
                self._drop()
                raise
        self._after_commit()
        return result

    def _before_commit(self) -> None:
        """A seam for fault injection: runs right before a write's COMMIT."""

    def _after_commit(self) -> None:
        """A seam for fault injection: runs right after a write's COMMIT returned."""


class PostgresEventStore(_Client):
    """An event store on PostgreSQL through psycopg 3's ``Connection`` (see the
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

    # ---------------------------------------------------------------- writing

    def append(self, run_id: str, events: Sequence[Event], expected_version: int, *,
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
        with self._lock:
            self._append_alone(prepared)
        self._after_commit()

    def _append_alone(self, prepared: PreparedAppend) -> None:
        """One append in a transaction of its own (events alone: one statement), under
        the lock its caller holds."""
        where = {"run_id": prepared.run_id}
        conn = self._live(APPEND, **where)
        if one_statement(prepared):
            self._append_one(conn, prepared)
            self.commits += 1
            return
        try:
            run_statements(conn, append_steps(self._sql, prepared), begin=BEGIN)
            self._before_commit()
        except ConcurrencyConflict:
            self._settle()
            raise
        except psycopg.errors.UniqueViolation:  # the log is ahead of its head
            self._settle()
            raise lost_race(prepared.run_id, prepared.expected,
                            prepared.expected + 1) from None
        except BACKEND_ERRORS as error:  # before COMMIT: the transaction did not commit
            self._settle()
            raise self._failure(error, doing=APPEND, outcome=Outcome.NOT_WRITTEN,
                                **where) from error
        except BaseException:
            self._settle()
            raise
        try:
            conn.execute("COMMIT")
        except psycopg.Error as error:
            self._classify(error, prepared)
        except BaseException:  # interrupted or cancelled while committing: never reused
            self._drop()
            raise
        self.commits += 1

    def _append_one(self, conn: psycopg.Connection[Any], a: PreparedAppend
                    ) -> None:
        """An append of events alone: one statement, its own transaction."""
        where = {"run_id": a.run_id}
        try:
            self._before_commit()
        except BACKEND_ERRORS as error:  # nothing was sent
            raise self._failure(error, doing=APPEND, outcome=Outcome.NOT_WRITTEN,
                                **where) from error
        try:
            cursor = conn.execute(self._sql.append[a.expected == 0, a.count == 1],
                                  a.params, prepare=prepared(conn))
            moved = cursor.rowcount
        except psycopg.errors.UniqueViolation:  # the log is ahead of its head
            raise lost_race(a.run_id, a.expected, a.expected + 1) from None
        except psycopg.Error as error:
            if answered(conn):
                raise self._failure(error, doing=APPEND, outcome=Outcome.NOT_WRITTEN,
                                    **where) from error
            self._classify(error, a)
            return
        except UnicodeEncodeError as error:  # refused while encoding: nothing was sent
            raise self._failure(error, doing=APPEND, outcome=Outcome.NOT_WRITTEN,
                                **where) from error
        except BaseException:  # interrupted or cancelled in flight: never reused
            self._drop()
            raise
        if moved != a.count:  # a lost race: the statement wrote nothing
            try:
                cursor = conn.execute(self._sql.head_version, (a.run_id,))
                row = cursor.fetchone()
            except BACKEND_ERRORS as error:
                self._settle()
                raise self._failure(error, doing=APPEND, outcome=Outcome.NOT_WRITTEN,
                                    **where) from error
            raise refusal(a, row)

    def _classify(self, error: psycopg.Error, prepared: PreparedAppend, *,
                  in_transaction: bool = False) -> None:
        """The connection was lost with a COMMIT in flight: fence and read the batch back
        on a fresh connection. Found: appended (return). Not found: ``"not_written"``.
        Undecidable: ``"unknown"``. ``in_transaction``: the append was not its own
        statement but ran in a transaction (BEGIN ... COMMIT) of several statements."""
        where = {"run_id": prepared.run_id}
        backend = self._backend
        self._drop()  # closing it ends whatever is left of the transaction server-side
        try:
            fenced, landed = self._landed(prepared, backend)
        except Exception as probe_error:
            raise self._failure(error, doing=APPEND, outcome=Outcome.UNKNOWN,
                                **where) from self._cause(probe_error)
        if landed:
            return
        decided = fenced or not one_statement(prepared) or in_transaction
        raise self._failure(error, doing=APPEND,
                            outcome=Outcome.NOT_WRITTEN if decided else Outcome.UNKNOWN,
                      **where) from error

    def _landed(self, prepared: PreparedAppend, backend: Backend | None
                ) -> tuple[bool, bool]:
        """(fenced, landed): see the package's docstring."""
        with psycopg.connect(
                self.dsn, **self._probe_options()) as probe:
            fenced = False
            if backend is not None:
                try:
                    fenced = run_statements(
                        probe, fence_steps(self._sql, backend, self.readback_timeout))
                except psycopg.Error:  # not allowed to signal it: the lock wait decides
                    fenced = False
            probe.execute("BEGIN")
            try:
                return fenced, run_statements(probe, probe_steps(
                    self._sql, prepared.run_id, prepared.expected == 0, prepared.batch_id,
                    self.readback_timeout))
            finally:
                with contextlib.suppress(Exception):
                    probe.execute("ROLLBACK")

    # ---------------------------------------------------------------- reading

    def load(self, run_id: str) -> list[Event]:
        loaded = self.load_measured(run_id)
        return loaded.events

    def load_measured(self, run_id: str) -> Loaded:
        """`load`, with the size of the events when they were decoded together (clean
        rows, the common case): see `stores.load_measured`."""
        rows = self._read(one(self._sql.load, {"run": run_id}), doing=LOAD,
                          run_id=run_id)
        return loaded_log(run_id, rows)

    def load_latest(self, run_id: str) -> tuple[Snapshot | None, list[Event]]:
        snapshot, tail = self.load_latest_measured(run_id)
        return snapshot, tail.events

    def load_latest_measured(self, run_id: str) -> tuple[Snapshot | None, Loaded]:
        """`load_latest`, with the size of the tail as `load_measured` measures it."""
        rows = self._read(one(self._sql.load_latest, {"run": run_id}), doing=LOAD,
                          run_id=run_id)
        snapshot, problem, tail = latest_log(run_id, rows)
        if problem is None:
            return snapshot, tail
        snapshot_ignored(run_id, problem)
        return None, self.load_measured(run_id)

    def list_runs(self, session_id: str | None = None,
                  steps: Collection[Step] | None = None) -> tuple[RunHead, ...]:
        wanted = check_filters(session_id, steps)
        if wanted is not None and not wanted:
            return ()
        tail, params = heads_query(session_id, wanted)
        rows = self._read(heads(self._sql, tail, params), doing=LIST)
        found = []
        for (run_id, stored_version, step, stored_session, owner, updated_at, holder,
             until, text, kind) in rows:
            model = None if step is None else kept_model(run_id, text, kind)
            if model is None:  # unfolded, or its read model does not decode: fold it
                version, known, session, model = self._fill_unfolded_head(run_id)
            else:
                version, known, session = stored_version, head_step(run_id, step), stored_session
            if wanted is None or known in wanted:
                found.append(RunHead(run_id, version, known, session, owner, updated_at,
                                     holder, until, model.blocker, model.waiting))
        return tuple(found)

    def version(self, run_id: str) -> int:
        """How many events the run's log holds (0 for a run not in the store): one read
        of its head row, what `RunController.fence` asks before an effect."""
        rows = self._read(one(self._sql.version, (run_id,)), doing=LOAD, run_id=run_id)
        return int(rows[0][0]) if rows else 0

    def session_items(self, session_id: str, limit: int | None = None) -> list[JSON]:
        """The items of the PostgreSQL Session ``session_id`` in this store's schema (all
        of them, or the last ``limit``), as its ``get_items`` reads them, through this
        store's connection (a sync store: no thread of the Session's). `StorageError` as
        the Session raises it."""
        items: list[JSON] = self._read(
            session_items_steps(self._sql, session_id, limit), doing=READ_SESSION)
        return items

    def run_ids(self, limit: int | None = None) -> list[str]:
        """The ids of the runs the store holds, sorted (the first ``limit`` of them)."""
        sql = self._sql.run_ids + ("" if limit is None else f" LIMIT {int(limit)}")
        return [row[0] for row in self._read(one(sql, None), doing=LIST)]

    def _fill_unfolded_head(self, run_id: str) -> Head:
        """Fold an unfolded head (or one whose read model does not decode) from the run's
        log (its snapshot and tail) and keep its step and read model (only if the run has
        not moved meanwhile; never when read-only). Keeping it is a cache: a failure to
        keep it costs a fold next time."""
        snapshot, tail = self.load_latest(run_id)
        head, stale = head_after_snapshot(run_id, snapshot, tail)
        if head is None:  # the whole log decides
            head = head_of_whole_log(run_id, self.load(run_id), stale=stale)
        version, step, _, model = head
        if not self.readonly:
            kind = None if model.blocker is None else model.blocker.kind.value
            kept = (step.value, model.encode(), kind, run_id, version)
            with contextlib.suppress(StorageError):
                self._read(one(self._sql.keep_fold, kept, "none"), doing=LIST,
                           run_id=run_id)
        return head


class PostgresSession(SessionMethods, _Client):
    """A Session on PostgreSQL through psycopg's ``Connection``: see `SessionMethods`
    (``dsn``, ``session_id``, ``schema``, ``lock_timeout``)."""
