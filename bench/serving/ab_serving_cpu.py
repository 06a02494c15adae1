"""Before/after on CPU: the same serving benchmarks on two commits, interleaved in one run.

    .venv/bin/python -m bench.serving.ab_serving_cpu --before 3699813 [--after HEAD] [--rounds 3] --out FILE

Each commit is checked out into a temporary git worktree; every round runs, for each commit in turn
(order alternating between rounds, so a drift of the shared machine hits both alike):
- ``bench/serving/serving_cpu.py`` of that commit: the router's added TTFT, one request at a time;
- a closed loop through ``distserve serve --mode disaggregated`` of that commit on the tiny model,
  driven by this tree's distbench (concurrency 8, 128-token prompts, 32 output tokens): req/s and
  TTFT/TPOT percentiles.
The server processes import the commit's own code (``-m distserve.server.cli`` from its worktree). Medians
over rounds are what to quote; the spread across rounds is the noise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.lib.server import ServeProcess
from distserve.distbench.atomic import atomic_write

ROOT = Path(__file__).resolve().parents[2]

TOKEN = "ab-bench-token"


def worktree(ref: str, into: Path) -> Path:
    path = into / ref.replace("/", "_")
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(path), ref], check=True)
    return path


def router_overhead(tree: Path, n: int, tmp: Path) -> dict[str, dict[str, float]]:
    out = tmp / "overhead.json"
    # the suite's layout (bench/serving/, run as a module) or a commit from before it (bench/serving_cpu.py)
    script = (
        ["-m", "bench.serving.serving_cpu"]
        if (tree / "bench/serving/serving_cpu.py").exists()
        else ["bench/serving_cpu.py"]
    )
    subprocess.run(
        [sys.executable, *script, "--requests", str(n), "--out", str(out)],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return {
        r["mode"]: {"added_p50_ms": r["added_ms"]["p50"], "router_p50_ms": r["router_ttft_ms"]["p50"]}
        for r in json.loads(out.read_text())
    }


def closed_loop(tree: Path, n: int, tmp: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    with ServeProcess(tmp / "serve", mode="disaggregated", token=TOKEN, cwd=tree, env=env) as srv:
        res = tmp / "closed.json"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "distserve.distbench.cli",
                "run",
                "--url",
                srv.url,
                "--concurrency",
                "8",
                "--num-prompts",
                str(n),
                "--warmup",
                "8",
                "--prompt-len",
                "128",
                "--output-len",
                "32",
                "--save-result",
                str(res),
                "--no-progress",
            ],
            cwd=ROOT,
            check=True,
            stdout=subprocess.DEVNULL,
        )
    s = json.loads(res.read_text())  # vLLM's key names at the top level
    return {
        "req_s": s["request_throughput"],
        "ttft_p50_ms": s["median_ttft_ms"],
        "ttft_p99_ms": s["p99_ttft_ms"],
        "tpot_p50_ms": s["median_tpot_ms"],
        "failed": s["failed"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="git ref of the 'before' tree")
    ap.add_argument("--after", default="HEAD", help="git ref of the 'after' tree")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=40, help="one-at-a-time requests for the router overhead")
    ap.add_argument("--closed-requests", type=int, default=160)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.rounds < 1:
        print("ab_serving_cpu: --rounds must be >= 1", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="ab-serving-") as tmpd:
        tmp = Path(tmpd)
        trees = {"before": worktree(args.before, tmp), "after": worktree(args.after, tmp)}
        runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
        try:
            for rnd in range(args.rounds):
                order = ["before", "after"] if rnd % 2 == 0 else ["after", "before"]
                for name in order:
                    work = tmp / f"{name}-{rnd}"
                    work.mkdir()
                    r = {
                        "round": rnd,
                        "overhead": router_overhead(trees[name], args.requests, work),
                        "closed": closed_loop(trees[name], args.closed_requests, work),
                    }
                    runs[name].append(r)
                    print(name, rnd, json.dumps(r), flush=True)
        finally:
            for path in trees.values():
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)], check=False)

    def med(name: str, *keys: str) -> float:
        vals: list[float] = []
        for r in runs[name]:
            v: Any = r  # a run's JSON, walked down by keys to a figure
            for k in keys:
                v = v[k]
            vals.append(v)
        return statistics.median(vals)

    rows = [
        ("colocated router added TTFT P50 (ms)", ("overhead", "colocated", "added_p50_ms")),
        ("disaggregated router added TTFT P50 (ms)", ("overhead", "disaggregated", "added_p50_ms")),
        ("disaggregated router TTFT P50, one at a time (ms)", ("overhead", "disaggregated", "router_p50_ms")),
        ("closed loop c=8 req/s", ("closed", "req_s")),
        ("closed loop TTFT P50 (ms)", ("closed", "ttft_p50_ms")),
        ("closed loop TTFT P99 (ms)", ("closed", "ttft_p99_ms")),
        ("closed loop TPOT P50 (ms)", ("closed", "tpot_p50_ms")),
    ]
    summary = {label: {"before": med("before", *keys), "after": med("after", *keys)} for label, keys in rows}
    for label, v in summary.items():
        print(f"{label:<52}{v['before']:>10.2f}{v['after']:>10.2f}")
    atomic_write(
        args.out,
        json.dumps(
            {
                "before": args.before,
                "after": args.after,
                "rounds": args.rounds,
                "summary_medians": summary,
                "runs": runs,
            },
            indent=1,
        ),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
