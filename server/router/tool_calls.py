"""Tool calls: what the template sees, the grammar for ``required``/named, and the parsers for ``auto``.

- ``tool_choice: none`` (or no tools): plain chat; the template still sees ``tools`` (as OpenAI's
  model does), and the output is never parsed.
- ``required``: the output is constrained to a JSON array of ``{"name", "parameters"}`` objects, one
  ``anyOf`` branch per tool (one item when ``parallel_tool_calls`` is false); named: to the named
  function's ``parameters`` schema, the output being the arguments themselves.
- ``auto``: free text, parsed by the parser of the template's family (``parser_for``): Hermes/Qwen
  ``<tool_call>{...}</tool_call>``, Mistral ``[TOOL_CALLS][...]``, Llama 3 JSON
  (``{"name", "parameters"}``, optionally after ``<|python_tag|>``).

Templates that ignore ``tools`` (SmolLM2's, for one) get the tools described in a system message in
the Hermes format, so the model is told about them either way (``describe_tools``).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from distserve.server.wire import StructuredConstraint

HERMES, MISTRAL, LLAMA3 = "hermes", "mistral", "llama3_json"


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parser_for(template_source: str) -> str:
    """The tool-call format a chat template teaches its model."""
    if "[TOOL_CALLS]" in template_source:
        return MISTRAL
    if "<tool_call>" in template_source:
        return HERMES  # Hermes, Qwen 2.5/3
    if "<|python_tag|>" in template_source or ("<|eot_id|>" in template_source and "parameters" in template_source):
        return LLAMA3
    return HERMES  # also the format describe_tools teaches


def describe_tools(tools: list[dict]) -> str:
    """A Hermes-style system text for templates that do not render ``tools`` themselves."""
    lines = [
        "You are a function calling AI model. You may call one or more functions to assist with the user query.",
        "Here are the available tools: <tools>",
        *(json.dumps(t, ensure_ascii=False) for t in tools),
        "</tools>",
        "For each function call, return a JSON object with the function name and arguments within "
        "<tool_call></tool_call> tags:",
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>',
    ]
    return "\n".join(lines)


def with_tools_described(messages: list[dict], tools: list[dict]) -> list[dict]:
    text = describe_tools(tools)
    if messages and messages[0]["role"] in ("system", "developer"):
        first = dict(messages[0], content=f"{messages[0]['content']}\n\n{text}")
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _params_schema(tool) -> dict:
    return tool.function.parameters or {"type": "object", "properties": {}}


def constraint(req) -> StructuredConstraint | None:
    """The grammar of ``required`` and named tool choices; None for ``auto``/``none``."""
    choice = req.tool_choice
    if not req.tools or choice in (None, "auto", "none"):
        return None
    if choice == "required":
        items = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": t.function.name}, "parameters": _params_schema(t)},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for t in req.tools
            ]
        }
        schema: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
        if not req.parallel_tool_calls:
            schema["maxItems"] = 1
        return StructuredConstraint(kind="json", text=json.dumps(schema))
    tool = next(t for t in req.tools if t.function.name == choice.function.name)
    return StructuredConstraint(kind="json", text=json.dumps(_params_schema(tool)), strict=bool(tool.function.strict))


def mode(req) -> str | None:
    """None (no tool handling), "auto", "required" or "named"."""
    if not req.tools or req.tool_choice == "none":
        return None
    if req.tool_choice in (None, "auto"):
        return "auto"
    return "required" if req.tool_choice == "required" else "named"


def parse_constrained(text: str, req) -> list[ParsedCall]:
    """The calls of a ``required``/named answer (its text follows the grammar of ``constraint``)."""
    if mode(req) == "named":
        return [ParsedCall(req.tool_choice.function.name, text.strip())]
    try:
        items = json.loads(text)
    except ValueError:
        return []
    return [
        ParsedCall(it["name"], json.dumps(it.get("parameters", {}), ensure_ascii=False))
        for it in items
        if isinstance(it, dict) and isinstance(it.get("name"), str)
    ]


def _call(obj: Any, names: set[str]) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if names and obj["name"] not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _json_values(text: str) -> list[Any]:
    """Consecutive JSON values in ``text`` (separated by whitespace, ``;`` or ``,``); stops at the first non-JSON."""
    dec, i = json.JSONDecoder(), 0
    out: list[Any] = []
    while True:
        while i < len(text) and text[i] in " \t\r\n;,":
            i += 1
        if i >= len(text):
            return out
        try:
            value, i = dec.raw_decode(text, i)
        except ValueError:
            return out
        out.append(value)


_HERMES_RE = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def parse_auto(text: str, family: str, tool_names: set[str]) -> tuple[str, list[ParsedCall]]:
    """(content, calls) from a model's free answer; no calls: the whole text is content."""
    if family == MISTRAL and "[TOOL_CALLS]" in text:
        content, _, rest = text.partition("[TOOL_CALLS]")
        calls: list[ParsedCall] = []
        if "[ARGS]" in rest:  # newer Mistral: [TOOL_CALLS]name[ARGS]{...}
            for part in rest.split("[TOOL_CALLS]"):
                name, _, args = part.partition("[ARGS]")
                values = _json_values(args)
                c = _call({"name": name.strip(), "arguments": values[0] if values else None}, tool_names)
                if c:
                    calls.append(c)
        else:
            for v in _json_values(rest):
                for obj in v if isinstance(v, list) else [v]:
                    if c := _call(obj, tool_names):
                        calls.append(c)
        if calls:
            return content.strip(), calls
        return text, []
    if family == LLAMA3:
        body = text.strip()
        if body.startswith("<|python_tag|>"):
            body = body[len("<|python_tag|>") :]
        if body.lstrip().startswith("{"):
            calls = [c for v in _json_values(body) if (c := _call(v, tool_names))]
            if calls:
                return "", calls
        return text, []
    matches = list(_HERMES_RE.finditer(text))
    calls = []
    for m in matches:
        values = _json_values(m.group(1))
        if values and (c := _call(values[0], tool_names)):
            calls.append(c)
    if calls:
        return text[: matches[0].start()].strip(), calls
    return text, []


MARKERS = {HERMES: ("<tool_call>",), MISTRAL: ("[TOOL_CALLS]",), LLAMA3: ("<|python_tag|>", "{")}


def safe_content_len(text: str, family: str) -> int:
    """How much of a partial answer can be streamed as content: everything before a tool-call marker,
    or before a suffix that could still become one (Llama 3's ``{`` counts only at the start)."""
    cut = len(text)
    for marker in MARKERS[family]:
        if marker == "{":
            if text.lstrip().startswith("{") or not text.strip():  # all of it may be a call
                cut = 0
            continue
        i = text.find(marker)
        if i >= 0:
            cut = min(cut, i)
            continue
        for k in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:k]):
                cut = min(cut, len(text) - k)
                break
    return cut
