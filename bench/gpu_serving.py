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

CPU dry run: ``python bench/gpu_serving.py --layout one-gpu --device cpu --model preset:tiny-gpu
--budget-s 120 --concurrency 8``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from distbench.metrics import percentile  # noqa: E402

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
        OUT_PATH.write_text(json.dumps(RESULTS, indent=2, default=float))


def left() -> float:
    return DEADLINE - time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T_START:6.1f}s] {msg}", flush=True)


# ------------------------------------------------------------------ load generator
class Rec:
    __slots__ = ("sched", "sent", "first", "last", "tokens", "ok", "error")

    def __init__(self, sched: float):
        self.sched, self.sent, self.first, self.last = sched, None, None, None
        self.tokens, self.ok, self.error = 0, False, None


async def one_request(session, url: str, model: str, prompt: list[int], max_tokens: int, rec: Rec) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0.0, "stream_options": {"include_usage": True}}
    rec.sent = time.perf_counter()
    try:
        async with session.post(url, json=body) as r:
            if r.status != 200:
                rec.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                return
            async for raw in r.content:
                if not raw.startswith(b"data: "):
                    continue
                now = time.perf_counter()
                if b'"choices":[{' in raw:
                    if rec.first is None:
                        rec.first = now
                    rec.last = now
                elif b'"usage"' in raw:
                    rec.tokens = json.loads(raw[6:])["usage"]["completion_tokens"]
                elif raw.startswith(b"data: [DONE]"):
                    break
            rec.ok = rec.first is not None and rec.tokens > 0
            if not rec.ok and rec.error is None:
                rec.error = "stream ended without tokens/usage"
    except asyncio.CancelledError:
        rec.error = "cancelled (drain timeout)"
        raise
    except Exception as e:  # noqa: BLE001 - a failed request is data
        rec.error = f"{type(e).__name__}: {e}"[:200]


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab - 1) for _ in range(n)]


async def closed_loop(url: str, model: str, vocab: int, concurrency: int, duration_s: float,
                      prompt_len: int, out_len: int, seed: int) -> tuple[list[Rec], float]:
    import aiohttp

    rng = random.Random(seed)
    recs: list[Rec] = []
    stop_at = time.perf_counter() + duration_s
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as s:
        async def user():
            while time.perf_counter() < stop_at:
                rec = Rec(time.perf_counter())
                recs.append(rec)
                await one_request(s, url, model, _prompt(rng, prompt_len, vocab), out_len, rec)
        t0 = time.perf_counter()
        await asyncio.gather(*(user() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return recs, wall


async def open_loop(url: str, model: str, vocab: int, rate: float, duration_s: float, prompt_len: int,
                    out_len: int, seed: int, drain_s: float) -> tuple[list[Rec], float]:
    """Poisson arrivals at `rate` for `duration_s`; send times fixed in advance."""
    import aiohttp

    rng = random.Random(seed)
    duration_s = min(2 * duration_s, max(duration_s, 20.0 / rate))  # >= ~20 arrivals where time allows
    offsets, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t > duration_s:
            break
        offsets.append(t)
    if not offsets:
        return [], 0.0
    prompts = [_prompt(rng, prompt_len, vocab) for _ in offsets]
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as s:
        t0 = time.perf_counter() + 0.05
        recs = [Rec(t0 + o) for o in offsets]

        async def fire(rec: Rec, prompt):
            delay = rec.sched - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            await one_request(s, url, model, prompt, out_len, rec)
        tasks = [asyncio.ensure_future(fire(r, p)) for r, p in zip(recs, prompts)]
        done, pending = await asyncio.wait(tasks, timeout=duration_s + drain_s)
        for p in pending:
            p.cancel()
        if pending:
            await asyncio.wait(pending, timeout=5)
        wall = time.perf_counter() - t0
    return recs, wall


# ------------------------------------------------------------------ statistics
_pct = percentile  # distbench's: linear interpolation between closest ranks


def _dist(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "mean": statistics.fmean(xs), "p50": _pct(xs, 50), "p90": _pct(xs, 90),
            "p95": _pct(xs, 95), "p99": _pct(xs, 99), "std": statistics.pstdev(xs), "max": max(xs)}


def summarize(recs: list[Rec], wall: float, slo: dict, open_loop_run: bool) -> dict:
    if not recs:
        return {"requests": 0, "slo_attainment": 0.0, "throughput_rps": 0.0, "ttft_ms": {}, "tpot_ms": {},
                "p90_ttft_all_ms": math.nan, "p99_ttft_all_ms": math.nan, "p90_tpot_all_ms": math.nan,
                "p99_tpot_all_ms": math.nan, "failed": 0,
                "meets": {"attainment_90": False, "p90": False, "p99": False}}
    inf = math.inf
    ttft, tpot, e2e, lag = [], [], [], []
    met, ok = 0, 0
    # failed / unfinished requests count as infinitely slow: they pull percentiles up, never down
    ttft_all, tpot_all = [], []
    for r in recs:
        if r.sent is not None:
            lag.append((r.sent - r.sched) * 1e3)
        if not r.ok:
            ttft_all.append(inf)
            tpot_all.append(inf)
            continue
        ok += 1
        a = (r.first - r.sched) * 1e3
        b = (r.last - r.first) * 1e3 / (r.tokens - 1) if r.tokens > 1 else 0.0
        ttft.append(a)
        tpot.append(b)
        ttft_all.append(a)
        tpot_all.append(b)
        e2e.append((r.last - r.sched) * 1e3)
        met += a <= slo["ttft_ms"] and b <= slo["tpot_ms"]
    n = len(recs)
    out_tokens = sum(r.tokens for r in recs if r.ok)
    errors: dict[str, int] = {}
    for r in recs:
        if not r.ok:
            key = (r.error or "?")[:80]
            errors[key] = errors.get(key, 0) + 1
    s = {"requests": n, "completed": ok, "failed": n - ok, "wall_s": wall,
         "throughput_rps": ok / wall if wall > 0 else 0.0, "output_tok_per_s": out_tokens / wall if wall else 0,
         "ttft_ms": _dist(ttft), "tpot_ms": _dist(tpot), "e2e_ms": _dist(e2e),
         "slo": slo, "slo_attainment": met / n if n else 0.0,
         "p90_ttft_all_ms": _pct(ttft_all, 90), "p99_ttft_all_ms": _pct(ttft_all, 99),
         "p90_tpot_all_ms": _pct(tpot_all, 90), "p99_tpot_all_ms": _pct(tpot_all, 99),
         "errors": errors}
    if open_loop_run:
        s["client_lag_ms"] = _dist(lag)
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
        out[form] = {"rps": best, "rps_per_gpu": best / gpus, "rps_below_first_miss": safe,
                     "rps_below_first_miss_per_gpu": safe / gpus, "monotone": safe == best,
                     "bracketed": bool(passing) and any(p["rate"] > best for p in sweep)}
    return out


# ------------------------------------------------------------------ server
class Server:
    def __init__(self, name: str, args, config: dict, serve_args: list[str], workdir: Path):
        self.name, self.args, self.workdir = name, args, workdir
        self.cfg_path = workdir / f"{name}.yaml"
        self.cfg_path.write_text(yaml.safe_dump(config))
        self.ready = workdir / f"{name}.ready.json"
        self.log_dir = workdir / f"logs-{name}"
        self.serve_args = serve_args
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self, timeout_s: float) -> float:
        env = dict(os.environ)
        conf = env.get("PYTORCH_CUDA_ALLOC_CONF", "")
        if "expandable_segments:True" in conf:  # cuda_ipc exports plain cudaMalloc blocks only
            env.pop("PYTORCH_CUDA_ALLOC_CONF")
            RESULTS["notes"].append(f"removed PYTORCH_CUDA_ALLOC_CONF={conf} for the server")
        cmd = [sys.executable, "-m", "server.cli", "serve", "--config", str(self.cfg_path), "--port", "0",
               "--ready-file", str(self.ready), "--log-dir", str(self.log_dir), *self.serve_args]
        log(f"start {self.name}: {' '.join(cmd[3:])}")
        t0 = time.monotonic()
        out = open(self.workdir / f"{self.name}.launcher.log", "wb")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        out.close()
        while not self.ready.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name}: launcher exited with {self.proc.returncode}")
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"{self.name}: not healthy after {timeout_s:.0f} s")
            time.sleep(0.25)
        self.url = json.loads(self.ready.read_text())["url"]
        return time.monotonic() - t0

    def workers(self) -> dict:
        import urllib.request
        token = json.loads(self.ready.read_text())["token"]
        req = urllib.request.Request(f"{self.url}/v1/workers", headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.loads(r.read())

    def metric_lines(self, prefix: str) -> list[str]:
        import urllib.request
        try:
            with urllib.request.urlopen(f"{self.url}/metrics", timeout=5) as r:
                return [ln for ln in r.read().decode().splitlines() if ln.startswith(prefix)]
        except Exception as e:  # noqa: BLE001
            return [f"error: {e}"]

    def log_tails(self, n: int = 25) -> dict:
        tails = {}
        for p in sorted(self.log_dir.glob("*.log")) + [self.workdir / f"{self.name}.launcher.log"]:
            try:
                lines = p.read_text(errors="replace").splitlines()
            except OSError:
                continue
            interesting = [ln for ln in lines if "Error" in ln or "Traceback" in ln or "WARNING" in ln]
            tails[p.name] = {"lines": len(lines), "tail": lines[-n:], "flagged": interesting[-10:]}
        return tails

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
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


def run_mode(name: str, args, serve_args: list[str], gpus: int, workloads: list[dict], grids: dict,
             workdir: Path, share: float, vocab: int) -> None:
    """One server configuration: start, closed loop (first workload), sweeps, stop."""
    mode_deadline = time.monotonic() + share
    res = RESULTS["modes"].setdefault(name, {"serve_args": serve_args, "gpus": gpus})
    srv = Server(name, args, base_config(args, args.max_seq_len), serve_args, workdir)
    try:
        res["startup_s"] = srv.start(timeout_s=min(args.startup_timeout_s, max(30.0, left() - 30)))
        log(f"{name} healthy in {res['startup_s']:.1f} s")
        res["workers"] = [{k: w.get(k) for k in ("worker_id", "role", "kv_blocks_free")}
                          for w in srv.workers()["workers"]]
        save()
        url = f"{srv.url}/v1/completions"
        # warm-up: a few requests of each workload (first-use kernels, allocator, connections)
        for wl in workloads:
            asyncio.run(closed_loop(url, args.model, vocab, min(4, args.concurrency), 2.0,
                                    wl["prompt_len"], wl["out_len"], seed=1))
        for wi, wl in enumerate(workloads):
            key = wl["name"]
            # closed loop: concurrency 100 on the short workload; a shorter one on the long one
            conc = args.concurrency if wi == 0 else max(8, args.concurrency // 3)
            dur = wl["closed_s"]
            if left() < dur + 10:
                RESULTS["errors"][f"{name}/{key}/closed"] = "skipped: out of time"
                continue
            recs, wall = asyncio.run(closed_loop(url, args.model, vocab, conc, dur, wl["prompt_len"],
                                                 wl["out_len"], seed=2))
            s = summarize(recs, wall, wl["slo"], False)
            s["concurrency"] = conc
            res.setdefault("closed_loop", {})[key] = s
            log(f"{name}/{key} closed c={conc}: {s['throughput_rps']:.1f} req/s, TTFT p50 "
                f"{s['ttft_ms'].get('p50', math.nan):.0f} ms, TPOT p50 {s['tpot_ms'].get('p50', math.nan):.1f} ms, "
                f"failed {s['failed']}")
            save()
            if key not in grids:  # the first mode fixes the layout's grid for this workload
                c = max(s["throughput_rps"], 0.5)
                grids[key] = [round(g * c, 2) for g in args.grid]
                RESULTS.setdefault("grids", {})[key] = {"from_mode": name, "closed_loop_rps": c,
                                                        "rates": grids[key]}
            sweep = res.setdefault("sweeps", {}).setdefault(key, [])
            wl_deadline = time.monotonic() + (mode_deadline - time.monotonic()) / (len(workloads) - wi)

            def run_rate(rate: float) -> dict | None:
                need = min(2 * wl["open_s"], max(wl["open_s"], 20.0 / rate)) + 4
                if time.monotonic() + need > min(wl_deadline, DEADLINE - 20):
                    return None
                recs, wall = asyncio.run(open_loop(url, args.model, vocab, rate, wl["open_s"], wl["prompt_len"],
                                                   wl["out_len"], seed=int(rate * 100) + 7, drain_s=wl["drain_s"]))
                s = summarize(recs, wall, wl["slo"], True)
                point = {"rate": rate, "summary": s}
                sweep.append(point)
                sweep.sort(key=lambda p: p["rate"])
                log(f"{name}/{key} rate {rate:g}: attain {s['slo_attainment']:.0%}, TTFT p90 "
                    f"{s['p90_ttft_all_ms']:.0f} p99 {s['p99_ttft_all_ms']:.0f} ms, TPOT p90 "
                    f"{s['p90_tpot_all_ms']:.1f} p99 {s['p99_tpot_all_ms']:.1f} ms, {s['throughput_rps']:.1f} req/s")
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
            rows.append(f"{name:<28} {key:<6} closed c={s.get('concurrency')}: {s['throughput_rps']:7.1f} req/s  "
                        f"TTFT mean/p50/p99 {s['ttft_ms'].get('mean', math.nan):6.0f}/{s['ttft_ms'].get('p50', math.nan):6.0f}/"
                        f"{s['ttft_ms'].get('p99', math.nan):6.0f} ms  TPOT mean/p50/p99 "
                        f"{s['tpot_ms'].get('mean', math.nan):5.1f}/{s['tpot_ms'].get('p50', math.nan):5.1f}/"
                        f"{s['tpot_ms'].get('p99', math.nan):5.1f} ms")
        for key, g in m.get("goodput", {}).items():
            def fmt(f):
                x = g[f]
                mark = "" if x["bracketed"] else " (top of sweep)"
                safe = "" if x["monotone"] else f" [below 1st miss {x['rps_below_first_miss']:.1f}]"
                return f"{x['rps']:.1f} ({x['rps_per_gpu']:.1f}/GPU){safe}{mark}"
            rows.append(f"{name:<28} {key:<6} goodput req/s: attain>=90% {fmt('attainment_90')}  "
                        f"P90 {fmt('p90')}  P99 {fmt('p99')}")
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
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.0,
                    help="cache.gpu_memory_utilization per worker; 0 = size KV from --kv-cache-mb")
    ap.add_argument("--pool-mb", type=int, default=4096)
    ap.add_argument("--startup-timeout-s", type=float, default=240.0)
    ap.add_argument("--short", default="128,64", help="prompt,output tokens of the short workload")
    ap.add_argument("--long", default="2048,128", help="prompt,output tokens of the long workload (two-gpu)")
    ap.add_argument("--workloads", default=None, help="comma list: short,long (default: all of the layout)")
    ap.add_argument("--modes", default=None, help="comma list to run a subset (in this order)")
    ap.add_argument("--grid", default=",".join(map(str, GRID)),
                    help="sweep rates as multiples of the first mode's closed-loop throughput")
    ap.add_argument("--rates-short", default=None, help="explicit short-workload rates (skip the grid)")
    ap.add_argument("--rates-long", default=None, help="explicit long-workload rates (skip the grid)")
    ap.add_argument("--max-extend", type=int, default=3, help="extra rates to bracket the knee")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.grid = [float(x) for x in args.grid.split(",")]
    DEADLINE = T_START + args.budget_s
    OUT_PATH = Path(args.out or Path(os.environ.get("OUT", ".")) / f"gpu_serving_{args.layout}.json")

    from server.engine.presets import preset_config

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
    short = {"name": "short", "prompt_len": sp, "out_len": so, "slo": SLO_SHORT, "closed_s": args.closed_s,
             "open_s": args.open_s, "drain_s": 15.0}
    long_ = {"name": "long", "prompt_len": lp, "out_len": lo, "slo": SLO_LONG, "closed_s": max(6.0, args.closed_s / 2),
             "open_s": args.open_s, "drain_s": 20.0}
    dev = args.device
    if args.layout == "one-gpu":
        d0 = "cuda:0" if dev == "cuda" else dev
        modes = [("colocated", ["--mode", "colocated", "--decode", "1", "--devices", d0], 1),
                 ("disaggregated", ["--mode", "disaggregated", "--prefill", "1", "--decode", "1", "--devices", d0], 1)]
        workloads = [short]
    else:
        d = "cuda:0,cuda:1" if dev == "cuda" else f"{dev},{dev}"
        modes = [("disaggregated_1p1d", ["--mode", "disaggregated", "--prefill", "1", "--decode", "1", "--devices", d], 2),
                 ("colocated_2replicas", ["--mode", "colocated", "--decode", "2", "--devices", d], 2)]
        workloads = [short, long_]
    if args.workloads:
        wanted = set(args.workloads.split(","))
        workloads = [w for w in workloads if w["name"] in wanted]
    if args.modes:
        by_name = {m[0]: m for m in modes}
        modes = [by_name[n] for n in args.modes.split(",")]
    RESULTS.update({"layout": args.layout, "env": env, "args": vars(args), "modes": {},
                    "slo": {"short": SLO_SHORT, "long": SLO_LONG, "attainment_target": ATTAIN},
                    "workloads": [{k: v for k, v in w.items() if k != "slo"} for w in workloads],
                    "method": "TTFT from the scheduled send time (open loop) / from the send (closed loop); "
                              "TPOT=(last-first)/(tokens-1); failed or unfinished requests count as "
                              "infinitely slow in the *_all percentiles and as SLO misses; goodput = highest "
                              "swept rate meeting the form"})
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
