"""KV by reference through the real server on the CPU: 1 prefill + 2 decode workers whose pools are
shared-memory arenas (``kv_transfer.by_reference: auto``). The prompt's KV is written by the prefill worker
into blocks each decode worker leased to it, the hand-off carries block ids, and: the tokens equal the
in-process reference (hence the copy path, which test_serving.py holds to the same reference); nothing was
copied; a client that disconnects, and a decode worker SIGKILLed mid-stream (its streams migrate), leave
no block behind on any worker."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.migration import streams_with_decode_kill

from .conftest import http
from .test_serving import MAX_TOKENS, PROMPTS, assert_no_leaks, run_concurrently
from .test_serving import reference as reference  # noqa: F401 (the module's fixture)


@pytest.fixture(scope="module")
def by_ref(serve_factory):
    return serve_factory(decode=2, config={"kv_transfer": {"by_reference": "auto", "transport": "shm"}})


def _metric(url: str, name: str, transport: str) -> float:
    _, text, _ = http("GET", f"{url}/metrics")
    lines = [ln for ln in text.splitlines() if ln.startswith(name) and f'transport="{transport}"' in ln]
    return float(lines[0].split()[-1]) if lines else 0.0


def test_tokens_equal_and_no_byte_is_copied(by_ref, reference):  # noqa: F811
    logs = [(by_ref.tmp / "logs" / f"{w}.log").read_text() for w in ("decode-1", "decode-2")]
    assert all("KV by reference: lessor on" in log for log in logs), logs
    assert run_concurrently(by_ref.url, True) == reference
    assert run_concurrently(by_ref.url, False) == reference
    assert _metric(by_ref.url, "distserve_kv_transfer_seconds_count", "reference") == 2 * len(PROMPTS)
    assert _metric(by_ref.url, "distserve_kv_transfer_bytes_total", "shm") == 0
    assert _metric(by_ref.url, "distserve_kv_transfer_bytes_total", "tcp") == 0
    assert_no_leaks(by_ref)


def test_disconnects_leave_no_lease_behind(by_ref):
    async def main():
        async with aiohttp.ClientSession() as s:
            body = {"prompt_token_ids": PROMPTS[0], "max_tokens": 1500, "temperature": 0.0, "ignore_eos": True}
            for _ in range(4):
                async with s.post(f"{by_ref.url}/generate", json={**body, "stream": True}) as r:
                    n = 0
                    async for _line in r.content:
                        n += 1
                        if n == 3:
                            break

    asyncio.run(main())
    assert_no_leaks(by_ref)


def test_decode_worker_sigkilled_mid_stream_migrates_with_the_same_tokens(by_ref, reference):  # noqa: F811
    bodies = [
        {"prompt_token_ids": p, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True} for p in PROMPTS
    ]
    got, killed = streams_with_decode_kill(by_ref, bodies)
    assert [n for n in killed["progress_at_kill"] if n < MAX_TOKENS], "every stream had finished before the kill"
    assert got == reference
    _, metrics, _ = http("GET", f"{by_ref.url}/metrics")
    migrations = [ln for ln in metrics.splitlines() if ln.startswith("distserve_migrations_total")]
    assert migrations and float(migrations[0].split()[-1]) >= 1, migrations
    assert_no_leaks(by_ref)  # every worker, the restarted decode worker and the prefill worker included
    # the prefill worker maps the restarted decode worker's new pool: by reference again
    before = _metric(by_ref.url, "distserve_kv_transfer_seconds_count", "reference")
    by_ref.wait_kv_free()
    assert run_concurrently(by_ref.url, True, PROMPTS[:4]) == reference[:4]
    assert _metric(by_ref.url, "distserve_kv_transfer_seconds_count", "reference") == before + 4
    assert_no_leaks(by_ref)


@pytest.fixture(scope="module")
def by_ref_full(serve_factory):
    """``on`` (no copy to fall back to) and a decode pool of 16 blocks: two or three of the 16 requests'
    sequences fit at a time, so most leases find the pool full."""
    return serve_factory(
        decode=1, config={"kv_transfer": {"by_reference": "on", "transport": "shm"}, "cache": {"num_gpu_blocks": 16}}
    )


def _counter(url: str, name: str) -> float:
    _, text, _ = http("GET", f"{url}/metrics", token=None)
    return sum(
        float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(name + " ") or ln.startswith(name + "{")
    )


def test_on_waits_for_room_in_a_full_decode_pool_instead_of_failing(by_ref_full, reference):  # noqa: F811
    # before: "KV by reference failed and kv_transfer.by_reference is 'on': lease refused: no room" for every
    # request that found the pool full (24 of 100 at 2048/128, 12 req/s on an H200)
    assert run_concurrently(by_ref_full.url, True) == reference
    prefill = next(w["url"] for w in by_ref_full.workers() if w["role"] == "prefill")
    assert _counter(prefill, "distserve_kv_reference_room_waits_total") >= 1  # the pool was full
    assert _metric(by_ref_full.url, "distserve_kv_transfer_seconds_count", "reference") == len(PROMPTS)
    assert_no_leaks(by_ref_full)
