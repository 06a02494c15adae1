"""GPU linears over e4m3 weights with per-output-channel scales (``fp8.quantize_model_weights``).

Decode is bandwidth-bound: at batch 1..64 a linear reads ``N * K`` weight bytes and does little
arithmetic on them, so reading one byte per weight instead of two is the gain, and the activation can
stay bf16 (W8A16). Three paths, by the number of rows ``M`` of ``x``:

* ``M == 1``: a GEMV (``_fp8_gemv_kernel``): products accumulate elementwise in float32, one reduction
  at the end, the weight stream software-pipelined (the bf16 GEMV of ``cuda_ops`` with e4m3 loads).
* ``M > 1``: ``_fp8_dot_kernel``, a tile kernel that widens each e4m3 tile to bf16 in registers and
  feeds ``tl.dot`` (rows padded to 16 inside the kernel, never in memory): W8A16 at every batch size, so
  a request's numerics do not depend on the batch it lands in.
* ``torch._scaled_mm`` on FP8 tensor cores (activation quantised per row, ``M`` padded to a multiple of
  16) only with ``SCALED_MM_MIN_M`` set: on an H200 it beat the tile kernel from M = 128 (44 vs 66 us on
  the qkv shape) but adds the activation's rounding (2.6 % relative output error against 0.3 %).

The per-channel scale multiplies the float32 accumulator at the end. Every path is CUDA-graph safe (no
host sync). ``bench/gpu_fp8.py`` times these against each other and against ``_scaled_mm`` at small M.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from server.engine.fp8 import FP8_DTYPE, FP8_MAX, fp8_linear_emulated, has_fp8_weight
from server.engine.ops.cuda_ops import TritonLayerOps

try:  # pragma: no cover - depends on the install
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:
    triton = None
    tl = None
    HAS_TRITON = False

SCALED_MM_MIN_M = 0  # 0: never (W8A16 tile kernel at every M); else rows from which _scaled_mm runs
# The bench may override these. Chosen by bench/gpu_fp8.py on an H200 (docs/performance/fp8.md, 'Why: the kernels':
# summed over the four 7B projections at M = 1, the best single GEMV config, 70.3 us against 94.5 for (8, 512, 4, 3)).
GEMV_CONFIG: dict[str, Any] = {"BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 4, "STAGES": 3}
DOT_CONFIG: dict[str, Any] = {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4}


if HAS_TRITON:

    @triton.jit
    def _fp8_gemv_kernel(
        x_ptr,
        w_ptr,
        s_ptr,
        b_ptr,
        y_ptr,
        N,
        K,
        stride_w,
        HAS_BIAS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        STAGES: tl.constexpr,
    ):
        """y[N] = (W[N, K] @ x[K]) * s[N] (+ b); W in e4m3. K must be a multiple of BLOCK_K."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < N
        w_rows = w_ptr + rows[:, None].to(tl.int64) * stride_w
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            cols = k0 + tl.arange(0, BLOCK_K)
            w = tl.load(w_rows + cols[None, :], mask=rmask[:, None], other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptr + cols)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        y = tl.sum(acc, 1) * tl.load(s_ptr + rows, mask=rmask, other=0.0)
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rmask)

    @triton.jit
    def _fp8_dot_kernel(
        x_ptr,
        w_ptr,
        s_ptr,
        b_ptr,
        y_ptr,
        M,
        N,
        K,
        stride_xm,
        stride_w,
        stride_ym,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """y[M, N] = (x[M, K] @ W[N, K].T) * s[N] (+ b); W in e4m3 widened to x's dtype per tile."""
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mmask = offs_m < M
        nmask = offs_n < N
        x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
        w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_w
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + offs_k
            kmask = cols < K
            x = tl.load(x_rows + cols[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
            w = tl.load(w_rows + cols[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
        acc = acc * tl.load(s_ptr + offs_n, mask=nmask, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
        y = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def fp8_gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, cfg=None):
    """One row ``x [1, K]`` (contiguous) times an e4m3 ``w [N, K]``; falls back to the tile kernel when
    ``K`` is not a multiple of the block."""
    n, k = w.shape
    c = cfg or GEMV_CONFIG
    if k % c["BLOCK_K"]:
        return fp8_dot(x, w, scale, bias)
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _fp8_gemv_kernel[(triton.cdiv(n, c["BLOCK_N"]),)](
        x,
        w,
        scale,
        bias if bias is not None else y,
        y,
        n,
        k,
        w.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_N=c["BLOCK_N"],
        BLOCK_K=c["BLOCK_K"],
        STAGES=c["STAGES"],
        num_warps=c["num_warps"],
        num_stages=c["STAGES"],
    )
    return y


def fp8_dot(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, cfg=None):
    """``x [M, K]`` (last dim contiguous) times an e4m3 ``w [N, K]`` through the tile kernel."""
    m, k = x.shape
    n = w.shape[0]
    c = cfg or DOT_CONFIG
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    block_m = min(64, max(16, _next_pow2(m)))
    _fp8_dot_kernel[(triton.cdiv(n, c["BLOCK_N"]), triton.cdiv(m, block_m))](
        x,
        w,
        scale,
        bias if bias is not None else y,
        y,
        m,
        n,
        k,
        x.stride(0),
        w.stride(0),
        y.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=c["BLOCK_N"],
        BLOCK_K=c["BLOCK_K"],
        num_warps=c["num_warps"],
        num_stages=c["num_stages"],
    )
    return y


def fp8_scaled_mm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
    """``torch._scaled_mm`` with a per-row e4m3 activation (rows padded to a multiple of 16) and the
    per-channel weight scales; the FP8 tensor-core path for prefill-sized ``M``."""
    m = x.shape[0]
    pad = -m % 16
    xf = x.float()
    sx = (xf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_(min=1e-12)
    xq = (xf / sx).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    if pad:
        xq = F.pad(xq.view(torch.uint8), (0, 0, 0, pad)).view(FP8_DTYPE)
        sx = F.pad(sx, (0, 0, 0, pad), value=1.0)
    y = torch._scaled_mm(xq, w.t(), scale_a=sx, scale_b=scale[None, :], out_dtype=x.dtype, bias=None)
    y = y[:m]
    return y + bias if bias is not None else y


def fp8_linear(x: torch.Tensor, layer: Any) -> torch.Tensor:
    m = x.shape[0]
    w, s, b = layer.weight, layer.weight_scale, layer.bias
    if not x.is_cuda or not HAS_TRITON:
        return fp8_linear_emulated(x, layer)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if m == 1 and x.is_contiguous():
        return fp8_gemv(x, w, s, b)
    if not SCALED_MM_MIN_M or m < SCALED_MM_MIN_M:
        return fp8_dot(x, w, s, b)
    if getattr(layer, "scaled_mm_ok", True):
        try:
            return fp8_scaled_mm(x, w, s, b)
        except (RuntimeError, TypeError):  # no FP8 tensor cores / unsupported scaling here
            layer.scaled_mm_ok = False
    return fp8_dot(x, w, s, b)


class Fp8TritonLayerOps(TritonLayerOps):
    """``cuda_ops.TritonLayerOps`` whose linears read e4m3 weights where a layer has them."""

    name = "triton+fp8"

    def linear(self, x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
        if has_fp8_weight(layer):
            return fp8_linear(x, layer)
        return super().linear(x, layer)


__all__ = ["Fp8TritonLayerOps", "fp8_dot", "fp8_gemv", "fp8_linear", "fp8_scaled_mm", "GEMV_CONFIG", "DOT_CONFIG"]
