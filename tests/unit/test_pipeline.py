"""The router's pipeline as a unit: migration, the progress deadline, keep-alives, typed parsing.

The workers here are small aiohttp servers speaking the worker's HTTP protocol with scripted
streams (a seam that a real worker cannot be made to misbehave at on cue); the pipeline, the
registry and the HTTP client are the real ones.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from server.metrics import RouterMetrics
from server.router.pipeline import EngineRequest, Pipeline, PipelineOptions, TokenEvent
from server.router.registry import WorkerRegistry
from server.wire import InternalSampling, RegisterRequest


def _line(tokens, finished=False, reason=None) -> bytes:
    body = {"token_ids": tokens, "finished": finished}
    if reason:
        body["finish_reason"] = reason
    return json.dumps(body).encode() + b"\n"


async def _worker(script) -> tuple[web.AppRunner, str, list[dict]]:
    """A colocated worker whose /internal/generate stream is ``script(body, response)``."""
    seen: list[dict] = []

    async def generate(request: web.Request):
        body = await request.json()
        seen.append(body)
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        await script(body, resp)
        return resp

    async def abort(request: web.Request):
        return web.json_response({"aborted": False})

    app = web.Application()
    app.router.add_post("/internal/generate", generate)
    app.router.add_post("/internal/abort", abort)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}", seen


async def _good(body, resp):  # continues from the tokens already generated, to 6 in all
    done = len(body["output_token_ids"])
    for t in range(done, 6):
        await resp.write(_line([100 + t], finished=t == 5, reason="length" if t == 5 else None))


async def _run(first_script, progress_timeout_s=5.0):
    runners = []
    try:
        bad, bad_url, _ = await _worker(first_script)
        good, good_url, good_seen = await _worker(_good)
        runners += [bad, good]
        reg = WorkerRegistry(heartbeat_timeout_s=30)
        for wid, url in (("a-bad", bad_url), ("b-good", good_url)):
            reg.register(
                RegisterRequest(worker_id=wid, role="colocated", url=url, pid=1, fingerprint={}, max_model_len=64)
            )
        reg.workers["b-good"].inflight = 1  # the pick goes to the bad worker first
        metrics = RouterMetrics()
        async with aiohttp.ClientSession() as http:
            pipe = Pipeline(
                reg,
                http,
                metrics,
                PipelineOptions(token="t", request_timeout_s=30, progress_timeout_s=progress_timeout_s),
            )
            req = EngineRequest("r1", [1, 2, 3], InternalSampling(max_tokens=6, temperature=0, top_p=1, seed=1))
            events = [ev async for ev in pipe.generate(req)]
        return events, reg, metrics, good_seen
    finally:
        for r in runners:
            await r.cleanup()


def _tokens(events):
    return [t for ev in events for t in ev.token_ids]


def test_a_stream_cut_without_a_finish_migrates_with_the_tokens_so_far():
    async def cut(body, resp):
        await resp.write(_line([100]) + _line([101]))

    events, reg, metrics, good_seen = asyncio.run(_run(cut))
    assert _tokens(events) == [100, 101, 102, 103, 104, 105] and events[-1].finish_reason == "length"
    assert good_seen[0]["output_token_ids"] == [100, 101]  # the live worker re-prefills what was streamed
    assert reg.workers["a-bad"].state == "suspect"
    assert metrics.migrations._value.get() == 1


def test_a_silent_stream_fails_at_the_progress_deadline_and_migrates():
    async def stall(body, resp):
        await resp.write(_line([100]))
        await asyncio.sleep(30)

    events, reg, _, good_seen = asyncio.run(_run(stall, progress_timeout_s=0.3))
    assert _tokens(events) == [100, 101, 102, 103, 104, 105]
    assert good_seen[0]["output_token_ids"] == [100]


def test_keepalive_lines_keep_a_slow_stream_alive_past_the_deadline():
    async def slow(body, resp):
        await resp.write(_line([100]))
        for _ in range(6):  # 0.6 s without a token, a blank line every 0.1 s
            await asyncio.sleep(0.1)
            await resp.write(b"\n")
        for t in range(1, 6):
            await resp.write(_line([100 + t], finished=t == 5, reason="length" if t == 5 else None))

    events, reg, _, good_seen = asyncio.run(_run(slow, progress_timeout_s=0.3))
    assert _tokens(events) == [100, 101, 102, 103, 104, 105] and not good_seen
    assert reg.workers["a-bad"].healthy


def test_a_line_that_does_not_parse_is_a_worker_failure():
    async def garbled(body, resp):
        await resp.write(_line([100]) + b'{"token_ids": "not a list", "finished": false}\n')

    events, reg, _, good_seen = asyncio.run(_run(garbled))
    assert _tokens(events) == [100, 101, 102, 103, 104, 105] and good_seen[0]["output_token_ids"] == [100]
    assert reg.workers["a-bad"].state == "suspect"


async def _pd_run(decode_lines: list[bytes]) -> tuple[list[TokenEvent], list[str]]:
    """A prefill stub that stages KV (answers a handle) and a decode stub that streams ``decode_lines``;
    the request ids the prefill stub was asked to abort."""
    aborted: list[str] = []

    async def prefill(request: web.Request):
        body = await request.json()
        return web.json_response(
            {"token_ids": [100], "finished": False, "kv": {"request_id": body["request_id"], "transport": "tcp"}}
        )

    async def abort(request: web.Request):
        aborted.append((await request.json())["request_id"])
        return web.json_response({"aborted": True})

    async def generate(request: web.Request):
        await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        for line in decode_lines:
            await resp.write(line)
        return resp

    app = web.Application()
    app.router.add_post("/internal/prefill", prefill)
    app.router.add_post("/internal/abort", abort)
    app.router.add_post("/internal/generate", generate)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    try:
        reg = WorkerRegistry(heartbeat_timeout_s=30)
        for wid, role in (("p", "prefill"), ("d", "decode")):
            reg.register(RegisterRequest(worker_id=wid, role=role, url=url, pid=1, fingerprint={}, max_model_len=64))
        async with aiohttp.ClientSession() as http:
            pipe = Pipeline(reg, http, RouterMetrics(), PipelineOptions(token="t", request_timeout_s=30))
            req = EngineRequest("r1", [1, 2, 3], InternalSampling(max_tokens=3, temperature=0, top_p=1, seed=1))
            events = [ev async for ev in pipe.generate(req)]
            await asyncio.sleep(0.2)  # the abort is sent without holding up the stream
        return events, aborted
    finally:
        await runner.cleanup()


def test_a_failed_kv_pull_frees_the_staged_kv_on_the_prefill_worker_at_once():
    fail = (
        json.dumps(
            {"token_ids": [], "finished": True, "finish_reason": "abort", "error": "KV transfer failed: timed out"}
        ).encode()
        + b"\n"
    )
    events, aborted = asyncio.run(_pd_run([fail]))
    assert events[-1].error and "KV transfer failed" in events[-1].error
    assert aborted == ["r1"]


def test_a_recomputed_prompt_frees_the_staged_kv_and_a_pulled_one_does_not():
    recompute = json.dumps({"token_ids": [101], "kv_transport": "recompute"}).encode() + b"\n"
    pulled = (
        json.dumps(
            {"token_ids": [101], "kv_transport": "tcp", "kv_transfer_seconds": 0.01, "kv_transfer_bytes": 10}
        ).encode()
        + b"\n"
    )
    last = _line([102], finished=True, reason="length")
    events, aborted = asyncio.run(_pd_run([recompute, last]))
    assert _tokens(events) == [100, 101, 102] and aborted == ["r1"]
    events, aborted = asyncio.run(_pd_run([pulled, last]))
    assert _tokens(events) == [100, 101, 102] and aborted == []
