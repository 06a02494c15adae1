"""Every data-plane request that reached the router leaves one journal line, whatever its answer.

The request's own code records the requests it serves (``_Run`` and the backup relay call
``SlaLive.record``). Requests answered before that — a 400 naming a field, a 404 model, a 413 or 408
from the body limits, a 503 with no worker, a 429 — used to leave nothing, so an audit of 10 × 503 +
10 × 200 saw only the 200s and passed availability. ``JournalEveryRequest`` is pure ASGI middleware
(no buffering of streams) around the data-plane routes: it notes the response status and, for an
error answer, the message of its JSON body; when the request ends and nothing recorded it, it records
one line with that status and reason. ``SlaLive.record`` marks the request recorded (:func:`mark`)
through a context variable, so no request is written twice.

Which of these count against availability is the audit's rule (``sla/records.py``): 5xx and 429 do;
the client's own faults (other 4xx, 499 client gone or timed out) are journaled and left out.
"""

from __future__ import annotations

import contextvars
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from server.router.sla_live import SlaLive

DATA_PATHS = ("/v1/completions", "/v1/chat/completions", "/generate")
_MAX_ERROR_BODY = 8192


@dataclass
class _Seen:
    recorded: bool = False


_current: contextvars.ContextVar[_Seen | None] = contextvars.ContextVar("distserve_request_journal", default=None)


def mark() -> None:
    """The running request has been journaled (called by ``SlaLive.record``)."""
    seen = _current.get()
    if seen is not None:
        seen.recorded = True


def _reason(body: bytes, status: int) -> str:
    try:
        err = json.loads(body)["error"]
        msg = err["message"] if isinstance(err, dict) else err
        return str(msg)[:512]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status}"


class JournalEveryRequest:
    def __init__(self, app, live: Callable[[], SlaLive | None]) -> None:
        self.app = app
        self.live = live

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] not in DATA_PATHS:
            return await self.app(scope, receive, send)
        seen = _Seen()
        token = _current.set(seen)
        start_mono, start_unix = time.monotonic(), time.time()
        status: int | None = None
        body = bytearray()

        async def watch(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            elif message["type"] == "http.response.body" and status is not None and status >= 400:
                if len(body) < _MAX_ERROR_BODY:
                    body.extend(message.get("body", b"")[: _MAX_ERROR_BODY - len(body)])
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            _current.reset(token)
            live = self.live()
            if live is not None and not seen.recorded:
                from server.router.sla_live import Finished  # sla_live imports mark() from here

                code = status if status is not None else 499  # nothing sent: the client left first
                ok = code < 400
                e2e = time.monotonic() - start_mono
                if status is None:
                    reason: str | None = "client disconnected before an answer"
                else:
                    reason = None if ok else _reason(bytes(body), code)
                live.record(
                    Finished(
                        "primary",
                        start_mono,
                        start_unix,
                        ok,
                        ttft=e2e if ok else None,
                        e2e=e2e if ok else None,
                        error=reason,
                        http_status=code,
                    )
                )
