"""The ``statemachine`` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from statemachine.values import RecoveryPolicy

if TYPE_CHECKING:
    from statemachine.fuzz import World

def _worlds() -> dict[str, Callable[[], World]]:
    from statemachine.fuzz import ReferenceWorld, RemoteWorld

    return {
        "reference": ReferenceWorld,
        "reference-fail-closed": lambda: ReferenceWorld(RecoveryPolicy.FAIL_CLOSED),
        "remote": RemoteWorld,
    }


def explore_command(args: argparse.Namespace) -> int:
    from statemachine.fuzz import explore

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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="statemachine", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    explore = commands.add_parser(
        "explore", help="walk every action sequence of a bounded model, checking I1-I12")
    explore.add_argument("--world", default="all",
                         choices=["all", "reference", "reference-fail-closed", "remote"])
    explore.add_argument("--depth", type=int, default=5)
    explore.add_argument("--max-states", type=int, default=200_000)
    explore.set_defaults(run=explore_command)
    args = parser.parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
