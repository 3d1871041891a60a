"""A store whose process dies, for the adapters' crash tests: an in-process stand-in for
kill -9 at a chosen moment (nothing the adapter holds catches a `BaseException`)."""

from __future__ import annotations

from typing import Any

from statemachine import SQLiteEventStore


class Crash(BaseException):
    """The process dies here (a stand-in for kill -9 in-process: nothing catches it)."""


class DiesWithItsProcess(SQLiteEventStore):
    """A SQLite store whose process dies once ``dead`` is set: nothing handed to it after
    lands (`Crash`), as after a kill -9 there."""

    dead = False

    def append(self, run_id: str, events: Any, expected_version: int, *,
               snapshot: Any = None, step: Any = None, read_model: Any = None,
               session_write: Any = None) -> None:
        if self.dead:
            raise Crash
        super().append(run_id, events, expected_version, snapshot=snapshot, step=step,
                       read_model=read_model, session_write=session_write)
