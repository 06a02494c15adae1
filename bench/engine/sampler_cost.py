"""What sampling costs per decode step, beside greedy: CPU (any model) or GPU (a preset, CUDA graphs).

    .venv/bin/python bench/sampler_cost.py --batches 32                                   # tiny model, CPU
    .venv/bin/python bench/sampler_cost.py --model smollm2-135m-instruct --batches 32
    python3 bench/sampler_cost.py --device cuda --model preset:llama-2-7b --batches 8 64 \\
        --context 511 --samplers old new graph --out $OUT/sampler_gpu.json                  # on the H200

For each batch size B: B sequences with ``--context`` tokens of prompt are prefilled once; then, in
rounds, each (sampler, variant) pair is set on the same sequences and ``--steps`` decode steps are timed
(the step's wall time, with a device sync on CUDA). Samplers (``--samplers``): ``old`` = the sampler of
2026-12-01 (``bench/engine/sampler_before_radix.py``: a full sort for top_p on a GPU, eager after the model's
graph), ``new`` = today's sampler run eagerly, ``graph`` = today's sampler with its CUDA graphs
(``graph_sampler.GraphSampler``; off the GPU its static-buffer function run eagerly); ``new-sort`` and
``graph-sort``: the same with top_k/top_p by one stable sort instead of the radix select. Variants: greedy;
the OpenAI default (T=1, top_p=1: what a client that sets nothing gets from OpenAI); the server default
(T=1, top_p 0.95: what distserve applies when the request sets nothing); top_k 50 at T=0.7 with presence,
frequency and repetition penalties; the server default with logprobs=5. ``share`` = (variant step -
greedy step) / greedy step, medians of the same run and the same sampler. ``sampler_ms`` times each
sampler alone on one step's shape (random logits); ``graph_equals_new`` counts, per variant, the rows
where the graph and the eager sampler drew the same token from the same logits and seeds. The JSON is
rewritten after every batch size (a run cut short keeps what it measured).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import torch

from distserve.server.engine.graph_sampler import GraphSampler
from distserve.server.engine.llm_engine import EngineConfig, LLMEngine
from distserve.server.engine.sampler import Sampler
from distserve.server.engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # imported where `--samplers old` asks for it
    from bench.engine.sampler_before_radix import Sampler as OldSampler


class BaseKw(TypedDict):
    """The ``SamplingParams`` fields every variant shares."""

    max_tokens: int
    ignore_eos: bool


class SamplingKw(TypedDict, total=False):
    """The ``SamplingParams`` fields a variant sets."""

    temperature: float
    top_p: float
    top_k: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logprobs: int


class EngineSizes(TypedDict):
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


BIG = 1 << 30
VARIANTS: dict[str, SamplingKw] = {
    "greedy": dict(temperature=0.0),
    "openai_default": dict(temperature=1.0, top_p=1.0),
    "server_default": dict(temperature=1.0, top_p=0.95),
    "topk50_penalties": dict(
        temperature=0.7, top_k=50, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1
    ),
    "logprobs5": dict(temperature=1.0, top_p=0.95, logprobs=5),
}


def make_samplers(
    names: list[str], eng: LLMEngine, batches: list[int]
) -> tuple[dict[str, OldSampler | Sampler], dict[str, int]]:
    """The samplers by name, and what each graph sampler's static buffers and graph workspace keep reserved
    (MiB)."""
    out: dict[str, OldSampler | Sampler] = {}
    reserved_mib: dict[str, int] = {}
    for name in names:
        if name == "old":
            from bench.engine.sampler_before_radix import Sampler as OldSampler

            out[name] = OldSampler()
        elif name == "new":
            out[name] = Sampler()
        elif name == "new-sort":
            out[name] = Sampler(impl="sort")
        elif name in ("graph", "graph-sort"):
            impl = "sort" if name == "graph-sort" else "radix"
            cuda = eng.device.type == "cuda"
            before = torch.cuda.memory_reserved(eng.device) if cuda else 0
            try:
                graphs = GraphSampler(eng.model_config.vocab_size, sorted(batches), eng.device, impl=impl)
            except Exception as e:  # a capture that fails costs this sampler only, not the run
                print(f"sampler {name} skipped: its CUDA graphs failed to capture: {type(e).__name__}: {e}", flush=True)
                continue
            out[name] = Sampler(graphs, impl=impl)
            # what its static buffers and graph workspace keep reserved
            reserved_mib[name] = ((torch.cuda.memory_reserved(eng.device) - before) >> 20) if cuda else 0
        else:
            raise SystemExit(f"--samplers: unknown sampler {name!r} (old, new, new-sort, graph, graph-sort)")
    return out, reserved_mib


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def build(args: argparse.Namespace) -> LLMEngine:
    cfg = EngineSizes(max_num_seqs=max(args.batches), max_num_batched_tokens=8192, max_model_len=args.context + 1024)
    if args.device == "cuda":
        eng = LLMEngine(
            EngineConfig(
                model=args.model,
                device="cuda",
                dtype="bfloat16",
                kv_cache_memory_mb=args.kv_mb,
                attention_backend="triton",
                enforce_eager=True,  # graphs captured below for the batch sizes measured only
                **cfg,
            )
        )
        from distserve.server.engine.cuda_graph_runner import CudaGraphRunner

        # ModelRunner declares graph_runner by its initial None (server/engine/model_runner.py)
        runner = CudaGraphRunner(eng.runner, eng.max_model_len, batch_sizes=sorted(args.batches))
        eng.runner.graph_runner = runner  # type: ignore[assignment]
        return eng
    return LLMEngine(EngineConfig(model=args.model, **cfg))


def measure_batch(
    eng: LLMEngine, b: int, args: argparse.Namespace, rng: random.Random, samplers: dict[str, OldSampler | Sampler]
) -> dict[str, Any]:
    dev, vocab = eng.device, eng.model_config.vocab_size
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    base = BaseKw(max_tokens=BIG, ignore_eos=True)
    for i in range(b):
        prompt = [rng.randrange(3, vocab) for _ in range(args.context)]
        eng.add_request(f"b{b}-{i}", prompt, SamplingParams(**base, seed=i))
    while any(s.num_computed_tokens < s.num_tokens - 1 or not s.output_token_ids for s in eng.requests.values()):
        eng.step()
    seqs = list(eng.requests.values())
    params = {name: SamplingParams(**base, **kw) for name, kw in VARIANTS.items()}
    pairs = [(sn, vn) for sn in samplers for vn in VARIANTS]
    times: dict[tuple[str, str], list[float]] = {pair: [] for pair in pairs}
    for rnd in range(args.rounds + 1):  # interleaved rounds; the first warms up
        for sn, vn in pairs:
            eng.sampler = samplers[sn]  # type: ignore[assignment]  # the old sampler: the same sample() signature
            for s in seqs:
                s.sampling_params = params[vn]
            for _ in range(args.steps):
                sync(dev)
                t0 = clock()
                eng.step()
                sync(dev)
                if rnd:
                    times[(sn, vn)].append((clock() - t0) * 1e3)
    # each sampler alone on one step's shape (the same rows, each variant), and graph vs new on the same logits
    logits = torch.randn(b, vocab, device=dev, dtype=torch.float32) * 3
    seeds, idx = list(range(b)), [s.num_output_tokens for s in seqs]
    alone: dict[str, dict[str, float]] = {sn: {} for sn in samplers}
    agree: dict[str, list[int]] = {}
    for vn, p in params.items():
        hist = seqs if p.has_penalties else None  # their penalty counts cached on the device, as in the engine
        for sn, smp in samplers.items():
            ts: list[float] = []
            for k in range(args.steps * 2 + 3):
                sync(dev)
                t0 = clock()
                smp.sample(logits, [p] * b, seeds, idx, hist)
                sync(dev)
                if k >= 3:
                    ts.append((clock() - t0) * 1e3)
            alone[sn][vn] = statistics.median(ts)
        if "graph" in samplers and "new" in samplers:  # the same impl (radix), graph vs eager
            a = samplers["graph"].sample(logits, [p] * b, seeds, idx, hist).tokens
            e = samplers["new"].sample(logits.clone(), [p] * b, seeds, idx, hist).tokens
            agree[vn] = [sum(x == y for x, y in zip(a, e)), b]
    for s in seqs:
        eng.abort_request(s.request_id)
    step_ms = {sn: {vn: statistics.median(times[(sn, vn)]) for vn in VARIANTS} for sn in samplers}
    return {
        "batch": b,
        "context": args.context,
        "step_ms": step_ms,
        "step_ms_min_max": {
            sn: {vn: [min(times[(sn, vn)]), max(times[(sn, vn)])] for vn in VARIANTS} for sn in samplers
        },
        "share_vs_greedy": {
            sn: {
                vn: (v - step_ms[sn]["greedy"]) / step_ms[sn]["greedy"]
                for vn, v in step_ms[sn].items()
                if vn != "greedy"
            }
            for sn in samplers
        },
        "sampler_ms": alone,
        "graph_equals_new": agree,
        "graph_replays": getattr(getattr(samplers.get("graph"), "graphs", None), "num_replays", None),
        "n_steps": args.steps * args.rounds,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--model", default=None, help="any --model distserve takes (default: the tiny model)")
    ap.add_argument("--batches", type=int, nargs="+", default=[32])
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per variant per round")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=0, help="torch threads on the CPU (0: torch's default)")
    ap.add_argument("--kv-mb", type=int, default=40000, help="CUDA: KV cache size")
    ap.add_argument("--samplers", nargs="+", default=["new"], help="old, new, new-sort, graph, graph-sort (above)")
    ap.add_argument(
        "--clock",
        default="wall",
        choices=("wall", "cpu"),
        help="cpu: this process's CPU time (a shared, overloaded CPU machine: wall time there is mostly waiting)",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    eng = build(args)
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0)
        if args.device == "cuda"
        else platform.processor() or platform.machine(),
        "model": args.model or "tiny",
        "torch_threads": torch.get_num_threads(),
        "clock": args.clock,
        "vocab": eng.model_config.vocab_size,
        "build_s": round(time.perf_counter() - t0, 1),
        "variants": VARIANTS,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "runs": [],
    }
    samplers, reserved_mib = make_samplers(args.samplers, eng, args.batches)
    res["samplers"] = list(samplers)
    res["graph_sampler_reserved_mib"] = reserved_mib
    res["setup_s"] = round(time.perf_counter() - t0, 1)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    rng = random.Random(0)
    for b in args.batches:
        r = measure_batch(eng, b, args, rng, samplers)
        res["runs"].append(r)
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1))
        print(f"batch {b}:", flush=True)
        for sn in samplers:
            cells = "  ".join(f"{n} {v:.2f}" for n, v in r["step_ms"][sn].items())
            shares = "  ".join(f"{n} {100 * v:+.1f}%" for n, v in r["share_vs_greedy"][sn].items())
            alone = "  ".join(f"{n} {v:.3f}" for n, v in r["sampler_ms"][sn].items())
            print(f"  {sn}: step ms  {cells}\n    share vs greedy  {shares}\n    sampler alone ms  {alone}", flush=True)
        if r["graph_equals_new"]:
            print(f"  graph == new (rows): {r['graph_equals_new']}", flush=True)


if __name__ == "__main__":
    main()
