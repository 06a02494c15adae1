"""A request inside one engine, and its explicit state machine.

::

      add_request            schedule (blocks allocated)
    ───────────▶ WAITING ─────────────────────────────▶ RUNNING ──┐
                   ▲                                   ▲  │        │ stop condition
                   │     preempt (blocks freed, recompute)│        ▼
                   └───────────────────────────────────┼──┘   FINISHED_STOPPED
                                                       │      FINISHED_LENGTH
      reserve_prefilled (blocks allocated)             │
    ───────────▶ WAITING_FOR_REMOTE_KVS ───────────────┘ commit_prefilled (KV written)
                                                   (decode side of a KV transfer)
          abort (any non-finished state) ──────────────────▶  FINISHED_ABORTED
                                                              (engine failures too, with ``error``)
          prefill-only request after token #1 ─────────────▶  FINISHED_PREFILLED

Terminal states are ordered after every live state, so ``status > RUNNING``
means "finished". A preempted sequence keeps the tokens it generated: on
re-admission its prompt is ``prompt + outputs`` and it is prefilled again
(recompute), which gives the same tokens as before because sampling is a pure
function of (seed, token index) — see ``sampler.py``.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from distserve.server.engine.sampling_params import SamplingParams


class SequenceStatus(enum.IntEnum):
    WAITING = 0
    WAITING_FOR_REMOTE_KVS = 1  # blocks reserved, KV being pulled from a prefill worker (vLLM's name)
    RUNNING = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_PREFILLED = 6

    @property
    def is_finished(self) -> bool:
        return self > SequenceStatus.RUNNING

    @property
    def finish_reason(self) -> str | None:
        return {
            SequenceStatus.FINISHED_STOPPED: "stop",
            SequenceStatus.FINISHED_LENGTH: "length",
            SequenceStatus.FINISHED_ABORTED: "abort",
            SequenceStatus.FINISHED_PREFILLED: "prefilled",
        }.get(self)


@dataclass(eq=False)  # identity, not field-by-field: `seq in running` was O(prompt length) per compare
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    # A prefill-only sequence stops after sampling token #1 and keeps its KV
    # blocks until the worker has staged them for transfer.
    prefill_only: bool = False
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    # Tokens whose KV is in the cache. A sequence is "in prefill" while this is
    # below num_tokens - 1, i.e. more than the newest token is still missing.
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    stop_reason: int | None = None
    error: str | None = None  # why it was aborted by the engine (its own fault, named), else None
    # prefix caching (block_manager.py): digests of the first full blocks of all_token_ids
    # (valid for ever: tokens are only appended), and how many blocks were offered to the cache
    block_digests: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    # prompt tokens whose KV came from the prefix cache at first admission (None: not admitted by
    # this engine's scheduler, e.g. a decode worker's KV arrived from a prefill worker)
    num_cached_tokens: int | None = None
    # the sampler's penalty counts on the device (sampler.PenaltyState), rebuilt from the ids when None
    sampler_state: Any = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def remaining_tokens(self) -> int:
        return self.sampling_params.max_tokens - len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        return self.num_uncomputed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished
