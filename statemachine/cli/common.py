"""What the command's modules share: the error a person can fix, and bounded echoes."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from statemachine.payloads import misprints

if TYPE_CHECKING:
    from statemachine.stores import SQLiteEventStore
    from statemachine.values import Step

SHOWN = 200
"""The most characters of any one user-provided string (a path, an id, a name) that a
message echoes."""


class UserError(Exception):
    """A problem the person at the terminal can fix; printed as one line."""


def shown(value: object, limit: int = SHOWN) -> str:
    """``value`` as one printable line of at most ``limit`` characters (plus "...")."""
    text = os.fsdecode(value) if isinstance(value, os.PathLike | bytes) else str(value)
    cut = len(text) > limit
    text = "".join(ascii(c)[1:-1] if misprints(c) else c for c in text[:limit])
    return text + "..." if cut else text


def open_store(path: Path) -> SQLiteEventStore:
    """A SQLite event store opened read-only (`SQLiteEventStore` with ``readonly=True``):
    nothing this command does can create or change a file. `StorageError` (one line)
    for a missing path, a directory, a file that is not a SQLite database or lacks the
    store's ``events`` table, and a damaged database."""
    from statemachine.stores import SQLiteEventStore

    return SQLiteEventStore(path, readonly=True, leave_shm=True)


def source_store(args: argparse.Namespace) -> Any:
    """The store ``--store DB`` or ``--dsn DSN`` names, opened read-only, or None."""
    dsn = getattr(args, "dsn", None)
    if dsn is not None and args.store is not None:
        raise UserError("give either --store DB or --dsn DSN, not both")
    if dsn is None:
        return None if args.store is None else open_store(args.store)
    try:
        from statemachine.postgres import PostgresEventStore
    except ImportError:
        raise UserError("--dsn needs psycopg: pip install 'agent-statemachine[postgres]'"
                        ) from None
    return PostgresEventStore(dsn, readonly=True)


def chosen_steps(texts: list[str] | None) -> set[Step] | None:
    """The steps ``--step`` names (by name or value, any case); `UserError` otherwise."""
    from statemachine.values import Step

    if not texts:
        return None
    chosen = set()
    for text in texts:
        found = next((step for step in Step if step.value == text.strip().lower()), None)
        if found is None:
            raise UserError(f"unknown step {shown(text, 60)!r}: --step is one of "
                            f"{', '.join(step.name for step in Step)}")
        chosen.add(found)
    return chosen
