"""A DSN's password never leaves the process (DESIGN §6.6, §6.7): no error message, no
chained cause a traceback prints, and no CLI line carries it, whether libpq refuses to
parse the DSN (and quotes it back) or the server cannot be reached. No server is needed:
every DSN here points at a port nothing listens on, or does not parse."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import traceback
from collections.abc import Callable
from typing import Any

import pytest

from statemachine.cli.main import main
from statemachine.errors import StorageError
from statemachine.postgres import (
    AsyncPostgresEventStore,
    AsyncPostgresSession,
    PostgresEventStore,
    PostgresSession,
)
from statemachine.postgres.steps import REDACTED, dsn_secrets, redact

SECRET = "S3cret-xyz"
"""In every DSN below, spelled in the ways libpq reads it; none of it may be printed."""

NOWHERE = "127.0.0.1:1"
DSNS = [
    f"postgresql://u:{SECRET}%zz@{NOWHERE}/db",  # libpq: invalid percent-encoded token
    f"postgresql://u:{SECRET}@{NOWHERE}/db?connect_timeout=2",  # unreachable
    f"postgres://u:{SECRET}%41@[::1/db",  # an unterminated IPv6 host: libpq quotes the URI
    f"postgresql://u:{SECRET}@{NOWHERE}/db?bogus=1",  # an unknown URI parameter
    f"postgresql://{NOWHERE}/db?password={SECRET}%zz&connect_timeout=2",
    f"host=127.0.0.1 port=1 user=u password={SECRET} dbname=db connect_timeout=2",
    f"host=127.0.0.1 port=1 password='{SECRET} \\' x' connect_timeout=2",
    f"host=127.0.0.1 password = '{SECRET}",  # an unterminated quoted string
    f"password={SECRET} bogus=1",  # an unknown option
    f"host=127.0.0.1 password={SECRET}'quote dbname",  # a key without a value
]


def _leaks(text: str) -> bool:
    return SECRET in text or SECRET[:6] in text


def _all_text(error: BaseException) -> str:
    """What a traceback of ``error`` prints: its message and every chained cause's."""
    return "".join(traceback.format_exception(error)) + repr(error)


def _calls(dsn: str) -> list[Callable[[], Any]]:
    store = PostgresEventStore(dsn)
    session = PostgresSession(dsn, "s")

    async def _async(call: Callable[[Any], Any], opened: Any) -> Any:
        try:
            return await call(opened)
        finally:
            await opened.close()

    def aio(make: Callable[[], Any], call: Callable[[Any], Any]) -> Callable[[], Any]:
        return lambda: asyncio.run(_async(call, make()))

    return [lambda: store.load("r"), store.list_runs, store.run_ids,
            lambda: PostgresEventStore(dsn, readonly=True).list_runs(),
            lambda: asyncio.run(session.get_items()),
            lambda: asyncio.run(session.add_items([{"a": 1}])),
            aio(lambda: AsyncPostgresEventStore(dsn), lambda s: s.load("r")),
            aio(lambda: AsyncPostgresSession(dsn, "s"), lambda s: s.pop_item())]


@pytest.mark.parametrize("dsn", DSNS)
def test_no_error_a_store_or_a_session_raises_carries_the_password(dsn: str) -> None:
    for call in _calls(dsn):
        with pytest.raises(StorageError) as info:
            call()
        assert info.value.outcome == "not_written"
        assert not _leaks(_all_text(info.value)), _all_text(info.value)
        assert "PostgreSQL" in str(info.value)  # still says what failed


@pytest.mark.parametrize("dsn", DSNS)
@pytest.mark.parametrize("command", [["list"], ["inspect", "--run", "r"],
                                     ["replay", "--run", "r"]])
def test_the_cli_never_prints_the_password(dsn: str, command: list[str],
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*command, "--dsn", dsn]) == 2
    out, err = capsys.readouterr()
    assert not _leaks(out + err), err
    assert "StorageError" in err


def test_the_reported_command_prints_no_password() -> None:
    """The report's reproduction, as a user types it."""
    done = subprocess.run([sys.executable, "-m", "statemachine", "list", "--dsn",
                           f"postgresql://u:{SECRET}%zz@127.0.0.1:1/db"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert not _leaks(done.stdout + done.stderr), done.stderr
    assert REDACTED in done.stderr  # libpq quoted the token: it is shown redacted


@pytest.mark.parametrize(("dsn", "shown"), [
    ("postgresql://u:p%41ss@h/db", "p%41ss"),
    ("postgresql://u:p@ss@h/db", "p@ss"),
    ("postgresql://h/db?sslmode=require&password=p%41ss", "pAss"),
    ("host=h password='it\\'s' user=u", "it's"),
    ("host=h password=plain user=u", "plain"),
    # what libpq cannot parse is read without it: each spelling still found
    ("postgresql://u:p%41ss@h/db?bogus=1", "pAss"),
    ("host=h password='it\\'s' bogus", "it's"),
    ("host=h password = 'it\\'s", "it's"),
])
def test_every_spelling_of_the_password_is_redacted(dsn: str, shown: str) -> None:
    secrets = dsn_secrets(dsn)
    assert shown in secrets
    assert redact(f"libpq said {shown!r} and {dsn}", secrets).count(REDACTED) >= 2
    assert shown not in redact(f"libpq said {shown!r} and {dsn}", secrets)


def test_a_dsn_without_a_password_redacts_nothing() -> None:
    for dsn in ("postgresql://u@h:5432/db", "host=h user=u dbname=db", "dbname=x", ""):
        assert dsn_secrets(dsn) == ()
