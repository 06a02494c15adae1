"""Twenty JSON schemas of varied shape (nested, enums, arrays, anyOf, numbers, booleans, null, const) for
the structured-output tests. Strings, arrays and numbers are bounded so that even the random-weight tiny
model finishes them within a few hundred tokens."""

S = {"type": "string", "maxLength": 6}
I = {"type": "integer", "minimum": 0, "maximum": 999}

SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"name": S}, "required": ["name"], "additionalProperties": False},
    {"type": "object", "properties": {"n": I}, "required": ["n"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": S, "maxItems": 3}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "p": {
                "type": "object",
                "properties": {"x": I, "y": I},
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "required": ["p"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"v": {"anyOf": [I, {"type": "boolean"}]}},
        "required": ["v"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"v": {"anyOf": [{"type": "null"}, S]}},
        "required": ["v"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"kind": {"const": "point"}, "n": I},
        "required": ["kind", "n"],
        "additionalProperties": False,
    },
    {"type": "array", "items": I, "minItems": 1, "maxItems": 4},
    {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 5},
    {
        "type": "object",
        "properties": {"a": {"type": "array", "items": {"type": "array", "items": I, "maxItems": 2}, "maxItems": 2}},
        "required": ["a"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"name": S, "age": I, "admin": {"type": "boolean"}},
                "required": ["name", "age", "admin"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"t": {"type": "integer", "exclusiveMinimum": -3, "exclusiveMaximum": 3}},
        "required": ["t"],
        "additionalProperties": False,
    },
    {"enum": ["yes", "no", "maybe"]},
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"id": I, "label": {"enum": ["x", "y"]}},
                    "required": ["id", "label"],
                    "additionalProperties": False,
                },
                "maxItems": 2,
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "shape": {
                "anyOf": [
                    {"type": "object", "properties": {"r": I}, "required": ["r"], "additionalProperties": False},
                    {
                        "type": "object",
                        "properties": {"w": I, "h": I},
                        "required": ["w", "h"],
                        "additionalProperties": False,
                    },
                ]
            }
        },
        "required": ["shape"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"}},
        "required": ["code"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"a": S, "b": {"type": "integer", "minimum": -5, "maximum": 5}, "c": {"enum": [1, 2, 3]}},
        "required": ["a", "b", "c"],
        "additionalProperties": False,
    },
    {
        "$defs": {"leaf": {"type": "object", "properties": {"v": I}, "required": ["v"], "additionalProperties": False}},
        "type": "object",
        "properties": {"left": {"$ref": "#/$defs/leaf"}, "right": {"$ref": "#/$defs/leaf"}},
        "required": ["left", "right"],
        "additionalProperties": False,
    },
]
