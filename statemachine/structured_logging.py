"""structlog logging for recorded events, silent unless switched on.

(Structured logging, that is: in this project "the log" is a run's event log.)

One module-level boolean gates every logging call, so a silent core pays one attribute
read per event. `enable_logging` switches it on; each controller then logs every recorded
event with its class name as the message and ``seq``, ``from`` and ``to`` (structlog
reserves ``event`` for the message, so the state names travel as keys), bound to its
``run_id``.
"""

from __future__ import annotations

import functools
import logging as _stdlib_logging
import sys
from typing import Any

import structlog


class _Switch:
    """What watches recorded events: ``logging`` (this module), ``telemetry``
    (`statemachine.telemetry`); ``enabled`` when either does (the one read a silent core
    pays per event)."""

    logging = False
    telemetry = False
    enabled = False

    def turn(self, *, logging: bool | None = None, telemetry: bool | None = None) -> None:
        if logging is not None:
            self.logging = logging
        if telemetry is not None:
            self.telemetry = telemetry
        self.enabled = self.logging or self.telemetry


switch = _Switch()


def enable_logging(*, json: bool = False, stream: Any = None) -> None:
    """Log every recorded event (as key=value lines, or JSON lines with ``json=True``)."""
    renderer: Any = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_stdlib_logging.INFO),
        logger_factory=structlog.PrintLoggerFactory(stream or sys.stderr),
        cache_logger_on_first_use=False,
    )
    run_logger.cache_clear()  # loggers bound before are bound to the old configuration
    switch.turn(logging=True)


def disable_logging() -> None:
    switch.turn(logging=False)


@functools.lru_cache(maxsize=256)
def run_logger(run_id: str) -> Any:
    """The logger bound to ``run_id``, kept here for the runs logging now rather than on
    each controller, so an idle run holds no logger."""
    return structlog.get_logger("statemachine").bind(run_id=run_id)
