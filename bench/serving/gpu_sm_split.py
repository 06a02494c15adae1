"""Issue 31 on one GPU: colocated vs 1P1D unpartitioned vs 1P1D on CUDA MPS SM splits (KV by copy or by reference).

Each layout is one ``distserve serve --device cuda`` with default settings but the model (memory split by role,
issue 36):

- ``colocated@N``: one colocated worker, chunked prefill with ``prefill.max_num_batched_tokens`` = N (the
  engine's token budget per step for every role; ``colocated`` alone = the default 4096);
- ``1p1d``: 1 prefill + 1 decode worker sharing the SMs freely, KV copied over ``cuda_ipc``;
- ``LABEL:P:D``: 1P1D with ``--sm-split P:D``; a ``+ref`` suffix (any layout but colocated) sets
  ``kv_transfer.by_reference: on`` (the prefill worker writes into blocks the decode worker leased to it; a
  request whose hand-off cannot go by reference fails rather than being copied silently); a ``+bN`` suffix (any
  layout) sets ``decode.max_batch_size`` = N (the decode or colocated worker's batch; default 128).

On each server, for each workload (``--workloads "NAME[@N]=r1,r2;..."``: ``128/64``-style random lengths, or
``sharegpt`` = the lengths in ``bench/data/sharegpt_lengths.jsonl``; N prompts per point, default
``--num-prompts``) and each ``--sampling``, distbench's open loop (Poisson) at each rate. Per point: completed /
failed, SLO attainment and goodput at TTFT <= 250 ms and TPOT <= 50 ms, TTFT mean / P50 / P90 / P95 / P99 /
stddev, TPOT P90 / P99, the decode worker's mean step time over the point (its ``/metrics`` deltas) and the KV
hand-off (the decode worker's ``distserve_kv_transfer_seconds`` by transport: mean per request). At the end
``summary``: per layout, workload and sampling the highest rate whose attainment is >= 90 % (the goodput in the
P90 form) and its ratio to colocated's. The JSON is rewritten after every point: a timeout keeps what was
measured; each point is skipped (with a reason) when it would not fit ``--budget-s``.

Device (one H200, carry .whl): ``bash bench/gpu_sm_split_run.sh`` (defaults: ~8.5 min).
CPU dry run (tiny model; splits need CUDA, so LABEL:P:D layouts are refused there):
``python bench/gpu_sm_split.py --device cpu --model '' --layouts colocated@256,1p1d,1p1d+ref
--workloads "32/8@12=4" --out /tmp/split.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import urllib.request
import zlib
from pathlib import Path

from distserve.distbench.loadgen import RunSpec
from distserve.distbench.promscrape import parse
from distserve.distbench.runner import Options, Workload
from distserve.distbench.runner import run as run_distbench
from distserve.distbench.target import ServeProcess

REPO = Path(__file__).resolve().parents[2]

SHAREGPT = REPO / "bench" / "data" / "sharegpt_lengths.jsonl"
SLO = "ttft:250ms,tpot:50ms"
KEEP = (
    "completed",
    "failed",
    "duration",
    "request_throughput",
    "request_goodput",
    "slo_attainment",
    "mean_ttft_ms",
    "std_ttft_ms",
    "p50_ttft_ms",
    "p90_ttft_ms",
    "p95_ttft_ms",
    "p99_ttft_ms",
    "p90_tpot_ms",
    "p99_tpot_ms",
    "late_sends",
)
DEFAULT_LAYOUTS = "colocated@512,split60:60:40+ref,split60:60:40,1p1d"
DEFAULT_WORKLOADS = "128/64=50,65,80;2048/128@120=5,8,11"


def layout_args(name: str) -> tuple[list[str], dict]:
    """(serve arguments, config overrides) of one layout name."""
    cfg: dict = {}
    name, *flags = name.split("+")
    for flag in flags:
        if flag == "ref":
            cfg["kv_transfer"] = {"by_reference": "on"}
        elif flag[:1] == "b" and flag[1:].isdigit() and int(flag[1:]) > 0:
            cfg["decode"] = {"max_batch_size": int(flag[1:])}
        else:
            raise ValueError(f"layout suffix +{flag}: use +ref or +bN (decode.max_batch_size N)")
    if name.split("@")[0] == "colocated":
        if "kv_transfer" in cfg:
            raise ValueError("colocated has no KV hand-off: no +ref")
        if "@" in name:
            cfg["prefill"] = {"max_num_batched_tokens": int(name.split("@")[1])}
        return ["--mode", "colocated", "--decode", "1"], cfg
    base = ["--mode", "disaggregated", "--prefill", "1", "--decode", "1"]
    if name == "1p1d":
        return base, cfg
    parts = name.split(":")
    if len(parts) != 3:
        raise ValueError(f"layout {name!r}: use colocated[@N], 1p1d[+ref] or LABEL:P:D[+ref]")
    return [*base, "--sm-split", f"{parts[1]}:{parts[2]}"], cfg


def parse_workloads(text: str, num_prompts: int) -> list[tuple[str, int, list[float]]]:
    out = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        head, _, rates = part.partition("=")
        name, _, n = head.partition("@")
        if name != "sharegpt" and len(name.split("/")) != 2:
            raise ValueError(f"workload {name!r}: use PROMPT/OUTPUT or sharegpt")
        out.append((name, int(n) if n else num_prompts, [float(r) for r in rates.split(",") if r]))
    return out


def point_seed(rate: float, sampling: str, prewarm: bool = False) -> int:
    """The prompts' seed of one point. It differs per rate, per sampling and for the pre-warm: the prefix cache is on
    by default, so two points sending the same prompts would measure cache hits, not prefills (the runs of
    2026-12-02 seeded by rate only, and each rate's OpenAI-default point re-sent its greedy point's prompts)."""
    return int(rate * 100) + 100_000 * (1 + zlib.crc32(sampling.encode()) % 997) + (7_777_777 if prewarm else 0)


def workload(name: str, seed: int) -> Workload:
    if name == "sharegpt":
        return Workload(dataset=f"jsonl:{SHAREGPT}", seed=seed)
    p, o = name.split("/")
    return Workload(prompt_len=p, output_len=o, seed=seed)


def scrape(url: str, token: str | None) -> dict[str, float]:
    req = urllib.request.Request(f"{url}/metrics")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=5) as r:
        return parse(r.read().decode())[0]


def handoff(before: dict, after: dict) -> dict:
    """Mean KV hand-off per request on the decode worker, by transport (ms), over one point."""
    out = {}
    for key, v in after.items():
        if key.startswith("distserve_kv_transfer_seconds_count{"):
            n = v - before.get(key, 0.0)
            if n > 0:
                s = key.replace("_count{", "_sum{")
                label = key.split('transport="')[1].split('"')[0]
                out[label] = {"requests": int(n), "mean_ms": round((after[s] - before.get(s, 0.0)) / n * 1e3, 4)}
    return out


def one_layout(name: str, args: argparse.Namespace, doc: dict, t0: float) -> None:
    serve, overrides = layout_args(name)
    entry: dict = {"layout": name, "command": f"distserve serve --device {args.device} " + " ".join(serve)}
    if overrides:
        entry["config"] = overrides
    doc["layouts"].append(entry)
    cfg = {**({"model": args.model} if args.model else {}), **overrides}
    # 2048/128 is 2176 tokens: above the default serving limit (prefill.max_seq_len 2048)
    cfg["prefill"] = {**cfg.get("prefill", {}), "max_seq_len": args.max_seq_len}
    with tempfile.TemporaryDirectory(prefix="i31-") as tmp:
        srv = None
        ts = time.monotonic()
        try:
            if time.monotonic() - t0 + args.startup_estimate_s > args.budget_s:
                entry["skipped"] = "no time left to start it"
                return
            srv = ServeProcess(
                Path(tmp),
                config=cfg,
                extra_args=["--device", args.device, *serve],
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
            for wname, n, rates in args.workloads:
                for sampling in args.sampling:
                    for rate in rates:
                        point: dict = {"workload": wname, "sampling": sampling, "rate": rate, "num_prompts": n}
                        entry["points"].append(point)
                        need = n / rate + args.drain_estimate_s
                        if time.monotonic() - t0 + need > args.budget_s:
                            point["skipped"] = f"needs ~{need:.0f} s"
                            continue
                        m0 = scrape(dec["url"], srv.token)
                        spec = RunSpec(
                            url=srv.url,
                            strategy="poisson",
                            request_rate=rate,
                            num_prompts=n,
                            warmup=args.warmup,
                            seed=point_seed(rate, sampling),
                            timeout_s=120.0,
                            sampling=sampling,
                        )
                        res = run_distbench(
                            Options(
                                spec,
                                workload(wname, point_seed(rate, sampling)),
                                slo=SLO,
                                percentiles=(50.0, 90.0, 95.0, 99.0),
                                progress=False,
                                token=srv.token,
                            )
                        )
                        m1 = scrape(dec["url"], srv.token)
                        point.update({k: res.get(k) for k in KEEP})
                        ds, dn = (
                            m1.get("distserve_engine_step_seconds", 0.0) - m0.get("distserve_engine_step_seconds", 0.0),
                            m1.get("distserve_engine_steps", 0.0) - m0.get("distserve_engine_steps", 0.0),
                        )
                        point["decode_step_ms"] = round(ds / dn * 1000, 3) if dn > 0 else None
                        point["kv_handoff"] = handoff(m0, m1)
                        print(
                            f"[{time.monotonic() - t0:6.1f}s] {name} {wname} {sampling} @ {rate:g}/s: "
                            f"{point['completed']} done, {point['failed']} failed, "
                            f"attainment {point['slo_attainment']}, "
                            f"TTFT p99 {point['p99_ttft_ms']}, TPOT p99 {point['p99_tpot_ms']}, "
                            f"step {point['decode_step_ms']} ms, hand-off {point['kv_handoff']}",
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
                f.stem: [
                    ln[-300:]
                    for ln in f.read_text(errors="replace").splitlines()
                    if "MPS" in ln or "rror" in ln or "by reference" in ln
                ][-6:]
                for f in sorted(logs.glob("*.log"))
            }
            doc["summary"] = summarize(doc)
            Path(args.out).write_text(json.dumps(doc, indent=1, default=float))


def summarize(doc: dict) -> list[dict]:
    """Per layout x workload x sampling: the highest measured rate with attainment >= 0.9 (goodput, P90 form)."""
    rows: dict[tuple, dict] = {}
    for entry in doc["layouts"]:
        for p in entry.get("points", []):
            if "completed" not in p:
                continue
            key = (entry["layout"], p["workload"], p["sampling"])
            row = rows.setdefault(
                key, {"layout": key[0], "workload": key[1], "sampling": key[2], "goodput_p90": 0.0, "rates": []}
            )
            row["rates"].append([p["rate"], p.get("slo_attainment")])
            if (p.get("slo_attainment") or 0) >= 0.9 and not p.get("failed"):
                row["goodput_p90"] = max(row["goodput_p90"], p["rate"])
    for row in rows.values():
        base = next(
            (
                r
                for (lay, w, s), r in rows.items()
                if lay.startswith("colocated") and w == row["workload"] and s == row["sampling"]
            ),
            None,
        )
        if base and base["goodput_p90"]:
            row["vs_colocated"] = round(row["goodput_p90"] / base["goodput_p90"], 3)
    return list(rows.values())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="preset:llama-2-7b", help="'' = the built-in tiny model")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layouts", default=DEFAULT_LAYOUTS)
    ap.add_argument("--workloads", default=DEFAULT_WORKLOADS, help='"NAME[@N]=r1,r2;..." (NAME: P/O or sharegpt)')
    ap.add_argument("--rates", help="one workload 128/64 at these rates (the old form); overrides --workloads")
    ap.add_argument("--sampling", type=lambda s: s.split(";"), default=["openai-default"], help="';'-separated")
    ap.add_argument("--num-prompts", type=int, default=300)
    ap.add_argument("--max-seq-len", type=int, default=4096, help="prefill.max_seq_len of every layout")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--budget-s", type=float, default=500.0)
    ap.add_argument("--startup-timeout-s", type=float, default=240.0)
    ap.add_argument("--startup-estimate-s", type=float, default=60.0, help="what a start is assumed to cost")
    ap.add_argument("--drain-estimate-s", type=float, default=12.0, help="per point on top of N / rate")
    ap.add_argument("--out", default=str(Path(os.environ.get("OUT", ".")) / "sm_split.json"))
    args = ap.parse_args()
    if args.rates:
        args.workloads = f"128/64={args.rates}"
    args.workloads = parse_workloads(args.workloads, args.num_prompts)
    for name in filter(None, args.layouts.split(",")):
        layout_args(name)  # a typo fails here, not after the first server
    t0 = time.monotonic()
    doc: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "slo": SLO, "args": vars(args), "layouts": []}
    for name in filter(None, args.layouts.split(",")):
        one_layout(name, args, doc, t0)
    doc["summary"] = summarize(doc)
    doc["elapsed_s"] = round(time.monotonic() - t0, 1)
    Path(args.out).write_text(json.dumps(doc, indent=1, default=float))
    for row in doc["summary"]:
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
