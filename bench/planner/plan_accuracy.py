#!/usr/bin/env python
"""Planner accuracy: predicted vs measured attainment and goodput for the layouts this repo measured on H200s.

    python -m bench.planner.plan_accuracy [--results DIR] [--out bench/results/plan_accuracy_DATE.json] [--seeds 5]

Three sets of recorded runs, one H200 profile (the shipped
``planner/profiles/h200-llama2-7b.json``, as ``bench/planner/h200_profile.py`` builds it). The recorded runs are
read from ``--results`` (default ``bench/results``, git-ignored: restore the recorded folder from history as
bench/README.md says); the ones the profile is built from are also kept under ``bench/records``:
- the two-GPU SLO study (docs/performance/history.md section 9, ``gpu_issue16/slo_study_*.json.gz``): long, summ and
  ShareGPT lengths, 1P1D vs 2 colocated replicas, several rates. Each recorded point is *replayed*: the
  simulator gets the same requests (lengths, send times) with the run's limits (decode batch 128, prefill
  budget 4096, the KV blocks each worker reported) and the report's scoring (first ``ramp`` requests
  dropped; a request meets the SLO at scale s when TTFT <= s x base and TPOT <= s x base). Goodput = the
  highest rate of the grid with >= 90 % attainment below the first miss, for measured and predicted alike,
  per layout and SLO scale, and the winner; beside it the continuous predicted goodput (Poisson, 30 s).
  Points: the second call's (flash-first prefill attention) and, for the fixed-length long workload, the
  first call's (its varied-length points paid a cuDNN plan per new length: section 9);
- four H200s (section 13, ``gpu_issue19``): 2P2D, 3P1D, 1P3D, 4 colocated at 16 req/s of long prompts,
  replayed the same way, steady state and with the cold-start stalls the colocated run measured;
- the first two-GPU runs (section 6, 2026-11-29, older serving code, 5 s per rate), below.

GPU part (no GPU needed): the shipped H200 profile and
each recorded two-GPU serving run (``bench/results/gpu_serving_two-gpu*_2026-11-29*.json``). For every
(layout, rate) the run measured, the simulator replays the same number of requests at that rate with the
run's config (decode batch 128, KV 36 000 MB per worker) over ``--seeds`` arrival seeds and reports the mean
predicted attainment; goodput is the highest rate *of the measured grid* at >= 90 % attainment (the measured
definition), and the continuous predicted goodput is printed beside it. CPU part: ``--cpu-profile FILE`` with
``--cpu-measured FILE`` (JSON written by tests/planner/test_plan_ordering_cpu.py's report) when given.
The four-GPU predictions: goodput (>= 90 % of requests within TTFT 200 ms and TPOT 50 ms, and within the
study's tight base at scale 1.5: 300 / 22.5 ms) of 2P2D, 3P1D, 1P3D and 4 colocated for the long (2048/128)
and ShareGPT workloads.

One GPU split between a prefill and a decode worker (issue 31), ``--one-gpu`` (alone; about 10 s, no
bench/results needed): the shipped profile plus the H200 SM-share curve of the recorded runs
(``bench.planner.h200_profile.share_points``), against every greedy point of 50:50, 100:50 and colocated@2048 at
128/64 and 2048/128 under ``bench/baselines/h200`` (``plan_accuracy_records.one_gpu``): attainment and decode step
per recorded point (same requests count and rate, ``--seeds`` arrival seeds), measured goodput (the highest rate
measured at >= 90 %), predicted on the same rates and continuous. ``--write-sm-profile FILE`` also writes that
profile, for ``distserve plan --profile FILE --devices 1``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from collections.abc import Sequence
from pathlib import Path

from bench.lib.results import write_result
from bench.planner import plan_accuracy_records as records
from distserve.planner.latency import LatencyModel
from distserve.planner.layouts import Layout, kv_capacity_tokens, limits_from_config
from distserve.planner.profile import Profile
from distserve.planner.profile import load as load_profile
from distserve.planner.search import Planner
from distserve.planner.simulator import simulate
from distserve.planner.slo import SLO, attainment
from distserve.planner.workload import load_workload
from distserve.server.config import load_config

REPO = Path(__file__).resolve().parents[2]

RESULTS = REPO / "bench" / "results"
STUDY_FILES = {
    "two-gpu long run 1": ("gpu_serving_two-gpu_long_2026-11-29.json", "long", "ttft:200ms,tpot:50ms"),
    "two-gpu long run 2": ("gpu_serving_two-gpu_long_2026-11-29_run2.json", "long", "ttft:200ms,tpot:50ms"),
    "two-gpu short": ("gpu_serving_two-gpu_2026-11-29.json", "short", "ttft:250ms,tpot:50ms"),
}


def study_layouts(cfg_over: dict, kvb: int) -> dict[str, Layout]:
    cfg = load_config(None, cfg_over)
    kv = kv_capacity_tokens(cfg, "cuda", kvb)
    pf, dec, col = limits_from_config(cfg, kv)
    return {
        "disaggregated_1p1d": Layout("disaggregated", 1, 1, pf, dec),
        "colocated_2replicas": Layout("colocated", 0, 2, pf, col),
    }


def predicted_attainment(model, layout, lengths, rate, n, prof, slo, seeds) -> float:
    vals = []
    for seed in range(seeds):
        res = simulate(
            model,
            layout,
            [lengths[i % len(lengths)] for i in range(n)],
            rate,
            prof.kv_bytes_per_token,
            prof.overhead_ttft_ms,
            seed,
            prof.handoff_ms,
            prof.handoff_steps,
            prof.admit_steps,
        )
        vals.append(attainment(slo, res.latencies))
    return statistics.mean(vals)


def gpu_accuracy(prof: Profile, seeds: int) -> list[dict]:
    model = LatencyModel.fit(prof)
    rows = []
    for name, (fname, wl_name, slo_text) in STUDY_FILES.items():
        data = json.loads((RESULTS / fname).read_text())
        args = data["args"]
        prompt, output = (int(x) for x in args[wl_name].split(","))
        cfg_over = {
            "prefill": {"max_seq_len": args["max_seq_len"]},
            "decode": {"max_batch_size": args["max_batch"], "max_concurrent_requests": args["max_batch"]},
            "cache": {"kv_cache_memory_mb": args["kv_cache_mb"], "gpu_memory_utilization": 0},
        }
        layouts = study_layouts(cfg_over, prof.kv_bytes_per_token)
        slo = SLO.parse(slo_text)
        wl = load_workload(f"prompt={prompt},output={output}", n=50)
        planner = Planner.for_profile(dataclasses.replace(prof, engine_thread=False), wl, slo)  # step on the loop
        for mode, lay in layouts.items():
            sweep = data["modes"].get(mode, {}).get("sweeps", {}).get(wl_name, [])
            if not sweep:
                continue
            points = []
            for r in sweep:
                s = r["summary"]
                pred = predicted_attainment(
                    model,
                    lay,
                    wl.requests,
                    r["rate"],
                    s["requests"],
                    prof,
                    slo,
                    seeds,
                )
                points.append(
                    {
                        "rate": r["rate"],
                        "requests": s["requests"],
                        "measured": s["slo_attainment"],
                        "predicted": round(pred, 3),
                        "measured_ttft_p90": round(s["ttft_ms"]["p90"]),
                        "measured_tpot_p90": round(s["tpot_ms"]["p90"], 1),
                    }
                )
            meas_g = max([p["rate"] for p in points if p["measured"] >= 0.9], default=0.0)
            pred_g = max([p["rate"] for p in points if p["predicted"] >= 0.9], default=0.0)
            cont = planner.goodput(lay)
            rows.append(
                {
                    "study": name,
                    "workload": f"{prompt}/{output}",
                    "slo": slo_text,
                    "layout": lay.name(),
                    "points": points,
                    "measured_goodput_grid": meas_g,
                    "predicted_goodput_grid": pred_g,
                    "predicted_goodput_continuous": round(cont, 2),
                    "error_grid": None if not meas_g else round(pred_g / meas_g - 1, 3),
                }
            )
    return rows


def four_gpu(num_requests: int) -> list[dict]:
    prof = load_profile("h200-llama2-7b")
    cfg = load_config(None, {"decode": {"max_batch_size": 128, "max_concurrent_requests": 128}})
    pf, dec, col = limits_from_config(cfg, 0)  # KV sized from GPU memory (~113 GiB): not the limit here
    layouts = [
        Layout("disaggregated", 2, 2, pf, dec),
        Layout("disaggregated", 3, 1, pf, dec),
        Layout("disaggregated", 1, 3, pf, dec),
        Layout("colocated", 0, 4, pf, col),
    ]
    out = []
    for wl_spec in ("prompt=2048,output=128", "sharegpt"):
        wl = load_workload(wl_spec, n=num_requests, seed=0)
        for slo_text, form in (
            ("ttft:200ms,tpot:50ms", "attainment"),
            ("ttft:300ms,tpot:22.5ms", "attainment"),  # the study's tight base (200 / 15 ms) at scale 1.5
        ):
            slo = SLO.parse(slo_text, form)
            planner = Planner.for_profile(prof, wl, slo)
            for lay in layouts:
                e = planner.evaluate(lay)
                out.append(
                    {
                        "workload": wl_spec,
                        "mean_prompt": round(wl.mean_prompt),
                        "mean_output": round(wl.mean_output),
                        "slo": slo.describe(),
                        "layout": lay.name(),
                        "goodput": round(e.goodput, 2),
                        "per_gpu": round(e.per_device, 2),
                        "bottleneck": e.bottleneck,
                    }
                )
    return out


def print_study(title: str, study: dict) -> None:
    print(f"\n{title}: attainment measured / predicted per point")
    for r in study["points"]:
        print(
            f"  {r['layout']:<10} {r['workload']:<8} {r['rate']:>4g}: "
            + ", ".join(f"x{k} {r['measured'][k]:.0%}/{r['predicted'][k]:.0%}" for k in ("1", "1.5", "2"))
            + f";  200/50 {r['measured_loose']:.0%}/{r['predicted_loose']:.0%}"
        )
    print("\n  goodput at >= 90 % (grid rule) measured / predicted, continuous prediction, winners")
    for g in study["goodput"]:
        a, b = g["1p1d"], g["colocated2"]
        print(
            f"  {g['workload']:<8} x{g['scale']:g}: 1p1d {a['measured']:g}/{a['predicted']:g} ({a['continuous']}), "
            f"colocated2 {b['measured']:g}/{b['predicted']:g} ({b['continuous']}); winner measured "
            f"{g['winner_measured']}{'' if g['decidable'] else ' (undecidable: within one grid step)'}, "
            f"predicted on the grid {g['winner_predicted']}, continuous {g['winner_continuous']}"
        )
    print("  summary:", json.dumps(study["summary"]))
    if study["excluded_prefix_hits"]:
        print(
            "  not replayed (mostly prefix-cache hits: layout, workload, rate, share):", study["excluded_prefix_hits"]
        )


def _share_scale(text: str) -> tuple[str, int, float]:
    """'prefill:50=2.0' -> ('prefill', 50, 2.0); ValueError otherwise."""
    head, x = text.split("=")
    phase, share = head.split(":")
    if phase not in ("prefill", "decode") or not 1 <= int(share) < 100 or float(x) <= 0:
        raise ValueError(text)
    return phase, int(share), float(x)


def one_gpu_main(
    seeds: int, out: str | None, write_profile: str | None, scales: Sequence[tuple[str, int, float]] = ()
) -> None:
    """The one-GPU comparison (``records.one_gpu``), printed as the table of docs/performance/planner.md;
    ``scales``: (phase, share, ms(share)/ms(100)) replacing the derived curve's points there."""
    from bench.planner.h200_profile import BASELINES, h200_profile_with_shares
    from distserve.planner.profile import SharePoint

    prof = h200_profile_with_shares()
    for phase, share, x in scales:
        base = [p for p in prof.sm_shares if p.phase == phase and p.share == 100]
        kept = [p for p in prof.sm_shares if (p.phase, p.share) != (phase, share)]
        made = [SharePoint(phase, share, p.batch, p.size, p.ms * x, "derived") for p in base]
        note = f"sm_shares: {phase} at {share} % set to {x}x by --share-scale"
        prof = dataclasses.replace(prof, sm_shares=(*kept, *made), notes=(*prof.notes, note))
    if write_profile:
        prof.save(write_profile)
        print(f"profile with the SM-share curve written: {write_profile}")
    for note in prof.notes[-3 - len(scales) :]:
        print(f"  {note}")
    rows = records.one_gpu(prof, BASELINES, seeds)
    print(f"\none H200, SLO {records.ONE_GPU_SLO}, >= 90 % within it; goodput req/s: measured (highest rate measured")
    print("at >= 90 % in any run) / predicted on the same rates / predicted continuous (Poisson, >= 30 s)")
    for r in rows:
        print(
            f"  {r['workload']:<9} {r['layout']:<20} {r['measured_goodput']:>6g} / {r['predicted_goodput_grid']:>6g} / "
            f"{r['predicted_goodput_continuous']:>6g}"
        )
    print(
        "\nper point: rate: attainment measured / predicted, decode step ms measured / predicted"
        "  (* before the gate fix)"
    )
    for r in rows:
        cells = "; ".join(
            f"{p['rate']:g}{'*' if p['before_gate_fix'] else ''}: {p['measured']:.0%}/{p['predicted']:.0%} "
            f"{p['measured_decode_step_ms'] or 0:.1f}/{p['predicted_decode_step_ms']:.1f}"
            for p in r["points"]
        )
        print(f"  {r['workload']} {r['layout']}: {cells}")
    if out:
        write_result(out, {"one_gpu": rows, "sm_shares_notes": list(prof.notes[-3 - len(scales) :])})


def main() -> None:
    global RESULTS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--num-requests", type=int, default=600)
    ap.add_argument("--out", default=None)
    ap.add_argument("--skip-four-gpu", action="store_true")
    ap.add_argument("--skip-continuous", action="store_true", help="section 9 without the goodput searches")
    ap.add_argument(
        "--without-prefill-costs",
        action="store_true",
        help="the profile without the prefill floor / per-sequence / chunked-continuation costs and the engine thread "
        "(to compare; replays still follow each recorded run's engine_thread)",
    )
    ap.add_argument(
        "--prefill-per-seq-ms",
        type=float,
        default=None,
        help="override the profile's per-sequence prefill cost (e.g. the engine-only 7.0 ms) to compare",
    )
    ap.add_argument("--results", default=str(RESULTS), help="the recorded results folder (default bench/results)")
    ap.add_argument(
        "--one-gpu",
        action="store_true",
        help="only the one-GPU split (issue 31): 50:50, 100:50 and colocated@2048 against the kept runs under "
        "bench/baselines/h200 (no bench/results needed), on the shipped profile plus the recorded SM-share curve",
    )
    ap.add_argument(
        "--write-sm-profile",
        default=None,
        metavar="FILE",
        help="with --one-gpu: also write that profile (for distserve plan --profile FILE --devices 1)",
    )
    ap.add_argument(
        "--share-scale",
        action="append",
        default=[],
        metavar="PHASE:SHARE=X",
        help="with --one-gpu: set the curve's ms(share)/ms(100) of a phase, e.g. prefill:50=2.0 (a sensitivity check)",
    )
    args = ap.parse_args()
    if args.one_gpu:
        try:
            scales = [_share_scale(x) for x in args.share_scale]
        except ValueError:
            ap.error(f"--share-scale must be PHASE:SHARE=X like prefill:50=2.0, got {args.share_scale!r}")
        one_gpu_main(args.seeds, args.out, args.write_sm_profile, scales)
        return
    RESULTS = Path(args.results)
    if not RESULTS.is_dir():
        ap.error(f"no recorded results at {RESULTS} (bench/README.md: restoring the recorded runs)")
    prof = load_profile("h200-llama2-7b")
    if args.prefill_per_seq_ms is not None:
        prof = dataclasses.replace(prof, prefill_per_seq_ms=args.prefill_per_seq_ms)
    if args.without_prefill_costs:
        prof = dataclasses.replace(
            prof, prefill_floor_ms=0.0, prefill_per_seq_ms=0.0, prefill_chunk_ms=0.0, engine_thread=False
        )
    x4 = records.four_gpu(prof, RESULTS / "gpu_issue19")
    print("four H200s, 16 req/s of 2048/128 (section 13): attainment measured / predicted steady / predicted cold")
    for r in x4:
        m, p, c = r["measured"], r["predicted"], r["predicted_cold"]
        print(
            f"  {r['layout']:<11} TTFT 200 + TPOT 50 ms: {r['measured_loose']:.0%} / {r['predicted_loose']:.0%} / "
            f"{r['predicted_cold_loose']:.0%};  TPOT 15 ms x1, x1.5, x2: "
            + ", ".join(f"{m[k]:.0%}/{p[k]:.0%}/{c[k]:.0%}" for k in m)
            + f"  (cold stalls per worker {r['cold_stalls'][0]} x {r['cold_stalls'][1]} ms)"
        )
    fit = records.admission_fit(prof, RESULTS / "gpu_issue16")
    print("\ncolocated TTFT P50 (ms), warm points: measured, replayed with admit_steps 1..4 (the profile uses 3)")
    for r in fit:
        print(
            f"  {r['run']:<36} {r['workload']:<8} {r['rate']:>4g}: {r['measured']:6.1f} | "
            + " ".join(f"{r[k]:6.1f}" for k in r if k.startswith("k"))
        )
    pf_rows = [
        row for name in records.PREFILL_WORKER_RUNS for row in records.prefill_worker_replay(prof, RESULTS / name)
    ]
    print("\n1P1D prefill worker per point: ms per step (prompts per step), TTFT P50 / P90 ms; measured | replayed")
    for r in pf_rows:
        print(
            f"  {r['run']:<58} {r['point']:<15} {r['measured_ms_per_step']:6.1f} ({r['measured_prompts_per_step']:.2f}) "  # noqa: E501
            f"{r['measured_ttft_p50_p90'][0]:6.1f} / {r['measured_ttft_p50_p90'][1]:6.1f} | "
            f"{r['replayed_ms_per_step']:6.1f} ({r['replayed_prompts_per_step']:.2f}) "
            f"{r['replayed_ttft_p50_p90'][0]:6.1f} / {r['replayed_ttft_p50_p90'][1]:6.1f}"
            f"  (prefix-cache hits {r['prefix_hit_share']:.0%})"
        )
    study = records.slo_study(prof, RESULTS / "gpu_issue16", continuous=not args.skip_continuous)
    print_study("two H200s, SLO study (section 9, 2026-11-30: step on the event loop)", study)
    rerun = records.slo_study(
        prof,
        RESULTS / "gpu_issue16_rerun",
        continuous=not args.skip_continuous,
        first=(),
        reruns=records.SLO_STUDY_RERUN,
    )
    print_study("two H200s, SLO study rerun (section 9b, 2026-12-01: engine thread, one call per layout)", rerun)
    rows = gpu_accuracy(prof, args.seeds)
    print("two-GPU study (H200, 7B shape): measured vs predicted attainment per rate")
    for r in rows:
        print(
            f"\n{r['study']} {r['workload']} {r['slo']} {r['layout']}: goodput on the grid measured "
            f"{r['measured_goodput_grid']} / predicted {r['predicted_goodput_grid']} req/s "
            f"(continuous prediction {r['predicted_goodput_continuous']})"
        )
        for p in r["points"]:
            print(
                f"  rate {p['rate']:>7}: measured {p['measured']:.0%} (TTFT P90 {p['measured_ttft_p90']} ms, "
                f"TPOT P90 {p['measured_tpot_p90']} ms), predicted {p['predicted']:.0%}  [{p['requests']} requests]"
            )
    four = [] if args.skip_four_gpu else four_gpu(args.num_requests)
    if four:
        print("\nfour H200s (issue 19), predicted:")
        for r in four:
            print(
                f"  {r['workload']:<24} {r['slo']:<55} {r['layout']:<24} goodput {r['goodput']:>7} "
                f"({r['per_gpu']} per GPU)  {r['bottleneck']}"
            )
    if args.out:
        doc = {
            "two_gpu_2026_11_29": rows,
            "four_gpu_predicted": four,
            "four_gpu_replay": x4,
            "slo_study": study,
            "slo_study_rerun": rerun,
            "profile_prefill_costs": {
                k: [getattr(prof, k), prof.cost_origins.get(k, "")]
                for k in ("prefill_floor_ms", "prefill_per_seq_ms", "prefill_chunk_ms")
            },
            "admission_fit": fit,
            "prefill_worker": pf_rows,
        }
        write_result(args.out, doc)


if __name__ == "__main__":
    main()
