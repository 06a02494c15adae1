"""Fused Triton kernels for the GPU forward, and ``TritonLayerOps``: the model's op set built on them.

The plain-PyTorch ops (``layer_ops.TorchLayerOps``) issue ~40 kernels per layer:
RMSNorm alone is eight elementwise passes in float32, RoPE another ten. On a GPU
that costs twice: in prefill every pass streams the whole ``[T, hidden]``
activation through memory, and in decode (even inside a CUDA graph) every kernel
boundary costs a few microseconds. With ``TritonLayerOps`` the model's forward
(``model.py``, the same code on every device) issues, per layer:

    add+RMSNorm, qkv GEMM, RoPE+KV-cache write, attention, o GEMM,
    add+RMSNorm, gate_up GEMM, SiLU*mul, down GEMM

and at one token (the batch-1 decode graph), where ``tune_gemv`` chose the Triton
GEMV for a projection, the GEMVs take the small kernels in (``_gemv_fused_kernel``,
``TritonLayerOps.fuse_gemv``, ``EngineConfig.fused_decode_gemv``):

    qkv GEMV with its RMSNorm, RoPE+KV-cache write, attention, o GEMV adding into
    the residual, gate_up GEMV with its RMSNorm, down GEMV with SiLU*mul and the add

six kernels instead of nine. Each program of a norm-prologue GEMV reads the whole
row (from L2) for the RMSNorm's statistics; the residual add moves from the next
norm into the previous GEMV's epilogue (each program adds its own rows), so no
fused kernel both reads and writes the stream.

The kernels round their intermediates to the model dtype exactly where the
PyTorch ops do (``x * cos`` and ``rotate_half(x) * sin`` rounded separately,
``silu(gate)`` rounded before ``* up``, RMSNorm cast before the weight), so both
op sets compute the same function up to float32 reduction order. The fused GEMVs
round where the unfused kernels do; only the norm prologue's sum of squares is
summed in another order.

Only for backends with an ``attend`` method (attention without the KV write:
the RoPE kernel already stored K/V); ``layer_ops.select_layer_ops`` checks
``can_fuse``. Importable without Triton.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from distserve.server.engine.attention import AttentionBackend, AttentionMetadata
from distserve.server.engine.ops.protocols import RopeInputs

if TYPE_CHECKING:  # the model's modules as the ops read them: the ops never import model.py
    from distserve.server.engine.ops.protocols import LlamaAttention, RMSNorm, RotaryEmbedding

try:  # pragma: no cover - depends on the install
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:
    triton = None
    tl = None
    HAS_TRITON = False


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


if HAS_TRITON:

    @triton.jit
    def _rms_norm_kernel(
        x_ptr,
        res_ptr,
        w_ptr,
        out_ptr,
        stride_x,
        stride_r,
        stride_o,
        n_cols,
        eps,
        HAS_RESIDUAL: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < n_cols
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
        if HAS_RESIDUAL:  # residual += x (rounded like a torch add), then normalise the sum
            r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(r.dtype)
            tl.store(res_ptr + row * stride_r + offs, x, mask=mask)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, 0) / n_cols
        y = (xf * tl.rsqrt(var + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + offs, (w * y).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rope_cache_kernel(
        qkv_ptr,
        pos_ptr,
        cos_ptr,
        sin_ptr,
        slot_ptr,
        q_out_ptr,
        k_out_ptr,
        cache_k_ptr,
        cache_v_ptr,
        kv_scale_ptr,
        kv_amax_ptr,
        stride_qkv,
        stride_cos,
        stride_ct,
        stride_ch,
        NUM_HEADS: tl.constexpr,
        NUM_KV_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HB: tl.constexpr,
        KV_FP8: tl.constexpr = False,
        FP8_LIMIT: tl.constexpr = 448.0,
    ):
        t = tl.program_id(0).to(tl.int64)
        hh = tl.program_id(1) * HB + tl.arange(0, HB)  # head index over [q heads | k heads]
        half = HEAD_DIM // 2
        offs_d = tl.arange(0, HEAD_DIM)
        valid = hh < NUM_HEADS + NUM_KV_HEADS
        is_q = hh < NUM_HEADS
        is_k = valid & (hh >= NUM_HEADS)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        row = qkv_ptr + t * stride_qkv
        m2 = valid[:, None]
        x = tl.load(row + hh[:, None] * HEAD_DIM + offs_d[None, :], mask=m2, other=0.0)
        rot_d = (offs_d + half) % HEAD_DIM
        xr = tl.load(row + hh[:, None] * HEAD_DIM + rot_d[None, :], mask=m2, other=0.0).to(tl.float32)
        xr = tl.where(offs_d[None, :] < half, -xr, xr)
        dt = x.dtype
        c = tl.load(cos_ptr + pos * stride_cos + offs_d).to(dt).to(tl.float32)
        s = tl.load(sin_ptr + pos * stride_cos + offs_d).to(dt).to(tl.float32)
        a = (x.to(tl.float32) * c[None, :]).to(dt).to(tl.float32)
        b = (xr * s[None, :]).to(dt).to(tl.float32)
        y = (a + b).to(dt)
        tl.store(
            q_out_ptr + t * (NUM_HEADS * HEAD_DIM) + hh[:, None] * HEAD_DIM + offs_d[None, :], y, mask=is_q[:, None]
        )
        kh = hh - NUM_HEADS
        km = is_k[:, None]
        tl.store(k_out_ptr + t * (NUM_KV_HEADS * HEAD_DIM) + kh[:, None] * HEAD_DIM + offs_d[None, :], y, mask=km)
        cm = km & (slot >= 0)
        dst = slot * stride_ct + kh[:, None] * stride_ch + offs_d[None, :]
        v = tl.load(row + (hh[:, None] + NUM_KV_HEADS) * HEAD_DIM + offs_d[None, :], mask=cm, other=0.0)
        if KV_FP8:  # e4m3 cache (fp8.py): amax of what is written, then quantised with the layer's scales
            yf = y.to(tl.float32)
            vf = v.to(tl.float32)
            tl.atomic_max(kv_amax_ptr, tl.max(tl.max(tl.where(cm, tl.abs(yf), 0.0), 1), 0))
            tl.atomic_max(kv_amax_ptr + 1, tl.max(tl.max(tl.where(cm, tl.abs(vf), 0.0), 1), 0))
            kq = tl.minimum(tl.maximum(yf / tl.load(kv_scale_ptr), -FP8_LIMIT), FP8_LIMIT)
            vq = tl.minimum(tl.maximum(vf / tl.load(kv_scale_ptr + 1), -FP8_LIMIT), FP8_LIMIT)
            tl.store(cache_k_ptr + dst, kq.to(cache_k_ptr.dtype.element_ty), mask=cm)
            tl.store(cache_v_ptr + dst, vq.to(cache_v_ptr.dtype.element_ty), mask=cm)
        else:
            tl.store(cache_k_ptr + dst, y, mask=cm)
            tl.store(cache_v_ptr + dst, v, mask=cm)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_o, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n_cols
        g = tl.load(gu_ptr + row * stride_gu + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * stride_gu + n_cols + offs, mask=mask, other=0.0).to(tl.float32)
        dt = out_ptr.dtype.element_ty
        sg = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        tl.store(out_ptr + row * stride_o + offs, (sg * u).to(dt), mask=mask)


if HAS_TRITON:

    @triton.jit
    def _gemv_kernel(
        x_ptr,
        w_ptr,
        b_ptr,
        y_ptr,
        N,
        K,
        stride_w,
        HAS_BIAS: tl.constexpr,
        EVEN_K: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        STAGES: tl.constexpr = 1,
        EVEN_N: tl.constexpr = False,
    ):
        """y[N] = W[N, K] @ x[K] (+ b): products accumulate elementwise, one reduction at the end.

        STAGES > 1 software-pipelines the weight stream through shared memory (cp.async, STAGES deep);
        Triton does not pipeline this loop on its own (it has no dot), and on an H200 the pipelined
        form is the fastest GEMV of bench/kernels/gemv_study.py for every 7B shape at one token.
        """
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < N
        w_rows = w_ptr + rows[:, None].to(tl.int64) * stride_w
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        if STAGES > 1:
            for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
                cols = k0 + tl.arange(0, BLOCK_K)
                if EVEN_K:
                    if EVEN_N:
                        w = tl.load(w_rows + cols[None, :], eviction_policy="evict_first")
                    else:
                        w = tl.load(
                            w_rows + cols[None, :], mask=rmask[:, None], other=0.0, eviction_policy="evict_first"
                        )
                    x = tl.load(x_ptr + cols)
                else:
                    w = tl.load(
                        w_rows + cols[None, :],
                        mask=rmask[:, None] & (cols[None, :] < K),
                        other=0.0,
                        eviction_policy="evict_first",
                    )
                    x = tl.load(x_ptr + cols, mask=cols < K, other=0.0)
                acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        else:
            for k0 in range(0, K, BLOCK_K):
                cols = k0 + tl.arange(0, BLOCK_K)
                if EVEN_K:
                    x = tl.load(x_ptr + cols)
                    w = tl.load(w_rows + cols[None, :], mask=rmask[:, None], other=0.0)
                else:
                    x = tl.load(x_ptr + cols, mask=cols < K, other=0.0)
                    w = tl.load(w_rows + cols[None, :], mask=rmask[:, None] & (cols[None, :] < K), other=0.0)
                acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        y = tl.sum(acc, 1)
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rmask)


if HAS_TRITON:

    @triton.jit
    def _fused_input(
        x_ptr,
        nw_ptr,
        cols,
        kmask,
        K,
        rstd,
        dt: tl.constexpr,
        NORM: tl.constexpr,
        SILU: tl.constexpr,
        MASKED: tl.constexpr,
    ):
        """The GEMV's input chunk ``cols`` (float32), computed on load.

        NORM: RMSNorm of the row ``x`` with the row's ``rstd``, rounded to ``dt`` before the weight and after it,
        as ``_rms_norm_kernel``. SILU: ``x`` is a gate|up row of ``2 K``: ``silu(g)`` rounded to ``dt`` before
        ``* u``, the product rounded, as ``_silu_mul_kernel``. Neither: ``x`` as it is."""
        if MASKED:
            xv = tl.load(x_ptr + cols, mask=kmask, other=0.0)
        else:
            xv = tl.load(x_ptr + cols)
        if NORM:
            if MASKED:
                nw = tl.load(nw_ptr + cols, mask=kmask, other=0.0).to(tl.float32)
            else:
                nw = tl.load(nw_ptr + cols).to(tl.float32)
            y = (xv.to(tl.float32) * rstd).to(dt).to(tl.float32)
            return (nw * y).to(dt).to(tl.float32)
        elif SILU:
            if MASKED:
                u = tl.load(x_ptr + K + cols, mask=kmask, other=0.0).to(tl.float32)
            else:
                u = tl.load(x_ptr + K + cols).to(tl.float32)
            g = xv.to(tl.float32)
            sg = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
            return (sg * u).to(dt).to(tl.float32)
        else:
            return xv.to(tl.float32)

    @triton.jit
    def _gemv_fused_kernel(
        x_ptr,
        w_ptr,
        b_ptr,
        y_ptr,
        nw_ptr,
        N,
        K,
        stride_w,
        eps,
        HAS_BIAS: tl.constexpr,
        EVEN_K: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        NORM: tl.constexpr,
        SILU: tl.constexpr,
        ADD: tl.constexpr,
        STAGES: tl.constexpr = 1,
        EVEN_N: tl.constexpr = False,
    ):
        """``_gemv_kernel`` with a prologue on its input and an epilogue on its output (one-token decode).

        Prologue (on every K chunk as it is loaded, ``_fused_input``): NORM: ``x`` is the un-normalised row and
        ``nw`` the RMSNorm weight; every program first reads the whole row (``K`` values, from L2) for the sum of
        squares. SILU: ``x`` is the ``[2 K]`` gate|up row. Epilogue: ADD: ``y`` is the residual row, updated in
        place, ``y[rows] += (W x + b)[rows]`` with the product rounded to the dtype first (as the unfused GEMV
        stores it) and the sum rounded as ``_rms_norm_kernel``'s add; each program owns its rows, and no program
        reads ``y`` otherwise. The loop is ``_gemv_kernel``'s (STAGES > 1: pipelined)."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < N
        w_rows = w_ptr + rows[:, None].to(tl.int64) * stride_w
        dt = y_ptr.dtype.element_ty
        rstd = 0.0
        if NORM:  # the row's statistics, as _rms_norm_kernel (float32, mean of squares, rsqrt(var + eps))
            ss = tl.zeros([BLOCK_K], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                cols = k0 + tl.arange(0, BLOCK_K)
                xs = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
                ss += xs * xs
            rstd = tl.rsqrt(tl.sum(ss, 0) / K + eps)
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        if STAGES > 1:
            for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
                cols = k0 + tl.arange(0, BLOCK_K)
                kmask = cols < K
                if EVEN_K:
                    if EVEN_N:
                        w = tl.load(w_rows + cols[None, :], eviction_policy="evict_first")
                    else:
                        w = tl.load(
                            w_rows + cols[None, :], mask=rmask[:, None], other=0.0, eviction_policy="evict_first"
                        )
                    x = _fused_input(x_ptr, nw_ptr, cols, kmask, K, rstd, dt, NORM, SILU, False)
                else:
                    w = tl.load(
                        w_rows + cols[None, :],
                        mask=rmask[:, None] & kmask[None, :],
                        other=0.0,
                        eviction_policy="evict_first",
                    )
                    x = _fused_input(x_ptr, nw_ptr, cols, kmask, K, rstd, dt, NORM, SILU, True)
                acc += w.to(tl.float32) * x[None, :]
        else:
            for k0 in range(0, K, BLOCK_K):
                cols = k0 + tl.arange(0, BLOCK_K)
                kmask = cols < K
                if EVEN_K:
                    x = _fused_input(x_ptr, nw_ptr, cols, kmask, K, rstd, dt, NORM, SILU, False)
                    w = tl.load(w_rows + cols[None, :], mask=rmask[:, None], other=0.0)
                else:
                    x = _fused_input(x_ptr, nw_ptr, cols, kmask, K, rstd, dt, NORM, SILU, True)
                    w = tl.load(w_rows + cols[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
                acc += w.to(tl.float32) * x[None, :]
        y = tl.sum(acc, 1)
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
        if ADD:  # residual += y: y rounded as the unfused GEMV stores it, the sum as _rms_norm_kernel's add
            r = tl.load(y_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
            tl.store(y_ptr + rows, (y.to(dt).to(tl.float32) + r).to(dt), mask=rmask)
        else:
            tl.store(y_ptr + rows, y.to(dt), mask=rmask)


# A GEMV config is (BLOCK_N, BLOCK_K, num_warps) or (BLOCK_N, BLOCK_K, num_warps, STAGES) (pipelined
# loop). tune_gemv stores the winner on each nn.Linear as `gemv_cfg` (absent/None: cuBLAS).
GemvCfg = tuple
GEMV_CANDIDATES = (
    (4, 1024, 4),
    (8, 512, 4),
    (2, 2048, 4),
    (8, 1024, 8),
    (16, 512, 8),
    (4, 512, 2),
    (16, 256, 4),
    # pipelined: best of bench/kernels/gemv_study.py on an H200 (CUDA graph, weights out of L2), in us:
    # qkv 25.9 (16,256,4,3), o_proj 10.8 (4,512,4,3), gate_up 43.5 (16,256,4,3),
    # down 23.6 (8,512,4,3); cuBLAS 28.4 / 13.7 / 47.3 / 28.1
    (16, 256, 4, 3),
    (4, 512, 4, 3),
    (8, 512, 4, 3),
    (8, 256, 2, 4),
    (4, 512, 4, 4),
)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cfg: GemvCfg) -> torch.Tensor:
    """``F.linear`` for a single row ``x [1, K]`` through the Triton GEMV."""
    n, k = weight.shape
    bn, bk, nw = cfg[:3]
    stages = cfg[3] if len(cfg) > 3 else 1
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    extra = {"STAGES": stages, "EVEN_N": n % bn == 0, "num_stages": stages} if stages > 1 else {}
    _gemv_kernel[(triton.cdiv(n, bn),)](
        x,
        weight,
        bias if bias is not None else y,
        y,
        n,
        k,
        weight.stride(0),
        HAS_BIAS=bias is not None,
        EVEN_K=k % bk == 0,
        BLOCK_N=bn,
        BLOCK_K=bk,
        num_warps=nw,
        **extra,
    )
    return y


def gemv_fused(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cfg: GemvCfg,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    silu: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """One row through ``_gemv_fused_kernel`` (the tuned ``_gemv_kernel`` config ``cfg``).

    ``norm_weight``: ``x [1, K]`` is RMSNorm'd (``eps``) on load; ``silu``: ``x [1, 2 K]`` is a gate|up row,
    ``silu(gate) * up`` on load. ``residual [1, N]``: the output is added into it in place and it is returned;
    otherwise a new ``[1, N]`` row. Rounding is the unfused ops' (``_rms_norm_kernel``, ``_silu_mul_kernel``,
    the GEMV's store, the add of ``_rms_norm_kernel``) except the RMSNorm's sum of squares, summed in another
    order (``TritonLayerOps.norm_linear``)."""
    n, k = weight.shape
    if norm_weight is not None and silu:
        raise ValueError("gemv_fused: a norm or a SiLU prologue, not both")
    want = 2 * k if silu else k
    if x.dim() != 2 or x.shape[0] != 1 or x.shape[1] != want or not x.is_contiguous():
        raise ValueError(f"gemv_fused: x must be one contiguous row of {want}, got {tuple(x.shape)}")
    bn, bk, nw = cfg[:3]
    stages = cfg[3] if len(cfg) > 3 else 1
    if residual is not None:
        if residual.shape != (1, n) or not residual.is_contiguous() or residual.dtype != x.dtype:
            raise ValueError(f"gemv_fused: residual must be a contiguous [1, {n}] row of {x.dtype}")
        y = residual
    else:
        y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    extra = {"STAGES": stages, "EVEN_N": n % bn == 0, "num_stages": stages} if stages > 1 else {}
    _gemv_fused_kernel[(triton.cdiv(n, bn),)](
        x,
        weight,
        bias if bias is not None else y,
        y,
        norm_weight if norm_weight is not None else y,
        n,
        k,
        weight.stride(0),
        float(eps),
        HAS_BIAS=bias is not None,
        EVEN_K=k % bk == 0,
        BLOCK_N=bn,
        BLOCK_K=bk,
        NORM=norm_weight is not None,
        SILU=silu,
        ADD=residual is not None,
        num_warps=nw,
        **extra,
    )
    return y


# Off the GPU, Triton's interpreter (TRITON_INTERPRET=1, read when the kernels are defined) runs the kernels on
# CPU tensors: the tests' way to check them without a GPU.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _kernel_row(x: torch.Tensor) -> bool:
    """A single contiguous row on a device the kernels run on."""
    return x.shape[0] == 1 and x.is_contiguous() and (x.is_cuda or _INTERPRET)


def linear(x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
    """``layer(x)``; one-token inputs take the Triton GEMV where tuning found it faster than cuBLAS."""
    if _kernel_row(x):
        cfg = getattr(layer, "gemv_cfg", None)
        if cfg is not None:
            return gemv(x, layer.weight, layer.bias, cfg)
    return layer(x)


def _graph_ms(call, weights, reps: int = 5) -> float:
    """Median ms of one ``call(w)``, timed as a CUDA graph of back-to-back calls over ``weights``.

    Like the decode step: no launch overhead, and (with the model's layers as ``weights``) weights that
    L2 does not already hold. do_bench times one launch with its CPU overhead, which at 10-60 us per GEMV
    is a large share of what it measures.
    """
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for w in weights:
            call(w)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for w in weights:
            call(w)
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / len(weights))
    del g
    ts.sort()
    return ts[len(ts) // 2]


def tune_gemv(model, margin: float = 0.03, verbose: bool = False) -> dict:
    """Time cuBLAS against the Triton GEMV candidates at one token for each distinct weight shape.

    Timed in a CUDA graph over the same projection of every layer (falls back to do_bench per launch).
    """
    from triton.testing import do_bench

    report = {}
    layers = list(model.layers)
    getters = [
        lambda l: l.self_attn.qkv_proj,
        lambda l: l.self_attn.o_proj,
        lambda l: l.mlp.gate_up_proj,
        lambda l: l.mlp.down_proj,
    ]
    for get in getters:
        mods = [get(l) for l in layers]
        w, b = mods[0].weight, mods[0].bias
        shape = tuple(w.shape)
        ws = [m.weight for m in mods]
        x = torch.randn(1, shape[1], device=w.device, dtype=w.dtype)
        ref = F_linear(x, w, b).float()

        def bench(fn):
            try:
                return _graph_ms(fn, ws), "graph"
            except Exception:  # capture refused here: per-launch timing
                return do_bench(lambda: fn(w), warmup=10, rep=40, return_mode="median"), "do_bench"

        base, how = bench(lambda wi: F_linear(x, wi, b))
        best, best_ms = None, base * (1 - margin)  # a candidate must beat cuBLAS by the margin
        times = {"cublas": base}
        for cfg in GEMV_CANDIDATES:
            try:
                out = gemv(x, w, b, cfg).float()
                if not torch.isfinite(out).all() or ((out - ref).norm() / ref.norm()).item() > 1e-2:
                    continue
                ms, _ = bench(lambda wi, cfg=cfg: gemv(x, wi, b, cfg))
            except Exception:  # a candidate that does not compile here is skipped
                continue
            times[str(cfg)] = ms
            if ms < best_ms:
                best, best_ms = cfg, ms
        for m in mods:
            m.gemv_cfg = best
        report[str(shape)] = {
            "choice": best,
            "us": {k: round(v * 1e3, 1) for k, v in times.items()},
            "bytes": w.numel() * w.element_size(),
            "timing": how,
        }
        if verbose:
            print("gemv", shape, report[str(shape)])
    return report


def F_linear(x, w, b):
    return torch.nn.functional.linear(x, w, b)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of ``x`` (or of ``residual += x`` in place, when a residual is given)."""
    t, n = x.shape
    out = torch.empty_like(x)
    if t == 0:
        return out
    block = _next_pow2(n)
    res = residual if residual is not None else x
    _rms_norm_kernel[(t,)](
        x,
        res,
        weight,
        out,
        x.stride(0),
        res.stride(0),
        out.stride(0),
        n,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=min(16, max(4, block // 512)),
    )
    return out


def rope_and_cache(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    kv_scale: torch.Tensor | None = None,
    kv_amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on q and k of a fused qkv projection; K/V stored at ``slot_mapping`` (negative: skipped).
    An e4m3 cache is written quantised with ``kv_scale`` ([K, V]); the amax written goes into ``kv_amax``.

    Returns ``q [T, H, D]`` and ``k [T, Hkv, D]`` (rotated, contiguous).
    """
    t = qkv.shape[0]
    q = torch.empty(t, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(t, num_kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if t == 0:
        return q, k
    hb = 8
    ck, cv = kv_cache[0], kv_cache[1]
    kv_fp8 = kv_cache.dtype == torch.float8_e4m3fn
    if kv_fp8 and (kv_scale is None or kv_amax is None):
        raise ValueError("an FP8 KV cache needs kv_scale and kv_amax")
    _rope_cache_kernel[(t, -(-(num_heads + num_kv_heads) // hb))](
        qkv,
        positions,
        cos,
        sin,
        slot_mapping,
        q,
        k,
        ck,
        cv,
        kv_scale if kv_fp8 else q,
        kv_amax if kv_fp8 else q,
        qkv.stride(0),
        cos.stride(0),
        ck.stride(0),
        ck.stride(1),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HB=hb,
        KV_FP8=kv_fp8,
        FP8_LIMIT=448.0,
        num_warps=4,
    )
    return q, k


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    t, n2 = gate_up.shape
    n = n2 // 2
    out = torch.empty(t, n, dtype=gate_up.dtype, device=gate_up.device)
    if t == 0:
        return out
    block = 1024
    _silu_mul_kernel[(t, -(-n // block))](gate_up, out, gate_up.stride(0), out.stride(0), n, BLOCK=block, num_warps=4)
    return out


class TritonLayerOps:
    """``layer_ops.LayerOps`` on the fused kernels above (CUDA tensors; see ``can_fuse``)."""

    name = "triton"
    # one-token decode: RMSNorm, the residual add and SiLU x mul inside the tuned GEMVs (gemv_fused), three
    # kernels fewer per layer; False: the unfused kernels at every size (EngineConfig.fused_decode_gemv). Read
    # when a forward runs, so a change takes effect in graphs captured after it.
    fuse_gemv: bool = True

    def __init__(self, fuse_gemv: bool = True) -> None:
        self.fuse_gemv = fuse_gemv

    def _fused_cfg(self, x: torch.Tensor, layer: torch.nn.Linear) -> GemvCfg | None:
        """The GEMV config of ``layer`` when its one-token GEMV can take a prologue/epilogue: fusion on, one
        contiguous row, a ``tune_gemv`` choice of the Triton GEMV (None: cuBLAS was faster, or an e4m3 weight,
        whose GEMV is ``fp8_linear``'s), weights in the activation's dtype."""
        if not self.fuse_gemv or not _kernel_row(x):
            return None
        cfg = getattr(layer, "gemv_cfg", None)
        if cfg is None or layer.weight.dtype != x.dtype:
            return None
        return cfg

    def rope(
        self, rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype, max_position: int
    ) -> RopeInputs:
        """The whole float32 tables and the positions: the kernel picks rows and rounds them to the dtype."""
        cos, sin = rotary.float_tables(max_position, positions.device)
        return positions, cos, sin

    def rms_norm(self, x: torch.Tensor | None, norm: RMSNorm, residual: torch.Tensor | None) -> torch.Tensor:
        if x is None:  # the stream already holds the previous output (a fused epilogue added it)
            assert residual is not None
            return rms_norm(residual, norm.weight, norm.eps)
        return rms_norm(x, norm.weight, norm.eps, residual=residual)

    def linear(self, x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
        return linear(x, layer)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_mul(gate_up)

    def norm_linear(
        self, x: torch.Tensor | None, norm: RMSNorm, residual: torch.Tensor | None, layer: torch.nn.Linear
    ) -> torch.Tensor:
        """One row whose norm needs no add (the first layer's embeddings, or a stream a fused epilogue already
        updated): the RMSNorm is the GEMV's prologue. Its sum of squares is summed in another order than
        ``_rms_norm_kernel``'s (per BLOCK_K lane, then across lanes): the float32 ``rstd`` may differ in its
        last bit, and then an element of the bf16 normalised row may round the other way (the tests bound the
        difference). Anything else: the add+RMSNorm kernel, then ``linear``."""
        src = residual if x is None else x if residual is None else None
        cfg = None if src is None else self._fused_cfg(src, layer)
        if cfg is not None and src is not None:
            return gemv_fused(src, layer.weight, layer.bias, cfg, norm_weight=norm.weight, eps=norm.eps)
        return self.linear(self.rms_norm(x, norm, residual), layer)

    def _fusable_residual(self, residual: torch.Tensor, x: torch.Tensor, layer: torch.nn.Linear) -> bool:
        return _kernel_row(residual) and residual.dtype == x.dtype and residual.shape[1] == layer.weight.shape[0]

    def linear_add(self, x: torch.Tensor, layer: torch.nn.Linear, residual: torch.Tensor) -> torch.Tensor | None:
        """One row: ``residual += linear(x)`` as the GEMV's epilogue (bit for bit the unfused GEMV's output
        added by the next add+RMSNorm), returns None. Otherwise ``linear(x)``, for the next norm to add."""
        cfg = self._fused_cfg(x, layer)
        if cfg is not None and self._fusable_residual(residual, x, layer):
            gemv_fused(x, layer.weight, layer.bias, cfg, residual=residual)
            return None
        return self.linear(x, layer)

    def silu_mul_linear_add(
        self, gate_up: torch.Tensor, layer: torch.nn.Linear, residual: torch.Tensor
    ) -> torch.Tensor | None:
        """One row: SiLU x mul as the GEMV's prologue (``_silu_mul_kernel``'s rounding, bit for bit) and the
        residual add as its epilogue, returns None. Otherwise ``linear(silu_mul(gate_up))``."""
        cfg = self._fused_cfg(gate_up, layer)
        if cfg is not None and self._fusable_residual(residual, gate_up, layer):
            gemv_fused(gate_up, layer.weight, layer.bias, cfg, silu=True, residual=residual)
            return None
        return self.linear(self.silu_mul(gate_up), layer)

    def attention(
        self,
        attn: LlamaAttention,
        qkv: torch.Tensor,
        rope: RopeInputs,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """One kernel rotates q and k and stores K/V; the backend only attends (``attend``)."""
        positions, cos, sin = rope
        t = qkv.shape[0]
        args = (qkv, positions, cos, sin, kv_cache, meta.slot_mapping, attn.num_heads, attn.num_kv_heads, attn.head_dim)
        if attn.kv_scale is None:
            q, k = rope_and_cache(*args)
        else:  # an e4m3 cache: quantised on write with the layer's scales, amax recorded (fp8.py)
            q, k = rope_and_cache(*args, attn.kv_scale, attn.kv_amax)
        v = qkv[:, attn.q_size + attn.kv_size :].view(t, attn.num_kv_heads, attn.head_dim)
        if attn.kv_scale is None:
            o = backend.attend(q, k, v, kv_cache, meta, attn.scale)  # type: ignore[attr-defined]  # can_fuse checked
        else:
            o = backend.attend(q, k, v, kv_cache, meta, attn.scale, kv_scale=attn.kv_scale)  # type: ignore[attr-defined]
        return o.reshape(t, attn.q_size)  # (reshape copies only a non-contiguous view)


def can_fuse(backend: AttentionBackend, head_dim: int) -> bool:
    """Triton importable, a backend that attends without writing K/V, and a power-of-two head size
    (the RoPE kernel's ``tl.arange`` over a head)."""
    return HAS_TRITON and hasattr(backend, "attend") and head_dim == _next_pow2(head_dim) and head_dim % 2 == 0
