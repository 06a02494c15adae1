"""Clients that leave at every moment of a request, through the real server (router + 1 prefill + 1 decode).

A client closes its connection while its request waits at the decode-room gate, while its prefill runs,
while its KV is handed over (taken out of the prefill pool and staged, before the decode worker's first
token), and mid-stream; streaming and non-streaming; then 50 at random moments at once. After each:
admission's counts are 0, every worker is idle (queue, running, inflight, KV blocks, staged KV), ``/health``
is ok, no traceback was logged, and the next request is served.

The fault hooks (``POST /admin/fault``) hold a request at the moment under test: ``block_step_ms`` inside
the prefill step, ``stage_delay_ms`` inside the staging of its KV (server/workers/fault.py).
"""

from __future__ import annotations

import asyncio
import random
import time

import aiohttp
import pytest

from tests.integration.conftest import ServeProcess, http

SLOTS = 2  # decode.max_concurrent_requests: a third request waits at the decode-room gate
LONG_PROMPT = "x" * 1500  # tiny model, byte-level tokenizer: ~1500 tokens


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ServeProcess(
        tmp_path_factory.mktemp("disconnects"),
        config={"decode": {"max_concurrent_requests": SLOTS, "max_batch_size": SLOTS}},
    )
    yield s
    t0 = time.monotonic()
    s.stop()
    assert time.monotonic() - t0 < 15, "shutdown after the disconnects was slow"


def _worker(s: ServeProcess, role: str) -> dict:
    return next(w for w in s.workers() if w["role"] == role)


def _fault(s: ServeProcess, role: str, **body) -> None:
    code, out, _ = http("POST", f"{_worker(s, role)['url']}/admin/fault", body)
    assert code == 200, out


def _busy(s: ServeProcess) -> dict:
    """What is still held anywhere: admission's counts, each worker's load (``/v1/workers`` and its own
    ``/metrics``); empty when everything is back to idle."""
    held = {}
    adm = s.get("/v1/admission")
    for k in ("inflight_requests", "queued_requests", "queued_prefill_tokens", "unplaced_requests"):
        if adm[k]:
            held[f"admission.{k}"] = adm[k]
    for w in s.workers():
        if w["state"] != "healthy":
            held[f"{w['worker_id']}.state"] = w["state"]
        for k in ("queue_depth", "num_running", "inflight", "kv_blocks_used", "num_staged_kv"):
            if w[k]:
                held[f"{w['worker_id']}.{k}"] = w[k]
        _, metrics, _ = http("GET", f"{w['url']}/metrics")
        for line in metrics.splitlines():
            name, _, value = line.partition(" ")
            if name in (
                "distserve_queue_depth",
                "distserve_num_requests_running",
                "distserve_kv_blocks_used",
                "distserve_kv_staged_requests",
            ) and float(value):
                held[f"{w['worker_id']}.{name}"] = float(value)
    return held


def assert_back_to_idle(s: ServeProcess, timeout: float = 10.0) -> None:
    """Nothing held within ``timeout`` (well under the 30 s KV lease), healthy, no traceback, the next request
    served."""
    deadline = time.monotonic() + timeout
    while (held := _busy(s)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not held, held
    assert http("GET", f"{s.url}/health", token=None)[0] == 200
    code, body, _ = http("POST", f"{s.url}/v1/completions", {"prompt": "next", "max_tokens": 4, "ignore_eos": True})
    assert code == 200 and body["usage"]["completion_tokens"] == 4, body
    logs = "".join(p.read_text(errors="replace") for p in (s.tmp / "logs").glob("*.log"))
    assert "Traceback" not in logs, logs[-3000:]


async def _leave_after(s: aiohttp.ClientSession, url: str, seconds: float, stream: bool, prompt: str, n: int = 16):
    """A request whose client closes its connection after ``seconds`` (or sooner, once answered): the status
    if it was answered, else "gone"."""
    body = {"prompt": prompt, "max_tokens": n, "ignore_eos": True, "stream": stream}

    async def go():
        async with s.post(f"{url}/v1/completions", json=body) as r:
            await r.read()
            return r.status

    try:
        return await asyncio.wait_for(go(), seconds)
    except TimeoutError:
        return "gone"


def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True, limit=0))


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_gone_while_its_kv_is_staged_leaves_no_staged_kv(server, stream):
    # the prefill's step is done and its KV out of the pool; the copy into staging takes 1.5 s: the client leaves
    # meanwhile, so the router's abort reaches the prefill worker before there is anything staged to abort
    _fault(server, "prefill", stage_delay_ms=1500)
    try:

        async def main():
            async with _session() as s:
                return await _leave_after(s, server.url, 0.8, stream, "hello there")

        assert asyncio.run(main()) == "gone"
        time.sleep(1.2)  # the staging ends (before: its KV then stayed staged until its lease ran out, 30 s)
    finally:
        _fault(server, "prefill")
    assert_back_to_idle(server)


@pytest.mark.parametrize("stream", [True, False])
def test_clients_gone_while_waiting_for_decode_room_give_their_places_back(server, stream):
    async def main():
        async with _session() as s:
            # two long streams hold both decode slots; four more requests wait at the gate, then leave
            hold = [asyncio.ensure_future(_leave_after(s, server.url, 4.0, True, "hold", 1500)) for _ in range(SLOTS)]
            await asyncio.sleep(1.0)
            waiters = [_leave_after(s, server.url, 1.0, stream, f"waiter {i}") for i in range(4)]
            assert await asyncio.gather(*waiters) == ["gone"] * 4
            adm = server.get("/v1/admission")
            assert adm["inflight_requests"] == SLOTS and adm["unplaced_requests"] == 0, adm
            return await asyncio.gather(*hold)

    assert asyncio.run(main()) == ["gone"] * SLOTS
    assert_back_to_idle(server)


@pytest.mark.parametrize("stream", [True, False])
def test_clients_gone_while_their_prefill_runs_free_it(server, stream):
    _fault(server, "prefill", block_step_ms=1500)  # each prefill step blocks 1.5 s
    try:

        async def main():
            async with _session() as s:
                cuts = [0.2, 0.8, 1.6]  # in the first step, in it later, in the next one (queued behind)
                return await asyncio.gather(*(_leave_after(s, server.url, c, stream, LONG_PROMPT) for c in cuts))

        assert asyncio.run(main()) == ["gone"] * 3
    finally:
        _fault(server, "prefill")
    assert_back_to_idle(server)


def test_streams_cut_mid_stream_and_at_the_hand_off_free_everything(server):
    _fault(server, "decode", block_step_ms=300)  # decode steps slow: the hand-off and the stream take a while

    async def one(s, lines: int):
        body = {"prompt": LONG_PROMPT[:200], "max_tokens": 200, "ignore_eos": True, "stream": True}
        async with s.post(f"{server.url}/v1/completions", json=body) as r:
            assert r.status == 200
            for _ in range(lines):  # 1: token #1 came from the prefill, the decode worker's first is pending
                await r.content.readline()

    async def main():
        async with _session() as s:
            await asyncio.gather(*(one(s, n) for n in (1, 1, 3, 10)))

    try:
        asyncio.run(main())
    finally:
        _fault(server, "decode")
    assert_back_to_idle(server)


def test_fifty_clients_gone_at_random_moments(server):
    rng = random.Random(7)

    async def one(s, i):
        stream = rng.random() < 0.6
        prompt = rng.choice(["short", LONG_PROMPT[: rng.randrange(100, 1500)]])
        path, body = rng.choice(
            [
                ("/v1/completions", {"prompt": prompt, "ignore_eos": True}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]}),
                ("/generate", {"prompt": prompt, "ignore_eos": True}),
                ("/v1/completions", {"prompt": prompt, "ignore_eos": True, "n": 2}),
            ]
        )
        body = {**body, "max_tokens": rng.randrange(1, 120), "stream": stream}

        async def go():
            async with s.post(f"{server.url}{path}", json=body) as r:
                await r.read()
                return r.status

        try:
            return await asyncio.wait_for(go(), rng.uniform(0.0, 4.0))
        except TimeoutError:
            return "gone"

    async def main():
        async with _session() as s:
            return await asyncio.gather(*(one(s, i) for i in range(50)))

    outcomes = asyncio.run(main())
    assert "gone" in outcomes and set(outcomes) <= {"gone", 200, 429}, outcomes
    assert_back_to_idle(server)
