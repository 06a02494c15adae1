"""Frozen worker: SIGSTOP a worker (heartbeats stop, streams stall) and SIGCONT it on rollback.

The stopped PIDs are saved (`chaos.state`) so any process can roll back, and the
rollback resumes exactly those PIDs — never a process found by name.
"""

from __future__ import annotations

import os
import signal

from distserve.chaos import state
from distserve.chaos.workers import select_workers

KIND = "pause"


def _key(role: str | None, worker_id: str | None, key: str | None) -> str:
    return key or worker_id or role or "any"


def inject(
    router_url: str,
    role: str | None = None,
    worker_id: str | None = None,
    count: int = 1,
    token: str | None = None,
    key: str | None = None,
    **_: object,
) -> dict:
    k = _key(role, worker_id, key)
    victims = select_workers(router_url, token, role, worker_id, count)
    stopped = []
    saved = state.load(KIND, k) or {"pids": []}
    for w in victims:
        saved["pids"].append(int(w["pid"]))
        state.save(KIND, k, saved)  # saved before each signal: a crash here still rolls back what was stopped
        os.kill(int(w["pid"]), signal.SIGSTOP)
        stopped.append({"worker_id": w["worker_id"], "role": w["role"], "pid": w["pid"]})
    return {"mechanism": "SIGSTOP", "stopped": stopped}


def rollback(role: str | None = None, worker_id: str | None = None, key: str | None = None, **_: object) -> dict:
    k = _key(role, worker_id, key)
    saved = state.load(KIND, k)
    if not saved:
        return {"rolled_back": False}
    resumed = []
    for pid in saved.get("pids") or []:
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 1:
            raise state.StateRefused(f"chaos state refused: pid {pid!r}")
        try:
            os.kill(pid, signal.SIGCONT)
            resumed.append(pid)
        except ProcessLookupError:
            pass
    state.clear(KIND, k)
    return {"rolled_back": True, "mechanism": "SIGCONT", "resumed": resumed}
