"""Which worker holds which prefix: the router's index of the workers' prefix-cache summaries.

Each worker's heartbeat may carry the digests of the full KV blocks its prefix cache holds
(``server/wire.py`` ``WorkerStatus.prefix_blocks``; digests from ``server/prefix_hash.py``, the function
the block manager names its blocks with). The index maps digest → workers. A summary *replaces* what was
known of that worker (never merges), so a worker's evictions and a restarted worker's empty cache show at
once; a worker that dies, is replaced, leaves or is forgotten loses its entries (``drop``). A summary older
than ``max_age_s`` counts as none. Between summaries, a prompt a worker has just prefilled is added to its
entries (``note_prefilled``: the next turn of a chat often comes before the next heartbeat); the next full
summary replaces those guesses with what the worker really holds.

Scoring (``expected_hits``): the number of leading full blocks of the prompt whose chained digests a worker
holds — a chained digest stands for the whole prefix up to its block, so that is exactly the number of
blocks ``BlockManager.claim_prefix`` would reuse there (barring evictions since the summary).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from distserve.server.prefix_hash import cacheable_blocks, chain_digests
from distserve.server.wire import WorkerStatus


@dataclass
class _Summary:
    digests: set[bytes]
    version: int
    block_size: int
    at: float  # monotonic time it was last confirmed (a full summary, or a heartbeat of the same version)


@dataclass
class PrefixIndex:
    max_age_s: float = 10.0
    by_digest: dict[bytes, set[str]] = field(default_factory=dict)
    of_worker: dict[str, _Summary] = field(default_factory=dict)

    def drop(self, worker_id: str) -> None:
        old = self.of_worker.pop(worker_id, None)
        if old is None:
            return
        for d in old.digests:
            holders = self.by_digest.get(d)
            if holders is not None:
                holders.discard(worker_id)
                if not holders:
                    del self.by_digest[d]

    def update(self, worker_id: str, status: WorkerStatus, now: float | None = None) -> None:
        """Apply one heartbeat's (or registration's) status to ``worker_id``'s entries."""
        now = time.monotonic() if now is None else now
        if status.prefix_block_size == 0:  # no prefix caching there
            self.drop(worker_id)
            return
        if status.prefix_blocks is None:  # "unchanged": true only if we hold that very version
            have = self.of_worker.get(worker_id)
            if have is not None and have.version == status.prefix_version:
                have.at = now
            else:
                self.drop(worker_id)  # a summary we missed: ours is out of date; the next full one restores it
            return
        self.drop(worker_id)  # replace, never merge
        digests = {bytes.fromhex(h) for h in status.prefix_blocks}
        self.of_worker[worker_id] = _Summary(digests, status.prefix_version, status.prefix_block_size, now)
        for d in digests:
            self.by_digest.setdefault(d, set()).add(worker_id)

    def note_prefilled(self, worker_id: str, token_ids: list[int]) -> None:
        """``worker_id`` just prefilled ``token_ids``: expect their full blocks in its cache now, before its
        next summary says so (a chat's next turn often arrives within one heartbeat interval). The entries
        live until that worker's next full summary replaces them; only added to a summary we hold."""
        s = self.of_worker.get(worker_id)
        if s is None:
            return
        for d in chain_digests(token_ids, s.block_size):
            if d not in s.digests:
                s.digests.add(d)
                self.by_digest.setdefault(d, set()).add(worker_id)

    def fresh(self, worker_id: str, now: float | None = None) -> bool:
        s = self.of_worker.get(worker_id)
        now = time.monotonic() if now is None else now
        return s is not None and now - s.at <= self.max_age_s

    def num_blocks(self, worker_id: str) -> int:
        s = self.of_worker.get(worker_id)
        return len(s.digests) if s is not None else 0

    def expected_hits(self, token_ids: list[int], worker_ids: list[str], now: float | None = None) -> dict[str, int]:
        """Per worker, the leading full blocks of ``token_ids`` it holds (0 for a stale or missing summary)."""
        now = time.monotonic() if now is None else now
        out = dict.fromkeys(worker_ids, 0)
        by_size: dict[int, list[str]] = {}
        for w in worker_ids:
            s = self.of_worker.get(w)
            if s is not None and now - s.at <= self.max_age_s:
                by_size.setdefault(s.block_size, []).append(w)
        for bs, ws in by_size.items():
            live = set(ws)
            for i, d in enumerate(chain_digests(token_ids, bs, cacheable_blocks(len(token_ids), bs))):
                live &= self.by_digest.get(d, set())
                if not live:
                    break
                for w in live:
                    out[w] = i + 1
        return out

    def block_size_of(self, worker_id: str) -> int:
        s = self.of_worker.get(worker_id)
        return s.block_size if s is not None else 0
