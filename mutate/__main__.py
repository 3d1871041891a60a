"""``python -m mutate [--module M] [--list] [--jobs N] [--json] [--id ID ...]``

Runs the catalogue's mutants (one at a time per job, each in its own copy of the tree)
and prints a table per module and the score, killed / (killed + survived).

Exit status: 0 when the score reaches the goal (90%); 1 below it; 2 when the catalogue
has a stale mutant or another problem, the unmutated tree fails a selection, or a
selection could not run."""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
from collections.abc import Sequence

from mutate.catalogue import CATALOGUE, SELECTIONS, Mutant
from mutate.harness import (
    GOAL,
    ROOT,
    Outcome,
    Result,
    baseline,
    check_catalogue,
    module_of,
    run_mutant,
    score,
)


def _chosen(module: str | None, ids: Sequence[str]) -> list[Mutant]:
    chosen = list(CATALOGUE)
    if module is not None:
        name = module.removeprefix("statemachine/").removesuffix(".py")
        chosen = [m for m in chosen
                  if module_of(m.target) == name or module_of(m.target).startswith(name + "/")]
    if ids:
        wanted = set(ids)
        unknown = wanted - {m.id for m in CATALOGUE}
        if unknown:
            raise SystemExit(f"unknown mutant id(s): {', '.join(sorted(unknown))}")
        chosen = [m for m in chosen if m.id in wanted]
    return chosen


def _table(results: Sequence[Result]) -> str:
    modules = sorted({module_of(r.mutant.target) for r in results})
    rows = [("module", "mutants", "killed", "timeouts", "survived", "equivalent", "score")]
    for name in [*modules, "total"]:
        mine = [r for r in results if name == "total" or module_of(r.mutant.target) == name]
        killed = sum(r.outcome is Outcome.KILLED for r in mine)
        survived = sum(r.outcome is Outcome.SURVIVED for r in mine)
        value = score(mine)
        rows.append((name, str(len(mine)), str(killed),
                     str(sum(r.timed_out for r in mine)), str(survived),
                     str(sum(r.outcome is Outcome.EQUIVALENT for r in mine)),
                     "-" if value is None else f"{value:.1%}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True))
                     for row in rows)


def _as_json(results: Sequence[Result], problems: Sequence[str]) -> str:
    value = score(results)
    return json.dumps({
        "score": value,
        "goal": GOAL,
        "problems": list(problems),
        "mutants": [{"id": r.mutant.id, "module": module_of(r.mutant.target),
                     "outcome": r.outcome.value, "timed_out": r.timed_out,
                     "seconds": round(r.seconds, 2), "detail": r.detail,
                     "description": r.mutant.description} for r in results],
    }, indent=2)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mutate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--module", help="only this module's mutants (machine, runner/loop, "
                                         "runner for every runner module)")
    parser.add_argument("--id", action="append", default=[], help="only this mutant (repeat)")
    parser.add_argument("--list", action="store_true", help="list the mutants, run nothing")
    parser.add_argument("--jobs", type=int, default=2, help="mutants run at once (default 2)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds per mutant; a run past it counts as killed (timeout)")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the unmutated run of each selection")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")

    problems = check_catalogue(CATALOGUE, ROOT)
    chosen = _chosen(args.module, args.id)
    if args.list:
        for m in chosen:
            tag = f"  [equivalent: {m.equivalent}]" if m.equivalent else ""
            print(f"{m.id:<6} {module_of(m.target):<14} {m.description}{tag}")
        for problem in problems:
            print(problem, file=sys.stderr)
        return 2 if problems else 0
    if problems:
        for problem in problems:
            print(problem, file=sys.stderr)
        print(f"{len(problems)} catalogue problem(s): fix or drop those mutants first",
              file=sys.stderr)
        return 2
    if not chosen:
        print("no mutant matches", file=sys.stderr)
        return 2

    runnable = [m for m in chosen if m.equivalent is None]
    if not args.no_baseline:
        broken = baseline({m.target for m in runnable}, root=ROOT)
        if broken:
            for problem in broken:
                print(problem, file=sys.stderr)
            return 2

    results: list[Result] = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(run_mutant, m, root=ROOT, timeout=args.timeout)
                   for m in chosen]
        for future in concurrent.futures.as_completed(futures):
            result = future.result()
            results.append(result)
            if not args.json:
                extra = f" ({result.detail})" if result.detail else ""
                print(f"[{len(results)}/{len(chosen)}] {result.mutant.id} "
                      f"{result.outcome.value}{' (timeout)' if result.timed_out else ''} "
                      f"{result.seconds:.0f}s{extra}", flush=True)
    order = {m.id: i for i, m in enumerate(CATALOGUE)}
    results.sort(key=lambda r: order[r.mutant.id])

    errors = [r for r in results if r.outcome is Outcome.ERROR]
    if args.json:
        print(_as_json(results, [f"{r.mutant.id}: {r.detail}" for r in errors]))
    else:
        print()
        print(_table(results))
        for r in results:
            if r.outcome is Outcome.SURVIVED:
                print(f"SURVIVED {r.mutant.id} ({module_of(r.mutant.target)}): "
                      f"{r.mutant.description}")
        for r in errors:
            print(f"ERROR {r.mutant.id}: {r.detail}")
        value = score(results)
        shown = "-" if value is None else f"{value:.1%}"
        print(f"\nscore {shown} (goal {GOAL:.0%}); selections: "
              f"{len({tuple(SELECTIONS[m.target]) for m in runnable})}")
    if errors:
        return 2
    value = score(results)
    return 0 if value is None or value >= GOAL else 1


if __name__ == "__main__":
    sys.exit(main())
