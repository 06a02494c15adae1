"""Attention through ``torch.nn.functional.scaled_dot_product_attention`` (CPU and GPU).

Prefills run one SDPA call per sequence (causal; with an explicit mask when
earlier tokens of the sequence are already cached, i.e. chunked prefill or a
re-admitted sequence). Decodes run as one batched call over the padded block
tables with a key-padding mask, so a decode step costs one call per layer
whatever the batch size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from distserve.server.engine.attention.base import AttentionBackend, AttentionMetadata, gather_kv, write_kv
from distserve.server.engine.fp8 import FP8_DTYPE, as_bytes, dequantize, gather_kv_fp8, write_kv_fp8


class SdpaBackend(AttentionBackend):
    name = "sdpa"
    supports_fp8_kv = True  # an e4m3 cache with per-layer scales (fp8.py): quantised on write, widened on read

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float, kv_scale=None, kv_amax=None):
        if kv_scale is None:
            write_kv(kv_cache, k, v, meta.slot_mapping)
        else:
            write_kv_fp8(kv_cache, k, v, meta.slot_mapping, kv_scale, kv_amax)
        out = torch.empty_like(q)
        gqa = q.shape[1] != k.shape[1]
        start = 0
        for i, (qlen, slen) in enumerate(zip(meta.prefill_query_lens, meta.prefill_seq_lens)):
            end = start + qlen
            qi = q[start:end].transpose(0, 1)  # [H, qlen, D]
            if qlen == slen:  # the whole context is new: no cache read needed
                ki, vi = k[start:end], v[start:end]
                mask, causal = None, True
            elif kv_scale is not None:
                ki, vi = gather_kv_fp8(kv_cache, meta.prefill_block_tables[i], slen, meta.block_size, kv_scale, q.dtype)
                mask, causal = _continuation_mask(qlen, slen, q.device), False
            else:
                ki, vi = gather_kv(kv_cache, meta.prefill_block_tables[i], slen, meta.block_size)
                # query j sits at absolute position slen - qlen + j and sees keys <= it
                qpos = torch.arange(slen - qlen, slen, device=q.device)[:, None]
                mask = torch.arange(slen, device=q.device)[None, :] <= qpos
                causal = False
            o = F.scaled_dot_product_attention(
                qi,
                ki.transpose(0, 1),
                vi.transpose(0, 1),
                attn_mask=mask,
                is_causal=causal,
                scale=scale,
                enable_gqa=gqa,
            )
            out[start:end] = o.transpose(0, 1)
            start = end
        if meta.num_decodes:
            if kv_scale is None:
                out[start:] = self._decode(q[start:], kv_cache, meta, scale, gqa)
            else:
                out[start:] = self._decode_fp8(q[start:], kv_cache, meta, scale, gqa, kv_scale)
        return out

    @staticmethod
    def _decode_fp8(q, kv_cache, meta: AttentionMetadata, scale: float, gqa: bool, kv_scale):
        return sdpa_decode(q, kv_cache, meta, scale, gqa, kv_scale)

    @staticmethod
    def _decode(q, kv_cache, meta: AttentionMetadata, scale: float, gqa: bool):
        return sdpa_decode(q, kv_cache, meta, scale, gqa, None)


def sdpa_decode(q, kv_cache, meta: AttentionMetadata, scale: float, gqa: bool, kv_scale):
    """All decode rows in one SDPA call over the padded block tables (an e4m3 cache widened with ``kv_scale``)."""
    block_tables, seq_lens = meta.decode_inputs()
    bs = meta.block_size
    nb = kv_cache.shape[1] // bs
    max_blocks = -(-meta.decode_max_seq_len // bs)
    tables = block_tables[:, :max_blocks]
    b = tables.shape[0]
    # index_select over whole blocks (rows of bs*Hkv*D) copies at memcpy speed; advanced
    # indexing (paged[:, tables]) took twice as long on CPU (bench: 1.6 vs 3.1 ms, B=32, L=160)
    rows = as_bytes(kv_cache).view(2, nb, -1).index_select(1, tables.reshape(-1))
    kv = rows.view(2, b, max_blocks * bs, *kv_cache.shape[2:])  # [2, B, L, Hkv, D]
    if kv_scale is not None:  # widen the e4m3 rows read: [2, ...] * [2] scales
        kv = dequantize(kv.view(FP8_DTYPE), kv_scale.view(2, 1, 1, 1, 1), q.dtype)
    length = kv.shape[2]
    mask = torch.arange(length, device=q.device)[None, :] < seq_lens[:, None]
    # The padded tail reads whatever the padding blocks and the last block's unused slots hold: another
    # sequence's KV, or a finished one's. Masked out, but a NaN/inf there would still reach the output (the
    # masked score is NaN + -inf, and 0 * NaN of V), failing this row for another request's bad KV: zero it.
    kv.masked_fill_(~mask[None, :, :, None, None], 0)  # kv is this call's own copy (index_select / dequantize)
    o = F.scaled_dot_product_attention(
        q[:, :, None, :],  # [B, H, 1, D]
        kv[0].transpose(1, 2),
        kv[1].transpose(1, 2),  # [B, Hkv, L, D]
        attn_mask=mask[:, None, None, :],
        scale=scale,
        enable_gqa=gqa,
    )
    return o[:, :, 0, :]


def _continuation_mask(qlen: int, slen: int, device) -> torch.Tensor:
    """Query j of a continuation sits at absolute position ``slen - qlen + j`` and sees keys <= it."""
    qpos = torch.arange(slen - qlen, slen, device=device)[:, None]
    return torch.arange(slen, device=device)[None, :] <= qpos
