"""Cache-aware vs least-load routing on multi-turn chat, CPU, tiny model (issue 34).

    .venv/bin/python -m bench.serving.cache_routing_cpu [--sessions 12] [--turns 4] [--rounds 1] --out FILE

``distserve serve --prefill 2 --decode 1`` is started once per variant and round: ``router.prefix_cache_weight``
2.0 (cache-aware, the default) and 0 (least load only). distbench drives multi-turn sessions (``--turns``:
each turn re-sends the conversation so far, ``--prefix-len``: a shared system prompt) in a closed loop; the
prefill workers' ``distserve_prefix_cache_hit_tokens`` / ``..._queried_tokens`` (scraped before and after)
give the prefix hit rate, distbench the TTFT percentiles. Variants alternate order between rounds, so a
drift of the shared machine hits both alike; quote medians over rounds and the ratio of the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

from bench.lib.results import write_result
from bench.lib.server import ServeProcess

ROOT = Path(__file__).resolve().parents[2]

TOKEN = "cache-routing-bench-token"
VARIANTS = {"cache_aware": 2.0, "least_load": 0.0}


def prefix_counters(srv: ServeProcess) -> tuple[float, float]:
    """(hit tokens, queried tokens) summed over the healthy prefill workers."""
    hit = queried = 0.0
    for w in srv.workers():
        if w["role"] != "prefill" or not w["healthy"]:
            continue
        req = urllib.request.Request(f"{w['url']}/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("distserve_prefix_cache_hit_tokens"):
                    hit += float(line.split()[-1])
                elif line.startswith("distserve_prefix_cache_queried_tokens"):
                    queried += float(line.split()[-1])
    return hit, queried


def one(weight: float, args: argparse.Namespace, tmp: Path) -> dict:
    cfg = {"router": {"prefix_cache_weight": weight}}
    with ServeProcess(tmp / "serve", prefill=2, decode=1, token=TOKEN, config=cfg) as srv:
        h0, q0 = prefix_counters(srv)
        res = tmp / "run.json"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "distserve.distbench.cli",
                "run",
                "--url",
                srv.url,
                "--concurrency",
                str(args.concurrency),
                "--num-prompts",
                str(args.sessions * args.turns),
                "--turns",
                str(args.turns),
                "--prefix-len",
                str(args.prefix_len),
                "--prompt-len",
                str(args.prompt_len),
                "--output-len",
                str(args.output_len),
                "--save-result",
                str(res),
                "--no-progress",
            ],
            cwd=ROOT,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        h1, q1 = prefix_counters(srv)
    s = json.loads(res.read_text())
    return {
        "prefix_hit_rate": (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0,
        "ttft_p50_ms": s["median_ttft_ms"],
        "ttft_p99_ms": s["p99_ttft_ms"],
        "completed": s["completed"],
        "failed": s["failed"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=12)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--prefix-len", type=int, default=64)
    ap.add_argument("--prompt-len", default="96")
    ap.add_argument("--output-len", default="16")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.rounds < 1 or args.sessions < 1 or args.turns < 2:
        print("cache_routing_cpu: --rounds and --sessions must be >= 1, --turns >= 2", file=sys.stderr)
        return 2
    runs: dict[str, list[dict]] = {k: [] for k in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="cache-routing-") as tmpd:
        for rnd in range(args.rounds):
            order = list(VARIANTS) if rnd % 2 == 0 else list(reversed(VARIANTS))
            for name in order:
                work = Path(tmpd) / f"{name}-{rnd}"
                work.mkdir()
                r = one(VARIANTS[name], args, work)
                runs[name].append(r)
                print(name, rnd, json.dumps(r), flush=True)
    summary = {
        name: {k: statistics.median(r[k] for r in rs) for k in ("prefix_hit_rate", "ttft_p50_ms", "ttft_p99_ms")}
        for name, rs in runs.items()
    }
    for name, v in summary.items():
        print(
            f"{name:<12} hit rate {v['prefix_hit_rate']:.3f}  TTFT P50 {v['ttft_p50_ms']:.1f} ms  "
            f"P99 {v['ttft_p99_ms']:.1f} ms"
        )
    write_result(args.out, {"args": vars(args), "runs": runs, "median": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
