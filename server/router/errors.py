"""The router's error answers in OpenAI's shape, and the exception handlers that turn raised errors into them."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from distserve.server.router.pipeline import NoWorkersError
from distserve.server.router.protocol import InvalidRequest
from distserve.server.router.state import ModelNotFound, router_state


def error(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 503:
        kind = "service_unavailable"
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": param, "code": status}},
        status_code=status,
        headers=headers,
    )


def first_error(e: ValidationError) -> str:
    """A pydantic error as one sentence naming the field (``status.num_waiting: ...``)."""
    err = e.errors()[0]
    return f"{first_error_field(e)}: {err['msg']}"


def first_error_field(e: ValidationError) -> str:
    return ".".join(str(p) for p in e.errors()[0]["loc"]) or "body"


def unavailable(message: str) -> JSONResponse:
    return error(503, message, headers={"Retry-After": "1"})


def rate_limit_kind(reason: str) -> str:
    """The ``type`` of a 429 refused for admission's ``reason``: ``tokens`` or ``requests``."""
    return "tokens" if "tokens" in reason or reason.startswith("slo") or "ttft" in reason else "requests"


def rate_limited(message: str, reason: str, retry_after_s: int) -> JSONResponse:
    """OpenAI's rate-limit answer: 429, ``rate_limit_exceeded``, Retry-After (whole seconds)."""
    kind = rate_limit_kind(reason)
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": "rate_limit_exceeded"}},
        status_code=429,
        headers={"Retry-After": str(retry_after_s), "x-distserve-admission": reason},
    )


async def http_error(request: Request, exc: StarletteHTTPException):
    """404 (unknown path), 405 (wrong method), 401 (the token dependency) and the rest in OpenAI's error shape."""
    message = {404: f"no route {request.url.path}", 405: f"method {request.method} not allowed here"}.get(
        exc.status_code, str(exc.detail)
    )
    return error(exc.status_code, message, headers=getattr(exc, "headers", None))


async def validation_error(request: Request, exc: RequestValidationError):
    err = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    param = ".".join(str(p) for p in err.get("loc", ()) if p != "body" and not isinstance(p, int)) or None
    return error(400, f"{param or 'body'}: {err.get('msg')}", param)


async def invalid(request: Request, exc: InvalidRequest):
    return error(400, str(exc), exc.param)


async def model_not_found(request: Request, exc: ModelNotFound):
    return JSONResponse(
        {
            "error": {
                "message": f"The model `{exc}` does not exist; this server serves "
                f"`{router_state(request).model_name()}` (see /v1/models).",
                "type": "invalid_request_error",
                "param": "model",
                "code": "model_not_found",
            }
        },
        status_code=404,
    )


async def no_workers(request: Request, exc: NoWorkersError):
    router_state(request).metrics.requests.labels("unavailable").inc()
    return unavailable(f"{exc}; retry later")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(StarletteHTTPException, http_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(InvalidRequest, invalid)  # type: ignore[arg-type]
    app.add_exception_handler(ModelNotFound, model_not_found)  # type: ignore[arg-type]
    app.add_exception_handler(NoWorkersError, no_workers)  # type: ignore[arg-type]
