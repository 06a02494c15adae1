"""Injectors alone, against real kernel objects: each inject changes what it says, each rollback
restores the exact prior state (sysctls, qdiscs, nftables, namespaces, cgroups, stopped PIDs)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from distserve.chaos import state
from distserve.chaos.injectors import kv_link, memory_limit, netns, sysctl_drift
from distserve.chaos.sysutil import HostError, pid_state, run, sysctl_get
from tests.chaos.conftest import host_snapshot, need_root


@pytest.fixture
def chaos_state(tmp_path, monkeypatch):
    monkeypatch.setenv(state.ENV, str(tmp_path / "state"))
    return tmp_path / "state"


@pytest.fixture
def ns(chaos_state):
    need_root("ip")
    info = netns.inject()
    yield info
    netns.rollback(netns=info["netns"])


def test_netns_rollback_removes_namespace_and_veth(chaos_state):
    need_root("ip")
    before = host_snapshot()
    info = netns.inject()
    assert os.path.exists(f"/run/netns/{info['netns']}") and os.path.exists(f"/sys/class/net/{info['host_if']}")
    assert netns.rollback(netns=info["netns"])["rolled_back"]
    assert host_snapshot() == before and not list(chaos_state.glob("*.json"))


def test_sysctl_drift_in_namespace_restores_exact_values(ns):
    need_root("sysctl")
    name = ns["netns"]
    run(["sysctl", "-w", "net.ipv4.tcp_rmem=4096 262144 16777216"], netns=name)
    host_before = sysctl_get("net.ipv4.tcp_rmem")
    out = sysctl_drift.inject(netns=name)
    assert out["drifted"]["net.ipv4.tcp_rmem"] == "4096 65536 4194304"
    assert set(out["skipped"]) == {"net.core.rmem_max", "net.core.wmem_max"}  # global keys need allow_host
    assert sysctl_get("net.ipv4.tcp_rmem") == host_before  # the host keeps its value
    sysctl_drift.rollback(netns=name)
    assert sysctl_get("net.ipv4.tcp_rmem", name) == "4096 262144 16777216"


def test_sysctl_drift_refuses_the_host_without_allow_host(chaos_state):
    need_root("sysctl")
    before = host_snapshot()
    out = sysctl_drift.inject(netns=None)
    assert out["drifted"] == {} and len(out["skipped"]) == 4
    sysctl_drift.rollback(netns=None)
    assert host_snapshot() == before


def _listener(host: str) -> tuple[socket.socket, int]:
    s = socket.create_server((host, 0))
    return s, s.getsockname()[1]


def _connect_from(ns_name: str, host: str, port: int, payload: str = "") -> subprocess.CompletedProcess:
    code = (
        f"import socket;s=socket.create_connection(('{host}',{port}),timeout=3);"
        f"s.sendall(b'{payload}');print('connected')"
    )
    return subprocess.run(
        ["ip", "netns", "exec", ns_name, sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_kv_link_partition_and_bandwidth_roll_back(ns):
    need_root("tc", "nft", "ss")
    srv, port = _listener(ns["host_ip"])
    try:
        assert "connected" in _connect_from(ns["netns"], ns["host_ip"], port).stdout
        out = kv_link.inject(netns=ns["netns"], fault="partition", kv_ports=[port])
        assert out["mechanism"] == "nftables drop"
        assert "connected" not in _connect_from(ns["netns"], ns["host_ip"], port).stdout
        kv_link.rollback(netns=ns["netns"])
        assert "connected" in _connect_from(ns["netns"], ns["host_ip"], port).stdout
        assert "dschaos" not in run(["nft", "list", "tables"], netns=ns["netns"])
        kv_link.inject(netns=ns["netns"], fault="bandwidth", rate="4mbit")
        assert " tbf " in run(["tc", "qdisc", "show", "dev", ns["host_if"]])
        kv_link.rollback(netns=ns["netns"])
        assert " tbf " not in run(["tc", "qdisc", "show", "dev", ns["host_if"]])
    finally:
        srv.close()


def test_kv_link_proxy_toxic_is_in_the_path_and_goes_away(ns):
    need_root("nft", "ss")
    srv, port = _listener(ns["host_ip"])
    try:
        out = kv_link.inject(netns=ns["netns"], fault="limit_data", kv_ports=[port], bytes=3)
        [proxy] = out["proxies"]
        assert "userspace proxy" in out["mechanism"]
        assert "connected" in _connect_from(ns["netns"], ns["host_ip"], port, "hello").stdout
        srv.settimeout(5)
        conn, peer = srv.accept()  # the connection arrives from the proxy (root side), not the namespace
        assert peer[0] == ns["host_ip"]
        conn.close()
        kv_link.rollback(netns=ns["netns"])
        for _ in range(50):
            if pid_state(proxy["pid"]) in (None, "Z"):
                break
            time.sleep(0.1)
        assert pid_state(proxy["pid"]) in (None, "Z")
    finally:
        srv.close()


def test_kv_link_loss_uses_netem_or_nftables(ns):
    need_root("tc", "nft", "ss")
    out = kv_link.inject(netns=ns["netns"], fault="loss", percent=20, kv_ports=[5555])
    assert out["mechanism"].startswith(("tc netem", "nftables numgen"))
    kv_link.rollback(netns=ns["netns"])
    assert "dschaos" not in run(["nft", "list", "tables"], netns=ns["netns"])
    assert "netem" not in run(["tc", "qdisc", "show", "dev", ns["host_if"]])


def test_memory_limit_moves_a_process_and_back(chaos_state):
    need_root()
    if memory_limit.cgroup_flavour() is None:
        pytest.skip("no cgroup hierarchy with the memory controller")
    before = host_snapshot()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        out = memory_limit.inject(pid=child.pid, limit_mb=256, key="t")
        with open(f"{out['cgroup']}/cgroup.procs") as f:
            assert str(child.pid) in f.read().split()
        limit_file = "memory.max" if "v2" in out["mechanism"] else "memory.limit_in_bytes"
        with open(f"{out['cgroup']}/{limit_file}") as f:
            assert int(f.read()) == 256 << 20
        back = memory_limit.rollback(pid=child.pid, key="t")
        assert back["rolled_back"] and back["worker_alive"]
        assert host_snapshot() == before
    finally:
        child.kill()
        child.wait()


def test_rollback_without_inject_is_a_noop(chaos_state):
    assert sysctl_drift.rollback(netns="nothing-here") == {"rolled_back": False}
    assert kv_link.rollback(netns="nothing-here") == {"rolled_back": False}


def test_kv_link_refuses_a_namespace_it_did_not_make(chaos_state):
    need_root()
    with pytest.raises(HostError, match="not made by the netns injector"):
        kv_link.inject(netns="dschaos-nonexistent", fault="partition", kv_ports=[1])


def _wait_state(pid: int, want: tuple[str, ...]) -> str | None:
    for _ in range(100):
        st = pid_state(pid)
        if st in want:
            return st
        time.sleep(0.05)
    return pid_state(pid)


def test_pause_stops_and_resumes_exact_pids(chaos_state):
    from distserve.chaos.injectors import pause

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        state.save("pause", "manual", {"pids": []})
        os.kill(child.pid, signal.SIGSTOP)
        state.save("pause", "manual", {"pids": [child.pid]})
        assert _wait_state(child.pid, ("T",)) == "T"  # signal delivery is asynchronous
        assert pause.rollback(key="manual")["resumed"] == [child.pid]
        assert _wait_state(child.pid, ("S", "R")) in ("S", "R")
    finally:
        child.kill()
        child.wait()


def test_planted_chaos_state_is_refused(tmp_path, monkeypatch):
    """State another user could have written is never acted on: a folder owned by someone else, a file
    owned by someone else or writable by others, and, in a file of ours, keys or objects the injector
    does not make (a sysctl outside its list, a link it did not name)."""
    need_root()
    nobody = __import__("pwd").getpwnam("nobody").pw_uid
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o777)
    os.chown(theirs, nobody, nobody)
    monkeypatch.setenv(state.ENV, str(theirs))
    with pytest.raises(state.StateRefused, match="owned by uid"):
        sysctl_drift.rollback(netns="x")
    monkeypatch.setenv(state.ENV, str(tmp_path / "mine"))
    plant = {"netns": None, "previous": {"net.core.rmem_max": [None, "212992"]}}
    state.save("sysctl", "host", plant)
    path = state.state_dir() / "sysctl--host.json"
    os.chown(path, nobody, nobody)
    with pytest.raises(state.StateRefused, match="owned by uid"):
        sysctl_drift.rollback()
    os.chown(path, 0, 0)
    os.chmod(path, 0o666)
    with pytest.raises(state.StateRefused, match="writable by other users"):
        sysctl_drift.rollback()
    before = sysctl_get("kernel.panic")
    state.save("sysctl", "host", {"netns": None, "previous": {"kernel.panic": [None, "0"]}})
    with pytest.raises(state.StateRefused, match="sysctl key"):
        sysctl_drift.rollback()
    assert sysctl_get("kernel.panic") == before
    state.save("netns", "dschaos-planted", {"netns": "dschaos-planted", "host_if": "lo"})
    with pytest.raises(state.StateRefused, match="veth link"):
        netns.rollback(netns="dschaos-planted")
    assert os.path.exists("/sys/class/net/lo")
    # the CLI: refused state is reported, and --all exits 1 (it restored nothing of what was recorded)
    rb = subprocess.run(
        [sys.executable, "-m", "distserve.server.cli", "chaos", "rollback", "--all"],
        capture_output=True,
        text=True,
        env={**os.environ, state.ENV: str(tmp_path / "mine"), "XDG_RUNTIME_DIR": str(tmp_path / "xdg")},
        timeout=60,
    )
    assert rb.returncode == 1, rb.stdout + rb.stderr
    report = json.loads(rb.stdout)
    assert not report["ok"] and len(report["failed"]) == 2 and not report["restored"], report
    assert sysctl_get("kernel.panic") == before and os.path.exists("/sys/class/net/lo")


def test_a_rollback_with_the_wrong_key_exits_non_zero_when_state_is_recorded(tmp_path):
    env = {**os.environ, state.ENV: str(tmp_path / "st"), "XDG_RUNTIME_DIR": str(tmp_path / "xdg")}
    code = "from distserve.chaos import state; state.save('sysctl', 'dschaos-abc', {'netns': 'dschaos-abc', 'previous': {}})"
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    rb = subprocess.run(
        [sys.executable, "-m", "distserve.server.cli", "chaos", "rollback", "sysctl_drift"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert rb.returncode == 1 and "sysctl--dschaos-abc.json" in rb.stderr, rb.stdout + rb.stderr
