"""Llama-family decoder (Llama 2/3, Mistral, Qwen2-style bias) over a paged KV cache.

Tokens arrive flattened across sequences (``[num_tokens]``), as in vLLM, so one
forward serves a mixed batch of prefills and decodes. Q/K/V and gate/up
projections are fused at load time: fewer, larger GEMMs matter on CPU and in
launch-bound GPU decode alike.

The forward is written once, here, over a small op set (``layer_ops.LayerOps``:
RMSNorm with a fused residual add, linear, SiLU×mul, rotary+KV store+attention, and
the compositions norm→linear, linear→add, SiLU×mul→linear→add that a GPU fuses at one token)
chosen when the engine builds the model: plain PyTorch on any device
(``TorchLayerOps``, Hugging Face's ``LlamaForCausalLM`` bit for bit on the CPU, so
greedy tokens match it exactly) or the fused Triton kernels on a GPU
(``cuda_ops.TritonLayerOps``). Editing the structure below changes what every
device runs, CUDA graphs included (they capture this forward).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from distserve.server.engine.attention import AttentionBackend, AttentionMetadata
from distserve.server.engine.model_config import ModelConfig
from distserve.server.engine.ops.layer_ops import LayerOps, RopeInputs, TorchLayerOps, rms_norm


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Standalone use; the model's forward goes through ``LayerOps.rms_norm``."""
        return rms_norm(x, self.weight, self.eps)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    rs = cfg.rope_scaling
    if rs.rope_type == "linear":
        inv_freq = inv_freq / rs.factor
    elif rs.rope_type == "yarn":
        inv_freq = _yarn_inv_freq(cfg, dim)
    elif rs.rope_type == "llama3":
        old_ctx = rs.original_max_position_embeddings
        low_wavelen = old_ctx / rs.low_freq_factor
        high_wavelen = old_ctx / rs.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
        smooth = (old_ctx / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


def _yarn_inv_freq(cfg: ModelConfig, dim: int) -> torch.Tensor:
    """YaRN's blend of interpolated and extrapolated frequencies, as transformers computes it."""
    rs, base = cfg.rope_scaling, cfg.rope_theta

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rs.original_max_position_embeddings / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rs.beta_fast), correction_dim(rs.beta_slow)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    # device="cpu": the model is built under torch.device("meta"), and these are real tables
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").to(dtype=torch.float) / dim)
    extrapolation = 1 - ramp
    return (1.0 / (rs.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_attention_factor(cfg: ModelConfig) -> float:
    """The factor YaRN scales cos and sin by (1.0 for every other RoPE type)."""
    rs = cfg.rope_scaling
    if rs.rope_type != "yarn":
        return 1.0
    if rs.attention_factor is not None:
        return rs.attention_factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if rs.mscale and rs.mscale_all_dim:
        return float(mscale(rs.factor, rs.mscale) / mscale(rs.factor, rs.mscale_all_dim))
    return mscale(rs.factor)


class RotaryEmbedding(nn.Module):
    """cos/sin tables indexed by absolute position; grown on demand."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # Plain attributes, not buffers: the model is built on the meta device and
        # these tables are (re)computed on the real one at first use.
        self.inv_freq = rope_inv_freq(cfg)
        self.attention_factor = rope_attention_factor(cfg)
        self._cache_len = 0
        # float32 tables on the device of first use, [cache_len, head_dim]; empty until then
        self._cos = self._sin = self._sin_signed = torch.empty(0)
        self._by_dtype: dict = {}

    def _build(self, length: int, device: torch.device) -> None:
        pos = torch.arange(length, device=device, dtype=torch.int64).float()
        freqs = torch.outer(pos, self.inv_freq.to(device))
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos, self._sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            self._cos, self._sin = self._cos * self.attention_factor, self._sin * self.attention_factor
        half = self._sin.shape[-1] // 2
        # sin with its first half negated: rotate_half(x) * sin == roll(x, half) * signed_sin exactly
        # ((-a) * b and a * (-b) round identically), one roll instead of two slices, a neg and a cat
        self._sin_signed = torch.cat((-self._sin[:, :half], self._sin[:, half:]), dim=-1)
        self._by_dtype = {}
        self._cache_len = length

    def float_tables(self, max_position: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Hugging Face's float32 ``(cos, sin)`` tables, ``[L, head_dim]`` with ``L > max_position``, on
        ``device`` (a tensor's, so with its index): what the fused RoPE kernel reads by position, rounding
        each value to the model dtype itself. The same tables back :meth:`tables`; they are rebuilt (at
        least doubled, at least 4096 rows) when a position outgrows them or the device changes."""
        if max_position >= self._cache_len or self._cos.device != device:
            self._build(max(2 * (max_position + 1), 4096), device)
        return self._cos, self._sin

    def tables(
        self, positions: torch.Tensor, dtype: torch.dtype, max_position: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, signed_sin)`` rows for ``positions`` as ``[T, 1, D]`` in ``dtype``, for
        ``layer_ops.apply_rope``."""
        self.float_tables(max_position, positions.device)
        tables = self._by_dtype.get(dtype)
        if tables is None:  # rounding the float32 table once equals rounding the rows picked from it
            tables = self._by_dtype[dtype] = (self._cos.to(dtype)[:, None, :], self._sin_signed.to(dtype)[:, None, :])
        return tables[0][positions], tables[1][positions]


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        # FP8 KV cache only (fp8.py): this layer's [K, V] scales and running amax, float32 views into the
        # runner's [num_layers, 2] tensors; None for a cache in the compute dtype
        self.kv_scale: torch.Tensor | None = None
        self.kv_amax: torch.Tensor | None = None
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        # Llama's attention_bias covers o_proj too; Qwen2 biases q/k/v only.
        o_bias = cfg.attention_bias and cfg.architecture != "Qwen2ForCausalLM"
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=o_bias)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(
        self,
        x: torch.Tensor | None,
        residual: torch.Tensor | None,
        rope: RopeInputs,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        ops: LayerOps,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``(MLP output not yet in the stream, residual stream)``. The previous layer's output ``x`` is added
        into the stream by this layer's first norm (in place), and this layer's MLP output by the next norm: an
        add+norm is one kernel on a GPU and the same single ``add_`` in PyTorch. Where an op added its output
        into the stream itself (a GPU's fused one-token GEMV), it returns None and the next norm only
        normalises. The first layer gets ``residual=None`` and the embeddings as ``x``, which become the
        stream."""
        attn, mlp = self.self_attn, self.mlp
        qkv = ops.norm_linear(x, self.input_layernorm, residual, attn.qkv_proj)
        if residual is None:
            assert x is not None
            residual = x
        h = ops.attention(attn, qkv, rope, kv_cache, meta, backend)
        out = ops.linear_add(h, attn.o_proj, residual)
        gate_up = ops.norm_linear(out, self.post_attention_layernorm, residual, mlp.gate_up_proj)
        return ops.silu_mul_linear_add(gate_up, mlp.down_proj, residual), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, ops: LayerOps | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.backend = backend
        # how the forward computes (layer_ops.select_layer_ops); the engine picks it with the backend, and
        # a benchmark may swap both (ops and backend must agree: TritonLayerOps needs backend.attend)
        self.ops: LayerOps = ops if ops is not None else TorchLayerOps()
        # nn.Embedding's own init, but skipped on the meta device (where the engine builds the model before it
        # loads or draws every weight): there a normal_ goes through torch._refs, whose first call imports
        # torch._dynamo, 1.5 s of CPU in every worker's start-up for a draw that is thrown away
        weight = torch.empty(cfg.vocab_size, cfg.hidden_size)
        if not weight.is_meta:
            nn.init.normal_(weight)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=weight)
        self.rotary = RotaryEmbedding(cfg)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self, input_ids, positions, kv_caches: list[torch.Tensor], meta: AttentionMetadata, max_position: int
    ) -> torch.Tensor:
        ops, backend = self.ops, self.backend
        x = F.embedding(input_ids, self.embed_tokens.weight)
        rope = ops.rope(self.rotary, positions, x.dtype, max_position)
        h: torch.Tensor | None = x
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            h, residual = layer.forward(h, residual, rope, kv_cache, meta, backend, ops)
        return ops.rms_norm(h, self.norm, residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.lm_head.weight, self.lm_head.bias)
        return logits if logits.dtype == torch.float32 else logits.float()

    # --- weights -----------------------------------------------------------
    @torch.no_grad()
    def load_hf_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up.

        Every parameter must be filled and every tensor consumed (a rotary
        ``inv_freq`` buffer excepted): a silently half-loaded model is the worst
        failure a loader can have.
        """
        sd = dict(state_dict)
        used: set[str] = set()

        def take(name: str) -> torch.Tensor:
            if name not in sd:
                raise ValueError(f"weights: missing tensor '{name}'")
            used.add(name)
            return sd[name]

        def copy(param: torch.Tensor, src: torch.Tensor, name: str) -> None:
            if tuple(param.shape) != tuple(src.shape):
                raise ValueError(f"weights: '{name}' has shape {tuple(src.shape)}, expected {tuple(param.shape)}")
            param.copy_(src)

        cfg = self.config
        copy(self.embed_tokens.weight, take("model.embed_tokens.weight"), "model.embed_tokens.weight")
        copy(self.norm.weight, take("model.norm.weight"), "model.norm.weight")
        if not cfg.tie_word_embeddings:
            copy(self.lm_head.weight, take("lm_head.weight"), "lm_head.weight")
        else:  # re-tie: moving modules between devices (to_empty) unties shared parameters
            self.lm_head.weight = self.embed_tokens.weight
            used.add("lm_head.weight")
        layer: Any
        for i, layer in enumerate(self.layers):  # Any: torch types submodules as Module | Tensor
            p = f"model.layers.{i}."
            att = layer.self_attn
            qkv = torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
            copy(att.qkv_proj.weight, qkv, p + "self_attn.qkv_proj.weight")
            if att.qkv_proj.bias is not None:
                copy(
                    att.qkv_proj.bias,
                    torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"]),
                    p + "self_attn.qkv_proj.bias",
                )
            copy(att.o_proj.weight, take(p + "self_attn.o_proj.weight"), p + "self_attn.o_proj.weight")
            if att.o_proj.bias is not None:
                copy(att.o_proj.bias, take(p + "self_attn.o_proj.bias"), p + "self_attn.o_proj.bias")
            mlp = layer.mlp
            gate_up = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
            copy(mlp.gate_up_proj.weight, gate_up, p + "mlp.gate_up_proj.weight")
            copy(mlp.down_proj.weight, take(p + "mlp.down_proj.weight"), p + "mlp.down_proj.weight")
            if mlp.gate_up_proj.bias is not None:
                copy(
                    mlp.gate_up_proj.bias,
                    torch.cat([take(p + "mlp.gate_proj.bias"), take(p + "mlp.up_proj.bias")]),
                    p + "mlp.gate_up_proj.bias",
                )
                copy(mlp.down_proj.bias, take(p + "mlp.down_proj.bias"), p + "mlp.down_proj.bias")
            copy(layer.input_layernorm.weight, take(p + "input_layernorm.weight"), p + "input_layernorm.weight")
            copy(
                layer.post_attention_layernorm.weight,
                take(p + "post_attention_layernorm.weight"),
                p + "post_attention_layernorm.weight",
            )
        extra = [n for n in sd if n not in used and not n.endswith("rotary_emb.inv_freq")]
        if extra:
            raise ValueError(f"weights: {len(extra)} unexpected tensor(s), e.g. '{extra[0]}'")
