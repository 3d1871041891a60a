"""OpenTelemetry spans (DESIGN §7.6, issue 31) through the reference runner, the operator
and a bare controller, read back from OpenTelemetry's own SDK and its in-memory exporter.

The expected trees are written out from each scenario (what the agent does, what a crash
leaves, what the operator says), never read from the log the library recorded: a turn
with one tool has one ``execute_tool`` span, a resumed call that ran before has none,
the publications are the input, the call with its output, and the answer."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.trace import StatusCode

from statemachine import (
    ConfigurationError,
    ReconcileRejected,
    Resolution,
    RunController,
    SQLiteEventStore,
    Step,
    ToolInDoubt,
    operator,
)
from statemachine.runner import Agent, ModelResponse, Runner
from statemachine.sessions import MemorySession, SQLiteSession
from statemachine.telemetry import disable_telemetry, enable_telemetry
from statemachine.testing import (
    Counters,
    FlakySession,
    InjectedWriteError,
    ScriptedModel,
    counted_tool,
)
from tests.otel import Traced, attributes, dedent

USER = "charge me 7"
RUN = "run-1"


def _agent(counters: Counters, *, approval: bool = False, notify: bool = False,
           resumed: bool = False) -> Agent:
    """The billing agent: the model asks for the charge (and the notice), then answers;
    ``resumed``: a model asked only after the calls were made (it answers)."""
    def charge(x: int) -> str:  # the body opens a span of its own, as a traced client does
        with trace.get_tracer("tests.billing").start_as_current_span("charge body"):
            return f"charged {x}"

    tools = [counted_tool(counters, "charge", charge, needs_approval=approval)]
    calls: list[tuple[str, str, dict[str, Any]]] = [("c1", "charge", {"x": 7})]
    if notify:
        tools.append(counted_tool(counters, "notify", lambda: "notified",
                                  needs_approval=approval))
        calls.append(("c2", "notify", {}))
    model = ScriptedModel([ModelResponse(tuple(calls)), ModelResponse(output="charged")][
        1 if resumed else 0:])
    return Agent("billing", model, tuple(tools))


def test_a_one_tool_turn_through_the_runner_is_one_tree(traced: Traced) -> None:
    counters = Counters()
    result = asyncio.run(Runner.run(_agent(counters), USER, session=MemorySession("s1")))
    assert result.step is Step.COMPLETED
    (root,) = [span for span in traced.spans if span.parent is None]
    assert root.name == "invoke_agent billing"
    assert dict(root.attributes or {}) == {
        "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "billing",
        "statemachine.run_id": result.controller.run_id}
    (tool,) = traced.named("execute_tool")
    assert tool.name == "execute_tool charge"
    assert dict(tool.attributes or {}) == {
        "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "charge",
        "gen_ai.tool.call.id": "c1", "gen_ai.tool.type": "function",
        "statemachine.run_id": result.controller.run_id,
        "statemachine.tool.outcome": "executed"}
    assert traced.ancestors(tool) == ["invoke_agent billing"]
    (body,) = traced.named("charge body")
    assert traced.ancestors(body) == ["execute_tool charge", "invoke_agent billing"]
    # the input, the call with its output, the answer: three writes, each committed
    published = traced.named("statemachine.publish")
    assert attributes(published, "statemachine.publication.via",
                      "statemachine.publication.items", "statemachine.publication.outcome"
                      ) == [("staged", 1, "committed"), ("staged", 2, "committed"),
                            ("staged", 1, "committed")]
    assert all(traced.ancestors(span) == ["invoke_agent billing"] for span in published)
    events = traced.walk()
    assert events[0]["statemachine.event"] == "RunStarted"
    assert events[-1]["statemachine.to"] == "completed"
    on_tool = [e["statemachine.event"] for e in events if e["span"] == "execute_tool charge"]
    assert on_tool == ["ToolStarted", "ToolCompleted"]
    on_publish = [e["statemachine.event"] for e in events if e["span"] == "statemachine.publish"]
    assert on_publish == ["PublicationStaged", "PublicationCommitted"] * 3
    traced.assert_no_payloads(USER, "charged 7", '"x"', "charged",
                              result.controller.fingerprint("c1"))


def test_loading_or_replaying_a_log_emits_nothing(tmp_path: Path, traced: Traced) -> None:
    store = SQLiteEventStore(tmp_path / "events.db")
    session = SQLiteSession("s1", tmp_path / "session.db")
    result = asyncio.run(Runner.run(_agent(Counters()), USER, session=session, store=store,
                                    run_id=RUN))
    assert traced.spans
    traced.clear()
    loaded = RunController.load(store, RUN)
    RunController.from_json(result.controller.to_json())
    asyncio.run(RunController.load_async(store, RUN))
    assert loaded.step is Step.COMPLETED
    assert traced.spans == ()


def test_off_emits_nothing_and_on_needs_opentelemetry(
        traced: Traced, monkeypatch: pytest.MonkeyPatch) -> None:
    disable_telemetry()
    asyncio.run(Runner.run(_agent(Counters()), USER, session=MemorySession("s1")))
    assert [span.name for span in traced.spans] == ["charge body"]  # the tool's own only
    monkeypatch.setitem(sys.modules, "opentelemetry", None)  # not installed
    with pytest.raises(ConfigurationError, match=r"\[otel\]"):
        enable_telemetry()


def test_the_seed_scenario_a_failed_write_then_a_resume_that_acknowledges_it(
        tmp_path: Path, traced: Traced) -> None:
    """Both calls approved; the write of their results lands and then raises; a fresh
    process reloads the run and resumes: the batch is found written (acknowledged),
    nothing runs again, the model answers."""
    counters = Counters()
    agent = _agent(counters, approval=True, notify=True)
    store = SQLiteEventStore(tmp_path / "events.db")
    session = SQLiteSession("s1", tmp_path / "session.db")
    first = asyncio.run(Runner.run(agent, USER, session=session, store=store, run_id=RUN))
    c = first.controller
    for call_id in ("c1", "c2"):
        operator.approve(store, RUN, call_id, fingerprint=c.fingerprint(call_id), by="alice")
    traced.clear()
    flaky = FlakySession(session, fail_on=1, outcome="commit_then_raise")
    with pytest.raises(InjectedWriteError):
        asyncio.run(Runner.run(agent, session=flaky, store=store, run_id=RUN))
    ran = traced.named("execute_tool")
    assert attributes(ran, "gen_ai.tool.call.id", "statemachine.tool.outcome") == [
        ("c1", "executed"), ("c2", "executed")]
    (failed,) = traced.named("statemachine.publish")
    assert attributes([failed], "statemachine.publication.via",
                      "statemachine.publication.items", "statemachine.publication.outcome",
                      "error.type") == [("staged", 4, "failed", "InjectedWriteError")]
    assert failed.status.status_code is StatusCode.ERROR
    (attempt,) = [span for span in traced.spans if span.parent is None]
    assert (attempt.name, (attempt.attributes or {})["error.type"]) == (
        "invoke_agent billing", "InjectedWriteError")

    traced.clear()
    done = asyncio.run(Runner.run(agent, session=SQLiteSession("s1", tmp_path / "session.db"),
                                  store=SQLiteEventStore(tmp_path / "events.db"), run_id=RUN))
    assert done.step is Step.COMPLETED
    assert counters.tools == {"charge": 1, "notify": 1}
    assert traced.named("execute_tool") == []  # nothing ran, nothing was even asked to
    published = traced.named("statemachine.publish")
    assert attributes(published, "statemachine.publication.via",
                      "statemachine.publication.outcome") == [
        ("reconcile", "acknowledged"), ("staged", "committed")]
    events = [e["statemachine.event"] for e in traced.walk(first_seq=_seq_after(traced))]
    assert events[0] == "RunClaimed"
    assert "ReconciledAcknowledge" in events


def test_the_seed_scenario_through_the_runner_is_one_tree_per_request(
        tmp_path: Path, traced: Traced) -> None:
    """The same scenario, every span kept: request 1 writes the input and pauses for the
    two approvals; the operator approves each (a command span of its own, naming alice);
    request 2 runs both calls (the charge's body opens its own span under its call's) and
    the write of their four items lands and raises; request 3 claims, finds the write
    (acknowledged), asks the model, and writes the answer. Every event of each attempt
    sits in its request's tree: the runner's ``invoke_agent`` span, its calls' and its
    publications' spans; none gets a span of its own."""
    counters = Counters()
    agent = _agent(counters, approval=True, notify=True)
    store = SQLiteEventStore(tmp_path / "events.db")
    session = SQLiteSession("s1", tmp_path / "session.db")
    caller = trace.get_tracer("tests.caller")
    with caller.start_as_current_span("request 1"):
        first = asyncio.run(Runner.run(agent, USER, session=session, store=store, run_id=RUN))
    for call_id in ("c1", "c2"):
        operator.approve(store, RUN, call_id, fingerprint=first.controller.fingerprint(call_id),
                         by="alice")
    flaky = FlakySession(session, fail_on=1, outcome="commit_then_raise")
    with caller.start_as_current_span("request 2"), pytest.raises(InjectedWriteError):
        asyncio.run(Runner.run(agent, session=flaky, store=store, run_id=RUN))
    with caller.start_as_current_span("request 3"):
        done = asyncio.run(Runner.run(agent, session=session, store=store, run_id=RUN))
    assert (done.step, counters.tools) == (Step.COMPLETED, {"charge": 1, "notify": 1})
    assert traced.tree() == dedent("""
        request 1
          invoke_agent billing
            · RunStarted InputAdded HookRan ModelCallBegun HookRan HookRan ModelResponded
            statemachine.publish via=staged items=1 outcome=committed
              · PublicationStaged PublicationCommitted
        statemachine.approve actor=alice
          · RunClaimed CallApproved
        statemachine.approve actor=alice
          · RunClaimed CallApproved
        request 2
          invoke_agent billing error=InjectedWriteError
            · RunClaimed Resumed HookRan HookRan HookRan HookRan
            execute_tool charge call=c1 outcome=executed
              · ToolStarted ToolCompleted
              charge body
            execute_tool notify call=c2 outcome=executed
              · ToolStarted ToolCompleted
            statemachine.publish via=staged items=4 outcome=failed error=InjectedWriteError
              · PublicationStaged PublicationFailed
        request 3
          invoke_agent billing
            · RunClaimed ModelCallBegun HookRan HookRan ModelResponded HookRan FinalOutputAccepted
            statemachine.publish via=reconcile outcome=acknowledged
              · ReconciledAcknowledge
            statemachine.publish via=staged items=1 outcome=committed
              · PublicationStaged PublicationCommitted""")
    traced.assert_conventions()
    assert len(traced.walk()) == len(RunController.load(store, RUN).events)


def _seq_after(traced: Traced) -> int:
    return min(int(e["statemachine.seq"]) for e in traced.transitions())


def _left_in_doubt(tmp_path: Path, *, completed: bool = False) -> SQLiteEventStore:
    """A run whose process died inside the charge (``completed``: after its result was
    recorded, before its end hook ran and it was published): per-event appends, so each
    is durable."""
    store = SQLiteEventStore(tmp_path / "events.db")
    agent = _agent(Counters(), approval=True)
    first = asyncio.run(Runner.run(agent, USER, session=SQLiteSession("s1", tmp_path / "s.db"),
                                   store=store, run_id=RUN, buffered=False))
    c = RunController.load(store, RUN)
    c.claim("dying")
    c.approve("c1", fingerprint=first.controller.fingerprint("c1"))
    c.resume()
    c.begin_tool("c1")
    c.hook_ran("tool_start", call_id="c1")  # what the runner records before the body
    if completed:
        c.tool_completed("c1", "charged 7")
    return store


def test_a_call_in_doubt_is_refused_then_settled_by_an_operator(
        tmp_path: Path, traced: Traced) -> None:
    store = _left_in_doubt(tmp_path)
    traced.clear()
    counters = Counters()
    with pytest.raises(ToolInDoubt):
        asyncio.run(Runner.run(_agent(counters, approval=True),
                               session=SQLiteSession("s1", tmp_path / "s.db"), store=store,
                               run_id=RUN))
    assert counters.tools == {}
    (refused,) = traced.named("execute_tool")
    assert attributes([refused], "gen_ai.tool.call.id", "statemachine.tool.outcome",
                      "error.type") == [("c1", "refused_in_doubt", "ToolInDoubt")]
    assert refused.status.status_code is StatusCode.ERROR
    assert traced.ancestors(refused) == ["invoke_agent billing"]

    traced.clear()
    operator.resolve(store, RUN, "c1", outcome=Resolution.COMPLETED, output="charged 7",
                     by="alice", evidence="payment 991")
    (command,) = traced.spans
    assert command.name == "statemachine.resolve_in_doubt"
    assert dict(command.attributes or {}) == {"statemachine.run_id": RUN,
                                              "statemachine.actor": "alice"}
    claimed, resolved = (dict(event.attributes or {}) for event in command.events)
    assert (claimed["statemachine.event"], claimed["statemachine.actor"]) == (
        "RunClaimed", "alice")
    assert {key: resolved[key] for key in ("statemachine.event", "statemachine.actor",
                                           "statemachine.resolution", "gen_ai.tool.call.id")
            } == {"statemachine.event": "InDoubtResolved", "statemachine.actor": "alice",
                  "statemachine.resolution": "completed", "gen_ai.tool.call.id": "c1"}
    traced.assert_no_payloads("payment 991", "charged 7")


def test_the_cli_emits_its_commands_spans_with_the_actor_when_the_environment_says_so(
        tmp_path: Path, traced: Traced, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``statemachine resolve ... --by alice`` and ``abandon ... --by bob`` in a process
    whose telemetry is off: with STATEMACHINE_TELEMETRY=1 the CLI turns it on (the global
    tracer provider, here the tests' in-memory one) and each command is one span naming
    its actor, its events on it; unset, nothing is emitted; any other value is refused."""
    from statemachine.cli.main import main

    store = _left_in_doubt(tmp_path)
    where = ["--store", str(tmp_path / "events.db")]
    disable_telemetry()
    traced.clear()
    assert main(["inbox", *where]) == 0  # (a read; and telemetry stays off)
    assert traced.spans == ()
    monkeypatch.setenv("STATEMACHINE_TELEMETRY", "yes")
    assert main(["abandon", RUN, *where, "--by", "bob", "--reason", "x"]) == 2
    assert "STATEMACHINE_TELEMETRY must be 1" in capsys.readouterr().err
    assert RunController.load(store, RUN).step is Step.TOOLS  # nothing was done
    monkeypatch.setenv("STATEMACHINE_TELEMETRY", "1")
    assert main(["resolve", RUN, "c1", *where, "--by", "alice", "--completed",
                 '"charged 7"', "--evidence", "payment 991"]) == 0
    assert main(["abandon", RUN, *where, "--by", "bob", "--reason", "the customer left"]) == 0
    assert traced.tree() == dedent("""
        statemachine.resolve_in_doubt actor=alice
          · RunClaimed InDoubtResolved
        statemachine.abandon actor=bob
          · RunClaimed Abandoned""")
    for span, actor in zip(traced.named("statemachine."), ["alice", "bob"], strict=True):
        assert [dict(e.attributes or {}).get("statemachine.actor") for e in span.events] == [
            actor, actor]
    traced.assert_no_payloads("payment 991", "charged 7", "the customer left")


def test_a_recorded_result_is_published_from_the_log_and_its_body_never_runs(
        tmp_path: Path, traced: Traced) -> None:
    """The runner resumed after a death between the result and its publication: it
    publishes the recorded result and asks nothing of the tool (no ``execute_tool``)."""
    store = _left_in_doubt(tmp_path, completed=True)
    traced.clear()
    counters = Counters()
    done = asyncio.run(Runner.run(_agent(counters, approval=True, resumed=True),
                                  session=SQLiteSession("s1", tmp_path / "s.db"), store=store,
                                  run_id=RUN))
    assert done.step is Step.COMPLETED
    assert counters.tools == {}
    assert traced.named("execute_tool") == []
    assert traced.named("charge body") == []
    assert attributes(traced.named("statemachine.publish"), "statemachine.publication.items",
                      "statemachine.publication.outcome") == [(2, "committed"),
                                                              (1, "committed")]


def test_a_call_asked_again_after_its_result_is_resent(traced: Traced) -> None:
    c = _bare_run()
    c.begin_tool("c1")
    c.tool_completed("c1", "charged 7")
    traced.clear()
    assert type(c.begin_tool("c1")).__name__ == "Resend"
    (resent,) = traced.spans
    assert (resent.name, resent.status.status_code) == ("execute_tool charge", StatusCode.UNSET)
    assert attributes([resent], "gen_ai.tool.call.id", "statemachine.tool.outcome") == [
        ("c1", "resent")]
    assert resent.events == ()  # nothing recorded


def test_a_body_that_ends_without_a_result_leaves_an_interrupted_span(traced: Traced) -> None:
    c = _bare_run()
    c.begin_tool("c1")
    c.tool_interrupted("c1")
    (span,) = traced.named("execute_tool")
    assert attributes([span], "statemachine.tool.outcome", "error.type") == [
        ("interrupted", "interrupted")]
    with pytest.raises(ToolInDoubt):
        c.begin_tool("c1")  # now it answers as a reloaded controller would
    assert attributes(traced.named("execute_tool"), "statemachine.tool.outcome") == [
        ("interrupted",), ("refused_in_doubt",)]


def _bare_run() -> RunController:
    """A controller driven by hand, outside any span: one call to run."""
    from statemachine import ToolCall

    c = RunController.start(run_id=RUN, session_id="s1")
    c.begin_model_call()
    c.model_responded([ToolCall("c1", "charge", {"x": 7})])
    return c


def test_events_outside_any_span_get_a_record_span_each(traced: Traced) -> None:
    _bare_run()
    records = traced.named("statemachine.record")
    assert [[dict(e.attributes or {})["statemachine.event"] for e in span.events]
            for span in records] == [["RunStarted"], ["ModelCallBegun"], ["ModelResponded"]]
    assert all(span.parent is None for span in records)


def test_a_reconcile_that_refuses_the_tail_is_a_rejected_attempt(traced: Traced) -> None:
    c = _bare_run()
    c.begin_tool("c1")
    c.tool_completed("c1", "charged 7")
    items = [{"type": "function_call", "call_id": "c1"},
             {"type": "function_call_output", "call_id": "c1", "output": "charged 7"}]
    c.stage_publication(items, [], whole=True, call_ids=["c1"])
    c.publication_failed(InjectedWriteError)
    traced.clear()
    with pytest.raises(ReconcileRejected):
        c.reconcile([{"role": "user", "content": "something else"}, items[0]], "s1")
    (span,) = traced.spans
    assert attributes([span], "statemachine.publication.via",
                      "statemachine.publication.outcome", "error.type") == [
        ("reconcile", "rejected", "ReconcileRejected")]
    assert span.status.status_code is StatusCode.ERROR
    assert span.events == ()  # nothing was recorded
    action = c.reconcile([], "s1")  # the Session is at the pre-write frontier: append
    assert type(action).__name__ == "Append"
    c.publication_committed()
    (_, attempt) = traced.spans
    assert attributes([attempt], "statemachine.publication.via",
                      "statemachine.publication.outcome") == [("reconcile", "committed")]
    assert [dict(e.attributes or {})["statemachine.event"] for e in attempt.events] == [
        "ReconciledAppend", "PublicationCommitted"]


class _Broken:
    """A tracer provider whose tracer raises on every span (a misconfigured exporter)."""

    def get_tracer(self, *args: Any, **kwargs: Any) -> Any:
        return self

    def start_span(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the tracer is broken")

    start_as_current_span = start_span


def test_a_failing_tracer_never_fails_what_the_ledger_recorded(traced: Traced) -> None:
    enable_telemetry(_Broken())  # type: ignore[arg-type]
    c = _bare_run()  # recording goes on: each event's span is lost, not the event
    assert type(c.begin_tool("c1")).__name__ == "Execute"
    c.tool_interrupted("c1")
    with pytest.raises(ToolInDoubt):  # the refusal, not the tracer's error
        c.begin_tool("c1")
    assert c.step is Step.TOOLS
    assert [type(e).__name__ for e in c.events] == [
        "RunStarted", "ModelCallBegun", "ModelResponded", "ToolStarted"]
    counters = Counters()  # the runner's attempt and the operator's command go on too
    result = asyncio.run(Runner.run(_agent(counters), USER, session=MemorySession("s1")))
    assert (result.step, counters.tools) == (Step.COMPLETED, {"charge": 1})


# ------------------------------------- one span per execution under an SDK that traces


def _sdk_span(name: str = "execute_tool charge", **attributes: Any) -> Any:
    """A span as an SDK that traces its tools opens around one (by default named as the
    GenAI conventions name it), with ``attributes``; not yet current."""
    return trace.get_tracer("tests.sdk").start_span(name, attributes=attributes)


AGREEING = {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "charge",
            "gen_ai.tool.call.id": "c1"}


@pytest.mark.parametrize(("name", "said"), [
    ("execute_tool charge", {}), ("execute_tool charge", AGREEING),
    ("anthropic.custom_tool_use charge", AGREEING)],
    ids=["named-only", "agreeing", "named-otherwise-agreeing"])
def test_an_sdks_span_of_the_call_is_joined_never_ended_or_failed_by_the_ledger(
        traced: Traced, name: str, said: dict[str, Any]) -> None:
    """The SDK's span is current while the call starts, runs, is interrupted and is then
    refused in doubt: the ledger opens no span of its own, says each outcome on the SDK's
    span, and leaves its end and its status to the SDK (which sees the errors itself)."""
    c = _bare_run()
    traced.clear()
    sdk = _sdk_span(name, **said)
    with trace.use_span(sdk, end_on_exit=False):
        c.begin_tool("c1")
        c.tool_interrupted("c1")
        assert sdk.is_recording()  # the SDK's to end
        assert (sdk.attributes or {})["statemachine.tool.outcome"] == "interrupted"
        with pytest.raises(ToolInDoubt):
            c.begin_tool("c1")
    assert traced.spans == ()  # nothing ended: the ledger opened nothing
    sdk.end()
    (only,) = traced.named(name)
    assert len(traced.spans) == 1
    assert attributes([only], "gen_ai.tool.call.id", "statemachine.run_id",
                      "statemachine.tool.outcome", "error.type") == [
        ("c1", RUN, "refused_in_doubt", None)]
    assert only.status.status_code is StatusCode.UNSET
    assert [dict(e.attributes or {})["statemachine.event"] for e in only.events] == [
        "ToolStarted"]


def test_an_sdks_span_of_a_completed_call_says_executed_and_stays_open(traced: Traced) -> None:
    c = _bare_run()
    traced.clear()
    sdk = _sdk_span(**{"gen_ai.operation.name": "execute_tool"})
    with trace.use_span(sdk, end_on_exit=False):
        c.begin_tool("c1")
        c.tool_completed("c1", "charged 7")
        assert type(c.begin_tool("c1")).__name__ == "Resend"  # asked again, same span
    assert traced.spans == ()
    sdk.end()
    (only,) = traced.named("execute_tool charge")
    assert len(traced.spans) == 1
    assert attributes([only], "statemachine.tool.outcome") == [("resent",)]
    assert [dict(e.attributes or {})["statemachine.event"] for e in only.events] == [
        "ToolStarted", "ToolCompleted"]


@pytest.mark.parametrize(("name", "said"), [
    ("execute_tool charge", {"gen_ai.tool.call.id": "c9"}),
    ("execute_tool charge", {"gen_ai.operation.name": "chat"}),
    ("execute_tool charge", {"gen_ai.tool.name": "refund"}),
    ("execute_tool charge", {"statemachine.run_id": "another run"}),
    ("anthropic.custom_tool_use refund", {**AGREEING, "gen_ai.tool.name": "refund"}),
    ("tool charge", {"gen_ai.operation.name": "execute_tool"}),
    ("tool charge", {"gen_ai.tool.name": "charge"})],
    ids=["another-call", "another-operation", "another-tool", "another-runs",
         "named-otherwise-another-tool", "no-tool-said", "no-operation-said"])
def test_a_span_that_is_not_the_sdks_of_this_call_gets_the_ledgers_span_under_it(
        traced: Traced, name: str, said: dict[str, Any]) -> None:
    c = _bare_run()
    traced.clear()
    outer = _sdk_span(name, **said)
    with trace.use_span(outer, end_on_exit=True):
        c.begin_tool("c1")
        c.tool_completed("c1", "charged 7")
    ours, outer_done = traced.spans
    assert outer_done.name == name
    assert "statemachine.tool.outcome" not in (outer_done.attributes or {})
    assert attributes([ours], "gen_ai.tool.call.id", "statemachine.tool.outcome") == [
        ("c1", "executed")]
    assert traced.parent_of(ours) is outer_done


# --------------------------------- a write never reported, and per-call result posts


def test_a_cancelled_write_stays_open_until_the_next_attempt_finds_it_written(
        traced: Traced) -> None:
    """The write of the call and its output is cancelled (it landed, the attempt never
    heard): that attempt stays open, so its span does not end with its request. The next
    attempt, on the same controller, takes the write over (the caller knows the cancelled
    request has ended) and reconciles: the Session holds the batch, so the open attempt
    ends acknowledged; had it found the frontier, that attempt would end unsettled and a
    new one open (the next test). Nothing runs again."""
    counters = Counters()
    agent = _agent(counters)
    session = FlakySession(MemorySession("s1"), fail_on=2, outcome="cancel")
    c = RunController.start(run_id=RUN, session_id="s1")
    tracer = trace.get_tracer("tests.caller")

    async def first() -> None:
        with tracer.start_as_current_span("request 1"), pytest.raises(asyncio.CancelledError):
            await Runner.run(agent, USER, session=session, controller=c)

    asyncio.run(first())
    assert attributes(traced.named("statemachine.publish"), "statemachine.publication.items",
                      "statemachine.publication.outcome") == [(1, "committed")]  # the input
    with tracer.start_as_current_span("request 2"):
        done = asyncio.run(Runner.run(agent, session=session, controller=c, take_over=True))
    assert (done.step, counters.tools) == (Step.COMPLETED, {"charge": 1})
    published = traced.named("statemachine.publish")
    assert attributes(published, "statemachine.publication.via",
                      "statemachine.publication.items", "statemachine.publication.outcome"
                      ) == [("staged", 1, "committed"), ("staged", 2, "acknowledged"),
                            ("staged", 1, "committed")]
    cancelled = published[1]  # opened by the first request, settled by the second
    assert traced.ancestors(cancelled) == ["invoke_agent billing", "request 1"]
    assert [dict(e.attributes or {})["statemachine.event"] for e in cancelled.events] == [
        "PublicationStaged", "ReconciledAcknowledge"]


def test_an_attempt_left_open_ends_unsettled_when_a_reconcile_opens_the_next(
        traced: Traced) -> None:
    """A staged write cancelled before it could land (nothing written) and never
    reported: the take-over reconcile finds the frontier and opens an attempt of its own
    (Append), which ends the one left open as unsettled; the re-write commits."""
    c = _bare_run()
    c.begin_tool("c1")
    c.tool_completed("c1", "charged 7")
    items = [{"type": "function_call", "call_id": "c1"},
             {"type": "function_call_output", "call_id": "c1", "output": "charged 7"}]
    traced.clear()
    c.stage_publication(items, [], whole=True, call_ids=["c1"])
    assert traced.spans == ()  # the attempt is open: its span too
    action = c.reconcile([], "s1", take_over=True)
    assert type(action).__name__ == "Append"
    (left,) = traced.named("statemachine.publish")
    assert attributes([left], "statemachine.publication.via", "statemachine.publication.items",
                      "statemachine.publication.outcome", "error.type") == [
        ("staged", 2, "unsettled", None)]
    assert left.status.status_code is StatusCode.UNSET  # nobody knows it failed
    c.publication_committed()
    _, taken = traced.named("statemachine.publish")
    assert attributes([taken], "statemachine.publication.via",
                      "statemachine.publication.outcome") == [("reconcile", "committed")]
    assert [dict(e.attributes or {})["statemachine.event"] for e in taken.events] == [
        "ReconciledAppend", "PublicationCommitted"]


def test_a_remote_result_post_that_failed_is_posted_again_from_the_cache(
        traced: Traced) -> None:
    """The remote executor (statemachine.runner.remote): the first post of the charge's
    result is refused for good, the stream drops; on the reconnect the ledger answers the
    call from its record (resent) and the re-post lands. Each post is a publication of
    its own (``post``, one item, naming the call), failed then committed."""
    from contextlib import aclosing

    from statemachine.runner import FunctionTool, RemoteToolExecutor
    from statemachine.testing import FakeRemote

    ran: list[str] = []
    remote = FakeRemote([("toolu_1", "charge", {"x": 7})], disconnect_after=[1],
                        post_outcomes={"toolu_1": ["permanent"]})

    def charge(x: int) -> str:
        ran.append("charge")
        return f"charged {x}"

    async def drain() -> list[bool]:
        with trace.get_tracer("tests.caller").start_as_current_span("executor"):
            c = RunController.start(run_id=RUN, session_id=None)
            executor = RemoteToolExecutor(remote, [FunctionTool("charge", charge)],
                                          controller=c, backoff=0)
            async with aclosing(executor.run()) as stream:
                return [call.posted async for call in stream]

    assert asyncio.run(drain()) == [False, True]
    assert ran == ["charge"]
    assert traced.tree() == dedent("""
        executor
          · RunStarted ToolCallsReceived
          execute_tool charge call=toolu_1 outcome=executed
            · ToolStarted ToolCompleted
          statemachine.publish call=toolu_1 via=post items=1 outcome=failed error=PermanentPostError
            · ResultPostFailed
          execute_tool charge call=toolu_1 outcome=resent
          statemachine.publish call=toolu_1 via=post items=1 outcome=committed
            · ResultPosted""")
    traced.assert_conventions()
    failed = traced.named("statemachine.publish")[0]
    assert failed.status.status_code is StatusCode.ERROR
    traced.assert_no_payloads("charged 7", '"x"')
