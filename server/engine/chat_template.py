"""Render chat messages with the model's own Jinja chat template, as ``transformers`` does.

Templates come from the model (``tokenizer_config.json``'s ``chat_template``,
``chat_template.jinja``, or a GGUF's ``tokenizer.chat_template``) and are
untrusted code: they run in jinja2's ``ImmutableSandboxedEnvironment`` with
exactly transformers' settings (``trim_blocks``, ``lstrip_blocks``, the
``loopcontrols`` extension, ``raise_exception``, ``tojson``, ``strftime_now``)
so the rendered text, and therefore the prompt tokens, equal
``tokenizer.apply_chat_template(messages, add_generation_prompt=True,
tokenize=False)``. A model without a template gets ``PLAIN_TEMPLATE``.

``end_of_turn_ids`` names the tokens that end an assistant turn, so a chat
request stops there even when the model's eos is another token (ChatML's
``<|im_end|>`` next to ``<|endoftext|>``, Llama 3's ``<|eot_id|>``).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from distserve.server.engine.tokenizer import Tokenizer

# Used only when the model has no template of its own.
PLAIN_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>")


class ChatTemplateError(ValueError):
    """The template refused the messages (``raise_exception``) or failed to render."""


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """One compiled template plus the special-token strings it may refer to."""

    def __init__(self, source: str, special_tokens: dict[str, str | None] | None = None) -> None:
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"the model's chat template does not compile: {e}") from None
        self.source = source
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer) -> ChatTemplate:
        def content(token_id: int | None) -> str | None:
            return tokenizer.id_to_token(token_id) if token_id is not None else None

        specials = {"bos_token": content(tokenizer.bos_token_id), "eos_token": content(tokenizer.eos_token_id)}
        return cls(tokenizer.chat_template or PLAIN_TEMPLATE, specials)

    def render(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> str:
        """``tools``: OpenAI's tool list, passed to the template as transformers passes ``tools=``."""
        from jinja2 import TemplateError

        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                documents=None,
                **self.special_tokens,
            )
        except TemplateError as e:
            raise ChatTemplateError(f"the model's chat template rejected the messages: {e}") from None


def end_of_turn_ids(tokenizer: Tokenizer, template: ChatTemplate) -> list[int]:
    """eos ids plus the end-of-turn tokens the template writes (and the vocabulary has)."""
    ids = list(tokenizer.eos_token_ids)
    for tok in _END_OF_TURN_TOKENS:
        if tok in template.source:
            tid = tokenizer.token_to_id(tok)
            if tid is not None and tid not in ids:
                ids.append(tid)
    return ids
