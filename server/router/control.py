"""The router's control plane: worker heartbeats (and a ``/health``) on a thread of their own.

The router's main event loop serves the data plane: thousands of client connections, token streams, 429s.
Under 2 000 streaming clients on two cores it ran 1.5-1.8 s behind at a time, and a heartbeat served there
was read that late: the registry aged it by its reading time, took healthy workers for stale ones and
answered 503 "no healthy prefill+decode pair". Liveness must not depend on the data plane's load, so:

- ``ControlPlane`` runs a second HTTP server (uvicorn, raw ASGI, no FastAPI) on its own thread and event
  loop, on its own port (chosen free at start, on ``router.control_host``, 127.0.0.1 by default);
- the registration reply names it (``control_url``) to a worker that registered from where it can reach it
  (loopback, unless ``control_host`` is not a loopback address), and that worker sends its heartbeats there
  (server/workers/heartbeat.py). Registration, goodbyes and the launcher's reports stay on the main port;
  so does ``POST /heartbeat`` (workers that were not told of a control plane);
- a heartbeat is authenticated (admin bearer token, before its body is read; then the worker's credential)
  and its **time of arrival is taken on this thread**; the registry is only changed by the main loop, which
  applies the heartbeats waiting in its inbox (``WorkerRegistry.receive`` / ``apply_received``, every sweep,
  pick and ``/health``): however late the main loop gets to them, a worker's age counts from when it spoke;
- ``GET /health`` here answers from the registry's read-only view (``WorkerRegistry.view``), without the
  main loop. ``/health`` on the main port stays (load balancers poll it there).

A frozen worker is still detected within the heartbeat timeout: its heartbeats stop arriving here. A frozen
router (SIGSTOP) stops this thread too; its pulse (``control_tick``) tells the registry, which then ages
heartbeats from this thread's recovery, as it does for the main loop's own stalls.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import socket
import threading
import time
from collections.abc import Callable

import uvicorn
from pydantic import ValidationError

from distserve.server.lograte import RateLimitedLog
from distserve.server.net import listen
from distserve.server.router.fdlimit import ConnectionCounter
from distserve.server.router.registry import WorkerRegistry
from distserve.server.wire import CREDENTIAL_HEADER, HeartbeatRequest

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20  # a heartbeat is a few hundred bytes (its prefix summary can be more)
LOOPBACK = ("127.0.0.1", "::1", "localhost")


def _json(status: int, payload: dict) -> tuple[int, bytes]:
    return status, json.dumps(payload).encode()


def _error(status: int, message: str, param: str | None = None) -> tuple[int, bytes]:
    kind = "invalid_request_error" if status < 500 else "service_unavailable"
    return _json(status, {"error": {"message": message, "type": kind, "param": param, "code": status}})


class ControlApp:
    """Raw ASGI: ``POST /heartbeat`` and ``GET /health``; everything else 404."""

    def __init__(
        self,
        registry: WorkerRegistry,
        token: str,
        holds: Callable[[str, str | None], bool],
        health: Callable[[], tuple[int, dict]],
    ) -> None:
        self.registry, self.token, self.holds, self.health = registry, token, holds, health
        self._bearer = f"Bearer {token}".encode()
        self._steps: dict[str, int] = {}  # each worker's step count in its last heartbeat read here

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if path == "/health" and method in ("GET", "HEAD"):
            status, payload = self.health()
            code, body = _json(status, payload)
        elif path == "/heartbeat" and method == "POST":
            code, body = await self._heartbeat(scope, receive)
        elif path in ("/health", "/heartbeat"):
            code, body = _error(405, f"method {method} not allowed here")
        else:
            code, body = _error(404, f"no route {path} on the router's control plane")
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if code == 503:
            headers.append((b"retry-after", b"1"))
        await send({"type": "http.response.start", "status": code, "headers": headers})
        await send({"type": "http.response.body", "body": body if method != "HEAD" else b""})

    async def _heartbeat(self, scope, receive) -> tuple[int, bytes]:
        headers = dict(scope["headers"])
        if not hmac.compare_digest(headers.get(b"authorization", b""), self._bearer):
            return _error(401, "missing or wrong bearer token")  # before a byte of the body is read
        raw = bytearray()
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return _error(400, "client disconnected")
            raw.extend(msg.get("body", b""))
            if len(raw) > MAX_BODY_BYTES:
                return _error(413, f"heartbeat body is larger than {MAX_BODY_BYTES} bytes", "body")
            if not msg.get("more_body"):
                break
        at = time.monotonic()  # its arrival, on this thread: what its age counts from
        try:
            hb = HeartbeatRequest.model_validate_json(bytes(raw))
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(p) for p in err["loc"]) or "body"
            return _error(400, f"invalid heartbeat: {where}: {err['msg']}", where)
        wid = hb.worker_id
        cred = headers.get(CREDENTIAL_HEADER.encode())
        if wid in self.registry.workers and not self.holds(wid, cred.decode("latin-1") if cred else None):
            return _error(403, f"wrong or missing worker credential for {wid!r}", CREDENTIAL_HEADER)
        if not self.registry.knows(wid):
            self._steps.pop(wid, None)
            return _error(404, f"unknown worker {wid}; register first")
        s = hb.status
        moved = s.in_step or self._steps.get(wid) != s.num_steps
        self._steps[wid] = s.num_steps
        self.registry.receive(wid, s, at, at if moved else None)
        return _json(200, {"ok": True})


class ControlPlane:
    """The control-plane server's thread; ``start`` returns its URL once it listens."""

    def __init__(self, app: ControlApp, host: str, tick_s: float, front: FrontDoor | None = None) -> None:
        self.app, self.host, self.tick_s, self.front = app, host, tick_s, front
        self.url: str | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> str:
        sock = listen(self.host, 0, backlog=256)
        host, port = sock.getsockname()[:2]
        self.url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        self._server = uvicorn.Server(
            uvicorn.Config(
                self.app,
                log_level="warning",
                access_log=False,
                lifespan="off",
                http="httptools",
                timeout_keep_alive=60,  # a worker heartbeats every second on one connection
                timeout_graceful_shutdown=1,
            )
        )
        started = threading.Event()
        self._thread = threading.Thread(target=self._main, args=(sock, started), name="router-control", daemon=True)
        self._thread.start()
        if not started.wait(10.0):
            raise RuntimeError("the router's control-plane server did not start")
        log.info("router control plane (heartbeats) on %s", self.url)
        return self.url

    def _main(self, sock, started: threading.Event) -> None:
        async def pulse() -> None:
            reg = self.app.registry
            while True:
                reg.control_tick()
                await asyncio.sleep(self.tick_s)

        async def run() -> None:
            assert self._server is not None
            ticker = asyncio.create_task(pulse())
            serving = asyncio.create_task(self._server.serve(sockets=[sock]))
            while not self._server.started and not serving.done():
                await asyncio.sleep(0.01)
            loop = asyncio.get_running_loop()
            if self.front is not None:
                self.front.start(loop)
            started.set()
            try:
                await serving
            finally:
                if self.front is not None:
                    self.front.stop(loop)
                ticker.cancel()

        try:
            asyncio.run(run())
        except Exception:
            log.exception("the router's control-plane server failed")
        finally:
            started.set()
            sock.close()

    def stop(self, timeout_s: float = 3.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)

    def advertised_to(self, client_host: str | None) -> str | None:
        """The URL to give a worker registering from ``client_host``: None where it may not reach it (a
        loopback control plane and a worker on another host)."""
        if self.url is None:
            return None
        if self.host in LOOPBACK and (client_host or "") not in LOOPBACK:
            return None
        return self.url


HEALTH_LINES = (b"GET /health ", b"GET /health?", b"HEAD /health ", b"HEAD /health?")
PEEK_BYTES = max(len(x) for x in HEALTH_LINES)
HANDOVER_AFTER_S = 1.0  # a connection that sent no request line yet by then goes to the main loop (its timers)
MAIN_LOOP_DEAD_S = 30.0  # the main loop has not ticked for this long: /health is left to it (so it goes unanswered)


class FrontDoor:
    """The router's main port, accepted on the control thread: ``GET /health`` is answered here, every other
    connection is handed to the main loop's HTTP server (uvicorn's protocol, as if it had accepted it).

    Each connection's first bytes are peeked (``MSG_PEEK``: they stay in the socket for uvicorn); a request line
    of ``/health`` is answered from ``health`` and the connection closed; anything else, or nothing within
    ``HANDOVER_AFTER_S``, goes to the main loop at once. So a load balancer's probe does not wait behind the data
    plane, and a load balancer still sees a router whose main loop is wedged: when that loop has not ticked for
    ``MAIN_LOOP_DEAD_S`` (``main_alive``), ``/health`` connections are handed over too and go unanswered, and
    the launcher's ``RouterProbe`` restarts the router as before."""

    def __init__(
        self,
        sock,
        health: Callable[[], tuple[int, dict]],
        main_alive: Callable[[], bool],
        hand_over: Callable[[object], None],
        counter: ConnectionCounter | None = None,
    ) -> None:
        self.sock, self.health, self.main_alive, self.hand_over = sock, health, main_alive, hand_over
        self.counter = counter  # connections being sorted count against the descriptor budget (fdlimit.py)
        self.answered = 0
        self.log = RateLimitedLog(log)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.sock.setblocking(False)
        loop.add_reader(self.sock.fileno(), self._accept, loop)

    def stop(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.remove_reader(self.sock.fileno())

    def _accept(self, loop: asyncio.AbstractEventLoop) -> None:
        for _ in range(256):
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # EMFILE and the like: pause accepting for a second, as asyncio's own accept does
                self.log.warning("accept", "router port: accept failed (%s); pausing accepts for 1 s", e)
                loop.remove_reader(self.sock.fileno())
                loop.call_later(1.0, self.start, loop)
                return
            conn.setblocking(False)
            loop.create_task(self._sort(loop, conn))

    async def _sort(self, loop: asyncio.AbstractEventLoop, conn) -> None:
        c = self.counter
        if c is not None:
            c.sorting += 1
        try:
            await self._sort_one(loop, conn)
        finally:
            if c is not None:
                c.sorting -= 1

    async def _sort_one(self, loop: asyncio.AbstractEventLoop, conn) -> None:
        deadline = loop.time() + HANDOVER_AFTER_S
        while True:
            try:
                head = conn.recv(PEEK_BYTES, socket.MSG_PEEK)
            except (BlockingIOError, InterruptedError):
                head = None
            except OSError:
                conn.close()
                return
            if head == b"":  # closed before a byte
                conn.close()
                return
            if head is not None:
                if any(head.startswith(x) for x in HEALTH_LINES) and self.main_alive():
                    return await self._answer(loop, conn)
                if len(head) >= PEEK_BYTES or not any(x.startswith(head) for x in HEALTH_LINES):
                    break
            if loop.time() > deadline:
                break
            ready: asyncio.Future[None] = loop.create_future()

            def readable(f: asyncio.Future[None] = ready) -> None:
                if not f.done():
                    f.set_result(None)

            loop.add_reader(conn.fileno(), readable)
            try:
                await asyncio.wait_for(ready, max(0.0, deadline - loop.time()))
            except TimeoutError:
                pass
            finally:
                loop.remove_reader(conn.fileno())
        self.hand_over(conn)

    async def _answer(self, loop: asyncio.AbstractEventLoop, conn) -> None:
        try:
            raw = b""
            async with asyncio.timeout(5.0):
                while b"\r\n\r\n" not in raw and len(raw) < 16384:
                    chunk = await loop.sock_recv(conn, 4096)
                    if not chunk:
                        return
                    raw += chunk
            status, payload = self.health()
            body = json.dumps(payload).encode()
            reason = {200: "OK", 503: "Service Unavailable"}.get(status, "")
            head = (
                f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
                + ("retry-after: 1\r\n" if status == 503 else "")
                + "connection: close\r\n\r\n"
            ).encode()
            await loop.sock_sendall(conn, head + (b"" if raw.startswith(b"HEAD") else body))
            self.answered += 1
        except (OSError, TimeoutError):
            pass
        finally:
            conn.close()
