"""One request's journey through the workers, as a stream of token events.

Disaggregated: prefill worker (token #1 + KV handle) → token #1 is yielded at
once → decode worker pulls the KV and streams the rest. Colocated: one worker
does both. If a worker fails mid-request (connection refused or reset, or a
stream that ends without a finish), the request is *migrated*: prompt + the
tokens generated so far are prefilled again on a live worker and the stream
continues. Sampling is a pure function of (seed, token index), so the client
sees the same tokens it would have seen without the failure: no gap, no
duplicate.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing, contextmanager
from dataclasses import dataclass, field

import aiohttp
from pydantic import ValidationError

from distserve.server.idle import IdleTimeout
from distserve.server.lograte import RateLimitedLog, describe
from distserve.server.metrics import RouterMetrics
from distserve.server.router.decode_room import DecodeRoom, NoRoom
from distserve.server.router.registry import DEAD, WorkerInfo, WorkerRegistry
from distserve.server.router.ttft_predictor import Call, RequestPhases, TtftPredictor
from distserve.server.wire import InternalSampling, PrefillResponse, StreamLine, TokenLogprob

log = logging.getLogger(__name__)


@contextmanager
def _routed(worker: WorkerInfo):
    """Count a request against ``worker``'s load for as long as it is routed there."""
    worker.inflight += 1
    try:
        yield
    finally:
        worker.inflight -= 1


_STREAM_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=5)  # reads: IdleTimeout in _stream


def _check_logprobs(worker: WorkerInfo, req: EngineRequest, token_ids: list[int], logprobs) -> None:
    """A request that asked for logprobs gets them with every token (the count is the wire model's check)."""
    if req.sampling.logprobs is not None and token_ids and logprobs is None:
        raise WorkerFailed(worker, "answer lacks the logprobs the request asked for")


class NoWorkersError(Exception):
    """No healthy worker can take the request (HTTP 503 before streaming starts)."""


class NoRoomInTime(NoWorkersError):
    """No decode worker had room for the request within its timeout."""


class WorkerFailed(Exception):
    def __init__(self, worker: WorkerInfo, reason: str, dead: bool = False) -> None:
        super().__init__(f"{worker.role} worker {worker.worker_id}: {reason}")
        self.worker = worker
        self.reason = reason
        self.dead = dead  # nothing listens at its address any more: the process is gone


def _call_failed(worker: WorkerInfo, what: str, e: BaseException, idle: IdleTimeout) -> WorkerFailed:
    if isinstance(e, asyncio.TimeoutError) and idle.reason:
        return WorkerFailed(worker, f"{what}: {idle.reason}")
    refused = isinstance(e, aiohttp.ClientConnectorError) and isinstance(e.os_error, ConnectionRefusedError)
    return WorkerFailed(worker, f"{what}: {describe(e)}", dead=refused)


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: InternalSampling  # seed always set by the router, so migrations reproduce tokens
    arrival: float = field(default_factory=time.perf_counter)
    path: str | None = None  # where its prompt was prefilled last: "disaggregated" or "local" (journaled)
    phases: RequestPhases | None = None  # its TTFT's measured parts, when admission predicts them


@dataclass
class TokenEvent:
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    kv_recomputed: bool = False  # the decode worker could not pull the KV and recomputed the prompt
    num_cached_tokens: int | None = None  # prompt tokens the prefilling worker's prefix cache served
    logprobs: list[TokenLogprob] | None = None  # one per token id when the request asked for logprobs


@dataclass
class PipelineOptions:
    token: str
    request_timeout_s: float
    # A token stream that delivers nothing (no token, no keep-alive line) for this long has failed
    # on that worker: the request migrates. Workers send keep-alives at a quarter of it while a
    # request waits for room or for its KV.
    progress_timeout_s: float = 10.0
    worker_wait_s: float = 10.0  # how long a started stream waits for a live worker after a failure
    max_migrations: int = 3
    log_period_s: float = 5.0  # per-request warnings: one line per cause per period (server/lograte.py)
    # requests routed to one decode worker at a time (decode.max_concurrent_requests; 0 = no bound): past it,
    # or while it reports requests waiting for KV room, a request waits here *before* its prefill, so no
    # staged KV outlives its lease behind the decode worker's back-pressure (then recomputed on the decode
    # worker, whose long prefill steps starved every stream on it: the first-use report's collapse)
    decode_slots: int = 0
    # conditional disaggregation (router.local_prefill_* in server/config.py); 0 = off
    local_prefill_max_tokens: int = 0
    local_prefill_prefill_load: float = 0.0


class Pipeline:
    def __init__(
        self, registry: WorkerRegistry, http: aiohttp.ClientSession, metrics: RouterMetrics, options: PipelineOptions
    ) -> None:
        self.registry = registry
        self.http = http
        self.metrics = metrics
        self.options = options
        self.headers = {"Authorization": f"Bearer {options.token}"}
        self.request_log = RateLimitedLog(log, options.log_period_s)
        self.room = DecodeRoom(registry, options.decode_slots)  # decode room before the prefill, in arrival order
        self.predictor: TtftPredictor | None = None  # told each request's phases (admission's TTFT prediction)

    def _call_started(self, worker: WorkerInfo, tokens: int) -> Call | None:
        return self.predictor.call_started(worker.worker_id, tokens) if self.predictor is not None else None

    def _call_ended(self, call: Call | None, ok: bool, req: EngineRequest) -> None:
        if call is not None and self.predictor is not None:
            self.predictor.call_ended(call, ok, req.phases)

    def check_available(self) -> str:
        mode = self.registry.mode()
        if mode is None:
            raise NoWorkersError(
                f"no healthy prefill+decode pair or colocated worker ({len(self.registry.workers)} registered)"
            )
        return mode

    async def _wait_for_mode(self) -> str | None:
        deadline = time.monotonic() + self.options.worker_wait_s
        while True:
            mode = self.registry.mode()
            if mode is not None or time.monotonic() > deadline:
                return mode
            await asyncio.sleep(0.05)

    async def generate(self, req: EngineRequest) -> AsyncGenerator[TokenEvent, None]:
        outputs: list[int] = []
        failures = 0
        while True:
            mode = await self._wait_for_mode() if failures else self.check_available()
            if mode is None:
                yield TokenEvent([], True, "error", "no healthy workers left to continue the request")
                return
            try:
                if mode == "disaggregated":
                    stream = self._disaggregated(req, outputs)
                else:
                    stream = self._colocated(req, outputs)
                async with aclosing(stream):
                    async for event in stream:
                        outputs.extend(event.token_ids)
                        yield event
                        if event.finished:
                            return
                raise RuntimeError("worker stream ended without a finish")  # defensive; streams raise
            except NoRoomInTime:
                raise  # waited the whole request timeout for decode room: no point waiting again
            except NoWorkersError as e:
                # check_available() above found a pair; it went out of rotation since (a worker marked suspect
                # or late with a heartbeat while this request waited for decode room): wait for one to come
                # back, as after a worker failure, instead of failing a request that has not started
                failures += 1
                if failures > self.options.max_migrations:
                    yield TokenEvent([], True, "error", f"giving up: {e}")
                    return
            except WorkerFailed as e:
                failures += 1
                if e.dead:
                    self.registry.mark_dead(e.worker.worker_id, "connection refused")
                else:
                    self.registry.mark_suspect(e.worker.worker_id, e.reason)
                if outputs:
                    self.metrics.migrations.inc()
                # one line per worker and kind of failure per period, not one per request (server/lograte.py)
                self.request_log.warning(
                    f"requests failing on {e.worker.role} worker {e.worker.worker_id} ({e.reason.split(':')[0]})",
                    "request %s: %s; %s (attempt %d)",
                    req.request_id,
                    e,
                    "migrating" if outputs else "retrying",
                    failures,
                )
                if failures > self.options.max_migrations:
                    yield TokenEvent([], True, "error", f"giving up after {failures} worker failures: {e}")
                    return

    # --- the two paths ------------------------------------------------------
    async def _colocated(self, req: EngineRequest, outputs: list[int]) -> AsyncGenerator[TokenEvent, None]:
        worker = self._pick_prefiller("colocated", req.prompt_token_ids + outputs)
        if worker is None:
            raise NoWorkersError("no healthy colocated worker")
        req.path = "local"
        self.metrics.prefill_path.labels("local").inc()
        with _routed(worker):
            async with aclosing(self._timed_stream(worker, req, outputs, None, ttft=True)) as stream:
                async for ev in stream:
                    yield ev

    async def _pick_decode(self, req: EngineRequest) -> WorkerInfo | None:
        """The least-loaded decode worker, once it has room for one more request (``decode_slots``; in
        arrival order: server/router/decode_room.py)."""
        try:
            decode, waited, releases = await self.room.acquire(
                lambda: self.registry.pick("decode"), self.options.request_timeout_s
            )
        except NoRoom as e:
            raise NoRoomInTime(str(e)) from None
        if self.predictor is not None:
            self.predictor.room_granted(req.phases, waited, releases)
        return decode

    def _pick_prefiller(self, role: str, token_ids: list[int]) -> WorkerInfo | None:
        """A cache-aware pick of the worker that will prefill ``token_ids`` (counted in /metrics)."""
        worker = self.registry.pick(role, token_ids=token_ids)
        if worker is not None and self.registry.prefix_cache_weight:
            self.metrics.prefix_picks.labels("hit" if self.registry.last_pick_cached_tokens else "miss").inc()
        return worker

    def _record(self, worker: WorkerInfo, seconds: float) -> None:
        """A latency sample of ``worker`` (TTFT or TPOT) for outlier ejection (server/router/outlier.py)."""
        pool = [w for w in self.registry.workers.values() if w.role == worker.role and w.healthy]
        self.registry.outliers.record(worker, seconds, pool)

    def _local_prefill(self, decode: WorkerInfo, token_ids: list[int]) -> bool:
        """Conditional disaggregation: prefill this request on its decode worker instead of a prefill worker?

        Yes when the part of the prompt the decode worker has not cached is short
        (``local_prefill_max_tokens``), or when every prefill worker carries at least
        ``local_prefill_prefill_load`` of load and the decode worker queues nothing. A decode worker
        prefills as a colocated one does (``/internal/generate`` without a KV handle, the path of a
        recompute), so the tokens are the same either way."""
        o = self.options
        if o.local_prefill_max_tokens:
            cached = self.registry.cached_tokens(token_ids, [decode])[decode.worker_id]
            if len(token_ids) - cached <= o.local_prefill_max_tokens:
                return True
        if o.local_prefill_prefill_load:
            prefills = [w for w in self.registry.healthy("prefill") if not w.ejected_until]
            s = decode.status
            if (
                prefills
                and all(w.load() >= o.local_prefill_prefill_load for w in prefills)
                and s.num_waiting + s.num_reserving == 0
            ):
                return True
        return False

    async def _timed_stream(
        self, worker: WorkerInfo, req: EngineRequest, outputs: list[int], kv: dict | None, ttft: bool
    ) -> AsyncGenerator[TokenEvent, None]:
        """``_stream``, recording the worker's TTFT (``ttft``: it prefills) or its TPOT (it decodes)."""
        t0 = time.perf_counter()
        first_at: float | None = None
        n = 0
        # a stream that prefills (no KV handle) is a call that ends with a first token (TTFT prediction)
        call = self._call_started(worker, len(req.prompt_token_ids) + len(outputs)) if kv is None else None
        try:
            async with aclosing(self._stream(worker, req, outputs, kv)) as stream:
                async for ev in stream:
                    if ev.token_ids:
                        now = time.perf_counter()
                        if first_at is None:
                            first_at = now
                            self._call_ended(call, True, req)
                            if ttft:
                                self._record(worker, now - t0)
                            if kv is None:  # it prefilled these tokens itself: they are in its prefix cache now
                                self.registry.prefix.note_prefilled(worker.worker_id, req.prompt_token_ids + outputs)
                        n += len(ev.token_ids)
                        if ev.finished and not ttft and n > 1 and not ev.error:
                            self._record(worker, (now - first_at) / (n - 1))
                    yield ev
        finally:
            self._call_ended(call, False, req)  # a no-op once its first token ended it

    async def _disaggregated(self, req: EngineRequest, outputs: list[int]) -> AsyncGenerator[TokenEvent, None]:
        decode = await self._pick_decode(req)
        if decode is None:
            raise NoWorkersError("no healthy prefill/decode pair")
        tokens = req.prompt_token_ids + outputs
        if self._local_prefill(decode, tokens):
            req.path = "local"
            self.metrics.prefill_path.labels("local").inc()
            with _routed(decode):
                async with aclosing(self._timed_stream(decode, req, outputs, None, ttft=False)) as stream:
                    async for ev in stream:
                        yield ev
            return
        prefill = self._pick_prefiller("prefill", tokens)
        if prefill is None:
            raise NoWorkersError("no healthy prefill/decode pair")
        req.path = "disaggregated"
        self.metrics.prefill_path.labels("disaggregated").inc()
        decode.inflight += 1  # counted from the pick, so a burst of picks spreads over the workers
        try:
            with _routed(prefill):
                t0 = time.perf_counter()
                call, answered = self._call_started(prefill, len(tokens)), False
                try:
                    first = await self._prefill(
                        prefill, req, outputs, decode.host_id, decode.cuda_uuids, decode.kv_arena
                    )
                    answered = first.error is None
                finally:
                    self._call_ended(call, answered, req)
                if first.error is None:
                    self._record(prefill, time.perf_counter() - t0)
                    self.registry.prefix.note_prefilled(prefill.worker_id, req.prompt_token_ids + outputs)
            done = outputs + first.token_ids  # copy now: the caller extends `outputs` when we yield
            pulled = first.finished  # True once no staged KV can be left behind on the prefill worker
            try:
                _check_logprobs(prefill, req, first.token_ids, first.logprobs)
                yield TokenEvent(
                    first.token_ids,
                    first.finished,
                    first.finish_reason,
                    first.error,
                    logprobs=first.logprobs,
                    num_cached_tokens=first.num_cached_tokens,
                )
                if first.finished:
                    return
                if not decode.healthy:  # failed while we prefilled: pick again
                    other = self.registry.pick("decode")
                    if other is not None:
                        decode.inflight -= 1
                        decode = other
                        decode.inflight += 1
                async with aclosing(self._timed_stream(decode, req, done, first.kv, ttft=False)) as stream:
                    async for ev in stream:
                        if not pulled and (ev.error or ev.kv_recomputed):
                            # the decode worker did not take the KV (pull failed): free it on the prefill
                            # worker now rather than when its lease ends
                            asyncio.ensure_future(self._abort(prefill, req.request_id))
                        pulled = True  # from here no staged KV of this request is left to free
                        yield ev
            except WorkerFailed:
                if not pulled:  # free the staged KV before a retry re-prefills this request id
                    await self._abort(prefill, req.request_id)
                raise
            except (GeneratorExit, asyncio.CancelledError):
                if not pulled:  # client gone or stop string hit at token #1: release the staged KV now
                    asyncio.ensure_future(self._abort(prefill, req.request_id))
                raise
        finally:
            decode.inflight -= 1

    async def _prefill(
        self,
        worker: WorkerInfo,
        req: EngineRequest,
        outputs: list[int],
        peer_host: str,
        peer_cuda: list[str] | None = None,
        peer_kv_arena: str = "",
    ) -> PrefillResponse:
        body = {
            "request_id": req.request_id,
            "prompt_token_ids": req.prompt_token_ids,
            "output_token_ids": outputs,
            "sampling": req.sampling.model_dump(),
            "peer_host_id": peer_host,
            "peer_cuda_uuids": peer_cuda,
            **({"peer_kv_arena": peer_kv_arena} if peer_kv_arena else {}),
        }
        # The progress deadline covers prefill too: a worker whose answer takes longer sends a blank
        # whenever its engine completed a step (server/workers/app.py: _with_progress), so one whose
        # engine hangs while it heartbeats is given up on after progress_timeout_s, not request_timeout_s.
        # As for a stream: a worker inside one long step (heartbeating, ``in_step``) is waited for, up to the
        # request timeout; one stalled between steps sends nothing and is given up on.
        idle = IdleTimeout(self.options.progress_timeout_s, self._heartbeating(worker), self.options.request_timeout_s)
        try:
            with worker.watch(idle):  # a prefill worker that freezes fails this wait when it goes stale
                r = await idle.wait(
                    self.http.post(
                        f"{worker.url}/internal/prefill", json=body, headers=self.headers, timeout=_STREAM_TIMEOUT
                    )
                )
                async with r:
                    if r.status == 400:
                        detail = (await idle.wait(r.json())).get("detail", "bad request")
                        raise ValueError(detail)
                    if r.status != 200:
                        raise WorkerFailed(worker, f"prefill answered HTTP {r.status}")
                    chunks = []
                    while data := await idle.wait(r.content.readany()):
                        chunks.append(data)
                    first = PrefillResponse.model_validate_json(b"".join(chunks))
                    if not first.finished and first.kv is None:
                        raise WorkerFailed(worker, "prefill answer has neither a finish nor a KV handle")
                    return first
        except ValidationError as e:
            raise WorkerFailed(worker, f"prefill answer does not parse: {e.errors()[0]['msg']}") from None
        except (TimeoutError, aiohttp.ClientError, ConnectionError) as e:
            asyncio.ensure_future(self._abort(worker, req.request_id))  # if it comes back, drop the work
            raise _call_failed(worker, "prefill failed", e, idle) from None
        except asyncio.CancelledError:
            asyncio.ensure_future(self._abort(worker, req.request_id))
            raise
        finally:
            idle.close()

    async def _stream(
        self, worker: WorkerInfo, req: EngineRequest, outputs: list[int], kv: dict | None
    ) -> AsyncGenerator[TokenEvent, None]:
        body = {
            "request_id": req.request_id,
            "prompt_token_ids": req.prompt_token_ids,
            "output_token_ids": outputs,
            "sampling": req.sampling.model_dump(),
            "kv": kv,
        }
        # The read timeout is ours, not aiohttp's sock_read (which reschedules a timer per received
        # chunk, i.e. per token): one lazily re-armed timer per stream, see server/idle.py.
        # It is the progress deadline: the worker sends a token or a keep-alive line well within it.
        # A worker that still heartbeats (from its own thread) with work queued is in a long step, not frozen:
        # its stream waits on, up to the request timeout; a frozen one goes stale and fails it as before.
        idle = IdleTimeout(self.options.progress_timeout_s, self._heartbeating(worker), self.options.request_timeout_s)
        try:
            with worker.watch(idle):
                r = await idle.wait(
                    self.http.post(
                        f"{worker.url}/internal/generate", json=body, headers=self.headers, timeout=_STREAM_TIMEOUT
                    )
                )
                async with r:
                    if r.status != 200:
                        raise WorkerFailed(worker, f"generate answered HTTP {r.status}")
                    # Whatever arrived, split into lines here: aiohttp's readline is a Python loop per
                    # line, and a line arrives per token. A line cut across reads waits in `rest`.
                    content, rest = r.content, b""
                    while True:
                        data = await idle.wait(content.readany())
                        if not data:  # EOF: a last line without its newline still counts (as readline did)
                            lines, rest = ([rest] if rest.strip() else []), b""
                        else:
                            lines = (rest + data if rest else data).split(b"\n")
                            rest = lines.pop()
                        for raw in lines:
                            if not raw.strip():  # keep-alive
                                continue
                            line = StreamLine.model_validate_json(raw)
                            if line.kv_transfer_seconds is not None:
                                transport = line.kv_transport or "?"
                                self.metrics.kv_transfer_seconds.labels(transport).observe(line.kv_transfer_seconds)
                                self.metrics.kv_transfer_bytes.labels(transport).inc(line.kv_transfer_bytes or 0)
                            _check_logprobs(worker, req, line.token_ids, line.logprobs)
                            ev = TokenEvent(
                                line.token_ids,
                                line.finished,
                                line.finish_reason,
                                line.error,
                                kv_recomputed=line.kv_transport == "recompute",
                                num_cached_tokens=line.num_cached_tokens,
                                logprobs=line.logprobs,
                            )
                            yield ev
                            if ev.finished:
                                return
                        if not data:
                            break
                raise WorkerFailed(worker, "stream ended before the request finished")
        except ValidationError as e:
            raise WorkerFailed(worker, f"stream line does not parse: {e.errors()[0]['msg']}") from None
        except (TimeoutError, aiohttp.ClientError, ConnectionError) as e:
            raise _call_failed(worker, "stream broke", e, idle) from None
        finally:
            idle.close()

    def _heartbeating(self, worker: WorkerInfo):
        """Asked when a wait on ``worker`` has been quiet for the progress deadline: wait on (True) or fail it?

        On while it is busy and working through its queue: it has work, its heartbeats are not older than the
        registry lets a silent worker's waits live (``fail_waits_after_s``: a frozen process fails there), and
        its engine is in a step or completed one within the deadline (``WorkerInfo.progressing``). So a request
        queued behind others, or inside a long step, waits; one on a worker stalled between steps fails. Not a
        test of the worker's *state*: a worker marked suspect because another call failed, or stale for a
        moment because its heartbeats were late, is as alive as its heartbeats and step count say; testing
        the state failed every other wait on it at their next check (one timeout became all of them)."""
        reg = self.registry
        fresh_s, deadline_s = reg.fail_waits_after_s, self.options.progress_timeout_s

        def alive() -> bool:
            s, now = worker.status, time.monotonic()
            busy = s.num_running + s.num_waiting + s.num_reserving > 0
            return (
                busy
                and worker.state != DEAD
                and reg.silent_for(worker, now) < fresh_s
                and worker.progressing(now, deadline_s)
            )

        return alive

    async def _abort(self, worker: WorkerInfo, request_id: str) -> None:
        try:
            async with self.http.post(
                f"{worker.url}/internal/abort",
                json={"request_id": request_id},
                headers=self.headers,
                timeout=aiohttp.ClientTimeout(total=2),
            ):
                pass
        except (TimeoutError, aiohttp.ClientError, OSError):
            pass
