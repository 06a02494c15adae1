"""Aggregates of per-request records: percentiles, SLO attainment, throughput.

Pure functions of the records (DistServe's habit): the raw records are saved
first, every figure can be recomputed from them.
"""

from __future__ import annotations

import math
import statistics

from distbench.loadgen import RequestRecord

METRICS = ("ttft", "tpot", "itl", "e2e")


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def values(records: list[RequestRecord], metric: str) -> list[float]:
    if metric == "itl":
        return [x for r in records if r.ok for x in r.itl]
    out = [getattr(r, metric) for r in records if r.ok]
    return [v for v in out if v is not None]


def parse_slo(text: str | None) -> dict[str, float]:
    """'ttft:250ms,tpot:50ms' -> {'ttft': 0.25, 'tpot': 0.05} (seconds)."""
    out: dict[str, float] = {}
    if not text:
        return out
    for part in text.split(","):
        name, _, limit = part.strip().partition(":")
        if name not in METRICS or not limit:
            raise ValueError(f"--slo: {part!r} is not METRIC:VALUE with METRIC one of {', '.join(METRICS)}")
        scale = 1e-3 if limit.endswith("ms") else 1.0
        try:
            out[name] = float(limit.removesuffix("ms").removesuffix("s")) * scale
        except ValueError:
            raise ValueError(f"--slo: {limit!r} is not a duration like 250ms or 0.25s") from None
    return out


def meets(r: RequestRecord, slo: dict[str, float]) -> bool:
    if not r.ok:
        return False
    for name, limit in slo.items():
        if name == "itl":
            if r.itl and max(r.itl) > limit:
                return False
            continue
        v = getattr(r, name)
        if v is not None and v > limit:
            return False
    return True


def summarize(records: list[RequestRecord], wall_s: float, percentiles: list[float],
              slo: dict[str, float]) -> dict:
    ok = [r for r in records if r.ok]
    out: dict = {"completed": len(ok), "failed": len(records) - len(ok), "duration": wall_s,
                 "request_throughput": len(ok) / wall_s if wall_s else 0.0,
                 "output_throughput": sum(r.output_tokens for r in ok) / wall_s if wall_s else 0.0,
                 "total_output_tokens": sum(r.output_tokens for r in ok)}
    for m in METRICS:
        vs = [v * 1000 for v in values(records, m)]
        out[f"mean_{m}_ms"] = statistics.fmean(vs) if vs else math.nan
        out[f"std_{m}_ms"] = statistics.pstdev(vs) if len(vs) > 1 else 0.0
        for q in percentiles:
            key = f"p{q:g}".replace(".", "_") if q != int(q) else f"p{int(q)}"
            out[f"{key}_{m}_ms"] = percentile(vs, q)
    if slo:
        out["slo"] = {k: v * 1000 for k, v in slo.items()}
        out["slo_attainment"] = sum(meets(r, slo) for r in records) / len(records) if records else 0.0
    return out
