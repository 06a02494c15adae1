"""Overload without collapse, through the real server: router + prefill + decode processes.

One server for the module (tiny model, fast heartbeats, small admission bounds):
- a long engine step (the fault hook's ``block_step_ms``, a ``time.sleep`` inside the step on the worker's
  event loop) does not make the worker stale (heartbeats come from their own thread), a decode step
  longer than the progress deadline delays its stream without failing it, and a prefill request queued
  behind such steps for longer than the deadline neither fails nor makes its worker suspect;
- a frozen worker (SIGSTOP) still goes stale, and the router logs the transition and the recovery;
- overload gets 429s with Retry-After (OpenAI's rate-limit shape), never a 5xx, and leaves nothing in flight;
- SLO headers: a TTFT SLO the live prediction misses is shed (429), or admitted with ``x-slo-on-miss: queue``,
  or sent to the backup pool; a bad header value is a 400 naming it;
- a router under a low RLIMIT_NOFILE refuses data requests with 503 + Retry-After before running out of
  descriptors, while /health keeps answering;
- shutdown after the overload is quick and leaves no cancelled-handler tracebacks.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.conftest import TOKEN, ServeProcess, http
from tests.stub_server import StubServer

ADMISSION = {"max_queued_requests": 3, "max_inflight_requests": 6}


def _complete(url: str, max_tokens: int = 4, headers: dict | None = None, timeout: float = 120.0):
    import urllib.error
    import urllib.request

    body = json.dumps({"prompt": "hello there", "max_tokens": max_tokens, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body, method="POST")
    req.add_header("Content-Type", "application/json")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            code, raw, hdrs = r.status, r.read(), r.headers
    except urllib.error.HTTPError as e:
        code, raw, hdrs = e.code, e.read(), e.headers
    try:
        body = json.loads(raw)
    except ValueError:  # the stub backup answers SSE
        body = raw.decode(errors="replace")
    return code, body, {k.lower(): v for k, v in hdrs.items()}


@pytest.fixture(scope="module")
def backup():
    with StubServer() as stub:
        yield stub


@pytest.fixture(scope="module")
def server(tmp_path_factory, backup):
    tmp = tmp_path_factory.mktemp("overload")
    router = {"admission": ADMISSION, "backup_pool": [backup.url], "stream_progress_timeout_s": 2.0}
    s = ServeProcess(tmp, config={"router": {**router, "journal_path": str(tmp / "requests.jsonl")}})
    yield s
    s.stop()


def _worker(s: ServeProcess, role: str) -> dict:
    return next(w for w in s.workers() if w["role"] == role)


def _fault(s: ServeProcess, role: str, **body) -> None:
    code, out, _ = http("POST", f"{_worker(s, role)['url']}/admin/fault", body)
    assert code == 200, out


def _router_log(s: ServeProcess) -> str:
    return (s.tmp / "logs" / "router.log").read_text(errors="replace")


def test_a_long_engine_step_does_not_make_the_worker_stale(server):
    # every prefill step blocks the worker's event loop for 2.5 s: 2.5 x the heartbeat timeout (1 s)
    _fault(server, "prefill", block_step_ms=2500)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(_complete, server.url, 2)
            states = []
            while not fut.done():
                states.append(_worker(server, "prefill")["state"])
                time.sleep(0.2)
            code, body, _ = fut.result()
    finally:
        _fault(server, "prefill")
    assert code == 200, body
    assert len(states) >= 5 and set(states) == {"healthy"}, states
    assert "(prefill) stale" not in _router_log(server)


def test_a_long_decode_step_delays_a_stream_but_does_not_fail_it(server):
    # one decode step of 3 s: longer than the progress deadline (2 s here), on a worker that heartbeats
    _fault(server, "decode", block_step_ms=3000)
    try:
        code, body, _ = _complete(server.url, 2)
    finally:
        _fault(server, "decode")
    assert code == 200 and body["usage"]["completion_tokens"] == 2, body
    log = _router_log(server)
    assert "stream broke" not in log and "migrating" not in log, log[-2000:]
    assert _worker(server, "decode")["state"] == "healthy"


def test_a_request_queued_past_the_progress_deadline_neither_fails_nor_makes_the_worker_suspect(server):
    # every prefill step blocks the worker's event loop for 1.5 s; requests sent 0.3 s apart queue behind the
    # running step, so the later ones get nothing for longer than the progress deadline (2 s here)
    _fault(server, "prefill", block_step_ms=1500)
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:  # 3: the admission bound on queued requests here
            futs = []
            for _ in range(3):
                futs.append(pool.submit(_complete, server.url, 2))
                time.sleep(0.3)
            states = []
            while not all(f.done() for f in futs):
                states.append(_worker(server, "prefill")["state"])
                time.sleep(0.1)
            results = [f.result() for f in futs]
    finally:
        _fault(server, "prefill")
    assert [c for c, _, _ in results] == [200] * 3, results
    assert set(states) == {"healthy"}, states
    log = _router_log(server)
    assert "(prefill) suspect" not in log and "nothing arrived" not in log, log[-2000:]


def test_overload_gets_429_with_retry_after_and_never_5xx(server):
    _fault(server, "prefill", block_step_ms=300)  # a slow prefill: a queue forms
    try:
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            results = list(pool.map(lambda _: _complete(server.url, 3), range(16)))
    finally:
        _fault(server, "prefill")
    codes = [c for c, _, _ in results]
    assert all(c in (200, 429) for c in codes), codes
    assert codes.count(429) >= 1 and codes.count(200) >= 3, codes
    for code, body, headers in results:
        if code == 429:
            assert int(headers["retry-after"]) >= 1
            assert body["error"]["code"] == "rate_limit_exceeded" and body["error"]["type"] in ("requests", "tokens")
            assert "router.admission.max_" in body["error"]["message"]
    # nothing stuck: the router's counts and every worker's in-flight count are back to 0
    st = server.get("/v1/admission")
    assert (st["inflight_requests"], st["queued_requests"], st["queued_prefill_tokens"]) == (0, 0, 0)
    assert all(w["inflight"] == 0 for w in server.workers())
    metrics = urllib_get(server.url + "/metrics")
    assert 'distserve_admission_total{decision="shed",reason="max_queued_requests"}' in metrics


def urllib_get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def test_slo_headers_shed_queue_or_route_to_backup(server, backup):
    for _ in range(10):  # the live TTFT model needs measurements first
        assert _complete(server.url, 2)[0] == 200
    st = server.get("/v1/admission")
    assert st["model"]["ready"], st
    # one request held in the queue (slow prefill steps): with nothing queued every request is admitted
    _fault(server, "prefill", block_step_ms=1500)
    pool = concurrent.futures.ThreadPoolExecutor(2)
    try:
        held = pool.submit(_complete, server.url, 2)
        deadline = time.monotonic() + 30
        while server.get("/v1/admission")["queued_requests"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        # no prompt can reach its first token in a microsecond: the prediction misses, the request is shed
        code, body, headers = _complete(server.url, 2, {"x-slo-ttft-ms": "0.001"})
        assert code == 429 and headers["x-distserve-admission"] == "slo_ttft", body
        assert "predicted TTFT" in body["error"]["message"] and int(headers["retry-after"]) >= 1
        # or sent to the backup pool
        before = backup.count
        code, body, headers = _complete(server.url, 2, {"x-slo-ttft-ms": "0.001", "x-slo-on-miss": "backup"})
        assert code == 200 and headers["x-distserve-pool"] == "backup" and backup.count == before + 1, body
        # the client accepts a wait: admitted anyway
        queued = pool.submit(_complete, server.url, 2, {"x-slo-ttft-ms": "0.001", "x-slo-on-miss": "queue"})
        # a generous SLO is met by the prediction: admitted on the primary
        assert _complete(server.url, 2, {"x-slo-ttft-ms": "600000"})[2]["x-distserve-pool"] == "primary"
        code, body, headers = queued.result()
        assert code == 200 and headers["x-distserve-pool"] == "primary", body
        assert held.result()[0] == 200
    finally:
        _fault(server, "prefill")
        pool.shutdown()
    code, body, _ = _complete(server.url, 2, {"x-slo-ttft-ms": "soon"})
    assert code == 400 and body["error"]["param"] == "x-slo-ttft-ms", body
    st = server.get("/v1/admission")
    assert st["prediction_error"]["samples"] >= 1 and st["prediction_error"]["median"] is not None
    assert st["model"]["busy_per_token_ms"] > 0 and st["model"]["idle_call_samples"] >= 1, st["model"]
    assert 'distserve_ttft_model{term="busy_per_token_ms"}' in urllib_get(server.url + "/metrics")
    # each admitted request with a prediction journals it beside its TTFT, with the parts predicted and
    # measured (decode room, prefill call, overhead) and the queue state the prediction read
    lines = [json.loads(x) for x in (server.tmp / "requests.jsonl").read_text().splitlines()]
    predicted = [d for d in lines if d.get("kind") == "request" and d.get("predicted_ttft") is not None]
    assert predicted, lines[-3:]
    for d in predicted:
        parts = d["ttft_parts"]
        assert sum(parts["predicted"]) == pytest.approx(d["predicted_ttft"], abs=1e-5)
        if d["ttft"] is not None:
            assert sum(parts["measured"]) == pytest.approx(d["ttft"], abs=1e-5), d
        assert {"releases", "workers", "queued_requests", "queued_prefill_tokens"} <= set(parts["state"])


def _post(url: str, stream: bool, headers: list[tuple[str, str]], max_tokens: int = 2):
    """POST /v1/completions with ``headers`` sent as given (a name may repeat): (status, JSON or text, headers)."""
    import http.client
    from urllib.parse import urlsplit

    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    body = json.dumps({"prompt": "hello there", "max_tokens": max_tokens, "ignore_eos": True, "stream": stream})
    try:
        conn.putrequest("POST", "/v1/completions")
        for k, v in [("content-type", "application/json"), ("content-length", str(len(body))), *headers]:
            conn.putheader(k, v)
        conn.endheaders(body.encode())
        r = conn.getresponse()
        raw, hdrs = r.read().decode(errors="replace"), {k.lower(): v for k, v in r.getheaders()}
    finally:
        conn.close()
    try:
        return r.status, json.loads(raw), hdrs
    except ValueError:  # a stream's SSE
        return r.status, raw, hdrs


ODD_SLO_VALUES = ("0", "-0", "-5", "", "abc", "50ms", "0x10", "nan", "inf", "-inf", "1e999")


def test_odd_slo_header_values_are_honoured_or_refused_naming_the_header(server):
    """Every SLO header value is either honoured or a 400 naming the header, streaming or not; never accepted and
    ignored. Before: a header sent twice with different values took the first silently, and a TPOT SLO was not
    read at all while nothing was queued (however many streams were decoding)."""
    for stream in (False, True):
        for name in ("x-slo-ttft-ms", "x-slo-tpot-ms"):
            for v in ODD_SLO_VALUES:
                code, body, _ = _post(server.url, stream, [(name, v)])
                assert code == 400 and body["error"]["param"] == name, (stream, name, v, code, body)
                assert body["error"]["message"].startswith(f"{name}: "), body
            code, body, _ = _post(server.url, stream, [(name, "50"), (name, "600000")])
            assert code == 400 and body["error"]["param"] == name and "2 times" in body["error"]["message"], body
        for v in ("", "QUEUE", "drop"):
            code, body, _ = _post(server.url, stream, [("x-slo-ttft-ms", "600000"), ("x-slo-on-miss", v)])
            assert code == 400 and body["error"]["param"] == "x-slo-on-miss", (v, body)
        # floats, a huge finite value, both headers, the same value twice: honoured (met on the primary)
        for hs in (
            [("x-slo-ttft-ms", "600000.5"), ("x-slo-tpot-ms", "1e300")],
            [("x-slo-ttft-ms", " 600000 "), ("x-slo-ttft-ms", " 600000 ")],
        ):
            code, body, headers = _post(server.url, stream, hs)
            assert code == 200 and headers["x-distserve-pool"] == "primary", (hs, code, body)
    # honoured when they miss, streaming or not: a TPOT SLO no stream meets while one decodes (nothing queued),
    # then a TTFT SLO no request meets while one is queued
    for _ in range(3):  # the TPOT of ended requests is measured
        assert _complete(server.url, 4)[0] == 200
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        for role, fault, tokens, name, reason in (
            ("decode", 300, 16, "x-slo-tpot-ms", "slo_tpot"),
            ("prefill", 1500, 2, "x-slo-ttft-ms", "slo_ttft"),
        ):
            _fault(server, role, block_step_ms=fault)
            held = pool.submit(_complete, server.url, tokens)
            deadline = time.monotonic() + 30
            while True:
                st = server.get("/v1/admission")
                if st["inflight_requests"] >= 1 and (st["queued_requests"] == 0) == (role == "decode"):
                    break
                assert time.monotonic() < deadline, st
                time.sleep(0.05)
            for stream in (False, True):
                code, body, headers = _post(server.url, stream, [(name, "0.001")])
                assert code == 429 and headers["x-distserve-admission"] == reason, (stream, name, code, body)
                assert int(headers["retry-after"]) >= 1 and body["error"]["code"] == "rate_limit_exceeded"
            assert held.result()[0] == 200
            _fault(server, role)
    finally:
        _fault(server, "prefill")
        _fault(server, "decode")
        pool.shutdown()


def test_a_frozen_worker_still_goes_stale_and_the_router_says_so(server):
    decode = _worker(server, "decode")
    os.kill(decode["pid"], signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 15
        while _worker(server, "decode")["state"] == "healthy":
            assert time.monotonic() < deadline, "a SIGSTOPped worker was never marked stale"
            time.sleep(0.1)
    finally:
        os.kill(decode["pid"], signal.SIGCONT)
    deadline = time.monotonic() + 15
    while _worker(server, "decode")["state"] != "healthy":
        assert time.monotonic() < deadline, "the worker never came back"
        time.sleep(0.1)
    log = _router_log(server)
    wid = decode["worker_id"]
    assert f"worker {wid} (decode) stale (was healthy): no heartbeat for" in log, log[-2000:]
    assert f"worker {wid} (decode) healthy again after" in log, log[-2000:]


def test_shutdown_after_overload_is_quick_and_quiet(server):
    t0 = time.monotonic()
    server.stop(grace_s=30)
    took = time.monotonic() - t0
    assert server.proc.returncode is not None
    logs = "".join(p.read_text(errors="replace") for p in (server.tmp / "logs").glob("*.log"))
    assert "Cancel" not in logs and "CancelledError" not in logs, logs[-3000:]
    assert took < 25  # not a timing claim: the grace period (30 s) was not needed


def test_a_low_open_file_limit_refuses_data_requests_with_503_before_exhaustion(tmp_path):
    """A router alone under a soft and hard RLIMIT_NOFILE of 256: once its connection budget is used,
    a data request gets 503 + Retry-After while /health still answers."""

    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

    ready = tmp_path / "ready.json"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps({"router": {"port": 0, "admission": {"reserved_fds": 200}}}))
    env = dict(os.environ, DISTSERVE_ADMIN_TOKEN=TOKEN)
    log = open(tmp_path / "router.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "distserve.server.cli", "router", "--config", str(cfg), "--ready-file", str(ready)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        preexec_fn=low_limit,
        cwd=Path(__file__).resolve().parents[2],
    )
    socks: list[socket.socket] = []
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "router.log").read_text()
            time.sleep(0.1)
        url = json.loads(ready.read_text())["url"]
        host, port = url.removeprefix("http://").split(":")
        for _ in range(40):  # budget (256 - 200) / 2 = 28 connections: hold more than that open
            s = socket.create_connection((host, int(port)))
            socks.append(s)
        time.sleep(0.5)
        code, body, headers = http("POST", f"{url}/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert code == 503 and headers["retry-after"] == "1", body
        assert "too many open connections" in body["error"]["message"]
        code, body, _ = http("GET", f"{url}/health")
        assert code == 503 and body["status"] == "down"  # answered (no worker registered), not refused
        assert "too many open connections" not in json.dumps(body)
    finally:
        for s in socks:
            s.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        log.close()
