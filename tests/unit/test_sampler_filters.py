"""top_k / top_p without a sort (radix_filter) and the sampler's CUDA-graph function, on a CPU.

The sets are the sorted rule's exactly (a stable descending sort, ties in vocabulary order); the graph
function (``sample_rows`` with the radix filters, over ``GraphSampler``'s static buffers) gives the same
tokens as the eager sampler for the same seeds; its draws follow the reference distribution."""

from __future__ import annotations

import pytest
import torch

from distserve.server.engine.graph_sampler import GraphSampler
from distserve.server.engine.radix_filter import top_k_mask, top_k_mask_host, top_p_mask, top_p_mask_host
from distserve.server.engine.sampler import NON_FINITE, Filters, Sampler, row_params, sample_rows
from distserve.server.engine.sampling_params import SamplingParams
from tests.unit.test_sampler import DRAWS, VOCAB, _check_chi2, _reference, _row

V = 3000


def _rows() -> torch.Tensor:
    """Peaked, medium and flat rows; ties inside and at the boundaries; bf16-rounded rows (many ties);
    a row with -inf entries and one that is all equal."""
    g = torch.Generator().manual_seed(11)
    scale = torch.tensor([9.0, 3.0, 0.3, 1.0] * 4).unsqueeze(1)
    x = torch.randn(16, V, generator=g) * scale
    x[3, 10:40] = x[3, 5]
    x[5] = x[5].to(torch.bfloat16).float()
    x[6] = (x[6] * 4).to(torch.bfloat16).float()
    x[7, :100] = float("-inf")
    x[8] = 0.25
    top = torch.sort(x[9], descending=True).values
    x[9, 200:230] = top[3]  # ties across the top_k boundary
    return x


def _sorted_keep(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The reference: stable descending sort, keep while the weight before is below the target (float64)."""
    vals, order = torch.sort(x, dim=-1, descending=True, stable=True)
    w = weight.gather(1, order).to(torch.float64)
    before = torch.cumsum(w, 1) - w
    keep = before < target.to(torch.float64).unsqueeze(1)
    keep[:, 0] = True
    return torch.zeros_like(keep).scatter_(1, order, keep)


def test_top_k_sets_are_the_stable_sort_rule():
    x = _rows()
    k = torch.tensor([1, 2, 5, 50, 1000, V, V + 7, 3, 4, 4, 17, 2999, 64, 1, 300, 10])
    want = _sorted_keep(x, torch.ones_like(x), k.clamp(max=V).to(torch.float64))
    assert torch.equal(top_k_mask(x, k), want)
    assert torch.equal(top_k_mask_host(x, k), want)
    assert (want.sum(1) == k.clamp(max=V)).all()  # exactly k, even with ties at the k-th value (row 9)


def test_top_p_sets_are_the_stable_sort_rule():
    x = _rows()
    probs = torch.softmax(x, dim=-1)
    top_p = torch.tensor([0.9, 0.5, 0.95, 0.3, 0.99, 0.7, 0.95, 0.8, 0.5, 0.6, 1.0, 0.05, 0.999, 0.9, 0.2, 1e-9])
    want = _sorted_keep(probs, probs, top_p) | (top_p >= 1.0).unsqueeze(1)
    got = top_p_mask(probs, top_p)
    assert torch.equal(got, want), (got.sum(1), want.sum(1))
    assert torch.equal(top_p_mask_host(probs, top_p), want)
    assert want[10].all() and want.sum(1)[15] == 1  # top_p 1 keeps all; a tiny top_p keeps the top token
    # a row's set does not depend on the rows batched with it
    for i in (0, 5, 8):
        assert torch.equal(top_p_mask(probs[i : i + 1], top_p[i : i + 1])[0], got[i])


def _batch(n: int, g: torch.Generator):
    kinds = [
        SamplingParams(temperature=0.0),
        SamplingParams(),
        SamplingParams(top_p=0.95),
        SamplingParams(temperature=0.7, top_k=50),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05),
        SamplingParams(top_p=0.9, logprobs=3),
        SamplingParams(temperature=0.7, top_k=40, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1),
        SamplingParams(temperature=0.9, logit_bias=((3, 5.0), (9, -100.0))),
        SamplingParams(temperature=0.0, frequency_penalty=1.0),
    ]
    params = [kinds[i % len(kinds)] for i in range(n)]
    hist = [([1, 2, 3], [int(t) for t in torch.randint(0, 200, (6,), generator=g)]) for _ in range(n)]
    return params, hist


def test_the_graph_function_gives_the_eager_sampler_s_tokens():
    """``GraphSampler`` off the GPU runs the graph's function over its static buffers: batches of several
    sizes (padded rows holding the previous step's data) give the eager sampler's ids and logprobs."""
    g = torch.Generator().manual_seed(4)
    graphed = Sampler(GraphSampler(200, [1, 2, 4, 8, 16], torch.device("cpu")))
    eager = Sampler()
    for step, n in enumerate([16, 7, 3, 9, 1, 5]):
        logits = torch.randn(n, 200, generator=g) * (1 + step)
        if n > 4:
            logits[2, 11] = float("nan")  # fails its row alone, in the graph as out of it
        params, hist = _batch(n, g)
        seeds, idx = [1000 + 7 * i for i in range(n)], [step] * n
        a = graphed.sample(logits, params, seeds, idx, hist)
        b = eager.sample(logits.clone(), params, seeds, idx, hist)
        assert a.tokens == b.tokens
        assert all(isinstance(t, int) for i, t in enumerate(a.tokens) if not (n > 4 and i == 2))
        assert n <= 4 or a.tokens[2] == NON_FINITE
        for la, lb in zip(a.logprobs, b.logprobs):
            assert (la is None) == (lb is None)
            if la is not None:
                assert la[0] == pytest.approx(lb[0], abs=1e-6) and [t for t, _ in la[1]] == [t for t, _ in lb[1]]
    # the one-row step is a greedy row without bias or penalty: argmax, no graph
    assert graphed.num_graphed == 5 and eager.num_graphed == 0
    # a row gives the same token alone, in any batch and at any position
    logits = torch.randn(8, 200, generator=g)
    ps = [SamplingParams(temperature=0.9, top_k=30, top_p=0.8)] * 8
    whole = graphed.sample(logits, ps, list(range(8)), [2] * 8).tokens
    alone = [graphed.sample(logits[i : i + 1], ps[:1], [i], [2]).tokens[0] for i in range(8)]
    assert whole == alone


def test_radix_sort_and_host_filters_give_the_same_tokens():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(64, 1000, generator=g) * torch.linspace(0.2, 8.0, 64).unsqueeze(1)
    params = [
        SamplingParams(temperature=0.5 + (i % 5) * 0.3, top_k=(i * 7) % 90, top_p=(0.3, 0.8, 0.95, 1.0)[i % 4])
        for i in range(64)
    ]
    fl, il, filters = row_params(params, list(range(64)), [5] * 64, 1000)
    fp, ip = torch.tensor(fl), torch.tensor(il)
    radix = sample_rows(x, fp, ip, filters)
    for impl in ("host", "sort"):
        assert torch.equal(radix, sample_rows(x, fp, ip, Filters(filters.top_k, filters.top_p, impl=impl))), impl


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.3, top_k=5), SamplingParams(temperature=1.2, top_k=8, top_p=0.9, min_p=0.05)],
    ids=["topk5", "all"],
)
def test_the_graph_function_draws_the_reference_distribution(params):
    logits = _row()
    fl, il, filters = row_params([params] * DRAWS, list(range(1000, 1000 + DRAWS)), [3] * DRAWS, VOCAB)
    tok = sample_rows(logits.expand(DRAWS, VOCAB), torch.tensor(fl), torch.tensor(il), filters.graphed())
    _check_chi2(torch.bincount(tok, minlength=VOCAB).double(), _reference(logits, params))


def test_an_engine_samples_the_same_tokens_through_the_graph_sampler():
    """The engine with the graph sampler attached (its CPU stand-in) generates what it generates without."""
    from distserve.server.engine.cuda_graph_runner import attach_graph_sampler
    from distserve.server.engine.llm_engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(max_num_seqs=8))
    prompts = [[1, 5 + i, 9, 2 * i + 3] for i in range(6)]
    params = [
        SamplingParams(max_tokens=6, seed=s, ignore_eos=True, **kw)
        for s, kw in enumerate(
            [
                dict(),
                dict(top_p=0.9),
                dict(temperature=0.7, top_k=20),
                dict(temperature=0.0),
                dict(top_p=0.95, frequency_penalty=0.8, presence_penalty=0.3),
                dict(temperature=0.8, top_p=0.9, logprobs=2),
            ]
        )
    ]
    before = engine.generate(prompts, params)
    attach_graph_sampler(engine, [1, 2, 4, 8])
    assert engine.generate(prompts, params) == before
    assert engine.sampler.num_graphed > 0
