"""Tool-call parsers on recorded outputs of each template family, the streaming hold-back, and the
grammar of `required`/named tool choices."""

from __future__ import annotations

import json

import pytest

from distserve.server.router import tool_calls
from distserve.server.router.protocol import ChatCompletionRequest, InvalidRequest, parse

NAMES = {"get_weather", "get_time"}

# (family, model output as recorded, expected content, expected [(name, arguments)])
RECORDED = [
    (
        tool_calls.HERMES,  # Hermes 2 Pro / Qwen 2.5
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "",
        [("get_weather", {"city": "Paris"})],
    ),
    (
        tool_calls.HERMES,
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>',
        "Let me check.",
        [("get_weather", {"city": "Rome"}), ("get_time", {"tz": "CET"})],
    ),
    (
        tool_calls.HERMES,  # cut by max_tokens before the closing tag
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}',
        "",
        [("get_time", {"tz": "UTC"})],
    ),
    (
        tool_calls.MISTRAL,  # Mistral 7B v0.3
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
        "",
        [("get_weather", {"city": "Oslo"})],
    ),
    (
        tool_calls.MISTRAL,  # newer Mistral templates: name[ARGS]{...}
        '[TOOL_CALLS]get_time[ARGS]{"tz": "PST"}',
        "",
        [("get_time", {"tz": "PST"})],
    ),
    (
        tool_calls.LLAMA3,  # Llama 3.1/3.2 JSON tool calling
        '{"name": "get_weather", "parameters": {"city": "Lima"}}',
        "",
        [("get_weather", {"city": "Lima"})],
    ),
    (
        tool_calls.LLAMA3,
        '<|python_tag|>{"name": "get_time", "parameters": {"tz": "JST"}}; {"name": "get_weather", "parameters": {"city": "Kyoto"}}',
        "",
        [("get_time", {"tz": "JST"}), ("get_weather", {"city": "Kyoto"})],
    ),
]


@pytest.mark.parametrize("family,text,content,calls", RECORDED)
def test_recorded_outputs_parse(family, text, content, calls):
    got_content, got = tool_calls.parse_auto(text, family, NAMES)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert all(c.id.startswith("call_") for c in got)


@pytest.mark.parametrize(
    "family,text",
    [
        (tool_calls.HERMES, "The weather in Paris is sunny."),
        (tool_calls.HERMES, '<tool_call>{"name": "unknown_tool", "arguments": {}}</tool_call>'),
        (tool_calls.MISTRAL, "[TOOL_CALLS] not json"),
        (tool_calls.LLAMA3, '{"answer": 42}'),
        (tool_calls.LLAMA3, 'Sure: {"name": "get_time", "parameters": {}}'),
    ],
)
def test_plain_answers_stay_content(family, text):
    assert tool_calls.parse_auto(text, family, NAMES) == (text, [])


def test_family_is_chosen_from_the_template():
    assert tool_calls.parser_for("{% if tools %}<tool_call>{% endif %}") == tool_calls.HERMES
    assert tool_calls.parser_for("[AVAILABLE_TOOLS] [TOOL_CALLS]") == tool_calls.MISTRAL
    assert tool_calls.parser_for("<|python_tag|> <|eot_id|>") == tool_calls.LLAMA3
    assert tool_calls.parser_for("{{ messages }}") == tool_calls.HERMES


def test_streaming_holds_back_what_could_become_a_marker():
    assert tool_calls.safe_content_len("Hello <tool", tool_calls.HERMES) == len("Hello ")
    assert tool_calls.safe_content_len("Hello <tool_call>{", tool_calls.HERMES) == len("Hello ")
    assert tool_calls.safe_content_len("Hello there", tool_calls.HERMES) == len("Hello there")
    assert tool_calls.safe_content_len('  {"name"', tool_calls.LLAMA3) == 0
    assert tool_calls.safe_content_len("Sure {x}", tool_calls.LLAMA3) == len("Sure {x}")


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}},
    },
]


def _req(**kw) -> ChatCompletionRequest:
    return parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, **kw})


def test_required_grammar_is_an_array_of_known_calls():
    c = tool_calls.constraint(_req(tool_choice="required", parallel_tool_calls=False))
    schema = json.loads(c.text)
    assert schema["minItems"] == 1 and schema["maxItems"] == 1
    assert [b["properties"]["name"]["const"] for b in schema["items"]["anyOf"]] == ["get_weather", "get_time"]
    text = '[{"name": "get_time", "parameters": {"tz": "UTC"}}]'
    calls = tool_calls.parse_constrained(text, _req(tool_choice="required"))
    assert [(x.name, json.loads(x.arguments)) for x in calls] == [("get_time", {"tz": "UTC"})]


def test_named_grammar_is_the_functions_parameters():
    req = _req(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(tool_calls.constraint(req).text) == TOOLS[0]["function"]["parameters"]
    assert tool_calls.constraint(_req(tool_choice="auto")) is None
    assert tool_calls.mode(_req(tool_choice="none")) is None


@pytest.mark.parametrize(
    "body,param",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": TOOLS + TOOLS[:1]}, "tools"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ],
)
def test_bad_tool_requests_name_the_field(body, param):
    with pytest.raises(InvalidRequest) as e:
        _req(**body)
    assert e.value.param == param


def test_tool_messages_reach_the_template_as_transformers_passes_them():
    req = parse(
        ChatCompletionRequest,
        {
            "messages": [
                {"role": "user", "content": "weather?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            ]
        },
    )
    d = [m.template_dict() for m in req.messages]
    assert d[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert d[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
