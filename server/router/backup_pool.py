"""The backup pool: OpenAI-compatible servers (e.g. vLLM) the breaker fails over to.

A request for the backup is forwarded as the client sent it, with ``model``
rewritten to ``router.backup_model`` (a vLLM server names its model after its
folder or ``--served-model-name``) and ``router.backup_api_key`` as the bearer
token; the answer is streamed back byte for byte. "Unreachable" means no usable
answer *before the first byte reached the client* — connection refused or
reset, timeout, or HTTP 5xx — and then the next backup URL is tried, and after
the last one the router serves the request from the primary pool. Once bytes
flow, the stream belongs to the backup to the end (no transition cuts it).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass

import aiohttp

log = logging.getLogger(__name__)

_CONNECT_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=2.0)


@dataclass(frozen=True)
class BackupOptions:
    urls: tuple[str, ...]
    model: str | None = None
    api_key: str | None = None
    first_byte_timeout_s: float = 30.0


def endpoint(base: str, path: str) -> str:
    """``http://h:8000`` or ``http://h:8000/v1`` + ``/v1/completions`` → ``http://h:8000/v1/completions``."""
    base = base.rstrip("/")
    if base.endswith("/v1") and path.startswith("/v1/"):
        return base + path[3:]
    return base + path


class BackupPool:
    def __init__(self, options: BackupOptions, http: aiohttp.ClientSession) -> None:
        self.options = options
        self.http = http
        self._next = itertools.cycle(range(len(options.urls))) if options.urls else None
        self.last_error: str | None = None

    @property
    def configured(self) -> bool:
        return bool(self.options.urls)

    def _headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.options.api_key:
            h["Authorization"] = f"Bearer {self.options.api_key}"
        return h

    async def open(self, path: str, body: dict) -> aiohttp.ClientResponse | None:
        """An open upstream response (status < 500, headers read), or None when no backup can answer."""
        if self._next is None:
            return None
        if self.options.model:
            body = {**body, "model": self.options.model}
        start = next(self._next)
        n = len(self.options.urls)
        for k in range(n):
            url = endpoint(self.options.urls[(start + k) % n], path)
            try:
                resp = await asyncio.wait_for(
                    self.http.post(url, json=body, headers=self._headers(), timeout=_CONNECT_TIMEOUT),
                    self.options.first_byte_timeout_s,
                )
            except (TimeoutError, aiohttp.ClientError, OSError) as e:
                self.last_error = f"{url}: {type(e).__name__}: {e}"
                log.warning("backup unreachable: %s", self.last_error)
                continue
            if resp.status >= 500:
                self.last_error = f"{url}: HTTP {resp.status}"
                log.warning("backup failed: %s", self.last_error)
                resp.release()
                continue
            return resp
        return None
