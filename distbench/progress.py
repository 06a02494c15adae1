"""Live view of a run: counts, rolling P99s against the SLO, and the saturation rule.

``--stop-on-saturation`` ends a run once the SLO attainment target cannot be met any more: the misses
already seen (failed requests included) exceed what the target allows over all the requests the run
will send, so no outcome of the rest can pass. The line is drawn with ``rich`` on stderr once a run has
lasted a few seconds.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque

from distserve.distbench.metrics import meets
from distserve.distbench.records import RequestRecord

SHOW_AFTER_S = 3.0


def _p99(xs) -> float:
    if not xs:
        return math.nan
    s = sorted(xs)
    return s[min(len(s) - 1, math.ceil(0.99 * len(s)) - 1)]


class Monitor:
    def __init__(self, planned: int, slo: dict[str, float], target: float, window: int = 500) -> None:
        self.planned, self.slo, self.target = planned, slo, target
        self.sent = self.done = self.failed = self.misses = 0
        self.ttft: deque[float] = deque(maxlen=window)
        self.tpot: deque[float] = deque(maxlen=window)
        self.t0 = time.monotonic()
        self.saturated = False

    def on_sent(self, r: RequestRecord) -> None:
        if not r.warmup:
            self.sent += 1

    def on_done(self, r: RequestRecord) -> None:
        if r.warmup:
            return
        self.done += 1
        if not r.ok or r.ttft is None:
            self.failed += 1
        else:
            self.ttft.append(r.ttft)
            if r.tpot is not None:
                self.tpot.append(r.tpot)
        if self.slo and not meets(r, self.slo):
            self.misses += 1

    def lost(self) -> bool:
        """The target is out of reach whatever the remaining requests do."""
        return bool(self.slo) and self.misses > (1.0 - self.target) * self.planned

    def line(self) -> str:
        el = time.monotonic() - self.t0
        parts = [
            f"{el:.0f} s",
            (f"sent {self.sent} done {self.done} failed {self.failed} in flight {self.sent - self.done}"),
        ]
        for name, xs in (("TTFT", self.ttft), ("TPOT", self.tpot)):
            p = _p99(xs) * 1000
            lim = self.slo.get(name.lower())
            parts.append(f"P99 {name} {p:.0f}" + (f"/{lim * 1000:g}" if lim else "") + " ms")
        if self.slo and self.done:
            parts.append(f"attainment {100 * (1 - self.misses / self.done):.1f}%")
        return " | ".join(parts)


async def watch(mon: Monitor, stop: asyncio.Event, stop_on_saturation: bool, show: bool) -> None:
    """Refresh the live line 4× a second; set ``stop`` when the SLO is lost (if asked)."""
    live = None
    try:
        while True:
            await asyncio.sleep(0.25)
            if stop_on_saturation and not mon.saturated and mon.lost():
                mon.saturated = True
                stop.set()
            if show and live is None and time.monotonic() - mon.t0 > SHOW_AFTER_S:
                from rich.console import Console
                from rich.live import Live

                live = Live(mon.line(), console=Console(stderr=True), refresh_per_second=4, transient=False)
                live.start()
            if live is not None:
                live.update(mon.line())
    finally:
        if live is not None:
            live.update(mon.line())
            live.stop()
