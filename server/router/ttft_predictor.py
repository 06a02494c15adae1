"""A request's time to first token, predicted from the live queue state phase by phase (admission asks).

A request's TTFT at the router is the sum of three parts, each predicted from what the router knows:

- **decode-room wait** (disaggregated): a request is prefilled only once a decode worker has room for it
  (``server/router/decode_room.py``, first come first served). One that finds ``W`` requests waiting and
  ``F`` free slots waits for ``W + 1 - F`` slot releases; the time per release is measured (an EWMA of
  wait / releases over the requests that waited), so it is the decode side's completion rate as it is now.
- **prefill call**: from sending ``/internal/prefill`` to its answer (colocated, or a prefill on the decode
  worker: to the first token of the stream). A worker prefills first come first served, so a request that
  finds ``tokens`` prompt tokens of ``requests`` requests ahead of it (the router counts, per worker, what it
  sent and has no answer for) waits for their steps and its own: ``queued_prefill_ms`` of
  server/latency_model.py, with the number of steps from the worker's budgets (``prefill_steps``) and three
  coefficients (per call: HTTP and KV staging; per step; per token) fitted online, by non-negative least
  squares of the relative error with exponential forgetting (``FORGET``) over every call's (steps, tokens,
  duration): the fit follows
  the machine as it is now (neighbours, threads, the model) and is not skewed by the decode-room wait, which
  one line through (tokens ahead, TTFT) mixed in.
- **overhead**: the rest of the measured TTFT (picking, the first token's way to the client): an EWMA.

Cheap on the hot path: a prediction is O(workers); a measurement is a few multiply-adds, and the 3x3 fit is
re-solved every ``FIT_EVERY`` calls (all seven subsets of the three terms, the best one with no negative
coefficient: a cost can not be negative, and an unconstrained fit extrapolates wildly). Until ``MIN_SAMPLES``
calls are measured there is no prediction (never a guess).

Without a pipeline attached (unit tests of admission alone) the whole TTFT is taken as the prefill call, with
the tokens that admission counted as queued ahead of the request.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

from server.config import DistServeConfig
from server.latency_model import prefill_steps, queued_prefill_ms

MIN_SAMPLES = 8
FORGET = 0.99  # per call: a sample's weight halves after about 70 calls
FIT_EVERY = 4  # re-solve the fit every this many calls (every call for the first 32)
EWMA = 0.1  # weight of a new sample in the decode-room and overhead averages


class RoomState(Protocol):
    """What the decode-room gate tells the predictor (``DecodeRoom``)."""

    def releases_needed(self) -> int: ...


class RequestPhases:
    """One admitted request's measured parts, filled in by the pipeline as it goes."""

    __slots__ = ("room_s", "call_s")

    def __init__(self) -> None:
        self.room_s = 0.0
        self.call_s: float | None = None


class Call:
    """One call in flight to a worker that ends with a request's first token (``TtftPredictor.call_started``)."""

    __slots__ = ("worker_id", "tokens", "ahead_tokens", "ahead_requests", "t0", "open")

    def __init__(self, worker_id: str, tokens: int, ahead_tokens: int, ahead_requests: int) -> None:
        self.worker_id, self.tokens = worker_id, tokens
        self.ahead_tokens, self.ahead_requests = ahead_tokens, ahead_requests
        self.t0 = time.perf_counter()
        self.open = True


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
    def __init__(self, cfg: DistServeConfig, workers) -> None:
        self.batched_tokens = cfg.prefill.max_num_batched_tokens
        self.batch_size = cfg.prefill.max_batch_size
        self.workers = workers  # how many workers share the prefill queue (admission's callback)
        self.call = OnlineFit(3)  # x = (1, steps, tokens / 1000), y = ms
        self.room_per_release_s: float | None = None
        self.room_samples = 0
        self.overhead_s = 0.0
        self.overhead_samples = 0
        self.outstanding: dict[str, list[int]] = {}  # worker id -> [prompt tokens, requests] sent, no answer yet
        self.room: RoomState | None = None  # set by attach(): the pipeline reports the phases

    @property
    def ready(self) -> bool:
        return self.call.count >= MIN_SAMPLES

    @property
    def attached(self) -> bool:
        return self.room is not None

    # --- the model --------------------------------------------------------------------------------
    def _x(self, tokens: int, requests: int) -> tuple[float, float, float]:
        return (1.0, float(prefill_steps(tokens, requests, self.batched_tokens, self.batch_size)), tokens / 1000.0)

    def call_ms(self, tokens: int, requests: int) -> float:
        """The predicted prefill call of a request that makes ``tokens`` prompt tokens in ``requests`` requests
        (itself included) on its worker."""
        c = self.call.coef
        steps = prefill_steps(tokens, requests, self.batched_tokens, self.batch_size)
        return queued_prefill_ms(tokens, steps, c[0], c[1], c[2] / 1000.0)

    def ahead(self) -> tuple[int, int]:
        """Prompt tokens and requests ahead on the worker a new request would likely get (the least queued;
        none when a serving worker has nothing outstanding)."""
        busy = [v for v in self.outstanding.values() if v[1] > 0]
        if not busy or len(busy) < self.workers():
            return 0, 0
        t, r = min(busy)
        return t, r

    def predict_s(self, own_tokens: int, fallback_ahead: tuple[float, float] = (0.0, 0.0)) -> float | None:
        """The predicted TTFT of a request of ``own_tokens`` prompt tokens admitted now, in seconds."""
        if not self.ready:
            return None
        if not self.attached:
            t, r = fallback_ahead
            return self.call_ms(int(t) + own_tokens, int(r) + 1) / 1000.0
        t, r = self.ahead()
        ms = self.call_ms(t + own_tokens, r + 1)
        room = 0.0
        assert self.room is not None
        releases = self.room.releases_needed()
        if releases and self.room_per_release_s is not None:
            room = releases * self.room_per_release_s
        return room + ms / 1000.0 + self.overhead_s

    # --- measurements (the pipeline's hooks) ------------------------------------------------------
    def attach(self, room: RoomState) -> None:
        self.room = room

    def room_granted(self, phases: RequestPhases | None, waited_s: float, releases: int) -> None:
        """A request got decode room after waiting ``waited_s`` for ``releases`` slot releases (0: no wait)."""
        if phases is not None:
            phases.room_s = waited_s
        if releases > 0:
            per = waited_s / releases
            r = self.room_per_release_s
            self.room_per_release_s = per if r is None else (1 - EWMA) * r + EWMA * per
            self.room_samples += 1

    def call_started(self, worker_id: str, tokens: int) -> Call:
        o = self.outstanding.get(worker_id)
        if o is None:
            o = self.outstanding[worker_id] = [0, 0]
        c = Call(worker_id, tokens, o[0], o[1])
        o[0] += tokens
        o[1] += 1
        return c

    def call_ended(self, c: Call, ok: bool, phases: RequestPhases | None = None) -> None:
        """The call answered with the first token (``ok``) or failed; released once however often called."""
        if not c.open:
            return
        c.open = False
        o = self.outstanding.get(c.worker_id)
        if o is not None:
            o[0] -= c.tokens
            o[1] -= 1
            if o[1] <= 0:
                del self.outstanding[c.worker_id]
        if not ok:
            return
        dur = time.perf_counter() - c.t0
        if phases is not None:
            phases.call_s = dur
        self.call.observe_relative(self._x(c.ahead_tokens + c.tokens, c.ahead_requests + 1), dur * 1000.0)

    def measured(self, phases: RequestPhases, tokens: int, ahead: tuple[float, float], ttft_s: float) -> None:
        """A request's first token reached the router ``ttft_s`` after its arrival."""
        if phases.call_s is not None:
            over = max(0.0, ttft_s - phases.room_s - phases.call_s)
            self.overhead_s = over if not self.overhead_samples else (1 - EWMA) * self.overhead_s + EWMA * over
            self.overhead_samples += 1
        elif not self.attached:  # no pipeline to report the parts: the whole TTFT is the call
            t, r = ahead
            self.call.observe_relative(self._x(int(t) + tokens, int(r) + 1), ttft_s * 1000.0)

    def terms(self) -> dict:
        c = self.call.coef
        return {
            "ready": self.ready,
            "samples": self.call.count,
            "per_call_ms": round(c[0], 3),
            "per_step_ms": round(c[1], 3),
            "per_token_ms": round(c[2] / 1000.0, 5),
            "room_per_release_ms": None if self.room_per_release_s is None else round(self.room_per_release_s * 1e3, 3),
            "room_samples": self.room_samples,
            "overhead_ms": round(self.overhead_s * 1000.0, 3),
        }
