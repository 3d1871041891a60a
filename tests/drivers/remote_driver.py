"""A remote-executor client on the embedded defaults, killable at a chosen point.

``python -m tests.drivers.remote_driver DIR [--kill-before-post | --kill-in-tool]``: executes the
remote's calls with a SQLite store in DIR against a file-backed fake remote, appending a
line to DIR/effects.txt per execution; prints each dispatched call as a JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
from contextlib import aclosing
from pathlib import Path

import attrs

from statemachine import RunController
from statemachine.payloads import JSON
from statemachine.runner import FunctionTool, RemoteToolExecutor
from statemachine.stores import SQLiteEventStore
from statemachine.testing import FakeRemote


class KillingRemote(FakeRemote):
    kill_before_post = False

    async def post_result(self, call_id: str, result: JSON) -> None:
        if self.kill_before_post:
            os.kill(os.getpid(), signal.SIGKILL)
        await super().post_result(call_id, result)


async def main(folder: Path, kill_before_post: bool, kill_in_tool: bool) -> None:
    store = SQLiteEventStore(folder / "events.db")
    if store.load("remote"):
        controller = RunController.load(store, "remote")
    else:
        controller = RunController.start(run_id="remote", session_id=None, store=store)
    remote = KillingRemote([("toolu_1", "bash", {"cmd": "pay"})], path=str(folder / "remote.json"))
    remote.kill_before_post = kill_before_post

    def bash(cmd: str) -> str:
        with open(folder / "effects.txt", "a") as f:
            f.write(cmd + "\n")
        if kill_in_tool:
            os.kill(os.getpid(), signal.SIGKILL)
        return f"ran {cmd} #{len((folder / 'effects.txt').read_text().splitlines())}"

    executor = RemoteToolExecutor(remote, [FunctionTool("bash", bash)], controller=controller,
                                  backoff=0)
    async with aclosing(executor.run()) as dispatched:
        async for call in dispatched:
            print(json.dumps(attrs.asdict(call)), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", type=Path)
    parser.add_argument("--kill-before-post", action="store_true")
    parser.add_argument("--kill-in-tool", action="store_true")
    args = parser.parse_args()
    asyncio.run(main(args.folder, args.kill_before_post, args.kill_in_tool))
