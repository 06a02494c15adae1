"""Layouts the planner can deploy: colocated replicas, or P prefill + D decode workers, with their batch
limits and (on CPU) torch threads, and the scheduler limits each worker runs with (read from the same
config the server reads, mapped the way ``server.workers.worker.engine_config_for`` maps it)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from distserve.server.config import DistServeConfig


@dataclass(frozen=True)
class EngineLimits:
    """The scheduler knobs of one worker's engine (``server.engine.scheduler.SchedulerConfig``)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    prefill_policy: str = "fcfs"  # fcfs | wfs
    decode_policy: str = "fcfs"  # fcfs | fewest_remaining
    aging_tokens_per_s: float = 1000.0
    kv_tokens: int = 0  # KV-cache capacity in tokens; 0 = not a limit (sized from device memory)


@dataclass(frozen=True)
class Layout:
    mode: str  # colocated | disaggregated
    num_prefill: int  # 0 when colocated
    num_decode: int  # decode workers, or colocated replicas
    prefill: EngineLimits
    decode: EngineLimits  # decode workers, or every colocated replica
    prefill_threads: int = 1  # CPU: torch threads per prefill worker
    decode_threads: int = 1  # CPU: per decode worker / colocated replica
    sm_split: tuple[int, int] | None = None  # 1P1D on one GPU as MPS clients: (prefill %, decode %) of its SMs

    @property
    def workers(self) -> int:
        return self.num_prefill + self.num_decode

    def devices(self, device: str) -> int:
        """GPUs used (one worker per GPU), or cores used on CPU (threads per worker, summed)."""
        if device == "cpu":
            return self.num_prefill * self.prefill_threads + self.num_decode * self.decode_threads
        return 1 if self.sm_split else self.workers

    def name(self, device: str = "cuda") -> str:
        if self.mode == "colocated":
            base = f"{self.num_decode} colocated"
        else:
            base = f"{self.num_prefill}P{self.num_decode}D"
        if self.sm_split:
            base += f" on 1 GPU, SM {self.sm_split[0]}:{self.sm_split[1]}"
        extra = []
        if device == "cpu" and (self.prefill_threads > 1 or self.decode_threads > 1):
            extra.append(
                f"threads {self.prefill_threads}/{self.decode_threads}"
                if self.num_prefill
                else f"{self.decode_threads} threads"
            )
        extra.append(f"batch<={self.decode.max_num_seqs}")
        return f"{base} ({', '.join(extra)})"


def kv_capacity_tokens(cfg: DistServeConfig, device: str, kv_bytes_per_token: int) -> int:
    """Tokens of KV one worker holds when the config fixes it (blocks, or MiB when not sized from GPU memory);
    0 when it is sized from device memory (not known here: treated as no limit)."""
    cache = cfg.cache
    if cache.num_gpu_blocks:
        return cache.num_gpu_blocks * cache.block_size
    if device != "cpu" and cache.gpu_memory_utilization > 0:
        return 0
    return cache.kv_cache_memory_mb * 2**20 // max(1, kv_bytes_per_token)


def limits_from_config(cfg: DistServeConfig, kv_tokens: int = 0) -> tuple[EngineLimits, EngineLimits, EngineLimits]:
    """(prefill worker, decode worker, colocated worker) limits, as the workers build their engines."""
    pf, dc = cfg.prefill, cfg.decode
    tokens = pf.max_num_batched_tokens
    return (
        EngineLimits(pf.max_batch_size, tokens, prefill_policy="wfs", kv_tokens=kv_tokens),
        EngineLimits(
            min(dc.max_batch_size, dc.max_concurrent_requests),
            tokens,
            decode_policy="fewest_remaining",
            kv_tokens=kv_tokens,
        ),
        EngineLimits(dc.max_batch_size, tokens, kv_tokens=kv_tokens),
    )


def enumerate_layouts(
    cfg: DistServeConfig, device: str, devices: int, batch_limits: tuple[int, ...] = (), kv_bytes_per_token: int = 0
) -> list[Layout]:
    """Every layout that fits ``devices`` exactly (GPUs, or cores on CPU), for each decode batch limit."""
    kv = kv_capacity_tokens(cfg, device, kv_bytes_per_token) if kv_bytes_per_token else 0
    pf, dec, col = limits_from_config(cfg, kv)
    out: list[Layout] = []
    thread_choices = range(1, devices + 1) if device == "cpu" else (1,)
    for t in thread_choices:  # colocated: r replicas of t threads (CPU), r replicas (GPU)
        if devices % t == 0:
            out.append(Layout("colocated", 0, devices // t, pf, col, decode_threads=t))
    for tp in thread_choices:
        for td in thread_choices:
            for p in range(1, devices):
                rest = devices - p * tp
                if rest <= 0 or rest % td:
                    continue
                out.append(Layout("disaggregated", p, rest // td, pf, dec, prefill_threads=tp, decode_threads=td))
    if batch_limits:
        more = []
        for lay in out:
            for b in batch_limits:
                if b < lay.decode.max_num_seqs:
                    more.append(replace(lay, decode=replace(lay.decode, max_num_seqs=b)))
        out += more
    return out


DEFAULT_SPLITS = tuple((p, 100 - p) for p in range(30, 90, 10))  # disjoint: 30:70 ... 80:20
# overlapping (MPS percentages are caps, not reservations): both shares 30..100 in steps of 10, 100 < P + D <= 150
OVERLAP_SPLITS = tuple((p, d) for p in range(30, 101, 10) for d in range(30, 101, 10) if 100 < p + d <= 150)
AUTO_SPLITS = DEFAULT_SPLITS + OVERLAP_SPLITS


def auto_splits(lowest: dict[str, int], wrong: frozenset[int] | set[int] = frozenset()) -> tuple[tuple[int, int], ...]:
    """``AUTO_SPLITS`` the profile can plan: each share at or above the lowest share measured for its phase (no
    extrapolation below the curve) and none whose bf16 GEMMs the profile recorded wrong."""
    return tuple(
        (p, d)
        for p, d in AUTO_SPLITS
        if p >= lowest["prefill"] and d >= lowest["decode"] and p not in wrong and d not in wrong
    )


def split_layouts(cfg: DistServeConfig, splits: tuple[tuple[int, int], ...] = DEFAULT_SPLITS) -> list[Layout]:
    """1 prefill + 1 decode worker on one GPU, one layout per SM split (``--sm-split P:D``)."""
    pf, dec, _ = limits_from_config(cfg, 0)
    return [Layout("disaggregated", 1, 1, pf, dec, sm_split=s) for s in splits]
