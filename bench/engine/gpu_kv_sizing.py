"""Device check of KV sizing from memory (cache.gpu_memory_utilization) and of the engine-only
prefill loop: one 7B preset engine on one GPU, its KVBudget, then N back-to-back 2048-token
prefills through add_request + step (no HTTP), timing step vs the whole per-request path.
Usage on the device: python3 -m bench.engine.gpu_kv_sizing --out $OUT/kv_sizing.json"""

import argparse
import os
import statistics
import time
from typing import Any

import torch

from bench.lib.results import write_result
from distserve.server.engine.llm_engine import EngineConfig, LLMEngine
from distserve.server.engine.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="preset:llama-2-7b")
    ap.add_argument("--utilization", type=float, default=0.9)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--n", type=int, default=30)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.utilization <= 0:  # the engine sizes its KV from memory only with a utilization above 0
        ap.error(f"--utilization must be above 0 (got {a.utilization}): this study measures KV sized from memory")
    t0 = time.perf_counter()
    eng = LLMEngine(
        EngineConfig(
            model=a.model,
            device="cuda:0",
            max_model_len=2304,
            max_num_batched_tokens=2048,
            max_num_seqs=128,
            gpu_memory_utilization=a.utilization,
        )
    )
    startup = time.perf_counter() - t0
    b = eng.kv_budget
    if b is None:  # the engine sizes its KV from memory only on CUDA with a utilization above 0
        raise SystemExit("gpu_kv_sizing: the engine made no KV budget (it needs CUDA and --utilization > 0)")
    free, total = torch.cuda.mem_get_info()
    res: dict[str, Any] = {
        "startup_s": startup,
        "budget": b.describe(),
        "num_blocks": b.num_blocks,
        "kv_gib": b.kv_bytes / 2**30,
        "peak_gib": b.peak_bytes / 2**30,
        "non_torch_gib": b.non_torch_bytes / 2**30,
        "device_used_after_gib": (total - free) / 2**30,
        "device_total_gib": total / 2**30,
    }
    print(res, flush=True)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    steps: list[float] = []
    whole: list[float] = []
    for i in range(a.n):
        ids = [(i * 7919 + j) % 30000 + 1 for j in range(a.prompt)]  # distinct: no prefix hits
        t1 = time.perf_counter()
        eng.add_request(f"r{i}", ids, params)
        while eng.has_unfinished_requests():
            t2 = time.perf_counter()
            eng.step()
            torch.cuda.synchronize()
            steps.append(time.perf_counter() - t2)
        whole.append(time.perf_counter() - t1)
    w, s = whole[3:], steps[3:]
    res.update(
        {
            "prefill_whole_ms_median": 1e3 * statistics.median(w),
            "step_ms_median": 1e3 * statistics.median(s),
            "engine_only_req_per_s": 1 / statistics.median(w),
            "n": len(w),
        }
    )
    print({k: v for k, v in res.items() if "ms" in k or "req" in k}, flush=True)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(3):
            eng.add_request(f"p{i}", [(i * 104729 + j) % 30000 + 1 for j in range(a.prompt)], params)
            while eng.has_unfinished_requests():
                eng.step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    with open(os.path.join(os.path.dirname(a.out), "prefill_engine_profile.txt"), "w") as f:
        f.write(table + "\n\n" + prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15))
    print(table[:6000], flush=True)
    write_result(a.out, res)


if __name__ == "__main__":
    main()
