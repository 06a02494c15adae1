"""Tables and a plot from ``bench/serving/gpu_slo_study.py`` results: SLO attainment vs rate and vs SLO scale.

Every figure comes from the per-request records (distbench's warm-up excluded, then the first ``ramp``
measured requests dropped): a request meets the SLO at scale s when TTFT <= s x base TTFT and TPOT <= s x
base TPOT (both bounds scaled together, DistServe's Figure-8 form); a failed request never meets it.
Goodput at a scale = the highest measured rate with attainment >= 90 % (``--target``) below the lowest
rate that misses; per GPU = / the layout's GPUs (one per worker: 1p1d and colocated2 have 2, 2p2d and
colocated4 have 4). Ratios: each disaggregated layout over the colocated layout of the same GPU count.
Later files override earlier ones point by point (same layout, workload and rate): give the first run,
then reruns.

``python -m bench.serving.gpu_slo_study_report bench/results/serving-slo-study/slo_study_{1p1d,colocated2}.json.gz
--plot docs/img/slo_study_two-gpu.png`` (the recorded two-GPU runs: restore bench/results as bench/README.md says;
the flash runs' records are kept in ``bench/records/h200-x2/serving-slo-study/``)
"""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

from bench.lib.results import read_result

# Tight base SLOs (ms): TTFT, TPOT. TPOT 15 ms is ~3x a batch-1 decode step of the 7B preset on an H200.
BASE = {"long": (200.0, 15.0), "summ": (200.0, 15.0), "sharegpt": (100.0, 15.0)}
SCALES = (0.5, 0.75, 1.0, 1.5, 2.0, 3.0)


def layout_gpus(layout: str) -> int:
    """GPUs of ``NpMd`` (N + M) or ``colocatedN`` (N): one per worker, as bench/serving/gpu_slo_study.py places them."""
    m = re.fullmatch(r"(\d+)p(\d+)d|colocated(\d+)", layout)
    if m is None:
        raise ValueError(f"unknown layout {layout!r}")
    return int(m.group(3)) if m.group(3) else int(m.group(1)) + int(m.group(2))


def layouts_of(pts: dict) -> list[str]:
    """Layouts present, disaggregated ones first (by GPU count, then name), colocated ones last."""
    names = {lay for (lay, _, _) in pts}
    return sorted(names, key=lambda n: (n.startswith("colocated"), layout_gpus(n), n))


def ratio_pairs(layouts: list[str]) -> list[tuple[str, str]]:
    """(disaggregated, colocated) pairs of the same GPU count."""
    col = {layout_gpus(n): n for n in layouts if n.startswith("colocated")}
    return [(n, col[layout_gpus(n)]) for n in layouts if not n.startswith("colocated") and layout_gpus(n) in col]


def load(paths: list[str]) -> dict:
    """{(layout, workload, rate): {"records": [...], "source": file, ...}}, later files win."""
    pts: dict = {}
    for p in paths:
        doc = read_result(p)  # .json.gz as the study writes it, .json.xz as bench/records keeps it
        for pt in doc["points"]:
            recs = sorted((r for r in pt["result"]["requests"] if not r.get("warmup")), key=lambda r: r["index"])
            recs = recs[pt.get("ramp", 0) :]
            pts[(doc["layout"], pt["workload"], pt["rate"])] = {"records": recs, "source": Path(p).name}
    return pts


def meets(r: dict, ttft_ms: float, tpot_ms: float) -> bool:
    if r.get("error") or r.get("ttft") is None:
        return False
    return r["ttft"] * 1000 <= ttft_ms and (r.get("tpot") is None or r["tpot"] * 1000 <= tpot_ms)


def attain(recs: list[dict], wl: str, scale: float) -> float:
    t, p = BASE[wl]
    return sum(meets(r, scale * t, scale * p) for r in recs) / max(len(recs), 1)


def pct(recs: list[dict], key: str, q: float) -> float:
    """Nearest rank; a failed request counts as infinitely slow."""
    vals = sorted(math.inf if r.get("error") or r.get(key) is None else r[key] * 1000 for r in recs)
    return vals[max(0, math.ceil(q / 100 * len(vals)) - 1)] if vals else math.nan


def goodput(pts: dict, layout: str, wl: str, scale: float, target: float) -> float:
    rates = sorted(r for (lay, w, r) in pts if lay == layout and w == wl)
    best = 0.0
    for r in rates:  # the highest rate below the first one that misses (a later pass is noise, not capacity)
        if attain(pts[(layout, wl, r)]["records"], wl, scale) < target:
            break
        best = r
    return best


def report(pts: dict, target: float) -> str:
    lines = []
    for wl in BASE:
        t, p = BASE[wl]
        lines.append(f"\n### {wl} (base SLO: TTFT <= {t:g} ms, TPOT <= {p:g} ms)\n")
        lines.append(
            "| layout | rate (req/s) | n | TTFT P90 / P99 ms | TPOT P90 / P99 ms | "
            + " | ".join(f"attain @{s:g}x" for s in SCALES)
            + " | run |"
        )
        lines.append("|---|---:|---:|---:|---:|" + "---:|" * len(SCALES) + "---|")
        layouts = layouts_of(pts)
        for lay in layouts:
            for (la, w, rate), pt in sorted(pts.items()):
                if la != lay or w != wl:
                    continue
                rs = pt["records"]
                lines.append(
                    f"| {lay} | {rate:g} | {len(rs)} | {pct(rs, 'ttft', 90):.0f} / {pct(rs, 'ttft', 99):.0f} | "
                    f"{pct(rs, 'tpot', 90):.1f} / {pct(rs, 'tpot', 99):.1f} | "
                    + " | ".join(f"{100 * attain(rs, wl, s):.0f}%" for s in SCALES)
                    + f" | {pt['source'].replace('slo_study_', '').replace('.json.gz', '')} |"
                )
        lines.append(
            "\nGoodput per GPU (highest measured rate with >= "
            f"{100 * target:g}% attainment below the first miss, / the layout's GPUs); ratios disaggregated / "
            "colocated:\n"
        )
        lines.append("| SLO scale | " + " | ".join(f"{s:g}x" for s in SCALES) + " |")
        lines.append("|---|" + "---:|" * len(SCALES))
        g = {lay: [goodput(pts, lay, wl, s, target) / layout_gpus(lay) for s in SCALES] for lay in layouts}
        for lay in layouts:
            lines.append(f"| {lay} | " + " | ".join(f"{x:g}" for x in g[lay]) + " |")
        for dis, col in ratio_pairs(layouts):
            lines.append(
                f"| ratio {dis} / {col} | "
                + " | ".join(f"{a / b:.2f}" if b else ("–" if not a else "∞") for a, b in zip(g[dis], g[col]))
                + " |"
            )
    return "\n".join(lines)


def plot(pts: dict, path: str, target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for col, wl in enumerate(BASE):
        styles = ("o-", "^-", "v-", "D-", "x-")
        for i, lay in enumerate(layouts_of(pts)):
            style = "s--" if lay.startswith("colocated") else styles[i % len(styles)]
            rates = sorted(r for (la, w, r) in pts if la == lay and w == wl)
            for scale, alpha in ((1.0, 1.0), (2.0, 0.5)):
                ys = [100 * attain(pts[(lay, wl, r)]["records"], wl, scale) for r in rates]
                axes[0, col].plot(rates, ys, style, alpha=alpha, label=f"{lay}, SLO x{scale:g}")
            mid = rates[len(rates) // 2] if rates else None
            if mid is not None:
                ys = [100 * attain(pts[(lay, wl, mid)]["records"], wl, s) for s in SCALES]
                axes[1, col].plot(SCALES, ys, style, label=f"{lay} @ {mid:g} req/s")
        t, p = BASE[wl]
        axes[0, col].set_title(f"{wl}: attainment vs rate (base TTFT {t:g} / TPOT {p:g} ms)")
        axes[0, col].set_xlabel("request rate (req/s, all GPUs of the layout)")
        axes[1, col].set_title(f"{wl}: attainment vs SLO scale")
        axes[1, col].set_xlabel("SLO scale (TTFT and TPOT bounds x)")
        for ax in axes[:, col]:
            ax.axhline(100 * target, color="grey", lw=0.8)
            ax.set_ylabel("SLO attainment (%)")
            ax.set_ylim(0, 102)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--target", type=float, default=0.9)
    ap.add_argument("--plot", default=None, help="PNG path (needs matplotlib)")
    args = ap.parse_args()
    pts = load(args.files)
    print(report(pts, args.target))
    if args.plot:
        plot(pts, args.plot, args.target)


if __name__ == "__main__":
    main()
