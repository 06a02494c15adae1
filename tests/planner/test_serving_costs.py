"""The serving-path costs the simulator models beyond the engine's steps, each against a closed form. The replays
of recorded H200 runs against what those runs measured are a bench study (``python -m bench run
planner-replay-check``, bench/planner/replay_check.py): they read recorded runs, which tests do not."""

from __future__ import annotations

import math

from distserve.planner.latency import LatencyModel
from distserve.planner.layouts import EngineLimits, Layout
from distserve.planner.simulator import Simulator


def model(fixed_d: float, fixed_p: float, per_tok: float = 0.0, per_seq: float = 0.0) -> LatencyModel:
    return LatencyModel(fixed_d, per_tok, 0.0, fixed_p, per_seq, 0.0, 0.0, 0.0, {})


def test_a_mixed_step_pays_the_larger_fixed_part_once_and_both_variable_parts():
    m = model(fixed_d=9.0, fixed_p=4.0, per_tok=0.02, per_seq=0.5)
    pf, dc = m.prefill_ms([2048]), m.decode_ms(10, 0)
    mixed = m.step_ms([(2048, 0)], 10, 0)
    assert math.isclose(mixed, 9.0 + 0.02 * 2048 + 0.5 * 10)
    assert pf < mixed < pf + dc  # decodes are not free in a mixed step, and one fixed part is shared


def test_colocated_decodes_stall_for_the_whole_mixed_step():
    # A decodes alone; B's prompt arrives: the step that prefills B also decodes A and takes the mixed time
    m = model(fixed_d=9.0, fixed_p=4.0, per_tok=0.02, per_seq=0.5)
    lim = EngineLimits(8, 4096)
    sim = Simulator(m, Layout("colocated", 0, 1, lim, lim), kv_bytes_per_token=0)
    res = sim.run([(0.0, 16, 40), (30.0, 2048, 2)])
    a, b = res.latencies
    decode_a = 9.0 + 0.5  # one decode step of A alone
    mixed = m.step_ms([(2048, 0)], 1, 0)
    prefill_a = m.prefill_ms([16])
    # A: 39 decode gaps: the mixed step that prefills B, the step that also decodes B's last token, 37 alone
    assert math.isclose(a["tpot"] * 39, 37 * decode_a + mixed + (9.0 + 2 * 0.5), rel_tol=1e-9)
    assert b["ttft"] > mixed
    assert prefill_a < decode_a  # sanity: the short prefill is cheaper than a decode step here


def test_the_handoff_spans_steps_of_a_busy_decode_worker_and_none_of_an_idle_one():
    m = LatencyModel(10.0, 0.0, 0.0, 5.0, 0.0, 0.0, 2.0, 0.0, {})  # decode step 10 ms, prefill 5, pull 2
    lim = EngineLimits(64, 4096)
    lay = Layout("disaggregated", 1, 1, lim, lim)
    idle = Simulator(m, lay, 1, handoff_ms=3.0, handoff_steps=4).run([(0.0, 64, 2)]).latencies[0]
    assert math.isclose(idle["e2el"] - idle["ttft"], 3.0 + 2.0 + 10.0)  # hand-off, pull, one step
    # B is handed over while A keeps the decode worker busy: B joins only after 4 more step ends
    busy = Simulator(m, lay, 1, handoff_ms=3.0, handoff_steps=4).run([(0.0, 64, 200), (103.0, 64, 2)])
    b = busy.latencies[1]  # KV in at 113 ms, mid-step: joins at the 4th step end (150), its token at 160
    assert math.isclose(b["e2el"] - b["ttft"], 160.0 - 108.0)


def test_a_busy_worker_admits_a_new_request_after_admit_steps_step_ends():
    m = model(fixed_d=10.0, fixed_p=10.0)
    lim = EngineLimits(8, 4096)
    lay = Layout("colocated", 0, 1, lim, lim)
    reqs = [(0.0, 16, 100), (25.0, 16, 2)]  # B arrives 5 ms into A's third step
    now = Simulator(m, lay, 0, admit_steps=1).run(reqs).latencies[1]
    later = Simulator(m, lay, 0, admit_steps=3).run(reqs).latencies[1]
    assert math.isclose(now["ttft"], 5.0 + 10.0)  # the rest of the step, then B's (mixed) step
    assert math.isclose(later["ttft"], now["ttft"] + 2 * 10.0)
