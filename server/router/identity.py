"""Worker identity: a credential per registration, and who may take a worker id.

The admin token lets a process *register*; it does not make it the owner of a worker id. At each
accepted registration the router issues a credential for that id, ``HMAC(admin token, worker id +
nonce)`` with a fresh random nonce, and answers it in the registration reply. Every later call a
worker makes about itself — heartbeat, its own goodbye (``/deregister`` without a reason), a
re-registration of the same live process — must carry it in ``X-Worker-Credential``; a wrong one is
refused 403. A new process (or anyone else) asking for an id whose holder is live is refused 409,
until the holder is proven gone:

- deregistered (the id is no longer listed),
- reported dead (the launcher saw its process exit, or nothing listened at its address), or
- silent past the heartbeat timeout (state ``stale``), or forgotten after that.

So a restarted worker gets its id back as soon as the launcher reports the old process dead (the
local and the Ray launcher both do, before they restart it), and a worker whose router restarted
registers afresh (the new router knows no credential for it). The launcher's reports (``/deregister``
with a reason, ``/drain``) are admin actions and take the admin token only: the launcher is the
authority on its children. See docs/SECURITY.md for the threat model.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass, field

from distserve.server.router.registry import DEAD, STALE, WorkerRegistry
from distserve.server.wire import CREDENTIAL_HEADER

__all__ = ["CREDENTIAL_HEADER", "IdInUse", "WorkerIdentities"]


class IdInUse(Exception):
    """A registration asked for the id of a live worker without that worker's credential (409)."""


@dataclass
class WorkerIdentities:
    token: str
    _issued: dict[str, str] = field(default_factory=dict)  # worker id -> its current credential

    def issue(self, worker_id: str) -> str:
        nonce = secrets.token_hex(16)
        cred = hmac.new(self.token.encode(), f"{worker_id}\0{nonce}".encode(), hashlib.sha256).hexdigest()
        self._issued[worker_id] = cred
        return cred

    def holds(self, worker_id: str, presented: str | None) -> bool:
        """Whether ``presented`` is the current credential of ``worker_id`` (constant-time compare)."""
        cred = self._issued.get(worker_id)
        return cred is not None and presented is not None and hmac.compare_digest(cred, presented)

    def admit(self, registry: WorkerRegistry, worker_id: str, presented: str | None) -> None:
        """Raise :class:`IdInUse` unless a registration for ``worker_id`` may go ahead."""
        registry.sweep()  # a holder silent past the heartbeat timeout is stale by now
        info = registry.workers.get(worker_id)
        if info is None or info.state in (DEAD, STALE):
            return  # proven gone: deregistered, forgotten, reported dead, or heartbeats timed out
        if self.holds(worker_id, presented):
            return  # the holder itself registering again (e.g. after a heartbeat timed out on its side)
        raise IdInUse(
            f"worker_id: {worker_id!r} is held by a live {info.role} worker (pid {info.pid}); a second "
            "registration is accepted only once that one is deregistered, reported dead or silent past "
            "router.heartbeat_timeout_ms"
        )

    def forget(self, worker_id: str) -> None:
        self._issued.pop(worker_id, None)
