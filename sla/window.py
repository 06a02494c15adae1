"""HDR histograms of latencies, and rolling windows of per-second histograms.

PURE: no I/O, no threads, no wall clock of its own (the clock is injected),
because the router imports this module for its live percentiles and breaker.

Values are recorded as integer microseconds in ``hdrhistogram`` histograms
with 3 significant figures (every reported value is within 0.1% of a value
that was recorded), from 1 µs to one hour; larger values are clamped to one
hour. Percentiles follow HdrHistogram's definition (the highest value
equivalent to the bucket where the cumulative count reaches
``round(p/100 * count)``), computed with numpy over the counts array: the
package's own loop takes milliseconds per query, this takes microseconds, with
the same answer (tested).

A rolling window keeps one histogram per whole second that received samples,
per metric; the last ``window_s`` seconds are summed when asked. Memory is one
counts array of 32-bit counts (~94 KB) per metric per second that had traffic.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np
from hdrh.histogram import HdrHistogram

__all__ = ["HIGHEST_US", "LatencyHistogram", "RollingWindow", "WindowStats", "new_histogram"]

HIGHEST_US = 3_600_000_000  # one hour in microseconds
SIGNIFICANT_FIGURES = 3


def new_histogram(word_size: int = 8) -> HdrHistogram:
    return HdrHistogram(1, HIGHEST_US, SIGNIFICANT_FIGURES, word_size=word_size)


def to_us(seconds: float) -> int:
    """Seconds → integer microseconds within the histogram's range (1 µs .. one hour)."""
    return min(max(int(round(seconds * 1e6)), 1), HIGHEST_US)


class LatencyHistogram:
    """An HdrHistogram of latencies in seconds, with fast percentiles and merging."""

    def __init__(self, word_size: int = 8) -> None:
        """``word_size`` 4 halves the memory (32-bit counts: plenty for one second of samples)."""
        self.hdr = new_histogram(word_size)

    def record(self, seconds: float, count: int = 1) -> None:
        self.hdr.record_value(to_us(seconds), count)

    def record_all(self, values: Iterable[float]) -> None:
        for v in values:
            self.hdr.record_value(to_us(v))

    @property
    def count(self) -> int:
        return int(self.hdr.get_total_count())

    def counts(self) -> np.ndarray:
        """A numpy *view* of the counts array (no copy)."""
        return np.ctypeslib.as_array(self.hdr.counts)

    def add(self, other: "LatencyHistogram") -> None:
        self.hdr.add(other.hdr)

    def percentile_ms(self, p: float) -> float | None:
        """The ``p``-th percentile in milliseconds, or None when empty."""
        return percentile_ms_of_counts(self.hdr, self.counts(), p)

    def encode(self) -> str:
        """HdrHistogram's compressed base64 form, portable to other HDR tools."""
        return self.hdr.encode().decode()


def percentile_ms_of_counts(hdr: HdrHistogram, counts: np.ndarray, p: float) -> float | None:
    total = int(counts.sum())
    if total == 0:
        return None
    target = max(int(min(p, 100.0) * total / 100 + 0.5), 1)
    index = int(np.searchsorted(np.cumsum(counts), target))
    value = hdr.get_value_from_index(index)
    us = hdr.get_highest_equivalent_value(value) if p else hdr.get_lowest_equivalent_value(value)
    return us / 1000.0


@dataclass(frozen=True)
class WindowStats:
    """One percentile of one metric over a window: the value (None when empty) and the sample count."""
    value_ms: float | None
    samples: int


class RollingWindow:
    """Per-second HDR histograms of several metrics; percentiles over the last ``window_s`` seconds.

    ``clock`` returns seconds (any epoch; the router passes ``time.monotonic``).
    """

    def __init__(self, window_s: int, clock: Callable[[], float], metrics: Iterable[str] = ("ttft", "tpot", "e2e")):
        if window_s < 1:
            raise ValueError(f"window_s must be >= 1, got {window_s}")
        self.window_s = int(window_s)
        self.clock = clock
        self.metrics = tuple(metrics)
        self._seconds: dict[str, OrderedDict[int, LatencyHistogram]] = {m: OrderedDict() for m in self.metrics}

    def _expire(self, now_s: int) -> None:
        oldest = now_s - self.window_s + 1
        for buckets in self._seconds.values():
            while buckets and next(iter(buckets)) < oldest:
                buckets.popitem(last=False)

    def record(self, metric: str, seconds: float) -> None:
        self.record_all(metric, (seconds,))

    def record_all(self, metric: str, values: Iterable[float]) -> None:
        """Record samples at the clock's current second (one expiry pass for all of them)."""
        values = list(values)
        if not values:
            return
        now_s = int(self.clock())
        self._expire(now_s)
        buckets = self._seconds[metric]
        h = buckets.get(now_s)
        if h is None:
            h = buckets[now_s] = LatencyHistogram(word_size=4)
        h.record_all(values)

    def clear(self) -> None:
        for buckets in self._seconds.values():
            buckets.clear()

    def _merged(self, metric: str, since: float | None) -> tuple[HdrHistogram | None, np.ndarray | None]:
        self._expire(int(self.clock()))
        first = None if since is None else int(since)
        parts = [h for s, h in self._seconds[metric].items() if first is None or s >= first]
        if not parts:
            return None, None
        total = parts[0].counts().astype(np.uint64)
        for h in parts[1:]:
            total += h.counts()
        return parts[0].hdr, total

    def stats(self, metric: str, percentile: float, since: float | None = None) -> WindowStats:
        """``percentile`` of ``metric`` over the window (only seconds >= ``since`` when given)."""
        hdr, counts = self._merged(metric, since)
        if hdr is None or counts is None:
            return WindowStats(None, 0)
        return WindowStats(percentile_ms_of_counts(hdr, counts, percentile), int(counts.sum()))

    def percentiles(self, metric: str, ps: Iterable[float], since: float | None = None) -> dict[float, float | None]:
        hdr, counts = self._merged(metric, since)
        if hdr is None or counts is None:
            return {p: None for p in ps}
        return {p: percentile_ms_of_counts(hdr, counts, p) for p in ps}

    def count(self, metric: str, since: float | None = None) -> int:
        _, counts = self._merged(metric, since)
        return 0 if counts is None else int(counts.sum())
