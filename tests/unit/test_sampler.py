"""The batched sampler: distributions against the reference, penalties and logit_bias as OpenAI/vLLM
define them, randomness a pure function of (seed, index), logprobs, and per-row failure."""

from __future__ import annotations

import math

import pytest
import torch

from distserve.server.engine.llm_engine import EngineConfig, LLMEngine
from distserve.server.engine.sampler import NON_FINITE, Sampler, uniform_reference, uniforms
from distserve.server.engine.sampling_params import SamplingParams

VOCAB = 16
DRAWS = 6000
# chi-square critical values at p = 0.001 by degrees of freedom (fixed seeds: the test is deterministic;
# the bound says the sampler's distribution is the reference's, not a lucky draw)
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88}
CHI2_999.update({10: 29.59, 11: 31.26, 12: 32.91, 13: 34.53, 14: 36.12, 15: 37.70})


def _row() -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randn(VOCAB, generator=g) * 1.5


def _reference(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """softmax after temperature, then top_k, top_p, min_p masks: written independently, in float64."""
    x = logits.double() / p.temperature
    order = torch.argsort(x, descending=True)
    keep = torch.ones(VOCAB, dtype=torch.bool)
    if p.top_k > 0:
        keep[order[p.top_k :]] = False
    probs = torch.where(keep, torch.exp(x - x.max()), 0.0)
    probs /= probs.sum()
    if p.top_p < 1.0:
        mass = 0.0
        for i in order.tolist():
            if not keep[i]:
                continue
            if mass >= p.top_p:
                keep[i] = False
            mass += float(probs[i])
    if p.min_p > 0:
        keep &= probs >= p.min_p * probs.max()
    probs = torch.where(keep, probs, 0.0)
    return probs / probs.sum()


def _draw(p: SamplingParams, logits: torch.Tensor, histories=None, draws: int = DRAWS) -> torch.Tensor:
    out = Sampler().sample(
        logits.expand(draws, VOCAB).contiguous(),
        [p] * draws,
        list(range(1000, 1000 + draws)),
        [3] * draws,
        histories * draws if histories else None,
    )
    assert all(isinstance(t, int) for t in out.tokens)
    return torch.bincount(torch.tensor(out.tokens), minlength=VOCAB).double()


def _check_chi2(counts: torch.Tensor, probs: torch.Tensor) -> None:
    assert counts[probs == 0].sum() == 0, "a masked token was sampled"
    live = probs > 0
    expected = probs[live] * counts.sum()
    chi2 = float(((counts[live] - expected) ** 2 / expected).sum())
    df = int(live.sum()) - 1
    if df == 0:
        return
    assert chi2 < CHI2_999[df], (chi2, df, counts.tolist(), (probs * counts.sum()).tolist())


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.6),
        SamplingParams(temperature=1.3, top_k=5),
        SamplingParams(temperature=1.0, top_p=0.7),
        SamplingParams(temperature=0.9, min_p=0.15),
        SamplingParams(temperature=1.2, top_k=8, top_p=0.9, min_p=0.05),
    ],
    ids=["T1", "T0.6", "topk5", "topp0.7", "minp", "all"],
)
def test_distribution_matches_the_reference(params):
    logits = _row()
    _check_chi2(_draw(params, logits), _reference(logits, params))


def test_penalties_and_logit_bias_shape_the_distribution_as_openai_defines_them():
    logits = _row()
    prompt, output = [1, 2], [3, 3, 3, 4, 9]
    counts = torch.bincount(torch.tensor(output), minlength=VOCAB).double()
    p = SamplingParams(frequency_penalty=0.4, presence_penalty=0.7, logit_bias=((5, 2.0), (6, -1.5)))
    # OpenAI: mu[j] - c[j] * alpha_frequency - (c[j] > 0) * alpha_presence; logit_bias added first
    ref = logits.double().clone()
    ref[5] += 2.0
    ref[6] -= 1.5
    ref = ref - counts * 0.4 - (counts > 0).double() * 0.7
    _check_chi2(_draw(p, logits, [(prompt, output)]), torch.softmax(ref, dim=0))
    # vLLM's repetition penalty: a seen token's logit / rp when positive, * rp when negative
    rp = SamplingParams(repetition_penalty=1.8, temperature=0.8)
    seen = torch.zeros(VOCAB, dtype=torch.bool)
    seen[prompt + output] = True
    ref = torch.where(seen, torch.where(logits > 0, logits / 1.8, logits * 1.8), logits).double() / 0.8
    _check_chi2(_draw(rp, logits, [(prompt, output)]), torch.softmax(ref, dim=0))
    # +100 forces a token, -100 bans one; greedy rows take the processed argmax
    forced = Sampler().sample(
        logits.expand(4, VOCAB), [SamplingParams(logit_bias=((11, 100.0),))] * 4, [1, 2, 3, 4], [0] * 4
    )
    assert forced.tokens == [11] * 4
    top = int(torch.argmax(logits))
    banned = SamplingParams(temperature=0.0, logit_bias=((top, -100.0),))
    second = int(torch.argsort(logits, descending=True)[1])
    assert Sampler().sample(logits[None], [banned], [0], [0]).tokens == [second]


def test_randomness_is_a_pure_function_of_seed_and_index_whatever_the_batch():
    seeds = torch.tensor([0, 1, -5, 2**62, -(2**63), 2**63 - 1, 123456789])
    idx = torch.tensor([0, 7, 3, 1, 2, 99, 4096])
    got = uniforms(seeds, idx).tolist()
    assert got == [pytest.approx(uniform_reference(int(s), int(i)), abs=0) for s, i in zip(seeds, idx)]
    assert all(0 < u <= 1 for u in got)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 300, generator=g) * 2
    ps = [
        SamplingParams(temperature=0.9),
        SamplingParams(top_p=0.9),
        SamplingParams(top_k=20, temperature=0.7),
        SamplingParams(temperature=0.0),
        SamplingParams(min_p=0.1, frequency_penalty=0.5),
        SamplingParams(temperature=1.1, logprobs=2),
    ]
    hist = [([1, 2], [5, 6, 5])] * 6
    batch = Sampler().sample(logits, ps, [11, 12, 13, 14, 15, 16], [4, 4, 4, 4, 4, 4], hist).tokens
    alone = [Sampler().sample(logits[i : i + 1], [ps[i]], [11 + i], [4], hist[:1]).tokens[0] for i in range(6)]
    assert batch == alone
    # another index (the next output token) or another seed draws anew
    many = Sampler().sample(logits[:1].expand(64, 300), [ps[0]] * 64, [11] * 32 + list(range(32)), list(range(32)) * 2)
    assert len(set(many.tokens)) > 10


def test_greedy_is_argmax_and_logprobs_are_the_raw_log_softmax():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(5, 200, generator=g) * 3
    greedy = Sampler().sample(logits, [SamplingParams(temperature=0.0)] * 5, [0] * 5, [0] * 5)
    assert greedy.tokens == torch.argmax(logits, dim=-1).tolist() and greedy.logprobs == [None] * 5
    ps = [SamplingParams(temperature=0.0, logprobs=5), SamplingParams(logprobs=0), SamplingParams(top_p=0.5)]
    ps += [SamplingParams(temperature=0.7, logprobs=20), SamplingParams(temperature=0.0)]
    out = Sampler().sample(logits, ps, [1, 2, 3, 4, 5], [0] * 5)
    ref = torch.log_softmax(logits.double(), dim=-1)
    for i, p in enumerate(ps):
        lp = out.logprobs[i]
        if p.logprobs is None:
            assert lp is None
            continue
        assert lp is not None
        chosen, top = lp
        assert chosen == pytest.approx(float(ref[i, out.tokens[i]]), abs=1e-5)
        assert len(top) == p.logprobs
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        assert [t for t, _ in top] == torch.argsort(ref[i], descending=True)[: p.logprobs].tolist()
        assert all(v == pytest.approx(float(ref[i, t]), abs=1e-5) for t, v in top)
    assert out.logprobs[0][1][0] == (out.tokens[0], out.logprobs[0][0])  # greedy: the sampled token leads


def test_a_row_that_cannot_be_sampled_fails_alone_in_a_sampled_batch():
    logits = torch.randn(4, 50)
    logits[1, 3] = float("nan")
    logits[2, 7] = float("inf")
    ps = [SamplingParams(top_p=0.9, logprobs=1), SamplingParams(top_p=0.9), SamplingParams(top_k=5), SamplingParams()]
    out = Sampler().sample(logits, ps, [1, 2, 3, 4], [0] * 4)
    assert out.tokens[1] == NON_FINITE and out.tokens[2] == NON_FINITE
    assert isinstance(out.tokens[0], int) and isinstance(out.tokens[3], int)
    assert out.logprobs[0] is not None and out.logprobs[1] is None
    assert not math.isnan(out.logprobs[0][0])


def test_penalised_sampling_resumes_identically_from_the_token_ids():
    """What a migration or the P/D hand-off does: a second engine given the prompt and the first outputs
    continues exactly as the first engine did (the counts are rebuilt from the ids)."""
    prompt = [1, 40, 41, 42, 43, 44, 45]
    p = SamplingParams(
        max_tokens=12,
        temperature=0.9,
        top_p=0.95,
        frequency_penalty=1.0,
        presence_penalty=0.5,
        repetition_penalty=1.3,
        seed=99,
        ignore_eos=True,
    )
    engine = LLMEngine(EngineConfig())
    full = engine.generate([prompt], p)[0]
    engine.add_request("resume", prompt, p, output_token_ids=full[:5])
    rest: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            rest += out.new_token_ids
    assert full[:5] + rest == full
    plain = engine.generate(
        [prompt], SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=99, ignore_eos=True)
    )[0]
    assert plain != full  # the penalties did change the tokens
