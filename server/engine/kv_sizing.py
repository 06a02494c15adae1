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
lives in ``LLMEngine._profile_kv_blocks``.
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
    reserved_bytes: int = 0  # allocated after the KV cache: staging pool, receive buffers, CUDA graphs
    headroom_bytes: int = 0  # left free inside the share

    @property
    def kv_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def share_bytes(self) -> int:
        return int(self.total_bytes * self.utilization)

    def describe(self) -> str:
        gib = _GIB
        return (
            f"KV cache {self.num_blocks} blocks = {self.kv_bytes / gib:.2f} GiB "
            f"(gpu_memory_utilization {self.utilization:.2f} of {self.total_bytes / gib:.1f} GiB; "
            f"weights+activations peak {self.peak_bytes / gib:.2f} GiB, "
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
            "weights_activations_mib": self.peak_bytes // mib,
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
) -> KVBudget:
    """Blocks that fit in ``utilization * total - peak - non_torch - reserved - headroom`` (this
    worker's share, as in vLLM: two workers on one GPU take e.g. 0.45 each), and in what is actually
    free minus ``reserve_bytes`` (the allocator's slack), ``reserved`` and ``headroom``;
    MemoryBudgetError (one sentence saying what to change) when fewer than ``min_blocks`` fit."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    if total_bytes <= 0 or block_bytes <= 0 or peak_bytes < 0 or non_torch_bytes < 0:
        raise ValueError("memory figures must be positive")
    if reserved_bytes < 0 or headroom_bytes < 0 or min_blocks < 1:
        raise ValueError("reserved and headroom bytes must be >= 0 and min_blocks >= 1")
    after = reserved_bytes + headroom_bytes
    free = int(total_bytes * utilization) - peak_bytes - non_torch_bytes - after
    if free_bytes is not None:
        free = min(free, free_bytes - reserve_bytes - after)
    else:
        free_bytes = total_bytes - peak_bytes - non_torch_bytes
    num_blocks = max(0, free) // block_bytes
    if num_blocks < min_blocks:
        gib = _GIB
        raise MemoryBudgetError(
            f"no room for the KV cache: gpu_memory_utilization {utilization:.3f} of {total_bytes / gib:.1f} GiB "
            f"(device free {free_bytes / gib:.2f} GiB) leaves {max(0, free) / gib:.2f} GiB for the KV cache "
            f"(need {min_blocks * block_bytes / gib:.2f} GiB for one sequence of the longest length) after "
            f"weights+activations ({peak_bytes / gib:.2f} GiB), "
            f"memory outside torch ({non_torch_bytes / gib:.2f} GiB), "
            f"staging pool, receive buffers and CUDA graphs ({reserved_bytes / gib:.2f} GiB) and headroom "
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
    )
