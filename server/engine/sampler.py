"""Token sampling for a whole step in one batched pass on the device of the logits.

Every row of a step is sampled together: the per-request parameters become per-row tensors, and no
row is handled on its own in Python. The order is vLLM's:

1. logits processors: ``logit_bias`` (added to the logit); a structured-output grammar masks the logits
   before the sampler sees them (``StructuredDecoding.mask_logits``, called by the engine);
2. penalties: ``repetition_penalty`` (vLLM/CTRL: the logit of a token in the prompt or the output is
   divided by it when positive, multiplied when negative), then OpenAI's ``frequency_penalty`` (times
   the token's count in the output) and ``presence_penalty`` (once if it is in the output), subtracted;
3. greedy rows (temperature below ``SAMPLING_EPS`` or top_k 1): argmax, bit-identical to before;
4. the other rows: ``/ temperature``, ``top_k`` (the k largest, ties in vocabulary order), softmax,
   ``top_p`` (the smallest set of the most likely tokens whose mass reaches top_p; the top token always
   stays), ``min_p`` (drop tokens below min_p times the top token's probability), then one draw by
   inverse CDF in vocabulary order. top_k and top_p sort nothing: ``radix_filter`` finds the same sets
   as a stable sort would, with exact integer sums.

Randomness is a pure function of ``(seed, output index)``: each row's uniform is a counter-based hash
(splitmix64) of the two, computed in batch on the device. Every op is row-wise and every row takes the
same path whatever the device (``sample_rows``), so a request yields the same tokens whatever it is
batched with: colocated, across the P/D hand-off, after preemption (recompute), after a migration, and
in or out of the sampler's CUDA graph (``graph_sampler``).

``logprobs`` are those of the model's raw logits (``log_softmax`` before any processing, vLLM's
``raw_logprobs``): the sampled token's and the k most likely. The host sees one transfer per step: the
sampled ids, the rows that failed, and the logprobs when a row asked for them. A row that cannot be
sampled (NaN/Inf logits) fails its request only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from itertools import chain

import torch

from distserve.server.engine.radix_filter import (
    FIXED_ONE,
    fixed_point,
    top_k_mask,
    top_k_mask_host,
    top_p_mask,
    top_p_mask_host,
)
from distserve.server.engine.sampling_params import SamplingParams

NON_FINITE = "the model produced NaN/Inf logits for this request"

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


IMPLS = ("radix", "sort", "host")


@dataclass(frozen=True)
class Filters:
    """What a step's rows use (decided on the host from the parameters; static per CUDA graph). A row
    that does not use a filter gets a value that makes it a no-op (top_k = vocabulary, top_p 1, min_p 0).
    ``impl``: how top_k/top_p find their sets — ``radix`` (``radix_filter``: no sort, no host sync, exact
    integer sums; a GPU's default), ``sort`` (a stable full sort per filter, the same integer sums; static
    shapes too), ``host`` (the CPU variants: a host sync costs nothing there). All three give the
    stable-sort sets (``host``'s top_p up to its float64 bin sums, ``sort``'s top_k up to a -0.0/+0.0 tie)."""

    top_k: bool = False
    top_p: bool = False
    min_p: bool = False
    temperature: bool = True  # some row's temperature is not 1
    greedy: bool = True  # some row is greedy
    impl: str = "radix"

    def graphed(self, impl: str = "radix") -> Filters:
        """The graph variant that runs these rows: only top_k/top_p vary between graphs."""
        return Filters(self.top_k, self.top_p, True, impl=impl)


def _sorted_keep(x: torch.Tensor, keep_sorted: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(x, dtype=torch.bool).scatter_(1, order, keep_sorted)


def sample_rows(
    logits: torch.Tensor,
    fparams: torch.Tensor,
    iparams: torch.Tensor,
    filters: Filters = Filters(),
) -> torch.Tensor:
    """Token ids ``[rows]`` (int64) of processed ``logits``, every row in one pass (with ``impl`` radix or
    sort: static shapes and no host sync, the body of the sampler's CUDA graphs; the eager sampler runs the
    same function, so both give the same ids).

    ``fparams`` ``[rows, 4]`` float32: 1 / temperature (1 for a greedy row), top_p, min_p, greedy (1.0/0.0);
    ``iparams`` ``[rows, 3]`` int64: seed, output index, top_k (the vocabulary size when off).
    Greedy rows: argmax. The others: / temperature, top_k (renormalised), softmax, top_p, min_p, then one
    inverse-CDF draw in vocabulary order with the row's uniform of (seed, index). top_k and top_p are the
    sorted rules (ties in vocabulary order)."""
    x = logits * fparams[:, 0:1] if filters.temperature else logits
    impl = filters.impl
    if filters.top_k:
        if impl == "sort":
            order = torch.sort(x, dim=-1, descending=True, stable=True).indices
            pos = torch.arange(x.shape[-1], device=x.device).unsqueeze(0)
            keep = _sorted_keep(x, pos < iparams[:, 2:3], order)
        else:
            keep = (top_k_mask if impl == "radix" else top_k_mask_host)(x, iparams[:, 2])
        x = x.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if filters.top_p:
        top_p = fparams[:, 1]
        if impl == "sort":  # by probability, with radix_filter's fixed-point sums: the radix select's sets
            ps, order = torch.sort(probs, dim=-1, descending=True, stable=True)
            w = fixed_point(ps)
            before = torch.cumsum(w, dim=-1) - w
            target = (top_p.to(torch.float64) * FIXED_ONE).to(torch.int64).clamp_(min=1)
            ks = (before < target.unsqueeze(1)) | (top_p >= 1.0).unsqueeze(1)
            keep = _sorted_keep(x, ks, order)
        else:
            keep = (top_p_mask if impl == "radix" else top_p_mask_host)(probs, top_p)
        probs = probs.masked_fill(~keep, 0.0)
    if filters.min_p:
        probs = probs.masked_fill(probs < fparams[:, 2:3] * probs.amax(dim=-1, keepdim=True), 0.0)
    drawn = _inverse_cdf(probs, uniforms(iparams[:, 0], iparams[:, 1]))
    return torch.where(fparams[:, 3] > 0.5, torch.argmax(logits, dim=-1), drawn) if filters.greedy else drawn


def row_params(
    params: list[SamplingParams], seeds: list[int], indices: list[int], vocab: int
) -> tuple[list[list[float]], list[list[int]], Filters]:
    """The host side of ``sample_rows``: its two parameter tables as lists, and the filters in use."""
    fl: list[list[float]] = []
    il: list[list[int]] = []
    use_k = use_p = use_min = use_t = use_g = False
    for p, seed, index in zip(params, seeds, indices):
        if p.is_greedy:
            use_g = True
            fl.append([1.0, 1.0, 0.0, 1.0])
            il.append([seed, index, vocab])
            continue
        k = p.top_k if 0 < p.top_k < vocab else vocab
        use_k |= k < vocab
        use_p |= p.top_p < 1.0
        use_min |= p.min_p > 0.0
        use_t |= p.temperature != 1.0
        fl.append([1.0 / p.temperature, p.top_p, p.min_p, 0.0])
        il.append([seed, index, k])
    return fl, il, Filters(use_k, use_p, use_min, use_t, use_g)


class PenaltyState:
    """A sequence's token counts for the penalties, kept on the device between steps (``Sequence.
    sampler_state``): ``counts`` of each output token, ``seen`` = in the prompt or the output, after the
    first ``n`` outputs. Built from the ids the first time, so a request resumed elsewhere (hand-off,
    migration) with its outputs gets the same counts; then only each step's new tokens are added."""

    __slots__ = ("counts", "seen", "n")

    def __init__(self, counts: torch.Tensor, seen: torch.Tensor, n: int) -> None:
        self.counts, self.seen, self.n = counts, seen, n


def _to_device(data: list, dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
    """A host list on ``dev`` without a device sync: on a GPU through pinned memory and a non-blocking copy
    (torch's pinned-memory cache keeps the buffer until the copy is done); a plain tensor on a CPU."""
    t = torch.tensor(data, dtype=dtype)
    return t.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else t


def _flat(rows: list[int], lists: list[Sequence[int]], dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) of every id in ``lists`` (list j belongs to ``rows[j]``), two int64 tensors
    from one host-to-device copy."""
    flat = _to_device([[r for r, x in zip(rows, lists) for _ in x], list(chain.from_iterable(lists))], torch.int64, dev)
    return flat[0], flat[1]


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
    row_t = None if every else _to_device(rows, torch.int64, dev)
    sub = logits if row_t is None else logits.index_select(0, row_t)
    ps = [params[i] for i in rows]
    # the three penalties of every row in one copy: [3, n, 1]
    cols = _to_device(
        [[[p.repetition_penalty] for p in ps], [[p.frequency_penalty] for p in ps], [[p.presence_penalty] for p in ps]],
        torch.float32,
        dev,
    )
    if any(p.repetition_penalty != 1.0 for p in ps):
        r = cols[0]
        sub = torch.where(seen, sub * torch.where(sub > 0, 1.0 / r, r), sub)
    if any(p.frequency_penalty != 0.0 for p in ps):
        sub = sub - counts * cols[1]
    if any(p.presence_penalty != 0.0 for p in ps):
        sub = sub - (counts > 0) * cols[2]
    if row_t is None:
        logits.copy_(sub)
    else:
        logits.index_copy_(0, row_t, sub)


def _apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams], rows: list[int]) -> None:
    dev = logits.device
    r = [i for i in rows for _ in params[i].logit_bias]
    toks = [t for i in rows for t, _ in params[i].logit_bias]
    vals = [b for i in rows for _, b in params[i].logit_bias]
    idx = _to_device([r, toks], torch.int64, dev)
    logits.index_put_((idx[0], idx[1]), _to_device(vals, torch.float32, dev), accumulate=True)


def _finish(
    codes: torch.Tensor, raw: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]
) -> SamplerOutput:
    """One device -> host transfer of the step's result: per row the token id or a failure code (-2: non-finite
    logits), and when any row asked for logprobs, those of the raw logits for every row in the same tensor
    (``logsumexp`` once, ``topk`` once, no full ``log_softmax`` written out; ids travel as float32, exact
    below 2**24)."""
    n = len(params)
    want = [p.logprobs for p in params]
    if all(w is None for w in want):
        ids: list[int] = codes.tolist()
        return SamplerOutput([NON_FINITE if t < 0 else t for t in ids], [None] * n)
    k = max(w or 0 for w in want)
    lse = torch.logsumexp(raw, dim=-1, keepdim=True)
    cols = [codes.to(torch.float32).unsqueeze(1), raw.gather(1, tokens.clamp(min=0).unsqueeze(1)) - lse]
    if k:
        top = torch.topk(raw, k, dim=-1)  # sorted, most likely first
        cols += [top.values - lse, top.indices.to(torch.float32)]
    packed = torch.cat(cols, dim=1).tolist()
    out: list[int | str] = []
    lps: list[TokenLogprobs | None] = []
    for row, w in zip(packed, want):
        t = int(row[0])
        out.append(NON_FINITE if t < 0 else t)
        if w is None or t < 0:
            lps.append(None)
        else:
            lps.append((row[1], [(int(row[2 + k + j]), row[2 + j]) for j in range(w)]))
    return SamplerOutput(out, lps)


class Sampler:
    """Samples every row of a step in one batched pass; a row that cannot be sampled fails that row only.

    ``sample`` returns a ``SamplerOutput``: one entry per row, the token id or a ``str`` saying why that
    request's row could not be sampled (non-finite logits, or the sampling ops failing). The engine fails
    exactly those requests; the rest of the batch goes on (DESIGN: one request never fails another).

    With ``graphs`` (a ``graph_sampler.GraphSampler``, on a GPU) the draw runs as a replay of a CUDA graph of
    ``sample_rows`` whenever the step's rows fit one; logit_bias and penalties are applied to the graph's
    input buffer first, eagerly. The graph and the eager pass run the same function: the same ids (give
    both the same ``impl``).
    """

    def __init__(self, graphs=None, impl: str = "radix") -> None:
        if impl not in IMPLS[:2]:
            raise ValueError(f"impl must be radix or sort, got {impl!r}")
        self.graphs = graphs
        self.impl = impl  # top_k/top_p on a GPU (a CPU always uses the host variants)
        self.num_graphed = 0  # steps sampled by a graph replay

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        seeds: list[int],
        indices: list[int],
        histories: Sequence | None = None,
    ) -> SamplerOutput:
        """``logits``: [rows, vocab] float32; ``histories``: per row a (prompt ids, output ids) pair or a
        ``Sequence`` (which then keeps its penalty counts between steps), read for rows with penalties."""
        # A row sum is non-finite iff the row holds a NaN or an Inf: one reduction, no extra sync
        # (it travels with the tokens in the same .tolist()).
        finite = torch.isfinite(logits.sum(dim=-1))
        n = len(params)
        biased = [i for i, p in enumerate(params) if p.logit_bias]
        penalized = [i for i, p in enumerate(params) if p.has_penalties]
        want_lp = any(p.logprobs is not None for p in params)
        if all(p.is_greedy for p in params) and not biased and not penalized and not want_lp:
            ids: list[int] = torch.where(finite, torch.argmax(logits, dim=-1), -2).tolist()
            return SamplerOutput([NON_FINITE if t < 0 else t for t in ids], [None] * n)
        if penalized and histories is None:
            return SamplerOutput(["sampling failed for this request: penalties need the rows' token histories"] * n)
        try:
            return self._sample(logits, params, seeds, indices, histories, finite, biased, penalized)
        except (RuntimeError, OverflowError) as e:  # e.g. an op failing on this batch: fail the rows, never the process
            return SamplerOutput([f"sampling failed for this request: {e}"] * n, [None] * n)

    def _sample(self, logits, params, seeds, indices, histories, finite, biased, penalized) -> SamplerOutput:
        n, dev, vocab = len(params), logits.device, logits.shape[-1]
        fl, il, filters = row_params(params, seeds, indices, vocab)
        graphs = self.graphs
        if graphs is not None and graphs.fits(n, vocab, dev):
            x = graphs.load(logits)  # the graph's static input rows: a copy, so ``logits`` stays raw
            self._process(x, params, histories, biased, penalized)
            tokens = graphs.replay(n, fl, il, filters)
            self.num_graphed += 1
        else:
            x = logits
            if biased or penalized:
                x = logits.clone()
                self._process(x, params, histories, biased, penalized)
            if all(p.is_greedy for p in params):
                tokens = torch.argmax(x, dim=-1)
            else:
                fp = _to_device(fl, torch.float32, dev)
                ip = _to_device(il, torch.int64, dev)
                tokens = sample_rows(x, fp, ip, replace(filters, impl="host" if dev.type == "cpu" else self.impl))
        return _finish(torch.where(finite, tokens, -2), logits, tokens, params)

    @staticmethod
    def _process(x, params, histories, biased, penalized) -> None:
        """In place on ``x``: logit_bias, then the penalties (vLLM's order)."""
        if biased:
            _apply_logit_bias(x, params, biased)
        if penalized:
            _apply_penalties(x, params, penalized, histories)
