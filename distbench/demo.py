"""``distbench demo`` (``make demo``): start ``distserve serve`` (the built-in tiny model, or the model of
``--config``), ask a real model a few chat questions, push a short streaming load through it with distbench's
closed loop, print the summary and the leak check (KV blocks used must be 0 on every worker afterwards),
then audit the run against an SLA spec (``--sla``, through ``distserve sla audit`` as a subprocess: the
harness never imports the server) and print the verdict in plain words. Exit 0 only when every request
produced exactly ``--max-tokens`` tokens, nothing leaked, and the SLA holds.

    distbench demo --config configs/demo_smollm2.yaml --sla configs/sla/demo_smollm2.yaml
"""

from __future__ import annotations

import argparse
import json
import secrets
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

from distserve.configs import find as find_config
from distserve.distbench.demo_chat import ask_questions
from distserve.distbench.loadgen import RunSpec
from distserve.distbench.result import save
from distserve.distbench.runner import Options, Workload, run
from distserve.distbench.summary import format_summary
from distserve.distbench.target import ServeProcess

PERCENTILES = (50.0, 90.0, 99.0)


def run_demo(args) -> int:
    if args.requests < 1 or args.concurrency < 1 or args.max_tokens < 1:
        print("distbench demo: error: --requests, --concurrency and --max-tokens must be >= 1", file=sys.stderr)
        return 2
    # a shipped file by its checkout name (configs/sla/demo.yaml) works from any folder
    args.config = str(find_config(args.config)) if args.config else None
    args.sla = str(find_config(args.sla)) if args.sla else None
    extra = ["--model", args.model] if args.model else []
    if args.config:
        extra += ["--config", args.config]
    with tempfile.TemporaryDirectory(prefix="distbench-demo-") as tmp:
        try:
            srv = ServeProcess(tmp, mode=args.mode, token=secrets.token_hex(16), extra_args=extra)
        except RuntimeError as e:
            print(f"distbench demo: error: {e}", file=sys.stderr)
            return 1
        with srv:
            workers = "1 prefill + 1 decode" if args.mode == "disaggregated" else "1 colocated"
            print(f"distbench demo: server up at {srv.url} ({args.mode}: router + {workers} worker)", flush=True)
            if _real_model(args):  # a trained model: show it answering before the load
                with urllib.request.urlopen(f"{srv.url}/v1/models", timeout=30) as r:
                    ask_questions(srv.url, json.loads(r.read())["data"][0]["id"])
            spec = RunSpec(url=srv.url, strategy="closed", concurrency=args.concurrency, num_prompts=args.requests)
            opts = Options(
                spec,
                Workload(prompt_len="128", output_len=str(args.max_tokens)),
                slo=None if args.sla else "ttft:250ms,tpot:50ms",
                percentiles=PERCENTILES,
                token=srv.token,
            )
            res = run(opts)
            # kept where the SLA report is written (its "Sources" line names it): re-audit or plot it later
            result_path = Path(args.sla_out) / "result.json" if args.sla else Path(tmp) / "result.json"
            result_path.parent.mkdir(parents=True, exist_ok=True)
            save(res, result_path)
            print(
                f"\nload: {args.requests} streaming completions, 128 prompt tokens, {args.max_tokens} output "
                f"tokens, concurrency {args.concurrency}"
            )
            print(format_summary({**res, "verdict": None}))
            deadline = time.monotonic() + 5
            while True:  # aborts settle within a heartbeat
                used = {w["worker_id"]: w["kv_blocks_used"] for w in srv.workers()}
                if not any(used.values()) or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        print(f"KV blocks used after the load (must be 0): {used}")
        wrong = [r for r in res["requests"] if r["error"] or r["output_tokens"] != args.max_tokens]
        for r in wrong[:5]:
            why = r["error"] or f"{r['output_tokens']} tokens instead of {args.max_tokens}"
            print(f"failed: {why}")
        ok = not wrong and not any(used.values())
        sla_ok = _audit(args.sla, result_path, args.sla_out) if args.sla else True
    checks = f"every request gave {args.max_tokens} tokens, no KV block leaked" + (
        f", SLA held ({_thresholds(args.sla)})" if args.sla else ""
    )
    print(f"demo: PASS ({checks})" if ok and sla_ok else "demo: FAIL")
    return 0 if ok and sla_ok else 1


def _thresholds(spec: str) -> str:
    """The spec's objectives in a few words ("TTFT P90 <= 10000 ms, ..."), so a PASS says what it means."""
    try:
        with open(spec) as f:
            d = yaml.safe_load(f) or {}
        parts = [
            f"{o['metric'].upper()} P{o['percentile']:g} <= {o['threshold_ms']:g} ms" for o in d.get("objectives", [])
        ]
        if d.get("availability") is not None:
            parts.append(f"availability >= {100 * float(d['availability']):g}%")
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError):
        return f"the objectives of {spec}"
    return ", ".join(parts) + f" from {spec}"


def _real_model(args) -> bool:
    if args.model:
        return True
    if args.config:
        with open(args.config) as f:
            return bool((yaml.safe_load(f) or {}).get("model"))
    return False


def _audit(spec: str, result: Path, out: str) -> bool:
    """``distserve sla audit`` of the demo's own run; the verdict in words a newcomer reads."""
    print(f"\nSLA audit of this run against {spec} (report: {out}/report.html, {out}/compliance.csv)")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "distserve.server.cli",
            "sla",
            "audit",
            "--spec",
            spec,
            "--results",
            str(result),
            "--out",
            out,
        ],
        capture_output=True,
        text=True,
    )
    print(proc.stdout.rstrip())
    if proc.returncode == 2:
        print(proc.stderr.rstrip(), file=sys.stderr)
    print(
        "TTFT = time to first token (how long a user waits before the answer starts); TPOT = time per output "
        "token after it (how fast the answer streams); E2E = the whole request."
    )
    if proc.returncode == 0:
        print(
            f"SLA verdict: PASS - every objective held ({_thresholds(spec)}) and every request succeeded; "
            f"the run is kept in {result}."
        )
    elif proc.returncode == 3:  # nothing failed, but the demo's short load is too small to judge a tail
        print(
            "SLA verdict: NOT ESTABLISHED - no objective failed, but this short load has too few requests to "
            "judge its percentiles (see 'needs' above); run more requests for a verdict."
        )
        return True
    else:
        print("SLA verdict: FAIL - see the table above for the objective that missed and by how much.")
    return proc.returncode == 0


def add_parser(sub, formatter) -> None:
    p = sub.add_parser(
        "demo",
        help="serve the built-in model, push a short load through it, check for leaks",
        formatter_class=formatter,
        description=(__doc__ or "").replace("``", "`"),
    )
    add_args(p)
    p.set_defaults(handler=run_demo)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--mode",
        choices=["disaggregated", "colocated"],
        default="disaggregated",
        help="router + 1 prefill + 1 decode worker, or 1 colocated worker",
    )
    p.add_argument(
        "--requests", type=int, default=100, help="streaming completions to send (100: enough to judge a P90)"
    )
    p.add_argument("--concurrency", type=int, default=8, help="closed-loop users")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per request")
    p.add_argument("--model", default=None, help="Hugging Face model folder (default: the built-in tiny model)")
    p.add_argument("--config", default=None, help="distserve YAML config")
    p.add_argument("--sla", default=None, help="SLA spec to audit the run against (configs/sla/*.yaml)")
    p.add_argument("--sla-out", default="demo-sla-report", help="folder for the SLA report")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m distserve.distbench.demo",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_args(p)
    return run_demo(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
