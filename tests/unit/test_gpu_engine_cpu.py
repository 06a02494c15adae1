"""CPU-side behaviour of the GPU engine pieces: backend resolution, presets, graph-size buckets."""

from __future__ import annotations

import pytest
import torch

from distserve.server.engine.attention import get_attention_backend
from distserve.server.engine.cuda_graph_runner import capture_sizes
from distserve.server.engine.presets import init_random_weights, is_preset, preset_config


def test_auto_is_cpu_paged_or_sdpa_on_cpu_and_gpu_names_refused():
    from distserve.server.engine.attention.cpu_paged import available

    assert get_attention_backend("auto", torch.device("cpu")).name == ("cpu_paged" if available() else "sdpa")
    assert get_attention_backend("sdpa", torch.device("cpu")).name == "sdpa"
    for name in ("triton", "flash_attn_v2"):
        with pytest.raises(ValueError, match="needs a CUDA device"):
            get_attention_backend(name, torch.device("cpu"))


def test_presets():
    assert is_preset("preset:llama-2-7b") and not is_preset("/models/x") and not is_preset(None)
    cfg = preset_config("preset:llama-2-7b")
    assert (
        cfg.hidden_size,
        cfg.num_hidden_layers,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.intermediate_size,
        cfg.vocab_size,
    ) == (4096, 32, 32, 32, 11008, 32000)
    with pytest.raises(ValueError, match="unknown model preset"):
        preset_config("preset:nope")


def test_preset_engine_on_cpu_is_finite_and_deterministic():
    from distserve.server.engine.llm_engine import EngineConfig, LLMEngine
    from distserve.server.engine.sampling_params import SamplingParams

    cfg = EngineConfig(model="preset:tiny-gpu", dtype="float32", num_blocks=64, max_model_len=128)
    eng = LLMEngine(cfg)
    assert eng.model_path is None and eng.runner.graph_runner is None
    w = eng.model.layers[0].mlp.down_proj.weight
    assert torch.isfinite(w).all() and 0.015 < w.std().item() < 0.025
    assert torch.equal(eng.model.norm.weight, torch.ones_like(eng.model.norm.weight))
    p = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    out = eng.generate([[5, 6, 7]], p)
    assert out == LLMEngine(cfg).generate([[5, 6, 7]], p)  # same seed, same weights


def test_capture_sizes():
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert capture_sizes(48) == [1, 2, 4, 8, 16, 32, 64]
    assert capture_sizes(1) == [1]


def test_init_random_weights_seeded():
    from distserve.server.engine.attention import SdpaBackend
    from distserve.server.engine.model import LlamaForCausalLM

    a = LlamaForCausalLM(preset_config("tiny-gpu"), SdpaBackend())
    b = LlamaForCausalLM(preset_config("tiny-gpu"), SdpaBackend())
    init_random_weights(a, seed=1)
    init_random_weights(b, seed=1)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
