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
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
# The keys each RoPE type reads (both the 4.x ``rope_scaling`` dict and the 5.x ``rope_parameters`` dict, which
# also carries ``rope_theta``). A key outside its type's set changes the rotary math in a way we do not follow,
# so it is refused, never ignored.
_ROPE_COMMON = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
_ROPE_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "dynamic": {"factor", "original_max_position_embeddings"},
    "yarn": {
        "factor",
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
    },
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
}
# Top-level config.json keys that change a Llama-family model's math in transformers, with the one value
# this engine implements. Keys transformers' Llama/Mistral/Qwen2 classes do not read change nothing there
# either and are ignored; these are refused when set to anything else.
_NEUTRAL = {
    "hidden_act": ("silu",),
    "partial_rotary_factor": (1, 1.0),
    "attn_logit_softcapping": (None,),
    "final_logit_softcapping": (None,),
    "query_pre_attn_scalar": (None,),
    "logit_scale": (None, 1, 1.0),
    "logits_scaling": (None, 1, 1.0),
    "embedding_multiplier": (None, 1, 1.0),
    "residual_multiplier": (None, 1, 1.0),
    "attention_multiplier": (None,),
    "use_qk_norm": (None, False),
    "qk_layernorm": (None, False),
    "no_rope_layers": (None,),
    "quantization_config": (None,),
}


@dataclass(frozen=True)
class RopeScaling:
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn only (transformers' defaults; attention_factor None = derived from factor and mscale)
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


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

        _refuse_unsupported_math(d)
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
        check_attention_shape("config.json", n_heads, n_kv, head_dim)
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
            rope_theta=_rope_theta(d),
            rope_scaling=_parse_rope_scaling(_rope_dict(d), int(d.get("max_position_embeddings", 2048))),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            torch_dtype=_dtype_name(d.get("torch_dtype") or d.get("dtype") or "float32"),
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


def check_attention_shape(where: str, n_heads: int, n_kv: int, head_dim: int) -> None:
    """Refuse, in one sentence naming ``where``, an attention shape the engine cannot compute: query heads not
    grouped evenly over the KV heads, or an odd head_dim (rotary embeddings rotate pairs of dimensions; an odd
    one loaded, then failed every request inside the forward)."""
    if n_heads % n_kv:
        raise ValueError(f"{where}: num_attention_heads={n_heads} is not a multiple of num_key_value_heads={n_kv}")
    if head_dim < 2 or head_dim % 2:
        raise ValueError(f"{where}: head_dim={head_dim} must be even (rotary embeddings rotate pairs of dimensions)")


def _refuse_unsupported_math(d: dict[str, Any]) -> None:
    for key, neutral in _NEUTRAL.items():
        if key in d and d[key] not in neutral:
            raise ValueError(
                f"config.json: {key}={d[key]!r} changes the model's math and this engine does not implement it "
                f"(it supports {neutral[0]!r} only)"
            )
    layer_types = d.get("layer_types")
    if layer_types is not None:
        odd = sorted({t for t in layer_types} - {"full_attention", "sliding_attention"})
        if odd:
            raise ValueError(f"config.json: layer_types {odd} are not supported (full and sliding attention only)")


def _rope_dict(d: dict[str, Any]) -> dict[str, Any] | None:
    """The RoPE parameters in either form: transformers 4.x's ``rope_scaling`` (``rope_theta`` beside it) or
    transformers 5's ``rope_parameters`` (``rope_theta`` inside). Both present and different: refused."""
    old, new = d.get("rope_scaling"), d.get("rope_parameters")
    if new is not None and not isinstance(new, dict):
        raise ValueError(f"config.json: rope_parameters must be an object, got {new!r}")
    if isinstance(new, dict) and new and all(isinstance(v, dict) for v in new.values()):
        raise ValueError(
            f"config.json: rope_parameters per layer type ({', '.join(sorted(new))}) is not supported; "
            "one set of RoPE parameters for every layer only"
        )
    if old and new:
        merged = {k: v for k, v in new.items() if k != "rope_theta"}
        plain = {k: v for k, v in old.items() if k != "rope_theta"}
        if _rope_type(merged) != _rope_type(plain) or {
            k: v for k, v in merged.items() if k not in ("type", "rope_type")
        } != {k: v for k, v in plain.items() if k not in ("type", "rope_type")}:
            raise ValueError("config.json: rope_scaling and rope_parameters are both given and disagree; keep one")
    return new or old


def _rope_type(rs: dict[str, Any]) -> str:
    return str(rs.get("rope_type") or rs.get("type") or "default")


def _rope_theta(d: dict[str, Any]) -> float:
    new = d.get("rope_parameters") or {}
    theta_new = new.get("rope_theta") if isinstance(new, dict) else None
    theta_old = d.get("rope_theta")
    if theta_new is not None and theta_old is not None and float(theta_new) != float(theta_old):
        raise ValueError(
            f"config.json: rope_theta={theta_old} and rope_parameters.rope_theta={theta_new} disagree; keep one"
        )
    theta = theta_new if theta_new is not None else theta_old
    return float(theta if theta is not None else 10000.0)


def _dtype_name(value: Any) -> str:
    """``torch_dtype`` (4.x) or ``dtype`` (5.x): "bfloat16", or "torch.bfloat16" as some tools write it."""
    return str(value).removeprefix("torch.")


def _parse_rope_scaling(rs: dict[str, Any] | None, max_position_embeddings: int = 2048) -> RopeScaling:
    if not rs:
        return RopeScaling()
    rope_type = _rope_type(rs)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"config.json: rope type {rope_type!r} is not supported; expected one of {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    unknown = sorted(set(rs) - _ROPE_COMMON - _ROPE_KEYS[rope_type])
    if unknown:
        raise ValueError(
            f"config.json: rope key(s) {', '.join(unknown)} are not understood for rope type {rope_type!r}; "
            "refusing to guess the rotary math"
        )
    if float(rs.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("config.json: partial_rotary_factor != 1 (partial RoPE) is not supported")
    if rope_type == "default":
        return RopeScaling()
    if "factor" not in rs:
        raise ValueError(f"config.json: rope type {rope_type!r} needs 'factor'")
    omp = rs.get("original_max_position_embeddings")
    if rope_type == "yarn":
        return RopeScaling(
            rope_type=rope_type,
            factor=float(rs["factor"]),
            original_max_position_embeddings=int(omp or max_position_embeddings),
            attention_factor=None if rs.get("attention_factor") is None else float(rs["attention_factor"]),
            beta_fast=float(rs.get("beta_fast") or 32.0),
            beta_slow=float(rs.get("beta_slow") or 1.0),
            mscale=None if rs.get("mscale") is None else float(rs["mscale"]),
            mscale_all_dim=None if rs.get("mscale_all_dim") is None else float(rs["mscale_all_dim"]),
            truncate=bool(rs.get("truncate", True)),
        )
    return RopeScaling(
        rope_type=rope_type,
        factor=float(rs.get("factor", 1.0)),
        low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(omp or (8192 if rope_type == "llama3" else max_position_embeddings)),
    )
