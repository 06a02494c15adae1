"""Finding a deployment's workers through the router's admin API (`GET /v1/workers`).

Injectors that act on worker processes (kill, pause, memory limit) pick their
targets here by role or worker id; the router's listing carries each worker's PID.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

TOKEN_ENV = "DISTSERVE_ADMIN_TOKEN"


def admin_token(token: str | None = None) -> str:
    tok = token or os.environ.get(TOKEN_ENV)
    if not tok:
        raise ValueError(f"token: the router's admin token is needed (pass token= or set {TOKEN_ENV})")
    return tok


def get_json(url: str, token: str | None = None, timeout: float = 5.0) -> dict:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    req = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def post_json(url: str, body: dict, token: str | None = None, timeout: float = 5.0) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read() or b"{}")
        except ValueError:
            return e.code, {}


def list_workers(router_url: str, token: str | None = None) -> list[dict]:
    return get_json(f"{router_url.rstrip('/')}/v1/workers", admin_token(token))["workers"]


def select_workers(
    router_url: str, token: str | None = None, role: str | None = None, worker_id: str | None = None, count: int = 1
) -> list[dict]:
    """Up to ``count`` workers matching role / id (sorted by id, so a drill is repeatable); ValueError if none."""
    if role is None and worker_id is None:
        raise ValueError("role or worker_id: name the worker(s) to act on")
    ws = sorted(list_workers(router_url, token), key=lambda w: w["worker_id"])
    hits = [w for w in ws if (worker_id is None or w["worker_id"] == worker_id) and (role is None or w["role"] == role)]
    if not hits:
        have = ", ".join(f"{w['worker_id']} ({w['role']})" for w in ws) or "none"
        raise ValueError(f"no worker matches role={role!r} worker_id={worker_id!r}; registered: {have}")
    return hits[:count]
