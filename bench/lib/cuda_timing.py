"""GPU time of a captured decode step: the one way the bench scripts time a CUDA graph's replay."""

from __future__ import annotations

import statistics
import time

import torch


def graph_replay_ms(graph: torch.cuda.CUDAGraph, n: int = 30, repeats: int = 1, warmup: int = 1) -> float:
    """Milliseconds per replay: ``n`` back-to-back replays between two CUDA events (the gaps between replays
    included, the host's work between engine steps not), the median over ``repeats`` such runs."""
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    vals = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            graph.replay()
        b.record()
        b.synchronize()
        vals.append(a.elapsed_time(b) / n)
    return statistics.median(vals)


def sync() -> None:
    """``torch.cuda.synchronize()`` where CUDA is present (the scripts' ``--smoke`` runs on a CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def step_times_ms(eng, n: int) -> list[float]:
    """Wall milliseconds of ``n`` engine ``step()`` calls, each between device synchronisations."""
    ts = []
    for _ in range(n):
        sync()
        t0 = time.perf_counter()
        eng.step()
        sync()
        ts.append((time.perf_counter() - t0) * 1e3)
    return ts
