"""Decode room before the prefill, first come first served (``Pipeline._pick_decode``).

In disaggregated mode a request is prefilled only once a decode worker has room for it: fewer than
``decode.max_concurrent_requests`` requests routed to it and no request of its waiting for KV room (its
heartbeat's ``num_kv_blocked``: reservations the KV pool refused for lack of blocks; a reservation that only
waits for the running engine step to end is not counted, else a heartbeat that caught one closed the gate
for a whole heartbeat interval). While none
has, requests wait here *in arrival order*: the first in line checks for room every ``POLL_S`` (room comes
back as requests end and heartbeats arrive, neither of which signals); the others sleep until they are
first. A request that finds ``W`` waiting and ``F`` free slots therefore waits for ``W + 1 - F`` slot
releases, which makes its wait predictable (``ttft_predictor.py``); with every waiter polling, whoever woke
first after a release took it, and a request's wait was anywhere from one release to the timeout.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

from distserve.server.router.registry import WorkerInfo, WorkerRegistry

POLL_S = 0.01


class NoRoom(Exception):
    """No decode worker had room within the wait allowed."""


class DecodeRoom:
    def __init__(self, registry: WorkerRegistry, slots: int) -> None:
        self.registry, self.slots = registry, slots
        self.waiters: deque[asyncio.Event] = deque()

    def has_room(self, w: WorkerInfo) -> bool:
        return w.inflight < self.slots and not w.status.num_kv_blocked

    def free_slots(self) -> int:
        return sum(
            max(0, self.slots - w.inflight) for w in self.registry.healthy("decode") if not w.status.num_kv_blocked
        )

    def kv_blocked(self) -> int:
        """Reservations the healthy decode workers' KV pools refused for lack of blocks (their heartbeats)."""
        return sum(w.status.num_kv_blocked for w in self.registry.healthy("decode"))

    def kv_bound(self) -> bool:
        """No decode worker has room and one is short of KV blocks, not slots: room then comes back as streams
        end and free their blocks, at the pace of the streams holding them, not of slot releases (on ShareGPT on
        SmolLM2 with 95 of 256 slots held, waits of 22-29 s were predicted 0.1-0.9 s as slot releases)."""
        ws = self.registry.healthy("decode")
        return any(w.status.num_kv_blocked for w in ws) and not any(self.has_room(w) for w in ws)

    def gates(self) -> bool:
        """Requests wait here at all (disaggregated, with a slot bound)."""
        return bool(self.slots) and self.registry.mode() == "disaggregated"

    def total_slots(self) -> int:
        return self.slots * len(self.registry.healthy("decode")) if self.gates() else 0

    def releases_needed(self, ahead: int = 0) -> int:
        """Slot releases a request arriving now would wait for before its prefill (0: none), behind ``ahead``
        requests admitted before it and not yet given a decode slot (admission's ledger: a request of a burst
        is decided before the ones admitted a moment earlier have reached this gate, so ``waiters`` alone
        would miss them; the waiters are among them)."""
        if not self.gates():
            return 0
        free = self.free_slots()
        ahead = max(ahead, len(self.waiters))
        if not self.waiters and ahead < free:
            return 0
        # with no slot free, the reservations a KV pool refused (past this gate, holding a slot) take the first
        # blocks freed before anyone waiting here
        blocked = self.kv_blocked() if not free else 0
        return max(1, ahead + blocked + 1 - free)

    async def acquire(
        self, pick: Callable[[], WorkerInfo | None], timeout_s: float
    ) -> tuple[WorkerInfo | None, float, int]:
        """(the decode worker, seconds waited, slot releases it waited for) once one has room; (None, ...)
        when none is healthy. Raises ``NoRoom`` after ``timeout_s``."""
        decode = pick()
        if decode is None or not self.slots or (not self.waiters and self.has_room(decode)):
            return decode, 0.0, 0
        releases = max(1, len(self.waiters) + 1 - self.free_slots())
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        me = asyncio.Event()
        self.waiters.append(me)
        try:
            while True:
                if self.waiters[0] is me:
                    decode = pick()
                    if decode is None:
                        return None, time.monotonic() - t0, releases
                    if self.has_room(decode):
                        return decode, time.monotonic() - t0, releases
                    wait = POLL_S
                else:
                    wait = deadline - time.monotonic()
                if time.monotonic() > deadline:
                    raise NoRoom(f"no decode worker had room for {timeout_s:g} s")
                try:
                    async with asyncio.timeout(max(0.0, wait)):
                        await me.wait()
                except TimeoutError:
                    pass
                me.clear()
        finally:
            first = self.waiters[0] is me
            self.waiters.remove(me)
            if first and self.waiters:
                self.waiters[0].set()  # the next in line checks at once (a burst of releases goes quickly)
