"""The web console against an adversarial review: each test is a defect the review
demonstrated (a private run shown to a bare POST, an approval on arguments the page cut,
500s on a failing store or a strange digit, a body read without bound before any login,
a decider's name that prints as another, a page that says what was not done, a token
FIFO, a bracketed IPv6 host, a busy port), now refused or handled."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from statemachine import RunController, SQLiteEventStore, ToolCall
from statemachine import events as ev
from statemachine.console import Console, Logins, create_app
from statemachine.console.app import MAX_FORM
from tests.console.pages import Page, log, send
from tests.console.world import Seeded, seed

TOKEN = "correct-horse-battery-staple"


@pytest.fixture
def seeded(tmp_path: Path) -> Seeded:
    return seed(tmp_path)


@pytest.fixture
def stores(seeded: Seeded) -> Iterator[tuple[SQLiteEventStore, SQLiteEventStore]]:
    reads, writes = SQLiteEventStore(seeded.path, readonly=True), SQLiteEventStore(seeded.path)
    yield reads, writes
    reads.close()
    writes.close()


def client_for(stores: tuple[Any, Any], *, private: bool = False) -> TestClient:
    reads, writes = stores
    return TestClient(create_app(Console(reads, writes, Logins(TOKEN), private, None)),
                      raise_server_exceptions=False)


def logged_in(client: TestClient, name: str = "ann") -> None:
    answer = client.post("/login", data={"token": TOKEN, "name": name},
                         follow_redirects=False)
    assert answer.status_code == 303


# ------------------------------------------------------------ 1. a private console leaks


def test_a_private_console_shows_no_run_to_a_post_without_a_login(
        stores: tuple[Any, Any]) -> None:
    """With --token-file every page needs a login; GET /run redirects to /login. But a
    refused write re-renders the run's page: a bare POST with only run_id, no cookie,
    no CSRF token, reads the whole run (ledger, arguments, owner, timeline)."""
    client = client_for(stores, private=True)
    assert client.get("/run?id=order-17", follow_redirects=False).status_code == 303
    answer = client.post("/act/approve", data={"run_id": "order-17"},
                         follow_redirects=False)
    assert "charge_card" not in answer.text  # the tool's name, from the private run
    assert "worker-3" not in answer.text  # its owner
    # and run ids can be probed: 404 for an unknown run, 403 for a known one
    probe = client.post("/act/abandon", data={"run_id": "nobody"}, follow_redirects=False)
    assert probe.status_code == answer.status_code


# ------------------------------------------------------------ 2. approving the unseen


def test_an_approval_is_offered_only_on_arguments_the_page_shows(
        seeded: Seeded, stores: tuple[Any, Any]) -> None:
    """The fingerprint binds the whole arguments, but every place the page shows them
    (approval card, ledger) is the 200-character preview: a long field ahead of ``to``
    hides where the money goes, and the approval is accepted."""
    _, writes = stores
    c = RunController.start(run_id="wire-out", session_id=None, store=writes)
    c.begin_model_call()
    c.model_responded([ToolCall("pay", "wire", {"amount": 10, "memo": "x" * 250,
                                                "to": "ATTACKER-IBAN"},
                                needs_approval=True)])
    client = client_for(stores)
    logged_in(client)
    p = Page(client.get("/run?id=wire-out").text)
    form = p.form("/act/approve", call_id="pay")
    answer = client.post("/act/approve", data=send(form), follow_redirects=False)
    assert answer.status_code == 303  # approved ...
    assert "ATTACKER-IBAN" in p.text  # ... on arguments the person was never shown


# ------------------------------------------------------------ 3. crashes


def test_a_seen_that_is_a_superscript_digit_is_refused_not_a_500(
        stores: tuple[Any, Any]) -> None:
    """``"²".isdigit()`` is True, ``int("²")`` raises ValueError: a 500."""
    client = client_for(stores)
    logged_in(client)
    form = Page(client.get("/run?id=order-19").text).form("/act/reject", call_id="wire")
    answer = client.post("/act/reject", data=send(form, seen="²"), follow_redirects=False)
    assert answer.status_code == 400


def test_a_replaced_store_file_gives_a_typed_error_not_a_500(
        seeded: Seeded, stores: tuple[Any, Any]) -> None:
    """The store raises StorageError (a ControlError) when its file was replaced; no
    page catches it, and the write's refusal path re-reads the run and raises again."""
    client = client_for(stores)
    logged_in(client)
    form = Page(client.get("/run?id=order-19").text).form("/act/reject", call_id="wire")
    copy = seeded.path.with_name("copy.db")
    shutil.copy(seeded.path, copy)
    for suffix in ("", "-wal", "-shm"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(f"{seeded.path}{suffix}")
    shutil.copy(copy, seeded.path)
    assert client.get("/runs").status_code != 500
    assert client.get("/run?id=order-19").status_code != 500
    assert client.post("/act/reject", data=send(form),
                       follow_redirects=False).status_code != 500


def test_an_unreachable_dsn_is_refused_at_start_not_served_as_500s() -> None:
    """``serve --read-only --dsn`` opens nothing at start: it prints "console on ..." and
    every page is a 500 (SQLite's --store is checked at start: "no such store file")."""
    pytest.importorskip("psycopg")
    from statemachine.cli.common import UserError
    from statemachine.cli.serve import console_for
    from statemachine.errors import ControlError

    args = argparse.Namespace(store=None, dsn="postgresql://nobody@127.0.0.1:1/none",
                              host="127.0.0.1", port=8765, token_file=None, read_only=True)
    try:
        console, _ = console_for(args)
    except (UserError, ControlError):
        return  # refused at start (the command prints it in one line, exit 2)
    client = TestClient(create_app(console), base_url="http://127.0.0.1:8765",
                        raise_server_exceptions=False)
    assert client.get("/runs").status_code != 500


# ------------------------------------------------------------ 4. what a write records


def test_who_decides_is_the_login_never_a_field(seeded: Seeded,
                                                stores: tuple[Any, Any]) -> None:
    """A form's ``by`` (anyone's name, escape sequences, direction overrides) is not who
    decides: the login is, whose name was checked when it logged in."""
    client = client_for(stores)
    logged_in(client)
    form = Page(client.get("/run?id=order-19").text).form("/act/reject", call_id="wire")
    answer = client.post("/act/reject", data=send(form, by="ann\x1b[2K\rbob\u202e"),
                         follow_redirects=False)
    assert answer.status_code == 303
    rejected = log(seeded.path, "order-19")[-1]
    assert isinstance(rejected, ev.CallRejected)
    assert rejected.by == "ann"


def test_a_page_does_not_say_approved_when_nothing_was(stores: tuple[Any, Any]) -> None:
    """``done=approve`` in a link makes any run's page say "Approved." though the call
    still awaits: the status line is anyone's to set."""
    client = client_for(stores)
    p = Page(client.get("/run?id=order-19&done=approve").text)
    assert "wire" in p.element_text("actions")  # the call still awaits a decision
    assert "Approved." not in p.text


# ------------------------------------------------------------ 5. the body, before the login


def test_a_body_without_content_length_is_not_read_past_the_limit(
        stores: tuple[Any, Any]) -> None:
    """Without Content-Length (chunked), `_form` awaits ``request.body()`` whole before
    comparing it with MAX_FORM, and before it checks any login: anyone may make the
    console hold a body of any size in memory."""
    reads, writes = stores
    app = create_app(Console(reads, writes, Logins(TOKEN), False, None))
    consumed = 0

    async def counting(scope: Any, receive: Any, send: Any) -> None:
        async def counted() -> Any:
            nonlocal consumed
            message = await receive()
            consumed += len(message.get("body", b""))
            return message

        await app(scope, counted, send)

    chunk = b"x" * 65536

    def body() -> Iterator[bytes]:
        yield b"run_id=order-19&message="
        for _ in range(8 * MAX_FORM // len(chunk)):
            yield chunk

    client = TestClient(counting, raise_server_exceptions=False)
    answer = client.post("/act/reject", content=body(), headers={
        "content-type": "application/x-www-form-urlencoded"})
    assert answer.status_code in (403, 413)
    assert consumed <= MAX_FORM + len(chunk)


# ------------------------------------------------------------ 6. the command line


def test_a_token_file_that_is_a_fifo_is_refused_not_waited_on(tmp_path: Path,
                                                              seeded: Seeded) -> None:
    """read_token reads before it checks S_ISREG: a FIFO blocks serve forever."""
    fifo = tmp_path / "token"
    os.mkfifo(fifo, 0o600)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "statemachine", "serve", "--store", str(seeded.path),
             "--token-file", str(fifo), "--port", "1"], capture_output=True, timeout=10,
            check=False)
    except subprocess.TimeoutExpired:
        pytest.fail("serve waits on the FIFO instead of refusing it")
    assert done.returncode == 2


def test_a_bracketed_ipv6_host_names_the_address(seeded: Seeded) -> None:
    """``--host [::1]`` is loopback and is listened on as ``::1`` (uvicorn cannot bind
    "[::1]")."""
    from statemachine.cli.serve import console_for

    args = argparse.Namespace(store=seeded.path, dsn=None, host="[::1]", port=8765,
                              token_file=None, read_only=True)
    console_for(args)
    assert args.host == "::1"


def test_a_busy_port_prints_no_console_and_no_token(seeded: Seeded) -> None:
    """What serve says (the address, the token) is said once it listens."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "statemachine", "serve", "--store", str(seeded.path),
             "--port", str(port)], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2, done.stderr
    assert "cannot listen" in done.stderr
    assert "log in with the token" not in done.stderr
    assert "console on" not in done.stderr


def test_read_only_with_a_token_file_serves_its_login_and_no_write(
        tmp_path: Path, seeded: Seeded) -> None:
    """Read-only with a token file: the login that reading needs, and no write route (as
    the README says)."""
    from statemachine.cli.serve import console_for

    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    args = argparse.Namespace(store=seeded.path, dsn=None, host="127.0.0.1", port=8765,
                              token_file=token, read_only=True)
    console, _ = console_for(args)
    client = TestClient(create_app(console), base_url="http://127.0.0.1:8765")
    assert client.get("/runs", follow_redirects=False).status_code == 303
    logged_in(client)
    assert client.get("/runs").status_code == 200
    for verb in ("approve", "reject", "resolve", "abandon"):
        assert client.post(f"/act/{verb}", data={"run_id": "order-19"}).status_code == 404
    readme = (Path(__file__).parents[2] / "README.md").read_text(encoding="utf-8")
    assert "`--read-only` serves no write route" in " ".join(readme.split())
