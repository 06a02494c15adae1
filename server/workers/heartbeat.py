"""Registration and heartbeats, on a thread of their own: a worker's liveness does not depend on its load.

On CPU the engine step runs on the event-loop thread (``EngineLoop``, inline mode: an engine thread would
add GIL hand-offs to every decode step and buy no parallelism on one core). A long prefill step (seconds on a
2-core machine) then blocks the loop, and heartbeats sent from the loop stopped with it: the router took a
busy, healthy worker for a frozen one and failed every request on it (100 of 100 in the first-use report).
So heartbeats are sent from this thread, with its own event loop and HTTP session; the engine's hot path is
unchanged. The load they carry (``WorkerState.status``) is a handful of ``len()`` reads, safe from any thread.

Heartbeat timeouts stay meaningful:

- a frozen process (SIGSTOP, a stopped VM) stops this thread too: no heartbeat, the router marks it stale;
- a *wedged* event loop (not ticking and not inside an engine step for ``wedged_after_s``, or one step
  running for longer than ``max_step_s``) makes this thread hold its heartbeats back, so the router sees
  what it saw before: silence (``Liveness.wedged``).

A worker that cannot reach its router says so every ``REPORT_EVERY_S`` with the error (a typo in
``--router`` is not silent), and errors name their type (a ``TimeoutError``'s text is empty).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from distserve.server.lograte import describe
from distserve.server.wire import CREDENTIAL_HEADER, DeregisterRequest, HeartbeatRequest, RegisterRequest, WorkerStatus
from distserve.server.workers.engine_loop import EngineLoop

log = logging.getLogger(__name__)

REPORT_EVERY_S = 5.0  # how often "cannot reach the router" is repeated while it lasts
TICK_S = 0.25


class Liveness:
    """The event loop's pulse, as the heartbeat thread sees it."""

    def __init__(self, engine_loop: EngineLoop, wedged_after_s: float, max_step_s: float) -> None:
        self.engine_loop = engine_loop
        self.wedged_after_s = wedged_after_s
        self.max_step_s = max_step_s
        self.loop_tick = time.monotonic()

    async def tick(self) -> None:
        """On the worker's event loop: note that it runs."""
        while True:
            self.loop_tick = time.monotonic()
            await asyncio.sleep(TICK_S)

    def wedged(self, now: float | None = None) -> str | None:
        """Why the loop looks wedged (then no heartbeat goes out), or None: it ticks, or it is in a step."""
        now = time.monotonic() if now is None else now
        step = self.engine_loop.step_started
        if step:
            long = now - step
            return f"one engine step has run for {long:.1f} s" if long > self.max_step_s else None
        lag = now - max(self.loop_tick, self.engine_loop.step_ended)  # a step just ended: the tick is due
        return f"event loop unresponsive for {lag:.1f} s" if lag > self.wedged_after_s else None


@dataclass
class HeartbeatOptions:
    router_url: str
    token: str
    interval_s: float
    role: str


class HeartbeatThread:
    """Registers with the router, then heartbeats; re-registers when the router forgets the worker."""

    def __init__(
        self,
        opts: HeartbeatOptions,
        reg: RegisterRequest,
        status: Callable[[], WorkerStatus],
        should_exit: Callable[[], bool],
        refused: Callable[[str], None],
        liveness: Liveness | None = None,
    ) -> None:
        self.opts, self.reg, self.status = opts, reg, status
        self.should_exit, self.refused, self.liveness = should_exit, refused, liveness
        self.registered = False
        self.credential: str | None = None  # issued by the router at registration; every later call carries it
        # where heartbeats go: the router's control plane when its registration reply names one (read on a
        # thread of its own there, server/router/control.py), else the router's URL. A failed heartbeat
        # registers again through the router's URL, which names the control plane of the router running now.
        self.heartbeat_url: str | None = None
        self.num_sent = 0
        self._thread = threading.Thread(target=self._main, name="heartbeat", daemon=True)
        self._last_report = 0.0
        self._held_back: str | None = None

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _main(self) -> None:
        try:
            asyncio.run(self._run())
        except Exception:
            log.exception("heartbeat thread failed")

    def _mine(self) -> dict[str, str]:
        return {CREDENTIAL_HEADER: self.credential} if self.credential else {}

    @staticmethod
    async def _refusal(r: aiohttp.ClientResponse) -> tuple[str, str | None]:
        try:
            err = (await r.json())["error"]
            return str(err["message"]), err.get("param")
        except (ValueError, KeyError, TypeError, aiohttp.ContentTypeError):
            return str(r.reason), None

    def _report(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last_report >= REPORT_EVERY_S:
            self._last_report = now
            log.warning(msg, *args)

    async def _run(self) -> None:
        o = self.opts
        headers = {"Authorization": f"Bearer {o.token}"}
        timeout = aiohttp.ClientTimeout(total=max(2.0, 2 * o.interval_s))
        async with aiohttp.ClientSession(timeout=timeout, headers=headers) as http:
            while not self.should_exit():
                try:
                    await self._once(http)
                except (TimeoutError, aiohttp.ClientError, OSError) as e:
                    if self.registered:
                        log.warning("router %s unreachable (%s); will re-register", o.router_url, describe(e))
                        self._last_report = time.monotonic()
                    else:
                        self._report("cannot register with %s: %s; retrying", o.router_url, describe(e))
                    self.registered = False
                if self.should_exit():
                    break
                await asyncio.sleep(o.interval_s)
            if self.registered:
                try:
                    bye = DeregisterRequest(worker_id=self.reg.worker_id, pid=self.reg.pid)
                    async with http.post(
                        f"{o.router_url}/deregister", json=bye.model_dump(exclude_none=True), headers=self._mine()
                    ):
                        pass
                except (TimeoutError, aiohttp.ClientError, OSError):
                    pass

    async def _once(self, http: aiohttp.ClientSession) -> None:
        o, reg = self.opts, self.reg
        wedged = self.liveness.wedged() if self.liveness is not None else None
        if wedged is not None:  # silence, as a frozen process: the router takes it out of rotation
            if self._held_back is None:
                log.error("holding heartbeats back: %s", wedged)
            self._held_back = wedged
            return
        if self._held_back is not None:
            log.warning("event loop responsive again; heartbeats resume")
            self._held_back = None
        if not self.registered:
            reg.status = self.status()
            async with http.post(f"{o.router_url}/register", json=reg.model_dump(), headers=self._mine()) as r:
                if r.status in (400, 401, 403, 409, 422):
                    detail, param = await self._refusal(r)
                    if r.status == 409 and param == "worker_id":
                        # The id is still held by a process the router believes live (its death not reported
                        # yet): try again next interval, until it is reported dead or its heartbeats time out.
                        self._report("registration deferred: %s", detail)
                        return
                    log.error("router refused registration (%s): %s", r.status, detail)
                    self.refused(f"router refused registration: {detail}")
                    return
                self.registered = r.status == 200
                if self.registered:
                    answer = await r.json()
                    self.credential = str(answer.get("credential") or "") or None
                    self.heartbeat_url = str(answer.get("control_url") or "").rstrip("/") or o.router_url
                    log.info(
                        "Registered with router %s as %s %s (heartbeats to %s)",
                        o.router_url,
                        o.role,
                        reg.worker_id,
                        self.heartbeat_url,
                    )
                else:
                    self._report("cannot register with %s: HTTP %d; retrying", o.router_url, r.status)
            return
        hb = HeartbeatRequest(worker_id=reg.worker_id, status=self.status())
        url = self.heartbeat_url or o.router_url
        async with http.post(f"{url}/heartbeat", json=hb.model_dump(), headers=self._mine()) as r:
            if r.status == 404:  # the router restarted and forgot us
                log.warning("router %s does not know this worker (restarted?); registering again", o.router_url)
                self.registered, self.credential = False, None
            elif r.status == 403:  # another process took our id while we were silent: register again
                detail, _ = await self._refusal(r)  # (409 until that one is gone, see above)
                log.error("router refused our heartbeat: %s", detail)
                self.registered, self.credential = False, None
            elif r.status == 200:
                self.num_sent += 1
            else:
                self._report("heartbeat to %s answered HTTP %d", o.router_url, r.status)
