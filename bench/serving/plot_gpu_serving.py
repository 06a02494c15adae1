"""SLO attainment vs request rate from bench/serving/gpu_serving.py results (PNG per layout and workload).

    .venv/bin/python -m bench.serving.plot_gpu_serving bench/results/serving-gpu/gpu_serving_two-gpu.json \
        bench/results/serving-gpu/gpu_serving_two-gpu_long.json --out-dir docs/img
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after the backend is chosen


def attainment(point: dict) -> float:
    s = point["summary"]
    for key in ("attainment", "slo_attainment", "attain"):
        if key in s:
            return 100 * s[key]
        if key in point:
            return 100 * point[key]
    raise KeyError(f"no attainment field in {list(s)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+")
    ap.add_argument("--out-dir", default="docs/img")
    args = ap.parse_args()
    curves: dict[tuple[str, str], dict[str, list]] = {}
    for path in args.results:
        d = json.loads(Path(path).read_text())
        for mode, m in d["modes"].items():
            for wl, points in m.get("sweeps", {}).items():
                pts = sorted((p["rate"], attainment(p)) for p in points)
                curves.setdefault((d["layout"], wl), {})[mode] = pts
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for (layout, wl), modes in curves.items():
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for mode, pts in modes.items():
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
        ax.axhline(90, color="grey", linestyle="--", linewidth=0.8, label="90% target")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("SLO attainment (%)")
        ax.set_ylim(0, 105)
        ax.set_title(f"{layout}, {wl} prompts")
        ax.legend(fontsize=8)
        fig.tight_layout()
        name = out / f"slo_attainment_{layout}_{wl}.png"
        fig.savefig(name, dpi=110)
        print(name)


if __name__ == "__main__":
    main()
