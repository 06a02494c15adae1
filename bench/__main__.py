"""The suite's runner: ``python -m bench list | run ID | report ID`` over the registry (``bench/suite.yaml``).

    python -m bench list [--subject S] [--device D]        every study: id, subject, device, what it measures
    python -m bench run ID [--variant V] [--dry-run] [-- ARGS]  run it here (outputs: bench/results/ID/ or $OUT)
    python -m bench run ID --device-call                    the command for the GPU machine (bench/lib/device.sh)
    python -m bench report ID [--hardware H] [--full]       its tracked baseline summaries

Bad input exits 2 with one sentence. ``run`` runs each step (with its timeout) from the repository root and exits
1 when a step failed; on the device (``--on-device``, as bench/lib/device.sh calls it) each step's output goes to
``$OUT/STEP.log`` and its tail is printed, as the device's shell wrappers did.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.lib.suite import DEVICES, REPO, SUBJECTS, Step, Study, SuiteError, load


def _err(sentence: str) -> int:
    print(f"python -m bench: error: {sentence}", file=sys.stderr)
    return 2


def cmd_list(args: argparse.Namespace) -> int:
    suite = load()
    rows = [s for s in suite.studies.values() if args.subject in (None, s.subject) and args.device in (None, s.device)]
    width = max(len(s.id) for s in rows) if rows else 0
    for s in rows:
        print(f"{s.id:<{width}}  {s.subject:<11} {s.device:<8} {s.measures}")
    print(f"{len(rows)} studies" + ("" if len(rows) == len(suite.studies) else f" of {len(suite.studies)}"))
    return 0


def _device_call(study: Study, variant: str | None, extra: list[str]) -> str:
    parts = ["bash", "bench/lib/device.sh", study.id]
    if variant:
        parts += ["--variant", variant]
    if extra:
        parts += ["--", *extra]
    return shlex.join(parts)


def _run_step(step: Step, argv: list[str], on_device: bool, out: Path) -> int:
    t0 = time.monotonic()
    try:
        if on_device:
            log = out / f"{step.name}.log"
            with open(log, "wb") as f:
                rc = subprocess.run(
                    argv, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, timeout=step.timeout_s
                ).returncode
        else:
            rc = subprocess.run(argv, cwd=REPO, timeout=step.timeout_s).returncode
    except subprocess.TimeoutExpired:
        rc = 124
    print(f"== {step.name} rc={rc} {time.monotonic() - t0:.0f}s", flush=True)
    if on_device:
        lines = (out / f"{step.name}.log").read_text(errors="replace").splitlines()
        print("\n".join(lines[-25:]), flush=True)
    return rc


def cmd_run(args: argparse.Namespace) -> int:
    suite = load()
    study = suite.get(args.id)
    steps = study.with_variant(args.variant)
    extra = list(args.extra)
    if args.device_call:
        print(_device_call(study, args.variant, extra))
        return 0
    out = Path(os.environ.get("OUT") or REPO / "bench" / "results" / study.id)
    plan = [(s, s.argv(sys.executable, str(out))) for s in steps]
    if extra:
        last, argv = plan[-1]
        plan[-1] = (last, argv + extra)
    if args.dry_run:
        for _, argv in plan:
            print(shlex.join(argv))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    if study.device != "cpu" and not args.on_device:
        print(f"note: {study.id} is a {study.device} study; on the device: {_device_call(study, args.variant, extra)}")
    failed = [s.name for s, argv in plan if _run_step(s, argv, args.on_device, out) != 0]
    print(f"outputs in {out}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def _flat(o: Any, prefix: str = "") -> list[str]:
    if isinstance(o, dict):
        return [line for k, v in o.items() for line in _flat(v, f"{prefix}.{k}" if prefix else str(k))]
    if isinstance(o, list):
        if all(not isinstance(x, dict | list) for x in o):
            return [f"{prefix} = {json.dumps(o)[:100]}"]
        return [line for i, v in enumerate(o) for line in _flat(v, f"{prefix}[{i}]")]
    if isinstance(o, str) and "\n" in o:
        return [f"{prefix}:", *("    " + x for x in o.splitlines())]
    return [f"{prefix} = {o}"]


def cmd_report(args: argparse.Namespace) -> int:
    study = load().get(args.id)
    files = [b for b in study.baselines if args.hardware in (None, Path(b).parent.name)]
    if not files:
        where = f" for hardware {args.hardware}" if args.hardware else ""
        return _err(f"study {study.id} has no tracked baseline{where} (bench/suite.yaml: baselines)")
    for b in files:
        doc = json.loads((REPO / b).read_text())
        print(f"# {doc['study']} on {doc['hardware']} ({b}; {doc.get('derived_by', '')})")
        for name, run in doc["runs"].items():
            print(f"\n## {name}: {run['source']} (added {run['added']}, sha256 {run['sha256'][:12]})")
            if run.get("record"):
                print(f"raw record kept: {run['record']}")
            lines = _flat(run["summary"])
            shown = lines if args.full else lines[: args.lines]
            print("\n".join("  " + x for x in shown))
            if len(shown) < len(lines):
                print(f"  ... {len(lines) - len(shown)} more (--full)")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=(__doc__ or "").split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("list", help="every study in bench/suite.yaml")
    p.add_argument("--subject", choices=SUBJECTS, default=None)
    p.add_argument("--device", choices=DEVICES, default=None)
    p.set_defaults(fn=cmd_list)
    p = sub.add_parser("run", help="run a study (or print its device call)")
    p.add_argument("id")
    p.add_argument("--variant", default=None, help="one of the study's named argument lists")
    p.add_argument("--device-call", action="store_true", help="print the command for the GPU machine and exit")
    p.add_argument("--dry-run", action="store_true", help="print the steps' commands and exit")
    p.add_argument("--on-device", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(fn=cmd_run)
    p = sub.add_parser("report", help="print a study's tracked baseline summaries")
    p.add_argument("id")
    p.add_argument("--hardware", default=None, help="only this hardware's baseline (cpu, h200, h200-x2, ...)")
    p.add_argument("--full", action="store_true", help="every figure, not the first --lines")
    p.add_argument("--lines", type=int, default=30)
    p.set_defaults(fn=cmd_report)
    argv = sys.argv[1:] if argv is None else list(argv)
    extra: list[str] = []
    if "--" in argv:  # run ID ... -- ARGS: arguments for the study's (last) step
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    args = ap.parse_args(argv)
    args.extra = extra
    if extra and args.cmd != "run":
        return _err("arguments after -- are for run only")
    try:
        return int(args.fn(args))
    except SuiteError as e:
        return _err(str(e))


if __name__ == "__main__":
    sys.exit(main())
