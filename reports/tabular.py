"""JSON, CSV and Markdown renderers of a compliance report."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from distserve.distbench.atomic import atomic_write


def write_json(report: dict, path: Path) -> None:
    atomic_write(path, json.dumps(report, indent=1, allow_nan=False) + "\n")


def _cell(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return repr(v)  # shortest exact text: CSV and JSON agree to the bit
    return str(v)


def write_csv(report: dict, path: Path) -> None:
    """One row per objective per window; the columns are ``report["columns"]`` (docs/SLA.md)."""
    names = [c[0] for c in report["columns"]]
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(names)
    for row in report["rows"]:
        w.writerow([_cell(row[n]) for n in names])
    atomic_write(path, buf.getvalue())


def _fmt(v, digits: int = 1) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _observed(r: dict) -> str:
    if r["metric"] == "availability":
        return "—" if r["observed"] is None else f"{100 * r['observed']:.3f}%"
    return f"{_fmt(r['observed'])} ms"


def _target(r: dict) -> str:
    if r["metric"] == "availability":
        return f">= {100 * r['threshold']:g}%"
    return f"p{r['percentile']:g} <= {r['threshold']:g} ms"


def _budget(r: dict) -> str:
    """Share of the error budget used; '12× budget' beyond 10×; no % when the budget is under 10 samples."""
    b = r.get("budget_used")
    if r.get("status") == "insufficient_data":
        return f"— (budget {r['allowed_violations']:.3g} samples: too few)"
    if b is None:
        return "exceeded (budget 0)" if r.get("status") == "fail" else "—"
    return f"{b:.0f}× budget" if b >= 10 else f"{100 * b:.0f}%"


def markdown_summary(report: dict) -> str:
    spec = report["spec"]
    lines = [
        f"# SLA audit: {spec['name']} — **{report['verdict'].upper()}**",
        "",
        f"{report['num_requests']} requests in {report['num_windows']} window(s) of {spec['window_s']:g} s "
        f"(clock: {report['clock']}); audit `{report['audit_id']}` at {report['audited_at']}.",
        "",
        "| objective | target | observed (all windows) | samples | windows failed | verdict |",
        "|---|---|---|---|---|---|",
    ]
    for o in report["overall"]:
        lines.append(
            f"| {o['objective']} | {_target(o)} | {_observed(o)} | {o['samples']} | "
            f"{o['windows_failed']}/{o['windows']} | {o['status']} |"
        )
    worst = [r for r in report["worst_windows"] if r["status"] == "fail"]
    lines += ["", "## Worst windows", ""]
    if not worst:
        lines.append("No window failed.")
    else:
        lines += [
            "| window start | objective | observed | target | samples | budget used |",
            "|---|---|---|---|---|---|",
        ]
        for r in worst:
            lines.append(
                f"| {r['window_start']} | {r['objective']} | {_observed(r)} | {_target(r)} | "
                f"{r['samples']} | {_budget(r)} |"
            )
    lines += ["", f"Sources: {', '.join(report['sources'])}", ""]
    return "\n".join(lines)


def write_markdown(report: dict, path: Path) -> None:
    atomic_write(path, markdown_summary(report))
