"""The study that builds the shipped H200 profile (``planner/profiles/h200-llama2-7b.json``; Llama-2-7B shape,
bf16) from recorded benchmark runs, so plans for it can be made without a GPU:

    python -m bench run planner-h200-profile      # = python -m bench.planner.h200_profile [--out PATH] [--check]

It reads the kept raw records under ``bench/records/`` (``INPUTS``: each the xz-compressed record of a run of
the study named in its path; ``bench/baselines/<hardware>/<study>.json`` names each one's original file, whose
history git keeps). Which point comes from where (the original file names, as the records' sources):

measured
- prefill 1 x 2048: 48.3 ms, the engine step alone (``gpu_issue16/kv_sizing.json``: ``step_ms_median``);
- prefill 2 x 2048: twice the prefill worker's in-step time per prompt at two prompts per step
  (``gpu_issue16/prefill_after_out16.json``: ``per_prefill_ms.in_step`` 47.8 ms);
- decode steps *on the serving path*: every decode worker of the recorded SLO-study runs
  (``gpu_issue16/slo_study_1p1d*.json.gz``, ``gpu_issue19/slo_study_x4_*p*d.json.gz``), per point: mean step
  (step seconds / steps of the worker's ``/metrics``) plus the host work between steps (wall - step - idle
  between two points of one server; a server's first point takes the median of the others, marked derived),
  mean batch (generated tokens / steps) and the context those tokens attended to (from the requests'
  lengths), ``bench.planner.serving_records``. They fit 9.3 ms + 0.14 us per token of context per step cycle; in
  the step alone 8.4 ms, where ``engine.step()`` timed alone takes 4.84 ms at batch 1
  (``gpu_engine_2026-11-29_run2.json``): host work of a loaded worker that the engine bench lacks. The
  per-context slope agrees with the engine's (0.12 us);
- the disaggregated hand-off: the first inter-token gap of every disaggregated request of those runs grows
  with the decode worker's step (about 33 ms + 6.8 steps: the decode worker's handlers for the hand-off
  resume only between its engine steps), hence ``handoff_ms`` and ``handoff_steps``;
- KV pull of 1 GiB (one 2048-token prompt) GPU 0 -> GPU 1 over cuda_ipc: 3.89 ms median, connection reused
  (``kv_transfer_gpu_x2_2026-11-29_run2.json``: ``cuda_ipc_pool.pull_s_median``).
- prefill steps of 128 and 512 tokens x 1-5 prompts, 1 024 and 2 048 tokens: the engine alone on a GPU of its
  own (``gpu_issue17_prefill/engine_alone/prefill_probe_engine.json``, ``bench/engine/gpu_prefill_mix.py --set
  probe``), every shape of more than 384 tokens (smaller steps are the engine's own host floor, 8-9 ms);
derived
- KV pull of 64 MiB (128 tokens): the 1 GiB pull's control phases (connect, PULL -> reply, ACK -> DONE) plus
  the copy scaled by bytes.
prefill host costs (``prefill_host_costs``; each one's source is in the profile's ``cost_origins``)
- floor and per further sequence: the loaded 1P1D prefill worker of today's code, its 128-token points
  (measured, serving records); between steps, per prompt: the same records; chunked continuation: the
  math-SDPA call time from the engine-only ShareGPT-lengths run's profiler table x 32 layers (derived).
Everything beyond these (more than two prompts per step, decode batches above ~35) is an extrapolation
made by ``planner.latency``. ``overhead_ttft_ms`` (6 ms) is the lowest-rate TTFT P50 of the two-GPU long study
minus the prefill step. The prefill points are the engine's: the prefill workers of the same runs measured
47.1-47.8 ms per 2 048-token prompt in their steps, the engine 48.3 ms.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import math
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

from bench.lib.results import read_result
from bench.planner.serving_records import decode_worker_points, fit_handoff, fit_prefill_host, prefill_worker_points
from distserve.planner.latency import _fit_nonneg
from distserve.planner.profile import DecodePoint, PrefillPoint, Profile, SharePoint, TransferPoint

KV_BYTES_PER_TOKEN = 32 * 2 * 32 * 128 * 2  # layers x (K, V) x heads x head dim x bf16 = 512 KiB


REPO = Path(__file__).resolve().parents[2]
RECORDS = REPO / "bench" / "records"
SHIPPED = REPO / "planner" / "profiles" / "h200-llama2-7b.json"
ENGINE = "h200/engine-gpu/2026-11-29-run2.json.xz"
KV_SIZING = "h200-x2/engine-kv-sizing/2026-11-30.json.xz"
PREFILL_WORKER = "h200-x2/serving-prefill-profile/after_out16_2026-11-30.json.xz"
KV_PULL = "h200-x2/kv-transfer-gpu/x2_2026-11-29-run2.json.xz"


def _read(path: Path) -> dict:
    return read_result(path)


# A new request reaches a busy colocated worker's scheduler after this many step ends: read off the colocated
# replicas' TTFT P50 of the recorded SLO-study runs (1..4 replayed by bench/planner/plan_accuracy.py; 3 is within 15 %
# at each of the four points without a stall: docs/performance/planner.md).
ADMIT_STEPS = 3
SERVING_RUNS = ("h200-x2/serving-slo-study/1p1d_*2026-11-30.json.xz", "h200-x4/serving-slo-study/x4_*p*d_*.json.xz")


def serving_decode_points(results: Path) -> tuple[tuple[DecodePoint, ...], float, float]:
    """(decode points of the loaded decode workers, hand-off intercept ms, slope in steps) from the records."""
    pts = [p for pattern in SERVING_RUNS for f in sorted(results.glob(pattern)) for p in decode_worker_points(f)]
    if not pts:
        raise FileNotFoundError(f"no recorded SLO-study runs under {results} ({', '.join(SERVING_RUNS)})")
    known = [p.host_ms_per_step for p in pts if math.isfinite(p.host_ms_per_step)]
    host_median = statistics.median(known) if known else 0.0
    out = []
    for p in pts:
        batch = max(1, round(p.mean_batch))
        host = p.host_ms_per_step if math.isfinite(p.host_ms_per_step) else host_median
        out.append(
            DecodePoint(
                batch,
                max(1, round(p.context_total / p.steps / batch)),
                p.mean_step_ms + host,
                "measured" if math.isfinite(p.host_ms_per_step) else "derived",
                f"serving path, {p.source}: mean step + host work between steps ({host:.2f} ms"
                + ("" if math.isfinite(p.host_ms_per_step) else ", the median of the other points: first point")
                + f") of the worker's /metrics, mean batch {p.mean_batch:.1f}",
            )
        )
    intercept, slope = fit_handoff(pts)
    return tuple(out), intercept, slope


LENGTHS = "h200/engine-prefill-lengths/before_varlen_2026-11-30.txt"
LENGTHS_K = 4  # prompts per step in the engine-only lengths run's second case
LAYERS = 32


# the 1P1D prefill worker of today's code (engine thread, varlen prefill attention) under prefill-bound load:
# 128-token and ShareGPT prompts with 2 output tokens, both workers on one H200, two servers
# (study serving-slo-study, docs/performance/planner.md)
ENGINE_PROBE = "h200/engine-prefill-mix/probe_engine_2026-12-01.json.xz"
SERVING_PREFILL = (
    "h200/serving-slo-study/prefill_r1_2026-12-01.json.xz",
    "h200/serving-slo-study/prefill_r2_2026-12-01.json.xz",
)


def prefill_host_costs(
    results: Path, gpu_ms: Callable[[float, float], float]
) -> tuple[float, float, float, float, dict[str, str]]:
    """(floor ms, per further sequence ms, chunked continuation ms, host ms between steps per prompt, their
    origins).

    - floor and per further sequence: the loaded 1P1D prefill worker of today's code (``SERVING_PREFILL``),
      fitted over its uniform-length (128-token) host-bound points (``serving_records.fit_prefill_host``;
      ``gpu_ms(prompts, tokens)`` is the step's GPU work). Varied-length points are left out of the fit (their
      mean step mixes host- and GPU-bound steps) and checked by the replays instead. Its decode worker shared
      the GPU (one decode step per request). The engine alone, before the varlen attention (``LENGTHS``:
      ShareGPT lengths, 1 and 4 prompts per step), is noted beside it;
    - chunked continuation: its math-SDPA call per layer (torch.profiler, ``LENGTHS``) x layers;
    - between steps: the same worker's wall time outside steps and idle, per prompt, median over its points
      (KV staging, replies, the next requests' HTTP handlers on the event loop)."""
    text = (results / LENGTHS).read_text()
    medians: dict[int, float] = {}
    for line in text.splitlines():
        k, _, rest = line.partition(" ")
        if k.isdigit():
            medians[int(k)] = ast.literal_eval(rest)["pass2"]["median_ms"]
    m = re.search(r"(\d+) us each: the chunked-prefill continuation", text.replace("\n# ", " "))
    if m is None or 1 not in medians or LENGTHS_K not in medians:
        raise ValueError(f"{LENGTHS}: expected the k=1 and k={LENGTHS_K} medians and the math-SDPA call time")
    engine_per_seq = (medians[LENGTHS_K] - medians[1]) / (LENGTHS_K - 1)
    chunk = int(m.group(1)) * LAYERS / 1000
    pts = [p for name in SERVING_PREFILL for p in prefill_worker_points(results / name, uniform_only=True)]
    try:
        floor, per_seq, used = fit_prefill_host(pts, gpu_ms)
    except ValueError as e:
        raise ValueError(f"{', '.join(SERVING_PREFILL)}: {e}") from None
    posts = [
        p.host_ms_per_prompt
        for name in SERVING_PREFILL
        for p in prefill_worker_points(results / name)
        if math.isfinite(p.host_ms_per_prompt)
    ]
    if not posts:
        raise ValueError(f"{', '.join(SERVING_PREFILL)}: no point with the wall time between two points")
    post = statistics.median(posts)
    src = f"bench/records/{LENGTHS}"
    serving = ", ".join(f"bench/records/{n}" for n in SERVING_PREFILL)
    fitted = (
        f"measured: {serving}, the prefill worker's /metrics, least squares with an intercept over its "
        f"{len(used)} host-bound uniform-length points (" + ", ".join(p.source.split(" ")[1] for p in used) + ")"
    )
    return (
        floor,
        per_seq,
        chunk,
        post,
        {
            "prefill_floor_ms": f"{fitted}; the engine alone before varlen, {src}: {medians[1]:.1f} ms",
            "prefill_per_seq_ms": f"{fitted}; the engine alone before varlen, {src}: {engine_per_seq:.1f} ms",
            "prefill_chunk_ms": f"derived: {src}, torch.profiler math-SDPA call {m.group(1)} us x {LAYERS} layers",
            "prefill_post_ms": f"measured: {serving}, the prefill worker's wall - in steps - idle per prompt, "
            f"median of {len(posts)} points ({min(posts):.2f}-{max(posts):.2f} ms)",
        },
    )


def build_h200_profile(results: Path = RECORDS) -> Profile:
    """The H200 profile from the kept records under ``results`` (default ``bench/records``)."""
    eng = _read(results / ENGINE)["engine_7b"]
    sizing = _read(results / KV_SIZING)
    worker = _read(results / PREFILL_WORKER)
    kvx = _read(results / KV_PULL)

    d1 = eng["decode_b1"]["graphs"]["step_ms_median"]
    d64 = eng["decode_b64_ctx1024"]["graphs"]
    d64_ms, d64_ctx = d64["step_ms_median"], d64["mean_context"]
    p2048 = sizing["step_ms_median"]
    in_step = worker["per_prefill_ms"]["in_step"]
    pool = kvx["cuda_ipc_pool"]
    phases = pool["phases_s_median"]
    control_ms = (phases["connect_s"] + phases["pull_to_header_s"] + phases["ack_to_done_s"]) * 1000
    copy_ms_per_byte = phases["copy_s"] * 1000 / kvx["nbytes"]
    small = 128 * KV_BYTES_PER_TOKEN
    src = "from bench/records: "
    decode, handoff_icpt, handoff_slope = serving_decode_points(results)
    # the engine alone on a GPU of its own, one step per shape (median of 7): 128 and 512 tokens x 1-5 prompts,
    # 1 024 and 2 048 (bench/engine/gpu_prefill_mix.py --set probe); the steps of up to three 128-token prompts are
    # the engine's own host floor (8-9 ms) and stay out of the GPU fit
    probe = _read(results / ENGINE_PROBE)["shapes"]
    engine_points = [
        (len(v["lengths"]), v["lengths"][0], v["repeat_median_ms"][0])
        for v in probe.values()
        if len(set(v["lengths"])) == 1 and len(v["repeat_median_ms"]) == 1 and len(v["lengths"]) * v["lengths"][0] > 384
    ]
    gpu_points = [(1, 2048, p2048), (2, 2048, 2 * in_step)] + engine_points
    g = _fit_nonneg([[1.0, b * t, b * t * t] for b, t, _ in gpu_points], [ms for _, _, ms in gpu_points])
    floor, per_seq, chunk, post, origins = prefill_host_costs(results, lambda k, t: g[0] + g[1] * t + g[2] * t * t / k)
    pull_2048 = pool["pull_s_median"] * 1000
    return Profile(
        device="cuda",
        device_name="NVIDIA H200 (from recorded runs)",
        model="preset:llama-2-7b",
        kv_bytes_per_token=KV_BYTES_PER_TOKEN,
        devices_available=4,
        transport="cuda_ipc",
        prefill=(
            PrefillPoint(1, 2048, p2048, "measured", src + f"{KV_SIZING} step_ms_median"),
            PrefillPoint(2, 2048, 2 * in_step, "measured", src + f"{PREFILL_WORKER} in_step x 2"),
            *(
                PrefillPoint(b, t, ms, "measured", src + f"{ENGINE_PROBE} {b}x{t}, engine alone, median of 7")
                for b, t, ms in engine_points
            ),
        ),
        decode=decode,
        kv_transfer=(
            TransferPoint(
                kvx["nbytes"],
                pool["pull_s_median"] * 1000,
                "measured",
                src + f"{KV_PULL} cuda_ipc_pool, GPU 0 -> GPU 1",
            ),
            TransferPoint(small, control_ms + copy_ms_per_byte * small, "derived", "control phases + scaled copy"),
        ),
        overhead_ttft_ms=6.0,
        handoff_ms=round(max(0.0, handoff_icpt - pull_2048), 1),
        handoff_steps=max(0, round(handoff_slope - 0.5)),
        admit_steps=ADMIT_STEPS,
        prefill_floor_ms=round(floor, 2),
        prefill_per_seq_ms=round(per_seq, 2),
        prefill_chunk_ms=round(chunk, 2),
        prefill_post_ms=round(post, 2),
        engine_thread=True,
        cost_origins=origins,
        notes=(
            f"engine.step() alone (not used for decode): batch 1 x 128 {d1:.2f} ms, 64 x {d64_ctx:.0f} {d64_ms:.2f} ms",
            f"hand-off: first inter-token gap = {handoff_icpt:.1f} ms + {handoff_slope:.2f} decode steps (fit over "
            f"{len(decode)} decode-worker points); simulated as handoff_ms + pull + handoff_steps busy steps + 1",
            "built by `python -m bench run planner-h200-profile` (bench/planner/h200_profile.py: each point's source)",
            "one GPU per worker; decode with CUDA graphs; prefill default max_num_batched_tokens 4096",
        ),
    )


BASELINES = REPO / "bench" / "baselines" / "h200"
# SM shares (issue 31): the share curve of `planner/sm_shares.py` (100 and 40 %), the MPS probe of every split
# worker (bf16 GEMM TFLOP/s on its share), the start-up GEMM check per share, and the serving runs' decode steps
SHARES_RUN = "serving-sm-shares.json"
GEMM_CHECK = "serving-mps-gemm-check.json"
SPLIT_RUNS = (
    "serving-one-gpu-knees-128-64.json",
    "serving-one-gpu-knees-2048-128.json",
    "serving-one-gpu-overlap-2048-128-and-128-64.json",
    "serving-one-gpu-overlap-gate-fixed.json",
    "serving-one-gpu-overlap-gates-fixed-edge.json",
    "serving-one-gpu-overlap-gates-fixed-split-high.json",
)
OVERLAP_MEMCHECK = "serving-one-gpu-overlap-memcheck.json"
UNSPLIT_RUN = "serving-sm-split-2026-12-02.json"  # 1P1D with no split, and the 60:40 split's probes


def _mps_tflops(baselines: Path) -> dict[int, float]:
    """Mean bf16 GEMM TFLOP/s per SM share over every split worker's start-up MPS probe."""
    got: dict[int, list[float]] = {}
    for name in (*SPLIT_RUNS, UNSPLIT_RUN):
        for lay in _read_plain(baselines / name)["layouts"]:
            for w in lay.get("workers", []):
                mps = w.get("mps") or (w.get("memory") or {}).get("mps") or {}
                if mps.get("gemm_bf16_tflops"):
                    got.setdefault(int(mps["thread_percentage"]), []).append(float(mps["gemm_bf16_tflops"]))
    return {k: statistics.mean(v) for k, v in got.items()}


def _read_plain(path: Path) -> dict:
    return json.loads(path.read_text())


def _decode_step(baselines: Path, name: str, layout: str, workload: str, sampling: str, rate: float) -> float:
    for lay in _read_plain(baselines / name)["layouts"]:
        if lay["layout"] == layout:
            for p in lay.get("points", []):
                if (p["workload"], p.get("sampling"), p["rate"]) == (workload, sampling, rate):
                    return float(p["decode_step_ms"])
    raise KeyError(f"{name}: no {layout} {workload} {sampling} {rate} point")


def share_points(baselines: Path = BASELINES) -> tuple[tuple[SharePoint, ...], tuple[int, ...], tuple[str, ...]]:
    """(points, shares with wrong bf16 GEMMs, notes): the H200 SM-share curve from the recorded one-GPU runs, for
    ``distserve plan --devices 1`` (not in the shipped profile: ``h200_profile_with_shares``).

    - 100 %: measured (``serving-sm-shares.json``: 1 x 512 and 1 x 2048 prefill, 16 x 512 and 64 x 1024 decode);
    - prefill at 50 and 60 %: derived. The share curve measured the prefill at 40 % at 1.89x its 100 % time, where
      the MPS probe's bf16 GEMM ran at T(100) / T(40) = 2.28x; the step is taken to follow the GEMM throughput with
      that same fraction: scale(s) = 1 + k (T(100) / T(s) - 1), k = 0.89 / 1.28 (T: the mean probe of the split
      workers at s). 40 % itself is not kept (its GEMMs are wrong: its timing is of a wrong computation);
    - decode at 50 %: derived, the 50:50 split's decode worker against the unsplit 1P1D's at the same load
      (128/64, 60 req/s, OpenAI-default sampling: 8.97 against 8.04 ms per step, one run each): a lower bound,
      as the unsplit decode worker shared its SMs with the prefill worker;
    - wrong: every share the start-up check found wrong (``serving-mps-gemm-check.json``: 40, 45) and 80, which
      the launcher refused in the overlap run (``serving-one-gpu-overlap-memcheck.json``, split80:80:50)."""
    run = _read_plain(baselines / SHARES_RUN)
    base = [p for p in run["points"] if p["share"] == 100]
    at40 = {(p["phase"], p["batch"], p["size"]): p["ms"] for p in run["points"] if p["share"] == 40}
    tf = _mps_tflops(baselines)
    t40 = tf[40]  # the 60:40 split's decode worker (its GEMMs wrong, its throughput still the share's)
    pf40 = statistics.mean(at40[("prefill", p["batch"], p["size"])] / p["ms"] for p in base if p["phase"] == "prefill")
    k = (pf40 - 1) / (tf[100] / t40 - 1)
    points = [SharePoint(p["phase"], 100, p["batch"], p["size"], p["ms"], "measured") for p in base]
    for share in (50, 60):
        scale = 1 + k * (tf[100] / tf[share] - 1)
        points += [
            SharePoint("prefill", share, p["batch"], p["size"], round(p["ms"] * scale, 4), "derived")
            for p in base
            if p["phase"] == "prefill"
        ]
    split = _decode_step(
        baselines, "serving-one-gpu-knees-128-64.json", "split50:50:50+ref", "128/64", "openai-default", 60.0
    )
    whole = _decode_step(baselines, UNSPLIT_RUN, "1p1d", "128/64", "openai-default", 60.0)
    points += [
        SharePoint("decode", 50, p["batch"], p["size"], round(p["ms"] * split / whole, 4), "derived")
        for p in base
        if p["phase"] == "decode"
    ]
    check = _read_plain(baselines / GEMM_CHECK)["shares"]
    wrong = {int(s) for s, v in check.items() if v.get("repeats_wrong")}
    for lay in _read_plain(baselines / OVERLAP_MEMCHECK)["layouts"]:
        m = re.search(r"share of the GPU \((\d+) % of the SMs\) gave \d+ wrong values", lay.get("error", ""))
        if m:
            wrong.add(int(m.group(1)))
    probe = ", ".join(f"{s} %: {t:.0f}" for s, t in sorted(tf.items()))
    notes = (
        f"sm_shares: 100 % measured ({SHARES_RUN}); prefill at 50 and 60 % derived from the 40 % step ({pf40:.2f}x, "
        f"{SHARES_RUN}) and the split workers' MPS GEMM probe (TFLOP/s {probe}): k = {k:.2f}",
        f"sm_shares: decode at 50 % derived: the 50:50 split's decode step {split:.2f} ms against the unsplit 1P1D's "
        f"{whole:.2f} ms (128/64, 60 req/s, OpenAI-default; serving-one-gpu-knees-128-64.json, {UNSPLIT_RUN})",
        f"sm_shares_wrong {sorted(wrong)}: the start-up GEMM check ({GEMM_CHECK}; {OVERLAP_MEMCHECK}: 80 %)",
    )
    return tuple(points), tuple(sorted(wrong)), notes


def h200_profile_with_shares(baselines: Path = BASELINES) -> Profile:
    """The shipped H200 profile plus ``share_points``: what ``distserve plan --devices 1`` needs for the split
    search (the shipped file has no share points)."""
    from distserve.planner.profile import load

    points, wrong, notes = share_points(baselines)
    prof = load(SHIPPED)
    return dataclasses.replace(prof, sm_shares=points, sm_shares_wrong=wrong, notes=(*prof.notes, *notes))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.planner.h200_profile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", default=str(RECORDS), help="the kept records folder (default bench/records)")
    ap.add_argument("--out", default=str(SHIPPED), help="where to write the profile (default: the shipped file)")
    ap.add_argument("--check", action="store_true", help="build and compare with the shipped file; write nothing")
    a = ap.parse_args(argv)
    prof = build_h200_profile(Path(a.records))
    if a.check:
        same = json.loads(SHIPPED.read_text()) == json.loads(json.dumps(prof.to_dict()))
        print(f"{SHIPPED.relative_to(REPO)}: {'up to date' if same else 'differs from a fresh build'}")
        return 0 if same else 1
    prof.save(a.out)
    print(f"profile written: {a.out} ({len(prof.prefill)} prefill, {len(prof.decode)} decode points)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
