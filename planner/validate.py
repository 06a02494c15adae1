"""Measuring what the planner predicts: start a layout with ``distserve serve`` (real processes on this
machine), push a Poisson load with the ``distbench`` CLI, read back the attainment. Used by the planner's
ordering test and ``bench/planner/plan_accuracy.py``; never by ``distserve plan`` itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from distserve.planner.latency import LatencyModel
from distserve.planner.layouts import Layout


@dataclass(frozen=True)
class Measured:
    rate: float
    attainment: float
    ttft_p90_ms: float
    tpot_p90_ms: float
    completed: int
    failed: int


# The CPU ordering check (tests/planner/test_plan_ordering_cpu.py explains why each workload ranks the layouts
# differently): (prompt, output, TTFT limit in prefill steps of the prompt, TPOT limit in decode steps, load of
# the one prefill worker of 1P1D). Limits and rate scale with the profile: a shared machine's speed moves 2-5x
# with other users' load, so absolute figures would test the load, not the planner.
ORDERING_CASES = [(512, 2, 8.0, 2.0, 0.3), (1024, 16, 5.0, 3.0, 0.5)]


def case_rate_and_slo(
    model: LatencyModel, prompt: int, ttft_steps: float, tpot_steps: float, busy: float
) -> tuple[float, str]:
    """(request rate, SLO text) of one ordering case on a profile's latency model."""
    prefill = model.prefill_ms([prompt])
    tpot = max(15.0, tpot_steps * model.decode_ms(1, prompt))
    return round(busy / prefill * 1000, 3), f"ttft:{ttft_steps * prefill:.0f}ms,tpot:{tpot:.0f}ms"


def serve_args(layout: Layout) -> tuple[str, int, int, list[str]]:
    """(mode, prefill, decode, extra args) of ``distserve serve`` for a CPU layout."""
    if layout.mode == "colocated":
        return "colocated", 1, layout.num_decode, (["--cpu-pinning", "none"] if layout.num_decode > 1 else [])
    return "disaggregated", layout.num_prefill, layout.num_decode, []


def layout_config(layout: Layout, base: dict | None = None) -> dict:
    cfg = json.loads(json.dumps(base or {}))
    cfg.setdefault("decode", {})["torch_threads"] = layout.decode_threads
    if layout.mode == "disaggregated":
        cfg.setdefault("prefill", {})["torch_threads"] = layout.prefill_threads
    cfg.setdefault("router", {})["port"] = 0
    return cfg


def run_distbench(
    url: str,
    prompt: str,
    output: str,
    rate: float,
    num: int,
    slo: str,
    out: Path,
    seed: int = 0,
    warmup: int = 2,
    timeout_s: float = 600,
) -> Measured:
    cmd = [
        sys.executable,
        "-m",
        "distserve.distbench",
        "run",
        "--url",
        url,
        "--dataset",
        "random",
        "--prompt-len",
        prompt,
        "--output-len",
        output,
        "--strategy",
        "poisson",
        "--request-rate",
        str(rate),
        "--num-prompts",
        str(num),
        "--warmup",
        str(warmup),
        "--slo",
        slo,
        "--seed",
        str(seed),
        "--no-progress",
        "--save-result",
        str(out),
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False, env=dict(os.environ))
    if p.returncode not in (0, 1) or not out.exists():
        raise RuntimeError(f"distbench failed ({p.returncode}): {p.stderr[-2000:]}")
    r = json.loads(out.read_text())
    return Measured(
        rate,
        float(r["slo_attainment"]),
        float(r.get("p90_ttft_ms") or 0.0),
        float(r.get("p90_tpot_ms") or 0.0),
        int(r["completed"]),
        int(r["failed"]),
    )


def measure_layout(
    layout: Layout,
    prompt: str,
    output: str,
    rates: list[float],
    num: int,
    slo: str,
    base_config: dict | None = None,
    workdir: Path | None = None,
) -> list[Measured]:
    """Start the layout once, run each rate in turn, stop it (by PID)."""
    from distserve.distbench.target import ServeProcess

    mode, prefill, decode, extra = serve_args(layout)
    wd = Path(workdir or tempfile.mkdtemp(prefix="plan-validate-"))
    out = []
    with ServeProcess(
        wd, mode=mode, prefill=prefill, decode=decode, config=layout_config(layout, base_config), extra_args=extra
    ) as srv:
        for i, rate in enumerate(rates):
            out.append(run_distbench(srv.url, prompt, output, rate, num, slo, wd / f"rate{i}.json", seed=i))
    return out
