"""``distbench plot RESULT...``: PNGs — TTFT/TPOT CDFs, latency and SLO attainment vs rate, per-request timeline.

matplotlib is an optional extra (``pip install 'distserve[bench]'``); without it the command says so.
A result may be a run result or a ``sweep.json`` (its points give the vs-rate plot).
"""

from __future__ import annotations

from pathlib import Path

from distbench.result import records_of


class PlotUnavailable(RuntimeError):
    pass


def _plt():
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable("distbench plot needs matplotlib: pip install 'distserve[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(results: list[tuple[str, dict]], out_dir: Path) -> list[Path]:
    plt = _plt()
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    runs = [(n, r) for n, r in results if "requests" in r]
    sweeps = [(n, r) for n, r in results if "points" in r]
    if runs:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
        for ax, (label, metric) in zip(axes, (("TTFT", "ttft"), ("TPOT", "tpot"))):
            for name, r in runs:
                xs = sorted(v * 1000 for rec in records_of(r) if rec.ok and (v := getattr(rec, metric)) is not None)
                if xs:
                    ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=name)
            if r.get("slo", {}).get(metric):
                ax.axvline(r["slo"][metric], color="grey", linestyle="--", linewidth=0.8, label="SLO")
            ax.set_xlabel(f"{label} (ms)")
            ax.set_ylabel("fraction of requests")
            ax.set_title(f"{label} CDF")
            ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(_save(fig, out_dir / "cdf.png", plt))
        fig, ax = plt.subplots(figsize=(10, 3.8))
        for name, r in runs:
            recs = records_of(r)
            ok = [x for x in recs if x.ok]
            ax.scatter([x.scheduled for x in ok], [(x.ttft or 0.0) * 1000 for x in ok], s=6, label=f"{name} TTFT")
            bad = [x for x in recs if not x.ok]
            if bad:
                ax.scatter(
                    [x.scheduled for x in bad], [0] * len(bad), marker="x", color="red", s=18, label=f"{name} failed"
                )
        ax.set_xlabel("scheduled send time (s from start)")
        ax.set_ylabel("TTFT (ms)")
        ax.set_title("per-request timeline")
        ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(_save(fig, out_dir / "timeline.png", plt))
    curves = {
        name: [(p["rate"], p["slo_attainment"], p["p99_ttft_ms"], p["p99_tpot_ms"]) for p in s["points"]]
        for name, s in sweeps
    }
    by_rate = [
        (r["request_rate"], r.get("slo_attainment"), r["p99_ttft_ms"], r["p99_tpot_ms"])
        for _, r in runs
        if isinstance(r.get("request_rate"), (int, float))
    ]
    if len(by_rate) > 1:
        curves["runs"] = by_rate
    if curves:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
        for name, pts in curves.items():
            pts = sorted(pts)
            axes[0].plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=f"{name} P99 TTFT")
            axes[0].plot([p[0] for p in pts], [p[3] for p in pts], marker="s", label=f"{name} P99 TPOT")
            if all(p[1] is not None for p in pts):
                axes[1].plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o", label=name)
        axes[0].set_xlabel("request rate (req/s)")
        axes[0].set_ylabel("ms")
        axes[0].set_yscale("log")
        axes[0].legend(fontsize=7)
        axes[1].set_xlabel("request rate (req/s)")
        axes[1].set_ylabel("SLO attainment (%)")
        axes[1].set_ylim(0, 105)
        axes[1].legend(fontsize=7)
        fig.tight_layout()
        written.append(_save(fig, out_dir / "vs_rate.png", plt))
    return written


def _save(fig, path: Path, plt) -> Path:
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
