"""One GPU, prefill and decode as MPS clients on an SM split, KV handed over by reference (issue 31). Skipped
without CUDA (and the split cases without CUDA MPS); on the lent H200:
``python3 -m pytest tests/gpu/test_sm_split_by_reference.py -q`` (tiny model; about 3 minutes).

- the split serves the tokens of a colocated worker, by reference and by copy, and by reference moves no byte
  (the router's ``distserve_kv_transfer_bytes_total`` stays 0 for every copy transport);
- a decode worker SIGKILLed mid-stream: its streams migrate with the same tokens, the restarted worker exports a
  new pool that the prefill worker maps again, and every worker ends with no KV block used.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import urllib.request
from pathlib import Path

import aiohttp
import pytest
import torch

from distserve.distbench.target import ServeProcess
from tests.migration import streams_with_decode_kill

# DISTSERVE_GPU_TEST_DEVICE=cpu dry-runs the file on a CPU (no split there: the --sm-split flags are left out)
DEVICE = os.environ.get("DISTSERVE_GPU_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_mps = pytest.mark.skipif(
    DEVICE == "cuda" and shutil.which("nvidia-cuda-mps-control") is None, reason="needs CUDA MPS"
)
ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[1] + [(13 * i + 7 * j) % 250 + 3 for j in range(n)] for i, n in enumerate([5, 40, 120, 17, 300, 64])]
MAX_TOKENS = 32
CFG = {"cache": {"gpu_memory_utilization": 0.5}}


def _serve(tmp: str, extra: list[str], cfg: dict | None = None) -> ServeProcess:
    config = {**CFG, **(cfg or {})}
    if DEVICE == "cpu" and "--sm-split" in extra:
        i = extra.index("--sm-split")
        extra = extra[:i] + extra[i + 2 :]
    return ServeProcess(Path(tmp), config=config, extra_args=["--device", DEVICE, *extra], timeout_s=300, cwd=ROOT)


async def _one(s: aiohttp.ClientSession, url: str, prompt: list[int]):
    body = {
        "prompt_token_ids": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    ids: list[int] = []
    async with s.post(f"{url}/generate", json=body) as r:
        assert r.status == 200, await r.text()
        async for raw in r.content:
            line = json.loads(raw)
            assert "error" not in line, line
            ids.extend(line["token_ids"])
    return ids


def _sequential(url: str) -> list[list[int]]:
    """One request at a time: the same batch shapes in every layout."""

    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
            return [await _one(s, url, p) for p in PROMPTS]

    return asyncio.run(main())


def _metric(srv: ServeProcess, name: str, transport: str) -> float:
    with urllib.request.urlopen(f"{srv.url}/metrics", timeout=10) as r:
        text = r.read().decode()
    lines = [ln for ln in text.splitlines() if ln.startswith(name) and f'transport="{transport}"' in ln]
    return float(lines[0].split()[-1]) if lines else 0.0


def _no_leaks(srv: ServeProcess) -> None:
    state = srv.wait_kv_free(30)
    assert not any(state["used"].values()), state
    assert not any(state["staged"].values()), state


@pytest.fixture(scope="module")
def colocated_tokens():
    with tempfile.TemporaryDirectory() as tmp, _serve(tmp, ["--mode", "colocated", "--decode", "1"]) as srv:
        return _sequential(srv.url)


@needs_mps
@pytest.mark.parametrize("by_reference", ["on", "off"], ids=["by-reference", "by-copy"])
def test_two_processes_on_a_split_serve_the_colocated_tokens(colocated_tokens, by_reference):
    cfg = {"kv_transfer": {"by_reference": by_reference}}
    with tempfile.TemporaryDirectory() as tmp, _serve(tmp, ["--sm-split", "60:40"], cfg) as srv:
        workers = srv.workers()
        if DEVICE == "cuda":
            assert all(w["memory"]["mps"]["split_in_effect"] for w in workers), workers
        got = _sequential(srv.url)
        for i, (a, b) in enumerate(zip(got, colocated_tokens)):
            first = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
            assert a == b, f"prompt {i}: first difference at token {first}"
        if by_reference == "on":
            assert _metric(srv, "distserve_kv_transfer_seconds_count", "reference") == len(PROMPTS)
            for transport in ("cuda_ipc", "shm", "tcp"):
                assert _metric(srv, "distserve_kv_transfer_bytes_total", transport) == 0
        elif DEVICE == "cuda":
            assert _metric(srv, "distserve_kv_transfer_bytes_total", "cuda_ipc") > 0
        _no_leaks(srv)


@needs_mps
def test_decode_worker_sigkilled_mid_stream_migrates_and_the_blocks_come_back(colocated_tokens):
    cfg = {"kv_transfer": {"by_reference": "auto"}}
    with tempfile.TemporaryDirectory() as tmp, _serve(tmp, ["--decode", "2", "--sm-split", "50:30"], cfg) as srv:
        bodies = [
            {"prompt_token_ids": p, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True} for p in PROMPTS
        ]
        got, killed = streams_with_decode_kill(srv, bodies, poll_s=0.002)
        assert [n for n in killed["progress_at_kill"] if n < MAX_TOKENS], "every stream had finished before the kill"
        assert got == colocated_tokens
        assert _metric(srv, "distserve_kv_transfer_seconds_count", "reference") >= 1
        _no_leaks(srv)  # the prefill worker, the surviving and the restarted decode worker
        before = _metric(srv, "distserve_kv_transfer_seconds_count", "reference")
        assert _sequential(srv.url) == colocated_tokens  # the restarted worker's new pool, mapped again
        assert _metric(srv, "distserve_kv_transfer_seconds_count", "reference") == before + len(PROMPTS)
        _no_leaks(srv)
