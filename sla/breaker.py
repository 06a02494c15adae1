"""The latency circuit breaker: a pure state machine with an injected clock.

::

            rolling p > threshold for consecutive_s          cooldown_s elapsed
    CLOSED ───────────(>= min_samples)──────────▶ OPEN ─────────────────────▶ HALF_OPEN
      ▲                                            ▲                              │
      │          probes healthy (>= probe_samples) │   probes breach              │
      └────────────────────────────────────────────┼──────────────────────────────┘
                                                   └──────────────────────────────┘

- CLOSED: every request goes to the primary pool.
- OPEN: every new request goes to the backup pool.
- HALF_OPEN: ``probe_fraction`` of new requests go to the primary (deterministically:
  an accumulator, not a coin, so tests and drills are repeatable); the rest to the backup.

The breaker does no I/O and keeps no samples: the caller feeds ``evaluate`` with
the statistics of the samples that count in the current state — those observed
since ``observe_since`` (entering CLOSED or HALF_OPEN starts a fresh view, so
samples from before a trip cannot trip it again, and probes are judged alone).
Every transition is returned as data and kept in ``transitions``.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass

from distserve.sla.slo import within
from distserve.sla.window import WindowStats

__all__ = ["BreakerSettings", "BreakerState", "CircuitBreaker", "Transition"]


class BreakerState(str, enum.Enum):  # noqa: UP042 (str mixin: JSON and f-strings show the value)
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"

    @property
    def gauge(self) -> int:
        """Numeric value for a Prometheus gauge: 0 closed, 1 open, 2 half-open."""
        return {"closed": 0, "open": 1, "half_open": 2}[self.value]


@dataclass(frozen=True)
class BreakerSettings:
    metric: str = "ttft"
    percentile: float = 99.0
    threshold_ms: float = 300.0
    consecutive_s: float = 5.0
    cooldown_s: float = 30.0
    probe_fraction: float = 0.1
    min_samples: int = 20
    probe_samples: int = 5

    def __post_init__(self) -> None:
        if not 0 < self.percentile < 100:
            raise ValueError(f"percentile must be in (0, 100), got {self.percentile}")
        for name in ("threshold_ms", "consecutive_s", "cooldown_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 < self.probe_fraction <= 1:
            raise ValueError(f"probe_fraction must be in (0, 1], got {self.probe_fraction}")
        if self.min_samples < 1 or self.probe_samples < 1:
            raise ValueError("min_samples and probe_samples must be >= 1")


@dataclass(frozen=True)
class Transition:
    at: float  # the breaker's clock
    from_state: BreakerState
    to_state: BreakerState
    reason: str
    value_ms: float | None = None
    samples: int = 0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["from_state"], d["to_state"] = self.from_state.value, self.to_state.value
        return d


class CircuitBreaker:
    def __init__(self, settings: BreakerSettings, clock: Callable[[], float], history: int = 100) -> None:
        self.settings = settings
        self.clock = clock
        self.state = BreakerState.CLOSED
        self.entered_at = clock()
        self.observe_since: float | None = None  # None: every sample in the window counts
        self.breach_since: float | None = None
        self.transitions: deque[Transition] = deque(maxlen=history)
        self.num_transitions = 0
        self._probe_credit = 0.0

    def _move(self, to: BreakerState, reason: str, stats: WindowStats | None = None) -> Transition:
        now = self.clock()
        t = Transition(now, self.state, to, reason, stats.value_ms if stats else None, stats.samples if stats else 0)
        self.state, self.entered_at, self.breach_since = to, now, None
        self.observe_since = now if to in (BreakerState.CLOSED, BreakerState.HALF_OPEN) else None
        self._probe_credit = 0.0
        self.transitions.append(t)
        self.num_transitions += 1
        return t

    def _cooldown_over(self) -> Transition | None:
        if self.state is BreakerState.OPEN and self.clock() - self.entered_at >= self.settings.cooldown_s:
            return self._move(BreakerState.HALF_OPEN, f"cooldown of {self.settings.cooldown_s:g} s over; probing")
        return None

    def evaluate(self, stats: WindowStats) -> Transition | None:
        """Feed the current statistics (of samples since ``observe_since``); returns a transition if any."""
        s = self.settings
        if self.state is BreakerState.OPEN:
            return self._cooldown_over()
        breached = stats.value_ms is not None and not within(stats.value_ms, s.threshold_ms)
        value = stats.value_ms if stats.value_ms is None else round(stats.value_ms, 1)
        what = f"{s.metric} p{s.percentile:g} {value} ms vs {s.threshold_ms:g} ms over {stats.samples} samples"
        if self.state is BreakerState.HALF_OPEN:
            if stats.samples < s.probe_samples:
                return None
            if breached:
                return self._move(BreakerState.OPEN, f"probes breach: {what}", stats)
            return self._move(BreakerState.CLOSED, f"probes healthy: {what}", stats)
        # CLOSED
        if not breached or stats.samples < s.min_samples:
            self.breach_since = None
            return None
        now = self.clock()
        if self.breach_since is None:
            self.breach_since = now
        if now - self.breach_since >= s.consecutive_s:
            return self._move(BreakerState.OPEN, f"breach held {now - self.breach_since:.1f} s: {what}", stats)
        return None

    def route(self) -> tuple[str, Transition | None]:
        """Which pool a new request goes to (``primary``|``backup``), and a transition if the cooldown ended."""
        t = self._cooldown_over()
        if self.state is BreakerState.CLOSED:
            return "primary", t
        if self.state is BreakerState.OPEN:
            return "backup", t
        self._probe_credit += self.settings.probe_fraction
        if self._probe_credit >= 1.0 - 1e-9:
            self._probe_credit -= 1.0
            return "primary", t
        return "backup", t
