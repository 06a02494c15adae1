"""distbench's arithmetic: schedules, percentiles, SLO parsing and attainment."""

from __future__ import annotations

import pytest

from distbench.loadgen import LoadSpec, RequestRecord, make_prompts, schedule
from distbench.metrics import meets, parse_slo, percentile, summarize


def test_open_loop_schedule_is_fixed_in_advance_and_has_the_rate():
    spec = LoadSpec(url="http://x", num_prompts=4000, request_rate=20.0, seed=3)
    a, b = schedule(spec), schedule(spec)
    assert a == b and a == sorted(a)
    assert 4000 / a[-1] == pytest.approx(20.0, rel=0.05)
    bursty = schedule(LoadSpec(url="http://x", num_prompts=4000, request_rate=20.0, burstiness=0.2, seed=3))
    gaps = [y - x for x, y in zip(bursty, bursty[1:])]
    smooth = [y - x for x, y in zip(a, a[1:])]
    assert max(gaps) > max(smooth)  # gamma with shape < 1 is burstier than Poisson


def test_prompts_have_exact_length_and_are_reproducible():
    spec = LoadSpec(url="http://x", num_prompts=5, prompt_len=17, concurrency=2, seed=9)
    assert make_prompts(spec) == make_prompts(spec)
    assert all(len(p) == 17 and all(3 <= t < 259 for t in p) for p in make_prompts(spec))


@pytest.mark.parametrize("kw", [dict(), dict(concurrency=2, request_rate=1.0), dict(concurrency=0),
                                dict(request_rate=-1.0), dict(concurrency=1, burstiness=0)])
def test_bad_specs_rejected(kw):
    with pytest.raises(ValueError):
        LoadSpec(url="http://x", num_prompts=3, **kw)


def test_percentile_interpolates_like_numpy():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5], 99) == 5
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)


def test_slo_parsing_and_attainment():
    slo = parse_slo("ttft:250ms,tpot:0.05s")
    assert slo == {"ttft": 0.25, "tpot": 0.05}
    with pytest.raises(ValueError, match="METRIC"):
        parse_slo("latency:3ms")
    good = RequestRecord(0, 0.0, 0.0, ttft=0.1, e2e=0.1 + 63 * 0.01, output_tokens=64)
    slow_tpot = RequestRecord(1, 0.0, 0.0, ttft=0.1, e2e=0.1 + 63 * 0.08, output_tokens=64)
    failed = RequestRecord(2, 0.0, 0.0, error="HTTP 503")
    assert meets(good, slo) and not meets(slow_tpot, slo) and not meets(failed, slo)
    s = summarize([good, slow_tpot, failed], 10.0, [50, 99], slo)
    assert s["completed"] == 2 and s["failed"] == 1
    assert s["slo_attainment"] == pytest.approx(1 / 3)
    assert s["p50_ttft_ms"] == pytest.approx(100.0)
    assert s["mean_tpot_ms"] == pytest.approx((10 + 80) / 2)
