"""A request's prompt as token ids: bounded before tokenizing, tokenized off the event loop when large, ids checked
against the workers' vocabulary and the served length."""

from __future__ import annotations

import asyncio

from distserve.server.router.protocol import InvalidRequest
from distserve.server.router.state import RouterState

TOKENIZE_INLINE_CHARS = 16 << 10  # larger texts are tokenized off the event loop


async def tokenizer_ready(state: RouterState) -> None:
    """Load the tokenizer off the event loop (a GGUF vocabulary takes seconds on a busy CPU: heartbeats
    and other requests must not wait for it)."""
    if state.tokenizer is None:
        await asyncio.to_thread(state.get_tokenizer)


async def tokenize(state: RouterState, text: str, field: str = "prompt", **kw) -> list[int]:
    limit = state.max_prompt_chars()
    if len(text) > limit:  # checked before tokenizing: a huge text must not cost tokenizer time
        raise InvalidRequest(
            f"{field}: {len(text)} characters is more than this server accepts ({limit}; router.max_prompt_chars)",
            field,
        )
    await tokenizer_ready(state)
    tokenizer = state.get_tokenizer()  # NoWorkersError (no model known yet) -> 503
    if len(text) <= TOKENIZE_INLINE_CHARS:
        return tokenizer.encode(text, **kw)
    return await asyncio.to_thread(lambda: tokenizer.encode(text, **kw))


def check_prompt_fits(state: RouterState, prompt_ids: list[int], max_tokens: int) -> None:
    """A batched request's other prompts: the length checks the first one had."""
    max_len = state.max_seq_len()
    if len(prompt_ids) + max_tokens > max_len:
        raise InvalidRequest(
            f"prompt: a prompt of {len(prompt_ids)} tokens + max_tokens ({max_tokens}) exceeds max_seq_len ({max_len})",
            "prompt",
        )


def vocab_size(state: RouterState) -> int | None:
    # every worker shares one fingerprint (registration enforces it), so any one tells the vocabulary
    first = next(iter(state.registry.workers.values()), None)
    return first.fingerprint.get("vocab_size") if first else None


def check_ids(state: RouterState, ids: list[int] | None) -> list[int]:
    if not ids:
        raise InvalidRequest("prompt: must not be empty", "prompt")
    vocab = vocab_size(state)
    if vocab is not None and any(not 0 <= t < vocab for t in ids):
        raise InvalidRequest(f"prompt: token ids must be in [0, {vocab})", "prompt")
    return ids


def single_prompt(prompt):
    """The one prompt of a completions request (a list of one prompt is that prompt)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
        return prompt[0]
    return prompt


async def prompt_ids(state: RouterState, prompt) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequest("prompt: must not be empty", "prompt")
        return await tokenize(state, prompt)
    return check_ids(state, list(prompt))
