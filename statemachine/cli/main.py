"""The ``statemachine`` command: render the machine, inspect and replay runs, explore
the invariants, and play the demo. Errors are one line on stderr and a non-zero exit."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from statemachine.values import Action, Phase, RecoveryPolicy

if TYPE_CHECKING:
    from statemachine.controller import RunController
    from statemachine.testing import World


class UserError(Exception):
    """A problem the person at the terminal can fix; printed as one line."""


# ----------------------------------------------------------------- loading runs


def _add_source(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", nargs="?", type=Path, help="a run's JSON (to_json output)")
    parser.add_argument("--store", type=Path, help="a SQLite event store file")
    parser.add_argument("--run", dest="run_id", help="the run id in --store")


def _load(args: argparse.Namespace) -> RunController:
    from statemachine.controller import RunController
    from statemachine.stores import SQLiteEventStore

    if args.store is not None:
        if args.file is not None or args.run_id is None:
            raise UserError("give either FILE, or --store DB with --run ID")
        if not args.store.is_file():
            raise UserError(f"no such store file: {args.store}")
        store = SQLiteEventStore(args.store)
        if not store.load(args.run_id):
            raise UserError(f"no run {args.run_id!r} in {args.store}")
        return RunController.load(store, args.run_id)
    if args.file is None:
        raise UserError("give a run's JSON file, or --store DB with --run ID")
    try:
        text = args.file.read_text()
    except OSError as error:
        raise UserError(f"cannot read {args.file}: {error.strerror or error}") from None
    return RunController.from_json(text)


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
        return (f"Blocked: call {c.in_doubt()[0]!r} was started and never completed, so it is "
                "never re-run; an operator records its outcome (resolve_in_doubt) or abandons "
                "the run.")
    if action is Action.RECONCILE:
        return ("Resumable: a write's outcome is unknown; the next attempt reconciles with "
                "the Session (append if nothing landed, acknowledge if it did) and completed "
                "tools are never re-run.")
    if action is Action.AWAIT_DECISIONS:
        return f"Resumable: waiting for decisions on {', '.join(c.pending_approvals)}."
    return f"Resumable: the runner's next action is {action.value}."


def describe(c: RunController) -> dict[str, Any]:
    envelope = c.envelope
    ledger = []
    in_doubt = set(c.in_doubt())
    for view in c.calls:
        call_id = view.call.call_id
        ledger.append({
            "call_id": call_id, "tool": view.call.name, "phase": view.phase.value,
            "starts": view.starts, "ran": view.starts > 0,
            "cached": view.phase in (Phase.COMPLETED, Phase.REJECTED, Phase.PUBLISHED),
            "in_doubt": call_id in in_doubt, "idempotent": view.call.idempotent,
        })
    return {
        "run_id": c.run_id,
        "step": c.step.value,
        "policy": c.policy.value,
        "session_id": c.session_id,
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
    print(f"run {info['run_id']}: step {info['step'].upper()}, policy {info['policy']}, "
          f"session {info['session_id']}, {info['events']} events")
    print(f"pending approvals: {', '.join(info['pending_approvals']) or 'none'}")
    env = info["envelope"]
    if env is None:
        print("envelope: none (nothing unsettled)")
    else:
        print(f"envelope: session {env['session_id']}, frontier {env['frontier_items']} "
              f"item(s) (read_limit {env['read_limit']}), batch {env['batch_items']} item(s) "
              f"publishing {', '.join(env['publishes_calls']) or 'no call results'}, "
              f"continuation {env['continuation'].upper()}, "
              f"{env['pending_guardrail_results']} pending guardrail result(s)"
              f"{', FAIL-CLOSED' if env['fail_closed'] else ''}")
    print(f"guardrail results: {info['published_guardrail_results']} published, "
          f"{info['pending_guardrail_results']} pending")
    print("ledger:" if info["ledger"] else "ledger: no tool calls")
    for call in info["ledger"]:
        notes = ["ran" if call["ran"] else "not run"]
        if call["cached"]:
            notes.append("result cached")
        if call["in_doubt"]:
            notes.append("IN DOUBT")
        if call["idempotent"]:
            notes.append("idempotent")
        print(f"  {call['call_id']:<16} {call['tool']:<14} {call['phase']:<10} "
              f"{', '.join(notes)}")
    print(f"verdict: {info['verdict']}")
    return 0


# -------------------------------------------------------------- replay, render


def replay_command(args: argparse.Namespace) -> int:
    c = _load(args)
    print(f"ok: {c.version} events replayed, every transition legal; step "
          f"{c.step.name}")
    return 0


def render_command(args: argparse.Namespace) -> int:
    from statemachine import diagrams

    if args.file is None and args.store is None:
        out = args.out or Path("diagrams")
        for path in diagrams.write_project_diagrams(out):
            print(f"wrote {path}")
        return 0
    c = _load(args)
    taken = diagrams.run_path(c.events)
    for written in diagrams.write(args.out or Path("."), basename=f"run-{c.run_id}",
                                  path=taken):
        print(f"wrote {written}")
    return 0


# ------------------------------------------------------------------- explore


def _worlds() -> dict[str, Callable[[], World]]:
    from statemachine.testing import ReferenceWorld, RemoteWorld

    return {
        "reference": ReferenceWorld,
        "reference-fail-closed": lambda: ReferenceWorld(RecoveryPolicy.FAIL_CLOSED),
        "remote": RemoteWorld,
    }


def explore_command(args: argparse.Namespace) -> int:
    from statemachine.testing import explore

    worlds = _worlds()
    names = list(worlds) if args.world == "all" else [args.world]
    status = 0
    for name in names:
        report = explore(worlds[name], depth=args.depth, max_states=args.max_states)
        print(f"{name}: {report.states} states, {report.transitions} transitions, "
              f"depth {report.depth}, {report.seconds:.1f}s")
        if report.counterexample is not None:
            status = 1
            print(f"  counterexample ({len(report.counterexample)} steps): {report.violation}")
            for i, action in enumerate(report.counterexample, 1):
                print(f"    {i}. {' '.join(action)}")
    return status


def demo_command(args: argparse.Namespace) -> int:
    from statemachine.cli.demo import run_demo

    return run_demo(args.dir)


# ---------------------------------------------------------------------- main


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="statemachine", description=__doc__)
    commands = top.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="play the field-report scenarios with injected "
                               "failures on SQLite, and check the invariants")
    demo.add_argument("--dir", type=Path, help="where to put the databases (default: a "
                      "fresh temporary directory)")
    demo.set_defaults(run=demo_command)

    render = commands.add_parser("render", help="draw the machine (diagrams/), or a run's "
                                 "path through it")
    _add_source(render)
    render.add_argument("--out", type=Path, help="output directory")
    render.set_defaults(run=render_command)

    inspect = commands.add_parser("inspect", help="why a run can or cannot resume")
    _add_source(inspect)
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    inspect.set_defaults(run=inspect_command)

    replay = commands.add_parser("replay", help="validate a run's log")
    _add_source(replay)
    replay.set_defaults(run=replay_command)

    explore = commands.add_parser(
        "explore", help="walk every action sequence of a bounded model, checking I1-I12")
    explore.add_argument("--world", default="all",
                         choices=["all", "reference", "reference-fail-closed", "remote"])
    explore.add_argument("--depth", type=int, default=5)
    explore.add_argument("--max-states", type=int, default=200_000)
    explore.set_defaults(run=explore_command)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    from statemachine.errors import ControlError

    args = parser().parse_args(argv)
    try:
        return int(args.run(args))
    except (UserError, ControlError) as error:
        kind = "error" if isinstance(error, UserError) else type(error).__name__
        print(f"statemachine {args.command}: {kind}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
