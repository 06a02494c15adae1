"""First-use rough edges: clear one-line errors before anything starts, help text on every option,
--version, the log level reaching child processes, file modes, and orphaned temporary folders."""

from __future__ import annotations

import argparse
import os
import socket
import stat
import subprocess
import sys

import pytest

from server import preflight
from server.cli import LOG_LEVEL_ENV, build_parser


def test_port_in_use_is_one_sentence():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        msg = preflight.port_problem("127.0.0.1", port)
        assert msg and "already in use" in msg and str(port) in msg
    assert preflight.port_problem("127.0.0.1", 0) is None


def test_serve_on_a_busy_port_exits_2_without_traceback():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run(
            [sys.executable, "-m", "server.cli", "serve", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert r.returncode == 2
    assert "already in use" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_one_sentence():
    assert "CUDA is not available" in preflight.device_problem(["cuda:0"])
    assert preflight.device_problem(["cpu"]) is None
    r = subprocess.run(
        [sys.executable, "-m", "server.cli", "serve", "--device", "cuda", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "CUDA is not available" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize(
    "model,words",
    [
        ("preset:nope", "unknown model preset 'nope'"),
        ("/nonexistent/model", "does not exist"),
        ("{tmp}", "config.json"),
    ],
)
def test_a_model_that_cannot_load_is_one_sentence_before_anything_starts(tmp_path, model, words):
    """Before: every worker died with a traceback and serve said only 'exited with status 1 during start-up'."""
    model = model.format(tmp=tmp_path)  # an empty folder: not a Hugging Face model folder
    assert words in preflight.model_problem(model)
    r = subprocess.run(
        [sys.executable, "-m", "server.cli", "serve", "--model", model, "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_models_that_resolve_pass_the_model_preflight():
    assert preflight.model_problem(None) is None and preflight.model_problem("preset:tiny-gpu") is None


def test_orphaned_launcher_folders_are_swept(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = tmp_path / f"{preflight.TMP_PREFIX}{dead.pid}-abc"
    alive = tmp_path / f"{preflight.TMP_PREFIX}{os.getpid()}-def"
    unrelated = tmp_path / "distserve-cache"
    for d in (orphan, alive, unrelated):
        d.mkdir()
        (d / "config.yaml").write_text("x: 1\n")
    assert preflight.sweep_orphan_tmp(str(tmp_path)) == [orphan]
    assert not orphan.exists() and alive.exists() and unrelated.exists()


def test_every_option_has_help():
    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = []
    for name, sub in subs.choices.items():
        for action in sub._actions:
            if action.option_strings and not action.help:
                missing.append(f"{name} {action.option_strings[0]}")
    assert not missing, missing


def test_version_and_log_level_env(monkeypatch):
    r = subprocess.run([sys.executable, "-m", "server.cli", "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("distserve ")
    monkeypatch.delenv(LOG_LEVEL_ENV, raising=False)
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os, sys; from server.cli import main; "
            "sys.argv=['distserve']; main(['--log-level', 'debug', 'make-tiny-model', sys.argv[0] or "
            "'/nonexistent/x', '--vocab', '10']); print(os.environ['DISTSERVE_LOG_LEVEL'])",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.stdout.strip().endswith("DEBUG"), r.stderr


def test_tiny_model_files_share_one_mode(tmp_path):
    from server.engine.tiny_model import make_tiny_model

    out = make_tiny_model(tmp_path / "m", layers=1, hidden=64, heads=2, kv_heads=2)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert len(set(modes.values())) == 1, modes
