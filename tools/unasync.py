"""Generate the sync PostgreSQL driver from the async one, which is written by hand.

``python tools/unasync.py`` writes ``statemachine/postgres/sync.py`` from
``statemachine/postgres/aio.py``; ``python tools/unasync.py --check`` writes nothing and
exits 1 when ``sync.py`` is not what it would write (stale, or edited by hand).

The rewrite is textual, line by line, in the order of `RULES`: ``async with await X``,
``async def``, ``async with``, ``async for`` and ``await`` lose their async part, and the
async names become the sync ones (``AsyncConnection`` → ``Connection``,
``__aenter__`` → ``__enter__``, the ``asyncio.Lock`` → a ``threading.Lock`` ...). The
module docstring is replaced by one saying where the file comes from, and the plain
``import`` lines are sorted again. A line of the result that still says ``async``,
``await``, ``asyncio`` or ``Async`` is refused: ``aio.py`` used something the rules do not
know, so add a rule (or write it another way) rather than let an async call into the
sync code.

Code that only the async store has (group commit: the sync store has no concurrent
appends) sits between a line ``# unasync: async only`` and a line ``# unasync: end``
(each alone on its line, at any indent): those lines, the markers included, are left out
of ``sync.py``, so what is around them must read as code without them.
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import sys
import tokenize
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "statemachine" / "postgres" / "aio.py"
TARGET = ROOT / "statemachine" / "postgres" / "sync.py"

RULES: tuple[tuple[str, str], ...] = (
    (r"\basync with await ", "with "),
    (r"\basync def ", "def "),
    (r"\basync with ", "with "),
    (r"\basync for ", "for "),
    (r"\bawait ", ""),
    (r"\b__aenter__\b", "__enter__"),
    (r"\b__aexit__\b", "__exit__"),
    (r"\bpsycopg\.AsyncConnection\.connect\(", "psycopg.connect("),
    (r"\bAsyncConnection\b", "Connection"),
    (r"\bAsyncCursor\b", "Cursor"),
    (r"\bAsyncPostgresEventStore\b", "PostgresEventStore"),
    (r"\bAsyncPostgresSession\b", "PostgresSession"),
    (r"\b_AsyncClient\b", "_Client"),
    (r"\basyncio\.Lock\b", "threading.Lock"),
    (r"^import asyncio$", "import threading"),
)
"""(pattern, replacement), applied in order to every line (`re.sub`, multiline)."""

ASYNC_ONLY = re.compile(r"[ ]*# unasync: async only")
END = re.compile(r"[ ]*# unasync: end")

LEFT_OVER = re.compile(r"\basync\b|\bawait\b|Async|asyncio")

DOCSTRING = '''"""The sync PostgreSQL event store and Session, on psycopg's ``Connection``.

GENERATED from ``aio.py`` by ``tools/unasync.py``: do not edit. Change ``aio.py`` and
run ``python tools/unasync.py``; ``python tools/unasync.py --check`` fails while this
file is stale.
"""'''


class Unconverted(Exception):
    """The async source holds something the rules do not turn into sync code."""


def unasync(source: str) -> str:
    """The sync module for the async module ``source``."""
    tree = ast.parse(source)
    first = tree.body[0] if tree.body else None
    if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)):
        raise Unconverted("the async module must open with its docstring")
    lines = _rewritten(source)
    start = first.end_lineno or 0
    body = "\n".join(_without_async_only(lines[start:], start))
    text = f"{DOCSTRING}\n{_sorted_imports(body)}"
    left = [f"  {number}: {line.strip()}" for number, line in
            enumerate(text.split("\n"), start=1) if LEFT_OVER.search(line)]
    if left:
        raise Unconverted("the rules leave async code in the sync module:\n"
                          + "\n".join(left))
    return text


def _without_async_only(lines: list[str], before: int = 0) -> list[str]:
    """``lines`` (the first of them line ``before + 1`` of the source) without their
    async-only blocks, the markers included; a marker out of place is refused."""
    kept: list[str] = []
    inside: int | None = None
    for number, line in enumerate(lines, start=before + 1):
        if ASYNC_ONLY.fullmatch(line):
            if inside is not None:
                raise Unconverted(f"line {number}: an async-only block inside the one "
                                  f"opened on line {inside}")
            inside = number
        elif END.fullmatch(line):
            if inside is None:
                raise Unconverted(f"line {number}: '# unasync: end' closes no block")
            inside = None
        elif inside is None:
            kept.append(line)
    if inside is not None:
        raise Unconverted(f"line {inside}: an async-only block that never ends")
    return kept


def _rewrite(text: str) -> str:
    for pattern, replacement in RULES:
        text = re.sub(pattern, replacement, text, flags=re.MULTILINE)
    return text


def _rewritten(source: str) -> list[str]:
    """Every line of ``source`` rewritten, and a continuation line aligned under an
    opening bracket moved with that bracket (the rules shorten the text before it)."""
    old = source.split("\n")
    under = _aligned(source)
    new: list[str] = []
    for number, line in enumerate(old, start=1):
        text = _rewrite(line)
        if number in under:
            row, col = under[number]
            opener = old[row - 1]
            margin = len(opener) - len(opener.lstrip(" "))
            moved = len(new[row - 1]) - len(new[row - 1].lstrip(" "))
            column = moved + len(_rewrite(opener[margin:col + 1])) - 1
            text = " " * (column + 1) + text.lstrip(" ")
        new.append(text)
    return new


def _aligned(source: str) -> dict[int, tuple[int, int]]:
    """Each continuation line (by number) whose first token stands right under the
    inside of the bracket it continues: the (line, column) of that bracket."""
    found: dict[int, tuple[int, int]] = {}
    brackets: list[tuple[int, int]] = []
    last_row = 0
    skipped = (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
               tokenize.ENDMARKER)
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in skipped:
            continue
        row, col = token.start
        if brackets and row > last_row and col == brackets[-1][1] + 1:
            found[row] = brackets[-1]
        if token.type == tokenize.OP and token.string in "([{":
            brackets.append(token.start)
        elif token.type == tokenize.OP and token.string in ")]}":
            brackets.pop()
        last_row = token.end[0]
    return found


def _sorted_imports(body: str) -> str:
    """``body`` with each run of plain ``import x`` lines in order (a rule renamed one)."""
    out: list[str] = []
    run: list[str] = []
    for line in [*body.split("\n"), None]:
        if line is not None and re.fullmatch(r"import [\w.]+", line):
            run.append(line)
            continue
        out.extend(sorted(run))
        run = []
        if line is not None:
            out.append(line)
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/unasync.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 when the generated file is stale")
    args = parser.parse_args(argv)
    try:
        wanted = unasync(SOURCE.read_text(encoding="utf-8"))
    except Unconverted as problem:
        print(f"{SOURCE.relative_to(ROOT)}: {problem}", file=sys.stderr)
        return 2
    found = TARGET.read_text(encoding="utf-8") if TARGET.exists() else None
    name = TARGET.relative_to(ROOT)
    if args.check:
        if found != wanted:
            print(f"{name} is stale: run python tools/unasync.py", file=sys.stderr)
            return 1
        return 0
    if found != wanted:
        TARGET.write_text(wanted, encoding="utf-8")
        print(f"wrote {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
