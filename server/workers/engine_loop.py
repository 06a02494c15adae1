"""Drives one ``LLMEngine`` from the worker's asyncio event loop.

The engine steps *on the event-loop thread*: one synchronous ``engine.step()``,
then a yield so HTTP handlers can run, then the next step. A worker owns one
core, so a separate engine thread would buy no parallelism; it would only add
GIL hand-offs (up to the 5 ms switch interval per hand-off) between the thread
that computes a token and the thread that streams it. Here a token computed in
a step is in the request's queue when the step returns, and engine calls from
handlers happen between steps by construction, so the engine needs no locks.

Requests whose KV must first find room (decode-side reservations) wait in a
FIFO that is retried after every step: the decode worker's back-pressure.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from server.engine.llm_engine import LLMEngine, RequestOutput
from server.engine.sampling_params import SamplingParams
from server.wire import WorkerStatus
from server.workers.fault import StepDelays

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
    """Cumulative counters (``/metrics``). The load snapshot the router routes by is ``status()``."""

    num_steps: int = 0
    num_preemptions: int = 0
    num_generated_tokens: int = 0
    step_seconds_total: float = 0.0
    step_cpu_seconds_total: float = 0.0  # CPU time of this thread inside steps (wall minus descheduled time)
    prefix_cache_queried_tokens: int = 0  # tokens of admitted sequences looked up in the prefix cache
    prefix_cache_hit_tokens: int = 0  # of those, tokens whose KV came from the cache
    idle_seconds_total: float = 0.0  # loop waiting with no unfinished request (the rest is host work)


@dataclass(frozen=True)
class GcPolicy:
    """Decode-side garbage collection of *stale slots*: blocks reserved for a KV pull that never
    completed (the pull hung, or its handler died without releasing them).

    A reservation is stale once it is older than ``stale_after_s``, which the worker sets past its
    pull timeout: a pull still in progress is never stale, however many there are (a burst under
    load can hold dozens). Every ``interval_s`` (``decode.gc_interval_ms``) the oldest stale slots
    beyond ``max_stale_slots`` (``decode.max_stale_slots``) are freed, and any slot stale for twice
    ``stale_after_s`` is freed regardless."""

    interval_s: float = 0.5
    stale_after_s: float = 11.0
    max_stale_slots: int = 16


class EngineLoop:
    def __init__(self, engine: LLMEngine, gc: GcPolicy = GcPolicy()) -> None:
        self.engine = engine
        self.gc = gc
        self.num_gc_collected = 0
        self._next_gc = 0.0
        self._streams: dict[str, asyncio.Queue] = {}
        self._reservations: deque[_Reservation] = deque()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._step_seconds = 0.0
        self._step_cpu_seconds = 0.0
        self.fault = StepDelays()  # set by POST /admin/fault (server/workers/fault.py)
        self._idle_seconds = 0.0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="engine-loop")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    @property
    def stats(self) -> LoopStats:
        e = self.engine
        return LoopStats(
            num_steps=e.stats.num_steps,
            num_preemptions=e.stats.num_preemptions,
            num_generated_tokens=e.stats.num_generated_tokens,
            step_seconds_total=self._step_seconds,
            step_cpu_seconds_total=self._step_cpu_seconds,
            prefix_cache_queried_tokens=e.block_manager.num_cache_queries,
            prefix_cache_hit_tokens=e.block_manager.num_cache_hits,
            idle_seconds_total=self._idle_seconds,
        )

    def status(self, num_staged_kv: int = 0) -> WorkerStatus:
        """The load snapshot: what heartbeats carry, ``/internal/status`` answers and ``/metrics`` shows."""
        e = self.engine
        return WorkerStatus(
            num_waiting=e.scheduler.num_waiting,
            num_running=e.scheduler.num_running,
            num_reserving=len(self._reservations),
            kv_blocks_used=e.num_used_blocks,
            kv_blocks_free=e.num_free_blocks,
            num_staged_kv=num_staged_kv,
        )

    # --- the loop ------------------------------------------------------------
    async def _run(self) -> None:
        engine = self.engine
        while True:
            self._admit_reservations()
            if engine.awaiting_kv and time.monotonic() >= self._next_gc:
                self.collect_stale_slots()
            if not engine.has_unfinished_requests():
                self._wakeup.clear()
                if self._reservations:  # blocks may free up through aborts: poll gently
                    timeout: float | None = 0.005
                elif engine.awaiting_kv:  # wake for the next garbage collection
                    timeout = max(0.0, self._next_gc - time.monotonic())
                else:
                    timeout = None
                t_idle = time.perf_counter()
                try:
                    async with asyncio.timeout(timeout):
                        await self._wakeup.wait()
                except TimeoutError:
                    pass
                self._idle_seconds += time.perf_counter() - t_idle
                continue
            delay = self.fault.for_step(engine.scheduler.num_waiting > 0)
            if delay:
                await asyncio.sleep(delay)  # handlers keep running; only the engine waits
                if not engine.has_unfinished_requests():  # all aborted meanwhile
                    continue
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                outputs = engine.step()
            except Exception as e:  # a bug, not a request's fault (those are failed inside the step)
                log.exception("engine step failed; aborting every request in it")
                outputs = self._abort_all(f"internal engine error: {type(e).__name__}: {e}")
            self._step_seconds += time.perf_counter() - t0
            self._step_cpu_seconds += time.thread_time() - c0
            for out in outputs:
                q = self._streams.get(out.request_id)
                if q is not None:
                    q.put_nowait(out)
            # Two yields, not one. The first lets handlers stream what this step produced and
            # go back to waiting on their queues; the second runs callbacks scheduled meanwhile
            # while those queue waits are still pending — anyio delivers a client-disconnect
            # cancellation only to a task whose awaited future is not yet done, so with a single
            # yield a stream fed every step would never be cancelled (and its KV never freed).
            await asyncio.sleep(0)
            await asyncio.sleep(0)

    def _abort_all(self, reason: str) -> list[RequestOutput]:
        outs = []
        for rid, seq in list(self.engine.requests.items()):
            self.engine.abort_request(rid)
            outs.append(
                RequestOutput(rid, [], True, "abort", len(seq.prompt_token_ids), seq.num_output_tokens, error=reason)
            )
        return outs

    def _admit_reservations(self) -> None:
        while self._reservations:
            r = self._reservations[0]
            if r.future.done():  # its waiter gave up
                self._reservations.popleft()
                continue
            try:
                ok = self.engine.reserve_prefilled(r.request_id, r.prompt_token_ids, r.output_token_ids, r.params)
            except Exception as e:  # invalid request: fail it, keep the queue moving
                self._reservations.popleft()
                r.future.set_exception(e)
                continue
            if not ok:
                return  # FIFO: later requests wait behind the head
            self._reservations.popleft()
            r.future.set_result(True)

    def collect_stale_slots(self) -> int:
        """Free the oldest stale slots beyond max_stale_slots, and those stale for too long (GcPolicy)."""
        now = time.monotonic()
        self._next_gc = now + self.gc.interval_s
        # reservations in the order they were made: Sequence.arrival_time is when reserve_prefilled made it
        by_age = [(rid, seq.arrival_time) for rid, seq in self.engine.awaiting_kv.items()]
        stale = [(rid, t) for rid, t in by_age if now - t > self.gc.stale_after_s]
        overflow = [rid for rid, _ in stale[: max(0, len(stale) - self.gc.max_stale_slots)]]
        too_old = [rid for rid, t in stale if now - t > 2 * self.gc.stale_after_s]
        victims = set(too_old) | set(overflow)
        for rid in victims:
            log.warning(
                "freeing stale KV slot of %s (reserved %.1f s ago, KV never arrived)",
                rid,
                now - self.engine.awaiting_kv[rid].arrival_time,
            )
            self.abort_nowait(rid)
        self.num_gc_collected += len(victims)
        return len(victims)

    # --- API for handlers (all on the loop thread, so between steps) ----------
    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` against the engine (between steps) and wake the loop."""
        result = fn()
        self._wakeup.set()
        return result

    def open_stream(self, request_id: str) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = q
        return q

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    async def add_request(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        *,
        prefill_only: bool = False,
        output_token_ids: list[int] | None = None,
    ) -> asyncio.Queue:
        q = self.open_stream(request_id)
        try:
            self.engine.add_request(
                request_id, prompt, params, prefill_only=prefill_only, output_token_ids=output_token_ids
            )
        except BaseException:
            self.close_stream(request_id)
            raise
        self._wakeup.set()
        return q

    async def reserve(
        self, request_id: str, prompt: list[int], outputs: list[int], params: SamplingParams, timeout_s: float
    ) -> None:
        """Wait until the engine has blocks for this request's KV (raises TimeoutError)."""
        fut = asyncio.get_running_loop().create_future()
        self._reservations.append(_Reservation(request_id, list(prompt), list(outputs), params, fut))
        self._admit_reservations()
        self._wakeup.set()
        try:
            async with asyncio.timeout(timeout_s):
                await fut
        except BaseException:
            fut.cancel()
            self.abort_nowait(request_id)  # it may have been granted meanwhile
            raise

    async def commit(self, request_id: str, kv) -> asyncio.Queue:
        q = self.open_stream(request_id)
        try:
            self.engine.commit_prefilled(request_id, kv)
        except BaseException:
            self.close_stream(request_id)
            raise
        self._wakeup.set()
        return q

    def abort_nowait(self, request_id: str) -> bool:
        """Abort now; safe in ``finally`` blocks of cancelled tasks (no await)."""
        self.close_stream(request_id)
        return self.engine.abort_request(request_id)

    async def abort(self, request_id: str) -> bool:
        return self.abort_nowait(request_id)
