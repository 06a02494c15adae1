"""Replays of the recorded SLO-study runs for ``bench/planner/plan_accuracy.py``
(docs/performance/history.md sections 9, 10, 13).

Each recorded point is simulated with the same requests and limits (``bench.planner.replay``) and scored with the
report's rules (``bench/serving/gpu_slo_study_report.py``); goodput uses the measured definition on the run's rate
grid, for measured and predicted attainment alike.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path

from bench.planner.replay import attained, cold_start, layout_of_run, replay, run_engine_thread
from bench.planner.serving_records import prefix_hit_shares, read_run, stall_events
from bench.serving.gpu_slo_study_report import BASE, SCALES, meets
from distserve.planner.layouts import Layout
from distserve.planner.profile import Profile
from distserve.planner.search import Planner
from distserve.planner.slo import SLO, percentile
from distserve.planner.workload import Workload

SLO_STUDY_FIRST = ("slo_study_1p1d.json.gz", "slo_study_colocated2.json.gz")
SLO_STUDY_FLASH = ("slo_study_1p1d_flash.json.gz", "slo_study_colocated2_flash.json.gz")
# the rerun of 2026-12-01 (engine thread, 48 pre-warm requests, every point in one call per layout): section 9b
SLO_STUDY_RERUN = ("slo_study_1p1d.json.gz", "slo_study_colocated2.json.gz")
X4 = (
    "slo_study_x4_2p2d.json.gz",
    "slo_study_x4_3p1d.json.gz",
    "slo_study_x4_1p3d.json.gz",
    "slo_study_x4_colocated4.json.gz",
)
# 1P1D runs whose prefill worker is replayed step by step: the prefill-bound probes of today's code (one H200,
# engine thread on, two servers: study serving-slo-study; the profile's prefill costs are fitted on their
# 128-token points) and the SLO-study rerun (section 9b, two H200s, before the varlen attention)
PREFILL_WORKER_RUNS = (
    "gpu_issue17_prefill/run2/prefill_serving_thread_on_r1.json.gz",
    "gpu_issue17_prefill/run2/prefill_serving_thread_on_r2.json.gz",
    # taken after the profile's constants were fixed (commit e160089), to check them: 512- and 2 048-token
    # prompts, engine thread on and off
    "gpu_issue17_prefill/run3_mid/prefill_serving_thread_on_r1.json.gz",
    "gpu_issue17_prefill/run3_mid/prefill_serving_thread_off_r1.json.gz",
    "gpu_issue17_prefill/run4_long/prefill_serving_thread_on_r1.json.gz",
    "gpu_issue16_rerun/slo_study_1p1d.json.gz",
)
HIT_LIMIT = (
    0.2  # points with at least this share of prompt tokens from the prefix cache are not replayed (0-5 % when new)
)
TIE = 0.1  # continuous predictions closer than this (relative) are a tie: the model's own error is larger
LOOSE = (200.0, 50.0)  # the four-GPU study's headline SLO: TTFT 200 ms, TPOT 50 ms


def _score(samples: list[dict], ttft: float, tpot: float) -> float:
    return attained(samples, lambda a, b: a <= ttft and b <= tpot)


def _measured(point: dict, ttft: float, tpot: float) -> float:
    recs = sorted((r for r in point["result"]["requests"] if not r.get("warmup")), key=lambda r: r["index"])
    recs = recs[point.get("ramp", 0) :]
    return sum(meets(r, ttft, tpot) for r in recs) / max(1, len(recs))


def _lengths(point: dict) -> list[tuple[int, int]]:
    return [(r["prompt_tokens"], r["output_tokens"]) for r in point["result"]["requests"] if not r.get("warmup")]


def replay_points(
    prof: Profile, folder: Path, first: tuple[str, ...], reruns: tuple[str, ...], excluded: list | None = None
) -> list[dict]:
    """Measured and predicted attainment of every point; a rerun's point replaces the first call's, and the
    first call's varied-length points are left out (section 9: a cuDNN plan per new prompt length). Points
    whose prompts were mostly prefix-cache hits (``HIT_LIMIT``: the study re-sent the same prompts at every
    rate of a workload, and a hit ran a slower attention path then; the simulator has no prefix cache) are
    left out too, and listed in ``excluded`` (layout, workload, rate, hit share)."""
    chosen: dict[tuple, tuple[dict, dict]] = {}
    for name in first + reruns:
        doc = read_run(folder / name)
        shares = prefix_hit_shares(doc)
        for pt in doc["points"]:
            key = (doc["layout"], pt["workload"], pt["rate"])
            if name in first and len({r["prompt_tokens"] for r in pt["result"]["requests"]}) > 1:
                continue
            share = shares.get((pt["workload"], pt["rate"]), 0.0)
            if share >= HIT_LIMIT:
                chosen.pop(key, None)
                if excluded is not None:
                    excluded.append([*key, round(share, 2)])
                continue
            chosen[key] = (doc, pt)
    rows = []
    for (layout, wl, rate), (doc, pt) in sorted(chosen.items()):
        steady = replay(prof, doc, pt)
        k, stall = cold_start(doc, pt)
        cold = replay(prof, doc, pt, cold=True) if k else steady
        t, p = BASE[wl]
        rows.append(
            {
                "layout": layout,
                "workload": wl,
                "rate": rate,
                "n": len(steady),
                "cold_stalls": [k, round(stall)],
                "measured": {f"{s:g}": round(_measured(pt, s * t, s * p), 3) for s in SCALES},
                "predicted": {f"{s:g}": round(_score(steady, s * t, s * p), 3) for s in SCALES},
                "predicted_cold": {f"{s:g}": round(_score(cold, s * t, s * p), 3) for s in SCALES},
                "measured_loose": round(_measured(pt, *LOOSE), 3),
                "predicted_loose": round(_score(steady, *LOOSE), 3),
                "predicted_cold_loose": round(_score(cold, *LOOSE), 3),
                "lengths": _lengths(pt),
            }
        )
    return rows


def grid_goodput(rows: list[dict], layout: str, wl: str, key: str, scale: str, target: float = 0.9) -> float:
    """The report's rule: the highest grid rate with attainment >= target below the first rate that misses."""
    best = 0.0
    for r in sorted((r for r in rows if r["layout"] == layout and r["workload"] == wl), key=lambda r: r["rate"]):
        if r[key][scale] < target:
            break
        best = r["rate"]
    return best


def winner(a: float, b: float, names: tuple[str, str], tol: float = 0.0) -> str:
    """The layout with the higher goodput; a tie within ``tol`` (relative) of the larger."""
    if math.isclose(a, b) or abs(a - b) <= tol * max(a, b):
        return "tie"
    return names[0] if a > b else names[1]


def slo_study(
    prof: Profile,
    folder: Path,
    scales: tuple[float, ...] = (1.0, 1.5, 2.0),
    continuous: bool = True,
    first: tuple[str, ...] = SLO_STUDY_FIRST,
    reruns: tuple[str, ...] = SLO_STUDY_FLASH,
) -> dict:
    """Section 9: per workload and SLO scale, grid goodput per layout measured / predicted, the winners, and
    the continuous predicted goodput (Poisson arrivals of the recorded lengths, 30 s). ``first``/``reruns``:
    which recorded runs (the first call's varied-length points are left out). A measured winner is
    *undecidable* when the two measured goodputs are within one step of the rate grid of each other (one
    point's noise; e.g. colocated summ 10 req/s 84 % but 15 req/s 89 % in the rerun)."""
    excluded: list = []
    rows = replay_points(prof, folder, first, reruns, excluded)
    layouts = ("1p1d", "colocated2")
    docs = {d["layout"]: d for d in (read_run(folder / n) for n in reruns)}
    table = []
    for wl, (t, p) in BASE.items():
        lengths = [x for r in rows if r["workload"] == wl for x in r["lengths"]]
        for s in scales:
            key = f"{s:g}"
            line: dict = {"workload": wl, "scale": s}
            for lay in layouts:
                doc = docs[lay]
                line[lay] = {
                    "measured": grid_goodput(rows, lay, wl, "measured", key),
                    "predicted": grid_goodput(rows, lay, wl, "predicted", key),
                    "continuous": round(
                        _continuous(
                            dataclasses.replace(prof, engine_thread=run_engine_thread(doc)),
                            layout_of_run(doc),
                            lengths,
                            s * t,
                            s * p,
                        ),
                        1,
                    )
                    if continuous
                    else 0.0,
                }
                m, pr = line[lay]["measured"], line[lay]["predicted"]
                line[lay]["within_25"] = abs(pr - m) <= 0.25 * m if m else pr == 0
            a, b = line["1p1d"]["measured"], line["colocated2"]["measured"]
            line["winner_measured"] = winner(a, b, layouts)
            line["decidable"] = _steps_apart(rows, wl, a, b) >= 2
            line["winner_predicted"] = winner(line["1p1d"]["predicted"], line["colocated2"]["predicted"], layouts)
            line["winner_continuous"] = winner(
                line["1p1d"]["continuous"], line["colocated2"]["continuous"], layouts, TIE
            )
            table.append(line)
    for r in rows:
        r.pop("lengths")
    return {"points": rows, "goodput": table, "summary": summarize(table), "excluded_prefix_hits": excluded}


def _steps_apart(rows: list[dict], wl: str, a: float, b: float) -> int:
    """Steps of the workload's union rate grid (0 first) between two goodputs."""
    grid = [0.0] + sorted({r["rate"] for r in rows if r["workload"] == wl})
    return abs(grid.index(a) - grid.index(b))


def summarize(table: list[dict]) -> dict:
    """Counts over the (workload, scale) entries: grid goodputs within 25 % per layout, right winners (all
    entries, and the decidable ones only), for the grid and the continuous predictions."""
    dec = [g for g in table if g["decidable"]]
    return {
        "entries": len(table),
        "within_25": {lay: sum(g[lay]["within_25"] for g in table) for lay in ("1p1d", "colocated2")},
        "winner_right_grid": sum(g["winner_predicted"] == g["winner_measured"] for g in table),
        "winner_right_continuous": sum(g["winner_continuous"] == g["winner_measured"] for g in table),
        "decidable": len(dec),
        "decidable_right_grid": sum(g["winner_predicted"] == g["winner_measured"] for g in dec),
        "decidable_right_continuous": sum(g["winner_continuous"] == g["winner_measured"] for g in dec),
    }


def _continuous(prof: Profile, layout: Layout, lengths: list, ttft: float, tpot: float) -> float:
    slo = SLO.parse(f"ttft:{ttft}ms,tpot:{tpot}ms")
    return Planner.for_profile(prof, Workload("recorded", tuple(lengths)), slo).goodput(layout, precision=0.03)


def four_gpu(prof: Profile, folder: Path) -> list[dict]:
    """Section 13: the four layouts at 16 req/s, replayed (steady and with the measured cold stalls)."""
    out = []
    for name in X4:
        doc = read_run(folder / name)
        pt = doc["points"][0]
        steady = replay(prof, doc, pt)
        k, stall = cold_start(doc, pt)
        cold = replay(prof, doc, pt, cold=True) if k else steady
        t, p = BASE["long"]
        out.append(
            {
                "layout": doc["layout"],
                "rate": pt["rate"],
                "n": len(steady),
                "cold_stalls": [k, round(stall)],
                "measured_loose": round(_measured(pt, *LOOSE), 3),
                "predicted_loose": round(_score(steady, *LOOSE), 3),
                "predicted_cold_loose": round(_score(cold, *LOOSE), 3),
                "measured": {f"{s:g}": round(_measured(pt, s * t, s * p), 3) for s in (1.0, 1.5, 2.0)},
                "predicted": {f"{s:g}": round(_score(steady, s * t, s * p), 3) for s in (1.0, 1.5, 2.0)},
                "predicted_cold": {f"{s:g}": round(_score(cold, s * t, s * p), 3) for s in (1.0, 1.5, 2.0)},
            }
        )
    return out


def admission_fit(prof: Profile, folder: Path, ks: tuple[int, ...] = (1, 2, 3, 4)) -> list[dict]:
    """The colocated TTFT P50 of every warm colocated point (no stalls), measured and replayed with each
    ``admit_steps``: the table the profile's constant (``bench.planner.h200_profile.ADMIT_STEPS``) is read from."""
    rows = []
    for name in SLO_STUDY_FLASH[1:] + SLO_STUDY_FIRST[1:]:
        doc = read_run(folder / name)
        for pt in doc["points"]:
            if stall_events(pt) or (name in SLO_STUDY_FIRST and pt["workload"] != "long"):
                continue
            recs = sorted((r for r in pt["result"]["requests"] if not r.get("warmup")), key=lambda r: r["index"])
            row = {"run": name, "workload": pt["workload"], "rate": pt["rate"]}
            row["measured"] = round(statistics.median(r["ttft"] * 1000 for r in recs[pt["ramp"] :]), 1)
            for k in ks:
                lat = replay(dataclasses.replace(prof, admit_steps=k), doc, pt)
                row[f"k{k}"] = round(statistics.median(x["ttft"] for x in lat), 1)
            rows.append(row)
    return rows


def prefill_worker_replay(prof: Profile, path: Path) -> list[dict]:
    """The 1P1D prefill worker of a recorded run, per point: ms per step and prompts per step (its ``/metrics``
    deltas) and TTFT P50 / P90 (the point's requests after ``ramp``), measured and replayed."""
    from bench.planner.replay import replay_result
    from bench.planner.serving_records import prefill_worker_points

    doc = read_run(path)
    shares = prefix_hit_shares(doc)
    measured = {pw.source.split(" ")[1]: pw for pw in prefill_worker_points(path)}
    out = []
    for pt in doc["points"]:
        key = f"{pt['workload']}@{pt['rate']:g}"
        if key not in measured:
            continue  # a server's first point whose counters include the pre-warm load
        pw = measured[key]
        res = replay_result(prof, doc, pt)
        s = res.prefill_stats
        recs = sorted((r for r in pt["result"]["requests"] if not r.get("warmup")), key=lambda r: r["index"])
        recs = recs[pt.get("ramp", 0) :]
        m_ttft = [r["ttft"] * 1000 for r in recs if r.get("ttft") is not None and not r.get("error")]
        p_ttft = [x["ttft"] for x in res.latencies[pt.get("ramp", 0) :]]
        out.append(
            {
                "run": f"{path.parent.name}/{path.name}",
                "point": key,
                "prefix_hit_share": round(shares.get((pt["workload"], pt["rate"]), float("nan")), 2),
                "measured_ms_per_step": round(pw.mean_step_ms, 1),
                "measured_prompts_per_step": round(pw.prompts_per_step, 2),
                "replayed_ms_per_step": round(s["busy_ms"] / max(1.0, s["steps"]), 1),
                "replayed_prompts_per_step": round(s["seqs"] / max(1.0, s["steps"]), 2),
                "measured_ttft_p50_p90": [round(percentile(m_ttft, q), 1) for q in (50, 90)],
                "replayed_ttft_p50_p90": [round(percentile(p_ttft, q), 1) for q in (50, 90)],
            }
        )
    return out


# --- one H200 split between a prefill and a decode worker (issue 31; docs/performance/serving-one-gpu.md) --------
# every recorded one-GPU serving run with a 50:50 or 100:50 split or colocated@2048 point, greedy sampling (each
# point sent new prompts); ``bench/baselines/h200/`` holds them (no bench/results needed)
ONE_GPU_RUNS = (
    "serving-one-gpu-knees-128-64.json",
    "serving-one-gpu-knees-2048-128.json",
    "serving-one-gpu-overlap-2048-128-and-128-64.json",
    "serving-one-gpu-overlap-gate-fixed.json",
    "serving-one-gpu-overlap-gate-fixed-colocated-low.json",
    "serving-one-gpu-overlap-gate-fixed-colocated-repeat.json",
    "serving-one-gpu-overlap-gates-fixed-edge.json",
    "serving-one-gpu-overlap-gates-fixed-split-high.json",
)
# bench layout -> (SM split or None, prefill.max_num_batched_tokens); the runs' max_seq_len was 4096
ONE_GPU_LAYOUTS = {
    "split50:50:50+ref": ((50, 50), 4096),
    "split100:100:50+ref": ((100, 50), 4096),
    "colocated@2048": (None, 2048),
}
ONE_GPU_WORKLOADS = {"128/64": "prompt=128,output=64", "2048/128": "prompt=2048,output=128"}
ONE_GPU_SLO = "ttft:250ms,tpot:50ms"
# runs made before the router's decode-room gate was fixed (docs/performance/serving-one-gpu.md, sixth session):
# the gate, not the GPU, limited the split there (100:50 at 128/64: 90 req/s before, 130 after)
BEFORE_GATE_FIX = (
    "serving-one-gpu-knees-128-64.json",
    "serving-one-gpu-knees-2048-128.json",
    "serving-one-gpu-overlap-2048-128-and-128-64.json",
)


def one_gpu_points(baselines: Path) -> dict[tuple[str, str], list[dict]]:
    """{(bench layout, workload): [recorded greedy point, ...]} with each point's file and the workers' KV blocks."""
    out: dict[tuple[str, str], list[dict]] = {}
    for name in ONE_GPU_RUNS:
        doc = json.loads((baselines / name).read_text())
        for lay in doc["layouts"]:
            if lay["layout"] not in ONE_GPU_LAYOUTS:
                continue
            blocks = {w["role"]: w["memory"]["kv_blocks"] for w in lay.get("workers", [])}
            for p in lay.get("points", []):
                if p.get("sampling") != "greedy" or p["workload"] not in ONE_GPU_WORKLOADS or "slo_attainment" not in p:
                    continue
                out.setdefault((lay["layout"], p["workload"]), []).append({**p, "file": name, "kv_blocks": blocks})
    return out


def one_gpu_layout(name: str, blocks: dict[str, int], block_size: int = 16) -> Layout:
    """The simulated layout of a bench layout, with the KV pools its workers reported."""
    from distserve.planner.layouts import limits_from_config
    from distserve.server.config import load_config

    split, tokens = ONE_GPU_LAYOUTS[name]
    cfg = load_config(None, {"prefill": {"max_seq_len": 4096, "max_num_batched_tokens": tokens}})
    pf, dec, col = limits_from_config(cfg, 0)
    if split is None:
        return Layout("colocated", 0, 1, pf, dataclasses.replace(col, kv_tokens=blocks["colocated"] * block_size))
    return Layout(
        "disaggregated",
        1,
        1,
        dataclasses.replace(pf, kv_tokens=blocks["prefill"] * block_size),
        dataclasses.replace(dec, kv_tokens=blocks["decode"] * block_size),
        sm_split=split,
    )


def one_gpu(prof: Profile, baselines: Path, seeds: int = 3) -> list[dict]:
    """Per (layout, workload): each recorded point's attainment and decode step against the simulated ones (the
    same number of requests at the same rate, ``seeds`` arrival seeds), the measured goodput (the highest rate
    measured at >= 90 % in any run), the predicted one on the same rates, and the continuous prediction
    (``Planner.goodput``: Poisson, >= 30 s of arrivals)."""
    from distserve.planner.slo import attainment
    from distserve.planner.workload import load_workload

    slo = SLO.parse(ONE_GPU_SLO)
    rows = []
    for (name, wl_name), points in sorted(one_gpu_points(baselines).items(), key=lambda kv: (kv[0][1], kv[0][0])):
        wl = load_workload(ONE_GPU_WORKLOADS[wl_name], n=50)
        layout = one_gpu_layout(name, points[-1]["kv_blocks"])
        planner = Planner.for_profile(prof, wl, slo)
        role = "colocated" if layout.mode == "colocated" else "decode"
        table = []
        for p in sorted(points, key=lambda p: (p["rate"], p["file"])):
            atts, steps = [], []
            for seed in range(seeds):
                res = dataclasses.replace(planner, seed=seed).run(layout, p["rate"], p["num_prompts"])
                atts.append(attainment(slo, res.latencies))
                steps.append(res.step_ms.get(role, 0.0))
            table.append(
                {
                    "rate": p["rate"],
                    "file": p["file"],
                    "requests": p["num_prompts"],
                    "measured": round(p["slo_attainment"], 3),
                    "predicted": round(statistics.mean(atts), 3),
                    "measured_decode_step_ms": p.get("decode_step_ms"),
                    "predicted_decode_step_ms": round(statistics.mean(steps), 2),
                    "before_gate_fix": p["file"] in BEFORE_GATE_FIX,
                }
            )
        rates = sorted({r["rate"] for r in table})
        pred_at = {r: statistics.mean(x["predicted"] for x in table if x["rate"] == r) for r in rates}
        rows.append(
            {
                "layout": name,
                "sm_split": layout.sm_split,
                "workload": wl_name,
                "slo": ONE_GPU_SLO,
                "points": table,
                "measured_goodput": max((x["rate"] for x in table if x["measured"] >= 0.9), default=0.0),
                "predicted_goodput_grid": max((r for r in rates if pred_at[r] >= 0.9), default=0.0),
                "predicted_goodput_continuous": round(planner.goodput(layout), 1),
            }
        )
    return rows
