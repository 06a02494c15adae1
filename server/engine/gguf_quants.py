"""Dequantize the common GGUF block types with torch (all cores) instead of numpy (one core).

Q4_0, Q4_1 and Q8_0 cover most small published GGUFs (SmolLM2's is Q4_1 +
Q8_0); the arithmetic is the ``gguf`` package's, operation for operation, so
the result is bit-identical (the tests compare). Every other type goes
through ``gguf.dequantize``. Measured on SmolLM2-135M (210 Q4_1 tensors):
see docs/performance/engine-cpu.md, 'A real model: SmolLM2-135M-Instruct'.
"""

from __future__ import annotations

import numpy as np
import torch

_BLOCK = 32  # weights per block for all three types


def _blocks(raw: np.ndarray, block_bytes: int) -> torch.Tensor:
    data = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, block_bytes)
    return torch.from_numpy(data.copy() if not data.flags.writeable else data)


def _scale(b: torch.Tensor, start: int) -> torch.Tensor:
    return b[:, start : start + 2].contiguous().view(torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes -> 32 values: low nibbles first, then high nibbles (ggml's order)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def dequantize_q4_0(raw: np.ndarray) -> torch.Tensor:
    b = _blocks(raw, 2 + _BLOCK // 2)
    q = (_nibbles(b[:, 2:]).to(torch.int8) - 8).to(torch.float32)
    return _scale(b, 0) * q


def dequantize_q4_1(raw: np.ndarray) -> torch.Tensor:
    b = _blocks(raw, 4 + _BLOCK // 2)
    return _scale(b, 0) * _nibbles(b[:, 4:]).to(torch.float32) + _scale(b, 2)


def dequantize_q8_0(raw: np.ndarray) -> torch.Tensor:
    b = _blocks(raw, 2 + _BLOCK)
    return b[:, 2:].contiguous().view(torch.int8).to(torch.float32) * _scale(b, 0)


_TORCH_DEQUANT = {"Q4_0": dequantize_q4_0, "Q4_1": dequantize_q4_1, "Q8_0": dequantize_q8_0}


def dequantize(raw: np.ndarray, qtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A float32 tensor of ``shape`` (outermost first) from a GGUF tensor's raw bytes and ggml type."""
    name = qtype.name
    fast = _TORCH_DEQUANT.get(name)
    if fast is not None:
        return fast(raw).reshape(shape)
    data = np.ascontiguousarray(raw).view(np.uint8)
    if name == "F32":
        return torch.from_numpy(data.view(np.float32).copy()).reshape(shape)
    if name == "F16":
        return torch.from_numpy(data.view(np.float16).astype(np.float32)).reshape(shape)
    if name == "BF16":
        return torch.from_numpy(data.view(np.int16).copy()).view(torch.bfloat16).to(torch.float32).reshape(shape)
    try:
        from gguf import GGMLQuantizationType
        from gguf import dequantize as gguf_dequantize
    except ImportError:
        raise ValueError(f"quantization {name} needs the 'gguf' package (pip install gguf)") from None
    try:
        w = gguf_dequantize(data.reshape(shape[0] if shape else 1, -1), GGMLQuantizationType(qtype.value))
    except NotImplementedError:
        raise ValueError(f"quantization {name} cannot be dequantized by the gguf package") from None
    return torch.from_numpy(np.array(w, dtype=np.float32)).reshape(shape)
