"""Thin wrappers over the host tools the injectors drive (ip, tc, nft, sysctl) and /proc.

Injectors act on processes, namespaces and kernel settings — never on server
internals — so everything they need from the host goes through here, with one
error type (`HostError`) whose message names the command that failed.
"""

from __future__ import annotations

import os
import shutil
import subprocess


class HostError(RuntimeError):
    """A host command failed or a precondition (root, a tool) is missing."""


def is_root() -> bool:
    return os.geteuid() == 0


def require_root(what: str) -> None:
    if not is_root():
        raise HostError(f"{what} needs root (run as root or with CAP_NET_ADMIN/CAP_SYS_ADMIN)")


def have(tool: str) -> bool:
    return shutil.which(tool) is not None


def run(argv: list[str], *, netns: str | None = None, check: bool = True, input: str | None = None) -> str:
    """Run a host command (inside ``netns`` when given); stdout, or HostError naming the command."""
    if netns:
        argv = ["ip", "netns", "exec", netns, *argv]
    if not have(argv[0]):
        raise HostError(f"{argv[0]} is not installed (needed for: {' '.join(argv)})")
    p = subprocess.run(argv, check=False, capture_output=True, text=True, input=input, timeout=30)
    if check and p.returncode != 0:
        raise HostError(f"`{' '.join(argv)}` failed ({p.returncode}): {p.stderr.strip() or p.stdout.strip()}")
    return p.stdout


def sysctl_get(key: str, netns: str | None = None) -> str:
    """The value as `sysctl -n` prints it, whitespace normalised to single spaces."""
    return " ".join(run(["sysctl", "-n", key], netns=netns).split())


def sysctl_set(key: str, value: str, netns: str | None = None) -> None:
    run(["sysctl", "-q", "-w", f"{key}={value}"], netns=netns)


def netns_exists(name: str) -> bool:
    return os.path.exists(f"/run/netns/{name}")


def kernel_has_netem() -> bool:
    """True when `tc qdisc ... netem` works: probed on a throw-away dummy device in a throw-away netns."""
    if not is_root() or not have("tc"):
        return False
    ns = f"dsprobe{os.getpid() % 100000}"
    try:
        run(["ip", "netns", "add", ns])
        run(["ip", "link", "add", "probe0", "type", "dummy"], netns=ns)
        p = subprocess.run(
            ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "probe0", "root", "netem", "delay", "1ms"],
            check=False,
            capture_output=True,
            text=True,
            timeout=30,
        )
        return p.returncode == 0
    except HostError:
        return False
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)


def listening_ports(pid: int) -> set[int]:
    """TCP ports a process listens on, from /proc (its socket inodes matched against /proc/PID/net/tcp*)."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError as e:
        raise HostError(f"cannot read the sockets of pid {pid}: {e}") from None
    ports = set()
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                next(f)
                for line in f:
                    cols = line.split()
                    if cols[3] == "0A" and cols[9] in inodes:  # state LISTEN
                        ports.add(int(cols[1].rsplit(":", 1)[1], 16))
        except OSError:
            continue
    return ports


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def pid_state(pid: int) -> str | None:
    """The one-letter state from /proc/PID/stat (R, S, T = stopped, Z, ...), None when gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None
