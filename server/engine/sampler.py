"""Token sampling: greedy, temperature, top-k, top-p, per-request seed.

Randomness is a pure function of ``(seed, output index)``: the generator for a
request's n-th token is seeded from both. A request therefore yields the same
tokens whether it runs colocated, prefills on one worker and decodes on another,
is preempted and recomputed, or migrates after a worker dies.
"""

from __future__ import annotations

import torch

from server.engine.sampling_params import SamplingParams

_MASK64 = (1 << 63) - 1


def token_generator(seed: int, index: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 1) & _MASK64)
    return g


def sample_row(logits: torch.Tensor, params: SamplingParams, seed: int, index: int) -> int:
    """Sample one token from a ``[vocab]`` float32 logits row."""
    if params.is_greedy:
        return int(torch.argmax(logits))
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_probs, dim=-1)
        drop = (cum - sorted_probs) >= params.top_p  # the top token is always kept
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    g = token_generator(seed, index, logits.device)
    return int(torch.multinomial(probs, 1, generator=g))


class Sampler:
    def sample(self, logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
               indices: list[int]) -> list[int]:
        """One token per row of ``logits`` ([B, vocab], float32)."""
        if all(p.is_greedy for p in params):
            return torch.argmax(logits, dim=-1).tolist()
        return [sample_row(logits[i], p, s, n) for i, (p, s, n) in enumerate(zip(params, seeds, indices))]
