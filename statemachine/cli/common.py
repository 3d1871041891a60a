"""What the command's modules share: the error a person can fix, and bounded echoes."""

from __future__ import annotations

import os

SHOWN = 200
"""The most characters of any one user-provided string (a path, an id, a name) that a
message echoes."""


class UserError(Exception):
    """A problem the person at the terminal can fix; printed as one line."""


def shown(value: object, limit: int = SHOWN) -> str:
    """``value`` as one printable line of at most ``limit`` characters (plus "...")."""
    text = os.fsdecode(value) if isinstance(value, os.PathLike | bytes) else str(value)
    cut = len(text) > limit
    text = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text[:limit])
    return text + "..." if cut else text
