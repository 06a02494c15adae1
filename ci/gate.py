"""`distserve gate [--quick]`: run the release checklist (ci/release_gate.yaml), say go / no-go.

Items run one after another with a live checklist on the terminal (each line
turns from RUN to PASS / FAIL / SKIP as it finishes, with its figure); the
report is written as gate.md and gate.json (atomically) in ``--out``. "go" means
no item failed; an item may be skipped only for a stated reason (no root, the
command is not in this build). Exit 0 go, 1 no-go, 2 bad input.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

from distserve.chaos.journal import SEED_NOTE
from distserve.configs import find as find_config
from distserve.distbench.atomic import atomic_write
from distserve.sla.slo import within

KINDS = ("command", "load", "drill")
MARK = {"passed": "PASS", "failed": "FAIL", "skipped": "SKIP"}


def _fill(v, ctx: dict):
    if isinstance(v, str):
        for k, val in ctx.items():
            v = v.replace("{" + k + "}", str(val))
        return v
    if isinstance(v, list):
        return [_fill(x, ctx) for x in v]
    if isinstance(v, dict):
        return {k: _fill(x, ctx) for k, x in v.items()}
    return v


def _skip_reason(item: dict) -> str | None:
    if item.get("needs_root") and os.geteuid() != 0:
        return "needs root (namespaces, tc, nftables, sysctl, cgroups)"
    path = item.get("needs_path")
    if path and not Path(path).exists():
        return f"needs {path} of a distserve checkout (this is an installed package)"
    mod = item.get("needs_module")
    if mod and importlib.util.find_spec(mod) is None:
        return f"not available: this build has no {mod}"
    cmd = item.get("needs_command")
    if cmd:
        p = subprocess.run(
            [sys.executable, "-m", "distserve.server.cli", *cmd, "--help"],
            capture_output=True,
            check=False,
            timeout=120,
        )
        if p.returncode != 0:
            return f"not available: this build has no `distserve {' '.join(cmd)}`"
    return None


def _run_command(item: dict, quick: bool, ctx: dict, log: Path) -> tuple[str, str]:
    argv = _fill(item.get("quick_argv") if quick and item.get("quick_argv") else item["argv"], ctx)
    with open(log, "wb") as f:
        try:
            p = subprocess.run(
                argv, stdout=f, stderr=subprocess.STDOUT, timeout=float(item.get("timeout_s", 600)), check=False
            )
        except subprocess.TimeoutExpired:
            return "failed", f"timed out after {item.get('timeout_s', 600)} s"
    tail = log.read_text(errors="replace").strip().splitlines()[-1:] or [""]
    ok = p.returncode in item.get("ok_exit", [0])
    return ("passed" if ok else "failed"), f"exit {p.returncode}: {tail[0][:200]}"


def _run_load(item: dict, quick: bool, ctx: dict, log_dir: Path) -> tuple[str, str]:
    from distserve.chaos.invariants import summarize
    from distserve.chaos.target import Target

    spec: dict = item["quick_load"] if quick and item.get("quick_load") else item["load"]
    result = Path(_fill(item["result"], ctx))
    target = Target(item.get("target") or {}, log_dir / item["id"])
    try:
        target.start()
        argv = [
            sys.executable,
            "-m",
            "distserve.distbench.cli",
            "run",
            "--url",
            target.url,
            "--concurrency",
            str(spec["concurrency"]),
            "--num-prompts",
            str(spec["num_prompts"]),
            "--prompt-len",
            str(spec["prompt_len"]),
            "--output-len",
            str(spec["output_len"]),
            "--save-result",
            str(result),
        ]
        with open(log_dir / f"{item['id']}.log", "wb") as f:
            subprocess.run(
                argv, stdout=f, stderr=subprocess.STDOUT, timeout=float(item.get("timeout_s", 900)), check=False
            )
        s = summarize(json.loads(result.read_text())["requests"], float(item.get("timeout_s", 900)))
    except (OSError, ValueError, KeyError, RuntimeError, subprocess.TimeoutExpired) as e:
        return "failed", f"{type(e).__name__}: {e}"
    finally:
        target.stop()
    p99, limit = s["ttft_p99_ms"], float(item.get("max_ttft_p99_ms", float("inf")))
    ok = p99 is not None and within(p99, limit) and s["failed"] <= int(item.get("max_failed", 0)) and s["lost"] == 0
    return ("passed" if ok else "failed"), (
        f"TTFT P99 {p99} ms (limit {limit:g}), P50 {s['ttft_p50_ms']} ms; "
        f"{s['ok']}/{s['total']} ok, {s['failed']} failed"
    )


def _run_drill(item: dict, ctx: dict, log: Path) -> tuple[str, str]:
    out = Path(ctx["out"]) / "drills" / item["id"]
    drill = str(find_config(item["file"]))  # the checkout's, else the shipped copy
    with open(log, "wb") as f:
        try:
            p = subprocess.run(
                [sys.executable, "-m", "distserve.server.cli", "chaos", "drill", drill, "--out", str(out)],
                stdout=f,
                stderr=subprocess.STDOUT,
                timeout=float(item.get("timeout_s", 900)),
                check=False,
            )
        except subprocess.TimeoutExpired:
            return "failed", "drill timed out"
    try:
        j = json.loads((out / "journal.json").read_text())
    except (OSError, ValueError):
        return "failed", f"exit {p.returncode}, no journal"
    bad = [i["name"] for i in j["invariants"] if i["status"] == "failed"]
    detail = f"{j['status']}; " + (
        f"failed: {', '.join(bad)}"
        if bad
        else f"{sum(i['status'] == 'passed' for i in j['invariants'])} invariants held"
    )
    if j.get("error"):
        detail += f" ({j['error'][:160]})"
    return ("passed" if p.returncode == 0 and j["status"] == "completed" else "failed"), detail


def run_gate(checklist: str, out: Path, quick: bool, only: set[str] | None = None, stream=sys.stdout) -> dict:
    spec = yaml.safe_load(find_config(checklist).read_text())
    items = [i for i in spec["items"] if (not quick or i.get("quick")) and (not only or i["id"] in only)]
    if only:  # a gate that runs nothing must not say GO
        ids = [i["id"] for i in spec["items"]]
        if only - set(ids):
            raise ValueError(
                f"--only: no item {', '.join(sorted(only - set(ids)))} in {checklist}; items: {', '.join(ids)}"
            )
        if not items:
            raise ValueError(f"--only {','.join(sorted(only))}: not a quick item; run it without --quick")
    for i in items:
        if i.get("kind") not in KINDS:
            raise ValueError(f"{checklist}: item {i.get('id')!r} has kind {i.get('kind')!r}; expected one of {KINDS}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    ctx = {"python": sys.executable, "out": str(out)}
    results = []
    print(f"{spec.get('title', 'release gate')}{' (quick)' if quick else ''}: {len(items)} items", file=stream)
    for n, item in enumerate(items, 1):
        print(f"  [ RUN  ] {n}/{len(items)} {item['title']}", file=stream, flush=True)
        t0 = time.monotonic()
        reason = _skip_reason(item)
        if reason:
            status, detail = "skipped", reason
        elif item["kind"] == "command":
            status, detail = _run_command(item, quick, ctx, out / "logs" / f"{item['id']}.log")
        elif item["kind"] == "load":
            status, detail = _run_load(item, quick, ctx, out / "logs")
        else:
            status, detail = _run_drill(item, ctx, out / "logs" / f"{item['id']}.log")
        r = {
            "id": item["id"],
            "title": item["title"],
            "status": status,
            "detail": detail,
            "seconds": round(time.monotonic() - t0, 1),
        }
        results.append(r)
        print(
            f"  [ {MARK[status]} ] {n}/{len(items)} {item['title']} ({r['seconds']} s): {detail}",
            file=stream,
            flush=True,
        )
    verdict = "no-go" if any(r["status"] == "failed" for r in results) else "go"
    report = {"verdict": verdict, "quick": quick, "checklist": checklist, "finished": time.time(), "items": results}
    atomic_write(out / "gate.json", json.dumps(report, indent=1))
    md = [
        f"# Release gate: **{verdict.upper()}**{' (quick)' if quick else ''}",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, checklist `{checklist}`",
        "",
        "| item | status | time | detail |",
        "|---|---|---:|---|",
    ]
    md += [f"| {r['title']} | {r['status']} | {r['seconds']} s | {r['detail'].replace('|', '/')} |" for r in results]
    seed = any("seed" in r["title"] for r in results)
    if seed:
        md += ["", f"({SEED_NOTE}.)"]
    atomic_write(out / "gate.md", "\n".join(md) + "\n")
    print(
        f"gate: {verdict.upper()} — {sum(r['status'] == 'passed' for r in results)} passed, "
        f"{sum(r['status'] == 'failed' for r in results)} failed, {sum(r['status'] == 'skipped' for r in results)} "
        f"skipped; report {out / 'gate.md'}",
        file=stream,
    )
    if seed:
        print(f"({SEED_NOTE}.)", file=stream)
    return report


DEFAULT_CHECKLIST = "ci/release_gate.yaml"


def main(args) -> int:
    out = Path(args.out).resolve()  # before a change of folder below: --out is relative to where it was typed
    checklist = args.checklist
    checkout = Path(__file__).resolve().parents[1]  # the checkout an editable install runs from, if any
    if checklist == DEFAULT_CHECKLIST and not Path(checklist).is_file() and (checkout / "tests").is_dir():
        os.chdir(checkout)  # the tests item runs the checkout's tests/ (installed, it is skipped: needs_path)
    if not find_config(checklist).is_file():  # configs/, drills and this file are shipped with the package
        print(f"distserve: error: checklist {checklist} does not exist", file=sys.stderr)
        return 2
    try:
        report = run_gate(checklist, out, args.quick, set(args.only.split(",")) if args.only else None)
    except (ValueError, KeyError, yaml.YAMLError) as e:
        print(f"distserve: error: {e}", file=sys.stderr)
        return 2
    return 0 if report["verdict"] == "go" else 1
