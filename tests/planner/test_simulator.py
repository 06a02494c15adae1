"""The simulator against closed forms: an M/D/1 queue (Poisson arrivals, one server, fixed service time) and
one decode batch stepped to the end."""

from __future__ import annotations

import math

from distserve.planner.latency import LatencyModel
from distserve.planner.layouts import EngineLimits, Layout
from distserve.planner.simulator import Simulator, poisson_arrivals, simulate


def model(fixed=0.0, per_tok=0.0, per_tok2=0.0, per_seq=0.0, per_ctx=0.0, kv_fixed=0.0, kv_per_byte=0.0):
    return LatencyModel(fixed, per_tok, per_tok2, fixed, per_seq, per_ctx, kv_fixed, kv_per_byte, {})


def colocated(max_seqs=256, budget=1 << 20, replicas=1) -> Layout:
    lim = EngineLimits(max_seqs, budget)
    return Layout("colocated", 0, replicas, lim, lim)


def test_md1_mean_wait_matches_pollaczek_khinchine():
    # one prompt per step (budget = prompt length), service S = 10 ms, output 1 token: TTFT = wait + S
    service, prompt = 10.0, 64
    m = model(fixed=service)
    for rho in (0.5, 0.8):
        rate = rho / service * 1000  # req/s
        n = 40_000
        res = simulate(m, colocated(budget=prompt), [(prompt, 1)] * n, rate, kv_bytes_per_token=0, seed=3)
        mean_ttft = sum(r["ttft"] for r in res.latencies) / n
        expected = service + rho * service / (2 * (1 - rho))  # M/D/1 mean wait + service
        assert math.isclose(mean_ttft, expected, rel_tol=0.04), (rho, mean_ttft, expected)


def test_single_decode_batch_matches_sum_of_steps():
    b, prompt, out = 16, 100, 33
    m = model(fixed=2.0, per_tok=0.01, per_seq=0.05, per_ctx=0.001)
    res = Simulator(m, colocated(), kv_bytes_per_token=0).run([(0.0, prompt, out)] * b)
    prefill = 2.0 + 0.01 * b * prompt  # all prompts in the first step
    decode_steps = [2.0 + 0.05 * b + 0.001 * b * (prompt + k) for k in range(1, out)]
    for r in res.latencies:
        assert math.isclose(r["ttft"], prefill, rel_tol=1e-9)
        assert math.isclose(r["tpot"], sum(decode_steps) / (out - 1), rel_tol=0.01)


def test_disaggregated_adds_the_kv_pull_and_waits_a_step_when_busy():
    # one request alone: TTFT = prefill; the decode side starts after the pull
    m = model(fixed=1.0, per_tok=0.1, kv_fixed=5.0, kv_per_byte=0.001)
    lim = EngineLimits(64, 4096)
    lay = Layout("disaggregated", 1, 1, lim, lim)
    res = Simulator(m, lay, kv_bytes_per_token=10).run([(0.0, 50, 3)])
    r = res.latencies[0]
    assert math.isclose(r["ttft"], 1.0 + 5.0)
    assert math.isclose(r["e2el"], 6.0 + (5.0 + 0.5) + 2 * 1.0)
    # two at once, one prompt per step: the first reply leaves only after the second step
    lim1 = EngineLimits(64, 50)
    res = Simulator(m, Layout("disaggregated", 1, 1, lim1, lim1), kv_bytes_per_token=10).run([(0.0, 50, 2)] * 2)
    assert sorted(x["ttft"] for x in res.latencies) == [12.0, 12.0]


def test_a_decode_batch_never_exceeds_max_num_seqs_while_hand_offs_join():
    # a decode-bound load whose hand-offs wait in the worker's handler for a step (handoff_steps): a request
    # there holds its slot (the engine's reservation does) — before, it was counted nowhere and the decode
    # worker ran batches above its limit (mean 152 of at most 128 in a ShareGPT-shaped plan)
    m = model(fixed=1.0, per_tok=0.001, per_seq=0.2, kv_fixed=1.0)
    lim = EngineLimits(8, 4096)
    lay = Layout("disaggregated", 1, 1, lim, lim)
    sim = Simulator(m, lay, kv_bytes_per_token=0, handoff_steps=2)
    most = 0
    start = sim._start_step

    def counting(w):
        nonlocal most
        start(w)
        if w.role == "decode":
            most = max(most, len(w.running))

    sim._start_step = counting  # type: ignore[method-assign]
    arrivals = poisson_arrivals(400, 200.0, seed=1)
    res = sim.run([(a, 16, 64) for a in arrivals])
    assert len(res.latencies) == 400
    assert 0 < most <= 8 and res.mean_batch["decode"] <= 8


def test_router_spreads_over_replicas_and_more_replicas_serve_more():
    m = model(fixed=10.0)
    lengths = [(64, 1)] * 2000
    one = simulate(m, colocated(budget=64), lengths, 90.0, 0)  # rho 0.9 on one replica
    two = simulate(m, colocated(budget=64, replicas=2), lengths, 90.0, 0)
    mean = lambda res: sum(r["ttft"] for r in res.latencies) / len(res.latencies)  # noqa: E731
    assert mean(two) < mean(one) / 2


def test_poisson_arrivals_have_the_rate():
    a = poisson_arrivals(20_000, 50.0, seed=1)
    assert math.isclose(len(a) / (a[-1] / 1000), 50.0, rel_tol=0.03)
