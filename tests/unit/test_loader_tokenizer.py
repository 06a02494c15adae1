"""Weights loader, tokenizer and tiny-model builder."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from distserve.server.engine.loader import find_weight_files, load_state_dict, resolve_model_path
from distserve.server.engine.model_config import ModelConfig
from distserve.server.engine.tiny_model import (
    build_byte_fallback_tokenizer,
    default_tiny_model_path,
    ensure_default_tiny_model,
    make_tiny_model,
)
from distserve.server.engine.tokenizer import IncrementalDetokenizer, Tokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]

TEXTS = [
    "",
    "Hello, world!  Two spaces, a tab\tand a newline\n.",
    "你好，世界。大型语言模型",
    "emoji 🙂👍🏽 family 👨‍👩‍👧 flag 🇫🇷",
    "héllo 世界 🙂",
    "▁ literal metaspace and \ufffd replacement char",
    "<s> looks special </s>",
]


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTSERVE_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", layers=2)


def _hash_folder(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def _assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k


# ---------------------------------------------------------------------------- tiny model


def test_tiny_model_folder_contents(tiny):
    names = {p.name for p in tiny.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    } <= names
    cfg = json.loads((tiny / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["model_type"] == "llama"
    assert cfg["bos_token_id"] == 1 and cfg["eos_token_id"] == 2
    assert cfg["torch_dtype"] == "float32"
    mc = ModelConfig.from_folder(tiny)
    assert (mc.hidden_size, mc.intermediate_size, mc.num_hidden_layers) == (256, 688, 2)
    assert (mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim) == (4, 4, 64)
    assert mc.vocab_size == 512 and mc.eos_token_ids == (2,)

    sd = load_state_dict(tiny)
    assert sd["model.embed_tokens.weight"].shape == (512, 256)
    assert sd["model.layers.1.mlp.down_proj.weight"].shape == (256, 688)
    assert sd["lm_head.weight"].shape == (512, 256)
    w = sd["model.layers.0.self_attn.q_proj.weight"]
    assert abs(w.std().item() - 0.02) < 0.002
    norm = sd["model.layers.0.input_layernorm.weight"]
    assert abs(norm.mean().item() - 1.0) < 0.05 and norm.std().item() > 0.01  # not all ones


def test_make_tiny_model_is_deterministic(tmp_path):
    a = make_tiny_model(tmp_path / "a", layers=1, hidden=64, heads=2, kv_heads=1, vocab=300)
    b = make_tiny_model(tmp_path / "b", layers=1, hidden=64, heads=2, kv_heads=1, vocab=300)
    ha, hb = _hash_folder(a), _hash_folder(b)
    assert ha == hb and "model.safetensors" in ha
    c = make_tiny_model(tmp_path / "c", layers=1, hidden=64, heads=2, kv_heads=1, vocab=300, seed=1)
    assert _hash_folder(c)["model.safetensors"] != ha["model.safetensors"]


def test_make_tiny_model_options(tmp_path):
    d = make_tiny_model(
        tmp_path / "t",
        layers=1,
        hidden=128,
        heads=4,
        kv_heads=2,
        vocab=259,
        tie_word_embeddings=True,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        dtype="bfloat16",
    )
    mc = ModelConfig.from_folder(d)
    assert mc.intermediate_size == 344  # int(8/3*128)=341 -> 344
    assert mc.tie_word_embeddings and mc.rope_scaling.rope_type == "linear"
    assert mc.num_queries_per_kv == 2 and mc.torch_dtype == "bfloat16"
    sd = load_state_dict(d)
    assert "lm_head.weight" not in sd
    assert sd["model.layers.0.self_attn.k_proj.weight"].shape == (64, 128)
    assert all(t.dtype == torch.bfloat16 for t in sd.values())
    assert Tokenizer.from_folder(d).vocab_size == 259


def test_make_tiny_model_rejects_small_vocab(tmp_path):
    with pytest.raises(ValueError, match="at least 259"):
        make_tiny_model(tmp_path / "x", vocab=258)


def test_tokenizer_files_match_transformers_save_pretrained(tmp_path, tiny):
    from transformers import PreTrainedTokenizerFast

    ref = PreTrainedTokenizerFast(
        tokenizer_object=build_byte_fallback_tokenizer(512),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )
    ref.save_pretrained(tmp_path / "ref")
    for name in ("tokenizer.json", "special_tokens_map.json"):
        assert json.loads((tmp_path / "ref" / name).read_text()) == json.loads((tiny / name).read_text()), name
    ours = json.loads((tiny / "tokenizer_config.json").read_text())
    theirs = json.loads((tmp_path / "ref" / "tokenizer_config.json").read_text())
    for key in ("model_max_length", "chat_template"):
        ours.pop(key, None)
        theirs.pop(key, None)
    assert ours == theirs


# ---------------------------------------------------------------------------- loader


def test_loader_matches_transformers(tiny):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny, torch_dtype=torch.float32)
    ref = {k: v.detach() for k, v in model.state_dict().items()}
    ours = load_state_dict(tiny)
    _assert_same_tensors(ours, ref)

    half = load_state_dict(tiny, dtype=torch.float16)
    assert all(t.dtype == torch.float16 for t in half.values())
    assert torch.equal(half["lm_head.weight"], ref["lm_head.weight"].half())


def test_loader_sharded_and_missing_shard(tiny, tmp_path):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny, torch_dtype=torch.float32)
    d = tmp_path / "sharded"
    model.save_pretrained(d, max_shard_size="200KB", safe_serialization=True)
    shards = sorted(d.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 3
    assert (d / "model.safetensors.index.json").is_file()
    assert not (d / "model.safetensors").exists()
    assert find_weight_files(d) == shards

    _assert_same_tensors(load_state_dict(d), load_state_dict(tiny))

    # Index names a tensor that no shard has.
    index_path = d / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    good = json.dumps(index)
    index["weight_map"]["model.layers.9.bogus.weight"] = shards[0].name
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"model\.layers\.9\.bogus\.weight"):
        load_state_dict(d)
    index_path.write_text(good)

    # A shard the index lists is gone.
    victim = shards[1]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=victim.name):
        load_state_dict(d)


def test_loader_unindexed_multiple_files(tiny, tmp_path):
    from safetensors.torch import save_file

    sd = load_state_dict(tiny)
    names = sorted(sd)
    d = tmp_path / "multi"
    d.mkdir()
    save_file({k: sd[k] for k in names[: len(names) // 2]}, str(d / "part-a.safetensors"))
    save_file({k: sd[k] for k in names[len(names) // 2 :]}, str(d / "part-b.safetensors"))
    _assert_same_tensors(load_state_dict(d), sd)

    save_file({names[0]: sd[names[0]]}, str(d / "part-c.safetensors"))
    with pytest.raises(ValueError, match="appears in both"):
        load_state_dict(d)


def test_loader_refuses_pickle_and_empty(tmp_path):
    d = tmp_path / "bin_only"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "pytorch_model.bin").write_bytes(b"not really a pickle")
    with pytest.raises(ValueError, match="(?i)safetensors") as ei:
        load_state_dict(d)
    assert "pytorch_model.bin" in str(ei.value) and "arbitrary code" in str(ei.value)

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_state_dict(empty)
    with pytest.raises(FileNotFoundError):
        load_state_dict(tmp_path / "does-not-exist")


def test_resolve_model_path(tmp_path, tiny):
    assert resolve_model_path(str(tiny)) == tiny.resolve()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_path(str(tmp_path / "nope"))
    noconf = tmp_path / "noconf"
    noconf.mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model_path(noconf)

    p = resolve_model_path(None)
    assert p == default_tiny_model_path()
    assert p.parent == tmp_path / "cache"
    assert ModelConfig.from_folder(p).num_hidden_layers == 4


# ---------------------------------------------------------------------------- tokenizer


def test_tokenizer_roundtrip_and_specials(tiny):
    tok = Tokenizer.from_folder(tiny)
    assert tok.kind == "tokenizers"
    assert tok.vocab_size == 512
    assert tok.bos_token_id == 1 and tok.eos_token_id == 2 and tok.eos_token_ids == (2,)
    assert tok.chat_template
    for s in TEXTS[:-1]:
        ids = tok.encode(s)
        assert ids[0] == 1
        assert tok.encode(s, add_bos=False) == ids[1:]
        assert all(3 <= i < 259 for i in ids[1:])
        assert tok.decode(ids) == s
        assert tok.decode(ids, skip_special_tokens=False) == "<s>" + s
        assert tok.decode(ids[1:], skip_special_tokens=False) == tok._tok.decode(ids[1:], skip_special_tokens=False)
    assert tok.encode("") == [1]
    # Like transformers, special-token text in the input is parsed as the special token.
    ids = tok.encode(TEXTS[-1])
    assert ids[:2] == [1, 1] and ids[-1] == 2
    assert tok.decode(ids, skip_special_tokens=False) == "<s>" + TEXTS[-1]
    assert tok.decode([]) == ""
    assert tok.decode([1, 3 + ord("a"), 2], skip_special_tokens=False) == "<s>a</s>"
    assert tok.decode([1, 3 + ord("a"), 2, 100000, -1]) == "a"  # out-of-range ids are dropped
    assert tok.decode([400]) == "<extra_141>" == tok._tok.decode([400])  # filler tokens decode as their text
    assert tok.encode_batch(["ab", ""]) == [[1, 3 + 97, 3 + 98], [1]]


def test_tokenizer_matches_transformers(tiny):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny)
    tok = Tokenizer.from_folder(tiny)
    for s in TEXTS:
        assert tok.encode(s) == hf.encode(s), s
        ids = tok.encode(s)
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True), s
    assert hf.bos_token_id == tok.bos_token_id and hf.eos_token_id == tok.eos_token_id


def test_byte_fallback_tokenizer_when_no_tokenizer_json(tmp_path, tiny):
    d = tmp_path / "notok"
    d.mkdir()
    (d / "config.json").write_text((tiny / "config.json").read_text())
    tok = Tokenizer.from_folder(d)
    assert tok.kind == "byte"
    assert tok.vocab_size == 259 and tok.bos_token_id == 1 and tok.eos_token_id == 2
    ref = Tokenizer.from_folder(tiny)
    for s in TEXTS[:-1]:
        assert tok.encode(s) == ref.encode(s)  # same id scheme as the tiny model's tokenizer
        assert tok.decode(tok.encode(s)) == s
    assert tok.decode([1, 3 + 104, 2], skip_special_tokens=False) == "<s>h</s>"
    assert tok.token_to_id("<0x41>") == 3 + 0x41 and tok.id_to_token(2) == "</s>"

    (d / "tokenizer.model").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_folder(d)


@pytest.mark.parametrize("kind", ["tokenizers", "byte"])
def test_incremental_detokenizer_streams_complete_characters(tiny, kind):
    tok = Tokenizer.from_folder(tiny) if kind == "tokenizers" else Tokenizer.byte_tokenizer()
    s = "héllo 世界 🙂"
    ids = tok.encode(s)
    det = tok.incremental_detokenizer()
    pieces = [det.push(i) for i in ids]
    tail = det.flush()
    assert "".join(pieces) + tail == s
    assert tail == ""
    assert not any("\ufffd" in p for p in pieces)
    nonempty = [p for p in pieces if p]
    assert nonempty == list(s)  # one piece per character, emitted as soon as it is complete
    # The 4-byte emoji is held back for three tokens, then released whole.
    assert pieces[-4:] == ["", "", "", "🙂"]


def test_incremental_detokenizer_invalid_and_truncated_bytes(tiny):
    tok = Tokenizer.from_folder(tiny)
    b = lambda x: x + 3  # noqa: E731
    # Lone continuation byte, then 'a': the replacement char appears immediately, not the whole run.
    ids = [b(0x80), b(ord("a")), b(0xE4), b(0xB8), b(0x96), b(0xE4), b(0xB8)]
    det = IncrementalDetokenizer(tok)
    pieces = [det.push(i) for i in ids]
    assert pieces == ["\ufffd", "a", "", "", "世", "", ""]
    assert det.flush() == "\ufffd"
    assert "".join(pieces) + "\ufffd" == tok.decode(ids)
    # special tokens are skipped by default and kept on request
    det = tok.incremental_detokenizer(skip_special_tokens=False)
    assert det.push_many([1, b(ord("x")), 2]) == "<s>x</s>"


def test_fast_decode_equals_tokenizers_for_llama_and_bytelevel_styles():
    """The byte-table decode path agrees with `tokenizers` on the decoder layouts it claims."""
    from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as HFTok

    # Llama-2 style: ▁ metaspace with merges, Replace + ByteFallback + Fuse + Strip.
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for i in range(256):
        vocab[f"<0x{i:02X}>"] = 3 + i
    for w in ["▁", "h", "e", "l", "o", "▁h", "▁he", "▁hel", "▁hell", "▁hello", "w", "r", "d"]:
        vocab.setdefault(w, len(vocab))
    merges = [("▁", "h"), ("▁h", "e"), ("▁he", "l"), ("▁hel", "l"), ("▁hell", "o")]
    llama = HFTok(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    llama.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    llama.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    llama.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])

    # GPT-2 / Qwen style byte-level BPE (no merges).
    bl_vocab = {c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    bl = HFTok(models.BPE(vocab=bl_vocab, merges=[]))
    bl.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bl.decoder = decoders.ByteLevel()
    bl.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False)])

    # bench/peers/make_peer_model.py style: a bare ByteFallback decoder and no post-processor (no bos added).
    peer = build_byte_fallback_tokenizer(512)
    peer.decoder = decoders.ByteFallback()
    peer.post_processor = None
    peer_tok = Tokenizer(peer, bos_token_id=1, eos_token_id=2)
    assert peer_tok._table is not None and not peer_tok.add_bos_token
    assert peer_tok.encode("hi") == [3 + ord("h"), 3 + ord("i")]

    for backend in (llama, bl, peer):
        tok = Tokenizer(backend, bos_token_id=None, eos_token_ids=())
        assert tok._table is not None
        for s in TEXTS[1:] + ["hello world", " hello  hello", "  x"]:
            ids = backend.encode(s).ids
            for skip in (True, False):
                assert tok.decode(ids, skip) == backend.decode(ids, skip_special_tokens=skip), (s, skip)
            det = tok.incremental_detokenizer()
            assert det.push_many(ids) + det.flush() == backend.decode(ids), s

    # A decoder we do not model falls back to `tokenizers` and the windowed detokenizer.
    wp = HFTok(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    wp.pre_tokenizer = pre_tokenizers.Whitespace()
    wp.decoder = decoders.WordPiece()
    tok = Tokenizer(wp)
    assert tok._table is None
    ids = wp.encode("a b a").ids
    assert tok.decode(ids) == wp.decode(ids)
    det = tok.incremental_detokenizer()
    assert det.push_many(ids) + det.flush() == wp.decode(ids)


# ---------------------------------------------------------------------------- default model


@pytest.mark.slow
def test_ensure_default_tiny_model_concurrent(tmp_path, monkeypatch):
    cache = tmp_path / "shared-cache"
    go = tmp_path / "go"
    script = (
        "import os, sys, time\n"
        "from distserve.server.engine.tiny_model import ensure_default_tiny_model\n"
        f"go = {str(go)!r}\n"
        "while not os.path.exists(go): time.sleep(0.005)\n"
        "print(ensure_default_tiny_model())\n"
    )
    env = dict(os.environ, DISTSERVE_CACHE_DIR=str(cache), PYTHONPATH=str(REPO_ROOT))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    time.sleep(0.5)
    go.write_text("go")
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    paths = {out.strip() for out, _ in outs}
    final = cache / "tiny-llama-v1"
    assert paths == {str(final)}
    assert sorted(p.name for p in cache.iterdir()) == ["tiny-llama-v1"]  # no temp dirs left behind

    mc = ModelConfig.from_folder(final)
    assert (mc.num_hidden_layers, mc.hidden_size, mc.intermediate_size, mc.vocab_size) == (4, 256, 688, 512)
    assert (mc.num_attention_heads, mc.num_key_value_heads, mc.max_position_embeddings) == (4, 4, 2048)
    ref = make_tiny_model(tmp_path / "ref", layers=4, hidden=256, heads=4, kv_heads=4, vocab=512, seed=0)
    assert _hash_folder(final) == _hash_folder(ref)

    # A damaged cache entry is moved aside and rebuilt.
    monkeypatch.setenv("DISTSERVE_CACHE_DIR", str(cache))
    (final / "model.safetensors").unlink()
    assert ensure_default_tiny_model() == final
    assert _hash_folder(final) == _hash_folder(ref)
    assert sorted(p.name for p in cache.iterdir()) == ["tiny-llama-v1"]


def test_default_tiny_model_path_env(monkeypatch, tmp_path):
    monkeypatch.setenv("DISTSERVE_CACHE_DIR", str(tmp_path / "a"))
    assert default_tiny_model_path() == tmp_path / "a" / "tiny-llama-v1"
    monkeypatch.delenv("DISTSERVE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_tiny_model_path() == tmp_path / "xdg" / "distserve" / "tiny-llama-v1"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_tiny_model_path() == tmp_path / "home" / ".cache" / "distserve" / "tiny-llama-v1"
