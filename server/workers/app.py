"""A worker's HTTP face: internal endpoints the router calls, plus /health and /metrics.

- ``POST /internal/prefill`` (prefill role): run prefill, sample token #1, stage
  the KV under a lease, answer with the token and the KV handle.
- ``POST /internal/generate`` (decode and colocated roles): NDJSON stream of
  tokens. With a KV handle: reserve blocks (back-pressure), pull the KV, decode.
  Without one: prefill locally (colocated, or recompute after a failed pull or
  a migration).
- ``POST /internal/abort``; ``GET /internal/status``.

When the router drops a stream (its client went away), the generator is
cancelled and the request is aborted in the engine: its blocks are freed at once.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from distserve.server.config import DistServeConfig
from distserve.server.engine.memory_pressure import is_memory_error, relieve
from distserve.server.engine.sampling_params import SamplingParams
from distserve.server.engine.structured.grammar import Constraint
from distserve.server.idle import IdleTimeout
from distserve.server.kv_transfer import KVHandle, KVPuller, KVStagingServer, TransferStatus, cuda_ipc
from distserve.server.kv_transfer.by_reference import is_reference
from distserve.server.kv_transfer.factory import choose_transport, host_id
from distserve.server.metrics import WorkerMetrics
from distserve.server.wire import (
    MAX_PREFIX_BLOCKS,
    AbortRequest,
    GenerateRequest,
    InternalSampling,
    PrefillRequest,
    PrefillResponse,
    StreamLine,
    TokenLogprob,
    WorkerStatus,
)
from distserve.server.workers import kv_reference
from distserve.server.workers.engine_loop import EngineLoop
from distserve.server.workers.fault import FaultRequest, StepDelays, arm_oom, arm_oom_kv_takes
from distserve.server.workers.guard import AuthFirst, internal_body_limit

log = logging.getLogger(__name__)

SUMMARY_RESEND_S = 5.0  # a full prefix summary goes out at least this often, changed or not


@dataclass(eq=False)
class HandOff:
    """A prefill between its last step and its answer: its KV taken out of the pool and being staged. An abort
    (``POST /internal/abort``: the router's client left) that lands now finds the request neither in the engine
    nor in the sender; it marks this instead, and the KV is released as soon as it is staged."""

    aborted: bool = False


@dataclass
class WorkerState:
    role: str
    worker_id: str
    config: DistServeConfig
    token: str
    loop: EngineLoop
    metrics: WorkerMetrics
    sender: KVStagingServer | None = None
    puller: KVPuller | None = None
    lessor: Any = None  # by_reference.KVLessor (decode worker whose pool is an arena)
    lessee: Any = None  # by_reference.KVLessee (prefill worker with kv_transfer.by_reference on/auto)
    fatal_error: str | None = None  # set when the router refuses us; the process exits with it
    started: float = field(default_factory=time.monotonic)
    summary_sent_version: int = -1  # prefix summary last put on a heartbeat (heartbeat thread only)
    summary_sent_at: float = 0.0
    # prefills here whose KV is gathered out of the pool and not yet handed over (by reference: waiting for
    # their lease's room or writing; by copy: until staged): device memory that comes back when they finish
    kv_gathered_held: int = 0
    kv_gather_waiting: int = 0  # prefills waiting for that memory to gather their own KV (proof of progress)
    handoffs: dict[str, HandOff] = field(default_factory=dict)  # by request id: prefills staging their KV

    def status(self) -> WorkerStatus:
        return self.loop.status(self.sender.num_staged if self.sender else 0)

    def heartbeat_status(self) -> WorkerStatus:
        """``status()`` plus the prefix summary (cache-aware routing): the cached blocks' digests when they
        changed since the last heartbeat, or every ``SUMMARY_RESEND_S`` (a router that restarted or lost a
        heartbeat gets them again); otherwise only their version ("unchanged")."""
        s = self.status()
        bm = self.loop.engine.block_manager
        if not bm.enable_prefix_caching:
            return s
        s.prefix_block_size = bm.block_size
        now = time.monotonic()
        version = bm.cache_version
        if version == self.summary_sent_version and now - self.summary_sent_at < SUMMARY_RESEND_S:
            s.prefix_version = version
            return s
        version, digests = bm.cached_digests(MAX_PREFIX_BLOCKS)
        if version < 0:  # could not copy it consistently: say nothing this time
            return s
        s.prefix_version, s.prefix_blocks = version, [d.hex() for d in digests]
        self.summary_sent_version, self.summary_sent_at = version, now
        return s


def to_sampling_params(s: InternalSampling) -> SamplingParams:
    structured = None if s.structured is None else Constraint(s.structured.kind, s.structured.text, s.structured.strict)
    return SamplingParams(
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        seed=s.seed,
        stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        structured=structured,
        min_p=s.min_p,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty,
        logit_bias=tuple((int(t), float(b)) for t, b in s.logit_bias),
        logprobs=s.logprobs,
    )


def wire_logprobs(lps) -> list[TokenLogprob] | None:
    """The engine's per-token logprobs as wire models (None when the request asked for none)."""
    if lps is None:
        return None
    return [TokenLogprob(logprob=lp, top=top) for lp, top in lps]


async def _prepare_grammar(state: WorkerState, params: SamplingParams) -> None:
    """Compile the request's grammar (or find it in the cache) off the event loop, before the engine sees
    the request; GrammarError (a ValueError) when it cannot be compiled."""
    if params.structured is not None:
        await asyncio.to_thread(state.loop.engine.structured.prepare, params.structured)


def create_worker_app(state: WorkerState) -> FastAPI:
    app = FastAPI(title=f"distserve {state.role} worker", docs_url=None, redoc_url=None)
    app.state.worker = state
    app.add_middleware(
        AuthFirst,
        token=state.token,
        max_body_bytes=internal_body_limit(state.config.prefill.max_seq_len),
        body_timeout_s=state.config.router.body_timeout_s,
    )

    async def require_token(request: Request) -> None:  # async: FastAPI runs a sync dependency in a thread
        got = request.headers.get("authorization", "")
        if not hmac.compare_digest(got.encode(), f"Bearer {state.token}".encode()):
            raise HTTPException(status_code=401, detail="missing or wrong bearer token")

    def require_role(*roles: str) -> None:
        if state.role not in roles:
            raise HTTPException(
                status_code=409, detail=f"this is a {state.role} worker; endpoint needs role {' or '.join(roles)}"
            )

    @app.get("/health")
    async def health():
        recent = state.loop.engine.memory_pressure.recent()
        if recent:  # serving, but steps fail for lack of device memory
            return {
                "status": "degraded",
                "role": state.role,
                "worker_id": state.worker_id,
                "reason": f"{recent} engine steps failed for lack of device memory in the last "
                f"{state.loop.engine.memory_pressure.window_s:g} s",
            }
        return {"status": "ok", "role": state.role, "worker_id": state.worker_id}

    @app.get("/metrics")
    async def metrics():
        state.metrics.refresh(state.status(), state.loop.stats)
        if state.loop.engine.runner.kv_calibration is not None:  # FP8 KV: scales and calibration state
            state.metrics.set_kv_calibration(await state.loop.call(state.loop.engine.kv_calibration_report))
        return PlainTextResponse(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/admin/fault", dependencies=[Depends(require_token)])
    async def fault(body: FaultRequest):
        state.loop.fault = StepDelays.from_request(body)
        log.warning("fault hook: engine step delays now %s", state.loop.fault.to_dict())
        out = state.loop.fault.to_dict()
        if body.oom_forwards:
            await state.loop.call(lambda: arm_oom(state.loop.engine, body.oom_forwards))
            log.warning("fault hook: the next %d model forwards raise OutOfMemoryError", body.oom_forwards)
            out["oom_forwards"] = body.oom_forwards
        if body.oom_kv_takes:
            await state.loop.call(lambda: arm_oom_kv_takes(state.loop.engine, body.oom_kv_takes))
            log.warning("fault hook: the next %d KV gathers raise OutOfMemoryError", body.oom_kv_takes)
            out["oom_kv_takes"] = body.oom_kv_takes
        return out

    @app.get("/internal/status", dependencies=[Depends(require_token)])
    async def status():
        return state.status().model_dump()

    @app.post("/internal/abort", dependencies=[Depends(require_token)])
    async def abort(body: AbortRequest):
        aborted = await state.loop.abort(body.request_id)
        handoff = state.handoffs.get(body.request_id)
        if handoff is not None:  # its KV is being staged: released once it is (_prefill)
            handoff.aborted = aborted = True
        if state.sender is not None:
            aborted = state.sender.abort(body.request_id) or aborted
        if state.lessee is not None:  # a lease written for it and not adopted goes back to its decode worker
            aborted = await state.lessee.release(body.request_id) or aborted
        if state.lessor is not None:
            aborted = bool(await state.lessor.abort_request(body.request_id)) or aborted
        return {"aborted": aborted}

    @app.post("/internal/prefill", dependencies=[Depends(require_token)])
    async def prefill(body: PrefillRequest, request: Request):
        require_role("prefill")
        return await _with_progress(state, request, _prefill(state, body))

    @app.post("/internal/generate", dependencies=[Depends(require_token)])
    async def generate(body: GenerateRequest):
        require_role("decode", "colocated")
        if body.kv is not None and state.role != "decode":
            raise HTTPException(status_code=409, detail="only decode workers accept a KV handle")
        return StreamingResponse(_generate_stream(state, body), media_type="application/x-ndjson")

    return app


async def _prefill(state: WorkerState, body: PrefillRequest) -> JSONResponse:
    rid = body.request_id
    try:
        params = to_sampling_params(body.sampling)
        await _prepare_grammar(state, params)
        staged = state.sender is not None and state.sender.poll(rid) in (
            TransferStatus.PENDING,
            TransferStatus.TRANSFERRING,
        )
        if rid in state.loop.engine.requests or staged or rid in state.handoffs:
            # only the router sends prefills, with ids it made: the same id again means it gave up on an earlier
            # attempt here (a progress deadline) before that attempt's abort landed; the new attempt replaces it,
            # its KV still staged included (else staging the new one fails: "already staged")
            log.info("request %s sent again: its earlier attempt here is aborted", rid)
            state.loop.abort_nowait(rid)
            if rid in state.handoffs:  # that attempt is staging its KV: it releases it once staged
                state.handoffs[rid].aborted = True
            if state.sender is not None:
                state.sender.abort(rid)
        q = await state.loop.add_request(
            rid, body.prompt_token_ids, params, prefill_only=True, output_token_ids=body.output_token_ids
        )
    except ValueError as e:
        raise HTTPException(status_code=400, detail=str(e)) from None
    t0 = time.perf_counter()
    held = False  # this prefill's KV is gathered and counted in state.kv_gathered_held
    handoff: HandOff | None = None
    leased = kv_reference.early_lease(state, body)  # by reference: the decode worker's blocks, while we prefill
    try:
        async with asyncio.timeout(state.config.router.request_timeout_s):
            out = await q.get()
        if out.finish_reason != "prefilled":  # stopped at token #1 (EOS, max_tokens=1) or aborted
            return JSONResponse(
                PrefillResponse(
                    token_ids=out.new_token_ids,
                    logprobs=wire_logprobs(out.logprobs),
                    finished=True,
                    finish_reason=out.finish_reason,
                    error=out.error,
                    prefill_seconds=time.perf_counter() - t0,
                    num_cached_tokens=out.num_cached_tokens,
                ).model_dump()
            )
        # By reference the KV is gathered out of this pool before its lease is awaited, never kept in the pool while
        # the lease waits for room: early leases hold the decode worker's blocks for requests still queued here,
        # and a pool full of finished prefills waiting for those blocks would wait for ever (hold and wait; seen
        # as a hung full-pool test). The price, with by_reference 'on' only: a full decode pool holds gathered KV
        # in device memory outside this pool while its leases wait (docs/FAILURE_SEMANTICS.md).
        t1 = time.perf_counter()
        phases = state.metrics.prefill_phase_seconds
        phases.labels("queued_and_step").observe(t1 - t0)
        handoff = state.handoffs[rid] = HandOff()
        try:
            kv, ready, kv_scales = await _take_kv_when_memory(state, rid, t0 + state.config.router.request_timeout_s)
            state.kv_gathered_held += 1
            held = True
        except KeyError:  # aborted (POST /internal/abort) between its last step and now: nothing to stage
            return JSONResponse(
                PrefillResponse(
                    token_ids=[], finished=True, finish_reason="abort", error="request was aborted during prefill"
                ).model_dump()
            )
        except Exception as e:
            if not is_memory_error(e):
                raise
            return await _out_of_memory(state, rid, "taking the prompt's KV out of the pool", e)
        kvc = state.config.kv_transfer
        nbytes = kv.numel() * kv.element_size()
        same_host = body.peer_host_id is None or body.peer_host_id == host_id()
        if body.peer_kv_arena and same_host and state.lessee is not None:  # by reference when it can
            try:
                lease, leased = leased, None  # hand_off consumes it (releases it on any failure)
                ref = await kv_reference.prefill_by_reference(state, rid, kv, ready, body.peer_kv_arena, lease)
            except ValueError as e:  # by_reference 'on' and it failed
                return JSONResponse(
                    PrefillResponse(token_ids=[], finished=True, finish_reason="abort", error=str(e)).model_dump()
                )
            except Exception as e:
                if not is_memory_error(e):
                    raise
                del kv
                return await _out_of_memory(state, rid, "writing the KV into the decode worker's blocks", e)
            if ref is not None:
                phases.labels("take_kv").observe(time.perf_counter() - t1)
                state.metrics.prefill_seconds.observe(time.perf_counter() - t0)
                return JSONResponse(
                    PrefillResponse(
                        token_ids=out.new_token_ids,
                        logprobs=wire_logprobs(out.logprobs),
                        finished=False,
                        kv=ref,
                        prefill_seconds=time.perf_counter() - t0,
                        num_cached_tokens=out.num_cached_tokens,
                    ).model_dump()
                )
        peer_gpu = (
            None
            if not kv.is_cuda or body.peer_cuda_uuids is None
            else (cuda_ipc.gpu_uuid(kv.device) in body.peer_cuda_uuids)
        )
        transport = choose_transport(
            kvc.transport, nbytes, same_host, kvc.zero_copy_threshold_mb, kv_on_cuda=kv.is_cuda, peer_gpu=peer_gpu
        )
        t2 = time.perf_counter()
        phases.labels("take_kv").observe(t2 - t1)
        # an FP8 cache's bytes travel with the scales they were quantised with (in the handle)
        scales = tuple((k, v) for k, v in kv_scales) if kv_scales is not None else ()
        # the staging thread runs to its end whatever happens to this handler: a handler cancelled meanwhile (its
        # caller gone) releases what it stages; an abort that landed meanwhile marked `handoff` (before: either
        # left the KV staged, unreachable, until its lease ran out)
        staging = asyncio.ensure_future(asyncio.to_thread(_stage, state, rid, kv, ready, transport, scales))
        try:
            handle = await asyncio.shield(staging)
        except asyncio.CancelledError:
            staging.add_done_callback(lambda f: _release_staged(state, f))
            raise
        except Exception as e:
            if not is_memory_error(e):
                raise
            del kv
            return await _out_of_memory(state, rid, f"staging the KV ({transport})", e)
        if handoff.aborted:
            _release_staged(state, staging)
            return JSONResponse(
                PrefillResponse(
                    token_ids=[], finished=True, finish_reason="abort", error="request was aborted during prefill"
                ).model_dump()
            )
        phases.labels("stage").observe(time.perf_counter() - t2)
        state.metrics.prefill_seconds.observe(time.perf_counter() - t0)
        return JSONResponse(
            PrefillResponse(
                token_ids=out.new_token_ids,
                logprobs=wire_logprobs(out.logprobs),
                finished=False,
                kv=handle.to_dict(),
                prefill_seconds=time.perf_counter() - t0,
                num_cached_tokens=out.num_cached_tokens,
            ).model_dump()
        )
    except BaseException:
        state.loop.abort_nowait(rid, q)  # client gone or timed out: free the blocks now (unless sent again since)
        raise
    finally:
        if held:
            state.kv_gathered_held -= 1
        if handoff is not None and state.handoffs.get(rid) is handoff:
            del state.handoffs[rid]
        state.loop.close_stream(rid, q)
        kv_reference.drop_lease(state, rid, leased)  # an early lease nobody used goes back


async def _take_kv_when_memory(state: WorkerState, rid: str, deadline: float):
    """``_take_kv`` on the engine's thread; when the gather runs out of device memory while other hand-offs of
    this worker hold gathered KV (``kv_gathered_held``) or staged KV (device memory that comes back as they
    are written or pulled), it waits for that memory, retrying 5 ms -> 100 ms apart, until ``deadline``
    (``time.perf_counter``; the request's timeout), its blocks kept in the pool meanwhile. With nothing held
    here the error is raised at once: no memory of ours is coming back. Seen on one H200 with a 100:50 split
    by reference at 2048/128 12 req/s: 8 of 100 failed here while leases waited for decode room."""
    delay, waited = 0.005, False
    while True:
        try:
            return await state.loop.call(lambda: _take_kv(state, rid))
        except Exception as e:
            held = state.kv_gathered_held + (state.sender.num_staged if state.sender is not None else 0)
            if not is_memory_error(e) or not held or time.perf_counter() + delay > deadline:
                raise
        if not waited:
            waited = True
            state.metrics.kv_gather_memory_waits.inc()
            log.info("request %s waits for device memory to gather its KV (%d hand-offs hold KV here)", rid, held)
        relieve(state.loop.engine.device)
        state.kv_gather_waiting += 1
        try:
            await asyncio.sleep(delay)
        finally:
            state.kv_gather_waiting -= 1
        delay = min(0.1, delay * 2)


async def _out_of_memory(state: WorkerState, rid: str, what: str, e: BaseException) -> JSONResponse:
    """A prefill that ran out of device memory after its step (its KV gathered out of the pool, staged or
    written to a peer): this request fails with the reason, its blocks are freed, the error is counted
    (``/health`` degraded for a while), and the worker goes on serving."""
    engine = state.loop.engine
    engine.memory_pressure.record()
    await state.loop.abort(rid)  # its blocks, if the gather failed before releasing them
    relieve(engine.device)
    log.warning("request %s failed: out of device memory while %s: %s", rid, what, str(e).splitlines()[0][:300])
    return JSONResponse(
        PrefillResponse(
            token_ids=[],
            finished=True,
            finish_reason="abort",
            error=f"out of device memory while {what} on the prefill worker",
        ).model_dump()
    )


async def _with_progress(state: WorkerState, request: Request, answer) -> Response:
    """The prefill answer, and proof of progress while it is not ready: the router's progress deadline
    (``router.stream_progress_timeout_s``) covers prefill too, so a worker whose engine hangs while its
    heartbeats go on cannot hold a request for ``request_timeout_s``.

    An answer ready within a quarter of the deadline goes out as it is. Else the answer becomes a
    stream: a blank (JSON allows leading whitespace) every quarter of the deadline *in which the engine
    completed a step or was inside one* — an engine hung between steps sends nothing, and the router gives
    up on this worker — then the JSON.

    A caller that disconnects while the answer is not ready cancels it, which aborts the request and frees
    its blocks (a plain handler is not cancelled by a disconnect: it would wait for its prefill, and hold
    it, until its timeout); once streaming, the response's own disconnect watch does the same."""
    keepalive_s = state.config.router.stream_progress_timeout_s / 4
    task = asyncio.ensure_future(answer)

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(gone())
    try:
        done, _ = await asyncio.wait({task, watcher}, timeout=keepalive_s, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler cancelled (shutdown): so is the prefill
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    if watcher in done:  # the router went away before the answer
        task.cancel()
        return JSONResponse({"error": "caller disconnected"}, status_code=499)
    watcher.cancel()

    async def body():
        steps = state.loop.engine.stats.num_steps
        try:
            while not (await asyncio.wait({task}, timeout=keepalive_s))[0]:
                now = state.loop.engine.stats.num_steps
                # a step completed, or one is running (engine thread: the loop is free meanwhile, and the
                # heartbeat thread withholds heartbeats of a step that runs past max_step_s)
                # (or a lease waits for room in the decode worker's pool: that worker answered, it is busy)
                lessee = state.lessee
                if (
                    now != steps
                    or state.loop.step_started
                    or state.kv_gather_waiting
                    or (lessee is not None and lessee.waiting_for_room)
                ):
                    steps = now
                    yield b" "
            try:
                resp = task.result()
            except HTTPException as e:  # refused after the answer started: say so in the body
                resp = JSONResponse(
                    PrefillResponse(
                        token_ids=[], finished=True, finish_reason="abort", error=str(e.detail)
                    ).model_dump()
                )
            yield bytes(resp.body)
        finally:
            task.cancel()  # the router went away: _prefill aborts the request and frees its blocks

    return StreamingResponse(body(), media_type="application/json")


def _release_staged(state: WorkerState, staging: asyncio.Future) -> None:
    """Release the KV a staging of an abandoned prefill put in the sender (that entry only: a later attempt
    under the same request id may have staged its own since)."""
    if staging.cancelled() or staging.exception() is not None or state.sender is None:
        return
    handle = staging.result()
    if state.sender.abort_handle(handle):
        log.info("request %s: its KV was staged after its caller left; released", handle.request_id)


def _take_kv(state: WorkerState, rid: str):
    """(KV, CUDA event after its gather or None, FP8 scales or None); on the engine's thread, between steps."""
    engine = state.loop.engine
    _, kv = engine.take_prefilled_kv(rid)
    return kv, cuda_ipc.record_ready(kv), engine.runner.kv_scales()


def _stage(state: WorkerState, rid: str, kv, ready, transport: str, kv_scales: tuple = ()):
    """In a thread: tcp/shm need the KV in (pinned) host memory; cuda_ipc keeps it on the GPU."""
    kvc, sender = state.config.kv_transfer, state.sender
    if sender is None:
        raise RuntimeError("this worker stages no KV (it has no KV sender)")
    if state.loop.fault.stage_s:  # fault hook (tests): a slow copy out of the pool
        time.sleep(state.loop.fault.stage_s)
    if transport == "cuda_ipc" and kvc.transport == "auto":
        try:
            return sender.stage(rid, kv, kvc.lease_ms, transport=transport, ready_event=ready, kv_scales=kv_scales)
        except cuda_ipc.IpcError as e:  # e.g. an allocator whose memory cannot be exported
            log.warning("cuda_ipc unusable here (%s); staging through host memory", e)
            transport = "shm" if kv.numel() * kv.element_size() >= kvc.zero_copy_threshold_mb * 2**20 else "tcp"
    if transport != "cuda_ipc" and kv.is_cuda:
        kv, ready = cuda_ipc.to_pinned_host(kv, ready), None
    return sender.stage(
        rid, kv, kvc.lease_ms, transport=transport, checksum=kvc.checksum, ready_event=ready, kv_scales=kv_scales
    )


_JSON = json.JSONEncoder(separators=(",", ":"))  # one encoder: json.dumps(..., separators=) builds one per call


def _line(**kw) -> bytes:
    """One NDJSON line: a ``StreamLine`` without its unset fields (the first and the last of a stream)."""
    return StreamLine(**kw).model_dump_json(exclude_none=True).encode() + b"\n"


def _token_line(tokens: list[int], finished: bool, reason: str | None) -> bytes:
    """``_line(token_ids=tokens, finished=finished, finish_reason=reason)``, byte for byte, formatted
    directly: this is the line of every request in every step."""
    head = '{"token_ids":[' + ",".join(map(str, tokens))
    if not finished:
        return (head + '],"finished":false}\n').encode()
    if reason is None:
        return (head + '],"finished":true}\n').encode()
    return (head + '],"finished":true,"finish_reason":' + _JSON.encode(reason) + "}\n").encode()


KEEPALIVE = b"\n"  # a blank NDJSON line: "still working on it" (the router's progress deadline)


async def _generate_stream(state: WorkerState, body: GenerateRequest):
    rid = body.request_id
    loop = state.loop
    keepalive_s = state.config.router.stream_progress_timeout_s / 4
    q: asyncio.Queue | None = None
    try:
        params = to_sampling_params(body.sampling)
        await _prepare_grammar(state, params)
        transfer: dict = {}
        if body.kv is not None:
            # Waiting for room (back-pressure) and pulling the KV send nothing: keep-alives say we are alive.
            admit = asyncio.ensure_future(_admit_with_kv(state, body, params))
            try:
                while not (await asyncio.wait({admit}, timeout=keepalive_s))[0]:
                    yield KEEPALIVE
            finally:
                admit.cancel()  # no-op once done; on a disconnect it runs reserve's clean-up
            q, transfer = admit.result()
            if q is None:
                yield _line(finished=True, finish_reason="error", error=transfer["error"])
                return
        else:
            q = await loop.add_request(rid, body.prompt_token_ids, params, output_token_ids=body.output_token_ids)
        # The first token may wait behind a queue (colocated, or after preemption): keep-alives until it comes.
        first = asyncio.ensure_future(q.get())
        try:
            async with asyncio.timeout(state.config.router.request_timeout_s):
                while not (await asyncio.wait({first}, timeout=keepalive_s))[0]:
                    yield KEEPALIVE
        finally:
            first.cancel()
        out = first.result()
        # Not wait_for: on 3.11 wait_for swallows a cancellation that arrives when q.get() has just
        # completed — with a token every step, that is almost always, and a disconnected client
        # would never be noticed. IdleTimeout cancels only a waiting q.get() and re-raises the rest;
        # unlike asyncio.timeout per q.get() it does not create and cancel a timer per token.
        with_lp = params.logprobs is not None  # then every token line carries its logprobs
        with IdleTimeout(state.config.router.request_timeout_s) as idle:
            tokens, finished, reason, error = list(out.new_token_ids), out.finished, out.finish_reason, out.error
            lps = list(out.logprobs or ()) if with_lp else None
            while not finished and not q.empty():
                more = q.get_nowait()
                tokens.extend(more.new_token_ids)
                if lps is not None:
                    lps.extend(more.logprobs or ())
                finished, reason, error = more.finished, more.finish_reason, more.error
            yield _line(
                token_ids=tokens,
                logprobs=wire_logprobs(lps),
                finished=finished,
                finish_reason=reason,
                error=error,
                num_cached_tokens=out.num_cached_tokens,
                **transfer,
            )
            while not finished:
                out = await idle.wait(q.get()) if q.empty() else q.get_nowait()
                # coalesce whatever else is already queued into one line
                tokens, finished, reason = out.new_token_ids, out.finished, out.finish_reason
                error = out.error
                lps = list(out.logprobs or ()) if with_lp else None
                if not finished and not q.empty():
                    tokens = list(tokens)
                    while not finished and not q.empty():
                        more = q.get_nowait()
                        tokens.extend(more.new_token_ids)
                        if lps is not None:
                            lps.extend(more.logprobs or ())
                        finished, reason, error = more.finished, more.finish_reason, more.error
                if error is not None:  # the engine failed this request: say why
                    yield _line(token_ids=tokens, finished=True, finish_reason=reason, error=error)
                    break
                if lps is not None:
                    yield _line(token_ids=tokens, logprobs=wire_logprobs(lps), finished=finished, finish_reason=reason)
                else:
                    yield _token_line(tokens, finished, reason)
    except ValueError as e:  # invalid request (engine validation)
        yield _line(finished=True, finish_reason="error", error=str(e))
    except TimeoutError:
        yield _line(finished=True, finish_reason="error", error="worker timed out")
    finally:
        # no-op when finished; frees the blocks when the router went away (by its stream once it has one: a later
        # attempt under the same id, the router's retry on this worker, is not this handler's to abort)
        if q is not None:
            loop.abort_nowait(rid, q)
            loop.close_stream(rid, q)
        else:
            loop.close_stream(rid)
            loop.abort_nowait(rid)


async def _admit_with_kv(state: WorkerState, body: GenerateRequest, params: SamplingParams):
    """Reserve blocks, pull the KV, commit. Returns (queue, transfer info) or (None, {"error": ...})."""
    loop, rid, kvc = state.loop, body.request_id, state.config.kv_transfer
    if is_reference(body.kv):
        return await kv_reference.admit_by_reference(state, body, params)
    try:
        handle = KVHandle.from_dict(body.kv)
    except (ValueError, TypeError) as e:
        return None, {"error": f"invalid kv handle: {e}"}
    if handle.request_id != rid:
        return None, {"error": "kv handle belongs to another request"}
    outputs = body.output_token_ids
    # the KV of every token but the newest, in this worker's layout: checked before anything is reserved or pulled
    # (the handle's own cap is 64 GiB: a handle of another shape would be allocated and pulled whole first)
    want = loop.engine.runner.kv_shape(len(body.prompt_token_ids) + len(outputs) - 1)
    if handle.shape != want:
        return None, {"error": f"invalid kv handle: shape {list(handle.shape)}, this request's KV here is {list(want)}"}
    await loop.reserve(rid, body.prompt_token_ids, outputs, params, state.config.router.request_timeout_s)
    t0 = time.perf_counter()
    if state.puller is None:
        return None, {"error": "this worker pulls no KV (it has no KV puller)"}
    result = await asyncio.to_thread(state.puller.pull, handle, kvc.pull_timeout_ms / 1000.0)
    elapsed = time.perf_counter() - t0
    if result.status == TransferStatus.SUCCESS:
        state.metrics.kv_transfer_seconds.labels(handle.transport).observe(elapsed)
        state.metrics.kv_transfer_bytes.labels(handle.transport).inc(result.nbytes)
        try:
            q = await loop.commit(rid, result.tensor, [list(p) for p in handle.kv_scales] or None)
        except (KeyError, ValueError) as e:
            await loop.abort(rid)
            return None, {"error": f"kv commit failed: {e}"}
        return q, {"kv_transfer_seconds": elapsed, "kv_transfer_bytes": result.nbytes, "kv_transport": handle.transport}
    state.metrics.kv_transfer_failures.labels(handle.transport).inc()
    await loop.abort(rid)  # drop the reservation
    log.warning("KV pull for %s failed (%s): %s", rid, result.status.name, result.error)
    if kvc.failure_policy == "fail":
        return None, {"error": f"KV transfer failed: {result.error}"}
    # recompute: prefill prompt + token #1 here; sampling is seeded per index, so tokens are unchanged
    q = await loop.add_request(rid, body.prompt_token_ids, params, output_token_ids=outputs)
    return q, {"kv_transport": "recompute"}
