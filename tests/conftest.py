"""Hypothesis profiles: ``ci`` (deterministic, bounded; active when CI is set), ``dev``
(the default) and ``fuzz`` (long, with a persistent example database; `just fuzz`).

And the PostgreSQL fixtures (DESIGN §6.7): ``pg_dsn`` is STATEMACHINE_PG_DSN when set,
else a throwaway cluster started once per session (tests/pg_cluster.py); ``pg_schema`` is
a fresh schema per test. Without a server the tests marked ``postgres`` skip with a
one-line reason, except under CI, where such a skip fails the run.

And one clock: a controller started without ``clock=`` reads `TEST_NOW`, always, so two
controllers that record the same commands record the same events (a live run and its
reloaded twin are compared event for event throughout); the tests of time pass their
own clocks."""

from __future__ import annotations

import os
from collections.abc import Generator, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.database import DirectoryBasedExampleDatabase

from statemachine import controller as controller_module
from tests import pg_cluster
from tests.helpers import TEST_NOW


@pytest.fixture(scope="session", autouse=True)
def _one_instant() -> Iterator[None]:
    wall_clock = controller_module.wall_clock
    controller_module.wall_clock = lambda: TEST_NOW
    try:
        yield
    finally:
        controller_module.wall_clock = wall_clock

settings.register_profile(
    "ci",
    max_examples=150,
    stateful_step_count=40,
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=100, stateful_step_count=40, deadline=None)
settings.register_profile(
    "fuzz",
    max_examples=2_000,
    stateful_step_count=60,
    deadline=None,
    database=DirectoryBasedExampleDatabase(".hypothesis/fuzz"),
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(
    os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev")
)


# ------------------------------------------------------------------ PostgreSQL (§6.7)


@pytest.fixture
def traced() -> Iterator[Any]:
    """Telemetry on (`statemachine.telemetry`) through OpenTelemetry's SDK with its
    in-memory exporter (tests/otel.py), off again after the test: a `tests.otel.Traced`.
    Under CI a missing ``opentelemetry-sdk`` fails the test instead of skipping it."""
    try:
        from tests import otel
    except ImportError:  # pragma: no cover - CI installs it (the dev extra)
        if os.environ.get("CI"):
            raise
        pytest.skip("opentelemetry-sdk is not installed (pip install -e '.[dev]')")
    from statemachine.telemetry import disable_telemetry, enable_telemetry

    traced = otel.Traced()
    enable_telemetry(otel.provider())
    try:
        yield traced
    finally:
        disable_telemetry()


@pytest.fixture(scope="session")
def pg_server() -> Iterator[pg_cluster.Cluster | None]:
    """The throwaway cluster (None when STATEMACHINE_PG_DSN names a server)."""
    if os.environ.get(pg_cluster.DSN_VARIABLE):
        yield None
        return
    try:
        cluster = pg_cluster.start_cluster()
    except pg_cluster.NoServer as reason:
        pytest.skip(f"no PostgreSQL server: {reason}")
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def pg_dsn(pg_server: pg_cluster.Cluster | None) -> str:
    """A DSN of a PostgreSQL database the tests may create schemas in."""
    if pg_server is None:
        return os.environ[pg_cluster.DSN_VARIABLE]
    return pg_server.dsn


@pytest.fixture
def pg_schema(pg_dsn: str) -> Iterator[str]:
    """A fresh schema for one test's tables, dropped afterwards."""
    schema = pg_cluster.unique_schema()
    yield schema
    pg_cluster.drop_schema(pg_dsn, schema)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Under CI a skipped PostgreSQL test is a failure (DESIGN §6.7), except the one that
    needs the throwaway cluster when STATEMACHINE_PG_DSN names another server; so is a
    skipped browser test (the console's, DESIGN §7.5)."""
    report: pytest.TestReport = yield
    if (os.environ.get("CI") and report.skipped and item.get_closest_marker("postgres")
            and not _skip_reason(report).endswith(pg_cluster.EXTERNAL_SKIP)):
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid}: a PostgreSQL test was skipped under CI "
                           f"({_skip_reason(report)}); CI must run them")
    elif os.environ.get("CI") and report.skipped and item.get_closest_marker("browser"):
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid}: a browser test was skipped under CI "
                           f"({_skip_reason(report)}); CI must run them")
    return report


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


# ------------------------------------------------------- stateful steps (DESIGN §6.9)


_WORKER_STEPS: list[int] = []
"""The stateful steps each pytest-xdist worker ran (`just test` runs one per core)."""


def pytest_sessionfinish(session: pytest.Session) -> None:
    """On a pytest-xdist worker: hand the steps it ran to the controlling process."""
    from statemachine.testing.explore import STEPS

    output = getattr(session.config, "workeroutput", None)
    if output is not None:
        output["stateful_steps"] = STEPS["stateful"]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    """pytest-xdist's: a worker ended; keep the steps it ran."""
    _WORKER_STEPS.append(int(getattr(node, "workeroutput", {}).get("stateful_steps", 0)))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The number of stateful steps the Hypothesis world machines ran in this session, in
    this process and its workers."""
    from statemachine.testing.explore import STEPS

    steps = STEPS["stateful"] + sum(_WORKER_STEPS)
    if steps:
        terminalreporter.write_line(f"stateful steps executed: {steps}")
