"""OpenAI-compatible request schemas and their validation.

Every rejection is an ``InvalidRequest`` carrying a sentence that names the
field; the app turns it into HTTP 400 with OpenAI's error shape. Fields we do
not implement are accepted only at their neutral value (e.g.
``presence_penalty: 0``) so a client never silently gets something other than
what it asked for; fields the models do not declare are refused by name
(``openai_fields.py``; ``router.allow_unknown_fields`` lets unknown ones through).
"""

from __future__ import annotations

import json
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, ValidationError

from distserve.server.router.openai_fields import refused_field

MAX_STOP_CHARS = 1024  # per stop string; the assembler scans each one at every token
MAX_BATCH_PROMPTS = 256  # prompts in one batched completions request
MAX_CHOICES = 16  # n and best_of: each choice is a request of its own on the workers
MAX_LOGPROBS = 20  # top_logprobs / completions logprobs (OpenAI's bound)
MAX_LOGIT_BIAS = 300  # entries (OpenAI's own limit)


class InvalidRequest(ValueError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def check_unicode(obj: Any, path: str = "") -> None:
    """Reject text that is not valid Unicode (a lone surrogate such as "\\ud800", which JSON can
    spell but UTF-8 cannot), naming the field, before any of it reaches a tokenizer."""
    if isinstance(obj, str):
        if not obj.isascii():
            try:
                obj.encode("utf-8")
            except UnicodeEncodeError:
                field = path or "body"
                raise InvalidRequest(
                    f"{field}: contains an unpaired surrogate (not valid Unicode text)", field.split(".")[0]
                ) from None
    elif isinstance(obj, dict):
        for k, v in obj.items():
            check_unicode(k, path)
            check_unicode(v, f"{path}.{k}" if path else str(k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            check_unicode(v, f"{path}.{i}" if path else str(i))


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM's; only False (the default) is accepted

    def check(self) -> None:
        if self.continuous_usage_stats:
            raise InvalidRequest(
                "stream_options.continuous_usage_stats: not supported", "stream_options.continuous_usage_stats"
            )


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``text``, ``json_object`` or ``json_schema`` ({name, schema, strict})."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of json / regex / choice / grammar."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = None
    json_object: StrictBool | None = None
    whitespace_pattern: str | None = None  # refused when set (see structured_spec)


# Strict where a lenient parse would change meaning: `max_tokens: true` is not 1, `stream: "yes"` is not a
# boolean, `temperature: true` is not 1.0 and `"0.5"` is a string. Numbers that are floats in OpenAI's API
# accept integers (1 means 1.0): StrictFloat does.
class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: StrictFloat = Field(default=1.0, ge=0.0, le=2.0)
    top_p: StrictFloat = Field(default=1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(default=-1, ge=-1)
    seed: StrictInt | None = Field(default=None, ge=-(2**63), lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = Field(default=None, max_length=256)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    n: StrictInt = Field(default=1, ge=1, le=MAX_CHOICES)
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # completions' and /generate's form
    presence_penalty: StrictFloat = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: StrictFloat = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: StrictFloat = Field(default=1.0, gt=0.0, le=10.0)
    min_p: StrictFloat = Field(default=0.0, ge=0.0, le=1.0)
    logit_bias: dict[str, StrictFloat] | None = None
    user: str | None = None  # an end-user id (abuse monitoring): accepted, no effect on the output by design
    safety_identifier: str | None = None  # OpenAI's newer spelling of `user`
    prompt_cache_key: str | None = None  # a cache-routing hint: the prefix cache needs none
    service_tier: Literal["auto", "default"] | None = None  # one tier here
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    def logprobs_k(self) -> int | None:
        """How many most-likely alternatives per token the client asked for (None: no logprobs)."""
        return self.logprobs

    def max_tokens_field(self) -> str:
        """The name under which the client sent the answer's token cap (for the errors that name it)."""
        return "max_tokens"

    def logit_bias_items(self) -> list[tuple[int, float]]:
        """``logit_bias`` as (token id, bias), checked; ids against the vocabulary by the caller."""
        items = []
        for key, bias in (self.logit_bias or {}).items():
            if key.startswith("-") and key[1:].isascii() and key[1:].isdigit():
                raise InvalidRequest(f"logit_bias: token id {key} must be >= 0", "logit_bias")
            if not (key.isascii() and key.isdigit()):  # int() would also read "1_0", "+5", " 5" and other digits
                raise InvalidRequest(f"logit_bias: key {key!r} is not a token id", "logit_bias")
            tok = int(key)
            if not -100.0 <= bias <= 100.0:
                raise InvalidRequest(f"logit_bias: the bias of token {tok} must be in [-100, 100]", "logit_bias")
            items.append((tok, float(bias)))
        return items

    def neutral_checks(self) -> None:
        if self.stream_options is not None:
            if not self.stream:
                raise InvalidRequest("stream_options: only allowed when stream is true", "stream_options")
            self.stream_options.check()
        if self.logit_bias is not None and len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequest(f"logit_bias: at most {MAX_LOGIT_BIAS} entries", "logit_bias")
        self.logit_bias_items()
        stops = self.stop_strings()
        if any(not s for s in stops):
            raise InvalidRequest("stop: stop strings must be non-empty", "stop")
        if len(stops) > 16:
            raise InvalidRequest("stop: at most 16 stop strings", "stop")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise InvalidRequest(f"stop: each stop string must be at most {MAX_STOP_CHARS} characters", "stop")
        if any(t < 0 for t in self.stop_token_ids or ()):
            raise InvalidRequest("stop_token_ids: token ids must be >= 0", "stop_token_ids")

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_SamplingFields):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    echo: StrictBool = False
    best_of: StrictInt | None = Field(default=None, ge=1, le=MAX_CHOICES)

    def neutral_checks(self) -> None:
        super().neutral_checks()
        if self.best_of is not None and self.best_of < self.n:
            raise InvalidRequest(f"best_of: must be >= n ({self.n})", "best_of")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise InvalidRequest("best_of: cannot be used with stream (OpenAI's rule)", "best_of")
        if self.echo and self.logprobs is not None:
            raise InvalidRequest(
                "echo: echo together with logprobs (the prompt's logprobs) is not supported; "
                "drop one of echo or logprobs",
                "echo",
            )

    def prompts(self) -> list[str | list[int]]:
        """The prompts of a batched request (a list of strings or of token-id lists), or the one prompt."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (list, str)):
            if len(p) > MAX_BATCH_PROMPTS:
                raise InvalidRequest(f"prompt: at most {MAX_BATCH_PROMPTS} prompts per request", "prompt")
            return list(p)
        return [p]  # type: ignore[list-item]


class ToolCallFunction(BaseModel):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(BaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for p in self.content:
            if p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise InvalidRequest("messages: only text content parts are supported", "messages")
            parts.append(p["text"])
        return "".join(parts)

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates see it (transformers' shape): ``{"role", "content"}`` with the
        content as text, plus ``tool_calls`` (arguments as objects), ``tool_call_id`` and ``name`` when set."""
        d: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            d["name"] = self.name
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            calls = []
            for c in self.tool_calls:
                args: Any = c.function.arguments
                if isinstance(args, str):
                    try:
                        args = json.loads(args)
                    except ValueError:
                        args = None
                if not isinstance(args, dict):
                    raise InvalidRequest("messages: tool_calls[].function.arguments must be a JSON object", "messages")
                calls.append({"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": args}})
            d["tool_calls"] = calls
        return d


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class NamedToolChoiceFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedToolChoiceFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    modalities: list[Literal["text"]] | None = None  # text is the only output modality

    logprobs: StrictBool | None = None  # chat's form: a flag plus top_logprobs
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def neutral_checks(self) -> None:
        super().neutral_checks()
        if self.max_completion_tokens is not None and self.max_tokens not in (None, self.max_completion_tokens):
            raise InvalidRequest(
                f"max_completion_tokens: {self.max_completion_tokens} and max_tokens: {self.max_tokens} are two "
                "different caps; send one (max_tokens is OpenAI's deprecated name for max_completion_tokens)",
                "max_completion_tokens",
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs: needs logprobs set to true", "top_logprobs")
        if self.tool_choice is not None and not self.tools:
            raise InvalidRequest("tool_choice: only allowed when tools are given", "tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = {t.function.name for t in self.tools or ()}
            if self.tool_choice.function.name not in names:
                raise InvalidRequest(
                    f"tool_choice: names function {self.tool_choice.function.name!r}, which is not in tools",
                    "tool_choice",
                )
        if self.tools and self.tool_choice not in (None, "none") and (self.response_format or self.structured_outputs):
            raise InvalidRequest(
                "tool_choice: tools cannot be combined with response_format or structured_outputs", "tool_choice"
            )
        if self.tools and len({t.function.name for t in self.tools}) != len(self.tools):
            raise InvalidRequest("tools: function names must be unique", "tools")


class GenerateRequest(_SamplingFields):
    """The seed article's ``POST /generate``: prompt text or ids, NDJSON when streaming."""

    prompt: str | None = None
    prompt_token_ids: list[StrictInt] | None = None


RequestT = TypeVar("RequestT", bound=_SamplingFields)


def declared_fields(model: type[BaseModel]) -> set[str]:
    """The top-level request fields ``model`` reads (by their JSON names)."""
    return {f.alias or name for name, f in model.model_fields.items()}


# pydantic's names for the members of a union in an error's location (`str`, `list[str]`,
# `literal['none','auto','required']`, `NamedToolChoice`): not fields, so not part of the field's name
_BUILTIN_TAGS = frozenset({"str", "int", "float", "bool", "none", "list", "dict"})


def _field_path(loc: tuple) -> str:
    """An error location as the request's field (``messages.content``), without list indexes, dict keys
    or union-member names."""
    parts = [p for p in loc if isinstance(p, str) and p not in _BUILTIN_TAGS and p.isidentifier() and p[:1].islower()]
    return ".".join(parts) or "body"


def parse(model: type[RequestT], body: Any, allow_unknown_fields: bool = False) -> RequestT:
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    declared = declared_fields(model)
    refused = refused_field(body, declared, allow_unknown_fields)
    if refused is not None:
        raise InvalidRequest(refused[1], refused[0])
    # OpenAI's optional fields are "X or null": null is the field left out (its default), not a wrong type
    body = {k: v for k, v in body.items() if not (v is None and k in declared)}
    try:
        req = model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        field = _field_path(err["loc"])
        # pydantic reports every union member; keep the first, human sentence
        raise InvalidRequest(f"{field}: {err['msg']}", field) from None
    req.neutral_checks()
    return req


class TokenizeRequest(BaseModel):
    """vLLM's ``/tokenize``: a ``prompt`` (completions) or ``messages`` (chat, rendered with the template)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[StrictInt] = Field(max_length=1 << 20)


def _parse_plain(model: type[BaseModel], body: Any) -> Any:
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        field = _field_path(err["loc"])
        msg = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
        raise InvalidRequest(f"{field}: {msg}", field) from None


def parse_tokenize(body: Any) -> TokenizeRequest:
    req = _parse_plain(TokenizeRequest, body)
    if (req.prompt is None) == (req.messages is None):
        raise InvalidRequest("prompt: give exactly one of prompt or messages", "prompt")
    return req


def parse_detokenize(body: Any) -> DetokenizeRequest:
    return _parse_plain(DetokenizeRequest, body)


def template_messages(messages: list[ChatMessage], template_source: str) -> list[dict[str, Any]]:
    """The messages as the chat template ``template_source`` sees them. OpenAI's ``developer`` role is its
    newer name for ``system``: a template that never names ``developer`` gets a ``system`` turn instead
    (rendered as-is, it would add its own default system prompt and an unknown turn, or refuse the role)."""
    out = [m.template_dict() for m in messages]
    if "developer" not in template_source:
        for d in out:
            if d["role"] == "developer":
                d["role"] = "system"
    return out


def render_chat(messages: list[ChatMessage]) -> str:
    """The plain chat format used when a model has no chat template of its own."""
    out = [f"<|{m.role}|>\n{m.text()}\n" for m in messages]
    out.append("<|assistant|>\n")
    return "".join(out)
