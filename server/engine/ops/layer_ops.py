"""The op set the model's forward is written over, and its PyTorch implementation.

``LlamaForCausalLM.forward`` (``model.py``) is written once, over five ops:
RMSNorm with an optional fused residual add, linear, SiLU×mul, and
rotary+KV-store+attention (plus the per-step rotary inputs those need), and three
compositions of them that a GPU fuses at one token (``norm_linear``: RMSNorm then a
linear; ``linear_add``: a linear added into the residual stream;
``silu_mul_linear_add``: SiLU×mul, a linear, the add). Which
implementation runs is chosen when the engine builds the model
(``select_layer_ops``) and can be swapped by assigning ``model.ops``:

* ``TorchLayerOps`` (here): plain PyTorch on any device. Its arithmetic is Hugging
  Face's ``LlamaForCausalLM``, bit for bit on the CPU (RMSNorm in float32; RoPE
  equal to ``rotate_half``'s), and it dispatches exactly the aten ops the model
  issued before the op set existed: a tiny model's CPU step is dispatch-bound.
* ``TritonLayerOps`` (``cuda_ops.py``): the fused Triton kernels on a CUDA device
  whose attention backend can attend without writing the cache (``attend``).

The residual stream is carried the way the fused kernel wants it (vLLM's form):
a layer returns its MLP output and the stream separately, and the next norm adds
the one into the other before normalising. In PyTorch that add is the same single
in-place ``add_`` the layer used to do itself, so nothing changes on the CPU. A
fused GEMV may instead add its output into the stream itself (``linear_add`` and
``silu_mul_linear_add`` return None): the next norm then only normalises.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from distserve.server.engine.attention import AttentionBackend, AttentionMetadata
from distserve.server.engine.ops.protocols import RopeInputs

if TYPE_CHECKING:  # the model's modules as the ops read them: the ops never import model.py
    from distserve.server.engine.ops.protocols import LlamaAttention, RMSNorm, RotaryEmbedding


class LayerOps(Protocol):
    """How one forward computes; ``model.py`` decides what is computed, in which order."""

    name: str  # "torch" | "triton"; logged at start-up

    def rope(
        self, rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype, max_position: int
    ) -> RopeInputs:
        """Once per forward: the rotary inputs of this step's tokens for every layer's ``attention``."""
        ...

    def rms_norm(self, x: torch.Tensor | None, norm: RMSNorm, residual: torch.Tensor | None) -> torch.Tensor:
        """``norm(x)``; with a ``residual``: ``residual += x`` in place, then ``norm(residual)``; ``x`` None:
        ``norm(residual)`` (the stream already holds the last output)."""
        ...

    def linear(self, x: torch.Tensor, layer: nn.Linear) -> torch.Tensor: ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of a fused ``[T, 2 * I]`` gate/up projection (gate first)."""
        ...

    # The three compositions the model calls (the ops above are their parts): a GPU fuses each into one kernel
    # at one token. The residual add of ``linear_add`` and ``silu_mul_linear_add`` is done now or left to the
    # next norm: they return the addend still to add, or None when the stream holds it already.

    def norm_linear(
        self, x: torch.Tensor | None, norm: RMSNorm, residual: torch.Tensor | None, layer: nn.Linear
    ) -> torch.Tensor:
        """``linear(rms_norm(x, norm, residual), layer)``."""
        ...

    def linear_add(self, x: torch.Tensor, layer: nn.Linear, residual: torch.Tensor) -> torch.Tensor | None:
        """``residual += linear(x, layer)``, now (returns None) or by the next norm (returns ``linear(x)``)."""
        ...

    def silu_mul_linear_add(
        self, gate_up: torch.Tensor, layer: nn.Linear, residual: torch.Tensor
    ) -> torch.Tensor | None:
        """``residual += linear(silu_mul(gate_up), layer)``, now or by the next norm, as ``linear_add``."""
        ...

    def attention(
        self,
        attn: LlamaAttention,
        qkv: torch.Tensor,
        rope: RopeInputs,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """RoPE on q and k of a fused ``[T, (H + 2 Hkv) D]`` projection, K/V stored at ``meta.slot_mapping``,
        attention over the cache; returns ``[T, H * D]``."""
        ...


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``x [T, heads, D]`` with tables from ``RotaryEmbedding.tables``: Hugging Face's
    ``x * cos + rotate_half(x) * sin``, bit for bit, in four ops (``roll`` by half a head times a sin
    whose first half is negated; ``(-a) * b`` and ``a * (-b)`` round identically)."""
    out = x * cos
    return out.add_(torch.roll(x, x.shape[-1] // 2, -1).mul_(signed_sin))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's ``LlamaRMSNorm``: statistics in float32, cast back before the weight."""
    dtype = x.dtype
    if dtype == torch.float32:  # same arithmetic, minus two no-op casts (a dispatch each, every layer)
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(eps)))
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


class TorchLayerOps:
    """Plain PyTorch. Linears are called without the module machinery (``F.linear``) and every op is the
    one the pre-op-set model dispatched: on a CPU a tiny model's step is mostly dispatch."""

    name = "torch"

    def rope(
        self, rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype, max_position: int
    ) -> RopeInputs:
        return rotary.tables(positions, dtype, max_position)

    def rms_norm(self, x: torch.Tensor | None, norm: RMSNorm, residual: torch.Tensor | None) -> torch.Tensor:
        if x is None:
            assert residual is not None
            return rms_norm(residual, norm.weight, norm.eps)
        return rms_norm(x if residual is None else residual.add_(x), norm.weight, norm.eps)

    def linear(self, x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
        return F.silu(gate).mul_(up)

    # the compositions, through the ops above (a subclass that changes one, e.g. FP8 linears, changes these);
    # the residual add is always left to the next norm: the same single add_ as before the compositions existed

    def norm_linear(
        self, x: torch.Tensor | None, norm: RMSNorm, residual: torch.Tensor | None, layer: nn.Linear
    ) -> torch.Tensor:
        return self.linear(self.rms_norm(x, norm, residual), layer)

    def linear_add(self, x: torch.Tensor, layer: nn.Linear, residual: torch.Tensor) -> torch.Tensor | None:
        return self.linear(x, layer)

    def silu_mul_linear_add(
        self, gate_up: torch.Tensor, layer: nn.Linear, residual: torch.Tensor
    ) -> torch.Tensor | None:
        return self.linear(self.silu_mul(gate_up), layer)

    def attention(
        self,
        attn: LlamaAttention,
        qkv: torch.Tensor,
        rope: RopeInputs,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """q and k are rotated together (rotation is per head); the backend stores K/V and attends."""
        cos, signed_sin = rope
        t, nq, nkv, d = qkv.shape[0], attn.num_heads, attn.num_kv_heads, attn.head_dim
        qk = apply_rope(qkv[:, : attn.q_size + attn.kv_size].view(t, nq + nkv, d), cos, signed_sin)
        v = qkv[:, attn.q_size + attn.kv_size :].view(t, nkv, d)
        if attn.kv_scale is None:
            return backend.forward(qk[:, :nq], qk[:, nq:], v, kv_cache, meta, attn.scale).reshape(t, attn.q_size)
        # an FP8 cache (fp8.py): the backend quantises on write and dequantises on read with these scales
        o = backend.forward(  # type: ignore[call-arg]  # FP8-capable backends only (engine checks)
            qk[:, :nq], qk[:, nq:], v, kv_cache, meta, attn.scale, kv_scale=attn.kv_scale, kv_amax=attn.kv_amax
        )
        return o.reshape(t, attn.q_size)


def select_layer_ops(
    backend: AttentionBackend, device: torch.device, head_dim: int, fuse_gemv: bool = True
) -> LayerOps:
    """The fused Triton ops where they apply (CUDA, Triton importable, a backend with ``attend``, a
    power-of-two head size), PyTorch otherwise. ``fuse_gemv``: the Triton ops' one-token GEMVs take the
    norm / SiLU prologues and the residual-add epilogue (``TritonLayerOps.fuse_gemv``)."""
    if device.type == "cuda":
        from distserve.server.engine.ops.cuda_ops import TritonLayerOps, can_fuse

        if can_fuse(backend, head_dim):
            return TritonLayerOps(fuse_gemv=fuse_gemv)
    return TorchLayerOps()


__all__ = ["LayerOps", "RopeInputs", "TorchLayerOps", "apply_rope", "rms_norm", "select_layer_ops"]
