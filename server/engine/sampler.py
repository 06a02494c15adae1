"""Token sampling for a whole step in one batched pass on the device of the logits.

Every row of a step is sampled together: the per-request parameters become per-row tensors, and no
row is handled on its own in Python. The order is vLLM's:

1. logits processors: ``logit_bias`` (added to the logit) and the optional allowed-token mask
   (``allowed``: a ``[rows, vocab]`` bool tensor, True = allowed; the seam structured outputs plug a
   grammar into: ``LLMEngine.logits_mask_fn``);
2. penalties: ``repetition_penalty`` (vLLM/CTRL: the logit of a token in the prompt or the output is
   divided by it when positive, multiplied when negative), then OpenAI's ``frequency_penalty`` (times
   the token's count in the output) and ``presence_penalty`` (once if it is in the output), subtracted;
3. greedy rows (temperature below ``SAMPLING_EPS`` or top_k 1): argmax, bit-identical to before;
4. the other rows: ``/ temperature``, ``top_k``, softmax, ``top_p`` (the smallest set of the most likely
   tokens whose mass reaches top_p; the top token always stays), ``min_p`` (drop tokens below min_p
   times the top token's probability), then one draw by inverse CDF.

Randomness is a pure function of ``(seed, output index)``: each row's uniform is a counter-based hash
(splitmix64) of the two, computed in batch on the device. Which path a row takes (the vocabulary order,
or the sorted order when it has top_k or top_p) depends on its own parameters only, and every op is
row-wise, so a request yields the same tokens whatever it is batched with: colocated, across the P/D
hand-off, after preemption (recompute) and after a migration.

``logprobs`` are those of the model's raw logits (``log_softmax`` before any processing, vLLM's
``raw_logprobs``): the sampled token's and the k most likely. The host sees one transfer of the
sampled ids (with the rows that failed) and, when a row asks for logprobs, one of the logprobs.
A row that cannot be sampled (NaN/Inf logits, or a mask that allows nothing) fails its request only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain

import torch

from server.engine.sampling_params import SamplingParams

NON_FINITE = "the model produced NaN/Inf logits for this request"
NOTHING_ALLOWED = "no token is allowed for this request at this step (the allowed-token mask is empty)"

# A token's logprob and the k most likely (token id, logprob), most likely first.
TokenLogprobs = tuple[float, list[tuple[int, float]]]


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_K_SEED, _K_INDEX = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9)
_MIX1, _MIX2 = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _srl(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def uniforms(seeds: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """One uniform in (0, 1] per row, a pure function of (seed, index): splitmix64 in int64 arithmetic
    (multiplication wraps modulo 2**64), float32 from the top 24 bits."""
    z = seeds * _K_SEED + indices * _K_INDEX + 1
    z = (z ^ _srl(z, 30)) * _MIX1
    z = (z ^ _srl(z, 27)) * _MIX2
    z = z ^ _srl(z, 31)
    return (_srl(z, 40) + 1).to(torch.float32) * (2.0**-24)


def uniform_reference(seed: int, index: int) -> float:
    """``uniforms`` for one (seed, index) in plain Python (tests pin the tensor version to it)."""
    m = (1 << 64) - 1
    z = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 1) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    z ^= z >> 31
    return ((z >> 40) + 1) * 2.0**-24


@dataclass
class SamplerOutput:
    """Per row: the token id, or a ``str`` saying why that request's row could not be sampled; and its
    logprobs when the request asked for them (else None)."""

    tokens: list[int | str]
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index of the first position whose cumulative mass reaches ``u`` x the row's total: with u in
    (0, 1] that position has a positive probability, so a masked (zero) token is never drawn."""
    cum = torch.cumsum(probs, dim=-1)
    target = (u * cum[:, -1]).unsqueeze(1)
    return torch.searchsorted(cum, target).squeeze(1).clamp_(max=probs.shape[-1] - 1)


def _draw(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], indices: list[int]) -> torch.Tensor:
    """Sample rows of processed ``logits`` (none greedy); returns token ids ``[rows]`` (int64)."""
    dev, vocab = logits.device, logits.shape[-1]
    temp = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev).unsqueeze(1)
    u = uniforms(
        torch.tensor(seeds, dtype=torch.int64, device=dev), torch.tensor(indices, dtype=torch.int64, device=dev)
    )
    # Shift so the largest logit is 0 before dividing: with a tiny temperature, logits / t alone
    # overflows float32 to inf and softmax turns inf - inf into NaN.
    x = (logits - logits.amax(dim=-1, keepdim=True)) / temp
    sorts = [0 < p.top_k < vocab or p.top_p < 1.0 for p in params]
    out = torch.empty(len(params), dtype=torch.int64, device=dev)
    plain = [i for i, s in enumerate(sorts) if not s]
    if plain:  # vocabulary order: softmax, min_p, draw
        rows = torch.tensor(plain, dtype=torch.int64, device=dev) if len(plain) < len(params) else None
        xp = x if rows is None else x.index_select(0, rows)
        probs = torch.softmax(xp, dim=-1)
        if any(params[i].min_p > 0.0 for i in plain):
            min_p = torch.tensor([params[i].min_p for i in plain], dtype=torch.float32, device=dev).unsqueeze(1)
            probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
        tok = _inverse_cdf(probs, u if rows is None else u.index_select(0, rows))
        if rows is None:
            return tok
        out.index_copy_(0, rows, tok)
    ranked = [i for i, s in enumerate(sorts) if s]
    if ranked:  # sorted order: top_k, softmax, top_p, min_p, draw
        rows = torch.tensor(ranked, dtype=torch.int64, device=dev) if len(ranked) < len(params) else None
        tok = _ranked_draw(
            x if rows is None else x.index_select(0, rows),
            [params[i] for i in ranked],
            u if rows is None else u.index_select(0, rows),
            CPU_CANDIDATES if dev.type == "cpu" else None,
        )
        if rows is None:
            return tok
        out.index_copy_(0, rows, tok)
    return out


# On a CPU a full-vocabulary sort is the one costly op of a step (32 x 49152 floats: ~0.2-0.5 s on a
# busy 2-vCPU VM); the most likely CPU_CANDIDATES (torch.topk) hold the top-p nucleus of almost every
# real row, and a row whose candidates do not reach its top_p is sorted in full. A GPU sorts in full.
CPU_CANDIDATES = 256


def _ranked_draw(
    x: torch.Tensor, params: list[SamplingParams], u: torch.Tensor, candidates: int | None
) -> torch.Tensor:
    """Rows with top_k or top_p, in order of likelihood. A row's probabilities are those of its own
    top_k tokens (renormalised, vLLM), else of the whole vocabulary (the log-normaliser over all of
    ``x`` whichever way the row is ranked, so the candidates path and the full sort draw alike)."""
    dev, vocab = x.device, x.shape[-1]
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    need = max(ks) if all(ks) else max(max(ks), candidates or vocab)
    n = min(vocab, need)
    if n < vocab:
        vals, order = torch.topk(x, n, dim=-1)  # sorted, most likely first
    else:
        vals, order = torch.sort(x, dim=-1, descending=True, stable=True)
    has_k = torch.tensor([k > 0 for k in ks], device=dev)
    kt = torch.tensor([k or n for k in ks], dtype=torch.int64, device=dev).unsqueeze(1)
    vals = vals.masked_fill(torch.arange(n, device=dev).unsqueeze(0) >= kt, float("-inf"))
    lse = torch.where(has_k, torch.logsumexp(vals, dim=-1), torch.logsumexp(x, dim=-1)).unsqueeze(1)
    probs = torch.exp(vals - lse)
    cum = torch.cumsum(probs, dim=-1)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev).unsqueeze(1)
    drop = (cum - probs) >= top_p  # the mass before this token already reaches top_p
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev).unsqueeze(1)
        drop |= probs < min_p * probs[:, :1]
    drop[:, 0] = False  # the top token always stays
    pos = _inverse_cdf(probs.masked_fill(drop, 0.0), u)
    tok = order.gather(1, pos.unsqueeze(1)).squeeze(1)
    if n < vocab:  # rows whose nucleus reaches past the candidates: ranked in full
        short = (~has_k & (cum[:, -1] < top_p.squeeze(1))).nonzero().squeeze(1).tolist()  # CPU: no device sync
        if short:
            rows = torch.tensor(short, dtype=torch.int64, device=dev)
            full = _ranked_draw(x.index_select(0, rows), [params[i] for i in short], u.index_select(0, rows), None)
            tok.index_copy_(0, rows, full)
    return tok


class PenaltyState:
    """A sequence's token counts for the penalties, kept on the device between steps (``Sequence.
    sampler_state``): ``counts`` of each output token, ``seen`` = in the prompt or the output, after the
    first ``n`` outputs. Built from the ids the first time, so a request resumed elsewhere (hand-off,
    migration) with its outputs gets the same counts; then only each step's new tokens are added."""

    __slots__ = ("counts", "seen", "n")

    def __init__(self, counts: torch.Tensor, seen: torch.Tensor, n: int) -> None:
        self.counts, self.seen, self.n = counts, seen, n


def _flat(rows: list[int], lists: list[Sequence[int]], dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) of every id in ``lists`` (list j belongs to ``rows[j]``), two int64 tensors."""
    ids = torch.tensor(list(chain.from_iterable(lists)), dtype=torch.int64, device=dev)
    lens = torch.tensor([len(x) for x in lists], dtype=torch.int64, device=dev)
    return torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64, device=dev), lens), ids


def _apply_penalties(logits: torch.Tensor, params: list[SamplingParams], rows: list[int], histories) -> None:
    """In place, on ``rows`` of ``logits``: repetition penalty over prompt + output tokens, then
    frequency and presence penalties over output tokens. ``histories[i]``: a ``(prompt ids, output
    ids)`` pair, or an object with ``prompt_token_ids``, ``output_token_ids`` and ``sampler_state``
    (a ``Sequence``: its counts are kept there and only the new tokens are added each step)."""
    dev, vocab, n = logits.device, logits.shape[-1], len(rows)
    hs = [histories[i] for i in rows]
    pairs = [(h[0], h[1]) if isinstance(h, tuple) else (h.prompt_token_ids, h.output_token_ids) for h in hs]
    states = [None if isinstance(h, tuple) else h.sampler_state for h in hs]
    if all(st is None for st in states):  # one allocation instead of a stack of empty rows
        counts = torch.zeros(n, vocab, dtype=torch.float32, device=dev)
        seen = torch.zeros(n, vocab, dtype=torch.bool, device=dev)
    else:
        zc = torch.zeros(vocab, dtype=torch.float32, device=dev)
        zs = torch.zeros(vocab, dtype=torch.bool, device=dev)
        counts = torch.stack([zc if st is None else st.counts for st in states])
        seen = torch.stack([zs if st is None else st.seen for st in states])
    fresh = [j for j, st in enumerate(states) if st is None]
    if fresh:  # the prompt is seen once, when a sequence's state is built
        pr, pi = _flat(fresh, [pairs[j][0] for j in fresh], dev)
        seen[pr, pi] = True
    new = [pairs[j][1][0 if st is None else st.n :] for j, st in enumerate(states)]
    if any(new):
        orow, oid = _flat(list(range(n)), new, dev)
        counts.index_put_((orow, oid), torch.ones_like(oid, dtype=torch.float32), accumulate=True)
        seen[orow, oid] = True
    for j, h in enumerate(hs):
        if not isinstance(h, tuple):
            h.sampler_state = PenaltyState(counts[j], seen[j], len(pairs[j][1]))
    row_t = torch.tensor(rows, dtype=torch.int64, device=dev)
    sub = logits.index_select(0, row_t)
    rep = [params[i].repetition_penalty for i in rows]
    if any(r != 1.0 for r in rep):
        r = torch.tensor(rep, dtype=torch.float32, device=dev).unsqueeze(1)
        sub = torch.where(seen, torch.where(sub > 0, sub / r, sub * r), sub)
    freq = torch.tensor([params[i].frequency_penalty for i in rows], dtype=torch.float32, device=dev).unsqueeze(1)
    pres = torch.tensor([params[i].presence_penalty for i in rows], dtype=torch.float32, device=dev).unsqueeze(1)
    sub = sub - counts * freq - (counts > 0).to(torch.float32) * pres
    logits.index_copy_(0, row_t, sub)


def _apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams], rows: list[int]) -> None:
    dev = logits.device
    r = [i for i in rows for _ in params[i].logit_bias]
    toks = [t for i in rows for t, _ in params[i].logit_bias]
    vals = [b for i in rows for _, b in params[i].logit_bias]
    logits.index_put_(
        (torch.tensor(r, dtype=torch.int64, device=dev), torch.tensor(toks, dtype=torch.int64, device=dev)),
        torch.tensor(vals, dtype=torch.float32, device=dev),
        accumulate=True,
    )


def _logprobs(raw: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]) -> list[TokenLogprobs | None]:
    """Logprobs of the raw logits for the rows that asked: one device → host transfer for them all."""
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    dev = raw.device
    rows = torch.tensor(want, dtype=torch.int64, device=dev) if len(want) < len(params) else None
    lp = torch.log_softmax(raw if rows is None else raw.index_select(0, rows), dim=-1)
    tok = tokens if rows is None else tokens.index_select(0, rows)
    chosen = lp.gather(1, tok.clamp(min=0).unsqueeze(1))
    k = max(params[i].logprobs or 0 for i in want)
    if k:
        top = torch.topk(lp, k, dim=-1)  # sorted, most likely first
        # ids as float32 (exact below 2**24) so values and ids travel in one transfer
        packed = torch.cat([chosen, top.values, top.indices.to(torch.float32)], dim=1).tolist()
    else:
        packed = chosen.tolist()
    result: list[TokenLogprobs | None] = [None] * len(params)
    for row, i in zip(packed, want):
        n = params[i].logprobs or 0
        result[i] = (row[0], [(int(row[1 + k + j]), row[1 + j]) for j in range(n)])
    return result


class Sampler:
    """Samples every row of a step in one batched pass; a row that cannot be sampled fails that row only.

    ``sample`` returns a ``SamplerOutput``: one entry per row, the token id or a ``str`` saying why that
    request's row could not be sampled (non-finite logits, an empty allowed-token mask, or the sampling
    ops failing). The engine fails exactly those requests; the rest of the batch goes on (DESIGN: one
    request never fails another).
    """

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        seeds: list[int],
        indices: list[int],
        histories: Sequence | None = None,
        allowed: torch.Tensor | None = None,
    ) -> SamplerOutput:
        """``logits``: [rows, vocab] float32; ``histories``: per row a (prompt ids, output ids) pair or a
        ``Sequence`` (which then keeps its penalty counts between steps), read for rows with penalties;
        ``allowed``: optional [rows, vocab] bool mask (True = may be sampled)."""
        # A row sum is non-finite iff the row holds a NaN or an Inf: one reduction, no extra sync
        # (it travels with the tokens in the same .tolist()).
        finite = torch.isfinite(logits.sum(dim=-1))
        n = len(params)
        biased = [i for i, p in enumerate(params) if p.logit_bias]
        penalized = [i for i, p in enumerate(params) if p.has_penalties]
        greedy = [p.is_greedy for p in params]
        want_lp = any(p.logprobs is not None for p in params)
        if all(greedy) and not biased and not penalized and allowed is None and not want_lp:
            ids: list[int] = torch.where(finite, torch.argmax(logits, dim=-1), -1).tolist()
            return SamplerOutput([NON_FINITE if t < 0 else t for t in ids], [None] * n)
        try:
            return self._sample(logits, params, seeds, indices, histories, allowed, finite, biased, penalized, greedy)
        except RuntimeError as e:  # e.g. an op failing on this batch: fail the rows, never the process
            return SamplerOutput([f"sampling failed for this request: {e}"] * n, [None] * n)

    def _sample(self, logits, params, seeds, indices, histories, allowed, finite, biased, penalized, greedy):
        n, dev = len(params), logits.device
        raw = logits
        ok = finite
        if biased or penalized or allowed is not None:
            logits = logits.clone()
            if biased:
                _apply_logit_bias(logits, params, biased)
            if allowed is not None:
                logits = logits.masked_fill(~allowed, float("-inf"))
                ok = ok & allowed.any(dim=-1)
            if penalized:
                if histories is None:
                    raise RuntimeError("penalties need the rows' token histories")
                _apply_penalties(logits, params, penalized, histories)
        if all(greedy):
            tokens = torch.argmax(logits, dim=-1)
        else:
            tokens = torch.argmax(logits, dim=-1) if any(greedy) else torch.empty(n, dtype=torch.int64, device=dev)
            drawn = [i for i, g in enumerate(greedy) if not g]
            rows = torch.tensor(drawn, dtype=torch.int64, device=dev) if len(drawn) < n else None
            sub = logits if rows is None else logits.index_select(0, rows)
            got = _draw(sub, [params[i] for i in drawn], [seeds[i] for i in drawn], [indices[i] for i in drawn])
            tokens = got if rows is None else tokens.index_copy(0, rows, got)
        ids = torch.where(ok, tokens, -1).tolist()
        lps = _logprobs(raw, tokens, params) if any(p.logprobs is not None for p in params) else [None] * n
        failed = finite.tolist() if -1 in ids else None
        out: list[int | str] = []
        for i, t in enumerate(ids):
            out.append(t if t >= 0 else (NON_FINITE if failed is not None and not failed[i] else NOTHING_ALLOWED))
        return SamplerOutput(out, [lp if isinstance(out[i], int) else None for i, lp in enumerate(lps)])
