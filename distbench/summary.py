"""The terminal summary of one result: throughput, latency table, coordinated omission, failures, verdict."""

from __future__ import annotations

import math

from distbench.metrics import pkey

ROWS = (
    ("TTFT", "ttft"),
    ("TTFT svc", "ttft_service"),
    ("TPOT", "tpot"),
    ("ITL", "itl"),
    ("E2EL", "e2el"),
    ("E2EL svc", "e2el_service"),
    ("send lag", "send_lag"),
)


def _f(v) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.2f}"


def format_summary(s: dict) -> str:
    lines = [
        f"sent {s['num_prompts']}, completed {s['completed']}, failed {s['failed']}, "
        f"{s['duration']:.1f} s, {s['request_throughput']:.2f} req/s, "
        f"{s['output_throughput']:.0f} output tok/s"
        + (f", goodput {s['request_goodput']:.2f} req/s" if s.get("request_goodput") is not None else "")
    ]
    if s.get("interrupted"):
        lines.append(f"partial result: {s['interrupted']}")
    fit = s.get("dataset_fit") or {}
    if fit.get("dropped"):
        lines.append(
            f"dataset: dropped {fit['dropped']} of {fit['considered']} prompts longer than the server's "
            f"max_model_len {fit['max_model_len']} minus the output length"
        )
    if s["completed"]:
        qs = s["percentiles"]
        lines.append(f"{'ms':<10}{'mean':>9}{'std':>9}" + "".join(f"{pkey(q).upper():>9}" for q in qs))
        for label, key in ROWS:
            if key in ("ttft_service", "e2el_service", "send_lag") and s.get("strategy") == "closed":
                continue
            lines.append(
                f"{label:<10}{_f(s[f'mean_{key}_ms']):>9}{_f(s[f'std_{key}_ms']):>9}"
                + "".join(f"{_f(s[f'{pkey(q)}_{key}_ms']):>9}" for q in qs)
            )
        if s.get("strategy") != "closed":
            lines.append(
                f"open loop: TTFT/E2EL from the scheduled send time (svc: from the actual send); "
                f"{s['late_sends']} sends late by > {s['late_threshold_ms']:g} ms, "
                f"max {_f(s['max_send_lag_ms'])} ms"
            )
    if s["failed"]:
        lines.append("failures:")
        for reason, n in list(s["failures"].items())[:8]:
            lines.append(f"  {n:>6} × {reason}")
    if "slo_attainment" in s:
        slo = ", ".join(f"{k} <= {v:g} ms" for k, v in s["slo"].items())
        lines.append(
            f"SLO ({slo}) attainment: {100 * s['slo_attainment']:.1f}% "
            f"({s['slo_met']} of {s['num_prompts']}; failed requests count as misses)"
        )
    if s.get("verdict"):
        lines.append(s["verdict"]["line"])
    return "\n".join(lines)
