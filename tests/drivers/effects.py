"""Effects counted outside the process that makes them: one line per effect appended to
``DIR/effects.txt`` (O_APPEND, then fsync), so a kill -9 right after an effect cannot
lose its line. The adapters' kill -9 drivers share it."""

from __future__ import annotations

import os
from pathlib import Path


class Effects:
    """``Effects(folder, name)("tool charge")`` appends ``"<name> tool charge"``, durable
    before it returns."""

    def __init__(self, folder: Path, name: str) -> None:
        self.path = folder / "effects.txt"
        self.name = name

    def __call__(self, what: str) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{self.name} {what}\n".encode())
            os.fsync(fd)
        finally:
            os.close(fd)

    def lines(self) -> list[str]:
        """Every line appended so far, in order."""
        return self.path.read_text().splitlines() if self.path.exists() else []
