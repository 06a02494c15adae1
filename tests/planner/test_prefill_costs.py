"""The prefill step's host floor, per-sequence and chunked-continuation costs (planner.latency) and the engine
thread's reply timing: each against a closed form through the simulator's own scheduling (budget, chunking),
and the shipped H200 profile's constants (fitted to recorded runs by bench/planner/h200_profile.py; the replays of
those runs are the bench study ``planner-replay-check``).
"""

from __future__ import annotations

import json
import math

import pytest

from distserve.planner.latency import LatencyModel
from distserve.planner.layouts import EngineLimits, Layout
from distserve.planner.profile import ProfileError, from_dict
from distserve.planner.simulator import Simulator


def model(floor: float = 20.0, per_seq: float = 6.0, chunk: float = 25.0) -> LatencyModel:
    # GPU work: 1 ms fixed + 0.01 ms per token; decode 2 ms per step
    return LatencyModel(2.0, 0.01, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, {}, floor, per_seq, chunk)


def test_a_prefill_step_is_the_larger_of_its_host_side_and_its_gpu_work():
    m = model()
    assert math.isclose(m.prefill_ms([100]), 20.0)  # host floor: GPU work would be 2 ms
    assert math.isclose(m.prefill_ms([100] * 4), 20.0 + 3 * 6.0)  # each further sequence adds host work
    assert math.isclose(m.prefill_ms([4000]), 41.0)  # GPU-bound: the host side runs hidden behind it
    assert math.isclose(m.prefill_ms([2000, 2000]), max(1.0 + 40.0, 26.0))
    # a chunked continuation (tokens computed before it) pays its attention path on top
    assert math.isclose(m.step_ms([(1000, 3096)], 0, 0), 20.0 + 25.0)
    # a colocated mixed step keeps its validated parts: no floor, per-sequence or continuation cost
    assert math.isclose(m.step_ms([(1000, 3096)], 4, 0), 2.0 + 10.0)
    without = model(per_seq=0.0, chunk=0.0)
    assert without.prefill_ms([100] * 4) < m.prefill_ms([100] * 4)


def test_the_simulator_chunks_at_the_token_budget_and_the_continuation_pays():
    # one 6 000-token prompt on a prefill worker with the server's budget (4 096): two steps, the second a
    # continuation of 1 904 tokens over 4 096 cached ones
    m = model()
    lim = EngineLimits(64, 4096, prefill_policy="wfs")
    lay = Layout("disaggregated", 1, 1, lim, lim)
    res = Simulator(m, lay, kv_bytes_per_token=0, reply_after_next_step=False).run([(0.0, 6000, 1)])
    first, second = 1.0 + 0.01 * 4096, max(1.0 + 0.01 * 1904, 20.0) + 25.0
    assert math.isclose(res.latencies[0]["ttft"], first + second)
    assert res.prefill_stats["continuations"] == 1 and res.prefill_stats["steps"] == 2
    # two 3 000-token prompts at once: the second is split (1 096 now, 1 904 next step as a continuation)
    res = Simulator(m, lay, kv_bytes_per_token=0, reply_after_next_step=False).run([(0.0, 3000, 1)] * 2)
    step1 = max(1.0 + 0.01 * 4096, 20.0 + 6.0)
    step2 = max(1.0 + 0.01 * 1904, 20.0) + 25.0
    assert sorted(x["ttft"] for x in res.latencies) == pytest.approx([step1, step1 + step2])


def test_with_the_engine_thread_a_reply_does_not_wait_for_the_next_step():
    m = model(per_seq=0.0, chunk=0.0)
    lim = EngineLimits(64, 100)  # one 100-token prompt per step
    lay = Layout("disaggregated", 1, 1, lim, lim)
    reqs = [(0.0, 100, 1)] * 2
    on = Simulator(m, lay, 0, reply_after_next_step=False).run(reqs).latencies
    off = Simulator(m, lay, 0, reply_after_next_step=True).run(reqs).latencies
    assert sorted(x["ttft"] for x in on) == [20.0, 40.0]
    assert sorted(x["ttft"] for x in off) == [40.0, 40.0]  # the first reply leaves after the second step


@pytest.fixture(scope="module")
def h200(h200_profile):
    return h200_profile


def test_the_prefill_workers_host_work_between_steps_delays_the_next_step_and_the_replies():
    m = model(per_seq=0.0, chunk=0.0)
    lim = EngineLimits(64, 100)  # one 100-token prompt per step: each step is the 20 ms floor
    lay = Layout("disaggregated", 1, 1, lim, lim)
    reqs = [(0.0, 100, 1)] * 3
    plain = Simulator(m, lay, 0, reply_after_next_step=False).run(reqs)
    post = Simulator(m, lay, 0, reply_after_next_step=False, prefill_post_ms=5.0).run(reqs)
    assert sorted(x["ttft"] for x in plain.latencies) == [20.0, 40.0, 60.0]
    assert sorted(x["ttft"] for x in post.latencies) == [25.0, 50.0, 75.0]
    assert post.prefill_stats["post_ms"] == 15.0 and post.prefill_stats["busy_ms"] == plain.prefill_stats["busy_ms"]


def test_h200_prefill_costs_are_fitted_and_labelled(h200):
    assert h200.engine_thread
    for key in ("prefill_floor_ms", "prefill_per_seq_ms", "prefill_chunk_ms", "prefill_post_ms"):
        assert getattr(h200, key) > 0, key
        assert h200.cost_origins[key].split(":")[0] in ("measured", "derived"), key
    # the 1P1D prefill worker of today's code, 128-token prompts, 1.2-5 per step: 17.8 ms + 3.6 per further one
    assert 12 < h200.prefill_floor_ms < 25
    assert 1 < h200.prefill_per_seq_ms < 8
    assert 20 < h200.prefill_chunk_ms < 35  # 864 us math SDPA x 32 layers
    assert 0.5 < h200.prefill_post_ms < 3  # wall - in steps - idle: 1.07-1.34 ms per prompt over 16 points
    d = json.loads(json.dumps(h200.to_dict()))
    assert from_dict(d) == h200
    d["cost_origins"] = {"prefill_chunk_ms": "guessed: from nowhere"}
    with pytest.raises(ProfileError, match="cost_origins"):
        from_dict(d)
    d = json.loads(json.dumps(h200.to_dict()))
    d["engine_thread"] = "yes"
    with pytest.raises(ProfileError, match="engine_thread"):
        from_dict(d)
