"""The sampler's CUDA graphs: a replay gives the eager sampler's tokens (same seeds), the radix filters give
the CPU's sets, and an engine with decode graphs samples through them.

Skipped without CUDA (CI has none); on the H200: ``python3 -m pytest tests/gpu/test_graph_sampler.py -q``
(run by ``bench/gpu_sampler_run.sh``)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEV = torch.device("cuda")
VOCAB = 32000


def _logits(rows: int, seed: int) -> torch.Tensor:
    """Peaked, medium and flat rows, a quarter of them bf16-rounded (many exact ties, as a bf16 model's)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([8.0, 3.0, 1.0, 0.3] * (rows // 4 + 1))[:rows].unsqueeze(1)
    x = torch.randn(rows, VOCAB, generator=g) * scale
    x[::4] = x[::4].to(torch.bfloat16).float()
    return x.to(DEV)


def _params():
    from distserve.server.engine.sampling_params import SamplingParams

    return [
        SamplingParams(temperature=0.0),
        SamplingParams(),
        SamplingParams(top_p=0.95),
        SamplingParams(temperature=0.7, top_k=50),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05),
        SamplingParams(top_p=0.95, logprobs=5),
        SamplingParams(temperature=0.7, top_k=50, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1),
        SamplingParams(temperature=0.9, logit_bias=((3, 5.0), (9, -100.0))),
    ]


def test_radix_sets_on_the_gpu_are_the_cpu_sets():
    from distserve.server.engine.radix_filter import top_k_mask, top_k_mask_host, top_p_mask

    x = _logits(64, 1)
    probs = torch.softmax(x, dim=-1)
    top_p = torch.tensor([0.95, 0.9, 0.5, 0.99] * 16, device=DEV)
    k = torch.tensor([50, 1, 7, 1000] * 16, device=DEV)
    assert torch.equal(top_p_mask(probs, top_p).cpu(), top_p_mask(probs.cpu(), top_p.cpu()))
    assert torch.equal(top_k_mask(x, k).cpu(), top_k_mask_host(x.cpu(), k.cpu()))


@pytest.mark.parametrize("n", [1, 5, 8, 33, 64])
def test_a_graph_replay_gives_the_eager_sampler_s_tokens(n):
    from distserve.server.engine.graph_sampler import GraphSampler
    from distserve.server.engine.sampler import NON_FINITE, Sampler

    graphed = Sampler(GraphSampler(VOCAB, [1, 2, 4, 8, 16, 32, 64], DEV))
    assert graphed.graphs.graphs or DEV.type == "cpu"  # captured (the CPU dry run of this file captures none)
    eager = Sampler()
    kinds = _params()
    for step in range(3):
        logits = _logits(n, 10 * n + step)
        if n > 4:
            logits[2, 11] = float("nan")  # fails its row alone (no device assert on the garbage it computes)
        params = [kinds[(i + step) % len(kinds)] for i in range(n)]
        hist = [([1, 2, 3], [5 + i, 7, 7, 100 + step]) for i in range(n)]
        seeds, idx = [123 + i for i in range(n)], [step] * n
        a = graphed.sample(logits, params, seeds, idx, hist)
        b = eager.sample(logits.clone(), params, seeds, idx, hist)
        assert a.tokens == b.tokens, step
        assert all(isinstance(t, int) for i, t in enumerate(a.tokens) if not (n > 4 and i == 2))
        assert n <= 4 or a.tokens[2] == NON_FINITE
        for la, lb in zip(a.logprobs, b.logprobs):
            assert (la is None) == (lb is None)
            if la is not None:
                assert la[0] == pytest.approx(lb[0], abs=1e-5)
    assert graphed.num_graphed >= 2  # (a one-row greedy step takes the argmax path)


@pytest.mark.parametrize("impl", ["radix", "sort"])
def test_every_graph_variant_equals_its_eager_function(impl):
    from distserve.server.engine.graph_sampler import VARIANTS, GraphSampler
    from distserve.server.engine.sampler import row_params, sample_rows
    from distserve.server.engine.sampling_params import SamplingParams

    gs = GraphSampler(VOCAB, [64], DEV, impl=impl)
    logits = _logits(64, 3)
    params = [
        SamplingParams(temperature=0.6 + 0.1 * (i % 7), top_k=(0, 40, 1000)[i % 3], top_p=(1.0, 0.9, 0.95, 0.5)[i % 4])
        for i in range(64)
    ]
    fl, il, _ = row_params(params, list(range(64)), [9] * 64, VOCAB)
    fp, ip = torch.tensor(fl, device=DEV), torch.tensor(il, device=DEV)
    radix = None
    for variant in VARIANTS:
        filters = variant.graphed(impl)
        gs.load(logits)
        got = gs.replay(64, fl, il, filters).clone()
        assert torch.equal(got, sample_rows(logits, fp, ip, filters)), filters
        if variant.top_k and variant.top_p:
            radix = sample_rows(logits, fp, ip, variant.graphed("radix"))
            # the sort and the radix select find the same sets (the same fixed-point sums): the same tokens
            assert torch.equal(got, radix), impl


def test_an_engine_with_decode_graphs_samples_through_the_sampler_graphs():
    """Each step's graphed tokens equal the eager sampler's on the same logits, and a second run with the
    same seeds gives the same tokens."""
    from distserve.server.engine.llm_engine import EngineConfig, LLMEngine
    from distserve.server.engine.sampler import Sampler
    from distserve.server.engine.sampling_params import SamplingParams

    engine = LLMEngine(
        EngineConfig(
            model="preset:tiny-gpu",
            device="cuda",
            dtype="bfloat16",
            num_blocks=2048,
            max_num_seqs=8,
            max_num_batched_tokens=8192,
            max_model_len=256,
        )
    )
    graphed = engine.sampler
    assert graphed.graphs is not None, "setup_cuda_engine attaches the graph sampler"
    eager = Sampler()
    mismatches: list = []

    class Checking:
        def sample(self, logits, params, seeds, indices, histories=None):
            raw = logits.clone()
            out = graphed.sample(logits, params, seeds, indices, histories)
            ref = eager.sample(raw, params, seeds, indices, histories)
            if out.tokens != ref.tokens:
                mismatches.append((out.tokens, ref.tokens))
            return out

    engine.sampler = Checking()
    kinds = _params()
    params = [
        SamplingParams.from_dict({**k.to_dict(), "max_tokens": 12, "ignore_eos": True, "seed": i})
        for i, k in enumerate(kinds)
    ]
    prompts = [[3 + i, 17, 40 + 2 * i, 9] for i in range(len(params))]
    first = engine.generate(prompts, params)
    assert not mismatches
    assert graphed.num_graphed >= 10 and graphed.graphs.num_replays >= 10
    engine.sampler = graphed
    assert engine.generate(prompts, params) == first
