#!/usr/bin/env python
"""Summarize the result JSONs of bench/peers/vs_vllm_cpu.sh as a markdown table.

Usage: summarize_vs_vllm.py RESULTS_DIR [--ttft-ms 250] [--tpot-ms 50] [--min-attainment 90]

Reads every *.json in RESULTS_DIR written by vLLM's benchmark client (`*.pytorch.json` side
files are skipped). Per server and rate it prints TTFT P50/P99, TPOT P50/P99, SLO attainment
and output tok/s; per server the goodput = the highest request rate whose attainment is at
least --min-attainment percent.

SLO attainment is the fraction of *all* requests sent (failed ones count as misses) with
TTFT <= --ttft-ms and TPOT <= --tpot-ms. It is computed from the per-request arrays the client
saves with --save-detailed (`ttfts`, `latencies`, `output_lens`, `errors`, in seconds), with
TPOT defined as the client does: (latency - ttft) / (output_len - 1), 0 for a 1-token output.
Without the per-request arrays it falls back to the client's own `request_goodput` (requests
meeting the --goodput SLOs per second of benchmark duration) * duration / num_prompts, which is
the same quantity when the client ran with the same SLOs.

Percentiles and SLO checks come from distbench's one statistics module (HDR, nearest rank; the
client's own pNN keys are preferred where the file has them).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
from typing import Any

from distserve.distbench.metrics import meets, stats_of
from distserve.distbench.records import RequestRecord
from distserve.distbench.vllm_compat import records_from_vllm


def per_request(d: dict[str, Any]) -> tuple[list[tuple[bool, float | None, float]], list[RequestRecord]] | None:
    """(ok, ttft_s, tpot_s) per request from a --save-detailed result, and the records; else None."""
    recs = records_from_vllm(d)
    if recs is None:
        return None
    return [(r.ok, r.ttft, r.tpot if r.tpot is not None else 0.0) for r in recs], recs


def summarize_one(path: str, ttft_ms: float, tpot_ms: float) -> dict[str, Any]:
    with open(path) as f:
        d = json.load(f)
    server = d.get("server") or d.get("label") or os.path.basename(path).rsplit("_rate", 1)[0]
    rate = d.get("request_rate")
    rate = float("inf") if rate in (None, "inf") else float(rate)
    num = int(d.get("num_prompts") or d.get("completed", 0) + d.get("failed", 0))
    row: dict[str, Any] = {
        "file": os.path.basename(path),
        "server": server,
        "rate": rate,
        "num": num,
        "completed": d.get("completed"),
        "out_tps": d.get("output_throughput"),
    }
    got = per_request(d)
    good_ttfts: list[float]
    good_tpots: list[float]
    client_tpots: list[float]
    if got is not None:
        reqs, recs = got
        good_ttfts = [t * 1000 for ok, t, _ in reqs if ok and t is not None]  # a request that is ok has a TTFT
        good_tpots = [tp * 1000 for ok, _, tp in reqs if ok]
        # The client's own percentiles only count outputs longer than one token for TPOT.
        client_tpots = [tp * 1000 for (ok, _, tp), out in zip(reqs, d["output_lens"]) if ok and out > 1]
        met = sum(meets(r, {"ttft": ttft_ms / 1000, "tpot": tpot_ms / 1000}) for r in recs)
        row["attain"] = 100.0 * met / max(num, len(reqs), 1)
        row["attain_src"] = "per-request"
        row["completed"] = sum(1 for ok, _, _ in reqs if ok)
    else:
        good_ttfts = good_tpots = client_tpots = []
        gp = d.get("request_goodput")
        if gp is not None and d.get("duration") and num:
            row["attain"] = 100.0 * gp * d["duration"] / num
            row["attain_src"] = "client goodput"
        else:
            row["attain"] = None
            row["attain_src"] = "n/a"
    # Prefer the client's own percentiles (same definitions as the published vLLM numbers).
    for metric, fallback in (("ttft", good_ttfts), ("tpot", client_tpots or good_tpots)):
        for p in (50, 99):
            v = d.get(f"p{p}_{metric}_ms")
            if v is None and p == 50:
                v = d.get(f"median_{metric}_ms")
            if v is None and fallback:
                v = stats_of([x / 1000 for x in fallback], metric, (p,))[f"p{p}_{metric}_ms"]
            row[f"{metric}_p{p}"] = v
    return row


def fmt(v: float | None, nd: int = 1) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    return f"{v:.{nd}f}"


def fmt_rate(r: float) -> str:
    return "inf" if math.isinf(r) else (f"{r:g}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results_dir")
    ap.add_argument("--ttft-ms", type=float, default=250.0)
    ap.add_argument("--tpot-ms", type=float, default=50.0)
    ap.add_argument("--min-attainment", type=float, default=90.0, help="percent")
    a = ap.parse_args(argv)

    paths = sorted(p for p in glob.glob(os.path.join(a.results_dir, "*.json")) if not p.endswith(".pytorch.json"))
    rows: list[dict[str, Any]] = []
    for p in paths:
        try:
            rows.append(summarize_one(p, a.ttft_ms, a.tpot_ms))
        except (ValueError, KeyError, TypeError, json.JSONDecodeError) as e:
            print(f"skipping {p}: {e}", file=sys.stderr)
    if not rows:
        print(f"no result JSONs in {a.results_dir}", file=sys.stderr)
        return 1

    order: dict[str, int] = {}
    for r in rows:  # vllm first, then the others in the order first seen
        order.setdefault(r["server"], 0 if r["server"] == "vllm" else len(order) + 1)
    rows.sort(key=lambda r: (order[r["server"]], r["server"], r["rate"]))

    slo = f"TTFT ≤ {a.ttft_ms:g} ms and TPOT ≤ {a.tpot_ms:g} ms"
    print(f"SLO: {slo}; attainment = share of all requests sent meeting both.\n")
    print(
        "| server | rate (req/s) | ok/sent | TTFT P50 ms | TTFT P99 ms | TPOT P50 ms "
        "| TPOT P99 ms | SLO attainment | output tok/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        att = "—" if r["attain"] is None else f"{r['attain']:.1f}%"
        if r["attain_src"] == "client goodput":
            att += "*"
        print(
            f"| {r['server']} | {fmt_rate(r['rate'])} | {r['completed']}/{r['num']} "
            f"| {fmt(r['ttft_p50'])} | {fmt(r['ttft_p99'])} | {fmt(r['tpot_p50'])} "
            f"| {fmt(r['tpot_p99'])} | {att} | {fmt(r['out_tps'], 0)} |"
        )
    if any(r["attain_src"] == "client goodput" for r in rows):
        print("\n\\* from the client's request_goodput (no per-request data saved)")

    print(f"\nGoodput (highest rate with SLO attainment ≥ {a.min_attainment:g}%):\n")
    print("| server | goodput (req/s) | rates measured |")
    print("|---|---|---|")
    goodput: dict[str, float | None] = {}
    for server in sorted(order, key=lambda s: order[s]):
        mine = [r for r in rows if r["server"] == server]
        passing = [r["rate"] for r in mine if r["attain"] is not None and r["attain"] >= a.min_attainment]
        best = goodput[server] = max(passing) if passing else None
        if best is None:
            gp = "< lowest rate measured"
        elif best == max(r["rate"] for r in mine):
            gp = f"≥ {fmt_rate(best)} (highest rate measured)"
        else:
            gp = fmt_rate(best)
        print(f"| {server} | {gp} | {' '.join(fmt_rate(r['rate']) for r in mine)} |")

    base = goodput.get("vllm")
    if base:
        lines = []
        for server, g in goodput.items():
            if server != "vllm" and g is not None:
                lines.append(f"- {server}: {g / base:.2f}× vLLM's goodput")
        if lines:
            print("\n" + "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
