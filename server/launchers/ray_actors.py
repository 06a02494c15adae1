"""The Ray actor that holds one distserve process (router or worker) on the node Ray places it on.

The actor asks Ray for the pool's resources (CPU, GPU, custom resources such as ``prefill_node``), so
placement is Ray's; the process it starts is the ordinary ``distserve router`` / ``distserve worker``
command, so registration, heartbeats, KV transfer and shutdown are the local launcher's code, unchanged.
Ray sets ``CUDA_VISIBLE_DEVICES`` in the actor for ``GPU`` resources and the process inherits it.

The process watches the actor's PID (``--parent-pid``): when the actor dies (``ray.kill``, its node's
raylet gone) the process exits within a second, so nothing is left behind on a node Ray gave up on.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ray

from distserve.server.private_files import write_private


class ProcessActor:
    """One distserve process under a Ray actor: start it, report where it runs, wait for it, stop it."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.tmp = Path(tempfile.mkdtemp(prefix="distserve-ray-"))

    def start(self, argv: list[str], env: dict[str, str], config_yaml: str) -> dict:
        """Spawn ``python -m distserve.server.cli ARGV``. ``{config}``, ``{node_ip}`` and ``{ready_file}`` in ARGV are
        replaced by this node's copy of the configuration, its Ray IP address and a ready-file path."""
        config = self.tmp / "config.yaml"
        write_private(config, config_yaml)  # may carry the admin token; the folder is 0700 (mkdtemp)
        node_ip = ray.util.get_node_ip_address()
        subst = {"{config}": str(config), "{node_ip}": node_ip, "{ready_file}": str(self.tmp / "ready.json")}
        cmd = [
            sys.executable,
            "-m",
            "distserve.server.cli",
            *(subst.get(a, a) for a in argv),
            "--parent-pid",
            str(os.getpid()),
        ]
        self.proc = subprocess.Popen(cmd, env={**os.environ, **env}, start_new_session=True)
        return {
            "pid": self.proc.pid,
            "node_ip": node_ip,
            "node_id": ray.get_runtime_context().get_node_id(),
            "actor_pid": os.getpid(),
        }

    async def ready(self, timeout_s: float) -> dict:
        """The process's ready file (the router writes ``{url, pid}`` once it listens)."""
        path = self.tmp / "ready.json"
        deadline = time.monotonic() + timeout_s
        while not path.exists():
            if self.proc is None or self.proc.poll() is not None:
                rc = None if self.proc is None else self.proc.returncode
                raise RuntimeError(f"process exited with status {rc} before it was ready")
            if time.monotonic() > deadline:
                raise RuntimeError(f"process not ready after {timeout_s:g} s")
            await asyncio.sleep(0.05)
        return json.loads(path.read_text())

    async def wait_exit(self) -> int:
        """Resolves with the exit status when the process ends (an error instead if the actor is lost)."""
        while self.proc is not None and self.proc.poll() is None:
            await asyncio.sleep(0.2)
        return self.proc.returncode if self.proc is not None else -1

    async def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM (a worker deregisters and exits), SIGKILL after ``grace_s``."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while self.proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def remote_process_actor():
    """``ProcessActor`` as a Ray actor class (made on first use, so importing this module is cheap)."""
    return ray.remote(max_restarts=0, max_concurrency=16)(ProcessActor)
