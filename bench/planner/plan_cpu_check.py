#!/usr/bin/env python
"""The planner against real servers on this CPU, for any model: profile, predict, serve, measure (issue 17).

    python -m bench.planner.plan_cpu_check --model smollm2-135m-instruct --out bench/results/plan_cpu_check_smollm2.json

1. ``distserve profile --device cpu --model M --quick --no-threads`` (a fresh profile of this machine, now);
2. for two workloads that rank the layouts differently (``tests/planner/test_plan_ordering_cpu.py`` explains
   why each should win), the rate and the SLO limits are set from that profile (a share of the prefill
   worker's capacity; limits in prefill and decode steps), because this machine's speed moves 2-5x with other
   users' load and absolute limits would test that load;
3. the plan's attainment at that rate for 2 colocated replicas and for 1 prefill + 1 decode worker (one torch
   thread each), and its goodput for both;
4. each layout served for real (``distserve serve``) and loaded with distbench at the same rate.

Writes one JSON (the profile's step times, per case: rate, SLO, predicted and measured attainment, TTFT/TPOT
P90, the winners). Minutes: the tiny model ~3, SmolLM2-135M ~8 on the 2-vCPU VM.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.lib.results import write_result
from distserve.planner.latency import LatencyModel
from distserve.planner.layouts import EngineLimits, Layout
from distserve.planner.profile import load
from distserve.planner.search import Planner
from distserve.planner.slo import SLO, attainment
from distserve.planner.validate import ORDERING_CASES, case_rate_and_slo, measure_layout
from distserve.planner.workload import load_workload

REPO = Path(__file__).resolve().parents[2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model to profile and serve (default: the built-in tiny model)")
    ap.add_argument("--num", type=int, default=12, help="measured requests per layout and case")
    ap.add_argument("--max-seq-len", type=int, default=1100)
    ap.add_argument("--kv-cache-mb", type=int, default=256)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="plan-cpu-check-") as tmp:
        prof_path = Path(tmp) / "profile.json"
        cmd = [sys.executable, "-m", "distserve.server.cli", "profile", "--device", "cpu", "--quick", "--no-threads"]
        cmd += (["--model", a.model] if a.model else []) + ["--out", str(prof_path)]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False, cwd=REPO)
        if p.returncode != 0:
            print(f"distserve profile failed ({p.returncode}): {p.stderr[-2000:]}", file=sys.stderr)
            return 1
        prof = load(prof_path)
        model = LatencyModel.fit(prof)
        lim = EngineLimits(64, 4096)
        layouts = {
            "colocated": Layout("colocated", 0, 2, lim, lim),
            "disaggregated": Layout("disaggregated", 1, 1, lim, lim),
        }
        base = {
            **({"model": a.model} if a.model else {}),
            "prefill": {"max_seq_len": a.max_seq_len},
            "cache": {"kv_cache_memory_mb": a.kv_cache_mb},
            "router": {"heartbeat_timeout_ms": 15000, "stream_progress_timeout_s": 120.0},
        }
        doc: dict = {
            "model": a.model or "tiny (built-in)",
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "profile": {
                "prefill_ms": {str(n): round(model.prefill_ms([n]), 1) for n in (512, 1024)},
                "decode_ms_b1": {str(n): round(model.decode_ms(1, n), 2) for n in (512, 1024)},
                "overhead_ttft_ms": prof.overhead_ttft_ms,
                "handoff_ms": prof.handoff_ms,
                "seconds": round(time.monotonic() - t0, 1),
            },
            "cases": [],
        }
        for prompt, output, ttft_steps, tpot_steps, busy in ORDERING_CASES:
            rate, slo_text = case_rate_and_slo(model, prompt, ttft_steps, tpot_steps, busy)
            slo = SLO.parse(slo_text)
            planner = Planner.for_profile(prof, load_workload(f"prompt={prompt},output={output}", n=400), slo)
            case: dict = {"workload": f"{prompt}/{output}", "slo": slo_text, "rate": rate}
            case["predicted"] = {k: attainment(slo, planner.run(lay, rate).latencies) for k, lay in layouts.items()}
            case["predicted_goodput"] = {k: round(planner.goodput(lay), 3) for k, lay in layouts.items()}
            case["measured"] = {}
            for name, lay in layouts.items():
                m = measure_layout(
                    lay, str(prompt), str(output), [rate], a.num, slo_text, base, Path(tmp) / f"{name}{prompt}"
                )[0]
                case["measured"][name] = {
                    "attainment": m.attainment,
                    "ttft_p90_ms": m.ttft_p90_ms,
                    "tpot_p90_ms": m.tpot_p90_ms,
                    "completed": m.completed,
                    "failed": m.failed,
                }
            pred, meas = case["predicted"], {k: v["attainment"] for k, v in case["measured"].items()}
            case["winner_predicted"] = (
                max(pred, key=pred.__getitem__) if pred["colocated"] != pred["disaggregated"] else "tie"
            )
            case["winner_measured"] = (
                max(meas, key=meas.__getitem__) if meas["colocated"] != meas["disaggregated"] else "tie"
            )
            doc["cases"].append(case)
            print(json.dumps(case), flush=True)
            write_result(a.out, doc)
        doc["elapsed_s"] = round(time.monotonic() - t0, 1)
        write_result(a.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
