"""Model folders in both config forms transformers writes load to the same math as transformers.

transformers 4.x writes ``rope_theta`` and ``rope_scaling`` beside the shape; transformers 5 writes
``rope_parameters`` (``rope_theta`` inside it) and ``dtype``. transformers 5 is not installed here, so the
5.x folder is the 4.x folder with its ``config.json`` rewritten by hand into that form (same weights).
Before: a 5.x folder was read as rope_theta 10000 with no scaling, silently. A field that changes the math
and is not understood is refused with one sentence (exit 2), never ignored.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from distserve.server.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from distserve.server.engine.model_config import ModelConfig  # noqa: E402
from distserve.server.engine.sampling_params import SamplingParams  # noqa: E402
from distserve.server.engine.scheduler import ScheduledSeq  # noqa: E402
from distserve.server.engine.sequence import Sequence  # noqa: E402

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=300)
CASES = {
    # rope_theta far from 10000 and llama3 scaling: what the 5.x form hid
    "llama3_gqa": dict(
        num_key_value_heads=2,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    # yarn (new here), with an explicit head_dim that is not hidden/heads, and tied embeddings
    "yarn_head_dim_tied": dict(
        num_key_value_heads=4,
        head_dim=24,
        tie_word_embeddings=True,
        rope_theta=20000.0,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    ),
    "linear": dict(num_key_value_heads=1, rope_scaling={"type": "linear", "factor": 2.0}),
    "dynamic": dict(num_key_value_heads=2, rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
}
PROMPTS = [[1, 17, 42, 99, 5], list(range(1, 40))]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _to_v5(folder_v4, folder_v5) -> dict:
    """The same weights with config.json in transformers 5's form: rope_parameters, dtype."""
    shutil.copytree(folder_v4, folder_v5)
    cfg = json.loads((folder_v4 / "config.json").read_text())
    rope = {"rope_theta": cfg.pop("rope_theta", 10000.0), **(cfg.pop("rope_scaling", None) or {"rope_type": "default"})}
    if "type" in rope:
        rope["rope_type"] = rope.pop("type")
    cfg["rope_parameters"] = rope
    cfg["dtype"] = cfg.pop("torch_dtype", "float32")
    cfg["transformers_version"] = "5.0.0"
    (folder_v5 / "config.json").write_text(json.dumps(cfg))
    return cfg


@torch.no_grad()
def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    for _ in range(n):
        ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt) :].tolist()


@pytest.mark.parametrize("name", list(CASES))
def test_both_config_forms_give_transformers_tokens(tmp_path, name):
    cfg = transformers.LlamaConfig(
        max_position_embeddings=128, initializer_range=0.15, torch_dtype="float32", **SHAPE, **CASES[name]
    )
    torch.manual_seed(7)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path / "v4", safe_serialization=True)
    v5 = _to_v5(tmp_path / "v4", tmp_path / "v5")
    assert "rope_theta" not in v5 and "rope_scaling" not in v5 and "torch_dtype" not in v5
    want = [_hf_greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS]
    with torch.no_grad():
        want_logits = hf(torch.tensor([PROMPTS[1]])).logits[0, -1]
    for form in ("v4", "v5"):
        # sdpa: the rotary math is under test, not the paged kernel (whose first build costs ~30 s alone)
        cfg_e = EngineConfig(model=str(tmp_path / form), block_size=4, num_blocks=128, attention_backend="sdpa")
        engine = LLMEngine(cfg_e)
        assert engine.model_config.rope_theta == cfg.rope_theta, form
        assert engine.generate(PROMPTS, GREEDY) == want, f"{name} {form}"
        seq = Sequence(f"logits-{form}", PROMPTS[1], GREEDY)
        engine.block_manager.grow(seq, len(PROMPTS[1]))
        try:
            ours = engine.runner.execute([ScheduledSeq(seq, len(PROMPTS[1]))])[0]
        finally:
            engine.block_manager.free(seq)
        assert torch.allclose(ours, want_logits, atol=1e-4, rtol=0), (form, (ours - want_logits).abs().max())


def test_dynamic_rope_caps_max_seq_len_to_the_exact_range(tmp_path):
    cfg = transformers.LlamaConfig(
        max_position_embeddings=64, **SHAPE, rope_scaling={"rope_type": "dynamic", "factor": 2.0}
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path, safe_serialization=True)
    engine = LLMEngine(
        EngineConfig(str(tmp_path), block_size=4, num_blocks=64, max_model_len=256, attention_backend="sdpa")
    )
    assert engine.max_model_len == 64


BASE = {"architectures": ["LlamaForCausalLM"], **SHAPE, "num_key_value_heads": 4}


@pytest.mark.parametrize(
    "extra,words",
    [
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0]}}, "'longrope'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "beta_fast": 3}}, "beta_fast"),
        ({"rope_parameters": {"full_attention": {"rope_type": "default"}}}, "per layer type"),
        ({"rope_theta": 1e4, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}, "disagree"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
    ],
)
def test_fields_that_change_the_math_are_refused(extra, words):
    with pytest.raises(ValueError, match="config.json") as e:
        ModelConfig.from_hf_dict({**BASE, **extra})
    assert words in str(e.value)


def test_fields_that_change_nothing_are_read():
    mc = ModelConfig.from_hf_dict({**BASE, "dtype": "torch.bfloat16", "use_cache": True, "pretraining_tp": 1})
    assert mc.torch_dtype == "bfloat16" and mc.rope_theta == 10000.0 and mc.rope_scaling.rope_type == "default"


def test_an_unknown_rope_type_is_one_sentence_exit_2_through_the_cli(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({**BASE, "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}})
    )
    r = subprocess.run(
        [sys.executable, "-m", "distserve.server.cli", "serve", "--model", str(tmp_path), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "'longrope' is not supported" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_an_odd_head_dim_is_one_sentence_exit_2_through_the_cli(tmp_path):
    """Rotary embeddings rotate pairs of dimensions: an odd head_dim (hidden 150 / 2 heads = 75) cannot be served.
    Before: the folder loaded, `serve` said ready, and every request failed inside the forward ("The size of tensor
    a (75) must match the size of tensor b (76)")."""
    odd = {**BASE, "hidden_size": 150, "num_attention_heads": 2, "num_key_value_heads": 2}
    with pytest.raises(ValueError, match="head_dim=75"):
        ModelConfig.from_hf_dict(odd)
    with pytest.raises(ValueError, match="head_dim=75"):
        ModelConfig.from_hf_dict({**BASE, "head_dim": 75})
    (tmp_path / "config.json").write_text(json.dumps(odd))
    r = subprocess.run(
        [sys.executable, "-m", "distserve.server.cli", "serve", "--model", str(tmp_path), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "head_dim=75" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
