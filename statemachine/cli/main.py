"""The ``statemachine`` command: render the machine, inspect and replay runs, explore
the invariants, and play the demo. Errors are one line on stderr and exit status 2.

The read-only commands (``inspect``, ``replay``, ``render FILE|--store``) never create
or change a file: a store is opened with SQLite's ``mode=ro`` (see `read_store_log`)."""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn
from urllib.parse import quote

from statemachine.cli.common import SHOWN, UserError, shown
from statemachine.values import Action, Phase, RecoveryPolicy

if TYPE_CHECKING:
    from statemachine.controller import RunController
    from statemachine.errors import ControlError
    from statemachine.events import Event
    from statemachine.testing import World
    from statemachine.testing.explore import ExploreReport


# ----------------------------------------------------------------- loading runs


def _add_source(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", nargs="?", type=Path, metavar="FILE",
                        help="a run's JSON file (what RunController.to_json() returns), "
                             "UTF-8")
    parser.add_argument("--store", type=Path, metavar="DB",
                        help="a SQLite event store file (opened read-only, never changed)")
    parser.add_argument("--run", dest="run_id", metavar="ID",
                        help="the run's id in the --store file")


def _read_file(path: Path) -> str:
    """A run's JSON file as text; `UserError` for every way that fails."""
    where = shown(path)
    try:
        data = path.read_bytes()
    except IsADirectoryError:
        raise UserError(f"cannot read {where}: it is a directory, not a run's JSON "
                        "file") from None
    except FileNotFoundError:
        raise UserError(f"cannot read {where}: no such file") from None
    except OSError as error:
        raise UserError(f"cannot read {where}: {error.strerror or error}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise UserError(f"cannot read {where}: not UTF-8 text (byte {error.start} is "
                        f"{data[error.start]:#04x}); a run's JSON file is UTF-8") from None


_SIDE_FILES = ("-wal", "-shm", "-journal")


def _side_files(name: str) -> list[str]:
    return [name + suffix for suffix in _SIDE_FILES if os.path.lexists(name + suffix)]


def _identity(name: str) -> tuple[int, int, int, int]:
    st = os.stat(name)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _query_store(name: str, run_id: str | None, *,
                 immutable: bool) -> tuple[list[str], list[tuple[Any, Any]]]:
    """(up to six run ids, the rows of ``run_id``) from a connection that cannot write."""
    uri = "file:" + quote(os.fsencode(os.path.abspath(name))) + "?mode=ro"
    conn = sqlite3.connect(uri + ("&immutable=1" if immutable else ""), uri=True,
                           timeout=5.0)
    try:
        tables = {row[0] for row in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table'")}
        columns = {row[1] for row in conn.execute("PRAGMA table_info(events)")}
        if "events" not in tables or not {"run_id", "seq", "body"} <= columns:
            what = "an empty file" if os.path.getsize(name) == 0 else "a SQLite database"
            raise UserError(f"{shown(name)} is not an agent-statemachine event store: "
                            f"it is {what} without the store's events table")
        runs = [row[0] for row in conn.execute(
            "SELECT DISTINCT run_id FROM events ORDER BY run_id LIMIT 6")]
        rows = [] if run_id is None else conn.execute(
            "SELECT seq, body FROM events WHERE run_id = ? ORDER BY seq",
            (run_id,)).fetchall()
        return runs, rows
    finally:
        conn.close()


def read_store_log(path: Path, run_id: str | None) -> tuple[list[str], list[Event]]:
    """Read a SQLite event store without creating or changing any file: (up to six of its
    run ids, the log of ``run_id``, empty when it has no such run).

    The connection is SQLite's ``mode=ro``. A WAL database at rest (no ``-wal``, ``-shm``
    or ``-journal`` beside it) is read as ``immutable``, because a read-only connection
    would otherwise leave a ``-wal`` and a ``-shm`` behind that it may not delete; if the
    file or its side files moved during that read (a writer came), it is read again
    through SQLite's locks. Refuses, as `UserError`, a missing path, a directory, a file
    that is not a SQLite database or lacks the store's ``events`` table, and a damaged
    database.

    Stopgap until `SQLiteEventStore` opens read-only itself: this reads the store's
    ``events`` table directly and decodes the rows as the store does."""
    from statemachine import codec

    name, where = os.fspath(path), shown(path)
    if not os.path.lexists(name):
        raise UserError(f"no such store file: {where}")
    if os.path.isdir(name):
        raise UserError(f"{where} is a directory, not an event store file")
    try:
        before = _identity(name)
        if not _side_files(name):
            runs, rows = _query_store(name, run_id, immutable=True)
            if _side_files(name) or _identity(name) != before:
                runs, rows = _query_store(name, run_id, immutable=False)
        else:
            runs, rows = _query_store(name, run_id, immutable=False)
    except sqlite3.DatabaseError as error:
        reason = shown(error, 120)
        if "not a database" in reason:
            raise UserError(f"{where} is not a SQLite database, so not an "
                            "agent-statemachine event store") from None
        if "malformed" in reason or "corrupt" in reason:
            raise UserError(f"{where} is a damaged SQLite database ({reason})") from None
        raise UserError(f"cannot read the store {where}: {reason}") from None
    except OSError as error:
        raise UserError(f"cannot read the store {where}: {error.strerror or error}") from None
    return runs, [codec.decode_stored_event(codec.parse(body), seq) for seq, body in rows]


def _load(args: argparse.Namespace) -> RunController:
    from statemachine.controller import RunController
    from statemachine.stores import MemoryEventStore

    if args.store is not None:
        if args.file is not None:
            raise UserError("give either FILE, or --store DB with --run ID, not both")
        runs, events = read_store_log(args.store, args.run_id)
        if args.run_id is None or not events:
            some = ", ".join(repr(shown(r, 60)) for r in runs[:5])
            holds = (f"it holds {some}{', ...' if len(runs) > 5 else ''}" if runs
                     else "it holds no run")
            if args.run_id is None:
                raise UserError(f"--store needs --run ID ({holds})")
            raise UserError(f"no run {shown(args.run_id)!r} in {shown(args.store)} ({holds})")
        # the log is replayed in memory: nothing this command does can reach the file
        memory = MemoryEventStore()
        memory.append(args.run_id, events, 0)
        return RunController.load(memory, args.run_id)
    if args.run_id is not None:
        raise UserError("--run needs --store DB (a FILE holds one run)")
    if args.file is None:
        raise UserError("give a run's JSON file, or --store DB with --run ID")
    return RunController.from_json(_read_file(args.file))


def _out_dir(path: Path, option: str) -> Path:
    """An existing or newly created directory; `UserError` otherwise."""
    where = shown(path)
    if path.exists() and not path.is_dir():
        raise UserError(f"{option} {where} is a file, not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UserError(f"cannot create {option} {where}: {error.strerror or error}") from None
    return path


# ------------------------------------------------------------------- inspect


def verdict(c: RunController) -> str:
    """One sentence: can the run resume, and what may the operator do."""
    from statemachine.values import Step

    action = c.next_action()
    if action is Action.NOT_RESUMABLE:
        if c.step is Step.COMPLETED:
            return "The run is completed: there is nothing to resume."
        if c.step is Step.UNSETTLED:
            return ("Cannot resume: a fail-closed publication is unsettled (the side effect "
                    "completed and the write's outcome is unknown); repair the Session and "
                    "start a new run, or abandon this one.")
        return "Cannot resume: the run is terminal and never resumes; start a new run."
    if action is Action.RESOLVE_IN_DOUBT:
        return (f"Blocked: call {shown(c.in_doubt()[0])!r} was started and never completed, "
                "so it is never re-run; an operator records its outcome (resolve_in_doubt) "
                "or abandons the run.")
    if action is Action.RECONCILE:
        return ("Resumable: a write's outcome is unknown; the next attempt reconciles with "
                "the Session (append if nothing landed, acknowledge if it did) and completed "
                "tools are never re-run.")
    if action is Action.AWAIT_DECISIONS:
        waiting = ", ".join(shown(a) for a in c.pending_approvals)
        return f"Resumable: waiting for decisions on {waiting}."
    return f"Resumable: the runner's next action is {action.value}."


def call_status(phase: Phase, *, rejected: bool, resolved: bool, in_doubt: bool,
                idempotent: bool, publishing: bool = False) -> str:
    """A ledger row in words. ``publishing``: the unsettled envelope publishes it."""
    if phase is Phase.STARTED:
        if in_doubt:
            return "started, outcome unknown: in doubt, never re-run automatically"
        if idempotent:
            return "started, outcome unknown: idempotent, so it may run again"
        return "started, outcome unknown"
    unpublished = ("its publication unsettled" if publishing else "not yet published")
    if rejected:
        return ("rejected, the rejection published" if phase is Phase.PUBLISHED
                else f"rejected, {unpublished}")
    done = "resolved by an operator" if resolved else "completed"
    return {
        Phase.AWAITING: "awaiting a decision",
        Phase.APPROVED: "approved, not started",
        Phase.REJECTED: f"rejected, {unpublished}",
        Phase.SKIPPED: "skipped: overtaken before it started, never runs",
        Phase.COMPLETED: f"{done}, result cached, {unpublished}",
        Phase.PUBLISHED: f"{done}, result published",
    }[phase]


def describe(c: RunController) -> dict[str, Any]:
    from statemachine import events as ev

    envelope = c.envelope
    rejected: set[str] = set()
    resolved: set[str] = set()
    for event in c.events:
        if isinstance(event, ev.CallRejected):
            rejected.add(event.call_id)
        elif isinstance(event, ev.InDoubtResolved):
            resolved.add(event.call_id)
    ledger = []
    in_doubt = set(c.in_doubt())
    publishing = set() if envelope is None else set(envelope.call_ids)
    for view in c.calls:
        call_id = view.call.call_id
        facts = {"rejected": call_id in rejected, "resolved": call_id in resolved,
                 "in_doubt": call_id in in_doubt, "idempotent": view.call.idempotent}
        ledger.append({
            "call_id": call_id, "tool": view.call.name, "phase": view.phase.value,
            "status": call_status(view.phase, **facts, publishing=call_id in publishing),
            "starts": view.starts, "ran": view.starts > 0,
            "cached": view.phase in (Phase.COMPLETED, Phase.REJECTED, Phase.PUBLISHED),
            "in_doubt": facts["in_doubt"], "idempotent": facts["idempotent"],
            "rejected": facts["rejected"],
            "outcome_unknown": view.phase is Phase.STARTED,
            "resolved_by_operator": facts["resolved"],
        })
    return {
        "run_id": c.run_id,
        "step": c.step.value,
        "policy": c.policy.value,
        "session_id": c.session_id,
        "has_session": c.session_id is not None,
        "events": c.version,
        "pending_approvals": list(c.pending_approvals),
        "envelope": None if envelope is None else {
            "session_id": envelope.session_id,
            "frontier_items": len(envelope.frontier),
            "read_limit": envelope.read_limit,
            "batch_items": len(envelope.items),
            "publishes_calls": list(envelope.call_ids),
            "continuation": envelope.continuation.value,
            "pending_guardrail_results": len(envelope.guardrails),
            "fail_closed": envelope.fail_closed,
        },
        "published_guardrail_results": len(c.guardrail_results),
        "pending_guardrail_results": len(c.pending_guardrail_results),
        "ledger": ledger,
        "next_action": c.next_action().value,
        "verdict": verdict(c),
    }


def inspect_command(args: argparse.Namespace) -> int:
    info = describe(_load(args))
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    session = (f"session {shown(info['session_id'])}" if info["has_session"]
               else "no Session")
    print(f"run {shown(info['run_id'])}: step {info['step'].upper()}, policy "
          f"{info['policy']}, {session}, {info['events']} events")
    print("pending approvals: "
          f"{', '.join(shown(a) for a in info['pending_approvals']) or 'none'}")
    env = info["envelope"]
    if env is None:
        print("envelope: none (nothing unsettled)")
    else:
        publishes = ", ".join(shown(c) for c in env["publishes_calls"])
        print(f"envelope: session {shown(env['session_id'])}, frontier "
              f"{env['frontier_items']} item(s) (read_limit {env['read_limit']}), batch "
              f"{env['batch_items']} item(s) publishing {publishes or 'no call results'}, "
              f"continuation {env['continuation'].upper()}, "
              f"{env['pending_guardrail_results']} pending guardrail result(s)"
              f"{', FAIL-CLOSED' if env['fail_closed'] else ''}")
    print(f"guardrail results: {info['published_guardrail_results']} published, "
          f"{info['pending_guardrail_results']} pending")
    print("ledger:" if info["ledger"] else "ledger: no tool calls")
    for call in info["ledger"]:
        notes = [call["status"]]
        if call["in_doubt"]:
            notes.append("IN DOUBT")
        if call["idempotent"] and call["phase"] != Phase.STARTED.value:
            notes.append("idempotent")
        if call["starts"] > 1:
            notes.append(f"started {call['starts']} times")
        print(f"  {shown(call['call_id']):<16} {shown(call['tool']):<14} {'; '.join(notes)}")
    print(f"verdict: {info['verdict']}")
    return 0


# -------------------------------------------------------------- replay, render


def replay_command(args: argparse.Namespace) -> int:
    c = _load(args)
    print(f"ok: {c.version} events replayed, every transition legal; step "
          f"{c.step.name}")
    return 0


def _safe_name(run_id: str) -> str:
    """A run id as part of a file name: no separators, no control characters, bounded."""
    return "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in run_id[:100])


def render_command(args: argparse.Namespace) -> int:
    from statemachine import diagrams

    if args.file is None and args.store is None:
        if args.run_id is not None:
            raise UserError("--run needs --store DB")
        out = _out_dir(args.out or Path("diagrams"), "--out")
        written = diagrams.write_project_diagrams(out)
    else:
        c = _load(args)
        taken = diagrams.run_path(c.events)
        out = _out_dir(args.out or Path("."), "--out")
        written = diagrams.write(out, basename=f"run-{_safe_name(c.run_id)}", path=taken)
    for path in written:
        print(f"wrote {shown(path, 400)}")
    if not any(path.suffix == ".svg" for path in written):
        print("skipped the SVG: Graphviz's dot program is not installed (the .dot file "
              "is the same graph; install Graphviz and render again to get the SVG)")
    return 0


# ------------------------------------------------------------------- explore


def _worlds() -> dict[str, Callable[[], World]]:
    from statemachine.testing import ReferenceWorld, RemoteWorld

    return {
        "reference": ReferenceWorld,
        "reference-fail-closed": lambda: ReferenceWorld(RecoveryPolicy.FAIL_CLOSED),
        "remote": RemoteWorld,
    }


def explore_verdict(name: str, report: ExploreReport, *, depth: int,
                    max_states: int) -> list[str]:
    """What one world's exploration found, in words."""
    took = f"{report.transitions} transitions, {report.seconds:.1f}s"
    if report.counterexample is not None:
        lines = [f"{name}: COUNTEREXAMPLE: {len(report.counterexample)} step(s) from the "
                 f"start break an invariant ({report.states} states, {took})",
                 f"  violation: {shown(report.violation, 400)}", "  trace:"]
        lines += [f"    {i}. {shown(' '.join(map(str, action)), 400)}"
                  for i, action in enumerate(report.counterexample, 1)]
        return lines
    if report.states >= max_states:
        return [f"{name}: no counterexample to I1-I12 in the first {report.states} states, "
                f"but --max-states {max_states} cut the search short at depth "
                f"{report.depth} of {depth}: states beyond them were not checked "
                f"({took})"]
    deepest = ("" if report.depth >= depth else
               f"; no state is deeper than {report.depth}, so this is every state")
    return [f"{name}: no counterexample to I1-I12 in {report.states} states up to depth "
            f"{depth} ({took}{deepest})"]


def explore_command(args: argparse.Namespace) -> int:
    from statemachine.testing import explore

    worlds = _worlds()
    names = list(worlds) if args.world == "all" else [args.world]
    status = 0
    for name in names:
        report = explore(worlds[name], depth=args.depth, max_states=args.max_states)
        if report.counterexample is not None:
            status = 1
        for line in explore_verdict(name, report, depth=args.depth,
                                    max_states=args.max_states):
            print(line, flush=True)
    return status


def demo_command(args: argparse.Namespace) -> int:
    from statemachine.cli.demo import run_demo

    return run_demo(args.dir)


# ---------------------------------------------------------------------- main


class _Parser(argparse.ArgumentParser):
    """Usage mistakes are one line on stderr and exit status 2, like every failure."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {shown(message, 300)} "
                     f"(see {self.prog} --help)\n")


def _count(least: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{shown(text, 40)!r} is not a whole number") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be {least} or more, not {value}")
        return value

    parse.__name__ = "number"
    return parse


DESCRIPTION = (
    "Render the run-step machine, inspect and replay runs, explore the invariants, and "
    "play the demo. inspect, replay and render read a run's JSON file or a SQLite event "
    "store and never change either.")
EPILOG = ("Exit status: 0 when all is well; 1 when explore finds a counterexample or a "
          "demo check fails; 2 for any error, which is one line on stderr. "
          "Run 'statemachine COMMAND --help' for a command's options.")


def parser() -> argparse.ArgumentParser:
    top = _Parser(prog="statemachine", description=DESCRIPTION, epilog=EPILOG)
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                  title="commands", help="one of:")

    demo = commands.add_parser(
        "demo", help="play the field-report scenarios with injected failures on SQLite, "
        "and check the invariants",
        description="Play the field-report scenarios with injected failures on a SQLite "
        "event store and Session, print every transition, and check the invariants. It "
        "ends with the inspect and render commands for the runs it left.")
    demo.add_argument("--dir", type=Path, metavar="DIR",
                      help="an empty or new directory for the databases (default: a fresh "
                           "temporary directory)")
    demo.set_defaults(run=demo_command)

    render = commands.add_parser(
        "render", help="draw the machine (diagrams/), or a run's path through it",
        description="Without FILE or --store: write the overview and the detailed "
        "diagram of the machine, drawn from its declaration, as Mermaid, DOT and (with "
        "Graphviz) SVG, plus README.md. With a run: draw the machine with the run's "
        "transitions and current step highlighted.")
    _add_source(render)
    render.add_argument("--out", type=Path, metavar="DIR",
                        help="output directory, created if needed (default: diagrams/ for "
                             "the machine, the current directory for a run)")
    render.set_defaults(run=render_command)

    inspect = commands.add_parser(
        "inspect", help="why a run can or cannot resume",
        description="Show a run's step, pending approvals, envelope and tool ledger, and "
        "one sentence on why it can or cannot resume and what an operator may do.")
    _add_source(inspect)
    inspect.add_argument("--json", action="store_true",
                         help="print the same facts as one JSON object")
    inspect.set_defaults(run=inspect_command)

    replay = commands.add_parser(
        "replay", help="validate a run's log",
        description="Replay a run's log, re-checking every transition; exits 2 naming the "
        "first illegal event.")
    _add_source(replay)
    replay.set_defaults(run=replay_command)

    explore = commands.add_parser(
        "explore", help="walk every action sequence of a bounded model, checking I1-I12",
        description="Breadth-first over every action sequence of a bounded model up to "
        "--depth, checking the invariants I1-I12 in every state; prints a shortest "
        "counterexample if there is one.")
    explore.add_argument("--world", default="all",
                         choices=["all", "reference", "reference-fail-closed", "remote"],
                         help="which model to explore (default: all)")
    explore.add_argument("--depth", type=_count(0), default=5, metavar="N",
                         help="the longest action sequence, 0 or more (default: 5)")
    explore.add_argument("--max-states", type=_count(1), default=200_000, metavar="N",
                         help="stop after this many distinct states, 1 or more; the "
                              "verdict says when it cut the search short (default: "
                              "200000)")
    explore.set_defaults(run=explore_command)
    return top


def _fail(command: str, kind: str, message: str) -> int:
    print(f"statemachine {command}: {kind}: {shown(message, 450)}", file=sys.stderr)
    return 2


def _control_message(error: ControlError) -> str:
    """A `ControlError`'s message with its run id and reason each bounded."""
    where = []
    if error.run_id is not None:
        where.append(f"run {shown(error.run_id, 80)!r}")
    if error.step is not None:
        where.append(f"in step {getattr(error.step, 'name', error.step)}")
    if error.action is not None:
        where.append(f"refused {shown(error.action, 40)}")
    reason = shown(error.reason, 300)
    return f"{', '.join(where)}: {reason}" if where else reason


def main(argv: Sequence[str] | None = None) -> int:
    from statemachine.diagrams import GraphvizFailed
    from statemachine.errors import ControlError

    args = parser().parse_args(argv)
    command = args.command
    try:
        return int(args.run(args))
    except UserError as error:
        return _fail(command, "error", str(error))
    except ControlError as error:
        return _fail(command, type(error).__name__, _control_message(error))
    except GraphvizFailed as error:
        return _fail(command, "error", f"cannot draw the SVG: {error}")
    except sqlite3.Error as error:
        return _fail(command, "error", f"SQLite: {error}")
    except BrokenPipeError:
        # the reader went away (| head): say nothing more, and do not fail on exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 2
    except OSError as error:
        where = f"{shown(error.filename)}: " if error.filename else ""
        return _fail(command, "error", f"{where}{error.strerror or error}")
    except (UnicodeError, subprocess.SubprocessError) as error:
        return _fail(command, "error", f"{type(error).__name__}: {error}")


__all__ = ["SHOWN", "UserError", "main", "parser", "shown"]

if __name__ == "__main__":
    sys.exit(main())
