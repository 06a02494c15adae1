"""Shared fixtures of the planner tests: the shipped H200 profile (``planner/profiles/h200-llama2-7b.json``, built
by the bench study ``planner-h200-profile``), loaded and validated once per session; it is a frozen dataclass,
so sharing it cannot leak state between tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from distserve.planner.profile import Profile, load

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "planner"


@pytest.fixture(scope="session")
def h200_profile() -> Profile:
    return load("h200-llama2-7b")
