"""The ``statemachine`` command: render the machine, inspect, replay and list runs, explore
the invariants, play the demo, and the operator's verbs
(`statemachine.cli.operate`).
Errors are one line on stderr and exit status 2.

The read-only commands (``inspect``, ``replay``, ``render FILE|-|--store|--dsn``,
``runs``/``list``, ``inbox``) never create or change a file, a writer's ``-wal`` and
``-shm`` included: a store is opened read-only (``SQLiteEventStore(path,
readonly=True)``, see `common.open_store`)."""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import subprocess
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from statemachine.cli.common import SHOWN, UserError, shown, source_store
from statemachine.cli.describe import decision_note, describe, when
from statemachine.cli.operate import blocker_words
from statemachine.values import Phase, RecoveryPolicy

if TYPE_CHECKING:
    from statemachine.controller import RunController
    from statemachine.errors import ControlError
    from statemachine.testing import World
    from statemachine.testing.explore import ExploreReport


# ----------------------------------------------------------------- loading runs


STDIN = Path("-")
"""FILE as ``-``: the run's JSON text is read from standard input. Told apart by identity,
since ``Path("./-") == Path("-")``: only the argument ``-`` itself is this object."""


def _file(text: str) -> Path:
    return STDIN if text == "-" else Path(text)


def _add_source(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", nargs="?", type=_file, metavar="FILE",
                        help="a run's JSON file (what RunController.to_json() returns), "
                             "UTF-8; - reads it from standard input (./- for a file "
                             "named -)")
    parser.add_argument("--store", type=Path, metavar="DB",
                        help="a SQLite event store file (opened read-only, never changed)")
    parser.add_argument("--dsn", metavar="DSN",
                        help="a PostgreSQL event store instead of --store: a libpq DSN or "
                             "URI (opened read-only, never changed; needs the postgres "
                             "extra)")
    parser.add_argument("--run", dest="run_id", metavar="ID",
                        help="the run's id in the --store file or --dsn database")


def _read_bytes(path: Path, what: str) -> bytes:
    """The bytes of ``path`` (standard input for `STDIN`); `UserError` for every way
    that fails. ``what`` names the file in a message."""
    where = "standard input" if path is STDIN else shown(path)
    try:
        return sys.stdin.buffer.read() if path is STDIN else path.read_bytes()
    except IsADirectoryError:
        raise UserError(f"cannot read {where}: it is a directory, not {what}") from None
    except FileNotFoundError:
        raise UserError(f"cannot read {where}: no such file") from None
    except OSError as error:
        raise UserError(f"cannot read {where}: {error.strerror or error}") from None


def _read_file(path: Path) -> str:
    """A run's JSON file (standard input for ``-``) as text; `UserError` for every way
    that fails."""
    where = "standard input" if path is STDIN else shown(path)
    data = _read_bytes(path, "a run's JSON file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise UserError(f"cannot read {where}: not UTF-8 text (byte {error.start} is "
                        f"{data[error.start]:#04x}); a run's JSON file is UTF-8") from None


KEY_FILE_HELP = (
    "check the log's keyed chain (RunController.to_json(key=...)) with the key this file "
    "holds: its bytes, less one trailing newline (\\n or \\r\\n, as echo or an editor "
    "leaves; a key that itself ends in a newline needs a second one). Without it a "
    "signed log is refused (exit 2), never reported ok unchecked")

UNCHECKED = ("the log is signed (it carries a keyed chain) and was not checked: give "
             "--key-file F with the key it was signed with")


def read_key(path: Path) -> bytes:
    """The chain key ``--key-file`` names (see `KEY_FILE_HELP`); `UserError` for a file
    that cannot be read or holds no key. The key itself is never echoed."""
    if path is STDIN:
        raise UserError("--key-file needs a file: - (standard input) is for FILE only")
    key = _read_bytes(path, "a key file")
    key = key[:-2] if key.endswith(b"\r\n") else key[:-1] if key.endswith(b"\n") else key
    if not key:
        raise UserError(f"--key-file {shown(path)} holds no key: a chain key is at least "
                        "one byte")
    return key


def _signed(text: str) -> bool:
    """Whether a run's JSON text (one `RunController.from_json` accepted) carries a
    keyed chain."""
    from statemachine import codec

    doc = codec.parse(text)
    return type(doc) is dict and "chain" in doc


def _load(args: argparse.Namespace, *, snapshot: bool = True, key: bytes | None = None,
          verify: bool = False) -> RunController:
    """The run a command names: from a JSON file (the whole log replayed), or from a
    store opened read-only (from its verified snapshot unless ``snapshot=False``).

    A file's keyed chain is checked with ``key``; with ``verify`` and no key a signed
    file is refused (`UNCHECKED`): a command that vouches for a log does not vouch for a
    signed one it could not check (fail closed)."""
    from statemachine.controller import RunController
    from statemachine.errors import RunNotFound

    store = source_store(args)
    if store is not None:
        if args.file is not None:
            raise UserError("give either FILE, or --store DB with --run ID, not both")
        if key is not None:
            raise UserError("--key-file checks a run's JSON file (FILE): a store's log "
                            "carries no keyed chain")
        if args.run_id is not None:
            try:
                return RunController.load(store, args.run_id, snapshot=snapshot)
            except RunNotFound:
                pass
        runs = store.run_ids(limit=6)
        some = ", ".join(repr(shown(r, 60)) for r in runs[:5])
        holds = (f"it holds {some}{', ...' if len(runs) > 5 else ''}" if runs
                 else "it holds no run")
        if args.run_id is None:
            raise UserError(f"--store needs --run ID ({holds})")
        where = shown(args.store) if args.store is not None else "the --dsn database"
        raise UserError(f"no run {shown(args.run_id)!r} in {where} ({holds})")
    if args.run_id is not None:
        raise UserError("--run needs --store DB or --dsn DSN (a FILE holds one run)")
    if args.file is None:
        raise UserError("give a run's JSON file, or --store DB with --run ID")
    text = _read_file(args.file)
    c = RunController.from_json(text, key=key)
    if verify and key is None and _signed(text):
        raise UserError(UNCHECKED)
    return c


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


def inspect_command(args: argparse.Namespace) -> int:
    c = _load(args)
    info = describe(c)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    session = (f"session {shown(info['session_id'])}" if info["has_session"]
               else "no Session")
    print(f"run {shown(info['run_id'])}: step {info['step'].upper()}, policy "
          f"{info['policy']}, {session}, {info['events']} events, last moved "
          f"{when(info['updated_at'])}")
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
        notes.extend(decision_note(d) for d in call["decisions"])
        print(f"  {shown(call['call_id']):<16} {shown(call['tool']):<14} {'; '.join(notes)}")
    print(blocker_words(c.blocker))
    for w in c.waiting:
        print(f"  waiting: {shown(w.call_id)} ({w.kind}) fingerprint {w.fingerprint}")
    print(f"verdict: {info['verdict']}")
    return 0


# -------------------------------------------------------------- replay, render


def replay_command(args: argparse.Namespace) -> int:
    key = None if args.key_file is None else read_key(args.key_file)
    # the whole log, every transition checked again, and a file's keyed chain
    c = _load(args, snapshot=False, key=key, verify=True)
    chain = "" if key is None else ", the keyed chain verified"
    print(f"ok: {c.version} events replayed, every transition legal{chain}; step "
          f"{c.step.name}")
    return 0


def _safe_name(run_id: str) -> str:
    """A run id as part of a file name: no separators, no control characters, bounded."""
    return "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in run_id[:100])


def render_command(args: argparse.Namespace) -> int:
    from statemachine import diagrams

    if args.file is None and args.store is None and args.dsn is None:
        if args.run_id is not None:
            raise UserError("--run needs --store DB or --dsn DSN")
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


# ---------------------------------------------------------------------- list


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
    "Render the run-step machine, inspect, replay and list runs, explore the invariants, "
    "play the demo, and act as an operator. inspect, replay and render read a run's JSON "
    "file (- for standard input) or a SQLite or PostgreSQL event store, runs and inbox "
    "read a store, and none of them changes either; approve, reject, resolve and abandon "
    "write one run, as --by.")
EPILOG = ("Exit status: 0 when all is well; 1 when explore finds a counterexample or a "
          "demo check fails; 2 for any error, which is one line on stderr. "
          "With STATEMACHINE_TELEMETRY=1 in the environment, the command emits OpenTelemetry "
          "spans (an operator verb's carries its --by) through the global tracer provider, "
          "the one opentelemetry-instrument sets up (needs the otel extra). "
          "Run 'statemachine COMMAND --help' for a command's options.")

TELEMETRY = "STATEMACHINE_TELEMETRY"
"""The environment variable that turns telemetry on for one command (``1``; ``0`` or
unset: off)."""


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
        description="Without FILE, --store or --dsn: write the overview and the "
        "detailed diagram of the machine, drawn from its declaration, as Mermaid, DOT and "
        "(with Graphviz) SVG, plus README.md. With a run: draw the run's part of the "
        "machine (the steps it visited and where each could have gone next, with the "
        "overview's labels), its path and current step highlighted.")
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
        "first illegal event. A signed JSON file (to_json(key=...)) is checked with "
        "--key-file: a chain that does not verify (another key, an edited, added or "
        "removed event), a file without a chain, and a signed file replayed without "
        "--key-file each exit 2.")
    _add_source(replay)
    replay.add_argument("--key-file", type=_file, metavar="F", help=KEY_FILE_HELP)
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

    from statemachine.cli import operate, serve

    serve.add_command(commands)
    operate.add_commands(commands, "only the runs in this step, by name (such as UNSETTLED "
                         "or interruption); repeat it for several steps")
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
    from statemachine.stores import SnapshotIgnored

    args = parser().parse_args(argv)
    command = args.command

    def one_line(message: Warning | str, category: type[Warning], *_: Any,
                 **__: Any) -> None:
        print(f"statemachine {command}: warning: {category.__name__}: "
              f"{shown(message, 450)}", file=sys.stderr, flush=True)

    with warnings.catch_warnings():  # a warning (a snapshot ignored) is one line too
        warnings.simplefilter("always", SnapshotIgnored)
        warnings.showwarning = one_line
        return _run(args)


def _telemetry() -> None:
    """Turn telemetry on when `TELEMETRY` says ``1``: the process has no code of its own
    to call `enable_telemetry`, so the environment says it, as OpenTelemetry's own
    settings are given (the spans go to the global tracer provider, which an
    ``opentelemetry-instrument statemachine ...`` run configures from ``OTEL_*``).
    `ConfigurationError` without the otel extra; a value other than ``0`` or ``1`` is an
    error rather than a guess."""
    value = os.environ.get(TELEMETRY, "").strip()
    if value in ("", "0"):
        return
    if value != "1":
        raise UserError(f"{TELEMETRY} must be 1 (telemetry on) or 0 (off), not "
                        f"{shown(value, 40)!r}")
    from statemachine.telemetry import enable_telemetry

    enable_telemetry()


def _run(args: argparse.Namespace) -> int:
    from statemachine.diagrams import GraphvizFailed
    from statemachine.errors import ControlError

    command = args.command
    try:
        _telemetry()
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
