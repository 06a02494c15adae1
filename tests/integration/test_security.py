"""Security and data integrity against one real ``distserve serve`` (router + prefill + decode processes),
as a second local user (``nobody``) and as an operator with a full journal disk would meet it.

One deployment for the whole module (start-up is the cost): its folder is traversable by others, so the
ready file's own mode is what keeps ``nobody`` out; its request journal lives on a 256 KiB tmpfs that the
journal test fills. Needs root (CI is root) for ``nobody`` and the mount; skipped otherwise.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path

import pytest

from tests.integration.conftest import TOKEN, ServeProcess, http

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: a second user and a tmpfs mount")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def deployment():
    top = Path(tempfile.mkdtemp(prefix="ds-security-"))
    top.chmod(0o755)  # others may enter: only the files' own modes protect them
    journal_fs = top / "journal-fs"
    journal_fs.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(journal_fs)]).returncode != 0:
        shutil.rmtree(top)
        pytest.skip("cannot mount a tmpfs here")
    srv = None
    try:
        srv = ServeProcess(
            top / "serve",
            config={
                "router": {
                    "journal_path": str(journal_fs / "requests.jsonl"),
                    "stream_write_timeout_s": 1.0,
                    "stream_progress_timeout_s": 4.0,
                },
                "cache": {"num_gpu_blocks": 512},
            },
        )
        (top / "serve").chmod(0o755)
        yield srv, journal_fs
    finally:
        if srv is not None:
            srv.stop()
        subprocess.run(["umount", "-l", str(journal_fs)])
        shutil.rmtree(top, ignore_errors=True)


def _as_nobody(code: str, env: dict[str, str]) -> dict:
    """Run ``code`` (Python, prints one JSON object) as the user ``nobody``; its answer."""
    out = subprocess.run(
        ["runuser", "-u", "nobody", "--", shutil.which("python3", path="/usr/bin:/bin") or "python3", "-c", code],
        env={"PATH": os.environ["PATH"], **env},
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


NOBODY = r"""
import json, os, sys, urllib.request, urllib.error
def post(path, body, headers):
    req = urllib.request.Request(os.environ["URL"] + path, data=json.dumps(body).encode(), method="POST")
    for k, v in headers.items():
        req.add_header(k, v)
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
out = {"uid": os.getuid()}
try:
    open(os.environ["READY"]).read()
    out["read_ready"] = True
except PermissionError:
    out["read_ready"] = False
reg = json.loads(os.environ["REG"])
out["no_token"] = post("/register", reg, {})[0]
auth = {"Authorization": "Bearer " + os.environ["LEAKED_TOKEN"], "X-Worker-Credential": os.environ["STALE"]}
out["takeover"] = post("/register", reg, auth)
out["stale_heartbeat"] = post("/heartbeat", {"worker_id": reg["worker_id"]}, auth)[0]
out["stale_goodbye"] = post("/deregister", {"worker_id": reg["worker_id"], "pid": reg["pid"]}, auth)[0]
print(json.dumps(out))
"""


def _wait_state(srv, worker_id: str, cond, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        w = next((w for w in srv.workers() if w["worker_id"] == worker_id), None)
        if w is not None and cond(w):
            return w
        assert time.monotonic() < deadline, w
        time.sleep(0.2)


def _registration(worker_id: str, url: str, pid: int) -> dict:
    return {
        "worker_id": worker_id,
        "role": "decode",
        "url": url,
        "pid": pid,
        "fingerprint": {},
        "max_model_len": 64,
    }


def test_nobody_cannot_read_the_ready_file_nor_take_over_a_worker_id(deployment):
    srv, _ = deployment
    assert stat.S_IMODE(srv.ready.stat().st_mode) == 0o600
    decode = next(w for w in srv.workers() if w["role"] == "decode")
    fingerprint = decode["fingerprint"]
    # A stale registration: a credential the router once issued for this id. Freeze the real worker
    # until its heartbeats time out (its id is then free), register under its id, let it go on.
    os.kill(decode["pid"], signal.SIGSTOP)
    try:
        _wait_state(srv, decode["worker_id"], lambda w: w["state"] == "stale")
        stale_reg = _registration(decode["worker_id"], "http://127.0.0.1:9/attacker", 4242) | {
            "fingerprint": fingerprint
        }
        status, body, _ = http("POST", f"{srv.url}/register", stale_reg)
        assert status == 200 and body["credential"], body
        stale = body["credential"]
    finally:
        os.kill(decode["pid"], signal.SIGCONT)
    # The real worker's next heartbeat is refused (403: not its credential any more); it registers
    # again once the impostor, which never heartbeats, times out, and holds its id with a new credential.
    _wait_state(srv, decode["worker_id"], lambda w: w["pid"] == decode["pid"] and w["state"] == "healthy")
    answer = _as_nobody(
        NOBODY,
        {
            "URL": srv.url,
            "READY": str(srv.ready),
            "REG": json.dumps(stale_reg),
            "LEAKED_TOKEN": TOKEN,  # even with the admin token (say, leaked) and the stale credential
            "STALE": stale,
        },
    )
    assert answer["uid"] != 0 and answer["read_ready"] is False
    assert answer["no_token"] == 401
    status, body = answer["takeover"]
    assert status == 409 and body["error"]["param"] == "worker_id", body
    assert answer["stale_heartbeat"] == 403 and answer["stale_goodbye"] == 403
    w = next(w for w in srv.workers() if w["worker_id"] == decode["worker_id"])
    assert w["url"] != stale_reg["url"] and w["state"] == "healthy"
    status, body, _ = http("POST", f"{srv.url}/v1/completions", {"prompt": "hi", "max_tokens": 3}, token=None)
    assert status == 200 and body["usage"]["completion_tokens"] >= 1


def test_load_figures_are_validated_naming_the_field(deployment):
    srv, _ = deployment
    reg = _registration("probe-1", "http://127.0.0.1:9/probe", 4343) | {"status": {"num_waiting": -5}}
    status, body, _ = http("POST", f"{srv.url}/register", reg)
    assert status == 400 and "num_waiting" in body["error"]["message"], body
    status, body, _ = http("POST", f"{srv.url}/register", reg | {"status": {}, "role": "prefill", "fingerprint": {}})
    if status == 409:  # a fingerprint mismatch with the live workers: register with theirs
        fp = next(w for w in srv.workers() if w["role"] == "decode")["fingerprint"]
        status, body, _ = http("POST", f"{srv.url}/register", reg | {"status": {}, "fingerprint": fp})
    assert status == 200, body
    cred = {"X-Worker-Credential": body["credential"]}
    for bad, field in (({"kv_blocks_used": 2**40}, "kv_blocks_used"), ({"num_running": 1.5}, "num_running")):
        status, body, _ = _post_with(srv.url, "/heartbeat", {"worker_id": "probe-1", "status": bad}, cred)
        assert status == 400 and field in body["error"]["message"], body
    assert _post_with(srv.url, "/deregister", {"worker_id": "probe-1", "pid": 4343}, cred)[0] == 200


def _post_with(url: str, path: str, body: dict, headers: dict) -> tuple[int, dict, dict]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST")
    req.add_header("Authorization", f"Bearer {TOKEN}")
    req.add_header("Content-Type", "application/json")
    for k, v in headers.items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def _stream_big_body(url: str, token: str | None, declared: int) -> tuple[bytes, int]:
    """POST a body of ``declared`` bytes, streamed 1 MiB at a time (never allocated whole), until the
    server answers; (the answer's first bytes, bytes sent by then)."""
    u = urllib.parse.urlsplit(url)
    s = socket.create_connection((u.hostname, u.port), timeout=30)
    head = f"POST /internal/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {declared}\r\n"
    if token:
        head += f"Authorization: Bearer {token}\r\n"
    s.sendall((head + "\r\n").encode())
    chunk = b" " * (1 << 20)
    sent = 0
    try:
        while sent < declared:
            readable, writable, _ = select.select([s], [s], [], 30)
            if readable:
                break
            if writable:
                try:
                    sent += s.send(chunk)
                except (BrokenPipeError, ConnectionResetError):
                    break
        s.settimeout(10)
        return s.recv(4096), sent
    finally:
        s.close()


def test_a_worker_answers_an_unauthenticated_400_mb_post_401_before_reading_it(deployment):
    srv, _ = deployment
    decode = next(w for w in srv.workers() if w["role"] == "decode")
    reply, sent = _stream_big_body(decode["url"], None, 400 << 20)
    assert reply.startswith(b"HTTP/1.1 401"), reply[:200]
    assert sent < 64 << 20, f"the worker read {sent >> 20} MiB before refusing"
    reply, sent = _stream_big_body(decode["url"], TOKEN, 400 << 20)  # authenticated: bounded by the size limit
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert sent < 64 << 20
    status, body, _ = http("POST", f"{srv.url}/v1/completions", {"prompt": "hi", "max_tokens": 2}, token=None)
    assert status == 200, body


def test_a_client_that_never_reads_its_stream_is_disconnected_and_journaled_as_a_client_timeout(deployment):
    srv, fs = deployment
    u = urllib.parse.urlsplit(srv.url)
    body = json.dumps({"prompt": "hi", "max_tokens": 1900, "ignore_eos": True, "stream": True}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window, then never read
    s.connect((u.hostname, u.port))
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    deadline = time.monotonic() + 120
    journal = fs / "requests.jsonl"
    try:
        while True:  # the router cuts it off after stream_write_timeout_s (1 s) of no progress
            lines = [json.loads(x) for x in journal.read_text().splitlines()]
            cut = [x for x in lines if x["kind"] == "request" and "client timeout" in (x.get("error") or "")]
            if cut:
                break
            assert time.monotonic() < deadline, lines[-3:]
            time.sleep(0.5)
        assert cut[-1]["status"] == 499 and cut[-1]["ttft"] is None, cut[-1]
        s.settimeout(10)
        try:  # the connection is gone: reading drains what was buffered, then EOF or reset
            while s.recv(1 << 16):
                pass
        except ConnectionResetError:
            pass
    finally:
        s.close()
    assert srv.wait_kv_free()["used"] == {w["worker_id"]: 0 for w in srv.workers() if w["healthy"]}


def _fill(fs: Path) -> Path:
    filler = fs / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)
    return filler


def _dropped(srv) -> float:
    status, metrics, _ = http("GET", f"{srv.url}/metrics", token=None)
    return next(
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith('distserve_journal_dropped_total{journal="requests"}')
    )


def test_a_full_journal_disk_keeps_serving_health_degraded_and_the_audit_incomplete(deployment, tmp_path):
    srv, fs = deployment
    journal = fs / "requests.jsonl"
    filler = _fill(fs)
    try:
        # The journal's last page still has room for a few lines: serve until the disk refuses one.
        for _ in range(80):
            status, body, _ = http("POST", f"{srv.url}/v1/completions", {"prompt": "hi", "max_tokens": 2}, token=None)
            assert status == 200 and body["choices"][0]["finish_reason"] in ("stop", "length"), body
            if _dropped(srv) >= 2:
                break
        status, text, _ = http(
            "POST", f"{srv.url}/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream": True}, token=None
        )
        assert status == 200 and text.rstrip().endswith("data: [DONE]"), text
        status, health, _ = http("GET", f"{srv.url}/health", token=None)
        assert status == 200 and health["status"] == "degraded", health
        assert any("journal" in r and "dropped" in r for r in health["reasons"]), health
        assert _dropped(srv) >= 2
    finally:
        filler.unlink()
    status, _, _ = http("POST", f"{srv.url}/v1/completions", {"prompt": "hi", "max_tokens": 2}, token=None)
    assert status == 200
    lines = [json.loads(x) for x in journal.read_text().splitlines()]  # every line whole: none torn
    gaps = [x for x in lines if x["kind"] == "journal_gap" and "until_unix" in x]
    assert gaps and gaps[-1]["dropped"] >= 1
    spec = tmp_path / "spec.yaml"
    spec.write_text("name: t\nwindow_s: 3600\navailability: 0.5\nobjectives: []\n")
    out = subprocess.run(
        [sys.executable, "-m", "distserve.server.cli", "sla", "audit", "--spec", str(spec), "--results", str(journal)]
        + ["--out", str(tmp_path / "report"), "--formats", "json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert out.returncode == 3, out.stdout + out.stderr
    report = json.loads((tmp_path / "report" / "compliance.json").read_text())
    assert report["verdict"] == "incomplete" and report["journal_gaps"]
    assert next(o for o in report["overall"] if o["objective"] == "availability")["status"] == "incomplete"


def test_a_restarted_worker_gets_its_id_back(deployment):
    """The launcher reports a SIGKILLed worker dead, then restarts it under the same id: allowed."""
    srv, _ = deployment
    decode = next(w for w in srv.workers() if w["role"] == "decode")
    os.kill(decode["pid"], signal.SIGKILL)
    _wait_state(srv, decode["worker_id"], lambda w: w["pid"] != decode["pid"] and w["state"] == "healthy", 60)
    status, body, _ = http("POST", f"{srv.url}/v1/completions", {"prompt": "hi", "max_tokens": 2}, token=None)
    assert status == 200, body


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(x) for x in (task / "children").read_text().split()]
    return out


def test_serve_restarts_a_frozen_router_on_the_same_port(deployment):
    srv, _ = deployment
    [router] = [p for p in _children(srv.pid) if b"router" in Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")]
    os.kill(router, signal.SIGSTOP)  # frozen: its socket accepts, nothing answers
    deadline = time.monotonic() + 90
    while True:
        try:
            status, health, _ = http("GET", f"{srv.url}/health", token=None, timeout=2)
            if status == 200 and health["mode"] == "disaggregated":
                break
        except OSError:
            pass
        assert time.monotonic() < deadline, srv.read_log()
        time.sleep(0.5)
    assert not Path(f"/proc/{router}").exists() or Path(f"/proc/{router}/status").read_text().find("zombie") >= 0
    # the launcher says so once its new router is ready, and the workers may have registered with it (so /health
    # answered) a moment before that line is written
    while "restarted on the same port" not in (srv.tmp / "serve.log").read_text():
        assert time.monotonic() < deadline, srv.read_log()
        time.sleep(0.1)
    status, body, _ = http("POST", f"{srv.url}/v1/completions", {"prompt": "hi", "max_tokens": 2}, token=None)
    assert status == 200, body


def test_a_prefill_worker_that_hangs_while_heartbeating_does_not_hold_requests(deployment):
    """The engine stalls (the fault hook: a 30 s wait before each step, heartbeats go on): the router gives
    up on the prefill after the progress deadline (4 s here) per attempt (4 attempts), not after the stall
    or request_timeout_s (600 s)."""
    srv, _ = deployment
    prefill = next(w for w in srv.workers() if w["role"] == "prefill")
    status, _, _ = http("POST", f"{prefill['url']}/admin/fault", {"prefill_delay_ms": 30000})
    assert status == 200
    try:
        status, body, _ = http(
            "POST", f"{srv.url}/v1/completions", {"prompt": "hi", "max_tokens": 2}, token=None, timeout=28
        )  # urllib raises TimeoutError if the router held it for the stall
        assert status >= 500, body
    finally:
        http("POST", f"{prefill['url']}/admin/fault", {})
    # the last test of the module: the stalled step still runs; the deployment is stopped next
