"""FP8 (e4m3) storage for decode: weights with per-output-channel scales, and the KV cache's scales.

Two things are stored in FP8, each with float32 scales (``x ≈ q * scale``):

* **Weights** of the decoder linears (q/k/v, o, gate/up, down) when ``decode.weight_dtype`` is ``fp8``:
  one scale per output channel (row of ``W [N, K]``), ``scale = amax(row) / 448``, so every row uses the
  whole e4m3 range. Embeddings, norms and the LM head stay in the compute dtype. A linear then is
  ``y = (x @ q.T) * scale (+ bias)``: the scale is per output column, so it is applied once to the
  float32 accumulator, never to the weight. On a GPU the kernels of ``fp8_linear.py`` read the e4m3 bytes
  directly; everywhere else (the CPU's emulated path, tests) ``q`` is widened to the compute dtype first
  (e4m3 values are exact in bf16 and float32, so the emulation computes the same function).
* **The KV cache** when ``cache.kv_dtype`` is ``fp8_e4m3``: one K and one V scale per layer, device
  tensors the kernels read (so CUDA graphs see a new scale without recapture). ``KVCalibration`` starts
  from a safe scale (``cache.kv_scale_init``), records the running K/V amax of what is written, and after
  the first ``cache.kv_calibration_requests`` finished requests sets ``scale = amax * headroom / 448`` and
  re-quantises the cache once in place (the entries written meanwhile stay valid).

CPU tensors of float8 dtypes lack ``index_copy_``/``index_select`` in torch: data movement goes through
``uint8`` views of the same bytes (``as_bytes``).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# calibrated scale = amax * HEADROOM / FP8_MAX: values up to 1.25x the calibration amax still fit
HEADROOM = 1.25
MIN_SCALE = 1e-8  # an all-zero layer keeps a finite, positive scale
_F32 = torch.finfo(torch.float32)
FP8_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_DTYPE


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The same storage as ``uint8`` (for copies of float8 tensors, which lack index ops on the CPU)."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t


def quantize(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """``x / scale`` rounded to e4m3 (round to nearest even), saturated at +-448 (no inf/NaN from range)."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize(q: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale).to(dtype)


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [N, K] e4m3, scale [N] float32)`` with ``w ≈ q * scale[:, None]``; ``amax(row) -> 448``."""
    amax = w.float().abs().amax(dim=1)
    scale = (amax / FP8_MAX).clamp_(min=MIN_SCALE)
    return quantize(w, scale[:, None]), scale


MSE_STEPS = 16  # quantize_per_channel_mse: candidate scales amax/448 * 2^(-j/16), j < 16 (one binade)


def quantize_per_channel_mse(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per output channel like ``quantize_per_channel``, but each row's scale is the one of least squared
    error among ``amax/448 * 2^(-j/16)``, ``j < 16``: e4m3 is floating point, so where a row's values fall
    on its grid depends on the scale's position inside a binade (a smaller scale may clip the row's
    largest value a little and round the rest better). The same format and kernels; only load time grows
    (16 quantisations per weight, one row block at a time)."""
    w32 = w.float()
    s0 = (w32.abs().amax(dim=1) / FP8_MAX).clamp_(min=MIN_SCALE)
    best_s = s0.clone()
    best_err = torch.full_like(s0, math.inf)
    for j in range(MSE_STEPS):
        s = s0 * 2.0 ** (-j / MSE_STEPS)
        err = (quantize(w32, s[:, None]).float() * s[:, None] - w32).pow_(2).sum(dim=1)
        take = err < best_err
        best_s = torch.where(take, s, best_s)
        best_err = torch.where(take, err, best_err)
    return quantize(w32, best_s[:, None]), best_s


# ---------------------------------------------------------------------------------------------- weights


def bf16_layer_set(rule: str, num_layers: int) -> set[int]:
    """Decoder layers an FP8-weight model keeps in the compute dtype: ``none``, or ``first_last`` (layers 0
    and L-1: on SmolLM2-135M they carry almost half the weights' FP8 error for 2/30 of the bytes,
    docs/performance/fp8.md)."""
    if rule == "none":
        return set()
    if rule == "first_last":
        return {0, num_layers - 1}
    raise ValueError(f"fp8_bf16_layers must be none or first_last, got {rule!r}")


ROUNDINGS = ("nearest", "gptq")  # decode.fp8_weight_rounding (server/config.py lists the same choices)


def quantize_model_weights(
    model: nn.Module,
    keep_layers: set[int] | frozenset[int] = frozenset(),
    rounding: str = "nearest",
    calibration: torch.Tensor | None = None,
) -> dict[str, Any]:
    """Replace the decoder linears' weights by e4m3 + per-output-channel scales (``weight_scale``), in place.

    ``rounding``: ``nearest`` (each weight to its nearest e4m3 value under the row's MSE-chosen scale) or
    ``gptq`` (the same scales, the rounding chosen to minimise each linear's output error on the
    ``calibration`` token ids ``[n, seq_len]``, layer by layer: ``fp8_gptq.py``). Same format either way.
    The first rows of the first layer's q/k/v weight are kept as they were loaded (``fingerprint_rows``):
    the worker's model fingerprint digests them, and a bf16 prefill worker must match an FP8 decode one.
    Layers in ``keep_layers`` stay as loaded. Returns what was converted (bytes before/after)."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"fp8_weight_rounding must be nearest or gptq, got {rounding!r}")
    before = after = 0
    layers: Any = model.layers

    def install(i: int, name: str, mod: Any, q: torch.Tensor, scale: torch.Tensor) -> None:
        nonlocal before, after
        w = mod.weight.detach()
        if i == 0 and name == "self_attn.qkv_proj":
            mod.fingerprint_rows = w[:4].clone()
        before += w.numel() * w.element_size()
        after += q.numel() + scale.numel() * 4
        mod.weight = nn.Parameter(q, requires_grad=False)
        mod.register_buffer("weight_scale", scale, persistent=False)
        mod.gemv_cfg = None  # the bf16 GEMV tuning does not apply

    report: dict[str, Any] = {"rounding": rounding}
    if rounding == "gptq":
        from distserve.server.engine.fp8_gptq import gptq_quantize_layers

        if calibration is None:
            raise ValueError("fp8_weight_rounding gptq needs calibration token ids")
        report["gptq"] = gptq_quantize_layers(model, calibration, keep_layers, quantize_per_channel_mse, install)
    else:
        for i, layer in enumerate(layers):
            if i in keep_layers:
                continue
            for name in FP8_LINEARS:
                mod: Any = layer.get_submodule(name)
                q, scale = quantize_per_channel_mse(mod.weight.detach())
                install(i, name, mod, q, scale)
    n = (len(layers) - len(set(keep_layers) & set(range(len(layers))))) * len(FP8_LINEARS)
    report.update({"linears": n, "bytes_before": before, "bytes_after": after, "bf16_layers": sorted(keep_layers)})
    return report


def fp8_linear_emulated(x: torch.Tensor, layer: Any) -> torch.Tensor:
    """``layer(x)`` for an e4m3 weight: widened to ``x``'s dtype (exact), scales on the float32 result."""
    y = F.linear(x, layer.weight.to(x.dtype)).float() * layer.weight_scale
    if layer.bias is not None:
        y += layer.bias.float()
    return y.to(x.dtype)


def has_fp8_weight(layer: Any) -> bool:
    return is_fp8(layer.weight.dtype)


def with_fp8_linears(ops: Any) -> Any:
    """The same op set, with ``linear`` reading e4m3 weights (Triton kernels on CUDA, emulated elsewhere)."""
    if ops.name == "triton":
        from distserve.server.engine.fp8_linear import Fp8TritonLayerOps

        return Fp8TritonLayerOps(fuse_gemv=ops.fuse_gemv)
    from distserve.server.engine.ops.layer_ops import TorchLayerOps

    class Fp8TorchLayerOps(TorchLayerOps):
        name = "torch+fp8"

        def linear(self, x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
            if has_fp8_weight(layer):
                return fp8_linear_emulated(x, layer)
            return F.linear(x, layer.weight, layer.bias)

    return Fp8TorchLayerOps()


# --------------------------------------------------------------------------------------------- KV cache


def write_kv_fp8(
    kv_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor,
    kv_amax: torch.Tensor | None,
) -> None:
    """PyTorch path: record the K/V amax, quantise with the layer's scales, store at the slots.
    Negative slots (CUDA-graph padding) are not written and not counted."""
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        k, v, slot_mapping = k[valid], v[valid], slot_mapping[valid]
    if k.shape[0] == 0:
        return
    if kv_amax is not None:
        seen = torch.stack([observed_amax(k.detach()), observed_amax(v.detach())])
        torch.maximum(kv_amax, seen, out=kv_amax)
    cache = as_bytes(kv_cache)
    cache[0].index_copy_(0, slot_mapping, as_bytes(quantize(k, kv_scale[0])))
    cache[1].index_copy_(0, slot_mapping, as_bytes(quantize(v, kv_scale[1])))


def gather_kv_fp8(
    kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, block_size: int, kv_scale: torch.Tensor, dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``attention.base.gather_kv`` of an FP8 cache, dequantised to ``dtype``."""
    from distserve.server.engine.attention.base import gather_kv

    kb, vb = gather_kv(as_bytes(kv_cache), block_table, seq_len, block_size)
    return dequantize(kb.view(FP8_DTYPE), kv_scale[0], dtype), dequantize(vb.view(FP8_DTYPE), kv_scale[1], dtype)


@dataclass
class KVCalibration:
    """Online calibration of per-layer FP8 K/V scales (the seed: "from the first 1000 requests").

    ``scales`` and ``amax`` are ``[num_layers, 2]`` float32 tensors on the cache's device (column 0 = K,
    1 = V) that the attention kernels read and update; this object decides when the scales change and
    keeps the host-side copy reported in ``/metrics``."""

    scales: torch.Tensor
    amax: torch.Tensor
    target_requests: int  # 0: keep the initial scale
    init_scale: float
    requests_seen: int = 0
    calibrated: bool = False
    host_scales: list[list[float]] = field(default_factory=list)
    host_amax: list[list[float]] = field(default_factory=list)

    @classmethod
    def create(cls, num_layers: int, device: torch.device, init_scale: float, target_requests: int) -> KVCalibration:
        scales = torch.full((num_layers, 2), float(init_scale), dtype=torch.float32, device=device)
        amax = torch.zeros(num_layers, 2, dtype=torch.float32, device=device)
        cal = cls(scales, amax, target_requests, float(init_scale))
        cal.host_scales = [[float(init_scale)] * 2 for _ in range(num_layers)]
        cal.host_amax = [[0.0, 0.0] for _ in range(num_layers)]
        return cal

    @property
    def state(self) -> str:
        if self.calibrated:
            return "calibrated"
        return "calibrating" if self.target_requests > 0 else "fixed"

    def on_finished(self, n: int, kv_caches: list[torch.Tensor]) -> bool:
        """Count ``n`` finished requests; at the target, set the scales and re-quantise. True if it did."""
        if n <= 0 or self.calibrated or self.target_requests <= 0:
            return False
        self.requests_seen += n
        if self.requests_seen < self.target_requests:
            return False
        self.apply(scales_from_amax(self.amax, self.scales), kv_caches)
        return True

    @torch.inference_mode()
    def apply(self, new_scales: torch.Tensor, kv_caches: list[torch.Tensor]) -> None:
        """Re-quantise every layer from the current scales to ``new_scales`` in place, then adopt them."""
        new_scales = new_scales.to(self.scales.device, torch.float32)
        for layer, cache in enumerate(kv_caches):
            for kind in (0, 1):
                requantize_(cache[kind], self.scales[layer, kind], new_scales[layer, kind])
        self.scales.copy_(new_scales)
        self.calibrated = True
        self.refresh_host()
        log.info(
            "FP8 KV scales calibrated from %d requests: K %.4g..%.4g, V %.4g..%.4g",
            self.requests_seen,
            min(s[0] for s in self.host_scales),
            max(s[0] for s in self.host_scales),
            min(s[1] for s in self.host_scales),
            max(s[1] for s in self.host_scales),
        )

    def refresh_host(self) -> None:
        """Copy scales and amax to the host (a device sync: call between steps, e.g. at a /metrics scrape)."""
        self.host_scales = self.scales.tolist()
        self.host_amax = self.amax.tolist()

    def report(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "requests_seen": self.requests_seen,
            "target_requests": self.target_requests,
            "scales": self.host_scales,
            "amax": self.host_amax,
        }


def observed_amax(x: torch.Tensor, dim: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """float32 ``amax(|x|)`` over ``dim`` (all of ``x`` when None) of the finite values only: a NaN or inf
    written by one request (a faulty device, a bad hand-off) must not become every later request's scale."""
    a = x.float().abs().nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)  # abs() is a new tensor: x is untouched
    return a.amax() if dim is None else a.amax(dim=dim)


def scales_from_amax(amax: torch.Tensor, fallback: torch.Tensor | None = None) -> torch.Tensor:
    """``amax * headroom / 448``; a layer whose amax is not finite (a writer that does not filter, e.g. a GPU
    kernel's atomic max of a NaN) keeps ``fallback`` (its current scale) instead of a NaN or inf scale."""
    scales = (amax.float() * HEADROOM / FP8_MAX).clamp(min=MIN_SCALE)
    if fallback is None:
        return scales
    return torch.where(torch.isfinite(scales), scales, fallback.to(scales.device, torch.float32))


def requantize_(q: torch.Tensor, old: torch.Tensor, new: torch.Tensor, chunk: int = 1 << 16) -> None:
    """``q = quantize(dequantize(q, old), new)`` in place, ``chunk`` rows at a time (bounded temporaries)."""
    for s in range(0, q.shape[0], chunk):
        part = q[s : s + chunk]
        part.copy_(quantize(part.float() * old, new))


def positive_finite(x: Any) -> bool:
    """An int or float (not a bool) that is finite and > 0 *as the float32 a scale is used as*, in its normal
    range (1e300 is inf there, 1e-50 is 0, 1e-40 a subnormal); an int too large for a float (JSON allows 400
    digits) is not finite, never an OverflowError. The one check of a scale from elsewhere: ``check_scales``
    here and ``KVHandle``'s (server/kv_transfer/base.py)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    try:
        f = float(x)
    except OverflowError:
        return False
    return _F32.tiny <= f <= _F32.max


def check_scales(scales: Any, num_layers: int) -> list[list[float]]:
    """Validate ``[[k, v], ...]`` scales from elsewhere (a KV hand-off): one pair per layer, finite, > 0."""
    if not isinstance(scales, (list, tuple)) or len(scales) != num_layers:
        raise ValueError(f"kv_scales must be {num_layers} [k, v] pairs")
    out = []
    for pair in scales:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ValueError("kv_scales entries must be [k, v] pairs")
        for s in pair:
            if not positive_finite(s):
                raise ValueError(f"kv_scales must be finite float32 numbers > 0, got {str(s)[:40]}")
        out.append([float(pair[0]), float(pair[1])])
    return out


__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "bf16_layer_set",
    "HEADROOM",
    "KVCalibration",
    "as_bytes",
    "check_scales",
    "dequantize",
    "fp8_linear_emulated",
    "gather_kv_fp8",
    "has_fp8_weight",
    "is_fp8",
    "quantize",
    "quantize_model_weights",
    "quantize_per_channel",
    "quantize_per_channel_mse",
    "requantize_",
    "observed_amax",
    "positive_finite",
    "scales_from_amax",
    "with_fp8_linears",
    "write_kv_fp8",
]
