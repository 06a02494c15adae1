"""`distserve chaos nan-check`: finite logits at prompt lengths around powers of two, on every backend.

Seed §4.3: logits were NaN only at prompt lengths 2048/4096 (a FlashAttention
block-boundary bug with causal masks); their release checklist's first item became
"prompts of 2048/4096/8192 tokens, confirm no NaN". Here every length 2^k−1, 2^k,
2^k+1 up to ``prefill.max_seq_len`` goes through the real engine (scheduler, model
runner, the attention backend's prefill, then one decode step on the paged
cache) of every attention backend that this machine can run; the logits each
step returns are checked with ``torch.isfinite``. The engine's KV cache is sized from
the model's KV bytes per token for the longest length asked (one sequence at a time), and
prefix caching is off so every prompt is computed in full.

Lengths beyond the model's context (``max_position_embeddings``) are reported as
``beyond context (N)``, not run and not failures; a prompt of exactly N tokens fills the
context, so only its prefill is checked.
"""

from __future__ import annotations

import json
import random
import sys

from distserve.distbench.atomic import atomic_write

CANDIDATES = ("sdpa", "cpu_paged", "flash_attn_v2", "triton")


def lengths(max_len: int, min_k: int = 4) -> list[int]:
    out: set[int] = set()
    k = min_k
    while (1 << k) - 1 <= max_len:
        out |= {n for n in ((1 << k) - 1, 1 << k, (1 << k) + 1) if 1 <= n <= max_len}
        k += 1
    return sorted(out)


BEYOND = "beyond context"
BLOCK_SIZE = 16


def kv_blocks_for(longest: int, block_size: int = BLOCK_SIZE) -> int:
    """Blocks for one sequence of ``longest`` prompt tokens and the one it decodes, plus a spare."""
    return -(-(longest + 2) // block_size) + 1


def model_context(model: str | None) -> int:
    """The model's context (``max_position_embeddings``), read without building it."""
    from distserve.server.engine.loader import load_model_config, resolve_model_path
    from distserve.server.engine.presets import is_preset, preset_config

    cfg = preset_config(model) if is_preset(model) else load_model_config(resolve_model_path(model))
    return int(cfg.max_position_embeddings)


def verdict_beyond(context: int) -> str:
    return f"{BEYOND} ({context})"


def check_backend(
    backend: str, lens: list[int], model: str | None, device: str, seed: int = 0, context: int | None = None
) -> dict:
    """{length: 'ok' | 'NaN in prefill' | 'beyond context (N)' | ...} for one backend, or {'unavailable': reason}."""
    import torch

    from distserve.server.engine.llm_engine import EngineConfig, LLMEngine
    from distserve.server.engine.sampling_params import SamplingParams

    context = context or model_context(model)
    runnable = [n for n in lens if n <= context]
    out: dict[str, str] = {str(n): verdict_beyond(context) for n in lens if n > context}
    if not runnable:
        return {"lengths": out}
    top = max(runnable)
    try:
        engine = LLMEngine(
            EngineConfig(
                model=model,
                device=device,
                attention_backend=backend,
                block_size=BLOCK_SIZE,
                max_model_len=top + 3,
                max_num_batched_tokens=max(top, 16) + 16,
                max_num_seqs=4,
                enable_prefix_caching=False,
                num_blocks=kv_blocks_for(top),  # from the model's KV bytes per token: one sequence of `top`
            )
        )
    except (ValueError, RuntimeError, ImportError) as e:
        return {"unavailable": str(e)}
    try:
        out.update(_check_lengths(engine, runnable, context, seed, torch, SamplingParams))
    finally:
        del engine
        _free_device(device)
    return {"lengths": {str(n): out[str(n)] for n in lens}}


def _free_device(device: str) -> None:
    import gc

    import torch

    gc.collect()  # the observed runner holds a cycle; a 7B engine per backend must go before the next
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def _check_lengths(engine, lens: list[int], context: int, seed: int, torch, SamplingParams) -> dict[str, str]:
    seen: list[str] = []
    execute = engine.runner.execute

    def observed(scheduled):  # the real step; only its result is inspected
        logits = execute(scheduled)
        nan, inf = bool(torch.isnan(logits).any()), bool(torch.isinf(logits).any())
        seen.append("NaN" if nan else "Inf" if inf else "ok")
        return logits

    engine.runner.execute = observed  # observe the real step, instance-local
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    out: dict[str, str] = {}
    for n in lens:
        seen.clear()
        prompt = [rng.randrange(3, min(vocab, 259)) for _ in range(n)]
        # a prompt that fills the context has no position left to decode at: its prefill alone is checked
        max_tokens = 2 if n < context else 1
        try:
            engine.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        except (ValueError, RuntimeError) as e:
            out[str(n)] = f"error: {e}"
            continue
        bad = [f"{s} in {'prefill' if i == 0 else 'decode'}" for i, s in enumerate(seen) if s != "ok"]
        out[str(n)] = "ok" if seen and not bad else (", ".join(bad) or "no step ran")
    return out


def run(max_len: int, model: str | None = None, device: str = "cpu", min_k: int = 4) -> dict:
    lens = lengths(max_len, min_k)
    context = model_context(model)
    return {
        "max_seq_len": max_len,
        "context": context,
        "lengths": lens,
        "device": device,
        "backends": {b: check_backend(b, lens, model, device, context=context) for b in CANDIDATES},
    }


def table(result: dict) -> str:
    avail = [b for b, r in result["backends"].items() if "unavailable" not in r]
    lines = ["| prompt length | " + " | ".join(avail) + " |", "|---:|" + "---|" * len(avail)]
    for n in result["lengths"]:
        lines.append(f"| {n} | " + " | ".join(result["backends"][b]["lengths"].get(str(n), "?") for b in avail) + " |")
    for b, r in result["backends"].items():
        if "unavailable" in r:
            lines.append(f"\n{b}: not run here ({r['unavailable'][:160]})")
    return "\n".join(lines)


def failures(result: dict) -> list[str]:
    return [
        f"{b} @ {n}: {v}"
        for b, r in result["backends"].items()
        if "lengths" in r
        for n, v in r["lengths"].items()
        if v != "ok" and not v.startswith(BEYOND)
    ]


def beyond(result: dict) -> list[int]:
    """Lengths not run because they exceed the model's context (not failures)."""
    return sorted(
        {int(n) for r in result["backends"].values() for n, v in r.get("lengths", {}).items() if v.startswith(BEYOND)}
    )


def cli_main(args) -> int:
    from distserve.server.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, {"model": args.model} if args.model else None)
    except ConfigError as e:
        print(f"distserve: error: {e}", file=sys.stderr)
        return 2
    max_len = args.max_len or cfg.prefill.max_seq_len
    if max_len < 2 or args.min_k < 1:
        print("distserve: error: --max-len must be >= 2 and --min-k >= 1", file=sys.stderr)
        return 2
    result = run(max_len, cfg.model, args.device, args.min_k)
    print(table(result))
    bad = failures(result)
    result["failures"] = bad
    if args.json:
        atomic_write(args.json, json.dumps(result, indent=1))
    if not any("lengths" in r for r in result["backends"].values()):
        print("nan-check: no attention backend could run", file=sys.stderr)
        return 1
    skipped = beyond(result)
    ran = len(result["lengths"]) - len(skipped)
    print(
        f"nan-check: {len(bad)} non-finite results"
        + (": " + "; ".join(bad) if bad else f" ({ran} lengths, all finite)")
        + (
            f"; {len(skipped)} lengths beyond the model's context ({result['context']}): {skipped[0]}..{skipped[-1]}"
            if skipped
            else ""
        )
    )
    return 1 if bad else 0
