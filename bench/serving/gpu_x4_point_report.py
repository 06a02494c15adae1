"""One-rate table of the four-GPU layouts (issue 19): attainment at several SLO scales and latency percentiles.

    python -m bench.serving.gpu_x4_point_report bench/records/h200-x4/serving-slo-study/x4_*.json.xz

Same records, same rules as ``bench/serving/gpu_slo_study_report.py`` (ramp dropped, failures count as misses).
"""

from __future__ import annotations

import sys

from bench.serving.gpu_slo_study_report import attain, load, meets, pct

ORDER = ("2p2d", "3p1d", "1p3d", "colocated4")


def main() -> None:
    pts = load(sys.argv[1:])
    print(
        "| layout | rate (req/s) | requests | TTFT P50 / P90 / P99 (ms) | TPOT P50 / P90 / P99 (ms) "
        "| attainment, TTFT 200 ms + TPOT 15 ms ×1 / ×1.5 / ×2 | attainment, TTFT 200 ms + TPOT 50 ms |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for (layout, wl, rate), p in sorted(pts.items(), key=lambda kv: ORDER.index(kv[0][0])):
        r = p["records"]
        t = " / ".join(f"{pct(r, 'ttft', q):.0f}" for q in (50, 90, 99))
        o = " / ".join(f"{pct(r, 'tpot', q):.1f}" for q in (50, 90, 99))
        a = " / ".join(f"{100 * attain(r, wl, s):.0f} %" for s in (1.0, 1.5, 2.0))
        b = 100 * sum(meets(x, 200.0, 50.0) for x in r) / max(len(r), 1)
        print(f"| {layout} | {rate:g} | {len(r)} | {t} | {o} | {a} | {b:.0f} % |")


if __name__ == "__main__":
    main()
