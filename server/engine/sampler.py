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

NON_FINITE = "the model produced NaN/Inf logits for this request"


def token_generator(seed: int, index: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 1) & _MASK64)
    return g


def sample_row(logits: torch.Tensor, params: SamplingParams, seed: int, index: int) -> int:
    """Sample one token from a ``[vocab]`` float32 logits row."""
    if params.is_greedy:
        return int(torch.argmax(logits))
    # Shift so the largest logit is 0 before dividing: with a tiny temperature, logits / t alone
    # overflows float32 to inf and softmax turns inf - inf into NaN.
    logits = (logits - logits.max()) / params.temperature
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
    """Samples each row on its own terms: a row that cannot be sampled fails that row only.

    ``sample`` returns one entry per row: the token id, or a ``str`` saying why that request's row
    could not be sampled (non-finite logits, or the sampling op itself failing). The engine fails
    exactly those requests; the rest of the batch goes on (DESIGN: one request never fails another).
    """

    def sample(
        self, logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], indices: list[int]
    ) -> list[int | str]:
        """One token (or a failure reason) per row of ``logits`` ([B, vocab], float32)."""
        # A row sum is non-finite iff the row holds a NaN or an Inf: one reduction, no extra sync
        # (it travels with the tokens in the same .tolist()).
        finite = torch.isfinite(logits.sum(dim=-1))
        if all(p.is_greedy for p in params):
            greedy: list[int] = torch.where(finite, torch.argmax(logits, dim=-1), -1).tolist()
            return [NON_FINITE if t < 0 else t for t in greedy]
        ok = finite.tolist()
        out: list[int | str] = []
        for i, (p, s, n) in enumerate(zip(params, seeds, indices)):
            if not ok[i]:
                out.append(NON_FINITE)
                continue
            try:
                out.append(sample_row(logits[i], p, s, n))
            except RuntimeError as e:  # e.g. multinomial on a degenerate distribution
                out.append(f"sampling failed for this request: {e}")
        return out
