"""Prometheus textfile renderer: the audit's verdict per objective, for node_exporter's textfile collector.

Per objective (not per window: windows are unbounded label values): the observed value over all
windows, the threshold, windows audited and failed, pass (1/0); and the overall verdict.
"""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, Gauge, generate_latest

from distserve.distbench.atomic import atomic_write


def render_prom(report: dict) -> bytes:
    r = CollectorRegistry()
    labels = ["spec", "objective", "metric"]
    observed = Gauge(
        "distserve_sla_observed",
        "Observed value over all windows: percentile in ms, or success share for availability.",
        labels,
        registry=r,
    )
    threshold = Gauge(
        "distserve_sla_threshold", "The objective's threshold (ms, or required success share).", labels, registry=r
    )
    windows = Gauge("distserve_sla_windows", "Windows audited.", labels, registry=r)
    failed = Gauge("distserve_sla_windows_failed", "Windows that failed the objective.", labels, registry=r)
    passed = Gauge("distserve_sla_objective_pass", "1 when every window passed the objective.", labels, registry=r)
    verdict = Gauge("distserve_sla_pass", "1 when the audit passed.", ["spec"], registry=r)
    stamp = Gauge("distserve_sla_audit_requests", "Requests audited.", ["spec"], registry=r)
    spec = report["spec"]["name"]
    for o in report["overall"]:
        key = (spec, o["objective"], o["metric"])
        if o["observed"] is not None:
            observed.labels(*key).set(o["observed"])
        threshold.labels(*key).set(o["threshold"])
        windows.labels(*key).set(o["windows"])
        failed.labels(*key).set(o["windows_failed"])
        passed.labels(*key).set(int(o["status"] == "pass"))
    verdict.labels(spec).set(int(report["verdict"] == "pass"))
    stamp.labels(spec).set(report["num_requests"])
    return generate_latest(r)


def write_prom(report: dict, path: Path) -> None:
    atomic_write(path, render_prom(report))
