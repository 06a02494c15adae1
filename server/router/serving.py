"""The serving path shared by completions, chat and /generate: a parsed request's limits and sampling, admission
(or the backup pool), one run per choice through the pipeline, then a JSON body or a stream."""

from __future__ import annotations

import asyncio
import secrets
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from distserve.server.router.admission import InvalidSlo, Ticket, parse_slo
from distserve.server.router.choices import Choices, choice_seed
from distserve.server.router.errors import error, rate_limited
from distserve.server.router.failover import maybe_backup
from distserve.server.router.logprobs import TokenTexts
from distserve.server.router.pipeline import EngineRequest
from distserve.server.router.prompts import check_prompt_fits, vocab_size
from distserve.server.router.protocol import InvalidRequest
from distserve.server.router.run import Run
from distserve.server.router.sampling_defaults import default_sampling
from distserve.server.router.state import RouterState
from distserve.server.router.streaming import Shape, final_body, ndjson_generate, sse_chat, sse_completion
from distserve.server.router.structured_outputs import constraint_for
from distserve.server.router.text import TextAssembler
from distserve.server.wire import InternalSampling


async def via_backup(state: RouterState, path: str, body: dict, req) -> Response | None:
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


async def output_constraint(state: RouterState, req):
    """The request's validated output grammar (InvalidRequest naming the field when it cannot compile)."""
    found = constraint_for(req)
    if found is None:
        return None
    c, where = found
    await state.grammar_check.check(c, where)
    return c


async def admit(
    state: RouterState, request: Request, req, kind: str, n_tokens: int, max_tokens: int = 0, slots: int = 1
) -> tuple[Ticket | None, Response | None]:
    """(ticket, None) when admitted; (None, response) when shed (429 + Retry-After) or served by the backup."""
    adm = state.admission
    if adm is None:
        return None, None
    ac = state.config.router.admission
    try:
        slo = parse_slo(request.headers, ac.slo_ttft_ms, ac.slo_tpot_ms, ac.on_slo_miss)
    except InvalidSlo as e:
        raise InvalidRequest(str(e), e.header) from None
    d = adm.decide(n_tokens, slo)
    if d.route == "primary":
        return adm.admit(n_tokens, d, max_tokens, slots), None
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
    return None, shed(state, d, n_tokens)


def shed(state: RouterState, d, n_tokens: int | None) -> JSONResponse:
    """Admission's refusal ``d`` answered: counted, journaled (``n_tokens`` None: the body was not read) and
    logged at a bounded rate; OpenAI's 429 with Retry-After. Also the early refusal's (early_refusal.py)."""
    assert state.admission is not None
    state.admission.refused(d, n_tokens, "shed")
    state.metrics.requests.labels("rate_limited").inc()
    state.overload_log.warning(f"admission: {d.reason}", "429 (%s): %s", d.reason, d.message)
    return rate_limited(d.message, d.reason, d.retry_after_s)


async def serve(
    state: RouterState,
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
        cap = req.max_tokens_field()  # max_completion_tokens when the client sent that
        raise InvalidRequest(
            f"{cap}: prompt ({len(prompt_ids)} tokens) + {cap} ({max_tokens}) exceeds max_seq_len ({max_len})",
            cap,
        )
    vocab = vocab_size(state)
    if vocab is not None and any(t >= vocab for t in req.stop_token_ids or ()):
        raise InvalidRequest(f"stop_token_ids: token ids must be in [0, {vocab})", "stop_token_ids")
    bias = req.logit_bias_items()
    if vocab is not None and any(t >= vocab for t, _ in bias):
        raise InvalidRequest(f"logit_bias: token ids must be in [0, {vocab})", "logit_bias")
    temperature, top_p = default_sampling(req, state.config.router)
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
    for ids in (batch or [])[1:]:  # every prompt checked before admission: no 400 once a place is taken
        check_prompt_fits(state, ids, max_tokens)
    state.running_pipeline().check_available()  # NoWorkersError -> 503 with Retry-After
    tokenizer = state.get_tokenizer()
    # OpenAI bodies prefix the id themselves (cmpl-, chatcmpl-); /generate's id is "gen-" + hex
    rid = f"{'gen-' if kind == 'generate' else ''}{uuid.uuid4().hex}"
    slots = best_of + (len(batch) - 1 if batch else 0)  # worker requests, each holding a decode slot
    ticket, refusal = await admit(state, request, req, kind, len(prompt_ids), max_tokens, slots)
    if refusal is not None:
        return refusal
    try:
        seed = sampling.seed or 0
        runs = [
            Run(
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
                Run(state, EngineRequest(f"{rid}-p{i}", ids, sampling), TextAssembler(tokenizer, req.stop_strings()))
                for i, ids in enumerate(batch[1:], 1)
            ]
        for r in runs:
            r.tools = tools
        group = Choices(runs, len(runs) if batch is not None else req.n, batched=batch is not None)
        shape = Shape(k, TokenTexts(tokenizer), echo)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            fmt = {"completion": sse_completion, "chat": sse_chat, "generate": ndjson_generate}[kind]
            media = "application/x-ndjson" if kind == "generate" else "text/event-stream"
            return _TicketStream(ticket, fmt(group, state.model_name(), include_usage, shape), media_type=media)
        try:
            await _until_done_or_disconnect(request, group.collect())
        except _ClientGone:
            return JSONResponse({}, status_code=499)
        finally:
            if ticket is not None:
                ticket.done()  # a no-op once the run ended it (with its TPOT); else the place is given back
        if group.error:
            return error(group.error_status, group.error)
        return JSONResponse(final_body(kind, group, state.model_name(), shape))
    except BaseException:
        if ticket is not None:
            ticket.done()  # anything raised once admitted (a cancelled handler too) gives the place back
        raise


class _ClientGone(Exception):
    pass


class _TicketStream(StreamingResponse):
    """A stream that gives its admission place back once the response is over, however it ends: a client that
    leaves before the body's first iteration never starts the run (whose own ``finally`` releases it)."""

    def __init__(self, ticket: Ticket | None, content, media_type: str) -> None:
        super().__init__(content, media_type=media_type)
        self.ticket = ticket

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.ticket is not None:
                self.ticket.done()


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
