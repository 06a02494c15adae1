"""Continuous-batching scheduler: which sequences run in the next step, and how many tokens each.

One step may mix decodes (one token each) and prefill chunks under a token
budget (``max_num_batched_tokens``). Running sequences are served first, in
decode-priority order; when blocks run out, the lowest-priority running
sequence is preempted by recompute (its blocks are freed, it goes back to the
waiting queue keeping its generated tokens). Waiting sequences are admitted
only in steps without preemption, so admission never evicts running work.

Policies (vocabulary of DESIGN section 4):
- prefill ``fcfs``: arrival order; ``wfs``: weighted-fair by prompt length —
  shortest first, with aging (``aging_tokens_per_s``) so long prompts never starve.
- decode ``fcfs``: arrival order; ``fewest_remaining``: requests closest to
  completion first (they free their blocks soonest).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from distserve.server.engine.block_manager import BlockManager
from distserve.server.engine.sequence import Sequence, SequenceStatus
from distserve.server.latency_model import PREFILL_AGING_TOKENS_PER_S

PREFILL_POLICIES = ("fcfs", "wfs")
DECODE_POLICIES = ("fcfs", "fewest_remaining")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    prefill_policy: str = "fcfs"
    decode_policy: str = "fcfs"
    aging_tokens_per_s: float = PREFILL_AGING_TOKENS_PER_S  # the router's TTFT prediction assumes this rate

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.prefill_policy not in PREFILL_POLICIES:
            raise ValueError(f"prefill_policy must be one of {PREFILL_POLICIES}, got {self.prefill_policy!r}")
        if self.decode_policy not in DECODE_POLICIES:
            raise ValueError(f"decode_policy must be one of {DECODE_POLICIES}, got {self.decode_policy!r}")


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """True when this step completes the sequence's context, so a token is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Sequences that can never fit (alone larger than the KV pool): aborted.
    rejected: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    # --- queue management --------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Admit a sequence whose KV is already in the cache (decode after a transfer)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --- policy ------------------------------------------------------------
    def _decode_order(self) -> list[Sequence]:
        if self.config.decode_policy == "fewest_remaining":
            return sorted(self.running, key=lambda s: (s.remaining_tokens, s.arrival_time))
        return sorted(self.running, key=lambda s: s.arrival_time)

    def _next_waiting(self) -> Sequence:
        if self.config.prefill_policy == "fcfs":
            return self.waiting[0]
        now = time.monotonic()
        aging = self.config.aging_tokens_per_s

        def score(s: Sequence) -> tuple:
            # preempted work first, then shortest effective length
            return (s.num_preemptions == 0, s.num_uncomputed_tokens - aging * (now - s.arrival_time))

        return min(self.waiting, key=score)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    # --- the step ----------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager
        order = self._decode_order()
        scheduled_ids: set[int] = set()
        while order and budget > 0:
            seq = order.pop(0)
            if seq not in self.running:  # preempted earlier in this loop
                continue
            num_new = min(seq.num_uncomputed_tokens, budget)
            needed = seq.num_computed_tokens + num_new
            while not bm.can_grow(seq, needed):
                victims = [s for s in reversed(self._decode_order()) if id(s) not in scheduled_ids]
                victim = victims[0]
                if victim is seq and len(self.running) == 1 and bm.never_fits(needed):
                    self.running.remove(seq)
                    bm.free(seq)
                    out.rejected.append(seq)
                    break
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq not in self.running:
                continue
            bm.grow(seq, needed)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            scheduled_ids.add(id(seq))
            budget -= num_new

        if not out.preempted:
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                seq = self._next_waiting()
                cached = bm.claim_prefix(seq)  # cached KV of its first blocks, if prefix caching is on
                num_new = min(seq.num_uncomputed_tokens, budget)
                needed = seq.num_computed_tokens + num_new
                if not bm.can_grow(seq, needed):
                    bm.free(seq)  # give the claimed prefix back (it stays cached)
                    if not self.running and not out.scheduled and bm.never_fits(needed):
                        self.waiting.remove(seq)  # larger than the whole pool: never fits
                        out.rejected.append(seq)
                        continue
                    break
                self.waiting.remove(seq)
                bm.grow(seq, needed)
                bm.record_lookup(seq.num_tokens, cached)
                if seq.num_cached_tokens is None:  # usage.prompt_tokens_details.cached_tokens
                    seq.num_cached_tokens = cached
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                out.scheduled.append(ScheduledSeq(seq, num_new))
                budget -= num_new
        # prefill chunks first, decodes after: the layout the model runner expects
        out.scheduled.sort(key=lambda s: s.num_new_tokens == 1)
        return out
