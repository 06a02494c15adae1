"""The OpenAI API as clients use it, against real `distserve serve` processes (tiny model, and SmolLM2):
structured outputs through the `openai` client (streaming too), tool calls, batched prompts, errors in
OpenAI's shape, cached-token usage in both modes, the token endpoints, disaggregated == colocated under
constraints, and a table over every request field of the completions and chat references."""

from __future__ import annotations

import json

import jsonschema
import pytest

from distserve.server.router.protocol import ChatCompletionRequest, CompletionRequest, declared_fields
from tests.structured_schemas import SCHEMAS

from .conftest import http
from .test_serving import assert_no_leaks

openai = pytest.importorskip("openai")

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["C", "F"]}},
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"tz": {"enum": ["UTC", "CET"]}},
                "required": ["tz"],
                "additionalProperties": False,
            },
        },
    },
]
MODEL = "tiny-llama-v1"
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def coloc(serve_factory):
    return serve_factory(mode="colocated", decode=1)


@pytest.fixture(scope="module")
def disagg(serve_factory):
    return serve_factory(mode="disaggregated", prefill=1, decode=2)  # two decode workers: a migration target


def client(s) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0)


def post(s, path, body):
    status, data, _ = http("POST", f"{s.url}{path}", body, token=None)
    return status, data


def rf(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


# --- structured outputs ---------------------------------------------------------------------------
@pytest.mark.parametrize("i", [6, 12, 19])
def test_json_schema_answers_validate_streamed_and_not(coloc, i):
    c = client(coloc)
    schema = SCHEMAS[i]
    full = c.chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=200, temperature=0, response_format=rf(schema)
    )
    jsonschema.validate(json.loads(full.choices[0].message.content), schema)
    assert full.choices[0].finish_reason == "stop"
    stream = c.chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=200, temperature=0, response_format=rf(schema), stream=True
    )
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == full.choices[0].message.content


def test_json_object_and_vllm_structured_outputs(coloc):
    c = client(coloc)
    r = c.completions.create(
        model=MODEL, prompt="x", max_tokens=20, extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}}
    )
    assert r.choices[0].text in ("alpha", "beta")
    r = c.completions.create(
        model=MODEL, prompt="x", max_tokens=20, extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}
    )
    assert len(r.choices[0].text) == 6 and r.choices[0].text[3] == "-"
    r = c.completions.create(
        model=MODEL, prompt="x", max_tokens=20, extra_body={"structured_outputs": {"grammar": 'start: "on" | "off"'}}
    )
    assert r.choices[0].text in ("on", "off")
    r = c.completions.create(
        model=MODEL, prompt="x", max_tokens=60, extra_body={"structured_outputs": {"json": SCHEMAS[2]}}
    )
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMAS[2])
    # json_object: the random-weight model may run out of tokens, but what it wrote starts an object
    r = c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=30, response_format={"type": "json_object"})
    assert r.choices[0].message.content.startswith("{")


@pytest.mark.parametrize(
    "body,param",
    [
        ({"response_format": rf({"type": "object", "properties": {"a": {"type": "nope"}}})}, "response_format"),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
    ],
)
def test_uncompilable_grammar_is_400_naming_the_field(coloc, body, param):
    status, data = post(coloc, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 4, **body})
    assert status == 400 and data["error"]["param"] == param, data


def test_constrained_disaggregated_equals_colocated(coloc, disagg):
    for schema, temp in ((SCHEMAS[12], 0.0), (SCHEMAS[15], 1.0)):
        body = {"messages": MSGS, "max_tokens": 200, "temperature": temp, "seed": 11, "response_format": rf(schema)}
        a, b = post(coloc, "/v1/chat/completions", body), post(disagg, "/v1/chat/completions", body)
        assert a[0] == b[0] == 200
        text = a[1]["choices"][0]["message"]["content"]
        assert b[1]["choices"][0]["message"]["content"] == text  # token #1 constrained on the prefill worker too
        jsonschema.validate(json.loads(text), schema)


# --- tools ------------------------------------------------------------------------------------------
def test_required_and_named_tool_calls_have_valid_arguments(coloc):
    c = client(coloc)
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        r = c.chat.completions.create(
            model=MODEL,
            messages=MSGS,
            max_tokens=200,
            tools=TOOLS,
            tool_choice=choice,
            seed=5,
            parallel_tool_calls=False,
        )
        assert r.choices[0].finish_reason == "tool_calls", r
        calls = r.choices[0].message.tool_calls
        assert calls and all(tc.id.startswith("call_") for tc in calls)
        by_name = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        for tc in calls:
            jsonschema.validate(json.loads(tc.function.arguments), by_name[tc.function.name])
        if isinstance(choice, dict):
            assert [tc.function.name for tc in calls] == ["get_time"]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_tool_call_deltas_reassemble_to_the_call(coloc, choice):
    c = client(coloc)
    kw = {"model": MODEL, "messages": MSGS, "max_tokens": 200, "temperature": 0, "tools": TOOLS, "tool_choice": choice}
    kw["parallel_tool_calls"] = False  # greedy on random weights would repeat calls up to max_tokens
    full = c.chat.completions.create(**kw).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for ch in c.chat.completions.create(**kw, stream=True):
        if not ch.choices:
            continue
        finish = ch.choices[0].finish_reason or finish
        for d in ch.choices[0].delta.tool_calls or ():
            entry = calls.setdefault(d.index, {"name": "", "arguments": "", "id": None})
            entry["id"] = d.id or entry["id"]
            if d.function and d.function.name:
                entry["name"] += d.function.name
            if d.function and d.function.arguments:
                entry["arguments"] += d.function.arguments
    assert finish == "tool_calls"
    want = [(tc.function.name, json.loads(tc.function.arguments)) for tc in full.message.tool_calls]
    got = [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)]
    assert got == want and all(calls[i]["id"] for i in calls)


def test_tool_choice_none_and_tool_messages_are_served(coloc):
    msgs = MSGS + [
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]
    status, data = post(
        coloc, "/v1/chat/completions", {"messages": msgs, "tools": TOOLS, "tool_choice": "none", "max_tokens": 4}
    )
    assert status == 200 and data["choices"][0]["message"].get("tool_calls") is None


# --- requests, errors, usage, endpoints --------------------------------------------------------------
def test_batched_prompts_one_choice_each_streamed_and_not(coloc):
    c = client(coloc)
    for prompt in (["Hello", "Good morning", "Hi"], [[1, 40, 41], [1, 50, 51, 52]]):
        kw = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, "extra_body": {"ignore_eos": True}}
        r = c.completions.create(**kw)
        assert [ch.index for ch in r.choices] == list(range(len(prompt)))
        assert r.usage.completion_tokens == 6 * len(prompt)
        singles = [c.completions.create(**{**kw, "prompt": p}) for p in prompt]
        assert [ch.text for ch in r.choices] == [s.choices[0].text for s in singles]
        assert r.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
        texts: dict[int, str] = {}
        usage = None
        for ch in c.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
            for choice in ch.choices:
                texts[choice.index] = texts.get(choice.index, "") + choice.text
            usage = ch.usage or usage
        assert [texts[i] for i in range(len(prompt))] == [ch.text for ch in r.choices]
        assert usage.completion_tokens == 6 * len(prompt)


def test_errors_have_openais_shape(coloc):
    for method, path, code in (
        ("POST", "/v1/nothing", 404),
        ("GET", "/v1/completions", 405),
        ("DELETE", "/v1/models", 405),
    ):
        status, data, _ = http(method, f"{coloc.url}{path}", None, token=None)
        assert status == code and set(data["error"]) >= {"message", "type", "param", "code"}, data
    with pytest.raises(openai.NotFoundError):
        client(coloc).chat.completions.create(model="no-such-model", messages=MSGS, max_tokens=2)


@pytest.mark.parametrize("s", ["coloc", "disagg"])
def test_cached_tokens_come_from_the_prefix_cache(request, s):
    server = request.getfixturevalue(s)
    prompt = "The same long system prompt, repeated. " * 4
    first = post(server, "/v1/completions", {"prompt": prompt + "A", "max_tokens": 2})[1]["usage"]
    second = post(server, "/v1/completions", {"prompt": prompt + "B", "max_tokens": 2})[1]["usage"]
    assert first["prompt_tokens_details"]["cached_tokens"] < first["prompt_tokens"]
    # every full block of the shared prefix is served from the cache (block size 16)
    assert second["prompt_tokens_details"]["cached_tokens"] >= 16 * ((first["prompt_tokens"] - 2) // 16) - 16 > 0
    stream = client(server).completions.create(
        model=MODEL, prompt=prompt + "C", max_tokens=2, stream=True, stream_options={"include_usage": True}
    )
    usage = [ch.usage for ch in stream if ch.usage][0]
    assert usage.prompt_tokens_details.cached_tokens > 0


def test_tokenize_detokenize_models_version(coloc):
    status, tok = post(coloc, "/tokenize", {"prompt": "hello world"})
    assert status == 200 and tok["count"] == len(tok["tokens"]) and tok["max_model_len"] > 0
    assert post(coloc, "/detokenize", {"tokens": tok["tokens"]})[1]["prompt"] == "hello world"
    status, chat = post(coloc, "/tokenize", {"messages": MSGS})
    assert status == 200 and chat["count"] > tok["count"]
    assert post(coloc, "/tokenize", {"prompt": "x", "messages": MSGS})[0] == 400
    assert post(coloc, "/detokenize", {"tokens": [10**9]})[1]["error"]["param"] == "tokens"
    m = client(coloc).models.list().data[0]
    assert m.created > 1_600_000_000 and m.owned_by == "distserve"
    assert client(coloc).models.retrieve(m.id).id == m.id  # GET /v1/models/{id}
    with pytest.raises(openai.NotFoundError):
        client(coloc).models.retrieve("no-such-model")
    status, v, _ = http("GET", f"{coloc.url}/version", None, token=None)
    assert status == 200 and v["version"]


# --- every request field: honoured (how) or refused -------------------------------------------------
# OpenAI's completions and chat-completions request fields (API reference), plus the vLLM extras we declare.
OPENAI_COMPLETIONS = {
    "model",
    "prompt",
    "best_of",
    "echo",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "max_tokens",
    "n",
    "presence_penalty",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "suffix",
    "temperature",
    "top_p",
    "user",
}
OPENAI_CHAT = {
    "messages",
    "model",
    "audio",
    "frequency_penalty",
    "function_call",
    "functions",
    "logit_bias",
    "logprobs",
    "max_completion_tokens",
    "max_tokens",
    "metadata",
    "modalities",
    "n",
    "parallel_tool_calls",
    "prediction",
    "presence_penalty",
    "prompt_cache_key",
    "reasoning_effort",
    "response_format",
    "safety_identifier",
    "seed",
    "service_tier",
    "stop",
    "store",
    "stream",
    "stream_options",
    "temperature",
    "tool_choice",
    "tools",
    "top_logprobs",
    "top_p",
    "user",
    "verbosity",
    "web_search_options",
}
H, R, S = "honoured", "refused", "sampling"  # S: owned by the sampling work: honoured or refused, never ignored
# field -> (status, a non-default value, the test that shows the behaviour)
FIELDS: dict[str, tuple[str, object, str]] = {
    "model": (H, "tiny-llama-v1", "test_errors_have_openais_shape (unknown model: 404)"),
    "prompt": (H, "hi", "test_batched_prompts_one_choice_each_streamed_and_not"),
    "messages": (H, MSGS, "test_model_serving.py::test_chat_uses_the_models_template"),
    "max_tokens": (H, 3, "test_serving.py::test_openai_client_streaming_and_not (usage == max_tokens)"),
    "max_completion_tokens": (H, 3, "this table (usage == value)"),
    "temperature": (H, 0.5, "test_serving.py::test_seeded_sampling_survives_disaggregation"),
    "top_p": (H, 0.9, "test_unit sampler tests (top-p)"),
    "top_k": (H, 5, "test_unit sampler tests (top-k)"),
    "seed": (H, 7, "test_serving.py::test_seeded_sampling_survives_disaggregation"),
    "stop": (H, ["zz"], "test_serving.py::test_stop_string_truncates_and_frees"),
    "stop_token_ids": (H, [3], "test_serving.py (stop_token_ids)"),
    "ignore_eos": (H, True, "test_batched_prompts_one_choice_each_streamed_and_not"),
    "stream": (H, False, "test_json_schema_answers_validate_streamed_and_not"),
    "stream_options": (H, {"include_usage": True}, "test_cached_tokens_come_from_the_prefix_cache; 400 without stream"),
    "response_format": (H, {"type": "json_object"}, "test_json_schema_answers_validate_streamed_and_not"),
    "structured_outputs": (H, {"choice": ["a"]}, "test_json_object_and_vllm_structured_outputs"),
    "tools": (H, TOOLS, "test_required_and_named_tool_calls_have_valid_arguments"),
    "tool_choice": (H, "auto", "test_streamed_tool_call_deltas_reassemble_to_the_call"),
    "parallel_tool_calls": (H, False, "test_tool_parsers.py::test_required_grammar_is_an_array_of_known_calls"),
    "modalities": (H, ["text"], "text is the only modality: ['audio'] is a 400"),
    "service_tier": (H, "auto", "one tier: 'flex' is a 400"),
    "user": (H, "u-1", "an end-user id; no effect on output by OpenAI's definition"),
    "safety_identifier": (H, "u-1", "as user"),
    "prompt_cache_key": (
        H,
        "k",
        "a cache hint; the prefix cache needs none (test_cached_tokens_come_from_the_prefix_cache)",
    ),
    "n": (S, 2, ""),
    "logprobs": (S, 2, ""),
    "top_logprobs": (S, 2, ""),
    "best_of": (S, 2, ""),
    "echo": (S, True, ""),
    "logit_bias": (S, {"5": 10}, ""),
    "presence_penalty": (S, 0.5, ""),
    "frequency_penalty": (S, 0.5, ""),
    "repetition_penalty": (S, 1.2, ""),
    "min_p": (S, 0.1, ""),
    "suffix": (R, "end", ""),
    "store": (R, True, ""),
    "metadata": (R, {"k": "v"}, ""),
    "audio": (R, {"voice": "alloy", "format": "wav"}, ""),
    "prediction": (R, {"type": "content", "content": "x"}, ""),
    "reasoning_effort": (R, "low", ""),
    "verbosity": (R, "low", ""),
    "web_search_options": (R, {}, ""),
    "functions": (R, [{"name": "f"}], ""),
    "function_call": (R, "auto", ""),
    "some_vendor_extra": (R, 1, "unknown fields: 400 unless router.allow_unknown_fields"),
}


def test_every_field_is_in_the_table():
    fields = (
        OPENAI_COMPLETIONS | OPENAI_CHAT | declared_fields(CompletionRequest) | declared_fields(ChatCompletionRequest)
    )
    missing = fields - set(FIELDS)
    assert not missing, f"request fields with no row in FIELDS (honoured how, or refused?): {sorted(missing)}"


def test_each_field_is_honoured_or_refused_naming_it(coloc):
    base = {"chat": {"messages": MSGS, "max_tokens": 3}, "completions": {"prompt": "hi", "max_tokens": 3}}
    checked = 0
    for name, (status, value, _how) in FIELDS.items():
        for kind in ("completions", "chat"):
            if kind == "completions" and name in OPENAI_CHAT - OPENAI_COMPLETIONS - declared_fields(CompletionRequest):
                continue
            if kind == "chat" and name in {"prompt", "suffix", "echo", "best_of"}:
                continue
            if name in ("messages", "prompt"):
                continue
            body = dict(base[kind], **{name: value})
            if name == "tool_choice" or name == "parallel_tool_calls":
                body["tools"] = TOOLS
            if name == "stream_options":
                body["stream"] = True
            if name == "logprobs" and kind == "chat":
                body["logprobs"] = True
            code, data = post(coloc, f"/v1/{kind.replace('chat', 'chat/completions')}", body)
            if status == H:
                assert code == 200, (name, kind, data)
            elif status == R:
                assert code == 400 and data["error"]["param"] == name, (name, kind, data)
            else:  # the sampling work's: honoured (200) or refused by name, never silently ignored
                assert code == 200 or (code == 400 and data["error"]["param"] == name), (name, kind, data)
            checked += 1
    assert checked > 60
    # honoured as documented: max_completion_tokens caps the answer; non-neutral values of the fixed ones are refused
    code, data = post(coloc, "/v1/chat/completions", {"messages": MSGS, "max_completion_tokens": 3, "ignore_eos": True})
    assert data["usage"]["completion_tokens"] == 3
    for name, value in (("modalities", ["audio"]), ("service_tier", "flex")):
        code, data = post(coloc, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 2, name: value})
        assert code == 400 and data["error"]["param"].startswith(name), data
    code, data = post(coloc, "/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}})
    assert code == 400 and data["error"]["param"] == "stream_options"


def test_unknown_fields_pass_when_the_config_allows():
    from distserve.server.config import load_config
    from distserve.server.router.protocol import InvalidRequest, parse

    assert load_config(overrides={"router": {"allow_unknown_fields": True}}).router.allow_unknown_fields
    body = {"prompt": "hi", "some_vendor_extra": 1}
    assert parse(CompletionRequest, body, allow_unknown_fields=True).prompt == "hi"
    with pytest.raises(InvalidRequest):
        parse(CompletionRequest, body)
    with pytest.raises(InvalidRequest):  # a known field we refuse stays refused
        parse(CompletionRequest, {"prompt": "hi", "suffix": "x"}, allow_unknown_fields=True)


# --- re-check: cases the tables above did not choose ---------------------------------------------------
@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_null_is_the_default_for_openais_nullable_fields(coloc, kind):
    """OpenAI documents these as "number or null" / "boolean or null" (the SDK sends null for an explicit None):
    null means the field was left out, so the answer is the one without it, not a 400."""
    path, base = {
        "chat": ("/v1/chat/completions", {"messages": MSGS}),
        "completions": ("/v1/completions", {"prompt": "hi"}),
    }[kind]
    base = {**base, "max_tokens": 5, "seed": 7}
    nulls = dict.fromkeys(("temperature", "top_p", "n", "presence_penalty", "frequency_penalty", "stream"))
    status, with_nulls = post(coloc, path, {**base, **nulls})
    assert status == 200, with_nulls
    status, without = post(coloc, path, base)
    assert status == 200, without
    answer = {"chat": lambda d: d["choices"][0]["message"]["content"], "completions": lambda d: d["choices"][0]["text"]}
    assert len(with_nulls["choices"]) == 1 and answer[kind](with_nulls) == answer[kind](without)


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"temperature": "0.5"}, "temperature"),  # a string is not a number
        ({"temperature": True}, "temperature"),  # nor is a boolean (it would have been 1.0)
        ({"top_p": "1"}, "top_p"),
        ({"presence_penalty": False}, "presence_penalty"),
        ({"logit_bias": {"5": True}}, "logit_bias"),
        ({"logit_bias": {"1_0": 5}}, "logit_bias"),  # int() reads "1_0" as token 10
        ({"logit_bias": {"+5": 5}}, "logit_bias"),
        # the param is the field, not pydantic's name for a member of the field's union
        ({"stop": 5}, "stop"),
        ({"stop": ["a", 1]}, "stop"),
        ({"tool_choice": "always", "tools": TOOLS}, "tool_choice"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.content"),
        # json_schema's keys are name, description, schema, strict: another one is not silently dropped
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "scheme": {}}}},
            "response_format.json_schema",
        ),
        # an earlier call's arguments must be a JSON object, as the message says
        (
            {
                "messages": MSGS
                + [
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "[1, 2]"}}],
                    }
                ]
            },
            "messages",
        ),
    ],
)
def test_wrong_types_are_400_naming_the_field(coloc, extra, param):
    status, data = post(coloc, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 2, **extra})
    assert status == 400 and data["error"]["param"] == param, data
    assert data["error"]["message"].startswith(param), data


def test_completions_union_errors_name_the_field(coloc):
    status, data = post(coloc, "/v1/completions", {"prompt": ["a", [1, 2]], "max_tokens": 2})
    assert status == 400 and data["error"]["param"] == "prompt", data


def test_max_tokens_and_max_completion_tokens(coloc):
    # two different caps: which one the client meant is not ours to guess (one would be silently ignored)
    body = {"messages": MSGS, "max_completion_tokens": 2, "max_tokens": 8, "ignore_eos": True}
    status, data = post(coloc, "/v1/chat/completions", body)
    assert status == 400 and data["error"]["param"] == "max_completion_tokens", data
    status, data = post(coloc, "/v1/chat/completions", {**body, "max_tokens": 2})  # the same cap twice is one cap
    assert status == 200 and data["usage"]["completion_tokens"] == 2, data
    # a cap beyond the context names the field the client sent
    status, data = post(coloc, "/v1/chat/completions", {"messages": MSGS, "max_completion_tokens": 10**6})
    assert status == 400 and data["error"]["param"] == "max_completion_tokens", data
    assert data["error"]["message"].startswith("max_completion_tokens"), data


def test_chat_logprob_bytes_rebuild_multibyte_characters(coloc):
    """OpenAI's ``bytes``: the token's own UTF-8 bytes, so a character split over tokens is rebuilt by joining
    them (the tiny model's tokens are single bytes: every non-ASCII character is split)."""
    c = client(coloc)
    for stream in (False, True):
        r = c.chat.completions.create(
            model=MODEL,
            messages=MSGS,
            max_tokens=20,
            logprobs=True,
            top_logprobs=2,
            stream=stream,
            extra_body={"structured_outputs": {"choice": ["日本語 é 🎉"]}},
        )
        chunks = list(r) if stream else [r]
        content = "".join(
            (ch.choices[0].delta.content or "") if stream else ch.choices[0].message.content
            for ch in chunks
            if ch.choices
        )
        entries = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
        assert content == "日本語 é 🎉"
        assert b"".join(bytes(e.bytes) for e in entries).decode("utf-8") == content
        for e in entries:
            for alt in e.top_logprobs:
                assert len(alt.bytes) >= 1


def test_nothing_left_behind_after_the_recheck(coloc):
    assert_no_leaks(coloc)


# --- SmolLM2: a real model writes real JSON and real tool calls ---------------------------------------
SMOL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def smol(serve_factory):
    return serve_factory(
        mode="colocated",
        decode=1,
        config={
            "model": SMOL,
            "cache": {"kv_cache_memory_mb": 64},
            "prefill": {"max_seq_len": 2048},
            # a busy 2-core machine can stall a worker's heartbeat during its first real steps
            "router": {"heartbeat_interval_ms": 500, "heartbeat_timeout_ms": 60000},
        },
    )


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"anyOf": [{"type": "string", "maxLength": 30}, {"type": "null"}]},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}


def test_smollm2_json_schema_and_json_object(smol):
    c = openai.OpenAI(base_url=f"{smol.url}/v1", api_key="unused", max_retries=0, timeout=300)
    msgs = [{"role": "user", "content": "Describe a person called Marie, 34, from Lyon, who likes chess, as JSON."}]
    for schema in (PERSON,):  # the twenty schemas run on the tiny model (tests/unit/test_structured_engine.py)
        r = c.chat.completions.create(
            model=SMOL, messages=msgs, max_tokens=150, temperature=0, response_format=rf(schema)
        )
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    stream = c.chat.completions.create(
        model=SMOL, messages=msgs, max_tokens=150, temperature=0, response_format=rf(PERSON), stream=True
    )
    data = json.loads("".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices))
    jsonschema.validate(data, PERSON)
    r = c.chat.completions.create(
        model=SMOL, messages=msgs, max_tokens=150, response_format={"type": "json_object"}, seed=1
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_smollm2_auto_tool_call_is_parsed_when_the_model_makes_one(smol):
    c = openai.OpenAI(base_url=f"{smol.url}/v1", api_key="unused", max_retries=0, timeout=300)
    msgs = [{"role": "user", "content": "What is the weather in Paris in C? Call the get_weather tool."}]
    r = c.chat.completions.create(model=SMOL, messages=msgs, max_tokens=80, temperature=0, tools=TOOLS)
    choice = r.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        for tc in choice.message.tool_calls:
            assert tc.function.name in {"get_weather", "get_time"}
            assert isinstance(json.loads(tc.function.arguments), dict)
    else:  # the model answered in words: then nothing in its answer was a call the parser missed
        assert "<tool_call>" not in (choice.message.content or "")
    # required on the real model: a valid call, whatever the model would have said
    r = c.chat.completions.create(
        model=SMOL, messages=msgs, max_tokens=80, temperature=0, tools=TOOLS, tool_choice="required"
    )
    call = r.choices[0].message.tool_calls[0]
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), params)


# --- last: it kills a decode worker of `disagg` -----------------------------------------------------------
LONG = {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 40, "maxItems": 40}


def test_sigkill_decode_mid_constrained_stream_migrates_with_the_same_tokens(disagg):
    import asyncio
    import os
    import signal

    import aiohttp

    from distserve.server.engine.llm_engine import EngineConfig, LLMEngine
    from distserve.server.engine.sampling_params import SamplingParams
    from distserve.server.engine.structured.grammar import Constraint

    n, max_tokens = 6, 120
    prompts = [[1, 40 + i, 41, 42] for i in range(n)]
    c = Constraint("json", json.dumps(LONG))
    engine = LLMEngine(EngineConfig())
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.7, seed=900 + i, structured=c) for i in range(n)]
    reference = [engine.generate([p], [sp])[0] for p, sp in zip(prompts, params)]
    progress = [0] * n
    killed: dict = {}
    decodes = [w for w in disagg.workers() if w["role"] == "decode" and w["state"] == "healthy"]

    async def one(s: aiohttp.ClientSession, i: int) -> list[int]:
        body = {
            "prompt_token_ids": prompts[i],
            "max_tokens": max_tokens,
            "temperature": 0.7,
            "top_p": 1.0,
            "seed": 900 + i,
            "stream": True,
            "structured_outputs": {"json": LONG},
        }
        ids: list[int] = []
        async with s.post(f"{disagg.url}/generate", json=body) as r:
            assert r.status == 200
            async for raw in r.content:
                line = json.loads(raw)
                assert "error" not in line, line
                ids.extend(line["token_ids"])
                progress[i] = len(ids)
        return ids

    async def killer() -> None:
        while sum(1 for p in progress if p >= 3) < n // 2:
            await asyncio.sleep(0.005)
        status = await asyncio.to_thread(disagg.workers)
        load = {w["worker_id"]: w["inflight"] + w["num_running"] for w in status}
        victim = max(decodes, key=lambda w: load.get(w["worker_id"], 0))
        os.kill(victim["pid"], signal.SIGKILL)
        killed.update(victim, progress_at_kill=list(progress))

    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
            results = asyncio.gather(*(one(s, i) for i in range(n)))
            await killer()
            return await results

    got = asyncio.run(main())
    assert killed and any(p < len(r) for p, r in zip(killed["progress_at_kill"], reference)), "nothing was mid-stream"
    assert got == reference
