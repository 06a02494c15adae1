"""Which request fields of the OpenAI API this server honours, and why it refuses the others.

A field is either declared on the request's pydantic model (``protocol.py``) — then it is
honoured — or named here with the reason it is refused, or unknown. Refused and unknown fields
are a 400 naming them (``router.allow_unknown_fields: true`` lets *unknown* ones through, for
clients that send vendor extras; a refused field is refused either way, since its sender expects
a behaviour we do not have). docs/OPENAI_COMPAT.md lists every field with the test that says so.
"""

from __future__ import annotations

# OpenAI (and vLLM) request fields this server knows and refuses, with the sentence sent back.
REFUSED: dict[str, str] = {
    # OpenAI platform features a self-hosted server does not have
    "suffix": "insertion (suffix) is not supported",
    "store": "stored completions are not supported",
    "metadata": "metadata is only for stored completions, which are not supported",
    "audio": "audio output is not supported (text only)",
    "prediction": "predicted outputs are not supported",
    "reasoning_effort": "this model has no reasoning-effort setting",
    "verbosity": "this model has no verbosity setting",
    "web_search_options": "web search is not supported",
    "functions": "the deprecated `functions` field is not supported; send `tools`",
    "function_call": "the deprecated `function_call` field is not supported; send `tool_choice`",
    # vLLM's older spellings of structured outputs
    "guided_json": "use structured_outputs.json (or response_format)",
    "guided_regex": "use structured_outputs.regex",
    "guided_choice": "use structured_outputs.choice",
    "guided_grammar": "use structured_outputs.grammar",
    "guided_decoding_backend": "the grammar engine is llguidance; it is not chosen per request",
}


def refused_field(body: dict, declared: set[str], allow_unknown: bool) -> tuple[str, str] | None:
    """(field, sentence) for the first refused (or, unless allowed, unknown) top-level field, else None."""
    for name in body:
        if name in declared:
            continue
        if name in REFUSED:
            return name, f"{name}: {REFUSED[name]}"
        if not allow_unknown:
            return name, f"{name}: unknown field (router.allow_unknown_fields: true ignores unknown fields)"
    return None
