"""Real processes over loopback: the launcher, the router and workers as the user starts them.

``ServeProcess`` is distbench's shared start/stop helper (``distbench/target.py``) with the tests' settings.
"""

from __future__ import annotations

import json
import signal
import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from distserve.distbench import target
from distserve.distbench.target import deep_merge

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


def complete(url: str, prompt: str | list[int], max_tokens: int, headers: dict | None = None) -> tuple[int, dict, dict]:
    """POST /v1/completions (ignore_eos; ``prompt`` text or token ids): (status, JSON body, lower-cased headers),
    a 4xx/5xx included."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body, method="POST")
    req.add_header("Content-Type", "application/json")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read()), {k.lower(): v for k, v in r.headers.items()}
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), {k.lower(): v for k, v in e.headers.items()}


class ServeProcess(target.ServeProcess):
    """``distserve serve`` (distbench's shared helper) with fast heartbeats and the test token."""

    def __init__(
        self,
        tmp: Path,
        mode: str = "disaggregated",
        prefill: int = 1,
        decode: int = 1,
        config: dict | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        super().__init__(
            tmp,
            mode=mode,
            prefill=prefill,
            decode=decode,
            config=deep_merge(FAST_HEARTBEATS, config or {}),
            token=TOKEN,
            extra_args=extra_args,
        )


@pytest.fixture(scope="module")
def serve_factory(tmp_path_factory):
    started: list[ServeProcess] = []

    def make(**kw) -> ServeProcess:
        s = ServeProcess(tmp_path_factory.mktemp("serve"), **kw)
        started.append(s)
        return s

    yield make
    for s in started:  # all told to stop first, so their shutdowns overlap
        if s.proc.poll() is None:
            s.proc.send_signal(signal.SIGTERM)
    for s in started:
        s.stop()
