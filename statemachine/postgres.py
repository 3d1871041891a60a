"""PostgreSQL event stores and Sessions (DESIGN §6.7): many workers, one database.

`PostgresEventStore` (sync) and `AsyncPostgresEventStore` (asyncio) keep the same
contract as `SQLiteEventStore` — `EventStore`, `SnapshotStore` (``load_latest``) and
`IndexedStore` (``append(..., snapshot=, step=)``, ``list_runs``) — on a PostgreSQL
server through psycopg 3 (the ``postgres`` extra: ``pip install
'agent-statemachine[postgres]'``).

Tables (in the schema named by ``schema=``, ``statemachine`` unless told otherwise, so
they never meet an application's own ``events`` table), created on first use in one
transaction under an advisory lock, and versioned by ``statemachine_schema(version)``:

- ``runs``: one head per run (``run_id`` primary key, ``version``, ``owner``, ``step``,
  ``session_id``). Every append moves it in the append's own transaction with ``UPDATE
  ... WHERE run_id = $1 AND version = $expected`` (a run's first append: ``INSERT ... ON
  CONFLICT DO NOTHING``); no row moved is a `ConcurrencyConflict`, so of two writers
  that loaded the same version exactly one appends. The owner is the one of the last
  `RunClaimed` the append writes (kept otherwise); the step is the ``step=`` the
  controller hands over (NULL, "unfolded", when a caller gives none after the first
  append: ``list_runs`` then folds it from the log and keeps it).
- ``events``: ``(run_id, seq)`` primary key, ``batch_id`` (a client-generated id per
  append), ``body`` (the event's JSON text, exactly as the SQLite store writes it).
- ``snapshots``: the newest snapshot per run, with the sha256 ``digest`` of its text.
  ``load_latest`` uses it only if the digest matches, its JSON is this run's state ending
  right before its version, and that version is within the log; otherwise it warns
  (`SnapshotIgnored`) and returns the whole log.
- ``session_items`` (schema version 2; a version 1 schema gains it on first use, under
  the same lock): the items of `PostgresSession` / `AsyncPostgresSession`, ``id``
  (bigserial: the order), ``session_id``, ``publication_id`` (the publication that wrote
  the item, ``run_id:seq``; NULL for an item written without one) and ``body`` (detached
  JSON text, as `SQLiteSession` keeps it).

The shared transaction: when a run's store and its Session are on the same database and
schema (`PostgresSession.shares_transaction_with`), ``statemachine.runner.publish`` hands
a publication's items to the store with its `PublicationCommitted`
(`RunController.publication_committed(session_write=...)`), and ``append(...,
session_write=)`` inserts them in the append's own transaction: the items and the commit
land together or not at all, and a COMMIT whose answer was lost is decided for both by
reading the batch back. The write of that pair is never ambiguous.

A log is read with its head in one statement and checked: a gap, a damaged row, or a log
shorter or longer than its head says is a `SchemaError`, never a silently shorter log.

Failures are typed: no psycopg error escapes a public call. An error the server answered
while the connection stays up is `StorageError` with ``outcome="not_written"`` (the
transaction rolled back), and so is every failure before a COMMIT was sent; a lost
version race is `ConcurrencyConflict`. A connection lost while the COMMIT (or the
one-statement append that is its own transaction) was in flight has an unknown outcome,
decided on a fresh connection: first the fence, then the read-back. The fence ends the
lost connection's server process (``pg_terminate_backend``, matched by process id and
start time, waiting up to ``readback_timeout``), so nothing still travelling towards it
can commit later; the read-back then waits for any lock the lost transaction may still
hold and looks for the append's batch id: found is success, not found is
``"not_written"``. Not found without a fence is ``"not_written"`` only for a
two-round-trip append, whose open transaction holds the run's head until its COMMIT
arrives; for a one-statement append it is ``"unknown"``. There is no fence when the role
may not signal the process, when it would not end in time, when the read-back reached
another server (its address or port differ), before PostgreSQL 14, and behind a pooler or a
proxy that answers for the server (seen at connect: the process the client was told of
is not the one it talks to). A read-back that cannot decide is ``"unknown"``. Nothing is
ever retried. A broken connection is replaced on the next call, so after a server restart
the command that met it fails and the next one works.

One connection per store object, in autocommit mode (a read is one statement, so one
snapshot; an append of events alone is one statement that is its own transaction: one
round trip; an append with a snapshot or Session items is ``BEGIN`` and its first
statement, pipelined, the others, then ``COMMIT``), serialized by a lock: share a store
between threads (or tasks) freely, or give each worker its own. A process forked while a
store is open leaves the parent's connection alone (the child opens its own).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import threading
import uuid
import weakref
from collections.abc import Collection, Generator, Sequence
from typing import Any, Self, TypeVar

import attrs
import psycopg
from psycopg.conninfo import conninfo_to_dict

from statemachine import codec
from statemachine.errors import ConcurrencyConflict, SchemaError, StorageError
from statemachine.events import Event
from statemachine.payloads import JSON, detach
from statemachine.stored import (
    RunHead,
    check_filters,
    claimed_owner,
    conflict,
    decode_rows,
    digest,
    dumps,
    head_of_log,
    snapshot_ignored,
    started_session,
    step_to_index,
    verified_snapshot,
)
from statemachine.stores import AsyncEventStore, SessionWrite, Snapshot
from statemachine.values import Step

__all__ = ["SCHEMA_VERSION", "AsyncEventStore", "AsyncPostgresEventStore",
           "AsyncPostgresSession", "PostgresEventStore", "PostgresSession", "SessionWrite"]

SCHEMA_VERSION = 2
"""The version of the tables this library writes (``statemachine_schema.version``): 2
adds ``session_items`` (`PostgresSession`); a version 1 schema is upgraded in place on
first use."""

T = TypeVar("T")
Rows = list[tuple[Any, ...]]


# ----------------------------------------------------------------------- failures

_AFTER = {
    "not_written": "nothing was written",
    "unknown": "the write may or may not have landed; load the run again",
}
_SHOWN = 300


def _reason(error: BaseException) -> str:
    """PostgreSQL's (or libpq's) own words for ``error``: its class, SQLSTATE and primary
    message, never its DETAIL (which may quote row values, so payloads)."""
    name = type(error).__name__
    if isinstance(error, psycopg.Error):
        sqlstate = error.sqlstate
        primary = error.diag.message_primary
        text = primary if primary else (str(error).strip().splitlines() or [""])[0]
        name = f"{name} {sqlstate}" if sqlstate else name
    else:
        text = (str(error).strip().splitlines() or [""])[0]
    text = "".join(c if c.isprintable() else " " for c in text[:_SHOWN])
    return f"{name}: {text}" if text else name


def _failure(error: BaseException, *, doing: str, outcome: str, **where: Any) -> StorageError:
    return StorageError(f"cannot {doing}: PostgreSQL {_reason(error)}; {_AFTER[outcome]}",
                        outcome=outcome, **where)


def _closed(doing: str, noun: str, **where: Any) -> StorageError:
    return StorageError(f"cannot {doing}: the {noun} is closed; nothing was written",
                        outcome="not_written", **where)


_BACKEND = (psycopg.Error, UnicodeEncodeError)
"""What the backend raises: psycopg's errors, and a text psycopg cannot encode (a lone
surrogate; PostgreSQL text also refuses NUL, which psycopg reports as `psycopg.DataError`)."""

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")


def _quoted(name: str) -> str:
    if type(name) is not str or _IDENTIFIER.fullmatch(name) is None:
        raise ValueError("schema must be a plain SQL identifier (letters, digits, _; "
                         "at most 63)")
    return f'"{name}"'


# ------------------------------------------------------------------------ queries


@attrs.frozen
class _Q:
    """One statement an operation asks its driver to run, and what it wants back:
    ``"rowcount"``, ``"one"`` (a row or None), ``"all"`` (the rows) or ``"none"``."""

    sql: str
    params: Any = None
    want: str = "none"


Op = Generator[_Q, Any, T]
"""An operation, sans I/O: it yields statements and is sent their answers; the sync and
the async store drive the same operations."""


class _Sql:
    """The statements of one schema."""

    def __init__(self, schema: str) -> None:
        s = _quoted(schema)
        self.schema = schema
        self.lock_key = f"agent-statemachine schema {schema}"
        self.version_table = f"{s}.statemachine_schema"
        runs, events, snapshots = f"{s}.runs", f"{s}.events", f"{s}.snapshots"
        items = f"{s}.session_items"
        self.ddl = (
            f"""CREATE TABLE {runs} (
                run_id     text COLLATE "C" PRIMARY KEY,
                version    bigint NOT NULL CHECK (version >= 0),
                owner      text,
                step       text,
                session_id text COLLATE "C")""",
            f"CREATE INDEX runs_by_session ON {runs} (session_id, step)",
            f"""CREATE TABLE {events} (
                run_id   text COLLATE "C" NOT NULL,
                seq      bigint NOT NULL,
                batch_id text NOT NULL,
                body     text NOT NULL,
                PRIMARY KEY (run_id, seq))""",
            f"CREATE INDEX events_by_batch ON {events} (batch_id)",
            f"""CREATE TABLE {snapshots} (
                run_id  text COLLATE "C" PRIMARY KEY,
                version bigint NOT NULL,
                body    text NOT NULL,
                digest  text NOT NULL)""",
        )
        self.ddl_2 = (  # version 2: PostgresSession's items
            f"""CREATE TABLE {items} (
                id             bigserial PRIMARY KEY,
                session_id     text COLLATE "C" NOT NULL,
                publication_id text COLLATE "C",
                body           text NOT NULL)""",
            f"CREATE INDEX session_items_by_session ON {items} (session_id, id)",
            f"CREATE INDEX session_items_by_publication ON {items} (publication_id) "
            "WHERE publication_id IS NOT NULL",
        )
        one = ("SELECT head.run_id, %(seq)s::bigint, %(batch)s, %(body)s FROM head")
        many = ("SELECT head.run_id, e.seq, %(batch)s, e.body FROM head CROSS JOIN "
                "unnest(%(seqs)s::bigint[], %(bodies)s::text[]) AS e(seq, body)")
        insert = f"INSERT INTO {events} (run_id, seq, batch_id, body) "
        first = (f"WITH head AS (INSERT INTO {runs} (run_id, version, owner, step, "
                 "session_id) VALUES (%(run)s, %(new)s, %(owner)s, %(step)s, %(session)s) "
                 "ON CONFLICT (run_id) DO NOTHING RETURNING run_id) ")
        later = (f"WITH head AS (UPDATE {runs} SET version = %(new)s, step = %(step)s, "
                 "owner = CASE WHEN %(claimed)s THEN %(owner)s::text ELSE owner END "
                 "WHERE run_id = %(run)s AND version = %(expected)s RETURNING run_id) ")
        self.append = {(True, True): first + insert + one, (True, False): first + insert + many,
                       (False, True): later + insert + one, (False, False): later + insert + many}
        self.head_version = f"SELECT version FROM {runs} WHERE run_id = %s"
        self.lock_head = f"SELECT version FROM {runs} WHERE run_id = %s FOR UPDATE"
        self.snapshot = (f"INSERT INTO {snapshots} (run_id, version, body, digest) "
                         "VALUES (%s, %s, %s, %s) ON CONFLICT (run_id) DO UPDATE SET "
                         "version = EXCLUDED.version, body = EXCLUDED.body, "
                         "digest = EXCLUDED.digest")
        # one statement, so one snapshot of the head and the log
        self.load = (f"SELECT -1::bigint, version::text FROM {runs} WHERE run_id = %(run)s "
                     f"UNION ALL SELECT seq, body FROM {events} WHERE run_id = %(run)s "
                     "ORDER BY 1")
        self.load_latest = (
            f"WITH snap AS (SELECT version, body, digest FROM {snapshots} "
            "WHERE run_id = %(run)s) "
            "SELECT -2::bigint, snap.version, snap.body, snap.digest, "
            f"(SELECT count(*) FROM {events} e WHERE e.run_id = %(run)s "
            "AND e.seq IN (0, snap.version - 1)) FROM snap "
            f"UNION ALL SELECT -1, version, NULL, NULL, NULL FROM {runs} "
            "WHERE run_id = %(run)s "
            f"UNION ALL SELECT seq, NULL, body, NULL, NULL FROM {events} "
            "WHERE run_id = %(run)s AND seq >= COALESCE((SELECT version FROM snap), 0) "
            "ORDER BY 1")
        self.heads = f"SELECT run_id, version, step, session_id, owner FROM {runs}"
        self.keep_fold = (f"UPDATE {runs} SET step = %s WHERE run_id = %s AND step IS NULL "
                          "AND version = %s")
        self.run_ids = f"SELECT run_id FROM {runs} WHERE version > 0 ORDER BY run_id"
        self.probe_first = (f"INSERT INTO {runs} (run_id, version) VALUES (%s, 0) "
                            "ON CONFLICT (run_id) DO NOTHING")
        self.probe_later = f"SELECT 1 FROM {runs} WHERE run_id = %s FOR SHARE"
        self.landed = f"SELECT EXISTS (SELECT 1 FROM {events} WHERE batch_id = %s)"
        where = "inet_server_addr()::text, current_setting('port')"
        self.identify = (f"SELECT pid, backend_start, pg_postmaster_start_time(), {where} "
                         "FROM pg_stat_activity WHERE pid = pg_backend_pid()")
        here = f"({where}) IS NOT DISTINCT FROM (%(addr)s, %(port)s)"
        self.fence = (f"SELECT {here}, pg_postmaster_start_time() = %(server)s, (SELECT "
                      "pg_terminate_backend(pid, %(millis)s) FROM pg_stat_activity "
                      "WHERE pid = %(pid)s AND backend_start = %(start)s "
                      f"AND pg_postmaster_start_time() = %(server)s AND {here})")
        # PostgresSession (and an append's session_write=)
        self.add_items = (f"INSERT INTO {items} (session_id, publication_id, body) "
                          "SELECT %(session)s, %(publication)s, t.body FROM "
                          "unnest(%(bodies)s::text[]) WITH ORDINALITY AS t(body, n) "
                          "ORDER BY t.n")
        self.items = f"SELECT body FROM {items} WHERE session_id = %s ORDER BY id"
        self.items_tail = (f"SELECT body FROM (SELECT id, body FROM {items} WHERE "
                           "session_id = %s ORDER BY id DESC LIMIT %s) AS tail ORDER BY id")
        self.pop_item = (f"DELETE FROM {items} WHERE id = (SELECT max(id) FROM {items} "
                         "WHERE session_id = %s) RETURNING body")
        self.clear_session = f"DELETE FROM {items} WHERE session_id = %s"
        self.publication_items = (f"SELECT count(*) FROM {items} WHERE session_id = %s AND "
                                  "publication_id = %s")


def _ensure_schema(sql: _Sql, *, readonly: bool) -> Op[None]:
    """Check the tables' version; create them, or upgrade them from version 1 (adding
    ``session_items``), under an advisory lock, so two processes starting at once do not
    collide. A newer version is refused. A read-only store reads a version 1 schema as it
    is (it writes no Session items)."""
    found = yield _Q("SELECT to_regclass(%s) IS NOT NULL", (sql.version_table,), "one")
    version = None
    if found[0]:
        version = (yield _Q(f"SELECT max(version) FROM {sql.version_table}", None, "one"))[0]
    if version == SCHEMA_VERSION or (readonly and version in _UPGRADABLE):
        return
    _refuse_version(sql, version, readonly=readonly)
    yield _Q("SELECT pg_advisory_xact_lock(hashtext(%s))", (sql.lock_key,))
    exists = yield _Q("SELECT to_regnamespace(%s) IS NOT NULL", (_quoted(sql.schema),), "one")
    if not exists[0]:
        yield _Q(f"CREATE SCHEMA {_quoted(sql.schema)}")
    yield _Q(f"CREATE TABLE IF NOT EXISTS {sql.version_table} (version integer NOT NULL)")
    version = (yield _Q(f"SELECT max(version) FROM {sql.version_table}", None, "one"))[0]
    if version == SCHEMA_VERSION:
        return  # another process created (or upgraded) them first
    _refuse_version(sql, version, readonly=readonly)
    if version is None:
        for statement in (*sql.ddl, *sql.ddl_2):
            yield _Q(statement)
        yield _Q(f"INSERT INTO {sql.version_table} (version) VALUES (%s)", (SCHEMA_VERSION,))
        return
    for statement in sql.ddl_2:  # version 1 → 2
        yield _Q(statement)
    yield _Q(f"UPDATE {sql.version_table} SET version = %s", (SCHEMA_VERSION,))


_UPGRADABLE = frozenset({1})
"""Versions this library upgrades in place (1: before ``session_items``)."""


def _refuse_version(sql: _Sql, version: Any, *, readonly: bool) -> None:
    where = f"schema {sql.schema!r}"
    if type(version) is int and version > SCHEMA_VERSION:
        raise StorageError(f"the event store in {where} has schema version {version}, newer "
                           f"than this library writes ({SCHEMA_VERSION}): upgrade "
                           "agent-statemachine; nothing was written", outcome="not_written")
    if version in _UPGRADABLE and not readonly:
        return
    if version is not None:
        raise StorageError(f"the event store in {where} has an unknown schema version "
                           f"{version}; nothing was written", outcome="not_written")
    if readonly:
        raise StorageError(f"there is no agent-statemachine event store in {where} (it is "
                           "opened read-only, so none is created)", outcome="not_written")


@attrs.frozen
class _Append:
    """One append, prepared before any I/O (encoding and checks cost no lock)."""

    run_id: str
    expected: int
    count: int
    params: dict[str, Any]
    snapshot: tuple[str, int, str, str] | None
    batch_id: str
    items: dict[str, Any] | None = None
    """The ``session_write``'s rows, written in the same transaction."""


def _prepare(run_id: str, events: Sequence[Event], expected_version: int,
             snapshot: Snapshot | None, step: Step | None,
             session_write: SessionWrite | None = None) -> _Append:
    if any(event.seq != expected_version + i for i, event in enumerate(events)):
        raise ValueError("events must carry the sequence numbers that follow "
                         "expected_version")
    items = None
    if session_write is not None:
        if type(session_write) is not SessionWrite:
            raise TypeError("session_write must be a SessionWrite")
        if not events:  # the read-back after a lost COMMIT finds a batch by its events
            raise ValueError("a session_write needs events to carry it")
        items = _session_rows(session_write.session_id, session_write.publication_id,
                              session_write.items)
    batch_id = uuid.uuid4().hex
    bodies = [dumps(codec.encode_event(event)) for event in events]
    kept = None
    if snapshot is not None:
        text = dumps(snapshot)
        kept = (run_id, expected_version, text, digest(text))
    step = step_to_index(run_id, events, step, expected_version)
    claimed, owner = claimed_owner(events)
    params: dict[str, Any] = {
        "run": run_id, "new": expected_version + len(events), "expected": expected_version,
        "step": None if step is None else step.value, "owner": owner, "claimed": claimed,
        "session": started_session(events), "batch": batch_id}
    if len(events) == 1:
        params.update(seq=events[0].seq, body=bodies[0])
    else:
        params.update(seqs=[event.seq for event in events], bodies=bodies)
    return _Append(run_id, expected_version, len(events), params, kept, batch_id, items)


def _session_rows(session_id: str, publication_id: str | None,
                  items: Sequence[JSON]) -> dict[str, Any]:
    """The parameters of ``add_items``'s statement (items as detached JSON text; a value
    that is not plain JSON raises here, before any I/O)."""
    if type(session_id) is not str:
        raise TypeError("session_id must be a str")
    if publication_id is not None and type(publication_id) is not str:
        raise TypeError("publication_id must be a str or None")
    return {"session": session_id, "publication": publication_id,
            "bodies": [dumps(detach(item)) for item in items]}


def _append(sql: _Sql, a: _Append) -> Op[None]:
    """The body of an append's transaction (its driver runs BEGIN and COMMIT)."""
    if a.count:
        statement = sql.append[a.expected == 0, a.count == 1]
        moved = yield _Q(statement, a.params, "rowcount")
        if moved != a.count:
            row = yield _Q(sql.head_version, (a.run_id,), "one")
            raise _lost_race(a.run_id, a.expected, 0 if row is None else row[0])
    else:
        row = yield _Q(sql.lock_head, (a.run_id,), "one")
        version = 0 if row is None else row[0]
        if version != a.expected:
            raise _lost_race(a.run_id, a.expected, version)
    if a.items is not None:
        yield _Q(sql.add_items, a.items)
    if a.snapshot is not None:
        yield _Q(sql.snapshot, a.snapshot)


def _lost_race(run_id: str, expected: int, actual: int) -> ConcurrencyConflict:
    if expected == 0:
        return ConcurrencyConflict(f"a run with this id already exists in the store "
                                   f"(version {actual})", run_id=run_id)
    return conflict(run_id, expected, actual)


def _one_statement(a: _Append) -> bool:
    """Whether the append is one statement, run as its own transaction (autocommit): one
    round trip, no ``BEGIN`` and no ``COMMIT``. A lost race writes no row (the head moves
    in the statement's first part, and the events are inserted only from its answer)."""
    return a.items is None and a.snapshot is None and a.count > 0


def _answered(conn: Any) -> bool:
    """After an error, the connection is still up and idle: the server answered the error
    (the statement's transaction rolled back) or psycopg refused the parameters before
    sending (a NUL in a text); either way nothing of the statement can commit later. (The
    statement returns no rows, so no error can come from reading an answer.)"""
    return (not conn.closed and not conn.broken
            and conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE)


Backend = tuple[int, Any, Any, Any, Any]
"""A connection's server process: its pid and start time (a pid alone may be reused), and
its server: the server's start time, address and port (another server holds no trace of
the process; the same server started again holds none of its processes)."""


def _backend_of(conn: Any, row: Any) -> Backend | None:
    """The server process ``conn`` talks to, when it is the one the server announced at
    connect. Behind a pooler or a proxy that answers for the server they differ (or a
    client may move between server processes): then there is nothing to fence."""
    if row is None or conn.info.backend_pid != row[0]:
        return None
    return (row[0], row[1], row[2], row[3], row[4])


def _fence(sql: _Sql, backend: Backend, timeout: float) -> Op[bool]:
    """End the server process of a lost connection and wait (up to ``timeout``) until it
    is gone. True when it is gone (or already was), or when its server has started again
    since (every process it had is gone); False when the probe reached another server,
    or the process would not end in time. Needs PostgreSQL 14+ (the two-argument
    ``pg_terminate_backend``); on an older server it raises, and the caller does not
    count it as fenced."""
    millis = max(1, math.ceil(timeout * 1000))
    pid, start, server, addr, port = backend
    row = yield _Q(sql.fence, {"addr": addr, "port": port, "server": server,
                               "millis": millis, "pid": pid, "start": start}, "one")
    same_address, same_start, ended = row
    if not same_address:
        return False
    return not same_start or ended is None or bool(ended)


def _probe(sql: _Sql, run_id: str, first: bool, batch_id: str, timeout: float) -> Op[bool]:
    """Did the append of ``batch_id`` land? Run on a fresh connection inside a transaction
    that is rolled back. It first waits for the lock the lost transaction holds on the
    run's head while it is still in progress (its row lock, or its uncommitted head row
    for a run's first append), so the answer is final, not a look at a commit in
    flight."""
    millis = f"{max(1, math.ceil(timeout * 1000))}ms"
    yield _Q("SELECT set_config('lock_timeout', %s, true), "
             "set_config('statement_timeout', %s, true)", (millis, millis))
    yield _Q(sql.probe_first if first else sql.probe_later, (run_id,))
    found = yield _Q(sql.landed, (batch_id,), "one")
    return bool(found[0])


def _split(rows: Rows, width: int) -> tuple[tuple[Any, ...] | None, Any, Rows]:
    """The rows of a load statement → (the snapshot row, the head's version, events)."""
    snap = head = None
    start = 0
    while start < len(rows) and rows[start][0] < 0:
        if rows[start][0] == -2:
            snap = rows[start][1:]
        else:
            head = rows[start][1]
        start += 1
    events = [(row[0], row[2 if width == 5 else 1]) for row in rows[start:]]
    return snap, head, events


def _checked(run_id: str, head: Any, rows: Rows, first: int) -> list[Event]:
    """Decode a log read with its head (``first``: the seq of the first row) and check
    that the log and its head agree: a log shorter than its head was truncated, one
    without a head was not written by this store. Never a silently shorter log."""
    events = decode_rows(run_id, rows, first).events
    if head is None:
        if events:
            raise SchemaError("the stored log has no run head row: the store is damaged",
                              run_id=run_id, action="load")
        return events
    version = int(head)
    if version != first + len(events):
        raise SchemaError(f"the stored log holds {first + len(events)} events but its head "
                          f"says {version}: the store is damaged", run_id=run_id,
                          action="load")
    return events


def _loaded(run_id: str, rows: Rows) -> list[Event]:
    _, head, events = _split(rows, 2)
    return _checked(run_id, head, events, 0)


def _latest(run_id: str, rows: Rows) -> tuple[Snapshot | None, str | None, list[Event]]:
    """(snapshot or None, None, the events after it) from ``load_latest``'s rows; or
    (None, why, []) when its snapshot is unusable: the caller then warns and reads the
    whole log."""
    snap, head, events = _split(rows, 5)
    if snap is None:
        return None, None, _checked(run_id, head, events, 0)
    version, body, digest, present = snap
    snapshot, problem = verified_snapshot(run_id, (version, body, digest))
    if snapshot is not None and present != (1 if version == 1 else 2):
        snapshot, problem = None, (f"its version {version} is past the log (event "
                                   f"{version - 1} or event 0 is missing)")
    if snapshot is not None and (head is None or version > head):
        snapshot, problem = None, f"its version {version} is past the log's head ({head})"
    if snapshot is None:
        return None, problem, []
    return snapshot, None, _checked(run_id, head, events, version)


def _heads(session_id: str | None, wanted: frozenset[Step] | None) -> tuple[str, list[Any]]:
    where: list[str] = ["version > 0"]
    params: list[Any] = []
    if session_id is not None:
        where.append("session_id = %s")
        params.append(session_id)
    if wanted is not None:  # and every unfolded head, which may match once folded
        where.append("(step IS NULL OR step = ANY(%s))")
        params.append([step.value for step in wanted])
    return f" WHERE {' AND '.join(where)} ORDER BY run_id", params


def _head(run_id: str, step: Any) -> Step:
    try:
        return Step(step)
    except ValueError:
        raise SchemaError("the run's head names an unknown step", run_id=run_id,
                          action="list_runs") from None


# ------------------------------------------------------------------------ drivers


def _answer(cursor: psycopg.Cursor[Any], want: str) -> Any:
    if want == "rowcount":
        return cursor.rowcount
    if want == "one":
        return cursor.fetchone()
    if want == "all":
        return cursor.fetchall()
    return None


_PIPELINE = psycopg.Pipeline.is_supported()
"""Whether libpq can pipeline (14+): then an append's BEGIN travels with its first
statement, one round trip fewer."""


def _drive(conn: psycopg.Connection[Any], op: Op[T], *, begin: bool = False) -> T:
    """Run ``op`` on ``conn``; with ``begin``, open a transaction first (pipelined with the
    op's first statement where libpq can)."""
    if begin and not _PIPELINE:
        conn.execute("BEGIN")
        begin = False
    answer: Any = None
    while True:
        try:
            q = op.send(answer)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        if begin:
            begin = False
            with conn.pipeline():
                conn.execute("BEGIN")
                cursor = conn.execute(q.sql, q.params)
        else:
            cursor = conn.execute(q.sql, q.params)
        answer = _answer(cursor, q.want)


async def _adrive(conn: psycopg.AsyncConnection[Any], op: Op[T], *, begin: bool = False) -> T:
    if begin and not _PIPELINE:
        await conn.execute("BEGIN")
        begin = False
    answer: Any = None
    while True:
        try:
            q = op.send(answer)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        if begin:
            begin = False
            async with conn.pipeline():
                await conn.execute("BEGIN")
                cursor = await conn.execute(q.sql, q.params)
        else:
            cursor = await conn.execute(q.sql, q.params)
        if q.want == "rowcount":
            answer = cursor.rowcount
        elif q.want == "one":
            answer = await cursor.fetchone()
        elif q.want == "all":
            answer = await cursor.fetchall()
        else:
            answer = None


_LIVE: weakref.WeakSet[_Base] = weakref.WeakSet()


def _detach_all() -> None:
    """In a forked child: let go of every inherited connection without a word to the
    server (its socket is the parent's). The descriptor is pointed at /dev/null first, so
    whatever libpq sends on closing goes nowhere."""
    for store in list(_LIVE):
        store._detach()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_detach_all)


class _Base:
    """What the sync and the async objects (stores and Sessions) share: configuration
    and the pure steps."""

    _conn: Any
    _noun = "event store"
    _opening = "open the event store"

    def __init__(self, dsn: str, *, schema: str = "statemachine", readonly: bool = False,
                 readback_timeout: float = 10.0) -> None:
        if type(dsn) is not str:
            raise TypeError("dsn must be a str (a libpq connection string or URI)")
        if not readback_timeout > 0:
            raise ValueError("readback_timeout must be > 0 (seconds)")
        self.dsn = dsn
        self.schema = schema
        self.readonly = readonly
        self.readback_timeout = readback_timeout
        self._sql = _Sql(schema)
        self._conn = None
        self._backend: Backend | None = None
        self._ready = False
        self._closed = False
        _LIVE.add(self)

    def _options(self) -> dict[str, Any]:
        options: dict[str, Any] = {"autocommit": True,
                                   "fallback_application_name": "agent-statemachine"}
        if self.readonly:
            options["options"] = "-c default_transaction_read_only=on"
        return options

    def _probe_options(self) -> dict[str, Any]:
        return {"autocommit": True, "connect_timeout": max(2, math.ceil(self.readback_timeout)),
                "fallback_application_name": "agent-statemachine"}

    def _detach(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        with contextlib.suppress(Exception):
            null = os.open(os.devnull, os.O_RDWR)
            try:
                os.dup2(null, conn.fileno())
            finally:
                os.close(null)
        _ORPHANS.append(conn)  # never finalized here: nothing reaches the parent's session

    def _refused_readonly(self, doing: str, run_id: str) -> StorageError:
        return StorageError(f"cannot {doing}: the event store is open read-only; nothing "
                            "was written", outcome="not_written", run_id=run_id)


_ORPHANS: list[Any] = []

_APPEND = "append to the event store"
_LOAD = "load a run"
_LIST = "list the runs of the event store"


class _Sync(_Base):
    """One psycopg connection (autocommit), opened on first use and replaced when it
    broke, serialized by a `threading.Lock`; what the sync store and Session share."""

    def __init__(self, dsn: str, *, schema: str = "statemachine", readonly: bool = False,
                 readback_timeout: float = 10.0) -> None:
        super().__init__(dsn, schema=schema, readonly=readonly,
                         readback_timeout=readback_timeout)
        self._lock = threading.Lock()
        self._pid = os.getpid()

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
        """The store's connection, opened (and the tables checked or created) if there is
        none or the last one broke."""
        if self._closed:
            raise _closed(doing, self._noun, **where)
        if self._pid != os.getpid():  # a forked child: the connection is the parent's
            self._detach()
            self._pid = os.getpid()
        conn = self._conn
        if conn is not None and not conn.closed:
            return conn  # type: ignore[no-any-return]
        self._conn = None
        try:
            conn = psycopg.connect(self.dsn, **self._options())
        except psycopg.Error as error:
            raise _failure(error, doing=doing, outcome="not_written", **where) from error
        try:
            if not self._ready:
                self._transaction(conn, _ensure_schema(self._sql, readonly=self.readonly))
                self._ready = True
            self._backend = _backend_of(conn, conn.execute(self._sql.identify).fetchone())
        except BaseException as error:
            with contextlib.suppress(Exception):
                conn.close()
            if isinstance(error, _BACKEND):
                raise _failure(error, doing=self._opening, outcome="not_written",
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
            result = _drive(conn, op)
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
                return _drive(conn, op)
            except _BACKEND as error:
                self._settle()
                raise _failure(error, doing=doing, outcome="not_written", **where) from error
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
                result = _drive(conn, op, begin=True)
                self._before_commit()
            except _BACKEND as error:
                self._settle()
                raise _failure(error, doing=doing, outcome="not_written", **where) from error
            except BaseException:
                self._settle()
                raise
            try:
                conn.execute("COMMIT")
            except psycopg.Error as error:
                self._drop()
                raise _failure(error, doing=doing, outcome="unknown", **where) from error
            except BaseException:  # interrupted while committing: unknown; never reused
                self._drop()
                raise
        self._after_commit()
        return result

    def _before_commit(self) -> None:
        """A seam for fault injection: runs right before a write's COMMIT."""

    def _after_commit(self) -> None:
        """A seam for fault injection: runs right after a write's COMMIT returned."""


class PostgresEventStore(_Sync):
    """An event store on PostgreSQL (sync; psycopg 3). See the module's docstring.

    ``dsn``: a libpq connection string or URI. ``schema``: where the tables live
    (created on first use). ``readonly=True``: never creates or writes anything (every
    session is ``default_transaction_read_only``; ``append`` is refused, ``list_runs``
    folds unfolded heads without keeping them, a database without the tables is a
    `StorageError`). ``readback_timeout``: how long (seconds) the read-back after a lost
    COMMIT may wait for a lock or a connection before answering ``"unknown"``.
    """

    # ---------------------------------------------------------------- writing

    def append(self, run_id: str, events: Sequence[Event], expected_version: int, *,
               snapshot: Snapshot | None = None, step: Step | None = None,
               session_write: SessionWrite | None = None) -> None:
        """`IndexedStore.append`; with ``session_write``, its items go to its Session (the
        ``session_items`` table `PostgresSession` reads, tagged with its publication id)
        in the same transaction as ``events``: both land or neither does, and a lost
        COMMIT answer is decided for both by reading the batch back."""
        where = {"run_id": run_id}
        if self.readonly:
            raise self._refused_readonly(_APPEND, run_id)
        prepared = _prepare(run_id, events, expected_version, snapshot, step, session_write)
        with self._lock:
            conn = self._live(_APPEND, **where)
            if _one_statement(prepared):
                self._append_one(conn, prepared)
                self._after_commit()
                return
            try:
                _drive(conn, _append(self._sql, prepared), begin=True)
                self._before_commit()
            except ConcurrencyConflict:
                self._settle()
                raise
            except psycopg.errors.UniqueViolation:  # the log is ahead of its head
                self._settle()
                raise _lost_race(run_id, expected_version, expected_version + 1) from None
            except _BACKEND as error:  # before COMMIT: the transaction did not commit
                self._settle()
                raise _failure(error, doing=_APPEND, outcome="not_written",
                               **where) from error
            except BaseException:
                self._settle()
                raise
            try:
                conn.execute("COMMIT")
            except psycopg.Error as error:
                self._classify(error, prepared)
            except BaseException:  # interrupted while committing: unknown; never reused
                self._drop()
                raise
        self._after_commit()

    def _append_one(self, conn: psycopg.Connection[Any], a: _Append) -> None:
        """An append of events alone: one statement, its own transaction."""
        where = {"run_id": a.run_id}
        try:
            self._before_commit()
        except _BACKEND as error:  # nothing was sent
            raise _failure(error, doing=_APPEND, outcome="not_written", **where) from error
        try:
            moved = conn.execute(self._sql.append[a.expected == 0, a.count == 1],
                                 a.params).rowcount
        except psycopg.errors.UniqueViolation:  # the log is ahead of its head
            raise _lost_race(a.run_id, a.expected, a.expected + 1) from None
        except psycopg.Error as error:
            if _answered(conn):
                raise _failure(error, doing=_APPEND, outcome="not_written",
                               **where) from error
            self._classify(error, a)
            return
        except UnicodeEncodeError as error:  # refused while encoding: nothing was sent
            raise _failure(error, doing=_APPEND, outcome="not_written", **where) from error
        except BaseException:  # interrupted in flight: unknown; never reused
            self._drop()
            raise
        if moved != a.count:  # a lost race: the statement wrote nothing
            try:
                row = conn.execute(self._sql.head_version, (a.run_id,)).fetchone()
            except _BACKEND as error:
                self._settle()
                raise _failure(error, doing=_APPEND, outcome="not_written",
                               **where) from error
            raise _lost_race(a.run_id, a.expected, 0 if row is None else row[0])

    def _classify(self, error: psycopg.Error, prepared: _Append) -> None:
        """The connection was lost with a COMMIT in flight: fence and read the batch back
        on a fresh connection. Found: appended (return). Not found: ``"not_written"``.
        Undecidable: ``"unknown"``."""
        where = {"run_id": prepared.run_id}
        backend = self._backend
        self._drop()  # closing it ends whatever is left of the transaction server-side
        try:
            fenced, landed = self._landed(prepared, backend)
        except Exception as probe_error:
            raise _failure(error, doing=_APPEND, outcome="unknown", **where) from probe_error
        if landed:
            return
        decided = fenced or not _one_statement(prepared)
        raise _failure(error, doing=_APPEND, outcome="not_written" if decided else "unknown",
                       **where) from error

    def _landed(self, prepared: _Append, backend: Backend | None) -> tuple[bool, bool]:
        """(fenced, landed): see the module's docstring."""
        with psycopg.connect(self.dsn, **self._probe_options()) as probe:
            fenced = False
            if backend is not None:
                try:
                    fenced = _drive(probe, _fence(self._sql, backend, self.readback_timeout))
                except psycopg.Error:  # not allowed to signal it: the lock wait decides
                    fenced = False
            probe.execute("BEGIN")
            try:
                return fenced, _drive(probe, _probe(
                    self._sql, prepared.run_id, prepared.expected == 0, prepared.batch_id,
                    self.readback_timeout))
            finally:
                with contextlib.suppress(Exception):
                    probe.execute("ROLLBACK")

    # ---------------------------------------------------------------- reading

    def load(self, run_id: str) -> list[Event]:
        rows = self._read(_one(self._sql.load, {"run": run_id}), doing=_LOAD, run_id=run_id)
        return _loaded(run_id, rows)

    def load_latest(self, run_id: str) -> tuple[Snapshot | None, list[Event]]:
        rows = self._read(_one(self._sql.load_latest, {"run": run_id}), doing=_LOAD,
                          run_id=run_id)
        snapshot, problem, tail = _latest(run_id, rows)
        if problem is None:
            return snapshot, tail
        snapshot_ignored(run_id, problem)
        return None, self.load(run_id)

    def list_runs(self, session_id: str | None = None,
                  steps: Collection[Step] | None = None) -> tuple[RunHead, ...]:
        wanted = check_filters(session_id, steps)
        if wanted is not None and not wanted:
            return ()
        tail, params = _heads(session_id, wanted)
        rows = self._read(_one(self._sql.heads + tail, params), doing=_LIST)
        heads = []
        for run_id, stored_version, step, stored_session, owner in rows:
            if step is None:
                version, known, session = self._fold(run_id)
            else:
                version, known, session = stored_version, _head(run_id, step), stored_session
            if wanted is None or known in wanted:
                heads.append(RunHead(run_id, version, known, session, owner))
        return tuple(heads)

    def run_ids(self, limit: int | None = None) -> list[str]:
        """The ids of the runs the store holds, sorted (the first ``limit`` of them)."""
        sql = self._sql.run_ids + ("" if limit is None else f" LIMIT {int(limit)}")
        return [row[0] for row in self._read(_one(sql, None), doing=_LIST)]

    def _fold(self, run_id: str) -> tuple[int, Step, str | None]:
        """Fold an unfolded head from the run's log and keep the step (only if the run has
        not moved meanwhile; never when read-only). Keeping it is a cache: a failure to
        keep it costs a fold next time."""
        snapshot, tail = self.load_latest(run_id)
        version, step, session = head_of_log(run_id, snapshot, tail, lambda: self.load(run_id))
        if not self.readonly:
            with contextlib.suppress(StorageError):
                self._read(_one(self._sql.keep_fold, (step.value, run_id, version), "none"),
                           doing=_LIST, run_id=run_id)
        return version, step, session


def _one(sql: str, params: Any, want: str = "all") -> Op[Any]:
    return (yield _Q(sql, params, want))


class _Async(_Base):
    """`_Sync` for asyncio: one ``psycopg.AsyncConnection``, serialized by an
    `asyncio.Lock` (use an object from one event loop)."""

    def __init__(self, dsn: str, *, schema: str = "statemachine", readonly: bool = False,
                 readback_timeout: float = 10.0) -> None:
        super().__init__(dsn, schema=schema, readonly=readonly,
                         readback_timeout=readback_timeout)
        self._lock = asyncio.Lock()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        async with self._lock:
            self._closed = True
            await self._drop()

    async def _live(self, doing: str, **where: Any) -> psycopg.AsyncConnection[Any]:
        if self._closed:
            raise _closed(doing, self._noun, **where)
        conn = self._conn
        if conn is not None and not conn.closed:
            return conn  # type: ignore[no-any-return]
        self._conn = None
        try:
            conn = await psycopg.AsyncConnection.connect(self.dsn, **self._options())
        except psycopg.Error as error:
            raise _failure(error, doing=doing, outcome="not_written", **where) from error
        try:
            if not self._ready:
                await self._transaction(conn, _ensure_schema(self._sql,
                                                             readonly=self.readonly))
                self._ready = True
            self._backend = _backend_of(
                conn, await (await conn.execute(self._sql.identify)).fetchone())
        except BaseException as error:
            with contextlib.suppress(Exception):
                await conn.close()
            if isinstance(error, _BACKEND):
                raise _failure(error, doing=self._opening, outcome="not_written",
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
            result = await _adrive(conn, op)
        except BaseException:
            with contextlib.suppress(Exception):
                await conn.execute("ROLLBACK")
            raise
        await conn.execute("COMMIT")
        return result

    async def _read(self, op: Op[T], *, doing: str, **where: Any) -> T:
        async with self._lock:
            conn = await self._live(doing, **where)
            try:
                return await _adrive(conn, op)
            except _BACKEND as error:
                await self._settle()
                raise _failure(error, doing=doing, outcome="not_written", **where) from error
            except BaseException:
                await self._settle()
                raise

    async def _write(self, op: Op[T], *, doing: str, **where: Any) -> T:
        """`_Sync._write`, awaited."""
        async with self._lock:
            conn = await self._live(doing, **where)
            try:
                result = await _adrive(conn, op, begin=True)
                await self._before_commit()
            except _BACKEND as error:
                await self._settle()
                raise _failure(error, doing=doing, outcome="not_written", **where) from error
            except BaseException:
                await self._settle()
                raise
            try:
                await conn.execute("COMMIT")
            except psycopg.Error as error:
                await self._drop()
                raise _failure(error, doing=doing, outcome="unknown", **where) from error
            except BaseException:  # cancelled while committing: unknown; never reused
                await self._drop()
                raise
        await self._after_commit()
        return result

    async def _before_commit(self) -> None:
        """A seam for fault injection: runs right before a write's COMMIT."""

    async def _after_commit(self) -> None:
        """A seam for fault injection: runs right after a write's COMMIT returned."""


class AsyncPostgresEventStore(_Async):
    """`PostgresEventStore` for asyncio (`AsyncEventStore`): the same tables, checks and
    failure rules on a ``psycopg.AsyncConnection``; calls on one store are serialized by
    an `asyncio.Lock` (use a store from one event loop)."""

    async def append(self, run_id: str, events: Sequence[Event], expected_version: int, *,
                     snapshot: Snapshot | None = None, step: Step | None = None,
                     session_write: SessionWrite | None = None) -> None:
        """`PostgresEventStore.append`, awaited."""
        where = {"run_id": run_id}
        if self.readonly:
            raise self._refused_readonly(_APPEND, run_id)
        prepared = _prepare(run_id, events, expected_version, snapshot, step, session_write)
        async with self._lock:
            conn = await self._live(_APPEND, **where)
            if _one_statement(prepared):
                await self._append_one(conn, prepared)
                await self._after_commit()
                return
            try:
                await _adrive(conn, _append(self._sql, prepared), begin=True)
                await self._before_commit()
            except ConcurrencyConflict:
                await self._settle()
                raise
            except psycopg.errors.UniqueViolation:
                await self._settle()
                raise _lost_race(run_id, expected_version, expected_version + 1) from None
            except _BACKEND as error:
                await self._settle()
                raise _failure(error, doing=_APPEND, outcome="not_written",
                               **where) from error
            except BaseException:
                await self._settle()
                raise
            try:
                await conn.execute("COMMIT")
            except psycopg.Error as error:
                await self._classify(error, prepared)
            except BaseException:  # cancelled while committing: unknown; never reused
                await self._drop()
                raise
        await self._after_commit()

    async def _append_one(self, conn: psycopg.AsyncConnection[Any], a: _Append) -> None:
        """`PostgresEventStore._append_one`, awaited."""
        where = {"run_id": a.run_id}
        try:
            await self._before_commit()
        except _BACKEND as error:
            raise _failure(error, doing=_APPEND, outcome="not_written", **where) from error
        try:
            cursor = await conn.execute(self._sql.append[a.expected == 0, a.count == 1],
                                        a.params)
            moved = cursor.rowcount
        except psycopg.errors.UniqueViolation:
            raise _lost_race(a.run_id, a.expected, a.expected + 1) from None
        except psycopg.Error as error:
            if _answered(conn):
                raise _failure(error, doing=_APPEND, outcome="not_written",
                               **where) from error
            await self._classify(error, a)
            return
        except UnicodeEncodeError as error:
            raise _failure(error, doing=_APPEND, outcome="not_written", **where) from error
        except BaseException:  # cancelled in flight: unknown; never reused
            await self._drop()
            raise
        if moved != a.count:
            try:
                row = await (await conn.execute(self._sql.head_version,
                                                (a.run_id,))).fetchone()
            except _BACKEND as error:
                await self._settle()
                raise _failure(error, doing=_APPEND, outcome="not_written",
                               **where) from error
            raise _lost_race(a.run_id, a.expected, 0 if row is None else row[0])

    async def _classify(self, error: psycopg.Error, prepared: _Append) -> None:
        where = {"run_id": prepared.run_id}
        backend = self._backend
        await self._drop()
        try:
            fenced, landed = await self._landed(prepared, backend)
        except Exception as probe_error:
            raise _failure(error, doing=_APPEND, outcome="unknown", **where) from probe_error
        if landed:
            return
        decided = fenced or not _one_statement(prepared)
        raise _failure(error, doing=_APPEND, outcome="not_written" if decided else "unknown",
                       **where) from error

    async def _landed(self, prepared: _Append, backend: Backend | None) -> tuple[bool, bool]:
        async with await psycopg.AsyncConnection.connect(
                self.dsn, **self._probe_options()) as probe:
            fenced = False
            if backend is not None:
                try:
                    fenced = await _adrive(probe, _fence(self._sql, backend,
                                                         self.readback_timeout))
                except psycopg.Error:
                    fenced = False
            await probe.execute("BEGIN")
            try:
                return fenced, await _adrive(probe, _probe(
                    self._sql, prepared.run_id, prepared.expected == 0, prepared.batch_id,
                    self.readback_timeout))
            finally:
                with contextlib.suppress(Exception):
                    await probe.execute("ROLLBACK")

    async def load(self, run_id: str) -> list[Event]:
        rows = await self._read(_one(self._sql.load, {"run": run_id}), doing=_LOAD,
                                run_id=run_id)
        return _loaded(run_id, rows)

    async def load_latest(self, run_id: str) -> tuple[Snapshot | None, list[Event]]:
        rows = await self._read(_one(self._sql.load_latest, {"run": run_id}), doing=_LOAD,
                                run_id=run_id)
        snapshot, problem, tail = _latest(run_id, rows)
        if problem is None:
            return snapshot, tail
        snapshot_ignored(run_id, problem)
        return None, await self.load(run_id)

    async def list_runs(self, session_id: str | None = None,
                        steps: Collection[Step] | None = None) -> tuple[RunHead, ...]:
        wanted = check_filters(session_id, steps)
        if wanted is not None and not wanted:
            return ()
        tail, params = _heads(session_id, wanted)
        rows = await self._read(_one(self._sql.heads + tail, params), doing=_LIST)
        heads = []
        for run_id, stored_version, step, stored_session, owner in rows:
            if step is None:
                version, known, session = await self._fold(run_id)
            else:
                version, known, session = stored_version, _head(run_id, step), stored_session
            if wanted is None or known in wanted:
                heads.append(RunHead(run_id, version, known, session, owner))
        return tuple(heads)

    async def run_ids(self, limit: int | None = None) -> list[str]:
        """The ids of the runs the store holds, sorted (the first ``limit`` of them)."""
        sql = self._sql.run_ids + ("" if limit is None else f" LIMIT {int(limit)}")
        return [row[0] for row in await self._read(_one(sql, None), doing=_LIST)]

    async def _fold(self, run_id: str) -> tuple[int, Step, str | None]:
        """As `PostgresEventStore._fold`, from the whole log (an unfolded head is rare:
        only a caller appending without ``step=`` leaves one)."""
        log = await self.load(run_id)
        version, step, session = head_of_log(run_id, None, log, log.copy)
        if not self.readonly:
            with contextlib.suppress(StorageError):
                await self._read(_one(self._sql.keep_fold, (step.value, run_id, version),
                                      "none"), doing=_LIST, run_id=run_id)
        return version, step, session


# ----------------------------------------------------------------------- sessions

_READ = "read the Session"
_ADD = "write to the Session"
_POP = "pop an item from the Session"
_CLEAR = "clear the Session"
_COUNT = "count a publication's items"


def _item(body: Any) -> JSON:
    try:
        return json.loads(body)
    except (ValueError, TypeError, RecursionError):
        raise StorageError("cannot read the Session: it holds a damaged item (not JSON)",
                           outcome="not_written") from None


def _get_items(sql: _Sql, session_id: str, limit: int | None) -> Op[list[JSON]]:
    if limit is None:
        rows = yield _Q(sql.items, (session_id,), "all")
    else:
        rows = yield _Q(sql.items_tail, (session_id, max(int(limit), 0)), "all")
    return [_item(body) for (body,) in rows]


def _add_items(sql: _Sql, rows: dict[str, Any]) -> Op[None]:
    yield _Q(sql.add_items, rows)


def _pop_item(sql: _Sql, session_id: str) -> Op[JSON | None]:
    row = yield _Q(sql.pop_item, (session_id,), "one")
    return None if row is None else _item(row[0])  # damaged: refused, rolled back, kept


def _count(sql: _Sql, session_id: str, publication_id: str) -> Op[int]:
    row = yield _Q(sql.publication_items, (session_id, publication_id), "one")
    return int(row[0])


def _conninfo(dsn: str) -> dict[str, str] | str:
    try:
        return conninfo_to_dict(dsn)  # type: ignore[return-value]
    except psycopg.Error:
        return dsn


def _shares(session: _Base, store: object) -> bool:
    """Whether ``store`` writes to the database and schema ``session`` reads: a PostgreSQL
    store (sync or async), not read-only, on the same schema and a DSN with the same
    parameters (compared as parsed; a DSN spelled with other parameters is another
    database here, which only costs the shared transaction)."""
    if not isinstance(store, PostgresEventStore | AsyncPostgresEventStore) or store.readonly:
        return False
    return store.schema == session.schema and _conninfo(store.dsn) == _conninfo(session.dsn)


def _check_session_id(session_id: object) -> None:
    if type(session_id) is not str:
        raise TypeError("session_id must be a str")


class PostgresSession(_Sync):
    """A Session on PostgreSQL (sync psycopg; DESIGN §6.7): the `Session` protocol, whose
    methods are coroutines, each running its statement on a worker thread
    (`asyncio.to_thread`) so the event loop never waits on the server.

    Items live in ``session_items`` (in the schema named by ``schema=``, created with the
    event store's tables, under the same advisory lock and schema version) as detached
    JSON text, each with the id of the publication that wrote it (``publication_id``, NULL
    for an item written without one), so `publication_items` counts a publication's items
    exactly. ``add_items`` is all or nothing (one transaction).

    Failures are `StorageError`, as the store's: ``"not_written"`` before COMMIT (and for
    every read, and for a damaged item, which ``pop_item`` refuses before removing it),
    ``"unknown"`` when a COMMIT raised (a write's error reaches the runner as the write's
    error: ``publish`` reports it and re-raises it, I6). A broken connection is replaced
    on the next call.

    When the run's event store is a PostgreSQL store on the same database and schema
    (`shares_transaction_with`), ``statemachine.runner.publish`` does not call
    ``add_items``: it hands the batch to the store with the publication's commit event
    (`RunController.publication_committed(session_write=...)`), and both are written in
    one transaction. One Session, one writer (DESIGN §6.4): concurrent ``pop_item`` calls
    on one Session may both answer None for the last item.
    """

    _noun = "Session"
    _opening = "open the Session"

    def __init__(self, dsn: str, session_id: str, *, schema: str = "statemachine") -> None:
        _check_session_id(session_id)
        super().__init__(dsn, schema=schema)
        self.session_id = session_id

    def shares_transaction_with(self, store: object) -> bool:
        """Whether ``store`` (a run's event store) writes into this Session's database and
        schema, so a publication's items can ride in its commit event's transaction."""
        return _shares(self, store)

    async def get_items(self, limit: int | None = None) -> list[JSON]:
        return await asyncio.to_thread(
            self._read, _get_items(self._sql, self.session_id, limit), doing=_READ)

    async def add_items(self, items: list[JSON], *, publication_id: str | None = None
                        ) -> None:
        """Append ``items`` in one transaction, tagged with ``publication_id``."""
        rows = _session_rows(self.session_id, publication_id, items)
        await asyncio.to_thread(self._write, _add_items(self._sql, rows), doing=_ADD)

    async def pop_item(self) -> JSON | None:
        return await asyncio.to_thread(self._write, _pop_item(self._sql, self.session_id),
                                       doing=_POP)

    async def clear_session(self) -> None:
        await asyncio.to_thread(self._write, _one(self._sql.clear_session,
                                                  (self.session_id,), "none"), doing=_CLEAR)

    async def publication_items(self, publication_id: str) -> int:
        """How many of this Session's items the publication ``publication_id`` wrote."""
        return await asyncio.to_thread(
            self._read, _count(self._sql, self.session_id, publication_id), doing=_COUNT)


class AsyncPostgresSession(_Async):
    """`PostgresSession` on a ``psycopg.AsyncConnection`` (use it from one event loop;
    ``await close()``)."""

    _noun = "Session"
    _opening = "open the Session"

    def __init__(self, dsn: str, session_id: str, *, schema: str = "statemachine") -> None:
        _check_session_id(session_id)
        super().__init__(dsn, schema=schema)
        self.session_id = session_id

    def shares_transaction_with(self, store: object) -> bool:
        """As `PostgresSession.shares_transaction_with`."""
        return _shares(self, store)

    async def get_items(self, limit: int | None = None) -> list[JSON]:
        return await self._read(_get_items(self._sql, self.session_id, limit), doing=_READ)

    async def add_items(self, items: list[JSON], *, publication_id: str | None = None
                        ) -> None:
        """Append ``items`` in one transaction, tagged with ``publication_id``."""
        rows = _session_rows(self.session_id, publication_id, items)
        await self._write(_add_items(self._sql, rows), doing=_ADD)

    async def pop_item(self) -> JSON | None:
        return await self._write(_pop_item(self._sql, self.session_id), doing=_POP)

    async def clear_session(self) -> None:
        await self._write(_one(self._sql.clear_session, (self.session_id,), "none"),
                          doing=_CLEAR)

    async def publication_items(self, publication_id: str) -> int:
        """How many of this Session's items the publication ``publication_id`` wrote."""
        return await self._read(_count(self._sql, self.session_id, publication_id),
                                doing=_COUNT)
