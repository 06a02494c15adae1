"""What sampling costs per decode step, beside greedy: CPU (any model) or GPU (a preset, CUDA graphs).

    .venv/bin/python bench/sampler_cost.py --batches 32                                   # tiny model, CPU
    .venv/bin/python bench/sampler_cost.py --model smollm2-135m-instruct --batches 32
    python3 bench/sampler_cost.py --device cuda --model preset:llama-2-7b --batches 1 8 64 128 \\
        --context 511 --out $OUT/sampler_gpu.json                                          # on the H200

For each batch size B: B sequences with ``--context`` tokens of prompt are prefilled once; then, in
rounds, each variant's sampling parameters are set on the same sequences and ``--steps`` decode steps
are timed (the step's wall time, with a device sync on CUDA). Variants: greedy; the OpenAI default
(T=1, top_p=1: what a client that sets nothing gets from OpenAI); the server default (T=1, top_p 0.95:
what distserve applies when the request sets nothing); top_k 50 at T=0.7 with presence, frequency and
repetition penalties; the server default with logprobs=5. ``share`` = (variant step - greedy step) /
greedy step, medians of the same run. ``sampler_ms`` times the sampler alone on one step's logits.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

import torch

from server.engine.llm_engine import EngineConfig, LLMEngine
from server.engine.sampling_params import SamplingParams

BIG = 1 << 30
VARIANTS = {
    "greedy": dict(temperature=0.0),
    "openai_default": dict(temperature=1.0, top_p=1.0),
    "server_default": dict(temperature=1.0, top_p=0.95),
    "topk50_penalties": dict(
        temperature=0.7, top_k=50, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1
    ),
    "logprobs5": dict(temperature=1.0, top_p=0.95, logprobs=5),
}


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def build(args) -> LLMEngine:
    cfg = dict(max_num_seqs=max(args.batches), max_num_batched_tokens=8192, max_model_len=args.context + 1024)
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
        from server.engine.cuda_graph_runner import CudaGraphRunner

        eng.runner.graph_runner = CudaGraphRunner(eng.runner, eng.max_model_len, batch_sizes=sorted(args.batches))
        return eng
    return LLMEngine(EngineConfig(model=args.model, **cfg))


def measure_batch(eng: LLMEngine, b: int, args, rng: random.Random) -> dict:
    dev, vocab = eng.device, eng.model_config.vocab_size
    base = dict(max_tokens=BIG, ignore_eos=True)
    for i in range(b):
        prompt = [rng.randrange(3, vocab) for _ in range(args.context)]
        eng.add_request(f"b{b}-{i}", prompt, SamplingParams(**base, seed=i))
    while any(s.num_computed_tokens < s.num_tokens - 1 or not s.output_token_ids for s in eng.requests.values()):
        eng.step()
    seqs = list(eng.requests.values())
    params = {name: SamplingParams(**base, **kw) for name, kw in VARIANTS.items()}
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for rnd in range(args.rounds + 1):  # interleaved rounds; the first warms up
        for name, p in params.items():
            for s in seqs:
                s.sampling_params = p
            for _ in range(args.steps):
                sync(dev)
                t0 = time.perf_counter()
                eng.step()
                sync(dev)
                if rnd:
                    times[name].append((time.perf_counter() - t0) * 1e3)
    # the sampler alone on one step's logits (the same rows, each variant)
    logits = torch.randn(b, vocab, device=dev, dtype=torch.float32) * 3
    seeds, idx = list(range(b)), [s.num_output_tokens for s in seqs]
    hist = seqs  # their penalty counts cached on the device, as in the engine
    alone: dict[str, float] = {}
    for name, p in params.items():
        ts = []
        for k in range(args.steps * 2 + 3):
            sync(dev)
            t0 = time.perf_counter()
            eng.sampler.sample(logits, [p] * b, seeds, idx, hist if p.has_penalties else None)
            sync(dev)
            if k >= 3:
                ts.append((time.perf_counter() - t0) * 1e3)
        alone[name] = statistics.median(ts)
    for s in seqs:
        eng.abort_request(s.request_id)
    g = statistics.median(times["greedy"])
    return {
        "batch": b,
        "context": args.context,
        "step_ms": {n: statistics.median(t) for n, t in times.items()},
        "step_ms_min_max": {n: [min(t), max(t)] for n, t in times.items()},
        "share_vs_greedy": {n: (statistics.median(t) - g) / g for n, t in times.items() if n != "greedy"},
        "sampler_ms": alone,
        "n_steps": len(times["greedy"]),
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
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    eng = build(args)
    res = {
        "device": torch.cuda.get_device_name(0)
        if args.device == "cuda"
        else platform.processor() or platform.machine(),
        "model": args.model or "tiny",
        "torch_threads": torch.get_num_threads(),
        "vocab": eng.model_config.vocab_size,
        "build_s": round(time.perf_counter() - t0, 1),
        "variants": VARIANTS,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "runs": [],
    }
    rng = random.Random(0)
    for b in args.batches:
        r = measure_batch(eng, b, args, rng)
        res["runs"].append(r)
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1))
        cells = "  ".join(f"{n} {v:.2f}" for n, v in r["step_ms"].items())
        shares = "  ".join(f"{n} {100 * v:+.1f}%" for n, v in r["share_vs_greedy"].items())
        alone = "  ".join(f"{n} {v:.3f}" for n, v in r["sampler_ms"].items())
        print(f"batch {b}: step ms  {cells}\n  share vs greedy  {shares}\n  sampler alone ms  {alone}", flush=True)


if __name__ == "__main__":
    main()
