"""The MCP world the adapters' MCP tests share: a real MCP server (the `mcp` package,
`tests.drivers.mcp_server`) in its own process on loopback, counting in an fsynced file
every ``tools/call`` it received; killed and started again as a test needs."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from tests.drivers.mcp_server import KEY, calls

ROOT = Path(__file__).resolve().parents[2]

__all__ = ["KEY", "Server", "calls"]


class Server:
    """``Server(folder)``: the MCP server process, started by `start` (``cut``: the tools
    whose first call kills it after recording the call, before answering)."""

    def __init__(self, folder: Path) -> None:
        self.log = folder / "mcp-calls.jsonl"
        self.process: subprocess.Popen[str] | None = None
        self.url = ""

    def start(self, *cut: str) -> Server:
        self.stop()
        command = [sys.executable, "-m", "tests.drivers.mcp_server", str(self.log)]
        for tool in cut:
            command += ["--cut", tool]
        self.process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE,
                                        stderr=subprocess.DEVNULL, text=True)
        assert self.process.stdout is not None
        port = int(self.process.stdout.readline())
        self.url = f"http://127.0.0.1:{port}/mcp"
        return self

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=30)
            self.process = None

    def calls(self) -> list[dict[str, Any]]:
        """Every ``tools/call`` the server received, in order (from its fsynced log)."""
        return calls(self.log)

    def counted(self) -> Counter[str]:
        return Counter(call["tool"] for call in self.calls())
