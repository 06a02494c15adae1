"""Turns a scheduled step into tensors, runs the model, returns the logits to sample from.

Also owns the KV pool (one ``[2, num_blocks * block_size, kv_heads, head_dim]``
tensor per layer) and the two copies that cross process boundaries in
disaggregated serving: ``gather_kv`` (prefill side, blocks → contiguous) and
``scatter_kv`` (decode side, contiguous → blocks).
"""

from __future__ import annotations

from typing import Any

import torch

from distserve.server.engine.attention import AttentionMetadata
from distserve.server.engine.fp8 import KVCalibration, as_bytes, dequantize, is_fp8, observed_amax, quantize
from distserve.server.engine.model import LlamaForCausalLM
from distserve.server.engine.model_config import ModelConfig
from distserve.server.engine.scheduler import ScheduledSeq


def _token_span(seq, start: int, end: int) -> list[int]:
    """``seq.all_token_ids[start:end]`` without building the whole list."""
    prompt, n = seq.prompt_token_ids, len(seq.prompt_token_ids)
    if end <= n:
        return prompt[start:end]
    if start >= n:
        return seq.output_token_ids[start - n : end - n]
    return prompt[start:] + seq.output_token_ids[: end - n]


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return cfg.num_hidden_layers * 2 * block_size * cfg.num_key_value_heads * cfg.head_dim * elem


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        kv_dtype: torch.dtype | None = None,
        kv_scale_init: float = 1.0,
        kv_calibration_requests: int = 0,
        kv_storage: torch.Tensor | None = None,
    ) -> None:
        cfg = model.config
        self.model = model
        self.config = cfg
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = device
        self.dtype = dtype  # compute dtype (what gather_kv hands out for a cache in it)
        self.kv_dtype = kv_dtype or dtype  # the cache's storage dtype
        if kv_storage is not None:  # one exported allocation of every layer (kv_arena.py: KV by reference)
            shape = (cfg.num_hidden_layers, 2, num_blocks * block_size, cfg.num_key_value_heads, cfg.head_dim)
            if tuple(kv_storage.shape) != shape or kv_storage.dtype != self.kv_dtype:
                raise ValueError(f"KV storage {tuple(kv_storage.shape)} {kv_storage.dtype}, expected {shape}")
            self.kv_caches = list(kv_storage.unbind(0))
        else:
            self.kv_caches = [
                torch.zeros(
                    2,
                    num_blocks * block_size,
                    cfg.num_key_value_heads,
                    cfg.head_dim,
                    dtype=self.kv_dtype,
                    device=device,
                )
                for _ in range(cfg.num_hidden_layers)
            ]
        # FP8 cache: per-layer [K, V] scales and running amax, read and updated by the attention kernels
        self.kv_calibration: KVCalibration | None = None
        layers: Any = model.layers
        if is_fp8(self.kv_dtype):
            cal = KVCalibration.create(cfg.num_hidden_layers, device, kv_scale_init, kv_calibration_requests)
            self.kv_calibration = cal
            for i, layer in enumerate(layers):
                layer.self_attn.kv_scale, layer.self_attn.kv_amax = cal.scales[i], cal.amax[i]
        else:
            for layer in layers:
                layer.self_attn.kv_scale = layer.self_attn.kv_amax = None
        self.graph_runner = None  # CudaGraphRunner for all-decode steps on CUDA (cuda_graph_runner.py)

    def _slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        """Run one step; returns float32 logits, one row per entry with ``samples`` true."""
        if self.graph_runner is not None:
            logits = self.graph_runner.execute(scheduled)
            if logits is not None:
                return logits
        # Plain lists, then one tensor for all the step's integers (views are cut from it): this runs
        # every step, and on a CPU a decode step of a small model is mostly Python and dispatch.
        bs = self.block_size
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        pf_qlens, pf_slens, pf_tables = [], [], []
        dec_slens, dec_tables = [], []
        sample_rows: list[int] = []
        for s in scheduled:
            seq, n = s.seq, s.num_new_tokens
            start = seq.num_computed_tokens
            end = start + n
            table = seq.block_table
            if n == 1:  # decode (or a one-token prefill chunk): the token at `start`, without copying the context
                prompt = seq.prompt_token_ids
                tokens.append(prompt[start] if start < len(prompt) else seq.output_token_ids[start - len(prompt)])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
                dec_slens.append(end)
                dec_tables.append(table)
            else:
                tokens.extend(_token_span(seq, start, end))
                positions.extend(range(start, end))
                slots.extend(self._slots(table, start, end))
                pf_qlens.append(n)
                pf_slens.append(end)
                pf_tables.append(torch.tensor(table, dtype=torch.long, device=self.device))
            if s.samples:
                sample_rows.append(len(tokens) - 1)
        t, nd = len(tokens), len(dec_tables)
        flat = tokens + positions + slots
        width = 0
        if nd:
            width = max(len(tb) for tb in dec_tables)
            flat += dec_slens
            for tb in dec_tables:
                flat += tb
                if len(tb) < width:
                    flat += [0] * (width - len(tb))
        ints = torch.tensor(flat, dtype=torch.long, device=self.device)
        off = 3 * t
        dec_slens_t: torch.Tensor | None = None
        dec_table_t: torch.Tensor | None = None
        if nd:
            dec_slens_t = ints[off : off + nd]
            dec_table_t = ints[off + nd : off + nd + nd * width].view(nd, width)
        meta = AttentionMetadata(
            slot_mapping=ints[2 * t : 3 * t],
            block_size=bs,
            prefill_query_lens=pf_qlens,
            prefill_seq_lens=pf_slens,
            prefill_block_tables=pf_tables,
            decode_seq_lens=dec_slens_t,
            decode_block_tables=dec_table_t,
            decode_max_seq_len=max(dec_slens, default=0),
        )
        hidden = self.model(ints[:t], ints[t : 2 * t], self.kv_caches, meta, max(positions))
        if not sample_rows:
            return torch.empty(0, self.config.vocab_size)
        if len(sample_rows) < t:  # prefill chunks: only each sequence's last row is sampled
            hidden = hidden[torch.tensor(sample_rows, dtype=torch.long, device=self.device)]
        return self.model.compute_logits(hidden)

    # --- KV movement for disaggregation -----------------------------------
    @torch.inference_mode()
    def gather_kv(self, block_table: list[int], num_tokens: int) -> torch.Tensor:
        """``[num_layers, 2, num_tokens, kv_heads, head_dim]`` contiguous copy on the cache's device."""
        # Slot ids built with torch on the host and sent without a stream sync (a pageable copy is
        # staged at once): a blocking copy would wait for every GPU op already queued, e.g. the
        # previous request's gather. Each layer is gathered straight into its slice of the result
        # (no torch.stack: half the memory traffic). Profiled on an H200 (docs/performance/serving-two-gpus.md).
        bs = self.block_size
        table = torch.tensor(block_table[: -(-num_tokens // bs)], dtype=torch.long)
        slots = (table[:, None] * bs + torch.arange(bs)).reshape(-1)[:num_tokens]
        slots = slots.to(self.device, non_blocking=True)
        first = self.kv_caches[0]
        out = torch.empty(
            (len(self.kv_caches), 2, num_tokens, *first.shape[2:]), dtype=first.dtype, device=first.device
        )
        raw = as_bytes(out)  # an e4m3 cache is copied as its bytes (the scales travel beside it: kv_scales)
        for layer, c in enumerate(self.kv_caches):
            torch.index_select(as_bytes(c), 1, slots, out=raw[layer])
        return out

    def kv_scales(self) -> list[list[float]] | None:
        """The FP8 cache's per-layer [K, V] scales (a device sync), or None for a cache in the compute dtype."""
        cal = self.kv_calibration
        return None if cal is None else cal.scales.tolist()

    @torch.inference_mode()
    def scatter_kv(self, block_table: list[int], kv: torch.Tensor, kv_scales: list[list[float]] | None = None) -> None:
        """Write a hand-off's KV (``gather_kv``'s layout) into this runner's blocks, converting once:
        an e4m3 payload needs its ``kv_scales``; into an e4m3 cache, values are quantised with this
        cache's scales (bytes copied as they are when the scales are equal), and count towards its
        calibration amax."""
        num_tokens = kv.shape[2]
        slots = torch.tensor(self._slots(block_table, 0, num_tokens), dtype=torch.long, device=self.device)
        kv = kv.to(device=self.device)
        src_scales = None
        if is_fp8(kv.dtype):
            if kv_scales is None:
                raise ValueError("FP8 KV arrived without its kv_scales")
            src_scales = torch.tensor(kv_scales, dtype=torch.float32, device=self.device)
        cal = self.kv_calibration
        if cal is not None and src_scales is not None and torch.equal(src_scales, cal.scales):
            for layer, cache in enumerate(self.kv_caches):  # same scales: the bytes as they came
                as_bytes(cache).index_copy_(1, slots, as_bytes(kv[layer]))
            seen = (observed_amax(kv, dim=(2, 3, 4)) * src_scales).nan_to_num_(nan=0.0, posinf=0.0)
            torch.maximum(cal.amax, seen, out=cal.amax)
            return
        for layer, cache in enumerate(self.kv_caches):
            x = kv[layer]
            if src_scales is not None:  # widen the e4m3 payload with its own scales
                x = dequantize(x, src_scales[layer].view(2, 1, 1, 1), torch.float32)
            if cal is None:
                cache.index_copy_(1, slots, x.to(self.dtype))
                continue
            amax = observed_amax(x, dim=(1, 2, 3))
            torch.maximum(cal.amax[layer], amax, out=cal.amax[layer])
            q = quantize(x, cal.scales[layer].view(2, 1, 1, 1))
            as_bytes(cache).index_copy_(1, slots, as_bytes(q))

    def kv_shape(self, num_tokens: int) -> tuple[int, ...]:
        c = self.config
        return (c.num_hidden_layers, 2, num_tokens, c.num_key_value_heads, c.head_dim)
