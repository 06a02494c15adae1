"""The router's HTTP app: its lifespan (HTTP session, pipeline, SLA tracker, admission), middleware, error
handlers, and the route families of ``server/router/routes/`` (OpenAI completions/chat, tokenize, models,
admin, sla, health). Handlers find the one ``RouterState`` in ``request.app.state.router``.

Routes only translate: HTTP ⇄ ``EngineRequest`` and token events ⇄ OpenAI JSON/SSE. Where a request goes
is ``pipeline.py``; who is alive is ``registry.py``.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager

import aiohttp
from fastapi import FastAPI

from distserve.server.router.admission import Admission
from distserve.server.router.backup_pool import BackupOptions, BackupPool
from distserve.server.router.control import MAIN_LOOP_DEAD_S, ControlApp, ControlPlane, FrontDoor
from distserve.server.router.early_refusal import EarlyRefusal
from distserve.server.router.errors import install_error_handlers
from distserve.server.router.failover import PoolHeaderMiddleware
from distserve.server.router.fdlimit import ConnectionLimit
from distserve.server.router.limits import BodyLimit
from distserve.server.router.pipeline import Pipeline, PipelineOptions
from distserve.server.router.request_journal import JournalEveryRequest
from distserve.server.router.routes import admin, health, models, openai, sla, tokenize
from distserve.server.router.routes.health import health_answer
from distserve.server.router.sla_live import SlaLive
from distserve.server.router.state import RouterState, decode_step_prior_s, prefill_priors, serving_workers

__all__ = ["ROUTE_FAMILIES", "RouterState", "create_router_app"]

ROUTE_FAMILIES = (admin, health, sla, models, tokenize, openai)  # each module's ``router``, included in this order


def front_door(state: RouterState, main: asyncio.AbstractEventLoop) -> FrontDoor | None:
    """The main port accepted on the control thread (``/health`` answered there), when ``serve_router`` gave
    its socket; every other connection is adopted by this loop's HTTP server."""
    if state.front_door is None:
        return None
    sock, protocol = state.front_door

    async def adopt(conn) -> None:
        try:
            await main.connect_accepted_socket(protocol, conn)
        except OSError:
            conn.close()

    def hand_over(conn) -> None:
        main.call_soon_threadsafe(lambda: main.create_task(adopt(conn)))

    reg = state.registry
    return FrontDoor(
        sock,
        lambda: health_answer(state, sweep=False),
        lambda: reg.main_loop_ticked_within(MAIN_LOOP_DEAD_S),
        hand_over,
        state.connections,
    )


def create_router_app(state: RouterState) -> FastAPI:
    rc = state.config.router

    async def sweep_registry() -> None:
        """Age worker states on a clock of their own, so the waits on a worker that froze fail
        within a heartbeat timeout even when no request or heartbeat arrives to notice it."""
        period = max(0.05, min(rc.heartbeat_interval_ms, rc.heartbeat_timeout_ms) / 2000.0)
        late = 0.0
        while True:
            state.registry.sweep()
            state.registry.tick(late)
            if state.pipeline is not None:
                state.pipeline.request_log.flush()  # the summaries of held-back per-request warnings
            t0 = time.monotonic()
            await asyncio.sleep(period)
            late = time.monotonic() - t0 - period

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        async with aiohttp.ClientSession(connector=connector) as http:
            state.pipeline = Pipeline(
                state.registry,
                http,
                state.metrics,
                PipelineOptions(
                    token=state.token,
                    request_timeout_s=rc.request_timeout_s,
                    progress_timeout_s=rc.stream_progress_timeout_s,
                    decode_slots=state.config.decode.max_concurrent_requests,
                    local_prefill_max_tokens=rc.local_prefill_max_tokens,
                    local_prefill_prefill_load=rc.local_prefill_prefill_load,
                ),
            )
            state.registry.configure(rc, lambda role: state.metrics.worker_ejections.labels(role).inc())
            state.backup = BackupPool(
                BackupOptions(
                    rc.backup_pool,
                    rc.backup_model,
                    rc.backup_api_key,
                    first_byte_timeout_s=rc.stream_progress_timeout_s,
                    progress_timeout_s=rc.stream_progress_timeout_s,
                ),
                http,
            )
            state.sla = SlaLive(rc, state.metrics.registry, backup_configured=state.backup.configured)
            if state.admission is None:  # one per state: its metrics live in the state's registry
                state.admission = Admission(
                    state.config,
                    state.metrics.registry,
                    lambda: serving_workers(state),
                    priors=lambda: prefill_priors(state),
                    tpot_prior=lambda holders: decode_step_prior_s(state, holders),
                    # prefill workers serve shortest first (the engine's wfs order); colocated ones in arrival order
                    shortest_first=lambda: state.registry.mode() == "disaggregated",
                )
            state.admission.journal = state.sla.events_journal.append
            state.admission.attach(state.pipeline)  # the TTFT model learns each request's phases
            ticker = asyncio.ensure_future(state.sla.run())
            sweeper = asyncio.create_task(sweep_registry(), name="registry-sweep")
            if rc.control_host:
                ids = state.ids()  # made here: the control thread only reads it
                period = max(0.05, min(rc.heartbeat_interval_ms, rc.heartbeat_timeout_ms) / 2000.0)
                state.control = ControlPlane(
                    ControlApp(state.registry, state.token, ids.holds, lambda: health_answer(state, sweep=False)),
                    rc.control_host,
                    period,
                    front_door(state, asyncio.get_running_loop()),
                )
                await asyncio.to_thread(state.control.start)
            try:
                yield
            finally:
                if state.control is not None:
                    await asyncio.to_thread(state.control.stop)
                    state.control = None
                sweeper.cancel()
                ticker.cancel()
                state.sla.close()

    app = FastAPI(title="distserve router", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimit, max_bytes=rc.max_request_body_bytes, body_timeout_s=rc.body_timeout_s)
    app.state.router = state
    app.add_middleware(EarlyRefusal, state=state)  # a certain 429 before the body is read (early_refusal.py)
    app.add_middleware(PoolHeaderMiddleware)
    if state.connections is not None:  # refuses before the body is read (journaled by the next one)
        app.add_middleware(ConnectionLimit, counter=state.connections, retry_after_s=rc.admission.retry_after_s)
    # outermost: sees 408/413 answers too; bounds the whole request (a client reading slowly)
    app.add_middleware(JournalEveryRequest, live=lambda: state.sla, request_timeout_s=rc.request_timeout_s)

    install_error_handlers(app)
    for family in ROUTE_FAMILIES:
        app.include_router(family.router)
    return app
