"""A shipped Chaos Toolkit experiment runs with the `chaos` CLI against a real deployment,
with our injectors as python providers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from distserve.chaos.target import Target
from tests.chaos.conftest import ROOT

pytestmark = pytest.mark.chaos  # a whole experiment against real servers: make test-chaos


def test_chaostoolkit_runs_the_pause_experiment(tmp_path):
    chaos_cli = shutil.which("chaos") or os.path.join(os.path.dirname(sys.executable), "chaos")
    if not os.path.exists(chaos_cli):
        pytest.skip("chaostoolkit is not installed (pip install chaostoolkit; in the test extra)")
    target = Target({"prefill": 1, "decode": 1, "config": {"cache": {"kv_cache_memory_mb": 64}}}, tmp_path / "logs")
    target.start()
    try:
        env = {
            **os.environ,
            "DISTSERVE_ROUTER_URL": target.url,
            "DISTSERVE_ADMIN_TOKEN": target.token,
            "DISTSERVE_CHAOS_STATE_DIR": str(tmp_path / "state"),
            "PYTHONPATH": str(ROOT),
        }
        journal = tmp_path / "journal.json"
        p = subprocess.run(
            [
                chaos_cli,
                "--no-version-check",
                "run",
                "--journal-path",
                str(journal),
                str(ROOT / "configs" / "chaostoolkit" / "pause_decode.json"),
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        j = json.loads(journal.read_text())
        assert p.returncode == 0 and j["status"] == "completed" and not j["deviated"], p.stdout[-3000:]
        pause = next(r for r in j["run"] if r["activity"]["name"] == "pause-decode")
        assert pause["status"] == "succeeded" and pause["output"]["mechanism"] == "SIGSTOP"
        assert not list((tmp_path / "state").glob("*.json"))  # resumed: nothing left to roll back
    finally:
        target.stop()
