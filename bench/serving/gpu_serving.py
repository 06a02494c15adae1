"""Serving comparison on GPUs: colocated vs disaggregated, through the real server.

One script per device call. For each mode it starts ``distserve serve`` (the launcher: router +
worker processes) with the Llama-2-7B shape preset (random bf16 weights made on the GPU), waits
for health, and drives load with the small asyncio/aiohttp generator below over the OpenAI
streaming API (``/v1/completions``, prompt = random token ids, ``ignore_eos``,
``stream_options.include_usage``):

(a) closed loop at concurrency 100 (short workload: prompt 128, output 64), for a fixed time;
(b) open loop, Poisson arrivals, a sweep of request rates. The grid is a multiple of the first
    mode's closed-loop throughput C (0.3C .. 1.1C), the same grid for every mode of the layout,
    extended upwards while the highest rate still meets the SLO and downwards while the lowest
    does not, as long as time is left: the sweep brackets each mode's knee.

Per request: TTFT from the *scheduled* send time (open loop; coordinated omission included),
TPOT = (last token - first token) / (output tokens - 1), E2E. Per run: mean, P50, P90, P95, P99,
std of TTFT and TPOT, SLO attainment (TTFT <= 250 ms and TPOT <= 50 ms, both), and goodput:
the highest swept rate with attainment >= 90%, and the percentile forms (P90 / P99 of TTFT and
TPOT each under its bound).

Layouts:
- ``one-gpu``: colocated (1 worker) vs disaggregated (1 prefill + 1 decode process on the same GPU,
  KV through cuda_ipc);
- ``two-gpu``: disaggregated (prefill on GPU 0, decode on GPU 1, KV over cuda_ipc GPU to GPU) vs
  2 colocated replicas behind the router (data parallel); plus a long-prompt workload (prompt
  2048, output 128) with SLO TTFT <= 200 ms / TPOT <= 50 ms at P90 (and at P99). Goodput per GPU.

Everything goes to ``$OUT/gpu_serving_<layout>.json`` (rewritten after every phase, so a timeout
keeps what was measured); a short table is printed last. ``--budget-s`` bounds the whole run.

CPU dry run: ``python -m bench.serving.gpu_serving --layout one-gpu --device cpu --model preset:tiny-gpu
--budget-s 120 --concurrency 8``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path

from bench.lib.results import write_result
from bench.lib.server import ServeProcess
from distserve.distbench.loadgen import RunSpec
from distserve.distbench.metrics import attainment, percentile_with_failures
from distserve.distbench.result import records_of
from distserve.distbench.runner import Options, Workload
from distserve.distbench.runner import run as run_distbench

REPO = Path(__file__).resolve().parents[2]

SLO_SHORT = {"ttft_ms": 250.0, "tpot_ms": 50.0}
SLO_LONG = {"ttft_ms": 200.0, "tpot_ms": 50.0}
ATTAIN = 0.9
GRID = (0.3, 0.5, 0.7, 0.9, 1.1)

RESULTS: dict = {"errors": {}, "notes": []}
OUT_PATH: Path | None = None
T_START = time.monotonic()
DEADLINE = math.inf


def save() -> None:
    if OUT_PATH is not None:
        RESULTS["elapsed_s"] = round(time.monotonic() - T_START, 1)
        write_result(OUT_PATH, RESULTS)


def left() -> float:
    return DEADLINE - time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T_START:6.1f}s] {msg}", flush=True)


# ------------------------------------------------------------------ load (distbench)
def drive(
    url: str,
    token: str | None,
    prompt_len: int,
    out_len: int,
    *,
    seed: int,
    duration_s: float,
    concurrency: int | None = None,
    rate: float | None = None,
    timeout_s: float = 120.0,
    num_prompts: int = 10**9,
) -> dict:
    """One distbench run: closed loop (``concurrency``) or Poisson open loop (``rate``) for ``duration_s``."""
    spec = RunSpec(
        url=url,
        strategy="closed" if concurrency else "poisson",
        concurrency=concurrency,
        request_rate=rate,
        num_prompts=num_prompts,
        duration_s=duration_s,
        seed=seed,
        timeout_s=timeout_s,
    )
    wl = Workload(prompt_len=str(prompt_len), output_len=str(out_len), seed=seed)
    return run_distbench(Options(spec, wl, percentiles=(50.0, 90.0, 95.0, 99.0), progress=False, token=token))


def _dist(res: dict, key: str) -> dict:
    if not res["completed"]:
        return {"n": 0}
    return {
        "n": res["completed"],
        "mean": res[f"mean_{key}_ms"],
        "p50": res[f"median_{key}_ms"],
        "p90": res[f"p90_{key}_ms"],
        "p95": res[f"p95_{key}_ms"],
        "p99": res[f"p99_{key}_ms"],
        "std": res[f"std_{key}_ms"],
        "max": res[f"max_{key}_ms"],
    }


def summarize(res: dict, slo: dict, open_loop_run: bool) -> dict:
    """This script's summary of a distbench result (figures from distbench's one statistics module)."""
    recs = records_of(res)
    limits = {"ttft": slo["ttft_ms"] / 1000, "tpot": slo["tpot_ms"] / 1000}
    s = {
        "requests": res["num_prompts"],
        "completed": res["completed"],
        "failed": res["failed"],
        "wall_s": res["duration"],
        "throughput_rps": res["request_throughput"],
        "output_tok_per_s": res["output_throughput"],
        "ttft_ms": _dist(res, "ttft"),
        "tpot_ms": _dist(res, "tpot"),
        "e2e_ms": _dist(res, "e2el"),
        "slo": slo,
        "slo_attainment": attainment(recs, limits),
        "errors": res["failures"],
    }
    for m in ("ttft", "tpot"):
        for q in (90, 99):
            s[f"p{q}_{m}_all_ms"] = percentile_with_failures(recs, m, q)
    if open_loop_run:
        s["client_lag_ms"] = _dist(res, "send_lag")
        s["late_sends"] = res["late_sends"]
        s["ttft_service_ms"] = _dist(res, "ttft_service")
    s["meets"] = {
        "attainment_90": s["slo_attainment"] >= ATTAIN,
        "p90": s["p90_ttft_all_ms"] <= slo["ttft_ms"] and s["p90_tpot_all_ms"] <= slo["tpot_ms"],
        "p99": s["p99_ttft_all_ms"] <= slo["ttft_ms"] and s["p99_tpot_all_ms"] <= slo["tpot_ms"],
    }
    return s


def goodput(sweep: list[dict], gpus: int) -> dict:
    """Per SLO form: `rps` = highest swept rate that meets it; `rps_below_first_miss` = highest rate
    below the lowest rate that misses (differs from `rps` when the sweep is not monotone: noise)."""
    out = {}
    for form in ("attainment_90", "p90", "p99"):
        pts = sorted(sweep, key=lambda p: p["rate"])
        passing = [p["rate"] for p in pts if p["summary"]["meets"][form]]
        best = max(passing) if passing else 0.0
        first_miss = next((p["rate"] for p in pts if not p["summary"]["meets"][form]), math.inf)
        safe = max([r for r in passing if r < first_miss], default=0.0)
        out[form] = {
            "rps": best,
            "rps_per_gpu": best / gpus,
            "rps_below_first_miss": safe,
            "rps_below_first_miss_per_gpu": safe / gpus,
            "monotone": safe == best,
            "bracketed": bool(passing) and any(p["rate"] > best for p in sweep),
        }
    return out


# ------------------------------------------------------------------ server
class Server:
    """distbench's shared ``distserve serve`` helper plus this script's log and metric views."""

    def __init__(self, name: str, args, config: dict, serve_args: list[str], workdir: Path):
        self.name, self.args, self.config = name, args, config
        self.workdir = workdir / name
        self.log_dir = self.workdir / "logs"
        self.serve_args = serve_args
        self.srv: ServeProcess | None = None
        self.url = ""
        self.token: str | None = None

    def start(self, timeout_s: float) -> float:
        env = dict(os.environ)
        conf = env.get("PYTORCH_CUDA_ALLOC_CONF", "")
        if "expandable_segments:True" in conf:  # cuda_ipc exports plain cudaMalloc blocks only
            env.pop("PYTORCH_CUDA_ALLOC_CONF")
            RESULTS["notes"].append(f"removed PYTORCH_CUDA_ALLOC_CONF={conf} for the server")
        log(f"start {self.name}: {' '.join(self.serve_args)}")
        t0 = time.monotonic()
        try:
            self.srv = ServeProcess(
                self.workdir, config=self.config, extra_args=self.serve_args, env=env, timeout_s=timeout_s, cwd=REPO
            )
        except RuntimeError as e:
            raise RuntimeError(f"{self.name}: {str(e)[:300]}") from None
        self.url, self.token = self.srv.url, self.srv.token
        return time.monotonic() - t0

    def workers(self) -> dict:
        return {"workers": self.srv.workers()}

    def metric_lines(self, prefix: str) -> list[str]:
        import urllib.request

        try:
            with urllib.request.urlopen(f"{self.url}/metrics", timeout=5) as r:
                return [ln for ln in r.read().decode().splitlines() if ln.startswith(prefix)]
        except Exception as e:  # noqa: BLE001
            return [f"error: {e}"]

    def log_tails(self, n: int = 25) -> dict:
        tails = {}
        for p in sorted(self.log_dir.glob("*.log")) + [self.workdir / "serve.log"]:
            try:
                lines = p.read_text(errors="replace").splitlines()
            except OSError:
                continue
            interesting = [ln for ln in lines if "Error" in ln or "Traceback" in ln or "WARNING" in ln]
            tails[p.name] = {"lines": len(lines), "tail": lines[-n:], "flagged": interesting[-10:]}
        return tails

    def stop(self) -> None:
        if self.srv is not None:
            self.srv.stop()
            time.sleep(1.0)  # children watch the launcher and exit within a second


# ------------------------------------------------------------------ phases
def base_config(args, max_seq_len: int) -> dict:
    return {
        "model": args.model,
        "prefill": {"max_seq_len": max_seq_len},
        "decode": {"max_batch_size": args.max_batch, "max_concurrent_requests": args.max_batch},
        "cache": {"kv_cache_memory_mb": args.kv_cache_mb, "gpu_memory_utilization": args.gpu_memory_utilization},
        "kv_transfer": {"transport": "auto", "cuda_ipc_pool_mb": args.pool_mb},
        "router": {"request_timeout_s": 120.0},
    }


def run_mode(
    name: str,
    args,
    serve_args: list[str],
    gpus: int,
    workloads: list[dict],
    grids: dict,
    workdir: Path,
    share: float,
    vocab: int,
) -> None:
    """One server configuration: start, closed loop (first workload), sweeps, stop."""
    mode_deadline = time.monotonic() + share
    res = RESULTS["modes"].setdefault(name, {"serve_args": serve_args, "gpus": gpus})
    srv = Server(name, args, base_config(args, args.max_seq_len), serve_args, workdir)
    try:
        res["startup_s"] = srv.start(timeout_s=min(args.startup_timeout_s, max(30.0, left() - 30)))
        log(f"{name} healthy in {res['startup_s']:.1f} s")
        res["workers"] = [
            {k: w.get(k) for k in ("worker_id", "role", "kv_blocks_free")} for w in srv.workers()["workers"]
        ]
        save()
        url = srv.url
        # warm-up: a few requests of each workload (first-use kernels, allocator, connections)
        for wl in workloads:
            drive(
                url,
                srv.token,
                wl["prompt_len"],
                wl["out_len"],
                seed=1,
                duration_s=2.0,
                concurrency=min(4, args.concurrency),
            )
        for wi, wl in enumerate(workloads):
            key = wl["name"]
            # closed loop: concurrency 100 on the short workload; a shorter one on the long one
            conc = args.concurrency if wi == 0 else max(8, args.concurrency // 3)
            dur = wl["closed_s"]
            if left() < dur + 10:
                RESULTS["errors"][f"{name}/{key}/closed"] = "skipped: out of time"
                continue
            s = summarize(
                drive(url, srv.token, wl["prompt_len"], wl["out_len"], seed=2, duration_s=dur, concurrency=conc),
                wl["slo"],
                False,
            )
            s["concurrency"] = conc
            res.setdefault("closed_loop", {})[key] = s
            log(
                f"{name}/{key} closed c={conc}: {s['throughput_rps']:.1f} req/s, TTFT p50 "
                f"{s['ttft_ms'].get('p50', math.nan):.0f} ms, TPOT p50 {s['tpot_ms'].get('p50', math.nan):.1f} ms, "
                f"failed {s['failed']}"
            )
            save()
            if key not in grids:  # the first mode fixes the layout's grid for this workload
                c = max(s["throughput_rps"], 0.5)
                grids[key] = [round(g * c, 2) for g in args.grid]
                RESULTS.setdefault("grids", {})[key] = {"from_mode": name, "closed_loop_rps": c, "rates": grids[key]}
            sweep = res.setdefault("sweeps", {}).setdefault(key, [])
            wl_deadline = time.monotonic() + (mode_deadline - time.monotonic()) / (len(workloads) - wi)

            def run_rate(rate: float) -> dict | None:
                need = min(2 * wl["open_s"], max(wl["open_s"], 20.0 / rate)) + 4
                if time.monotonic() + need > min(wl_deadline, DEADLINE - 20):
                    return None
                open_s = min(2 * wl["open_s"], max(wl["open_s"], 20.0 / rate))  # >= ~20 arrivals where time allows
                res = drive(
                    url,
                    srv.token,
                    wl["prompt_len"],
                    wl["out_len"],
                    seed=int(rate * 100) + 7,
                    duration_s=open_s,
                    rate=rate,
                    timeout_s=open_s + wl["drain_s"],
                )
                s = summarize(res, wl["slo"], True)
                point = {"rate": rate, "summary": s}
                sweep.append(point)
                sweep.sort(key=lambda p: p["rate"])
                log(
                    f"{name}/{key} rate {rate:g}: attain {s['slo_attainment']:.0%}, TTFT p90 "
                    f"{s['p90_ttft_all_ms']:.0f} p99 {s['p99_ttft_all_ms']:.0f} ms, TPOT p90 "
                    f"{s['p90_tpot_all_ms']:.1f} p99 {s['p99_tpot_all_ms']:.1f} ms, {s['throughput_rps']:.1f} req/s"
                )
                save()
                return point

            for rate in grids[key]:
                if run_rate(rate) is None:
                    RESULTS["errors"][f"{name}/{key}/sweep"] = f"stopped before rate {rate}: out of time"
                    break
            # bracket the knee: extend while the top passes / the bottom fails
            for _ in range(args.max_extend):
                if not sweep:
                    break
                top, bottom = sweep[-1], sweep[0]
                if top["summary"]["meets"]["attainment_90"]:
                    nxt = round(top["rate"] * 1.4, 2)
                elif not bottom["summary"]["meets"]["attainment_90"]:
                    nxt = round(bottom["rate"] * 0.5, 2)
                else:
                    passing = [p for p in sweep if p["summary"]["meets"]["attainment_90"]]
                    failing = [p for p in sweep if p["rate"] > passing[-1]["rate"]] if passing else []
                    if not passing or not failing or failing[0]["rate"] / passing[-1]["rate"] < 1.15:
                        break
                    nxt = round((passing[-1]["rate"] + failing[0]["rate"]) / 2, 2)  # refine the knee
                if run_rate(nxt) is None:
                    break
            if sweep:
                res.setdefault("goodput", {})[key] = goodput(sweep, gpus)
            else:
                res["sweeps"].pop(key, None)
            save()
        res["kv_transfer_metrics"] = srv.metric_lines("distserve_kv_transfer")
        res["router_request_metrics"] = srv.metric_lines("distserve_requests_total")
    except Exception as e:  # noqa: BLE001 - keep going with the next mode
        RESULTS["errors"][name] = f"{type(e).__name__}: {e}"
        log(f"{name} failed: {e}")
        res["logs"] = srv.log_tails()
    finally:
        srv.stop()
        if "logs" not in res:
            tails = srv.log_tails(8)
            res["log_flags"] = {k: v["flagged"] for k, v in tails.items() if v["flagged"]}
        save()


def print_table(layout: str) -> None:
    rows = []
    for name, m in RESULTS.get("modes", {}).items():
        for key, s in m.get("closed_loop", {}).items():
            rows.append(
                f"{name:<28} {key:<6} closed c={s.get('concurrency')}: {s['throughput_rps']:7.1f} req/s  "
                f"TTFT mean/p50/p99 {s['ttft_ms'].get('mean', math.nan):6.0f}/{s['ttft_ms'].get('p50', math.nan):6.0f}/"
                f"{s['ttft_ms'].get('p99', math.nan):6.0f} ms  TPOT mean/p50/p99 "
                f"{s['tpot_ms'].get('mean', math.nan):5.1f}/{s['tpot_ms'].get('p50', math.nan):5.1f}/"
                f"{s['tpot_ms'].get('p99', math.nan):5.1f} ms"
            )
        for key, g in m.get("goodput", {}).items():

            def fmt(f):
                x = g[f]
                mark = "" if x["bracketed"] else " (top of sweep)"
                safe = "" if x["monotone"] else f" [below 1st miss {x['rps_below_first_miss']:.1f}]"
                return f"{x['rps']:.1f} ({x['rps_per_gpu']:.1f}/GPU){safe}{mark}"

            rows.append(
                f"{name:<28} {key:<6} goodput req/s: attain>=90% {fmt('attainment_90')}  "
                f"P90 {fmt('p90')}  P99 {fmt('p99')}"
            )
    print(f"\n== gpu_serving {layout} ({RESULTS.get('elapsed_s')} s; errors: {list(RESULTS['errors']) or 'none'})")
    for r in rows:
        print(r)


def main() -> int:
    global OUT_PATH, DEADLINE
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layout", choices=["one-gpu", "two-gpu"], required=True)
    ap.add_argument("--model", default="preset:llama-2-7b")
    ap.add_argument("--device", default="cuda", help="cuda (GPU runs) or cpu (dry run)")
    ap.add_argument("--budget-s", type=float, default=480.0)
    ap.add_argument("--concurrency", type=int, default=100)
    ap.add_argument("--closed-s", type=float, default=20.0)
    ap.add_argument("--open-s", type=float, default=6.0)
    ap.add_argument("--max-batch", type=int, default=128)
    ap.add_argument("--max-seq-len", type=int, default=2304)
    ap.add_argument("--kv-cache-mb", type=int, default=36_000)
    ap.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.0,
        help="cache.gpu_memory_utilization per worker; 0 = size KV from --kv-cache-mb",
    )
    ap.add_argument("--pool-mb", type=int, default=4096)
    ap.add_argument("--startup-timeout-s", type=float, default=240.0)
    ap.add_argument("--short", default="128,64", help="prompt,output tokens of the short workload")
    ap.add_argument("--long", default="2048,128", help="prompt,output tokens of the long workload (two-gpu)")
    ap.add_argument("--workloads", default=None, help="comma list: short,long (default: all of the layout)")
    ap.add_argument("--modes", default=None, help="comma list to run a subset (in this order)")
    ap.add_argument(
        "--grid",
        default=",".join(map(str, GRID)),
        help="sweep rates as multiples of the first mode's closed-loop throughput",
    )
    ap.add_argument("--rates-short", default=None, help="explicit short-workload rates (skip the grid)")
    ap.add_argument("--rates-long", default=None, help="explicit long-workload rates (skip the grid)")
    ap.add_argument("--max-extend", type=int, default=3, help="extra rates to bracket the knee")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.grid = [float(x) for x in args.grid.split(",")]
    DEADLINE = T_START + args.budget_s
    OUT_PATH = Path(args.out or Path(os.environ.get("OUT", ".")) / f"gpu_serving_{args.layout}.json")

    from distserve.server.engine.presets import preset_config

    vocab = preset_config(args.model).vocab_size
    env = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "python": sys.version.split()[0], "cpus": os.cpu_count()}
    try:
        import torch

        env["torch"] = torch.__version__
        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name(0)
            env["gpus"] = torch.cuda.device_count()
    except Exception as e:  # noqa: BLE001
        env["torch_error"] = str(e)
    sp, so = (int(x) for x in args.short.split(","))
    lp, lo = (int(x) for x in args.long.split(","))
    short = {
        "name": "short",
        "prompt_len": sp,
        "out_len": so,
        "slo": SLO_SHORT,
        "closed_s": args.closed_s,
        "open_s": args.open_s,
        "drain_s": 15.0,
    }
    long_ = {
        "name": "long",
        "prompt_len": lp,
        "out_len": lo,
        "slo": SLO_LONG,
        "closed_s": max(6.0, args.closed_s / 2),
        "open_s": args.open_s,
        "drain_s": 20.0,
    }
    dev = args.device
    if args.layout == "one-gpu":
        d0 = "cuda:0" if dev == "cuda" else dev
        modes = [
            ("colocated", ["--mode", "colocated", "--decode", "1", "--devices", d0], 1),
            ("disaggregated", ["--mode", "disaggregated", "--prefill", "1", "--decode", "1", "--devices", d0], 1),
        ]
        workloads = [short]
    else:
        d = "cuda:0,cuda:1" if dev == "cuda" else f"{dev},{dev}"
        modes = [
            ("disaggregated_1p1d", ["--mode", "disaggregated", "--prefill", "1", "--decode", "1", "--devices", d], 2),
            ("colocated_2replicas", ["--mode", "colocated", "--decode", "2", "--devices", d], 2),
        ]
        workloads = [short, long_]
    if args.workloads:
        wanted = set(args.workloads.split(","))
        workloads = [w for w in workloads if w["name"] in wanted]
    if args.modes:
        by_name = {m[0]: m for m in modes}
        modes = [by_name[n] for n in args.modes.split(",")]
    RESULTS.update(
        {
            "layout": args.layout,
            "env": env,
            "args": vars(args),
            "modes": {},
            "slo": {"short": SLO_SHORT, "long": SLO_LONG, "attainment_target": ATTAIN},
            "workloads": [{k: v for k, v in w.items() if k != "slo"} for w in workloads],
            "method": "TTFT from the scheduled send time (open loop) / from the send (closed loop); "
            "TPOT=(last-first)/(tokens-1); failed or unfinished requests count as "
            "infinitely slow in the *_all percentiles and as SLO misses; goodput = highest "
            "swept rate meeting the form",
        }
    )
    save()
    grids: dict = {}
    for key, rates in (("short", args.rates_short), ("long", args.rates_long)):
        if rates:
            grids[key] = [float(x) for x in rates.split(",")]
            RESULTS.setdefault("grids", {})[key] = {"from_mode": "command line", "rates": grids[key]}
    with tempfile.TemporaryDirectory(prefix="gpu-serving-") as tmp:
        for i, (name, serve_args, gpus) in enumerate(modes):
            share = left() / (len(modes) - i)
            run_mode(name, args, serve_args, gpus, workloads, grids, Path(tmp), share, vocab)
    save()
    print_table(args.layout)
    return 0 if not RESULTS["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
