"""What the recorded serving runs say about the serving path's own step times (``bench/serving/gpu_slo_study.py``
records: per-request TTFT/ITLs and, per point, every worker's cumulative ``/metrics``).

The engine benchmarks time ``engine.step()`` alone; a worker under load does more per step (and the planner
must predict the worker). From one run's records this module reads, per point and worker:
- decode workers: steps, step seconds and generated tokens (deltas of the cumulative counters between
  consecutive points of one server), and the total context those tokens attended to (from the requests'
  prompt and output lengths: a request decodes ``output - 1`` tokens over contexts ``prompt + 1 ..``);
- disaggregated requests: the first inter-token gap (prefill reply -> first token of the decode worker), the
  hand-off the simulator models as ``handoff_ms`` plus ``handoff_steps`` decode-worker steps.
Every per-point figure is a difference of the workers' cumulative counters (``worker_deltas``): a server's first
point after a pre-warm (``--prewarm``) counts only when the run recorded the counters after the pre-warm.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.lib.results import read_result

STEPS, STEP_S, IDLE = "distserve_engine_steps", "distserve_engine_step_seconds", "distserve_engine_idle_seconds"
QUERIED = "distserve_prefix_cache_queried_tokens"
HITS = "distserve_prefix_cache_hit_tokens"


@dataclass(frozen=True)
class DecodeWorkerPoint:
    source: str  # file name, workload, rate, worker
    steps: float
    step_ms_total: float
    tokens: float  # decode tokens generated (sum of batch sizes over steps)
    context_total: float  # sum over steps of the batch's total context (tokens)
    first_itl_ms_median: float  # the point's disaggregated hand-off gap, median over requests
    host_ms_total: float  # wall - in steps - idle between this point's counters and the previous (nan: unknown)

    @property
    def mean_step_ms(self) -> float:
        return self.step_ms_total / self.steps

    @property
    def host_ms_per_step(self) -> float:
        """Host work between steps (streaming the tokens out, KV commits), per step; nan when unknown."""
        return self.host_ms_total / self.steps

    @property
    def mean_batch(self) -> float:
        return self.tokens / self.steps

    @property
    def mean_context_per_seq(self) -> float:
        return self.context_total / self.tokens


def read_run(path: Path) -> dict:
    """A recorded run (``.json.gz`` as the study writes it, ``.json.xz`` as bench/records keeps it)."""
    doc: dict = read_result(path)
    return doc


def worker_deltas(doc: dict, roles: tuple[str, ...]) -> Iterator[tuple[dict, dict[str, dict], float]]:
    """Per point whose counters have a baseline: (point, {worker: {metric: delta}} for the workers whose id starts
    with one of ``roles``, wall ms since the previous point's end: nan for a server's first point). The baseline
    is the previous point's counters, the counters recorded after the pre-warm (``prewarm_server_metrics``), or
    zero for a run without a pre-warm; a server's first point after an unrecorded pre-warm is skipped."""
    recorded = doc.get("prewarm_server_metrics")
    prev: dict | None
    if recorded:
        prev = {w: m for w, m in recorded.items() if w.startswith(roles)}
    else:
        prev = None if doc["args"].get("prewarm") else {}
    prev_end = math.nan
    for p in doc["points"]:
        res = p["result"]
        cur = {w: m for w, m in res.get("server_metrics", {}).items() if w.startswith(roles)}
        if cur and prev is not None:
            deltas = {w: {k: v - prev.get(w, {}).get(k, 0.0) for k, v in m.items()} for w, m in sorted(cur.items())}
            yield p, deltas, (res["end_unix"] - prev_end) * 1000
        prev, prev_end = cur, res["end_unix"]


def prefix_hit_shares(doc: dict) -> dict[tuple[str, float], float]:
    """Per point (workload, rate): the share of its prompt tokens that the prefill-side workers (prefill or
    colocated) found in the prefix cache, from their ``/metrics`` deltas (points with a baseline only)."""
    out: dict[tuple[str, float], float] = {}
    for p, deltas, _ in worker_deltas(doc, ("prefill", "colocated")):
        queried = sum(d.get(QUERIED, 0.0) for d in deltas.values())
        if queried > 0:
            out[(p["workload"], p["rate"])] = sum(d.get(HITS, 0.0) for d in deltas.values()) / queried
    return out


def decode_worker_points(path: Path) -> list[DecodeWorkerPoint]:
    """Per point and decode worker of one recorded run (empty for colocated layouts)."""
    out: list[DecodeWorkerPoint] = []
    for p, deltas, wall_ms in worker_deltas(read_run(path), ("decode",)):
        reqs = p["result"]["requests"]
        tokens = sum(r["output_tokens"] - 1 for r in reqs)
        ctx = sum((r["output_tokens"] - 1) * (r["prompt_tokens"] + r["output_tokens"] / 2) for r in reqs)
        measured = [r for r in reqs if not r.get("warmup") and r.get("itl")]
        first = statistics.median(r["itl"][0] * 1000 for r in measured)
        for w, d in deltas.items():
            step_ms, idle_ms = d[STEP_S] * 1000, d[IDLE] * 1000
            out.append(
                DecodeWorkerPoint(
                    f"{path.name} {p['workload']}@{p['rate']:g} {w}",
                    d[STEPS],
                    step_ms,
                    tokens / len(deltas),
                    ctx / len(deltas),
                    first,
                    wall_ms - step_ms - idle_ms,
                )
            )
    return out


def fit_handoff(points: list[DecodeWorkerPoint]) -> tuple[float, float]:
    """(intercept ms, slope in decode steps) of the first inter-token gap against the decode worker's mean
    step, least squares over the points: the hand-off's handlers resume only between engine steps."""
    x = np.array([p.mean_step_ms for p in points])
    y = np.array([p.first_itl_ms_median for p in points])
    slope, intercept = np.polyfit(x, y, 1)
    return float(intercept), float(slope)


def run_layout(doc: dict) -> tuple[str, int, int]:
    """(mode, prefill workers, decode workers or replicas) of a recorded run's ``layout`` (1p1d, colocated2)."""
    name = doc["layout"]
    if name.startswith("colocated"):
        return "colocated", 0, int(name[len("colocated") :])
    p, d = name.rstrip("d").split("p")
    return "disaggregated", int(p), int(d)


def run_kv_tokens(doc: dict, block_size: int = 16) -> int:
    """KV capacity per worker, tokens: the blocks each worker reported free before the first point."""
    return min(w["kv_blocks_free"] for w in doc["workers"]) * block_size


def point_requests(point: dict) -> list[tuple[float, int, int]]:
    """(arrival ms, prompt, output) of a point's measured requests in send order (warm-up excluded; the
    first ``ramp`` are kept, they load the system, and are dropped when scoring)."""
    recs = sorted((r for r in point["result"]["requests"] if not r.get("warmup")), key=lambda r: r["index"])
    return [(r["scheduled"] * 1000.0, int(r["prompt_tokens"]), int(r["output_tokens"])) for r in recs]


@dataclass(frozen=True)
class PrefillWorkerPoint:
    source: str
    steps: float
    step_ms_total: float
    prompts: float  # prompts prefilled (each step's batch summed)
    tokens: float  # prompt tokens prefilled
    host_ms_total: float = math.nan  # wall - in steps - idle since the previous point (nan: unknown)

    @property
    def host_ms_per_prompt(self) -> float:
        """The worker's host work between steps (KV staging, replies, HTTP), per prompt; nan when unknown."""
        return self.host_ms_total / self.prompts

    @property
    def mean_step_ms(self) -> float:
        return self.step_ms_total / self.steps

    @property
    def prompts_per_step(self) -> float:
        return self.prompts / self.steps

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.steps


def fit_prefill_host(
    points: list[PrefillWorkerPoint], gpu_ms: Callable[[float, float], float]
) -> tuple[float, float, list[PrefillWorkerPoint]]:
    """(host floor ms, host ms per further sequence, the points used) of a prefill step: least squares of each
    host-bound point's mean step against prompts per step - 1, with an intercept (the floor: one prompt's step).
    A point is host-bound when its GPU work, ``gpu_ms(prompts per step, tokens per step)``, is below its
    measured step: the model takes a step as the larger of its host side and its GPU work, so the host side is
    what such a step measured (on GPU-bound points it runs hidden behind the GPU work). ValueError when fewer
    than 3 points are host-bound or they do not span one prompt per step."""
    used = [p for p in points if gpu_ms(p.prompts_per_step, p.tokens_per_step) < p.mean_step_ms]
    x = np.array([p.prompts_per_step - 1.0 for p in used])
    if len(used) < 3 or float(x.max() - x.min()) < 1.0:
        raise ValueError(
            f"{len(used)} host-bound prefill-worker points spanning {float(np.ptp(x)) if used else 0:.2f} prompts "
            "per step: need 3 or more, at least one prompt per step apart"
        )
    a = np.vstack([np.ones_like(x), x]).T
    floor, per_seq = np.linalg.lstsq(a, np.array([p.mean_step_ms for p in used]), rcond=None)[0]
    return float(floor), max(0.0, float(per_seq)), used


def prefill_worker_points(path: Path, uniform_only: bool = False) -> list[PrefillWorkerPoint]:
    """Per point and prefill worker of one recorded run: steps and step seconds (deltas of ``/metrics``), and
    the prompts they prefilled (the point's requests, split evenly over the prefill workers).
    ``uniform_only``: leave out workloads of varied prompt lengths. Their mean step mixes host-bound steps
    with GPU-bound ones (a long prompt's), so it says little about the host's per-sequence cost; and the
    study's first call built a cuDNN plan per new length (docs/performance/engine-gpu.md)."""
    out: list[PrefillWorkerPoint] = []
    for p, deltas, wall_ms in worker_deltas(read_run(path), ("prefill",)):
        reqs = p["result"]["requests"]
        if uniform_only and len({r["prompt_tokens"] for r in reqs}) > 1:
            continue
        mean_prompt = sum(r["prompt_tokens"] for r in reqs) / len(reqs)
        for w, d in deltas.items():
            tokens = d.get(QUERIED, 0.0)  # the prompt tokens this worker admitted
            step_ms = d[STEP_S] * 1000
            out.append(
                PrefillWorkerPoint(
                    f"{path.name} {p['workload']}@{p['rate']:g} {w}",
                    d[STEPS],
                    step_ms,
                    tokens / mean_prompt,
                    tokens,
                    wall_ms - step_ms - d[IDLE] * 1000,
                )
            )
    return out


def stall_events(point: dict, min_gap_ms: float = 250.0, same_ms: float = 30.0) -> list[tuple[float, float]]:
    """(start s, length ms) of the engine stalls a point's measured requests saw: inter-token gaps above
    ``min_gap_ms``; gaps that start within ``same_ms`` of each other are one stall (one worker's batch)."""
    gaps = []
    for r in point["result"]["requests"]:
        if r.get("warmup") or not r.get("itl"):
            continue
        t = r["start_unix"] + r["ttft"]
        for g in r["itl"]:
            if g * 1000 > min_gap_ms:
                gaps.append((t, g * 1000))
            t += g
    events: list[tuple[float, float]] = []
    for start, ms in sorted(gaps):
        if events and (start - events[-1][0]) * 1000 < same_ms:
            continue
        events.append((start, ms))
    t0 = point["result"]["start_unix"]
    return [(s - t0, ms) for s, ms in events]
