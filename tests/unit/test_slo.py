"""One definition of "meets the SLO" (``sla/slo.py``), and the four users judging the same latencies alike:
distbench's per-request rule and verdict, the SLA audit's windows and breaker, the planner's attainment and
percentile forms, the release gate's TTFT P99. A value equal to its limit meets it everywhere."""

from __future__ import annotations

import math

import pytest

from distserve.distbench.metrics import attainment as distbench_attainment
from distserve.distbench.metrics import meets as distbench_meets
from distserve.distbench.records import RequestRecord
from distserve.distbench.runner import verdict
from distserve.planner import slo as planner_slo
from distserve.sla import slo
from distserve.sla.audit import _latency_row
from distserve.sla.breaker import BreakerSettings, BreakerState, CircuitBreaker
from distserve.sla.spec import Objective
from distserve.sla.window import WindowStats


def test_the_rules_as_stated():
    assert slo.within(0.25, 0.25) and not slo.within(0.25 + 1e-9, 0.25)
    assert slo.meets({"ttft": 0.25, "tpot": 0.05}, {"ttft": 0.25, "tpot": 0.05})
    assert not slo.meets({"ttft": 0.2}, {"ttft": 0.25}, ok=False)  # a failed request meets nothing
    assert slo.meets({"ttft": 0.2, "tpot": None}, {"ttft": 0.25, "tpot": 0.01})  # one token: no TPOT to judge
    assert slo.meets({"ttft": 0.2}, {"ttft": 0.25, "tpot": 0.01})
    assert not slo.meets({"itl": [0.01, 0.2, 0.01]}, {"itl": 0.1})  # ITL: the largest gap
    assert slo.meets({"itl": [0.01, 0.1]}, {"itl": 0.1})
    values = list(range(1, 11))
    assert slo.nearest_rank(values, 90) == 9 and slo.nearest_rank(values, 99) == 10
    assert slo.nearest_rank(values, 50) == 5 and slo.nearest_rank([], 90) == math.inf
    assert slo.percentile_meets(values, 90, 9) and not slo.percentile_meets(values, 90, 8.999)
    assert slo.attainment_meets(0.9, 0.9) and not slo.attainment_meets(0.899, 0.9)


def test_the_typed_spec_parses_and_describes():
    s = slo.SLO.parse("ttft:200ms,tpot:0.05s", form="p90")
    assert s.limits == {"ttft": 200.0, "tpot": 50.0} and s.percentile == 90.0
    assert s.describe() == "P90 of each: TTFT <= 200 ms, TPOT <= 50 ms"
    assert slo.SLO.parse("e2el:2s").percentile is None
    assert planner_slo.SLO is slo.SLO  # the planner's SLO is this one
    for bad in ("ttft", "itl:5ms", "ttft:0", "ttft:5ms,ttft:6ms", "ttft:fast"):
        with pytest.raises(slo.SLOError):
            slo.SLO.parse(bad)
    with pytest.raises(slo.SLOError, match="slo-form"):
        slo.SLO.parse("ttft:1s", form="p50")


def test_distbench_the_audit_the_breaker_the_planner_and_the_gate_agree_at_the_limit():
    limit_ms = 250.0
    # distbench: a request whose TTFT equals the limit meets it; one a microsecond over does not
    at, over = (
        RequestRecord(0, 0.0, ttft=limit_ms / 1000, e2e=1.0, output_tokens=2),
        RequestRecord(1, 0.0, ttft=limit_ms / 1000 + 1e-6, e2e=1.0, output_tokens=2),
    )
    failed = RequestRecord(2, 0.0, ttft=0.001, error="HTTP 500: boom")
    assert distbench_meets(at, {"ttft": limit_ms / 1000}) and not distbench_meets(over, {"ttft": limit_ms / 1000})
    assert not distbench_meets(failed, {"ttft": 1.0})
    assert distbench_attainment([at, over, failed], {"ttft": limit_ms / 1000}) == pytest.approx(1 / 3)
    # distbench's verdict: attainment equal to the target passes
    res = {"num_prompts": 10, "failed": 0, "slo_attainment": 0.9, "slo_target": 0.9, "slo": {"ttft": limit_ms}}
    assert verdict(res)["pass"] and not verdict(res | {"slo_attainment": 0.89})["pass"]
    # the SLA audit: samples equal to the threshold are no violations, and an observed P50 at it passes
    o = Objective("ttft", 50.0, limit_ms)
    row = _latency_row(_base(), o, [limit_ms / 1000] * 40)
    assert row.violations == 0 and row.status == "pass", row
    row = _latency_row(_base(), o, [limit_ms / 1000 * 1.01] * 40)
    assert row.violations == 40 and row.status == "fail", row
    # the breaker: a percentile equal to its threshold is no breach
    b = CircuitBreaker(BreakerSettings(threshold_ms=limit_ms, consecutive_s=0.001, min_samples=1), clock=lambda: 0.0)
    for _ in range(3):
        b.evaluate(WindowStats(limit_ms, 100))
    assert b.state is BreakerState.CLOSED and b.breach_since is None
    b.evaluate(WindowStats(limit_ms + 1, 100))
    assert b.breach_since is not None
    # the planner: attainment (one-token answers have no TPOT to hold them to) and the P90 form
    plan = planner_slo.SLO.parse(f"ttft:{limit_ms:g}ms,tpot:50ms")
    samples = [{"ttft": limit_ms, "tpot": 50.0, "e2el": 900.0}, {"ttft": limit_ms, "e2el": 300.0}]
    samples.append({"ttft": math.inf, "e2el": math.inf})  # a failed request
    assert planner_slo.attainment(plan, samples) == pytest.approx(2 / 3)
    p90 = planner_slo.SLO.parse(f"ttft:{limit_ms:g}ms", form="p90")
    ten = [{"ttft": float(v)} for v in range(241, 251)]  # nearest-rank P90 = 249
    assert planner_slo.meets(p90, ten) and not planner_slo.meets(p90, [{"ttft": v["ttft"] + 2} for v in ten])


def test_the_gate_uses_the_shared_comparison():
    import ast
    import inspect

    from distserve.ci import gate

    tree = ast.parse(inspect.getsource(gate))
    calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert "within" in calls and gate.within is slo.within


def _base() -> dict:
    return {
        "audit_id": "a",
        "spec": "s",
        "window_index": 0,
        "window_start": "0",
        "window_start_s": 0.0,
        "window_s": 60.0,
    }
