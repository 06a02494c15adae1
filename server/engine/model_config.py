"""Model shape, read once from a Hugging Face ``config.json`` and frozen.

The engine never reads the raw JSON again: everything that depends on the
architecture (RoPE variant, GQA ratio, head dim, tied embeddings) is decided
here so that a malformed folder fails at load time with the key's name.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    # Mistral-style sliding-window attention. We attend to the full context, which is
    # identical only while a sequence fits in the window: the engine caps max_model_len to it.
    sliding_window: int | None = None

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def fingerprint(self) -> str:
        """Stable digest of everything a KV cache layout depends on."""
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        def need(key: str) -> Any:
            if key not in d:
                raise ValueError(f"config.json: missing required key '{key}'")
            return d[key]

        archs = d.get("architectures") or ["LlamaForCausalLM"]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"config.json: architectures={archs!r} is not supported; "
                f"expected one of {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        n_heads = int(need("num_attention_heads"))
        n_kv = int(d.get("num_key_value_heads") or n_heads)
        hidden = int(need("hidden_size"))
        head_dim = int(d.get("head_dim") or hidden // n_heads)
        if n_heads % n_kv:
            raise ValueError(
                f"config.json: num_attention_heads={n_heads} is not a multiple of num_key_value_heads={n_kv}"
            )
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        # Qwen2 always has q/k/v bias; Llama states it explicitly.
        attention_bias = bool(d.get("attention_bias", arch == "Qwen2ForCausalLM"))
        return cls(
            architecture=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=int(need("num_hidden_layers")),
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv,
            head_dim=head_dim,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(d.get("rope_theta", 10000.0)),
            rope_scaling=_parse_rope_scaling(d.get("rope_scaling")),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "float32"),
            sliding_window=(
                int(d["sliding_window"]) if d.get("sliding_window") and d.get("use_sliding_window", True) else None
            ),
        )

    @classmethod
    def from_folder(cls, path: str | Path) -> ModelConfig:
        p = Path(path) / "config.json"
        if not p.is_file():
            raise FileNotFoundError(f"{path}: no config.json (is this a Hugging Face model folder?)")
        return cls.from_hf_dict(json.loads(p.read_text()))


def _parse_rope_scaling(rs: dict[str, Any] | None) -> RopeScaling:
    if not rs:
        return RopeScaling()
    rope_type = rs.get("rope_type") or rs.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"config.json: rope_scaling.rope_type={rope_type!r} is not supported; "
            f"expected one of {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return RopeScaling(
        rope_type=rope_type,
        factor=float(rs.get("factor", 1.0)),
        low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 8192)),
    )
