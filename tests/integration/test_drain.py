"""Drain without Ray: ``POST /drain`` and ``server.launchers.drain.drain_worker`` against a real local
deployment (router + 1 prefill + 2 decode processes). The leaving decode worker gets no new request, its
streams in flight finish there, it ends idle with no KV block, and no request fails."""

from __future__ import annotations

import asyncio
import json
import threading

import aiohttp
import pytest

from distserve.server.launchers.drain import drain_worker
from tests.integration.conftest import TOKEN, http


async def _stream(session: aiohttp.ClientSession, url: str, max_tokens: int) -> int:
    body = {
        "prompt": "drain me gently",
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    tokens = 0
    async with session.post(f"{url}/generate", json=body) as r:
        assert r.status == 200, await r.text()
        async for raw in r.content:
            line = json.loads(raw)
            assert "error" not in line, line
            tokens += len(line["token_ids"])
    return tokens


@pytest.fixture(scope="module")
def s(serve_factory):
    return serve_factory(prefill=1, decode=2)


def test_drain_endpoint_needs_the_token_and_names_an_unknown_worker(s):
    status, _, _ = http("POST", f"{s.url}/drain", {"worker_id": "decode-0"}, token=None)
    assert status == 401
    status, body, _ = http("POST", f"{s.url}/drain", {"worker_id": "nobody"})
    assert status == 404 and body["error"]["message"].startswith("worker_id:")
    status, body, _ = http("POST", f"{s.url}/drain", {"worker": "decode-0"})
    assert status == 400 and "worker_id" in body["error"]["message"]


def test_a_drained_worker_finishes_its_streams_and_gets_no_new_request(s):

    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            first = [asyncio.ensure_future(_stream(session, s.url, 200)) for _ in range(6)]
            while not all(w["inflight"] > 0 for w in s.workers() if w["role"] == "decode"):
                await asyncio.sleep(0.05)  # both decode workers hold streams now
            drain = asyncio.ensure_future(drain_worker(s.url, TOKEN, "decode-1", timeout_s=120, poll_s=0.05))
            while next(w for w in s.workers() if w["worker_id"] == "decode-1")["state"] != "draining":
                await asyncio.sleep(0.05)
            later = [asyncio.ensure_future(_stream(session, s.url, 16)) for _ in range(4)]
            result = await drain
            return await asyncio.gather(*first), await asyncio.gather(*later), result

    # the test's own HTTP polling is blocking: run the client loop in a thread of its own
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(r=asyncio.run(main())))
    t.start()
    t.join(600)
    first, later, result = out["r"]
    assert first == [200] * 6 and later == [16] * 4  # nothing failed or was cut
    assert result.idle and result.kv_blocks_used == 0 and result.seconds > 0
    d1 = next(w for w in s.workers() if w["worker_id"] == "decode-1")
    assert d1["state"] == "draining" and d1["inflight"] == 0 and d1["num_running"] == 0
    other = next(w for w in s.workers() if w["role"] == "decode" and w["worker_id"] != "decode-1")
    assert other["state"] == "healthy"
    status, health, _ = http("GET", f"{s.url}/health")
    assert status == 200 and health["status"] == "ok" and health["workers"]["decode"]["draining"] == 1
