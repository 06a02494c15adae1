"""Control plane: worker registration, heartbeats, goodbyes, drain, and the admin views (workers, admission).

Every route here takes the admin token (``auth.ADMIN``, checked before a body is read); a worker's own
heartbeat and goodbye also take the credential its registration was issued (``identity.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TypeVar

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from distserve.server.router.auth import ADMIN
from distserve.server.router.body import json_body
from distserve.server.router.errors import error, first_error, first_error_field, unavailable
from distserve.server.router.identity import CREDENTIAL_HEADER, IdInUse
from distserve.server.router.protocol import InvalidRequest
from distserve.server.router.registry import RegistrationRefused
from distserve.server.router.state import router_state
from distserve.server.wire import DeregisterRequest, DrainRequest, HeartbeatRequest, RegisterRequest

log = logging.getLogger(__name__)

router = APIRouter(dependencies=ADMIN)

MAX_BLOCK_MS = 60_000.0
M = TypeVar("M", bound=BaseModel)


async def _body_as(request: Request, model: type[M], what: str) -> M:
    """The request's JSON body as ``model``; otherwise InvalidRequest (a 400 naming the field, errors.py)."""
    try:
        return model.model_validate(await json_body(request))
    except ValidationError as e:
        raise InvalidRequest(f"invalid {what}: {first_error(e)}", first_error_field(e)) from None
    except InvalidRequest as e:
        raise InvalidRequest(f"invalid {what}: {e}", e.param) from None
    except ValueError as e:
        raise InvalidRequest(f"invalid {what}: {e}") from None


@router.post("/register")
async def register(request: Request):
    state = router_state(request)
    try:
        req = RegisterRequest.model_validate(await json_body(request))
        state.ids().admit(state.registry, req.worker_id, request.headers.get(CREDENTIAL_HEADER))
        info = state.registry.register(req)
    except InvalidRequest as e:
        return error(400, str(e))
    except IdInUse as e:
        log.warning("registration refused: %s", e)
        return error(409, str(e), "worker_id")
    except RegistrationRefused as e:
        log.error("%s", e)
        return error(409, str(e))
    except ValidationError as e:
        return error(400, f"invalid registration: {first_error(e)}", first_error_field(e))
    except ValueError as e:
        return error(422, f"invalid registration: {e}")
    log.info("worker %s (%s, pid %d) registered at %s", info.worker_id, info.role, info.pid, info.url)
    if state.tokenizer is None:  # build it off the event loop now, not inside the first request
        asyncio.get_running_loop().run_in_executor(None, state.warm_tokenizer)
    out = {"registered": info.worker_id, "credential": state.ids().issue(info.worker_id)}
    control = state.control.advertised_to(request.client.host if request.client else None) if state.control else None
    if control:  # heartbeats go there: read on the control plane's own thread (server/router/control.py)
        out["control_url"] = control
    return out


@router.post("/heartbeat")
async def heartbeat(request: Request):
    state = router_state(request)
    hb = await _body_as(request, HeartbeatRequest, "heartbeat")
    if hb.worker_id in state.registry.workers and not state.ids().holds(
        hb.worker_id, request.headers.get(CREDENTIAL_HEADER)
    ):
        return error(403, f"wrong or missing worker credential for {hb.worker_id!r}", CREDENTIAL_HEADER)
    if not state.registry.heartbeat(hb.worker_id, hb.status):
        return error(404, f"unknown worker {hb.worker_id}; register first")
    return {"ok": True}


@router.post("/deregister")
async def deregister(request: Request):
    state = router_state(request)
    try:
        req = DeregisterRequest.model_validate(await json_body(request))
    except (InvalidRequest, ValueError) as e:
        return error(400, f"invalid deregistration: {e}")
    if req.reason is not None:  # the launcher saw the process exit: keep it listed, as dead
        return {"deregistered": state.registry.mark_dead(req.worker_id, req.reason)}  # it logs the transition
    # A worker's own goodbye: only the holder of the id's credential may remove it.
    if req.worker_id in state.registry.workers and not state.ids().holds(
        req.worker_id, request.headers.get(CREDENTIAL_HEADER)
    ):
        return error(403, f"wrong or missing worker credential for {req.worker_id!r}", CREDENTIAL_HEADER)
    gone = state.registry.deregister(req.worker_id, req.pid)
    if gone:
        state.ids().forget(req.worker_id)
        log.info("worker %s deregistered (it is leaving)", req.worker_id)
    return {"deregistered": gone}


@router.post("/drain")
async def drain(request: Request):
    """Scale-down, step one: no new request goes to this worker; the caller waits for it to go idle."""
    state = router_state(request)
    try:
        req = DrainRequest.model_validate(await json_body(request))
    except (InvalidRequest, ValueError) as e:
        return error(400, f"invalid drain request: {e}")
    if not state.registry.drain(req.worker_id):
        return error(404, f"worker_id: no live worker {req.worker_id!r} is registered")
    return {"draining": req.worker_id}


class RouterFault(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # block the main event loop (a synchronous sleep on it) for this long, once, right after the answer: what a
    # data plane saturated by thousands of clients does to everything served on that loop
    block_loop_ms: float = Field(default=0.0, ge=0.0, le=MAX_BLOCK_MS)


@router.post("/admin/fault")
async def fault(request: Request):
    """Fault hook for tests and drills (admin token): ``{"block_loop_ms": N}``."""
    req = await _body_as(request, RouterFault, "fault")
    if req.block_loop_ms:
        log.warning("fault hook: blocking the router's event loop for %.0f ms", req.block_loop_ms)
        asyncio.get_running_loop().call_soon(time.sleep, req.block_loop_ms / 1000.0)
    return {"block_loop_ms": req.block_loop_ms}


@router.get("/v1/workers")
async def workers(request: Request):
    reg = router_state(request).registry
    reg.sweep()
    now = time.monotonic()
    out = []
    for w in reg.workers.values():
        d = w.to_dict(now)
        d["prefix_blocks"] = reg.prefix.num_blocks(w.worker_id)  # in its routing summary (prefix_index.py)
        out.append(d)
    control = router_state(request).control
    return {"mode": reg.mode(), "workers": out, "control_url": control.url if control is not None else None}


@router.get("/v1/admission")
async def admission_status(request: Request):
    """Admission counts, bounds, the live TTFT model and its measured prediction error."""
    state = router_state(request)
    return state.admission.status() if state.admission else unavailable("starting up")
