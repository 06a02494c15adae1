"""Discrete-event model of the server: router, prefill queue and batching, KV transfer, decode batching.

What it simulates, with the server's own policies (``server/engine/scheduler.py``):
- each worker runs one engine step at a time; a step serves running sequences first (one token per decode,
  a chunk of at most the remaining token budget per unfinished prefill), then admits waiting prompts while
  the token budget (``max_num_batched_tokens``) and ``max_num_seqs`` allow (chunked prefill: the last
  admitted prompt may get a partial chunk); prefill workers admit shortest-first with aging (``wfs``),
  decode workers serve fewest-remaining first; the step's duration comes from ``planner.latency``;
- the router sends each request to the least-loaded worker of each role, charging a decode worker from
  the pick; disaggregated: prefill (token #1), then the decode worker reserves a slot (back-pressure
  while it has ``max_num_seqs`` sequences), pulls the KV (``kv_ms(bytes)``) and decodes the rest; the
  hand-off itself (router -> decode worker request, reservation, scatter, stream back) costs ``handoff_ms``
  and then ``handoff_steps`` engine steps of a busy decode worker (its handlers resume only between steps,
  one await per step; an idle worker runs them at once);
- a prefill worker's reply leaves after the *next* step when it has more work (the engine step runs on the
  worker's event loop, so the handler awaiting the staged KV resumes only between steps; measured in
  docs/performance/serving-two-gpus.md); with the engine on its own thread (``reply_after_next_step=False``, the
  CUDA default) it leaves at the end of its own step;
- a prefill worker's host work between steps (KV staging, replies, the next requests' HTTP handlers):
  ``prefill_post_ms`` per prompt a step finished; the next step and those replies wait for it;
- a fixed serving-path cost (``overhead_ttft_ms``) on every TTFT;
- a new request reaches a busy colocated worker's scheduler only after ``admit_steps`` step ends (its HTTP
  handler's awaits resume between engine steps, behind the streaming of the whole batch's tokens; 1 = at the
  next step; an idle worker takes it at once). Prefill workers stream nothing between steps: not applied.
- KV capacity (when the config fixes it): a sequence holds prompt + output tokens from admission (decode:
  from its reservation) to its end, and waits while they do not fit.
- one GPU split between a prefill and a decode worker as MPS clients (``layout.sm_split``): each step runs on
  its worker's share of the SMs; where the shares overlap (P + D > 100) and both workers are in a step at once,
  each runs on ``planner.sm_shares.contended_share`` (the SMs divided in proportion to the shares), and a step
  in progress is re-timed whenever the other worker starts or ends one (its remaining work, in ms on its own
  share, proceeds at step(own share) / step(contended share)); a prefill worker's host work between steps
  (``prefill_post_ms``) leaves the decode worker its own share;
- (replays of recorded runs only, ``cold_mixed_steps``) a fresh colocated worker's first mixed steps each cost
  a measured stall more (first-use kernel builds of its eager mixed-step path).
It ignores: preemption (admission waits instead), prefix caching, the router's and the client's CPU, network
jitter, contention between concurrent KV pulls, and sampling (output lengths are exact, as with ignore_eos).
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from distserve.planner.latency import LatencyModel
from distserve.planner.layouts import EngineLimits, Layout
from distserve.planner.sm_shares import contended_share


@dataclass
class SimRequest:
    index: int
    arrival: float  # ms
    prompt: int
    output: int
    computed: int = 0  # prompt tokens computed on the current worker
    tokens: int = 0  # output tokens produced
    first_token_at: float = math.nan
    done_at: float = math.nan
    reply_ready: bool = False

    def latencies(self, overhead_ms: float) -> dict[str, float]:
        ttft = self.first_token_at - self.arrival + overhead_ms
        e2e = self.done_at - self.arrival + overhead_ms
        out = {"ttft": ttft, "e2el": e2e}
        if self.output > 1:
            out["tpot"] = (e2e - ttft) / (self.output - 1)
        return out


@dataclass
class Worker:
    role: str  # prefill | decode | colocated
    index: int
    limits: EngineLimits
    threads: int
    neighbours: int
    sm_share: int = 100  # % of the GPU's SMs (an MPS split)
    waiting: list[SimRequest] = field(default_factory=list)
    running: list[SimRequest] = field(default_factory=list)
    blocked: list[SimRequest] = field(default_factory=list)  # decode: waiting for a reservation
    joining: list[list] = field(default_factory=list)  # [request, steps left, "running" | "waiting"] in handlers
    cold_left: int = 0  # colocated: mixed steps that still pay the cold-start stall
    reserved: int = 0  # decode: slots reserved for KV in flight
    kv_used: int = 0  # tokens of KV held (prompt + output of every admitted sequence)
    assigned: int = 0  # router's load count
    busy: bool = False
    kick_pending: bool = False
    busy_ms: float = 0.0
    steps: int = 0
    seqs_in_steps: int = 0  # summed over steps: the mean batch is seqs_in_steps / steps
    prefill_seqs: int = 0  # prefill chunks summed over steps (a prompt split over k steps counts k times)
    continuations: int = 0  # chunked-prefill continuations (a chunk resuming a prompt over its cached context)
    prefill_steps: int = 0  # steps with at least one prefill chunk
    # an overlapping MPS split (P + D > 100): the other client on the GPU, and this worker's step in progress,
    # re-timed whenever the other starts or ends a step (``Simulator._retime``)
    peer: Worker | None = field(default=None, repr=False, compare=False)
    in_step: bool = False
    step_plan: tuple = ()  # (prefill chunks, decode batch, context, cold stall ms) of the step in progress
    step_left: float = 0.0  # of the step, in ms on its own share
    step_rate: float = 1.0  # ms of own-share work done per ms now
    step_mark: float = 0.0  # when step_left was last brought up to date
    step_gen: int = 0  # the step_end event that counts (earlier ones were re-timed away)
    step_duty: float = 1.0  # the part of the step its GPU work fills (a host-bound prefill step: less than 1)
    step_started: float = 0.0
    step_scheduled: list = field(default_factory=list, repr=False)
    post_ms: float = 0.0  # prefill: host work between steps (``prefill_post_ms`` per finished prompt)
    replies: list[SimRequest] = field(default_factory=list)  # prefill: finished, reply after next step


@dataclass(frozen=True)
class SimResult:
    latencies: tuple[dict[str, float], ...]
    duration_ms: float
    utilization: dict[str, float]  # role -> mean busy share of its workers
    mean_batch: dict[str, float]  # role -> sequences per step
    mean_ttft_ms: float
    mean_tpot_ms: float
    prefill_stats: dict[str, float] = field(default_factory=dict)  # prefill steps, sequences and continuations
    step_ms: dict[str, float] = field(default_factory=dict)  # role -> mean engine step (busy ms / steps)


class Simulator:
    def __init__(
        self,
        model: LatencyModel,
        layout: Layout,
        kv_bytes_per_token: int,
        overhead_ttft_ms: float = 0.0,
        reply_after_next_step: bool = True,
        device: str = "cuda",
        handoff_ms: float = 0.0,
        handoff_steps: int = 0,
        cold_mixed_steps: tuple[int, float] = (0, 0.0),
        admit_steps: int = 0,
        prefill_post_ms: float = 0.0,
    ) -> None:
        self.model, self.layout = model, layout
        self.prefill_post_ms = prefill_post_ms
        self.handoff_steps = handoff_steps
        self.admit_steps = admit_steps
        self.cold_stall_ms = cold_mixed_steps[1]
        self.kv_bytes_per_token = kv_bytes_per_token
        self.overhead = overhead_ttft_ms
        self.reply_after_next_step = reply_after_next_step
        self.handoff_ms = handoff_ms
        many = 1 if layout.workers > 1 else 0
        if layout.mode == "colocated":
            self.prefill: list[Worker] = []
            self.decode = [
                Worker("colocated", i, layout.decode, layout.decode_threads, many) for i in range(layout.num_decode)
            ]
        else:
            pct, dct = layout.sm_split or (100, 100)
            self.prefill = [
                Worker("prefill", i, layout.prefill, layout.prefill_threads, many, pct)
                for i in range(layout.num_prefill)
            ]
            self.decode = [
                Worker("decode", i, layout.decode, layout.decode_threads, many, dct) for i in range(layout.num_decode)
            ]
        for w in self.decode if layout.mode == "colocated" else ():
            w.cold_left = cold_mixed_steps[0]
        if layout.sm_split and sum(layout.sm_split) > 100 and len(self.prefill) == len(self.decode) == 1:
            # overlapping shares: while both are in a step they divide the SMs (planner.sm_shares.contended_share)
            self.prefill[0].peer, self.decode[0].peer = self.decode[0], self.prefill[0]
        self._events: list[tuple[float, int, str, Any]] = []
        self._seq = 0
        self.now = 0.0
        self._decode_of: dict[int, Worker] = {}

    # --- events -------------------------------------------------------------------------------------
    def _at(self, t: float, kind: str, obj: Any) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, obj))

    def run(self, requests: Sequence[tuple[float, int, int]]) -> SimResult:
        """``requests``: (arrival ms, prompt tokens, output tokens); all run to completion."""
        reqs = [SimRequest(i, a, p, o) for i, (a, p, o) in enumerate(requests)]
        for r in reqs:
            self._at(r.arrival, "arrive", r)
        while self._events:
            self.now, _, kind, obj = heapq.heappop(self._events)
            if kind == "arrive":
                self._arrive(obj)
            elif kind == "step_end":
                w, scheduled, gen = obj
                if gen == w.step_gen:  # else re-timed: a later event ends this step
                    self._step_end(w, scheduled)
            elif kind == "kick":
                obj.kick_pending = False
                self._start_step(obj)
            elif kind == "post_end":  # a prefill worker's host work between steps is done: replies leave
                w, ready = obj
                w.busy = False
                for s in ready:
                    self._reply(s)
                self._kick(w)
            elif kind == "kv_done":
                req, w = obj
                w.reserved -= 1
                if w.busy and self.handoff_steps > 0:
                    w.joining.append([req, self.handoff_steps, "running"])
                else:
                    w.running.append(req)
                    self._kick(w)
        end = max((r.done_at for r in reqs), default=0.0)
        start = min((r.arrival for r in reqs), default=0.0)
        lat = tuple(r.latencies(self.overhead) for r in reqs)
        util, batch, step = {}, {}, {}
        for role, ws in (("prefill", self.prefill), ("decode", self.decode)):
            if ws and end > start:
                name = role if self.layout.mode == "disaggregated" else "colocated"
                util[name] = sum(w.busy_ms for w in ws) / len(ws) / (end - start)
                batch[name] = sum(w.seqs_in_steps for w in ws) / max(1, sum(w.steps for w in ws))
                step[name] = sum(w.busy_ms for w in ws) / max(1, sum(w.steps for w in ws))
        tpots = [x["tpot"] for x in lat if "tpot" in x]
        pw = self.prefill or self.decode
        stats = {
            "steps": float(sum(w.prefill_steps for w in pw)),
            "seqs": float(sum(w.prefill_seqs for w in pw)),
            "continuations": float(sum(w.continuations for w in pw)),
            "busy_ms": float(sum(w.busy_ms for w in pw)),
            "post_ms": float(sum(w.post_ms for w in pw)),
        }
        return SimResult(
            lat,
            end - start,
            util,
            batch,
            sum(x["ttft"] for x in lat) / max(1, len(lat)),
            sum(tpots) / max(1, len(tpots)),
            stats,
            step,
        )

    def _least(self, ws: list[Worker]) -> Worker:
        return min(ws, key=lambda w: (w.assigned, w.index))

    def _arrive(self, r: SimRequest) -> None:
        d = self._least(self.decode)
        d.assigned += 1
        if self.layout.mode == "colocated":
            if d.busy and self.admit_steps > 0:
                d.joining.append([r, self.admit_steps, "waiting"])
            else:
                d.waiting.append(r)
                self._kick(d)
            return
        self._decode_of[r.index] = d
        p = self._least(self.prefill)
        p.assigned += 1
        p.waiting.append(r)
        self._kick(p)

    # --- one engine step ----------------------------------------------------------------------------
    def _kick(self, w: Worker) -> None:
        """Start a step once every event of this instant is in (simultaneous arrivals share a step)."""
        if not w.busy and not w.kick_pending:
            w.kick_pending = True
            self._at(self.now, "kick", w)

    def _start_step(self, w: Worker) -> None:
        if w.busy:
            return
        plan = self._schedule(w)
        if plan is None and w.joining:  # idle: the handlers run at once
            self._join(w, [j for j in w.joining])
            plan = self._schedule(w)
        if plan is None:
            self._flush_replies(w)
            return
        chunks, decodes, ctx, scheduled = plan
        dt = self.model.step_ms(chunks, len(decodes), ctx, w.threads, w.neighbours, w.sm_share)
        stall = 0.0
        if w.cold_left and chunks and decodes:
            w.cold_left -= 1
            stall = self.cold_stall_ms
            dt += stall
        w.busy = True
        w.steps += 1
        w.seqs_in_steps += len(scheduled)
        if chunks:
            w.prefill_steps += 1
            w.prefill_seqs += len(chunks)
            w.continuations += sum(1 for _, before in chunks if before > 0)
        if w.peer is None:
            w.busy_ms += dt
            self._at(self.now + dt, "step_end", (w, scheduled, w.step_gen))
            return
        w.in_step, w.step_started, w.step_mark = True, self.now, self.now
        w.step_plan = (chunks, len(decodes), ctx, stall)
        w.step_duty = self.model.gpu_fraction(chunks, len(decodes), ctx, w.sm_share)
        w.step_left, w.step_rate = dt, 1.0
        w.step_scheduled = scheduled
        self._retime(w)
        self._retime(w.peer)

    def _retime(self, w: Worker) -> None:
        """Bring ``w``'s step in progress up to date and reschedule its end at the speed it has from now on: on
        its own share while the other client of an overlapping split is between steps; while the other is in a
        step, on the contended share (``contended_share``) for the part of that step its GPU work fills
        (``gpu_fraction``; a host-bound prefill step leaves the SMs idle the rest of the time) and on its own share
        for the rest. Speed = the step's time on its own share / on the contended one, blended that way."""
        if not w.in_step or w.peer is None:
            return
        w.step_left = max(0.0, w.step_left - (self.now - w.step_mark) * w.step_rate)
        w.step_mark = self.now
        chunks, batch, ctx, extra = w.step_plan
        w.step_rate = 1.0
        if w.peer.in_step:
            own = self.model.step_ms(chunks, batch, ctx, w.threads, w.neighbours, w.sm_share) + extra
            share = contended_share(w.sm_share, w.peer.sm_share)
            slow = self.model.step_ms(chunks, batch, ctx, w.threads, w.neighbours, share) + extra
            if slow > 0:
                w.step_rate = 1.0 - w.peer.step_duty + w.peer.step_duty * own / slow
        w.step_gen += 1
        self._at(self.now + w.step_left / w.step_rate, "step_end", (w, w.step_scheduled, w.step_gen))

    def _schedule(self, w: Worker):
        lim = w.limits
        budget = lim.max_num_batched_tokens
        if lim.decode_policy == "fewest_remaining":
            order = sorted(w.running, key=lambda s: (s.output - s.tokens, s.arrival))
        else:
            order = sorted(w.running, key=lambda s: s.arrival)
        chunks: list[tuple[int, int]] = []
        decodes: list[SimRequest] = []
        scheduled: list[tuple[SimRequest, int]] = []
        ctx = 0
        for s in order:
            if budget <= 0:
                break
            if s.computed < s.prompt:
                n = min(s.prompt - s.computed, budget)
                chunks.append((n, s.computed))
                scheduled.append((s, n))
            else:
                n = 1
                decodes.append(s)
                ctx += s.prompt + s.tokens
                scheduled.append((s, 0))
            budget -= n
        while w.waiting and budget > 0 and len(w.running) < lim.max_num_seqs:
            s = self._next_waiting(w)
            if not self._fits(w, s):
                break
            w.waiting.remove(s)
            w.kv_used += self._kv_need(w, s)
            n = min(s.prompt - s.computed, budget)
            w.running.append(s)
            chunks.append((n, s.computed))
            scheduled.append((s, n))
            budget -= n
        if not scheduled:
            return None
        return chunks, decodes, ctx, scheduled

    @staticmethod
    def _kv_need(w: Worker, s: SimRequest) -> int:
        return s.prompt + (1 if w.role == "prefill" else s.output)

    def _fits(self, w: Worker, s: SimRequest) -> bool:
        cap = w.limits.kv_tokens
        return cap <= 0 or w.kv_used + self._kv_need(w, s) <= cap or (w.kv_used == 0)

    def _next_waiting(self, w: Worker) -> SimRequest:
        if w.limits.prefill_policy == "fcfs":
            return w.waiting[0]
        aging = w.limits.aging_tokens_per_s / 1000.0  # per ms
        return min(w.waiting, key=lambda s: (s.prompt - s.computed) - aging * (self.now - s.arrival))

    def _step_end(self, w: Worker, scheduled: list[tuple[SimRequest, int]]) -> None:
        w.busy = False
        if w.in_step:  # an overlapping split: the other client has the SMs to itself from now
            w.in_step = False
            w.busy_ms += self.now - w.step_started
            self._retime(w.peer)  # type: ignore[arg-type]
        ready = w.replies
        w.replies = []
        for s, n in scheduled:
            if n:  # a prefill chunk
                s.computed += n
                if s.computed < s.prompt:
                    continue
                s.tokens = 1
                if w.role == "prefill":
                    w.running.remove(s)
                    w.assigned -= 1
                    w.kv_used -= self._kv_need(w, s)
                    if self.reply_after_next_step:
                        w.replies.append(s)
                    else:
                        ready.append(s)
                    continue
                s.first_token_at = self.now
            else:
                s.tokens += 1
            if s.tokens >= s.output:
                s.done_at = self.now
                w.running.remove(s)
                w.assigned -= 1
                w.kv_used -= self._kv_need(w, s)
                self._admit_blocked(w)
        for j in w.joining:
            j[1] -= 1
        self._join(w, [j for j in w.joining if j[1] <= 0])
        finished = sum(1 for s, n in scheduled if n and s.computed >= s.prompt)
        if w.role == "prefill" and self.prefill_post_ms > 0 and finished:
            # the worker's host work between steps (KV staging, replies, the next requests' HTTP) holds the
            # next step back, and the replies leave when it is done
            w.busy = True
            w.post_ms += self.prefill_post_ms * finished
            self._at(self.now + self.prefill_post_ms * finished, "post_end", (w, ready))
            return
        for s in ready:
            self._reply(s)
        self._kick(w)

    @staticmethod
    def _join(w: Worker, done: list[list]) -> None:
        """Requests whose handlers finished: hand-offs start decoding, arrivals queue for admission."""
        for j in done:
            w.joining.remove(j)
            (w.running if j[2] == "running" else w.waiting).append(j[0])

    def _flush_replies(self, w: Worker) -> None:
        ready, w.replies = w.replies, []
        for s in ready:
            self._reply(s)

    def _reply(self, s: SimRequest) -> None:
        """The prefill worker answered: token #1 reaches the client, the decode worker takes over."""
        s.first_token_at = self.now
        if s.tokens >= s.output:
            s.done_at = self.now
            self._decode_of[s.index].assigned -= 1
            return
        d = self._decode_of[s.index]
        d.blocked.append(s)
        self._admit_blocked(d)

    @staticmethod
    def _slots_held(d: Worker) -> int:
        return len(d.running) + d.reserved + sum(1 for j in d.joining if j[2] == "running")

    def _admit_blocked(self, d: Worker) -> None:
        """A hand-off holds its decode slot from its reservation through the pull and its handler (``joining``)
        until it runs, as the engine's reservation does: the batch never exceeds ``max_num_seqs``."""
        while d.blocked and self._slots_held(d) < d.limits.max_num_seqs and self._fits(d, d.blocked[0]):
            s = d.blocked.pop(0)
            d.reserved += 1
            d.kv_used += self._kv_need(d, s)
            pull = self.model.kv_ms(self.kv_bytes_per_token * s.prompt)
            self._at(self.now + self.handoff_ms + pull, "kv_done", (s, d))


def poisson_arrivals(n: int, rate_per_s: float, seed: int = 0) -> list[float]:
    """Arrival times (ms) of a Poisson process; the same seed gives the same unit gaps at every rate, so
    attainment changes smoothly with the rate (common random numbers)."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(1.0) * 1000.0 / rate_per_s
        out.append(t)
    return out


def simulate(
    model: LatencyModel,
    layout: Layout,
    lengths: Sequence[tuple[int, int]],
    rate_per_s: float,
    kv_bytes_per_token: int,
    overhead_ttft_ms: float = 0.0,
    seed: int = 0,
    handoff_ms: float = 0.0,
    handoff_steps: int = 0,
    admit_steps: int = 0,
    engine_thread: bool = False,
    prefill_post_ms: float = 0.0,
) -> SimResult:
    arrivals = poisson_arrivals(len(lengths), rate_per_s, seed)
    reqs = [(a, p, o) for a, (p, o) in zip(arrivals, lengths, strict=True)]
    sim = Simulator(
        model,
        layout,
        kv_bytes_per_token,
        overhead_ttft_ms,
        reply_after_next_step=not engine_thread,
        handoff_ms=handoff_ms,
        handoff_steps=handoff_steps,
        admit_steps=admit_steps,
        prefill_post_ms=prefill_post_ms,
    )
    return sim.run(reqs)
