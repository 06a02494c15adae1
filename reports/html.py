"""Self-contained HTML report: tables and inline SVG plots, readable offline (no CDN, no script)."""

from __future__ import annotations

import html
from pathlib import Path

from distserve.distbench.atomic import atomic_write
from distserve.reports.tabular import _budget, _fmt, _observed, _target

_CSS = """body{font-family:system-ui,sans-serif;margin:2em;color:#222}table{border-collapse:collapse;margin:1em 0}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}th{background:#f4f4f4}td:first-child{text-align:left}
.pass{color:#1a7f37}.fail{color:#cf222e;font-weight:bold}.no_data{color:#888}h1 .fail,h1 .pass{font-size:1em}
svg{background:#fff;border:1px solid #ddd}"""

W, H, ML, MR, MT, MB = 760, 230, 60, 20, 20, 40


def _e(v) -> str:
    return html.escape(str(v))


def _tick(v: float) -> str:
    """An axis label without exponents: '12,100' rather than '1.21e+04'; short enough to fit the margin."""
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def svg_plot(rows: list[dict], title: str) -> str:
    """Observed value per window (dots, red when failing) against the threshold (dashed)."""
    pts = [r for r in rows if r["observed"] is not None]
    is_avail = bool(rows) and rows[0]["metric"] == "availability"
    scale = 100.0 if is_avail else 1.0
    unit = "%" if is_avail else "ms"
    threshold = rows[0]["threshold"] * scale if rows else 0.0
    values = [r["observed"] * scale for r in pts]
    lo = min(values + [threshold]) * 0.98 if is_avail else 0.0
    hi = max(values + [threshold]) * 1.1 or 1.0
    if hi <= lo:
        hi = lo + 1.0
    n = max(len(rows), 1)

    def x(i: int) -> float:
        return ML + (W - ML - MR) * (i + 0.5) / n

    def y(v: float) -> float:
        return MT + (H - MT - MB) * (1 - (v - lo) / (hi - lo))

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" role="img" aria-label="{_e(title)}">',
        f'<text x="{ML}" y="14" font-size="12">{_e(title)}</text>',
        f'<line x1="{ML}" y1="{H - MB}" x2="{W - MR}" y2="{H - MB}" stroke="#444"/>',
        f'<line x1="{ML}" y1="{MT}" x2="{ML}" y2="{H - MB}" stroke="#444"/>',
    ]
    for k in range(5):
        v = lo + (hi - lo) * k / 4
        out.append(f'<text x="{ML - 4}" y="{y(v) + 4:.1f}" font-size="10" text-anchor="end">{_tick(v)}</text>')
    # the unit runs up the left edge, clear of the tick labels (which end at ML - 4)
    mid = (MT + H - MB) / 2
    out.append(
        f'<text x="12" y="{mid:.1f}" font-size="10" text-anchor="middle" transform="rotate(-90 12 {mid:.1f})">'
        f"{unit}</text>"
    )
    out.append(
        f'<line x1="{ML}" y1="{y(threshold):.1f}" x2="{W - MR}" y2="{y(threshold):.1f}" '
        f'stroke="#cf222e" stroke-dasharray="5,4"><title>threshold {threshold:g} {unit}</title></line>'
    )
    step = max(1, len(rows) // 8)
    for i, r in enumerate(rows):
        if i % step == 0:
            out.append(
                f'<text x="{x(i):.1f}" y="{H - MB + 14}" font-size="9" text-anchor="middle">'
                f"{_e(r['window_start'])[:19]}</text>"
            )
        if r["observed"] is None:
            continue
        color = {"fail": "#cf222e", "insufficient_data": "#9a6700"}.get(r["status"], "#1a7f37")
        out.append(
            f'<circle cx="{x(i):.1f}" cy="{y(r["observed"] * scale):.1f}" r="3.5" fill="{color}">'
            f"<title>{_e(r['window_start'])}: {r['observed'] * scale:.4g} {unit} "
            f"({r['status']})</title></circle>"
        )
    out.append("</svg>")
    return "".join(out)


def _table(head: list[str], body: list[list[str]]) -> str:
    th = "".join(f"<th>{_e(h)}</th>" for h in head)
    trs = "".join(
        "<tr>" + "".join(c if c.startswith("<td") else f"<td>{c}</td>" for c in row) + "</tr>" for row in body
    )
    return f"<table><tr>{th}</tr>{trs}</table>"


def _status(s: str) -> str:
    return f'<td class="{_e(s)}">{_e(s)}</td>'


def render_html(report: dict) -> str:
    spec = report["spec"]
    verdict = report["verdict"]
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>SLA audit {_e(spec['name'])}</title>"
        f"<style>{_CSS}</style></head><body>",
        f"<h1>SLA audit: {_e(spec['name'])} — <span class='{verdict}'>{verdict.upper()}</span></h1>",
        f"<p>{report['num_requests']} requests, {report['num_windows']} window(s) of {spec['window_s']:g} s "
        f"(clock: {_e(report['clock'])}). Audit <code>{_e(report['audit_id'])}</code> at "
        f"{_e(report['audited_at'])}. Sources: {_e(', '.join(report['sources']))}.</p>",
        "<h2>Objectives</h2>",
        _table(
            ["objective", "target", "observed (all windows)", "samples", "windows failed", "verdict"],
            [
                [
                    _e(o["objective"]),
                    _e(_target(o)),
                    _e(_observed(o)),
                    str(o["samples"]),
                    f"{o['windows_failed']}/{o['windows']}",
                    _status(o["status"]),
                ]
                for o in report["overall"]
            ],
        ),
        "<h2>Worst windows</h2>",
        _table(
            ["window start", "objective", "observed", "target", "samples", "budget used", "status"],
            [
                [
                    _e(r["window_start"]),
                    _e(r["objective"]),
                    _e(_observed(r)),
                    _e(_target(r)),
                    str(r["samples"]),
                    _e(_budget(r)),
                    _status(r["status"]),
                ]
                for r in report["worst_windows"]
            ],
        ),
    ]
    for o in report["overall"]:
        rows = [r for r in report["rows"] if r["objective"] == o["objective"]]
        parts.append(f"<h2>{_e(o['objective'])} per window</h2>")
        parts.append(svg_plot(rows, f"{o['objective']}: observed per window vs target {_target(o)}"))
        parts.append(
            _table(
                ["window start", "observed", "samples", "violations", "allowed", "budget used", "status"],
                [
                    [
                        _e(r["window_start"]),
                        _e(_observed(r)),
                        str(r["samples"]),
                        str(r["violations"]),
                        _fmt(r["allowed_violations"], 2),
                        _e(_budget(r)),
                        _status(r["status"]),
                    ]
                    for r in rows
                ],
            )
        )
    parts.append("</body></html>\n")
    return "".join(parts)


def write_html(report: dict, path: Path) -> None:
    atomic_write(path, render_html(report))
