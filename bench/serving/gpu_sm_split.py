"""Issue 31 on one GPU: colocated vs 1P1D unpartitioned vs 1P1D on CUDA MPS SM splits, open loop.

Each layout is one ``distserve serve --device cuda`` with default settings but the model (memory split by
role, issue 36); ``NAME:P:D`` layouts add ``--sm-split P:D``. On each server, distbench's open loop
(Poisson, 128 / 64 tokens, greedy — distbench sends temperature 0 —, ``--num-prompts`` per rate) at each
of ``--rates``; recorded per point: completed / failed, SLO attainment and goodput at TTFT <= 250 ms and
TPOT <= 50 ms, TTFT P50/P90/P99 and TPOT P90/P99, and the decode worker's mean step time over the point
(``distserve_engine_step_seconds`` / ``distserve_engine_steps`` deltas of its ``/metrics``: decode step
time against its SM share). Also each worker's start-up MPS probe (``/v1/workers`` ``memory.mps``:
SM count, bf16 GEMM TFLOP/s).

Device (one H200, carry .whl): ``bash bench/gpu_sm_split_run.sh --layouts split60:60:40 --rates 60,75``.
CPU dry run (tiny model; splits need CUDA): ``python bench/gpu_sm_split.py --device cpu --model ''
--layouts colocated,1p1d --rates 4 --num-prompts 12 --out /tmp/split.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from distbench.loadgen import RunSpec
from distbench.promscrape import parse
from distbench.runner import Options, Workload
from distbench.runner import run as run_distbench
from distbench.target import ServeProcess

REPO = Path(__file__).resolve().parents[2]

KEEP = (
    "completed",
    "failed",
    "duration",
    "request_throughput",
    "request_goodput",
    "slo_attainment",
    "p50_ttft_ms",
    "p90_ttft_ms",
    "p99_ttft_ms",
    "p90_tpot_ms",
    "p99_tpot_ms",
    "late_sends",
)


def layout_args(name: str) -> list[str]:
    """colocated | 1p1d | LABEL:P:D (1P1D with --sm-split P:D)."""
    if name == "colocated":
        return ["--mode", "colocated", "--decode", "1"]
    base = ["--mode", "disaggregated", "--prefill", "1", "--decode", "1"]
    if name == "1p1d":
        return base
    parts = name.split(":")
    if len(parts) != 3:
        raise ValueError(f"layout {name!r}: use colocated, 1p1d or LABEL:P:D")
    return [*base, "--sm-split", f"{parts[1]}:{parts[2]}"]


def step_counters(url: str) -> tuple[float, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
        samples, _ = parse(r.read().decode())
    return samples.get("distserve_engine_step_seconds", 0.0), samples.get("distserve_engine_steps", 0.0)


def one_layout(name: str, args: argparse.Namespace, doc: dict, t0: float) -> None:
    entry: dict = {"layout": name, "command": f"distserve serve --device {args.device} " + " ".join(layout_args(name))}
    doc["layouts"].append(entry)
    cfg = {"model": args.model} if args.model else {}
    with tempfile.TemporaryDirectory(prefix="i31-") as tmp:
        srv = None
        ts = time.monotonic()
        try:
            srv = ServeProcess(
                Path(tmp),
                config=cfg,
                extra_args=["--device", args.device, *layout_args(name)],
                timeout_s=args.startup_timeout_s,
                cwd=REPO,
            )
            entry["startup_s"] = round(time.monotonic() - ts, 1)
            workers = srv.workers()
            entry["workers"] = [
                {
                    "worker_id": w["worker_id"],
                    "kv_blocks": w.get("kv_blocks_free"),
                    "mps": (w.get("memory") or {}).get("mps"),
                    "gpu_memory_utilization": (w.get("memory") or {}).get("gpu_memory_utilization"),
                }
                for w in workers
            ]
            dec = next(w for w in workers if w["role"] in ("decode", "colocated"))
            print(
                f"[{time.monotonic() - t0:6.1f}s] {name} up in {entry['startup_s']} s: {entry['workers']}", flush=True
            )
            entry["points"] = []
            for rate in args.rates:
                need = args.num_prompts / rate + 25
                if time.monotonic() - t0 + need > args.budget_s:
                    entry["points"].append({"rate": rate, "skipped": f"needs ~{need:.0f} s"})
                    continue
                s0, n0 = step_counters(dec["url"])
                spec = RunSpec(
                    url=srv.url,
                    strategy="poisson",
                    request_rate=rate,
                    num_prompts=args.num_prompts,
                    warmup=args.warmup,
                    seed=int(rate * 100),
                    timeout_s=120.0,
                )
                res = run_distbench(
                    Options(
                        spec,
                        Workload(prompt_len="128", output_len="64", seed=int(rate * 100)),
                        slo="ttft:250ms,tpot:50ms",
                        percentiles=(50.0, 90.0, 99.0),
                        progress=False,
                        token=srv.token,
                    )
                )
                s1, n1 = step_counters(dec["url"])
                point = {"rate": rate, **{k: res.get(k) for k in KEEP}}
                point["decode_step_ms"] = round((s1 - s0) / (n1 - n0) * 1000, 3) if n1 > n0 else None
                entry["points"].append(point)
                print(
                    f"[{time.monotonic() - t0:6.1f}s] {name} @ {rate:g}/s: {point['completed']} done, "
                    f"{point['failed']} failed, attainment {point['slo_attainment']}, TTFT p99 "
                    f"{point['p99_ttft_ms']}, TPOT p99 {point['p99_tpot_ms']}, decode step {point['decode_step_ms']} ms",  # noqa: E501
                    flush=True,
                )
                Path(args.out).write_text(json.dumps(doc, indent=1, default=float))
        except Exception as e:  # noqa: BLE001 - keep what was measured
            entry["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
            print(f"{name}: {entry['error']}", flush=True)
        finally:
            if srv is not None:
                srv.stop()
            logs = Path(tmp) / "logs"
            entry["log_lines"] = {
                f.stem: [ln[-300:] for ln in f.read_text(errors="replace").splitlines() if "MPS" in ln or "rror" in ln][
                    -5:
                ]
                for f in sorted(logs.glob("*.log"))
            }
            Path(args.out).write_text(json.dumps(doc, indent=1, default=float))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="preset:llama-2-7b", help="'' = the built-in tiny model")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layouts", default="colocated,1p1d,split60:60:40,split70:70:30")
    ap.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[50.0, 60.0, 75.0])
    ap.add_argument("--num-prompts", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--budget-s", type=float, default=540.0)
    ap.add_argument("--startup-timeout-s", type=float, default=240.0)
    ap.add_argument("--out", default=str(Path(os.environ.get("OUT", ".")) / "sm_split.json"))
    args = ap.parse_args()
    t0 = time.monotonic()
    doc: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args), "layouts": []}
    for name in filter(None, args.layouts.split(",")):
        one_layout(name, args, doc, t0)
    doc["elapsed_s"] = round(time.monotonic() - t0, 1)
    Path(args.out).write_text(json.dumps(doc, indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
