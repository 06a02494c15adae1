"""Model-shape presets with random weights made directly on the target device.

``EngineConfig(model="preset:llama-2-7b", device="cuda")`` builds a Llama-2-7B
shaped engine without any file: no download, no 13 GB checkpoint, weights drawn
on the GPU in a second. Used by the GPU benchmarks and tests, where only the
shape (bytes moved, FLOPs) matters, never the text.

Initialisation: every matrix N(0, 0.02) (the Llama/HF ``initializer_range``),
RMSNorm weights 1, biases 0, drawn from a seeded generator on the device; with
these the residual stream of the 32-layer model stays O(10) and every
activation finite in bf16.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeGuard

from distserve.server.engine.model_config import ModelConfig

if TYPE_CHECKING:  # torch is imported where weights are drawn: the shapes (preflight, the launcher) need none
    import torch

PRESET_PREFIX = "preset:"
INIT_STD = 0.02


def _llama(**shape) -> ModelConfig:
    """A Llama-architecture config: head_dim 128, bf16, Llama-2 norms/RoPE/ids unless given."""
    defaults = dict(
        architecture="LlamaForCausalLM",
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        bos_token_id=1,
        eos_token_ids=(2,),
        torch_dtype="bfloat16",
    )
    return ModelConfig(**{**defaults, **shape})


PRESETS: dict[str, ModelConfig] = {
    "llama-2-7b": _llama(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=4096,
    ),
    # Llama-3-8B shape (GQA 4:1), for the kernel's grouped path.
    "llama-3-8b": _llama(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        bos_token_id=128000,
        eos_token_ids=(128001,),
    ),
    # Small shapes for GPU tests (seconds to build, same code paths).
    "tiny-gpu": _llama(
        vocab_size=1024,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=8192,
    ),
    "tiny-gpu-gqa": _llama(
        vocab_size=1024,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=8192,
    ),
}


def is_preset(model: str | None) -> TypeGuard[str]:
    return isinstance(model, str) and model.startswith(PRESET_PREFIX)


def preset_config(model: str) -> ModelConfig:
    name = model[len(PRESET_PREFIX) :] if is_preset(model) else model
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN, _MIX1, _MIX2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def counter_normal(n: int, seed: int, offset: int, device: torch.device) -> torch.Tensor:
    """N(0, 1) float32 draws number ``offset .. offset + n`` of stream ``seed``: splitmix64 of the counter,
    then Box-Muller. Element-wise, so the values do not depend on the launch grid — torch's own CUDA
    generator sizes its grid from the SM count, which an MPS thread percentage lowers: two workers at
    different SM shares would make different "same" preset weights (and be refused as a model mismatch)."""
    import torch

    key = _signed(((seed * 0x5851F42D + 1) * (_GOLDEN % (1 << 64))) % (1 << 64))
    z = torch.arange(offset, offset + n, dtype=torch.int64, device=device) + key
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    z = z ^ _shr(z, 31)
    u1 = ((_shr(z, 40) & 0xFFFFFF).to(torch.float32) + 0.5) / 16777216.0
    u2 = (_shr(z, 16) & 0xFFFFFF).to(torch.float32) / 16777216.0
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(6.283185307179586 * u2)


def init_random_weights(model: torch.nn.Module, seed: int = 0, std: float = INIT_STD) -> None:
    """Fill every parameter in place on its own device: norms 1, biases 0, matrices N(0, std). On CUDA
    the draws come from :func:`counter_normal` (the same weights whatever share of the SMs the process has)."""
    import torch

    with torch.no_grad():
        params = list(model.named_parameters())
        device = params[0][1].device if params else torch.device("cpu")
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        drawn = 0
        for name, p in params:
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            elif device.type == "cuda":
                flat = p.view(-1)
                step = 1 << 24
                for i in range(0, flat.numel(), step):
                    chunk = flat[i : i + step]
                    chunk.copy_(counter_normal(chunk.numel(), seed, drawn + i, device) * std)
                drawn += flat.numel()
            elif p.dtype in (torch.float16, torch.bfloat16):
                # draw in float32 chunk by chunk (normal_ on bf16 is fine too, this keeps draws dtype-independent)
                flat = p.view(-1)
                step = 1 << 26
                for i in range(0, flat.numel(), step):
                    chunk = flat[i : i + step]
                    chunk.copy_(torch.randn(chunk.shape, generator=gen, device=device, dtype=torch.float32) * std)
            else:
                p.normal_(0.0, std, generator=gen)
        if getattr(model.config, "tie_word_embeddings", False):
            model.lm_head.weight = model.embed_tokens.weight  # type: ignore[union-attr]  # modules typed loosely by torch
