"""Streams with a decode worker SIGKILLed in the middle: the shared harness of the migration tests.

``streams_with_decode_kill(server, bodies)`` posts every body to ``/generate`` as a stream, waits until half the
streams are past token #3 (so in decode), SIGKILLs the decode worker with the most work, and returns each
stream's token ids and the victim (its ``/v1/workers`` row plus ``progress_at_kill``: tokens per stream then).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from typing import Any

import aiohttp


async def _stream_ids(s: aiohttp.ClientSession, url: str, body: dict, progress: list[int], i: int) -> list[int]:
    ids: list[int] = []
    async with s.post(f"{url}/generate", json={**body, "stream": True}) as r:
        assert r.status == 200
        async for raw in r.content:
            line = json.loads(raw)
            assert "error" not in line, line
            ids.extend(line["token_ids"])
            progress[i] = len(ids)
    return ids


async def _kill_busiest_decode(server: Any, progress: list[int], poll_s: float) -> dict:
    while sum(1 for n in progress if n >= 3) < len(progress) // 2:
        await asyncio.sleep(poll_s)
    status = await asyncio.to_thread(server.workers)
    decodes = [w for w in status if w["role"] == "decode"]
    victim = max(decodes, key=lambda w: w["inflight"] + w["num_running"])
    os.kill(victim["pid"], signal.SIGKILL)
    return {**victim, "progress_at_kill": list(progress)}


def streams_with_decode_kill(server: Any, bodies: list[dict], poll_s: float = 0.005) -> tuple[list[list[int]], dict]:
    progress = [0] * len(bodies)

    async def main() -> tuple[list[list[int]], dict]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
            runs = asyncio.gather(*(_stream_ids(s, server.url, b, progress, i) for i, b in enumerate(bodies)))
            killed = await _kill_busiest_decode(server, progress, poll_s)
            return list(await runs), killed

    return asyncio.run(main())
