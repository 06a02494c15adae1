"""Router-side text: stop strings never leak a partial match; OpenAI request validation names fields."""

from __future__ import annotations

import pytest

from distserve.server.engine.tokenizer import Tokenizer
from distserve.server.router import protocol
from distserve.server.router.text import TextAssembler

TOK = Tokenizer.byte_tokenizer()


def ids(text: str) -> list[int]:
    return TOK.encode(text, add_bos=False)


def stream(assembler: TextAssembler, text: str) -> list[str]:
    tokens = ids(text)
    out = [assembler.push([t], final=i == len(tokens) - 1) for i, t in enumerate(tokens)]
    return out


def test_without_stop_text_is_exact_and_multibyte_safe():
    a = TextAssembler(TOK, [])
    pieces = stream(a, "héllo 世界 🙂")
    assert "".join(pieces) == "héllo 世界 🙂" and "\ufffd" not in "".join(pieces)


def test_stop_string_truncates_and_is_never_partially_emitted():
    a = TextAssembler(TOK, ["STOP"])
    pieces = stream(a, "abc STO STOP tail")
    assert "".join(pieces) == "abc STO "
    assert a.stopped
    assert all("STOP" not in p for p in pieces)
    assert a.push(ids("more")) == ""  # nothing after a stop


def test_earliest_of_several_stop_strings_wins():
    a = TextAssembler(TOK, ["zz", "b"])
    assert "".join(stream(a, "aazzab")) == "aa"


@pytest.mark.parametrize(
    "body,field",
    [
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "stop": [""]}, "stop"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "logprobs": 1, "echo": True}, "echo"),
        ({"prompt": "x", "n": 3, "best_of": 2}, "best_of"),
        ({"prompt": "x", "best_of": 2, "stream": True}, "best_of"),
        ({"prompt": "x", "n": 17}, "n"),
        ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
        ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
        ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
        ({}, "prompt"),
    ],
)
def test_completion_validation_names_the_field(body, field):
    with pytest.raises(protocol.InvalidRequest) as e:
        protocol.parse(protocol.CompletionRequest, body)
    assert field in str(e.value)


def test_chat_rendering_and_content_parts():
    req = protocol.parse(
        protocol.ChatCompletionRequest,
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]},
            ]
        },
    )
    assert protocol.render_chat(req.messages) == "<|system|>\nbe brief\n<|user|>\nhi there\n<|assistant|>\n"
    bad = protocol.parse(
        protocol.ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
    )
    with pytest.raises(protocol.InvalidRequest, match="text"):
        protocol.render_chat(bad.messages)
