"""The operator's commands (DESIGN §7.5): ``runs`` and ``inbox`` read a store's run heads;
``approve``, ``reject``, ``resolve`` and ``abandon`` act on one run through
`statemachine.operator`, as the person ``--by`` names. A write opens the store for
writing (an existing SQLite file, never a new one; or a PostgreSQL DSN); the read verbs
open it read-only."""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from statemachine.cli.common import UserError, chosen_steps, shown, source_store

if TYPE_CHECKING:
    from statemachine.blocker import Blocker, Waiting
    from statemachine.controller import RunController
    from statemachine.stored import RunHead


def add_store_options(parser: argparse.ArgumentParser, *, writes: bool) -> None:
    """``--store DB`` | ``--dsn DSN``."""
    how = "opened for writing: an existing file" if writes else "opened read-only"
    parser.add_argument("--store", type=Path, metavar="DB",
                        help=f"a SQLite event store file ({how})")
    parser.add_argument("--dsn", metavar="DSN",
                        help="a PostgreSQL event store: a libpq DSN or URI (needs the "
                             "postgres extra)")


def writable_store(args: argparse.Namespace) -> Any:
    """The store ``--store``/``--dsn`` names, opened for writing. A SQLite path that is
    not an existing file is refused (a write never creates a store)."""
    if (args.store is None) == (args.dsn is None):
        raise UserError("give one of --store DB or --dsn DSN")
    if args.dsn is not None:
        try:
            from statemachine.postgres import PostgresEventStore
        except ImportError:
            raise UserError("--dsn needs psycopg: pip install "
                            "'agent-statemachine[postgres]'") from None
        return PostgresEventStore(args.dsn)
    if not args.store.is_file():
        raise UserError(f"no event store at {shown(args.store)} (a write never creates one)")
    from statemachine.stores import SQLiteEventStore

    return SQLiteEventStore(args.store)


def moment(at: int | None) -> str | None:
    """``at`` as ISO 8601 UTC to the millisecond (None when unknown or out of range)."""
    if at is None:
        return None
    try:
        found = datetime.datetime.fromtimestamp(at / 1_000_000, tz=datetime.UTC)
    except (OverflowError, ValueError, OSError):
        return None
    return found.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def blocker_json(blocker: Blocker | None) -> dict[str, Any] | None:
    if blocker is None:
        return None
    return {"kind": blocker.kind.value, "since": blocker.since,
            "since_utc": moment(blocker.since), "call_ids": list(blocker.call_ids),
            "publication": blocker.publication, "reason": blocker.reason}


def blocker_words(blocker: Blocker | None) -> str:
    """A blocker in words: ``blocked: in_doubt (charge) since 2026-...Z``."""
    if blocker is None:
        return "not blocked"
    what = ", ".join(shown(c, 60) for c in blocker.call_ids[:5])
    if len(blocker.call_ids) > 5:
        what += f" and {len(blocker.call_ids) - 5} more"
    detail = what or shown(blocker.reason or blocker.publication or "", 120)
    since = moment(blocker.since) or "an unknown time"
    return f"blocked: {blocker.kind.value}{f' ({detail})' if detail else ''} since {since}"


def waiting_json(w: Waiting) -> dict[str, Any]:
    return {"run_id": w.run_id, "call_id": w.call_id, "kind": w.kind, "tool": w.tool,
            "arguments": w.preview, "fingerprint": w.fingerprint, "since": w.since,
            "since_utc": moment(w.since)}


# ------------------------------------------------------------------ the reads


def runs_command(args: argparse.Namespace) -> int:
    from statemachine import operator

    store = source_store(args)
    if store is None:
        raise UserError(f"{args.command} needs --store DB or --dsn DSN")
    heads = operator.runs(store, steps=chosen_steps(args.step), session_id=args.session,
                          blocked=args.blocked)
    if args.json:
        print(json.dumps([_head_json(h) for h in heads], indent=2))
        return 0
    for h in heads:
        session = "no Session" if h.session_id is None else f"session {shown(h.session_id)}"
        owner = "no owner" if h.owner is None else f"owner {shown(h.owner)}"
        events = f"{h.version} event{'' if h.version == 1 else 's'}"
        blocked = "" if h.blocker is None else f", {blocker_words(h.blocker)}"
        print(f"run {shown(h.run_id)}: step {h.step.name}, {session}, {events}, {owner}"
              f"{blocked}")
    return 0


def _head_json(h: RunHead) -> dict[str, Any]:
    return {"run_id": h.run_id, "step": h.step.value, "session_id": h.session_id,
            "version": h.version, "owner": h.owner, "updated_at": h.updated_at,
            "updated_utc": moment(h.updated_at), "lease_owner": h.lease_owner,
            "lease_until": h.lease_until, "blocker": blocker_json(h.blocker),
            "waiting": len(h.waiting)}


def inbox_command(args: argparse.Namespace) -> int:
    from statemachine import operator

    store = source_store(args)
    if store is None:
        raise UserError("inbox needs --store DB or --dsn DSN")
    entries = operator.inbox(store)
    if args.json:
        print(json.dumps([waiting_json(w) for w in entries], indent=2))
        return 0
    if not entries:
        print("nothing waits: no call awaits a decision and none is in doubt")
    for w in entries:
        what = "awaits a decision" if w.kind == "approval" else "is IN DOUBT"
        print(f"run {shown(w.run_id, 80)} call {shown(w.call_id, 80)} ({shown(w.tool, 60)}) "
              f"{what} since {moment(w.since) or 'an unknown time'}: "
              f"{shown(w.preview, 200)}; fingerprint {w.fingerprint}")
    return 0


# ------------------------------------------------------------------ the writes


def _limits(args: argparse.Namespace) -> dict[str, Any]:
    """The run's own limits the command was given (``--max-bytes``, ``--max-events``),
    and the run as the operator saw it (``--seen``)."""
    if args.seen is not None and args.seen < 1:
        raise UserError("--seen is the run's event count as inspect shows it, 1 or more")
    found = {"max_bytes": args.max_bytes, "max_events": args.max_events, "seen": args.seen}
    return {name: value for name, value in found.items() if value is not None}


def _done(c: RunController, what: str) -> int:
    print(f"{what}; run {shown(c.run_id)} is now in step {c.step.name} "
          f"({c.version} events), {blocker_words(c.blocker)}")
    return 0


def approve_command(args: argparse.Namespace) -> int:
    from statemachine import operator

    c = operator.approve(writable_store(args), args.run_ref, args.call,
                         fingerprint=args.fingerprint, by=args.by, reason=args.reason,
                         **_limits(args))
    return _done(c, f"approved call {shown(args.call)} as {shown(args.by)}")


def reject_command(args: argparse.Namespace) -> int:
    from statemachine import operator

    c = operator.reject(writable_store(args), args.run_ref, args.call, by=args.by,
                        message=args.message, **_limits(args))
    return _done(c, f"rejected call {shown(args.call)} as {shown(args.by)}")


def resolve_command(args: argparse.Namespace) -> int:
    from statemachine import operator
    from statemachine.codec import parse
    from statemachine.values import Resolution

    output: Any = None
    if args.completed is not None:
        outcome, output = Resolution.COMPLETED, parse(args.completed)
    elif args.failed is not None:
        outcome, output = Resolution.FAILED, args.failed
    else:
        outcome = Resolution.NOT_EXECUTED
    c = operator.resolve(writable_store(args), args.run_ref, args.call, outcome=outcome,
                         output=output, by=args.by, evidence=args.evidence,
                         **_limits(args))
    return _done(c, f"resolved call {shown(args.call)} {outcome.value} as {shown(args.by)}")


def abandon_command(args: argparse.Namespace) -> int:
    from statemachine import operator

    c = operator.abandon(writable_store(args), args.run_ref, reason=args.reason, by=args.by,
                         **_limits(args))
    return _done(c, f"abandoned the run as {shown(args.by)}")


# ------------------------------------------------------------------ the parsers


def add_commands(commands: Any, steps_help: str) -> None:
    """Add ``runs`` (alias ``list``), ``inbox`` and the four writes to the parser."""
    runs = commands.add_parser(
        "runs", aliases=["list"],
        help="the runs in a store: step, Session, events, owner and what blocks each",
        description="List the runs an event store (SQLite or PostgreSQL) holds, one line "
        "per run: its id, step, Session, number of events, owner (of its last claim) and, "
        "when something blocks it, what (a call in doubt, an unsettled publication, "
        "decisions to take, not resumable) and since when, read off the store's run "
        "heads in one query. The store is opened read-only and never changed.")
    add_store_options(runs, writes=False)
    runs.add_argument("--session", metavar="ID", help="only the runs on this Session")
    runs.add_argument("--step", action="append", metavar="STEP", help=steps_help)
    runs.add_argument("--blocked", action="store_true",
                      help="only the runs something blocks")
    runs.add_argument("--json", action="store_true",
                      help="print the runs as one JSON list of objects (run_id, step, "
                           "session_id, version, owner, updated_at, lease, blocker, "
                           "waiting: how many inbox entries)")
    runs.set_defaults(run=runs_command)

    inbox = commands.add_parser(
        "inbox", help="every call awaiting a decision and every call in doubt, oldest first",
        description="Every pending approval and every call in doubt across the store's "
        "runs, oldest first: run, call, tool, an argument preview (200 characters at "
        "most), the fingerprint an approval must give, and since when. Read-only.")
    add_store_options(inbox, writes=False)
    inbox.add_argument("--json", action="store_true", help="print one JSON list")
    inbox.set_defaults(run=inbox_command)

    def write(name: str, help_text: str, description: str, *, call: bool = True
              ) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = commands.add_parser(
            name, help=help_text, description=description + " The run is loaded, claimed "
            "as --by and the command applied through the controller (every guard, "
            "fingerprint and lease applies), durable before this returns; a refusal is "
            "one line (exit 2) and changes nothing.")
        parser.add_argument("run_ref", metavar="RUN", help="the run's id")
        if call:
            parser.add_argument("call", metavar="CALL", help="the call's id")
        add_store_options(parser, writes=True)
        parser.add_argument("--by", required=True, metavar="NAME",
                            help="who decides (recorded with the decision)")
        parser.add_argument("--max-bytes", type=int, metavar="N",
                            help="the run's max_bytes, when its workers load it with "
                                 "another than the default (so this write keeps to it)")
        parser.add_argument("--max-events", type=int, metavar="N",
                            help="the run's max_events, likewise")
        parser.add_argument("--seen", type=int, metavar="N",
                            help="the run's event count as you saw it (inspect's "
                                 "events): refused, nothing written, if the run has "
                                 "moved since, so a command run again after the run "
                                 "went on decides nothing")
        return parser

    approve = write("approve", "approve a call awaiting a decision",
                    "Approve CALL of RUN, bound to the fingerprint inbox and inspect show: "
                    "a call whose arguments are not those is refused.")
    approve.add_argument("--fingerprint", required=True, metavar="HEX",
                         help="the call's fingerprint (inbox, inspect)")
    approve.add_argument("--reason", metavar="TEXT", help="why (recorded)")
    approve.set_defaults(run=approve_command)

    reject = write("reject", "reject a call awaiting a decision",
                   "Reject CALL of RUN; the model is told --message.")
    reject.add_argument("--message", metavar="TEXT", help="what the model is told")
    reject.set_defaults(run=reject_command)

    resolve = write("resolve", "record what happened to a call in doubt",
                    "Settle CALL of RUN, which was started and whose outcome was never "
                    "recorded: --completed JSON (it happened; the model sees JSON), "
                    "--failed TEXT (it failed; the model sees TEXT) or --not-executed "
                    "(it did not happen: the call runs again on the next attempt).")
    outcome = resolve.add_mutually_exclusive_group(required=True)
    outcome.add_argument("--completed", metavar="JSON",
                         help="the output the model sees, as JSON (a text is '\"...\"')")
    outcome.add_argument("--failed", metavar="TEXT", help="the error text the model sees")
    outcome.add_argument("--not-executed", action="store_true",
                         help="the effect did not happen: run the call again")
    resolve.add_argument("--evidence", metavar="TEXT",
                         help="what this rests on (a payment id, a ticket; recorded)")
    resolve.set_defaults(run=resolve_command)

    abandon = write("abandon", "end a run for good", "End RUN for good "
                    "(TERMINAL_UNRECOVERABLE).", call=False)
    abandon.add_argument("--reason", required=True, metavar="TEXT", help="why (recorded)")
    abandon.set_defaults(run=abandon_command)
