"""Prefill memory exhaustion: prompts and batches past the prefill worker's budget.

Sends, at once, ``over_len`` prompts longer than ``max_seq_len`` (the router must
refuse each with a 400 naming the field) and ``batch`` prompts of ``prompt_len``
tokens — more than the prefill worker's KV pool holds together, or alone when
``prompt_len`` exceeds it. Every request must end with tokens or a clear error, and
the prefill worker must live (the drill checks its PID). Nothing to roll back.
"""

from __future__ import annotations

import asyncio
import random

import aiohttp


async def _one(http: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    try:
        async with http.post(f"{url}/v1/completions", json=body) as r:
            data = await r.json(content_type=None)
            if r.status == 200:
                ch = data["choices"][0]
                return {
                    "status": 200,
                    "prompt_len": len(prompt),
                    "tokens": data["usage"]["completion_tokens"],
                    "finish_reason": ch.get("finish_reason"),
                }
            msg = (data.get("error") or {}).get("message") if isinstance(data, dict) else None
            return {"status": r.status, "prompt_len": len(prompt), "error": msg or str(data)[:200]}
    except (TimeoutError, aiohttp.ClientError, ValueError) as e:
        return {"status": None, "prompt_len": len(prompt), "error": f"{type(e).__name__}: {e}"}


async def _run(
    url: str, over_len: int, lens: list[int], max_seq_len: int, max_tokens: int, timeout_s: float
) -> list[dict]:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 259) for _ in range(n)] for n in [max_seq_len + 16] * over_len + lens]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http:
        return list(await asyncio.gather(*[_one(http, url, p, max_tokens) for p in prompts]))


def clear(r: dict) -> bool:
    """Tokens, or an error status with a message that names something (not a bare 'error')."""
    if r["status"] == 200:
        return r.get("tokens", 0) > 0
    msg = (r.get("error") or "").strip()
    return r["status"] is not None and r["status"] >= 400 and len(msg) > 12


def inject(
    router_url: str,
    max_seq_len: int,
    over_len: int = 2,
    batch: int = 8,
    prompt_len: int = 1024,
    prompt_lens: list[int] | None = None,
    max_tokens: int = 4,
    timeout_s: float = 120.0,
    **_: object,
) -> dict:
    lens = list(prompt_lens) if prompt_lens else [prompt_len] * batch
    results = asyncio.run(_run(router_url.rstrip("/"), over_len, lens, max_seq_len, max_tokens, timeout_s))
    return {
        "mechanism": f"{over_len} prompts over max_seq_len + concurrent prompts of {lens} tokens",
        "results": results,
        "clear": sum(clear(r) for r in results),
        "unclear": sum(not clear(r) for r in results),
    }


def rollback(**_: object) -> dict:
    return {"rolled_back": False, "note": "nothing to undo"}
