"""A request's own failure inside an engine step fails that request alone, with its true cause."""

from __future__ import annotations

import random

import torch

from distserve.server.engine.llm_engine import EngineConfig, LLMEngine
from distserve.server.engine.sampler import NON_FINITE, Sampler
from distserve.server.engine.sampling_params import SamplingParams


def make_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 259) for _ in range(rng.randrange(4, 40))] for _ in range(n)]


def test_sampler_fails_only_the_rows_it_cannot_sample():
    logits = torch.randn(4, 50)
    logits[2, 7] = float("nan")
    logits[3, 1] = float("inf")
    greedy = [SamplingParams(temperature=0.0)] * 4
    out = Sampler().sample(logits, greedy, [0] * 4, [0] * 4).tokens
    assert out[:2] == torch.argmax(logits[:2], dim=-1).tolist() and out[2:] == [NON_FINITE, NON_FINITE]
    mixed = [SamplingParams(temperature=t) for t in (1e-300, 0.7, 1.0, 1.0)]
    out = Sampler().sample(logits, mixed, [1, 2, 3, 4], [0] * 4).tokens
    assert out[0] == int(torch.argmax(logits[0])) and isinstance(out[1], int) and out[2:] == [NON_FINITE] * 2


def test_tiny_temperatures_sample_like_greedy_and_small_ones_stay_finite():
    logits = torch.randn(3, 50) * 30
    for t in (1e-300, 1e-30, 1e-6):
        assert SamplingParams(temperature=t).is_greedy
    p = SamplingParams(temperature=2e-5, seed=3)  # above the greedy cut-off: logits / t is ~1e6
    assert not p.is_greedy
    out = Sampler().sample(logits, [p] * 3, [1, 2, 3], [0, 0, 0]).tokens
    assert out == torch.argmax(logits, dim=-1).tolist()  # the distribution is one-hot in float32


# --- helpers of the engine-level isolation ---------------------------------------------------------
def test_a_forward_that_fails_for_one_request_is_retried_without_it():
    engine = LLMEngine(EngineConfig())
    real = engine.runner.execute

    def execute(scheduled):  # the seam: a forward that breaks whenever one given request is in the batch
        if any(s.seq.request_id == "bad" for s in scheduled):
            raise RuntimeError("simulated kernel failure")
        return real(scheduled)

    engine.runner.execute = execute
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = make_prompts(4, seed=1)
    reference = LLMEngine(EngineConfig()).generate(prompts, params)
    for i, p in enumerate(prompts):
        engine.add_request(f"ok{i}", p, params)
    engine.add_request("bad", [1, 2, 3], params)
    got: dict[str, list[int]] = {}
    errors = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.error:
                errors[out.request_id] = out.error
    assert [got[f"ok{i}"] for i in range(4)] == reference
    assert list(errors) == ["bad"] and "simulated kernel failure" in errors["bad"]
    assert engine.num_used_blocks == 0 and not engine.requests
