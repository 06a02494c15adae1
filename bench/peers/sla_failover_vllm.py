#!/usr/bin/env python
"""The breaker's failover drill with a real vLLM (CPU build) as the backup pool and a real OpenAI client.

    bench/peers/sla_failover_vllm.py --vllm-python /tmp/vllmcpu/bin/python --out bench/results/sla_failover_vllm.json

Steps: make the peer model (bench/peers/make_peer_model.py) unless --model-dir exists; start vLLM's OpenAI
server on a free port and wait for /health; start `distserve serve --model MODEL_DIR` (disaggregated)
with the breaker on and `router.backup_pool` pointing at vLLM; drive streaming completions with the
`openai` client at --rate req/s through four phases: before (healthy), fault (POST /admin/fault slows
the prefill worker by --fault-ms per step until the breaker opens), open (--hold-s more seconds on the
backup), after (fault cleared, until the breaker closes, then --tail-s). Prints and saves: failover time
(fault → open, from the router's event journal), requests per pool, failed requests, TTFT P50/P99 per
phase (client side, from the send), and the router's transitions. Every process it starts is stopped
by PID (process group) at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, NotRequired, TypedDict

import yaml

from bench.lib.results import write_result

ROOT = Path(__file__).resolve().parents[2]


class SentRequest(TypedDict):
    """One request the drill sent: its phase, the pool that served it (the router's header), and what came back."""

    i: int
    phase: str
    start: float
    pool: str | None
    ttft: float | None
    error: str | None
    tokens: int
    end: NotRequired[float]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} not healthy after {timeout:.0f} s")


def stop(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, int(round(p / 100 * len(v) + 0.5)) - 1))]


async def drive(
    args: argparse.Namespace, router: str, prefill_url: str, token: str, model: str, events: Path
) -> dict[str, Any]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{router}/v1", api_key="unused", max_retries=0, timeout=120)
    log: list[SentRequest] = []
    marks: dict[str, float] = {}
    phase = {"name": "before"}

    async def one(i: int) -> None:
        rec: SentRequest = {
            "i": i,
            "phase": phase["name"],
            "start": time.monotonic(),
            "pool": None,
            "ttft": None,
            "error": None,
            "tokens": 0,
        }
        log.append(rec)
        try:
            raw = await client.completions.with_raw_response.create(
                model=model,
                prompt=f"request {i}: tell me a story about the number {i}",
                max_tokens=args.max_tokens,
                temperature=0.0,
                stream=True,
            )
            rec["pool"] = raw.headers.get("x-distserve-pool")
            async for chunk in raw.parse():  # the raw response parses to the AsyncStream
                if chunk.choices:
                    if rec["ttft"] is None:
                        rec["ttft"] = time.monotonic() - rec["start"]
                    rec["tokens"] += 1
        except Exception as e:  # counted as a failed request in the summary
            rec["error"] = f"{type(e).__name__}: {e}"
        rec["end"] = time.monotonic()

    def state() -> str:
        with urllib.request.urlopen(f"{router}/sla/status", timeout=5) as r:
            return json.load(r)["breaker"]["state"]

    def fault(body: dict[str, float]) -> None:
        req = urllib.request.Request(
            f"{prefill_url}/admin/fault",
            data=json.dumps(body).encode(),
            method="POST",
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        )
        urllib.request.urlopen(req, timeout=10).read()

    stop_evt = asyncio.Event()
    tasks: list[asyncio.Task[None]] = []

    async def trickle() -> None:
        i = 0
        while not stop_evt.is_set():
            tasks.append(asyncio.create_task(one(i)))
            i += 1
            await asyncio.sleep(1.0 / args.rate)

    sender = asyncio.create_task(trickle())
    await asyncio.sleep(args.before_s)
    phase["name"] = "fault"
    marks["fault"] = time.monotonic()
    fault_unix = time.time()
    fault({"prefill_delay_ms": args.fault_ms})
    while await asyncio.to_thread(state) != "open":
        if time.monotonic() - marks["fault"] > 120:
            raise RuntimeError("the breaker did not open within 120 s")
        await asyncio.sleep(0.1)
    marks["open"] = time.monotonic()
    phase["name"] = "open"
    await asyncio.sleep(args.hold_s)
    fault({})
    marks["clear"] = time.monotonic()
    phase["name"] = "recovering"
    while await asyncio.to_thread(state) != "closed":
        if time.monotonic() - marks["clear"] > 180:
            raise RuntimeError("the breaker did not close within 180 s")
        await asyncio.sleep(0.1)
    marks["closed"] = time.monotonic()
    phase["name"] = "after"
    await asyncio.sleep(args.tail_s)
    stop_evt.set()
    await sender
    await asyncio.gather(*tasks)
    await client.close()

    transitions = [json.loads(x) for x in events.read_text().splitlines()] if events.exists() else []
    opened = next((t for t in transitions if t["to_state"] == "open"), None)
    phases: dict[str, dict[str, Any]] = {}
    for name in ("before", "fault", "open", "recovering", "after"):
        rs = [r for r in log if r["phase"] == name]
        ttfts = [r["ttft"] * 1000 for r in rs if r["ttft"] is not None]
        phases[name] = {
            "requests": len(rs),
            "primary": sum(r["pool"] == "primary" for r in rs),
            "backup": sum(r["pool"] == "backup" for r in rs),
            "failed": sum(r["error"] is not None for r in rs),
            "ttft_p50_ms": pct(ttfts, 50),
            "ttft_p99_ms": pct(ttfts, 99),
        }
    return {
        "failover_s": marks["open"] - marks["fault"],
        "failover_s_router": opened["at_unix"] - fault_unix if opened else None,  # fault → the router's transition
        "recovery_s": marks["closed"] - marks["clear"],
        "requests": len(log),
        "failed": sum(r["error"] is not None for r in log),
        "by_pool": {p: sum(r["pool"] == p for r in log) for p in ("primary", "backup")},
        "errors": [r["error"] for r in log if r["error"]][:10],
        "phases": phases,
        "transitions": transitions,
    }


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v:.0f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", default="/tmp/vllmcpu/bin/python")
    p.add_argument("--model-dir", default="/tmp/distserve_peer_model")
    p.add_argument("--out", default=str(ROOT / "bench/results/sla_failover_vllm.json"))
    p.add_argument("--rate", type=float, default=4.0, help="requests per second")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--fault-ms", type=float, default=1500.0, help="prefill step delay while faulted")
    p.add_argument("--before-s", type=float, default=15.0)
    p.add_argument("--hold-s", type=float, default=15.0)
    p.add_argument("--tail-s", type=float, default=10.0)
    p.add_argument("--health-timeout", type=float, default=400.0)
    args = p.parse_args()

    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").exists():
        subprocess.run([sys.executable, str(ROOT / "bench/peers/make_peer_model.py"), str(model_dir)], check=True)
    work = Path(tempfile.mkdtemp(prefix="sla-failover-"))
    vllm: subprocess.Popen[bytes] | None = None
    serve: subprocess.Popen[bytes] | None = None
    try:
        vport = free_port()
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"))
        vlog = open(work / "vllm.log", "wb")
        t0 = time.monotonic()
        vllm = subprocess.Popen(
            [
                args.vllm_python,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                str(model_dir),
                "--host",
                "127.0.0.1",
                "--port",
                str(vport),
                "--max-model-len",
                "2048",
                "--dtype",
                "float32",
                "--served-model-name",
                "peer-on-vllm",
            ],
            stdout=vlog,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        wait_http(f"http://127.0.0.1:{vport}/health", args.health_timeout, vllm)
        print(f"vLLM healthy after {time.monotonic() - t0:.0f} s on port {vport}", flush=True)

        token = "sla-failover-drill"
        events, journal = work / "events.jsonl", work / "requests.jsonl"
        cfg = {
            "router": {
                "port": 0,
                "backup_pool": [f"http://127.0.0.1:{vport}/v1"],
                "backup_model": "peer-on-vllm",
                "journal_path": str(journal),
                "event_journal_path": str(events),
                "sla_window_s": 5,
                "breaker": {
                    "enabled": True,
                    "metric": "ttft",
                    "percentile": 90.0,
                    "threshold_ms": 800.0,
                    "consecutive_s": 2.0,
                    "cooldown_s": 5.0,
                    "probe_fraction": 0.3,
                    "min_samples": 5,
                    "probe_samples": 3,
                },
            }
        }
        (work / "config.yaml").write_text(yaml.safe_dump(cfg))
        ready = work / "ready.json"
        slog = open(work / "serve.log", "wb")
        serve = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "distserve.server.cli",
                "serve",
                "--model",
                str(model_dir),
                "--config",
                str(work / "config.yaml"),
                "--ready-file",
                str(ready),
            ],
            cwd=ROOT,
            stdout=slog,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, DISTSERVE_ADMIN_TOKEN=token),
            start_new_session=True,
        )
        deadline = time.monotonic() + 300
        while not ready.exists():
            if serve.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"distserve serve did not start; see {work / 'serve.log'}")
            time.sleep(0.5)
        router = json.loads(ready.read_text())["url"]
        req = urllib.request.Request(f"{router}/v1/workers", headers={"Authorization": f"Bearer {token}"})
        workers = json.load(urllib.request.urlopen(req, timeout=10))["workers"]
        prefill = next(w["url"] for w in workers if w["role"] == "prefill")
        result = asyncio.run(drive(args, router, prefill, token, str(model_dir), events))
        result.update(
            machine=f"{os.cpu_count()} CPUs, {os.uname().sysname} {os.uname().release}",
            date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            config=cfg["router"],
            rate=args.rate,
            max_tokens=args.max_tokens,
            fault_ms=args.fault_ms,
            command=" ".join(sys.argv),
        )
        write_result(args.out, result)
        print(json.dumps({k: result[k] for k in ("failover_s", "recovery_s", "requests", "failed", "by_pool")}))
        print("| phase | requests | primary | backup | failed | TTFT P50 ms | TTFT P99 ms |")
        print("|---|---|---|---|---|---|---|")
        for name, ph in result["phases"].items():
            print(
                f"| {name} | {ph['requests']} | {ph['primary']} | {ph['backup']} | {ph['failed']} | "
                f"{_ms(ph['ttft_p50_ms'])} | {_ms(ph['ttft_p99_ms'])} |"
            )
        return 0 if result["failed"] == 0 else 1
    finally:
        stop(serve)
        stop(vllm)
        print(f"logs in {work}")


if __name__ == "__main__":
    sys.exit(main())
