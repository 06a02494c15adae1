"""The backup pool: OpenAI-compatible servers (e.g. vLLM) the breaker fails over to.

A request for the backup is forwarded as the client sent it, with ``model``
rewritten to ``router.backup_model`` (a vLLM server names its model after its
folder or ``--served-model-name``) and ``router.backup_api_key`` as the bearer
token; the answer is streamed back byte for byte. "Unreachable" means no usable
answer *before the first byte reached the client* — connection refused or
reset, a timeout, HTTP 5xx, or HTTP 401/403 (the router's key is wrong: no
client can fix that) — and then the next backup URL is tried, and after the last
one the router serves the request from the primary pool. Once bytes flow, the
stream belongs to the backup to the end (no transition cuts it), but it is still
bounded: no bytes for ``progress_timeout_s`` ends it with an error event.

Every call is bounded: ``connect_timeout_s`` to connect, ``first_byte_timeout_s``
until the answer's head, ``progress_timeout_s`` between reads. **The rule**: a
backup that fails in any of those ways (or whose stream breaks) is marked
unhealthy for ``unhealthy_for_s`` and skipped meanwhile; while every backup is
unhealthy, traffic returns to the primary at once (no request waits on a backup
known to be failing). An upstream response that did not end normally is closed,
not returned to the connection pool, so a stalled backup holds no connection.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass

import aiohttp

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BackupOptions:
    urls: tuple[str, ...]
    model: str | None = None
    api_key: str | None = None
    first_byte_timeout_s: float = 10.0
    connect_timeout_s: float = 2.0
    progress_timeout_s: float = 10.0
    unhealthy_for_s: float = 30.0


UNUSABLE = frozenset({401, 403})  # the router's credentials for the backup are wrong


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
        self._unhealthy_until: dict[str, float] = {}  # base URL -> monotonic time it may be tried again
        self.timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=options.connect_timeout_s, sock_read=options.progress_timeout_s
        )

    def healthy(self, base: str) -> bool:
        return self._unhealthy_until.get(base, 0.0) <= time.monotonic()

    def mark_unhealthy(self, base: str, why: str) -> None:
        """Skip ``base`` for ``unhealthy_for_s`` (the documented rule in the module docstring)."""
        self.last_error = f"{base}: {why}"
        self._unhealthy_until[base] = time.monotonic() + self.options.unhealthy_for_s
        log.warning("backup %s unhealthy for %g s: %s", base, self.options.unhealthy_for_s, why)

    @property
    def configured(self) -> bool:
        return bool(self.options.urls)

    def _headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.options.api_key:
            h["Authorization"] = f"Bearer {self.options.api_key}"
        return h

    async def open(self, path: str, body: dict) -> aiohttp.ClientResponse | None:
        """An open upstream response (a usable status, headers read), or None when no backup can answer.

        The response's ``backup_base`` attribute names the backup it came from (for
        :meth:`mark_unhealthy` when its body fails later)."""
        if self._next is None:
            return None
        if self.options.model:
            body = {**body, "model": self.options.model}
        start = next(self._next)
        n = len(self.options.urls)
        for k in range(n):
            base = self.options.urls[(start + k) % n]
            if not self.healthy(base):
                continue
            url = endpoint(base, path)
            try:
                resp = await asyncio.wait_for(
                    self.http.post(url, json=body, headers=self._headers(), timeout=self.timeout),
                    self.options.first_byte_timeout_s,
                )
            except (TimeoutError, aiohttp.ClientError, OSError) as e:
                self.mark_unhealthy(base, f"{url}: {type(e).__name__}: {e}")
                continue
            if resp.status >= 500 or resp.status in UNUSABLE:
                self.mark_unhealthy(base, f"{url}: HTTP {resp.status}")
                resp.close()
                continue
            resp.backup_base = base  # type: ignore[attr-defined]
            return resp
        return None
