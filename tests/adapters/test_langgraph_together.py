"""The LangGraph adapter with the ledger's `SQLiteEventStore` in the checkpoints' own file
(``SqliteSaver`` and the store on one SQLite database, DESIGN §7.7): a checkpoint that
publishes a batch's results is written in one transaction with the publication's staging
and commit. In one process, on files on disk; what ran is counted from the tools' fsynced
effects file, and what landed is read back by connections and stores of the test's own.

Before, this configuration hung: the staging was appended on the store's connection while
the checkpoint's write held the file's write lock, until the store's busy timeout, and the
turn ended in `StorageError`. The kill -9 rows of this configuration are in
test_langgraph_durability.py (mode ``together``).

Under CI a missing ``langgraph`` package fails this module instead of skipping it.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest

try:
    import langgraph  # noqa: F401
except ImportError:  # pragma: no cover - CI installs the extra
    if os.environ.get("CI"):
        raise
    pytest.skip("langgraph is not installed (pip install -e '.[langgraph]')",
                allow_module_level=True)

from langchain_core.messages import HumanMessage, ToolMessage
from langgraph.checkpoint.sqlite import SqliteSaver

from statemachine import SQLiteEventStore, ToolCall
from statemachine.adapters.langgraph import OneWriterSaver, ToolLedger
from statemachine.events import RunClaimed
from statemachine.values import Phase
from statemachine.verifiers import Completed
from tests.drivers.langgraph_driver import (
    FailingPut,
    ScriptedModel,
    build,
    effects,
    make_tools,
)

SCRIPT: list[Any] = [[("charge", {"amount": 7}, "call-charge")], "done"]
BUSY = 2.0
"""The ledger store's busy timeout here (seconds): a wait on the file's write lock that
should never happen ends in `StorageError` this soon, not after the default 30 s."""


def _config(thread: str) -> Any:
    return {"configurable": {"thread_id": thread}}


class _Place:
    """One SQLite file holding LangGraph's checkpoints and the ledger's store (``one``),
    or each in a file of its own (the ledger's in ``ledger.db``)."""

    def __init__(self, folder: Path, *, one: bool = True) -> None:
        folder.mkdir(exist_ok=True)
        self.folder = folder
        self.file = folder / "checkpoints.db"
        self.effects = folder / "effects.txt"
        self.conn = sqlite3.connect(str(self.file), check_same_thread=False)
        self.statements: list[str] = []
        self.conn.set_trace_callback(self.statements.append)
        self.inner = SqliteSaver(self.conn)
        self.store = SQLiteEventStore(str(self.file if one else folder / "ledger.db"),
                                      timeout=BUSY)
        self.ledger = ToolLedger(self.store)
        self.saver = OneWriterSaver(self.inner, ledger=self.ledger)
        self.graph = build("ledger", make_tools(self.effects), ScriptedModel(script=SCRIPT),
                           self.saver, ledger=self.ledger)

    def commits(self) -> int:
        """The checkpoint connection's COMMITs so far."""
        return sum(1 for q in self.statements if q.lstrip().upper().startswith("COMMIT"))

    def turn(self, thread: str) -> Any:
        return self.graph.invoke({"messages": [HumanMessage("charge me 7")]},
                                 _config(thread), durability="sync")

    def landed(self, thread: str) -> tuple[bool, list[str]]:
        """Read back by a connection and a store of their own: whether the thread's
        latest checkpoint holds the tool's result, and the run's event types."""
        reader = SqliteSaver(sqlite3.connect(str(self.file), check_same_thread=False))
        found = reader.get_tuple(_config(thread))
        messages = [] if found is None else found.checkpoint["channel_values"]["messages"]
        log = SQLiteEventStore(str(self.store.path)).load(f"langgraph:{thread}")
        return (any(isinstance(m, ToolMessage) for m in messages),
                [type(event).__name__ for event in log])


def test_one_file_writes_the_checkpoint_with_its_publication_in_one_commit(
        tmp_path: Path) -> None:
    """A one-tool turn with the ledger in the checkpoints' file: the tool runs once, its
    result is published once, and the file takes LangGraph's own commits (counted in the
    same turn on a graph whose ledger has a file of its own, less the ledger's writes
    there) plus the ledger's two that must come before LangGraph's (the call's start
    before its body, its result before LangGraph saves the tool's writes): the staging
    and the commit of the publication ride in the checkpoint's transaction."""
    apart = _Place(tmp_path / "apart", one=False)
    apart_commits, apart_ledger = apart.commits(), apart.store.commits
    assert apart.turn("t1")["messages"][-1].content == "done"
    langgraph_own = apart.commits() - apart_commits
    assert apart.store.commits - apart_ledger == 4  # start, result, staging, commit

    one = _Place(tmp_path / "one")
    assert one.saver._together
    assert not apart.saver._together
    before, ledger_before = one.commits(), one.store.commits
    assert one.turn("t1")["messages"][-1].content == "done"
    assert effects(one.effects) == ["charge 7"]
    assert one.commits() - before == langgraph_own
    assert one.store.commits - ledger_before == 2
    holds, kinds = one.landed("t1")
    assert holds
    assert kinds.count("PublicationStaged") == kinds.count("PublicationCommitted") == 1
    c = ToolLedger(SQLiteEventStore(str(one.file))).controller("langgraph:t1")
    assert c.phase("call-charge") is Phase.PUBLISHED
    assert one.turn("t2")["messages"][-1].content == "done"  # and again, another thread
    assert effects(one.effects) == ["charge 7", "charge 7"]


@pytest.mark.invariant("I1", "I6")
@pytest.mark.parametrize("landed", [True, False])
def test_a_checkpoint_write_that_fails_takes_its_publication_with_it(
        tmp_path: Path, landed: bool) -> None:
    """The checkpoint that publishes the result fails, after the saver's own statements
    ran (``landed``) or before them: its error reaches the caller (I6), and neither the
    checkpoint nor the publication's staging is in the file, read back from outside; the
    result stays recorded. Resumed in the same process (whose copy of the run went ahead
    of the store), the graph publishes the result once and never runs the tool again."""
    one = _Place(tmp_path)
    FailingPut(landed=landed).attach(one.inner)
    with pytest.raises(OSError, match="injected"):
        one.turn("t1")
    holds, kinds = one.landed("t1")
    assert not holds
    assert kinds[-2:] == ["ToolStarted", "ToolCompleted"]
    assert effects(one.effects) == ["charge 7"]
    result = one.graph.invoke(None, _config("t1"), durability="sync")
    assert result["messages"][-1].content == "done"
    assert effects(one.effects) == ["charge 7"]
    holds, kinds = one.landed("t1")
    assert holds
    assert kinds.count("PublicationStaged") == kinds.count("PublicationCommitted") == 1
    assert "PublicationFailed" not in kinds


def test_a_ledger_call_on_another_thread_never_waits_on_a_put_that_waits_for_it(
        tmp_path: Path) -> None:
    """Two graph threads through one saver and one ledger in one file. Thread ``b``'s
    tool ends (and its ledger call records the result) while thread ``a``'s checkpoint
    write holds the file's write lock: the put took the ledger's lock first, so ``b``
    waits for the put, never the put for ``b`` while ``b`` waits for the file (which
    ended, before, in ``b``'s `StorageError` after the store's busy timeout, its result
    unrecorded). Both turns complete; each charge ran once."""
    folder = tmp_path
    folder.mkdir(exist_ok=True)
    effects_file = folder / "effects.txt"
    b_running, a_writing = threading.Event(), threading.Event()
    conn = sqlite3.connect(str(folder / "checkpoints.db"), check_same_thread=False)

    def traced(statement: str) -> None:
        # a's first put after b's tool began, its write lock taken (BEGIN IMMEDIATE
        # ran): the one-writer check's read
        if b_running.is_set() and not a_writing.is_set() and statement.startswith(
                "SELECT checkpoint_id FROM checkpoints"):
            a_writing.set()
            threading.Event().wait(0.5)  # b's tool ends meanwhile

    conn.set_trace_callback(traced)
    store = SQLiteEventStore(str(folder / "checkpoints.db"), timeout=BUSY)
    ledger = ToolLedger(store)
    saver = OneWriterSaver(SqliteSaver(conn), ledger=ledger)
    from langchain_core.tools import tool

    from tests.drivers.langgraph_driver import effect

    @tool
    def charge(amount: int) -> str:
        """Charge the customer."""
        effect(effects_file, f"charge {amount}")
        if not b_running.is_set():  # (b's call: the first to run)
            b_running.set()
            assert a_writing.wait(10)
        return f"charged {amount}"

    graph = build("ledger", [charge], ScriptedModel(script=SCRIPT), saver, ledger=ledger)
    outcomes: dict[str, Any] = {}

    def turn(thread: str) -> None:
        try:
            done = graph.invoke({"messages": [HumanMessage("charge me 7")]},
                                _config(thread), durability="sync")
            outcomes[thread] = done["messages"][-1].content
        except Exception as error:  # (the outcome is what is asserted)
            outcomes[thread] = error

    b = threading.Thread(target=turn, args=("b",))
    b.start()
    assert b_running.wait(10)
    a = threading.Thread(target=turn, args=("a",))
    a.start()
    a.join(30)
    b.join(30)
    assert outcomes == {"a": "done", "b": "done"}
    assert effects(effects_file) == ["charge 7", "charge 7"]


def test_a_reader_on_another_thread_waits_for_the_checkpoint_to_commit(
        tmp_path: Path) -> None:
    """A read of the thread on another thread, through the same saver, made while the
    checkpoint that publishes is being written (its statement running, its commit held
    back for the publication's), waits for the commit: it never sees a checkpoint that
    may still be rolled back (it would, on the saver's own connection, without the
    saver's lock)."""
    one = _Place(tmp_path)
    seen: dict[str, Any] = {}
    go, read_done = threading.Event(), threading.Event()

    def read() -> None:
        assert go.wait(30)
        found = one.inner.get_tuple(_config("t1"))
        messages = [] if found is None else found.checkpoint["channel_values"]["messages"]
        seen["holds"] = any(isinstance(m, ToolMessage) for m in messages)
        read_done.set()

    def traced(statement: str) -> None:
        one.statements.append(statement)
        if ("INSERT OR REPLACE INTO checkpoints" in statement and effects(one.effects)
                and not go.is_set()):  # (the checkpoint holding the result)
            go.set()
            threading.Event().wait(0.1)  # the reader asks meanwhile

    held = one.saver._put_held

    def written_then_wait(*args: Any) -> Any:
        written = held(*args)
        seen["waited"] = not read_done.wait(0.3)  # (it must still be waiting)
        return written

    reader = threading.Thread(target=read)
    reader.start()
    one.conn.set_trace_callback(traced)
    one.saver._put_held = written_then_wait  # type: ignore[method-assign]
    assert one.turn("t1")["messages"][-1].content == "done"
    reader.join(10)
    assert seen["waited"] is True
    assert seen["holds"] is True  # read once the checkpoint committed


def test_a_threads_first_write_settles_a_call_in_doubt_inside_its_transaction(
        tmp_path: Path) -> None:
    """A fresh process whose first call on a thread is a checkpoint write (here an
    ``update_state``) opens the run there: a call in doubt that a verifier can settle is
    claimed and settled then, its events written into the write's transaction (on the
    store's own connection they would wait for the file's write lock the write holds,
    until the busy timeout). The settled result and the checkpoint land together."""
    one = _Place(tmp_path)
    c = one.ledger.controller("langgraph:t1")
    c.begin_model_call()
    c.model_responded([ToolCall("x", "charge", {"amount": 7})])
    c.begin_tool("x")
    c.flush()  # started; then the process died
    fresh = ToolLedger(SQLiteEventStore(str(one.file), timeout=BUSY),
                       verifiers={"charge": lambda context: Completed("charged 7")})
    saver = OneWriterSaver(SqliteSaver(sqlite3.connect(str(one.file),
                                                       check_same_thread=False)),
                           ledger=fresh)
    graph = build("ledger", make_tools(one.effects), ScriptedModel(script=SCRIPT), saver,
                  ledger=fresh)
    graph.update_state(_config("t1"), {"messages": [HumanMessage("a note")]},
                       as_node="model")
    settled = ToolLedger(SQLiteEventStore(str(one.file))).controller("langgraph:t1")
    assert settled.phase("x") is Phase.COMPLETED
    assert any(isinstance(e, RunClaimed) for e in settled.events)
    found = SqliteSaver(sqlite3.connect(str(one.file))).get_tuple(_config("t1"))
    assert found is not None
    assert effects(one.effects) == []


@pytest.mark.invariant("I1")
def test_a_copy_ahead_of_a_rolled_back_write_is_dropped_before_another_attempt_catches_up(
        tmp_path: Path) -> None:
    """The checkpoint that publishes fails before the saver writes it, and its
    transaction, which carried the publication's staging, rolls back: this process's
    copy of the run is then one event ahead of the store. Another attempt (another
    process's ledger on the same file) then appends one event of its own, its claim: a
    fence that counts events would find the counts equal, and the copy would append its
    reconcile onto the other attempt's claim, a log that no longer replays. Resumed
    here, the graph goes on from the run as the store holds it (the copy was dropped
    when the write failed): the log replays, the result is published once, the tool
    never runs again."""
    one = _Place(tmp_path)
    FailingPut(landed=False).attach(one.inner)
    with pytest.raises(OSError, match="injected"):
        one.turn("t1")
    run = "langgraph:t1"
    other = ToolLedger(SQLiteEventStore(str(one.file)), owner="p2").controller(run)
    other.flush()  # (as many events as were rolled back)
    result = one.graph.invoke(None, _config("t1"), durability="sync")
    assert result["messages"][-1].content == "done"
    assert effects(one.effects) == ["charge 7"]
    replayed = ToolLedger(SQLiteEventStore(str(one.file))).controller(run)
    assert replayed.phase("call-charge") is Phase.PUBLISHED
    kinds = [type(event).__name__ for event in replayed.events]
    assert kinds.count("PublicationStaged") == kinds.count("PublicationCommitted") == 1


def test_a_cursor_of_the_users_own_on_the_saver_is_kept(tmp_path: Path) -> None:
    """A ``cursor`` the user set on the ``SqliteSaver`` instance (instrumentation) is in
    place after a checkpoint that publishes, and still used."""
    one = _Place(tmp_path)
    calls: list[bool] = []
    plain = SqliteSaver.cursor

    def counted(transaction: bool = True) -> Any:
        calls.append(transaction)
        return plain(one.inner, transaction)

    one.inner.cursor = counted  # type: ignore[method-assign]
    assert one.turn("t1")["messages"][-1].content == "done"
    assert one.inner.cursor is counted
    before = len(calls)
    assert one.inner.get_tuple(_config("t1")) is not None
    assert len(calls) == before + 1
