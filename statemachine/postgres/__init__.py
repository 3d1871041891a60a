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

Failures are typed: no psycopg error escapes a public call, and none carries the DSN's
password: libpq quotes a DSN it cannot parse, so every spelling of the password (as
written, percent-decoded, unquoted) is redacted from a message, and such an error is not
chained as the cause a traceback would print. An error the server answered
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
ever retried. No statement waits for ever for a lock another session holds (the run's
head row, held by another append's transaction): each connection sets ``lock_timeout``
(`LOCK_TIMEOUT`, 5 s, unless the store or Session is told otherwise), past which the
command fails with ``"not_written"``. A broken connection is replaced on the next call,
so after a server restart the command that met it fails and the next one works.

One connection per store object, in autocommit mode (a read is one statement, so one
snapshot; an append of events alone is one statement that is its own transaction: one
round trip; an append with a snapshot or Session items is ``BEGIN`` and its first
statement, pipelined, the others, then ``COMMIT``), serialized by a lock: share a sync
store between threads freely (a ``threading.Lock``), use an async one from one event loop
(an ``asyncio.Lock``), or give each worker its own. A process forked while a store is
open leaves the parent's connection alone (the child opens its own). The async store
group-commits (DESIGN §7.7; ``group_commit=False`` turns it off): the appends waiting
while its connection is busy are written by one writer task in one transaction, each in
a savepoint of its own, so one COMMIT (one WAL flush) carries many runs' appends and one
run's refusal fails only its own; a group of one is the lone append above.

The code: ``aio.py`` holds the async store and Session, written by hand; ``sync.py``
holds the sync ones, generated from it by ``tools/unasync.py`` (never edit it; ``just
lint`` fails while it is stale); ``steps.py`` holds what both run: the statements, each
operation as a generator of statements (sans I/O), the checks of what a load read, the
typed failures, and the Session methods.
"""

from __future__ import annotations

from statemachine.postgres.aio import AsyncPostgresEventStore, AsyncPostgresSession
from statemachine.postgres.steps import LOCK_TIMEOUT, SCHEMA_VERSION, prepare
from statemachine.postgres.sync import PostgresEventStore, PostgresSession
from statemachine.stores import AsyncEventStore, SessionWrite

__all__ = ["LOCK_TIMEOUT", "SCHEMA_VERSION", "AsyncEventStore", "AsyncPostgresEventStore",
           "AsyncPostgresSession", "PostgresEventStore", "PostgresSession", "SessionWrite"]

_prepare = prepare
"""`steps.prepare` under its old name here (``bench/backends.py`` reads it)."""
