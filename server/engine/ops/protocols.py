"""What the ops read from the model's modules, as structural types, so no op module imports ``model.py``.

``model.py``'s ``RMSNorm``, ``RotaryEmbedding`` and ``LlamaAttention`` have these members (mypy checks it
where the model hands its modules to the ops); the names are the model's, so the ops' signatures read as
they did when they imported the classes themselves.
"""

from __future__ import annotations

from typing import Protocol

import torch

# Per-step rotary inputs, opaque to the model: what ``LayerOps.rope`` returns is handed to every layer's
# ``LayerOps.attention``. PyTorch: ``(cos, signed_sin)`` rows of the step's positions; Triton:
# ``(positions, cos, sin)`` with the whole float32 tables.
RopeInputs = tuple[torch.Tensor, ...]


class RMSNorm(Protocol):
    @property
    def weight(self) -> torch.Tensor: ...

    @property
    def eps(self) -> float: ...


class RotaryEmbedding(Protocol):
    def tables(
        self, positions: torch.Tensor, dtype: torch.dtype, max_position: int
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def float_tables(self, max_position: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]: ...


class LlamaAttention(Protocol):
    """One layer's attention shapes and, with an FP8 KV cache, its scales (``fp8.py``)."""

    @property
    def num_heads(self) -> int: ...

    @property
    def num_kv_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...

    @property
    def q_size(self) -> int: ...

    @property
    def kv_size(self) -> int: ...

    @property
    def scale(self) -> float: ...

    @property
    def kv_scale(self) -> torch.Tensor | None: ...

    @property
    def kv_amax(self) -> torch.Tensor | None: ...
