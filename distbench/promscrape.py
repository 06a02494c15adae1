"""The server's side of a run: scrape Prometheus ``/metrics`` before and after, keep what changed.

Counters, histogram ``_count``/``_sum`` and summaries are stored as deltas (after - before); gauges as
their value after the run. With an admin token the workers' own ``/metrics`` are scraped too (their URLs
come from the router's ``/v1/workers``): preemptions, prefix-cache hits, KV bytes moved live there.
"""

from __future__ import annotations

import aiohttp
from prometheus_client.parser import text_string_to_metric_families


def parse(text: str) -> tuple[dict[str, float], set[str]]:
    """({'name{labels}': value}, names of gauges)."""
    samples, gauges = {}, set()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith("_bucket") or s.name.endswith("_created"):
                continue
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            key = f"{s.name}{{{labels}}}" if labels else s.name
            samples[key] = s.value
            if fam.type == "gauge":
                gauges.add(key)
    return samples, gauges


def delta(before: str, after: str) -> dict[str, float]:
    b, _ = parse(before)
    a, gauges = parse(after)
    out = {}
    for k, v in a.items():
        d = v if k in gauges else v - b.get(k, 0.0)
        if d:
            out[k] = d
    return out


async def _get(http: aiohttp.ClientSession, url: str, token: str | None = None) -> str | None:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        async with http.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=5)) as r:
            return await r.text() if r.status == 200 else None
    except (aiohttp.ClientError, TimeoutError):
        return None


async def scrape(base: str, token: str | None = None) -> dict[str, str]:
    """{'router': text, '<worker_id>': text, ...}; targets that do not answer are left out."""
    out: dict[str, str] = {}
    async with aiohttp.ClientSession() as http:
        text = await _get(http, f"{base}/metrics")
        if text is not None:
            out["router"] = text
        if token:
            import json

            body = await _get(http, f"{base}/v1/workers", token)
            try:
                workers = json.loads(body)["workers"] if body else []
            except (ValueError, KeyError):
                workers = []
            for w in workers:
                if w.get("url"):
                    t = await _get(http, f"{w['url']}/metrics", token)
                    if t is not None:
                        out[w.get("worker_id", w["url"])] = t
    return out


def deltas(before: dict[str, str], after: dict[str, str]) -> dict[str, dict[str, float]]:
    return {name: delta(before.get(name, ""), text) for name, text in after.items()}
