"""Paged KV-cache bookkeeping: which physical blocks each sequence owns.

The block pool itself (the tensors) lives in ``kv_cache.py``; this module only
hands out block ids. Blocks are reference counted so that a block can be shared
(``fork``) and is returned to the free list exactly when its last owner lets go.
"""

from __future__ import annotations

from collections import deque

from server.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    # --- queries -----------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_missing_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks ``seq`` still needs so that its table covers ``num_tokens`` slots."""
        return max(0, self.blocks_needed(num_tokens) - len(seq.block_table))

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= len(self._free)

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.num_missing_blocks(seq, num_tokens) <= len(self._free)

    # --- mutations ---------------------------------------------------------
    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Extend ``seq.block_table`` to cover ``num_tokens`` slots."""
        missing = self.num_missing_blocks(seq, num_tokens)
        if missing > len(self._free):
            raise RuntimeError(
                f"out of KV blocks: request {seq.request_id} needs {missing}, "
                f"{len(self._free)} free (callers must check can_grow first)"
            )
        for _ in range(missing):
            block = self._free.popleft()
            self.ref_counts[block] = 1
            seq.block_table.append(block)

    def fork(self, src: Sequence, dst: Sequence) -> None:
        """Let ``dst`` share every block of ``src`` (prefix sharing)."""
        if dst.block_table:
            raise RuntimeError(f"fork target {dst.request_id} already owns blocks")
        for block in src.block_table:
            self.ref_counts[block] += 1
        dst.block_table = list(src.block_table)

    def free(self, seq: Sequence) -> None:
        for block in seq.block_table:
            count = self.ref_counts[block]
            if count <= 0:
                raise RuntimeError(f"double free of block {block} by {seq.request_id}")
            self.ref_counts[block] = count - 1
            if count == 1:
                self._free.append(block)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def check_invariants(self) -> None:
        """Raise if the free list and the ref counts disagree (used by tests and /health)."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a block is on the free list twice")
        for block, count in enumerate(self.ref_counts):
            if count < 0:
                raise AssertionError(f"block {block} has ref count {count}")
            if (count == 0) != (block in free):
                raise AssertionError(f"block {block}: ref count {count}, on free list {block in free}")
