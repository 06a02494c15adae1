"""A request's output constraint (``response_format``, vLLM's ``structured_outputs``) → the grammar workers apply.

The constraint is validated here, before any worker sees it: an uncompilable schema, regex or
grammar is a 400 naming the field. Validation runs off the event loop and its verdicts are cached
by the constraint's text (``GrammarCheck``, one per router), so a client repeating a schema pays once.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict

from distserve.server.engine.structured.grammar import Constraint, GrammarError, validate
from distserve.server.router.protocol import InvalidRequest
from distserve.server.wire import StructuredConstraint

_JSON_OBJECT = json.dumps({"type": "object"})
_JSON_SCHEMA_KEYS = frozenset({"name", "description", "schema", "strict"})  # OpenAI's json_schema object


def constraint_for(req) -> tuple[StructuredConstraint, str] | None:
    """(constraint, the request field it came from) or None for free text."""
    rf, so = getattr(req, "response_format", None), getattr(req, "structured_outputs", None)
    if rf is not None and rf.type != "text" and so is not None:
        raise InvalidRequest("structured_outputs: cannot be combined with response_format", "structured_outputs")
    if rf is not None and rf.type == "json_object":
        return StructuredConstraint(kind="json", text=_JSON_OBJECT), "response_format"
    if rf is not None and rf.type == "json_schema":
        js = rf.json_schema
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
            raise InvalidRequest(
                "response_format.json_schema: must be an object with a `schema` object", "response_format.json_schema"
            )
        unknown = sorted(set(js) - _JSON_SCHEMA_KEYS)
        if unknown:
            raise InvalidRequest(
                f"response_format.json_schema.{unknown[0]}: unknown field (the keys are name, description, schema, "
                "strict)",
                "response_format.json_schema",
            )
        if "name" in js and not isinstance(js["name"], str):
            raise InvalidRequest("response_format.json_schema.name: must be a string", "response_format.json_schema")
        strict = js.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidRequest("response_format.json_schema.strict: must be a boolean", "response_format.json_schema")
        schema = js.get("schema") or {}
        return StructuredConstraint(kind="json", text=json.dumps(schema), strict=bool(strict)), (
            "response_format.json_schema"
        )
    if rf is not None and rf.json_schema is not None:
        raise InvalidRequest("response_format.json_schema: only with type json_schema", "response_format.json_schema")
    if so is None:
        return None
    if so.whitespace_pattern is not None:
        raise InvalidRequest(
            "structured_outputs.whitespace_pattern: not supported", "structured_outputs.whitespace_pattern"
        )
    given = [
        k for k in ("json", "regex", "choice", "grammar", "json_object") if getattr(so, _attr(k)) not in (None, False)
    ]
    if len(given) != 1:
        raise InvalidRequest(
            "structured_outputs: give exactly one of json, regex, choice, grammar, json_object", "structured_outputs"
        )
    kind = given[0]
    field = f"structured_outputs.{kind}"
    if kind == "json_object":
        return StructuredConstraint(kind="json", text=_JSON_OBJECT), field
    if kind == "json":
        value = so.json_
        return StructuredConstraint(kind="json", text=value if isinstance(value, str) else json.dumps(value)), field
    if kind == "choice":
        return StructuredConstraint(kind="choice", text=json.dumps(so.choice)), field
    if kind == "regex":
        return StructuredConstraint(kind="regex", text=so.regex), field
    return StructuredConstraint(kind="grammar", text=so.grammar), field


def _attr(k: str) -> str:
    return "json_" if k == "json" else k


class GrammarCheck:
    """Validated constraints, cached (least recently used dropped): text → None (compiles) or the error."""

    def __init__(self, size: int = 512) -> None:
        self._size = size
        self._verdicts: OrderedDict[tuple[str, str, bool], str | None] = OrderedDict()
        self._lock = threading.Lock()

    def _check(self, c: StructuredConstraint) -> str | None:
        key = (c.kind, c.text, c.strict)
        with self._lock:
            if key in self._verdicts:
                self._verdicts.move_to_end(key)
                return self._verdicts[key]
        try:
            validate(Constraint(c.kind, c.text, c.strict))
            verdict = None
        except GrammarError as e:
            verdict = str(e) or "does not compile"
        with self._lock:
            self._verdicts[key] = verdict
            while len(self._verdicts) > self._size:
                self._verdicts.popitem(last=False)
        return verdict

    async def check(self, c: StructuredConstraint, field: str) -> None:
        """InvalidRequest naming ``field`` when ``c`` does not compile (validated off the event loop)."""
        error = await asyncio.to_thread(self._check, c)
        if error is not None:
            raise InvalidRequest(f"{field}: the grammar engine cannot compile it: {error}", field.split(".")[0])
