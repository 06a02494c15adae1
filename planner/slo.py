"""SLOs and attainment, in distbench's meanings, over simulated (or measured) per-request latencies.

``ttft:200ms,tpot:50ms`` (units ms or s; metrics ttft, tpot, e2el). Three forms of "meets the SLO":
- ``attainment``: at least ``target`` of the requests meet every limit (distbench's ``slo_attainment`` >=
  ``--slo-target``; a failed request is a miss);
- ``p90`` / ``p99``: that percentile (nearest rank) of each metric is within its limit (the two-GPU
  study's "P90 form").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

METRICS = ("ttft", "tpot", "e2el")
FORMS = ("attainment", "p90", "p99")


class SLOError(ValueError):
    """A bad --slo; one sentence."""


@dataclass(frozen=True)
class SLO:
    limits_ms: tuple[tuple[str, float], ...]
    form: str = "attainment"
    target: float = 0.9

    @classmethod
    def parse(cls, text: str, form: str = "attainment", target: float = 0.9) -> SLO:
        if form not in FORMS:
            raise SLOError(f"--slo-form must be one of {', '.join(FORMS)}, got {form!r}")
        if not 0 < target <= 1:
            raise SLOError(f"--slo-target must be in (0, 1], got {target}")
        limits = []
        for part in text.split(","):
            name, sep, value = part.strip().partition(":")
            if not sep or name not in METRICS:
                raise SLOError(f"--slo part {part!r} must be METRIC:VALUE with METRIC one of {', '.join(METRICS)}")
            v = value.strip().lower()
            try:
                ms = float(v[:-2]) if v.endswith("ms") else float(v[:-1]) * 1000 if v.endswith("s") else float(v)
            except ValueError:
                raise SLOError(f"--slo value {value!r} of {name} is not a number of ms or s (e.g. 200ms)") from None
            if not ms > 0 or math.isinf(ms):
                raise SLOError(f"--slo limit of {name} must be > 0, got {value!r}")
            limits.append((name, ms))
        if len({n for n, _ in limits}) != len(limits):
            raise SLOError("--slo names a metric twice")
        return cls(tuple(limits), form, target)

    def describe(self) -> str:
        lim = ", ".join(f"{n.upper()} <= {v:g} ms" for n, v in self.limits_ms)
        if self.form == "attainment":
            return f"{lim} for >= {self.target:.0%} of requests"
        return f"{self.form.upper()} of each: {lim}"


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest rank (distbench's definition): the value of rank ceil(q/100 * n)."""
    s = sorted(values)
    if not s:
        return math.inf
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


def attainment(slo: SLO, samples: Sequence[dict[str, float]]) -> float:
    """Share of requests meeting every limit (``samples``: one dict of ms per request; inf = failed)."""
    if not samples:
        return 0.0
    ok = sum(all(r.get(m, math.inf) <= v for m, v in slo.limits_ms) for r in samples)
    return ok / len(samples)


def meets(slo: SLO, samples: Sequence[dict[str, float]]) -> bool:
    if slo.form == "attainment":
        return attainment(slo, samples) >= slo.target
    q = 90.0 if slo.form == "p90" else 99.0
    return all(percentile([r.get(m, math.inf) for r in samples], q) <= v for m, v in slo.limits_ms)


def score(slo: SLO, samples: Sequence[dict[str, float]]) -> float:
    """A number that is >= 1 exactly when the SLO is met (for curves): attainment / target, or the worst
    limit / percentile ratio."""
    if slo.form == "attainment":
        return attainment(slo, samples) / slo.target
    q = 90.0 if slo.form == "p90" else 99.0
    return min(v / max(percentile([r.get(m, math.inf) for r in samples], q), 1e-9) for m, v in slo.limits_ms)
