"""The sampler alone, old vs new, on random logits: interleaved rounds, medians (CPU or GPU).

    .venv/bin/python bench/sampler_alone.py --vocab 512 49152 --batch 32 --threads 1 --out OUT.json

``old`` = the sampler of 2026-12-01 (``bench/engine/sampler_before_radix.py``), ``new`` = today's, eagerly;
``graph`` (``--samplers ... graph``) = today's through ``GraphSampler`` (CUDA graphs on a GPU; on a CPU its
static-buffer function run eagerly). Logits: ``randn * 3`` (peaked rows, as a trained model's are; the
7B preset's random weights give flat ones). Rows with penalties get a 6-token output history each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.engine.sampler_before_radix import Sampler as OldSampler
from bench.engine.sampler_cost import SamplingKw
from distserve.server.engine.graph_sampler import GraphSampler
from distserve.server.engine.sampler import Sampler
from distserve.server.engine.sampling_params import SamplingParams

VARIANTS: dict[str, SamplingKw] = {
    "greedy": dict(temperature=0.0),
    "openai_default": dict(temperature=1.0, top_p=1.0),
    "server_default": dict(temperature=1.0, top_p=0.95),
    "topk50_penalties": dict(
        temperature=0.7, top_k=50, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1
    ),
    "logprobs5": dict(temperature=1.0, top_p=0.95, logprobs=5),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--vocab", type=int, nargs="+", default=[512, 49152])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3, help="timed calls per (sampler, variant) per round")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--samplers", nargs="+", default=["old", "new", "graph"])
    ap.add_argument(
        "--clock",
        default="wall",
        choices=("wall", "cpu"),
        help="cpu: this process's CPU time (a shared, overloaded CPU machine: wall time there is mostly waiting)",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dev, b = torch.device(args.device), args.batch
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    res: dict[str, Any] = {
        "device": args.device,
        "batch": b,
        "threads": torch.get_num_threads(),
        "clock": args.clock,
        "runs": {},
    }
    res["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    params = {n: SamplingParams(**kw) for n, kw in VARIANTS.items()}
    for vocab in args.vocab:
        samplers: dict[str, OldSampler | Sampler] = {}
        factories: dict[str, Callable[[], OldSampler | Sampler]]
        for name in args.samplers:
            factories = {
                "old": OldSampler,
                "new": Sampler,
                "new-sort": lambda: Sampler(impl="sort"),
                "graph": lambda: Sampler(GraphSampler(vocab, [b], dev)),
                "graph-sort": lambda: Sampler(GraphSampler(vocab, [b], dev, impl="sort"), impl="sort"),
            }
            samplers[name] = factories[name]()
        g = torch.Generator().manual_seed(0)
        logits = (torch.randn(b, vocab, generator=g) * 3).to(dev)
        hist = [([1, 2, 3], [5, 9, 9, 17, 3, 40])] * b
        times: dict[tuple[str, str], list[float]] = {(s, v): [] for s in samplers for v in params}
        for rnd in range(args.rounds + 1):  # the first round warms up
            for (sn, vn), ts in times.items():
                p = params[vn]
                for _ in range(args.reps):
                    if dev.type == "cuda":
                        torch.cuda.synchronize(dev)
                    t0 = clock()
                    samplers[sn].sample(logits, [p] * b, list(range(b)), [3] * b, hist if p.has_penalties else None)
                    if dev.type == "cuda":
                        torch.cuda.synchronize(dev)
                    if rnd:
                        ts.append((clock() - t0) * 1e3)
        run = {
            sn: {vn: {"median_ms": statistics.median(times[(sn, vn)]), "min_ms": min(times[(sn, vn)])} for vn in params}
            for sn in samplers
        }
        res["runs"][str(vocab)] = run
        for sn in samplers:
            print(vocab, sn, "  ".join(f"{vn} {v['median_ms']:.2f}" for vn, v in run[sn].items()), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
