"""The router's added latency: TTFT through the router minus TTFT directly at a worker.

    .venv/bin/python -m bench.serving.serving_cpu [--requests 60] [--out FILE]

For each mode it starts `distserve serve` on the built-in tiny model, then sends
the same prompts one at a time (no queueing) two ways and times the first token:
- colocated: router `/v1/completions` (stream) vs the worker's `/internal/generate`;
- disaggregated: router `/v1/completions` (stream) vs the prefill worker's
  `/internal/prefill` (which returns token #1; the router adds its hop, the
  decode worker pick and the SSE framing on top).
Reports P50/P99 of each and of the difference (P50 of router minus P50 of direct). The server is
started by distbench's shared helper, the router request is distbench's client, the percentiles are
distbench's (HDR, nearest rank).
KV transfer throughput per transport is measured by bench/kv_transfer/kv_transfer_cpu.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.lib.server import ServeProcess
from distserve.distbench.client import body_for, send
from distserve.distbench.datasets import Item
from distserve.distbench.metrics import stats_of
from distserve.distbench.records import RequestRecord

TOKEN = "bench-serving-cpu"


async def ttft_router(s: aiohttp.ClientSession, url: str, prompt: list[int]) -> float:
    """distbench's own client: one streamed /v1/completions, TTFT from the send."""
    rec = RequestRecord(0, 0.0)
    item = Item(prompt, None, 4, len(prompt))
    await send(s, url, "/v1/completions", body_for("/v1/completions", item, None, None), rec, time.perf_counter())
    ttft = rec.ttft_service
    if not rec.ok or ttft is None:
        raise RuntimeError(f"router request failed: {rec.error}")
    return ttft


async def ttft_direct(s: aiohttp.ClientSession, worker: dict[str, Any], prompt: list[int], i: int) -> float:
    sampling = {"max_tokens": 4, "temperature": 0.0, "top_p": 1.0, "ignore_eos": True, "seed": 1}
    rid = f"bench-{i}-{time.monotonic_ns()}"
    headers = {"Authorization": f"Bearer {TOKEN}"}
    t0 = time.perf_counter()
    if worker["role"] == "prefill":
        async with s.post(
            f"{worker['url']}/internal/prefill",
            headers=headers,
            json={"request_id": rid, "prompt_token_ids": prompt, "sampling": sampling},
        ) as r:
            await r.read()
        dt = time.perf_counter() - t0
        async with s.post(f"{worker['url']}/internal/abort", headers=headers, json={"request_id": rid}):
            pass
        return dt
    async with s.post(
        f"{worker['url']}/internal/generate",
        headers=headers,
        json={"request_id": rid, "prompt_token_ids": prompt, "sampling": sampling},
    ) as r:
        first: float | None = None
        async for _ in r.content:
            first = time.perf_counter() - t0
            break
        async for _ in r.content:
            pass
    if first is None:
        raise RuntimeError(f"{worker['url']}/internal/generate: the stream ended before its first chunk")
    return first


async def measure(url: str, n: int) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url}/v1/workers", headers={"Authorization": f"Bearer {TOKEN}"}) as r:
            workers = (await r.json())["workers"]
        target = next(w for w in workers if w["role"] in ("prefill", "colocated"))
        prompts = [[1] + [(i * 31 + j * 7) % 250 + 3 for j in range(127)] for i in range(n)]
        via: list[float] = []
        direct: list[float] = []
        for i, p in enumerate(prompts):  # interleaved so drift hits both alike
            via.append(await ttft_router(s, url, p))
            direct.append(await ttft_direct(s, target, p, i))
        via, direct = via[5:], direct[5:]  # warm-up
    v, d = stats_of(via, "router", (50, 99)), stats_of(direct, "direct", (50, 99))
    out: dict[str, Any] = {"direct_at": target["role"], "n": len(via)}
    for name, st in (("router", v), ("direct", d)):
        out[f"{name}_ttft_ms"] = {
            "p50": st[f"p50_{name}_ms"],
            "p99": st[f"p99_{name}_ms"],
            "mean": st[f"mean_{name}_ms"],
        }
    out["added_ms"] = {q: out["router_ttft_ms"][q] - out["direct_ttft_ms"][q] for q in ("p50", "p99")}
    return out


def run_mode(mode: str, n: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp, ServeProcess(tmp, mode=mode, token=TOKEN) as srv:
        return {"mode": mode, **asyncio.run(measure(srv.url, n))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    results = [run_mode(m, args.requests) for m in ("colocated", "disaggregated")]
    print(
        f"{'mode':<15}{'direct at':<11}{'router P50':>11}{'P99':>8}{'direct P50':>12}{'P99':>8}"
        f"{'added P50':>11}{'P99':>8}   (ms)"
    )
    for r in results:
        print(
            f"{r['mode']:<15}{r['direct_at']:<11}{r['router_ttft_ms']['p50']:>11.1f}{r['router_ttft_ms']['p99']:>8.1f}"
            f"{r['direct_ttft_ms']['p50']:>12.1f}{r['direct_ttft_ms']['p99']:>8.1f}"
            f"{r['added_ms']['p50']:>11.1f}{r['added_ms']['p99']:>8.1f}"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
