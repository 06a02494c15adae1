"""``flash_attn_v2`` backend: prefill through ``flash_attn_varlen_func``, decode through the Triton kernel.

Available when the ``flash_attn`` package imports (CUDA only). All prefill
sequences of a step go into one varlen call; a chunked prefill (earlier tokens
already cached) gets its full K/V gathered from the cache, and flash-attn's
causal mask, aligned to the bottom-right corner when ``seqlen_q < seqlen_k``,
gives exactly "query j sees keys <= its absolute position". Decodes use the
Triton paged kernel when Triton is there, else the SDPA backend's batched path.
"""

from __future__ import annotations

import torch

from distserve.server.engine.attention.base import AttentionBackend, AttentionMetadata, gather_kv, write_kv
from distserve.server.engine.attention.sdpa import SdpaBackend
from distserve.server.engine.attention.triton_decode import HAS_TRITON, paged_decode_attention, write_kv_triton

try:  # pragma: no cover - optional dependency
    from flash_attn import flash_attn_varlen_func

    HAS_FLASH_ATTN = True
except Exception:
    flash_attn_varlen_func = None
    HAS_FLASH_ATTN = False


class FlashAttnBackend(AttentionBackend):
    name = "flash_attn_v2"
    supports_cuda_graph = HAS_TRITON

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float):
        if HAS_TRITON:
            write_kv_triton(kv_cache, k, v, meta.slot_mapping)
        else:
            write_kv(kv_cache, k, v, meta.slot_mapping)
        return self.attend(q, k, v, kv_cache, meta, scale)

    def attend(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float):
        out = torch.empty_like(q)
        start = 0
        if meta.num_prefills:
            ks, vs, cu_q, cu_k = [], [], [0], [0]
            for i, (qlen, slen) in enumerate(zip(meta.prefill_query_lens, meta.prefill_seq_lens)):
                end = start + qlen
                if qlen == slen:
                    ks.append(k[start:end])
                    vs.append(v[start:end])
                else:
                    ki, vi = gather_kv(kv_cache, meta.prefill_block_tables[i], slen, meta.block_size)
                    ks.append(ki)
                    vs.append(vi)
                cu_q.append(cu_q[-1] + qlen)
                cu_k.append(cu_k[-1] + slen)
                start = end
            dev = q.device
            o = flash_attn_varlen_func(
                q[:start],
                torch.cat(ks) if len(ks) > 1 else ks[0],
                torch.cat(vs) if len(vs) > 1 else vs[0],
                torch.tensor(cu_q, dtype=torch.int32, device=dev),
                torch.tensor(cu_k, dtype=torch.int32, device=dev),
                max(meta.prefill_query_lens),
                max(meta.prefill_seq_lens),
                softmax_scale=scale,
                causal=True,
            )
            out[:start] = o
        if meta.num_decodes:
            if HAS_TRITON:
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
                )
            else:
                out[start:] = SdpaBackend._decode(q[start:], kv_cache, meta, scale, q.shape[1] != k.shape[1])
        return out
