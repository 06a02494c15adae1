"""A finished request's JSON body and a streaming one's SSE/NDJSON chunks (OpenAI completions and chat, /generate).

The per-token chunks are preformatted per request (``docs/ARCHITECTURE.md``, hot paths): byte for byte what
``json.dumps`` of the whole chunk writes (``tests/unit/test_hot_paths.py`` pins that).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from distserve.server.router import protocol, tool_calls
from distserve.server.router.choices import Choices
from distserve.server.router.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from distserve.server.router.run import Run


@dataclass
class Shape:
    """How a response shows its choices: logprobs (None: not asked; k: k alternatives), echo text."""

    logprobs: int | None = None
    texts: TokenTexts | None = None
    echo: str | None = None


async def _sse_chat_tools(run: Run, model: str, include_usage: bool):
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


def _chat_message(run: Run) -> dict:
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


def final_body(kind: str, group: Choices, model: str, shape: Shape | None = None) -> dict:
    shape = shape or Shape()
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


async def sse_completion(run, model: str, include_usage: bool, shape: Shape | None = None):
    group, shape = _as_group(run), shape or Shape()
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


async def sse_chat(run, model: str, include_usage: bool, shape: Shape | None = None):
    group, shape = _as_group(run), shape or Shape()
    # tool calls; with n > 1 each choice streams its text
    if len(group.runs) == 1 and getattr(group.runs[0], "tools", None) is not None:
        async for b in _sse_chat_tools(group.runs[0], model, include_usage):
            yield b
        return
    rid, created = f"chatcmpl-{group.req.request_id}", int(time.time())
    # `_sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices":
    # [{"index": i, "delta": d, "logprobs": lp, "finish_reason": reason}]})` with d = {"role":
    # "assistant", "content": delta} in a choice's first chunk, else {"content": delta}: formatted as in
    # sse_completion, byte for byte.
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


async def ndjson_generate(run, model: str, include_usage: bool, shape: Shape | None = None):
    group, shape = _as_group(run), shape or Shape()
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
