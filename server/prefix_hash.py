"""The chained digests that name full KV blocks: one function, shared by the block manager and the router.

A full block of ``block_size`` tokens is named by a digest of its tokens and of the digest of the block
before it, so one digest stands for the whole prefix up to the end of that block (vLLM's automatic prefix
caching). The worker's block manager caches blocks under these digests; the router computes the same
digests from a prompt's token ids to ask "how many leading blocks of this prompt does worker W hold?"
(``server/router/prefix_index.py``). Both import them from here, so the two can never disagree.
"""

from __future__ import annotations

import hashlib
from array import array

ROOT = b"distserve-prefix-v1"  # the "parent" of a sequence's first block
DIGEST_BYTES = 16


def block_digest(parent: bytes, token_ids: list[int]) -> bytes:
    """Digest of one full block given the digest of the prefix before it (16 bytes, blake2b).

    Cryptographic so that two different prefixes never share a digest in practice: a
    collision would hand one request another request's KV."""
    h = hashlib.blake2b(parent, digest_size=DIGEST_BYTES)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def chain_digests(token_ids: list[int], block_size: int, max_blocks: int | None = None) -> list[bytes]:
    """Digests of the leading full blocks of ``token_ids`` (at most ``max_blocks``), first block first."""
    n = len(token_ids) // block_size
    if max_blocks is not None:
        n = min(n, max_blocks)
    out: list[bytes] = []
    parent = ROOT
    for i in range(n):
        parent = block_digest(parent, token_ids[i * block_size : (i + 1) * block_size])
        out.append(parent)
    return out


def cacheable_blocks(num_tokens: int, block_size: int) -> int:
    """Full blocks a sequence of ``num_tokens`` can take from a prefix cache: one token is always computed
    (the step that computes it samples the next token), as ``BlockManager.claim_prefix`` does."""
    return max(0, (num_tokens - 1) // block_size)
