"""``distbench``: load generator for OpenAI-compatible LLM servers, built for P99/P99.9.

    distbench run --url http://127.0.0.1:8080 --request-rate 12 --num-prompts 200 --slo ttft:250ms,tpot:50ms \\
        --save-result r.json
    distbench run --url http://127.0.0.1:8080 --concurrency 100 --prompt-len 128 --output-len 64 --duration 300
    distbench sweep --url URL --slo ttft:250ms,tpot:50ms --out-dir sweep/
    distbench compare A1.json A2.json A3.json vs B1.json B2.json B3.json
    distbench repeat 3 --variant A='--url U --request-rate 8' --variant B='--url V --request-rate 8'
    distbench plot A.json B.json --out-dir plots/
    distbench merge part1.json part2.json -o all.json

Exit status: 0 pass, 1 SLO missed or requests failed, 2 bad arguments or unreachable URL,
130 interrupted (the partial result is still written).
"""

from __future__ import annotations

import argparse
import sys

from distserve.distbench import commands
from distserve.distbench.load_args import Formatter, add_load_args, options_from
from distserve.distbench.runner import UsageError

__all__ = ["add_load_args", "build_parser", "main", "options_from"]  # options_from: kept importable here

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def cmd_run(args) -> int:
    from distserve.distbench import result
    from distserve.distbench.runner import run
    from distserve.distbench.summary import format_summary

    res = run(options_from(args))
    if args.save_result:
        print(f"saved {result.save(res, args.save_result)}")
    print(format_summary(res))
    if res["interrupted"] == "stopped by signal":
        return EXIT_INTERRUPTED
    return EXIT_OK if res["verdict"]["pass"] else EXIT_FAIL


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="distbench", description=__doc__, formatter_class=Formatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser(
        "run",
        help="one load run against a server",
        formatter_class=Formatter,
        description="Closed loop (--concurrency) or open loop (--request-rate; TTFT from the "
        "scheduled send time). Example: distbench run --url http://127.0.0.1:8080 "
        "--request-rate 8 --num-prompts 200 --slo ttft:250ms,tpot:50ms",
    )
    add_load_args(r)
    r.set_defaults(handler=cmd_run)
    commands.add_parsers(sub, Formatter, add_load_args)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except UsageError as e:
        print(f"distbench: error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
