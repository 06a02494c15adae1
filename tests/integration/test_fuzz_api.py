"""Schema-driven fuzzing of the OpenAI endpoints and /generate against a real server.

Hypothesis draws request bodies field by field from the request models' fields, mixing valid and
invalid values of every JSON type (NaN included: Python's json writes it and the server must refuse
it). Every answer must be a 2xx or a 4xx whose error names a field, never a 5xx and never a hang
(each request has a client deadline); streams must end with ``[DONE]`` or an error event. After the
run the server is healthy and no worker holds a KV block. Derandomized, so CI sees the same examples
each run; the example count bounds the time.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integration.conftest import http

any_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
token_ids = st.lists(st.integers(-3, 600), max_size=12)
small_int = st.integers(-3, 24) | st.sampled_from([0, 10**9, 2**63, -(2**63)])
unit_float = st.floats(-1, 3) | st.sampled_from([1e-300, 1e-30, 0.0, 1.0, float("nan"), float("inf"), -float("inf")])
prompt_text = st.text(max_size=60) | st.sampled_from(["", "a\ud800b", "hello world", "\x00"])

SAMPLING = {
    "max_tokens": small_int | any_json,
    "temperature": unit_float | any_json,
    "top_p": unit_float,
    "top_k": st.integers(-3, 600),
    "seed": st.integers(-(2**64), 2**64) | st.none(),
    "stop": st.none() | prompt_text | st.lists(prompt_text, max_size=3),
    "stop_token_ids": token_ids | any_json,
    "stream": st.booleans() | any_json,
    "stream_options": st.none() | st.fixed_dictionaries({"include_usage": st.booleans() | any_json}),
    "ignore_eos": st.booleans(),
    "n": st.integers(0, 3),
    "logprobs": st.none() | st.booleans() | st.integers(0, 3),
    "presence_penalty": unit_float,
    "min_p": unit_float,
    "model": st.none() | st.text(max_size=10),
}


def _body(required: dict) -> st.SearchStrategy[dict]:
    optional = st.fixed_dictionaries({}, optional=SAMPLING)
    return st.tuples(st.fixed_dictionaries(required), optional).map(lambda t: {**t[1], **t[0]})


message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "system", "assistant", "tool", "robot"]) | any_json,
        "content": prompt_text | st.none() | any_json,
    }
)
ENDPOINTS = {
    "/v1/completions": _body(
        {
            "prompt": prompt_text
            | token_ids
            | st.lists(prompt_text, max_size=2)
            | st.lists(token_ids, max_size=2)
            | any_json
        }
    ),
    "/v1/chat/completions": _body({"messages": st.lists(message, max_size=3) | any_json}),
    "/generate": _body({"prompt": prompt_text})
    | _body({"prompt_token_ids": token_ids})
    | _body({"prompt": prompt_text, "prompt_token_ids": token_ids}),
}


@pytest.fixture(scope="module")
def server(serve_factory):
    return serve_factory(prefill=1, decode=1, config={"prefill": {"max_seq_len": 256}})


def _check(url: str, path: str, body: dict) -> None:
    raw = json.dumps(body)  # NaN / Infinity included, as Python's json writes them
    # 60 s without a byte raises (socket timeout): a hung request fails the test
    status, payload, headers = http("POST", url + path, raw=raw.encode(), token=None, timeout=60.0)
    text = payload if isinstance(payload, str) else json.dumps(payload)
    assert status < 500, (path, raw[:300], status, text[:300])
    if status >= 400:
        err = json.loads(text)["error"]
        assert err["message"] and err["code"] in (status, "model_not_found"), text
        return
    if headers["content-type"].startswith("text/event-stream"):
        events = [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]
        assert events and events[-1] == "[DONE]", text[-300:]
    elif headers["content-type"].startswith("application/x-ndjson"):
        last = json.loads(text.strip().splitlines()[-1])
        assert last["finished"], text[-300:]
    else:
        json.loads(text)


@pytest.mark.parametrize("path", sorted(ENDPOINTS))
def test_fuzzed_requests_never_get_a_5xx_or_hang(server, path):
    @settings(
        max_examples=80,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    @given(body=ENDPOINTS[path])
    def run(body):
        _check(server.url, path, body)

    run()
    assert http("GET", server.url + "/health", token=None)[0] == 200
    kv = server.wait_kv_free(timeout=20)
    assert not any(kv["used"].values()) and not any(kv["staged"].values()), kv
