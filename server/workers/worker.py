"""``distserve worker``: one engine, one role, one HTTP server, registered with a router.

Start order does not matter: the worker keeps trying to register until the
router answers, re-registers when the router forgets it (restart), and
heartbeats its load (queue depth, KV blocks) so the router can route by load
and take it out of rotation when the heartbeats stop (dead or frozen).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import signal
import uuid
from dataclasses import dataclass
from typing import Any

import aiohttp
import torch
import uvicorn

from server.config import DistServeConfig
from server.engine.llm_engine import EngineConfig, LLMEngine
from server.kv_transfer import KVPuller, KVStagingServer, cuda_ipc
from server.kv_transfer.factory import choose_transport, host_id
from server.metrics import WorkerMetrics
from server.net import listen
from server.preflight import sweep_orphan_segments
from server.wire import CREDENTIAL_HEADER, DeregisterRequest, HeartbeatRequest, RegisterRequest, Role
from server.workers.app import WorkerState, create_worker_app
from server.workers.engine_loop import EngineLoop, GcPolicy, resolve_engine_thread

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


def engine_config_for(role: str, cfg: DistServeConfig, device: str) -> EngineConfig:
    """Map the config onto one role's engine (the one place that does).

    Shared by every role: ``model``, ``cache``, and ``prefill.max_seq_len`` — the serving limit (the
    seed's key), which a decode worker must accept too because it holds prompt + output. Each role reads
    its own section for the rest: batch limits, threads and attention backend (``prefill.*`` for prefill
    workers, ``decode.*`` for decode and colocated ones).
    """
    pf, dc, cache = cfg.prefill, cfg.decode, cfg.cache
    common: dict[str, Any] = dict(
        model=cfg.model,
        device=device,
        dtype=cache.dtype,
        block_size=cache.block_size,
        num_blocks=cache.num_gpu_blocks,
        kv_cache_memory_mb=cache.kv_cache_memory_mb,
        gpu_memory_utilization=cache.gpu_memory_utilization,
        max_model_len=pf.max_seq_len,
        max_num_batched_tokens=pf.max_num_batched_tokens,
        enable_prefix_caching=cache.enable_prefix_caching,
    )
    if role == "prefill":
        return EngineConfig(
            **common,
            max_num_seqs=pf.max_batch_size,
            prefill_policy="wfs",
            torch_threads=pf.torch_threads,
            attention_backend=pf.attention_backend,
        )
    if role == "decode":
        return EngineConfig(
            **common,
            max_num_seqs=min(dc.max_batch_size, dc.max_concurrent_requests),
            decode_policy="fewest_remaining",
            torch_threads=dc.torch_threads,
            attention_backend=dc.attention_backend,
        )
    return EngineConfig(
        **common, max_num_seqs=dc.max_batch_size, torch_threads=dc.torch_threads, attention_backend=dc.attention_backend
    )


def fingerprint(engine: LLMEngine) -> dict:
    """What a prefill/decode pair must agree on for KV to be interchangeable.

    Shape alone is not enough: two checkpoints of one architecture produce KV of
    the same layout but different meaning, so a digest of some weights is included.
    Block size is not: KV travels as contiguous tokens and each side pages it its own way.
    """
    c = engine.model_config
    m: Any = engine.model  # torch types submodules loosely
    sample = (
        torch.cat(
            [
                m.embed_tokens.weight[:8].flatten(),
                m.norm.weight.flatten(),
                m.layers[0].self_attn.qkv_proj.weight[:4].flatten(),
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
    }


async def _registration_loop(
    state: WorkerState, opts: WorkerOptions, reg: RegisterRequest, server: uvicorn.Server
) -> None:
    interval = opts.config.router.heartbeat_interval_ms / 1000.0
    headers = {"Authorization": f"Bearer {opts.token}"}
    registered = False
    credential: str | None = None  # issued by the router at registration; every later call carries it
    timeout = aiohttp.ClientTimeout(total=max(2.0, 2 * interval))

    def mine() -> dict[str, str]:
        return {CREDENTIAL_HEADER: credential} if credential else {}

    async def refusal(r: aiohttp.ClientResponse) -> tuple[str, str | None]:
        try:
            err = (await r.json())["error"]
            return str(err["message"]), err.get("param")
        except (ValueError, KeyError, TypeError, aiohttp.ContentTypeError):
            return str(r.reason), None

    async with aiohttp.ClientSession(timeout=timeout, headers=headers) as http:
        while not server.should_exit:
            try:
                if not registered:
                    reg.status = state.status()
                    async with http.post(f"{opts.router_url}/register", json=reg.model_dump(), headers=mine()) as r:
                        if r.status in (400, 401, 403, 409, 422):
                            detail, param = await refusal(r)
                            if r.status == 409 and param == "worker_id":
                                # The id is still held by a process the router believes live (its death not
                                # reported yet): wait until it is reported dead or its heartbeats time out.
                                log.warning("registration deferred: %s", detail)
                                await asyncio.sleep(interval)
                                continue
                            log.error("router refused registration (%s): %s", r.status, detail)
                            state.fatal_error = f"router refused registration: {detail}"
                            server.should_exit = True
                            return
                        registered = r.status == 200
                        if registered:
                            credential = str((await r.json()).get("credential") or "") or None
                            log.info("registered with router %s as %s %s", opts.router_url, opts.role, reg.worker_id)
                else:
                    hb = HeartbeatRequest(worker_id=reg.worker_id, status=state.status())
                    async with http.post(f"{opts.router_url}/heartbeat", json=hb.model_dump(), headers=mine()) as r:
                        if r.status == 404:  # the router restarted and forgot us
                            registered, credential = False, None
                            continue
                        if r.status == 403:  # another process took our id while we were silent: register
                            detail, _ = await refusal(r)  # again (409 until that one is gone, see above)
                            log.error("router refused our heartbeat: %s", detail)
                            registered, credential = False, None
                            continue
            except (TimeoutError, aiohttp.ClientError, OSError) as e:
                if registered:
                    log.warning("router unreachable (%s); will re-register", e)
                registered = False
            await asyncio.sleep(interval)
        if registered:
            try:
                bye = DeregisterRequest(worker_id=reg.worker_id, pid=reg.pid)
                async with http.post(
                    f"{opts.router_url}/deregister", json=bye.model_dump(exclude_none=True), headers=mine()
                ):
                    pass
            except (TimeoutError, aiohttp.ClientError, OSError):
                pass


async def serve_worker(opts: WorkerOptions) -> int:
    if opts.cpus:
        os.sched_setaffinity(0, opts.cpus)
    on_cuda = opts.device.startswith("cuda")
    try:  # refuse an unusable transport at start-up, not at the first request
        choose_transport(opts.config.kv_transfer.transport, 0, True, 0.0, kv_on_cuda=on_cuda)
    except (NotImplementedError, ValueError) as e:
        print(f"distserve worker: error: {e}", flush=True)
        return 2
    if on_cuda and torch.device(opts.device).index is not None:
        # The current device is per thread and defaults to 0: without this, eager Triton kernels of a
        # worker on cuda:1 launch on GPU 0 (seen on 2 GPUs: pointer errors, then an illegal address).
        torch.cuda.set_device(torch.device(opts.device))
    engine = LLMEngine(engine_config_for(opts.role, opts.config, opts.device))
    loop = asyncio.get_running_loop()
    kvc, dc = opts.config.kv_transfer, opts.config.decode
    engine_loop = EngineLoop(
        engine,
        GcPolicy(
            interval_s=dc.gc_interval_ms / 1000.0,
            stale_after_s=kvc.pull_timeout_ms / 1000.0 + 1.0,
            max_stale_slots=dc.max_stale_slots,
        ),
        threaded=resolve_engine_thread(
            (opts.config.prefill if opts.role == "prefill" else dc).engine_thread, str(engine.device)
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
    if opts.role == "decode":
        state.puller = KVPuller(cuda_device=engine.device if on_cuda else None)
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
        restart_count=opts.restart_count,
    )
    engine_loop.start()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
    reg_task = asyncio.create_task(_registration_loop(state, opts, reg, server))
    log.info("%s worker %s listening on %s (pid %d)", opts.role, state.worker_id, url, os.getpid())
    try:
        await server.serve(sockets=[sock])
    finally:
        server.should_exit = True
        try:
            await asyncio.wait_for(reg_task, 3)
        except (TimeoutError, Exception):
            reg_task.cancel()
        engine_loop.stop()
        if state.sender is not None:
            state.sender.close()
    if state.fatal_error:
        print(f"distserve worker: error: {state.fatal_error}", flush=True)
        return EXIT_REFUSED
    return 0
