"""A request's time to first token, predicted from the live queue state (admission asks).

The wait for decode room (``server/router/decode_room.py``, disaggregated) is first come first served, then
the prefill call on the worker it is sent to: a colocated worker takes prompts oldest first, a prefill worker
shortest first with aging (the engine's ``wfs``), so there only the queued prompts its order puts ahead of a
request, and those that share its step, are ahead of it (``ahead_share``: admission reads its ledger,
server/latency_model.py has the order). So a request admitted now gets its first token once the prefill
work ahead of it is done and its own is: **queued prefill tokens x the measured cost per token**,
``queued_ttft_ms`` of server/latency_model.py (the planner's prefill formula, the one model), with

- *queued prefill tokens*: the prompt tokens of every admitted request still waiting for its first
  token (admission's count, ``Admission.queued_tokens``), on the least-loaded prefill worker: the calls
  in flight there plus its share of those not yet sent anywhere (waiting for decode room, or admitted a
  moment ago); less what the worker has done of its running step: a worker answers a step's calls together
  at its end and a call sent while a step runs waits for the next, so the running step holds the calls in
  flight when it started (its last answer, or the call that found it idle: calls sent within
  ``STEP_JOIN_S`` of that join it), up to the prefill batch budget, and at most their work is done since.
  A step that runs past its work at the cost per token is **overdue** (a stall: on one GPU the decode
  process's work, a neighbour on a CPU): the work behind it is predicted late by as much again as the step
  has overrun (scaled down to the work behind it when that is smaller than the step: a worker slower per
  token rather than stalled), so a burst that piles up on a stalled worker is predicted behind it instead of
  "nearly done" (docs/performance/overload.md, 2026-12-07);
- *cost per token*: measured on each prefill worker as busy seconds per prompt token answered (a worker
  is busy while a call of ours is in flight there), over the last ``RATE_TAU_S`` seconds. It is the
  worker's throughput as it is now, with everything a call pays on it besides the engine step (HTTP,
  KV staging, a CPU the decode worker and neighbours share), which a step model fitted to engine steps
  misses and which on a shared CPU changes within seconds;

and never less than an **idle call**: the prefill call of a request that finds its worker idle, a level
plus a slope per prompt token — the slope fitted on such calls (fast: ``IDLE_FORGET``), the level the
``IDLE_QUANTILE`` of the last ``IDLE_SAMPLES`` of them less their slope part (on a shared CPU the same idle
call takes 1x-4x from one request to the next; a low quantile of the recent ones is the prediction with the
smallest relative error, a mean is pulled up by every slow outlier for many calls). The decode-room wait is predicted as
the slot releases a request would wait for (behind the admitted requests without a decode slot yet:
admission's ledger, ``Admission.unplaced``, of which the requests already waiting at the gate are a part)
x the measured time per release (before any request waited: the slot holding time measured on admitted
requests / the slots, Little's law; before any slot was released either, the **room prior**, below; with
none of the three, no prediction); the two stages are in tandem,
so TTFT = max(decode-room wait + idle call, queued work) + the router's **overhead** (the rest of the
measured TTFT: picking, the first token's way to the client; an EWMA). The parts are reported as
(decode room, prefill call = the rest of the max, overhead).

Cheap on the hot path: a prediction is O(workers) (each worker's queued tokens are a running sum), a
measurement a few multiply-adds.

**Cold start.** Until ``MIN_SAMPLES`` calls are answered the cost per token is a **prior**: what each
prefill worker measured itself at start (``LLMEngine.measure_prefill``: one prefill batch timed on its own
device, model and threads, reported at registration as ``prefill_warmup``; ``priors()`` gives them per
healthy worker, in ms per token), on the worker's own engine, so it leaves out what a call pays besides the
step (HTTP, KV staging, a neighbour on a shared CPU); the live lower bound above (a worker at its calls
longer than their tokens cost at the prior is read as slower) corrects it while the first batch runs. From
the ``MIN_SAMPLES``-th answer on the measurements replace it (``source``: ``prior`` then ``measured``). With
neither there is no prediction (never a guess): admission then admits only what starts at once.

**Cold start of the decode room** (``RoomPrior``). A burst that takes every decode slot leaves the next
request waiting for a release before any was measured. The prior predicts it from the admitted requests
holding a slot now: each one's tokens left (its ``max_tokens``, the router's default where the client gave
none, less the tokens streamed so far) x the time per output token measured on the streams decoding now
(their tokens after the first / the seconds since their first token, pooled; before any stream has two
tokens, the TPOT of ended requests, ``Admission.tpot_ewma_s``; before any request ended, the decode step each
decode worker timed at start at the batch of the holders (its registration's ``decode_warmup``:
``LLMEngine.measure_decode`` at one and at ``decode.warmup_batch`` sequences, a line through the two); with
none of the three, no prior; ``tpot_source``: live / ended / prior). The k-th release is then the k-th
smallest of those times left; beyond the streams holding slots now, one more release every (their mean
``max_tokens`` x TPOT) / the slots (Little's law on the predicted holding time). It is
**pessimistic in the tokens it counts**: ``max_tokens`` is an upper bound (EOS or a stop string ends a
stream earlier), so at a steady TPOT the predicted wait is at most too long. It is not pessimistic in time:
the TPOT measured now can rise (a shared CPU, the burst's remaining prefills slowing the decode). A request
of ``n`` / ``best_of`` choices or batched prompts holds a slot per worker request (``slots``), released
together. A request it predicts too late is shed or queued
like any other; none is admitted blind. It is
refreshed at most every ``ROOM_PRIOR_REFRESH_S`` (one pass over the open tickets and a sort), and a
prediction between refreshes is one lookup (the k-th time left less the time since). A holder still
waiting for its first token is counted from the end of its prefill (the prompt tokens of the waiting
holders up to it, in admission order, at the prefill model's cost per token: a burst that took every slot
is mostly still in its prefill). Measured releases replace it as they come (``room_source``: ``prior``,
then ``slot_held``, then ``waits``).

Without a pipeline attached (unit tests of admission alone) the whole TTFT is taken as the prefill call,
with the tokens that admission counted as queued ahead of the request, fitted as one line (``call_ms``).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from distserve.server.config import DistServeConfig
from distserve.server.latency_model import prefill_steps, queued_prefill_ms, queued_ttft_ms

MIN_SAMPLES = 8
FORGET = 0.97  # per sample, the fits without a pipeline: a sample's weight halves after about 23
IDLE_FORGET = 0.7  # per idle call: the slope of the idle call over its prompt tokens follows within a few calls
IDLE_SAMPLES = 16  # the idle call's level: over the last this many idle calls ...
IDLE_QUANTILE = 0.3  # ... this quantile (a shared CPU's slow outliers would pull a mean up for many calls)
RATE_TAU_S = 2.0  # the cost per token is measured over about this many seconds of answers
FIT_EVERY = 4  # re-solve a fit every this many samples (every sample for the first 32)
EWMA = 0.1  # weight of a new sample in the decode-room and overhead averages
# Without a prediction (a cold model) a request is admitted only while it would be prefilled within this many
# batches: a burst of 40 on a fresh server is served, the seed's 300 users on a CPU are not taken in blind.
COLD_BATCHES = 2
ROOM_ERROR_MIN_S = 0.01  # decode-room waits shorter than this are not judged by their relative error
MARGIN_QUANTILE = 0.95  # admission's margin: this quantile of measured / predicted TTFT ...
MARGIN_SAMPLES = 256  # ... over the last this many requests admission judged (something queued ahead)
MARGIN_MIN_SAMPLES = 16
# The margin before MARGIN_MIN_SAMPLES judged requests: no run kept settled below 1.5 (H100 tiny / 7B open loops
# 1.55-3.7, SmolLM2 on the 2-vCPU VM 4.0), and 1 (the prediction taken as a bound) let a ShareGPT burst on a fresh
# server fill each request's slack to the SLO exactly: its first requests came 14 % past it (2026-12-07)
MARGIN_COLD = 1.5
MARGIN_MAX = 4.0
ROOM_PRIOR_REFRESH_S = 0.05  # the room prior's times left are recomputed at most this often
# A call sent this soon after its worker's step started (a burst sent to an idle worker at once) is counted in
# that step; one sent later waits for the next step.
STEP_JOIN_S = 0.001


class Stream(Protocol):
    """One admitted request as the room prior reads it (``admission.Ticket``)."""

    tokens: int  # its prompt tokens
    max_tokens: int  # its bound on output tokens (the router's default where the client gave none)
    streamed: int  # output tokens streamed so far
    first_at: float | None  # when its first token came (the predictor's clock), None before
    placed_at: float | None  # when it got its decode slot, None before (read only while the request is open)
    slots: int  # decode slots it holds: its worker requests (n / best_of choices, batched prompts), 1 or more


class RoomPrior:
    """The decode-slot releases predicted from the streams holding a slot now (see the module's docstring):
    the k-th release comes after the k-th smallest (tokens left x TPOT), refreshed at most every
    ``ROOM_PRIOR_REFRESH_S``. Pessimistic: tokens left are counted to ``max_tokens``."""

    def __init__(
        self,
        streams: Callable[[], Iterable[Stream]],
        tpot_fallback: Callable[[], float | None] = lambda: None,
        clock: Callable[[], float] = time.perf_counter,
        prefill_s_per_token: Callable[[], float] = lambda: 0.0,
        tpot_prior: Callable[[int], float | None] = lambda holders: None,
    ) -> None:
        self.streams, self.tpot_fallback, self.clock = streams, tpot_fallback, clock
        self.tpot_prior = tpot_prior  # the decode workers' start-up step (s) at this many holders: before any measure
        self.tpot_source = "none"  # live (the streams decoding now) / ended (requests that ended) / prior / none
        self.prefill_s_per_token = prefill_s_per_token  # the prefill queue's cost per prompt token (seconds)
        self.left: list[float] = []  # seconds left of each holder at ``at``, ascending
        self.hold_s = 0.0  # a new holder's predicted holding time (mean max_tokens x TPOT)
        self.tpot_s: float | None = None
        self.tpot_live = False  # the TPOT is the live streams' (else the ended requests', or none)
        self.at: float | None = None

    def refresh(self, now: float) -> None:
        if self.at is not None and now - self.at < ROOM_PRIOR_REFRESH_S:
            return
        self.at = now
        # a ticket without a bound (max_tokens 0: admission used alone, in unit tests) says nothing: not a holder
        holders = [s for s in self.streams() if s.placed_at is not None and s.max_tokens > 0]
        tokens = elapsed = 0.0
        for s in holders:
            if s.first_at is not None and s.streamed >= 2:
                tokens += s.streamed - 1
                elapsed += max(0.0, now - s.first_at)  # since its first token, to now: a stalled decode counts
        self.tpot_live = tokens > 0 and elapsed > 0
        if self.tpot_live:
            self.tpot_s, self.tpot_source = elapsed / tokens, "live"
        else:
            self.tpot_s, self.tpot_source = self.tpot_fallback(), "ended"
            if self.tpot_s is None:
                self.tpot_s = self.tpot_prior(len(holders)) if holders else None
                self.tpot_source = "prior" if self.tpot_s is not None else "none"
        if self.tpot_s is None or not holders:
            self.left, self.hold_s = [], 0.0
            return
        t = self.tpot_s
        # a holder still waiting for its first token is first prefilled: behind the prompt tokens of the
        # holders admitted before it that are still waiting too (the prefill is first come first served, the
        # streams are in admission order), at the prefill model's cost per token, counted in full
        per_token, queued, left = self.prefill_s_per_token(), 0, []
        for s in holders:
            wait = 0.0
            if s.first_at is None:
                queued += s.tokens
                wait = queued * per_token
            left += [wait + max(0, s.max_tokens - s.streamed) * t] * s.slots  # its choices end together
        self.left = sorted(left)
        self.hold_s = sum(s.max_tokens * s.slots for s in holders) / sum(s.slots for s in holders) * t

    def wait_s(self, releases: int, total_slots: int) -> float | None:
        """Seconds until the ``releases``-th slot release from now; None without a prior (no stream holds a
        slot, or no TPOT is known)."""
        now = self.clock()
        self.refresh(now)
        if not self.left or self.at is None:
            return None
        since = now - self.at
        n = len(self.left)
        if releases <= n:
            return max(0.0, self.left[releases - 1] - since)
        return max(0.0, self.left[-1] - since) + (releases - n) * self.hold_s / max(1, total_slots, n)

    def terms(self) -> dict:
        return {
            "tpot_ms": None if self.tpot_s is None else round(self.tpot_s * 1e3, 3),
            "tpot_live": self.tpot_live,
            "tpot_source": self.tpot_source,
            "holders": len(self.left),
            "next_release_ms": round(max(0.0, self.left[0] - (self.clock() - (self.at or 0.0))) * 1e3, 3)
            if self.left
            else None,
        }


class RoomState(Protocol):
    """What the decode-room gate tells the predictor (``DecodeRoom``)."""

    def releases_needed(self, ahead: int = 0) -> int: ...

    def gates(self) -> bool: ...

    def total_slots(self) -> int: ...

    def kv_bound(self) -> bool: ...


class RequestPhases:
    """One admitted request's measured parts, filled in by the pipeline as it goes."""

    __slots__ = ("room_s", "call_s", "predicted", "call_at_start_s", "state", "on_placed")

    def __init__(self) -> None:
        self.on_placed: Callable[[], None] | None = None  # told when the request gets its decode slot (ledger)
        self.room_s = 0.0
        self.call_s: float | None = None
        self.predicted: tuple[float, float, float] | None = None  # (room, call, overhead) seconds, at admission
        self.call_at_start_s: float | None = None  # the call predicted again when it was sent (state then)
        self.state: dict | None = None  # the queue state the admission prediction read (``TtftPredictor.state``)

    def journal(self, ttft_s: float | None) -> dict | None:
        """Predicted and measured parts for the request journal (seconds), None when nothing was predicted."""
        if self.predicted is None:
            return None
        r = 6
        out: dict = {"predicted": [round(x, r) for x in self.predicted]}
        if self.call_s is not None and ttft_s is not None:
            out["measured"] = [
                round(self.room_s, r),
                round(self.call_s, r),
                round(max(0.0, ttft_s - self.room_s - self.call_s), r),
            ]
        if self.call_at_start_s is not None:
            out["call_at_start"] = round(self.call_at_start_s, r)
        if self.state is not None:
            out["state"] = self.state
        return out


class Call:
    """One call in flight to a worker that ends with a request's first token (``TtftPredictor.call_started``)."""

    __slots__ = ("worker_id", "tokens", "ahead_tokens", "ahead_requests", "t0", "idle", "at_start_ms", "open")

    def __init__(self, worker_id: str, tokens: int, ahead_tokens: int, ahead_requests: int, t0: float) -> None:
        self.worker_id, self.tokens = worker_id, tokens
        self.ahead_tokens, self.ahead_requests = ahead_tokens, ahead_requests
        self.t0 = t0
        self.idle = ahead_requests == 0  # it found its worker idle: a sample of the idle call
        self.at_start_ms: float | None = None  # the call predicted when it was sent (for the journal)
        self.open = True


class WorkerQueue:
    """One prefill worker's calls in flight from this router and its measured cost per token.

    Busy time: from a call sent to the idle worker until no call is left there. Each answer adds the busy
    time since the previous answer (or since the worker became busy) and its prompt tokens; both sums decay
    by ``exp(-dt / RATE_TAU_S)`` between answers, so their ratio is the busy seconds per token of about the
    last ``RATE_TAU_S`` seconds (a step that answers many calls at once counts once, spread over its
    tokens).

    The running step (``step_at``, ``step_tokens``): the worker answers a step's calls together at its end and
    schedules the calls waiting then, oldest first, up to its batch budget (``prefill.max_num_batched_tokens``,
    ``prefill.max_batch_size``); so a step starts at an answer (or when a call finds the worker idle) and holds
    the calls in flight then (and those sent within ``STEP_JOIN_S``), up to the budget."""

    __slots__ = (
        "calls",
        "tokens",
        "busy_since",
        "busy_s",
        "busy_tokens",
        "last_answer",
        "step_at",
        "step_tokens",
        "step_calls",
        "budget",
    )

    def __init__(self, batched_tokens: int = 0, batch_size: int = 0) -> None:
        self.calls: list[Call] = []  # in flight, in the order sent
        self.tokens = 0  # their prompt tokens
        self.busy_since: float | None = None  # start of the current busy stretch, or its last answer
        self.busy_s = 0.0
        self.busy_tokens = 0.0
        self.last_answer: float | None = None
        self.step_at: float | None = None  # when the running step started (None: idle)
        self.step_tokens = 0  # the prompt tokens of the calls it holds
        self.step_calls = 0
        self.budget = (batched_tokens, batch_size)  # a step's most tokens and calls (0: no bound)

    def per_token_ms(self) -> float | None:
        return self.busy_s * 1000.0 / self.busy_tokens if self.busy_tokens > 0 else None

    def step_s(self, now: float) -> float:
        """Seconds the running step has run (0 when the worker is idle)."""
        return now - self.step_at if self.step_at is not None and self.calls else 0.0

    def _fits(self, tokens: int) -> bool:
        most_tokens, most_calls = self.budget
        if not self.step_calls:
            return True  # a step holds at least one call, however long
        return (not most_calls or self.step_calls < most_calls) and (
            not most_tokens or self.step_tokens + tokens <= most_tokens
        )

    def _next_step(self, now: float) -> None:
        """A step ended (an answer): the next holds the calls in flight, oldest first, up to the budget."""
        self.step_at, self.step_tokens, self.step_calls = (now if self.calls else None), 0, 0
        for c in self.calls:
            if not self._fits(c.tokens):
                break
            self.step_tokens += c.tokens
            self.step_calls += 1

    def add(self, c: Call, now: float) -> None:
        if not self.calls:
            self.busy_since = now
            self.step_at, self.step_tokens, self.step_calls = now, 0, 0
        if self.step_at is not None and now - self.step_at <= STEP_JOIN_S and self._fits(c.tokens):
            self.step_tokens += c.tokens
            self.step_calls += 1
        self.calls.append(c)
        self.tokens += c.tokens

    def remove(self, c: Call, now: float, answered: bool) -> None:
        self.calls.remove(c)
        self.tokens -= c.tokens
        if answered:
            if self.last_answer is not None:
                f = math.exp(-max(0.0, now - self.last_answer) / RATE_TAU_S)
                self.busy_s, self.busy_tokens = self.busy_s * f, self.busy_tokens * f
            since = self.busy_since if self.busy_since is not None else c.t0
            self.busy_s += max(0.0, now - since)
            self.busy_tokens += c.tokens
            self.last_answer = now
            self._next_step(now)
        else:  # a failed call: it may have been in the running step, which holds no more than what is left
            self.step_tokens = min(self.step_tokens, self.tokens)
            self.step_calls = min(self.step_calls, len(self.calls))
            if not self.calls:
                self.step_at = None
        self.busy_since = now if self.calls else None


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """``a x = b`` by Gaussian elimination with partial pivoting; None when ``a`` is (near) singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    scale = max(1.0, max(abs(m[i][i]) for i in range(n)))
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) <= 1e-9 * scale:
            return None
        m[c], m[p] = m[p], m[c]
        for r in range(c + 1, n):
            f = m[r][c] / m[c][c]
            for k in range(c, n + 1):
                m[r][k] -= f * m[c][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][k] * x[k] for k in range(r + 1, n))) / m[r][r]
    return x


class OnlineFit:
    """Least squares ``y = coef . x`` with every coefficient >= 0, over samples weighted ``forget ** age``
    (times the weight each is given: ``observe_relative`` weighs by 1 / expected y squared)."""

    def __init__(self, n: int, forget: float = FORGET) -> None:
        self.n, self.forget = n, forget
        self.sxx = [[0.0] * n for _ in range(n)]
        self.sxy = [0.0] * n
        self.syy = 0.0
        self.count = 0
        self.coef = [0.0] * n
        self._pending = 0

    def observe(self, x: Sequence[float], y: float, weight: float = 1.0) -> None:
        f = self.forget
        for i in range(self.n):
            xi = x[i] * weight
            self.sxy[i] = f * self.sxy[i] + xi * y
            row = self.sxx[i]
            for j in range(self.n):
                row[j] = f * row[j] + xi * x[j]
        self.syy = f * self.syy + weight * y * y
        self.count += 1
        self._pending += 1
        if self.count <= 32 or self._pending >= FIT_EVERY:
            self.solve()

    def _sse(self, coef: list[float]) -> float:
        quad = sum(coef[i] * coef[j] * self.sxx[i][j] for i in range(self.n) for j in range(self.n))
        return self.syy - 2 * sum(c * s for c, s in zip(coef, self.sxy, strict=True)) + quad

    def solve(self) -> None:
        self._pending = 0
        best: tuple[float, list[float]] | None = None
        for mask in range(1, 1 << self.n):
            idx = [i for i in range(self.n) if mask >> i & 1]
            theta = _solve([[self.sxx[i][j] for j in idx] for i in idx], [self.sxy[i] for i in idx])
            if theta is None or min(theta) < 0:
                continue
            coef = [0.0] * self.n
            for k, i in enumerate(idx):
                coef[i] = theta[k]
            sse = self._sse(coef)
            if best is None or sse < best[0] - 1e-9 * max(1.0, abs(best[0])):
                best = (sse, coef)
        if best is not None:
            self.coef = best[1]

    def predict(self, x: Sequence[float]) -> float:
        return sum(c * xi for c, xi in zip(self.coef, x, strict=True))

    def observe_relative(self, x: Sequence[float], y: float, floor: float = 1.0) -> None:
        """A sample whose error is judged relative to its size: timings' noise grows with them (a 5 % jitter
        on a 5 s wait outweighs a whole 20 ms prefill in absolute terms), and admission is judged on the
        relative error. The weight is 1 / y^2 of the current fit's prediction, not of the measured y (which
        would favour the samples that happened to come out low), until the fit has a few samples."""
        guess = self.predict(x) if self.count >= MIN_SAMPLES else y
        self.observe(x, y, 1.0 / max(floor, guess) ** 2)


class TtftPredictor:
    def __init__(
        self,
        cfg: DistServeConfig,
        workers,
        clock: Callable[[], float] = time.perf_counter,
        priors: Callable[[], dict[str, float]] = dict,
    ) -> None:
        self.batched_tokens = cfg.prefill.max_num_batched_tokens
        self.batch_size = cfg.prefill.max_batch_size
        self.workers = workers  # how many workers share the prefill queue (admission's callback)
        # worker id -> the ms per prompt token it measured at start (its registration's prefill_warmup)
        self.priors = priors
        self.clock = clock
        self.idle_call = OnlineFit(2, IDLE_FORGET)  # a call to an idle worker: x = (1, tokens / 1000), y = ms
        self.idle_calls: deque[tuple[float, int]] = deque(maxlen=IDLE_SAMPLES)  # (ms, prompt tokens)
        self.answered = 0  # calls answered (the model is ready after MIN_SAMPLES)
        self.call = OnlineFit(4)  # without a pipeline: x = (1, steps, (ahead + own) / 1000, -ahead / 1000)
        self.room_per_release_s: float | None = None
        self.room_samples = 0
        self.slot_s: float | None = None  # how long an admitted request holds its decode slot (an EWMA)
        self.slot_samples = 0
        self.overhead_s = 0.0
        self.overhead_samples = 0
        self.known: dict[str, WorkerQueue] = {}  # worker id -> its calls in flight and its measured cost
        self.room: RoomState | None = None  # set by attach(): the pipeline reports the phases
        # relative errors of the two predicted parts (|measured - predicted| / measured), for GET /v1/admission
        self.call_errors: deque[float] = deque(maxlen=1024)
        self.room_errors: deque[float] = deque(maxlen=1024)
        self.ratios: deque[float] = deque(maxlen=MARGIN_SAMPLES)  # measured / predicted TTFT, judged requests
        self.room_prior: RoomPrior | None = None  # the decode-room wait before any release (admission's streams)

    @property
    def queues(self) -> dict[str, WorkerQueue]:
        """The workers with calls of ours in flight (one without is idle, as one never sent to)."""
        return {w: q for w, q in self.known.items() if q.calls}

    @property
    def measuring(self) -> bool:
        """Enough calls answered for the measured cost per token to be used (the prior no longer is)."""
        return self.answered >= MIN_SAMPLES if self.room is not None else self.call.count >= MIN_SAMPLES

    @property
    def ready(self) -> bool:
        return self.measuring or self.source == "prior"

    @property
    def source(self) -> str:
        """What the prefill part is predicted from: ``measured`` calls, the workers' start-up ``prior``, or
        ``none`` (no prediction). The prior needs the pipeline's phases (it is a cost per prompt token)."""
        if self.measuring:
            return "measured"
        return "prior" if self.room is not None and self.priors() else "none"

    def prior_per_token_ms(self, worker_id: str | None = None) -> float | None:
        """The start-up cost per token of ``worker_id`` (of the healthy workers, on average, for one that
        reported none or for None); None when no worker reported one."""
        p = self.priors()
        if worker_id is not None and worker_id in p:
            return p[worker_id]
        return sum(p.values()) / len(p) if p else None

    # --- the model --------------------------------------------------------------------------------
    def per_token_ms(self, wq: WorkerQueue | None = None) -> float:
        """The measured busy milliseconds per prompt token of ``wq``'s worker (of the workers measured, on
        average, for one not measured yet); before ``MIN_SAMPLES`` answers, the prior."""
        if not self.measuring:
            wid = next((w for w, q in self.known.items() if q is wq), None) if wq is not None else None
            return self.prior_per_token_ms(wid) or 0.0
        own = wq.per_token_ms() if wq is not None else None
        if own is not None:
            return own
        known = [c for c in (q.per_token_ms() for q in self.known.values()) if c is not None]
        return sum(known) / len(known) if known else 0.0

    def idle_call_ms(self, own: int) -> float:
        """The prefill call of ``own`` prompt tokens on an idle worker (before any idle call was measured:
        its tokens at the measured cost per token)."""
        if not self.idle_calls:
            return own * self.per_token_ms()
        return max(0.0, self.idle_level_ms()) + own * self.idle_slope_ms()

    def idle_slope_ms(self) -> float:
        return self.idle_call.coef[1] / 1000.0

    def idle_level_ms(self) -> float:
        m = self.idle_slope_ms()
        s = sorted(ms - tokens * m for ms, tokens in self.idle_calls)
        return s[min(len(s) - 1, max(0, math.ceil(IDLE_QUANTILE * len(s)) - 1))] if s else 0.0

    def queued_ms(
        self, wq: WorkerQueue | None, own: int, unsent_tokens: float, now: float, ahead_share: float = 1.0
    ) -> float:
        """Until a request of ``own`` prompt tokens sent to this worker (after ``unsent_tokens`` admitted
        before it and not sent anywhere yet) has its first token: the queued work at the cost per token, less
        what the worker did of its running step (at most that step's work); a step overdue (run past its work
        at the cost per token) delays the work behind it by its overrun, scaled down to that work when it is
        smaller than the step. ``ahead_share``: the share of the queued prompt tokens the worker's order puts
        ahead of this request (1: all, first come first served; less under shortest first); the running
        step's are ahead whatever the order."""
        ahead = unsent_tokens + (wq.tokens if wq is not None else 0)
        if ahead_share < 1.0:
            running = min(ahead, wq.step_tokens) if wq is not None and wq.calls else 0.0
            ahead = running + max(0.0, ahead_share) * (ahead - running)
        per_token = self.per_token_ms(wq)
        work_ms = queued_ttft_ms(ahead, own, 0.0, per_token)
        if wq is None or not wq.calls:
            return max(0.0, work_ms)
        ran_ms = wq.step_s(now) * 1000.0
        step_ms = wq.step_tokens * per_token
        done_ms = min(ran_ms, step_ms)
        late_ms = 0.0
        if ran_ms > step_ms and wq.step_tokens:
            # overdue: a stall (as long again as it has overrun) or a worker slower per token than measured
            # (the work behind at the step's own pace, which is less when that work is smaller than the step)
            behind = max(0.0, ahead + own - wq.step_tokens)
            late_ms = (ran_ms - step_ms) * min(1.0, behind / wq.step_tokens)
        return max(0.0, work_ms - done_ms + late_ms)

    def _queued_best_ms(self, own: int, queued_tokens: float, now: float, ahead_share: float = 1.0) -> float:
        """``queued_ms`` on the worker that would answer first; the admitted requests not in flight yet
        (``queued_tokens`` less the calls in flight) are shared among the workers."""
        busy = self.queues
        n = max(1, self.workers(), len(busy))
        in_flight = sum(q.tokens for q in busy.values())
        share = max(0.0, queued_tokens - in_flight) / n
        best = self.queued_ms(None, own, share, now, ahead_share) if len(busy) < n else math.inf
        for wq in busy.values():
            best = min(best, self.queued_ms(wq, own, share, now, ahead_share))
        return best

    def call_ms(self, ahead: int, ahead_requests: int, own: int) -> float:
        """Without a pipeline: the one fit over (tokens ahead, own) of every TTFT, in which tokens ahead may
        cost less than the request's own (``ahead_discount``) but never less than nothing."""
        c = self.call.coef
        steps = prefill_steps(ahead + own, ahead_requests + 1, self.batched_tokens, self.batch_size)
        discount = min(c[3], c[2]) * ahead
        return queued_prefill_ms(ahead + own, steps, c[0], c[1], c[2] / 1000.0) - discount / 1000.0

    def _x(self, ahead: int, ahead_requests: int, own: int) -> tuple[float, float, float, float]:
        steps = prefill_steps(ahead + own, ahead_requests + 1, self.batched_tokens, self.batch_size)
        return (1.0, float(steps), (ahead + own) / 1000.0, -ahead / 1000.0)

    def predict_s(
        self,
        own_tokens: int,
        fallback_ahead: tuple[float, float] = (0.0, 0.0),
        queued_tokens: float = 0.0,
        unplaced: int = 0,
    ) -> float | None:
        """The predicted TTFT of a request of ``own_tokens`` prompt tokens admitted now, in seconds."""
        parts = self.predict_parts(own_tokens, fallback_ahead, queued_tokens, unplaced)
        return None if parts is None else sum(parts)

    def predict_parts(
        self,
        own_tokens: int,
        fallback_ahead: tuple[float, float] = (0.0, 0.0),
        queued_tokens: float = 0.0,
        unplaced: int = 0,
        ahead_share: float = 1.0,
    ) -> tuple[float, float, float] | None:
        """(decode-room wait, prefill call, overhead) predicted for a request admitted now, in seconds, with
        ``queued_tokens`` prompt tokens admitted before it and still without their first token, ``unplaced``
        of those requests not yet given a decode slot (admission's ledger), ``ahead_share`` of those tokens
        ahead of it in the prefill worker's order (``queued_ms``). None: no prediction (the model has not
        measured enough, or the request would wait for decode room before any wait or slot was measured)."""
        if not self.ready:
            return None
        if self.room is None:
            t, r = fallback_ahead
            return 0.0, self.call_ms(int(t), int(r), own_tokens) / 1000.0, 0.0
        room = 0.0
        releases = self.room.releases_needed(unplaced)
        if releases:
            wait = self.room_wait_s(releases)
            if wait is None:  # it would wait for decode room, and nothing says for how long yet
                return None
            room = wait
        idle_s = self.idle_call_ms(own_tokens) / 1000.0
        queued_s = self._queued_best_ms(own_tokens, queued_tokens, self.clock(), ahead_share) / 1000.0
        return room, max(idle_s, queued_s - room), self.overhead_s  # tandem: max(room + idle, queued)

    def release_s(self) -> float | None:
        """Seconds per decode-slot release: measured on the requests that waited for room; before any did, a
        slot held as long as admitted requests have held theirs, over the slots (Little's law: with every slot
        busy one frees every holding time / slots); None while neither is known."""
        if self.room_per_release_s is not None:
            return self.room_per_release_s
        total = self.room.total_slots() if self.room is not None else 0
        return self.slot_s / total if self.slot_s is not None and total else None

    @property
    def room_source(self) -> str:
        """What the decode-room wait is predicted from: ``waits`` (measured waits for room), ``slot_held``
        (measured slot holding times, Little's law), ``prior`` (the streams holding slots now: ``RoomPrior``)
        or ``none``."""
        if self.room_per_release_s is not None:
            return "waits"
        if self.release_s() is not None:
            return "slot_held"
        if self.room_prior is not None and self.room is not None and self.room.gates():
            if self.room_prior.wait_s(1, self.room.total_slots()) is not None:
                return "prior"
        return "none"

    def room_wait_s(self, releases: int) -> float | None:
        """Seconds a request waits for ``releases`` slot releases: x the measured time per release where one
        is known, else the room prior's time to the ``releases``-th release; None with neither."""
        per = self.release_s()
        if self.room is not None and self.room_prior is not None and self.room.kv_bound():
            # short of KV blocks, not slots: room comes back as the streams holding blocks end (the room prior's
            # k-th stream end), never sooner than the pace of releases measured so far
            ends = self.room_prior.wait_s(releases, 0)
            if ends is not None:
                return max(ends, releases * per) if per is not None else ends
        if per is not None:
            return releases * per
        if self.room_prior is None or self.room is None:
            return None
        return self.room_prior.wait_s(releases, self.room.total_slots())

    def starts_at_once(self, unplaced: int, queued_requests: int) -> bool:
        """Without a prediction: would a request admitted now start soon? It must fit in the first
        ``COLD_BATCHES`` prefill batches behind the ``queued_requests`` admitted before it without their first
        token (per worker that prefills) and, where the decode-room gate applies, find a decode slot behind
        the ``unplaced`` requests admitted before it without one."""
        soon = queued_requests < COLD_BATCHES * max(1, self.workers()) * self.batch_size
        if self.room is not None and self.room.gates():  # a decode slot, and a place in the first prefill batches
            return soon and self.room.releases_needed(unplaced) == 0
        return soon

    # --- measurements (the pipeline's hooks) ------------------------------------------------------
    def attach(self, room: RoomState) -> None:
        self.room = room

    def slot_held(self, seconds: float) -> None:
        """An admitted request gave its decode slot back after holding it ``seconds``."""
        self.slot_s = seconds if self.slot_s is None else (1 - EWMA) * self.slot_s + EWMA * seconds
        self.slot_samples += 1

    def room_granted(self, phases: RequestPhases | None, waited_s: float, releases: int) -> None:
        """A request got decode room after waiting ``waited_s`` for ``releases`` slot releases (0: no wait)."""
        if phases is not None:
            phases.room_s = waited_s
            if phases.on_placed is not None:
                phases.on_placed()
        if releases > 0:
            per = waited_s / releases
            r = self.room_per_release_s
            self.room_per_release_s = per if r is None else (1 - EWMA) * r + EWMA * per
            self.room_samples += 1

    def call_started(self, worker_id: str, tokens: int) -> Call:
        now = self.clock()
        wq = self.known.get(worker_id)
        if wq is None:
            wq = self.known[worker_id] = WorkerQueue(self.batched_tokens, self.batch_size)
        c = Call(worker_id, tokens, wq.tokens, len(wq.calls), now)
        if self.ready:
            c.at_start_ms = max(self.idle_call_ms(tokens), self.queued_ms(wq, tokens, 0.0, now))
        wq.add(c, now)
        return c

    def call_ended(self, c: Call, ok: bool, phases: RequestPhases | None = None) -> None:
        """The call answered with the first token (``ok``) or failed; released once however often called."""
        if not c.open:
            return
        c.open = False
        now = self.clock()
        wq = self.known.get(c.worker_id)
        if wq is not None:
            wq.remove(c, now, ok)
        if not ok:
            return
        self.answered += 1
        ms = (now - c.t0) * 1000.0
        if c.idle:
            self.idle_call.observe_relative((1.0, c.tokens / 1000.0), ms)
            self.idle_calls.append((ms, c.tokens))
        if phases is not None:
            phases.call_s = ms / 1000.0
            if c.at_start_ms is not None:
                phases.call_at_start_s = c.at_start_ms / 1000.0

    def measured(self, phases: RequestPhases, tokens: int, ahead: tuple[float, float], ttft_s: float) -> None:
        """A request's first token reached the router ``ttft_s`` after its arrival."""
        if phases.call_s is not None:
            if phases.predicted is not None:
                p_room, p_call, _ = phases.predicted
                self.call_errors.append(abs(phases.call_s - p_call) / max(phases.call_s, 1e-6))
                if phases.room_s >= ROOM_ERROR_MIN_S:  # a relative error of a wait of nothing says nothing
                    self.room_errors.append(abs(phases.room_s - p_room) / phases.room_s)
            over = max(0.0, ttft_s - phases.room_s - phases.call_s)
            self.overhead_s = over if not self.overhead_samples else (1 - EWMA) * self.overhead_s + EWMA * over
            self.overhead_samples += 1
        elif self.room is None:  # no pipeline to report the parts: the whole TTFT is the call
            t, r = ahead
            self.call.observe_relative(self._x(int(t), int(r), tokens), ttft_s * 1000.0)

    def judged(self, predicted_s: float, ttft_s: float) -> None:
        """A request admitted with something queued ahead (so admission judged its prediction) had ``ttft_s``."""
        if predicted_s > 0 and ttft_s > 0:
            self.ratios.append(ttft_s / predicted_s)

    def slo_margin(self) -> float:
        """What admission multiplies a prediction by before comparing it with the SLO: the ``MARGIN_QUANTILE``
        of measured / predicted TTFT of the requests it judged lately, in [1, ``MARGIN_MAX``] (``MARGIN_COLD`` until
        ``MARGIN_MIN_SAMPLES``). On a machine whose speed moves within seconds the prediction is a median; the
        SLO bounds a tail, so a request is admitted when it would meet the SLO even as late as most are."""
        if len(self.ratios) < MARGIN_MIN_SAMPLES:
            return MARGIN_COLD
        s = sorted(self.ratios)
        q = s[min(len(s) - 1, math.ceil(MARGIN_QUANTILE * len(s)) - 1)]
        return max(1.0, min(MARGIN_MAX, q))

    def state(self, unplaced: int = 0) -> dict:
        """The queue state a prediction reads, for the journal: slot releases needed (behind ``unplaced``
        admitted requests without a decode slot yet) and requests waiting for decode room, and per prefill
        worker [prompt tokens in flight, calls in flight, ms per token]."""
        out: dict = {"source": self.source}
        if self.room is not None:
            out["room_source"] = self.room_source
            out["releases"] = self.room.releases_needed(unplaced)
            out["room_waiting"] = len(getattr(self.room, "waiters", ()))
        out["workers"] = {w: [q.tokens, len(q.calls), round(q.per_token_ms() or 0.0, 5)] for w, q in self.known.items()}
        return out

    def ahead(self) -> tuple[int, int]:
        """Prompt tokens and requests in flight on the least-loaded worker (0, 0 when one has none)."""
        busy = self.queues
        if len(busy) < self.workers() or not busy:
            return 0, 0
        return min((q.tokens, len(q.calls)) for q in busy.values())

    def terms(self) -> dict:
        c = self.call.coef
        prior = self.prior_per_token_ms()
        return {
            "ready": self.ready,
            "source": self.source,
            "prior_per_token_ms": None if prior is None else round(prior, 5),
            "samples": self.answered if self.room is not None else self.call.count,
            "busy_per_token_ms": round(self.per_token_ms(), 5),
            "idle_call_fixed_ms": round(self.idle_level_ms(), 3),
            "idle_call_per_token_ms": round(self.idle_slope_ms(), 5),
            "idle_call_samples": self.idle_call.count,
            "per_call_ms": round(c[0], 3),
            "per_step_ms": round(c[1], 3),
            "per_token_ms": round(c[2] / 1000.0, 5),
            "ahead_discount_per_token_ms": round(min(c[3], c[2]) / 1000.0, 5),
            "room_per_release_ms": None if self.room_per_release_s is None else round(self.room_per_release_s * 1e3, 3),
            "room_samples": self.room_samples,
            "slot_held_ms": None if self.slot_s is None else round(self.slot_s * 1e3, 3),
            "room_source": self.room_source if self.room is not None else "none",
            "room_prior": self.room_prior.terms() if self.room_prior is not None else None,
            "overhead_ms": round(self.overhead_s * 1000.0, 3),
            "slo_margin": round(self.slo_margin(), 3),
        }

    def part_errors(self) -> dict:
        return {"prefill_call": quantiles(self.call_errors), "decode_room": quantiles(self.room_errors)}


def quantiles(errors: Iterable[float]) -> dict:
    """Samples, median and P90 (nearest rank) of relative errors."""
    s = sorted(errors)

    def q(p: float) -> float | None:
        return round(s[min(len(s) - 1, math.ceil(p * len(s)) - 1)], 4) if s else None

    return {"samples": len(s), "median": q(0.5), "p90": q(0.9)}
