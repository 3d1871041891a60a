"""What the storage tests share: ``make``, every store kind under test."""

from __future__ import annotations

from pathlib import Path

import pytest

from statemachine import MemoryEventStore
from statemachine.postgres import AsyncPostgresEventStore, PostgresEventStore
from statemachine.stores import AsyncSQLiteEventStore, SQLiteEventStore
from tests.helpers import StoreMaker


@pytest.fixture(params=["memory", "sqlite", "sqlite-async",
                        pytest.param("postgres", marks=pytest.mark.postgres),
                        pytest.param("postgres-async", marks=pytest.mark.postgres)])
def make(request: pytest.FixtureRequest, tmp_path: Path) -> StoreMaker:
    """Opens the store under test again (each call another handle on the same data)."""
    kind = request.param
    if kind == "memory":
        shared = MemoryEventStore()
        return lambda: shared
    if kind.startswith("sqlite"):
        cls = AsyncSQLiteEventStore if kind.endswith("async") else SQLiteEventStore
        return lambda: cls(tmp_path / "events.db")
    dsn = request.getfixturevalue("pg_dsn")
    schema = request.getfixturevalue("pg_schema")
    pg = AsyncPostgresEventStore if kind.endswith("async") else PostgresEventStore
    return lambda: pg(dsn, schema=schema)
