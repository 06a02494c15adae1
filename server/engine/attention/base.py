"""The attention-backend seam.

A backend gets the flattened tokens of one engine step — prefills first, then
decodes — and the paged cache of one layer. It writes the new K/V into the
cache (``slot_mapping``) and returns the attention output. Backends differ only
in how they compute; the metadata and cache layout are shared, so ``auto`` can
pick per device without the model or the scheduler noticing.

Cache layout per layer: ``[2, num_blocks * block_size, num_kv_heads, head_dim]``
(index 0 = K, 1 = V); slot ``s`` is block ``s // block_size``, offset
``s % block_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64, cache slot of each new token
    block_size: int
    # Prefill part: the first num_prefill_tokens tokens, one span per sequence.
    prefill_query_lens: list[int]
    prefill_seq_lens: list[int]  # context length after this step (computed + new)
    prefill_block_tables: list[torch.Tensor]  # int64 block ids per prefill sequence
    # Decode part: one token per sequence after the prefill tokens.
    decode_seq_lens: torch.Tensor | None  # [num_decodes] int64
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] int64 (padded with 0)
    decode_max_seq_len: int = 0
    # int32 [num_prefills + 1] on the device: cumulative prefill query lengths, built on first use in a step
    # by a backend that runs all whole-new prefills in one variable-length attention call
    prefill_cu_seqlens: torch.Tensor | None = None

    @property
    def num_prefills(self) -> int:
        return len(self.prefill_query_lens)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(self.prefill_query_lens)

    @property
    def num_decodes(self) -> int:
        return 0 if self.decode_seq_lens is None else int(self.decode_seq_lens.shape[0])

    def decode_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(block_tables, seq_lens) of the decode rows; call only when num_decodes > 0."""
        if self.decode_block_tables is None or self.decode_seq_lens is None:
            raise ValueError("attention metadata has no decode rows")
        return self.decode_block_tables, self.decode_seq_lens


class AttentionBackend:
    name = "base"

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        raise NotImplementedError


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    kv_cache[0].index_copy_(0, slot_mapping, k)
    kv_cache[1].index_copy_(0, slot_mapping, v)


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, block_size: int):
    """K and V of one sequence as contiguous ``[seq_len, num_kv_heads, head_dim]`` tensors."""
    nb = kv_cache.shape[1] // block_size
    rows = kv_cache.view(2, nb, -1).index_select(1, block_table)
    kv = rows.view(2, -1, *kv_cache.shape[2:])[:, :seq_len]
    return kv[0], kv[1]
