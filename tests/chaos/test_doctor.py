"""`distserve doctor`: clean on a host that matches the baseline, exit 1 with the fix command on drift."""

from __future__ import annotations

import json
import subprocess
import sys

from distserve.chaos import state
from distserve.chaos.injectors import netns, sysctl_drift
from distserve.chaos.sysutil import sysctl_set
from tests.chaos.conftest import ROOT, need_root

TCP = "net.ipv4.tcp_rmem,net.ipv4.tcp_wmem"


def _doctor(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "distserve.server.cli", "doctor", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_doctor_sees_sysctl_drift_in_a_namespace_and_prints_the_fix(tmp_path, monkeypatch):
    need_root("ip", "sysctl")
    monkeypatch.setenv(state.ENV, str(tmp_path / "state"))
    info = netns.inject()
    name = info["netns"]
    try:
        for k in ("net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem"):
            sysctl_set(k, "4096 262144 16777216", name)
        ok = _doctor("--only", "sysctl", "--sysctl-keys", TCP, "--netns", name)
        assert ok.returncode == 0, ok.stdout
        sysctl_drift.inject(netns=name)
        bad = _doctor("--only", "sysctl", "--sysctl-keys", TCP, "--netns", name)
        assert bad.returncode == 1
        assert f'ip netns exec {name} sysctl -w net.ipv4.tcp_rmem="4096 262144 16777216"' in bad.stdout
        js = json.loads(_doctor("--only", "sysctl", "--sysctl-keys", TCP, "--netns", name, "--json").stdout)
        assert js["drift"] == 2
        sysctl_drift.rollback(netns=name)
        assert _doctor("--only", "sysctl", "--sysctl-keys", TCP, "--netns", name).returncode == 0
    finally:
        sysctl_drift.rollback(netns=name)
        netns.rollback(netns=name)


def test_doctor_max_seq_len_against_the_model(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("prefill:\n  max_seq_len: 1024\n")
    p = _doctor("--only", "model", "--config", str(cfg))
    assert p.returncode == 1 and "max_seq_len: 2048" in p.stdout  # the tiny model's context length
    assert _doctor("--only", "model").returncode == 0


def test_doctor_bad_input_exits_2():
    p = _doctor("--only", "everything")
    assert p.returncode == 2 and "--only" in p.stderr
