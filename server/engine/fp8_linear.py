"""GPU linears over e4m3 weights with per-output-channel scales (``fp8.quantize_model_weights``).

Decode is bandwidth-bound: at batch 1..128 a linear reads ``N * K`` weight bytes and does little
arithmetic on them, so reading one byte per weight instead of two is the gain, and the activation can
stay bf16 (W8A16). Paths, by the number of rows ``M`` of ``x``:

* ``M == 1``: a GEMV (``_fp8_gemv_kernel``): products accumulate elementwise in float32, one reduction
  at the end, the weight stream software-pipelined (the bf16 GEMV of ``cuda_ops`` with e4m3 loads).
* ``2 <= M <= 128`` (decode batches): ``_fp8_splitk_kernel``, one program per ``BLOCK_N`` output
  columns and K slice with *all* rows in one tile (the weights are read once, whatever ``M``): each e4m3
  tile is widened to bf16 in registers and feeds ``tl.dot``. ``SWAP_AB`` computes ``W @ x.T`` so the
  weight tile is the MMA's M side (64/128 rows, what Hopper's tensor cores want) and the few tokens its
  N side. With ``SPLIT_K > 1`` each program writes a float32 partial and the last program of a column
  tile (an atomic counter, reset by that program) sums the partials in a fixed order and stores ``y``:
  one launch, deterministic. The previous tile kernel looped a grid over M and re-read ``x`` from L2 in
  every one of its ``N / 64`` programs, which is why it lost to cuBLAS from 64 rows on an H200.
* ``M > 128`` (a colocated worker's prefill): ``_fp8_dot_kernel``, the plain tile kernel.
* ``torch._scaled_mm`` on FP8 tensor cores (activation quantised per row, ``M`` padded to a multiple of
  16) only with ``SCALED_MM_MIN_M`` set: it adds the activation's rounding (2.6 % relative output error
  against 0.3 % for W8A16 on the H200).

Per-shape configs: ``tune_fp8_linears`` (called by ``cuda_graph_runner.setup_cuda_engine`` for an FP8
engine, like ``cuda_ops.tune_gemv`` for bf16) times candidate configs of the GEMV and of the split-K
kernel at M = 16 / 32 / 64 / 128 for each projection shape, as a CUDA graph over every layer's weight,
and stores the winners on each linear (``fp8_cfg``: bucket -> config). Untuned layers use the defaults
below. The per-channel scale multiplies the float32 accumulator at the end. Every path is CUDA-graph safe
(no host sync; the split-K counters are allocated before capture). ``bench/gpu_fp8.py`` times all of
these against cuBLAS bf16 and ``_scaled_mm``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from distserve.server.engine.fp8 import FP8_DTYPE, FP8_MAX, fp8_linear_emulated, has_fp8_weight
from distserve.server.engine.ops.cuda_ops import TritonLayerOps

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
SPLITK_MAX_M = 128  # rows up to which the split-K kernel runs (all rows in one tile)
# Split-K defaults per row bucket (untuned layers); tune_fp8_linears replaces them per shape.
SPLITK_CONFIG: dict[int, dict[str, Any]] = {
    16: {"BLOCK_N": 64, "BLOCK_K": 256, "SPLIT_K": 2, "SWAP_AB": True, "num_warps": 4, "num_stages": 3},
    32: {"BLOCK_N": 64, "BLOCK_K": 256, "SPLIT_K": 2, "SWAP_AB": True, "num_warps": 4, "num_stages": 3},
    64: {"BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 4, "SWAP_AB": True, "num_warps": 4, "num_stages": 3},
    128: {"BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 4, "SWAP_AB": True, "num_warps": 8, "num_stages": 3},
}
# What tune_fp8_linears tries (each must divide nothing: K and N tails are masked; the GEMV needs
# BLOCK_K | K and falls back otherwise).
SPLITK_CANDIDATES: tuple[dict[str, Any], ...] = (
    {"BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 1, "SWAP_AB": False, "num_warps": 4, "num_stages": 4},
    {"BLOCK_N": 64, "BLOCK_K": 256, "SPLIT_K": 2, "SWAP_AB": True, "num_warps": 4, "num_stages": 3},
    {"BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 4, "SWAP_AB": True, "num_warps": 4, "num_stages": 4},
    {"BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 2, "SWAP_AB": True, "num_warps": 4, "num_stages": 4},
    {"BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 4, "SWAP_AB": True, "num_warps": 8, "num_stages": 3},
    {"BLOCK_N": 128, "BLOCK_K": 256, "SPLIT_K": 4, "SWAP_AB": True, "num_warps": 8, "num_stages": 3},
    {"BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 4, "SWAP_AB": False, "num_warps": 4, "num_stages": 3},
    {"BLOCK_N": 64, "BLOCK_K": 256, "SPLIT_K": 8, "SWAP_AB": True, "num_warps": 4, "num_stages": 3},
)
GEMV_CANDIDATES: tuple[dict[str, Any], ...] = (
    {"BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 4, "STAGES": 3},
    {"BLOCK_N": 8, "BLOCK_K": 512, "num_warps": 4, "STAGES": 3},
    {"BLOCK_N": 4, "BLOCK_K": 1024, "num_warps": 4, "STAGES": 3},
    {"BLOCK_N": 16, "BLOCK_K": 512, "num_warps": 8, "STAGES": 4},
    {"BLOCK_N": 8, "BLOCK_K": 256, "num_warps": 2, "STAGES": 4},
    {"BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "STAGES": 4},
)


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


if HAS_TRITON:

    @triton.jit
    def _fp8_splitk_kernel(
        x_ptr,
        w_ptr,
        s_ptr,
        b_ptr,
        y_ptr,
        part_ptr,
        lock_ptr,
        M,
        N,
        K,
        K_SPLIT,
        stride_xm,
        stride_w,
        stride_ym,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr,
        SWAP_AB: tl.constexpr,
        EVEN_K: tl.constexpr,
    ):
        """y[M, N] = (x[M, K] @ W[N, K].T) * s[N] (+ b), W in e4m3; grid (N / BLOCK_N, SPLIT_K, M / BLOCK_M).

        Program (n, k, m) computes rows ``m``'s tile over the K slice ``[k * K_SPLIT, (k + 1) * K_SPLIT)``.
        SPLIT_K > 1: the float32 partial goes to ``part [SPLIT_K, M_pad, N]``; the program that finds the
        tile's counter at SPLIT_K - 1 sums the partials (slice order: deterministic), writes ``y`` and
        resets the counter to 0 for the next call."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m = tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mmask = offs_m < M
        nmask = offs_n < N
        x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
        w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_w
        k_lo = pid_k * K_SPLIT
        if SWAP_AB:
            acc_t = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        else:
            acc_t = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for kk in range(0, K_SPLIT, BLOCK_K):  # K_SPLIT: a multiple of BLOCK_K
            cols = k_lo + kk + offs_k
            if EVEN_K:  # every slice whole: no K mask
                x = tl.load(x_rows + cols[None, :], mask=mmask[:, None], other=0.0)
                w = tl.load(w_rows + cols[None, :], mask=nmask[:, None], other=0.0, eviction_policy="evict_first")
            else:
                kmask = cols < K
                x = tl.load(x_rows + cols[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
                w = tl.load(
                    w_rows + cols[None, :],
                    mask=nmask[:, None] & kmask[None, :],
                    other=0.0,
                    eviction_policy="evict_first",
                )
            wb = w.to(x.dtype)  # e4m3 -> bf16 in registers, just before the MMA
            if SWAP_AB:
                acc_t = tl.dot(wb, tl.trans(x), acc_t)
            else:
                acc_t = tl.dot(x, tl.trans(wb), acc_t)
        if SWAP_AB:
            acc = tl.trans(acc_t)
        else:
            acc = acc_t
        out_mask = mmask[:, None] & nmask[None, :]
        if SPLIT_K > 1:
            m_pad = tl.num_programs(2) * BLOCK_M
            tile = pid_m * tl.num_programs(0) + pid_n
            part_rows = part_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
            tl.store(part_rows + pid_k.to(tl.int64) * m_pad * N, acc, mask=nmask[None, :])
            tl.debug_barrier()  # every thread's partial is written before the counter is released
            count = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel")
            if count == SPLIT_K - 1:  # the last slice of this tile: reduce, store, reset
                acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                for j in tl.static_range(SPLIT_K):
                    # .cg: from L2 (other SMs wrote these; L1 is not coherent)
                    acc += tl.load(part_rows + j * m_pad * N, mask=nmask[None, :], other=0.0, cache_modifier=".cg")
                acc = acc * tl.load(s_ptr + offs_n, mask=nmask, other=0.0)[None, :]
                if HAS_BIAS:
                    acc += tl.load(b_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
                y = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
                tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
                tl.atomic_xchg(lock_ptr + tile, 0)
        else:
            acc = acc * tl.load(s_ptr + offs_n, mask=nmask, other=0.0)[None, :]
            if HAS_BIAS:
                acc += tl.load(b_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
            y = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
            tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=out_mask)


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


def splitk_bucket(m: int) -> int:
    """The row bucket (16, 32, 64, 128) whose split-K config serves ``m`` rows (2..SPLITK_MAX_M)."""
    return min(SPLITK_MAX_M, max(16, _next_pow2(m)))


def splitk_locks(layer: Any, device: torch.device) -> torch.Tensor | None:
    """The layer's split-K tile counters (int32 zeros, one per column tile at BLOCK_N >= 16 for up to 8
    row tiles), made on first use outside a CUDA-graph capture; None while capturing without them."""
    locks = getattr(layer, "fp8_locks", None)
    if locks is None or locks.device != device:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        n = layer.weight.shape[0]
        locks = torch.zeros(8 * triton.cdiv(n, 16), dtype=torch.int32, device=device)
        layer.fp8_locks = locks
    return locks


def fp8_splitk(
    x: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    cfg: dict[str, Any],
    locks: torch.Tensor | None,
) -> torch.Tensor:
    """``x [M, K]`` (M <= 1024, last dim contiguous) times an e4m3 ``w [N, K]`` through the split-K kernel;
    ``locks`` (``splitk_locks``) is needed when ``cfg["SPLIT_K"] > 1`` (without it: one slice)."""
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    block_m = max(16, min(128, _next_pow2(m)))
    grid_m = triton.cdiv(m, block_m)
    split = int(cfg["SPLIT_K"]) if locks is not None and grid_m <= 8 else 1
    bk = int(cfg["BLOCK_K"])
    k_split = triton.cdiv(triton.cdiv(k, split), bk) * bk
    split = triton.cdiv(k, k_split)  # no empty slice
    part = torch.empty(split * grid_m * block_m * n if split > 1 else 1, dtype=torch.float32, device=x.device)
    _fp8_splitk_kernel[(triton.cdiv(n, cfg["BLOCK_N"]), split, grid_m)](
        x,
        w,
        scale,
        bias if bias is not None else y,
        y,
        part,
        locks if locks is not None else y,
        m,
        n,
        k,
        k_split,
        x.stride(0),
        w.stride(0),
        y.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=bk,
        SPLIT_K=split,
        SWAP_AB=bool(cfg["SWAP_AB"]),
        EVEN_K=k % k_split == 0,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
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
    cfgs = getattr(layer, "fp8_cfg", None) or {}
    if m == 1 and x.is_contiguous():
        return fp8_gemv(x, w, s, b, cfgs.get(1))
    if SCALED_MM_MIN_M and m >= SCALED_MM_MIN_M:
        return _scaled_mm_or_dot(x, layer)
    if m <= SPLITK_MAX_M:
        bucket = splitk_bucket(m)
        return fp8_splitk(x, w, s, b, cfgs.get(bucket) or SPLITK_CONFIG[bucket], splitk_locks(layer, x.device))
    return fp8_dot(x, w, s, b)


def _scaled_mm_or_dot(x: torch.Tensor, layer: Any) -> torch.Tensor:
    w, s, b = layer.weight, layer.weight_scale, layer.bias
    if getattr(layer, "scaled_mm_ok", True):
        try:
            return fp8_scaled_mm(x, w, s, b)
        except (RuntimeError, TypeError):  # no FP8 tensor cores / unsupported scaling here
            layer.scaled_mm_ok = False
    return fp8_dot(x, w, s, b)


def _candidate_ok(fn, ref: torch.Tensor) -> bool:
    out = fn().float()
    return bool(torch.isfinite(out).all()) and ((out - ref).norm() / ref.norm()).item() < 1e-2


def tune_fp8_linears(model: Any, buckets: tuple[int, ...] = (16, 32, 64, 128), verbose: bool = False) -> dict:
    """Per projection shape: the fastest e4m3 GEMV config at one row and split-K config per row bucket,
    timed as a CUDA graph over that projection of every layer (``cuda_ops._graph_ms``: weights stream
    from HBM as in a decode step), each candidate first checked against a float32 reference (relative
    error < 1e-2). Stores ``fp8_cfg = {1: gemv, 16: splitk, ...}`` on every linear; returns the timings."""
    from distserve.server.engine.fp8 import FP8_LINEARS
    from distserve.server.engine.ops.cuda_ops import _graph_ms

    report: dict = {}
    layers = list(model.layers)
    dtype = model.embed_tokens.weight.dtype
    for name in FP8_LINEARS:
        mods = [m for m in (layer.get_submodule(name) for layer in layers) if has_fp8_weight(m)]
        if not mods:  # (layers kept in bf16: fp8_bf16_layers)
            continue
        n, k = mods[0].weight.shape
        dev = mods[0].weight.device
        for mod in mods:
            splitk_locks(mod, dev)
        g = torch.Generator(device=dev).manual_seed(n + k)
        chosen: dict[int, dict[str, Any]] = {}
        entry: dict = {}
        for bucket in (1, *buckets):
            x = torch.randn(bucket, k, device=dev, generator=g).to(dtype)
            m0 = mods[0]
            ref = (x.float() @ m0.weight.float().t()) * m0.weight_scale
            if m0.bias is not None:
                ref += m0.bias.float()
            times: dict[str, float] = {}
            best, best_ms = None, float("inf")
            cands = GEMV_CANDIDATES if bucket == 1 else SPLITK_CANDIDATES
            for i, cfg in enumerate(cands):
                if bucket == 1:
                    if k % cfg["BLOCK_K"]:
                        continue

                    def run(mod, cfg=cfg):
                        return fp8_gemv(x, mod.weight, mod.weight_scale, mod.bias, cfg)
                else:

                    def run(mod, cfg=cfg):
                        return fp8_splitk(x, mod.weight, mod.weight_scale, mod.bias, cfg, mod.fp8_locks)

                try:
                    if not _candidate_ok(lambda: run(m0), ref):
                        continue
                    ms = _graph_ms(run, mods)
                except Exception:  # a config that does not compile (or capture) here is skipped
                    continue
                times[str(i)] = round(ms * 1e3, 2)
                if ms < best_ms:
                    best, best_ms = cfg, ms
            if best is not None:
                chosen[bucket] = dict(best)
            entry[bucket] = {"choice": best, "us": times}
        for mod in mods:
            mod.fp8_cfg = chosen
        report[f"{name} {n}x{k}"] = entry
        if verbose:
            print(
                "fp8", name, (n, k), {b: (e["choice"], min(e["us"].values(), default=None)) for b, e in entry.items()}
            )
    return report


class Fp8TritonLayerOps(TritonLayerOps):
    """``cuda_ops.TritonLayerOps`` whose linears read e4m3 weights where a layer has them."""

    name = "triton+fp8"

    def linear(self, x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
        if has_fp8_weight(layer):
            return fp8_linear(x, layer)
        return super().linear(x, layer)


__all__ = [
    "DOT_CONFIG",
    "Fp8TritonLayerOps",
    "GEMV_CONFIG",
    "SPLITK_CONFIG",
    "fp8_dot",
    "fp8_gemv",
    "fp8_linear",
    "fp8_scaled_mm",
    "fp8_splitk",
    "splitk_bucket",
    "splitk_locks",
    "tune_fp8_linears",
]
