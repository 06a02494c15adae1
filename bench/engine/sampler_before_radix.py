# The sampler as of 2026-12-01 (commit e7864e1), kept verbatim: bench/sampler_cost.py runs it beside the new one.
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

from distserve.server.engine.sampling_params import SamplingParams

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
    """Sample rows of processed ``logits`` (none greedy); returns token ids ``[rows]`` (int64).

    Each row goes one of three ways, chosen by its own parameters and the device only: neither top_k
    nor top_p → vocabulary order; top_p without top_k on a CPU → vocabulary order inside the nucleus
    (``_nucleus_cpu``: a CPU full-vocabulary sort costs more than the model's step); else → in order of
    likelihood (``_ranked_draw``: a full sort, or ``torch.topk`` when every row has a top_k)."""
    dev, vocab = logits.device, logits.shape[-1]
    u = uniforms(
        torch.tensor(seeds, dtype=torch.int64, device=dev), torch.tensor(indices, dtype=torch.int64, device=dev)
    )
    # No shift by the row's max first: every op below is shift-invariant or shifts itself (softmax), and
    # a temperature is >= SAMPLING_EPS here (below it a row is greedy), so logits / T stays finite.
    x = logits
    if any(p.temperature != 1.0 for p in params):
        inv = torch.tensor([1.0 / p.temperature for p in params], dtype=torch.float32, device=dev).unsqueeze(1)
        x = logits * inv
    cpu = dev.type == "cpu"

    def way(p: SamplingParams) -> int:
        has_k = 0 < p.top_k < vocab
        if not has_k and p.top_p >= 1.0:
            return 0
        return 1 if cpu and not has_k else 2

    ways = [way(p) for p in params]
    out = torch.empty(len(params), dtype=torch.int64, device=dev)
    for w in (0, 1, 2):
        idx = [i for i, v in enumerate(ways) if v == w]
        if not idx:
            continue
        rows = torch.tensor(idx, dtype=torch.int64, device=dev) if len(idx) < len(params) else None
        xs, us, ps = (
            (x, u, params)
            if rows is None
            else (x.index_select(0, rows), u.index_select(0, rows), [params[i] for i in idx])
        )
        tok = _ranked_draw(xs, ps, us) if w == 2 else _vocab_draw(xs, ps, us, nucleus=w == 1)
        if rows is None:
            return tok
        out.index_copy_(0, rows, tok)
    return out


def _vocab_draw(x: torch.Tensor, params: list[SamplingParams], u: torch.Tensor, nucleus: bool) -> torch.Tensor:
    """softmax, the top_p nucleus (when asked), min_p, then the draw, all in vocabulary order."""
    dev = x.device
    probs = torch.softmax(x, dim=-1)
    if nucleus:
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
        probs = probs.masked_fill(~_nucleus_cpu(probs, top_p), 0.0)
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev).unsqueeze(1)
        probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    return _inverse_cdf(probs, u)


def _nucleus_cpu(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The top_p nucleus of each row without sorting the vocabulary (bool ``[rows, vocab]``): the same set
    as the sorted rule (keep a token while the mass of the tokens before it is below top_p, ties in
    vocabulary order). A float32 probability's bits order like the value, so a 1024-bin histogram of the
    top 10 bits finds the bin where the mass crosses top_p; only that bin's few tokens are sorted."""
    rows, vocab = probs.shape
    bits = probs.view(torch.int32)  # probabilities are >= 0 and < 2: bit 30 is clear, bits >> 20 < 1024
    bins = (bits >> 20).clamp_(0, 1023)  # (a NaN row's bits are not: it fails anyway, but must not index out)
    offsets = torch.arange(rows, dtype=torch.int32).unsqueeze(1) * 1024
    hist = torch.zeros(rows * 1024, dtype=torch.float32).index_add_(0, (bins + offsets).view(-1), probs.view(-1))
    above = hist.view(rows, 1024).flip(1).cumsum(1).flip(1)  # above[r, j] = mass of row r's bins >= j
    # the boundary bin: the highest whose mass, with every bin above it, reaches top_p
    edge = ((above >= top_p.unsqueeze(1)).sum(1) - 1).clamp(min=0)
    before = torch.where(edge < 1023, above.gather(1, (edge + 1).clamp(max=1023).unsqueeze(1)).squeeze(1), 0.0)
    keep = bins > edge.to(torch.int32).unsqueeze(1)
    r, c = (bins == edge.to(torch.int32).unsqueeze(1)).nonzero(as_tuple=True)
    v = probs[r, c]  # the boundary bin's tokens: few
    # within the boundary bin: by row, then value descending, then vocabulary order (stable sorts)
    o = torch.sort(v, descending=True, stable=True).indices
    o = o[torch.sort(r[o], stable=True).indices]
    r, c, v = r[o], c[o], v[o]
    # One cumulative sum over every row's entries, kept exact so that no row's answer depends on the rows
    # before it: a bin's values share one float32 exponent, so each is its integer significand times the
    # bin's power of two, and integer sums are exact.
    vb = bits[r, c].to(torch.int64)
    expo = vb >> 23
    mant = torch.where(expo > 0, (vb & 0x7FFFFF) | 0x800000, vb & 0x7FFFFF)
    cum = torch.cumsum(mant, 0)
    starts = torch.searchsorted(r, torch.arange(rows))  # each row's first entry (r is sorted)
    base = torch.where(starts > 0, cum[(starts - 1).clamp(min=0)], 0)
    excl = (cum - mant - base[r]).to(torch.float64) * torch.pow(2.0, (expo.clamp(min=1) - 150).to(torch.float64))
    keep[r, c] = (before[r].to(torch.float64) + excl) < top_p[r].to(torch.float64)
    keep[:, 0] |= ~keep.any(dim=1)  # never empty (a row whose mass is all NaN fails anyway)
    return keep


def _ranked_draw(x: torch.Tensor, params: list[SamplingParams], u: torch.Tensor) -> torch.Tensor:
    """Rows with top_k or top_p, in order of likelihood: top_k (renormalised, vLLM), softmax, top_p,
    min_p, draw. ``torch.topk`` when every row has a top_k, else a full stable sort."""
    dev, vocab = x.device, x.shape[-1]
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    n = max(ks) if all(ks) else vocab
    if n < vocab:
        vals, order = torch.topk(x, n, dim=-1)  # sorted, most likely first
    else:
        vals, order = torch.sort(x, dim=-1, descending=True, stable=True)
    kt = torch.tensor([k or n for k in ks], dtype=torch.int64, device=dev).unsqueeze(1)
    vals = vals.masked_fill(torch.arange(n, device=dev).unsqueeze(0) >= kt, float("-inf"))
    probs = torch.softmax(vals, dim=-1)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev).unsqueeze(1)
    drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p  # the mass before this token already reaches top_p
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev).unsqueeze(1)
        drop |= probs < min_p * probs[:, :1]
    drop[:, 0] = False  # the top token always stays
    pos = _inverse_cdf(probs.masked_fill(drop, 0.0), u)
    return order.gather(1, pos.unsqueeze(1)).squeeze(1)


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
    every = n == logits.shape[0]
    row_t = None if every else torch.tensor(rows, dtype=torch.int64, device=dev)
    sub = logits if row_t is None else logits.index_select(0, row_t)

    def column(name: str) -> torch.Tensor:
        return torch.tensor([getattr(params[i], name) for i in rows], dtype=torch.float32, device=dev).unsqueeze(1)

    if any(params[i].repetition_penalty != 1.0 for i in rows):
        r = column("repetition_penalty")
        sub = torch.where(seen, sub * torch.where(sub > 0, 1.0 / r, r), sub)
    if any(params[i].frequency_penalty != 0.0 for i in rows):
        sub = sub - counts * column("frequency_penalty")
    if any(params[i].presence_penalty != 0.0 for i in rows):
        sub = sub - (counts > 0) * column("presence_penalty")
    if row_t is None:
        logits.copy_(sub)
    else:
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
