"""Test-session isolation: the built-in tiny model is written to a private cache dir,
so tests never read or write the user's ~/.cache and subprocesses inherit the same one."""

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _private_model_cache(tmp_path_factory):
    if "DISTSERVE_CACHE_DIR" not in os.environ:
        os.environ["DISTSERVE_CACHE_DIR"] = str(tmp_path_factory.mktemp("distserve-cache"))
    yield
