"""The FP8 split-K linear kernel (fp8_linear._fp8_splitk_kernel) on the CPU, in Triton's interpreter.

Where the ``triton`` package is installed (CI's CPU torch has none: skipped there), the kernel runs under
``TRITON_INTERPRET=1`` in a subprocess (the mode is read when the kernels are defined): every split-K
candidate, row counts that are not a tile, a K that is not a block, a bias; against float64, and the tile
counters back at zero after each call (the last program of a tile resets its counter). The interpreter's
bf16 ``tl.dot`` is wrong (numpy has no bf16), so activations are float32 here; the kernel is the same for
bf16 (tests/gpu/test_fp8.py runs it in bf16 on a GPU).
"""

from __future__ import annotations

from tests.triton_interpret import require_interpreter, run_python

CASES = """
import torch
from distserve.server.engine import fp8_linear as fl
from distserve.server.engine.fp8 import quantize_per_channel
torch.manual_seed(0)
worst = 0.0
for m, n, k, bias in [(5, 70, 96, False), (33, 130, 200, True)]:
    w = torch.randn(n, k) * 0.02
    q, s = quantize_per_channel(w)
    x = torch.randn(m, k)
    b = torch.randn(n) if bias else None
    ref = (x.double() @ q.double().t()) * s.double() + (b.double() if bias else 0)
    for cfg in fl.SPLITK_CANDIDATES:
        c = dict(cfg, BLOCK_N=min(cfg["BLOCK_N"], 64), BLOCK_K=64)  # small tiles: several slices and tails
        locks = torch.zeros(64, dtype=torch.int32)
        y = fl.fp8_splitk(x, q, s, b, c, locks)
        assert y.shape == (m, n), (y.shape, c)
        err = ((y.double() - ref).norm() / ref.norm()).item()
        assert err < 1e-5, (m, n, k, c, err)
        assert int(locks.abs().sum()) == 0, (m, n, k, c, locks)
        worst = max(worst, err)
    assert fl.splitk_bucket(m) in fl.SPLITK_CONFIG
print("ok", worst)
"""


def test_fp8_splitk_kernel_in_the_triton_interpreter():
    require_interpreter()
    out = run_python(CASES, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("ok")
