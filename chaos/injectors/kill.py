"""Worker death: SIGKILL a worker process picked by role or id (the seed's "a worker dies").

No rollback can bring a killed process back; ``rollback`` is a no-op and the
drill checks that the router migrated the dead worker's streams and that the
survivors carry the load.
"""

from __future__ import annotations

import os
import signal

from distserve.chaos.workers import select_workers


def inject(
    router_url: str,
    role: str | None = None,
    worker_id: str | None = None,
    count: int = 1,
    token: str | None = None,
    **_: object,
) -> dict:
    victims = select_workers(router_url, token, role, worker_id, count)
    done = []
    for w in victims:
        try:
            os.kill(int(w["pid"]), signal.SIGKILL)
            done.append({"worker_id": w["worker_id"], "role": w["role"], "pid": w["pid"]})
        except ProcessLookupError:
            pass
    if not done:
        raise RuntimeError("every selected worker was already gone")
    return {"mechanism": "SIGKILL", "killed": done}


def rollback(**_: object) -> dict:
    return {"rolled_back": False, "note": "a killed process cannot be revived; supervision restarts it"}
