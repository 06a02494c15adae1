"""Per-worker latency outlier ejection (Envoy's outlier detection, latency flavour).

The circuit breaker (``sla_live.py``) watches the pool as a whole; this watches each worker against its
pool. The pipeline records, per worker, the latency it served: TTFT on prefill and colocated workers (pick
to first token, queueing included), TPOT on decode workers. A worker whose recent ``percentile`` is above
``factor`` x the median of the same percentile of the *other* workers of its role (compared with the
others, not with a median that includes itself, so a pool of two can eject), by at least
``min_excess_ms``, each with ``min_samples`` samples in the last ``window_s``, is *ejected*: ``pick`` gives
it no new request for ``ejection_s`` x its consecutive ejections (at most 4x); its requests in flight
continue. At most ``max_ejection_share`` of a role's healthy workers are ejected at once, never the last
one; and should every candidate of a pick be ejected, the pick ignores ejection (it never causes a 503).
When the cooling period ends, the worker returns with its samples cleared (judged afresh). One log line
per ejection and per return; counts in ``/metrics``; state in ``/v1/workers``.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from distserve.server.config import OutlierConfig

if TYPE_CHECKING:
    from distserve.server.router.registry import WorkerInfo

log = logging.getLogger(__name__)

MAX_SAMPLES = 256  # per worker: the most recent ones
MAX_BACKOFF = 4


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in (0, 1])."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


class OutlierDetector:
    def __init__(self, config: OutlierConfig, on_eject: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.on_eject = on_eject  # called with the role at each ejection (the /metrics counter)

    def _recent(self, w: WorkerInfo, now: float) -> list[float]:
        horizon = now - self.config.window_s
        while w.latency and w.latency[0][0] < horizon:
            w.latency.popleft()
        return [v for _, v in w.latency]

    def record(self, w: WorkerInfo, seconds: float, pool: Iterable[WorkerInfo], now: float | None = None) -> None:
        """One latency sample of ``w`` (TTFT or TPOT, by its role); then judge its pool."""
        if not self.config.enabled or w.ejected_until:
            return  # an ejected worker's late answers do not count: it is judged afresh on return
        now = time.monotonic() if now is None else now
        w.latency.append((now, seconds))
        if len(w.latency) > MAX_SAMPLES:
            w.latency.popleft()
        self.judge([p for p in pool if p.role == w.role], now)

    def worker_percentile(self, w: WorkerInfo, now: float | None = None) -> float | None:
        vals = self._recent(w, time.monotonic() if now is None else now)
        return percentile(vals, self.config.percentile) if len(vals) >= self.config.min_samples else None

    def judge(self, pool: list[WorkerInfo], now: float) -> None:
        c = self.config
        if len(pool) < 2:
            return
        figures = {w.worker_id: self.worker_percentile(w, now) for w in pool}
        ejected = sum(1 for w in pool if w.ejected_until)
        allowed = min(len(pool) - 1, math.floor(c.max_ejection_share * len(pool)))
        for w in pool:
            mine = figures[w.worker_id]
            if w.ejected_until or mine is None or ejected >= allowed:
                continue
            others = [v for k, v in figures.items() if k != w.worker_id and v is not None]
            if not others:
                continue
            median = statistics.median(others)
            if not (mine > c.factor * median and (mine - median) * 1000 >= c.min_excess_ms):
                w.ejections = 0  # judged within bounds since it returned: its back-off starts over
                continue
            w.ejections += 1
            period = c.ejection_s * min(MAX_BACKOFF, w.ejections)
            w.ejected_until = now + period
            ejected += 1
            what = "TPOT" if w.role == "decode" else "TTFT"
            log.warning(
                "worker %s (%s) ejected for %.0f s: %s p%g %.1f ms > %.1f x pool median %.1f ms (%d samples)",
                w.worker_id,
                w.role,
                period,
                what,
                c.percentile * 100,
                mine * 1000,
                c.factor,
                median * 1000,
                len(w.latency),
            )
            if self.on_eject is not None:
                self.on_eject(w.role)

    def release_due(self, workers: Iterable[WorkerInfo], now: float | None = None) -> None:
        """Return the workers whose cooling period is over (samples cleared)."""
        now = time.monotonic() if now is None else now
        for w in workers:
            if w.ejected_until and now >= w.ejected_until:
                w.ejected_until = 0.0
                w.latency.clear()
                log.info("worker %s (%s) back in rotation after its ejection", w.worker_id, w.role)
