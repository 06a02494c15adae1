"""Goodput per layout: the highest Poisson rate at which the simulated run meets the SLO, found by
doubling then bisection over the rate (the same arrival gaps scaled at every rate), and what limits it."""

from __future__ import annotations

import math
from dataclasses import dataclass

from distserve.planner.latency import LatencyModel
from distserve.planner.layouts import Layout
from distserve.planner.profile import Profile
from distserve.planner.simulator import SimResult, simulate
from distserve.planner.slo import SLO, attainment, meets, percentile
from distserve.planner.workload import Workload


@dataclass(frozen=True)
class Evaluation:
    layout: Layout
    devices: int
    goodput: float  # req/s
    bottleneck: str
    at_goodput: SimResult | None

    @property
    def per_device(self) -> float:
        return self.goodput / self.devices


@dataclass(frozen=True)
class Planner:
    model: LatencyModel
    workload: Workload
    slo: SLO
    kv_bytes_per_token: int
    overhead_ttft_ms: float = 0.0
    device: str = "cuda"
    seed: int = 0
    handoff_ms: float = 0.0
    handoff_steps: int = 0
    admit_steps: int = 0
    engine_thread: bool = False
    prefill_post_ms: float = 0.0
    min_duration_s: float = 30.0  # arrivals span at least this long: a burst of a few requests is no load
    max_requests: int = 6000

    @classmethod
    def for_profile(cls, prof: Profile, workload: Workload, slo: SLO, seed: int = 0) -> Planner:
        return cls(
            LatencyModel.fit(prof),
            workload,
            slo,
            prof.kv_bytes_per_token,
            prof.overhead_ttft_ms,
            prof.device,
            seed,
            handoff_ms=prof.handoff_ms,
            handoff_steps=prof.handoff_steps,
            admit_steps=prof.admit_steps,
            engine_thread=prof.engine_thread,
            prefill_post_ms=prof.prefill_post_ms,
        )

    def run(self, layout: Layout, rate: float, n: int | None = None) -> SimResult:
        reqs = self.workload.requests
        if n is None:
            n = min(self.max_requests, max(len(reqs), math.ceil(rate * self.min_duration_s)))
        lengths = [reqs[i % len(reqs)] for i in range(n)]
        return simulate(
            self.model,
            layout,
            lengths,
            rate,
            self.kv_bytes_per_token,
            self.overhead_ttft_ms,
            self.seed,
            self.handoff_ms,
            self.handoff_steps,
            self.admit_steps,
            self.engine_thread,
            self.prefill_post_ms,
        )

    def ok(self, layout: Layout, rate: float) -> bool:
        return meets(self.slo, self.run(layout, rate).latencies)

    def goodput(self, layout: Layout, precision: float = 0.02, max_rate: float = 1e5) -> float:
        lo, hi = 0.0, 1.0
        while self.ok(layout, hi):
            lo, hi = hi, hi * 2
            if hi > max_rate or math.ceil(hi * self.min_duration_s) > self.max_requests:
                return lo  # beyond what a run of max_requests can show
        if lo == 0.0:  # find a passing rate below 1 req/s, if any
            r = 0.5
            while r > 1e-3 and not self.ok(layout, r):
                r /= 2
            if r <= 1e-3:
                return 0.0
            lo, hi = r, r * 2
        while hi - lo > precision * hi:
            mid = (lo + hi) / 2
            if self.ok(layout, mid):
                lo = mid
            else:
                hi = mid
        return lo

    def bottleneck(self, layout: Layout, rate: float) -> str:
        """What fails first just above the goodput: which SLO metric misses most, and the busiest role."""
        res = self.run(layout, max(rate * 1.15, 0.05))
        misses = []
        for metric, limit in self.slo.limits_ms:
            vals = [r.get(metric, float("inf")) for r in res.latencies]
            share = sum(v > limit for v in vals) / max(1, len(vals))
            misses.append((share, metric, percentile(vals, 90)))
        share, metric, p90 = max(misses)
        parts = []
        for role, busy in sorted(res.utilization.items()):
            parts.append(f"{role} {busy:.0%} busy, mean batch {res.mean_batch.get(role, 0):.1f}")
        if layout.mode == "colocated":
            cause = "prefill steps stall decodes" if metric == "tpot" else "prefill queueing behind mixed steps"
        elif metric == "ttft":
            cause = "prefill workers" if res.utilization.get("prefill", 0) > 0.5 else "prefill reply + KV path"
        else:
            cause = "decode workers"
        return f"{metric.upper()} ({share:.0%} miss, P90 {p90:.0f} ms) -> {cause}; {'; '.join(parts)}"

    def evaluate(self, layout: Layout) -> Evaluation:
        g = self.goodput(layout)
        return Evaluation(
            layout, layout.devices(self.device), g, self.bottleneck(layout, g), self.run(layout, g) if g > 0 else None
        )

    def curve(self, layout: Layout, rates: list[float]) -> list[tuple[float, float, float, float]]:
        """(rate, attainment, TTFT P90 ms, TPOT P90 ms) per rate, for --explain and the accuracy bench."""
        out = []
        for r in rates:
            res = self.run(layout, r)
            tt = [x["ttft"] for x in res.latencies]
            tp = [x["tpot"] for x in res.latencies if "tpot" in x]
            out.append((r, attainment(self.slo, res.latencies), percentile(tt, 90), percentile(tp, 90) if tp else 0.0))
        return out
