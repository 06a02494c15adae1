"""Prefill step time on varied prompt lengths, engine only (issue 16's ShareGPT finding).

In the two-GPU study the 1P1D prefill worker, fed ShareGPT lengths (mean 278 tokens), took 18.5 / 55 /
80 ms per step at 12 / 24 / 36 req/s (1.0 / 1.8 / 3.4 prompts per step), while one 2 048-token prompt
takes about 48 ms. This script separates the candidates without HTTP: one 7B-preset engine on one GPU,
prefill-only requests with ShareGPT lengths added ``k`` at a time and stepped to completion, two passes
over the same lengths (token ids differ, so no prefix hits): pass 1 sees each length for the first time,
pass 2 again. Per step: wall ms (synchronized), sequences, tokens, new lengths. Then a torch.profiler
table of 6 steps of 4 never-seen lengths.

Usage on the device: python3 -m bench.engine.gpu_prefill_lengths --out $OUT/prefill_lengths.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.lib.results import write_result
from distserve.server.engine.llm_engine import EngineConfig, LLMEngine
from distserve.server.engine.sampling_params import SamplingParams

DATA = Path(__file__).resolve().parents[1] / "data" / "sharegpt_lengths.jsonl"


def run_pass(eng: LLMEngine, lengths: list[int], k: int, tag: str, seen: set[int]) -> list[dict]:
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    steps = []
    for g in range(0, len(lengths), k):
        group = lengths[g : g + k]
        new = sum(1 for n in group if n not in seen)
        seen.update(group)
        for i, n in enumerate(group):
            base = hash((tag, g, i)) % 20000
            eng.add_request(f"{tag}-{g}-{i}", [(base + j * 7) % 30000 + 1 for j in range(n)], params)
        while eng.has_unfinished_requests():
            torch.cuda.synchronize()
            t = time.perf_counter()
            eng.step()
            torch.cuda.synchronize()
            steps.append({"ms": 1e3 * (time.perf_counter() - t), "seqs": len(group), "tokens": sum(group), "new": new})
    return steps


def summary(steps: list[dict]) -> dict:
    ms = sorted(s["ms"] for s in steps)
    return {
        "steps": len(ms),
        "median_ms": statistics.median(ms),
        "p90_ms": ms[int(0.9 * len(ms))],
        "max_ms": ms[-1],
        "sum_ms": sum(ms),
        "ms_per_1k_tokens": 1e3 * sum(ms) / max(1, sum(s["tokens"] for s in steps)),
        "slowest": sorted(steps, key=lambda s: -s["ms"])[:8],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="preset:llama-2-7b")
    ap.add_argument("--n", type=int, default=96, help="prompts per pass")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    lengths = [json.loads(ln)["prompt_len"] for ln in DATA.read_text().splitlines()[: a.n]]
    eng = LLMEngine(
        EngineConfig(
            model=a.model,
            device="cuda:0",
            max_model_len=2304,
            max_num_batched_tokens=4096,
            max_num_seqs=128,
            gpu_memory_utilization=0.9,
        )
    )
    res: dict = {"lengths_mean": statistics.mean(lengths), "n": len(lengths)}
    seen: set[int] = set()
    for i in range(3):  # warm-up on one fixed length
        run_pass(eng, [512], 1, f"w{i}", seen)
    for k in (1, 4):
        seen_k = set(seen)
        res[f"k{k}_pass1"] = summary(run_pass(eng, lengths, k, f"a{k}", seen_k))
        res[f"k{k}_pass2"] = summary(run_pass(eng, lengths, k, f"b{k}", seen_k))
        print(
            k,
            {
                p: {x: res[f"k{k}_{p}"][x] for x in ("median_ms", "p90_ms", "max_ms", "sum_ms")}
                for p in ("pass1", "pass2")
            },
            flush=True,
        )
    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams(max_tokens=1, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for s in range(6):
            for i in range(4):
                n = 1001 + 37 * (4 * s + i)  # lengths no pass used
                eng.add_request(f"p{s}-{i}", [(j * 13 + s) % 30000 + 1 for j in range(n)], params)
            while eng.has_unfinished_requests():
                eng.step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    res["profile_cpu"] = table
    res["profile_cuda"] = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15)
    print(table[:7000], flush=True)
    write_result(a.out, res)


if __name__ == "__main__":
    main()
