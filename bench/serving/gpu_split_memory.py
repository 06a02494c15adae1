"""One GPU split between a prefill and a decode worker: the start-up memory of each worker, a smoke test of
each layout, then the goodput sweep — in one device call (or an A/B of the serving path against another tree).

``--variant memcheck`` (default): for each of ``--layouts`` (names as in ``gpu_sm_split``: ``colocated@N``,
``1p1d``, ``LABEL:P:D``, ``+ref`` for KV by reference) start ``distserve serve`` (7B preset), record every
worker's ``/v1/workers`` memory row and its start-up log lines (``start-up memory: ...`` — weights,
activations peak, graphs measured before the sizing and kept after start, KV pool, share, process limit, what
CUDA reports), send ``--smoke`` requests (half greedy, half OpenAI-default sampling, 128/64) and keep each
one's outcome with its error text verbatim. The first split layout whose smoke fails entirely is started once
more with the start-up tuners and sampler graphs off (``DISTSERVE_DECODE_TUNE=0 DISTSERVE_GEMV_TUNE=0
DISTSERVE_GRAPH_SAMPLER=0``) and smoked again (off with ``--no-bisect``): whether that one serves says where to
look. Then,
for the layouts in ``--sweep`` whose smoke served, distbench's open loop per workload, sampling and rate
(``--workloads``, >= 300 requests per point by default): attainment and goodput at TTFT <= 250 ms / TPOT <= 50
ms, TTFT mean / P50 / P90 / P95 / P99 / stddev, TPOT P90 / P99, failures by reason, the decode worker's mean
step and the KV hand-off. ``summary``: per layout, workload and sampling the highest rate at >= 90 %
attainment and its ratio to colocated's.

``--stop-below A`` (a knee search): rates run in ascending order, and once a point attains less than A the
higher rates of that workload and sampling are skipped ("above the knee"), so one rate list can span the
knees of every layout.

``--variant ab --ab-tree PATH``: the same sweep on fresh servers alternating this tree and the tree at PATH
(plain files of another commit, e.g. ``git archive e7864e1 | tar -x -C ab-tree``), layouts given as
``1p1d,1p1d^ab,...`` (``^ab``: served from PATH); the client is this tree's distbench either way.

The JSON (``--out``) is rewritten after every layout and point: a timeout keeps what was measured; anything
that would not fit ``--budget-s`` is skipped with the reason. Device: ``bash bench/serving/gpu_split_memory_run.sh``.
CPU dry run (tiny model, no MPS there: the splits' flags are refused, so only colocated/1p1d layouts):
``python -m bench.serving.gpu_split_memory --device cpu --model '' --layouts colocated@256,1p1d,1p1d+ref
--sweep colocated@256,1p1d --workloads "32/8@12=4" --smoke 4 --out /tmp/split_memory.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from bench.lib.results import write_result
from bench.serving.gpu_sm_split import (
    KEEP,
    SLO,
    handoff,
    layout_args,
    parse_workloads,
    point_seed,
    scrape,
    summarize,
    workload,
)
from distserve.distbench.loadgen import RunSpec
from distserve.distbench.runner import Options
from distserve.distbench.runner import run as run_distbench
from distserve.distbench.sampling import sampling_fields
from distserve.distbench.target import ServeProcess

REPO = Path(__file__).resolve().parents[2]
DEFAULT_LAYOUTS = "split60:60:40+ref,split60:60:40,split50:50:50+ref,split50:50:50,colocated@512,1p1d"
# (the 50:50 layouts are smoked only, between the 60:40 sweeps and the baselines' sweeps)
DEFAULT_SWEEP = "split60:60:40+ref,split60:60:40,colocated@512,1p1d"
DEFAULT_AB = "1p1d,1p1d^ab,1p1d!notune,1p1d,1p1d^ab,1p1d!notune"
PREWARM_ATTAINMENT = 0.9  # a pre-warm round attaining this share within the SLO ends the pre-warm
BISECT_ENV = {"DISTSERVE_DECODE_TUNE": "0", "DISTSERVE_GEMV_TUNE": "0", "DISTSERVE_GRAPH_SAMPLER": "0"}
# layout suffixes "!NAME": the server started with these variables (A/B of one start-up feature at a time)
ENV_SETS = {
    "notune": {"DISTSERVE_DECODE_TUNE": "0"},
    "nosampler": {"DISTSERVE_GRAPH_SAMPLER": "0"},
    "bare": BISECT_ENV,
}


def split_name(name: str) -> tuple[str, bool, dict]:
    """'1p1d!notune^ab' -> ('1p1d', True, {...}): the layout, served from --ab-tree?, extra environment."""
    ab = name.endswith("^ab")
    base = name[: -len("^ab")] if ab else name
    base, _, env_name = base.partition("!")
    if env_name and env_name not in ENV_SETS:
        raise ValueError(f"layout {name!r}: !{env_name} is not one of {', '.join(ENV_SETS)}")
    return base, ab, dict(ENV_SETS.get(env_name, {}))


LOG_KEYS = ("start-up memory", "KV cache", "MPS SM split", "GPU engine", "rror", "failed", "out of memory", "refus")


def log_lines(tmp: Path, keys=LOG_KEYS, last: int = 14) -> dict[str, list[str]]:
    """Per log file (router, prefill-0, decode-1, serve): its lines with any of ``keys``, the last ``last``."""
    out = {}
    files = sorted((tmp / "logs").glob("*.log")) + [tmp / "serve.log"]
    for f in files:
        if f.exists():
            lines = [ln[-600:] for ln in f.read_text(errors="replace").splitlines() if any(k in ln for k in keys)]
            out[f.stem] = lines[-last:]
    return out


async def _one(s: aiohttp.ClientSession, url: str, body: dict) -> dict:
    t0 = time.perf_counter()
    rec: dict = {"sampling": "greedy" if body.get("temperature") == 0.0 else "openai-default", "tokens": 0}
    try:
        async with s.post(f"{url}/generate", json=body) as r:
            if r.status != 200:
                rec["error"] = f"HTTP {r.status}: {(await r.text())[:400]}"
                return rec
            async for raw in r.content:
                if not raw.strip():
                    continue
                line = json.loads(raw)
                if "error" in line or line.get("finish_reason") in ("error", "abort"):
                    rec["error"] = str(line.get("error") or line)[:400]
                    return rec
                if line.get("token_ids") and "ttft_ms" not in rec:
                    rec["ttft_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
                rec["tokens"] += len(line.get("token_ids") or [])
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"[:400]
    rec["ok"] = "error" not in rec and rec["tokens"] > 0
    return rec


def smoke(srv: ServeProcess, n: int, prompt_len: int = 128, output_len: int = 64, vocab: int = 32000) -> list[dict]:
    """``n`` requests at once, half greedy, half with no temperature (the OpenAI default): each one's outcome."""
    rng = random.Random(7)
    bodies = []
    for i in range(n):
        body = {
            "prompt_token_ids": [rng.randrange(3, vocab) for _ in range(prompt_len)],
            "max_tokens": output_len,
            "ignore_eos": True,
            "stream": True,
        }
        if i % 2 == 0:
            body["temperature"] = 0.0
        bodies.append(body)

    async def main():
        headers = {"Authorization": f"Bearer {srv.token}"} if srv.token else None
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120), headers=headers) as s:
            return list(await asyncio.gather(*(_one(s, srv.url, b) for b in bodies)))

    return asyncio.run(main())


def start(name: str, args, tmp: Path, env_extra: dict | None = None) -> tuple[ServeProcess, dict]:
    base, from_ab, env_set = split_name(name)
    env_extra = {**env_set, **(env_extra or {})}
    tree = None
    if from_ab:
        if not args.ab_tree:
            raise ValueError(f"layout {name!r} needs --ab-tree")
        tree = Path(args.ab_tree).resolve()
    serve, overrides = layout_args(base)
    cfg = {**({"model": args.model} if args.model else {}), **overrides}
    cfg["prefill"] = {**cfg.get("prefill", {}), "max_seq_len": args.max_seq_len}
    env = dict(os.environ, **(env_extra or {}))
    if tree is not None:  # the other tree's server (its router and workers inherit the path)
        site = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != REPO]
        env["PYTHONPATH"] = os.pathsep.join([*site, str(tree)])
    entry: dict = {"layout": name, "command": f"distserve serve --device {args.device} " + " ".join(serve)}
    if overrides:
        entry["config"] = overrides
    if env_extra:
        entry["env"] = env_extra
    ts = time.monotonic()
    srv = ServeProcess(
        tmp,
        config=cfg,
        extra_args=["--device", args.device, *serve],
        timeout_s=args.startup_timeout_s,
        cwd=tree or REPO,
        env=env,
    )
    entry["startup_s"] = round(time.monotonic() - ts, 1)
    entry["workers"] = [{k: w.get(k) for k in ("worker_id", "role", "kv_blocks_free", "memory")} for w in srv.workers()]
    return srv, entry


def _run(srv: ServeProcess, wname: str, n: int, rate: float, sampling: str, warmup: int, prewarm: int = 0) -> dict:
    """One point (``prewarm`` 0) or pre-warm round ``prewarm`` (1, 2, ...: prompts of its own each)."""
    seed = point_seed(rate, sampling, prewarm > 0) + 31 * max(0, prewarm - 1)
    spec = RunSpec(
        url=srv.url,
        strategy="poisson",
        request_rate=rate,
        num_prompts=n,
        warmup=warmup,
        seed=seed,
        timeout_s=120.0,
        sampling=sampling,
    )
    opts = Options(
        spec,
        workload(wname, seed),
        slo=SLO,
        percentiles=(50.0, 90.0, 95.0, 99.0),
        progress=False,
        token=srv.token,
    )
    return run_distbench(opts)


def sweep(srv: ServeProcess, entry: dict, args, doc: dict, t0: float) -> None:
    dec = next(w for w in srv.workers() if w["role"] in ("decode", "colocated"))
    entry["points"] = []
    if args.prewarm and args.workloads and args.workloads[0][2]:
        wname, _, rates = args.workloads[0]
        # not a point: a warm server (prompts of their own, so no point is served from its prefix cache). A fresh
        # colocated server attained 7-23 % on its first 30 requests at 50-140 req/s on the H200 (the split 100 %), and
        # its first point after one round could still be cold: rounds are repeated until one attains
        # PREWARM_ATTAINMENT, at most --prewarm-rounds
        rounds: list = []
        for k in range(1, args.prewarm_rounds + 1):
            if time.monotonic() - t0 + args.prewarm / rates[0] + args.drain_estimate_s > args.budget_s:
                break
            res = _run(srv, wname, args.prewarm, rates[0], args.sampling[0], 0, prewarm=k)
            rounds.append(res.get("slo_attainment"))
            if (rounds[-1] or 0.0) >= PREWARM_ATTAINMENT:
                break
        if rounds:
            entry["prewarm"] = {"requests": args.prewarm, "rate": rates[0], "attainment": rounds[-1], "rounds": rounds}
    for wname, n, rates in args.workloads:
        for sampling in args.sampling:
            knee: float | None = None  # the first rate whose attainment fell below --stop-below
            for rate in sorted(rates):
                point: dict = {"workload": wname, "sampling": sampling, "rate": rate, "num_prompts": n}
                entry["points"].append(point)
                if knee is not None:
                    point["skipped"] = f"above the knee: {knee:g}/s attained < {args.stop_below:g}"
                    continue
                need = n / rate + args.drain_estimate_s
                if time.monotonic() - t0 + need > args.budget_s:
                    point["skipped"] = f"needs ~{need:.0f} s"
                    continue
                m0 = scrape(dec["url"], srv.token)
                res = _run(srv, wname, n, rate, sampling, args.warmup)
                m1 = scrape(dec["url"], srv.token)
                point.update({k: res.get(k) for k in KEEP})
                point["failures"] = dict(list((res.get("failures") or {}).items())[:5])
                ds = m1.get("distserve_engine_step_seconds", 0.0) - m0.get("distserve_engine_step_seconds", 0.0)
                dn = m1.get("distserve_engine_steps", 0.0) - m0.get("distserve_engine_steps", 0.0)
                point["decode_step_ms"] = round(ds / dn * 1000, 3) if dn > 0 else None
                point["kv_handoff"] = handoff(m0, m1)
                print(
                    f"[{time.monotonic() - t0:6.1f}s] {entry['layout']} {wname} {sampling} @ {rate:g}/s: "
                    f"{point['completed']} done, {point['failed']} failed {point['failures'] or ''}, "
                    f"attainment {point['slo_attainment']}, TTFT p99 {point['p99_ttft_ms']}, "
                    f"TPOT p99 {point['p99_tpot_ms']}, step {point['decode_step_ms']} ms",
                    flush=True,
                )
                write_result(args.out, doc)
                if (point.get("slo_attainment") or 0.0) < args.stop_below:
                    knee = rate


def print_memory(entry: dict) -> None:
    for w in entry.get("workers", []):
        mem = w.get("memory") or {}
        keys = (
            "budget_mib",
            "share_mib",
            "limit_mib",
            "weights_mib",
            "activations_mib",
            "profile_tokens",
            "startup_graphs_mib",
            "cuda_graphs_mib",
            "reserved_mib",
            "headroom_mib",
            "kv_cache_mib",
            "reported_total_mib",
            "reported_free_mib",
            "device_free_after_start_mib",
        )
        print(f"  {w['worker_id']}: " + ", ".join(f"{k}={mem.get(k)}" for k in keys if k in mem), flush=True)
    for worker, lines in entry.get("log", {}).items():
        for ln in lines:
            if "start-up memory" in ln or "MPS SM split" in ln:
                print(f"  {worker}| {ln[-400:]}", flush=True)


def one_layout(name: str, args, doc: dict, t0: float, env_extra: dict | None = None, sweep_it: bool = True) -> dict:
    entry: dict = {"layout": name}
    doc["layouts"].append(entry)
    if time.monotonic() - t0 + args.startup_estimate_s > args.budget_s:
        entry["skipped"] = "no time left to start it"
        return entry
    with tempfile.TemporaryDirectory(prefix="split-mem-") as tmp_name:
        tmp = Path(tmp_name)
        srv = None
        try:
            srv, started = start(name, args, tmp, env_extra)
            entry.update(started)
            entry["log"] = log_lines(tmp)
            print(f"[{time.monotonic() - t0:6.1f}s] {name} up in {entry['startup_s']} s", flush=True)
            print_memory(entry)
            if args.smoke:
                plen, olen = (int(x) for x in args.smoke_shape.split("/"))
                entry["smoke"] = smoke(srv, args.smoke, plen, olen, args.smoke_vocab)
                ok = sum(1 for r in entry["smoke"] if r.get("ok"))
                errors = sorted({r["error"] for r in entry["smoke"] if r.get("error")})
                entry["smoke_ok"] = ok
                print(f"  smoke: {ok}/{args.smoke} served; errors: {errors[:3]}", flush=True)
                write_result(args.out, doc)
                if not ok:
                    entry["sweep_skipped"] = "no smoke request was served"
                    return entry
            if sweep_it:
                sweep(srv, entry, args, doc, t0)
        except Exception as e:  # noqa: BLE001 - keep what was measured (a refusal's sentence is in serve.log)
            entry["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
            print(f"{name}: {entry['error']}", flush=True)
        finally:
            if srv is not None:
                srv.stop()
            entry["log"] = log_lines(tmp)
            doc["summary"] = summarize(doc)
            write_result(args.out, doc)
    return entry


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", choices=("memcheck", "ab"), default="memcheck")
    ap.add_argument("--model", default="preset:llama-2-7b", help="'' = the built-in tiny model")
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--layouts",
        default=None,
        help=f"default memcheck: {DEFAULT_LAYOUTS}; ab: {DEFAULT_AB}; suffixes ^ab (from --ab-tree), "
        f"!{'/!'.join(ENV_SETS)} (start-up features off)",
    )
    ap.add_argument(
        "--sweep", default=None, help=f"layouts that get the sweep (default memcheck: {DEFAULT_SWEEP}; ab: all)"
    )
    ap.add_argument("--workloads", default="128/64=60,80,100", help='"NAME[@N]=r1,r2;..." (NAME: P/O or sharegpt)')
    ap.add_argument(
        "--sampling",
        type=lambda s: s.split(";"),
        default=None,
        help="';'-separated (default greedy;openai-default, ab: greedy)",
    )
    ap.add_argument("--num-prompts", type=int, default=300)
    ap.add_argument("--max-seq-len", type=int, default=4096)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--smoke", type=int, default=8, help="smoke requests per layout (0: none)")
    ap.add_argument("--prewarm", type=int, default=None, help="requests before the points (default 0; ab: 150)")
    ap.add_argument(
        "--prewarm-rounds",
        type=int,
        default=3,
        help=f"pre-warm rounds at most, until one attains {PREWARM_ATTAINMENT * 100:.0f} %% within the SLO (default 3)",
    )
    ap.add_argument("--smoke-shape", default="128/64", help="PROMPT/OUTPUT tokens of a smoke request")
    ap.add_argument("--smoke-vocab", type=int, default=32000, help="prompt ids are drawn below this")
    ap.add_argument("--no-bisect", dest="bisect", action="store_false", help="no tuners-off retry of a failed split")
    ap.add_argument("--ab-tree", help="plain files of the other commit (layouts ending ^ab run from there)")
    ap.add_argument("--budget-s", type=float, default=470.0)
    ap.add_argument(
        "--stop-below",
        type=float,
        default=0.0,
        help="after a point below this attainment, skip the higher rates of that workload and sampling (0: off)",
    )
    ap.add_argument("--startup-timeout-s", type=float, default=240.0)
    ap.add_argument("--startup-estimate-s", type=float, default=45.0)
    ap.add_argument("--drain-estimate-s", type=float, default=4.0)
    ap.add_argument("--out", default=str(Path(os.environ.get("OUT", ".")) / "split_memory.json"))
    args = ap.parse_args()
    ab = args.variant == "ab"
    if ab and not args.ab_tree:
        print("gpu_split_memory: error: --variant ab needs --ab-tree PATH (plain files of the other commit)")
        return 2
    if args.ab_tree and not (Path(args.ab_tree) / "server" / "cli.py").exists():
        print(f"gpu_split_memory: error: --ab-tree {args.ab_tree} has no server/cli.py")
        return 2
    layouts = [x for x in (args.layouts or (DEFAULT_AB if ab else DEFAULT_LAYOUTS)).split(",") if x]
    swept = set(layouts if (ab and args.sweep is None) else (args.sweep or DEFAULT_SWEEP).split(","))
    args.sampling = args.sampling or (["greedy"] if ab else ["greedy", "openai-default"])
    args.prewarm = (150 if ab else 0) if args.prewarm is None else args.prewarm
    if args.prewarm_rounds < 1:
        print(f"gpu_split_memory: error: --prewarm-rounds must be at least 1, got {args.prewarm_rounds}")
        return 2
    args.workloads = parse_workloads(args.workloads, args.num_prompts)
    for name in layouts:
        layout_args(split_name(name)[0])  # a typo fails here, not after the first server
    unknown = sorted(swept - set(layouts))
    if unknown:  # a sweep over nothing would cost a device call and measure no point
        print(f"gpu_split_memory: error: --sweep names {', '.join(unknown)}, not in --layouts {','.join(layouts)}")
        return 2
    for spec in args.sampling:
        try:
            sampling_fields(spec)
        except ValueError as e:  # before any server starts
            print(f"gpu_split_memory: error: {e} (several: ';'-separated)")
            return 2
    t0 = time.monotonic()
    doc: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "slo": SLO, "args": vars(args), "layouts": []}
    bisected = False
    for name in layouts:
        entry = one_layout(name, args, doc, t0, sweep_it=name in swept)
        split = ":" in split_name(name)[0]
        if args.bisect and not bisected and split and args.smoke and entry.get("smoke_ok") == 0:
            bisected = True  # once per call: it says whether the start-up features are the cause
            print(f"  {name}: every smoke request failed; again with {BISECT_ENV}", flush=True)
            one_layout(name, args, doc, t0, env_extra=BISECT_ENV, sweep_it=False)
    doc["summary"] = summarize(doc)
    doc["elapsed_s"] = round(time.monotonic() - t0, 1)
    write_result(args.out, doc)
    for row in doc["summary"]:
        print(json.dumps(row), flush=True)
    print(f"wrote {args.out} in {doc['elapsed_s']} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
