"""The router's HTTP layer: OpenAI API, the seed's /generate, worker registry, metrics.

Routes only translate: HTTP ⇄ ``EngineRequest`` and token events ⇄ OpenAI
JSON/SSE. Where a request goes is ``pipeline.py``; who is alive is
``registry.py``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
import threading
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field

import aiohttp
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.config import DistServeConfig
from server.engine.chat_template import ChatTemplate, ChatTemplateError, end_of_turn_ids
from server.engine.loader import load_tokenizer, model_display_name, resolve_model_path
from server.engine.tokenizer import Tokenizer
from server.lograte import RateLimitedLog
from server.metrics import RouterMetrics
from server.router import protocol, tool_calls
from server.router.admission import Admission, InvalidSlo, Ticket, parse_slo
from server.router.backup_pool import BackupOptions, BackupPool
from server.router.choices import Choices, choice_seed
from server.router.failover import PoolHeaderMiddleware, maybe_backup
from server.router.fdlimit import ConnectionCounter, ConnectionLimit
from server.router.identity import CREDENTIAL_HEADER, IdInUse, WorkerIdentities
from server.router.limits import BodyLimit
from server.router.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from server.router.pipeline import EngineRequest, NoWorkersError, Pipeline, PipelineOptions, TokenEvent
from server.router.protocol import InvalidRequest
from server.router.registry import STATES, RegistrationRefused, WorkerRegistry
from server.router.request_journal import JournalEveryRequest, client_fault
from server.router.sampling_defaults import default_sampling
from server.router.sla_live import Finished, SlaLive
from server.router.structured_outputs import GrammarCheck, constraint_for
from server.router.text import TextAssembler
from server.wire import DeregisterRequest, DrainRequest, HeartbeatRequest, InternalSampling, RegisterRequest

log = logging.getLogger(__name__)


@dataclass
class RouterState:
    config: DistServeConfig
    token: str
    registry: WorkerRegistry
    metrics: RouterMetrics = field(default_factory=RouterMetrics)
    served_model_name: str | None = None
    model_path: str | None = None
    tokenizer: Tokenizer | None = None
    chat_template: ChatTemplate | None = None
    pipeline: Pipeline | None = None
    sla: SlaLive | None = None  # rolling percentiles, breaker, journals (server/router/sla_live.py)
    backup: BackupPool | None = None
    grammar_check: GrammarCheck = field(default_factory=GrammarCheck)  # structured outputs: compile verdicts
    created: int = field(default_factory=lambda: int(time.time()))  # /v1/models `created`
    admission: Admission | None = None  # bounded queues, SLO-aware admission (server/router/admission.py)
    connections: ConnectionCounter | None = None  # open client connections vs the fd budget (fdlimit.py)
    identities: WorkerIdentities | None = None  # per-worker credentials (server/router/identity.py)

    def ids(self) -> WorkerIdentities:
        if self.identities is None:
            self.identities = WorkerIdentities(self.token)
        return self.identities

    _tokenizer_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def running_pipeline(self) -> Pipeline:
        """The pipeline, which exists while the app runs (made in its lifespan, with the HTTP session)."""
        if self.pipeline is None:
            raise RuntimeError("the router's pipeline is not running (app not started)")
        return self.pipeline

    def warm_tokenizer(self) -> None:
        try:
            self.get_tokenizer()
        except Exception as e:  # the first request reports it properly
            log.warning("cannot load the tokenizer yet: %s", e)

    def get_tokenizer(self) -> Tokenizer:
        if self.tokenizer is not None:
            return self.tokenizer
        with self._tokenizer_lock:  # a GGUF vocabulary takes a second or more to build: build it once
            return self._load_tokenizer()

    def _load_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            path = self.model_path or self.registry.model_path()
            if path is None and not self.registry.workers:
                raise NoWorkersError("no worker has registered a model yet")
            if path is None or str(path).startswith("preset:"):  # shape presets (no files): byte tokenizer
                self.tokenizer = Tokenizer.byte_tokenizer()
            else:
                self.tokenizer = load_tokenizer(resolve_model_path(path))  # a name, a folder or a .gguf
                self.model_path = path
        return self.tokenizer

    def get_chat_template(self) -> ChatTemplate:
        if self.chat_template is None:
            self.chat_template = ChatTemplate.for_tokenizer(self.get_tokenizer())
        return self.chat_template

    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return model_display_name(self.model_path or self.registry.model_path())

    def check_model(self, requested: str | None) -> None:
        """A request may name the served model (or the ``--model`` it was started with), or no model."""
        if requested is None or requested == self.model_name():
            return
        if self.model_path is not None and requested == str(self.model_path):
            return
        raise ModelNotFound(requested)

    def max_prompt_chars(self) -> int:
        return self.config.router.max_prompt_chars or 32 * self.max_seq_len()

    def max_seq_len(self) -> int:
        lens = [self.config.prefill.max_seq_len]
        worker_len = self.registry.max_model_len()
        if worker_len:
            lens.append(worker_len)
        return min(lens)


class ModelNotFound(Exception):
    """OpenAI's answer to a request that names a model this server does not serve: 404 model_not_found."""


def _error(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 503:
        kind = "service_unavailable"
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": param, "code": status}},
        status_code=status,
        headers=headers,
    )


def _first_error(e: ValidationError) -> str:
    """A pydantic error as one sentence naming the field (``status.num_waiting: ...``)."""
    err = e.errors()[0]
    return f"{_first_error_field(e)}: {err['msg']}"


def _first_error_field(e: ValidationError) -> str:
    return ".".join(str(p) for p in e.errors()[0]["loc"]) or "body"


def _unavailable(message: str) -> JSONResponse:
    return _error(503, message, headers={"Retry-After": "1"})


def _rate_limited(message: str, reason: str, retry_after_s: int) -> JSONResponse:
    """OpenAI's rate-limit answer: 429, ``rate_limit_exceeded``, Retry-After (whole seconds)."""
    kind = "tokens" if "tokens" in reason or reason.startswith("slo") or "ttft" in reason else "requests"
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": "rate_limit_exceeded"}},
        status_code=429,
        headers={"Retry-After": str(retry_after_s), "x-distserve-admission": reason},
    )


def _serving_workers(state: RouterState) -> int:
    """How many workers share the prefill queue: healthy prefill workers, else healthy colocated ones."""
    reg = state.registry
    return len(reg.healthy("prefill")) if reg.mode() == "disaggregated" else len(reg.healthy("colocated"))


def create_router_app(state: RouterState) -> FastAPI:
    rc = state.config.router
    overload_log = RateLimitedLog(log)  # one line per admission cause per period

    async def sweep_registry() -> None:
        """Age worker states on a clock of their own, so the waits on a worker that froze fail
        within a heartbeat timeout even when no request or heartbeat arrives to notice it."""
        period = max(0.05, min(rc.heartbeat_interval_ms, rc.heartbeat_timeout_ms) / 2000.0)
        while True:
            state.registry.sweep()
            if state.pipeline is not None:
                state.pipeline.request_log.flush()  # the summaries of held-back per-request warnings
            await asyncio.sleep(period)

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
                state.admission = Admission(state.config, state.metrics.registry, lambda: _serving_workers(state))
            state.admission.journal = state.sla.events_journal.append
            state.admission.attach(state.pipeline)  # the TTFT model learns each request's phases
            ticker = asyncio.ensure_future(state.sla.run())
            sweeper = asyncio.create_task(sweep_registry(), name="registry-sweep")
            try:
                yield
            finally:
                sweeper.cancel()
                ticker.cancel()
                state.sla.close()

    app = FastAPI(title="distserve router", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimit, max_bytes=rc.max_request_body_bytes, body_timeout_s=rc.body_timeout_s)
    app.state.router = state
    app.add_middleware(PoolHeaderMiddleware)
    if state.connections is not None:  # refuses before the body is read (journaled by the next one)
        app.add_middleware(ConnectionLimit, counter=state.connections, retry_after_s=rc.admission.retry_after_s)
    # outermost: sees 408/413 answers too; bounds the whole request (a client reading slowly)
    app.add_middleware(JournalEveryRequest, live=lambda: state.sla, request_timeout_s=rc.request_timeout_s)

    def authorized(request: Request) -> bool:
        got = request.headers.get("authorization", "")
        return hmac.compare_digest(got.encode(), f"Bearer {state.token}".encode())

    async def json_body(request: Request):
        raw = await request.body()  # at most router.max_request_body_bytes (BodyLimit)
        try:
            body = json.loads(raw) if len(raw) < _PARSE_INLINE_BYTES else await asyncio.to_thread(json.loads, raw)
        except RecursionError:
            raise InvalidRequest("request body nests JSON too deeply") from None
        except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, or an integer of > 4300 digits
            raise InvalidRequest(f"request body is not valid JSON: {e}") from None
        protocol.check_unicode(body)
        request.state.json_body = body  # the request as sent, should admission send it to the backup pool
        return body

    # --- control plane -----------------------------------------------------
    @app.post("/register")
    async def register(request: Request):
        if not authorized(request):
            return _error(401, "missing or wrong bearer token")
        try:
            req = RegisterRequest.model_validate(await json_body(request))
            state.ids().admit(state.registry, req.worker_id, request.headers.get(CREDENTIAL_HEADER))
            info = state.registry.register(req)
        except InvalidRequest as e:
            return _error(400, str(e))
        except IdInUse as e:
            log.warning("registration refused: %s", e)
            return _error(409, str(e), "worker_id")
        except RegistrationRefused as e:
            log.error("%s", e)
            return _error(409, str(e))
        except ValidationError as e:
            return _error(400, f"invalid registration: {_first_error(e)}", _first_error_field(e))
        except ValueError as e:
            return _error(422, f"invalid registration: {e}")
        log.info("worker %s (%s, pid %d) registered at %s", info.worker_id, info.role, info.pid, info.url)
        if state.tokenizer is None:  # build it off the event loop now, not inside the first request
            asyncio.get_running_loop().run_in_executor(None, state.warm_tokenizer)
        return {"registered": info.worker_id, "credential": state.ids().issue(info.worker_id)}

    @app.post("/heartbeat")
    async def heartbeat(request: Request):
        if not authorized(request):
            return _error(401, "missing or wrong bearer token")
        try:
            hb = HeartbeatRequest.model_validate(await json_body(request))
        except ValidationError as e:
            return _error(400, f"invalid heartbeat: {_first_error(e)}", _first_error_field(e))
        except (InvalidRequest, ValueError) as e:
            return _error(400, f"invalid heartbeat: {e}")
        if hb.worker_id in state.registry.workers and not state.ids().holds(
            hb.worker_id, request.headers.get(CREDENTIAL_HEADER)
        ):
            return _error(403, f"wrong or missing worker credential for {hb.worker_id!r}", CREDENTIAL_HEADER)
        if not state.registry.heartbeat(hb.worker_id, hb.status):
            return _error(404, f"unknown worker {hb.worker_id}; register first")
        return {"ok": True}

    @app.post("/deregister")
    async def deregister(request: Request):
        if not authorized(request):
            return _error(401, "missing or wrong bearer token")
        try:
            req = DeregisterRequest.model_validate(await json_body(request))
        except (InvalidRequest, ValueError) as e:
            return _error(400, f"invalid deregistration: {e}")
        if req.reason is not None:  # the launcher saw the process exit: keep it listed, as dead
            return {"deregistered": state.registry.mark_dead(req.worker_id, req.reason)}  # it logs the transition
        # A worker's own goodbye: only the holder of the id's credential may remove it.
        if req.worker_id in state.registry.workers and not state.ids().holds(
            req.worker_id, request.headers.get(CREDENTIAL_HEADER)
        ):
            return _error(403, f"wrong or missing worker credential for {req.worker_id!r}", CREDENTIAL_HEADER)
        gone = state.registry.deregister(req.worker_id, req.pid)
        if gone:
            state.ids().forget(req.worker_id)
        return {"deregistered": gone}

    @app.post("/drain")
    async def drain(request: Request):
        """Scale-down, step one: no new request goes to this worker; the caller waits for it to go idle."""
        if not authorized(request):
            return _error(401, "missing or wrong bearer token")
        try:
            req = DrainRequest.model_validate(await json_body(request))
        except (InvalidRequest, ValueError) as e:
            return _error(400, f"invalid drain request: {e}")
        if not state.registry.drain(req.worker_id):
            return _error(404, f"worker_id: no live worker {req.worker_id!r} is registered")
        return {"draining": req.worker_id}

    @app.get("/v1/workers")
    async def workers(request: Request):
        if not authorized(request):
            return _error(401, "missing or wrong bearer token")
        reg = state.registry
        reg.sweep()
        now = time.monotonic()
        out = []
        for w in reg.workers.values():
            d = w.to_dict(now)
            d["prefix_blocks"] = reg.prefix.num_blocks(w.worker_id)  # in its routing summary (prefix_index.py)
            out.append(d)
        return {"mode": reg.mode(), "workers": out}

    @app.get("/v1/admission")
    async def admission_status(request: Request):
        """Admission counts, bounds, the live TTFT model and its measured prediction error."""
        if not authorized(request):
            return _error(401, "missing or wrong bearer token")
        return state.admission.status() if state.admission else _unavailable("starting up")

    @app.get("/health")
    async def health():
        """200 ``ok`` (every registered worker healthy), 200 ``degraded`` (serving, with capacity
        lost: some worker stale, suspect or dead), 503 ``down`` (no healthy prefill+decode pair and
        no healthy colocated worker)."""
        reg = state.registry
        reg.sweep()
        mode, counts = reg.mode(), reg.counts()
        workers = {role: dict(c) for role, c in counts.items()}
        if mode is None:
            return JSONResponse(
                {
                    "status": "down",
                    "mode": None,
                    "workers": workers,
                    "error": {
                        "message": "no healthy prefill+decode pair or colocated worker",
                        "type": "service_unavailable",
                        "code": 503,
                    },
                },
                status_code=503,
                headers={"Retry-After": "1"},
            )
        lost = sum(n for c in counts.values() for st, n in c.items() if st not in ("healthy", "draining"))
        journal = state.sla.journal_problem() if state.sla is not None else None
        # workers whose engine steps fail for lack of device memory (their heartbeats say so)
        pressure = sorted(w.worker_id for w in reg.workers.values() if w.healthy and w.status.memory_errors_recent)
        out = {"status": "degraded" if lost or journal or pressure else "ok", "mode": mode, "workers": workers}
        if journal:
            out["reasons"] = [journal]  # a journal write failed: requests are served, records are being lost
        if pressure:
            out["memory_pressure"] = pressure
        return out

    @app.get("/metrics")
    async def metrics():
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

    @app.get("/sla/status")
    async def sla_status():
        return state.sla.status() if state.sla else _unavailable("starting up")

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": state.model_name(),
                    "object": "model",
                    "created": state.created,
                    "owned_by": "distserve",
                    "max_model_len": state.max_seq_len(),
                }
            ],
        }

    @app.get("/version")
    async def version():
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as package_version

        try:
            return {"version": package_version("distserve")}
        except PackageNotFoundError:
            return {"version": "unknown"}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """vLLM's shape: ``{prompt, add_special_tokens}`` or ``{messages, add_generation_prompt}`` →
        ``{count, max_model_len, tokens}``."""
        body = await json_body(request)
        req = protocol.parse_tokenize(body)
        state.check_model(req.model)
        state.running_pipeline().check_available()
        await _tokenizer_ready(state)
        tokenizer = state.get_tokenizer()
        if req.messages is not None:
            template = state.get_chat_template()
            try:
                text = template.render(
                    [m.template_dict() for m in req.messages], add_generation_prompt=req.add_generation_prompt
                )
            except ChatTemplateError as e:
                raise InvalidRequest(f"messages: {e}", "messages") from None
            ids = await _tokenize(state, text, "messages", add_bos=tokenizer.chat_template is None)
        else:
            ids = await _tokenize(state, req.prompt or "", add_bos=req.add_special_tokens)
        out: dict = {"count": len(ids), "max_model_len": state.max_seq_len(), "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = [tokenizer.id_to_token(t) for t in ids]
        return out

    @app.post("/detokenize")
    async def detokenize(request: Request):
        """vLLM's shape: ``{tokens}`` → ``{prompt}``."""
        body = await json_body(request)
        req = protocol.parse_detokenize(body)
        state.check_model(req.model)
        state.running_pipeline().check_available()
        await _tokenizer_ready(state)
        vocab = _vocab_size(state)
        if vocab is not None and any(not 0 <= t < vocab for t in req.tokens):
            raise InvalidRequest(f"tokens: token ids must be in [0, {vocab})", "tokens")
        return {"prompt": state.get_tokenizer().decode(req.tokens)}

    # --- data plane --------------------------------------------------------
    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        """404 (unknown path), 405 (wrong method) and the rest in OpenAI's error shape."""
        message = {404: f"no route {request.url.path}", 405: f"method {request.method} not allowed here"}.get(
            exc.status_code, str(exc.detail)
        )
        return _error(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        err = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        param = ".".join(str(p) for p in err.get("loc", ()) if p != "body" and not isinstance(p, int)) or None
        return _error(400, f"{param or 'body'}: {err.get('msg')}", param)

    @app.exception_handler(InvalidRequest)
    async def invalid(request: Request, exc: InvalidRequest):
        return _error(400, str(exc), exc.param)

    @app.exception_handler(ModelNotFound)
    async def model_not_found(request: Request, exc: ModelNotFound):
        return JSONResponse(
            {
                "error": {
                    "message": f"The model `{exc}` does not exist; this server serves "
                    f"`{state.model_name()}` (see /v1/models).",
                    "type": "invalid_request_error",
                    "param": "model",
                    "code": "model_not_found",
                }
            },
            status_code=404,
        )

    @app.exception_handler(NoWorkersError)
    async def no_workers(request: Request, exc: NoWorkersError):
        state.metrics.requests.labels("unavailable").inc()
        return _unavailable(f"{exc}; retry later")

    async def via_backup(path: str, body: dict, req) -> Response | None:
        if state.sla is None or state.backup is None:
            return None
        return await maybe_backup(
            state.sla,
            state.backup,
            lambda: state.registry.mode() is not None,
            path,
            body,
            req.stream,
            time.perf_counter(),
        )

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await json_body(request)
        req = protocol.parse(protocol.CompletionRequest, body, rc.allow_unknown_fields)
        state.check_model(req.model)
        if (resp := await via_backup("/v1/completions", body, req)) is not None:
            return resp
        prompts = req.prompts()  # a batched request has several: one choice each
        constraint = await _constraint(req)
        await _tokenizer_ready(state)
        if len(prompts) > 1:  # a batch: one choice per prompt, in order
            if req.n != 1 or req.best_of not in (None, 1) or req.echo:
                raise InvalidRequest("prompt: a batch of prompts takes neither n, best_of nor echo", "prompt")
            batch = [await _prompt_ids(state, p) for p in prompts]
            return await _serve(request, req, batch[0], "completion", constraint=constraint, batch=batch)
        ids = await _prompt_ids(state, prompts[0])
        echo = None
        if req.echo:  # the prompt as the client sent it (text), or the decoding of its ids
            echo = _single_prompt(req.prompt)
            if not isinstance(echo, str):
                echo = state.get_tokenizer().decode(ids)
        return await _serve(request, req, ids, "completion", echo=echo, constraint=constraint)

    async def _constraint(req):
        """The request's validated output grammar (InvalidRequest naming the field when it cannot compile)."""
        found = constraint_for(req)
        if found is None:
            return None
        c, where = found
        await state.grammar_check.check(c, where)
        return c

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await json_body(request)
        req = protocol.parse(protocol.ChatCompletionRequest, body, rc.allow_unknown_fields)
        state.check_model(req.model)
        if (resp := await via_backup("/v1/chat/completions", body, req)) is not None:
            return resp
        if req.max_completion_tokens is not None and req.max_tokens is None:
            req.max_tokens = req.max_completion_tokens
        state.running_pipeline().check_available()  # 503 before touching the tokenizer when no model is known yet
        await _tokenizer_ready(state)
        tokenizer, template = state.get_tokenizer(), state.get_chat_template()
        messages = [m.template_dict() for m in req.messages]
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        if tools and "tools" not in template.source:  # the template ignores tools: describe them ourselves
            messages = tool_calls.with_tools_described(messages, tools)
        try:
            text = template.render(messages, tools=tools)
        except ChatTemplateError as e:
            raise InvalidRequest(f"messages: {e}", "messages") from None
        # the model's template writes its own bos; only the plain fallback needs one added
        ids = await _tokenize(state, text, "messages", add_bos=tokenizer.chat_template is None)
        stop_ids = [] if req.ignore_eos else end_of_turn_ids(tokenizer, template)
        constraint = tool_calls.constraint(req)
        if constraint is not None:
            await state.grammar_check.check(constraint, "tools")
        else:
            constraint = await _constraint(req)
        tool_mode = tool_calls.mode(req)
        tools_ctx = None
        if tool_mode is not None:
            tools_ctx = _ToolContext(req, tool_mode, tool_calls.parser_for(template.source), set(stop_ids))
        return await _serve(request, req, ids, "chat", stop_ids, constraint=constraint, tools=tools_ctx)

    @app.post("/generate")
    async def generate(request: Request):
        req = protocol.parse(protocol.GenerateRequest, await json_body(request), rc.allow_unknown_fields)
        state.check_model(req.model)
        if req.n != 1:
            raise InvalidRequest("n: /generate returns one completion; use /v1/completions for n > 1", "n")
        await _tokenizer_ready(state)
        if (req.prompt is None) == (req.prompt_token_ids is None):
            raise InvalidRequest("prompt: give exactly one of prompt or prompt_token_ids", "prompt")
        if req.prompt == "":
            raise InvalidRequest("prompt: must not be empty", "prompt")
        ids = await _tokenize(state, req.prompt) if req.prompt is not None else _check_ids(state, req.prompt_token_ids)
        return await _serve(request, req, ids, "generate", constraint=await _constraint(req))

    async def _admit(request: Request, req, kind: str, n_tokens: int) -> tuple[Ticket | None, Response | None]:
        """(ticket, None) when admitted; (None, response) when shed (429 + Retry-After) or served by the backup."""
        adm = state.admission
        if adm is None:
            return None, None
        ac = rc.admission
        try:
            slo = parse_slo(request.headers, ac.slo_ttft_ms, ac.slo_tpot_ms, ac.on_slo_miss)
        except InvalidSlo as e:
            raise InvalidRequest(str(e), e.header) from None
        d = adm.decide(n_tokens, slo)
        if d.route == "primary":
            return adm.admit(n_tokens, d), None
        if d.route == "backup" and state.sla is not None and state.backup is not None and state.backup.configured:
            body = getattr(request.state, "json_body", None)
            path = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}.get(kind)
            if body is not None and path is not None:
                resp = await maybe_backup(
                    state.sla, state.backup, lambda: True, path, body, req.stream, time.perf_counter(), d.reason
                )
                if resp is not None:
                    adm.refused(d, n_tokens, "backup")
                    return None, resp
        adm.refused(d, n_tokens, "shed")
        state.metrics.requests.labels("rate_limited").inc()
        overload_log.warning(f"admission: {d.reason}", "429 (%s): %s", d.reason, d.message)
        return None, _rate_limited(d.message, d.reason, d.retry_after_s)

    async def _serve(
        request: Request,
        req,
        prompt_ids: list[int],
        kind: str,
        stop_ids: list[int] | None = None,
        echo: str | None = None,
        constraint=None,
        tools=None,
        batch: list[list[int]] | None = None,
    ):
        max_len = state.max_seq_len()
        if len(prompt_ids) >= max_len:
            raise InvalidRequest(
                f"prompt: {len(prompt_ids)} tokens is longer than max_seq_len allows "
                f"({max_len} tokens, including at least one generated token)",
                "prompt",
            )
        max_tokens = req.max_tokens
        if max_tokens is None:
            max_tokens = 16 if kind == "completion" else max_len - len(prompt_ids)
        if len(prompt_ids) + max_tokens > max_len:
            raise InvalidRequest(
                f"max_tokens: prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) "
                f"exceeds max_seq_len ({max_len})",
                "max_tokens",
            )
        vocab = _vocab_size(state)
        if vocab is not None and any(t >= vocab for t in req.stop_token_ids or ()):
            raise InvalidRequest(f"stop_token_ids: token ids must be in [0, {vocab})", "stop_token_ids")
        bias = req.logit_bias_items()
        if vocab is not None and any(t >= vocab for t, _ in bias):
            raise InvalidRequest(f"logit_bias: token ids must be in [0, {vocab})", "logit_bias")
        temperature, top_p = default_sampling(req, state.config.decode)
        k = req.logprobs_k()
        best_of = getattr(req, "best_of", None) or req.n
        sampling = InternalSampling(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=max(req.top_k, 0),
            seed=req.seed if req.seed is not None else secrets.randbits(62),
            stop_token_ids=(req.stop_token_ids or []) + (stop_ids or []),
            ignore_eos=req.ignore_eos,
            min_p=req.min_p,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty,
            logit_bias=bias,
            logprobs=k if k is not None or best_of == req.n else 0,  # best_of ranks by logprob
            structured=constraint,
        )
        state.running_pipeline().check_available()  # NoWorkersError -> 503 with Retry-After
        tokenizer = state.get_tokenizer()
        # OpenAI bodies prefix the id themselves (cmpl-, chatcmpl-); /generate's id is "gen-" + hex
        rid = f"{'gen-' if kind == 'generate' else ''}{uuid.uuid4().hex}"
        ticket, refusal = await _admit(request, req, kind, len(prompt_ids))
        if refusal is not None:
            return refusal
        seed = sampling.seed or 0
        runs = [
            _Run(
                state,
                EngineRequest(
                    rid if i == 0 else f"{rid}-{i}",
                    prompt_ids,
                    sampling if i == 0 else sampling.model_copy(update={"seed": choice_seed(seed, i)}),
                ),
                TextAssembler(tokenizer, req.stop_strings()),
                ticket if i == 0 else None,  # admission counts the prompt once: the first choice holds its place
            )
            for i in range(best_of)
        ]
        if batch is not None:  # batched prompts: one run per prompt, the same sampling, each its own id
            runs += [
                _Run(state, EngineRequest(f"{rid}-p{i}", ids, sampling), TextAssembler(tokenizer, req.stop_strings()))
                for i, ids in enumerate(batch[1:], 1)
            ]
            for ids in batch[1:]:
                _check_prompt_fits(state, ids, max_tokens)
        for r in runs:
            r.tools = tools
        group = Choices(runs, len(runs) if batch is not None else req.n, batched=batch is not None)
        shape = _Shape(k, TokenTexts(tokenizer), echo)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            fmt = {"completion": _sse_completion, "chat": _sse_chat, "generate": _ndjson_generate}[kind]
            media = "application/x-ndjson" if kind == "generate" else "text/event-stream"
            return StreamingResponse(fmt(group, state.model_name(), include_usage, shape), media_type=media)
        try:
            await _until_done_or_disconnect(request, group.collect())
        except _ClientGone:
            return JSONResponse({}, status_code=499)
        if group.error:
            return _error(group.error_status, group.error)
        return JSONResponse(_final_body(kind, group, state.model_name(), shape))

    return app


# --- helpers ---------------------------------------------------------------
_PARSE_INLINE_BYTES = 256 << 10  # larger bodies are parsed, and larger texts tokenized, off the event loop
_TOKENIZE_INLINE_CHARS = 16 << 10


async def _tokenizer_ready(state: RouterState) -> None:
    """Load the tokenizer off the event loop (a GGUF vocabulary takes seconds on a busy CPU: heartbeats
    and other requests must not wait for it)."""
    if state.tokenizer is None:
        await asyncio.to_thread(state.get_tokenizer)


async def _tokenize(state: RouterState, text: str, field: str = "prompt", **kw) -> list[int]:
    limit = state.max_prompt_chars()
    if len(text) > limit:  # checked before tokenizing: a huge text must not cost tokenizer time
        raise InvalidRequest(
            f"{field}: {len(text)} characters is more than this server accepts ({limit}; router.max_prompt_chars)",
            field,
        )
    await _tokenizer_ready(state)
    tokenizer = state.get_tokenizer()  # NoWorkersError (no model known yet) -> 503
    if len(text) <= _TOKENIZE_INLINE_CHARS:
        return tokenizer.encode(text, **kw)
    return await asyncio.to_thread(lambda: tokenizer.encode(text, **kw))


def _check_prompt_fits(state: RouterState, prompt_ids: list[int], max_tokens: int) -> None:
    """A batched request's other prompts: the length checks the first one had."""
    max_len = state.max_seq_len()
    if len(prompt_ids) + max_tokens > max_len:
        raise InvalidRequest(
            f"prompt: a prompt of {len(prompt_ids)} tokens + max_tokens ({max_tokens}) exceeds max_seq_len ({max_len})",
            "prompt",
        )


def _vocab_size(state: RouterState) -> int | None:
    # every worker shares one fingerprint (registration enforces it), so any one tells the vocabulary
    first = next(iter(state.registry.workers.values()), None)
    return first.fingerprint.get("vocab_size") if first else None


def _check_ids(state: RouterState, ids: list[int] | None) -> list[int]:
    if not ids:
        raise InvalidRequest("prompt: must not be empty", "prompt")
    vocab = _vocab_size(state)
    if vocab is not None and any(not 0 <= t < vocab for t in ids):
        raise InvalidRequest(f"prompt: token ids must be in [0, {vocab})", "prompt")
    return ids


def _single_prompt(prompt):
    """The one prompt of a completions request (a list of one prompt is that prompt)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
        return prompt[0]
    return prompt


@dataclass
class _Shape:
    """How a response shows its choices: logprobs (None: not asked; k: k alternatives), echo text."""

    logprobs: int | None = None
    texts: TokenTexts | None = None
    echo: str | None = None


async def _prompt_ids(state: RouterState, prompt) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequest("prompt: must not be empty", "prompt")
        return await _tokenize(state, prompt)
    return _check_ids(state, list(prompt))


class _ClientGone(Exception):
    pass


async def _until_done_or_disconnect(request: Request, coro) -> None:
    """Await ``coro`` unless the client disconnects first; then cancel it (frees worker KV)."""
    task = asyncio.ensure_future(coro)

    async def watch() -> None:
        while True:
            if (await request.receive())["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        watcher.cancel()
        task.result()
        return
    task.cancel()
    raise _ClientGone()


_OUTCOME_STATUS = {"ok": 200, "rejected": 400, "aborted": 499, "unavailable": 503}  # journal's "status"


class _Run:
    """One request's progress: tokens, text, timings; records metrics when it ends."""

    def __init__(
        self, state: RouterState, req: EngineRequest, text: TextAssembler, ticket: Ticket | None = None
    ) -> None:
        self.state, self.req, self.assembler = state, req, text
        self.ticket = ticket  # its place in admission's counts: released at token #1 and at the end
        req.phases = ticket.phases if ticket is not None else req.phases  # measured for its TTFT model
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.error_status = 500  # HTTP status of `error` when the response has not started
        self.first_token_at: float | None = None
        self.last_event_at: float | None = None
        self.itl: list[float] = []
        self.cached_tokens: int | None = None  # prompt tokens the prefilling worker's prefix cache served
        self.tools: _ToolContext | None = None  # tool calls requested (chat with tools)
        self.logprobs: list = []  # wire TokenLogprob per token, when the request asked for logprobs
        self.started = asyncio.Event()  # set at the first event (choices.py starts the other choices then)

    async def events(self) -> AsyncIterator[tuple[TokenEvent, str]]:
        m = self.state.metrics
        m.running.inc()
        status = "aborted"
        try:
            async with aclosing(self.state.running_pipeline().generate(self.req)) as stream:
                async for ev in stream:
                    self.started.set()
                    now = time.perf_counter()
                    if ev.token_ids:
                        if self.first_token_at is None:
                            self.first_token_at = now
                            m.ttft.observe(now - self.req.arrival)
                            if self.ticket is not None:
                                self.ticket.first_token(now - self.req.arrival)
                        elif self.last_event_at is not None:
                            m.itl.observe(now - self.last_event_at)
                            self.itl.append(now - self.last_event_at)
                        self.last_event_at = now
                    self.token_ids.extend(ev.token_ids)
                    if self.cached_tokens is None and ev.num_cached_tokens is not None:
                        self.cached_tokens = ev.num_cached_tokens  # the first prefill's (a migration re-prefills)
                    if ev.logprobs:
                        self.logprobs.extend(ev.logprobs)
                    if ev.error:
                        self.error, status = ev.error, "error"
                        self.finish_reason = "error"
                        yield ev, ""
                        return
                    delta = self.assembler.push(ev.token_ids, final=ev.finished)
                    if self.assembler.stopped:
                        self.finish_reason = "stop"
                        status = "ok"
                        yield TokenEvent(ev.token_ids, True, "stop", logprobs=ev.logprobs), delta
                        return  # closing the pipeline closes the worker stream: it aborts and frees KV
                    if ev.finished:
                        if ev.finish_reason not in ("stop", "length"):  # a worker aborted it without saying why
                            self.error = f"request ended early ({ev.finish_reason}) on the worker"
                            self.finish_reason, status = "error", "error"
                            yield TokenEvent(ev.token_ids, True, "error", self.error), ""
                            return
                        self.finish_reason = ev.finish_reason
                        status = "ok"
                    yield ev, delta
                    if ev.finished:
                        return
        except NoWorkersError as e:
            self.error, status, self.finish_reason = f"{e}", "unavailable", "error"
            self.error_status = 503
            yield TokenEvent([], True, "error", self.error), ""
        except (InvalidRequest, ValueError) as e:  # a worker's 400 (validation it does and we did not)
            # the client's fault: "rejected", like the router's own 400s, and not an SLA failure
            self.error, status, self.finish_reason = f"{e}", "rejected", "error"
            self.error_status = 400
            yield TokenEvent([], True, "error", self.error), ""
        except Exception as e:  # a bug: still end the stream with an error the client can read
            log.exception("request %s failed", self.req.request_id)
            self.error, status, self.finish_reason = f"internal error: {type(e).__name__}: {e}", "error", "error"
            yield TokenEvent([], True, "error", self.error), ""
        finally:
            self.started.set()
            m.running.dec()
            m.requests.labels(status).inc()
            if self.ticket is not None:
                n = len(self.token_ids)
                first = self.first_token_at
                tpot = (time.perf_counter() - first) / (n - 1) if status == "ok" and first and n > 1 else None
                self.ticket.done(tpot)
            if status == "ok":
                e2e = time.perf_counter() - self.req.arrival
                m.e2e.observe(e2e)
                m.prompt_tokens.inc(len(self.req.prompt_token_ids))
                m.generation_tokens.inc(len(self.token_ids))
                if self.first_token_at is not None and len(self.token_ids) > 1:
                    m.tpot.observe((time.perf_counter() - self.first_token_at) / (len(self.token_ids) - 1))
            # journaled whatever the outcome; a client that left (499) or a request the worker refused as
            # invalid (400) is not a server failure: the audit leaves them out of availability
            if self.state.sla is not None:
                self._record_sla(status)

    def _record_sla(self, status: str) -> None:
        sla = self.state.sla
        if sla is None:
            return
        now = time.perf_counter()
        ok, n = status == "ok", len(self.token_ids)
        first = self.first_token_at
        ttft = first - self.req.arrival if ok and first is not None else None
        tpot = (now - first) / (n - 1) if ok and first is not None and n > 1 else None
        sla.record(
            Finished(
                "primary",
                time.monotonic() - (now - self.req.arrival),
                time.time() - (now - self.req.arrival),
                ok,
                ttft=ttft,
                tpot=tpot,
                e2e=now - self.req.arrival if ok else None,
                itl=tuple(self.itl) if ok else (),
                prompt_tokens=len(self.req.prompt_token_ids),
                output_tokens=n,
                error=None
                if ok
                else (self.error or ((client_fault() or "client disconnected") if status == "aborted" else status)),
                http_status=_OUTCOME_STATUS.get(status, 500),
                predicted_ttft=self.ticket.predicted_ttft_s if self.ticket is not None else None,
                path=self.req.path,
            )
        )

    async def collect(self) -> None:
        async for _ in self.events():
            pass

    def usage(self) -> dict:
        p, c = len(self.req.prompt_token_ids), len(self.token_ids)
        return {
            "prompt_tokens": p,
            "completion_tokens": c,
            "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens or 0},
        }


@dataclass
class _ToolContext:
    """A chat request with tools: how its answer becomes ``tool_calls`` (server/router/tool_calls.py)."""

    req: protocol.ChatCompletionRequest
    mode: str  # auto | required | named
    family: str  # the parser of the template's family (auto)
    stop_ids: set[int]

    def answer(self, run: _Run) -> tuple[str | None, list[tool_calls.ParsedCall]]:
        """(content, calls) of a finished run."""
        if self.mode == "auto":
            content, calls = tool_calls.parse_auto(self.raw_text(run), self.family, self._names())
            if not self.req.parallel_tool_calls:
                calls = calls[:1]
            return (content or None) if calls else run.assembler.text, calls
        calls = tool_calls.parse_constrained(run.assembler.text, self.req)
        return None, calls

    def raw_text(self, run: _Run) -> str:
        """The answer with special tokens (tool-call markers may be special), end-of-turn tokens left out."""
        ids = [t for t in run.token_ids if t not in self.stop_ids]
        return run.state.get_tokenizer().decode(ids, skip_special_tokens=False)

    def _names(self) -> set[str]:
        return {t.function.name for t in self.req.tools or ()}


async def _sse_chat_tools(run: _Run, model: str, include_usage: bool):
    """A chat stream with tools, as OpenAI streams it: content deltas while the answer is text; each call
    as a first delta (index, id, type, function.name, arguments "") then its arguments; finish
    ``tool_calls``. Named: the arguments stream as they are generated; required and auto: at the end."""
    ctx = run.tools
    assert ctx is not None
    rid, created = f"chatcmpl-{run.req.request_id}", int(time.time())

    def chunk(delta: dict, reason: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        return _sse(
            {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}
        )

    yield chunk({"role": "assistant", "content": ""})
    choice = ctx.req.tool_choice
    named_call = (
        tool_calls.ParsedCall(choice.function.name, "") if isinstance(choice, protocol.NamedToolChoice) else None
    )
    if named_call is not None:
        first = {"index": 0, "id": named_call.id, "type": "function"}
        yield chunk({"tool_calls": [{**first, "function": {"name": named_call.name, "arguments": ""}}]})
    sent = 0  # content characters streamed (auto)
    async for ev, delta in run.events():
        if ev.error:
            yield _sse_error(ev.error)
            yield b"data: [DONE]\n\n"
            return
        if named_call is not None and delta:
            yield chunk({"tool_calls": [{"index": 0, "function": {"arguments": delta}}]})
        elif ctx.mode == "auto" and not ev.finished:
            text = ctx.raw_text(run)
            safe = tool_calls.safe_content_len(text, ctx.family)
            if safe > sent:
                yield chunk({"content": text[sent:safe]})
                sent = safe
    if named_call is not None:
        calls: list[tool_calls.ParsedCall] = [named_call]
    else:
        content, calls = ctx.answer(run)
        if ctx.mode == "auto":
            text = ctx.raw_text(run) if calls else run.assembler.text
            rest = (content or "")[sent:] if calls else text[sent:]
            if rest:
                yield chunk({"content": rest})
        for i, c in enumerate(calls):
            head = {"index": i, "id": c.id, "type": "function"}
            yield chunk({"tool_calls": [{**head, "function": {"name": c.name, "arguments": ""}}]})
            yield chunk({"tool_calls": [{"index": i, "function": {"arguments": c.arguments}}]})
    reason = "tool_calls" if calls and run.finish_reason == "stop" else run.finish_reason
    yield chunk({}, reason)
    if include_usage and not run.error:
        yield _usage_chunk(rid, "chat.completion.chunk", created, model, run.usage())
    yield b"data: [DONE]\n\n"


def _chat_message(run: _Run) -> dict:
    """A chat choice's ``message`` and ``finish_reason`` (tool calls parsed when the request has tools)."""
    message: dict = {"role": "assistant", "content": run.assembler.text}
    reason = run.finish_reason
    tools = getattr(run, "tools", None)
    if tools is not None:
        content, calls = tools.answer(run)
        if calls:
            message = {"role": "assistant", "content": content, "tool_calls": [c.to_openai() for c in calls]}
            reason = "tool_calls" if reason == "stop" else reason
    return {"message": message, "finish_reason": reason}


def _final_body(kind: str, group: Choices, model: str, shape: _Shape | None = None) -> dict:
    shape = shape or _Shape()
    created = int(time.time())
    k, texts = shape.logprobs, shape.texts
    runs = group.chosen()
    if kind == "generate":
        run = runs[0]
        body = {
            "id": run.req.request_id,
            "text": run.assembler.text,
            "token_ids": run.token_ids,
            "finish_reason": run.finish_reason,
            "usage": group.usage(),
        }
        if k is not None:
            body["logprobs"] = _generate_logprobs(run.logprobs)
        return body
    if kind == "chat":
        return {
            "id": f"chatcmpl-{group.req.request_id}",
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": i,
                    **_chat_message(run),
                    "logprobs": None
                    if k is None or texts is None
                    else chat_logprobs(run.token_ids, run.logprobs, texts),
                }
                for i, run in enumerate(runs)
            ],
            "usage": group.usage(),
        }
    return {
        "id": f"cmpl-{group.req.request_id}",
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": i,
                "text": (shape.echo or "") + run.assembler.text,
                "finish_reason": run.finish_reason,
                "logprobs": None
                if k is None or texts is None
                else completion_logprobs(run.token_ids, run.logprobs, texts)[0],
            }
            for i, run in enumerate(runs)
        ],
        "usage": group.usage(),
    }


def _generate_logprobs(logprobs) -> list[dict]:
    """/generate's logprobs: per token its logprob and ``[id, logprob]`` of the k most likely."""
    return [{"logprob": lp.logprob, "top_logprobs": [list(t) for t in lp.top]} for lp in logprobs]


def _as_group(run) -> Choices:
    return run if isinstance(run, Choices) else Choices([run], 1)


_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)  # json.dumps(..., **kw) builds one per call
_JSON_NDJSON = json.JSONEncoder(ensure_ascii=False)  # /generate lines: json.dumps' default separators
_json_str = json.encoder.encode_basestring  # a str as JSON, as _JSON writes it (ensure_ascii=False); C


def _usage_chunk(rid: str, obj: str, created: int, model: str, usage: dict) -> bytes:
    """The last chunk of a stream with ``stream_options.include_usage``: no choices, the usage."""
    return _sse({"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage})


def _sse(obj: dict) -> bytes:
    return f"data: {_JSON.encode(obj)}\n\n".encode()


def _sse_error(message: str) -> bytes:
    return _sse({"error": {"message": message, "type": "server_error", "code": 500}})


def _reason(finish_reason: str | None) -> str:
    return "null" if finish_reason is None else _JSON.encode(finish_reason)


async def _sse_completion(run, model: str, include_usage: bool, shape: _Shape | None = None):
    group, shape = _as_group(run), shape or _Shape()
    rid, created = f"cmpl-{group.req.request_id}", int(time.time())
    # Each chunk is `_sse({"id": rid, "object": "text_completion", "created": created, "model": model,
    # "choices": [{"index": i, "text": delta, "logprobs": lp, "finish_reason": reason}]})`, byte for
    # byte; all but the text (and the logprobs, when asked) is formatted once per request, not per token.
    heads = [
        f'data: {{"id":{_JSON.encode(rid)},"object":"text_completion","created":{created},'
        f'"model":{_JSON.encode(model)},"choices":[{{"index":{i},"text":'
        for i in range(len(group.runs))
    ]
    tail = "}]}\n\n"
    offsets = [len(shape.echo or "")] * len(heads)  # text_offset continues across chunks
    if shape.echo:  # echo: the prompt first, as its own chunk per choice
        for head in heads:
            yield f'{head}{_json_str(shape.echo)},"logprobs":null,"finish_reason":null{tail}'.encode()
    async for i, ev, delta in group.events():
        if ev.error:
            yield _sse_error(ev.error)
            break
        reason = group.runs[i].finish_reason if ev.finished else None
        lp = "null"
        if shape.logprobs is not None and shape.texts is not None:
            obj, offsets[i] = completion_logprobs(ev.token_ids, ev.logprobs or [], shape.texts, offsets[i])
            lp = _JSON.encode(obj)
        yield f'{heads[i]}{_json_str(delta)},"logprobs":{lp},"finish_reason":{_reason(reason)}{tail}'.encode()
    if include_usage and not group.error:
        yield _usage_chunk(rid, "text_completion", created, model, group.usage())
    yield b"data: [DONE]\n\n"


async def _sse_chat(run, model: str, include_usage: bool, shape: _Shape | None = None):
    group, shape = _as_group(run), shape or _Shape()
    # tool calls; with n > 1 each choice streams its text
    if len(group.runs) == 1 and getattr(group.runs[0], "tools", None) is not None:
        async for b in _sse_chat_tools(group.runs[0], model, include_usage):
            yield b
        return
    rid, created = f"chatcmpl-{group.req.request_id}", int(time.time())
    # `_sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices":
    # [{"index": i, "delta": d, "logprobs": lp, "finish_reason": reason}]})` with d = {"role":
    # "assistant", "content": delta} in a choice's first chunk, else {"content": delta}: formatted as in
    # _sse_completion, byte for byte.
    heads = [
        f'data: {{"id":{_JSON.encode(rid)},"object":"chat.completion.chunk","created":{created},'
        f'"model":{_JSON.encode(model)},"choices":[{{"index":{i},"delta":{{'
        for i in range(len(group.runs))
    ]
    first = [True] * len(heads)
    async for i, ev, delta in group.events():
        if ev.error:
            yield _sse_error(ev.error)
            break
        role = '"role":"assistant",' if first[i] else ""
        first[i] = False
        reason = group.runs[i].finish_reason if ev.finished else None
        lp = "null"
        if shape.logprobs is not None and shape.texts is not None:
            lp = _JSON.encode(chat_logprobs(ev.token_ids, ev.logprobs or [], shape.texts))
        yield (
            f'{heads[i]}{role}"content":{_json_str(delta)}}},"logprobs":{lp},"finish_reason":{_reason(reason)}}}]}}\n\n'
        ).encode()
    if include_usage and not group.error:
        yield _usage_chunk(rid, "chat.completion.chunk", created, model, group.usage())
    yield b"data: [DONE]\n\n"


async def _ndjson_generate(run, model: str, include_usage: bool, shape: _Shape | None = None):
    group, shape = _as_group(run), shape or _Shape()
    async for _, ev, delta in group.events():
        line = {"text": delta, "token_ids": ev.token_ids, "finished": ev.finished}
        if shape.logprobs is not None:
            line["logprobs"] = _generate_logprobs(ev.logprobs or [])
        if ev.finished:
            line["finish_reason"] = group.runs[0].finish_reason
            line["usage"] = group.usage()
        if ev.error:
            line["error"] = ev.error
        yield (_JSON_NDJSON.encode(line) + "\n").encode()
