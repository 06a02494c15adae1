"""A request's output constraint as an llguidance grammar.

``Constraint`` is what travels from the router to the workers (``InternalSampling.structured``):
a kind and its text. ``to_grammar`` is pure (no tokenizer): the router uses it with
``validate`` to refuse a grammar that cannot be compiled (400 naming the field) before any
worker sees it; the workers compile the same grammar against their tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

Kind = Literal["json", "regex", "choice", "grammar"]
KINDS: tuple[str, ...] = ("json", "regex", "choice", "grammar")

# How constrained JSON is written: OpenAI's own separators and no free whitespace. Free whitespace
# ("whitespace_flexible") lets a model pad forever between tokens; these are what models trained on
# JSON write anyway.
JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}

_REGEX_SPECIAL = set("\\.+*?()|[]{}^$#&-~")


class GrammarError(ValueError):
    """The constraint cannot be compiled (the message says why)."""


@dataclass(frozen=True)
class Constraint:
    """``kind`` json (``text`` a JSON schema), regex, choice (``text`` a JSON list of strings) or grammar
    (Lark, or GBNF when it has ``::=``). ``strict`` (json): unsupported schema keywords are an error
    instead of being ignored."""

    kind: str
    text: str
    strict: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError(f"unknown constraint kind {self.kind!r} (one of {', '.join(KINDS)})")


def _escape_regex(s: str) -> str:
    return "".join("\\" + c if c in _REGEX_SPECIAL else c for c in s)


def to_grammar(c: Constraint) -> str:
    """The llguidance grammar (its JSON form) for ``c``; GrammarError when the input is malformed."""
    import llguidance

    if c.kind == "json":
        try:
            schema = json.loads(c.text)
        except ValueError as e:
            raise GrammarError(f"not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise GrammarError("a JSON schema must be an object")
        options = dict(JSON_OPTIONS, lenient=not c.strict)
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)  # type: ignore[arg-type]
        except ValueError as e:
            raise GrammarError(str(e)) from None
    if c.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(c.text)
    if c.kind == "choice":
        choices = json.loads(c.text)
        if not isinstance(choices, list) or not choices or not all(isinstance(x, str) and x for x in choices):
            raise GrammarError("choice must be a non-empty list of non-empty strings")
        return llguidance.LLMatcher.grammar_from_regex("|".join(f"({_escape_regex(x)})" for x in choices))
    text = c.text
    if "::=" in text:  # GBNF (llama.cpp's grammars, which vLLM users send too)
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            text = gbnf_to_lark(text)
        except Exception as e:  # the converter raises plain exceptions on bad input
            raise GrammarError(f"GBNF does not convert: {e}") from None
    return llguidance.LLMatcher.grammar_from_lark(text)


def validate(c: Constraint) -> None:
    """Raise GrammarError when ``c`` does not compile (checked without a tokenizer: milliseconds)."""
    import llguidance

    grammar = to_grammar(c)
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        raise GrammarError(error)
