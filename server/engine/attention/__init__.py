"""Attention backends behind one interface; ``get_attention_backend`` resolves names."""

from __future__ import annotations

import torch

from distserve.server.engine.attention.base import AttentionBackend, AttentionMetadata
from distserve.server.engine.attention.sdpa import SdpaBackend

BACKEND_NAMES = ("auto", "sdpa", "cpu_paged", "flash_attn_v2", "triton")


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKEND_NAMES)}; got {name!r}")
    if name == "auto" and device.type == "cuda":  # GPU: the Triton paged-decode backend when Triton imports
        from distserve.server.engine.attention.triton_decode import HAS_TRITON, TritonBackend

        if HAS_TRITON:
            return TritonBackend()
    if name in ("auto", "cpu_paged") and device.type == "cpu":  # CPU: the paged C++ decode kernel when it builds
        from distserve.server.engine.attention.cpu_paged import CpuPagedBackend, unavailable_reason

        if CpuPagedBackend.available():
            return CpuPagedBackend()
        if name == "cpu_paged":
            raise ValueError(f"attention_backend 'cpu_paged' is not available: {unavailable_reason()}")
    if name in ("auto", "sdpa"):
        return SdpaBackend()
    if name == "cpu_paged":
        raise ValueError(f"attention_backend 'cpu_paged' runs on the CPU only; use 'auto' on {device.type}")
    if device.type != "cuda":
        raise ValueError(f"attention_backend {name!r} needs a CUDA device; use 'sdpa' or 'auto' on {device.type}")
    if name == "triton":
        from distserve.server.engine.attention.triton_decode import HAS_TRITON, TritonBackend

        if HAS_TRITON:
            return TritonBackend()
    if name == "flash_attn_v2":
        from distserve.server.engine.attention.flash_attn_backend import HAS_FLASH_ATTN, FlashAttnBackend

        if HAS_FLASH_ATTN:
            return FlashAttnBackend()
    raise ValueError(f"attention_backend {name!r} is not available in this build; use 'sdpa' or 'auto'")


__all__ = ["AttentionBackend", "AttentionMetadata", "SdpaBackend", "get_attention_backend", "BACKEND_NAMES"]
