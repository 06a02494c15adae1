"""``distbench merge``: several results (parallel clients, Locust workers, repeated runs) as one.

Lossless: the HDR histograms are added bucket by bucket and every percentile, mean and std is read from
the sum, exactly what one client sending all of those requests would have reported. Counts add;
per-request records are concatenated.

Throughput is taken over the time the runs were running: the union of their own spans (``duration``).
Runs side by side (parallel clients, Locust workers) share one span; runs one after the other add their
spans, and a gap between them counts for nothing (``wall_span_s`` keeps first start to last end).
"""

from __future__ import annotations

from distserve.distbench.metrics import hist_stats, merge_histograms


def merge(results: list[dict]) -> dict:
    if not results:
        raise ValueError("merge needs at least one result")
    start = min(r["start_unix"] for r in results)
    end = max(r["end_unix"] for r in results)
    dur = max(busy_span(results), 1e-9)
    percentiles = results[0]["percentiles"]
    out = dict(results[0])
    keys = (
        "num_prompts",
        "completed",
        "failed",
        "cancelled",
        "rate_limited",
        "rate_limited_with_retry_after",
        "total_input_tokens",
        "total_output_tokens",
    )
    for key in (*keys, "late_sends", "backoff_delays", "backoff_total_s"):
        out[key] = sum(r.get(key, 0) for r in results)
    failures: dict[str, int] = {}
    for r in results:
        for reason, n in r.get("failures", {}).items():
            failures[reason] = failures.get(reason, 0) + n
    out.update(
        start_unix=start,
        end_unix=end,
        duration=dur,
        wall_span_s=end - start,
        failures=failures,
        request_throughput=out["completed"] / dur,
        output_throughput=out["total_output_tokens"] / dur,
        total_token_throughput=(out["total_input_tokens"] + out["total_output_tokens"]) / dur,
    )
    hs = merge_histograms([r["histograms"] for r in results])
    for name, h in hs.items():
        out.update(hist_stats(h, name, percentiles))
    out["histograms"] = {name: h.encode().decode("ascii") for name, h in hs.items()}
    slos = {str(r.get("slo")) for r in results}
    if "slo_met" in results[0] and len(slos) == 1:
        out["slo_met"] = sum(r["slo_met"] for r in results)
        out["slo_judged"] = sum(r.get("slo_judged", r["num_prompts"]) for r in results)
        out["slo_attainment"] = out["slo_met"] / out["slo_judged"] if out["slo_judged"] else 0.0
    else:
        for k in ("slo", "slo_met", "slo_judged", "slo_attainment"):
            out.pop(k, None)
    goodputs = [r.get("request_goodput") for r in results]
    out["request_goodput"] = (
        sum(g * r["duration"] for g, r in zip(goodputs, results)) / dur
        if all(g is not None for g in goodputs)
        else None
    )
    for key in ("ttfts", "itls", "input_lens", "output_lens", "errors", "requests"):
        out[key] = [x for r in results for x in r.get(key, [])]
    counts: dict[str, int] = {}
    for r in results:
        for name, n in (r.get("sample_counts") or {}).items():
            counts[name] = counts.get(name, 0) + n
    out["sample_counts"] = counts
    out["merged_from"] = [r.get("date") for r in results]
    out.pop("verdict", None)
    return out


def busy_span(results: list[dict]) -> float:
    """Seconds covered by at least one run: the union of the [start_unix, end_unix] intervals."""
    spans = sorted((r["start_unix"], r["end_unix"]) for r in results)
    total, (lo, hi) = 0.0, spans[0]
    for s, e in spans[1:]:
        if s > hi:
            total += hi - lo
            lo, hi = s, e
        else:
            hi = max(hi, e)
    return total + hi - lo
