"""The deployment a drill runs against: a remote one (URL + token), or one it starts here.

A local target is a router and its workers as child processes of the drill
(``python -m distserve.server.cli router|worker``), each with its own config file so a
drill can give one role a different budget (e.g. a small prefill KV pool). With
``decode_netns: true`` the first decode worker runs inside a fresh network
namespace (`chaos.injectors.netns`), the router and prefill workers bind the
root side of the veth, and KV moves over ``tcp`` across that link: a second host
on one machine. Children are stopped by PID; the namespace is removed.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from distserve.chaos.injectors import netns as netns_injector
from distserve.chaos.sysutil import sysctl_set
from distserve.chaos.workers import TOKEN_ENV, list_workers


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in (over or {}).items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@dataclass
class Target:
    spec: dict
    log_dir: Path
    url: str = ""
    token: str = ""
    netns: dict | None = None
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    counter: int = 0
    backup: Target | None = None

    @property
    def local(self) -> bool:
        return not self.spec.get("url")

    def context(self) -> dict:
        """Values drills may refer to as {router}, {token}, {netns}, {host_ip}, {ns_ip}, {max_seq_len}."""
        ctx = {"router": self.url, "token": self.token, "max_seq_len": self.max_seq_len()}
        if self.netns:
            ctx.update(netns=self.netns["netns"], host_ip=self.netns["host_ip"], ns_ip=self.netns["ns_ip"])
        return ctx

    def max_seq_len(self) -> int:
        return int(self._config("prefill").get("prefill", {}).get("max_seq_len", 2048))

    def _config(self, role: str) -> dict:
        from distserve.server.config import load_config

        base = load_config(None, self.spec.get("config") or {}).to_dict()
        return _merge(base, self.spec.get(f"{role}_config") or {})

    def _config_file(self, role: str) -> str:
        path = self.log_dir / f"config-{role}.yaml"
        path.write_text(yaml.safe_dump(self._config(role)))
        return str(path)

    def _spawn(
        self, name: str, argv: list[str], netns: str | None = None, module: str = "distserve.server.cli"
    ) -> subprocess.Popen:
        env = dict(os.environ, **{TOKEN_ENV: self.token, "OMP_NUM_THREADS": "1"})
        # --parent-pid: the child exits if the drill dies without stopping it (even by SIGKILL)
        cmd = [sys.executable, "-m", module, *argv, "--parent-pid", str(os.getpid())]
        if netns:
            cmd = ["ip", "netns", "exec", netns, *cmd]  # exec's the command: the PID is the worker's
        with open(self.log_dir / f"{name}.log", "ab") as out:
            p = subprocess.Popen(
                cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=os.getcwd()
            )
        self.procs[name] = p
        return p

    def start(self, timeout_s: float = 180.0) -> None:
        if not self.local:
            self.url = self.spec["url"].rstrip("/")
            self.token = os.environ.get(self.spec.get("token_env", TOKEN_ENV), "")
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.token = secrets.token_hex(16)
        if self.spec.get("backup"):  # a second deployment as the breaker's backup pool, started first
            self.backup = Target(self.spec["backup"], self.log_dir / "backup")
            self.backup.start(timeout_s)
            router_cfg = dict((self.spec.get("config") or {}).get("router") or {})
            router_cfg["backup_pool"] = [self.backup.url]
            self.spec = {**self.spec, "config": {**(self.spec.get("config") or {}), "router": router_cfg}}
        host = "127.0.0.1"
        if self.spec.get("decode_netns"):
            self.netns = netns_injector.inject()
            host = self.netns["host_ip"]
            for key, value in (self.spec.get("netns_sysctls") or {}).items():  # a tuned second host
                sysctl_set(key, str(value), self.netns["netns"])
        ready = Path(tempfile.mkdtemp(prefix="dschaos-")) / "router.json"
        router = self._spawn(
            "router",
            [
                "router",
                "--config",
                self._config_file("router"),
                "--host",
                host,
                "--port",
                "0",
                "--ready-file",
                str(ready),
            ],
        )
        deadline = time.monotonic() + timeout_s
        while not ready.exists():
            if router.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"router did not start (see {self.log_dir}/router.log)")
            time.sleep(0.05)
        self.url = json.loads(ready.read_text())["url"]
        for _ in range(int(self.spec.get("prefill", 1))):
            self.add_worker("prefill")
        for i in range(int(self.spec.get("decode", 1))):
            self.add_worker("decode", in_netns=(i == 0 and self.netns is not None))
        for _ in range(int(self.spec.get("colocated", 0))):
            self.add_worker("colocated")
        self.wait_workers(
            sum(int(self.spec.get(r, d)) for r, d in (("prefill", 1), ("decode", 1), ("colocated", 0))), deadline
        )

    def add_worker(self, role: str, in_netns: bool = False) -> str:
        """Start one more worker (also mid-drill: a hot join); its worker id."""
        wid = f"{role}-{self.counter}"
        self.counter += 1
        ns = self.netns or {}
        host = ns["ns_ip"] if in_netns else ns.get("host_ip", "127.0.0.1")
        module = self.spec.get(f"{role}_module", "distserve.server.cli")
        self._spawn(
            wid,
            [
                "worker",
                "--role",
                role,
                "--router",
                self.url,
                "--config",
                self._config_file(role),
                "--host",
                host,
                "--worker-id",
                wid,
            ],
            netns=ns["netns"] if in_netns else None,
            module=module,
        )
        return wid

    def restart_worker(self, worker_id: str) -> None:
        """Start a worker again under its id, with its original command (a supervisor's restart)."""
        old = self.procs[worker_id]
        if old.poll() is None:
            raise RuntimeError(f"{worker_id} is still running")
        with open(self.log_dir / f"{worker_id}.log", "ab") as out:
            self.procs[worker_id] = subprocess.Popen(
                old.args,
                env=dict(os.environ, **{TOKEN_ENV: self.token, "OMP_NUM_THREADS": "1"}),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait_workers(self, expected: int, deadline: float) -> None:
        while True:
            for name, p in self.procs.items():
                died = p.poll() is not None and (name == "router" or p.returncode not in (0, -9, -15))
                if died:
                    raise RuntimeError(f"{name} exited with {p.returncode} (see {self.log_dir}/{name}.log)")
            try:
                if sum(w["healthy"] for w in list_workers(self.url, self.token)) >= expected:
                    return
            except (OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{expected} healthy workers expected; not in time (logs: {self.log_dir})")
            time.sleep(0.2)

    def stop_worker(self, worker_id: str, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int | None:
        p = self.procs.get(worker_id)
        if p is None or p.poll() is not None:
            return None if p is None else p.returncode
        p.send_signal(sig)
        try:
            return p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            return p.wait()

    def stop(self) -> None:
        """SIGCONT (a paused worker cannot die of SIGTERM), SIGTERM, then SIGKILL — by PID, workers first."""
        names = [n for n in self.procs if n != "router"] + (["router"] if "router" in self.procs else [])
        for n in names:
            p = self.procs[n]
            if p.poll() is None:
                for sig in (signal.SIGCONT, signal.SIGTERM):
                    try:
                        p.send_signal(sig)
                    except ProcessLookupError:
                        pass
        deadline = time.monotonic() + 10
        for n in names:
            p = self.procs[n]
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.netns:
            netns_injector.rollback(netns=self.netns["netns"])
            self.netns = None
        if self.backup is not None:
            self.backup.stop()
