"""``distbench``: load generator for OpenAI-compatible LLM servers.

    distbench run --url http://127.0.0.1:8080 --concurrency 100 --prompt-len 128 --output-len 64 --duration 300
    distbench run --url URL --request-rate 12 --num-prompts 200 --slo ttft:250ms,tpot:50ms --save-result r.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

from distbench.loadgen import LoadSpec, run_load
from distbench.metrics import parse_slo, summarize


def _percentiles(text: str) -> list[float]:
    try:
        qs = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--percentiles must be numbers like 50,99,99.9, got {text!r}") from None
    if any(not 0 < q < 100 for q in qs):
        raise argparse.ArgumentTypeError("--percentiles must be in (0, 100)")
    return qs


def print_summary(s: dict, percentiles: list[float]) -> None:
    print(f"completed {s['completed']}, failed {s['failed']}, {s['duration']:.1f} s, "
          f"{s['request_throughput']:.2f} req/s, {s['output_throughput']:.0f} output tok/s")
    keys = [f"p{q:g}".replace(".", "_") if q != int(q) else f"p{int(q)}" for q in percentiles]
    print(f"{'ms':<6}{'mean':>9}{'std':>9}" + "".join(f"{k.upper():>9}" for k in keys))
    for m in ("ttft", "tpot", "itl", "e2e"):
        print(f"{m.upper():<6}{s[f'mean_{m}_ms']:>9.2f}{s[f'std_{m}_ms']:>9.2f}"
              + "".join(f"{s[f'{k}_{m}_ms']:>9.2f}" for k in keys))
    if "slo_attainment" in s:
        print(f"SLO {s['slo']} attainment: {100 * s['slo_attainment']:.1f}%")


def cmd_run(args) -> int:
    try:
        spec = LoadSpec(url=args.url.rstrip("/"), num_prompts=args.num_prompts, prompt_len=args.prompt_len,
                        output_len=args.output_len, concurrency=args.concurrency, request_rate=args.request_rate,
                        burstiness=args.burstiness, duration_s=args.duration, seed=args.seed, model=args.model)
        slo = parse_slo(args.slo)
    except ValueError as e:
        print(f"distbench: error: {e}", file=sys.stderr)
        return 2
    records, wall = asyncio.run(run_load(spec))
    summary = summarize(records, wall, args.percentiles, slo)
    print_summary(summary, args.percentiles)
    if args.save_result:
        result = {"spec": spec.__dict__, "percentiles": args.percentiles, **summary,
                  "requests": [r.to_dict() for r in records]}
        path = Path(args.save_result)
        tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
        tmp.write_text(json.dumps(result, indent=1))
        os.replace(tmp, path)  # never a half-written report
        print(f"saved {path}")
    return 0 if summary["failed"] == 0 else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="distbench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="one load run against a server",
                       description="Closed loop (--concurrency) or open loop (--request-rate). "
                                   "Example: distbench run --url http://127.0.0.1:8080 --concurrency 8 "
                                   "--num-prompts 64")
    r.add_argument("--url", required=True)
    mode = r.add_mutually_exclusive_group(required=True)
    mode.add_argument("--concurrency", type=int)
    mode.add_argument("--request-rate", type=float)
    r.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals; 1 = Poisson")
    r.add_argument("--num-prompts", type=int, default=None, help="default: 1000 with --duration, else 100")
    r.add_argument("--duration", type=float, default=None, help="stop sending after this many seconds")
    r.add_argument("--prompt-len", type=int, default=128)
    r.add_argument("--output-len", type=int, default=64)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--model", default=None)
    r.add_argument("--slo", default=None, help="e.g. ttft:250ms,tpot:50ms")
    r.add_argument("--percentiles", type=_percentiles, default=[50.0, 90.0, 95.0, 99.0, 99.9])
    r.add_argument("--save-result", default=None)
    r.set_defaults(handler=cmd_run)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "num_prompts", 0) is None:
        args.num_prompts = 100000 if args.duration else 100
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
