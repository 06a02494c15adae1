"""A tiny OpenAI-style streaming server for distbench's tests, in a thread of the test process.

``/v1/completions`` streams ``max_tokens`` SSE chunks ``token_delay_s`` apart, then usage and [DONE].
``stall_at=K``: when the K-th request arrives the server stalls for ``stall_s`` — every request waits
until the stall ends before its first token (a GC pause / a stuck scheduler at a known moment).
``fail_every=N``: every N-th request gets ``HTTP 503 {"error": "overloaded, retry"}``.
``rate_limit_every=N``: every N-th request gets ``HTTP 429`` in OpenAI's rate-limit shape with
``Retry-After: retry_after`` (seconds; None: no header).
``max_active=K``: at most K requests stream at once, the others queue for a slot before their first
token: a server of known capacity, ``K / ((max_tokens - 1) × token_delay_s)`` requests per second.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Self

from aiohttp import web


class StubServer:
    def __init__(
        self,
        token_delay_s: float = 0.002,
        stall_at: int | None = None,
        stall_s: float = 1.0,
        fail_every: int | None = None,
        max_active: int | None = None,
        rate_limit_every: int | None = None,
        retry_after: str | None = "1",
    ) -> None:
        self.rate_limit_every, self.retry_after = rate_limit_every, retry_after
        self.token_delay_s, self.stall_at, self.stall_s, self.fail_every = token_delay_s, stall_at, stall_s, fail_every
        self.max_active = max_active
        self.count = 0
        self.url = ""
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._main, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def _main(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._open = asyncio.Event()
        self._open.set()
        self._slots = asyncio.Semaphore(self.max_active) if self.max_active else None
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/completions", self._completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self._ready.set()
        await self._stop.wait()
        await runner.cleanup()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "stub", "max_model_len": 4096}]})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=f"# TYPE stub_requests_total counter\nstub_requests_total {self.count}\n")

    async def _reopen(self) -> None:
        await asyncio.sleep(self.stall_s)
        self._open.set()

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.count += 1
        n = self.count
        if self.fail_every and n % self.fail_every == 0:
            return web.json_response({"error": "overloaded, retry"}, status=503)
        if self.rate_limit_every and n % self.rate_limit_every == 0:
            err = {"message": "Rate limit reached", "type": "requests", "param": None, "code": "rate_limit_exceeded"}
            headers = {"Retry-After": self.retry_after} if self.retry_after is not None else None
            return web.json_response({"error": err}, status=429, headers=headers)
        if n == self.stall_at:
            self._open.clear()
            asyncio.get_running_loop().create_task(self._reopen())
        await self._open.wait()
        if self._slots is None:
            return await self._stream(request, body)
        async with self._slots:
            return await self._stream(request, body)

    async def _stream(self, request: web.Request, body: dict) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        tokens = int(body.get("max_tokens") or 16)
        for i in range(tokens):
            if i:
                await asyncio.sleep(self.token_delay_s)
            chunk = {"choices": [{"index": 0, "text": "x", "finish_reason": "length" if i == tokens - 1 else None}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        prompt = body.get("prompt")
        usage = {"prompt_tokens": len(prompt) if isinstance(prompt, list) else 1, "completion_tokens": tokens}
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
        await resp.write_eof()
        return resp


def main() -> None:
    """``python -m tests.stub_server --ready-file F``: serve until killed (bench/loadgen/distbench_capacity.py)."""
    import argparse
    import time
    from pathlib import Path

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--ready-file", required=True)
    ap.add_argument("--token-delay-s", type=float, default=0.0)
    a = ap.parse_args()
    with StubServer(token_delay_s=a.token_delay_s) as srv:
        Path(a.ready_file).write_text(json.dumps({"url": srv.url}))
        while True:
            time.sleep(3600)


if __name__ == "__main__":
    main()
