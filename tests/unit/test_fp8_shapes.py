"""FP8 KV on model shapes the other FP8 tests do not build: GQA with an odd number of KV heads, head_dim 48 and 80,
a single layer, a prompt crossing 75 blocks. For each: a float32 prefill engine's KV handed to a calibrated FP8
decode engine (quantised once, there) decodes the colocated FP8 engine's tokens exactly under greedy sampling, and
the FP8 engine's first decode logits stay within the documented KV-only tolerance (5 %, tests/unit/test_fp8.py) of
the float32 engine's."""

from __future__ import annotations

import pytest
import torch

from distserve.server.engine.llm_engine import EngineConfig, LLMEngine
from distserve.server.engine.sampling_params import SamplingParams
from distserve.server.engine.tiny_model import make_tiny_model

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
SHAPES = {
    "gqa-9q-3kv-hd48": dict(layers=2, hidden=432, heads=9, kv_heads=3),
    "1-layer-gqa-4q-1kv-hd80": dict(layers=1, hidden=320, heads=4, kv_heads=1),
    "mha-5kv-hd80": dict(layers=2, hidden=400, heads=5, kv_heads=5),
}


def _engine(path, **kw) -> LLMEngine:
    base = dict(
        model=str(path),
        dtype="float32",
        block_size=4,
        num_blocks=256,
        max_num_seqs=8,
        enable_prefix_caching=False,
        attention_backend="sdpa",
        kv_calibration_requests=0,
    )
    base.update(kw)
    return LLMEngine(EngineConfig(**base))


def _calibrated(path) -> LLMEngine:
    eng = _engine(path, kv_cache_dtype="fp8_e4m3", kv_calibration_requests=1)
    eng.generate([[3 + j for j in range(20)]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    assert eng.kv_calibration_report()["state"] == "calibrated"
    return eng


def _first_decode_logits(eng: LLMEngine, prompts) -> torch.Tensor:
    rows: list[torch.Tensor] = []
    orig = eng.runner.execute

    def execute(scheduled):
        out = orig(scheduled)
        if not rows and all(s.num_new_tokens == 1 for s in scheduled):
            rows.append(out.float().clone())
        return out

    eng.runner.execute = execute
    eng.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    eng.runner.execute = orig
    return rows[0]


@pytest.mark.parametrize("shape", list(SHAPES))
def test_disaggregated_fp8_equals_colocated_fp8_and_stays_near_float(shape, tmp_path):
    path = make_tiny_model(tmp_path / shape, vocab=300, max_positions=512, **SHAPES[shape])
    prompts = [[3 + (i * 7 + j * 13) % 290 for j in range(n)] for i, n in enumerate([37, 300, 5])]
    want = _calibrated(path).generate(prompts, GREEDY)

    pre, dec = _engine(path), _calibrated(path)
    for i, p in enumerate(prompts):
        pre.add_request(f"p{i}", p, GREEDY, prefill_only=True)
    first = {}
    while pre.has_unfinished_requests():
        for o in pre.step():
            first[o.request_id] = o.new_token_ids
    got = {}
    for i, p in enumerate(prompts):
        _, kv = pre.take_prefilled_kv(f"p{i}")
        assert dec.reserve_prefilled(f"p{i}", p, first[f"p{i}"], GREEDY)
        dec.commit_prefilled(f"p{i}", kv)  # float32 KV into the FP8 cache: quantised here, with dec's scales
        got[f"p{i}"] = list(first[f"p{i}"])
    while dec.has_unfinished_requests():
        for o in dec.step():
            assert o.error is None, o.error
            got[o.request_id].extend(o.new_token_ids)
    assert [got[f"p{i}"] for i in range(len(prompts))] == want
    assert dec.num_used_blocks == 0

    ref = _first_decode_logits(_engine(path), prompts)
    f8 = _first_decode_logits(_calibrated(path), prompts)
    err = ((f8 - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    assert 0 < err < 0.05, err
