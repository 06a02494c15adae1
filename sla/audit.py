"""Audit request records against an SLA spec, window by window.

For every window of ``spec.window_s`` seconds that holds requests, and every
objective: the observed percentile (from an HDR histogram of the window's
samples), the sample count, the violations (samples above the threshold,
counted exactly from the raw values), the violations the objective allows
(``(1 - p/100) × samples``), the share of that error budget used, and
pass/fail (the percentile <= threshold, judged on the exact values: ``sla/slo.py``). Availability is one more
objective per window: successes / requests against ``spec.availability``; where the
router's journal records a gap (lines it could not write) the availability of the
windows it touches, and overall, is ``incomplete``, never ``pass``.

Thin tails: a percentile whose tail holds fewer than ``MIN_TAIL_SAMPLES``
samples (``(1 - p/100) × samples < 10``: P99 under 1 000 samples, P99.9
under 10 000) is the window's maximum or near it, not an estimate; such a
window's objective is ``insufficient_data``, never pass (it is ``fail`` only
when at least ``MIN_TAIL_SAMPLES`` samples broke the threshold, a violation
share far above any budget it could have). The overall verdict is ``fail``
if any window failed, else ``insufficient_data`` if any could not be judged.

The result is plain data (``AuditReport.to_dict()``) whose ``rows`` follow
``COLUMNS``: the renderers in ``reports/`` write it as JSON, CSV, Parquet,
SQL, HTML and Markdown without knowing anything about SLAs.
"""

from __future__ import annotations

import datetime as dt
import math
import uuid
from collections import defaultdict
from dataclasses import asdict, dataclass, fields, replace

from distserve.sla.records import Gap, Record, RecordSet
from distserve.sla.slo import percentile_meets, within
from distserve.sla.spec import Objective, SlaSpec
from distserve.sla.window import LatencyHistogram

MIN_TAIL_SAMPLES = 10  # as distbench.metrics: a pNN needs this many samples above it

__all__ = ["COLUMNS", "AuditReport", "WindowRow", "audit"]

WORST_N = 5


@dataclass(frozen=True)
class WindowRow:
    """One objective in one window: a row of compliance.csv and of the SQL table."""

    audit_id: str
    spec: str
    window_index: int
    window_start: str  # ISO 8601 UTC (clock "unix") or seconds from the run's start (clock "relative")
    window_start_s: float  # unix seconds or seconds from the run's start
    window_s: float
    objective: str  # e.g. ttft_p99.9, or "availability"
    metric: str  # ttft | tpot | itl | e2e | availability
    percentile: float | None  # None for availability
    threshold: float  # ms for latency objectives; the required success share for availability
    observed: float | None  # the observed percentile in ms (latency) or success share; None without samples
    samples: int
    violations: int
    allowed_violations: float
    budget_used: float | None  # violations / allowed_violations; None when the budget is 0 and exceeded
    status: str  # pass | fail | insufficient_data | no_data | incomplete (availability, journal gaps)

    @property
    def passed(self) -> bool:
        return self.status != "fail"


COLUMNS: tuple[tuple[str, str], ...] = tuple(
    (f.name, {"int": "int", "float": "float", "float | None": "float", "str": "str"}[str(f.type)])
    for f in fields(WindowRow)
)


def _budget(violations: int, allowed: float) -> float | None:
    if allowed > 0:
        return round(violations / allowed, 9)
    return 0.0 if violations == 0 else None


def _allowed(share: float, n: int) -> float:
    """The error budget in samples, without float noise (1 - 0.999 is 0.0010000000000000009)."""
    return round(share * n, 9)


def _latency_row(base: dict, o: Objective, values: list[float]) -> WindowRow:
    n = len(values)
    if n == 0:
        return WindowRow(
            **base,
            objective=o.name,
            metric=o.metric,
            percentile=o.percentile,
            threshold=o.threshold_ms,
            observed=None,
            samples=0,
            violations=0,
            allowed_violations=0.0,
            budget_used=None,
            status="no_data",
        )
    h = LatencyHistogram()
    h.record_all(values)
    observed = h.percentile_ms(o.percentile)
    violations = sum(not within(v * 1000.0, o.threshold_ms) for v in values)
    allowed = _allowed(o.allowed_share, n)
    # judged on the exact values (sla/slo.py); ``observed`` is the histogram's figure, up to 0.1 % above them
    status = "pass" if percentile_meets([v * 1000.0 for v in values], o.percentile, o.threshold_ms) else "fail"
    if allowed < MIN_TAIL_SAMPLES and violations < MIN_TAIL_SAMPLES:
        status = "insufficient_data"
    return WindowRow(
        **base,
        objective=o.name,
        metric=o.metric,
        percentile=o.percentile,
        threshold=o.threshold_ms,
        observed=observed,
        samples=n,
        violations=violations,
        allowed_violations=allowed,
        budget_used=_budget(violations, allowed),
        status=status,
    )


def _availability_row(base: dict, target: float, recs: list[Record]) -> WindowRow:
    n = len(recs)
    failed = sum(not r.ok for r in recs)
    allowed = _allowed(1.0 - target, n)
    share = (n - failed) / n
    return WindowRow(
        **base,
        objective="availability",
        metric="availability",
        percentile=None,
        threshold=target,
        observed=share,
        samples=n,
        violations=failed,
        allowed_violations=allowed,
        budget_used=_budget(failed, allowed),
        status="pass" if share >= target else "fail",
    )


_SEVERITY = ("fail", "incomplete", "insufficient_data")  # worst first; anything else (pass, no_data) is a pass


def _worst_status(statuses) -> str:
    seen = set(statuses)
    return next((s for s in _SEVERITY if s in seen), "pass")


def _window_label(start: float, clock: str) -> str:
    if clock == "unix":
        return dt.datetime.fromtimestamp(start, dt.UTC).isoformat().replace("+00:00", "Z")
    return f"{start:g}"


@dataclass
class AuditReport:
    audit_id: str
    audited_at: str
    spec: SlaSpec
    clock: str
    sources: tuple[str, ...]
    num_requests: int
    rows: list[WindowRow]
    overall: list[dict]
    covered_s: float = 0.0  # seconds between the first and last request of each window, summed

    gaps: tuple[Gap, ...] = ()
    client_errors: int = 0

    @property
    def verdict(self) -> str:
        """``fail`` if any objective failed in any window; else ``incomplete`` if records are missing
        (journal gaps: availability cannot be judged); else ``insufficient_data`` if a percentile could
        not be judged (too few samples); else ``pass``."""
        return _worst_status([r.status for r in self.rows] + [o["status"] for o in self.overall])

    def worst(self, n: int = WORST_N) -> list[WindowRow]:
        """The failed windows that overspent their budget most (then the closest to failing)."""

        def badness(r: WindowRow) -> tuple[int, float]:
            b = math.inf if r.budget_used is None else r.budget_used
            return (r.status == "fail", b)

        scored = [r for r in self.rows if r.status != "no_data"]
        return sorted(scored, key=badness, reverse=True)[:n]

    def to_dict(self) -> dict:
        return {
            "audit_id": self.audit_id,
            "audited_at": self.audited_at,
            "verdict": self.verdict,
            "spec": self.spec.to_dict(),
            "clock": self.clock,
            "sources": list(self.sources),
            "num_requests": self.num_requests,
            "num_windows": len({r.window_index for r in self.rows}),
            "client_errors": self.client_errors,
            "journal_gaps": [
                {"since_unix": g.since, "until_unix": g.until, "dropped": g.dropped, "source": g.source}
                for g in self.gaps
            ],
            "dropped_records": sum(g.dropped or 0 for g in self.gaps),
            "covered_s": self.covered_s,
            "overall": self.overall,
            "worst_windows": [asdict(r) for r in self.worst()],
            "columns": [list(c) for c in COLUMNS],
            "rows": [asdict(r) for r in self.rows],
        }


def audit(spec: SlaSpec, data: RecordSet, audit_id: str | None = None, now: dt.datetime | None = None) -> AuditReport:
    """Judge ``data`` against ``spec``; windows start at multiples of ``window_s`` (of the clock's epoch)."""
    audit_id = audit_id or uuid.uuid4().hex[:12]
    by_window: dict[int, list[Record]] = defaultdict(list)
    for r in data.records:
        by_window[math.floor(r.start / spec.window_s)].append(r)
    rows: list[WindowRow] = []
    totals: dict[str, list[float]] = {o.name: [] for o in spec.objectives}
    for k in sorted(by_window):
        recs = by_window[k]
        start = k * spec.window_s
        base = {
            "audit_id": audit_id,
            "spec": spec.name,
            "window_index": k,
            "window_start": _window_label(start, data.clock),
            "window_start_s": start,
            "window_s": spec.window_s,
        }
        for o in spec.objectives:
            values = [v for r in recs for v in r.values(o.metric)]
            totals[o.name].extend(values)
            rows.append(_latency_row(base, o, values))
        if spec.availability is not None:
            row = _availability_row(base, spec.availability, recs)
            if row.status == "pass" and any(g.overlaps(start, start + spec.window_s) for g in data.gaps):
                row = replace(row, status="incomplete")  # records of this window were lost: cannot pass
            rows.append(row)
    overall = []
    for o in spec.objectives:
        mine = [r for r in rows if r.objective == o.name]
        h = LatencyHistogram()
        h.record_all(totals[o.name])
        overall.append(
            {
                "objective": o.name,
                "metric": o.metric,
                "percentile": o.percentile,
                "threshold": o.threshold_ms,
                "observed": h.percentile_ms(o.percentile),
                "samples": len(totals[o.name]),
                "windows": len(mine),
                "windows_failed": sum(r.status == "fail" for r in mine),
                "windows_insufficient": sum(r.status == "insufficient_data" for r in mine),
                "samples_needed": math.ceil(round(MIN_TAIL_SAMPLES / o.allowed_share, 6)),
                "status": _worst_status(r.status for r in mine),
            }
        )
    if spec.availability is not None:
        mine = [r for r in rows if r.objective == "availability"]
        n = len(data.records)
        ok = sum(r.ok for r in data.records)
        overall.append(
            {
                "objective": "availability",
                "metric": "availability",
                "percentile": None,
                "threshold": spec.availability,
                "observed": ok / n,
                "samples": n,
                "windows": len(mine),
                "windows_failed": sum(r.status == "fail" for r in mine),
                "windows_insufficient": 0,
                "status": _worst_status([r.status for r in mine] + (["incomplete"] if data.gaps else [])),
            }
        )
    audited_at = (now or dt.datetime.now(dt.UTC)).isoformat().replace("+00:00", "Z")
    spans = [max(r.start for r in recs) - min(r.start for r in recs) for recs in by_window.values()]
    return AuditReport(
        audit_id,
        audited_at,
        spec,
        data.clock,
        data.sources,
        len(data.records),
        rows,
        overall,
        covered_s=round(sum(spans), 6),
        gaps=data.gaps,
        client_errors=data.client_errors,
    )
