"""A request's time to first token, predicted from the live queue state phase by phase (admission asks).

A request's TTFT at the router is the sum of three parts, each predicted from what the router knows:

- **decode-room wait** (disaggregated): a request is prefilled only once a decode worker has room for it
  (``server/router/decode_room.py``, first come first served). One that finds ``W`` requests waiting and
  ``F`` free slots waits for ``W + 1 - F`` slot releases; the time per release is measured (an EWMA of
  wait / releases over the requests that waited), so it is the decode side's completion rate as it is now.
- **prefill call**: from sending ``/internal/prefill`` to its answer (colocated, or a prefill on the decode
  worker: to the first token of the stream). The router replays each worker's scheduler on the calls it
  sent there (``WorkerSteps``): a worker computes steps first come first served under its budgets
  (``prefill.max_num_batched_tokens``, ``max_batch_size``); an idle one starts a step when a call arrives, a
  busy one starts the next when a step ends, and the first answer of a call in the running step marks that
  end. So a new call waits for the rest of the running step, then the steps of the calls waiting ahead of
  it, packed as the scheduler packs them, then its own step — which the calls arriving meanwhile join, up to
  the budgets (the measured arrival rate says how many). A step costs ``queued_prefill_ms`` of
  server/latency_model.py (per step + per request + per token: the planner's step model), its three
  coefficients fitted online on the steps so measured (answer - step start, with their tokens and
  requests), by non-negative least squares of the relative error with exponential forgetting (``FORGET``).
  Steps of late running slower or faster than the fit (a CPU that neighbours take or give back) scale every
  predicted step by a fast EWMA of measured / fitted step time (the fit itself needs many steps, and under
  overload a step holds many calls); what the replay misses per call (HTTP, KV staging) is a learned
  residual (the same fit, on measured - replayed).
- **overhead**: the rest of the measured TTFT (picking, the first token's way to the client): an EWMA.

Cheap on the hot path: a prediction is O(calls in flight) additions; a measurement a few multiply-adds,
and the 3x3 fit is re-solved every ``FIT_EVERY`` steps (all subsets of the terms, the best one with no
negative coefficient: a cost can not be negative, and an unconstrained fit extrapolates wildly). Until
``MIN_SAMPLES`` steps are measured there is no prediction (never a guess).

Without a pipeline attached (unit tests of admission alone) the whole TTFT is taken as the prefill call,
with the tokens that admission counted as queued ahead of the request, fitted as one line (``call_ms``).
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
SPEED_EWMA = 0.3  # weight of a new step in the speed factor
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


WAITING, IN_STEP, DONE = 0, 1, 2  # a call's place in its worker's steps, as the router replays them (WorkerSteps)


class Call:
    """One call in flight to a worker that ends with a request's first token (``TtftPredictor.call_started``)."""

    __slots__ = ("worker_id", "tokens", "ahead_tokens", "ahead_requests", "t0", "predicted_ms", "state", "open")

    def __init__(self, worker_id: str, tokens: int, ahead_tokens: int, ahead_requests: int, t0: float) -> None:
        self.worker_id, self.tokens = worker_id, tokens
        self.ahead_tokens, self.ahead_requests = ahead_tokens, ahead_requests
        self.t0 = t0
        self.predicted_ms: float | None = None  # what the step model said at its start (its bias is learned)
        self.state = WAITING
        self.open = True


class WorkerSteps:
    """The router's view of one worker's prefill steps, from the calls it sent there and their answers.

    The worker schedules first come first served under its budgets per step (``prefill.max_num_batched_tokens``,
    ``max_batch_size``): an idle worker starts a step when a call arrives; a busy one starts the next step
    when a step ends, with the calls waiting, oldest first, up to its budgets. The router replays that on the
    calls it sent: the first answer of a call in the running step ends that step (its duration, answer -
    start, is one measured step), the step's other calls are done (their answers are on the way), and the
    next step is formed from the waiting calls."""

    __slots__ = ("calls", "step_start", "budget")

    def __init__(self, budget: tuple[int, int]) -> None:
        self.calls: list[Call] = []  # outstanding, in the order sent
        self.step_start: float | None = None  # when the running step began (None: no step running)
        self.budget = budget  # (tokens, requests) per step

    def sums(self, state: int) -> tuple[int, int]:
        """Prompt tokens and requests of the calls in ``state`` (WAITING, IN_STEP)."""
        t = n = 0
        for c in self.calls:
            if c.state == state:
                t, n = t + c.tokens, n + 1
        return t, n

    def queue_ahead(self, own: int) -> tuple[int, int, int, int, int]:
        """(tokens, requests, steps, tokens and requests of the last step) the worker computes from the end of
        its running step until a new call of ``own`` tokens is done: the waiting calls and it, packed into
        steps as the scheduler packs them; the new call is in the last."""
        max_t, max_n = self.budget
        tokens = requests = steps = 0
        t = n = 0  # the step being packed
        for c in self.calls:
            if c.state == WAITING:
                if n and (n + 1 > max_n or t + c.tokens > max_t):
                    steps, t, n = steps + 1, 0, 0
                t, n = t + c.tokens, n + 1
                tokens, requests = tokens + c.tokens, requests + 1
        if n and (n + 1 > max_n or t + own > max_t):
            steps, t, n = steps + 1, 0, 0
        return tokens + own, requests + 1, steps + 1, t + own, n + 1

    def start_step(self, now: float) -> None:
        """Form the next step from the waiting calls, oldest first, up to the budgets."""
        max_t, max_n = self.budget
        t = n = 0
        for c in self.calls:
            if c.state != WAITING:
                continue
            if n and (n + 1 > max_n or t + c.tokens > max_t):
                break
            c.state = IN_STEP
            t, n = t + c.tokens, n + 1
        self.step_start = now if n else None

    def answered(self, c: Call, now: float) -> tuple[int, int, float] | None:
        """``c`` answered: (tokens, requests, seconds) of the step it ended, or None (a later answer of a
        step that already ended)."""
        ended = None
        if c.state != DONE:  # the first answer of its step (a waiting call answering: our view was behind)
            if c.state == WAITING:
                c.state = IN_STEP
            t, n = self.sums(IN_STEP)
            start = self.step_start if self.step_start is not None else c.t0
            ended = (t, n, max(0.0, now - start))
            for x in self.calls:
                if x.state == IN_STEP:
                    x.state = DONE
            self.step_start = None
        self.calls.remove(c)
        if self.step_start is None:
            self.start_step(now)
        return ended

    def failed(self, c: Call, now: float) -> None:
        self.calls.remove(c)
        if not any(x.state == IN_STEP for x in self.calls):
            self.step_start = None
            self.start_step(now)


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
    def __init__(self, cfg: DistServeConfig, workers, clock: Callable[[], float] = time.perf_counter) -> None:
        self.batched_tokens = cfg.prefill.max_num_batched_tokens
        self.batch_size = cfg.prefill.max_batch_size
        self.workers = workers  # how many workers share the prefill queue (admission's callback)
        self.clock = clock
        self.step = OnlineFit(3)  # a prefill step: x = (1, tokens / 1000, requests), y = ms
        # how much slower than the fit the last steps ran: an EWMA of log(measured / fitted) over steps, fast
        # (SPEED_EWMA), so a CPU that neighbours take or give back moves every prediction at the next step,
        # where the fit, which needs many steps, would lag (under overload a step holds many calls)
        self.log_speed = 0.0
        # what the replay misses per call (HTTP, KV staging): x = (1,), y = measured - replayed ms
        self.residual = OnlineFit(1)
        self.call = OnlineFit(4)  # without a pipeline: x = (1, steps, (ahead + own) / 1000, -ahead / 1000)
        self.arrival_gap_s = 0.0  # EWMA of the time between prefill calls (all workers)
        self.arrival_tokens = 0.0  # EWMA of their prompt tokens
        self.last_arrival: float | None = None
        self.room_per_release_s: float | None = None
        self.room_samples = 0
        self.overhead_s = 0.0
        self.overhead_samples = 0
        self.queues: dict[str, WorkerSteps] = {}  # worker id -> its calls in flight and its running step
        self.room: RoomState | None = None  # set by attach(): the pipeline reports the phases
        # relative errors of the two predicted parts (|measured - predicted| / measured), for GET /v1/admission
        self.call_errors: deque[float] = deque(maxlen=1024)
        self.room_errors: deque[float] = deque(maxlen=1024)

    @property
    def ready(self) -> bool:
        return (self.step if self.room is not None else self.call).count >= MIN_SAMPLES

    # --- the model --------------------------------------------------------------------------------
    def step_ms(self, tokens: int, requests: int) -> float:
        """The predicted engine time to prefill ``requests`` prompts of ``tokens`` in all, in as many steps as
        the worker's budgets need (``queued_prefill_ms``: per request, per step, per token)."""
        if requests <= 0:
            return 0.0
        c = self.step.coef
        steps = prefill_steps(tokens, requests, self.batched_tokens, self.batch_size)
        return queued_prefill_ms(tokens, steps, c[2] * requests, c[0], c[1] / 1000.0) * math.exp(self.log_speed)

    def worker_call_ms(self, ws: WorkerSteps | None, own: int, now: float) -> float:
        """The predicted prefill call of a request of ``own`` prompt tokens sent to this worker now: the
        replayed steps (``replay_ms``) plus the learned residual."""
        return self.replay_ms(ws, own, now) + self.residual.predict((1.0,))

    def replay_ms(self, ws: WorkerSteps | None, own: int, now: float) -> float:
        """The rest of the worker's running step, the steps of the calls waiting there, and this call's own
        step with the calls expected to join it."""
        if ws is None or ws.step_start is None:
            return self.step_ms(own, 1)
        t, n = ws.sums(IN_STEP)
        ms = max(0.0, (ws.step_start - now) * 1000.0 + self.step_ms(t, n))  # the rest of the running step
        t, n, steps, last_t, last_n = ws.queue_ahead(own)
        c = self.step.coef
        speed = math.exp(self.log_speed)
        ms += queued_prefill_ms(t, steps, c[2] * n, c[0], c[1] / 1000.0) * speed
        # calls that arrive before its step starts join it, up to the budgets: the arrival rate says how many
        before_ms = ms - self.step_ms(last_t, last_n)
        if self.arrival_gap_s > 0 and self.arrival_tokens > 0:
            max_t, max_n = ws.budget
            per_s = self.arrival_tokens / self.arrival_gap_s / max(1, self.workers())
            join_t = min(max_t - last_t, (max_n - last_n) * self.arrival_tokens, per_s * before_ms / 1000.0)
            if join_t > 0:
                ms += (c[1] / 1000.0 * join_t + c[2] * join_t / self.arrival_tokens) * speed
        return ms

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

    def best_call_ms(self, own: int) -> float:
        """The prefill call on the worker that would answer first (an idle one when a serving worker has
        nothing in flight from here)."""
        now = self.clock()
        idle = len(self.queues) < self.workers()
        best = self.worker_call_ms(None, own, now) if idle or not self.queues else math.inf
        for ws in self.queues.values():
            best = min(best, self.worker_call_ms(ws, own, now))
        return best

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
        room = 0.0
        releases = self.room.releases_needed()
        if releases and self.room_per_release_s is not None:
            room = releases * self.room_per_release_s
        return room, self.best_call_ms(own_tokens) / 1000.0, self.overhead_s

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
        now = self.clock()
        if self.last_arrival is not None:
            gap = now - self.last_arrival
            self.arrival_gap_s = gap if not self.arrival_gap_s else (1 - EWMA) * self.arrival_gap_s + EWMA * gap
        self.arrival_tokens = tokens if not self.arrival_tokens else (1 - EWMA) * self.arrival_tokens + EWMA * tokens
        self.last_arrival = now
        ws = self.queues.get(worker_id)
        if ws is None:
            ws = self.queues[worker_id] = WorkerSteps((self.batched_tokens, self.batch_size))
        t = sum(c.tokens for c in ws.calls)
        c = Call(worker_id, tokens, t, len(ws.calls), now)
        if self.step.count >= MIN_SAMPLES:
            c.predicted_ms = self.replay_ms(ws, tokens, now)
        ws.calls.append(c)
        if ws.step_start is None:  # nothing computing there: a step starts with this call
            ws.start_step(now)
        return c

    def call_ended(self, c: Call, ok: bool, phases: RequestPhases | None = None) -> None:
        """The call answered with the first token (``ok``) or failed; released once however often called."""
        if not c.open:
            return
        c.open = False
        now = self.clock()
        ws = self.queues.get(c.worker_id)
        if ws is not None:
            if ok:
                step = ws.answered(c, now)
                if step is not None and step[1]:
                    t, n, secs = step
                    x = (1.0, t / 1000.0, float(n))
                    fitted = self.step.predict(x)
                    if self.step.count >= MIN_SAMPLES and fitted > 0 and secs > 0:
                        r = max(-2.0, min(2.0, math.log(secs * 1000.0 / fitted)))
                        self.log_speed = (1 - SPEED_EWMA) * self.log_speed + SPEED_EWMA * r
                    self.step.observe_relative(x, secs * 1000.0)
            else:
                ws.failed(c, now)
            if not ws.calls:
                del self.queues[c.worker_id]
        if not ok:
            return
        ms = (now - c.t0) * 1000.0
        if phases is not None:
            phases.call_s = ms / 1000.0
        if c.predicted_ms is not None:  # weighed relative to the call, as the step fit
            self.residual.observe((1.0,), ms - c.predicted_ms, 1.0 / max(1.0, ms) ** 2)

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

    def ahead(self) -> tuple[int, int]:
        """Prompt tokens and requests in flight on the least-loaded worker (0, 0 when one has none)."""
        if len(self.queues) < self.workers() or not self.queues:
            return 0, 0
        return min((sum(c.tokens for c in ws.calls), len(ws.calls)) for ws in self.queues.values())

    def terms(self) -> dict:
        c, s = self.call.coef, self.step.coef
        return {
            "ready": self.ready,
            "samples": self.step.count if self.room is not None else self.call.count,
            "step_per_step_ms": round(s[0], 3),
            "step_per_token_ms": round(s[1] / 1000.0, 5),
            "step_per_request_ms": round(s[2], 3),
            "step_samples": self.step.count,
            "step_speed_ratio": round(math.exp(self.log_speed), 4),
            "residual_per_call_ms": round(self.residual.coef[0], 3),
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
