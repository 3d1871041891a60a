"""The read verbs of the ``statemachine`` command against strange inputs, in a subprocess:
a signed log checked with ``replay --key-file`` (and refused every way a chain can fail),
FILE as ``-`` for standard input, an integer past Python's 4,300-digit limit, a writer's
``-wal`` and ``-shm`` left byte for byte as they were (a live writer, a crashed one, a
read-only directory), and a run drawn at a page's width."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from statemachine import RunController, SQLiteEventStore, Step
from statemachine import diagrams as diagrams_module
from statemachine.codec import CHAIN_MISSING, CHAIN_REFUSED
from tests.helpers import at_interruption, failed, run_charge
from tests.tools.test_cli import COMMAND, ROOT, _one_line_error

KEY = b"k3y: the operator's secret"


def cli(*args: str, stdin: str | None = None,
        cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*COMMAND, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, check=False, input=stdin,
                          stdin=None if stdin is not None else subprocess.DEVNULL)


def _charged() -> RunController:
    c = at_interruption()
    run_charge(c)
    return c


# ------------------------------------------------------------ replay --key-file


def _signed_case(case: str, tmp_path: Path) -> tuple[list[str], str | None]:
    """A replay of a signed (or unsigned) log; what its one error line says, or None when
    it must verify."""
    c = _charged()
    doc: dict[str, Any] = c.to_json(key=KEY)
    key = tmp_path / "key"
    key.write_bytes(KEY)
    says: str | None = None
    if case == "key-with-newline":
        key.write_bytes(KEY + b"\n")
    elif case == "key-with-crlf":
        key.write_bytes(KEY + b"\r\n")
    elif case == "another-key":
        key.write_bytes(KEY + b"!")
        says = CHAIN_REFUSED
    elif case == "key-with-two-newlines":  # only one is stripped: the key differs
        key.write_bytes(KEY + b"\n\n")
        says = CHAIN_REFUSED
    elif case == "tampered-event":  # a legal edit: only the chain can see it
        completed = next(e for e in doc["events"] if e["type"] == "ToolCompleted")
        completed["output"] = "charged 7000"
        says = CHAIN_REFUSED
    elif case == "event-removed":
        doc["events"].pop()
        says = CHAIN_REFUSED
    elif case == "chain-stripped":
        del doc["chain"]
        says = CHAIN_MISSING
    elif case == "unsigned-log":
        doc = c.to_json()
        says = CHAIN_MISSING
    elif case == "signed-without-key":
        says = "signed (it carries a keyed chain) and was not checked: give --key-file"
    elif case == "empty-key-file":
        key.write_bytes(b"\n")
        says = "holds no key"
    elif case == "missing-key-file":
        key = tmp_path / "nope"
        says = "no such file"
    run = tmp_path / "run.json"
    run.write_text(json.dumps(doc))
    args = ["replay", str(run)]
    if case != "signed-without-key":
        args += ["--key-file", str(key)]
    return args, says


SIGNED_CASES = ["key", "key-with-newline", "key-with-crlf", "another-key",
                "key-with-two-newlines", "tampered-event", "event-removed", "chain-stripped",
                "unsigned-log", "signed-without-key", "empty-key-file", "missing-key-file"]


@pytest.mark.parametrize("case", SIGNED_CASES)
def test_replay_checks_the_keyed_chain_with_the_key_file(case: str, tmp_path: Path) -> None:
    args, says = _signed_case(case, tmp_path)
    done = cli(*args)
    if says is None:
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(f"ok: {len(_charged().events)} events replayed, every "
                                      "transition legal, the keyed chain verified; step ")
        return
    line = _one_line_error(done)
    assert says in line
    assert "ok" not in done.stdout
    assert KEY.decode() not in line  # the key is never echoed


def test_an_unsigned_log_replays_without_a_key(tmp_path: Path) -> None:
    run = tmp_path / "run.json"
    run.write_text(json.dumps(_charged().to_json()))
    done = cli("replay", str(run))
    assert done.returncode == 0, done.stderr
    assert "keyed chain" not in done.stdout


def test_a_key_file_is_for_a_file_not_a_store(tmp_path: Path) -> None:
    store = SQLiteEventStore(tmp_path / "events.db")
    at_interruption(store=store)
    store.close()
    (tmp_path / "key").write_bytes(KEY)
    line = _one_line_error(cli("replay", "--store", str(tmp_path / "events.db"), "--run",
                               "run-1", "--key-file", str(tmp_path / "key")))
    assert "a store's log carries no keyed chain" in line


# ------------------------------------------------------------------ FILE as -


@pytest.mark.parametrize("verb", ["inspect", "replay", "render"])
def test_file_may_be_standard_input(verb: str, tmp_path: Path) -> None:
    c = _charged()
    text = json.dumps(c.to_json())
    extra = ["--out", str(tmp_path)] if verb == "render" else []
    done = cli(verb, "-", *extra, stdin=text)
    assert done.returncode == 0, done.stderr
    from_file = tmp_path / "run.json"
    from_file.write_text(text)
    if verb == "render":
        assert (tmp_path / "run-run-1.mmd").read_text() == diagrams_module.run_mermaid(
            diagrams_module.run_path(c.events))
    else:
        assert done.stdout == cli(verb, str(from_file)).stdout


def test_a_signed_log_on_standard_input_is_checked(tmp_path: Path) -> None:
    (tmp_path / "key").write_bytes(KEY)
    signed = json.dumps(_charged().to_json(key=KEY))
    done = cli("replay", "-", "--key-file", str(tmp_path / "key"), stdin=signed)
    assert done.returncode == 0, done.stderr
    assert "the keyed chain verified" in done.stdout
    tampered = signed.replace("charged 7", "charged 9")
    assert CHAIN_REFUSED in _one_line_error(cli("replay", "-", "--key-file",
                                                str(tmp_path / "key"), stdin=tampered))


def test_standard_input_errors_name_it_and_dot_slash_dash_is_a_file(tmp_path: Path) -> None:
    line = _one_line_error(cli("inspect", "-", stdin="{not json"))
    assert "not valid JSON" in line
    line = _one_line_error(cli("inspect", "-", stdin=""))
    assert "not valid JSON" in line
    (tmp_path / "-").write_text(json.dumps(_charged().to_json()))
    done = cli("replay", "./-", stdin="{not json", cwd=tmp_path)  # the file, not stdin
    assert done.returncode == 0, done.stderr


# --------------------------------------------------------- the 4,300-digit limit


@pytest.mark.parametrize("digits", [4301, 10_000])
@pytest.mark.parametrize("sign", ["", "-"])
def test_an_int_past_the_digit_limit_is_refused_for_that_reason(digits: int, sign: str,
                                                                tmp_path: Path) -> None:
    text = json.dumps(_charged().to_json()).replace('"charged 7"', sign + "9" * digits, 1)
    assert text.count("9" * digits) == 1
    run = tmp_path / "run.json"
    run.write_text(text)
    for verb in ("inspect", "replay"):
        line = _one_line_error(cli(verb, str(run)))
        assert "an integer of more than 4300 digits" in line
        assert "not valid JSON" not in line
        assert "9" * 300 not in line


def test_an_int_within_the_digit_limit_is_not_refused_for_its_digits(tmp_path: Path) -> None:
    text = json.dumps(_charged().to_json()).replace('"charged 7"', "9" * 4300, 1)
    run = tmp_path / "run.json"
    run.write_text(text)
    done = cli("replay", str(run))
    assert done.returncode == 0, done.stderr


# ------------------------------------------------------------ -wal and -shm


def _side_files(db: Path) -> dict[str, tuple[str, int]]:
    """Every file beside the database: its bytes' digest and its mtime."""
    return {p.name: (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(db.parent.iterdir())}


READ_VERBS = [["inspect"], ["inspect", "--json"], ["replay"], ["render", "--out", "OUT"],
              ["list"]]


def _read_verbs(db: Path, out: Path) -> Iterator[subprocess.CompletedProcess[str]]:
    for verb in READ_VERBS:
        args = [str(out) if a == "OUT" else a for a in verb]
        run = [] if verb[0] == "list" else ["--run", "run-1"]
        yield cli(*args, "--store", str(db), *run)


def test_read_verbs_leave_a_live_writers_shm_as_it_was(tmp_path: Path) -> None:
    """A writer holds the store open with WAL, its last events only in the -wal and its
    -shm present: every read verb sees those events, and the -shm's bytes and mtime (and
    every other file's) are as they were."""
    db = tmp_path / "store" / "events.db"
    db.parent.mkdir()
    writer = SQLiteEventStore(db)
    try:
        c = at_interruption(store=writer)
        c.approve("charge")
        assert (db.parent / "events.db-shm").exists()
        assert (db.parent / "events.db-wal").stat().st_size > 0
        before = _side_files(db)
        for done in _read_verbs(db, tmp_path / "out"):
            assert done.returncode == 0, done.stderr
            assert _side_files(db) == before, done.args
        assert f"ok: {c.version} events replayed" in cli(
            "replay", "--store", str(db), "--run", "run-1").stdout
        c.approve("audit")  # the writer goes on writing, unharmed
        assert RunController.load(writer, "run-1").version == c.version
    finally:
        writer.close()


def _crashed_writer(db: Path) -> None:
    """A writer process killed with its -wal and -shm left beside the database."""
    code = ("import os, sys\n"
            "from statemachine import SQLiteEventStore\n"
            "from tests.helpers import at_interruption\n"
            "c = at_interruption(store=SQLiteEventStore(sys.argv[1]))\n"
            "c.approve('charge')\n"
            "os.kill(os.getpid(), 9)\n")
    done = subprocess.run([sys.executable, "-c", code, str(db)], cwd=ROOT, check=False,
                          capture_output=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert {p.name for p in db.parent.iterdir()} >= {"events.db-wal", "events.db-shm"}


@contextlib.contextmanager
def read_only(folder: Path) -> Iterator[None]:
    """``folder`` read-only for the command: a read-only bind mount as root (whom file
    modes do not stop), else its mode."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        try:
            yield
        finally:
            folder.chmod(0o755)
        return
    if shutil.which("mount") is None or subprocess.run(
            ["mount", "--bind", str(folder), str(folder)], capture_output=True,
            check=False).returncode != 0:
        pytest.skip("root here cannot bind-mount a folder read-only")
    try:
        remount = subprocess.run(["mount", "-o", "remount,ro,bind", str(folder)],
                                 capture_output=True, check=False)
        assert remount.returncode == 0, remount.stderr
        yield
    finally:
        for lazy in ([], ["-l"]):
            if subprocess.run(["umount", *lazy, str(folder)], capture_output=True,
                              check=False).returncode == 0:
                break


@pytest.mark.parametrize("folder", ["writable", "read-only"])
def test_read_verbs_read_a_crashed_writers_files_and_leave_them(folder: str,
                                                                tmp_path: Path) -> None:
    db = tmp_path / "store" / "events.db"
    db.parent.mkdir()
    _crashed_writer(db)
    expected = at_interruption()
    expected.approve("charge")
    before = _side_files(db)
    with read_only(db.parent) if folder == "read-only" else contextlib.nullcontext():
        if folder == "read-only":
            with pytest.raises(OSError, match=r"Read-only|Permission"):
                (db.parent / "probe").write_text("x")
        for done in _read_verbs(db, tmp_path / "out"):
            assert done.returncode == 0, done.stderr
        replayed = cli("replay", "--store", str(db), "--run", "run-1")
    assert f"ok: {expected.version} events replayed" in replayed.stdout
    assert _side_files(db) == before


# ----------------------------------------------------------- render --run


def _svg_width_px(svg: str) -> float:
    found = re.search(r'<svg width="([\d.]+)pt"', svg)
    assert found is not None
    return float(found.group(1)) * 4 / 3


def _steps_visited(c: RunController) -> set[Step]:
    """The steps a run was in, from replaying its events one at a time (a model of its
    own: each prefix of the log is loaded and its step read)."""
    doc = c.to_json()
    return {RunController.from_json({**doc, "events": doc["events"][:n]}).step
            for n in range(1, len(doc["events"]) + 1)}


RUNS = {"interrupted": at_interruption, "charged": _charged, "unsettled": failed}


@pytest.mark.parametrize("name", list(RUNS))
def test_a_runs_drawing_shows_its_steps_and_where_they_lead(name: str) -> None:
    c = RUNS[name]()
    path = diagrams_module.run_path(c.events)
    visited = _steps_visited(c)
    mermaid = diagrams_module.run_mermaid(path)
    dot = diagrams_module.run_dot(path)
    for step in visited:
        assert f'{step.value}("{step.name}")' in mermaid or \
            f'{step.value}(["{step.name}"])' in mermaid
        assert f'{step.value} [label="{step.name}"' in dot
    assert f"class {c.step.value} current" in mermaid
    assert re.search(rf'{c.step.value} \[label="{c.step.name}"[^\]]*fillcolor="#ffd54f"', dot)
    # the run's own moves are drawn bold, the rest of its part is not
    bold = set(re.findall(r'(\w+) -> (\w+) \[label="[^"]*", color="#e65100", penwidth=3',
                          dot))
    moved = {(a.value, b.value) for a, b, _ in path.visited if a is not b}
    assert bold == moved
    # only the steps it visited and one move away are drawn: not the whole machine
    drawn = set(re.findall(r"^    (\w+) \[label=", dot, re.M))
    nearby = {e.dest for e in diagrams_module.overview_edges()
              if e.source in {s.value for s in visited}}
    assert {s.value for s in visited} <= drawn <= {s.value for s in visited} | nearby | {
        Step.TERMINAL_UNRECOVERABLE.value}
    assert "[" not in "".join(re.findall(r'label="([^"]*)"', dot.split("\n", 3)[3]))


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz is not installed")
@pytest.mark.parametrize("name", list(RUNS))
def test_render_draws_a_run_at_a_pages_width(name: str, tmp_path: Path) -> None:
    c = RUNS[name]()
    run = tmp_path / "run.json"
    run.write_text(json.dumps(c.to_json()))
    done = cli("render", str(run), "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    svg = (tmp_path / f"run-{c.run_id}.svg").read_text()
    assert _svg_width_px(svg) <= 1100
    titles = set(re.findall(r"<title>(\w+)</title>", svg))
    assert {s.value for s in _steps_visited(c)} | {c.step.value} <= titles


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz is not installed")
def test_a_run_through_every_step_still_fits_a_page(tmp_path: Path) -> None:
    every = frozenset((Step(e.source), Step(e.dest), e.triggers[0])
                      for e in diagrams_module.overview_edges()
                      if e.source != diagrams_module.ANY_LIVE_STEP)
    path = diagrams_module.RunPath(every, Step.COMPLETED, "everywhere")
    written = diagrams_module.write(tmp_path, basename="r", path=path)
    svg = next(p for p in written if p.suffix == ".svg").read_text()
    assert _svg_width_px(svg) <= 1100
    assert {s.value for s in Step} <= set(re.findall(r"<title>(\w+)</title>", svg))


@pytest.mark.parametrize("leave_shm", [False, True])
def test_a_reader_in_a_writers_process_never_blocks_its_writes_unless_told_to_leave_shm(
        tmp_path: Path, leave_shm: bool) -> None:
    """A writer whose first connection opens while a read of the same process is under
    way shares that read's shared-memory index: a ``leave_shm`` reader (the CLI's, alone
    in its process) makes it read-only, a plain read-only store (what a process that also
    writes, such as a console, uses) does not."""
    from statemachine import ControlError, RunController

    db = tmp_path / "events.db"
    first = SQLiteEventStore(db)
    RunController.start(run_id="r0", session_id=None, store=first)
    first.close()
    holder = subprocess.Popen(  # a live writer elsewhere keeps the -wal and -shm in place
        [sys.executable, "-c", "import sqlite3, sys, time\n"
         "c = sqlite3.connect(sys.argv[1]); c.execute('PRAGMA journal_mode=WAL')\n"
         "c.execute('SELECT count(*) FROM events').fetchone(); print('ready', flush=True)\n"
         "time.sleep(60)", str(db)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None
    assert holder.stdout.readline().strip() == "ready"
    reader = SQLiteEventStore(db, readonly=True, leave_shm=leave_shm)
    outcome: list[str] = []

    def during_a_read(conn: sqlite3.Connection) -> None:
        conn.execute("BEGIN")
        conn.execute("SELECT count(*) FROM events").fetchone()
        writer = SQLiteEventStore(db)
        try:
            RunController.start(run_id="r1", session_id=None, store=writer)
            outcome.append("written")
        except ControlError:
            outcome.append("refused")
        finally:
            writer.close()
        conn.execute("COMMIT")

    try:
        reader._query_readonly(during_a_read, immutable=False)
    finally:
        holder.kill()
        holder.wait()
    assert outcome == (["refused"] if leave_shm else ["written"])
