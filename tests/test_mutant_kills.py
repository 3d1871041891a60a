"""Tests written to kill the mutants of `mutate.catalogue` that the rest of the suite let
survive. Each states a promise of the library and checks it against an outcome worked out
from the rule itself (DESIGN's invariants, the documented contract), never read back from
what the code recorded. The mutant each family was written for is named in its comment.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path
from typing import Any

import pytest

from statemachine import (
    Action,
    Execute,
    InvalidTransition,
    MemoryEventStore,
    Phase,
    RecoveryPolicy,
    RunController,
    SchemaError,
    SessionWrite,
    SnapshotIgnored,
    SQLiteEventStore,
    Step,
    StorageError,
    ToolCall,
    ToolInDoubt,
    sqlite,
)
from statemachine import events as ev
from statemachine.machine import replay
from statemachine.payloads import JSON, digests
from statemachine.runner import (
    Agent,
    FunctionTool,
    MaxTurnsExceeded,
    ModelResponse,
    OutputGuardrail,
    OutputGuardrailTripwire,
    Runner,
    ToolGuardrail,
)
from statemachine.runner.agents import ALLOW, reject_content
from statemachine.runner.remote import RemoteEvent, RemoteToolExecutor, RemoteUnavailable
from statemachine.sessions import MemorySession, SQLiteSession
from statemachine.state import RunState
from statemachine.stores import Snapshot, restored
from statemachine.testing import FakeRemote, ScriptedModel
from tests.helpers import SESSION, B, P, assert_refused, at_interruption, failed, staged

# ------------------------------------------------------- forged logs (the replay guards)
# The controller checks these rules before it records, so only a log edited outside it
# shows whether replay checks them too (I10: a log is re-validated as it is loaded).


def _forged(c: RunController, *extra: dict[str, Any]) -> dict[str, Any]:
    """``c``'s document with ``extra`` raw events appended (their seq filled in)."""
    doc: dict[str, Any] = c.to_json()
    for offset, raw in enumerate(extra):
        doc["events"].append({**raw, "seq": c.version + offset})
    return doc


def _refused(doc: dict[str, Any], seq: int) -> None:
    with pytest.raises(InvalidTransition) as info:
        RunController.from_json(doc)
    assert f"event {seq}" in str(info.value)


def _tools_run(*calls: ToolCall) -> RunController:
    c = RunController.start(run_id="forge", session_id=SESSION)
    c.begin_model_call()
    c.model_responded(list(calls))
    assert c.step is Step.TOOLS
    return c


def test_a_log_starting_a_non_idempotent_call_twice_is_refused() -> None:
    # MA11: I11, a started non-idempotent call is never started again
    c = _tools_run(ToolCall("pay", "pay", {"x": 1}), ToolCall("look", "look", {},
                                                                idempotent=True))
    c.begin_tool("pay")
    c.begin_tool("look")
    _refused(_forged(c, {"type": "ToolStarted", "call_id": "pay"}), c.version)
    # the same second start of the idempotent call is legal: the flag is what decides
    again = RunController.from_json(_forged(c, {"type": "ToolStarted", "call_id": "look"}))
    assert again.call("look").starts == 2


def test_a_log_completing_a_call_never_started_is_refused() -> None:
    # MA12: a result belongs to a started call
    c = _tools_run(ToolCall("pay", "pay", {}))
    for kind in ("ToolCompleted", "InDoubtResolved"):
        _refused(_forged(c, {"type": kind, "call_id": "pay", "output": "paid"}), c.version)
    c.begin_tool("pay")
    done = RunController.from_json(_forged(c, {"type": "ToolCompleted", "call_id": "pay",
                                               "output": "paid"}))
    assert done.phase("pay") is Phase.COMPLETED


def test_a_log_appending_over_an_open_attempt_is_refused() -> None:
    # MA24: reconcile decides Append only when no attempt may still be writing
    c = staged()
    assert c.state.attempt_seq is not None
    _refused(_forged(c, {"type": "ReconciledAppend", "take_over": False}), c.version)
    taken = RunController.from_json(_forged(c, {"type": "ReconciledAppend",
                                                "take_over": True}))
    assert taken.state.attempt_seq == c.version


def test_a_log_claiming_a_fail_closed_unsettled_run_is_refused() -> None:
    # MA25: a fail-closed envelope refuses every attempt, so no claim is ever recorded
    closed = staged(RecoveryPolicy.FAIL_CLOSED)
    _refused(_forged(closed, {"type": "RunClaimed", "owner": None}), closed.version)
    open_ = staged(RecoveryPolicy.RECONCILE)
    assert RunController.from_json(_forged(open_, {"type": "RunClaimed", "owner": "w"}
                                           )).step is Step.UNSETTLED


def test_a_log_committing_with_no_attempt_open_is_refused() -> None:
    # MA32: after publication_failed the attempt is over; only reconcile may settle
    c = failed()
    assert c.state.attempt_seq is None
    _refused(_forged(c, {"type": "PublicationCommitted"}), c.version)
    committed = RunController.from_json(_forged(staged(), {"type": "PublicationCommitted"}))
    assert committed.step is not Step.UNSETTLED


def test_a_log_resuming_with_nothing_approved_is_refused() -> None:
    # MA10: resume enters TOOLS only for an approved, unstarted call
    c = at_interruption()
    _refused(_forged(c, {"type": "Resumed"}), c.version)
    c.approve("charge")
    assert RunController.from_json(_forged(c, {"type": "Resumed"})).step is Step.TOOLS


def _staged_over(history: list[JSON], items: list[JSON], *, whole: bool = False
                 ) -> RunController:
    c = RunController.start(run_id="forge", session_id=SESSION)
    c.add_input(items)
    c.stage_publication(items, history, whole=whole)
    return c


def _last_staging(doc: dict[str, Any]) -> dict[str, Any]:
    staging: dict[str, Any] = [e for e in doc["events"] if e["type"] == "PublicationStaged"][-1]
    return staging


def test_a_log_recording_a_read_limit_larger_than_needed_is_refused() -> None:
    # MA21, EN09: the recorded read limit is the smallest that tells the outcomes apart;
    # a larger one (with a frontier long enough to match it) is forged
    history: list[JSON] = [{"h": i} for i in range(5)]
    c = _staged_over(history, [{"n": 9}])
    doc = c.to_json()
    staging = _last_staging(doc)
    form = c.state.form
    # five distinct items and a new one: the last 2 tell "nothing written" from "written"
    assert staging["read_limit"] == 2
    assert staging["frontier"] == list(digests(history[-2:], form))
    assert RunController.from_json(doc).step is Step.UNSETTLED
    staging["read_limit"] = 3
    staging["frontier"] = list(digests(history[-3:], form))
    _refused(doc, staging["seq"])


def test_a_log_recording_another_continuation_is_refused() -> None:
    # MA22: the continuation is implied by the ledger (notify still awaits a decision)
    c = staged()
    doc = c.to_json()
    staging = _last_staging(doc)
    assert staging["continuation"] == Step.INTERRUPTION.value
    staging["continuation"] = Step.RUN_AGAIN.value
    _refused(doc, staging["seq"])


def test_a_log_whose_batch_does_not_match_its_digests_is_refused() -> None:
    # MA31: the staged items are the batch the digests describe (reconcile compares the
    # Session with the digests, the runner writes the items)
    c = staged()
    doc = c.to_json()
    staging = _last_staging(doc)
    staging["items"][0] = {"type": "function_call", "call_id": "charge", "name": "refund"}
    _refused(doc, staging["seq"])


def test_a_frontier_is_whole_only_when_it_covers_the_whole_history() -> None:
    # EN07: frontier_whole says the frontier covers all of P; with the whole Session given
    # but only its last read_limit items kept, it does not
    history: list[JSON] = [{"h": i} for i in range(3)]
    c = _staged_over(history, [{"n": 9}], whole=True)
    envelope = c.envelope
    assert envelope is not None
    assert envelope.read_limit == 2
    assert envelope.frontier == digests(history[-2:], c.state.form)
    assert envelope.frontier_whole is False
    short = _staged_over(history[:1], [{"n": 9}], whole=True)  # P shorter than the limit: all kept
    assert short.envelope is not None
    assert short.envelope.frontier_whole is True
    assert short.envelope.frontier == digests(history[:1], c.state.form)


def test_a_document_whose_run_id_is_not_its_logs_is_refused() -> None:
    # MA35: the RunStarted names the run; a document relabelled as another run is forged
    c = at_interruption()
    doc = c.to_json()
    doc["run_id"] = "another-run"
    with pytest.raises(SchemaError):
        RunController.from_json(doc)
    with pytest.raises(SchemaError):
        replay("another-run", list(c.events))


def test_a_run_with_max_turns_zero_round_trips() -> None:
    # MA34: max_turns=0 is a legal start (no model call at all), so its log loads
    c = RunController.start(run_id="zero", session_id=None, max_turns=0)
    again = RunController.from_json(c.to_json())
    assert again.max_turns == 0
    assert_refused(again, InvalidTransition, again.begin_model_call)


# ------------------------------------------------------------------- staging a batch


def test_a_batch_listing_a_call_twice_is_refused() -> None:
    # MA19: each call's result is published once; a doubled id would publish it twice
    c = at_interruption()
    c.approve("charge")
    c.resume()
    c.begin_tool("charge")
    c.tool_completed("charge", "charged 7")
    items: list[JSON] = [{"type": "function_call_output", "call_id": "charge",
                          "output": "charged 7"}]
    assert_refused(c, InvalidTransition, c.stage_publication, items, P,
                   call_ids=["charge", "charge"])
    c.stage_publication(items, P, call_ids=["charge"])  # the honest batch is accepted


def test_a_batch_naming_a_rejected_call_it_does_not_list_is_refused() -> None:
    # MA20: a rejection's output is a result like any other; an item naming it must be
    # listed in call_ids, or the call would stay unpublished after its output was written
    c = at_interruption()
    c.reject("notify", "not now")
    c.reject("charge", "no")
    items: list[JSON] = [{"type": "function_call_output", "call_id": "notify",
                          "output": "not now"}]
    assert_refused(c, InvalidTransition, c.stage_publication, items, P, call_ids=["charge"])
    c.stage_publication(items, P, call_ids=["notify"])


def test_a_call_id_is_never_reused_in_a_run() -> None:
    # MA04: call ids are new to the run; reusing a published call's id would overwrite
    # its ledger record, and the call could run again
    c = _tools_run(ToolCall("pay", "pay", {}))
    c.begin_tool("pay")
    c.tool_completed("pay", "paid")
    c.stage_publication([{"type": "function_call_output", "call_id": "pay",
                          "output": "paid"}], [], call_ids=["pay"])
    c.publication_committed()
    assert c.phase("pay") is Phase.PUBLISHED
    c.begin_model_call()
    assert_refused(c, InvalidTransition, c.model_responded, [ToolCall("pay", "pay", {})])
    c.model_responded([ToolCall("pay-2", "pay", {})])  # a new id is accepted
    remote = RunController.start(run_id="remote", session_id=None)
    remote.receive_tool_calls([ToolCall("k", "echo", {})])
    assert_refused(remote, InvalidTransition, remote.receive_tool_calls,
                   [ToolCall("k", "echo", {})])


def test_a_posted_result_is_posted_once() -> None:
    # MA07: once the remote holds a call's result, no further post of it is recorded
    c = RunController.start(run_id="remote", session_id=None)
    c.receive_tool_calls([ToolCall("k", "echo", {})])
    c.begin_tool("k")
    c.tool_completed("k", "out")
    c.result_post_failed("k", TimeoutError)  # a failed post leaves the result cached
    c.result_posted("k")
    assert_refused(c, InvalidTransition, c.result_posted, "k")
    assert_refused(c, InvalidTransition, c.result_post_failed, "k", TimeoutError)


def test_a_tool_stage_guardrail_names_a_known_call() -> None:
    # MA13: tool_input/tool_output guardrails are keyed by their call, which must exist
    c = at_interruption()
    for stage in ("tool_input", "tool_output"):
        assert_refused(c, InvalidTransition, c.guardrail_evaluated, "g", {"ok": True},
                       stage=stage, call_id="no-such-call")
        assert_refused(c, InvalidTransition, c.guardrail_evaluated, "g", {"ok": True},
                       stage=stage)
    c.guardrail_evaluated("g", {"ok": True}, stage="tool_input", call_id="charge")
    assert c.recorded_guardrail("g", stage="tool_input", call_id="charge") is not None


def test_input_and_output_guardrails_run_once_per_activation() -> None:
    # ST03: a handoff starts a new activation, in which the input guardrail runs again
    # (once); tool guardrails stay keyed by their call
    c = RunController.start(run_id="acts", session_id=None)
    c.guardrail_evaluated("screen", {"ok": True}, stage="input")
    assert_refused(c, InvalidTransition, c.guardrail_evaluated, "screen", {"ok": True},
                   stage="input")
    c.handoff("specialist")
    assert c.recorded_guardrail("screen", stage="input") is None
    c.guardrail_evaluated("screen", {"ok": False}, stage="input")
    found = c.recorded_guardrail("screen", stage="input")
    assert found is not None
    assert found.result == {"ok": False}
    assert_refused(c, InvalidTransition, c.guardrail_evaluated, "screen", {"ok": True},
                   stage="input")


def test_received_calls_are_approved_and_runnable() -> None:
    # ST13: calls a remote loop hands over need no approval here: they are runnable at
    # once, and the run has tools to run until each has run
    c = RunController.start(run_id="remote", session_id=None)
    c.receive_tool_calls([ToolCall("k1", "echo", {}), ToolCall("k2", "echo", {})])
    assert c.runnable_call_ids() == ("k1", "k2")
    assert c.next_action() is Action.RUN_TOOLS
    c.begin_tool("k1")
    c.tool_completed("k1", 1)
    assert c.runnable_call_ids() == ("k2",)
    assert c.next_action() is Action.RUN_TOOLS
    c.begin_tool("k2")
    c.tool_completed("k2", 2)
    assert c.runnable_call_ids() == ()
    assert c.next_action() is Action.PUBLISH


def test_recorded_input_is_published_only_by_a_batch_that_starts_with_it() -> None:
    # ST16: a batch that does not start with the recorded input leaves it unpublished
    c = RunController.start(run_id="input", session_id=SESSION)
    c.add_input([{"role": "user", "content": "hi"}])
    c.stage_publication([{"role": "user", "content": "other"}], [])
    c.publication_committed()
    assert c.unpublished_input == ({"role": "user", "content": "hi"},)
    assert c.next_action() is Action.PUBLISH
    c.stage_publication([{"role": "user", "content": "hi"}, {"note": 1}],
                        [{"role": "user", "content": "other"}])
    c.publication_committed()
    assert c.unpublished_input == ()


def test_recorded_input_is_published_before_anything_else() -> None:
    # ST18: from every step that stages, recorded input goes to the Session first
    c = at_interruption()
    c.add_input([{"role": "user", "content": "and also"}])
    assert c.next_action() is Action.PUBLISH  # not AWAIT_DECISIONS
    h = RunController.start(run_id="handoff", session_id=SESSION)
    h.add_input([{"role": "user", "content": "hi"}])
    h.handoff("specialist")
    assert h.next_action() is Action.PUBLISH  # not CALL_MODEL


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


# -------------------------------------------------------- controller and its stores


class _PairStore(MemoryEventStore):
    """A memory store whose append takes a Session write with its events (as the
    PostgreSQL stores do), keeping what it was handed."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[SessionWrite] = []

    def append(self, run_id: str, events: Sequence[ev.Event], expected_version: int, *,
               snapshot: Snapshot | None = None, step: Step | None = None,
               session_write: SessionWrite | None = None) -> None:
        super().append(run_id, events, expected_version, snapshot=snapshot, step=step)
        if session_write is not None:
            self.written.append(session_write)


def test_a_session_write_under_another_attempts_id_is_refused() -> None:
    # CT19: the publication id is f"{run_id}:{seq of the event that opened the attempt}"
    store = _PairStore()
    c = staged(store=store)
    opened = [e.seq for e in c.events if type(e) is ev.PublicationStaged][-1]
    for wrong in (f"{c.run_id}:{opened + 1}", f"other-run:{opened}", "x"):
        assert_refused(c, InvalidTransition, c.publication_committed,
                       session_write=SessionWrite(SESSION, wrong, tuple(B)))
    assert store.written == []
    c.publication_committed(session_write=SessionWrite(SESSION, f"{c.run_id}:{opened}",
                                                       tuple(B)))
    assert [w.publication_id for w in store.written] == [f"{c.run_id}:{opened}"]
    assert c.step is not Step.UNSETTLED


class _LostAnswerStore(MemoryEventStore):
    """Appends, then (when armed) loses the answer: the append landed, the caller cannot
    know it (a StorageError with outcome "unknown")."""

    armed = False

    def append(self, run_id: str, events: Sequence[ev.Event], expected_version: int, *,
               snapshot: Snapshot | None = None, step: Step | None = None) -> None:
        super().append(run_id, events, expected_version, snapshot=snapshot, step=step)
        if self.armed:
            self.armed = False
            raise StorageError("the answer was lost", outcome="unknown")


def test_after_an_append_of_unknown_outcome_every_command_is_refused() -> None:
    # CT04: the controller may be behind its log, so it refuses everything (StorageError,
    # nothing appended) until the run is loaded again, which shows what landed
    store = _LostAnswerStore()
    c = RunController.start(run_id="lost", session_id=None, store=store)
    store.armed = True
    with pytest.raises(StorageError):
        c.add_input(["first"])
    for command, args in ((c.add_input, (["second"],)), (c.begin_model_call, ()),
                          (c.abandon, ("gone",))):
        with pytest.raises(StorageError) as info:
            command(*args)
        assert type(info.value) is StorageError
        assert "load the run again" in str(info.value)
    assert [type(e) for e in store.load("lost")] == [ev.RunStarted, ev.InputAdded]
    again = RunController.load(store, "lost")
    assert again.unpublished_input == ("first",)
    again.add_input(["second"])


def test_a_completed_call_is_no_longer_in_flight() -> None:
    # CT10: in flight means started here and not seen complete
    c = _tools_run(ToolCall("pay", "pay", {}))
    c.begin_tool("pay")
    assert c.in_flight == ("pay",)
    assert c.call("pay").in_flight is True
    c.tool_completed("pay", "paid")
    assert c.in_flight == ()
    assert c.call("pay").in_flight is False
    assert c.in_doubt() == ()


def test_an_interrupted_tool_is_answered_as_a_reloaded_controller_would() -> None:
    # CT22: after tool_interrupted the call is no longer held in flight: in doubt when it
    # is not idempotent (never re-run, I11), runnable again when it is
    c = _tools_run(ToolCall("pay", "pay", {}), ToolCall("look", "look", {}, idempotent=True))
    c.begin_tool("pay")
    c.begin_tool("look")
    c.tool_interrupted("pay")
    c.tool_interrupted("look")
    assert c.in_flight == ()
    assert c.in_doubt() == ("pay",)
    assert_refused(c, ToolInDoubt, c.begin_tool, "pay")
    again = c.begin_tool("look")
    assert isinstance(again, Execute)
    assert c.call("look").starts == 2


def test_the_model_output_handed_out_is_a_copy() -> None:
    # CT18: what the controller hands out is the caller's; changing it changes nothing
    c = RunController.start(run_id="copy", session_id=None)
    c.begin_model_call()
    c.model_responded(output={"answer": [1, 2]})
    handed = c.model_output
    assert isinstance(handed, dict)
    handed["answer"].append(3)
    handed["extra"] = True
    assert c.model_output == {"answer": [1, 2]}
    c.accept_final_output(c.model_output)
    assert RunController.from_json(c.to_json()).final_output == {"answer": [1, 2]}


def test_max_events_counts_the_events_before_a_snapshot() -> None:
    # CT23: max_events bounds the whole log, however it is loaded
    store = MemoryEventStore()
    c = RunController.start(run_id="long", session_id=None, store=store)
    for i in range(299):
        c.add_input([i])
    assert c.version == 300
    snapshot, tail = store.load_latest("long")
    assert snapshot is not None  # the load below starts from it
    assert len(tail) < 280
    for use_snapshot in (True, False):
        with pytest.raises(SchemaError):
            RunController.load(store, "long", max_events=280, snapshot=use_snapshot)
        assert RunController.load(store, "long", max_events=300,
                                  snapshot=use_snapshot).version == 300


def test_a_memory_stores_log_is_not_the_callers_list() -> None:
    # SS04: what load returns is the caller's; changing it changes nothing stored
    store = MemoryEventStore()
    RunController.start(run_id="r", session_id=None, store=store).add_input(["x"])
    log = store.load("r")
    log.clear()
    assert [type(e) for e in store.load("r")] == [ev.RunStarted, ev.InputAdded]
    assert RunController.load(store, "r").version == 2


@pytest.mark.parametrize("kind", ["memory", "sqlite",
                                  pytest.param("postgres", marks=pytest.mark.postgres)])
def test_a_run_heads_owner_is_its_last_claims(kind: str, tmp_path: Path,
                                              request: pytest.FixtureRequest) -> None:
    # SS03, SS08, PG03: RunHead.owner is the owner of the run's last RunClaimed, whatever
    # was appended after it
    store: Any
    if kind == "memory":
        store = MemoryEventStore()
    elif kind == "sqlite":
        store = SQLiteEventStore(tmp_path / "e.db")
    else:
        from statemachine.postgres import PostgresEventStore

        store = PostgresEventStore(request.getfixturevalue("pg_dsn"),
                                   schema=request.getfixturevalue("pg_schema"))

    def owner() -> str | None:
        (head,) = store.list_runs()
        found: str | None = head.owner
        return found

    try:
        c = RunController.start(run_id="owned", session_id=SESSION, store=store)
        assert owner() is None
        for who in ("worker-1", "worker-2"):
            c = RunController.load(store, "owned")
            c.claim(who)
            assert owner() == who
            c.add_input(["more"])  # an append without a claim keeps the owner
            assert owner() == who
        c.claim(None)
        assert owner() is None
    finally:
        if kind != "memory":
            store.close()


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


def test_another_runs_snapshot_is_ignored() -> None:
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


# ----------------------------------------------------------------- SQLite underneath


def test_sqlite_connections_sync_every_commit(tmp_path: Path) -> None:
    # SQ01: synchronous=FULL (2) in WAL mode: an acknowledged commit survives a power cut
    conn = sqlite.connect(tmp_path / "db.sqlite", timeout=1.0)
    try:
        assert conn.execute("PRAGMA synchronous").fetchone()[0] == 2
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        conn.close()


def test_a_write_transaction_holds_the_write_lock_from_its_start(tmp_path: Path) -> None:
    # SQ02: BEGIN IMMEDIATE, so a check-then-write (an append's version check) cannot
    # interleave with another writer's: the second writer waits at its BEGIN
    path = tmp_path / "db.sqlite"
    first = sqlite.connect(path, timeout=5.0)
    second = sqlite.connect(path, timeout=0.05)
    try:
        first.execute("CREATE TABLE t (x INTEGER)")
        with sqlite.write_transaction(first):
            first.execute("SELECT COUNT(*) FROM t").fetchone()  # a read, no write yet
            with pytest.raises(sqlite3.OperationalError, match="locked"), \
                    sqlite.write_transaction(second):
                pass
        with sqlite.write_transaction(second):
            second.execute("INSERT INTO t VALUES (1)")
    finally:
        first.close()
        second.close()


def test_a_refused_pop_leaves_the_session_usable(tmp_path: Path) -> None:
    # SQ03: a write transaction that fails is rolled back, so the next one can begin
    path = tmp_path / "session.db"
    session = SQLiteSession("s", path)
    try:
        raw = sqlite3.connect(path)
        raw.execute("INSERT INTO session_items (session_id, body) VALUES ('s', 'not json{')")
        raw.commit()
        raw.close()
        with pytest.raises(StorageError):
            asyncio.run(session.pop_item())
        asyncio.run(session.clear_session())
        asyncio.run(session.add_items([{"n": 1}]))
        assert asyncio.run(session.get_items()) == [{"n": 1}]
    finally:
        session.close()


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_a_non_positive_limit_reads_no_items(kind: str, tmp_path: Path) -> None:
    # SE01, SE03: get_items(limit=n) is the last n items: none for 0 (and for a negative
    # n, on which both Sessions agree)
    session: MemorySession | SQLiteSession = (
        MemorySession("s") if kind == "memory" else SQLiteSession("s", tmp_path / "s.db"))
    asyncio.run(session.add_items([1, 2, 3]))
    assert asyncio.run(session.get_items(limit=2)) == [2, 3]
    assert asyncio.run(session.get_items(limit=0)) == []
    assert asyncio.run(session.get_items(limit=-1)) == []
    if isinstance(session, SQLiteSession):
        session.close()


# --------------------------------------------------------------------- the runner


def test_a_tool_is_looked_up_by_its_whole_name() -> None:
    # AG04: Agent.tool names one tool exactly; a prefix is another (unknown) name
    agent = Agent("a", ScriptedModel([]), (FunctionTool("search_all", lambda: 1),))
    assert agent.tool("search_all").name == "search_all"
    with pytest.raises(LookupError):
        agent.tool("search")


def test_the_first_rejecting_input_guardrail_decides() -> None:
    # LP06: the tool guardrails of a stage run in order and the first rejection wins
    ran: list[str] = []

    def tool() -> str:
        ran.append("tool")
        return "ran"

    guards = (ToolGuardrail("allow", lambda call: ALLOW),
              ToolGuardrail("first", lambda call: reject_content("first says no")),
              ToolGuardrail("second", lambda call: reject_content("second says no")))
    agent = Agent("a", ScriptedModel([ModelResponse((("k", "act", {}),)),
                                      ModelResponse(output="done")]),
                  (FunctionTool("act", tool, input_guardrails=guards),))
    result = asyncio.run(Runner.run(agent, "go"))
    assert ran == []
    assert result.controller.call("k").result == "first says no"


def test_a_rejected_tool_output_is_replaced_by_the_guardrails_message() -> None:
    # LP07: an output guardrail's reject_content verdict replaces the tool's output
    runs: list[int] = []

    def secret() -> str:
        runs.append(1)
        return "the password is hunter2"

    guard = ToolGuardrail("redact", lambda call, output: reject_content("[redacted]"))
    agent = Agent("a", ScriptedModel([ModelResponse((("s", "secret", {}),)),
                                      ModelResponse(output="done")]),
                  (FunctionTool("secret", secret, output_guardrails=(guard,)),))
    session = MemorySession(SESSION)
    result = asyncio.run(Runner.run(agent, "tell me", session=session))
    assert runs == [1]
    assert result.controller.call("s").result == "[redacted]"
    written = asyncio.run(session.get_items())
    assert {"type": "function_call_output", "call_id": "s", "output": "[redacted]"} in written
    assert "hunter2" not in json.dumps(written)


def test_an_output_guardrail_tripwire_abandons_the_run() -> None:
    # LP08: the tripwire is raised and the run is abandoned (terminal, for good)
    store = MemoryEventStore()
    agent = Agent("a", ScriptedModel([ModelResponse(output="rude")]),
                  output_guardrails=(OutputGuardrail("polite",
                                                     lambda out: reject_content("no")),))
    with pytest.raises(OutputGuardrailTripwire):
        asyncio.run(Runner.run(agent, "hi", store=store, run_id="tripped"))
    c = RunController.load(store, "tripped")
    assert c.step is Step.TERMINAL_UNRECOVERABLE
    assert c.final_output is None


def test_max_turns_abandons_the_run_before_one_more_model_call() -> None:
    # LP02: with max_turns=2, the third model call is never made: the run is abandoned
    # with "max_turns" and MaxTurnsExceeded raised
    store = MemoryEventStore()
    model = ScriptedModel([ModelResponse(((f"c{i}", "tick", {}),)) for i in range(3)])
    agent = Agent("a", model, (FunctionTool("tick", lambda: "tock"),), max_turns=2)
    with pytest.raises(MaxTurnsExceeded):
        asyncio.run(Runner.run(agent, "go", store=store, run_id="turns"))
    assert model.calls == 2
    c = RunController.load(store, "turns")
    assert c.step is Step.TERMINAL_UNRECOVERABLE
    assert [e.reason for e in c.events if isinstance(e, ev.Abandoned)] == ["max_turns"]


def test_a_failed_attempt_still_stores_what_it_recorded() -> None:
    # LP11: a buffered run whose model call fails records the failure, and the attempt's
    # buffered events reach the store although the run ends with the model's error
    class Broken(ScriptedModel):
        async def respond(self, history: list[JSON], agent: Agent) -> ModelResponse:
            raise ValueError("the model is down")

    store = MemoryEventStore()
    agent = Agent("a", Broken([]))
    with pytest.raises(ValueError, match="the model is down"):
        asyncio.run(Runner.run(agent, "hi", store=store, run_id="down", buffered=True))
    c = RunController.load(store, "down")
    assert c.step is Step.RUN_AGAIN
    last = c.events[-1]
    assert isinstance(last, ev.ModelFailed)
    assert last.error == "ValueError"


def test_a_runner_that_can_make_no_progress_stops() -> None:
    # LP12: a call this controller holds in flight (started, never reported) can be
    # neither run again nor resolved here: the runner raises instead of spinning
    c = _tools_run(ToolCall("pay", "pay", {}))
    c.begin_tool("pay")
    agent = Agent("a", ScriptedModel([]), (FunctionTool("pay", lambda: "paid"),))

    async def consume() -> int:
        seen = 0
        streamed = Runner.run_streamed(agent, controller=c, session=MemorySession(SESSION))
        async for _ in streamed.stream_events():
            seen += 1
            if seen > 50:
                break
        return seen

    with pytest.raises(RuntimeError, match="no progress"):
        asyncio.run(consume())
    assert c.phase("pay") is Phase.STARTED


# ------------------------------------------- durable at every effect boundary (§6.7)
# A run that buffers its events appends them at each effect boundary: whatever the run
# recorded before a model call, a tool, a Session write or a post is in the store when
# that effect happens (a crash during the effect must find its announcement in the log).
# LP03, LP04, PU03, RE04.


def _stored(store: MemoryEventStore, run_id: str, kind: type[ev.Event]) -> int:
    return sum(type(e) is kind for e in store.load(run_id))


class _WatchedModel(ScriptedModel):
    def __init__(self, store: MemoryEventStore, responses: list[ModelResponse]) -> None:
        super().__init__(responses)
        self.store = store
        self.begun_when_called: list[int] = []

    async def respond(self, history: list[JSON], agent: Agent) -> ModelResponse:
        self.begun_when_called.append(_stored(self.store, "durable", ev.ModelCallBegun))
        return await super().respond(history, agent)


class _WatchedSession(MemorySession):
    def __init__(self, store: MemoryEventStore) -> None:
        super().__init__(SESSION)
        self.store = store
        self.staged_when_written: list[int] = []

    async def add_items(self, items: list[JSON]) -> None:
        self.staged_when_written.append(_stored(self.store, "durable", ev.PublicationStaged))
        await super().add_items(items)


def test_a_buffered_run_is_durable_at_every_effect() -> None:
    store = MemoryEventStore()
    started_when_run: list[int] = []

    def pay(x: int) -> str:
        started_when_run.append(_stored(store, "durable", ev.ToolStarted))
        return f"paid {x}"

    model = _WatchedModel(store, [ModelResponse((("p1", "pay", {"x": 1}),)),
                                  ModelResponse((("p2", "pay", {"x": 2}),)),
                                  ModelResponse(output="done")])
    session = _WatchedSession(store)
    agent = Agent("a", model, (FunctionTool("pay", pay),))
    result = asyncio.run(Runner.run(agent, "pay twice", session=session, store=store,
                                    run_id="durable", buffered=True))
    assert result.step is Step.COMPLETED
    assert model.begun_when_called == [1, 2, 3]  # the k-th call finds k begun
    assert started_when_run == [1, 2]
    # input, two tool batches, the final output: the k-th write finds k staged
    assert session.staged_when_written == [1, 2, 3, 4]


class _WatchedRemote(FakeRemote):
    def __init__(self, store: MemoryEventStore, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.store = store
        self.completed_when_posted: list[tuple[str, int]] = []

    async def post_result(self, call_id: str, result: JSON) -> None:
        done = sum(type(e) is ev.ToolCompleted and e.call_id == call_id
                   for e in self.store.load("remote"))
        self.completed_when_posted.append((call_id, done))
        await super().post_result(call_id, result)


async def _drain_remote(remote: FakeRemote, c: RunController,
                        tools: Sequence[FunctionTool]) -> list[Any]:
    executor = RemoteToolExecutor(remote, tools, controller=c, backoff=0)
    return [call async for call in executor.run()]


def test_a_remote_result_is_durable_before_it_is_posted() -> None:
    store = MemoryEventStore()
    remote = _WatchedRemote(store, [("t1", "echo", {"v": 1}), ("t2", "echo", {"v": 2})])
    c = RunController.start(run_id="remote", session_id=None, store=store, buffered=True)
    asyncio.run(_drain_remote(remote, c, [FunctionTool("echo", lambda v: v)]))
    assert remote.completed_when_posted == [("t1", 1), ("t2", 1)]


def test_a_result_the_remote_already_holds_is_recorded_as_posted() -> None:
    # RE05: the first post lands but its answer is lost; the retry hears AlreadyAnswered,
    # which means the remote holds the result: the ledger must say published
    remote = FakeRemote([("t1", "echo", {"v": 1})],
                        post_outcomes={"t1": ["commit_then_raise"]})
    c = RunController.start(run_id="remote", session_id=None)
    seen = asyncio.run(_drain_remote(remote, c, [FunctionTool("echo", lambda v: v)]))
    assert remote.results() == {"t1": [1]}
    assert c.phase("t1") is Phase.PUBLISHED
    assert [(d.call_id, d.posted) for d in seen] == [("t1", True)]


# ------------------------------------------------------------ the remote executor


def test_a_result_the_listing_shows_is_never_posted_again() -> None:
    # RE01: on reconnect the listing is reconciled with the ledger: a result the remote
    # holds (its post landed, the answer was lost) is recorded as posted, not re-posted
    remote = FakeRemote([("t1", "echo", {"v": 1})], disconnect_after=[1],
                        post_outcomes={"t1": ["commit_then_raise"]})
    c = RunController.start(run_id="remote", session_id=None)
    executor = RemoteToolExecutor(remote, [FunctionTool("echo", lambda v: v)],
                                  controller=c, backoff=0, retries=0)

    async def drain() -> list[Any]:
        return [d async for d in executor.run()]

    seen = asyncio.run(drain())
    assert remote.posts["t1"] == 1
    assert remote.results() == {"t1": [1]}
    assert c.phase("t1") is Phase.PUBLISHED
    assert [(d.call_id, d.posted) for d in seen] == [("t1", False)]


class _Redelivering:
    """A remote whose stream delivers the same tool_use twice (at-least-once delivery),
    then ends the session."""

    def __init__(self) -> None:
        self.history: list[RemoteEvent] = []
        self.posted: list[tuple[str, JSON]] = []

    async def list_events(self) -> AsyncGenerator[RemoteEvent, None]:
        for event in list(self.history):
            yield event

    async def events(self) -> AsyncGenerator[RemoteEvent, None]:
        use = RemoteEvent("tool_use", "t1", "echo", {"v": 1})
        self.history.append(use)
        yield use
        yield use  # redelivered after its result was posted
        yield RemoteEvent("session_end")

    async def post_result(self, call_id: str, result: JSON) -> None:
        self.posted.append((call_id, result))
        self.history.append(RemoteEvent("tool_result", call_id, result=result))


def test_a_redelivered_call_is_not_run_or_posted_again() -> None:
    # RE02: a published call is done: a second delivery of it changes nothing
    remote = _Redelivering()
    runs: list[int] = []

    def echo(v: int) -> int:
        runs.append(v)
        return v

    c = RunController.start(run_id="remote", session_id=None)
    executor = RemoteToolExecutor(remote, [FunctionTool("echo", echo)], controller=c,
                                  backoff=0)

    async def drain() -> list[Any]:
        return [d async for d in executor.run()]

    seen = asyncio.run(drain())
    assert runs == [1]
    assert remote.posted == [("t1", 1)]
    assert [(d.call_id, d.posted) for d in seen] == [("t1", True)]
    assert c.phase("t1") is Phase.PUBLISHED


def test_the_executor_gives_up_after_max_reconnects() -> None:
    # RE07: max_reconnects=3: the first listing and three reconnects, then it gives up
    remote = FakeRemote([("t1", "echo", {"v": 1})], failing_listings=range(1, 100))
    c = RunController.start(run_id="remote", session_id=None)
    executor = RemoteToolExecutor(remote, [FunctionTool("echo", lambda v: v)],
                                  controller=c, backoff=0, max_reconnects=3)

    async def drain() -> list[Any]:
        return [d async for d in executor.run()]

    with pytest.raises(RemoteUnavailable):
        asyncio.run(drain())
    assert remote.listings == 4


def test_a_remote_tools_exception_is_its_result() -> None:
    # RE09: as for every FunctionTool, an exception the tool raises is its output
    def broken(v: int) -> int:
        raise KeyError(v)

    remote = FakeRemote([("t1", "broken", {"v": 1}), ("t2", "echo", {"v": 2})])
    c = RunController.start(run_id="remote", session_id=None)
    seen = asyncio.run(_drain_remote(remote, c, [FunctionTool("broken", broken),
                                                 FunctionTool("echo", lambda v: v)]))
    assert remote.results() == {"t1": ["tool error: KeyError"], "t2": [2]}
    assert [(d.call_id, d.result, d.posted) for d in seen] == [
        ("t1", "tool error: KeyError", True), ("t2", 2, True)]
