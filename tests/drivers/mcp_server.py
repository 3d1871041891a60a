"""A real MCP server (the `mcp` package's `MCPServer`) on loopback, streamable HTTP, for
the adapters' MCP tests: ``python -m tests.drivers.mcp_server LOG [--cut TOOL]...``.

It binds 127.0.0.1 on a free port and prints that port (one line) once it listens. Every
``tools/call`` it receives is appended to ``LOG`` as one JSON line (the tool, its
arguments, and the idempotency key found in the request's ``_meta``), fsynced before the
tool answers: the count of calls the server received survives whatever comes next. A
tool named by ``--cut`` kills the server right after recording its first call, before
answering it: the request was sent and received, and its response is lost. Its tools:

* ``charge(amount)``: a payment (no hints: neither read-only nor idempotent);
* ``balance()``: read-only (``readOnlyHint``);
* ``refund(amount)``: idempotent (``idempotentHint``), not read-only.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

import uvicorn
from mcp.server.mcpserver import Context, MCPServer
from mcp.types import ToolAnnotations

KEY = "statemachine/idempotency_key"


def calls(log: Path) -> list[dict[str, Any]]:
    """The ``tools/call`` requests the server recorded, in order."""
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("log", type=Path)
    parser.add_argument("--cut", action="append", default=[])
    args = parser.parse_args(argv)
    log: Path = args.log
    cut = set(args.cut)
    server = MCPServer("payments")

    def received(tool: str, arguments: dict[str, Any], ctx: Context) -> None:
        meta: Any = ctx.request_context.meta or {}

        def entry(name: str) -> Any:  # (the request's _meta: a dict, or an object)
            return meta.get(name) if isinstance(meta, dict) else getattr(meta, name, None)

        key, tenant = entry(KEY), entry("tenant")
        earlier = sum(1 for call in calls(log) if call["tool"] == tool)
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps({"tool": tool, "arguments": arguments, "key": key,
                                      "tenant": tenant}) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        if tool in cut and not earlier:
            os._exit(3)  # received and recorded, never answered: the response is lost

    @server.tool(annotations=ToolAnnotations(read_only_hint=False, destructive_hint=True,
                                             idempotent_hint=False))
    def charge(amount: int, ctx: Context) -> str:
        received("charge", {"amount": amount}, ctx)
        return f"charged {amount}"

    @server.tool(annotations=ToolAnnotations(read_only_hint=True))
    def balance(ctx: Context) -> str:
        received("balance", {}, ctx)
        return "balance 100"

    @server.tool(annotations=ToolAnnotations(read_only_hint=False, idempotent_hint=True))
    def refund(amount: int, ctx: Context) -> str:
        received("refund", {"amount": amount}, ctx)
        return f"refunded {amount}"

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    print(sock.getsockname()[1], flush=True)  # listening: connections queue until served
    config = uvicorn.Config(server.streamable_http_app(), log_level="warning")
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main(sys.argv[1:])
