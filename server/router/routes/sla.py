"""The live SLA view: rolling percentiles, the breaker, the journals' health (``server/router/sla_live.py``)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from distserve.server.router.errors import unavailable
from distserve.server.router.state import router_state

router = APIRouter()


@router.get("/sla/status")
async def sla_status(request: Request):
    state = router_state(request)
    return state.sla.status() if state.sla else unavailable("starting up")
