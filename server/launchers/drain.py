"""Drain one worker before it leaves: out of rotation, its requests finish (or migrate), its KV freed.

A scale-down must not lose or cut a request. The procedure, over the router's and the worker's HTTP
control planes (admin token):

1. ``POST /drain`` at the router: the worker is never picked again; streams already routed to it go on.
2. Wait until it is idle: the router routes nothing to it (``inflight`` 0, counted from the pick, so a
   request picked just before step 1 is waited for) and the worker itself reports no waiting, running or
   reserving request, no staged KV left for a decode worker to pull, and no KV block in use. Idle must be
   seen twice in a row, a poll apart, so a hand-off between the router's count and the worker's is not
   taken for idle.
3. Past the timeout, the worker is reported dead to the router (``/deregister`` with a reason): every
   stream still waiting on it fails at once and migrates (re-prefilled with its tokens so far on a live
   pair; sampling is seeded per token index, so the client sees the same tokens).

The caller then stops the process (SIGTERM): it deregisters with its own pid and exits.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import aiohttp

_BUSY_FIELDS = ("num_waiting", "num_running", "num_reserving", "num_staged_kv", "kv_blocks_used")


@dataclass(frozen=True)
class DrainResult:
    worker_id: str
    idle: bool  # went idle within the timeout (False: the rest were migrated)
    seconds: float
    kv_blocks_used: int | None  # when the drain ended (None: not known, the worker was gone)
    detail: str

    def to_dict(self) -> dict:
        return {
            "worker_id": self.worker_id,
            "idle": self.idle,
            "seconds": round(self.seconds, 3),
            "kv_blocks_used": self.kv_blocks_used,
            "detail": self.detail,
        }


async def _router_view(http: aiohttp.ClientSession, router_url: str, worker_id: str) -> dict | None:
    async with http.get(f"{router_url}/v1/workers") as r:
        r.raise_for_status()
        body = await r.json()
    return next((w for w in body["workers"] if w["worker_id"] == worker_id), None)


async def _worker_status(http: aiohttp.ClientSession, worker_url: str) -> dict | None:
    try:
        async with http.get(f"{worker_url}/internal/status") as r:
            return await r.json() if r.status == 200 else None
    except (aiohttp.ClientError, TimeoutError, OSError):
        return None


async def drain_worker(
    router_url: str, token: str, worker_id: str, timeout_s: float, poll_s: float = 0.1
) -> DrainResult:
    t0 = time.monotonic()
    headers = {"Authorization": f"Bearer {token}"}
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=5)) as http:
        async with http.post(f"{router_url}/drain", json={"worker_id": worker_id}) as r:
            if r.status == 404:  # not registered (never joined, or already gone): nothing routed to it
                return DrainResult(worker_id, True, time.monotonic() - t0, None, "not registered at the router")
            r.raise_for_status()
        idle_polls, used = 0, None
        while time.monotonic() - t0 < timeout_s:
            view = await _router_view(http, router_url, worker_id)
            if view is None or view["state"] == "dead":
                return DrainResult(
                    worker_id, view is None, time.monotonic() - t0, None, "left the router while draining"
                )
            status = await _worker_status(http, view["url"])
            used = status.get("kv_blocks_used") if status else None
            busy = view["inflight"] > 0 or status is None or any(status.get(k, 0) for k in _BUSY_FIELDS)
            idle_polls = 0 if busy else idle_polls + 1
            if idle_polls >= 2:
                return DrainResult(
                    worker_id,
                    True,
                    time.monotonic() - t0,
                    used,
                    "idle: no request in flight, no staged KV, no KV block in use",
                )
            await asyncio.sleep(poll_s)
        reason = f"drain timeout after {timeout_s:g} s; its remaining requests migrate"
        async with http.post(f"{router_url}/deregister", json={"worker_id": worker_id, "reason": reason}):
            pass
        return DrainResult(worker_id, False, time.monotonic() - t0, used, reason)
