"""Batch-1 decode with the fused one-token GEMVs on and off, one process (issue 32: bf16 step ≤ 4.05 ms, H200).

    python3 -m bench.engine.b1_fused --out $OUT/b1_fused.json       (device: ~2-3 min on an H200)
    python3 -m bench.engine.b1_fused --smoke --out /tmp/b1.json      (CPU, tiny model: checks this script only)

The engine: ``preset:llama-2-7b`` (random bf16 weights), triton backend, decode CUDA graphs, start-up tuning on
(``tune_gemv``'s choices are reported: the fusion applies to a projection only where it chose a Triton GEMV),
``max_num_seqs`` 1, a fixed KV pool. Then two more graph runners at batch 1 are captured on it, one with
``TritonLayerOps.fuse_gemv`` on (per layer: qkv with its RMSNorm, RoPE+KV write, attention, o_proj adding into
the residual, gate_up with its RMSNorm, down with SiLU×mul and the add: 6 kernels where there were 9) and one
with it off, and the engine's steps switch between them (``runner.graph_runner``):

1. ``kernels``: each 7B projection's fused kernel against its unfused kernels (rms_norm + gemv, gemv + the
   add+RMSNorm kernel's add, silu_mul + gemv + add), on the engine's weights and tuned configs: relative error,
   whether bit-identical, and µs per layer in a CUDA graph over the 32 layers' weights;
2. ``check``: one prompt decoded in lockstep: each step replays the unfused graph then the fused one on the same
   inputs (the KV both write is the fused one's), logits' relative L2 and greedy-token agreement per step;
   then free-running greedy decoding of the same prompt with each graph, tokens and the first divergence
   (random weights: near-flat logits, so a late divergence is a near tie, not a bug);
3. ``timing``: interleaved repeats (``--repeats``, default 5) of on / off: engine ``step()`` median of
   ``--steps`` batch-1 decode steps at context 128.., and the graph's back-to-back replay time (GPU time);
   a fresh prompt per repeat. Summary: median over repeats per mode, the difference, and the aim.

Results are written after each section (``bench.lib.results.write_result``), so a timeout keeps what was measured.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from bench.lib.cuda_timing import graph_replay_ms, step_times_ms
from bench.lib.results import write_result

AIM_MS = 4.05
RESULTS: dict[str, Any] = {"study": "b1_fused", "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
OUT = Path("b1_fused.json")


def save() -> None:
    write_result(OUT, RESULTS)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def build(smoke: bool):
    from distserve.server.engine.llm_engine import EngineConfig, LLMEngine

    cfg = EngineConfig(
        model=None if smoke else "preset:llama-2-7b",
        device="cpu" if smoke else "cuda",
        dtype="float32" if smoke else "bfloat16",
        num_blocks=256 if smoke else 1024,  # 16k tokens of KV (8 GB at 7B): a few prompts of ~1k
        max_model_len=1024,
        max_num_seqs=1,
        max_num_batched_tokens=2048,
        attention_backend="sdpa" if smoke else "triton",
        enable_prefix_caching=False,
    )
    t0 = time.time()
    eng = LLMEngine(cfg)
    RESULTS["engine"] = {
        "build_s": round(time.time() - t0, 1),
        "model": cfg.model,
        "ops": eng.model.ops.name,
        "fuse_gemv_default": getattr(eng.model.ops, "fuse_gemv", None),
        "gemv_tuning": getattr(eng, "gemv_report", None),
    }
    return eng


def fusable(eng) -> dict[str, bool]:
    """Which projections the fusion applies to (a Triton GEMV config from tune_gemv)."""
    layer = eng.model.layers[0]
    mods = {
        "qkv": layer.self_attn.qkv_proj,
        "o": layer.self_attn.o_proj,
        "gate_up": layer.mlp.gate_up_proj,
        "down": layer.mlp.down_proj,
    }
    return {k: getattr(m, "gemv_cfg", None) is not None for k, m in mods.items()}


def runners(eng) -> dict[str, Any]:
    """Two graph runners at batch 1 on the engine, captured with the fusion on and off."""
    from distserve.server.engine.cuda_graph_runner import CudaGraphRunner

    out = {}
    ops = eng.model.ops
    for mode in ("on", "off"):
        if hasattr(ops, "fuse_gemv"):
            ops.fuse_gemv = mode == "on"
        t0 = time.time()
        out[mode] = CudaGraphRunner(eng.runner, eng.max_model_len, batch_sizes=[1])
        RESULTS.setdefault("capture_s", {})[mode] = round(time.time() - t0, 2)
    if hasattr(ops, "fuse_gemv"):
        ops.fuse_gemv = True  # eager batch-1 steps (none here: every decode step replays a graph)
    return out


def kernels(eng) -> None:
    """Fused kernel against its unfused kernels, per 7B projection, on the engine's weights and tuned configs."""
    from distserve.server.engine.ops import cuda_ops as co

    layers = list(eng.model.layers)
    h = eng.model_config.hidden_size
    dt = eng.model.embed_tokens.weight.dtype
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(1, h, device="cuda", generator=g) * 4).to(dt)
    res0 = (torch.randn(1, h, device="cuda", generator=g) * 10).to(dt)
    ones = torch.ones(h, device="cuda", dtype=dt)
    inter = eng.model_config.intermediate_size
    gu = torch.randn(1, 2 * inter, device="cuda", generator=g).to(dt)
    a_in = torch.randn(1, layers[0].self_attn.q_size, device="cuda", generator=g).to(dt)
    idx = list(range(len(layers)))
    res_buf = res0.clone()

    def norm_pair(get, norm_get):
        def fused(i):
            m, n = get(layers[i]), norm_get(layers[i])
            return co.gemv_fused(x, m.weight, m.bias, m.gemv_cfg, norm_weight=n.weight, eps=n.eps)

        def unfused(i):
            m, n = get(layers[i]), norm_get(layers[i])
            return co.gemv(co.rms_norm(x, n.weight, n.eps), m.weight, m.bias, m.gemv_cfg)

        return fused, unfused

    def add_pair(get, inp, silu):
        def fused(i, out=None):
            m = get(layers[i])
            return co.gemv_fused(inp, m.weight, m.bias, m.gemv_cfg, silu=silu, residual=res_buf if out is None else out)

        def unfused(i, out=None):
            m = get(layers[i])
            y = co.gemv(co.silu_mul(inp) if silu else inp, m.weight, m.bias, m.gemv_cfg)
            co.rms_norm(y, ones, 1e-5, residual=res_buf if out is None else out)  # its add (and a norm: timed too)

        return fused, unfused

    # each pair is timed alone: the engine's unfused layer shares an add+RMSNorm between o_add and gate_up_norm
    # (and between down_silu_add and the next qkv_norm), so the per-layer saving is less than the pairs' sum
    out_note = (
        "pairs timed alone; the unfused o_add / down_silu_add include the add+RMSNorm kernel that the next "
        "norm pair's rms_norm also stands for"
    )
    pairs = {
        "qkv_norm": norm_pair(lambda l: l.self_attn.qkv_proj, lambda l: l.input_layernorm),
        "o_add": add_pair(lambda l: l.self_attn.o_proj, a_in, False),
        "gate_up_norm": norm_pair(lambda l: l.mlp.gate_up_proj, lambda l: l.post_attention_layernorm),
        "down_silu_add": add_pair(lambda l: l.mlp.down_proj, gu, True),
    }
    ok = fusable(eng)
    out: dict[str, Any] = {"note": out_note}
    RESULTS["kernels"] = out
    for name, (fused, unfused) in pairs.items():
        key = name.split("_")[0] if not name.startswith("gate_up") else "gate_up"
        if not ok[key]:
            out[name] = "tune_gemv chose cuBLAS: no fusion"
            continue
        try:
            if name.endswith("add"):
                a, b = res0.clone(), res0.clone()
                fused(0, a)
                unfused(0, b)
            else:
                a, b = fused(0), unfused(0)
            row: dict[str, Any] = {"rel": rel(a, b), "bit_equal": bool(torch.equal(a, b))}
            row["fused_us"] = co._graph_ms(fused, idx) * 1e3
            row["unfused_us"] = co._graph_ms(unfused, idx) * 1e3
            row["saved_us"] = row["unfused_us"] - row["fused_us"]
            out[name] = row
            print(f"  {name}: fused {row['fused_us']:.1f} us, unfused {row['unfused_us']:.1f} us, rel {row['rel']:.2e}")
        except Exception:
            out[name] = traceback.format_exc()[-1500:]
            print(out[name])
        save()


def _prompt(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def check(eng, grs: dict, rng: random.Random, steps: int) -> None:
    from distserve.server.engine.sampling_params import SamplingParams

    greedy = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    vocab = eng.model_config.vocab_size
    run = eng.runner.execute
    per_step: list[dict] = []

    def both(scheduled):
        eng.runner.graph_runner = grs["off"]
        lu = run(scheduled).float().clone()
        eng.runner.graph_runner = grs["on"]
        lf = run(scheduled)
        if len(scheduled) == 1 and scheduled[0].num_new_tokens == 1:
            lf32 = lf.float()
            top2 = lu.topk(2, dim=-1).values[0]
            per_step.append(
                {
                    "rel": rel(lf32, lu),
                    "same_token": int(lf32.argmax()) == int(lu.argmax()),
                    "top2_margin_off": float(top2[0] - top2[1]),
                    "max_abs": float((lf32 - lu).abs().max()),
                }
            )
        return lf

    prompt = _prompt(rng, vocab, 128)
    eng.runner.execute = both
    try:
        eng.add_request("lockstep", prompt, greedy)
        while eng.has_unfinished_requests():
            eng.step()
    finally:
        del eng.runner.execute  # (the instance attribute: back to the method)
    c: dict[str, Any] = {
        "lockstep_steps": len(per_step),
        "lockstep_max_rel": max((s["rel"] for s in per_step), default=None),
        "lockstep_median_rel": statistics.median(s["rel"] for s in per_step) if per_step else None,
        "lockstep_same_token": sum(s["same_token"] for s in per_step),
        "lockstep": per_step,
    }
    RESULTS["check"] = c
    save()
    toks = {}
    for mode in ("on", "off"):
        eng.runner.graph_runner = grs[mode]
        rid = f"free-{mode}"
        eng.add_request(rid, prompt, greedy)
        got: list[int] = []
        while eng.has_unfinished_requests():
            for o in eng.step():
                got.extend(o.new_token_ids)
        toks[mode] = got
    diverge = next((i for i, (a, b) in enumerate(zip(toks["on"], toks["off"])) if a != b), None)
    c.update({"free_tokens_on": toks["on"], "free_tokens_off": toks["off"], "free_first_divergence": diverge})
    print(
        f"  check: lockstep max rel {c['lockstep_max_rel']}, same token {c['lockstep_same_token']}/{len(per_step)}, "
        f"free-running first divergence {diverge} of {len(toks['on'])}"
    )
    save()


def _steps(eng, n: int) -> list[float]:
    return step_times_ms(eng, n)


def _replay_ms(gr, n: int = 30) -> float | None:
    return graph_replay_ms(gr.graphs[1], n) if gr.use_graphs else None


def timing(eng, grs: dict, rng: random.Random, repeats: int, steps: int) -> None:
    from distserve.server.engine.sampling_params import SamplingParams

    greedy = SamplingParams(max_tokens=100000, temperature=0.0, ignore_eos=True)
    vocab = eng.model_config.vocab_size
    reps: list[dict] = []
    t: dict[str, Any] = {"repeats": reps, "steps_per_repeat": steps, "context_start": 128}
    RESULTS["timing"] = t
    for r in range(repeats):
        for mode in ("on", "off") if r % 2 == 0 else ("off", "on"):  # alternate which goes first
            eng.runner.graph_runner = grs[mode]
            rid = f"t{r}-{mode}"
            eng.add_request(rid, _prompt(rng, vocab, 128), greedy)
            while any(not s.output_token_ids for s in eng.requests.values()):
                eng.step()  # the prefill
            _steps(eng, 5)
            before = grs[mode].num_replays
            ts = _steps(eng, steps)
            assert grs[mode].num_replays - before == steps, "a decode step left the graph"
            row = {
                "repeat": r,
                "mode": mode,
                "step_ms_median": statistics.median(ts),
                "step_ms_p10": sorted(ts)[len(ts) // 10],
                "replay_ms": _replay_ms(grs[mode]),
            }
            reps.append(row)
            eng.abort_request(rid)
            print(f"  repeat {r} fusion {mode}: step {row['step_ms_median']:.3f} ms, replay {row['replay_ms']}")
            save()
    summary: dict[str, Any] = {}
    for mode in ("on", "off"):
        rows = [x for x in reps if x["mode"] == mode]
        summary[f"step_ms_{mode}"] = statistics.median(x["step_ms_median"] for x in rows)
        replays = [x["replay_ms"] for x in rows if x["replay_ms"] is not None]
        summary[f"replay_ms_{mode}"] = statistics.median(replays) if replays else None
        summary[f"step_ms_{mode}_all"] = [round(x["step_ms_median"], 4) for x in rows]
    summary["step_saved_ms"] = summary["step_ms_off"] - summary["step_ms_on"]
    if summary["replay_ms_on"] is not None:
        summary["replay_saved_ms"] = summary["replay_ms_off"] - summary["replay_ms_on"]
    summary["aim_ms"] = AIM_MS
    summary["aim_met"] = summary["step_ms_on"] <= AIM_MS
    t["summary"] = summary
    save()


def main() -> None:
    global OUT
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="b1_fused.json")
    ap.add_argument(
        "--smoke", action="store_true", help="tiny model on the CPU: checks the script, no timing worth reading"
    )
    ap.add_argument("--repeats", type=int, default=5, help="interleaved on/off repeats of the step timing (>= 3)")
    ap.add_argument("--steps", type=int, default=100, help="timed decode steps per repeat and mode")
    ap.add_argument("--check-steps", type=int, default=24, help="decode steps of the fused/unfused comparison")
    a = ap.parse_args()
    OUT = Path(a.out)
    if not a.smoke and not torch.cuda.is_available():
        raise SystemExit("needs CUDA (or --smoke)")
    repeats, steps, check_steps = (max(3, a.repeats), a.steps, a.check_steps) if not a.smoke else (3, 4, 4)
    RESULTS["device"] = torch.cuda.get_device_name(0) if not a.smoke else "cpu (smoke)"
    try:
        import triton

        RESULTS["versions"] = {"torch": torch.__version__, "triton": triton.__version__}
    except ImportError:
        RESULTS["versions"] = {"torch": torch.__version__, "triton": None}
    eng = build(a.smoke)
    RESULTS["fusable"] = fusable(eng)
    print(f"engine {RESULTS['engine']['build_s']} s, ops {eng.model.ops.name}, fusable {RESULTS['fusable']}")
    save()
    if not a.smoke:
        kernels(eng)
    grs = runners(eng)
    rng = random.Random(0)
    for name, fn in (
        ("check", lambda: check(eng, grs, rng, check_steps)),
        ("timing", lambda: timing(eng, grs, rng, repeats, steps)),
    ):
        t0 = time.time()
        try:
            fn()
        except Exception:
            RESULTS.setdefault("errors", {})[name] = traceback.format_exc()
            print(RESULTS["errors"][name])
        RESULTS.setdefault("section_s", {})[name] = round(time.time() - t0, 1)
        save()
    s = RESULTS.get("timing", {}).get("summary")
    if s:
        print(
            f"b1 step: fused {s['step_ms_on']:.3f} ms, unfused {s['step_ms_off']:.3f} ms (saved "
            f"{s['step_saved_ms']:.3f}); replay fused {s['replay_ms_on']} / unfused {s['replay_ms_off']}; "
            f"aim {AIM_MS} ms met: {s['aim_met']}"
        )
    if a.smoke:
        assert "errors" not in RESULTS, RESULTS.get("errors")
        assert RESULTS["check"]["lockstep_steps"] == check_steps and RESULTS["check"]["lockstep_max_rel"] == 0.0
        print("smoke ok")


if __name__ == "__main__":
    main()
