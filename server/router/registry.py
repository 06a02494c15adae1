"""The router's view of its workers: who exists, who is healthy, who is least loaded.

Workers push heartbeats carrying their load; a worker whose heartbeats stop
for ``heartbeat_timeout`` is out of rotation until the next one arrives (a
frozen process comes back by itself). A worker the router saw fail mid-request
is marked suspect the same way. Every worker must share one model fingerprint:
KV from one prefill worker has to be readable by any decode worker.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from server.workers.protocol import RegisterRequest, WorkerStatus


class RegistrationRefused(Exception):
    pass


@dataclass
class WorkerInfo:
    worker_id: str
    role: str
    url: str
    pid: int
    fingerprint: dict
    model_path: str | None
    max_model_len: int
    host_id: str
    status: WorkerStatus
    cuda_uuids: list[str] = field(default_factory=list)  # GPUs it can open IPC handles of
    last_seen: float = field(default_factory=time.monotonic)
    registered_at: float = field(default_factory=time.time)
    healthy: bool = True
    inflight: int = 0  # requests the router has sent here and not finished

    def load(self) -> float:
        """Lower is better: router-side in-flight work, the worker's queues, and KV pressure."""
        s = self.status
        total = s.kv_blocks_used + s.kv_blocks_free
        kv_pressure = s.kv_blocks_used / total if total else 0.0
        return self.inflight + s.num_waiting + s.num_reserving + 4.0 * kv_pressure

    def to_dict(self, now: float) -> dict:
        return {
            "worker_id": self.worker_id, "role": self.role, "pid": self.pid, "url": self.url,
            "healthy": self.healthy, "last_heartbeat_s_ago": round(now - self.last_seen, 3),
            "queue_depth": self.status.num_waiting + self.status.num_reserving,
            "num_running": self.status.num_running, "inflight": self.inflight,
            "kv_blocks_used": self.status.kv_blocks_used, "kv_blocks_free": self.status.kv_blocks_free,
            "num_staged_kv": self.status.num_staged_kv, "fingerprint": self.fingerprint,
            "model_path": self.model_path, "max_model_len": self.max_model_len,
        }


class WorkerRegistry:
    def __init__(self, heartbeat_timeout_s: float, forget_after_s: float | None = None) -> None:
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.forget_after_s = forget_after_s if forget_after_s is not None else 20 * heartbeat_timeout_s
        self.workers: dict[str, WorkerInfo] = {}

    def register(self, req: RegisterRequest) -> WorkerInfo:
        self.sweep()
        for other in self.workers.values():
            if other.worker_id != req.worker_id and other.fingerprint != req.fingerprint:
                diff = sorted(k for k in set(other.fingerprint) | set(req.fingerprint)
                              if other.fingerprint.get(k) != req.fingerprint.get(k))
                raise RegistrationRefused(
                    f"model fingerprint mismatch with {other.role} worker {other.worker_id}: "
                    + ", ".join(f"{k}={req.fingerprint.get(k)!r} (registered: {other.fingerprint.get(k)!r})"
                                for k in diff)
                    + "; every prefill and decode worker must serve the same model, dtype and KV layout"
                )
        info = WorkerInfo(
            worker_id=req.worker_id, role=req.role, url=req.url.rstrip("/"), pid=req.pid,
            fingerprint=req.fingerprint, model_path=req.model_path, max_model_len=req.max_model_len,
            host_id=req.host_id, status=req.status, cuda_uuids=list(req.cuda_uuids),
        )
        old = self.workers.get(req.worker_id)
        if old is not None:
            info.inflight = old.inflight
        self.workers[req.worker_id] = info
        return info

    def heartbeat(self, worker_id: str, status: WorkerStatus) -> bool:
        info = self.workers.get(worker_id)
        if info is None:
            return False
        info.status = status
        info.last_seen = time.monotonic()
        info.healthy = True
        return True

    def deregister(self, worker_id: str) -> bool:
        return self.workers.pop(worker_id, None) is not None

    def mark_suspect(self, worker_id: str) -> None:
        """Take a worker out of rotation after a failed call; its next heartbeat restores it."""
        info = self.workers.get(worker_id)
        if info is not None:
            info.healthy = False
            info.last_seen = min(info.last_seen, time.monotonic() - self.heartbeat_timeout_s)

    def sweep(self) -> None:
        now = time.monotonic()
        for wid, info in list(self.workers.items()):
            age = now - info.last_seen
            if age > self.forget_after_s:
                del self.workers[wid]
            elif age > self.heartbeat_timeout_s:
                info.healthy = False

    def healthy(self, role: str) -> list[WorkerInfo]:
        self.sweep()
        return [w for w in self.workers.values() if w.role == role and w.healthy]

    def pick(self, role: str, exclude: frozenset[str] = frozenset()) -> WorkerInfo | None:
        candidates = [w for w in self.healthy(role) if w.worker_id not in exclude]
        if not candidates:
            return None
        return min(candidates, key=lambda w: (w.load(), w.worker_id))

    def mode(self) -> str | None:
        """'disaggregated' when a prefill and a decode worker are healthy, else 'colocated' when a
        colocated worker is, else None."""
        if self.healthy("prefill") and self.healthy("decode"):
            return "disaggregated"
        if self.healthy("colocated"):
            return "colocated"
        return None

    def max_model_len(self) -> int | None:
        lens = [w.max_model_len for w in self.workers.values()]
        return min(lens) if lens else None

    def model_path(self) -> str | None:
        for w in self.workers.values():
            if w.model_path:
                return w.model_path
        return None
