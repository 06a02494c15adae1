"""The router's one token check: a FastAPI dependency on the control-plane routes.

It reads only the request's headers, and FastAPI resolves a route's dependencies before its handler runs,
so a request without the admin bearer token is refused (401) before its handler reads or parses a body.
It is ``async``: a sync dependency would run in the thread pool.
"""

from __future__ import annotations

import hmac

from fastapi import Depends, HTTPException, Request

from distserve.server.router.state import router_state

UNAUTHORIZED = "missing or wrong bearer token"


def has_admin_token(request: Request) -> bool:
    got = request.headers.get("authorization", "")
    return hmac.compare_digest(got.encode(), f"Bearer {router_state(request).token}".encode())


async def require_admin_token(request: Request) -> None:
    if not has_admin_token(request):
        raise HTTPException(401, UNAUTHORIZED)  # answered by errors.http_error in OpenAI's shape


ADMIN = [Depends(require_admin_token)]  # ``APIRouter(dependencies=ADMIN)``: every route of the router checks it
