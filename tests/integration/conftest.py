"""Real processes over loopback: the launcher, the router and workers as the user starts them."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

TOKEN = "test-token-not-secret"

FAST_HEARTBEATS = {"router": {"heartbeat_interval_ms": 200, "heartbeat_timeout_ms": 1000, "port": 0}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, body=None, token: str | None = TOKEN, timeout: float = 60.0, raw: bytes | None = None):
    """(status, parsed JSON or text, headers)."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            text = r.read().decode()
            status, headers = r.status, {k.lower(): v for k, v in r.headers.items()}
    except urllib.error.HTTPError as e:
        text, status, headers = e.read().decode(), e.code, {k.lower(): v for k, v in e.headers.items()}
    try:
        return status, json.loads(text), headers
    except json.JSONDecodeError:
        return status, text, headers


def deep_merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


class ServeProcess:
    """``distserve serve`` in a subprocess, stopped by PID."""

    def __init__(self, tmp: Path, mode: str = "disaggregated", prefill: int = 1, decode: int = 1,
                 config: dict | None = None, extra_args: tuple[str, ...] = ()) -> None:
        self.tmp = tmp
        cfg = deep_merge(FAST_HEARTBEATS, config or {})
        cfg_path = tmp / "config.yaml"
        cfg_path.write_text(yaml.safe_dump(cfg))
        self.ready = tmp / "ready.json"
        env = dict(os.environ, DISTSERVE_ADMIN_TOKEN=TOKEN)
        self.log = open(tmp / "serve.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "server.cli", "serve", "--mode", mode, "--prefill", str(prefill),
             "--decode", str(decode), "--config", str(cfg_path), "--ready-file", str(self.ready),
             "--log-dir", str(tmp / "logs"), *extra_args],
            env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 180
        while not self.ready.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited with {self.proc.returncode}: {self.read_log()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"serve did not become ready: {self.read_log()}")
            time.sleep(0.1)
        self.url = json.loads(self.ready.read_text())["url"]

    def read_log(self) -> str:
        return (self.tmp / "serve.log").read_text(errors="replace")[-4000:]

    def workers(self) -> list[dict]:
        status, body, _ = http("GET", f"{self.url}/v1/workers")
        assert status == 200, body
        return body["workers"]

    def wait_kv_free(self, timeout: float = 10.0) -> dict:
        """Blocks used per worker once in-flight aborts settled (heartbeats carry the counts)."""
        deadline = time.monotonic() + timeout
        while True:
            used = {w["worker_id"]: w["kv_blocks_used"] for w in self.workers() if w["healthy"]}
            staged = {w["worker_id"]: w["num_staged_kv"] for w in self.workers() if w["healthy"]}
            if (not any(used.values()) and not any(staged.values())) or time.monotonic() > deadline:
                return {"used": used, "staged": staged}
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def serve_factory(tmp_path_factory):
    started: list[ServeProcess] = []

    def make(**kw) -> ServeProcess:
        s = ServeProcess(tmp_path_factory.mktemp("serve"), **kw)
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop()
