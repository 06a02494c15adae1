"""Latency through the workers' fault hook: ``POST /admin/fault {"prefill_delay_ms": X, "decode_delay_ms": Y}``.

The hook (admin token) adds a delay to each prefill / decode step of that worker,
which pushes the router's rolling P99 past the SLA breaker's threshold: the
breaker must fail over to the backup pool and come back when the delay is
removed. ``rollback`` posts zeros. A worker without the hook answers 404, and
this injector says so (`HookMissing`).
"""

from __future__ import annotations

from distserve.chaos import state
from distserve.chaos.workers import admin_token, post_json, select_workers

KIND = "latency"


class HookMissing(RuntimeError):
    """The worker has no POST /admin/fault."""


def _post(url: str, body: dict, token: str) -> dict:
    status, reply = post_json(f"{url.rstrip('/')}/admin/fault", body, token)
    if status == 404:
        raise HookMissing(f"{url} has no POST /admin/fault (404): this server build lacks the fault hook")
    if status != 200:
        raise RuntimeError(f"{url}/admin/fault answered {status}: {reply}")
    return reply


def inject(
    router_url: str,
    role: str | None = None,
    worker_id: str | None = None,
    count: int = 100,
    prefill_delay_ms: float = 0.0,
    decode_delay_ms: float = 0.0,
    token: str | None = None,
    key: str | None = None,
    **_: object,
) -> dict:
    tok = admin_token(token)
    targets = select_workers(router_url, tok, role, worker_id, count)
    k = key or worker_id or role or "any"
    state.save(KIND, k, {"urls": [w["url"] for w in targets]})
    body = {"prefill_delay_ms": prefill_delay_ms, "decode_delay_ms": decode_delay_ms}
    replies = {w["worker_id"]: _post(w["url"], body, tok) for w in targets}
    return {"mechanism": "worker fault hook POST /admin/fault", "fault": body, "replies": replies}


def rollback(
    role: str | None = None, worker_id: str | None = None, token: str | None = None, key: str | None = None, **_: object
) -> dict:
    k = key or worker_id or role or "any"
    saved = state.load(KIND, k)
    if not saved:
        return {"rolled_back": False}
    tok = admin_token(token)
    for url in saved["urls"]:
        try:
            _post(url, {"prefill_delay_ms": 0, "decode_delay_ms": 0}, tok)
        except OSError:
            pass  # the worker is gone: so is its fault
    state.clear(KIND, k)
    return {"rolled_back": True}
