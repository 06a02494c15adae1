"""Replaying a recorded serving run through the simulator: the same requests (lengths and send times), the
same layout and scheduler limits, so predicted and measured attainment are compared on one arrival sample.

Used by ``bench/planner/plan_accuracy.py`` (predicted vs measured) and ``replay_check.py``; never by ``distserve
plan`` itself. Records: ``bench/serving/gpu_slo_study.py`` results (``bench.planner.serving_records``).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from bench.planner.serving_records import point_requests, run_kv_tokens, run_layout, stall_events
from distserve.planner.latency import LatencyModel
from distserve.planner.layouts import Layout, limits_from_config
from distserve.planner.profile import Profile
from distserve.server.config import load_config


def run_config(doc: dict) -> dict:
    """The config keys of a recorded run that the simulator reads (as ``bench/serving/gpu_slo_study.py`` set them)."""
    a = doc["args"]
    return {
        "prefill": {"max_seq_len": a["max_seq_len"]},
        "decode": {"max_batch_size": a["max_batch"], "max_concurrent_requests": a["max_batch"]},
    }


def layout_of_run(doc: dict) -> Layout:
    """The recorded run's layout with its limits: decode batch, prefill token budget (the default 4096), and
    the KV capacity each worker reported (blocks free before the first point)."""
    pf, dec, col = limits_from_config(load_config(None, run_config(doc)), run_kv_tokens(doc))
    mode, p, d = run_layout(doc)
    return Layout(mode, p, d, pf, col if mode == "colocated" else dec)


def run_engine_thread(doc: dict) -> bool:
    """Whether the recorded run's workers stepped the engine on their own thread (``engine_thread``: auto = on
    for CUDA, docs/performance/serving-two-gpus.md); runs recorded before the option stepped on the event loop."""
    v = doc["args"].get("engine_thread")
    return v in ("on", True) or (v == "auto" and str(doc["args"].get("device", "")).startswith("cuda"))


def cold_start(doc: dict, point: dict) -> tuple[int, float]:
    """(stalls per colocated worker, median stall ms) seen by a point's requests; (0, 0) when none."""
    mode, _, workers = run_layout(doc)
    ev = stall_events(point)
    if mode != "colocated" or not ev:
        return 0, 0.0
    return round(len(ev) / workers), statistics.median(ms for _, ms in ev)


def replay(
    prof: Profile,
    doc: dict,
    point: dict,
    cold: bool = False,
    model: LatencyModel | None = None,
) -> list[dict[str, float]]:
    """Simulated per-request latencies (ms) of a recorded point, its first ``ramp`` requests dropped as the
    report drops them. ``cold``: colocated workers pay the stalls the point measured (``cold_start``)."""
    from distserve.planner.simulator import Simulator

    sim = Simulator(
        model or LatencyModel.fit(prof),
        layout_of_run(doc),
        prof.kv_bytes_per_token,
        prof.overhead_ttft_ms,
        handoff_ms=prof.handoff_ms,
        handoff_steps=prof.handoff_steps,
        admit_steps=prof.admit_steps,
        cold_mixed_steps=cold_start(doc, point) if cold else (0, 0.0),
        reply_after_next_step=not run_engine_thread(doc),
        prefill_post_ms=prof.prefill_post_ms,
    )
    return list(sim.run(point_requests(point)).latencies[point.get("ramp", 0) :])


def replay_result(prof: Profile, doc: dict, point: dict, model: LatencyModel | None = None):
    """The whole simulated result of a recorded point (per-role statistics too), steady state."""
    from distserve.planner.simulator import Simulator

    sim = Simulator(
        model or LatencyModel.fit(prof),
        layout_of_run(doc),
        prof.kv_bytes_per_token,
        prof.overhead_ttft_ms,
        handoff_ms=prof.handoff_ms,
        handoff_steps=prof.handoff_steps,
        admit_steps=prof.admit_steps,
        reply_after_next_step=not run_engine_thread(doc),
        prefill_post_ms=prof.prefill_post_ms,
    )
    return sim.run(point_requests(point))


def attained(samples: list[dict[str, float]], meets: Callable[[float, float], bool]) -> float:
    """Share of samples for which ``meets(ttft_ms, tpot_ms)`` (a one-token request has TPOT 0)."""
    return sum(meets(s["ttft"], s.get("tpot", 0.0)) for s in samples) / max(1, len(samples))
