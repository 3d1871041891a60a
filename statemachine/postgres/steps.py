"""What the sync and the async PostgreSQL objects share, none of it I/O.

The statements of a schema (`Sql`); each operation as a generator that yields the
`Query`s it needs and is sent their answers (`Op`: creating or upgrading the tables,
an append's transaction body, the fence and the read-back after a lost COMMIT, a Session's
reads and writes), so the async driver (`aio.py`) and the sync one generated from it
(`sync.py`) run the same steps; preparing an append before any I/O (`prepare`); reading a
load's rows back into a checked log; typed failures (`failure`); and the configuration
and the Session methods both faces share (`Base`, `SessionMethods`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import math
import os
import re
import uuid
import weakref
from collections.abc import Callable, Generator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import unquote

import attrs
import psycopg
from psycopg.conninfo import conninfo_to_dict

from statemachine.errors import (
    ConcurrencyConflict,
    ConfigurationError,
    Outcome,
    SchemaError,
    StorageError,
    excerpt,
    lease_held,
)
from statemachine.events import Event, RunClaimed
from statemachine.payloads import JSON, detach, text_problem
from statemachine.stored import (
    Loaded,
    claimed_owner,
    conflict,
    decode_rows,
    digest,
    dumps,
    event_text,
    moved_refusal,
    session_moved,
    started_session,
    to_index,
    verified_snapshot,
)
from statemachine.stores import SessionWrite, session_writes
from statemachine.values import Step

if TYPE_CHECKING:
    from statemachine.blocker import ReadModel
    from statemachine.stores import Snapshot

SCHEMA_VERSION = 5
"""The version of the tables this library writes (``statemachine_schema.version``): 2
adds ``session_items`` (`PostgresSession`); 3 adds ``runs.updated_at`` (the newest
event's ``at``, `RunHead.updated_at`; NULL for the runs already there, whose events carry
no time); 4 adds the run's lease (``runs.lease_owner``, ``lease_until``, ``lease``; NULL
for the runs already there, none of which took one); 5 adds the run's read model
(``runs.read_model``, ``blocker``), every head already there left unfolded, so the first
listing folds it. An older schema is upgraded in place on first use."""

T = TypeVar("T")
Rows = list[tuple[Any, ...]]


# ----------------------------------------------------------------------- failures

_AFTER = {
    Outcome.NOT_WRITTEN: "nothing was written",
    Outcome.UNKNOWN: "the write may or may not have landed; load the run again",
}
_SHOWN = 300


REDACTED = "[password]"
"""What a message shows in place of a DSN's password."""


def dsn_secrets(dsn: str) -> tuple[str, ...]:
    """Every spelling of the password ``dsn`` carries that libpq might echo back (when it
    refuses to parse the DSN, it quotes the offending token, or the whole URI): as
    written, percent-decoded (a URI's), unquoted (a ``key=value`` string's), and as libpq
    parsed it. Read generously, without libpq, so that a DSN libpq cannot parse still
    yields its password: redacting too much only hides a bit of a host name. Longest
    first, so that a spelling inside another is replaced after it."""
    found: set[str] = set()
    scheme = re.match(r"\s*postgres(?:ql)?://", dsn, re.IGNORECASE)
    if scheme is not None:
        rest = dsn[scheme.end():]
        if "@" in rest:  # user:password@host: everything up to the last "@" may be it
            userinfo = rest[:rest.rindex("@")]
            if ":" in userinfo:
                found.add(userinfo[userinfo.index(":") + 1:])
        found.update(m.group(1) for m in re.finditer(r"[?&]password=([^&#]*)", rest))
    for m in re.finditer(r"(?<![A-Za-z_])password\s*=\s*('(?:[^'\\]|\\.)*'?|\S+)", dsn):
        value = m.group(1)
        found.add(value)
        if value.startswith("'"):
            found.add(re.sub(r"\\(.)", r"\1", value[1:-1] if value.endswith("'")
                             and len(value) > 1 else value[1:]))
    found.update([unquote(secret) for secret in found])
    with contextlib.suppress(psycopg.Error):
        found.add(str(conninfo_to_dict(dsn).get("password") or ""))
    found.discard("")
    return tuple(sorted(found, key=len, reverse=True))


def redact(text: str, secrets: Sequence[str]) -> str:
    """``text`` with every one of ``secrets`` replaced by `REDACTED`."""
    for secret in secrets:
        text = text.replace(secret, REDACTED)
    return text


def _reason(error: BaseException, secrets: Sequence[str] = ()) -> str:
    """PostgreSQL's (or libpq's) own words for ``error``: its class, SQLSTATE and primary
    message, never its DETAIL (which may quote row values, so payloads), and never a
    password of ``secrets`` (redacted before the message is cut, so that no part of one
    survives the cut)."""
    name = type(error).__name__
    if isinstance(error, psycopg.Error):
        sqlstate = error.sqlstate
        primary = error.diag.message_primary
        text = primary if primary else (str(error).strip().splitlines() or [""])[0]
        name = f"{name} {sqlstate}" if sqlstate else name
    else:
        text = (str(error).strip().splitlines() or [""])[0]
    text = redact(text, secrets)
    text = "".join(c if c.isprintable() else " " for c in text[:_SHOWN])
    return f"{name}: {text}" if text else name


def failure(error: BaseException, *, doing: str, outcome: Outcome,
            secrets: Sequence[str] = (), **where: Any) -> StorageError:
    """The `StorageError` for a backend error met while ``doing`` something: PostgreSQL's
    own words (`_reason`, without a password of ``secrets``) and what happened to the
    write (``outcome``)."""
    return StorageError(f"cannot {doing}: PostgreSQL {_reason(error, secrets)}; "
                        f"{_AFTER[outcome]}", outcome=outcome, **where)


def closed(doing: str, noun: str, **where: Any) -> StorageError:
    """The `StorageError` of a call on a closed store or Session (``noun``)."""
    return StorageError(f"cannot {doing}: the {noun} is closed; nothing was written",
                        outcome=Outcome.NOT_WRITTEN, **where)


BACKEND_ERRORS = (psycopg.Error, UnicodeEncodeError)
"""What the backend raises: psycopg's errors, and a text psycopg cannot encode (a lone
surrogate; PostgreSQL text also refuses NUL, which psycopg reports as `psycopg.DataError`)."""

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")


def _quoted(name: str) -> str:
    if type(name) is not str or _IDENTIFIER.fullmatch(name) is None:
        raise ConfigurationError(f"schema must be a plain SQL identifier (letters, digits, "
                                 f"_; at most 63), not {excerpt(name)}")
    return f'"{name}"'


# ------------------------------------------------------------------------ queries


@attrs.frozen
class Query:
    """One statement an operation asks its driver to run, and what it wants back:
    ``"rowcount"``, ``"one"`` (a row or None), ``"all"`` (the rows) or ``"none"``."""

    sql: str
    params: Any = None
    want: str = "none"


@attrs.frozen
class Batch:
    """Statements an operation sends together, none of them waiting for the answer of
    another: its driver pipelines them (one round trip where libpq can) and sends back
    their answers as a list, in order. The server still runs them one after another,
    each statement seeing what the ones before it wrote; the first that fails ends the
    batch with its error, and the statements after it are not run."""

    queries: tuple[Query, ...]


UNPREPARED: weakref.WeakSet[Any] = weakref.WeakSet()
"""The connections on which a pipeline failed or was cancelled: nothing is prepared on
them any more. psycopg prepares a statement it has run a few times, and in a pipeline it
counts the statement prepared as soon as it sends the PREPARE; when a statement before it
fails, the server skips that PREPARE, and every later use of the name would fail."""


def prepared(conn: Any) -> bool | None:
    """``prepare=`` for a statement on ``conn``: never on a connection in `UNPREPARED`,
    else psycopg's choice."""
    return False if conn in UNPREPARED else None


Op = Generator[Query | Batch, Any, T]
"""An operation, sans I/O: it yields statements (a `Query`, or a `Batch` of them) and is
sent their answers; the sync and the async store drive the same operations."""


class Sql:
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
                session_id text COLLATE "C",
                updated_at bigint,
                lease_owner text,
                lease_until bigint,
                lease      bigint,
                read_model text,
                blocker    text)""",
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
        self.ddl_3 = (f"ALTER TABLE {runs} ADD COLUMN updated_at bigint",)  # version 3
        self.ddl_4 = (f"ALTER TABLE {runs} ADD COLUMN lease_owner text, "  # version 4
                      "ADD COLUMN lease_until bigint, ADD COLUMN lease bigint",)
        self.ddl_5 = (f"ALTER TABLE {runs} ADD COLUMN read_model text, "  # version 5
                      "ADD COLUMN blocker text",
                      f"UPDATE {runs} SET step = NULL")  # none kept a read model: unfolded
        # Leases are judged by the database's clock (DESIGN §7.2), so the workers' clocks
        # need not agree; clock_timestamp(), not now(): a statement that waited for the
        # head's row lock judges the lease when it gets it.
        now = "(extract(epoch FROM clock_timestamp()) * 1000000)::bigint"
        one = ("SELECT head.run_id, %(seq)s::bigint, %(batch)s, %(body)s FROM head")
        many = ("SELECT head.run_id, e.seq, %(batch)s, e.body FROM head CROSS JOIN "
                "unnest(%(seqs)s::bigint[], %(bodies)b::text[]) AS e(seq, body)")
        insert = f"INSERT INTO {events} (run_id, seq, batch_id, body) "
        first = (f"WITH head AS (INSERT INTO {runs} (run_id, version, owner, step, "
                 "session_id, updated_at, lease_owner, lease_until, lease, read_model, "
                 "blocker) VALUES (%(run)s, %(new)s, %(owner)s, %(step)s, %(session)s, "
                 f"%(at)s, %(holder)s, {now} + %(lease)s::bigint, %(lease)s, %(model)s, "
                 "%(kind)s) "
                 "ON CONFLICT (run_id) DO NOTHING RETURNING run_id) ")
        # A claim takes (or drops) the lease; any other append is the holder's (the
        # expected version says so) and moves its end on. A claim lands only when no
        # other owner's lease is live: ALL() of the claims' owners, where a NULL owner
        # equals no one, so an unnamed claim never passes a live lease.
        later = (f"WITH now AS (SELECT {now} AS us), head AS (UPDATE {runs} SET "
                 "version = %(new)s, step = %(step)s, read_model = %(model)s, "
                 "blocker = %(kind)s, "
                 "owner = CASE WHEN %(claimed)s THEN %(owner)s::text ELSE owner END, "
                 "updated_at = %(at)s, "
                 "lease_owner = CASE WHEN %(claimed)s THEN %(holder)s::text "
                 "ELSE lease_owner END, "
                 "lease = CASE WHEN %(claimed)s THEN %(lease)s::bigint ELSE lease END, "
                 "lease_until = now.us + CASE WHEN %(claimed)s THEN %(lease)s::bigint "
                 "ELSE lease END FROM now "
                 "WHERE run_id = %(run)s AND version = %(expected)s AND (NOT %(claimed)s "
                 "OR lease_until IS NULL OR lease_until <= now.us "
                 "OR lease_owner = ALL(%(owners)s::text[])) RETURNING run_id) ")
        self.append = {(True, True): first + insert + one, (True, False): first + insert + many,
                       (False, True): later + insert + one, (False, False): later + insert + many}
        self.head_version = (f"SELECT version, lease_owner, lease_until FROM {runs} "
                             "WHERE run_id = %s")
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
        self.heads = (f"SELECT run_id, version, step, session_id, owner, updated_at, "
                      f"lease_owner, lease_until, read_model, blocker FROM {runs}")
        """What ``list_runs`` reads; a read-only store on an older schema reads NULL for
        the columns it lacks, and every head unfolded when it keeps no read models
        (`ensure_schema` switches it)."""
        # the fold of the log at this version, whatever the head held (unfolded, or a read
        # model that did not decode); a newer append has moved the version and keeps its own
        self.keep_fold = (f"UPDATE {runs} SET step = %s, read_model = %s, blocker = %s "
                          "WHERE run_id = %s AND version = %s")
        self.run_ids = f"SELECT run_id FROM {runs} WHERE version > 0 ORDER BY run_id"
        self.version = f"SELECT version FROM {runs} WHERE run_id = %s"
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
                          "unnest(%(bodies)b::text[]) WITH ORDINALITY AS t(body, n) "
                          "ORDER BY t.n")
        self.items = f"SELECT body FROM {items} WHERE session_id = %s ORDER BY id"
        # every write of this library's to a Session (an append's checked one, and
        # PostgresSession's own) holds this lock until its transaction ends: a write
        # checking the Session's tail (`SessionWrite.after`) then sees every such write
        # that got its rows' ids before it, committed
        key = items.replace("'", "''")
        self.lock_session = f"SELECT pg_advisory_xact_lock(hashtextextended('{key}:' || %s, 0))"
        # the same locks, of several Sessions in one statement, taken in the array's order
        self.lock_sessions = (f"SELECT count(pg_advisory_xact_lock(hashtextextended('{key}:' "
                              "|| t.s, 0))) FROM (SELECT s FROM unnest(%s::text[]) WITH "
                              "ORDINALITY AS u(s, n) ORDER BY n) AS t")
        self.items_tail = (f"SELECT body FROM (SELECT id, body FROM {items} WHERE "
                           "session_id = %s ORDER BY id DESC LIMIT %s) AS tail ORDER BY id")
        # a checked write (`SessionWrite.after`) in one statement: it adds the items and
        # answers the Session's last %(tail)s items as they were before it (the statement's
        # one snapshot, in which its own rows are not), so that a moved tail refuses it,
        # rolled back with its append
        self.add_items_checked = (f"WITH tail AS (SELECT id, body FROM {items} WHERE "
                                  "session_id = %(session)s ORDER BY id DESC LIMIT %(tail)s), "
                                  f"added AS ({self.add_items}) "
                                  "SELECT body FROM tail ORDER BY id")
        self.pop_item = (f"DELETE FROM {items} WHERE id = (SELECT max(id) FROM {items} "
                         "WHERE session_id = %s) RETURNING body")
        self.clear_session = f"DELETE FROM {items} WHERE session_id = %s"
        self.publication_items = (f"SELECT count(*) FROM {items} WHERE session_id = %s AND "
                                  "publication_id = %s")


def ensure_schema(sql: Sql, *, readonly: bool) -> Op[None]:
    """Check the tables' version; create them, or upgrade them from version 1 (adding
    ``session_items``), under an advisory lock, so two processes starting at once do not
    collide. A newer version is refused. A read-only store reads an older schema as it
    is (it writes no Session items, and reads every run's ``updated_at`` as NULL, which
    is what the upgrade would give it)."""
    found = yield Query("SELECT to_regclass(%s) IS NOT NULL", (sql.version_table,), "one")
    version = None
    if found[0]:
        version = (yield Query(f"SELECT max(version) FROM {sql.version_table}", None, "one"))[0]
    if version == SCHEMA_VERSION:
        return
    if readonly and version in _UPGRADABLE:
        sql.heads = sql.heads.replace(" step,", " NULL::text,").replace(
            "read_model, blocker", "NULL::text, NULL::text")
        if version < 4:
            sql.heads = sql.heads.replace("lease_owner, lease_until",
                                          "NULL::text, NULL::bigint")
        if version < 3:
            sql.heads = sql.heads.replace("updated_at", "NULL::bigint")
        return
    _refuse_version(sql, version, readonly=readonly)
    yield Query("SELECT pg_advisory_xact_lock(hashtext(%s))", (sql.lock_key,))
    exists = yield Query("SELECT to_regnamespace(%s) IS NOT NULL", (_quoted(sql.schema),), "one")
    if not exists[0]:
        yield Query(f"CREATE SCHEMA {_quoted(sql.schema)}")
    yield Query(f"CREATE TABLE IF NOT EXISTS {sql.version_table} (version integer NOT NULL)")
    version = (yield Query(f"SELECT max(version) FROM {sql.version_table}", None, "one"))[0]
    if version == SCHEMA_VERSION:
        return  # another process created (or upgraded) them first
    _refuse_version(sql, version, readonly=readonly)
    if version is None:
        for statement in (*sql.ddl, *sql.ddl_2):  # the version 3 ``runs`` already
            yield Query(statement)
        yield Query(f"INSERT INTO {sql.version_table} (version) VALUES (%s)", (SCHEMA_VERSION,))
        return
    upgrades = {1: (*sql.ddl_2, *sql.ddl_3, *sql.ddl_4, *sql.ddl_5),
                2: (*sql.ddl_3, *sql.ddl_4, *sql.ddl_5), 3: (*sql.ddl_4, *sql.ddl_5),
                4: sql.ddl_5}
    for statement in upgrades[version]:  # version 1 → 2 → 3 → 4 → 5
        yield Query(statement)
    yield Query(f"UPDATE {sql.version_table} SET version = %s", (SCHEMA_VERSION,))


_UPGRADABLE = frozenset({1, 2, 3, 4})
"""Versions this library upgrades in place (1: before ``session_items``; 2: before
``runs.updated_at``; 3: before the leases; 4: before the read models)."""


def _refuse_version(sql: Sql, version: Any, *, readonly: bool) -> None:
    where = f"schema {sql.schema!r}"
    if type(version) is int and version > SCHEMA_VERSION:
        raise StorageError(f"the event store in {where} has schema version {version}, newer "
                           f"than this library writes ({SCHEMA_VERSION}): upgrade "
                           "agent-statemachine; nothing was written", outcome=Outcome.NOT_WRITTEN)
    if version in _UPGRADABLE and not readonly:
        return
    if version is not None:
        raise StorageError(f"the event store in {where} has an unknown schema version "
                           f"{version}; nothing was written", outcome=Outcome.NOT_WRITTEN)
    if readonly:
        raise StorageError(f"there is no agent-statemachine event store in {where} (it is "
                           "opened read-only, so none is created)", outcome=Outcome.NOT_WRITTEN)


@attrs.frozen
class PreparedAppend:
    """One append, prepared before any I/O (encoding and checks cost no lock)."""

    run_id: str
    expected: int
    count: int
    params: dict[str, Any]
    snapshot: tuple[str, int, str, str] | None
    batch_id: str
    items: tuple[dict[str, Any], ...] | None = None
    """The rows of each ``session_write``, in order, written in the same transaction."""
    tails: tuple[SessionWrite | None, ...] = ()
    """For each of ``items``: its write, where its staged tail (`SessionWrite.after`) is
    checked just before its rows; else None."""


def prepare(run_id: str, events: Sequence[Event], expected_version: int,
            snapshot: Snapshot | None, step: Step | None,
            session_write: SessionWrite | tuple[SessionWrite, ...] | None = None,
            read_model: ReadModel | None = None) -> PreparedAppend:
    """One append, prepared before any I/O: checked (`ValueError`, `TypeError`), its
    events and snapshot encoded, its head's fields read off its events."""
    events = tuple(events)  # read once: an iterator would be empty on the next read
    if any(event.seq != expected_version + i for i, event in enumerate(events)):
        raise ValueError("events must carry the sequence numbers that follow "
                         "expected_version")
    items = None
    tails: tuple[SessionWrite | None, ...] = ()
    if session_write is not None:
        writes = session_writes(session_write)
        if not events:  # the read-back after a lost COMMIT finds a batch by its events
            raise ValueError("a session_write needs events to carry it")
        items = tuple(session_rows(write.session_id, write.publication_id, write.items)
                      for write in writes)
        tails = tuple(None if write.after is None else write for write in writes)
    batch_id = uuid.uuid4().hex
    bodies = [event_text(event) for event in events]
    kept = None
    if snapshot is not None:
        text = dumps(snapshot)
        kept = (run_id, expected_version, text, digest(text))
    fold = to_index(run_id, events, step, read_model, expected_version)
    model = None if fold is None else fold[1]
    claimed, owner = claimed_owner(events)
    claims = [event for event in events if type(event) is RunClaimed] if claimed else []
    lease = claims[-1].lease if claims else None
    params: dict[str, Any] = {
        "run": run_id, "new": expected_version + len(events), "expected": expected_version,
        "step": None if fold is None else fold[0].value, "owner": owner, "claimed": claimed,
        "model": None if model is None else model.encode(),
        "kind": None if model is None or model.blocker is None else model.blocker.kind.value,
        "session": started_session(events), "batch": batch_id,
        "at": events[-1].at if events else None,
        "holder": None if lease is None else owner, "lease": lease,
        "owners": [claim.owner for claim in claims]}
    if len(events) == 1:
        params.update(seq=events[0].seq, body=bodies[0])
    else:
        params.update(seqs=[event.seq for event in events], bodies=bodies)
    return PreparedAppend(run_id, expected_version, len(events), params, kept, batch_id, items,
                          tails if any(tails) else ())


def session_rows(session_id: str, publication_id: str | None,
                 items: Sequence[JSON]) -> dict[str, Any]:
    """The parameters of ``add_items``'s statement (items as detached JSON text; a value
    that is not plain JSON raises here, before any I/O)."""
    if type(session_id) is not str:
        raise TypeError("session_id must be a str")
    if publication_id is not None and type(publication_id) is not str:
        raise TypeError("publication_id must be a str or None")
    return {"session": session_id, "publication": publication_id,
            "bodies": [dumps(detach(item)) for item in items]}


def locked_sessions(group: Sequence[PreparedAppend]) -> list[str]:
    """The Sessions whose lock (`Sql.lock_session`) the appends of ``group`` take: those of
    their checked writes, in the order every transaction takes them (sorted), and all of
    them before any run's row, so that no two transactions wait on each other."""
    return sorted({write.session_id for a in group for write in a.tails if write is not None})


def lock_steps(sql: Sql, session_ids: Sequence[str]) -> Op[None]:
    """Take the Sessions' locks (`Sql.lock_session`), in the order given, in one
    statement."""
    yield lock_query(sql, session_ids)


def lock_query(sql: Sql, session_ids: Sequence[str]) -> Query:
    """The statement that takes the Sessions' locks, in the order given."""
    return Query(sql.lock_sessions, (list(session_ids),), "one")


def append_steps(sql: Sql, a: PreparedAppend, *, locked: bool = False) -> Op[None]:
    """The body of an append's transaction (its driver runs BEGIN and COMMIT), its
    statements sent as one `Batch`. The locks of the Sessions it checks come first
    (`locked_sessions`), unless its transaction holds them already (``locked``: a group
    takes them all before its first append). Then the run's own statement, then each
    Session write (a checked one answering the tail it found). The answers are judged
    once all have run: a version the append did not expect first, then each checked
    write's tail in order; either refusal raises, and the driver rolls the whole append
    back (its transaction, or its savepoint in a group). The snapshot, if any, is
    written after that, on its own."""
    batch: list[Query] = []
    sessions = [] if locked else locked_sessions([a])
    if sessions:
        batch.append(lock_query(sql, sessions))
    if a.count:
        batch.append(Query(sql.append[a.expected == 0, a.count == 1], a.params, "rowcount"))
    else:
        batch.append(Query(sql.lock_head, (a.run_id,), "one"))
    head = len(batch) - 1
    checked: list[tuple[SessionWrite, int]] = []
    for position, rows in enumerate(a.items or ()):
        write = a.tails[position] if a.tails else None
        if write is None:
            batch.append(Query(sql.add_items, rows))
        else:  # the Session as the write was staged against, or refused
            assert write.after is not None
            checked.append((write, len(batch)))
            batch.append(Query(sql.add_items_checked,
                               {**rows, "tail": len(write.after) + 1}, "all"))
    answers = yield Batch(tuple(batch))
    if a.count:
        if answers[head] != a.count:
            row = yield Query(sql.head_version, (a.run_id,), "one")
            raise refusal(a, row)
    else:
        version = 0 if answers[head] is None else answers[head][0]
        if version != a.expected:
            raise lost_race(a.run_id, a.expected, version)
    for write, at in checked:
        if session_moved(write, [body for (body,) in answers[at]]):
            raise moved_refusal(write, a.run_id)
    if a.snapshot is not None:  # only once the run's statement moved its head: a stale
        # append must not wait for the snapshot row an append in flight holds
        yield Query(sql.snapshot, a.snapshot)


def refusal(a: PreparedAppend, row: Any) -> ConcurrencyConflict:
    """Why an append's statement moved no head, from the head row read after it
    (version, lease holder, lease end): another version, or, for a claim on the version
    it expected, another owner's live lease (`LeaseHeld`)."""
    if row is not None and row[0] == a.expected and a.params["claimed"] and a.expected:
        return lease_held(row[1], row[2], run_id=a.run_id)
    return lost_race(a.run_id, a.expected, 0 if row is None else row[0])


def lost_race(run_id: str, expected: int, actual: int) -> ConcurrencyConflict:
    if expected == 0:
        return ConcurrencyConflict(f"a run with this id already exists in the store "
                                   f"(version {actual})", run_id=run_id)
    return conflict(run_id, expected, actual)


def one_statement(a: PreparedAppend) -> bool:
    """Whether the append is one statement, run as its own transaction (autocommit): one
    round trip, no ``BEGIN`` and no ``COMMIT``. A lost race writes no row (the head moves
    in the statement's first part, and the events are inserted only from its answer)."""
    return a.items is None and a.snapshot is None and a.count > 0


def answered(conn: Any) -> bool:
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


def backend_of(conn: Any, row: Any) -> Backend | None:
    """The server process ``conn`` talks to, when it is the one the server announced at
    connect. Behind a pooler or a proxy that answers for the server they differ (or a
    client may move between server processes): then there is nothing to fence."""
    if row is None or conn.info.backend_pid != row[0]:
        return None
    return (row[0], row[1], row[2], row[3], row[4])


def fence_steps(sql: Sql, backend: Backend, timeout: float) -> Op[bool]:
    """End the server process of a lost connection and wait (up to ``timeout``) until it
    is gone. True when it is gone (or already was), or when its server has started again
    since (every process it had is gone); False when the probe reached another server,
    or the process would not end in time. Needs PostgreSQL 14+ (the two-argument
    ``pg_terminate_backend``); on an older server it raises, and the caller does not
    count it as fenced."""
    millis = max(1, math.ceil(timeout * 1000))
    pid, start, server, addr, port = backend
    row = yield Query(sql.fence, {"addr": addr, "port": port, "server": server,
                                  "millis": millis, "pid": pid, "start": start}, "one")
    same_address, same_start, ended = row
    if not same_address:
        return False
    return not same_start or ended is None or bool(ended)


def probe_steps(sql: Sql, run_id: str, first: bool, batch_id: str, timeout: float) -> Op[bool]:
    """Did the append of ``batch_id`` land? Run on a fresh connection inside a transaction
    that is rolled back. It first waits for the lock the lost transaction holds on the
    run's head while it is still in progress (its row lock, or its uncommitted head row
    for a run's first append), so the answer is final, not a look at a commit in
    flight."""
    millis = f"{max(1, math.ceil(timeout * 1000))}ms"
    yield Query("SELECT set_config('lock_timeout', %s, true), "
                "set_config('statement_timeout', %s, true)", (millis, millis))
    yield Query(sql.probe_first if first else sql.probe_later, (run_id,))
    found = yield Query(sql.landed, (batch_id,), "one")
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


def _checked(run_id: str, head: Any, rows: Rows, first: int) -> Loaded:
    """Decode a log read with its head (``first``: the seq of the first row) and check
    that the log and its head agree: a log shorter than its head was truncated, one
    without a head was not written by this store. Never a silently shorter log."""
    loaded = decode_rows(run_id, rows, first)
    events = loaded.events
    if head is None:
        if events:
            raise SchemaError("the stored log has no run head row: the store is damaged",
                              run_id=run_id, action="load")
        return loaded
    version = int(head)
    if version != first + len(events):
        raise SchemaError(f"the stored log holds {first + len(events)} events but its head "
                          f"says {version}: the store is damaged", run_id=run_id,
                          action="load")
    return loaded


def loaded_log(run_id: str, rows: Rows) -> Loaded:
    """The whole log from ``Sql.load``'s rows, checked against its head."""
    _, head, events = _split(rows, 2)
    return _checked(run_id, head, events, 0)


def latest_log(run_id: str, rows: Rows) -> tuple[Snapshot | None, str | None, Loaded]:
    """(snapshot or None, None, the events after it) from ``Sql.load_latest``'s rows; or
    (None, why, no events) when its snapshot is unusable: the caller then warns and reads
    the whole log."""
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
        return None, problem, Loaded([])
    return snapshot, None, _checked(run_id, head, events, version)


def heads_query(session_id: str | None, wanted: frozenset[Step] | None) -> tuple[str, list[Any]]:
    """The WHERE clause (and its parameters) of ``list_runs``' statement after `Sql.heads`."""
    where: list[str] = ["version > 0"]
    params: list[Any] = []
    if session_id is not None:
        where.append("session_id = %s")
        params.append(session_id)
    if wanted is not None:  # and every unfolded head, which may match once folded
        where.append("(step IS NULL OR step = ANY(%s))")
        params.append([step.value for step in wanted])
    return f" WHERE {' AND '.join(where)} ORDER BY run_id", params


def heads(sql: Sql, tail: str, params: list[Any]) -> Op[Rows]:
    """``list_runs``' rows. Its statement is chosen when the operation starts, after the
    connection checked the schema (`ensure_schema`): an older one has no ``updated_at``."""
    rows: Rows = yield Query(sql.heads + tail, params, "all")
    return rows


def head_step(run_id: str, step: Any) -> Step:
    """The `Step` a head row names; `SchemaError` for one this library does not know."""
    try:
        return Step(step)
    except ValueError:
        raise SchemaError("the run's head names an unknown step", run_id=run_id,
                          action="list_runs") from None


PIPELINE = psycopg.Pipeline.is_supported()
"""Whether libpq can pipeline (14+): then an append's BEGIN travels with its first
statement, one round trip fewer."""


def one(sql: str, params: Any, want: str = "all") -> Op[Any]:
    """The operation of a single statement (``want``: what it returns, see `Query`)."""
    return (yield Query(sql, params, want))



_LIVE: weakref.WeakSet[Base] = weakref.WeakSet()


def _detach_all() -> None:
    """In a forked child: let go of every inherited connection without a word to the
    server (its socket is the parent's). The descriptor is pointed at /dev/null first, so
    whatever libpq sends on closing goes nowhere."""
    for store in list(_LIVE):
        store._detach()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_detach_all)


LOCK_TIMEOUT = 5.0
"""How long (seconds) a statement waits for a lock another session holds (PostgreSQL's
``lock_timeout``) before it fails: an append waits for a run's head row while another
session's transaction holds it, which an append holds for milliseconds. Past it the
statement is cancelled and the command fails with `StorageError` ``"not_written"``
(the transaction rolled back), instead of waiting as long as the other session likes."""


class Base:
    """What the sync and the async objects (stores and Sessions) share: their
    configuration, the connection options, and letting go of a connection a forked child
    inherited."""

    _conn: Any
    _noun = "event store"
    _opening = "open the event store"

    def __init__(self, dsn: str, *, schema: str = "statemachine", readonly: bool = False,
                 readback_timeout: float = 10.0,
                 lock_timeout: float | None = LOCK_TIMEOUT) -> None:
        if type(dsn) is not str:
            raise TypeError("dsn must be a str (a libpq connection string or URI)")
        if not readback_timeout > 0:
            raise ValueError("readback_timeout must be > 0 (seconds)")
        if lock_timeout is not None and (type(lock_timeout) not in (int, float)
                                         or not 0 < lock_timeout < 2**31 / 1000):
            raise ConfigurationError("lock_timeout must be None or a number of seconds > 0")
        self.lock_timeout = lock_timeout
        self.dsn = dsn
        self._secrets = dsn_secrets(dsn)
        self.schema = schema
        self.readonly = readonly
        self.readback_timeout = readback_timeout
        self._sql = Sql(schema)
        self._conn = None
        self._backend: Backend | None = None
        self._ready = False
        self._closed = False
        self._pid = os.getpid()
        _LIVE.add(self)

    def _failure(self, error: BaseException, *, doing: str, outcome: Outcome, **where: Any
                 ) -> StorageError:
        """`failure`, never quoting this DSN's password."""
        return failure(error, doing=doing, outcome=outcome, secrets=self._secrets, **where)

    def _cause(self, error: BaseException) -> BaseException | None:
        """``error``, to chain a `StorageError` to; None when its text quotes the DSN's
        password (libpq refusing to parse the DSN), so no traceback ever prints it."""
        text = str(error)
        return None if any(secret in text for secret in self._secrets) else error

    def _options(self) -> dict[str, Any]:
        options: dict[str, Any] = {"autocommit": True,
                                   "fallback_application_name": "agent-statemachine"}
        settings = []
        if self.lock_timeout is not None:  # ms: PostgreSQL's unit; 0 would mean "for ever"
            settings.append(f"-c lock_timeout={max(1, math.ceil(self.lock_timeout * 1000))}")
        if self.readonly:
            settings.append("-c default_transaction_read_only=on")
        if settings:
            options["options"] = " ".join(settings)
        return options

    def _probe_options(self) -> dict[str, Any]:
        return {"autocommit": True, "connect_timeout": max(2, math.ceil(self.readback_timeout)),
                "fallback_application_name": "agent-statemachine"}

    def _inherited(self) -> bool:
        """Whether this process forked since the connection was opened (and the fork hook
        did not run, as after a fork from C): the connection is the parent's. Detaches it
        then, so that the caller opens its own."""
        if self._pid == os.getpid():
            return False
        self._detach()
        self._pid = os.getpid()
        return True

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
                            "was written", outcome=Outcome.NOT_WRITTEN, run_id=run_id)


_ORPHANS: list[Any] = []

APPEND = "append to the event store"
LOAD = "load a run"
LIST = "list the runs of the event store"


# ----------------------------------------------------------------------- sessions

READ_SESSION = "read the Session"
_ADD = "write to the Session"
_POP = "pop an item from the Session"
_CLEAR = "clear the Session"
_COUNT = "count a publication's items"


def _item(body: Any) -> JSON:
    try:
        return json.loads(body)
    except (ValueError, TypeError, RecursionError):
        raise StorageError("cannot read the Session: it holds a damaged item (not JSON)",
                           outcome=Outcome.NOT_WRITTEN) from None


def session_items_steps(sql: Sql, session_id: str, limit: int | None) -> Op[list[JSON]]:
    if limit is None:
        rows = yield Query(sql.items, (session_id,), "all")
    else:
        rows = yield Query(sql.items_tail, (session_id, max(int(limit), 0)), "all")
    return [_item(body) for (body,) in rows]


# each write takes the Session's lock first (see `Sql.lock_session`), in one batch with it


def _add_items(sql: Sql, rows: dict[str, Any]) -> Op[None]:
    yield Batch((Query(sql.lock_session, (rows["session"],), "one"),
                 Query(sql.add_items, rows)))


def _pop_item(sql: Sql, session_id: str) -> Op[JSON | None]:
    _, row = yield Batch((Query(sql.lock_session, (session_id,), "one"),
                          Query(sql.pop_item, (session_id,), "one")))
    return None if row is None else _item(row[0])  # damaged: refused, rolled back, kept


def _clear_session(sql: Sql, session_id: str) -> Op[None]:
    yield Batch((Query(sql.lock_session, (session_id,), "one"),
                 Query(sql.clear_session, (session_id,))))


def _count(sql: Sql, session_id: str, publication_id: str) -> Op[int]:
    row = yield Query(sql.publication_items, (session_id, publication_id), "one")
    return int(row[0])


@functools.lru_cache(maxsize=256)
def _conninfo(dsn: str) -> tuple[tuple[str, str], ...] | str:
    """A DSN's settings, to compare two DSNs by (parsed once per DSN: `publish` asks
    `shares_transaction_with` at each publication)."""
    try:
        return tuple(sorted(conninfo_to_dict(dsn).items()))  # type: ignore[arg-type]
    except psycopg.Error:
        return dsn


async def _through(method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Await ``method``'s call: a coroutine's in place (the async Session), a blocking
    one's on a worker thread (the sync Session), so the event loop never waits on the
    server."""
    if inspect.iscoroutinefunction(method):
        return await method(*args, **kwargs)
    return await asyncio.to_thread(method, *args, **kwargs)


class SessionMethods(Base):
    """A Session on PostgreSQL (DESIGN §6.7): the `Session` protocol, whose methods are
    coroutines. `AsyncPostgresSession` awaits psycopg's ``AsyncConnection`` (use it from
    one event loop; ``await close()``); `PostgresSession`, on the sync ``Connection``,
    runs each statement on a worker thread (`asyncio.to_thread`), so the event loop never
    waits on the server.

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
    _read: Callable[..., Any]
    _write: Callable[..., Any]

    def __init__(self, dsn: str, session_id: str, *, schema: str = "statemachine",
                 lock_timeout: float | None = LOCK_TIMEOUT) -> None:
        if type(session_id) is not str:
            raise TypeError("session_id must be a str")
        if (problem := text_problem(session_id)) is not None:  # PostgreSQL refuses a NUL
            raise SchemaError(f"session_id {problem}", action="open the Session")
        super().__init__(dsn, schema=schema, lock_timeout=lock_timeout)
        self.session_id = session_id

    def shares_transaction_with(self, store: object) -> bool:
        """Whether ``store`` (a run's event store) writes into this Session's database and
        schema, so a publication's items can ride in its commit event's transaction: a
        PostgreSQL store (sync or async), not read-only, on the same schema and a DSN
        with the same parameters (compared as parsed; a DSN spelled with other parameters
        is another database here, which only costs the shared transaction)."""
        if not isinstance(store, Base) or isinstance(store, SessionMethods) or store.readonly:
            return False
        return store.schema == self.schema and _conninfo(store.dsn) == _conninfo(self.dsn)

    async def get_items(self, limit: int | None = None) -> list[JSON]:
        items: list[JSON] = await _through(
            self._read, session_items_steps(self._sql, self.session_id, limit), doing=READ_SESSION)
        return items

    async def add_items(self, items: list[JSON], *, publication_id: str | None = None
                        ) -> None:
        """Append ``items`` in one transaction, tagged with ``publication_id``."""
        rows = session_rows(self.session_id, publication_id, items)
        await _through(self._write, _add_items(self._sql, rows), doing=_ADD)

    async def pop_item(self) -> JSON | None:
        item: JSON | None = await _through(
            self._write, _pop_item(self._sql, self.session_id), doing=_POP)
        return item

    async def clear_session(self) -> None:
        await _through(self._write, _clear_session(self._sql, self.session_id),
                       doing=_CLEAR)

    async def publication_items(self, publication_id: str) -> int:
        """How many of this Session's items the publication ``publication_id`` wrote."""
        count: int = await _through(
            self._read, _count(self._sql, self.session_id, publication_id), doing=_COUNT)
        return count
