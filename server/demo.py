"""The short load the README's first command pushes through a fresh server.

distbench's closed loop (N streaming completions at a fixed concurrency),
its summary table, and the leak check: KV blocks used must be 0 on every
worker afterwards.
"""

from __future__ import annotations

import asyncio
import time

from distbench.cli import print_summary
from distbench.loadgen import LoadSpec, run_load
from distbench.metrics import summarize

PERCENTILES = [50.0, 90.0, 99.0]


def run_demo(url: str, launcher, *, num_requests: int, concurrency: int, max_tokens: int) -> int:
    spec = LoadSpec(url=url, num_prompts=num_requests, prompt_len=128, output_len=max_tokens,
                    concurrency=concurrency)
    records, wall = asyncio.run(run_load(spec))
    summary = summarize(records, wall, PERCENTILES, {"ttft": 0.25, "tpot": 0.05})
    print(f"\nload: {num_requests} streaming completions, 128 prompt tokens, {max_tokens} output tokens, "
          f"concurrency {concurrency}")
    print_summary(summary, PERCENTILES)
    deadline = time.monotonic() + 5
    while True:  # aborts settle within a heartbeat
        used = {w["worker_id"]: w["kv_blocks_used"] for w in launcher.workers()["workers"]}
        if not any(used.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    print(f"KV blocks used after the load (must be 0): {used}")
    failed = [r.error for r in records if not r.ok or r.output_tokens != max_tokens]
    for err in failed[:5]:
        print(f"failed: {err or 'wrong number of tokens'}")
    return 0 if not failed and not any(used.values()) else 1
