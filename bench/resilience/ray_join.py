"""Join and leave times of `distserve scale` on a real 2-node Ray cluster on this machine (tiny model, CPU).

The seed article claims a new worker is in the router's pool "< 200 ms" after it registers. This measures,
per scale-up under a closed-loop distbench load (4 users): the router's join-to-first-request time (from
the router accepting the registration to the first request routed to the worker: `/v1/workers`
`join_to_first_request_ms`), the controller's launch-to-registered time (Ray placement + process start +
model load), and the whole `distserve scale` command; per scale-down, the drain time. Every request of
the load must complete.

    python -m bench.resilience.ray_join --rounds 5 --out bench/results/ray_join_$(date +%F).json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.lib.results import write_result
from tests.ray.cluster import RayCluster

REPO = Path(__file__).resolve().parents[2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ray-join-"))
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0"}
    env.setdefault("DISTSERVE_CACHE_DIR", str(root / "cache"))
    (root / "config.yaml").write_text(
        "kv_transfer: {transport: tcp}\ncache: {kv_cache_memory_mb: 16}\n"
        "prefill: {attention_backend: sdpa}\ndecode: {attention_backend: sdpa}\n"
    )
    cluster = RayCluster(root, env)
    serve = load = None
    rounds = []
    try:
        cluster.start_head(num_cpus=4, resources={"prefill_node": 2})
        cluster.add_node("node2", "127.0.0.3", num_cpus=4, resources={"decode_node": 2})
        cluster.wait_nodes(2)
        ready = root / "ready.json"
        serve = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "distserve.server.cli",
                "serve",
                "--launcher",
                "ray",
                "--address",
                cluster.address,
                "--config",
                str(root / "config.yaml"),
                "--port",
                "0",
                "--prefill",
                "1",
                "--decode",
                "1",
                "--prefill-resources",
                '{"prefill_node": 1}',
                "--decode-resources",
                '{"decode_node": 1}',
                "--ready-file",
                str(ready),
            ],
            cwd=REPO,
            env=env,
            stdout=open(root / "serve.log", "wb"),  # noqa: SIM115
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        while not ready.exists():
            if serve.poll() is not None:
                raise RuntimeError((root / "serve.log").read_text()[-3000:])
            time.sleep(0.5)
        info = json.loads(ready.read_text())
        load = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "distserve.distbench.cli",
                "run",
                "--url",
                info["url"],
                "--concurrency",
                "4",
                "--duration",
                "3600",
                "--prompt-len",
                "24",
                "--output-len",
                "48",
                "--no-progress",
                "--save-result",
                str(root / "load.json"),
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        time.sleep(5)
        for i in range(args.rounds):
            for role, n in (("prefill", 2), ("decode", 2)):
                t0 = time.monotonic()
                up = _scale(cluster, env, f"--{role}", str(n))
                scale_s = time.monotonic() - t0
                wid = up["joined"][0]["worker_id"]
                first = _first_request_ms(info, wid)
                down = _scale(cluster, env, f"--{role}", "1")
                rounds.append(
                    {
                        "round": i,
                        "role": role,
                        "worker_id": wid,
                        "join_to_first_request_ms": first,
                        "launch_to_registered_s": up["joined"][0]["start_to_registered_s"],
                        "scale_up_command_s": round(scale_s, 3),
                        "drain_s": down["left"][0]["seconds"],
                        "drained_idle": down["left"][0]["idle"],
                    }
                )
                print(json.dumps(rounds[-1]), flush=True)
        load.send_signal(signal.SIGTERM)
        load.wait(300)
        result = json.loads((root / "load.json").read_text())
    finally:
        for p in (load, serve):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(120)
        cluster.stop()
    out = {
        "rounds": rounds,
        "load": {"completed": result["completed"], "failed": result["failed"]},
        "median": {
            k: statistics.median(r[k] for r in rounds)
            for k in ("join_to_first_request_ms", "launch_to_registered_s", "scale_up_command_s", "drain_s")
        },
        "machine": f"{os.cpu_count()} CPUs",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    print(json.dumps({k: out[k] for k in ("load", "median")}, indent=1))
    if args.out:
        write_result(args.out, out)
    return 0 if result["failed"] == 0 else 1


def _scale(cluster: RayCluster, env: dict, *argv: str) -> dict:
    r = subprocess.run(
        [sys.executable, "-m", "distserve.server.cli", "scale", "--address", cluster.address, *argv],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if r.returncode != 0:
        raise RuntimeError(f"scale {argv}: {r.stderr[-2000:]}")
    return json.loads(r.stdout)


def _first_request_ms(info: dict, worker_id: str) -> float:
    import urllib.request

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        req = urllib.request.Request(f"{info['url']}/v1/workers", headers={"Authorization": f"Bearer {info['token']}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            w = next(w for w in json.loads(r.read())["workers"] if w["worker_id"] == worker_id)
        if w["join_to_first_request_ms"] is not None:
            return w["join_to_first_request_ms"]
        time.sleep(0.2)
    raise RuntimeError(f"no request routed to {worker_id} within 60 s")


if __name__ == "__main__":
    sys.exit(main())
