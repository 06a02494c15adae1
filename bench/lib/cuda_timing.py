"""GPU time of a captured decode step: the one way the bench scripts time a CUDA graph's replay."""

from __future__ import annotations

import statistics

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
