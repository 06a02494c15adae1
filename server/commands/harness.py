"""``distserve sla | chaos | doctor | gate``: the one edge from the server's CLI into the harness packages.

Each handler imports ``sla``/``chaos``/``ci`` *inside* the handler, so the serving code never loads the
harness (docs/ARCHITECTURE.md, dependency rule); ``chaos/cli.py``, which only declares argparse options,
is imported while the parser is built.
"""

from __future__ import annotations

import argparse


def _add_sla(sub) -> None:
    p = sub.add_parser(
        "sla",
        add_help=False,
        help="SLA audits and compliance reports (distserve sla audit --help)",
        description="Example: distserve sla audit --spec configs/sla/default.yaml --results run.json --out report/",
    )
    p.add_argument("sla_args", nargs=argparse.REMAINDER)
    p.set_defaults(handler=cmd_sla)


def cmd_sla(args) -> int:
    # The one place `server` reaches into the harness: imported only when the command runs, so the
    # server never loads the harness packages (docs/ARCHITECTURE.md, dependency rule).
    from distserve.sla.cli import main as sla_main

    return sla_main(args.sla_args)


def _add_chaos_doctor_gate(sub) -> None:
    """`chaos`, `doctor`, `gate`: the one edge from the server's CLI into the harness packages. The
    parsers are small and declared here; each handler imports chaos/ci lazily, so serving never loads
    them (see docs/ARCHITECTURE.md, dependency rule)."""

    def lazy(module: str, attr: str = "main"):
        def handler(args) -> int:
            import importlib

            return getattr(importlib.import_module(module), attr)(args)

        return handler

    from distserve.chaos.cli import (
        add_parser as add_chaos,  # argparse only: chaos/cli.py imports nothing else at load
    )

    add_chaos(sub)
    p = sub.add_parser(
        "doctor",
        help="compare this host with the recommended baseline",
        description="Checks the KV-link sysctls (net.core.rmem_max/wmem_max, net.ipv4.tcp_rmem/"
        "tcp_wmem), memory limits, prefill.max_seq_len against the model's context "
        "length and, given a router, the workers' registration; prints what drifted "
        "and the command that fixes it. Exit 1 on drift. Example: distserve doctor "
        "--router http://127.0.0.1:8080",
    )
    p.add_argument("--config", default=None, help="YAML config (default: built-in defaults)")
    p.add_argument("--router", default=None, help="router URL: also check the workers' registration")
    p.add_argument(
        "--model",
        default=None,
        help="the model --config serves (default: the config's model, else the built-in tiny model); with "
        "--router and no --model, the served model is checked instead",
    )
    p.add_argument("--netns", default=None, help="check the sysctls inside this network namespace")
    p.add_argument("--only", default=None, help="comma-separated subset of sysctl,memory,model,router (default: all)")
    p.add_argument("--sysctl-keys", default=None, help="check only these sysctl keys (comma-separated)")
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    p.set_defaults(handler=lazy("distserve.chaos.doctor"))
    p = sub.add_parser(
        "gate",
        help="run the release-gate checklist and say go / no-go",
        description="Runs ci/release_gate.yaml (tests, NaN lengths, TTFT P99 under load, drills, "
        "SLA audit) with a live checklist; writes gate.md and gate.json. Exit 1 on "
        "no-go. Example: distserve gate --quick --out .out/gate",
    )
    p.add_argument("--checklist", default="ci/release_gate.yaml", help="default: ci/release_gate.yaml")
    p.add_argument("--quick", action="store_true", help="only the items marked quick, in their short form")
    p.add_argument("--out", default=".out/gate", help="report directory (default .out/gate)")
    p.add_argument("--only", default=None, help="comma-separated item ids to run")
    p.set_defaults(handler=lazy("distserve.ci.gate"))


def add_parsers(sub) -> None:
    _add_sla(sub)
    _add_chaos_doctor_gate(sub)
