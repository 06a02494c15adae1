"""Runs one ``LLMEngine`` in a dedicated thread and bridges it to asyncio.

The engine is synchronous and not thread-safe; the HTTP side is asyncio. All
engine calls therefore go through this loop's command queue and run on the
engine thread, between steps. Outputs travel back per request through an
``asyncio.Queue`` fed with ``call_soon_threadsafe``. Requests whose KV must
first find room (decode-side reservations) wait in a FIFO that the thread
retries every iteration: that is the decode worker's back-pressure.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from server.engine.llm_engine import LLMEngine, RequestOutput
from server.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class _Reservation:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    future: asyncio.Future
    created: float = field(default_factory=time.monotonic)


@dataclass
class LoopStats:
    """Snapshot the event loop may read without locking (replaced whole each iteration)."""
    num_waiting: int = 0
    num_running: int = 0
    num_reserving: int = 0
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    num_steps: int = 0
    num_preemptions: int = 0
    step_seconds_total: float = 0.0


class EngineLoop:
    def __init__(self, engine: LLMEngine, loop: asyncio.AbstractEventLoop) -> None:
        self.engine = engine
        self.loop = loop
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue] = {}
        self._reservations: deque[_Reservation] = deque()
        self._stop = threading.Event()
        self._step_seconds = 0.0
        self.stats = LoopStats(kv_blocks_free=engine.num_free_blocks)
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._commands.put(lambda: None)
        self._thread.join(timeout)

    # --- thread side -------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            # Block only when idle; poll while reservations wait for blocks; never wait when busy.
            if engine.has_unfinished_requests():
                timeout: float | None = 0.0
            else:
                timeout = 0.005 if self._reservations else None
            try:
                cmd = self._commands.get(timeout=timeout) if timeout != 0.0 else self._commands.get_nowait()
                cmd()
                while True:
                    self._commands.get_nowait()()
            except queue.Empty:
                pass
            except Exception:  # a command must never kill the loop
                log.exception("engine command failed")
            self._admit_reservations()
            if engine.has_unfinished_requests():
                t0 = time.perf_counter()
                try:
                    outputs = engine.step()
                except Exception:
                    log.exception("engine step failed; aborting every request in it")
                    outputs = self._abort_all("engine error")
                self._step_seconds += time.perf_counter() - t0
                for out in outputs:
                    self._deliver(out.request_id, out)
            self._publish_stats()

    def _publish_stats(self) -> None:
        e = self.engine
        self.stats = LoopStats(
            num_waiting=e.scheduler.num_waiting,
            num_running=e.scheduler.num_running,
            num_reserving=len(self._reservations),
            kv_blocks_used=e.num_used_blocks,
            kv_blocks_free=e.num_free_blocks,
            num_steps=e.stats.num_steps,
            num_preemptions=e.stats.num_preemptions,
            step_seconds_total=self._step_seconds,
        )

    def _abort_all(self, reason: str) -> list[RequestOutput]:
        outs = []
        for rid in list(self.engine.requests):
            seq = self.engine.requests[rid]
            self.engine.abort_request(rid)
            outs.append(RequestOutput(rid, [], True, "error", len(seq.prompt_token_ids), seq.num_output_tokens))
        return outs

    def _admit_reservations(self) -> None:
        while self._reservations:
            r = self._reservations[0]
            if r.future.done():  # cancelled by its waiter
                self._reservations.popleft()
                continue
            try:
                ok = self.engine.reserve_prefilled(r.request_id, r.prompt_token_ids, r.output_token_ids, r.params)
            except Exception as e:  # invalid request: fail it, keep the queue moving
                self._reservations.popleft()
                self._resolve(r.future, e)
                continue
            if not ok:
                return  # FIFO: later requests wait behind the head
            self._reservations.popleft()
            self._resolve(r.future, True)

    def _deliver(self, request_id: str, item: Any) -> None:
        q = self._streams.get(request_id)
        if q is not None:
            self.loop.call_soon_threadsafe(q.put_nowait, item)

    def _resolve(self, fut: asyncio.Future, value: Any) -> None:
        def set_it() -> None:
            if fut.done():
                return
            if isinstance(value, BaseException):
                fut.set_exception(value)
            else:
                fut.set_result(value)
        self.loop.call_soon_threadsafe(set_it)

    # --- asyncio side ------------------------------------------------------
    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the engine thread between steps and await its result."""
        fut = self.loop.create_future()

        def run() -> None:
            try:
                self._resolve(fut, _Ok(fn()))
            except Exception as e:
                self._resolve(fut, e)

        self._commands.put(run)
        return (await fut).value

    def open_stream(self, request_id: str) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = q
        return q

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    async def add_request(self, request_id: str, prompt: list[int], params: SamplingParams, *,
                          prefill_only: bool = False, output_token_ids: list[int] | None = None) -> asyncio.Queue:
        q = self.open_stream(request_id)
        try:
            await self.call(lambda: self.engine.add_request(
                request_id, prompt, params, prefill_only=prefill_only, output_token_ids=output_token_ids))
        except BaseException:
            self.close_stream(request_id)
            raise
        return q

    async def reserve(self, request_id: str, prompt: list[int], outputs: list[int], params: SamplingParams,
                      timeout_s: float) -> None:
        """Wait until the engine has blocks for this request's KV (raises TimeoutError)."""
        fut = self.loop.create_future()
        r = _Reservation(request_id, list(prompt), list(outputs), params, fut)
        self._commands.put(lambda: self._reservations.append(r))
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout_s)
        except BaseException:
            fut.cancel()
            self.abort_nowait(request_id)  # it may have been granted meanwhile
            raise

    async def commit(self, request_id: str, kv) -> asyncio.Queue:
        q = self.open_stream(request_id)
        try:
            await self.call(lambda: self.engine.commit_prefilled(request_id, kv))
        except BaseException:
            self.close_stream(request_id)
            raise
        return q

    def abort_nowait(self, request_id: str) -> None:
        """Abort without waiting: safe in ``finally`` blocks of cancelled tasks."""
        self.close_stream(request_id)
        self._commands.put(lambda: self.engine.abort_request(request_id))

    async def abort(self, request_id: str) -> bool:
        self.close_stream(request_id)
        return await self.call(lambda: self.engine.abort_request(request_id))

    def reservation_ages(self) -> list[tuple[str, float]]:
        now = time.monotonic()
        return [(r.request_id, now - r.created) for r in list(self._reservations)]


@dataclass
class _Ok:
    value: Any
