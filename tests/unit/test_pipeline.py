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

from distserve.server.metrics import RouterMetrics
from distserve.server.router.pipeline import EngineRequest, Pipeline, PipelineOptions, TokenEvent
from distserve.server.router.registry import WorkerRegistry
from distserve.server.wire import InternalSampling, RegisterRequest, WorkerStatus


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
    # a stream still open at cleanup (a silent one the router gave up on) is cancelled there, not waited for
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}", seen


async def _good(body, resp):  # continues from the tokens already generated, to 6 in all
    done = len(body["output_token_ids"])
    for t in range(done, 6):
        await resp.write(_line([100 + t], finished=t == 5, reason="length" if t == 5 else None))


async def _run(first_script, progress_timeout_s=5.0, beat=None):
    """``beat(registry)``: runs beside the request (the bad worker's heartbeats, as a test scripts them)."""
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
            beating = asyncio.ensure_future(beat(reg)) if beat is not None else None
            try:
                events = [ev async for ev in pipe.generate(req)]
            finally:
                if beating is not None:
                    beating.cancel()
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


async def _queued(body, resp):
    """Queued behind other requests: nothing for 1 s (more than three progress deadlines), then the tokens."""
    await asyncio.sleep(1.0)
    await _good(body, resp)


def _beats(steps_move: bool, in_step: bool = False, suspect_at: int | None = None, period_s: float = 0.05):
    """Heartbeats of the queued worker every ``period_s``: a request waiting there, between two steps when each
    one is sent (``in_step``), its step count moving or standing still; ``suspect_at``: the router marks it
    suspect right after that beat (another call to it failed), until the next one."""

    async def beat(reg: WorkerRegistry) -> None:
        for k in range(1000):
            st = WorkerStatus(num_waiting=1, num_running=1, in_step=in_step, num_steps=k if steps_move else 7)
            reg.heartbeat("a-bad", st)
            if k == suspect_at:
                reg.mark_suspect("a-bad", "prefill failed: nothing arrived for 10 s")
            await asyncio.sleep(period_s)

    return beat


def test_a_request_queued_past_the_progress_deadline_waits_while_the_worker_steps():
    # every heartbeat falls between two steps (in_step false), but the step count moves: a busy worker
    events, reg, metrics, good_seen = asyncio.run(_run(_queued, progress_timeout_s=0.3, beat=_beats(True)))
    assert _tokens(events) == [100, 101, 102, 103, 104, 105] and events[-1].finish_reason == "length"
    assert not good_seen  # not retried elsewhere
    assert reg.workers["a-bad"].state == "healthy"


def test_a_worker_marked_suspect_by_another_call_does_not_fail_the_waits_on_it():
    # inside a long step, heartbeating every 0.5 s; right after the first beat another call's failure marks it
    # suspect until the next one: the waits already on it go on, they do not all fail at their next check
    beat = _beats(False, in_step=True, suspect_at=0, period_s=0.5)
    events, reg, metrics, good_seen = asyncio.run(_run(_queued, progress_timeout_s=0.3, beat=beat))
    assert _tokens(events) == [100, 101, 102, 103, 104, 105] and not good_seen


def test_a_worker_stalled_between_steps_still_fails_the_wait_at_the_progress_deadline():
    # it heartbeats with a request waiting, but no step runs and its step count stands still: hung
    events, reg, metrics, good_seen = asyncio.run(_run(_queued, progress_timeout_s=0.3, beat=_beats(False)))
    assert _tokens(events) == [100, 101, 102, 103, 104, 105]
    assert len(good_seen) == 1  # retried on the other worker
    assert reg.workers["a-bad"].state in ("suspect", "healthy")  # suspect until its next heartbeat


def test_a_line_that_does_not_parse_is_a_worker_failure():
    async def garbled(body, resp):
        await resp.write(_line([100]) + b'{"token_ids": "not a list", "finished": false}\n')

    events, reg, _, good_seen = asyncio.run(_run(garbled))
    assert _tokens(events) == [100, 101, 102, 103, 104, 105] and good_seen[0]["output_token_ids"] == [100]
    assert reg.workers["a-bad"].state == "suspect"


async def _pd_run(decode_lines: list[bytes], slots: int = 0, during=None) -> tuple[list[TokenEvent], list[str]]:
    """A prefill stub that stages KV (answers a handle) and a decode stub that streams ``decode_lines``;
    the request ids the prefill stub was asked to abort. ``slots``: decode room per decode worker;
    ``during(registry)``: called as the request starts, returns an awaitable that runs beside it."""
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
            opts = PipelineOptions(token="t", request_timeout_s=30, decode_slots=slots)
            pipe = Pipeline(reg, http, RouterMetrics(), opts)
            req = EngineRequest("r1", [1, 2, 3], InternalSampling(max_tokens=3, temperature=0, top_p=1, seed=1))
            side = asyncio.ensure_future(during(reg)) if during is not None else None
            events = [ev async for ev in pipe.generate(req)]
            if side is not None:
                await side
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


def test_a_request_waiting_for_decode_room_outlives_its_pair_leaving_rotation_for_a_moment():
    # one decode slot, taken: the request waits for room; meanwhile the decode worker is marked suspect (a call
    # to it failed) until its next heartbeat, which also frees the slot. It waits for the pair to come back
    # instead of failing with "no healthy prefill/decode pair".
    def during(reg: WorkerRegistry):
        reg.workers["d"].inflight = 1  # before the request starts
        return later(reg)

    async def later(reg: WorkerRegistry) -> None:
        await asyncio.sleep(0.2)
        reg.mark_suspect("d", "stream broke: nothing arrived for 10 s")
        await asyncio.sleep(0.3)
        reg.workers["d"].inflight = 0
        reg.heartbeat("d", WorkerStatus())

    last = _line([101, 102], finished=True, reason="length")
    events, _ = asyncio.run(_pd_run([last], slots=1, during=during))
    assert _tokens(events) == [100, 101, 102] and not any(ev.error for ev in events), events
