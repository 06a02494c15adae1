"""The KV pool sized from memory measured at start-up, in vLLM's order.

A worker on a GPU (``cache.gpu_memory_utilization`` > 0) sizes its KV pool from what it measured, not
from constants:

1. **weights**: torch's allocated bytes right after the model load;
2. **activations**: one profiling forward at the largest step the scheduler forms
   (``max_num_batched_tokens``, capped by ``max_model_len``) on a KV cache just big enough for it; the
   peak of torch's allocated bytes, less that small cache;
3. **start-up graphs**: what the start-up set-up keeps (kernel tuning that needs no pool, the decode
   CUDA graphs and the sampler's CUDA graphs) is captured over that small cache and *measured* —
   torch's reserved bytes and the memory outside torch (graph executables, cuBLAS workspaces, loaded
   kernels), read from the device — then released again (the graphs point into the small cache);
4. the KV pool gets what is left of the worker's budget — its share of the device, or its own
   process limit when lower (an MPS client's ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``, less the CUDA
   context) — after weights + activations, the start-up graphs, what stays outside torch, the
   configured buffers (staging pool, KV gathered or received outside the pool) and the headroom;
5. the real pool is allocated and the set-up runs again for good (graphs captured over it).

A budget that cannot hold one sequence of the longest length raises ``MemoryBudgetError`` naming
every number (the worker exits 2 with that sentence; ``distserve serve`` repeats it and stops).

The device queries go through :class:`MemoryProbe` (``torch.cuda`` on a GPU); tests pass a fake one
to check the arithmetic and the order on a CPU. The start-up log line (``StartupMemory.describe``)
gives every figure.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from distserve.server.engine.kv_sizing import KVBudget, kv_blocks_from_memory

_GIB = 2**30


class MemoryProbe:
    """The device's memory as this process sees it (``torch.cuda``; a fake in CPU tests)."""

    def __init__(self, device) -> None:
        self.device = device

    def synchronize(self) -> None:
        import torch

        torch.cuda.synchronize(self.device)

    def empty_cache(self) -> None:
        import torch

        torch.cuda.empty_cache()

    def mem_info(self) -> tuple[int, int]:
        """(free, total) as CUDA reports them to this process."""
        import torch

        free, total = torch.cuda.mem_get_info(self.device)
        return int(free), int(total)

    def allocated(self) -> int:
        import torch

        return int(torch.cuda.memory_allocated(self.device))

    def reserved(self) -> int:
        import torch

        return int(torch.cuda.memory_reserved(self.device))

    def max_allocated(self) -> int:
        import torch

        return int(torch.cuda.max_memory_allocated(self.device))

    def reset_peak(self) -> None:
        import torch

        torch.cuda.reset_peak_memory_stats(self.device)


_LIMIT_RE = re.compile(r"^\s*(?:(\d+)\s*=\s*)?(\d+(?:\.\d+)?)\s*([KMGT]?)B?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def pinned_limit_bytes(value: str | None, device_index: int = 0) -> int | None:
    """``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` ('0=38000M,1=2G', or one value for every device) for one device
    index, in bytes; None when unset or not given for that device. ValueError for an entry it cannot read."""
    if not value or not value.strip():
        return None
    found = None
    for part in value.split(","):
        if not part.strip():
            continue
        m = _LIMIT_RE.match(part)
        if m is None:
            raise ValueError(f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT entry {part.strip()!r} is not [INDEX=]SIZE[K|M|G]")
        idx, num, unit = m.group(1), float(m.group(2)), m.group(3).upper()
        if idx is None or int(idx) == device_index:
            found = int(num * _UNITS[unit])
    return found


@dataclass
class StartupMemory:
    """What the start-up measured (bytes), for the log and /v1/workers."""

    reported_total: int = 0  # mem_get_info's total as this process saw it (an MPS client may see its limit)
    reported_free: int = 0  # and its free, at the sizing
    weights: int = 0
    peak: int = 0  # weights + activations of the profiling forward
    profile_tokens: int = 0
    startup_measured: int = 0  # start-up graphs, measured over the profiling cache (released again)
    startup_final: int = -1  # what the final set-up kept, measured after it (-1: not measured yet)
    process_limit: int = 0  # the process's own limit less the context allowance; 0 = none
    phases: list[str] = field(default_factory=list)  # the order the sizing ran in (tests read it)

    def describe(self, budget: KVBudget | None = None) -> str:
        gib = _GIB
        parts = [
            f"weights {self.weights / gib:.2f} GiB",
            f"activations peak {max(0, self.peak - self.weights) / gib:.2f} GiB at {self.profile_tokens} tokens",
            f"graphs {self.startup_measured / gib:.2f} GiB measured before sizing"
            + (f", {self.startup_final / gib:.2f} GiB kept after start" if self.startup_final >= 0 else ""),
        ]
        if budget is not None:
            parts.append(f"KV pool {budget.kv_bytes / gib:.2f} GiB ({budget.num_blocks} blocks)")
            parts.append(f"share {budget.share_bytes / gib:.2f} GiB of {budget.total_bytes / gib:.1f} GiB")
        parts.append(f"process limit {self.process_limit / gib:.2f} GiB" if self.process_limit else "no process limit")
        parts.append(f"CUDA reports {self.reported_free / gib:.2f} free of {self.reported_total / gib:.2f} GiB")
        return "start-up memory: " + ", ".join(parts)

    def to_dict(self) -> dict:
        mib = 2**20
        return {
            "reported_total_mib": self.reported_total // mib,
            "reported_free_mib": self.reported_free // mib,
            "startup_measured_mib": self.startup_measured // mib,
            "startup_final_mib": self.startup_final // mib if self.startup_final >= 0 else None,
            "process_limit_mib": self.process_limit // mib,
        }


@dataclass(frozen=True)
class SizingInputs:
    """The engine's side of the sizing: configured numbers (bytes)."""

    utilization: float
    block_bytes: int
    min_blocks: int
    profile_tokens: int
    device_total: int = 0  # the device's memory when the process sees less (0 = what CUDA reports)
    process_limit: int = 0  # the process's own ceiling less the context allowance (0 = none)
    reserved: int = 0  # staging pool + KV held outside the pool (gathered or received)
    headroom: int = 0


def size_kv_pool(
    probe: MemoryProbe,
    inputs: SizingInputs,
    free_at_start: int,
    weights: int,
    profile: Callable[[], int],
    setup: Callable[[], None],
    teardown: Callable[[], None],
    drop_cache: Callable[[], None],
    report: StartupMemory | None = None,
) -> tuple[KVBudget, StartupMemory]:
    """Measure, in order: the profiling forward (``profile()`` runs it on a small cache and returns that
    cache's bytes), the start-up set-up over that cache (``setup()``: what it adds is what the final set-up
    takes again), ``teardown()`` (its graphs released), ``drop_cache()`` (the small cache released); then
    size the pool from what is left.

    ``free_at_start``: the device's free bytes before the engine allocated anything (so memory outside
    torch is this process's, not another's); ``weights``: torch's allocated bytes after the load."""
    rep = report or StartupMemory()
    rep.weights, rep.profile_tokens, rep.process_limit = weights, inputs.profile_tokens, inputs.process_limit
    probe.synchronize()
    probe.reset_peak()
    rep.phases.append("profile")
    small_cache = profile()
    probe.synchronize()
    rep.peak = max(weights, probe.max_allocated() - small_cache)
    probe.empty_cache()  # the profiling forward's activations are not the graphs' cost
    before = process_used(probe, free_at_start)
    rep.phases.append("setup")
    setup()
    probe.synchronize()
    probe.empty_cache()  # the tuners' scratch; the graphs' pools stay (their graphs hold them)
    graphs = max(0, process_used(probe, free_at_start) - before)
    rep.phases.append("teardown")
    teardown()
    probe.synchronize()
    rep.phases.append("drop_cache")
    drop_cache()
    probe.empty_cache()
    # the final set-up takes the graphs again; what this one left allocated (it should be nothing) stays
    # on top (memory it left outside torch is in the non-torch figure below)
    rep.startup_measured = graphs + max(0, probe.allocated() - weights)
    free, total = probe.mem_info()
    rep.reported_free, rep.reported_total = free, total
    total = max(total, inputs.device_total)
    non_torch = max(0, free_at_start - free - probe.reserved())
    rep.phases.append("size")
    budget = kv_blocks_from_memory(
        total,
        inputs.utilization,
        rep.peak,
        non_torch,
        inputs.block_bytes,
        # the activations are not allocated now but will be at the largest step
        free_bytes=free - (rep.peak - probe.allocated()),
        reserved_bytes=inputs.reserved,
        headroom_bytes=inputs.headroom,
        min_blocks=inputs.min_blocks,
        startup_bytes=rep.startup_measured,
        limit_bytes=inputs.process_limit,
        weights_bytes=weights,
        profile_tokens=inputs.profile_tokens,
    )
    return budget, rep


def process_used(probe: MemoryProbe, free_at_start: int) -> int:
    """This process's device memory now (torch's reserved + outside torch, from ``free_at_start``)."""
    free, _ = probe.mem_info()
    return max(probe.reserved(), free_at_start - free)


__all__ = ["MemoryProbe", "SizingInputs", "StartupMemory", "pinned_limit_bytes", "process_used", "size_kv_pool"]
