"""TTFT of the prefill worker under Poisson load against an M/D/1 queue (issue 16).

Reads ``bench/serving/gpu_slo_study.py`` records of a 1P1D run (``--long 2048,16``: TTFT is the prefill side) and
compares, per rate, the measured TTFT (distbench's warm-up and the first ``ramp`` requests dropped) with an
M/D/1 queue whose deterministic service time is one prefill's in-step time measured by
``bench/serving/gpu_prefill_profile.py`` (``--service-from``, the ``in_step`` per prefill) or given (``--service-ms``).
The M/D/1 figures come from Lindley's recursion over 200 000 Poisson arrivals (mean, P50, P90), so the
percentiles are compared too, not just the mean (whose closed form, S + ρS / 2(1 − ρ), the simulation
matches).

Usage: python -m bench.serving.gpu_prefill_mdl_report bench/results/serving-slo-study/mdl_thread_*.json.gz \\
         --service-from bench/results/serving-prefill-profile/prefill_thread_off.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import sys


def md1(rate: float, service_s: float, n: int = 200_000, seed: int = 1) -> dict[str, float]:
    """Sojourn times (wait + service) of an M/D/1 queue, by Lindley's recursion."""
    rng = random.Random(seed)
    wait, out = 0.0, []
    for _ in range(n):
        out.append(wait + service_s)
        gap = rng.expovariate(rate)
        wait = max(0.0, wait + service_s - gap)
    out.sort()
    return {"mean": sum(out) / n, "p50": out[n // 2], "p90": out[int(0.9 * n)]}


def measured(recs: list[dict]) -> dict[str, float]:
    ttft = sorted(r["ttft"] for r in recs if r.get("error") is None and r.get("ttft") is not None)
    n = len(ttft)
    return {"n": n, "mean": sum(ttft) / n, "p50": ttft[n // 2], "p90": ttft[int(0.9 * n)]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--service-ms", type=float, default=None)
    ap.add_argument("--service-from", default=None, help="gpu_prefill_profile.py JSON: its in_step per prefill")
    a = ap.parse_args()
    if a.service_ms is None:
        if a.service_from is None:
            print("give --service-ms or --service-from", file=sys.stderr)
            return 2
        with open(a.service_from) as f:
            a.service_ms = json.load(f)["per_prefill_ms"]["in_step"]
    s = a.service_ms / 1000.0
    print(f"service time S = {a.service_ms:.1f} ms (one prefill in step); TTFT in ms; ratio = measured / M/D/1")
    print("| run | rate | ρ | n | mean | M/D/1 mean | ratio | P50 | M/D/1 P50 | P90 | M/D/1 P90 | ratio P90 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for path in a.files:
        with gzip.open(path, "rt") as f:
            doc = json.load(f)
        name = path.rsplit("/", 1)[-1].split(".")[0]
        for pt in doc["points"]:
            recs = [r for r in pt["result"]["requests"] if not r.get("warmup")][pt.get("ramp", 0) :]
            m, q = measured(recs), md1(pt["rate"], s)
            print(
                f"| {name} | {pt['rate']:g} | {pt['rate'] * s:.2f} | {m['n']} | {1e3 * m['mean']:.1f} | "
                f"{1e3 * q['mean']:.1f} | {m['mean'] / q['mean']:.2f} | {1e3 * m['p50']:.1f} | {1e3 * q['p50']:.1f} | "
                f"{1e3 * m['p90']:.1f} | {1e3 * q['p90']:.1f} | {m['p90'] / q['p90']:.2f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
