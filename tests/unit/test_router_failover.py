"""Router failover paths in-process: no primary + unreachable backup → 503 at once; no primary →
the backup serves (model rewritten, API key sent, stream relayed); sampling defaults from the config."""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import pytest
from aiohttp import web
from fastapi.testclient import TestClient

from distserve.server.config import RouterConfig, load_config
from distserve.server.router.app import RouterState, create_router_app
from distserve.server.router.backup_pool import endpoint
from distserve.server.router.protocol import CompletionRequest, parse
from distserve.server.router.registry import WorkerRegistry
from distserve.server.router.sampling_defaults import default_sampling


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_client(tmp_path, backup_pool, **router) -> TestClient:
    cfg = load_config(
        overrides={
            "router": {
                "backup_pool": backup_pool,
                "journal_path": str(tmp_path / "j.jsonl"),
                "breaker": {"enabled": True},
                **router,
            }
        }
    )
    state = RouterState(config=cfg, token="t", registry=WorkerRegistry(heartbeat_timeout_s=3.0))
    return TestClient(create_router_app(state))


def test_no_primary_and_backup_unreachable_is_503_at_once(tmp_path):
    with make_client(tmp_path, [f"http://127.0.0.1:{free_port()}"]) as c:
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.headers["x-distserve-pool"] == "primary"
        m = c.get("/metrics").text
        assert "distserve_breaker_state 0.0" in m and "distserve_breaker_enabled 1.0" in m
        st = c.get("/sla/status").json()
        assert st["breaker"]["state"] == "closed" and st["window_s"] == 60


def test_open_breaker_with_unreachable_backup_falls_back_to_primary(tmp_path):
    from distserve.sla.breaker import BreakerState
    from distserve.sla.window import WindowStats

    with make_client(
        tmp_path,
        [f"http://127.0.0.1:{free_port()}"],
        breaker={"enabled": True, "consecutive_s": 0.001, "cooldown_s": 3600},
    ) as c:
        breaker = c.app.state.router.sla.breaker
        breaker.evaluate(WindowStats(5000.0, 100))
        while breaker.state is BreakerState.CLOSED:
            breaker.evaluate(WindowStats(5000.0, 100))
        assert c.get("/sla/status").json()["serving_pool"] == "backup"
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        # the backup is down, so the primary is asked; it has no workers either: 503 at once
        assert r.status_code == 503 and r.headers["x-distserve-pool"] == "primary"
        m = c.get("/metrics").text
        assert 'distserve_pool_fallbacks_total{reason="backup_unreachable"} 1.0' in m
        assert "distserve_breaker_state 1.0" in m


class StubOpenAI:
    """A minimal OpenAI-compatible server standing in for a vLLM backup: echoes what it received."""

    def __init__(self) -> None:
        self.seen: list[dict] = []
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()
        assert self.ready.wait(10)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append({"body": body, "auth": request.headers.get("Authorization")})
        if not body.get("stream"):
            return web.json_response(
                {
                    "object": "text_completion",
                    "model": body["model"],
                    "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}],
                }
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for tok in ("a", "b", "c"):
            chunk = {"model": body["model"], "choices": [{"index": 0, "text": tok, "finish_reason": None}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await asyncio.sleep(0.01)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        runner = web.AppRunner(app)
        self.loop.run_until_complete(runner.setup())
        self.loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self.ready.set()
        self.loop.run_forever()


def test_backup_serves_when_primary_has_no_workers(tmp_path):
    stub = StubOpenAI()
    with make_client(
        tmp_path,
        [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{stub.port}/v1"],
        backup_model="vllm-model",
        backup_api_key="k3y",
    ) as c:
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200 and r.headers["x-distserve-pool"] == "backup"
        assert r.json()["model"] == "vllm-model"
        with c.stream("POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 3, "stream": True}) as r:
            assert r.headers["x-distserve-pool"] == "backup"
            text = "".join(r.iter_text())
        assert text.count("data: {") == 3 and text.endswith("data: [DONE]\n\n")
        assert all(s["auth"] == "Bearer k3y" and s["body"]["model"] == "vllm-model" for s in stub.seen)
        # a bad request is still the router's 400, never forwarded
        assert c.post("/v1/completions", json={"prompt": "hi", "logprobs": 99}).status_code == 400
        assert len(stub.seen) == 2
        m = c.get("/metrics").text
        assert 'distserve_pool_requests_total{pool="backup"} 2.0' in m
        assert 'distserve_pool_fallbacks_total{reason="primary_unavailable"} 2.0' in m
    lines = [json.loads(x) for x in (tmp_path / "j.jsonl").read_text().splitlines()]
    # the router's own 400 is journaled too (status 400: a client fault, left out of availability)
    assert [x["pool"] for x in lines] == ["backup", "backup", "primary"] and lines[1]["output_tokens"] == 3
    assert lines[2]["status"] == 400 and "n" in lines[2]["error"]
    assert lines[1]["ttft"] is not None and len(lines[1]["itl"]) == 2


def test_backup_endpoint_urls():
    assert endpoint("http://h:8000", "/v1/completions") == "http://h:8000/v1/completions"
    assert endpoint("http://h:8000/v1/", "/v1/chat/completions") == "http://h:8000/v1/chat/completions"


@pytest.mark.parametrize(
    "strategy, given, expect",
    [
        ("top_p", {}, (1.0, 0.95)),
        ("top_p", {"top_p": 0.5}, (1.0, 0.5)),
        ("top_p", {"temperature": 0.0}, (0.0, 0.95)),
        ("greedy", {}, (0.0, 1.0)),
        ("greedy", {"temperature": 0.7}, (0.7, 1.0)),
    ],
)
def test_sampling_defaults_from_config(strategy, given, expect):
    req = parse(CompletionRequest, {"prompt": "x", **given})
    assert default_sampling(req, RouterConfig(sampling_strategy=strategy, top_p=0.95)) == expect


def test_fault_request_validation_and_step_choice():
    from pydantic import ValidationError

    from distserve.server.workers.fault import FaultRequest, StepDelays

    d = StepDelays.from_request(FaultRequest(prefill_delay_ms=250, decode_delay_ms=10))
    assert d.for_step(has_waiting=True) == 0.25 and d.for_step(has_waiting=False) == 0.01
    assert StepDelays.from_request(FaultRequest()).to_dict() == {
        "prefill_delay_ms": 0.0,
        "decode_delay_ms": 0.0,
        "block_step_ms": 0.0,
        "stage_delay_ms": 0.0,
    }
    for bad in ({"prefill_delay_ms": -1}, {"decode_delay_ms": 60_001}, {"prefill_delay": 5}):
        with pytest.raises(ValidationError):
            FaultRequest(**bad)


class _StatusPrefill:
    """A prefill worker (stdlib HTTP server, own thread) whose /internal/prefill answers one status."""

    def __init__(self, status: int) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - the stdlib's name
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                code = status if self.path == "/internal/prefill" else 200
                body = json.dumps({"detail": "prompt token 7 is out of range"} if code == 400 else {}).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("worker_status, counted", [(400, False), (500, True)])
def test_a_request_the_worker_refuses_is_not_an_sla_failure(tmp_path, worker_status, counted):
    """A worker's 400 is the client's fault: answered 400, counted "rejected", journaled with status 400,
    which the audit leaves out of availability. A worker's 500 is the server's: a failed request."""
    from distserve.server.wire import RegisterRequest
    from distserve.sla.records import load_records

    fake = _StatusPrefill(worker_status)
    try:
        with make_client(tmp_path, []) as c:
            # no worker comes back after the 500: the wait for one (10 s by default) only delays the answer
            c.app.state.router.pipeline.options.worker_wait_s = 0.2
            reg = c.app.state.router.registry
            for wid, role in (("p0", "prefill"), ("d0", "decode")):
                reg.register(
                    RegisterRequest(worker_id=wid, role=role, url=fake.url, pid=1, fingerprint={}, max_model_len=64)
                )
            r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            metrics = c.get("/metrics").text
        journal = (tmp_path / "j.jsonl").read_text().splitlines() if (tmp_path / "j.jsonl").exists() else []
    finally:
        fake.close()
    if worker_status == 400:
        assert r.status_code == 400 and "out of range" in r.text, r.text
        assert 'distserve_requests_total{status="rejected"} 1.0' in metrics
    else:
        assert r.status_code >= 500, r.text
    assert len(journal) == 1 and json.loads(journal[0])["error"], journal
    assert json.loads(journal[0])["status"] == (400 if worker_status == 400 else 500)
    if counted:
        assert [r.ok for r in load_records([tmp_path / "j.jsonl"]).records] == [False]
    else:
        with pytest.raises(ValueError, match="no request records"):  # the only record is a client fault
            load_records([tmp_path / "j.jsonl"])
