"""``distserve worker``: one engine, one role, one HTTP server, registered with a router.

Start order does not matter: the worker keeps trying to register until the
router answers, re-registers when the router forgets it (restart), and
heartbeats its load (queue depth, KV blocks) so the router can route by load
and take it out of rotation when the heartbeats stop (dead or frozen). The
heartbeats come from their own thread (``server/workers/heartbeat.py``), so a
long engine step on the event loop cannot make a busy worker look dead.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import signal
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import uvicorn

from distserve.server import mps
from distserve.server.config import DistServeConfig, role_dtype
from distserve.server.engine.kv_sizing import MemoryBudgetError
from distserve.server.engine.llm_engine import EngineConfig, LLMEngine
from distserve.server.engine.memory_profile import pinned_limit_bytes
from distserve.server.kv_transfer import KVPuller, KVStagingServer, cuda_ipc
from distserve.server.kv_transfer.factory import choose_transport, host_id
from distserve.server.kv_transfer.kv_arena import ARENA_PREFIX
from distserve.server.metrics import WorkerMetrics
from distserve.server.net import listen
from distserve.server.preflight import sweep_orphan_segments
from distserve.server.wire import DecodeWarmup, PrefillWarmup, RegisterRequest, Role
from distserve.server.workers import kv_reference
from distserve.server.workers.app import WorkerState, create_worker_app
from distserve.server.workers.engine_loop import EngineLoop, GcPolicy, resolve_engine_thread
from distserve.server.workers.heartbeat import HeartbeatOptions, HeartbeatThread, Liveness

log = logging.getLogger(__name__)

EXIT_REFUSED = 3  # the router refused registration (token or model fingerprint)


@dataclass(frozen=True)
class WorkerOptions:
    role: Role
    router_url: str
    config: DistServeConfig
    token: str
    host: str = "127.0.0.1"
    port: int = 0
    device: str = "cpu"
    worker_id: str = ""
    cpus: tuple[int, ...] = ()
    restart_count: int = 0  # times the launcher restarted this worker id (reported at registration)
    # this worker's own share of its GPU (the launcher's split of cache.gpu_memory_utilization among the
    # workers sharing it, server/memory_budget.py); None = cache.gpu_memory_utilization
    gpu_memory_utilization: float | None = None


def engine_config_for(
    role: str, cfg: DistServeConfig, device: str, gpu_memory_utilization: float | None = None
) -> EngineConfig:
    """Map the config onto one role's engine (the one place that does).

    Shared by every role: ``model``, ``cache``, and ``prefill.max_seq_len`` — the serving limit (the
    seed's key), which a decode worker must accept too because it holds prompt + output. Each role reads
    its own section for the rest: batch limits, threads and attention backend (``prefill.*`` for prefill
    workers, ``decode.*`` for decode and colocated ones).
    """
    pf, dc, cache = cfg.prefill, cfg.decode, cfg.cache
    on_cuda = device.startswith("cuda")
    common: dict[str, Any] = dict(
        model=cfg.model,
        device=device,
        dtype=role_dtype(cfg, "prefill" if role == "prefill" else "decode"),
        kv_scale_init=cache.kv_scale_init,
        kv_calibration_requests=cache.kv_calibration_requests,
        block_size=cache.block_size,
        num_blocks=cache.num_gpu_blocks,
        kv_cache_memory_mb=cache.kv_cache_memory_mb,
        gpu_memory_utilization=cache.gpu_memory_utilization
        if gpu_memory_utilization is None
        else gpu_memory_utilization,
        gpu_memory_headroom_bytes=cache.gpu_memory_headroom_mb << 20,
        # allocated after the engine: the prefill worker's cuda_ipc staging pool; a decode worker's pulled KV
        # lands in a buffer of its own before the commit: two prefill batches' worth in flight; a prefill
        # worker gathers each prompt's KV out of its pool before staging or writing it: one longest prompt
        gpu_memory_reserved_bytes=(cfg.kv_transfer.cuda_ipc_pool_mb << 20) if role == "prefill" and on_cuda else 0,
        kv_receive_tokens=2 * pf.max_num_batched_tokens
        if role == "decode"
        else pf.max_seq_len
        if role == "prefill"
        else 0,
        gpu_device_total_bytes=int(os.environ.get("DISTSERVE_DEVICE_TOTAL_MIB", "0") or 0) << 20,
        gpu_process_limit_bytes=process_limit_bytes(device) if on_cuda else 0,
        max_model_len=pf.max_seq_len,
        max_num_batched_tokens=pf.max_num_batched_tokens,
        enable_prefix_caching=cache.enable_prefix_caching,
    )
    if role == "prefill":
        return EngineConfig(
            **common,
            decode_graphs=False,  # its sequences stop at token #1: no decode graphs, no decode kernel tuning
            max_num_seqs=pf.max_batch_size,
            prefill_policy="wfs",
            torch_threads=pf.torch_threads,
            attention_backend=pf.attention_backend,
            kv_cache_dtype=pf.kv_dtype,  # the prefill role keeps its weights as loaded (the seed's bf16 prefill)
        )
    if role == "decode":
        return EngineConfig(
            **common,
            max_num_seqs=min(dc.max_batch_size, dc.max_concurrent_requests),
            decode_policy="fewest_remaining",
            torch_threads=dc.torch_threads,
            attention_backend=dc.attention_backend,
            weight_dtype=dc.weight_dtype,
            fp8_weight_rounding=dc.fp8_weight_rounding,
            fp8_bf16_layers=dc.fp8_bf16_layers,
            kv_cache_dtype=cache.kv_dtype,
            kv_arena=cfg.kv_transfer.by_reference,  # its pool exported to the prefill workers (kv_reference.py)
        )
    return EngineConfig(
        **common,
        max_num_seqs=dc.max_batch_size,
        torch_threads=dc.torch_threads,
        attention_backend=dc.attention_backend,
        weight_dtype=dc.weight_dtype,
        fp8_weight_rounding=dc.fp8_weight_rounding,
        fp8_bf16_layers=dc.fp8_bf16_layers,
        kv_cache_dtype=cache.kv_dtype,
    )


def process_limit_bytes(device: str, env: Mapping[str, str] | None = None) -> int:
    """This worker's own ceiling on its GPU: an MPS client's ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` less the
    CUDA context's allowance (``mps.CONTEXT_MIB``); 0 when it has none."""
    index = torch.device(device).index or 0
    limit = pinned_limit_bytes((os.environ if env is None else env).get(mps.MEM_ENV), index)
    return max(1, limit - (mps.CONTEXT_MIB << 20)) if limit else 0


def fingerprint(engine: LLMEngine) -> dict:
    """What a prefill/decode pair must agree on for KV to be interchangeable.

    Shape alone is not enough: two checkpoints of one architecture produce KV of
    the same layout but different meaning, so a digest of some weights is included.
    Block size is not: KV travels as contiguous tokens and each side pages it its own way.
    """
    c = engine.model_config
    m: Any = engine.model  # torch types submodules loosely
    qkv = m.layers[0].self_attn.qkv_proj
    # FP8 weights (decode.weight_dtype fp8) keep these rows as loaded, so an FP8 decode worker matches a
    # bf16 prefill worker of the same checkpoint
    qkv_rows = getattr(qkv, "fingerprint_rows", None)
    sample = (
        torch.cat(
            [
                m.embed_tokens.weight[:8].flatten(),
                m.norm.weight.flatten(),
                (qkv_rows if qkv_rows is not None else qkv.weight[:4]).flatten(),
            ]
        )
        .detach()
        .float()
        .cpu()
    )
    weights = hashlib.sha256(sample.numpy().tobytes()).hexdigest()[:16]
    return {
        "architecture": c.architecture,
        "config": c.fingerprint(),
        "weights": weights,
        "dtype": str(engine.dtype).split(".")[-1],
        "num_layers": c.num_hidden_layers,
        "num_kv_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "vocab_size": c.vocab_size,
        "max_position_embeddings": c.max_position_embeddings,  # the model's context, for `distserve doctor`
    }


def memory_report(engine: LLMEngine, sender: KVStagingServer | None) -> dict | None:
    """The sizing (kv_sizing.KVBudget) plus what was measured after it, for /v1/workers; None off CUDA."""
    budget = engine.kv_budget
    if budget is None:
        return None
    out = budget.to_dict()
    out["cuda_graphs_mib"] = engine.cuda_graph_bytes >> 20
    if engine.startup_memory is not None:
        out.update(engine.startup_memory.to_dict())
    out["staging_pool_mib"] = (sender.cuda_ipc_pool_bytes if sender is not None else 0) >> 20
    free, _ = torch.cuda.mem_get_info(engine.device)
    out["device_free_after_start_mib"] = free >> 20
    return out


def _timed_at_start(what: str, measure) -> dict | None:
    """A start-up timing for the router's priors; one that raises gives no prior (the router then admits only
    what starts at once), not a failed start."""
    try:
        return measure()
    except Exception as e:
        log.warning("start-up %s not timed: %s: %s", what, type(e).__name__, e)
        return None


async def serve_worker(opts: WorkerOptions) -> int:
    if opts.cpus:
        os.sched_setaffinity(0, opts.cpus)
    on_cuda = opts.device.startswith("cuda")
    try:  # refuse an unusable transport at start-up, not at the first request
        choose_transport(opts.config.kv_transfer.transport, 0, True, 0.0, kv_on_cuda=on_cuda)
    except (NotImplementedError, ValueError) as e:
        print(f"distserve worker: error: {e}", flush=True)
        return 2
    if opts.role == "decode" and opts.config.kv_transfer.by_reference != "off":
        sweep_orphan_segments(ARENA_PREFIX)  # KV pools of an earlier decode worker that was killed
    if on_cuda and torch.device(opts.device).index is not None:
        # The current device is per thread and defaults to 0: without this, eager Triton kernels of a
        # worker on cuda:1 launch on GPU 0 (seen on 2 GPUs: pointer errors, then an illegal address).
        torch.cuda.set_device(torch.device(opts.device))
    try:
        engine = LLMEngine(engine_config_for(opts.role, opts.config, opts.device, opts.gpu_memory_utilization))
    except MemoryBudgetError as e:  # its share cannot hold what it needs: say so, and stay stopped (exit 2)
        print(f"distserve worker: error: {opts.worker_id or opts.role}: {e}", flush=True)
        return 2
    # the router's priors until it measures: the TTFT model's cost per prompt token (prefill and colocated
    # workers) and the decode-room prior's step time (decode and colocated workers)
    warmup = (
        _timed_at_start("prefill", lambda: engine.measure_prefill(opts.config.prefill.warmup_tokens))
        if opts.role != "decode"
        else None
    )
    if warmup is not None:
        log.info(
            "start-up prefill: %d prompt tokens (%d prompts) in %.1f ms, %.4f ms per token",
            warmup["tokens"],
            warmup["requests"],
            warmup["ms"],
            warmup["ms"] / warmup["tokens"],
        )
    decode_warmup = (
        _timed_at_start("decode steps", lambda: engine.measure_decode(opts.config.decode.warmup_batch))
        if opts.role != "prefill"
        else None
    )
    if decode_warmup is not None:
        log.info(
            "start-up decode: %d steps of %d sequences, %.2f ms per step (%.2f at one)",
            decode_warmup["steps"],
            decode_warmup["batch"],
            decode_warmup["ms"],
            decode_warmup["ms_batch1"],
        )
    loop = asyncio.get_running_loop()
    kvc, dc = opts.config.kv_transfer, opts.config.decode
    sm = mps.probe(engine.device, int(os.environ.get("DISTSERVE_DEVICE_SM_COUNT", "0") or 0)) if on_cuda else None
    if sm is not None:
        log.info("MPS SM split: %s", sm)
        if sm.get("split_in_effect") is False:
            log.warning("the SM split asked for did not take effect: %s", sm)
        wrong = mps.gemm_self_check(engine.device, hidden=engine.model_config.hidden_size)
        if wrong is not None:  # a share that computes wrong results serves NaN or wrong tokens: stay stopped
            print(f"distserve worker: error: {opts.worker_id or opts.role}: {wrong}", flush=True)
            return 2
    engine_loop = EngineLoop(
        engine,
        GcPolicy(
            interval_s=dc.gc_interval_ms / 1000.0,
            stale_after_s=kvc.pull_timeout_ms / 1000.0 + 1.0,
            max_stale_slots=dc.max_stale_slots,
        ),
        threaded=resolve_engine_thread(
            (opts.config.prefill if opts.role == "prefill" else dc).engine_thread, str(engine.device), opts.role
        ),
    )
    log.info("engine steps %s", "on a dedicated thread" if engine_loop.threaded else "on the event loop")
    state = WorkerState(
        role=opts.role,
        worker_id=opts.worker_id or f"{opts.role}-{uuid.uuid4().hex[:8]}",
        config=opts.config,
        token=opts.token,
        loop=engine_loop,
        metrics=WorkerMetrics(opts.role),
    )
    budget = engine.kv_budget
    state.metrics.set_kv_cache(engine.kv_cache_bytes, budget.utilization if budget else 0.0)
    if opts.role == "prefill":
        sweep_orphan_segments()  # KV segments of an earlier prefill worker killed with its tracker
        state.sender = KVStagingServer(
            opts.host,
            0,
            default_lease_ms=kvc.lease_ms,
            checksum=kvc.checksum,
            handshake_timeout_s=kvc.handshake_timeout_ms / 1000.0,
            max_connections=kvc.max_connections,
            max_connections_per_peer=kvc.max_connections_per_peer or None,
            cuda_ipc_pool_bytes=(kvc.cuda_ipc_pool_mb << 20) if on_cuda else 0,
        )
        if on_cuda:  # allocate the staging pool now, inside this worker's budget
            state.sender.ipc_pool(engine.device)
    if opts.role == "decode":
        state.puller = KVPuller(cuda_device=engine.device if on_cuda else None)
        state.lessor = kv_reference.make_lessor(state, opts.host)
        if state.lessor is not None:
            log.info(
                "KV by reference: lessor on %s (%s pool)", await state.lessor.start(), engine.kv_arena.description.kind
            )
    if opts.role == "prefill":
        state.lessee = kv_reference.make_lessee(state)
    sock = listen(opts.host, opts.port)
    port = sock.getsockname()[1]
    url = f"http://{opts.host}:{port}"
    app = create_worker_app(state)
    # Keep-alive longer than the router's aiohttp pool keeps idle connections (15 s): with uvicorn's
    # default 5 s the worker could close a pooled connection just as the router reused it, which the
    # router reads as a worker failure (seen with long prompts on 2 GPUs: resets, then 503s).
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=5,
            timeout_keep_alive=75,
        )
    )
    reg = RegisterRequest(
        worker_id=state.worker_id,
        role=opts.role,
        url=url,
        pid=os.getpid(),
        fingerprint=fingerprint(engine),
        model_path=str(engine.model_path) if engine.model_path else None,
        max_model_len=engine.max_model_len,
        host_id=host_id(),
        cuda_uuids=cuda_ipc.visible_gpu_uuids() if on_cuda else [],
        kv_arena=state.lessor.address if state.lessor is not None else "",
        restart_count=opts.restart_count,
        memory=memory_report(engine, state.sender),
        prefill_warmup=PrefillWarmup(**warmup) if warmup is not None else None,
        decode_warmup=DecodeWarmup(**decode_warmup) if decode_warmup is not None else None,
    )
    if reg.memory is not None and sm is not None:
        reg.memory["mps"] = sm
    if reg.memory is not None:
        log.info("device memory: %s", reg.memory)
    engine_loop.start()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
    rc = opts.config.router

    def refused(reason: str) -> None:
        state.fatal_error = reason
        server.should_exit = True

    liveness = Liveness(engine_loop, wedged_after_s=rc.stream_progress_timeout_s, max_step_s=rc.request_timeout_s)
    ticker = asyncio.create_task(liveness.tick(), name="liveness-tick")
    beats = HeartbeatThread(
        HeartbeatOptions(opts.router_url, opts.token, rc.heartbeat_interval_ms / 1000.0, opts.role),
        reg,
        state.heartbeat_status,  # with the prefix summary (cache-aware routing)
        lambda: server.should_exit,
        refused,
        liveness,
    )
    beats.start()
    log.info("%s worker %s listening on %s (pid %d)", opts.role, state.worker_id, url, os.getpid())
    try:
        await server.serve(sockets=[sock])
    finally:
        server.should_exit = True
        ticker.cancel()
        await asyncio.to_thread(beats.join, 3.0)  # it deregisters on its way out
        engine_loop.stop()
        if state.sender is not None:
            state.sender.close()
        if state.lessor is not None:
            await state.lessor.close()
        if state.lessee is not None:
            await state.lessee.close()
        if engine.kv_arena is not None:
            engine.kv_arena.close()
    if state.fatal_error:
        print(f"distserve worker: error: {state.fatal_error}", flush=True)
        return EXIT_REFUSED
    return 0
