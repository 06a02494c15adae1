"""Failures the server must survive: a decode worker killed mid-stream, start order, a foreign model."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import aiohttp
import pytest
import yaml

from distserve.server.engine.llm_engine import EngineConfig, LLMEngine
from distserve.server.engine.sampling_params import SamplingParams
from tests.migration import streams_with_decode_kill

from .conftest import TOKEN, free_port, http
from .test_serving import assert_no_leaks, make_prompts

MAX_TOKENS = 96
PROMPTS = make_prompts(16, seed=7)


def test_sigkill_decode_worker_mid_stream_streams_complete_identically(serve_factory):
    server = serve_factory(prefill=1, decode=2)
    engine = LLMEngine(EngineConfig())
    # odd streams also carry penalties: their counts are rebuilt from the token ids on the new worker
    penalties = [
        {"frequency_penalty": 0.5, "presence_penalty": 0.3, "repetition_penalty": 1.1} if i % 2 else {}
        for i in range(len(PROMPTS))
    ]
    seeded = [
        SamplingParams(
            max_tokens=MAX_TOKENS, temperature=0.7, top_p=0.95, seed=500 + i, ignore_eos=True, **penalties[i]
        )
        for i in range(len(PROMPTS))
    ]
    reference = [engine.generate([p], [sp])[0] for p, sp in zip(PROMPTS, seeded)]
    assert len([w for w in server.workers() if w["role"] == "decode"]) == 2
    bodies = [
        {
            "prompt_token_ids": PROMPTS[i],
            "max_tokens": MAX_TOKENS,
            "temperature": 0.7,
            "top_p": 0.95,
            "seed": 500 + i,
            "ignore_eos": True,
            **penalties[i],
        }
        for i in range(len(PROMPTS))
    ]
    # once most streams are past token #1 (so in decode), SIGKILL the busier decode worker
    got, killed = streams_with_decode_kill(server, bodies)
    assert killed
    unfinished = [n for n in killed["progress_at_kill"] if n < MAX_TOKENS]
    assert unfinished, "every stream had finished before the kill: the test proved nothing"
    assert got == reference
    _, metrics, _ = http("GET", f"{server.url}/metrics")
    migrations = [ln for ln in metrics.splitlines() if ln.startswith("distserve_migrations_total")]
    assert migrations and float(migrations[0].split()[-1]) >= 1, migrations
    assert_no_leaks(server)


def _spawn(argv: list[str], log, extra_env: dict | None = None) -> subprocess.Popen:
    env = dict(os.environ, DISTSERVE_ADMIN_TOKEN=TOKEN, **(extra_env or {}))
    return subprocess.Popen(
        [sys.executable, "-m", "distserve.server.cli", *argv], env=env, stdout=log, stderr=subprocess.STDOUT
    )


def _stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _wait(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


@pytest.fixture
def config_file(tmp_path):
    p = tmp_path / "cfg.yaml"
    p.write_text(yaml.safe_dump({"router": {"heartbeat_interval_ms": 200, "heartbeat_timeout_ms": 1000}}))
    return str(p)


def test_workers_started_before_the_router_register(tmp_path, config_file):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "log.txt", "wb")
    workers = [
        _spawn(["--log-level", "INFO", "worker", "--role", r, "--router", url, "--config", config_file], log)
        for r in ("prefill", "decode")
    ]
    router = None
    try:
        # both workers up and serving (so retrying registration: there is no router yet)
        _wait(
            lambda: (tmp_path / "log.txt").read_text(errors="replace").count("listening on") >= 2,
            120,
            "both workers to listen",
        )
        assert all(w.poll() is None for w in workers)
        router = _spawn(["router", "--port", str(port), "--config", config_file], log)

        def ready():
            try:
                status, body, _ = http("GET", f"{url}/v1/workers", timeout=2)
            except OSError:
                return False
            return status == 200 and sum(w["healthy"] for w in body["workers"]) == 2

        _wait(ready, 60, "both workers to register")
        status, body, _ = http(
            "POST", f"{url}/v1/completions", {"prompt": "hello", "max_tokens": 5, "ignore_eos": True}, token=None
        )
        assert status == 200 and body["usage"]["completion_tokens"] == 5, body
    finally:
        _stop(*workers, *([router] if router else []))
        log.close()


def test_fingerprint_mismatch_is_refused(tmp_path, config_file):
    other = tmp_path / "other-model"
    subprocess.run(
        [sys.executable, "-m", "distserve.server.cli", "make-tiny-model", str(other), "--seed", "1"],
        check=True,
        capture_output=True,
        timeout=120,
    )
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "log.txt", "wb")
    router = _spawn(["router", "--port", str(port), "--config", config_file], log)
    good = _spawn(["worker", "--role", "prefill", "--router", url, "--config", config_file], log)
    bad = None
    try:

        def registered():
            try:
                status, body, _ = http("GET", f"{url}/v1/workers", timeout=2)
            except OSError:
                return False
            return status == 200 and len(body["workers"]) == 1

        _wait(registered, 60, "the first worker")
        out = tmp_path / "bad.txt"
        with open(out, "wb") as f:
            bad = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "distserve.server.cli",
                    "worker",
                    "--role",
                    "decode",
                    "--router",
                    url,
                    "--config",
                    config_file,
                    "--model",
                    str(other),
                ],
                env=dict(os.environ, DISTSERVE_ADMIN_TOKEN=TOKEN),
                stdout=f,
                stderr=subprocess.STDOUT,
                timeout=120,
            )
        text = out.read_text()
        assert bad.returncode == 3, text
        assert "fingerprint mismatch" in text and "weights" in text, text
        _, body, _ = http("GET", f"{url}/v1/workers")
        assert [w["role"] for w in body["workers"]] == ["prefill"]
    finally:
        _stop(good, router)
        log.close()


def test_no_workers_gives_503_and_bad_token_worker_is_refused(tmp_path, config_file):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "log.txt", "wb")
    router = _spawn(["router", "--port", str(port), "--config", config_file], log)
    try:

        def up():
            try:
                return http("GET", f"{url}/health", timeout=2)[0] == 503
            except OSError:
                return False

        _wait(up, 60, "the router")
        status, body, headers = http("POST", f"{url}/v1/completions", {"prompt": "hi"}, token=None)
        assert status == 503 and headers.get("retry-after") == "1", body
        wrong = subprocess.run(
            [
                sys.executable,
                "-m",
                "distserve.server.cli",
                "worker",
                "--role",
                "decode",
                "--router",
                url,
                "--config",
                config_file,
            ],
            env=dict(os.environ, DISTSERVE_ADMIN_TOKEN="wrong"),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert wrong.returncode == 3 and "token" in wrong.stdout + wrong.stderr
    finally:
        _stop(router)
        log.close()


def _prefill_body(rid: str, n: int) -> dict:
    prompt = [1] + [3 + (7 * i + len(rid)) % 250 for i in range(n - 1)]
    return {
        "request_id": rid,
        "prompt_token_ids": prompt,
        "sampling": {"max_tokens": 8, "temperature": 0.0, "top_p": 1.0},
    }


def test_a_prefill_sent_again_while_its_first_attempt_is_in_a_step_answers_and_leaks_nothing(serve_factory):
    """The router re-sends a prefill under the same request id when it gave up on the first attempt (its progress
    deadline on a worker frozen mid-step, SIGSTOP). Here the first attempt is inside a long engine step (fault hook
    ``block_step_ms``) when its caller leaves and the same id comes again. Before: the first attempt's output of that
    step went to the new attempt's stream, which answered "request was aborted during prefill" while the new
    sequence prefilled later with nobody to take it: its 113 KV blocks stayed used for good. And an id whose earlier
    attempt's KV was still staged (its abort lost with the frozen worker) got a 500 "already staged"."""
    server = serve_factory()
    prefill = next(w for w in server.workers() if w["role"] == "prefill")
    purl, n = prefill["url"], 1800

    def status() -> dict:
        return http("GET", f"{purl}/internal/status")[1]

    async def post(s: aiohttp.ClientSession, body: dict) -> tuple[int, dict]:
        async with s.post(f"{purl}/internal/prefill", json=body) as r:
            return r.status, json.loads(await r.read())

    async def main() -> list[tuple[int, dict]]:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=120)) as s:
            first = asyncio.ensure_future(post(s, _prefill_body("again-0", n)))
            while not (await asyncio.to_thread(status))["in_step"]:
                await asyncio.sleep(0.01)
            first.cancel()  # the router gives up on it (its connection closes) ...
            await asyncio.sleep(0.2)
            answers = [await post(s, _prefill_body("again-0", n))]  # ... and sends the same id again
            # the same id once more, its earlier attempt's KV still staged (never pulled, its abort lost)
            answers.append(await post(s, _prefill_body("again-0", n)))
            return answers

    http("POST", f"{purl}/admin/fault", {"block_step_ms": 1500})
    try:
        answers = asyncio.run(main())
    finally:
        http("POST", f"{purl}/admin/fault", {})
    for code, answer in answers:
        assert code == 200, answer
        assert answer["error"] is None and not answer["finished"] and answer["kv"], answer
    http("POST", f"{purl}/internal/abort", {"request_id": "again-0"})  # the router's abort: its staged KV goes
    _wait(lambda: status()["kv_blocks_used"] == 0 and status()["num_staged_kv"] == 0, 10, "KV blocks freed")
    assert_no_leaks(server)
