"""Shared fixtures of the planner tests: the H200 profile is built once per session (it reads the recorded runs,
about a second each time); it is a frozen dataclass, so sharing it cannot leak state between tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from planner.from_results import build_h200_profile
from planner.profile import Profile

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


@pytest.fixture(scope="session")
def h200_profile() -> Profile:
    return build_h200_profile(RESULTS)
