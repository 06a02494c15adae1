"""``distbench compare A1.json [A2.json ...] vs B1.json [B2.json ...]``: is B different from A?

The seed's table — mean, P95, P99, std of TTFT, TPOT and E2E for A and B and the change in % — with a
test that covers the variance a person bets a release on.

- **Several runs per side** (the honest form): each run's statistic (its mean, its P99, ...) is one
  observation; it already carries that run's within-run noise, and its spread across runs carries the
  run-to-run variance (server state, caches, neighbours on the machine). The 95 % interval of B − A is
  Welch's t interval on those per-run values (the two-stage "summary statistics" form of a mixed model;
  exact for balanced normal data, conservative with few runs). ``significant`` when it excludes 0.
  The A and B columns are the mean over runs of the per-run statistic.
- **One run per side**: only the bootstrap over that run's requests is possible (1000 resamples of the
  per-request samples). It sees within-run variance only: two runs of the identical command minutes apart
  can differ far more than it allows (93 % on a P99 was seen). The verdict is then ``not established``,
  whatever the interval says; the interval is printed for what it is.

Both sides' settings are compared (the seed excepted, which should differ): a difference is named, so a
"regression" that is a changed rate or prompt length is seen for what it is.
"""

from __future__ import annotations

import math

import numpy as np

from distserve.distbench.result import records_of
from distserve.distbench.table import render

STATS = ("mean", "p95", "p99", "std")
METRICS = (("TTFT", "ttft"), ("TPOT", "tpot"), ("E2E", "e2e"))
# settings that are expected to differ between repeats, or that describe the run rather than set it
IGNORED_SETTINGS = {"seed", "workload.seed", "server", "vocab_size"}
# Student's t, 0.975 quantile, df 1..30 (two-sided 95 %)
_T975: tuple[float, ...] = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179)
_T975 += (2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052)
_T975 += (2.048, 2.045, 2.042)


def t975(df: float) -> float:
    """The two-sided 95 % quantile of Student's t; df rounded down (conservative)."""
    d = max(1, int(math.floor(df)))
    return _T975[d - 1] if d <= 30 else 1.96 + 2.5 / d


def _stat(x: np.ndarray, name: str, axis=None):
    if name == "mean":
        return x.mean(axis=axis)
    if name == "std":
        return x.std(axis=axis)
    return np.percentile(x, float(name[1:]), axis=axis, method="inverted_cdf")  # nearest rank, as the HDR figures


def samples(result: dict, metric: str) -> np.ndarray:
    vals = [getattr(r, metric) for r in records_of(result) if r.ok]
    return np.array([v for v in vals if v is not None], dtype=float) * 1000.0


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if key in IGNORED_SETTINGS:
            continue
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def setting_differences(a: list[dict], b: list[dict]) -> dict[str, list[str]]:
    """{"between": ["request_rate: 8 (A) vs 16 (B)", ...], "within_a": [...], "within_b": [...]}."""
    fa = [_flat(r.get("config") or {}) for r in a]
    fb = [_flat(r.get("config") or {}) for r in b]
    keys = sorted({k for f in fa + fb for k in f})

    def vals(fs: list[dict], k: str) -> list:
        return sorted({repr(f.get(k)) for f in fs})

    out: dict[str, list[str]] = {"between": [], "within_a": [], "within_b": []}
    for k in keys:
        va, vb = vals(fa, k), vals(fb, k)
        if va != vb:
            out["between"].append(f"{k}: {' / '.join(va)} (A) vs {' / '.join(vb)} (B)")
        for side, v in (("within_a", va), ("within_b", vb)):
            if len(v) > 1:
                out[side].append(f"{k}: {' / '.join(v)}")
    return out


def _welch(xa: np.ndarray, xb: np.ndarray) -> tuple[float, float]:
    diff = float(xb.mean() - xa.mean())
    va, vb = xa.var(ddof=1) / len(xa), xb.var(ddof=1) / len(xb)
    se = math.sqrt(va + vb)
    if se == 0:
        return diff, diff
    df = (va + vb) ** 2 / ((va**2 / (len(xa) - 1) if va else 0.0) + (vb**2 / (len(xb) - 1) if vb else 0.0))
    h = t975(df) * se
    return diff - h, diff + h


def compare_sides(
    a_samples: list[dict[str, np.ndarray]],
    b_samples: list[dict[str, np.ndarray]],
    resamples: int = 1000,
    seed: int = 0,
) -> list[dict]:
    """Rows of the table from per-run samples ({"ttft": ms array, ...} per run) of each side."""
    rng = np.random.default_rng(seed)
    between = len(a_samples) >= 2 and len(b_samples) >= 2
    rows = []
    for label, metric in METRICS:
        ra = [s[metric] for s in a_samples if len(s.get(metric, ()))]
        rb = [s[metric] for s in b_samples if len(s.get(metric, ()))]
        if not ra or not rb or (between and (len(ra) < 2 or len(rb) < 2)):
            continue
        if not between:
            xa, xb = np.concatenate(ra), np.concatenate(rb)
            boot_a = xa[rng.integers(0, len(xa), size=(resamples, len(xa)))]
            boot_b = xb[rng.integers(0, len(xb), size=(resamples, len(xb)))]
        for stat in STATS:
            per_a = np.array([float(_stat(x, stat)) for x in ra])
            per_b = np.array([float(_stat(x, stat)) for x in rb])
            if between:
                va, vb = float(per_a.mean()), float(per_b.mean())
                lo, hi = _welch(per_a, per_b)
                verdict = "yes" if lo > 0 or hi < 0 else "no"
            else:
                va, vb = float(_stat(xa, stat)), float(_stat(xb, stat))
                diff = _stat(boot_b, stat, axis=1) - _stat(boot_a, stat, axis=1)
                lo, hi = (float(x) for x in np.percentile(diff, [2.5, 97.5]))
                verdict = "not established"
            rows.append(
                {
                    "metric": label,
                    "stat": stat,
                    "a": va,
                    "b": vb,
                    "a_runs": per_a.tolist(),
                    "b_runs": per_b.tolist(),
                    "change_pct": 100.0 * (vb - va) / va if va else float("nan"),
                    "ci95_ms": [lo, hi],
                    "ci_excludes_0": bool(lo > 0 or hi < 0),
                    "significant": verdict == "yes",
                    "verdict": verdict,
                }
            )
    return rows


def compare(a: list[dict] | dict, b: list[dict] | dict, resamples: int = 1000, seed: int = 0) -> dict:
    """A side is one result or a list of results (repeats of one configuration)."""
    a_runs = a if isinstance(a, list) else [a]
    b_runs = b if isinstance(b, list) else [b]
    per = (
        [{m: samples(r, m) for _, m in METRICS} for r in a_runs],
        [{m: samples(r, m) for _, m in METRICS} for r in b_runs],
    )
    between = len(a_runs) >= 2 and len(b_runs) >= 2
    return {
        "runs": [len(a_runs), len(b_runs)],
        "method": (
            "between runs: Welch's t interval on the per-run statistics (covers run-to-run variance)"
            if between
            else "within run only: bootstrap over one run's requests (run-to-run variance not covered)"
        ),
        "settings": setting_differences(a_runs, b_runs),
        "rows": compare_sides(per[0], per[1], resamples, seed),
    }


def format_report(rep: dict, name_a: str = "A", name_b: str = "B") -> str:
    ka, kb = rep["runs"]
    lines = [f"A = {name_a} ({ka} run{'s' * (ka != 1)}), B = {name_b} ({kb} run{'s' * (kb != 1)})"]
    s = rep["settings"]
    if s["between"]:
        lines.append("settings differ between A and B (so a change may be the settings, not the system):")
        lines += [f"  {d}" for d in s["between"]]
    else:
        lines.append("settings: identical on both sides (the seed aside)")
    for side, name in (("within_a", "A"), ("within_b", "B")):
        if s[side]:
            lines.append(f"{name}'s runs differ among themselves: " + "; ".join(s[side]))
    between = ka >= 2 and kb >= 2
    header = ["metric", "stat", "A", "B", "change", "95% CI of B-A (ms)", "significant"]
    if between:
        header.insert(4, "A runs spread")
        header.insert(5, "B runs spread")
    body = []
    for r in rep["rows"]:
        cells = [
            r["metric"],
            r["stat"],
            f"{r['a']:.2f}",
            f"{r['b']:.2f}",
            f"{r['change_pct']:+.1f}%",
            f"[{r['ci95_ms'][0]:+.2f}, {r['ci95_ms'][1]:+.2f}]",
            r["verdict"],
        ]
        if between:
            cells.insert(4, f"{min(r['a_runs']):.1f}..{max(r['a_runs']):.1f}")
            cells.insert(5, f"{min(r['b_runs']):.1f}..{max(r['b_runs']):.1f}")
        body.append(cells)
    lines.append(render(header, body, left=2))
    lines.append(f"method: {rep['method']}")
    if not between:
        lines.append(
            "one run on a side: the interval is a bootstrap over that run's requests and covers only "
            "within-run variance; two runs of the identical command can differ by far more, so no change is "
            "established. Give several runs per side: distbench compare A1 A2 A3 vs B1 B2 B3 "
            "(distbench repeat makes them, interleaved)."
        )
    return "\n".join(lines)


def split_sides(paths: list[str]) -> tuple[list[str], list[str]]:
    """'A1 A2 vs B1 B2' -> ([A1, A2], [B1, B2]); 'A B' -> ([A], [B])."""
    if "vs" in paths:
        i = paths.index("vs")
        a, b = paths[:i], paths[i + 1 :]
        if not a or not b or "vs" in b:
            raise ValueError("compare: give A1 [A2 ...] vs B1 [B2 ...], one 'vs' between two non-empty sides")
        return a, b
    if len(paths) == 2:
        return [paths[0]], [paths[1]]
    raise ValueError(f"compare: {len(paths)} files: put 'vs' between the two sides (A1 A2 vs B1 B2)")
