"""What each failure does to the requests in flight, measured on a real `distserve serve`.

    python -m bench.resilience.failure_semantics --out bench/results/failure_semantics_$(date +%F).json

Starts `distserve serve --prefill 1 --decode 2` with the default configuration (so the figures are
what a user gets) and runs, one after another: a bad neighbour (a request with temperature 1e-300
among 39 others), an oversized body (50 MB), a huge prompt under the body limit (5 MB) with /health
timed meanwhile, a frozen decode worker (SIGSTOP under 20 streams), a killed decode worker, a killed
prefill worker (restart), and 200 slowloris connections. Prints one line per scenario and writes the
raw figures as JSON. The figures are recorded in docs/FAILURE_SEMANTICS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp

from bench.lib.results import write_result
from bench.lib.server import ServeProcess

TOKEN = "bench-failure-semantics"


def http(method: str, url: str, body: bytes | None = None, timeout: float = 300) -> tuple[int, dict]:
    req = urllib.request.Request(
        url, data=body, method=method, headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def workers(url: str) -> list[dict]:
    return http("GET", f"{url}/v1/workers")[1]["workers"]


async def stream(s: aiohttp.ClientSession, url: str, body: dict) -> dict:
    """Token ids, the longest gap between lines (s), the error if any."""
    t0 = time.perf_counter()
    last, gap, ids, error = t0, 0.0, [], None
    async with s.post(f"{url}/generate", json={**body, "stream": True}) as r:
        if r.status != 200:
            return {"ids": [], "gap": 0.0, "error": f"HTTP {r.status}", "e2e": time.perf_counter() - t0}
        async for raw in r.content:
            now = time.perf_counter()
            gap, last = max(gap, now - last), now
            line = json.loads(raw)
            ids += line.get("token_ids", [])
            error = line.get("error") or error
    return {"ids": ids, "gap": gap, "error": error, "e2e": time.perf_counter() - t0}


def prompts(n: int) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[1] + [rng.randrange(3, 259) for _ in range(rng.randrange(8, 80))] for _ in range(n)]


async def bad_neighbour(url: str) -> dict:
    async with aiohttp.ClientSession() as s:
        others = [
            stream(s, url, {"prompt_token_ids": p, "max_tokens": 32, "temperature": 0.8, "seed": i, "ignore_eos": True})
            for i, p in enumerate(prompts(39))
        ]
        bad = stream(s, url, {"prompt": "hi", "max_tokens": 4, "temperature": 1e-300})
        res = await asyncio.gather(bad, *others)
    return {
        "requests": 40,
        "failed": sum(r["error"] is not None for r in res),
        "bad_request_tokens": len(res[0]["ids"]),
    }


async def oversize(url: str) -> dict:
    async with aiohttp.ClientSession() as s:
        t0 = time.perf_counter()
        async with s.post(
            f"{url}/v1/completions",
            data=b'{"prompt":"' + b"x" * (50 << 20) + b'"}',
            headers={"Content-Type": "application/json"},
        ) as r:
            status_50mb, t_50mb = r.status, time.perf_counter() - t0

        async def huge():
            t = time.perf_counter()
            async with s.post(f"{url}/v1/completions", json={"prompt": "y" * (5 << 20), "max_tokens": 1}) as r:
                return r.status, time.perf_counter() - t

        async def health():
            worst = 0.0
            for _ in range(20):
                t = time.perf_counter()
                async with s.get(f"{url}/health") as r:
                    await r.read()
                worst = max(worst, time.perf_counter() - t)
                await asyncio.sleep(0.01)
            return worst

        (status_5mb, t_5mb), health_worst = await asyncio.gather(huge(), health())
    return {
        "body_50mb_status": status_50mb,
        "body_50mb_s": t_50mb,
        "prompt_5mb_status": status_5mb,
        "prompt_5mb_s": t_5mb,
        "health_worst_s_during_5mb": health_worst,
    }


async def fault_under_streams(url: str, role: str, sig: int, n: int = 20) -> dict:
    progress = [0] * n
    out: dict = {}

    async def one(s, i, p):
        r = await stream(
            s, url, {"prompt_token_ids": p, "max_tokens": 64, "temperature": 0.7, "seed": i, "ignore_eos": True}
        )
        progress[i] = len(r["ids"])
        return r

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        tasks = [asyncio.ensure_future(one(s, i, p)) for i, p in enumerate(prompts(n))]
        await asyncio.sleep(0.5)
        ws = await asyncio.to_thread(workers, url)
        victim = max((w for w in ws if w["role"] == role and w["healthy"]), key=lambda w: w["inflight"])
        t0 = time.perf_counter()
        os.kill(victim["pid"], sig)
        res = await asyncio.gather(*tasks)
        out["all_done_after_fault_s"] = time.perf_counter() - t0
        if sig == signal.SIGSTOP:
            os.kill(victim["pid"], signal.SIGCONT)
    out.update(
        streams=n,
        failed=sum(r["error"] is not None for r in res),
        complete=sum(len(r["ids"]) == 64 for r in res),
        max_gap_s=max(r["gap"] for r in res),
    )
    return out


def prefill_restart(url: str) -> dict:
    victim = next(w for w in workers(url) if w["role"] == "prefill")
    t0 = time.perf_counter()
    os.kill(victim["pid"], signal.SIGKILL)
    down = None
    while True:
        status, body = http("GET", f"{url}/health")
        if down is None and status == 503:
            down = time.perf_counter() - t0
        if status == 200 and body.get("status") == "ok":
            break
        time.sleep(0.05)
    back = time.perf_counter() - t0
    status, body = http("POST", f"{url}/generate", json.dumps({"prompt": "hello", "max_tokens": 4}).encode())
    return {"health_503_after_s": down, "healthy_again_after_s": back, "request_after_restart": status}


def slowloris(url: str, n: int = 200) -> dict:
    host, port = url.removeprefix("http://").split(":")
    conns = []
    for _ in range(n):
        c = socket.create_connection((host, int(port)), timeout=60)
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        conns.append(c)
    t0 = time.perf_counter()
    health = http("GET", f"{url}/health")[0]
    closed = 0
    for c in conns:
        while c.recv(4096):
            pass
        closed += 1
        c.close()
    return {"connections": n, "health_status_meanwhile": health, "all_closed_after_s": time.perf_counter() - t0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="write the figures here (JSON)")
    args = ap.parse_args()
    with (
        tempfile.TemporaryDirectory(prefix="distserve-failures-") as tmp,
        ServeProcess(Path(tmp), prefill=1, decode=2, token=TOKEN) as srv,
    ):
        url = srv.url
        results = {
            "machine": f"{platform.node()} {os.cpu_count()} CPUs",
            "date": time.strftime("%F %T"),
            "bad_neighbour": asyncio.run(bad_neighbour(url)),
            "oversize": asyncio.run(oversize(url)),
            "frozen_decode": asyncio.run(fault_under_streams(url, "decode", signal.SIGSTOP)),
            "killed_decode": asyncio.run(fault_under_streams(url, "decode", signal.SIGKILL)),
            "killed_prefill": prefill_restart(url),
            "slowloris": slowloris(url),
        }
    for k, v in results.items():
        print(f"{k}: {v}")
    if args.out:
        write_result(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
