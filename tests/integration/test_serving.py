"""The disaggregated server end to end: real router + worker processes over loopback.

Every workload ends with the leak check: KV blocks used is 0 on every worker
and no KV payload is left staged.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time

import aiohttp
import pytest

from distserve.server.engine.llm_engine import EngineConfig, LLMEngine
from distserve.server.engine.sampling_params import SamplingParams

from .conftest import http

N_REQUESTS = 16
MAX_TOKENS = 24


def make_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 259) for _ in range(rng.randrange(4, 90))] for _ in range(n)]


PROMPTS = make_prompts(N_REQUESTS)


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    """What `distserve generate` computes in-process for each prompt (greedy)."""
    engine = LLMEngine(EngineConfig())
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [engine.generate([p], params)[0] for p in PROMPTS]


async def stream_completion(
    http_: aiohttp.ClientSession, url: str, prompt, max_tokens: int = MAX_TOKENS, **extra
) -> dict:
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    text, usage, finish, chunks = "", None, None, 0
    async with http_.post(f"{url}/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            assert "error" not in data, data
            if data["choices"]:
                chunks += 1
                text += data["choices"][0]["text"]
                finish = data["choices"][0]["finish_reason"] or finish
            else:
                usage = data["usage"]
    return {"text": text, "usage": usage, "finish_reason": finish, "chunks": chunks}


async def generate_ids(
    http_: aiohttp.ClientSession, url: str, prompt: list[int], stream: bool, max_tokens: int = MAX_TOKENS, **extra
) -> list[int]:
    """Token ids through the seed's /generate endpoint (streaming NDJSON or one JSON body)."""
    body = {
        "prompt_token_ids": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": stream,
        **extra,
    }
    async with http_.post(f"{url}/generate", json=body) as r:
        assert r.status == 200, await r.text()
        if not stream:
            return (await r.json())["token_ids"]
        ids = []
        async for raw in r.content:
            line = json.loads(raw)
            assert "error" not in line, line.get("error")  # the reason, not a truncated line
            ids.extend(line["token_ids"])
        return ids


def run_concurrently(url: str, stream: bool, prompts=PROMPTS, **extra) -> list[list[int]]:
    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
            return await asyncio.gather(*(generate_ids(s, url, p, stream, **extra) for p in prompts))

    return asyncio.run(main())


def assert_no_leaks(server) -> None:
    state = server.wait_kv_free()
    assert not any(state["used"].values()), state
    assert not any(state["staged"].values()), state


@pytest.fixture(scope="module", params=["tcp", "shm"])
def disagg(request, serve_factory):
    """1 prefill + 1 decode worker; the KV transport under test forced by config."""
    return serve_factory(config={"kv_transfer": {"transport": request.param}})


@pytest.fixture(scope="module")
def colocated(serve_factory):
    return serve_factory(mode="colocated", decode=1)


def test_disaggregated_equals_generate_and_colocated(disagg, colocated, reference):
    for stream in (True, False):
        assert run_concurrently(disagg.url, stream) == reference
    assert run_concurrently(colocated.url, True) == reference
    assert_no_leaks(disagg)
    assert_no_leaks(colocated)
    # the transport under test really carried the KV
    _, metrics, _ = http("GET", f"{disagg.url}/metrics")
    transport = "shm" if "shm" in disagg.tmp.joinpath("config.yaml").read_text() else "tcp"
    line = [
        ln
        for ln in metrics.splitlines()
        if ln.startswith("distserve_kv_transfer_bytes_total") and f'transport="{transport}"' in ln
    ]
    assert line and float(line[0].split()[-1]) > 0, metrics


def test_generate_cli_matches_server(disagg, reference):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "distserve.server.cli",
            "generate",
            "--prompt-ids",
            ",".join(map(str, PROMPTS[3])),
            "--max-tokens",
            str(MAX_TOKENS),
            "--ignore-eos",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert json.loads(out.stdout)["token_ids"] == reference[3]


def test_seeded_sampling_survives_disaggregation(disagg, colocated):
    extra = {"temperature": 0.8, "top_p": 0.9, "seed": 1234}
    prompts = PROMPTS[:6]
    a = run_concurrently(disagg.url, True, prompts, **extra)
    b = run_concurrently(colocated.url, False, prompts, **extra)
    assert a == b
    assert run_concurrently(disagg.url, True, prompts[:1], **{**extra, "seed": 99}) != a[:1]


def test_repeated_prompt_hits_the_prefill_workers_prefix_cache(disagg):
    prompt = "The quick brown fox jumps over the lazy dog; " * 3  # ~135 byte tokens: 8 full blocks
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    outs = []
    for _ in range(2):
        status, out, _ = http("POST", f"{disagg.url}/v1/completions", body)
        assert status == 200, out
        outs.append(out["choices"][0]["text"])
    assert outs[0] == outs[1]
    (prefill,) = [w for w in disagg.workers() if w["role"] == "prefill"]
    _, metrics, _ = http("GET", f"{prefill['url']}/metrics")
    hits = [ln for ln in metrics.splitlines() if ln.startswith("distserve_prefix_cache_hit_tokens ")]
    assert hits and float(hits[0].split()[-1]) >= 7 * 16, metrics
    # the KV size decided at startup (CPU: cache.kv_cache_memory_mb) and the prefill phase timers
    kv = [ln for ln in metrics.splitlines() if ln.startswith("distserve_kv_cache_bytes ")]
    assert kv and float(kv[0].split()[-1]) > 0, metrics
    taken = [ln for ln in metrics.splitlines() if ln.startswith('distserve_prefill_phase_seconds_count{phase="stage"}')]
    assert taken and float(taken[0].split()[-1]) >= 2, metrics  # one per KV handed over (earlier tests add more)
    assert_no_leaks(disagg)


def test_openai_client_streaming_and_not(disagg):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{disagg.url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    full = client.completions.create(
        model=model, prompt="Hello, world", max_tokens=12, temperature=0.0, extra_body={"ignore_eos": True}
    )
    assert full.usage.completion_tokens == 12 and full.choices[0].finish_reason == "length"
    pieces = list(
        client.completions.create(
            model=model,
            prompt="Hello, world",
            max_tokens=12,
            temperature=0.0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].text for c in pieces if c.choices) == full.choices[0].text
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=8,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 8
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=8,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == chat.choices[0].message.content
    assert_no_leaks(disagg)


def test_stop_string_truncates_and_frees(disagg):
    async def main():
        async with aiohttp.ClientSession() as s:
            full = await stream_completion(s, disagg.url, "The fox", max_tokens=40)
            assert len(full["text"]) > 6
            stop = full["text"][3:6]
            cut = await stream_completion(s, disagg.url, "The fox", max_tokens=40, stop=[stop])
            return full, cut, stop

    full, cut, stop = asyncio.run(main())
    assert cut["text"] == full["text"][: full["text"].index(stop)]
    assert cut["finish_reason"] == "stop"
    assert_no_leaks(disagg)


def test_client_disconnect_frees_kv(disagg):
    async def main():
        async with aiohttp.ClientSession() as s:
            body = {
                "prompt_token_ids": PROMPTS[0],
                "max_tokens": 1500,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
            }
            for _ in range(4):
                async with s.post(f"{disagg.url}/generate", json=body) as r:
                    n = 0
                    async for _line in r.content:
                        n += 1
                        if n == 5:
                            break  # leaving the block closes the connection mid-stream

    asyncio.run(main())
    assert_no_leaks(disagg)


def test_engine_thread_mode_serves_the_same_tokens_and_frees_everything(serve_factory, reference):
    """``engine_thread: on`` (the CUDA default) on CPU workers: steps on the engine thread while handlers
    stage KV, stream and abort on the event loop. Same tokens, and disconnects leave no KV behind."""
    server = serve_factory(
        config={
            "prefill": {"engine_thread": "on"},
            "decode": {"engine_thread": "on"},
            "kv_transfer": {"transport": "shm"},
        }
    )
    logs = [(server.tmp / "logs" / f"{w}.log").read_text() for w in ("prefill-0", "decode-1")]
    assert all("engine steps on a dedicated thread" in log for log in logs)
    assert run_concurrently(server.url, True) == reference
    test_client_disconnect_frees_kv(server)  # streams cut mid-step: the aborts queue behind the running step
    assert_no_leaks(server)


# --- errors -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "body,field",
    [
        ({"max_tokens": 4}, "prompt"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
        ({"prompt": "hi", "temperature": -1}, "temperature"),
        ({"prompt": "hi", "top_p": 1.5}, "top_p"),
        ({"prompt": [1, 2, 99999], "max_tokens": 2}, "prompt"),
        ({"prompt": "hi", "n": 17}, "n"),
        ({"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
        ({"prompt": "hi", "logit_bias": {"99999": 1}}, "logit_bias"),
        ({"prompt": "x" * 5000, "max_tokens": 2}, "prompt"),
        ({"prompt": "hi", "max_tokens": 4000}, "max_tokens"),
    ],
)
def test_bad_completion_requests_get_400_naming_the_field(disagg, body, field):
    status, resp, _ = http("POST", f"{disagg.url}/v1/completions", body, token=None)
    assert status == 400, resp
    assert field in resp["error"]["message"], resp


def test_malformed_json_and_bad_chat(disagg):
    status, resp, _ = http("POST", f"{disagg.url}/v1/completions", raw=b"{not json", token=None)
    assert status == 400 and "JSON" in resp["error"]["message"]
    status, resp, _ = http("POST", f"{disagg.url}/v1/chat/completions", {"messages": []}, token=None)
    assert status == 400 and "messages" in resp["error"]["message"]
    status, resp, _ = http("POST", f"{disagg.url}/generate", {"max_tokens": 3}, token=None)
    assert status == 400 and "prompt" in resp["error"]["message"]


def test_admin_endpoints_need_the_token(disagg):
    for method, path in (("GET", "/v1/workers"), ("POST", "/register"), ("POST", "/deregister")):
        status, _, _ = http(method, f"{disagg.url}{path}", {} if method == "POST" else None, token="wrong")
        assert status == 401
    workers = disagg.workers()
    assert {w["role"] for w in workers} == {"prefill", "decode"}
    for w in workers:
        assert w["pid"] > 0 and w["url"].startswith("http://127.0.0.1:")
        assert w["kv_blocks_free"] > 0


def test_frozen_worker_leaves_and_rejoins_rotation(serve_factory):
    server = serve_factory(prefill=1, decode=1)
    decode = next(w for w in server.workers() if w["role"] == "decode")
    os.kill(decode["pid"], signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 10
        while any(w["healthy"] for w in server.workers() if w["role"] == "decode"):
            assert time.monotonic() < deadline, "frozen worker still in rotation"
            time.sleep(0.2)
        status, body, headers = http(
            "POST", f"{server.url}/v1/completions", {"prompt": "hi", "max_tokens": 2}, token=None
        )
        assert status == 503 and headers.get("retry-after") == "1", body
    finally:
        os.kill(decode["pid"], signal.SIGCONT)
    deadline = time.monotonic() + 10
    while not all(w["healthy"] for w in server.workers()):
        assert time.monotonic() < deadline, "thawed worker did not come back"
        time.sleep(0.2)
    assert run_concurrently(server.url, True, PROMPTS[:2])
    assert_no_leaks(server)
