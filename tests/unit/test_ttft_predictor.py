"""The router's TTFT prediction (server/router/ttft_predictor.py) and its decode-room gate
(server/router/decode_room.py): the online fit on synthetic prefill-call timings (convergence, a change of
machine, no negative cost), the decode-room term, the per-worker queue it counts, and the gate's order.
Pure: no server start-up, no engine."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from distserve.server.config import load_config
from distserve.server.latency_model import prefill_steps
from distserve.server.router.admission import Admission, Slo
from distserve.server.router.decode_room import DecodeRoom, NoRoom
from distserve.server.router.registry import WorkerRegistry
from distserve.server.router.state import decode_step_prior_s, prefill_priors
from distserve.server.router.ttft_predictor import (
    MARGIN_MIN_SAMPLES,
    MIN_SAMPLES,
    OnlineFit,
    RequestPhases,
    TtftPredictor,
)
from distserve.server.wire import DecodeWarmup, PrefillWarmup, RegisterRequest

B, S = 4096, 32  # prefill.max_num_batched_tokens, prefill.max_batch_size (the defaults)


def _cost_ms(tokens: int, requests: int, call: float, step: float, per_token: float) -> float:
    return call + step * prefill_steps(tokens, requests, B, S) + per_token * tokens


def _feed(fit: OnlineFit, rng: random.Random, n: int, call: float, step: float, per_token: float) -> None:
    for _ in range(n):
        requests = rng.randint(1, 80)
        tokens = requests * rng.choice((64, 128, 256))
        y = _cost_ms(tokens, requests, call, step, per_token) * rng.uniform(0.95, 1.05)  # +-5 % noise
        fit.observe_relative((1.0, prefill_steps(tokens, requests, B, S), tokens / 1000.0), y)


def test_the_online_fit_recovers_per_call_per_step_and_per_token_costs():
    fit = OnlineFit(3)
    _feed(fit, random.Random(1), 400, call=4.0, step=12.0, per_token=0.4)
    call, step, per_ktok = fit.coef
    # one step's fixed part (per call + per step) and the per-token cost; how the fixed part splits between
    # call and step is weakly determined where most calls take one step, and need not be
    assert call + step == pytest.approx(16.0, rel=0.15) and min(call, step) >= 0
    assert per_ktok / 1000 == pytest.approx(0.4, rel=0.05)
    for tokens, requests in ((128, 1), (4096, 32), (12_800, 100)):
        want = _cost_ms(tokens, requests, 4.0, 12.0, 0.4)
        got = fit.predict((1.0, prefill_steps(tokens, requests, B, S), tokens / 1000))
        assert got == pytest.approx(want, rel=0.05)


def test_the_fit_follows_a_change_of_machine_and_never_fits_a_negative_cost():
    fit = OnlineFit(3)
    rng = random.Random(2)
    _feed(fit, rng, 300, call=4.0, step=12.0, per_token=0.4)
    _feed(fit, rng, 400, call=8.0, step=24.0, per_token=0.8)  # a neighbour took half the core
    x = (1.0, prefill_steps(2048, 16, B, S), 2.048)
    assert fit.predict(x) == pytest.approx(_cost_ms(2048, 16, 8.0, 24.0, 0.8), rel=0.05)
    flat = OnlineFit(3)
    for i in range(200):  # a cost that does not grow with the tokens (noise only): no negative slope
        tokens = 100 + 37 * (i % 50)
        flat.observe((1.0, 1.0, tokens / 1000), 10.0 + (1.0 if i % 3 == 0 else -0.5) * (tokens % 7) / 7)
    assert min(flat.coef) >= 0.0
    assert flat.predict((1.0, 1.0, 5.0)) == pytest.approx(10.0, abs=1.0)  # extrapolated, not run off


def _registry(slots_used: int = 0) -> WorkerRegistry:
    reg = WorkerRegistry(heartbeat_timeout_s=30)
    for wid, role in (("p0", "prefill"), ("d0", "decode")):
        reg.register(RegisterRequest(worker_id=wid, role=role, url="http://x", pid=1, fingerprint={}, max_model_len=64))
    reg.workers["d0"].inflight = slots_used
    return reg


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _warm(p: TtftPredictor, clock: Clock, n: int = 20, ms: float = 20.0) -> None:
    for _ in range(n):  # prefill calls of `ms` on an idle worker, one at a time
        c = p.call_started("p0", 128)
        clock.t += ms / 1000
        p.call_ended(c, True)
        clock.t += 1.0


def _attached(slots: int = 2, workers: int = 1) -> tuple[TtftPredictor, Clock, DecodeRoom, WorkerRegistry]:
    clock, reg = Clock(), _registry()
    room = DecodeRoom(reg, slots=slots)
    p = TtftPredictor(load_config(), lambda: workers, clock=clock)
    p.attach(room)
    return p, clock, room, reg


def test_the_prediction_adds_the_decode_room_wait_and_the_router_overhead():
    p, clock, room, reg = _attached()
    assert p.predict_s(128) is None  # nothing measured yet: no prediction, never a guess
    _warm(p, clock)
    assert p.predict_s(128) == pytest.approx(0.020, rel=0.05)  # decode has room: the prefill call alone
    ph = RequestPhases()
    ph.room_s, ph.call_s = 0.0, 0.020
    p.measured(ph, 128, (0, 0), 0.025)  # 5 ms more than its parts: the router's own overhead
    assert p.overhead_s == pytest.approx(0.005)
    for releases in (1, 2, 4):  # requests that waited 150 ms per slot release
        p.room_granted(RequestPhases(), 0.150 * releases, releases)
    assert p.room_per_release_s == pytest.approx(0.150)
    reg.workers["d0"].inflight = 2  # decode full: a new request waits for one release
    assert room.releases_needed() == 1
    assert p.predict_s(128) == pytest.approx(0.150 + 0.020 + 0.005, rel=0.05)
    room.waiters.extend(asyncio.Event() for _ in range(3))  # three already waiting: four releases
    assert room.releases_needed() == 4
    assert p.predict_s(128) == pytest.approx(4 * 0.150 + 0.020 + 0.005, rel=0.05)
    assert p.terms()["room_per_release_ms"] == pytest.approx(150.0)


def test_the_gate_closes_on_a_pool_short_of_blocks_not_on_a_reservation_between_steps():
    # a heartbeat that caught a reservation waiting only for the running step (num_reserving, not blocked)
    # leaves the room open; one the KV pool refused closes it until a heartbeat says otherwise
    p, clock, room, reg = _attached(slots=2)
    d0 = reg.workers["d0"]
    d0.status = d0.status.model_copy(update={"num_reserving": 3, "num_kv_blocked": 0})
    assert room.has_room(d0) and room.free_slots() == 2 and room.releases_needed() == 0
    d0.status = d0.status.model_copy(update={"num_reserving": 3, "num_kv_blocked": 3})
    assert not room.has_room(d0) and room.free_slots() == 0 and room.kv_bound()
    # the three refused reservations (past the gate, holding slots) take the first blocks freed: a fourth release
    assert room.releases_needed() == 4


def test_the_prediction_is_the_queued_tokens_at_the_measured_cost_per_token():
    # known state: idle calls of 20 ms for 128 tokens measure 20 / 128 ms per token of busy time
    p, clock, room, reg = _attached(slots=2, workers=1)
    _warm(p, clock)
    per_token = 20.0 / 128
    assert p.per_token_ms() == pytest.approx(per_token) and p.idle_call_ms(128) == pytest.approx(20.0)
    for _ in range(3):  # three calls of 128 tokens in flight on the worker, sent 5 ms ago
        p.call_started("p0", 128)
    clock.t += 0.005
    # two more admitted (waiting for decode room or not sent yet): 640 queued tokens before the new request
    want = (640 + 128) * per_token - 5.0  # less the 5 ms the worker has worked on them since
    assert p.predict_parts(128, queued_tokens=640) == pytest.approx((0.0, want / 1000, 0.0))
    assert p.state()["workers"]["p0"][:2] == [384, 3]
    # nothing queued but what is in flight: the queue there, never less than an idle call
    assert p.predict_s(128, queued_tokens=384) == pytest.approx(((384 + 128) * per_token - 5.0) / 1000)
    clock.t += 1.0  # a second without an answer for 384 tokens: slower than measured, not nearly done
    assert p.predict_s(128, queued_tokens=384) == pytest.approx(128 * 1005.0 / 384 / 1000)
    clock.t -= 1.0
    # decode full, 150 ms per slot release: the stages are in tandem, the larger of room + idle call and
    # the queue is the TTFT; the parts say so
    p.room_per_release_s = 0.150
    reg.workers["d0"].inflight = 2
    room_s, call_s, over_s = p.predict_parts(128, queued_tokens=640)
    assert (room_s, call_s) == pytest.approx((0.150, 0.020)) and over_s == 0.0
    room.waiters.extend(asyncio.Event() for _ in range(3))  # four releases: 600 ms + the idle call
    assert p.predict_s(128, queued_tokens=640) == pytest.approx(0.620)


def test_the_progress_credited_since_the_last_answer_is_at_most_the_running_steps_work():
    # The worker answers a step's calls together at its end; a call sent while a step runs waits for the next.
    # So what it has done since its last answer is at most the running step's work: the calls in flight when
    # the step started. Counting all the time since then as progress on every call in flight (calls sent
    # after the step started included) read a stalled worker as nearly done (the H200's 4x run: 40 calls
    # piled up behind a 227 ms step of 4 and each new one was predicted ~70 ms).
    p, clock, _, _ = _attached(workers=1)
    _warm(p, clock)  # 20 ms per call of 128 tokens: 20 / 128 ms per token
    c = 20.0 / 128
    p.call_started("p0", 128)  # finds the worker idle: a step of its 128 tokens, 20 ms
    clock.t += 0.010
    for _ in range(9):  # nine more sent 10 ms into that step: they wait for the next one
        p.call_started("p0", 128)
    queued = 10 * 128
    # 10 ms into the step: 10 ms done of it, the rest ahead
    assert p.predict_s(128, queued_tokens=queued) == pytest.approx(((queued + 128) * c - 10.0) / 1000)
    clock.t += 0.010  # the step's 20 ms are up: all of it done, nothing of the nine
    at_end = p.predict_s(128, queued_tokens=queued)
    assert at_end == pytest.approx(((queued + 128) * c - 20.0) / 1000)
    # 60 ms more without an answer: the step is 60 ms overdue. Before, the 80 ms since it started counted
    # as done (the prediction fell to 140 ms as the worker stood still); now the step is read as late,
    # by as much again as it has overrun: the rest is still ahead, and the prediction grows
    clock.t += 0.060
    overdue = p.predict_s(128, queued_tokens=queued)
    assert overdue == pytest.approx(((queued + 128) * c - 20.0 + 60.0) / 1000)
    assert overdue > at_end


def test_each_request_of_a_burst_on_a_stalled_worker_is_predicted_behind_the_one_before():
    # the H200's 4x run (docs/performance/overload.md, 2026-12-07): the prefill worker went 200+ ms without
    # answering while a burst came in; each new request was predicted ~70 ms whatever its place (the time
    # without an answer was credited as progress on calls sent after the step started), and admitted
    p, clock, _, _ = _attached(workers=1)
    _warm(p, clock)
    p.call_started("p0", 128)  # a step of one call, 20 ms expected
    preds = []
    for _ in range(12):  # one call every 20 ms (as much work as the time it waits), no answer for 240 ms
        clock.t += 0.020
        queued = sum(q.tokens for q in p.queues.values())
        preds.append(p.predict_s(128, queued_tokens=queued))
        p.call_started("p0", 128)
    assert all(b > a for a, b in zip(preds[1:], preds[2:], strict=False)), preds  # each behind the one before
    assert preds[-1] > 2 * preds[1]


def test_the_idle_call_is_a_low_quantile_of_the_recent_ones_plus_a_slope_per_token():
    p, clock, _, _ = _attached(slots=0)
    _warm(p, clock, n=12, ms=20.0)
    _warm(p, clock, n=4, ms=200.0)  # a neighbour took the CPU for four calls: 20 ms stays the idle call
    assert p.idle_call_ms(128) == pytest.approx(20.0)
    _warm(p, clock, n=12, ms=200.0)  # ... and kept it: the idle call follows within a dozen calls
    assert p.idle_call_ms(128) == pytest.approx(200.0)
    for i in range(40):  # idle calls of 5 ms + 0.1 ms per token, prompts of 64 to 512 tokens
        tokens = (64, 128, 256, 512)[i % 4]
        c = p.call_started("p0", tokens)
        clock.t += (5.0 + 0.1 * tokens) / 1000
        p.call_ended(c, True)
        clock.t += 1.0
    assert p.idle_slope_ms() == pytest.approx(0.1, rel=0.01) and p.idle_call_ms(1000) == pytest.approx(105.0, rel=0.01)


def test_the_requests_not_sent_yet_are_shared_among_the_workers():
    p, clock, _, _ = _attached(slots=0, workers=2)
    _warm(p, clock)  # 20 ms per 128 tokens on p0; p1 never measured: the same cost
    for _ in range(3):
        p.call_started("p0", 128)
    # 640 queued: 384 in flight on p0, 256 not sent, half of them p1's; p1 is idle and answers first
    assert p.predict_s(128, queued_tokens=640) == pytest.approx((128 + 128) * 20.0 / 128 / 1000)


def test_the_prefill_queue_is_counted_per_worker_and_released_once():
    p, clock, _, _ = _attached(slots=0, workers=2)  # two prefill workers
    a = p.call_started("p0", 1000)
    assert p.ahead() == (0, 0)  # the other worker has nothing in flight: a new request goes there
    b = p.call_started("p1", 300)
    c = p.call_started("p1", 200)
    assert p.ahead() == (500, 2) and (c.ahead_tokens, c.ahead_requests) == (300, 1)
    for call in (a, a, b):  # ended once, however often
        p.call_ended(call, False)
    assert [x.tokens for x in p.queues["p1"].calls] == [200] and set(p.queues) == {"p1"}
    assert p.answered == 0  # a failed call is not a measured answer
    ph = RequestPhases()
    clock.t += 0.05
    p.call_ended(c, True, ph)
    assert p.queues == {} and p.answered == 1 and ph.call_s == pytest.approx(0.05)


def _next_step(waiting: list) -> tuple[list, list]:
    """The worker's scheduler: the oldest waiting calls, up to 32 requests and 4096 tokens."""
    t = n = 0
    for c in waiting:
        if n and (n + 1 > S or t + c.tokens > B):
            break
        t, n = t + c.tokens, n + 1
    return waiting[:n], waiting[n:]


def _simulate(p: TtftPredictor, clock: Clock, rng: random.Random, n: int, mean_gap_s: float) -> list[float]:
    """A prefill worker that batches: a call to an idle worker starts a step at once; the calls that arrive
    during a step make the next one. A step costs 8 ms + 2 ms per request + 0.1 ms per token. Returns the
    relative error of each call's prediction made when it was sent (once the model had one)."""

    def cost_s(calls: list) -> float:
        return (8.0 + 2.0 * len(calls) + 0.1 * sum(c.tokens for c in calls)) / 1000

    arrivals, t = [], clock.t
    for _ in range(n):
        t += rng.expovariate(1 / mean_gap_s)
        arrivals.append((t, rng.choice((64, 128, 256, 512))))
    running: list = []
    waiting: list = []
    step_end: float | None = None
    errors, i = [], 0
    while i < len(arrivals) or running:
        if step_end is not None and (i == len(arrivals) or step_end <= arrivals[i][0]):
            clock.t = step_end
            for c in running:
                measured = (step_end - c.t0) * 1000
                if c.at_start_ms is not None:
                    errors.append(abs(c.at_start_ms - measured) / measured)
                p.call_ended(c, True)
            running, waiting = _next_step(waiting)
            step_end = step_end + cost_s(running) if running else None
        else:
            clock.t = arrivals[i][0]
            c = p.call_started("p0", arrivals[i][1])
            i += 1
            if step_end is None:
                running, step_end = [c], clock.t + cost_s([c])
            else:
                waiting.append(c)
    return errors


def test_the_queue_model_converges_on_a_batching_worker_light_and_overloaded():
    # the router sees only sends and answers; it learns the idle call and the worker's cost per token
    p, clock, _, _ = _attached(slots=0)
    rng = random.Random(4)
    _simulate(p, clock, rng, 400, mean_gap_s=0.040)  # light load: mostly one call per step
    light = _simulate(p, clock, rng, 400, mean_gap_s=0.040)
    over = _simulate(p, clock, rng, 400, mean_gap_s=0.004)  # overloaded: steps of many calls, a queue behind
    # the cost per token it measured: a full step of 32 calls of 240 tokens on average, 8 + 2 x 32 + 0.1 x 7680 ms
    assert p.per_token_ms() == pytest.approx((8 + 2 * 32 + 0.1 * 32 * 240) / (32 * 240), rel=0.25)
    for errs, p90 in ((light, 0.5), (over, 0.3)):  # a drain at a mean cost: a call's own step is not modelled
        errs.sort()
        assert errs[len(errs) // 2] < 0.2 and errs[int(len(errs) * 0.9)] < p90, (errs[len(errs) // 2], errs[-40])


def test_admission_attached_to_a_pipeline_predicts_from_the_phases_and_exports_them():
    registry = CollectorRegistry()
    adm = Admission(load_config(), registry, lambda: 1)

    class _Pipe:  # what Admission.attach reads of a Pipeline
        predictor = None
        room = DecodeRoom(_registry(), slots=4)

    pipe = _Pipe()
    adm.attach(pipe)  # type: ignore[arg-type]
    assert pipe.predictor is adm.model
    clock = Clock()
    adm.model.clock = clock
    _warm(adm.model, clock, ms=30.0)
    d = adm.decide(128, Slo())
    t = adm.admit(128, d)
    t.phases.call_s = 0.030
    t.first_token(0.032)
    assert d.predicted_ttft_s == pytest.approx(0.030, rel=0.05) and adm.status()["prediction_error"]["samples"] == 1
    assert adm.status()["prediction_error_by_part"]["prefill_call"]["samples"] == 1
    text = generate_latest(registry).decode()
    assert 'distserve_ttft_model{term="busy_per_token_ms"}' in text
    assert "distserve_ttft_prediction_error_ratio_bucket" in text


def test_the_decode_room_is_granted_in_arrival_order():
    async def go() -> tuple[list[int], list[int]]:
        reg = _registry(slots_used=1)
        room = DecodeRoom(reg, slots=1)
        d0 = reg.workers["d0"]
        order: list[int] = []
        releases: list[int] = []

        async def want(i: int) -> None:
            w, _, r = await room.acquire(lambda: reg.pick("decode"), timeout_s=30)
            assert w is d0
            d0.inflight += 1  # as the pipeline charges it at once
            order.append(i)
            releases.append(r)

        tasks = []
        for i in range(5):
            tasks.append(asyncio.ensure_future(want(i)))
            await asyncio.sleep(0.005)  # arrive in this order
        gone = tasks.pop(2)
        gone.cancel()  # a client that leaves gives up its place
        await asyncio.sleep(0.05)
        assert order == [] and len(room.waiters) == 4
        for _ in range(4):
            d0.inflight -= 1  # a request ends: one slot
            await asyncio.sleep(0.05)
        await asyncio.gather(*tasks)
        return order, releases

    order, releases = asyncio.run(go())
    assert order == [0, 1, 3, 4]
    assert releases == [1, 2, 3, 4, 5][:2] + [4, 5]  # each counted the releases ahead of it when it came


def test_the_decode_room_gives_up_after_its_timeout():
    async def go() -> None:
        reg = _registry(slots_used=1)
        room = DecodeRoom(reg, slots=1)
        with pytest.raises(NoRoom):
            await room.acquire(lambda: reg.pick("decode"), timeout_s=0.05)
        assert not room.waiters

    asyncio.run(go())


def _admission_on(slots: int = 2) -> tuple[Admission, Clock, WorkerRegistry]:
    """Admission attached to a decode-room gate of ``slots`` on one decode worker, its model on a test clock."""
    reg = _registry()

    class _Pipe:
        predictor = None
        room = DecodeRoom(reg, slots=slots)

    adm = Admission(load_config(), CollectorRegistry(), lambda: 1)
    adm.attach(_Pipe())  # type: ignore[arg-type]
    clock = Clock()
    adm.model.clock = clock
    return adm, clock, reg


def test_request_k_of_a_burst_is_predicted_behind_the_k_minus_1_admitted_before_it():
    adm, clock, reg = _admission_on(slots=2)
    _warm(adm.model, clock)
    adm.model.room_per_release_s = 0.150
    # a burst: every decision is taken before any of the requests admitted before it reaches the gate
    tickets, rooms = [], []
    for _ in range(6):
        d = adm.decide(128, Slo())
        rooms.append(d.predicted_parts[0])
        tickets.append(adm.admit(128, d))
    # 2 free slots: the first two wait for nothing, request k waits for k - 2 releases
    assert rooms == pytest.approx([0.0, 0.0, 0.150, 0.300, 0.450, 0.600])
    assert tickets[-1].phases.state["unplaced_requests"] == 5 and tickets[-1].phases.state["releases"] == 4
    assert (adm.queued_requests, adm.unplaced, adm.queued_tokens) == (6, 6, 6 * 128)
    # two get their decode slot (the pipeline's gate tells the model, which tells the ticket): they are no
    # longer ahead of anyone in the wait for room, though still waiting for their first token
    for t in tickets[:2]:
        adm.model.room_granted(t.phases, 0.0, 0)
        adm.model.room_granted(t.phases, 0.0, 0)  # a migration asks again: released once
        reg.workers["d0"].inflight += 1
    assert (adm.queued_requests, adm.unplaced) == (6, 4)
    assert adm.decide(128, Slo()).predicted_parts[0] == pytest.approx(5 * 0.150)  # 4 ahead, no slot free
    # every way out releases each count once: first token then end, an end without a first token (a failure,
    # a client that left), an end after the slot, done() again
    tickets[0].first_token(0.02)
    for t in tickets:
        t.done()
        t.done()
    assert (adm.inflight, adm.queued_requests, adm.unplaced, adm.queued_tokens, len(adm.tickets)) == (0, 0, 0, 0, 0)
    assert adm.model.slot_samples == 2  # the two that held a slot said for how long


def test_without_a_prediction_only_what_starts_at_once_is_admitted():
    adm, clock, reg = _admission_on(slots=2)
    # a cold server (nothing measured): the first two find decode room, the third would wait for an
    # unknown time: 429 with Retry-After, unless the client accepts a wait
    a, b = (adm.admit(128, adm.decide(128, Slo())) for _ in range(2))
    d = adm.decide(128, Slo())
    assert (d.route, d.reason, d.predicted_ttft_s) == ("shed", "unpredicted_wait", None) and d.retry_after_s >= 1
    assert adm.decide(128, Slo(None, None, "queue")).route == "primary"
    # ready, but nobody waited for room yet: a slot is released every (holding time / slots), Little's law
    _warm(adm.model, clock)
    assert adm.decide(128, Slo()).reason == "unpredicted_wait"
    adm.model.slot_held(3.0)
    d = adm.decide(128, Slo())
    assert d.route == "primary" and d.predicted_parts[0] == pytest.approx(1 * 3.0 / 2)
    adm.model.room_per_release_s = 0.4  # measured waits win over the prior
    assert adm.decide(128, Slo()).predicted_parts[0] == pytest.approx(0.4)
    a.done()
    b.done()
    assert adm.status()["unplaced_requests"] == 0 and adm.status()["oldest_admitted_age_s"] == 0.0


# --- the cold-start prior: the workers' own start-up prefill (LLMEngine.measure_prefill) -------------------


def _with_warmup(reg: WorkerRegistry, wid: str, ms: float, tokens: int = 512) -> None:
    """``wid`` registers again, reporting a start-up prefill of ``tokens`` in ``ms`` (as serve_worker does)."""
    w = reg.workers[wid]
    reg.register(
        RegisterRequest(
            worker_id=wid,
            role=w.role,
            url=w.url,
            pid=w.pid,
            fingerprint={},
            max_model_len=64,
            prefill_warmup=PrefillWarmup(tokens=tokens, requests=2, ms=ms),
        )
    )


def _admission_with_prior(slots: int = 256, warmup_ms: float | None = 256.0, shortest_first: bool = False):
    """Admission as the router builds it: priors from the registry (``prefill_priors``) of one prefill worker
    that reported 512 tokens in ``warmup_ms`` (0.5 ms per token) at registration, or nothing (None)."""
    reg = _registry()
    if warmup_ms is not None:
        _with_warmup(reg, "p0", warmup_ms)
    registry = CollectorRegistry()
    state = SimpleNamespace(registry=reg)  # what prefill_priors reads of a RouterState

    class _Pipe:
        predictor = None
        room = DecodeRoom(reg, slots=slots)

    adm = Admission(
        load_config(),
        registry,
        lambda: 1,
        priors=lambda: prefill_priors(state),  # type: ignore[arg-type]
        tpot_prior=lambda holders: decode_step_prior_s(state, holders),  # type: ignore[arg-type]
        shortest_first=lambda: shortest_first,
    )
    adm.attach(_Pipe())  # type: ignore[arg-type]
    clock = Clock()
    adm.model.clock = clock
    return adm, clock, reg, registry


def test_the_prior_predicts_before_any_call_is_answered():
    adm, _, _, registry = _admission_with_prior()
    p = adm.model
    assert p.answered == 0 and p.source == "prior" and p.ready
    assert p.predict_s(128) == pytest.approx(128 * 0.5 / 1000)  # an idle worker: its own tokens at the prior
    # ten admitted before it and not answered: their tokens too, at the prior's cost per token
    assert p.predict_s(128, queued_tokens=1280) == pytest.approx((1280 + 128) * 0.5 / 1000)
    assert adm.status()["model"]["source"] == "prior" and adm.status()["model"]["prior_per_token_ms"] == 0.5
    text = generate_latest(registry).decode()
    assert 'distserve_ttft_model{term="prior_in_use"} 1.0' in text
    assert 'distserve_ttft_model{term="prior_per_token_ms"} 0.5' in text
    # a worker that reported nothing: no prior, no prediction (never a guess)
    cold, _, _, _ = _admission_with_prior(warmup_ms=None)
    assert cold.model.source == "none" and cold.model.predict_s(128) is None


def test_the_prior_yields_to_the_measured_calls():
    adm, clock, _, registry = _admission_with_prior()
    p = adm.model
    _warm(p, clock, n=MIN_SAMPLES - 1, ms=20.0)  # fewer than MIN_SAMPLES answers: still the prior
    assert p.source == "prior" and p.per_token_ms() == pytest.approx(0.5)
    _warm(p, clock, n=1, ms=20.0)
    assert p.source == "measured" and p.per_token_ms() == pytest.approx(20.0 / 128)
    assert p.predict_s(128, queued_tokens=1280) == pytest.approx((1280 + 128) * 20.0 / 128 / 1000)
    assert 'distserve_ttft_model{term="prior_in_use"} 0.0' in generate_latest(registry).decode()


def test_a_first_batch_slower_than_the_prior_raises_the_prediction_while_it_runs():
    adm, clock, _, _ = _admission_with_prior()
    p = adm.model
    for _ in range(10):  # the first batch: 1280 tokens in flight, 640 ms at the prior
        p.call_started("p0", 128)
    clock.t += 2.0  # still no answer after 2 s: the worker is at least 2000 / 1280 ms per token (at the prior
    # alone the batch would be "done" by now and a new request predicted an idle call, 64 ms)
    per_token = 2000.0 / 1280
    assert p.predict_s(128, queued_tokens=1280) == pytest.approx(((1280 + 128) * per_token - 2000.0) / 1000)


def test_a_burst_on_a_fresh_server_is_admitted_while_it_fits_the_slo_and_shed_after():
    adm, _, _, _ = _admission_with_prior()
    # 0.5 ms per token, 128 tokens each: the first 5 fit (5 x 64 ms x the cold margin 1.5 = 480 ms)
    slo = Slo(ttft_s=0.5)
    decisions = []
    for _ in range(12):
        d = adm.decide(128, slo)
        decisions.append((d.route, d.reason))
        if d.route == "primary":
            adm.admit(128, d)
    assert decisions == [("primary", "ok")] * 5 + [("shed", "slo_ttft")] * 7
    # the same burst without any prior: only what starts at once (the first two batches), blind
    cold, _, _, _ = _admission_with_prior(warmup_ms=None)
    for _ in range(12):
        d = cold.decide(128, slo)
        assert (d.route, d.predicted_ttft_s) == ("primary", None)
        cold.admit(128, d)


def test_under_shortest_first_a_short_prompt_is_predicted_behind_only_what_the_prefill_order_puts_ahead(monkeypatch):
    """A prefill worker serves its waiting prompts shortest first with aging (the engine's wfs order) and answers a
    step's prompts together. Before: a 5-token prompt admitted behind 8 000 tokens of a ShareGPT burst was predicted
    behind all of them (40 s; it had its first token in 2.5 s, in the first step), prediction error P90 908 % on
    SmolLM2 (2026-12-07)."""
    from distserve.server.router import admission as admission_module

    now = [1000.0]
    monkeypatch.setattr(admission_module, "time", SimpleNamespace(perf_counter=lambda: now[0], time=lambda: 0.0))
    ms = 0.5 / 1000  # the prior: 0.5 ms per token, nothing answered yet
    fcfs, _, _, _ = _admission_with_prior()
    wfs, _, _, _ = _admission_with_prior(shortest_first=True)
    tickets = [a.admit(2000, a.decide(2000, Slo())) for a in (fcfs, wfs) for _ in range(4)]  # a burst: 8 000 tokens
    assert fcfs.decide(10, Slo()).predicted_ttft_s == pytest.approx((8000 + 10) * ms)  # arrival order: all ahead
    # shortest first: ahead of all four, but its step (4 096 tokens) also holds two of them, answered together
    d = wfs.decide(10, Slo())
    assert d.ahead_share == 0.5 and d.predicted_ttft_s == pytest.approx((4000 + 10) * ms)
    # a prompt as long or longer waits for them all, as in arrival order
    assert wfs.decide(2000, Slo()).predicted_ttft_s == pytest.approx((8000 + 2000) * ms)
    assert wfs.decide(5000, Slo()).ahead_share == 1.0
    short = wfs.admit(10, d)
    assert wfs.decide(20, Slo()).predicted_ttft_s == pytest.approx((4010 + 20) * ms)  # the 10, then its step
    # a longer prompt never waits for less (the early refusal decides for a one-token prompt)
    waits = [wfs.decide(n, Slo()).predicted_ttft_s for n in range(1, 3000, 7)]
    assert waits == sorted(waits)
    # aging: 1.5 s later the 2 000-token prompts (2000 - 1500) go before a new 600-token one, not a 400-token one
    now[0] += 1.5
    assert wfs.decide(600, Slo()).ahead_share == 1.0
    assert wfs.decide(400, Slo()).ahead_share == pytest.approx(4010 / 8010)
    # the order forgets each prompt once it has its first token (or ends without one), exactly once
    tickets[4].first_token(0.1)
    short.done()
    short.done()
    assert (wfs.queued_tokens, [t.tokens for t in wfs._order]) == (6000, [2000, 2000, 2000])
    for t in tickets:
        t.done()
    assert (wfs.queued_tokens, wfs._order) == (0, [])
    assert fcfs.decide(10, Slo()).ahead_share == 1.0


def test_nothing_queued_admits_whatever_the_prefill_prediction_but_not_a_wait_for_decode_room():
    # Nothing queued: a request is admitted whatever its prefill part is predicted (shedding it could not help,
    # and it is the model's next measurement). A request that would wait for decode room is not in that case:
    # every slot is held by admitted requests (the ledger), the wait is real and re-measured as they end. On
    # the H200's 4x run 11 of the 102 late admitted requests were such (predicted 0.4-0.6 s of decode room,
    # admitted for nothing queued, measured 0.27-1.05 s).
    adm, clock, reg, _ = _admission_with_prior(slots=2)
    slo = Slo(ttft_s=0.25)
    d = adm.decide(1024, slo)  # 1024 tokens at the prior (0.5 ms each): 512 ms > SLO, yet nothing queued
    assert (d.route, d.reason) == ("primary", "ok") and d.predicted_ttft_s == pytest.approx(0.512)
    adm.model.room_per_release_s = 0.4
    reg.workers["d0"].inflight = 2  # every decode slot held: a release (400 ms) before the prefill
    assert adm.queued_requests == 0 and adm.model.room.releases_needed(0) == 1
    d = adm.decide(128, slo)
    assert (d.route, d.reason) == ("shed", "slo_ttft") and d.predicted_ttft_s == pytest.approx(0.464)
    reg.workers["d0"].inflight = 1  # a slot free again: admitted
    assert adm.decide(128, slo).route == "primary"


# --- the room prior: the decode-room wait before any slot release (RoomPrior) -----------------------------


def _full_decode(slots: int, max_tokens: list[int], streamed: list[int], tpot_s: float = 0.1):
    """A fresh server (prefill prior, nothing released yet) whose ``slots`` decode slots are all held by
    admitted requests of ``max_tokens``, each having streamed ``streamed`` tokens at ``tpot_s`` per token
    (what the pipeline's gate and the run set on each ticket)."""
    adm, clock, reg, registry = _admission_with_prior(slots=slots)
    adm.model.room_prior.clock = clock
    tickets = []
    for mt, n in zip(max_tokens, streamed, strict=True):
        t = adm.admit(128, adm.decide(128, Slo()), max_tokens=mt)
        adm.model.room_granted(t.phases, 0.0, 0)  # it got a decode slot at once
        tickets.append(t)
    clock.t += 1.0  # past the room prior's refresh interval (admit() read it, before any slot was held)
    for t, n in zip(tickets, streamed, strict=True):
        t.placed_at = clock.t - 1.0
        if n:
            t.first_token(0.5)
            t.first_at, t.streamed = clock.t - (n - 1) * tpot_s, n
    reg.workers["d0"].inflight = slots
    return adm, clock, tickets, registry


def test_the_room_prior_predicts_the_kth_release_from_the_streams_decoding_now():
    adm, clock, tickets, registry = _full_decode(4, [64, 32, 64, 16], [11, 11, 1, 11])
    p = adm.model
    assert p.slot_samples == 0 and p.room_samples == 0 and p.release_s() is None  # nothing released yet
    assert p.room_source == "prior"
    # TPOT pooled over the streams with two tokens or more (0.1 s); tokens left: 53, 21, 63, 5
    d = adm.decide(128, Slo())
    assert d.route == "primary" and d.predicted_parts[0] == pytest.approx(5 * 0.1)  # the 1st release
    t5 = adm.admit(128, d, max_tokens=64)
    assert adm.decide(128, Slo()).predicted_parts[0] == pytest.approx(21 * 0.1)  # behind t5: the 2nd
    adm.admit(128, adm.decide(128, Slo()), max_tokens=64)
    adm.admit(128, adm.decide(128, Slo()), max_tokens=64)
    assert adm.decide(128, Slo()).predicted_parts[0] == pytest.approx(63 * 0.1)  # the 4th: the last holder
    for _ in range(2):
        adm.admit(128, adm.decide(128, Slo()), max_tokens=64)
    # the 6th release is beyond the holders: one more every (mean max_tokens 44 x TPOT) / 4 slots
    assert adm.decide(128, Slo()).predicted_parts[0] == pytest.approx(63 * 0.1 + 2 * 44 * 0.1 / 4)
    st = adm.status()["model"]
    assert st["room_source"] == "prior" and st["room_prior"]["tpot_ms"] == pytest.approx(100.0)
    assert st["room_prior"]["tpot_live"] and st["room_prior"]["holders"] == 4
    assert t5.phases.state["room_source"] == "prior"  # journaled with the request
    text = generate_latest(registry).decode()
    assert 'distserve_ttft_model{term="room_prior_in_use"} 1.0' in text
    assert 'distserve_ttft_model{term="room_prior_tpot_ms"} 100.0' in text


def test_the_room_prior_needs_a_tpot_and_is_cheap_between_refreshes():
    # the slots held, no stream past its first token and no request ended: no prior, the 429 as before
    adm, clock, tickets, _ = _full_decode(2, [64, 64], [1, 0])
    assert adm.model.room_source == "none"
    d = adm.decide(128, Slo())
    assert (d.route, d.reason) == ("shed", "unpredicted_wait")
    adm.tpot_ewma_s = 0.2  # ended requests' TPOT (here, of another burst): the prior uses it
    clock.t += 1.0  # past the refresh interval
    d = adm.decide(128, Slo())
    assert d.route == "primary" and d.predicted_parts[0] == pytest.approx(63 * 0.2)  # 63 left x 0.2 s
    assert adm.status()["model"]["room_prior"]["tpot_live"] is False
    # between refreshes a prediction is one lookup: the time left less the time since (the streams are not
    # read again, so a stream that moved on is seen at the next refresh)
    tickets[0].streamed, tickets[0].first_at = 40, clock.t + 1.01 - 39 * 0.2  # 39 more tokens, 0.2 s each
    clock.t += 0.01
    assert adm.model.room_prior.wait_s(1, 2) == pytest.approx(63 * 0.2 - 0.01)
    clock.t += 1.0
    assert adm.model.room_prior.wait_s(1, 2) == pytest.approx(24 * 0.2)  # its live TPOT, 24 tokens left
    assert adm.status()["model"]["room_prior"]["tpot_live"] is True
    # a holder that ends (EOS before max_tokens) gives its place up: the next holder's time is read
    tickets[0].done()
    clock.t += 1.0
    # ... and one still waiting for its first token is counted from the end of its prefill (its 128 prompt
    # tokens at the prefill prior's 0.5 ms each), then its 64 tokens
    assert adm.model.room_prior.wait_s(1, 2) == pytest.approx(128 * 0.5 / 1000 + 64 * 0.2)


def test_before_any_stream_decoded_the_room_prior_takes_the_decode_workers_start_up_step():
    # the first seconds of a burst: every slot held, no stream past its first token, no request ended. With the
    # decode worker's start-up steps (decode_warmup: 10 ms at one sequence, 90 at nine: 10 ms more a sequence,
    # so 20 ms at the two holders) the wait is predicted, not refused unseen
    adm, clock, tickets, _ = _full_decode(2, [64, 64], [1, 0])
    assert (adm.decide(128, Slo()).reason, adm.model.room_source) == ("unpredicted_wait", "none")
    w = adm.model.room_prior
    reg = adm.model.room.registry  # type: ignore[union-attr]
    d0 = reg.workers["d0"]
    reg.register(
        RegisterRequest(
            worker_id="d0",
            role="decode",
            url=d0.url,
            pid=d0.pid,
            fingerprint={},
            max_model_len=64,
            decode_warmup=DecodeWarmup(batch=9, steps=4, ms=90.0, ms_batch1=10.0),
        )
    )
    reg.workers["d0"].inflight = 2
    clock.t += 1.0  # past the refresh interval
    d = adm.decide(128, Slo())
    # the first release: holder 0's 63 tokens left at 20 ms (holder 1, still in its prefill: its 128 prompt tokens
    # at 0.5 ms, then 64 tokens, later)
    assert d.route == "primary" and d.predicted_parts[0] == pytest.approx(63 * 0.02)
    assert adm.status()["model"]["room_prior"]["tpot_source"] == "prior" and adm.model.room_source == "prior"
    adm.tpot_ewma_s = 0.2  # a request ended: its measured TPOT replaces the start-up step
    clock.t += 1.0
    adm.decide(128, Slo())
    assert w.tpot_source == "ended" and w.tpot_s == pytest.approx(0.2)


def test_a_decode_warmup_on_the_wire_is_validated():
    base = {"worker_id": "d0", "role": "decode", "url": "http://x", "pid": 1, "fingerprint": {}, "max_model_len": 64}
    ok = RegisterRequest.model_validate(
        {**base, "decode_warmup": {"batch": 8, "steps": 4, "ms": 12.5, "ms_batch1": 3.0}}
    )
    assert ok.decode_warmup is not None and ok.decode_warmup.ms == 12.5
    good = {"batch": 8, "steps": 4, "ms": 1.0, "ms_batch1": 1.0}
    for bad in (
        {**good, "batch": 0},
        {**good, "ms": 0.0},
        {**good, "ms_batch1": float("nan")},
        {"batch": 8, "steps": 4},
    ):
        with pytest.raises(ValueError, match="decode_warmup"):
            RegisterRequest.model_validate({**base, "decode_warmup": bad})


def test_a_request_of_several_choices_holds_a_slot_per_choice_in_the_room_prior():
    # 4 decode slots: one request of n=3 (3 slots, 10 tokens each) and one of 1 slot (40 tokens), all decoding at
    # 0.1 s per token with two tokens out. The 1st to 3rd releases are the n=3 request's (8 tokens left), the 4th
    # the other's (38 left); counted as one holder, its 3 slots looked like 1 and the 2nd release came at 3.8 s
    adm, clock, reg, _ = _admission_with_prior(slots=4)
    adm.model.room_prior.clock = clock
    three = adm.admit(128, adm.decide(128, Slo()), max_tokens=10, slots=3)
    one = adm.admit(128, adm.decide(128, Slo()), max_tokens=40)
    clock.t += 1.0
    for t in (three, one):
        adm.model.room_granted(t.phases, 0.0, 0)
        t.placed_at = clock.t - 1.0
        t.first_token(0.5)
        t.first_at, t.streamed = clock.t - 0.1, 2  # two tokens, 0.1 s apart: the live TPOT
    reg.workers["d0"].inflight = 4
    prior = adm.model.room_prior
    assert prior.wait_s(1, 4) == pytest.approx(0.8) and prior.wait_s(3, 4) == pytest.approx(0.8)
    assert prior.wait_s(4, 4) == pytest.approx(3.8)
    # beyond the holders: one release every (slot-weighted mean max_tokens 17.5 x 0.1 s) / 4 slots
    assert prior.wait_s(5, 4) == pytest.approx(3.8 + 17.5 * 0.1 / 4)
    assert prior.terms()["holders"] == 4


def test_the_room_prior_yields_to_measured_releases():
    adm, clock, tickets, registry = _full_decode(4, [64] * 4, [11] * 4)
    p = adm.model
    assert adm.decide(128, Slo()).predicted_parts[0] == pytest.approx(53 * 0.1)
    p.slot_held(8.0)  # a request ended after holding its slot 8 s: Little's law replaces the prior
    assert p.room_source == "slot_held"
    assert adm.decide(128, Slo()).predicted_parts[0] == pytest.approx(8.0 / 4)
    p.room_granted(RequestPhases(), 1.5, 3)  # a request waited 1.5 s for 3 releases: measured waits win
    assert p.room_source == "waits" and adm.decide(128, Slo()).predicted_parts[0] == pytest.approx(0.5)
    assert 'distserve_ttft_model{term="room_prior_in_use"} 0.0' in generate_latest(registry).decode()


def test_a_gate_closed_by_kv_blocks_is_predicted_from_the_streams_ending_not_from_slot_releases():
    # 4 of 8 slots held, but the decode worker's KV pool refused a reservation: room comes back when a stream ends
    # and frees its blocks. Before: predicted as slot releases at the slot-held pace over all 8 slots (on ShareGPT
    # on SmolLM2, waits of 22-29 s predicted 0.1-0.9 s, 2026-12-07)
    adm, clock, tickets, _ = _full_decode(8, [64] * 4, [11] * 4)
    d0 = adm.model.room.registry.workers["d0"]
    d0.inflight = 4
    p = adm.model
    p.slot_held(8.0)  # measured: a slot held 8 s, so one release every second over 8 slots
    assert adm.decide(128, Slo()).predicted_parts[0] == 0.0  # slots free, no KV shortage: no wait
    d0.status = d0.status.model_copy(update={"num_kv_blocked": 1})
    assert adm.model.room.kv_bound() and adm.model.room.releases_needed(0) == 2  # the refused one, then this one
    # the 2nd stream to end: 53 tokens left at 0.1 s each (as slot releases: 2 x 1 s)
    assert adm.decide(128, Slo()).predicted_parts[0] == pytest.approx(53 * 0.1)
    p.room_granted(RequestPhases(), 20.0, 2)  # measured waits slower than the streams say: never below them
    assert adm.decide(128, Slo()).predicted_parts[0] == pytest.approx(2 * 10.0)
    d0.status = d0.status.model_copy(update={"num_kv_blocked": 0})  # blocks free again: the slot pace
    assert not adm.model.room.kv_bound() and adm.decide(128, Slo()).predicted_parts[0] == 0.0


def test_the_room_prior_is_pessimistic_and_never_admits_blind():
    # streams bounded at 64 tokens that will stop at 30 (EOS): the prior counts to 64, so its wait is at least
    # the real one and at most what max_tokens allows
    tpot = 0.1
    adm, clock, tickets, _ = _full_decode(4, [64] * 4, [11, 12, 13, 14], tpot)
    d = adm.decide(128, Slo())
    predicted = d.predicted_parts[0]
    real = (30 - 14) * tpot  # the holder furthest on stops first
    assert real <= predicted <= (64 - 14) * tpot + 1e-9
    adm.admit(128, d, max_tokens=64)  # queued behind the full decode: the next one is judged
    # a wait the prior puts past the SLO is shed with its prediction (the 2nd release), not admitted blind
    d = adm.decide(128, Slo(ttft_s=1.0))
    assert (d.route, d.reason) == ("shed", "slo_ttft") and d.predicted_ttft_s >= (64 - 13) * tpot


def test_holders_still_in_their_prefill_are_counted_from_its_end_in_admission_order():
    # a burst took every slot and most of it is still waiting for its prefill (first come first served): each
    # is released after the prompt tokens of the waiting holders up to it (0.5 ms each, the prefill prior),
    # then its tokens at the TPOT the one decoding measures (0.1 s)
    adm, clock, tickets, _ = _full_decode(4, [64] * 4, [11, 0, 0, 0])
    rp = adm.model.room_prior
    assert [rp.wait_s(k, 4) for k in (1, 2, 3, 4)] == pytest.approx(
        [53 * 0.1, 128 * 0.5e-3 + 6.4, 256 * 0.5e-3 + 6.4, 384 * 0.5e-3 + 6.4]
    )


def test_under_shortest_first_a_prompt_that_would_make_a_queued_request_miss_its_slo_is_refused(monkeypatch):
    """A queued request was admitted on a prediction that did not know of the shorter prompts arriving after it,
    which the prefill worker serves first. Each such prompt takes its work off the queued request's slack; one that
    would push it past its TTFT SLO is refused (its own SLO miss), so admitted requests keep their promise. Before:
    ShareGPT on SmolLM2 with a 30 s SLO, 37 of 104 admitted requests late, TTFT P99 135 s (2026-12-07)."""
    from dataclasses import replace

    from distserve.server.router import admission as admission_module

    now = [1000.0]
    monkeypatch.setattr(admission_module, "time", SimpleNamespace(perf_counter=lambda: now[0], time=lambda: 0.0))
    wfs, _, _, _ = _admission_with_prior(shortest_first=True)  # the prior: 0.5 ms per prompt token
    wfs.model.ratios.extend([1.0] * MARGIN_MIN_SAMPLES)  # a margin measured at 1: the slack is SLO - prediction
    long = wfs.admit(2000, wfs.decide(2000, Slo(ttft_s=1.2)))  # predicted 1.0 s: 0.2 s to spare
    assert long.slack_s == pytest.approx(0.2)
    d = wfs.decide(200, Slo())  # goes first: 0.1 s more for the long one, which still meets its SLO
    assert (d.route, d.reason, d.overtakes_s) == ("primary", "ok", pytest.approx(0.1))
    wfs.admit(200, d)
    assert long.slack_s == pytest.approx(0.1)
    d = wfs.decide(300, Slo())  # 0.15 s more would make it late
    assert (d.route, d.reason) == ("shed", "slo_ttft_overtakes") and d.retry_after_s >= 1
    assert "ahead of queued requests" in d.message
    assert wfs.decide(300, Slo(on_miss="backup")).route == "backup"
    assert (wfs.decide(300, Slo(on_miss="queue")).route, wfs.decide(300, Slo(on_miss="queue")).reason) == (
        "primary",
        "slo_ttft_overtakes_queued",
    )
    assert wfs.decide(300, Slo(), protect=False).route == "primary"  # the early refusal's one-token question
    # a prompt the order puts after it costs it nothing; nor does any prompt once it has its first token
    assert (wfs.decide(2500, Slo()).route, wfs.decide(2500, Slo()).overtakes_s) == ("primary", 0.0)
    now[0] += 0.5  # aging: half a second on, a 300-token prompt still goes before it (300 + 500 < 2000)
    assert wfs.decide(300, Slo()).reason == "slo_ttft_overtakes"
    long.first_token(0.9)
    assert wfs.decide(300, Slo()).route == "primary"
    # a request admitted already predicted late (queue on miss) is not protected: refusing others cannot save it
    late = wfs.admit(3000, wfs.decide(3000, Slo(ttft_s=0.1, on_miss="queue")))
    assert late.slack_s is not None and late.slack_s < 0
    assert wfs.decide(300, Slo()).route == "primary"
    # the guard is the operator's choice (router.admission.protect_admitted), and arrival order has no overtaking
    late.done()
    guarded = wfs.admit(2000, wfs.decide(2000, Slo(ttft_s=1.2)))
    assert wfs.decide(1000, Slo()).reason == "slo_ttft_overtakes"
    wfs.cfg = replace(wfs.cfg, protect_admitted=False)
    assert wfs.decide(1000, Slo()).route == "primary"
    fcfs, _, _, _ = _admission_with_prior()
    fcfs.admit(2000, fcfs.decide(2000, Slo(ttft_s=1.0001)))
    assert fcfs.decide(10, Slo()).route == "primary"
    guarded.done()
    # prompts of one length arrive in order: nothing is overtaken, however little slack is left. A later prompt
    # that only shares a queued one's step is the first-come-first-served case the measured cost per token already
    # holds (charging it shed 24 % of the 7B open loop's requests at 1x capacity on an H100)
    eq, _, _, _ = _admission_with_prior(shortest_first=True)
    eq.model.ratios.extend([1.0] * MARGIN_MIN_SAMPLES)
    eq.admit(128, eq.decide(128, Slo()))
    tight = eq.admit(128, eq.decide(128, Slo(ttft_s=0.1281)))  # 128 tokens ahead of it: 0.1 ms to spare
    assert tight.slack_s is not None and 0 <= tight.slack_s < 0.001
    now[0] += 0.001
    assert (eq.decide(128, Slo()).route, eq.decide(128, Slo()).overtakes_s) == ("primary", 0.0)
    assert eq.decide(3000, Slo()).route == "primary"  # longer: after it
    assert eq.decide(100, Slo()).reason == "slo_ttft_overtakes"  # shorter: ahead of it
