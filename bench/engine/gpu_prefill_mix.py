"""Prefill step shapes the planner's profile does not hold, timed through the engine alone (issue 17).

The recorded SLO-study runs (docs/performance/history.md sections 9, 10) show the prefill worker's in-step time per
prompt at 40 ms for 1 024-2 048-token prompts at 15 req/s but 52 ms at 20 req/s, and ShareGPT steps 2-4x the
model; fixed 2 048-token prompts match it (47-48 ms). What differs at those loads: several prompts of
*different* lengths per step, a prompt chunked across two steps (the continuation runs the masked SDPA path
over the cached context), and lengths the step has never seen. This times one engine step of each shape,
first time and repeated (median of ``--repeats``), so the cause can be read off and put into the profile.

Device (one H200, carry .whl): ``python3 -m bench.engine.gpu_prefill_mix --out $OUT/prefill_mix.json`` (``--set probe``:
the serving probe's uniform shapes, 128 and 512 tokens x 1-5 prompts, 1 024 and 2 048).
CPU dry run: ``python -m bench.engine.gpu_prefill_mix --model preset:tiny-gpu --device cpu --scale 0.0625
--out /tmp/m.json``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.lib.results import write_result
from distserve.server.engine.llm_engine import EngineConfig, LLMEngine
from distserve.server.engine.sampling_params import SamplingParams

# name -> prompt lengths admitted together (budget 4096: the last one may be chunked)
SHAPES = {
    "one_2048": [2048],
    "two_2048": [2048, 2048],
    "one_1560": [1560],
    "two_varied_1500_1100": [1500, 1100],
    "three_varied_chunked_1800_1500_1400": [1800, 1500, 1400],  # 4700 tokens: the last one chunked
    "one_300": [300],
    "four_varied_short_120_300_450_700": [120, 300, 450, 700],
}
# ``--set probe``: the uniform shapes of the serving probe (study serving-slo-study), engine alone on a GPU
# of its own, to tell the step's own cost from what sharing the GPU with a decode worker adds
PROBE = {f"{k}x{n}": [n] * k for n in (128, 512) for k in (1, 2, 3, 4, 5)} | {
    "1x1024": [1024],
    "1x2048": [2048],
    "2x2048": [2048, 2048],
}
# ``--set batch``: many short prompts in one step (a colocated worker at a high rate)
BATCH = {f"{k}x{n}": [n] * k for n, ks in ((128, (1, 5, 19, 26)), (512, (3, 8))) for k in ks}


def step_times(eng: LLMEngine, lengths: list[int], salt: int, sync: Callable[[], None]) -> list[float]:
    """Admit the prompts at once, then time every step until all are prefilled (ms per step)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    vocab = eng.model_config.vocab_size - 1
    for i, n in enumerate(lengths):
        eng.add_request(f"m{salt}-{i}", [(salt * 7919 + i * 104729 + j) % vocab + 1 for j in range(n)], params)
    out: list[float] = []
    while eng.has_unfinished_requests():
        sync()
        t0 = time.perf_counter()
        eng.step()
        sync()
        out.append((time.perf_counter() - t0) * 1000)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="preset:llama-2-7b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every length (CPU dry runs)")
    ap.add_argument(
        "--set",
        default="mix",
        choices=("mix", "probe", "batch", "hits"),
        help="mix: SHAPES; probe: PROBE; batch: BATCH; hits: BATCH cold, then again with every prompt a prefix-cache hit",  # noqa: E501
    )
    ap.add_argument("--max-num-seqs", type=int, default=32, help="the engine's max_num_seqs (CUDA graphs up to it)")
    ap.add_argument(
        "--masked-continuations",
        action="store_true",
        help="time the old continuation path (explicit boolean mask, PyTorch's math kernel) for comparison",
    )
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.masked_continuations:  # this process only: the engine then takes the masked SDPA path on CUDA too
        from distserve.server.engine.attention import triton_decode

        # the state the module itself takes on torch < 2.3 (its import fallback assigns None the same way)
        triton_decode.causal_lower_right = None  # type: ignore[assignment]
    eng = LLMEngine(
        EngineConfig(
            model=a.model,
            device=a.device,
            max_num_seqs=a.max_num_seqs,
            max_num_batched_tokens=max(16, int(4096 * a.scale)),
            max_model_len=max(64, int(2304 * a.scale)),
            kv_cache_memory_mb=36000 if a.device != "cpu" else 256,
            enable_prefix_caching=a.set == "hits",
        )
    )
    sync: Callable[[], None] = torch.cuda.synchronize if a.device.startswith("cuda") else (lambda: None)
    step_times(eng, [max(8, int(2048 * a.scale))], 0, sync)  # warm-up
    res: dict[str, Any] = {
        "model": a.model,
        "device": a.device,
        "torch": torch.__version__,
        "max_num_seqs": a.max_num_seqs,
        "continuations": "masked (math kernel)" if a.masked_continuations else "fused (lower-right causal bias)",
        "shapes": {},
    }
    salt = 1
    if a.set == "hits":  # the same prompts twice: cold, then with all but their last block from the cache
        for name, lengths in BATCH.items():
            ls = [max(8, int(n * a.scale)) for n in lengths]
            cold: list[list[float]] = []
            warm: list[list[float]] = []
            for _ in range(a.repeats):
                cold.append(step_times(eng, ls, salt, sync))
                warm.append(step_times(eng, ls, salt, sync))
                salt += 1
            res["shapes"][name] = {
                "lengths": ls,
                "cold_median_ms": [round(statistics.median(col), 2) for col in zip(*cold, strict=True)],
                "hit_median_ms": [round(statistics.median(col), 2) for col in zip(*warm, strict=True)],
            }
            print(name, res["shapes"][name], flush=True)
        write_result(a.out, res)
        return
    for name, lengths in {"mix": SHAPES, "probe": PROBE, "batch": BATCH}[a.set].items():
        ls = [max(8, int(n * a.scale)) for n in lengths]
        first = step_times(eng, ls, salt, sync)
        salt += 1
        again = [step_times(eng, ls, salt + r, sync) for r in range(a.repeats)]
        salt += a.repeats
        res["shapes"][name] = {
            "lengths": ls,
            "first_ms": [round(x, 2) for x in first],
            "repeat_median_ms": [round(statistics.median(col), 2) for col in zip(*again, strict=True)],
        }
        print(name, res["shapes"][name], flush=True)
    write_result(a.out, res)


if __name__ == "__main__":
    main()
