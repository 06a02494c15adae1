"""One request must never hurt another: each defect of the hardening pass, through the real server.

A module-scoped server (1 prefill + 2 decode workers) takes the bad input. The isolation test
serves a tiny model with one *poisoned* token: its embedding row is NaN, so any request that
contains it makes NaN logits in a real forward; the token is chosen among those the other
requests of that test never generate. The destructive tests (freeze, kill, crash loop) start
servers of their own.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import socket
import time

import aiohttp
import pytest
from safetensors.torch import load_file, save_file

from distserve.server.engine.tiny_model import DEFAULT_TINY_MODEL_KWARGS, make_tiny_model

from .conftest import http
from .test_serving import make_prompts

CONFIG = {
    "router": {
        "max_request_body_bytes": 1 << 20,
        "stream_progress_timeout_s": 4.0,
        "header_timeout_s": 1.0,
        "body_timeout_s": 2.0,
        "max_prompt_chars": 20000,
    },
    "prefill": {"max_seq_len": 512},
}


GOOD = make_prompts(24, seed=3)
TINY_TEMPERATURES = (1e-300, 1e-30, 1e-6)


def _good_body(i: int) -> dict:
    return {
        "prompt_token_ids": GOOD[i],
        "max_tokens": 12,
        "temperature": 0.8,
        "top_p": 1.0,
        "seed": i,
        "ignore_eos": True,
    }


@pytest.fixture(scope="module")
def server(serve_factory):
    return serve_factory(prefill=1, decode=2, config=CONFIG)


@pytest.fixture(scope="module")
def poisoned(serve_factory, tmp_path_factory):
    """(server, reference outputs of GOOD, greedy output of GOOD[0], the poisoned token id)."""
    from distserve.server.engine.llm_engine import EngineConfig, LLMEngine
    from distserve.server.engine.sampling_params import SamplingParams

    folder = tmp_path_factory.mktemp("poisoned")
    make_tiny_model(folder, **DEFAULT_TINY_MODEL_KWARGS)
    engine = LLMEngine(EngineConfig(model=str(folder)))
    reference = [
        engine.generate([GOOD[i]], [SamplingParams(max_tokens=12, temperature=0.8, seed=i, ignore_eos=True)])[0]
        for i in range(len(GOOD))
    ]
    greedy = engine.generate([GOOD[0]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    used = {t for seq in [*reference, greedy, *GOOD] for t in seq}
    poison = next(t for t in range(259, 512) if t not in used)
    weights = load_file(folder / "model.safetensors")
    weights["model.embed_tokens.weight"][poison] = float("nan")
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return serve_factory(prefill=1, decode=1, config={**CONFIG, "model": str(folder)}), reference, greedy, poison


def _counter(metrics_text: str, name: str) -> float:
    return sum(float(ln.split()[-1]) for ln in metrics_text.splitlines() if ln.startswith(name))


def wait_kv_free(server) -> None:
    used = server.wait_kv_free(timeout=20)
    assert not any(used["used"].values()) and not any(used["staged"].values()), used


async def _stream(s: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, list[dict], bytes]:
    """(status, parsed NDJSON lines of /generate, raw body)."""
    async with s.post(f"{url}/generate", json={**body, "stream": True}) as r:
        raw = await r.read()
    lines = [json.loads(x) for x in raw.splitlines() if x.strip()] if r.status == 200 else []
    return r.status, lines, raw


# --- 1. sampler isolation -------------------------------------------------------
def test_tiny_temperature_and_nan_logits_fail_only_their_own_request(poisoned):
    server, reference, greedy, poison = poisoned

    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
            good = [_stream(s, server.url, _good_body(i)) for i in range(len(GOOD))]
            tiny = [
                _stream(s, server.url, {**_good_body(0), "temperature": t, "seed": None}) for t in TINY_TEMPERATURES
            ]
            nan = _stream(s, server.url, {"prompt_token_ids": [1, 5, poison, 7], "max_tokens": 12})
            return await asyncio.gather(asyncio.gather(*good), asyncio.gather(*tiny), nan)

    good, tiny, (nan_status, nan_lines, _) = asyncio.run(main())
    for i, (status, lines, raw) in enumerate(good):  # exactly what they make without the bad neighbour
        assert status == 200 and not any("error" in ln for ln in lines), raw[-300:]
        assert [t for ln in lines for t in ln["token_ids"]] == reference[i]
    for status, lines, raw in tiny:  # a tiny temperature is greedy, not an error
        assert status == 200 and [t for ln in lines for t in ln["token_ids"]] == greedy, raw[-300:]
    # the poisoned request fails alone, with the true reason, and its stream ends cleanly
    assert nan_status == 200
    assert "NaN/Inf logits" in nan_lines[-1]["error"] and nan_lines[-1]["finished"], nan_lines
    status, body, _ = http("POST", f"{server.url}/v1/completions", {"prompt": [1, poison], "max_tokens": 4})
    assert status == 500 and "NaN/Inf logits" in body["error"]["message"], body
    wait_kv_free(server)


# --- 2. body and prompt size limits ---------------------------------------------------
def test_oversized_body_is_413_at_once_and_prompt_chars_are_bounded_before_tokenizing(server):
    big = json.dumps({"prompt": "x" * (2 << 20), "max_tokens": 1}).encode()
    # "at once": the answer comes from the head alone, before a byte of the body is sent
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as c:
        c.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(big)
        )
        reply = b""
        while chunk := c.recv(4096):
            reply += chunk
    head, _, payload = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), reply[:300]
    assert "router.max_request_body_bytes" in json.loads(payload)["error"]["message"]

    # the same body chunked (no Content-Length): counted as it arrives, cut off at the limit. A raw socket that
    # stops sending once the answer is there: a client that keeps writing after the router answered and
    # closed gets a reset, and may lose the answer with it (aiohttp did, now and then)
    with socket.create_connection((host, int(port)), timeout=30) as c:
        c.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        step = 1 << 16
        for i in range(0, len(big), step):
            if select.select([c], [], [], 0)[0]:
                break  # the router has answered
            piece = big[i : i + step]
            try:
                c.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            except (BrokenPipeError, ConnectionResetError):
                break
        reply = b""
        try:
            while chunk := c.recv(4096):
                reply += chunk
        except ConnectionResetError:
            pass
    assert reply.startswith(b"HTTP/1.1 413"), reply[:300]

    status, body, _ = http("POST", f"{server.url}/v1/completions", {"prompt": "y" * 30000, "max_tokens": 1})
    assert status == 400 and body["error"]["param"] == "prompt" and "max_prompt_chars" in body["error"]["message"]
    msgs = [{"role": "user", "content": "z" * 30000}]
    status, body, _ = http("POST", f"{server.url}/v1/chat/completions", {"messages": msgs, "max_tokens": 1})
    assert status == 400 and body["error"]["param"] == "messages", body
    assert http("GET", f"{server.url}/health")[0] == 200


def test_a_body_that_stalls_gets_408(server):
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as c:
        c.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"prompt":'
        )
        reply = c.recv(4096)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]


# --- 5. every bad input is a 4xx naming the field ------------------------------------------
@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "stop_token_ids": [-1]}, "stop_token_ids"),
        (
            "/v1/completions",
            {"prompt": "hi", "max_tokens": 4, "stop_token_ids": [-1], "stream": True},
            "stop_token_ids",
        ),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "stop_token_ids": [10**6]}, "stop_token_ids"),
        ("/v1/completions", {"prompt": "a\ud800b", "max_tokens": 4}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800b"}], "max_tokens": 4}, "messages"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": True}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "stream": "yes"}, "stream"),
        ("/generate", {"prompt": "", "max_tokens": 4}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "stop": "s" * 500_000}, "stop"),
    ],
)
def test_bad_fields_are_400_naming_the_field(server, path, body, param):
    status, reply, _ = http("POST", f"{server.url}{path}", body)
    assert status == 400, reply
    assert reply["error"]["param"] == param and reply["error"]["message"].startswith(param), reply


@pytest.mark.parametrize(
    "raw",
    [
        b"[" * 100_000 + b"]" * 100_000,
        b'{"prompt": "hi", "max_tokens": ' + b"7" * 5000 + b"}",
        b'{"prompt": "hi", "max_tokens": 4',
        b"\xff\xfe not utf-8",
    ],
)
def test_malformed_json_is_400(server, raw):
    status, reply, _ = http("POST", f"{server.url}/v1/completions", raw=raw)
    assert status == 400 and "JSON" in reply["error"]["message"], reply


# --- 6. a burst spreads over the decode workers ---------------------------------------------
def test_a_burst_is_spread_over_both_decode_workers(server):
    decodes = [w for w in server.workers() if w["role"] == "decode"]
    before = {
        w["worker_id"]: _counter(http("GET", f"{w['url']}/metrics")[1], "distserve_engine_generated_tokens")
        for w in decodes
    }
    prompts = make_prompts(40, seed=11)

    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
            return await asyncio.gather(
                *(
                    _stream(s, server.url, {"prompt_token_ids": p, "max_tokens": 16, "ignore_eos": True})
                    for p in prompts
                )
            )

    for status, lines, raw in asyncio.run(main()):
        assert status == 200 and lines[-1]["finished"] and "error" not in lines[-1], raw[-200:]
    after = {
        w["worker_id"]: _counter(http("GET", f"{w['url']}/metrics")[1], "distserve_engine_generated_tokens")
        for w in decodes
    }
    made = {k: after[k] - before[k] for k in after}
    total = sum(made.values())
    assert total >= 40 * 15 and min(made.values()) >= 0.25 * total, made
    wait_kv_free(server)


# --- 8. slowloris: connections that never finish their headers are closed -------------------
def test_stalled_request_heads_are_closed_and_the_router_keeps_serving(server):
    host, port = server.url.removeprefix("http://").split(":")
    conns = []
    for _ in range(100):
        c = socket.create_connection((host, int(port)), timeout=30)
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # never finished
        conns.append(c)
    assert http("GET", f"{server.url}/health")[0] == 200  # served meanwhile
    try:
        for c in conns:  # each is answered 408 and closed by the router (header_timeout_s = 1)
            data = b""
            while chunk := c.recv(4096):
                data += chunk
            assert data.startswith(b"HTTP/1.1 408"), data[:100]
    finally:
        for c in conns:
            c.close()


# --- 9. aborts racing the prefill hand-off never make a 500 ------------------------------------
def test_disconnect_storm_at_first_token_leaves_no_traceback_and_no_blocks(server):
    prompts = make_prompts(40, seed=5)

    async def one(s, p):
        async with s.post(
            f"{server.url}/v1/completions", json={"prompt": p, "max_tokens": 64, "stream": True, "ignore_eos": True}
        ) as r:
            assert r.status == 200
            await r.content.readline()  # first chunk, then go away

    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
            await asyncio.gather(*(one(s, p) for p in prompts))

    asyncio.run(main())
    wait_kv_free(server)
    logs = "".join(p.read_text(errors="replace") for p in (server.tmp / "logs").glob("*.log"))
    assert "Traceback" not in logs, logs[-3000:]


# --- 3. a frozen decode worker: its streams migrate, none hangs --------------------------------
def test_streams_on_a_frozen_decode_worker_migrate(serve_factory):
    server = serve_factory(prefill=1, decode=2, config={"router": {"stream_progress_timeout_s": 4.0}})
    prompts = make_prompts(16, seed=21)
    reference = [
        http(
            "POST",
            f"{server.url}/generate",
            {"prompt_token_ids": p, "max_tokens": 48, "temperature": 0.7, "seed": i, "ignore_eos": True},
        )[1]["token_ids"]
        for i, p in enumerate(prompts)
    ]
    progress = [0] * len(prompts)
    frozen: dict = {}

    async def one(s, i):
        ids = []
        async with s.post(
            f"{server.url}/generate",
            json={
                "prompt_token_ids": prompts[i],
                "max_tokens": 48,
                "temperature": 0.7,
                "seed": i,
                "ignore_eos": True,
                "stream": True,
            },
        ) as r:
            async for raw in r.content:
                line = json.loads(raw)
                assert "error" not in line, line
                ids.extend(line["token_ids"])
                progress[i] = len(ids)
        return ids

    async def freezer():
        while sum(n >= 2 for n in progress) < len(prompts) // 2:
            await asyncio.sleep(0.005)
        ws = await asyncio.to_thread(server.workers)
        victim = max((w for w in ws if w["role"] == "decode"), key=lambda w: w["inflight"])
        os.kill(victim["pid"], signal.SIGSTOP)
        frozen.update(victim, progress=list(progress))

    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
            results = asyncio.gather(*(one(s, i) for i in range(len(prompts))))
            await freezer()
            try:
                return await results
            finally:
                os.kill(frozen["pid"], signal.SIGCONT)

    got = asyncio.run(main())
    assert any(n < 48 for n in frozen["progress"]), "everything finished before the freeze: proved nothing"
    assert got == reference  # no gap, no duplicate: migrated streams continue exactly
    assert _counter(http("GET", f"{server.url}/metrics")[1], "distserve_migrations_total") >= 1
    server.wait_kv_free(timeout=20)
    ws = {w["worker_id"]: w for w in server.workers()}
    assert all(w["kv_blocks_used"] == 0 for w in ws.values() if w["healthy"]), ws


# --- 4 and 10. supervision: a dead worker is listed dead at once, restarted, crash loops stop ----
def test_lost_prefill_worker_is_restarted_and_a_crash_loop_is_reported(serve_factory):
    server = serve_factory(prefill=1, decode=1, extra_args=("--max-restarts", "1"))

    def prefill():
        return next(w for w in server.workers() if w["role"] == "prefill")

    def wait(pred, what, timeout=60.0):
        deadline = time.monotonic() + timeout
        while not pred():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.05)

    first = prefill()
    os.kill(first["pid"], signal.SIGKILL)
    wait(lambda: prefill()["state"] == "dead", "the router to list the killed worker as dead")
    dead = prefill()
    assert dead["kv_blocks_used"] is None and dead["num_running"] is None  # no stale numbers read as live
    status, body, _ = http("GET", f"{server.url}/health")
    assert status == 503 and body["status"] == "down", body
    wait(lambda: prefill()["state"] == "healthy" and prefill()["pid"] != first["pid"], "the restart")
    assert prefill()["restart_count"] == 1
    status, body, _ = http("GET", f"{server.url}/health")
    assert status == 200 and body["status"] == "ok", body
    metrics = http("GET", f"{server.url}/metrics")[1]
    assert 'distserve_worker_restarts{role="prefill",worker_id="prefill-0"} 1.0' in metrics, metrics
    status, body, _ = http("POST", f"{server.url}/generate", {"prompt": "after the restart", "max_tokens": 4})
    assert status == 200 and len(body["token_ids"]) == 4, body

    os.kill(prefill()["pid"], signal.SIGKILL)  # the second exit within the window: a crash loop
    wait(lambda: "crash loop" in (prefill()["dead_reason"] or ""), "the crash loop to be reported")
    time.sleep(2.0)  # the backoff of a restart would have passed: it must stay down
    assert prefill()["state"] == "dead"
    assert http("GET", f"{server.url}/health")[0] == 503
    assert "not restarting" in server.read_log()


def test_a_decode_worker_lost_with_another_left_is_degraded(serve_factory):
    server = serve_factory(prefill=1, decode=2, extra_args=("--restart", "never"))
    victim = next(w for w in server.workers() if w["role"] == "decode")
    os.kill(victim["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while http("GET", f"{server.url}/health")[1].get("status") != "degraded":
        assert time.monotonic() < deadline, "never reported degraded"
        time.sleep(0.05)
    status, body, _ = http("GET", f"{server.url}/health")
    assert status == 200 and body["workers"]["decode"] == {
        "healthy": 1,
        "stale": 0,
        "suspect": 0,
        "dead": 1,
        "draining": 0,
    }
    status, body, _ = http("POST", f"{server.url}/generate", {"prompt": "still serving", "max_tokens": 4})
    assert status == 200 and len(body["token_ids"]) == 4, body
