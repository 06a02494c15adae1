"""What a new prefill length costs in causal SDPA on the GPU: first call vs repeat, per backend choice.

cuDNN attention builds an execution plan per new shape; flash attention does not. For each choice
(PyTorch's default, flash first, cuDNN first) it times the first and the second call of a [1, 32, T, 128]
bf16 causal attention for lengths T it has not seen yet (a disjoint set per choice), like a 7B prefill layer.
Device: ``python3 -m bench.kernels.gpu_sdpa_shapes --out $OUT/sdpa_shapes.json``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench.lib.results import write_result


def timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, default=12, help="new lengths per choice")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    choices = {
        "default": None,
        "flash_first": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION],
        "cudnn_first": [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION],
    }
    dev = torch.device("cuda")
    x = torch.randn(1, 32, 2048, 128, device=dev, dtype=torch.bfloat16)
    F.scaled_dot_product_attention(x, x, x, is_causal=True)  # CUDA context, allocator
    out: dict[str, Any] = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0), "choices": {}}
    base = 1031
    for name, backends in choices.items():
        firsts, seconds = [], []
        for i in range(args.lengths):
            t = base + 7 * i
            q = torch.randn(1, 32, t, 128, device=dev, dtype=torch.bfloat16)

            def call(q=q, backends=backends):
                if backends is None:
                    return F.scaled_dot_product_attention(q, q, q, is_causal=True)
                with sdpa_kernel(backends, set_priority=True):
                    return F.scaled_dot_product_attention(q, q, q, is_causal=True)

            firsts.append(timed(call))
            seconds.append(timed(call))
        base += 7 * args.lengths + 3
        out["choices"][name] = {
            "first_ms_median": statistics.median(firsts),
            "first_ms_max": max(firsts),
            "repeat_ms_median": statistics.median(seconds),
        }
        print(name, {k: round(v, 3) for k, v in out["choices"][name].items()}, flush=True)
    if args.out:
        write_result(args.out, out)


if __name__ == "__main__":
    main()
