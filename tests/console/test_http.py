"""The console over HTTP (Starlette's test client): what each page shows against the
store as it was built (`world.seed`), every write's refusals (no login, no CSRF token,
another site, a stale page, a moved fingerprint, a form that says two things) leaving
the log exactly as it was, and values that never become markup."""

from __future__ import annotations

import contextlib
import io
import json
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
from starlette.testclient import TestClient

from statemachine import SQLiteEventStore, operator
from statemachine import events as ev
from statemachine.cli.common import UserError
from statemachine.cli.main import main
from statemachine.console import Console, Logins, create_app, read_token
from statemachine.console.app import loopback_hosts
from statemachine.values import Resolution
from tests.console.pages import Page, log, markup_is_clean, send
from tests.console.world import HOSTILE, Seeded, seed, seed_into

TOKEN = "correct-horse-battery-staple"

Make = Callable[..., TestClient]


@pytest.fixture
def seeded(tmp_path: Path) -> Seeded:
    return seed(tmp_path)


@pytest.fixture
def make(seeded: Seeded) -> Iterator[Make]:
    stores: list[SQLiteEventStore] = []

    def build(*, read_only: bool = False, private: bool = False, logins: bool = True,
              hosts: frozenset[str] | None = None) -> TestClient:
        reads = SQLiteEventStore(seeded.path, readonly=True)
        writes = None if read_only else SQLiteEventStore(seeded.path)
        stores.extend(s for s in (reads, writes) if s is not None)
        console = Console(reads, writes, Logins(TOKEN) if logins else None, private, hosts)
        return TestClient(create_app(console), base_url="http://testserver")

    yield build
    for store in stores:
        store.close()


def logged_in(client: TestClient, name: str = "ann") -> None:
    answer = client.post("/login", data={"token": TOKEN, "name": name, "next": "/runs"},
                         follow_redirects=False)
    assert answer.status_code == 303, answer.text
    assert answer.headers["location"] == "/runs"
    cookie = answer.headers["set-cookie"].lower()
    assert "httponly" in cookie
    assert "samesite=strict" in cookie


def page(client: TestClient, url: str, status: int = 200) -> Page:
    answer = client.get(url, follow_redirects=False)
    assert answer.status_code == status, (url, answer.status_code, answer.text[:500])
    if status == 200:
        assert "script-src" not in answer.headers["content-security-policy"]
        assert "default-src 'none'" in answer.headers["content-security-policy"]
    return Page(answer.text)


# ------------------------------------------------------------------ what pages show


def test_runs_page_shows_every_run_its_step_and_the_counts(make: Make,
                                                           seeded: Seeded) -> None:
    client = make()
    p = page(client, "/runs")
    shown = {cells[0]: cells[1] for cells in p.table("runs")}
    assert shown == seeded.runs
    # the store as built: one in doubt, two runs awaiting decisions, one unsettled, one
    # abandoned (not resumable), one completed (nothing blocks it)
    counts = dict(p.counts())
    assert counts == {"in_doubt": 1, "awaiting_decisions": 2, "unsettled": 1,
                      "not_resumable": 1, "none": 1}
    interrupted = page(client, "/runs?step=INTERRUPTION").table("runs")
    assert {cells[0] for cells in interrupted} == {
        r for r, step in seeded.runs.items() if step == "INTERRUPTION"}
    blocked = page(client, "/runs?blocked=1&step=tools&step=completed").table("runs")
    assert {cells[0] for cells in blocked} == {
        r for r, step in seeded.runs.items() if step == "TOOLS"}
    page(client, "/runs?step=nowhere", 400)


def test_inbox_lists_every_waiting_call_oldest_first_with_a_bounded_preview(
        make: Make, seeded: Seeded) -> None:
    p = page(make(), "/inbox")
    found = p.table("inbox")
    waiting = {(cells[1], cells[2]): cells[3] for cells in found}
    assert waiting == {**seeded.approvals, **seeded.in_doubt}
    # built in this order: the charge started, then order-18's two calls, order-19's, and
    # the unsettled run's undecided notify
    assert [cells[1] for cells in found] == ["order-17", "order-18", "order-18", "order-19",
                                             "run-1"]
    assert all(len(cells[4]) <= 200 for cells in found)
    assert found[0][4].endswith("…")  # the charge's 300-character note was cut
    fingerprints = {cells[5] for cells in found}
    assert all(len(f) == 64 and int(f, 16) >= 0 for f in fingerprints)


def test_a_run_page_shows_its_timeline_ledger_verdict_and_drawing(make: Make) -> None:
    p = page(make(), "/run?id=order-17")
    timeline = p.table("timeline")
    # newest first: started the charge (TOOLS -> TOOLS), proposed, began the model call,
    # claimed by worker-3, started
    kinds = [cells[1] for cells in timeline]
    assert kinds == ["ToolStarted", "ModelResponded", "ModelCallBegun", "RunClaimed",
                     "RunStarted"]
    claimed = timeline[3]
    assert claimed[3] == "worker-3"
    assert [cells[4:6] for cells in timeline[:3]] == [
        ["TOOLS", "TOOLS"], ["AWAITING_MODEL", "TOOLS"], ["RUN_AGAIN", "AWAITING_MODEL"]]
    assert all(cells[2].endswith("Z") for cells in timeline)
    ledger = p.table("ledger")
    assert [cells[:4] for cells in ledger] == [["charge", "charge_card", "started", "1"]]
    assert "never re-run" in p.element_text("verdict")
    assert p.has_form("/act/resolve") is False  # not logged in: no form to act
    svg = make().get("/run/diagram.svg?id=order-17")
    assert svg.headers["content-type"].startswith("image/svg+xml")
    ET.fromstring(svg.text)
    page(make(), "/run?id=nobody", 404)


# ------------------------------------------------------------------ the writes


def test_resolve_with_evidence_leaves_the_inbox_and_records_who(make: Make,
                                                                seeded: Seeded) -> None:
    client = make()
    logged_in(client, "ann")
    form = page(client, "/run?id=order-17").form("/act/resolve", call_id="charge")
    assert "by" not in form.fields  # who decides is the login, never a field
    before = log(seeded.path, "order-17")
    answer = client.post("/act/resolve", data=send(
        form, outcome="completed", output='{"payment": "pay_1"}',
        evidence="stripe pay_1"), follow_redirects=False)
    assert answer.status_code == 303, answer.text
    after = log(seeded.path, "order-17")
    assert answer.headers["location"] == f"/run?id=order-17&done=resolve&seq={len(after) - 1}"
    assert after[: len(before)] == before
    added = after[len(before):]
    assert [type(e) for e in added] == [ev.RunClaimed, ev.InDoubtResolved]
    resolved = added[1]
    assert isinstance(resolved, ev.InDoubtResolved)
    assert (resolved.call_id, resolved.by, resolved.outcome, resolved.evidence,
            resolved.output) == ("charge", "ann", Resolution.COMPLETED, "stripe pay_1",
                                 {"payment": "pay_1"})
    inbox = page(client, "/inbox").table("inbox")
    assert ("order-17", "charge") not in {(c[1], c[2]) for c in inbox}
    shown = page(client, "/run?id=order-17")
    newest = shown.table("timeline")[0]
    assert (newest[1], newest[3]) == ("InDoubtResolved", "ann")


def test_approve_binds_the_fingerprint_it_shows(make: Make, seeded: Seeded) -> None:
    client = make()
    logged_in(client, "bob")
    p = page(client, "/run?id=order-19")
    form = p.form("/act/approve", call_id="wire")
    assert form.fields["fingerprint"] in p.text  # shown, not only sent
    answer = client.post("/act/approve", data=send(form, reason="known payee"),
                         follow_redirects=False)
    assert answer.status_code == 303, answer.text
    approved = log(seeded.path, "order-19")[-1]
    assert isinstance(approved, ev.CallApproved)
    assert (approved.call_id, approved.by, approved.reason, approved.fingerprint) == (
        "wire", "bob", "known payee", form.fields["fingerprint"])


def refused(client: TestClient, seeded: Seeded, run_id: str, action: str,
            fields: dict[str, str], status: int, **headers: str) -> str:
    """Post ``fields`` and check the refusal changed nothing; the page's text."""
    before = log(seeded.path, run_id)
    answer = client.post(action, data=fields, headers=headers, follow_redirects=False)
    assert answer.status_code == status, answer.text[:800]
    assert log(seeded.path, run_id) == before
    return Page(answer.text).text


def test_a_stale_page_is_refused_and_changes_nothing(make: Make, seeded: Seeded) -> None:
    client = make()
    logged_in(client)
    form = page(client, "/run?id=order-18").form("/act/approve", call_id="refund")
    # someone else decides the other call meanwhile: the page no longer shows the run
    operator.reject(SQLiteEventStore(seeded.path), "order-18", "email", by="carol")
    text = refused(client, seeded, "order-18", "/act/approve", send(form), 409)
    assert "ConcurrencyConflict" in text
    assert "Nothing was changed" in text


def test_a_moved_fingerprint_is_refused(make: Make, seeded: Seeded) -> None:
    client = make()
    logged_in(client)
    form = page(client, "/run?id=order-18").form("/act/approve", call_id="refund")
    other = page(client, "/run?id=order-18").form("/act/approve", call_id="email")
    # the approval of the refund carries the email's fingerprint: not the refund's call
    text = refused(client, seeded, "order-18", "/act/approve",
                   send(form, fingerprint=other.fields["fingerprint"]), 409)
    assert "InvalidTransition" in text


@pytest.mark.parametrize(("change", "status"), [
    ({"csrf": None}, 403), ({"csrf": "forged"}, 403), ({"seen": None}, 400),
    ({"seen": "many"}, 400), ({"seen": "²"}, 400), ({"seen": "٣"}, 400),
    ({"call_id": None}, 400)])
def test_a_write_without_its_tokens_or_fields_is_refused(
        make: Make, seeded: Seeded, change: dict[str, Any], status: int) -> None:
    client = make()
    logged_in(client)
    form = page(client, "/run?id=order-19").form("/act/approve", call_id="wire")
    refused(client, seeded, "order-19", "/act/approve", send(form, **change), status)


def test_a_write_without_a_login_or_from_another_site_is_refused(make: Make,
                                                                 seeded: Seeded) -> None:
    client = make()
    logged_in(client)
    form = page(client, "/run?id=order-19").form("/act/approve", call_id="wire")
    refused(client, seeded, "order-19", "/act/approve", send(form), 403,
            origin="http://evil.example")
    refused(client, seeded, "order-19", "/act/approve", send(form), 403,
            referer="http://evil.example/page")
    refused(client, seeded, "order-19", "/act/approve", send(form), 403, origin="null")
    stranger = make()  # the same fields, the same CSRF token, but no login cookie
    refused(stranger, seeded, "order-19", "/act/approve", send(form), 403)
    logout = page(client, "/runs").form("/logout")
    assert client.post("/logout", data=logout.fields, follow_redirects=False
                       ).status_code == 303
    refused(client, seeded, "order-19", "/act/approve", send(form), 403)


def test_wrong_tokens_and_names_open_no_login(make: Make) -> None:
    client = make()
    for token, name, status in ((TOKEN[:-1], "ann", 403), ("", "ann", 403),
                                (TOKEN, "", 400), (TOKEN, "a\nb", 400),
                                (TOKEN, "x" * 201, 400), (TOKEN, "ann\x1b[2K\rbob", 400),
                                (TOKEN, "ann\u202ebob", 400), (TOKEN, "a\u200bb", 400)):
        answer = client.post("/login", data={"token": token, "name": name},
                             follow_redirects=False)
        assert answer.status_code == status
        assert "set-cookie" not in answer.headers


@pytest.mark.parametrize("target", ["//evil.example/x", "https://evil.example/",
                                    "/\\evil.example", "javascript:alert(1)", "runs"])
def test_a_login_never_sends_the_browser_elsewhere(make: Make, target: str) -> None:
    answer = make().post("/login", data={"token": TOKEN, "name": "ann", "next": target},
                         follow_redirects=False)
    assert answer.headers["location"] == "/runs"


@pytest.mark.parametrize(("fields", "status", "error"), [
    ({"outcome": "not_executed", "output": '"it ran"'}, 400, "takes no output"),
    ({"outcome": "completed", "output": "{not json"}, 409, "SchemaError"),
    ({"outcome": "completed", "output": "1" * 5000}, 409, "SchemaError"),
    ({"outcome": "completed", "output": ""}, 400, "completed needs"),
    ({"outcome": "failed", "output": " "}, 400, "failed needs"),
    ({"outcome": "maybe"}, 400, "outcome is one of"),
])
def test_a_resolve_form_that_says_two_things_is_refused(
        make: Make, seeded: Seeded, fields: dict[str, str], status: int,
        error: str) -> None:
    client = make()
    logged_in(client)
    form = page(client, "/run?id=order-17").form("/act/resolve", call_id="charge")
    text = refused(client, seeded, "order-17", "/act/resolve", send(form, **fields),
                   status)
    assert error in text


def test_not_executed_and_abandon_through_the_forms(make: Make, seeded: Seeded) -> None:
    client = make()
    logged_in(client, "dan")
    form = page(client, "/run?id=order-17").form("/act/resolve", call_id="charge")
    assert client.post("/act/resolve", data=send(form, outcome="not_executed"),
                       follow_redirects=False).status_code == 303
    resolved = log(seeded.path, "order-17")[-1]
    assert isinstance(resolved, ev.InDoubtResolved)
    assert resolved.outcome is Resolution.NOT_EXECUTED
    assert resolved.output is None
    form = page(client, "/run?id=run-1").form("/act/abandon")
    assert client.post("/act/abandon", data=send(form, reason="the Session is gone"),
                       follow_redirects=False).status_code == 303
    gone = log(seeded.path, "run-1")[-1]
    assert isinstance(gone, ev.Abandoned)
    assert (gone.reason, gone.by) == ("the Session is gone", "dan")
    assert not page(client, "/run?id=run-1").has_form("/act/abandon")


def test_a_huge_or_foreign_body_is_refused(make: Make, seeded: Seeded) -> None:
    client = make()
    logged_in(client)
    form = page(client, "/run?id=order-19").form("/act/reject", call_id="wire")
    refused(client, seeded, "order-19", "/act/reject",
            send(form, message="x" * (1_048_576 + 1)), 413)
    before = log(seeded.path, "order-19")
    answer = client.post("/act/reject", files={"message": ("m.txt", b"x")},
                         data=form.fields, follow_redirects=False)
    assert answer.status_code == 415
    assert log(seeded.path, "order-19") == before


# ------------------------------------------------------------------ what is served


def test_the_read_only_console_has_no_write_route(make: Make, seeded: Seeded) -> None:
    writer = make()
    logged_in(writer)
    form = page(writer, "/run?id=order-19").form("/act/approve", call_id="wire")
    client = make(read_only=True, logins=False)
    for url in ("/runs", "/inbox", *(f"/run?id={r}" for r in ("order-17", "order-19"))):
        assert not any(f.method == "post" for f in page(client, url).forms)
    for verb in ("approve", "reject", "resolve", "abandon"):
        refused(client, seeded, "order-19", f"/act/{verb}", send(form), 404)
    assert client.get("/login").status_code == 404
    assert client.post("/login", data={"token": TOKEN, "name": "x"}).status_code == 404


def test_a_console_with_a_token_file_needs_a_login_to_read(make: Make) -> None:
    client = make(private=True)
    for url in ("/runs", "/inbox", "/run?id=order-17", "/run/diagram.svg?id=order-17"):
        answer = client.get(url, follow_redirects=False)
        assert answer.status_code == 303
        assert answer.headers["location"].startswith("/login?next=")
        assert "order-17" not in answer.text
    logged_in(client)
    page(client, "/inbox")


def test_a_loopback_console_answers_only_loopback_names(make: Make) -> None:
    client = make(hosts=loopback_hosts("127.0.0.1", 8765))
    assert client.get("/runs", headers={"host": "127.0.0.1:8765"}).status_code == 200
    assert client.get("/runs", headers={"host": "localhost:8765"}).status_code == 200
    assert client.get("/runs", headers={"host": "evil.example"}).status_code == 421
    assert client.get("/runs", headers={"host": "127.0.0.1:9999"}).status_code == 421


def test_hostile_values_never_become_markup(tmp_path: Path) -> None:
    hostile = seed(tmp_path, hostile=True)
    reads = SQLiteEventStore(hostile.path, readonly=True)
    client = TestClient(create_app(Console(reads, SQLiteEventStore(hostile.path),
                                           Logins(TOKEN), False, None)))
    logged_in(client, f"eve{HOSTILE}")
    pages = [page(client, "/runs"), page(client, "/inbox")]
    pages += [page(client, "/run?" + urlencode({"id": run_id})) for run_id in hostile.runs]
    for p in pages:
        markup_is_clean(p)
        assert HOSTILE in p.text  # shown as text, whole
    for run_id in hostile.runs:
        answer = client.get("/run/diagram.svg", params={"id": run_id})
        tree = ET.fromstring(answer.text)
        assert not [e for e in tree.iter() if e.tag.rsplit("}", 1)[-1] in (
            "script", "foreignObject", "image")]
    # a refusal's message echoes the form's values: as text too
    crashed = next(r for r in hostile.runs if r.startswith("order-17"))
    p = page(client, "/run?" + urlencode({"id": crashed}))
    form = next(f for f in p.forms if f.action == "/act/resolve")
    answer = client.post("/act/resolve", data=send(form, outcome=HOSTILE),
                         follow_redirects=False)
    assert answer.status_code == 400
    markup_is_clean(Page(answer.text))


# ------------------------------------------------------------------ starting it


def test_token_files_are_checked(tmp_path: Path) -> None:
    good = tmp_path / "token"
    good.write_text(f"  {TOKEN}\nignored\n")
    good.chmod(0o600)
    assert read_token(good) == TOKEN
    short = tmp_path / "short"
    short.write_text("abc\n")
    short.chmod(0o600)
    with pytest.raises(UserError, match="shorter than 16"):
        read_token(short)
    shared = tmp_path / "shared"
    shared.write_text(TOKEN)
    shared.chmod(0o644)
    with pytest.raises(UserError, match="chmod 600"):
        read_token(shared)
    with pytest.raises(UserError, match="cannot read"):
        read_token(tmp_path / "missing")
    with pytest.raises(UserError, match="not a regular file"):
        read_token(tmp_path)


def run_cli(*argv: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, err.getvalue()


def test_serve_refuses_to_listen_beyond_loopback_without_a_token(seeded: Seeded,
                                                                  tmp_path: Path) -> None:
    for host in ("0.0.0.0", "192.168.1.7", "example.com", "::"):
        code, err = run_cli("serve", "--store", str(seeded.path), "--host", host)
        assert code == 2
        assert "needs --token-file" in err
    code, err = run_cli("serve", "--store", str(tmp_path / "none.db"))
    assert code == 2
    assert "no such store file" in err
    code, err = run_cli("serve", "--store", str(seeded.path), "--port", "70000")
    assert code == 2
    assert "not a TCP port" in err


@pytest.mark.postgres
def test_the_console_on_postgresql(pg_dsn: str, pg_schema: str) -> None:
    """The same pages and a resolve through the form, on PostgreSQL stores (a read-only
    one for the pages, as ``serve --dsn`` opens them)."""
    from statemachine import RunController
    from statemachine.postgres import PostgresEventStore

    with PostgresEventStore(pg_dsn, schema=pg_schema) as writes, \
            PostgresEventStore(pg_dsn, schema=pg_schema, readonly=True) as reads:
        approvals, in_doubt, runs = seed_into(writes)
        client = TestClient(create_app(Console(reads, writes, Logins(TOKEN), False, None)))
        found = page(client, "/inbox").table("inbox")
        assert {(c[1], c[2]): c[3] for c in found} == {**approvals, **in_doubt}
        assert {c[0]: c[1] for c in page(client, "/runs").table("runs")} == runs
        logged_in(client, "pat")
        form = page(client, "/run?id=order-17").form("/act/resolve", call_id="charge")
        answer = client.post("/act/resolve", data=send(form, outcome="failed",
                                                       output="card declined"),
                             follow_redirects=False)
        assert answer.status_code == 303, answer.text
        resolved = RunController.load(writes, "order-17").events[-1]
        assert isinstance(resolved, ev.InDoubtResolved)
        assert (resolved.by, resolved.outcome, resolved.output) == (
            "pat", Resolution.FAILED, "card declined")
        assert ("order-17", "charge") not in {
            (c[1], c[2]) for c in page(client, "/inbox").table("inbox")}


def test_what_does_not_print_as_itself_is_shown_escaped(tmp_path: Path) -> None:
    """A direction override or a zero-width space prints as something else, or as
    nothing: an IBAN ``"\\u202e1111 9999 00ED"`` reads as ``"DE00 9999 1111"``. Every
    page shows such a character as its escape (the runs, the inbox, the run's ids, tool
    names and notes), and a call's arguments as JSON that reads back as exactly what an
    approval binds. Before, the run page printed them as they were (the CLI escaped
    them)."""
    import html
    import re

    from statemachine import RunController, ToolCall

    run_id, call_id, tool = "pay\u202e-1", "wire\u200b", "wire_money\u202e"
    arguments = {"to_iban": "\u202e1111 9999 00ED", "amount": 100}
    path = tmp_path / "events.db"
    store = SQLiteEventStore(path)
    c = RunController.start(run_id=run_id, session_id=None, store=store)
    c.begin_model_call()
    c.model_responded([ToolCall(call_id, tool, arguments, needs_approval=True)])
    store.close()
    reads = SQLiteEventStore(path, readonly=True)
    try:
        client = TestClient(create_app(Console(reads, SQLiteEventStore(path), Logins(TOKEN),
                                               False, None)), base_url="http://testserver")
        logged_in(client)
        for url in ("/runs", "/inbox", f"/run?id={run_id}"):
            text = client.get(url).text
            assert not any(c in text for c in "\u202e\u200b"), url
            assert "pay\\u202e-1" in text, url
        text = client.get(f"/run?id={run_id}").text
        assert "wire\\u200b" in text
        assert "wire_money\\u202e" in text
        shown = re.findall(r'<pre class="arguments">(.*?)</pre>', text, re.S)
        assert [json.loads(html.unescape(block)) for block in shown] == [arguments]
    finally:
        reads.close()
