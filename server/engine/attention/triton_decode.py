"""Triton paged-decode attention, and the ``triton`` backend built on it.

The decode kernel reads the paged cache through the block table directly (no
gather into a contiguous copy): one program per (sequence, kv head, split),
each streaming its share of the context in ``BLOCK_N``-token tiles with an
online softmax in float32. All query heads of a GQA group are served by the
program of their kv head, so each K/V byte is read once per step.

Split-K: when ``batch * kv_heads`` is too small to fill the GPU (batch 1, long
contexts) the context is cut into ``num_splits`` partitions; every split writes
an unnormalised partial (acc, max, sum) and a second small kernel combines them.
The grid and the partition size depend only on host-side static numbers
(batch, kv heads, an upper bound on the context), never on the device-side
lengths, so a step can be captured in a CUDA graph: splits past a sequence's
end exit at once.

Prefills go through ``torch.nn.functional.scaled_dot_product_attention``
(flash kernel on CUDA for bf16/fp16) on ``[1, H, T, D]`` views whose last
dimension is contiguous; chunked prefills (earlier tokens already cached) use
the SDPA backend's masked path.

The module imports without Triton (CPU installs); ``HAS_TRITON`` says whether
the kernels exist.
"""

from __future__ import annotations

import itertools
import logging

import torch
import torch.nn.functional as F

from distserve.server.engine.attention.base import AttentionBackend, AttentionMetadata, gather_kv
from distserve.server.engine.fp8 import FP8_MAX, gather_kv_fp8

log = logging.getLogger(__name__)

try:
    from torch.nn.attention import SDPBackend
    from torch.nn.attention.bias import causal_lower_right
except ImportError:  # torch < 2.3
    SDPBackend = None  # type: ignore[assignment,misc]
    causal_lower_right = None  # type: ignore[assignment]

try:  # pragma: no cover - depends on the install
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # ImportError, or a broken driver stack
    triton = None
    tl = None
    HAS_TRITON = False

# Launch parameters; the GPU bench may override them (see bench/engine/gpu_engine.py).
# Defaults from the H200 sweep (docs/performance/engine-gpu.md): at batch 64 x 1024 context, BLOCK_N 16
# with one warp streamed the cache at ~4.1 TB/s, 32/2 at 3.1, 64/4 at 1.9. (GQA groups of 8+ take the
# tensor-core path with at least 32 tokens and 2 warps.)
DECODE_CONFIG = {"BLOCK_N": 16, "num_warps": 1, "num_stages": 2, "target_programs_per_sm": 2, "min_partition": 256}
# An e4m3 cache: rows of half the bytes, so twice the tokens per tile move what a bf16 tile moved (the
# bf16 config left the FP8 KV gain at -6 % step time at batch 64 x 1k, PERFORMANCE "FP8 decode on one
# H200"). ``tune_decode_configs`` replaces both per shape at start-up.
DECODE_CONFIG_FP8 = {
    "BLOCK_N": 32,
    "num_warps": 1,
    "num_stages": 2,
    "target_programs_per_sm": 2,
    "min_partition": 256,
}
# (BLOCK_N, num_warps, num_stages, min_partition) tried by tune_decode_configs
DECODE_CANDIDATES = (
    (16, 1, 2, 256),
    (32, 1, 2, 256),
    (32, 2, 2, 256),
    (64, 2, 2, 256),
    (64, 4, 2, 256),
    (16, 1, 2, 64),
    (32, 1, 2, 64),
    (32, 2, 3, 128),
)
# SDPA kernels for causal prefill, in priority order (None: PyTorch's own choice), e.g.
# [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]; the bench may override it. Flash first by
# default: PyTorch's choice on Hopper can be cuDNN, which builds an execution plan for every new sequence
# length (tens to hundreds of ms each), so a workload of varied prompt lengths (or chunked prefills) paid
# it on most steps in the two-GPU SLO study (docs/performance/engine-gpu.md, 'Prefill attention: flash first').
PREFILL_SDPA_BACKENDS: list | None = (
    [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH] if SDPBackend is not None else None
)
_LOG2E = 1.4426950408889634
_SM_COUNT: dict[int, int] = {}


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def plan_splits(
    batch: int, num_kv_heads: int, max_context: int, device: torch.device, cfg: dict | None = None
) -> tuple[int, int]:
    """(num_splits, partition_size) for a launch; host-side, static numbers only."""
    cfg = cfg or DECODE_CONFIG
    block_n = cfg["BLOCK_N"]
    max_context = max(1, max_context)
    if max_context <= cfg["min_partition"]:
        return 1, -(-max_context // block_n) * block_n
    programs = batch * num_kv_heads
    want = -(-cfg["target_programs_per_sm"] * _sm_count(device) // programs)
    splits = max(1, min(want, -(-max_context // cfg["min_partition"]), 64))
    partition = -(-(-(-max_context // splits)) // block_n) * block_n  # noqa: B002 (ceil division, not a decrement)
    splits = -(-max_context // partition)
    return splits, partition


if HAS_TRITON:

    @triton.jit
    def _paged_decode_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        bt_ptr,
        lens_ptr,
        out_ptr,
        part_o_ptr,
        part_ml_ptr,
        kv_scale_ptr,
        scale_log2,
        stride_qt,
        stride_qh,
        stride_ct,
        stride_ch,
        stride_bt,
        stride_ot,
        stride_oh,
        partition_size,
        num_heads,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        USE_DOT: tl.constexpr,
        KV_FP8: tl.constexpr = False,
    ):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        sp = tl.program_id(2)
        seq_len = tl.load(lens_ptr + b).to(tl.int32)
        start = sp * partition_size
        end = tl.minimum(start + partition_size, seq_len)

        offs_g = tl.arange(0, GROUP_PAD)
        offs_d = tl.arange(0, HEAD_DIM)
        mask_g = offs_g < GROUP
        heads = kvh * GROUP + offs_g
        q = tl.load(
            q_ptr + b * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=mask_g[:, None], other=0.0
        )
        if not USE_DOT:
            q = q.to(tl.float32)
        if KV_FP8:  # e4m3 cache: K's scale folds into the softmax scale, V's into the output
            scale_log2 = scale_log2 * tl.load(kv_scale_ptr)

        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        bt_row = bt_ptr + b.to(tl.int64) * stride_bt
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            blk = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
            slot = blk * BLOCK_SIZE + (offs_n % BLOCK_SIZE)
            kv_off = slot[:, None] * stride_ct + kvh * stride_ch + offs_d[None, :]
            k = tl.load(k_ptr + kv_off, mask=mask_n[:, None], other=0.0)
            if KV_FP8:
                k = k.to(q.dtype)
            if USE_DOT:
                s = tl.dot(q, tl.trans(k))  # [GROUP_PAD, BLOCK_N] fp32
            else:
                s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
            s = tl.where(mask_n[None, :], s * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + kv_off, mask=mask_n[:, None], other=0.0)
            if KV_FP8:
                v = v.to(q.dtype)
            if USE_DOT:
                pv = tl.dot(p.to(v.dtype), v)
            else:
                pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        if KV_FP8:
            acc = acc * tl.load(kv_scale_ptr + 1)

        if NUM_SPLITS == 1:
            o = acc / l_i[:, None]
            tl.store(
                out_ptr + b * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                o.to(out_ptr.dtype.element_ty),
                mask=mask_g[:, None],
            )
        else:
            # partials: o [B, H, S, D] fp32; ml [B, H, S, 2] fp32 (max in log2 units, sum)
            row = (b * num_heads + heads).to(tl.int64) * NUM_SPLITS + sp
            tl.store(part_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=mask_g[:, None])
            tl.store(part_ml_ptr + row * 2, m_i, mask=mask_g)
            tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=mask_g)

    @triton.jit
    def _combine_splits_kernel(
        part_o_ptr,
        part_ml_ptr,
        out_ptr,
        stride_ot,
        stride_oh,
        num_heads,
        NUM_SPLITS: tl.constexpr,
        SPLITS_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        offs_s = tl.arange(0, SPLITS_PAD)
        offs_d = tl.arange(0, HEAD_DIM)
        mask_s = offs_s < NUM_SPLITS
        row = (b * num_heads + h).to(tl.int64) * NUM_SPLITS + offs_s
        m = tl.load(part_ml_ptr + row * 2, mask=mask_s, other=float("-inf"))
        l = tl.load(part_ml_ptr + row * 2 + 1, mask=mask_s, other=0.0)
        m_max = tl.max(m, 0)
        w = tl.where(mask_s & (m > float("-inf")), tl.exp2(m - m_max), 0.0)
        denom = tl.sum(l * w, 0)
        o = tl.load(part_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], mask=mask_s[:, None], other=0.0)
        res = tl.sum(o * w[:, None], 0) / denom
        tl.store(out_ptr + b * stride_ot + h * stride_oh + offs_d, res.to(out_ptr.dtype.element_ty))


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D], last dim contiguous
    kv_cache: torch.Tensor,  # [2, slots, Hkv, D]
    block_tables: torch.Tensor,  # [B, W] int32/int64
    seq_lens: torch.Tensor,  # [B] int32/int64, each >= 1
    block_size: int,
    scale: float,
    max_context: int,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    kv_scale: torch.Tensor | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """Decode attention over a paged cache. ``max_context`` is a static upper bound on ``seq_lens``.
    An e4m3 cache (``kv_cache.dtype`` float8_e4m3fn) is read directly, with ``kv_scale`` = its [K, V] scales.
    ``config``: launch parameters (default ``DECODE_CONFIG``, ``DECODE_CONFIG_FP8`` for an e4m3 cache).

    No host synchronisation and a grid fixed by (B, Hkv, max_context): safe inside a CUDA graph.
    """
    if not HAS_TRITON:
        raise RuntimeError("paged_decode_attention needs the triton package")
    bsz, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[2]
    group = num_heads // num_kv_heads
    assert num_heads % num_kv_heads == 0 and head_dim == _next_pow2(head_dim), "head_dim must be a power of two"
    assert q.stride(-1) == 1 and kv_cache.stride(-1) == 1
    if out is None:
        out = torch.empty(bsz, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if bsz == 0:
        return out
    kv_fp8 = kv_cache.dtype == torch.float8_e4m3fn
    cfg = config or (DECODE_CONFIG_FP8 if kv_fp8 else DECODE_CONFIG)
    if num_splits is None:
        splits, partition = plan_splits(bsz, num_kv_heads, max_context, q.device, cfg)
    else:
        splits = max(1, num_splits)
        partition = -(-(-(-max(1, max_context) // splits)) // cfg["BLOCK_N"]) * cfg["BLOCK_N"]  # noqa: B002 (ceil division, not a decrement)
        splits = -(-max(1, max_context) // partition)
    use_dot = group >= 8
    group_pad = max(16, _next_pow2(group)) if use_dot else _next_pow2(group)
    if use_dot:
        block_n, num_warps = max(32, cfg["BLOCK_N"]), max(2, cfg["num_warps"])
    else:
        # [group, BLOCK_N, D] float32 products live in registers: more warps for bigger groups
        block_n, num_warps = max(16, cfg["BLOCK_N"] // group_pad), max(cfg["num_warps"], min(8, group_pad))
    if splits > 1:
        part_o = torch.empty(bsz * num_heads * splits * head_dim, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(bsz * num_heads * splits * 2, dtype=torch.float32, device=q.device)
    else:
        part_o = part_ml = out  # unused
    k_view, v_view = kv_cache[0], kv_cache[1]
    if kv_fp8 and kv_scale is None:
        raise ValueError("an FP8 KV cache needs its kv_scale")
    _paged_decode_kernel[(bsz, num_kv_heads, splits)](
        q,
        k_view,
        v_view,
        block_tables,
        seq_lens,
        out,
        part_o,
        part_ml,
        kv_scale if kv_fp8 else out,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        k_view.stride(0),
        k_view.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        partition,
        num_heads,
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        NUM_SPLITS=splits,
        USE_DOT=use_dot,
        KV_FP8=kv_fp8,
        num_warps=num_warps,
        num_stages=cfg["num_stages"],
    )
    if splits > 1:
        _combine_splits_kernel[(bsz, num_heads)](
            part_o,
            part_ml,
            out,
            out.stride(0),
            out.stride(1),
            num_heads,
            NUM_SPLITS=splits,
            SPLITS_PAD=_next_pow2(splits),
            HEAD_DIM=head_dim,
            num_warps=4,
        )
    return out


def _sdpa(q, k, v, **kw):
    """F.scaled_dot_product_attention under PREFILL_SDPA_BACKENDS (on CUDA)."""
    if PREFILL_SDPA_BACKENDS is None or q.device.type != "cuda":
        return F.scaled_dot_product_attention(q, k, v, **kw)
    from torch.nn.attention import sdpa_kernel

    try:  # the list's order is the priority (PyTorch >= 2.6)
        ctx = sdpa_kernel(PREFILL_SDPA_BACKENDS, set_priority=True)
    except TypeError:
        ctx = sdpa_kernel(PREFILL_SDPA_BACKENDS)
    with ctx:
        return F.scaled_dot_product_attention(q, k, v, **kw)


def _causal_sdpa(q, k, v, scale, gqa):
    return _sdpa(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)


def full_prefill_attention(q, k, v, scale: float) -> torch.Tensor:
    """Causal attention of one sequence whose whole context is new; ``[T, H, D]`` (a view when possible)."""
    gqa = q.shape[1] != k.shape[1]
    qi, ki, vi = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if gqa and q.device.type == "cuda":
        rep = q.shape[1] // k.shape[1]
        ki, vi = ki.repeat_interleave(rep, dim=1), vi.repeat_interleave(rep, dim=1)
        gqa = False
    return _causal_sdpa(qi, ki, vi, scale, gqa)[0].transpose(0, 1)


def continuation_attention(q, k, v, scale: float) -> torch.Tensor:
    """Attention of a prompt's new tokens over its whole context, the earlier part from the cache (a
    prefix-cache hit, or a chunked prefill's continuation): ``q`` ``[Q, H, D]``, ``k``/``v`` ``[S, Hkv, D]``,
    S >= Q, the new tokens last; ``[Q, H, D]`` out.

    A fused kernel (flash / memory-efficient) through a lower-right causal bias on 4-D tensors, K/V repeated
    for GQA. The explicit boolean mask over 3-D tensors that this replaces could only run PyTorch's math
    kernel: about 0.5-0.9 ms per layer on the 7B preset, so a step of prompts that hit the prefix cache cost
    more than computing them cold (docs/performance/engine-gpu.md, 'A prefix-cache hit')."""
    qlen, slen = q.shape[0], k.shape[0]
    qi, ki, vi = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if q.shape[1] != k.shape[1]:
        rep = q.shape[1] // k.shape[1]
        ki, vi = ki.repeat_interleave(rep, dim=1), vi.repeat_interleave(rep, dim=1)
    return _sdpa(qi, ki, vi, attn_mask=causal_lower_right(qlen, slen), scale=scale)[0].transpose(0, 1)


def varlen_prefill_ok(q: torch.Tensor, meta: AttentionMetadata) -> bool:
    """Several prefills, every one's whole context new, on a CUDA half-precision tensor: one flash call."""
    return (
        meta.num_prefills > 1
        and q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and q.shape[-1] <= 256
        and meta.prefill_query_lens == meta.prefill_seq_lens
    )


def varlen_prefill_attention(q, k, v, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal flash attention of all prefill sequences of a step in one call (``[T, H, D]`` in and out).

    Per sequence, the loop in ``prefill_attention_sdpa`` costs a handful of host-side dispatches per layer;
    on a step of short prompts that host time, not the GPU, set the step time (``bench/engine/gpu_prefill_lengths.py``:
    about 5 ms per extra sequence on the 7B preset). The cumulative lengths go to the device once per step.
    GQA runs natively (the flash kernel maps query heads onto K/V heads)."""
    total = meta.num_prefill_tokens
    cu = meta.prefill_cu_seqlens
    if cu is None:
        cu = torch.tensor([0, *itertools.accumulate(meta.prefill_query_lens)], dtype=torch.int32).to(q.device)
        meta.prefill_cu_seqlens = cu
    longest = max(meta.prefill_query_lens)
    out = torch.ops.aten._flash_attention_forward(
        q[:total], k[:total], v[:total], cu, cu, longest, longest, 0.0, True, False, scale=scale
    )
    return out[0]


def prefill_attention_sdpa(
    q, k, v, kv_cache, meta: AttentionMetadata, scale: float, out: torch.Tensor, kv_scale=None
) -> int:
    """Prefill part of a step through SDPA; returns the number of prefill tokens written to ``out``."""
    if varlen_prefill_ok(q, meta):
        total = meta.num_prefill_tokens
        out[:total] = varlen_prefill_attention(q, k, v, meta, scale)
        return total
    gqa = q.shape[1] != k.shape[1]
    start = 0
    for i, (qlen, slen) in enumerate(zip(meta.prefill_query_lens, meta.prefill_seq_lens)):
        end = start + qlen
        if qlen == slen:  # whole context new: causal flash attention on [1, H, T, D] views
            qi = q[start:end].transpose(0, 1)[None]
            ki = k[start:end].transpose(0, 1)[None]
            vi = v[start:end].transpose(0, 1)[None]
            if gqa and q.device.type == "cuda":
                rep = q.shape[1] // k.shape[1]
                ki = ki.repeat_interleave(rep, dim=1)
                vi = vi.repeat_interleave(rep, dim=1)
                o = _causal_sdpa(qi, ki, vi, scale, False)
            else:
                o = _causal_sdpa(qi, ki, vi, scale, gqa)
            out[start:end] = o[0].transpose(0, 1)
        else:  # a continuation (prefix-cache hit, chunked prefill): earlier keys come from the cache
            if kv_scale is not None:  # e4m3 cache: gather the bytes, widen with the layer's scales
                ki, vi = gather_kv_fp8(kv_cache, meta.prefill_block_tables[i], slen, meta.block_size, kv_scale, q.dtype)
            else:
                ki, vi = gather_kv(kv_cache, meta.prefill_block_tables[i], slen, meta.block_size)
            if q.device.type == "cuda" and causal_lower_right is not None:
                out[start:end] = continuation_attention(q[start:end], ki, vi, scale)
            else:  # CPU: the explicit mask (SDPA's CPU kernels take it, GQA natively)
                qpos = torch.arange(slen - qlen, slen, device=q.device)[:, None]
                mask = torch.arange(slen, device=q.device)[None, :] <= qpos
                o = _sdpa(
                    q[start:end].transpose(0, 1),
                    ki.transpose(0, 1),
                    vi.transpose(0, 1),
                    attn_mask=mask,
                    scale=scale,
                    enable_gqa=gqa,
                )
                out[start:end] = o.transpose(0, 1)
        start = end
    return start


if HAS_TRITON:

    @triton.jit
    def _write_kv_kernel(
        k_ptr,
        v_ptr,
        cache_k_ptr,
        cache_v_ptr,
        slot_ptr,
        kv_scale_ptr,
        kv_amax_ptr,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_ct,
        stride_ch,
        NUM_KV_HEADS: tl.constexpr,
        HEADS_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        KV_FP8: tl.constexpr = False,
        FP8_LIMIT: tl.constexpr = 448.0,
    ):
        t = tl.program_id(0)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        offs_h = tl.arange(0, HEADS_PAD)
        offs_d = tl.arange(0, HEAD_DIM)
        m = (offs_h[:, None] < NUM_KV_HEADS) & (slot >= 0)
        k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=m)
        v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=m)
        dst = slot * stride_ct + offs_h[:, None] * stride_ch + offs_d[None, :]
        if KV_FP8:  # amax of what is written (calibration), then e4m3 with the layer's scales, saturated
            kf = k.to(tl.float32)
            vf = v.to(tl.float32)
            tl.atomic_max(kv_amax_ptr, tl.max(tl.max(tl.where(m, tl.abs(kf), 0.0), 1), 0))
            tl.atomic_max(kv_amax_ptr + 1, tl.max(tl.max(tl.where(m, tl.abs(vf), 0.0), 1), 0))
            kq = tl.minimum(tl.maximum(kf / tl.load(kv_scale_ptr), -FP8_LIMIT), FP8_LIMIT)
            vq = tl.minimum(tl.maximum(vf / tl.load(kv_scale_ptr + 1), -FP8_LIMIT), FP8_LIMIT)
            tl.store(cache_k_ptr + dst, kq.to(cache_k_ptr.dtype.element_ty), mask=m)
            tl.store(cache_v_ptr + dst, vq.to(cache_v_ptr.dtype.element_ty), mask=m)
        else:
            tl.store(cache_k_ptr + dst, k, mask=m)
            tl.store(cache_v_ptr + dst, v, mask=m)


def write_kv_triton(
    kv_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
    kv_amax: torch.Tensor | None = None,
) -> None:
    """Store new K/V at their slots; a negative slot (CUDA-graph padding) is skipped. An e4m3 cache is
    written quantised with ``kv_scale`` and the written values' amax goes into ``kv_amax``."""
    t, hkv, d = k.shape
    if t == 0:
        return
    ck, cv = kv_cache[0], kv_cache[1]
    kv_fp8 = kv_cache.dtype == torch.float8_e4m3fn
    if kv_fp8 and (kv_scale is None or kv_amax is None):
        raise ValueError("an FP8 KV cache needs kv_scale and kv_amax")
    _write_kv_kernel[(t,)](
        k,
        v,
        ck,
        cv,
        slot_mapping,
        kv_scale if kv_fp8 else k,
        kv_amax if kv_fp8 else k,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        ck.stride(0),
        ck.stride(1),
        NUM_KV_HEADS=hkv,
        HEADS_PAD=_next_pow2(hkv),
        HEAD_DIM=d,
        KV_FP8=kv_fp8,
        FP8_LIMIT=FP8_MAX,
        num_warps=4,
    )


def decode_regime(batch: int, num_kv_heads: int, device: torch.device) -> str:
    """``small`` when the (batch x kv head) programs do not fill the GPU (batch 1..few), else ``large``."""
    return "small" if batch * num_kv_heads < _sm_count(device) else "large"


def tune_decode_configs(
    kv_cache: torch.Tensor,
    num_heads: int,
    block_size: int,
    dtype: torch.dtype,
    points: tuple[tuple[int, int], ...] = ((1, 128), (1, 2048), (64, 1024)),
    verbose: bool = False,
    check: bool = True,
) -> tuple[dict[tuple[bool, str], dict], dict]:
    """Time ``DECODE_CANDIDATES`` on ``kv_cache`` (a layer's real cache, at start-up: nothing is stored in it
    yet) at ``points`` ((batch, context) pairs; batch 1 points are the ``small`` regime), each as a CUDA graph
    of 8 back-to-back launches. Returns ``({(kv_fp8, regime): config}, report)``: the config with the least
    summed time over each regime's points.

    ``check`` (a bf16/fp16 cache): the cache is filled with random values first, and a candidate whose output
    differs from the default config's (or is not finite) at a point is not chosen (``report["rejected"]``):
    the fastest launch must also be right on this device and this SM partition. The cache is zeroed after."""
    from distserve.server.engine.ops.cuda_ops import _graph_ms

    dev = kv_cache.device
    num_kv_heads, head_dim = kv_cache.shape[2], kv_cache.shape[3]
    slots = kv_cache.shape[1]
    kv_fp8 = kv_cache.dtype == torch.float8_e4m3fn
    base = DECODE_CONFIG_FP8 if kv_fp8 else DECODE_CONFIG
    scale = torch.ones(2, dtype=torch.float32, device=dev) if kv_fp8 else None
    g = torch.Generator(device=dev).manual_seed(0)
    sums: dict[str, dict[int, float]] = {"small": {}, "large": {}}
    report: dict = {}
    rejected: list[str] = []
    check = check and not kv_fp8
    if check:
        try:
            kv_cache.normal_(generator=g)
        except Exception as e:  # never let the check stop a start-up
            log.warning("decode tuning: no output check (%s: %s)", type(e).__name__, e)
            check = False
    for batch, ctx in points:
        nb = -(-ctx // block_size)
        if batch * nb * block_size > slots:
            continue
        tables = torch.randperm(slots // block_size, device=dev, generator=g)[: batch * nb].view(batch, nb)
        tables = tables.to(torch.int32)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        q = torch.randn(batch, num_heads, head_dim, device=dev, generator=g).to(dtype)
        out = torch.empty_like(q)
        regime = decode_regime(batch, num_kv_heads, dev)
        row = {}
        ref, tol = None, 0.0
        if check:
            try:
                ref = paged_decode_attention(
                    q, kv_cache, tables, lens, block_size, head_dim**-0.5, ctx, kv_scale=scale, config=base
                ).float()
                tol = 2e-2 * max(1.0, float(ref.abs().max()))
            except Exception as e:  # the default config itself: time without the check at this point
                log.warning("decode tuning: no output check at b%d ctx%d (%s: %s)", batch, ctx, type(e).__name__, e)
                ref = None
        for i, (bn, nw, ns, mp) in enumerate(DECODE_CANDIDATES):
            cfg = dict(base, BLOCK_N=bn, num_warps=nw, num_stages=ns, min_partition=mp)

            def call(_, cfg=cfg):
                paged_decode_attention(
                    q, kv_cache, tables, lens, block_size, head_dim**-0.5, ctx, out=out, kv_scale=scale, config=cfg
                )

            try:
                if ref is not None:
                    out.fill_(float("nan"))
                    call(None)
                    got = out.float()
                    if not bool(torch.isfinite(got).all()) or float((got - ref).abs().max()) > tol:
                        rejected.append(f"b{batch}_ctx{ctx}:{i}")
                        raise ValueError("output differs from the default config's")
                ms = _graph_ms(call, list(range(8)))
            except Exception:  # does not compile here, or computes something else
                ms = float("inf")
            row[str(i)] = round(ms * 1e3, 2)
            sums[regime][i] = sums[regime].get(i, 0.0) + ms
        report[f"b{batch}_ctx{ctx}"] = row
    chosen = {}
    for regime, per in sums.items():
        if per:
            i = min(per, key=lambda j: per[j])
            if per[i] < float("inf"):
                bn, nw, ns, mp = DECODE_CANDIDATES[i]
                chosen[(kv_fp8, regime)] = dict(base, BLOCK_N=bn, num_warps=nw, num_stages=ns, min_partition=mp)
    if check:
        kv_cache.zero_()  # as allocated: the tuning's random values are nobody's KV
    if rejected:
        log.warning("decode tuning rejected candidates whose output was wrong here: %s", rejected)
    report["rejected"] = rejected
    report["chosen"] = {f"{'fp8' if k[0] else 'bf16'}_{k[1]}": v for k, v in chosen.items()}
    if verbose:
        print("decode attention", report)
    return chosen, report


class TritonBackend(AttentionBackend):
    """Prefill: SDPA (flash on CUDA); decode: the Triton paged kernel. CUDA-graph capturable for decode."""

    name = "triton"
    supports_cuda_graph = True  # negative slots are skipped, fixed grid, no host sync in decode
    supports_fp8_kv = True  # an e4m3 cache: written quantised, read directly by the decode kernel

    def __init__(self) -> None:
        # (kv_fp8, decode_regime) -> launch config, from tune_decode_configs; empty: the module defaults
        self.decode_configs: dict[tuple[bool, str], dict] = {}

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float, kv_scale=None, kv_amax=None):
        write_kv_triton(kv_cache, k, v, meta.slot_mapping, kv_scale, kv_amax)
        return self.attend(q, k, v, kv_cache, meta, scale, kv_scale=kv_scale)

    def attend(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float, kv_scale=None):
        """Attention only: the new K/V are already in ``kv_cache`` (an e4m3 one with ``kv_scale``)."""
        if (
            meta.num_prefills == 1
            and not meta.num_decodes
            and meta.prefill_query_lens[0] == meta.prefill_seq_lens[0] == q.shape[0]
        ):
            return full_prefill_attention(q, k, v, scale)  # the prefill worker's common case: no copy
        out = torch.empty_like(q)
        start = prefill_attention_sdpa(q, k, v, kv_cache, meta, scale, out, kv_scale) if meta.num_prefills else 0
        if meta.num_decodes:
            block_tables, seq_lens = meta.decode_inputs()
            paged_decode_attention(
                q[start:],
                kv_cache,
                block_tables,
                seq_lens,
                meta.block_size,
                scale,
                meta.decode_max_seq_len,
                out=out[start:],
                kv_scale=kv_scale,
                config=self.decode_configs.get(
                    (
                        kv_cache.dtype == torch.float8_e4m3fn,
                        decode_regime(seq_lens.shape[0], kv_cache.shape[2], q.device),
                    )
                )
                if self.decode_configs
                else None,
            )
        return out


def triton_available() -> bool:
    return HAS_TRITON


__all__ = [
    "TritonBackend",
    "paged_decode_attention",
    "write_kv_triton",
    "plan_splits",
    "HAS_TRITON",
    "DECODE_CONFIG",
    "DECODE_CONFIG_FP8",
    "tune_decode_configs",
    "prefill_attention_sdpa",
    "varlen_prefill_attention",
    "triton_available",
]
