"""Step-time models fitted to a profile: what one engine step costs for a given batch.

An engine step does three kinds of work, and its time is modelled as their sum:
- a fixed part (reading the weights once, launching kernels, Python around the step);
- work linear in the tokens computed (the GEMMs of a prefill) and in the decode batch (per-sequence
  sampling and bookkeeping);
- attention: quadratic in each prompt's length for a prefill, linear in the total context for decode.
Coefficients are least-squares fits over the profile's points with every coefficient kept >= 0 (a term the
points cannot support is dropped), so the model interpolates between measured points and extrapolates
linearly beyond them. The prefill and the decode fixed parts are fitted separately (on a serving path the
decode step's fixed part can be the larger: host work per step that a long prefill hides); a colocated step
that mixes prefill chunks with decodes pays the larger of the two once, and both variable parts (checked
against the colocated replicas' measured step seconds in docs/performance/planner.md).

A prefill step also has costs no single-prompt point shows (docs/performance/planner.md). It runs eagerly,
so its host side (hundreds of kernel launches and the Python around them) is at least ``prefill_floor_ms`` and
grows by ``prefill_per_seq_ms`` per further sequence; the host runs ahead of the GPU, so the step takes the
larger of host and GPU work. Each chunked-prefill continuation (a prompt resumed over its cached context, which
runs a slower masked attention path) adds ``prefill_chunk_ms``:
step = max(floor + per_seq x (sequences - 1), fixed + GPU work) + chunk x continuations. These three apply to
steps without decodes (prefill workers, an idle colocated worker): a colocated mixed step's measured seconds
already equal its parts within 5 % (measured, same page), the prefill's host side hiding behind the decode work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from distserve.planner.profile import Profile
from distserve.server.latency_model import prefill_work_ms


def _fit_nonneg(rows: list[list[float]], y: list[float]) -> list[float]:
    """Least squares with coefficients >= 0: refit without any term that came out negative."""
    a, b = np.asarray(rows, dtype=float), np.asarray(y, dtype=float)
    active = list(range(a.shape[1]))
    while active:
        coef, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if (coef >= 0).all():
            out = [0.0] * a.shape[1]
            for i, c in zip(active, coef, strict=True):
                out[i] = float(c)
            return out
        active.pop(int(np.argmin(coef)))
    return [0.0] * a.shape[1]


def share_scales(points) -> dict[str, tuple[tuple[int, float], ...]]:
    """{phase: ((share, mean of ms(share) / ms(100) over the shapes measured at both), ...)}, 100 -> 1.0."""
    base = {(p.phase, p.batch, p.size): p.ms for p in points if p.share == 100}
    ratios: dict[tuple[str, int], list[float]] = {}
    for p in points:
        ref = base.get((p.phase, p.batch, p.size))
        if ref and p.share < 100:
            ratios.setdefault((p.phase, p.share), []).append(p.ms / ref)
    out: dict[str, list[tuple[int, float]]] = {}
    for (phase, share), rs in sorted(ratios.items()):
        out.setdefault(phase, []).append((share, max(1.0, sum(rs) / len(rs))))  # fewer SMs never speed a step up
    return {ph: tuple([*v, (100, 1.0)]) for ph, v in out.items()}


@dataclass(frozen=True)
class LatencyModel:
    fixed_ms: float  # a decode step's fixed part
    prefill_per_token_ms: float
    prefill_per_token2_ms: float  # per (prompt length)^2, summed over prompts
    prefill_fixed_ms: float  # a prefill step's fixed part (a mixed step pays max(fixed_ms, this) once)
    decode_per_seq_ms: float
    decode_per_ctx_ms: float  # per token of context, summed over the batch
    kv_fixed_ms: float
    kv_ms_per_byte: float
    thread_scale: dict[tuple[str, int, int], float]
    prefill_floor_ms: float = 0.0  # host side of a one-sequence prefill step (eager launches, Python)
    prefill_per_seq_ms: float = 0.0  # ... and per further sequence in the step
    prefill_chunk_ms: float = 0.0  # per chunked-prefill continuation (a prompt resumed over its cached context)
    # step-time multiplier on a share of the GPU's SMs, by phase: [(share, scale)] ascending (planner/sm_shares.py)
    sm_scale: dict[str, tuple[tuple[int, float], ...]] = field(default_factory=dict)

    @classmethod
    def fit(cls, profile: Profile) -> LatencyModel:
        d = _fit_nonneg([[1.0, p.batch, p.batch * p.context] for p in profile.decode], [p.ms for p in profile.decode])
        fixed = d[0]
        # prefill: its own fixed part + per token + per token^2
        rows = [[1.0, p.batch * p.tokens, p.batch * p.tokens**2] for p in profile.prefill]
        pf = _fit_nonneg(rows, [p.ms for p in profile.prefill])
        if len(profile.kv_transfer) >= 2:
            kv = _fit_nonneg([[1.0, p.bytes] for p in profile.kv_transfer], [p.ms for p in profile.kv_transfer])
        else:
            kv = [0.0, profile.kv_transfer[0].ms / profile.kv_transfer[0].bytes]
        scale = {(t.phase, t.threads, t.neighbours): t.scale for t in profile.threads}
        return cls(
            fixed,
            pf[1],
            pf[2],
            pf[0],
            d[1],
            d[2],
            kv[0],
            kv[1],
            scale,
            profile.prefill_floor_ms,
            profile.prefill_per_seq_ms,
            profile.prefill_chunk_ms,
            share_scales(profile.sm_shares),
        )

    # --- one step -----------------------------------------------------------------------------------
    def _parts(
        self, prefill_chunks: Sequence[tuple[int, int]], decode_batch: int, decode_context: int, sm_share: float
    ) -> tuple[str, float, float, float]:
        """(phase, GPU work, host side, continuations' attention) of one step, ms, before the thread scale."""
        if prefill_chunks:
            t = max(self.fixed_ms, self.prefill_fixed_ms) if decode_batch else self.prefill_fixed_ms
        else:
            t = self.fixed_ms
        # the one prefill formula (server/latency_model.py), also the router's TTFT prediction
        pf = prefill_work_ms(prefill_chunks, self.prefill_per_token_ms, self.prefill_per_token2_ms)
        dc = self.decode_per_seq_ms * decode_batch + self.decode_per_ctx_ms * decode_context
        phase = "prefill" if prefill_chunks and pf >= dc else "decode"
        sm = self.share_scale(phase, sm_share) if sm_share < 100 else 1.0
        if not prefill_chunks or decode_batch:
            return phase, (t + pf + dc) * sm, 0.0, 0.0
        # an eager prefill step's host side (launches, Python: a floor + per sequence) runs ahead of its GPU work,
        # so the step takes the larger of the two; a chunked continuation adds its slow attention path
        host = self.prefill_floor_ms + self.prefill_per_seq_ms * (len(prefill_chunks) - 1)
        chunk = self.prefill_chunk_ms * sm * sum(1 for _, before in prefill_chunks if before > 0)
        return phase, (t + pf) * sm, host, chunk

    def step_ms(
        self,
        prefill_chunks: Sequence[tuple[int, int]],
        decode_batch: int,
        decode_context: int,
        threads: int = 1,
        neighbours: int = 0,
        sm_share: float = 100,
    ) -> float:
        """One engine step: ``prefill_chunks`` as (new tokens, context before them) per prompt, plus a
        decode batch of ``decode_batch`` sequences holding ``decode_context`` tokens in all; on ``sm_share`` %
        of the GPU's SMs (an MPS split: its GPU work scaled by the profile's measured share points; a prefill
        step's host side, which runs on the CPU, is not)."""
        phase, gpu, host, chunk = self._parts(prefill_chunks, decode_batch, decode_context, sm_share)
        return (max(gpu, host) + chunk) * self.scale(phase, threads, neighbours)

    def gpu_fraction(
        self, prefill_chunks: Sequence[tuple[int, int]], decode_batch: int, decode_context: int, sm_share: float = 100
    ) -> float:
        """The part of a step's time its GPU work fills, 0..1: 1 but for a prefill-only step whose host side (the
        floor + per sequence) is the longer, which leaves the SMs idle the rest of the time (for the other client
        of an overlapping MPS split)."""
        _, gpu, host, chunk = self._parts(prefill_chunks, decode_batch, decode_context, sm_share)
        step = max(gpu, host) + chunk
        return 1.0 if step <= 0 else (gpu + chunk) / step

    def share_scale(self, phase: str, share: float) -> float:
        """ms(share) / ms(100) for ``phase``, interpolated linearly between measured shares, and below the
        lowest one scaled by lowest / share (an SM-bound step: never optimistic); 1.0 at 100. ValueError when
        the profile measured none for ``phase``."""
        pts = self.sm_scale.get(phase)
        if share >= 100:
            return 1.0
        if not pts:
            raise ValueError(f"the profile has no {phase} steps at SM shares: run distserve profile --sm-shares")
        if share <= pts[0][0]:  # below the lowest measured share: as if the step were bound by SMs alone
            return pts[0][1] * pts[0][0] / max(1, share)
        for (s0, v0), (s1, v1) in zip(pts, pts[1:]):
            if s0 <= share <= s1:
                return v0 + (v1 - v0) * (share - s0) / (s1 - s0)
        return pts[-1][1]

    def prefill_ms(self, lengths: Sequence[int], threads: int = 1, neighbours: int = 0) -> float:
        return self.step_ms([(n, 0) for n in lengths], 0, 0, threads, neighbours)

    def decode_ms(self, batch: int, context: int, threads: int = 1, neighbours: int = 0) -> float:
        return self.step_ms([], batch, context, threads, neighbours)

    def kv_ms(self, nbytes: int) -> float:
        return self.kv_fixed_ms + self.kv_ms_per_byte * nbytes

    def scale(self, phase: str, threads: int, neighbours: int) -> float:
        """Time multiplier for a step with ``threads`` torch threads beside ``neighbours`` busy processes:
        the measured point, else the nearest measured thread count with the same neighbours, else 1."""
        if not self.thread_scale:
            return 1.0
        key = (phase, threads, neighbours)
        if key in self.thread_scale:
            return self.thread_scale[key]
        same = [
            (abs(t - threads), s)
            for (p, t, n), s in self.thread_scale.items()
            if p == phase
            and n == min(neighbours, max((n2 for (p2, _, n2) in self.thread_scale if p2 == phase), default=0))
        ]
        return min(same)[1] if same else 1.0
