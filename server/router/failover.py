"""Which pool serves a request, and proxying it to the backup pool.

``maybe_backup`` is called by the OpenAI routes after the request was validated.
It returns a response when the backup pool serves the request, or None when the
primary should (the route then goes on as before):

- breaker says primary and the primary can serve → None;
- breaker says backup (open, or half-open and not a probe), or the primary has no
  healthy workers → try the backup pool; if no backup answers → None (the primary
  serves, or its 503 with Retry-After goes out at once when it cannot either).

Every data-plane response carries ``x-distserve-pool: primary|backup``
(``PoolHeaderMiddleware`` adds ``primary`` where the backup path did not set it).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator, Callable

import aiohttp
from starlette.responses import Response, StreamingResponse

from distserve.server.router.backup_pool import BackupPool
from distserve.server.router.sla_live import Finished, SlaLive

POOL_HEADER = "x-distserve-pool"
DATA_PATHS = ("/v1/completions", "/v1/chat/completions", "/generate")
_CHOICE = re.compile(rb'"choices"\s*:\s*\[\s*\{')  # an SSE event carrying a choice (not usage-only)


async def maybe_backup(
    live: SlaLive,
    backup: BackupPool,
    primary_available: Callable[[], bool],
    path: str,
    body: dict,
    stream: bool,
    arrival: float,
    force_reason: str | None = None,
) -> Response | None:
    """``force_reason``: admission sends this request to the backup whatever the breaker says (counted
    under that reason)."""
    pool = "backup" if force_reason else live.choose_pool()
    if force_reason:
        reason: str | None = f"admission_{force_reason}"
    elif pool == "primary":
        if primary_available() or not backup.configured:
            return None
        reason = "primary_unavailable"
    else:
        reason = None
    upstream = await backup.open(path, body)
    if upstream is None:
        if pool == "backup":
            live.fallbacks.labels("backup_unreachable").inc()
        return None
    if reason:
        live.fallbacks.labels(reason).inc()
    headers = {POOL_HEADER: "backup"}
    media = upstream.headers.get("Content-Type", "application/json")
    start_mono = time.monotonic() - (time.perf_counter() - arrival)
    start_unix = time.time() - (time.perf_counter() - arrival)
    base = getattr(upstream, "backup_base", "")
    if not stream:
        try:  # bounded between reads (progress_timeout_s): a stalled body is a failed backup
            data = await upstream.read()
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            upstream.close()  # never back to the pool half-read
            backup.mark_unhealthy(base, f"body not received: {type(e).__name__}: {e}")
            live.fallbacks.labels("backup_unreachable").inc()
            return None  # nothing reached the client yet: the primary serves it
        upstream.release()
        e2e = time.perf_counter() - arrival
        ok = upstream.status < 400
        live.record(
            Finished(
                "backup",
                start_mono,
                start_unix,
                ok,
                ttft=e2e if ok else None,
                e2e=e2e if ok else None,
                error=None if ok else f"backup HTTP {upstream.status}",
            )
        )
        return Response(data, status_code=upstream.status, media_type=media, headers=headers)

    async def relay() -> AsyncIterator[bytes]:
        first: float | None = None
        last: float | None = None
        itl: list[float] = []
        events = 0
        ok = upstream.status < 400
        finished = False
        try:
            async for chunk in upstream.content.iter_any():
                now = time.perf_counter()
                n = len(_CHOICE.findall(chunk))
                if n:
                    if first is None:
                        first = now
                    elif last is not None:
                        itl.append(now - last)
                    last = now
                    events += n
                yield chunk
            finished = True
        except (TimeoutError, aiohttp.ClientError, OSError) as e:  # broke or stalled mid-stream
            why = f"backup stream broke: {type(e).__name__}: {e}"
            backup.mark_unhealthy(base, why)
            live.record(Finished("backup", start_mono, start_unix, False, error=why))
            if media.startswith("text/event-stream"):  # end it cleanly: an error event, then [DONE]
                err = {"error": {"message": why, "type": "server_error", "code": 502}}
                yield f"data: {json.dumps(err)}\n\n".encode() + b"data: [DONE]\n\n"
            return
        finally:
            if finished:
                upstream.release()
            else:
                upstream.close()  # cut short (client gone, backup stalled): never back to the pool
        end = time.perf_counter()
        ttft = None if first is None else first - arrival
        tpot = (end - first) / (events - 1) if first is not None and events > 1 else None
        live.record(
            Finished(
                "backup",
                start_mono,
                start_unix,
                ok and ttft is not None,
                ttft=ttft,
                tpot=tpot,
                e2e=end - arrival,
                itl=tuple(itl),
                output_tokens=events,
                error=None if ok else f"backup HTTP {upstream.status}",
            )
        )

    return StreamingResponse(relay(), status_code=upstream.status, media_type=media, headers=headers)


class PoolHeaderMiddleware:
    """Pure ASGI (no buffering of streams): adds ``x-distserve-pool: primary`` to data-plane responses."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] not in DATA_PATHS:
            return await self.app(scope, receive, send)

        async def send_with_pool(message):
            if message["type"] == "http.response.start":
                headers = message.get("headers") or []
                if not any(k == b"x-distserve-pool" for k, _ in headers):
                    message["headers"] = [*headers, (b"x-distserve-pool", b"primary")]
            await send(message)

        return await self.app(scope, receive, send_with_pool)
