"""A NUL character (DESIGN §6.6): PostgreSQL's ``text`` cannot hold one, so a text field
holding one (a run or session id, an owner, a tool name, a call id) is refused on every
store, before anything is recorded, and a run behaves the same on SQLite and PostgreSQL.
A payload's string may hold a NUL: it is stored as JSON text, where it reads ``\\u0000``,
and comes back on every store. A bad ``schema=`` name is a typed refusal."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from statemachine import (
    ConfigurationError,
    ControlError,
    MemoryEventStore,
    RunController,
    SchemaError,
    SQLiteEventStore,
    SQLiteSession,
    ToolCall,
)
from statemachine.stores import _dumps
from tests.helpers import assert_refused

NUL = "a\x00b"
KINDS = ["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


@pytest.fixture(params=KINDS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    opened: Any
    if request.param == "memory":
        opened = MemoryEventStore()
    elif request.param == "sqlite":
        opened = SQLiteEventStore(tmp_path / "e.db")
    else:
        from statemachine.postgres import PostgresEventStore

        opened = PostgresEventStore(request.getfixturevalue("pg_dsn"),
                                    schema=request.getfixturevalue("pg_schema"))
    yield opened
    if request.param != "memory":
        opened.close()


def test_a_nul_in_a_text_field_is_refused_on_every_store_before_anything_is_recorded(
        store: Any) -> None:
    for field in ("run_id", "session_id"):
        options: dict[str, Any] = {"run_id": "r", "session_id": "s", field: NUL}
        with pytest.raises(SchemaError, match="NUL"):
            RunController.start(store=store, **options)
    assert list(store.list_runs()) == []  # nothing of either run was written
    c = RunController.start(run_id="r", session_id="s", store=store)
    assert_refused(c, SchemaError, c.claim, NUL)
    c.begin_model_call()
    for call in (ToolCall(NUL, "charge", {}), ToolCall("c1", NUL, {})):
        assert_refused(c, SchemaError, c.model_responded, [call])
    assert len(store.load("r")) == c.version  # the store holds what the controller does
    assert RunController.load(store, "r").events == c.events


def test_a_nul_in_a_payload_is_kept_on_every_store(store: Any) -> None:
    c = RunController.start(run_id="r", session_id="s", store=store)
    c.add_input([{"content": NUL, NUL: [NUL]}])
    c.begin_model_call()
    c.model_responded([ToolCall("c1", "charge", {"note": NUL}, needs_approval=True)])
    again = RunController.load(store, "r")
    assert again.events == c.events
    assert again.call("c1").call.arguments == {"note": NUL}
    text = json.dumps(again.to_json())
    assert RunController.from_json(text).events == c.events


def test_a_stored_nul_text_field_is_refused_on_the_fast_and_the_strict_load(
        tmp_path: Path) -> None:
    """A log an older version wrote into SQLite with a NUL in its Session id: refused on
    load (the clean rows' batch decoder and the row-by-row one agree), never replayed."""
    path = tmp_path / "e.db"
    store = SQLiteEventStore(path)
    c = RunController.start(run_id="r", session_id="s", store=store)
    c.add_input(["hello"])
    store.close()
    conn = sqlite3.connect(path)
    (body,) = conn.execute("SELECT body FROM events WHERE seq = 0").fetchone()
    forged = json.loads(body)
    forged["session_id"] = NUL
    with conn:
        conn.execute("UPDATE events SET body = ? WHERE seq = 0", (_dumps(forged),))
    conn.close()
    store = SQLiteEventStore(path)
    try:
        for load in (lambda: store.load("r"), lambda: RunController.load(store, "r")):
            with pytest.raises(SchemaError):
                load()
        doc = c.to_json()
        doc["events"][0]["session_id"] = NUL
        for form in (doc, json.dumps(doc)):
            with pytest.raises(SchemaError):
                RunController.from_json(form)
    finally:
        store.close()


def test_a_session_id_with_a_nul_is_refused_by_the_sessions(tmp_path: Path) -> None:
    from statemachine.postgres import AsyncPostgresSession, PostgresSession

    with pytest.raises(SchemaError, match="NUL"):
        SQLiteSession(NUL, tmp_path / "s.db")
    for cls in (PostgresSession, AsyncPostgresSession):  # refused before connecting
        with pytest.raises(SchemaError, match="NUL"):
            cls("dbname=nowhere", NUL)


@pytest.mark.parametrize("name", ['x"; DROP TABLE y; --', "", "a" * 64, "1a", NUL, 7])
def test_a_bad_schema_name_is_a_typed_refusal(name: Any) -> None:
    from statemachine.postgres import (
        AsyncPostgresEventStore,
        AsyncPostgresSession,
        PostgresEventStore,
        PostgresSession,
    )

    for make in (lambda: PostgresEventStore("dbname=x", schema=name),
                 lambda: AsyncPostgresEventStore("dbname=x", schema=name),
                 lambda: PostgresSession("dbname=x", "s", schema=name),
                 lambda: AsyncPostgresSession("dbname=x", "s", schema=name)):
        with pytest.raises(ConfigurationError, match="plain SQL identifier") as info:
            make()
        assert isinstance(info.value, ControlError)
        assert isinstance(info.value, ValueError)
        assert "\x00" not in str(info.value)
