"""tools/unasync.py: the sync PostgreSQL driver is generated from the async one, and the
check fails while the generated file is stale."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools import unasync


def test_the_generated_sync_driver_is_current() -> None:
    assert unasync.TARGET.read_text(encoding="utf-8") == unasync.unasync(
        unasync.SOURCE.read_text(encoding="utf-8"))
    assert unasync.main(["--check"]) == 0


def test_the_check_fails_on_a_stale_or_missing_file_and_writes_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    target = tmp_path / "statemachine" / "postgres" / "sync.py"
    target.parent.mkdir(parents=True)
    monkeypatch.setattr(unasync, "ROOT", tmp_path)
    monkeypatch.setattr(unasync, "TARGET", target)
    assert unasync.main(["--check"]) == 1  # missing
    assert not target.exists()
    stale = unasync.unasync(unasync.SOURCE.read_text(encoding="utf-8")) + "# edited\n"
    target.write_text(stale, encoding="utf-8")
    assert unasync.main(["--check"]) == 1
    assert target.read_text(encoding="utf-8") == stale
    assert "stale" in capsys.readouterr().err
    assert unasync.main([]) == 0  # regenerated
    assert unasync.main(["--check"]) == 0


def test_the_rewrite_realigns_continuations_and_sorts_the_imports() -> None:
    source = ('"""doc"""\n\nimport asyncio\nimport contextlib\n\n\n'
              "class _AsyncClient:\n"
              "    async def go(self, conn: psycopg.AsyncConnection[Any],\n"
              "                 limit: int) -> None:\n"
              "        async with self._lock:\n"
              "            await conn.execute(self.sql,\n"
              "                               (limit,))\n"
              "        self._lock = asyncio.Lock()\n")
    text = unasync.unasync(source)
    assert text.startswith('"""The sync PostgreSQL')
    assert "do not edit" in text
    assert text.endswith("\nimport contextlib\nimport threading\n\n\n"
                         "class _Client:\n"
                         "    def go(self, conn: psycopg.Connection[Any],\n"
                         "           limit: int) -> None:\n"
                         "        with self._lock:\n"
                         "            conn.execute(self.sql,\n"
                         "                         (limit,))\n"
                         "        self._lock = threading.Lock()\n")


@pytest.mark.parametrize("line", ["    return asyncio.sleep(0)", "    x = AsyncIterator",
                                  '    print("async")', "    return x  # then await"])
def test_async_code_the_rules_do_not_know_is_refused(line: str) -> None:
    source = f'"""doc"""\n\n\ndef f():\n{line}\n'
    with pytest.raises(unasync.Unconverted, match="async code"):
        unasync.unasync(source)


def test_an_async_only_block_is_left_out_of_the_sync_module() -> None:
    source = ('"""doc"""\n\n\n'
              "class _AsyncClient:\n"
              "    # unasync: async only\n"
              "    def __init__(self, group_commit: bool = True) -> None:\n"
              "        self._writer: asyncio.Task[None] | None = None\n\n"
              "    # unasync: end\n"
              "    async def go(self) -> None:\n"
              "        # unasync: async only\n"
              "        if self.group_commit:\n"
              "            return await self._in_group()\n"
              "        # unasync: end\n"
              "        await self._alone()\n")
    assert unasync.unasync(source).endswith("\n\n\nclass _Client:\n"
                                            "    def go(self) -> None:\n"
                                            "        self._alone()\n")
    aio = unasync.SOURCE.read_text(encoding="utf-8")
    assert "# unasync: async only" in aio  # the store's group commit
    generated = unasync.TARGET.read_text(encoding="utf-8")
    assert "group_commit" not in generated
    assert "SAVEPOINT" not in generated


@pytest.mark.parametrize("body", [
    "    # unasync: async only\n    x = 1\n",  # never ends
    "    x = 1\n    # unasync: end\n",  # closes nothing
    "    # unasync: async only\n    # unasync: async only\n    # unasync: end\n    x = 1\n"])
def test_a_marker_out_of_place_is_refused(body: str) -> None:
    with pytest.raises(unasync.Unconverted, match="block"):
        unasync.unasync(f'"""doc"""\n\n\ndef f():\n{body}')
