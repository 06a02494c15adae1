"""The short load the README's first command pushes through a fresh server.

A stand-in for distbench until that exists: N streaming completions at a fixed
concurrency, TTFT/TPOT percentiles, and the leak check (KV blocks used must be
0 on every worker afterwards).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time

import aiohttp


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


async def _one(http: aiohttp.ClientSession, url: str, i: int, max_tokens: int) -> dict:
    body = {"model": None, "prompt": f"Request {i}: the quick brown fox jumps over the lazy dog. " * 3,
            "max_tokens": max_tokens, "temperature": 0.0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, chunks, tokens, text = None, 0, 0, ""
    async with http.post(f"{url}/v1/completions", json=body) as r:
        if r.status != 200:
            return {"ok": False, "error": f"HTTP {r.status}: {await r.text()}"}
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                return {"ok": False, "error": data["error"]["message"]}
            if data.get("choices"):
                if ttft is None:
                    ttft = time.perf_counter() - t0
                chunks += 1
                text += data["choices"][0]["text"]
            elif data.get("usage"):
                tokens = data["usage"]["completion_tokens"]
    e2e = time.perf_counter() - t0
    tpot = (e2e - ttft) / (tokens - 1) if tokens > 1 and ttft is not None else None
    return {"ok": tokens == max_tokens, "ttft": ttft, "tpot": tpot, "e2e": e2e, "tokens": tokens, "text": text,
            "error": None if tokens == max_tokens else f"got {tokens} tokens, wanted {max_tokens}"}


async def _load(url: str, num_requests: int, concurrency: int, max_tokens: int) -> tuple[list[dict], float]:
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        async def run(i: int) -> dict:
            async with sem:
                return await _one(http, url, i, max_tokens)
        t0 = time.perf_counter()
        results = await asyncio.gather(*(run(i) for i in range(num_requests)))
        return results, time.perf_counter() - t0


def run_demo(url: str, launcher, *, num_requests: int, concurrency: int, max_tokens: int) -> int:
    results, wall = asyncio.run(_load(url, num_requests, concurrency, max_tokens))
    ok = [r for r in results if r["ok"]]
    ttft = [r["ttft"] * 1000 for r in ok]
    tpot = [r["tpot"] * 1000 for r in ok if r["tpot"] is not None]
    print(f"\n{len(ok)}/{num_requests} requests completed in {wall:.2f} s "
          f"(concurrency {concurrency}, {max_tokens} tokens each, "
          f"{sum(r['tokens'] for r in ok) / wall:.0f} output tok/s)")
    print(f"{'metric':<8}{'mean':>9}{'p50':>9}{'p90':>9}{'p99':>9}   (ms)")
    for name, vals in (("TTFT", ttft), ("TPOT", tpot)):
        if vals:
            print(f"{name:<8}{statistics.fmean(vals):>9.2f}{_pct(vals, 50):>9.2f}{_pct(vals, 90):>9.2f}"
                  f"{_pct(vals, 99):>9.2f}")
    if ok:
        print(f"\nfirst completion: {ok[0]['text'][:80]!r}")
    deadline = time.monotonic() + 5
    while True:  # in-flight aborts settle within a heartbeat
        workers = launcher.workers()["workers"]
        used = {w["worker_id"]: w["kv_blocks_used"] for w in workers}
        if not any(used.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    print(f"KV blocks used after the load (must be 0): {used}")
    failed = [r["error"] for r in results if not r["ok"]]
    for err in failed[:5]:
        print(f"failed: {err}")
    return 0 if not failed and not any(used.values()) else 1
