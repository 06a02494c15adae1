"""The fused one-token GEMV (norm / SiLU prologue, residual-add epilogue) against the unfused kernels, on a GPU.

Skipped without CUDA. The CPU checks (Triton's interpreter, float32, and a compile for sm_90) are in
``tests/unit/test_fused_gemv_interpret.py``; here the compiled kernels run in bf16:

* kernel level, 7B shapes: each fused form against the unfused composition (``rms_norm`` + ``gemv``,
  ``silu_mul`` + ``gemv``, ``gemv`` + the add+RMSNorm kernel's add) within 1e-3 relative error. The SiLU
  prologue and the add epilogue round where the unfused kernels round, so they are expected bit-identical
  (``bench/engine/b1_fused.py`` records whether they are); the norm prologue sums its squares in another order
  (its float32 rstd may differ in the last bit, flipping a bf16 rounding of the normalised row now and then);
* the model, tiny presets, CUDA graphs at batch 1: one engine, one graph captured with the fusion and one
  without (every linear given a Triton GEMV config, so the fusion applies whatever the start-up tuning chose),
  replayed on the same inputs step after step (the KV both write is the fused one's): logits within 1e-2
  relative error (the graph-vs-eager test's 2e-2 halved) and the same greedy token wherever the unfused top-2
  margin is at least 0.05.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TIE = 0.05


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize(
    "n,k,cfg", [(12288, 4096, (16, 256, 4, 3)), (4096, 11008, (8, 512, 4, 3)), (4096, 4096, (4, 1024, 4))]
)
def test_fused_gemv_kernels_equal_unfused_in_bf16(n, k, cfg):
    from distserve.server.engine.ops import cuda_ops as co

    g = torch.Generator(device="cuda").manual_seed(n + k)
    bf = torch.bfloat16
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(bf)
    b = torch.randn(n, device="cuda", generator=g).to(bf)
    x = (torch.randn(1, k, device="cuda", generator=g) * 4).to(bf)
    nw = (1 + 0.1 * torch.randn(k, device="cuda", generator=g)).to(bf)
    gu = torch.randn(1, 2 * k, device="cuda", generator=g).to(bf)
    res = (torch.randn(1, n, device="cuda", generator=g) * 10).to(bf)
    norm_f = co.gemv_fused(x, w, b, cfg, norm_weight=nw, eps=1e-5)
    norm_u = co.gemv(co.rms_norm(x, nw, 1e-5), w, b, cfg)
    assert _rel(norm_f, norm_u) < 1e-3
    silu_f = co.gemv_fused(gu, w, None, cfg, silu=True)
    assert _rel(silu_f, co.gemv(co.silu_mul(gu), w, None, cfg)) < 1e-3
    add_f, add_u = res.clone(), res.clone()
    co.gemv_fused(x, w, b, cfg, residual=add_f)
    co.rms_norm(co.gemv(x, w, b, cfg), torch.ones(n, device="cuda", dtype=bf), 1e-5, residual=add_u)
    assert _rel(add_f, add_u) < 1e-3
    both_f, both_u = res.clone(), res.clone()
    co.gemv_fused(gu, w, b, cfg, silu=True, residual=both_f)
    both_u.add_(co.gemv(co.silu_mul(gu), w, b, cfg))
    assert _rel(both_f, both_u) < 1e-3
    assert all(torch.isfinite(t).all() for t in (norm_f, silu_f, add_f, both_f))


def _graph_runner(eng, fuse: bool):
    from distserve.server.engine.cuda_graph_runner import CudaGraphRunner

    eng.model.ops.fuse_gemv = fuse
    return CudaGraphRunner(eng.runner, eng.max_model_len, batch_sizes=[1])


@pytest.mark.parametrize("preset", ["tiny-gpu", "tiny-gpu-gqa"])
def test_fused_decode_graph_equals_unfused(preset, monkeypatch):
    from distserve.server.engine.llm_engine import EngineConfig, LLMEngine
    from distserve.server.engine.ops import cuda_ops as co
    from distserve.server.engine.sampling_params import SamplingParams

    eng = LLMEngine(
        EngineConfig(
            model=f"preset:{preset}",
            device="cuda",
            dtype="bfloat16",
            num_blocks=512,
            max_num_seqs=1,
            max_model_len=256,
            attention_backend="triton",
        )
    )
    assert eng.model.ops.name == "triton" and eng.model.ops.fuse_gemv
    for layer in eng.model.layers:  # the fusion applies wherever a linear has a Triton GEMV config
        layer.self_attn.qkv_proj.gemv_cfg = (16, 256, 4, 3)
        layer.self_attn.o_proj.gemv_cfg = (4, 512, 4, 3)
        layer.mlp.gate_up_proj.gemv_cfg = (16, 256, 4, 3)
        layer.mlp.down_proj.gemv_cfg = (8, 512, 4, 3)  # K = 1376 / 2816: no multiple of 512
    fused_calls = []
    fused = co.gemv_fused

    def counting(*a, **kw):
        fused_calls.append(1)
        return fused(*a, **kw)

    monkeypatch.setattr(co, "gemv_fused", counting)
    unfused_graph = _graph_runner(eng, False)
    assert not fused_calls
    fused_graph = _graph_runner(eng, True)
    assert len(fused_calls) >= 4 * eng.model_config.num_hidden_layers  # (warm-up forwards and the capture)
    rows = []
    run = eng.runner.execute

    def both(scheduled):
        eng.runner.graph_runner = unfused_graph
        lu = run(scheduled).float().cpu()
        eng.runner.graph_runner = fused_graph
        lf = run(scheduled)
        if len(scheduled) == 1 and scheduled[0].num_new_tokens == 1:
            rows.append((lf.float().cpu(), lu))
        return lf

    monkeypatch.setattr(eng.runner, "execute", both)
    eng.add_request(
        "r", [3 + 13 * j % 1000 for j in range(37)], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    )
    while eng.has_unfinished_requests():
        eng.step()
    assert len(rows) == 23 and fused_graph.num_replays == unfused_graph.num_replays == 23
    decided = 0
    for step, (lf, lu) in enumerate(rows):
        assert torch.isfinite(lf).all() and _rel(lf, lu) < 1e-2, (step, _rel(lf, lu))
        top2 = lu.topk(2, dim=-1).values[0]
        if top2[0] - top2[1] >= TIE:
            assert int(lf.argmax()) == int(lu.argmax()), (step, top2)
            decided += 1
    assert decided >= len(rows) // 3
