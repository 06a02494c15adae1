"""SLOs and attainment over simulated (or measured) per-request latencies, in ``sla.slo``'s meanings.

``ttft:200ms,tpot:50ms`` (units ms or s; metrics ttft, tpot, e2el). Three forms of "meets the SLO"
(``sla/slo.py`` states each rule once: inclusive limits, nearest rank, a failed request a miss):
- ``attainment``: at least ``target`` of the requests meet every limit (distbench's ``slo_attainment`` >=
  ``--slo-target``; a failed request is a miss);
- ``p90`` / ``p99``: that percentile (nearest rank) of each metric is within its limit (the two-GPU
  study's "P90 form").
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from distserve.sla import slo as shared
from distserve.sla.slo import FORMS, SLO, SLOError

__all__ = ["FORMS", "METRICS", "SLO", "SLOError", "attainment", "meets", "percentile", "score"]

METRICS = ("ttft", "tpot", "e2el")  # what the simulator measures (no ITL)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest rank (distbench's definition): the value of rank ceil(q/100 * n)."""
    return shared.nearest_rank(values, q)


def attainment(slo: SLO, samples: Sequence[dict[str, float]]) -> float:
    """Share of requests meeting every limit (``samples``: one dict of ms per request; inf = failed)."""
    if not samples:
        return 0.0
    limits = slo.limits  # a failed request's inf latencies miss; a one-token answer has no TPOT to hold it to
    ok = sum(shared.meets(r, limits) for r in samples)
    return ok / len(samples)


def meets(slo: SLO, samples: Sequence[dict[str, float]]) -> bool:
    if slo.form == "attainment":
        return shared.attainment_meets(attainment(slo, samples), slo.target)
    q = 90.0 if slo.form == "p90" else 99.0
    return all(shared.percentile_meets([r.get(m, math.inf) for r in samples], q, v) for m, v in slo.limits_ms)


def score(slo: SLO, samples: Sequence[dict[str, float]]) -> float:
    """A number that is >= 1 exactly when the SLO is met (for curves): attainment / target, or the worst
    limit / percentile ratio."""
    if slo.form == "attainment":
        return attainment(slo, samples) / slo.target
    q = 90.0 if slo.form == "p90" else 99.0
    return min(v / max(percentile([r.get(m, math.inf) for r in samples], q), 1e-9) for m, v in slo.limits_ms)
