"""``statemachine serve``: the web console (DESIGN §7.5) on a store, until interrupted.

It listens on loopback unless given ``--token-file``; every write needs a login with the
console's token (the file's, or one made up at start and printed) and the login's CSRF
token; ``--read-only`` serves no write route at all."""

from __future__ import annotations

import argparse
import ipaddress
import sys
from pathlib import Path
from typing import Any

from statemachine.cli.common import UserError, shown, source_store
from statemachine.cli.operate import add_store_options, writable_store

PORT = 8765


def loopback(host: str) -> bool:
    """Whether ``host`` names only this machine (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _read_store(args: argparse.Namespace) -> Any:
    """The store the pages read: read-only (no ``leave_shm``: this process may also
    write the file, through the second store)."""
    if args.store is not None and args.dsn is None:
        from statemachine.stores import SQLiteEventStore

        return SQLiteEventStore(args.store, readonly=True)
    return source_store(args)


def console_for(args: argparse.Namespace) -> tuple[Any, str | None]:
    """The `Console` the options describe, and the token to print (None: the token
    came from a file, or there is no login)."""
    try:
        from statemachine.console import Console, Logins, read_token
        from statemachine.console.app import loopback_hosts
    except ImportError as error:
        raise UserError(f"serve needs the console extra ({error.name} is missing): pip "
                        "install 'agent-statemachine[console]'") from None
    if (args.store is None) == (args.dsn is None):
        raise UserError("give one of --store DB or --dsn DSN")
    args.host = args.host.strip()
    if args.host.startswith("[") and args.host.endswith("]"):  # [::1] names ::1
        args.host = args.host[1:-1]
    if not 0 < args.port < 65536:
        raise UserError(f"--port {args.port} is not a TCP port (1 to 65535)")
    private = args.token_file is not None
    if not private and not loopback(args.host):
        raise UserError(f"--host {shown(args.host, 60)} is not loopback: a console that "
                        "others can reach needs --token-file (every page then needs a "
                        "login)")
    token = read_token(args.token_file) if private else None
    printed = None
    if token is None and not args.read_only:
        from statemachine.console.auth import new_token

        token = printed = new_token()
    reads = _read_store(args)
    reads.run_ids(limit=1)  # a store that cannot be read is refused now, not page by page
    writes = None if args.read_only else writable_store(args)
    logins = None if token is None else Logins(token)
    hosts = None if private else loopback_hosts(args.host, args.port)
    return Console(reads, writes, logins, private, hosts), printed


def serve_command(args: argparse.Namespace) -> int:
    console, printed = console_for(args)
    import uvicorn

    from statemachine.console import create_app

    where = f"http://{args.host if ':' not in args.host else f'[{args.host}]'}:{args.port}/"
    mode = "read-only" if console.writes is None else "writes need a login"

    class Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started:  # said once it listens: a busy port prints no token
                print(f"console on {where} ({mode}); Ctrl-C stops it", file=sys.stderr)
                if printed is not None:
                    print(f"log in with the token: {printed}", file=sys.stderr)
                sys.stderr.flush()

    config = uvicorn.Config(create_app(console), host=args.host, port=args.port,
                            log_level="warning", access_log=False, server_header=False)
    try:
        Server(config).run()
    except SystemExit as stopped:  # uvicorn could not listen (it said why above)
        raise UserError(f"cannot listen on {where} (exit {stopped.code})") from None
    return 0


def add_command(commands: Any) -> None:
    serve = commands.add_parser(
        "serve", help="the web console: runs, the inbox, each run, and the four actions",
        description="Serve the web console on a store (needs the console extra): every "
        "run with what blocks it, the inbox, a run's timeline, ledger and drawing, and "
        "approve / reject / resolve / abandon as forms that go through the operator "
        "(every guard applies; a refusal shows the typed error and changes nothing). It "
        "listens on loopback unless given --token-file; a write needs a login with the "
        "token (printed at start when there is no file) and the login's CSRF token.")
    add_store_options(serve, writes=True)
    serve.add_argument("--host", default="127.0.0.1",
                       help="the address to listen on (default 127.0.0.1; another than "
                            "loopback needs --token-file)")
    serve.add_argument("--port", type=int, default=PORT, help=f"default {PORT}")
    serve.add_argument("--token-file", type=Path, metavar="F",
                       help="a file holding the console's token (its first line, 16 "
                            "characters at least, readable by its owner only): every "
                            "page then needs a login")
    serve.add_argument("--read-only", action="store_true",
                       help="serve the pages only: no login, no write route")
    serve.set_defaults(run=serve_command)
