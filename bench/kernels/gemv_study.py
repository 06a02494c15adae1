#!/usr/bin/env python3
"""GEMV study for batch-1 (and small-batch) decode of a 7B Llama on Hopper.

Run from the repository root on a CUDA machine:

    python3 -m bench.kernels.gemv_study --out $OUT/gemv_study.json          # ~40 s on an H200 (cold Triton cache)
    python3 -m bench.kernels.gemv_study --quick --out $OUT/gemv_quick.json  # ~10 s

What it does (every failing piece is recorded as an error string, never fatal):

1. correctness of every GEMV variant against ``F.linear`` in float32 (bf16 inputs, relative error < 1e-2,
   finite) on the five 7B shapes and on an odd shape (1000x4096 with bias; M=3 for the batched kinds);
2. timing of each variant inside a CUDA graph of 20 back-to-back launches (the engine decodes in CUDA
   graphs), weights rotated over enough distinct copies that L2 (50-60 MB) never serves them, L2 flushed
   before each replay; median microseconds and GB/s = weight bytes / time;
3. a 32-layer decode chain at batch 1 (rms_norm, qkv, dummy attention copy, o_proj, rms_norm, gate_up,
   silu_mul, down) with 32 distinct weight sets (12.9 GB) in one CUDA graph, for cuBLAS everywhere, the best
   Triton GEMV per shape, and the new kernels with and without programmatic dependent launch (PDL);
4. writes everything to ``--out`` (JSON) and prints a compact summary.

Kernels here (besides cuBLAS and the engine's ``cuda_ops._gemv_kernel``):

* ``v2``: CUDA-core GEMV. Weight tile of BLOCK_N rows x BLOCK_K columns, fp32 products accumulated
  elementwise, one reduction at the end (like the engine's), plus: the next weight tile is loaded before
  the current one is used (register double buffering, PREFETCH) or the loop is software-pipelined through
  shared memory (STAGES > 1, cp.async); ``evict_first`` on the streamed weights; optional split-K (each
  program reduces a K slice, fp32 atomics into a workspace, the last program of a row tile -- found with
  an atomic ticket -- writes the output and re-zeroes workspace and ticket, so no memset kernel is needed);
  optional persistent grid (``persist * SM count`` programs looping over the tiles); M <= 8 rows.
* ``tc``: tensor-core "swap AB" GEMV: y^T[N, 16] = W[N, K] @ x^T[K, 16] with x zero-padded to 16 rows, so
  Triton software-pipelines the weight stream through shared memory (num_stages deep) and the reduction is
  done by wgmma/mma; same split-K; serves M <= 16 with one compile.
* both take ``USE_PDL`` (launched with ``launch_pdl=True``): ``gdc_launch_dependents()`` at entry, or with
  ``trig="late"`` after the weight stream; the first weight tile (register-prefetch path) is loaded before
  ``gdc_wait()``, which guards the first read of the activation written by the previous kernel. Optional
  ``l2pf``: ``prefetch.global.L2`` of each program's first weight lines before the wait.
* ``legacy``: ``server.engine.ops.cuda_ops.gemv`` with every entry of ``GEMV_CANDIDATES`` (3-tuples: the plain
  loop; 4-tuples: the loop pipelined ``STAGES`` deep).

Measured on the H200 (Nov run): pipelined loops (cp.async, 3 stages) win every 7B shape at one token
(qkv 25.7 us, o_proj 10.7, gate_up 43.5, down 23.6 against cuBLAS 28.5 / 13.6 / 47.1 / 28.1); the
32-layer chain takes 3.98 ms with cuBLAS, 3.50 with the best Triton GEMVs, 3.37-3.38 with PDL (trigger after
the weight stream); split-K on CUDA cores, register prefetch, persistent grids and the L2 prefetch lose.
For M = 2..16 the tensor-core kernel beats cuBLAS by 2-4 us on qkv, o_proj (split-K 4) and down.

CPU: ``python3 -m bench.kernels.gemv_study`` exits with a message;
``TRITON_INTERPRET=1 python3 -m bench.kernels.gemv_study --selftest`` runs the new kernels on tiny shapes through
Triton's interpreter.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypedDict, Unpack, overload

from bench.lib.results import write_result

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

try:
    import torch
    import torch.nn.functional as F
except Exception as e:  # pragma: no cover
    torch = None  # type: ignore[assignment]  # main() says so and exits
    F = None  # type: ignore[assignment]
    _TORCH_ERR = repr(e)

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception as e:  # pragma: no cover
    triton = None
    tl = None
    HAS_TRITON = False
    _TRITON_ERR = repr(e)

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

HAS_GDC = False
if HAS_TRITON:
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

        HAS_GDC = True
    except Exception:  # older Triton: PDL variants are skipped

        @triton.jit
        def gdc_wait():
            pass

        @triton.jit
        def gdc_launch_dependents():
            pass


# 7B Llama-2 shapes (N, K) of the weights, in decode order.
SHAPES = {
    "qkv": (12288, 4096),
    "o_proj": (4096, 4096),
    "gate_up": (22016, 4096),
    "down": (4096, 11008),
    "lm_head": (32000, 4096),
}
HIDDEN, INTER = 4096, 11008
NUM_SMS = 132
L2_BYTES = 60 * 2**20
READ_BW = 4.16e12  # measured read bandwidth of the H200 (B/s), for the floor


class KernelCfg(TypedDict, total=False):
    """A ``v2`` / ``tc`` config: tile (bn rows x bk columns), warps, and the options the kernels take."""

    bn: int
    bk: int
    nw: int
    pf: int  # v2: register prefetch of the next weight tile (default on)
    ns: int  # pipeline stages through shared memory
    split: int  # split-K programs per row tile
    persist: int  # persistent grid: persist * SM count programs
    evict: str  # the weight loads' eviction policy ("" = none)
    l2pf: int  # PDL: lines of prefetch.global.L2 before gdc_wait()
    trig: str  # PDL: "late" = gdc_launch_dependents() after the weight stream


if TYPE_CHECKING:  # the chain's small kernels: rms_norm(x, weight, residual), silu_mul(gate_up), the attention copy
    RmsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    UnaryFn = Callable[[torch.Tensor], torch.Tensor]
    Smalls = tuple[RmsFn, UnaryFn, UnaryFn]

# ----------------------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _ld_w(w_rows, cols, rmask, k_hi, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, EVICT: tl.constexpr):
        if EVEN_K:
            if EVEN_N:
                w = tl.load(w_rows + cols[None, :], eviction_policy=EVICT)
            else:
                w = tl.load(w_rows + cols[None, :], mask=rmask[:, None], other=0.0, eviction_policy=EVICT)
        else:
            w = tl.load(
                w_rows + cols[None, :], mask=rmask[:, None] & (cols[None, :] < k_hi), other=0.0, eviction_policy=EVICT
            )
        return w

    @triton.jit
    def _ld_x(x_ptr, stride_xm, M, cols, k_hi, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr):
        if BLOCK_M == 1:
            if EVEN_K:
                x = tl.load(x_ptr + cols)
            else:
                x = tl.load(x_ptr + cols, mask=cols < k_hi, other=0.0)
        else:
            offs_m = tl.arange(0, BLOCK_M)
            if EVEN_K:
                x = tl.load(x_ptr + offs_m[:, None] * stride_xm + cols[None, :], mask=offs_m[:, None] < M, other=0.0)
            else:
                x = tl.load(
                    x_ptr + offs_m[:, None] * stride_xm + cols[None, :],
                    mask=(offs_m[:, None] < M) & (cols[None, :] < k_hi),
                    other=0.0,
                )
        return x

    @triton.jit
    def _l2_prefetch(w_rows, k_lo, k_hi, LINES: tl.constexpr):
        """prefetch.global.L2 of LINES 128-byte lines (64 bf16) of each row of the tile, from column k_lo."""
        offs = tl.minimum(k_lo + tl.arange(0, LINES) * 64, k_hi - 1)
        ptrs = w_rows + offs[None, :]
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
        )

    @triton.jit
    def _fma(acc, w, x, BLOCK_M: tl.constexpr):
        if BLOCK_M == 1:  # acc [BLOCK_N, BLOCK_K]: elementwise, reduced once at the end
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        else:  # acc [BLOCK_M, BLOCK_N]: reduced every step (keeps registers bounded)
            acc += tl.sum(w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :], axis=2)
        return acc

    @triton.jit
    def _epilogue(
        part,
        b_ptr,
        y_ptr,
        ws_ptr,
        cnt_ptr,
        pid_n,
        rows,
        rmask,
        M,
        N,
        stride_ym,
        split_k,
        HAS_BIAS: tl.constexpr,
        SPLIT: tl.constexpr,
        BLOCK_M: tl.constexpr,
    ):
        """part [BLOCK_M, BLOCK_N] fp32 -> y (direct, or through the split-K workspace and ticket)."""
        offs_m = tl.arange(0, BLOCK_M)
        omask = (offs_m[:, None] < M) & rmask[None, :]
        y_ptrs = y_ptr + offs_m[:, None] * stride_ym + rows[None, :]
        if SPLIT:
            ws_ptrs = ws_ptr + offs_m[:, None] * N + rows[None, :]
            tl.atomic_add(ws_ptrs, part, mask=omask, sem="relaxed")
            tl.debug_barrier()  # every thread's add is issued before the ticket (release, cumulative)
            ticket = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
            if ticket == split_k - 1:  # last slice of this row tile: read back (L2) and re-zero the sums
                tot = tl.load(ws_ptrs, mask=omask, other=0.0, cache_modifier=".cg")
                tl.debug_barrier()  # the load and the re-zeroing store may use different thread layouts
                tl.store(ws_ptrs, tl.zeros_like(part), mask=omask)
                tl.store(cnt_ptr + pid_n, 0)
                if HAS_BIAS:
                    tot += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)[None, :]
                tl.store(y_ptrs, tot.to(y_ptr.dtype.element_ty), mask=omask)
        else:
            if HAS_BIAS:
                part += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptrs, part.to(y_ptr.dtype.element_ty), mask=omask)

    @triton.jit
    def _gemv_v2_kernel(
        x_ptr,
        w_ptr,
        b_ptr,
        y_ptr,
        ws_ptr,
        cnt_ptr,
        M,
        N,
        K,
        stride_xm,
        stride_w,
        stride_ym,
        n_tiles,
        split_k,
        k_per_split,
        n_prog,
        HAS_BIAS: tl.constexpr,
        EVEN_K: tl.constexpr,
        EVEN_N: tl.constexpr,
        SPLIT: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PREFETCH: tl.constexpr,
        STAGES: tl.constexpr,
        USE_PDL: tl.constexpr,
        EVICT: tl.constexpr,
        L2PF: tl.constexpr,
        TRIG_LATE: tl.constexpr,
    ):
        """y[M, N] = x[M, K] @ W[N, K]^T (+ b); tiles t = pid, pid + nprog, ... (a persistent grid when
        n_prog < n_tiles * split_k); tile t covers rows (t % n_tiles) and K slice (t // n_tiles)."""
        if USE_PDL:
            if not TRIG_LATE:
                gdc_launch_dependents()
        for t in range(tl.program_id(0), n_tiles * split_k, n_prog):
            pid_n = t % n_tiles
            pid_k = t // n_tiles
            rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            rmask = rows < N
            w_rows = w_ptr + rows[:, None].to(tl.int64) * stride_w
            k_lo = pid_k * k_per_split
            k_hi = tl.minimum(k_lo + k_per_split, K)
            if BLOCK_M == 1:
                acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
            else:
                acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            if PREFETCH:
                cols = k_lo + tl.arange(0, BLOCK_K)
                w = _ld_w(w_rows, cols, rmask, k_hi, EVEN_K, EVEN_N, EVICT)  # weights: before the wait
                if USE_PDL:
                    if L2PF > 0:
                        _l2_prefetch(w_rows, k_lo, k_hi, L2PF)
                    gdc_wait()
                for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
                    cols_nx = k0 + tl.arange(0, BLOCK_K)
                    w_nx = _ld_w(w_rows, cols_nx, rmask, k_hi, EVEN_K, EVEN_N, EVICT)
                    x = _ld_x(x_ptr, stride_xm, M, cols, k_hi, EVEN_K, BLOCK_M)
                    acc = _fma(acc, w, x, BLOCK_M)
                    w = w_nx
                    cols = cols_nx
                x = _ld_x(x_ptr, stride_xm, M, cols, k_hi, EVEN_K, BLOCK_M)
                acc = _fma(acc, w, x, BLOCK_M)
            else:
                if USE_PDL:
                    if L2PF > 0:
                        _l2_prefetch(w_rows, k_lo, k_hi, L2PF)
                    gdc_wait()
                for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
                    cols = k0 + tl.arange(0, BLOCK_K)
                    w = _ld_w(w_rows, cols, rmask, k_hi, EVEN_K, EVEN_N, EVICT)
                    x = _ld_x(x_ptr, stride_xm, M, cols, k_hi, EVEN_K, BLOCK_M)
                    acc = _fma(acc, w, x, BLOCK_M)
            if USE_PDL:
                if TRIG_LATE:  # dependents may launch once every program is past its weight stream
                    gdc_launch_dependents()
            if BLOCK_M == 1:
                part = tl.sum(acc, 1)[None, :]
            else:
                part = acc
            _epilogue(
                part,
                b_ptr,
                y_ptr,
                ws_ptr,
                cnt_ptr,
                pid_n,
                rows,
                rmask,
                M,
                N,
                stride_ym,
                split_k,
                HAS_BIAS,
                SPLIT,
                BLOCK_M,
            )

    @triton.jit
    def _gemv_tc_kernel(
        x_ptr,
        w_ptr,
        b_ptr,
        y_ptr,
        ws_ptr,
        cnt_ptr,
        M,
        N,
        K,
        stride_xm,
        stride_w,
        stride_ym,
        split_k,
        k_per_split,
        HAS_BIAS: tl.constexpr,
        EVEN_K: tl.constexpr,
        EVEN_N: tl.constexpr,
        SPLIT: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        STAGES: tl.constexpr,
        USE_PDL: tl.constexpr,
        EVICT: tl.constexpr,
        L2PF: tl.constexpr,
        TRIG_LATE: tl.constexpr,
    ):
        """Swap-AB tensor-core GEMV: acc[BLOCK_N, BLOCK_M] += W_tile @ x_tile^T, x zero-padded to BLOCK_M."""
        if USE_PDL:
            if not TRIG_LATE:
                gdc_launch_dependents()
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < N
        w_rows = w_ptr + rows[:, None].to(tl.int64) * stride_w
        k_lo = pid_k * k_per_split
        k_hi = tl.minimum(k_lo + k_per_split, K)
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        k_first = k_lo
        if USE_PDL:  # peel the first tile so its weights stream in before the wait
            cols = k_lo + tl.arange(0, BLOCK_K)
            w = _ld_w(w_rows, cols, rmask, k_hi, EVEN_K, EVEN_N, EVICT)
            if L2PF > 0:
                _l2_prefetch(w_rows, k_lo + BLOCK_K, k_hi, L2PF)
            gdc_wait()
            x = _ld_x(x_ptr, stride_xm, M, cols, k_hi, EVEN_K, BLOCK_M)
            acc = tl.dot(w, tl.trans(x), acc)
            k_first = k_lo + BLOCK_K
        for k0 in tl.range(k_first, k_hi, BLOCK_K, num_stages=STAGES):
            cols = k0 + tl.arange(0, BLOCK_K)
            w = _ld_w(w_rows, cols, rmask, k_hi, EVEN_K, EVEN_N, EVICT)
            x = _ld_x(x_ptr, stride_xm, M, cols, k_hi, EVEN_K, BLOCK_M)
            acc = tl.dot(w, tl.trans(x), acc)
        if USE_PDL:
            if TRIG_LATE:
                gdc_launch_dependents()
        _epilogue(
            tl.trans(acc),
            b_ptr,
            y_ptr,
            ws_ptr,
            cnt_ptr,
            pid_n,
            rows,
            rmask,
            M,
            N,
            stride_ym,
            split_k,
            HAS_BIAS,
            SPLIT,
            BLOCK_M,
        )

    # --- small kernels of the chain, PDL-capable (same math as server.engine.ops.cuda_ops, one row) ---------

    @triton.jit
    def _rms_norm_pdl_kernel(
        x_ptr,
        res_ptr,
        w_ptr,
        out_ptr,
        n_cols,
        eps,
        HAS_RESIDUAL: tl.constexpr,
        BLOCK: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        if USE_PDL:
            gdc_launch_dependents()
        offs = tl.arange(0, BLOCK)
        mask = offs < n_cols
        wv = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if USE_PDL:
            gdc_wait()
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + offs, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(r.dtype)
            tl.store(res_ptr + offs, x, mask=mask)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, 0) / n_cols
        y = (xf * tl.rsqrt(var + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + offs, (wv * y).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_mul_pdl_kernel(gu_ptr, out_ptr, n_cols, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
        if USE_PDL:
            gdc_launch_dependents()
            gdc_wait()
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n_cols
        g = tl.load(gu_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + n_cols + offs, mask=mask, other=0.0).to(tl.float32)
        dt = out_ptr.dtype.element_ty
        sg = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        tl.store(out_ptr + offs, (sg * u).to(dt), mask=mask)

    @triton.jit
    def _copy_pdl_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
        if USE_PDL:
            gdc_launch_dependents()
            gdc_wait()
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


# ----------------------------------------------------------------------------------------------------------
# host wrappers
# ----------------------------------------------------------------------------------------------------------


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


_WS: dict[tuple[str, int, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _workspace(device: torch.device, numel: int, n_tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-K workspace (fp32 sums) and tickets; zero once, kept zero by the kernels themselves."""
    key = (str(device), numel, n_tiles)
    if key not in _WS:
        _WS[key] = (
            torch.zeros(numel, dtype=torch.float32, device=device),
            torch.zeros(n_tiles, dtype=torch.int32, device=device),
        )
    return _WS[key]


def _split(K: int, bk: int, split_req: int) -> tuple[int, int]:
    """(K columns per split-K program, programs per row tile)."""
    k_per = _cdiv(_cdiv(K, max(1, split_req)), bk) * bk
    return k_per, _cdiv(K, k_per)


@overload
def v2_launch(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    cfg: KernelCfg,
    pdl: bool = ...,
    warmup: Literal[False] = ...,
) -> torch.Tensor: ...
@overload
def v2_launch(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, cfg: KernelCfg, pdl: bool = ..., *, warmup: Literal[True]
) -> None: ...
def v2_launch(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, cfg: KernelCfg, pdl: bool = False, warmup: bool = False
) -> torch.Tensor | None:
    """y = x @ w.T (+ b) through the v2 kernel; with ``warmup`` only compiled (Triton's warmup), nothing run."""
    M, K = x.shape
    N = w.shape[0]
    bn, bk = cfg["bn"], cfg["bk"]
    bm = 1 if M == 1 else _next_pow2(M)
    assert bm <= 8, "v2 serves M <= 8"
    k_per, split = _split(K, bk, cfg.get("split", 1))
    n_tiles = _cdiv(N, bn)
    total = n_tiles * split
    persist = cfg.get("persist", 0)
    grid = (min(total, persist * NUM_SMS) if persist else total,)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    ws, cnt = _workspace(x.device, M * N, n_tiles) if split > 1 else (y, y)
    args = (
        x,
        w,
        b if b is not None else y,
        y,
        ws,
        cnt,
        M,
        N,
        K,
        x.stride(0),
        w.stride(0),
        y.stride(0),
        n_tiles,
        split,
        k_per,
        grid[0],
    )
    ns = cfg.get("ns", 1)
    kw = dict(
        HAS_BIAS=b is not None,
        EVEN_K=K % bk == 0,
        EVEN_N=N % bn == 0,
        SPLIT=split > 1,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        PREFETCH=bool(cfg.get("pf", 1)),
        STAGES=ns,
        USE_PDL=bool(pdl),
        EVICT=cfg.get("evict", "evict_first"),
        L2PF=cfg.get("l2pf", 0) if pdl else 0,
        TRIG_LATE=bool(pdl) and cfg.get("trig") == "late",
        num_warps=cfg["nw"],
        num_stages=ns,
    )
    if pdl:
        kw["launch_pdl"] = True
    if warmup:
        _gemv_v2_kernel.warmup(*args, grid=grid, **kw)
        return None
    _gemv_v2_kernel[grid](*args, **kw)
    return y


@overload
def tc_launch(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    cfg: KernelCfg,
    pdl: bool = ...,
    warmup: Literal[False] = ...,
) -> torch.Tensor: ...
@overload
def tc_launch(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, cfg: KernelCfg, pdl: bool = ..., *, warmup: Literal[True]
) -> None: ...
def tc_launch(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, cfg: KernelCfg, pdl: bool = False, warmup: bool = False
) -> torch.Tensor | None:
    """y = x @ w.T (+ b) through the tensor-core kernel; with ``warmup`` only compiled, nothing run."""
    M, K = x.shape
    N = w.shape[0]
    bn, bk = cfg["bn"], cfg["bk"]
    bm = 16 if M <= 16 else _next_pow2(M)
    k_per, split = _split(K, bk, cfg.get("split", 1))
    n_tiles = _cdiv(N, bn)
    grid = (n_tiles, split)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    ws, cnt = _workspace(x.device, M * N, n_tiles) if split > 1 else (y, y)
    args = (x, w, b if b is not None else y, y, ws, cnt, M, N, K, x.stride(0), w.stride(0), y.stride(0), split, k_per)
    ns = cfg.get("ns", 3)
    kw = dict(
        HAS_BIAS=b is not None,
        EVEN_K=K % bk == 0,
        EVEN_N=N % bn == 0,
        SPLIT=split > 1,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        STAGES=ns,
        USE_PDL=bool(pdl),
        EVICT=cfg.get("evict", "evict_first"),
        L2PF=cfg.get("l2pf", 0) if pdl else 0,
        TRIG_LATE=bool(pdl) and cfg.get("trig") == "late",
        num_warps=cfg["nw"],
        num_stages=ns,
    )
    if pdl:
        kw["launch_pdl"] = True
    if warmup:
        _gemv_tc_kernel.warmup(*args, grid=grid, **kw)
        return None
    _gemv_tc_kernel[grid](*args, **kw)
    return y


@overload
def legacy_launch(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, cfg: tuple[int, ...], warmup: Literal[False] = ...
) -> torch.Tensor: ...
@overload
def legacy_launch(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, cfg: tuple[int, ...], *, warmup: Literal[True]
) -> None: ...
def legacy_launch(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, cfg: tuple[int, ...], warmup: bool = False
) -> torch.Tensor | None:
    """The engine's ``cuda_ops.gemv`` with one ``GEMV_CANDIDATES`` entry; with ``warmup`` only compiled."""
    from distserve.server.engine.ops import cuda_ops

    if not warmup:
        return cuda_ops.gemv(x, w, b, tuple(cfg))
    n, k = w.shape
    bn, bk, nw = cfg[:3]
    stages = cfg[3] if len(cfg) > 3 else 1
    extra = {"STAGES": stages, "EVEN_N": n % bn == 0, "num_stages": stages} if stages > 1 else {}
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    cuda_ops._gemv_kernel.warmup(
        x,
        w,
        b if b is not None else y,
        y,
        n,
        k,
        w.stride(0),
        HAS_BIAS=b is not None,
        EVEN_K=k % bk == 0,
        BLOCK_N=bn,
        BLOCK_K=bk,
        num_warps=nw,
        grid=(_cdiv(n, bn),),
        **extra,
    )
    return None


class Variant:
    """One GEMV implementation + config. ``kind``: cublas | legacy | v2 | tc."""

    def __init__(self, kind: str, cfg: KernelCfg | tuple[int, ...] | None = None, name: str | None = None) -> None:
        self.kind, self.cfg = kind, cfg
        self.max_m = {"cublas": 1 << 30, "legacy": 1, "v2": 8, "tc": 16}[kind]
        self.pdl_ok = kind in ("v2", "tc")
        self.name = name or self._name()

    @property
    def kernel_cfg(self) -> KernelCfg:
        """The config of a v2 / tc variant."""
        c = self.cfg
        if c is None or isinstance(c, tuple):
            raise TypeError(f"a {self.kind} variant has no v2/tc config")
        return c

    @property
    def legacy_cfg(self) -> tuple[int, ...]:
        """The ``GEMV_CANDIDATES`` entry of a legacy variant."""
        if not isinstance(self.cfg, tuple):
            raise TypeError(f"a {self.kind} variant has no GEMV_CANDIDATES entry")
        return self.cfg

    def _name(self) -> str:
        if self.kind == "cublas":
            return "cublas"
        if self.kind == "legacy":
            lc = self.legacy_cfg
            return "legacy_bn{}_bk{}_w{}".format(*lc[:3]) + (f"_ns{lc[3]}" if len(lc) > 3 and lc[3] > 1 else "")
        c = self.kernel_cfg
        s = f"{self.kind}_bn{c['bn']}_bk{c['bk']}_w{c['nw']}"
        if self.kind == "v2":
            s += "_pf" if c.get("pf", 1) else ""
        if c.get("ns", 1 if self.kind == "v2" else 3) > 1:
            s += f"_ns{c['ns']}"
        if c.get("split", 1) > 1:
            s += f"_sk{c['split']}"
        if c.get("persist", 0):
            s += f"_p{c['persist']}"
        if c.get("evict", "evict_first") != "evict_first":
            s += "_evnone"
        return s

    def __call__(
        self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, pdl: bool = False
    ) -> torch.Tensor:
        if self.kind == "cublas":
            return F.linear(x, w, b)
        if self.kind == "legacy":
            return legacy_launch(x, w, b, self.legacy_cfg)
        if self.kind == "v2":
            return v2_launch(x, w, b, self.kernel_cfg, pdl=pdl)
        return tc_launch(x, w, b, self.kernel_cfg, pdl=pdl)

    def warmup(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, pdl: bool = False) -> None:
        if self.kind == "legacy":
            legacy_launch(x, w, b, self.legacy_cfg, warmup=True)
        elif self.kind == "v2":
            v2_launch(x, w, b, self.kernel_cfg, pdl=pdl, warmup=True)
        elif self.kind == "tc":
            tc_launch(x, w, b, self.kernel_cfg, pdl=pdl, warmup=True)

    def applies(self, M: int) -> bool:
        return M <= self.max_m


def build_variants(quick: bool) -> tuple[list[Variant], list[Variant]]:
    """M=1 variants and the (few) batched ones."""
    from distserve.server.engine.ops.cuda_ops import GEMV_CANDIDATES

    vs = [Variant("cublas")]
    vs += [Variant("legacy", tuple(c)) for c in (GEMV_CANDIDATES[:3] if quick else GEMV_CANDIDATES)]
    v2: list[KernelCfg] = [  # register-prefetch, evict_first
        dict(bn=1, bk=2048, nw=4),
        dict(bn=2, bk=1024, nw=4),
        dict(bn=4, bk=512, nw=4),
        dict(bn=4, bk=1024, nw=4),
        dict(bn=4, bk=1024, nw=8),
        dict(bn=8, bk=512, nw=4),
        dict(bn=8, bk=512, nw=8),
        dict(bn=16, bk=256, nw=4),
        # whole row per step, no prefetch (all loads of a program issued at once)
        dict(bn=1, bk=4096, nw=4, pf=0),
        # software pipelined through shared memory (cp.async)
        dict(bn=4, bk=512, nw=4, pf=0, ns=3),
        dict(bn=8, bk=256, nw=4, pf=0, ns=4),
        dict(bn=2, bk=1024, nw=4, pf=0, ns=3),
        dict(bn=4, bk=512, nw=4, pf=0, ns=4),
        dict(bn=4, bk=256, nw=4, pf=0, ns=4),
        dict(bn=8, bk=512, nw=8, pf=0, ns=3),
        dict(bn=2, bk=512, nw=4, pf=0, ns=4),
        dict(bn=4, bk=512, nw=4, pf=0, ns=3, split=2),
        dict(bn=4, bk=512, nw=4, pf=0, ns=3, persist=4),
        dict(bn=16, bk=256, nw=4, pf=0, ns=3),
        dict(bn=8, bk=512, nw=4, pf=0, ns=3),
        dict(bn=8, bk=256, nw=4, pf=0, ns=3),
        dict(bn=4, bk=512, nw=4, pf=0, ns=5),
        dict(bn=4, bk=256, nw=4, pf=0, ns=6),
        dict(bn=16, bk=512, nw=8, pf=0, ns=3),
        dict(bn=8, bk=256, nw=2, pf=0, ns=4),
        dict(bn=4, bk=512, nw=4, pf=0, ns=3, evict=""),
        # split-K (fp32 atomics + ticket)
        dict(bn=4, bk=1024, nw=4, split=2),
        dict(bn=8, bk=512, nw=4, split=4),
        # persistent (one wave of persist * SMs programs)
        dict(bn=4, bk=1024, nw=4, persist=4),
        dict(bn=8, bk=512, nw=4, persist=8),
        dict(bn=4, bk=512, nw=4, persist=8),
        # evict_first off (to see what the hint buys)
        dict(bn=4, bk=1024, nw=4, evict=""),
    ]
    tc: list[KernelCfg] = [
        dict(bn=64, bk=128, nw=4, ns=4),
        dict(bn=64, bk=128, nw=4, ns=4, split=2),
        dict(bn=64, bk=128, nw=4, ns=4, split=4),
        dict(bn=64, bk=128, nw=4, ns=4, split=8),
        dict(bn=64, bk=256, nw=4, ns=3),
        dict(bn=64, bk=256, nw=4, ns=3, split=4),
        dict(bn=128, bk=128, nw=8, ns=4),
        dict(bn=128, bk=128, nw=8, ns=4, split=4),
        dict(bn=32, bk=256, nw=4, ns=4),
        dict(bn=32, bk=256, nw=4, ns=4, split=4),
        dict(bn=16, bk=512, nw=4, ns=3, split=2),
        dict(bn=64, bk=128, nw=4, ns=6),
        dict(bn=64, bk=128, nw=4, ns=6, split=2),
        dict(bn=64, bk=64, nw=4, ns=8),
    ]
    if quick:
        v2 = [
            dict(bn=4, bk=1024, nw=4),
            dict(bn=8, bk=512, nw=4),
            dict(bn=4, bk=512, nw=4, pf=0, ns=3),
            dict(bn=4, bk=512, nw=4, pf=0, ns=4),
            dict(bn=4, bk=1024, nw=4, split=4),
            dict(bn=4, bk=1024, nw=4, persist=4),
        ]
        tc = [
            dict(bn=64, bk=128, nw=4, ns=4),
            dict(bn=64, bk=128, nw=4, ns=4, split=4),
            dict(bn=64, bk=256, nw=4, ns=3),
            dict(bn=32, bk=256, nw=4, ns=4, split=4),
        ]
    vs += [Variant("v2", c) for c in v2] + [Variant("tc", c) for c in tc]
    # batched (M = 2..8): cuBLAS, v2 with small tiles (products [M, BN, BK] per step), tc (one compile for M<=16)
    vb = [Variant("cublas"), Variant("v2", dict(bn=2, bk=512, nw=4)), Variant("v2", dict(bn=4, bk=256, nw=4))]
    vb += [Variant("tc", c) for c in (tc[:3] if quick else [tc[0], tc[1], tc[2], tc[4], tc[6], tc[9]])]
    return vs, vb


# ----------------------------------------------------------------------------------------------------------
# measurement helpers
# ----------------------------------------------------------------------------------------------------------


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    y = y.float()
    if not torch.isfinite(y).all():
        return float("inf")
    return ((y - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def checked_call(v: Variant, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """v(x, w, b) with the allocator's free block of the output's size poisoned with NaN first, so a
    kernel that leaves part of its output unwritten cannot pass on a stale correct result."""
    n = w.shape[0]
    torch.full((x.shape[0], n), float("nan"), dtype=x.dtype, device=x.device)  # freed at once, then reused
    y = v(x, w, b)
    torch.cuda.synchronize()
    return y


def short_err(e: BaseException) -> str:
    s = f"{type(e).__name__}: {e}"
    s = " ".join(s.split())
    return s[:400]


class Timer:
    def __init__(self, device: torch.device, flush_mb: int = 256) -> None:
        self.flush_buf = torch.empty(flush_mb * 2**20 // 4, dtype=torch.int32, device=device)

    def graph(self, fn: Callable[[int], object], n_inner: int, reps: int, flush: bool = True) -> tuple[float, float]:
        """Capture fn(0..n_inner-1) in one CUDA graph; median / min microseconds per inner call."""
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for i in range(n_inner):  # warm-up: compiles, loads modules, allocates workspaces
                fn(i)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(n_inner):
                fn(i)
        g.replay()
        g.replay()
        torch.cuda.synchronize()
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for a, b in ev:
            if flush:
                self.flush_buf.zero_()
            a.record()
            g.replay()
            b.record()
        torch.cuda.synchronize()
        ts = sorted(a.elapsed_time(b) * 1e3 / n_inner for a, b in ev)
        del g
        return statistics.median(ts), ts[0]


def precompile(
    items: Sequence[tuple[Variant, torch.Tensor, torch.Tensor, torch.Tensor | None, bool]], threads: int
) -> tuple[float, dict[str, str]]:
    """Compile (variant, x, w, b, pdl) combos in parallel threads (Triton's AsyncCompileMode)."""
    from concurrent.futures import ThreadPoolExecutor

    t0 = time.time()
    errs: dict[str, str] = {}
    if threads <= 1 or not hasattr(triton, "AsyncCompileMode"):
        return 0.0, errs
    try:
        with ThreadPoolExecutor(threads) as ex, triton.AsyncCompileMode(ex, ignore_errors=True):
            for v, x, w, b, pdl in items:
                try:
                    v.warmup(x, w, b, pdl=pdl)
                except Exception as e:  # recorded by the real call later
                    errs[v.name] = short_err(e)
    except Exception as e:
        errs["_async"] = short_err(e)
    return time.time() - t0, errs


# ----------------------------------------------------------------------------------------------------------
# the study
# ----------------------------------------------------------------------------------------------------------


def check_odd(
    variants_m1: list[Variant], variants_b: list[Variant], dev: torch.device, res: dict[str, Any]
) -> set[str]:
    """Odd shape 1000x4096 + bias (M=1), and M=3 for the batched kinds."""
    g = torch.Generator(device=dev).manual_seed(7)
    n, k = 1000, 4096
    w = (0.02 * torch.randn(n, k, generator=g, device=dev)).bfloat16()
    b = torch.randn(n, generator=g, device=dev).bfloat16()
    out: dict[str, dict[str, Any]] = {}
    for m, vs in ((1, variants_m1), (3, variants_b)):
        x = torch.randn(m, k, generator=g, device=dev).bfloat16()
        ref = F.linear(x.float(), w.float(), b.float())
        for v in vs:
            if not v.applies(m):
                continue
            key = f"{v.name}@M{m}"
            try:
                e = max(rel_err(checked_call(v, x, w, b), ref) for _ in range(2))
                out[key] = {"rel": e, "ok": bool(e < 1e-2)}
            except Exception as ex:
                out[key] = {"ok": False, "error": short_err(ex)}
    res["odd_shape"] = {"shape": [n, k], "bias": True, "results": out}
    return {k for k, r in out.items() if r.get("ok")}


def study_shape(
    name: str,
    n: int,
    k: int,
    variants_m1: list[Variant],
    variants_b: list[Variant],
    ms: list[int],
    timer: Timer,
    args: argparse.Namespace,
    res: dict[str, Any],
    deadline: float,
    odd_ok: set[str],
) -> None:
    dev = torch.device("cuda")
    nbytes = n * k * 2
    ncopies = max(2, math.ceil(4 * L2_BYTES / nbytes))
    ent: dict[str, Any] = {"N": n, "K": k, "weight_bytes": nbytes, "copies": ncopies, "M": {}}
    res["shapes"][name] = ent
    W = torch.empty(ncopies, n, k, dtype=torch.bfloat16, device=dev).uniform_(-0.03, 0.03)
    g = torch.Generator(device=dev).manual_seed(n + k)
    reps = 7 if args.quick else 15
    inner = 20
    for m in [1] + ms:
        vs = variants_m1 if m == 1 else variants_b
        x = torch.randn(m, k, generator=g, device=dev).bfloat16()
        ref = F.linear(x.float(), W[0].float())
        tc_s, cerr = precompile(
            [(v, x, W[0], None, False) for v in vs if v.applies(m) and v.kind != "cublas"], args.compile_threads
        )
        rows: dict[str, dict[str, Any]] = {}
        ent["M"][str(m)] = {"results": rows, "precompile_s": round(tc_s, 2)}
        for v in vs:
            if not v.applies(m):
                continue
            r = rows[v.name] = {}
            if time.time() > deadline:
                r["error"] = "skipped: time budget"
                continue
            try:
                e = rel_err(checked_call(v, x, W[0]), ref)
                r["rel"] = e
                if not e < 1e-2:
                    r["error"] = f"wrong result: rel {e:.3g}"
                    continue
                if v.kind != "cublas" and f"{v.name}@M{1 if m == 1 else 3}" not in odd_ok:
                    r["odd_shape_failed"] = True
                med, mn = timer.graph(lambda i: v(x, W[i % ncopies]), inner, reps)
                r.update(us=round(med, 2), us_min=round(mn, 2), GBps=round(nbytes / (med * 1e-6) / 1e9, 1))
                e2 = rel_err(checked_call(v, x, W[0]), ref)  # after ~20 x reps launches (split-K state still clean)
                if not e2 < 1e-2:
                    r["error"] = f"wrong result after timing: rel {e2:.3g}"
                    r.pop("us")
            except Exception as ex:
                r["error"] = short_err(ex)
                if v.name in cerr:
                    r["compile_error"] = cerr[v.name]
        ok = {vn: r for vn, r in rows.items() if "us" in r and not r.get("odd_shape_failed")}
        if ok:
            best = min(ok, key=lambda vn: ok[vn]["us"])
            tri = {vn: r for vn, r in ok.items() if vn != "cublas"}
            bt = min(tri, key=lambda vn: tri[vn]["us"]) if tri else None
            ent["M"][str(m)]["best"] = best
            ent["M"][str(m)]["best_triton"] = bt
            pd = {vn: r for vn, r in tri.items() if vn.startswith(("v2_", "tc_"))}
            ent["M"][str(m)]["best_pdl_capable"] = min(pd, key=lambda vn: pd[vn]["us"]) if pd else None
        torch.cuda.synchronize()
    # free the copies before empty_cache (closures above are done with them; `del` would leave them unbound)
    W = None  # type: ignore[assignment]
    torch.cuda.empty_cache()


def copy_bandwidth(dev: torch.device) -> float:
    a = torch.empty(2**30 // 2, dtype=torch.bfloat16, device=dev).fill_(1)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(10):
        b.copy_(a)
    e1.record()
    torch.cuda.synchronize()
    t = e0.elapsed_time(e1) / 10 * 1e-3
    del a, b
    return 2 * 2**30 / t / 1e12  # TB/s, read + write


def run_chain(
    res: dict[str, Any], variants_by_name: dict[str, Variant], timer: Timer, args: argparse.Namespace
) -> None:
    from distserve.server.engine.ops import cuda_ops

    dev = torch.device("cuda")
    L = args.layers
    H, I = HIDDEN, INTER
    eps = 1e-5
    t0 = time.time()
    Wqkv = torch.empty(L, 3 * H, H, dtype=torch.bfloat16, device=dev).uniform_(-0.02, 0.02)
    Wo = torch.empty(L, H, H, dtype=torch.bfloat16, device=dev).uniform_(-0.02, 0.02)
    Wgu = torch.empty(L, 2 * I, H, dtype=torch.bfloat16, device=dev).uniform_(-0.02, 0.02)
    Wd = torch.empty(L, H, I, dtype=torch.bfloat16, device=dev).uniform_(-0.02, 0.02)
    ln = torch.empty(L, 2, H, dtype=torch.bfloat16, device=dev).uniform_(0.8, 1.2)
    x0 = torch.randn(1, H, device=dev).bfloat16()
    res_buf = torch.zeros(1, H, dtype=torch.bfloat16, device=dev)
    wbytes = sum(t.numel() * 2 for t in (Wqkv, Wo, Wgu, Wd))
    ch = res["chain"] = {
        "layers": L,
        "weight_bytes": wbytes,
        "alloc_s": round(time.time() - t0, 2),
        "floor_ms_at_4.16TBps": round(wbytes / READ_BW * 1e3, 3),
        "runs": {},
    }

    def rms_ops(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return cuda_ops.rms_norm(x, w, eps, residual=residual)

    def silu_ops(gu: torch.Tensor) -> torch.Tensor:
        return cuda_ops.silu_mul(gu)

    def copy_ops(qkv: torch.Tensor) -> torch.Tensor:
        a = torch.empty(1, H, dtype=qkv.dtype, device=qkv.device)
        a.copy_(qkv[:, :H])
        return a

    def small_local(pdl: bool) -> Smalls:
        kw = {"launch_pdl": True} if pdl else {}

        def rms(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
            out = torch.empty_like(x)
            _rms_norm_pdl_kernel[(1,)](
                x, residual, w, out, H, eps, HAS_RESIDUAL=True, BLOCK=H, USE_PDL=pdl, num_warps=8, **kw
            )
            return out

        def silu(gu: torch.Tensor) -> torch.Tensor:
            out = torch.empty(1, I, dtype=gu.dtype, device=gu.device)
            _silu_mul_pdl_kernel[(_cdiv(I, 1024),)](gu, out, I, BLOCK=1024, USE_PDL=pdl, num_warps=4, **kw)
            return out

        def copy(qkv: torch.Tensor) -> torch.Tensor:
            a = torch.empty(1, H, dtype=qkv.dtype, device=qkv.device)
            _copy_pdl_kernel[(_cdiv(H, 1024),)](qkv, a, H, BLOCK=1024, USE_PDL=pdl, num_warps=4, **kw)
            return a

        return rms, silu, copy

    def make_chain(
        gem: dict[str, Variant], smalls: Smalls, pdl: bool, gemv_on: bool = True
    ) -> Callable[[], torch.Tensor]:
        rms, silu, copy = smalls

        def chain() -> torch.Tensor:
            x = x0
            for l in range(L):
                h = rms(x, ln[l, 0], res_buf)
                qkv = gem["qkv"](h, Wqkv[l], None, pdl) if gemv_on else torch.empty(1, 3 * H, dtype=h.dtype, device=dev)
                a = copy(qkv)
                o = gem["o_proj"](a, Wo[l], None, pdl) if gemv_on else a
                h2 = rms(o, ln[l, 1], res_buf)
                gu = (
                    gem["gate_up"](h2, Wgu[l], None, pdl)
                    if gemv_on
                    else torch.empty(1, 2 * I, dtype=h.dtype, device=dev)
                )
                s = silu(gu)
                x = gem["down"](s, Wd[l], None, pdl) if gemv_on else s[:, :H].contiguous()
            return x

        return chain

    captured: dict[str, torch.cuda.CUDAGraph] = {}

    def time_chain(label: str, chain: Callable[[], torch.Tensor], desc: dict[str, str] | str) -> torch.Tensor | None:
        """Eager run (numeric check, warm-up), then capture; timing happens interleaved below."""
        r: dict[str, Any] = {"gemv": desc}
        ch["runs"][label] = r
        try:
            res_buf.zero_()
            y = chain().float()
            torch.cuda.synchronize()
            r["out_finite"] = bool(torch.isfinite(y).all())
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                chain()
            torch.cuda.current_stream().wait_stream(s)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                chain()
            g.replay()
            torch.cuda.synchronize()
            captured[label] = g
            return y
        except Exception as ex:
            r["error"] = short_err(ex)
            r["trace"] = traceback.format_exc()[-1500:]
            return None

    def resolve(names: dict[str, str]) -> dict[str, Variant]:
        return {s: variants_by_name[n] for s, n in names.items()}

    def with_cfg(names: dict[str, str], **extra: Unpack[KernelCfg]) -> dict[str, Variant]:
        return {
            s: Variant(variants_by_name[n].kind, {**variants_by_name[n].kernel_cfg, **extra}) for s, n in names.items()
        }

    shapes = ("qkv", "o_proj", "gate_up", "down")
    ks = {"qkv": HIDDEN, "o_proj": HIDDEN, "gate_up": HIDDEN, "down": INTER}
    ops_smalls = (rms_ops, silu_ops, copy_ops)
    cub = {s: "cublas" for s in shapes}
    m1 = {s: res["shapes"].get(s, {}).get("M", {}).get("1", {}) for s in shapes}
    best_tri = {s: m1[s].get("best_triton") for s in shapes}
    best_any = {s: m1[s].get("best") for s in shapes}
    best_pdl = {s: m1[s].get("best_pdl_capable") for s in shapes}
    best_leg: dict[str, str | None] = {}
    for s in shapes:
        leg = {
            vn: r["us"]
            for vn, r in m1[s].get("results", {}).items()
            if vn.startswith("legacy") and "us" in r and not r.get("odd_shape_failed")
        }
        best_leg[s] = min(leg, key=lambda vn: leg[vn]) if leg else None
    # a fixed set (the H200 winners of an earlier run), so that PDL on/off compare the same kernels every run
    fixed = {
        "qkv": "v2_bn16_bk256_w4_ns3",
        "o_proj": "v2_bn4_bk512_w4_ns3",
        "gate_up": "v2_bn16_bk256_w4_ns3",
        "down": "v2_bn8_bk512_w4_ns3",
    }

    y_ref = time_chain("cublas", make_chain(resolve(cub), ops_smalls, False), cub)
    time_chain("small_kernels_only", make_chain(resolve(cub), ops_smalls, False, gemv_on=False), "none")
    outs: dict[str, torch.Tensor | None] = {}
    if all(best_tri.values()):
        outs["triton_best"] = time_chain("triton_best", make_chain(resolve(best_tri), ops_smalls, False), best_tri)
    if all(best_any.values()) and best_any != best_tri and best_any != cub:
        outs["best_any"] = time_chain("best_any", make_chain(resolve(best_any), ops_smalls, False), best_any)
    if all(best_leg.values()) and best_leg != best_tri:
        leg_names = {s: n for s, n in best_leg.items() if n}  # every shape's (checked above)
        outs["legacy_best"] = time_chain("legacy_best", make_chain(resolve(leg_names), ops_smalls, False), leg_names)
    pdl_sets = [("new", best_pdl)]
    if all(n in variants_by_name for n in fixed.values()) and fixed != best_pdl:
        pdl_sets.append(("fixed", fixed))
    for tag, names in pdl_sets:
        if not all(names.values()):
            continue
        y_np = outs[f"{tag}_nopdl"] = time_chain(
            f"{tag}_nopdl", make_chain(resolve(names), small_local(False), False), names
        )
        if not HAS_GDC:
            ch["runs"][f"{tag}_pdl"] = {"error": "triton.language.extra.cuda.gdc_* not available"}
            continue
        if args.no_pdl:
            continue
        runs: list[tuple[str, dict[str, Variant], dict[str, str]]] = [
            (f"{tag}_pdl", resolve(names), names),
            (f"{tag}_pdl_late", with_cfg(names, trig="late"), {s: n + "+trig_late" for s, n in names.items()}),
        ]
        if tag == "new":
            # + prefetch.global.L2 of up to 32 KB of each program's weights before gdc_wait()
            gem: dict[str, Variant] = {}
            desc: dict[str, str] = {}
            for s_, vn in names.items():
                v = variants_by_name[vn]
                vc = v.kernel_cfg
                k_per, _ = _split(ks[s_], vc["bk"], vc.get("split", 1))
                cap = max(1, 32 * 1024 // (vc["bn"] * 128))
                lines = max(1, min(_next_pow2(_cdiv(k_per, 64)), 1 << (cap.bit_length() - 1)))
                gem[s_] = Variant(v.kind, {**vc, "l2pf": lines})
                desc[s_] = f"{vn}+l2pf{lines}"
            runs.append((f"{tag}_pdl_l2pf32k", gem, desc))
        for lab, gem, desc in runs:
            y_p = outs[lab] = time_chain(lab, make_chain(gem, small_local(True), True), desc)
            if y_p is not None and y_np is not None:
                ch["runs"][lab]["rel_vs_nopdl"] = rel_err(y_p, y_np)
    if y_ref is not None:
        for k_, y in outs.items():
            if y is not None:
                ch["runs"][k_]["rel_vs_cublas"] = rel_err(y, y_ref)
    # timing: the captured graphs replayed round-robin (drift and clocks hit every variant alike)
    rounds, per = (3, 3) if args.quick else (5, 4)
    times: dict[str, list[float]] = {lab: [] for lab in captured}
    rmeds: dict[str, list[float]] = {lab: [] for lab in captured}
    for _ in range(rounds):
        for lab, g in captured.items():
            ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(per)]
            for a_, b_ in ev:
                a_.record()
                g.replay()
                b_.record()
            torch.cuda.synchronize()
            ts = [a_.elapsed_time(b_) for a_, b_ in ev]
            times[lab] += ts
            rmeds[lab].append(round(statistics.median(ts), 4))
    for lab, ts in times.items():
        med = statistics.median(ts) * 1e3  # us
        ch["runs"][lab].update(
            ms=round(med / 1e3, 4),
            ms_min=round(min(ts), 4),
            round_medians_ms=rmeds[lab],
            TBps=round(wbytes / (med * 1e-6) / 1e12, 3),
            us_per_layer=round(med / L, 2),
        )
    captured.clear()
    Wqkv = Wo = Wgu = Wd = None  # type: ignore[assignment]  # free 12.9 GB before empty_cache
    torch.cuda.empty_cache()


def summarize(res: dict[str, Any]) -> str:
    lines = [
        f"device {res.get('device')}  torch {res.get('torch')}  triton {res.get('triton')}  "
        f"copy {res.get('copy_TBps_rw')} TB/s (r+w)"
    ]
    for name, ent in res.get("shapes", {}).items():
        nb = ent["weight_bytes"]
        for m, me in ent["M"].items():
            rows = me["results"]
            ok = sorted(((r["us"], vn) for vn, r in rows.items() if "us" in r))
            if not ok:
                lines.append(f"{name:8s} M={m}: no timings")
                continue
            cub = rows.get("cublas", {}).get("us")
            leg = min((r["us"] for vn, r in rows.items() if vn.startswith("legacy") and "us" in r), default=None)
            top = ", ".join(f"{vn} {us:.1f}" for us, vn in ok[:4])
            floor = nb / READ_BW * 1e6
            nerr = sum(1 for r in rows.values() if "error" in r)
            lines.append(
                f"{name:8s} M={m}: floor {floor:.1f}us cublas {cub} legacy {leg} | best {top}"
                + (f" | {nerr} errors" if nerr else "")
            )
    ch = res.get("chain")
    if ch:
        lines.append(
            f"chain {ch['layers']} layers, {ch['weight_bytes'] / 1e9:.2f} GB, floor {ch['floor_ms_at_4.16TBps']} ms:"
        )
        for k, r in ch["runs"].items():
            if "ms" in r:
                extra = "".join(f" {kk}={r[kk]:.2e}" for kk in ("rel_vs_cublas", "rel_vs_nopdl") if kk in r)
                lines.append(
                    f"  {k:18s} {r['ms']:.3f} ms  {r['TBps']:.2f} TB/s  {r['us_per_layer']:.1f} us/layer{extra}"
                )
            else:
                lines.append(f"  {k:18s} ERROR {r.get('error')}")
    return "\n".join(lines)


def selftest() -> int:
    """Tiny shapes through the new kernels (CPU, TRITON_INTERPRET=1, or a GPU)."""
    global NUM_SMS
    if INTERPRET:  # numpy >= 2 refuses int() of the interpreter's 1-element program_id arrays in range()
        from triton.runtime import interpreter as _itp

        _orig = _itp._patch_lang_tensor

        def _patched(tensor: object, scope: Any) -> None:  # Triton's interpreter internals (untyped)
            _orig(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        _itp._patch_lang_tensor = _patched
    dev = "cuda" if (torch.cuda.is_available() and not INTERPRET) else "cpu"
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    NUM_SMS = 2 if dev == "cpu" else NUM_SMS
    g = torch.Generator().manual_seed(0)
    fails = 0
    cases: list[tuple[int, int, int, bool]] = []
    for n, k in ((37, 128), (64, 96), (48, 256)):
        for m in (1, 3):
            for bias in (False, True):
                cases.append((n, k, m, bias))
    v2cfgs: list[KernelCfg] = [
        dict(bn=4, bk=32, nw=4),
        dict(bn=4, bk=32, nw=4, pf=0, ns=2),
        dict(bn=8, bk=64, nw=4, split=3),
        dict(bn=4, bk=32, nw=4, persist=2),
        dict(bn=2, bk=32, nw=4, split=2, persist=1),
    ]
    tccfgs: list[KernelCfg] = [dict(bn=16, bk=32, nw=4, ns=2), dict(bn=16, bk=32, nw=4, ns=2, split=3)]
    for n, k, m, bias in cases:
        w = (0.05 * torch.randn(n, k, generator=g)).to(dt).to(dev)
        x = torch.randn(m, k, generator=g).to(dt).to(dev)
        b = torch.randn(n, generator=g).to(dt).to(dev) if bias else None
        ref = F.linear(x.float(), w.float(), b.float() if b is not None else None)  # b is None iff not bias
        for kind, cfgs in (("v2", v2cfgs), ("tc", tccfgs)):
            for c in cfgs:
                v = Variant(kind, c)
                for rep in range(2):  # second call: split-K workspace must have been re-zeroed
                    try:
                        e = rel_err(v(x, w, b), ref)
                    except Exception as ex:
                        e = float("nan")
                        print("ERROR", v.name, n, k, m, bias, short_err(ex))
                    if not e < 1e-2:
                        fails += 1
                        print(f"FAIL {v.name} n={n} k={k} m={m} bias={bias} rep={rep} rel={e}")
    print(f"selftest on {dev}: {len(cases)} cases, {fails} failures")
    return fails


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if torch is None:
        print("gemv_study: torch is not importable:", _TORCH_ERR)
        return 2
    if not HAS_TRITON:
        print("gemv_study: triton is not importable:", _TRITON_ERR)
        return 2
    if args.selftest:
        return 1 if selftest() else 0
    if not torch.cuda.is_available():
        print(
            "gemv_study: needs a CUDA device (none found); on CPU try "
            "`TRITON_INTERPRET=1 python3 -m bench.kernels.gemv_study --selftest`"
        )
        return 2
    global NUM_SMS, L2_BYTES
    t_start = time.time()
    budget = args.budget if args.budget is not None else (45.0 if args.quick else 170.0)
    chain_reserve = 0.0 if args.no_chain else (12.0 if args.quick else 20.0)
    deadline = t_start + budget - chain_reserve
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    NUM_SMS = props.multi_processor_count
    L2_BYTES = max(L2_BYTES, getattr(props, "L2_cache_size", 0) or 0)
    res: dict[str, Any] = {
        "device": props.name,
        "sms": NUM_SMS,
        "l2_bytes": L2_BYTES,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "has_gdc": HAS_GDC,
        "quick": args.quick,
        "shapes": {},
        "args": vars(args),
    }
    out_path = args.out

    def dump() -> None:
        if out_path:
            write_result(out_path, res)

    try:
        res["copy_TBps_rw"] = round(copy_bandwidth(dev), 3)
    except Exception as ex:
        res["copy_TBps_rw"] = short_err(ex)
    timer = Timer(dev)
    variants_m1, variants_b = build_variants(args.quick)
    by_name = {v.name: v for v in variants_m1 + variants_b}
    # odd shape first (compiles the HAS_BIAS flavours in parallel)
    t0 = time.time()
    gg = torch.Generator(device=dev).manual_seed(1)
    wodd = torch.empty(1000, 4096, dtype=torch.bfloat16, device=dev).uniform_(-0.03, 0.03)
    bodd = torch.randn(1000, generator=gg, device=dev).bfloat16()
    items = [
        (v, torch.empty(1, 4096, dtype=torch.bfloat16, device=dev), wodd, bodd, False)
        for v in variants_m1
        if v.kind != "cublas"
    ]
    items += [
        (v, torch.empty(3, 4096, dtype=torch.bfloat16, device=dev), wodd, bodd, False)
        for v in variants_b
        if v.kind != "cublas"
    ]
    pc_s, _ = precompile(items, args.compile_threads)
    odd_ok = check_odd(variants_m1, variants_b, dev, res)
    res["odd_shape"]["seconds"] = round(time.time() - t0, 2)
    res["odd_shape"]["precompile_s"] = round(pc_s, 2)
    dump()
    ms = [4] if args.quick else [2, 4, 8, 16]
    names = list(SHAPES) if not args.shapes else [s.strip() for s in args.shapes.split(",")]
    for name in names:
        n, k = SHAPES[name]
        t0 = time.time()
        try:
            study_shape(
                name, n, k, variants_m1, variants_b, ms if name != "lm_head" else [], timer, args, res, deadline, odd_ok
            )
        except Exception as ex:
            res["shapes"].setdefault(name, {})["error"] = short_err(ex)
            res["shapes"][name]["trace"] = traceback.format_exc()[-1500:]
        res["shapes"].setdefault(name, {})["seconds"] = round(time.time() - t0, 2)
        print(f"[{time.time() - t_start:6.1f}s] {name} done", flush=True)
        dump()
    if not args.no_chain:
        t0 = time.time()
        try:
            run_chain(res, by_name, timer, args)
        except Exception as ex:
            res["chain"] = res.get("chain", {})
            res["chain"]["error"] = short_err(ex)
            res["chain"]["trace"] = traceback.format_exc()[-1500:]
        res.setdefault("chain", {})["seconds"] = round(time.time() - t0, 2)
        print(f"[{time.time() - t_start:6.1f}s] chain done", flush=True)
    res["total_s"] = round(time.time() - t_start, 1)
    dump()
    print(summarize(res))
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="JSON file for all results")
    p.add_argument("--quick", action="store_true", help="fewer configs and repetitions (< 1 min)")
    p.add_argument(
        "--budget",
        type=float,
        default=None,
        help="seconds for the whole run; later configs are skipped past it (default 170, quick 45)",
    )
    p.add_argument("--shapes", default=None, help="comma list out of qkv,o_proj,gate_up,down,lm_head")
    p.add_argument("--layers", type=int, default=32, help="layers in the decode chain")
    p.add_argument("--no-chain", action="store_true", help="skip the 32-layer chain")
    p.add_argument("--no-pdl", action="store_true", help="skip the programmatic-dependent-launch chain")
    p.add_argument("--compile-threads", type=int, default=16, help="threads for Triton's parallel compile")
    p.add_argument(
        "--selftest",
        action="store_true",
        help="tiny-shape correctness of the new kernels (CPU with TRITON_INTERPRET=1, or a GPU)",
    )
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
