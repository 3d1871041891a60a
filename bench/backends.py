"""The rows of `just bench` that need a storage backend (DESIGN §5, §6.7), each printed
against a floor measured in the same run, and each run only when its backend is there
(a row that cannot run says ``skipped: <reason>``):

* ``pg_append``: `PostgresEventStore.append`, one event per transaction, against a bare
  psycopg loop writing the same rows into a copy of the same table (``BEGIN``, ``INSERT``,
  ``COMMIT``); beside it the bare loop with the run head's ``UPDATE`` too, the same
  pipelined into one round trip, the client-side cost of preparing an append and the
  server's round-trip time, which is where the time goes;
* ``backend_scenario``: the seed scenario (`bench.suite.partial_approval`: an approval, a
  tool, a Session write that fails after landing, recovery) on the memory store (the
  floor), SQLite per command and buffered, the async SQLite store, PostgreSQL per command
  and buffered, and the async PostgreSQL store: time per scenario, the ratio to memory,
  and store transactions (``append`` calls) per scenario;
* ``loop_lag``: how late a 1 ms heartbeat task wakes (max and p99) while ``runs`` seed
  scenarios proceed concurrently on one event loop, on the async stores and on the sync
  SQLite store (per command and buffered), beside the idle loop's own lateness;
* ``pg_workers``: N worker processes (each its own `PostgresEventStore`) driving
  independent seed scenarios on one PostgreSQL database: runs/s and events/s.

PostgreSQL is ``--pg-dsn`` or STATEMACHINE_PG_DSN when given, else a throwaway cluster
started with ``tests/pg_cluster.py`` (needs the server binaries); every measurement uses
a schema of its own, dropped afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import multiprocessing
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench.suite import partial_approval
from statemachine import codec
from statemachine import events as ev
from statemachine.stores import AsyncSQLiteEventStore, MemoryEventStore, SQLiteEventStore, _dumps
from statemachine.values import RecoveryPolicy, Step

DSN_VARIABLE = "STATEMACHINE_PG_DSN"


# ------------------------------------------------------------------------ PostgreSQL


class Postgres:
    """Where the PostgreSQL rows run: ``dsn`` (None: they are skipped, ``skipped`` says
    why), where it came from, and the server's version and durability settings."""

    def __init__(self, dsn: str | None, source: str, skipped: str | None = None) -> None:
        self.dsn = dsn
        self.source = source
        self.skipped = skipped
        self.settings: dict[str, str] = {}

    def describe(self) -> dict[str, Any]:
        return {"available": self.dsn is not None, "source": self.source,
                "skipped": self.skipped, **self.settings}


@contextlib.contextmanager
def postgres(dsn: str | None = None, *, enabled: bool = True) -> Iterator[Postgres]:
    """The PostgreSQL server of the bench: ``dsn``, else STATEMACHINE_PG_DSN, else a
    throwaway cluster (stopped and removed on exit)."""
    if not enabled:
        yield Postgres(None, "none", "skipped: --no-pg")
        return
    try:
        import psycopg
    except ImportError:
        yield Postgres(None, "none", "skipped: psycopg is not installed "
                       "(pip install -e '.[postgres]')")
        return
    dsn = dsn or os.environ.get(DSN_VARIABLE) or None
    if dsn is not None:
        server = Postgres(dsn, "--pg-dsn / " + DSN_VARIABLE)
        try:
            server.settings = _settings(psycopg, dsn)
        except psycopg.Error as error:
            first = (str(error).strip().splitlines() or [type(error).__name__])[0]
            yield Postgres(None, server.source, f"skipped: cannot connect: {first}")
            return
        yield server
        return
    try:
        from tests import pg_cluster
    except ImportError:
        yield Postgres(None, "none", "skipped: no PostgreSQL server: tests/pg_cluster.py is "
                       f"not importable (run from the repository root) and {DSN_VARIABLE} "
                       "is unset")
        return
    try:
        cluster = pg_cluster.start_cluster()
    except pg_cluster.NoServer as reason:
        yield Postgres(None, "none", f"skipped: no PostgreSQL server: {reason}")
        return
    try:
        server = Postgres(cluster.dsn, "a throwaway cluster (tests/pg_cluster.py)")
        server.settings = _settings(psycopg, cluster.dsn)
        yield server
    finally:
        cluster.stop()


def _settings(psycopg: Any, dsn: str) -> dict[str, str]:
    with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
        found = {name: conn.execute(f"SHOW {name}").fetchone()[0]
                 for name in ("server_version", "fsync", "synchronous_commit")}
    return {"server": found["server_version"].split()[0], "fsync": found["fsync"],
            "synchronous_commit": found["synchronous_commit"]}


@contextlib.contextmanager
def _schema(dsn: str) -> Iterator[str]:
    """A fresh schema for one measurement, dropped afterwards."""
    import psycopg

    name = f"bench_{uuid.uuid4().hex[:16]}"
    try:
        yield name
    finally:
        with contextlib.suppress(psycopg.Error), \
                psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


# ------------------------------------------------------------- a) PostgreSQL appends


def measure_pg_append(dsn: str, appends: int, repeats: int) -> dict[str, Any]:
    """Appends per second, one event per transaction: `PostgresEventStore` (encoding and
    the run head included, as a controller appends: with ``step=``) against bare psycopg
    loops on a connection with the store's settings (autocommit, explicit ``BEGIN``)
    writing the same rows into a copy of the store's ``events`` table (its primary key
    and index included): the event row alone, and with the run head's ``UPDATE`` too
    (also pipelined into one round trip). Medians of ``repeats`` interleaved rounds.

    Where the time goes: an append of events alone is one statement that is its own
    transaction (one round trip, the server's WAL flush included); each store append is
    split at its fault-injection seams into the part before sending (preparing: encoding
    and ids, also measured apart, and taking the connection) and that round trip; the
    bare loop's ``BEGIN``, ``INSERT`` and ``COMMIT`` are timed each."""
    import psycopg

    from statemachine.postgres import PostgresEventStore, _prepare

    class Timed(PostgresEventStore):
        before: float = 0.0
        after: float = 0.0

        def _before_commit(self) -> None:
            self.before = time.perf_counter()

        def _after_commit(self) -> None:
            self.after = time.perf_counter()

    events: list[ev.Event] = [ev.RunStarted(0, "r", "s", RecoveryPolicy.RECONCILE, None,
                                            "json")]
    events += [ev.HookRan(i, "tool_start", f"call-{i}") for i in range(1, appends)]
    bodies = [_dumps(codec.encode_event(e)) for e in events]
    rounds: dict[str, list[float]] = {"store": [], "bare": [], "bare_head": [],
                                      "bare_head_pipelined": []}
    split: dict[str, list[float]] = {"store_before_send": [], "store_round_trip": [],
                                     "bare_begin": [], "bare_insert": [], "bare_commit": []}
    with _schema(dsn) as schema, Timed(dsn, schema=schema) as store, \
            psycopg.connect(dsn, autocommit=True) as conn:
        store.load("warm-up")  # connects and creates the tables
        s = f'"{schema}"'
        conn.execute(f"CREATE TABLE {s}.bare (LIKE {s}.events INCLUDING ALL)")
        conn.execute(f"CREATE TABLE {s}.bare_runs (LIKE {s}.runs INCLUDING ALL)")
        insert = f"INSERT INTO {s}.bare (run_id, seq, batch_id, body) VALUES (%s, %s, %s, %s)"
        head = f"UPDATE {s}.bare_runs SET version = %s, step = %s WHERE run_id = %s"
        clock = time.perf_counter
        for r in range(repeats):
            run_id = f"r{r}"
            gc.collect()
            statement = commit = 0.0
            began = clock()
            for e in events:
                t0 = clock()
                store.append(run_id, (e,), e.seq, step=Step.RUN_AGAIN)
                statement += store.before - t0
                commit += store.after - store.before
            rounds["store"].append(appends / (clock() - began))
            split["store_before_send"].append(statement / appends)
            split["store_round_trip"].append(commit / appends)

            rows = [(f"b{r}", e.seq, uuid.uuid4().hex, body)
                    for e, body in zip(events, bodies, strict=True)]
            steps = [0.0, 0.0, 0.0]
            began = clock()
            for row in rows:
                t0 = clock()
                conn.execute("BEGIN")
                t1 = clock()
                conn.execute(insert, row)
                t2 = clock()
                conn.execute("COMMIT")
                t3 = clock()
                steps[0] += t1 - t0
                steps[1] += t2 - t1
                steps[2] += t3 - t2
            rounds["bare"].append(appends / (clock() - began))
            for name, total in zip(("bare_begin", "bare_insert", "bare_commit"), steps,
                                   strict=True):
                split[name].append(total / appends)

            for name, pipelined in (("bare_head", False), ("bare_head_pipelined", True)):
                bare_id = f"{name}{r}"
                conn.execute(f"INSERT INTO {s}.bare_runs (run_id, version) VALUES (%s, 0)",
                             (bare_id,))
                rows = [(bare_id, e.seq, uuid.uuid4().hex, body)
                        for e, body in zip(events, bodies, strict=True)]
                began = clock()
                for row in rows:
                    if pipelined:
                        with conn.pipeline():
                            _bare_append(conn, head, insert, row)
                    else:
                        _bare_append(conn, head, insert, row)
                rounds[name].append(appends / (clock() - began))
        prepare = _per_call_us(lambda: [_prepare("p", (e,), e.seq, None, Step.RUN_AGAIN)
                                        for e in events], appends)
        rtt = _per_call_us(lambda: [conn.execute("SELECT 1") for _ in range(200)], 200)
    rate = {name: statistics.median(values) for name, values in rounds.items()}
    us = {name: round(statistics.median(values) * 1e6, 1) for name, values in split.items()}
    return {
        "appends": appends,
        "store_appends_per_s": round(rate["store"]),
        "bare_psycopg_per_s": round(rate["bare"]),
        "bare_with_head_per_s": round(rate["bare_head"]),
        "bare_with_head_pipelined_per_s": round(rate["bare_head_pipelined"]),
        "store_over_bare": round(rate["store"] / rate["bare"], 2),
        "store_over_bare_with_head": round(rate["store"] / rate["bare_head"], 2),
        "store_over_pipelined": round(rate["store"] / rate["bare_head_pipelined"], 2),
        "store_us_per_append": round(1e6 / rate["store"], 1),
        "bare_us_per_append": round(1e6 / rate["bare"], 1),
        "where": {
            "store_prepare_us": round(prepare, 1),
            "store_before_send_us": us["store_before_send"],
            "store_round_trip_us": us["store_round_trip"],
            "bare_begin_us": us["bare_begin"],
            "bare_insert_us": us["bare_insert"],
            "bare_commit_us": us["bare_commit"],
            "select_1_round_trip_us": round(rtt, 1),
        },
    }


def _bare_append(conn: Any, head: str, insert: str, row: tuple[Any, ...]) -> None:
    conn.execute("BEGIN")
    conn.execute(head, (row[1] + 1, Step.RUN_AGAIN.value, row[0]))
    conn.execute(insert, row)
    conn.execute("COMMIT")


def _per_call_us(fn: Callable[[], Any], calls: int, repeats: int = 3) -> float:
    samples = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - began) / calls * 1e6)
    return statistics.median(samples)


# ------------------------------------------------ b) the seed scenario on every store


def count_appends(store: Any) -> list[int]:
    """Count ``store``'s append calls (transactions) from now on: ``[count]``, updated in
    place. The store's class is left alone (a controller asks the class what kind of
    store it is)."""
    counter = [0]
    original = store.append
    if inspect.iscoroutinefunction(original):
        async def append_async(*args: Any, **kwargs: Any) -> None:
            counter[0] += 1
            await original(*args, **kwargs)

        store.append = append_async
    else:
        def append(*args: Any, **kwargs: Any) -> None:
            counter[0] += 1
            original(*args, **kwargs)

        store.append = append
    return counter


Opener = Callable[[], Any]
"""Opens a store (called on the event loop that will use it)."""


async def _close(store: Any) -> None:
    close = getattr(store, "close", None)
    if callable(close):
        closing = close()
        if inspect.isawaitable(closing):
            await closing


async def _scenarios(openers: list[tuple[Opener, bool]], scenarios: int
                     ) -> list[dict[str, float]]:
    """``scenarios`` rounds, each one seed scenario on every store in turn (so a noisy
    moment of a shared machine falls on all of them alike), on one event loop."""
    stores: list[Any] = []
    try:
        for opener, _ in openers:
            stores.append(opener())
        tag = uuid.uuid4().hex[:8]
        for k, (store, (_, buffered)) in enumerate(zip(stores, openers, strict=True)):
            await partial_approval(store, run_id=f"warm-{tag}-{k}",
                                   session_id=f"warm-{tag}-{k}", buffered=buffered)
        counters = [count_appends(store) for store in stores]
        samples: list[list[float]] = [[] for _ in stores]
        events = [0] * len(stores)
        gc.collect()
        for i in range(scenarios):
            for k, (store, (_, buffered)) in enumerate(zip(stores, openers, strict=True)):
                began = time.perf_counter()
                events[k] += await partial_approval(store, run_id=f"{tag}-{k}-{i}",
                                                    session_id=f"s-{tag}-{k}-{i}",
                                                    buffered=buffered)
                samples[k].append(time.perf_counter() - began)
    finally:
        for store in stores:
            await _close(store)
    return [{"ms": statistics.median(times) * 1e3, "transactions": counter[0] / scenarios,
             "events": count / scenarios}
            for times, counter, count in zip(samples, counters, events, strict=True)]


def _backends(tmp: Path, dsn: str | None, schema: str | None
              ) -> list[tuple[str, Opener | None, bool, str | None]]:
    """(name, opener or None when skipped, buffered, why skipped)."""
    rows: list[tuple[str, Opener | None, bool, str | None]] = [
        ("memory", MemoryEventStore, False, None),
        ("SQLite per command", lambda: SQLiteEventStore(tmp / "per-command.db"), False, None),
        ("SQLite buffered", lambda: SQLiteEventStore(tmp / "buffered.db"), True, None),
        ("SQLite async", lambda: AsyncSQLiteEventStore(tmp / "async.db"), True, None),
    ]
    if dsn is None or schema is None:
        return [*rows, *((name, None, buffered, "no PostgreSQL") for name, buffered in
                         (("PostgreSQL per command", False), ("PostgreSQL buffered", True),
                          ("PostgreSQL async", True)))]
    from statemachine.postgres import AsyncPostgresEventStore, PostgresEventStore

    return [*rows,
            ("PostgreSQL per command", lambda: PostgresEventStore(dsn, schema=schema),
             False, None),
            ("PostgreSQL buffered", lambda: PostgresEventStore(dsn, schema=schema), True,
             None),
            ("PostgreSQL async", lambda: AsyncPostgresEventStore(dsn, schema=schema), True,
             None)]


def measure_backend_scenario(scenarios: int, pg: Postgres) -> list[dict[str, Any]]:
    """The seed scenario on every store, interleaved: median ms per scenario, the ratio
    to the memory store's, store transactions (append calls) and events per scenario."""
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        schema = None if pg.dsn is None else stack.enter_context(_schema(pg.dsn))
        wanted = _backends(Path(tmp), pg.dsn, schema)
        openers = [(opener, buffered) for _, opener, buffered, _ in wanted
                   if opener is not None]
        measured = iter(asyncio.run(_scenarios(openers, scenarios)))
    rows: list[dict[str, Any]] = []
    for name, opener, buffered, _ in wanted:
        if opener is None:
            rows.append({"store": name, "buffered": buffered, "skipped": pg.skipped})
            continue
        m = next(measured)
        rows.append({"store": name, "buffered": buffered, "ms": round(m["ms"], 3),
                     "transactions": round(m["transactions"], 1),
                     "events": round(m["events"], 1)})
    floor = rows[0]["ms"]
    for row in rows:
        if "ms" in row:
            row["over_memory"] = round(row["ms"] / floor, 2)
    return rows


# ---------------------------------------------------------------- c) event-loop lag


async def _heartbeat(lateness: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        began = time.perf_counter()
        await asyncio.sleep(0.001)
        lateness.append(time.perf_counter() - began - 0.001)


def _lag_figures(lateness: list[float]) -> dict[str, Any]:
    if not lateness:
        return {"heartbeats": 0, "max_ms": None, "p99_ms": None}
    p99 = (statistics.quantiles(lateness, n=100, method="inclusive")[98]
           if len(lateness) > 1 else lateness[0])
    return {"heartbeats": len(lateness), "max_ms": round(max(lateness) * 1e3, 2),
            "p99_ms": round(p99 * 1e3, 2)}


async def _idle_lag(seconds: float) -> dict[str, Any]:
    lateness: list[float] = []
    stop = asyncio.Event()
    beat = asyncio.create_task(_heartbeat(lateness, stop))
    await asyncio.sleep(seconds)
    stop.set()
    await beat
    return _lag_figures(lateness)


async def _lag(open_store: Opener, runs: int, buffered: bool) -> dict[str, Any]:
    store = open_store()
    try:
        lateness: list[float] = []
        stop = asyncio.Event()
        beat = asyncio.create_task(_heartbeat(lateness, stop))
        await asyncio.sleep(0.01)
        lateness.clear()
        tag = uuid.uuid4().hex[:8]
        began = time.perf_counter()
        await asyncio.gather(*(partial_approval(store, run_id=f"lag-{tag}-{i}",
                                                session_id=f"s-{tag}-{i}", buffered=buffered)
                               for i in range(runs)))
        wall = time.perf_counter() - began
        stop.set()
        await beat
    finally:
        await _close(store)
    return {**_lag_figures(lateness), "wall_s": round(wall, 3)}


def measure_loop_lag(runs: int, pg: Postgres) -> dict[str, Any]:
    """The lateness of a 1 ms heartbeat task while ``runs`` seed scenarios proceed
    concurrently on one event loop, per store; the idle loop's own lateness first."""
    rows: list[dict[str, Any]] = []
    idle = asyncio.run(_idle_lag(0.3))
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        root = Path(tmp)
        schema = None if pg.dsn is None else stack.enter_context(_schema(pg.dsn))
        wanted: list[tuple[str, Opener | None, bool]] = [
            ("memory (no I/O)", MemoryEventStore, False),
            ("SQLite async", lambda: AsyncSQLiteEventStore(root / "async.db"), True),
            ("SQLite sync, per command", lambda: SQLiteEventStore(root / "sync.db"), False),
            ("SQLite sync, buffered", lambda: SQLiteEventStore(root / "buffered.db"), True),
        ]
        if pg.dsn is not None and schema is not None:
            from statemachine.postgres import AsyncPostgresEventStore

            dsn = pg.dsn
            wanted.append(("PostgreSQL async",
                           lambda: AsyncPostgresEventStore(dsn, schema=schema), True))
        else:
            wanted.append(("PostgreSQL async", None, True))
        for name, opener, buffered in wanted:
            if opener is None:
                rows.append({"store": name, "skipped": pg.skipped})
                continue
            gc.collect()
            rows.append({"store": name, **asyncio.run(_lag(opener, runs, buffered))})
    return {"runs": runs, "idle": idle, "rows": rows}


# ------------------------------------------------------- d) workers on one PostgreSQL


def _worker(dsn: str, schema: str, worker: int, runs: int, buffered: bool,
            ready: Any, answers: Any) -> None:
    """One worker process: its own store; after the barrier, ``runs`` seed scenarios."""
    try:
        from statemachine.postgres import PostgresEventStore

        store = PostgresEventStore(dsn, schema=schema)
        store.load("warm-up")

        async def run_seeds() -> int:
            events = 0
            for i in range(runs):
                events += await partial_approval(store, run_id=f"w{worker}-{i}",
                                                 session_id=f"s{worker}-{i}",
                                                 buffered=buffered)
            return events

        ready.wait(timeout=120)
        began = time.perf_counter()
        events = asyncio.run(run_seeds())
        answers.put((events, time.perf_counter() - began))
        store.close()
    except BaseException as error:  # reported to the parent, never swallowed
        answers.put((None, f"{type(error).__name__}: {error}"))


def _workers_once(dsn: str, schema: str, workers: int, runs: int,
                  buffered: bool) -> dict[str, Any]:
    methods = multiprocessing.get_all_start_methods()
    context: Any = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    ready = context.Barrier(workers + 1)
    answers = context.Queue()
    processes = [context.Process(target=_worker, args=(dsn, schema, w, runs, buffered,
                                                       ready, answers), daemon=True)
                 for w in range(workers)]
    for p in processes:
        p.start()
    ready.wait(timeout=120)
    found = [answers.get(timeout=600) for _ in processes]
    for p in processes:
        p.join(timeout=60)
    failed = [str(answer[1]) for answer in found if answer[0] is None]
    if failed:
        raise RuntimeError(f"a bench worker failed: {failed[0]}")
    wall = max(float(answer[1]) for answer in found)
    events = sum(int(answer[0]) for answer in found)
    return {"workers": workers, "runs": workers * runs,
            "runs_per_s": round(workers * runs / wall, 1),
            "events_per_s": round(events / wall)}


def measure_pg_workers(dsn: str, counts: tuple[int, ...], runs: int) -> dict[str, Any]:
    """N worker processes, each with its own `PostgresEventStore`, each driving ``runs``
    seed scenarios (independent runs) on one database; per command and buffered. The
    rate is all runs over the slowest worker's time; ``scaling``: over one worker's."""
    rows: dict[str, list[dict[str, Any]]] = {}
    for mode, buffered in (("per_command", False), ("buffered", True)):
        found = []
        for workers in counts:
            with _schema(dsn) as schema:
                from statemachine.postgres import PostgresEventStore

                with PostgresEventStore(dsn, schema=schema) as store:
                    store.load("warm-up")  # the tables exist before the workers start
                found.append(_workers_once(dsn, schema, workers, runs, buffered))
        base = found[0]["runs_per_s"] / found[0]["workers"]
        for row in found:
            row["scaling"] = round(row["runs_per_s"] / base, 2) if base else 0.0
        rows[mode] = found
    return {"runs_per_worker": runs, "cpus": os.cpu_count(), **rows}


# ----------------------------------------------------------------------- all of them


def measure_all(pg: Postgres, *, pg_appends: int, repeats: int, scenarios: int,
                lag_runs: int, workers: tuple[int, ...], worker_runs: int) -> dict[str, Any]:
    def skipped() -> dict[str, Any]:
        return {"skipped": pg.skipped}

    report: dict[str, Any] = {"postgres": pg.describe()}
    report["pg_append"] = (skipped() if pg.dsn is None
                           else measure_pg_append(pg.dsn, pg_appends, repeats))
    report["backend_scenario"] = measure_backend_scenario(scenarios, pg)
    report["loop_lag"] = measure_loop_lag(lag_runs, pg)
    report["pg_workers"] = (skipped() if pg.dsn is None
                            else measure_pg_workers(pg.dsn, workers, worker_runs))
    return report


# ----------------------------------------------------------------------- reporting


def _mark(ok: bool) -> str:
    return "met" if ok else "MISSED"


def print_rows(report: dict[str, Any]) -> None:
    """The text of the backend rows."""
    say = print
    pg = report["postgres"]
    where = (f"PostgreSQL {pg.get('server')} from {pg['source']} (fsync={pg.get('fsync')}, "
             f"synchronous_commit={pg.get('synchronous_commit')})" if pg["available"]
             else f"PostgreSQL rows {pg['skipped']}")
    say(f"\nbackends; {where}")
    a = report["pg_append"]
    if "skipped" in a:
        say(f"PostgreSQL store append: {a['skipped']}")
    else:
        say(f"PostgreSQL store, one event per transaction ({a['appends']} appends): "
            f"{a['store_appends_per_s']}/s vs bare psycopg BEGIN/INSERT/COMMIT "
            f"{a['bare_psycopg_per_s']}/s = {a['store_over_bare']:.2f}x (target >= 0.8x) "
            f"{_mark(a['store_over_bare'] >= 0.8)}")
        say(f"  bare with the head UPDATE {a['bare_with_head_per_s']}/s "
            f"({a['store_over_bare_with_head']:.2f}x), the same pipelined in one round trip "
            f"{a['bare_with_head_pipelined_per_s']}/s ({a['store_over_pipelined']:.2f}x)")
        w = a["where"]
        say(f"  where the time goes, µs per append: store {a['store_us_per_append']} = "
            f"before sending {w['store_before_send_us']} (of which preparing "
            f"{w['store_prepare_us']}) + the one round trip {w['store_round_trip_us']}; bare "
            f"{a['bare_us_per_append']} = BEGIN {w['bare_begin_us']} + INSERT "
            f"{w['bare_insert_us']} + COMMIT {w['bare_commit_us']}; an idle round trip "
            f"(SELECT 1) {w['select_1_round_trip_us']}")
    say("\nthe seed scenario per store (approval, tool, a failed Session write, recovery); "
        "goal: SQLite buffered <= 5x memory")
    say(f"{'store':<24}{'ms':>9}{'x memory':>10}{'transactions':>14}{'events':>8}")
    for row in report["backend_scenario"]:
        if "skipped" in row:
            say(f"{row['store']:<24}  {row['skipped']}")
            continue
        mark = (f"  {_mark(row['over_memory'] <= 5)}" if row["store"] == "SQLite buffered"
                else "")
        say(f"{row['store']:<24}{row['ms']:>9.2f}{row['over_memory']:>10.2f}"
            f"{row['transactions']:>14}{row['events']:>8}{mark}")
    lag = report["loop_lag"]
    idle = lag["idle"]
    say(f"\nevent-loop lag: a 1 ms heartbeat's lateness while {lag['runs']} seed scenarios "
        f"run concurrently (idle loop: max {idle['max_ms']} ms, p99 {idle['p99_ms']} ms)")
    say(f"{'store':<28}{'max ms':>9}{'p99 ms':>9}{'beats':>7}{'wall s':>9}")
    for row in lag["rows"]:
        if "skipped" in row:
            say(f"{row['store']:<28}  {row['skipped']}")
            continue
        say(f"{row['store']:<28}{row['max_ms']:>9}{row['p99_ms']:>9}{row['heartbeats']:>7}"
            f"{row['wall_s']:>9}")
    w = report["pg_workers"]
    if "skipped" in w:
        say(f"\nPostgreSQL worker processes: {w['skipped']}")
        return
    say(f"\nworker processes on one PostgreSQL ({w['runs_per_worker']} seed scenarios each, "
        f"{w['cpus']} CPUs shared with the server)")
    say(f"{'mode':<14}{'workers':>8}{'runs/s':>9}{'events/s':>10}{'scaling':>9}")
    for mode in ("per_command", "buffered"):
        for row in w[mode]:
            say(f"{mode.replace('_', ' '):<14}{row['workers']:>8}{row['runs_per_s']:>9}"
                f"{row['events_per_s']:>10}{row['scaling']:>9}")


def markdown_rows(report: dict[str, Any]) -> list[str]:
    """The README table's rows for the backends."""
    rows = []
    a = report["pg_append"]
    if "skipped" in a:
        rows.append(f"| PostgreSQL store append | {a['skipped']} | >= 0.8x |")
    else:
        rows.append(f"| PostgreSQL store append | {a['store_appends_per_s']}/s, "
                    f"{a['store_over_bare']:.2f}x a bare psycopg loop "
                    f"({a['store_over_bare_with_head']:.2f}x one that also updates the head) "
                    "| >= 0.8x |")
    for row in report["backend_scenario"]:
        target = "<= 5x memory" if row["store"] == "SQLite buffered" else "the floor" \
            if row["store"] == "memory" else "-"
        if "skipped" in row:
            rows.append(f"| seed scenario, {row['store']} | {row['skipped']} | {target} |")
            continue
        rows.append(f"| seed scenario, {row['store']} | {row['ms']:.2f} ms, "
                    f"{row['over_memory']:.2f}x memory, {row['transactions']} transactions "
                    f"| {target} |")
    lag = report["loop_lag"]
    idle = lag["idle"]
    for row in lag["rows"]:
        what = f"| loop lag, {lag['runs']} concurrent runs, {row['store']} |"
        if "skipped" in row:
            rows.append(f"{what} {row['skipped']} | - |")
            continue
        target = "near the idle loop" if "async" in row["store"] else "-"
        rows.append(f"{what} max {row['max_ms']} ms, p99 {row['p99_ms']} ms (idle loop: "
                    f"max {idle['max_ms']}, p99 {idle['p99_ms']}) | {target} |")
    w = report["pg_workers"]
    if "skipped" in w:
        rows.append(f"| PostgreSQL worker processes | {w['skipped']} | more is better |")
        return rows
    for mode in ("per_command", "buffered"):
        cells = ", ".join(f"{row['workers']}: {row['runs_per_s']} runs/s "
                          f"({row['events_per_s']} ev/s)" for row in w[mode])
        rows.append(f"| PostgreSQL workers, {mode.replace('_', ' ')} | {cells} | "
                    "more is better |")
    return rows
