"""Where the time between two prefills goes, through the real server (issue 16).

Starts ``distserve serve --mode disaggregated --prefill 1 --decode 1`` (the 7B preset, bf16), drives a
closed loop of long prompts over the OpenAI API (bench/serving/gpu_serving.py's generator), then reads the
prefill worker's own /metrics: time inside engine steps, time idle (no unfinished request), the
rest = host work on the engine's thread between steps; and the per-request phases of the prefill
handler (queued+step, take_kv, stage). The compute bound is 1 / (one prefill's step time).

Usage on the device (carry .whl): python3 -m bench.serving.gpu_prefill_profile --devices cuda:0,cuda:1 --out $OUT/p.json
CPU dry run: python -m bench.serving.gpu_prefill_profile --devices cpu,cpu --model preset:tiny-gpu --prompt 64 \\
    --extra '{"cache": {"kv_cache_memory_mb": 64}}' --out /tmp/p.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.lib.results import write_result
from bench.serving import gpu_serving as gs


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for ln in text.splitlines():
        m = re.match(r"^(distserve_(?:engine_\w+|prefill_\w+|kv_\w+|gpu_\w+)(?:\{[^}]*\})?) ([0-9.eE+-]+)$", ln)
        if m and "_bucket" not in m.group(1):
            out[m.group(1)] = float(m.group(2))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="preset:llama-2-7b")
    ap.add_argument("--devices", default="cuda:0,cuda:1", help="prefill,decode devices (default: %(default)s)")
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--output", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--duration-s", type=float, default=15.0)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--extra", default="", help="JSON merged into the config's sections, e.g. '{\"prefill\": {}}'")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    args = argparse.Namespace(
        model=a.model, max_batch=128, kv_cache_mb=36000, pool_mb=4096, gpu_memory_utilization=a.gpu_memory_utilization
    )
    cfg = gs.base_config(args, a.prompt + a.output + 256)
    for k, v in json.loads(a.extra or "{}").items():
        cfg.setdefault(k, {}).update(v)
    res: dict = {"args": vars(a), "config": cfg}
    with tempfile.TemporaryDirectory(prefix="prefill-profile-") as tmp:
        srv = gs.Server(
            "pd",
            args,
            cfg,
            ["--mode", "disaggregated", "--prefill", "1", "--decode", "1", "--devices", a.devices],
            Path(tmp),
        )
        try:
            res["startup_s"] = srv.start(timeout_s=240)
            workers = srv.workers()["workers"]
            pw = next(w for w in workers if w["role"] == "prefill")["url"]
            res["decode_kv_blocks_free"] = [w["kv_blocks_free"] for w in workers if w["role"] == "decode"]
            gs.drive(srv.url, srv.token, a.prompt, a.output, seed=1, duration_s=3.0, concurrency=4)  # warm-up
            m0, t0 = scrape(pw), time.perf_counter()
            run = gs.drive(
                srv.url, srv.token, a.prompt, a.output, seed=2, duration_s=a.duration_s, concurrency=a.concurrency
            )
            m1, wall_m = scrape(pw), time.perf_counter() - t0
            d = {k: m1[k] - m0.get(k, 0.0) for k in m1}
            s = gs.summarize(run, {"ttft_ms": 1e9, "tpot_ms": 1e9}, False)
            n = d.get("distserve_engine_steps", 0) or 1
            done = d.get('distserve_prefill_phase_seconds_count{phase="stage"}', 0) or 1
            step_s, idle_s = d.get("distserve_engine_step_seconds", 0), d.get("distserve_engine_idle_seconds", 0)
            res.update(
                {
                    "throughput_rps": s["throughput_rps"],
                    "requests": s["requests"],
                    "failed": s.get("failed"),
                    "ttft_ms": s["ttft_ms"],
                    "wall_s": wall_m,
                    "prefills": done,
                    "steps": n,
                    "per_prefill_ms": {
                        "wall": 1e3 * wall_m / done,
                        "in_step": 1e3 * step_s / done,
                        "step_cpu": 1e3 * d.get("distserve_engine_step_cpu_seconds", 0) / done,
                        "idle": 1e3 * idle_s / done,
                        "host_between_steps": 1e3 * (wall_m - step_s - idle_s) / done,
                        **{
                            f"phase_{p}_mean": 1e3
                            * d.get(f'distserve_prefill_phase_seconds_sum{{phase="{p}"}}', 0)
                            / max(1, d.get(f'distserve_prefill_phase_seconds_count{{phase="{p}"}}', 0))
                            for p in ("queued_and_step", "take_kv", "stage")
                        },
                    },
                    "kv_cache": {k: v for k, v in m1.items() if "kv_cache_bytes" in k or "gpu_memory" in k},
                    "metrics_delta": d,
                }
            )
        except Exception as e:  # noqa: BLE001 - keep what was measured, and the logs
            res["error"] = f"{type(e).__name__}: {e}"
        finally:
            res["log_tails"] = srv.log_tails(15)
            srv.stop()
    print(json.dumps({k: v for k, v in res.items() if k not in ("metrics_delta", "log_tails", "config")}, indent=1))
    write_result(a.out, res)
    return 0 if "error" not in res else 1


if __name__ == "__main__":
    sys.exit(main())
