"""The terminal summary of one result: throughput, latency table, coordinated omission, failures, verdict.

Every percentile comes with the number of samples behind it (column ``n``); a percentile whose tail holds
fewer than ``MIN_TAIL_SAMPLES`` samples (P99 below 1 000, P99.9 below 10 000) is marked ``*`` and
explained under the table: it is the run's maximum, or close to it, not a tail estimate.
"""

from __future__ import annotations

import math

from distserve.distbench.metrics import MIN_TAIL_SAMPLES, pkey, samples_needed, thin_tail
from distserve.distbench.table import render

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


def _count(s: dict, key: str) -> int | None:
    counts = s.get("sample_counts") or {}
    if key == "send_lag":
        return s["num_prompts"]
    return counts.get(key)


def latency_table(s: dict) -> tuple[str, list[str]]:
    """(the table, the caution lines for thin tails)."""
    qs = s["percentiles"]
    header = ["ms", "n", "mean", "std", *(pkey(q).upper() for q in qs)]
    rows: list[list[str]] = []
    thin: set[float] = set()
    for label, key in ROWS:
        if key in ("ttft_service", "e2el_service", "send_lag") and s.get("strategy") == "closed":
            continue
        n = _count(s, key)
        cells = [label, "-" if n is None else str(n), _f(s[f"mean_{key}_ms"]), _f(s[f"std_{key}_ms"])]
        for q in qs:
            v = _f(s[f"{pkey(q)}_{key}_ms"])
            if n is not None and n and v != "-" and thin_tail(n, q):
                v += "*"
                thin.add(q)
            cells.append(v)
        rows.append(cells)
    notes = []
    if thin:
        need = ", ".join(f"{pkey(q).upper()} {samples_needed(q):,}" for q in sorted(thin))
        notes.append(
            f"* fewer than {MIN_TAIL_SAMPLES} samples above this percentile (column n): the value is the largest "
            f"or near it, not a tail estimate (samples needed: {need})"
        )
    return render(header, rows), notes


def format_summary(s: dict) -> str:
    cancelled = s.get("cancelled", 0)
    limited = s.get("rate_limited", 0)
    lines = [
        f"sent {s['num_prompts']}, completed {s['completed']}, failed {s['failed']}"
        + (f", rate-limited (429) {limited}" if limited else "")
        + (f", cancelled {cancelled}" if cancelled else "")
        + f", {s['duration']:.1f} s, {s['request_throughput']:.2f} req/s, "
        f"{s['output_throughput']:.0f} output tok/s"
        + (f", goodput {s['request_goodput']:.2f} req/s" if s.get("request_goodput") is not None else "")
    ]
    if s.get("merged_from"):
        lines.append(
            f"merged {len(s['merged_from'])} runs: throughput over the {s['duration']:.1f} s they were running "
            f"(wall span {s.get('wall_span_s', s['duration']):.1f} s)"
        )
    if s.get("interrupted"):
        lines.append(f"partial result: {s['interrupted']}")
    fit = s.get("dataset_fit") or {}
    if fit.get("dropped"):
        lines.append(
            f"dataset: dropped {fit['dropped']} of {fit['considered']} prompts longer than the server's "
            f"max_model_len {fit['max_model_len']} minus the output length"
        )
    if cancelled:
        lines.append(
            f"{cancelled} requests were in flight when the run stopped: recorded as cancelled "
            f"(neither completed nor failed)"
        )
    if s["completed"]:
        table, notes = latency_table(s)
        lines.append(table)
        lines.extend(notes)
        if s.get("strategy") != "closed":
            lines.append(
                f"open loop: TTFT/E2EL from the scheduled send time (svc: from the actual send); "
                f"{s['late_sends']} sends late by > {s['late_threshold_ms']:g} ms, "
                f"max {_f(s['max_send_lag_ms'])} ms"
            )
    if limited:
        with_ra = s.get("rate_limited_with_retry_after", 0)
        waited = "; closed-loop users waited the Retry-After before their next request"
        lines.append(
            f"{limited} requests were refused with 429 (server at capacity; {with_ra} with Retry-After): "
            f"counted apart, neither completed nor failed" + (waited if s.get("strategy") == "closed" else "")
        )
    if s.get("backoff_delays"):
        lines.append(
            f"closed loop back-off: {s['backoff_delays']} sends delayed after a fast failure "
            f"({s['backoff_total_s']:.1f} s of waiting in all)"
        )
    if s["failed"]:
        lines.append("failures:")
        for reason, n in list(s["failures"].items())[:8]:
            lines.append(f"  {n:>6} × {reason}")
    if "slo_attainment" in s:
        slo = ", ".join(f"{k} <= {v:g} ms" for k, v in s["slo"].items())
        judged = s.get("slo_judged", s["num_prompts"])
        extra = (
            f"; {s['num_prompts'] - judged} cancelled with no verdict left out" if judged != s["num_prompts"] else ""
        )
        lines.append(
            f"SLO ({slo}) attainment: {100 * s['slo_attainment']:.1f}% "
            f"({s['slo_met']} of {judged}; failed requests count as misses{extra})"
        )
    if s.get("verdict"):
        lines.append(s["verdict"]["line"])
    return "\n".join(lines)
