"""bench/resilience/overload_cpu.py's open-loop plan (the part runs on a GPU host too: ``--device cuda``): what it
starts and sends, validated by the typed config as ``distserve serve`` would; the CPU default unchanged."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.resilience.overload_cpu import openloop_plan
from distserve.server.config import load_config

REPO = Path(__file__).resolve().parents[2]


def test_the_cpu_default_plan_is_the_tiny_model_on_the_cpu_as_before(tmp_path):
    plan = openloop_plan(tmp_path)
    assert plan["serve_args"] == () and plan["common"] == ("--prompt-len", "128", "--output-len", "32")
    assert plan["capacity_args"] == ("--concurrency", "8", "--duration", "20")
    assert plan["config"]["router"]["admission"] == {"slo_ttft_ms": 1000.0}
    assert plan["config"]["router"]["journal_path"] == str(tmp_path / "requests.jsonl")


def test_the_gpu_plan_names_the_device_and_model_and_its_configs_validate(tmp_path):
    plan = openloop_plan(tmp_path, 250.0, "preset:llama-2-7b", "cuda", 256, 16, 32)
    assert plan["serve_args"] == ("--model", "preset:llama-2-7b", "--device", "cuda")
    assert plan["common"] == ("--prompt-len", "256", "--output-len", "16")
    assert plan["capacity_args"][:2] == ("--concurrency", "32")
    cfg = load_config(None, plan["config"])
    assert cfg.router.admission.slo_ttft_ms == 250.0 and cfg.router.journal_path == str(tmp_path / "requests.jsonl")
    off = load_config(None, plan["off_config"]).router.admission
    assert (off.max_inflight_requests, off.max_queued_requests) == (0, 0)


def test_the_dry_run_parses_the_gpu_command_line_and_checks_the_preset():
    cmd = [sys.executable, "-m", "bench.resilience.overload_cpu", "--parts", "openloop", "--device", "cuda"]
    ok = subprocess.run(
        [*cmd, "--open-model", "preset:llama-2-7b", "--open-slo-ms", "250", "--dry-run"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    out = json.loads(ok.stdout)
    assert out["serve"].endswith("--model preset:llama-2-7b --device cuda") and out["rates"] == [1, 2, 4]
    bad = subprocess.run(
        [*cmd, "--open-model", "preset:no-such-model", "--dry-run"], cwd=REPO, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert bad.returncode != 0 and "unknown model preset 'no-such-model'" in bad.stderr
