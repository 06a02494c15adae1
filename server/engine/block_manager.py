"""Paged KV-cache bookkeeping: which physical blocks each sequence owns.

The block pool itself (the tensors) lives in ``model_runner.py``; this module only
hands out block ids. Blocks are reference counted so that a block can be shared
(prefix caching) and leaves use exactly when its last owner lets go.

Prefix caching (vLLM's "automatic prefix caching", ``enable_prefix_caching``).
A *full* block is named by a digest of its tokens and of the digest of the block
before it, so one digest stands for the whole prefix up to the end of that block.
Once every slot of a block holds computed KV, its owner ``register``s it: the block
is then in the cache under its digest and is never written again (a sequence only
ever appends to its last, partial block). When the last owner frees a cached block,
its KV stays where it is: the block is *evictable* — counted as free, handed out
again only after every never-cached free block is gone, least recently freed first,
and only then does its digest leave the cache. A new sequence ``claim_prefix``es the
longest run of cached blocks that starts at its first token, takes a reference on
each (an evictable block becomes used again) and starts computing after them.

Free-block accounting is unchanged for callers: ``num_free_blocks`` counts never-used
and evictable blocks alike, so "KV blocks used" still drops to 0 when all work is done.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from distserve.server.engine.sequence import Sequence
from distserve.server.prefix_hash import ROOT as _ROOT
from distserve.server.prefix_hash import block_digest, cacheable_blocks

__all__ = ["BlockManager", "block_digest"]  # block_digest lives in server/prefix_hash.py (shared with the router)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self.num_leased = 0  # blocks taken with take_blocks, neither adopted by a sequence nor given back yet
        # prefix cache: digest -> block, block -> digest; evictable = cached blocks nobody holds,
        # oldest first (they count as free)
        self._cached: dict[bytes, int] = {}
        self._digest_of: dict[int, bytes] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.num_cache_queries = 0  # tokens of admitted sequences looked up (record_lookup)
        self.num_cache_hits = 0  # of those, tokens found cached
        # bumped whenever a digest enters or leaves the cache: the heartbeat resends its summary then
        self.cache_version = 0

    # --- queries -----------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_missing_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks ``seq`` still needs so that its table covers ``num_tokens`` slots."""
        return max(0, self.blocks_needed(num_tokens) - len(seq.block_table))

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= self.num_free_blocks

    def never_fits(self, num_tokens: int) -> bool:
        """For a sequence asked while no other sequence runs: ``num_tokens`` will never fit. Blocks held by
        no running sequence come back — leases (``take_blocks``: adopted or given back), finished prefills
        whose KV is about to be taken, reservations for KV on its way — so what fits the whole pool waits
        for them; only what is larger than the pool never fits."""
        return not self.can_allocate(num_tokens) and self.blocks_needed(num_tokens) > self.num_blocks

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.num_missing_blocks(seq, num_tokens) <= self.num_free_blocks

    # --- mutations ---------------------------------------------------------
    def _take_free_block(self) -> int:
        if self._free:
            return self._free.popleft()
        block, _ = self._evictable.popitem(last=False)  # least recently freed cached block
        del self._cached[self._digest_of.pop(block)]
        self.cache_version += 1
        return block

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Extend ``seq.block_table`` to cover ``num_tokens`` slots."""
        missing = self.num_missing_blocks(seq, num_tokens)
        if missing > self.num_free_blocks:
            raise RuntimeError(
                f"out of KV blocks: request {seq.request_id} needs {missing}, "
                f"{self.num_free_blocks} free (callers must check can_grow first)"
            )
        for _ in range(missing):
            block = self._take_free_block()
            self.ref_counts[block] = 1
            seq.block_table.append(block)

    def take_blocks(self, n: int) -> list[int] | None:
        """``n`` blocks with one reference each, held by no sequence (a KV lease: by_reference.py), or
        None when fewer are free. ``adopt`` hands them to a sequence, ``give_back`` frees them."""
        if n > self.num_free_blocks:
            return None
        blocks = [self._take_free_block() for _ in range(n)]
        for block in blocks:
            self.ref_counts[block] = 1
        self.num_leased += n
        return blocks

    def adopt(self, seq: Sequence, blocks: list[int]) -> None:
        """Leased ``blocks`` (``take_blocks``) become ``seq``'s block table."""
        if any(self.ref_counts[b] != 1 for b in blocks) or len(blocks) > self.num_leased:
            raise RuntimeError(f"blocks adopted by {seq.request_id} were not leased")
        seq.block_table = list(blocks)
        self.num_leased -= len(blocks)

    def give_back(self, blocks: list[int]) -> None:
        """Free blocks taken with ``take_blocks`` and never adopted (last first, as ``free``)."""
        for block in reversed(blocks):
            if self.ref_counts[block] != 1:
                raise RuntimeError(f"block {block} given back with ref count {self.ref_counts[block]}")
            self.ref_counts[block] = 0
            self.num_leased -= 1
            if block in self._digest_of:  # pragma: no cover - a leased block is never registered
                self._evictable[block] = None
            else:
                self._free.append(block)

    def _ref(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self._evictable[block]
        self.ref_counts[block] += 1

    def free(self, seq: Sequence) -> None:
        # last block first: a cached prefix is evicted from its tail, so what stays cached is
        # still reachable from the prefix's first block (lookups stop at the first miss)
        for block in reversed(seq.block_table):
            count = self.ref_counts[block]
            if count <= 0:
                raise RuntimeError(f"double free of block {block} by {seq.request_id}")
            self.ref_counts[block] = count - 1
            if count == 1:
                if block in self._digest_of:
                    self._evictable[block] = None  # newest at the end
                else:
                    self._free.append(block)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0

    # --- prefix caching ----------------------------------------------------
    def _digests(self, seq: Sequence, num_full_blocks: int) -> list[bytes]:
        """Digests of ``seq``'s first ``num_full_blocks`` blocks (memoised on the sequence)."""
        digests = seq.block_digests
        if len(digests) < num_full_blocks:
            tokens = seq.all_token_ids
            bs = self.block_size
            parent = digests[-1] if digests else _ROOT
            for i in range(len(digests), num_full_blocks):
                parent = block_digest(parent, tokens[i * bs : (i + 1) * bs])
                digests.append(parent)
        return digests

    def claim_prefix(self, seq: Sequence) -> int:
        """Give a sequence that owns no blocks the longest cached prefix of its tokens.

        At least one token is always left to compute (the step that computes it samples
        the next token), so a fully cached context reuses all blocks but its last. Sets
        ``seq.block_table`` and ``seq.num_computed_tokens``; returns the cached tokens."""
        if not self.enable_prefix_caching or seq.block_table or seq.num_computed_tokens:
            return 0
        bs = self.block_size
        max_blocks = cacheable_blocks(seq.num_tokens, bs)
        if max_blocks == 0 or not self._cached:
            return 0
        blocks: list[int] = []
        for digest in self._digests(seq, max_blocks):
            block = self._cached.get(digest)
            if block is None:
                break
            blocks.append(block)
        for block in blocks:
            self._ref(block)
        seq.block_table = blocks
        seq.num_computed_tokens = len(blocks) * bs
        return seq.num_computed_tokens

    def cached_digests(self, limit: int) -> tuple[int, list[bytes]]:
        """(cache_version, up to ``limit`` cached digests, the most recently cached last): the worker's prefix
        summary (``server/wire.py`` ``WorkerStatus.prefix_blocks``). Safe from another thread: copying a
        dict's keys holds the GIL; a copy that races a resize is retried."""
        for _ in range(3):
            try:
                version = self.cache_version
                keys = list(self._cached)
                return version, keys[-limit:] if limit else []
            except RuntimeError:  # changed size during the copy
                continue
        return -1, []  # -1: no summary this time (the router keeps none rather than a wrong one)

    def record_lookup(self, num_tokens: int, num_cached: int) -> None:
        """Count one admitted sequence's lookup (a claim given back because the sequence did not
        fit yet is not counted: it is looked up again when it is admitted)."""
        if self.enable_prefix_caching:
            self.num_cache_queries += num_tokens
            self.num_cache_hits += num_cached

    def register(self, seq: Sequence) -> None:
        """Put ``seq``'s blocks whose every slot now holds computed KV into the cache."""
        if not self.enable_prefix_caching:
            return
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if full <= seq.num_registered_blocks:
            return
        digests = self._digests(seq, full)
        for i in range(seq.num_registered_blocks, full):
            block, digest = seq.block_table[i], digests[i]
            if block not in self._digest_of and digest not in self._cached:
                self._cached[digest] = block
                self._digest_of[block] = digest
                self.cache_version += 1
            # else: already cached (a claimed block), or the same prefix computed twice at
            # once: the first copy stays the cached one, this one is freed normally
        seq.num_registered_blocks = full

    def check_invariants(self) -> None:
        """Raise if the free list, the evictable set and the ref counts disagree."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a block is on the free list twice")
        if free & set(self._evictable):
            raise AssertionError("a block is both free and evictable")
        if self.num_leased < 0:
            raise AssertionError(f"{self.num_leased} blocks leased")
        for block, count in enumerate(self.ref_counts):
            if count < 0:
                raise AssertionError(f"block {block} has ref count {count}")
            idle = block in free or block in self._evictable
            if (count == 0) != idle:
                raise AssertionError(f"block {block}: ref count {count}, free or evictable {idle}")
        for block in self._evictable:
            if block not in self._digest_of:
                raise AssertionError(f"evictable block {block} has no digest")
        if len(self._cached) != len(self._digest_of) or any(
            self._cached.get(d) != b for b, d in self._digest_of.items()
        ):
            raise AssertionError("prefix-cache maps disagree")
        if free & set(self._digest_of):
            raise AssertionError("a block on the free list still has a digest")
