"""A worker's door: the bearer token is checked on the request head, before one byte of the body is read.

FastAPI reads and parses a route's body before its dependencies run, so a token check written as a
dependency lets an unauthenticated client make the worker receive, buffer and parse any body it sends
(an unauthenticated 400 MB POST froze a decode worker for 20 s and added 2 GB). ``AuthFirst`` is ASGI
middleware in front of the app:

1. every route except ``GET /health`` and ``GET /metrics`` needs ``Authorization: Bearer <admin token>``:
   else 401 at once, ``Connection: close``, the body never read;
2. then the body is bounded: 413 at once when ``Content-Length`` is over ``max_body_bytes``, or as a
   chunked body crosses it; 408 when it is not received within ``body_timeout_s``;
3. the app gets the body it read, replayed.

The limit is derived from the serving limit, not from the router's client limit: an internal request
carries token ids (up to ``prefill.max_seq_len`` of them, prompt and output together, at most a dozen
bytes each in JSON) plus a KV handle (:func:`internal_body_limit`).
"""

from __future__ import annotations

import hmac
import json

from distserve.server.asgi_body import DISCONNECTED, TIMED_OUT, TOO_LARGE, read_bounded, replaying

PUBLIC = {("GET", "/health"), ("GET", "/metrics")}


def internal_body_limit(max_seq_len: int) -> int:
    return 2 * 12 * max_seq_len + (1 << 20)


class AuthFirst:
    def __init__(self, app, token: str, max_body_bytes: int, body_timeout_s: float) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode()
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    @staticmethod
    async def _reply(send, status: int, message: str) -> None:
        body = json.dumps({"detail": message}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or (scope["method"], scope["path"]) in PUBLIC:
            return await self.app(scope, receive, send)
        got = b""
        declared: bytes | None = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                got = value
            elif name == b"content-length":
                declared = value
        if not hmac.compare_digest(got, self.expected):
            return await self._reply(send, 401, "missing or wrong bearer token")
        too_big = f"request body is larger than a worker accepts ({self.max_body_bytes} bytes)"
        if declared is not None:
            try:
                if int(declared) > self.max_body_bytes:
                    return await self._reply(send, 413, too_big)
            except ValueError:
                return await self._reply(send, 400, "Content-Length is not a number")
        if scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        body = await read_bounded(receive, self.max_body_bytes, self.body_timeout_s)
        if body == DISCONNECTED:
            return
        if body == TOO_LARGE:
            return await self._reply(send, 413, too_big)
        if body == TIMED_OUT:
            return await self._reply(send, 408, f"request body not received within {self.body_timeout_s:g} s")
        assert isinstance(body, bytes)
        # after the body: http.disconnect when the router goes away
        await self.app(scope, replaying(body, receive), send)
