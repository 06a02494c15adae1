"""The correctness oracle: our engine against Hugging Face ``transformers`` on the same weights.

Greedy tokens must be identical and last-position logits within 1e-4, for
single prompts and for mixed batches (batching must not change greedy tokens),
across model shapes chosen to break shape assumptions.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from distserve.server.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from distserve.server.engine.sampling_params import SamplingParams  # noqa: E402
from distserve.server.engine.scheduler import ScheduledSeq  # noqa: E402
from distserve.server.engine.sequence import Sequence  # noqa: E402

# name -> (config class name, kwargs)
SHAPES = {
    "mha": (
        "LlamaConfig",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            vocab_size=300,
        ),
    ),
    "gqa": (
        "LlamaConfig",
        dict(
            hidden_size=96,
            intermediate_size=200,
            num_hidden_layers=3,
            num_attention_heads=6,
            num_key_value_heads=2,
            vocab_size=320,
        ),
    ),
    "odd_sizes_mqa": (
        "LlamaConfig",
        dict(
            hidden_size=120,
            intermediate_size=250,
            num_hidden_layers=2,
            num_attention_heads=5,
            num_key_value_heads=1,
            vocab_size=333,
        ),
    ),
    "tied_llama3_rope": (
        "LlamaConfig",
        dict(
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=300,
            tie_word_embeddings=True,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
    ),
    "linear_rope_bias": (
        "LlamaConfig",
        dict(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=280,
            attention_bias=True,
            rope_scaling={"rope_type": "linear", "factor": 2.0},
        ),
    ),
    "mistral": (
        "MistralConfig",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            vocab_size=300,
            sliding_window=4096,
        ),
    ),
    "qwen2_bias": (
        "Qwen2Config",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=300,
        ),
    ),
}

PROMPTS = [
    [1, 17, 42, 99, 5],
    [1, 250, 3, 3, 3, 8, 19, 200, 101, 7, 64, 33, 12],
    [1, 9],
    list(range(1, 38)),  # crosses several blocks of 4
]
MAX_TOKENS = 12


def _hf_model(name: str, folder):
    cfg_cls, kwargs = SHAPES[name]
    cfg = getattr(transformers, cfg_cls)(
        max_position_embeddings=256,
        initializer_range=0.15,
        torch_dtype="float32",
        bos_token_id=1,
        eos_token_id=2,
        **kwargs,
    )
    torch.manual_seed(1234)
    model_cls = {"Qwen2Config": transformers.Qwen2ForCausalLM, "MistralConfig": transformers.MistralForCausalLM}.get(
        cfg_cls, transformers.LlamaForCausalLM
    )
    model = model_cls(cfg).eval()
    with torch.no_grad():  # RMSNorm weights of 1.0 would hide a norm bug
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    return model


@torch.no_grad()
def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = []
    for _ in range(n):
        nxt = int(model(ids).logits[0, -1].argmax())
        out.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


@pytest.fixture(scope="module", params=list(SHAPES))
def pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = _hf_model(request.param, folder)
    engine = LLMEngine(EngineConfig(model=str(folder), block_size=4, num_blocks=256))
    return request.param, hf, engine


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def test_last_position_logits_match(pair):
    _, hf, engine = pair
    for i, prompt in enumerate(PROMPTS):
        seq = Sequence(f"logits-{i}", prompt, GREEDY)
        engine.block_manager.grow(seq, len(prompt))
        try:
            ours = engine.runner.execute([ScheduledSeq(seq, len(prompt))])[0]
        finally:
            engine.block_manager.free(seq)
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0, -1].float()
        assert torch.allclose(ours, ref, atol=1e-4, rtol=0), (ours - ref).abs().max()


def test_greedy_single_prompts_match_hf(pair):
    name, hf, engine = pair
    for prompt in PROMPTS:
        [ours] = engine.generate([prompt], GREEDY)
        assert ours == _hf_greedy(hf, prompt, MAX_TOKENS), f"{name}: prompt {prompt[:5]}..."
    assert engine.num_used_blocks == 0


def test_greedy_mixed_batch_matches_single(pair):
    name, hf, engine = pair
    batch = engine.generate(PROMPTS, GREEDY)
    for prompt, got in zip(PROMPTS, batch):
        assert got == _hf_greedy(hf, prompt, MAX_TOKENS), f"{name}: batched prompt {prompt[:5]}..."
    engine.block_manager.check_invariants()
    assert engine.num_used_blocks == 0


def test_sliding_window_caps_max_seq_len(tmp_path):
    import json

    _hf_model("mistral", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["sliding_window"] = 64
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    engine = LLMEngine(EngineConfig(model=str(tmp_path), block_size=4, num_blocks=64))
    assert engine.max_model_len == 64
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.add_request("long", list(range(3, 70)), GREEDY)
