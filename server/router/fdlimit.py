"""File descriptors: the router refuses new client work before it runs out of them.

Every client connection holds a descriptor, and each request it streams holds one or two more (the
connections to the prefill and decode workers). At the soft ``RLIMIT_NOFILE`` (1024 on many systems)
``accept()`` fails with EMFILE, ``/health`` stops answering, worker calls fail, and asyncio logs the
failure for every attempt (153 MB of log in 30 s in the first-use report). So:

- ``raise_nofile_limit`` lifts the soft limit to the hard one at start-up;
- ``ConnectionCounter`` counts open client connections (``guarded_http_protocol`` calls it on connect and
  disconnect); its budget is ``router.admission.max_connections``, or by default half of what is left of
  the soft limit after ``reserved_fds`` (room for each request's worker connections, logs, journals);
- ``ConnectionLimit`` (ASGI middleware): over the budget, a data-plane request is answered **503 with
  Retry-After** and ``connection: close`` at once, before its body is read. The control plane (``/health``,
  ``/metrics``, ``/register``, ``/heartbeat``, ...) is never refused: the descriptors held back are theirs.
"""

from __future__ import annotations

import json
import logging
import resource

from distserve.server.lograte import RateLimitedLog

log = logging.getLogger(__name__)

DATA_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/generate"})


def raise_nofile_limit() -> tuple[int, int]:
    """Soft RLIMIT_NOFILE up to the hard limit (capped at 1 << 20); returns the (soft, hard) now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, 1 << 20) if hard != resource.RLIM_INFINITY else 1 << 20
    if soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as e:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, want, e)
    return soft, hard


class ConnectionCounter:
    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.open = 0
        self.refused = 0
        # accepted by the control thread and not yet handed to the main loop (server/router/control.py,
        # ``FrontDoor``): changed by that thread only
        self.sorting = 0

    @classmethod
    def for_limit(cls, soft: int, max_connections: int, reserved_fds: int) -> ConnectionCounter:
        return cls(max_connections or max(8, (soft - reserved_fds) // 2))

    def connected(self) -> None:
        self.open += 1

    def disconnected(self) -> None:
        self.open -= 1

    @property
    def over(self) -> bool:
        return self.open + self.sorting > self.budget


class ConnectionLimit:
    """ASGI middleware: 503 + Retry-After for data-plane requests while connections exceed the budget."""

    def __init__(self, app, counter: ConnectionCounter, retry_after_s: int = 1) -> None:
        self.app, self.counter, self.retry_after_s = app, counter, retry_after_s
        self.log = RateLimitedLog(log)

    async def __call__(self, scope, receive, send) -> None:
        c = self.counter
        if scope["type"] != "http" or not c.over or scope["path"] not in DATA_PATHS:
            return await self.app(scope, receive, send)
        c.refused += 1
        self.log.warning(
            "connections",
            "refusing new requests: %d client connections open, budget %d (open-file limit; "
            "router.admission.max_connections)",
            c.open,
            c.budget,
        )
        body = json.dumps(
            {
                "error": {
                    "message": f"the server has too many open connections ({c.open}, budget {c.budget}); "
                    f"retry after {self.retry_after_s} s",
                    "type": "service_unavailable",
                    "param": None,
                    "code": 503,
                }
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 503,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"retry-after", str(self.retry_after_s).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
