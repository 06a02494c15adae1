"""The load generator's own capacity: the highest open-loop rate distbench sustains with send-lag P99
under 1 ms, and the request rate single-process Locust (distbench's locustfile) reaches, against the
same trivial streaming server (tests/stub_server.py in its own process: 8 SSE tokens, no delay).

    .venv/bin/python -m bench.loadgen.distbench_capacity [--rates 50,100,200,400,800] [--seconds 5] [--out FILE]

distbench: constant arrivals at each rate for --seconds; reports achieved completions/s, send-lag P99
and max. Locust: --users users with no wait for --seconds (closed loop: as fast as it can).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.lib.results import write_result
from distserve.distbench.loadgen import RunSpec
from distserve.distbench.runner import Options, Workload, run

REPO = Path(__file__).resolve().parents[2]


def start_stub(tmp: str) -> tuple[subprocess.Popen, str]:
    ready = Path(tmp) / "stub.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.stub_server", "--ready-file", str(ready)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("stub server did not start")
        time.sleep(0.05)
    return proc, json.loads(ready.read_text())["url"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="50,100,200,400,800")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--users", type=int, default=32, help="Locust users")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out: dict = {"machine": {"cpus": os.cpu_count()}, "distbench": [], "locust": None}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "model").mkdir()
        (Path(tmp) / "model" / "config.json").write_text(json.dumps({"vocab_size": 512}))
        proc, url = start_stub(tmp)
        try:
            wl = Workload(prompt_len="16", output_len="8", tokenizer=str(Path(tmp) / "model"))
            for rate in (float(r) for r in args.rates.split(",")):
                spec = RunSpec(url=url, strategy="constant", request_rate=rate, num_prompts=int(rate * args.seconds))
                res = run(Options(spec, wl, progress=False))
                row = {
                    "rate": rate,
                    "achieved_rps": res["request_throughput"],
                    "failed": res["failed"],
                    "p99_send_lag_ms": res["p99_send_lag_ms"],
                    "max_send_lag_ms": res["max_send_lag_ms"],
                    "p99_ttft_service_ms": res["p99_ttft_service_ms"],
                }
                out["distbench"].append(row)
                print(
                    f"distbench rate {rate:6g}: {row['achieved_rps']:7.1f} req/s done, send lag P99 "
                    f"{row['p99_send_lag_ms']:.2f} ms, max {row['max_send_lag_ms']:.2f} ms, failed {row['failed']}",
                    flush=True,
                )
            lf = Path(tmp) / "locust.json"
            p = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "distserve.distbench",
                    "locust",
                    "--url",
                    url,
                    "--users",
                    str(args.users),
                    "--spawn-rate",
                    str(args.users),
                    "--run-time",
                    str(int(args.seconds)),
                    "--prompt-len",
                    "16",
                    "--output-len",
                    "8",
                    "--tokenizer",
                    str(Path(tmp) / "model"),
                    "--save-result",
                    str(lf),
                ],
                cwd=REPO,
                capture_output=True,
                text=True,
                check=False,
            )
            if p.returncode == 0:
                lr = json.loads(lf.read_text())
                out["locust"] = {
                    "users": args.users,
                    "achieved_rps": lr["request_throughput"],
                    "completed": lr["completed"],
                    "p99_ttft_ms": lr["p99_ttft_ms"],
                }
                print(f"locust (1 process, {args.users} users): {lr['request_throughput']:.1f} req/s", flush=True)
            else:
                out["locust"] = {"error": p.stderr[-500:]}
        finally:
            proc.terminate()
            proc.wait(10)
    ok = [r["rate"] for r in out["distbench"] if r["p99_send_lag_ms"] < 1.0 and r["failed"] == 0]
    out["distbench_capacity_rps"] = max(ok) if ok else None
    print(f"distbench: highest rate with send-lag P99 < 1 ms: {out['distbench_capacity_rps']}")
    if args.out:
        write_result(args.out, out)


if __name__ == "__main__":
    main()
