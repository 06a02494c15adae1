"""GPTQ-style (OBQ) rounding of FP8 weights into the same format (``decode.fp8_weight_rounding: gptq``).

``fp8.quantize_per_channel_mse`` rounds each weight to its nearest e4m3 value under the row's scale. GPTQ
(Frantar et al., 2022) keeps that format and those scales but chooses the rounding to minimise the layer's
*output* error on calibration activations, ``||(W - Q) X^T||^2``: with ``H = X^T X`` (``[K, K]``, K = input
channels), it quantises the columns one at a time and pushes each column's rounding error onto the columns
not yet quantised through the inverse Hessian (its upper Cholesky factor), 128 columns per block, columns in
order of decreasing ``diag(H)`` ("act order": with one scale per row the order is free, nothing is regrouped).
The result is the same e4m3 bytes and float32 scales: the kernels and their speed do not change, only the
load does.

The activations come from text the product ships (``data/fp8_calibration.txt``: English prose, dialogue and
code written for this purpose, not any evaluation set), run through the model on its own device, layer by
layer and linear by linear (sequential GPTQ): each linear's Hessian is taken from the inputs that the
already-quantised linears before it produce, so later layers compensate the earlier layers' error too.

Memory: the calibration hidden states (``tokens x hidden``, model dtype), one stage's intermediate
activations (at most ``tokens x intermediate``), one float32 Hessian ``[K, K]`` and its factors (for a 7B
``down_proj``, K = 11008: 0.48 GB each), temporaries of one micro-batch of ``MICRO_BATCH_TOKENS``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from distserve.server.engine.fp8 import FP8_DTYPE, FP8_MAX, fp8_linear_emulated, has_fp8_weight

log = logging.getLogger(__name__)

CALIBRATION_FILE = Path(__file__).with_name("data") / "fp8_calibration.txt"
SEQ_LEN = 256  # tokens per calibration sequence (the text is tokenised once and cut into these)
MAX_SEQUENCES = 64  # at most this many sequences (bounds the load-time memory and cost)
MICRO_BATCH_TOKENS = 2048  # tokens per forward chunk of the calibration pass
BLOCK = 128  # columns per lazy-update block
DAMP = 0.01  # added to diag(H): this share of its mean


def calibration_text() -> str:
    return CALIBRATION_FILE.read_text(encoding="utf-8")


def calibration_sequences(
    encode: Callable[[str], list[int]],
    seq_len: int = SEQ_LEN,
    max_sequences: int = MAX_SEQUENCES,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """``[n, seq_len]`` int64 token ids: the shipped text's paragraphs tokenised one by one (so every
    paragraph starts fresh), concatenated and cut into whole sequences. Deterministic. ``vocab_size``: ids
    at or above it are taken modulo it (a preset model's byte tokenizer may exceed a tiny vocabulary)."""
    ids: list[int] = []
    for para in calibration_text().split("\n\n"):
        para = para.strip()
        if para:
            ids.extend(encode(para + "\n\n"))
    if vocab_size is not None:
        ids = [t % vocab_size for t in ids]
    n = min(max_sequences, len(ids) // seq_len)
    if n < 1:
        raise ValueError(f"calibration text too short: {len(ids)} tokens < one sequence of {seq_len}")
    return torch.tensor(ids[: n * seq_len], dtype=torch.int64).view(n, seq_len)


# ------------------------------------------------------------------------------------------- rounding


def _cholesky_inverse_upper(h: torch.Tensor, damp: float) -> torch.Tensor:
    """The upper Cholesky factor of ``(H + damp * mean(diag H) * I)^-1``; damping raised 10x per failure."""
    k = h.shape[0]
    mean_diag = float(h.diagonal().mean()) or 1.0
    eye = torch.eye(k, dtype=h.dtype, device=h.device)
    for attempt in range(4):
        d = damp * 10**attempt
        lower, info = torch.linalg.cholesky_ex(h + eye * (d * mean_diag))
        if int(info) == 0:
            hinv = torch.cholesky_inverse(lower)
            upper, info = torch.linalg.cholesky_ex(hinv, upper=True)
            if int(info) == 0:
                if attempt:
                    log.warning("GPTQ: Hessian needed damping %.3g (asked %.3g)", d, damp)
                return upper
    raise torch.linalg.LinAlgError("GPTQ: Hessian not positive definite even with damping")


@torch.no_grad()
def gptq_round(
    w: torch.Tensor,
    hessian: torch.Tensor,
    scale: torch.Tensor,
    block: int = BLOCK,
    damp: float = DAMP,
    act_order: bool = True,
) -> torch.Tensor:
    """``w [N, K]`` rounded to e4m3 under the fixed per-row ``scale [N]`` (``w ≈ q * scale[:, None]``) so as to
    minimise ``||(w - q * scale) X^T||^2`` for ``hessian = X^T X [K, K]``. Returns ``q`` (``float8_e4m3fn``,
    ``[N, K]``): the same format as ``fp8.quantize_per_channel_mse``, values saturated at +-448.

    Float32 throughout, on ``w``'s device; deterministic for a given device. Inputs that never activate
    (``H[j, j] == 0``) are rounded to nearest and push no error anywhere."""
    n, k = w.shape
    work = w.float().clone()
    h = hessian.float().clone()
    s = scale.float().to(w.device)[:, None]
    dead = h.diagonal() == 0
    h[dead, dead] = 1.0
    perm = torch.argsort(h.diagonal(), descending=True, stable=True) if act_order else None
    if perm is not None:
        work, h = work[:, perm], h[perm][:, perm]
    u = _cholesky_inverse_upper(h, damp)
    del h
    # transposed ([K, N]): each column a contiguous row, so the per-column work streams memory
    wt = work.T.contiguous()
    del work
    sv = s[:, 0]
    codes = torch.empty_like(wt)  # e4m3 values, exact in float32
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1 = wt[i1:i2]  # a view: updated in place
        u1 = u[i1:i2, i1:i2]
        err1 = torch.empty(i2 - i1, n, dtype=torch.float32, device=w.device)
        for j in range(i2 - i1):
            col = w1[j]
            q = (col / sv).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float()
            codes[i1 + j] = q
            e = torch.sub(col, q * sv).div_(u1[j, j])
            err1[j] = e
            w1[j + 1 :].addmm_(u1[j, j + 1 :, None], e[None, :], alpha=-1.0)  # (a rank-1 addmm: BLAS; addr_ is not)
        if i2 < k:
            wt[i2:].addmm_(u[i1:i2, i2:].T, err1, alpha=-1.0)
    codes = codes.T
    if perm is not None:
        codes = codes[:, torch.argsort(perm)]
    return codes.to(FP8_DTYPE)


def output_error(w: torch.Tensor, w_hat: torch.Tensor, hessian: torch.Tensor) -> float:
    """``||(w - w_hat) X^T||^2 = tr(D H D^T)`` for ``D = w - w_hat`` and ``H = X^T X``."""
    d = (w.float() - w_hat.float()).double()
    return float(((d @ hessian.double()) * d).sum())


# ------------------------------------------------------------------------------ sequential over a model


class _Hessian:
    """``X^T X`` of a linear's inputs, accumulated in float32 over micro-batches."""

    def __init__(self, k: int, device: torch.device) -> None:
        self.h = torch.zeros(k, k, dtype=torch.float32, device=device)
        self.tokens = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        self.h.addmm_(x.T, x)
        self.tokens += x.shape[0]


def _linear(x: torch.Tensor, mod: Any) -> torch.Tensor:
    return fp8_linear_emulated(x, mod) if has_fp8_weight(mod) else F.linear(x, mod.weight, mod.bias)


def _rms(x: torch.Tensor, norm: Any) -> torch.Tensor:
    from distserve.server.engine.ops.layer_ops import rms_norm

    return rms_norm(x, norm.weight, norm.eps)


def _attention(layer: Any, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Causal self-attention of whole sequences, ``qkv [b, S, q+2kv]`` -> ``[b, S, q]`` (dense: calibration only)."""
    from distserve.server.engine.ops.layer_ops import apply_rope

    att = layer.self_attn
    b, t = qkv.shape[:2]
    nq, nkv, d = att.num_heads, att.num_kv_heads, att.head_dim
    q = apply_rope(qkv[..., : att.q_size].reshape(b, t, nq, d), cos, sin)
    k = apply_rope(qkv[..., att.q_size : att.q_size + att.kv_size].reshape(b, t, nkv, d), cos, sin)
    v = qkv[..., att.q_size + att.kv_size :].reshape(b, t, nkv, d)
    rep = nq // nkv
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=att.scale
    )
    return o.transpose(1, 2).reshape(b, t, att.q_size)


def _chunks(n_seq: int, seq_len: int) -> list[slice]:
    per = max(1, MICRO_BATCH_TOKENS // seq_len)
    return [slice(i, min(i + per, n_seq)) for i in range(0, n_seq, per)]


InstallFn = Callable[[int, str, Any, torch.Tensor, torch.Tensor], None]
QuantFn = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@torch.no_grad()
def gptq_quantize_layers(
    model: Any,
    token_ids: torch.Tensor,
    keep_layers: set[int] | frozenset[int],
    scale_fn: QuantFn,
    install: InstallFn,
    block: int = BLOCK,
    damp: float = DAMP,
) -> dict[str, Any]:
    """Sequential GPTQ over ``model.layers`` (the engine's ``LlamaForCausalLM``): for each decoder layer not in
    ``keep_layers``, and each of its linears in forward order (q/k/v, o, gate/up, down), accumulate the
    Hessian of the inputs produced by everything already quantised, take the row scales from ``scale_fn(w)``
    (the nearest rounding's own choice), round with :func:`gptq_round` and hand ``(layer, name, module, q,
    scale)`` to ``install``, which replaces the weight. The calibration hidden states then go through the
    quantised layer to the next one. Returns timings and the calibration size."""
    from distserve.server.engine.ops.layer_ops import TorchLayerOps

    silu_mul = TorchLayerOps().silu_mul  # the engine's own SiLU x mul on a fused gate/up
    t0 = time.perf_counter()
    dev = model.embed_tokens.weight.device
    dtype = model.embed_tokens.weight.dtype
    ids = token_ids.to(dev)
    n_seq, seq_len = ids.shape
    chunks = _chunks(n_seq, seq_len)
    positions = torch.arange(seq_len, device=dev)
    cos, sin = model.rotary.tables(positions, dtype, seq_len)  # [S, 1, D]: broadcast over [b, S, heads, D]
    x = F.embedding(ids, model.embed_tokens.weight)  # [n, S, hidden], the residual stream
    t_round = t_hess = 0.0

    def quantise(i: int, name: str, mod: Any, hess: _Hessian) -> None:
        nonlocal t_round
        t1 = time.perf_counter()
        w = mod.weight.detach()
        _, scale = scale_fn(w)
        q = gptq_round(w, hess.h, scale, block=block, damp=damp)
        install(i, name, mod, q, scale)
        t_round += time.perf_counter() - t1

    def stage(fn: Callable[[slice], torch.Tensor]) -> _Hessian:
        """Run ``fn`` (a stage's input for a chunk of sequences) over all chunks; its Hessian."""
        nonlocal t_hess
        t1 = time.perf_counter()
        hess: _Hessian | None = None
        for c in chunks:
            inp = fn(c)
            if hess is None:
                hess = _Hessian(inp.shape[-1], dev)
            hess.add(inp)
        t_hess += time.perf_counter() - t1
        assert hess is not None
        return hess

    def normed(norm: Any) -> Callable[[slice], torch.Tensor]:
        def inputs(c: slice) -> torch.Tensor:
            return _rms(x[c], norm)

        return inputs

    for i, layer in enumerate(model.layers):
        att, mlp = layer.self_attn, layer.mlp
        if i in keep_layers:
            for c in chunks:
                xc = x[c]
                h = _rms(xc, layer.input_layernorm)
                xc = xc + _linear(_attention(layer, _linear(h, att.qkv_proj), cos, sin), att.o_proj)
                h = _rms(xc, layer.post_attention_layernorm)
                x[c] = xc + _linear(silu_mul(_linear(h, mlp.gate_up_proj)), mlp.down_proj)
            continue
        quantise(i, "self_attn.qkv_proj", att.qkv_proj, stage(normed(layer.input_layernorm)))
        attn_out = torch.empty(n_seq, seq_len, att.q_size, dtype=dtype, device=dev)

        def attn_in(c: slice, out: torch.Tensor = attn_out, layer: Any = layer) -> torch.Tensor:
            att = layer.self_attn
            out[c] = _attention(layer, _linear(_rms(x[c], layer.input_layernorm), att.qkv_proj), cos, sin)
            return out[c]

        quantise(i, "self_attn.o_proj", att.o_proj, stage(attn_in))
        for c in chunks:
            x[c] = x[c] + _linear(attn_out[c], att.o_proj)
        del attn_out
        quantise(i, "mlp.gate_up_proj", mlp.gate_up_proj, stage(normed(layer.post_attention_layernorm)))
        inter = mlp.down_proj.weight.shape[1]
        act = torch.empty(n_seq, seq_len, inter, dtype=dtype, device=dev)

        def down_in(c: slice, out: torch.Tensor = act, layer: Any = layer) -> torch.Tensor:
            out[c] = silu_mul(_linear(_rms(x[c], layer.post_attention_layernorm), layer.mlp.gate_up_proj))
            return out[c]

        quantise(i, "mlp.down_proj", mlp.down_proj, stage(down_in))
        for c in chunks:
            x[c] = x[c] + _linear(act[c], mlp.down_proj)
        del act
    return {
        "calibration_sequences": n_seq,
        "calibration_tokens": n_seq * seq_len,
        "seconds": round(time.perf_counter() - t0, 2),
        "seconds_hessian_and_forward": round(t_hess, 2),
        "seconds_rounding": round(t_round, 2),
    }


__all__ = [
    "BLOCK",
    "CALIBRATION_FILE",
    "DAMP",
    "calibration_sequences",
    "calibration_text",
    "gptq_quantize_layers",
    "gptq_round",
    "output_error",
]
