"""The router's added latency: TTFT through the router minus TTFT directly at a worker.

    .venv/bin/python bench/serving_cpu.py [--requests 60] [--out FILE]

For each mode it starts `distserve serve` on the built-in tiny model, then sends
the same prompts one at a time (no queueing) two ways and times the first token:
- colocated: router `/v1/completions` (stream) vs the worker's `/internal/generate`;
- disaggregated: router `/v1/completions` (stream) vs the prefill worker's
  `/internal/prefill` (which returns token #1; the router adds its hop, the
  decode worker pick and the SSE framing on top).
Reports P50/P99 of each and of the difference (P50 of router minus P50 of direct).
KV transfer throughput per transport is measured by bench/kv_transfer_cpu.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

TOKEN = "bench-serving-cpu"


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


async def ttft_router(s: aiohttp.ClientSession, url: str, prompt: list[int]) -> float:
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    async with s.post(f"{url}/v1/completions", json=body) as r:
        async for raw in r.content:
            if raw.startswith(b"data: {"):
                dt = time.perf_counter() - t0
                break
        async for _ in r.content:
            pass
    return dt


async def ttft_direct(s: aiohttp.ClientSession, worker: dict, prompt: list[int], i: int) -> float:
    sampling = {"max_tokens": 4, "temperature": 0.0, "top_p": 1.0, "ignore_eos": True, "seed": 1}
    rid = f"bench-{i}-{time.monotonic_ns()}"
    headers = {"Authorization": f"Bearer {TOKEN}"}
    t0 = time.perf_counter()
    if worker["role"] == "prefill":
        async with s.post(f"{worker['url']}/internal/prefill", headers=headers,
                          json={"request_id": rid, "prompt_token_ids": prompt, "sampling": sampling}) as r:
            await r.read()
        dt = time.perf_counter() - t0
        async with s.post(f"{worker['url']}/internal/abort", headers=headers, json={"request_id": rid}):
            pass
        return dt
    async with s.post(f"{worker['url']}/internal/generate", headers=headers,
                      json={"request_id": rid, "prompt_token_ids": prompt, "sampling": sampling}) as r:
        async for _ in r.content:
            dt = time.perf_counter() - t0
            break
        async for _ in r.content:
            pass
    return dt


async def measure(url: str, n: int) -> dict:
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url}/v1/workers", headers={"Authorization": f"Bearer {TOKEN}"}) as r:
            workers = (await r.json())["workers"]
        target = next(w for w in workers if w["role"] in ("prefill", "colocated"))
        prompts = [[1] + [(i * 31 + j * 7) % 250 + 3 for j in range(127)] for i in range(n)]
        via, direct = [], []
        for i, p in enumerate(prompts):  # interleaved so drift hits both alike
            via.append(await ttft_router(s, url, p))
            direct.append(await ttft_direct(s, target, p, i))
        via, direct = via[5:], direct[5:]  # warm-up
    ms = lambda xs: [x * 1000 for x in xs]  # noqa: E731
    v, d = ms(via), ms(direct)
    return {"direct_at": target["role"], "n": len(v),
            "router_ttft_ms": {"p50": pct(v, 50), "p99": pct(v, 99), "mean": statistics.fmean(v)},
            "direct_ttft_ms": {"p50": pct(d, 50), "p99": pct(d, 99), "mean": statistics.fmean(d)},
            "added_ms": {"p50": pct(v, 50) - pct(d, 50), "p99": pct(v, 99) - pct(d, 99)}}


def run_mode(mode: str, n: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        ready = Path(tmp) / "ready.json"
        env = dict(os.environ, DISTSERVE_ADMIN_TOKEN=TOKEN)
        proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--mode", mode, "--port", "0",
                                 "--ready-file", str(ready)], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 180
            while not ready.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{mode} server did not start")
                time.sleep(0.1)
            url = json.loads(ready.read_text())["url"]
            return {"mode": mode, **asyncio.run(measure(url, n))}
        finally:
            proc.terminate()
            proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    results = [run_mode(m, args.requests) for m in ("colocated", "disaggregated")]
    print(f"{'mode':<15}{'direct at':<11}{'router P50':>11}{'P99':>8}{'direct P50':>12}{'P99':>8}"
          f"{'added P50':>11}{'P99':>8}   (ms)")
    for r in results:
        print(f"{r['mode']:<15}{r['direct_at']:<11}{r['router_ttft_ms']['p50']:>11.1f}{r['router_ttft_ms']['p99']:>8.1f}"
              f"{r['direct_ttft_ms']['p50']:>12.1f}{r['direct_ttft_ms']['p99']:>8.1f}"
              f"{r['added_ms']['p50']:>11.1f}{r['added_ms']['p99']:>8.1f}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
