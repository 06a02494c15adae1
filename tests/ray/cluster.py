"""A real multi-node Ray cluster on one machine, for tests: a head and extra ``ray start`` nodes.

Each node is a ``ray start --block`` process started in a session of its own, bound to its own loopback
address (127.0.0.2, 127.0.0.3, ...: Ray rewrites 127.0.0.1 to the machine's outward address, any other
127/8 address it keeps), with free ports and a temp dir under the test's tmp_path. Stopping a node kills
exactly the processes of its session (the raylet, GCS, Ray's worker processes), by PID: never ``ray stop``,
which kills every Ray process of the user on the machine. The distserve processes those actors started
run in sessions of their own and exit within a second of their actor (they watch its PID).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def session_pids(sid: int) -> list[int]:
    """PIDs of every process in session ``sid`` (ours: each node's ``ray start`` leads its own)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields_ = stat[stat.rindex(")") + 2 :].split()
        if int(fields_[3]) == sid:  # state ppid pgrp session ...
            pids.append(int(entry))
    return pids


def pid_of(sid: int, exe_name: str) -> int | None:
    for pid in session_pids(sid):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == exe_name:
                return pid
        except OSError:
            continue
    return None


@dataclass
class RayNode:
    name: str
    ip: str
    proc: subprocess.Popen
    log: Path

    @property
    def sid(self) -> int:
        return self.proc.pid

    def raylet_pid(self) -> int | None:
        return pid_of(self.sid, "raylet")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Every process of this node's session, by PID."""
        for pid in session_pids(self.sid):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass


@dataclass
class RayCluster:
    root: Path
    env: dict
    nodes: list[RayNode] = field(default_factory=list)
    port: int = 0

    @property
    def address(self) -> str:
        return f"127.0.0.2:{self.port}"

    def _start(self, name: str, ip: str, args: list[str], num_cpus: int, resources: dict) -> RayNode:
        log = self.root / f"{name}.log"
        cmd = [
            str(Path(sys.executable).parent / "ray"),
            "start",
            "--block",
            f"--node-ip-address={ip}",
            f"--num-cpus={num_cpus}",
            "--resources",
            json.dumps(resources),
            "--disable-usage-stats",
            f"--node-manager-port={free_port()}",
            f"--object-manager-port={free_port()}",
            f"--min-worker-port={free_port()}",
            "--max-worker-port=0",
            f"--metrics-export-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}",
            "--object-store-memory=80000000",
            *args,
        ]
        with open(log, "ab") as out:
            proc = subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        node = RayNode(name, ip, proc, log)
        self.nodes.append(node)
        return node

    def start_head(self, num_cpus: int, resources: dict) -> RayNode:
        self.port = free_port()
        return self._start(
            "head",
            "127.0.0.2",
            [
                "--head",
                f"--port={self.port}",
                "--include-dashboard=false",
                f"--dashboard-port={free_port()}",
                f"--temp-dir={self.root / 'tmp'}",
            ],
            num_cpus,
            resources,
        )

    def add_node(self, name: str, ip: str, num_cpus: int, resources: dict) -> RayNode:
        return self._start(name, ip, [f"--address={self.address}"], num_cpus, resources)

    def wait_nodes(self, alive: int, timeout_s: float = 120.0) -> list[dict]:
        """Block until ``alive`` nodes are registered and alive (asked through a short-lived driver)."""
        code = (
            f"import json, ray; ray.init(address={self.address!r}, logging_level='ERROR', log_to_driver=False); "
            "print(json.dumps([{'ip': n['NodeManagerAddress'], 'alive': n['Alive'], 'resources': n['Resources']}"
            " for n in ray.nodes()]))"
        )
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            for n in self.nodes:
                if n.proc.poll() is not None and n.name == "head":
                    raise RuntimeError(f"ray head exited: {n.log.read_text()[-2000:]}")
            r = subprocess.run([sys.executable, "-c", code], env=self.env, capture_output=True, text=True, timeout=120)
            last = r.stderr[-1000:]
            if r.returncode == 0:
                nodes = json.loads(r.stdout.strip().splitlines()[-1])
                if sum(n["alive"] for n in nodes) >= alive:
                    return nodes
            time.sleep(1.0)
        raise RuntimeError(f"{alive} Ray nodes not alive in time: {last}")

    def stop(self) -> None:
        for node in reversed(self.nodes):
            node.kill(signal.SIGTERM)
        time.sleep(1.0)
        for node in reversed(self.nodes):
            node.kill(signal.SIGKILL)
