"""Reading a request body under a size and a time bound, in ASGI middleware, then handing it on.

The router's ``BodyLimit`` (server/router/limits.py) and a worker's ``AuthFirst`` (server/workers/guard.py)
both read the whole body before the app sees it: a chunked body is bounded as it arrives, not after.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

Receive = Callable[[], Awaitable[dict]]

TOO_LARGE, TIMED_OUT, DISCONNECTED = 413, 408, 499


async def read_bounded(receive: Receive, max_bytes: int, timeout_s: float) -> bytes | int:
    """The body, or why not: ``TOO_LARGE`` once it crosses ``max_bytes``, ``TIMED_OUT`` when it is not
    received within ``timeout_s``, ``DISCONNECTED`` when the client went away."""
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return DISCONNECTED
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > max_bytes:
                    return TOO_LARGE
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(chunks)
    except TimeoutError:
        return TIMED_OUT


def replaying(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives the app ``body`` first, then what the connection says (a disconnect)."""
    replayed = False

    async def replay() -> dict:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
