"""vLLM's /tokenize and /detokenize: a prompt (or chat messages) as the served model's token ids, and back."""

from __future__ import annotations

from fastapi import APIRouter, Request

from distserve.server.engine.chat_template import ChatTemplateError
from distserve.server.router import prompts, protocol
from distserve.server.router.body import json_body
from distserve.server.router.protocol import InvalidRequest
from distserve.server.router.state import router_state

router = APIRouter()


@router.post("/tokenize")
async def tokenize(request: Request):
    """vLLM's shape: ``{prompt, add_special_tokens}`` or ``{messages, add_generation_prompt}`` →
    ``{count, max_model_len, tokens}``."""
    state = router_state(request)
    body = await json_body(request)
    req = protocol.parse_tokenize(body)
    state.check_model(req.model)
    state.running_pipeline().check_available()
    await prompts.tokenizer_ready(state)
    tokenizer = state.get_tokenizer()
    if req.messages is not None:
        template = state.get_chat_template()
        try:
            text = template.render(
                protocol.template_messages(req.messages, template.source),
                add_generation_prompt=req.add_generation_prompt,
            )
        except ChatTemplateError as e:
            raise InvalidRequest(f"messages: {e}", "messages") from None
        ids = await prompts.tokenize(state, text, "messages", add_bos=tokenizer.chat_template is None)
    else:
        ids = await prompts.tokenize(state, req.prompt or "", add_bos=req.add_special_tokens)
    out: dict = {"count": len(ids), "max_model_len": state.max_seq_len(), "tokens": ids}
    if req.return_token_strs:
        out["token_strs"] = [tokenizer.id_to_token(t) for t in ids]
    return out


@router.post("/detokenize")
async def detokenize(request: Request):
    """vLLM's shape: ``{tokens}`` → ``{prompt}``."""
    state = router_state(request)
    body = await json_body(request)
    req = protocol.parse_detokenize(body)
    state.check_model(req.model)
    state.running_pipeline().check_available()
    await prompts.tokenizer_ready(state)
    vocab = prompts.vocab_size(state)
    if vocab is not None and any(not 0 <= t < vocab for t in req.tokens):
        raise InvalidRequest(f"tokens: token ids must be in [0, {vocab})", "tokens")
    return {"prompt": state.get_tokenizer().decode(req.tokens)}
