"""Listening sockets for the HTTP servers and the KV data plane.

Every listener sets TCP_NODELAY, which accepted connections inherit on Linux.
uvicorn handed a ready socket (``sockets=[...]``) does not set it, and without it
a small response written in two pieces (headers, then body) or a stream of small
token chunks waits for the peer's delayed ACK: 40+ ms per hop, measured here on
every request before this fix.
"""

from __future__ import annotations

import socket


def listen(host: str, port: int, backlog: int = 1024) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=backlog)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock
