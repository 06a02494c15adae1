"""``distbench sweep``: the highest request rate whose SLO attainment meets the target (goodput).

Bracket, then bisect: starting at ``--rate-start``, double the rate while a run passes (halve while it
fails) until one passing and one failing rate bracket the knee, then bisect between them until they are
within ``--precision`` (relative) or ``--max-runs`` runs were made. Every run is an ordinary open-loop
``distbench run`` (its result is kept in ``--out-dir``); failed requests count as SLO misses.

Steady state: each point sends for at least ``min_duration_s`` (default 30 s: ``rate × 30`` requests, or
``--num-prompts`` if more), so a point is not a burst of 3 s measured before queues form.

Saturation: each point records the rate it achieved (completions per second of the run, drain included)
beside the rate it offered (requests sent per second of the sending span). A point whose achieved rate is
more than 10 % below the offered one is ``saturated``: the server fell behind, its queue was growing, and
no SLO verdict over a finite run speaks for the steady state. A saturated point never passes, so it is
never reported as goodput.

Noise: SLO attainment should fall as the rate rises. Where a higher rate attained more than a lower one
by more than the two points' sampling error, the sweep says so (``non_monotonic``) and treats it as noise:
the goodput is the highest passing rate below the lowest failing or saturated one.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

from distserve.distbench import result
from distserve.distbench.metrics import samples_needed, thin_tail
from distserve.distbench.runner import Options, run
from distserve.distbench.table import render

SATURATION = 0.9  # achieved / offered below this: saturated


def point(res: dict, rate: float) -> dict:
    recs = [r for r in res["requests"] if not r.get("warmup")]
    last = max((r["scheduled"] for r in recs), default=0.0)
    offered = len(recs) / (last + 1.0 / rate) if recs else 0.0  # n arrivals over n mean gaps
    achieved = res["completed"] / res["duration"] if res["duration"] > 0 else 0.0
    saturated = achieved < SATURATION * min(offered, rate)
    n = res.get("slo_judged", res["num_prompts"])
    att = res["slo_attainment"]
    return {
        "rate": rate,
        "sent": res["num_prompts"],
        "offered_rate": offered,
        "achieved_rate": achieved,
        "saturated": saturated,
        "slo_attainment": att,
        "attainment_ci95": 1.96 * math.sqrt(max(att * (1 - att), 0.25 / max(n, 1)) / max(n, 1)),
        "pass": bool(res["verdict"]["pass"]) and not saturated,
        "request_throughput": res["request_throughput"],
        "p99_ttft_ms": res["p99_ttft_ms"],
        "p99_tpot_ms": res["p99_tpot_ms"],
        "p99_e2el_ms": res["p99_e2el_ms"],
        "p99_samples": (res.get("sample_counts") or {}).get("ttft"),
        "failed": res["failed"],
        "late_sends": res["late_sends"],
        "interrupted": res["interrupted"],
    }


def non_monotonic(points: list[dict]) -> list[str]:
    """Pairs where a higher rate attained more than a lower one, beyond both points' sampling error."""
    pts = sorted(points, key=lambda p: p["rate"])
    out = []
    for lo, hi in zip(pts, pts[1:]):
        if hi["slo_attainment"] - lo["slo_attainment"] > lo["attainment_ci95"] + hi["attainment_ci95"]:
            out.append(
                f"{lo['rate']:g} req/s attained {100 * lo['slo_attainment']:.1f}% but "
                f"{hi['rate']:g} req/s {100 * hi['slo_attainment']:.1f}%"
            )
    return out


def goodput_of(points: list[dict]) -> float | None:
    """The highest passing rate below the lowest failing (or saturated) one."""
    failing = [p["rate"] for p in points if not p["pass"]]
    ceiling = min(failing, default=math.inf)
    passing = [p["rate"] for p in points if p["pass"] and p["rate"] < ceiling]
    return max(passing, default=None)


def sweep(
    opts: Options,
    rate_start: float,
    precision: float,
    max_runs: int,
    out_dir: Path,
    max_rate: float = math.inf,
    log=print,
    min_duration_s: float = 30.0,
) -> dict:
    points: list[dict] = []

    def measure(rate: float) -> bool:
        n = max(opts.spec.num_prompts, math.ceil(rate * min_duration_s))
        o = replace(opts, spec=replace(opts.spec, request_rate=rate, num_prompts=n), stop_on_saturation=True)
        res = run(o)
        result.save(res, out_dir / f"rate_{rate:g}.json")
        p = point(res, rate)
        points.append(p)
        word = "saturated" if p["saturated"] else ("pass" if p["pass"] else "FAIL")
        log(
            f"rate {rate:8.3g} req/s: sent {p['sent']}, achieved {p['achieved_rate']:.3g} req/s, attainment "
            f"{100 * p['slo_attainment']:5.1f}% ±{100 * p['attainment_ci95']:.1f}  {word}  "
            f"P99 TTFT {p['p99_ttft_ms']:.0f} ms  P99 TPOT {p['p99_tpot_ms']:.1f} ms  failed {p['failed']}"
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
    good = goodput_of(points)
    summary = {
        "slo": opts.slo,
        "slo_target": opts.slo_target,
        "min_duration_s": min_duration_s,
        "goodput_rate": good,
        "bracket": [lo, None if math.isinf(hi) else hi],
        "points": sorted(points, key=lambda p: p["rate"]),
        "bracketed": good is not None and any(p["rate"] > good and not p["pass"] for p in points),
        "non_monotonic": non_monotonic(points),
    }
    result.save(summary, out_dir / "sweep.json")
    return summary


def format_table(s: dict) -> str:
    header = ["rate", "sent", "offered", "achieved", "attain %", "±", "P99 TTFT", "P99 TPOT", "failed", "verdict"]
    rows = []
    for p in s["points"]:
        word = "saturated" if p.get("saturated") else ("pass" if p["pass"] else "FAIL")
        rows.append(
            [
                f"{p['rate']:.3g}",
                str(p.get("sent", "-")),
                f"{p.get('offered_rate', p['rate']):.3g}",
                f"{p.get('achieved_rate', p['request_throughput']):.3g}",
                f"{100 * p['slo_attainment']:.1f}",
                f"{100 * p.get('attainment_ci95', 0.0):.1f}",
                f"{p['p99_ttft_ms']:.0f}",
                f"{p['p99_tpot_ms']:.1f}",
                str(p["failed"]),
                word,
            ]
        )
    lines = [
        render(header, rows, left=0),
        "(rate: target, offered: sent per second of sending, achieved: completed per second of the run, all req/s; "
        "P99: ms; ±: 95 % sampling error of the attainment)",
    ]
    thin = [p for p in s["points"] if p.get("p99_samples") is not None and thin_tail(p["p99_samples"], 99.0)]
    if thin:
        lines.append(
            f"P99 of {len(thin)} point{'s' * (len(thin) != 1)} from fewer than {samples_needed(99.0):,} samples: the "
            f"largest value or near it (raise --min-duration for a P99 estimate); attainment is unaffected"
        )
    for note in s.get("non_monotonic") or []:
        lines.append(f"non-monotonic: {note}: treated as noise (goodput = highest pass below the lowest failure)")
    if any(p.get("saturated") for p in s["points"]):
        lines.append(
            f"saturated: achieved rate > {100 * (1 - SATURATION):.0f} % below the offered rate; "
            "never counted as goodput"
        )
    if s["goodput_rate"]:
        edge = "" if s["bracketed"] else " (no failing rate found: at least this)"
        at: dict = next((p for p in s["points"] if p["rate"] == s["goodput_rate"]), {})
        got = f" (achieved {at['achieved_rate']:.3g} req/s there)" if "achieved_rate" in at else ""
        lines.append(
            f"goodput: {s['goodput_rate']:.3g} req/s{got} at SLO attainment >= {100 * s['slo_target']:g}%{edge}"
        )
    else:
        lines.append("goodput: no rate tried met the SLO")
    return "\n".join(lines)
