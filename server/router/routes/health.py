"""Health, Prometheus metrics and the version: open routes (no token), read by load balancers and scrapers."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from distserve.server.router.registry import STATES
from distserve.server.router.state import RouterState, router_state

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    """200 ``ok`` (every registered worker healthy), 200 ``degraded`` (serving, with capacity
    lost: some worker stale, suspect or dead), 503 ``down`` (no healthy prefill+decode pair and
    no healthy colocated worker)."""
    status, payload = health_answer(router_state(request))
    if status != 200:
        return JSONResponse(payload, status_code=status, headers={"Retry-After": "1"})
    return payload


def health_answer(state: RouterState, sweep: bool = True) -> tuple[int, dict]:
    """(HTTP status, body) of ``/health``, from the registry's read-only view: the main loop's route (after a
    sweep) and the control plane's thread (server/router/control.py; ``sweep=False``: it changes nothing)
    answer the same."""
    reg = state.registry
    if sweep:
        reg.sweep()
    mode, counts, healthy = reg.view()
    workers = {role: dict(c) for role, c in counts.items()}
    if mode is None:
        return 503, {
            "status": "down",
            "mode": None,
            "workers": workers,
            "error": {
                "message": "no healthy prefill+decode pair or colocated worker",
                "type": "service_unavailable",
                "code": 503,
            },
        }
    lost = sum(n for c in counts.values() for st, n in c.items() if st not in ("healthy", "draining"))
    journal = state.sla.journal_problem() if state.sla is not None else None
    # workers whose engine steps fail for lack of device memory (their heartbeats say so)
    pressure = sorted(w.worker_id for w in healthy if w.status.memory_errors_recent)
    out: dict = {"status": "degraded" if lost or journal or pressure else "ok", "mode": mode, "workers": workers}
    if journal:
        out["reasons"] = [journal]  # a journal write failed: requests are served, records are being lost
    if pressure:
        out["memory_pressure"] = pressure
    return 200, out


@router.get("/metrics")
async def metrics(request: Request):
    state = router_state(request)
    reg = state.registry
    reg.sweep()
    for role in ("prefill", "decode", "colocated"):
        c = reg.counts().get(role, {})
        for st in STATES:
            state.metrics.workers.labels(role, st).set(c.get(st, 0))
    for w in reg.workers.values():
        state.metrics.worker_restarts.labels(w.worker_id, w.role).set(w.restart_count)
    for role in ("prefill", "decode", "colocated"):  # latency outliers out of rotation now (outlier.py)
        state.metrics.workers_ejected.labels(role).set(
            sum(1 for w in reg.workers.values() if w.role == role and w.ejected_until)
        )
    return PlainTextResponse(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/version")
async def version():
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        return {"version": package_version("distserve")}
    except PackageNotFoundError:
        return {"version": "unknown"}
