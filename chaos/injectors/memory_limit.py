"""A memory cgroup around a worker (seed §4.2's second guard: `cgexec -g memory:distserve-decode`).

Moves the worker's process into a fresh cgroup with a memory limit — cgroup v2
(``memory.max``) where the memory controller is on the unified hierarchy, else
v1 (``memory.limit_in_bytes``) — and reports the cgroup's OOM counters on
rollback, which moves the process back to its previous cgroup and removes ours.
On v1 a moved process's existing pages stay charged where they were, so the
limit bounds what it allocates from now on (``limit_mb``).
"""

from __future__ import annotations

import os
import time

from distserve.chaos import state
from distserve.chaos.sysutil import HostError, pid_alive, require_root
from distserve.chaos.workers import select_workers

KIND = "memory_limit"
V2_ROOTS = ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")
V1_ROOT = "/sys/fs/cgroup/memory"


def cgroup_flavour() -> tuple[str, str] | None:
    """('v2', root) or ('v1', root) of a hierarchy with the memory controller, else None."""
    for root in V2_ROOTS:
        try:
            with open(f"{root}/cgroup.controllers") as f:
                if "memory" in f.read().split():
                    return "v2", root
        except OSError:
            continue
    if os.path.exists(f"{V1_ROOT}/memory.limit_in_bytes"):
        return "v1", V1_ROOT
    return None


def _current_cgroup(pid: int, flavour: str) -> str:
    with open(f"/proc/{pid}/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if (flavour == "v2" and controllers == "") or (flavour == "v1" and "memory" in controllers.split(",")):
                return path
    return "/"


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def counters(cg: str, flavour: str) -> dict:
    out = {}
    try:
        if flavour == "v2":
            with open(f"{cg}/memory.events") as f:
                out = {k: int(v) for k, v in (line.split() for line in f)}
            with open(f"{cg}/memory.peak" if os.path.exists(f"{cg}/memory.peak") else f"{cg}/memory.current") as f:
                out["peak_bytes"] = int(f.read())
        else:
            with open(f"{cg}/memory.failcnt") as f:
                out["failcnt"] = int(f.read())
            with open(f"{cg}/memory.max_usage_in_bytes") as f:
                out["peak_bytes"] = int(f.read())
            with open(f"{cg}/memory.oom_control") as f:
                out.update({k: int(v) for k, v in (line.split() for line in f)})
    except OSError:
        pass
    return out


def _key(role: str | None, worker_id: str | None, pid: int | None, key: str | None) -> str:
    return key or worker_id or (str(pid) if pid else None) or role or "worker"


def inject(
    router_url: str | None = None,
    role: str | None = "decode",
    worker_id: str | None = None,
    pid: int | None = None,
    limit_mb: int = 1024,
    token: str | None = None,
    key: str | None = None,
    **_: object,
) -> dict:
    require_root("creating a memory cgroup")
    fl = cgroup_flavour()
    if fl is None:
        raise HostError("no cgroup hierarchy with the memory controller (v2 or v1) is mounted")
    flavour, root = fl
    k = _key(role, worker_id, pid, key)  # from the arguments alone: rollback gets the same ones
    if pid is None:
        if router_url is None:
            raise ValueError("router_url or pid: name the worker to limit")
        [w] = select_workers(router_url, token, role, worker_id, 1)
        pid = int(w["pid"])
    cg = f"{root}/distserve-chaos-{k}"
    previous = _current_cgroup(pid, flavour)
    state.save(KIND, k, {"pid": pid, "cgroup": cg, "flavour": flavour, "previous": f"{root}{previous}"})
    os.makedirs(cg, exist_ok=True)
    limit = str(limit_mb << 20)
    _write(f"{cg}/memory.max" if flavour == "v2" else f"{cg}/memory.limit_in_bytes", limit)
    _write(f"{cg}/cgroup.procs", str(pid))
    return {
        "mechanism": f"cgroup {flavour} memory limit {limit_mb} MiB",
        "pid": pid,
        "cgroup": cg,
        "previous_cgroup": previous,
    }


def rollback(
    router_url: str | None = None,
    role: str | None = "decode",
    worker_id: str | None = None,
    pid: int | None = None,
    key: str | None = None,
    **_: object,
) -> dict:
    k = _key(role, worker_id, pid, key)
    saved = state.load(KIND, k)
    if not saved:
        return {"rolled_back": False}
    cg, flavour = saved.get("cgroup"), saved.get("flavour")
    fl = cgroup_flavour()
    root = fl[1] if fl else ""
    # only the cgroup this injector makes for this key, and a move back inside the same hierarchy
    if fl is None or flavour != fl[0] or cg != f"{root}/distserve-chaos-{k}" or ".." in k:
        raise state.StateRefused(f"chaos state refused: cgroup {cg!r} is not the one memory_limit makes for {k!r}")
    prev = saved.get("previous")
    if not isinstance(prev, str) or not (prev == root or prev.startswith(root + "/")) or "/.." in prev:
        raise state.StateRefused(f"chaos state refused: previous cgroup {prev!r} is outside {root}")
    if not isinstance(saved.get("pid"), int):
        raise state.StateRefused(f"chaos state refused: pid {saved.get('pid')!r}")
    seen = counters(cg, flavour)
    alive = pid_alive(saved["pid"])
    if alive:
        try:
            _write(f"{saved['previous']}/cgroup.procs", str(saved["pid"]))
        except OSError as e:
            raise HostError(f"could not move pid {saved['pid']} back to {saved['previous']}: {e}") from None
    for _attempt in range(50):  # rmdir fails while the cgroup still has (exiting) tasks
        try:
            os.rmdir(cg)
            break
        except FileNotFoundError:
            break
        except OSError:
            time.sleep(0.1)
    else:
        raise HostError(f"could not remove cgroup {cg}")
    state.clear(KIND, k)
    return {"rolled_back": True, "worker_alive": alive, "counters": seen, "removed": [f"cgroup {cg}"]}
