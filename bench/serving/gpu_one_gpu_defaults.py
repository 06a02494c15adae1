"""Issue 36 on one GPU: the seed's form with *default settings* (no config but the model), then nan-check.

For each layout — ``1p1d`` (``distserve serve --device cuda``: 1 prefill + 1 decode worker on cuda:0),
``colocated`` (``--mode colocated``), ``1p2d`` (``--prefill 1 --decode 2``) — one ``distserve serve`` with
no config file but the model, then distbench's closed loop (``--concurrency`` users, 128/64 tokens,
``--duration`` s, greedy (distbench sends temperature 0), goodput at TTFT <= 250 ms and TPOT <= 50 ms), while a thread
reads the router's ``/health`` every 0.5 s. Recorded per layout: start-up time, each worker's memory
sizing (``/v1/workers`` ``memory``), completed / failed, goodput, TTFT P50/P99, the /health statuses seen,
the workers' memory-error counters after the run. Then ``distserve chaos nan-check`` of the model at
2^k-1, 2^k, 2^k+1 for k = 11..13 (8191+ beyond the 7B preset's 4096 context) on every backend.

Device (one H200, carry .whl): ``python -m bench run serving-one-gpu-defaults --device-call``.
CPU dry run (tiny model, seconds):
``python -m bench.serving.gpu_one_gpu_defaults --device cpu --model '' --concurrency 4 --duration 4 --users2 0
--nan-max-len 40 --nan-min-k 5 --out /tmp/i36.json``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from bench.lib.results import write_result
from bench.lib.server import ServeProcess
from distserve.distbench.loadgen import RunSpec
from distserve.distbench.runner import Options, Workload
from distserve.distbench.runner import run as run_distbench

REPO = Path(__file__).resolve().parents[2]

LAYOUTS = {
    "1p1d": ["--mode", "disaggregated", "--prefill", "1", "--decode", "1"],
    "colocated": ["--mode", "colocated", "--decode", "1"],
    "1p2d": ["--mode", "disaggregated", "--prefill", "1", "--decode", "2"],
}
KEEP = (
    "completed",
    "failed",
    "duration",
    "request_throughput",
    "output_throughput",
    "request_goodput",
    "slo_attainment",
    "mean_ttft_ms",
    "p50_ttft_ms",
    "p99_ttft_ms",
    "p50_tpot_ms",
    "p99_tpot_ms",
    "late_sends",
)


def atomic_json(path: Path, obj: dict) -> None:
    write_result(path, obj)


class HealthWatch(threading.Thread):
    """GET /health every ``interval_s``: how many times each status was seen (and the first non-ok body)."""

    def __init__(self, url: str, interval_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.url, self.interval_s = url, interval_s
        self.seen: collections.Counter = collections.Counter()
        self.first_bad: dict | None = None
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    body = json.loads(r.read())
            except urllib.error.HTTPError as e:
                body = {"status": f"http {e.code}"}
            except (urllib.error.URLError, OSError, ValueError) as e:
                body = {"status": f"unreachable: {type(e).__name__}"}
            self.seen[body.get("status", "?")] += 1
            if body.get("status") != "ok" and self.first_bad is None:
                self.first_bad = body
            self._halt.wait(self.interval_s)

    def stop(self) -> dict:
        self._halt.set()
        self.join(5)
        return {"seen": dict(self.seen), "first_not_ok": self.first_bad}


def load(srv: ServeProcess, users: int, duration: float, seed: int) -> dict:
    spec = RunSpec(
        url=srv.url,
        strategy="closed",
        concurrency=users,
        duration_s=duration,
        num_prompts=10**6,
        seed=seed,
        timeout_s=120.0,
    )
    watch = HealthWatch(srv.url)
    watch.start()
    try:
        res = run_distbench(
            Options(
                spec,
                Workload(prompt_len="128", output_len="64", seed=seed),
                slo="ttft:250ms,tpot:50ms",
                percentiles=(50.0, 99.0),
                progress=False,
                token=srv.token,
            )
        )
    finally:
        health = watch.stop()
    out = {k: res.get(k) for k in KEEP if k in res}
    out["health"] = health
    errs = res.get("errors") or []
    out["errors_first"] = [str(e)[:300] for e in errs[:3]]
    return out


def memory_counters(srv: ServeProcess) -> dict:
    return {
        w["worker_id"]: {"memory_errors_recent": w.get("memory_errors_recent"), "state": w.get("state")}
        for w in srv.workers()
    }


def sizing_lines(log_dir: Path) -> dict[str, list[str]]:
    out = {}
    for f in sorted(log_dir.glob("*.log")):
        lines = f.read_text(errors="replace").splitlines()
        keep = [ln[-400:] for ln in lines if re.search(r"KV cache|CUDA graphs|device memory|error|refus", ln)]
        out[f.stem] = keep[-8:]
    return out


def one_layout(name: str, args: argparse.Namespace, doc: dict, t0: float) -> None:
    entry: dict = {"layout": name, "command": f"distserve serve --device {args.device} " + " ".join(LAYOUTS[name])}
    doc["layouts"].append(entry)
    cfg = {"model": args.model} if args.model else {}
    with tempfile.TemporaryDirectory(prefix=f"i36-{name}-") as tmp:
        srv = None
        ts = time.monotonic()
        try:
            srv = ServeProcess(
                Path(tmp),
                config=cfg,
                extra_args=["--device", args.device, *LAYOUTS[name]],
                timeout_s=args.startup_timeout_s,
                cwd=REPO,
            )
            entry["startup_s"] = round(time.monotonic() - ts, 1)
            entry["workers"] = [
                {k: w.get(k) for k in ("worker_id", "role", "kv_blocks_free", "memory")} for w in srv.workers()
            ]
            print(f"[{time.monotonic() - t0:6.1f}s] {name} up in {entry['startup_s']} s", flush=True)
            entry["users"] = {}
            for users, dur in ((args.concurrency, args.duration), (args.users2, args.duration2)):
                if not users:
                    continue
                if time.monotonic() - t0 + dur + 20 > args.budget_s:
                    entry.setdefault("skipped", []).append(f"{users} users: over the budget")
                    continue
                r = load(srv, users, dur, seed=users)
                entry["users"][str(users)] = r
                print(
                    f"[{time.monotonic() - t0:6.1f}s] {name} {users} users: {r.get('completed')} done, "
                    f"{r.get('failed')} failed, goodput {r.get('request_goodput')}, TTFT p99 {r.get('p99_ttft_ms')}, "
                    f"health {r['health']['seen']}",
                    flush=True,
                )
                atomic_json(args.out, doc)
            entry["after"] = memory_counters(srv)
            entry["kv_after"] = srv.wait_kv_free(5.0)
        except Exception as e:  # noqa: BLE001 - keep what was measured
            entry["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
            print(f"{name}: {entry['error']}", flush=True)
        finally:
            if srv is not None:
                srv.stop()
            entry["logs"] = sizing_lines(Path(tmp) / "logs")
            atomic_json(args.out, doc)


def nan_check(args: argparse.Namespace, doc: dict) -> None:
    js = args.out.with_name("nan_check.json")
    cmd = [
        sys.executable,
        "-m",
        "distserve.server.cli",
        "chaos",
        "nan-check",
        "--device",
        args.device,
        "--max-len",
        str(args.nan_max_len),
        "--min-k",
        str(args.nan_min_k),
        "--json",
        str(js),
    ]
    if args.model:
        cmd += ["--model", args.model]
    ts = time.monotonic()
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    doc["nan_check"] = {
        "command": " ".join(cmd[2:]),
        "exit": p.returncode,
        "wall_s": round(time.monotonic() - ts, 1),
        "stdout": p.stdout[-3000:],
        "stderr": p.stderr[-1500:],
        "result": json.loads(js.read_text()) if js.exists() else None,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="preset:llama-2-7b", help="'' = the built-in tiny model")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layouts", default="1p1d,colocated,1p2d")
    ap.add_argument("--concurrency", type=int, default=100)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--users2", type=int, default=300, help="a second run with this many users (0: none)")
    ap.add_argument("--duration2", type=float, default=30.0)
    ap.add_argument("--budget-s", type=float, default=520.0)
    ap.add_argument("--startup-timeout-s", type=float, default=240.0)
    ap.add_argument("--nan-max-len", type=int, default=8193)
    ap.add_argument("--nan-min-k", type=int, default=11)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "one_gpu_defaults.json")
    args = ap.parse_args()
    t0 = time.monotonic()
    doc: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "args": {k: str(v) for k, v in vars(args).items()},
        "layouts": [],
    }
    for name in filter(None, args.layouts.split(",")):
        one_layout(name, args, doc, t0)
    nan_check(args, doc)
    doc["elapsed_s"] = round(time.monotonic() - t0, 1)
    atomic_json(args.out, doc)
    print(json.dumps(doc.get("nan_check", {}).get("stdout", ""))[:2000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
