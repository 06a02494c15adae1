"""``distbench sweep``: the highest request rate whose SLO attainment meets the target (goodput).

Bracket, then bisect: starting at ``--rate-start``, double the rate while a run passes (halve while it
fails) until one passing and one failing rate bracket the knee, then bisect between them until they are
within ``--precision`` (relative) or ``--max-runs`` runs were made. Every run is an ordinary open-loop
``distbench run`` (its result is kept in ``--out-dir``); failed requests count as SLO misses.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

from distbench import result
from distbench.runner import Options, run


def point(res: dict, rate: float) -> dict:
    return {
        "rate": rate,
        "slo_attainment": res["slo_attainment"],
        "pass": res["verdict"]["pass"],
        "request_throughput": res["request_throughput"],
        "p99_ttft_ms": res["p99_ttft_ms"],
        "p99_tpot_ms": res["p99_tpot_ms"],
        "p99_e2el_ms": res["p99_e2el_ms"],
        "failed": res["failed"],
        "late_sends": res["late_sends"],
        "interrupted": res["interrupted"],
    }


def sweep(
    opts: Options,
    rate_start: float,
    precision: float,
    max_runs: int,
    out_dir: Path,
    max_rate: float = math.inf,
    log=print,
) -> dict:
    points: list[dict] = []

    def measure(rate: float) -> bool:
        o = replace(opts, spec=replace(opts.spec, request_rate=rate), stop_on_saturation=True)
        res = run(o)
        result.save(res, out_dir / f"rate_{rate:g}.json")
        p = point(res, rate)
        points.append(p)
        log(
            f"rate {rate:8.3g} req/s: attainment {100 * p['slo_attainment']:5.1f}% "
            f"{'pass' if p['pass'] else 'FAIL'}  P99 TTFT {p['p99_ttft_ms']:.0f} ms  "
            f"P99 TPOT {p['p99_tpot_ms']:.1f} ms  failed {p['failed']}"
        )
        if res["interrupted"] == "stopped by signal":
            raise KeyboardInterrupt
        return p["pass"]

    lo, hi = 0.0, math.inf
    rate = rate_start
    while len(points) < max_runs:  # bracket
        if measure(rate):
            lo = rate
            if rate >= max_rate:
                break
            rate = min(rate * 2, max_rate)
        else:
            hi = rate
            if lo > 0:
                break
            rate /= 2
        if lo > 0 and hi < math.inf:
            break
    while lo > 0 and hi < math.inf and hi / lo - 1 > precision and len(points) < max_runs:  # bisect
        mid = (lo + hi) / 2
        if measure(mid):
            lo = mid
        else:
            hi = mid
    summary = {
        "slo": opts.slo,
        "slo_target": opts.slo_target,
        "goodput_rate": lo or None,
        "bracket": [lo, None if math.isinf(hi) else hi],
        "points": sorted(points, key=lambda p: p["rate"]),
        "bracketed": lo > 0 and not math.isinf(hi),
    }
    result.save(summary, out_dir / "sweep.json")
    return summary


def format_table(s: dict) -> str:
    lines = [f"{'rate':>9}{'attain %':>10}{'P99 TTFT':>10}{'P99 TPOT':>10}{'req/s':>8}{'failed':>8}  verdict"]
    for p in s["points"]:
        lines.append(
            f"{p['rate']:>9.3g}{100 * p['slo_attainment']:>10.1f}{p['p99_ttft_ms']:>10.0f}"
            f"{p['p99_tpot_ms']:>10.1f}{p['request_throughput']:>8.2f}{p['failed']:>8}  "
            f"{'pass' if p['pass'] else 'FAIL'}"
        )
    if s["goodput_rate"]:
        edge = "" if s["bracketed"] else " (no failing rate found: at least this)"
        lines.append(f"goodput: {s['goodput_rate']:.3g} req/s at SLO attainment >= {100 * s['slo_target']:g}%{edge}")
    else:
        lines.append("goodput: no rate tried met the SLO")
    return "\n".join(lines)
