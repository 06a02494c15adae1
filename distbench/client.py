"""One streamed request over HTTP: /v1/completions (SSE), /v1/chat/completions (SSE), /generate (NDJSON).

Fills a ``RequestRecord``: first token and inter-chunk gaps from the stream, token counts from the
final ``usage`` (or counted from the stream when the server sends none), and on failure a short reason
(``HTTP 404: first words of the body``).
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp

from distserve.distbench.datasets import Item, Vocab
from distserve.distbench.records import RequestRecord, parse_retry_after, short_error

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/generate")


def split_endpoint(url: str) -> tuple[str, str | None]:
    """``http://h:8080/generate`` -> (``http://h:8080``, ``/generate``); a URL without an endpoint is
    returned as it is, with None."""
    url = url.strip().rstrip("/")
    for ep in ("/v1/chat/completions", "/v1/completions", "/generate"):
        if url.endswith(ep):
            return url[: -len(ep)], ep
    return url, None


def base_url(url: str) -> str:
    """'http://h:8080/v1/' and 'http://h:8080' both mean the server at http://h:8080."""
    url = url.strip().rstrip("/")
    return url.removesuffix("/v1")


def _text(item: Item, vocab: Vocab | None) -> str:
    if item.text is not None:
        return item.text
    ids = item.prompt_ids or []
    text = vocab.decode(ids) if vocab else None
    # without a tokenizer: one short word per token id (the length is then approximate)
    return text if text is not None else " ".join(f"w{t}" for t in ids)


def body_for(endpoint: str, item: Item, model: str | None, vocab: Vocab | None, sampling: dict | None = None) -> dict:
    """``sampling``: the fields of ``--sampling`` (distbench/sampling.py); None sends none (OpenAI's default)."""
    body: dict = {"max_tokens": item.output_len, **(sampling or {}), "ignore_eos": True, "stream": True}
    if endpoint == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": _text(item, vocab)}]
        body["stream_options"] = {"include_usage": True}
    elif endpoint == "/generate":
        if item.prompt_ids is not None:
            body["prompt_token_ids"] = item.prompt_ids
        else:
            body["prompt"] = item.text
    else:
        body["prompt"] = item.prompt_ids if item.prompt_ids is not None else item.text
        body["stream_options"] = {"include_usage": True}
    if model:
        body["model"] = model
    return body


def _chunk_tokens(endpoint: str, data: dict) -> int:
    """Tokens a stream chunk carries (0 for the usage-only chunk)."""
    if endpoint == "/generate":
        return len(data.get("token_ids") or [])
    choices = data.get("choices") or []
    if not choices:
        return 0
    c = choices[0]
    if endpoint == "/v1/chat/completions":
        delta = c.get("delta") or {}
        return 1 if delta.get("content") or c.get("finish_reason") is not None else 0
    return 1


async def send(http: aiohttp.ClientSession, url: str, endpoint: str, body: dict, rec: RequestRecord, t0: float) -> None:
    """POST and stream; times are offsets from ``t0`` (perf_counter of the run's start)."""
    sched_abs = t0 + rec.scheduled
    sent_abs = time.perf_counter()
    rec.sent = sent_abs - t0
    last = None
    counted = 0
    usage = None
    try:
        async with http.post(url + endpoint, json=body) as r:
            if r.status != 200:
                rec.error = short_error(r.status, await r.text())
                if r.status == 429:
                    rec.retry_after = parse_retry_after(r.headers.get("Retry-After"))
                return
            async for raw in r.content:
                line = raw.strip()
                if endpoint != "/generate":
                    if not line.startswith(b"data:"):
                        continue
                    line = line[5:].strip()
                    if line == b"[DONE]":
                        break
                if not line:
                    continue
                now = time.perf_counter()
                data = json.loads(line)
                if "error" in data:
                    err = data["error"]
                    rec.error = f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"[:200]
                    return
                if data.get("usage"):
                    usage = data["usage"]
                n = _chunk_tokens(endpoint, data)
                if n:
                    if rec.ttft is None:
                        rec.ttft = now - sched_abs
                        rec.ttft_service = now - sent_abs
                    elif last is not None:
                        rec.itl.append(now - last)
                    last = now
                    counted += n
        if rec.ttft is None:
            rec.error = "no tokens received"
            return
        rec.e2e = (last or time.perf_counter()) - sched_abs
        rec.output_tokens = int(usage["completion_tokens"]) if usage else counted
        if usage and usage.get("prompt_tokens"):
            rec.prompt_tokens = int(usage["prompt_tokens"])
    except asyncio.CancelledError:
        if rec.error is None:
            rec.error = "cancelled: in flight when the run stopped"
            rec.cancelled_after = time.perf_counter() - sched_abs
        raise
    except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError, ValueError, KeyError) as e:
        rec.error = short_error(None, exc=e)
