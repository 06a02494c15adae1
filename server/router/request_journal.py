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

import asyncio
import contextvars
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from distserve.server.router.limits import CLIENT_TIMEOUT

if TYPE_CHECKING:
    from distserve.server.router.sla_live import SlaLive

DATA_PATHS = ("/v1/completions", "/v1/chat/completions", "/generate")
_MAX_ERROR_BODY = 8192


@dataclass
class _Seen:
    scope: dict
    recorded: bool = False


_current: contextvars.ContextVar[_Seen | None] = contextvars.ContextVar("distserve_request_journal", default=None)


def mark() -> None:
    """The running request has been journaled (called by ``SlaLive.record``)."""
    seen = _current.get()
    if seen is not None:
        seen.recorded = True


def client_fault() -> str | None:
    """Why the running request's client was cut off (write deadline, whole-request bound), or None."""
    seen = _current.get()
    return None if seen is None else seen.scope.get(CLIENT_TIMEOUT)


def _reason(body: bytes, status: int) -> str:
    try:
        err = json.loads(body)["error"]
        msg = err["message"] if isinstance(err, dict) else err
        return str(msg)[:512]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status}"


class JournalEveryRequest:
    """Also the whole-request bound: a request still running ``request_timeout_s`` + ``GRACE_S`` after it
    arrived (the pipeline bounds generation by ``request_timeout_s``; what is left is a client reading
    slowly) is cut off and journaled as a client timeout."""

    GRACE_S = 5.0

    def __init__(self, app, live: Callable[[], SlaLive | None], request_timeout_s: float | None = None) -> None:
        self.app = app
        self.live = live
        self.budget_s = None if request_timeout_s is None else request_timeout_s + self.GRACE_S

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] not in DATA_PATHS:
            return await self.app(scope, receive, send)
        seen = _Seen(scope)
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
            async with asyncio.timeout(None) as bound:
                expiry = None
                if self.budget_s is not None:
                    loop = asyncio.get_running_loop()

                    def expire() -> None:
                        scope[CLIENT_TIMEOUT] = (
                            f"client timeout: request still running {self.budget_s:g} s after it arrived "
                            "(router.request_timeout_s)"
                        )
                        bound.reschedule(loop.time())

                    expiry = loop.call_later(self.budget_s, expire)
                try:
                    await self.app(scope, receive, watch)
                finally:
                    if expiry is not None:
                        expiry.cancel()
        except TimeoutError:
            if status is None:  # nothing sent yet: say so; else the connection is closed mid-answer
                await send({"type": "http.response.start", "status": 504, "headers": [(b"connection", b"close")]})
                await send({"type": "http.response.body", "body": b""})
        finally:
            _current.reset(token)
            live = self.live()
            if live is not None and not seen.recorded:
                from distserve.server.router.sla_live import Finished  # sla_live imports mark() from here

                fault = scope.get(CLIENT_TIMEOUT)
                code = 499 if fault or status is None else status  # 499: the client left or was cut off
                ok = code < 400
                e2e = time.monotonic() - start_mono
                if fault:
                    reason: str | None = fault
                elif status is None:
                    reason = "client disconnected before an answer"
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
