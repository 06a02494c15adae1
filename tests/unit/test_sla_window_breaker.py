"""sla.window (HDR rolling windows) and sla.breaker (state machine), with a fake clock."""

from __future__ import annotations

import random

import pytest

from distserve.sla.breaker import BreakerSettings, BreakerState, CircuitBreaker
from distserve.sla.window import LatencyHistogram, RollingWindow, WindowStats


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


def test_fast_percentile_matches_hdrhistogram():
    rng = random.Random(0)
    h = LatencyHistogram()
    h.record_all(rng.lognormvariate(-3, 1) for _ in range(5000))
    slow = h.hdr.__class__(1, 3_600_000_000, 3)  # the package's own recording and percentile loop
    for v in h.counts().nonzero()[0]:
        slow.record_value(h.hdr.get_value_from_index(int(v)), int(h.counts()[v]))
    for p in (1, 50, 90, 99, 99.9, 100):
        assert (
            h.percentile_ms(p) == h.hdr.get_value_at_percentile(p) / 1000.0 == slow.get_value_at_percentile(p) / 1000.0
        )
    assert LatencyHistogram().percentile_ms(99) is None


def test_vectorised_indices_match_hdrhistogram():
    from distserve.sla.window import HIGHEST_US, LAYOUT

    rng = random.Random(2)
    values = [1, 2, 1023, 1024, 2047, 2048, 2049, 4095, 4096, 999_999, 1_000_000, HIGHEST_US - 1, HIGHEST_US]
    values += [int(rng.lognormvariate(8, 3)) % HIGHEST_US + 1 for _ in range(20000)]
    import numpy as np

    got = LAYOUT.indices(np.array(values, dtype=np.int64))
    assert got.tolist() == [LAYOUT.hdr.get_counts_array_index(v) for v in values]
    assert [LAYOUT.index(v / 1e6) for v in values] == got.tolist()


def test_record_all_keeps_hdr_bookkeeping():
    h = LatencyHistogram()
    h.record_all([0.001, 0.5, 7200.0])  # the last is clamped to one hour
    assert h.count == 3 and h.hdr.min_value == 1000 and h.hdr.max_value == 3_600_000_000
    assert LatencyHistogram().count == 0


def test_percentile_within_three_significant_figures():
    h = LatencyHistogram()
    h.record_all([0.1234567] * 10)
    assert h.percentile_ms(50) == pytest.approx(123.4567, rel=1e-3)


def test_rolling_window_forgets_old_seconds():
    clock = FakeClock()
    w = RollingWindow(3, clock)
    for _ in range(10):
        w.record("ttft", 1.0)  # 1000 ms at t=1000
    clock.advance(1)
    for _ in range(10):
        w.record("ttft", 0.010)
    assert w.stats("ttft", 99) == WindowStats(pytest.approx(1000, rel=1e-3), 20)
    assert w.stats("ttft", 99, since=clock()).value_ms == pytest.approx(10, rel=1e-3)  # only this second
    clock.advance(2)  # second 1000 leaves a 3 s window at t=1003
    assert w.stats("ttft", 99) == WindowStats(pytest.approx(10, rel=1e-3), 10)
    clock.advance(5)
    assert w.stats("ttft", 99) == WindowStats(None, 0)
    assert w.percentiles("tpot", [50, 99]) == {50: None, 99: None}


def settings(**kw) -> BreakerSettings:
    base = dict(
        metric="ttft",
        percentile=99.0,
        threshold_ms=100.0,
        consecutive_s=2.0,
        cooldown_s=5.0,
        probe_fraction=0.25,
        min_samples=10,
        probe_samples=4,
    )
    return BreakerSettings(**{**base, **kw})


def feed(w: RollingWindow, b: CircuitBreaker, value_s: float, n: int):
    for _ in range(n):
        w.record("ttft", value_s)
    return b.evaluate(w.stats("ttft", 99, since=b.observe_since))


def test_breaker_full_cycle_with_fake_clock():
    clock = FakeClock()
    w = RollingWindow(10, clock)
    b = CircuitBreaker(settings(), clock)
    assert feed(w, b, 0.050, 20) is None and b.state is BreakerState.CLOSED
    # a breach must hold consecutive_s before it trips
    clock.advance(1)
    assert feed(w, b, 0.500, 20) is None
    clock.advance(1)
    assert feed(w, b, 0.500, 5) is None  # held 1 s
    clock.advance(1.0)
    t = feed(w, b, 0.500, 5)
    assert t is not None and t.to_state is BreakerState.OPEN and t.from_state is BreakerState.CLOSED
    assert t.samples >= 10 and t.value_ms > 100
    assert [b.route()[0] for _ in range(5)] == ["backup"] * 5
    # cooldown: still open before it, half-open after
    clock.advance(4.9)
    assert b.route() == ("backup", None)
    clock.advance(0.2)
    pool, t = b.route()
    assert t is not None and t.to_state is BreakerState.HALF_OPEN
    pools = [pool] + [b.route()[0] for _ in range(7)]
    assert pools.count("primary") == 2  # probe_fraction 0.25 of 8
    # old bad samples in the window do not count against the probes
    assert feed(w, b, 0.020, 3) is None  # fewer than probe_samples: undecided
    t = feed(w, b, 0.020, 1)
    assert t is not None and t.to_state is BreakerState.CLOSED
    assert b.route()[0] == "primary"
    assert feed(w, b, 0.020, 1) is None  # the pre-trip breach does not re-trip
    assert [x.to_state for x in b.transitions] == [BreakerState.OPEN, BreakerState.HALF_OPEN, BreakerState.CLOSED]


def test_breaker_probes_breach_reopen():
    clock = FakeClock()
    b = CircuitBreaker(settings(consecutive_s=0.5), clock)
    assert b.evaluate(WindowStats(500.0, 50)) is None
    clock.advance(0.5)
    assert b.evaluate(WindowStats(500.0, 50)).to_state is BreakerState.OPEN
    clock.advance(5)
    assert b.evaluate(WindowStats(None, 0)).to_state is BreakerState.HALF_OPEN
    t = b.evaluate(WindowStats(300.0, 4))
    assert t.to_state is BreakerState.OPEN and "probes breach" in t.reason
    assert b.entered_at == clock()  # cooldown restarts


def test_breaker_needs_min_samples_and_continuity():
    clock = FakeClock()
    b = CircuitBreaker(settings(), clock)
    for _ in range(10):  # high percentile but too few samples
        assert b.evaluate(WindowStats(900.0, 9)) is None
        clock.advance(1)
    assert b.evaluate(WindowStats(900.0, 10)) is None
    clock.advance(1.5)
    assert b.evaluate(WindowStats(50.0, 10)) is None  # healthy: the breach streak resets
    clock.advance(1)
    assert b.evaluate(WindowStats(900.0, 10)) is None
    clock.advance(1.9)
    assert b.evaluate(WindowStats(900.0, 10)) is None
    assert b.state is BreakerState.CLOSED


def test_transition_as_data():
    clock = FakeClock()
    b = CircuitBreaker(settings(consecutive_s=0.1), clock)
    b.evaluate(WindowStats(200.0, 10))
    clock.advance(0.1)
    d = b.evaluate(WindowStats(200.0, 10)).to_dict()
    assert d["from_state"] == "closed" and d["to_state"] == "open" and d["samples"] == 10
    with pytest.raises(ValueError, match="probe_fraction"):
        settings(probe_fraction=0)
