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
