"""``distserve router``: run the HTTP gateway."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal

import uvicorn

from distserve.server.config import DistServeConfig
from distserve.server.net import listen
from distserve.server.private_files import write_ready_file
from distserve.server.router.app import create_router_app
from distserve.server.router.fdlimit import ConnectionCounter, raise_nofile_limit
from distserve.server.router.limits import guarded_http_protocol
from distserve.server.router.registry import WorkerRegistry
from distserve.server.router.state import RouterState

log = logging.getLogger(__name__)


GC_THRESHOLDS = (5_000, 20, 100)


def tune_gc() -> None:
    """Keep the garbage collector's full passes short and rare. Under 2 000 streaming clients the default
    thresholds ran a full collection every 1-3 s, each holding the GIL for 100-380 ms (measured with a
    ``gc.callbacks`` timer, docs/performance/overload.md, "a control plane off the data plane's loop"): every
    thread stopped, the control plane's too. What is alive at start-up (modules, the app, the tokenizer once built: see
    ``RouterState.warm_tokenizer``) is frozen out of every later pass; collections of the young generation run
    after 5 000 allocations instead of 700, the middle one after 20 young passes instead of 10, and full ones
    after 100 middle passes instead of 10 (``GC_THRESHOLDS``)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


async def serve_router(
    config: DistServeConfig,
    token: str,
    *,
    model_path: str | None = None,
    served_model_name: str | None = None,
    ready_file: str | None = None,
) -> int:
    rc = config.router
    registry = WorkerRegistry(
        heartbeat_timeout_s=rc.heartbeat_timeout_ms / 1000.0, fail_waits_after_s=rc.stream_progress_timeout_s
    )
    state = RouterState(
        config=config, token=token, registry=registry, served_model_name=served_model_name, model_path=model_path
    )
    soft, _ = raise_nofile_limit()  # then refuse client work before running out (server/router/fdlimit.py)
    ac = rc.admission
    state.connections = ConnectionCounter.for_limit(soft, ac.max_connections, ac.reserved_fds)
    app = create_router_app(state)
    sock = listen(rc.host, rc.port, backlog=2048)
    host, port = sock.getsockname()[:2]
    url = f"http://{host}:{port}"
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            http=guarded_http_protocol(rc.header_timeout_s, rc.stream_write_timeout_s, state.connections),
            timeout_graceful_shutdown=5,
            timeout_keep_alive=max(1, round(rc.keepalive_timeout_s)),
        )
    )
    if rc.control_host:  # the control thread accepts on the main port: /health there, the rest handed to uvicorn

        def protocol() -> asyncio.Protocol:
            c = server.config
            return c.http_protocol_class(  # type: ignore[call-arg]
                config=c, server_state=server.server_state, app_state=server.lifespan.state
            )

        state.front_door = (sock, protocol)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))

    async def announce() -> None:
        while not server.started:
            await asyncio.sleep(0.01)
        write_ready_file(ready_file, {"url": url, "pid": os.getpid()})
        log.info("router listening on %s (pid %d)", url, os.getpid())

    task = asyncio.create_task(announce())
    tune_gc()
    await server.serve(sockets=[] if state.front_door is not None else [sock])
    task.cancel()
    return 0
