"""The router's live SLA view: rolling percentiles, the breaker, journals, their metrics.

- Per pool (``primary``, ``backup``), per-second HDR windows of TTFT, TPOT, ITL and
  E2E over the last ``router.sla_window_s`` seconds (``sla.window``, pure).
- The breaker (``sla.breaker``, pure) judges the *primary* pool only: its samples are
  the primary's requests that started after the breaker entered its current state
  (probes alone in half-open; nothing from before a trip after it closes). A tick
  task evaluates it every ``TICK_S``; the routing decision reads its state.
- Journals (JSON lines, ``server/router/journal.py``: a failed write is dropped, counted and
  marked, never raised): every request that reached the router (``router.journal_path``, read by
  ``distserve sla audit``) and breaker transitions (``router.event_journal_path``).
- Metrics are computed at scrape time by a collector on the router's registry.

This module and ``sla.window``/``sla.breaker`` are the only SLA code in the server; the
``sla`` package's audit, records and reports stay out of it (dependency rule).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from distserve.server.config import RouterConfig
from distserve.server.router.journal import Journal
from distserve.server.router.request_journal import mark as request_journal_mark
from distserve.sla.breaker import BreakerSettings, BreakerState, CircuitBreaker, Transition
from distserve.sla.window import RollingWindow

log = logging.getLogger(__name__)

POOLS = ("primary", "backup")
METRICS = ("ttft", "tpot", "itl", "e2e")
QUANTILES = (50.0, 90.0, 99.0, 99.9)
TICK_S = 0.2


@dataclass(frozen=True)
class Finished:
    """One finished request as the journal and the windows see it (latencies in seconds)."""

    pool: str
    start_mono: float  # time.monotonic() when the request arrived
    start_unix: float
    ok: bool
    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None
    itl: tuple[float, ...] = ()
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None
    predicted_ttft: float | None = None  # admission's prediction (server/router/admission.py)
    http_status: int | None = None  # what the client was answered (499: it left or stopped reading)
    path: str | None = None  # where its prompt was prefilled: "disaggregated" or "local" (pipeline.py)
    ttft_parts: dict | None = None  # predicted and measured TTFT parts (ttft_predictor.RequestPhases.journal)

    def journal_line(self) -> dict:
        out = {
            "kind": "request",
            "status": self.http_status if self.http_status is not None else (200 if self.ok else 500),
            "start_unix": round(self.start_unix, 6),
            "pool": self.pool,
            "ttft": self.ttft,
            "tpot": self.tpot,
            "e2e": self.e2e,
            "itl": [round(x, 6) for x in self.itl],
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "error": self.error,
            "predicted_ttft": self.predicted_ttft,
        }
        if self.path is not None:
            out["path"] = self.path
        if self.ttft_parts is not None:
            out["ttft_parts"] = self.ttft_parts
        return out


def breaker_settings(cfg: RouterConfig) -> BreakerSettings:
    b = cfg.breaker
    return BreakerSettings(
        metric=b.metric,
        percentile=b.percentile,
        threshold_ms=b.threshold_ms,
        consecutive_s=b.consecutive_s,
        cooldown_s=b.cooldown_s,
        probe_fraction=b.probe_fraction,
        min_samples=b.min_samples,
        probe_samples=b.probe_samples,
    )


class SlaLive:
    def __init__(
        self,
        cfg: RouterConfig,
        registry: CollectorRegistry,
        *,
        backup_configured: bool,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.cfg = cfg
        self.clock, self.wall = clock, wall
        self.windows = {p: RollingWindow(cfg.sla_window_s, clock, METRICS) for p in POOLS}
        # A breaker without a backup could only fall back to the primary: it is built but never routes away.
        self.breaker = CircuitBreaker(breaker_settings(cfg), clock) if cfg.breaker.enabled else None
        self.backup_configured = backup_configured
        self._judge = RollingWindow(cfg.sla_window_s, clock, (cfg.breaker.metric,))
        self.requests_journal = Journal(cfg.journal_path)
        self.events_journal = Journal(cfg.event_journal_path)
        self.registry = registry
        self.pool_requests = Counter(
            "distserve_pool_requests", "Requests answered, by pool.", ["pool"], registry=registry
        )
        self.transitions = Counter(
            "distserve_breaker_transitions", "Breaker transitions.", ["from_state", "to_state"], registry=registry
        )
        self.fallbacks = Counter(
            "distserve_pool_fallbacks",
            "Requests served by the other pool than chosen: "
            "backup unreachable -> primary, or primary unavailable -> backup.",
            ["reason"],
            registry=registry,
        )
        self._collector = _Collector(self)
        registry.register(self._collector)

    # --- routing ------------------------------------------------------------
    def choose_pool(self) -> str:
        """``primary`` or ``backup`` for a new request (HALF_OPEN: every 1/probe_fraction-th to the primary)."""
        if self.breaker is None or not self.backup_configured:
            return "primary"
        pool, t = self.breaker.route()
        if t is not None:
            self._on_transition(t)
        return pool

    @property
    def state(self) -> BreakerState:
        return self.breaker.state if self.breaker else BreakerState.CLOSED

    # --- samples ------------------------------------------------------------
    def record(self, f: Finished) -> None:
        w = self.windows[f.pool]
        if f.ok:
            for m in ("ttft", "tpot", "e2e"):
                v = getattr(f, m)
                if v is not None:
                    w.record(m, v)
            if f.itl:
                w.record_all("itl", f.itl)
            if f.pool == "primary" and self.breaker is not None:
                since = self.breaker.observe_since
                if since is None or f.start_mono >= since:
                    metric = self.cfg.breaker.metric
                    if metric == "itl":
                        self._judge.record_all(metric, f.itl)
                    elif getattr(f, metric) is not None:
                        self._judge.record(metric, getattr(f, metric))
        self.pool_requests.labels(f.pool).inc()
        self.requests_journal.append(f.journal_line())
        request_journal_mark()

    # --- the breaker's clock ---------------------------------------------------
    def tick(self) -> Transition | None:
        if self.breaker is None:
            return None
        b = self.breaker
        t = b.evaluate(self._judge.stats(self.cfg.breaker.metric, self.cfg.breaker.percentile, since=b.observe_since))
        if t is not None:
            self._on_transition(t)
        return t

    async def run(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            try:
                self.tick()
            except Exception:  # a bug here must not stop the router; it is logged loudly
                log.exception("breaker tick failed")

    def _on_transition(self, t: Transition) -> None:
        self._judge.clear()  # each state judges only its own samples
        self.transitions.labels(t.from_state.value, t.to_state.value).inc()
        log.warning("breaker %s -> %s: %s", t.from_state.value, t.to_state.value, t.reason)
        self.events_journal.append(
            {"kind": "breaker", "at_unix": round(self.wall() - (self.clock() - t.at), 6), **t.to_dict()}
        )

    # --- views --------------------------------------------------------------
    def status(self) -> dict:
        b = self.breaker
        serving = {
            BreakerState.CLOSED: "primary",
            BreakerState.OPEN: "backup",
            BreakerState.HALF_OPEN: "primary+backup",
        }[self.state]
        if not self.backup_configured:
            serving = "primary"
        breaker: dict = {
            "enabled": b is not None,
            "state": self.state.value,
            "backup_configured": self.backup_configured,
        }
        percentiles: dict = {}
        out = {
            "window_s": self.cfg.sla_window_s,
            "serving_pool": serving,
            "breaker": breaker,
            "percentiles_ms": percentiles,
        }
        for pool, w in self.windows.items():
            percentiles[pool] = {
                m: {"samples": w.count(m), **{f"p{q:g}": v for q, v in w.percentiles(m, QUANTILES).items()}}
                for m in METRICS
            }
        if b is not None:
            s = b.settings
            stats = self._judge.stats(s.metric, s.percentile, since=b.observe_since)
            breaker.update(
                {
                    "metric": s.metric,
                    "percentile": s.percentile,
                    "threshold_ms": s.threshold_ms,
                    "in_state_s": round(self.clock() - b.entered_at, 3),
                    "judged": {"value_ms": stats.value_ms, "samples": stats.samples},
                    "transitions": [self._wall_clock(t) for t in b.transitions][-20:],
                }
            )
        return out

    def journal_problem(self) -> str | None:
        """Why ``/health`` must say degraded because of a journal (a write failed recently), or None."""
        reasons = [r for r in (self.requests_journal.reason(), self.events_journal.reason()) if r]
        return "; ".join(reasons) or None

    def _wall_clock(self, t: Transition) -> dict:
        """A transition with its time as wall clock (``at_unix``, ``at_iso``, UTC) beside the breaker's
        monotonic ``at``, so it lines up with logs and the event journal."""
        at_unix = round(self.wall() - (self.clock() - t.at), 6)
        iso = datetime.fromtimestamp(at_unix, tz=UTC).isoformat(timespec="milliseconds")
        return {**t.to_dict(), "at_unix": at_unix, "at_iso": iso}

    def close(self) -> None:
        self.requests_journal.close()
        self.events_journal.close()
        try:
            self.registry.unregister(self._collector)
        except KeyError:
            pass


class _Collector:
    """Rolling percentiles and breaker state, computed when /metrics is scraped."""

    def __init__(self, live: SlaLive) -> None:
        self.live = live

    def describe(self):
        return []

    def collect(self):
        live = self.live
        lat = GaugeMetricFamily(
            "distserve_sla_rolling_latency_seconds",
            f"Latency percentile over the last {live.cfg.sla_window_s} s (HDR, per-second windows).",
            labels=["pool", "metric", "quantile"],
        )
        n = GaugeMetricFamily(
            "distserve_sla_rolling_samples", "Samples in the rolling window.", labels=["pool", "metric"]
        )
        qs = sorted(set(QUANTILES) | ({live.cfg.breaker.percentile} if live.breaker else set()))
        for pool, w in live.windows.items():
            for m in METRICS:
                count = w.count(m)
                n.add_metric([pool, m], count)
                for q, v in (w.percentiles(m, qs) if count else {}).items():
                    if v is not None:
                        lat.add_metric([pool, m, f"{q / 100:g}"], v / 1000.0)
        yield lat
        yield n
        yield GaugeMetricFamily(
            "distserve_sla_window_seconds", "Length of the rolling window.", value=live.cfg.sla_window_s
        )
        yield GaugeMetricFamily(
            "distserve_breaker_state", "Latency circuit breaker: 0 closed, 1 open, 2 half-open.", value=live.state.gauge
        )
        dropped = CounterMetricFamily(
            "distserve_journal_dropped",
            "Journal lines lost to a failed write (full disk, I/O error): each request was still served.",
            labels=["journal"],
        )
        dropped.add_metric(["requests"], live.requests_journal.dropped)
        dropped.add_metric(["events"], live.events_journal.dropped)
        yield dropped
        yield GaugeMetricFamily(
            "distserve_breaker_enabled",
            "1 when the breaker is on and a backup pool is set.",
            value=int(live.breaker is not None and live.backup_configured),
        )
