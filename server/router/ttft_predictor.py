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
  coefficients (per call: HTTP and KV staging; per step; per token), less a discount per token ahead (a
  prompt ahead may be in a step already under way, or share this one's step, so it adds less than a step
  of its own; a line through total tokens over-predicted every request that found one ahead), all fitted
  online, by non-negative least squares of the relative error with exponential forgetting (``FORGET``) over
  every call's (steps, tokens, duration): the fit follows
  the machine as it is now (neighbours, threads, the model) and is not skewed by the decode-room wait, which
  one line through (tokens ahead, TTFT) mixed in.
- **overhead**: the rest of the measured TTFT (picking, the first token's way to the client): an EWMA.

Cheap on the hot path: a prediction is O(workers); a measurement is a few multiply-adds, and the 4x4 fit is
re-solved every ``FIT_EVERY`` calls (all 15 subsets of the four terms, the best one with no negative
coefficient: a cost can not be negative, and an unconstrained fit extrapolates wildly). Until ``MIN_SAMPLES``
calls are measured there is no prediction (never a guess).

Without a pipeline attached (unit tests of admission alone) the whole TTFT is taken as the prefill call, with
the tokens that admission counted as queued ahead of the request.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from server.config import DistServeConfig
from server.latency_model import prefill_steps, queued_prefill_ms

MIN_SAMPLES = 8
FORGET = 0.97  # per call: a sample's weight halves after about 23 calls (a shared CPU changes quickly)
FIT_EVERY = 4  # re-solve the fit every this many calls (every call for the first 32)
EWMA = 0.1  # weight of a new sample in the decode-room and overhead averages
ROOM_ERROR_MIN_S = 0.01  # decode-room waits shorter than this are not judged by their relative error


class RoomState(Protocol):
    """What the decode-room gate tells the predictor (``DecodeRoom``)."""

    def releases_needed(self) -> int: ...


class RequestPhases:
    """One admitted request's measured parts, filled in by the pipeline as it goes."""

    __slots__ = ("room_s", "call_s", "predicted")

    def __init__(self) -> None:
        self.room_s = 0.0
        self.call_s: float | None = None
        self.predicted: tuple[float, float, float] | None = None  # (room, call, overhead) seconds, at admission


class Call:
    """One call in flight to a worker that ends with a request's first token (``TtftPredictor.call_started``)."""

    __slots__ = ("worker_id", "tokens", "ahead_tokens", "ahead_requests", "streams", "t0", "open")

    def __init__(self, worker_id: str, tokens: int, ahead_tokens: int, ahead_requests: int, streams: int) -> None:
        self.worker_id, self.tokens, self.streams = worker_id, tokens, streams
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
        self.call = OnlineFit(4)  # x = (1, steps, (ahead + own) / 1000, -ahead / 1000), y = ms
        # calls that found nothing ahead: x = (1, own / 1000, streams / 100), y = ms; the streams being decoded
        # are a proxy for the CPU the router and the workers' other work take (the router shares a core with
        # the prefill worker on CPU)
        self.alone = OnlineFit(3)
        self.streams: Callable[[], int] = lambda: 0  # requests past their first token (admission's counts)
        self.behind = OnlineFit(2)  # the rest, over `alone`: x = (ahead / 1000, ahead requests), y = ms more
        self.room_per_release_s: float | None = None
        self.room_samples = 0
        self.overhead_s = 0.0
        self.overhead_samples = 0
        self.outstanding: dict[str, list[int]] = {}  # worker id -> [prompt tokens, requests] sent, no answer yet
        self.room: RoomState | None = None  # set by attach(): the pipeline reports the phases
        # relative errors of the two predicted parts (|measured - predicted| / measured), for GET /v1/admission
        self.call_errors: deque[float] = deque(maxlen=1024)
        self.room_errors: deque[float] = deque(maxlen=1024)

    @property
    def ready(self) -> bool:
        return self.call.count >= MIN_SAMPLES

    @property
    def attached(self) -> bool:
        return self.room is not None

    # --- the model --------------------------------------------------------------------------------
    def _x(self, ahead: int, ahead_requests: int, own: int) -> tuple[float, float, float, float]:
        steps = prefill_steps(ahead + own, ahead_requests + 1, self.batched_tokens, self.batch_size)
        return (1.0, float(steps), (ahead + own) / 1000.0, -ahead / 1000.0)

    def split(self, ahead_requests: int) -> bool:
        """Whether the two-part model (alone + behind) has the measurements to predict this call."""
        return self.alone.count >= MIN_SAMPLES and (ahead_requests == 0 or self.behind.count >= MIN_SAMPLES)

    def call_ms(self, ahead: int, ahead_requests: int, own: int, streams: int = 0) -> float:
        """The predicted prefill call of a request of ``own`` prompt tokens that finds ``ahead`` tokens of
        ``ahead_requests`` requests queued on its worker: what such a call costs on an idle worker, plus what
        the queue ahead adds (both fitted on their own calls, ``split``); until both have measurements, one
        fit over every call, in which tokens ahead may cost less than the request's own (the
        ``ahead_discount``: some are in a step already under way, the rest share its step) but never less
        than nothing."""
        if self.split(ahead_requests):
            ms = self.alone.predict((1.0, own / 1000.0, streams / 100.0))
            if ahead_requests:
                ms += self.behind.predict((ahead / 1000.0, float(ahead_requests)))
            return ms
        c = self.call.coef
        steps = prefill_steps(ahead + own, ahead_requests + 1, self.batched_tokens, self.batch_size)
        discount = min(c[3], c[2]) * ahead
        return queued_prefill_ms(ahead + own, steps, c[0], c[1], c[2] / 1000.0) - discount / 1000.0

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
        parts = self.predict_parts(own_tokens, fallback_ahead)
        return None if parts is None else sum(parts)

    def predict_parts(
        self, own_tokens: int, fallback_ahead: tuple[float, float] = (0.0, 0.0)
    ) -> tuple[float, float, float] | None:
        """(decode-room wait, prefill call, overhead) predicted for a request admitted now, in seconds."""
        if not self.ready:
            return None
        if self.room is None:
            t, r = fallback_ahead
            return 0.0, self.call_ms(int(t), int(r), own_tokens) / 1000.0, 0.0
        t, r = self.ahead()
        ms = self.call_ms(t, r, own_tokens, self.streams())
        room = 0.0
        releases = self.room.releases_needed()
        if releases and self.room_per_release_s is not None:
            room = releases * self.room_per_release_s
        return room, ms / 1000.0, self.overhead_s

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
        c = Call(worker_id, tokens, o[0], o[1], self.streams())
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
        self._observe_call(c.ahead_tokens, c.ahead_requests, c.tokens, dur * 1000.0, c.streams)

    def _observe_call(self, ahead: int, ahead_requests: int, own: int, ms: float, streams: int = 0) -> None:
        self.call.observe_relative(self._x(ahead, ahead_requests, own), ms)
        x_alone = (1.0, own / 1000.0, streams / 100.0)
        if ahead_requests == 0:
            self.alone.observe_relative(x_alone, ms)
        elif self.alone.count >= MIN_SAMPLES:  # what the queue added, weighed relative to the whole call
            guess = self.call_ms(ahead, ahead_requests, own, streams) if self.split(ahead_requests) else ms
            self.behind.observe(
                (ahead / 1000.0, float(ahead_requests)), ms - self.alone.predict(x_alone), 1.0 / max(1.0, guess) ** 2
            )

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
        elif not self.attached:  # no pipeline to report the parts: the whole TTFT is the call
            t, r = ahead
            self._observe_call(int(t), int(r), tokens, ttft_s * 1000.0)

    def terms(self) -> dict:
        c = self.call.coef
        a, b = self.alone.coef, self.behind.coef
        return {
            "ready": self.ready,
            "samples": self.call.count,
            "alone_per_call_ms": round(a[0], 3),
            "alone_per_token_ms": round(a[1] / 1000.0, 5),
            "alone_per_stream_ms": round(a[2] / 100.0, 4),
            "alone_samples": self.alone.count,
            "behind_per_token_ms": round(b[0] / 1000.0, 5),
            "behind_per_request_ms": round(b[1], 3),
            "behind_samples": self.behind.count,
            "per_call_ms": round(c[0], 3),
            "per_step_ms": round(c[1], 3),
            "per_token_ms": round(c[2] / 1000.0, 5),
            "ahead_discount_per_token_ms": round(min(c[3], c[2]) / 1000.0, 5),
            "room_per_release_ms": None if self.room_per_release_s is None else round(self.room_per_release_s * 1e3, 3),
            "room_samples": self.room_samples,
            "overhead_ms": round(self.overhead_s * 1000.0, 3),
        }

    def part_errors(self) -> dict:
        return {"prefill_call": quantiles(self.call_errors), "decode_room": quantiles(self.room_errors)}


def quantiles(errors: Iterable[float]) -> dict:
    """Samples, median and P90 (nearest rank) of relative errors."""
    s = sorted(errors)

    def q(p: float) -> float | None:
        return round(s[min(len(s) - 1, math.ceil(p * len(s)) - 1)], 4) if s else None

    return {"samples": len(s), "median": q(0.5), "p90": q(0.9)}
