"""``distbench compare A.json B.json``: the seed's table — mean, P95, P99, std of TTFT, TPOT and E2E for A
and B, the change in %, and whether the change is significant: a bootstrap 95 % confidence interval of
the difference (B - A) from the per-request samples; significant when it excludes 0.
"""

from __future__ import annotations

import numpy as np

from distbench.result import records_of

STATS = ("mean", "p95", "p99", "std")
METRICS = (("TTFT", "ttft"), ("TPOT", "tpot"), ("E2E", "e2e"))


def _stat(x: np.ndarray, name: str, axis=None):
    if name == "mean":
        return x.mean(axis=axis)
    if name == "std":
        return x.std(axis=axis)
    return np.percentile(x, float(name[1:]), axis=axis, method="inverted_cdf")  # nearest rank, as the HDR figures


def samples(result: dict, metric: str) -> np.ndarray:
    vals = [getattr(r, metric) for r in records_of(result) if r.ok]
    return np.array([v for v in vals if v is not None], dtype=float) * 1000.0


def compare(a: dict, b: dict, resamples: int = 1000, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for label, metric in METRICS:
        xa, xb = samples(a, metric), samples(b, metric)
        if not len(xa) or not len(xb):
            continue
        ia = rng.integers(0, len(xa), size=(resamples, len(xa)))
        ib = rng.integers(0, len(xb), size=(resamples, len(xb)))
        ra, rb = xa[ia], xb[ib]
        for stat in STATS:
            va, vb = float(_stat(xa, stat)), float(_stat(xb, stat))
            diff = _stat(rb, stat, axis=1) - _stat(ra, stat, axis=1)
            lo, hi = np.percentile(diff, [2.5, 97.5])
            rows.append(
                {
                    "metric": label,
                    "stat": stat,
                    "a": va,
                    "b": vb,
                    "change_pct": 100.0 * (vb - va) / va if va else float("nan"),
                    "ci95_ms": [float(lo), float(hi)],
                    "significant": bool(lo > 0 or hi < 0),
                }
            )
    return rows


def format_table(rows: list[dict], name_a: str = "A", name_b: str = "B") -> str:
    lines = [
        (
            f"{'metric':<7}{'stat':<6}{name_a[:12]:>13}{name_b[:12]:>13}{'change':>10}  "
            f"{'95% CI of B-A (ms)':<24}significant"
        )
    ]
    for r in rows:
        ci = f"[{r['ci95_ms'][0]:+.2f}, {r['ci95_ms'][1]:+.2f}]"
        lines.append(
            f"{r['metric']:<7}{r['stat']:<6}{r['a']:>13.2f}{r['b']:>13.2f}{r['change_pct']:>+9.1f}%  "
            f"{ci:<24}{'yes' if r['significant'] else 'no'}"
        )
    return "\n".join(lines)
