"""Shared guards and host snapshots for the chaos tests.

Drills need root (namespaces, tc, nftables, sysctl, cgroups): without it they skip
and say why — never a false pass. ``host_snapshot`` records what a drill may touch
so a test can assert it came back exactly.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def need_root(*tools: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces, tc, nftables, sysctl, cgroups)")
    for t in tools:
        if shutil.which(t) is None:
            pytest.skip(f"needs `{t}` (apt-get install -y {'nftables' if t == 'nft' else t})")


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def host_snapshot() -> dict:
    """What a drill may change on the host: global sysctls, our netns / cgroups, qdiscs, nft tables."""
    snap = {
        k: " ".join(_read(f"/proc/sys/{k.replace('.', '/')}").split())
        for k in ("net.core.rmem_max", "net.core.wmem_max", "net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem")
    }
    snap["netns"] = (
        sorted(n for n in os.listdir("/run/netns") if n.startswith("dschaos")) if os.path.isdir("/run/netns") else []
    )
    snap["links"] = sorted(n for n in os.listdir("/sys/class/net") if n.startswith("dsc"))
    cg = []
    for root in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified", "/sys/fs/cgroup/memory"):
        if os.path.isdir(root):
            cg += [f"{root}/{n}" for n in os.listdir(root) if n.startswith("distserve-chaos")]
    snap["cgroups"] = sorted(cg)
    if shutil.which("tc"):  # qdiscs on the drill's links (host side)
        out = subprocess.run(["tc", "qdisc", "show"], capture_output=True, text=True, check=False).stdout
        snap["qdiscs"] = sorted(line for line in out.splitlines() if " dev dsc" in line)
    if shutil.which("nft"):
        out = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True, check=False).stdout
        snap["nft"] = sorted(line for line in out.splitlines() if "dschaos" in line)
    return snap


def run_drill(
    path: str | Path, out: Path, timeout: float = 400, env: dict | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "distserve.server.cli", "chaos", "drill", str(path), "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        check=False,
    )
