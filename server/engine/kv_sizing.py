"""KV cache size from device memory (vLLM's ``gpu_memory_utilization`` convention).

The worker may use ``utilization`` of the device's total memory: the whole of
``cache.gpu_memory_utilization`` when it has the GPU to itself, its share of it when several
workers share one GPU (``server.memory_budget`` splits the device budget by
``prefill.memory_share`` / ``decode.memory_share``). Weights and the peak of a profiling forward at
the largest batch the scheduler can form are measured first; what the worker allocates after the
KV cache (its KV staging pool, receive buffers for pulled KV, decode CUDA graphs) is reserved, and
``headroom`` is left free for what nobody sizes (cuBLAS handles and workspaces of new threads, the
allocator's slack); the KV cache gets the rest. A worker whose share cannot hold one sequence of
the longest length it serves after all that refuses to start (:class:`MemoryBudgetError`, one
sentence). Kept pure (numbers in, numbers out) so the arithmetic is tested on CPU; the measuring
lives in ``server.engine.memory_profile`` (the order: weights, profiling forward, start-up graphs
captured and measured, then the KV pool from what is left).

Two ceilings apply: the share (``utilization`` of the device's total) and, when the process runs
under a per-process limit (an MPS client with ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``), that limit less
the CUDA context's allowance (``limit_bytes``): whichever is lower.
"""

from __future__ import annotations

from dataclasses import dataclass

_GIB = 2**30


class MemoryBudgetError(ValueError):
    """This worker's share of the device cannot hold what it needs; the message says what to change."""


@dataclass(frozen=True)
class KVBudget:
    """What the sizing saw and decided, reported at startup (log line, /metrics, /v1/workers)."""

    total_bytes: int  # the device's memory
    utilization: float  # share of total_bytes this worker may use
    peak_bytes: int  # weights + activations at the profiling forward (torch's peak allocated)
    non_torch_bytes: int  # this process's device memory outside torch's allocator (cuBLAS workspaces, ...)
    free_bytes: int  # free on the device when sizing (other processes' memory is not this worker's budget)
    block_bytes: int  # one KV block, all layers, K and V
    num_blocks: int
    reserved_bytes: int = 0  # allocated after the KV cache: staging pool, receive buffers (configured)
    headroom_bytes: int = 0  # left free inside the share
    startup_bytes: int = 0  # measured: decode and sampler CUDA graphs captured before the sizing
    limit_bytes: int = 0  # this process's own ceiling (an MPS pinned limit less the context); 0 = none
    weights_bytes: int = 0  # measured after the load (part of peak_bytes)
    profile_tokens: int = 0  # tokens of the profiling forward

    @property
    def budget_bytes(self) -> int:
        """What this worker may hold: its share, or its process limit when that is lower."""
        share = self.share_bytes
        return min(share, self.limit_bytes) if self.limit_bytes else share

    @property
    def kv_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def share_bytes(self) -> int:
        return int(self.total_bytes * self.utilization)

    def describe(self) -> str:
        gib = _GIB
        limit = f"process limit {self.limit_bytes / gib:.2f} GiB" if self.limit_bytes else "no process limit"
        return (
            f"KV cache {self.num_blocks} blocks = {self.kv_bytes / gib:.2f} GiB "
            f"(gpu_memory_utilization {self.utilization:.2f} of {self.total_bytes / gib:.1f} GiB, {limit}; "
            f"weights {self.weights_bytes / gib:.2f} GiB, "
            f"weights+activations peak {self.peak_bytes / gib:.2f} GiB at {self.profile_tokens} tokens, "
            f"start-up graphs {self.startup_bytes / gib:.2f} GiB (measured), "
            f"outside torch {self.non_torch_bytes / gib:.2f} GiB, "
            f"reserved {self.reserved_bytes / gib:.2f} GiB, headroom {self.headroom_bytes / gib:.2f} GiB)"
        )

    def to_dict(self) -> dict:
        """The sizing in MiB, as /v1/workers shows it."""
        mib = 2**20
        return {
            "gpu_memory_utilization": round(self.utilization, 4),
            "device_mib": self.total_bytes // mib,
            "share_mib": self.share_bytes // mib,
            "limit_mib": self.limit_bytes // mib,
            "budget_mib": self.budget_bytes // mib,
            "weights_mib": self.weights_bytes // mib,
            "weights_activations_mib": self.peak_bytes // mib,
            "activations_mib": max(0, self.peak_bytes - self.weights_bytes) // mib,
            "profile_tokens": self.profile_tokens,
            "startup_graphs_mib": self.startup_bytes // mib,
            "outside_torch_mib": self.non_torch_bytes // mib,
            "reserved_mib": self.reserved_bytes // mib,
            "headroom_mib": self.headroom_bytes // mib,
            "kv_cache_mib": self.kv_bytes // mib,
            "kv_blocks": self.num_blocks,
            "free_at_sizing_mib": self.free_bytes // mib,
        }


def kv_blocks_from_memory(
    total_bytes: int,
    utilization: float,
    peak_bytes: int,
    non_torch_bytes: int,
    block_bytes: int,
    free_bytes: int | None = None,
    reserve_bytes: int = 256 * 2**20,
    *,
    reserved_bytes: int = 0,
    headroom_bytes: int = 0,
    min_blocks: int = 1,
    startup_bytes: int = 0,
    limit_bytes: int = 0,
    weights_bytes: int = 0,
    profile_tokens: int = 0,
) -> KVBudget:
    """Blocks that fit in ``budget - peak - non_torch - startup - reserved - headroom``, where the budget
    is this worker's share (``utilization * total``, as in vLLM: two workers on one GPU take e.g. 0.45
    each) or its process limit (``limit_bytes``) when lower, and in what is actually free minus
    ``reserve_bytes`` (the allocator's slack), ``startup``, ``reserved`` and ``headroom``;
    MemoryBudgetError (one sentence naming the numbers and what to change) when fewer than
    ``min_blocks`` fit."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    if total_bytes <= 0 or block_bytes <= 0 or peak_bytes < 0 or non_torch_bytes < 0:
        raise ValueError("memory figures must be positive")
    if reserved_bytes < 0 or headroom_bytes < 0 or startup_bytes < 0 or limit_bytes < 0 or min_blocks < 1:
        raise ValueError("reserved, headroom, start-up and limit bytes must be >= 0 and min_blocks >= 1")
    after = reserved_bytes + headroom_bytes + startup_bytes
    share = int(total_bytes * utilization)
    budget = min(share, limit_bytes) if limit_bytes else share
    free = budget - peak_bytes - non_torch_bytes - after
    if free_bytes is not None:
        free = min(free, free_bytes - reserve_bytes - after)
    else:
        free_bytes = total_bytes - peak_bytes - non_torch_bytes
    num_blocks = max(0, free) // block_bytes
    if num_blocks < min_blocks:
        gib = _GIB
        limit = f", process limit {limit_bytes / gib:.2f} GiB" if limit_bytes else ""
        raise MemoryBudgetError(
            f"no room for the KV cache: gpu_memory_utilization {utilization:.3f} of {total_bytes / gib:.1f} GiB "
            f"({share / gib:.2f} GiB{limit}; device free {free_bytes / gib:.2f} GiB) leaves "
            f"{max(0, free) / gib:.2f} GiB for the KV cache "
            f"(need {min_blocks * block_bytes / gib:.2f} GiB for one sequence of the longest length) after "
            f"weights ({weights_bytes / gib:.2f} GiB) and activations "
            f"({max(0, peak_bytes - weights_bytes) / gib:.2f} GiB at {profile_tokens} tokens), "
            f"CUDA graphs ({startup_bytes / gib:.2f} GiB, measured), "
            f"memory outside torch ({non_torch_bytes / gib:.2f} GiB), "
            f"staging pool and KV buffers ({reserved_bytes / gib:.2f} GiB) and headroom "
            f"({headroom_bytes / gib:.2f} GiB); raise cache.gpu_memory_utilization or this role's memory_share, "
            f"lower prefill.max_num_batched_tokens, or set cache.num_gpu_blocks"
        )
    return KVBudget(
        total_bytes,
        utilization,
        peak_bytes,
        non_torch_bytes,
        free_bytes,
        block_bytes,
        num_blocks,
        reserved_bytes=reserved_bytes,
        headroom_bytes=headroom_bytes,
        startup_bytes=startup_bytes,
        limit_bytes=limit_bytes,
        weights_bytes=weights_bytes,
        profile_tokens=profile_tokens,
    )
