"""Workloads for the planner: the (prompt tokens, output tokens) of each request.

Specs (``--workload``):
- ``prompt=N,output=M``: distbench's length syntax for each (``N``, ``uniform:LO:HI``, ``lognormal:MEDIAN:SIGMA``),
  as ``distbench run --dataset random --prompt-len N --output-len M`` sends;
- ``sharegpt`` or ``sharegpt:PATH``: distbench's ShareGPT sampling (``--dataset sharegpt``; lengths without a
  tokenizer, as distbench counts them then); ``,output=M`` overrides the output lengths;
- ``result:PATH``: a recorded distbench result file (its requests' prompt/output token counts), or a
  ``bench/serving/gpu_serving.py`` result (``args.long``/``args.short`` give the lengths: ``result:PATH#long``).
Arrivals are Poisson at the rate the search tries; the lengths are drawn once with a seed.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from distserve.distbench.datasets import Lengths


class WorkloadError(ValueError):
    """A workload spec that cannot be used; one sentence."""


def parse_lengths(text: str, name: str) -> Lengths:
    """distbench's length syntax (N, uniform:LO:HI, lognormal:MEDIAN:SIGMA), refused as a WorkloadError."""
    try:
        return Lengths.parse(text, name)
    except ValueError as e:
        raise WorkloadError(str(e)) from None


@dataclass(frozen=True)
class Workload:
    spec: str
    requests: tuple[tuple[int, int], ...]  # (prompt tokens, output tokens)

    @property
    def mean_prompt(self) -> float:
        return sum(p for p, _ in self.requests) / len(self.requests)

    @property
    def mean_output(self) -> float:
        return sum(o for _, o in self.requests) / len(self.requests)

    def distbench_args(self) -> str:
        """The distbench options that send this workload (for the printed plan)."""
        if self.spec.startswith("prompt="):
            kv = dict(part.split("=", 1) for part in self.spec.split(","))
            return f"--dataset random --prompt-len {kv['prompt']} --output-len {kv['output']}"
        if self.spec.startswith("sharegpt"):
            return "--dataset " + self.spec.replace(",output=", " --output-len ")
        return f"(the requests of {self.spec})"


def _from_result(path: str, which: str) -> list[tuple[int, int]]:
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise WorkloadError(f"cannot read result file {p}: {e}") from None
    if isinstance(data.get("requests"), list):  # distbench
        out = [
            (int(r["prompt_tokens"]), int(r["output_tokens"]))
            for r in data["requests"]
            if not r.get("warmup") and r.get("prompt_tokens") and r.get("output_tokens")
        ]
        if out:
            return out
    args = data.get("args", {})
    if which in ("long", "short") and isinstance(args.get(which), str):  # bench/serving/gpu_serving.py
        prompt, output = (int(x) for x in args[which].split(","))
        return [(prompt, output)]
    raise WorkloadError(f"{p} holds no per-request lengths (a distbench result, or a gpu_serving result with #long)")


def load_workload(spec: str, n: int = 400, seed: int = 0) -> Workload:
    """Parse ``spec`` and draw ``n`` requests' lengths (a fixed spec repeats one pair)."""
    rng = random.Random(seed)
    if spec.startswith("prompt="):
        try:
            kv = dict(part.split("=", 1) for part in spec.split(","))
        except ValueError:
            raise WorkloadError(f"workload {spec!r} must look like prompt=N,output=M") from None
        if set(kv) != {"prompt", "output"}:
            raise WorkloadError(f"workload {spec!r} must name exactly prompt= and output=")
        pl, ol = parse_lengths(kv["prompt"], "prompt"), parse_lengths(kv["output"], "output")
        return Workload(spec, tuple((pl.draw(rng), ol.draw(rng)) for _ in range(n)))
    if spec.startswith("sharegpt"):
        head, _, out = spec.partition(",output=")
        path = head.split(":", 1)[1] if ":" in head else None
        try:
            from distserve.distbench.datasets import sharegpt_items
        except ImportError:
            raise WorkloadError("the sharegpt workload needs the distbench package") from None
        try:
            items = sharegpt_items(n, path, None, None, seed=seed)
        except ValueError as e:  # distbench names its own flag; here it is --workload
            raise WorkloadError(str(e).replace("--dataset sharegpt", "--workload sharegpt")) from None
        over = parse_lengths(out, "output") if out else None
        return Workload(spec, tuple((it.prompt_len, over.draw(rng) if over else it.output_len) for it in items))
    if spec.startswith("result:"):
        path, _, which = spec[len("result:") :].partition("#")
        pairs = _from_result(path, which)
        return Workload(spec, tuple(pairs[i % len(pairs)] for i in range(max(n, len(pairs)))))
    raise WorkloadError(f"workload {spec!r} is not prompt=N,output=M, sharegpt[:PATH] or result:PATH")
