"""Drives one ``LLMEngine`` from the worker's asyncio event loop.

Two ways to run ``engine.step()``, chosen per role by ``prefill.engine_thread`` / ``decode.engine_thread``:

* **inline** (the default of CPU decode and colocated workers): the step runs *on the event-loop
  thread*, then a yield lets HTTP handlers run, then the next step. A CPU worker owns one core, so a
  separate engine thread would buy no parallelism; it would only add GIL hand-offs (up to the 5 ms switch
  interval each) between the thread that computes a token and the thread that streams it.
* **thread** (the default on CUDA, and of prefill workers on any device: ``resolve_engine_thread``): the
  step runs on one dedicated engine thread while the event loop keeps serving. A GPU step is mostly
  waiting for the device (the wait releases the GIL), so handlers' host work — parsing the next request,
  staging a finished prefill's KV, streaming tokens — overlaps the step instead of sitting between steps,
  and a handler whose work finished mid-step resumes at once instead of after the *next* step (measured
  on two H200s: docs/performance/serving-two-gpus.md).

Either way the engine is touched by one thread at a time, so it needs no locks: in thread mode a
handler's engine call made while a step runs is queued (``_pending``) and applied on the loop thread
right after the step returns, before the next one starts.

Requests whose KV must first find room (decode-side reservations) wait in a
FIFO that is retried after every step: the decode worker's back-pressure.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from distserve.server.engine.llm_engine import LLMEngine, RequestOutput
from distserve.server.engine.memory_pressure import is_memory_error, relieve
from distserve.server.engine.sampling_params import SamplingParams
from distserve.server.wire import WorkerStatus
from distserve.server.workers.fault import StepDelays

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
    num_memory_errors: int = 0  # engine steps (or their retries) that failed for lack of device memory


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


def resolve_engine_thread(setting: str, device: str, role: str = "decode") -> bool:
    """``engine_thread`` config value -> step on a dedicated thread? ``auto``: on CUDA devices, and for prefill
    workers on any device. A prefill worker's steps are few and long (a 4 096-token CPU step takes seconds to
    tens of seconds on a shared core), so the thread's GIL hand-off per step costs nothing measurable there,
    while on the event loop each finished prefill's reply — and the KV lease it starts — waited for the whole
    *next* step: with steps longer than ``kv_transfer.lease_ms`` every staged KV expired before its decode
    worker could pull it, and the decode worker recomputed each prompt (the seed's closed loop on SmolLM2:
    1 of 100 completed in 3 minutes). Decode and colocated workers stay inline on CPU (a hand-off per token)."""
    if setting == "auto":
        return device.startswith("cuda") or role == "prefill"
    return setting == "on"


class EngineLoop:
    def __init__(self, engine: LLMEngine, gc: GcPolicy = GcPolicy(), *, threaded: bool = False) -> None:
        self.engine = engine
        self.gc = gc
        self.threaded = threaded
        self._executor: ThreadPoolExecutor | None = None
        self._stepping = False  # a step is running on the engine thread (thread mode only)
        # engine calls made by handlers while a step runs: (fn, future or None for fire-and-forget)
        self._pending: deque[tuple[Callable[[], Any], asyncio.Future | None]] = deque()
        self._aborted_in_step: set[str] = set()  # ids aborted while the running step ran (its outputs are stale)
        self.num_gc_collected = 0
        self._next_gc = 0.0
        self._streams: dict[str, asyncio.Queue] = {}
        self._reservations: deque[_Reservation] = deque()
        # the head reservation was refused for lack of KV blocks (not merely deferred until a step ends, nor
        # behind a full batch): the reservations queued now wait for KV room (heartbeats: ``num_kv_blocked``)
        self._kv_blocked = False
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._step_seconds = 0.0
        self._step_cpu_seconds = 0.0
        self.fault = StepDelays()  # set by POST /admin/fault (server/workers/fault.py)
        self._idle_seconds = 0.0
        # monotonic start of the inline step running now (0: none): a long step blocks the event loop,
        # and the heartbeat thread tells it from a wedged loop by this (server/workers/heartbeat.py)
        self.step_started = 0.0
        self.step_ended = 0.0  # ... and when the last one ended

    def start(self) -> None:
        if self.threaded and self._executor is None:
            self._executor = ThreadPoolExecutor(1, "engine-step", initializer=self._init_engine_thread)
            # start the thread now: its cuBLAS handle and workspace are made at start, not by the first
            # step (which may come when the device is full: CUBLAS_STATUS_ALLOC_FAILED at cublasCreate)
            self._executor.submit(lambda: None)
        self._task = asyncio.get_running_loop().create_task(self._run(), name="engine-loop")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    def _init_engine_thread(self) -> None:
        # The current CUDA device is per thread and defaults to 0: a worker on cuda:1 must say so here too.
        dev = getattr(self.engine, "device", None)
        if dev is not None and getattr(dev, "type", "") == "cuda" and dev.index is not None:
            import torch

            torch.cuda.set_device(dev)
        if dev is not None and getattr(dev, "type", "") == "cuda":
            import torch

            try:  # this thread's cuBLAS handle and workspace, made while there is room
                a = torch.ones(8, 8, device=dev, dtype=getattr(self.engine, "dtype", torch.float32))
                (a @ a).sum().item()
            except RuntimeError as e:  # an initializer that raises would break the executor for good
                log.warning("could not warm up cuBLAS on the engine thread: %s", e)

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
            num_memory_errors=e.memory_pressure.total,
        )

    def status(self, num_staged_kv: int = 0) -> WorkerStatus:
        """The load snapshot: what heartbeats carry, ``/internal/status`` answers and ``/metrics`` shows."""
        e = self.engine
        return WorkerStatus(
            num_waiting=e.scheduler.num_waiting,
            num_running=e.scheduler.num_running,
            num_reserving=len(self._reservations),
            num_kv_blocked=len(self._reservations) if self._kv_blocked else 0,
            kv_blocks_used=e.num_used_blocks,
            kv_blocks_free=e.num_free_blocks,
            num_staged_kv=num_staged_kv,
            memory_errors_recent=e.memory_pressure.recent(),
            in_step=self.step_started > 0,
            num_steps=e.stats.num_steps,
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
            t0 = time.perf_counter()
            steps_before = engine.stats.num_steps
            try:
                if self._executor is not None:
                    self._stepping = True
                    self.step_started = time.monotonic()  # heartbeats say in_step: a long step, not a hang
                    try:
                        outputs, cpu = await asyncio.get_running_loop().run_in_executor(self._executor, self._step)
                    finally:
                        self._stepping = False
                        self.step_started, self.step_ended = 0.0, time.monotonic()
                else:
                    self.step_started = time.monotonic()  # the heartbeat thread reads it (wedged?)
                    try:
                        outputs, cpu = self._step()
                    finally:
                        self.step_started, self.step_ended = 0.0, time.monotonic()
            except Exception as e:  # a bug, not a request's fault (those are failed inside the step)
                if is_memory_error(e):
                    engine.memory_pressure.record()
                    relieve(engine.device)
                log.exception("engine step failed; aborting every request in it")
                outputs, cpu = self._abort_all(f"internal engine error: {type(e).__name__}: {e}"), 0.0
            self._step_seconds += time.perf_counter() - t0
            self._step_cpu_seconds += cpu
            self._apply_pending()
            # A request aborted while the step ran already got its final "abort" output; the step's output for
            # its id is the aborted attempt's, not that of a request added again under the same id meanwhile
            # (a prefill the router sent again): delivered, it told the new attempt "prefilled" before its step.
            aborted, self._aborted_in_step = self._aborted_in_step, set()
            for out in outputs:
                q = self._streams.get(out.request_id)
                if q is not None and out.request_id not in aborted:
                    q.put_nowait(out)
            # Two yields, not one. The first lets handlers stream what this step produced and
            # go back to waiting on their queues; the second runs callbacks scheduled meanwhile
            # while those queue waits are still pending — anyio delivers a client-disconnect
            # cancellation only to a task whose awaited future is not yet done, so with a single
            # yield a stream fed every step would never be cancelled (and its KV never freed).
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            if not outputs and engine.stats.num_steps == steps_before:
                # nothing could run (waiting requests whose blocks are leased out, KV by reference): poll
                # gently until a call (an adoption, a give-back, an abort) wakes the loop
                self._wakeup.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.005):
                        await self._wakeup.wait()

    def _step(self) -> tuple[list[RequestOutput], float]:
        """One engine step and the CPU time of the thread that ran it."""
        c0 = time.thread_time()
        if self.fault.block_s:
            time.sleep(self.fault.block_s)  # the fault hook's long step (server/workers/fault.py)
        outputs = self.engine.step()
        return outputs, time.thread_time() - c0

    def _apply_pending(self) -> None:
        """Handlers' engine calls that arrived during the step, in arrival order (loop thread, no step running)."""
        while self._pending:
            fn, fut = self._pending.popleft()
            if fut is not None and fut.done():  # its caller gave up (cancelled)
                continue
            try:
                result = fn()
            except Exception as e:
                if fut is None:
                    log.exception("queued engine call failed")
                elif not fut.done():
                    fut.set_exception(e)
                continue
            # a caller cancelled while ``fn`` ran has its future cancelled: the effect stands, and its
            # except path undoes it (add_request/commit abort the request)
            if fut is not None and not fut.done():
                fut.set_result(result)

    async def _engine_call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` against the engine now if no step is running, else right after the step."""
        if not self._stepping:
            return fn()
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((fn, fut))
        return await fut

    def _abort_all(self, reason: str) -> list[RequestOutput]:
        outs = []
        for rid, seq in list(self.engine.requests.items()):
            self.engine.abort_request(rid)
            outs.append(
                RequestOutput(rid, [], True, "abort", len(seq.prompt_token_ids), seq.num_output_tokens, error=reason)
            )
        return outs

    def _admit_reservations(self) -> None:
        if self._stepping:  # retried after the step
            return
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
                # short of KV blocks, unless the batch is full (max_num_seqs running): that queue is the router's
                # slots' to bound (decode.max_concurrent_requests), a release frees both
                self._kv_blocked = self.engine.scheduler.num_running < self.engine.config.max_num_seqs
                return  # FIFO: later requests wait behind the head
            self._kv_blocked = False
            self._reservations.popleft()
            r.future.set_result(True)
        self._kv_blocked = False

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

    # --- API for handlers (loop thread; engine calls happen between steps) -----
    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` against the engine (between steps) and wake the loop."""
        result = await self._engine_call(fn)
        self._wakeup.set()
        return result

    def open_stream(self, request_id: str) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = q
        return q

    def close_stream(self, request_id: str, q: asyncio.Queue | None = None) -> None:
        """Stop delivering ``request_id``'s outputs; given its queue ``q``, only if that stream is still ``q``: a
        handler leaving must not close the stream of a later attempt under the same id (a prefill sent again)."""
        if q is None or self._streams.get(request_id) is q:
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
        # its arrival is now, not when the call is applied: a call made during a step waits for the step's end,
        # and the prompts of a burst would all tie there, so the wfs order's aging would not see who came first
        arrived = time.monotonic()
        try:
            await self._engine_call(
                lambda: self.engine.add_request(
                    request_id,
                    prompt,
                    params,
                    prefill_only=prefill_only,
                    output_token_ids=output_token_ids,
                    arrival_time=arrived,
                )
            )
        except ValueError:  # refused by the engine: nothing was added
            self.close_stream(request_id, q)
            raise
        except BaseException:  # cancelled: in thread mode the queued call may have run just before
            self.abort_nowait(request_id)
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

    async def commit(self, request_id: str, kv, kv_scales=None) -> asyncio.Queue:
        q = self.open_stream(request_id)
        try:
            await self._engine_call(lambda: self.engine.commit_prefilled(request_id, kv, kv_scales))
        except ValueError:
            self.close_stream(request_id, q)
            raise
        except BaseException:  # cancelled, maybe after the queued commit ran: free what it holds
            self.abort_nowait(request_id)
            raise
        self._wakeup.set()
        return q

    def wake(self) -> None:
        """Step soon: work was added outside ``add_request``/``commit`` (KV adopted by reference)."""
        self._wakeup.set()

    def abort_nowait(self, request_id: str, q: asyncio.Queue | None = None) -> bool:
        """Abort now, or right after the running step; safe in ``finally`` blocks of cancelled tasks (no
        await). Returns whether the engine knew the request (when queued behind a step: whether it knows
        it now; the abort itself happens before the next step, so its blocks are freed by then).
        A handler still waiting on the request's stream gets a final "abort" output: it is released now,
        not at its timeout (POST /internal/abort of a request whose caller gave up).
        Given the caller's stream ``q`` (a handler cleaning up after itself), nothing is done unless the id's
        stream is still ``q``: another stream means a later attempt under the same id replaced this one (and
        aborted it), no stream means it was aborted already."""
        if q is not None and self._streams.get(request_id) is not q:
            return False
        q = self._streams.pop(request_id, None)
        if q is not None:
            q.put_nowait(RequestOutput(request_id, [], True, "abort", 0, 0, error="request was aborted"))
        if self._stepping:
            self._pending.append((lambda: self.engine.abort_request(request_id), None))
            self._aborted_in_step.add(request_id)
            self._wakeup.set()
            return request_id in self.engine.requests
        return self.engine.abort_request(request_id)

    async def abort(self, request_id: str) -> bool:
        """As ``abort_nowait``: never waits, so a cancelled caller cannot skip the abort."""
        return self.abort_nowait(request_id)
