"""Read a GGUF file (llama.cpp's format) as a Llama model: config, weights, tokenizer.

Only what ``server/engine/loader.py`` dispatches to; nothing else imports it.
The ``gguf`` package parses the file; quantized tensors (Q4_0, Q4_1, Q8_0,
K-quants, ...) are dequantized at load to the engine's dtype, so the engine
itself never sees a quantized weight. The result equals what Hugging Face
``transformers`` builds from the same file (``from_pretrained(dir,
gguf_file=...)``), which the tests check token for token:

* tensor names map onto Hugging Face's (``blk.3.attn_q.weight`` ->
  ``model.layers.3.self_attn.q_proj.weight``);
* llama.cpp's converter permutes the rows of Q and K so that its RoPE can
  rotate adjacent pairs; Hugging Face's RoPE rotates halves, so the
  permutation is undone here, exactly as transformers does;
* no ``output.weight`` means tied embeddings;
* the tokenizer is rebuilt from ``tokenizer.ggml.*`` (vocabulary, merges,
  token types) the way transformers' GGUF converter does: ``gpt2`` (byte-level
  BPE: SmolLM2, Llama 3, Qwen2) and ``llama`` (SentencePiece BPE with byte
  fallback: Llama 2, Mistral, TinyLlama). Where transformers misreads the
  metadata (it takes ``bos`` for ``eos`` and ignores ``add_bos_token``) we
  follow the file.
"""

from __future__ import annotations

import logging
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distserve.server.engine.gguf_file import GGUFFile
from distserve.server.engine.model_config import ModelConfig, RopeScaling, check_attention_shape

if TYPE_CHECKING:  # torch is imported where tensors are loaded: the router reads metadata and tokenizers only
    import torch

log = logging.getLogger(__name__)

SUPPORTED_GGUF_ARCHITECTURES = ("llama",)
_TOKEN_TYPE_CONTROL = 3  # llama.cpp: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def is_gguf_file(path: str | Path) -> bool:
    p = Path(path)
    return p.suffix.lower() == ".gguf"


def _reader(path: str | Path) -> GGUFFile:
    try:
        return GGUFFile(path)
    except (ValueError, OSError, struct.error) as e:
        raise ValueError(f"{path}: not a readable GGUF file ({e})") from None


@dataclass(frozen=True)
class GGUFMetadata:
    """The ``key -> value`` fields of a GGUF header (arrays as lists), tensors not read."""

    path: Path
    fields: dict[str, Any]
    tensor_names: tuple[str, ...]

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    @property
    def architecture(self) -> str:
        return str(self.fields.get("general.architecture", ""))

    def arch(self, key: str, default: Any = None) -> Any:
        return self.fields.get(f"{self.architecture}.{key}", default)


def read_metadata(path: str | Path) -> GGUFMetadata:
    return metadata_of(_reader(path), path)


def metadata_of(reader: GGUFFile, path: str | Path) -> GGUFMetadata:
    return GGUFMetadata(Path(path), reader.fields, tuple(t.name for t in reader.tensors))


def model_config(meta: GGUFMetadata) -> ModelConfig:
    """The engine's ``ModelConfig`` from GGUF metadata (transformers' GGUF_CONFIG_MAPPING for llama)."""
    arch = meta.architecture
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"{meta.path}: GGUF architecture {arch!r} is not supported; expected one of "
            f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)} (Llama-family models)"
        )

    def need(key: str) -> Any:
        v = meta.arch(key)
        if v is None:
            raise ValueError(f"{meta.path}: GGUF metadata is missing '{arch}.{key}'")
        return v

    if "rope_freqs.weight" in meta.tensor_names:
        raise ValueError(f"{meta.path}: per-frequency RoPE factors (rope_freqs, Llama 3.1 style) are not supported")
    n_heads = int(need("attention.head_count"))
    n_kv = int(meta.arch("attention.head_count_kv") or n_heads)
    hidden = int(need("embedding_length"))
    tokens = meta.get("tokenizer.ggml.tokens") or []
    vocab = int(meta.arch("vocab_size") or len(tokens))
    if not vocab:
        raise ValueError(f"{meta.path}: GGUF metadata has neither '{arch}.vocab_size' nor a tokenizer vocabulary")
    scaling = RopeScaling()
    if meta.arch("rope.scaling.type") == "linear":
        scaling = RopeScaling(rope_type="linear", factor=float(meta.arch("rope.scaling.factor", 1.0)))
    elif meta.arch("rope.scaling.type") not in (None, "none"):
        raise ValueError(f"{meta.path}: rope scaling {meta.arch('rope.scaling.type')!r} is not supported")
    head_dim = int(meta.arch("rope.dimension_count") or hidden // n_heads)
    check_attention_shape(str(meta.path), n_heads, n_kv, head_dim)
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_hidden_layers=int(need("block_count")),
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        max_position_embeddings=int(meta.arch("context_length", 2048)),
        rms_norm_eps=float(meta.arch("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(meta.arch("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        tie_word_embeddings="output.weight" not in meta.tensor_names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
        torch_dtype="float32",
    )


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's ``permute`` of Q/K rows (pairwise RoPE -> Hugging Face's half rotation)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _hf_name(name: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def load_state_dict(
    path: str | Path,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    meta: GGUFMetadata | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor of the file, dequantized to float32, unpermuted, cast to ``dtype``, under HF names."""
    import torch

    from distserve.server.engine.gguf_quants import dequantize

    reader = _reader(path)
    cfg = model_config(meta or metadata_of(reader, path))
    dev = torch.device(device)
    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        hf = _hf_name(t.name)
        if hf is None:
            raise ValueError(f"{path}: unexpected GGUF tensor '{t.name}' for a llama model")
        try:
            w = dequantize(t.data, t.tensor_type, t.shape)
        except ValueError as e:
            raise ValueError(f"{path}: tensor '{t.name}': {e}") from None
        if ".attn_q." in t.name:
            w = _unpermute(w, cfg.num_attention_heads)
        elif ".attn_k." in t.name:
            w = _unpermute(w, cfg.num_key_value_heads)
        if dtype is not None and w.dtype != dtype:
            w = w.to(dtype)
        out[hf] = w.contiguous().to(dev) if w.device != dev else w.contiguous()
    return out


# ----------------------------------------------------------------------------- tokenizer


def build_tokenizer(meta: GGUFMetadata):
    """``(tokenizers.Tokenizer, bos_id, eos_id, add_bos, chat_template)`` from ``tokenizer.ggml.*``."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = list(meta.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise ValueError(f"{meta.path}: GGUF file has no tokenizer (tokenizer.ggml.tokens)")
    if kind not in ("gpt2", "llama"):
        raise ValueError(f"{meta.path}: GGUF tokenizer model {kind!r} is not supported; expected gpt2 or llama")
    vocab = {t: i for i, t in enumerate(tokens)}
    raw_merges = meta.get("tokenizer.ggml.merges")
    if raw_merges:
        merges = [tuple(m.split(" ", 1)) for m in raw_merges]
    else:
        merges = _merges_from_scores(tokens, list(meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)))

    def tok_at(key: str) -> str | None:
        i = meta.get(key)
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    tok = Tokenizer(
        BPE(vocab, merges, unk_token=tok_at("tokenizer.ggml.unknown_token_id"), fuse_unk=True, byte_fallback=True)
    )
    if kind == "gpt2":
        tok.normalizer = normalizers.Sequence([])
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
    else:
        prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
        steps = [normalizers.Prepend("\u2581")] if prefix else []
        tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "\u2581")])
        dec = [decoders.ByteFallback(), decoders.Fuse(), decoders.Replace("\u2581", " ")]
        tok.decoder = decoders.Sequence(dec + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    types = meta.get("tokenizer.ggml.token_type")
    if types:
        special = [tokens[i] for i, t in enumerate(types) if t == _TOKEN_TYPE_CONTROL]
    else:
        special = [
            t
            for t in (
                tok_at("tokenizer.ggml.unknown_token_id"),
                tok_at("tokenizer.ggml.bos_token_id"),
                tok_at("tokenizer.ggml.eos_token_id"),
            )
            if t is not None
        ]
    if special:
        tok.add_special_tokens([AddedToken(s, normalized=False, special=True) for s in special])
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    template = meta.get("tokenizer.chat_template")
    return (
        tok,
        meta.get("tokenizer.ggml.bos_token_id"),
        meta.get("tokenizer.ggml.eos_token_id"),
        add_bos if isinstance(add_bos, bool) else kind == "llama",
        template if isinstance(template, str) else None,
    )


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece GGUFs carry scores, not merges: every split of a token into two vocabulary pieces
    is a merge, ranked by the token's score (transformers' GGUFTokenizerSkeleton, same order)."""
    vocab = {t: scores[i] for i, t in enumerate(tokens)}
    merges: list[tuple[str, str, float]] = []
    for piece, score in vocab.items():
        local = [
            (piece[:k], piece[k:], score) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab
        ]
        local.sort(key=lambda x: (vocab[x[0]], vocab[x[1]]), reverse=True)
        merges.extend(local)
    merges.sort(key=lambda m: m[2], reverse=True)
    return [(a, b) for a, b, _ in merges]
