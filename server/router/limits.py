"""Bounds on what one HTTP client can make the router hold: header time, body size, body time.

uvicorn arms no timer until a first response is complete, so a client that opens a connection and
sends nothing, or trickles its headers a byte at a time (slowloris), holds a socket and a protocol
object for ever; and nothing bounds the body a client may send. Here:

- ``guarded_http_protocol(header_timeout_s, write_timeout_s)``: an ``HttpToolsProtocol`` whose
  connections must deliver a complete request head within ``header_timeout_s`` of connecting (or of
  the previous response, for keep-alive), else they are answered 408 and closed; and whose client
  must keep reading its answer: when the connection's write buffer stays full (the transport paused
  writing) for ``write_timeout_s``, the connection is aborted and its request marked
  ``CLIENT_TIMEOUT`` in the ASGI scope, so the journal records a client timeout (499), not a
  success. The kernel send buffer of each connection is fixed at ``SEND_BUFFER_BYTES`` (Linux
  doubles it): autotuned, one never-reading stream could park ~4 MB in the kernel before the
  transport ever paused, so a slow reader went unnoticed and 1 000 of them pinned gigabytes;
- ``BodyLimit``: ASGI middleware that answers 413 at once when ``Content-Length`` is over the
  limit, reads the body itself (so a chunked body is counted as it arrives and cut off at the
  limit, and one that stalls is answered 408 after ``body_timeout_s``), then hands the app the
  body it read. The app's handlers therefore never see more than ``max_bytes``.
"""

from __future__ import annotations

import asyncio
import json
import socket

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from distserve.server.asgi_body import DISCONNECTED, TIMED_OUT, TOO_LARGE, read_bounded, replaying

CLIENT_TIMEOUT = "distserve.client_timeout"  # ASGI scope key: why the client was cut off
SEND_BUFFER_BYTES = 64 << 10


def guarded_http_protocol(
    header_timeout_s: float, write_timeout_s: float | None = None, counter=None
) -> type[HttpToolsProtocol]:
    """``counter``: a ``ConnectionCounter`` (server/router/fdlimit.py) told of every connect and disconnect."""

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        _head_timer: asyncio.TimerHandle | None = None
        _write_timer: asyncio.TimerHandle | None = None

        def pause_writing(self) -> None:
            super().pause_writing()
            if write_timeout_s is not None and self._write_timer is None:
                self._write_timer = self.loop.call_later(write_timeout_s, self._write_timed_out)

        def resume_writing(self) -> None:
            self._cancel_write_timer()
            super().resume_writing()

        def _cancel_write_timer(self) -> None:
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None

        def _write_timed_out(self) -> None:
            self._write_timer = None
            if self.cycle is not None:
                self.cycle.scope[CLIENT_TIMEOUT] = (  # type: ignore[literal-required]
                    f"client timeout: read nothing of its answer for {write_timeout_s:g} s "
                    "(router.stream_write_timeout_s)"
                )
            self.transport.abort()

        def _arm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_timed_out)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing():
                self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if counter is not None:
                counter.connected()
            sock = transport.get_extra_info("socket")
            if sock is not None and write_timeout_s is not None:
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
                except OSError:
                    pass
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()  # a keep-alive connection's next request gets the same bound

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if counter is not None:
                counter.disconnected()
            self._cancel_write_timer()
            super().connection_lost(exc)

    return GuardedHttpToolsProtocol


def _json_error(status: int, message: str, param: str | None = None) -> tuple[dict, bytes]:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = json.dumps({"error": {"message": message, "type": kind, "param": param, "code": status}}).encode()
    start = {
        "type": "http.response.start",
        "status": status,
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ],
    }
    return start, body


class BodyLimit:
    """ASGI middleware: request bodies of at most ``max_bytes``, fully received within ``body_timeout_s``."""

    def __init__(self, app, max_bytes: int, body_timeout_s: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.body_timeout_s = body_timeout_s

    async def _reply(self, send, status: int, message: str) -> None:
        start, body = _json_error(status, message, "body" if status == 413 else None)
        await send(start)
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        too_big = (
            f"request body is larger than this server accepts ({self.max_bytes} bytes; router.max_request_body_bytes)"
        )
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    return await self._reply(send, 400, "Content-Length is not a number")
                if declared > self.max_bytes:
                    return await self._reply(send, 413, too_big)
        body = await read_bounded(receive, self.max_bytes, self.body_timeout_s)
        if body == DISCONNECTED:
            return
        if body == TOO_LARGE:
            return await self._reply(send, 413, too_big)
        if body == TIMED_OUT:
            return await self._reply(
                send, 408, f"request body not received within {self.body_timeout_s:g} s (router.body_timeout_s)"
            )
        assert isinstance(body, bytes)
        # after the body: http.disconnect when the client goes away
        await self.app(scope, replaying(body, receive), send)
