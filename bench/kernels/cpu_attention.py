"""CPU decode attention: the SDPA backend's gather + SDPA against the ``cpu_paged`` kernel.

    taskset -c 1 .venv/bin/python -m bench.kernels.cpu_attention [--repeats 9] [--out FILE]

1. Kernel: decode attention of one layer on tiny-model shapes (4 heads, 4 KV heads, head_dim 64,
   float32, block_size 16), batch 1/8/32/64 x context 160/512/1024, shuffled block tables, 1 thread.
   Each timed call walks --layers separate caches, as a decode step does, so a layer's K/V is not
   still in cache from the previous call; the figure is per layer. The two variants run
   interleaved (alternating which goes first) and each figure is the median of --repeats.
2. Engine: decode tokens/s of the built-in tiny model at batch 8/32/64 (bench/engine/engine_cpu.py's
   method: B sequences of --context tokens, --steps decode steps timed), the two backends
   interleaved, median of --engine-repeats.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from distserve.server.engine.attention import cpu_paged
from distserve.server.engine.attention.base import AttentionMetadata
from distserve.server.engine.attention.sdpa import SdpaBackend

if TYPE_CHECKING:  # the engine is imported only where part 2 runs
    from distserve.server.engine.llm_engine import LLMEngine

H, HKV, D, BS = 4, 4, 64, 16  # the built-in tiny model; the engine's default block size


def _layer_inputs(
    b: int, ctx: int, layers: int, seed: int
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor, torch.Tensor, AttentionMetadata]:
    """The query, ``layers`` KV caches, block tables, sequence lengths and the metadata of one decode step."""
    g = torch.Generator().manual_seed(seed)
    per_seq = -(-ctx // BS)
    nb = b * per_seq + 8
    caches = [torch.randn(2, nb * BS, HKV, D, generator=g) for _ in range(layers)]
    tables = torch.randperm(nb, generator=g)[: b * per_seq].view(b, per_seq).contiguous()
    lens = torch.full((b,), ctx, dtype=torch.long)
    q = torch.randn(b, H, D, generator=g)
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long),
        block_size=BS,
        prefill_query_lens=[],
        prefill_seq_lens=[],
        prefill_block_tables=[],
        decode_seq_lens=lens,
        decode_block_tables=tables,
        decode_max_seq_len=ctx,
    )
    return q, caches, tables, lens, meta


def bench_kernel(batches: list[int], contexts: list[int], layers: int, repeats: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    scale = D**-0.5
    for ctx in contexts:
        for b in batches:
            q, caches, tables, lens, meta = _layer_inputs(b, ctx, layers, seed=b * 10_000 + ctx)
            out = torch.empty_like(q)

            def sdpa() -> None:
                for c in caches:  # noqa: F821
                    SdpaBackend._decode(q, c, meta, scale, False)

            def paged() -> None:
                for c in caches:  # noqa: F821
                    cpu_paged.paged_decode_attention(q, c, tables, lens, scale, BS, out=out)

            err = float(
                (
                    cpu_paged.paged_decode_attention(q, caches[0], tables, lens, scale, BS)
                    - SdpaBackend._decode(q, caches[0], meta, scale, False)
                )
                .abs()
                .max()
            )
            times: dict[str, list[float]] = {"sdpa": [], "cpu_paged": []}
            sdpa()  # warm-up
            paged()
            for r in range(repeats):
                order = (("sdpa", sdpa), ("cpu_paged", paged))
                for name, fn in order if r % 2 == 0 else order[::-1]:
                    t0 = time.perf_counter()
                    fn()
                    times[name].append((time.perf_counter() - t0) / layers * 1e3)
            s, p = statistics.median(times["sdpa"]), statistics.median(times["cpu_paged"])
            rows.append(
                {
                    "batch": b,
                    "context": ctx,
                    "sdpa_ms": s,
                    "cpu_paged_ms": p,
                    "speedup": s / p,
                    "sdpa_min_max": [min(times["sdpa"]), max(times["sdpa"])],
                    "cpu_paged_min_max": [min(times["cpu_paged"]), max(times["cpu_paged"])],
                    "max_abs_diff": err,
                }
            )
            del caches
    return rows


def _decode_tok_s(engine: LLMEngine, b: int, context: int, steps: int, tag: str) -> float:
    from bench.engine.engine_cpu import decode_tok_s  # bench/engine/engine_cpu.py: the same method, one measurement

    return decode_tok_s(engine, b, context, steps, tag, offset=zlib.crc32(tag.encode()) % 97)


def bench_engine(batches: list[int], context: int, steps: int, repeats: int) -> list[dict[str, Any]]:
    from distserve.server.engine.llm_engine import EngineConfig, LLMEngine

    engines = {
        name: LLMEngine(EngineConfig(attention_backend=name, max_num_seqs=128, max_num_batched_tokens=8192))
        for name in ("sdpa", "cpu_paged")
    }
    rows: list[dict[str, Any]] = []
    for b in batches:
        vals: dict[str, list[float]] = {name: [] for name in engines}
        for name, eng in engines.items():  # warm-up
            _decode_tok_s(eng, b, context, steps, f"w{name}{b}")
        for r in range(repeats):
            names = list(engines) if r % 2 == 0 else list(engines)[::-1]
            for name in names:
                vals[name].append(_decode_tok_s(engines[name], b, context, steps, f"{name}{b}r{r}"))
        s, p = statistics.median(vals["sdpa"]), statistics.median(vals["cpu_paged"])
        rows.append(
            {
                "batch": b,
                "context": context,
                "steps": steps,
                "sdpa_tok_s": s,
                "cpu_paged_tok_s": p,
                "speedup": p / s,
                "sdpa_min_max": [min(vals["sdpa"]), max(vals["sdpa"])],
                "cpu_paged_min_max": [min(vals["cpu_paged"]), max(vals["cpu_paged"])],
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=9, help="kernel repeats per variant")
    ap.add_argument("--layers", type=int, default=4, help="separate layer caches walked per timed call")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--contexts", type=int, nargs="+", default=[160, 512, 1024])
    ap.add_argument("--engine-batches", type=int, nargs="+", default=[8, 32, 64])
    ap.add_argument("--engine-context", type=int, default=160)
    ap.add_argument("--engine-steps", type=int, default=16)
    ap.add_argument("--engine-repeats", type=int, default=5)
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    t0 = time.perf_counter()
    ok = cpu_paged.available()
    load_s = time.perf_counter() - t0
    if not ok:
        sys.exit(f"cpu_paged is not available: {cpu_paged.unavailable_reason()}")
    info = cpu_paged.build_info()
    results: dict[str, Any] = {
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "torch": torch.__version__,
        "threads": args.threads,
        "shapes": {"heads": H, "kv_heads": HKV, "head_dim": D, "block_size": BS, "dtype": "float32"},
        "extension": {"cached": info.get("cached"), "seconds": load_s, "path": info.get("path")},
        "kernel": bench_kernel(args.batches, args.contexts, args.layers, args.repeats),
    }
    print(
        f"cpu_paged extension: {'loaded from cache' if info.get('cached') else 'built'} in {load_s * 1e3:.1f} ms"
        f" ({info.get('path')})"
    )
    print(f"\ndecode attention per layer ({args.threads} thread, median of {args.repeats})")
    print(f"{'batch':>6}{'context':>9}{'sdpa ms':>10}{'paged ms':>10}{'speedup':>9}{'max|diff|':>11}")
    for r in results["kernel"]:
        print(
            f"{r['batch']:>6}{r['context']:>9}{r['sdpa_ms']:>10.3f}{r['cpu_paged_ms']:>10.3f}"
            f"{r['speedup']:>8.2f}x{r['max_abs_diff']:>11.1e}"
        )
    if not args.skip_engine:
        results["engine"] = bench_engine(
            args.engine_batches, args.engine_context, args.engine_steps, args.engine_repeats
        )
        print(
            f"\nengine decode tok/s, tiny model, context {args.engine_context} "
            f"(median of {args.engine_repeats}, min..max)"
        )
        print(f"{'batch':>6}{'sdpa':>10}{'cpu_paged':>11}{'speedup':>9}   {'sdpa range':>15}  {'paged range':>15}")
        for r in results["engine"]:
            print(
                f"{r['batch']:>6}{r['sdpa_tok_s']:>10.0f}{r['cpu_paged_tok_s']:>11.0f}{r['speedup']:>8.2f}x"
                f"   {r['sdpa_min_max'][0]:>7.0f}..{r['sdpa_min_max'][1]:<6.0f}"
                f"  {r['cpu_paged_min_max'][0]:>7.0f}..{r['cpu_paged_min_max'][1]:<6.0f}"
            )
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
