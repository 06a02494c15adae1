"""Where FP8 decode's error comes from (issue 32): a quick study on SmolLM2-135M-Instruct, CPU, float32.

    nice .venv/bin/python -m bench.engine.fp8_accuracy_study --prompts 40 --out bench/results/fp8_accuracy_study.json

``bench/fp8_accuracy.py`` measures the engine end to end; this script asks *why*, fast enough to try many
variants on two cores. It runs its own Llama forward over the model's weights (the engine's arithmetic:
Hugging Face's, float32) in the teacher-forced form the accuracy bench measures: the prompt is prefilled by
the reference (unquantised) model, its K/V handed over, then the 64 continuation tokens (the reference's own
greedy tokens) are run as one causal chunk by the variant: its weights quantised as the variant says, every
K/V it attends to (prompt and continuation) rounded to e4m3 with the variant's scales. A decode step reads
exactly these (its own token's K/V is written to the cache before it is read), so the chunk's logits equal
64 teacher-forced decode steps up to summation order, at a fraction of the cost.

Variants vary one thing at a time: weights only / KV only / both; which projections or layers are FP8;
per-output-channel vs per-block (1x128) weight scales; per-layer vs per-head KV scales; amax vs percentile
calibration; per-token activation rounding (what ``torch._scaled_mm`` adds). Reported per variant: top-1
agreement with the reference and mean KL(reference || variant), and the decoder-weight bytes it stores.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from distserve.server.engine.fp8 import FP8_DTYPE, FP8_MAX
from distserve.server.engine.loader import load_model_config, load_state_dict, load_tokenizer, resolve_model_path
from distserve.server.engine.model import rope_inv_freq

PROJ = ("q", "k", "v", "o", "gate", "up", "down")


def q8(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """Round ``x`` to e4m3 under ``scale`` and widen back (saturating at +-448)."""
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() * scale


def bf(x: torch.Tensor) -> torch.Tensor:
    """Round to bf16 and widen back: what a bf16 op's output (float32 accumulation, bf16 store) holds."""
    return x.to(torch.bfloat16).float()


def ident(x: torch.Tensor) -> torch.Tensor:
    return x


def quant_weight(w: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "channel":
        s = (w.abs().amax(1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
        return q8(w, s)
    if mode == "channel_mse":  # per channel, the scale (within one binade below amax/448) of least squared error
        s0 = (w.abs().amax(1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
        best, best_err = None, None
        for j in range(16):
            qj = q8(w, s0 * 2.0 ** (-j / 16))
            err = (qj - w).pow(2).sum(1, keepdim=True)
            if best is None:
                best, best_err = qj, err
            else:
                take = err < best_err
                best = torch.where(take, qj, best)
                best_err = torch.minimum(err, best_err)
        return best
    if mode.startswith("block"):
        b = int(mode[5:])
        n, k = w.shape
        kp = -(-k // b) * b  # a ragged last group (SmolLM2's K = 576 = 4.5 x 128): zero-padded, amax unchanged
        wb = F.pad(w, (0, kp - k)).view(n, kp // b, b)
        s = (wb.abs().amax(2, keepdim=True) / FP8_MAX).clamp(min=1e-12)
        return q8(wb, s).view(n, kp)[:, :k]
    if mode == "tensor":
        return q8(w, (w.abs().amax() / FP8_MAX).clamp(min=1e-12))
    raise ValueError(mode)


@dataclass
class Variant:
    name: str
    weights: str | None = None  # None | channel | channel_mse | gptq | block128 | tensor
    projections: tuple[str, ...] = PROJ
    bf16_layers: tuple[int, ...] = ()  # decoder layers kept unquantised
    kv: str | None = None  # None | layer | head
    kv_only: str | None = None  # "k" | "v": quantise only that half
    kv_pct: float | None = None  # calibrate from this percentile of |x| instead of amax
    kv_headroom: float = 1.25
    kv_scale_fixed: float | None = None  # e.g. 1.0: the uncalibrated initial scale
    act: bool = False  # per-token e4m3 rounding of every FP8 linear's input (torch._scaled_mm)
    lm_head: bool = False  # lm_head (tied embeddings) in FP8 too
    bf16: bool = False  # bf16 numerics (weights loaded as bf16, every op's output rounded to bf16), as on a GPU
    extra: dict = field(default_factory=dict)


def pairs(tok, n: int, max_len: int, reply_len: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, reply ids) of ShareGPT conversations: bench/fp8_accuracy.py's prompts and order."""
    from distserve.distbench.datasets import _conversations, _sharegpt_path

    data = [d for d in _conversations(_sharegpt_path(None)) if len(d.get("conversations", [])) >= 2]
    random.Random(0).shuffle(data)
    out = []
    for d in data:
        ids = tok.encode(d["conversations"][0]["value"])
        reply = tok.encode(d["conversations"][1]["value"])
        if 8 <= len(ids) <= max_len and len(reply) >= reply_len:
            out.append((ids, reply))
        if len(out) == n:
            break
    return out


class Model:
    def __init__(self, path: Path) -> None:
        self.cfg = cfg = load_model_config(path)
        self.sd = load_state_dict(path, dtype=torch.float32, device="cpu")
        self.L = cfg.num_hidden_layers
        self.H, self.Hkv, self.D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.eps = cfg.rms_norm_eps
        inv = rope_inv_freq(cfg)
        pos = torch.arange(4096).float()
        emb = torch.cat([torch.outer(pos, inv)] * 2, -1)
        self.cos, self.sin = emb.cos(), emb.sin()
        self.embed = self.sd["model.embed_tokens.weight"]
        self.lm = self.sd.get("lm_head.weight", self.embed)
        self.ref_w = [self.layer_weights(i) for i in range(self.L)]
        self.gptq_reports: dict[tuple[int, ...], dict] = {}
        tok = load_tokenizer(path)
        self.encode_calibration = lambda text: tok.encode(text, add_bos=False)

    def layer_weights(self, i: int) -> dict[str, torch.Tensor]:
        p = f"model.layers.{i}."
        w = {n: self.sd[p + f"self_attn.{n}_proj.weight"] for n in "qkvo"}
        w.update({n: self.sd[p + f"mlp.{n}_proj.weight"] for n in ("gate", "up", "down")})
        w["ln1"] = self.sd[p + "input_layernorm.weight"]
        w["ln2"] = self.sd[p + "post_attention_layernorm.weight"]
        return w

    def gptq_w(self, keep: tuple[int, ...]) -> list[dict[str, torch.Tensor]]:
        """The decoder weights as the product's GPTQ rounding leaves them (``quantize_model_weights(...,
        rounding="gptq")`` on the engine's own ``LlamaForCausalLM`` in float32, calibrated on the shipped
        text), dequantised and split back into q/k/v and gate/up. Cached per set of bf16 layers."""
        cache = self.__dict__.setdefault("_gptq_w", {})
        if keep in cache:
            return cache[keep]
        from distserve.server.engine.attention import get_attention_backend
        from distserve.server.engine.fp8 import quantize_model_weights
        from distserve.server.engine.fp8_gptq import calibration_sequences
        from distserve.server.engine.model import LlamaForCausalLM

        t0 = time.time()
        with torch.device("meta"):
            model = LlamaForCausalLM(self.cfg, get_attention_backend("sdpa", torch.device("cpu")))
        model = model.to_empty(device="cpu").float()
        model.load_hf_weights(self.sd)
        report = quantize_model_weights(model, set(keep), "gptq", calibration_sequences(self.encode_calibration))
        q_size, kv_size = self.H * self.D, self.Hkv * self.D
        out = []
        for i, layer in enumerate(model.layers):
            if i in keep:
                out.append(self.ref_w[i])
                continue
            w = dict(self.ref_w[i])

            def deq(mod):
                return mod.weight.float() * mod.weight_scale[:, None]

            qkv = deq(layer.self_attn.qkv_proj)
            w["q"], w["k"], w["v"] = qkv[:q_size], qkv[q_size : q_size + kv_size], qkv[q_size + kv_size :]
            w["o"] = deq(layer.self_attn.o_proj)
            w["gate"], w["up"] = deq(layer.mlp.gate_up_proj).chunk(2)
            w["down"] = deq(layer.mlp.down_proj)
            out.append(w)
        self.gptq_reports[keep] = dict(report, wall_seconds=round(time.time() - t0, 1))
        print(f"GPTQ (bf16 layers {list(keep)}): {self.gptq_reports[keep]}", flush=True)
        cache[keep] = out
        return out

    def variant_weights(self, v: Variant) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor]:
        out = []
        base = self.bf16_w() if v.bf16 else self.ref_w
        if v.weights == "gptq":
            if v.bf16 or v.projections != PROJ:
                raise ValueError("gptq variants: all projections, float32 numerics only")
            return self.gptq_w(tuple(sorted(v.bf16_layers))), self.lm
        for i, w in enumerate(base):
            if v.weights is None or i in v.bf16_layers:
                out.append(w)
                continue
            w = dict(w)
            for n in v.projections:
                w[n] = quant_weight(w[n], v.weights)
            out.append(w)
        lm = bf(self.lm) if v.bf16 else self.lm
        lm = quant_weight(lm, "channel") if v.lm_head else lm
        return out, lm

    def bf16_w(self) -> list[dict[str, torch.Tensor]]:
        """The decoder weights as a bf16 engine holds them (rounded once at load), widened to float32."""
        if not hasattr(self, "_bf16_w"):
            self._bf16_w = [{n: bf(t) for n, t in w.items()} for w in self.ref_w]
        return self._bf16_w

    def norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:  # x [T, h, D]
        c, s = self.cos[pos][:, None, :], self.sin[pos][:, None, :]
        half = x.shape[-1] // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * c + rot * s

    def forward(self, ids, pos0, weights, lm, past=None, kvq=None, act=False, act_names=(), bf16=False):
        """``ids`` at positions ``pos0..``; ``past``: per-layer (K, V) [T0, Hkv, D] unquantised.
        ``kvq(layer, k, v) -> (k, v)`` rounds what is attended to. ``bf16``: every op's output rounded to
        bf16 (the weights are given already rounded). Returns (logits, new per-layer (K, V))."""
        t = len(ids)
        pos = torch.arange(pos0, pos0 + t)
        r = bf if bf16 else ident
        x = r(self.embed[torch.tensor(ids)])
        new = []

        def lin(h, w, name):
            if act and name in act_names:
                s = (h.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
                h = q8(h, s)
            return r(h @ w.T)

        for i, w in enumerate(weights):
            h = r(self.norm(x, w["ln1"]))
            q = lin(h, w["q"], "q").view(t, self.H, self.D)
            k = lin(h, w["k"], "k").view(t, self.Hkv, self.D)
            v = lin(h, w["v"], "v").view(t, self.Hkv, self.D)
            q, k = r(self.rope(q, pos)), r(self.rope(k, pos))
            new.append((k, v))
            if past is not None:
                k = torch.cat([past[i][0], k])
                v = torch.cat([past[i][1], v])
            if kvq is not None:
                k, v = kvq(i, k, v)
            rep = self.H // self.Hkv
            kk = k.repeat_interleave(rep, 1).transpose(0, 1)  # [H, S, D]
            vv = v.repeat_interleave(rep, 1).transpose(0, 1)
            qq = q.transpose(0, 1)
            s_len = kk.shape[1]
            mask = torch.ones(t, s_len, dtype=torch.bool).tril(s_len - t)
            o = F.scaled_dot_product_attention(qq[None], kk[None], vv[None], attn_mask=mask[None, None])[0]
            o = r(o.transpose(0, 1).reshape(t, self.H * self.D))
            x = r(x + lin(o, w["o"], "o"))
            h = r(self.norm(x, w["ln2"]))
            g, u = lin(h, w["gate"], "gate"), lin(h, w["up"], "up")
            x = r(x + lin(r(F.silu(g) * u), w["down"], "down"))
        x = r(self.norm(x, self.sd["model.norm.weight"]))
        return x @ lm.T, new


def kv_scales(cal_kv: list[list[tuple[torch.Tensor, torch.Tensor]]], v: Variant, L: int) -> list[tuple]:
    """Per layer (k_scale, v_scale): scalars (per layer) or [Hkv, 1] tensors (per head)."""
    out = []
    for i in range(L):
        ks = torch.cat([c[i][0] for c in cal_kv])  # [T, Hkv, D]
        vs = torch.cat([c[i][1] for c in cal_kv])
        pair = []
        for x in (ks, vs):
            a = x.abs()
            if v.kv == "head":
                a = a.transpose(0, 1).reshape(a.shape[1], -1)  # [Hkv, T*D]
                m = (
                    a.amax(1)
                    if v.kv_pct is None
                    else torch.quantile(a[:, :: max(1, a.shape[1] // 500000)], v.kv_pct, dim=1)
                )
                pair.append((m * v.kv_headroom / FP8_MAX).clamp(min=1e-8)[:, None])
            else:
                flat = a.flatten()
                m = (
                    flat.amax()
                    if v.kv_pct is None
                    else torch.quantile(flat[:: max(1, flat.numel() // 1000000)], v.kv_pct)
                )
                pair.append(float(m) * v.kv_headroom / FP8_MAX)
        out.append(tuple(pair))
    return out


def gptq_calibration_overlap(m: Model, eval_p: list, n: int = 12) -> dict:
    """The GPTQ calibration text must be disjoint from what is evaluated: evaluation prompts (prompt and
    forced continuation) sharing any ``n``-token run with the shipped calibration text's token stream."""
    from distserve.server.engine.fp8_gptq import calibration_sequences

    cal = calibration_sequences(m.encode_calibration, max_sequences=10**6).flatten().tolist()
    grams = {tuple(cal[i : i + n]) for i in range(len(cal) - n + 1)}
    hits = sum(
        any(tuple(ids[i : i + n]) in grams for i in range(len(ids) - n + 1)) for ids in (p + r for p, r in eval_p)
    )
    return {"ngram": n, "calibration_tokens": len(cal), "eval_prompts": len(eval_p), "eval_prompts_sharing_one": hits}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--calibration", type=int, default=50)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--max-prompt", type=int, default=192)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    ap.add_argument("--layers", action="store_true", help="also the per-layer sensitivity (weights of one layer)")
    ap.add_argument("--greedy", action="store_true", help="force the reference's greedy tokens (slow: 64 steps)")
    ap.add_argument(
        "--ref",
        default="fp32",
        choices=("fp32", "bf16"),
        help="reference numerics; bf16: the reference and every variant run bf16 numerics (as on the GPU)",
    )
    ap.add_argument("--out", default="bench/results/fp8_accuracy_study.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)  # before the long reference, not after it
    t0 = time.time()
    path = resolve_model_path("smollm2-135m-instruct")
    m = Model(path)
    tok = load_tokenizer(path)
    allp = pairs(tok, a.prompts + a.calibration, a.max_prompt, a.tokens)
    cal_p, eval_p = [p for p, _ in allp[: a.calibration]], allp[a.calibration :]
    overlap = gptq_calibration_overlap(m, eval_p)
    print(f"GPTQ calibration text vs evaluation prompts: {overlap}", flush=True)
    torch.inference_mode().__enter__()
    # reference: prompt K/V and teacher-forced logits; the forced continuation is the reference's own greedy
    # tokens with --greedy (as bench/fp8_accuracy.py), else the ShareGPT reply's first tokens (one chunk)
    refs = []
    rb = a.ref == "bf16"
    ref_w, ref_lm = (m.bf16_w(), bf(m.lm)) if rb else (m.ref_w, m.lm)
    for p, reply in eval_p:
        lg, past = m.forward(p, 0, ref_w, ref_lm, bf16=rb)
        cont = [int(lg[-1].argmax())]
        if a.greedy:
            kv = past
            for _ in range(a.tokens - 1):
                lg1, new = m.forward(cont[-1:], len(p) + len(cont) - 1, ref_w, ref_lm, past=kv, bf16=rb)
                kv = [(torch.cat([k0, k1]), torch.cat([v0, v1])) for (k0, v0), (k1, v1) in zip(kv, new)]
                cont.append(int(lg1[-1].argmax()))
        else:
            cont = reply[: a.tokens]
        ref_lg, _ = m.forward(cont, len(p), ref_w, ref_lm, past=past, bf16=rb)
        refs.append((p, cont, past, torch.log_softmax(ref_lg, -1)))
    print(f"reference: {len(refs)} prompts, {time.time() - t0:.0f}s", flush=True)
    # calibration K/V: the calibration prompts prefilled plus 8 greedy tokens' worth (prompt K/V suffices)
    cal_kv = [m.forward(p, 0, ref_w, ref_lm, bf16=rb)[1] for p in cal_p]
    print(f"calibration K/V: {len(cal_kv)} prompts, {time.time() - t0:.0f}s", flush=True)

    A = ("q", "k", "v")
    variants = [
        Variant("w_channel", weights="channel"),
        Variant("kv_layer", kv="layer"),
        Variant("both_channel_layer", weights="channel", kv="layer"),
        Variant("kv_k_only", kv="layer", kv_only="k"),
        Variant("kv_v_only", kv="layer", kv_only="v"),
        Variant("kv_head", kv="head"),
        Variant("kv_layer_p99.9", kv="layer", kv_pct=0.999, kv_headroom=1.0),
        Variant("kv_init_scale_1", kv="layer", kv_scale_fixed=1.0),
        Variant("w_block64", weights="block64"),
        Variant("w_block32", weights="block32"),
        Variant("w_tensor", weights="tensor"),
        Variant("w_qkv_only", weights="channel", projections=A),
        Variant("w_o_only", weights="channel", projections=("o",)),
        Variant("w_gate_up_only", weights="channel", projections=("gate", "up")),
        Variant("w_down_only", weights="channel", projections=("down",)),
        Variant("w_channel_act", weights="channel", act=True),
        Variant("w_channel_lm_head", weights="channel", lm_head=True),
        Variant("w_channel_bf16_first_last", weights="channel", bf16_layers=(0, m.L - 1)),
        Variant("w_no_down", weights="channel", projections=("q", "k", "v", "o", "gate", "up")),
        # the noise floor: the unquantised model in bf16 numerics against the float32 reference
        Variant("bf16_numerics", bf16=True),
        Variant("w_block128", weights="block128"),
        Variant("w_channel_mse", weights="channel_mse"),
        Variant("both_block128_layer", weights="block128", kv="layer"),
        Variant("both_block128_head", weights="block128", kv="head"),
        Variant("both_channel_head", weights="channel", kv="head"),
        Variant("both_channel_layer_first_last", weights="channel", kv="layer", bf16_layers=(0, m.L - 1)),
        Variant("both_block128_layer_first_last", weights="block128", kv="layer", bf16_layers=(0, m.L - 1)),
        Variant("kv_layer_p99.99", kv="layer", kv_pct=0.9999, kv_headroom=1.0),
        Variant("kv_layer_headroom1", kv="layer", kv_headroom=1.0),
        # GPTQ rounding (the product's fp8_gptq, MSE-chosen per-channel scales, calibrated on the shipped text)
        Variant("w_gptq", weights="gptq"),
        Variant("both_gptq_layer", weights="gptq", kv="layer"),
        Variant("both_gptq_layer_first_last", weights="gptq", kv="layer", bf16_layers=(0, m.L - 1)),
        Variant("w_gptq_first_last", weights="gptq", bf16_layers=(0, m.L - 1)),
        Variant("both_channel_mse_layer", weights="channel_mse", kv="layer"),
        Variant("both_channel_mse_layer_first_last", weights="channel_mse", kv="layer", bf16_layers=(0, m.L - 1)),
    ]
    if a.layers:
        variants += [
            Variant(f"w_layer_{i}", weights="channel", bf16_layers=tuple(j for j in range(m.L) if j != i))
            for i in range(m.L)
        ]
    only = [n for n in a.only.split(",") if n]
    if only:
        by_name = {v.name: v for v in variants}
        variants = [by_name[n] for n in only]
    if rb:  # every variant in bf16 numerics too: what differs from the reference is the FP8 storage only
        variants = [dataclasses.replace(v, bf16=True) for v in variants]
    res = {
        "model": "smollm2-135m-instruct",
        "model_file": str(path),
        "method": "own float32 forward, teacher-forced 64-token chunk after a reference prefill (see the docstring)",
        "prompts": len(eval_p),
        "calibration_prompts": len(cal_p),
        "tokens": a.tokens,
        "reference": a.ref,
        "command": "python -m bench.engine.fp8_accuracy_study " + " ".join(sys.argv[1:]),
        "gptq_calibration_overlap": overlap,
        "variants": {},
    }
    dec_bytes_bf16 = sum(w[n].numel() * 2 for w in m.ref_w for n in PROJ)
    for v in variants:
        t1 = time.time()
        weights, lm = m.variant_weights(v)
        kvq = None
        if v.bf16 and v.kv is None:  # the reference's prompt K/V as a bf16 cache holds it

            def kvq(i, k, vv):
                return bf(k), bf(vv)

        if v.kv is not None:
            sc = kv_scales(cal_kv, v, m.L) if v.kv_scale_fixed is None else [(v.kv_scale_fixed,) * 2] * m.L

            def kvq(i, k, vv, sc=sc, only=v.kv_only):
                ks, vs = sc[i]
                return (k if only == "v" else q8(k, ks)), (vv if only == "k" else q8(vv, vs))

        agree = total = 0
        kl = 0.0
        for p, cont, past, ref_lp in refs:
            lg, _ = m.forward(
                cont, len(p), weights, lm, past=past, kvq=kvq, act=v.act, act_names=v.projections, bf16=v.bf16
            )
            lq = torch.log_softmax(lg, -1)
            agree += int((lq.argmax(-1) == ref_lp.argmax(-1)).sum())
            total += len(cont)
            kl += float((ref_lp.exp() * (ref_lp - lq)).sum())
        fp8_elems = 0
        if v.weights is not None:
            fp8_elems = sum(m.ref_w[i][n].numel() for i in range(m.L) if i not in v.bf16_layers for n in v.projections)
        dec_bytes = dec_bytes_bf16 - fp8_elems  # one byte instead of two per FP8 weight (scales ignored)
        row = {
            "top1_agreement": round(agree / total, 5),
            "mean_kl": round(kl / total, 5),
            "positions": total,
            "decoder_weight_bytes_vs_bf16": round(dec_bytes / dec_bytes_bf16, 4),
            "seconds": round(time.time() - t1, 1),
        }
        res["variants"][v.name] = row
        print(v.name, row, flush=True)
        Path(a.out).write_text(json.dumps(res, indent=1))
    res["gptq"] = {str(list(k)): r for k, r in m.gptq_reports.items()}
    res["seconds"] = round(time.time() - t0, 1)
    Path(a.out).write_text(json.dumps(res, indent=1))
    _ = math  # noqa


if __name__ == "__main__":
    main()
