"""Token logprobs (``server/wire.TokenLogprob``) in OpenAI's two response shapes.

- completions (``logprobs: k``): ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``,
  ``top_logprobs`` a ``{token text: logprob}`` per token holding the k most likely and the sampled token
  (OpenAI: "up to logprobs + 1 elements"); ``text_offset`` the character offset of each token in the
  choice's text (continued across stream chunks);
- chat (``logprobs: true, top_logprobs: k``): ``{"content": [{"token", "logprob", "bytes",
  "top_logprobs": [{"token", "logprob", "bytes"}] * k}], "refusal": null}``.

A token's text is the tokenizer's decoding of that id alone (a byte-level piece of a multi-byte character
shows as U+FFFD). ``bytes`` in the chat shape are the token's own bytes (OpenAI: "useful when characters are
represented by multiple tokens and their byte representations must be combined"): the UTF-8 of its text,
except for a piece of a character, whose bytes come from the tokenizer's byte table.
"""

from __future__ import annotations

from distserve.server.engine.tokenizer import Tokenizer
from distserve.server.wire import TokenLogprob


class TokenTexts:
    """Token id → text, memoised per request (a stream repeats ids)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def token_bytes(self, token_id: int) -> list[int]:
        """OpenAI's ``bytes`` of a token: its text's UTF-8, or its raw bytes when the text is a U+FFFD stand-in."""
        found = self._bytes.get(token_id)
        if found is None:
            text = self(token_id)
            raw = self._tokenizer.token_bytes(token_id) if "\ufffd" in text else None
            found = self._bytes[token_id] = list(raw if raw is not None else text.encode("utf-8"))
        return found


def completion_logprobs(
    token_ids: list[int], logprobs: list[TokenLogprob], texts: TokenTexts, offset: int = 0
) -> tuple[dict, int]:
    """The completions shape for these tokens, and the text offset after them."""
    tokens, offsets, top = [], [], []
    for tid, lp in zip(token_ids, logprobs):
        t = texts(tid)
        tokens.append(t)
        offsets.append(offset)
        offset += len(t)
        alts = {texts(a): v for a, v in lp.top}
        alts.setdefault(t, lp.logprob)
        top.append(alts)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": top,
        "text_offset": offsets,
    }, offset


def _entry(texts: TokenTexts, token_id: int, logprob: float) -> dict:
    return {"token": texts(token_id), "logprob": logprob, "bytes": texts.token_bytes(token_id)}


def chat_logprobs(token_ids: list[int], logprobs: list[TokenLogprob], texts: TokenTexts) -> dict:
    content = []
    for tid, lp in zip(token_ids, logprobs):
        e = _entry(texts, tid, lp.logprob)
        e["top_logprobs"] = [_entry(texts, a, v) for a, v in lp.top]
        content.append(e)
    return {"content": content, "refusal": None}


def mean_logprob(logprobs: list[TokenLogprob]) -> float:
    """best_of's score: the log probability per token (OpenAI's wording)."""
    return sum(lp.logprob for lp in logprobs) / len(logprobs) if logprobs else float("-inf")
