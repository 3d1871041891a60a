"""Decoder fuzzing (DESIGN §6.6): Hypothesis mutations of the golden fixtures go through
every loading entry point — ``from_json(text)``, ``from_json(dict)``, a SQLite store file
holding the mutated events, and the CLI's ``replay`` — and the only outcomes allowed are
acceptance with an exact round trip, `SchemaError` and `InvalidTransition`. Anything else
(an untyped exception, a silently different run, a traceback from the CLI) fails.
``just fuzz`` runs it with the long profile."""

from __future__ import annotations

import contextlib
import io
import json
import sqlite3
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from statemachine import InvalidTransition, RunController, SchemaError, codec
from statemachine.cli.main import main as cli_main
from statemachine.codec import SCHEMA_VERSION
from statemachine.stores import SQLiteEventStore

FIXTURES = sorted((Path(__file__).parents[1] / "fixtures").glob("v*/*.json"))
TEXTS = [path.read_text() for path in FIXTURES]
ALLOWED = (SchemaError, InvalidTransition)

STRANGE_VALUES: list[Any] = [
    None, True, 0, -1, 1.5, "__HUGE__", "", "x" * 5000, "\ud800", "\U0001f600", [], {},
    [[[[[]]]]], {"a": {"b": {"c": {}}}}, "7", 1e308, -0.0,
]


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path into a JSON tree (iteratively)."""
    found: list[tuple[Any, ...]] = []
    stack = [(prefix, value)]
    while stack:
        path, node = stack.pop()
        found.append(path)
        if isinstance(node, dict):
            stack.extend(((*path, key), child) for key, child in node.items())
        elif isinstance(node, list):
            stack.extend(((*path, i), child) for i, child in enumerate(node))
    return found


def _parent(doc: Any, path: tuple[Any, ...]) -> Any:
    for key in path[:-1]:
        doc = doc[key]
    return doc


@st.composite
def mutated_documents(draw: st.DrawFn) -> str:
    text = draw(st.sampled_from(TEXTS))
    kind = draw(st.sampled_from(["flip", "truncate", "delete", "swap", "strange", "duplicate",
                                 "deep", "reorder", "renumber", "insert"]))
    if kind == "flip":
        raw = bytearray(text.encode())
        for _ in range(draw(st.integers(1, 4))):
            at = draw(st.integers(0, len(raw) - 1))
            raw[at] = draw(st.integers(0, 255))
        return raw.decode("utf-8", errors="surrogateescape")
    if kind == "truncate":
        return text[: draw(st.integers(0, len(text) - 1))]
    if kind == "duplicate":
        at = text.index('"run_id"')
        return text[:at] + '"run_id": "other", ' + text[at:]
    if kind == "deep":
        depth = draw(st.integers(150, 5000))
        at = text.index('"output"') if '"output"' in text else text.index('"run_id"')
        return text[:at] + '"deep": ' + "[" * depth + "]" * depth + ", " + text[at:]
    doc = json.loads(text)
    events = doc["events"]
    if kind == "reorder" and len(events) > 2:
        i = draw(st.integers(1, len(events) - 2))
        events[i], events[i + 1] = events[i + 1], events[i]
    elif kind == "renumber" and len(events) > 1:
        i = draw(st.integers(0, len(events) - 1))
        events[i]["seq"] = draw(st.sampled_from([-1, i + 1, 10**6, "1", True, None]))
    elif kind == "insert" and len(events) > 1:
        i = draw(st.integers(1, len(events) - 1))
        events.insert(i, json.loads(json.dumps(events[draw(st.integers(1, len(events) - 1))])))
    else:
        paths = [p for p in _paths(doc) if p]
        path = draw(st.sampled_from(paths))
        parent = _parent(doc, path)
        if kind == "delete":
            del parent[path[-1]]
        else:  # swap or strange: replace a value by another type or a strange one
            parent[path[-1]] = draw(st.sampled_from(STRANGE_VALUES))
    # an int past Python's 4,300-digit printing limit, spelled out by hand
    return json.dumps(doc).replace('"__HUGE__"', "1" + "0" * 4400)


def _check_accepted(c: RunController, text: str) -> None:
    again = RunController.from_json(json.dumps(c.to_json()))
    assert again.to_json() == c.to_json()
    doc = json.loads(text)
    if doc.get("schema_version") == SCHEMA_VERSION:
        assert c.to_json() == doc  # nothing dropped, nothing invented


def _through_store(text: str) -> None:
    doc = json.loads(text)
    events = doc.get("events") if isinstance(doc, dict) else None
    if not isinstance(events, list) or not isinstance(doc.get("run_id"), str):
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "events.db"
        SQLiteEventStore(path).close()
        with contextlib.closing(sqlite3.connect(path)) as conn, conn:
            conn.executemany(
                "INSERT INTO events (run_id, seq, batch_id, body) VALUES (?, ?, 'x', ?)",
                [(doc["run_id"], i, json.dumps(e)) for i, e in enumerate(events)])
        store = SQLiteEventStore(path)
        try:
            with contextlib.suppress(*ALLOWED):
                c = RunController.load(store, doc["run_id"])
                assert c.to_json()["events"] == RunController.from_json(c.to_json()).to_json()[
                    "events"]
        finally:
            store.close()


def _through_cli(text: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.json"
        path.write_bytes(text.encode("utf-8", errors="surrogateescape"))
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli_main(["replay", str(path)])
        assert code in (0, 2), err.getvalue()
        assert "Traceback" not in err.getvalue()
        assert len(err.getvalue().strip().splitlines()) <= 1


@pytest.mark.invariant("I10")
@given(mutated_documents())
def test_mutated_documents_are_accepted_exactly_or_refused_typed(text: str) -> None:
    try:
        c = RunController.from_json(text)
    except ALLOWED:
        pass
    else:
        _check_accepted(c, text)
    try:  # the same strict parse (a dict cannot hold duplicate keys or NaN)
        doc = codec.parse(text)
    except SchemaError:
        doc = None
    if doc is not None:
        try:
            from_dict = RunController.from_json(doc)
        except ALLOWED:
            from_dict = None
        try:
            from_text = RunController.from_json(text)
        except ALLOWED:
            from_text = None
        # from_json(dict) and from_json(text) accept exactly the same documents
        assert (from_dict is None) == (from_text is None)
        if from_dict is not None and from_text is not None:
            assert from_dict.to_json() == from_text.to_json()
        _through_store(text)
    _through_cli(text)
