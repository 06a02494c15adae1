"""Every shipped drill in its short form: it completes, its invariants hold, and the host is back.

Then the ways a drill must fail: a planted defect (a decode worker that keeps the
slots of disconnected clients) makes the slot-leak drill fail on its KV invariant,
and a drill interrupted mid-fault (SIGINT, SIGTERM) still rolls everything back.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.chaos.conftest import ROOT, host_snapshot, need_root, run_drill

pytestmark = pytest.mark.chaos  # whole drills: make test-chaos (CI runs it after make test)

DRILLS = ROOT / "configs" / "drills"
ALWAYS = [
    "worker_pause",
    "worker_kill",
    "slot_leak",
    "prefill_exhaustion",
    "memory_limit",
    "hot_join_leave",
    "sysctl_drift",
    "kv_link",
]


def _journal(out: Path) -> dict:
    return json.loads((out / "journal.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("name", ALWAYS)
def test_drill_completes_and_rolls_back(name, tmp_path):
    need_root("ip", "tc", "nft", "sysctl", "ss")
    before = host_snapshot()
    p = run_drill(DRILLS / f"{name}.yaml", tmp_path / name)
    j = _journal(tmp_path / name)
    failed = [i for i in j["invariants"] if i["status"] == "failed"]
    assert p.returncode == 0 and j["status"] == "completed", (p.stdout + p.stderr)[-3000:]
    assert not failed
    assert any(i["status"] == "passed" and i["name"].startswith("requests") for i in j["invariants"])
    assert any(i["status"] == "passed" and i["name"].startswith("kv blocks") for i in j["invariants"])
    assert (tmp_path / name / "report.md").read_text().startswith(f"# Drill `{name}`")
    assert host_snapshot() == before


@pytest.mark.slow
def test_latency_failover_drill(tmp_path):
    need_root("ip")
    if importlib.util.find_spec("distserve.server.workers.fault") is None:
        pytest.skip("this server build has no worker fault hook (POST /admin/fault) and no SLA breaker yet")
    p = run_drill(DRILLS / "latency_failover.yaml", tmp_path / "lat")
    j = _journal(tmp_path / "lat")
    assert p.returncode == 0 and j["status"] == "completed", (p.stdout + p.stderr)[-3000:]
    assert next(i for i in j["invariants"] if "breaker" in i["name"])["status"] == "passed"


@pytest.mark.slow
def test_planted_slot_leak_makes_the_leak_drill_fail(tmp_path):
    """A decode worker that keeps an aborted request's blocks (tests/chaos/leaky_worker.py)."""
    need_root("ip")
    spec = yaml.safe_load((DRILLS / "slot_leak.yaml").read_text())
    spec["target"]["decode_module"] = "tests.chaos.leaky_worker"
    path = tmp_path / "slot_leak_planted.yaml"
    path.write_text(yaml.safe_dump(spec))
    p = run_drill(path, tmp_path / "leaky")
    j = _journal(tmp_path / "leaky")
    assert p.returncode == 1 and j["status"] == "failed", (p.stdout + p.stderr)[-3000:]
    kv = next(i for i in j["invariants"] if i["name"].startswith("kv blocks"))
    assert kv["status"] == "failed" and "decode" in kv["detail"]


def _drill_state(out: Path) -> list[Path]:
    """The state files of the drill writing to ``out`` (its own sub-folder of the private state folder)."""
    return list((out.parent / "xdg" / "distserve" / "chaos" / "drills").glob(f"{out.name}-*/*.json"))


def _env(out: Path) -> dict:
    """A private state folder per test (``$XDG_RUNTIME_DIR``): ``rollback --all`` sees only this test's drill."""
    xdg = out.parent / "xdg"
    xdg.mkdir(mode=0o700, exist_ok=True)
    return {**os.environ, "XDG_RUNTIME_DIR": str(xdg)}


def _interrupt_mid_fault(drill: str, sig: int, state_glob: str, out: Path) -> tuple[int, dict]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "distserve.server.cli",
            "chaos",
            "drill",
            str(DRILLS / f"{drill}.yaml"),
            "--out",
            str(out),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=_env(out),
    )
    deadline = time.monotonic() + 300
    try:
        while not [p for p in _drill_state(out) if p.match(state_glob)]:  # the fault is in place
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the fault never started"
            time.sleep(0.2)
        proc.send_signal(sig)
        rc = proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return rc, _journal(out)


@pytest.mark.slow
def test_sigint_mid_sysctl_drift_restores_everything(tmp_path):
    need_root("ip", "sysctl", "nft")
    before = host_snapshot()
    rc, j = _interrupt_mid_fault("sysctl_drift", signal.SIGINT, "sysctl--*.json", tmp_path / "int")
    assert rc == 130 and j["status"] == "interrupted"
    assert [r["status"] for r in j["rollbacks"]] == ["succeeded"]
    assert j["rollbacks"][0]["output"]["rolled_back"] is True
    assert not _drill_state(tmp_path / "int")
    assert host_snapshot() == before  # host net.core.rmem_max/wmem_max exactly as before, netns gone


@pytest.mark.slow
def test_sigterm_mid_kv_link_fault_restores_everything(tmp_path):
    need_root("ip", "tc", "nft", "ss")
    before = host_snapshot()
    rc, j = _interrupt_mid_fault("kv_link", signal.SIGTERM, "kv_link--*.json", tmp_path / "term")
    assert rc == 130 and j["status"] == "interrupted"
    assert j["rollbacks"] and all(r["status"] == "succeeded" for r in j["rollbacks"])
    assert host_snapshot() == before  # qdisc, nft tables, proxy, veth and namespace gone


@pytest.mark.slow
def test_sigkill_mid_drill_then_rollback_all_leaves_the_host_exactly_as_before(tmp_path):
    """SIGKILL runs no rollback: the host keeps the drifted global sysctls, the drill's namespace and veth.
    ``distserve chaos rollback --all`` restores them from the recorded state, says what it restored, and
    a second run finds nothing."""
    need_root("ip", "sysctl")
    before = host_snapshot()
    out = tmp_path / "kill"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "distserve.server.cli",
            "chaos",
            "drill",
            str(DRILLS / "sysctl_drift.yaml"),
            "--out",
            str(out),
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=_env(out),
    )
    deadline = time.monotonic() + 300
    try:
        while not [p for p in _drill_state(out) if p.name.startswith("sysctl--")]:
            assert proc.poll() is None and time.monotonic() < deadline, "the fault never started"
            time.sleep(0.2)
        time.sleep(0.5)  # the drift is applied right after its state is written
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    changed = host_snapshot()
    assert changed != before, "the killed drill left nothing to roll back: the test would prove nothing"
    time.sleep(2)  # the drill's router and workers notice their parent is gone and exit
    rb = subprocess.run(
        [sys.executable, "-m", "distserve.server.cli", "chaos", "rollback", "--all"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=_env(out),
        timeout=120,
    )
    assert rb.returncode == 0, rb.stdout + rb.stderr
    report = json.loads(rb.stdout)
    assert report["ok"] and {r["injector"] for r in report["restored"]} >= {"sysctl_drift", "netns"}, report
    assert host_snapshot() == before  # sysctls, qdiscs, nft tables, netns, veth, cgroups
    again = subprocess.run(
        [sys.executable, "-m", "distserve.server.cli", "chaos", "rollback", "--all"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=_env(out),
        timeout=60,
    )
    assert again.returncode == 0 and json.loads(again.stdout)["restored"] == []
