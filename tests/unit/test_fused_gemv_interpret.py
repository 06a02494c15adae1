"""The fused one-token GEMV (cuda_ops._gemv_fused_kernel) on the CPU, in Triton's interpreter, and compiled for Hopper.

Where the ``triton`` package is installed (CI's CPU torch has none: skipped there), the kernels run under
``TRITON_INTERPRET=1`` in a subprocess (the mode is read when the kernels are defined):

* each prologue/epilogue against the unfused composition (``rms_norm`` then ``gemv``; ``silu_mul`` then
  ``gemv``; ``gemv`` then the add+RMSNorm kernel's add) and against float64, on shapes whose K is not a
  multiple of BLOCK_K and whose N is not a multiple of BLOCK_N, with and without a bias, for the plain and the
  pipelined (STAGES > 1) loop. float32 activations for the comparison with PyTorch: the interpreter rounds
  float32 to bf16 by truncation (numpy has no bf16), so only kernel against kernel is meaningful in bf16,
  where the SiLU prologue and the add epilogue must be bit-identical to the unfused kernels;
* the model's forward (the tiny preset, a 9-token prefill then batch-1 decode steps) with
  ``TritonLayerOps(fuse_gemv=True)`` against ``fuse_gemv=False`` and against ``TorchLayerOps``, the fused
  kernel counted (4 per layer per decode step). The RoPE+KV-write kernel does not run in this interpreter
  (a mask it cannot broadcast), so its PyTorch transcription stands in for it (``test_layer_ops.py``'s);
* the kernel compiled ahead of time for sm_90 (``triton.compile`` with a GPUTarget: no GPU needed) in the
  variants the 7B engine would build, so a syntax the interpreter accepts but the compiler refuses fails here.

On a GPU, ``tests/gpu/test_fused_gemv.py`` compares fused with unfused in bf16 on the tiny preset.
"""

from __future__ import annotations

import pytest

from tests.triton_interpret import require_interpreter, run_python

KERNELS = """
import torch
import torch.nn.functional as F
from distserve.server.engine.ops import cuda_ops as co
torch.manual_seed(0)
eps = 1e-5
worst = {"norm": 0.0, "silu": 0.0, "add": 0.0}

def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()

# (N, K, cfg, bias): K tails (96 % 64, 200 % 64, 1376 % 256), N tails (70 % 16, 37 % 8), the pipelined loop
CASES = [
    (70, 96, (16, 64, 1), True),
    (64, 128, (8, 64, 2, 3), False),
    (37, 200, (8, 64, 4, 2), True),
    (40, 1376, (16, 256, 4, 3), False),
    (48, 256, (16, 128, 4, 3), True),
]
for n, k, cfg, bias in CASES:
    w = torch.randn(n, k) * 0.05
    b = torch.randn(n) if bias else None
    x = torch.randn(1, k) * 3
    nw = 1 + 0.1 * torch.randn(k)
    gu = torch.randn(1, 2 * k)
    # RMSNorm prologue: against the unfused kernels and float64
    got = co.gemv_fused(x, w, b, cfg, norm_weight=nw, eps=eps)
    unf = co.gemv(co.rms_norm(x, nw, eps), w, b, cfg)
    x64 = x.double()
    h64 = nw.double() * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    ref = F.linear(h64, w.double(), b.double() if bias else None)
    assert got.shape == (1, n) and rel(got, unf) < 1e-6 and rel(got, ref) < 1e-5, (n, k, cfg, rel(got, unf))
    worst["norm"] = max(worst["norm"], rel(got, ref))
    # SiLU x mul prologue
    got = co.gemv_fused(gu, w, b, cfg, silu=True)
    unf = co.gemv(co.silu_mul(gu), w, b, cfg)
    g64, u64 = gu.double()[:, :k], gu.double()[:, k:]
    ref = F.linear(F.silu(g64) * u64, w.double(), b.double() if bias else None)
    assert rel(got, unf) < 1e-6 and rel(got, ref) < 1e-5, (n, k, cfg, rel(got, unf))
    worst["silu"] = max(worst["silu"], rel(got, ref))
    # residual-add epilogue, with each prologue too; the residual is updated in place and returned
    for kw, xin, h in ((dict(), x, x), (dict(silu=True), gu, co.silu_mul(gu)), (dict(norm_weight=nw, eps=eps), x, co.rms_norm(x, nw, eps))):
        res = torch.randn(1, n)
        want = res + co.gemv(h, w, b, cfg)
        out = res.clone()
        assert co.gemv_fused(xin, w, b, cfg, residual=out, **kw) is out
        assert rel(out, want) < 1e-6, (n, k, cfg, kw, rel(out, want))
        worst["add"] = max(worst["add"], rel(out, want))
    # bf16, kernel against kernel (the interpreter's own bf16 rounding on both sides)
    wb, bb, xb, nb, gb = (t.bfloat16() if t is not None else None for t in (w, b, x, nw, gu))
    assert torch.equal(co.gemv_fused(gb, wb, bb, cfg, silu=True), co.gemv(co.silu_mul(gb), wb, bb, cfg))
    resb = torch.randn(1, n).bfloat16()
    a, c = resb.clone(), resb.clone()
    co.gemv_fused(xb, wb, bb, cfg, residual=a)
    co.rms_norm(co.gemv(xb, wb, bb, cfg), torch.ones(n, dtype=torch.bfloat16), eps, residual=c)  # its add
    assert torch.equal(a, c), (n, k, cfg)
    nf, nu = co.gemv_fused(xb, wb, bb, cfg, norm_weight=nb, eps=eps), co.gemv(co.rms_norm(xb, nb, eps), wb, bb, cfg)
    assert rel(nf, nu) < 1e-2, (n, k, cfg, rel(nf, nu))  # the sum of squares' order may flip a bf16 rounding
for bad in (dict(norm_weight=torch.ones(96), silu=True), dict(residual=torch.zeros(1, 69))):
    try:
        co.gemv_fused(torch.randn(1, 96), torch.randn(70, 96), None, (16, 64, 1), **bad)
    except ValueError:
        pass
    else:
        raise AssertionError(bad)
print("ok", worst)
"""

MODEL = """
import torch
from distserve.server.engine.attention import SdpaBackend
from distserve.server.engine.llm_engine import EngineConfig, LLMEngine
from distserve.server.engine.ops import cuda_ops as co
from distserve.server.engine.ops.layer_ops import TorchLayerOps
from distserve.server.engine.sampling_params import SamplingParams
from tests.unit.test_layer_ops import _rope_and_cache_contract


class Attend(SdpaBackend):
    name = "sdpa-attend"

    def attend(self, q, k, v, kv_cache, meta, scale):  # the cache holds K/V already; writing them again is harmless
        return self.forward(q, k, v, kv_cache, meta, scale)


calls = {"fused": 0}
fused = co.gemv_fused


def counting(*a, **kw):
    calls["fused"] += 1
    return fused(*a, **kw)


co.gemv_fused = counting
co.rope_and_cache = _rope_and_cache_contract  # its kernel does not run in the interpreter


def steps(eng, ops, backend, n=3):
    eng.model.ops, eng.model.backend = ops, backend
    eng.add_request("r", [3 + (7 * j) % 1000 for j in range(9)], SamplingParams(max_tokens=8))
    out = []
    for _ in range(n):  # a prefill (9 tokens: unfused everywhere), then batch-1 decode steps
        sched = eng.scheduler.schedule()
        logits = eng.runner.execute(sched.scheduled)
        out.append(logits.clone())
        for row, s in enumerate(sched.scheduled):
            s.seq.num_computed_tokens += s.num_new_tokens
            s.seq.output_token_ids.append(int(logits[row].argmax()))
    assert eng.abort_request("r")
    return out


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


report = {}
for dtype in ("float32", "bfloat16"):
    eng = LLMEngine(EngineConfig(model="preset:tiny-gpu", dtype=dtype, attention_backend="sdpa", num_blocks=32,
                                 max_model_len=128, enable_prefix_caching=False))
    layers = eng.model.layers
    for l in layers:  # what tune_gemv would store (o_proj and down: the pipelined loop; down's K 1376 is no block)
        l.self_attn.qkv_proj.gemv_cfg = (64, 128, 2)
        l.self_attn.o_proj.gemv_cfg = (32, 256, 4, 3)
        l.mlp.gate_up_proj.gemv_cfg = (64, 128, 4, 2)
        l.mlp.down_proj.gemv_cfg = (32, 256, 4, 3)
    ref = steps(eng, TorchLayerOps(), SdpaBackend()) if dtype == "float32" else None
    calls["fused"] = 0
    unf = steps(eng, co.TritonLayerOps(fuse_gemv=False), Attend())
    assert calls["fused"] == 0
    fus = steps(eng, co.TritonLayerOps(fuse_gemv=True), Attend())
    assert calls["fused"] == 4 * len(layers) * 2, calls  # qkv, o, gate_up, down in each of the 2 decode steps
    assert torch.equal(unf[0], fus[0])  # the prefill step is the same function (nothing fused at 9 rows)
    r = [rel(f, u) for f, u in zip(fus, unf)]
    if dtype == "float32":
        r_ref = [rel(f, t) for f, t in zip(fus, ref)]
        assert max(r) < 1e-5 and max(r_ref) < 1e-5, (r, r_ref)
        assert all(torch.equal(f.argmax(-1), t.argmax(-1)) for f, t in zip(fus, ref))
        report["float32_vs_torch"] = max(r_ref)
    else:
        assert max(r) < 2e-2, r
    report[dtype + "_fused_vs_unfused"] = max(r)
print("ok", report)
"""

COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from distserve.server.engine.ops import cuda_ops as co

target = GPUTarget("cuda", 90, 32)
sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16", "N": "i32", "K": "i32",
       "stride_w": "i32", "HAS_BIAS": "constexpr", "EVEN_K": "constexpr", "BLOCK_N": "constexpr",
       "BLOCK_K": "constexpr", "STAGES": "constexpr", "EVEN_N": "constexpr"}
plain = {"HAS_BIAS": False, "EVEN_K": True, "BLOCK_N": 16, "BLOCK_K": 256, "STAGES": 3, "EVEN_N": True}
try:  # the toolchain probe: the engine's existing GEMV
    triton.compile(ASTSource(fn=co._gemv_kernel, signature=sig, constexprs=plain), target=target,
                   options={"num_warps": 4, "num_stages": 3})
except Exception as e:
    print("skip", type(e).__name__, str(e)[:200])
    raise SystemExit(0)
fsig = dict(sig, nw_ptr="*bf16", eps="fp32", NORM="constexpr", SILU="constexpr", ADD="constexpr")
fsig = {k: fsig[k] for k in ("x_ptr", "w_ptr", "b_ptr", "y_ptr", "nw_ptr", "N", "K", "stride_w", "eps", "HAS_BIAS",
                              "EVEN_K", "BLOCK_N", "BLOCK_K", "NORM", "SILU", "ADD", "STAGES", "EVEN_N")}
n = 0
# the 7B engine's variants (qkv/gate_up: norm; o: add; down: silu + add, K 11008 no multiple of 512), both loops
for norm, silu, add, even_k, bias in [(1, 0, 0, 1, 0), (0, 0, 1, 1, 1), (0, 1, 1, 0, 0), (1, 0, 0, 0, 1), (0, 0, 0, 1, 0)]:
    for cfg in ((16, 256, 4, 3), (8, 512, 4, 3), (4, 1024, 4)):
        st = cfg[3] if len(cfg) > 3 else 1
        c = {"HAS_BIAS": bool(bias), "EVEN_K": bool(even_k), "BLOCK_N": cfg[0], "BLOCK_K": cfg[1], "NORM": bool(norm),
             "SILU": bool(silu), "ADD": bool(add), "STAGES": st, "EVEN_N": True}
        k = triton.compile(ASTSource(fn=co._gemv_fused_kernel, signature=fsig, constexprs=c), target=target,
                           options={"num_warps": cfg[2], "num_stages": st})
        assert "ptx" in k.asm, c
        n += 1
print("ok", n)
"""


def test_fused_gemv_kernel_against_the_unfused_kernels_in_the_interpreter():
    require_interpreter()
    out = run_python(KERNELS)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("ok"), out.stdout


def test_model_forward_with_fused_decode_gemvs_in_the_interpreter():
    require_interpreter()
    out = run_python(MODEL)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("ok"), out.stdout


def test_fused_gemv_kernel_compiles_for_sm90():
    pytest.importorskip("triton")
    out = run_python(COMPILE, interpret=False, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    if out.stdout.startswith("skip"):
        pytest.skip("Triton cannot compile for sm_90 here: " + out.stdout.strip())
    assert out.stdout.startswith("ok"), out.stdout
