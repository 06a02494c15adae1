"""``distbench plot RESULT...``: PNGs — TTFT/TPOT CDFs, latency and SLO attainment vs rate, per-request timeline.

matplotlib is an optional extra (``pip install 'distserve[bench]'``); without it the command says so.
A result may be a run result or a ``sweep.json`` (its points give the vs-rate plot). Every plot has a
title and axes with units; every run is named in the legend with its settings (load, lengths, requests);
SLO limits are drawn from every run (or sweep) that has one, the attainment target as a line, a sweep's
goodput as a marker, saturated sweep points as crosses.
"""

from __future__ import annotations

import math
from pathlib import Path

from distserve.distbench.result import records_of


class PlotUnavailable(RuntimeError):
    pass


def _plt():
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable(
            "distbench plot needs matplotlib: pip install -e '.[bench]' in a distserve checkout "
            "('distserve[bench]' where distserve comes from an index)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def settings_label(name: str, r: dict) -> str:
    """'a: 8 req/s poisson, 128→64 tok, 200 req' — what a reader needs to tell the runs apart."""
    c = r.get("config") or {}
    w = c.get("workload") or {}
    if c.get("strategy") == "closed":
        load = f"{c.get('concurrency')} users"
    elif isinstance(c.get("request_rate"), (int, float)):
        load = f"{c['request_rate']:g} req/s {c.get('strategy', '')}".rstrip()
    else:
        load = str(c.get("strategy", "?"))
    lengths = (
        f"{w.get('prompt_len', '?')}→{w.get('output_len') or ('64' if w.get('dataset') == 'random' else 'data')} tok"
    )
    dataset = "" if w.get("dataset", "random") == "random" else f" {w['dataset']}"
    return f"{name}: {load}, {lengths}{dataset}, {r.get('num_prompts', '?')} req"


def _slo_lines(items: list[tuple[str, dict]], metric: str) -> list[tuple[float, str]]:
    """Distinct SLO limits of ``metric`` (ms) across runs/sweeps, with the names that carry each."""
    by_limit: dict[float, list[str]] = {}
    for name, r in items:
        slo = r.get("slo")
        if isinstance(slo, str):  # a sweep keeps the --slo text
            from distserve.distbench.metrics import parse_slo

            slo = {k: v * 1000 for k, v in parse_slo(slo).items()}
        v = (slo or {}).get(metric)
        if v:
            by_limit.setdefault(float(v), []).append(name)
    return sorted(by_limit.items())  # type: ignore[arg-type]


def plot(results: list[tuple[str, dict]], out_dir: Path) -> list[Path]:
    plt = _plt()
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    runs = [(n, r) for n, r in results if "requests" in r]
    sweeps = [(n, r) for n, r in results if "points" in r]
    if runs:
        written.append(_cdf(plt, runs, out_dir))
        written.append(_timeline(plt, runs, out_dir))
    curves: dict[str, list[dict]] = {name: list(s["points"]) for name, s in sweeps}
    by_rate = [
        {
            "rate": r["request_rate"],
            "slo_attainment": r.get("slo_attainment"),
            "p99_ttft_ms": r["p99_ttft_ms"],
            "p99_tpot_ms": r["p99_tpot_ms"],
            "saturated": False,
        }
        for _, r in runs
        if isinstance(r.get("request_rate"), (int, float))
    ]
    if len(by_rate) > 1:
        curves["runs " + ", ".join(n for n, r in runs if isinstance(r.get("request_rate"), (int, float)))] = by_rate
    if curves:
        written.append(_vs_rate(plt, curves, runs + sweeps, sweeps, out_dir))
    return written


def _cdf(plt, runs, out_dir: Path) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, (label, metric) in zip(axes, (("TTFT", "ttft"), ("TPOT", "tpot"))):
        for name, r in runs:
            xs = sorted(v * 1000 for rec in records_of(r) if rec.ok and (v := getattr(rec, metric)) is not None)
            if xs:
                ax.plot(xs, [100 * (i + 1) / len(xs) for i in range(len(xs))], label=settings_label(name, r))
        for limit, names in _slo_lines(runs, metric):
            ax.axvline(limit, color="grey", linestyle="--", linewidth=1, label=f"SLO {limit:g} ms ({', '.join(names)})")
        ax.set_xlabel(f"{label} (ms)")
        ax.set_ylabel("requests at or below (%)")
        ax.set_ylim(0, 101)
        ax.set_title(f"{label}: cumulative distribution")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle("Latency CDFs (completed requests; open loop: TTFT from the scheduled send)", fontsize=10)
    fig.tight_layout()
    return _save(fig, out_dir / "cdf.png", plt)


def _timeline(plt, runs, out_dir: Path) -> Path:
    fig, ax = plt.subplots(figsize=(11, 4.2))
    for name, r in runs:
        recs = records_of(r)
        ok = [x for x in recs if x.ok]
        ax.scatter([x.scheduled for x in ok], [(x.ttft or 0.0) * 1000 for x in ok], s=6, label=settings_label(name, r))
        bad = [x for x in recs if not x.ok and not x.cancelled]
        if bad:
            ax.scatter(
                [x.scheduled for x in bad], [0] * len(bad), marker="x", color="red", s=18, label=f"{name}: failed"
            )
        cut = [x for x in recs if x.cancelled]
        if cut:
            ax.scatter(
                [x.scheduled for x in cut], [0] * len(cut), marker="|", color="black", s=30, label=f"{name}: cancelled"
            )
    for limit, names in _slo_lines(runs, "ttft"):
        ax.axhline(
            limit, color="grey", linestyle="--", linewidth=1, label=f"TTFT SLO {limit:g} ms ({', '.join(names)})"
        )
    ax.set_xlabel("scheduled send time (s from the run's start)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("TTFT of every request over the run (failed and cancelled requests at 0)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return _save(fig, out_dir / "timeline.png", plt)


def _vs_rate(plt, curves: dict[str, list[dict]], with_slo, sweeps, out_dir: Path) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    lat, att = axes
    for name, pts in curves.items():
        pts = sorted(pts, key=lambda p: p["rate"])
        rates = [p["rate"] for p in pts]
        lat.plot(rates, [p["p99_ttft_ms"] for p in pts], marker="o", label=f"{name}: P99 TTFT")
        lat.plot(rates, [p["p99_tpot_ms"] for p in pts], marker="s", label=f"{name}: P99 TPOT")
        known = [p for p in pts if p.get("slo_attainment") is not None]
        if known:
            line = att.plot(
                [p["rate"] for p in known], [100 * p["slo_attainment"] for p in known], marker="o", label=name
            )
            sat = [p for p in known if p.get("saturated")]
            if sat:
                att.scatter(
                    [p["rate"] for p in sat],
                    [100 * p["slo_attainment"] for p in sat],
                    marker="x",
                    s=80,
                    color=line[0].get_color(),
                    label=f"{name}: saturated (achieved < 90 % of offered)",
                    zorder=3,
                )
    for metric, style in (("ttft", "--"), ("tpot", ":")):
        for limit, _names in _slo_lines(with_slo, metric):
            lat.axhline(limit, color="grey", linestyle=style, linewidth=1, label=f"{metric.upper()} SLO {limit:g} ms")
    targets = sorted({s.get("slo_target") for _, s in with_slo if s.get("slo_target")})
    for t in targets:
        att.axhline(100 * t, color="grey", linestyle="--", linewidth=1, label=f"attainment target {100 * t:g}%")
    for name, s in sweeps:
        g = s.get("goodput_rate")
        if g:
            att.axvline(g, color="green", linestyle="-.", linewidth=1.2, label=f"{name}: goodput {g:.3g} req/s")
    lat.set_xlabel("request rate (req/s)")
    lat.set_ylabel("P99 latency (ms, log scale)")
    if all(p["p99_ttft_ms"] > 0 and not math.isnan(p["p99_ttft_ms"]) for pts in curves.values() for p in pts):
        from matplotlib.ticker import ScalarFormatter

        lat.set_yscale("log")
        lat.yaxis.set_major_formatter(ScalarFormatter())  # 200, not 2 x 10^2
        lat.yaxis.set_minor_formatter(ScalarFormatter())
    lat.set_title("P99 TTFT and TPOT vs request rate")
    lat.grid(alpha=0.3, which="both")
    lat.legend(fontsize=7)
    att.set_xlabel("request rate (req/s)")
    att.set_ylabel("SLO attainment (% of requests)")
    att.set_ylim(0, 105)
    att.set_title("SLO attainment vs request rate")
    att.grid(alpha=0.3)
    att.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    return _save(fig, out_dir / "vs_rate.png", plt)


def _save(fig, path: Path, plt) -> Path:
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
