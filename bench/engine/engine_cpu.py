"""Engine throughput on the CPU: prefill and decode tokens/s (default: the built-in tiny model).

    .venv/bin/python -m bench.engine.engine_cpu [--threads 1 2] [--repeats 7] [--out FILE]
    .venv/bin/python -m bench.engine.engine_cpu --model smollm2-135m-instruct --threads 2 --decode-batches 1 8 32

Prefill: one step over B prompts of L tokens (all new), tokens/s = B*L / step time.
Decode: B running sequences with L tokens of context, one token each per step,
tokens/s = B / step time. Each figure is the median of --repeats runs; the
spread (min..max) is printed beside it because these machines are shared.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from typing import Any

import torch

from distserve.server.engine.llm_engine import EngineConfig, LLMEngine
from distserve.server.engine.sampling_params import SamplingParams

GREEDY_1 = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def prompts(b: int, length: int, offset: int = 0) -> list[list[int]]:
    return [[1] + [(7 * i + 13 * j + offset) % 250 + 3 for j in range(length - 1)] for i in range(b)]


def time_prefill(engine: LLMEngine, b: int, length: int, repeats: int) -> list[float]:
    out: list[float] = []
    for r in range(repeats + 1):
        for i, p in enumerate(prompts(b, length, r)):
            engine.add_request(f"p{r}-{i}", p, GREEDY_1)
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        if r:  # the first run is warm-up
            out.append(b * length / (time.perf_counter() - t0))
    return out


def decode_tok_s(engine: LLMEngine, b: int, context: int, steps: int, tag: str, offset: int = 0) -> float:
    """One measurement: B sequences of ``context`` tokens prefilled, then ``steps`` decode steps timed."""
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts(b, context, offset)):
        engine.add_request(f"{tag}-{i}", p, params)
    engine.step()  # prefill all (token budget permitting), token #1
    while any(s.is_prefill for s in engine.requests.values()):
        engine.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    dt = time.perf_counter() - t0
    while engine.has_unfinished_requests():
        engine.step()
    return b * steps / dt


def time_decode(engine: LLMEngine, b: int, context: int, steps: int, repeats: int) -> list[float]:
    runs = [decode_tok_s(engine, b, context, steps, f"d{r}", offset=r) for r in range(repeats + 1)]
    return runs[1:]  # the first run is warm-up


def summarize(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--model", default=None, help="any --model distserve takes (default: the tiny model)")
    ap.add_argument("--decode-batches", type=int, nargs="+", default=[1, 8, 32, 64])
    args = ap.parse_args()
    results: dict[str, Any] = {
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "cpus": torch.get_num_threads(),
        "torch": torch.__version__,
        "model": args.model or "tiny",
        "runs": [],
    }
    for threads in args.threads:
        torch.set_num_threads(threads)
        t0 = time.perf_counter()
        engine = LLMEngine(
            EngineConfig(model=args.model, max_num_seqs=128, max_num_batched_tokens=8192, max_model_len=2048)
        )
        results.setdefault("load_s", []).append(round(time.perf_counter() - t0, 2))
        for b, length in ((1, 128), (1, 512), (8, 128)):
            r = summarize(time_prefill(engine, b, length, args.repeats))
            results["runs"].append({"phase": "prefill", "threads": threads, "batch": b, "tokens": length, **r})
        for b in args.decode_batches:
            r = summarize(time_decode(engine, b, 128, 16, args.repeats))
            results["runs"].append({"phase": "decode", "threads": threads, "batch": b, "context": 128, **r})
    print(f"model {results['model']}: engine load {results['load_s']} s")
    print(f"{'phase':<8}{'threads':>8}{'batch':>6}{'len':>6}{'tok/s median':>14}{'min..max':>20}")
    for r in results["runs"]:
        length = r.get("tokens", r.get("context"))
        print(
            f"{r['phase']:<8}{r['threads']:>8}{r['batch']:>6}{length:>6}{r['median']:>14.0f}"
            f"{r['min']:>11.0f}..{r['max']:<8.0f}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
