"""Client-disconnect storm (seed §4.2: slots kept after client disconnects piled up until OOM).

Opens ``n`` streaming completions at once, waits for each one's first token, then
drops the connection without reading further. Nothing to roll back: the drill
checks afterwards that every worker's KV blocks return to 0 and stale slots stay
under ``decode.max_stale_slots``.
"""

from __future__ import annotations

import asyncio
import json
import random

import aiohttp


async def _one(
    http: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int, first_token_timeout_s: float
) -> str:
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True, "temperature": 0.0}
    try:
        async with asyncio.timeout(first_token_timeout_s):
            async with http.post(f"{url}/v1/completions", json=body) as r:
                if r.status != 200:
                    return f"http_{r.status}"
                async for raw in r.content:
                    if raw.startswith(b"data: {"):
                        if b'"error"' in raw and "error" in json.loads(raw[6:]):
                            return "error_event"
                        r.close()  # abort the connection right after the first token
                        return "aborted_after_first_token"
                return "ended_before_first_token"
    except TimeoutError:
        return "no_first_token_in_time"
    except aiohttp.ClientError:
        return "client_error"


async def _storm(url: str, n: int, prompt_len: int, max_tokens: int, seed: int, timeout_s: float) -> dict:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 259) for _ in range(prompt_len)] for _ in range(n)]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        outcomes = await asyncio.gather(*[_one(http, url, p, max_tokens, timeout_s) for p in prompts])
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o] = counts.get(o, 0) + 1
    return counts


def inject(
    router_url: str,
    n: int = 32,
    prompt_len: int = 64,
    max_tokens: int = 256,
    seed: int = 0,
    first_token_timeout_s: float = 60.0,
    **_: object,
) -> dict:
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    counts = asyncio.run(_storm(router_url.rstrip("/"), n, prompt_len, max_tokens, seed, first_token_timeout_s))
    return {"mechanism": f"{n} streaming clients closing their connections after the first token", "outcomes": counts}


def rollback(**_: object) -> dict:
    return {"rolled_back": False, "note": "nothing to undo: the clients are gone"}
