"""Where the NaN/Inf logits of a decode worker on an MPS SM split come from: a bisection in one device call.

Symptom (docs/performance/serving-one-gpu.md): ``distserve serve --sm-split 60:40`` (7B preset) serves an
8-request smoke, then every request of the distbench sweep fails on the decode worker with the sampler's
"the model produced NaN/Inf logits for this request"; the unpartitioned 1P1D on the same GPU serves it.

Stages, each in a child process under its own time limit (the JSON ``--out`` is rewritten after every stage,
and a child writes its partial result after every case, so a hang or a timeout keeps what was measured):

1. ``engine@40``: this script's own MPS control daemon (``server.mps.MpsDaemon``: private 0700 pipe/log
   folders, ``quit`` at the end whatever happens), one engine process at ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``
   ``--pct`` (40: the decode worker's share), the decode engine of the 7B preset (engine only, no HTTP, the
   decode worker's ``max_num_seqs`` 64 and ``max_model_len`` 4096, so the same CUDA-graph sizes and the same
   split-K plan over the graphs' static 4096-token bound). Per batch size (``--batches``): random 128-token
   prompts (ids in [0, vocab) as distbench draws them, plus one case with ids >= 3 as the smoke drew them),
   ``--tokens`` greedy tokens with the decode CUDA graphs (on the thread that captured them, then on a step
   thread of its own as ``engine_loop`` runs a worker's steps), then the same prompts eagerly in the process
   (batches 8 and 64 also before ``server.mps.probe``, which a worker runs under MPS only after its engine):
   per (batch, graphs) whether every request finished without the NaN error, the tokens' agreement with the
   eager run, the split-K plan (``plan_splits``) of that batch at this SM count. For the first failing case,
   forward hooks in eager mode name the first module whose output is not finite (its inputs' state, shapes),
   and the kernel choices (backend, layer ops, the GEMV and decode tunings' picks) are dumped. A third pass
   runs staggered arrivals (4 new prompts per step up to 64 running: prefills beside decodes, like the sweep).
2. ``engine@100``: the same with no MPS variables (control).
3. ``server`` (before stage 2 when it runs; at most 130 s): if ``--server always``, or ``auto`` (default) and
   stage 1 found nothing (or could not run), the real server with the sweep's layout (``split60:60:40+ref``)
   under bursts of concurrent requests (8, 16, 32, 64; ids >= 3, then ids from 0) and a distbench open loop
   at the sweep's first point (``--server-requests`` at 60 req/s, 128/64 greedy): the first shape that fails.

Without CUDA (CPU dry run) the MPS stage says so and is skipped; the engine stages run the tiny model eagerly
(``--device cpu``), so the bookkeeping is exercised. Device:
``bash -c 'source bench/lib/gpu_env.sh && python3 -m bench.serving.gpu_split_nan --out $OUT/split_nan.json'``
(about 4 minutes). CPU: ``python -m bench.serving.gpu_split_nan --device cpu --server never --out /tmp/split_nan.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.lib.results import write_result

REPO = Path(__file__).resolve().parents[2]
BATCHES = "1,2,4,8,12,16,24,32,48,64"
NAN = "NaN/Inf"


# --------------------------------------------------------------------------------------------- child: engine
def _engine(args, eager: bool):
    from distserve.server.engine.llm_engine import EngineConfig, LLMEngine

    cuda = args.device == "cuda"
    cfg = EngineConfig(
        model=args.model or None,
        device=args.device,
        num_blocks=args.num_blocks,
        max_num_seqs=64,
        max_model_len=4096 if cuda else 0,
        enable_prefix_caching=False,
        enforce_eager=eager,
    )
    return LLMEngine(cfg)


def _prompts(n: int, length: int, vocab: int, low: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(low, vocab) for _ in range(length)] for _ in range(n)]


def _run(engine, prompts: list[list[int]], tokens: int, stagger: int = 0) -> dict:
    """Every prompt to ``tokens`` greedy tokens; ``stagger`` > 0: that many new prompts per step."""
    from distserve.server.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    ids = [f"r{i}-{random.getrandbits(32):08x}" for i in range(len(prompts))]
    out: dict[str, list[int]] = {i: [] for i in ids}
    errors: dict[str, str] = {}
    first_bad_step = None
    queue = list(zip(ids, prompts))
    if not stagger:
        for rid, p in queue:
            engine.add_request(rid, p, params)
        queue = []
    pending = set(ids)
    steps = 0
    t0 = time.monotonic()
    while pending:
        for rid, p in queue[: stagger or len(queue)]:
            engine.add_request(rid, p, params)
        queue = queue[stagger or len(queue) :]
        running = len(engine.requests)
        for o in engine.step():
            if o.request_id not in out:
                continue
            out[o.request_id].extend(o.new_token_ids)
            if o.error:
                errors[o.request_id] = o.error
                if first_bad_step is None:
                    first_bad_step = {"step": steps, "running": running, "tokens_so_far": len(out[o.request_id])}
            if o.finished:
                pending.discard(o.request_id)
        steps += 1
        if steps > 10 * (tokens + len(prompts)) + 100:
            errors["_"] = "did not finish"
            break
    nan = sum(1 for e in errors.values() if NAN in e)
    return {
        "requests": len(prompts),
        "failed": len(errors),
        "failed_nan": nan,
        "first_error": next(iter(errors.values()), None),
        "first_bad": first_bad_step,
        "steps": steps,
        "s": round(time.monotonic() - t0, 2),
        "tokens": [out[i] for i in ids],
    }


def _pool_finite(engine) -> bool:
    import torch

    return all(bool(torch.isfinite(c).all()) for c in engine.runner.kv_caches if c.is_floating_point())


def _agree(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return round(sum(x == y for x, y in pairs) / max(1, len(pairs)), 3)


def _kernel_choices(engine) -> dict:
    import torch

    from distserve.server.engine.attention import triton_decode as td

    m = engine.model
    dev = engine.device
    out: dict = {
        "backend": getattr(m.backend, "name", None),
        "layer_ops": getattr(m.ops, "name", None),
        "decode_configs": {str(k): v for k, v in getattr(m.backend, "decode_configs", {}).items()},
        "gemv_report": getattr(engine, "gemv_report", None),
        "decode_report": getattr(engine, "decode_report", None),
        "graph_sizes": getattr(engine.runner.graph_runner, "batch_sizes", None),
        "sampler_graph_sizes": getattr(engine.sampler.graphs, "batch_sizes", None),
        "env": {k: v for k, v in os.environ.items() if k.startswith(("CUDA_MPS", "DISTSERVE"))},
    }
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        out["sm_count"] = p.multi_processor_count
        out["mem_get_info"] = list(torch.cuda.mem_get_info(dev))
    out["split_plan_graph_bound"] = {
        b: td.plan_splits(b, engine.model_config.num_key_value_heads, engine.max_model_len, dev)
        for b in (1, 2, 3, 4, 8, 16, 64)
    }
    return out


class _CheckedOps:
    """The model's op set with every op's output checked (host sync per op: eager diagnosis only)."""

    def __init__(self, ops, names: dict[int, str], found: list[dict], engine) -> None:
        self._ops, self._names, self._found, self._engine = ops, names, found, engine
        self.calls = 0

    def __getattr__(self, attr):
        val = getattr(self._ops, attr)
        if not callable(val) or attr.startswith("_"):
            return val

        def wrapped(*a, **kw):
            out = val(*a, **kw)
            self.calls += 1
            if not self._found:
                self._check(attr, a, out)
            return out

        return wrapped

    def _check(self, op: str, a, out) -> None:
        import torch

        outs = out if isinstance(out, (list, tuple)) else (out,)
        bad = [
            o
            for o in outs
            if isinstance(o, torch.Tensor) and o.is_floating_point() and not bool(torch.isfinite(o).all())
        ]
        if not bad:
            return

        def desc(x):
            if isinstance(x, torch.Tensor):
                d = {"shape": list(x.shape), "dtype": str(x.dtype), "stride": list(x.stride())}
                if x.is_floating_point():
                    d["finite"] = bool(torch.isfinite(x).all())
                return d
            if isinstance(x, torch.nn.Module):
                info = {"module": self._names.get(id(x), type(x).__name__), "class": type(x).__name__}
                info["attrs"] = {
                    k: v
                    for k, v in vars(x).items()
                    if not k.startswith("_") and k != "training" and isinstance(v, (str, int, float, bool, tuple))
                }
                w = getattr(x, "weight", None)
                if isinstance(w, torch.Tensor):
                    info["weight"] = {
                        "shape": list(w.shape),
                        "dtype": str(w.dtype),
                        "finite": bool(torch.isfinite(w).all()),
                    }
                return info
            if isinstance(x, (list, tuple)):
                return [desc(y) for y in x[:4]]
            return type(x).__name__

        o = bad[0]
        self._found.append(
            {
                "op": op,
                "call": self.calls,
                "step": self._engine.stats.num_steps,
                "args": [desc(x) for x in a[:6]],
                "output": desc(o),
                "nan": int(torch.isnan(o).sum()),
                "inf": int(torch.isinf(o).sum()),
            }
        )


def _first_nonfinite(engine, prompts: list[list[int]], tokens: int, graph_bound: bool = False) -> dict:
    """Eager re-run with every op of the model's op set checked: the first op whose output holds NaN/Inf
    (its layer, the layer's kernel-choice attributes, its inputs' shapes and finiteness). ``graph_bound``:
    decode attention planned over the graphs' static context bound (max_model_len: split-K as in a replay)
    instead of the step's longest sequence."""
    found: list[dict] = []
    backend = engine.model.backend
    if graph_bound:
        attend = backend.attend
        bound = -(-engine.max_model_len // engine.config.block_size) * engine.config.block_size

        def attend_bound(q, k, v, kv_cache, meta, scale, **kw):
            if meta.num_decodes:
                meta.decode_max_seq_len = bound
            return attend(q, k, v, kv_cache, meta, scale, **kw)

        backend.attend = attend_bound
    names = {id(m): n or "model" for n, m in engine.model.named_modules()}
    saved_ops, saved = engine.model.ops, engine.runner.graph_runner
    checked = _CheckedOps(saved_ops, names, found, engine)
    engine.model.ops = checked
    engine.runner.graph_runner = None
    try:
        res = _run(engine, prompts, tokens)
    finally:
        engine.model.ops = saved_ops
        engine.runner.graph_runner = saved
        if graph_bound:
            del backend.attend
    res.pop("tokens")
    return {"first": found[0] if found else None, "run": res, "checked_calls": checked.calls}


def child_engine(args) -> int:
    import logging

    import torch

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # the engine's kernel-choice lines

    doc: dict = {"pct": os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "100 (no MPS)"), "cases": []}
    part = Path(args.part)

    def save():
        part.write_text(json.dumps(doc))

    t0 = time.monotonic()
    eng = _engine(args, eager=args.device != "cuda")
    doc["startup_s"] = round(time.monotonic() - t0, 1)
    doc["kernels"] = _kernel_choices(eng)
    vocab = eng.model_config.vocab_size
    save()
    first_bad = None
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(1, "engine-step")  # like server/workers/engine_loop.py
    pool.submit(lambda: None).result()
    # the worker runs server.mps.probe (a bf16 GEMM rate, then empty_cache) right after building its engine,
    # under MPS only: batches 8 and 64 before it, then the probe, then every case
    doc["before_probe"] = {}
    for b in (8, 64):
        r = pool.submit(_run, eng, _prompts(b, args.prompt_len, vocab, 0, seed=99 + b), args.tokens).result()
        r.pop("tokens")
        doc["before_probe"][f"b{b}"] = r
        print(f"  before the MPS probe, b{b} (graphs, step thread): failed {r['failed']}/{b}", flush=True)
    if eng.device.type == "cuda":
        from distserve.server import mps

        doc["mps_probe"] = mps.probe(eng.device)
        print(f"  mps.probe: {doc['mps_probe']}", flush=True)
    save()
    for b in [int(x) for x in args.batches.split(",") if x]:
        if time.monotonic() - t0 > args.child_budget_s:
            doc["skipped_from_batch"] = b
            break
        for low in (0,) if b != 8 else (0, 3):
            prompts = _prompts(b, args.prompt_len, vocab, low, seed=b * 10 + low)
            case: dict = {"batch": b, "ids_from": low}
            g = _run(eng, prompts, args.tokens)
            # as a worker runs it: graphs captured on this thread, steps on a thread of their own
            t = pool.submit(_run, eng, prompts, args.tokens).result()
            saved = eng.runner.graph_runner
            replays0 = getattr(saved, "num_replays", 0)
            eng.runner.graph_runner = None
            e = _run(eng, prompts, args.tokens)
            eng.runner.graph_runner = saved
            case["graphs"] = {k: v for k, v in g.items() if k != "tokens"}
            case["graphs_step_thread"] = {k: v for k, v in t.items() if k != "tokens"}
            case["step_thread_agree"] = _agree(t["tokens"], e["tokens"])
            case["eager"] = {k: v for k, v in e.items() if k != "tokens"}
            case["graph_replays"] = replays0
            case["tokens_agree"] = _agree(g["tokens"], e["tokens"])
            case["kv_pool_finite"] = _pool_finite(eng)  # zeros at start: a NaN anywhere was written by a step
            if eng.device.type == "cuda":
                from distserve.server.engine.attention.triton_decode import plan_splits

                case["split_plan"] = plan_splits(b, eng.model_config.num_key_value_heads, eng.max_model_len, eng.device)
            doc["cases"].append(case)
            print(
                f"  b{b} ids>={low}: graphs failed {g['failed']}/{b}, on a step thread {t['failed']}/{b}, "
                f"eager {e['failed']}/{b}, "
                f"agree {case['tokens_agree']}",
                flush=True,
            )
            if first_bad is None and (g["failed"] or t["failed"] or e["failed"]):
                first_bad = (b, low, prompts)
            save()
    if time.monotonic() - t0 < args.child_budget_s:
        prompts = _prompts(64, args.prompt_len, vocab, 0, seed=4242)
        st = pool.submit(_run, eng, prompts, args.tokens, 4).result()
        st.pop("tokens")
        doc["staggered_64x4"] = st
        print(f"  staggered 64 (4 per step): failed {st['failed']}", flush=True)
        if first_bad is None and st["failed"]:
            first_bad = (64, 0, prompts)
        save()
    if first_bad is not None:
        b, low, prompts = first_bad
        doc["first_nonfinite"] = {"batch": b, "ids_from": low, **_first_nonfinite(eng, prompts, args.tokens)}
        print(f"  first non-finite (eager): {json.dumps(doc['first_nonfinite']['first'])[:600]}", flush=True)
        save()
        if hasattr(eng.model.backend, "attend"):  # eager again, attention planned as in a graph replay
            doc["first_nonfinite_graph_bound"] = _first_nonfinite(eng, prompts, args.tokens, graph_bound=True)
            fn = doc["first_nonfinite_graph_bound"]["first"]
            print(f"  first non-finite (eager, graph's split-K plan): {json.dumps(fn)[:600]}", flush=True)
    doc["elapsed_s"] = round(time.monotonic() - t0, 1)
    if eng.device.type == "cuda":
        torch.cuda.synchronize()
    save()
    return 0


# --------------------------------------------------------------------------------------------- child: server
def child_server(args) -> int:
    import asyncio

    import aiohttp

    from bench.serving.gpu_split_memory import _one, _run, log_lines, start

    def term(*_):
        raise SystemExit(124)  # the parent's time limit: the finally below stops the server

    signal.signal(signal.SIGTERM, term)
    t0 = time.monotonic()
    doc: dict = {"layout": args.layout, "bursts": []}
    part = Path(args.part)
    tmp = Path(tempfile.mkdtemp(prefix="split-nan-srv-"))
    ns = argparse.Namespace(
        model=args.model, max_seq_len=4096, ab_tree=None, device=args.device, startup_timeout_s=180.0
    )
    srv = None
    try:
        srv, entry = start(args.layout, ns, tmp)
        doc["server"] = entry
        part.write_text(json.dumps(doc))

        def burst(n: int, low: int) -> list[dict]:
            rng = random.Random(n * 10 + low)
            bodies = [
                {
                    "prompt_token_ids": [rng.randrange(low, args.server_vocab) for _ in range(128)],
                    "max_tokens": 64,
                    "ignore_eos": True,
                    "stream": True,
                    "temperature": 0.0,
                }
                for _ in range(n)
            ]

            async def main():
                headers = {"Authorization": f"Bearer {srv.token}"} if srv.token else None
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=40), headers=headers) as s:
                    return list(await asyncio.gather(*(_one(s, srv.url, b) for b in bodies)))

            return asyncio.run(main())

        for low in (3, 0):
            for n in (8, 16, 32, 64):
                if time.monotonic() - t0 > args.child_budget_s:
                    doc["skipped_from"] = {"n": n, "ids_from": low}
                    break
                recs = burst(n, low)
                bad = [r for r in recs if not r.get("ok")]
                row = {"n": n, "ids_from": low, "failed": len(bad), "first_error": bad[0].get("error") if bad else None}
                doc["bursts"].append(row)
                print(f"  burst {n} ids>={low}: failed {len(bad)}", flush=True)
                part.write_text(json.dumps(doc))
        if time.monotonic() - t0 > args.child_budget_s:
            return 0
        res = _run(srv, "128/64", args.server_requests, 60.0, "greedy", 0)
        doc["open_loop_60rps"] = {
            k: v for k, v in res.items() if not isinstance(v, (list, dict)) or len(json.dumps(v, default=str)) < 2000
        }
        print(f"  open loop: {json.dumps(doc['open_loop_60rps'])[:400]}", flush=True)
    finally:
        if srv is not None:
            doc["logs"] = log_lines(tmp, last=20)
            srv.stop()
        part.write_text(json.dumps(doc, default=str))
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


# --------------------------------------------------------------------------------------------- parent
def run_stage(name: str, argv: list[str], env: dict, limit_s: float) -> dict:
    """One child under ``limit_s``; its partial JSON whatever happens (timeout: its process group is killed)."""
    fd, part = tempfile.mkstemp(prefix="split-nan-", suffix=".json")
    os.close(fd)
    cmd = [sys.executable, "-m", "bench.serving.gpu_split_nan", *argv, "--part", part]
    t0 = time.monotonic()
    p = subprocess.Popen(
        cmd, env=env, cwd=REPO, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: list[str] = []
    rc: int | None = None
    try:
        out, _ = p.communicate(timeout=limit_s)
        lines = out.splitlines()
        rc = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGTERM)  # the child we started: it stops its server (SystemExit, finally)
        try:
            out, _ = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, _ = p.communicate()
        lines = (out or "").splitlines()
        rc = None
    try:
        res = json.loads(Path(part).read_text() or "{}")
    except (OSError, ValueError):
        res = {}
    Path(part).unlink(missing_ok=True)
    res["stage"] = name
    res["rc"] = rc
    res["timed_out"] = rc is None
    res["wall_s"] = round(time.monotonic() - t0, 1)
    keep = [ln for ln in lines if "Warning" not in ln]
    res["log_tail"] = [ln[-400:] for ln in keep[-40:]]
    keys = ("GPU engine", "tuning", "GEMV", "gemv", "captured", "MPS", "rror", "Traceback")
    res["log_kernels"] = [ln[-600:] for ln in keep if any(k in ln for k in keys)][:40]
    for ln in keep:
        if ln.startswith("  "):
            print(f"[{name}]{ln}", flush=True)
    return res


def _clean(stage: dict) -> bool:
    cases = stage.get("cases") or []
    st = stage.get("staggered_64x4") or {}
    return (
        bool(cases)
        and not any(c[m]["failed"] for c in cases for m in ("graphs", "graphs_step_thread", "eager") if m in c)
        and not st.get("failed")
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--model", default="preset:llama-2-7b", help="'' = the tiny model (CPU dry run)")
    ap.add_argument("--pct", type=int, default=40, help="the MPS stage's thread percentage (the decode share)")
    ap.add_argument("--batches", default=BATCHES)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=8, help="greedy tokens per request")
    ap.add_argument("--num-blocks", type=int, default=1200, help="KV blocks of 16 tokens")
    ap.add_argument("--server", default="auto", choices=("auto", "always", "never"))
    ap.add_argument("--layout", default="split60:60:40+ref", help="the server stage's layout (gpu_sm_split names)")
    ap.add_argument("--server-requests", type=int, default=150)
    ap.add_argument("--server-vocab", type=int, default=32000, help="burst prompt ids are drawn below this")
    ap.add_argument("--budget-s", type=float, default=240.0, help="the whole call")
    ap.add_argument("--stage-s", type=float, default=100.0, help="limit of each engine stage")
    ap.add_argument(
        "--env",
        action="append",
        default=[],
        help="NAME=VALUE for every stage's process (e.g. CUBLAS_WORKSPACE_CONFIG=:0:0, DISTSERVE_GEMV_TUNE=0)",
    )
    ap.add_argument("--out", default=str(Path(os.environ.get("OUT", ".")) / "split_nan.json"))
    ap.add_argument("--child", choices=("engine", "server"), help=argparse.SUPPRESS)
    ap.add_argument("--part", help=argparse.SUPPRESS)
    ap.add_argument("--child-budget-s", type=float, default=80.0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child == "engine":
        return child_engine(args)
    if args.child == "server":
        return child_server(args)

    t0 = time.monotonic()
    doc: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args), "stages": [], "notes": []}
    common = ["--device", args.device, "--model", args.model, "--batches", args.batches]
    common += ["--prompt-len", str(args.prompt_len), "--tokens", str(args.tokens), "--num-blocks", str(args.num_blocks)]
    base_env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    }

    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep or not name:
            ap.error(f"--env takes NAME=VALUE, got {item!r}")
        base_env[name] = value

    def left() -> float:
        return args.budget_s - (time.monotonic() - t0)

    def engine_stage(name: str, env: dict) -> dict:
        limit = min(args.stage_s, left() - 5)
        if limit < 30:
            return {"stage": name, "skipped": f"{limit:.0f} s of the budget left"}
        argv = ["--child", "engine", *common, "--child-budget-s", str(max(10.0, limit - 20))]
        return run_stage(name, argv, env, limit)

    # 1. under MPS at the decode share
    from distserve.server.mps import MpsDaemon, MpsUnavailable

    mps_stage: dict = {"stage": f"engine@{args.pct}"}
    if args.device != "cuda":
        mps_stage["skipped"] = "CPU dry run: no MPS on a CPU, the MPS stage is skipped"
        print(mps_stage["skipped"], flush=True)
    else:
        daemon = MpsDaemon()
        try:
            daemon.start()
            mps_stage = engine_stage(f"engine@{args.pct}", {**base_env, **daemon.env(args.pct)})
        except MpsUnavailable as e:
            mps_stage["skipped"] = str(e)
            print(f"MPS stage skipped: {e}", flush=True)
        finally:
            daemon.stop()
            mps_stage["mps_events"] = daemon.events
    doc["stages"].append(mps_stage)
    write_result(args.out, doc)

    def server_stage() -> None:
        limit = min(130.0, left() - 5)
        if limit < 60:
            doc["stages"].append({"stage": "server", "skipped": f"{limit:.0f} s of the budget left"})
            return
        srv_argv = ["--child", "server", "--device", args.device, "--model", args.model, "--layout", args.layout]
        srv_argv += ["--server-requests", str(args.server_requests), "--server-vocab", str(args.server_vocab)]
        srv_argv += ["--child-budget-s", str(limit - 20)]
        doc["stages"].append(run_stage("server", srv_argv, base_env, limit))
        write_result(args.out, doc)

    # 2. the MPS engine was clean (or could not run): the real server with the sweep's layout first, then the
    # control if time is left; it failed: the control (the whole GPU, no MPS) says whether MPS is needed
    want = args.server == "always" or (args.server == "auto" and (_clean(mps_stage) or "skipped" in mps_stage))
    if args.device != "cuda" and args.server == "auto":
        want = False
    if want and args.server != "always":
        server_stage()
    doc["stages"].append(engine_stage("engine@100", base_env))
    write_result(args.out, doc)
    if want and args.server == "always":
        server_stage()
    if not want:
        doc["notes"].append("server stage not run (--server, or the MPS engine stage already failed)")
    doc["verdict"] = verdict(doc)
    doc["elapsed_s"] = round(time.monotonic() - t0, 1)
    write_result(args.out, doc)
    print(json.dumps(doc["verdict"], indent=1), flush=True)
    print(f"wrote {args.out} in {doc['elapsed_s']} s", flush=True)
    return 0


def verdict(doc: dict) -> dict:
    out = {}
    for st in doc["stages"]:
        if "skipped" in st:
            out[st["stage"]] = f"skipped: {st['skipped']}"
            continue
        if st["stage"] == "server":
            bad = [b for b in st.get("bursts", []) if b["failed"]]
            ol = {k: v for k, v in (st.get("open_loop_60rps") or {}).items() if k == "completed" or "fail" in k}
            out["server"] = f"first failing burst {bad[0]}" if bad else f"bursts clean; open loop {ol or 'not run'}"
            continue
        cases = st.get("cases") or []
        bad = [f"b{c['batch']}/ids>={c['ids_from']}/{m}" for c in cases for m in ("graphs", "eager") if c[m]["failed"]]
        fn = (st.get("first_nonfinite") or {}).get("first")
        out[st["stage"]] = {
            "timed_out": st.get("timed_out"),
            "cases": len(cases),
            "failing": bad[:12],
            "staggered_failed": (st.get("staggered_64x4") or {}).get("failed"),
            "first_nonfinite_op": fn and f"{fn['op']} at step {fn['step']}: {json.dumps(fn['args'])[:300]}",
            "min_tokens_agree": min((c["tokens_agree"] for c in cases), default=None),
            "kv_pool_nonfinite_after": [f"b{c['batch']}" for c in cases if c.get("kv_pool_finite") is False][:4],
        }
    return out


if __name__ == "__main__":
    sys.exit(main())
