"""Hypothesis profiles: ``ci`` (deterministic, bounded; active when CI is set), ``dev``
(the default) and ``fuzz`` (long, with a persistent example database; `just fuzz`)."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings
from hypothesis.database import DirectoryBasedExampleDatabase

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
