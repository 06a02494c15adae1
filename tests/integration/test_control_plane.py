"""The router's control plane (server/router/control.py) through the real server: router + prefill + decode.

- the workers are told of the control plane at registration and heartbeat there;
- while the router's main event loop is blocked for four heartbeat timeouts (the router's fault hook, a
  synchronous sleep on that loop), ``/health`` is answered on the main port and on the control port, the
  workers stay healthy (no stale line), and their heartbeats keep arriving;
- a worker frozen (SIGSTOP) while the main loop is blocked is reported stale by the control thread's
  ``/health`` before the main loop runs again, and is stale in the registry once it does;
- the control port's ``/heartbeat`` takes the admin token before its body, then the worker's credential,
  and names what is wrong (401, 403, 404, 400 naming the field).

Nothing here is timed: "while the main loop is blocked" is shown by an admin call to the main loop, made after
the block began, that has not been answered yet.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request

import pytest

from tests.integration.conftest import TOKEN, http


@pytest.fixture(scope="module")
def server(serve_factory):
    return serve_factory()


def _workers(server) -> dict:
    status, body, _ = http("GET", server.url + "/v1/workers")
    assert status == 200, body
    return body


def _health(base: str) -> tuple[int, dict]:
    status, body, _ = http("GET", base + "/health", token=None, timeout=60)
    return status, body


def _router_log(server) -> str:
    return (server.tmp / "logs" / "router.log").read_text(errors="replace")


class MainLoopCall(threading.Thread):
    """An admin call answered by the router's main loop: while it is not answered, that loop is blocked."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.answered = url, threading.Event()

    def run(self) -> None:
        http("GET", self.url + "/v1/workers", timeout=120)
        self.answered.set()


def _block_main_loop(server, seconds: float) -> MainLoopCall:
    status, body, _ = http("POST", server.url + "/admin/fault", {"block_loop_ms": seconds * 1000})
    assert status == 200 and body == {"block_loop_ms": seconds * 1000}, body
    call = MainLoopCall(server.url)
    call.start()
    return call


def test_workers_heartbeat_to_the_control_plane(server):
    listed = _workers(server)
    ctl = listed["control_url"]
    assert ctl.startswith("http://127.0.0.1:") and ctl != server.url
    for w in listed["workers"]:
        log = (server.tmp / "logs" / f"{w['worker_id']}.log").read_text(errors="replace")
        assert f"(heartbeats to {ctl})" in log, log[-2000:]
    assert _health(ctl) == _health(server.url)


def test_heartbeats_keep_workers_healthy_while_the_main_loop_is_blocked(server):
    ctl = _workers(server)["control_url"]
    timeout_s = 1.0  # FAST_HEARTBEATS (tests/integration/conftest.py)
    call = _block_main_loop(server, 4 * timeout_s)
    answers = []
    while not call.answered.is_set():  # the main loop is blocked: each answer below came from the control thread
        for base in (server.url, ctl):
            got = _health(base)
            if not call.answered.is_set():
                answers.append(got)
        time.sleep(0.1)
    call.join()
    assert answers, "no /health answer while the main loop was blocked"
    assert all(a == (200, {"status": "ok", "mode": "disaggregated", "workers": a[1]["workers"]}) for a in answers), (
        answers
    )
    assert all(
        a[1]["workers"]["prefill"]["healthy"] == 1 and a[1]["workers"]["decode"]["healthy"] == 1 for a in answers
    )
    for w in _workers(server)["workers"]:
        assert w["state"] == "healthy", w
    log = _router_log(server)
    assert "fault hook: blocking the router's event loop" in log
    assert "stale (was healthy)" not in log, log[-3000:]
    code, body, _ = http(
        "POST",
        server.url + "/v1/completions",
        {"prompt": "hello", "max_tokens": 4, "ignore_eos": True},
        token=None,
    )
    assert code == 200, body


def test_a_worker_frozen_while_the_main_loop_is_blocked_is_reported_stale(server):
    ctl = _workers(server)["control_url"]
    decode = next(w for w in _workers(server)["workers"] if w["role"] == "decode")
    os.kill(decode["pid"], signal.SIGSTOP)
    try:
        call = _block_main_loop(server, 8.0)
        seen_stale_during_block = False
        while not call.answered.is_set():
            code, body = _health(ctl)
            if not call.answered.is_set() and code == 503 and body["workers"]["decode"]["stale"] == 1:
                seen_stale_during_block = True
                assert body["workers"]["prefill"]["healthy"] == 1, body  # still heartbeating
                break
            time.sleep(0.1)
        assert seen_stale_during_block, "the control thread never reported the frozen worker stale"
        call.join()
        deadline = time.monotonic() + 30
        while next(w for w in _workers(server)["workers"] if w["role"] == "decode")["state"] != "stale":
            assert time.monotonic() < deadline, "the registry never marked the frozen worker stale"
            time.sleep(0.1)
    finally:
        os.kill(decode["pid"], signal.SIGCONT)
    deadline = time.monotonic() + 30
    while next(w for w in _workers(server)["workers"] if w["role"] == "decode")["state"] != "healthy":
        assert time.monotonic() < deadline, "the worker never came back"
        time.sleep(0.1)
    assert f"worker {decode['worker_id']} (decode) stale (was healthy): no heartbeat for" in _router_log(server)


def _post(url: str, raw: bytes, headers: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=raw, method="POST", headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_the_control_port_checks_the_token_before_the_body_then_the_credential(server):
    listed = _workers(server)
    url = listed["control_url"] + "/heartbeat"
    wid = listed["workers"][0]["worker_id"]
    auth = {"Authorization": f"Bearer {TOKEN}"}
    code, body = _post(url, b"{not json", {})
    assert code == 401, body  # the body (not JSON) was never read
    code, body = _post(url, b"{not json", {"Authorization": f"Bearer {TOKEN}x"})
    assert code == 401, body
    code, body = _post(url, json.dumps({"worker_id": wid}).encode(), {**auth, "x-worker-credential": "forged"})
    assert code == 403 and body["error"]["param"] == "x-worker-credential", body
    code, body = _post(url, json.dumps({"worker_id": "nobody"}).encode(), auth)
    assert code == 404 and "nobody" in body["error"]["message"], body
    code, body = _post(url, json.dumps({"worker_id": wid, "status": {"num_waiting": "many"}}).encode(), auth)
    assert code == 400 and body["error"]["param"] == "status.num_waiting", body
    code, body = _post(listed["control_url"] + "/register", b"{}", auth)
    assert code == 404, body  # registration stays on the main port
    for w in _workers(server)["workers"]:
        assert w["state"] == "healthy", w  # none of these touched a worker's entry
