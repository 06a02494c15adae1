"""Probes (steady-state hypothesis and invariants): HTTP status, process liveness, Prometheus values.

A probe is a dict from the drill file; ``run_probe`` returns ``{name, value,
tolerance, ok}`` and never raises for an unreachable target (that is a
deviation, recorded as data). ``within_s`` retries until the tolerance holds.
"""

from __future__ import annotations

import re
import time
import urllib.error
import urllib.request

from distserve.chaos.sysutil import pid_alive
from distserve.chaos.workers import list_workers

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_metrics(text: str) -> list[tuple[str, dict, float]]:
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        try:
            out.append((m.group(1), labels, float(m.group(3))))
        except ValueError:
            continue
    return out


def metric_value(text: str, name: str, labels: dict | None = None) -> float | None:
    """Sum of the samples of ``name`` whose labels include ``labels``; None when there is none."""
    hits = [
        v
        for n, lab, v in parse_metrics(text)
        if n == name and all(lab.get(k) == v2 for k, v2 in (labels or {}).items())
    ]
    return sum(hits) if hits else None


def _get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except OSError as e:
        return 0, str(e)


def in_tolerance(value, tolerance) -> bool:
    if value is None:
        return False
    if isinstance(tolerance, list) and len(tolerance) == 2 and all(isinstance(t, (int, float)) for t in tolerance):
        return tolerance[0] <= value <= tolerance[1]
    if isinstance(tolerance, list):
        return value in tolerance
    return value == tolerance


def _value(probe: dict, router: str, token: str):
    kind = probe.get("type", "http")
    if kind == "http":
        return _get(probe["url"])[0]
    if kind == "process":  # every worker of a role has a live PID
        ws = [w for w in list_workers(router, token) if w["role"] == probe["role"]]
        return bool(ws) and all(pid_alive(int(w["pid"])) for w in ws)
    if kind == "workers":  # healthy workers of a role, as the router sees them
        return sum(w["healthy"] for w in list_workers(router, token) if w["role"] == probe["role"])
    if kind == "command":  # exit status of a command (e.g. `distserve doctor` finds the drift)
        import subprocess
        import sys

        argv = [sys.executable if a == "{python}" else a for a in probe["argv"]]
        return subprocess.run(
            argv, capture_output=True, timeout=float(probe.get("timeout_s", 120)), check=False
        ).returncode
    if kind == "prometheus":
        scope = probe.get("scope", "router")
        if scope == "router":
            urls = [f"{router}/metrics"]
        else:  # "workers", "role:decode" or "worker:decode-1"
            ws = list_workers(router, token)
            if scope.startswith("role:"):
                ws = [w for w in ws if w["role"] == scope[5:]]
            elif scope.startswith("worker:"):
                ws = [w for w in ws if w["worker_id"] == scope[7:]]
            urls = [f"{w['url']}/metrics" for w in ws]
        total = None
        for u in urls:
            status, text = _get(u)
            if status != 200:
                return None
            v = metric_value(text, probe["metric"], probe.get("labels"))
            if v is not None:
                total = (total or 0.0) + v
        return total
    raise ValueError(f"probe type {kind!r} is unknown; known: http, process, workers, prometheus, command")


def run_probe(probe: dict, router: str, token: str) -> dict:
    deadline = time.monotonic() + float(probe.get("within_s", 0))
    while True:
        try:
            value = _value(probe, router, token)
        except (OSError, ValueError, KeyError) as e:
            value = f"unreachable: {e}"
        ok = in_tolerance(value, probe.get("tolerance"))
        if ok or time.monotonic() >= deadline:
            return {
                "name": probe.get("name", probe.get("type")),
                "value": value,
                "tolerance": probe.get("tolerance"),
                "ok": ok,
            }
        time.sleep(0.5)
