"""Admission: bounded queues and SLO-aware admission, decided per request before it reaches a worker.

The router counts what it has admitted (``router.admission``), its own ledger: requests in flight, requests
still waiting for their first token (*queued*), those requests' prompt tokens (*queued prefill tokens*), and
those of them not yet given a decode slot (*unplaced*). Each count is taken at admission and released exactly
once by the request's ``Ticket`` (unplaced when the decode-room gate grants it a slot or at its first token,
queued at its first token, in flight at its end, whatever the end: failure, client gone, a 4xx raised after
admission). The ledger, not the workers' heartbeats, is what the prediction reads: the requests of a burst
are decided before the ones admitted a moment earlier reach the gate or a worker, so request k of a burst is
predicted behind the k - 1 admitted before it (read from the gate alone, a whole burst was admitted:
docs/performance/overload.md). A request
that would push a count past its bound is not admitted: it gets **429 with Retry-After** in OpenAI's
rate-limit shape, or goes to the backup pool (``on_full: backup``). Overload therefore never becomes an
unbounded wait, a silent drop or a 5xx.

SLO-aware: each request may carry ``x-slo-ttft-ms`` / ``x-slo-tpot-ms`` (llm-d's names; defaults
``slo_ttft_ms``/``slo_tpot_ms``). The router predicts its TTFT from the live queue state: the prompt tokens
admitted before it and still queued x the measured cost per token, never less than the wait for decode room
plus an idle worker's prefill call, plus the router's own part, each calibrated online on what the pipeline
measures (server/router/ttft_predictor.py, with the prefill formula of server/latency_model.py). TPOT is
predicted as the recent measured TPOT (an EWMA). A TTFT SLO bounds a tail and the prediction is a median,
so the prediction is compared with the SLO times a margin: the P95 of measured / predicted TTFT of the
requests admission judged lately (``TtftPredictor.slo_margin``, 1 to 4; 1.5 until 16 were judged).
A request admitted keeps its slack (SLO - prediction x margin); under shortest first, each later prompt the order
puts ahead of it takes its own prefill work off that slack, and one that would make it miss is refused
(``slo_ttft_overtakes``: ``Admission.overtaking``, ``router.admission.protect_admitted``).
When a prediction misses the SLO the request is shed (429), queued anyway (``on_slo_miss: queue``, or the
client's ``x-slo-on-miss: queue``), or sent to the backup pool — except when nothing is queued and no decode
room is waited for: then a request is admitted whatever the prediction (it is also the next measurement, so a
model that overestimates corrects itself instead of shedding for ever; a wait for decode room is the slots
held by admitted requests, real, and measured again as they end). That exemption is the TTFT model's: a TPOT SLO
is judged whenever a stream is in flight (the batch the request joins), and only with none in flight is a
request admitted whatever its TPOT SLO.
Without any SLO a request predicted to wait longer than ``max_predicted_ttft_s`` is still
refused: no admitted request waits without bound. Without a prediction (the model has not measured a few
prefill calls yet, or the request would wait for decode room before any wait or slot holding time was
measured, and no stream holding a slot says when one frees: the room prior of ttft_predictor.py) a request
is admitted only if it starts soon (within the first ``COLD_BATCHES`` prefill batches
per prefilling worker and, disaggregated, with a free decode slot behind the unplaced ones) or nothing is
queued; otherwise 429 (``unpredicted_wait``) with a Retry-After of the oldest open request's age, so a cold
server no longer takes a whole burst in blind.

Every decision is counted in ``/metrics`` (``distserve_admission_total{decision,reason}``), sheds and
backups are journaled with their reason (``router.event_journal_path``), and each admitted request keeps
its predicted TTFT, so the prediction error is measured (``GET /v1/admission``: median and P90;
``distserve_ttft_prediction_error_ratio`` in ``/metrics``, the model's terms in ``distserve_ttft_model``).
"""

from __future__ import annotations

import bisect
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from distserve.server.config import DistServeConfig
from distserve.server.latency_model import ahead_under_shortest_first
from distserve.server.router.ttft_predictor import RequestPhases, RoomPrior, TtftPredictor

if TYPE_CHECKING:
    from distserve.server.router.pipeline import Pipeline

SLO_HEADERS = ("x-slo-ttft-ms", "x-slo-tpot-ms")
ON_MISS_HEADER = "x-slo-on-miss"
MAX_RETRY_AFTER_S = 60


def _order_key(t: Ticket) -> float:
    return t.order_key


class InvalidSlo(ValueError):
    def __init__(self, header: str, message: str) -> None:
        super().__init__(f"{header}: {message}")
        self.header = header


@dataclass(frozen=True)
class Slo:
    ttft_s: float | None = None
    tpot_s: float | None = None
    on_miss: str = "shed"


def _single(headers, name: str) -> str | None:
    """The header's one value. Sent twice with different values it is refused (``InvalidSlo``): HTTP reads
    repeated fields as one comma-separated list, and taking the first (Starlette's ``get``) ignored the rest."""
    getlist = getattr(headers, "getlist", None)
    if getlist is None:  # a plain mapping (tests, the unit helpers)
        return headers.get(name)
    values = getlist(name)
    if len(set(values)) > 1:
        shown = ", ".join(repr(v[:20]) for v in values[:3])
        raise InvalidSlo(name, f"given {len(values)} times with different values ({shown}); send it once")
    return values[0] if values else None


def parse_slo(headers, defaults_ttft_ms: float, defaults_tpot_ms: float, on_miss: str) -> Slo:
    """The request's SLO from its headers (milliseconds, > 0) over the config defaults (0 = none)."""
    values = []
    for name, default in zip(SLO_HEADERS, (defaults_ttft_ms, defaults_tpot_ms), strict=True):
        raw = _single(headers, name)
        if raw is None:
            values.append(default / 1000.0 if default > 0 else None)
            continue
        try:
            v = float(raw)
        except ValueError:
            raise InvalidSlo(name, f"must be a number of milliseconds, got {raw[:40]!r}") from None
        if not math.isfinite(v) or v <= 0:
            raise InvalidSlo(name, f"must be a positive number of milliseconds, got {raw[:40]!r}")
        values.append(v / 1000.0)
    miss = _single(headers, ON_MISS_HEADER)
    if miss is not None:
        if miss not in ("shed", "queue", "backup"):
            raise InvalidSlo(ON_MISS_HEADER, f"must be shed, queue or backup, got {miss[:40]!r}")
        on_miss = miss
    return Slo(values[0], values[1], on_miss)


@dataclass(frozen=True)
class Decision:
    """``route``: ``primary`` (admitted), ``backup`` or ``shed`` (429). ``reason`` names the bound or SLO."""

    route: str
    reason: str
    predicted_ttft_s: float | None = None
    predicted_tpot_s: float | None = None
    retry_after_s: int = 1
    message: str = ""
    predicted_parts: tuple[float, float, float] | None = None  # (decode room, prefill call, overhead) seconds
    ahead_share: float = 1.0  # of the queued prompt tokens, the share the prefill order puts ahead of it
    # seconds its first token may come later than predicted (x the SLO margin) and still meet its TTFT SLO; None:
    # no TTFT SLO or no prediction, nothing to protect. Admission keeps it per queued request (``Admission.admit``)
    slack_s: float | None = None
    overtakes_s: float = 0.0  # its prefill work (x the margin) that the queued requests it goes ahead of wait for


class Ticket:
    """One admitted request's place in the ledger; each count released exactly once, whatever way the request
    ends: *unplaced* when it gets a decode slot (``place``, the pipeline's decode-room gate) or its first
    token, *queued* at its first token, *in flight* at ``done`` (which releases whatever is left: a failure,
    a client that left, a 4xx after admission). Every call after the first of each is a no-op."""

    def __init__(
        self,
        adm: Admission,
        tokens: int,
        ahead: tuple[float, float],
        predicted_ttft_s: float | None,
        max_tokens: int = 0,
        slots: int = 1,
    ) -> None:
        self.adm, self.tokens, self.ahead = adm, tokens, ahead  # ahead: (tokens, requests) queued per worker
        # what the room prior reads (ttft_predictor.Stream): its bound on output tokens, the tokens streamed so
        # far (the run sets it at each event), when its first token came (perf_counter), and the decode slots it
        # holds (its worker requests: n / best_of choices, batched prompts)
        self.max_tokens, self.streamed, self.slots = max_tokens, 0, max(1, slots)
        self.first_at: float | None = None
        self.admitted_at = time.perf_counter()
        self.order_key = ahead_under_shortest_first(tokens, self.admitted_at)  # its place in the prefill order
        self.predicted_ttft_s = predicted_ttft_s
        self.queued, self.open, self.unplaced = True, True, True
        # what later arrivals may still delay it by and it meets its TTFT SLO (Decision.slack_s); each prompt the
        # shortest-first prefill order puts ahead of it after its admission takes its work off (Admission.admit)
        self.slack_s: float | None = None
        self.placed_at: float | None = None  # when it got its decode slot (perf_counter)
        self.judged = False  # admitted with something queued ahead: its prediction was judged against the SLO
        self.phases = RequestPhases()  # filled in by the pipeline (EngineRequest.phases)
        self.phases.on_placed = self.place

    def place(self) -> None:
        """It got a decode slot: no longer ahead of anyone in the wait for decode room."""
        if self.unplaced:
            self.unplaced = False
            self.adm.unplaced -= 1
            if self.open:
                self.placed_at = time.perf_counter()

    def first_token(self, ttft_s: float) -> None:
        if not self.queued:
            return
        self.queued = False
        self.first_at = time.perf_counter()
        self.adm._dequeue(self)
        self.adm._measured(self, ttft_s)

    def done(self, tpot_s: float | None = None) -> None:
        if not self.open:
            return
        if self.queued:
            self.queued = False
            self.adm._dequeue(self)
        self.open = False
        self.adm.inflight -= 1
        self.adm.tickets.pop(self, None)
        if self.placed_at is not None:  # its decode slot is free again
            self.adm.model.slot_held(time.perf_counter() - self.placed_at)
        if tpot_s is not None:
            self.adm._tpot(tpot_s)


class Admission:
    def __init__(
        self,
        cfg: DistServeConfig,
        registry: CollectorRegistry,
        workers: Callable[[], int],
        journal: Callable[[dict], object] = lambda _: None,
        clock: Callable[[], float] = time.time,
        priors: Callable[[], dict[str, float]] = dict,
        tpot_prior: Callable[[int], float | None] = lambda holders: None,
        shortest_first: Callable[[], bool] = lambda: False,
    ) -> None:
        """``shortest_first``: whether the prefill is served shortest first (prefill workers: the engine's
        ``wfs`` order, server/latency_model.py) rather than first come first served (colocated workers)."""
        a = cfg.router.admission
        self.cfg = a
        self.max_tokens = a.max_queued_prefill_tokens or 64 * cfg.prefill.max_num_batched_tokens
        self.max_ttft_s = a.max_predicted_ttft_s or cfg.router.request_timeout_s / 2
        self.workers, self.journal, self.clock = workers, journal, clock
        self.inflight = 0
        self.queued_requests = 0
        self.queued_tokens = 0
        self.unplaced = 0  # of the queued requests, those not given a decode slot yet
        self.tickets: dict[Ticket, None] = {}  # the open tickets, oldest first (len == inflight)
        # the prefill worker's shortest-first order
        self.shortest_first = shortest_first
        self.prefill_budget = (max(1, cfg.prefill.max_batch_size), cfg.prefill.max_num_batched_tokens)
        self._order: list[Ticket] = []  # the queued tickets in that order (bisect by ``Ticket.order_key``)
        self.model = TtftPredictor(cfg, workers, priors=priors)  # priors: the workers' start-up cost per token
        self.tpot_ewma_s: float | None = None
        # the decode-room wait before any slot release was measured: from the streams holding a slot now
        self.model.room_prior = RoomPrior(
            lambda: self.tickets,
            lambda: self.tpot_ewma_s,
            prefill_s_per_token=lambda: self.model.per_token_ms() / 1000.0 / max(1, self.workers()),
            tpot_prior=tpot_prior,  # the decode workers' start-up step, before any stream decoded or request ended
        )
        self.errors: deque[float] = deque(maxlen=4096)  # |measured - predicted| / measured
        self.decisions = Counter(
            "distserve_admission", "Admission decisions", ["decision", "reason"], registry=registry
        )
        self.error_ratio = Histogram(
            "distserve_ttft_prediction_error_ratio",
            "|measured - predicted| / measured TTFT of admitted requests",
            buckets=(0.05, 0.1, 0.15, 0.25, 0.5, 1.0, 2.0, 5.0),
            registry=registry,
        )
        terms = Gauge("distserve_ttft_model", "The live TTFT model's terms (ms)", ["term"], registry=registry)
        for term in (
            "busy_per_token_ms",
            "idle_call_fixed_ms",
            "idle_call_per_token_ms",
            "room_per_release_ms",
            "slot_held_ms",
            "overhead_ms",
            "slo_margin",
            "prior_per_token_ms",
        ):
            terms.labels(term).set_function(self._term(term))
        # 1 while the prefill part is predicted from the workers' start-up prior, not yet from measured calls
        terms.labels("prior_in_use").set_function(lambda: 1.0 if self.model.source == "prior" else 0.0)
        # 1 while the decode-room wait is predicted from the streams holding slots (no release measured yet)
        terms.labels("room_prior_in_use").set_function(lambda: 1.0 if self.model.room_source == "prior" else 0.0)
        terms.labels("room_prior_tpot_ms").set_function(lambda: self._room_prior_term("tpot_ms"))
        terms.labels("room_prior_next_release_ms").set_function(lambda: self._room_prior_term("next_release_ms"))
        g = Gauge("distserve_admission_queue", "Admitted requests by stage", ["what"], registry=registry)
        g.labels("inflight_requests").set_function(lambda: self.inflight)
        g.labels("queued_requests").set_function(lambda: self.queued_requests)
        g.labels("queued_prefill_tokens").set_function(lambda: self.queued_tokens)
        g.labels("unplaced_requests").set_function(lambda: self.unplaced)

    def _term(self, term: str) -> Callable[[], float]:
        return lambda: float(self.model.terms()[term] or 0.0)

    def _room_prior_term(self, term: str) -> float:
        rp = self.model.room_prior
        return float((rp.terms()[term] if rp is not None else None) or 0.0)

    # --- the decision -------------------------------------------------------------------------------
    def tokens_ahead(self) -> tuple[float, float]:
        """Prompt tokens and requests queued per serving worker, as admission counts them."""
        n = max(1, self.workers())
        return self.queued_tokens / n, self.queued_requests / n

    def attach(self, pipeline: Pipeline) -> None:
        """From now on ``pipeline`` reports each request's phases to the TTFT model, which reads its decode-room
        gate (``EngineRequest.phases`` is the ticket's)."""
        pipeline.predictor = self.model
        self.model.attach(pipeline.room)

    def ahead_share(self, prompt_tokens: int) -> float:
        """The share of the queued prompt tokens a request of ``prompt_tokens`` arriving now would wait for:
        under shortest first, those of the queued prompts its worker's order puts ahead of it (shorter, or
        longer but waiting long enough) and those that share its step; else all of them. Before (2026-12-07),
        a burst of ShareGPT prompts on SmolLM2 predicted every request behind every prompt admitted before it:
        5-token prompts answered in 2.5 s were predicted 40 s, prediction error P90 908 %."""
        if not self.queued_tokens or not self.shortest_first():
            return 1.0
        toks = [t.tokens for t in self._order]
        k = self._place(prompt_tokens)
        # its own step: the worker answers a step's prompts together, so the queued ones ranked after it that
        # fill its step (up to the prefill batch's prompts and tokens) are waited for as well; with prompts of
        # one length nothing ranks after it and this is first come first served. The step's tokens leave its
        # own out, so a longer prompt never waits for less (the early refusal, early_refusal.py, relies on it)
        most_seqs, most_tokens = self.prefill_budget
        first = k - k % most_seqs
        in_step = sum(toks[first:k])
        j, end = k, min(len(toks), first + most_seqs - 1)
        while j < end and in_step + toks[j] <= most_tokens:
            in_step += toks[j]
            j += 1
        return min(1.0, sum(toks[:j]) / self.queued_tokens)

    def _place(self, prompt_tokens: int) -> int:
        """Where a prompt of ``prompt_tokens`` arriving now goes among the queued ones in the prefill order."""
        return bisect.bisect_right(
            self._order, ahead_under_shortest_first(prompt_tokens, time.perf_counter()), key=_order_key
        )

    def overtaking(self, prompt_tokens: int, margin: float) -> tuple[float, Ticket | None]:
        """What admitting a prompt of ``prompt_tokens`` now would cost the queued requests the prefill worker's
        shortest-first order would put it ahead of: its prefill work (seconds, x ``margin``, shared among the
        workers as the queue is), and the first of them that work would push past its TTFT SLO (one whose first
        token was still predicted in time: ``Ticket.slack_s`` >= 0); (0, None) when it goes ahead of none."""
        if not self.queued_requests or not self.shortest_first():
            return 0.0, None
        k = self._place(prompt_tokens)
        if k >= len(self._order):
            return 0.0, None
        # Only those it goes ahead of: a later prompt that merely shares a queued one's step is the ordinary
        # first-come-first-served case, already inside the measured cost per token every prediction uses (charging
        # it too shed 935 requests of 128 tokens each on the H100's 7B open loop, 24 % of them at 1x capacity).
        cost = prompt_tokens * self.model.per_token_ms() / 1000.0 / max(1, self.workers()) * margin
        for t in self._order[k:]:
            if t.slack_s is not None and 0.0 <= t.slack_s < cost:
                return cost, t
        return cost, None

    def decide(self, prompt_tokens: int, slo: Slo, protect: bool = True) -> Decision:
        """``protect``: refuse a request whose prefill, served before queued requests (shortest first), would make
        one of them miss its TTFT SLO (``router.admission.protect_admitted``). The early refusal passes False:
        it decides for a one-token prompt, and a shorter prompt goes ahead of more requests, not fewer."""
        a = self.cfg
        share = self.ahead_share(prompt_tokens)
        parts = self.model.predict_parts(
            prompt_tokens, self.tokens_ahead(), self.queued_tokens, self.unplaced, ahead_share=share
        )
        ttft = None if parts is None else sum(parts)
        tpot = self.tpot_ewma_s
        full = None
        if a.max_inflight_requests and self.inflight >= a.max_inflight_requests:
            full = ("requests", "max_inflight_requests", f"{self.inflight} requests in flight")
        elif a.max_queued_requests and self.queued_requests >= a.max_queued_requests:
            full = ("requests", "max_queued_requests", f"{self.queued_requests} requests queued")
        elif self.queued_tokens and self.queued_tokens + prompt_tokens > self.max_tokens:
            full = ("tokens", "max_queued_prefill_tokens", f"{self.queued_tokens} prompt tokens queued")
        if full is not None:
            kind, reason, what = full
            retry = self._retry_after(ttft)
            return Decision(
                "backup" if a.on_full == "backup" else "shed",
                reason,
                ttft,
                tpot,
                retry,
                f"Rate limit reached: the server is at capacity ({what}; bound router.admission.{reason}). "
                f"Please retry after {retry} s.",
            )
        if ttft is not None and ttft > self.max_ttft_s:
            retry = self._retry_after(ttft - self.max_ttft_s)
            return Decision(
                "shed",
                "max_predicted_ttft_s",
                ttft,
                tpot,
                retry,
                f"Rate limit reached: predicted time to first token {ttft:.1f} s is more than this server "
                f"lets a request wait ({self.max_ttft_s:.0f} s). Please retry after {retry} s.",
            )
        if (
            ttft is None
            and self.queued_requests
            and slo.on_miss != "queue"
            and not self.model.starts_at_once(self.unplaced, self.queued_requests)
        ):
            # No prediction (the model is still measuring, or this request would wait for decode room before
            # any such wait was measured): admit only what starts at once. Admitting the rest blind is how a
            # cold server took a whole burst in; once answers come back the model predicts. Nothing says when
            # it will start, so the client is told to wait as long as the oldest admitted request has been
            # running (it is at least that far from done): a retry that backs off as it waits.
            retry = self._retry_after(self.oldest_age_s())
            return Decision(
                "backup" if a.on_full == "backup" else "shed",
                "unpredicted_wait",
                None,
                tpot,
                retry,
                f"Rate limit reached: the server is busy ({self.queued_requests} requests waiting for their first "
                f"token) and cannot predict this request's wait yet. Please retry after {retry} s.",
            )
        miss = None
        # Nothing queued: admit whatever the model says of the prefill. Shedding could not help (the SLO is out
        # of reach even on an idle server), and an admitted request is a fresh measurement: a model that
        # overestimates would otherwise shed everything and never see a TTFT again to correct itself. Not so a
        # wait for decode room: every slot is held by admitted requests (the ledger), the wait is real, and
        # its measure is renewed as they end (on the H200's 4x run such requests, predicted 0.4-0.6 s and
        # admitted for nothing queued, were 11 of the 102 admitted past the SLO).
        # A TPOT SLO is about the decode batch the request joins, not the TTFT model: it is judged whenever a
        # stream is in flight (before, a request with nothing queued ahead was admitted with its TPOT SLO
        # unread however many streams were decoding); with none in flight there is no batch, and an admitted
        # request is the next TPOT sample.
        ttft_exempt = self.queued_requests == 0 and not (parts is not None and parts[0] > 0)
        margin = self.model.slo_margin()
        slack = None  # what it has to spare; kept on its ticket for the overtaking guard
        if slo.ttft_s is not None and ttft is not None:
            slack = slo.ttft_s - ttft * margin
            if slack < 0 and not ttft_exempt:
                late = f" (x {margin:.2f}, the recent late tail)" if margin > 1 else ""
                what = f"predicted TTFT {ttft * 1000:.0f} ms{late} > SLO {slo.ttft_s * 1000:g} ms"
                miss = ("slo_ttft", what, -slack)
        if miss is None and slo.tpot_s is not None and tpot is not None and self.inflight and tpot > slo.tpot_s:
            miss = ("slo_tpot", f"predicted TPOT {tpot * 1000:.1f} ms > SLO {slo.tpot_s * 1000:g} ms", 0.0)
        if miss is not None and slo.on_miss != "queue":
            reason, what, over = miss
            retry = self._retry_after(over)
            return Decision(
                slo.on_miss,
                reason,
                ttft,
                tpot,
                retry,
                f"Rate limit reached: {what} (x-slo-* headers). Please retry after {retry} s.",
            )
        overtakes, victim = self.overtaking(prompt_tokens, margin) if a.protect_admitted else (0.0, None)
        if victim is not None and miss is None:
            # Served shortest first, this request would go ahead of queued requests admitted on a prediction
            # that did not know of it, and one of them would miss its SLO for it. Admitted requests keep their
            # promise: on ShareGPT on SmolLM2 (2026-12-07), the late admitted requests were long prompts of a
            # burst that a median of 29 shorter later arrivals overtook (docs/performance/overload.md).
            left = victim.admitted_at + (victim.predicted_ttft_s or 0.0) - time.perf_counter()
            if slo.on_miss != "queue" and protect:
                retry = self._retry_after(left)
                return Decision(
                    slo.on_miss,
                    "slo_ttft_overtakes",
                    ttft,
                    tpot,
                    retry,
                    f"Rate limit reached: the prefill serves shorter prompts first, so this request "
                    f"({prompt_tokens} prompt tokens) would go ahead of queued requests and delay one of them past "
                    f"its TTFT SLO (x-slo-* headers). Please retry after {retry} s.",
                )
            miss = ("slo_ttft_overtakes", "", 0.0)
        return Decision(
            "primary",
            miss[0] + "_queued" if miss else "ok",
            ttft,
            tpot,
            predicted_parts=parts,
            ahead_share=share,
            slack_s=slack,
            overtakes_s=overtakes,
        )

    def oldest_age_s(self) -> float:
        """Seconds since the oldest request still open was admitted (0 when none is)."""
        oldest = next(iter(self.tickets), None)
        return time.perf_counter() - oldest.admitted_at if oldest is not None else 0.0

    def _retry_after(self, seconds: float | None) -> int:
        s = self.cfg.retry_after_s
        if seconds is not None and seconds > s:
            s = math.ceil(seconds)
        return min(MAX_RETRY_AFTER_S, s)

    def admit(self, prompt_tokens: int, d: Decision, max_tokens: int = 0, slots: int = 1) -> Ticket:
        """``max_tokens``: the request's bound on output tokens (the room prior's tokens left); ``slots``: the
        worker requests it fans out to, each holding a decode slot (n / best_of choices, batched prompts)."""
        t = Ticket(self, prompt_tokens, self.tokens_ahead(), d.predicted_ttft_s, max_tokens, slots)
        t.phases.predicted = d.predicted_parts
        t.judged = self.queued_requests > 0
        if d.predicted_parts is not None:
            t.phases.state = {
                **self.model.state(self.unplaced),
                "queued_requests": self.queued_requests,
                "queued_prefill_tokens": self.queued_tokens,
                "unplaced_requests": self.unplaced,
                "inflight_requests": self.inflight,
                "prefill_ahead_share": round(d.ahead_share, 4),
            }
        self.inflight += 1
        self.tickets[t] = None
        self.queued_requests += 1
        self.queued_tokens += prompt_tokens
        i = bisect.bisect_right(self._order, t.order_key, key=_order_key)
        self._order.insert(i, t)
        t.slack_s = d.slack_s
        if d.overtakes_s:  # the queued requests it goes ahead of wait for its prefill too
            for later in self._order[i + 1 :]:
                if later.slack_s is not None:
                    later.slack_s -= d.overtakes_s
        self.unplaced += 1
        self.decisions.labels("admitted", d.reason).inc()
        return t

    def refused(self, d: Decision, prompt_tokens: int | None, route: str) -> None:
        """Count and journal a request that was not admitted (``route``: shed or backup); ``prompt_tokens``
        None: refused before its body was read (server/router/early_refusal.py)."""
        self.decisions.labels(route, d.reason).inc()
        self.journal(
            {
                "kind": "admission",
                "at_unix": round(self.clock(), 6),
                "decision": route,
                "reason": d.reason,
                "prompt_tokens": prompt_tokens,
                "predicted_ttft": None if d.predicted_ttft_s is None else round(d.predicted_ttft_s, 6),
                "predicted_tpot": None if d.predicted_tpot_s is None else round(d.predicted_tpot_s, 6),
                "queued_requests": self.queued_requests,
                "queued_prefill_tokens": self.queued_tokens,
                "unplaced_requests": self.unplaced,
                "inflight_requests": self.inflight,
                "retry_after_s": d.retry_after_s,
            }
        )

    # --- ticket callbacks ---------------------------------------------------------------------------
    def _dequeue(self, t: Ticket) -> None:
        self.queued_requests -= 1
        self.queued_tokens -= t.tokens
        i = bisect.bisect_left(self._order, t.order_key, key=_order_key)
        while i < len(self._order) and self._order[i] is not t:
            i += 1
        if i < len(self._order):
            del self._order[i]
        if t.unplaced:  # a first token (colocated, local prefill) or an end without ever getting a decode slot
            t.unplaced = False
            self.unplaced -= 1

    def _measured(self, t: Ticket, ttft_s: float) -> None:
        if t.predicted_ttft_s is not None and ttft_s > 0:
            err = abs(ttft_s - t.predicted_ttft_s) / ttft_s
            self.errors.append(err)
            self.error_ratio.observe(err)
            if t.judged:
                self.model.judged(t.predicted_ttft_s, ttft_s)
        self.model.measured(t.phases, t.tokens, t.ahead, ttft_s)

    def _tpot(self, tpot_s: float) -> None:
        self.tpot_ewma_s = tpot_s if self.tpot_ewma_s is None else 0.9 * self.tpot_ewma_s + 0.1 * tpot_s

    # --- view ---------------------------------------------------------------------------------------
    def status(self) -> dict:
        errs = sorted(self.errors)

        def q(p: float) -> float | None:
            return round(errs[min(len(errs) - 1, math.ceil(p * len(errs)) - 1)], 4) if errs else None

        return {
            "inflight_requests": self.inflight,
            "queued_requests": self.queued_requests,
            "queued_prefill_tokens": self.queued_tokens,
            "unplaced_requests": self.unplaced,
            "oldest_admitted_age_s": round(self.oldest_age_s(), 3),
            "bounds": {
                "max_inflight_requests": self.cfg.max_inflight_requests,
                "max_queued_requests": self.cfg.max_queued_requests,
                "max_queued_prefill_tokens": self.max_tokens,
                "max_predicted_ttft_s": self.max_ttft_s,
            },
            "model": self.model.terms(),
            "tpot_ewma_s": self.tpot_ewma_s,
            "prediction_error": {"samples": len(errs), "median": q(0.5), "p90": q(0.9)},
            "prediction_error_by_part": self.model.part_errors(),
        }
