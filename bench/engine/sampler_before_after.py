"""The sampler alone, before (the per-row sampler of commit 9f26773) and after, on one CPU thread.

    git show 9f26773:server/engine/sampler.py > /tmp/old_sampler.py
    .venv/bin/python bench/sampler_before_after.py [OUT.json]

32 rows of random logits (x3) at vocabularies 512 (the tiny model) and 49152 (SmolLM2); median ms.
"""

import importlib.util
import json
import statistics
import sys
import time

import torch

from distserve.server.engine.sampler import Sampler
from distserve.server.engine.sampling_params import SamplingParams

OLD = "/tmp/old_sampler.py"
torch.set_num_threads(1)
spec = importlib.util.spec_from_file_location("old_sampler", OLD)
if spec is None or spec.loader is None:  # not a path Python can load a module from
    raise SystemExit(f"{OLD}: not a Python file (git show 9f26773:server/engine/sampler.py > {OLD})")
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)

res: dict[str, float] = {}
for V in (512, 49152):
    logits = torch.randn(32, V) * 3
    for name, p in [
        ("greedy", SamplingParams(temperature=0)),
        ("openai_default", SamplingParams()),
        ("server_default", SamplingParams(top_p=0.95)),
        ("topk50_T0.7", SamplingParams(temperature=0.7, top_k=50)),
    ]:
        for impl, s in (("before", old.Sampler()), ("after", Sampler())):
            ts = []
            for _ in range(4 if V > 1000 else 12):
                t0 = time.perf_counter()
                s.sample(logits, [p] * 32, list(range(32)), [3] * 32)
                ts.append((time.perf_counter() - t0) * 1e3)
            res[f"V{V} {name} {impl}"] = round(statistics.median(ts[1:]), 2)
for k, v in res.items():
    print(k, v)
json.dump(res, open(sys.argv[1] if len(sys.argv) > 1 else "/dev/stdout", "w"), indent=1)
