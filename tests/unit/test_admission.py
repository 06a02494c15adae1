"""Admission decisions, the live TTFT model, rate-limited logs and the heartbeat thread's wedge rule
Pure: no server start-up, no engine."""

from __future__ import annotations

import logging
import time

import pytest
from prometheus_client import CollectorRegistry

from distserve.server.config import load_config
from distserve.server.latency_model import prefill_work_ms, queued_ttft_ms
from distserve.server.lograte import RateLimitedLog, describe
from distserve.server.router.admission import Admission, InvalidSlo, Slo, parse_slo
from distserve.server.router.ttft_predictor import MARGIN_COLD, RequestPhases, TtftPredictor
from distserve.server.workers.heartbeat import Liveness


def _admission(**adm) -> Admission:
    cfg = load_config(overrides={"router": {"admission": adm}}) if adm else load_config()
    return Admission(cfg, CollectorRegistry(), lambda: 1)


def test_the_ttft_model_recovers_fixed_and_per_token_cost():
    m = TtftPredictor(load_config(), lambda: 1)
    assert m.predict_s(100) is None  # no measurement yet: no prediction, never a guess
    for tokens in range(100, 2100, 100):  # admission alone (no pipeline): the whole TTFT is the prefill call
        m.measured(RequestPhases(), tokens, (0.0, 0.0), (20.0 + 0.5 * tokens) / 1000.0)  # 20 ms + 0.5 ms/token
    t = m.terms()
    assert t["per_call_ms"] + t["per_step_ms"] == pytest.approx(20.0, abs=1e-6)  # one step each: one fixed part
    assert t["per_token_ms"] == pytest.approx(0.5, abs=1e-9)
    assert m.predict_s(100, (900.0, 1.0)) == pytest.approx((20.0 + 0.5 * 1000) / 1000.0)


def test_one_prefill_formula_for_planner_and_router():
    assert prefill_work_ms([(10, 0), (5, 10)], 2.0, 0.1) == pytest.approx(2 * 15 + 0.1 * (100 + (225 - 100)))
    assert queued_ttft_ms(300, 100, 5.0, 0.5) == pytest.approx(5.0 + 0.5 * 400)


def test_queue_bounds_shed_and_release():
    a = _admission(max_queued_requests=2, max_inflight_requests=3, max_queued_prefill_tokens=1000)
    t1 = a.admit(100, a.decide(100, Slo()))
    t2 = a.admit(100, a.decide(100, Slo()))
    d = a.decide(100, Slo())
    assert (d.route, d.reason) == ("shed", "max_queued_requests") and d.retry_after_s >= 1
    t1.first_token(0.1)
    assert a.decide(901, Slo()).reason == "max_queued_prefill_tokens"  # 100 queued + 901 > 1000
    t3 = a.admit(100, a.decide(100, Slo()))
    assert a.decide(10, Slo()).reason == "max_inflight_requests"
    for t in (t1, t2, t3, t3):  # released once, however often done() is called
        t.done()
    assert (a.inflight, a.queued_requests, a.queued_tokens) == (0, 0, 0)


def test_slo_miss_sheds_queues_or_routes_to_backup_and_the_error_is_measured():
    a = _admission(on_slo_miss="backup")
    for tokens in range(100, 1100, 100):
        t = a.admit(tokens, a.decide(tokens, Slo()))
        t.first_token((10.0 + 1.0 * tokens) / 1000.0)
        t.done(0.02)
    slo = parse_slo({"x-slo-ttft-ms": "50"}, 0.0, 0.0, a.cfg.on_slo_miss)
    # nothing queued: admitted whatever the prediction (shedding cannot help; it is the next measurement)
    assert a.decide(500, slo).route == "primary"
    a.admit(100, a.decide(100, Slo()))  # one request waiting for its first token
    d = a.decide(500, slo)  # predicted 10 + (100 + 500) ms > 50 ms
    assert (d.route, d.reason) == ("backup", "slo_ttft") and d.predicted_ttft_s == pytest.approx(0.61)
    assert a.decide(500, Slo(0.05, None, "shed")).route == "shed"
    assert a.decide(500, Slo(0.05, None, "queue")).route == "primary"
    assert a.decide(20, Slo(1.0, None, "shed")).route == "primary"
    assert a.decide(20, Slo(None, 0.001, "shed")).reason == "slo_tpot"  # measured TPOT 20 ms > 1 ms
    assert a.status()["prediction_error"]["samples"] >= 1


def test_a_tpot_slo_is_judged_while_streams_decode_even_with_nothing_queued():
    """The "nothing queued: admit whatever the prediction" rule is the TTFT model's (an admitted request is its next
    measurement); a TPOT SLO is about the decode batch the request joins. Before: a request with
    ``x-slo-tpot-ms: 1`` was admitted, its SLO ignored, whenever no other request waited for a first token, however
    many streams were decoding at 20 ms per token."""
    a = _admission()
    for tokens in range(100, 1100, 100):
        t = a.admit(tokens, a.decide(tokens, Slo()))
        t.first_token((10.0 + 1.0 * tokens) / 1000.0)
        t.done(0.02)  # measured TPOT 20 ms
    slo = Slo(None, 0.001, "shed")
    assert a.decide(100, slo).route == "primary"  # nothing in flight: no batch to join (and a fresh TPOT sample)
    decoding = a.admit(100, a.decide(100, Slo()))
    decoding.first_token(0.11)  # one stream decoding, nothing queued
    assert a.queued_requests == 0 and a.inflight == 1
    d = a.decide(100, slo)
    assert (d.route, d.reason) == ("shed", "slo_tpot") and "predicted TPOT 20.0 ms > SLO 1 ms" in d.message, d
    assert a.decide(100, Slo(None, 0.001, "queue")).reason == "slo_tpot_queued"
    assert a.decide(100, Slo(None, 0.05, "shed")).route == "primary"  # an SLO the batch meets
    decoding.done(0.02)


def test_an_slo_is_judged_on_the_late_tail_of_the_prediction_once_it_is_measured():
    a = _admission()
    for tokens in range(100, 1100, 100):  # 10 ms + 1 ms per token, measured with nothing queued
        t = a.admit(tokens, a.decide(tokens, Slo()))
        t.first_token((10.0 + 1.0 * tokens) / 1000.0)
        t.done()
    # nothing judged yet: the cold margin, the least any kept run settled at (the prediction taken as a bound
    # let a ShareGPT burst fill each request's slack to the SLO exactly)
    assert a.model.slo_margin() == MARGIN_COLD == 1.5 and not a.model.ratios
    held = a.admit(100, a.decide(100, Slo()))  # one request queued: the following ones are judged
    slo = Slo(0.5, None, "shed")
    assert a.decide(300, Slo(0.62, None, "shed")).route == "primary"  # predicted (10 + 400 ms) x 1.5 < 620 ms
    assert a.decide(300, slo).reason == "slo_ttft"  # ... > 500 ms
    t = a.admit(300, a.decide(300, Slo()))
    t.first_token(t.predicted_ttft_s * 3.0)  # a judged request: its measured / predicted is kept
    t.done()
    assert list(a.model.ratios) == [pytest.approx(3.0)]
    a.model.ratios.clear()
    for _ in range(19):  # judged requests came in 1.5 x as late as predicted (a slower machine), one 3 x
        a.model.judged(0.4, 0.6)
    a.model.judged(0.4, 1.2)
    assert a.model.slo_margin() == pytest.approx(1.5)  # the P95 of measured / predicted: 19 of 20
    d = a.decide(300, slo)
    assert d.predicted_ttft_s * 1.5 > 0.5 and (d.route, d.reason) == ("shed", "slo_ttft") and "x 1.50" in d.message
    assert a.decide(100, slo).route == "primary"  # 210 ms x 1.5 < 500 ms
    assert a.status()["model"]["slo_margin"] == pytest.approx(1.5)
    for _ in range(256):
        a.model.judged(0.1, 10.0)
    assert a.model.slo_margin() == 4.0  # bounded: a margin that sheds all but an idle server's requests
    held.done()


def test_slo_headers_are_validated_and_fall_back_to_the_config_defaults():
    assert parse_slo({}, 250.0, 0.0, "shed") == Slo(0.25, None, "shed")
    assert parse_slo({"x-slo-tpot-ms": "40", "x-slo-on-miss": "queue"}, 0.0, 0.0, "shed") == Slo(None, 0.04, "queue")
    for headers, name in (
        ({"x-slo-ttft-ms": "fast"}, "x-slo-ttft-ms"),
        ({"x-slo-tpot-ms": "-1"}, "x-slo-tpot-ms"),
        ({"x-slo-ttft-ms": "nan"}, "x-slo-ttft-ms"),
        ({"x-slo-on-miss": "drop"}, "x-slo-on-miss"),
    ):
        with pytest.raises(InvalidSlo) as e:
            parse_slo(headers, 0.0, 0.0, "shed")
        assert e.value.header == name


def test_rate_limited_log_writes_one_line_per_cause_then_a_summary(caplog):
    now = [0.0]
    rl = RateLimitedLog(logging.getLogger("t"), period_s=5.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, "t"):
        for i in range(100):
            rl.warning("prefill failed on p0", "request %d failed", i)
        rl.warning("other cause", "different")
        now[0] = 6.0
        rl.flush()
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["request 0 failed", "different", "prefill failed on p0: 99 more like this in the last 6.0 s"]
    assert describe(TimeoutError()) == "TimeoutError" and describe(OSError("refused")) == "OSError: refused"


def test_liveness_tells_a_long_step_from_a_wedged_loop():
    class Loop:
        step_started = step_ended = 0.0

    loop = Loop()
    live = Liveness(loop, wedged_after_s=10.0, max_step_s=600.0)  # type: ignore[arg-type]
    live.loop_tick = 100.0
    assert live.wedged(105.0) is None
    assert "unresponsive for 11.0 s" in (live.wedged(111.0) or "")
    loop.step_started = 101.0  # inside one long step: alive, however long the loop has not ticked
    assert live.wedged(400.0) is None
    assert "step has run for" in (live.wedged(702.0) or "")


def test_a_worker_that_cannot_reach_its_router_says_so_with_the_error(caplog):
    import socket
    import threading

    from distserve.server.wire import RegisterRequest, WorkerStatus
    from distserve.server.workers.heartbeat import HeartbeatOptions, HeartbeatThread

    with socket.socket() as s:  # a port nothing listens on: a typo in --router
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    reg = RegisterRequest(
        worker_id="p0", role="prefill", url="http://127.0.0.1:1", pid=1, fingerprint={}, max_model_len=8
    )
    stop = threading.Event()
    hb = HeartbeatThread(
        HeartbeatOptions(f"http://127.0.0.1:{port}", "t", 0.05, "prefill"), reg, WorkerStatus, stop.is_set, print
    )
    with caplog.at_level(logging.WARNING, "distserve.server.workers.heartbeat"):
        hb.start()
        deadline = time.monotonic() + 10
        while not any("cannot register" in r.getMessage() for r in caplog.records) and time.monotonic() < deadline:
            time.sleep(0.05)
        stop.set()
        hb.join(5)
    lines = [r.getMessage() for r in caplog.records if "cannot register" in r.getMessage()]
    assert lines and f"127.0.0.1:{port}" in lines[0] and "retrying" in lines[0]
    assert "Error" in lines[0]  # the error's type is named: ClientConnectorError ..., never an empty reason
    assert len(lines) == 1  # repeated every 5 s, not every 50 ms attempt
