"""bench/serving/gpu_serving.py's pure parts (it needs GPUs to run): its summary of a distbench result and goodput."""

from __future__ import annotations

import math

import pytest

from bench.serving import gpu_serving
from distserve.distbench import result
from distserve.distbench.records import RequestRecord


def _res(n_ok: int, n_failed: int, ttft: float = 0.1, tpot: float = 0.02) -> dict:
    recs = [
        RequestRecord(
            i,
            i * 0.1,
            i * 0.1,
            1000 + i * 0.1,
            ttft=ttft,
            ttft_service=ttft,
            e2e=ttft + 15 * tpot,
            itl=[tpot] * 15,
            prompt_tokens=128,
            output_tokens=16,
        )
        for i in range(n_ok)
    ]
    recs += [RequestRecord(n_ok + i, 0.0, error="HTTP 503: busy") for i in range(n_failed)]
    return result.build(recs, 10.0, 1000.0, {"strategy": "poisson"}, (50, 90, 95, 99), {}, {})


def test_failed_requests_count_as_misses_and_as_infinitely_slow():
    slo = {"ttft_ms": 250.0, "tpot_ms": 50.0}
    s = gpu_serving.summarize(_res(95, 5), slo, open_loop_run=True)
    assert s["slo_attainment"] == pytest.approx(0.95) and s["failed"] == 5
    assert s["p90_ttft_all_ms"] == pytest.approx(100.0, rel=1e-3)
    assert math.isinf(s["p99_ttft_all_ms"])  # 5 % failed: the P99 over all requests is a failure
    assert s["meets"] == {"attainment_90": True, "p90": True, "p99": False}
    assert s["errors"] == {"HTTP 503: busy": 5} and "client_lag_ms" in s
    slow = gpu_serving.summarize(_res(100, 0, tpot=0.06), slo, open_loop_run=False)
    assert slow["slo_attainment"] == 0.0 and not any(slow["meets"].values())


def test_goodput_is_the_highest_passing_rate():
    sweep = [
        {"rate": r, "summary": {"meets": {"attainment_90": r <= 4, "p90": r <= 3, "p99": r <= 2}}}
        for r in (1, 2, 3, 4, 5)
    ]
    g = gpu_serving.goodput(sweep, gpus=2)
    assert g["attainment_90"]["rps"] == 4 and g["attainment_90"]["rps_per_gpu"] == 2
    assert g["p99"]["rps"] == 2 and g["p99"]["bracketed"]
