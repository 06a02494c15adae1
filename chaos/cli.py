"""`distserve chaos ...`: drills, single injections and their rollback, the NaN check.

Imported lazily by `server/cli.py` inside the handler (the server never imports
the harness at module level).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _kv(items: list[str]) -> dict:
    out = {}
    for it in items:
        k, sep, v = it.partition("=")
        if not sep or not k:
            raise ValueError(f"argument {it!r} is not key=value")
        try:
            out[k] = json.loads(v)
        except ValueError:
            out[k] = v
    return out


def add_parser(sub) -> None:
    p = sub.add_parser(
        "chaos",
        help="chaos drills, fault injection, NaN check",
        description="Chaos drills and fault injectors. Example: distserve chaos drill configs/drills/worker_kill.yaml",
    )
    cs = p.add_subparsers(dest="chaos_command", required=True)
    d = cs.add_parser(
        "drill",
        help="run one drill file",
        description="Steady state, faults under distbench load, invariants, rollback; writes "
        "journal.json and report.md. Exit 0 completed, 1 failed, 3 aborted, 130 "
        "interrupted. Example: distserve chaos drill configs/drills/worker_pause.yaml "
        "--out .out/drills/pause",
    )
    d.add_argument("file")
    d.add_argument("--out", default=None, help="directory for journal.json, report.md, logs (default: a temp dir)")
    d.add_argument(
        "--url",
        default=None,
        help="run against this router instead of starting the file's target "
        "(token from DISTSERVE_ADMIN_TOKEN; PID and namespace faults "
        "need the drill on the workers' host)",
    )
    i = cs.add_parser(
        "inject",
        help="run one injector's inject(key=value ...)",
        description="Example: distserve chaos inject pause router_url=http://127.0.0.1:8080 "
        "role=decode (token from DISTSERVE_ADMIN_TOKEN)",
    )
    i.add_argument("injector")
    i.add_argument("args", nargs="*", help="key=value (values parsed as JSON when they parse)")
    r = cs.add_parser(
        "rollback",
        help="run one injector's rollback(key=value ...), or every recorded one (--all)",
        description="Example: distserve chaos rollback pause role=decode; distserve chaos rollback --all "
        "(after a killed drill: restores every injection still recorded, reports what it restored, "
        "exits 1 when something recorded was not restored)",
    )
    r.add_argument("injector", nargs="?")
    r.add_argument("args", nargs="*")
    r.add_argument("--all", action="store_true", help="roll back every injection still recorded")
    n = cs.add_parser(
        "nan-check",
        help="logits finite at prompt lengths 2^k-1, 2^k, 2^k+1 on every backend",
        description="Runs the real prefill path of every available attention backend at prompt "
        "lengths around powers of two up to prefill.max_seq_len and checks the logits "
        "are finite. Exit 1 on any NaN/Inf. Example: distserve chaos nan-check "
        "--max-len 512 --json out.json",
    )
    n.add_argument("--config", default=None, help="YAML config (default: built-in defaults)")
    n.add_argument("--model", default=None, help="model folder (default: the built-in tiny model)")
    n.add_argument("--max-len", type=int, default=None, help="largest length (default: prefill.max_seq_len)")
    n.add_argument("--min-k", type=int, default=4, help="smallest power of two, 2^k (default 4)")
    n.add_argument("--device", default="cpu")
    n.add_argument("--json", default=None, help="also write the table as JSON here")
    p.set_defaults(handler=main)


def _recorded(kind: str) -> list[str]:
    from distserve.chaos.rollback_all import _found

    return [str(p) for p in _found() if p.name.startswith(f"{kind}--")]


def _rollback_all(args) -> int:
    if args.injector is not None or args.args:
        print("distserve: error: rollback takes an injector or --all, not both", file=sys.stderr)
        return 2
    from distserve.chaos.rollback_all import rollback_all
    from distserve.chaos.state import StateRefused

    try:
        report = rollback_all()
    except StateRefused as e:
        print(f"distserve: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=1, default=str))
    if not (report["restored"] or report["failed"] or report["refused"]):
        print("distserve chaos: nothing recorded, nothing to roll back", file=sys.stderr)
    return 0 if report["ok"] else 1


def main(args) -> int:
    if args.chaos_command == "drill":
        from distserve.chaos.drill import EXIT, run_drill

        if not Path(args.file).is_file():
            print(f"distserve: error: drill file {args.file} does not exist", file=sys.stderr)
            return 2
        try:
            journal, out = run_drill(args.file, Path(args.out) if args.out else None, args.url)
        except (ValueError, TypeError) as e:
            print(f"distserve: error: {e}", file=sys.stderr)
            return 2
        for inv in journal.invariants:
            print(f"  [{inv['status']:>7}] {inv['name']}: {inv['detail']}")
        print(f"drill {journal.drill}: {journal.status}" + (f" ({journal.error})" if journal.error else ""))
        print(f"journal: {out / 'journal.json'}  report: {out / 'report.md'}")
        return EXIT[journal.status]
    if args.chaos_command == "rollback" and (args.all or args.injector is None):
        return _rollback_all(args)
    if args.chaos_command in ("inject", "rollback"):
        from distserve.chaos import injectors
        from distserve.chaos.state import StateRefused

        try:
            mod = injectors.get(args.injector)
            kw = _kv(args.args)
        except ValueError as e:
            print(f"distserve: error: {e}", file=sys.stderr)
            return 2
        from distserve.chaos.sysutil import HostError

        fn = mod.inject if args.chaos_command == "inject" else mod.rollback
        try:
            out = fn(**kw)
        except StateRefused as e:
            print(f"distserve: error: {args.injector} {args.chaos_command}: {e}", file=sys.stderr)
            return 1
        except (ValueError, TypeError) as e:  # bad input (a missing token, a bad argument): exit 2, as the README says
            print(f"distserve: error: {args.injector} {args.chaos_command}: {e}", file=sys.stderr)
            return 2
        except (HostError, RuntimeError, OSError) as e:
            print(f"distserve: error: {args.injector} {args.chaos_command}: {e}", file=sys.stderr)
            return 1
        print(json.dumps(out, indent=1, default=str))
        if args.chaos_command == "rollback" and not out.get("rolled_back"):
            others = _recorded(getattr(mod, "KIND", args.injector))
            if others:  # something is recorded, but not under these arguments
                print(
                    f"distserve: error: {args.injector} rollback restored nothing, yet state is recorded in "
                    f"{', '.join(others)}; pass its key (netns=, key=) or use --all",
                    file=sys.stderr,
                )
                return 1
        return 0
    if args.chaos_command == "nan-check":
        from distserve.chaos.nan_check import cli_main

        return cli_main(args)
    return 2
