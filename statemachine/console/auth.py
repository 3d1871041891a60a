"""Who may write through the console: the token, the logins it opens, their CSRF tokens.

A login gives the console's token (from ``--token-file``, or the one ``serve`` made up
and printed) and a name; it gets a random session id in an HttpOnly, SameSite=Strict
cookie and a random CSRF token that every form of its pages carries. A write needs
both, compared in constant time, and a same-origin request (an ``Origin`` header, when
the browser sends one, naming the console itself). Logins live in this process only:
restarting the console logs everyone out.
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat
import threading
import time
from collections import OrderedDict
from pathlib import Path

import attrs

from statemachine.cli.common import UserError, shown

COOKIE = "statemachine_console"
LOGIN_SECONDS = 12 * 3600
"""How long a login lasts."""
MAX_LOGINS = 1_000
"""The most logins kept at once (the oldest goes first)."""
MIN_TOKEN = 16
"""The shortest token a token file may hold (characters)."""
MAX_NAME = 200
"""The longest name a login may give (characters)."""


def read_token(path: Path) -> str:
    """The token a file holds (its first line, surrounding blanks removed). `UserError`
    for a missing or unreadable file, one others may read (``chmod 600`` it), or a token
    shorter than `MIN_TOKEN` characters."""
    try:
        mode = path.stat().st_mode
    except OSError as error:
        raise UserError(f"cannot read the token file {shown(path)}: "
                        f"{error.strerror or error}") from None
    if not stat.S_ISREG(mode):  # before reading: a FIFO would wait for ever
        raise UserError(f"the token file {shown(path)} is not a regular file")
    if os.name == "posix" and mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise UserError(f"the token file {shown(path)} may be read by others: "
                        f"chmod 600 it")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise UserError(f"cannot read the token file {shown(path)}: "
                        f"{getattr(error, 'strerror', None) or error}") from None
    lines = text.strip().splitlines()
    token = lines[0].strip() if lines else ""
    if len(token) < MIN_TOKEN:
        raise UserError(f"the token in {shown(path)} is shorter than {MIN_TOKEN} "
                        "characters")
    return token


def new_token() -> str:
    return secrets.token_urlsafe(24)


@attrs.frozen
class Login:
    name: str
    csrf: str
    until: float


class Logins:
    """The open logins of one console, by session id. Safe to share between threads."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()
        self._open: OrderedDict[str, Login] = OrderedDict()
        self._lock = threading.Lock()

    def token_matches(self, given: str) -> bool:
        return hmac.compare_digest(given.encode(), self._token)

    def open(self, name: str) -> tuple[str, Login]:
        """A new login for ``name``: its session id and the login."""
        session = secrets.token_urlsafe(32)
        login = Login(name, secrets.token_urlsafe(32), time.monotonic() + LOGIN_SECONDS)
        with self._lock:
            self._open[session] = login
            while len(self._open) > MAX_LOGINS:
                self._open.popitem(last=False)
        return session, login

    def find(self, session: str | None) -> Login | None:
        """The live login ``session`` names, or None."""
        if not session:
            return None
        with self._lock:
            login = self._open.get(session)
            if login is not None and login.until < time.monotonic():
                del self._open[session]
                return None
            return login

    def close(self, session: str | None) -> None:
        with self._lock:
            self._open.pop(session or "", None)


def csrf_matches(login: Login, given: str | None) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), login.csrf.encode())
