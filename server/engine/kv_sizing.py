"""KV cache size from device memory (vLLM's ``gpu_memory_utilization`` convention).

The worker may use ``utilization`` of the device's total memory. Weights and the peak of a
profiling forward at the largest batch the scheduler can form are measured first; the KV cache
gets what is left. Kept pure (numbers in, numbers out) so the arithmetic is tested on CPU; the
measuring lives in ``LLMEngine._profile_kv_blocks``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVBudget:
    """What the sizing saw and decided, reported at startup (log line and worker /metrics)."""

    total_bytes: int  # the device's memory
    utilization: float  # share of total_bytes this worker may use
    peak_bytes: int  # weights + activations at the profiling forward (torch's peak allocated)
    non_torch_bytes: int  # this process's device memory outside torch's allocator (cuBLAS workspaces, ...)
    free_bytes: int  # free on the device when sizing (other processes' memory is not this worker's budget)
    block_bytes: int  # one KV block, all layers, K and V
    num_blocks: int

    @property
    def kv_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def describe(self) -> str:
        gib = 2**30
        return (
            f"KV cache {self.num_blocks} blocks = {self.kv_bytes / gib:.2f} GiB "
            f"(gpu_memory_utilization {self.utilization:.2f} of {self.total_bytes / gib:.1f} GiB; "
            f"weights+activations peak {self.peak_bytes / gib:.2f} GiB, "
            f"outside torch {self.non_torch_bytes / gib:.2f} GiB)"
        )


def kv_blocks_from_memory(
    total_bytes: int,
    utilization: float,
    peak_bytes: int,
    non_torch_bytes: int,
    block_bytes: int,
    free_bytes: int | None = None,
    reserve_bytes: int = 256 * 2**20,
) -> KVBudget:
    """Blocks that fit in ``utilization * total - peak - non_torch`` (this worker's share, as in vLLM:
    two workers on one GPU take e.g. 0.45 each), and in what is actually free minus
    ``reserve_bytes`` (CUDA graphs and the allocator's slack come after sizing); ValueError (saying
    what to change) when not even one block fits."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    if total_bytes <= 0 or block_bytes <= 0 or peak_bytes < 0 or non_torch_bytes < 0:
        raise ValueError("memory figures must be positive")
    free = int(total_bytes * utilization) - peak_bytes - non_torch_bytes
    if free_bytes is not None:
        free = min(free, free_bytes - reserve_bytes)
    else:
        free_bytes = total_bytes - peak_bytes - non_torch_bytes
    num_blocks = free // block_bytes
    if num_blocks < 1:
        gib = 2**30
        raise ValueError(
            f"no room for the KV cache: gpu_memory_utilization {utilization} of {total_bytes / gib:.1f} GiB "
            f"(device free {free_bytes / gib:.2f} GiB) leaves {free / gib:.2f} GiB after weights+activations "
            f"({peak_bytes / gib:.2f} GiB) and memory "
            f"outside torch ({non_torch_bytes / gib:.2f} GiB); raise cache.gpu_memory_utilization, lower "
            f"prefill.max_num_batched_tokens, or set cache.num_gpu_blocks"
        )
    return KVBudget(total_bytes, utilization, peak_bytes, non_torch_bytes, free_bytes, block_bytes, num_blocks)
