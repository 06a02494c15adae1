"""Goodput per layout: the highest Poisson rate at which the simulated run meets the SLO, found by
doubling then bisection over the rate (the same arrival gaps scaled at every rate), and what limits it."""

from __future__ import annotations

from dataclasses import dataclass

from planner.latency import LatencyModel
from planner.layouts import Layout
from planner.simulator import SimResult, simulate
from planner.slo import SLO, attainment, meets, percentile
from planner.workload import Workload


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

    def run(self, layout: Layout, rate: float) -> SimResult:
        return simulate(self.model, layout, self.workload.requests, rate, self.kv_bytes_per_token,
                        self.overhead_ttft_ms, self.seed)

    def ok(self, layout: Layout, rate: float) -> bool:
        return meets(self.slo, self.run(layout, rate).latencies)

    def goodput(self, layout: Layout, precision: float = 0.02, max_rate: float = 1e5) -> float:
        lo, hi = 0.0, 1.0
        while self.ok(layout, hi):
            lo, hi = hi, hi * 2
            if hi > max_rate:
                return lo
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
        busiest = max(res.utilization.items(), key=lambda kv: kv[1], default=("?", 0.0))
        util = ", ".join(f"{k} {v:.0%} busy" for k, v in sorted(res.utilization.items()))
        return f"{metric.upper()} ({share:.0%} miss, P90 {p90:.0f} ms); {util}; limit: {busiest[0]}"

    def evaluate(self, layout: Layout) -> Evaluation:
        g = self.goodput(layout)
        return Evaluation(layout, layout.devices(self.device), g, self.bottleneck(layout, g),
                          self.run(layout, g) if g > 0 else None)

    def curve(self, layout: Layout, rates: list[float]) -> list[tuple[float, float, float, float]]:
        """(rate, attainment, TTFT P90 ms, TPOT P90 ms) per rate, for --explain and the accuracy bench."""
        out = []
        for r in rates:
            res = self.run(layout, r)
            tt = [x["ttft"] for x in res.latencies]
            tp = [x["tpot"] for x in res.latencies if "tpot" in x]
            out.append((r, attainment(self.slo, res.latencies), percentile(tt, 90), percentile(tp, 90) if tp else 0.0))
        return out
