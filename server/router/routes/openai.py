"""OpenAI's completions and chat completions, and the seed's /generate: parse and check a request, render
its prompt, then hand it to the shared serving path (``server/router/serving.py``)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from distserve.server.engine.chat_template import ChatTemplateError, end_of_turn_ids
from distserve.server.router import prompts, protocol, serving, tool_calls
from distserve.server.router.body import json_body
from distserve.server.router.protocol import InvalidRequest
from distserve.server.router.run import ToolContext
from distserve.server.router.state import router_state

router = APIRouter()


@router.post("/v1/completions")
async def completions(request: Request):
    state = router_state(request)
    body = await json_body(request)
    req = protocol.parse(protocol.CompletionRequest, body, state.config.router.allow_unknown_fields)
    state.check_model(req.model)
    if (resp := await serving.via_backup(state, "/v1/completions", body, req)) is not None:
        return resp
    texts = req.prompts()  # a batched request has several: one choice each
    constraint = await serving.output_constraint(state, req)
    await prompts.tokenizer_ready(state)
    if len(texts) > 1:  # a batch: one choice per prompt, in order
        if req.n != 1 or req.best_of not in (None, 1) or req.echo:
            raise InvalidRequest("prompt: a batch of prompts takes neither n, best_of nor echo", "prompt")
        batch = [await prompts.prompt_ids(state, p) for p in texts]
        return await serving.serve(state, request, req, batch[0], "completion", constraint=constraint, batch=batch)
    ids = await prompts.prompt_ids(state, texts[0])
    echo = None
    if req.echo:  # the prompt as the client sent it (text), or the decoding of its ids
        echo = prompts.single_prompt(req.prompt)
        if not isinstance(echo, str):
            echo = state.get_tokenizer().decode(ids)
    return await serving.serve(state, request, req, ids, "completion", echo=echo, constraint=constraint)


@router.post("/v1/chat/completions")
async def chat(request: Request):
    state = router_state(request)
    body = await json_body(request)
    req = protocol.parse(protocol.ChatCompletionRequest, body, state.config.router.allow_unknown_fields)
    state.check_model(req.model)
    if (resp := await serving.via_backup(state, "/v1/chat/completions", body, req)) is not None:
        return resp
    if req.max_completion_tokens is not None and req.max_tokens is None:
        req.max_tokens = req.max_completion_tokens
    state.running_pipeline().check_available()  # 503 before touching the tokenizer when no model is known yet
    await prompts.tokenizer_ready(state)
    tokenizer, template = state.get_tokenizer(), state.get_chat_template()
    messages = protocol.template_messages(req.messages, template.source)
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    if tools and "tools" not in template.source:  # the template ignores tools: describe them ourselves
        messages = tool_calls.with_tools_described(messages, tools)
    try:
        text = template.render(messages, tools=tools)
    except ChatTemplateError as e:
        raise InvalidRequest(f"messages: {e}", "messages") from None
    # the model's template writes its own bos; only the plain fallback needs one added
    ids = await prompts.tokenize(state, text, "messages", add_bos=tokenizer.chat_template is None)
    stop_ids = [] if req.ignore_eos else end_of_turn_ids(tokenizer, template)
    constraint = tool_calls.constraint(req)
    if constraint is not None:
        await state.grammar_check.check(constraint, "tools")
    else:
        constraint = await serving.output_constraint(state, req)
    tool_mode = tool_calls.mode(req)
    tools_ctx = None
    if tool_mode is not None:
        tools_ctx = ToolContext(req, tool_mode, tool_calls.parser_for(template.source), set(stop_ids))
    return await serving.serve(state, request, req, ids, "chat", stop_ids, constraint=constraint, tools=tools_ctx)


@router.post("/generate")
async def generate(request: Request):
    state = router_state(request)
    req = protocol.parse(protocol.GenerateRequest, await json_body(request), state.config.router.allow_unknown_fields)
    state.check_model(req.model)
    if req.n != 1:
        raise InvalidRequest("n: /generate returns one completion; use /v1/completions for n > 1", "n")
    await prompts.tokenizer_ready(state)
    if (req.prompt is None) == (req.prompt_token_ids is None):
        raise InvalidRequest("prompt: give exactly one of prompt or prompt_token_ids", "prompt")
    if req.prompt == "":
        raise InvalidRequest("prompt: must not be empty", "prompt")
    ids = (
        await prompts.tokenize(state, req.prompt)
        if req.prompt is not None
        else prompts.check_ids(state, req.prompt_token_ids)
    )
    return await serving.serve(
        state, request, req, ids, "generate", constraint=await serving.output_constraint(state, req)
    )
