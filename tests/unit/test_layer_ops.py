"""One model forward over a swappable op set (``layer_ops``): the structure lives in ``model.py``.

The fused Triton kernels need a GPU; here ``TritonLayerOps`` runs with the three kernel wrappers
replaced by PyTorch transcriptions of their contracts (the seam that cannot run on a CPU), which
checks everything around the kernels: the rotary inputs, the residual protocol of the add+norm, the
K/V store before ``attend``, the v slice and the output shape. The kernels themselves are compared with
PyTorch on the GPU (``tests/gpu``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from distserve.server.engine.attention import SdpaBackend
from distserve.server.engine.llm_engine import EngineConfig, LLMEngine
from distserve.server.engine.ops import cuda_ops
from distserve.server.engine.ops.layer_ops import TorchLayerOps, select_layer_ops
from distserve.server.engine.sampling_params import SamplingParams


class RecordingOps(TorchLayerOps):
    """PyTorch ops that log each call (name, and for rms_norm whether a residual came with it)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def rope(self, *a):
        self.calls.append("rope")
        return super().rope(*a)

    def rms_norm(self, x, norm, residual):
        self.calls.append("norm" if residual is None else "add+norm")
        return super().rms_norm(x, norm, residual)

    def linear(self, x, layer):
        self.calls.append("linear")
        return super().linear(x, layer)

    def silu_mul(self, gate_up):
        self.calls.append("silu_mul")
        return super().silu_mul(gate_up)

    def attention(self, *a):
        self.calls.append("attention")
        return super().attention(*a)


def _engine(dtype: str = "float32") -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model="preset:tiny-gpu-gqa",  # GQA: q, k and v heads differ
            dtype=dtype,
            attention_backend="sdpa",
            num_blocks=64,
            max_model_len=256,
            enable_prefix_caching=False,  # each _two_steps computes every prompt token
        )
    )


def _two_steps(eng: LLMEngine, ops=None, backend=None) -> list[torch.Tensor]:
    """Logits of a mixed prefill step (three prompts) and of the decode step after it, under ``ops``."""
    if ops is not None:
        eng.model.ops = ops
    if backend is not None:
        eng.model.backend = backend
    for i, n in enumerate((5, 23, 40)):
        eng.add_request(f"r{i}", [3 + (7 * i + j) % 1000 for j in range(n)], SamplingParams(max_tokens=4))
    out = []
    for _ in range(2):
        sched = eng.scheduler.schedule()
        logits = eng.runner.execute(sched.scheduled)
        out.append(logits.clone())
        for row, s in enumerate(sched.scheduled):
            s.seq.num_computed_tokens += s.num_new_tokens
            s.seq.output_token_ids.append(int(logits[row].argmax()))
    for i in range(3):
        assert eng.abort_request(f"r{i}")
    return out


def test_forward_is_the_models_structure_over_its_ops():
    eng = _engine()
    assert eng.model.ops.name == "torch"  # CPU
    plain = _two_steps(eng)
    rec = RecordingOps()
    recorded = _two_steps(eng, rec)
    assert all(torch.equal(a, b) for a, b in zip(plain, recorded))  # the op set swapped in is the one used
    layers = eng.model_config.num_hidden_layers
    first = ["norm", "linear", "attention", "linear", "add+norm", "linear", "silu_mul", "linear"]
    later = ["add+norm", *first[1:]]
    one_forward = ["rope", *first, *later * (layers - 1), "add+norm"]
    assert rec.calls == one_forward * 2


def test_changing_an_op_changes_the_forward():
    """A different SiLU×mul (editing the op, not a copy of the forward) changes the logits."""

    class GeluOps(TorchLayerOps):
        def silu_mul(self, gate_up):
            gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
            return F.gelu(gate) * up

    eng = _engine()
    plain = _two_steps(eng)
    other = _two_steps(eng, GeluOps())
    assert not torch.equal(plain[0], other[0])


# --- TritonLayerOps around PyTorch transcriptions of the kernels' contracts -------------------------
def _rms_norm_contract(x, weight, eps, residual=None):
    if residual is not None:  # residual += x in place, then the sum is normalised
        residual.add_(x)
        x = residual
    x32 = x.float()
    y = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * y


def _rope_and_cache_contract(qkv, positions, cos, sin, kv_cache, slot_mapping, num_heads, num_kv_heads, head_dim):
    """Hugging Face's rotate_half RoPE on rows of the float32 tables rounded to the dtype; K/V stored at
    slots >= 0; q and k returned contiguous."""
    t, dt = qkv.shape[0], qkv.dtype
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1)
    c, s = cos[positions].to(dt)[:, None, :], sin[positions].to(dt)[:, None, :]

    def rot(x):
        x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2 :]
        return x * c + torch.cat((-x2, x1), dim=-1) * s

    q, k = rot(q.reshape(t, num_heads, head_dim)), rot(k.reshape(t, num_kv_heads, head_dim))
    keep = slot_mapping >= 0
    kv_cache[0][slot_mapping[keep]] = k[keep]
    kv_cache[1][slot_mapping[keep]] = v.reshape(t, num_kv_heads, head_dim)[keep]
    return q.contiguous(), k.contiguous()


def _silu_mul_contract(gate_up):
    n = gate_up.shape[-1] // 2
    return F.silu(gate_up[:, :n]) * gate_up[:, n:]


class AttendOnlySdpa(SdpaBackend):
    """A backend with ``attend``: attention over a cache that must already hold this step's K/V."""

    name = "sdpa-attend"

    def __init__(self) -> None:
        self.attends = 0

    def attend(self, q, k, v, kv_cache, meta, scale):
        slots = meta.slot_mapping
        assert torch.equal(kv_cache[0][slots], k) and torch.equal(kv_cache[1][slots], v), "K/V not stored"
        self.attends += 1
        return self.forward(q, k, v, kv_cache, meta, scale)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_triton_layer_ops_around_kernel_contracts_equal_torch_ops(dtype, monkeypatch):
    monkeypatch.setattr(cuda_ops, "rms_norm", _rms_norm_contract)
    monkeypatch.setattr(cuda_ops, "rope_and_cache", _rope_and_cache_contract)
    monkeypatch.setattr(cuda_ops, "silu_mul", _silu_mul_contract)
    eng = _engine(dtype)
    plain = _two_steps(eng)
    backend = AttendOnlySdpa()
    fused = _two_steps(eng, cuda_ops.TritonLayerOps(), backend)
    assert backend.attends == 2 * eng.model_config.num_hidden_layers
    for a, b in zip(plain, fused):  # same rounding points as the PyTorch ops: bit for bit
        assert torch.isfinite(a).all() and torch.equal(a, b)


def test_select_layer_ops(monkeypatch):
    attend = AttendOnlySdpa()
    cuda = torch.device("cuda")
    assert select_layer_ops(attend, torch.device("cpu"), 128).name == "torch"
    monkeypatch.setattr(cuda_ops, "HAS_TRITON", True)  # the choice itself, on a machine without Triton
    assert select_layer_ops(attend, cuda, 128).name == "triton"
    assert select_layer_ops(SdpaBackend(), cuda, 128).name == "torch"  # no attend: the backend writes K/V
    assert select_layer_ops(attend, cuda, 96).name == "torch"  # the RoPE kernel spans a power-of-two head
    monkeypatch.setattr(cuda_ops, "HAS_TRITON", False)
    assert select_layer_ops(attend, cuda, 128).name == "torch"


# --- the fused one-token GEMVs' wiring (TritonLayerOps.norm_linear / linear_add / silu_mul_linear_add) -------
def _gemv_fused_contract(x, weight, bias, cfg, *, norm_weight=None, eps=0.0, silu=False, residual=None):
    """``cuda_ops.gemv_fused``'s contract: the prologue, the linear, the add into ``residual`` (returned)."""
    if norm_weight is not None:
        x = _rms_norm_contract(x, norm_weight, eps)
    if silu:
        x = _silu_mul_contract(x)
    y = F.linear(x, weight, bias)
    return y if residual is None else residual.add_(y)


def _one_sequence(eng: LLMEngine, ops=None, backend=None, decodes: int = 3) -> list[torch.Tensor]:
    """Logits of a prompt's prefill and of ``decodes`` batch-1 decode steps after it, under ``ops``."""
    if ops is not None:
        eng.model.ops = ops
    if backend is not None:
        eng.model.backend = backend
    eng.add_request("one", [3 + 11 * j % 1000 for j in range(13)], SamplingParams(max_tokens=8))
    out = []
    for _ in range(1 + decodes):
        sched = eng.scheduler.schedule()
        logits = eng.runner.execute(sched.scheduled)
        out.append(logits.clone())
        for row, s in enumerate(sched.scheduled):
            s.seq.num_computed_tokens += s.num_new_tokens
            s.seq.output_token_ids.append(int(logits[row].argmax()))
    assert eng.abort_request("one")
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_decode_gemvs_around_kernel_contracts_equal_torch_ops(dtype, monkeypatch):
    """At one token, with a tuned GEMV config on a linear, ``TritonLayerOps`` takes the fused GEMV (norm or
    SiLU prologue, residual-add epilogue) and returns None where the stream already holds the output; where a
    linear has no config (cuBLAS was faster) it falls back to the composition, so the next norm adds. Around
    the kernels' contracts the logits equal the PyTorch ops' bit for bit in every mix, and the number of
    fused calls is the number of tuned linears per decode step; ``fuse_gemv=False`` fuses nothing."""
    fused_calls: list[tuple] = []

    def gemv_fused(x, weight, bias, cfg, **kw):
        fused_calls.append(
            (tuple(weight.shape), tuple(sorted(k for k, v in kw.items() if v is not None and v is not False)))
        )
        return _gemv_fused_contract(x, weight, bias, cfg, **kw)

    monkeypatch.setattr(cuda_ops, "rms_norm", _rms_norm_contract)
    monkeypatch.setattr(cuda_ops, "rope_and_cache", _rope_and_cache_contract)
    monkeypatch.setattr(cuda_ops, "silu_mul", _silu_mul_contract)
    monkeypatch.setattr(cuda_ops, "gemv", lambda x, w, b, cfg: F.linear(x, w, b))
    monkeypatch.setattr(cuda_ops, "gemv_fused", gemv_fused)
    monkeypatch.setattr(cuda_ops, "_INTERPRET", True)  # CPU tensors count as the kernels' device
    eng = _engine(dtype)
    layers = list(eng.model.layers)
    for layer in layers:
        for mod in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            mod.gemv_cfg = (8, 64, 4)
    plain = _one_sequence(eng)
    decodes = 3
    full = _one_sequence(eng, cuda_ops.TritonLayerOps(), AttendOnlySdpa(), decodes)
    assert all(torch.isfinite(a).all() and torch.equal(a, b) for a, b in zip(plain, full))
    assert len(fused_calls) == 4 * len(layers) * decodes
    h, inter = eng.model_config.hidden_size, eng.model_config.intermediate_size
    attn = layers[0].self_attn
    assert fused_calls[0] == ((attn.q_size + 2 * attn.kv_size, h), ("eps", "norm_weight"))  # qkv: norm prologue
    assert fused_calls[1] == ((h, h), ("residual",))  # o_proj: the add epilogue
    assert fused_calls[2] == ((2 * inter, h), ("eps", "norm_weight"))  # gate_up
    assert fused_calls[3] == ((h, inter), ("residual", "silu"))  # down: SiLU prologue, add epilogue
    # a mix: some linears on cuBLAS (no config), the stream added by the next norm there
    layers[0].self_attn.o_proj.gemv_cfg = None
    layers[1].mlp.gate_up_proj.gemv_cfg = None
    layers[2].mlp.down_proj.gemv_cfg = None
    layers[-1].self_attn.qkv_proj.gemv_cfg = None
    fused_calls.clear()
    mixed = _one_sequence(eng, cuda_ops.TritonLayerOps(), AttendOnlySdpa(), decodes)
    assert all(torch.equal(a, b) for a, b in zip(plain, mixed))
    # 4 configs fewer, and layer 0's gate_up norm has o_proj's output still to add (an add+norm, not a prologue)
    assert len(fused_calls) == (4 * len(layers) - 4 - 1) * decodes
    fused_calls.clear()
    off = _one_sequence(eng, cuda_ops.TritonLayerOps(fuse_gemv=False), AttendOnlySdpa(), decodes)
    assert all(torch.equal(a, b) for a, b in zip(plain, off)) and not fused_calls


def test_fused_decode_gemv_option():
    """``EngineConfig.fused_decode_gemv`` is checked once, reaches the Triton ops, and survives FP8 linears."""
    from distserve.server.engine.fp8 import with_fp8_linears

    with pytest.raises(ValueError, match="fused_decode_gemv"):
        EngineConfig(fused_decode_gemv="no")  # type: ignore[arg-type]
    assert EngineConfig().fused_decode_gemv is False  # off until measured on a GPU (engine-gpu.md)
    assert EngineConfig(fused_decode_gemv=True).fused_decode_gemv is True
    attend, cuda = AttendOnlySdpa(), torch.device("cuda")
    ops = cuda_ops.TritonLayerOps(fuse_gemv=False)
    assert with_fp8_linears(ops).fuse_gemv is False and with_fp8_linears(cuda_ops.TritonLayerOps()).fuse_gemv
    try:
        saved, cuda_ops.HAS_TRITON = cuda_ops.HAS_TRITON, True
        assert select_layer_ops(attend, cuda, 128, fuse_gemv=False).fuse_gemv is False  # type: ignore[attr-defined]
        assert select_layer_ops(attend, cuda, 128).fuse_gemv is True  # type: ignore[attr-defined]
    finally:
        cuda_ops.HAS_TRITON = saved
