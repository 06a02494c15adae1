"""The sorted-order filters of sampling (top_k, top_p) without sorting: a radix select over float bits.

The rule both filters share, on one row: order the tokens by a key, best first, ties in vocabulary
order (a stable descending sort); keep a token while the weight of the tokens before it is below a
target. ``top_k``: key = the logit, weight 1, target k. ``top_p``: key = the probability, weight = the
probability, target top_p (the smallest set whose mass reaches top_p; the top token always stays).

``keep_before`` finds that set with no sort and no host sync: a float32's bits, made unsigned and
flipped, order like the value from best to worst, so three histogram passes (11, 11 and 10 bits) find
the one key value where the weight crosses the target (a radix select). Tokens with a better key are
kept; tokens tied on that exact key are kept in vocabulary order while the weight before them stays
below the target (an exclusive cumulative count of the ties). Weights are int64 (fixed point for
probabilities, ``2**-47`` units: exact for every float32 probability above ``2**-24``), so every sum is
exact and independent of summation order: the set is the same on any device, in any batch, and in or
out of a CUDA graph. Every shape is static, so the whole filter can be captured in a graph.
"""

from __future__ import annotations

import torch

FIXED_ONE = 1 << 47  # fixed-point unit of probability weights (sums of a 2**16-token row stay < 2**63)
_PASSES = ((21, 11), (10, 11), (0, 10))  # (shift, bits) of the 32-bit key, most significant first
_INT_MIN = -(1 << 31)


def descending_key(x: torch.Tensor) -> torch.Tensor:
    """int32 per float32 element whose order as a signed integer is the values' order reversed (smaller =
    larger value; -0.0 ranks just after +0.0, NaNs at either end: a row holding a NaN fails anyway).
    ``key ^ -2**31`` read as unsigned has the same order: its bits are the radix digits."""
    bits = x.contiguous().view(torch.int32)
    return ~torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def keep_before(key: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Bool ``[rows, vocab]``: the tokens of each row whose preceding weight (in ``key`` order, ties by
    vocabulary index) is below ``target[row]``. ``key``: int32 (``descending_key``); ``weight``: int32 or
    int64 >= 0; ``target``: int64 ``[rows]``."""
    rows, vocab = key.shape
    dev = key.device
    target = target.clamp(min=1)  # the best token always stays
    u = key ^ _INT_MIN  # the same order, unsigned: digits by shift and mask
    above = torch.zeros(rows, dtype=torch.int64, device=dev)  # weight of tokens with a better key
    prefix = torch.zeros(rows, dtype=torch.int64, device=dev)  # the boundary key's bits found so far
    flat_w = weight.reshape(-1)
    for n, (shift, bits) in enumerate(_PASSES):
        nb = 1 << bits
        offsets = torch.arange(rows, dtype=torch.int32, device=dev).unsqueeze(1) * nb
        index = ((u >> shift) & (nb - 1)) + offsets
        if n:  # only the tokens whose higher digits are the boundary's
            high = (u >> (shift + bits)) & ((1 << (32 - shift - bits)) - 1)
            w = torch.where(high == prefix.to(torch.int32).unsqueeze(1), weight, 0).reshape(-1)
        else:
            w = flat_w
        hist = torch.zeros(rows * nb, dtype=weight.dtype, device=dev).index_add_(0, index.view(-1), w).view(rows, nb)
        cum = hist.cumsum(1)  # inclusive, best digit first (int64)
        d = (cum < (target - above).unsqueeze(1)).sum(1).clamp_(max=nb - 1)  # the digit where it crosses
        above = above + cum.gather(1, d.unsqueeze(1)).squeeze(1) - hist.gather(1, d.unsqueeze(1)).squeeze(1)
        prefix = (prefix << bits) | d
    # the boundary key back in ``key``'s signed form
    boundary = (torch.where(prefix >= 1 << 31, prefix - (1 << 32), prefix).to(torch.int32) ^ _INT_MIN).unsqueeze(1)
    ties = key == boundary
    rank = torch.cumsum(ties, 1, dtype=torch.int32) - ties.to(torch.int32)  # ties before this one
    tied_ok = ties & ((above.unsqueeze(1) + rank * weight) < target.unsqueeze(1))
    return (key < boundary) | tied_ok


def fixed_point(probs: torch.Tensor) -> torch.Tensor:
    """float32 probabilities in [0, 1] as int64 multiples of ``2**-47`` (rounded down). The scaling by a
    power of two is exact in float32 (no float64 pass needed); only the truncation rounds."""
    return (probs.to(torch.float32) * float(FIXED_ONE)).to(torch.int64)


def top_k_mask(x: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Bool mask of each row's ``top_k[row]`` largest logits (ties in vocabulary order); ``top_k`` int64,
    >= the vocabulary size for a row without top_k."""
    return keep_before(descending_key(x), torch.ones_like(x, dtype=torch.int32), top_k)


def top_p_mask(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Bool mask of each row's nucleus: the most likely tokens while the mass before them is below
    ``top_p[row]`` (float32, in (0, 1]); a row with top_p 1 keeps every token."""
    keep = keep_before(descending_key(probs), fixed_point(probs), _p_target(top_p))
    return keep | (top_p >= 1.0).unsqueeze(1)


def _p_target(top_p: torch.Tensor) -> torch.Tensor:
    return (top_p.to(torch.float64) * FIXED_ONE).to(torch.int64).clamp_(min=1)


# --- the same sets on a CPU, where syncs are free and scatters are slow ---------------------------------
# (a radix pass scatters every token; on one CPU core that costs more than the model's step)


def top_k_mask_host(x: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """``top_k_mask`` by ``torch.topk`` (the k-th value); a row holding more tokens equal to its k-th value
    than fit keeps the first ones in vocabulary order (a count of the ties before each)."""
    vocab = x.shape[-1]
    k = top_k.clamp(min=1, max=vocab)
    kth = torch.topk(x, int(k.max()), dim=-1).values.gather(1, (k - 1).unsqueeze(1))
    keep = x >= kth
    over = keep.sum(1) > k  # ties at the k-th value beyond k: rare (bf16 logits)
    if bool(over.any()):
        rows = over.nonzero().squeeze(1)
        xs, ks, kv = x[rows], k[rows].unsqueeze(1), kth[rows]
        ties = xs == kv
        t64 = ties.to(torch.int64)
        rank = torch.cumsum(t64, 1) - t64
        keep[rows] = (xs > kv) | (ties & (rank < ks - (xs > kv).sum(1, keepdim=True)))
    return keep


def top_p_mask_host(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``top_p_mask`` by one 1024-bin histogram of the probabilities' top bits (the bin where the mass
    crosses top_p) and a sort of that bin's few tokens only. The bins' sums are float64 rather than fixed
    point: the same set unless a row's mass before a token lies within ~1e-12 of top_p."""
    rows = probs.shape[0]
    tp = top_p.to(torch.float64)
    bins = (probs.contiguous().view(torch.int32) >> 20).clamp_(0, 1023)  # ascending value
    offsets = torch.arange(rows, dtype=torch.int32).unsqueeze(1) * 1024
    flat = (bins + offsets).view(-1)
    hist = torch.zeros(rows * 1024, dtype=torch.float64).index_add_(0, flat, probs.reshape(-1).to(torch.float64))
    above = hist.view(rows, 1024).flip(1).cumsum(1).flip(1)  # above[r, j] = mass of row r's bins >= j
    edge = ((above >= tp.unsqueeze(1)).sum(1) - 1).clamp(min=0)  # the bin where the mass crosses
    nxt = above.gather(1, (edge + 1).clamp(max=1023).unsqueeze(1)).squeeze(1)
    before = torch.where(edge < 1023, nxt, 0.0)  # the mass of the bins above it
    e32 = edge.to(torch.int32).unsqueeze(1)
    keep = bins > e32
    r, c = (bins == e32).nonzero(as_tuple=True)  # row-major: vocabulary order within a row
    v = probs[r, c]
    o = torch.sort(v, descending=True, stable=True).indices
    o = o[torch.sort(r[o], stable=True).indices]
    r, c, w = r[o], c[o], fixed_point(v[o])
    # one running sum over every row's few entries, in integers so that no row's answer depends on the
    # rows before it
    cum = torch.cumsum(w, 0)
    starts = torch.searchsorted(r, torch.arange(rows))  # each row's first entry (r is sorted)
    base = torch.where(starts > 0, cum[(starts - 1).clamp(min=0)], 0)
    keep[r, c] = (before[r] + (cum - w - base[r]).to(torch.float64) / FIXED_ONE) < tp[r]
    return keep | (top_p >= 1.0).unsqueeze(1)


__all__ = [
    "FIXED_ONE",
    "descending_key",
    "fixed_point",
    "keep_before",
    "top_k_mask",
    "top_k_mask_host",
    "top_p_mask",
    "top_p_mask_host",
]
