"""The SLO study's pure parts (the runs need two GPUs): point parsing, scaled attainment, goodput, loading."""

from __future__ import annotations

import gzip
import json
import math

from bench.serving import gpu_slo_study
from bench.serving import gpu_slo_study_report as rep


def _rec(i: int, ttft: float | None, tpot: float | None, error: str | None = None, warmup: bool = False) -> dict:
    return {"index": -1 if warmup else i, "ttft": ttft, "tpot": tpot, "error": error, "warmup": warmup}


def test_parse_points_keeps_order():
    assert gpu_slo_study.parse_points("long:8,12;summ:10") == [("long", 8.0), ("long", 12.0), ("summ", 10.0)]


def test_attainment_scales_both_bounds_and_failures_miss():
    # base for "long": TTFT 200 ms, TPOT 15 ms
    recs = [_rec(0, 0.150, 0.010), _rec(1, 0.250, 0.010), _rec(2, 0.150, 0.020), _rec(3, None, None, "HTTP 503")]
    assert rep.attain(recs, "long", 1.0) == 0.25
    assert rep.attain(recs, "long", 1.5) == 0.75  # 300 ms / 22.5 ms: the two slow ones now meet it
    assert rep.attain(recs, "long", 10.0) == 0.75  # a failed request never meets it
    assert math.isinf(rep.pct(recs, "ttft", 99))
    assert rep.pct(recs, "ttft", 50) == 150.0


def test_goodput_stops_at_first_miss(tmp_path):
    good = [_rec(i, 0.1, 0.01) for i in range(10)]
    bad = [_rec(i, 0.5, 0.01) for i in range(10)]

    def doc(layout, pts):
        return {
            "layout": layout,
            "points": [
                {"workload": "long", "rate": r, "ramp": 2, "result": {"requests": [_rec(0, 9, 9, warmup=True)] + rs}}
                for r, rs in pts
            ],
        }

    a = tmp_path / "a.json.gz"
    with gzip.open(a, "wt") as f:
        json.dump(doc("1p1d", [(4.0, good), (8.0, bad), (12.0, good)]), f)
    b = tmp_path / "b.json.gz"  # a rerun of one point overrides it
    with gzip.open(b, "wt") as f:
        json.dump(doc("1p1d", [(8.0, good)]), f)
    pts = rep.load([str(a)])
    assert len(pts[("1p1d", "long", 4.0)]["records"]) == 8  # warm-up and the ramp's 2 dropped
    assert rep.goodput(pts, "1p1d", "long", 1.0, 0.9) == 4.0  # 12 passes, but 8 missed first
    assert rep.goodput(rep.load([str(a), str(b)]), "1p1d", "long", 1.0, 0.9) == 12.0
    assert "| 1p1d | 8 | 8 |" in rep.report(rep.load([str(a), str(b)]), 0.9)
