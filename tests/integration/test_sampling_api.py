"""Sampling as clients send it, through a real disaggregated server: the official ``openai`` client parses
every logprobs shape (stream and not, completions and chat); n and best_of fan out (indexes, usage, the
prompt's KV shared through the prefix cache); seeded sampling with penalties and logit_bias gives the
tokens and logprobs the colocated engine gives; bad sampling fields are 400s naming the field."""

from __future__ import annotations

import urllib.request

import openai
import pytest

from distserve.server.engine.llm_engine import EngineConfig, LLMEngine
from distserve.server.engine.sampling_params import SamplingParams

from .conftest import http
from .test_serving import assert_no_leaks

PROMPT = [1] + list(range(40, 80))  # 41 tokens: two full KV blocks of 16 to share between choices


@pytest.fixture(scope="module")
def server(serve_factory):
    return serve_factory(prefill=1, decode=1)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_seeded_sampling_with_penalties_is_the_colocated_engines(server):
    """Disaggregated (token 1 sampled on the prefill worker, the rest on the decode worker) equals the
    colocated engine, token for token and logprob for logprob."""
    body = {
        "prompt_token_ids": PROMPT,
        "max_tokens": 24,
        "temperature": 0.8,
        "top_p": 0.9,
        "top_k": 50,
        "min_p": 0.02,
        "frequency_penalty": 0.6,
        "presence_penalty": 0.4,
        "repetition_penalty": 1.2,
        "logit_bias": {"300": 3.0, "301": -100},
        "seed": 1234,
        "ignore_eos": True,
        "logprobs": 3,
    }
    status, got, _ = http("POST", f"{server.url}/generate", body)
    assert status == 200, got
    params = SamplingParams(
        max_tokens=24,
        temperature=0.8,
        top_p=0.9,
        top_k=50,
        min_p=0.02,
        frequency_penalty=0.6,
        presence_penalty=0.4,
        repetition_penalty=1.2,
        logit_bias=((300, 3.0), (301, -100.0)),
        seed=1234,
        ignore_eos=True,
        logprobs=3,
    )
    engine = LLMEngine(EngineConfig())
    engine.add_request("ref", PROMPT, params)
    ids, lps = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            ids += out.new_token_ids
            lps += out.logprobs or []
    assert got["token_ids"] == ids and 301 not in ids
    assert len(got["logprobs"]) == len(ids)
    for wire, (lp, top) in zip(got["logprobs"], lps):
        assert wire["logprob"] == pytest.approx(lp, abs=1e-4)
        assert [t for t, _ in wire["top_logprobs"]] == [t for t, _ in top]
    assert got["usage"]["completion_tokens"] == 24


def test_openai_client_parses_completions_logprobs_and_n(server, client):
    before = _prefix_hits(server)
    r = client.completions.create(
        model=None,  # type: ignore[arg-type]
        prompt=PROMPT,
        max_tokens=6,
        n=3,
        logprobs=2,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 18 and r.usage.prompt_tokens == len(PROMPT)
    for c in r.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
        assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
        assert all(1 <= len(t) <= 3 for t in lp.top_logprobs)  # the 2 most likely and the sampled token
        assert all(v <= 0 for v in lp.token_logprobs)
        assert all(isinstance(t, str) and t for t in lp.tokens)  # a byte piece of a character shows as U+FFFD
    assert len({c.text for c in r.choices}) > 1  # each choice has a seed of its own
    # choices 1 and 2 started after choice 0's prefill: their two full prompt blocks came from the cache
    assert _prefix_hits(server) - before >= 2 * 32
    stream = client.completions.create(
        model=None,  # type: ignore[arg-type]
        prompt=PROMPT,
        max_tokens=5,
        n=2,
        logprobs=1,
        seed=7,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    texts, ntoks, usage = {0: "", 1: ""}, {0: 0, 1: 0}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.text
            ntoks[c.index] += len(c.logprobs.tokens)
    assert ntoks == {0: 5, 1: 5} and usage is not None and usage.completion_tokens == 10
    # the same seed gives the same choices, streamed or not (choice 0 and 1 of the n=3 request above)
    assert [texts[0], texts[1]] == [r.choices[0].text[: len(texts[0])], r.choices[1].text[: len(texts[1])]]
    assert_no_leaks(server)


def test_openai_client_parses_chat_logprobs_stream_and_not(client):
    msgs = [{"role": "user", "content": "hello there"}]
    r = client.chat.completions.create(
        model=None,  # type: ignore[arg-type]
        messages=msgs,  # type: ignore[arg-type]
        max_tokens=5,
        logprobs=True,
        top_logprobs=3,
        n=2,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 10
    for c in r.choices:
        content = c.logprobs.content
        assert len(content) == 5
        for t in content:
            tops = [x.logprob for x in t.top_logprobs]
            assert len(tops) == 3 and tops == sorted(tops, reverse=True) and t.logprob <= tops[0] + 1e-6
            # the token's own bytes: its text's UTF-8, or a piece of a character (whose text is U+FFFD)
            assert bytes(t.bytes).decode("utf-8", "replace") == t.token
    stream = client.chat.completions.create(
        model=None,  # type: ignore[arg-type]
        messages=msgs,  # type: ignore[arg-type]
        max_tokens=4,
        logprobs=True,
        stream=True,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    n = 0
    for chunk in stream:
        for c in chunk.choices:
            n += len(c.logprobs.content)
            assert all(t.top_logprobs == [] for t in c.logprobs.content)
    assert n == 4


def test_best_of_echo_and_bad_fields(server, client):
    r = client.completions.create(
        model=None,  # type: ignore[arg-type]
        prompt=PROMPT,
        max_tokens=4,
        n=1,
        best_of=3,
        seed=11,
        extra_body={"ignore_eos": True},
    )
    assert len(r.choices) == 1 and r.choices[0].index == 0 and r.choices[0].logprobs is None
    assert r.usage.completion_tokens == 12  # every candidate was generated
    r = client.completions.create(model=None, prompt="Say", max_tokens=3, echo=True, temperature=0)  # type: ignore[arg-type]
    assert r.choices[0].text.startswith("Say") and len(r.choices[0].text) > 3
    vocab = server.workers()[0]["fingerprint"]["vocab_size"]
    for body, field in [
        ({"prompt": "x", "logit_bias": {str(vocab): 1}}, "logit_bias"),
        ({"prompt": "x", "echo": True, "logprobs": 1}, "echo"),
        ({"prompt": "x", "best_of": 2, "stream": True}, "best_of"),
    ]:
        status, err, _ = http("POST", f"{server.url}/v1/completions", body)
        assert status == 400 and err["error"]["param"] == field, err
    status, err, _ = http(
        "POST", f"{server.url}/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}
    )
    assert status == 400 and err["error"]["param"] == "top_logprobs", err


def _prefix_hits(server) -> float:
    url = next(w["url"] for w in server.workers() if w["role"] == "prefill")
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith("distserve_prefix_cache_hit_tokens"))
