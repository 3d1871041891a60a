"""`just bench`: the speed of one guarded command, as ratios against floors measured in
the same run (DESIGN §5). Never a pass/fail timing: machines here are shared and noisy.

For each command, three variants run interleaved on fresh runs, GC on:

* floor: one dict lookup of (step, trigger), one guard call, and one frozen, slotted attrs
  record with the command's fields appended to a list (plus one detach pass of the
  payload, for a command that carries one);
* controller: the real `RunController` command (gate, arguments, guards, record, fold);
* transitions: our declaration in a plain ``transitions.Machine(auto_transitions=False)``
  with the guards as model methods, firing the same trigger.

Then the rows of `bench.suite`: the SQLite store against a bare sqlite3 loop, loading runs
of several lengths (JSON, SQLite replay, SQLite snapshot), the memory of idle runs,
stateful fuzzing throughput, the whole partial-approval scenario and a paused 500-turn
run's round trip (each beside openai-agents when the ``bench`` extra is installed), and
the large rows: staging a 10,000-item batch and loading its document, and recording and
loading a run whose one event is a ~1 MB tool output, each also at twice the size (the
ratio of the times shows the cost is linear: about 2).

Then the rows of `bench.backends`, each only where its backend is available (else
``skipped: <reason>``): the PostgreSQL store against a bare psycopg loop; the seed
scenario on memory, SQLite (per command, buffered, async) and PostgreSQL (per command,
buffered, async), against memory, with store transactions per scenario; the event-loop
lag of 100 concurrent runs on the async stores and the sync SQLite store; and 1, 2 and 4
worker processes on one PostgreSQL. PostgreSQL is ``--pg-dsn`` or STATEMACHINE_PG_DSN,
else a throwaway cluster (``--no-pg`` skips those rows).

Usage: ``python -m bench [--quick] [--json | --markdown] [--runs N] ...`` (``--help``
lists all).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from statemachine import RunController, ToolCall
from statemachine import events as ev
from statemachine.machine import (
    GUARDS,
    GuardAdapter,
    build_transitions_machine,
)
from statemachine.payloads import detach, fingerprint_of
from statemachine.values import GuardrailResult, RecoveryPolicy, Step

Setup = Callable[[int], RunController]


def _fresh(i: int) -> RunController:
    return RunController.start(run_id=f"run-{i}", session_id="s")


def _interrupted(i: int) -> RunController:
    c = _fresh(i)
    c.begin_model_call()
    c.model_responded([ToolCall("a", "t", {"x": 7}, needs_approval=True),
                       ToolCall("b", "t", {}, needs_approval=True)])
    return c


FINGERPRINT = fingerprint_of("t", {"x": 7})
PAYLOAD = {"allowed": True, "score": 0.97, "labels": ["pii", "tone"]}

# name: (setup, step, trigger, the guard the floor calls, the command, the floor's record
# with the command's fields, detaching the payload where the command carries one)
COMMANDS: dict[str, tuple[Setup, Step, str, str, Callable[[RunController], Any],
                          Callable[[int], ev.Event]]] = {
    "begin_model_call": (
        _fresh, Step.RUN_AGAIN, "begin_model_call", "turns_left",
        lambda c: c.begin_model_call(), ev.ModelCallBegun),
    "hook_ran": (
        _fresh, Step.RUN_AGAIN, "hook_ran", "hook_not_repeated",
        lambda c: c.hook_ran("agent_start"), lambda seq: ev.HookRan(seq, "agent_start", None)),
    "approve": (
        _interrupted, Step.INTERRUPTION, "approve", "call_awaits_decision",
        lambda c: c.approve("a"), lambda seq: ev.CallApproved(seq, "a", FINGERPRINT)),
    "guardrail_evaluated": (
        _fresh, Step.RUN_AGAIN, "guardrail_evaluated", "guardrail_not_repeated",
        lambda c: c.guardrail_evaluated("g", PAYLOAD, stage="input"),
        lambda seq: ev.GuardrailEvaluated(
            seq, GuardrailResult("g", "input", None, detach(PAYLOAD)))),
}


def _time(fn: Callable[[Any], Any], subjects: list[Any]) -> float:
    start = time.perf_counter()
    for subject in subjects:
        fn(subject)
    return (time.perf_counter() - start) / len(subjects) * 1e6


def _repeat(name: str, runs: int) -> dict[str, float]:
    """One interleaved sample of each variant, each on its own fresh runs."""
    setup, step, trigger, guard_name, command, make_event = COMMANDS[name]
    check = {(step, trigger): GUARDS[guard_name]}
    controllers = [setup(i) for i in range(runs)]
    states = [setup(i).state for i in range(runs)]
    models = [GuardAdapter(setup(i).state) for i in range(runs)]
    machine = build_transitions_machine(models[0], initial=step)
    for model in models[1:]:
        machine.add_model(model, initial=step.value)
    probe = make_event(len(controllers[0].events))
    logs: list[list[ev.Event]] = [[] for _ in range(runs)]

    def floor(i: int) -> None:
        if not check[(step, trigger)](states[i], probe):
            raise AssertionError
        log = logs[i]
        log.append(make_event(len(log)))

    def transitions_fire(model: Any) -> None:
        if not model.trigger(trigger, event=probe):
            raise AssertionError

    gc.collect()
    return {
        "floor": _time(floor, list(range(runs))),
        "controller": _time(command, controllers),
        "transitions": _time(transitions_fire, models),
    }


def measure(name: str, runs: int, repeats: int) -> dict[str, float]:
    """Medians (µs per command) of ``repeats`` interleaved samples."""
    samples = [_repeat(name, runs) for _ in range(repeats)]
    return {key: statistics.median(s[key] for s in samples) for key in samples[0]}


def measure_store(appends: int, repeats: int) -> dict[str, float]:
    """Appends per second: `SQLiteEventStore` (one event per transaction, encoding
    included) vs a bare sqlite3 loop writing the same rows with the same pragmas."""
    import sqlite3
    import tempfile
    import uuid
    from pathlib import Path

    from statemachine import codec
    from statemachine.stores import SQLiteEventStore

    events: list[ev.Event] = [ev.RunStarted(0, "r", "s", RecoveryPolicy.RECONCILE, None, "json")]
    events += [ev.HookRan(i, "tool_start", f"call-{i}") for i in range(1, appends)]
    rows = [("r", e.seq, uuid.uuid4().hex, json.dumps(codec.encode_event(e))) for e in events]
    ours, bare = [], []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as tmp:
            store = SQLiteEventStore(Path(tmp) / "store.db")
            start = time.perf_counter()
            for e in events:
                store.append("r", (e,), e.seq)
            ours.append(appends / (time.perf_counter() - start))
            store.close()
            conn = sqlite3.connect(Path(tmp) / "bare.db", isolation_level=None)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
            conn.execute("CREATE TABLE events (run_id TEXT NOT NULL, seq INTEGER NOT NULL, "
                         "batch_id TEXT NOT NULL, body TEXT NOT NULL, UNIQUE (run_id, seq))")
            start = time.perf_counter()
            for row in rows:
                conn.execute("BEGIN IMMEDIATE")
                conn.execute("INSERT INTO events VALUES (?, ?, ?, ?)", row)
                conn.execute("COMMIT")
            bare.append(appends / (time.perf_counter() - start))
            conn.close()
    return {"store_per_s": statistics.median(ours), "bare_per_s": statistics.median(bare)}


# Sizes of the full run and of ``--quick``; an option given explicitly wins over both.
FULL: dict[str, Any] = {
    "runs": 3000, "repeats": 7, "appends": 2000, "sizes": [100, 10_000, 100_000],
    "idle_runs": 10_000, "fuzz_examples": 20, "turns": 500, "batch_items": [10_000, 20_000],
    "event_mb": [1.0, 2.0], "pg_appends": 500, "scenarios": 20, "lag_runs": 100,
    "workers": [1, 2, 4], "worker_runs": 20,
}
QUICK: dict[str, Any] = {
    "runs": 500, "repeats": 3, "appends": 300, "sizes": [100, 10_000], "idle_runs": 2000,
    "fuzz_examples": 5, "turns": 100, "batch_items": [2000, 4000], "event_mb": [0.25, 0.5],
    "pg_appends": 150, "scenarios": 5, "lag_runs": 100, "workers": [1, 2, 4],
    "worker_runs": 5,
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--quick", action="store_true",
        help="smaller counts everywhere (about half a minute; for a look, not for the README)")
    add("--runs", type=int, help="fresh runs per repeat (3000; quick 500)")
    add("--repeats", type=int, help="repeats, medians are shown (7; quick 3)")
    add("--json", action="store_true", help="print JSON instead of tables")
    add("--markdown", action="store_true", help="print the README's performance table instead")
    add("--appends", type=int, help="SQLite appends per repeat (2000; quick 300)")
    add("--sizes", type=int, nargs="+", help="log lengths to load (100 10000 100000)")
    add("--idle-runs", type=int, help="runs for the memory row (10000)")
    add("--fuzz-examples", type=int, help="stateful examples for the throughput row (20)")
    add("--turns", type=int, help="turns of the paused run (500)")
    add("--batch-items", type=int, nargs=2, metavar=("N", "M"),
        help="items of the two large batches (10000 20000)")
    add("--event-mb", type=float, nargs=2, metavar=("A", "B"),
        help="MB of the two large events (1 2)")
    add("--pg-dsn", help="the PostgreSQL server of the PostgreSQL rows (default: "
        "STATEMACHINE_PG_DSN, else a throwaway cluster from tests/pg_cluster.py)")
    add("--no-pg", action="store_true", help="skip the PostgreSQL rows")
    add("--pg-appends", type=int, help="PostgreSQL appends per repeat (500; quick 150)")
    add("--scenarios", type=int, help="seed scenarios per store (20; quick 5)")
    add("--lag-runs", type=int, help="concurrent runs of the loop-lag row (100)")
    add("--workers", type=int, nargs="+", help="worker process counts (1 2 4)")
    add("--worker-runs", type=int, help="seed scenarios per worker process (20; quick 5)")
    return parser


def options(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with the sizes not given taken from `FULL` or `QUICK`."""
    args = _parser().parse_args(argv)
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def main(argv: list[str] | None = None) -> int:
    from bench import backends, suite

    args = options(argv)
    rows: list[dict[str, Any]] = []
    for name in COMMANDS:
        m = measure(name, args.runs, args.repeats)
        rows.append({
            "command": name,
            "floor_us": round(m["floor"], 3),
            "controller_us": round(m["controller"], 3),
            "transitions_us": round(m["transitions"], 3),
            "controller_over_floor": round(m["controller"] / m["floor"], 2),
            "transitions_over_controller": round(m["transitions"] / m["controller"], 2),
        })
    store = measure_store(args.appends, max(1, args.repeats // 2))
    report: dict[str, Any] = {
        "machine": {"python": platform.python_version(), "machine": platform.machine(),
                    "processor": platform.processor() or "unknown",
                    "cpus": os.cpu_count()},
        "quick": args.quick,
        "command": rows,
        "sqlite_store": {"store_appends_per_s": round(store["store_per_s"]),
                         "bare_sqlite_per_s": round(store["bare_per_s"]),
                         "store_over_bare": round(store["store_per_s"] / store["bare_per_s"],
                                                  2)},
        "load": suite.measure_load(tuple(args.sizes), max(1, args.repeats // 2)),
        "memory": suite.measure_memory(args.idle_runs),
        "fuzz": suite.measure_fuzz_throughput(args.fuzz_examples),
        "scenario": suite.measure_scenario(max(3, args.repeats)),
        "roundtrip": suite.measure_roundtrip(args.turns, max(1, args.repeats // 2)),
        "large": suite.measure_large(tuple(args.batch_items), tuple(args.event_mb),
                                     max(1, min(3, args.repeats // 2))),
    }
    with backends.postgres(args.pg_dsn, enabled=not args.no_pg) as pg:
        report.update(backends.measure_all(
            pg, pg_appends=args.pg_appends, repeats=max(1, min(3, args.repeats // 2)),
            scenarios=args.scenarios, lag_runs=args.lag_runs, workers=tuple(args.workers),
            worker_runs=args.worker_runs))
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
        return 0
    if args.markdown:
        print(markdown(report))
        return 0
    print_report(report, args)
    return 0


def markdown(report: dict[str, Any]) -> str:
    """The README's performance table, from a `--json` report."""
    m = report["machine"]
    rows = ["| what | measured | target |", "|---|---|---|"]
    for row in report["command"]:
        rows.append(f"| `{row['command']}` | {row['controller_us']:.2f} µs: "
                    f"{row['controller_over_floor']:.2f}x the floor, "
                    f"{row['transitions_over_controller']:.2f}x faster than `transitions` | "
                    "<= 3x floor, >= 2x faster |")
    st = report["sqlite_store"]
    rows.append(f"| SQLite store append | {st['store_appends_per_s']}/s, "
                f"{st['store_over_bare']:.2f}x a bare sqlite3 loop | >= 0.8x |")
    for row in report["load"]:
        rows.append(f"| load {row['events']} events | JSON {row['json_events_per_s']} ev/s, "
                    f"SQLite replay {row['sqlite_replay_events_per_s']} ev/s, snapshot "
                    f"{row['sqlite_snapshot_ms']} ms ({row['sqlite_snapshot_100_calls_ms']} ms "
                    "with a 100-call ledger), a resumed runner attempt "
                    f"{row['resumed_attempt_ms']} ms | >= 100k ev/s; O(1) from a snapshot |")
    mem = report["memory"]
    rows.append(f"| idle run in memory | {mem['bytes_per_run_beyond_payloads']} B beyond "
                "payloads | <= 4 KB |")
    fz = report["fuzz"]
    rows.append(f"| stateful fuzzing | {fz['steps_per_s']} steps/s | more is better |")
    sc = report["scenario"]
    theirs = (f"; openai-agents {sc['openai_agents_ms']} ms ({sc['openai_agents_over_ours']}x)"
              if sc["openai_agents_ms"] is not None else "")
    rows.append(f"| partial-approval scenario | {sc['reference_runner_ms']} ms{theirs} | "
                "<= 1/5 of openai-agents |")
    rt = report["roundtrip"]
    theirs = (f"; openai-agents {rt['openai_agents_load_us_per_item']} µs/item "
              f"({rt['openai_agents_over_ours']}x)"
              if rt["openai_agents_load_us_per_item"] is not None else "")
    rows.append(f"| paused {rt['turns']}-turn run | serialize {rt['serialize_us_per_item']} "
                f"µs/item, load {rt['load_us_per_item']} µs/item{theirs} | load >= 5x faster |")
    lg = report["large"]
    small, big = lg["batch"]
    rows.append(f"| {small['items']}-item batch | stage {small['stage_s']} s "
                f"({small['stage_us_per_item']} µs/item), load its document {small['load_s']} s "
                f"({small['load_us_per_item']} µs/item); {big['items']} items: "
                f"{lg['batch_stage_ratio']}x / {lg['batch_load_ratio']}x the time | linear "
                f"(~{lg['batch_size_ratio']}x) |")
    small, big = lg["event"]
    rows.append(f"| {small['event_bytes'] / 2**20:.2f} MB event | record {small['record_ms']} ms, "
                f"load {small['load_ms']} ms ({small['load_ms_per_mb']} ms/MB); "
                f"{big['event_bytes'] / 2**20:.2f} MB: {lg['event_record_ratio']}x / "
                f"{lg['event_load_ratio']}x the time | linear (~{lg['event_size_ratio']}x) |")
    if "pg_append" in report:
        from bench import backends

        rows += backends.markdown_rows(report)
    pg = report.get("postgres", {})
    server = (f"; PostgreSQL {pg['server']} (fsync={pg['fsync']}, synchronous_commit="
              f"{pg['synchronous_commit']}) on the same machine" if pg.get("available") else "")
    quick = " with `--quick`" if report.get("quick") else ""
    return (f"Measured by `just bench`{quick} on Python {m['python']}, {m['machine']}, "
            f"{m['cpus']} CPUs{server} (a shared machine; medians):\n\n" + "\n".join(rows))


def _mark(ok: bool) -> str:
    return "met" if ok else "MISSED"


def print_report(report: dict[str, Any], args: argparse.Namespace) -> None:
    """The text report."""
    m = report["machine"]
    print(f"just bench on Python {m['python']}, {m['machine']}, {m['cpus']} CPUs; medians")
    print(f"\none guarded command ({args.repeats} x {args.runs} fresh runs); targets: "
          "controller <= 3x floor, transitions >= 2x controller")
    print(f"{'command':<22}{'floor µs':>10}{'ctrl µs':>10}{'trans µs':>10}"
          f"{'ctrl/floor':>12}{'trans/ctrl':>12}")
    for row in report["command"]:
        ok = row["controller_over_floor"] <= 3 and row["transitions_over_controller"] >= 2
        print(f"{row['command']:<22}{row['floor_us']:>10.2f}{row['controller_us']:>10.2f}"
              f"{row['transitions_us']:>10.2f}{row['controller_over_floor']:>12.2f}"
              f"{row['transitions_over_controller']:>12.2f}  {_mark(ok)}")
    st = report["sqlite_store"]
    print(f"\nSQLite store, one event per transaction: {st['store_appends_per_s']}/s vs bare "
          f"sqlite3 {st['bare_sqlite_per_s']}/s = {st['store_over_bare']:.2f}x "
          f"(target >= 0.8x) {_mark(st['store_over_bare'] >= 0.8)}")
    print("\nloading a run (target >= 100k events/s; O(1) in length from a snapshot)")
    print(f"{'events':>8}{'JSON ev/s':>12}{'SQLite replay ev/s':>20}{'snapshot ms':>13}"
          f"{'snapshot ms, 100 calls':>24}{'resumed attempt ms':>20}")
    for row in report["load"]:
        print(f"{row['events']:>8}{row['json_events_per_s']:>12}"
              f"{row['sqlite_replay_events_per_s']:>20}{row['sqlite_snapshot_ms']:>13}"
              f"{row['sqlite_snapshot_100_calls_ms']:>24}{row['resumed_attempt_ms']:>20}")
    mem = report["memory"]
    print(f"\nmemory: {mem['runs']} idle runs, {mem['bytes_per_run']} B each, "
          f"{mem['bytes_per_run_beyond_payloads']} B beyond payloads (target <= 4096) "
          f"{_mark(mem['bytes_per_run_beyond_payloads'] <= 4096)}")
    fz = report["fuzz"]
    print(f"\nstateful fuzzing: {fz['steps']} steps in {fz['examples']} examples, "
          f"{fz['steps_per_s']} steps/s")
    sc = report["scenario"]
    line = f"\npartial-approval scenario: reference runner {sc['reference_runner_ms']} ms"
    if sc["openai_agents_ms"] is not None:
        line += (f", openai-agents {sc['openai_agents_ms']} ms "
                 f"({sc['openai_agents_over_ours']}x; goal >= 5x)")
    else:
        line += " (openai-agents not installed: pip install -e '.[bench]')"
    print(line)
    rt = report["roundtrip"]
    line = (f"paused {rt['turns']}-turn run: serialize {rt['serialize_us_per_item']} µs/item, "
            f"load {rt['load_us_per_item']} µs/item")
    if rt["openai_agents_load_us_per_item"] is not None:
        line += (f"; openai-agents load {rt['openai_agents_load_us_per_item']} µs/item "
                 f"({rt['openai_agents_over_ours']}x; goal >= 5x)")
    print(line)
    _print_large(report["large"])
    if "pg_append" in report:
        from bench import backends

        backends.print_rows(report)


def _print_large(lg: dict[str, Any]) -> None:
    print("\nlarge batches and events (target: linear, the second size's time ~2x the first's)")
    print(f"{'batch items':>12}{'doc MB':>9}{'stage s':>10}{'µs/item':>10}{'load s':>10}"
          f"{'µs/item':>10}")
    for row in lg["batch"]:
        print(f"{row['items']:>12}{row['document_bytes'] / 2**20:>9.2f}{row['stage_s']:>10}"
              f"{row['stage_us_per_item']:>10}{row['load_s']:>10}{row['load_us_per_item']:>10}")
    print(f"  ratio at {lg['batch_size_ratio']}x the items: stage {lg['batch_stage_ratio']}x, "
          f"load {lg['batch_load_ratio']}x")
    print(f"{'event MB':>12}{'record ms':>12}{'ms/MB':>9}{'load ms':>10}{'ms/MB':>9}")
    for row in lg["event"]:
        print(f"{row['event_bytes'] / 2**20:>12.2f}{row['record_ms']:>12}"
              f"{row['record_ms_per_mb']:>9}{row['load_ms']:>10}{row['load_ms_per_mb']:>9}")
    print(f"  ratio at {lg['event_size_ratio']}x the bytes: record "
          f"{lg['event_record_ratio']}x, load {lg['event_load_ratio']}x")


if __name__ == "__main__":
    raise SystemExit(main())
