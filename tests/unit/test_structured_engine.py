"""Constrained decoding in the engine (llguidance): every answer of 20 schemas validates on the tiny model,
greedy and sampled; free rows of a mixed batch are untouched; a matcher rebuilt from the tokens so far
(decode-side hand-off, migration) continues exactly as an undisturbed run; a bad grammar is a ValueError."""

from __future__ import annotations

import json

import jsonschema
import pytest

from distserve.server.engine.llm_engine import EngineConfig, LLMEngine
from distserve.server.engine.sampling_params import SamplingParams
from distserve.server.engine.structured.grammar import Constraint, GrammarError, validate
from tests.structured_schemas import SCHEMAS

PROMPT = [1, 40, 41, 42, 43]


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig())


@pytest.fixture(scope="module")
def tok(engine):
    return engine._load_tokenizer()


def test_twenty_schemas_answer_valid_json_greedy_and_sampled(engine, tok):
    prompts, params = [], []
    for i, schema in enumerate(SCHEMAS):
        c = Constraint("json", json.dumps(schema))
        prompts.append(PROMPT + [50 + i])
        params.append(SamplingParams(max_tokens=200, temperature=float(i % 2), seed=i, structured=c))
    outs = engine.generate(prompts, params)  # all 20 in one continuous batch: a mask per row
    for schema, out in zip(SCHEMAS, outs):
        jsonschema.validate(json.loads(tok.decode(out)), schema)
    assert engine.num_used_blocks == 0 and not engine.structured._matchers


def test_free_rows_beside_constrained_ones_are_unchanged(engine):
    free = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    alone = engine.generate([PROMPT], free)[0]
    c = Constraint("regex", "[a-z]{8}")
    mixed = engine.generate([PROMPT, PROMPT], [free, SamplingParams(max_tokens=10, temperature=0.0, structured=c)])
    assert mixed[0] == alone


@pytest.mark.parametrize("cut", [1, 5])
def test_matcher_rebuilt_from_tokens_continues_the_same(engine, cut):
    c = Constraint("json", json.dumps(SCHEMAS[5]))
    p = SamplingParams(max_tokens=100, temperature=1.0, seed=7, structured=c)
    full = engine.generate([PROMPT], p)[0]
    # a fresh request that already has the first `cut` tokens (decode worker after prefill, or a migration)
    engine.add_request("resumed", PROMPT, p, output_token_ids=full[:cut])
    rest: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            rest.extend(out.new_token_ids)
    assert full[:cut] + rest == full


def test_tokens_that_break_the_grammar_are_refused_at_add(engine):
    c = Constraint("regex", "[0-9]+")
    with pytest.raises(ValueError, match="do not follow the grammar"):
        engine.add_request("bad", PROMPT, SamplingParams(max_tokens=4, structured=c), output_token_ids=[120])
    assert "bad" not in engine.requests


def test_compiled_grammars_are_cached(engine):
    c = Constraint("json", json.dumps({"enum": ["cached", "twice"]}))
    before = engine.structured.num_compiled
    engine.generate([PROMPT, PROMPT], SamplingParams(max_tokens=40, structured=c))
    engine.generate([PROMPT], SamplingParams(max_tokens=40, structured=c))
    assert engine.structured.num_compiled == before + 1


@pytest.mark.parametrize(
    "c",
    [
        Constraint("regex", "[a-z"),
        Constraint("json", "{not json"),
        Constraint("json", json.dumps({"type": "object", "properties": {"a": {"type": "strnig"}}})),
        Constraint("grammar", "start: foo"),
        Constraint("choice", "[]"),
    ],
)
def test_uncompilable_constraints_raise(c):
    with pytest.raises(GrammarError):
        validate(c)


def test_gbnf_grammar_is_converted():
    validate(Constraint("grammar", 'root ::= "yes" | "no"'))


def test_host_and_device_unpacking_of_the_bitmask_agree():
    import torch

    from distserve.server.engine.structured.decoding import unpack_on_device, unpack_on_host

    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (5, 7), dtype=torch.int32, generator=g)
    host = unpack_on_host(bits, 7 * 32 - 5)
    dev = unpack_on_device(bits, 7 * 32 - 5, torch.arange(32, dtype=torch.int32))
    assert torch.equal(host, dev)
    word, bit = 3, 31  # token 32 * word + bit is allowed iff that bit is set
    assert bool(host[0, 32 * word + bit]) == bool((int(bits[0, word]) >> bit) & 1)
