"""The ``distserve`` command line: one parser, one dispatch (``args.handler``).

Every subcommand validates its arguments up front and exits with status 2 and one sentence on bad input
(argparse's convention), before loading a model. The subcommands live in ``server/commands/``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from distserve.server.commands import cluster, harness, planner, serve, tools
from distserve.server.commands.common import LOG_LEVEL_ENV, Parser, unrecognized

__all__ = ["LOG_LEVEL_ENV", "build_parser", "main"]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("distserve")
    except PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="distserve",
        description="LLM serving with prefill/decode disaggregation. Exit status: 0 ok, 1 failure, 2 bad "
        "input (one sentence on stderr); a worker also exits 3 when the router refuses to register "
        "it (wrong token or a different model). Example: distserve serve --model smollm2-135m-instruct",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument(
        "--log-level",
        type=str.upper,
        default=None,
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="log level of this process and the processes it starts (default: INFO for serve, "
        "router and worker, WARNING otherwise; env DISTSERVE_LOG_LEVEL)",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    tools.add_parsers(sub)
    serve.add_parsers(sub)
    harness.add_parsers(sub)
    planner.add_parsers(sub)
    cluster.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "sla":  # `distserve sla --help` and options go to sla's own parser
        args.sla_args = extra + args.sla_args
    elif extra:
        unrecognized(parser, args.command, extra)
    level = (
        args.log_level
        or os.environ.get(LOG_LEVEL_ENV)
        or ("INFO" if args.command in ("serve", "router", "worker") else "WARNING")
    )
    os.environ[LOG_LEVEL_ENV] = level  # the children `serve` starts inherit it
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
