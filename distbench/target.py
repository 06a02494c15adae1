"""Start and stop a ``distserve serve`` for benchmarks, tests, the demo and chaos drills.

The server runs as a subprocess (``python -m distserve.server.cli serve ... --ready-file F``) — distbench never
imports the server — and is stopped by PID: SIGTERM, then SIGKILL after a grace period.

    with ServeProcess(Path("/tmp/x"), mode="colocated") as srv:
        print(srv.url, srv.token)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Self


def deep_merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


class ServeProcess:
    """``distserve serve`` in a subprocess: ``url`` and ``token`` once ready; ``stop()`` by PID."""

    def __init__(
        self,
        workdir: Path | str,
        mode: str = "disaggregated",
        prefill: int = 1,
        decode: int = 1,
        config: dict | None = None,
        token: str | None = None,
        extra_args: list[str] | tuple = (),
        env: dict | None = None,
        timeout_s: float = 180.0,
        cwd: str | Path | None = None,
    ) -> None:
        self.tmp = Path(workdir)
        self.tmp.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "distserve.server.cli",
            "serve",
            "--mode",
            mode,
            "--prefill",
            str(prefill),
            "--decode",
            str(decode),
            "--ready-file",
            str(self.tmp / "ready.json"),
            "--log-dir",
            str(self.tmp / "logs"),
        ]
        if config is not None:
            import yaml

            cfg_path = self.tmp / "config.yaml"
            cfg_path.write_text(yaml.safe_dump(config))
            cmd += ["--config", str(cfg_path)]
        if "--port" not in extra_args:
            cmd += ["--port", "0"]
        cmd += list(extra_args)
        self.ready = self.tmp / "ready.json"
        self.ready.unlink(missing_ok=True)
        full_env = dict(os.environ if env is None else env)
        if token:
            full_env["DISTSERVE_ADMIN_TOKEN"] = token
        self.log = open(self.tmp / "serve.log", "wb")  # noqa: SIM115 - lives as long as the server
        self.proc = subprocess.Popen(cmd, env=full_env, stdout=self.log, stderr=subprocess.STDOUT, cwd=cwd)
        self.pid = self.proc.pid
        deadline = time.monotonic() + timeout_s
        while not self.ready.exists():
            if self.proc.poll() is not None:
                self.log.close()
                raise RuntimeError(f"serve exited with {self.proc.returncode}: {self.read_log()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"serve did not become ready in {timeout_s:.0f} s: {self.read_log()}")
            time.sleep(0.1)
        info = json.loads(self.ready.read_text())
        self.url: str = info["url"]
        self.token: str | None = info.get("token") or token

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def read_log(self) -> str:
        return (self.tmp / "serve.log").read_text(errors="replace")[-4000:]

    def get(self, path: str, timeout: float = 10.0) -> dict:
        req = urllib.request.Request(f"{self.url}{path}")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def workers(self) -> list[dict]:
        return self.get("/v1/workers")["workers"]

    def wait_kv_free(self, timeout: float = 10.0) -> dict:
        """Blocks used and KV staged per healthy worker once in-flight aborts settled (heartbeats carry them)."""
        deadline = time.monotonic() + timeout
        while True:
            ws = [w for w in self.workers() if w["healthy"]]
            used = {w["worker_id"]: w["kv_blocks_used"] for w in ws}
            staged = {w["worker_id"]: w.get("num_staged_kv", 0) for w in ws}
            if (not any(used.values()) and not any(staged.values())) or time.monotonic() > deadline:
                return {"used": used, "staged": staged}
            time.sleep(0.2)

    def stop(self, grace_s: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self.log.closed:
            self.log.close()


def healthy(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False
