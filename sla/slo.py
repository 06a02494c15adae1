"""What "meets the SLO" means: the one definition that distbench, the SLA audit, the planner and the release gate use.

Pure (no I/O, the standard library only), so every harness package imports it without a circle: the
load generator, the planner and the gate import this module, never the rest of ``sla``.

The rules, stated once:

- **Within a limit** is inclusive: a latency *equal* to its limit meets it (``value <= limit``); a
  violation is a value strictly above its limit.
- **A request meets an SLO** (``meets``) when it succeeded and each limited metric it measured is within
  its limit. A failed request meets none. A metric the request did not measure (the TPOT of a one-token
  answer, ``None`` or absent) is not held against it, as vLLM's goodput counts it. ITL is judged by the
  request's largest gap (every gap within the limit).
- **Percentile form** (``percentile_meets``): the nearest-rank pNN — the sample of rank ``ceil(q/100 × n)``
  in sorted order, no interpolation — is within the limit. No sample: not met. It is judged on the exact
  values: a histogram's pNN (HDR, 3 significant figures) may read up to 0.1 % above the sample it stands
  for, so a figure reported from a histogram is not what decides.
- **Attainment form** (``attainment_meets``): the share of requests that meet the SLO is at least the
  target (``share >= target``).

Units are the caller's, the same for values and limits (distbench's records hold seconds, the planner's
samples and the gate's summaries milliseconds).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

METRICS = ("ttft", "tpot", "itl", "e2el")  # what an SLO can limit (e2el: end-to-end latency)
FORMS = ("attainment", "p90", "p99")  # how a set of requests meets it (``SLO.form``)


class SLOError(ValueError):
    """A bad SLO text; one sentence."""


def within(value: float, limit: float) -> bool:
    """The one comparison: a value meets its limit when it is at most the limit."""
    return value <= limit


def meets(record: Mapping[str, float | Sequence[float] | None], limits: Mapping[str, float], ok: bool = True) -> bool:
    """One request against ``limits`` (metric → limit): ``record`` maps a metric to its value (ITL: the
    gaps); ``ok`` is False for a failed request, which meets nothing."""
    if not ok:
        return False
    for name, limit in limits.items():
        value = record.get(name)
        if value is None:
            continue
        if isinstance(value, Sequence):  # ITL: every gap
            if value and not within(max(value), limit):
                return False
        elif not within(value, limit):
            return False
    return True


def nearest_rank(values: Sequence[float], q: float) -> float:
    """The nearest-rank pNN of ``values``: the value of rank ``ceil(q/100 × n)``; ``inf`` without values."""
    s = sorted(values)
    if not s:
        return math.inf
    return s[max(0, math.ceil(round(q / 100 * len(s), 9)) - 1)]  # round: 0.9 × 70 is 63.00000000000001


def percentile_meets(values: Sequence[float], q: float, limit: float) -> bool:
    return within(nearest_rank(values, q), limit)


def attainment_meets(share: float, target: float) -> bool:
    return share >= target


@dataclass(frozen=True)
class SLO:
    """A typed SLO: limits in ms, and the form a set of requests meets it in (``FORMS``), with its target."""

    limits_ms: tuple[tuple[str, float], ...]
    form: str = "attainment"
    target: float = 0.9

    @property
    def limits(self) -> dict[str, float]:
        return dict(self.limits_ms)

    @property
    def percentile(self) -> float | None:
        """The q of the percentile form (90 or 99); None for the attainment form."""
        return None if self.form == "attainment" else float(self.form[1:])

    @classmethod
    def parse(cls, text: str, form: str = "attainment", target: float = 0.9, metrics=("ttft", "tpot", "e2el")) -> SLO:
        """``ttft:200ms,tpot:50ms`` (units ms or s, a bare number is ms)."""
        if form not in FORMS:
            raise SLOError(f"--slo-form must be one of {', '.join(FORMS)}, got {form!r}")
        if not 0 < target <= 1:
            raise SLOError(f"--slo-target must be in (0, 1], got {target}")
        limits = []
        for part in text.split(","):
            name, sep, value = part.strip().partition(":")
            if not sep or name not in metrics:
                raise SLOError(f"--slo part {part!r} must be METRIC:VALUE with METRIC one of {', '.join(metrics)}")
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
