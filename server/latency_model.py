"""The one prefill-cost formula, shared by the planner (fitted offline to a profile) and the router's
admission (fitted live to the TTFTs it observes).

A prefill of prompts given as (new tokens, tokens of context before them) costs, beyond a step's fixed part,
``per_token x new + per_token2 x ((before + new)^2 - before^2)`` each: the GEMMs are linear in the tokens
computed, attention quadratic in the prompt (the difference of squares keeps a chunked prompt's total exact).
A request queued behind others waits for their prefills and then its own, so its time to first token is
``fixed + prefill_work(queued prompts + its own)``: ``queued_ttft_ms``. planner/latency.py builds its step
model on ``prefill_work_ms``. The router's TTFT prediction (server/router/ttft_predictor.py) is
``queued_ttft_ms`` with the prompt tokens admitted ahead of a request and the per-token cost measured live on
the prefill worker (busy seconds per prompt token answered); its fallback without a pipeline fits the per-step
form, ``queued_prefill_ms``: a fixed part per call and per step (``prefill_steps``, from the worker's budgets)
plus the per-token work. Pure, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable

# A prefill worker schedules its waiting prompts shortest first with aging (the engine's ``wfs`` policy,
# server/engine/scheduler.py): prompt i goes before prompt j when len_i - AGING x waited_i < len_j - AGING x
# waited_j. Both wait at the same rate, so the order of two prompts is fixed at the later one's arrival: a
# prompt of L tokens arriving now waits for the queued prompts with len + AGING x arrival <= L + AGING x now.
# The router's TTFT prediction counts only those ahead (server/router/admission.py); with prompts of one length
# that is every queued prompt, first come first served.
PREFILL_AGING_TOKENS_PER_S = 1000.0


def ahead_under_shortest_first(tokens: int, arrival_s: float) -> float:
    """The key that orders a prompt of ``tokens`` arriving at ``arrival_s`` among the others under the prefill
    worker's shortest-first order: the smaller goes first, whenever both are waiting."""
    return tokens + PREFILL_AGING_TOKENS_PER_S * arrival_s


def prefill_work_ms(chunks: Iterable[tuple[int, int]], per_token_ms: float, per_token2_ms: float = 0.0) -> float:
    """The variable part of prefilling ``chunks`` ((new tokens, context before them) per prompt), in ms."""
    total = 0.0
    for new, before in chunks:
        total += per_token_ms * new + per_token2_ms * ((before + new) ** 2 - before**2)
    return total


def queued_ttft_ms(
    tokens_ahead: float, own_tokens: int, fixed_ms: float, per_token_ms: float, per_token2_ms: float = 0.0
) -> float:
    """Predicted time to first token of a prompt of ``own_tokens`` queued behind ``tokens_ahead`` prompt
    tokens (on the worker it will wait for): the fixed part plus the prefill work of both."""
    return fixed_ms + prefill_work_ms([(int(tokens_ahead), 0), (own_tokens, 0)], per_token_ms, per_token2_ms)


def prefill_steps(tokens: int, requests: int, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """Engine steps a prefill worker needs for ``requests`` prompts of ``tokens`` in all, first come first
    served under its two budgets per step (``prefill.max_num_batched_tokens``, ``prefill.max_batch_size``)."""
    if tokens <= 0 or requests <= 0:
        return 0
    return max(-(-tokens // max(1, max_num_batched_tokens)), -(-requests // max(1, max_num_seqs)))


def queued_prefill_ms(tokens: int, steps: int, per_call_ms: float, per_step_ms: float, per_token_ms: float) -> float:
    """The time from sending a prefill to its answer, for a prompt that finds ``tokens`` prompt tokens (its own
    included) in ``steps`` steps of its worker: a fixed part per call (HTTP, KV staging), one per step (the
    engine's fixed cost of a step) and the prefill work of the tokens (``prefill_work_ms``, linear part)."""
    return per_call_ms + per_step_ms * steps + prefill_work_ms([(tokens, 0)], per_token_ms)
