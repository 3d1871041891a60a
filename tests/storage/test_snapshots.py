"""Snapshots are verified, never trusted blindly (DESIGN §6.6): a snapshot row carries the
sha256 of its JSON text; one whose digest, JSON, shape, run or version does not check out
is ignored with a `SnapshotIgnored` warning and the whole log replayed. A log with a gap,
a truncation or a damaged row is a `SchemaError` or `StorageError`, never a silently
shorter ``events``.

Then a seeded random corruption loop over a SQLite store file holding runs with
snapshots: bytes flipped in event and snapshot bodies and in the file's pages, rows
deleted, seq and version values changed, digests and snapshots replaced. Every load is
the exact run, or a typed error, or (for an edit the log itself cannot reveal: a legal
event where another stood) exactly the log the store holds; never a log with a gap, never
one shorter than its head or a snapshot vouched for.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import json
import random
import shutil
import sqlite3
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from statemachine import (
    ControlError,
    InvalidTransition,
    MemoryEventStore,
    Resolution,
    RunController,
    RunNotFound,
    SchemaError,
    SQLiteEventStore,
    StorageError,
    codec,
)
from statemachine import controller as controller_module
from statemachine import events as ev
from statemachine.state import STATE_VERSION, RunState
from statemachine.stores import AsyncSQLiteEventStore, Snapshot, SnapshotIgnored, restored
from tests.helpers import SESSION, B, P, at_interruption, run_charge

RUN = "run-1"
EVERY = 8
TYPED = (SchemaError, StorageError, InvalidTransition)


@pytest.fixture(autouse=True)
def _often(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(controller_module, "SNAPSHOT_EVERY", EVERY)


def _long_run(store: Any, run_id: str = RUN) -> RunController:
    """A run of 38 events (snapshots at 8, 16, 24 and 32): approvals, tools, a published
    batch, then input while notify awaits its decision."""
    c = at_interruption(store=store, run_id=run_id)
    run_charge(c)
    c.stage_publication(B, P, call_ids=["charge", "audit"])
    c.publication_committed()
    while c.version < 38:
        c.add_input([{"role": "user", "content": f"and then {c.version}"}])
    return c


def _raw(path: Path) -> contextlib.closing[sqlite3.Connection]:
    return contextlib.closing(sqlite3.connect(path, isolation_level=None))


def _store_file(path: Path) -> tuple[RunController, RunController]:
    store = SQLiteEventStore(path)
    c = _long_run(store)
    other = _long_run(store, "run-2")
    other.add_input([{"role": "user", "content": "run-2 goes on"}])
    store.close()  # checkpointed: the whole database in one file
    return c, other


@contextlib.contextmanager
def _no_warning() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("error", SnapshotIgnored)
        yield


def _snapshot_row(path: Path, run_id: str = RUN) -> tuple[int, str, str]:
    with _raw(path) as raw:
        row = raw.execute("SELECT version, body, digest FROM snapshots WHERE run_id = ?",
                          (run_id,)).fetchone()
    assert row is not None
    return row  # type: ignore[no-any-return]


def _set_snapshot(path: Path, body: str, *, version: int | None = None,
                  digest: str | None = None) -> None:
    digest = hashlib.sha256(body.encode()).hexdigest() if digest is None else digest
    with _raw(path) as raw:
        raw.execute("UPDATE snapshots SET body = ?, digest = ?, version = COALESCE(?, "
                    "version) WHERE run_id = ?", (body, digest, version, RUN))


# ------------------------------------------------------------ what is stored


def test_a_snapshot_row_holds_the_sha256_of_its_text(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    c, _ = _store_file(path)
    version, body, digest = _snapshot_row(path)
    assert version == 32
    assert digest == hashlib.sha256(body.encode()).hexdigest()
    assert json.loads(body)["last_seq"] == version - 1
    with _no_warning():
        loaded = RunController.load(SQLiteEventStore(path), RUN)
    assert loaded.state == c.state
    assert loaded.events == c.events


def test_an_older_database_gets_the_digest_column_and_drops_unverified_snapshots(
        tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    c, _ = _store_file(path)
    with _raw(path) as raw:
        raw.execute("ALTER TABLE snapshots DROP COLUMN digest")
    with _no_warning():
        store = SQLiteEventStore(path)
        assert store.load_latest(RUN)[0] is None  # dropped: nothing vouches for it
        assert RunController.load(store, RUN).state == c.state
        again = RunController.load(store, RUN)
        while again.version <= 40:  # the append at seq 40 hands the store a snapshot
            again.add_input([{"role": "user", "content": "more"}])
    assert _snapshot_row(path)[0] == 40


def test_a_restored_snapshot_keeps_the_pending_approvals() -> None:
    # ST22: a snapshot is the whole folded state; the calls awaiting a decision (in
    # proposal order) come back with it, so a run loaded from one still pauses on them
    c = at_interruption()
    c.approve("notify")
    restored = RunState.restore(json.loads(json.dumps(c.state.snapshot())))
    assert restored is not None
    assert restored.awaiting() == ("charge", "audit")
    assert restored == c.state
    assert restored.counts == c.state.counts


def test_a_restored_snapshot_keeps_every_resolution_of_a_call() -> None:
    # STT5: a call given back (NOT_EXECUTED), run again and resolved again keeps both
    # resolutions, with who, the outcome and the evidence, through a snapshot
    c = at_interruption()
    c.approve("charge", by="alice")
    c.reject("notify", "no")
    c.reject("audit", "no")
    c.resume()
    c.begin_tool("charge")
    c = RunController.from_json(c.to_json())
    c.resolve_in_doubt("charge", outcome=Resolution.NOT_EXECUTED, by="bob", evidence="none")
    c.begin_tool("charge")
    c = RunController.from_json(c.to_json())
    c.resolve_in_doubt("charge", "charged 7", by="carol", evidence="ch_1")
    restored = RunState.restore(json.loads(json.dumps(c.state.snapshot())))
    assert restored == c.state
    assert restored is not None
    record = restored.calls["charge"]
    assert [(d.kind, d.by, d.outcome, d.evidence) for d in record.decisions()] == [
        ("approved", "alice", None, None),
        ("resolved", "bob", Resolution.NOT_EXECUTED, "none"),
        ("resolved", "carol", Resolution.COMPLETED, "ch_1")]


# ------------------------------------------------------------ bad snapshots


def _ignored(path: Path, expected: RunController, says: str) -> None:
    for readonly in (False, True):
        with pytest.warns(SnapshotIgnored, match=says):
            loaded = RunController.load(SQLiteEventStore(path, readonly=readonly), RUN)
        assert loaded.state == expected.state
        assert loaded.events == expected.events
        assert loaded.version == expected.version


def test_a_snapshot_whose_digest_does_not_match_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    c, _ = _store_file(path)
    _, body, digest = _snapshot_row(path)
    _set_snapshot(path, body.replace('"turns":1', '"turns":7'), digest=digest)
    _ignored(path, c, "digest does not match")


@pytest.mark.parametrize(("text", "says"), [
    ("{not json", "not JSON"),
    ("[1, 2]", "not a JSON object"),
    (json.dumps({"last_seq": 31, "state_version": STATE_VERSION,
                 "started": {"run_id": "run-1"}}), "does not restore"),
])
def test_a_snapshot_with_bad_json_or_shape_is_ignored(tmp_path: Path, text: str,
                                                      says: str) -> None:
    """Whatever the text, with a matching digest: only the shape checks can catch it."""
    path = tmp_path / "events.db"
    c, _ = _store_file(path)
    _set_snapshot(path, text)
    _ignored(path, c, says)


def test_a_snapshot_with_values_of_the_wrong_type_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    c, _ = _store_file(path)
    _, body, _ = _snapshot_row(path)
    doc = json.loads(body)
    doc["calls"] = [["not", "a", "call"]]
    _set_snapshot(path, json.dumps(doc))
    _ignored(path, c, "does not restore")


def test_a_snapshot_whose_version_was_changed_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    c, _ = _store_file(path)
    for version in (24, 33, 1000):  # inside the log, past the tail's start, past the log
        _set_snapshot(path, _snapshot_row(path)[1], version=version)
        _ignored(path, c, "version does not match")


def test_another_runs_snapshot_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    c, _ = _store_file(path)
    version, body, _ = _snapshot_row(path, "run-2")
    _set_snapshot(path, body, version=version)
    _ignored(path, c, "another run's")


def test_a_snapshot_the_tail_does_not_replay_onto_is_ignored() -> None:
    """A store without digests (memory): a snapshot that restores but is not the state
    the log leads to, so the events after it do not replay onto it."""
    store = MemoryEventStore()
    c = _long_run(store)
    version, snapshot = store._snapshots[RUN]
    tampered = dict(snapshot, step="completed")
    store._snapshots[RUN] = (version, tampered)
    with pytest.warns(SnapshotIgnored, match="do not replay onto it"):
        loaded = RunController.load(store, RUN)
    assert loaded.state == c.state
    assert loaded.events == c.events
    store._snapshots[RUN] = (version, {**snapshot, "calls": 7})  # restore raises
    with pytest.warns(SnapshotIgnored, match="does not restore"):
        assert RunController.load(store, RUN).state == c.state
    with _no_warning():  # snapshot=False never looks at it
        assert RunController.load(store, RUN, snapshot=False).state == c.state


def test_another_runs_snapshot_is_ignored_even_where_its_tail_would_replay_onto_it(
) -> None:
    # SS05: a snapshot is used only for its own run, even when the run's later events
    # would replay onto it; otherwise the whole log is replayed and an operator warned
    class Crossed(MemoryEventStore):
        foreign: Snapshot | None = None

        def load_latest(self, run_id: str) -> tuple[Snapshot | None, list[ev.Event]]:
            return self.foreign, self.load(run_id)[2:]

    other = RunController.start(run_id="other", session_id=SESSION)
    other.add_input(["theirs"])
    store = Crossed()
    store.foreign = other.state.snapshot()  # two events, like the tail expects
    mine = RunController.start(run_id="mine", session_id=SESSION, store=store)
    mine.add_input(["mine"])
    mine.add_input(["also mine"])
    with pytest.warns(SnapshotIgnored):
        loaded = RunController.load(store, "mine")
    assert loaded.run_id == "mine"
    assert loaded.unpublished_input == ("mine", "also mine")
    assert loaded.state == mine.state


def test_a_snapshot_that_does_not_meet_its_tail_is_not_restored() -> None:
    # SS06: the events after a snapshot start right after it (a gap means another log)
    c = at_interruption()
    snapshot = c.state.snapshot()  # at the last event
    later = ev.RunClaimed(c.version + 1, None)  # one event missing before it
    with pytest.warns(SnapshotIgnored):
        assert restored(c.run_id, snapshot, [later]) is None
    assert restored(c.run_id, snapshot, [ev.RunClaimed(c.version, None)]) == c.state


def test_list_runs_ignores_a_bad_snapshot_too(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    c, other = _store_file(path)
    with _raw(path) as raw:
        raw.execute("UPDATE runs SET step = NULL")  # every head unfolded: folded now
        raw.execute("UPDATE snapshots SET digest = 'x'")
    with pytest.warns(SnapshotIgnored):
        heads = SQLiteEventStore(path).list_runs()
    assert [(h.run_id, h.version, h.step) for h in heads] == [
        (RUN, c.version, c.step), ("run-2", other.version, other.step)]


# -------------------------------------------------------------- bad logs


@pytest.mark.invariant("I10")
def test_a_truncated_log_under_a_verified_snapshot_is_refused(tmp_path: Path) -> None:
    """The snapshot vouches for 32 events: a log with fewer is truncated (SchemaError),
    not replayed short (which once loaded a stale state and inspect said all was well)."""
    path = tmp_path / "events.db"
    _store_file(path)
    with _raw(path) as raw:
        raw.execute("DELETE FROM events WHERE run_id = ? AND seq >= 20", (RUN,))
    for readonly in (False, True):
        with pytest.raises(SchemaError, match="truncated"):
            RunController.load(SQLiteEventStore(path, readonly=readonly), RUN)


def _loads(store: Any) -> list[Any]:
    """Every way a run is read from a sync SQLite store."""
    return [lambda: store.load(RUN), lambda: store.load_latest(RUN),
            lambda: store.load_measured(RUN), lambda: store.load_latest_measured(RUN),
            lambda: RunController.load(store, RUN),
            lambda: RunController.load(store, RUN, snapshot=False)]


@pytest.mark.invariant("I10")
@pytest.mark.parametrize("lost", [1, 5])
def test_the_last_events_lost_past_the_newest_snapshot_are_refused(tmp_path: Path,
                                                                   lost: int) -> None:
    """The last rows of a 38-event log deleted, past its snapshot at 32: what is left is a
    legal log, and only the run's head (version 38) tells it from a run that stopped
    there. Every load path refuses it (sync, async, read-only, with and without the
    snapshot), and nothing is ever written on top of it: neither by a controller loaded
    before the rows were lost nor by an append at the shorter log's version."""
    path = tmp_path / "events.db"
    c, _ = _store_file(path)
    assert c.version == 38
    before = RunController.load(SQLiteEventStore(path), RUN)
    left = c.version - lost
    with _raw(path) as raw:
        raw.execute("DELETE FROM events WHERE run_id = ? AND seq >= ?", (RUN, left))
    for readonly in (False, True):
        store = SQLiteEventStore(path, readonly=readonly)
        for load in _loads(store):
            with pytest.raises(SchemaError, match=f"holds {left} events but its head says 38"):
                load()
        store.close()

    async def async_loads() -> None:
        store = AsyncSQLiteEventStore(path)
        try:
            for load in (lambda: store.load(RUN), lambda: store.load_latest(RUN),
                         lambda: RunController.load_async(store, RUN)):
                with pytest.raises(SchemaError, match="head says 38"):
                    await load()
        finally:
            await store.close()

    asyncio.run(async_loads())
    store = SQLiteEventStore(path)
    with pytest.raises(SchemaError, match="head says 38"):
        before.add_input(["on top"])
    with pytest.raises(SchemaError, match="head says 38"):
        store.append(RUN, c.events[left:left + 1], left)
    store.close()
    assert len(_stored_log(path) or []) == left  # nothing was written on top


def test_a_head_an_older_version_wrote_gets_its_version_when_opened(tmp_path: Path) -> None:
    """A database whose heads have no version: read-only, nothing is checked (and nothing
    changed); opened for writing, each head gets its log's length, checked from then on."""
    path = tmp_path / "events.db"
    c, other = _store_file(path)
    with _raw(path) as raw:
        raw.execute("ALTER TABLE runs DROP COLUMN version")
    assert RunController.load(SQLiteEventStore(path, readonly=True), RUN).events == c.events
    heads = {h.run_id: h.version for h in SQLiteEventStore(path).list_runs()}
    assert heads == {RUN: c.version, "run-2": other.version}
    with _raw(path) as raw:
        assert raw.execute("SELECT run_id, version FROM runs ORDER BY run_id").fetchall() == [
            (RUN, c.version), ("run-2", other.version)]
        raw.execute("DELETE FROM events WHERE run_id = ? AND seq = ?", (RUN, c.version - 1))
    with pytest.raises(SchemaError, match="head says 38"):
        RunController.load(SQLiteEventStore(path), RUN)


@pytest.mark.invariant("I10")
@pytest.mark.parametrize("seq", [0, 3, 31, 32, 36])
def test_a_log_with_a_gap_is_refused(tmp_path: Path, seq: int) -> None:
    """A row deleted before the snapshot (found when the prefix is read: ``events``), at
    its edge, or after it (found by the load)."""
    path = tmp_path / "events.db"
    _store_file(path)
    with _raw(path) as raw:
        raw.execute("DELETE FROM events WHERE run_id = ? AND seq = ?", (RUN, seq))
    with pytest.raises(SchemaError, match=r"gap|truncated"):  # noqa: PT012
        c = RunController.load(SQLiteEventStore(path), RUN)
        c.events  # noqa: B018
    with pytest.raises(SchemaError):
        RunController.load(SQLiteEventStore(path), RUN, snapshot=False)
    with pytest.raises(SchemaError):
        SQLiteEventStore(path).load(RUN)


@pytest.mark.invariant("I10")
@pytest.mark.parametrize("change", ["row-seq", "body-seq", "not-json", "not-text"])
def test_a_damaged_row_is_refused(tmp_path: Path, change: str) -> None:
    path = tmp_path / "events.db"
    _store_file(path)
    with _raw(path) as raw:
        if change == "row-seq":  # the last row moved past a hole
            raw.execute("UPDATE events SET seq = 100 WHERE run_id = ? AND seq = 37", (RUN,))
        elif change == "body-seq":  # two rows' bodies swapped
            (a,) = raw.execute("SELECT body FROM events WHERE run_id = ? AND seq = 35",
                               (RUN,)).fetchone()
            (b,) = raw.execute("SELECT body FROM events WHERE run_id = ? AND seq = 36",
                               (RUN,)).fetchone()
            raw.execute("UPDATE events SET body = ? WHERE run_id = ? AND seq = 35", (b, RUN))
            raw.execute("UPDATE events SET body = ? WHERE run_id = ? AND seq = 36", (a, RUN))
        elif change == "not-json":
            raw.execute("UPDATE events SET body = '{\"type\":' WHERE run_id = ? AND seq = 36",
                        (RUN,))
        else:
            raw.execute("UPDATE events SET body = x'00ff' WHERE run_id = ? AND seq = 36",
                        (RUN,))
    for snapshot in (True, False):
        with pytest.raises(SchemaError):
            RunController.load(SQLiteEventStore(path), RUN, snapshot=snapshot)


@pytest.mark.invariant("I10")
def test_a_stored_body_must_carry_its_rows_seq(tmp_path: Path) -> None:
    # SS11: load never returns a log other than its rows: a body whose seq is not its
    # row's (here a later one) is damage, refused
    path = tmp_path / "e.db"
    store = SQLiteEventStore(path)
    c = RunController.start(run_id="r", session_id=None, store=store)
    c.add_input(["a"])
    c.add_input(["b"])
    store.close()
    raw = sqlite3.connect(path)
    (body,) = raw.execute("SELECT body FROM events WHERE seq = 2").fetchone()
    event = json.loads(body)
    event["seq"] = 3
    raw.execute("UPDATE events SET body = ? WHERE seq = 2", (json.dumps(event),))
    raw.commit()
    raw.close()
    reopened = SQLiteEventStore(path)
    try:
        with pytest.raises(SchemaError):
            reopened.load("r")
    finally:
        reopened.close()


def test_a_shorter_prefix_in_a_store_is_never_shown_as_the_log() -> None:
    """A store (memory) whose log lost events before the snapshot a run was loaded from:
    ``events`` refuses rather than returning fewer."""
    store = MemoryEventStore()
    _long_run(store)
    c = RunController.load(store, RUN)
    del store._logs[RUN][5]
    with pytest.raises(SchemaError, match="lacks events before the snapshot"):
        c.events  # noqa: B018


# ------------------------------------------------------------- the command


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "statemachine", *args], capture_output=True,
                          text=True, timeout=300, check=False,
                          cwd=Path(__file__).resolve().parents[2])


def test_inspect_warns_about_a_bad_snapshot_in_one_line_and_shows_the_whole_log(
        tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    c, _ = _store_file(path)
    with _raw(path) as raw:
        raw.execute("UPDATE snapshots SET version = 1000")  # once: a stale state, exit 0
    done = _cli("inspect", "--store", str(path), "--run", RUN)
    assert done.returncode == 0, done.stderr
    assert f"{c.version} events" in done.stdout
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("statemachine inspect: warning: SnapshotIgnored: run 'run-1'")
    replayed = _cli("replay", "--store", str(path), "--run", RUN)
    assert (replayed.returncode, replayed.stderr) == (0, "")  # the whole log, no snapshot


def test_inspect_refuses_a_log_truncated_under_its_snapshot(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    _store_file(path)
    with _raw(path) as raw:
        raw.execute("DELETE FROM events WHERE run_id = ? AND seq >= 30", (RUN,))
    done = _cli("inspect", "--store", str(path), "--run", RUN)
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert "SchemaError" in line
    assert "truncated" in line


# ------------------------------------------------------- the corruption loop


KINDS = ("event-byte", "event-body", "event-seq", "delete-row", "delete-tail",
         "snapshot-byte", "snapshot-version", "snapshot-digest", "delete-snapshot",
         "foreign-snapshot", "page-byte")
SNAPSHOT_ONLY = frozenset({"snapshot-byte", "snapshot-version", "snapshot-digest",
                           "delete-snapshot", "foreign-snapshot"})
"""Corruptions of a snapshot alone: the run must load exactly (the log is intact)."""
CORRUPTIONS = 330
SHOWN: dict[str, collections.Counter[str]] = {}


def _flip(text: str, rng: random.Random) -> str:
    """``text`` with one character changed (to another)."""
    at = rng.randrange(len(text))
    choices = [c for c in '{}[]":,0123456789abcdeflnrstuTRS \\x' if c != text[at]]
    return text[:at] + rng.choice(choices) + text[at + 1:]


def _corrupt(path: Path, kind: str, rng: random.Random) -> None:
    if kind == "page-byte":
        data = bytearray(path.read_bytes())
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(100, len(data))] = rng.randrange(256)
        path.write_bytes(bytes(data))
        return
    with _raw(path) as raw:
        rows = raw.execute("SELECT rowid, seq, body FROM events WHERE run_id = ? "
                           "ORDER BY seq", (RUN,)).fetchall()
        rowid, seq, body = rng.choice(rows)
        if kind == "event-byte":
            raw.execute("UPDATE events SET body = ? WHERE rowid = ?", (_flip(body, rng), rowid))
        elif kind == "event-body":
            other = rng.choice(rows)[2]
            raw.execute("UPDATE events SET body = ? WHERE rowid = ?", (rng.choice([
                "", "{", "null", "[]", other,
                json.dumps({"type": "Resumed", "seq": seq}),
                json.dumps({"type": "ModelCallBegun", "seq": seq}),
            ]), rowid))
        elif kind == "event-seq":
            for value in rng.sample([seq + 1, seq - 1, seq + 100, -1, "x", 3.5], 6):
                with contextlib.suppress(sqlite3.IntegrityError):
                    raw.execute("UPDATE events SET seq = ? WHERE rowid = ?", (value, rowid))
                    break
        elif kind == "delete-row":
            raw.execute("DELETE FROM events WHERE rowid = ?", (rowid,))
        elif kind == "delete-tail":
            raw.execute("DELETE FROM events WHERE run_id = ? AND seq >= ?",
                        (RUN, len(rows) - rng.randint(1, 12)))
        elif kind == "snapshot-byte":
            (text,) = raw.execute("SELECT body FROM snapshots WHERE run_id = ?",
                                  (RUN,)).fetchone()
            raw.execute("UPDATE snapshots SET body = ? WHERE run_id = ?",
                        (_flip(text, rng), RUN))
        elif kind == "snapshot-version":
            raw.execute("UPDATE snapshots SET version = version + ? WHERE run_id = ?",
                        (rng.choice([-31, -9, -8, -1, 1, 5, 6, 8, 1000]), RUN))
        elif kind == "snapshot-digest":
            raw.execute("UPDATE snapshots SET digest = ? WHERE run_id = ?",
                        (rng.choice([None, "", "0" * 64, hashlib.sha256(b"x").hexdigest()]),
                         RUN))
        elif kind == "delete-snapshot":
            raw.execute("DELETE FROM snapshots WHERE run_id = ?", (RUN,))
        else:  # foreign-snapshot: run-2's, verified, in run-1's row
            raw.execute("UPDATE snapshots SET (version, body, digest) = (SELECT version, "
                        "body, digest FROM snapshots WHERE run_id = 'run-2') "
                        "WHERE run_id = ?", (RUN,))


def _stored_log(path: Path) -> list[Any] | None:
    """What the store's file holds for the run, decoded row by row as stored (None when
    the file cannot be read at all)."""
    try:
        with _raw(path) as raw:
            rows = raw.execute("SELECT seq, body FROM events WHERE run_id = ? ORDER BY seq",
                               (RUN,)).fetchall()
    except sqlite3.DatabaseError:
        return None
    return [codec.decode_stored_event(codec.parse(body), seq) for seq, body in rows]


@pytest.mark.invariant("I10")
def test_random_corruptions_load_exactly_or_fail_typed(tmp_path: Path) -> None:
    pristine = tmp_path / "pristine.db"
    original, _ = _store_file(pristine)
    vouched = _snapshot_row(pristine)[0]
    rng = random.Random(20240611)
    outcomes: dict[str, collections.Counter[str]] = {k: collections.Counter() for k in KINDS}
    for attempt in range(CORRUPTIONS):
        kind = KINDS[attempt % len(KINDS)]
        work = tmp_path / f"c{attempt}"
        work.mkdir()
        path = work / "events.db"
        shutil.copyfile(pristine, path)
        _corrupt(path, kind, rng)
        where = f"corruption {attempt} ({kind})"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", SnapshotIgnored)
            refused: ControlError | None = None
            try:
                store = SQLiteEventStore(path, readonly=attempt % 2 == 1)
                loaded = RunController.load(store, RUN)
                events = loaded.events  # the whole log, read through the store
            except (*TYPED, RunNotFound) as error:
                refused = error
        if refused is not None:
            assert kind not in SNAPSHOT_ONLY, (where, refused)
            if type(refused) is RunNotFound:
                assert not _stored_log(path), where
            outcomes[kind]["typed " + type(refused).__name__] += 1
            continue
        ignored = any(issubclass(w.category, SnapshotIgnored) for w in caught)
        # never a gap, never shorter than the verified snapshot, always what is stored
        assert [e.seq for e in events] == list(range(len(events))), where
        assert len(events) == loaded.version, where
        assert len(events) >= vouched or ignored, where
        stored = _stored_log(path)
        assert stored is not None, where
        assert list(events) == stored, where
        if events == original.events and loaded.state == original.state:
            assert kind not in SNAPSHOT_ONLY or ignored or kind == "delete-snapshot", where
            outcomes[kind]["exact" + (" (snapshot ignored)" if ignored else "")] += 1
            continue
        # the log itself changed in a way no check can see: a legal event where another
        # stood (I10: legal edits are not detected), or the last events gone past the
        # newest snapshot. The run is then exactly that log, replayed.
        assert kind not in SNAPSHOT_ONLY, where
        full = RunController.load(SQLiteEventStore(path, readonly=True), RUN,
                                  snapshot=False)
        assert full.events == events, where
        assert loaded.state == full.state, where
        shorter = len(events) < len(original.events)
        assert kind != "delete-tail", where  # the head's version tells a lost tail
        outcomes[kind]["legal shorter log" if shorter else "legal edit"] += 1
    SHOWN.update(outcomes)
    print("\ncorruptions:", CORRUPTIONS)
    for kind, counts in outcomes.items():
        print(f"  {kind}: {dict(counts)}")
    totals = collections.Counter[str]()
    for counts in outcomes.values():
        for outcome, n in counts.items():
            totals[outcome.split(" (")[0].split(" ")[0]] += n
    assert totals["typed"] > 0
    assert totals["exact"] > 0
    for kind in SNAPSHOT_ONLY:  # each snapshot corruption was tried, and loaded exactly
        assert sum(outcomes[kind].values()) > 0
        assert set(outcomes[kind]) <= {"exact", "exact (snapshot ignored)"}, kind


@pytest.mark.parametrize("events", [0, 3])
def test_loading_without_a_snapshot_reads_the_log_once(tmp_path: Path, events: int,
                                                       monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    """With no snapshot the store's newest-snapshot read holds the whole log (none: no
    run), so a load reads the store once: a missing run is `RunNotFound`, a short run
    loads every event, and neither reads the log a second time."""
    store = SQLiteEventStore(tmp_path / "events.db")
    if events:
        c = RunController.start(run_id="r", session_id="s", store=store)
        c.hook_ran("agent_start")
        c.begin_model_call()
    reads: list[str] = []
    for name in ("load_latest_measured", "load_measured"):
        real = getattr(SQLiteEventStore, name)

        def counted(self: Any, run_id: str, real: Any = real, name: str = name) -> Any:
            reads.append(name)
            return real(self, run_id)

        monkeypatch.setattr(SQLiteEventStore, name, counted)
    if events:
        loaded = RunController.load(store, "r")
        assert [type(e).__name__ for e in loaded.events] == [
            "RunStarted", "HookRan", "ModelCallBegun"]
    else:
        with pytest.raises(RunNotFound):
            RunController.load(store, "r")
    assert reads == ["load_latest_measured"]
