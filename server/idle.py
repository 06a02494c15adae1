"""A timeout per wait, for streams that wait for something every engine step.

``asyncio.timeout`` around each wait creates and cancels a timer per token per stream (and
aiohttp's ``sock_read`` reschedules one per received chunk). ``IdleTimeout`` gives every
:meth:`IdleTimeout.wait` the same limit with one timer per timeout period: a wait only notes when
it started; when the timer fires it re-arms for the current wait's deadline, and it cancels the
task only when the task has been inside one wait for longer than the timeout. The waiter then gets
``TimeoutError``; any other cancellation of the task propagates untouched (so a client disconnect
is never swallowed).

:meth:`IdleTimeout.expire` ends the waits early from outside (the router's registry calls it when
the worker being waited on is declared stale or dead); ``reason`` then says why.

``alive``: asked when a wait has gone quiet for the timeout; while it says the other side is alive (the
router: the worker's heartbeats are fresh), the wait goes on, for at most ``max_wait_s`` in all. A long
engine step then delays a stream instead of failing it; a frozen worker stops heartbeating and fails it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


class IdleTimeout:
    __slots__ = (
        "_loop",
        "_task",
        "_timeout",
        "_last",
        "_waiting",
        "_expired",
        "_handle",
        "_cancelling",
        "reason",
        "_alive",
        "_max_wait",
    )

    def __init__(
        self, timeout_s: float, alive: Callable[[], bool] | None = None, max_wait_s: float | None = None
    ) -> None:
        self._alive = alive
        self._max_wait = max_wait_s if max_wait_s is not None else timeout_s
        self._loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("IdleTimeout needs to be created inside a task")
        self._task = task
        self._timeout = timeout_s
        self._last = self._loop.time()
        self._waiting = self._expired = False
        self.reason: str | None = None  # set when the timeout fired or expire() was called
        self._cancelling = self._task.cancelling()
        self._handle: asyncio.TimerHandle | None = self._loop.call_at(self._last + timeout_s, self._check)

    def _check(self) -> None:
        due, now = self._last + self._timeout, self._loop.time()
        if now < due:
            self._handle = self._loop.call_at(due, self._check)
        elif not self._waiting:  # busy elsewhere (e.g. sending to a slow reader): look again later
            self._handle = self._loop.call_at(now + self._timeout / 8, self._check)
        elif self._alive is not None and now - self._last < self._max_wait and self._alive():
            self._handle = self._loop.call_at(now + self._timeout / 4, self._check)  # slow, not gone
        else:
            self._handle = None
            self.expire(f"nothing arrived for {self._timeout:g} s")

    def expire(self, reason: str) -> None:
        """Fail the current wait (or the next one) with TimeoutError; idempotent."""
        if self._expired:
            return
        self._expired, self.reason = True, reason
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._waiting:
            self._task.cancel()

    async def wait(self, awaitable: Awaitable[T]) -> T:
        """Await ``awaitable``; TimeoutError when nothing arrived for the timeout."""
        if self._expired:
            if asyncio.iscoroutine(awaitable):
                awaitable.close()  # never awaited: no "coroutine was never awaited" warning
            raise TimeoutError
        self._last = self._loop.time()  # like a timeout per wait: the clock starts now
        self._waiting = True
        try:
            result = await awaitable
        except asyncio.CancelledError:
            if self._expired and self._task.uncancel() <= self._cancelling:
                raise TimeoutError from None
            raise
        finally:
            self._waiting = False
        return result

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def __enter__(self) -> IdleTimeout:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
