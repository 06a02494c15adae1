"""A tiny random-weight Llama in Hugging Face format, built deterministically.

``make_tiny_model`` writes a folder that ``transformers.LlamaForCausalLM``,
``transformers.AutoTokenizer``, vLLM and our own engine can all load:

* ``config.json`` / ``generation_config.json`` (Llama, bos=1, eos=2),
* ``model.safetensors`` with Hugging Face parameter names and weights drawn
  from ``torch.Generator().manual_seed(seed)`` (normal, std 0.02; RMSNorm
  weights are ``1 + N(0, 0.1)`` so that a missing/incorrect norm shows up),
* a byte-fallback BPE tokenizer: ``<unk>``=0, ``<s>``=1, ``</s>``=2, the 256
  byte tokens ``<0x00>``..``<0xFF>`` at ids 3..258, filler tokens
  ``<extra_N>`` up to ``vocab``; no merges, no normalizer, decoder
  ``ByteFallback + Fuse``. Every string is encoded as its UTF-8 bytes, so
  ``decode(encode(s)) == s`` for any text (including a literal ``"▁"``, which a
  Llama-style ``Replace(" ", "▁")`` normalizer would not round-trip without a
  ``"▁"`` vocab entry).

The tokenizer files are written by hand, with exactly the content that
``PreTrainedTokenizerFast(...).save_pretrained`` produces (checked by the unit
tests), so that creating the model needs no ``transformers`` at run time.
Two calls with the same arguments produce byte-identical folders.

``ensure_default_tiny_model`` materialises the default model once per cache
directory, atomically, safe against several processes racing to create it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where weights are drawn: finding the model (the launcher) needs none
    import torch

DEFAULT_TINY_MODEL_NAME = "tiny-llama-v1"
DEFAULT_TINY_MODEL_KWARGS: dict[str, Any] = dict(
    layers=4,
    hidden=256,
    heads=4,
    kv_heads=4,
    intermediate=688,
    vocab=512,
    max_positions=2048,
    seed=0,
)

NUM_SPECIAL_TOKENS = 3  # <unk>, <s>, </s>
BYTE_TOKEN_OFFSET = NUM_SPECIAL_TOKENS
MIN_VOCAB = NUM_SPECIAL_TOKENS + 256  # 259

_DTYPES = ("float32", "float16", "bfloat16")  # torch dtypes, by name
_INIT_STD = 0.02
_NORM_NOISE_STD = 0.1
_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")

# A plain chat template so /v1/chat/completions works against the tiny model.
_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def default_intermediate_size(hidden: int) -> int:
    """Llama's SwiGLU sizing: int(8/3 * hidden) rounded up to a multiple of 8 (256 -> 688)."""
    raw = (8 * hidden) // 3
    return ((raw + 7) // 8) * 8


def make_tiny_model(
    out_dir: str | Path,
    *,
    layers: int = 4,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 4,
    intermediate: int | None = None,
    vocab: int = 512,
    max_positions: int = 2048,
    seed: int = 0,
    tie_word_embeddings: bool = False,
    rope_theta: float = 10000.0,
    rope_scaling: dict[str, Any] | None = None,
    dtype: str = "float32",
) -> Path:
    """Write a Hugging Face Llama folder with random weights to ``out_dir`` and return its path."""
    if vocab < MIN_VOCAB:
        raise ValueError(
            f"vocab={vocab} is too small: the byte-fallback tokenizer needs at least "
            f"{MIN_VOCAB} ids (3 special tokens + 256 byte tokens)."
        )
    if layers < 1:
        raise ValueError(f"layers={layers} must be at least 1.")
    if hidden < 1 or heads < 1 or kv_heads < 1:
        raise ValueError("hidden, heads and kv_heads must all be positive.")
    if hidden % heads:
        raise ValueError(f"hidden={hidden} is not a multiple of heads={heads}.")
    if heads % kv_heads:
        raise ValueError(f"heads={heads} is not a multiple of kv_heads={kv_heads}.")
    head_dim = hidden // heads
    if head_dim % 2:
        raise ValueError(f"head_dim={head_dim} (hidden/heads) must be even for rotary embeddings.")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; expected one of {', '.join(_DTYPES)}.")
    if intermediate is None:
        intermediate = default_intermediate_size(hidden)
    if intermediate < 1:
        raise ValueError(f"intermediate={intermediate} must be positive.")
    if max_positions < 1:
        raise ValueError(f"max_positions={max_positions} must be positive.")

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    config = {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": _INIT_STD,
        "intermediate_size": intermediate,
        "max_position_embeddings": max_positions,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": rope_scaling,
        "rope_theta": float(rope_theta),
        "tie_word_embeddings": bool(tie_word_embeddings),
        "torch_dtype": dtype,
        "use_cache": True,
        "vocab_size": vocab,
    }
    _write_json(out / "config.json", config)
    _write_json(
        out / "generation_config.json",
        {"_from_model_config": True, "bos_token_id": 1, "eos_token_id": 2},
    )

    import torch

    tensors = _random_weights(
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate=intermediate,
        vocab=vocab,
        seed=seed,
        tie_word_embeddings=tie_word_embeddings,
        dtype=getattr(torch, dtype),
    )
    from safetensors.torch import save_file

    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out / "model.safetensors", 0o666 & ~_umask())  # safetensors creates it 0600; match its siblings

    write_byte_fallback_tokenizer(out, vocab=vocab, model_max_length=max_positions)
    return out


def _random_weights(
    *,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    intermediate: int,
    vocab: int,
    seed: int,
    tie_word_embeddings: bool,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    import torch

    g = torch.Generator().manual_seed(seed)

    def linear(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, dtype=torch.float32) * _INIT_STD).to(dtype)

    def norm(n: int) -> torch.Tensor:
        noise = torch.randn(n, generator=g, dtype=torch.float32) * _NORM_NOISE_STD
        return (1.0 + noise).to(dtype)

    # Fixed draw order: changing it changes every weight of the default model.
    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": linear(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = linear(heads * head_dim, hidden)
        t[p + "self_attn.k_proj.weight"] = linear(kv_heads * head_dim, hidden)
        t[p + "self_attn.v_proj.weight"] = linear(kv_heads * head_dim, hidden)
        t[p + "self_attn.o_proj.weight"] = linear(hidden, heads * head_dim)
        t[p + "mlp.gate_proj.weight"] = linear(intermediate, hidden)
        t[p + "mlp.up_proj.weight"] = linear(intermediate, hidden)
        t[p + "mlp.down_proj.weight"] = linear(hidden, intermediate)
        t[p + "input_layernorm.weight"] = norm(hidden)
        t[p + "post_attention_layernorm.weight"] = norm(hidden)
    t["model.norm.weight"] = norm(hidden)
    if not tie_word_embeddings:
        # Tied models omit lm_head.weight, as transformers' save_pretrained does.
        t["lm_head.weight"] = linear(vocab, hidden)
    return {k: v.contiguous() for k, v in t.items()}


def build_byte_fallback_tokenizer(vocab: int = 512):
    """The ``tokenizers.Tokenizer`` object of the tiny model (see module docstring)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    if vocab < MIN_VOCAB:
        raise ValueError(f"vocab={vocab} is too small: the byte-fallback tokenizer needs at least {MIN_VOCAB} ids.")
    table: dict[str, int] = {tok: i for i, tok in enumerate(_SPECIAL_TOKENS)}
    for b in range(256):
        table[f"<0x{b:02X}>"] = BYTE_TOKEN_OFFSET + b
    for n in range(vocab - MIN_VOCAB):
        table[f"<extra_{n}>"] = MIN_VOCAB + n
    model = models.BPE(vocab=table, merges=[], unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    tok = Tokenizer(model)
    # No normalizer / pre-tokenizer: every character falls back to its UTF-8 bytes.
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in _SPECIAL_TOKENS])
    return tok


def write_byte_fallback_tokenizer(out_dir: str | Path, *, vocab: int = 512, model_max_length: int = 2048) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json.

    Same content as ``PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>",
    eos_token="</s>", unk_token="<unk>").save_pretrained(out_dir)`` plus
    ``model_max_length`` and a plain ``chat_template``.
    """
    out = Path(out_dir)
    tok = build_byte_fallback_tokenizer(vocab)
    tok.save(str(out / "tokenizer.json"), pretty=True)
    added = {
        str(i): {
            "content": s,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, s in enumerate(_SPECIAL_TOKENS)
    }
    _write_json(
        out / "tokenizer_config.json",
        {
            "added_tokens_decoder": added,
            "bos_token": "<s>",
            "chat_template": _CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "eos_token": "</s>",
            "extra_special_tokens": {},
            "model_max_length": model_max_length,
            "tokenizer_class": "PreTrainedTokenizerFast",
            "unk_token": "<unk>",
        },
    )
    _write_json(
        out / "special_tokens_map.json",
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
    )


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------- default model


def default_tiny_model_path() -> Path:
    """``$DISTSERVE_CACHE_DIR`` or ``$XDG_CACHE_HOME/distserve`` or ``~/.cache/distserve``, + ``tiny-llama-v1``."""
    root = os.environ.get("DISTSERVE_CACHE_DIR")
    if root:
        base = Path(root).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "distserve"
    return base / DEFAULT_TINY_MODEL_NAME


_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def _is_complete(folder: Path) -> bool:
    return folder.is_dir() and all((folder / f).is_file() for f in _REQUIRED_FILES)


def ensure_default_tiny_model() -> Path:
    """Create the default tiny model once (atomically) and return its folder.

    The model is written into a private temporary folder next to the final one
    and renamed into place; when several processes race, the first rename wins
    and the others discard their copy. A folder left incomplete by something
    else (e.g. a user deleting a file) is moved aside and rebuilt.
    """
    final = default_tiny_model_path()
    if _is_complete(final):
        return final
    parent = final.parent
    parent.mkdir(parents=True, exist_ok=True)

    if final.exists() and not _is_complete(final):
        aside = parent / f".{final.name}.broken-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(final, aside)
        except FileNotFoundError:
            pass  # someone else moved it already
        else:
            shutil.rmtree(aside, ignore_errors=True)

    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-{os.getpid()}-", dir=parent))
    try:
        os.chmod(tmp, 0o755)
        make_tiny_model(tmp, **DEFAULT_TINY_MODEL_KWARGS)
        try:
            os.rename(tmp, final)
        except OSError:
            # Lost the race (rename onto a non-empty directory fails): use the winner's copy.
            if not _is_complete(final):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
