"""FP8 decode on one H200 (issue 32): kernels, then the 7B preset's decode step in four precisions.

    python3 bench/gpu_fp8.py --out $OUT/gpu_fp8.json        (on the device: bench/gpu_fp8_run.sh)

1. ``kernels``: each 7B projection (qkv 12288x4096, o 4096x4096, gate_up 22016x4096, down 4096x11008) at
   M = 1, 16, 64, 128 rows: cuBLAS bf16 against the e4m3 GEMV candidates (M = 1), the split-K candidates
   (M > 1: ``fp8_linear.SPLITK_CANDIDATES``, what the engine's start-up tuner tries), the old tile kernel
   (``fp8_dot`` with DOT_CONFIG, the 2026-12-01 path) and ``torch._scaled_mm`` (activation quantised per
   row), each timed as a CUDA graph over 32 weight copies (weights stream from HBM, not L2) and checked
   against float64.
2. ``engine``: ``preset:llama-2-7b`` built four times (bf16; FP8 weights; FP8 KV; both), one process each,
   ``gpu_memory_utilization`` 0.9, triton backend, decode CUDA graphs, start-up tuning on (the e4m3
   GEMV / split-K configs per shape, the paged-decode tile per cache dtype and regime; both reported in
   the JSON): KV capacity (sequences of 2k tokens), decode logits after a bf16 prefill hand-off (the P/D
   path) against bf16 (the random model's sensitivity) and against the same function computed another way
   (``handoff_check``: a bf16 cache holding the KV rounded to e4m3; the correctness check), ``step()``
   medians at batch 1 (context 128) and 8 / 64 / 128 (context ~1k); then,
   for bf16 and FP8 weights + KV, the same engine back on the 2026-12-01 kernels (``legacy``: graphs
   re-captured) at batch 1 and 64, a same-run comparison.

Accuracy on SmolLM2 is not measured here: the engine's own export of the model is bf16 safetensors (270 MB,
larger than the 98 MB GGUF), beyond what one device call carries; the CPU's emulated FP8 path computes the
same function (``bench/fp8_accuracy.py``), and the kernels are checked against float64 in tests/gpu.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from bench.lib.cuda_timing import graph_replay_ms, step_times_ms

RESULTS: dict = {"device": None, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
OUT = Path("gpu_fp8.json")
MODEL = ["preset:llama-2-7b", "cuda"]  # --smoke: the tiny model on the CPU (checks this script, no timing)
SHAPES = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)}
MS = (1, 16, 64, 128)
LEGACY = ("bf16", "fp8_both")  # also measured with the 2026-12-01 kernels (batch 1 and 64)
VARIANTS = {
    "bf16": {},
    "fp8_weights": {"weight_dtype": "fp8"},
    "fp8_kv": {"kv_cache_dtype": "fp8_e4m3"},
    "fp8_both": {"weight_dtype": "fp8", "kv_cache_dtype": "fp8_e4m3"},
}


def save() -> None:
    OUT.write_text(json.dumps(RESULTS, indent=1, default=str))


def med(xs):
    return statistics.median(xs)


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def graph_ms(call, weights, reps: int = 5) -> float:
    from distserve.server.engine.ops.cuda_ops import _graph_ms

    return _graph_ms(call, weights, reps) * 1e3  # us per call


def kernels() -> None:
    """Per projection and M: cuBLAS bf16; the e4m3 GEMV candidates (M = 1); the split-K candidates (M > 1,
    the engine's tuner's list); the old tile kernel (``fp8_dot``, DOT_CONFIG: the 2026-12-01 path); and
    ``_scaled_mm``. Each checked against float64, timed as a CUDA graph over 32 weight copies. The compiles
    land in Triton's cache, so the engines' start-up tuning (same candidates) finds them there."""
    from distserve.server.engine import fp8_linear as fl
    from distserve.server.engine.fp8 import quantize_per_channel

    res: dict = {}
    RESULTS["kernels_us"] = res
    for name, (n, k) in SHAPES.items():
        g = torch.Generator(device="cuda").manual_seed(n)
        ws = [torch.randn(n, k, device="cuda", generator=g).mul_(0.02).to(torch.bfloat16) for _ in range(32)]
        qs = [quantize_per_channel(w) for w in ws]
        locks = [torch.zeros(8 * -(-n // 16), dtype=torch.int32, device="cuda") for _ in range(32)]
        idx = list(range(32))
        for m in MS:
            x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
            q0, s0 = qs[0]
            ref = (x.double() @ q0.double().t()) * s0.double()
            row: dict = {"bytes_bf16": n * k * 2}
            row["cublas_bf16"] = graph_ms(lambda w: torch.nn.functional.linear(x, w), ws)

            def timed(key, fn):
                try:
                    e = rel(fn(0), ref)
                    row[key] = graph_ms(fn, idx)
                    row[key + "_rel"] = e
                    return row[key] if e < 1e-2 else None
                except Exception as ex:  # a config that does not compile here
                    row[key] = f"error {type(ex).__name__}: {ex}"[:200]
                    return None

            best: dict = {}
            if m == 1:
                for i, c in enumerate(fl.GEMV_CANDIDATES):
                    if k % c["BLOCK_K"]:
                        continue
                    t = timed(f"fp8_gemv{i}", lambda j, c=c: fl.fp8_gemv(x, qs[j][0], qs[j][1], None, c))  # noqa: F821
                    if t is not None and t < best.get("gemv", (1e9,))[0]:
                        best["gemv"] = (t, i)
            else:
                for i, c in enumerate(fl.SPLITK_CANDIDATES):
                    t = timed(f"fp8_splitk{i}", lambda j, c=c: fl.fp8_splitk(x, qs[j][0], qs[j][1], None, c, locks[j]))  # noqa: F821
                    if t is not None and t < best.get("splitk", (1e9,))[0]:
                        best["splitk"] = (t, i)
            timed("fp8_dot_old", lambda j: fl.fp8_dot(x, qs[j][0], qs[j][1], None, fl.DOT_CONFIG))  # noqa: F821
            timed("scaled_mm", lambda j: fl.fp8_scaled_mm(x, qs[j][0], qs[j][1], None))  # noqa: F821
            for kk, (t, i) in best.items():
                row[f"best_{kk}"] = t
                row[f"best_{kk}_cfg"] = i
            res[f"{name}_m{m}"] = row
            nums = {
                kk: v for kk, v in row.items() if isinstance(v, float) and not kk.endswith("_rel") and "best" not in kk
            }
            print(
                f"  {name} m={m}: cublas {row['cublas_bf16']:.1f}, "
                + ", ".join(f"{kk} {v:.1f}" for kk, v in sorted(nums.items(), key=lambda t: t[1])[:3])
            )
            save()
        del ws, qs
        torch.cuda.empty_cache()
    save()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _steps(eng, n: int) -> list[float]:
    return step_times_ms(eng, n)


def _until_decoding(eng):
    while any(s.num_computed_tokens < s.num_tokens - 1 or not s.output_token_ids for s in eng.requests.values()):
        eng.step()


def _replay_ms(gr, bs, n=30) -> float:
    return graph_replay_ms(gr.graphs[bs], n)


def engine(variant: str, kw: dict, handoff: dict) -> None:
    from distserve.server.engine.llm_engine import EngineConfig, LLMEngine
    from distserve.server.engine.sampling_params import SamplingParams

    t0 = time.time()
    eng = LLMEngine(
        EngineConfig(
            model=MODEL[0],
            device=MODEL[1],
            dtype="bfloat16",
            gpu_memory_utilization=0.9 if MODEL[1] == "cuda" else 0.0,
            max_num_seqs=128,
            max_num_batched_tokens=8192,
            attention_backend="triton" if MODEL[1] == "cuda" else "sdpa",
            kv_calibration_requests=0,
            **kw,
        )
    )
    cfg = eng.model_config
    wbytes = sum(p.numel() * p.element_size() for p in eng.model.parameters())
    r: dict = {
        "build_s": round(time.time() - t0, 1),
        "ops": eng.model.ops.name,
        "weight_bytes": wbytes,
        "num_blocks": eng.runner.num_blocks,
        "kv_bytes": eng.kv_cache_bytes,
        "capacity_seqs_2k": eng.runner.num_blocks * eng.config.block_size // 2048,
        "graph_sizes": eng.runner.graph_runner.batch_sizes if eng.runner.graph_runner else None,
    }
    RESULTS.setdefault("engine", {})[variant] = r
    rng = random.Random(0)
    vocab = cfg.vocab_size
    # --- logits after a bf16 prefill hand-off (8 prompts of 128) ---
    if variant == "bf16":
        for i in range(8):
            eng.add_request(
                f"h{i}",
                [rng.randrange(3, vocab) for _ in range(128)],
                SamplingParams(max_tokens=4, temperature=0.0),
                prefill_only=True,
            )
        first = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                first[o.request_id] = o.new_token_ids
        for i in range(8):
            seq, kv = eng.take_prefilled_kv(f"h{i}")
            handoff.setdefault("kv", {})[f"h{i}"] = (list(seq.prompt_token_ids), first[f"h{i}"], kv.cpu())
    if "kv" in handoff:
        handoff_check(eng, variant, handoff, r)
    r["fp8_linear_tuning"] = getattr(eng, "fp8_report", None)
    r["decode_attention_tuning"] = getattr(eng, "decode_report", None)
    measure(eng, r, "", (1, 8, 64, 128) if MODEL[1] == "cuda" else (1, 8), variant, rng, vocab)
    if variant in LEGACY and MODEL[1] == "cuda":  # the 2026-12-01 kernels, same process, same weights
        legacy(eng)
        measure(eng, r, "legacy_", (1, 64), variant, rng, vocab)
    del eng
    gc.collect()
    torch.cuda.empty_cache()
    _ = cfg


def _handoff_step(eng, kvs: dict, tag: str) -> torch.Tensor:
    """Commit each bf16-prefilled KV (``kvs``: rid -> (prompt, first token, kv)), run one decode step of the
    whole batch, return its logits (float32, CPU); the requests are then aborted."""
    from distserve.server.engine.sampling_params import SamplingParams

    rows = []
    orig = eng.runner.execute

    def capture(sched):
        out = orig(sched)
        rows.append(out.float().cpu())
        return out

    for rid, (prompt, t1, kv) in kvs.items():
        assert eng.reserve_prefilled(rid + tag, prompt, t1, SamplingParams(max_tokens=3, temperature=0.0))
        eng.commit_prefilled(rid + tag, kv)
    eng.runner.execute = capture
    eng.step()
    del eng.runner.execute  # (the instance attribute: back to the method)
    for rid in kvs:
        eng.abort_request(rid + tag)
    return rows[0]


def handoff_check(eng, variant: str, handoff: dict, r: dict) -> None:
    """The P/D hand-off's numerics, checked against the same function computed another way.

    The 7B preset has random weights: near-flat logits, and 32 random layers that amplify any perturbation,
    so FP8 against bf16 (``handoff_*_vs_bf16``) says how sensitive this model is, not whether the hand-off
    is right. The check: a compute-dtype cache given the same KV rounded to e4m3 at scale 1.0 (exact in
    bf16; the FP8 engines here run uncalibrated, scale 1.0) computes what the FP8 cache should, except
    for the new token's own K/V. So ``fp8_kv`` is compared with ``bf16`` decoding the rounded KV and
    ``fp8_both`` with ``fp8_weights`` decoding it (``handoff_*_vs_same_kv``: expect rel well under 0.05,
    top-1 near 1), and ``handoff_kv_rounding_sensitivity`` is bf16 on the rounded KV against bf16."""
    from distserve.server.engine.fp8 import quantize

    kvs = handoff["kv"]
    logits = _handoff_step(eng, kvs, "")
    saved = handoff.setdefault("_logits", {})
    saved[variant] = logits
    ref = saved["bf16"]
    r["handoff_logits_rel_vs_bf16"] = rel(logits, ref)
    r["handoff_top1_agree_vs_bf16"] = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
    if variant in ("bf16", "fp8_weights"):  # a compute-dtype cache: decode the e4m3-rounded KV too
        rounded = {k: (p, t, quantize(kv, 1.0).to(kv.dtype)) for k, (p, t, kv) in kvs.items()}
        saved[variant + "_kv_e4m3"] = _handoff_step(eng, rounded, "e")
        if variant == "bf16":
            s = saved["bf16_kv_e4m3"]
            r["handoff_kv_rounding_sensitivity_rel"] = rel(s, ref)
            r["handoff_kv_rounding_sensitivity_top1"] = (s.argmax(-1) == ref.argmax(-1)).float().mean().item()
    same = {"fp8_kv": "bf16_kv_e4m3", "fp8_both": "fp8_weights_kv_e4m3"}.get(variant)
    if same in saved:
        want = saved[same]
        r["handoff_logits_rel_vs_same_kv"] = rel(logits, want)
        r["handoff_top1_agree_vs_same_kv"] = (logits.argmax(-1) == want.argmax(-1)).float().mean().item()


def measure(eng, r: dict, prefix: str, batches, variant: str, rng, vocab: int) -> None:
    """``step()`` medians: batch 1 at context 128 (100 steps), larger batches at context ~1k (20 steps)."""
    from distserve.server.engine.sampling_params import SamplingParams

    greedy = SamplingParams(max_tokens=100000, temperature=0.0, ignore_eos=True)
    for b in batches:
        ctx_len = 128 if b == 1 else 1023
        for i in range(b):
            eng.add_request(f"{prefix}b{b}-{i}", [rng.randrange(3, vocab) for _ in range(ctx_len)], greedy)
        _until_decoding(eng)
        _steps(eng, 5 if b == 1 else 3)
        ts = _steps(eng, 100 if b == 1 else 20)
        key = f"{prefix}b1_ctx128" if b == 1 else f"{prefix}b{b}_ctx1k"
        r[f"{key}_step_ms"] = med(ts)
        r[f"{key}_tok_s"] = b / (med(ts) / 1e3)
        if b == 1 and eng.runner.graph_runner:
            r[f"{prefix}b1_replay_ms"] = _replay_ms(eng.runner.graph_runner, 1)
        else:
            r[f"{key}_mean_ctx"] = statistics.mean(s.num_tokens for s in eng.requests.values())
        print(f"  {prefix}{variant}: b{b} {med(ts):.2f} ms, {b / (med(ts) / 1e3):.0f} tok/s")
        for i in range(b):
            eng.abort_request(f"{prefix}b{b}-{i}")
        save()


def legacy(eng) -> None:
    """Back to the 2026-12-01 kernels: one GEMV config, the old tile kernel for M > 1, the bf16 decode
    attention config for every cache; decode graphs re-captured."""
    from distserve.server.engine import fp8_linear as fl
    from distserve.server.engine.attention import triton_decode as td

    fl.SPLITK_MAX_M = 0
    for mod in eng.model.modules():
        if getattr(mod, "fp8_cfg", None) is not None:
            mod.fp8_cfg = None
    eng.model.backend.decode_configs = {}
    td.DECODE_CONFIG_FP8.clear()
    td.DECODE_CONFIG_FP8.update(td.DECODE_CONFIG)
    gr = eng.runner.graph_runner
    if gr is not None:
        gr.graphs.clear()
        gr.outputs.clear()
        gc.collect()
        torch.cuda.empty_cache()
        gr.capture()


def table() -> str:
    e = RESULTS.get("engine", {})
    lines = [
        "variant | b1 step ms | b8 | b64x1k ms (tok/s) | b128x1k | cap 2k seqs | logits rel | top1 "
        "| vs same KV rel | top1"
    ]
    for v, r in e.items():
        lines.append(
            f"{v} | {r.get('b1_ctx128_step_ms', float('nan')):.2f} | {r.get('b8_ctx1k_step_ms', float('nan')):.2f} | "
            f"{r.get('b64_ctx1k_step_ms', float('nan')):.2f} ({r.get('b64_ctx1k_tok_s', 0):.0f}) | "
            f"{r.get('b128_ctx1k_step_ms', float('nan')):.2f} | {r.get('capacity_seqs_2k')} | "
            f"{r.get('handoff_logits_rel_vs_bf16', float('nan')):.4f} | {r.get('handoff_top1_agree_vs_bf16', float('nan')):.3f}"  # noqa: E501
            f" | {r.get('handoff_logits_rel_vs_same_kv', float('nan')):.4f} | {r.get('handoff_top1_agree_vs_same_kv', float('nan')):.3f}"  # noqa: E501
        )
    for v, r in e.items():
        if "legacy_b1_ctx128_step_ms" in r:
            lines.append(
                f"{v} legacy kernels | {r['legacy_b1_ctx128_step_ms']:.2f} | - | "
                f"{r.get('legacy_b64_ctx1k_step_ms', float('nan')):.2f} ({r.get('legacy_b64_ctx1k_tok_s', 0):.0f})"
            )
    if "bf16" in e and "fp8_both" in e:
        a, b = e["bf16"], e["fp8_both"]
        ratios = {
            "b64_tok_s_ratio": b.get("b64_ctx1k_tok_s", 0) / max(a.get("b64_ctx1k_tok_s", 1), 1e-9),
            "capacity_ratio": b.get("capacity_seqs_2k", 0) / max(a.get("capacity_seqs_2k", 1), 1),
            "b1_ms_both": b.get("b1_ctx128_step_ms"),
            "b1_ms_bf16": a.get("b1_ctx128_step_ms"),
        }
        RESULTS["aims"] = ratios
        lines.append(json.dumps(ratios))
    return "\n".join(lines)


GPTQ_SHAPES = {"o": (4096, 4096), "gate": (11008, 4096), **{k: SHAPES[k] for k in ("qkv", "gate_up", "down")}}


def gptq_timing(device: str, shapes: list[str], tokens: int) -> None:
    """Load-time cost of ``decode.fp8_weight_rounding: gptq`` on 7B shapes (random weights; the cost does not
    depend on the values): per projection, the Hessian ``X^T X`` of ``tokens`` calibration rows (float32, as
    ``fp8_gptq._Hessian``), the MSE scales (which nearest rounding pays too) and ``gptq_round`` (Cholesky,
    128-column blocks, act order), each timed once after a warm-up on a small shape. A 7B layer is qkv + o +
    gate_up + down; the model is 32 of them, plus the calibration forward (not timed here: about one forward
    pass over ``tokens`` tokens)."""
    from distserve.server.engine.fp8 import quantize_per_channel_mse
    from distserve.server.engine.fp8_gptq import gptq_round

    dev = torch.device(device)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    g = torch.Generator(device="cpu").manual_seed(0)
    w0 = torch.randn(256, 256, generator=g).to(dev)
    gptq_round(w0, w0.T @ w0 + torch.eye(256, device=dev), quantize_per_channel_mse(w0)[1])  # warm-up
    out = RESULTS.setdefault("gptq", {"device": device, "tokens": tokens})
    for name in shapes:
        n, k = GPTQ_SHAPES[name]
        w = (0.02 * torch.randn(n, k, generator=g)).to(dev, torch.bfloat16)
        x = torch.randn(tokens, k, generator=g).to(dev, torch.bfloat16)
        sync()
        t0 = time.perf_counter()
        h = torch.zeros(k, k, device=dev)
        for c in x.split(2048):
            h.addmm_(c.float().T, c.float())
        sync()
        t1 = time.perf_counter()
        _, scale = quantize_per_channel_mse(w)  # nearest rounding pays this too
        sync()
        t2 = time.perf_counter()
        q = gptq_round(w, h, scale)
        sync()
        t3 = time.perf_counter()
        out[name] = {
            "shape": [n, k],
            "hessian_s": round(t1 - t0, 3),
            "mse_scales_s": round(t2 - t1, 3),
            "round_s": round(t3 - t2, 3),
        }
        print(
            f"gptq {name} {n}x{k} on {device}: hessian {t1 - t0:.2f}s, MSE scales {t2 - t1:.2f}s, "
            f"GPTQ rounding {t3 - t2:.2f}s",
            flush=True,
        )
        del w, x, h, q
        save()
    if all(k in out for k in ("qkv", "o", "gate_up", "down")):
        four = ("qkv", "o", "gate_up", "down")
        extra = sum(out[k]["hessian_s"] + out[k]["round_s"] for k in four)  # what gptq adds to nearest
        out["gptq_extra_per_7b_layer_s"] = round(extra, 2)
        out["gptq_extra_per_7b_model_s"] = round(32 * extra, 1)
        out["mse_scales_per_7b_model_s"] = round(32 * sum(out[k]["mse_scales_s"] for k in four), 1)
        save()


def main() -> None:
    global OUT
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu_fp8.json")
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument("--variant-timeout-s", type=float, default=95.0)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU: checks the script only")
    ap.add_argument("--handoff", default="", help="(internal) file of the bf16 hand-off KV and logits")
    ap.add_argument(
        "--gptq-only",
        default="",
        help="only time GPTQ rounding (decode.fp8_weight_rounding: gptq) on these 7B shapes, e.g. "
        "qkv,o,gate_up,down (or o,gate), then exit",
    )
    ap.add_argument("--gptq-device", default="cuda")
    ap.add_argument("--gptq-tokens", type=int, default=10240, help="calibration rows (the shipped text: 10240)")
    a = ap.parse_args()
    OUT = Path(a.out)
    if a.gptq_only:
        RESULTS["device"] = torch.cuda.get_device_name(0) if a.gptq_device.startswith("cuda") else a.gptq_device
        gptq_timing(a.gptq_device, a.gptq_only.split(","), a.gptq_tokens)
        return
    if a.smoke:
        MODEL[:] = [None, "cpu"]
    RESULTS["device"] = torch.cuda.get_device_name(0) if not a.smoke else "cpu (smoke)"
    if not a.skip_kernels and not a.smoke:
        t0 = time.time()
        try:
            kernels()
        except Exception:
            RESULTS["kernels_error"] = traceback.format_exc()
            print(RESULTS["kernels_error"])
        print(f"kernels {time.time() - t0:.0f}s")
    variants = a.variants.split(",")
    if len(variants) > 1 and not a.smoke:
        # one process per engine: a 7B engine's memory (CUDA graph pools, 110+ GB of KV) is not all given back
        # inside one process (measured: the second engine hit OOM), and each variant starts from the same state
        hand = str(OUT.with_suffix(".handoff.pt"))
        for v in variants:
            part = OUT.with_name(f"{OUT.stem}_{v}.json")
            cmd = [
                sys.executable,
                "-m",
                "bench.kernels.gpu_fp8",
                "--skip-kernels",
                "--variants",
                v,
                "--out",
                str(part),
                "--handoff",
                hand,
            ]
            t0 = time.time()
            try:
                rc = subprocess.run(cmd, timeout=a.variant_timeout_s).returncode
            except subprocess.TimeoutExpired:  # what it measured so far is in its part file
                rc = "timeout"
            print(f"engine {v} rc={rc} {time.time() - t0:.0f}s")
            if part.exists():
                sub = json.loads(part.read_text())
                RESULTS.setdefault("engine", {}).update(sub.get("engine", {}))
                RESULTS.setdefault("engine_errors", {}).update(sub.get("engine_errors", {}))
            save()
        print(table())
        save()
        return
    handoff: dict = torch.load(a.handoff) if a.handoff and Path(a.handoff).exists() else {}
    for v in variants:
        t0 = time.time()
        try:
            engine(v, VARIANTS[v], handoff)
        except Exception:
            RESULTS.setdefault("engine_errors", {})[v] = traceback.format_exc()
            print(RESULTS["engine_errors"][v])
        torch.cuda.empty_cache()
        print(f"engine {v} {time.time() - t0:.0f}s")
        save()
        if a.handoff and "kv" in handoff:  # the next variants compare with this one's logits
            torch.save(handoff, a.handoff)
    print(table())
    save()


if __name__ == "__main__":
    main()
