"""A throwaway PostgreSQL cluster for the tests (DESIGN §6.7).

`start_cluster` runs ``initdb`` (``--auth=trust``, UTF8, locale C) in a new temp dir and
starts the server with ``pg_ctl``, listening only on a unix socket inside that dir (no TCP
port, so clusters of parallel test runs never meet). ``initdb`` refuses to run as root:
as root, every server command runs as the ``postgres`` user (``runuser``), and the temp
dir is handed to that user. `Cluster.stop` stops the server and removes the dir.

`STATEMACHINE_PG_DSN`, when set, names an existing server instead; the tests then cannot
restart it, so the restart test skips with `EXTERNAL_SKIP` (the one PostgreSQL skip CI
accepts).
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

DSN_VARIABLE = "STATEMACHINE_PG_DSN"
EXTERNAL_SKIP = (f"needs the throwaway cluster (it restarts the server); {DSN_VARIABLE} "
                 "names an external one")
"""The reason of the only skip of a PostgreSQL test that CI lets pass."""

DATABASE = "statemachine_test"
SERVER_USER = "postgres"
_SEARCH = "/usr/lib/postgresql/*/bin"


class NoServer(Exception):
    """No PostgreSQL server can be had here; the message is the one-line reason."""


def server_bin_dir() -> Path:
    """The directory of ``initdb``/``pg_ctl``: on PATH, else the newest
    ``/usr/lib/postgresql/<version>/bin`` (Debian's packages keep them off PATH)."""
    found = shutil.which("initdb")
    if found is not None:
        where = Path(os.path.realpath(found)).parent
        if (where / "pg_ctl").exists():
            return where
    candidates = sorted(glob.glob(_SEARCH), key=lambda p: _version_key(Path(p).parent.name))
    for candidate in reversed(candidates):
        if (Path(candidate) / "initdb").exists() and (Path(candidate) / "pg_ctl").exists():
            return Path(candidate)
    raise NoServer("no PostgreSQL server binaries (initdb, pg_ctl) on PATH or in "
                   f"{_SEARCH}")


def _version_key(name: str) -> tuple[int, ...]:
    return tuple(int(part) for part in name.split(".") if part.isdigit())


class Cluster:
    """A running throwaway cluster: ``dsn`` names its test database."""

    def __init__(self, root: Path, bindir: Path, as_user: list[str]) -> None:
        self.root = root
        self.data = root / "data"
        self.sockets = root / "sock"
        self.log = root / "server.log"
        self._bindir = bindir
        self._as_user = as_user
        self._watchdog: subprocess.Popen[bytes] | None = None
        self.dsn = f"host={self.sockets} dbname={DATABASE} user={SERVER_USER}"

    def _run(self, *args: str, timeout: float = 120.0) -> None:
        command = [*self._as_user, str(self._bindir / args[0]), *args[1:]]
        done = subprocess.run(command, cwd=self.root, capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL, check=False)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise NoServer(f"{args[0]} failed ({done.returncode}): {tail[0]}")

    def init(self) -> None:
        self._run("initdb", "-D", str(self.data), "--auth=trust", "-E", "UTF8",
                  "--locale=C", "-U", SERVER_USER, "--no-sync")

    def start(self) -> None:
        # a transaction a broken test leaves open is ended after a minute, so a schema
        # drop waiting for its locks cannot hang the run
        options = (f"-k {self.sockets} -c listen_addresses='' -c fsync=on "
                   "-c max_connections=100 -c idle_in_transaction_session_timeout=60s")
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60",
                  "-o", options, "start")
        self._watch()

    def _watch(self) -> None:
        """A process that stops the server and removes the dir if this one dies without
        doing so (a test run killed by a timeout must not leave a server behind)."""
        stop = [*self._as_user, str(self._bindir / "pg_ctl"), "-D", str(self.data), "-m",
                "immediate", "-w", "-t", "60", "stop"]
        self._watchdog = subprocess.Popen(
            [sys.executable, "-c", _WATCHDOG, str(os.getpid()), str(self.root), *stop],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, cwd=self.root)

    def restart(self) -> None:
        """Stop the server (``-m fast``: open sessions are cut) and start it again."""
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-m", "fast", "-w",
                  "-t", "60", "restart")

    def stop(self) -> None:
        """Stop the server (if it runs) and remove the cluster's dir."""
        try:
            if (self.data / "postmaster.pid").exists():
                with contextlib.suppress(NoServer, subprocess.TimeoutExpired):
                    self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w",
                              "-t", "60", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
            if self._watchdog is not None:
                self._watchdog.kill()
                self._watchdog.wait()


_WATCHDOG = """
import os, shutil, subprocess, sys, time
pid, root, stop = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
while True:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        break
    time.sleep(0.5)
subprocess.run(stop, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
shutil.rmtree(root, ignore_errors=True)
"""


def start_cluster() -> Cluster:
    """initdb + start + CREATE DATABASE; `NoServer` (with the cluster cleaned up) when
    any step fails."""
    bindir = server_bin_dir()
    try:
        import psycopg
    except ImportError:
        raise NoServer("psycopg is not installed (pip install -e '.[postgres]')") from None
    as_user: list[str] = []
    if os.geteuid() == 0:  # initdb refuses root: run the server as its own user
        runuser = shutil.which("runuser")
        try:
            import pwd

            account = pwd.getpwnam(SERVER_USER)
        except KeyError:
            raise NoServer(f"running as root and there is no {SERVER_USER!r} user to run "
                           "initdb as") from None
        if runuser is None:
            raise NoServer("running as root and runuser is missing (initdb refuses root)")
        as_user = [runuser, "-u", SERVER_USER, "--"]
    # a short path: a unix socket's path is limited to about 100 bytes
    root = Path(tempfile.mkdtemp(prefix="smpg-", dir="/tmp" if os.path.isdir("/tmp")
                                 else None))
    cluster = Cluster(root, bindir, as_user)
    try:
        cluster.sockets.mkdir()
        if as_user:
            for path in (root, cluster.sockets):
                os.chown(path, account.pw_uid, account.pw_gid)
        cluster.init()
        cluster.start()
        admin = f"host={cluster.sockets} dbname=postgres user={SERVER_USER}"
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {DATABASE}")
    except BaseException as error:
        cluster.stop()
        if isinstance(error, NoServer):
            raise
        if isinstance(error, Exception):
            raise NoServer(f"the throwaway cluster did not start: {type(error).__name__}: "
                           f"{str(error).strip().splitlines()[0] if str(error) else ''}"
                           ) from error
        raise
    return cluster


def unique_schema() -> str:
    """A new schema name for one test's tables."""
    return f"t_{uuid.uuid4().hex[:16]}"


def drop_schema(dsn: str, schema: str) -> None:
    """Drop a test's schema and everything in it (best effort: a server that is gone
    takes its schemas along)."""
    import psycopg

    with contextlib.suppress(psycopg.Error), psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET lock_timeout = '30s'")
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def wait_until_up(dsn: str, timeout: float = 30.0) -> None:
    """Block until the server answers (after a restart)."""
    import psycopg

    deadline = time.monotonic() + timeout
    while True:
        try:
            with psycopg.connect(dsn, connect_timeout=2) as conn:
                conn.execute("SELECT 1")
            return
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
